"""``python -m trio_agent journal show PATH [--session ID]`` in a real subprocess."""

from __future__ import annotations

import os
import random
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_agent import SideEffect, define_tool
from trio_agent._tools._definition import InterruptBehavior, ToolKind
from trio_agent.journal import ToolScheduled, ToolStarted, open_journal, open_sqlite_store
from trio_agent.testing import start_turn
from trio_agent.tools import CallOrigin, ToolCall, ToolPipeline

REQ: dict[str, Any] = {"request_id": "request", "turn_id": "turn"}


@define_tool(name="adder", description="Add two numbers.", input_schema={"type": "object"}, side_effect="pure")
async def adder(input: dict[str, Any], ctx: Any) -> int:
    return int(input["a"]) + int(input["b"])


@define_tool(name="breaker", description="Always fails.", input_schema={"type": "object"}, side_effect="idempotent")
async def breaker(input: dict[str, Any], ctx: Any) -> str:
    raise RuntimeError("the disk is on fire")


@define_tool(name="charge", description="Charge a card.", input_schema={"type": "object"}, side_effect="non_idempotent")
async def charge(input: dict[str, Any], ctx: Any) -> str:
    raise AssertionError("recovery never runs a tool")


TOOLS = [adder, breaker, charge]


async def build_journal(path: Path) -> None:
    async with open_sqlite_store(path) as store:
        async with open_journal(store, session_id="sess-a") as journal:
            origin = await start_turn(journal)
            pipeline = ToolPipeline(TOOLS, journal=journal)
            ok = await pipeline.execute(ToolCall("call-ok", "adder", {"a": 2, "b": 3}), origin)
            assert ok.result.output == 5
            bad = await pipeline.execute(ToolCall("call-bad", "breaker", {}), origin)
            assert not bad.result.ok
            # A non_idempotent call that started, then the process "crashed".
            await journal.append(
                ToolScheduled(
                    **REQ,
                    call_id="call-lost",
                    tool_name="charge",
                    model_input={"amount": 5},
                    side_effect=SideEffect.NON_IDEMPOTENT,
                    kind=ToolKind.EXECUTE,
                    interrupt=InterruptBehavior.BLOCK,
                    concurrency_safe=False,
                    idempotency_key="charge-key",
                ),
                ToolStarted(**REQ, call_id="call-lost", input={"amount": 5}, side_effect=SideEffect.NON_IDEMPOTENT),
            )
        async with open_journal(store, session_id="sess-a") as journal:
            report = await journal.recover(tools={tool.name: tool for tool in TOOLS})
            assert report.outcome_unknown == ("call-lost",)
        async with open_journal(store, session_id="sess-b") as journal:
            origin = await start_turn(journal, request_id="other-request", turn_id="other-turn")
            pipeline = ToolPipeline(TOOLS, journal=journal)
            await pipeline.execute(ToolCall("call-elsewhere", "adder", {"a": 1, "b": 1}), origin)
            assert origin == CallOrigin("sess-b", "root", "other-request", "other-turn")


@pytest.fixture(scope="module")
def journal_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "journal.db"
    trio.run(build_journal, path)
    return path


def show(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    return subprocess.run(
        [sys.executable, "-m", "trio_agent", "journal", "show", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def journal_content(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every journal table, read through a read-only connection."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
            for table in ("journal_meta", "journal_streams", "journal_events", "journal_leases", "journal_commands")
        }
    finally:
        conn.close()


def test_show_prints_calls_outcomes_durations_and_recovery(journal_path: Path) -> None:
    before_bytes = journal_path.read_bytes()
    before = journal_content(journal_path)
    assert len(before["journal_events"]) > 10
    done = show(journal_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    out = done.stdout
    assert "session sess-a" in out and "session sess-b" in out
    # The calls table: id, tool, side effect, outcome, duration, attempts.
    assert re.search(r"call-ok\s+adder\s+pure\s+completed\s+\d+\.\d ms\s+attempts 1", out), out
    assert re.search(r"call-bad\s+breaker\s+idempotent\s+failed\s+\d+\.\d ms\s+attempts 1", out), out
    assert re.search(r"call-lost\s+charge\s+non_idempotent\s+outcome_unknown\s+\d+\.\d ms\s+attempts 1", out), out
    assert "recovery: settle_outcome_unknown:" in out
    # The timeline.
    assert "call-ok completed: 5" in out
    assert "call-bad failed: Error: RuntimeError: the disk is on fire" in out
    assert "RECOVERY call-lost: settle_outcome_unknown" in out
    assert "call-lost OUTCOME UNKNOWN (no_reconcile)" in out
    assert "3 call(s): 1 completed, 1 failed, 1 outcome_unknown" in out
    # Read-only: the journal is untouched (its file and what it holds).
    assert journal_path.read_bytes() == before_bytes
    assert journal_content(journal_path) == before


def test_show_session_filters(journal_path: Path) -> None:
    done = show(journal_path, "--session", "sess-b")
    assert done.returncode == 0, done.stderr
    assert "session sess-b" in done.stdout and "call-elsewhere" in done.stdout
    assert "sess-a" not in done.stdout
    assert "call-ok" not in done.stdout and "call-lost" not in done.stdout


def test_show_unknown_session_fails(journal_path: Path) -> None:
    done = show(journal_path, "--session", "no-such-session")
    assert done.returncode == 1
    assert done.stdout == ""
    assert "error:" in done.stderr and "no-such-session" in done.stderr


def test_show_refuses_random_bytes_and_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "random.db"
    data = random.Random(1234).randbytes(8192)
    path.write_bytes(data)
    done = show(path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert "is not a readable trio_agent journal" in done.stderr
    assert "Traceback" not in done.stderr
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["random.db"]


def test_show_refuses_a_sqlite_file_that_is_not_a_journal(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes(text TEXT)")
        conn.execute("INSERT INTO notes VALUES ('keep me')")
    conn.close()
    data = path.read_bytes()
    done = show(path)
    assert done.returncode == 1
    assert "is not a readable trio_agent journal" in done.stderr
    assert "Traceback" not in done.stderr
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


def test_show_a_missing_path_fails_without_creating_it(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    done = show(path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert f"no journal at {path}" in done.stderr
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_show_reads_a_version_1_journal_without_migrating_it(tmp_path: Path) -> None:
    from test_journal_damage import write_v1_file

    path = tmp_path / "v1.db"
    write_v1_file(path, sessions=["old"], events=5)
    before = journal_content(path)
    done = show(path)
    assert done.returncode == 0, done.stderr
    assert "stream old/root (5 events)" in done.stdout
    assert journal_content(path) == before  # still version 1: only a write-open migrates
    assert before["journal_meta"] == [("format", "trio_agent.journal/1")]


def test_show_reports_a_row_that_fails_its_checksum(journal_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "damaged.db"
    path.write_bytes(journal_path.read_bytes())
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE journal_events SET body = replace(body, 'charge-key', 'charge-kez')"
            " WHERE stream_id = 'sess-a/root' AND body LIKE '%charge-key%'"
        )
        [(seq,)] = conn.execute(
            "SELECT seq FROM journal_events WHERE stream_id = 'sess-a/root' AND body LIKE '%charge-kez%'"
        ).fetchall()
    conn.close()
    done = show(path)
    assert done.returncode == 1
    assert f"sess-a/root#{seq} is corrupt: checksum mismatch" in done.stderr
    assert "Traceback" not in done.stderr
