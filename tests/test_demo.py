"""The demo's own machinery: its workspace under a cancellation, its output under a slow reader,
its plugins given bad input."""

from __future__ import annotations

import fcntl
import io
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import _demo as demo
from trio_agent import open_session
from trio_agent.testing import Reply, TestModel

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")


async def test_building_the_workspace_stops_at_a_cancellation(tmp_path: Path) -> None:
    # A plain loop of writes inside trio.run: Ctrl-C and SIGTERM (a cancellation of the run) went
    # unanswered until the last note was written (--calls 99999999999999: more than ten minutes).
    workspace = tmp_path / "workspace"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(demo._make_workspace, workspace, 5000)
        for _ in range(3):
            await trio.lowlevel.checkpoint()  # the builder runs a step or so meanwhile
        nursery.cancel_scope.cancel()
    written = len(list((workspace / "notes").iterdir()))
    assert 0 < written < 10
    assert not (workspace / "config" / "settings.ini").exists()  # stopped before the end, not after it


def _fill(fd: int) -> None:
    """Fill the pipe *fd* writes to, so that its next write blocks."""
    os.set_blocking(fd, False)
    for size in (65536, 4096, 1):
        while True:
            try:
                os.write(fd, b"x" * size)
            except BlockingIOError:
                break
    os.set_blocking(fd, True)


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as reader:
        return reader.read()


async def test_live_lines_skipped_while_the_reader_lags_are_counted_in_order() -> None:
    read_fd, write_fd = os.pipe()
    _fill(write_fd)
    got: list[bytes] = []

    async def reader() -> None:
        got.append(await trio.to_thread.run_sync(_read_all, read_fd))

    with os.fdopen(write_fd, "w", encoding="utf-8") as out:
        async with trio.open_nursery() as nursery:
            async with demo._open_output(out, backlog=3) as output:
                output.live("line 0")
                await trio.testing.wait_all_tasks_blocked()  # its write waits for the reader, in a thread
                for number in range(1, 10):
                    output.live(f"line {number}")  # three wait, six are skipped: never blocking
                nursery.start_soon(reader)  # the reader is back
                await output.text("the end\n  | every line of it")  # waits for room: never skipped
            out.close()  # the reader's end of file
    text = got[0].lstrip(b"x").decode()
    assert text.splitlines() == [
        "line 0",
        "line 1",
        "line 2",
        "line 3",
        demo._skipped_note(6),
        "the end",
        "  | every line of it",
    ]
    assert "6 lines skipped" in demo._skipped_note(6)


def test_a_reader_that_pauses_does_not_stall_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # The live view printed from the event loop: with the pipe full (a paused pager) the loop
    # blocked in print(), leases went unrenewed, and the run failed with LeaseLostError (status 1).
    # Here nobody reads until the session is over; the run must get there on its own.
    session_over = threading.Event()
    summarize = demo.summarize_journal

    async def summarize_after_the_session(*args: Any, **kwargs: Any) -> dict[str, Any]:
        session_over.set()  # the session closed: everything it did, it did with nobody reading
        return await summarize(*args, **kwargs)

    monkeypatch.setattr(demo, "summarize_journal", summarize_after_the_session)
    read_fd, write_fd = os.pipe()
    pipe_size = fcntl.fcntl(read_fd, fcntl.F_GETPIPE_SZ) if hasattr(fcntl, "F_GETPIPE_SZ") else 65536
    got: list[bytes] = []
    waited: list[bool] = []

    def reader() -> None:
        waited.append(session_over.wait(timeout=60))  # a bound for the failing case, not a pause
        got.append(_read_all(read_fd))

    thread = threading.Thread(target=reader)
    thread.start()
    errors = io.StringIO()
    monkeypatch.setattr(sys, "stderr", errors)
    try:
        with os.fdopen(write_fd, "w", encoding="utf-8") as out:
            status = demo.run_demo(calls=100, out=out)
    finally:
        thread.join(timeout=120)
    assert waited == [True], "the run stalled while its reader paused"
    text = got[0].decode()
    assert len(got[0]) > pipe_size  # the output did fill the pipe
    assert (status, errors.getvalue()) == (0, "")
    assert "skipped" not in text  # the backlog held every line
    assert "\nreport.md\n" in text and "the research was interrupted by you" in text
    assert text.endswith("cache hits: 1\n")


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({}, '"path" is a required property'),  # was "Tool middleware failed: KeyError('path')"
        ({"path": 5}, "5 is not of type"),
        ({"path": ["notes"]}, "is not of type"),
    ],
)
async def test_the_read_cache_passes_a_read_without_a_usable_path_on_to_validation(
    tmp_path: Path, arguments: dict[str, Any], said: str
) -> None:
    workspace = tmp_path / "workspace"
    await demo._make_workspace(workspace, 1)
    model = TestModel(default=[Reply("", [("read_file", arguments)]), Reply("done")])
    log = demo.AuditLog()
    async with open_session(
        provider=model,
        tools=demo.build_tools(workspace),
        plugins=demo.audit_plugins(log),
        workspace_roots=[workspace],
        permissions={"allow": ["write_report"]},
    ) as session:
        assert await session.send("go") == "done"
    result = model.requests[1].messages[-1]
    assert "invalid input for tool 'read_file'" in result.content and said in result.content  # type: ignore[attr-defined]
    assert "middleware failed" not in result.content  # type: ignore[attr-defined]
    assert log.cache_hits == 0 and log.entries == [("root", "read_file", False)]
