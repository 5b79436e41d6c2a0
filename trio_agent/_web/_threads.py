"""Web threads backed by durable sessions: a thread id is a session id.

Rules
=====

* The hub lives for the app (its lifespan): it opens a thread's session on first use
  (``open_session(spec, journal=store, session_id=thread_id)``; the app's default
  spec asks for permissions with pauses, ``permission_asks="interrupt"``) in a task
  of its own nursery. At most ``max_threads`` sessions stay open once idle (no live run,
  no request using it): past that, the least recently used idle thread is closed when
  another opens and whenever a thread becomes idle (its run ends, its last request
  leaves), so while more are busy more are open, and they close as they go idle
  (cleanly: it reopens from the journal when next used; a request for a thread that is
  closing waits for its session to close, then reopens it, and is never handed a
  session that is closing). A busy thread is never closed to make room. When the app
  stops, every session closes cleanly.
* A run on a thread is the session's request, driven by a task of the hub, never by
  the HTTP request: a client that disconnects only detaches. A new prompt's request id
  in the journal is the run's id (`Session.serve_request`: at most once), so the journal
  knows every run id a thread ran, across runs and restarts; a continuation (``resume``)
  answers its pause, which the journal accepts once. Its AG-UI frames are kept
  in a `LiveRun` (the run's frames so far, at most `RUN_BYTES` of them: past that the
  oldest are dropped), so a client that comes back (or a second tab) replays them from
  the run's start and then follows live. The run never waits for a client: one that
  reads so slowly that frames it has not read yet are dropped is told so (``RUN_ERROR``
  ``fell_behind``: reload the thread) and its stream ends, never with a hole in it; so
  is one that comes after the run's first frames were dropped (a replay is never
  partial: a run's stream without its ``RUN_STARTED`` is no AG-UI run). One
  run per thread at a time; the previous run's frames are dropped when the next starts.
* Stopping a run is a request on the run, not on the session: it takes effect as soon
  as the run's request is open (a stop that comes first waits for it), and never
  reaches another run.
* What outlives a run is the session's: ``GET /threads/{id}`` starts with a
  ``MESSAGES_SNAPSHOT`` of the session's conversation as it was before a live run (the
  live run's own events follow, replayed), read from the journal after a restart; a
  paused thread says so with a ``CUSTOM`` ``trio_agent.thread_paused`` event carrying
  the interrupts.
* A failure inside one thread (its session, its run) is logged and reported on that
  thread only (``RUN_ERROR``, or the thread closes); it never stops the hub.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import trio

from .._abort import AbortReason
from .._agui._encode import interrupt_to_agui
from .._agui._session_encode import SessionAgUiEncoder
from .._agui._sse import sse_event
from .._agui._wire import AgUiEvent, CustomEvent, RunErrorEvent, RunFinishedEvent, to_wire
from .._errors import RequestAbortedError, SessionClosedError, TrioAgentError, error_code
from .._journal._projection import RequestState
from .._loop._interrupts import InterruptAnswer
from .._loop._rules import StopReason
from .._session._messages import DoneEvent, SessionEvent
from .._session._open import open_session
from .._session._session import Session
from .._session._spec import AgentSpec
from .._session._stream import EventSink, SessionEventStream
from .._util import describe

__all__ = ["RUN_BYTES", "THREAD_PAUSED", "LiveRun", "ThreadHub", "open_hub"]

THREAD_PAUSED = "trio_agent.thread_paused"
RUN_BYTES = 16 * 1024 * 1024
"""The frames of one live run kept for a replay."""

logger = logging.getLogger("trio_agent.web")


class LiveRun:
    """One run's frames, in order (a window of them: see `RUN_BYTES`), and a wake-up for those
    who follow it. Positions are absolute: frame ``n`` is the run's ``n``-th, whatever was dropped.
    The window slides whoever follows (the run never waits for a reader): `since` says when a
    reader's next frame is gone."""

    def __init__(self, run_id: str, history_len: int, *, max_bytes: int = RUN_BYTES) -> None:
        self.run_id = run_id
        self.history_len = history_len  # the session's messages before this run
        self.input: object = None  # what the run was asked (its prompt or answers): a retry asks the same
        self.done = False
        self._frames: collections.deque[bytes] = collections.deque()
        self._first = 0  # the position of the oldest frame kept
        self._bytes = 0
        self._max_bytes = max_bytes
        self._changed = trio.Event()
        self._stop_requested = False
        self._stop: Callable[[], None] | None = None

    @property
    def first(self) -> int:
        """The position of the oldest frame kept: past 0, the run can no longer be replayed."""
        return self._first

    @property
    def end(self) -> int:
        return self._first + len(self._frames)

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def since(self, position: int) -> tuple[list[bytes], int] | None:
        """The frames from ``position`` on and the end; ``None`` if the frame at ``position`` was
        dropped already (its reader fell behind: it could only go on with a hole)."""
        if position < self._first:
            return None
        # Only the frames after ``position``, read from the end: a follower that keeps up wakes
        # once per frame, and copying the whole window each time made following a run quadratic.
        new = list(itertools.islice(reversed(self._frames), max(self.end - position, 0)))
        new.reverse()
        return new, self.end

    def add(self, frame: bytes) -> None:
        self._frames.append(frame)
        self._bytes += len(frame)
        while self._bytes > self._max_bytes and len(self._frames) > 1:
            self._bytes -= len(self._frames.popleft())
            self._first += 1
        self._changed.set()
        self._changed = trio.Event()

    def finish(self) -> None:
        self.done = True
        self._stop = None
        self._changed.set()

    async def changed(self) -> None:
        await self._changed.wait()

    def request_stop(self) -> None:
        """Stop this run: now if its request is open, else as soon as it opens; never after it ended."""
        if self.done:
            return
        self._stop_requested = True
        if self._stop is not None:
            self._stop()

    def stoppable(self, stop: Callable[[], None]) -> None:
        """The run's request is open: ``stop`` stops it (at once, if a stop was asked for before)."""
        self._stop = stop
        if self._stop_requested:
            stop()


