"""PostgreSQL-only journal store tests (the shared rules live in test_journal_stores.py).

They run against a throw-away cluster (``postgres_dsn``, one per session) and a
schema of their own (``fresh_pg_schema``). Real, short timeouts only: Trio's
mock clock means nothing to the database server.
"""

from __future__ import annotations

import logging
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from pg_cluster import find_bindir
from psycopg.conninfo import conninfo_to_dict

from trio_agent._errors import (
    ConfigError,
    JournalCorruptError,
    JournalError,
    JournalUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    StaleFencingTokenError,
)
from trio_agent._journal._events import EventEnvelope, RequestAccepted, RequestStarted
from trio_agent._journal._lane import LaneItem
from trio_agent._journal._lease import HeldLease
from trio_agent._journal._postgres import _COLUMNS, STORE_FORMAT, PostgresStore, open_postgres_store
from trio_agent._journal._store import AppendBatch, AppendResult, Lease, command_digest, stream_id_for
from trio_agent._journal._subscribe import CaughtUp, DurableEvent, subscribe_durable_events

LONG_TTL = 60.0
PROMPT = 3.0
"""A generous bound for "promptly" on a loaded 2-core CI machine; far below any timeout that is not ours."""


def envs(stream_id: str, first: int, count: int) -> list[EventEnvelope]:
    return [
        EventEnvelope(stream_id=stream_id, seq=seq, event=RequestStarted(request_id=f"r{seq}"), recorded_at=1.5)
        for seq in range(first, first + count)
    ]


def batch(
    lease: Lease, stream_id: str, envelopes: Sequence[EventEnvelope], command_id: str | None = None
) -> AppendBatch:
    return AppendBatch(
        lease.session_id,
        stream_id,
        lease.token,
        envelopes,
        command_id=command_id,
        command_digest=None if command_id is None else command_digest(envelopes),
    )


