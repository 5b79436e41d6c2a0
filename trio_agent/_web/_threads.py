"""Web threads backed by durable sessions: a thread id is a session id.

Rules
=====

* The hub lives for the app (its lifespan): it opens a thread's session on first use
  (``open_session(spec, journal=store, session_id=thread_id)``; the app's default
  spec asks for permissions with pauses, ``permission_asks="interrupt"``) in a task
  of its own nursery and keeps it open until
  the app stops, when every session closes cleanly (a reopen later goes on with the
  conversation).
* A run on a thread is the session's request, driven by a task of the hub, never by
  the HTTP request: a client that disconnects only detaches. Its AG-UI frames are kept
  in a `LiveRun` (the run's frames so far, and who waits for more), so a client that
  comes back (or a second tab) replays them and then follows live. One run per thread
  at a time; the previous run's frames are dropped when the next starts.
* What outlives a run is the session's: ``GET /threads/{id}`` starts with a
  ``MESSAGES_SNAPSHOT`` of the session's conversation (read from the journal after a
  restart), then, while a run is live, its frames; a paused thread says so with a
  ``CUSTOM`` ``trio_agent.thread_paused`` event carrying the interrupts.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from .._abort import AbortReason
from .._agui._encode import interrupt_to_agui
from .._agui._session_encode import SessionAgUiEncoder
from .._agui._sse import sse_event
from .._agui._wire import CustomEvent, RunErrorEvent, to_wire
from .._errors import RequestAbortedError, TrioAgentError
from .._session._open import open_session
from .._session._session import Session
from .._session._spec import AgentSpec

__all__ = ["THREAD_PAUSED", "LiveRun", "ThreadHub"]

THREAD_PAUSED = "trio_agent.thread_paused"


class LiveRun:
    """One run's frames, in order, and a wake-up for those who follow it."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.frames: list[bytes] = []
        self.done = False
        self._changed = trio.Event()

    def add(self, frame: bytes) -> None:
        self.frames.append(frame)
        self._changed.set()
        self._changed = trio.Event()

    def finish(self) -> None:
        self.done = True
        self._changed.set()

    async def changed(self) -> None:
        await self._changed.wait()


class _Thread:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.live: LiveRun | None = None


class ThreadHub:
    """The sessions of the app's threads (see the module rules); made by the app's lifespan."""

    def __init__(self, spec: AgentSpec, journal: Any, nursery: trio.Nursery) -> None:
        self.spec = spec
        self.journal = journal
        self.nursery = nursery
        self._threads: dict[str, _Thread] = {}
        self._opening: dict[str, trio.Event] = {}
        self._failures: dict[str, BaseException] = {}
        self._closing = trio.Event()

    async def thread(self, thread_id: str) -> _Thread:
        """The thread's open session (opened now if needed); its error if it cannot be opened."""
        while thread_id not in self._threads:
            opening = self._opening.get(thread_id)
            if opening is None:
                opening = self._opening[thread_id] = trio.Event()
                self._failures.pop(thread_id, None)
                self.nursery.start_soon(self._keep, thread_id, opening)
            await opening.wait()
            failure = self._failures.pop(thread_id, None)
            if failure is not None:
                raise failure
        return self._threads[thread_id]

    async def _keep(self, thread_id: str, opening: trio.Event) -> None:
        try:
            async with open_session(self.spec, journal=self.journal, session_id=thread_id) as session:
                self._threads[thread_id] = _Thread(session)
                del self._opening[thread_id]
                opening.set()
                await self._closing.wait()
                thread = self._threads.pop(thread_id)
                if thread.live is not None and not thread.live.done:
                    await session.abort(AbortReason.SESSION_CLOSE, "the server is stopping")
        except Exception as exc:  # the request that asked gets it; the app goes on
            if not opening.is_set():
                self._failures[thread_id] = exc
                self._opening.pop(thread_id, None)
                opening.set()
            else:
                raise

    def close(self) -> None:
        """Close every session (the app is stopping)."""
        self._closing.set()

    def start_run(
        self,
        thread: _Thread,
        thread_id: str,
        run_id: str,
        open_stream: Callable[[Session], Any],
        on_done: Callable[[], object],
    ) -> LiveRun:
        live = LiveRun(run_id)
        thread.live = live
        self.nursery.start_soon(self._drive, thread, thread_id, live, open_stream, on_done)
        return live

    async def _drive(
        self,
        thread: _Thread,
        thread_id: str,
        live: LiveRun,
        open_stream: Callable[[Session], Any],
        on_done: Callable[[], object],
    ) -> None:
        session = thread.session
        encoder = SessionAgUiEncoder(thread_id=thread_id, run_id=live.run_id, root_agent_id=session.root_agent_id)
        for event in encoder.start():
            live.add(sse_event(to_wire(event)))
        try:
            async with open_stream(session) as events:
                async for event in events:
                    for out in encoder.encode(event):
                        live.add(sse_event(to_wire(out)))
        except RequestAbortedError as exc:
            for out in encoder.aborted(str(exc)):
                live.add(sse_event(to_wire(out)))
        except TrioAgentError as exc:
            code = getattr(exc, "code", None) or "run_failed"
            live.add(sse_event(to_wire(RunErrorEvent(message=str(exc), code=str(code)))))
        finally:
            live.finish()
            on_done()

    def paused_frame(self, thread: _Thread) -> bytes | None:
        """A ``CUSTOM`` frame with the paused run's interrupts, if the thread's session is paused."""
        paused = thread.session.paused
        if paused is None:
            return None
        interrupts = [to_wire(interrupt_to_agui(interrupt)) for interrupt in paused.state.interrupts]
        return sse_event(to_wire(CustomEvent(name=THREAD_PAUSED, value={"interrupts": interrupts})))


@contextlib.asynccontextmanager
async def open_hub(spec: AgentSpec, journal: Any) -> AsyncIterator[ThreadHub]:
    async with trio.open_nursery() as nursery:
        hub = ThreadHub(spec, journal, nursery)
        try:
            yield hub
        finally:
            hub.close()
