"""Scheduler slots by kind (FIFO, cancellable, shareable) and fair reader/writer file locks.

Most tests run through `ToolPipeline`: a tool blocks on a per-call event, so the test
decides exactly when each call finishes and observes who is inside the tool.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from trio_agent import ConfigError, Tool, ToolErrorType, ToolKind, ToolResult, define_tool
from trio_agent._tools._definition import unscheduled
from trio_agent.testing import call_tool
from trio_agent.tools import (
    AbortHandle,
    Allow,
    BehaviorOverride,
    CallOrigin,
    FaultCode,
    FileLockManager,
    SchedulerLimits,
    SettlementStatus,
    ToolCall,
    ToolPipeline,
    ToolScheduler,
    ToolStages,
)

WORKSPACE = "/ws"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "paths": {"type": "array", "items": {"type": "string"}}},
    "required": ["id"],
}


class Gate:
    """Tools that block until the test opens their call's event, recording who is inside."""

    def __init__(self) -> None:
        self.events: defaultdict[str, trio.Event] = defaultdict(trio.Event)
        self.started: list[str] = []
        self.finished: list[str] = []
        self.inside: set[str] = set()
        self.max_inside = 0

    def open(self, key: str) -> None:
        self.events[key].set()

    def tool(self, name: str, kind: str, **kwargs: Any) -> Tool[Any]:
        async def run(inp: dict[str, Any], ctx: Any) -> str:
            key = inp["id"]
            self.started.append(key)
            self.inside.add(key)
            self.max_inside = max(self.max_inside, len(self.inside))
            try:
                await self.events[key].wait()
            finally:
                self.inside.discard(key)
                self.finished.append(key)
            return f"{name}:{key}"

        return define_tool(
            run,
            name=name,
            description=f"{kind} tool",
            side_effect="idempotent",
            kind=kind,
            input_schema=SCHEMA,
            affected_paths=lambda inp: inp.get("paths", []),
            **kwargs,
        )