def run_sql(dsn: str, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """One autocommitted statement on a connection of the test's own."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(query.encode(), params)
        return cursor.fetchall() if cursor.description is not None else []


async def test_cluster_binaries_are_found(postgres_dsn: str) -> None:
    bindir = find_bindir()
    assert (bindir / "postgres").is_file()


# ---------------------------------------------------------------- cancellation and timeouts


async def test_a_read_blocked_on_the_server_ends_promptly_when_its_scope_is_cancelled(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 2)))
        with psycopg.connect(postgres_dsn) as locker:  # holds the table until it rolls back
            locker.execute(f'LOCK TABLE "{fresh_pg_schema}".events IN ACCESS EXCLUSIVE MODE'.encode())
            for _ in range(2):  # a fresh and then a reused read connection
                started = time.monotonic()
                with trio.move_on_after(0.3) as scope:
                    await store.read(stream)
                elapsed = time.monotonic() - started
                assert scope.cancelled_caught
                assert elapsed < PROMPT, f"the cancelled read took {elapsed:.2f} s"
            # The server is not still running the abandoned statement.
            waiting = run_sql(
                postgres_dsn,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'trio_agent journal'"
                " AND state = 'active' AND wait_event_type = 'Lock'",
            )
            assert waiting == [(0,)]
            locker.rollback()
        with trio.fail_after(PROMPT):
            assert await store.read(stream) == envs(stream, 1, 2)
            assert await store.head(stream) == 2
            assert await store.append(batch(lease, stream, envs(stream, 3, 1))) == AppendResult(stream, 3, 3)


async def test_a_long_server_statement_is_aborted_by_a_cancel_scope(postgres_dsn: str, fresh_pg_schema: str) -> None:
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        started = time.monotonic()
        with trio.move_on_after(0.2) as scope:
            await store._query(lambda conn: conn.execute(b"SELECT pg_sleep(30)").fetchall())
        assert scope.cancelled_caught
        assert time.monotonic() - started < PROMPT
        with trio.fail_after(PROMPT):
            assert await store._query(lambda conn: conn.execute(b"SELECT 7").fetchall()) == [(7,)]


async def test_an_already_cancelled_scope_never_starts_the_statement(postgres_dsn: str, fresh_pg_schema: str) -> None:
    ran: list[bool] = []

    def query(conn: Any) -> None:
        ran.append(True)

    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        with trio.CancelScope() as scope:
            scope.cancel()
            await store._query(query)
        assert scope.cancelled_caught
        assert ran == []


async def test_statement_timeout_bounds_a_blocked_read_server_side(postgres_dsn: str, fresh_pg_schema: str) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, statement_timeout=0.3) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 1)))
        with psycopg.connect(postgres_dsn) as locker:
            locker.execute(f'LOCK TABLE "{fresh_pg_schema}".events IN ACCESS EXCLUSIVE MODE'.encode())
            with trio.fail_after(PROMPT), pytest.raises(JournalUnavailableError, match="statement_timeout"):
                await store.read(stream)
            locker.rollback()
        assert await store.read(stream) == envs(stream, 1, 1)


# ---------------------------------------------------------------- NOTIFY


@pytest.mark.parametrize(("seconds", "server_ms"), [(0.0004, "1"), (0.0016, "2"), (0.3, "300"), (0, "0")])
def test_a_timeout_under_half_a_millisecond_is_still_a_timeout_on_the_server(seconds: float, server_ms: str) -> None:
    # Rounded to 0 ms it was "no timeout" for PostgreSQL, for statements and idle transactions alike.
    store = PostgresStore("postgresql://nobody@127.0.0.1:1/none", statement_timeout=seconds)
    options = str(conninfo_to_dict(store._conninfo)["options"]).split()
    assert f"statement_timeout={server_ms}" in options
    assert f"idle_in_transaction_session_timeout={server_ms}" in options


async def test_notify_wakes_a_waiter_in_another_store_long_before_polling(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, poll_interval=30) as writer:
        lease = await writer.acquire_lease("sess", "A", LONG_TTL)
        await writer.append(batch(lease, stream, envs(stream, 1, 1)))
        # Opened after that append, so its NOTIFY cannot wake the watcher below.
        async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, poll_interval=30) as watcher:
            await _wait_woken_by_notify(writer, watcher, lease, stream)


async def _wait_woken_by_notify(writer: PostgresStore, watcher: PostgresStore, lease: Lease, stream: str) -> None:
    # Know when the watcher has looked at the head, so the append below can only reach it by NOTIFY.
    looked = trio.Event()
    real_heads = watcher._heads

    async def heads(stream_ids: Sequence[str]) -> dict[str, int | JournalError]:
        value = await real_heads(stream_ids)
        looked.set()
        return value

    watcher._heads = heads  # type: ignore[method-assign]
    woken = trio.Event()

    async def wait() -> None:
        await watcher.wait_for_append(stream, 1)
        woken.set()

    with trio.fail_after(5):  # poll_interval is 30 s: only NOTIFY can be this quick
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await looked.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert not woken.is_set()
            before = watcher.notifications
            await writer.append(batch(lease, stream, envs(stream, 2, 1)))
            await woken.wait()
    assert watcher.notifications > before
    assert await watcher.read(stream, after=1) == envs(stream, 2, 1)


async def test_notify_is_scoped_to_the_schema(postgres_dsn: str, fresh_pg_schema: str) -> None:
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as one,
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema + "_other") as other,
    ):
        assert one.channel != other.channel
        assert len(PostgresStore(postgres_dsn, schema="s" * 63).channel.encode()) <= 63
    run_sql(postgres_dsn, f'DROP SCHEMA "{fresh_pg_schema}_other" CASCADE')


async def test_the_listener_reconnects_after_its_connection_is_killed(postgres_dsn: str, fresh_pg_schema: str) -> None:
    stream = stream_id_for("sess", "root")
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema, poll_interval=30) as writer,
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema, poll_interval=0.2) as watcher,
    ):
        lease = await writer.acquire_lease("sess", "A", LONG_TTL)
        listener = watcher._listener
        assert listener is not None
        run_sql(postgres_dsn, "SELECT pg_terminate_backend(%s)", (listener.info.backend_pid,))
        with trio.fail_after(10):
            while watcher._listener is None or watcher._listener is listener:
                await watcher.wait_for_append(stream, 0)  # polls every 0.2 s meanwhile
            before = watcher.notifications
            await writer.append(batch(lease, stream, envs(stream, 1, 1)))
            while watcher.notifications == before:
                await watcher.wait_for_append(stream, 1)


# ---------------------------------------------------------------- leases across workers


async def test_workers_racing_for_a_lease_exactly_one_wins_and_takeover_fences(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    short_ttl = 0.3
    stream = stream_id_for("sess", "root")
    outcomes: dict[str, Lease | BaseException] = {}

    async def race(store: PostgresStore, owner: str) -> None:
        try:
            outcomes[owner] = await store.acquire_lease("sess", owner, LONG_TTL)
        except LeaseHeldError as exc:
            outcomes[owner] = exc

    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as w1,
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as w2,
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as w3,
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as w4,
    ):
        workers = {"w1": w1, "w2": w2, "w3": w3, "w4": w4}
        async with trio.open_nursery() as nursery:
            for owner, store in workers.items():
                nursery.start_soon(race, store, owner)
        winners = [lease for lease in outcomes.values() if isinstance(lease, Lease)]
        assert len(winners) == 1, outcomes
        first = winners[0]
        assert first.token == 1
        for owner, outcome in outcomes.items():
            if owner != first.owner:
                assert isinstance(outcome, LeaseHeldError)
                assert outcome.owner == first.owner
        holder = workers[first.owner]
        await holder.append(batch(first, stream, envs(stream, 1, 1)))

        # The holder's last renewal is short and then it stalls past it (on the server's clock);
        # the others race again and one takes over with a higher token.
        first = await holder.renew_lease(first, short_ttl)
        await trio.sleep(short_ttl + 0.2)
        outcomes.clear()
        async with trio.open_nursery() as nursery:
            for owner, store in workers.items():
                if owner != first.owner:
                    nursery.start_soon(race, store, owner)
        winners = [lease for lease in outcomes.values() if isinstance(lease, Lease)]
        assert len(winners) == 1, outcomes
        second = winners[0]
        assert second.token > first.token
        assert await w1.current_lease("sess") == second

        # The stalled holder wakes up: the STORE refuses its token, whichever worker carries the write.
        for store in workers.values():
            with pytest.raises(StaleFencingTokenError, match="refused by the store"):
                await store.append(batch(first, stream, envs(stream, 2, 1)))
        with pytest.raises(LeaseLostError):
            await holder.renew_lease(first, LONG_TTL)
        taker = workers[second.owner]
        assert await taker.append(batch(second, stream, envs(stream, 2, 1))) == AppendResult(stream, 2, 2)
        assert await holder.read(stream) == envs(stream, 1, 2)
        tokens = run_sql(postgres_dsn, f'SELECT seq, token FROM "{fresh_pg_schema}".events ORDER BY seq')
        assert tokens == [(1, 1), (2, second.token)]

        # A release keeps the token: the next owner's is higher still.
        await taker.release_lease(second)
        await taker.release_lease(second)
        third = await holder.acquire_lease("sess", first.owner, LONG_TTL)
        assert third.token > second.token


async def test_a_lease_row_locked_elsewhere_holds_only_its_own_session(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """Another process frozen inside a transaction holds one session's lease row (here: a
    takeover attempt waits on it). The writer does not wait on that row: the other sessions'
    appends and renewals in the same group commit land at once; the locked session's work waits
    alone, lands once the row is free, and fails alone past statement_timeout."""
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, statement_timeout=30) as store:
        await store.release_lease(await store.acquire_lease("stuck", "A", LONG_TTL))  # its row exists, free
        mine = await store.acquire_lease("mine", "B", LONG_TTL)
        stream = stream_id_for("mine", "root")
        await store.append(batch(mine, stream, envs(stream, 1, 1)))
        taken: list[object] = []
        answered = trio.Event()

        def took(outcome: object) -> None:
            taken.append(outcome)
            answered.set()

        with psycopg.connect(postgres_dsn) as frozen:
            frozen.execute(
                f'SELECT 1 FROM "{fresh_pg_schema}".leases WHERE session_id = %s FOR UPDATE'.encode(), ("stuck",)
            )
            with store.grouped():
                store.submit_acquire("stuck", "B", LONG_TTL, took)
                ticket = store.submit(batch(mine, stream, envs(stream, 2, 1)))
                renewal = store.submit_renew(mine, LONG_TTL)
            with trio.fail_after(PROMPT):  # not statement_timeout later
                assert await ticket.wait() == AppendResult(stream, 2, 2)
                assert (await renewal.wait()).token == mine.token
                # Later work of other sessions does not queue behind it either.
                assert await store.append(batch(mine, stream, envs(stream, 3, 1))) == AppendResult(stream, 3, 3)
            assert taken == []  # still waiting for its row
            frozen.rollback()
            with trio.fail_after(PROMPT):
                await answered.wait()  # the lane offered it again, and now it locked the row
        [lease] = taken
        assert isinstance(lease, Lease) and (lease.session_id, lease.owner) == ("stuck", "B")
        assert await store.current_lease("stuck") == lease

    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, statement_timeout=0.5) as store:
        with psycopg.connect(postgres_dsn) as frozen:
            frozen.execute(
                f'SELECT 1 FROM "{fresh_pg_schema}".leases WHERE session_id = %s FOR UPDATE'.encode(), ("stuck",)
            )
            started = time.monotonic()
            with trio.fail_after(PROMPT), pytest.raises(JournalUnavailableError, match="locked by another transaction"):
                await store.acquire_lease("stuck", "C", LONG_TTL)
            assert time.monotonic() - started >= 0.5
            frozen.rollback()
        assert await store.current_lease("stuck") == lease  # nothing was written


async def test_a_lease_row_locked_elsewhere_costs_the_keeper_only_that_sessions_lease(
    postgres_dsn: str, fresh_pg_schema: str, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store's lease keeper waited for every renewal of a round before taking any answer or
    # starting another: the deferred renewal of the locked session held the others unscheduled
    # until its lease ran out locally, and by then theirs had run out too. Trio's clock is mocked
    # (the keeper's schedule); the server's expiries are real, 60 s away.
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        keeper = store._lease_keeper
        assert keeper is not None
        kept = {}
        for session_id in ("stuck", "t1", "t2"):
            lease = await store.acquire_lease(session_id, "A", LONG_TTL)
            kept[session_id] = held = HeldLease(store, lease, ttl=9, interval=3, sent=trio.current_time())
            keeper.keep(held)
        sent: dict[str, list[LaneItem[Lease]]] = {session_id: [] for session_id in kept}
        submit = store.submit_renew

        def spy(lease: Lease, ttl: float) -> LaneItem[Lease]:
            sent[lease.session_id].append(item := submit(lease, ttl))
            return item

        async def round_answered(count: int) -> None:
            await trio.testing.wait_all_tasks_blocked()  # the keeper woke and queued its round
            for session_id in ("t1", "t2"):
                assert len(sent[session_id]) == count, session_id
                with trio.fail_after(PROMPT):
                    await sent[session_id][-1].wait_done()

        monkeypatch.setattr(store, "submit_renew", spy)
        with psycopg.connect(postgres_dsn) as frozen:
            frozen.execute(
                f'SELECT 1 FROM "{fresh_pg_schema}".leases WHERE session_id = %s FOR UPDATE'.encode(), ("stuck",)
            )
            mock_clock.jump(3)
            await round_answered(1)
            mock_clock.jump(3)  # the next round, while the first renewal of "stuck" waits for its row
            await round_answered(2)
            assert len(sent["stuck"]) == 1 and not sent["stuck"][0].done
            mock_clock.jump(2.2)  # 8.2 s: past the 8.1 s the lease of "stuck" counts as held
            await trio.testing.wait_all_tasks_blocked()
            assert isinstance(kept["stuck"].lost, trio.TooSlowError)
            assert kept["t1"].lost is None and kept["t2"].lost is None
            frozen.rollback()
        with trio.fail_after(PROMPT):
            await sent["stuck"][0].wait_done()  # committed once the row was free: ignored
        mock_clock.jump(1)
        await round_answered(3)
        assert kept["t1"].lost is None and kept["t2"].lost is None
        assert isinstance(kept["stuck"].lost, trio.TooSlowError) and len(sent["stuck"]) == 1


async def test_a_transaction_left_idle_is_ended_by_the_server(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """A process frozen half-way through a write must not hold its row locks until it wakes: the
    store's connections end a transaction idle for statement_timeout (a DSN's own setting wins)."""
    show = lambda conn: conn.execute(b"SHOW idle_in_transaction_session_timeout").fetchone()[0]  # noqa: E731
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, statement_timeout=7) as store:
        assert await store._query(show) == "7s"
    own = f"{postgres_dsn} options='-c idle_in_transaction_session_timeout=1234'"
    async with open_postgres_store(own, schema=fresh_pg_schema, statement_timeout=7) as store:
        assert await store._query(show) == "1234ms"


async def test_the_server_clock_decides_lease_expiry(postgres_dsn: str, fresh_pg_schema: str) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 1)))
        (server_now,) = run_sql(postgres_dsn, "SELECT extract(epoch FROM clock_timestamp())::float8")[0]
        lease = await store.renew_lease(lease, 0.3)
        assert server_now < lease.expires_at < server_now + 0.3 + PROMPT
        await trio.sleep(0.5)  # past the TTL on the server's clock
        with pytest.raises(StaleFencingTokenError, match="expires at"):
            await store.append(batch(lease, stream, envs(stream, 2, 1)))
        with pytest.raises(LeaseLostError):
            await store.renew_lease(lease, LONG_TTL)
        assert await store.head(stream) == 1


async def test_a_takeover_waits_by_the_server_clock_whatever_the_local_clock_says(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """With clock=None the server's clock decides expiry, so a takeover's wait is what the lease
    has left by that clock (`LeaseHeldError.now`, read with the refusal), not expires_at minus
    this host's clock: behind, it gave up at once; ahead, it asked every millisecond."""
    from trio_agent._journal._durable import open_journal

    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as holder,
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as taker,
    ):
        await holder.acquire_lease("s0", "A", 0.5)
        (server_now,) = run_sql(postgres_dsn, "SELECT extract(epoch FROM clock_timestamp())::float8")[0]
        with pytest.raises(LeaseHeldError) as refused:
            await taker.acquire_lease("s0", "B", LONG_TTL)
        assert refused.value.now is not None and abs(refused.value.now - server_now) < PROMPT
        assert 0 < refused.value.expires_at - refused.value.now <= 0.5

        for session_id, skew in (("behind", -60.0), ("ahead", 60.0)):
            await holder.acquire_lease(session_id, "A", 0.5)  # its owner dies: it runs out in 0.5 s
            taker.clock = lambda skew=skew: time.time() + skew  # this host's clock, a minute off
            before = taker.statistics()["batches"]
            with trio.fail_after(PROMPT):
                async with open_journal(taker, session_id=session_id, takeover_timeout=10) as journal:
                    assert journal.lease.owner != "A" and journal.lease.token == 2
            asks = taker.statistics()["batches"] - before
            assert asks <= 0.5 / 0.05 + 5, f"{session_id}: {asks} write transactions to wait 0.5 s"


