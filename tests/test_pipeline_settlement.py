"""Settlement under every kind of cancellation, and what the journal records of a call.

The invariant: every scheduled call ends settled (completed if its core finished,
else cancelled), never published unfinished; where nothing can be written any
more the journal is fenced and the caller gets the cancellation (or the journal
error); a group holding ``trio.Cancelled`` stays a cancellation and comes out
unchanged; middleware that returns early never wedges the call.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_agent import LeaseLostError, SideEffect, Tool, ToolErrorType, ToolResult, define_tool
from trio_agent._tools._scheduler import SchedulerLimits, ToolScheduler
from trio_agent.journal import (
    AppendBatch,
    AppendTicket,
    DurableJournal,
    JournalStore,
    MemoryStore,
    RecoveryKind,
    ToolCancelled,
    ToolRecoveryAction,
    ToolScheduled,
    ToolStarted,
    ToolState,
    open_journal,
    open_sqlite_store,
)
from trio_agent.testing import LeaseStub, call_tool, start_turn
from trio_agent.tools import (
    BehaviorOverride,
    Effect,
    FaultCode,
    InMemoryToolJournal,
    SettlementStatus,
    Skip,
    ToolCall,
    ToolError,
    ToolMiddlewareRequest,
    ToolPipeline,
    ToolStages,
)

# ---------------------------------------------------------------- helpers


@asynccontextmanager
async def make_store(kind: str, tmp_path: Path) -> AsyncIterator[JournalStore]:
    if kind == "memory":
        yield MemoryStore(clock=trio.current_time)
    else:
        async with open_sqlite_store(tmp_path / "j.db") as store:
            yield store


class CancellingStore:
    """Passes everything through; when a batch holding a given event type is submitted, runs ``on_submit``."""

    def __init__(self, inner: JournalStore) -> None:
        self.inner = inner
        self.clock = inner.clock
        self.trigger: type[Any] | None = None
        self.on_submit: Callable[[], None] | None = None

    def submit(self, batch: AppendBatch) -> AppendTicket:
        ticket = self.inner.submit(batch)
        if self.trigger is not None and any(isinstance(e.event, self.trigger) for e in batch.envelopes):
            self.trigger = None
            assert self.on_submit is not None
            self.on_submit()
        return ticket

    async def append(self, batch: AppendBatch) -> Any:
        return await self.submit(batch).wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class HangingStore(CancellingStore):
    """Like `CancellingStore`, but the triggering batch never reaches the store (its commit hangs)."""

    def submit(self, batch: AppendBatch) -> AppendTicket:
        if self.trigger is not None and any(isinstance(e.event, self.trigger) for e in batch.envelopes):
            self.trigger = None
            assert self.on_submit is not None
            self.on_submit()
            return AppendTicket(batch)  # never resolved
        return self.inner.submit(batch)


def simple_tool(name: str = "work", *, side_effect: str = "idempotent", **kwargs: Any) -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        return ToolResult.success(f"ran:{inp}")

    return define_tool(
        run, name=name, description="works", side_effect=side_effect, input_schema={"type": "object"}, **kwargs
    )


def kinds(journal: InMemoryToolJournal, call_id: str) -> list[str]:
    return journal.kinds(call_id)


def settled_entry(journal: InMemoryToolJournal, call_id: str) -> dict[str, Any]:
    (found,) = [e.data for e in journal.entries if e.call_id == call_id and e.kind == "settled"]
    return found


def codes(record: Any) -> list[FaultCode]:
    return [fault.code for fault in record.faults]


class Journals:
    """One call's journal, in memory or durable, read the same way."""

    def __init__(self, journal: InMemoryToolJournal | DurableJournal) -> None:
        self.journal = journal

    def states(self, call_id: str) -> list[str]:
        if isinstance(self.journal, InMemoryToolJournal):
            return self.journal.kinds(call_id)
        record = self.journal.call(call_id)
        assert record is not None
        out = ["scheduled"] + ["started"] * record.attempts
        if record.settlement is not None:
            out.append("settled")
        return out

    def synthetic(self, call_id: str) -> bool | None:
        if isinstance(self.journal, InMemoryToolJournal):
            found = [e.data["synthetic"] for e in self.journal.entries if e.call_id == call_id and e.kind == "started"]
            return found[0] if found else None
        return None


