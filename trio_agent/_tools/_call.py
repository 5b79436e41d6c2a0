"""One tool call in flight: its state, the faults it records, and the results its outcomes become.

`ToolPipeline.execute` makes one `_Call` per tool call and passes it down: the links of the
middleware chain carry it (see `_chain`), the core and the settlement read and write it.

Rules
=====

* Per-call state lives on the `_Call` and in locals, never on the pipeline or on a middleware:
  one pipeline runs many calls at once.
* What the pipeline corrected (a rule a middleware broke, a tool overrunning its cleanup grace)
  is a `MiddlewareFault` on the call, and so on its record: the real result wins, nothing is raised.
* Only the tool itself may change the permission rules: a ``permission_updates`` effect reaches
  the session only if the tool emitted it (`_Call.note_granted`, `_Call.sink`).
* The result helpers turn an outcome (an abort, a `ToolFailure`, an exception, a stray
  ``Cancelled``) into that call's error `ToolResult`, and `_status_for` a result into its
  settlement status: the call fails, never the pipeline.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, NoReturn

import attrs
import trio

from .._abort import Abort, AbortReason
from .._errors import SettlementError
from .._groups import leaves
from .._reader_wait import HeldDeadline, Holding
from .._util import safe_repr
from ._context import Emit, ExecutionContext, _SlotHolder
from ._definition import Tool
from ._journal import ScheduledCall, SettlementStatus
from ._results import (
    Effect,
    JsonObject,
    Progress,
    ToolErrorType,
    ToolFailure,
    ToolItem,
    ToolMessage,
    ToolResult,
    describe,
)
from ._stages import ToolStages

if TYPE_CHECKING:
    from types import CoroutineType

    from ._pipeline import ToolPipeline

__all__ = ["FaultCode", "MiddlewareFault"]


class FaultCode(enum.Enum):
    """Middleware faults that the pipeline corrected; the real result won."""

    NEXT_CALLED_TWICE = "next_called_twice"
    FAILED_CORE_TURNED_SUCCESS = "failed_core_turned_success"
    CANCELLATION_OVERWRITTEN = "cancellation_overwritten"
    TIMEOUT_OVERWRITTEN = "timeout_overwritten"
    MIDDLEWARE_RAISED_AFTER_CORE = "middleware_raised_after_core"
    UNWIND_DEADLINE_MISSED = "unwind_deadline_missed"
    CLEANUP_OVERRUN = "cleanup_overrun"
    EARLY_RETURN = "early_return"
    """The chain returned while ``call_next()`` was still pending or running."""
    PERMISSION_UPDATE_REFUSED = "permission_update_refused"
    """A ``permission_updates`` effect that did not come from the tool itself was dropped."""


@attrs.frozen
class MiddlewareFault:
    code: FaultCode
    message: str


PERMISSION_UPDATES = "permission_updates"
"""The `Effect` kind that changes permission rules: only the tool itself may emit it."""


class _Phase(enum.Enum):
    MIDDLEWARE = 0  # before the core started: abort cancels the middleware scope
    CORE = 1  # the core runs: abort cancels the core scope
    COMMITTED = 2  # the core returned: abort is only recorded


class _Call(HeldDeadline):
    """Per-execution state. Lives in locals and on the chain's links, never on the pipeline.

    As a `HeldDeadline`: while its tool runs, a wait on a reader of what the tool emits
    (`waiting_for_reader`, around each item: `Holding`) holds the tool's deadline."""

    __slots__ = (
        "abort",
        "aborted",
        "behavior",
        "cleanup_deadline",
        "clock",
        "closed",
        "core_done",
        "core_entered",
        "core_result",
        "core_waiter",
        "ctx",
        "done",
        "door_closed",
        "effective_input",
        "effects",
        "entered",
        "fatal",
        "faults",
        "granted",
        "has_pre",
        "live_input",
        "locks",
        "mw_scope",
        "next_twice",
        "on_item",
        "pending",
        "phase",
        "pipeline",
        "scheduled",
        "settle_attempted",
        "slot",
        "stages",
        "started",
        "synthetic",
        "target",
        "tool",
        "tool_ran",
        "violation",
    )

    def __init__(
        self,
        pipeline: ToolPipeline,
        tool: Tool[Any],
        scheduled: ScheduledCall,
        ctx: ExecutionContext,
        on_item: Emit | None,
        live_input: JsonObject,
        clock: trio.abc.Clock,
    ) -> None:
        self.pipeline = pipeline
        self.tool = tool
        self.scheduled = scheduled
        self.ctx = ctx
        self.abort = ctx.abort
        # ``abort.reason`` as `on_abort` heard it (the listener from the call's start to its end):
        # a slot, read where the handle's property would be a call.
        self.aborted: Abort | None = None
        self.behavior = scheduled.behavior
        self.on_item = on_item
        self.clock = clock  # looked up once: the call reads the time several times
        # The dict middleware and the tool see: a copy, so the model's input (scheduled.model_input,
        # record.call.input) stays as sent, and in-place changes are detected by comparing against it.
        self.live_input: JsonObject = live_input
        self.effective_input: JsonObject = live_input
        # Made by the first item: most calls have neither.
        self.effects: list[Effect] | None = None
        self.faults: list[MiddlewareFault] | None = None
        self.phase = _Phase.MIDDLEWARE
        self.mw_scope: trio.CancelScope | None = None
        self.target: trio.CancelScope | None = None
        self.core_result: ToolResult | None = None
        self.fatal: BaseException | None = None
        self.violation: str | None = None
        self.next_twice = False
        self.started = False
        self.synthetic = False
        self.tool_ran = False
        self.cleanup_deadline = math.inf
        self._held = None  # a wait on a reader of the tool's items holds its deadline (`HeldDeadline`)
        self.done: trio.Event | None = None
        # The chain's bookkeeping: `call_next()` awaitables made but not awaited, the coroutines
        # the chain entered (a list while it runs), the core entered / finished (an event only for
        # whoever waits for it), and the door that refuses entries after the chain returned.
        self.pending = 0
        self.entered: list[CoroutineType[Any, Any, ToolResult]] | None = None
        self.core_entered = False
        self.core_done = False
        self.core_waiter: trio.Event | None = None
        self.door_closed = False
        # Set once a settlement was attempted, so an exit never writes a second one.
        self.settle_attempted = False
        # Set when the settlement starts (or `execute` ends without one): ``emit`` takes no more items.
        self.closed = False
        # `permission_updates` effects the tool itself emitted (by identity); made by the first.
        self.granted: list[Effect] | None = None
        # The pipeline's stages, with one run's added (see `execute`).
        self.stages: ToolStages = pipeline.stages
        self.has_pre = pipeline._has_pre_stages
        # What the core holds until it ends: its scheduler slot, and its file locks
        # (paths taken, exclusive, owner: (session, call_key)).
        self.slot: _SlotHolder | None = None
        self.locks: tuple[tuple[str, ...], bool, Hashable] | None = None

    def on_abort(self, abort: Abort) -> None:
        self.aborted = abort
        phase = self.phase
        if phase is _Phase.MIDDLEWARE:
            if self.mw_scope is not None:
                self.mw_scope.cancel(reason=abort.message)
        elif phase is _Phase.CORE and self.target is not None:
            self.target.cancel(reason=abort.message)
            if self.tool_ran:
                self.pipeline._note_cancel(self)

    # -- a wait on a reader of the tool's items (`waiting_for_reader`) ---------------

    def _reader_scope(self) -> trio.CancelScope | None:
        """The tool's scope while it runs (its timeout), else nothing."""
        return self.target if self.tool_ran else None

    def _reader_held(self) -> float:
        """While the tool's deadline is held, so is its cleanup deadline: the tool does not overrun
        (new starts do not wait for it) while a reader keeps it waiting."""
        held = self.cleanup_deadline
        if held != -math.inf:  # (-inf: the tool ended)
            self.cleanup_deadline = math.inf  # its heap entries no longer match: they are dropped
        return held

    def _reader_resumed(self, waited: float, held: float) -> None:
        if self.cleanup_deadline == math.inf:  # neither cancelled (`_note_cancel`) nor ended meanwhile
            self.pipeline._track_cleanup(self, held + waited)

    def fault(self, code: FaultCode, message: str) -> None:
        """Record a middleware fault that the pipeline corrected."""
        if self.faults is None:
            self.faults = [MiddlewareFault(code, message)]
        else:
            self.faults.append(MiddlewareFault(code, message))

    def core_finished(self) -> trio.Event:
        """An event set when the core has finished (made for the first who waits)."""
        waiter = self.core_waiter
        if waiter is None:
            waiter = self.core_waiter = trio.Event()
            if self.core_done:
                waiter.set()
        return waiter

    def tool_emit(self, emit: Emit) -> Emit:
        """The tool's own ``ctx.emit``: marks its permission updates before they pass the middleware.

        A closure, not state on the call: *emit* is often the call's own `sink`, and the call
        holding it would be a reference cycle.
        """

        async def emit_from_tool(item: ToolItem) -> None:
            if self.closed:
                self.refuse_late(item)
            self.note_granted(item)
            with Holding(self):  # its publication's wait on a reader is not the tool's time
                await emit(item)

        return emit_from_tool

    async def sink_from_tool(self, item: ToolItem) -> None:
        """`tool_emit` of the call's own `sink` (no middleware in between): a bound method, no closure."""
        if self.closed:
            self.refuse_late(item)
        self.note_granted(item)
        with Holding(self):  # its publication's wait on a reader is not the tool's time
            await self.sink(item)

    def note_granted(self, item: ToolItem) -> None:
        """Mark *item* as the tool's own if it is a permission update."""
        if isinstance(item, Effect) and item.kind == PERMISSION_UPDATES:
            if self.granted is None:
                self.granted = []
            self.granted.append(item)

    def __call__(self, abort: Abort) -> None:
        """The call is the listener on the request's handle (and steering's), not a bound method
        kept per call: it aborts the call's own."""
        self.abort.abort(abort.reason, abort.message)

    def refuse_late(self, item: ToolItem) -> NoReturn:
        """An ``emit`` after the call settled (from a task that outlived it): a progress item would
        reach the stream after the call's result, an effect would never be applied."""
        raise trio.ClosedResourceError(
            f"tool call {self.scheduled.call_id!r} has ended: emit({type(item).__name__}) came after its "
            "result was settled (from a task that outlived the call?)"
        )

    async def sink(self, item: ToolItem) -> None:
        """The outermost ``emit``: collects effects, forwards the rest to the observer."""
        if self.closed:
            self.refuse_late(item)
        if isinstance(item, Effect):
            if item.kind == PERMISSION_UPDATES:
                # Only the tool (or the permission engine, outside the pipeline) may change the rules:
                # from middleware or a short-circuit this would be a plugin granting itself permissions.
                for index, granted in enumerate(self.granted or ()):
                    if granted is item:
                        del self.granted[index]  # type: ignore[union-attr]
                        break
                else:
                    self.fault(
                        FaultCode.PERMISSION_UPDATE_REFUSED,
                        "a permission_updates effect that the tool did not emit itself was dropped",
                    )
                    return
            if self.effects is None:
                self.effects = [item]
            else:
                self.effects.append(item)
        elif isinstance(item, (Progress, ToolMessage)):
            if self.on_item is not None:
                await self.on_item(item)
        else:
            raise TypeError(f"emit() takes Progress, ToolMessage or Effect items, got {safe_repr(item)}")