async def test_an_injected_clock_replaces_the_server_clock(postgres_dsn: str, fresh_pg_schema: str) -> None:
    now = [1000.0]
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, clock=lambda: now[0]) as store:
        assert store.clock() == 1000.0
        lease = await store.acquire_lease("sess", "A", 10)
        assert lease.expires_at == 1010.0
        await store.append(batch(lease, stream, envs(stream, 1, 1)))
        now[0] = 1010.5
        with pytest.raises(StaleFencingTokenError):
            await store.append(batch(lease, stream, envs(stream, 2, 1)))
        with pytest.raises(LeaseLostError):
            await store.renew_lease(lease, 10)
        taken = await store.acquire_lease("sess", "B", 10)
        assert (taken.token, taken.expires_at) == (lease.token + 1, 1020.5)


async def test_store_clock_defaults_to_wall_time(postgres_dsn: str, fresh_pg_schema: str) -> None:
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        assert abs(store.clock() - time.time()) < 1.0


# ---------------------------------------------------------------- group commit and isolation


async def test_one_group_commit_isolates_refused_and_failing_items(postgres_dsn: str, fresh_pg_schema: str) -> None:
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        good = await store.acquire_lease("good", "A", LONG_TTL)
        stale = await store.acquire_lease("stale", "A", LONG_TTL)
        await store.acquire_lease("stale", "A", LONG_TTL)  # fences the first token
        blocked = stream_id_for("good", "blocked")
        await store.append(batch(good, blocked, envs(blocked, 1, 1)))
        # A row the writer does not expect (as if damaged): the append that collides with it fails alone.
        body = run_sql(postgres_dsn, f'SELECT body FROM "{fresh_pg_schema}".events')[0][0]
        run_sql(
            postgres_dsn,
            f'INSERT INTO "{fresh_pg_schema}".events(stream_id, seq, token, body, checksum) VALUES (%s, 2, %s, %s, 0)',
            (blocked, good.token, body),
        )
        streams = [stream_id_for("good", f"agent-{i}") for i in range(30)]
        tickets = [store.submit(batch(good, s, envs(s, 1, 2))) for s in streams[:15]]
        collide = store.submit(batch(good, blocked, envs(blocked, 2, 1)))
        refused = store.submit(batch(stale, stream_id_for("stale", "root"), envs(stream_id_for("stale", "root"), 1, 1)))
        tickets += [store.submit(batch(good, s, envs(s, 1, 2))) for s in streams[15:]]
        with trio.fail_after(10):
            results = [await ticket.wait() for ticket in tickets]
            with pytest.raises(JournalUnavailableError, match="refused the write"):
                await collide.wait()
            with pytest.raises(StaleFencingTokenError):
                await refused.wait()
        assert results == [AppendResult(s, 1, 2) for s in streams]
        for s in streams:
            assert await store.read(s) == envs(s, 1, 2)
        assert await store.head(blocked) == 1
        assert store._lane is not None
        assert store._lane.batches < 20  # grouped, not one transaction per append


def refuse_with(dsn: str, schema: str, table: str, column: str, value: str, sqlstate: str) -> None:
    """Make the database refuse a row of *table* whose *column* is *value* with *sqlstate* (a
    trigger standing in for a limit one item hits: an index row too large, memory, ...)."""
    run_sql(
        dsn,
        f'CREATE FUNCTION "{schema}".refuse_{table}() RETURNS trigger LANGUAGE plpgsql AS $$'
        f" BEGIN IF NEW.{column} = '{value}' THEN"
        f" RAISE EXCEPTION 'refused by the test' USING ERRCODE = '{sqlstate}'; END IF; RETURN NEW; END $$",
    )
    run_sql(
        dsn,
        f'CREATE TRIGGER refuse BEFORE INSERT ON "{schema}".{table}'
        f' FOR EACH ROW EXECUTE FUNCTION "{schema}".refuse_{table}()',
    )


