"""How waits for appends learn of other processes' writes: ONE poll per store and ``poll_interval``.

A SQLite or PostgreSQL store's `wait_for_append` is woken at once by the store's own commits;
appends made through another store object (another process) are found by polling the heads of
the waited-on streams. However many tasks wait (idle subscriptions), a store reads once per
interval, from one of the waiters (`SharedPoll`), and a wait returns only when its stream grew
(or the poll failed for it, or the store closed), never on a poll that found nothing: an idle
subscription reads no page. The workers' `wait_for_request` shares its inbox reads the same way.

Run on Trio's mock clock, stepped by hand (``mock_clock``): the reads run in threads, which an
autojumping clock would jump past. `Reads.settle` waits until every task is blocked and no read
is in flight.
"""

from __future__ import annotations

import collections
import functools
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent._errors import JournalCorruptError, JournalError, JournalUnavailableError
from trio_agent._journal._events import EventEnvelope, RequestAccepted
from trio_agent._journal._memory import MemoryStore
from trio_agent._journal._sqlite import SQLiteStore, open_sqlite_store
from trio_agent._journal._store import AppendBatch, AppendWaits, Lease, stream_id_for
from trio_agent._journal._subscribe import CaughtUp, DurableEvent, subscribe_durable_events

INTERVAL = 10.0
"""poll_interval of the watching stores, in mock seconds."""

LONG_TTL = 3600.0


def envs(stream_id: str, start: int, count: int) -> list[EventEnvelope]:
    return [
        EventEnvelope(
            stream_id=stream_id,
            seq=seq,
            recorded_at=1.5,
            event=RequestAccepted(request_id=f"r{seq}", command_id=f"c{seq}", input={"prompt": "x"}),
        )
        for seq in range(start, start + count)
    ]


def batch(lease: Lease, stream_id: str, envelopes: Sequence[EventEnvelope]) -> AppendBatch:
    return AppendBatch(lease.session_id, stream_id, lease.token, tuple(envelopes))


class Reads:
    """Counts a store's reads by the method that made them, and knows when none is in flight."""

    def __init__(self, store: Any) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.running = 0
        self.idle = trio.Event()
        self.idle.set()
        name = "_read" if isinstance(store, SQLiteStore) else "_query"  # every read goes through it
        real = getattr(store, name)

        async def counted(fn: Callable[..., Any]) -> Any:
            self.counts[fn.__qualname__.split(".<locals>")[0].rpartition(".")[2]] += 1
            self.running += 1
            if self.running == 1:
                self.idle = trio.Event()
            try:
                return await real(fn)
            finally:
                self.running -= 1
                if not self.running:
                    self.idle.set()

        setattr(store, name, counted)

    async def settle(self) -> None:
        """Until every task is blocked and no read runs (a read's thread is no task)."""
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if not self.running:
                return
            await self.idle.wait()

    def taken(self) -> dict[str, int]:
        counts = dict(self.counts)
        self.counts.clear()
        return counts


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Any]:
    """Opens a store of the backend (the same file or schema each time), watching at `INTERVAL`."""
    if request.param == "sqlite":
        return functools.partial(open_sqlite_store, tmp_path / "journal.db", poll_interval=INTERVAL)
    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("fresh_pg_schema")
    from trio_agent._journal._postgres import open_postgres_store  # lazily: it needs psycopg

    return functools.partial(open_postgres_store, dsn, schema=schema, poll_interval=INTERVAL)


@asynccontextmanager
async def writer_and_watcher(backend: Callable[[], Any]) -> AsyncIterator[tuple[Any, Any]]:
    """Two store objects on one journal: what the first appends, the second learns of only by its
    poll (as another process's append). A PostgreSQL watcher's NOTIFY wake-ups are switched off."""
    async with AsyncExitStack() as stack:
        writer = await stack.enter_async_context(backend())
        watcher = await stack.enter_async_context(backend())
        if hasattr(watcher, "notifications"):
            watcher._wake = lambda stream_id: None  # only the fallback poll is left
        yield writer, watcher


async def test_idle_subscribers_make_one_read_per_interval_however_many_they_are(
    backend: Callable[[], Any], mock_clock: trio.testing.MockClock
) -> None:
    stream = stream_id_for("sess", "root")
    async with backend() as store, trio.open_nursery() as nursery:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 2)))
        reads = Reads(store)
        caught_up = 0

        async def subscriber() -> None:
            nonlocal caught_up
            async with subscribe_durable_events(store, stream) as events:
                async for item in events:
                    caught_up += isinstance(item, CaughtUp)

        for _ in range(100):
            nursery.start_soon(subscriber)
        await reads.settle()
        assert caught_up == 100
        reads.taken()
        for _ in range(5):  # nothing is appended: five intervals, five reads of the heads, no page read
            mock_clock.jump(INTERVAL)
            await reads.settle()
        assert reads.taken() == {"_heads": 5}
        assert len(store._changed) == 1  # one stream waited on
        nursery.cancel_scope.cancel()
    assert len(store._changed) == 0


