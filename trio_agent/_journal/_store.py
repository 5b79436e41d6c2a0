"""The store protocol every journal backend implements, and the values it trades in.

A store is deliberately dumb: it keeps streams of encoded envelopes, execution
leases and command ids, and it enforces the four rules that must hold even
against a buggy or paused client, inside the same transaction as the write:

* the fencing token of every append is the session lease's current one and the
  lease has not expired by the store's clock (else `StaleFencingTokenError`);
* an append continues the stream exactly at its head (else `SequenceConflictError`);
* a stream belongs to one session for ever (else `ForeignStreamError`);
* a command id is recorded with a digest of its content: an identical replay
  returns the first outcome, different content raises `CommandConflictError`.

Everything else (which event may follow which) is the projection's job, on the
client, before anything reaches the store.

A store also keeps at most one *snapshot* per stream (`save_snapshot`, `load_snapshot`;
see `_snapshot`): opaque bytes that stand for the stream's first ``seq`` events. Saving
one is fenced like an append (`decide_snapshot`: current, unexpired token; the stream
exists, is the session's and has reached ``seq``), inside the write's own transaction.
A snapshot is a cache: it never changes what `read` returns.

Writes are submitted and then awaited: `JournalStore.submit` queues a batch and
returns an `AppendTicket` at once; once submitted, the write happens whether or
not anyone waits for it, so journal order never depends on cancellation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs
import orjson
import trio

from .._builders import constructor
from .._config import finite_seconds
from .._errors import (
    CommandConflictError,
    ConfigError,
    ForeignStreamError,
    JournalError,
    JournalUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    SequenceConflictError,
    StaleFencingTokenError,
)
from ._events import EventEnvelope, encode_event, event_converter

__all__ = [
    "AppendBatch",
    "AppendResult",
    "AppendTicket",
    "AppendWaits",
    "Clock",
    "CommandRecord",
    "JournalStore",
    "Lease",
    "SharedPoll",
    "SnapshotWrite",
    "StreamInfo",
    "append_result",
    "check_id",
    "command_digest",
    "encode_body",
    "stream_id_for",
]

Clock = Callable[[], float]
"""Seconds, as the store judges lease expiry (wall time by default; `trio.current_time` in tests)."""

wall_clock: Clock = time.time


class _Waiter:
    """One task waiting in a `SharedPoll`. Its event is set when it is woken (``done``), or handed the lead."""

    __slots__ = ("done", "event", "key", "ready")

    def __init__(self, key: Any, ready: Callable[[Any], bool]) -> None:
        self.key = key
        self.ready = ready
        self.done = False
        self.event = trio.Event()


K = TypeVar("K")
V = TypeVar("V")


class SharedPoll(Generic[K, V]):
    """Tasks waiting for keys to change, and ONE poll for all of them, whatever their number.

    A waiter registers its key and a test of the polled value (`registered`), then `wait`\\ s
    until `wake` (a change this process made), `wake_all` (a close) or a poll whose value for its
    key passes the test. The poll (``poll(keys)``: every waited-on key in one read; a key it does
    not answer is not ready) runs every ``interval`` seconds while anyone waits, in one of the
    waiters: the first to wait leads, and one that leaves (woken, cancelled) hands the lead to
    another, which polls when the next poll is due. So there is no task of its own, no nursery is
    needed and nothing outlives the waiters; a leader cancelled or woken during a poll cuts it
    short, and its successor polls again at once. A poll that raises raises in the leader alone:
    *poll* turns the failures its waiters must hear of into values of their keys."""

    __slots__ = ("_due", "_leader", "_polling", "_waits", "polls")

    def __init__(self) -> None:
        self._waits: dict[K, dict[_Waiter, None]] = {}  # per key, its waiters in arrival order
        self._leader: _Waiter | None = None
        self._polling: trio.CancelScope | None = None  # the leader's poll in flight
        self._due = -math.inf  # the Trio time the next poll is due
        self.polls = 0  # polls run (observability, tests)

    def __len__(self) -> int:
        """The keys someone waits on."""
        return len(self._waits)

    @contextlib.contextmanager
    def registered(self, key: K, ready: Callable[[V], bool]) -> Iterator[_Waiter]:
        """A waiter on *key* while the block runs: a change from now on wakes it. It leaves
        (handing the lead on) however the block ends, a cancellation at its await included."""
        waiter = _Waiter(key, ready)
        self._waits.setdefault(key, {})[waiter] = None
        try:
            yield waiter
        finally:
            self._leave(waiter)

    async def wait(
        self, waiter: _Waiter, poll: Callable[[Sequence[K]], Awaitable[Mapping[K, V]]] | None, interval: float
    ) -> None:
        """Until *waiter* is woken, polling for every waiter while it leads (never without *poll*)."""
        if waiter.done:
            # Woken while its caller looked (a read in a worker thread, which finishes though the
            # caller was cancelled): still an await point, so a cancelled wait raises.
            await trio.lowlevel.checkpoint_if_cancelled()
            return
        while not waiter.done:
            if waiter.event.is_set():  # the lead was handed to it
                waiter.event = trio.Event()
            if poll is not None and self._leader is None:
                # No one else waits with a poll: it leads, and has just looked at its own key.
                self._leader = waiter
                self._due = trio.current_time() + interval
            if self._leader is waiter:
                assert poll is not None
                await self._lead(waiter, poll, interval)
            else:
                await waiter.event.wait()

    async def _lead(
        self, waiter: _Waiter, poll: Callable[[Sequence[K]], Awaitable[Mapping[K, V]]], interval: float
    ) -> None:
        while not waiter.done:
            with trio.move_on_at(self._due):
                await waiter.event.wait()  # set only when it is woken
            if waiter.done:
                return
            keys = list(self._waits)
            values: Mapping[K, V] | None = None
            try:
                with trio.CancelScope() as self._polling:
                    values = await poll(keys)
            finally:
                self._polling = None
            if values is None:  # cut short: it was woken (`_finish`), and its successor polls at once
                return
            self.polls += 1
            self._due = trio.current_time() + interval
            for key in keys:
                if key in values:
                    value = values[key]
                    for other in list(self._waits.get(key, ())):
                        if other.ready(value):
                            self._finish(other)

    def _finish(self, waiter: _Waiter) -> None:
        waiter.done = True
        self._drop(waiter)
        if waiter is self._leader and self._polling is not None:
            self._polling.cancel()  # its caller is not kept waiting for the poll
        waiter.event.set()

    def _drop(self, waiter: _Waiter) -> None:
        waiters = self._waits.get(waiter.key)
        if waiters is not None and waiter in waiters:
            del waiters[waiter]
            if not waiters:
                del self._waits[waiter.key]

    def _leave(self, waiter: _Waiter) -> None:
        self._drop(waiter)
        if self._leader is waiter:
            self._leader = None
            for waiters in self._waits.values():  # the lead goes to the first waiter on the oldest key
                successor = next(iter(waiters))
                self._leader = successor
                successor.event.set()
                break

    def wake(self, key: K) -> None:
        """Wake every waiter on *key*."""
        for waiter in list(self._waits.get(key, ())):
            self._finish(waiter)

    def wake_all(self) -> None:
        """Wake every waiter."""
        for waiters in list(self._waits.values()):
            for waiter in list(waiters):
                self._finish(waiter)


StreamHeads = Callable[[Sequence[str]], Awaitable[Mapping[str, "int | JournalError"]]]
"""A store's read of the heads of streams, in one query: a stream it does not name has none (0); a
`JournalError` in place of the head of a stream whose row is damaged. Raises when the read fails."""


class AppendWaits(SharedPoll[str, "int | JournalError"]):
    """A store's `wait_for_append`\\ s: woken at once by the store's own commits (`wake`), and
    for the appends of other processes by ONE read of every waited-on stream's head per
    ``poll_interval`` (`SharedPoll`), however many wait."""

    __slots__ = ()

    async def wait_for_append(
        self, stream_id: str, after: int, *, heads: StreamHeads | None = None, interval: float = math.inf
    ) -> None:
        """Return once *stream_id* grew past *after* (a commit of this process, or a poll found its
        head past it), when the store closes (`wake_all`), or when a poll failed for it (the
        caller's next read reports the failure, typed as ever). Never on a poll that found nothing.

        With *heads*, it looks first (registered before, so an append committed from now on wakes
        it, and one committed since the caller's read is seen by the look) and polls at
        *interval*; without, the caller looked itself and only a `wake` returns it."""

        def past(head: int | JournalError) -> bool:
            return not isinstance(head, int) or head > after

        with self.registered(stream_id, past) as waiter:
            if heads is not None:
                try:
                    head = (await heads([stream_id])).get(stream_id, 0)
                except JournalError:
                    head = 0  # the next poll reports it, a poll_interval from now: never a busy loop
                if isinstance(head, int) and head > after:
                    # A read in a worker thread finishes even when its caller was cancelled meanwhile:
                    # a cancelled wait raises, never returns as if it had waited.
                    await trio.lowlevel.checkpoint_if_cancelled()
                    return
            await self.wait(waiter, None if heads is None else _heads_poll(heads), interval)


def _heads_poll(heads: StreamHeads) -> Callable[[Sequence[str]], Awaitable[Mapping[str, int | JournalError]]]:
    """*heads* as `AppendWaits`' poll: a failed read is every waiter's, whose read then reports it."""

    async def poll(stream_ids: Sequence[str]) -> Mapping[str, int | JournalError]:
        try:
            found = await heads(stream_ids)
        except JournalError as exc:
            return dict.fromkeys(stream_ids, exc)
        return {stream_id: found.get(stream_id, 0) for stream_id in stream_ids}

    return poll


MAX_ID_BYTES = 1200
"""The longest id a store keeps, in UTF-8 bytes. PostgreSQL indexes two ids in one entry (a
stream and a command id, a session and a stream id), and an index entry must stay under 2,704
bytes; every session id `validate_id` accepts (200 characters, 800 bytes) still gets a
subagent's stream (64 more characters and a number)."""


def check_id(value: object, what: str) -> str:
    """An id a store keeps (session, stream, owner, command): text every store can hold.

    Checked at the door, before the id joins a group commit: a lone surrogate (not
    encodable as UTF-8), a NUL (PostgreSQL text cannot hold it) or more than
    `MAX_ID_BYTES` bytes (PostgreSQL cannot index it) is a `ConfigError` of its own, never
    a failed batch that takes its neighbours down with it. Every store checks the same.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string, not {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigError(f"{what} must be valid Unicode text (it has a lone surrogate): {value!r}") from None
    if "\x00" in value:
        raise ConfigError(f"{what} must not contain NUL: {value!r}")
    if size > MAX_ID_BYTES:
        raise ConfigError(f"{what} must be at most {MAX_ID_BYTES} bytes of UTF-8, not {size}: {value[:40]!r}...")
    return value


def stream_id_for(session_id: str, agent_id: str) -> str:
    """The stream of one agent of a session: ``"<session_id>/<agent_id>"``."""
    return f"{session_id}/{agent_id}"


@attrs.frozen
class Lease:
    """An execution lease on a session, as the store granted or renewed it.

    ``token`` is the fencing token: it increases on every acquisition, so a
    previous owner's token is stale for ever. ``expires_at`` is on the store's clock.
    """

    session_id: str
    owner: str
    token: int
    expires_at: float


@attrs.frozen
class StreamInfo:
    stream_id: str
    session_id: str
    head: int


@attrs.frozen
class CommandRecord:
    """The first outcome of a command: the events it appended."""

    stream_id: str
    command_id: str
    digest: str
    first_seq: int
    last_seq: int


@attrs.frozen
class AppendResult:
    """Where an append landed. ``replayed`` means an identical command had already landed there."""

    stream_id: str
    first_seq: int
    last_seq: int
    replayed: bool = False


def _json_writer(*, sort_keys: bool) -> Callable[[Any], str]:
    """``json.dumps(value, separators=(",", ":"), allow_nan=False, sort_keys=...)``: the same text
    and errors, from one encoder made once (``json.dumps`` with options makes one per call)."""
    return json.JSONEncoder(separators=(",", ":"), sort_keys=sort_keys, allow_nan=False).encode


_write_escaped = _json_writer(sort_keys=False)
# A command's digest must read the same in every version that may replay the command: it keeps
# the standard library's text (orjson spells some floats differently, ``1e-7`` for ``1e-07``).
_write_digest = _json_writer(sort_keys=True)


def _write_body(data: Any) -> str:
    """The stored JSON text of an unstructured envelope: ASCII, compact; what ``json.dumps(data,
    separators=(",", ":"), allow_nan=False)`` writes, or the same values in other spelling (orjson
    writes ``1e-7`` for ``1e-07`` and leaves DEL unescaped, as JSON allows), and refused alike.

    orjson writes it in about half the standard library's instructions, its check included (a
    request's dozen bodies were most of a SQLite writer's Python work), but only for data of JSON's
    own types (`_plain`): orjson writes some values the standard library refuses (any enum, a UUID, a
    non-finite float as ``null``), writes a str or int enum by its ``value`` where the standard
    library writes its text, and can crash on an enum whose ``value`` raises. Everything else,
    text outside ASCII (the stored form escapes it) and what orjson refuses (an integer past 64
    bits, a lone surrogate, a non-string key) is written by the standard library.
    """
    if not _plain(data, 0):
        return _write_escaped(data)
    try:
        text = orjson.dumps(data)
    except orjson.JSONEncodeError:
        return _write_escaped(data)
    return text.decode("ascii") if text.isascii() else _write_escaped(data)


_PLAIN_LEAVES = frozenset({str, int, bool, type(None)})
_PLAIN_DEPTH = 200  # orjson refuses deeper nesting than 255; well within it, the standard library takes over


def _plain(value: Any, depth: int) -> bool:
    """Whether *value* holds JSON's exact types only (`dict`, `list`, `tuple`, `str`, `int`,
    `bool`, ``None``, finite `float`; keys unchecked: orjson refuses what is not a `str`),
    nested no deeper than `_PLAIN_DEPTH`. The leaves are judged in the loop: most are."""
    kind = type(value)
    if kind is dict:
        items: Any = value.values()
    elif kind is list or kind is tuple:
        items = value
    elif kind is float:
        return bool(value - value == 0.0)  # NaN and the infinities give NaN
    else:
        return kind in _PLAIN_LEAVES
    if depth >= _PLAIN_DEPTH:
        return False
    for item in items:
        inner = type(item)
        if inner in _PLAIN_LEAVES:
            continue
        if inner is float:
            if item - item != 0.0:
                return False
        elif inner is dict or inner is list or inner is tuple:
            if not _plain(item, depth + 1):
                return False
        else:
            return False
    return True


def encode_body(envelope: EventEnvelope) -> str:
    """The stored text of one envelope (validated: junk is never written)."""
    # Events type-check every field when built, so the hot path skips the decode round trip.
    return _write_body(encode_event(envelope, validate=False))


def command_digest(envelopes: Sequence[EventEnvelope]) -> str:
    """A digest of what a command writes, without its position and time, so a replay matches."""
    content = [event_converter.unstructure(envelope.event, type(envelope.event)) for envelope in envelopes]
    kinds = [type(envelope.event).__name__ for envelope in envelopes]
    text = _write_digest([kinds, content])
    return hashlib.sha256(text.encode()).hexdigest()


def _envelope_tuple(envelopes: Sequence[EventEnvelope]) -> tuple[EventEnvelope, ...]:
    return tuple(envelopes)


@attrs.frozen
class AppendBatch:
    """One atomic append: all of ``envelopes`` land on ``stream_id`` or none does.

    ``owner``, when given, is the lease owner the writer holds ``token`` as: the store refuses the
    append unless the lease is that owner's (a token alone may be another owner's, when a new
    session's lease is taken with its first write and someone else took it first)."""

    session_id: str
    stream_id: str
    token: int
    envelopes: tuple[EventEnvelope, ...] = attrs.field(converter=_envelope_tuple)
    command_id: str | None = None
    command_digest: str | None = None
    owner: str | None = None

    def __attrs_post_init__(self) -> None:
        check_id(self.session_id, "session id")
        check_id(self.stream_id, "stream id")
        if self.command_id is not None:
            check_id(self.command_id, "command id")
        if self.owner is not None:
            check_id(self.owner, "lease owner")
        if not self.envelopes:
            raise JournalError("an append needs at least one event")
        first = self.envelopes[0].seq
        for offset, envelope in enumerate(self.envelopes):
            if envelope.stream_id != self.stream_id:
                raise JournalError(f"event for stream {envelope.stream_id!r} in an append to stream {self.stream_id!r}")
            if envelope.seq != first + offset:
                raise JournalError(f"sequence numbers of one append must be consecutive, got {envelope.seq}")
        if (self.command_id is None) != (self.command_digest is None):
            raise JournalError("command_id and command_digest go together")

    @classmethod
    def placed(
        cls,
        session_id: str,
        stream_id: str,
        token: int,
        envelopes: tuple[EventEnvelope, ...],
        command_id: str | None = None,
        command_digest: str | None = None,
        owner: str | None = None,
    ) -> AppendBatch:
        """A batch a journal built from envelopes it placed itself (`place_event`), without the
        constructor's checks: it checked the stream id (whose text holds the session id), the
        command id and its lease's owner at its door, numbered the envelopes on that stream one
        after the other, and gives a digest exactly with a command id."""
        return _placed_batch(session_id, stream_id, token, envelopes, command_id, command_digest, owner)

    @property
    def bodies(self) -> tuple[str, ...]:
        """The stored text of each envelope, encoded on demand (by a writer thread, for the file stores).

        Events type-check every field when they are built, so encoding cannot meet junk.
        """
        return tuple(encode_body(envelope) for envelope in self.envelopes)

    @property
    def first_seq(self) -> int:
        return self.envelopes[0].seq

    @property
    def last_seq(self) -> int:
        return self.envelopes[-1].seq