@asynccontextmanager
async def journal_of(kind: str) -> AsyncIterator[tuple[Journals, Any]]:
    """``(journals, origin)`` for a fresh in-memory or durable (MemoryStore) journal."""
    if kind == "memory":
        yield Journals(InMemoryToolJournal()), None
        return
    async with open_journal(MemoryStore(clock=trio.current_time), session_id="s") as journal:
        origin = await start_turn(journal)
        yield Journals(journal), origin


JOURNALS = ["memory", "durable"]

# ---------------------------------------------------------------- defect 1: cancel while tool_scheduled commits


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_outside_cancel_while_tool_scheduled_commits_settles_the_call(store_kind: str, tmp_path: Path) -> None:
    async with make_store(store_kind, tmp_path) as inner:
        store = CancellingStore(inner)
        async with open_journal(store, session_id="s") as journal:  # type: ignore[arg-type]
            origin = await start_turn(journal)
            pipeline = ToolPipeline([simple_tool()], journal=journal)
            with trio.CancelScope() as outside:
                store.trigger = ToolScheduled
                store.on_submit = outside.cancel
                await pipeline.execute(ToolCall("c1", "work", {}), origin)
            assert outside.cancelled_caught
            assert not journal.fenced
            record = journal.projection().tool("c1")
            assert record is not None and record.state is ToolState.CANCELLED
        async with open_journal(inner, session_id="s") as reopened:
            assert reopened.projection().tool("c1").state is ToolState.CANCELLED  # type: ignore[union-attr]
            events = [e.event for e in await inner.read(reopened.stream_id())]
            # The scheduling is deferred into the start's batch: the cancel lands while both commit.
            assert [type(e) for e in events if getattr(e, "call_id", None) == "c1"] == [
                ToolScheduled,
                ToolStarted,
                ToolCancelled,
            ]


async def test_outside_cancel_while_tool_scheduled_hangs_fences_and_cancels(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inner = MemoryStore(clock=trio.current_time)
    store = HangingStore(inner)
    async with open_journal(store, session_id="s", commit_grace=1.0) as journal:  # type: ignore[arg-type]
        origin = await start_turn(journal)
        pipeline = ToolPipeline([simple_tool()], journal=journal)
        with trio.CancelScope() as outside:
            store.trigger = ToolScheduled
            store.on_submit = outside.cancel
            await pipeline.execute(ToolCall("c1", "work", {}), origin)
        assert outside.cancelled_caught  # the cancellation went on; nothing could be written
        assert journal.fenced
    async with open_journal(inner, session_id="s") as reopened:
        # The scheduling never landed: recovery has nothing of c1 to close.
        assert reopened.projection().tool("c1") is None


async def test_outside_cancel_in_a_blocking_on_tool_scheduled_settles_in_memory() -> None:
    class SlowScheduling(InMemoryToolJournal):
        async def on_tool_scheduled(self, call: Any) -> None:
            await super().on_tool_scheduled(call)
            await trio.sleep_forever()  # the write is recorded, its confirmation never comes

    journal = SlowScheduling()
    pipeline = ToolPipeline([simple_tool()], journal=journal)
    with trio.move_on_after(0) as outside:  # already expired: cancelled at the first checkpoint
        await call_tool(pipeline, "work", {}, call_id="c1")
    assert outside.cancelled_caught
    assert kinds(journal, "c1") == ["scheduled", "settled"]
    assert settled_entry(journal, "c1")["status"] == "cancelled"
    assert settled_entry(journal, "c1")["published"] is False


# ---------------------------------------------------------------- defect 3: nurseries inside tools and middleware


def ticking_tool(entered: trio.Event, groups: list[BaseException]) -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)  # a progress ticker
                entered.set()
                await trio.sleep_forever()
        except BaseExceptionGroup as group:
            groups.append(group)
            raise
        return ToolResult.success("never")

    return define_tool(run, name="tick", description="ticks", side_effect="idempotent", input_schema={"type": "object"})


