"""A session on a lane store (SQLite, PostgreSQL) commits only what its durability needs (issue 17).

- Writes submitted together (`LaneStore.grouped`) share one transaction and wake together.
- A new session reads nothing (its id was just made), writes its ``session_created`` with its
  first request's ``request_accepted``, and its ``session_closed`` with the lease's release;
  it takes its lease in that first transaction: a session's open and close cost one
  transaction, not four.
- The store's block renews every lease held through it from one task (`LeaseKeeper`), in one
  transaction per round: no session runs a heartbeat task of its own. A refused renewal loses
  that session's lease only.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import LeaseLostError, define_agent, open_session
from trio_agent._journal._durable import DurableJournal, open_journal
from trio_agent._journal._lease import HeldLease, LeaseKeeper
from trio_agent._journal._sqlite import SQLiteStore, open_sqlite_store
from trio_agent.journal import RequestAccepted, SessionClosed, SessionCreated
from trio_agent.testing import Reply, TestModel


def _task_names() -> list[str]:
    names: list[str] = []
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        names.append(task.name)
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return names


def _agent() -> Any:
    return define_agent(provider=TestModel({"hi": [Reply(text="hello")]}))


async def test_a_group_commits_in_one_transaction_and_wakes_together(tmp_path: Any) -> None:
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        lease = await store.acquire_lease("s", "me", 30)
        before = store.statistics()["batches"]
        with store.grouped():
            renewing = store.submit_renew(lease, 30)
            releasing = store.submit_release(lease)
        renewed = await renewing.wait()
        assert releasing.done  # resolved in the same wake-up as the renewal
        await releasing.wait()
        assert store.statistics()["batches"] == before + 1
        assert renewed.token == lease.token
        current = await store.current_lease("s")
        assert current is not None and current.expires_at < store.clock()  # released after the renewal


async def test_a_new_session_costs_three_transactions_for_one_request(tmp_path: Any) -> None:
    spec = _agent()
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        reads: list[str | None] = []
        streams = store.streams

        async def counted(session_id: str | None = None) -> Any:
            reads.append(session_id)
            return await streams(session_id)

        store.streams = counted  # type: ignore[method-assign]
        before = store.statistics()["batches"]
        async with open_session(spec, journal=store) as session:
            stream_id = session.journal.stream_id()
            assert store.statistics()["batches"] == before  # nothing yet, not even the lease
            assert await store.current_lease(session.session_id) is None
            assert await store.head(stream_id) == 0  # session_created waits for the first write
            assert await session.send("hi") == "hello"
            lease = await store.current_lease(session.session_id)
            assert lease is not None and lease.token == 1 and session.journal.lease == lease
        # lease + created + accepted | the turn's events | closed + release (six before: the lease,
        # created and closed on their own, the release on its own; and a read)
        assert store.statistics()["batches"] == before + 3
        assert reads == []  # a session id made here has nothing stored under it
        events = [envelope.event for envelope in await store.read(stream_id)]
        assert isinstance(events[0], SessionCreated) and isinstance(events[1], RequestAccepted)
        assert isinstance(events[-1], SessionClosed)
        lease = await store.current_lease(session.session_id)
        assert lease is not None and lease.expires_at < store.clock()  # released


async def test_a_named_session_still_reads_what_is_stored(tmp_path: Any) -> None:
    spec = _agent()
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        async with open_session(spec, journal=store, session_id="named") as session:
            assert await session.send("hi") == "hello"
        async with open_session(spec, journal=store, session_id="named") as again:
            assert len(again.journal.conversation()) == 2  # the prompt and the answer, read back


async def test_an_explicit_close_is_durable_when_it_returns(tmp_path: Any) -> None:
    spec = _agent()
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store, open_session(spec, journal=store) as session:
        assert await session.send("hi") == "hello"
        await session.close()
        last = (await store.read(session.journal.stream_id()))[-1]
        assert isinstance(last.event, SessionClosed)  # not deferred to the block's exit


async def test_sessions_on_a_store_block_run_no_heartbeat_task(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _agent()
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        assert isinstance(store._lease_keeper, LeaseKeeper)
        submitted = _spy_renewals(store, monkeypatch)
        async with (
            open_session(spec, journal=store, lease_ttl=9) as one,
            open_session(_agent(), journal=store, lease_ttl=9) as two,
        ):
            assert await one.send("hi") == "hello"  # each takes its lease with its first write
            assert await two.send("hi") == "hello"
            names = _task_names()
            assert not [name for name in names if name.endswith("_heartbeat")]
            assert names.count("trio_agent lease keeper") == 1
            for _ in range(13):  # 39 s, several TTLs: the keeper renews both every 3 s
                mock_clock.jump(3)
                await _answered(submitted)
            assert len(submitted) == 26
            assert not one.journal.lost and not two.journal.lost
            # Valid 0.9 TTL past the last renewal (unrenewed, it would have run out at 8.1 s).
            assert one.journal.held.valid_until > trio.current_time()
        assert store._lease_keeper is not None
    assert store._lease_keeper is None  # stopped with the block


async def test_the_shared_store_of_a_path_keeps_a_heartbeat_per_session(tmp_path: Any) -> None:
    # The run's shared store may be opened by one task and closed by another: no keeper task.
    async with open_session(_agent(), journal=os.fspath(tmp_path / "j.db")) as session:
        names = _task_names()
        assert [name for name in names if name.endswith("_heartbeat")]
        assert "trio_agent lease keeper" not in names
        assert await session.send("hi") == "hello"


def _keeper_of(store: SQLiteStore) -> LeaseKeeper:
    keeper = store._lease_keeper
    assert keeper is not None  # the store's block runs one
    return keeper


async def _held(store: SQLiteStore, session_id: str, interval: float = 10) -> HeldLease:
    lease = await store.acquire_lease(session_id, "me", 30)
    return HeldLease(store, lease, ttl=30, interval=interval, sent=trio.current_time())


def _spy_renewals(store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    submitted: list[Any] = []
    submit = store.submit_renew

    def spy(lease: Any, ttl: float) -> Any:
        submitted.append(item := submit(lease, ttl))
        return item

    monkeypatch.setattr(store, "submit_renew", spy)
    return submitted


async def _answered(submitted: list[Any]) -> None:
    """Wait for the keeper's round: its renewals answered by the writer thread, and taken in."""
    await trio.testing.wait_all_tasks_blocked()  # the keeper woke and submitted its round
    for item in submitted:
        await item.wait_done()
    await trio.testing.wait_all_tasks_blocked()


