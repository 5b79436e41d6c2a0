"""A tool's timeout bounds the tool's own time, not a wait on the reader of what it emits.

An ``on_item`` that waits for its reader says so with `waiting_for_reader()` (``chat()``'s and a
session's sinks do): while it waits, the deadline of the tool whose item it passes on holds (and
its cleanup deadline with it: a tool a reader keeps waiting does not overrun), and goes on with
what was left once the wait ends. An abort still cuts the tool at once.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import AbortReason, Progress, ToolErrorType, ToolResult, define_tool
from trio_agent._reader_wait import open_frames
from trio_agent.models import waiting_for_reader
from trio_agent.testing import call_tool
from trio_agent.tools import AbortHandle, CallNext, SettlementStatus, ToolMiddlewareRequest, ToolPipeline

OBJECT: dict[str, Any] = {"type": "object"}


async def slow_reader(item: Any) -> None:
    """An ``on_item`` whose reader takes ``item.data`` seconds (trio time) to make room."""
    with waiting_for_reader():
        await trio.sleep(item.data)


async def passthrough(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    return await call_next()


def chatty(own: float) -> Any:
    async def chatty(inp: dict[str, Any], ctx: Any) -> str:
        for _ in range(3):
            await ctx.emit(Progress("step", data=10.0))
        await trio.sleep(own)  # the tool's own time
        return "said"

    return define_tool(chatty, description="x", side_effect="pure", input_schema=OBJECT)


@pytest.mark.parametrize("middleware", [(), (passthrough,)], ids=["no middleware", "through middleware"])
async def test_the_reader_s_waits_do_not_count_against_the_tool_s_timeout(
    autojump_clock: trio.testing.MockClock, middleware: tuple[Any, ...]
) -> None:
    pipeline = ToolPipeline([chatty(0.5)], middleware=middleware, timeout=1.0)
    record = await call_tool(pipeline, "chatty", {}, on_item=slow_reader)
    assert record.status is SettlementStatus.COMPLETED and record.result.output == "said"
    assert trio.current_time() == 30.5
    assert open_frames() == {}  # the tool's frames were left with its items


@pytest.mark.parametrize("middleware", [(), (passthrough,)], ids=["no middleware", "through middleware"])
async def test_the_tool_s_own_time_still_counts_after_the_reader_s_waits(
    autojump_clock: trio.testing.MockClock, middleware: tuple[Any, ...]
) -> None:
    pipeline = ToolPipeline([chatty(2.0)], middleware=middleware, timeout=1.0)
    record = await call_tool(pipeline, "chatty", {}, on_item=slow_reader)
    assert record.result.error is not None and record.result.error.type is ToolErrorType.TIMEOUT
    assert trio.current_time() == 31.0  # 30 s of the reader's, then the 1 s of its own


async def test_waits_of_two_of_the_tool_s_tasks_hold_its_deadline_until_the_last_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two tasks of the tool wait on the reader at once (from 0 to 5 and from 0.1 to 10.1): the
    # deadline holds until the later one ends, not only until the first does, then 0.5 s of the
    # tool's own follow (within its 1 s).
    async def fan_out(inp: dict[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ctx.emit, Progress("reader waits", data=5.0))
            await trio.sleep(0.1)
            nursery.start_soon(ctx.emit, Progress("reader waits", data=10.0))
        await trio.sleep(0.5)
        return "fanned"

    pipeline = ToolPipeline(
        [define_tool(fan_out, description="x", side_effect="pure", input_schema=OBJECT)], timeout=1.0
    )
    record = await call_tool(pipeline, "fan_out", {}, on_item=slow_reader)
    assert record.result.output == "fanned"
    assert trio.current_time() == pytest.approx(10.6)


async def test_a_tool_kept_waiting_by_its_reader_does_not_overrun(autojump_clock: trio.testing.MockClock) -> None:
    # Its deadline (1 s) and cleanup deadline (1 s later) pass while the reader keeps it waiting:
    # it is not overrunning, so a new start does not wait for it, and nothing is reported.
    async def talky(inp: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Progress("long read", data=100.0))
        return "talked"

    async def quick(inp: dict[str, Any], ctx: Any) -> str:
        return "quick"

    tools = [
        define_tool(talky, description="x", side_effect="pure", input_schema=OBJECT),
        define_tool(quick, description="q", side_effect="pure", input_schema=OBJECT),
    ]
    pipeline = ToolPipeline(tools, timeout=1.0, cleanup_grace=1.0)
    records: list[Any] = []

    async def call_talky() -> None:
        records.append(await call_tool(pipeline, "talky", {}, on_item=slow_reader))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call_talky)
        await trio.sleep(50)
        assert pipeline.overrunning_calls() == []
        quick_record = await call_tool(pipeline, "quick", {})
        assert quick_record.result.output == "quick"
        assert trio.current_time() == 50  # not held back
    [record] = records
    assert record.result.output == "talked" and record.faults == ()
    assert pipeline.cleanup_overruns == 0


async def test_a_moved_deadline_still_tracks_the_tool_s_overrun(autojump_clock: trio.testing.MockClock) -> None:
    # After the reader's 100 s the tool's deadline is at 101 and its cleanup deadline at 102: a tool
    # that then ignores its timeout is overrunning from 102 on (a new start waits for it).
    release = trio.Event()

    async def stubborn(inp: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Progress("long read", data=100.0))
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await release.wait()
        return "never"  # pragma: no cover

    async def quick(inp: dict[str, Any], ctx: Any) -> str:
        return "quick"

    tools = [
        define_tool(stubborn, description="x", side_effect="pure", input_schema=OBJECT),
        define_tool(quick, description="q", side_effect="pure", input_schema=OBJECT),
    ]
    pipeline = ToolPipeline(tools, timeout=1.0, cleanup_grace=1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(call_tool, pipeline, "stubborn", {}, call_id="c-1", on_item=slow_reader))
        await trio.sleep(101.5)
        assert pipeline.overrunning_calls() == []
        await trio.sleep(1)
        assert pipeline.overrunning_calls() == ["tool 'stubborn' (call 'c-1')"]
        release.set()


async def test_an_abort_during_a_blocked_publication_cuts_the_tool_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def never_read(item: Any) -> None:
        with waiting_for_reader():
            await trio.sleep_forever()

    async def emits(inp: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Progress("waits"))
        return "never"  # pragma: no cover

    pipeline = ToolPipeline([define_tool(emits, description="x", side_effect="pure", input_schema=OBJECT)], timeout=1.0)
    abort = AbortHandle()
    records: list[Any] = []

    async def call() -> None:
        records.append(await call_tool(pipeline, "emits", {}, abort=abort, on_item=never_read))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.sleep(5)  # past its 1 s timeout: held, the reader keeps it waiting
        abort.abort(AbortReason.USER_ABORT, "enough")
    [record] = records
    assert trio.current_time() == 5  # cut at once
    assert record.status is SettlementStatus.CANCELLED
    assert record.result.error is not None and record.result.error.type is ToolErrorType.INTERRUPTED
    assert record.aborted is not None and record.aborted.reason is AbortReason.USER_ABORT
