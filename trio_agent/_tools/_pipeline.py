"""The tool execution pipeline.

One call, in order (see docs/tool-pipeline.md for the picture)::

    on_tool_scheduled -> ownership check
    -> tool middleware (onion; guards at every layer boundary)
         core: pre_tool -> permission -> before -> schema check -> guard
               -> scheduler slot -> file locks -> on_execution_started (FINAL input)
               -> the tool -> post_tool
    -> unwind -> ownership check -> on_tool_settled -> publish (history, return)

Abort (SDK-owned, through `AbortHandle`) cancels whichever phase is running:
the middleware before the core starts, or the core. Once the tool has returned,
its result is committed: later aborts are only recorded, and the rest of the
unwind runs shielded under a short deadline so transforms such as redaction
still apply. Cancellation from outside propagates after a committed result (or
the cancellation itself) has been settled under a bounded shield.

Where the parts live: the middleware chain (`ToolLayers`, ``call_next``, the guard at every
layer boundary) in `_chain`; one call's state, the faults it records and the results its
outcomes become in `_call`; here, `ToolPipeline` (the core and its waits, the cleanup-overrun
tracking, settlement and publication) and the `ToolExecutionRecord` it returns.
"""

from __future__ import annotations

import heapq
import math
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import CoroutineType
from typing import Any, TypeAlias

import attrs
import trio

from .._abort import Abort, AbortHandle, AbortReason
from .._builders import constructor
from .._cleanup import bounded_shield
from .._config import MAX_TIMEOUT, validate_timeout
from .._errors import (
    ConfigError,
    FileLockTimeoutError,
    JournalError,
    LeaseLostError,
    NextCalledTwiceError,
    SettlementError,
    ToolBehaviorError,
    ToolDefinitionError,
    ToolInputError,
)
from .._groups import (
    STRAY_CANCELLED,
    cancelled_around,
    contains_cancelled,
    is_cancellation,
    stray_cancellation,
    typed_error,
)
from .._json import NOT_JSON, copy_if_json, is_json, json_problem
from .._middleware import Composed
from .._util import safe_repr
from ._call import (
    FaultCode,
    MiddlewareFault,
    _aborted_result,
    _Call,
    _failure_result,
    _must_propagate,
    _Phase,
    _raised_result,
    _settlement_failed,
    _status_for,
    _stray_cancelled_result,
    _withheld_result,
)
from ._chain import CallNext, ToolLayers, ToolMiddleware, _CallNext, _compose
from ._context import CallOrigin, Emit, ToolCall, _SlotHolder, execution_context, middleware_request, tool_context
from ._definition import InterruptBehavior, SideEffect, Tool, ToolBehavior, ToolKind
from ._journal import (
    InMemoryToolJournal,
    ScheduledCall,
    Settlement,
    SettlementStatus,
    ToolJournal,
    scheduled_call,
    settlement,
)
from ._overruns import logger, unwatch_cleanups, watch_cleanups
from ._results import (
    Effect,
    JsonObject,
    ToolErrorType,
    ToolFailure,
    ToolResult,
    _unstorable,
    describe,
    json_copy,
    result_problem,
)
from ._scheduler import FileLockManager, ToolScheduler
from ._stages import Allow, Deny, Skip, StageRequest, ToolStages, _stage_name, decide, failed_stage_result

__all__ = [
    "CallNext",
    "FaultCode",
    "MiddlewareFault",
    "ToolExecutionRecord",
    "ToolLayers",
    "ToolMiddleware",
    "ToolPipeline",
]


_OPEN_STATES = frozenset({"scheduled", "started"})


@attrs.frozen
class ToolExecutionRecord:
    """One settled call, as returned by `ToolPipeline.execute` and kept in the history.

    ``result`` is what the model and the stream see. ``effects`` are the `Effect`
    items the call emitted, for the session to apply now that the call is settled.
    Times are ``trio.current_time()`` values.
    """

    call: ToolCall
    effective_input: JsonObject | None
    result: ToolResult
    status: SettlementStatus
    behavior: ToolBehavior
    effects: tuple[Effect, ...]
    faults: tuple[MiddlewareFault, ...]
    published: bool
    tool_ran: bool
    synthetic_start: bool
    aborted: Abort | None
    scheduled_at: float
    ended_at: float

    @property
    def duration(self) -> float:
        return self.ended_at - self.scheduled_at


# One per call: built cheaper (see `_builders`), every field given.
_execution_record: Callable[
    [
        ToolCall,
        JsonObject | None,
        ToolResult,
        SettlementStatus,
        ToolBehavior,
        tuple[Effect, ...],
        tuple[MiddlewareFault, ...],
        bool,
        bool,
        bool,
        Abort | None,
        float,
        float,
    ],
    ToolExecutionRecord,
] = constructor(ToolExecutionRecord)


class _Aborted(Exception):
    """Our own scope was cancelled (abort or tool deadline) before the tool returned."""


_Prepared: TypeAlias = tuple[JsonObject, object, ToolBehavior]
"""The final input, what ``run`` receives, and the behaviour of the final input."""


