"""Durable-event subscriptions: replay to the head, one caught-up marker, then live events.

Pull-based: the subscriber reads committed events from the store when it asks
for the next one, so a slow subscriber never holds up a commit and never sees
an uncommitted event. It is an iterator object, not an async generator, so no
cancel scope or nursery is ever suspended across a ``yield``.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from .._errors import ConfigError, CursorError, JournalCorruptError, JournalError
from ._events import EventEnvelope, SessionClosed
from ._store import JournalStore, check_id

__all__ = [
    "CaughtUp",
    "DurableEvent",
    "DurableEventStream",
    "JournalCursor",
    "SubscriptionsClose",
    "journal_subscription",
    "subscribe_durable_events",
]

# ASCII digits only (``\d`` takes others, which int() reads), at most 19 (a seq is a 64-bit
# integer; more is no seq, and many more trip int()'s digit limit with a bare ValueError).
# DOTALL: a stream id may hold a newline (`check_id` takes it), and its cursor must read back.
_CURSOR = re.compile(r"(?P<stream>.+)@(?P<seq>[0-9]{1,19})", re.ASCII | re.DOTALL)


@attrs.frozen
class JournalCursor:
    """A position in one stream: everything up to and including ``seq`` was seen.

    ``str(cursor)`` is ``"<stream_id>@<seq>"`` and `JournalCursor.parse` reads it back,
    so a cursor can be stored anywhere a string can.
    """

    stream_id: str
    seq: int

    def __str__(self) -> str:
        return f"{self.stream_id}@{self.seq}"

    @classmethod
    def parse(cls, text: str) -> JournalCursor:
        match = _CURSOR.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            shown = text if not isinstance(text, str) or len(text) <= 200 else f"{text[:200]}..."
            raise CursorError(f"not a journal cursor: {shown!r} (expected '<stream_id>@<seq>', seq 1-19 ASCII digits)")
        return cls(match["stream"], int(match["seq"]))


@attrs.frozen
class DurableEvent:
    """One committed event, and the cursor to resume after it."""

    envelope: EventEnvelope

    @property
    def cursor(self) -> JournalCursor:
        return JournalCursor(self.envelope.stream_id, self.envelope.seq)


@attrs.frozen
class CaughtUp:
    """Sent once, when the replay reached the head; live events follow."""

    cursor: JournalCursor


class DurableEventStream:
    """The async iterator of a subscription (see `subscribe_durable_events`)."""

    def __init__(
        self, store: JournalStore, stream_id: str, after: int, *, page_size: int, closed: trio.Event | None
    ) -> None:
        self._store = store
        self.stream_id = stream_id
        self._opened_at = after
        self._seq = after  # the last event delivered
        self._read_to = after  # the last event read (delivered or in the buffer)
        self._page_size = page_size
        self._closed = closed
        self._buffer: deque[EventEnvelope] = deque()
        self._caught_up = False
        self._ended = False
        # The event at the cursor is a `session_closed`: the stream ends there if nothing follows
        # it (a reopened session goes on after it with `session_reopened`).
        self._closed_at_cursor = False
        # `SubscriptionsClose`: whether the journal's close read everything committed into the
        # buffer, or the error that stopped it. Only a stream handed its rest may end at a failed read.
        self._handed_over = False
        self._handover_error: JournalError | None = None

    @property
    def cursor(self) -> JournalCursor:
        return JournalCursor(self.stream_id, self._seq)

    def __aiter__(self) -> DurableEventStream:
        return self

    async def __anext__(self) -> DurableEvent | CaughtUp:
        while True:
            if self._buffer:
                envelope = self._buffer.popleft()
                self._seq = envelope.seq
                self._closed_at_cursor = isinstance(envelope.event, SessionClosed)
                return DurableEvent(envelope)
            if self._ended:
                raise StopAsyncIteration
            # Seen before the read: an event committed while the read ran (then the close) is read
            # next time round, never lost to a close that the read's answer did not include.
            closed_before = self._closed is not None and self._closed.is_set()
            try:
                rows = await self._read_page()
            except JournalCorruptError:
                raise  # damage is never an end, closed or not
            except JournalError as exc:
                if self._closed is None or not self._closed.is_set():
                    raise
                if not self._handed_over:
                    raise self._unfinished(exc)  # noqa: B904 - its own cause is set there
                # The session (and the store it owned) closed. Its close handed this stream what
                # was left to read (`SubscriptionsClose`), and that went out: nothing follows, as
                # a read of the open store would have found, so the stream ends as that read's
                # would (CaughtUp first if not yet sent), whether or not the store closed since.
                rows = []
                closed_before = True
            self._take(rows)
            if self._buffer:
                # What this read found, or what a close handed over while it ran: `_StreamRest`
                # buffers the same rows, so those of this read may all be behind `_read_to`. Either
                # way more is to be delivered: this is not the head, nor the end.
                continue
            # Nothing follows what was delivered. A `session_closed` ends the stream only here, as
            # its last event: one of an earlier life is followed by the next life's events.
            if self._closed_at_cursor and self._seq != self._opened_at:
                self._ended = True  # it delivered the session's close: that is its last item
                raise StopAsyncIteration
            if not self._caught_up:
                self._caught_up = True
                return CaughtUp(self.cursor)
            if self._closed_at_cursor:
                self._ended = True  # resumed after the last session_closed: CaughtUp, then the end
                raise StopAsyncIteration
            if closed_before:
                self._ended = True
                raise StopAsyncIteration
            await self._wait()

    def _unfinished(self, failed: JournalError) -> JournalError:
        """The error of a stream whose journal closed before handing it the rest, and whose own
        read of the rest failed: never a clean end, which would say everything was delivered."""
        stopped = self._handover_error
        if isinstance(stopped, JournalCorruptError):
            return stopped  # the damage the close met is what lies ahead of this stream
        why = (
            f"handing it the rest failed ({stopped})"
            if stopped is not None
            else "its close did not hand it the rest (cut short by commit_grace, or the lease was lost)"
        )
        error = JournalError(
            f"the subscription to {self.stream_id!r} ended at {self.cursor} before the end of its stream was"
            f" delivered: the journal closed, {why}, and reading the rest failed: {failed}"
            " (resume from the cursor on an open store)"
        )
        error.__cause__ = failed
        return error

    async def _read_page(self) -> list[EventEnvelope]:
        return await _read_page(self._store, self.stream_id, self._read_to, self._page_size)

    def _take(self, rows: list[EventEnvelope]) -> bool:
        """Buffer the rows after what was read (a close may have read some of them meanwhile)."""
        expected = self._read_to + 1
        taken = False
        for envelope in rows:
            if envelope.seq < expected:
                continue
            if envelope.seq != expected:
                raise JournalCorruptError(
                    f"stream {self.stream_id!r} skips from {expected - 1} to {envelope.seq}: nothing is skipped"
                )
            self._buffer.append(envelope)
            self._read_to = expected
            expected += 1
            taken = True
        return taken

    async def _wait(self) -> None:
        if self._closed is None:
            await self._store.wait_for_append(self.stream_id, self._seq)
            return
        closed = self._closed
        async with trio.open_nursery() as nursery:

            async def wait_closed() -> None:
                await closed.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait_closed)
            await self._store.wait_for_append(self.stream_id, self._seq)
            nursery.cancel_scope.cancel()


async def _read_page(store: JournalStore, stream_id: str, after: int, limit: int) -> list[EventEnvelope]:
    """At most *limit* events after *after*. A damaged row ends the page before it: the events the
    read decoded ahead of it go out first, and the read that starts at it raises."""
    try:
        return await store.read(stream_id, after=after, limit=limit)
    except JournalCorruptError as exc:
        if not exc.intact:
            raise
        return list(exc.intact)


class _StreamRest:
    """What is committed in one stream past its live subscriptions, read once for all of them
    (`SubscriptionsClose.close`): the most advanced is served first, with the stream's tail;
    each one behind it then needs only the rows between its position and what was read."""

    __slots__ = ("error", "head", "rows", "start", "store", "stream_id", "tail_read", "waiting")

    def __init__(self, store: JournalStore, stream_id: str) -> None:
        self.store = store
        self.stream_id = stream_id
        self.waiting: list[DurableEventStream] = []  # not served yet
        self.head: int | None = None  # None: unknown, served last (needed only to order streams)
        self.rows: list[EventEnvelope] = []  # the events after `start`, in order
        self.start = 0  # set by the first subscription served
        self.tail_read = False  # `rows` reach the end of the stream
        self.error: JournalError | None = None  # a read failed: every one still behind it is left to itself

    def cost(self) -> float:
        """The events still to read to serve the next subscription (the most advanced waiting)."""
        if self.error is not None:
            return 0  # nothing more is read for this stream: out of the way at once
        read_to = max(stream._read_to for stream in self.waiting)
        if not self.tail_read:
            return math.inf if self.head is None else self.head - read_to
        return self.start - read_to

    async def serve_next(self) -> None:
        """Hand the most advanced waiting subscription the rest of its stream, or as much of it as
        was read before a read failed or the close's bound cut it short."""
        stream = max(self.waiting, key=lambda waiting: waiting._read_to)
        self.waiting.remove(stream)
        read_to = stream._read_to
        segment: list[EventEnvelope] = []  # read for this one alone: its rows before `start`
        done = False
        try:
            if self.error is not None:
                stream._handover_error = self.error
                return
            if not self.tail_read:  # the first served: the tail, which every subscription needs
                self.start = read_to
                while page := await _read_page(
                    self.store, self.stream_id, self.start + len(self.rows), stream._page_size
                ):
                    self.rows.extend(page)
                self.tail_read = True
            elif read_to < self.start:
                while (after := read_to + len(segment)) < self.start:
                    limit = min(stream._page_size, self.start - after)
                    page = await _read_page(self.store, self.stream_id, after, limit)
                    if not page:
                        raise JournalCorruptError(f"stream {self.stream_id!r} ends at {after}, before {self.start}")
                    segment.extend(page)
                self.rows[:0] = segment
                self.start, segment = read_to, []
            done = True
        except JournalError as exc:
            self.error = stream._handover_error = exc
        finally:
            # What was read goes to it even when the read failed or the bound cut it short: every
            # event up to there is delivered before the error (or the stream's own read) comes.
            if segment or read_to >= self.start:
                try:
                    stream._take(segment or self.rows[read_to - self.start :])
                except JournalError as exc:  # not contiguous: the stream reports it when it gets there
                    stream._handover_error, done = exc, False
            stream._handed_over = done