# -- what an outcome becomes ------------------------------------------------


def _aborted_result(abort: Abort) -> ToolResult:
    # The abort's message is free text ("the user pressed stop", "timed out after 2 s", ...): it
    # follows a colon or sits in parentheses, never glued into a sentence of ours.
    message = abort.message.strip().rstrip(".") or abort.reason.value.replace("_", " ")
    if abort.reason is AbortReason.TIMEOUT:
        text = f"The tool call did not finish in time and was stopped ({message})."
        return ToolResult.failure(ToolErrorType.TIMEOUT, text, code=abort.reason.value)
    text = f"The tool call was stopped before it finished: {message}."
    return ToolResult.failure(ToolErrorType.INTERRUPTED, text, code=abort.reason.value)


def _status_for(result: ToolResult) -> tuple[SettlementStatus, str | None]:
    error = result.error
    if error is None:
        return SettlementStatus.COMPLETED, None
    if error.type is ToolErrorType.INTERRUPTED:
        return SettlementStatus.CANCELLED, error.code or "interrupted"
    if error.type is ToolErrorType.PERMISSION_DENIED:
        return SettlementStatus.CANCELLED, error.code or "permission_denied"
    return SettlementStatus.FAILED, None


def _failure_result(failure: ToolFailure) -> ToolResult:
    """The error result of a `ToolFailure` the tool raised. Made from the tool's exception, so it stays
    that call's error result whatever the exception does (a subclass's ``to_result`` that raises or
    returns no error result), never an error of the pipeline."""
    try:
        result = failure.to_result()
    except Exception as exc:
        problem = f"its to_result() raised {describe(exc, 'repr')}"
    else:
        if isinstance(result, ToolResult) and result.error is not None:
            return result
        problem = (
            "its to_result() returned a success"
            if isinstance(result, ToolResult)
            else f"its to_result() returned {type(result).__name__}, not a ToolResult"
        )
    return ToolResult.failure(ToolErrorType.EXECUTION, f"{describe(failure)} ({problem})", code="tool_error")


