"""One owner of a session's execution lease: claim, renewal, local validity, loss.

`open_journal` and the PostgreSQL worker's claim (`_workers`) both hold leases
through `HeldLease`, so there is one set of rules for both:

* A lease counts as ours until ``sent + 0.9 * ttl`` on the local clock, where
  ``sent`` is when the request that granted or last renewed it was sent: the
  store's expiry is later than that, whatever the round trip took.
* The heartbeat renews every ``interval``. A renewal the store refuses
  (`LeaseLostError`) loses the lease at once; a store that cannot be reached is
  retried until the local validity runs out, then the lease is lost.
* Losing the lease cancels ``body`` (the scope of the work it guards: the journal's
  block), once. A scope, not a callback into the owner: no reference cycle.
  Nothing is written with a lost lease: the store refuses the stale token anyway.
* A store whose leases never expire (``leases_expire = False``: only this process
  could ever hold the session) needs no heartbeat; its lease is valid for ever.
* A store opened with a `LeaseKeeper` (`open_sqlite_store`, `open_postgres_store`)
  renews every lease held through it from one task, in one transaction per round: a
  session costs no task of its own. Otherwise each holder runs `HeldLease.keep_alive`.
  The rules are the same.
* On such a store a new session's lease is provisional (`HeldLease.pending`) until it
  is taken with the session's first write, in the same transaction, or by the keeper's
  first round: nobody else can hold a lease on a name just made.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from .._config import MAX_TIMEOUT, finite_seconds
from .._errors import ConfigError, JournalError, LeaseHeldError, LeaseLostError
from .._groups import raise_alone
from ._store import JournalStore, Lease

if TYPE_CHECKING:
    from ._lane import LaneItem, LaneStore

__all__ = ["HeldLease", "LeaseKeeper", "acquire", "check_seconds", "check_timing", "default_owner"]

logger = logging.getLogger("trio_agent.journal")

VALID_SHARE = 0.9
"""How much of the TTL a lease counts as ours after its request was sent."""

TAKEOVER_POLL = 0.05
"""The shortest pause between two asks for a lease another owner holds (seconds)."""


def default_owner() -> str:
    """``"<host>:<pid>:<32 random bits>"``: unique per holder, so two journals of one process on
    one session still exclude each other."""
    return f"{_host()}:{os.getpid()}:{os.urandom(4).hex()}"


@functools.cache
def _host() -> str:
    return socket.gethostname()


def check_seconds(name: str, value: float, *, allow_zero: bool = False) -> float:
    # At most MAX_TIMEOUT: past every timer a database or trio is given (a lease TTL becomes one).
    # The usual float inline (each opening checks a handful): NaN fails both comparisons.
    if type(value) is float and (value > 0.0 or (allow_zero and value == 0.0)) and value <= MAX_TIMEOUT:
        return value
    return finite_seconds(value, name, allow_zero=allow_zero, maximum=MAX_TIMEOUT)


def check_timing(lease_ttl: float, heartbeat_interval: float | None) -> tuple[float, float]:
    """``(lease_ttl, heartbeat_interval)`` checked; the interval defaults to a third of the TTL."""
    ttl = check_seconds("lease_ttl", lease_ttl)
    interval = check_seconds("heartbeat_interval", heartbeat_interval if heartbeat_interval is not None else ttl / 3)
    # A lease counts as held for VALID_SHARE of its TTL after each renewal was sent: a renewal due
    # later always comes too late, and every such session would lose its lease on its own.
    if interval >= VALID_SHARE * ttl:
        raise ConfigError(
            f"heartbeat_interval ({interval}) must be shorter than {VALID_SHARE:g} x lease_ttl ({ttl}): "
            f"a lease counts as held for {VALID_SHARE:.0%} of its TTL after each renewal is sent"
        )
    return ttl, interval


async def acquire(
    store: JournalStore, session_id: str, owner: str, ttl: float, takeover_timeout: float
) -> tuple[Lease, float]:
    """The lease, and when the successful request was sent (local validity counts from then)."""
    deadline = trio.current_time() + takeover_timeout
    # A store whose own class takes a lease without waiting (the memory store) is asked directly:
    # opening a session on it then costs no scheduler pass. A subclass may wait: it is awaited.
    take_now = type(store).__dict__.get("acquire_lease_now")
    while True:
        sent = trio.current_time()
        try:
            if take_now is not None:
                return take_now(store, session_id, owner, ttl), sent
            return await store.acquire_lease(session_id, owner, ttl), sent
        except LeaseHeldError as exc:
            # What the lease has left by the store's own clock, read with the refusal: the server's
            # for PostgreSQL, which the local clock may be far from.
            wait = max(exc.expires_at - (store.clock() if exc.now is None else exc.now), 0.0)
            now = trio.current_time()
            if now >= deadline or now + wait > deadline:
                raise
            # Wait for the holder's expiry, asking again now and then in case it releases early:
            # never more often than `TAKEOVER_POLL` (each ask is a write transaction).
            await trio.sleep(min(max(wait + 0.001, TAKEOVER_POLL), 0.25, deadline - now))


class HeldLease:
    """A lease this process holds on one session (module rules)."""

    __slots__ = (
        "body",
        "expires",
        "interval",
        "keeper",
        "lag",
        "lease",
        "lost",
        "pending",
        "store",
        "ttl",
        "valid_until",
    )

    def __init__(
        self,
        store: JournalStore,
        lease: Lease,
        *,
        ttl: float,
        interval: float,
        sent: float,
    ) -> None:
        self.store = store
        self.lease = lease
        self.ttl = ttl
        self.interval = interval
        self.body: trio.CancelScope | None = None  # cancelled when the lease is lost
        self.expires: bool = getattr(store, "leases_expire", True)
        self.valid_until = sent + ttl * VALID_SHARE if self.expires else math.inf
        self.lost: BaseException | None = None
        self.keeper: LeaseKeeper | None = None  # the store's keeper renews it (`LeaseKeeper.keep`)
        self.pending = False
        """Granted provisionally (a new session's, token 1): taken from the store by
        `submit_acquire`, in one transaction with the first write, or by the keeper's next
        round if that comes first. Valid from ``sent`` meanwhile, as a granted one."""
        self.lag = 0.0
        """The longest a renewal came after it was due so far (seconds): what the event loop's
        load and the store's round trip cost. Choose the TTL well above it (a warning is
        logged when it passes a third of the TTL)."""

    @property
    def session_id(self) -> str:
        return self.lease.session_id

    def lose(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
            if self.body is not None:
                self.body.cancel()

    def check(self) -> None:
        """Raise `LeaseLostError` if the lease is lost or no longer valid by the local clock."""
        if self.lost is not None:
            raise LeaseLostError(f"the lease on session {self.session_id!r} was lost: {self.lost}")
        if self.expires and trio.current_time() >= self.valid_until:
            self.lose(LeaseLostError("the lease was not renewed in time"))
            raise LeaseLostError(f"the lease on session {self.session_id!r} expired locally before renewal")

    def guard(self, body: trio.CancelScope) -> None:
        """Make *body* what a loss cancels; cancelled at once if the lease is lost already (a
        renewal refused while the session loaded)."""
        self.body = body
        if self.lost is not None:
            body.cancel()

    def submit_acquire(self, then: Callable[[object], None] | None = None) -> None:
        """Queue the taking of the `pending` lease on its lane store (`took` decides the outcome;
        *then*, if given, is called with it after)."""
        self.pending = False
        sent = trio.current_time()
        provisional = self.lease

        def answer(outcome: object) -> None:
            self.took(outcome, sent, provisional)
            if then is not None:
                then(outcome)

        store: LaneStore = self.store  # type: ignore[assignment]
        store.submit_acquire(provisional.session_id, provisional.owner, self.ttl, answer)

    def took(self, outcome: object, sent: float, provisional: Lease) -> None:
        """The store's answer to taking the `pending` lease (in the Trio thread; never raises): the
        lease it granted replaces the provisional one (token 1: nobody held the name); a refusal
        loses it; a store that could not be reached is asked again (the next write or round)
        while the lease is still locally valid, as a renewal would be."""
        if isinstance(outcome, Lease) and outcome.token == provisional.token:
            if self.lease is provisional:
                self.lease = outcome
            self.valid_until = max(self.valid_until, sent + self.ttl * VALID_SHARE)
        elif isinstance(outcome, (LeaseLostError, LeaseHeldError)) or not isinstance(outcome, JournalError):
            self.lose(
                outcome
                if isinstance(outcome, BaseException)
                else LeaseLostError(f"the store granted {outcome!r}, not the provisional {provisional!r}")
            )
        elif trio.current_time() >= self.valid_until:
            self.lose(outcome)
        elif self.lost is None and self.lease is provisional:
            self.pending = True

    async def confirm(self) -> None:
        """Renew now (take a `pending` lease): the store confirms this process holds the lease,
        else `LeaseLostError`."""
        self.check()
        sent = trio.current_time()
        if self.pending:
            # Through `took`, as a write or the keeper takes it: what the store grants is this
            # lease's even if this wait is cancelled (never a lease nobody holds).
            answers: list[object] = []
            answered = trio.Event()

            def answer(outcome: object) -> None:
                answers.append(outcome)
                answered.set()

            provisional = self.lease
            try:
                self.submit_acquire(answer)
            except JournalError as exc:  # not queued (the store is not open): asked again later
                self.took(exc, sent, provisional)
                self.check()
                raise
            await answered.wait()
            [outcome] = answers
            if isinstance(outcome, BaseException):
                self.check()
                raise outcome
            return
        try:
            self.lease = await self.store.renew_lease(self.lease, self.ttl)
        except LeaseLostError as exc:
            self.lose(exc)
            raise
        self.valid_until = max(self.valid_until, sent + self.ttl * VALID_SHARE)

    async def keep_alive(self) -> None:
        """Renew every ``interval`` until cancelled or lost (never raises: a loss is `lost`)."""
        while True:
            due = trio.current_time() + self.interval
            await trio.sleep_until(due)
            sent = trio.current_time()
            try:
                with trio.fail_after(max(self.valid_until - sent, 0.001)):
                    lease = await self.store.renew_lease(self.lease, self.ttl)
            except (LeaseLostError, JournalError, trio.TooSlowError) as exc:
                if self.renewal_failed(exc):
                    return
                continue
            self.renewed(lease, sent, due)

    def renewed(self, lease: Lease, sent: float, due: float) -> None:
        """A renewal sent at *sent* (due at *due*) returned *lease*. One sent before a later
        confirmation (`confirm`) leaves the validity that one gave."""
        self.lease = lease
        self._note_lag(trio.current_time() - due)
        self.valid_until = max(self.valid_until, sent + self.ttl * VALID_SHARE)

    def renewal_failed(self, exc: BaseException) -> bool:
        """A renewal failed with *exc*; returns whether the lease is lost now. A refusal
        (`LeaseLostError`) loses it at once; a store that cannot be reached (or answers too
        late) is retried while the lease is still locally valid."""
        if isinstance(exc, LeaseLostError) or trio.current_time() >= self.valid_until:
            self.lose(exc)
            return True
        return False

    def _note_lag(self, lag: float) -> None:
        if lag > self.lag:
            if lag > self.ttl / 3 >= self.lag:
                logger.warning(
                    "the lease heartbeat of session %s renewed %.3f s late (lease_ttl %.1f s): "
                    "the event loop or the store is slow; a longer lease_ttl keeps the lease",
                    self.session_id,
                    lag,
                    self.ttl,
                )
            self.lag = lag

    async def release(self) -> None:
        """Give the lease back (a lost one is left to expire; a failed release expires on its own;
        a `pending` one was never taken)."""
        if self.lost is None and not self.pending:
            try:
                now = type(self.store).__dict__.get("release_lease_now")  # as `acquire` does
                if now is not None:
                    now(self.store, self.lease)
                else:
                    await self.store.release_lease(self.lease)
            except JournalError as exc:
                logger.debug("releasing the lease on %s failed (it expires on its own): %s", self.session_id, exc)


class LeaseKeeper:
    """Renews every lease held through one lane store, from one task (`run`, in the block that
    opened the store): the leases due are renewed together, in one transaction, and each holder
    keeps its own schedule, lag and local validity (`HeldLease`). `keep` and `drop` cost no
    checkpoint. A renewal answered after its holder was dropped is ignored (its release follows
    it in the lane).

    Each answer is taken as it comes (`LaneItem.then`), and a round never waits for the one before:
    a renewal held up alone (PostgreSQL: its lease row locked by another transaction, so the lane
    defers it) holds up only its own session, which loses its lease if it is still unanswered when
    its local validity runs out. The other sessions are renewed on their own schedules meanwhile."""

    __slots__ = ("_due", "_order", "_scope", "_store", "_unanswered", "_wake", "_wake_at")

    def __init__(self, store: LaneStore) -> None:
        self._store = store
        self._scope = trio.CancelScope()  # `stop` cancels `run`
        # (due, order, holder); a dropped holder's entry stays until it comes up (skipped then).
        self._due: list[tuple[float, int, HeldLease]] = []
        # (the holder's local validity when sent, order, holder, renewal): the renewals sent and not
        # answered, by when each counts as too slow. An answered one stays until it comes up.
        self._unanswered: list[tuple[float, int, HeldLease, LaneItem[Lease]]] = []
        self._order = itertools.count()
        self._wake = trio.Event()  # set when a lease comes due before the keeper would wake
        self._wake_at = math.inf

    def keep(self, held: HeldLease) -> None:
        """Renew *held* every ``held.interval`` from now, until `drop` (or its loss)."""
        held.keeper = self
        self._schedule(held, trio.current_time() + held.interval)

    def drop(self, held: HeldLease) -> None:
        """Renew *held* no more (before its release)."""
        if held.keeper is self:
            held.keeper = None

    def _schedule(self, held: HeldLease, due: float) -> None:
        heapq.heappush(self._due, (due, next(self._order), held))
        if due < self._wake_at:
            self._wake.set()

    def stop(self) -> None:
        """End `run` (the store is closing): the leases still kept are renewed no more."""
        self._scope.cancel()
        if self._store._lease_keeper is self:
            self._store._lease_keeper = None

    async def run(self) -> None:
        """Sleep until a lease is due (or a renewal is too slow), renew every lease due, and again;
        until `stop`."""
        with self._scope:
            await self._rounds()

    async def _rounds(self) -> None:
        due = self._due
        while True:
            self._wake_at = min(due[0][0] if due else math.inf, self._too_slow_at())
            with trio.move_on_at(self._wake_at):
                await self._wake.wait()
            self._wake = trio.Event()
            now = trio.current_time()
            self._give_up(now)
            round_: list[tuple[float, HeldLease]] = []
            while due and due[0][0] <= now:
                at, _, held = heapq.heappop(due)
                if held.keeper is not self or held.lost is not None:
                    continue
                if held.pending:  # not taken yet (nothing written): take it now
                    held.submit_acquire()
                    self._schedule(held, now + held.interval)
                else:
                    round_.append((at, held))
            if round_:
                try:
                    self._renew(round_)
                except Exception as exc:  # a bug: fail closed for this round's sessions, keep the rest
                    logger.exception("the lease keeper failed renewing %d leases; they are lost", len(round_))
                    for _, held in round_:
                        if held.keeper is self:
                            held.lose(exc)

    def _too_slow_at(self) -> float:
        """When the first renewal still unanswered counts as too slow (answered ones are dropped)."""
        unanswered = self._unanswered
        while unanswered and unanswered[0][3].done:
            heapq.heappop(unanswered)
        return unanswered[0][0] if unanswered else math.inf

    def _give_up(self, now: float) -> None:
        """Lose the leases whose renewal is still unanswered when they run out locally (as
        `keep_alive`'s `fail_after`): a renewal answered later is ignored."""
        unanswered = self._unanswered
        while unanswered and unanswered[0][0] <= now:
            _, _, held, item = heapq.heappop(unanswered)
            if item.done or held.keeper is not self or held.lost is not None:
                continue
            if held.valid_until > now:  # made valid for longer meanwhile (`confirm`, a write that took it)
                heapq.heappush(unanswered, (held.valid_until, next(self._order), held, item))
                continue
            held.renewal_failed(trio.TooSlowError("the lease renewal was not answered in time"))

    def _renew(self, round_: list[tuple[float, HeldLease]]) -> None:
        """Queue the renewals of *round_* as one unit (one transaction); each answer is taken by
        `_answered` when it comes."""
        store = self._store
        sent = trio.current_time()
        late = [(at, held) for at, held in round_ if held.valid_until <= sent]
        for _, held in late:  # ran out locally before its turn came (a stalled loop): no use renewing
            held.renewal_failed(trio.TooSlowError("the lease was not renewed before it ran out locally"))
        if late:
            round_ = [(at, held) for at, held in round_ if held.lost is None]
        submitted = 0
        try:
            with store.grouped():
                for at, held in round_:
                    item = store.submit_renew(held.lease, held.ttl)
                    submitted += 1
                    heapq.heappush(self._unanswered, (held.valid_until, next(self._order), held, item))
                    item.then(functools.partial(self._answered, held, sent, at))
        except JournalError as exc:  # the store is closing: nothing more was queued
            for at, held in round_[submitted:]:
                self._answered(held, sent, at, exc)

    def _answered(self, held: HeldLease, sent: float, at: float, outcome: object) -> None:
        """The answer to *held*'s renewal sent at *sent* (due at *at*), in the Trio thread, when it
        comes (from the lane's wake-up: never raises)."""
        if held.keeper is not self or held.lost is not None:
            return  # dropped meanwhile (released after this renewal), or lost: too slow, or refused
        try:
            if isinstance(outcome, Lease):
                held.renewed(outcome, sent, at)
            elif held.renewal_failed(
                outcome if isinstance(outcome, BaseException) else JournalError(f"the renewal answered {outcome!r}")
            ):
                return
            self._schedule(held, trio.current_time() + held.interval)
        except Exception as exc:  # a bug: fail closed for this session
            logger.exception("the lease keeper failed taking the renewal of %s; its lease is lost", held.session_id)
            held.lose(exc)


class keeping_leases:
    """``async with keeping_leases(store)``: a `LeaseKeeper` renews the leases held through
    *store* while the block runs (its task is the block's). What the block raises comes out
    as itself, never in a group: the keeper never raises."""

    __slots__ = ("_keeper", "_nursery_cm")

    def __init__(self, store: LaneStore) -> None:
        self._keeper = LeaseKeeper(store)
        self._nursery_cm = trio.open_nursery()

    async def __aenter__(self) -> None:
        nursery = await self._nursery_cm.__aenter__()
        keeper = self._keeper
        keeper._store._lease_keeper = keeper
        nursery.start_soon(keeper.run, name="trio_agent lease keeper")

    async def __aexit__(self, *exc_info: Any) -> bool:
        self._keeper.stop()
        exc = exc_info[1]
        try:
            return bool(await self._nursery_cm.__aexit__(*exc_info))
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1 and group.exceptions[0] is exc:
                return False  # the block's own error goes on unchanged
            raise_alone(group)  # or a cancellation from outside that landed while it closed
