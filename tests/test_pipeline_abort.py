"""Abort and cancellation driven into every phase of a tool call.

For each phase we start a call, wait until it provably sits in that phase, then
abort it either the SDK way (an `AbortHandle`) or from outside (a cancel scope
of the caller), and check the rule: committed => settled (and returned for SDK
aborts); not committed => cancelled, the tool's result never published.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from cancel_helpers import cancelled_of_its_own

import trio_agent as ta
from trio_agent.testing import call_tool

PHASES = [
    "middleware_before",
    "slot_wait",
    "lock_wait",
    "pre_tool_stage",
    "mid_tool_emit",
    "after_core",
    "during_unwind",
]
COMMITTED = {"after_core", "during_unwind"}
HANG_GUARD = 10  # seconds; only turns a would-be hang into a failure, never synchronises anything


@attrs.define
class Harness:
    """A pipeline wired so that a call blocks in one chosen phase until released."""

    phase: str
    pipeline: ta.ToolPipeline
    journal: ta.InMemoryToolJournal
    hit: trio.Event
    release: trio.Event
    tool_runs: list[str]
    blocker_release: trio.Event | None = None
    prepare: Callable[[trio.Nursery], Awaitable[None]] | None = None


def make_harness(phase: str) -> Harness:
    hit = trio.Event()
    release = trio.Event()
    tool_runs: list[str] = []
    journal = ta.InMemoryToolJournal()
    blocker_release = trio.Event()

    async def work(input: dict[str, Any], ctx: ta.ToolContext) -> ta.ToolResult:
        tool_runs.append(ctx.tool_call_id)
        if ctx.tool_call_id == "blocker":
            await blocker_release.wait()
            return ta.ToolResult.success("blocker done")
        await ctx.emit(ta.Progress("working"))
        return ta.ToolResult.success("token=secret-42")

    tool = ta.define_tool(
        work,
        name="work",
        description="does work",
        side_effect="idempotent",
        kind="execute",
        input_schema={"type": "object", "properties": {"path": {"type": "string"}}},
        affected_paths=lambda input: [input["path"]] if "path" in input else [],
        interrupt="cancel",
    )

    async def redact(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        if phase == "middleware_before":
            hit.set()
            await release.wait()
        result = await call_next()
        if phase == "during_unwind":
            hit.set()
            await release.wait()
        return attrs.evolve(result, output=str(result.output).replace("secret-42", "[redacted]"))

    async def blocking_pre_tool(request: ta.StageRequest) -> None:
        if phase == "pre_tool_stage":
            hit.set()
            await release.wait()

    async def blocking_post_tool(request: ta.StageRequest, result: ta.ToolResult) -> None:
        if phase == "after_core" and request.context.tool_call_id == "target":
            hit.set()
            await release.wait()

    stages = ta.ToolStages(pre_tool=[blocking_pre_tool], post_tool=[blocking_post_tool])
    pipeline = ta.ToolPipeline(
        [tool],
        middleware=[redact],
        journal=journal,
        stages=stages,
        scheduler=ta.ToolScheduler(ta.SchedulerLimits(execute=1)),
    )
    return Harness(phase, pipeline, journal, hit, release, tool_runs, blocker_release)


def target_input(phase: str) -> dict[str, Any]:
    return {"path": "shared.txt"} if phase == "lock_wait" else {}


async def drive_into_phase(h: Harness, nursery: trio.Nursery) -> None:
    """Start a blocker if the phase needs one; return once the target call sits in the phase."""
    if h.phase in ("slot_wait", "lock_wait"):
        blocker_input = {"path": "shared.txt"} if h.phase == "lock_wait" else {}
        if h.phase == "lock_wait":
            # A separate slot bucket so the target waits on the lock, not the slot.
            h.pipeline.scheduler = ta.ToolScheduler(ta.SchedulerLimits(execute=5))
        nursery.start_soon(partial(call_tool, h.pipeline, "work", blocker_input, call_id="blocker"))
        await trio.testing.wait_all_tasks_blocked()
        assert h.tool_runs == ["blocker"]


async def wait_for_phase(h: Harness) -> None:
    if h.phase == "slot_wait":
        await trio.testing.wait_all_tasks_blocked()
        waiting = h.pipeline.scheduler.statistics().buckets["execute"][1]
        assert waiting == 1, "the target must be queued for a slot"
    elif h.phase == "lock_wait":
        await trio.testing.wait_all_tasks_blocked()
        (_readers, writer, waiters) = next(iter(h.pipeline.file_locks.held().values()))
        assert writer and waiters == 1, "the target must be queued for the file lock"
    else:
        await h.hit.wait()


def settled(journal: ta.InMemoryToolJournal, call_id: str) -> dict[str, Any]:
    entries = [e for e in journal.entries if e.call_id == call_id and e.kind == "settled"]
    assert len(entries) == 1, journal.kinds(call_id)
    return entries[0].data


def assert_pipeline_idle(pipeline: ta.ToolPipeline) -> None:
    for borrowed, waiting, _total in pipeline.scheduler.statistics().buckets.values():
        assert (borrowed, waiting) == (0, 0)
    assert pipeline.file_locks.held() == {}


def blocking_observer(h: Harness) -> Callable[[ta.ToolItem], Awaitable[None]]:
    """An on_item observer that, in the mid_tool_emit phase, holds the tool inside ctx.emit()."""

    async def observe(item: ta.ToolItem) -> None:
        if h.phase == "mid_tool_emit":
            h.hit.set()
            await h.release.wait()

    return observe


@pytest.mark.parametrize("phase", PHASES)
async def test_sdk_abort_in_each_phase(phase: str) -> None:
    h = make_harness(phase)
    abort = ta.AbortHandle()
    records: list[ta.ToolExecutionRecord] = []
    tasks_before = trio.lowlevel.current_statistics().tasks_living

    async def run_target() -> None:
        records.append(
            await call_tool(
                h.pipeline, "work", target_input(phase), call_id="target", abort=abort, on_item=blocking_observer(h)
            )
        )

    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            await drive_into_phase(h, nursery)
            nursery.start_soon(run_target)
            await wait_for_phase(h)
            if phase == "mid_tool_emit":
                assert "target" in h.tool_runs
            abort.abort(ta.AbortReason.USER_ABORT)
            await trio.testing.wait_all_tasks_blocked()
            h.release.set()
            assert h.blocker_release is not None
            h.blocker_release.set()

    (record,) = records
    data = settled(h.journal, "target")
    if phase in COMMITTED:
        # Committed: settled as completed, returned, and redaction applied to what was persisted.
        assert record.status is ta.SettlementStatus.COMPLETED
        assert record.result.output == "token=[redacted]"
        assert data["result"].output == "token=[redacted]"
        assert data["published"] is True
        assert record.aborted is not None and record.aborted.reason is ta.AbortReason.USER_ABORT
    else:
        assert record.status is ta.SettlementStatus.CANCELLED
        assert record.result.error is not None
        assert record.result.error.type is ta.ToolErrorType.INTERRUPTED
        assert record.result.error.code == "user_abort"
        assert "secret-42" not in str(data["result"].output)
        assert data["status"] == "cancelled"
    if phase in ("middleware_before", "slot_wait", "lock_wait", "pre_tool_stage"):
        assert "target" not in h.tool_runs
        assert h.journal.kinds("target") == ["scheduled", "settled"]
    assert_pipeline_idle(h.pipeline)
    assert trio.lowlevel.current_statistics().tasks_living == tasks_before


@pytest.mark.parametrize("phase", PHASES)
async def test_outside_cancellation_in_each_phase(phase: str) -> None:
    h = make_harness(phase)
    outcome: dict[str, Any] = {}
    scope_box: list[trio.CancelScope] = []
    tasks_before = trio.lowlevel.current_statistics().tasks_living

    async def run_target() -> None:
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            outcome["record"] = await call_tool(
                h.pipeline, "work", target_input(phase), call_id="target", on_item=blocking_observer(h)
            )
        outcome["cancelled_caught"] = scope.cancelled_caught

    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            await drive_into_phase(h, nursery)
            nursery.start_soon(run_target)
            await wait_for_phase(h)
            scope_box[0].cancel()
            await trio.testing.wait_all_tasks_blocked()
            h.release.set()
            assert h.blocker_release is not None
            h.blocker_release.set()

    # Trio's Cancelled propagated out of execute(): nothing was returned.
    assert "record" not in outcome
    assert outcome["cancelled_caught"] is True
    data = settled(h.journal, "target")
    if phase in COMMITTED:
        assert data["status"] == "completed"
        assert data["result"].output == "token=[redacted]"
    else:
        assert data["status"] == "cancelled"
        assert data["published"] is False
    if phase in ("middleware_before", "slot_wait", "lock_wait", "pre_tool_stage"):
        assert "target" not in h.tool_runs
    # The execution history holds settled calls: the committed one, never a cancelled one.
    in_history = any(r.call.id == "target" for r in h.pipeline.history)
    assert in_history is (phase in COMMITTED)
    assert_pipeline_idle(h.pipeline)
    assert trio.lowlevel.current_statistics().tasks_living == tasks_before


async def test_unwind_deadline_missed_persists_raw_result_unpublished(autojump_clock: trio.abc.Clock) -> None:
    journal = ta.InMemoryToolJournal()

    @ta.define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def leak(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Returns a secret."""
        return "secret"

    async def stuck_redactor(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        result = await call_next()
        await trio.sleep_forever()  # never finishes unwinding
        return result  # pragma: no cover

    pipeline = ta.ToolPipeline([leak], middleware=[stuck_redactor], journal=journal, unwind_grace=1.0)
    record = await call_tool(pipeline, "leak", {}, call_id="c1")
    assert record.published is False
    assert record.result.error is not None and record.result.error.code == "unwind_deadline_missed"
    assert "secret" not in str(record.result.output)
    data = settled(journal, "c1")
    assert data["published"] is False and data["result"].output == "secret"
    assert [f.code for f in record.faults] == [ta.FaultCode.UNWIND_DEADLINE_MISSED]


async def test_steering_reaches_only_cancel_tools() -> None:
    entered = trio.Event()
    proceed = trio.Event()

    async def run(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        entered.set()
        await proceed.wait()
        return "finished"

    schema = {"type": "object"}
    blocking = ta.define_tool(run, name="blocking", description="d", side_effect="pure", input_schema=schema)
    cancelling = ta.define_tool(
        run, name="cancelling", description="d", side_effect="pure", input_schema=schema, interrupt="cancel"
    )
    pipeline = ta.ToolPipeline([blocking, cancelling])
    results: dict[str, ta.ToolExecutionRecord] = {}
    for name in ("blocking", "cancelling"):
        entered = trio.Event()
        proceed = trio.Event()
        steering = ta.AbortHandle()

        async def go(name: str = name, steering: ta.AbortHandle = steering) -> None:
            results[name] = await call_tool(pipeline, name, {}, steering=steering)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(go)
            await entered.wait()
            steering.abort(ta.AbortReason.STEERING)
            await trio.testing.wait_all_tasks_blocked()
            proceed.set()
    assert results["blocking"].result.output == "finished"
    assert results["blocking"].status is ta.SettlementStatus.COMPLETED
    error = results["cancelling"].result.error
    assert error is not None and error.type is ta.ToolErrorType.INTERRUPTED and error.code == "steering"


async def test_request_abort_reaches_block_tools() -> None:
    entered = trio.Event()

    @ta.define_tool(side_effect="pure", input_schema={"type": "object"})
    async def stubborn(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Blocks steering."""
        entered.set()
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    pipeline = ta.ToolPipeline([stubborn])
    abort = ta.AbortHandle()
    out: list[ta.ToolExecutionRecord] = []
    async with trio.open_nursery() as nursery:

        async def go() -> None:
            out.append(await call_tool(pipeline, "stubborn", {}, abort=abort))

        nursery.start_soon(go)
        await entered.wait()
        abort.abort(ta.AbortReason.SESSION_CLOSE)
    assert out[0].status is ta.SettlementStatus.CANCELLED
    assert out[0].result.error is not None and out[0].result.error.code == "session_close"


async def test_tool_timeout(autojump_clock: trio.abc.Clock) -> None:
    @ta.define_tool(side_effect="pure", input_schema={"type": "object"}, timeout=5)
    async def hang(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Hangs."""
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    pipeline = ta.ToolPipeline([hang], timeout=100)
    start = trio.current_time()
    record = await call_tool(pipeline, "hang", {})
    assert trio.current_time() - start == pytest.approx(5)
    assert record.result.error is not None and record.result.error.type is ta.ToolErrorType.TIMEOUT
    assert record.status is ta.SettlementStatus.FAILED


async def test_timeout_keeps_running_while_consumer_pauses(autojump_clock: trio.abc.Clock) -> None:
    @ta.define_tool(side_effect="pure", input_schema={"type": "object"})
    async def chatty(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Emits and then waits."""
        await ctx.emit(ta.Progress("one"))
        await trio.sleep(1)
        return "done"

    async def slow_consumer(item: ta.ToolItem) -> None:
        await trio.sleep(10)  # the consumer pauses far past the tool's deadline

    pipeline = ta.ToolPipeline([chatty], timeout=3)
    record = await call_tool(pipeline, "chatty", {}, on_item=slow_consumer)
    assert record.result.error is not None and record.result.error.type is ta.ToolErrorType.TIMEOUT


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "600", True, 10**12])
def test_invalid_timeouts_rejected(bad: object) -> None:
    with pytest.raises(ta.ConfigError, match="timeout"):
        ta.ToolPipeline([], timeout=bad)  # type: ignore[arg-type]


def test_default_timeout_is_600_seconds() -> None:
    assert ta.ToolPipeline([]).timeout == 600.0


async def test_cleanup_overrun_is_reported_and_blocks_new_tool_starts(autojump_clock: trio.abc.Clock) -> None:
    order: list[str] = []
    entered = trio.Event()

    @ta.define_tool(side_effect="pure", input_schema={"type": "object"})
    async def sloppy(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Ignores cancellation for 30 s while cleaning up."""
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(30)
                order.append("sloppy cleaned up")
        return "never"  # pragma: no cover

    @ta.define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def quick(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Runs at once."""
        order.append("quick ran")
        return "ok"

    pipeline = ta.ToolPipeline([sloppy, quick], cleanup_grace=5)
    abort = ta.AbortHandle()
    records: dict[str, ta.ToolExecutionRecord] = {}
    async with trio.open_nursery() as nursery:

        async def run_sloppy() -> None:
            records["sloppy"] = await call_tool(pipeline, "sloppy", {}, abort=abort)

        nursery.start_soon(run_sloppy)
        await entered.wait()
        abort.abort()
        await trio.sleep(6)  # virtual time: past the 5 s grace, the cleanup still runs
        records["quick"] = await call_tool(pipeline, "quick", {})
    assert order == ["sloppy cleaned up", "quick ran"]
    assert pipeline.cleanup_overruns == 1
    assert [f.code for f in records["sloppy"].faults] == [ta.FaultCode.CLEANUP_OVERRUN]
    assert records["quick"].result.output == "ok"


async def test_tool_start_within_grace_is_not_blocked(autojump_clock: trio.abc.Clock) -> None:
    order: list[str] = []
    entered = trio.Event()

    @ta.define_tool(side_effect="pure", input_schema={"type": "object"})
    async def tidy(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Cleans up within the grace using ctx.cleanup_scope()."""
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            with ctx.cleanup_scope():
                await trio.sleep(2)
                order.append("tidy cleaned up")
        return "never"  # pragma: no cover

    @ta.define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def quick(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Runs at once."""
        order.append("quick ran")
        return "ok"

    pipeline = ta.ToolPipeline([tidy, quick], cleanup_grace=5)
    abort = ta.AbortHandle()
    async with trio.open_nursery() as nursery:

        async def run_tidy() -> None:
            await call_tool(pipeline, "tidy", {}, abort=abort)

        nursery.start_soon(run_tidy)
        await entered.wait()
        abort.abort()
        await call_tool(pipeline, "quick", {})
    assert order == ["quick ran", "tidy cleaned up"]
    assert pipeline.cleanup_overruns == 0


async def test_abort_before_execute_never_enters_middleware() -> None:
    entered: list[str] = []

    async def spy(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        entered.append("mw")
        return await call_next()

    @ta.define_tool(side_effect="pure", input_schema={"type": "object"})
    async def noop(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Does nothing."""
        return "ran"

    journal = ta.InMemoryToolJournal()
    pipeline = ta.ToolPipeline([noop], middleware=[spy], journal=journal)
    abort = ta.AbortHandle()
    abort.abort(ta.AbortReason.USER_ABORT)
    record = await call_tool(pipeline, "noop", {}, call_id="c", abort=abort)
    assert entered == []
    assert record.status is ta.SettlementStatus.CANCELLED
    assert journal.kinds("c") == ["scheduled", "settled"]


async def test_lease_lost_abort_raises_instead_of_result() -> None:
    entered = trio.Event()

    @ta.define_tool(side_effect="pure", input_schema={"type": "object"})
    async def waits(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Waits."""
        entered.set()
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    journal = ta.InMemoryToolJournal()
    pipeline = ta.ToolPipeline([waits], journal=journal)
    abort = ta.AbortHandle()
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:

        async def go() -> None:
            try:
                await call_tool(pipeline, "waits", {}, call_id="c", abort=abort)
            except ta.LeaseLostError as exc:
                errors.append(exc)

        nursery.start_soon(go)
        await entered.wait()
        abort.abort(ta.AbortReason.LEASE_LOST)
    assert len(errors) == 1
    assert journal.kinds("c") == ["scheduled", "started"]  # fails closed: nothing settled
    assert len(pipeline.history) == 0


class CheckpointingJournal(ta.InMemoryToolJournal):
    """A journal whose settlement write yields to the scheduler, like a real store."""

    async def on_tool_settled(self, call: ta.ScheduledCall, settlement: ta.Settlement) -> None:
        await trio.lowlevel.checkpoint()
        await super().on_tool_settled(call, settlement)


async def test_blocking_settlement_is_shielded_from_outside_cancellation() -> None:
    """A committed call is settled even when the store's write checkpoints under a cancelled scope."""
    journal = CheckpointingJournal()
    done = trio.Event()

    @ta.define_tool(side_effect="pure", input_schema={"type": "object"})
    async def quick(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Finishes at once."""
        return "result"

    async def cancel_outside_then_unwind(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        result = await call_next()
        scope_box[0].cancel()  # the caller gives up while the unwind (and then settlement) still has to run
        done.set()
        return result

    scope_box: list[trio.CancelScope] = []
    pipeline = ta.ToolPipeline([quick], middleware=[cancel_outside_then_unwind], journal=journal)
    with trio.CancelScope() as scope:
        scope_box.append(scope)
        await call_tool(pipeline, "quick", {}, call_id="c")
    assert scope.cancelled_caught and done.is_set()
    assert settled(journal, "c")["status"] == "completed"


@pytest.mark.parametrize("layered", [False, True])
async def test_a_cancelled_the_tool_raises_while_nothing_cancels_the_call_is_its_error(layered: bool) -> None:
    async def stray(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        raise await cancelled_of_its_own()

    tool = ta.define_tool(stray, description="raises a Cancelled of its own", side_effect="pure",
                          input_schema={"type": "object"})  # fmt: skip

    async def passthrough(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        result: ta.ToolResult = await call_next()
        return result

    journal = ta.InMemoryToolJournal()
    pipeline = ta.ToolPipeline([tool], journal=journal, middleware=[passthrough] if layered else [])
    try:
        record = await call_tool(pipeline, "stray", {}, call_id="c1")
    except trio.Cancelled:  # a Cancelled out of a test would end it silently, as passed
        pytest.fail("the tool's own Cancelled left execute as a cancellation")
    assert record.status is ta.SettlementStatus.FAILED
    assert record.result.error is not None and record.result.error.code == "tool_error"
    assert "not cancelled" in str(record.result.output)
    assert journal.kinds("c1") == ["scheduled", "started", "settled"]
    assert_pipeline_idle(pipeline)


@pytest.mark.parametrize("slot", ["pre_tool", "before", "guard", "post_tool"])
async def test_a_cancelled_a_stage_raises_while_nothing_cancels_the_call_fails_it_closed(slot: str) -> None:
    # It left execute as a cancellation nobody made (a bare Cancelled out of send() or chat()).
    async def stray(*args: Any) -> None:
        raise await cancelled_of_its_own()

    @ta.define_tool(side_effect="pure", input_schema={"type": "object"})
    async def quick(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Answers."""
        return "fine"

    journal = ta.InMemoryToolJournal()
    pipeline = ta.ToolPipeline([quick], journal=journal, stages=ta.tools.ToolStages(**{slot: [stray]}))
    try:
        record = await call_tool(pipeline, "quick", {}, call_id="c1")
    except trio.Cancelled:  # a Cancelled out of a test would end it silently, as passed
        pytest.fail("the stage's own Cancelled left execute as a cancellation")
    assert record.result.error is not None and record.result.error.code == "hook_error"
    assert "nothing around it was cancelled" in str(record.result.output)
    assert_pipeline_idle(pipeline)


@pytest.mark.parametrize("cancel", ["timeout", "abort"])
async def test_a_tool_that_swallows_its_cancellation_and_returns_is_settled_completed(
    autojump_clock: trio.abc.Clock, cancel: str
) -> None:
    # Its side effect is done: the result is committed and published (tool-pipeline.md, settlement).
    @ta.define_tool(side_effect="non_idempotent", input_schema={"type": "object"})
    async def stubborn(input: dict[str, Any], ctx: ta.ToolContext) -> str:
        """Ignores its cancellation and returns without another checkpoint."""
        with trio.CancelScope(shield=True):
            await trio.sleep(10)
        return "finished anyway"

    pipeline = ta.ToolPipeline([stubborn], timeout=1.0, cleanup_grace=2.0)
    abort = ta.AbortHandle()
    async with trio.open_nursery() as nursery:
        if cancel == "abort":
            nursery.start_soon(_abort_at, abort, 0.5)
        record = await call_tool(pipeline, "stubborn", {}, abort=abort)
    assert record.status is ta.SettlementStatus.COMPLETED
    assert record.result == ta.ToolResult.success("finished anyway")
    assert record.published
    assert [f.code for f in record.faults] == [ta.FaultCode.CLEANUP_OVERRUN]
    assert (record.aborted is not None) == (cancel == "abort")


async def _abort_at(abort: ta.AbortHandle, at: float) -> None:
    await trio.sleep(at)  # (virtual time)
    abort.abort()