class SubscriptionsClose:
    """How a journal's subscriptions end with it: `close` first hands every live one what is
    committed and not yet read, then sets `closed`. A subscriber that runs only later (the store
    it read from may be closed by then, with the session that owned it) still gets every event
    up to the close, and one that reads nothing new after `closed` knows it has them all.

    The rest is read within the close's bound (``commit_grace``), cheapest first: each stream's
    rows are read once for all its subscriptions, and the subscription with the fewest events
    still to read is served next, so a caught-up one (only the committed tail missing) is never
    starved by one far behind. A stream whose rest was not handed over (the read failed, the
    bound cut it short, or `closed` was set without `close`, as on a lost lease) reads on by
    itself; if that read fails it raises (`DurableEventStream._unfinished`), never ends as if
    complete. The rest is held in memory until read: at most what the close could read within
    its bound, one copy of each event for all the subscriptions of its stream."""

    __slots__ = ("_live", "closed")

    def __init__(self) -> None:
        self.closed = trio.Event()
        self._live: set[DurableEventStream] = set()

    def add(self, stream: DurableEventStream) -> None:
        self._live.add(stream)

    def discard(self, stream: DurableEventStream) -> None:
        self._live.discard(stream)

    async def close(self) -> None:
        """Hand each live subscription its rest (a failed read leaves those it concerns to their
        own), cheapest first, then set `closed`."""
        try:
            rests: dict[tuple[int, str], _StreamRest] = {}
            for stream in self._live:
                if not stream._ended:  # it delivered its stream's end: nothing follows
                    key = (id(stream._store), stream.stream_id)
                    rest = rests.get(key)
                    if rest is None:
                        rest = rests[key] = _StreamRest(stream._store, stream.stream_id)
                    rest.waiting.append(stream)
            waiting = list(rests.values())
            for rest in waiting if len(waiting) > 1 else ():
                # What each stream's tail costs to read, to serve the cheapest first.
                with contextlib.suppress(JournalError):  # unknown: served last, its read reports it
                    rest.head = await rest.store.head(rest.stream_id)
            while waiting:
                cheapest = min(waiting, key=_StreamRest.cost)
                await cheapest.serve_next()
                if not cheapest.waiting:
                    waiting.remove(cheapest)
        finally:
            self.closed.set()


