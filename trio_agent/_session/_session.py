"""Sessions: the agent loop per request, durable requests, subagents, in one nursery.

``async with open_session(...) as session`` owns a nursery. One request runs at
a time (a worker task takes them from a queue); background subagents are tasks
of the same nursery, so they outlive the request that started them but never
the session. Leaving the block cancels what still runs, records every
cancellation and writes exactly one ``session_closed`` per agent stream.

Each request is one run of the one agent loop (`trio_agent._loop.run_agent_loop`),
hosted through `_host.py`: model stream -> tool calls (concurrent, isolated,
results in call order) -> model ... until the model stops, a Stop hook lets it,
or ``max_turns``. Everything durable goes through the session's
`DurableJournal` (an in-memory store when no journal is given), so the same
code runs with and without durability.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio

from .._abort import Abort, AbortHandle, AbortReason
from .._cleanup import DEFAULT_CLEANUP_GRACE, bounded_shield, validate_cleanup_grace
from .._config import validate_id, validate_timeout
from .._errors import (
    ConfigError,
    InvalidTransitionError,
    JournalError,
    LeaseLostError,
    RequestAbortedError,
    SessionBusyError,
    SessionClosedError,
    SettlementError,
    TrioAgentError,
    UnknownSubagentError,
)
from .._groups import contains_cancelled, is_cancellation, typed_error, unwrap_for_boundary
from .._journal._conversation import encode_conversation, fold_conversation
from .._journal._durable import DurableJournal, RecoveryReport, open_journal, unknown_outcome_result
from .._journal._events import (
    PERMISSION_UPDATE_SOURCES,
    ConversationSeeded,
    ErrorInfo,
    ModelAttemptCompleted,
    PermissionUpdated,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    SessionClosed,
    SessionCloseReason,
    SessionReopened,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    TurnAborted,
    TurnAbortReason,
)
from .._journal._memory import MemoryStore
from .._journal._projection import RequestState, SessionState, ToolState, TurnState
from .._journal._registry import shared_sqlite_store
from .._journal._store import JournalStore
from .._journal._subscribe import DurableEventStream, JournalCursor
from .._loop._rules import LoopStrategy, max_iterations
from .._loop._run import run_agent_loop
from .._models._history import CallIdIndex, answer_orphan_calls, validate_history
from .._models._messages import (
    AssistantMessage,
    Message,
    TextPart,
    ToolSpec,
    UserMessage,
)
from .._models._service import ModelService, Provider
from .._tools._context import CallOrigin, ToolCall, ToolContext
from .._tools._definition import SideEffect, Tool, ToolKind, define_tool
from .._tools._pipeline import ToolPipeline
from .._tools._results import Effect, ToolErrorType, ToolResult
from ._endings import committed_results, open_items, record_request_end, request_is_open
from ._hooks import (
    HookAbortedError,
    HookAction,
    HookCallback,
    HookDecision,
    HookError,
    HookEvent,
    HookInput,
    HookRunner,
)
from ._host import SessionHooks, run_ports, run_spec
from ._messages import (
    DoneEvent,
    SessionEvent,
    SubagentEvent,
    SubagentStatus,
)
from ._permissions import (
    PermissionEngine,
    PermissionHandler,
    PermissionMode,
    PermissionRules,
    PermissionUpdate,
    ToolFilter,
    update_from_json,
    update_to_json,
)
from ._plugins import MiddlewareConfig, Plugin

__all__ = ["Priority", "Session", "SubagentDefinition", "SubagentHandle", "open_session"]

_log = logging.getLogger("trio_agent.session")

Priority = str  # "next" | "later" | "now"
_PRIORITIES = ("next", "later", "now")
_ids = itertools.count(1)

EventSink = Callable[[SessionEvent], Awaitable[None]]


async def _discard(event: SessionEvent) -> None:
    return None


def _optional_names(value: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen
class SubagentDefinition:
    """A named subagent: its own system prompt, a tool allowlist (intersected with the
    session's; ``None`` = all of the session's tools, empty = none), model and turn limit."""

    name: str
    description: str
    system_prompt: str
    tools: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_names)
    model: str | None = None
    max_turns: int | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 64:
            raise ConfigError(f"subagent name must be 1-64 characters, not {self.name!r}")
        validate_id(self.name, name="subagent name", max_length=64)  # it names the subagent's stream
        if self.max_turns is not None and (not isinstance(self.max_turns, int) or self.max_turns < 1):
            raise ConfigError(f"subagent {self.name!r}: max_turns must be a positive int")


@attrs.define
class _Agent:
    """One agent's configuration inside a session (the root or a subagent)."""

    agent_id: str
    name: str
    system_prompt: str
    allowed: frozenset[str]
    max_turns: int
    parent_id: str | None = None
    model: str | None = None
    history: list[Message] = attrs.Factory(list)
    specs: list[ToolSpec] | None = None
    lineage: tuple[str, ...] = ()  # the calls it runs under (a foreground subagent's tool calls)
    _strategy: LoopStrategy | None = None
    call_index: CallIdIndex = attrs.Factory(CallIdIndex)

    def strategy(self) -> LoopStrategy:
        """``max_turns`` as the loop's strategy (made once)."""
        if self._strategy is None:
            self._strategy = max_iterations(self.max_turns)
        return self._strategy


class _Request:
    __slots__ = (
        "abort",
        "accepting",
        "agent",
        "call_ids",
        "cancel_reason",
        "continuation",
        "done",
        "error",
        "finishing",
        "forwards",
        "holds",
        "pending",
        "priority",
        "prompt",
        "released",
        "request_id",
        "sink",
        "started",
        "steering",
        "stop",
        "stop_reason",
        "text",
        "turns",
    )

    def __init__(self, prompt: str, sink: EventSink, agent: _Agent) -> None:
        self.request_id = f"req-{uuid.uuid4().hex[:12]}"
        self.prompt = prompt
        self.sink = sink
        self.agent = agent
        self.abort = AbortHandle()
        self.steering = AbortHandle()
        # "Finish what runs, then stop": steering of a foreground subagent (its block tools finish).
        self.stop = AbortHandle()
        self.pending: list[str] = []
        self.call_ids: list[str] = []  # the tool calls it scheduled, for the results an abort keeps
        self.forwards: list[_Forward] = []  # the stream channels it feeds, closed when it ends
        # Why a cancellation from outside (not an SDK abort) ended it: decided by who hosts it.
        self.cancel_reason: Callable[[], RequestInterruptReason] = _session_close
        self.done = trio.Event()
        self.text = ""
        self.stop_reason = "end_turn"
        self.turns = 0
        self.error: BaseException | None = None
        self.priority: str | None = None
        self.started = False  # request_started is durable
        self.accepting = True  # messages with priority next/now may still join it
        self.continuation: str | None = None  # a Stop hook's "one more round" message
        self.finishing = False  # no new background starts may join it
        self.holds = 0  # background starts in progress under this request
        self.released = trio.Event()

    def finish(self) -> None:
        """It ended: wake its waiters. A stream always ends, even when its end could not be
        recorded or sent in time (the reader then learns the outcome from the request)."""
        for forward in self.forwards:
            forward.close_now()
        self.done.set()


def _session_close() -> RequestInterruptReason:
    return RequestInterruptReason.SESSION_CLOSE


_INTERRUPT_REASONS = {
    AbortReason.STEERING: RequestInterruptReason.STEERING,
    AbortReason.SESSION_CLOSE: RequestInterruptReason.SESSION_CLOSE,
}


def _interrupt_reason(reason: AbortReason) -> RequestInterruptReason:
    """The journal's reason for a request that an SDK abort with *reason* interrupted."""
    return _INTERRUPT_REASONS.get(reason, RequestInterruptReason.USER_ABORT)


