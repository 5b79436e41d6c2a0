"""The lease keeper of a lane store (`LeaseKeeper`), on a store that answers as the tests say.

The keeper is the same for every lane store (SQLite, PostgreSQL): what it needs of one is
``grouped()`` and ``submit_renew()``. `_Store` answers renewals as a writer lane does (from the
run loop, after the round was queued), except those of the sessions it holds up: a PostgreSQL
lease row locked by another transaction, whose renewal the lane defers until the lock goes.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter

import pytest
import trio
import trio.testing

from trio_agent._journal._lane import LaneItem
from trio_agent._journal._lease import HeldLease, LeaseKeeper
from trio_agent._journal._store import Lease

TTL, INTERVAL = 9.0, 3.0
VALID = 0.9 * TTL  # how long a lease counts as held after its request was sent


class _Store:
    """What a `LeaseKeeper` asks of a lane store."""

    leases_expire = True

    def __init__(self, *held_up: str) -> None:
        self._lease_keeper: LeaseKeeper | None = None
        self.renewals: Counter[str] = Counter()
        self.held_up = {session_id: list[tuple[LaneItem[Lease], Lease]]() for session_id in held_up}
        self._token = trio.lowlevel.current_trio_token()

    def grouped(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def submit_renew(self, lease: Lease, ttl: float) -> LaneItem[Lease]:
        self.renewals[lease.session_id] += 1
        item: LaneItem[Lease] = LaneItem()
        renewed = Lease(lease.session_id, lease.owner, lease.token, trio.current_time() + ttl)
        if lease.session_id in self.held_up:
            self.held_up[lease.session_id].append((item, renewed))
        else:
            self._token.run_sync_soon(item.resolve, renewed)  # as the lane wakes its waiters
        return item

    def let_go(self, session_id: str) -> None:
        """The lock is gone: the held-up renewals of *session_id* commit, and later ones at once."""
        for item, renewed in self.held_up.pop(session_id):
            self._token.run_sync_soon(item.resolve, renewed)


def _kept(store: _Store, keeper: LeaseKeeper, *session_ids: str) -> dict[str, tuple[HeldLease, trio.CancelScope]]:
    kept = {}
    for session_id in session_ids:
        held = HeldLease(store, Lease(session_id, "me", 1, math.inf), ttl=TTL, interval=INTERVAL, sent=0.0)
        body = trio.CancelScope()  # what the lease guards: cancelled when it is lost
        held.guard(body)
        keeper.keep(held)
        kept[session_id] = (held, body)
    return kept


async def test_a_renewal_held_up_alone_costs_only_its_own_lease(autojump_clock: trio.testing.MockClock) -> None:
    # The keeper waited for every renewal of a round before taking any answer or starting another
    # round: one held-up renewal kept the others unscheduled until its lease ran out locally, and
    # by then theirs had run out too. Every session of the process lost its lease.
    store = _Store("stuck", "slow")
    keeper = LeaseKeeper(store)  # type: ignore[arg-type]  # what it uses of a LaneStore, no more
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keeper.run)
        kept = _kept(store, keeper, "stuck", "slow", "t1", "t2")
        await trio.sleep_until(5.0)  # every lease was sent for renewal at 3 s
        store.let_go("slow")  # answered late, but in time: renewed from when it was sent
        await trio.sleep_until(30.5)
        stuck, stuck_body = kept["stuck"]
        assert isinstance(stuck.lost, trio.TooSlowError) and stuck_body.cancel_called
        assert stuck.valid_until == pytest.approx(VALID)  # lost when it ran out locally, never renewed
        for name in ("slow", "t1", "t2"):
            held, body = kept[name]
            assert held.lost is None and not body.cancel_called, name
            assert held.valid_until > trio.current_time()
        assert store.renewals["t1"] == store.renewals["t2"] == 10  # every 3 s, as if nothing was held up
        assert store.renewals["slow"] == 9  # at 3 s, then every 3 s from its answer at 5 s
        assert store.renewals["stuck"] == 1  # one at a time: never sent again while unanswered
        # Answered after it was given up on: ignored (the lease stays lost, renewed no more).
        store.let_go("stuck")
        await trio.sleep(10)
        assert isinstance(stuck.lost, trio.TooSlowError) and stuck.valid_until == pytest.approx(VALID)
        assert store.renewals["stuck"] == 1
        keeper.stop()


async def test_a_lease_made_valid_for_longer_meanwhile_is_not_given_up_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = _Store("stuck")
    keeper = LeaseKeeper(store)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keeper.run)
        [(held, body)] = _kept(store, keeper, "stuck").values()
        await trio.sleep_until(VALID - 1)
        held.valid_until = trio.current_time() + VALID  # as `confirm` does with its own renewal
        await trio.sleep_until(VALID + 1)
        assert held.lost is None and not body.cancel_called  # its renewal is still waited for
        store.let_go("stuck")
        await trio.sleep(1)
        # The renewal sent at 3 s does not cut short the validity the later one gave.
        assert held.lost is None and held.valid_until == pytest.approx(2 * VALID - 1)
        await trio.sleep_until(30)
        assert held.lost is None and store.renewals["stuck"] > 5
        keeper.stop()