@pytest.mark.parametrize(("sqlstate", "error"), [("54000", "ProgramLimitExceeded"), ("53200", "OutOfMemory")])
async def test_an_item_the_database_refuses_with_an_operational_error_fails_alone(
    postgres_dsn: str, fresh_pg_schema: str, sqlstate: str, error: str
) -> None:
    """psycopg raises several per-item refusals as `OperationalError` (classes 53 and 54): they
    are redone item by item like any other, so the neighbours of the group commit never suffer."""
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        good = await store.acquire_lease("good", "A", LONG_TTL)
        other = await store.acquire_lease("other", "B", LONG_TTL)
        good_stream, bad_stream = stream_id_for("good", "root"), stream_id_for("other", "root")
        await store.append(batch(good, good_stream, envs(good_stream, 1, 1)))
        refuse_with(postgres_dsn, fresh_pg_schema, "events", "stream_id", bad_stream, sqlstate)
        refuse_with(postgres_dsn, fresh_pg_schema, "leases", "session_id", "refused", sqlstate)
        taken: dict[str, object] = {}
        with store.grouped():  # one transaction, as under concurrency
            neighbour = store.submit(batch(good, good_stream, envs(good_stream, 2, 1)))
            culprit = store.submit(batch(other, bad_stream, envs(bad_stream, 1, 1)))
            renewal = store.submit_renew(good, LONG_TTL)
            for session in ("refused", "fresh"):  # a new session's lease row is refused, another's is not
                store.submit_acquire(session, "C", LONG_TTL, lambda outcome, s=session: taken.__setitem__(s, outcome))
        with trio.fail_after(PROMPT):
            assert await neighbour.wait() == AppendResult(good_stream, 2, 2)
            assert (await renewal.wait()).token == good.token
            with pytest.raises(JournalUnavailableError, match=f"refused the write: {error}"):
                await culprit.wait()
        assert isinstance(taken["fresh"], Lease) and taken["fresh"].token == 1
        assert isinstance(taken["refused"], JournalUnavailableError)
        assert f"refused the write: {error}" in str(taken["refused"])
        assert await store.read(good_stream) == envs(good_stream, 1, 2)
        assert await store.head(bad_stream) == 0
        assert await store.current_lease("refused") is None


def terminate(dsn: str, *conns: psycopg.Connection[Any] | None) -> None:
    """End the server side of *conns*, as a restart, a failover or an idle timeout does."""
    pids = [conn.info.backend_pid for conn in conns if conn is not None]
    # With a timeout (ms), pg_terminate_backend returns once the backend has ended, not on the signal.
    ended = run_sql(
        dsn, "SELECT count(*) FROM unnest(%s::int[]) AS pid WHERE pg_terminate_backend(pid, 10000)", (pids,)
    )
    assert ended == [(len(pids),)]


async def test_a_writer_connection_the_server_dropped_is_replaced_and_the_batch_redone(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # The next group commit failed on its first statements, before COMMIT was ever sent, yet it was
    # answered "outcome unknown": every journal with a write in it was fenced.
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 1)))
        dropped = store._writer
        terminate(postgres_dsn, dropped)
        with store.grouped():
            appended = store.submit(batch(lease, stream, envs(stream, 2, 1), "cmd"))
            renewed = store.submit_renew(lease, LONG_TTL)
        with trio.fail_after(10):
            assert await appended.wait() == AppendResult(stream, 2, 2)
            assert (await renewed.wait()).token == lease.token
        assert store._writer is not None and store._writer is not dropped
        assert await store.read(stream) == envs(stream, 1, 2)  # written once


async def test_a_writer_connection_lost_once_commit_was_sent_leaves_the_outcome_unknown(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        writer = store._writer
        assert writer is not None
        execute = writer.execute
        commits: list[int] = []

        def lost_at_commit(query: Any, *args: Any, **kwargs: Any) -> Any:
            if query == b"COMMIT":  # the connection dies as COMMIT is handed to it: it may have been applied
                commits.append(writer.info.backend_pid)
                terminate(postgres_dsn, writer)
            return execute(query, *args, **kwargs)

        writer.execute = lost_at_commit  # type: ignore[method-assign]
        with trio.fail_after(10), pytest.raises(JournalUnavailableError, match="the transaction failed"):
            await store.append(batch(lease, stream, envs(stream, 1, 1)))
        assert len(commits) == 1 and writer.closed  # not redone: its outcome is unknown
        with trio.fail_after(10):  # the next batch reconnects
            assert await store.append(batch(lease, stream, envs(stream, 1, 1))) == AppendResult(stream, 1, 1)


async def test_a_writer_connection_lost_again_on_the_redo_is_unavailable(
    postgres_dsn: str, fresh_pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        terminate(postgres_dsn, store._writer)
        reconnect = store._connect

        def unreachable() -> Any:
            raise JournalUnavailableError("cannot connect to PostgreSQL (the test)")

        monkeypatch.setattr(store, "_connect", unreachable)
        with trio.fail_after(10), pytest.raises(JournalUnavailableError, match="the test"):
            await store.append(batch(lease, stream, envs(stream, 1, 1)))
        monkeypatch.setattr(store, "_connect", reconnect)
        with trio.fail_after(10):
            assert await store.append(batch(lease, stream, envs(stream, 1, 1))) == AppendResult(stream, 1, 1)


async def test_pooled_readers_the_server_dropped_are_replaced_and_a_subscription_goes_on(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # Each dead pooled reader failed its next read with JournalUnavailableError, though a read is
    # safe to repeat: a live subscription died on it.
    stream = stream_id_for("sess", "root")
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as writer,
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema, poll_interval=0.2) as reader,
    ):
        lease = await writer.acquire_lease("sess", "A", LONG_TTL)
        await writer.append(batch(lease, stream, envs(stream, 1, 1)))
        async with trio.open_nursery() as nursery:  # several readers in the pool
            for _ in range(3):
                nursery.start_soon(reader.read, stream)
        async with subscribe_durable_events(reader, stream) as sub:
            with trio.fail_after(10):
                items = [await anext(sub), await anext(sub)]
            assert [type(item) for item in items] == [DurableEvent, CaughtUp]
            dropped = list(reader._idle_readers)
            assert len(dropped) >= 2
            terminate(postgres_dsn, *dropped, reader._listener)
            await writer.append(batch(lease, stream, envs(stream, 2, 1)))
            with trio.fail_after(10):
                item = await anext(sub)
            assert isinstance(item, DurableEvent) and item.envelope.seq == 2
        read: list[list[EventEnvelope]] = []

        async def read_all() -> None:
            read.append(await reader.read(stream))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:  # at once: each takes a pooled reader, every dead one
                for _ in range(len(reader._idle_readers)):
                    nursery.start_soon(read_all)
        assert read == [envs(stream, 1, 2)] * len(read)
        assert all(conn.closed for conn in dropped)
        assert not [conn for conn in reader._idle_readers if any(conn is old for old in dropped)]


async def test_replayed_command_across_workers_returns_the_first_outcome(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    stream = stream_id_for("sess", "root")
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as one,
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as two,
    ):
        lease = await one.acquire_lease("sess", "A", LONG_TTL)
        content = envs(stream, 1, 2)
        assert await one.append(batch(lease, stream, content, "cmd")) == AppendResult(stream, 1, 2)
        assert await two.append(batch(lease, stream, content, "cmd")) == AppendResult(stream, 1, 2, replayed=True)
        assert await two.head(stream) == 2


# ---------------------------------------------------------------- corruption and failures


@pytest.mark.parametrize(
    "body",
    ['{"not": "an envelope"}', "not json at all {", "[]"],
)
async def test_a_corrupt_row_is_reported_with_stream_and_seq(
    postgres_dsn: str, fresh_pg_schema: str, body: str
) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 3)))
        run_sql(postgres_dsn, f'UPDATE "{fresh_pg_schema}".events SET body = %s WHERE seq = 2', (body,))
        with pytest.raises(JournalCorruptError, match=f"{stream}#2"):
            await store.read(stream)
        assert await store.read(stream, after=2) == envs(stream, 3, 1)


