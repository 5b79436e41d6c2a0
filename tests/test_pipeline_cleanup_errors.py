"""A tool, stage or middleware whose own nursery raises while the pipeline's scope cancels it.

The pipeline's scope (the tool's deadline, the call's abort, the unwind deadline) caught its
``Cancelled`` out of the group and let the error raised beside it through as an
``ExceptionGroup`` that nothing caught: ``execute`` raised it (a `chat()` turn lost its other
calls), a layered call blamed its middleware, and a result committed before the unwind
overran was not returned. The call now ends as that cancellation would: timed out, aborted,
or committed with its unwind deadline missed.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import trio_agent as ta
from tests.cancel_helpers import failing_child, nursery_failing_in_cleanup
from trio_agent.tools import AbortHandle, InMemoryToolJournal, ToolCall, ToolPipeline, ToolStages


async def _work_with_a_nursery(input: dict[str, Any], ctx: Any) -> ta.ToolResult:
    await nursery_failing_in_cleanup()


async def _passthrough(request: Any, call_next: Any) -> ta.ToolResult:
    result: ta.ToolResult = await call_next()
    return result


async def _after(seconds: float, abort: AbortHandle) -> None:
    await trio.sleep(seconds)
    abort.abort()


@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("how", ["timeout", "abort"])
async def test_a_tool_whose_nursery_raises_while_cancelled_ends_as_the_cancellation(
    autojump_clock: trio.testing.MockClock, layered: bool, how: str
) -> None:
    tool = ta.define_tool(
        _work_with_a_nursery,
        name="work",
        description="Works.",
        side_effect="pure",
        kind="readonly",
        input_schema={"type": "object"},
        interrupt="cancel",
        timeout=1.0,
    )
    pipeline = ToolPipeline([tool], middleware=[_passthrough] if layered else [], journal=InMemoryToolJournal())
    abort = AbortHandle()
    async with trio.open_nursery() as nursery:
        if how == "abort":
            nursery.start_soon(_after, 0.5, abort)
        record = await pipeline.execute(ToolCall("c1", "work", {}), abort=abort)
    assert record.result.error is not None
    if how == "timeout":
        assert (record.status.value, record.result.error.code) == ("failed", "timeout")
    else:
        assert (record.status.value, record.result.error.code) == ("cancelled", "user_abort")
    assert record.faults == ()


async def _work(input: dict[str, Any], ctx: Any) -> ta.ToolResult:
    return ta.ToolResult.success("committed")


WORK = ta.define_tool(
    _work, name="work", description="Works.", side_effect="pure", kind="readonly", input_schema={"type": "object"}
)


async def _middleware_with_a_nursery(request: Any, call_next: Any) -> ta.ToolResult:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(failing_child)
        await trio.sleep(5)  # the abort lands here, before call_next
        nursery.cancel_scope.cancel()
    result: ta.ToolResult = await call_next()
    return result


async def _stage_with_a_nursery(request: Any) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(failing_child)
        await trio.sleep(5)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("where", ["middleware", "pre_tool stage"])
async def test_a_middleware_or_stage_whose_nursery_raises_on_abort_ends_the_call_aborted(
    autojump_clock: trio.testing.MockClock, where: str
) -> None:
    options: dict[str, Any] = (
        {"middleware": [_middleware_with_a_nursery]}
        if where == "middleware"
        else {"stages": ToolStages(pre_tool=[_stage_with_a_nursery])}
    )
    pipeline = ToolPipeline([WORK], journal=InMemoryToolJournal(), **options)
    abort = AbortHandle()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_after, 1, abort)
        record = await pipeline.execute(ToolCall("c1", "work", {}), abort=abort)
    assert record.status.value == "cancelled" and not record.tool_ran
    assert record.result.error is not None and record.result.error.code == "user_abort"


async def test_a_committed_result_stands_when_an_unwind_in_a_nursery_overruns_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow_unwind(request: Any, call_next: Any) -> ta.ToolResult:
        result: ta.ToolResult = await call_next()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(failing_child)
            await trio.sleep(10)  # past the unwind grace (2 s)
        return result

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([WORK], middleware=[slow_unwind], journal=journal)
    record = await pipeline.execute(ToolCall("c1", "work", {}))
    assert (record.status.value, record.published) == ("completed", False)
    assert "withheld" in str(record.result.output)  # persisted, withheld: as for an unwind without a nursery
    assert [fault.code.value for fault in record.faults] == ["unwind_deadline_missed"]