class _NoScope:
    """``with``-able stand-in where a scope the code is already in serves (no second scope)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


_NO_SCOPE = _NoScope()
_NOT_RUN: Any = object()  # the tool's outcome before it ran


_NO_HISTORY: deque[ToolExecutionRecord] = deque(maxlen=0)
_NO_STAGES = ToolStages()  # immutable: every pipeline without stages shares it


def _post_stage_failed(callback: object, problem: str, state: _Call, result: ToolResult) -> ToolResult:
    """What a post_tool stage that failed leaves of *result*: a success becomes a ``hook_error``, its
    output withheld; an error stays as it is (it says more than the stage's failure)."""
    if not result.ok:
        return result
    name = state.tool.name
    return failed_stage_result(
        f"post_tool stage {_stage_name(callback)} {problem}; the output of {name!r} was withheld"
    )


def _invalid_input(tool: Tool[Any], errors: tuple[str, ...]) -> ToolResult:
    """The error result of input that fails *tool*'s checks (`Tool.input_errors`): what the
    `ToolInputError` of `Tool.validate_input` says, for the model."""
    message = f"invalid input for tool {tool.name!r}: " + "; ".join(errors)
    return ToolResult.failure(ToolErrorType.VALIDATION, message, code="invalid_input", details={"errors": list(errors)})


def _told(exc: BaseException | None) -> str:
    """A middleware's exception as its error result tells it (`describe`)."""
    if exc is None:
        return "None"
    told = describe(exc, "repr")
    return f"{told} {STRAY_CANCELLED}" if contains_cancelled(exc) else told


def _has_pre(stages: ToolStages) -> bool:
    return bool(stages.pre_tool or stages.permission or stages.before or stages.guard)


def _lock_manager(value: object) -> FileLockManager:
    if not isinstance(value, FileLockManager):
        raise ConfigError(f"file_locks must be a FileLockManager, not {safe_repr(value)}")
    return value


def _declares(journal: object, name: str) -> bool:
    """Whether *journal*'s own class (not an ancestor) promises *name*: a subclass may add awaits."""
    declared = type(journal).__dict__.get(name, False)
    return declared is True or (isinstance(declared, property) and getattr(journal, name, False) is True)


class ToolPipeline:
    """Runs tool calls through the journal, the tool middleware onion and the core stages.

    One pipeline serves a session, its root agent and all its subagents; it is
    safe to call `execute` from many tasks at once. The middleware stack is an
    immutable tuple checked once; per-call state never lives on middleware or
    on the pipeline.

    Args:
        tools: the tools by name (names must be unique).
        middleware: tool middleware, first = outermost.
        journal: the journal outlet (default: a new `InMemoryToolJournal`).
        scheduler: slot buckets by kind (default: a new `ToolScheduler` of this pipeline).
        stages: hook, permission and guard stages (default: none).
        timeout: per-call tool timeout in seconds (default 600); a tool's own ``timeout`` wins.
        lock_timeout: bound on waiting for file locks (default 30 s).
        cleanup_grace: how long a tool the pipeline cancelled (its abort or its timeout) may take
            to clean up before it is reported and new tool starts wait for it (default 5 s). A
            cancellation from outside is not tracked: Trio tells no one a scope around it was cancelled.
        unwind_grace: deadline for the middleware unwind after the core completed (default 2 s).
        settle_grace: deadline for a shielded settlement write (default 10 s).
        workspace: base directory for relative affected paths (default: the working directory).
        history_limit: how many settled calls `history` keeps (default 10,000).
        session_key: an opaque token of the session whose calls this pipeline runs, given to each
            call as ``ExecutionContext.session_key`` (default ``None``).
    """

    def __init__(
        self,
        tools: Iterable[Tool[Any]],
        *,
        middleware: Sequence[ToolMiddleware] = (),
        journal: ToolJournal | None = None,
        scheduler: ToolScheduler | None = None,
        file_locks: FileLockManager | None = None,
        stages: ToolStages | None = None,
        timeout: float = 600.0,
        lock_timeout: float = 30.0,
        cleanup_grace: float = 5.0,
        unwind_grace: float = 2.0,
        settle_grace: float = 10.0,
        workspace: str | os.PathLike[str] | None = None,
        history_limit: int = 10_000,
        session_key: object = None,
    ) -> None:
        registry: dict[str, Tool[Any]] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise ToolDefinitionError(f"expected a Tool (see define_tool), got {safe_repr(tool)}")
            if tool.name in registry:
                raise ToolDefinitionError(f"duplicate tool name {tool.name!r}; nothing is silently replaced")
            registry[tool.name] = tool
        self.tools: dict[str, Tool[Any]] = registry
        layers = ToolLayers.check(middleware)
        self.middleware: tuple[ToolMiddleware, ...] = layers
        journal = self.journal = journal if journal is not None else InMemoryToolJournal()
        # Only a class that declares never_blocks itself is trusted: a subclass may add awaits.
        self._journal_never_blocks = _declares(journal, "never_blocks")
        # A journal whose writes never checkpoint and raise before they change anything needs no
        # probe of the call's state around them (a write that raised left it as it was).
        self._journal_atomic = _declares(journal, "_atomic_writes")
        # The in-memory journal has no lease: its ownership check, asked five times a call, is a no-op.
        check = journal.check_ownership
        self._owner_checks = getattr(check, "__func__", None) is not InMemoryToolJournal.check_ownership
        # Whether the journal tells where it holds a call (`call_state`), and confirms its lease
        # (`ensure_owner`): its methods are looked up when used, not kept bound per pipeline.
        self._probes = callable(getattr(journal, "call_state", None))
        self._ensures = getattr(journal, "ensure_owner", None) is not None
        if scheduler is None:
            scheduler = ToolScheduler()
        elif not isinstance(scheduler, ToolScheduler):
            raise ConfigError(f"scheduler must be a ToolScheduler, not {safe_repr(scheduler)}")
        self.scheduler = scheduler
        # Made on first use: most pipelines never lock a file.
        self._file_locks = None if file_locks is None else _lock_manager(file_locks)
        stages_ = self.stages = stages if stages is not None else _NO_STAGES
        # The defaults are plain floats in range: checked only if one is not (a chat() run builds a pipeline).
        if not (
            type(timeout) is float
            and type(lock_timeout) is float
            and type(cleanup_grace) is float
            and type(unwind_grace) is float
            and type(settle_grace) is float
            and 0.0 < timeout <= MAX_TIMEOUT  # NaN fails each of these
            and 0.0 < lock_timeout <= MAX_TIMEOUT
            and 0.0 < cleanup_grace <= MAX_TIMEOUT
            and 0.0 < unwind_grace <= MAX_TIMEOUT
            and 0.0 < settle_grace <= MAX_TIMEOUT
        ):
            timeout = validate_timeout(timeout, name="tool timeout")
            lock_timeout = validate_timeout(lock_timeout, name="lock_timeout")
            cleanup_grace = validate_timeout(cleanup_grace, name="cleanup_grace")
            unwind_grace = validate_timeout(unwind_grace, name="unwind_grace")
            settle_grace = validate_timeout(settle_grace, name="settle_grace")
        self.timeout = timeout
        self.lock_timeout = lock_timeout
        self.cleanup_grace = cleanup_grace
        self.unwind_grace = unwind_grace
        self.settle_grace = settle_grace
        if isinstance(history_limit, bool) or not isinstance(history_limit, int) or history_limit < 0:
            raise ConfigError(f"history_limit must be a whole number >= 0, got {safe_repr(history_limit)}")
        history_limit = min(history_limit, sys.maxsize)  # a deque's bound; no history gets near it
        if workspace is not None:
            if not isinstance(workspace, (str, os.PathLike)) or not isinstance(path := os.fspath(workspace), str):
                raise ConfigError(f"workspace must be a directory path (a str), not {safe_repr(workspace)}")
            workspace = path
        self.workspace = workspace
        try:
            hash(session_key)  # it names the holders of file locks (`FileLockManager` owners)
        except TypeError:
            raise ConfigError(f"session_key must be hashable, got {safe_repr(session_key)}") from None
        self.session_key = session_key
        # No history kept: one shared empty deque (appending to it keeps nothing), not ~600 bytes each.
        self.history: deque[ToolExecutionRecord] = deque(maxlen=history_limit) if history_limit else _NO_HISTORY
        # Calls whose tool is running, keyed by the moment their cleanup would overrun: made by the
        # first, dropped once empty (an idle pipeline keeps no empty list).
        self._cleanup_heap: list[tuple[float, int, _Call]] | None = None
        self._cleanup_seq = 0
        self.cleanup_overruns = 0
        # Calls whose overrun is watched (the pipeline cancelled them, or found them overrunning),
        # each with whether it was reported; and when the run's watcher looks at them next.
        self._watched: dict[_Call, bool] | None = None
        self._watch_at = math.inf
        self._has_unwind = bool(layers) or bool(stages_.post_tool)
        self._has_pre_stages = _has_pre(stages_)
        # Composed once per layers object: sessions opened from one spec share it.
        self._chain: Composed | None = layers.derived("tool_chain", _compose) if layers else None

    @property
    def file_locks(self) -> FileLockManager:
        """The per-path locks of this pipeline's calls."""
        locks = self._file_locks
        if locks is None:
            locks = self._file_locks = FileLockManager()
        return locks

    @file_locks.setter
    def file_locks(self, value: FileLockManager) -> None:
        self._file_locks = _lock_manager(value)

    # -- public ---------------------------------------------------------------

    async def execute(
        self,
        call: ToolCall,
        origin: CallOrigin | None = None,
        *,
        abort: AbortHandle | None = None,
        steering: AbortHandle | None = None,
        on_item: Emit | None = None,
        idempotency_key: str | None = None,
        stages: ToolStages | None = None,
    ) -> ToolExecutionRecord:
        """Run one tool call to settlement and return its record.

        *abort* is the request's handle (reaches every call); *steering* reaches
        only ``cancel`` tools. *on_item* receives the progress and message items
        that survive the middleware's emit transforms. *stages* adds one run's
        stages (a chat run's before / guard / after hooks) after the pipeline's own.

        Raises:
            LeaseLostError: ownership was lost; nothing more was committed or published.
            JournalError: the journal refused a write (a `SettlementError` if the
                settlement failed, in which case nothing was published).
            trio.Cancelled: cancellation from outside, after settling what was committed.
        """
        if origin is None:
            origin = _DEFAULT_ORIGIN
        clock = trio.lowlevel.current_clock()
        scheduled_at = clock.current_time()
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            result = ToolResult.failure(
                ToolErrorType.VALIDATION, f"unknown tool {call.name!r} (available: {known})", code="unknown_tool"
            )
            return self._record(call, None, result, SettlementStatus.FAILED, _UNKNOWN_BEHAVIOR, None, scheduled_at)
        if not is_json(call.input):
            problem = json_problem(call.input, "the input")
            if problem is not None:
                # Refused before it is scheduled: no journal can hold it (a durable one's event check
                # raised out of here), and the tool is promised JSON. This call fails alone.
                result = _invalid_input(tool, (f"at <root>: {problem}",))
                return self._record(call, None, result, SettlementStatus.FAILED, tool.behavior, None, scheduled_at)
        behavior_error: ToolBehaviorError | None = None
        try:
            behavior = tool._static if tool.resolver is None else tool._resolve_behavior(call.input, True)
        except ToolBehaviorError as exc:
            behavior, behavior_error = tool.behavior, exc
        key = idempotency_key or f"{origin.session_id}:{origin.agent_id}:{call.id}"
        scheduled = scheduled_call(
            call.id, call.name, call.input, behavior, key,
            origin.session_id, origin.agent_id, origin.request_id, origin.turn_id,
        )  # fmt: skip
        journal = self.journal
        call_abort = AbortHandle()
        ctx = execution_context(
            origin.session_id, origin.agent_id, origin.request_id, origin.turn_id, call.id, key,
            call_abort, journal.fencing_token, origin.lineage, journal.ensure_owner if self._ensures else None,
            self.session_key,
        )  # fmt: skip
        state = _Call(self, tool, scheduled, ctx, on_item, json_copy(call.input), clock)
        has_unwind = self._has_unwind
        if stages is not None:
            merged = self.stages.then(stages)
            if merged is not self.stages:
                state.stages = merged
                state.has_pre = _has_pre(merged)
                has_unwind = has_unwind or bool(merged.post_tool)

        before = None if self._journal_atomic else self._call_state(scheduled)
        try:
            await journal.on_tool_scheduled(scheduled)
        except BaseException as exc:
            # A cancellation can land while the write is being confirmed, after the journal took it:
            # a call the journal now holds open is settled here, or it would stay open for ever.
            after = self._call_state(scheduled)
            if self._journal_atomic:
                before = after  # the write raised, so it changed nothing
            held = after in _OPEN_STATES and (after != before or contains_cancelled(exc))
            if held or (after is None and not self._knows_call_state() and contains_cancelled(exc)):
                lost = await self._settle_on_exit(state, exc)
                if lost is not None:
                    raise lost from exc
            raise
        if self._owner_checks:
            journal.check_ownership()

        # Removed in the finally below: the handle and the call refer to each other.
        token = call_abort.add_listener(state.on_abort)
        abort_token = -1 if abort is None else abort.add_listener(state)  # (it forwards: `_Call.__call__`)
        if steering is not None and behavior.interrupt is not InterruptBehavior.CANCEL:
            steering = None  # steering reaches only `cancel` tools
        steer_token = -1 if steering is None else steering.add_listener(state)
        try:
            if behavior_error is not None:
                result = ToolResult.failure(ToolErrorType.EXECUTION, str(behavior_error), code="behavior_error")
                published = True
            elif state.aborted is not None:  # aborted before we began: middleware is never entered
                if state.aborted.reason is AbortReason.LEASE_LOST:
                    raise LeaseLostError(state.aborted.message)
                result, published = _aborted_result(state.aborted), True
            elif has_unwind:
                result, published = await self._run_layered(state)
            else:
                result = await self._core(state, state.live_input, None)
                if state.fatal is not None or state.aborted is not None:  # what `_raise_fatal` looks at
                    self._raise_fatal(state)
                published = True
            # Settle (a success without a recorded start can only come from a short-circuit), then publish.
            if self._owner_checks:
                journal.check_ownership()
            if result.error is None:  # `_status_for`, inline for the common case
                status, reason = SettlementStatus.COMPLETED, None
            else:
                status, reason = _status_for(result)
            if status is SettlementStatus.COMPLETED and not state.started:
                await self._synthetic_start(state)
            if self._journal_never_blocks:
                # `_settle`, one await less: it cannot be interrupted (it never checkpoints), so no shield.
                state.settle_attempted = state.closed = True
                settled = settlement(status, result, state.effective_input, published, reason)
                try:
                    await journal.on_tool_settled(scheduled, settled)
                except LeaseLostError:
                    raise
                except Exception as exc:
                    raise _settlement_failed(state, exc) from exc
            else:
                await self._settle(state, result, status, published, reason)
            record = _execution_record(
                call,
                state.effective_input,
                result if published else _withheld_result(),
                status,
                behavior,
                () if state.effects is None else tuple(state.effects),
                () if state.faults is None else tuple(state.faults),
                published,
                state.tool_ran,
                state.synthetic,
                state.aborted,
                scheduled_at,
                clock.current_time(),
            )
            self.history.append(record)
            # Cancellation from outside continues here, after the committed result is settled.
            await trio.lowlevel.checkpoint_if_cancelled()
            return record
        except BaseException as exc:
            # Whatever leaves here (an outside cancellation, a group holding one, a journal error),
            # the call ends settled where the journal can still be written; the exception goes on unchanged
            # (unless the lease turned out lost: then that is what the caller must hear).
            lost = await self._settle_on_exit(state, exc)
            if lost is not None:
                raise lost from exc
            raise
        finally:
            state.closed = True  # settled, or ended without a settlement (a lost lease ...)
            call_abort.remove_listener(token)
            if abort is not None:
                abort.remove_listener(abort_token)
            if steering is not None:
                steering.remove_listener(steer_token)

    def statistics(self) -> dict[str, Any]:
        """Counters for diagnostics."""
        return {
            "tools": len(self.tools),
            "middleware": len(self.middleware),
            "history": len(self.history),
            "cleanup_overruns": self.cleanup_overruns,
            "scheduler": self.scheduler.statistics().buckets,
        }

    # -- the chain ------------------------------------------------------------

    async def _run_layered(self, state: _Call) -> tuple[ToolResult, bool]:
        """Run the middleware chain and the core; return the final result and whether it may be published."""
        chain = self._chain
        mw_result: ToolResult | None = None
        mw_error: BaseException | None = None
        entered: list[CoroutineType[Any, Any, ToolResult]] | None = None
        try:
            with trio.CancelScope() as scope:
                state.mw_scope = scope
                try:
                    if chain is not None:
                        state.entered = []
                        # The outermost layer gets our own request: nothing to guard.
                        request = middleware_request(state.tool.name, state.live_input, state.ctx, state.sink)
                        mw_result = await chain.start(request, state, _CallNext)
                    else:
                        mw_result = await self._core(state, state.live_input, None)
                except NextCalledTwiceError as exc:
                    state.next_twice = True
                    mw_error = exc
                except BaseException as exc:
                    # A group holding Cancelled (a middleware's or tool's own nursery) is a cancellation:
                    # it goes on unchanged, never a middleware failure. A typed error in it wins. A
                    # Cancelled of the middleware's own scope that nothing around it made is its failure.
                    if (is_cancellation(exc) and not stray_cancellation(exc)) or isinstance(
                        exc, (KeyboardInterrupt, SystemExit)
                    ):
                        raise
                    typed = typed_error(exc)
                    if isinstance(typed, LeaseLostError) and state.fatal is None and self.lease_lost():
                        state.fatal = typed
                    mw_error = exc
                finally:
                    # The chain is over: nothing that is still pending may enter it any more. What it
                    # entered is taken off the call (a coroutine still running refers back to it).
                    state.door_closed = True
                    entered, state.entered = state.entered, None
        except Exception as rest:
            # The scope caught its cancellation out of a group (a middleware's own nursery) and let
            # through an error raised beside it in cleanup: the chain was stopped by the abort or the
            # unwind deadline all the same, and what follows judges that as it would a Cancelled.
            if not scope.cancelled_caught:
                raise
            mw_error = rest
        # A `call_next()` still pending, or the inner layers it entered still running (in a task of
        # their own: a coroutine that has finished has no frame).
        still_open = state.pending > 0
        for coroutine in entered or ():
            if coroutine.cr_frame is not None:
                still_open = True
                break
        self._raise_fatal(state)
        if state.next_twice:
            state.fault(FaultCode.NEXT_CALLED_TWICE, "next() called multiple times")
        if state.core_entered and not state.core_done:
            # Started the core (in a task of its own) and returned: the real result is the core's.
            state.fault(
                FaultCode.EARLY_RETURN,
                "middleware returned before the core it started had finished; its real result was awaited",
            )
            await self._drain_core(state)
            self._raise_fatal(state)
            if state.core_result is not None:
                return state.core_result, True
        elif still_open:
            state.fault(
                FaultCode.EARLY_RETURN,
                "middleware returned while call_next() was pending; it was refused and the call short-circuited",
            )

        core = state.core_result
        if state.violation is not None:
            return ToolResult.failure(
                ToolErrorType.EXECUTION, f"Tool middleware failed: {state.violation}", code="middleware_violation"
            ), True
        if core is None and state.started and not state.synthetic:
            # The tool_started is recorded but the core ended without a result: a middleware's own scope
            # cancelled it. The real result is a cancellation; a start is never written twice.
            if mw_result is None:
                detail = f"middleware raised after cancelling the started core: {_told(mw_error)}"
                state.fault(FaultCode.MIDDLEWARE_RAISED_AFTER_CORE, detail)
            elif not (mw_result.error is not None and mw_result.error.type is ToolErrorType.INTERRUPTED):
                state.fault(FaultCode.CANCELLATION_OVERWRITTEN, "middleware replaced the result of a core it cancelled")
            return ToolResult.failure(ToolErrorType.INTERRUPTED, "tool call cancelled", code="cancelled"), True
        if core is None:
            # The core never ran: aborted, failed or short-circuited in middleware.
            if scope.cancelled_caught or (mw_result is None and state.aborted is not None):
                abort = state.aborted or Abort(AbortReason.USER_ABORT, "aborted")
                return _aborted_result(abort), True
            if mw_result is None:
                return ToolResult.failure(
                    ToolErrorType.EXECUTION, f"Tool middleware failed: {_told(mw_error)}", code="middleware_error"
                ), True
            if not isinstance(mw_result, ToolResult):
                return ToolResult.failure(
                    ToolErrorType.EXECUTION,
                    f"Tool middleware failed: returned {type(mw_result).__name__}, expected ToolResult",
                    code="middleware_error",
                ), True
            if result_problem(mw_result) is not None:
                return _unstorable(mw_result, "tool middleware returned"), True
            if mw_result.ok:
                await self._synthetic_start(state)
            return mw_result, True

        # The core ran and returned: its result is authoritative where middleware broke a rule.
        if scope.cancelled_caught:
            state.fault(
                FaultCode.UNWIND_DEADLINE_MISSED,
                f"middleware unwind missed its {self.unwind_grace:g} s deadline; the raw result was "
                "persisted and withheld",
            )
            return core, False
        if mw_result is None or not isinstance(mw_result, ToolResult):
            detail = _told(mw_error) if mw_result is None else f"returned {type(mw_result).__name__}"
            state.fault(FaultCode.MIDDLEWARE_RAISED_AFTER_CORE, detail)
            return core, True
        if mw_result is not core and result_problem(mw_result) is not None:
            mw_result = _unstorable(mw_result, "tool middleware returned")
        core_error = core.error
        if core_error is not None:
            if core_error.type in (ToolErrorType.INTERRUPTED, ToolErrorType.TIMEOUT):
                final_error = mw_result.error
                if final_error is None or final_error.type is not core_error.type:
                    code = (
                        FaultCode.TIMEOUT_OVERWRITTEN
                        if core_error.type is ToolErrorType.TIMEOUT
                        else FaultCode.CANCELLATION_OVERWRITTEN
                    )
                    state.fault(code, f"middleware replaced the core's {core_error.type.value} result")
                    return core, True
            elif mw_result.ok:
                state.fault(FaultCode.FAILED_CORE_TURNED_SUCCESS, "middleware turned a failed core into success")
                return core, True
        return mw_result, True

    # -- the core ---------------------------------------------------------------

    async def _core(self, state: _Call, model_input: JsonObject, emit: Emit | None) -> ToolResult:
        """The terminal of the chain: everything between the middleware and the side effect, and the tool.

        *emit* is ``None`` when no middleware runs: then the tool emits to the call's `sink`, and
        *model_input* is the call's `live_input`, which no one else has seen (so it need not be copied).

        One cancel scope that the call's abort cancels (`state.target`): the tool's own, with its
        deadline, or, when something may wait before the tool starts (stages, an overrunning
        cleanup, the slot, file locks), one entered before those waits whose deadline is set when
        the tool starts. The journal's ``tool_started`` write is never cancelled by an abort.
        """
        state.core_entered = True
        state.phase = _Phase.CORE
        try:
            try:
                try:
                    if state.aborted is not None:
                        raise _Aborted
                    tool = state.tool
                    prepared: _Prepared | ToolResult | None = None
                    paths: tuple[str, ...] | None = None
                    early: trio.CancelScope | None = None
                    if state.has_pre:
                        early = trio.CancelScope()
                    else:
                        prepared = self._prepare_input(state, model_input, private=emit is None)
                        if type(prepared) is tuple:
                            if self._cleanup_heap and self._overrunning() is not None:
                                early = trio.CancelScope()
                            else:
                                if tool._takes_slot:
                                    slot = state.slot = _SlotHolder(self.scheduler, prepared[2].kind)
                                    held = slot.acquire_nowait()
                                else:
                                    held = True  # a control tool's call takes none (`unscheduled`)
                                if not held:
                                    early = trio.CancelScope()
                                elif tool.affected_paths is not None:
                                    found = self._paths(tool, prepared[0])
                                    if isinstance(found, ToolResult):
                                        prepared = found  # the call fails: it runs no tool
                                    else:
                                        paths = found
                                        if paths:
                                            early = trio.CancelScope()
                                else:
                                    paths = ()
                    outcome: Any = _NOT_RUN
                    active: trio.CancelScope | None = early  # the scope that may cancel what runs now
                    try:
                        with _NO_SCOPE if early is None else early:
                            if early is not None:
                                state.target = early
                                prepared = await self._wait_for_start(state, model_input, prepared, paths)
                                state.target = None
                            if type(prepared) is tuple:
                                final_input, value, behavior = prepared
                                if state.aborted is not None:
                                    raise _Aborted
                                # The one final input: what the journal records, the record keeps and the
                                # tool's value came from.
                                state.effective_input = final_input
                                journal = self.journal
                                try:
                                    if self._owner_checks:
                                        journal.check_ownership()
                                    before = None if self._journal_atomic else self._call_state(state.scheduled)
                                    try:
                                        await journal.on_execution_started(
                                            state.scheduled, final_input, behavior.side_effect, synthetic=False
                                        )
                                    except BaseException:
                                        # Cancelled while the start was being confirmed, after the journal took it:
                                        # it is started, so the call settles as cancelled (never with a second,
                                        # synthetic start).
                                        if (
                                            not self._journal_atomic
                                            and before != "started"
                                            and self._call_state(state.scheduled) == "started"
                                        ):
                                            state.started = True
                                        raise
                                    state.started = True
                                    if self._owner_checks:
                                        journal.check_ownership()
                                except (LeaseLostError, JournalError) as exc:
                                    state.fatal = exc
                                    raise
                                if state.aborted is not None:  # arrived while tool_started was written
                                    raise _Aborted  # the tool never runs
                                tool_emit = state.sink_from_tool if emit is None else state.tool_emit(emit)
                                context = tool_context(state.ctx, tool_emit, state.slot, self.cleanup_grace, state)
                                deadline = state.clock.current_time() + (tool.timeout or self.timeout)
                                if early is None:
                                    scope = active = trio.CancelScope(deadline=deadline)
                                    entered: trio.CancelScope | _NoScope = scope
                                else:
                                    scope, entered = early, _NO_SCOPE
                                    scope.deadline = deadline
                                with entered:
                                    state.target = scope
                                    # Tracked until `_untrack_cleanup`: new starts wait for it if it overruns.
                                    self._track_cleanup(state, deadline + self.cleanup_grace)
                                    state.tool_ran = True
                                    try:
                                        outcome = await tool.run(value, context)
                                    except ToolFailure as failure:
                                        outcome = _failure_result(failure)
                                    except BaseException as exc:
                                        typed = typed_error(exc)
                                        if isinstance(typed, LeaseLostError) and self.lease_lost():
                                            state.fatal = typed
                                            raise
                                        if contains_cancelled(exc):
                                            # A cancellation (maybe a group from the tool's own nursery) goes
                                            # on. With nothing around the call cancelled, it is a Cancelled of a
                                            # scope of the tool's own that escaped it: the tool's error.
                                            if cancelled_around(scope) or _must_propagate(exc):
                                                raise
                                            outcome = _stray_cancelled_result(exc)
                                        elif not isinstance(exc, Exception):
                                            raise
                                        else:
                                            outcome = _raised_result(exc)
                                    finally:
                                        self._untrack_cleanup(state, scope)
                                    # The side effect is done: commit before anything else can be cancelled.
                                    state.target = None
                                    state.phase = _Phase.COMMITTED
                                    if state.mw_scope is not None:
                                        self._commit(state)
                                if scope.cancelled_caught and state.phase is not _Phase.COMMITTED:
                                    raise _Aborted
                    except Exception as rest:
                        # A scope of ours caught its cancellation out of a group (a stage's or the tool's own
                        # nursery) and let through an error raised beside it in their cleanup: the call was
                        # stopped by its abort or deadline all the same.
                        if active is None or not active.cancelled_caught or state.phase is _Phase.COMMITTED:
                            raise
                        raise _Aborted from rest
                    if early is not None and early.cancelled_caught and state.phase is not _Phase.COMMITTED:
                        raise _Aborted
                    if outcome is _NOT_RUN:  # short-circuited: denied, skipped, invalid, a lock timeout
                        assert isinstance(prepared, ToolResult)
                        result = prepared
                    else:
                        result = outcome if isinstance(outcome, ToolResult) else ToolResult.success(outcome)
                        if result_problem(result) is not None:
                            result = _unstorable(result, f"tool {tool.name!r} returned")
                        # Known from here on, even if the bounded unwind is cut short inside a post_tool stage.
                        state.core_result = result
                        if self._owner_checks:
                            try:
                                self.journal.check_ownership()
                            except LeaseLostError as exc:
                                state.fatal = exc
                                raise
                        if state.stages.post_tool:
                            result = await self._post_tool(state, result, prepared)  # type: ignore[arg-type]
                finally:
                    locks = state.locks
                    if locks is not None:
                        state.locks = None
                        self.file_locks.release_all(locks[0], exclusive=locks[1], owner=locks[2])
                    if state.slot is not None:
                        state.slot.release()
            except _Aborted:
                abort = state.aborted
                if abort is None:  # our deadline fired: the tool timed out
                    timeout = state.tool.timeout or self.timeout
                    state.abort.abort(AbortReason.TIMEOUT, f"timed out after {timeout:g} s")
                    abort = state.aborted
                    assert abort is not None
                result = _aborted_result(abort)
            finally:
                state.target = None
            if state.phase is not _Phase.COMMITTED:
                self._commit(state)
            state.core_result = result
            return result
        finally:
            state.core_done = True
            if state.core_waiter is not None:
                state.core_waiter.set()

    async def _wait_for_start(
        self,
        state: _Call,
        model_input: JsonObject,
        prepared: _Prepared | ToolResult | None,
        paths: tuple[str, ...] | None,
    ) -> _Prepared | ToolResult:
        """What may wait before the tool starts, in the scope the call's abort cancels: the stages (or the
        schema check), an overrunning cleanup, the slot, the file locks. Each step is done once: the
        ones `_core` already did without waiting are skipped."""
        if prepared is None:
            prepared = await self._pre_stages(state, model_input)
        if isinstance(prepared, ToolResult):
            return prepared
        if self._cleanup_heap and self._overrunning() is not None:
            if state.aborted is not None:
                raise _Aborted
            await self._wait_for_overrunning_cleanup()
        final_input, _, behavior = prepared
        slot = state.slot
        if slot is None and state.tool._takes_slot:
            slot = state.slot = _SlotHolder(self.scheduler, behavior.kind)
            held = slot.acquire_nowait()
        else:
            held = slot is None or slot.held  # none: a control tool's call takes none (`unscheduled`)
        if not held:
            assert slot is not None
            if state.aborted is not None:
                raise _Aborted
            await slot.acquire()
        if paths is None:
            found = self._paths(state.tool, final_input)
            if isinstance(found, ToolResult):
                return found
            paths = found
        if paths:
            exclusive = not (behavior.kind is ToolKind.READONLY and behavior.concurrency_safe)
            file_locks = self.file_locks
            locked = paths  # normalised by `_paths`
            ctx = state.ctx
            # Named within the session (else this pipeline): pipelines sharing the locks repeat call ids.
            scope = self.session_key if self.session_key is not None else self
            owner = (scope, ctx.call_key)
            lineage = tuple([(scope, key) for key in ctx.lineage]) if ctx.lineage else ()
            taken = file_locks.try_acquire_all(locked, exclusive, owner=owner, lineage=lineage)
            if taken is None:
                # Never wait for a lock while holding a slot: the lock's holder may have given its own
                # slot back (`slot_released`, e.g. while its subagent runs) and need one to go on, for
                # itself or its children. Waiting for a slot while holding locks is safe: that is what
                # the holder's own re-acquire does, and no slot holder waits for a lock.
                if slot is not None:
                    slot.release()
                if state.aborted is not None:
                    raise _Aborted
                try:
                    taken = await file_locks.acquire_all(
                        locked, exclusive, self.lock_timeout, owner=owner, lineage=lineage
                    )
                except FileLockTimeoutError as exc:
                    return ToolResult.failure(ToolErrorType.TIMEOUT, str(exc), code="lock_timeout")
                state.locks = (taken, exclusive, owner)
                if slot is not None:
                    await slot.acquire()
            else:
                state.locks = (taken, exclusive, owner)
        return prepared

    async def _post_tool(self, state: _Call, result: ToolResult, prepared: _Prepared) -> ToolResult:
        """The tool's result through the post_tool stages (an error result stays an error)."""
        final_input, _, behavior = prepared
        return await self._post_stages(state, final_input, result, behavior=behavior, ran=True)

    def _commit(self, state: _Call) -> None:
        state.phase = _Phase.COMMITTED
        mw_scope = state.mw_scope
        if mw_scope is not None:
            # From here on the unwind may not be cancelled from outside, only bounded.
            mw_scope.shield = True
            mw_scope.deadline = state.clock.current_time() + self.unwind_grace

    def _prepare_input(
        self, state: _Call, current: JsonObject, *, private: bool = False
    ) -> ToolResult | tuple[JsonObject, object, ToolBehavior]:
        """Schema check, behaviour for the final input, and structuring for ``run``. *private*: no one
        but the pipeline has seen *current* (it is not copied again)."""
        tool = state.tool
        # Whatever a stage or middleware handed over, and whatever the tool's own code makes of it,
        # fails this call alone, with a typed result: nothing here raises out of the call.
        try:
            # Frozen here, once: later in-place changes to the middleware's dict (while this call waits
            # for a slot or a lock) cannot make the journal say something other than what the tool ran with.
            json_checked = private  # private: a copy of the model's input, which `execute` found to be JSON
            if not private:
                copy = copy_if_json(current)  # frozen and checked in one walk
                if copy is NOT_JSON:
                    current = json_copy(current)  # what is wrong with it is told below
                else:
                    current, json_checked = copy, True  # type: ignore[assignment]
            errors = tool._input_errors(current, json_checked)
        except Exception as exc:
            return ToolResult.failure(
                ToolErrorType.VALIDATION,
                f"invalid input for tool {tool.name!r}: {describe(exc, 'text')}",
                code="invalid_input",
            )
        if errors:
            return _invalid_input(tool, errors)
        if private or current == state.scheduled.model_input:  # private: a copy of it no one changed
            behavior = state.behavior
        else:
            try:
                behavior = tool.resolve_behavior(current)
            except ToolBehaviorError as exc:
                return ToolResult.failure(ToolErrorType.EXECUTION, str(exc), code="behavior_error")
            except Exception as exc:
                message = f"the behaviour of tool {tool.name!r} could not be resolved: {describe(exc, 'repr')}"
                return ToolResult.failure(ToolErrorType.EXECUTION, message, code="behavior_error")
            if behavior.interrupt is not state.behavior.interrupt:
                # What steering does to this call was decided when it was scheduled (as for middleware).
                message = "a stage cannot change the tool interrupt behavior"
                return ToolResult.failure(ToolErrorType.EXECUTION, message, code="behavior_error")
        try:
            # The tool gets its own copy, so changing it cannot rewrite the recorded final input (which the
            # post_tool stages see, and the call's record keeps): an untyped tool the dict, a typed one an
            # instance made from a copy, unless its fields can hold no container (`Tool._shares_input`).
            if tool.input_type is None:
                value = json_copy(current)
            else:
                value = tool.structure_input(json_copy(current) if tool._shares_input else current)
        except ToolInputError as exc:
            return ToolResult.failure(ToolErrorType.VALIDATION, str(exc), code="invalid_input")
        except Exception as exc:
            message = f"invalid input for tool {tool.name!r}: {describe(exc, 'repr')}"
            return ToolResult.failure(ToolErrorType.VALIDATION, message, code="invalid_input")
        return current, value, behavior

    def _paths(self, tool: Tool[Any], final_input: JsonObject) -> tuple[str, ...] | ToolResult:
        """The paths the call locks (resolved, sorted: `FileLockManager.normalise`), or the failure of
        the tool's ``affected_paths`` (this call's alone)."""
        try:
            paths = tool.paths_for(final_input)
            # Resolved (file system calls) only for a call that names paths.
            return self.file_locks.normalise(paths, self.workspace) if paths else paths
        except Exception as exc:
            message = f"affected paths of tool {tool.name!r} failed: {describe(exc, 'repr')}"
            return ToolResult.failure(ToolErrorType.EXECUTION, message, code="tool_error")

    async def _pre_stages(
        self, state: _Call, model_input: JsonObject
    ) -> ToolResult | tuple[JsonObject, object, ToolBehavior]:
        """pre_tool and permission (pipes) -> before (first decision wins) -> schema check -> guard."""
        stages = state.stages
        current = model_input
        tool, ctx, behavior = state.tool, state.ctx, state.behavior
        for name, callbacks in (("pre_tool", stages.pre_tool), ("permission", stages.permission)):
            for callback in callbacks:
                request = StageRequest(tool, current, ctx, behavior)
                decision = await decide(name, callback, request, self.lease_lost)
                if isinstance(decision, Deny):
                    return decision.to_result()
                if isinstance(decision, Allow) and decision.input is not None:
                    current = decision.input
        for callback in stages.before:
            request = StageRequest(tool, current, ctx, behavior)
            decision = await decide("before", callback, request, self.lease_lost)
            if isinstance(decision, Deny):
                return decision.to_result()
            if isinstance(decision, Skip):
                return await self._post_stages(state, current, decision.result)
            if isinstance(decision, Allow):
                if decision.input is not None:
                    current = decision.input
                break
        prepared = self._prepare_input(state, current)
        if isinstance(prepared, ToolResult):
            return prepared
        for callback in stages.guard:
            # Each its own copy: the final input is checked, and is what the tool runs with and the journal
            # records; a change a guard made in place would reach neither (a new input goes by Allow).
            request = StageRequest(tool, json_copy(prepared[0]), ctx, behavior)
            decision = await decide("guard", callback, request, self.lease_lost)
            if isinstance(decision, Deny):
                return decision.to_result()
            if isinstance(decision, Allow):
                if decision.input is not None:
                    return self._prepare_input(state, decision.input)
                break
        return prepared

    async def _post_stages(
        self,
        state: _Call,
        final_input: JsonObject,
        result: ToolResult,
        *,
        behavior: ToolBehavior | None = None,
        ran: bool = False,
    ) -> ToolResult:
        """*result* through the post_tool stages (an error result stays an error): the tool's own
        when it *ran* (then a lost lease is the call's fatal error and a replacement is the core's
        result), else a skipped call's. A stage that raises or answers nonsense fails closed: a
        success becomes its ``hook_error``, the output withheld (a redaction that failed never passes
        the raw output on); an error result stays as it is."""
        for callback in state.stages.post_tool:
            request = StageRequest(
                state.tool, final_input, state.ctx, state.behavior if behavior is None else behavior, ran
            )
            try:
                replaced = await callback(request, result)
            except BaseException as exc:
                if isinstance(exc, LeaseLostError) and self.lease_lost():
                    if ran:
                        state.fatal = exc
                    raise
                if not isinstance(exc, Exception) and not stray_cancellation(exc):
                    raise  # a cancellation from outside goes on
                # Any other failure, a lost lease of a store the stage drives itself included.
                told = _told(exc)
                state.fault(FaultCode.MIDDLEWARE_RAISED_AFTER_CORE, f"post_tool stage failed: {told}")
                replaced = _post_stage_failed(callback, f"failed: {told}", state, result)
            if replaced is None:
                continue
            if not isinstance(replaced, ToolResult):
                replaced = _post_stage_failed(
                    callback, f"returned {safe_repr(replaced)}, expected a ToolResult or None", state, result
                )
            if replaced.error is not None or result.ok:
                if result_problem(replaced) is not None:
                    replaced = _unstorable(replaced, f"post_tool stage {_stage_name(callback)} returned")
                result = replaced
                if ran:
                    state.core_result = result
        return result

    def lease_lost(self) -> bool:
        """Whether the lease of this pipeline's journal is lost. A `LeaseLostError` that a tool, a
        stage or a middleware raised ends the session only then; otherwise it may be about a store
        of its own (a nested session's) and fails only its call. The loop asks the same of a
        client-tool call's stages."""
        if not self._owner_checks:
            return False  # a journal without a lease (the in-memory one) cannot lose it
        try:
            self.journal.check_ownership()
        except LeaseLostError:
            return True
        return False

    # -- cleanup overrun tracking ----------------------------------------------

    def _untrack_cleanup(self, state: _Call, scope: trio.CancelScope) -> None:
        # Lazy deletion: mark done; the heap drops finished entries when it looks at them.
        # The time first: a scope's `cancel_called` reads the clock itself, and past the cleanup
        # deadline the scope was cancelled (by its deadline or an abort) anyway.
        if (now := state.clock.current_time()) > state.cleanup_deadline and scope.cancel_called:
            self.cleanup_overruns += 1
            state.fault(
                FaultCode.CLEANUP_OVERRUN,
                f"tool {state.tool.name!r} took {now - state.cleanup_deadline + self.cleanup_grace:.3g} s to "
                f"stop after cancellation (grace {self.cleanup_grace:g} s)",
            )
        watched = self._watched
        if watched and state in watched:  # only on the overrun path: something is watched
            if watched.pop(state):  # its overrun was logged when it began: log its end
                logger.warning(
                    "tool %r (call %r) stopped %.3g s after it was cancelled (cleanup_grace %g s)",
                    state.tool.name,
                    state.scheduled.call_id,
                    now - state.cleanup_deadline + self.cleanup_grace,
                    self.cleanup_grace,
                )
            if not watched:
                self._watch_at = math.inf
                unwatch_cleanups(self)
        state.cleanup_deadline = -math.inf
        if state.done is not None:
            state.done.set()
        heap = self._cleanup_heap
        while heap and heap[0][2].cleanup_deadline == -math.inf:
            heapq.heappop(heap)
        if heap:
            # Below a call that still runs (a long tool, a subagent's), finished entries would keep
            # their calls alive (result, input, context) until it ends: drop every finished one now.
            heap[:] = [entry for entry in heap if entry[2].cleanup_deadline != -math.inf]
            heapq.heapify(heap)
        if not heap:
            self._cleanup_heap = None

    def _track_cleanup(self, state: _Call, deadline: float) -> None:
        """*state*'s tool overruns if it still runs at *deadline* (a wait on a reader of its items
        moved its deadline on: `_Call._reader_resumed`)."""
        state.cleanup_deadline = deadline
        self._cleanup_seq += 1
        heap = self._cleanup_heap
        if heap is None:
            heap = self._cleanup_heap = []
        heapq.heappush(heap, (deadline, self._cleanup_seq, state))

    def _note_cancel(self, state: _Call) -> None:
        if state.cleanup_deadline == -math.inf:
            return  # its tool has ended (an abort recording its timeout, say)
        deadline = trio.current_time() + self.cleanup_grace
        if deadline < state.cleanup_deadline:
            self._track_cleanup(state, deadline)
        self._watch(state)

    def _watch(self, state: _Call) -> None:
        """Report *state*'s overrun when its cleanup deadline passes (now, if it has), while its tool
        still runs: nothing else runs in its task until it ends. For the calls the pipeline cancels
        (their abort) and those it finds overrunning; a timeout alone is not watched (that would take
        a task per call), and is reported when the call is aborted, holds back a new start, or ends."""
        watched = self._watched
        if watched is None:
            watched = self._watched = {}
        watched.setdefault(state, False)
        at = state.cleanup_deadline
        if at <= trio.current_time():
            self._report_overruns()
        elif at < self._watch_at:
            self._watch_at = at
            watch_cleanups(self, at)

    def _report_overruns(self) -> None:
        """Log each watched call whose cleanup grace has run out, once (the run's watcher calls this at
        a cleanup deadline), and have the watcher come back at the next deadline."""
        watched = self._watched
        if not watched:
            return
        now = trio.current_time()
        later = math.inf
        for state, reported in list(watched.items()):
            deadline = state.cleanup_deadline
            if deadline > now:
                later = min(later, deadline)
                continue
            if reported:
                continue
            watched[state] = True
            abort = state.aborted
            why = f"aborted ({abort.reason.value})" if abort is not None else "timed out"
            logger.warning(
                "tool %r (call %r) has not stopped %.3g s after it was cancelled (%s; cleanup_grace %g s): "
                "new tool starts wait for it, and so does whatever waits for its call (the request's end, "
                "session.abort(), the session's close and the exit of its block), until it ends",
                state.tool.name,
                state.scheduled.call_id,
                now - deadline + self.cleanup_grace,
                why,
                self.cleanup_grace,
            )
        self._watch_at = later
        if later != math.inf:
            watch_cleanups(self, later)

    def overrunning_calls(self) -> list[str]:
        """For diagnostics: the running tools cancelled longer ago than their cleanup grace, as
        ``"tool 'name' (call 'id')"``."""
        now = trio.current_time()
        return [
            f"tool {state.tool.name!r} (call {state.scheduled.call_id!r})"
            for deadline, _, state in sorted(self._cleanup_heap or (), key=lambda entry: entry[:2])
            if state.cleanup_deadline == deadline and deadline <= now
        ]

    def _overrunning(self) -> _Call | None:
        """A cancelled call whose tool still runs past its cleanup grace, if any (new starts wait for it)."""
        heap = self._cleanup_heap
        while heap:
            deadline, _, other = heap[0]
            if other.cleanup_deadline == -math.inf or other.cleanup_deadline != deadline:
                heapq.heappop(heap)  # finished, or superseded by an earlier deadline entry
                continue
            if deadline > trio.current_time():
                return None
            return other
        return None

    async def _wait_for_overrunning_cleanup(self) -> None:
        """Block new tool starts while a cancelled tool overruns its cleanup grace."""
        while (other := self._overrunning()) is not None:
            self._watch(other)  # reported now, if it was not
            if other.done is None:
                other.done = trio.Event()
            await other.done.wait()

    # -- settlement and publication ----------------------------------------------

    def _knows_call_state(self) -> bool:
        return self._probes

    def _call_state(self, scheduled: ScheduledCall) -> str | None:
        if not self._probes:
            return None
        state = self.journal.call_state(scheduled)
        return state if isinstance(state, str) else None

    async def _settle_on_exit(self, state: _Call, exc: BaseException) -> LeaseLostError | None:
        """*exc* leaves `execute` with the call maybe unsettled: settle it where that can still be written.

        Completed (unpublished) if its core finished, else cancelled. Nothing is
        written once the lease is lost; a fenced journal refuses the write, and
        recovery closes the call when the journal is reopened. Never raises: the
        caller re-raises *exc* unchanged, or the returned `LeaseLostError` when
        the lease turned out lost (lease loss wins over what it caused).
        """
        if state.settle_attempted:
            return None
        if state.core_entered and not state.core_done:
            # A core started by middleware in another task still runs: stop it before settling.
            state.abort.abort(AbortReason.USER_ABORT, "tool call cancelled")
            with bounded_shield(self.cleanup_grace, f"tool call {state.scheduled.call_id!r} (stopping its core)"):
                await state.core_finished().wait()
        state.door_closed = True
        if isinstance(typed_error(exc), LeaseLostError) or isinstance(state.fatal, LeaseLostError):
            return None
        try:
            self.journal.check_ownership()
        except LeaseLostError as lost:
            return lost
        core = state.core_result
        if core is not None and state.phase is _Phase.COMMITTED and (state.started or not core.ok):
            result = core
            status, reason = _status_for(core)
        else:
            result = ToolResult.failure(ToolErrorType.INTERRUPTED, "tool call cancelled", code="cancelled")
            status, reason = SettlementStatus.CANCELLED, "cancelled"
        try:
            await self._settle(state, result, status, False, reason)
        except LeaseLostError as lost:
            return lost
        except JournalError:
            pass  # fenced: the call stays open for recovery to close
        return None

    async def _drain_core(self, state: _Call) -> None:
        """The chain returned while the core it started runs on elsewhere: wait for its real result."""
        with trio.move_on_after(state.tool.timeout or self.timeout):
            await state.core_finished().wait()
        if not state.core_done:
            state.abort.abort(AbortReason.TIMEOUT, "timed out waiting for a core that middleware left running")
            with bounded_shield(self.cleanup_grace, f"tool call {state.scheduled.call_id!r} (stopping its core)"):
                await state.core_finished().wait()

    async def _synthetic_start(self, state: _Call) -> None:
        effective_input = state.effective_input
        try:
            side_effect = state.tool.resolve_behavior(effective_input).side_effect
        except ToolBehaviorError:
            side_effect = state.tool.side_effect
        journal = self.journal
        journal.check_ownership()
        call_id = state.scheduled.call_id
        with bounded_shield(self.settle_grace, f"the synthetic start of tool call {call_id!r}") as scope:
            await journal.on_execution_started(state.scheduled, dict(effective_input), side_effect, synthetic=True)
        if scope.cancelled_caught:
            raise SettlementError(
                f"recording the start of short-circuited call {state.scheduled.call_id!r} did not finish within "
                f"{self.settle_grace:g} s; nothing was published"
            )
        state.started = True
        state.synthetic = True

    async def _settle(
        self, state: _Call, result: ToolResult, status: SettlementStatus, published: bool, reason: str | None
    ) -> None:
        state.settle_attempted = state.closed = True
        settled = settlement(status, result, state.effective_input, published, reason)
        if self._journal_never_blocks:
            # It cannot be interrupted (it never checkpoints), so a shield would change nothing.
            await self._write_settlement(state, settled)
            return
        call_id = state.scheduled.call_id
        with bounded_shield(self.settle_grace, f"the settlement of tool call {call_id!r}") as scope:
            await self._write_settlement(state, settled)
        if scope.cancelled_caught:
            raise SettlementError(
                f"settling tool call {state.scheduled.call_id!r} did not finish within {self.settle_grace:g} s; "
                "nothing was published"
            )

    async def _write_settlement(self, state: _Call, settled: Settlement) -> None:
        try:
            await self.journal.on_tool_settled(state.scheduled, settled)
        except LeaseLostError:
            raise
        except Exception as exc:
            raise _settlement_failed(state, exc) from exc

    def _raise_fatal(self, state: _Call) -> None:
        if state.fatal is not None:
            raise state.fatal
        abort = state.aborted
        if abort is not None and abort.reason is AbortReason.LEASE_LOST:
            raise LeaseLostError(abort.message)

    def _record(
        self,
        call: ToolCall,
        effective_input: JsonObject | None,
        result: ToolResult,
        status: SettlementStatus,
        behavior: ToolBehavior,
        state: _Call | None,
        scheduled_at: float,
        *,
        published: bool = True,
    ) -> ToolExecutionRecord:
        record = _execution_record(
            call,
            effective_input,
            result,
            status,
            behavior,
            () if state is None or state.effects is None else tuple(state.effects),
            () if state is None or state.faults is None else tuple(state.faults),
            published,
            state.tool_ran if state is not None else False,
            state.synthetic if state is not None else False,
            state.aborted if state is not None else None,
            scheduled_at,
            trio.current_time(),
        )
        self.history.append(record)
        return record


_DEFAULT_ORIGIN = CallOrigin()
_UNKNOWN_BEHAVIOR = ToolBehavior(SideEffect.NON_IDEMPOTENT, ToolKind.EXECUTE, InterruptBehavior.CANCEL, False)