async def test_a_row_in_the_wrong_place_or_missing_is_corrupt(postgres_dsn: str, fresh_pg_schema: str) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 4)))
        table = f'"{fresh_pg_schema}".events'
        run_sql(postgres_dsn, f"UPDATE {table} SET body = (SELECT body FROM {table} WHERE seq = 1) WHERE seq = 2")
        with pytest.raises(JournalCorruptError, match=f"{stream}#2"):
            await store.read(stream)
        run_sql(postgres_dsn, f"DELETE FROM {table} WHERE seq IN (2, 4)")
        for after, limit in ((0, None), (1, 1), (2, None)):
            with pytest.raises(JournalCorruptError, match="missing"):
                await store.read(stream, after=after, limit=limit)
        assert await store.read(stream, after=2, limit=1) == envs(stream, 3, 1)


async def test_events_left_without_their_stream_row_are_damage_never_an_empty_stream(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # The read started from the stream row: without it the events were never looked at, the stream
    # read as empty and the session looked new; writing it again failed as "unavailable" (retry).
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 3)))
        run_sql(postgres_dsn, f'DELETE FROM "{fresh_pg_schema}".streams WHERE stream_id = %s', (stream,))
        for after, limit in ((0, None), (1, 1), (2, 5)):
            with pytest.raises(
                JournalCorruptError, match=f"{stream}#{after + 1} is corrupt: the stream has events but no head"
            ):
                await store.read(stream, after=after, limit=limit)
        assert await store.read(stream, after=3) == []  # nothing stored past it, as on SQLite
        with pytest.raises(JournalCorruptError, match=f"{stream}#1 is corrupt: the stream has events but no head"):
            await store.append(batch(lease, stream, envs(stream, 1, 1)))  # as a stream never written


async def test_an_unknown_format_marker_is_refused(postgres_dsn: str, fresh_pg_schema: str) -> None:
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema):
        pass
    assert run_sql(postgres_dsn, f'SELECT value FROM "{fresh_pg_schema}".meta') == [(STORE_FORMAT,)]
    run_sql(postgres_dsn, f"UPDATE \"{fresh_pg_schema}\".meta SET value = 'trio_agent.journal.postgres/99'")
    with pytest.raises(JournalCorruptError, match="postgres/99"):
        async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema):
            pass


@pytest.mark.parametrize(
    "tables",
    [
        ["CREATE TABLE {s}.events(id serial PRIMARY KEY, name text)", "INSERT INTO {s}.events(name) VALUES ('app')"],
        ["CREATE TABLE {s}.meta(id int)", "CREATE TABLE {s}.orders(id int)"],
        ["CREATE TABLE {s}.meta(key text PRIMARY KEY, value text NOT NULL)", "INSERT INTO {s}.meta VALUES ('a', 'b')"],
        ["CREATE VIEW {s}.streams AS SELECT 'x'::text AS stream_id, 'y'::text AS session_id, 1::bigint AS head"],
    ],
    ids=["app-events", "app-meta-of-another-shape", "app-rows-in-a-meta-like-ours", "a-view"],
)
async def test_a_schema_holding_other_tables_of_the_same_names_is_refused_and_left_unchanged(
    postgres_dsn: str, fresh_pg_schema: str, tables: list[str]
) -> None:
    # It was adopted: CREATE TABLE IF NOT EXISTS skipped the application's table, the format row was
    # stamped, and every write then failed as "unavailable" (outcome unknown) on the foreign columns.
    schema = f'"{fresh_pg_schema}"'
    run_sql(postgres_dsn, f"CREATE SCHEMA {schema}")
    for statement in tables:
        run_sql(postgres_dsn, statement.format(s=schema))
    listing = (
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = %s"
        " ORDER BY table_name, column_name"
    )
    before = run_sql(postgres_dsn, listing, (fresh_pg_schema,))
    with pytest.raises(JournalCorruptError, match="not a trio_agent journal"):
        async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema):
            pass
    assert run_sql(postgres_dsn, listing, (fresh_pg_schema,)) == before


async def test_tables_exactly_like_the_journals_are_adopted_and_keep_their_rows(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # The workers' tables create `leases` with the journal's definition before any store opens the schema.
    schema = f'"{fresh_pg_schema}"'
    run_sql(postgres_dsn, f"CREATE SCHEMA {schema}")
    run_sql(
        postgres_dsn,
        f"CREATE TABLE {schema}.leases(session_id text PRIMARY KEY, owner text NOT NULL, token bigint NOT NULL,"
        " expires_at double precision NOT NULL)",
    )
    run_sql(postgres_dsn, f"INSERT INTO {schema}.leases VALUES ('queued', '', 0, '-Infinity')")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("queued", "A", LONG_TTL)
    assert lease.token == 1
    assert run_sql(postgres_dsn, f"SELECT value FROM {schema}.meta") == [(STORE_FORMAT,)]


async def test_the_columns_the_open_expects_are_the_ones_it_creates(postgres_dsn: str, fresh_pg_schema: str) -> None:
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema):
        pass
    rows = run_sql(
        postgres_dsn,
        "SELECT table_name, column_name, data_type FROM information_schema.columns WHERE table_schema = %s",
        (fresh_pg_schema,),
    )
    created: dict[str, dict[str, str]] = {}
    for table, column, data_type in rows:
        created.setdefault(table, {})[column] = data_type
    assert created == _COLUMNS


async def test_reopening_keeps_everything_and_several_stores_open_one_schema_at_once(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    stream = stream_id_for("sess", "root")
    async with trio.open_nursery() as nursery:  # concurrent schema creation must not collide
        for _ in range(3):
            nursery.start_soon(_open_and_close, postgres_dsn, fresh_pg_schema)
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 2), "cmd"))
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        assert await store.read(stream) == envs(stream, 1, 2)
        assert await store.current_lease("sess") == lease
        assert [c.command_id for c in await store.commands(stream)] == ["cmd"]


async def test_opening_a_store_waits_for_no_write_in_progress(postgres_dsn: str, fresh_pg_schema: str) -> None:
    # CREATE INDEX IF NOT EXISTS takes a SHARE lock on its table even when the index exists: every
    # open waited behind a write transaction left open (a process frozen mid-batch) until
    # statement_timeout, and every other store's writes queued behind the open's lock request.
    stream = stream_id_for("sess", "root")
    schema = f'"{fresh_pg_schema}"'
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 1), "cmd"))
    with psycopg.connect(postgres_dsn) as frozen:  # writes to both indexed tables, never committed
        frozen.execute(f"UPDATE {schema}.streams SET head = head WHERE stream_id = %s".encode(), (stream,))
        frozen.execute(f"INSERT INTO {schema}.commands VALUES (%s, 'other', 'd', 2, 2)".encode(), (stream,))
        with trio.fail_after(PROMPT):
            async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, statement_timeout=PROMPT) as store:
                assert await store.head(stream) == 1
        frozen.rollback()
    # A schema made before the index existed still gets it on open.
    run_sql(postgres_dsn, f"DROP INDEX {schema}.commands_seq")
    await _open_and_close(postgres_dsn, fresh_pg_schema)
    indexes = run_sql(postgres_dsn, "SELECT indexname FROM pg_indexes WHERE schemaname = %s", (fresh_pg_schema,))
    assert {"commands_seq", "streams_session"} <= {name for (name,) in indexes}