@asynccontextmanager
async def subscribe_durable_events(
    store: JournalStore,
    stream_id: str,
    *,
    after: JournalCursor | str | int = 0,
    page_size: int = 256,
    closed: trio.Event | None = None,
) -> AsyncIterator[DurableEventStream]:
    """Subscribe to one stream's committed events after ``after``.

    ``after`` is a `JournalCursor` (or its string form) of this stream, or a
    sequence number; 0 replays from the start. A cursor of another stream, a
    negative one, or one past the stream's head raises `CursorError`. The
    iteration ends after the stream's ``session_closed`` event when nothing follows
    it (a reopened session's stream goes on after an earlier life's close), or when
    ``closed`` is set and everything committed was delivered. A session reopened
    after the subscriber read past its last close is followed by subscribing again
    from that cursor.
    """
    yield await _open_stream(store, stream_id, after, page_size, closed)


@asynccontextmanager
async def journal_subscription(
    store: JournalStore, stream_id: str, close: SubscriptionsClose, *, after: JournalCursor | str | int = 0
) -> AsyncIterator[DurableEventStream]:
    """`subscribe_durable_events` for a journal: while the block runs, *close* hands the stream the
    rest of what was committed before it says the journal closed (`SubscriptionsClose`)."""
    stream = await _open_stream(store, stream_id, after, 256, close.closed)
    close.add(stream)
    try:
        yield stream
    finally:
        close.discard(stream)