# Every append makes one of each: built cheaper (see `_builders`), every field given. A placed
# batch's envelopes are a tuple already and were checked where they were placed (`AppendBatch.placed`):
# its converter and its own checks have nothing to do.
_placed_batch: Callable[[str, str, int, tuple[EventEnvelope, ...], str | None, str | None, str | None], AppendBatch] = (
    constructor(AppendBatch, trusted=("envelopes", "__attrs_post_init__"))
)
append_result: Callable[[str, int, int, bool], AppendResult] = constructor(AppendResult)


@attrs.frozen
class SnapshotWrite:
    """One snapshot to save: ``body`` stands for the first ``seq`` events of ``stream_id``."""

    session_id: str
    stream_id: str
    seq: int
    token: int
    body: bytes

    def __attrs_post_init__(self) -> None:
        check_id(self.session_id, "session id")
        check_id(self.stream_id, "stream id")
        if type(self.seq) is not int or self.seq < 1:
            raise JournalError(f"a snapshot's seq must be a positive integer, not {self.seq!r}")
        if not isinstance(self.body, bytes):
            raise JournalError(f"a snapshot's body must be bytes, not {type(self.body).__name__}")


class AppendTicket:
    """The pending outcome of one submitted append.

    Resolved from the store's writer (thread or not) through `_resolve`, which
    must run in the Trio thread. `wait` returns the `AppendResult` once the
    write is committed, or raises what refused it.
    """

    __slots__ = ("_done", "_error", "_result", "batch")

    def __init__(self, batch: AppendBatch) -> None:
        self.batch = batch
        self._done = trio.Event()
        self._result: AppendResult | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _resolve(self, outcome: object) -> None:
        if isinstance(outcome, BaseException):
            self._error = outcome
        else:
            assert isinstance(outcome, AppendResult)
            self._result = outcome
        self._done.set()

    def outcome(self) -> AppendResult:
        """The outcome of a resolved ticket (raises what refused the write)."""
        if not self._done.is_set():
            raise JournalError("the append is not resolved yet")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    async def wait(self) -> AppendResult:
        if not self._done.is_set():
            await self._done.wait()
        else:
            # Already committed (the memory store): still a full checkpoint, so a task appending in
            # a loop lets the others run (the lease heartbeat among them).
            await trio.lowlevel.checkpoint()
        return self.outcome()