class Calls:
    """Starts calls in a nursery and keeps their records by id."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.records: dict[str, Any] = {}
        self.aborts: dict[str, AbortHandle] = {}

    async def submit(self, pipeline: ToolPipeline, name: str, key: str, **inp: Any) -> None:
        abort = self.aborts[key] = AbortHandle()

        async def go() -> None:
            self.records[key] = await call_tool(pipeline, name, {"id": key, **inp}, call_id=key, abort=abort)

        self.nursery.start_soon(go)
        await wait_all_tasks_blocked()


def stats(pipeline_or_scheduler: Any, kind: str) -> tuple[int, int, int]:
    scheduler = getattr(pipeline_or_scheduler, "scheduler", pipeline_or_scheduler)
    return scheduler.statistics().buckets[kind]


# -- limits ------------------------------------------------------------------------


async def test_default_limits() -> None:
    limits = SchedulerLimits()
    assert (limits.readonly, limits.write, limits.execute) == (10, 10, 3)
    assert ToolScheduler().statistics().buckets == {"readonly": (0, 0, 10), "write": (0, 0, 10), "execute": (0, 0, 3)}
    assert ToolPipeline([]).scheduler.limits == limits


@pytest.mark.parametrize("kind", ["readonly", "write", "execute"])
async def test_default_limit_bounds_running_calls(kind: str) -> None:
    limit = SchedulerLimits().for_kind(ToolKind(kind))
    extra = 2
    gate = Gate()
    pipeline = ToolPipeline([gate.tool("t", kind)])
    keys = [f"c{i}" for i in range(limit + extra)]
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        for key in keys:
            await calls.submit(pipeline, "t", key)
        assert gate.started == keys[:limit]
        assert len(gate.inside) == limit
        assert stats(pipeline, kind) == (limit, extra, limit)
        for key in keys:
            gate.open(key)
    assert gate.max_inside == limit
    assert sorted(gate.finished) == sorted(keys)
    assert stats(pipeline, kind) == (0, 0, limit)
    assert all(calls.records[key].result.ok for key in keys)


async def test_admission_is_fifo() -> None:
    gate = Gate()
    pipeline = ToolPipeline([gate.tool("run", "execute")])
    keys = ["a", "b", "c", "d", "e"]
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        for key in keys:
            await calls.submit(pipeline, "run", key)
        assert gate.started == ["a", "b", "c"]
        # free one slot at a time: each goes to the longest waiter
        gate.open("b")
        await wait_all_tasks_blocked()
        assert gate.started == ["a", "b", "c", "d"]
        gate.open("a")
        await wait_all_tasks_blocked()
        assert gate.started == keys
        for key in keys:
            gate.open(key)
    assert gate.max_inside == 3


async def test_cancelled_waiter_leaves_the_queue_and_slot_goes_to_next() -> None:
    gate = Gate()
    pipeline = ToolPipeline([gate.tool("run", "execute")], scheduler=ToolScheduler(SchedulerLimits(execute=1)))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        for key in "abc":
            await calls.submit(pipeline, "run", key)
        assert gate.started == ["a"]
        assert stats(pipeline, "execute") == (1, 2, 1)
        calls.aborts["b"].abort()
        await wait_all_tasks_blocked()
        record_b = calls.records["b"]
        assert record_b.status is SettlementStatus.CANCELLED
        assert record_b.result.error is not None and record_b.result.error.type is ToolErrorType.INTERRUPTED
        assert not record_b.tool_ran
        assert pipeline.journal.kinds("b") == ["scheduled", "settled"]  # type: ignore[attr-defined]
        assert stats(pipeline, "execute") == (1, 1, 1)
        gate.open("a")
        await wait_all_tasks_blocked()
        assert gate.started == ["a", "c"]
        gate.open("c")
    assert stats(pipeline, "execute") == (0, 0, 1)
    assert calls.records["c"].result == ToolResult.success("run:c")


async def test_cancelled_holder_releases_its_slot() -> None:
    gate = Gate()
    pipeline = ToolPipeline([gate.tool("run", "execute")], scheduler=ToolScheduler(SchedulerLimits(execute=1)))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "run", "holder")
        await calls.submit(pipeline, "run", "next")
        assert gate.started == ["holder"]
        calls.aborts["holder"].abort()
        await wait_all_tasks_blocked()
        holder = calls.records["holder"]
        assert holder.tool_ran and holder.status is SettlementStatus.CANCELLED
        assert gate.started == ["holder", "next"]
        assert stats(pipeline, "execute") == (1, 0, 1)
        gate.open("next")
    assert stats(pipeline, "execute") == (0, 0, 1)
    assert gate.max_inside == 1


async def test_cancel_from_outside_releases_slot() -> None:
    gate = Gate()
    pipeline = ToolPipeline([gate.tool("run", "execute")], scheduler=ToolScheduler(SchedulerLimits(execute=1)))
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            calls = Calls(nursery)
            await calls.submit(pipeline, "run", "a")
            await calls.submit(pipeline, "run", "b")
            assert stats(pipeline, "execute") == (1, 1, 1)
            scope.cancel()
    assert stats(pipeline, "execute") == (0, 0, 1)
    assert pipeline.journal.kinds("a")[-1] == "settled"  # type: ignore[attr-defined]
    assert pipeline.journal.kinds("b")[-1] == "settled"  # type: ignore[attr-defined]


async def test_scheduler_direct_fifo_and_cancel() -> None:
    scheduler = ToolScheduler(SchedulerLimits(write=1))
    order: list[str] = []
    assert scheduler.try_acquire(ToolKind.WRITE)
    assert not scheduler.try_acquire(ToolKind.WRITE)

    async def waiter(name: str, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await scheduler.acquire(ToolKind.WRITE)
            order.append(name)
            scheduler.release(ToolKind.WRITE)

    async with trio.open_nursery() as nursery:
        await nursery.start(waiter, "first")
        second = await nursery.start(waiter, "second")
        await nursery.start(waiter, "third")
        await wait_all_tasks_blocked()
        assert scheduler.statistics().buckets["write"] == (1, 3, 1)
        second.cancel()
        await wait_all_tasks_blocked()
        assert scheduler.statistics().buckets["write"] == (1, 2, 1)
        scheduler.release(ToolKind.WRITE)
    assert order == ["first", "third"]
    assert scheduler.statistics().buckets["write"] == (0, 0, 1)


async def test_shared_scheduler_shares_buckets() -> None:
    gate = Gate()
    shared = ToolScheduler(SchedulerLimits(execute=1))
    first = ToolPipeline([gate.tool("run", "execute")], scheduler=shared)
    second = ToolPipeline([gate.tool("run", "execute")], scheduler=shared)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(first, "run", "p1")
        await calls.submit(second, "run", "p2")
        assert gate.started == ["p1"]
        assert stats(shared, "execute") == (1, 1, 1)
        gate.open("p1")
        await wait_all_tasks_blocked()
        assert gate.started == ["p1", "p2"]
        gate.open("p2")
    assert gate.max_inside == 1


async def test_separate_pipelines_do_not_share_buckets() -> None:
    gate = Gate()
    first = ToolPipeline([gate.tool("run", "execute")])
    second = ToolPipeline([gate.tool("run", "execute")])
    assert first.scheduler is not second.scheduler
    limit = SchedulerLimits().execute
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        for i in range(limit + 1):
            await calls.submit(first, "run", f"first{i}")
        await calls.submit(second, "run", "second")
        assert gate.started == [f"first{i}" for i in range(limit)] + ["second"]
        assert stats(first, "execute") == (limit, 1, limit)
        assert stats(second, "execute") == (1, 0, limit)
        for key in list(gate.events):
            gate.open(key)
        await wait_all_tasks_blocked()
        for key in list(gate.events):
            gate.open(key)


@pytest.mark.parametrize("value", [0, -1, 1.5, "3", None, True])
@pytest.mark.parametrize("kind", ["readonly", "write", "execute"])
async def test_invalid_limits_are_config_errors(kind: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=kind):
        SchedulerLimits(**{kind: value})


# -- file locks ----------------------------------------------------------------------


def lock_pipeline(gate: Gate, **kwargs: Any) -> ToolPipeline:
    return ToolPipeline(
        [
            gate.tool("write", "write"),
            gate.tool("read", "readonly"),
            gate.tool("read_unsafe", "readonly", concurrency_safe=False),
        ],
        workspace=WORKSPACE,
        **kwargs,
    )


async def test_writers_on_the_same_path_are_serialized() -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "write", "w1", paths=["f.txt"])
        await calls.submit(pipeline, "write", "w2", paths=["f.txt"])
        assert gate.started == ["w1"]
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/f.txt": (0, True, 1)}
        assert pipeline.journal.kinds("w2") == ["scheduled"]  # type: ignore[attr-defined]
        gate.open("w1")
        await wait_all_tasks_blocked()
        assert gate.started == ["w1", "w2"]
        assert gate.finished == ["w1"]
        gate.open("w2")
    assert gate.max_inside == 1
    assert pipeline.file_locks.held() == {}


async def test_writers_on_different_paths_run_together() -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "write", "w1", paths=["a"])
        await calls.submit(pipeline, "write", "w2", paths=["b"])
        assert gate.inside == {"w1", "w2"}
        gate.open("w1")
        gate.open("w2")


async def test_readonly_concurrency_safe_calls_share_the_lock() -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "read", "r1", paths=["f.txt"])
        await calls.submit(pipeline, "read", "r2", paths=["f.txt"])
        assert gate.inside == {"r1", "r2"}
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/f.txt": (2, False, 0)}
        gate.open("r1")
        gate.open("r2")
    assert pipeline.file_locks.held() == {}


async def test_readonly_not_concurrency_safe_is_exclusive() -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "read_unsafe", "u1", paths=["f.txt"])
        await calls.submit(pipeline, "read", "r1", paths=["f.txt"])
        assert gate.started == ["u1"]
        gate.open("u1")
        await wait_all_tasks_blocked()
        assert gate.started == ["u1", "r1"]
        gate.open("r1")
    assert gate.max_inside == 1


async def test_writer_is_not_starved_by_later_readers() -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "read", "r1", paths=["f.txt"])
        await calls.submit(pipeline, "write", "w", paths=["f.txt"])
        await calls.submit(pipeline, "read", "r2", paths=["f.txt"])
        await calls.submit(pipeline, "read", "r3", paths=["f.txt"])
        # r2 and r3 could share with r1, but they arrived after the writer
        assert gate.started == ["r1"]
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/f.txt": (1, False, 3)}
        gate.open("r1")
        await wait_all_tasks_blocked()
        assert gate.started == ["r1", "w"]
        gate.open("w")
        await wait_all_tasks_blocked()
        # both readers are granted together (their tasks may be scheduled in either order)
        assert gate.started[:2] == ["r1", "w"]
        assert gate.inside == {"r2", "r3"}
        gate.open("r2")
        gate.open("r3")
    assert pipeline.file_locks.held() == {}


def test_paths_are_normalised_deduplicated_and_sorted() -> None:
    assert FileLockManager.normalise(["c", "./a/../b", "b", "/abs/x", "d/./e/"], WORKSPACE) == (
        "/abs/x",
        f"{WORKSPACE}/b",
        f"{WORKSPACE}/c",
        f"{WORKSPACE}/d/e",
    )


async def test_equivalent_paths_share_one_lock() -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "write", "w1", paths=["./a/../b", "c"])
        await calls.submit(pipeline, "write", "w2", paths=["b"])
        assert gate.started == ["w1"]
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/b": (0, True, 1), f"{WORKSPACE}/c": (0, True, 0)}
        gate.open("w1")
        await wait_all_tasks_blocked()
        assert gate.started == ["w1", "w2"]
        gate.open("w2")
    assert pipeline.file_locks.held() == {}


async def test_overlapping_path_sets_in_opposite_order_do_not_deadlock(autojump_clock: Any) -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            calls = Calls(nursery)
            await calls.submit(pipeline, "write", "hold_a", paths=["a"])
            await calls.submit(pipeline, "write", "ba", paths=["b", "a"])
            await calls.submit(pipeline, "write", "ab", paths=["a", "b"])
            assert gate.started == ["hold_a"]
            for key in ("hold_a", "ba", "ab"):
                gate.open(key)
    assert gate.started == ["hold_a", "ba", "ab"]
    assert all(record.result.ok for record in calls.records.values())


async def test_lock_wait_is_bounded(autojump_clock: Any) -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate, lock_timeout=1)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "write", "w1", paths=["f.txt"])
        start = trio.current_time()
        record = await call_tool(pipeline, "write", {"id": "w2", "paths": ["f.txt"]}, call_id="w2")
        assert trio.current_time() - start == pytest.approx(1)
        assert record.result.error is not None
        assert record.result.error.type is ToolErrorType.TIMEOUT
        assert record.result.error.code == "lock_timeout"
        assert not record.tool_ran
        assert gate.started == ["w1"]
        assert pipeline.journal.kinds("w2") == ["scheduled", "settled"]  # type: ignore[attr-defined]
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/f.txt": (0, True, 0)}
        assert stats(pipeline, "write") == (1, 0, 10)
        gate.open("w1")
    assert pipeline.file_locks.held() == {}


async def test_locks_are_released_on_cancel() -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "write", "holder", paths=["x", "y"])
        await calls.submit(pipeline, "write", "waiter", paths=["y", "z"])
        assert pipeline.file_locks.held()[f"{WORKSPACE}/y"] == (0, True, 1)
        calls.aborts["waiter"].abort()
        await wait_all_tasks_blocked()
        assert not calls.records["waiter"].tool_ran
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/x": (0, True, 0), f"{WORKSPACE}/y": (0, True, 0)}
        calls.aborts["holder"].abort()
    assert calls.records["holder"].tool_ran
    assert calls.records["holder"].status is SettlementStatus.CANCELLED
    assert pipeline.file_locks.held() == {}
    assert stats(pipeline, "write") == (0, 0, 10)


# -- slot_released ---------------------------------------------------------------------


def nesting_pipeline(*, release: bool) -> ToolPipeline:
    holder: list[ToolPipeline] = []

    async def child(inp: dict[str, Any], ctx: Any) -> str:
        return "child done"

    async def parent(inp: dict[str, Any], ctx: Any) -> str:
        call = ToolCall(f"{ctx.tool_call_id}/child", "child", {})
        if release:
            async with ctx.slot_released():
                record = await holder[0].execute(call)
        else:
            record = await holder[0].execute(call)
        return f"parent saw {record.result.output}"

    tools = [
        define_tool(fn, description=fn.__name__, side_effect="pure", input_schema={"type": "object"})
        for fn in (parent, child)
    ]
    pipeline = ToolPipeline(tools, scheduler=ToolScheduler(SchedulerLimits(execute=1)))
    holder.append(pipeline)
    return pipeline


async def test_slot_released_lets_nested_call_run(autojump_clock: Any) -> None:
    pipeline = nesting_pipeline(release=True)
    with trio.fail_after(60):
        record = await call_tool(pipeline, "parent", {}, call_id="p")
    assert record.result == ToolResult.success("parent saw child done")
    assert [r.call.id for r in pipeline.history] == ["p/child", "p"]
    assert stats(pipeline, "execute") == (0, 0, 1)


async def test_without_slot_released_the_nested_call_deadlocks(autojump_clock: Any) -> None:
    pipeline = nesting_pipeline(release=False)
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(60):
            await call_tool(pipeline, "parent", {}, call_id="p")
    assert stats(pipeline, "execute") == (0, 0, 1)


async def test_slot_is_reacquired_behind_earlier_waiters() -> None:
    gate = Gate()
    events: list[str] = []
    child_done = trio.Event()

    async def parent(inp: dict[str, Any], ctx: Any) -> str:
        events.append("parent start")
        async with ctx.slot_released():
            events.append("parent released")
            await child_done.wait()
        events.append("parent resumed")
        return "parent"

    tools = [
        gate.tool("other", "execute"),
        define_tool(parent, description="p", side_effect="pure", input_schema={"type": "object"}),
    ]
    pipeline = ToolPipeline(tools, scheduler=ToolScheduler(SchedulerLimits(execute=1)))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "parent", "p")
        # the parent gave its slot back: another call gets it
        await calls.submit(pipeline, "other", "o1")
        assert gate.started == ["o1"]
        await calls.submit(pipeline, "other", "o2")
        child_done.set()
        await wait_all_tasks_blocked()
        # the parent queues for its slot behind o2, which was waiting first
        assert events == ["parent start", "parent released"]
        gate.open("o1")
        await wait_all_tasks_blocked()
        assert gate.started == ["o1", "o2"]
        assert events == ["parent start", "parent released"]
        gate.open("o2")
        await wait_all_tasks_blocked()
        assert events[-1] == "parent resumed"
    assert calls.records["p"].result == ToolResult.success("parent")
    assert stats(pipeline, "execute") == (0, 0, 1)


# -- what the slot and the locks are chosen from ---------------------------------------


async def test_slot_kind_is_resolved_from_the_final_input() -> None:
    gate = Gate()

    def resolve(inp: dict[str, Any]) -> Any:
        return BehaviorOverride(kind=ToolKind.READONLY) if inp.get("ro") else None

    async def make_readonly(request: Any, call_next: Any) -> ToolResult:
        if request.input["id"].startswith("ro"):
            return await call_next(request.replace(input={**request.input, "ro": True}))
        return await call_next()

    scheduler = ToolScheduler(SchedulerLimits(execute=1, readonly=1))
    pipeline = ToolPipeline(
        [gate.tool("run", "execute", resolve_behavior=resolve)], scheduler=scheduler, middleware=[make_readonly]
    )
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "run", "ex1")
        await calls.submit(pipeline, "run", "ro1")  # the execute bucket is full, readonly is not
        await calls.submit(pipeline, "run", "ex2")
        assert gate.started == ["ex1", "ro1"]
        assert stats(scheduler, "execute") == (1, 1, 1)
        assert stats(scheduler, "readonly") == (1, 0, 1)
        for key in ("ex1", "ro1", "ex2"):
            gate.open(key)
    assert stats(scheduler, "execute") == (0, 0, 1)
    assert stats(scheduler, "readonly") == (0, 0, 1)


async def test_locks_follow_the_paths_of_the_final_input() -> None:
    gate = Gate()

    async def redirect(request: Any) -> Any:
        if request.input["id"] == "moved":
            return Allow(input={**request.input, "paths": ["b"]})
        return None

    pipeline = ToolPipeline([gate.tool("write", "write")], workspace=WORKSPACE, stages=ToolStages(pre_tool=[redirect]))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "write", "hold_b", paths=["b"])
        await calls.submit(pipeline, "write", "moved", paths=["a"])  # model asked for a, stage moved it to b
        assert gate.started == ["hold_b"]
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/b": (0, True, 1)}
        gate.open("hold_b")
        await wait_all_tasks_blocked()
        assert gate.started == ["hold_b", "moved"]
        gate.open("moved")
    assert calls.records["moved"].effective_input["paths"] == ["b"]


async def test_tool_timeout_does_not_count_the_wait_for_a_slot(autojump_clock: Any) -> None:
    async def work(inp: dict[str, Any], ctx: Any) -> str:
        await trio.sleep(inp["seconds"])
        return f"worked {inp['seconds']}"

    tool = define_tool(
        work,
        description="w",
        side_effect="pure",
        input_schema={"type": "object", "properties": {"seconds": {"type": "number"}}},
        timeout=5,
    )
    pipeline = ToolPipeline([tool], scheduler=ToolScheduler(SchedulerLimits(execute=1)))
    records: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        for key, seconds in (("first", 4), ("second", 4)):

            async def go(key: str = key, seconds: float = seconds) -> None:
                records[key] = await call_tool(pipeline, "work", {"seconds": seconds})

            nursery.start_soon(go)
            await wait_all_tasks_blocked()
    # the second call waited 4 s for the slot and then ran 4 s: 8 s in all, each run under its 5 s timeout
    assert trio.current_time() == pytest.approx(8)
    assert records["first"].result == ToolResult.success("worked 4")
    assert records["second"].result == ToolResult.success("worked 4")
    assert records["second"].duration == pytest.approx(8)


async def test_slot_released_wait_cancelled_leaves_the_bucket_consistent() -> None:
    child_started = trio.Event()

    async def parent(inp: dict[str, Any], ctx: Any) -> str:
        async with ctx.slot_released():
            child_started.set()
            await trio.sleep_forever()
        return "never"

    gate = Gate()
    tools = [
        define_tool(parent, description="p", side_effect="pure", input_schema={"type": "object"}),
        gate.tool("other", "execute"),
    ]
    pipeline = ToolPipeline(tools, scheduler=ToolScheduler(SchedulerLimits(execute=1)))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "parent", "p")
        assert stats(pipeline, "execute") == (0, 0, 1)
        await calls.submit(pipeline, "other", "o")
        assert gate.started == ["o"]
        calls.aborts["p"].abort()
        await wait_all_tasks_blocked()
        assert calls.records["p"].status is SettlementStatus.CANCELLED
        assert stats(pipeline, "execute") == (1, 0, 1)
        gate.open("o")
    assert stats(pipeline, "execute") == (0, 0, 1)


async def test_a_call_waiting_for_a_lock_leaves_the_slot_to_the_holder_s_child(autojump_clock: Any) -> None:
    # The parent holds /ws/a and gives its slot back to run a child under it; an unrelated call that
    # comes meanwhile waits for /ws/a without the slot, so the child (and the parent's re-acquire)
    # get one: no one waits out the lock_timeout.
    gate = Gate()
    holder: list[ToolPipeline] = []
    child_records: list[Any] = []

    async def parent(inp: dict[str, Any], ctx: Any) -> str:
        async with ctx.slot_released():
            await gate.events["parent"].wait()
            origin = CallOrigin(lineage=(ctx.execution.call_key,))
            child_records.append(await holder[0].execute(ToolCall("c", "child", {"id": "c", "paths": ["a"]}), origin))
        return "parent"

    tools = [
        gate.tool("child", "write"),
        gate.tool("unrelated", "write"),
        define_tool(
            parent, description="p", side_effect="pure", kind="write", input_schema=SCHEMA,
            affected_paths=lambda inp: inp.get("paths", []),
        ),
    ]  # fmt: skip
    pipeline = ToolPipeline(tools, scheduler=ToolScheduler(SchedulerLimits(write=1)), workspace=WORKSPACE)
    holder.append(pipeline)
    with trio.fail_after(5):  # the lock_timeout is 30 s: a deadlock fails here
        async with trio.open_nursery() as nursery:
            calls = Calls(nursery)
            await calls.submit(pipeline, "parent", "p", paths=["a"])
            await calls.submit(pipeline, "unrelated", "u", paths=["a"])
            assert stats(pipeline, "write") == (0, 0, 1)  # the lock waiter holds no slot
            gate.open("parent")
            await wait_all_tasks_blocked()
            assert gate.started == ["c"]
            gate.open("c")
            await wait_all_tasks_blocked()
            assert gate.started == ["c", "u"]  # after the parent ended and let go of /ws/a
            gate.open("u")
    assert trio.current_time() == 0
    assert child_records[0].result == ToolResult.success("child:c")
    assert calls.records["p"].result == ToolResult.success("parent")
    assert calls.records["u"].result == ToolResult.success("unrelated:u")
    assert stats(pipeline, "write") == (0, 0, 1)
    assert pipeline.file_locks.held() == {}


async def test_slot_released_re_acquires_past_a_call_waiting_for_its_lock(autojump_clock: Any) -> None:
    gate = Gate()
    events: list[str] = []

    async def parent(inp: dict[str, Any], ctx: Any) -> str:
        async with ctx.slot_released():
            await gate.events["parent"].wait()
        events.append("parent resumed")
        return "parent"

    tools = [
        gate.tool("other", "execute"),
        define_tool(
            parent, description="p", side_effect="pure", input_schema=SCHEMA,
            affected_paths=lambda inp: inp.get("paths", []),
        ),
    ]  # fmt: skip
    pipeline = ToolPipeline(tools, scheduler=ToolScheduler(SchedulerLimits(execute=1)), workspace=WORKSPACE)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            calls = Calls(nursery)
            await calls.submit(pipeline, "parent", "p", paths=["a"])
            await calls.submit(pipeline, "other", "o", paths=["a"])
            gate.open("parent")
            await wait_all_tasks_blocked()
            assert events == ["parent resumed"]
            assert gate.started == ["o"]
            gate.open("o")
    assert trio.current_time() == 0
    assert calls.records["p"].result == ToolResult.success("parent")
    assert calls.records["o"].result == ToolResult.success("other:o")


async def test_cleanup_overrun_holds_back_new_tool_starts(autojump_clock: Any) -> None:
    cleanup_done = trio.Event()

    async def stubborn(inp: dict[str, Any], ctx: Any) -> str:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(10)  # ignores the 2 s cleanup grace
                cleanup_done.set()
        return "never"

    started_at: list[float] = []

    async def quick(inp: dict[str, Any], ctx: Any) -> str:
        started_at.append(trio.current_time())
        return "quick"

    tools = [
        define_tool(fn, description=fn.__name__, side_effect="pure", input_schema={"type": "object"})
        for fn in (stubborn, quick)
    ]
    pipeline = ToolPipeline(tools, cleanup_grace=2)
    abort = AbortHandle()
    records: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:

        async def go_stubborn() -> None:
            records["stubborn"] = await call_tool(pipeline, "stubborn", {}, abort=abort)

        nursery.start_soon(go_stubborn)
        await wait_all_tasks_blocked()
        cancelled_at = trio.current_time()
        abort.abort()
        await trio.sleep(3)  # virtual time: past the 2 s grace, the cleanup is now overrunning
        records["quick"] = await call_tool(pipeline, "quick", {})
    assert cleanup_done.is_set()
    assert started_at == [pytest.approx(cancelled_at + 10)]
    assert pipeline.cleanup_overruns == 1
    assert FaultCode.CLEANUP_OVERRUN in [fault.code for fault in records["stubborn"].faults]
    assert records["quick"].result == ToolResult.success("quick")


async def test_readers_behind_a_cancelled_writer_go_at_once() -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "read", "r1", paths=["f.txt"])
        await calls.submit(pipeline, "write", "w", paths=["f.txt"])
        await calls.submit(pipeline, "read", "r2", paths=["f.txt"])
        assert gate.started == ["r1"]
        calls.aborts["w"].abort()
        await wait_all_tasks_blocked()
        assert not calls.records["w"].tool_ran
        assert gate.inside == {"r1", "r2"}
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/f.txt": (2, False, 0)}
        gate.open("r1")
        gate.open("r2")
    assert pipeline.file_locks.held() == {}


async def test_lock_timeout_gives_back_the_paths_already_taken(autojump_clock: Any) -> None:
    gate = Gate()
    pipeline = lock_pipeline(gate, lock_timeout=1)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "write", "hold_b", paths=["b"])
        record = await call_tool(pipeline, "write", {"id": "ab", "paths": ["b", "a"]}, call_id="ab")
        assert record.result.error is not None and record.result.error.code == "lock_timeout"
        assert f"{WORKSPACE}/b" in record.result.error.message
        # "a" was only queued for (a waiter holds none of its paths), and nothing is left of it
        assert pipeline.file_locks.held() == {f"{WORKSPACE}/b": (0, True, 0)}
        await calls.submit(pipeline, "write", "a_only", paths=["a"])
        assert gate.inside == {"hold_b", "a_only"}
        gate.open("hold_b")
        gate.open("a_only")
    assert pipeline.file_locks.held() == {}


async def test_a_descendant_takes_a_path_its_ancestor_holds_and_unrelated_calls_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trio_agent._errors import FileLockTimeoutError
    from trio_agent._tools._scheduler import FileLockManager

    locks = FileLockManager()
    paths = ("/w/a",)
    held = await locks.acquire_all(paths, True, 1.0, owner="root/task_1")
    assert held == paths
    # A subagent's call under the task call: its ancestor's hold is no obstacle; it holds the path too.
    inherited = await locks.acquire_all(paths, True, 1.0, owner="helper-1/call_1", lineage=("root/task_1",))
    assert inherited == paths
    assert locks.held() == {"/w/a": (0, True, 0)}
    locks.release_all(inherited, exclusive=True, owner="helper-1/call_1")
    # An unrelated call waits (and here times out): the ancestor still holds it.
    with pytest.raises(FileLockTimeoutError):
        await locks.acquire_all(paths, True, 1.0, owner="other/call_9", lineage=("root/other",))
    locks.release_all(held, exclusive=True, owner="root/task_1")
    assert locks.held() == {}


async def test_a_descendant_writer_waits_for_an_unrelated_reader_beside_its_reading_ancestor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trio_agent._errors import FileLockTimeoutError
    from trio_agent._tools._scheduler import FileLockManager

    locks = FileLockManager()
    paths = ("/w/a",)
    parent = await locks.acquire_all(paths, False, 1.0, owner="root/task_1")  # a read-only task
    reader = await locks.acquire_all(paths, False, 1.0, owner="root/read_7")  # an unrelated reader
    # A shared request under the reading ancestor reads beside it, and gives its read back.
    sibling = await locks.acquire_all(paths, False, 1.0, owner="sub-1/read_1", lineage=("root/task_1",))
    assert locks.held() == {"/w/a": (3, False, 0)}
    locks.release_all(sibling, exclusive=False, owner="sub-1/read_1")
    taken: list[tuple[str, ...]] = []

    async def child_writer() -> None:
        taken.append(await locks.acquire_all(paths, True, 5.0, owner="sub-1/write_1", lineage=("root/task_1",)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(child_writer)
        await trio.testing.wait_all_tasks_blocked()
        assert taken == []  # the ancestor only reads: the unrelated reader keeps the writer out
        assert locks.held() == {"/w/a": (2, False, 1)}
        locks.release_all(reader, exclusive=False, owner="root/read_7")
    # Only its ancestor reads now, and the ancestor waits for it: the writer goes in beside that read.
    assert taken == [paths]
    assert locks.held() == {"/w/a": (1, True, 0)}
    # Meanwhile another reader waits for the writer.
    with pytest.raises(FileLockTimeoutError):
        await locks.acquire_all(paths, False, 1.0, owner="root/read_8")
    locks.release_all(taken[0], exclusive=True, owner="sub-1/write_1")
    locks.release_all(parent, exclusive=False, owner="root/task_1")
    assert locks.held() == {}


async def test_a_descendant_writer_goes_ahead_of_a_queued_writer_that_waits_for_its_reading_ancestor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trio_agent._tools._scheduler import FileLockManager

    locks = FileLockManager()
    paths = ("/w/a",)
    parent = await locks.acquire_all(paths, False, 1.0, owner="root/task_1")
    queued: list[tuple[str, ...]] = []

    async def unrelated_writer() -> None:
        queued.append(await locks.acquire_all(paths, True, 5.0, owner="root/write_9"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unrelated_writer)
        await trio.testing.wait_all_tasks_blocked()
        # The queued writer waits for the ancestor, the ancestor for its descendant: it goes first.
        child = await locks.acquire_all(paths, True, 1.0, owner="sub-1/write_1", lineage=("root/task_1",))
        assert child == paths
        locks.release_all(child, exclusive=True, owner="sub-1/write_1")
        await trio.testing.wait_all_tasks_blocked()
        assert queued == []  # still behind the ancestor's read
        locks.release_all(parent, exclusive=False, owner="root/task_1")
    assert queued == [paths]
    locks.release_all(queued[0], exclusive=True, owner="root/write_9")
    assert locks.held() == {}


@pytest.mark.parametrize(
    ("ancestor_exclusive", "first_exclusive", "second_exclusive"),
    [(True, True, True), (True, True, False), (True, False, True), (False, True, False), (False, False, True)],
)
async def test_two_calls_under_one_ancestor_exclude_each_other(
    autojump_clock: trio.testing.MockClock, ancestor_exclusive: bool, first_exclusive: bool, second_exclusive: bool
) -> None:
    locks = FileLockManager()
    paths = ("/w/a",)
    lineage = ("root/task_1",)
    parent = await locks.acquire_all(paths, ancestor_exclusive, 1.0, owner="root/task_1")
    first = await locks.acquire_all(paths, first_exclusive, 1.0, owner="sub-1/call_1", lineage=lineage)
    taken: list[tuple[str, ...]] = []

    async def second() -> None:
        taken.append(await locks.acquire_all(paths, second_exclusive, 5.0, owner="sub-1/call_2", lineage=lineage))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await wait_all_tasks_blocked()
        assert taken == []  # the ancestor's hold lets each in, but not beside its sibling
        assert locks.held()["/w/a"][2] == 1
        locks.release_all(first, exclusive=first_exclusive, owner="sub-1/call_1")
    assert taken == [paths]
    locks.release_all(taken[0], exclusive=second_exclusive, owner="sub-1/call_2")
    locks.release_all(parent, exclusive=ancestor_exclusive, owner="root/task_1")
    assert locks.held() == {}


async def test_a_call_waiting_for_its_sibling_goes_ahead_of_a_call_waiting_for_their_ancestor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    locks = FileLockManager()
    paths = ("/w/a",)
    lineage = ("root/task_1",)
    parent = await locks.acquire_all(paths, True, 1.0, owner="root/task_1")
    first = await locks.acquire_all(paths, True, 1.0, owner="sub-1/call_1", lineage=lineage)
    order: list[str] = []

    async def take(owner: str, lineage: tuple[str, ...]) -> None:
        taken = await locks.acquire_all(paths, True, 5.0, owner=owner, lineage=lineage)
        order.append(owner)
        locks.release_all(taken, exclusive=True, owner=owner)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "root/other_9", ())  # waits for the ancestor, which waits for its calls
        await wait_all_tasks_blocked()
        nursery.start_soon(take, "sub-1/call_2", lineage)
        await wait_all_tasks_blocked()
        locks.release_all(first, exclusive=True, owner="sub-1/call_1")
        await wait_all_tasks_blocked()
        assert order == ["sub-1/call_2"]
        locks.release_all(parent, exclusive=True, owner="root/task_1")
    assert order == ["sub-1/call_2", "root/other_9"]
    assert locks.held() == {}


async def test_calls_a_subagent_runs_side_by_side_under_its_task_do_not_overlap_on_a_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = Gate()
    holder: list[ToolPipeline] = []

    async def task(inp: dict[str, Any], ctx: Any) -> str:
        origin = CallOrigin(lineage=(ctx.execution.call_key,))
        async with ctx.slot_released(), trio.open_nursery() as nursery:
            for key, name in (("w1", "write"), ("r1", "read"), ("w2", "write")):
                nursery.start_soon(holder[0].execute, ToolCall(key, name, {"id": key, "paths": ["a"]}), origin)
                await wait_all_tasks_blocked()
        return "task"

    tools = [
        gate.tool("write", "write"),
        gate.tool("read", "readonly", concurrency_safe=True),
        define_tool(
            task, description="t", side_effect="pure", kind="write", input_schema=SCHEMA,
            affected_paths=lambda inp: inp.get("paths", []),
        ),
    ]  # fmt: skip
    pipeline = ToolPipeline(tools, workspace=WORKSPACE)
    holder.append(pipeline)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "task", "t", paths=["a"])
        # The task's exclusive hold lets each of its calls in, one at a time.
        for key, started in (("w1", ["w1"]), ("r1", ["w1", "r1"]), ("w2", ["w1", "r1", "w2"])):
            assert gate.started == started
            gate.open(key)
            await wait_all_tasks_blocked()
    assert calls.records["t"].result == ToolResult.success("task")
    assert gate.max_inside == 1
    assert gate.finished == ["w1", "r1", "w2"]
    assert pipeline.file_locks.held() == {}


# -- calls that take no slot --------------------------------------------------------


async def test_an_unscheduled_tool_runs_with_its_bucket_full_and_takes_no_slot() -> None:
    """The built-in `task` / `task_output` (`unscheduled`) hold no resource a slot stands for: their
    calls run with every slot of their kind held, on each way to the tool (at once; through the
    waits before it, here file locks; after waiting for a lock), and take none."""
    gate = Gate()
    pipeline = ToolPipeline(
        [gate.tool("read", "readonly"), gate.tool("write", "write"), unscheduled(gate.tool("control", "readonly"))],
        workspace=WORKSPACE,
        scheduler=ToolScheduler(SchedulerLimits(readonly=1)),
    )
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        await calls.submit(pipeline, "read", "r1")  # holds the only read-only slot
        await calls.submit(pipeline, "write", "w1", paths=["f.txt"])  # holds f.txt
        await calls.submit(pipeline, "control", "c1")
        await calls.submit(pipeline, "control", "c2", paths=["g.txt"])
        await calls.submit(pipeline, "control", "c3", paths=["f.txt"])  # waits for w1's lock
        await calls.submit(pipeline, "read", "r2")  # waits for the slot
        assert gate.started == ["r1", "w1", "c1", "c2"]
        assert stats(pipeline, "readonly") == (1, 1, 1)
        gate.open("w1")
        await wait_all_tasks_blocked()
        assert gate.started == ["r1", "w1", "c1", "c2", "c3"]
        assert stats(pipeline, "readonly") == (1, 1, 1)
        for key in ("c1", "c2", "c3"):
            gate.open(key)
        await wait_all_tasks_blocked()
        assert "r2" not in gate.started, "the control calls gave back no slot they never took"
        gate.open("r1")
        await wait_all_tasks_blocked()
        gate.open("r2")
    assert stats(pipeline, "readonly") == (0, 0, 1)
    assert all(record.result.ok for record in calls.records.values())
    assert pipeline.file_locks.held() == {}