def _must_propagate(exc: BaseException) -> bool:
    """Whether *exc* (holding a ``Cancelled``) holds something that must go on whatever the
    cancellation was (``KeyboardInterrupt``, ``SystemExit``)."""
    return any(not isinstance(leaf, (Exception, trio.Cancelled)) for leaf in leaves(exc))


def _raised_result(exc: Exception) -> ToolResult:
    # A group (a tool's own nursery) is told by its errors: "Exceptions from Trio nursery (1
    # sub-exception)" says nothing the model can act on.
    described = "; ".join(describe(leaf) for leaf in leaves(exc))
    return ToolResult.failure(ToolErrorType.EXECUTION, described, code="tool_error")


def _stray_cancelled_result(exc: BaseException) -> ToolResult:
    """The error result of a tool that raised ``trio.Cancelled`` (maybe in a group) while nothing
    around the call was cancelled: a cancellation of its own, escaped from the scope it belonged to."""
    return ToolResult.failure(
        ToolErrorType.EXECUTION,
        f"the tool raised {type(exc).__name__} though the call was not cancelled "
        "(a cancellation of a scope of its own that escaped it)",
        code="tool_error",
    )


def _withheld_result() -> ToolResult:
    return ToolResult.failure(
        ToolErrorType.EXECUTION,
        "tool result withheld: middleware did not finish unwinding in time",
        code="unwind_deadline_missed",
    )


def _settlement_failed(state: _Call, exc: Exception) -> SettlementError:
    return SettlementError(
        f"settling tool call {state.scheduled.call_id!r} failed: {describe(exc, 'text')}; nothing was published"
    )
