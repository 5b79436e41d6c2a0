"""A pure in-memory journal store, for tests and users' tests.

It keeps the same rules as the durable stores (fencing, gapless sequences,
stream ownership, command ids). It keeps the event objects themselves (they are
immutable and were type-checked when built), so nothing is encoded or decoded:
treat what `read` returns as read-only. Nothing survives the process.

What a stream keeps is what `read` needs and no more, in forms the cyclic GC can leave
alone (a session's store lives as long as the session, and thousands may be alive): per
row the event, and its ``recorded_at`` packed in a bytearray; the envelope is made again
on read (its stream id is the stream's, its seq the row's place). A row whose envelope
cannot be made that way (another schema version, a ``recorded_at`` that is not a float,
a test's damage through `_Stream.rows`) keeps its envelope whole, and `read` checks its
stream id and seq. A command id keeps ``(digest, first_seq, last_seq)``.

Leases: nothing outside this process can take a session over, so by default a lease never
expires (it ends when its holder releases it) and a journal on this store runs no heartbeat:
a slow event loop cannot cost a session its lease. A second holder is still refused
(`LeaseHeldError`) and tokens still fence. Give a clock to get expiring leases, as the durable
stores have: ``MemoryStore(clock=trio.current_time)`` makes lease expiry follow Trio's (mock)
clock, which is what lease and takeover tests with ``autojump_clock`` want.

It commits synchronously (`commit`), so a journal's append on it never waits.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from typing import overload

import trio

from .._errors import (
    JournalCorruptError,
    JournalError,
)
from ._codec import snapshot_row, verify_snapshot
from ._events import SCHEMA_VERSION, Event, EventEnvelope, place_event
from ._store import (
    AppendBatch,
    AppendResult,
    AppendTicket,
    AppendWaits,
    Clock,
    CommandRecord,
    Lease,
    LeaseRow,
    SnapshotWrite,
    StreamInfo,
    check_id,
    check_ttl,
    decide_append,
    decide_lease,
    decide_snapshot,
    releases,
    wall_clock,
)

__all__ = ["MemoryStore"]

_DOUBLE = struct.Struct("=d")
_pack = _DOUBLE.pack


class _Stream:
    __slots__ = ("commands", "events", "session_id", "snapshot", "stream_id", "times")

    def __init__(self, stream_id: str, session_id: str) -> None:
        self.stream_id = stream_id
        self.session_id = session_id
        # Row i: the event of seq i + 1, or its whole envelope (module docstring); its recorded_at.
        self.events: list[Event | EventEnvelope] = []
        self.times = bytearray()  # the rows' recorded_at, packed (`_DOUBLE`): no object the GC tracks
        self.commands: dict[str, tuple[str, int, int]] = {}  # command id -> (digest, first_seq, last_seq)
        # (seq, body, checksum): kept as a file store keeps it, so a test can damage it like one.
        self.snapshot: tuple[int, bytes, int] | None = None

    def envelope(self, index: int) -> EventEnvelope:
        """The envelope of row ``index`` (seq ``index + 1``), as it was appended."""
        row = self.events[index]
        if isinstance(row, EventEnvelope):
            return row
        recorded_at: float = _DOUBLE.unpack_from(self.times, index * _DOUBLE.size)[0]
        return place_event(self.stream_id, index + 1, row, recorded_at)

    @property
    def rows(self) -> _Rows:
        """The stored envelopes, as a list of them would show them (for tests: read, or damage one)."""
        return _Rows(self)


class _Rows(Sequence[EventEnvelope]):
    """A view of a stream's rows as envelopes; setting one keeps that envelope whole."""

    __slots__ = ("_stream",)

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream

    def __len__(self) -> int:
        return len(self._stream.events)

    @overload
    def __getitem__(self, index: int) -> EventEnvelope: ...

    @overload
    def __getitem__(self, index: slice) -> list[EventEnvelope]: ...

    def __getitem__(self, index: int | slice) -> EventEnvelope | list[EventEnvelope]:
        stream = self._stream
        if isinstance(index, slice):
            return [stream.envelope(i) for i in range(*index.indices(len(stream.events)))]
        return stream.envelope(range(len(stream.events))[index])

    def __setitem__(self, index: int, envelope: EventEnvelope) -> None:
        self._stream.events[index] = envelope

    def __iter__(self) -> Iterator[EventEnvelope]:
        stream = self._stream
        for index in range(len(stream.events)):
            yield stream.envelope(index)