RunWork = Callable[[Session, EventSink, LiveRun], Awaitable[RequestState | None]]
"""What a run does on its thread's session: its request's events into the sink, the run made
stoppable (`LiveRun.stoppable`) once its request is open; its state if it ran one to its end,
or the request's error raised."""


class _Thread:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.live: LiveRun | None = None
        self.closing = trio.Event()  # asked to close (to make room, or the app stops)
        self.closed = trio.Event()  # its session closed: the thread may be opened again

    @property
    def busy(self) -> bool:
        return self.live is not None and not self.live.done


class ThreadHub:
    """The sessions of the app's threads (see the module rules); made by the app's lifespan."""

    def __init__(self, spec: AgentSpec, journal: Any, nursery: trio.Nursery, *, max_threads: int = 256) -> None:
        self.spec = spec
        self.journal = journal
        self.nursery = nursery
        self.max_threads = max_threads
        self.run_bytes = RUN_BYTES  # what each live run keeps for replays (see `LiveRun`)
        self._threads: collections.OrderedDict[str, _Thread] = collections.OrderedDict()
        self._opening: dict[str, trio.Event] = {}
        self._failures: dict[str, BaseException] = {}
        self._users: collections.Counter[str] = collections.Counter()  # requests opening or using a thread
        self._closed = False

    @contextlib.asynccontextmanager
    async def use(self, thread_id: str) -> AsyncIterator[_Thread]:
        """The thread with its session open for the block (opened now if needed); its error if it
        cannot be opened. No other request closes it to make room while the block runs."""
        self._users[thread_id] += 1
        try:
            yield await self._open(thread_id)
        finally:
            self._users[thread_id] -= 1
            if not self._users[thread_id]:
                del self._users[thread_id]
                self._make_room(0)  # it may be idle now: past max_threads, the least recently used idle go

    async def _open(self, thread_id: str) -> _Thread:
        while True:
            if self._closed:
                raise SessionClosedError(f"the server is stopping: thread {thread_id!r} cannot be opened")
            thread = self._threads.get(thread_id)
            if thread is not None and not thread.closing.is_set():
                self._threads.move_to_end(thread_id)
                return thread
            if thread is not None:  # its session is closing: once it has closed, it opens again
                await thread.closed.wait()
                continue
            opening = self._opening.get(thread_id)
            if opening is None:
                self._make_room(1)
                opening = self._opening[thread_id] = trio.Event()
                self._failures.pop(thread_id, None)
                self.nursery.start_soon(self._keep, thread_id, opening)
            await opening.wait()
            failure = self._failures.pop(thread_id, None)
            if failure is not None:
                raise failure

    def _make_room(self, more: int) -> None:
        """Close the least recently used idle threads until ``more`` threads more fit under
        ``max_threads`` (idle: no live run and no request opening or using it), as far as idle
        ones allow: a busy thread is never closed for room."""
        idle = [
            tid
            for tid, thread in self._threads.items()
            if not thread.busy and not thread.closing.is_set() and not self._users.get(tid)
        ]
        open_count = sum(1 for thread in self._threads.values() if not thread.closing.is_set())
        for thread_id in idle[: max(open_count + len(self._opening) + more - self.max_threads, 0)]:
            self._threads[thread_id].closing.set()

    async def _keep(self, thread_id: str, opening: trio.Event) -> None:
        thread: _Thread | None = None
        try:
            async with open_session(self.spec, journal=self.journal, session_id=thread_id) as session:
                thread = self._threads[thread_id] = _Thread(session)
                del self._opening[thread_id]
                opening.set()
                if self._closed:  # the app stopped while it opened
                    thread.closing.set()
                await thread.closing.wait()
                if thread.busy:
                    await session.abort(AbortReason.SESSION_CLOSE, "the server is stopping")
        except Exception as exc:  # this thread's failure: the request that asked gets it, the app goes on
            if not opening.is_set():
                self._failures[thread_id] = exc
                self._opening.pop(thread_id, None)
                opening.set()
            else:
                logger.exception("thread %r closed after an error", thread_id)
        finally:
            if thread is not None:
                if self._threads.get(thread_id) is thread:
                    del self._threads[thread_id]
                thread.closed.set()

    def close(self) -> None:
        """Close every session (the app is stopping)."""
        self._closed = True
        for thread in self._threads.values():
            thread.closing.set()

    def start_request(
        self, thread: _Thread, thread_id: str, run_id: str, prompt: str, on_done: Callable[[], object]
    ) -> LiveRun:
        """Run ``prompt`` on the thread as the session's request ``run_id`` (at most once: the
        journal records it under that id; see `Session.serve_request`)."""

        async def serve(session: Session, sink: EventSink, live: LiveRun) -> RequestState:
            # The session's root requests are this thread's runs, one at a time: while this one
            # is in flight (from here until `live.finish`, with no checkpoint before
            # serve_request takes the session's request slot), the session's current request is
            # this run's, so a session abort stops this run and no other.
            live.stoppable(functools.partial(self.nursery.start_soon, _stop_request, session, live))
            return await session.serve_request(run_id, prompt, sink=sink)

        return self.start_run(thread, thread_id, run_id, serve, on_done)

    def start_resume(
        self,
        thread: _Thread,
        thread_id: str,
        run_id: str,
        answers: Sequence[InterruptAnswer],
        on_done: Callable[[], object],
    ) -> LiveRun:
        """Answer the thread's paused request (its pause is answered once: the journal refuses a second)."""

        async def resume(session: Session, sink: EventSink, live: LiveRun) -> None:
            async with session.resume_stream(answers) as events:
                live.stoppable(lambda: self.nursery.start_soon(_abort, events, live.run_id))
                async for event in events:
                    await sink(event)

        return self.start_run(thread, thread_id, run_id, resume, on_done)

    def start_run(
        self, thread: _Thread, thread_id: str, run_id: str, work: RunWork, on_done: Callable[[], object]
    ) -> LiveRun:
        live = LiveRun(run_id, len(thread.session.messages()), max_bytes=self.run_bytes)
        thread.live = live
        self.nursery.start_soon(self._drive, thread, thread_id, live, work, on_done)
        return live

    async def _drive(
        self, thread: _Thread, thread_id: str, live: LiveRun, work: RunWork, on_done: Callable[[], object]
    ) -> None:
        session = thread.session
        encoder = SessionAgUiEncoder(thread_id=thread_id, run_id=live.run_id, root_agent_id=session.root_agent_id)
        ended = False  # the run's last frame (RUN_FINISHED or RUN_ERROR) was added

        def add(events: Iterable[AgUiEvent]) -> None:
            nonlocal ended
            for out in events:
                live.add(sse_event(to_wire(out)))
                ended = ended or isinstance(out, (RunFinishedEvent, RunErrorEvent))

        async def sink(event: SessionEvent) -> None:
            # Called by the request itself: never waits (the run never waits for a client) and
            # never raises into it; an event it cannot write ends the stream and stops the run.
            if ended:
                return
            try:
                add(_encode(encoder, event))
            except Exception as exc:
                logger.exception("writing an event of run %r of thread %r failed", live.run_id, thread_id)
                add([RunErrorEvent(message=f"the run failed: {describe(exc)}", code="run_failed")])
                live.request_stop()

        add(encoder.start())
        try:
            state = await work(session, sink, live)
            if not ended:  # a request stopped before it started ends without a DoneEvent
                if state in (None, RequestState.INTERRUPTED):
                    add(encoder.aborted())
                else:
                    add(encoder.failed(f"the run's request ended {state.value} without its end", "run_failed"))
        except Exception as exc:  # the run's end is this run's: reported on its stream, the hub goes on
            if ended:  # its end was reported; this came after it (its end's write was refused, ...)
                logger.warning("run %r of thread %r: %s", live.run_id, thread_id, exc)
            elif isinstance(exc, RequestAbortedError) and exc.reason != "error":
                add(encoder.aborted())  # stopped (by the client, the server stopping ...): cancelled
            else:  # failed, also a request the session ended because it failed: an error, with its reason
                if not isinstance(exc, TrioAgentError):
                    logger.exception("run %r of thread %r failed", live.run_id, thread_id)
                add(encoder.failed(describe(exc, "text"), error_code(exc) or "run_failed"))
        finally:
            live.finish()
            on_done()
            self._make_room(0)  # the thread may be idle now: past max_threads, the least recently used idle go

    def paused_frame(self, thread: _Thread) -> bytes | None:
        """A ``CUSTOM`` frame with the paused run's interrupts, if the thread's session is paused."""
        paused = thread.session.paused
        if paused is None:
            return None
        interrupts = [to_wire(interrupt_to_agui(interrupt)) for interrupt in paused.state.interrupts]
        return sse_event(to_wire(CustomEvent(name=THREAD_PAUSED, value={"interrupts": interrupts})))


