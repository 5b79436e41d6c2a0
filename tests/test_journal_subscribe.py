"""Durable-event subscriptions: replay, one `CaughtUp`, live events, cursors, the end,
slow subscribers and uncommitted events, on the memory and the SQLite store."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent.journal import (
    AppendBatch,
    AppendTicket,
    CaughtUp,
    CursorError,
    DurableEvent,
    DurableEventStream,
    JournalCorruptError,
    JournalCursor,
    JournalError,
    JournalStore,
    LeaseLostError,
    MemoryStore,
    RequestAccepted,
    SessionClosed,
    SessionCloseReason,
    SessionCreated,
    SessionReopened,
    open_journal,
    open_sqlite_store,
    subscribe_durable_events,
)
from trio_agent.testing import FaultyStore

SID = "sess"
STREAM = f"{SID}/root"
Item = DurableEvent | CaughtUp


def accepted(request_id: str) -> RequestAccepted:
    return RequestAccepted(request_id=request_id, command_id=f"cmd-{request_id}", input={"prompt": request_id})


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JournalStore]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        async with open_sqlite_store(tmp_path / "j.db", poll_interval=0.02) as sqlite:
            yield sqlite


async def until_caught_up(sub: DurableEventStream) -> list[Item]:
    items: list[Item] = []
    async for item in sub:
        items.append(item)
        if isinstance(item, CaughtUp):
            break
    return items


def seqs(items: list[Item]) -> list[int]:
    return [item.envelope.seq for item in items if isinstance(item, DurableEvent)]


class _AppendAfterAnEmptyRead:
    """A store whose next read that finds nothing runs *hook* (an append that commits) before it
    answers: the interleaving of a reader thread that raced the writer, forced."""

    def __init__(self, inner: JournalStore) -> None:
        self.inner = inner
        self.hook: Any = None

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> Any:
        rows = await self.inner.read(stream_id, after=after, limit=limit)
        hook, self.hook = self.hook, None
        if hook is not None and not rows:
            await hook()
        return rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_an_append_committed_between_the_read_and_the_wait_is_delivered_without_the_poll(
    tmp_path: Path,
) -> None:
    # SQLite's wait only registered for the next wake-up, after the subscriber's read found
    # nothing: the append's wake-up, between the two, reached no one, and the event came a whole
    # poll_interval later (an hour here).
    async with open_sqlite_store(tmp_path / "j.db", poll_interval=3600) as sqlite:
        wrapped: Any = _AppendAfterAnEmptyRead(sqlite)
        async with open_journal(sqlite, session_id=SID) as journal, subscribe_durable_events(wrapped, STREAM) as sub:
            head = seqs(await until_caught_up(sub))[-1]

            async def append() -> None:
                await journal.append(accepted("between"))

            wrapped.hook = append
            with trio.fail_after(10):
                item = await sub.__anext__()
        assert wrapped.hook is None  # the read found nothing, then the append committed
        assert isinstance(item, DurableEvent) and item.envelope.seq == head + 1
        assert isinstance(item.envelope.event, RequestAccepted) and item.envelope.event.request_id == "between"


async def test_replay_then_exactly_one_caught_up_then_live_events(store: JournalStore) -> None:
    got: list[Item] = []
    caught_up = trio.Event()
    async with open_journal(store, session_id=SID) as journal:
        for name in ("r1", "r2", "r3"):
            await journal.append(accepted(name))
        head = await store.head(STREAM)
        assert head == 4

        async def subscriber() -> None:
            async with journal.subscribe_durable_events() as sub:
                async for item in sub:
                    got.append(item)
                    if isinstance(item, CaughtUp):
                        caught_up.set()
                    elif item.envelope.seq == head + 2:
                        return

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(subscriber)
                await caught_up.wait()
                await journal.append(accepted("live1"))
                await journal.append(accepted("live2"))
        stored = await store.read(STREAM)
    markers = [index for index, item in enumerate(got) if isinstance(item, CaughtUp)]
    assert markers == [head]  # exactly one, right after the replay
    marker = got[head]
    assert isinstance(marker, CaughtUp) and marker.cursor == JournalCursor(STREAM, head)
    events = [item for item in got if isinstance(item, DurableEvent)]
    assert [event.envelope for event in events] == stored
    assert seqs(got) == list(range(1, head + 3))
    assert [event.cursor for event in events] == [JournalCursor(STREAM, seq) for seq in range(1, head + 3)]


@pytest.mark.parametrize("form", ["cursor", "string", "int"])
async def test_resume_from_a_cursor_gives_exactly_the_rest(store: JournalStore, form: str) -> None:
    async with open_journal(store, session_id=SID) as journal:
        for index in range(5):
            await journal.append(accepted(f"r{index}"))
        async with journal.subscribe_durable_events() as sub:
            first = await until_caught_up(sub)
        third = first[2]
        assert isinstance(third, DurableEvent) and third.envelope.seq == 3
        after: Any = {"cursor": third.cursor, "string": str(third.cursor), "int": 3}[form]
        assert JournalCursor.parse(str(third.cursor)) == third.cursor
        async with journal.subscribe_durable_events(after=after) as sub:
            rest = await until_caught_up(sub)
    assert seqs(rest) == [4, 5, 6]
    assert rest[3] == CaughtUp(JournalCursor(STREAM, 6))
    assert [item.envelope for item in rest[:3] if isinstance(item, DurableEvent)] == [
        item.envelope for item in first[3:6] if isinstance(item, DurableEvent)
    ]


async def test_resume_at_the_head_is_caught_up_at_once(store: JournalStore) -> None:
    async with open_journal(store, session_id=SID) as journal:
        await journal.append(accepted("r1"))
        async with journal.subscribe_durable_events(after=JournalCursor(STREAM, 2)) as sub:
            assert await until_caught_up(sub) == [CaughtUp(JournalCursor(STREAM, 2))]


@pytest.mark.parametrize(
    "after",
    [
        JournalCursor(STREAM, 3),  # past the head (2)
        f"{STREAM}@99",
        JournalCursor("other/root", 1),  # another session's stream (it exists)
        "other/root@1",
        JournalCursor(f"{SID}/child", 1),  # another agent's stream of this session
        "garbage",
        "",
        f"{STREAM}@",
        f"{STREAM}@x",
        "@3",
        f"{STREAM}@-1",
        -1,
        JournalCursor(STREAM, -1),
        True,
        2.0,
        None,
        JournalCursor(STREAM, True),
        JournalCursor(STREAM, 1.0),  # type: ignore[arg-type]
        f"{STREAM}@" + "9" * 5000,  # past int()'s digit limit: a bare ValueError before
        f"{STREAM}@" + "1" * 20,  # more digits than any seq has
        f"{STREAM}@\u0661",  # an Arabic-Indic 1: int() reads it, a cursor never holds it
        f"{STREAM}@1\n",
    ],
)
async def test_bad_cursors_raise_cursor_error(store: JournalStore, after: Any) -> None:
    async with open_journal(store, session_id="other") as other:
        await other.append(accepted("x"))
    async with open_journal(store, session_id=SID) as journal:
        await journal.append(accepted("r1"))
        with pytest.raises(CursorError):
            async with journal.subscribe_durable_events(after=after):
                pytest.fail("a bad cursor must be refused")
        with pytest.raises(CursorError):
            async with subscribe_durable_events(store, STREAM, after=after):
                pytest.fail("a bad cursor must be refused")


@pytest.mark.parametrize("page_size", [0, 1.5, "x", True])
async def test_a_bad_page_size_raises_cursor_error(store: JournalStore, page_size: Any) -> None:
    with pytest.raises(CursorError, match="page_size"):
        async with subscribe_durable_events(store, STREAM, page_size=page_size):
            pytest.fail("page_size must be an int >= 1")


async def test_closed_that_is_no_event_is_a_config_error_naming_it(store: JournalStore) -> None:
    from trio_agent import ConfigError

    with pytest.raises(ConfigError, match="closed"):
        async with subscribe_durable_events(store, STREAM, closed="yes"):  # type: ignore[arg-type]
            pytest.fail("closed must be a trio.Event")


@pytest.mark.parametrize("session_id", ["tenant\nA", "a@1", "a@b\n@2\r\n"], ids=repr)
async def test_a_cursor_reads_back_and_resumes_whatever_the_stream_id_holds(
    store: JournalStore, session_id: str
) -> None:
    # An id with a newline is taken by the journal: its cursor must read back (it did not).
    async with open_journal(store, session_id=session_id) as journal:
        await journal.append(accepted("r1"), accepted("r2"))
        async with journal.subscribe_durable_events() as sub:
            items = await until_caught_up(sub)
        second = items[1]
        assert isinstance(second, DurableEvent)
        saved = str(second.cursor)
        assert JournalCursor.parse(saved) == second.cursor == JournalCursor(f"{session_id}/root", 2)
        async with journal.subscribe_durable_events(after=saved) as sub:
            assert seqs(await until_caught_up(sub)) == [3]


@pytest.mark.parametrize("page_size", [2**63 - 1, 2**63, 10**30])
async def test_a_page_size_past_the_stores_integers_means_no_limit(store: JournalStore, page_size: int) -> None:
    # On SQLite, past 2**63 - 1 it was a bare OverflowError at the first item.
    async with open_journal(store, session_id=SID) as journal:
        await journal.append(accepted("r1"), accepted("r2"))
    async with subscribe_durable_events(store, STREAM, page_size=page_size) as sub:
        assert seqs(await until_caught_up(sub)) == [1, 2, 3]


async def test_a_read_bound_past_the_stores_integers_means_the_same(store: JournalStore) -> None:
    async with open_journal(store, session_id=SID) as journal:
        await journal.append(accepted("r1"), command_id="cmd-r1")
    every = await store.read(STREAM)
    assert [envelope.seq for envelope in every] == [1, 2]
    for huge in (2**63, 10**30):
        assert await store.read(STREAM, after=huge) == []
        assert await store.read(STREAM, limit=huge) == every
        assert await store.read(STREAM, after=-huge, limit=huge) == every
        assert await store.commands(STREAM, after=huge) == []
        assert [record.command_id for record in await store.commands(STREAM, after=-huge)] == ["cmd-r1"]


def test_a_cursor_with_a_long_seq_is_refused_with_a_short_message() -> None:
    with pytest.raises(CursorError, match="not a journal cursor") as caught:
        JournalCursor.parse("root@" + "9" * 5000)
    assert len(str(caught.value)) < 400


async def test_iteration_ends_after_a_replayed_session_closed(store: JournalStore) -> None:
    async with open_journal(store, session_id=SID) as journal:
        await journal.append(accepted("r1"))
        await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
    # The journal is gone: only session_closed can end this store-level subscription.
    with trio.fail_after(10):
        async with subscribe_durable_events(store, STREAM) as sub:
            items = [item async for item in sub]
            with pytest.raises(StopAsyncIteration):
                await sub.__anext__()
    assert seqs(items) == [1, 2, 3]
    last = items[-1]
    assert isinstance(last, DurableEvent) and isinstance(last.envelope.event, SessionClosed)


async def test_a_live_subscriber_ends_after_session_closed(store: JournalStore) -> None:
    got: list[Item] = []
    caught_up = trio.Event()
    ended = trio.Event()

    async def subscriber() -> None:
        async with subscribe_durable_events(store, STREAM) as sub:
            async for item in sub:
                got.append(item)
                if isinstance(item, CaughtUp):
                    caught_up.set()
        ended.set()

    async with open_journal(store, session_id=SID) as journal:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(subscriber)
                await caught_up.wait()
                await journal.append(accepted("r1"))
                await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.USER))
            assert ended.is_set()
    assert seqs(got) == [1, 2, 3]
    assert isinstance(got[-1], DurableEvent) and isinstance(got[-1].envelope.event, SessionClosed)


async def test_a_subscriber_ends_when_the_journal_closes_after_delivering_everything(store: JournalStore) -> None:
    got: list[Item] = []
    caught_up = trio.Event()
    ended = trio.Event()

    async def subscriber(journal: Any) -> None:
        async with journal.subscribe_durable_events() as sub:
            async for item in sub:
                got.append(item)
                if isinstance(item, CaughtUp):
                    caught_up.set()
        ended.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async with open_journal(store, session_id=SID) as journal:
                await journal.append(accepted("r1"))
                nursery.start_soon(subscriber, journal)
                await caught_up.wait()
                await journal.append(accepted("r2"))  # appended right before the close: still delivered
            assert journal.closed
    assert ended.is_set()
    assert seqs(got) == [1, 2, 3]
    assert sum(isinstance(item, CaughtUp) for item in got) == 1


class _StaleReads:
    """A store whose reads, while ``hold`` is set, answer with what they read and only return when
    it fires: a read that started before an append and ended after the close."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.clock = inner.clock
        self.hold: trio.Event | None = None
        self.reading = trio.Event()

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[Any]:
        rows = await self.inner.read(stream_id, after=after, limit=limit)
        hold = self.hold
        if hold is not None:
            self.hold = None
            self.reading.set()
            await hold.wait()
        return rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_an_event_committed_while_a_read_ran_is_delivered_before_the_close_ends_the_stream() -> None:
    inner = MemoryStore()
    store = _StaleReads(inner)
    closed = trio.Event()
    async with open_journal(inner, session_id=SID) as journal:
        await journal.append(accepted("r1"))
        async with subscribe_durable_events(store, STREAM, closed=closed) as sub:  # type: ignore[arg-type]
            assert seqs(await until_caught_up(sub)) == [1, 2]
            release = store.hold = trio.Event()
            got: list[Item] = []

            async def read_on() -> None:
                async for item in sub:
                    got.append(item)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_on)
                await store.reading.wait()  # its read saw nothing new ...
                await journal.append(accepted("r2"))  # ... then r2 committed and the session closed
                closed.set()
                release.set()
    assert seqs(got) == [3]


