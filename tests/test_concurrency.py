"""Hundreds of concurrent calls through ONE shared middleware stack.

Each test middleware writes request-local state, awaits checkpoints where
hypothesis says, then reads the state back and checks that it still belongs to
its own call. A deliberately stateful middleware (state on ``self``) is the
negative control: the very same check must catch it.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_agent as ta
from trio_agent.testing import call_tool


@attrs.frozen
class Plan:
    """Where a layer yields to the scheduler: before writing, between write and read, after call_next."""

    before: int
    between: int
    after: int


async def yield_n(count: int) -> None:
    for _ in range(count):
        await trio.lowlevel.checkpoint()


class SafeLayer:
    """Keeps request-local state in locals, as middleware must."""

    def __init__(self, name: str, plan: Plan, mismatches: list[str]) -> None:
        self.name = name
        self.plan = plan
        self.mismatches = mismatches

    async def __call__(self, request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        await yield_n(self.plan.before)
        mine = request.context.tool_call_id  # request-local state, in a local
        await yield_n(self.plan.between)
        if mine != request.context.tool_call_id:
            self.mismatches.append(f"{self.name}: saw {mine} in {request.context.tool_call_id}")
        trail = [*request.input["trail"], self.name]
        result = await call_next(request.replace(input={**request.input, "trail": trail}))
        await yield_n(self.plan.after)
        if mine != request.context.tool_call_id:
            self.mismatches.append(f"{self.name}: after next saw {mine}")
        return attrs.evolve(result, output=f"{result.output}|{self.name}:{mine}")


class StatefulLayer(SafeLayer):
    """The negative control: keeps request state on the shared instance."""

    current: str | None = None

    async def __call__(self, request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        await yield_n(self.plan.before)
        self.current = request.context.tool_call_id
        await yield_n(self.plan.between)
        if self.current != request.context.tool_call_id:
            self.mismatches.append(f"{self.name}: saw {self.current} in {request.context.tool_call_id}")
        trail = [*request.input["trail"], self.name]
        result = await call_next(request.replace(input={**request.input, "trail": trail}))
        await yield_n(self.plan.after)
        return attrs.evolve(result, output=f"{result.output}|{self.name}:{self.current}")


@ta.define_tool(
    side_effect="pure",
    kind="readonly",
    input_schema={"type": "object", "properties": {"trail": {"type": "array", "items": {"type": "string"}}}},
)
async def echo(input: dict[str, Any], ctx: ta.ToolContext) -> str:
    """Echoes its call id and the trail of layers that touched the input."""
    await trio.lowlevel.checkpoint()
    return f"{ctx.tool_call_id}:{'>'.join(input['trail'])}"


async def run_many(layers: list[SafeLayer], calls: int) -> list[str]:
    """Run *calls* concurrent calls through one pipeline; return every mismatch observed."""
    mismatches = layers[0].mismatches if layers else []
    pipeline = ta.ToolPipeline(
        [echo], middleware=layers, scheduler=ta.ToolScheduler(ta.SchedulerLimits(readonly=calls))
    )
    records: dict[str, ta.ToolExecutionRecord] = {}

    async def one(index: int) -> None:
        call_id = f"call-{index}"
        records[call_id] = await call_tool(pipeline, "echo", {"trail": []}, call_id=call_id)

    async with trio.open_nursery() as nursery:
        for index in range(calls):
            nursery.start_soon(one, index)

    names = [layer.name for layer in layers]
    expected_trail = ">".join(names)
    for call_id, record in records.items():
        expected = f"{call_id}:{expected_trail}" + "".join(f"|{name}:{call_id}" for name in reversed(names))
        if record.result.output != expected:
            mismatches.append(f"{call_id}: result {record.result.output!r} != {expected!r}")
        if record.effective_input != {"trail": names}:
            mismatches.append(f"{call_id}: effective input {record.effective_input!r}")
    assert len(records) == calls
    return mismatches


plans = st.builds(Plan, st.integers(0, 2), st.integers(0, 3), st.integers(0, 2))


@settings(max_examples=15, deadline=None)
@given(layer_plans=st.lists(plans, min_size=1, max_size=4), calls=st.integers(100, 300))
def test_shared_stack_keeps_request_local_state(layer_plans: list[Plan], calls: int) -> None:
    mismatches: list[str] = []
    layers = [SafeLayer(f"L{i}", plan, mismatches) for i, plan in enumerate(layer_plans)]
    assert trio.run(run_many, layers, calls) == []


@settings(max_examples=10, deadline=None)
@given(
    layer_plans=st.lists(plans, min_size=0, max_size=3),
    control=st.builds(Plan, st.integers(0, 2), st.integers(1, 3), st.integers(0, 2)),
    position=st.integers(0, 3),
    calls=st.integers(100, 300),
)
def test_stateful_middleware_is_caught(layer_plans: list[Plan], control: Plan, position: int, calls: int) -> None:
    """The negative control: the same check must catch state kept on the shared instance."""
    mismatches: list[str] = []
    layers: list[SafeLayer] = [SafeLayer(f"L{i}", plan, mismatches) for i, plan in enumerate(layer_plans)]
    layers.insert(min(position, len(layers)), StatefulLayer("STATEFUL", control, mismatches))
    found = trio.run(run_many, layers, calls)
    assert found, "a middleware keeping request state on self must be detected"
    assert any("STATEFUL" in line for line in found)


async def test_concurrent_executions_with_aborts_leave_nothing_behind() -> None:
    """Concurrent calls, a third of them aborted mid-way: every call settles exactly once."""
    journal = ta.InMemoryToolJournal()
    started = trio.Event()
    gate = trio.Event()

    @ta.define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def wait_gate(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Waits for the gate."""
        started.set()
        await gate.wait()
        return ctx.tool_call_id

    mismatches: list[str] = []
    layers = [SafeLayer("A", Plan(1, 1, 1), mismatches)]
    pipeline = ta.ToolPipeline(
        [wait_gate], middleware=layers, journal=journal, scheduler=ta.ToolScheduler(ta.SchedulerLimits(readonly=50))
    )
    handles = [ta.AbortHandle() for _ in range(300)]
    records: list[ta.ToolExecutionRecord] = []

    async def one(index: int) -> None:
        records.append(await call_tool(pipeline, "wait_gate", {"trail": []}, call_id=f"c{index}", abort=handles[index]))

    async with trio.open_nursery() as nursery:
        for index in range(300):
            nursery.start_soon(one, index)
        await started.wait()
        await trio.testing.wait_all_tasks_blocked()
        for index in range(0, 300, 3):
            handles[index].abort()
        gate.set()
    assert len(records) == 300
    by_id = {record.call.id: record for record in records}
    for index in range(300):
        record = by_id[f"c{index}"]
        kinds = journal.kinds(f"c{index}")
        assert kinds.count("settled") == 1 and kinds[0] == "scheduled"
        if index % 3 == 0:
            assert record.status is ta.SettlementStatus.CANCELLED
        else:
            assert record.result.output == f"c{index}|A:c{index}"
    assert mismatches == []
    stats = pipeline.scheduler.statistics().buckets["readonly"]
    assert stats[:2] == (0, 0)
