"""`Session`: the public face of an open session (open one with `open_session`).

A session owns a nursery. One request runs at a time (`RequestQueue`'s worker);
background subagents are tasks of the same nursery (`SubagentSupervisor`), so
they outlive the request that started them but never the session. Each request
is one run of the one agent loop, hosted by `SessionHost`. Leaving the block
cancels what still runs, records every cancellation and writes exactly one
``session_closed`` per agent stream (`Session._close`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal

import trio

from .._abort import AbortReason, abort_reason
from .._cleanup import bounded_shield
from .._config import validate_id
from .._errors import (
    ConfigError,
    InvalidTransitionError,
    JournalError,
    JournalFencedError,
    LeaseLostError,
    SessionClosedError,
    SessionPausedError,
    TrioAgentError,
    UnfinishedRequestError,
)
from .._groups import cancelled_around, is_cancellation, raise_for_boundary
from .._journal._durable import DurableJournal, RecoveryReport
from .._journal._events import (
    ErrorInfo,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    SessionClosed,
    SessionCloseReason,
)
from .._journal._projection import RequestState, SessionState
from .._journal._subscribe import DurableEventStream, JournalCursor
from .._lifecycle._interrupts import PausedRun, continuation_answers
from .._loop._interrupts import InterruptAnswer, InterruptIssue, InterruptResumeError, Resume
from .._models._messages import Message
from .._permissions._engine import PermissionEngine
from .._tools._context import ToolContext
from .._tools._definition import Tool
from .._tools._pipeline import ToolPipeline
from ._endings import open_items, record_request_end
from ._hooks import HookEvent
from ._host import SessionHost
from ._messages import PausedReply, SessionEvent
from ._recovery import begin_life, rebuild_history
from ._requests import Priority, RequestQueue, _Agent, _Request, working_for
from ._stream import EventForward, EventSink, SessionEventStream, discard, tee
from ._subagents import SubagentDefinition, SubagentHandle, SubagentSupervisor

__all__ = ["Priority", "Session", "SubagentDefinition", "SubagentHandle"]

_log = logging.getLogger("trio_agent.session")


class Session:
    """A multi-turn agent session. Open it with `open_session`."""

    # Slotted: thousands of idle sessions may be alive, and a dict each is bytes and a GC object.
    __slots__ = (
        "_close_after",
        "_close_done",
        "_closed",
        "_closing",
        "_final",
        "_host",
        "_kept",
        "_nursery",
        "_queue",
        "_recovery_notes",
        "_started",
        "_starting",
        "_starts_settled",
        "_supervisor",
        "cleanup_grace",
        "close_timeout",
        "journal",
        "life",
        "recovery",
        "session_id",
    )

    def __init__(
        self,
        *,
        host: SessionHost,
        queue: RequestQueue,
        supervisor: SubagentSupervisor,
        nursery: trio.Nursery,
        close_timeout: float = 30.0,
    ) -> None:
        self._host = host
        self._queue = queue
        self._supervisor = supervisor
        self._nursery: trio.Nursery | None = nursery
        self.journal: DurableJournal = host.journal
        self.session_id = host.session_id
        self.cleanup_grace = host.cleanup_grace  # both checked by open_session
        self.close_timeout = close_timeout
        self.recovery: RecoveryReport | None = None
        self._recovery_notes: list[str] | None = None  # made when first read or added to (`recovery_notes`)
        self.life = 1  # which life of the session this is (a cleanly closed session reopened: 2, 3 ...)
        self._started = False
        self._kept: str | None = None  # the started request an earlier owner left, kept at open
        self._final = False  # the close ends it for good
        self._closed = False
        self._closing = False  # a close runs (in some task)
        self._close_done: trio.Event | None = None  # made by a second close that waits for the first
        # The requests a close asked for from inside running work waits for (their callers work for
        # them), then runs: None until one asks.
        self._close_after: set[_Request] | None = None
        # Subagent starts between requests whose holder request is (being) written: the close
        # waits for them, or it would find that request open and leave the stream to recovery.
        self._starting = 0
        self._starts_settled: trio.Event | None = None  # made when the close waits for them

    # -- what it holds

    @property
    def recovery_notes(self) -> list[str]:
        """What reopening recovered, one line per re-run call or unknown outcome on any stream (a
        list made when first read or added to: most sessions have none)."""
        notes = self._recovery_notes
        if notes is None:
            notes = self._recovery_notes = []
        return notes

    @recovery_notes.setter
    def recovery_notes(self, notes: list[str]) -> None:
        self._recovery_notes = notes

    @property
    def root_agent_id(self) -> str:
        """The root agent's id: its journal stream is ``journal.stream_id(root_agent_id)``."""
        return self._host.root.agent_id

    @property
    def pipeline(self) -> ToolPipeline:
        return self._host.pipeline

    @property
    def permissions(self) -> PermissionEngine | None:
        return self._host.permissions

    @property
    def subagents(self) -> dict[str, SubagentHandle]:
        return self._supervisor.subagents

    @property
    def definitions(self) -> Mapping[str, SubagentDefinition]:
        return self._supervisor.definitions

    def messages(self) -> tuple[Message, ...]:
        """The root agent's conversation so far (a snapshot; the session owns the live one)."""
        return tuple(self._host.root.history)

    @property
    def model(self) -> str:
        return self._host.service.model

    def set_model(self, name: str) -> None:
        """Use model ``name`` from the next model call on, also in the request running now (same
        middleware stack)."""
        self._host.set_model(name, self._queue.current)

    # -- requests

    def _check_open(self) -> None:
        # The queue closes first when the close waits for the running request (`close` from a tool).
        if self._host.closing or self._nursery is None or self._queue.closed:
            raise SessionClosedError("the session is closed")

    def _check_not_paused(self) -> None:
        paused = self._host.paused
        if paused is not None:
            asked = ", ".join(item.id for item in paused.interrupts)
            raise SessionPausedError(
                f"session {self.session_id!r} is paused waiting for answers ({asked}): "
                "answer with session.resume([...]) (Cancel answers every question without running anything)"
            )

    def _check_no_kept_request(self, serving: str | None = None) -> None:
        """While nothing runs: refuse a new request of the root (*serving*: the one `serve_request`
        runs) before anything is written, when an earlier owner started one that this life keeps
        (``unfinished="keep"``), or one this life started was left open. The journal takes one
        started request at a time, and only `serve_request` goes on with a kept one; one left open
        here (its end could not be recorded) is ended by the recovery of the next life."""
        kept = self.journal.projection(self._host.root.agent_id)._s.active_request
        if kept is not None and kept != serving and kept != self._kept:
            # Started in this life and left open: its end could not be recorded (the journal fenced,
            # or its calls left unsettled by a refused settlement). What refuses writes says why.
            self.journal._check_writable()
            raise UnfinishedRequestError(
                f"session {self.session_id!r} holds request {kept!r}, started here, whose end could not be "
                "recorded (a write of it was refused or its outcome unknown, its tool calls are left "
                "unsettled): close the session and reopen it (open_session(session_id=...)), whose recovery "
                "ends it; nothing was written",
                request_id=kept,
            )
        if kept is not None and kept != serving:
            raise UnfinishedRequestError(
                f"session {self.session_id!r} keeps request {kept!r}, started by an earlier owner "
                "(open_session(unfinished='keep')): run it to its end with "
                f"session.serve_request({kept!r}, prompt) first (or reopen with unfinished='interrupt' "
                "to record it interrupted); nothing was written",
                request_id=kept,
            )

    @property
    def paused(self) -> PausedRun | None:
        """The paused request's state (its questions in ``paused.interrupts``), or ``None``."""
        return self._host.paused

    async def resume(self, answers: Sequence[InterruptAnswer]) -> str:
        """Answer the paused request's questions and go on; returns what ``send()`` returns.

        Every question is answered once (`Approve` / `Reject` / `Cancel` an approval,
        `Respond` to a client tool or a question); a bad set of answers raises
        `InterruptResumeError` naming each issue, nothing runs and the session stays
        paused. A second continuation of one pause is refused (code ``stale``), also
        from another process: the journal accepts one ``interrupts_resolved`` per pause.
        """
        request = self._continuation(answers)
        await self._run_to_end(request, "resume() was cancelled")
        return _reply(request)

    @asynccontextmanager
    async def resume_stream(self, answers: Sequence[InterruptAnswer]) -> AsyncIterator[SessionEventStream]:
        """`resume`, streamed like `stream`: ``async with session.resume_stream(answers) as events``."""
        request = self._continuation(answers)
        send, recv = trio.open_memory_channel[SessionEvent](256)
        async with self._streamed(request, send, recv) as stream:
            yield stream

    def _continuation(self, answers: Sequence[InterruptAnswer]) -> _Request:
        """The request that answers the paused one (checked: the session is open, paused and idle)."""
        self._check_open()
        paused = self._host.paused
        if paused is None:
            raise InterruptResumeError(
                [InterruptIssue(None, "stale", f"session {self.session_id!r} is not paused: nothing to resume")]
            )
        checked = continuation_answers(answers)
        self._queue.check_not_busy(None)
        request = _Request("", discard, self._host.root)
        request.resume = Resume(paused.state, checked, paused.run_id)
        return request

    async def send(self, prompt: str, *, priority: Priority | Literal["next", "now", "later"] | None = None) -> str:
        """Run ``prompt`` as a request and return the final answer.

        A request that paused (``permission_asks="interrupt"``, a client tool, a
        middleware's question) returns a `PausedReply` (a ``str`` with ``interrupts``);
        answer it with `resume`. While paused, a new prompt raises `SessionPausedError`.

        While a request runs: ``priority="next"`` adds the message to it after
        the current turn, ``"now"`` does that and steers (aborts ``cancel``
        tools), ``"later"`` queues a new request; no priority raises `SessionBusyError`.
        """
        # Same rules as `stream`, without an event channel: nobody reads the events.
        queue = self._queue
        queue.check_message(prompt, priority)
        self._check_open()
        current = queue.joinable(priority)
        if current is not None:
            queue.join(current, prompt, priority)
            await current.done.wait()
            current.raise_if_failed()
            return _reply(current)
        queue.check_not_busy(priority)
        if queue.idle():  # else it queues behind what runs; the worker refuses it if still paused then
            self._check_not_paused()
            self._check_no_kept_request()
        request = _Request(prompt, discard, self._host.root)
        request.priority = None if priority is None else Priority(priority)
        await self._run_to_end(request, "send() was cancelled")
        return _reply(request)

    async def serve_request(self, request_id: str, prompt: str, *, sink: EventSink = discard) -> RequestState:
        """Run request *request_id* to its end at most once, and return how the journal says it ended.

        What a worker does with each submission (`serve_sessions`), idempotent by request id:
        a request the journal never saw is accepted with *prompt* and run; one accepted by an
        earlier owner of the session (``open_session(..., unfinished="keep")``) runs; one it
        started goes on from its last durable point (its settled calls kept, the next model
        call next); one that already ended is not run again. A failing request ends
        ``failed`` (recorded) and is returned, not raised; *sink* receives its events as
        `stream` s do.

        The state returned is durable: when the journal could not record the request's end
        (its lease lost, or a write refused or of unknown outcome: the journal is fenced),
        this raises that error instead, and the store, not this process, knows how it ended.

        *request_id* is judged by the rule new ids are made under (`validate_id`) only when the
        journal never saw it: one it holds is served by the older rule it may have been taken
        under (``stored=True``), as that request's session is.
        """
        return await self._serve_request(request_id, prompt, sink, queued=False)

    async def _serve_request(self, request_id: str, prompt: str, sink: EventSink, *, queued: bool) -> RequestState:
        """`serve_request`; ``queued``: *request_id* names a submission already stored (a worker's
        inbox row, maybe taken under the older id rule), so it is judged by the rule it was
        stored under even when the journal never saw it, as its session id is."""
        validate_id(request_id, name="request_id", stored=True)
        journal = self.journal
        # Looked up before the rule for new ids: a request accepted under an older rule (a worker
        # that died before an upgrade) must still be served, or its session fails on every claim.
        record = journal.projection().request(request_id)
        if record is None and not queued:
            validate_id(request_id, name="request_id")
        self._check_open()
        if record is not None and record.state not in (RequestState.ACCEPTED, RequestState.STARTED):
            return record.state
        if record is None:
            self._queue.check_message(prompt, None)
        if self._queue.idle():  # (else it waits its turn: a kept request cannot run beside another)
            self._check_no_kept_request(request_id)
        request = _Request(prompt, sink, self._host.root, request_id=request_id)
        request.accepted_before = record is not None
        if record is not None and record.state is RequestState.STARTED:
            request.continuing = True
            request.turns_before = record.turns  # its turns go on numbering after the recorded ones
        try:
            await self._run_to_end(request, "serve_request() was cancelled")
        except TrioAgentError:
            if journal.lost or journal.fenced:
                raise
            # Otherwise it ended as the journal recorded it (failed, interrupted): read below.
        journal.check_ownership()  # LeaseLostError if the lease went meanwhile
        if journal.fenced:
            raise JournalFencedError(f"the end of request {request_id!r} may not be recorded: the journal is fenced")
        ended = journal.projection().request(request_id)
        return RequestState.ACCEPTED if ended is None else ended.state

    async def _serve_continuation(
        self, request_id: str, answers: Sequence[InterruptAnswer], sink: EventSink, *, accepted_before: bool
    ) -> tuple[RequestState, TrioAgentError | None]:
        """`resume` as request *request_id* (a worker's answers row, `serve_sessions`): the id of its
        ``request_accepted``, its ``interrupts_resolved.continuation_id`` and its end. Returns how the
        journal says it ended, with the error it ended with (answers the pause refused: ``failed``).
        Raises `InterruptResumeError` when nothing was written (not paused, not idle, bad answers),
        and, as `serve_request`, when the journal could not record the end."""
        request = self._continuation(answers)
        request.request_id = request_id
        request.sink = sink
        request.accepted_before = accepted_before  # accepted by an earlier holder: not again
        journal = self.journal
        error: TrioAgentError | None = None
        try:
            await self._run_to_end(request, "serving answers was cancelled")
        except TrioAgentError as exc:
            if journal.lost or journal.fenced:
                raise
            error = exc  # it ended as the journal recorded it (failed): read below
        journal.check_ownership()  # LeaseLostError if the lease went meanwhile
        if journal.fenced:
            raise JournalFencedError(f"the end of request {request_id!r} may not be recorded: the journal is fenced")
        ended = journal.projection().request(request_id)
        if ended is None:
            if error is not None:
                raise error  # refused before anything was written
            raise JournalError(f"the continuation {request_id!r} left nothing in the journal")
        return ended.state, error

    def _run_to_end(self, request: _Request, cancelled: str) -> Awaitable[None]:
        """Run *request* to its end (raising as `_Request.raise_if_failed` does if it failed): in
        the caller's task when the session is idle, else by the worker. A plain function: the
        caller awaits the coroutine that runs it, one coroutine level less per request in flight."""
        queue = self._queue
        if queue.runs_here():  # idle: the caller's task runs it, no hand-off to the worker
            return queue.run_here(request, self._host, self._cancelled_by)
        return self._run_queued(request, cancelled)

    async def _run_queued(self, request: _Request, cancelled: str) -> None:
        queue = self._queue
        await queue.accept(request, self._cancelled_by)
        try:
            await request.done.wait()
        finally:
            if not request.ended:
                with self._host.cleanup_scope():
                    await queue.abort_request(request, *self._abort_for(cancelled))
        request.raise_if_failed()

    def _cancelled_by(self) -> RequestInterruptReason:
        """Why a request run in its caller's task was cancelled: the session's end (closing, or its
        nursery cancelled, also from a scope around the session), or else its caller."""
        nursery = self._nursery
        if self._host.closing or nursery is None or cancelled_around(nursery.cancel_scope):
            return RequestInterruptReason.SESSION_CLOSE
        return RequestInterruptReason.USER_ABORT

    def _abort_for(self, message: str) -> tuple[AbortReason, str]:
        """The abort of a request whose caller left before it ended (cancelled, or a stream block
        left early): ``session_close`` when the session's end caused it, as for a request run in
        its caller's task (`_cancelled_by`), else ``user_abort`` with *message*."""
        if self._cancelled_by() is RequestInterruptReason.SESSION_CLOSE:
            return AbortReason.SESSION_CLOSE, "the session closed"
        return AbortReason.USER_ABORT, message

    @asynccontextmanager
    async def stream(
        self, prompt: str, *, priority: Priority | Literal["next", "now", "later"] | None = None
    ) -> AsyncIterator[SessionEventStream]:
        """``async with session.stream(prompt) as events: async for event in events``.

        Leaving the block before the request finished aborts it.
        """
        queue = self._queue
        queue.check_message(prompt, priority)
        self._check_open()
        send, recv = trio.open_memory_channel[SessionEvent](256)
        current = queue.joinable(priority)
        if current is not None:
            # Joins the running request at its next turn.
            queue.join(current, prompt, priority)
            stream = SessionEventStream(recv, current, joined=True)
            forward = EventForward(send, current.abort)
            # Calls already announced and still running are announced to this stream first (no
            # checkpoint until the tee below: nothing is missed or heard twice).
            forward.announce(current.running_calls)
            current.forwards += (forward,)
            current.sink = tee(current.sink, forward)
            try:
                async with recv:
                    yield stream
            finally:
                forward.closed = True
            return
        queue.check_not_busy(priority)
        if queue.idle():
            self._check_not_paused()
            self._check_no_kept_request()
        request = _Request(prompt, discard, self._host.root)
        request.priority = None if priority is None else Priority(priority)
        async with self._streamed(request, send, recv) as stream:
            yield stream

    @asynccontextmanager
    async def _streamed(
        self,
        request: _Request,
        send: trio.MemorySendChannel[SessionEvent],
        recv: trio.MemoryReceiveChannel[SessionEvent],
    ) -> AsyncIterator[SessionEventStream]:
        queue = self._queue
        forward = EventForward(send, request.abort)
        request.sink = forward
        request.forwards += (forward,)
        await queue.accept(request, self._cancelled_by)
        stream = SessionEventStream(
            recv, request, joined=False, aborter=functools.partial(queue.abort_request, request)
        )
        try:
            async with recv:
                yield stream
        finally:
            forward_sink = request.sink
            if isinstance(forward_sink, EventForward):
                forward_sink.closed = True
            if not request.ended:
                with self._host.cleanup_scope():
                    await queue.abort_request(request, *self._abort_for("the stream was closed early"))

    async def abort(self, reason: AbortReason | str = AbortReason.USER_ABORT, message: str = "aborted") -> None:
        """Abort the running request; returns after ``request_interrupted`` is durable.
        *reason* is ``user_abort``, ``steering`` or ``session_close`` (an `AbortReason` or its value);
        any other (``timeout`` and ``lease_lost`` are the SDK's own) raises `ConfigError`, also when idle."""
        reason = abort_reason(reason, message)
        current = self._queue.current
        if current is None or current.ended:
            await trio.lowlevel.checkpoint()
            return
        await self._queue.abort_request(current, reason, message)

    def subscribe_durable_events(
        self, *, agent_id: str | None = None, after: JournalCursor | str | int = 0
    ) -> AbstractAsyncContextManager[DurableEventStream]:
        """The journal's subscription for one agent's stream (the root's by default)."""
        return self.journal.subscribe_durable_events(agent_id=agent_id, after=after)

    # -- subagents

    async def start_subagent(self, name: str, prompt: str, *, parent_agent_id: str | None = None) -> SubagentHandle:
        """Start a background subagent in the session's nursery; returns its handle at once.

        Its start is recorded on the parent's stream under the running request, or,
        between requests, under a short request of its own. Under another agent than the
        root (``parent_agent_id``), only while that agent runs a request.
        """
        self._queue.check_message(prompt, None)  # as send(): a non-empty string, before anything is written
        self._check_open()
        supervisor = self._supervisor
        supervisor.definition(name)  # unknown names fail before anything is written
        root_id = self._host.root.agent_id
        parent = parent_agent_id or root_id
        if parent != root_id:
            return await self._start_under_agent(name, prompt, parent)
        current = self._queue.current
        while current is not None and not current.started and not current.ended:
            # Being accepted (a request run in its caller's task is current from before its
            # acceptance is written): it starts under that request, not after its end.
            await current.wait_started()
            self._check_open()
            current = self._queue.current
        if current is not None and current.started and not current.finishing:
            return await self._start_under(current, name, prompt, parent)
        # Between requests: a short request of its own holds the request slot meanwhile.
        try:
            async with self._queue.slot():
                return await self._start_between_requests(name, prompt, parent)
        except BaseExceptionGroup as group:
            raise_for_boundary(group)

    async def _start_under(self, request: _Request, name: str, prompt: str, parent: str) -> SubagentHandle:
        """Start it under *request*, which waits for the start to be recorded before it ends."""
        released = request.released
        if request.holds == 0 or released is None:
            released = request.released = trio.Event()
        request.holds += 1
        try:
            return await self._supervisor.spawn_background(name, prompt, parent, request.request_id, call_id=None)
        finally:
            request.holds -= 1
            if request.holds == 0:
                released.set()

    async def _start_under_agent(self, name: str, prompt: str, parent: str) -> SubagentHandle:
        """Start it under the request another agent (a subagent) runs now: its stream has no
        request slot, so a short request of its own could clash with the agent's next one."""
        if not isinstance(parent, str) or parent not in self.journal.agents:
            raise ConfigError(f"parent_agent_id {parent!r}: no agent of this session has that id")
        for (agent_id, _), request in self._host.running.items():
            if agent_id == parent and request.started and not request.finishing:
                return await self._start_under(request, name, prompt, parent)
        raise ConfigError(
            f"parent_agent_id {parent!r}: that agent runs no request now; a subagent is started under "
            "another agent only while it works (or under the root, which takes a request of its own)"
        )

    async def _start_between_requests(self, name: str, prompt: str, parent: str) -> SubagentHandle:
        self._check_open()  # again: the session may have closed while this waited for the slot
        self._check_no_kept_request()  # its short request could not start (before the hooks run)
        supervisor = self._supervisor
        # The SubagentStart hooks run before anything is journalled: a refusal writes nothing, and
        # a prompt they replace (redact) is never stored in its original form. The holder request
        # records only which subagent it started; its prompt is on the subagent's own stream.
        agent, prompt = await supervisor.prepare_background(name, prompt, parent)
        self._check_open()  # the hooks may have run into the close
        self._starting += 1
        try:
            return await self._run_holder(agent, prompt, name, parent)
        finally:
            self._starting -= 1
            settled = self._starts_settled
            if not self._starting and settled is not None:
                settled.set()

    async def _run_holder(self, agent: _Agent, prompt: str, name: str, parent: str) -> SubagentHandle:
        """The holder request of a start between requests, from its acceptance to its end."""
        holder = _Request(f"start subagent {name}", discard, self._host.root)
        try:
            # From the moment this append is submitted the holder request is open in the
            # projection: every way out below must end it, a cancellation included.
            await self.journal.append(
                RequestAccepted(
                    request_id=holder.request_id,
                    command_id=holder.request_id,
                    input={"start_subagent": name, "subagent_id": agent.agent_id},
                ),
                RequestStarted(request_id=holder.request_id),
                agent_id=parent,
            )
            handle = await self._supervisor.launch_background(agent, prompt, parent, holder.request_id, call_id=None)
            await self.journal.append(RequestCompleted(request_id=holder.request_id), agent_id=parent)
            return handle
        except BaseException as exc:
            if is_cancellation(exc):
                terminal: Any = RequestInterrupted(
                    request_id=holder.request_id, reason=RequestInterruptReason.USER_ABORT
                )
            else:
                terminal = RequestFailed(request_id=holder.request_id, error=ErrorInfo.of(exc))
            with self._host.cleanup_scope("recording an interrupted subagent start"):
                await record_request_end(self.journal, parent, holder.request_id, terminal)
            if self._refused_by_the_close(exc, parent):
                raise SessionClosedError("the session closed while the subagent was starting") from exc
            raise

    def _refused_by_the_close(self, exc: BaseException, agent_id: str) -> bool:
        """Whether *exc* is the journal refusing a write because the session closed meanwhile: its
        stream took its ``session_closed``, or its journal closed. The caller is told the session
        closed, as one that came a moment later is."""
        if not self._host.closing or not isinstance(exc, JournalError):
            return False
        if isinstance(exc, InvalidTransitionError):
            return self.journal.projection(agent_id).session_state is not SessionState.OPEN
        return type(exc) is JournalError and self.journal.closed

    async def run_foreground_subagent(self, name: str, prompt: str, ctx: ToolContext, sink: EventSink) -> str:
        """Run subagent *name* inside the calling tool's execution (what the ``task`` tool does)."""
        return await self._supervisor.run_foreground(name, prompt, ctx, sink)

    async def _rebuild_history(self, agent_id: str) -> list[Message]:
        """The conversation of *agent_id* as the journal tells it."""
        return await rebuild_history(self.journal, agent_id)

    # -- opening and closing

    async def _start(
        self, tools: Mapping[str, Tool[Any]], history: Sequence[Message] | None, *, keep_requests: bool = False
    ) -> None:
        """Begin this life of the session (`begin_life`), then the SessionStart hooks."""
        host = self._host
        life = await begin_life(
            host, tools, history, keep_requests=keep_requests, subagent_of=self._supervisor.recovered_agent
        )
        if keep_requests:  # what an earlier owner started and this life keeps (`_check_no_kept_request`)
            self._kept = self.journal.projection(host.root.agent_id)._s.active_request
        if life is not None:
            self.life, self.recovery = life.number, life.recovery
            if life.notes:
                self.recovery_notes.extend(life.notes)
        self._started = True
        if host.hooks.has_hooks(HookEvent.SESSION_START):
            decision = await host.dispatch(HookEvent.SESSION_START, host.root.agent_id)
            decision.raise_for_abort()
            if decision.context_text:
                host.context.append(decision.context_text)

    async def close(self, *, final: bool = False) -> None:
        """Close the session now (what leaving the block does). With ``final=True`` it is
        ended for good: reopening its id is refused. Otherwise a later
        ``open_session(session_id=...)`` continues the conversation in a new life.

        ``final=True`` (``end()``) after a close that was not final raises `SessionClosedError`:
        that close's ``session_closed`` is written, and a closed life takes no second one. During
        such a close (in another task) it waits for that close, then raises the same.

        Called from inside running work (a tool or a hook of the root's request or of a
        background subagent's), it returns at once: the close waits for that work's end, which
        waits for the caller. New messages are refused from then on, the work runs to its end,
        then the session closes in a task of its own."""
        working = working_for()
        if final and self._closed and not self._final:
            if self._closing and working is None:
                # A plain close runs in another task: its session_closed (not final) is on its way.
                # Wait for it as a second close() would, so the session is closed when this raises.
                await self._close(SessionCloseReason.COMPLETED)
            raise SessionClosedError(
                f"session {self.session_id!r} was already closed (not for good), so end() cannot end it "
                "for good now: end() it instead of closing it, or reopen it with "
                "open_session(session_id=...) and end() it there"
            )
        self._final = self._final or final
        if working is not None:
            self._close_after_request(working)
            await trio.lowlevel.checkpoint()
            return
        await self._close(SessionCloseReason.COMPLETED)

    def _close_after_request(self, request: _Request) -> None:
        """Close once *request* (running, and the caller works for it: the root's request or a
        background subagent's work) ended; refuse new messages now, and reject what is queued (as
        the close would) rather than start it."""
        if self._closed:
            return  # a close runs: it ends the request itself
        waiting = self._close_after
        if waiting is not None:
            # Asked already, from other work: the close waits for this work's end too (each caller
            # was promised its work runs to its end).
            waiting.add(request)
            return
        self._close_after = {request}
        self._queue.close()
        nursery = self._nursery
        assert nursery is not None  # a request runs: the session is open
        nursery.start_soon(self._close_when_done, name="trio_agent.session.close_after_request")

    async def _close_when_done(self) -> None:
        waiting = self._close_after
        assert waiting is not None
        while waiting:
            request = next(iter(waiting))
            await request.done.wait()
            waiting.discard(request)
        try:
            await self._close(SessionCloseReason.COMPLETED)
        except InvalidTransitionError as exc:
            # Nobody awaits this close to raise it to: the refused session_closed is left to recovery.
            _log.warning("the close asked for from inside a request could not record its end: %s", exc)

    async def end(self) -> None:
        """End the session for good now: ``close(final=True)`` (`SessionClosedError` after a plain close)."""
        await self.close(final=True)

    async def _close(self, reason: SessionCloseReason, *, journal_closes: bool = False) -> None:
        """End the session's life: every request, call and subagent closed, then one
        ``session_closed`` per stream that has nothing open. Bounded by ``close_timeout``.

        ``journal_closes``: the journal's block is left next (`open_session`'s way out), so the
        ``session_closed`` events are deferred to its close, which writes them in one
        transaction with the lease's release."""
        if self._closed:
            if not self._closing:
                await trio.lowlevel.checkpoint()
                return
            # Another task is closing: this close (the block's way out, maybe cancelled) returns
            # once that one is done, or the journal would be closed under it.
            done = self._close_done
            if done is None:
                done = self._close_done = trio.Event()
            with bounded_shield(
                self.close_timeout, "waiting for the session's close in another task", bound="close_timeout"
            ):
                await done.wait()
            return
        self._closed = self._closing = True
        final = self._final  # fixed now: every stream's session_closed says the same
        # Stays None when the close overran close_timeout: what was not done by then is abandoned
        # (logged by the shield; what is left open is recovery's on reopen), nothing is raised.
        refused: InvalidTransitionError | None = None
        try:
            self._host.closing = True
            queue = self._queue
            queue.close()
            if self._close_may_wait(queue):
                with bounded_shield(self.close_timeout, "closing the session", bound="close_timeout"):
                    refused = await self._close_steps(queue, reason, final, journal_closes)
            else:
                # Nothing below reaches a checkpoint: a shield (a cancel scope) would guard nothing.
                refused = await self._close_steps(queue, reason, final, journal_closes)
        finally:
            self._closing = False
            if self._close_done is not None:
                self._close_done.set()
        if refused is not None:
            raise refused

    def _close_may_wait(self, queue: RequestQueue) -> bool:
        """Whether closing may reach a checkpoint: a request runs or waits, a subagent or a
        SessionEnd hook runs, or the journal's appends may wait for their commit."""
        journal = self.journal
        return (
            not queue.settled()
            or self._starting > 0
            or bool(self._supervisor.subagents)
            or (self._started and self._host.hooks.has_hooks(HookEvent.SESSION_END))
            # Only the class itself is trusted to say so: a subclass may add awaits.
            or type(journal) is not DurableJournal
            or not journal.never_blocks
        )

    async def _close_steps(
        self, queue: RequestQueue, reason: SessionCloseReason, final: bool, journal_closes: bool
    ) -> InvalidTransitionError | None:
        """Stop what runs, then one ``session_closed`` per stream with nothing open; returns the
        first refusal of one (raised once the rest is done)."""
        refused: InvalidTransitionError | None = None
        current = queue.current
        if current is not None and not current.ended:
            await queue.abort_request(current, AbortReason.SESSION_CLOSE, "the session is closing")
        # The worker rejects what is still queued; requests accepted meanwhile record themselves.
        await queue.drain()
        while self._starting:  # a start between requests ends its holder request (the close failed it)
            settled = self._starts_settled = trio.Event()
            await settled.wait()
        await self._supervisor.close()
        if self._started:  # SessionEnd pairs with a SessionStart that ran
            with contextlib.suppress(TrioAgentError):
                await self._host.dispatch(HookEvent.SESSION_END, self._host.root.agent_id, reason=reason.value)
        journal = self.journal
        if journal.lost or journal.fenced:
            return refused
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
            closed = SessionClosed(session_id=self.session_id, reason=reason, final=final)
            try:
                if journal_closes:
                    journal.defer(closed, agent_id=agent_id)
                else:
                    await journal.append(closed, agent_id=agent_id)
            except InvalidTransitionError as exc:
                refused = refused or exc
            except (JournalError, LeaseLostError) as exc:
                _log.warning("could not record the close of agent %s: %s", agent_id, exc)
                break
        return refused


def _reply(request: _Request) -> str:
    """A request's answer: its text, or a `PausedReply` if it ended paused."""
    return request.text if request.paused is None else PausedReply(request.text, request.paused)