class JournalStore(Protocol):
    """What the journal needs from a backend (memory, SQLite, PostgreSQL).

    Every method that raises for a store-side failure raises a `JournalError`
    (`JournalUnavailableError` when a write's outcome is unknown), or
    `StaleFencingTokenError` for a stale or expired token.
    """

    clock: Clock
    leases_expire: bool
    """Whether a lease runs out unless renewed (a journal then runs a heartbeat). A store whose
    sessions no other process can take over may say no (`MemoryStore` without a clock).

    A store that commits at once may also define ``commit(batch) -> AppendResult`` (`submit`
    without the ticket): a journal on it appends without waiting."""

    def submit(self, batch: AppendBatch) -> AppendTicket:
        """Queue ``batch`` for the next commit; never blocks.

        Batches are committed in submission order (the journal relies on it to
        queue a settlement right behind a start that is still in flight).
        """

    async def append(self, batch: AppendBatch) -> AppendResult:
        """Submit ``batch`` and wait until it is committed (group commit with concurrent appends)."""

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[EventEnvelope]:
        """Committed events of one stream with ``seq > after``, in order, strictly decoded."""

    async def head(self, stream_id: str) -> int:
        """The last committed sequence number of a stream (0 if it has none)."""

    async def stream_info(self, stream_id: str) -> StreamInfo | None: ...

    async def streams(self, session_id: str | None = None) -> list[StreamInfo]:
        """All streams, or those of one session, ordered by stream id."""

    async def command(self, stream_id: str, command_id: str) -> CommandRecord | None: ...

    async def commands(self, stream_id: str, *, after: int = 0) -> list[CommandRecord]:
        """The commands of a stream whose first event lies past ``after``, in stream order."""

    async def save_snapshot(self, session_id: str, stream_id: str, seq: int, token: int, body: bytes) -> None:
        """Keep ``body`` as the snapshot of ``stream_id`` at ``seq``, replacing any earlier one.

        Fenced like an append (`decide_snapshot`): `StaleFencingTokenError` for a stale or
        expired token, `ForeignStreamError` for another session's stream, `JournalError`
        if the stream does not exist or has not reached ``seq``.
        """

    async def load_snapshot(self, stream_id: str) -> tuple[int, bytes] | None:
        """The stored snapshot of a stream as ``(seq, body)``, its checksum verified
        (`JournalCorruptError` if it fails), or ``None``."""

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> Lease:
        """Take the session's lease with a new, higher token; `LeaseHeldError` if another holds it."""

    async def renew_lease(self, lease: Lease, ttl: float) -> Lease:
        """Extend a still-valid lease; `LeaseLostError` if it expired or was taken over."""

    async def release_lease(self, lease: Lease) -> None:
        """Give the lease up now (idempotent; a stale lease is left alone)."""

    async def current_lease(self, session_id: str) -> Lease | None: ...

    async def wait_for_append(self, stream_id: str, after: int) -> None:
        """Return when ``stream_id`` may have grown past ``after`` (a hint: callers re-read), or the
        store closed; never merely because a poll for other processes' appends found nothing."""

    async def aclose(self) -> None: ...