async def test_the_keeper_renews_every_due_lease_in_one_transaction(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        keeper = _keeper_of(store)
        helds = [await _held(store, f"s{i}") for i in range(5)]
        for held in helds:
            keeper.keep(held)
        keeper.drop(helds[4])  # renewed no more
        submitted = _spy_renewals(store, monkeypatch)
        before = store.statistics()["batches"]
        expiries = [held.lease.expires_at for held in helds]
        mock_clock.jump(10)
        await _answered(submitted)
        assert len(submitted) == 4
        assert store.statistics()["batches"] == before + 1
        assert [held.lease.expires_at > old for held, old in zip(helds, expiries, strict=True)] == [True] * 4 + [False]
        assert all(held.valid_until == pytest.approx(trio.current_time() + 27) for held in helds[:4])
        assert not any(held.lost for held in helds)


async def test_a_lease_due_sooner_wakes_the_keeper(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        keeper = _keeper_of(store)
        slow, fast = await _held(store, "slow", 10), await _held(store, "fast", 2)
        keeper.keep(slow)
        await trio.testing.wait_all_tasks_blocked()  # the keeper sleeps until t+10
        keeper.keep(fast)
        submitted = _spy_renewals(store, monkeypatch)
        first = fast.lease.expires_at
        mock_clock.jump(2)
        await _answered(submitted)
        assert len(submitted) == 1
        assert fast.lease.expires_at > first


async def test_a_refused_renewal_loses_that_lease_only(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        submitted = _spy_renewals(store, monkeypatch)
        journals: list[Any] = []
        with pytest.raises(LeaseLostError):
            async with (
                open_journal(store, session_id="lost", lease_ttl=9) as lost,
                open_journal(store, session_id="kept", lease_ttl=9) as kept,
            ):
                journals += [lost, kept]
                await store.release_lease(lost.lease)  # behind its holder's back
                mock_clock.jump(3)
                await _answered(submitted)
                assert len(submitted) == 2
                assert lost.lost and not kept.lost
                await trio.sleep_forever()  # the loss cancelled the body
        assert journals[0].lost and not journals[1].lost
        lease = await store.current_lease("kept")
        assert lease is not None and lease.expires_at < store.clock()  # released on the way out


async def test_a_session_that_loses_its_lease_through_the_keeper_ends(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        submitted = _spy_renewals(store, monkeypatch)
        with pytest.raises(LeaseLostError):
            async with open_session(_agent(), journal=store, lease_ttl=9) as session:
                assert await session.send("hi") == "hello"
                await store.release_lease(session.journal.lease)
                mock_clock.jump(3)
                await _answered(submitted)
                await trio.sleep_forever()


async def test_the_keeper_takes_a_pending_lease_before_any_write(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        taken = trio.Event()
        submit = store.submit_acquire

        def spy(session_id: str, owner: str, ttl: float, resolve: Any) -> None:
            def resolved(outcome: object) -> None:
                resolve(outcome)
                taken.set()

            submit(session_id, owner, ttl, resolved)

        monkeypatch.setattr(store, "submit_acquire", spy)
        async with open_session(_agent(), journal=store, lease_ttl=9) as session:
            assert session.journal.held.pending
            mock_clock.jump(3)  # the keeper's first round comes before any write
            await taken.wait()
            assert not session.journal.held.pending and not session.journal.lost
            lease = await store.current_lease(session.session_id)
            assert lease is not None and session.journal.lease == lease
            assert session.journal.held.valid_until == pytest.approx(trio.current_time() + 9 * 0.9)
            assert await session.send("hi") == "hello"  # written with the lease taken


async def test_a_pending_lease_that_cannot_be_taken_loses_the_session(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nobody can hold a name just made, so this is a store that refuses the acquisition anyway.
    from trio_agent import LeaseHeldError

    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:

        def refuse(session_id: str, owner: str, ttl: float, resolve: Any) -> None:
            resolve(LeaseHeldError("held elsewhere", owner="other", expires_at=0.0))

        monkeypatch.setattr(store, "submit_acquire", refuse)
        with pytest.raises(LeaseLostError):
            async with open_session(_agent(), journal=store) as session:
                await session.send("hi")
        assert await store.current_lease(session.session_id) is None


async def test_a_lease_that_ran_out_before_its_round_is_lost_not_renewed(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        keeper = _keeper_of(store)
        stalled, fine = await _held(store, "stalled"), await _held(store, "fine")
        stalled.valid_until = trio.current_time() + 5  # as if the loop had stalled past its renewal
        keeper.keep(stalled)
        keeper.keep(fine)
        submitted = _spy_renewals(store, monkeypatch)
        mock_clock.jump(10)
        await _answered(submitted)
        assert len(submitted) == 1  # only the one still valid
        assert isinstance(stalled.lost, trio.TooSlowError) and fine.lost is None


async def test_a_keeper_round_that_fails_loses_its_leases_and_the_keeper_goes_on(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        keeper = _keeper_of(store)
        first = await _held(store, "first")
        keeper.keep(first)
        grouped = store.grouped

        def broken() -> Any:
            monkeypatch.setattr(store, "grouped", grouped)  # once
            raise RuntimeError("a bug")

        monkeypatch.setattr(store, "grouped", broken)
        mock_clock.jump(10)
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(first.lost, RuntimeError)  # failed closed
        assert "lease keeper failed" in caplog.text
        second = await _held(store, "second")
        keeper.keep(second)
        submitted = _spy_renewals(store, monkeypatch)
        mock_clock.jump(10)
        await _answered(submitted)
        assert len(submitted) == 1 and second.lost is None


async def test_a_lease_lost_while_the_session_loads_cancels_the_body_at_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = DurableJournal._load

    async def losing(self: DurableJournal) -> None:
        await load(self)
        self.held.lose(LeaseLostError("refused while loading"))  # what a refused renewal does

    reached: list[str] = []
    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        monkeypatch.setattr(DurableJournal, "_load", losing)
        with pytest.raises(LeaseLostError):
            async with open_journal(store, session_id="named"):
                await trio.lowlevel.checkpoint()
                reached.append("journal body")
        with pytest.raises(LeaseLostError):
            async with open_session(_agent(), journal=store, session_id="other"):
                await trio.lowlevel.checkpoint()
                reached.append("session body")
    assert reached == []


async def test_leaving_the_store_block_under_an_outer_cancel_raises_cancelled_not_a_group(tmp_path: Any) -> None:
    caught: list[BaseException] = []
    with trio.CancelScope() as outer:
        try:
            async with open_sqlite_store(os.fspath(tmp_path / "j.db")):
                outer.cancel()
        except BaseException as exc:
            caught.append(exc)
            raise
    assert outer.cancelled_caught
    assert [type(exc) for exc in caught] == [trio.Cancelled]


async def test_a_pending_lease_survives_a_store_that_cannot_be_reached_once(
    tmp_path: Any, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_agent import JournalUnavailableError

    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store:
        submit = store.submit_acquire
        answered = trio.Event()

        def blip(session_id: str, owner: str, ttl: float, resolve: Any) -> None:
            monkeypatch.setattr(store, "submit_acquire", submit)  # once
            resolve(JournalUnavailableError("database is locked"))
            answered.set()

        monkeypatch.setattr(store, "submit_acquire", blip)
        async with open_session(_agent(), journal=store, lease_ttl=9) as session:
            mock_clock.jump(3)  # the keeper's round tries to take it
            await answered.wait()
            held = session.journal.held
            assert held.pending and not held.lost  # asked again, as a renewal would be
            assert await session.send("hi") == "hello"  # taken with the first write
            assert not held.pending and held.lease.token == 1


async def test_ensure_owner_takes_a_pending_lease(tmp_path: Any) -> None:
    async with (
        open_sqlite_store(os.fspath(tmp_path / "j.db")) as store,
        open_session(_agent(), journal=store) as session,
    ):
        journal = session.journal
        assert journal.held.pending
        await journal.ensure_owner()
        assert not journal.held.pending and not journal.lost
        lease = await store.current_lease(session.session_id)
        assert lease is not None and journal.lease == lease
        assert await session.send("hi") == "hello"


async def test_a_cancelled_ensure_owner_still_takes_the_pending_lease(tmp_path: Any) -> None:
    """The acquisition is queued before the wait is cancelled: the journal adopts what the store
    grants (the store gives back only a lease nobody will hold), so the session goes on."""
    async with (
        open_sqlite_store(os.fspath(tmp_path / "j.db")) as store,
        open_session(_agent(), journal=store) as session,
    ):
        journal = session.journal
        assert journal.held.pending
        with trio.move_on_after(0) as scope:
            await journal.ensure_owner()
        assert scope.cancelled_caught
        assert await session.send("hi") == "hello"  # after the acquisition, in the lane
        lease = await store.current_lease(session.session_id)
        assert lease is not None and journal.lease == lease and lease.expires_at > store.clock()
        assert not journal.held.pending and not journal.lost


async def test_reconcile_before_the_first_write_landed_starts_the_root_again(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_agent import JournalUnavailableError
    from trio_agent._journal._durable import _JournalBlock

    async with open_sqlite_store(os.fspath(tmp_path / "j.db")) as store, trio.open_nursery() as nursery:
        block = open_journal(store)
        assert isinstance(block, _JournalBlock)
        block.lend_body()  # as open_session does: the root's session_created is deferred
        journal = await block.__aenter__()
        block.use_body_nursery(nursery)
        submit = store.submit

        def refuse(batch: Any) -> Any:
            monkeypatch.setattr(store, "submit", submit)  # once
            raise JournalUnavailableError("the disk is gone")

        monkeypatch.setattr(store, "submit", refuse)
        first = RequestAccepted(request_id="r1", command_id="c1", input={"prompt": "hi"})
        with pytest.raises(JournalUnavailableError):
            await journal.append(first, command_id="c1")
        assert journal.fenced
        await journal.reconcile()  # nothing of the session is stored: the root starts again
        assert journal.projection().head == 1 and not journal.fenced
        result = await journal.append(first, command_id="c1")
        assert (result.first_seq, result.last_seq) == (2, 2)
        events = [envelope.event for envelope in await store.read(journal.stream_id())]
        assert [type(event) for event in events] == [SessionCreated, RequestAccepted]
        await block.__aexit__(None, None, None)
        nursery.cancel_scope.cancel()