class SubagentHandle:
    """A background subagent: ``status``, ``wait()``, ``cancel()`` (stop its current work;
    `resume` continues it) and ``kill()`` (final)."""

    def __init__(self, session: Session, agent: _Agent, parent_id: str, request_id: str) -> None:
        self._session = session
        self.agent = agent
        self.parent_id = parent_id
        self.parent_request_id = request_id
        self.status = SubagentStatus.RUNNING
        self.result: str | None = None
        self.error: str | None = None
        self._finished = trio.Event()
        self._work_scope: trio.CancelScope | None = None
        self._request: _Request | None = None  # the work running now
        self._killed = False
        self._prompts: list[str] = []
        self._wake = trio.Event()
        self._recorded = False  # its final outcome is on the parent's stream
        self._task_done = trio.Event()  # its task in the session's nursery ended

    @property
    def id(self) -> str:
        return self.agent.agent_id

    @property
    def name(self) -> str:
        return self.agent.name

    async def wait(self) -> str | None:
        """Wait until the current work ends (completed, failed, cancelled or idle); return its result."""
        await self._finished.wait()
        return self.result

    def cancel(self) -> None:
        """Stop the current work; the subagent stays resumable (`resume`)."""
        if self._work_scope is not None:
            self._work_scope.cancel()

    def kill(self) -> None:
        """Stop for good (recorded as cancelled if it never completed)."""
        self._killed = True
        self.cancel()
        self._wake.set()

    def resume(self, prompt: str) -> None:
        """Give an idle (cancelled or finished) subagent more work."""
        if self._killed:
            raise SessionClosedError(f"subagent {self.id} was killed")
        if self.status is SubagentStatus.RUNNING or not self._finished.is_set():
            raise SessionBusyError(f"subagent {self.id} is still running (or still recording its outcome)")
        self._prompts.append(prompt)
        self._finished = trio.Event()
        self.status = SubagentStatus.RUNNING
        self._wake.set()


def _tool_spec(tool: Tool[Any]) -> ToolSpec:
    return ToolSpec(tool.name, tool.description, dict(tool.input_schema))


def _text_of(message: AssistantMessage) -> str:
    return "".join(part.text for part in message.parts if isinstance(part, TextPart))


