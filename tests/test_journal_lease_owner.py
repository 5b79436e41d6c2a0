"""A write is fenced by its lease's owner as well as its token.

A new session on a lane store (SQLite, PostgreSQL) takes its lease in the transaction of its
first write, with the token the acquisition will give it (1). If another owner opened the same
session id first, it holds token 1 too: the fence compared tokens only, so the first journal's
append was acknowledged although its acquisition in the same transaction was refused, two
owners writing under one token. Its batches now say whose lease they write under.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from trio_agent import LeaseLostError, StaleFencingTokenError
from trio_agent._journal._durable import open_journal
from trio_agent._journal._events import RequestAccepted, SessionCreated, place_event
from trio_agent._journal._sqlite import open_sqlite_store
from trio_agent._journal._store import AppendBatch, decide_append


def _created(session_id: str, token: int, owner: str | None) -> AppendBatch:
    stream = f"{session_id}/root"
    event = SessionCreated(session_id=session_id, agent_id="root", parent_agent_id=None)
    return AppendBatch(session_id, stream, token, [place_event(stream, 1, event, 1.0)], owner=owner)


def test_the_fence_refuses_a_token_held_by_another_owner_and_checks_no_owner_when_none_is_given() -> None:
    lease = ("b", 1, 100.0)
    with pytest.raises(StaleFencingTokenError, match="another owner"):
        decide_append(_created("s", 1, "a"), lease=lease, stream=None, command=None, now=1.0)
    assert decide_append(_created("s", 1, "b"), lease=lease, stream=None, command=None, now=1.0).first_seq == 1
    assert decide_append(_created("s", 1, None), lease=lease, stream=None, command=None, now=1.0).first_seq == 1


@asynccontextmanager
async def _sqlite(tmp_path: Path) -> AsyncIterator[Any]:
    async with open_sqlite_store(str(tmp_path / "journal.db")) as store:
        yield store


async def _second_owner_first(open_store: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
    async with open_store() as store:
        # As open_session does: session_created deferred, the lease taken with the first write.
        with pytest.raises(LeaseLostError):
            async with open_journal(store, snapshot_every=None).lend_body() as first:
                session_id = first.session_id
                assert first.held.pending
                async with open_journal(store, session_id=session_id, snapshot_every=None).lend_body() as second:
                    with pytest.raises(StaleFencingTokenError, match="another owner"):
                        await first.append(RequestAccepted(request_id="r", command_id="c", input={}))
                    assert first.held.lost is not None
                    assert await store.read(f"{session_id}/root") == []  # nothing of the first's
                    await second.append(RequestAccepted(request_id="r2", command_id="c2", input={}))
                    assert second.held.lost is None


async def test_a_new_sessions_first_write_after_another_owner_took_its_id_is_refused_sqlite(tmp_path: Path) -> None:
    await _second_owner_first(lambda: _sqlite(tmp_path))


async def test_a_new_sessions_first_write_after_another_owner_took_its_id_is_refused_postgres(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    from trio_agent._journal._postgres import open_postgres_store

    await _second_owner_first(lambda: open_postgres_store(postgres_dsn, schema=fresh_pg_schema))