async def _open_and_close(dsn: str, schema: str) -> None:
    async with open_postgres_store(dsn, schema=schema):
        pass


async def test_the_store_connections_use_tcp_keepalives_unless_the_dsn_says_otherwise(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # Without them a server that vanished (answering nothing, not even an error) held a write for as
    # long as the kernel retransmits, statement_timeout being the server's own.
    def settings(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        return conninfo_to_dict(conn.info.dsn)

    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        made = await store.run_read(settings)
        assert store._listener is not None  # (the writer's is made by the same `_connect`)
        for used in (made, settings(store._listener)):
            assert {key: used.get(key) for key in ("keepalives", "keepalives_idle", "tcp_user_timeout")} == {
                "keepalives": "1",
                "keepalives_idle": "10",
                "tcp_user_timeout": "30000",
            }
    async with open_postgres_store(f"{postgres_dsn} keepalives_idle=99", schema=fresh_pg_schema) as store:
        made = await store.run_read(settings)
        assert (made["keepalives_idle"], made["tcp_user_timeout"]) == ("99", "30000")  # the DSN's own wins


async def test_an_unreachable_database_is_unavailable_and_the_password_stays_secret() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    dsn = f"postgresql://someone:s3cr3t-pw@127.0.0.1:{port}/journal"
    with trio.fail_after(15), pytest.raises(JournalUnavailableError) as info:
        async with open_postgres_store(dsn):
            pass
    message = str(info.value)
    assert f"127.0.0.1:{port}/journal" in message
    assert "s3cr3t-pw" not in message
    assert "s3cr3t-pw" not in repr(info.value.__cause__) + repr(info.value.__context__)


def test_bad_arguments_are_refused_before_connecting() -> None:
    for kwargs in ({"schema": "no-dashes"}, {"schema": ""}, {"schema": "x" * 64}, {"poll_interval": 0}):
        with pytest.raises(JournalError):
            PostgresStore("host=127.0.0.1", **kwargs)
    with pytest.raises(JournalError, match="not a valid") as info:
        PostgresStore("host=127.0.0.1 password=s3cr3t bogus")
    assert "s3cr3t" not in str(info.value)


async def test_closed_store_refuses_reads_and_writes(postgres_dsn: str, fresh_pg_schema: str) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.read(stream)
        conns = [store._writer, store._listener, *store._idle_readers]
        pids = [conn.info.backend_pid for conn in conns if conn is not None]
        assert len(pids) == 3
    assert all(conn is None or conn.closed for conn in conns)
    with pytest.raises(JournalError):
        await store.read(stream)
    with pytest.raises(JournalUnavailableError):
        await store.append(batch(lease, stream, envs(stream, 1, 1)))
    await store.wait_for_append(stream, 0)  # returns at once
    # The server ends the sessions soon after the client closed them (its backends exit on their own time).
    with trio.fail_after(10):
        while run_sql(postgres_dsn, "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)):
            await trio.sleep(0.05)


async def test_what_the_block_raises_comes_out_as_it_is(postgres_dsn: str, fresh_pg_schema: str) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="in the block"):
        async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema):
            raise Boom("in the block")

    started = time.monotonic()
    with trio.move_on_after(0.2) as scope:
        async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, poll_interval=30) as store:
            await store.wait_for_append(stream_id_for("sess", "root"), 0)
    assert scope.cancelled_caught
    assert time.monotonic() - started < PROMPT


# ---------------------------------------------------------------- bounded clean-up (cleanup_grace)

GRACE = 0.2
RELEASE_AFTER = 10.0  # a stuck test thread lets go after this anyway, so a regression fails rather than hangs


