"""Requests: what one message to a session becomes, its queue, and how each one ends.

Rules
=====

* One request of the root agent runs at a time; the worker takes them from a
  bounded queue in order. ``request_accepted`` is durable before ``send`` returns
  or a stream starts.
* While a request runs, a message with priority ``next`` joins it at its next
  turn, ``now`` joins it and steers (aborts its ``cancel`` tools), ``later`` queues
  a new request; no priority is refused (`SessionBusyError`).
* Every accepted request ends exactly once (completed, failed or interrupted),
  recorded through `record_request_end`; a request aborted while still queued is
  recorded at once, never run. A request always wakes its waiters when it ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math
import os
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn, Protocol

import attrs
import trio

from .._abort import AbortHandle, AbortReason
from .._cleanup import bounded_shield
from .._errors import (
    ConfigError,
    HookInterruptedError,
    LeaseLostError,
    RequestAbortedError,
    SessionBusyError,
    SessionClosedError,
    TrioAgentError,
    error_code,
)
from .._groups import is_cancellation, leaves, raise_for_boundary, typed_error, unwrap_for_boundary
from .._journal._durable import DurableJournal
from .._journal._events import (
    ErrorInfo,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    TurnAbortReason,
    request_accepted,
)
from .._journal._projection import RequestState
from .._lifecycle._interrupts import PausedRun
from .._loop._events import RunEvent
from .._loop._interrupts import Resume
from .._loop._ports import RunPorts
from .._loop._rules import LoopStrategy, StopReason, max_iterations
from .._models._history import CallIdIndex
from .._models._messages import Message, ToolSpec
from .._permissions._rules import ToolFilter
from .._util import describe
from ._endings import committed_results, record_request_end
from ._messages import DoneEvent, ToolUseEvent
from ._stream import EventForward, EventSink, discard

__all__ = ["PRIORITIES", "Priority", "RequestQueue", "interrupt_reason"]


class Priority(enum.StrEnum):
    """What a message sent while a request runs does (a plain ``"next"`` works as well)."""

    NEXT = "next"  # joins the running request: the model reads it at its next call
    NOW = "now"  # joins and steers: the running tool phase stops, then the model reads it
    LATER = "later"  # queues a request of its own, run after the current one


PRIORITIES = tuple(Priority)

RunParts = tuple[Callable[[], str], tuple[ToolSpec, ...], Collection[str], Mapping[str, Any]]
"""The instructions, offered tools, allowlist and model metadata of every run of one agent."""

_STRATEGIES: dict[int, LoopStrategy] = {}  # max_turns -> its `max_iterations` (stateless: shared)


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
    _history: list[Message] | None = attrs.Factory(list)
    run_parts: RunParts | None = None  # what each of its runs hands the loop alike (`SessionHost._spec`)
    lineage: tuple[str, ...] = ()  # the calls it runs under (a foreground subagent's tool calls)
    _strategy: LoopStrategy | None = None
    call_index: CallIdIndex = attrs.Factory(CallIdIndex)
    _deferred: Callable[[], list[Message]] | None = None
    _tool_filter: ToolFilter | None = None

    def tool_filter(self) -> ToolFilter:
        """``allowed`` as the permission engine's filter of this agent's calls (made once)."""
        if self._tool_filter is None:
            self._tool_filter = ToolFilter(allowed=self.allowed)
        return self._tool_filter

    @property
    def history(self) -> list[Message]:
        """The conversation (a reopened agent's is read from the journal when first needed)."""
        if self._history is None:
            assert self._deferred is not None
            self._history = self._deferred()
            self._deferred = None
        return self._history

    @history.setter
    def history(self, messages: list[Message]) -> None:
        self._history, self._deferred = messages, None

    def defer_history(self, load: Callable[[], list[Message]]) -> None:
        """Take the history from ``load`` when it is first needed (a reopen reads no history)."""
        self._history, self._deferred = None, load

    def strategy(self) -> LoopStrategy:
        """``max_turns`` as the loop's strategy (made once per limit, for every agent of the process:
        it holds nothing but the limit, and thousands of idle sessions need not keep one each)."""
        strategy = self._strategy
        if strategy is None:
            strategy = _STRATEGIES.get(self.max_turns)
            if strategy is None:
                strategy = max_iterations(self.max_turns)
                if len(_STRATEGIES) < 64:  # a few limits are in use; a process that makes more pays per agent
                    _STRATEGIES[self.max_turns] = strategy
            self._strategy = strategy
        return strategy


_NONE_PENDING: list[str] = []
"""`_Request.pending` until a message joins: shared, never added to (see there)."""


def _session_close() -> RequestInterruptReason:
    return RequestInterruptReason.SESSION_CLOSE


class _Request:
    __slots__ = (
        "_done",
        "_stop",
        "abort",
        "acceptance",
        "accepted_before",
        "accepting",
        "agent",
        "begun",
        "call_ids",
        "cancel_reason",
        "continuation",
        "continuing",
        "ended",
        "error",
        "finishing",
        "forwards",
        "heard_text",
        "holds",
        "in_line",
        "observe",
        "paused",
        "pending",
        "ports",
        "priority",
        "prompt",
        "released",
        "request_id",
        "resume",
        "running_calls",
        "sink",
        "started",
        "steering",
        "stop_reason",
        "text",
        "turn_counted",
        "turns",
        "turns_before",
    )

    def __init__(self, prompt: str, sink: EventSink, agent: _Agent, request_id: str | None = None) -> None:
        self.request_id = request_id or f"req-{os.urandom(6).hex()}"  # 48 random bits, as uuid4().hex[:12]
        self.prompt = prompt
        self.resume: Resume | None = None  # a continuation of a paused request: its answers
        self.paused: PausedRun | None = None  # set when it ended paused
        self.sink = sink
        self.agent = agent
        self.abort = AbortHandle()
        self.steering = AbortHandle()
        # "Finish what runs, then stop": steering of a foreground subagent (its block tools finish),
        # made when first asked for (`stop`): a root request is never told to stop.
        self._stop: AbortHandle | None = None
        # The messages that joined it, not yet taken by a turn. Until one joins (`RequestQueue.join`
        # makes its own list), the one shared empty list: read, popped while non-empty and cleared
        # when non-empty only, never added to (each object made eagerly is one more for the
        # garbage collector to walk per request in flight).
        self.pending: list[str] = _NONE_PENDING
        self.in_line = False  # counted by its queue as waiting (`RequestQueue.queued`)
        self.call_ids: list[str] = []  # the tool calls it scheduled, for the results an abort keeps
        # The stream channels it feeds, closed when it ends (a tuple: most requests have none).
        self.forwards: tuple[EventForward, ...] = ()
        # The ToolUseEvent of each call announced to a listener and not yet answered, by call id:
        # what a stream that joins is told first (made with the first announced call).
        self.running_calls: dict[str, ToolUseEvent] | None = None
        # Its run's ports while it runs: set_model switches their model for the next model call.
        self.ports: RunPorts | None = None
        # Why a cancellation from outside (not an SDK abort) ended it: decided by who hosts it.
        self.cancel_reason: Callable[[], RequestInterruptReason] = _session_close
        # The run's events as delivered (after chat middleware), for whoever routes it (subagents).
        self.observe: Callable[[RunEvent], Awaitable[None]] | None = None
        # Whether it ended (`finish`); the event its waiters wait on is made by the first of them
        # (`done`): most requests end with nobody waiting but their own caller's task.
        self.ended = False
        self._done: trio.Event | None = None
        self.text = ""
        self.stop_reason = StopReason.END_TURN
        self.turns = 0
        self.turn_counted = False  # this turn was counted while nobody listened (`RequestInbox.begin_turn`)
        self.heard_text: list[str] | None = None  # the text of the reply being streamed to a listener
        self.error: BaseException | None = None
        self.priority: Priority | None = None
        self.started = False  # request_started is durable
        self.begun: trio.Event | None = None  # made by what waits for it to start (`wait_started`)
        self.accepting = True  # messages with priority next/now may still join it
        self.continuation: str | None = None  # a Stop hook's "one more round" message
        # Started by an earlier owner of the session (a worker that died or handed it off): it goes
        # on from its last durable point, its prompt already in the conversation.
        self.continuing = False
        self.accepted_before = False  # its request_accepted is in the journal (a request taken over)
        # Set once its request_accepted write settled (made for a request that waits in line,
        # which takes its place before the write: the worker waits for it).
        self.acceptance: trio.Event | None = None
        self.turns_before = 0
        self.finishing = False  # no new background starts may join it
        self.holds = 0  # background starts in progress under this request
        self.released: trio.Event | None = None  # made with the first hold

    @property
    def done(self) -> trio.Event:
        """Set when it ended (`finish`): made when first asked for, set already if it ended."""
        done = self._done
        if done is None:
            done = self._done = trio.Event()
            if self.ended:
                done.set()
        return done

    @property
    def stop(self) -> AbortHandle:
        """The request's stop handle (`_stop`), made when first asked for."""
        stop = self._stop
        if stop is None:
            stop = self._stop = AbortHandle()
        return stop

    def listening(self) -> bool:
        """Whether anything reads the request's events now (a stream, one that joined, an observer)."""
        return self.sink is not discard or self.observe is not None

    def mark_started(self) -> None:
        """Its ``request_started`` is taken: what waits for it to start may start under it."""
        self.started = True
        if self.begun is not None:
            self.begun.set()

    async def wait_started(self) -> None:
        """Wait until it started or ended (it may end without starting: aborted while accepted)."""
        if self.begun is None:
            self.begun = trio.Event()
        await self.begun.wait()

    def finish(self) -> None:
        """It ended: wake its waiters. A stream always ends, even when its end could not be
        recorded or sent in time (the reader then learns the outcome from the request)."""
        for forward in self.forwards:
            forward.close_now()
        self.ended = True
        done = self._done
        if done is not None:
            done.set()
        if self.begun is not None:
            self.begun.set()

    def raise_if_failed(self) -> None:
        """Raise a finished request's error as a trio_agent error."""
        error = self.error
        if error is not None:
            if isinstance(error, TrioAgentError):
                raise error
            raise RequestAbortedError(f"the request failed: {describe(error)}", reason="error") from error

    def raise_for_group(self, group: BaseExceptionGroup[BaseException]) -> NoReturn:
        """Raise what the caller that ran this request in its own task is told of *group* (a tool's
        or a hook's own nursery, cancelled from outside, whose cleanup raised beside the
        cancellation): one exception (`raise_for_boundary`), a foreign error typed as
        `raise_if_failed` types one: the request's end as recorded (interrupted by the
        cancellation), that error its cause."""
        single = unwrap_for_boundary(group)
        if isinstance(single, Exception) and not isinstance(single, TrioAgentError):
            error = self.error
            if not isinstance(error, RequestAbortedError):  # (its completion was recorded first)
                error = RequestAbortedError(f"the request failed: {describe(single)}", reason="error")
            raise error from single
        raise_for_boundary(group)


# The request the current task works for: the root's, set by its runner, or a background subagent's
# work, set by its task (`SubagentSupervisor._background_main`); inherited by every task started
# under it (tools, hooks, foreground subagents). What runs there must not wait for that request's
# end (`Session.close` from a tool would wait for itself).
_WORKING_FOR: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("trio_agent_working_for", default=None)


def working_for() -> _Request | None:
    """The unfinished request the calling task works for (`_WORKING_FOR`), if any."""
    request = _WORKING_FOR.get()
    return request if request is not None and not request.ended else None


class RequestRunner(Protocol):
    """What runs a request to its end (the session's host): passed as itself, not as a bound
    method, so neither an idle session's queue nor a request in flight keeps one more object."""

    async def run_request(self, request: _Request) -> None: ...


class Notes(Protocol):
    """Where messages go that joined a request which never ran: its agent's inbox, journalled
    (the host's `InboxNotes`)."""

    def note_later(self, agent_id: str, messages: Sequence[str], *, request_id: str | None = None) -> None: ...


_INTERRUPT_REASONS = {
    AbortReason.STEERING: RequestInterruptReason.STEERING,
    AbortReason.SESSION_CLOSE: RequestInterruptReason.SESSION_CLOSE,
}


def interrupt_reason(reason: AbortReason) -> RequestInterruptReason:
    """The journal's reason for a request that an SDK abort with *reason* interrupted."""
    return _INTERRUPT_REASONS.get(reason, RequestInterruptReason.USER_ABORT)


async def accept_on(journal: DurableJournal, agent_id: str, request: _Request) -> None:
    """Record *request* accepted on *agent_id*'s stream (once: one an earlier owner of the session
    accepted, and that a worker now serves, is recorded already)."""
    if request.accepted_before:
        return
    await journal.append(
        request_accepted(
            request.request_id,
            request.request_id,
            # A continuation carries no prompt: its answers are recorded with interrupts_resolved.
            {"prompt": request.prompt} if request.resume is None else {"resume": request.resume.parent_run_id},
        ),
        command_id=request.request_id,
        agent_id=agent_id,
    )


# ---------------------------------------------------------------- how a running request ends


async def drain_holds(request: _Request) -> None:
    """Let background starts under this request finish their writes before it ends."""
    request.finishing = True
    released = request.released
    if request.holds and released is not None:
        await released.wait()


async def record_raised(journal: DurableJournal, request: _Request, exc: BaseException, grace: float) -> bool:
    """Record how a request that raised ended; return whether the exception is handled
    (recorded as the request's error) or must go on.

    Cancellation (a group holding ``Cancelled`` and no typed error included) is
    recorded interrupted and goes on unchanged, except that a request whose
    completion the journal took already stays completed (no error); a typed error
    wins over a ``Cancelled`` beside it and fails the request; lease loss goes on at once.
    """
    agent_id = request.agent.agent_id
    typed = typed_error(exc)
    if isinstance(typed, LeaseLostError):
        if typed is exc:
            return False
        raise typed from None
    if isinstance(typed, HookInterruptedError) and typed.abort is request.abort.reason:
        # The request's own abort stopped a hook it awaited (UserPromptSubmit, Stop): an abort of
        # the request (its reason, its committed results), not a failure of the hook.
        await record_interrupted(journal, request, grace)
        return True
    if typed is None and (is_cancellation(exc) or any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves(exc))):
        # Cancelled from outside (the session block, a subagent's work scope, a parent's tool call),
        # or Ctrl-C landing in this task: recorded, so no request is left open for recovery.
        record = journal.projection(agent_id).request(request.request_id)
        if record is not None and record.state is RequestState.COMPLETED:
            # Its completion was taken first (the cancellation landed while it was committed, or
            # its DoneEvent sent): the work is done and stays so, its answer kept.
            return False
        reason = request.cancel_reason()
        # What a message that joined this request is told (its sender waits for this request's end):
        # the caller's own cancellation goes on as it is.
        request.error = RequestAbortedError(f"the request was interrupted ({reason.value})", reason=reason.value)
        request.stop_reason = StopReason.ABORTED
        with bounded_shield(grace, "recording a cancelled request"):
            await drain_holds(request)
            await record_request_end(
                journal,
                agent_id,
                request.request_id,
                RequestInterrupted(request_id=request.request_id, reason=reason),
            )
        return False
    if typed is None and not isinstance(exc, Exception):
        return False  # KeyboardInterrupt, SystemExit...: nothing more may run
    error: BaseException = typed if typed is not None else exc
    request.error = error
    request.stop_reason = StopReason.ABORTED if isinstance(error, RequestAbortedError) else StopReason.ERROR
    with bounded_shield(grace, "recording a failed request"):
        await drain_holds(request)
        await record_request_end(
            journal,
            agent_id,
            request.request_id,
            RequestFailed(request_id=request.request_id, error=ErrorInfo.of(error)),
            turn_reason=TurnAbortReason.ERROR,
        )
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await request.sink(
                DoneEvent(
                    request.request_id,
                    request.text,
                    request.stop_reason,
                    request.turns,
                    describe(error, "text"),
                    error_code=error_code(error),
                )
            )
    return True


