"""Behaviour the tool pipeline's cheaper paths keep (issue 17): one scope for what waits before the
tool and the tool itself, a journal that checks the lifecycle without keeping entries, layers checked
once by identity, and a tool chain on the generic composer, composed once per layers object, whose
``call_next()`` runs nothing until awaited and whose links die by refcount."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import trio
import trio.testing

import trio_agent as ta
from trio_agent._middleware import Composed, ComposedNext, PassedChecks, compose_middleware
from trio_agent._tools._pipeline import ToolLayers
from trio_agent.middleware import NextCalledTwiceError
from trio_agent.testing import call_tool
from trio_agent.tools import Allow, InMemoryToolJournal, ToolPipeline, ToolStages


def sleeper(seconds: float) -> ta.Tool[Any]:
    async def run(inp: dict[str, Any], ctx: ta.ToolContext) -> ta.ToolResult:
        await trio.sleep(seconds)
        return ta.ToolResult.success("slept")

    return ta.define_tool(run, name="sleep", description="s", side_effect="pure", input_schema={"type": "object"})


async def test_the_tool_timeout_starts_when_the_tool_does_not_before_a_stage_that_waited(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow_permission(request: Any) -> Allow:
        await trio.sleep(5)  # longer than the tool's timeout: it must not count
        return Allow()

    pipeline = ToolPipeline([sleeper(0.5)], stages=ToolStages(permission=[slow_permission]), timeout=1)
    record = await call_tool(pipeline, "sleep", {})
    assert record.result.ok and record.result.output == "slept"

    pipeline = ToolPipeline([sleeper(2)], stages=ToolStages(permission=[slow_permission]), timeout=1)
    record = await call_tool(pipeline, "sleep", {}, call_id="c2")
    assert record.result.error is not None and record.result.error.type is ta.ToolErrorType.TIMEOUT
    assert record.tool_ran


async def test_an_abort_while_a_stage_waits_stops_the_call_before_the_tool(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ran: list[str] = []
    waiting = trio.Event()

    async def stalling(request: Any) -> Allow:
        waiting.set()
        await trio.sleep_forever()
        return Allow()  # pragma: no cover

    async def run(inp: dict[str, Any], ctx: ta.ToolContext) -> ta.ToolResult:
        ran.append("ran")  # pragma: no cover
        return ta.ToolResult.success("never")  # pragma: no cover

    tool = ta.define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([tool], journal=journal, stages=ToolStages(pre_tool=[stalling]))
    abort = ta.AbortHandle()
    records: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def go() -> None:
            records.append(await call_tool(pipeline, "t", {}, call_id="c1", abort=abort))

        nursery.start_soon(go)
        await waiting.wait()
        abort.abort(ta.AbortReason.USER_ABORT, "stop")
    (record,) = records
    assert ran == [] and not record.tool_ran
    assert record.result.error is not None and record.result.error.type is ta.ToolErrorType.INTERRUPTED
    assert journal.kinds("c1") == ["scheduled", "settled"]
    # The scheduler slot it never took is not held.
    assert all(borrowed == 0 for borrowed, _, _ in pipeline.scheduler.statistics().buckets.values())


async def test_a_journal_without_entries_still_checks_the_lifecycle() -> None:
    journal = InMemoryToolJournal(keep_entries=False)
    pipeline = ToolPipeline([sleeper(0)], journal=journal)
    record = await call_tool(pipeline, "sleep", {}, call_id="c1")
    assert record.result.ok
    assert journal.entries == []
    assert journal.call_state(record_call(record)) == "settled"
    with pytest.raises(ta.JournalError, match="already scheduled"):
        await call_tool(pipeline, "sleep", {}, call_id="c1")


def record_call(record: Any) -> Any:
    return ta.ScheduledCall(
        record.call.id, record.call.name, record.call.input, record.behavior, "k", "s", "a", "r", "t"
    )


def test_passed_checks_go_by_identity() -> None:
    class EqualsAll:
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = object.__hash__

    passed = PassedChecks()
    first, second = EqualsAll(), EqualsAll()
    passed.add(first)
    assert first in passed
    assert second not in passed  # equal, but not the layer that was checked
    del first
    assert len(passed._passed) == 0  # forgotten with its last reference


async def passthrough(request: ta.ToolMiddlewareRequest, call_next: Any) -> ta.ToolResult:
    return await call_next()


async def test_the_tool_chain_is_composed_once_per_layers_object() -> None:
    layers = ToolLayers.check([passthrough, passthrough])
    first = ToolPipeline([sleeper(0)], middleware=layers)
    second = ToolPipeline([sleeper(0)], middleware=layers)
    assert isinstance(first._chain, Composed)
    assert first._chain is second._chain  # sessions opened from one spec share it
    assert ToolPipeline([sleeper(0)])._chain is None  # no layers: the core alone
    record = await call_tool(second, "sleep", {})
    assert record.result.ok and record.result.output == "slept"


async def test_call_next_runs_nothing_until_it_is_awaited() -> None:
    ran: list[str] = []

    async def run(inp: dict[str, Any], ctx: ta.ToolContext) -> ta.ToolResult:
        ran.append("tool")
        return ta.ToolResult.success("ran")

    tool = ta.define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    seen: list[Any] = []

    async def layer(request: ta.ToolMiddlewareRequest, call_next: Any) -> ta.ToolResult:
        with pytest.raises(TypeError, match="must be called"):
            await call_next  # not called: nothing to await
        pending = call_next()
        await trio.lowlevel.checkpoint()
        seen.append(list(ran))  # called, not awaited: the core has not run
        result: ta.ToolResult = await pending
        with pytest.raises(RuntimeError, match="cannot await the same call_next"):
            await pending
        with pytest.raises(NextCalledTwiceError):
            call_next()
        return result

    record = await call_tool(ToolPipeline([tool], middleware=[layer]), "t", {})
    assert seen == [[]] and ran == ["tool"]
    assert record.result.output == "ran"
    assert [fault.code.value for fault in record.faults] == ["next_called_twice"]


async def test_the_chain_leaves_no_cycles_behind() -> None:
    pipeline = ToolPipeline([sleeper(0)], middleware=[passthrough] * 3, history_limit=0)
    await call_tool(pipeline, "sleep", {})  # warm up
    gc.collect()
    gc.disable()
    try:
        record = await call_tool(pipeline, "sleep", {})
        assert record.result.ok
        # Freed by refcount (not waiting for the cyclic GC): the links, the call's state.
        left = [type(obj).__name__ for obj in gc.get_objects() if type(obj).__name__ in ("_CallNext", "_Call")]
        assert left == []
    finally:
        gc.enable()


def test_a_run_that_carries_a_context_and_enters_when_awaited() -> None:
    """The composer's side of the tool chain: `Composed.start` hands the run to the check and the
    terminal, and a `ComposedNext` subclass may admit at call time and enter later."""

    class Deferred(ComposedNext):
        __slots__ = ("_entered",)

        def __call__(self, replacement: Any = None, /) -> Any:
            current = self._current if replacement is None else replacement
            self._admit(current)  # next once, and the check: now
            self._current = current
            return self

        def result(self) -> Any:
            return self._enter(self._current)  # the inner layer: later

    checked: list[tuple[Any, Any]] = []

    def check(run: Any, request: Any) -> None:
        checked.append((run, request))

    def outer(request: str, next_: Any) -> Any:
        deferred = next_(request + "o")
        with pytest.raises(NextCalledTwiceError):
            next_()
        return deferred.result() + "!"

    def inner(request: str, next_: Any) -> Any:
        return next_().result()

    chain: Any = compose_middleware([outer, inner], lambda run, request: f"{run}:{request}", check=check)
    assert isinstance(chain, Composed)
    assert chain.start("r", "ctx", Deferred) == "ctx:ro!"
    assert checked == [("ctx", "ro"), ("ctx", "ro")]  # the first request is the caller's own
