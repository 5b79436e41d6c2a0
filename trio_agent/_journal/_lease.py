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
"""

from __future__ import annotations

import logging
import math
import os
import socket
import uuid

import trio

from .._errors import ConfigError, JournalError, LeaseHeldError, LeaseLostError
from ._store import JournalStore, Lease

__all__ = ["HeldLease", "acquire", "check_seconds", "check_timing", "default_owner"]

logger = logging.getLogger("trio_agent.journal")

VALID_SHARE = 0.9
"""How much of the TTL a lease counts as ours after its request was sent."""


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def check_seconds(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number of seconds, not {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, not {value!r}")
    return float(value)


def check_timing(lease_ttl: float, heartbeat_interval: float | None) -> tuple[float, float]:
    """``(lease_ttl, heartbeat_interval)`` checked; the interval defaults to a third of the TTL."""
    ttl = check_seconds("lease_ttl", lease_ttl)
    interval = check_seconds("heartbeat_interval", heartbeat_interval if heartbeat_interval is not None else ttl / 3)
    if interval >= ttl:
        raise ConfigError(f"heartbeat_interval ({interval}) must be shorter than lease_ttl ({ttl})")
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
            wait = exc.expires_at - store.clock()
            now = trio.current_time()
            if now + max(wait, 0.0) > deadline:
                raise
            # Wait for the holder's expiry (by the store's clock), polling in case it releases early.
            await trio.sleep(min(max(wait, 0.0) + 0.001, max(deadline - now, 0.0), 0.25))


class HeldLease:
    """A lease this process holds on one session (module rules)."""

    __slots__ = ("body", "expires", "interval", "lag", "lease", "lost", "store", "ttl", "valid_until")

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

    async def confirm(self) -> None:
        """Renew now: the store confirms this process still holds the lease, else `LeaseLostError`."""
        self.check()
        sent = trio.current_time()
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
                    self.lease = await self.store.renew_lease(self.lease, self.ttl)
                self._note_lag(trio.current_time() - due)
            except LeaseLostError as exc:
                self.lose(exc)
                return
            except (JournalError, trio.TooSlowError) as exc:
                # The store is unreachable: keep trying while the lease is still locally valid.
                if trio.current_time() >= self.valid_until:
                    self.lose(exc)
                    return
                continue
            self.valid_until = sent + self.ttl * VALID_SHARE

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
        """Give the lease back (a lost one is left to expire; a failed release expires on its own)."""
        if self.lost is None:
            try:
                now = type(self.store).__dict__.get("release_lease_now")  # as `acquire` does
                if now is not None:
                    now(self.store, self.lease)
                else:
                    await self.store.release_lease(self.lease)
            except JournalError as exc:
                logger.debug("releasing the lease on %s failed (it expires on its own): %s", self.session_id, exc)