class MemoryStore:
    """A `JournalStore` in a few dicts. Every operation commits at once."""

    __slots__ = ("_closed", "_leases", "_streams", "_waits", "clock", "commits", "leases_expire")

    def __init__(self, *, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else wall_clock
        # Leases expire only by an explicit clock (module docstring).
        self.leases_expire = clock is not None
        self._streams: dict[str, _Stream] = {}
        self._leases: dict[str, Lease] = {}
        # The `wait_for_append`s, on streams that exist or not yet; made for the first (most stores have none).
        self._waits: AppendWaits | None = None
        self._closed = False  # `aclose` was called: a `wait_for_append` returns at once (the protocol's rule)
        self.commits = 0

    # -- writes

    def submit(self, batch: AppendBatch) -> AppendTicket:
        ticket = AppendTicket(batch)
        try:
            outcome: AppendResult | BaseException = self.commit(batch)
        except Exception as exc:
            outcome = exc
        ticket._resolve(outcome)
        return ticket

    async def append(self, batch: AppendBatch) -> AppendResult:
        return await self.submit(batch).wait()

    def commit(self, batch: AppendBatch) -> AppendResult:
        """Commit ``batch`` now (a synchronous store's `submit` without the ticket); raises what refuses it."""
        stream = self._streams.get(batch.stream_id)
        command_id = batch.command_id
        known = None if stream is None or command_id is None else stream.commands.get(command_id)
        result = decide_append(
            batch,
            lease=self._row(batch.session_id),
            stream=None if stream is None else (stream.session_id, len(stream.events)),
            command=known,
            now=self.clock(),
        )
        if result.replayed:
            return result
        if stream is None:
            stream = self._streams[batch.stream_id] = _Stream(batch.stream_id, batch.session_id)
        events, times = stream.events, stream.times
        for envelope in batch.envelopes:
            recorded_at = envelope.recorded_at
            if (
                type(recorded_at) is float
                and envelope.schema_version == SCHEMA_VERSION
                and type(envelope) is EventEnvelope
            ):
                events.append(envelope.event)  # the envelope is made again on read (module docstring)
            else:
                events.append(envelope)
                recorded_at = math.nan
            times += _pack(recorded_at)
        if command_id is not None:
            assert batch.command_digest is not None
            stream.commands[command_id] = (batch.command_digest, result.first_seq, result.last_seq)
        self.commits += 1
        if self._waits is not None:
            self._waits.wake(batch.stream_id)
        return result

    # -- reads

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[EventEnvelope]:
        await trio.lowlevel.checkpoint()
        if self._closed:
            # As the file stores: a subscription woken by the close ends here, never reads on for ever.
            raise JournalError("the memory store is closed")
        stream = self._streams.get(stream_id)
        if stream is None:
            return []
        after = max(after, 0)
        envelopes: list[EventEnvelope] = []
        # As slicing a list of the rows would, but a negative limit is no events (as the SQL stores
        # have it), never "all but the last".
        for index in range(after, len(stream.events))[: None if limit is None else max(limit, 0)]:
            envelope = stream.envelope(index)
            if envelope.stream_id != stream_id or envelope.seq != index + 1:
                raise JournalCorruptError(
                    f"stored event {stream_id}#{index + 1} is corrupt: row holds {envelope.stream_id}#{envelope.seq}",
                    intact=tuple(envelopes),
                )
            envelopes.append(envelope)
        return envelopes

    async def head(self, stream_id: str) -> int:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        return 0 if stream is None else len(stream.events)

    async def stream_info(self, stream_id: str) -> StreamInfo | None:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        return None if stream is None else StreamInfo(stream_id, stream.session_id, len(stream.events))

    async def streams(self, session_id: str | None = None) -> list[StreamInfo]:
        await trio.lowlevel.checkpoint()
        return self.streams_now(session_id)

    def streams_now(self, session_id: str | None = None) -> list[StreamInfo]:
        """`streams` without the checkpoint (the journal of a session opening calls it)."""
        return [
            StreamInfo(stream_id, stream.session_id, len(stream.events))
            for stream_id, stream in sorted(self._streams.items())
            if session_id is None or stream.session_id == session_id
        ]

    async def command(self, stream_id: str, command_id: str) -> CommandRecord | None:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        row = None if stream is None else stream.commands.get(command_id)
        return None if row is None else CommandRecord(stream_id, command_id, *row)

    async def commands(self, stream_id: str, *, after: int = 0) -> list[CommandRecord]:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        if stream is None:
            return []
        rows = [(command_id, *row) for command_id, row in stream.commands.items() if row[1] > after]
        return [CommandRecord(stream_id, *row) for row in sorted(rows, key=lambda row: row[2])]

    # -- snapshots

    async def save_snapshot(self, session_id: str, stream_id: str, seq: int, token: int, body: bytes) -> None:
        write = SnapshotWrite(session_id, stream_id, seq, token, body)
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        decide_snapshot(
            write,
            lease=self._row(session_id),
            stream=None if stream is None else (stream.session_id, len(stream.events)),
            now=self.clock(),
        )
        assert stream is not None
        stream.snapshot = (seq, *snapshot_row(stream_id, seq, body))

    async def load_snapshot(self, stream_id: str) -> tuple[int, bytes] | None:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        if stream is None or stream.snapshot is None:
            return None
        return verify_snapshot(stream_id, *stream.snapshot)

    # -- leases

    def _row(self, session_id: str) -> LeaseRow | None:
        lease = self._leases.get(session_id)
        return None if lease is None else (lease.owner, lease.token, lease.expires_at)

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> Lease:
        await trio.lowlevel.checkpoint()
        return self.acquire_lease_now(session_id, owner, ttl)

    def acquire_lease_now(self, session_id: str, owner: str, ttl: float) -> Lease:
        """`acquire_lease` without the checkpoint: nothing here waits (`open_journal` calls it)."""
        check_id(session_id, "session id")
        check_id(owner, "lease owner")
        ttl = check_ttl(ttl)
        ttl = ttl if self.leases_expire else math.inf
        lease = decide_lease("acquire", session_id, owner, 0, ttl, self._row(session_id), self.clock())
        assert lease is not None
        self._leases[session_id] = lease
        return lease

    async def renew_lease(self, lease: Lease, ttl: float) -> Lease:
        check_id(lease.session_id, "session id")
        check_id(lease.owner, "lease owner")
        ttl = check_ttl(ttl)
        await trio.lowlevel.checkpoint()
        row = self._row(lease.session_id)
        ttl = ttl if self.leases_expire else math.inf
        renewed = decide_lease("renew", lease.session_id, lease.owner, lease.token, ttl, row, self.clock())
        assert renewed is not None
        self._leases[lease.session_id] = renewed
        return renewed

    async def release_lease(self, lease: Lease) -> None:
        await trio.lowlevel.checkpoint()
        self.release_lease_now(lease)

    def release_lease_now(self, lease: Lease) -> None:
        """`release_lease` without the checkpoint (a journal closing calls it)."""
        check_id(lease.session_id, "session id")
        check_id(lease.owner, "lease owner")
        current = self._leases.get(lease.session_id)
        if current is not None and releases(self._row(lease.session_id), lease.token):
            self._leases[lease.session_id] = Lease(current.session_id, current.owner, current.token, -math.inf)

    async def current_lease(self, session_id: str) -> Lease | None:
        await trio.lowlevel.checkpoint()
        return self._leases.get(session_id)

    async def wait_for_append(self, stream_id: str, after: int) -> None:
        """Return once *stream_id* grew past *after*: woken by the append, whether or not the
        stream exists yet (its first append creates it)."""
        stream = self._streams.get(stream_id)
        if self._closed or (stream is not None and len(stream.events) > after):
            await trio.lowlevel.checkpoint()
            return
        if self._waits is None:
            self._waits = AppendWaits()
        await self._waits.wait_for_append(stream_id, after)  # looked just now: only an append returns it

    async def aclose(self) -> None:
        """Return every `wait_for_append`, now and later; `read` refuses from now on, as the file
        stores' do (a subscription ends rather than waits for ever)."""
        self._closed = True
        if self._waits is not None:
            self._waits.wake_all()
        await trio.lowlevel.checkpoint()
