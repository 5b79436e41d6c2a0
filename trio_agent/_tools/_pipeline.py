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
"""

from __future__ import annotations

import enum
import functools
import heapq
import inspect
import math
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence
from types import TracebackType
from typing import Any, Protocol

import attrs
import trio

from .._abort import Abort, AbortHandle, AbortReason
from .._cleanup import bounded_shield
from .._config import validate_timeout
from .._errors import (
    ConfigError,
    FileLockTimeoutError,
    JournalError,
    LeaseLostError,
    MiddlewareShapeError,
    NextCalledTwiceError,
    SettlementError,
    ToolBehaviorError,
    ToolDefinitionError,
    ToolInputError,
)
from .._groups import contains_cancelled, is_cancellation, typed_error
from .._middleware import CheckedLayers, PassedChecks, check_middleware_shape, compose_middleware
from ._context import (
    CallOrigin,
    Emit,
    ExecutionContext,
    ToolCall,
    ToolContext,
    ToolMiddlewareRequest,
    _inherit_emit,
    _SlotHolder,
)
from ._definition import InterruptBehavior, SideEffect, Tool, ToolBehavior, ToolKind
from ._journal import InMemoryToolJournal, ScheduledCall, Settlement, SettlementStatus, ToolJournal
from ._results import (
    Effect,
    JsonObject,
    Progress,
    ToolErrorType,
    ToolFailure,
    ToolItem,
    ToolMessage,
    ToolResult,
    json_copy,
)
from ._scheduler import FileLockManager, ToolScheduler
from ._stages import Allow, Deny, Skip, StageRequest, ToolStages

__all__ = [
    "CallNext",
    "FaultCode",
    "MiddlewareFault",
    "ToolExecutionRecord",
    "ToolLayers",
    "ToolMiddleware",
    "ToolPipeline",
]


class CallNext(Protocol):
    """``await call_next(request=None, *, emit=None)`` runs the inner layers and the core."""

    def __call__(
        self, request: ToolMiddlewareRequest | None = None, *, emit: Emit | None = None
    ) -> Awaitable[ToolResult]: ...


ToolMiddleware = Callable[[ToolMiddlewareRequest, CallNext], Awaitable[ToolResult]]
"""``async def mw(request, call_next) -> ToolResult``."""


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


PERMISSION_UPDATES = "permission_updates"
"""The `Effect` kind that changes permission rules: only the tool itself may emit it."""

_OPEN_STATES = frozenset({"scheduled", "started"})


@attrs.frozen
class MiddlewareFault:
    code: FaultCode
    message: str


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


class _GuardViolation(Exception):
    """A middleware broke a pre-run rule; the call ends with an error and the tool does not run."""


class _Aborted(Exception):
    """Our own scope was cancelled (abort or tool deadline) before the tool returned."""


class _Phase(enum.Enum):
    MIDDLEWARE = 0  # before the core started: abort cancels the middleware scope
    CORE = 1  # the core runs: abort cancels the core scope
    COMMITTED = 2  # the core returned: abort is only recorded


class _Call:
    """Per-execution state. Lives in locals and on the request frame, never on the pipeline."""

    __slots__ = (
        "abort",
        "behavior",
        "cleanup_deadline",
        "core_entered",
        "core_finished",
        "core_result",
        "ctx",
        "done",
        "door_closed",
        "effective_input",
        "effects",
        "fatal",
        "faults",
        "granted",
        "has_pre",
        "has_unwind",
        "live_input",
        "mw_scope",
        "next_twice",
        "on_item",
        "pending",
        "phase",
        "pipeline",
        "running",
        "scheduled",
        "settle_attempted",
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
    ) -> None:
        self.pipeline = pipeline
        self.tool = tool
        self.scheduled = scheduled
        self.ctx = ctx
        self.abort = ctx.abort
        self.behavior = scheduled.behavior
        self.on_item = on_item
        # The dict middleware and the tool see: a copy, so the model's input (scheduled.model_input,
        # record.call.input) stays as sent, and in-place changes are detected by comparing against it.
        self.live_input: JsonObject = live_input
        self.effective_input: JsonObject = live_input
        self.effects: list[Effect] = []
        self.faults: list[MiddlewareFault] = []
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
        self.done: trio.Event | None = None
        # The chain's bookkeeping: `call_next()` awaitables made but not awaited, layers running,
        # the core entered / finished, and the door that refuses entries after the chain returned.
        self.pending = 0
        self.running = 0
        self.core_entered = False
        self.core_finished = trio.Event()
        self.door_closed = False
        # Set once a settlement was attempted, so an exit never writes a second one.
        self.settle_attempted = False
        # `permission_updates` effects the tool itself emitted (by identity).
        self.granted: list[Effect] = []
        # One run's stages added to the pipeline's (None: the pipeline's own, decided once).
        self.stages: ToolStages | None = None
        self.has_pre = False
        self.has_unwind = False

    def use_stages(self, stages: ToolStages, has_middleware: bool) -> None:
        self.stages = stages
        self.has_pre = bool(stages.pre_tool or stages.permission or stages.before or stages.guard)
        self.has_unwind = has_middleware or bool(stages.post_tool)

    def on_abort(self, abort: Abort) -> None:
        phase = self.phase
        if phase is _Phase.MIDDLEWARE:
            if self.mw_scope is not None:
                self.mw_scope.cancel(reason=abort.message)
        elif phase is _Phase.CORE and self.target is not None:
            self.target.cancel(reason=abort.message)
            if self.tool_ran:
                self.pipeline._note_cancel(self)

    def tool_emit(self, emit: Emit) -> Emit:
        """The tool's own ``ctx.emit``: marks its permission updates before they pass the middleware."""

        async def emit_from_tool(item: ToolItem) -> None:
            if isinstance(item, Effect) and item.kind == PERMISSION_UPDATES:
                self.granted.append(item)
            await emit(item)

        return emit_from_tool

    async def sink(self, item: ToolItem) -> None:
        """The outermost ``emit``: collects effects, forwards the rest to the observer."""
        if isinstance(item, Effect):
            if item.kind == PERMISSION_UPDATES:
                # Only the tool (or the permission engine, outside the pipeline) may change the rules:
                # from middleware or a short-circuit this would be a plugin granting itself permissions.
                for index, granted in enumerate(self.granted):
                    if granted is item:
                        del self.granted[index]
                        break
                else:
                    self.faults.append(
                        MiddlewareFault(
                            FaultCode.PERMISSION_UPDATE_REFUSED,
                            "a permission_updates effect that the tool did not emit itself was dropped",
                        )
                    )
                    return
            self.effects.append(item)
        elif isinstance(item, (Progress, ToolMessage)):
            if self.on_item is not None:
                await self.on_item(item)
        else:
            raise TypeError(f"emit() takes Progress, ToolMessage or Effect items, got {item!r}")