class GatedClock:
    """A lease clock (called by the writer thread inside its transaction) that blocks while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> float:
        if self.armed and not self.release.is_set():
            self.entered.set()
            self.release.wait(RELEASE_AFTER)
        return time.time()


def overruns(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trio_agent" and r.levelno == logging.WARNING]


async def test_close_with_a_stuck_write_is_bounded_and_the_journal_stays_consistent(
    postgres_dsn: str, fresh_pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    stream = stream_id_for("sess", "root")
    clock = GatedClock()
    store: PostgresStore | None = None
    try:
        async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, clock=clock, cleanup_grace=GRACE) as store:
            lease = await store.acquire_lease("sess", "A", LONG_TTL)
            await store.append(batch(lease, stream, envs(stream, 1, 2)))
            clock.armed = True
            stuck = store.submit(batch(lease, stream, envs(stream, 3, 2)))
            assert await trio.to_thread.run_sync(clock.entered.wait, RELEASE_AFTER)  # inside its transaction
            behind = store.submit(batch(lease, stream, envs(stream, 5, 1)))
        lane = store._lane
        assert lane is not None
        assert not lane.stopped  # the close returned while the write was stuck
        assert not stuck.done
    finally:
        clock.release.set()
    assert any("journal writer (postgres" in m and "0.2 s" in m for m in overruns(caplog))
    with trio.fail_after(RELEASE_AFTER):
        assert await stuck.wait() == AppendResult(stream, 3, 4)  # the transaction in progress completes whole
        with pytest.raises(JournalUnavailableError):
            await behind.wait()  # nothing not yet begun is written after the close
    await trio.to_thread.run_sync(lane._stopped.wait, RELEASE_AFTER)
    assert store._writer is None  # closed by the writer thread itself, after its transaction
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as again:
        assert await again.read(stream) == envs(stream, 1, 4)
        assert await again.head(stream) == 4


async def test_a_cancelled_read_whose_thread_never_returns_is_abandoned_after_cleanup_grace(
    postgres_dsn: str, fresh_pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    used: list[Any] = []

    def stuck(conn: Any) -> None:
        # Not in a statement, so the server-side cancel cannot end it: only the bound can.
        used.append(conn)
        entered.set()
        release.wait(RELEASE_AFTER)
        returned.set()

    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, cleanup_grace=GRACE) as store:
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(store._query, stuck)
                    assert await trio.to_thread.run_sync(entered.wait, RELEASE_AFTER)
                    scope.cancel()
            assert scope.cancelled_caught
            assert not returned.is_set()  # the cancelled read ended while its thread still ran
        finally:
            release.set()
        assert any("a cancelled PostgreSQL read" in m and "0.2 s" in m for m in overruns(caplog))
        with trio.fail_after(RELEASE_AFTER):
            # The abandoned thread gives its limiter token back once it is back (after closing its connection).
            borrowers = [object() for _ in range(int(store._read_threads.total_tokens))]
            for borrower in borrowers:
                await store._read_threads.acquire_on_behalf_of(borrower)
            for borrower in borrowers:
                store._read_threads.release_on_behalf_of(borrower)
            assert used[0].closed
            assert used[0] not in store._idle_readers
            assert await store._query(lambda conn: conn.execute(b"SELECT 7").fetchall()) == [(7,)]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
async def test_cleanup_grace_is_validated(postgres_dsn: str, fresh_pg_schema: str, bad: float) -> None:
    with pytest.raises(ConfigError, match="cleanup_grace"):
        async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema, cleanup_grace=bad):
            pass  # pragma: no cover


# ---------------------------------------------------------------- checksums and the version-1 migration


async def test_a_row_edited_with_sql_into_other_valid_json_is_caught(postgres_dsn: str, fresh_pg_schema: str) -> None:
    stream = stream_id_for("sess", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 3)))
        table = f'"{fresh_pg_schema}".events'
        # Still a valid, decodable envelope of the same stream and seq: only the checksum can tell.
        run_sql(postgres_dsn, f"UPDATE {table} SET body = replace(body, '\"r2\"', '\"r9\"') WHERE seq = 2")
        assert "r9" in run_sql(postgres_dsn, f"SELECT body FROM {table} WHERE seq = 2")[0][0]
        with pytest.raises(JournalCorruptError, match=f"{stream}#2 is corrupt: checksum mismatch"):
            await store.read(stream)
        assert await store.read(stream, limit=1) == envs(stream, 1, 1)
        assert await store.read(stream, after=2) == envs(stream, 3, 1)
        stats = store.statistics()
        assert stats["batches"] >= 2 and 0.0 < stats["longest_write_hold"] < PROMPT


_V1_SCHEMA = (
    "CREATE SCHEMA {s}",
    "CREATE TABLE {s}.meta(key text PRIMARY KEY, value text NOT NULL)",
    "CREATE TABLE {s}.streams(stream_id text PRIMARY KEY, session_id text NOT NULL, head bigint NOT NULL)",
    "CREATE INDEX streams_session ON {s}.streams(session_id, stream_id)",
    "CREATE TABLE {s}.events(stream_id text NOT NULL, seq bigint NOT NULL, token bigint NOT NULL,"
    " body text NOT NULL, PRIMARY KEY(stream_id, seq))",
    "CREATE TABLE {s}.leases(session_id text PRIMARY KEY, owner text NOT NULL, token bigint NOT NULL,"
    " expires_at double precision NOT NULL)",
    "CREATE TABLE {s}.commands(stream_id text NOT NULL, command_id text NOT NULL, digest text NOT NULL,"
    " first_seq bigint NOT NULL, last_seq bigint NOT NULL, PRIMARY KEY(stream_id, command_id))",
)
"""The tables exactly as schema version 1 (``trio_agent.journal.postgres/1``) created them."""


async def test_a_version_1_schema_is_migrated_when_a_store_opens_it(postgres_dsn: str, fresh_pg_schema: str) -> None:
    from trio_agent._journal._codec import row_checksum
    from trio_agent._journal._postgres import V1_FORMAT
    from trio_agent._journal._store import encode_body

    s = f'"{fresh_pg_schema}"'
    for statement in _V1_SCHEMA:
        run_sql(postgres_dsn, statement.format(s=s))
    run_sql(postgres_dsn, f"INSERT INTO {s}.meta VALUES ('format', %s)", (V1_FORMAT,))
    streams = [stream_id_for(f"sess{i}", "root") for i in range(3)]
    count = 1500 // len(streams) + 1  # more rows than one migration chunk
    for index, stream in enumerate(streams):
        rows = [(stream, e.seq, encode_body(e)) for e in envs(stream, 1, count)]
        with psycopg.connect(postgres_dsn, autocommit=True) as conn, conn.cursor() as cursor:
            cursor.executemany(f"INSERT INTO {s}.events VALUES (%s, %s, 1, %s)".encode(), rows)
        run_sql(postgres_dsn, f"INSERT INTO {s}.streams VALUES (%s, %s, %s)", (stream, f"sess{index}", count))
        run_sql(postgres_dsn, f"INSERT INTO {s}.leases VALUES (%s, 'A', 1, 1e300)", (f"sess{index}",))

    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        for stream in streams:
            assert await store.read(stream) == envs(stream, 1, count)
        lease = await store.current_lease("sess0")
        assert lease is not None
        await store.append(batch(lease, streams[0], envs(streams[0], count + 1, 1)))
        assert await store.head(streams[0]) == count + 1
    assert run_sql(postgres_dsn, f"SELECT value FROM {s}.meta") == [(STORE_FORMAT,)]
    nullable = run_sql(
        postgres_dsn,
        "SELECT is_nullable FROM information_schema.columns WHERE table_schema = %s AND table_name = 'events'"
        " AND column_name = 'checksum'",
        (fresh_pg_schema,),
    )
    assert nullable == [("NO",)]
    for stream, seq, body, checksum in run_sql(postgres_dsn, f"SELECT stream_id, seq, body, checksum FROM {s}.events"):
        assert checksum == row_checksum(stream, seq, body.encode())
    # A version-1 writer still attached is refused, never trusted.
    with pytest.raises(psycopg.errors.NotNullViolation):
        run_sql(postgres_dsn, f"INSERT INTO {s}.events(stream_id, seq, token, body) VALUES ('x/root', 1, 1, '{{}}')")
    # Old rows are protected from now on.
    run_sql(postgres_dsn, f"UPDATE {s}.events SET body = replace(body, '\"r5\"', '\"r6\"') WHERE seq = 5")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        with pytest.raises(JournalCorruptError, match=f"{streams[1]}#5 is corrupt: checksum mismatch"):
            await store.read(streams[1])


@pytest.mark.parametrize(
    "options",
    [
        {"poll_interval": 10**400},  # too large for a float: OverflowError before
        {"poll_interval": 0},
        {"statement_timeout": 10**400},
        {"statement_timeout": 10**7},  # past PostgreSQL's int32 of milliseconds: refused at connect before
        {"statement_timeout": -1},
    ],
    ids=["poll-huge", "poll-zero", "statement-huge", "statement-past-int32", "statement-negative"],
)
def test_bad_timings_are_a_journal_error_before_any_connection(options: dict[str, Any]) -> None:
    with pytest.raises(JournalError, match=next(iter(options))):
        PostgresStore("postgresql://nobody@127.0.0.1:1/none", **options)


@pytest.mark.parametrize("bad", [None, "100", 0, 1.5])
async def test_a_bad_max_batch_is_a_config_error_before_any_connection(bad: Any) -> None:
    # It was taken as it was: the writer thread died on its first batch and every waiter hung.
    with pytest.raises(ConfigError, match="max_batch"):  # not JournalUnavailableError: nothing was tried
        async with open_postgres_store("postgresql://nobody@127.0.0.1:1/none", max_batch=bad):
            pass


async def test_a_lease_row_whose_expiry_is_nan_is_damage_for_every_use_and_fails_alone(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # NaN compares as neither expired nor valid: another owner could acquire the session while the
    # holder's appends still passed the fence. SQLite refuses such a row as damage; so does this store.
    stream = stream_id_for("damaged", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        damaged = await store.acquire_lease("damaged", "A", LONG_TTL)
        neighbour = await store.acquire_lease("neighbour", "A", LONG_TTL)
        damage = f"UPDATE \"{fresh_pg_schema}\".leases SET expires_at = 'NaN' WHERE session_id = 'damaged'"
        run_sql(postgres_dsn, damage)
        with store.grouped():
            appended = store.submit(batch(damaged, stream, envs(stream, 1, 1)))
            renewed = store.submit_renew(damaged, LONG_TTL)
            renewed_neighbour = store.submit_renew(neighbour, LONG_TTL)
        with trio.fail_after(10):
            for item in (appended, renewed):
                with pytest.raises(JournalCorruptError, match="'damaged' is damaged: its expiry is NaN"):
                    await item.wait()
            assert (await renewed_neighbour.wait()).token == neighbour.token
            with pytest.raises(JournalCorruptError, match="expiry is NaN"):
                await store.acquire_lease("damaged", "B", LONG_TTL)
            for read in (store.current_lease, store.live_lease):
                with pytest.raises(JournalCorruptError, match="expiry is NaN"):
                    await read("damaged")
        assert await store.head(stream) == 0


async def test_a_negative_stored_head_is_damage_to_its_stream_alone(postgres_dsn: str, fresh_pg_schema: str) -> None:
    # An int, but no head the store writes: a subscription from the start took it for the caller's
    # cursor being past the head (CursorError), and an append met a sequence conflict, not damage.
    damaged, neighbour = stream_id_for("damaged", "root"), stream_id_for("neighbour", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("damaged", "A", LONG_TTL)
        other = await store.acquire_lease("neighbour", "A", LONG_TTL)
        await store.append(batch(lease, damaged, envs(damaged, 1, 2)))
        await store.append(batch(other, neighbour, envs(neighbour, 1, 2)))
        run_sql(postgres_dsn, f'UPDATE "{fresh_pg_schema}".streams SET head = -1 WHERE stream_id = %s', (damaged,))
        named = f"stored event {damaged}#head is corrupt: the stream's row is damaged: the stored head is -1"
        with trio.fail_after(10):
            with store.grouped():
                appended = store.submit(batch(lease, damaged, envs(damaged, 3, 1)))
                appended_neighbour = store.submit(batch(other, neighbour, envs(neighbour, 3, 1)))
            with pytest.raises(JournalCorruptError, match=named):
                await appended.wait()
            assert (await appended_neighbour.wait()).first_seq == 3
            reads = (store.stream_info(damaged), store.head(damaged), store.streams("damaged"), store.read(damaged))
            for read in reads:
                with pytest.raises(JournalCorruptError, match=named):
                    await read
            with pytest.raises(JournalCorruptError, match=named):
                async with subscribe_durable_events(store, damaged) as sub:
                    await sub.__anext__()
            assert [info.head for info in await store.streams("neighbour")] == [3]


async def test_a_read_bound_past_bigint_means_the_same_as_on_the_other_stores(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # A LIMIT past bigint failed the read ("bigint out of range") where the other stores read on:
    # more rows than bigint counts is no limit, and no seq lies past the largest.
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("s", "owner", LONG_TTL)
        await store.append(batch(lease, "s/root", envs("s/root", 1, 2), command_id="cmd-1"))
        every = await store.read("s/root")
        assert [envelope.seq for envelope in every] == [1, 2]
        for huge in (2**63, 10**30):
            assert await store.read("s/root", after=huge) == []
            assert await store.read("s/root", limit=huge) == every
            assert await store.read("s/root", after=-huge, limit=huge) == every
            assert await store.commands("s/root", after=huge) == []
            assert [record.command_id for record in await store.commands("s/root", after=-huge)] == ["cmd-1"]
        async with subscribe_durable_events(store, "s/root", page_size=2**63) as sub:
            items = [await sub.__anext__() for _ in range(3)]
        assert [item.envelope.seq for item in items if isinstance(item, DurableEvent)] == [1, 2]
        assert isinstance(items[-1], CaughtUp)


async def test_a_body_dense_with_escapes_costs_memory_in_proportion_to_its_size(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # Control characters are stored as JSON escapes (\u0001: six bytes each). The bodies went to the
    # server in psycopg's text form of an array, which escapes each backslash of each element with a
    # regex substitution in Python: a new object per escape, ~50 x the body at its peak (9 MB of
    # control characters took 3 GB and 6 s). The binary form copies each body a few times at most.
    prompt = "\x01" * 200_000
    stream = stream_id_for("s", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("s", "owner", LONG_TTL)
        event = RequestAccepted(request_id="r1", command_id="c1", input={"prompt": prompt})
        append = batch(lease, stream, [EventEnvelope(stream_id=stream, seq=1, event=event, recorded_at=1.5)])
        size = len(append.bodies[0])  # encoded before the measurement: that copy is the caller's
        tracemalloc.start()
        try:
            assert await store.append(append) == AppendResult(stream, 1, 1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 * size, f"appending a {size}-byte body peaked at {peak} bytes"
        [stored] = await store.read(stream)
        assert isinstance(stored.event, RequestAccepted) and stored.event.input == {"prompt": prompt}


_RETYPED = {
    # (table, column, which row, the value it is given once the column is text). Columns no
    # statement compares: a retyped one that is compared fails the statement itself (a JournalError).
    "lease expiry": ("leases", "expires_at", "session_id = 'damaged'", "soon"),
    "stream head": ("streams", "head", "session_id = 'damaged'", "abc"),
    "command seq": ("commands", "last_seq", "stream_id = 'damaged/root'", "2.5"),
}


@pytest.mark.parametrize("retyped", list(_RETYPED))
async def test_a_value_a_column_retyped_by_hand_cannot_hold_is_damage_to_its_row_alone(
    postgres_dsn: str, fresh_pg_schema: str, retyped: str
) -> None:
    # float("soon") escaped as a raw ValueError from the reads, and from the writer's checks it failed
    # every item of the group commit as JournalUnavailableError. The other rows of the retyped column
    # still hold their values (as text), and are read as such.
    table, column, where, value = _RETYPED[retyped]
    damaged, neighbour = stream_id_for("damaged", "root"), stream_id_for("neighbour", "root")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        lease = await store.acquire_lease("damaged", "A", LONG_TTL)
        other = await store.acquire_lease("neighbour", "A", LONG_TTL)
        await store.append(batch(lease, damaged, envs(damaged, 1, 1), "cmd"))
        await store.append(batch(other, neighbour, envs(neighbour, 1, 1), "cmd"))
        name = f'"{fresh_pg_schema}".{table}'
        run_sql(postgres_dsn, f"ALTER TABLE {name} ALTER COLUMN {column} TYPE text")
        run_sql(postgres_dsn, f"UPDATE {name} SET {column} = %s WHERE {where}", (value,))
        lease_damage = "the stored lease of session 'damaged' is damaged"
        damage = {
            "leases": lease_damage,
            "streams": f"stored event {damaged}#head is corrupt: the stream's row is damaged",
            "commands": f"the stored command records of {damaged!r} are damaged",
        }[table]
        with trio.fail_after(10):
            with store.grouped():
                replayed = store.submit(batch(lease, damaged, envs(damaged, 1, 1), "cmd"))
                renewed = store.submit_renew(lease, LONG_TTL)
                appended_neighbour = store.submit(batch(other, neighbour, envs(neighbour, 2, 1), "cmd2"))
                renewed_neighbour = store.submit_renew(other, LONG_TTL)
            with pytest.raises(JournalCorruptError, match=damage):
                await replayed.wait()
            if table == "leases":
                with pytest.raises(JournalCorruptError, match=lease_damage):
                    await renewed.wait()
            else:
                assert (await renewed.wait()).token == lease.token
            assert (await appended_neighbour.wait()).first_seq == 2
            assert (await renewed_neighbour.wait()).token == other.token
            reads: dict[str, list[Callable[[], Awaitable[object]]]] = {
                "leases": [lambda: store.current_lease("damaged"), lambda: store.live_lease("damaged")],
                "streams": [
                    lambda: store.read(damaged),
                    lambda: store.stream_info(damaged),
                    lambda: store.streams("damaged"),
                ],
                "commands": [lambda: store.command(damaged, "cmd"), lambda: store.commands(damaged)],
            }
            for read in reads[table]:
                with pytest.raises(JournalCorruptError, match=damage):
                    await read()
            # The neighbour's row of the same column is read as the value its text holds.
            assert (await store.current_lease("neighbour")) == await store.live_lease("neighbour")
            assert [info.head for info in await store.streams("neighbour")] == [2]
            assert [record.command_id for record in await store.commands(neighbour)] == ["cmd", "cmd2"]
            assert await store.read(neighbour) == envs(neighbour, 1, 2)


async def test_whatever_a_read_raises_comes_out_as_a_journal_error(postgres_dsn: str, fresh_pg_schema: str) -> None:
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        with pytest.raises(JournalError, match="a read failed: ValueError") as caught:
            await store.run_read(lambda conn: int(conn.execute(b"SELECT 'soon'").fetchall()[0][0]))
        assert isinstance(caught.value.__cause__, ValueError)