class _LateRead:
    """A store whose one read after ``at`` waits for ``release`` before it reads: the subscriber's
    own page read, answered only after the journal's close handed the subscription the same rows
    (as a read in a worker thread or over the network may be)."""

    def __init__(self, inner: JournalStore) -> None:
        self.inner = inner
        self.clock = inner.clock
        self.at: int | None = None
        self.reading = trio.Event()
        self.release = trio.Event()

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[Any]:
        if after == self.at:
            self.at = None
            self.reading.set()
            await self.release.wait()
        return await self.inner.read(stream_id, after=after, limit=limit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("first_page_ends_with", ["session_closed", "request"])
async def test_a_close_during_the_subscribers_own_read_drops_nothing_and_catches_up_at_the_head(
    store: JournalStore, first_page_ends_with: str
) -> None:
    # The first page (256 events, the journal's page size) ends with life 1's session_closed, or
    # with a plain event; then two more commit. The subscriber's read of the next page is answered
    # only after the close handed it those two: that read's rows were all taken by then. It ended
    # the stream there, dropping both (after a session_closed), or said CaughtUp at 256.
    late = _LateRead(store)
    page = 256
    async with open_journal(late, session_id=SID) as journal:
        head = await store.head(STREAM)
        await journal.append(*(accepted(f"r{index}") for index in range(page - head - 1)))
        if first_page_ends_with == "session_closed":
            await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
        else:
            await journal.append(accepted("last-of-page"))
    assert await store.head(STREAM) == page
    got: list[Item] = []

    async def subscriber(journal: Any, task_status: trio.TaskStatus[None]) -> None:
        async with journal.subscribe_durable_events() as sub:
            task_status.started()
            async for item in sub:
                got.append(item)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async with open_journal(late, session_id=SID) as journal:
                if first_page_ends_with == "session_closed":
                    await journal.append(SessionReopened(session_id=SID, life=2))
                else:
                    await journal.append(accepted("next-1"))
                await journal.append(accepted("next-2"))
                late.at = page  # the subscriber's read of the second page
                await nursery.start(subscriber, journal)
                await late.reading.wait()
            # The journal closed: its close read the rest into the subscription, then said so.
            late.release.set()
    assert await store.head(STREAM) == page + 2
    assert seqs(got) == list(range(1, page + 3))
    assert [item for item in got if isinstance(item, CaughtUp)] == [CaughtUp(JournalCursor(STREAM, page + 2))]
    assert got[-1] == CaughtUp(JournalCursor(STREAM, page + 2))


async def test_a_slow_subscriber_never_stalls_commits(store: JournalStore) -> None:
    count = 500
    async with (
        open_journal(store, session_id=SID) as journal,
        journal.subscribe_durable_events() as idle,
        journal.subscribe_durable_events() as reader,
    ):
        first = await reader.__anext__()  # one subscriber read one event and stopped; the other never read
        assert isinstance(first, DurableEvent) and first.envelope.seq == 1
        with trio.fail_after(20):
            for index in range(count):
                result = await journal.append(accepted(f"r{index}"))
                assert result.first_seq == index + 2
        assert await store.head(STREAM) == count + 1
        rest = await until_caught_up(reader)
        everything = await until_caught_up(idle)
    assert seqs(rest) == list(range(2, count + 2))
    assert rest[-1] == CaughtUp(JournalCursor(STREAM, count + 1))
    assert seqs(everything) == list(range(1, count + 2))
    assert sum(isinstance(item, CaughtUp) for item in everything) == 1


async def test_a_hung_write_is_never_delivered(store: JournalStore) -> None:
    faulty = FaultyStore(store)
    got: list[Item] = []
    caught_up = trio.Event()
    async with open_journal(faulty, session_id=SID, commit_grace=0.05) as journal:
        await journal.append(accepted("r1"))

        async def subscriber() -> None:
            async with journal.subscribe_durable_events() as sub:
                async for item in sub:
                    got.append(item)
                    if isinstance(item, CaughtUp):
                        caught_up.set()
                    elif item.envelope.seq == 3:
                        return

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(subscriber)
                await caught_up.wait()
                faulty.fail_next("hang")
                with trio.move_on_after(0.05) as scope:  # the caller's own deadline
                    await journal.append(accepted("hung"))
                assert scope.cancelled_caught and journal.fenced
                await journal.reconcile()
                await journal.append(accepted("after"))  # takes seq 3, which the hung write never got
    events = [item.envelope.event for item in got if isinstance(item, DurableEvent)]
    assert seqs(got) == [1, 2, 3]
    assert events[-1] == accepted("after")
    assert accepted("hung") not in events


class GatedStore:
    """A memory store whose appends, while ``hold`` is set, commit only when it fires."""

    def __init__(self, inner: MemoryStore, nursery: trio.Nursery) -> None:
        self.inner = inner
        self.clock = inner.clock
        self._nursery = nursery
        self.hold: trio.Event | None = None

    def submit(self, batch: AppendBatch) -> AppendTicket:
        gate = self.hold
        if gate is None:
            return self.inner.submit(batch)
        ticket = AppendTicket(batch)

        async def land() -> None:
            await gate.wait()
            ticket._resolve(self.inner.submit(batch).outcome())

        self._nursery.start_soon(land)
        return ticket

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_an_event_is_delivered_only_once_committed() -> None:
    got: list[Item] = []
    caught_up = trio.Event()
    inner = MemoryStore()
    with trio.fail_after(10):
        async with trio.open_nursery() as outer:
            store = GatedStore(inner, outer)
            async with open_journal(store, session_id=SID) as journal:

                async def subscriber() -> None:
                    async with journal.subscribe_durable_events() as sub:
                        async for item in sub:
                            got.append(item)
                            if isinstance(item, CaughtUp):
                                caught_up.set()
                            elif item.envelope.seq == 2:
                                return

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(subscriber)
                    await caught_up.wait()
                    gate = trio.Event()
                    store.hold = gate
                    async with trio.open_nursery() as writers:
                        writers.start_soon(journal.append, accepted("slow"))
                        await trio.testing.wait_all_tasks_blocked()
                        # Applied to the journal's projection, submitted, not committed: not delivered.
                        assert journal.projection().request("slow") is not None
                        assert await inner.head(STREAM) == 1
                        assert seqs(got) == [1]
                        store.hold = None
                        gate.set()
    assert seqs(got) == [1, 2]
    assert isinstance(got[-1], DurableEvent) and got[-1].envelope.event == accepted("slow")


async def test_resuming_after_session_closed_ends(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    async with open_journal(store, session_id=SID) as journal:
        await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
    with trio.fail_after(60):  # mock time: fails at once instead of hanging
        async with subscribe_durable_events(store, STREAM, after=JournalCursor(STREAM, 2)) as sub:
            items = [item async for item in sub]
    assert items == [CaughtUp(JournalCursor(STREAM, 2))]


async def _two_lives(store: JournalStore) -> int:
    """Life 1 (created, r1, closed: seqs 1-3), then life 2 opened (reopened, r2: seqs 4-5) and
    left open by not closing its stream; returns the seq of life 1's ``session_closed``."""
    async with open_journal(store, session_id=SID) as journal:
        await journal.append(accepted("r1"))
        await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
    return 3


@pytest.mark.parametrize("page_size", [1, 2, 256])  # the close last on a page, mid-page, all in one page
@pytest.mark.parametrize("start", ["beginning", "at the first close"])
async def test_a_subscription_goes_on_past_the_session_closed_of_an_earlier_life(
    store: JournalStore, page_size: int, start: str
) -> None:
    first_close = await _two_lives(store)
    after = 0 if start == "beginning" else JournalCursor(STREAM, first_close)
    got: list[Item] = []
    caught_up = trio.Event()
    ended = trio.Event()

    async def subscriber() -> None:
        async with subscribe_durable_events(store, STREAM, after=after, page_size=page_size) as sub:
            async for item in sub:
                got.append(item)
                if isinstance(item, CaughtUp):
                    caught_up.set()
        ended.set()

    async with open_journal(store, session_id=SID) as journal:
        await journal.append(SessionReopened(session_id=SID, life=2))
        await journal.append(accepted("r2"))
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(subscriber)
                await caught_up.wait()  # at life 2's head: the replay went on past life 1's close
                await trio.testing.wait_all_tasks_blocked()
                assert not ended.is_set()  # waiting for live events, the stream is open again
                await journal.append(accepted("live"))  # life 2's live event
                await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
    assert ended.is_set()
    first = 1 if start == "beginning" else first_close + 1
    assert seqs(got) == list(range(first, 8))
    markers = [index for index, item in enumerate(got) if isinstance(item, CaughtUp)]
    assert markers == [5 - first + 1] and got[markers[0]] == CaughtUp(JournalCursor(STREAM, 5))
    last = got[-1]
    assert isinstance(last, DurableEvent) and isinstance(last.envelope.event, SessionClosed)


async def test_a_subscription_that_ended_at_the_last_close_resumes_into_the_next_life(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The close was the stream's last event when the subscriber read past it, so it ended there;
    # a reopen after that is followed by subscribing again from its cursor.
    store = MemoryStore(clock=trio.current_time)
    await _two_lives(store)
    with trio.fail_after(60):  # mock time: fails at once instead of hanging
        async with subscribe_durable_events(store, STREAM) as sub:
            items = [item async for item in sub]
    assert seqs(items) == [1, 2, 3]
    last = items[-1]
    assert isinstance(last, DurableEvent)
    async with open_journal(store, session_id=SID) as journal:
        await journal.append(SessionReopened(session_id=SID, life=2))
        with trio.fail_after(60):
            async with subscribe_durable_events(store, STREAM, after=str(last.cursor)) as sub:
                assert seqs(await until_caught_up(sub)) == [4]


class ClosingStore:
    """A memory store that can be closed under its subscribers (as a session closes the store it
    owned): reads then fail. While ``hang`` is set, reads never answer (a close cut short)."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.clock = inner.clock
        self.closed = False
        self.hang = False

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[Any]:
        if self.hang:
            await trio.sleep_forever()
        if self.closed:
            raise JournalError("the store is closed")
        return await self.inner.read(stream_id, after=after, limit=limit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def drain(sub: DurableEventStream) -> list[int]:
    delivered: list[int] = []
    async for item in sub:
        if isinstance(item, DurableEvent):
            delivered.append(item.envelope.seq)
    return delivered


async def test_a_subscriber_handed_the_rest_ends_cleanly_after_its_store_closed() -> None:
    store = ClosingStore(MemoryStore())
    async with contextlib.AsyncExitStack() as stack:
        async with open_journal(store, session_id=SID) as journal:  # type: ignore[arg-type]
            sub = await stack.enter_async_context(journal.subscribe_durable_events())
            await journal.append(accepted("r1"), accepted("r2"))
        store.closed = True
        with trio.fail_after(10):
            assert await drain(sub) == [1, 2, 3]


@pytest.mark.parametrize("store_closed", [False, True])
@pytest.mark.parametrize("last", ["request", "session_closed"])
async def test_a_subscriber_handed_the_rest_gets_the_same_items_whether_or_not_its_store_closed(
    store_closed: bool, last: str
) -> None:
    # Replay, then one CaughtUp: the end of a handed-over stream said CaughtUp only if the store
    # was still open (its read found nothing); closed, the failed read ended it without one.
    store = ClosingStore(MemoryStore())
    async with contextlib.AsyncExitStack() as stack:
        async with open_journal(store, session_id=SID) as journal:  # type: ignore[arg-type]
            sub = await stack.enter_async_context(journal.subscribe_durable_events())
            await journal.append(accepted("r1"), accepted("r2"))
            if last == "session_closed":
                await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
        store.closed = store_closed
        with trio.fail_after(10):
            items = [item async for item in sub]
    if last == "request":  # the head, then the end
        assert seqs(items) == [1, 2, 3] and items[3:] == [CaughtUp(JournalCursor(STREAM, 3))]
    else:  # the session's close is its last item, as on any stream that ends at one
        assert seqs(items) == [1, 2, 3, 4] and len(items) == 4


async def test_a_close_cut_short_before_a_subscription_had_the_rest_is_no_clean_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = ClosingStore(MemoryStore())
    async with contextlib.AsyncExitStack() as stack:
        async with open_journal(store, session_id=SID, commit_grace=1.0) as journal:  # type: ignore[arg-type]
            sub = await stack.enter_async_context(journal.subscribe_durable_events())
            await journal.append(accepted("r1"), accepted("r2"))
            store.hang = True  # the close's handover never answers: its bound cuts it short
        store.hang, store.closed = False, True
        with trio.fail_after(10), pytest.raises(JournalError, match="before the end of its stream was delivered"):
            await drain(sub)
        assert sub.cursor == JournalCursor(STREAM, 0)  # where to resume on an open store


class _CountedReads(ClosingStore):
    """A `ClosingStore` that counts the events its reads return; reads from below ``hang_below``
    never answer (a backlog the close cannot read within its bound)."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.rows_read = 0
        self.hang_below = 0

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[Any]:
        if after < self.hang_below:
            await trio.sleep_forever()
        rows = await super().read(stream_id, after=after, limit=limit)
        self.rows_read += len(rows)
        return rows


class _InOrder(dict[Any, None]):
    """The live subscriptions of a close, iterated in the order they are given (a set's order is
    its hashes'): a test then decides which one the close meets first."""

    def add(self, stream: Any) -> None:
        self[stream] = None

    def discard(self, stream: Any) -> None:
        self.pop(stream, None)


def _in_order(journal: Any, streams: list[DurableEventStream]) -> None:
    assert set(journal._subscriptions._live) == set(streams)
    journal._subscriptions._live = _InOrder.fromkeys(streams)


@pytest.mark.parametrize("idle_first", [True, False])
@pytest.mark.parametrize("idle_on", ["the same stream", "another stream"])
async def test_a_subscription_far_behind_never_starves_a_caught_up_one_of_the_close(
    autojump_clock: trio.testing.MockClock, idle_first: bool, idle_on: str
) -> None:
    # The close handed over one subscription at a time in the set's order, all within one
    # commit_grace: met first, an idle one's backlog used the whole bound, the caught-up one was
    # handed nothing and, its store closed, raised JournalError instead of ending with its event.
    store = _CountedReads(MemoryStore())
    async with contextlib.AsyncExitStack() as stack:
        async with open_journal(store, session_id=SID, commit_grace=1.0) as journal:  # type: ignore[arg-type]
            idle_agent = None if idle_on == "the same stream" else "idle"
            backlog: list[Any] = [accepted(f"r{index}") for index in range(600)]
            if idle_agent is not None:  # a subagent's stream, which starts with its creation
                backlog.insert(0, SessionCreated(session_id=SID, agent_id=idle_agent, parent_agent_id="root"))
            await journal.append(*backlog, agent_id=idle_agent)
            idle = await stack.enter_async_context(journal.subscribe_durable_events(agent_id=idle_agent))
            live = await stack.enter_async_context(journal.subscribe_durable_events())
            head = seqs(await until_caught_up(live))[-1]
            await journal.append(accepted("last"))
            _in_order(journal, [idle, live] if idle_first else [live, idle])
            store.hang_below = 1  # the idle one's backlog never comes: only the bound ends its read
        store.hang_below, store.closed = 0, True  # closed with the session: reads fail
        with trio.fail_after(10):
            rest = [item async for item in live]
        assert seqs(rest) == [head + 1] and len(rest) == 1  # its last event, and the end
        with trio.fail_after(10), pytest.raises(JournalError, match="before the end of its stream was delivered"):
            await drain(idle)


async def test_the_close_reads_a_stream_once_for_all_its_subscriptions() -> None:
    # Each subscription read its whole rest itself: the rows two of them lacked were read twice.
    store = _CountedReads(MemoryStore())
    async with contextlib.AsyncExitStack() as stack:
        async with open_journal(store, session_id=SID) as journal:  # type: ignore[arg-type]
            await journal.append(*(accepted(f"r{index}") for index in range(600)))
            subs = [await stack.enter_async_context(journal.subscribe_durable_events()) for _ in range(4)]
            for sub, read in zip(subs[1:], (300, 301, 601), strict=True):
                while sub.cursor.seq < read:
                    await sub.__anext__()
            assert [sub._read_to for sub in subs] == [0, 512, 512, 601]  # what each read, in pages
            await journal.append(accepted("last"))
            store.rows_read = 0
        assert store.rows_read == 602  # every event once: 602, then 513-602 for two, 1-512 for one
        store.closed = True
        with trio.fail_after(10):
            rests = [[item async for item in sub] for sub in subs]
    assert [seqs(rest) for rest in rests] == [list(range(first, 603)) for first in (1, 301, 302, 602)]
    assert [rest[-1] for rest in rests] == [CaughtUp(JournalCursor(STREAM, 602))] * 4


async def test_a_subscriber_of_a_journal_that_lost_its_lease_is_not_told_it_has_everything() -> None:
    store = ClosingStore(MemoryStore())
    async with contextlib.AsyncExitStack() as stack:
        with pytest.raises(LeaseLostError):
            async with open_journal(store, session_id=SID) as journal:  # type: ignore[arg-type]
                sub = await stack.enter_async_context(journal.subscribe_durable_events())
                await journal.append(accepted("r1"))
                journal._lose(LeaseLostError("taken over"))  # its close hands nothing over
        store.closed = True
        with trio.fail_after(10), pytest.raises(JournalError, match="before the end of its stream was delivered"):
            await drain(sub)


async def test_damage_met_by_the_close_is_raised_never_taken_for_the_end(store: JournalStore, tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        async with open_journal(store, session_id=SID) as journal:
            sub = await stack.enter_async_context(journal.subscribe_durable_events())
            await journal.append(*(accepted(f"r{index}") for index in range(4)))
            if isinstance(store, MemoryStore):
                store._streams[STREAM].rows[2] = store._streams[STREAM].rows[3]  # a row out of place
            else:
                with contextlib.closing(sqlite3.connect(tmp_path / "j.db")) as conn:
                    conn.execute("UPDATE journal_events SET body = replace(body, 'r1', 'R1') WHERE seq = 3")
                    conn.commit()
        delivered: list[int] = []
        with trio.fail_after(10), pytest.raises(JournalCorruptError, match=f"{STREAM}#3"):
            async for item in sub:
                if isinstance(item, DurableEvent):
                    delivered.append(item.envelope.seq)
        assert delivered == [1, 2]


@pytest.mark.parametrize("agent_id", ["", "../x", "a/b", "x\x00"], ids=repr)
async def test_a_subscription_to_an_agent_id_no_stream_can_have_is_refused(agent_id: str) -> None:
    # "../x" was a subscription to a stream no agent can ever have: it waited for ever; "" was
    # taken for the root's.
    from trio_agent import ConfigError

    async with open_journal(MemoryStore(), session_id=SID) as journal:
        with pytest.raises(ConfigError, match="agent_id"):
            journal.subscribe_durable_events(agent_id=agent_id)
