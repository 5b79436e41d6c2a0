"""A request's events as its caller reads them: sinks, and `SessionEventStream`.

Rules
=====

* Every request has one event sink; ``send()`` discards, ``stream()`` forwards
  into a bounded channel (backpressure), a message that joins a running request
  tees a second channel onto it.
* A forward never blocks once the request is aborted: the reader may be the very
  task waiting in ``abort()`` (or ``close()``, which aborts it), so a full channel
  then drops events, and the end of the stream is signalled by closing the channel.
  A send already waiting on a full channel when the abort comes is woken and drops
  its event too, the request's final `DoneEvent` included.
* A stream ends at the request's `DoneEvent`, or when its channel closes; either
  way the reader learns a failure from the request itself (`RequestEnding`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import trio

from .._abort import AbortHandle, AbortReason, abort_reason
from .._reader_wait import waiting_for_reader
from ._messages import DoneEvent, SessionEvent, ToolUseEvent

__all__ = ["EventForward", "EventSink", "RequestEnding", "SessionEventStream", "discard", "tee"]

EventSink = Callable[[SessionEvent], Awaitable[None]]


async def discard(event: SessionEvent) -> None:
    return None


class EventForward:
    """An event sink into a bounded channel; drops events once its reader left (module rules)."""

    def __init__(self, send: trio.MemorySendChannel[SessionEvent], abort: AbortHandle | None = None) -> None:
        self.send = send
        self.abort = abort
        self.closed = False

    async def __call__(self, event: SessionEvent) -> None:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return
        try:
            # What trio's own send() does while the channel has room: no cancel scope per event.
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                self.send.send_nowait(event)
            except trio.WouldBlock:
                await self._send_unless_aborted(event)
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = True
        if isinstance(event, DoneEvent):
            self.close_now()
            await trio.lowlevel.checkpoint()

    async def _send_unless_aborted(self, event: SessionEvent) -> None:
        """Wait for room for *event*, unless the request is (or gets) aborted: then drop it. The
        wait is the reader's: a model call streaming meanwhile, or a tool whose progress it is,
        holds its deadline."""
        abort = self.abort
        if abort is None:
            with waiting_for_reader():
                await self.send.send(event)
            return
        with waiting_for_reader(), trio.CancelScope() as waiting:
            # An abort from any task (the reader's own abort(), a close) wakes the waiting send.
            token = abort.add_listener(lambda _abort: waiting.cancel())
            try:
                await self.send.send(event)
            finally:
                abort.remove_listener(token)

    def announce(self, running: Mapping[str, ToolUseEvent] | None) -> None:
        """Tell a stream that joins a request of the calls that run (their `ToolUseEvent` s),
        into its channel before anything else; its fresh channel has room for them."""
        if running:
            for use in running.values():
                with contextlib.suppress(trio.WouldBlock):
                    self.send.send_nowait(use)

    def close_now(self) -> None:
        """End the stream (the reader sees the end and learns the outcome from the request)."""
        self.closed = True
        self.send.close()


def tee(first: EventSink, second: EventSink) -> EventSink:
    async def both(event: SessionEvent) -> None:
        await first(event)
        await second(event)

    return both


class RequestEnding(Protocol):
    """What a stream needs of its request: when it is done, and its failure."""

    @property
    def done(self) -> trio.Event: ...

    def raise_if_failed(self) -> None: ...


class SessionEventStream:
    """What ``async with session.stream(prompt) as events`` gives: ``async for event in events``
    yields the request's `SessionEvent` s up to its `DoneEvent`.

    ``text`` is the final answer once the `DoneEvent` arrived (``done``); ``joined`` says
    whether the prompt joined a request that was already running. A failed or aborted
    request raises its error (a `TrioAgentError`) at the end of the iteration.
    """

    def __init__(
        self,
        recv: trio.MemoryReceiveChannel[SessionEvent],
        request: RequestEnding,
        *,
        joined: bool,
        aborter: Callable[[AbortReason, str], Awaitable[None]] | None = None,
    ) -> None:
        self._recv = recv
        self.request = request
        self.joined = joined
        self.text = ""
        self.done: DoneEvent | None = None
        self._aborter = aborter

    async def abort(self, message: str = "aborted", reason: AbortReason | str = AbortReason.USER_ABORT) -> None:
        """Abort this stream's request (queued or running; returns once its end is durable). A stream
        that joined another request's turn aborts nothing: that request is not its own. *reason*
        is an `AbortReason` or its value, as for ``session.abort`` (``timeout`` and ``lease_lost`` are
        the SDK's own); a bad one raises `ConfigError`."""
        checked = abort_reason(reason, message)
        if self._aborter is None or self.request.done.is_set():
            await trio.lowlevel.checkpoint()
            return
        await self._aborter(checked, message)

    def __aiter__(self) -> SessionEventStream:
        return self

    async def __anext__(self) -> SessionEvent:
        if self.done is not None:
            raise StopAsyncIteration
        try:
            event = await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            await self.request.done.wait()
            self.request.raise_if_failed()
            raise StopAsyncIteration from None
        if isinstance(event, DoneEvent):
            self.done = event
            self.text = event.text
            if event.stop_reason in ("error", "aborted"):
                await self.request.done.wait()
                self.request.raise_if_failed()
        return event