async def _open_stream(
    store: JournalStore,
    stream_id: str,
    after: JournalCursor | str | int,
    page_size: int,
    closed: trio.Event | None,
) -> DurableEventStream:
    check_id(stream_id, "stream id")
    if isinstance(after, str):
        after = JournalCursor.parse(after)
    if isinstance(after, JournalCursor):
        if after.stream_id != stream_id:
            raise CursorError(f"cursor {after} is from stream {after.stream_id!r}, not {stream_id!r}")
        seq = after.seq
    else:
        seq = after
    # Exactly an int: a bool is no position, and a float fails later with a bare TypeError.
    if type(seq) is not int:
        raise CursorError(
            f"after must be a JournalCursor with an int seq, its string or an int, not {type(seq).__name__}"
        )
    if seq < 0:
        raise CursorError(f"cursor sequence must be >= 0, not {seq}")
    if type(page_size) is not int or page_size < 1:
        raise CursorError(f"page_size must be an int >= 1, not {page_size!r}")
    if closed is not None and not isinstance(closed, trio.Event):
        raise ConfigError(f"closed must be a trio.Event or None, not {type(closed).__name__}")
    head = await store.head(stream_id)
    if seq > head:
        raise CursorError(f"cursor {stream_id}@{seq} is past the head of the stream ({head}): stale or foreign")
    stream = DurableEventStream(store, stream_id, seq, page_size=page_size, closed=closed)
    if seq > 0:
        last = await store.read(stream_id, after=seq - 1, limit=1)
        stream._closed_at_cursor = bool(last) and isinstance(last[0].event, SessionClosed)
    return stream
