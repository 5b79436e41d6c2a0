"""``python -m trio_agent journal show PATH [--session ID]`` in a real subprocess."""

from __future__ import annotations

import os
import random
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_agent import SideEffect, define_tool
from trio_agent._journal._events import (
    ConversationSeeded,
    EventEnvelope,
    InterruptsResolved,
    RequestAccepted,
    RequestStarted,
    RunPaused,
    SessionCreated,
)
from trio_agent._journal._store import AppendBatch, stream_id_for
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
    # The damage ends its own stream's timeline, shown up to it, and no other.
    out = done.stdout
    assert f"stream sess-a/root ({seq - 1} events, damaged at #{seq})" in out
    assert re.search(rf"^\s+{seq - 1}  .*$", out, re.MULTILINE), out
    assert f"damaged at #{seq}: stored event sess-a/root#{seq} is corrupt: checksum mismatch" in out
    assert "session sess-b" in out and "stream sess-b/root" in out


def test_show_describes_payloads_of_unexpected_shapes_without_crashing(tmp_path: Path) -> None:
    """Decodable events whose free-form payloads are not what the writer puts there."""
    path = tmp_path / "odd.db"

    async def write() -> None:
        stream = stream_id_for("odd", "root")
        events: list[Any] = [
            SessionCreated(session_id="odd", agent_id="root"),
            ConversationSeeded(session_id="odd", conversation={"messages": 5}),
            RequestAccepted(request_id="r1", command_id="c1", input={"prompt": ["not", "text"]}),
            RequestStarted(request_id="r1"),
            RunPaused(request_id="r1", state={"interrupts": 5}),
            InterruptsResolved(request_id="r1", continuation_id="k1", answers={"a": 5}),
        ]
        placed = [EventEnvelope(stream_id=stream, seq=i + 1, event=e, recorded_at=1.0) for i, e in enumerate(events)]
        async with open_sqlite_store(path) as store:
            lease = await store.acquire_lease("odd", "writer", 60.0)
            await store.append(AppendBatch("odd", stream, lease.token, placed))

    trio.run(write)
    done = show(path)
    assert done.returncode == 0, done.stderr
    assert "conversation seeded (its messages are int, not a list)" in done.stdout
    assert "request r1 paused (its interrupts are int, not a list)" in done.stdout
    assert "request r1 answered by k1" in done.stdout


def _truncated(data: bytes, size: int) -> bytes:
    return data[:size]


