"""A pure in-memory journal store, for tests and users' tests.

It keeps the same rules as the durable stores (fencing, gapless sequences,
stream ownership, command ids). It keeps the event objects themselves (they are
immutable and were type-checked when built), so nothing is encoded or decoded:
treat what `read` returns as read-only. Nothing survives the process. Its clock is injectable:
``MemoryStore(clock=trio.current_time)`` makes lease expiry follow Trio's
(mock) clock, which is what lease tests with ``autojump_clock`` want.
"""

from __future__ import annotations

import attrs
import trio

from .._errors import (
    CommandConflictError,
    ForeignStreamError,
    JournalCorruptError,
    LeaseHeldError,
    LeaseLostError,
    SequenceConflictError,
    StaleFencingTokenError,
)
from ._events import EventEnvelope
from ._store import (
    AppendBatch,
    AppendResult,
    AppendTicket,
    Clock,
    CommandRecord,
    Lease,
    StreamInfo,
    check_ttl,
    wall_clock,
)

__all__ = ["MemoryStore"]


@attrs.define
class _Stream:
    session_id: str
    rows: list[EventEnvelope] = attrs.Factory(list)
    commands: dict[str, CommandRecord] = attrs.Factory(dict)
    changed: trio.Event = attrs.Factory(trio.Event)


class MemoryStore:
    """A `JournalStore` in a few dicts. Every operation commits at once."""

    def __init__(self, *, clock: Clock = wall_clock) -> None:
        self.clock = clock
        self._streams: dict[str, _Stream] = {}
        self._leases: dict[str, Lease] = {}
        self.commits = 0

    # -- writes

    def submit(self, batch: AppendBatch) -> AppendTicket:
        ticket = AppendTicket(batch)
        try:
            outcome: AppendResult | BaseException = self._apply(batch)
        except Exception as exc:
            outcome = exc
        ticket._resolve(outcome)
        return ticket

    async def append(self, batch: AppendBatch) -> AppendResult:
        return await self.submit(batch).wait()

    def _apply(self, batch: AppendBatch) -> AppendResult:
        lease = self._leases.get(batch.session_id)
        if lease is None or lease.token != batch.token or lease.expires_at < self.clock():
            raise StaleFencingTokenError(
                f"append to {batch.stream_id!r} with fencing token {batch.token} refused: "
                + ("no lease" if lease is None else f"the lease has token {lease.token}, expires at {lease.expires_at}")
            )
        stream = self._streams.get(batch.stream_id)
        if stream is not None and stream.session_id != batch.session_id:
            raise ForeignStreamError(
                f"stream {batch.stream_id!r} belongs to session {stream.session_id!r}, not {batch.session_id!r}"
            )
        if batch.command_id is not None and stream is not None:
            known = stream.commands.get(batch.command_id)
            if known is not None:
                if known.digest != batch.command_digest:
                    raise CommandConflictError(
                        f"command {batch.command_id!r} was already applied with different content",
                        command_id=batch.command_id,
                    )
                return AppendResult(batch.stream_id, known.first_seq, known.last_seq, replayed=True)
        head = len(stream.rows) if stream is not None else 0
        if batch.first_seq != head + 1:
            raise SequenceConflictError(
                f"stream {batch.stream_id!r} is at {head}, the append starts at {batch.first_seq}",
                stream_id=batch.stream_id,
                expected=batch.first_seq - 1,
                actual=head,
            )
        if stream is None:
            stream = self._streams[batch.stream_id] = _Stream(batch.session_id)
        stream.rows.extend(batch.envelopes)
        if batch.command_id is not None:
            assert batch.command_digest is not None
            stream.commands[batch.command_id] = CommandRecord(
                batch.stream_id, batch.command_id, batch.command_digest, batch.first_seq, batch.last_seq
            )
        self.commits += 1
        stream.changed.set()
        stream.changed = trio.Event()
        return AppendResult(batch.stream_id, batch.first_seq, batch.last_seq)

    # -- reads

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[EventEnvelope]:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        if stream is None:
            return []
        after = max(after, 0)
        rows = stream.rows[after:]
        if limit is not None:
            rows = rows[:limit]
        for index, envelope in enumerate(rows):
            if envelope.stream_id != stream_id or envelope.seq != after + 1 + index:
                raise JournalCorruptError(
                    f"stored event {stream_id}#{after + 1 + index} is corrupt: "
                    f"row holds {envelope.stream_id}#{envelope.seq}"
                )
        return list(rows)

    async def head(self, stream_id: str) -> int:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        return 0 if stream is None else len(stream.rows)

    async def stream_info(self, stream_id: str) -> StreamInfo | None:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        return None if stream is None else StreamInfo(stream_id, stream.session_id, len(stream.rows))

    async def streams(self, session_id: str | None = None) -> list[StreamInfo]:
        await trio.lowlevel.checkpoint()
        return [
            StreamInfo(stream_id, stream.session_id, len(stream.rows))
            for stream_id, stream in sorted(self._streams.items())
            if session_id is None or stream.session_id == session_id
        ]

    async def command(self, stream_id: str, command_id: str) -> CommandRecord | None:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        return None if stream is None else stream.commands.get(command_id)

    async def commands(self, stream_id: str) -> list[CommandRecord]:
        await trio.lowlevel.checkpoint()
        stream = self._streams.get(stream_id)
        return [] if stream is None else sorted(stream.commands.values(), key=lambda c: c.first_seq)

    # -- leases

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> Lease:
        ttl = check_ttl(ttl)
        await trio.lowlevel.checkpoint()
        now = self.clock()
        current = self._leases.get(session_id)
        if current is not None and current.expires_at >= now and current.owner != owner:
            raise LeaseHeldError(
                f"session {session_id!r} is leased by {current.owner!r} until {current.expires_at}",
                owner=current.owner,
                expires_at=current.expires_at,
            )
        token = 1 if current is None else current.token + 1
        lease = self._leases[session_id] = Lease(session_id, owner, token, now + ttl)
        return lease

    async def renew_lease(self, lease: Lease, ttl: float) -> Lease:
        ttl = check_ttl(ttl)
        await trio.lowlevel.checkpoint()
        now = self.clock()
        current = self._leases.get(lease.session_id)
        if current is None or current.token != lease.token or current.owner != lease.owner or current.expires_at < now:
            raise LeaseLostError(f"lease on session {lease.session_id!r} with token {lease.token} is lost")
        renewed = self._leases[lease.session_id] = attrs.evolve(current, expires_at=now + ttl)
        return renewed

    async def release_lease(self, lease: Lease) -> None:
        await trio.lowlevel.checkpoint()
        current = self._leases.get(lease.session_id)
        if current is not None and current.token == lease.token:
            # Keep the token so the next owner's is higher; expire now.
            self._leases[lease.session_id] = attrs.evolve(current, expires_at=float("-inf"))

    async def current_lease(self, session_id: str) -> Lease | None:
        await trio.lowlevel.checkpoint()
        return self._leases.get(session_id)

    async def wait_for_append(self, stream_id: str, after: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None and len(stream.rows) > after:
            await trio.lowlevel.checkpoint()
            return
        if stream is None:
            # No stream yet: poll gently; streams are created by their first append.
            await trio.sleep(0.01)
            return
        await stream.changed.wait()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
