"""The durable journal of one session: lease, projections, commands, lifecycle, recovery.

`open_journal` takes the session's execution lease from a store (taking over a
dead owner's after it expired), loads every stream of the session into its
projection, and keeps the lease alive with a heartbeat task in its own nursery.
Leaving the block releases the lease.

Writes go through `DurableJournal.append`: the projection checks the events
first (nothing invalid reaches the store), they are applied to it and
submitted; the call returns only after the store committed them. The store
checks the fencing token inside the same transaction as the write, so a paused
or partitioned former owner cannot write after a takeover.

Reopening is as cheap as the events since the last snapshot: each stream is
restored from its snapshot (if it has a usable one) and only the events after it
are read and applied; `open_journal` writes snapshots on its way out (see
`_snapshot` for the rules). `DurableJournal.conversation` gives an agent's history
from the same state, without reading its stream.

Failure rules:

* The lease is lost (the heartbeat could not renew in time, or the store refused
  our token): the block's body is cancelled, every later write raises
  `LeaseLostError`, and the block exits with `LeaseLostError`. It never becomes a
  tool result.
* A write whose outcome is unknown (the store failed or timed out mid-write) or
  that the store refused: the journal is fenced; every write raises
  `JournalFencedError` until `reconcile()` re-read the store.

The journal implements the tool pipeline's `ToolJournal`: ``tool_scheduled``
is durable before anyone sees the call, ``tool_started`` with the final input
before the side effect starts, the settlement before the result is published.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar

import attrs
import trio

from .._cleanup import bounded_shield
from .._config import MAX_TIMEOUT, finite_seconds, validate_id
from .._errors import (
    CommandConflictError,
    ConfigError,
    ForeignStreamError,
    InvalidTransitionError,
    JournalCorruptError,
    JournalError,
    JournalFencedError,
    LeaseLostError,
    StaleFencingTokenError,
)
from .._groups import typed_error
from .._json import copy_if_json
from .._models._messages import Message
from .._tools._definition import SideEffect, Tool
from .._tools._journal import ScheduledCall, Settlement, SettlementStatus
from .._tools._results import ToolErrorType, ToolResult, describe, json_copy, result_problem
from .._util import safe_repr
from ._conversation import ConversationFold
from ._events import (
    Event,
    EventEnvelope,
    ModelAbortReason,
    ModelAttemptAborted,
    OutcomeUnknownReason,
    PermissionDecision,
    PermissionResolved,
    RecoveryDecision,
    SessionCreated,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolRecoveryAction,
    ToolScheduled,
    place_event,
    tool_cancelled,
    tool_completed,
    tool_failed,
    tool_scheduled,
    tool_scheduled_copied,
    tool_started,
    tool_started_copied,
)
from ._lane import LaneStore
from ._lease import HeldLease, acquire, check_seconds, check_timing, default_owner
from ._memory import MemoryStore
from ._projection import PermissionState, Projection, RecoveryKind, RecoveryPlan, ToolState
from ._snapshot import (
    CALL_EVENTS,
    CALL_UPDATES,
    FOLD_AFTER,
    SNAPSHOT_GRACE,
    CallRecord,
    _Stream,
    decode_snapshot,
    encode_snapshot,
    logger,
    result_from_json,
    result_to_json,
)
from ._store import (
    AppendBatch,
    AppendResult,
    AppendTicket,
    JournalStore,
    Lease,
    append_result,
    check_id,
    command_digest,
    stream_id_for,
)
from ._subscribe import DurableEventStream, JournalCursor, SubscriptionsClose, journal_subscription

__all__ = [
    "CallRecord",
    "DurableJournal",
    "RecoveryReport",
    "open_journal",
    "result_from_json",
    "result_to_json",
]

ROOT_AGENT = "root"

_T = TypeVar("_T")

_NO_STARTS: dict[str, AppendTicket] = {}  # `DurableJournal._pending_starts` of a journal with none: never written


class _CommandInFlight:
    """A command's write, submitted and not concluded by the append that wrote it: a retry of the
    command waits until ``settled`` (that append knows the write's outcome, or gave up on it),
    then takes the ticket's outcome as its own."""

    __slots__ = ("settled", "ticket")

    def __init__(self, ticket: AppendTicket) -> None:
        self.ticket = ticket
        self.settled = trio.Event()


# `DurableJournal._in_flight` of a journal with no command in flight yet: never written.
_NO_COMMANDS: dict[tuple[str, str], _CommandInFlight] = {}


@attrs.frozen
class RecoveryReport:
    """What `DurableJournal.recover` decided and wrote for one stream.

    ``to_execute`` are the calls the session must run again as NEW attempts
    through the full live pipeline, each with its stored idempotency key.
    ``outcome_unknown`` are ``non_idempotent`` calls that started and may or may
    not have happened: the model and the user must be told.
    """

    plan: RecoveryPlan
    decisions: Mapping[str, ToolRecoveryAction]
    to_execute: tuple[ToolScheduled, ...]
    replayed: tuple[str, ...]
    outcome_unknown: tuple[str, ...]
    reconciled: tuple[str, ...]
    cancelled: tuple[str, ...]


class _Default:
    """The default of an option whose value depends on the store."""


_DEFAULT = _Default()


def _checked_agent_id(agent_id: object) -> str | None:
    """An agent id as the journal's methods take it: an id (`validate_id`, as stored ids were made),
    or ``None`` for the root. Anything else is a `ConfigError`: never a stream named after its
    ``repr`` (``5`` would come back as ``"5"`` after a reopen), never one no agent can have
    (``"../x"``: a subscription to it would wait for ever)."""
    if agent_id is None:
        return None
    if not isinstance(agent_id, str):
        raise ConfigError(f"agent_id must be a string (or None for the root), not {agent_id!r}")
    return validate_id(agent_id, name="agent_id", stored=True)


def _checked_name(value: object, what: str) -> str:
    """A session or root agent id given to `open_journal`: non-empty text a store can keep."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be a non-empty string, not {value!r}")
    return check_id(value, what)


def _recorded_at(now: object) -> float:
    """A store clock's reading that is not a plain finite float: an int is fine, anything else
    is the clock's bug, named before anything is written."""
    if type(now) is int:
        return float(now)
    raise JournalError(f"the store's clock returned {now!r}, not a finite number of seconds")


class DurableJournal:
    """One session's journal over a `JournalStore`. Open it with `open_journal`."""

    # Slotted, and nothing made before it is needed: thousands of sessions may hold one each.
    __slots__ = (
        "_checked_ids",
        "_commits_now",
        "_fenced",
        "_fold_after",
        "_in_flight",
        "_pending_starts",
        "_shut",
        "_streams",
        "_subscriptions",
        "commit_grace",
        "durable_pure_starts",
        "held",
        "owner",
        "recovered",
        "root_agent_id",
        "session_id",
        "store",
    )

    def __init__(
        self,
        store: JournalStore,
        *,
        session_id: str,
        owner: str,
        lease: Lease,
        lease_ttl: float,
        heartbeat_interval: float,
        durable_pure_starts: bool,
        commit_grace: float,
        root_agent_id: str,
        fold_after: int | None = FOLD_AFTER,
        sent: float | None = None,
    ) -> None:
        self.store = store
        self.session_id = session_id
        self.owner = owner
        self.held = HeldLease(
            store,
            lease,
            ttl=lease_ttl,
            interval=heartbeat_interval,
            sent=trio.current_time() if sent is None else sent,
        )
        self.durable_pure_starts = durable_pure_starts
        self.commit_grace = commit_grace
        self.root_agent_id = root_agent_id
        # A journal that snapshots folds its conversation as it goes (the snapshot needs it);
        # one that never does folds only when `conversation` is asked for.
        self._fold_after = fold_after
        self._streams: dict[str, _Stream] = {}
        self._checked_ids: dict[str | None, str] = {}  # agent id -> its stream id, checked once
        self._fenced: str | None = None
        self._subscriptions: SubscriptionsClose | None = None  # made by the first subscription
        self._shut = False
        # Call id -> the ticket of its unawaited start: the shared empty one until the first (only
        # ``durable_pure_starts=False`` makes any; it is never written to, see `on_execution_started`).
        self._pending_starts: dict[str, AppendTicket] = _NO_STARTS
        # (stream id, command id) -> its write in flight (`_submit`, `_settle_command`): the shared
        # empty one until the first (a store that commits at once never has one).
        self._in_flight: dict[tuple[str, str], _CommandInFlight] = _NO_COMMANDS
        self.recovered = False
        # A store whose leases never run out needs no heartbeat (`HeldLease`), and one that commits
        # at once (`JournalStore.commit`) needs no ticket: the memory store's appends never wait.
        # Only a class that defines commit itself is trusted: a wrapper may intercept `submit`.
        self._commits_now = "commit" in type(store).__dict__

    # -- the lease (held by `HeldLease`; these read and steer it)

    @property
    def lease(self) -> Lease:
        return self.held.lease

    @property
    def lease_ttl(self) -> float:
        return self.held.ttl

    @property
    def heartbeat_interval(self) -> float:
        return self.held.interval

    @property
    def renews_lease(self) -> bool:
        return self.held.expires

    @property
    def heartbeat_lag(self) -> float:
        """The longest a renewal came after it was due so far (seconds); see `HeldLease.lag`."""
        return self.held.lag

    @property
    def _lost(self) -> BaseException | None:
        return self.held.lost

    @property
    def _valid_until(self) -> float:
        return self.held.valid_until

    @_valid_until.setter
    def _valid_until(self, value: float) -> None:
        self.held.valid_until = value

    def _lose(self, exc: BaseException) -> None:
        self.held.lose(exc)

    # -- reading

    def stream_id(self, agent_id: str | None = None) -> str:
        return stream_id_for(self.session_id, agent_id or self.root_agent_id)

    @property
    def agents(self) -> list[str]:
        return [stream.agent_id for stream in self._streams.values()]

    def projection(self, agent_id: str | None = None) -> Projection:
        """The projection of one agent's stream (read it; never apply to it)."""
        return self._stream(agent_id).projection

    def call(self, call_id: str, agent_id: str | None = None) -> CallRecord | None:
        return self._stream(agent_id).calls.get(call_id)

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    @property
    def lost(self) -> bool:
        return self._lost is not None

    @property
    def closed(self) -> bool:
        return self._shut

    def _close(self) -> None:
        """No write from now on (the subscriptions hear of it in `_finish`, after their rest)."""
        self._shut = True

    def _subscriptions_close(self) -> SubscriptionsClose:
        """How the subscriptions end with the journal: each gets the rest of its stream, then
        ``closed`` is set (`_finish`; already set for a journal that is closed)."""
        close = self._subscriptions
        if close is None:
            close = self._subscriptions = SubscriptionsClose()
            if self._shut:
                close.closed.set()
        return close

    def _stream_id_of(self, agent_id: str | None) -> str:
        """`stream_id`, without formatting it again once a write checked it."""
        try:
            return self._checked_ids.get(agent_id) or self.stream_id(agent_id)
        except TypeError:  # an unhashable agent id: named as the wrong type it is
            _checked_agent_id(agent_id)
            raise

    def _stream(self, agent_id: str | None) -> _Stream:
        stream = self._streams.get(self._stream_id_of(agent_id))
        if stream is None:
            raise JournalError(f"session {self.session_id!r} has no stream for agent {agent_id!r}")
        return stream

    # -- ownership

    def check_ownership(self) -> None:
        """Raise `LeaseLostError` if the lease is lost or no longer valid by the local clock."""
        self.held.check()

    def fencing_token(self) -> int | None:
        return self.lease.token

    async def ensure_owner(self) -> None:
        """Confirm with the store, now, that this process still holds the lease; else `LeaseLostError`.

        It narrows the window in which a paused old owner can act after a takeover; it
        cannot close it (a pause may land between this check and the effect). Only a
        downstream that refuses stale fencing tokens, or deduplicates by idempotency key,
        closes it (see docs/durability.md, "Fencing external effects").
        """
        await self.held.confirm()

    # -- writing

    def _fence(self, why: str) -> None:
        if self._fenced is None:
            self._fenced = why

    def _check_writable(self) -> None:
        """Raise what refuses every write now: a lost lease (also one expired by the local clock),
        a closed journal, a fence. Checked before anything is taken from a stream to be written."""
        held = self.held
        if held.lost is not None:
            raise LeaseLostError(f"the lease on session {self.session_id!r} was lost: {held.lost}")
        if self._shut:
            raise JournalError(f"the journal of session {self.session_id!r} is closed")
        if self._fenced is not None:
            raise JournalFencedError(
                f"the journal of session {self.session_id!r} is fenced ({self._fenced}); call reconcile() first"
            )
        if held.expires:
            held.check()

    def _prepare(
        self, agent_id: str | None, events: tuple[Event, ...], command_id: str | None, *, defer: bool = False
    ) -> tuple[_Stream, AppendBatch | AppendResult | None]:
        held = self.held  # read once: every append passes here
        if held.lost is not None or self._shut or self._fenced is not None:
            self._check_writable()  # raises the refusal
        if held.expires:
            held.check()
        if not events:
            raise JournalError("append needs at least one event")
        try:
            stream_id = self._checked_ids.get(agent_id)
        except TypeError:  # an unhashable agent id: refused just below
            stream_id = None
        if stream_id is None:
            # Checked once, before the projection moves: an id no store can keep (or no id at
            # all) fails this append alone.
            stream_id = check_id(self.stream_id(_checked_agent_id(agent_id)), "stream id")
            self._checked_ids[agent_id] = stream_id
        stream = self._streams.get(stream_id)
        fresh = stream is None
        if stream is None:
            if not (isinstance(events[0], SessionCreated) and events[0].session_id == self.session_id):
                raise JournalError(f"the stream of agent {agent_id!r} must start with session_created")
            stream = _Stream(stream_id, agent_id or self.root_agent_id)
        now = self.store.clock()
        if type(now) is not float or not math.isfinite(now):
            now = _recorded_at(now)
        projection = stream.projection
        seq = projection._s.head  # `head`, without the property's call: every event passes here
        if len(events) == 1:  # most writes are one event (every `defer`)
            envelopes: tuple[EventEnvelope, ...] = (place_event(stream_id, seq + 1, events[0], now),)
        else:
            placed: list[EventEnvelope] = []
            for event in events:
                seq += 1
                placed.append(place_event(stream_id, seq, event, now))
            envelopes = tuple(placed)
        digest: str | None = None
        if command_id is not None:
            command_id = check_id(command_id, "command id")
            digest = command_digest(envelopes)
            known = stream.commands.get(command_id)
            if known is not None:
                if known[0] != digest:
                    raise CommandConflictError(
                        f"command {command_id!r} was already applied with different content", command_id=command_id
                    )
                return stream, append_result(stream_id, known[1], known[2], True)
        if stream.pins:
            stream.settle_pins()  # the pinned conversations are of before these events
        # `_Stream.track` of each event, in line (every event passes here; the pins are settled).
        unfolded = stream.unfolded
        # What `track_call` reads is read first: a snapshot's line that does not decode raises
        # before anything moved (`append` rebuilds it and prepares again).
        if len(envelopes) == 1:
            event = envelopes[0].event
            if type(event) in CALL_UPDATES:
                stream.read_call(event)
            # One refusal changes nothing (`Projection.apply_atomic`, without its call).
            projection._step(envelopes[0], True)
            if type(event) in CALL_EVENTS:
                stream.track_call(event)
            unfolded.append(event)
        else:
            for envelope in envelopes:
                if type(envelope.event) in CALL_UPDATES:
                    stream.read_call(envelope.event)
            projection.apply_atomic(envelopes)  # all or nothing: a refusal changes nothing
            for envelope in envelopes:
                event = envelope.event
                if type(event) in CALL_EVENTS:
                    stream.track_call(event)
                unfolded.append(event)
        fold_after = self._fold_after
        if fold_after is not None and len(unfolded) > fold_after:
            stream.fold_some()
        if fresh:
            self._streams[stream_id] = stream  # its first events were taken: the stream exists
        if defer:
            stream.deferred += envelopes
            return stream, None
        if command_id is not None:
            assert digest is not None
            # Known from now on, as the projection knows its events: a replay after a cancellation
            # that landed while the write was confirmed is a replay (a write that fails fences the
            # journal, and `reconcile` reads the commands again from the store).
            stream.commands[command_id] = (digest, envelopes[0].seq, envelopes[-1].seq)
        if stream.deferred:
            assert command_id is None  # `append` writes them on their own before a command
            envelopes = stream.deferred + envelopes
            stream.deferred = ()
        # Built from what this journal checked and counted itself (`AppendBatch.placed`).
        lease = held.lease
        batch = AppendBatch.placed(self.session_id, stream_id, lease.token, envelopes, command_id, digest, lease.owner)
        return stream, batch

    def defer(self, *events: Event, agent_id: str | None = None) -> None:
        """Apply ``events`` to the stream now and write them with its next append (or `flush`).

        For events whose loss in a crash recovery treats as if they never happened (a request
        or turn that started, a model reply that a re-run asks for again): they need not be
        durable on their own, so they cost no commit of their own. The next `append` writes
        them first, in one batch with its own events, and a close writes what is left. Raises
        what `append` raises for events that may not come next (nothing changes then).
        """
        self._prepare(agent_id, events, None, defer=True)

    async def flush(self) -> None:
        """Write every stream's deferred events (`defer`); returns once they are committed.
        Raises what `append` raises for a journal that may not write (lost, closed, fenced)."""
        for stream in list(self._streams.values()):
            if stream.deferred:
                self._check_writable()  # again for each: the write before may have fenced it
                await self._write(self._deferred_batch(stream))

    def _deferred_batch(self, stream: _Stream) -> AppendBatch:
        envelopes, stream.deferred = stream.deferred, ()
        lease = self.lease
        return AppendBatch.placed(self.session_id, stream.stream_id, lease.token, envelopes, owner=lease.owner)

    async def _write(self, batch: AppendBatch) -> AppendResult:
        if self._commits_now:
            # Committed before this returns: not a checkpoint (the caller's next await is one).
            return self._committed(batch)
        return await self._await(self._submit(batch))

    async def _write_together(self, batches: list[AppendBatch], *, release: bool = False) -> AppendResult | None:
        """Write *batches* in submission order, then (``release``) give the lease back: on a lane
        store in one transaction that resolves in one wake-up, elsewhere all handed over before
        the first is awaited (nothing else can take a place between them), confirmed in order.
        Returns the last batch's result; a refusal is raised (the journal is fenced), a failed
        release only logged (the lease expires on its own)."""
        store = self.store
        result: AppendResult | None = None
        if not isinstance(store, LaneStore):
            try:
                if self._commits_now:
                    for batch in batches:
                        result = self._committed(batch)
                else:
                    handed = [self._submit(batch) for batch in batches]
                    for index, ticket in enumerate(handed):
                        try:
                            result = await self._await(ticket)
                        except BaseException:
                            for later in handed[index + 1 :]:  # in flight behind it: learn how they end
                                await self._confirm(later)
                            raise
            finally:
                if release:
                    await self.held.release()
            return result
        releasing = None
        tickets: list[AppendTicket] = []
        with store.grouped():
            try:
                for batch in batches:
                    tickets.append(self._submit(batch))
            finally:  # the lease is given back even if a batch could not be handed over
                if release and self.held.lost is None and not self.held.pending:
                    releasing = store.submit_release(self.held.lease)
        refused: BaseException | None = None
        try:
            if tickets:
                # The group resolves at once: the last waiter's wake-up is everyone's, and
                # `_await` confirms it (bounded) if a cancellation lands here.
                result = await self._await(tickets[-1])
            elif releasing is not None:
                with contextlib.suppress(JournalError):
                    await releasing.wait()
        finally:
            failed = releasing.failure() if releasing is not None else None
            if failed is not None:
                logger.debug("releasing the lease on %s failed (it expires on its own): %s", self.session_id, failed)
            for ticket in tickets[:-1]:  # resolved with the last: a refusal fences the journal
                if ticket.done and refused is None:
                    try:
                        self._outcome(ticket)
                    except (JournalError, LeaseLostError) as exc:
                        refused = exc
        if refused is not None:
            raise refused
        return result

    def _submit(self, batch: AppendBatch) -> AppendTicket:
        """Hand *batch* to the store (with the lease's acquisition ahead of it while that is
        `HeldLease.pending`). The projection already moved: a store that raises here (not open,
        a bug) leaves what it holds unknown, so the journal is fenced, as for any refusal."""
        try:
            held = self.held
            if held.pending:
                store = self.store
                assert isinstance(store, LaneStore)  # only a keeper's store has pending leases
                with store.grouped():
                    held.submit_acquire()
                    ticket = store.submit(batch)
            else:
                ticket = self.store.submit(batch)
        except Exception as exc:
            self._refused(exc)
            raise
        if batch.command_id is not None:
            # The command is in the replay cache already (`_prepare`): a retry must not be told it
            # applied before this write is known to have (`_replay_in_flight`).
            if self._in_flight is _NO_COMMANDS:
                self._in_flight = {}
            self._in_flight[batch.stream_id, batch.command_id] = _CommandInFlight(ticket)
        return ticket

    def _settle_command(self, batch: AppendBatch) -> None:
        """The append that wrote *batch* (a command's) is done waiting for it: wake its retries."""
        assert batch.command_id is not None
        flight = self._in_flight.pop((batch.stream_id, batch.command_id), None)
        if flight is not None:
            flight.settled.set()

    async def _replay_in_flight(self, flight: _CommandInFlight, command_id: str) -> None:
        """A retry of a command whose first write was in flight: wait until the append that wrote
        it concluded, then answer as it was answered. A refusal is raised as it refused that write;
        an outcome it gave up on (not confirmed in time) or a command the store already held
        leaves the journal fenced, and the retry raises that. Cancelling the retry leaves the
        write alone: its own append confirms it (`_await`, `_confirm`)."""
        await flight.settled.wait()
        ticket = flight.ticket
        if ticket.done and not self._outcome(ticket).replayed:  # `_outcome` raises what refused it
            return
        self._check_writable()  # fenced (or lost) by the append that wrote it
        raise JournalFencedError(
            f"the first write of command {command_id!r} of session {self.session_id!r} did not conclude; "
            "the journal is fenced: call reconcile()"
        )

    async def append(self, *events: Event, agent_id: str | None = None, command_id: str | None = None) -> AppendResult:
        """Append ``events`` atomically to an agent's stream (the root's by default).

        Returns once they are committed. With ``command_id``, an identical
        replay returns the first outcome (``replayed=True``) and the same id
        with other content raises `CommandConflictError`.
        """
        ahead: AppendBatch | None = None
        if command_id is not None:
            # A command's batch holds its own events only (its digest and seqs are replayed): what
            # is deferred goes in a batch before it, in the same transaction where the store can.
            waiting = self._streams.get(self._stream_id_of(agent_id))
            if waiting is not None and waiting.deferred:
                self._check_writable()  # nothing is taken from a journal that may not write
                ahead = self._deferred_batch(waiting)
        damaged: _Stream | None = None
        try:
            _, prepared = self._prepare(agent_id, events, command_id)
        except BaseException as exc:
            if ahead is not None:
                await self._write(ahead)  # taken from the stream: written whatever this refused
            if isinstance(exc, JournalCorruptError):
                damaged = self._streams.get(self._stream_id_of(agent_id))
            if damaged is None or not damaged.damaged():
                raise
        if damaged is not None:
            # A line of the stream's snapshot did not decode, and nothing moved (`_prepare`): the
            # lines are rebuilt from the events, then the append starts again (it cannot fail so twice).
            await self._rebuild_lines(damaged)
            return await self.append(*events, agent_id=agent_id, command_id=command_id)
        if isinstance(prepared, AppendResult):
            if ahead is not None:
                await self._write(ahead)
            assert command_id is not None  # only a command is replayed
            flight = self._in_flight.get((prepared.stream_id, command_id)) if self._in_flight else None
            if flight is not None:
                await self._replay_in_flight(flight, command_id)
            elif ahead is None:
                await trio.lowlevel.checkpoint()
            return prepared
        assert prepared is not None
        if self._commits_now:
            if ahead is not None:
                self._committed(ahead)
            result = self._committed(prepared)  # as `_write`, without a coroutine of its own
        elif ahead is not None:
            try:
                written = await self._write_together([ahead, prepared])
            finally:
                self._settle_command(prepared)
            assert written is not None  # the last batch's
            result = written
        elif command_id is not None:
            try:
                result = await self._await(self._submit(prepared))
            finally:
                self._settle_command(prepared)
        else:
            result = await self._await(self._submit(prepared))
        if result.replayed:
            # The store held this command and the journal did not: the projection now holds its
            # events once more than the store does.
            self._fence(f"command {command_id!r} was already in the store")
            raise JournalFencedError(
                f"command {command_id!r} of session {self.session_id!r} was already in the store, though "
                "this journal had not seen it; the journal is fenced: call reconcile()"
            )
        return result

    @property
    def never_blocks(self) -> bool:
        """Whether `on_tool_settled` never checkpoints: on a store that commits at once (the memory
        store) a settlement cannot be interrupted, so the pipeline needs no shield around it."""
        return self._commits_now

    def _refused(self, exc: BaseException) -> None:
        """A write the store refused, or whose outcome is unknown: the journal is fenced (and a
        stale token means the lease is lost)."""
        if isinstance(exc, StaleFencingTokenError):
            self._lose(exc)
            self._fence(str(exc))
        else:
            self._fence(f"{type(exc).__name__}: {exc}")

    def _outcome(self, ticket: AppendTicket) -> AppendResult:
        """The outcome of a resolved ticket (raises, fenced, what refused it)."""
        try:
            return ticket.outcome()
        except (StaleFencingTokenError, JournalError) as exc:
            self._refused(exc)
            raise

    def _committed(self, batch: AppendBatch) -> AppendResult:
        try:
            result: AppendResult = self.store.commit(batch)  # type: ignore[attr-defined]
            return result
        except Exception as exc:  # refused, or a store's bug: either way the projection is ahead
            self._refused(exc)
            raise

    async def _await(self, ticket: AppendTicket) -> AppendResult:
        try:
            try:
                return await ticket.wait()
            except trio.Cancelled:
                await self._confirm(ticket)
                raise  # the cancellation goes on, whatever the write's outcome was
        except (StaleFencingTokenError, JournalError) as exc:
            self._refused(exc)
            raise

    async def _confirm(self, ticket: AppendTicket) -> None:
        """Learn how a submitted write ended, where its waiter cannot wait for it (a cancellation,
        or a write before it that failed): it lands or fails regardless, so wait for it, shielded
        and bounded, that the projection stays true; a refusal, or no answer in time, fences."""
        with (
            bounded_shield(self.commit_grace, "confirming a journal commit after cancellation"),
            contextlib.suppress(JournalError, LeaseLostError),
        ):
            await ticket.wait()
        if not ticket.done:
            self._fence("a commit was not confirmed before cancellation")
        else:
            try:
                ticket.outcome()
            except (JournalError, LeaseLostError) as exc:
                self._refused(exc)

    async def reconcile(self) -> None:
        """Re-read every stream of the session from the store and lift the fence.

        The store is the truth: a write whose outcome was unknown is either
        there or not, and the projections are rebuilt from what is there.
        """
        for ticket in list(self._pending_starts.values()):
            if not ticket.done:
                with trio.move_on_after(self.commit_grace), contextlib.suppress(JournalError, LeaseLostError):
                    await ticket.wait()
        self._pending_starts.clear()
        await self._load()
        self._fenced = None
        root = self.root_agent_id
        if self.stream_id(root) not in self._streams:
            # Its deferred session_created never landed (`_begin`): the root starts again.
            self.defer(SessionCreated(session_id=self.session_id, agent_id=root, parent_agent_id=None), agent_id=root)

    async def _load(self) -> None:
        streams: dict[str, _Stream] = {}
        prefix = f"{self.session_id}/"
        now = type(self.store).__dict__.get("streams_now")  # as `acquire` does for the lease
        infos = now(self.store, self.session_id) if now is not None else await self.store.streams(self.session_id)
        for info in infos:
            if not info.stream_id.startswith(prefix):
                raise ForeignStreamError(f"stream {info.stream_id!r} is not named after session {self.session_id!r}")
            agent_id = info.stream_id[len(prefix) :]
            stream = await self._restore(info.stream_id, agent_id, info.head)
            try:
                await self._catch_up(stream, info.head)
            except JournalCorruptError as exc:
                if stream.snapshot_seq == 0:
                    raise
                # The tail (or the commands since) does not follow the snapshot: the snapshot is
                # wrong, the events decide.
                logger.warning("ignoring the snapshot of %s: %s; replaying the stream in full", info.stream_id, exc)
                stream = _Stream(info.stream_id, agent_id)
                await self._catch_up(stream, info.head)
            streams[info.stream_id] = stream
        self._streams = streams

    async def _restore(self, stream_id: str, agent_id: str, head: int) -> _Stream:
        """The stream as its snapshot has it, or empty if it has no usable one (logged)."""
        load = getattr(self.store, "load_snapshot", None)  # a store from before snapshots has none
        if load is not None:
            try:
                found: tuple[int, bytes] | None = await load(stream_id)
                if found is not None:
                    seq, body = found
                    if seq > head:
                        raise JournalCorruptError(f"snapshot {stream_id}@{seq} lies past the stream's head {head}")
                    return decode_snapshot(stream_id, agent_id, seq, body)
            except JournalCorruptError as exc:
                logger.warning("ignoring the snapshot of %s: %s; replaying the stream in full", stream_id, exc)
        return _Stream(stream_id, agent_id)

    async def _rebuild_lines(self, stream: _Stream) -> None:
        """The snapshot ``stream`` was restored from is unusable: a lookup found one of its index
        lines not to decode (`_Stream.damaged`). Rebuild every line still stored as text from the
        events up to ``snapshot_seq`` and the store's commands, as a replay has them (logged).

        No race with the writes: the events up to a snapshot's seq were committed before it was
        saved and are never rewritten, what was applied since stays in the indexes as it is, and
        the lines are swapped in one step after the last read. A cancellation before that leaves
        the stream as it was (still damaged: the next lookup reports it and this runs again). One
        rebuild at a time per stream; another caller waits for it, then finds nothing to do."""
        while (running := stream.rebuilding) is not None:
            await running.wait()
        problems = stream.damaged()
        if not problems:
            return
        done = stream.rebuilding = trio.Event()
        try:
            seq = stream.snapshot_seq
            logger.warning(
                "the snapshot of %s cannot be used: %s; rebuilding its indexes from the events up to seq %d",
                stream.stream_id,
                "; ".join(problems),
                seq,
            )
            rebuilt = _Stream(stream.stream_id, stream.agent_id)
            projection = rebuilt.projection
            while projection.head < seq:
                page = await self.store.read(
                    stream.stream_id, after=projection.head, limit=min(1000, seq - projection.head)
                )
                if not page:
                    raise JournalCorruptError(f"stream {stream.stream_id!r} holds {projection.head} events, not {seq}")
                for envelope in page:
                    try:
                        projection.apply(envelope)
                    except InvalidTransitionError as exc:
                        raise JournalCorruptError(
                            f"stored stream {stream.stream_id!r} breaks the journal's rules at seq {envelope.seq}: "
                            f"{exc}"
                        ) from exc
                    if type(envelope.event) in CALL_EVENTS:
                        rebuilt.track_call(envelope.event)
            records = await self.store.commands(stream.stream_id)
            commands = {record.command_id: (record.digest, record.first_seq, record.last_seq) for record in records}
            stream.rebuild_lines(rebuilt, commands)
            # Restored from no usable snapshot, as a replay in full: the next `snapshot_all` saves it anew.
            stream.snapshot_seq = 0
        finally:
            stream.rebuilding = None
            done.set()

    async def _read(self, stream: _Stream, read: Callable[[], _T]) -> _T:
        """``read()`` of ``stream``'s state; one that met an index line of its snapshot that does not
        decode (and changed nothing) is asked again once the lines are rebuilt (`_rebuild_lines`)."""
        try:
            return read()
        except JournalCorruptError:
            if not stream.damaged():
                raise
        await self._rebuild_lines(stream)
        return read()

    async def _catch_up(self, stream: _Stream, head: int) -> None:
        """Apply the events and add the command ids stored after the stream's snapshot (if any)."""
        await self._replay(stream, head)
        for record in await self.store.commands(stream.stream_id, after=stream.snapshot_seq):
            stream.commands[record.command_id] = (record.digest, record.first_seq, record.last_seq)

    async def _replay(self, stream: _Stream, head: int) -> None:
        """Apply the stored events after the stream's head, up to ``head`` (the store's)."""
        while True:
            await self._replay_pages(stream)
            held = stream.projection.head
            if held <= head:
                break
            # A write of ours that was not confirmed in time (`reconcile`) may land after the heads
            # were read: the store's head, read again, counts it then (and what landed since, read
            # in turn). A head that still claims fewer events than the stream holds is damage.
            now = await self.store.head(stream.stream_id)
            if now <= head:
                break
            head = now
        if stream.projection.head != head:
            raise JournalCorruptError(
                f"stream {stream.stream_id!r} claims head {head} but holds {stream.projection.head} events"
            )

    async def _replay_pages(self, stream: _Stream) -> None:
        """Apply every stored event after the stream's head."""
        after = stream.projection.head
        while True:
            page = await self.store.read(stream.stream_id, after=after, limit=1000)
            if not page:
                break
            for envelope in page:
                try:
                    stream.apply(envelope, fold_after=self._fold_after)
                except InvalidTransitionError as exc:
                    raise JournalCorruptError(
                        f"stored stream {stream.stream_id!r} breaks the journal's rules at seq {envelope.seq}: {exc}"
                    ) from exc
                except Exception as exc:
                    if stream.snapshot_seq == 0:
                        raise  # the events alone: the projection's own bug, not stored damage
                    # A snapshot whose state contradicts itself in a way `decode_snapshot` did not
                    # see: the events after it do not apply, so the snapshot is wrong (`_load`).
                    raise JournalCorruptError(
                        f"stored stream {stream.stream_id!r} does not follow its snapshot at seq {envelope.seq}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
            after = page[-1].seq

    # -- snapshots and the conversation

    def conversation(self, agent_id: str | None = None) -> list[Message]:
        """One agent's conversation (the root's by default) as `fold_conversation` of every event
        of its stream gives it, without reading the stream (`JournalCorruptError` for a payload
        that cannot be read)."""
        return self._stream(agent_id).folded().messages()

    def deferred_conversation(self, agent_id: str | None = None) -> Callable[[], list[Message]]:
        """One agent's conversation as it stands now, folded and decoded when first called (or at
        the latest before its stream takes another event): what a reopen hands on without reading."""
        return self._stream(agent_id).pin()

    def conversation_fold(self, agent_id: str | None = None) -> ConversationFold:
        """The incremental fold of one agent's stream, caught up (read it; never feed it):
        ``outcomes_since_reply`` and ``last_output`` are there too."""
        return self._stream(agent_id).folded()

    def _healthy(self) -> bool:
        if self._lost is not None or self._fenced is not None:
            return False
        for ticket in self._pending_starts.values():
            if not ticket.done:
                return False
            try:
                ticket.outcome()
            except (JournalError, LeaseLostError):
                return False
        return True

    async def snapshot_all(self, *, min_events: int = 1) -> list[str]:
        """Save a snapshot of every stream at least ``min_events`` past its last one; best effort.

        Returns the stream ids saved. Nothing is saved unless the journal is healthy (lease
        held, not fenced, every submitted start committed); a stream whose snapshot cannot be
        made or saved is logged (WARNING) and skipped: the events stay the truth. A stream whose
        snapshot a lookup found damaged has its lines rebuilt first (`_rebuild_lines`) and is saved
        anew, never with the damage carried on. A ``min_events`` that is not an int is a `ConfigError`.
        """
        if isinstance(min_events, bool) or not isinstance(min_events, int):
            raise ConfigError(f"min_events must be a number of events, not {min_events!r}")
        save = getattr(self.store, "save_snapshot", None)
        saved: list[str] = []
        if save is None:
            await trio.lowlevel.checkpoint()
            return saved
        if self._healthy():
            try:
                await self.flush()  # a snapshot stands for written events only
            except (JournalError, LeaseLostError) as exc:
                logger.warning("no snapshot: the deferred events were not written: %s: %s", type(exc).__name__, exc)
                return saved
        for stream in list(self._streams.values()):
            if not self._healthy():
                break
            try:
                if stream.damaged():
                    # A lookup found a line of its snapshot damaged: never carried on into the next.
                    await self._rebuild_lines(stream)
                if stream.projection.head - stream.snapshot_seq < max(min_events, 1):
                    continue
                # The store's commands as well as the cache's: what the snapshot holds is what the store holds.
                since = await self.store.commands(stream.stream_id, after=stream.snapshot_seq)
                seq = stream.projection.head
                commands = [(c.command_id, c.digest, c.first_seq, c.last_seq) for c in since]
                body = await self._read(stream, functools.partial(encode_snapshot, stream, commands))
                await save(self.session_id, stream.stream_id, seq, self.lease.token, body)
            except (JournalError, LeaseLostError) as exc:
                logger.warning("the snapshot of %s was not saved: %s: %s", stream.stream_id, type(exc).__name__, exc)
                if isinstance(exc, StaleFencingTokenError):
                    self._lose(exc)  # as an append would: another process owns the session now
                continue
            stream.snapshot_seq = seq
            saved.append(stream.stream_id)
        return saved

    async def _begin(self, *, new: bool, defer_created: bool) -> None:
        """Load the session's streams (a session id made just now has none to read) and create
        the root agent's. ``defer_created``: its ``session_created`` is deferred (`defer`), written
        with the first append or at the close; a crash before either leaves no trace of a
        session that recorded nothing."""
        if not new:
            await self._load()
        root = self.root_agent_id
        if not defer_created:
            await self.open_agent(root)
        elif self.stream_id(root) not in self._streams:
            self.defer(SessionCreated(session_id=self.session_id, agent_id=root, parent_agent_id=None), agent_id=root)

    async def open_agent(self, agent_id: str, *, parent_agent_id: str | None = None) -> None:
        """Create an agent's stream (its ``session_created`` event) if it does not exist yet."""
        if self.stream_id(agent_id) in self._streams:
            await trio.lowlevel.checkpoint()
            return
        await self.append(
            SessionCreated(session_id=self.session_id, agent_id=agent_id, parent_agent_id=parent_agent_id),
            agent_id=agent_id,
        )

    # -- the tool pipeline's lifecycle

    def _call_stream(self, call: ScheduledCall) -> _Stream:
        if call.session_id != self.session_id:
            raise ForeignStreamError(
                f"call {call.call_id!r} is of session {call.session_id!r}, not {self.session_id!r}"
            )
        return self._stream(call.agent_id)

    def call_state(self, call: ScheduledCall) -> str | None:
        """Where the projection holds *call* (`ToolJournal.call_state`).

        A started call that recovery decided to re-run counts as ``"scheduled"``:
        it may start again.
        """
        stream = self._streams.get(self._stream_id_of(call.agent_id))
        record = stream.projection.tool(call.call_id) if stream is not None else None
        if record is None:
            return None
        if record.state.settled:
            return "settled"
        if record.state is ToolState.STARTED and not record.rerun_allowed:
            return "started"
        return "scheduled"

    async def on_tool_scheduled(self, call: ScheduledCall) -> None:
        stream = self._call_stream(call)
        existing, record = await self._read(
            stream, lambda: (stream.calls.get(call.call_id), stream.projection.tool(call.call_id))
        )
        if existing is not None and record is not None:
            # A new attempt of a recovered call: allowed only where recovery decided a (re)run.
            if record.state.settled or record.decision not in (
                ToolRecoveryAction.RUN,
                ToolRecoveryAction.RERUN,
                ToolRecoveryAction.RERUN_SAME_KEY,
            ):
                raise JournalError(f"tool call {call.call_id!r} was already scheduled and may not run again")
            if existing.scheduled.idempotency_key != call.idempotency_key:
                raise JournalError(f"tool call {call.call_id!r} must re-run with its stored idempotency key")
            if existing.scheduled.tool_name != call.tool_name or existing.scheduled.model_input != call.model_input:
                raise JournalError(
                    f"tool call {call.call_id!r} must re-run as scheduled: "
                    f"{existing.scheduled.tool_name} with the stored model input"
                )
            await trio.lowlevel.checkpoint()
            return
        behavior = call.behavior
        # Frozen and checked in one walk; what is not JSON goes to the event's own check, which names it.
        model_input = copy_if_json(call.model_input)
        build = tool_scheduled_copied
        if type(model_input) is not dict:
            model_input, build = json_copy(call.model_input), tool_scheduled
        # Deferred: the call's start (durable before the tool runs) or its settlement writes it.
        self.defer(
            build(
                call.request_id,
                call.turn_id,
                call.call_id,
                call.tool_name,
                model_input,
                behavior.side_effect,
                behavior.kind,
                behavior.interrupt,
                behavior.concurrency_safe,
                call.idempotency_key,
            ),
            agent_id=call.agent_id,
        )

    async def on_execution_started(
        self, call: ScheduledCall, input: dict[str, Any], side_effect: SideEffect, *, synthetic: bool
    ) -> None:
        self._call_stream(call)
        copied = copy_if_json(input)  # as in `on_tool_scheduled`
        if type(copied) is dict:
            event = tool_started_copied(call.request_id, call.turn_id, call.call_id, copied, side_effect, synthetic)
        else:
            event = tool_started(
                call.request_id, call.turn_id, call.call_id, json_copy(dict(input)), side_effect, synthetic
            )
        if side_effect is SideEffect.PURE and not self.durable_pure_starts and not synthetic:
            # Explicit opt-in for pure tools only: submit without waiting for the commit.
            _, prepared = self._prepare(call.agent_id, (event,), None)
            assert isinstance(prepared, AppendBatch)
            if self._pending_starts is _NO_STARTS:
                self._pending_starts = {}
            self._pending_starts[call.call_id] = self._submit(prepared)
            await trio.lowlevel.checkpoint()
            return
        await self.append(event, agent_id=call.agent_id)

    async def on_tool_settled(self, call: ScheduledCall, settlement: Settlement) -> None:
        self._call_stream(call)
        pending = self._pending_starts.pop(call.call_id, None)
        if pending is not None and pending.done:
            self._outcome(pending)  # raises if the start was refused
            pending = None
        event: Event
        status = settlement.status
        if status is SettlementStatus.COMPLETED:
            event = tool_completed(
                call.request_id, call.turn_id, call.call_id, result_to_json(settlement.result), settlement.published
            )
        elif status is SettlementStatus.FAILED:
            event = tool_failed(
                call.request_id, call.turn_id, call.call_id, result_to_json(settlement.result), settlement.published
            )
        elif status is SettlementStatus.CANCELLED:
            event = tool_cancelled(
                call.request_id,
                call.turn_id,
                call.call_id,
                settlement.reason or "cancelled",
                result_to_json(settlement.result),
                settlement.published,
            )
        else:
            event = ToolOutcomeUnknown(
                request_id=call.request_id,
                turn_id=call.turn_id,
                call_id=call.call_id,
                reason=OutcomeUnknownReason.COMMIT_OUTCOME_UNKNOWN,
            )
        if pending is None:
            await self.append(event, agent_id=call.agent_id)
            return
        # The start is still in flight: queue the settlement right behind it (one group commit
        # can take both; the store's sequence check refuses the settlement if the start failed)
        # and report success only when both are committed.
        _, prepared = self._prepare(call.agent_id, (event,), None)
        assert isinstance(prepared, AppendBatch)
        settled = self._submit(prepared)
        try:
            await self._await(pending)
        except BaseException:
            await self._confirm(settled)  # submitted behind the start: how it ends is learned too
            raise
        await self._await(settled)

    # -- recovery

    def recovery_plan(
        self,
        agent_id: str | None = None,
        *,
        tools: Mapping[str, Tool[Any]] | None = None,
        agent_continues: bool = True,
    ) -> RecoveryPlan:
        """The projection's plan for one stream; ``tools`` tells which tools have a ``reconcile``;
        ``agent_continues=False``: the stream's agent never runs again, so its calls that never
        started are cancelled (`Projection.recovery_plan`)."""
        known = tools or {}

        def has_reconcile(name: str) -> bool:
            tool = known.get(name)
            return tool is not None and tool.reconcile is not None

        return self._stream(agent_id).projection.recovery_plan(has_reconcile, agent_continues=agent_continues)

    async def recover(
        self,
        agent_id: str | None = None,
        *,
        tools: Mapping[str, Tool[Any]] | None = None,
        agent_continues: bool = True,
        reconcile_timeout: float = 600.0,
    ) -> RecoveryReport:
        """Apply the recovery plan of one stream: write decisions and settlements only.

        Never executes a tool and never runs middleware. Settled calls keep
        their stored result; calls that may run (again) get a decision and are
        returned in ``to_execute`` for the session to run through its live
        pipeline with the stored idempotency key; a started ``non_idempotent``
        call is reconciled by its tool's ``reconcile`` if it has one (a check,
        not the side effect), else settled ``outcome_unknown``. Model attempts
        without an outcome are recorded aborted (``process_restart``).
        ``agent_continues=False`` (the stream's agent never runs again, e.g. a subagent
        after a restart): the calls it scheduled and never started are settled cancelled.
        A ``reconcile`` may take its tool's ``timeout``, else *reconcile_timeout* seconds (the
        pipeline's default); one that does not answer by then "cannot tell".
        """
        reconcile_timeout = finite_seconds(reconcile_timeout, "reconcile_timeout", maximum=MAX_TIMEOUT)
        stream = self._stream(agent_id)
        known = tools or {}
        plan = self.recovery_plan(agent_id, tools=known, agent_continues=agent_continues)
        decisions: dict[str, ToolRecoveryAction] = {}
        to_execute: list[ToolScheduled] = []
        unknown: list[str] = []
        reconciled: list[str] = []
        cancelled: list[str] = []
        replayed = [
            call_id for call_id, action in plan.tool_actions.items() if action is ToolRecoveryAction.REPLAY_RESULT
        ]
        for item in plan.items:
            if item.kind is RecoveryKind.MODEL_ATTEMPT_WITHOUT_OUTCOME:
                assert item.turn_id is not None and item.attempt_id is not None
                await self.append(
                    ModelAttemptAborted(
                        request_id=item.request_id,
                        turn_id=item.turn_id,
                        attempt_id=item.attempt_id,
                        reason=ModelAbortReason.PROCESS_RESTART,
                    ),
                    agent_id=agent_id,
                )
                continue
            if item.kind is RecoveryKind.PENDING_PERMISSION:
                # Nobody can answer the old question any more, and a call may ask only once:
                # the permission is cancelled and the call settles cancelled (the model is told).
                assert item.call_id is not None and item.turn_id is not None and item.permission_id is not None
                ids0: dict[str, Any] = {"request_id": item.request_id, "turn_id": item.turn_id, "call_id": item.call_id}
                await self.append(
                    PermissionResolved(**ids0, permission_id=item.permission_id, decision=PermissionDecision.CANCEL),
                    RecoveryDecision(
                        **ids0, decision=ToolRecoveryAction.CANCEL, reason="a permission was pending at the restart"
                    ),
                    ToolCancelled(**ids0, reason="permission pending at restart"),
                    agent_id=agent_id,
                )
                decisions[item.call_id] = ToolRecoveryAction.CANCEL
                cancelled.append(item.call_id)
                continue
            if item.kind not in (RecoveryKind.TOOL_STARTED_WITHOUT_OUTCOME, RecoveryKind.TOOL_SCHEDULED_NOT_STARTED):
                continue
            if item.call_id in decisions:
                continue  # settled above (its permission was pending)
            assert item.call_id is not None and item.action is not None and item.turn_id is not None
            record = await self._read(stream, functools.partial(stream.calls.__getitem__, item.call_id))
            ids: dict[str, Any] = {"request_id": item.request_id, "turn_id": item.turn_id, "call_id": item.call_id}
            action = item.action
            decisions[item.call_id] = action
            if action in (ToolRecoveryAction.RUN, ToolRecoveryAction.RERUN, ToolRecoveryAction.RERUN_SAME_KEY):
                reason = {
                    ToolRecoveryAction.RUN: "scheduled but never started: safe to run",
                    ToolRecoveryAction.RERUN: "pure call started without an outcome: runs again",
                    ToolRecoveryAction.RERUN_SAME_KEY: "idempotent call started without an outcome: "
                    "runs again with the same idempotency key",
                }[action]
                await self.append(RecoveryDecision(**ids, decision=action, reason=reason), agent_id=agent_id)
                to_execute.append(record.scheduled)
            elif action is ToolRecoveryAction.CANCEL:
                tracked = stream.projection.tool(item.call_id)
                if tracked is not None and tracked.permission in (PermissionState.DENIED, PermissionState.CANCELLED):
                    why, settled_why = "permission was denied or cancelled", "permission denied before restart"
                else:
                    why = "scheduled but never started, and its agent does not run again: never run"
                    settled_why = "its agent does not run again after the restart"
                await self.append(
                    RecoveryDecision(**ids, decision=action, reason=why),
                    ToolCancelled(**ids, reason=settled_why),
                    agent_id=agent_id,
                )
                cancelled.append(item.call_id)
            elif action is ToolRecoveryAction.RECONCILE:
                tool = known[record.scheduled.tool_name]
                outcome, why_unknown = await self._reconcile(tool, record, reconcile_timeout)
                if outcome is None:
                    await self.append(
                        RecoveryDecision(**ids, decision=action, reason=why_unknown),
                        ToolOutcomeUnknown(**ids, reason=OutcomeUnknownReason.PROCESS_RESTART),
                        agent_id=agent_id,
                    )
                    unknown.append(item.call_id)
                else:
                    settle: Event = (
                        ToolCompleted(**ids, result=result_to_json(outcome))
                        if outcome.error is None
                        else ToolFailed(**ids, result=result_to_json(outcome))
                    )
                    await self.append(
                        RecoveryDecision(**ids, decision=action, reason="reconcile reported the outcome"),
                        settle,
                        agent_id=agent_id,
                    )
                    reconciled.append(item.call_id)
            else:
                await self.append(
                    RecoveryDecision(
                        **ids,
                        decision=ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN,
                        reason="non_idempotent call started without an outcome and has no reconcile: never re-run",
                    ),
                    ToolOutcomeUnknown(**ids, reason=OutcomeUnknownReason.NO_RECONCILE),
                    agent_id=agent_id,
                )
                unknown.append(item.call_id)
        self.recovered = True
        return RecoveryReport(
            plan=plan,
            decisions=decisions,
            to_execute=tuple(to_execute),
            replayed=tuple(replayed),
            outcome_unknown=tuple(unknown),
            reconciled=tuple(reconciled),
            cancelled=tuple(cancelled),
        )

    async def _reconcile(self, tool: Tool[Any], record: CallRecord, limit: float) -> tuple[ToolResult | None, str]:
        """What *tool*'s ``reconcile`` says of a started call: its result, or ``None`` ("cannot
        tell") and why. The hook is the tool's code: when it raises or answers what the journal
        cannot store (no `ToolResult` or ``None``, a result that is no JSON) that is "cannot tell"
        too, so the call settles ``outcome_unknown`` instead of failing the recovery, and with it
        every reopen of the session. Cancellation goes on, and a `LeaseLostError` when this
        journal's own lease is lost (a reconciler may drive a store of its own). A hook that does not
        answer within *limit* seconds (its tool's own ``timeout`` wins) cannot tell either: a hanging one
        would otherwise hold the session's open for ever."""
        assert tool.reconcile is not None
        call = f"reconcile of {tool.name} call {record.scheduled.call_id}"
        started = record.started_input if record.started_input is not None else record.scheduled.model_input
        if tool.timeout is not None:
            limit = tool.timeout
        try:
            with trio.move_on_after(limit) as bound:
                outcome = await tool.run_reconcile(
                    json_copy(started), record.scheduled.idempotency_key, fencing_token=self.lease.token
                )
            if bound.cancelled_caught:
                problem = f"did not answer within {limit:g} s"
                logger.warning("%s %s; its outcome is unknown", call, problem)
                return None, f"reconcile {problem}: could not tell whether it happened"
        except Exception as exc:
            if isinstance(typed_error(exc), LeaseLostError):
                await self.ensure_owner()  # asks the store: raises when the lease lost is this journal's
            problem = f"raised {describe(exc, 'repr')}"
        else:
            if outcome is None:
                return None, "reconcile could not tell whether it happened"
            if not isinstance(outcome, ToolResult):
                problem = f"returned {type(outcome).__name__}, expected a ToolResult or None"
            else:
                result_issue = result_problem(outcome)
                if result_issue is None:
                    return outcome, ""
                problem = f"returned a result that cannot be stored: {result_issue}"
        logger.warning("%s %s; its outcome is unknown", call, problem)
        return None, f"reconcile {problem}: could not tell whether it happened"

    # -- subscriptions

    def subscribe_durable_events(
        self, *, agent_id: str | None = None, after: JournalCursor | str | int = 0
    ) -> AbstractAsyncContextManager[DurableEventStream]:
        """Committed events of one agent's stream: replay, one `CaughtUp`, then live (ends when the journal closes).

        The stream need not exist yet (a subagent's is made when it starts), but its agent id must be
        one a stream can have: anything else is a `ConfigError`, never a subscription that waits for ever.
        """
        stream_id = check_id(self.stream_id(_checked_agent_id(agent_id)), "stream id")
        return journal_subscription(self.store, stream_id, self._subscriptions_close(), after=after)


def unknown_outcome_result(call_id: str, tool_name: str) -> ToolResult:
    """What the model sees for a ``non_idempotent`` call whose outcome is unknown after a restart."""
    return ToolResult.failure(
        ToolErrorType.INTERRUPTED,
        f"the outcome of {tool_name} call {call_id} is unknown: the process stopped after it started. "
        "It was NOT run again; verify whether it took effect before retrying.",
        code="outcome_unknown",
    )


# What every JournalStore has (the protocol is not runtime-checkable): enough to tell a store from a mistake.
_STORE_METHODS = ("submit", "read", "acquire_lease", "release_lease")


def is_journal_store(value: object) -> bool:
    """Whether *value* has what every `JournalStore` has (ours, a wrapper's, a test double's)."""
    if isinstance(value, (LaneStore, MemoryStore)):
        return True
    try:
        return all(callable(getattr(value, name, None)) for name in _STORE_METHODS)
    except Exception:  # a property of the caller's object that raises: not a store either
        return False


def _check_store(store: object) -> None:
    """`open_journal`'s *store*: a mistake is a `ConfigError` naming what goes there, not an
    ``AttributeError`` from deep inside the first lease operation."""
    if is_journal_store(store):
        return
    if isinstance(store, (str, bytes, os.PathLike)):
        raise ConfigError(
            f"open_journal takes an open JournalStore, not the path {safe_repr(store)}: open the file's "
            "store with open_sqlite_store(path) and pass that (open_session(journal=path) does both)"
        )
    raise ConfigError(
        "open_journal takes a JournalStore (a MemoryStore, or the store of open_sqlite_store or "
        f"open_postgres_store), not {type(store).__name__} {safe_repr(store)}"
    )


def open_journal(
    store: JournalStore,
    *,
    session_id: str | None = None,
    owner: str | None = None,
    lease_ttl: float = 30.0,
    heartbeat_interval: float | None = None,
    takeover_timeout: float = 0.0,
    durable_pure_starts: bool = True,
    commit_grace: float = 10.0,
    root_agent_id: str = ROOT_AGENT,
    snapshot_every: int | _Default | None = _DEFAULT,
    lease: Lease | None = None,
    lease_sent: float | None = None,
) -> AbstractAsyncContextManager[DurableJournal]:
    """Hold one session's journal: lease, heartbeat, projections.

    ``session_id`` defaults to a new one; an existing session is loaded from the
    store (use `DurableJournal.recover` to settle what was unfinished).
    ``takeover_timeout`` is how long to wait for another owner's lease to expire
    (0: fail at once with `LeaseHeldError`). ``durable_pure_starts=False`` lets
    ``pure`` tools start without waiting for their ``tool_started`` commit (an
    explicit opt-in; every other tool always waits).

    On the way out, a healthy journal saves a snapshot of every stream that moved at
    least ``snapshot_every`` events since its last one (``None``: never), so the next
    open reads only what came after (bounded, best effort; see `_snapshot`). The
    default is 32 for durable stores and never for a `MemoryStore`, whose journal does
    not outlive the process (a reopen in the same process replays memory, which is cheap).

    ``lease`` adopts a lease already taken on the session (a worker's claim, see
    `serve_sessions`), granted by a request sent at ``lease_sent`` (trio's clock): its
    validity counts from then. The block then renews and releases it as its own.

    If the lease is lost, the body is cancelled and the block raises `LeaseLostError`.
    """
    return _JournalBlock(
        store,
        session_id,
        owner,
        lease_ttl,
        heartbeat_interval,
        takeover_timeout,
        durable_pure_starts,
        commit_grace,
        root_agent_id,
        snapshot_every,
        lease,
        lease_sent,
    )


class _JournalBlock:
    """The block of `open_journal`. A class rather than a generator: a session holds it as long as
    it lives (one small object, not a generator and its frame), and entering and leaving it cost
    no generator steps. A store whose leases expire gets a heartbeat in a nursery (`_renewing`).

    The arguments are checked on entry, as the body of a generator function would check them."""

    __slots__ = (
        "_body",
        "_body_lent",
        "_commit_grace",
        "_durable_pure_starts",
        "_heartbeat_interval",
        "_journal",
        "_lease",
        "_lease_sent",
        "_lease_ttl",
        "_owner",
        "_renewing",
        "_root_agent_id",
        "_session_id",
        "_snapshot_every",
        "_store",
        "_takeover_timeout",
    )

    def __init__(
        self,
        store: JournalStore,
        session_id: str | None,
        owner: str | None,
        lease_ttl: float,
        heartbeat_interval: float | None,
        takeover_timeout: float,
        durable_pure_starts: bool,
        commit_grace: float,
        root_agent_id: str,
        snapshot_every: int | _Default | None,
        lease: Lease | None,
        lease_sent: float | None,
    ) -> None:
        self._store = store
        self._session_id = session_id
        self._owner = owner
        self._lease_ttl = lease_ttl
        self._heartbeat_interval = heartbeat_interval
        self._takeover_timeout = takeover_timeout
        self._durable_pure_starts = durable_pure_starts
        self._commit_grace = commit_grace
        self._root_agent_id = root_agent_id
        self._snapshot_every = snapshot_every
        self._lease = lease
        self._lease_sent = lease_sent
        self._journal: DurableJournal | None = None
        self._body: trio.CancelScope | None = None
        self._body_lent = False  # `lend_body`
        self._renewing: AbstractAsyncContextManager[DurableJournal] | None = None

    def lend_body(self) -> _JournalBlock:
        """Let the caller's nursery hold the body (`use_body_nursery`), when this block would
        enter a scope (and a nursery, for a heartbeat) only for that. `open_session` lends its
        nursery (it holds everything the block holds): an idle session keeps no scope of the
        block's, and a new session's heartbeat runs in it. A lost lease cancels nothing until
        the caller gives its nursery: it must not await before. A session that loads stored
        streams keeps the block's own heartbeat, which renews while it loads. The session writes
        the root's ``session_created`` with its first append (`DurableJournal._begin`)."""
        self._body_lent = True
        return self

    def use_body_nursery(self, nursery: trio.Nursery) -> None:
        """After entering a block that `lend_body`: *nursery*, entered around everything the
        caller runs in the block from now on, is what a lost lease cancels, and where the
        heartbeat runs; the caller cancels it before leaving the block."""
        journal = self._journal
        if self._body_lent and self._renewing is None and journal is not None:
            held = journal.held
            held.guard(nursery.cancel_scope)
            if held.expires and held.keeper is None and held.lost is None:
                nursery.start_soon(held.keep_alive, name=f"{journal.session_id}_heartbeat")

    async def __aenter__(self) -> DurableJournal:
        store, session_id, owner, lease = self._store, self._session_id, self._owner, self._lease
        _check_store(store)
        lease_ttl, interval = check_timing(self._lease_ttl, self._heartbeat_interval)
        takeover_timeout = check_seconds("takeover_timeout", self._takeover_timeout, allow_zero=True)
        commit_grace = check_seconds("commit_grace", self._commit_grace)
        snapshot_every = self._snapshot_every
        if isinstance(snapshot_every, _Default):
            snapshot_every = None if isinstance(store, MemoryStore) else 32
        if snapshot_every is not None and (
            isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1
        ):
            raise ConfigError(f"snapshot_every must be a positive number of events or None, not {snapshot_every!r}")
        self._snapshot_every = snapshot_every
        if session_id is not None and not isinstance(session_id, str):
            raise ConfigError(f"session_id must be a string (or None for a new session), not {session_id!r}")
        root_agent_id = _checked_name(self._root_agent_id, "root_agent_id")
        if lease is not None:
            if session_id not in (None, lease.session_id) or owner not in (None, lease.owner):
                raise ConfigError(
                    f"the adopted lease is on session {lease.session_id!r} for owner {lease.owner!r}, "
                    f"not session_id={session_id!r}, owner={owner!r}"
                )
            session_id, owner = lease.session_id, lease.owner
        new = not session_id  # made here: nothing can be stored under it yet
        session_id = session_id or f"session-{os.urandom(16).hex()}"  # 128 random bits, as uuid4().hex
        if "/" in session_id:
            raise ConfigError(f"session_id must not contain '/': {session_id!r}")
        check_id(session_id, "session id")
        check_id(stream_id_for(session_id, root_agent_id), "the root agent's stream id")
        owner = owner or default_owner()
        keeper = store._lease_keeper if isinstance(store, LaneStore) else None
        # A new session on a store whose keeper renews it takes its lease with its first write,
        # in the same transaction (`HeldLease.pending`): nobody else can hold a lease on a name
        # just made, and nothing is written under it before.
        provisional = lease is None and new and keeper is not None
        if provisional:
            lease, sent = Lease(session_id, owner, 1, math.inf), trio.current_time()
        elif lease is None:
            lease, sent = await acquire(store, session_id, owner, lease_ttl, takeover_timeout)
        else:
            sent = trio.current_time() if self._lease_sent is None else self._lease_sent
        self._lease = None  # held by the journal from here on
        journal = self._journal = DurableJournal(
            store,
            session_id=session_id,
            owner=owner,
            lease=lease,
            lease_ttl=lease_ttl,
            heartbeat_interval=interval,
            durable_pure_starts=self._durable_pure_starts,
            commit_grace=commit_grace,
            root_agent_id=root_agent_id,
            fold_after=None if snapshot_every is None else FOLD_AFTER,
            sent=sent,
        )
        held = journal.held
        held.pending = provisional
        if keeper is not None and held.expires:
            keeper.keep(held)  # from now: loading a long session must not outlast the lease
        elif held.expires and not (new and self._body_lent):
            renewing = self._renewing = _renewing(journal, snapshot_every, new, self._body_lent)
            return await renewing.__aenter__()
        try:
            await journal._begin(new=new, defer_created=self._body_lent)
        except BaseException:
            await _finish(journal, snapshot_every)
            raise
        if not self._body_lent:
            body = self._body = trio.CancelScope()
            body.__enter__()
            journal.held.guard(body)
        return journal

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        if self._renewing is not None:
            return bool(await self._renewing.__aexit__(exc_type, exc, traceback))
        journal, body, snapshot_every = self._journal, self._body, self._snapshot_every
        assert journal is not None, "the block was not entered"
        assert not isinstance(snapshot_every, _Default)  # resolved on entry
        try:
            # A lent body (`lend_body`) was the caller's scope: it caught its own cancellation.
            swallowed = body.__exit__(exc_type, exc, traceback) if body is not None else False
        finally:
            await _finish(journal, snapshot_every)
        if exc is not None and not swallowed:
            return False  # the body's error goes on
        _raise_if_lost(journal)
        return swallowed


@asynccontextmanager
async def _renewing(
    journal: DurableJournal, snapshot_every: int | None, new: bool, defer_created: bool
) -> AsyncIterator[DurableJournal]:
    """The body of a journal whose lease must be renewed: the heartbeat runs beside it."""
    try:
        try:
            async with trio.open_nursery() as nursery:
                # Renewing from the start: loading a long session must not outlast the lease.
                nursery.start_soon(journal.held.keep_alive, name=f"{journal.session_id}_heartbeat")
                try:
                    with trio.CancelScope() as body:
                        journal.held.guard(body)
                        await journal._begin(new=new, defer_created=defer_created)
                        yield journal
                finally:
                    nursery.cancel_scope.cancel()
                    journal._close()
        except BaseExceptionGroup as group:
            # The heartbeat never raises: a group holds the body's own error. Raise it as itself.
            if len(group.exceptions) == 1:
                raise group.exceptions[0]  # noqa: B904 - `from` would overwrite the error's own cause
            raise
    finally:
        await _finish(journal, snapshot_every)
    _raise_if_lost(journal)


async def _finish(journal: DurableJournal, snapshot_every: int | None) -> None:
    """The way out of `open_journal`, whatever ended the body: unless the lease was lost, write
    what is pending, save the snapshots due (bounded) and release the lease."""
    journal._close()
    held = journal.held
    if held.keeper is not None:
        held.keeper.drop(held)  # before the release: a renewal after it would find it lost
    subscriptions = journal._subscriptions
    if journal._lost is not None:
        if subscriptions is not None:
            subscriptions.closed.set()
        return
    commit_grace = journal.commit_grace
    streams = journal._streams
    # With no snapshot to save while the lease is held, the deferred events and the release
    # share one transaction (`_write_together`).
    release_with_flush = snapshot_every is None or not any(
        stream.projection.head - stream.snapshot_seq >= snapshot_every or stream.damaged()
        for stream in streams.values()
    )
    if (
        release_with_flush
        and subscriptions is None
        and not journal._pending_starts
        and journal._commits_now
        and "release_lease_now" in type(held.store).__dict__
    ):
        # Nothing below reaches a checkpoint (the store commits and releases at once): a shield
        # (a cancel scope) would guard nothing, and a cancellation cannot land.
        if journal._fenced is None:
            batches = [journal._deferred_batch(stream) for stream in streams.values() if stream.deferred]
            with contextlib.suppress(JournalError, LeaseLostError):
                await journal._write_together(batches, release=True)
        else:
            await held.release()
        return
    with bounded_shield(commit_grace, "closing the journal (pending starts, lease release)"):
        try:
            for ticket in list(journal._pending_starts.values()):
                with contextlib.suppress(JournalError, LeaseLostError):
                    await ticket.wait()
            if journal._fenced is None:
                # What the last appends left deferred.
                batches = [journal._deferred_batch(stream) for stream in streams.values() if stream.deferred]
                with contextlib.suppress(JournalError, LeaseLostError):
                    if release_with_flush:
                        await journal._write_together(batches, release=True)
                    else:
                        for batch in batches:
                            await journal._write(batch)
            else:
                release_with_flush = False
        finally:
            # Before the store can close with the session that owned it: every subscription is
            # handed what it has not read yet (up to session_closed), and only then hears the close.
            if subscriptions is not None:
                await subscriptions.close()
        if not release_with_flush and snapshot_every is not None and streams:
            # While the lease is still ours (the store fences it); never holds the close for long.
            with trio.move_on_after(min(SNAPSHOT_GRACE, commit_grace)) as scope:
                await journal.snapshot_all(min_events=snapshot_every)
            if scope.cancelled_caught:
                logger.warning("saving snapshots of session %s overran its bound; left", journal.session_id)
        if not release_with_flush:
            await journal.held.release()


def _raise_if_lost(journal: DurableJournal) -> None:
    if journal._lost is not None:
        raise LeaseLostError(
            f"the lease on session {journal.session_id!r} was lost: {journal._lost}"
        ) from journal._lost
