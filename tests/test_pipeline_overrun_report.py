"""A tool that ignores its cancellation past ``cleanup_grace`` is reported (a WARNING on the
``trio_agent`` logger naming the tool and the call) when its grace runs out, while it still runs,
and once more when it ends."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import AbortReason, define_tool
from trio_agent.testing import call_tool
from trio_agent.tools import AbortHandle, FaultCode, ToolPipeline


class Seen(logging.Handler):
    """Keeps the ``trio_agent`` records, and sets an event on the first whose text has *marker*."""

    def __init__(self, marker: str) -> None:
        super().__init__(logging.WARNING)
        self.marker = marker
        self.records: list[tuple[float, str]] = []
        self.event = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.records.append((trio.current_time(), text))
        if self.marker in text:
            self.event.set()


@pytest.fixture
def seen() -> Iterator[Seen]:
    handler = Seen("has not stopped")
    logger = logging.getLogger("trio_agent")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def stubborn_tool(release: trio.Event, ended: list[float]) -> Any:
    async def stubborn(inp: dict[str, Any], ctx: Any) -> str:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):  # ignores its cancellation until released
                await release.wait()
            ended.append(trio.current_time())
        return "never"  # pragma: no cover

    return define_tool(stubborn, description="x", side_effect="pure", input_schema={"type": "object"})


async def test_an_aborted_tool_s_overrun_is_logged_when_its_grace_runs_out_while_it_still_runs(
    autojump_clock: trio.testing.MockClock, seen: Seen
) -> None:
    release = trio.Event()
    ended: list[float] = []
    pipeline = ToolPipeline([stubborn_tool(release, ended)], cleanup_grace=2.0)
    abort = AbortHandle()
    records: list[Any] = []

    async def call() -> None:
        records.append(await call_tool(pipeline, "stubborn", {}, call_id="c-7", abort=abort))

    async with trio.open_nursery() as nursery:
        try:
            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            abort.abort(AbortReason.USER_ABORT, "stop")
            aborted_at = trio.current_time()
            with trio.fail_after(100):  # (virtual time)
                await seen.event.wait()
            # Reported at its cleanup deadline, while it still runs.
            assert trio.current_time() == aborted_at + 2.0
            assert ended == []
            assert [text for _, text in seen.records] == [
                "tool 'stubborn' (call 'c-7') has not stopped 2 s after it was cancelled (aborted (user_abort); "
                "cleanup_grace 2 s): new tool starts wait for it, and so does whatever waits for its call (the "
                "request's end, session.abort(), the session's close and the exit of its block), until it ends"
            ]
            await trio.sleep(1)  # (virtual time) it holds out a second longer
        finally:
            release.set()  # (a failed assertion must not leave it stuck)
    assert ended == [aborted_at + 3.0]
    assert [text for _, text in seen.records][1:] == [
        "tool 'stubborn' (call 'c-7') stopped 3 s after it was cancelled (cleanup_grace 2 s)"
    ]
    assert [fault.code for fault in records[0].faults] == [FaultCode.CLEANUP_OVERRUN]


@pytest.mark.parametrize("then", ["abort", "new start"])
async def test_a_timed_out_tool_s_overrun_is_logged_as_soon_as_something_waits_for_it(
    autojump_clock: trio.testing.MockClock, seen: Seen, then: str
) -> None:
    # A timeout alone is not watched (that would take a task per call): the overrun is logged once an
    # abort reaches the call, or a new tool start is held back by it.
    release = trio.Event()
    ended: list[float] = []

    async def quick(inp: dict[str, Any], ctx: Any) -> str:
        return "quick"

    tools = [
        stubborn_tool(release, ended),
        define_tool(quick, description="q", side_effect="pure", input_schema={"type": "object"}),
    ]
    pipeline = ToolPipeline(tools, timeout=1.0, cleanup_grace=2.0)
    abort = AbortHandle()
    async with trio.open_nursery() as nursery:
        try:
            nursery.start_soon(partial(call_tool, pipeline, "stubborn", {}, call_id="c-8", abort=abort))
            await trio.sleep(10)  # (virtual time) timed out at 1, overrunning since 3
            assert seen.records == []
            if then == "abort":
                abort.abort(AbortReason.USER_ABORT, "stop")
            else:
                nursery.start_soon(call_tool, pipeline, "quick", {})
            await trio.testing.wait_all_tasks_blocked()
            [(at, text)] = seen.records
            assert at == 10.0
            assert text.startswith("tool 'stubborn' (call 'c-8') has not stopped 9 s after it was cancelled")
        finally:
            release.set()
    assert ended == [10.0]


async def test_a_tool_that_stops_within_its_grace_is_not_reported(
    autojump_clock: trio.testing.MockClock, seen: Seen
) -> None:
    async def polite(inp: dict[str, Any], ctx: Any) -> str:
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    tool = define_tool(polite, description="x", side_effect="pure", input_schema={"type": "object"})
    pipeline = ToolPipeline([tool], timeout=1.0, cleanup_grace=2.0)
    for _ in range(3):
        record = await call_tool(pipeline, "polite", {})
        assert record.result.error is not None and record.result.error.code == "timeout"
    await trio.sleep(100)  # past every deadline the watcher was given
    assert seen.records == []
    assert pipeline.cleanup_overruns == 0


async def test_the_watcher_keeps_no_pipeline_alive(autojump_clock: trio.testing.MockClock) -> None:
    async def quick(inp: dict[str, Any], ctx: Any) -> str:
        return "ok"

    tool = define_tool(quick, description="x", side_effect="pure", input_schema={"type": "object"})
    pipeline = ToolPipeline([tool])
    assert (await call_tool(pipeline, "quick", {})).result.ok
    gone = weakref.ref(pipeline)
    del pipeline
    gc.collect()
    assert gone() is None


def _watchers() -> int:
    tasks, todo = 0, [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        tasks += task.name == "trio_agent tool cleanup watcher"
        todo.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return tasks


async def test_the_watcher_runs_only_while_a_cancelled_tool_does(
    autojump_clock: trio.testing.MockClock, seen: Seen
) -> None:
    release = trio.Event()
    ended: list[float] = []
    pipeline = ToolPipeline([stubborn_tool(release, ended)], cleanup_grace=2.0)
    abort = AbortHandle()
    async with trio.open_nursery() as nursery:
        try:
            nursery.start_soon(partial(call_tool, pipeline, "stubborn", {}, abort=abort))
            await trio.testing.wait_all_tasks_blocked()
            assert _watchers() == 0  # a call that is not cancelled costs no task
            abort.abort(AbortReason.USER_ABORT, "stop")
            await trio.testing.wait_all_tasks_blocked()
            assert _watchers() == 1
        finally:
            release.set()  # within its grace: nothing to report
    await trio.testing.wait_all_tasks_blocked()
    assert _watchers() == 0
    assert seen.records == []
    assert trio.current_time() == 0