def unavailable(exc: BaseException, what: str) -> JournalUnavailableError:
    error = JournalUnavailableError(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def check_ttl(ttl: float) -> float:
    return finite_seconds(ttl, "lease ttl", error=JournalError)


# ---------------------------------------------------------------- the store's rules, once
#
# Every store decides an append or a lease operation with these two functions,
# against the rows it read inside the write's own transaction (or its dicts).

LeaseRow = tuple[str, int, float]
"""A stored lease: owner, token (0 = never leased), expires_at on the store's clock."""


def decide_append(
    batch: AppendBatch,
    *,
    lease: LeaseRow | None,
    stream: tuple[str, int] | None,
    command: tuple[str, int, int] | None,
    now: float,
) -> AppendResult:
    """Apply the store's four rules to one append; raise the typed refusal, or return where it lands.

    ``stream`` is the stored (session_id, head) of the batch's stream; ``command`` the stored
    (digest, first_seq, last_seq) of its command id. An identical replay returns the first
    outcome with ``replayed=True`` (and nothing must be written for it).
    """

    _check_fence("append", batch.session_id, batch.stream_id, batch.token, lease, stream, now, batch.owner)
    if batch.command_id is not None and command is not None:
        if command[0] != batch.command_digest:
            raise CommandConflictError(
                f"command {batch.command_id!r} was already applied with different content", command_id=batch.command_id
            )
        return append_result(batch.stream_id, command[1], command[2], True)
    head = 0 if stream is None else stream[1]
    envelopes = batch.envelopes
    first = envelopes[0].seq
    if first != head + 1:
        raise SequenceConflictError(
            f"stream {batch.stream_id!r} is at {head}, the append starts at {first}",
            stream_id=batch.stream_id,
            expected=first - 1,
            actual=head,
        )
    return append_result(batch.stream_id, first, envelopes[-1].seq, False)


def _check_fence(
    what: str,
    session_id: str,
    stream_id: str,
    token: int,
    lease: LeaseRow | None,
    stream: tuple[str, int] | None,
    now: float,
    owner: str | None = None,
) -> None:
    """The fence every write passes: the session's current, unexpired token (of *owner*, when the
    writer says whose), on its own stream."""

    if lease is None or lease[1] == 0 or lease[1] != token or lease[2] < now:
        detail = (
            "no lease" if lease is None or lease[1] == 0 else f"the lease has token {lease[1]}, expires at {lease[2]}"
        )
        raise StaleFencingTokenError(
            f"{what} to {stream_id!r} with fencing token {token} refused by the store: {detail}"
        )
    if owner is not None and lease[0] != owner:
        raise StaleFencingTokenError(
            f"{what} to {stream_id!r} with fencing token {token} refused by the store: "
            f"the lease with that token is held by another owner"
        )
    if stream is not None and stream[0] != session_id:
        raise ForeignStreamError(f"stream {stream_id!r} belongs to session {stream[0]!r}, not {session_id!r}")


def decide_snapshot(
    write: SnapshotWrite, *, lease: LeaseRow | None, stream: tuple[str, int] | None, now: float
) -> None:
    """Apply the store's rules to one snapshot (as to an append: the fence first), or raise the refusal.

    ``stream`` is the stored (session_id, head) of its stream: it must exist and have
    reached the snapshot's seq, so a snapshot never stands for events the store lacks.
    """
    _check_fence("snapshot", write.session_id, write.stream_id, write.token, lease, stream, now)
    if stream is None:
        raise JournalError(f"snapshot of {write.stream_id!r} refused: the stream does not exist")
    if write.seq > stream[1]:
        raise JournalError(
            f"snapshot of {write.stream_id!r} at seq {write.seq} refused: the stream's head is {stream[1]}"
        )


def decide_lease(
    kind: str, session_id: str, owner: str, token: int, ttl: float, row: LeaseRow | None, now: float
) -> Lease | None:
    """Apply the lease rules: ``acquire`` and ``renew`` return the new lease (or raise
    `LeaseHeldError` / `LeaseLostError`); ``release`` returns ``None`` (see `releases`)."""

    if kind == "acquire":
        if row is not None and row[1] > 0 and row[2] >= now and row[0] != owner:
            raise LeaseHeldError(
                f"session {session_id!r} is leased by {row[0]!r} until {row[2]}",
                owner=row[0],
                expires_at=row[2],
                now=now,
            )
        # Every acquisition gets a higher token, so a previous owner's is stale for ever.
        return Lease(session_id, owner, (0 if row is None else row[1]) + 1, now + ttl)
    if kind == "renew":
        if row is None or row[1] == 0 or row[0] != owner or row[1] != token or row[2] < now:
            raise LeaseLostError(f"lease on session {session_id!r} with token {token} is lost")
        return Lease(session_id, owner, token, now + ttl)
    return None


def releases(row: LeaseRow | None, token: int) -> bool:
    """Whether releasing with ``token`` expires the stored lease (only its own, current token does;
    the token is kept, so the next owner's is higher)."""
    return row is not None and row[1] > 0 and row[1] == token