async def test_an_append_through_another_store_wakes_every_subscriber_within_one_interval(
    backend: Callable[[], Any], mock_clock: trio.testing.MockClock
) -> None:
    stream = stream_id_for("sess", "root")
    async with writer_and_watcher(backend) as (writer, watcher), trio.open_nursery() as nursery:
        lease = await writer.acquire_lease("sess", "A", LONG_TTL)
        await writer.append(batch(lease, stream, envs(stream, 1, 1)))
        reads = Reads(watcher)
        woken: list[tuple[int, float]] = []

        async def subscriber() -> None:
            async with subscribe_durable_events(watcher, stream, after=1) as events:
                async for item in events:
                    if isinstance(item, DurableEvent):
                        woken.append((item.envelope.seq, trio.current_time()))

        for _ in range(50):
            nursery.start_soon(subscriber)
        await reads.settle()
        reads.taken()
        polls = watcher._changed.polls
        await writer.append(batch(lease, stream, envs(stream, 2, 1)))
        appended_at = trio.current_time()
        mock_clock.jump(INTERVAL * 0.99)
        await reads.settle()
        assert woken == [] and reads.taken() == {}  # no poll yet, and no wait returned
        mock_clock.jump(INTERVAL * 0.01)
        await reads.settle()
        assert woken == [(2, appended_at + INTERVAL)] * 50  # every one, one interval later
        assert watcher._changed.polls == polls + 1  # by one poll
        # Then each reads its event, reads on to the head (nothing), and waits again: its wait
        # looks at the head once (what it read may be behind a commit that woke no one), then idles.
        assert reads.taken() == {"_heads": 1 + 50, "read": 2 * 50}
        nursery.cancel_scope.cancel()


async def test_a_waiter_that_leaves_hands_the_poll_to_another(
    backend: Callable[[], Any], mock_clock: trio.testing.MockClock
) -> None:
    """The first waiter polls for all; cancelled (at its wait, or during a poll), another takes over
    when the next poll is due, and the others are still woken within the interval."""
    stream = stream_id_for("sess", "root")
    async with writer_and_watcher(backend) as (writer, watcher), trio.open_nursery() as nursery:
        lease = await writer.acquire_lease("sess", "A", LONG_TTL)
        await writer.append(batch(lease, stream, envs(stream, 1, 1)))
        reads = Reads(watcher)
        woken: list[str] = []
        scopes = {name: trio.CancelScope() for name in ("first", "second", "third", "fourth")}

        async def waiter(name: str) -> None:
            with scopes[name]:
                await watcher.wait_for_append(stream, 1)
                woken.append(name)

        for name in scopes:
            nursery.start_soon(waiter, name)
            await reads.settle()  # in this order: "first" leads
        reads.taken()
        mock_clock.jump(INTERVAL)
        await reads.settle()
        assert reads.taken() == {"_heads": 1}
        scopes["first"].cancel()  # the leader, at its wait
        await reads.settle()
        assert reads.taken() == {}  # no extra read: the next poll is due when it was
        mock_clock.jump(INTERVAL)
        await reads.settle()
        assert reads.taken() == {"_heads": 1}
        mock_clock.jump(INTERVAL)
        scopes["second"].cancel()  # the leader again, now that its poll has begun
        await reads.settle()
        assert sum(reads.taken().values()) <= 2  # the cut-short poll, then its successor's at once
        await writer.append(batch(lease, stream, envs(stream, 2, 1)))
        mock_clock.jump(INTERVAL)
        await reads.settle()
        assert sorted(woken) == ["fourth", "third"]
        assert reads.taken() == {"_heads": 1}
    assert len(watcher._changed) == 0