@pytest.mark.parametrize("with_middleware", [False, True])
async def test_outside_cancel_through_a_tool_nursery_settles_cancelled(with_middleware: bool) -> None:
    entered = trio.Event()
    groups: list[BaseException] = []
    seen: list[BaseException] = []
    journal = InMemoryToolJournal()

    async def passthrough(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next()

    pipeline = ToolPipeline(
        [ticking_tool(entered, groups)], journal=journal, middleware=[passthrough] if with_middleware else []
    )
    async with trio.open_nursery() as nursery:
        outside = trio.CancelScope()

        async def run() -> None:
            with outside:
                try:
                    await call_tool(pipeline, "tick", {}, call_id="c1")
                except BaseException as exc:
                    seen.append(exc)
                    raise

        nursery.start_soon(run)
        await entered.wait()
        outside.cancel()
    assert outside.cancelled_caught
    assert seen[0] is groups[0]  # the group comes out unchanged
    assert kinds(journal, "c1") == ["scheduled", "started", "settled"]
    assert settled_entry(journal, "c1")["status"] == "cancelled"
    assert settled_entry(journal, "c1")["published"] is False
    assert not pipeline.history  # nothing was published


async def test_outside_cancel_through_a_middleware_nursery_settles_cancelled() -> None:
    entered = trio.Event()
    groups: list[BaseException] = []
    seen: list[BaseException] = []
    journal = InMemoryToolJournal()

    async def blocking(inp: dict[str, Any], ctx: Any) -> ToolResult:
        entered.set()
        await trio.sleep_forever()
        return ToolResult.success("never")

    tool = define_tool(
        blocking, name="block", description="b", side_effect="idempotent", input_schema={"type": "object"}
    )

    async def with_ticker(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                result: ToolResult = await call_next()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            groups.append(group)
            raise
        return result

    pipeline = ToolPipeline([tool], journal=journal, middleware=[with_ticker])
    outside = trio.CancelScope()
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            with outside:
                try:
                    await call_tool(pipeline, "block", {}, call_id="c1")
                except BaseException as exc:
                    seen.append(exc)
                    raise

        nursery.start_soon(run)
        await entered.wait()
        outside.cancel()
    assert outside.cancelled_caught
    assert seen[0] is groups[0]
    assert settled_entry(journal, "c1")["status"] == "cancelled"
    assert settled_entry(journal, "c1")["published"] is False
    assert not pipeline.history


# ---------------------------------------------------------------- defect 8: middleware that returns early


def sleeping_tool(entered: trio.Event | None = None) -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        if entered is not None:
            entered.set()
        await trio.sleep_forever()
        return ToolResult.success("never")

    return define_tool(run, name="slow", description="s", side_effect="idempotent", input_schema={"type": "object"})


@pytest.mark.parametrize("kind", JOURNALS)
async def test_early_return_a_middleware_scope_cancels_a_started_core(
    kind: str, autojump_clock: trio.testing.MockClock
) -> None:
    async def impatient(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        with trio.move_on_after(5):
            await call_next()
        return ToolResult.success("mine")

    async with journal_of(kind) as (journals, origin):
        pipeline = ToolPipeline([sleeping_tool()], journal=journals.journal, middleware=[impatient])
        record = await pipeline.execute(ToolCall("c1", "slow", {}), origin)
        assert record.status is SettlementStatus.CANCELLED
        assert not record.result.ok
        assert FaultCode.CANCELLATION_OVERWRITTEN in codes(record)
        assert not record.synthetic_start
        assert journals.states("c1") == ["scheduled", "started", "settled"]
        # Not wedged: the next call runs.
        pipeline2 = ToolPipeline([simple_tool()], journal=journals.journal)
        assert (await pipeline2.execute(ToolCall("c2", "work", {}), origin)).result.ok


@pytest.mark.parametrize("kind", JOURNALS)
async def test_early_return_while_a_dispatched_core_runs_waits_for_the_real_result(kind: str) -> None:
    entered = trio.Event()
    release = trio.Event()

    async def tool_run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        entered.set()
        await release.wait()
        return ToolResult.success("real")

    tool = define_tool(tool_run, name="t", description="t", side_effect="idempotent", input_schema={"type": "object"})

    async with journal_of(kind) as (journals, origin), trio.open_nursery() as outer:

        async def detach(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
            outer.start_soon(call_next)
            await entered.wait()
            return ToolResult.success("mine")

        pipeline = ToolPipeline([tool], journal=journals.journal, middleware=[detach])
        done: list[Any] = []

        async def run() -> None:
            done.append(await pipeline.execute(ToolCall("c1", "t", {}), origin))

        outer.start_soon(run)
        await entered.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert not done  # it waits for the core instead of settling a synthetic short-circuit
        release.set()
    (record,) = done
    assert record.status is SettlementStatus.COMPLETED
    assert record.result.output == "real"
    assert FaultCode.EARLY_RETURN in codes(record)
    assert record.tool_ran and not record.synthetic_start
    assert journals.states("c1") == ["scheduled", "started", "settled"]


@pytest.mark.parametrize("kind", JOURNALS)
async def test_early_return_before_a_dispatched_core_entered_closes_the_door(kind: str) -> None:
    runs: list[str] = []

    async def tool_run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        runs.append("ran")
        return ToolResult.success("real")

    tool = define_tool(tool_run, name="t", description="t", side_effect="idempotent", input_schema={"type": "object"})
    late: list[Any] = []

    async with journal_of(kind) as (journals, origin):
        async with trio.open_nursery() as outer:

            async def detach(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
                async def later(pending: Any) -> None:
                    late.append(await pending)

                outer.start_soon(later, call_next())  # dispatched, entered only when the task runs
                return ToolResult.success("mine")  # before the task got to run

            pipeline = ToolPipeline([tool], journal=journals.journal, middleware=[detach])
            record = await pipeline.execute(ToolCall("c1", "t", {}), origin)
        assert runs == []
        assert record.result.output == "mine"
        assert record.synthetic_start
        assert FaultCode.EARLY_RETURN in codes(record)
        assert journals.states("c1") == ["scheduled", "started", "settled"]
        (late_result,) = late
        assert not late_result.ok and late_result.error.code == "middleware_early_return"


@pytest.mark.parametrize("kind", JOURNALS)
async def test_early_return_with_a_never_awaited_call_next(kind: str) -> None:
    runs: list[str] = []

    async def tool_run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        runs.append("ran")
        return ToolResult.success("real")

    tool = define_tool(tool_run, name="t", description="t", side_effect="idempotent", input_schema={"type": "object"})
    kept: list[Any] = []

    async def forgetful(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        kept.append(call_next())  # never awaited
        return ToolResult.success("mine")

    async def inner(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next()

    async with journal_of(kind) as (journals, origin):
        for layers in ([forgetful], [forgetful, inner]):
            call_id = f"c{len(layers)}"
            pipeline = ToolPipeline([tool], journal=journals.journal, middleware=layers)
            record = await pipeline.execute(ToolCall(call_id, "t", {}), origin)
            assert runs == []
            assert record.result.output == "mine"
            assert FaultCode.EARLY_RETURN in codes(record)
            assert journals.states(call_id) == ["scheduled", "started", "settled"]
    late = await kept[0]  # awaiting it later does not run the tool
    assert late.error.code == "middleware_early_return"
    kept.clear()
    gc.collect()  # a never-awaited coroutine would warn here (and -W error makes that fail)
    assert runs == []


# ---------------------------------------------------------------- defect 9: an input change that widens the side effect


def widening_tool(runs: list[dict[str, Any]]) -> Tool[Any]:
    def resolve(inp: dict[str, Any]) -> BehaviorOverride | None:
        return None if inp.get("wide") else BehaviorOverride(side_effect=SideEffect.PURE)

    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        runs.append(dict(inp))
        return ToolResult.success("done")

    return define_tool(
        run,
        name="widen",
        description="w",
        side_effect="non_idempotent",
        interrupt="cancel",
        input_schema={"type": "object"},
        resolve_behavior=resolve,
    )


async def widen(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
    return await call_next(request.replace(input={**request.input, "wide": True}))


@pytest.mark.parametrize("kind", JOURNALS)
async def test_a_widening_input_transform_runs_and_records_the_wider_contract(kind: str) -> None:
    runs: list[dict[str, Any]] = []
    async with journal_of(kind) as (journals, origin):
        pipeline = ToolPipeline([widening_tool(runs)], journal=journals.journal, middleware=[widen])
        record = await pipeline.execute(ToolCall("c1", "widen", {"q": 1}), origin)
        assert record.result.ok and runs == [{"q": 1, "wide": True}]
        journal = journals.journal
        if isinstance(journal, InMemoryToolJournal):
            (started,) = [e.data for e in journal.entries if e.kind == "started"]
            assert started["side_effect"] == "non_idempotent"
        else:
            assert journal.projection().tool("c1").side_effect is SideEffect.NON_IDEMPOTENT  # type: ignore[union-attr]


async def test_recovery_plan_sees_the_widened_contract() -> None:
    entered = trio.Event()

    def resolve(inp: dict[str, Any]) -> BehaviorOverride | None:
        return None if inp.get("wide") else BehaviorOverride(side_effect=SideEffect.PURE)

    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        entered.set()
        await trio.sleep_forever()
        return ToolResult.success("never")

    tool = define_tool(
        run,
        name="widen",
        description="w",
        side_effect="non_idempotent",
        input_schema={"type": "object"},
        resolve_behavior=resolve,
    )
    async with open_journal(MemoryStore(clock=trio.current_time), session_id="s") as journal:
        origin = await start_turn(journal)
        pipeline = ToolPipeline([tool], journal=journal, middleware=[widen])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipeline.execute, ToolCall("c1", "widen", {}), origin)
            await entered.wait()
            # What a crash now would leave: a started, non-idempotent call. Never re-run.
            plan = journal.recovery_plan()
            (item,) = [i for i in plan.items if i.kind is RecoveryKind.TOOL_STARTED_WITHOUT_OUTCOME]
            assert item.side_effect is SideEffect.NON_IDEMPOTENT
            assert plan.tool_actions["c1"] is ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN
            nursery.cancel_scope.cancel()
        assert journal.projection().tool("c1").state is ToolState.CANCELLED  # type: ignore[union-attr]


# ---------------------------------------------------------------- defect 10: the frozen final input


@pytest.mark.parametrize("kind", JOURNALS)
async def test_the_final_input_is_frozen_before_waiting_for_a_slot(kind: str) -> None:
    runs: list[dict[str, Any]] = []
    release = trio.Event()
    live: list[dict[str, Any]] = []

    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        runs.append(dict(inp))
        if ctx.tool_call_id == "blocker":
            await release.wait()
        return ToolResult.success("ok")

    tool = define_tool(
        run, name="t", description="t", side_effect="idempotent", kind="execute", input_schema={"type": "object"}
    )

    async def mutate_in_place(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        if request.context.tool_call_id == "target":
            request.input["x"] = 1
            live.append(request.input)
        return await call_next()

    async with journal_of(kind) as (journals, origin):
        pipeline = ToolPipeline(
            [tool],
            journal=journals.journal,
            middleware=[mutate_in_place],
            scheduler=ToolScheduler(SchedulerLimits(execute=1)),
        )
        done: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipeline.execute, ToolCall("blocker", "t", {}), origin)
            await trio.testing.wait_all_tasks_blocked()

            async def target() -> None:
                done.append(await pipeline.execute(ToolCall("target", "t", {}), origin))

            nursery.start_soon(target)
            await trio.testing.wait_all_tasks_blocked()  # the target waits for the slot
            live[0]["x"] = 999  # a middleware's later in-place change
            release.set()
        (record,) = done
        assert runs[-1] == {"x": 1}
        assert record.effective_input == {"x": 1}
        journal = journals.journal
        if isinstance(journal, InMemoryToolJournal):
            (started,) = [e.data for e in journal.entries if e.call_id == "target" and e.kind == "started"]
            assert started["input"] == {"x": 1}
        else:
            assert journal.call("target").started_input == {"x": 1}  # type: ignore[union-attr]


# ---------------------------------------------------------------- defect 11: permission updates only from the tool


def permission_tool() -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        await ctx.emit(Effect("permission_updates", {"allow": ["own"]}))
        return ToolResult.success("ok")

    return define_tool(run, name="perm", description="p", side_effect="pure", input_schema={"type": "object"})


async def test_a_short_circuit_cannot_grant_permissions() -> None:
    async def grant(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await request.emit(Effect("permission_updates", {"allow": ["*"]}))
        return ToolResult.success("cached")

    pipeline = ToolPipeline([permission_tool()], middleware=[grant])
    record = await call_tool(pipeline, "perm", {})
    assert record.effects == ()
    assert FaultCode.PERMISSION_UPDATE_REFUSED in codes(record)


async def test_middleware_emit_cannot_add_permission_updates_but_forwards_the_tools() -> None:
    async def inject(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        outer = request.emit

        async def emit(item: Any) -> None:
            await outer(item)
            if isinstance(item, Effect):
                await outer(Effect("permission_updates", {"allow": ["*"]}))

        return await call_next(emit=emit)

    pipeline = ToolPipeline([permission_tool()], middleware=[inject])
    record = await call_tool(pipeline, "perm", {})
    assert record.effects == (Effect("permission_updates", {"allow": ["own"]}),)
    assert codes(record) == [FaultCode.PERMISSION_UPDATE_REFUSED]


async def test_other_effects_from_middleware_still_pass() -> None:
    async def note(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await request.emit(Effect("new_messages", ["hi"]))
        return await call_next()

    pipeline = ToolPipeline([permission_tool()], middleware=[note])
    record = await call_tool(pipeline, "perm", {})
    assert record.effects == (Effect("new_messages", ["hi"]), Effect("permission_updates", {"allow": ["own"]}))
    assert codes(record) == []


async def test_a_group_with_a_typed_error_from_middleware_raises_the_typed_error() -> None:
    journal = LeaseStub()

    async def lose_lease(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        journal.revoke()  # this journal's lease: another store's would fail only the call
        raise ExceptionGroup("from a nursery", [LeaseLostError("gone")])

    pipeline = ToolPipeline([simple_tool()], journal=journal, middleware=[lose_lease])
    with pytest.raises(LeaseLostError, match="gone"):
        await call_tool(pipeline, "work", {}, call_id="c1")
    assert kinds(journal, "c1") == ["scheduled"]  # lease lost: nothing more is written
    assert not pipeline.history


async def test_outside_cancel_while_waiting_for_a_detached_core_stops_it_and_settles() -> None:
    entered = trio.Event()
    stopped: list[str] = []

    async def tool_run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            stopped.append("stopped")
        return ToolResult.success("never")

    tool = define_tool(tool_run, name="t", description="t", side_effect="idempotent", input_schema={"type": "object"})
    journal = InMemoryToolJournal()
    outside = trio.CancelScope()
    async with trio.open_nursery() as outer:

        async def detach(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
            outer.start_soon(call_next)
            await entered.wait()
            return ToolResult.success("mine")

        pipeline = ToolPipeline([tool], journal=journal, middleware=[detach])

        async def run() -> None:
            with outside:
                await call_tool(pipeline, "t", {}, call_id="c1")

        outer.start_soon(run)
        await entered.wait()
        await trio.testing.wait_all_tasks_blocked()  # the pipeline waits for the detached core
        outside.cancel()
    assert outside.cancelled_caught
    assert stopped == ["stopped"]
    assert kinds(journal, "c1") == ["scheduled", "started", "settled"]
    assert settled_entry(journal, "c1")["status"] == "cancelled"
    assert settled_entry(journal, "c1")["published"] is False


async def test_a_detached_core_is_bounded_by_the_tool_timeout(autojump_clock: trio.testing.MockClock) -> None:
    journal = InMemoryToolJournal()
    async with trio.open_nursery() as outer:

        async def detach(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
            outer.start_soon(call_next)
            await trio.sleep(1)  # the core has entered the tool by now
            return ToolResult.success("mine")

        pipeline = ToolPipeline([sleeping_tool()], journal=journal, middleware=[detach], timeout=5)
        record = await call_tool(pipeline, "slow", {}, call_id="c1")
    assert record.result.error is not None and record.result.error.type.value == "timeout"
    assert FaultCode.EARLY_RETURN in codes(record)
    assert kinds(journal, "c1") == ["scheduled", "started", "settled"]


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_outside_cancel_while_tool_started_commits_settles_cancelled(store_kind: str, tmp_path: Path) -> None:
    runs: list[str] = []

    async def tool_run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        runs.append("ran")
        return ToolResult.success("ok")

    tool = define_tool(tool_run, name="t", description="t", side_effect="idempotent", input_schema={"type": "object"})

    async def impatient(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next()

    async with make_store(store_kind, tmp_path) as inner:
        store = CancellingStore(inner)
        async with open_journal(store, session_id="s") as journal:  # type: ignore[arg-type]
            origin = await start_turn(journal)
            for index, layers in enumerate(([], [impatient])):
                call_id = f"c{index}"
                pipeline = ToolPipeline([tool], journal=journal, middleware=layers)
                with trio.CancelScope() as outside:
                    store.trigger = ToolStarted
                    store.on_submit = outside.cancel
                    await pipeline.execute(ToolCall(call_id, "t", {}), origin)
                assert outside.cancelled_caught
                assert runs == []
                record = journal.call(call_id)
                assert record is not None and record.attempts == 1  # never a second (synthetic) start
                assert journal.projection().tool(call_id).state is ToolState.CANCELLED  # type: ignore[union-attr]


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_middleware_scope_cancels_while_tool_started_commits(store_kind: str, tmp_path: Path) -> None:
    runs: list[str] = []

    async def tool_run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        runs.append("ran")
        return ToolResult.success("ok")

    tool = define_tool(tool_run, name="t", description="t", side_effect="idempotent", input_schema={"type": "object"})
    async with make_store(store_kind, tmp_path) as inner:
        store = CancellingStore(inner)

        async def own_scope(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
            with trio.CancelScope() as mine:
                store.trigger = ToolStarted
                store.on_submit = mine.cancel
                await call_next()
            return ToolResult.success("mine")

        async with open_journal(store, session_id="s") as journal:  # type: ignore[arg-type]
            origin = await start_turn(journal)
            pipeline = ToolPipeline([tool], journal=journal, middleware=[own_scope])
            record = await pipeline.execute(ToolCall("c1", "t", {}), origin)
            assert runs == []
            assert record.status is SettlementStatus.CANCELLED
            assert FaultCode.CANCELLATION_OVERWRITTEN in codes(record)
            assert journal.call("c1").attempts == 1  # type: ignore[union-attr]
            assert journal.projection().tool("c1").state is ToolState.CANCELLED  # type: ignore[union-attr]


@pytest.mark.parametrize("with_middleware", [False, True])
async def test_an_sdk_abort_through_a_tool_nursery_is_an_abort(with_middleware: bool) -> None:
    from trio_agent.tools import AbortHandle

    entered = trio.Event()
    groups: list[BaseException] = []

    async def passthrough(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next()

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline(
        [ticking_tool(entered, groups)], journal=journal, middleware=[passthrough] if with_middleware else []
    )
    handle = AbortHandle()
    done: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            done.append(await call_tool(pipeline, "tick", {}, call_id="c1", abort=handle))

        nursery.start_soon(run)
        await entered.wait()
        handle.abort()
    (record,) = done
    assert groups  # the cancellation did arrive as a group
    assert record.status is SettlementStatus.CANCELLED
    assert record.result.error is not None and record.result.error.code == "user_abort"
    assert kinds(journal, "c1") == ["scheduled", "started", "settled"]


# ---------------------------------------------------------------- a result that is not JSON


class Opaque:
    def __repr__(self) -> str:
        return "<Opaque>"


NOT_JSON: dict[str, tuple[Callable[[], Any], str]] = {
    "set": (lambda: {1, 2}, "result.output is not JSON: set"),
    "bytes": (lambda: b"\x00", "result.output is not JSON: bytes"),
    "nan": (lambda: float("nan"), "result.output is not a finite number"),
    "int key": (lambda: {1: "a"}, "result.output has a non-string key 1"),
    "object": (lambda: Opaque(), "result.output is not JSON: Opaque"),
    "object output": (lambda: ToolResult.success(Opaque()), "result.output is not JSON: Opaque"),
    "data": (lambda: ToolResult.success("fine", data={"x": Opaque()}), "result.data.x is not JSON: Opaque"),
    "metadata": (lambda: ToolResult.success("fine", metadata={"o": {1, 2}}), "result.metadata.o is not JSON: set"),
    "error details": (
        lambda: ToolResult.failure(ToolErrorType.EXECUTION, "no", details={"why": Opaque()}),
        "result.error.details.why is not JSON: Opaque",
    ),
    # Past the interpreter's digit limit json.dumps raises (the journal's settlement failed the
    # request); past MAX_JSON_INT_BITS a process with a lower limit could not read it back.
    "huge int": (lambda: 10**5000, "result.output is an integer too large for JSON (16610 bits, at most 2048)"),
    "large int": (lambda: [-(1 << 2048)], "result.output[0] is an integer too large for JSON (2049 bits"),
    "large int metadata": (
        lambda: ToolResult.success("fine", metadata={"n": 10**700}),
        "result.metadata.n is an integer too large for JSON",
    ),
    # Fields of the wrong type: the class does not check them; the journal's conversion failed on
    # some (an AttributeError as the message), took others (display 3, an int code), and the fast
    # path took an empty non-dict metadata ([] or None), which failed later where it was read.
    "error not a ToolError": (
        lambda: ToolResult("x", error="oops"),
        "result.error must be a ToolError or None, not str",
    ),
    "error message": (
        lambda: ToolResult("x", error=ToolError(ToolErrorType.EXECUTION, 5)),  # type: ignore[arg-type]
        "result.error.message must be a string, not int",
    ),
    "error code": (
        lambda: ToolResult("x", error=ToolError(ToolErrorType.EXECUTION, "no", 5)),  # type: ignore[arg-type]
        "result.error.code must be a string or None, not int",
    ),
    "display": (lambda: ToolResult("x", display=3), "result.display must be a string or None, not int"),
    "empty list metadata": (lambda: ToolResult("x", metadata=[]), "result.metadata must be a mapping, not list"),
    "None metadata": (lambda: ToolResult("x", metadata=None), "result.metadata must be a mapping, not NoneType"),
}


def returning_tool(make: Callable[[], Any], name: str = "bad") -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> Any:
        return make()

    return define_tool(run, name=name, description="returns it", side_effect="pure", input_schema={"type": "object"})


@pytest.mark.parametrize("kind", JOURNALS)
@pytest.mark.parametrize("value", NOT_JSON)
async def test_a_tool_result_that_is_not_json_fails_that_call(kind: str, value: str) -> None:
    make, problem = NOT_JSON[value]
    async with journal_of(kind) as (journals, origin):
        pipeline = ToolPipeline([returning_tool(make)], journal=journals.journal)
        record = await call_tool(pipeline, "bad", {}, call_id="c1", origin=origin)
        assert record.status is SettlementStatus.FAILED
        assert record.published and record.tool_ran
        error = record.result.error
        assert error is not None and error.type is ToolErrorType.EXECUTION and error.code == "invalid_result"
        assert error.message.startswith("tool 'bad' returned a non-JSON result: ")
        assert problem in error.message
        assert journals.states("c1") == ["scheduled", "started", "settled"]


@pytest.mark.parametrize("kind", JOURNALS)
async def test_results_the_journal_stores_as_json_stay_successes(kind: str) -> None:
    @attrs.frozen
    class Point:
        x: int

    async with journal_of(kind) as (journals, origin):
        for make, output in (
            (lambda: (1, "a"), (1, "a")),  # stored as a list
            (lambda: Point(1), Point(1)),  # stored as its fields
            (lambda: ToolResult.success("ok", data={"n": [1.5]}, metadata={"m": None}), "ok"),
            (lambda: ToolResult("ok", metadata=MappingProxyType({"m": 1})), "ok"),  # any mapping: stored as a dict
        ):
            pipeline = ToolPipeline([returning_tool(make)], journal=journals.journal)
            record = await call_tool(pipeline, "bad", {}, origin=origin)
            assert record.status is SettlementStatus.COMPLETED
            assert record.result.output == output


@pytest.mark.parametrize("kind", JOURNALS)
@pytest.mark.parametrize("where", ["short-circuit", "after the core", "post_tool stage", "before stage skip"])
async def test_a_non_json_result_from_middleware_or_a_stage_fails_that_call(kind: str, where: str) -> None:
    async def short_circuit(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return ToolResult.success({1, 2})

    async def after_core(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        result: ToolResult = await call_next()
        return attrs.evolve(result, data=Opaque())

    async def post_tool(request: Any, result: ToolResult) -> ToolResult:
        return attrs.evolve(result, metadata={"o": Opaque()})

    async def skip(request: Any) -> Skip:
        return Skip(ToolResult.success({1, 2}))

    middleware = {"short-circuit": [short_circuit], "after the core": [after_core]}.get(where, [])
    stages = {
        "post_tool stage": ToolStages(post_tool=[post_tool]),
        "before stage skip": ToolStages(before=[skip]),
    }.get(where)
    async with journal_of(kind) as (journals, origin):
        pipeline = ToolPipeline([simple_tool()], journal=journals.journal, middleware=middleware, stages=stages)
        record = await call_tool(pipeline, "work", {}, call_id="c1", origin=origin)
        assert record.status is SettlementStatus.FAILED
        error = record.result.error
        assert error is not None and error.code == "invalid_result"
        assert "is not JSON: " in error.message
        # A short-circuit that was refused never got a (synthetic) start.
        refused = where in ("short-circuit", "before stage skip")
        expected = ["scheduled", "settled"] if refused else ["scheduled", "started", "settled"]
        assert journals.states("c1") == expected