def _flipped(data: bytes, position: int) -> bytes:
    damaged = bytearray(data)
    damaged[position] ^= 0xFF
    return bytes(damaged)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: _truncated(data, 4096),  # the first page only: the schema points at missing pages
        lambda data: _truncated(data, len(data) // 2),
        lambda data: _flipped(data, 28),  # the header's page count
    ],
    ids=["first-page-only", "half", "header-page-count"],
)
def test_show_leaves_no_wal_or_shm_behind_on_a_damaged_journal(journal_path: Path, tmp_path: Path, damage: Any) -> None:
    """A damaged WAL-mode journal is refused, and the directory is left as it was: the check that
    refuses it used to open a ``mode=ro`` connection, which creates ``-wal``/``-shm`` and cannot remove them."""
    path = tmp_path / "journal.db"
    data = damage(journal_path.read_bytes())
    path.write_bytes(data)
    assert data[18:20] == b"\x02\x02"  # the header still says WAL: SQLite will want the side files
    done = show(path)
    assert done.returncode == 1
    assert "is not a readable trio_agent journal" in done.stderr
    assert "Traceback" not in done.stderr
    assert listing(tmp_path) == ["journal.db"]
    assert path.read_bytes() == data


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def test_show_beside_a_live_writer_leaves_its_wal_alone(journal_path: Path, tmp_path: Path) -> None:
    """The damage fix must not tidy away what a running writer uses: SQLite removes side files
    only when the last connection closes."""
    path = tmp_path / "journal.db"
    shutil.copyfile(journal_path, path)
    async with open_sqlite_store(path) as store:
        side_files = listing(tmp_path)
        assert side_files == ["journal.db", "journal.db-shm", "journal.db-wal"]
        done = await trio.run_process(
            [sys.executable, "-m", "trio_agent", "journal", "show", str(path)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert listing(tmp_path) == side_files
        async with open_journal(store, session_id="sess-c") as journal:
            await start_turn(journal)
            during = await trio.run_process(
                [sys.executable, "-m", "trio_agent", "journal", "show", str(path), "--session", "sess-c"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        assert {info.session_id for info in await store.streams(None)} >= {"sess-a", "sess-b", "sess-c"}
    assert listing(tmp_path) == ["journal.db"]
    # The lease of a running session is shown as held; a closed session's as no longer held.
    header = during.stdout.decode().splitlines()[0]
    assert re.fullmatch(r"session sess-c: 1 agent stream\(s\), lease token 1 \(.+, held until [\d:.]+\)", header)
    assert re.search(r"session sess-a: .*lease token \d+ \(.+, not held\)", done.stdout.decode())


async def test_show_orders_streams_root_first_then_by_name_with_numbers_as_numbers(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with open_sqlite_store(path) as store:
        for agent in ("summarizer-10", "summarizer-2", "root", "reviewer-7", "summarizer-1"):
            async with open_journal(store, session_id="multi", root_agent_id=agent) as journal:
                await start_turn(journal)
    done = await trio.run_process(
        [sys.executable, "-m", "trio_agent", "journal", "show", str(path)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    streams = re.findall(r"^  stream multi/(\S+) ", done.stdout.decode(), re.MULTILINE)
    assert streams == ["root", "reviewer-7", "summarizer-1", "summarizer-2", "summarizer-10"]
    missing = await trio.run_process(
        [sys.executable, "-m", "trio_agent", "journal", "show", str(path), "--agent", "summarizer-3"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert missing.returncode == 1
    assert missing.stderr.decode().strip() == (
        "error: the journal has no agent 'summarizer-3'; its agents: "
        "root, reviewer-7, summarizer-1, summarizer-2, summarizer-10"
    )


def test_show_orders_agent_ids_with_digit_runs_past_ints_digit_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An edited file's agent id of 5,000 digits: int() of the run raised a bare ValueError (over
    # Python's 4,300-digit limit), and `journal show` crashed with a traceback, showing nothing.
    from trio_agent._journal._inspect import show_journal

    path = tmp_path / "journal.db"

    async def build() -> None:
        async with open_sqlite_store(path) as store, open_journal(store, session_id="s1"):
            pass

    trio.run(build)
    agents = ["w" + "7" * 5000, "w" + "9" * 4999, "w" + "0" * 4400 + "8"]
    with sqlite3.connect(path) as conn:
        conn.executemany("INSERT INTO journal_streams VALUES (?, 's1', 0)", [(f"s1/{agent}",) for agent in agents])
    conn.close()
    assert show_journal(str(path)) == 0
    shown = re.findall(r"^  stream s1/(\S+) ", capsys.readouterr().out, re.MULTILINE)
    assert shown == ["root", agents[2], agents[1], agents[0]]  # 8 < 99...9 (4,999 digits) < 77...7 (5,000)
    assert show_journal(str(path), agent_id="nobody") == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: the journal has no agent 'nobody'; its agents: root, {agents[2]}, {agents[1]}")


def test_show_of_a_directory_names_the_sqlite_files_in_it(journal_path: Path, tmp_path: Path) -> None:
    shutil.copyfile(journal_path, tmp_path / "kept.db")
    (tmp_path / "notes.txt").write_text("not a database")
    (tmp_path / "sub").mkdir()
    done = show(tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"error: {tmp_path} is a directory, not a journal file; the SQLite files in it: {tmp_path / 'kept.db'}"
    )
    empty = show(tmp_path / "sub")
    assert empty.returncode == 1
    assert (
        empty.stderr.strip()
        == f"error: {tmp_path / 'sub'} is a directory, not a journal file (it holds no SQLite file)"
    )


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")
def test_show_into_a_pipe_closed_early_stops_quietly(journal_path: Path) -> None:
    """``journal show big.db | head`` ends without a traceback (exit 141, like a tool SIGPIPE stopped)."""
    with subprocess.Popen(
        [sys.executable, "-m", "trio_agent", "journal", "show", str(journal_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # the reader is gone before the timeline is written
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=60) == 141, stderr
    assert stderr == ""