@attrs.frozen(eq=False)
class _Frame:
    """What travels through the composed chain: the request (which carries the current emit) and the call."""

    request: ToolMiddlewareRequest
    call: _Call


def _early_return_result() -> ToolResult:
    return ToolResult.failure(
        ToolErrorType.EXECUTION,
        "Tool middleware fault: call_next() was entered after the middleware chain had returned; "
        "nothing ran (the call was already settled)",
        code="middleware_early_return",
    )


class _Deferred(Coroutine[Any, Any, ToolResult]):
    """What ``call_next()`` returns: the inner layer's coroutine is made only when this is awaited.

    So a ``call_next()`` that is never awaited leaves no coroutine behind (no
    "never awaited" warning), the pipeline can count what is still pending when
    the chain returns, and an entry after that (the door is closed) runs nothing
    and returns a fault result. It is a `Coroutine`, so ``nursery.start_soon(call_next)`` works.
    """

    __slots__ = ("_gen", "_make", "_state", "_used")

    def __init__(self, make: Callable[[], Awaitable[ToolResult]], state: _Call) -> None:
        self._make = make
        self._state = state
        self._used = False
        self._gen: Generator[Any, Any, ToolResult] | None = None
        state.pending += 1

    def __await__(self) -> Generator[Any, Any, ToolResult]:
        if self._used:
            raise RuntimeError("cannot await the same call_next() twice")
        self._used = True
        return self._run()

    def _run(self) -> Generator[Any, Any, ToolResult]:
        state = self._state
        state.pending -= 1
        if state.door_closed:
            return _early_return_result()
        state.running += 1
        try:
            return (yield from self._make().__await__())
        finally:
            state.running -= 1

    def send(self, value: Any) -> Any:
        if self._gen is None:
            self._gen = self.__await__()
        return self._gen.send(value)

    def throw(self, typ: Any, val: Any = None, tb: TracebackType | None = None) -> Any:
        if self._gen is None:
            self._gen = self.__await__()
        if val is None and tb is None:
            return self._gen.throw(typ)
        return self._gen.throw(typ, val, tb)  # pragma: no cover - the legacy signature

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()


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


def _check_tool_middleware(layer: object, index: int) -> None:
    # Callable with (request, call_next): the generic check; then what a tool layer adds: async def.
    check_middleware_shape(layer, what="tool middleware", index=index)
    what = f"tool middleware #{index}"
    target = layer if inspect.isroutine(layer) or isinstance(layer, functools.partial) else type(layer).__call__
    if inspect.isasyncgenfunction(target):
        raise MiddlewareShapeError(
            f"{what} ({getattr(layer, '__qualname__', layer)}) is an async generator; tool middleware is "
            "`async def mw(request, call_next) -> ToolResult` and transforms items by passing emit= to call_next"
        )
    if not inspect.iscoroutinefunction(target):
        raise MiddlewareShapeError(
            f"{what} ({getattr(layer, '__qualname__', layer)}) must be an `async def mw(request, call_next)`"
        )


class ToolLayers(CheckedLayers):
    """Tool middleware checked once (`check`): a `ToolPipeline` built from it checks nothing again.

    An `AgentSpec` holds its layers as one, so opening a session re-validates nothing.
    """

    __slots__ = ()
    _sequence_error = "middleware must be a sequence of tool middleware, got {!r}"
    _passed = PassedChecks()  # a chat() run per request must not inspect the same functions again

    @staticmethod
    def _check_layer(layer: object, index: int) -> None:
        _check_tool_middleware(layer, index)


_NO_HISTORY: deque[ToolExecutionRecord] = deque(maxlen=0)