async def record_interrupted(journal: DurableJournal, request: _Request, grace: float) -> None:
    """An SDK abort (or a steering stop) ended the request: record it; keep what was committed."""
    stop = request._stop
    abort = request.abort.reason or (stop.reason if stop is not None else None)
    reason = abort.reason if abort is not None else AbortReason.USER_ABORT
    agent_id = request.agent.agent_id
    request.stop_reason = StopReason.ABORTED
    detail = f": {abort.message}" if abort is not None and abort.message else ""
    request.error = RequestAbortedError(
        f"the request was aborted ({reason.value}){detail}",
        reason=reason.value,
        results=committed_results(journal, agent_id, request.call_ids),
    )
    with bounded_shield(grace, "recording an interrupted request"):
        await drain_holds(request)
        await record_request_end(
            journal,
            agent_id,
            request.request_id,
            RequestInterrupted(request_id=request.request_id, reason=interrupt_reason(reason)),
        )
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await request.sink(DoneEvent(request.request_id, request.text, StopReason.ABORTED, request.turns))


# ---------------------------------------------------------------- the root agent's queue


class RequestQueue:
    """The root agent's requests: intake (priorities, join, steer), the queue, and the worker."""

    # Slotted, as every object an idle session keeps (thousands may be alive).
    __slots__ = (
        "_accepted",
        "_accepting",
        "_held_here",
        "_line",
        "_queued",
        "_runner",
        "_serve_in",
        "_slot",
        "_waiting",
        "_worker_done",
        "closed",
        "current",
        "grace",
        "journal",
        "max_queued",
        "notes",
        "root",
    )

    def __init__(
        self,
        journal: DurableJournal,
        root: _Agent,
        *,
        max_queued: int,
        cleanup_grace: float,
        notes: Notes,
    ) -> None:
        self.journal = journal
        self.root = root
        # The host: what joined a request that never started reaches the agent's next turn, journalled.
        self.notes = notes
        self.grace = cleanup_grace
        self.max_queued = max_queued
        self._worker_done: trio.Event | None = None  # made when the worker starts
        # The requests that wait, made with the first one (an idle session holds no channel).
        self._line: tuple[trio.MemorySendChannel[_Request], trio.MemoryReceiveChannel[_Request]] | None = None
        self._waiting: _Request | None = None  # taken by the worker, waiting for the request slot
        # Requests accepted to wait, from before their acceptance is written (its place is taken
        # then) until they run or end: counted, not read off the channel, which misses one handed
        # straight to the worker and counts one aborted while it waited.
        self._queued = 0
        # The worker starts with the first request that has to wait: an idle session runs no task.
        self._serve_in: trio.Nursery | None = None
        self._runner: RequestRunner | None = None  # (two slots: no tuple to keep)
        self.current: _Request | None = None
        # The request slot: one request (or subagent start) at a time. A request run in its caller's
        # task holds it as a flag; the semaphore is made when something has to wait for it.
        self._held_here = False
        self._slot: trio.Semaphore | None = None
        self.closed = False
        self._accepting = 0  # request_accepted writes in flight (close waits for them)
        self._accepted: trio.Event | None = None  # made when the close waits for an acceptance

    # -- intake

    @staticmethod
    def check_message(prompt: str, priority: str | None) -> None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError("a prompt must be a non-empty string")
        if priority is not None and priority not in PRIORITIES:
            names = ", ".join(repr(p.value) for p in Priority)
            raise ConfigError(f"priority must be one of {names} (or None), not {priority!r}")

    def joinable(self, priority: str | None) -> _Request | None:
        """The running request a message with *priority* joins, if any."""
        current = self.current
        if (
            current is not None
            and not current.ended
            and current.accepting
            and priority in (Priority.NEXT, Priority.NOW)
        ):
            return current
        return None

    @staticmethod
    def join(current: _Request, prompt: str, priority: str | None) -> None:
        if current.pending is _NONE_PENDING:
            current.pending = [prompt]
        else:
            current.pending.append(prompt)
        if priority == Priority.NOW:
            current.steering.abort(AbortReason.STEERING, "steered by a new message")

    @property
    def queued(self) -> int:
        """Accepted requests that wait to run (the one the worker took and holds counts)."""
        return self._queued

    def _leave_line(self, request: _Request) -> None:
        """*request* waits no more (it runs, or ended): once, wherever that is noticed first."""
        if request.in_line:
            request.in_line = False
            self._queued -= 1

    def idle(self) -> bool:
        """Nothing runs and nothing is queued."""
        current = self.current
        return (current is None or current.ended) and not self.queued

    def check_not_busy(self, priority: str | None) -> None:
        current = self.current
        if current is not None and not current.ended and priority is None:
            raise SessionBusyError("a request is running: send with priority='next', 'now' or 'later', or wait for it")
        if current is None and self.queued and priority is None:
            raise SessionBusyError("requests are queued: send with priority='later' to queue another")

    async def accept(self, request: _Request, cancel_reason: Callable[[], RequestInterruptReason]) -> None:
        """Accept *request* to wait in line for the worker (*cancel_reason*: why a cancellation of
        the caller while its acceptance is written ends it)."""
        if self.closed:
            raise SessionClosedError("the session is closed")
        queued = self._queued
        if queued >= self.max_queued:
            raise SessionBusyError(f"{queued} requests are already queued; wait for some to finish")
        # Its place is taken before the acceptance is written (an await): the line never overfills,
        # and it runs in the order the journal accepted it, whatever order the writes are confirmed
        # in (a store that commits a group of writes at once may wake their writers last first).
        self._queued += 1
        request.in_line = True
        acceptance = request.acceptance = trio.Event()
        send, _ = self._waiting_line()
        send.send_nowait(request)
        self._start_worker()
        try:
            await self._accept_durably(request, cancel_reason)
        except BaseException:
            self._leave_line(request)  # it ended (`_accept_durably`): the worker drops it
            raise
        finally:
            acceptance.set()

    def _waiting_line(
        self,
    ) -> tuple[trio.MemorySendChannel[_Request], trio.MemoryReceiveChannel[_Request]]:
        if self._line is None:
            # Unbounded: `_queued` bounds the requests that wait; a request aborted while it waits
            # leaves the count at once but the channel only when the worker reaches it.
            self._line = trio.open_memory_channel[_Request](math.inf)
        return self._line

    async def _accept_durably(self, request: _Request, cancel_reason: Callable[[], RequestInterruptReason]) -> None:
        """Record *request* accepted (durable before send returns or the stream starts), or end it:
        a request that is not accepted, or accepted while the session closed, is never left open."""
        self._accepting += 1  # the close waits for this, so the request is settled either way
        try:
            try:
                await accept_on(self.journal, self.root.agent_id, request)
            except BaseException as exc:
                # A cancellation, Ctrl-C or a failed write: the accepted request never runs,
                # so it ends here (recorded if the journal took it), never left open.
                reason = RequestInterruptReason.SESSION_CLOSE if self.closed else cancel_reason()
                await self._unqueue(request, exc, "the caller was cancelled while the request was accepted", reason)
                raise
            if self.closed:
                closed = SessionClosedError("the session closed while the request was accepted")
                await self._unqueue(request, closed, str(closed), RequestInterruptReason.SESSION_CLOSE)
                raise closed
        finally:
            self._accepting -= 1
            if self._accepting == 0 and self._accepted is not None:
                self._accepted.set()

    def settled(self) -> bool:
        """Nothing runs, waits, is being accepted, and no worker task runs (closing it awaits nothing)."""
        current = self.current
        worker_done = self._worker_done
        return (
            (current is None or current.ended)
            and (worker_done is None or worker_done.is_set())
            and not self._accepting
            and not self.queued
        )

    def slot(self) -> trio.Semaphore:
        """The request slot, for what waits for it (`async with queue.slot()`)."""
        slot = self._slot
        if slot is None:
            # Held by a request run in its caller's task meanwhile: taken on its behalf (`run_here`).
            slot = self._slot = trio.Semaphore(0 if self._held_here else 1, max_value=1)
        return slot

    def runs_here(self) -> bool:
        """Nothing runs or waits and the request slot is free: a request may run in its caller's task."""
        slot = self._slot
        return (
            self.current is None
            and not self.closed
            and not self._held_here
            and (slot is None or slot.value > 0)
            and not self.queued
        )

    async def run_here(
        self,
        request: _Request,
        runner: RequestRunner,
        cancel_reason: Callable[[], RequestInterruptReason],
    ) -> None:
        """Accept and run *request* in the calling task (`runs_here` said the session is idle), to
        its end: raises as `_Request.raise_if_failed` does if it failed.

        No hand-off to the worker: the slot is taken before the first await, so what arrives
        meanwhile queues behind this request or joins it, exactly as if the worker ran it. A
        cancellation of the caller interrupts the request (*cancel_reason* says why). The tasks
        under it know they work for *request* (`working_for`). One coroutine level (the caller's
        is a plain function): each level is one more object per request in flight.
        """
        try:
            slot = self._slot
            if slot is None:
                self._held_here = True
            else:
                slot.acquire_nowait()  # free: `runs_here` checked it, and nothing awaited since
            self.current = request
            try:
                try:
                    await self._accept_durably(request, cancel_reason)
                    if request.abort.aborted:  # aborted while it was accepted: it never starts
                        await self._record_unstarted(request)
                    else:
                        request.cancel_reason = cancel_reason
                        token = _WORKING_FOR.set(request)
                        try:
                            await runner.run_request(request)
                        finally:
                            _WORKING_FOR.reset(token)
                finally:
                    self.current = None
            finally:
                if self._held_here:
                    self._held_here = False
                    if self._slot is not None:  # made while this request ran: taken on its behalf
                        self._slot.release()
                else:
                    assert slot is not None
                    slot.release()
        except BaseExceptionGroup as group:  # a tool's or a hook's nursery, cancelled: one error out
            request.raise_for_group(group)
        request.raise_if_failed()

    async def _unqueue(self, request: _Request, exc: BaseException, why: str, reason: RequestInterruptReason) -> None:
        """A request whose acceptance failed (*exc*) or came as the session closed: it never runs.
        Recorded interrupted with *reason* if the journal took it; it ends either way (what joined
        it meanwhile is told so, and its message reaches the agent's next turn)."""
        try:
            record = self.journal.projection().request(request.request_id)
            if record is not None and record.state is RequestState.ACCEPTED:
                with bounded_shield(self.grace, "recording an unqueued request"):
                    await record_request_end(
                        self.journal,
                        self.root.agent_id,
                        request.request_id,
                        RequestInterrupted(request_id=request.request_id, reason=reason),
                    )
        finally:
            if not request.ended:  # else it ended meanwhile (aborted, or rejected by the close)
                request.accepting = False
                self._keep_pending(request)
                typed = typed_error(exc)
                request.error = typed if typed is not None else RequestAbortedError(why, reason=reason.value)
                request.stop_reason = StopReason.ABORTED
                request.finish()

    def _keep_pending(self, request: _Request) -> None:
        """What joined *request*, which never ran: to the agent's next turn, journalled with the
        stream's next write (the request's end, written next), as for a request that ended first."""
        if request.pending:
            self.notes.note_later(request.agent.agent_id, request.pending, request_id=request.request_id)
            request.pending.clear()

    async def abort_request(self, request: _Request, reason: AbortReason, message: str) -> None:
        """Abort *request*; returns once its end is durable."""
        request.abort.abort(reason, message)
        if self.current is not request and not request.started and not request.ended:
            # Still queued: it never starts; record it now instead of waiting for the worker.
            await self._record_unstarted(request)
            return
        await request.done.wait()

    async def _record_unstarted(self, request: _Request) -> None:
        """An accepted request that was aborted before it started: recorded interrupted, finished
        (also when the record raises: the caller is told). A message that joined it meanwhile is
        not lost: it reaches the agent's next turn, as for a request aborted while it ran
        (`SessionHost.run_request`)."""
        self._leave_line(request)
        request.accepting = False
        self._keep_pending(request)
        abort = request.abort.reason
        reason = abort.reason if abort is not None else AbortReason.USER_ABORT
        message = abort.message if abort is not None else "aborted"
        # Its outcome first, then the record: it ends whatever the record raises (the projection
        # refusing the event; a store's failure is logged there), else its waiters (a stream's
        # reader, a message that joined it) wait for ever: nobody else ends an aborted request
        # (`_serve` and `_reject_left` leave it to whoever aborted it).
        request.error = RequestAbortedError(
            f"the request was aborted before it started: {message}", reason=reason.value
        )
        request.stop_reason = StopReason.ABORTED
        try:
            with bounded_shield(self.grace, "recording a queued request's abort"):
                await record_request_end(
                    self.journal,
                    request.agent.agent_id,
                    request.request_id,
                    RequestInterrupted(request_id=request.request_id, reason=interrupt_reason(reason)),
                )
        finally:
            request.finish()

    # -- the worker

    def serve_in(self, nursery: trio.Nursery, runner: RequestRunner) -> None:
        """Run what has to wait with *runner*, in a worker task of *nursery* started when first needed."""
        self._serve_in, self._runner = nursery, runner

    def _start_worker(self) -> None:
        nursery, runner = self._serve_in, self._runner
        if nursery is not None and runner is not None:
            self._serve_in = self._runner = None
            done = self._worker_done = trio.Event()  # made now: a close from here on waits for it
            nursery.start_soon(self._serve, runner, done, name="trio_agent.session.request_worker")

    async def _serve(self, runner: RequestRunner, done: trio.Event) -> None:
        """Run the queued requests one at a time with *runner*; rejects what is queued once closed."""
        try:
            _, line = self._waiting_line()
            async for request in line:
                if request.ended or request.abort.aborted:
                    self._leave_line(request)
                    continue  # aborted while it was queued: `abort_request` records it
                if self.closed:
                    await self._reject_queued(request)
                    continue
                self._waiting = request
                slot = self.slot()
                try:
                    acceptance = request.acceptance
                    if acceptance is not None and not acceptance.is_set():
                        # In line from before its acceptance was written: it runs once that settled
                        # (and not at all if it failed: it ended then, `_run_taken` sees it).
                        await acceptance.wait()
                    await slot.acquire()  # a request run in its caller's task may hold the slot
                except BaseException:
                    if not request.ended:
                        await self._reject_queued(request)  # taken from the queue: it must still end
                    raise
                finally:
                    self._waiting = None
                try:
                    await self._run_taken(request, runner)
                finally:
                    slot.release()
        finally:
            try:
                # Cancelled (the session's block, a lost lease): what is still queued must end too,
                # or its callers wait for ever and its acceptance stays open in the journal.
                await self._reject_left()
            finally:
                done.set()

    async def _reject_left(self) -> None:
        """End what is still in the line when the worker ends, as the close ends what it finds there."""
        line = self._line
        if line is None:
            return
        while True:
            try:
                request = line[1].receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if not (request.ended or request.abort.aborted):
                await self._reject_queued(request)
            self._leave_line(request)

    async def _run_taken(self, request: _Request, runner: RequestRunner) -> None:
        """Run a queued request that got the slot, unless it was aborted or the session closed meanwhile."""
        if request.ended or request.abort.aborted:
            self._leave_line(request)
            return  # aborted while it waited for the request slot: `abort_request` recorded it
        if self.closed:
            await self._reject_queued(request)
            return
        self._leave_line(request)
        self.current = request
        token = _WORKING_FOR.set(request)  # the tasks under it know they work for it (`working_for`)
        try:
            await runner.run_request(request)
        finally:
            _WORKING_FOR.reset(token)
            self.current = None

    async def _reject_queued(self, queued: _Request) -> None:
        """A request still queued when the session closes: recorded interrupted, its caller told."""
        self._leave_line(queued)
        queued.abort.abort(AbortReason.SESSION_CLOSE, "the session closed before it started")
        try:
            with bounded_shield(self.grace, "recording a request the close rejected"):
                await record_request_end(
                    self.journal,
                    queued.agent.agent_id,
                    queued.request_id,
                    RequestInterrupted(request_id=queued.request_id, reason=RequestInterruptReason.SESSION_CLOSE),
                )
        finally:
            # Its caller is told even when the record overran cleanup_grace (abandoned) or was
            # refused: else its send() waits for ever.
            queued.error = SessionClosedError("the session closed before the request started")
            queued.stop_reason = StopReason.ABORTED
            try:
                # A bound of its own: the record's may be spent, and a sink of the caller's may wait.
                with (
                    bounded_shield(self.grace, "telling a rejected request's caller"),
                    contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
                ):
                    await queued.sink(DoneEvent(queued.request_id, "", StopReason.ABORTED, 0, str(queued.error)))
            finally:
                queued.finish()

    # -- closing

    def close(self) -> None:
        """Accept nothing more; the worker rejects what is queued and ends."""
        self.closed = True
        self._serve_in = self._runner = None
        if self._line is not None:
            self._line[0].close()

    async def drain(self) -> None:
        """Wait for the worker to end and for accepts in flight to settle (after `close`)."""
        worker_done = self._worker_done
        if worker_done is not None and not worker_done.is_set():  # else no checkpoint: nothing to wait for
            await worker_done.wait()
        while self._accepting:
            accepted = self._accepted = trio.Event()
            await accepted.wait()
