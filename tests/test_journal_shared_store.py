"""Sessions that name the same SQLite file share one store (one writer, one group commit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from trio_agent import open_session
from trio_agent._journal._registry import shared_sqlite_store
from trio_agent.testing import Reply, TestModel


async def test_sessions_naming_one_file_share_one_store_and_the_last_closes_it(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model, journal=path) as first:
        async with open_session(provider=model, journal=str(tmp_path / "." / "j.db")) as second:
            assert first.journal.store is second.journal.store
            assert await second.send("hi") == "ok"
        # The first session's store is still open after the second left.
        assert await first.send("hi") == "ok"
    async with open_session(provider=model, journal=path) as third:
        assert third.journal.store is not first.journal.store


async def test_a_failed_open_reaches_every_waiting_user(tmp_path: Path) -> None:
    path = tmp_path / "not-a-journal.db"
    path.write_bytes(b"this is not a SQLite file at all" * 100)
    errors: list[BaseException] = []

    async def use() -> None:
        try:
            async with shared_sqlite_store(path):
                pass
        except Exception as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(use)
    assert len(errors) == 3


@pytest.mark.parametrize("sessions", [1000])
async def test_a_thousand_sessions_on_one_file_by_path_have_no_errors(tmp_path: Path, sessions: int) -> None:
    path = tmp_path / "load.db"
    model = TestModel(default=Reply(text="done"))
    answers: list[str] = []

    async def one(index: int) -> None:
        async with open_session(provider=model, journal=path, session_id=f"s{index}") as session:
            answers.append(await session.send(f"hello {index}"))

    async with trio.open_nursery() as nursery:
        for index in range(sessions):
            nursery.start_soon(one, index)
    assert answers == ["done"] * sessions


@pytest.mark.parametrize("bad", ["\ud800", "a/b", "tab\there", "", "x" * 201])
async def test_a_bad_session_id_is_refused_at_the_door(bad: str) -> None:
    from trio_agent import ConfigError

    with pytest.raises(ConfigError, match="session_id"):
        async with open_session(provider=TestModel(), session_id=bad):
            pass