def _compose(layers: ToolLayers) -> Callable[[_Frame], Awaitable[ToolResult]]:
    """The chain of *layers* around the core: the adapters are ours, around checked layers (nothing
    to check again), and hold no pipeline (a call's frame knows it), so pipelines share it."""
    adapted = [ToolPipeline._adapt(layer) for layer in layers]
    return compose_middleware(adapted, ToolPipeline._terminal, check=ToolPipeline._guard, validate=False)


class ToolPipeline:
    """Runs tool calls through the journal, the tool middleware onion and the core stages.

    One pipeline serves a session, its root agent and all its subagents; it is
    safe to call `execute` from many tasks at once. The middleware stack is an
    immutable tuple composed once; per-call state never lives on middleware or
    on the pipeline.

    Args:
        tools: the tools by name (names must be unique).
        middleware: tool middleware, first = outermost.
        journal: the journal outlet (default: a new `InMemoryToolJournal`).
        scheduler: slot buckets by kind (default: a new `ToolScheduler` of this pipeline).
        stages: hook, permission and guard stages (default: none).
        timeout: per-call tool timeout in seconds (default 600); a tool's own ``timeout`` wins.
        lock_timeout: bound on waiting for file locks (default 30 s).
        cleanup_grace: how long a cancelled tool may take to clean up before it is
            reported and new tool starts wait for it (default 5 s).
        unwind_grace: deadline for the middleware unwind after the core completed (default 2 s).
        settle_grace: deadline for a shielded settlement write (default 10 s).
        workspace: base directory for relative affected paths (default: the working directory).
        history_limit: how many settled calls `history` keeps (default 10,000).
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
        workspace: str | None = None,
        history_limit: int = 10_000,
    ) -> None:
        registry: dict[str, Tool[Any]] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise ToolDefinitionError(f"expected a Tool (see define_tool), got {tool!r}")
            if tool.name in registry:
                raise ToolDefinitionError(f"duplicate tool name {tool.name!r}; nothing is silently replaced")
            registry[tool.name] = tool
        self.tools: dict[str, Tool[Any]] = registry
        layers = ToolLayers.check(middleware)
        self.middleware: tuple[ToolMiddleware, ...] = layers
        self.journal: ToolJournal = journal if journal is not None else InMemoryToolJournal()
        # Only a class that declares never_blocks itself is trusted: a subclass may add awaits.
        declared = type(self.journal).__dict__.get("never_blocks", False)
        self._journal_never_blocks = declared is True or (
            isinstance(declared, property) and getattr(self.journal, "never_blocks", False) is True
        )
        self.scheduler = scheduler if scheduler is not None else ToolScheduler()
        self.file_locks = file_locks if file_locks is not None else FileLockManager()
        self.stages = stages if stages is not None else ToolStages()
        self.timeout = validate_timeout(timeout, name="tool timeout")
        self.lock_timeout = validate_timeout(lock_timeout, name="lock_timeout")
        self.cleanup_grace = validate_timeout(cleanup_grace, name="cleanup_grace")
        self.unwind_grace = validate_timeout(unwind_grace, name="unwind_grace")
        self.settle_grace = validate_timeout(settle_grace, name="settle_grace")
        if isinstance(history_limit, bool) or not isinstance(history_limit, int) or history_limit < 0:
            raise ConfigError(f"history_limit must be a whole number >= 0, got {history_limit!r}")
        self.workspace = workspace
        # No history kept: one shared empty deque (appending to it keeps nothing), not ~600 bytes each.
        self.history: deque[ToolExecutionRecord] = deque(maxlen=history_limit) if history_limit else _NO_HISTORY
        # Calls whose tool is running, keyed by the moment their cleanup would overrun.
        self._cleanup_heap: list[tuple[float, int, _Call]] = []
        self._cleanup_seq = 0
        self.cleanup_overruns = 0
        self._has_unwind = bool(layers) or bool(self.stages.post_tool)
        stages_ = self.stages
        self._has_pre_stages = bool(stages_.pre_tool or stages_.permission or stages_.before or stages_.guard)
        self._chain: Callable[[_Frame], Awaitable[ToolResult]] | None = (
            layers.derived("tool_chain", _compose) if layers else None
        )

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
        origin = origin or _DEFAULT_ORIGIN
        scheduled_at = trio.current_time()
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            result = ToolResult.failure(
                ToolErrorType.VALIDATION, f"unknown tool {call.name!r} (available: {known})", code="unknown_tool"
            )
            return self._record(call, None, result, SettlementStatus.FAILED, _UNKNOWN_BEHAVIOR, None, scheduled_at)
        behavior_error: ToolBehaviorError | None = None
        try:
            behavior = tool.resolve_behavior(call.input)
        except ToolBehaviorError as exc:
            behavior, behavior_error = tool.behavior, exc
        key = idempotency_key or f"{origin.session_id}:{origin.agent_id}:{call.id}"
        scheduled = ScheduledCall(
            call.id, call.name, call.input, behavior, key,
            origin.session_id, origin.agent_id, origin.request_id, origin.turn_id,
        )  # fmt: skip
        journal = self.journal
        call_abort = AbortHandle()
        ctx = ExecutionContext(
            origin.session_id, origin.agent_id, origin.request_id, origin.turn_id, call.id, key,
            call_abort, journal.fencing_token, origin.lineage, getattr(journal, "ensure_owner", None),
        )  # fmt: skip
        state = _Call(self, tool, scheduled, ctx, on_item, json_copy(call.input))
        if stages is not None:
            state.use_stages(self.stages.then(stages), bool(self.middleware))

        before = self._call_state(scheduled)
        try:
            await journal.on_tool_scheduled(scheduled)
        except BaseException as exc:
            # A cancellation can land while the write is being confirmed, after the journal took it:
            # a call the journal now holds open is settled here, or it would stay open for ever.
            after = self._call_state(scheduled)
            held = after in _OPEN_STATES and (after != before or contains_cancelled(exc))
            if held or (after is None and not self._knows_call_state() and contains_cancelled(exc)):
                lost = await self._settle_on_exit(state, exc)
                if lost is not None:
                    raise lost from exc
            raise
        journal.check_ownership()

        # Removed in the finally below, with the links: the handle and the call refer to each other.
        links: list[tuple[AbortHandle, int]] = [(call_abort, call_abort.add_listener(state.on_abort))]
        if abort is not None:
            links.append((abort, abort.add_listener(_forward(call_abort))))
        if steering is not None and behavior.interrupt is InterruptBehavior.CANCEL:
            links.append((steering, steering.add_listener(_forward(call_abort))))
        try:
            if behavior_error is not None:
                result = ToolResult.failure(ToolErrorType.EXECUTION, str(behavior_error), code="behavior_error")
                return await self._finish(state, call, result, scheduled_at, published=True)
            if call_abort.reason is not None:  # aborted before we began: middleware is never entered
                if call_abort.reason.reason is AbortReason.LEASE_LOST:
                    raise LeaseLostError(call_abort.reason.message)
                return await self._finish(state, call, _aborted_result(call_abort.reason), scheduled_at)
            result, published = await self._run(state)
            return await self._finish(state, call, result, scheduled_at, published=published)
        except BaseException as exc:
            # Whatever leaves here (an outside cancellation, a group holding one, a journal error),
            # the call ends settled where the journal can still be written; the exception goes on unchanged
            # (unless the lease turned out lost: then that is what the caller must hear).
            lost = await self._settle_on_exit(state, exc)
            if lost is not None:
                raise lost from exc
            raise
        finally:
            for handle, token in links:
                handle.remove_listener(token)

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

    async def _run(self, state: _Call) -> tuple[ToolResult, bool]:
        """Run the middleware chain and the core; return the final result and whether it may be published."""
        if not (self._has_unwind if state.stages is None else state.has_unwind):
            result = await self._core(state, state.live_input, state.sink)
            self._raise_fatal(state)
            return result, True
        return await self._run_layered(state)

    async def _run_layered(self, state: _Call) -> tuple[ToolResult, bool]:
        chain = self._chain

        mw_result: ToolResult | None = None
        mw_error: BaseException | None = None
        with trio.CancelScope() as scope:
            state.mw_scope = scope
            try:
                if chain is not None:
                    request = ToolMiddlewareRequest(state.tool.name, state.live_input, state.ctx, state.sink)
                    mw_result = await chain(_Frame(request, state))
                else:
                    mw_result = await self._core(state, state.live_input, state.sink)
            except NextCalledTwiceError as exc:
                state.next_twice = True
                mw_error = exc
            except BaseException as exc:
                # A group holding Cancelled (a middleware's or tool's own nursery) is a cancellation:
                # it goes on unchanged, never a middleware failure. A typed error in it wins.
                if is_cancellation(exc) or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                typed = typed_error(exc)
                if isinstance(typed, LeaseLostError) and state.fatal is None:
                    state.fatal = typed
                mw_error = exc
            finally:
                # The chain is over: nothing that is still pending may enter it any more.
                state.door_closed = True
        self._raise_fatal(state)
        if state.next_twice:
            state.faults.append(MiddlewareFault(FaultCode.NEXT_CALLED_TWICE, "next() called multiple times"))
        if state.core_entered and not state.core_finished.is_set():
            # Started the core (in a task of its own) and returned: the real result is the core's.
            state.faults.append(
                MiddlewareFault(
                    FaultCode.EARLY_RETURN,
                    "middleware returned before the core it started had finished; its real result was awaited",
                )
            )
            await self._drain_core(state)
            self._raise_fatal(state)
            if state.core_result is not None:
                return state.core_result, True
        elif state.pending or state.running:
            state.faults.append(
                MiddlewareFault(
                    FaultCode.EARLY_RETURN,
                    "middleware returned while call_next() was pending; it was refused and the call short-circuited",
                )
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
                detail = f"middleware raised after cancelling the started core: {mw_error!r}"
                state.faults.append(MiddlewareFault(FaultCode.MIDDLEWARE_RAISED_AFTER_CORE, detail))
            elif not (mw_result.error is not None and mw_result.error.type is ToolErrorType.INTERRUPTED):
                state.faults.append(
                    MiddlewareFault(
                        FaultCode.CANCELLATION_OVERWRITTEN, "middleware replaced the result of a core it cancelled"
                    )
                )
            return ToolResult.failure(ToolErrorType.INTERRUPTED, "tool call cancelled", code="cancelled"), True
        if core is None:
            # The core never ran: aborted, failed or short-circuited in middleware.
            if scope.cancelled_caught or (mw_result is None and state.abort.reason is not None):
                abort = state.abort.reason or Abort(AbortReason.USER_ABORT, "aborted")
                return _aborted_result(abort), True
            if mw_result is None:
                return ToolResult.failure(
                    ToolErrorType.EXECUTION, f"Tool middleware failed: {mw_error!r}", code="middleware_error"
                ), True
            if not isinstance(mw_result, ToolResult):
                return ToolResult.failure(
                    ToolErrorType.EXECUTION,
                    f"Tool middleware failed: returned {type(mw_result).__name__}, expected ToolResult",
                    code="middleware_error",
                ), True
            if mw_result.ok:
                await self._synthetic_start(state)
            return mw_result, True

        # The core ran and returned: its result is authoritative where middleware broke a rule.
        if scope.cancelled_caught:
            state.faults.append(
                MiddlewareFault(
                    FaultCode.UNWIND_DEADLINE_MISSED,
                    f"middleware unwind missed its {self.unwind_grace:g} s deadline; the raw result was "
                    "persisted and withheld",
                )
            )
            return core, False
        if mw_result is None or not isinstance(mw_result, ToolResult):
            detail = repr(mw_error) if mw_result is None else f"returned {type(mw_result).__name__}"
            state.faults.append(MiddlewareFault(FaultCode.MIDDLEWARE_RAISED_AFTER_CORE, detail))
            return core, True
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
                    state.faults.append(
                        MiddlewareFault(code, f"middleware replaced the core's {core_error.type.value} result")
                    )
                    return core, True
            elif mw_result.ok:
                state.faults.append(
                    MiddlewareFault(
                        FaultCode.FAILED_CORE_TURNED_SUCCESS, "middleware turned a failed core into success"
                    )
                )
                return core, True
        return mw_result, True

    @staticmethod
    def _adapt(
        layer: ToolMiddleware,
    ) -> Callable[[_Frame, Callable[[_Frame | None], Awaitable[ToolResult]]], Awaitable[ToolResult]]:
        def run_layer(frame: _Frame, next_: Callable[[_Frame | None], Awaitable[ToolResult]]) -> Awaitable[ToolResult]:
            return _Deferred(functools.partial(enter_layer, frame, next_), frame.call)

        def enter_layer(
            frame: _Frame, next_: Callable[[_Frame | None], Awaitable[ToolResult]]
        ) -> Awaitable[ToolResult]:
            def call_next(
                request: ToolMiddlewareRequest | None = None, *, emit: Emit | None = None
            ) -> Awaitable[ToolResult]:
                try:
                    if request is None and emit is None:
                        return next_(None)
                    inner = frame.request if request is None else request
                    # The emit for inner layers: the emit= argument, else the request's own
                    # (if it was bound), else the current one.
                    inner_emit = inner.emit if emit is None else emit
                    if inner_emit is _inherit_emit:
                        inner_emit = frame.request.emit
                    if inner.emit is not inner_emit:
                        inner = ToolMiddlewareRequest(inner.tool_name, inner.input, inner.context, inner_emit)
                    return next_(_Frame(inner, frame.call))
                except NextCalledTwiceError:
                    frame.call.next_twice = True
                    raise

            return layer(frame.request, call_next)

        return run_layer

    @staticmethod
    def _guard(frame: _Frame) -> None:
        """Checked before every layer and the core: identity, name and interrupt behaviour."""
        state = frame.call
        request = frame.request
        if state.door_closed:
            return  # the chain already returned: the entry is refused when it is awaited
        try:
            if not isinstance(request, ToolMiddlewareRequest):
                raise _GuardViolation(f"call_next() takes a ToolMiddlewareRequest, got {type(request).__name__}")
            if request.tool_name != state.tool.name:
                raise _GuardViolation("Tool middleware cannot change the tool name")
            if request.context is not state.ctx:
                raise _GuardViolation("Tool middleware cannot replace the execution context")
            if request.input != state.scheduled.model_input:  # replaced, or changed in place
                if not isinstance(request.input, dict):
                    raise _GuardViolation("Tool middleware must pass a JSON object as input")
                try:
                    behavior = state.tool.resolve_behavior(request.input)
                except ToolBehaviorError as exc:
                    raise _GuardViolation(str(exc)) from None
                if behavior.interrupt is not state.behavior.interrupt:
                    raise _GuardViolation("Tool middleware cannot change the tool interrupt behavior")
        except _GuardViolation as exc:
            if state.violation is None:
                state.violation = str(exc)
            raise
        state.effective_input = request.input

    # -- the core ---------------------------------------------------------------

    @staticmethod
    def _terminal(frame: _Frame) -> Awaitable[ToolResult]:
        # Static, like _guard: the composed chain holds no bound method, so no pipeline -> chain ->
        # pipeline cycle (a chat() run's pipeline dies by refcount); the call knows its pipeline.
        state = frame.call
        return _Deferred(functools.partial(state.pipeline._core, state, frame.request.input, frame.request.emit), state)

    async def _core(self, state: _Call, model_input: JsonObject, emit: Emit) -> ToolResult:
        """The terminal of the chain: everything between the middleware and the side effect, and the tool."""
        state.core_entered = True
        state.phase = _Phase.CORE
        try:
            try:
                result = await self._core_body(state, model_input, emit)
            except _Aborted:
                abort = state.abort.reason
                if abort is None:  # our deadline fired: the tool timed out
                    timeout = state.tool.timeout or self.timeout
                    state.abort.abort(AbortReason.TIMEOUT, f"timed out after {timeout:g} s")
                    abort = state.abort.reason
                    assert abort is not None
                result = _aborted_result(abort)
            finally:
                state.target = None
            if state.phase is not _Phase.COMMITTED:
                self._commit(state)
            state.core_result = result
            return result
        finally:
            state.core_finished.set()

    def _commit(self, state: _Call) -> None:
        state.phase = _Phase.COMMITTED
        mw_scope = state.mw_scope
        if mw_scope is not None:
            # From here on the unwind may not be cancelled from outside, only bounded.
            mw_scope.shield = True
            mw_scope.deadline = trio.current_time() + self.unwind_grace

    async def _abortable(self, state: _Call, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Await ``fn(*args)`` in a scope that the call's abort cancels; raise `_Aborted` if it did."""
        if state.abort.reason is not None:
            raise _Aborted
        with trio.CancelScope() as scope:
            state.target = scope
            value = await fn(*args)
        state.target = None
        if scope.cancelled_caught:
            raise _Aborted
        return value

    async def _core_body(self, state: _Call, model_input: JsonObject, emit: Emit) -> ToolResult:
        if state.abort.reason is not None:
            raise _Aborted
        tool = state.tool
        if self._has_pre_stages if state.stages is None else state.has_pre:
            prepared = await self._abortable(state, self._pre_stages, state, model_input)
        else:
            prepared = self._prepare_input(state, model_input)
        if isinstance(prepared, ToolResult):
            return prepared
        final_input, value, behavior = prepared

        if self._cleanup_heap:
            await self._abortable(state, self._wait_for_overrunning_cleanup)
        slot = _SlotHolder(self.scheduler, behavior.kind)
        if not slot.acquire_nowait():
            await self._abortable(state, slot.acquire)
        try:
            paths = tool.paths_for(final_input)
            if not paths:
                return await self._start_and_run(state, tool, final_input, value, behavior, emit, slot)
            exclusive = not (behavior.kind is ToolKind.READONLY and behavior.concurrency_safe)
            locked = self.file_locks.normalise(paths, self.workspace)
            ctx = state.ctx
            owner = ctx.call_key
            try:
                taken = await self._abortable(
                    state,
                    functools.partial(self.file_locks.acquire_all, owner=owner, lineage=ctx.lineage),
                    locked,
                    exclusive,
                    self.lock_timeout,
                )
            except FileLockTimeoutError as exc:
                return ToolResult.failure(ToolErrorType.TIMEOUT, str(exc), code="lock_timeout")
            try:
                return await self._start_and_run(state, tool, final_input, value, behavior, emit, slot)
            finally:
                self.file_locks.release_all(taken, exclusive=exclusive, owner=owner)
        finally:
            slot.release()

    def _prepare_input(self, state: _Call, current: JsonObject) -> ToolResult | tuple[JsonObject, object, ToolBehavior]:
        """Schema check, behaviour for the final input, and structuring for ``run``."""
        tool = state.tool
        # Frozen here, once: later in-place changes to the middleware's dict (while this call waits
        # for a slot or a lock) cannot make the journal say something other than what the tool ran with.
        current = json_copy(current)
        errors = tool.input_errors(current)
        if errors:
            return ToolResult.failure(
                ToolErrorType.VALIDATION, f"invalid input for tool {tool.name!r}: " + "; ".join(errors),
                code="invalid_input", details={"errors": list(errors)},
            )  # fmt: skip
        if current == state.scheduled.model_input:
            behavior = state.behavior
        else:
            try:
                behavior = tool.resolve_behavior(current)
            except ToolBehaviorError as exc:
                return ToolResult.failure(ToolErrorType.EXECUTION, str(exc), code="behavior_error")
        try:
            # An untyped tool gets its own copy, so changing it cannot rewrite the recorded final input.
            value = tool.structure_input(current) if tool.input_type is not None else json_copy(current)
        except ToolInputError as exc:
            return ToolResult.failure(ToolErrorType.VALIDATION, str(exc), code="invalid_input")
        return current, value, behavior

    async def _pre_stages(
        self, state: _Call, model_input: JsonObject
    ) -> ToolResult | tuple[JsonObject, object, ToolBehavior]:
        """pre_tool and permission (pipes) -> before (first decision wins) -> schema check -> guard."""
        stages = self.stages if state.stages is None else state.stages
        current = model_input

        def request_for(value: JsonObject) -> StageRequest:
            return StageRequest(state.tool, value, state.ctx, state.behavior)

        for name, callbacks in (("pre_tool", stages.pre_tool), ("permission", stages.permission)):
            for callback in callbacks:
                decision = await self._decide(name, callback, request_for(current))
                if isinstance(decision, Deny):
                    return decision.to_result()
                if isinstance(decision, Allow) and decision.input is not None:
                    current = decision.input
        for callback in stages.before:
            decision = await self._decide("before", callback, request_for(current))
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
            decision = await self._decide("guard", callback, request_for(prepared[0]))
            if isinstance(decision, Deny):
                return decision.to_result()
            if isinstance(decision, Allow):
                if decision.input is not None:
                    return self._prepare_input(state, decision.input)
                break
        return prepared

    async def _post_stages(self, state: _Call, final_input: JsonObject, result: ToolResult) -> ToolResult:
        """A skipped call's result through the post stages (an error result stays an error)."""
        stages = self.stages if state.stages is None else state.stages
        for callback in stages.post_tool:
            try:
                replaced = await callback(StageRequest(state.tool, final_input, state.ctx, state.behavior), result)
            except LeaseLostError:
                raise
            except Exception as exc:
                state.faults.append(
                    MiddlewareFault(FaultCode.MIDDLEWARE_RAISED_AFTER_CORE, f"post_tool stage failed: {exc!r}")
                )
                continue
            if isinstance(replaced, ToolResult) and (replaced.error is not None or result.ok):
                result = replaced
        return result

    async def _decide(
        self,
        stage: str,
        callback: Callable[[StageRequest], Awaitable[Allow | Deny | Skip | None]],
        request: StageRequest,
    ) -> Allow | Deny | Skip | None:
        name = getattr(callback, "__qualname__", repr(callback))
        try:
            decision = await callback(request)
        except LeaseLostError:
            raise
        except Exception as exc:  # hooks fail closed
            return Deny(f"{stage} stage {name} failed: {exc!r}", ToolErrorType.EXECUTION, "hook_error")
        if decision is None or isinstance(decision, (Allow, Deny)):
            return decision
        if isinstance(decision, Skip) and stage == "before":
            return decision
        return Deny(
            f"{stage} stage {name} returned {decision!r}, expected Allow, Deny or None",
            ToolErrorType.EXECUTION,
            "hook_error",
        )

    async def _start_and_run(
        self,
        state: _Call,
        tool: Tool[Any],
        final_input: JsonObject,
        value: object,
        behavior: ToolBehavior,
        emit: Emit,
        slot: _SlotHolder,
    ) -> ToolResult:
        if state.abort.reason is not None:
            raise _Aborted
        journal = self.journal
        # The one final input: what the journal records, the record keeps and the tool's value came from.
        state.effective_input = final_input
        try:
            journal.check_ownership()
            before = self._call_state(state.scheduled)
            try:
                await journal.on_execution_started(state.scheduled, final_input, behavior.side_effect, synthetic=False)
            except BaseException:
                # Cancelled while the start was being confirmed, after the journal took it: it is
                # started, so the call settles as cancelled (never with a second, synthetic start).
                if before != "started" and self._call_state(state.scheduled) == "started":
                    state.started = True
                raise
            state.started = True
            journal.check_ownership()
        except (LeaseLostError, JournalError) as exc:
            state.fatal = exc
            raise
        if state.abort.reason is not None:  # arrived while tool_started was written: the tool never runs
            raise _Aborted
        context = ToolContext(state.ctx, state.tool_emit(emit), slot, self.cleanup_grace)
        deadline = trio.current_time() + (tool.timeout or self.timeout)
        with trio.CancelScope(deadline=deadline) as scope:
            state.target = scope
            self._track_cleanup(state, deadline + self.cleanup_grace)
            state.tool_ran = True
            try:
                outcome = await tool.run(value, context)
            except ToolFailure as failure:
                outcome = failure.to_result()
            except BaseException as exc:
                typed = typed_error(exc)
                if isinstance(typed, LeaseLostError):
                    state.fatal = typed
                    raise
                if contains_cancelled(exc) or not isinstance(exc, Exception):
                    raise  # a cancellation (maybe a group from the tool's own nursery) goes on unchanged
                outcome = ToolResult.failure(ToolErrorType.EXECUTION, f"{type(exc).__name__}: {exc}", code="tool_error")
            finally:
                self._untrack_cleanup(state, scope)
            # The side effect is done: commit before anything else can be cancelled.
            state.target = None
            self._commit(state)
        if scope.cancelled_caught and state.phase is not _Phase.COMMITTED:
            raise _Aborted
        result = outcome if isinstance(outcome, ToolResult) else ToolResult.success(outcome)
        # Known from here on, even if the bounded unwind is cut short inside a post_tool stage.
        state.core_result = result
        try:
            journal.check_ownership()
        except LeaseLostError as exc:
            state.fatal = exc
            raise
        for callback in (self.stages if state.stages is None else state.stages).post_tool:
            try:
                replaced = await callback(StageRequest(tool, final_input, state.ctx, behavior), result)
            except LeaseLostError as exc:
                state.fatal = exc
                raise
            except Exception as exc:
                state.faults.append(
                    MiddlewareFault(FaultCode.MIDDLEWARE_RAISED_AFTER_CORE, f"post_tool stage failed: {exc!r}")
                )
                continue
            if isinstance(replaced, ToolResult) and (replaced.error is not None or result.ok):
                result = replaced
                state.core_result = result
        return result

    # -- cleanup overrun tracking ----------------------------------------------

    def _track_cleanup(self, state: _Call, deadline: float) -> None:
        self._cleanup_seq += 1
        entry = (deadline, self._cleanup_seq, state)
        state.cleanup_deadline = deadline
        heapq.heappush(self._cleanup_heap, entry)

    def _untrack_cleanup(self, state: _Call, scope: trio.CancelScope) -> None:
        # Lazy deletion: mark done; the heap drops finished entries when it looks at them.
        if scope.cancel_called and (now := trio.current_time()) > state.cleanup_deadline:
            self.cleanup_overruns += 1
            state.faults.append(
                MiddlewareFault(
                    FaultCode.CLEANUP_OVERRUN,
                    f"tool {state.tool.name!r} took {now - state.cleanup_deadline + self.cleanup_grace:.3g} s to "
                    f"stop after cancellation (grace {self.cleanup_grace:g} s)",
                )
            )
        state.cleanup_deadline = -math.inf
        if state.done is not None:
            state.done.set()
        heap = self._cleanup_heap
        while heap and heap[0][2].cleanup_deadline == -math.inf:
            heapq.heappop(heap)

    def _note_cancel(self, state: _Call) -> None:
        deadline = trio.current_time() + self.cleanup_grace
        if deadline < state.cleanup_deadline:
            state.cleanup_deadline = deadline
            self._cleanup_seq += 1
            heapq.heappush(self._cleanup_heap, (deadline, self._cleanup_seq, state))

    async def _wait_for_overrunning_cleanup(self) -> None:
        """Block new tool starts while a cancelled tool overruns its cleanup grace."""
        heap = self._cleanup_heap
        while heap:
            deadline, _, other = heap[0]
            if other.cleanup_deadline == -math.inf or other.cleanup_deadline != deadline:
                heapq.heappop(heap)  # finished, or superseded by an earlier deadline entry
                continue
            if deadline > trio.current_time():
                return
            if other.done is None:
                other.done = trio.Event()
            await other.done.wait()

    # -- settlement and publication ----------------------------------------------

    def _knows_call_state(self) -> bool:
        return callable(getattr(self.journal, "call_state", None))

    def _call_state(self, scheduled: ScheduledCall) -> str | None:
        probe = getattr(self.journal, "call_state", None)
        if not callable(probe):
            return None
        state = probe(scheduled)
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
        if state.core_entered and not state.core_finished.is_set():
            # A core started by middleware in another task still runs: stop it before settling.
            state.abort.abort(AbortReason.USER_ABORT, "tool call cancelled")
            with bounded_shield(self.cleanup_grace, f"tool call {state.scheduled.call_id!r} (stopping its core)"):
                await state.core_finished.wait()
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
            await state.core_finished.wait()
        if not state.core_finished.is_set():
            state.abort.abort(AbortReason.TIMEOUT, "timed out waiting for a core that middleware left running")
            with bounded_shield(self.cleanup_grace, f"tool call {state.scheduled.call_id!r} (stopping its core)"):
                await state.core_finished.wait()

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
        state.settle_attempted = True
        settlement = Settlement(status, result, state.effective_input, published, reason)
        if self._journal_never_blocks:
            # It cannot be interrupted (it never checkpoints), so a shield would change nothing.
            await self._write_settlement(state, settlement)
            return
        call_id = state.scheduled.call_id
        with bounded_shield(self.settle_grace, f"the settlement of tool call {call_id!r}") as scope:
            await self._write_settlement(state, settlement)
        if scope.cancelled_caught:
            raise SettlementError(
                f"settling tool call {state.scheduled.call_id!r} did not finish within {self.settle_grace:g} s; "
                "nothing was published"
            )

    async def _write_settlement(self, state: _Call, settlement: Settlement) -> None:
        try:
            await self.journal.on_tool_settled(state.scheduled, settlement)
        except LeaseLostError:
            raise
        except Exception as exc:
            raise SettlementError(
                f"settling tool call {state.scheduled.call_id!r} failed: {exc}; nothing was published"
            ) from exc

    def _raise_fatal(self, state: _Call) -> None:
        if state.fatal is not None:
            raise state.fatal
        abort = state.abort.reason
        if abort is not None and abort.reason is AbortReason.LEASE_LOST:
            raise LeaseLostError(abort.message)

    async def _finish(
        self, state: _Call, call: ToolCall, result: ToolResult, scheduled_at: float, *, published: bool = True
    ) -> ToolExecutionRecord:
        self.journal.check_ownership()
        status, reason = _status_for(result)
        if status is SettlementStatus.COMPLETED and not state.started:
            # A success without a recorded start can only come from a short-circuit.
            await self._synthetic_start(state)
        await self._settle(state, result, status, published, reason)
        visible = result
        if not published:
            visible = ToolResult.failure(
                ToolErrorType.EXECUTION,
                "tool result withheld: middleware did not finish unwinding in time",
                code="unwind_deadline_missed",
            )
        record = self._record(
            call,
            state.effective_input,
            visible,
            status,
            state.behavior,
            state,
            scheduled_at,
            published=published,
        )
        # Cancellation from outside continues here, after the committed result is settled.
        await trio.lowlevel.checkpoint_if_cancelled()
        return record

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
        record = ToolExecutionRecord(
            call=call,
            effective_input=effective_input,
            result=result,
            status=status,
            behavior=behavior,
            effects=tuple(state.effects) if state is not None else (),
            faults=tuple(state.faults) if state is not None else (),
            published=published,
            tool_ran=state.tool_ran if state is not None else False,
            synthetic_start=state.synthetic if state is not None else False,
            aborted=state.abort.reason if state is not None else None,
            scheduled_at=scheduled_at,
            ended_at=trio.current_time(),
        )
        self.history.append(record)
        return record


def _forward(target: AbortHandle) -> Callable[[Abort], None]:
    def forward(abort: Abort) -> None:
        target.abort(abort.reason, abort.message)

    return forward


_DEFAULT_ORIGIN = CallOrigin()
_UNKNOWN_BEHAVIOR = ToolBehavior(SideEffect.NON_IDEMPOTENT, ToolKind.EXECUTE, InterruptBehavior.CANCEL, False)