def _encode(encoder: SessionAgUiEncoder, event: object) -> list[AgUiEvent]:
    """*event* as AG-UI events. A request's ``DoneEvent`` with an error (what `Session.serve_request`
    sends where a stream raises instead) ends the run as the stream's error would: an abort is
    ``cancelled``, a failure ``RUN_ERROR`` with its message and code (``run_failed`` when it has none)."""
    if isinstance(event, DoneEvent) and event.error is not None:
        if event.stop_reason is StopReason.ABORTED:
            return encoder.aborted()
        return encoder.failed(event.error, event.error_code or "run_failed")
    return encoder.encode(event)


async def _stop_request(session: Session, live: LiveRun) -> None:
    """Stop the thread's request in flight, the run's (see `ThreadHub.start_request`)."""
    if live.done:  # ended meanwhile: whatever the session runs now is not this run
        return
    try:
        await session.abort(AbortReason.USER_ABORT, "stopped by the client")
    except Exception:  # a stop that failed is logged; it never takes the hub down
        logger.exception("stopping run %r failed", live.run_id)


async def _abort(events: SessionEventStream, run_id: str) -> None:
    try:
        await events.abort("stopped by the client")
    except Exception:  # a stop that failed is logged; it never takes the hub down
        logger.exception("stopping run %r failed", run_id)


@contextlib.asynccontextmanager
async def open_hub(spec: AgentSpec, journal: Any, *, max_threads: int = 256) -> AsyncIterator[ThreadHub]:
    async with trio.open_nursery() as nursery:
        hub = ThreadHub(spec, journal, nursery, max_threads=max_threads)
        try:
            yield hub
        finally:
            hub.close()