class Session:
    """A multi-turn agent session. Open it with `open_session`."""

    def __init__(
        self,
        *,
        journal: DurableJournal,
        service: ModelService,
        pipeline: ToolPipeline,
        root: _Agent,
        definitions: Mapping[str, SubagentDefinition],
        hooks: Any,
        max_concurrent_requests_queue: int = 64,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
        close_timeout: float = 30.0,
    ) -> None:
        self.journal = journal
        self.cleanup_grace = validate_cleanup_grace(cleanup_grace)
        self.close_timeout = validate_timeout(close_timeout, name="close_timeout")
        self.session_id = journal.session_id
        self._service = service
        self._services: dict[str, ModelService] = {service.model: service}
        self.pipeline = pipeline
        self.root = root
        self.definitions = dict(definitions)
        self._hooks = hooks
        self._agents: dict[str, _Agent] = {}
        self._context: list[str] = []  # SessionStart hooks' additional context, for every model call
        self.permissions: PermissionEngine | None = None
        self._nursery: trio.Nursery | None = None
        self._queue_send, self._queue_recv = trio.open_memory_channel[_Request](max_concurrent_requests_queue)
        self._current: _Request | None = None
        self._request_lock = trio.Lock()
        self._accepting = 0  # request_accepted writes in flight (close waits for them)
        self._accepted = trio.Event()
        self._started = False
        self._worker_done = trio.Event()
        self._running: dict[tuple[str, str], _Request] = {}  # (agent id, request id) -> running request
        self._call_origins: dict[str, str] = {}  # running tool call id -> its request id
        self._closing = False
        self.subagents: dict[str, SubagentHandle] = {}
        self._inbox: dict[str, list[str]] = {}
        self.recovery: RecoveryReport | None = None
        self.recovery_notes: list[str] = []
        self.life = 1  # which life of the session this is (a cleanly closed session reopened: 2, 3 ...)
        self._final = False  # the close ends it for good
        self._closed = False

    # -- public API

    def messages(self) -> tuple[Message, ...]:
        """The root agent's conversation so far (a snapshot; the session owns the live one)."""
        return tuple(self.root.history)

    async def close(self, *, final: bool = False) -> None:
        """Close the session now (what leaving the block does). With ``final=True`` it is
        ended for good: reopening its id is refused. Otherwise a later
        ``open_session(session_id=...)`` continues the conversation in a new life."""
        self._final = self._final or final
        await self._close(SessionCloseReason.COMPLETED)

    async def end(self) -> None:
        """End the session for good now: ``close(final=True)``."""
        await self.close(final=True)

    @property
    def model(self) -> str:
        return self._service.model

    def set_model(self, name: str) -> None:
        """Use model ``name`` from the next model call on (same middleware stack)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"model name must be a non-empty string, not {name!r}")
        service = self._services.get(name)
        if service is None:
            service = self._services[name] = self._service.with_model(name)
        self._service = service

    def _service_for(self, agent: _Agent) -> ModelService:
        if agent.model is None:
            return self._service
        service = self._services.get(agent.model)
        if service is None:
            service = self._services[agent.model] = self._service.with_model(agent.model)
        return service

    async def send(self, prompt: str, *, priority: Priority | None = None) -> str:
        """Run ``prompt`` as a request and return the final answer.

        While a request runs: ``priority="next"`` adds the message to it after
        the current turn, ``"now"`` does that and steers (aborts ``cancel``
        tools), ``"later"`` queues a new request; no priority raises `SessionBusyError`.
        """
        # Same rules as `stream`, without an event channel: nobody reads the events.
        self._check_message(prompt, priority)
        current = self._current
        if self._joins(current, priority):
            assert current is not None
            self._join(current, prompt, priority)
            await current.done.wait()
            _raise_for(current)
            return current.text
        self._check_not_busy(current, priority)
        request = _Request(prompt, _discard, self.root)
        request.priority = priority
        await self._accept(request)
        try:
            await request.done.wait()
        finally:
            if not request.done.is_set():
                with self._cleanup_scope():
                    await self._abort_request(request, AbortReason.USER_ABORT, "send() was cancelled")
        _raise_for(request)
        return request.text

    def _check_message(self, prompt: str, priority: Priority | None) -> None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError("a prompt must be a non-empty string")
        if priority is not None and priority not in _PRIORITIES:
            raise ConfigError(f"priority must be one of {_PRIORITIES}, not {priority!r}")
        if self._closing or self._nursery is None:
            raise SessionClosedError("the session is closed")

    @staticmethod
    def _joins(current: _Request | None, priority: Priority | None) -> bool:
        return current is not None and not current.done.is_set() and current.accepting and priority in ("next", "now")

    @staticmethod
    def _join(current: _Request, prompt: str, priority: Priority | None) -> None:
        current.pending.append(prompt)
        if priority == "now":
            current.steering.abort(AbortReason.STEERING, "steered by a new message")

    def _check_not_busy(self, current: _Request | None, priority: Priority | None) -> None:
        if current is not None and not current.done.is_set() and priority is None:
            raise SessionBusyError("a request is running: send with priority='next', 'now' or 'later', or wait for it")
        if current is None and self._queue_recv.statistics().current_buffer_used and priority is None:
            raise SessionBusyError("requests are queued: send with priority='later' to queue another")

    @asynccontextmanager
    async def stream(self, prompt: str, *, priority: Priority | None = None) -> AsyncIterator[_EventStream]:
        """``async with session.stream(prompt) as events: async for event in events``.

        Leaving the block before the request finished aborts it.
        """
        self._check_message(prompt, priority)
        send, recv = trio.open_memory_channel[SessionEvent](256)
        current = self._current
        if self._joins(current, priority):
            assert current is not None
            # Joins the running request at its next turn.
            self._join(current, prompt, priority)
            stream = _EventStream(recv, current, joined=True)
            forward = _Forward(send, current.abort)
            current.forwards.append(forward)
            previous = current.sink
            current.sink = _tee(previous, forward)
            try:
                async with recv:
                    yield stream
            finally:
                forward.closed = True
            return
        self._check_not_busy(current, priority)
        request = _Request(prompt, _discard, self.root)
        forward = _Forward(send, request.abort)
        request.sink = forward
        request.forwards.append(forward)
        request.priority = priority
        await self._accept(request)
        stream = _EventStream(recv, request, joined=False)
        try:
            async with recv:
                yield stream
        finally:
            forward_sink = request.sink
            if isinstance(forward_sink, _Forward):
                forward_sink.closed = True
            if not request.done.is_set():
                with self._cleanup_scope():
                    await self._abort_request(request, AbortReason.USER_ABORT, "the stream was closed early")

    async def _accept(self, request: _Request) -> None:
        stats = self._queue_send.statistics()
        if stats.current_buffer_used >= stats.max_buffer_size:
            raise SessionBusyError(f"{stats.current_buffer_used} requests are already queued; wait for some to finish")
        # request_accepted is durable before send returns or the stream starts.
        self._accepting += 1  # the close waits for this, so the request is settled either way
        try:
            try:
                await self.journal.append(
                    RequestAccepted(
                        request_id=request.request_id, command_id=request.request_id, input={"prompt": request.prompt}
                    ),
                    command_id=request.request_id,
                )
            except trio.Cancelled:
                await self._unqueue(request, "the caller was cancelled while the request was accepted")
                raise
            if self._closing:
                await self._unqueue(request, "the session closed while the request was accepted")
                raise SessionClosedError("the session is closed")
            self._queue_send.send_nowait(request)
        finally:
            self._accepting -= 1
            if self._accepting == 0:
                self._accepted.set()

    async def _unqueue(self, request: _Request, why: str) -> None:
        """An accepted request that will never be queued: record it interrupted (if it was accepted)."""
        record = self.journal.projection().request(request.request_id)
        if record is None or record.state is not RequestState.ACCEPTED:
            return
        with self._cleanup_scope("recording an unqueued request"):
            await record_request_end(
                self.journal,
                self.root.agent_id,
                request.request_id,
                RequestInterrupted(request_id=request.request_id, reason=RequestInterruptReason.USER_ABORT),
            )
        request.error = RequestAbortedError(why, reason="user_abort")
        request.finish()

    async def abort(self, reason: AbortReason | str = AbortReason.USER_ABORT, message: str = "aborted") -> None:
        """Abort the running request; returns after ``request_interrupted`` is durable."""
        reason = AbortReason(reason) if isinstance(reason, str) else reason
        current = self._current
        if current is None or current.done.is_set():
            await trio.lowlevel.checkpoint()
            return
        await self._abort_request(current, reason, message)

    async def _abort_request(self, request: _Request, reason: AbortReason, message: str) -> None:
        request.abort.abort(reason, message)
        if self._current is not request and not request.started and not request.done.is_set():
            # Still queued: it never starts; record it now instead of waiting for the worker.
            with self._cleanup_scope("recording a queued request's abort"):
                await record_request_end(
                    self.journal,
                    request.agent.agent_id,
                    request.request_id,
                    RequestInterrupted(request_id=request.request_id, reason=_interrupt_reason(reason)),
                )
            request.error = RequestAbortedError(
                f"the request was aborted before it started: {message}", reason=reason.value
            )
            request.stop_reason = "aborted"
            request.finish()
            return
        await request.done.wait()

    def subscribe_durable_events(
        self, *, agent_id: str | None = None, after: JournalCursor | str | int = 0
    ) -> AbstractAsyncContextManager[DurableEventStream]:
        """The journal's subscription for one agent's stream (the root's by default)."""
        return self.journal.subscribe_durable_events(agent_id=agent_id, after=after)

    async def start_subagent(self, name: str, prompt: str, *, parent_agent_id: str | None = None) -> SubagentHandle:
        """Start a background subagent in the session's nursery; returns its handle at once.

        Its start is recorded on the parent's stream under the running request, or,
        between requests, under a short request of its own.
        """
        if self._closing or self._nursery is None:
            raise SessionClosedError("the session is closed")
        self._definition(name)  # unknown names fail before anything is written
        parent = parent_agent_id or self.root.agent_id
        current = self._current
        if current is not None and current.started and not current.finishing:
            if current.holds == 0:
                current.released = trio.Event()
            current.holds += 1
            try:
                return await self._spawn_background(name, prompt, parent, current.request_id, call_id=None)
            finally:
                current.holds -= 1
                if current.holds == 0:
                    current.released.set()
        # Between requests: a short request of its own holds the request slot meanwhile.
        try:
            async with self._request_lock:
                return await self._start_between_requests(name, prompt, parent)
        except BaseExceptionGroup as group:
            raise unwrap_for_boundary(group) from None

    async def _start_between_requests(self, name: str, prompt: str, parent: str) -> SubagentHandle:
        holder = _Request(f"start subagent {name}", _discard, self.root)
        try:
            # From the moment this append is submitted the holder request is open in the
            # projection: every way out below must end it, a cancellation included.
            await self.journal.append(
                RequestAccepted(
                    request_id=holder.request_id,
                    command_id=holder.request_id,
                    input={"start_subagent": name, "prompt": prompt},
                ),
                RequestStarted(request_id=holder.request_id),
                agent_id=parent,
            )
            handle = await self._spawn_background(name, prompt, parent, holder.request_id, call_id=None)
            await self.journal.append(RequestCompleted(request_id=holder.request_id), agent_id=parent)
            return handle
        except BaseException as exc:
            if is_cancellation(exc):
                terminal: Any = RequestInterrupted(
                    request_id=holder.request_id, reason=RequestInterruptReason.USER_ABORT
                )
            else:
                terminal = RequestFailed(request_id=holder.request_id, error=ErrorInfo(message=str(exc)[:2000]))
            with self._cleanup_scope("recording an interrupted subagent start"):
                await record_request_end(self.journal, parent, holder.request_id, terminal)
            raise

    # -- subagents

    def _definition(self, name: str) -> SubagentDefinition:
        definition = self.definitions.get(name)
        if definition is None:
            known = ", ".join(sorted(self.definitions)) or "none"
            raise UnknownSubagentError(f"unknown subagent {name!r} (defined: {known})")
        return definition

    def _make_agent(self, definition: SubagentDefinition, parent_id: str) -> _Agent:
        allowed = self.root.allowed if definition.tools is None else self.root.allowed & frozenset(definition.tools)
        # Subagents never get the task tools: no unbounded recursion.
        allowed = allowed - {"task", "task_output"}
        return _Agent(
            agent_id=f"{definition.name}-{next(_ids)}",
            name=definition.name,
            system_prompt=definition.system_prompt,
            allowed=allowed,
            max_turns=definition.max_turns or self.root.max_turns,
            parent_id=parent_id,
            model=definition.model,
        )

    async def _spawn_background(
        self, name: str, prompt: str, parent_id: str, request_id: str, *, call_id: str | None
    ) -> SubagentHandle:
        if self._closing:
            raise SessionClosedError("the session is closed")
        definition = self._definition(name)
        agent = self._make_agent(definition, parent_id)
        prompt = await self._subagent_start(agent, prompt)
        await self.journal.open_agent(agent.agent_id, parent_agent_id=parent_id)
        try:
            # Once submitted, subagent_started is in the projection: every way out must end it.
            await self.journal.append(
                SubagentStarted(request_id=request_id, subagent_id=agent.agent_id, call_id=call_id),
                agent_id=parent_id,
            )
            if self._closing or self._nursery is None:
                raise SessionClosedError("the session closed while the subagent was starting")
            handle = SubagentHandle(self, agent, parent_id, request_id)
            handle._prompts.append(prompt)
            # No await from here: the task's own `finally` records its outcome from now on.
            self._nursery.start_soon(self._background_main, handle)
            self.subagents[agent.agent_id] = handle
        except BaseException as exc:
            # It never runs, and says so.
            why = "session closed" if self._closing or isinstance(exc, SessionClosedError) else "start interrupted"
            with self._cleanup_scope("recording a subagent that never started"):
                await self._record_subagent_end(
                    parent_id,
                    SubagentCancelled(request_id=request_id, subagent_id=agent.agent_id, reason=why),
                )
            raise
        return handle

    async def _record_subagent_end(self, parent_id: str, event: SubagentCompleted | SubagentCancelled) -> bool:
        """Record a subagent's one outcome on its parent's stream, if it is still running there."""
        journal = self.journal
        if journal.lost or journal.fenced or journal.closed:
            return False
        record = journal.projection(parent_id)._s.subagents.get(event.subagent_id)
        if record is None or record.state.value != "running":
            return False
        try:
            await journal.append(event, agent_id=parent_id)
        except InvalidTransitionError:
            raise
        except (JournalError, LeaseLostError) as exc:
            _log.warning("could not record the end of subagent %s: %s", event.subagent_id, exc)
            return False
        return True

    async def _background_main(self, handle: SubagentHandle) -> None:
        """The task of one background subagent: runs its prompts until killed or the session closes.

        Between prompts it is idle (completed, failed or cancelled work) and can be
        resumed. Its start was recorded on the parent's stream; its end is recorded
        once: completed at its first completion, cancelled when killed before that.
        """
        agent = handle.agent
        try:
            while not handle._killed:
                if not handle._prompts:
                    handle._wake = trio.Event()
                    await handle._wake.wait()
                    continue
                prompt = handle._prompts.pop(0)
                request = _Request(prompt, _discard, agent)
                handle.error = None
                with trio.CancelScope() as scope:
                    handle._work_scope = scope
                    handle._request = request

                    def cancel_reason(scope: trio.CancelScope = scope) -> RequestInterruptReason:
                        # Its own scope cancelled (cancel(), kill()) is the user's doing, unless closing.
                        if scope.cancel_called and not self._closing:
                            return RequestInterruptReason.USER_ABORT
                        return RequestInterruptReason.SESSION_CLOSE

                    request.cancel_reason = cancel_reason
                    handle.status = SubagentStatus.RUNNING
                    try:
                        await self._accept_on(agent, request)
                        await self._run_request(request)
                    except (LeaseLostError, SettlementError):
                        raise
                    except Exception as exc:  # a subagent crash is reported, never unhandled
                        handle.status = SubagentStatus.FAILED
                        handle.error = f"{type(exc).__name__}: {exc}"
                    finally:
                        handle._request = None
                handle._work_scope = None
                record = self.journal.projection(agent.agent_id).request(request.request_id)
                if scope.cancelled_caught and record is not None and record.state is RequestState.COMPLETED:
                    scope_cancelled = False  # the work finished (durably) before the cancel arrived
                else:
                    scope_cancelled = scope.cancelled_caught
                if scope_cancelled:
                    # Accepted but cancelled before it ran records its end here (a no-op otherwise).
                    with self._cleanup_scope("recording a cancelled subagent request"):
                        await record_request_end(
                            self.journal,
                            agent.agent_id,
                            request.request_id,
                            RequestInterrupted(request_id=request.request_id, reason=request.cancel_reason()),
                        )
                    # A resumed conversation must answer every tool call the cancelled work left open.
                    agent.history = answer_orphan_calls(agent.history)
                    handle.status = SubagentStatus.CANCELLED if handle._killed else SubagentStatus.IDLE
                    handle.result = None
                elif handle.status is not SubagentStatus.FAILED:
                    if request.error is not None:
                        handle.status = SubagentStatus.FAILED
                        handle.error = str(request.error)
                    else:
                        handle.status = SubagentStatus.COMPLETED
                        handle.result = request.text
                await self._report_subagent(handle)
                handle._finished.set()
        finally:
            if handle._killed and handle.status is not SubagentStatus.CANCELLED:
                handle.status = SubagentStatus.CANCELLED
            if not handle._recorded:
                handle._recorded = True
                with self._cleanup_scope("recording a subagent's end"):
                    await self._record_subagent_end(
                        handle.parent_id,
                        SubagentCancelled(
                            request_id=handle.parent_request_id,
                            subagent_id=handle.id,
                            reason="session closed" if self._closing else "killed",
                        ),
                    )
            handle._finished.set()
            handle._task_done.set()

    async def _report_subagent(self, handle: SubagentHandle) -> None:
        """Tell the parent (its next turn) and record the first final outcome on its stream."""
        summary = handle.result if handle.status is SubagentStatus.COMPLETED else (handle.error or handle.status.value)
        with self._cleanup_scope("recording a subagent's outcome"):
            if not handle._recorded and handle.status in (
                SubagentStatus.COMPLETED,
                SubagentStatus.FAILED,
                SubagentStatus.CANCELLED,
            ):
                handle._recorded = True
                if handle.status is SubagentStatus.COMPLETED:
                    event: Any = SubagentCompleted(request_id=handle.parent_request_id, subagent_id=handle.id)
                else:
                    event = SubagentCancelled(
                        request_id=handle.parent_request_id, subagent_id=handle.id, reason=handle.status.value
                    )
                await self._record_subagent_end(handle.parent_id, event)
            note = f"[background subagent {handle.id} ({handle.name}) {handle.status.value}]: {summary or ''}"
            self._inbox.setdefault(handle.parent_id, []).append(note)

    async def _subagent_start(self, agent: _Agent, prompt: str) -> str:
        """SubagentStart hooks: may replace the prompt; skip or abort refuses the subagent."""
        decision = await self._dispatch(
            HookEvent.SUBAGENT_START,
            agent.agent_id,
            subagent_id=agent.agent_id,
            subagent_type=agent.name,
            prompt=prompt,
        )
        decision.raise_for_abort()
        if decision.action is HookAction.SKIP:
            refused = HookAbortedError(
                f"a SubagentStart hook refused subagent {agent.name!r}: {decision.reason or 'skip'}",
                event=HookEvent.SUBAGENT_START,
                reason=decision.reason,
                callback=decision.decided_by,
                source=decision.source,
            )
            refused.code = "hook_skip"
            raise refused
        self._agents[agent.agent_id] = agent
        prompt = decision.prompt or prompt
        if decision.context_text:
            prompt = f"{prompt}\n\n{decision.context_text}"
        return prompt

    async def run_foreground_subagent(self, name: str, prompt: str, ctx: ToolContext, sink: EventSink) -> str:
        """Run a subagent inside the calling tool's execution; the caller's slot is given back meanwhile.

        The parent's abort reaches the child's work. Steering of the parent's request
        reaches it as a steering abort of the child's request: its ``cancel`` tools are
        cancelled, its ``block`` tools finish and settle, then the child's request ends
        interrupted (steering) and `RequestAbortedError` is raised.
        """
        definition = self._definition(name)
        agent = self._make_agent(definition, ctx.agent_id)
        # Its calls descend from the calling tool's: file locks that call holds cover them.
        agent.lineage = (*ctx.execution.lineage, ctx.execution.call_key)
        prompt = await self._subagent_start(agent, prompt)
        await self.journal.open_agent(agent.agent_id, parent_agent_id=ctx.agent_id)

        async def child_sink(event: SessionEvent) -> None:
            # The child's events join the parent's stream; its DoneEvent is not the parent's.
            if not isinstance(event, DoneEvent):
                await sink(event)

        request = _Request(prompt, child_sink, agent)
        request.cancel_reason = self._cancelled_by_parent

        def forward_abort(abort: Abort) -> None:
            request.abort.abort(abort.reason, abort.message)

        def forward_steering(abort: Abort) -> None:
            request.stop.abort(abort.reason, abort.message)
            request.steering.abort(abort.reason, abort.message)

        listeners: list[tuple[AbortHandle, int]] = []
        status = SubagentStatus.FAILED
        try:
            # Once submitted, subagent_started is in the projection: the `finally` ends it.
            await self.journal.append(
                SubagentStarted(request_id=ctx.request_id, subagent_id=agent.agent_id, call_id=ctx.tool_call_id),
                agent_id=ctx.agent_id,
            )
            listeners.append((ctx.abort, ctx.abort.add_listener(forward_abort)))
            parent = self._running.get((ctx.agent_id, ctx.request_id))
            if parent is not None:
                listeners.append((parent.steering, parent.steering.add_listener(forward_steering)))
            await sink(SubagentEvent(ctx.agent_id, agent.agent_id, name, SubagentStatus.RUNNING, background=False))
            async with ctx.slot_released():
                await self._accept_on(agent, request)
                await self._run_request(request)
            status = SubagentStatus.COMPLETED if request.error is None else SubagentStatus.FAILED
        finally:
            for handle, token in listeners:
                handle.remove_listener(token)
            with self._cleanup_scope("recording a foreground subagent's end"):
                # Accepted but cancelled before it ran records its end here (a no-op otherwise).
                await record_request_end(
                    self.journal,
                    agent.agent_id,
                    request.request_id,
                    RequestInterrupted(request_id=request.request_id, reason=request.cancel_reason()),
                )
                if status is SubagentStatus.COMPLETED:
                    event: Any = SubagentCompleted(request_id=ctx.request_id, subagent_id=agent.agent_id)
                else:
                    event = SubagentCancelled(
                        request_id=ctx.request_id, subagent_id=agent.agent_id, reason=str(request.error or "cancelled")
                    )
                await self._record_subagent_end(ctx.agent_id, event)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await sink(SubagentEvent(ctx.agent_id, agent.agent_id, name, status, False, request.text[:200]))
            self._agents.pop(agent.agent_id, None)  # it will make no more calls
        if request.error is not None:
            raise request.error
        return request.text

    def _cancelled_by_parent(self) -> RequestInterruptReason:
        # A foreground child is cancelled with its parent's tool call: the parent's abort or deadline.
        return RequestInterruptReason.SESSION_CLOSE if self._closing else RequestInterruptReason.USER_ABORT

    def _cleanup_scope(self, layer: str = "recording a session outcome") -> bounded_shield:
        """A shield for recording what was already decided, bounded (``cleanup_grace``) so a dead
        store cannot hang us; an overrun is logged."""
        return bounded_shield(self.cleanup_grace, layer)

    # -- effects

    async def _apply_effect(self, agent: _Agent, effect: Effect, call_id: str) -> None:
        """Apply what a settled tool asked of the session.

        ``new_messages`` (a string or a list of strings) reach the agent's model at
        its next turn; ``permission_updates`` (`PermissionUpdate` s, accepted only from
        the tool itself: the pipeline drops them from middleware) change the session's
        permission rules, journalled first. Other kinds are logged and ignored.
        """
        if effect.kind == "new_messages":
            payload = effect.payload
            messages = [payload] if isinstance(payload, str) else list(payload or [])
            self._inbox.setdefault(agent.agent_id, []).extend(str(message) for message in messages)
        elif effect.kind == "permission_updates" and self.permissions is not None:
            payload = effect.payload
            updates = [payload] if isinstance(payload, PermissionUpdate) else list(payload or [])
            try:
                await self.permissions.accept_updates(updates, source="tool", call_id=call_id)
            except ConfigError as exc:
                _log.warning("ignored a permission_updates effect: %s", exc)
        else:
            _log.warning("ignored an effect of unknown kind %r from agent %s", effect.kind, agent.agent_id)

    async def _journal_permission_updates(
        self, updates: Sequence[PermissionUpdate], *, source: str, call_id: str | None
    ) -> None:
        """Record accepted rule updates on the root stream (replayed into the engine on reopen)."""
        origin = self._call_origins.get(call_id) if call_id is not None else None
        current = self._current
        request_id = origin if origin is not None else (current.request_id if current is not None else "session")
        kind = source if source in PERMISSION_UPDATE_SOURCES else "permission_engine"
        await self.journal.append(
            *(
                PermissionUpdated(request_id=request_id, source=kind, update=update_to_json(update), call_id=call_id)
                for update in updates
            )
        )

    def _replay_permission_updates(self) -> None:
        """Apply the rule updates the journal holds (a reopened session keeps what was granted)."""
        if self.permissions is None:
            return
        stored = self.journal.projection().permission_updates
        if stored:
            self.permissions.replay_updates([update_from_json(event.update) for event in stored])

    # -- hooks (wired by open_session)

    async def _dispatch(
        self, event: HookEvent, agent_id: str, *, abort: AbortHandle | None = None, **fields: Any
    ) -> HookDecision:
        """Dispatch one session hook event (session hooks first, then plugin hooks)."""
        runner: HookRunner = self._hooks
        return await runner.dispatch(
            event, HookInput(event=event, session_id=self.session_id, agent_id=agent_id, **fields), abort=abort
        )

    # -- requests

    async def _accept_on(self, agent: _Agent, request: _Request) -> None:
        await self.journal.append(
            RequestAccepted(
                request_id=request.request_id, command_id=request.request_id, input={"prompt": request.prompt}
            ),
            command_id=request.request_id,
            agent_id=agent.agent_id,
        )

    async def _worker(self) -> None:
        try:
            await self._serve()
        finally:
            self._worker_done.set()

    async def _serve(self) -> None:
        async for request in self._queue_recv:
            if request.done.is_set() or request.abort.aborted:
                continue  # aborted while it was queued: `_abort_request` records it
            if self._closing:
                await self._reject_queued(request)
                continue
            async with self._request_lock:
                if request.done.is_set() or request.abort.aborted:
                    continue  # aborted while it waited for the request slot: already recorded
                self._current = request
                try:
                    await self._run_request(request)
                finally:
                    self._current = None

    async def _run_request(self, request: _Request) -> None:
        """One request on one agent's stream: started -> turns -> completed | failed | interrupted."""
        agent = request.agent
        journal = self.journal
        key = (agent.agent_id, request.request_id)
        self._running[key] = request
        completed = False
        try:
            await journal.append(RequestStarted(request_id=request.request_id), agent_id=agent.agent_id)
            request.started = True
            prompt = request.prompt
            extra: str | None = None
            if agent.parent_id is None:
                decision = await self._dispatch(
                    HookEvent.USER_PROMPT_SUBMIT, agent.agent_id, prompt=prompt, abort=request.abort
                )
                decision.raise_for_abort()
                if decision.action is HookAction.SKIP:
                    # The prompt never reaches the model; the request ends without a model call.
                    request.text = ""
                    request.stop_reason = "skipped"
                    await self._drain_holds(request)
                    await journal.append(
                        RequestCompleted(request_id=request.request_id, output={"skipped": decision.reason or ""}),
                        agent_id=agent.agent_id,
                    )
                    completed = True
                    await request.sink(DoneEvent(request.request_id, "", "skipped", 0))
                    return
                prompt = decision.prompt or prompt
                extra = decision.context_text
            agent.history.append(UserMessage(prompt))
            if extra:
                agent.history.append(UserMessage(extra))
            if agent.specs is None:  # the offered tools never change during a session
                tools = self.pipeline.tools
                agent.specs = [_tool_spec(tools[name]) for name in sorted(agent.allowed) if name in tools]
            outcome = await run_agent_loop(
                run_spec(self, agent, request), run_ports(self, agent, request), SessionHooks(self, agent, request)
            )
            request.text = outcome.text or request.text
            if outcome.aborted:
                await self._finish_interrupted(request)
            else:
                request.stop_reason = outcome.stop_reason.value
                await self._drain_holds(request)
                await journal.append(
                    RequestCompleted(request_id=request.request_id, output={"text": request.text}),
                    agent_id=agent.agent_id,
                )
                completed = True
                await request.sink(DoneEvent(request.request_id, request.text, request.stop_reason, request.turns))
        except BaseException as exc:
            if not await self._request_raised(request, exc):
                raise
        finally:
            self._running.pop(key, None)
            # No message that joined may be lost: whatever is still pending reaches the next turn.
            request.accepting = False
            if request.pending:
                self._inbox.setdefault(agent.agent_id, []).extend(request.pending)
                request.pending.clear()
            if not completed:
                # The next request must not send the model a tool call without its answer.
                agent.history = answer_orphan_calls(agent.history)
            request.finish()

    async def _request_raised(self, request: _Request, exc: BaseException) -> bool:
        """Record how a request that raised ended; return whether the exception is handled
        (recorded as the request's error) or must go on.

        Cancellation (a group holding ``Cancelled`` and no typed error included) is
        recorded interrupted and goes on unchanged; a typed error wins over a
        ``Cancelled`` beside it and fails the request; lease loss goes on at once.
        """
        journal = self.journal
        agent_id = request.agent.agent_id
        typed = typed_error(exc)
        if isinstance(typed, LeaseLostError):
            if typed is exc:
                return False
            raise typed from None
        if typed is None and is_cancellation(exc):
            # Cancelled from outside (the session block, a subagent's work scope, a parent's tool call).
            with self._cleanup_scope("recording a cancelled request"):
                await self._drain_holds(request)
                await record_request_end(
                    journal,
                    agent_id,
                    request.request_id,
                    RequestInterrupted(request_id=request.request_id, reason=request.cancel_reason()),
                )
            return False
        if typed is None and not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit...: nothing more may run
        error: BaseException = typed if typed is not None else exc
        request.error = error
        request.stop_reason = "aborted" if isinstance(error, RequestAbortedError) else "error"
        with self._cleanup_scope("recording a failed request"):
            await self._drain_holds(request)
            await record_request_end(
                journal,
                agent_id,
                request.request_id,
                RequestFailed(request_id=request.request_id, error=ErrorInfo(message=str(error)[:2000])),
                turn_reason=TurnAbortReason.ERROR,
            )
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await request.sink(
                    DoneEvent(request.request_id, request.text, request.stop_reason, request.turns, str(error))
                )
        return True

    @staticmethod
    async def _drain_holds(request: _Request) -> None:
        """Let background starts under this request finish their writes before it ends."""
        request.finishing = True
        if request.holds:
            await request.released.wait()

    async def _finish_interrupted(self, request: _Request) -> None:
        """An SDK abort (or a steering stop) ended the request: record it; keep what was committed."""
        abort = request.abort.reason or request.stop.reason
        reason = abort.reason if abort is not None else AbortReason.USER_ABORT
        agent_id = request.agent.agent_id
        request.stop_reason = "aborted"
        detail = f": {abort.message}" if abort is not None and abort.message else ""
        request.error = RequestAbortedError(
            f"the request was aborted ({reason.value}){detail}",
            reason=reason.value,
            results=committed_results(self.journal, agent_id, request.call_ids),
        )
        with self._cleanup_scope("recording an interrupted request"):
            await self._drain_holds(request)
            await record_request_end(
                self.journal,
                agent_id,
                request.request_id,
                RequestInterrupted(request_id=request.request_id, reason=_interrupt_reason(reason)),
            )
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await request.sink(DoneEvent(request.request_id, request.text, "aborted", request.turns))

    # -- opening and closing

    async def _start(self, tools: Mapping[str, Tool[Any]], history: Sequence[Message] | None) -> None:
        """Begin this life of the session: a new one, a reopened one, or one recovered after a crash."""
        projection = self.journal.projection()
        state = projection.session_state
        if state is SessionState.ENDED:
            raise SessionClosedError(
                f"session {self.session_id!r} was ended for good (session.end()); it can be read "
                "(journal show, read_conversation) but not continued: open a new session id"
            )
        if history is not None:
            if state is not SessionState.OPEN or projection._s.requests or projection._s.seeded:
                raise ConfigError(
                    f"history= seeds a new session, but session {self.session_id!r} already has a conversation"
                )
            await self.journal.append(
                ConversationSeeded(session_id=self.session_id, conversation=encode_conversation(history))
            )
        self.life = projection.life
        if state is SessionState.CLOSED:
            # A new life on the same streams: the conversation is rebuilt from the journal below.
            self.life += 1
            await self.journal.append(SessionReopened(session_id=self.session_id, life=self.life))
        await self._recover(tools)
        self._replay_permission_updates()
        self._started = True
        decision = await self._dispatch(HookEvent.SESSION_START, self.root.agent_id)
        decision.raise_for_abort()
        if decision.context_text:
            self._context.append(decision.context_text)

    async def _recover(self, tools: Mapping[str, Tool[Any]]) -> None:
        """Apply the journal's recovery plan on every stream and re-run what it allows, live."""
        journal = self.journal
        for agent_id in list(journal.agents):
            projection = journal.projection(agent_id)
            if projection.session_state is not SessionState.OPEN:
                continue
            plan = journal.recovery_plan(agent_id, tools=tools)
            if plan.is_empty:
                continue
            # Told from the journal, not from the last process's memory: a call an earlier
            # recovery settled outcome_unknown, in a request that recovery never got to close
            # (the process died again), is still news to the model and the user.
            earlier = [
                call.call_id
                for call in projection._s.tools.values()
                if call.state is ToolState.OUTCOME_UNKNOWN and request_is_open(projection, call.request_id)
            ]
            report = await journal.recover(agent_id, tools=tools)
            if earlier:
                merged = tuple(dict.fromkeys([*earlier, *report.outcome_unknown]))
                report = attrs.evolve(report, outcome_unknown=merged)
            if agent_id == self.root.agent_id:
                self.recovery = report
            # Subagents that ran before the restart (not those a re-executed call may start below).
            stale = [
                record
                for record in journal.projection(agent_id)._s.subagents.values()
                if record.state.value == "running"
            ]
            for scheduled in report.to_execute:
                origin = CallOrigin(self.session_id, agent_id, scheduled.request_id, scheduled.turn_id)
                record = await self.pipeline.execute(
                    ToolCall(scheduled.call_id, scheduled.tool_name, dict(scheduled.model_input)),
                    origin,
                    idempotency_key=scheduled.idempotency_key,
                )
                self.recovery_notes.append(
                    f"re-ran {scheduled.tool_name} call {scheduled.call_id}: {'ok' if record.result.ok else 'error'}"
                )
            for call_id in report.outcome_unknown:
                call = journal.call(call_id, agent_id)
                name = call.scheduled.tool_name if call is not None else "?"
                note = unknown_outcome_result(call_id, name).output
                self.recovery_notes.append(str(note))
            # Close what the crash left open, then rebuild the conversation from the journal.
            projection = journal.projection(agent_id)  # appends may have replaced the object
            for turn in list(projection._s.turns.values()):
                if turn.state is TurnState.OPEN:
                    await journal.append(
                        TurnAborted(
                            request_id=turn.request_id, turn_id=turn.turn_id, reason=TurnAbortReason.PROCESS_RESTART
                        ),
                        agent_id=agent_id,
                    )
            for request in list(projection._s.requests.values()):
                if request.state in (RequestState.ACCEPTED, RequestState.STARTED):
                    await journal.append(
                        RequestInterrupted(
                            request_id=request.request_id, reason=RequestInterruptReason.PROCESS_RESTART
                        ),
                        agent_id=agent_id,
                    )
            for subagent in stale:
                if subagent.state.value == "running":
                    await journal.append(
                        SubagentCancelled(
                            request_id=subagent.request_id, subagent_id=subagent.subagent_id, reason="process_restart"
                        ),
                        agent_id=agent_id,
                    )
        events = [envelope.event for envelope in await journal.store.read(journal.stream_id())]
        self.root.history = fold_conversation(events)
        # What the model is told goes through the inbox, so it is recorded with its next model call.
        notes = self._inbox.setdefault(self.root.agent_id, [])
        if self.recovery_notes:
            notes.append("[session recovered after a restart]\n" + "\n".join(self.recovery_notes))
        notes.extend(await self._undelivered_subagent_notes(events))
        if not notes:
            del self._inbox[self.root.agent_id]

    async def _undelivered_subagent_notes(self, events: Sequence[Any]) -> list[str]:
        """Background subagents whose outcome was recorded after the last model call of the root
        (so its note never reached the model, e.g. killed by the previous close)."""
        last_call = max((i for i, e in enumerate(events) if isinstance(e, ModelAttemptCompleted)), default=-1)
        notes: list[str] = []
        for event in events[last_call + 1 :]:
            if isinstance(event, SubagentCompleted):
                text = await self._subagent_answer(event.subagent_id)
                notes.append(f"[background subagent {event.subagent_id} completed]: {text}")
            elif isinstance(event, SubagentCancelled):
                notes.append(f"[background subagent {event.subagent_id} cancelled]: {event.reason}")
        return notes

    async def _subagent_answer(self, subagent_id: str) -> str:
        try:
            events = await self.journal.store.read(self.journal.stream_id(subagent_id))
        except TrioAgentError:
            return ""
        answers = [e.event.output for e in events if isinstance(e.event, RequestCompleted) and e.event.output]
        return str(answers[-1].get("text", "")) if answers else ""

    async def _rebuild_history(self, agent_id: str) -> list[Message]:
        """The conversation as the journal tells it (`fold_conversation`)."""
        events = await self.journal.store.read(self.journal.stream_id(agent_id))
        return fold_conversation(envelope.event for envelope in events)

    async def _reject_queued(self, queued: _Request) -> None:
        """A request still queued when the session closes: recorded interrupted, its caller told."""
        queued.abort.abort(AbortReason.SESSION_CLOSE, "the session closed before it started")
        with self._cleanup_scope("recording a request the close rejected"):
            await record_request_end(
                self.journal,
                queued.agent.agent_id,
                queued.request_id,
                RequestInterrupted(request_id=queued.request_id, reason=RequestInterruptReason.SESSION_CLOSE),
            )
            queued.error = SessionClosedError("the session closed before the request started")
            queued.stop_reason = "aborted"
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await queued.sink(DoneEvent(queued.request_id, "", "aborted", 0, str(queued.error)))
            queued.finish()

    async def _close(self, reason: SessionCloseReason) -> None:
        """End the session's life: every request, call and subagent closed, then one
        ``session_closed`` per stream that has nothing open. Bounded by ``close_timeout``."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        self._closing = True
        self._queue_send.close()
        refused: InvalidTransitionError | None = None
        with bounded_shield(self.close_timeout, "closing the session"):
            current = self._current
            if current is not None and not current.done.is_set():
                await self._abort_request(current, AbortReason.SESSION_CLOSE, "the session is closing")
            # The worker rejects what is still queued (the channel is closed) and then ends.
            await self._worker_done.wait()
            # Requests accepted while the close began record themselves interrupted first.
            while self._accepting:
                self._accepted = trio.Event()
                await self._accepted.wait()
            # Background work is aborted with the close's reason (its calls settle with it), then stopped.
            for handle in list(self.subagents.values()):
                work = handle._request
                if work is not None:
                    work.abort.abort(AbortReason.SESSION_CLOSE, "the session is closing")
            for handle in list(self.subagents.values()):
                work = handle._request
                if work is not None:
                    await work.done.wait()
            for handle in list(self.subagents.values()):
                handle.kill()
            for handle in list(self.subagents.values()):
                await handle._task_done.wait()
            if self._started:  # SessionEnd pairs with a SessionStart that ran
                with contextlib.suppress(TrioAgentError):
                    await self._dispatch(HookEvent.SESSION_END, self.root.agent_id, reason=reason.value)
            journal = self.journal
            if not journal.lost and not journal.fenced:
                for agent_id in journal.agents:
                    projection = journal.projection(agent_id)
                    if projection.session_state is not SessionState.OPEN:
                        continue
                    still_open = open_items(projection)
                    if still_open:
                        # Never written over open items: recovery on reopen decides them.
                        _log.warning(
                            "agent %s has open items at close (%s); they are left to recovery on reopen",
                            agent_id,
                            ", ".join(still_open[:5]),
                        )
                        continue
                    try:
                        await journal.append(
                            SessionClosed(session_id=self.session_id, reason=reason, final=self._final),
                            agent_id=agent_id,
                        )
                    except InvalidTransitionError as exc:
                        refused = refused or exc
                    except (JournalError, LeaseLostError) as exc:
                        _log.warning("could not record the close of agent %s: %s", agent_id, exc)
                        break
        if refused is not None:
            raise refused


def _raise_for(request: _Request) -> None:
    """Raise a finished request's error as a trio_agent error."""
    error = request.error
    if error is not None:
        if isinstance(error, TrioAgentError):
            raise error
        raise RequestAbortedError(f"the request failed: {type(error).__name__}: {error}", reason="error") from error


class _Forward:
    """An event sink into a bounded channel (backpressure); drops events once its reader left.

    Once the request is aborted it never blocks: the reader may be the very task
    waiting in ``abort()``, so a full channel drops further events, and the end
    of the stream is signalled by closing the channel (the reader then learns the
    outcome from the request).
    """

    def __init__(self, send: trio.MemorySendChannel[SessionEvent], abort: AbortHandle | None = None) -> None:
        self.send = send
        self.abort = abort
        self.closed = False

    async def __call__(self, event: SessionEvent) -> None:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return
        try:
            if self.abort is not None and self.abort.aborted:
                with contextlib.suppress(trio.WouldBlock):
                    self.send.send_nowait(event)
                await trio.lowlevel.checkpoint()
            else:
                await self.send.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = True
        if isinstance(event, DoneEvent):
            self.close_now()
            await trio.lowlevel.checkpoint()

    def close_now(self) -> None:
        """End the stream (the reader sees the end and learns the outcome from the request)."""
        self.closed = True
        self.send.close()


def _tee(first: EventSink, second: EventSink) -> EventSink:
    async def both(event: SessionEvent) -> None:
        await first(event)
        await second(event)

    return both


class _EventStream:
    """The iterator of `Session.stream`: session events until the request's `DoneEvent`."""

    def __init__(self, recv: trio.MemoryReceiveChannel[SessionEvent], request: _Request, *, joined: bool) -> None:
        self._recv = recv
        self.request = request
        self.joined = joined
        self.text = ""
        self.done: DoneEvent | None = None

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> SessionEvent:
        if self.done is not None:
            raise StopAsyncIteration
        try:
            event = await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            await self.request.done.wait()
            self._raise_if_failed()
            raise StopAsyncIteration from None
        if isinstance(event, DoneEvent):
            self.done = event
            self.text = event.text
            if event.stop_reason in ("error", "aborted"):
                await self.request.done.wait()
                self._raise_if_failed()
        return event

    def _raise_if_failed(self) -> None:
        _raise_for(self.request)


# ---------------------------------------------------------------- built-in task tools


def _task_tools(get_session: Callable[[], Session]) -> list[Tool[Any]]:
    @define_tool(
        name="task",
        description=(
            "Run a named subagent on a task. Foreground (default): waits and returns its answer. "
            "With background=true: starts it and returns its id; its result arrives at a later turn "
            "(or check with task_output)."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "subagent": {"type": "string", "description": "the subagent's name"},
                "prompt": {"type": "string", "minLength": 1},
                "background": {"type": "boolean", "default": False},
            },
            "required": ["subagent", "prompt"],
            "additionalProperties": False,
        },
        side_effect=SideEffect.NON_IDEMPOTENT,
        kind=ToolKind.READONLY,
        # Steering reaches a foreground subagent itself (its cancel tools stop, its block
        # tools finish, then it ends), so the call is not cancelled from outside by it.
        interrupt="block",
    )
    async def task(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        session = get_session()
        name = input["subagent"]
        if name not in session.definitions:
            known = ", ".join(sorted(session.definitions)) or "none"
            return ToolResult.failure(
                ToolErrorType.VALIDATION, f"unknown subagent {name!r} (defined: {known})", code="unknown_subagent"
            )
        try:
            if input.get("background"):
                handle = await session._spawn_background(
                    name, input["prompt"], ctx.agent_id, ctx.request_id, call_id=ctx.tool_call_id
                )
                return ToolResult.success(
                    f"started background subagent {handle.id}; its result arrives at a later turn",
                    data={"task_id": handle.id, "status": "running"},
                )
            # The subagent's events go to the stream of the request that called the tool.
            parent = session._running.get((ctx.agent_id, ctx.request_id))
            sink: EventSink = _discard if parent is None else (lambda event: parent.sink(event))
            text = await session.run_foreground_subagent(name, input["prompt"], ctx, sink)
        except RequestAbortedError as exc:
            # Steered or aborted: the call settles cancelled with the subagent's reason.
            return ToolResult.failure(ToolErrorType.INTERRUPTED, f"subagent {name!r}: {exc}", code=exc.reason)
        except HookError as exc:
            code = (
                exc.code
                if exc.code == "hook_skip"
                else ("hook_abort" if isinstance(exc, HookAbortedError) else "hook_error")
            )
            return ToolResult.failure(ToolErrorType.EXECUTION, str(exc), code=code)
        return ToolResult.success(text, data={"subagent": name})

    @define_tool(
        name="task_output",
        description="Check (or wait for, with block=true) a background subagent started by the task tool.",
        input_schema={
            "type": "object",
            "properties": {
                "task_id": {"type": "string"},
                "block": {"type": "boolean", "default": True},
                "timeout": {"type": "number", "minimum": 0, "maximum": 600, "default": 30},
            },
            "required": ["task_id"],
            "additionalProperties": False,
        },
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
        interrupt="cancel",
    )
    async def task_output(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        session = get_session()
        handle = session.subagents.get(input["task_id"])
        if handle is None:
            return ToolResult.failure(ToolErrorType.VALIDATION, f"no task {input['task_id']!r}", code="unknown_task")
        if input.get("block", True) and handle.status is SubagentStatus.RUNNING:
            async with ctx.slot_released():
                with trio.move_on_after(float(input.get("timeout", 30))):
                    await handle.wait()
        return ToolResult.success(
            f"task {handle.id}: {handle.status.value}"
            + (f"\n{handle.result}" if handle.result else "")
            + (f"\nerror: {handle.error}" if handle.error else ""),
            data={"task_id": handle.id, "status": handle.status.value},
        )

    return [task, task_output]


# ---------------------------------------------------------------- open_session


def _resolve_store(journal: JournalStore | str | os.PathLike[str] | None) -> tuple[JournalStore | None, str | None]:
    if journal is None:
        return MemoryStore(), None
    if isinstance(journal, (str, os.PathLike)):
        return None, os.fspath(journal)
    return journal, None


@asynccontextmanager
async def open_session(
    *,
    provider: Provider | str,
    model: str | None = None,
    system_prompt: str = "",
    tools: Sequence[Tool[Any]] = (),
    plugins: Sequence[Plugin] = (),
    middleware: MiddlewareConfig | None = None,
    hooks: Mapping[HookEvent, Sequence[HookCallback]] | None = None,
    allowed_tools: Sequence[str] | None = None,
    disallowed_tools: Sequence[str] | None = None,
    permissions: PermissionRules | Mapping[str, Sequence[str]] | None = None,
    permission_mode: PermissionMode | str = PermissionMode.DEFAULT,
    permission_handler: PermissionHandler | None = None,
    journal: JournalStore | str | os.PathLike[str] | None = None,
    session_id: str | None = None,
    max_turns: int = 20,
    subagents: Sequence[SubagentDefinition] = (),
    workspace_roots: Sequence[str | os.PathLike[str]] | None = None,
    hook_deadlines: Mapping[HookEvent, float] | None = None,
    lease_ttl: float = 30.0,
    takeover_timeout: float = 0.0,
    model_request_timeout: float = 600.0,
    tool_timeout: float = 600.0,
    cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    close_timeout: float = 30.0,
    history: Sequence[Message] | None = None,
) -> AsyncIterator[Session]:
    """Open a session: ``async with open_session(provider=..., model=...) as session`` (the spec's ``createSession``).

    ``provider`` is a `Provider` (the caller owns it) or a provider name
    (``"openai"``, ``"anthropic"``: the session creates and closes it; ``model`` is
    then required). ``journal`` is a `JournalStore`, a SQLite file path (opened
    and closed by the session) or ``None`` (an in-memory store: same rules, no
    durability). Reopening an existing ``session_id`` on a durable journal
    continues it: a cleanly closed session starts a new life with its
    conversation rebuilt from the journal, a crashed one is recovered first (see
    ``Session.recovery``); a session ended for good (``session.end()``) is refused.
    ``history`` seeds a new session with earlier messages (validated; recorded in
    the journal, so a rebuilt conversation has them). Leaving the block cancels what still
    runs, records it, and writes one ``session_closed`` per agent stream.

    ``cleanup_grace`` bounds every shielded clean-up after a cancellation
    (recording outcomes, closing streams and stores; an overrun is logged as a
    WARNING on the ``trio_agent`` logger); ``close_timeout`` bounds leaving the
    block as a whole.

    Raises `ConfigError` (bad options, duplicate tools or plugins, bad rules)
    before anything starts; errors at the boundary are trio_agent errors, never
    exception groups, and a cancellation from outside is one ``trio.Cancelled``.
    """
    from ._wiring import build_session_parts

    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise ConfigError(f"max_turns must be a positive int, not {max_turns!r}")
    cleanup_grace = validate_cleanup_grace(cleanup_grace)
    close_timeout = validate_timeout(close_timeout, name="close_timeout")
    seed = None if history is None else validate_history(history)
    if session_id is not None:
        validate_id(session_id, name="session_id")
    if isinstance(subagents, (str, bytes)) or not isinstance(subagents, Sequence):
        raise ConfigError(f"subagents must be a list of SubagentDefinition, not {subagents!r}")
    definitions: dict[str, SubagentDefinition] = {}
    for definition in subagents:
        if not isinstance(definition, SubagentDefinition):
            raise ConfigError(f"subagents must be SubagentDefinition objects, not {definition!r}")
        if definition.name in definitions:
            raise ConfigError(f"subagent {definition.name!r} is defined twice")
        definitions[definition.name] = definition
    holder: list[Session] = []
    builtins = _task_tools(lambda: holder[0]) if definitions else []

    def agent_filter(agent_id: str) -> ToolFilter:
        # Every agent's calls are checked against its own allowlist (subagents included).
        session = holder[0] if holder else None
        agent = None if session is None else session._agents.get(agent_id)
        if agent is None:
            return ToolFilter(allowed=None)
        return ToolFilter(allowed=sorted(agent.allowed))

    parts = build_session_parts(
        builtin_tools=builtins,
        tools=tools,
        plugins=plugins,
        middleware=middleware,
        hooks=hooks,
        allowed_tools=allowed_tools,
        disallowed_tools=disallowed_tools,
        permissions=permissions,
        permission_mode=permission_mode,
        permission_handler=permission_handler,
        workspace_roots=workspace_roots,
        hook_deadlines=hook_deadlines,
        agent_filter=agent_filter,
    )
    store, path = _resolve_store(journal)
    try:
        async with AsyncExitStack() as stack:
            if isinstance(provider, str):
                if model is None:
                    raise ConfigError("model is required when provider is given by name")
                from .._models._providers import create_provider

                created: Any = create_provider(provider, model)
                if hasattr(created, "__aenter__"):
                    await stack.enter_async_context(created)
                provider_obj: Provider = created
            else:
                provider_obj = provider.with_model(model) if model and model != provider.model else provider
            if path is not None:
                # One store per file and Trio run, shared by every session that names it.
                store = await stack.enter_async_context(shared_sqlite_store(path, cleanup_grace=cleanup_grace))
            assert store is not None
            durable = await stack.enter_async_context(
                open_journal(
                    store,
                    session_id=session_id,
                    lease_ttl=lease_ttl,
                    takeover_timeout=takeover_timeout,
                    commit_grace=cleanup_grace,
                )
            )
            service = ModelService(
                provider_obj,
                parts.model_middleware,
                request_timeout=model_request_timeout,
                cleanup_grace=cleanup_grace,
            )
            pipeline = ToolPipeline(
                parts.tools.values(),
                middleware=parts.tool_middleware,
                lifecycle=durable,
                stages=parts.stages,
                timeout=tool_timeout,
                workspace=parts.workspace,
                unwind_grace=max(2.0, (hook_deadlines or {}).get(HookEvent.POST_TOOL_USE, 0.0) + 1.0),
                settle_grace=cleanup_grace,
            )
            root = _Agent(
                agent_id=durable.root_agent_id,
                name="root",
                system_prompt=system_prompt,
                allowed=frozenset(parts.allowed),
                max_turns=max_turns,
            )
            session = Session(
                journal=durable,
                service=service,
                pipeline=pipeline,
                root=root,
                definitions=definitions,
                hooks=parts.runner,
                cleanup_grace=cleanup_grace,
                close_timeout=close_timeout,
            )
            session.permissions = parts.permissions
            if parts.permissions is not None:
                # Write-ahead: a rule update is durable before the engine applies it.
                parts.permissions.on_updates_applied = session._journal_permission_updates
            session._agents[root.agent_id] = root
            holder.append(session)
            parts.bind(session)
            close_reason = SessionCloseReason.COMPLETED
            async with trio.open_nursery() as nursery:
                session._nursery = nursery
                nursery.start_soon(session._worker)
                try:
                    await session._start(parts.tools, seed)
                    yield session
                except BaseException:
                    close_reason = SessionCloseReason.ERROR
                    raise
                finally:
                    await session._close(close_reason)
                    nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # A public boundary never raises a group. The body's own error (even a user's exception
        # group) comes out unchanged; a failure of the session's tasks comes out as one typed
        # error; a cancellation from outside comes out as one `trio.Cancelled`.
        if len(group.exceptions) == 1:
            only = group.exceptions[0]
            if not isinstance(only, BaseExceptionGroup) or (
                typed_error(only) is None and not contains_cancelled(only)
            ):
                raise only  # noqa: B904 - `from` would overwrite the error's own cause
        single = unwrap_for_boundary(group)
        if single is group:
            raise
        raise single from None