async def test_a_poll_that_finds_a_damaged_head_fails_its_stream_alone(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The poll reads both streams at once; a damaged row wakes the subscriptions of its stream,
    whose next read raises the damage as ever, and the other stream's go on waiting."""
    damaged, intact = stream_id_for("one", "root"), stream_id_for("two", "root")
    path = tmp_path / "journal.db"
    async with (
        open_sqlite_store(path, poll_interval=INTERVAL) as store,
        trio.open_nursery() as nursery,
    ):
        for session, stream in (("one", damaged), ("two", intact)):
            lease = await store.acquire_lease(session, "A", LONG_TTL)
            await store.append(batch(lease, stream, envs(stream, 1, 1)))
        reads = Reads(store)
        seen: dict[str, list[object]] = {damaged: [], intact: []}

        async def subscriber(stream: str) -> None:
            try:
                async with subscribe_durable_events(store, stream, after=1) as events:
                    async for item in events:
                        seen[stream].append(item.envelope.seq if isinstance(item, DurableEvent) else item)
            except JournalError as exc:
                seen[stream].append(type(exc))

        for _ in range(3):
            nursery.start_soon(subscriber, damaged)
            nursery.start_soon(subscriber, intact)
        await reads.settle()
        assert all(len(items) == 3 and all(isinstance(item, CaughtUp) for item in items) for items in seen.values())
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE journal_streams SET head='x' WHERE stream_id=?", (damaged,))
        reads.taken()
        mock_clock.jump(INTERVAL)
        await reads.settle()
        assert reads.taken() == {"_heads": 1, "read": 3}
        assert seen[damaged][3:] == [JournalCorruptError] * 3
        assert len(seen[intact]) == 3  # still waiting
        await store.append(batch(lease, intact, envs(intact, 2, 1)))
        await reads.settle()
        assert seen[intact][3:] == [2, 2, 2]
        nursery.cancel_scope.cancel()


async def test_a_failed_poll_returns_every_wait_and_the_polls_go_on(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """A poll that fails (the read raised) returns the waits, whose callers' reads report the
    failure; the store is not harmed: the next waits are polled for as before."""
    stream = stream_id_for("sess", "root")
    async with open_sqlite_store(tmp_path / "journal.db", poll_interval=INTERVAL) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(batch(lease, stream, envs(stream, 1, 1)))
        reads = Reads(store)
        real_heads = store._heads
        failing = False

        async def heads(stream_ids: Sequence[str]) -> dict[str, int | JournalError]:
            if failing:
                await trio.lowlevel.checkpoint()
                raise JournalUnavailableError("the database is locked")
            return await real_heads(stream_ids)

        store._heads = heads  # type: ignore[method-assign]
        returned: list[int] = []

        async def waiter(index: int) -> None:
            await store.wait_for_append(stream, 1)
            returned.append(index)

        async with trio.open_nursery() as nursery:
            for index in range(10):
                nursery.start_soon(waiter, index)
            await reads.settle()
            failing = True
            mock_clock.jump(INTERVAL)
            await reads.settle()
            assert sorted(returned) == list(range(10))
        failing = False
        returned.clear()
        async with trio.open_nursery() as nursery:
            for index in range(10):
                nursery.start_soon(waiter, index)
            await reads.settle()
            reads.taken()
            mock_clock.jump(INTERVAL)
            await reads.settle()
            assert reads.taken() == {"_heads": 1} and returned == []
            await store.append(batch(lease, stream, envs(stream, 2, 1)))
        assert sorted(returned) == list(range(10))


async def test_waits_on_a_closed_store_return(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    stream = stream_id_for("sess", "root")
    returned = 0
    async with trio.open_nursery() as nursery:
        async with open_sqlite_store(tmp_path / "journal.db", poll_interval=INTERVAL) as store:
            reads = Reads(store)

            async def waiter() -> None:
                nonlocal returned
                await store.wait_for_append(stream, 0)
                returned += 1

            for _ in range(5):
                nursery.start_soon(waiter)
            await reads.settle()
            assert returned == 0
        await reads.settle()
        assert returned == 5 and len(store._changed) == 0
        await store.wait_for_append(stream, 0)  # closed: at once


async def test_a_memory_wait_on_a_stream_that_does_not_exist_yet_waits_for_its_first_append(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(clock=trio.current_time)
    lease = await store.acquire_lease("sess", "A", LONG_TTL)
    stream = stream_id_for("sess", "later")
    woke: list[float] = []

    async def waiter() -> None:
        await store.wait_for_append(stream, 0)  # one call: no wake-up before the append
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        nursery.start_soon(waiter)
        await trio.sleep(3600)
        assert woke == []
        appended_at = trio.current_time()
        await store.append(batch(lease, stream, envs(stream, 1, 1)))
    assert woke == [appended_at, appended_at]
    assert store._waits is not None and len(store._waits) == 0

    with trio.move_on_after(1):  # a wait cancelled leaves nothing behind
        await store.wait_for_append(stream_id_for("sess", "never"), 0)
    assert len(store._waits) == 0


async def test_many_wait_for_request_share_one_inbox_read_per_interval(
    postgres_dsn: str, fresh_pg_schema: str, mock_clock: trio.testing.MockClock
) -> None:
    """Waits for requests that are not in the journal (yet): every interval, one read of the heads
    and one of the inbox for all of them; a refusal written meanwhile ends its own wait alone."""
    import psycopg

    from trio_agent._journal._postgres import open_postgres_store
    from trio_agent.workers import submit, wait_for_request

    await trio.to_thread.run_sync(
        functools.partial(submit, "s0", "hello", request_id="r0", dsn=postgres_dsn, schema=fresh_pg_schema)
    )  # the workers' tables exist; no worker runs
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema, poll_interval=INTERVAL) as store,
        trio.open_nursery() as nursery,
    ):
        reads = Reads(store)
        outcomes: dict[str, str] = {}

        async def waiter(index: int) -> None:
            outcome = await wait_for_request(store, f"s{index}", f"r{index}")
            outcomes[outcome.request_id] = outcome.state

        for index in range(30):
            nursery.start_soon(waiter, index)
        await reads.settle()
        reads.taken()
        for _ in range(3):
            mock_clock.jump(INTERVAL)
            await reads.settle()
        assert reads.taken() == {"_heads": 3, "refused": 3}
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(
                f'INSERT INTO "{fresh_pg_schema}".inbox(session_id, request_id, prompt, priority, submitted_at,'
                " state, outcome, updated_at) VALUES ('s7', 'r7', 'x', 0, 0, 'done', 'refused', 0)"
            )
        mock_clock.jump(INTERVAL)
        await reads.settle()
        assert outcomes == {"r7": "refused"}
        assert reads.taken() == {"_heads": 1, "refused": 1}
        nursery.cancel_scope.cancel()


async def test_a_memory_store_s_close_returns_its_waits_and_ends_its_subscriptions() -> None:
    # The protocol's rule ("return when the stream may have grown, or the store closed"): the
    # memory store's close woke nobody, so a wait on a stream not yet made waited for ever.
    store = MemoryStore()
    returned: list[int] = []

    async def wait(after: int) -> None:
        await store.wait_for_append("s1/root", after)
        returned.append(after)

    with trio.fail_after(10):  # a guard: the close returns the waits at once
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, 0)
            nursery.start_soon(wait, 5)
            await trio.testing.wait_all_tasks_blocked()
            assert returned == []
            await store.aclose()
    assert sorted(returned) == [0, 5]
    with trio.fail_after(1):
        await store.wait_for_append("s1/root", 0)  # after the close: at once
    with pytest.raises(JournalError, match="closed"):
        await store.read("s1/root")


async def test_a_wait_cancelled_while_it_looks_raises_even_when_the_look_finds_the_append() -> None:
    # A store's first look is a read in a worker thread, which finishes though its caller was
    # cancelled meanwhile: the wait returned as if it had waited, inside a cancelled scope (a
    # cancelled waiter was counted woken, 1 run in 10 of test_abandoned_waits_leave_no_wake_up_behind).
    waits = AppendWaits()
    looking, answer = trio.Event(), trio.Event()

    async def heads(stream_ids: Sequence[str]) -> dict[str, int | JournalError]:
        looking.set()
        with trio.CancelScope(shield=True):  # as a thread's read, which cannot be abandoned
            await answer.wait()
        return dict.fromkeys(stream_ids, 5)

    returned: list[bool] = []
    scope = trio.CancelScope()

    async def waiter() -> None:
        with scope:
            await waits.wait_for_append("s/root", 1, heads=heads)
            returned.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await looking.wait()
        scope.cancel()
        answer.set()
    assert returned == []
    assert scope.cancelled_caught


async def test_a_wait_woken_and_cancelled_while_it_looks_raises_even_when_the_look_found_nothing() -> None:
    # The other order: the look read the head before the append, and the append's wake finished the
    # waiter meanwhile, so `SharedPoll.wait` had nothing left to wait for. It returned without an
    # await inside the cancelled scope (test_abandoned_waits_leave_no_wake_up_behind[sqlite] saw
    # the cancelled waiter counted woken on a fresh CI machine).
    waits = AppendWaits()
    looking, answer = trio.Event(), trio.Event()

    async def heads(stream_ids: Sequence[str]) -> dict[str, int | JournalError]:
        looking.set()
        with trio.CancelScope(shield=True):  # as a thread's read, which cannot be abandoned
            await answer.wait()
        return dict.fromkeys(stream_ids, 1)  # read before the append

    returned: list[bool] = []
    scope = trio.CancelScope()

    async def waiter() -> None:
        with scope:
            await waits.wait_for_append("s/root", 1, heads=heads)
            returned.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await looking.wait()
        scope.cancel()
        waits.wake("s/root")  # the append commits while the look still reads
        answer.set()
    assert returned == []
    assert scope.cancelled_caught
