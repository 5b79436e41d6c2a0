"""The durable journal: leases, store-side fencing, commands, the projection guard,
unknown write outcomes, the tool journal wired through a real `ToolPipeline`,
recovery after a crash, and corrupt stored data.

Lease tests run on Trio's mock clock (``autojump_clock``) with
``MemoryStore(clock=trio.current_time)`` only; SQLite tests use the real clock.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from session_helpers import all_tasks

from trio_agent import ConfigError, SideEffect, ToolResult, define_tool
from trio_agent._tools._definition import InterruptBehavior, Tool, ToolKind
from trio_agent.journal import (
    AppendBatch,
    AppendResult,
    AppendTicket,
    CommandConflictError,
    Event,
    EventEnvelope,
    InvalidTransitionError,
    JournalCorruptError,
    JournalError,
    JournalFencedError,
    JournalStore,
    JournalUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    MemoryStore,
    ModelAbortReason,
    ModelAttemptAborted,
    ModelAttemptStarted,
    OutcomeUnknownReason,
    PermissionDecision,
    PermissionRequested,
    PermissionResolved,
    RecoveryDecision,
    RequestAccepted,
    SessionCreated,
    StaleFencingTokenError,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolRecoveryAction,
    ToolScheduled,
    ToolStarted,
    ToolState,
    TurnStarted,
    open_journal,
    open_sqlite_store,
    result_from_json,
    result_to_json,
)
from trio_agent.testing import FaultyStore, start_turn
from trio_agent.tools import CallOrigin, SettlementError, ToolCall, ToolPipeline

SID = "sess"
REQ: dict[str, Any] = {"request_id": "request", "turn_id": "turn"}  # what start_turn opens by default

# ---------------------------------------------------------------- helpers


def accepted(request_id: str, prompt: str = "hi") -> RequestAccepted:
    return RequestAccepted(request_id=request_id, command_id=f"cmd-{request_id}", input={"prompt": prompt})


def scheduled(
    call_id: str,
    tool: str = "upsert",
    side_effect: SideEffect = SideEffect.IDEMPOTENT,
    *,
    key: str | None = None,
    model_input: dict[str, Any] | None = None,
) -> ToolScheduled:
    return ToolScheduled(
        **REQ,
        call_id=call_id,
        tool_name=tool,
        model_input=model_input if model_input is not None else {"n": 1},
        side_effect=side_effect,
        kind=ToolKind.EXECUTE,
        interrupt=InterruptBehavior.BLOCK,
        concurrency_safe=False,
        idempotency_key=key or f"key-{call_id}",
    )


def started(call_id: str, side_effect: SideEffect, input: dict[str, Any] | None = None) -> ToolStarted:
    return ToolStarted(**REQ, call_id=call_id, input=input if input is not None else {"n": 1}, side_effect=side_effect)


def completed(call_id: str, result: ToolResult) -> ToolCompleted:
    return ToolCompleted(**REQ, call_id=call_id, result=result_to_json(result))


async def events_of(store: JournalStore, stream_id: str) -> list[Event]:
    return [envelope.event for envelope in await store.read(stream_id)]


def for_call(events: list[Event], call_id: str) -> list[Event]:
    return [event for event in events if getattr(event, "call_id", None) == call_id]


SETTLEMENTS = (ToolCompleted, ToolFailed, ToolCancelled, ToolOutcomeUnknown)


@asynccontextmanager
async def make_store(kind: str, tmp_path: Path) -> AsyncIterator[JournalStore]:
    if kind == "memory":
        yield MemoryStore()
    else:
        async with open_sqlite_store(tmp_path / "j.db") as store:
            yield store


class GatedStore:
    """Passes everything through, except that while ``hold`` is set, submitted appends
    wait for that event before they reach the inner store (a slow commit)."""

    def __init__(self, inner: JournalStore, nursery: trio.Nursery) -> None:
        self.inner = inner
        self.clock = inner.clock
        self._nursery = nursery
        self.hold: trio.Event | None = None
        self.refuse: JournalError | None = None  # while set, a held append is refused with it once let go
        self.held: list[AppendBatch] = []
        self._last: AppendTicket | None = None

    def submit(self, batch: AppendBatch) -> AppendTicket:
        # Like every store, commits in submission order: later appends queue behind a held one.
        gate = self.hold
        behind = self._last if self._last is not None and not self._last.done else None
        if gate is None and behind is None:
            return self.inner.submit(batch)
        ticket = AppendTicket(batch)
        self.held.append(batch)
        self._last = ticket

        async def land() -> None:
            if gate is not None:
                await gate.wait()
            if behind is not None:
                await behind._done.wait()
            outcome: object
            try:
                if self.refuse is not None:
                    raise self.refuse
                outcome = await self.inner.submit(batch).wait()
            except Exception as exc:
                outcome = exc
            ticket._resolve(outcome)

        self._nursery.start_soon(land)
        return ticket

    async def append(self, batch: AppendBatch) -> Any:
        return await self.submit(batch).wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ---------------------------------------------------------------- 1. leases


async def test_open_takes_token_one_and_a_second_owner_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    async with open_journal(store, session_id=SID, owner="a", lease_ttl=10) as journal:
        assert journal.lease.token == 1
        assert journal.fencing_token() == 1
        held = await store.current_lease(SID)
        assert held is not None and (held.owner, held.token) == ("a", 1)
        start = trio.current_time()
        with pytest.raises(LeaseHeldError) as info:
            async with open_journal(store, session_id=SID, owner="b", lease_ttl=10):
                pytest.fail("a second owner must not get a held lease")
        assert info.value.owner == "a"
        assert trio.current_time() == start  # takeover_timeout=0: refused at once
        still = await store.current_lease(SID)
        assert still is not None and (still.owner, still.token) == ("a", 1)
        await journal.append(accepted("r1"))  # the holder is unaffected


async def test_takeover_waits_for_a_dead_owners_expiry_and_gets_a_higher_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(clock=trio.current_time)
    dead = await store.acquire_lease(SID, "dead", 3)  # acquired, then the owner "crashed"
    start = trio.current_time()
    async with open_journal(store, session_id=SID, owner="b", lease_ttl=10, takeover_timeout=15) as journal:
        assert trio.current_time() >= dead.expires_at
        assert trio.current_time() - start < 4
        assert journal.lease.token == dead.token + 1
        assert journal.lease.owner == "b"
        await trio.sleep(50)  # and it keeps the lease it took over
        await journal.append(accepted("r1"))
        assert not journal.lost


async def test_takeover_after_a_full_ttl_wait_opens(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    dead = await store.acquire_lease(SID, "dead", 10)
    async with open_journal(store, session_id=SID, owner="b", lease_ttl=10, takeover_timeout=15) as journal:
        assert trio.current_time() >= dead.expires_at
        assert journal.lease.token == dead.token + 1
        await journal.append(accepted("r1"))


async def test_takeover_timeout_shorter_than_the_expiry_fails_without_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(clock=trio.current_time)
    await store.acquire_lease(SID, "dead", 10)
    start = trio.current_time()
    with pytest.raises(LeaseHeldError):
        async with open_journal(store, session_id=SID, owner="b", lease_ttl=10, takeover_timeout=5):
            pytest.fail("the lease expires after the takeover timeout")
    assert trio.current_time() == start


async def test_a_live_owner_is_never_taken_over(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    async with open_journal(store, session_id=SID, owner="a", lease_ttl=10) as journal:
        start = trio.current_time()
        with pytest.raises(LeaseHeldError):
            async with open_journal(store, session_id=SID, owner="b", lease_ttl=10, takeover_timeout=35):
                pytest.fail("the heartbeat keeps a's lease alive")
        waited = trio.current_time() - start
        assert 10 <= waited <= 35  # it did wait for expiries that the heartbeat kept pushing back
        assert not journal.lost
        assert journal.lease.token == 1
        await journal.append(accepted("r1"))


async def test_heartbeat_keeps_the_lease_across_many_ttls(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    async with open_journal(store, session_id=SID, owner="a", lease_ttl=10) as journal:
        start = trio.current_time()
        await trio.sleep(200)  # twenty TTLs of mock time
        assert trio.current_time() - start >= 200
        journal.check_ownership()
        assert not journal.lost
        lease = await store.current_lease(SID)
        assert lease is not None and lease.token == 1 and lease.expires_at > trio.current_time()
        result = await journal.append(accepted("r1"))
        assert result.first_seq == 2


async def _revoke_by_release(store: MemoryStore, journal: Any) -> None:
    await store.release_lease(journal.lease)
    await store.acquire_lease(SID, "b", 10)


async def _revoke_by_expiry_and_takeover(store: MemoryStore, journal: Any) -> None:
    # The store's lease expires (as if renewals stopped reaching it), then b takes over.
    store._leases[SID] = attrs.evolve(store._leases[SID], expires_at=trio.current_time() - 1)
    await store.acquire_lease(SID, "b", 10)


async def _expire_only(store: MemoryStore, journal: Any) -> None:
    store._leases[SID] = attrs.evolve(store._leases[SID], expires_at=trio.current_time() - 1)


@pytest.mark.parametrize("revoke", [_revoke_by_release, _revoke_by_expiry_and_takeover, _expire_only])
async def test_a_refused_renewal_cancels_the_body_and_the_block_raises_lease_lost(
    autojump_clock: trio.testing.MockClock, revoke: Callable[..., Any]
) -> None:
    store = MemoryStore(clock=trio.current_time)
    after_sleep = False
    journal: Any = None
    with pytest.raises(LeaseLostError):
        async with open_journal(store, session_id=SID, owner="a", lease_ttl=9, heartbeat_interval=3) as opened:
            journal = opened
            head = journal.projection().head
            revoked_at = trio.current_time()
            await revoke(store, journal)
            await trio.sleep_forever()
            after_sleep = True
    assert not after_sleep
    assert trio.current_time() - revoked_at <= 3 + 1e-9  # the next heartbeat noticed
    assert journal.lost and journal.closed
    with pytest.raises(LeaseLostError):
        journal.check_ownership()
    with pytest.raises(LeaseLostError):
        await journal.append(accepted("late"))
    assert await store.head(journal.stream_id()) == head
    lease = await store.current_lease(SID)
    assert lease is not None
    if revoke is not _expire_only:
        assert lease.owner == "b"  # the lost owner did not release b's lease


async def test_release_on_exit_lets_another_owner_in_at_once(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    async with open_journal(store, session_id=SID, owner="a", lease_ttl=30) as first:
        await first.append(accepted("r1"))
    exited = trio.current_time()
    assert first.closed and not first.lost
    with pytest.raises(JournalError):
        await first.append(accepted("r2"))  # closed
    async with open_journal(store, session_id=SID, owner="b", lease_ttl=30) as second:
        assert trio.current_time() == exited
        assert second.lease.token == 2
        assert second.projection().request("r1") is not None  # loaded from the store
        await second.append(accepted("r2"))


async def test_a_heartbeat_just_within_the_local_validity_keeps_the_lease(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The bound is the local validity (90% of the TTL), not stricter: an interval below it renews in time.
    store = MemoryStore(clock=trio.current_time)
    async with open_journal(store, session_id=SID, lease_ttl=10, heartbeat_interval=8.9) as journal:
        await trio.sleep(100)
        journal.check_ownership()


@pytest.mark.parametrize(
    "options",
    [
        {"lease_ttl": 0},
        {"lease_ttl": -1},
        {"lease_ttl": math.nan},
        {"lease_ttl": math.inf},
        {"lease_ttl": True},
        {"lease_ttl": "30"},
        {"lease_ttl": 10**400},  # too large for a float: OverflowError before
        {"lease_ttl": -(10**4000)},  # close to the 4,300 digits a repr may have
        {"lease_ttl": 10, "heartbeat_interval": 10},
        {"lease_ttl": 10, "heartbeat_interval": 11},
        {"lease_ttl": 10, "heartbeat_interval": 0},
        # Past 90% of the TTL a renewal always comes after the lease ran out locally.
        {"lease_ttl": 1.0, "heartbeat_interval": 0.95},
        {"lease_ttl": 10, "heartbeat_interval": 9},
        {"takeover_timeout": -1},
        {"commit_grace": 0},
        {"session_id": "a/b"},
        {"session_id": 5},
        {"session_id": "a\x00"},
        {"root_agent_id": ""},
        {"root_agent_id": 5},
        {"root_agent_id": "a\x00"},
        {"root_agent_id": "x" * 2000},
    ],
)
async def test_bad_options_raise_config_error_before_taking_the_lease(options: dict[str, Any]) -> None:
    store = MemoryStore()
    kwargs: dict[str, Any] = {"session_id": SID, **options}
    with pytest.raises(ConfigError):
        async with open_journal(store, **kwargs):
            pytest.fail("must not open")
    assert await store.current_lease(kwargs["session_id"]) is None
    assert await store.streams() == []


@pytest.mark.parametrize("agent_id", [5, b"a", ["a"]])
async def test_an_agent_id_that_is_no_string_fails_the_append_alone(agent_id: Any) -> None:
    """Never a stream named after its repr (5 came back as "5" after a reopen)."""
    store = MemoryStore()
    async with open_journal(store, session_id=SID) as journal:
        created = SessionCreated(session_id=SID, agent_id="a", parent_agent_id="root")
        with pytest.raises(ConfigError, match="agent_id must be a string"):
            await journal.append(created, agent_id=agent_id)
        with pytest.raises(ConfigError, match="agent_id must be a string"):
            await journal.append(created, agent_id=agent_id, command_id="cmd-a")
        assert journal.agents == ["root"] and not journal.fenced
        await journal.append(created, agent_id="a")
    assert sorted(info.stream_id for info in await store.streams(SID)) == [f"{SID}/a", f"{SID}/root"]


async def test_an_exception_from_the_body_is_not_wrapped() -> None:
    async with open_journal(MemoryStore(), session_id=SID):
        pass
    with pytest.raises(KeyError):
        async with open_journal(MemoryStore(), session_id=SID):
            raise KeyError("plain")


async def test_lease_lost_raised_in_the_body_leaves_the_block_as_lease_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(clock=trio.current_time)
    with pytest.raises(LeaseLostError):
        async with open_journal(store, session_id=SID, owner="a", lease_ttl=10) as journal:
            await _revoke_by_release(store, journal)
            await journal.append(accepted("r1"))  # refused by the store: StaleFencingTokenError


# ---------------------------------------------------------------- 2. fencing at the store


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_the_store_refuses_a_stale_owner_even_when_its_local_check_passes(kind: str, tmp_path: Path) -> None:
    async with make_store(kind, tmp_path) as store:
        refused: BaseException | None = None
        old: Any = None
        with pytest.raises(LeaseLostError):
            async with open_journal(store, session_id=SID, owner="old", lease_ttl=30) as opened:
                old = opened
                await old.append(accepted("r1"))
                stream = old.stream_id()
                head = await store.head(stream)
                await store.release_lease(old.lease)
                taken = await store.acquire_lease(SID, "new", 30)
                assert taken.token > old.lease.token
                old._valid_until = math.inf  # the local check passes: only the store can refuse
                old.check_ownership()
                with pytest.raises(StaleFencingTokenError) as info:
                    await old.append(accepted("r2"))
                refused = info.value
        assert isinstance(refused, LeaseLostError)
        assert await store.head(stream) == head
        assert [e.event for e in await store.read(stream)][-1] == accepted("r1")
        assert old.lost and old.fenced
        lease = await store.current_lease(SID)
        assert lease is not None and lease.owner == "new"


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize("ttl", [10**400, -(10**5000), math.nan, 0], ids=["huge", "unprintable", "nan", "zero"])
async def test_a_store_refuses_a_lease_ttl_no_float_can_hold_with_a_journal_error(
    kind: str, ttl: float, tmp_path: Path
) -> None:
    # An int too large for a float raised OverflowError (isfinite, float) and one too long to
    # print ValueError (the message's repr), instead of the store's JournalError.
    async with make_store(kind, tmp_path) as store:
        with pytest.raises(JournalError, match="lease ttl"):
            await store.acquire_lease(SID, "owner", ttl)
        assert await store.current_lease(SID) is None


# ---------------------------------------------------------------- 3. commands


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_commands_replay_identically_and_conflict_on_other_content(kind: str, tmp_path: Path) -> None:
    event = accepted("r1", prompt="hello")
    other = accepted("r1", prompt="something else")
    async with make_store(kind, tmp_path) as store:
        async with open_journal(store, session_id=SID) as journal:
            stream = journal.stream_id()
            first = await journal.append(event, command_id="cmd-1")
            assert not first.replayed
            head = await store.head(stream)
            again = await journal.append(event, command_id="cmd-1")
            assert again.replayed
            assert (again.first_seq, again.last_seq) == (first.first_seq, first.last_seq)
            with pytest.raises(CommandConflictError) as info:
                await journal.append(other, command_id="cmd-1")
            assert info.value.command_id == "cmd-1"
            assert await store.head(stream) == head
            assert journal.projection().head == head
            assert not journal.fenced
        # Reopened: the commands are loaded from the store.
        async with open_journal(store, session_id=SID) as journal:
            replay = await journal.append(event, command_id="cmd-1")
            assert replay.replayed
            assert (replay.first_seq, replay.last_seq) == (first.first_seq, first.last_seq)
            with pytest.raises(CommandConflictError):
                await journal.append(other, command_id="cmd-1")
            assert await store.head(stream) == head
            assert [e.event for e in await store.read(stream)].count(event) == 1


@pytest.mark.parametrize("refused", [False, True])
async def test_a_retry_of_a_command_in_flight_is_answered_only_as_its_first_write_ends(refused: bool) -> None:
    """A client retry that comes while the command's first write is in flight waits for that
    write: told "replayed" only once it committed; a refusal reaches the retry too."""
    inner = MemoryStore()
    outcomes: dict[str, AppendResult | JournalError] = {}
    async with trio.open_nursery() as nursery:
        store = GatedStore(inner, nursery)
        async with open_journal(store, session_id=SID) as journal:
            await journal.flush()

            async def write(name: str) -> None:
                try:
                    outcomes[name] = await journal.append(accepted("r1"), command_id="cmd-1")
                except JournalError as exc:
                    outcomes[name] = exc

            gate = store.hold = trio.Event()
            nursery.start_soon(write, "first")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(write, "retry")
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == {}  # the first write is in flight: the retry is not answered yet
            store.hold = None
            store.refuse = JournalUnavailableError("the disk said no") if refused else None
            gate.set()
            await trio.testing.wait_all_tasks_blocked()
            first, retry = outcomes["first"], outcomes["retry"]
            if refused:
                assert isinstance(first, JournalUnavailableError) and retry is first
                assert journal.fenced
                await journal.reconcile()
                assert journal.projection().request("r1") is None
                assert not (await journal.append(accepted("r1"), command_id="cmd-1")).replayed
            else:
                assert isinstance(first, AppendResult) and isinstance(retry, AppendResult)
                assert not first.replayed and retry.replayed
                assert (retry.first_seq, retry.last_seq) == (first.first_seq, first.last_seq)
                assert not journal.fenced
            assert [e.event for e in await inner.read(journal.stream_id())].count(accepted("r1")) == 1


async def test_a_retry_of_a_command_whose_first_write_never_concluded_is_fenced(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first write hangs and its caller gives up (its confirmation is bounded): the retry
    waiting for it is told the journal is fenced, never that the command applied."""
    faulty = FaultyStore(MemoryStore(clock=trio.current_time))
    async with open_journal(faulty, session_id=SID, commit_grace=0.5) as journal:
        await journal.flush()
        faulty.fail_next("hang")
        retried: list[AppendResult | JournalError] = []

        async def retry() -> None:
            try:
                retried.append(await journal.append(accepted("r1"), command_id="cmd-1"))
            except JournalError as exc:
                retried.append(exc)

        async with trio.open_nursery() as nursery:
            with trio.move_on_after(1):
                nursery.start_soon(retry)  # runs once the first is in flight
                await journal.append(accepted("r1"), command_id="cmd-1")
        assert len(retried) == 1 and isinstance(retried[0], JournalFencedError)
        await journal.reconcile()
        assert journal.projection().request("r1") is None
        assert not (await journal.append(accepted("r1"), command_id="cmd-1")).replayed


# ---------------------------------------------------------------- 4. projection guard


async def test_an_invalid_transition_writes_nothing() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id=SID) as journal:
        stream = journal.stream_id()
        head = await store.head(stream)
        commits = store.commits
        snapshot = journal.projection().snapshot()
        with pytest.raises(InvalidTransitionError):
            await journal.append(started("ghost", SideEffect.PURE))
        with pytest.raises(InvalidTransitionError):
            await journal.append(TurnStarted(request_id="r1", turn_id="t1", turn=1))
        # The first event is valid, the second is not (r1 was accepted, never started): neither lands.
        with pytest.raises(InvalidTransitionError):
            await journal.append(accepted("r1"), TurnStarted(request_id="r1", turn_id="t1", turn=1))
        assert await store.head(stream) == head
        assert store.commits == commits
        assert journal.projection().snapshot() == snapshot
        assert journal.projection().request("r1") is None
        assert not journal.fenced
        result = await journal.append(accepted("r1"))
        assert result.first_seq == head + 1


async def test_an_agent_stream_must_start_with_session_created() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id=SID) as journal:
        with pytest.raises(JournalError):
            await journal.append(accepted("r1"), agent_id="child")
        assert await store.streams(SID) == [await store.stream_info(journal.stream_id())]
        await journal.open_agent("child", parent_agent_id=journal.root_agent_id)
        await journal.append(accepted("r1"), agent_id="child")
        assert await store.head(journal.stream_id("child")) == 2


# ---------------------------------------------------------------- 4b. deferred events


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_deferred_events_apply_now_and_ride_with_the_next_append(kind: str, tmp_path: Path) -> None:
    async with make_store(kind, tmp_path) as store, open_journal(store, session_id=SID) as journal:
        origin = await start_turn(journal)
        stream = journal.stream_id()
        head = await store.head(stream)
        journal.defer(scheduled("c1"), agent_id=origin.agent_id)
        assert journal.projection().tool("c1") is not None  # applied at once ...
        assert await store.head(stream) == head  # ... written later
        result = await journal.append(started("c1", SideEffect.IDEMPOTENT))
        assert (result.first_seq, result.last_seq) == (head + 1, head + 2)  # one batch holds both
        assert [type(e) for e in (await events_of(store, stream))[head:]] == [ToolScheduled, ToolStarted]


async def test_a_deferred_event_that_may_not_come_next_changes_nothing() -> None:
    async with open_journal(MemoryStore(), session_id=SID) as journal:
        snapshot = journal.projection().snapshot()
        with pytest.raises(InvalidTransitionError):
            journal.defer(started("ghost", SideEffect.PURE))
        assert journal.projection().snapshot() == snapshot
        await journal.append(accepted("r1"))  # the journal stays usable


async def test_a_command_is_written_alone_after_the_deferred_events() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id=SID) as journal:
        await start_turn(journal)
        journal.defer(scheduled("c1"))
        commits = store.commits
        first = await journal.append(accepted("r2"), command_id="cmd-r2")
        assert store.commits == commits + 2  # the deferred batch, then the command's own
        assert first.first_seq == first.last_seq
        replay = await journal.append(accepted("r2"), command_id="cmd-r2")
        assert replay.replayed and (replay.first_seq, replay.last_seq) == (first.first_seq, first.last_seq)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_closing_writes_what_is_still_deferred(kind: str, tmp_path: Path) -> None:
    async with make_store(kind, tmp_path) as store:
        async with open_journal(store, session_id=SID) as journal:
            await start_turn(journal)
            journal.defer(scheduled("c1"))
            head = journal.projection().head
        assert await store.head(journal.stream_id()) == head
        assert isinstance((await events_of(store, journal.stream_id()))[-1], ToolScheduled)


async def test_deferred_events_lost_in_a_crash_never_happened(autojump_clock: trio.testing.MockClock) -> None:
    """A crash loses what was deferred: the store, and a recovery, see the stream without it."""
    store = MemoryStore(clock=trio.current_time)
    with pytest.raises(LeaseLostError):
        async with open_journal(store, session_id=SID, lease_ttl=1) as journal:
            await start_turn(journal)
            head = await store.head(journal.stream_id())
            journal.defer(scheduled("c1"))
            journal._lose(LeaseLostError("the process died"))  # no clean close: nothing more is written
            await trio.sleep_forever()
    assert await store.head(journal.stream_id()) == head
    async with open_journal(store, session_id=SID, takeover_timeout=2) as reopened:  # the lease runs out
        assert reopened.projection().tool("c1") is None
        assert "c1" not in reopened.recovery_plan().tool_actions


async def test_a_sibling_scheduled_beside_a_started_call_is_run_by_recovery(tmp_path: Path) -> None:
    """Schedulings are deferred and written by the first start: a sibling that never started is
    durable as scheduled, and recovery runs it (a started idempotent call re-runs with its key)."""
    async with open_sqlite_store(tmp_path / "j.db") as store:
        with pytest.raises(LeaseLostError):
            async with open_journal(store, session_id=SID) as journal:
                await start_turn(journal)
                journal.defer(scheduled("a"), scheduled("b"))
                await journal.append(started("a", SideEffect.IDEMPOTENT))
                journal._lose(LeaseLostError("the process died"))  # no clean close
        await store.release_lease(journal.lease)  # as its expiry would
        async with open_journal(store, session_id=SID) as reopened:
            actions = dict(reopened.recovery_plan().tool_actions)
    assert actions == {"a": ToolRecoveryAction.RERUN_SAME_KEY, "b": ToolRecoveryAction.RUN}


# ---------------------------------------------------------------- 5. unknown outcomes fence the journal


async def test_a_write_that_landed_but_failed_fences_until_reconcile() -> None:
    faulty = FaultyStore(MemoryStore())
    async with open_journal(faulty, session_id=SID) as journal:
        stream = journal.stream_id()
        faulty.fail_next("after")
        with pytest.raises(JournalUnavailableError):
            await journal.append(accepted("r1"))
        assert journal.fenced
        with pytest.raises(JournalFencedError):
            await journal.append(accepted("r2"))
        assert await faulty.head(stream) == 2  # it did land
        await journal.reconcile()
        assert not journal.fenced
        assert journal.projection().head == await faulty.head(stream) == 2
        assert journal.projection().request("r1") is not None
        assert (await journal.append(accepted("r2"))).first_seq == 3


async def test_a_write_refused_before_the_store_is_absent_after_reconcile() -> None:
    faulty = FaultyStore(MemoryStore())
    async with open_journal(faulty, session_id=SID) as journal:
        stream = journal.stream_id()
        faulty.fail_next("before")
        with pytest.raises(JournalUnavailableError):
            await journal.append(accepted("r1"))
        assert journal.fenced
        with pytest.raises(JournalFencedError):
            await journal.append(accepted("r1"))
        await journal.reconcile()
        assert not journal.fenced
        assert journal.projection().head == await faulty.head(stream) == 1
        assert journal.projection().request("r1") is None
        assert (await journal.append(accepted("r1"))).first_seq == 2


async def test_a_hung_write_cut_by_cancellation_fences(autojump_clock: trio.testing.MockClock) -> None:
    faulty = FaultyStore(MemoryStore(clock=trio.current_time))
    async with open_journal(faulty, session_id=SID, lease_ttl=30, commit_grace=0.5) as journal:
        stream = journal.stream_id()
        faulty.fail_next("hang")
        start = trio.current_time()
        with trio.move_on_after(1) as scope:
            await journal.append(accepted("r1"))
        assert scope.cancelled_caught
        assert trio.current_time() - start == pytest.approx(1.5)  # waited its commit_grace, no longer
        assert journal.fenced
        with pytest.raises(JournalFencedError):
            await journal.append(accepted("r2"))
        await journal.reconcile()
        assert not journal.fenced
        assert journal.projection().request("r1") is None
        assert journal.projection().head == await faulty.head(stream) == 1


async def test_a_cancelled_write_that_lands_within_the_grace_does_not_fence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inner = MemoryStore(clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        store = GatedStore(inner, nursery)
        async with open_journal(store, session_id=SID, commit_grace=5) as journal:
            gate = trio.Event()
            store.hold = gate

            async def open_gate() -> None:
                await trio.sleep(2)
                gate.set()

            nursery.start_soon(open_gate)
            with trio.move_on_after(1) as scope:
                await journal.append(accepted("r1"))
            store.hold = None
            assert scope.cancelled_caught
            assert not journal.fenced
            assert journal.projection().head == await inner.head(journal.stream_id()) == 2
            assert (await journal.append(accepted("r2"))).first_seq == 3


async def test_a_write_that_lands_while_reconcile_reads_is_no_corruption(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A write not confirmed within the grace may still land while `reconcile` reads the store:
    after it read the heads, before it read the events. The events decide (the write is ours,
    under our lease): the journal takes it, it is not a stream that holds more than it claims."""
    inner = MemoryStore(clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        store = GatedStore(inner, nursery)
        gate = trio.Event()
        landed_between = False

        async def streams(session_id: str | None = None) -> Any:
            nonlocal landed_between
            heads = await inner.streams(session_id)
            if not gate.is_set():
                gate.set()  # the write lands now, after the heads were read
                await trio.testing.wait_all_tasks_blocked()
                landed_between = True
            return heads

        async with open_journal(store, session_id=SID, commit_grace=0.5) as journal:
            store.hold = gate
            with trio.move_on_after(1):
                await journal.append(accepted("r1"))
            store.hold = None
            assert journal.fenced
            store.streams = streams  # type: ignore[attr-defined]
            await journal.reconcile()
            assert landed_between
            assert not journal.fenced
            record = journal.projection().request("r1")
            assert record is not None
            assert journal.projection().head == await inner.head(journal.stream_id()) == 2
            assert (await journal.append(accepted("r2"))).first_seq == 3


async def test_a_head_that_claims_fewer_events_than_the_stream_holds_is_corruption() -> None:
    """What the test above tells apart: a head read again that still claims fewer events."""
    inner = MemoryStore()
    async with open_journal(inner, session_id=SID) as journal:
        await journal.append(accepted("r1"))
        stream = journal.stream_id()

    class StaleHeads:
        clock = inner.clock

        async def streams(self, session_id: str | None = None) -> Any:
            return [attrs.evolve(info, head=info.head - 1) for info in await inner.streams(session_id)]

        async def head(self, stream_id: str) -> int:
            return await inner.head(stream_id) - 1

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

    with pytest.raises(JournalCorruptError, match=f"stream {stream!r} claims head 1 but holds 2 events"):
        async with open_journal(StaleHeads(), session_id=SID):  # type: ignore[arg-type]
            pytest.fail("a stream holding more than its head claims must not open")


# ---------------------------------------------------------------- 6. the tool journal through a real pipeline


async def test_scheduled_and_the_final_input_are_committed_before_the_tool_runs() -> None:
    """The scheduling is in the projection before the middleware runs, and in the store (with
    the final input) before the tool runs: it is written with the start, in one batch."""
    store = MemoryStore()
    seen_by_middleware: list[Event] = []
    projected: list[ToolState | None] = []
    seen_by_tool: list[Event] = []
    async with open_journal(store, session_id=SID) as journal:
        origin = await start_turn(journal)
        stream = journal.stream_id()

        async def lowercase_path(request: Any, call_next: Any) -> ToolResult:
            seen_by_middleware.extend(await events_of(store, stream))
            call = journal.projection().tool("c1")
            projected.append(None if call is None else call.state)
            normalised: ToolResult = await call_next(request.replace(input={"path": request.input["path"].lower()}))
            return normalised

        @define_tool(
            name="write_note",
            description="Write a note.",
            input_schema={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            side_effect="idempotent",
            kind="write",
        )
        async def write_note(input: dict[str, Any], ctx: Any) -> str:
            seen_by_tool.extend(await events_of(store, stream))
            return f"wrote {input['path']}"

        pipeline = ToolPipeline([write_note], middleware=[lowercase_path], journal=journal)
        record = await pipeline.execute(ToolCall("c1", "write_note", {"path": "NOTES.TXT"}), origin)

    assert projected == [ToolState.SCHEDULED]
    assert for_call(seen_by_middleware, "c1") == []  # deferred: written with the start
    mine = for_call(seen_by_tool, "c1")
    assert [type(e) for e in mine] == [ToolScheduled, ToolStarted]
    assert isinstance(mine[0], ToolScheduled)
    assert mine[0].model_input == {"path": "NOTES.TXT"}
    assert mine[0].idempotency_key == f"{SID}:root:c1"
    start = mine[1]
    assert isinstance(start, ToolStarted)
    assert start.input == {"path": "notes.txt"}  # the FINAL input, after the middleware
    assert start.side_effect is SideEffect.IDEMPOTENT and not start.synthetic
    final = for_call(await events_of(store, stream), "c1")
    assert [type(e) for e in final] == [ToolScheduled, ToolStarted, ToolCompleted]
    assert record.result.output == "wrote notes.txt"


async def test_the_settlement_is_committed_before_the_result_is_published(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inner = MemoryStore(clock=trio.current_time)
    observed: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        store = GatedStore(inner, nursery)
        async with open_journal(store, session_id=SID) as journal:
            origin = await start_turn(journal)
            stream = journal.stream_id()
            gate = trio.Event()

            async def open_gate_later() -> None:
                await trio.sleep(5)
                # The settlement is submitted but not committed: nothing may be published yet.
                observed["history_while_held"] = len(pipeline.history)
                observed["held"] = [type(e) for b in store.held for e in (x.event for x in b.envelopes)]
                observed["stored_while_held"] = for_call(await events_of(inner, stream), "c1")
                gate.set()

            @define_tool(name="add", description="Add.", input_schema={"type": "object"}, side_effect="pure")
            async def add(input: dict[str, Any], ctx: Any) -> int:
                store.hold = gate  # the next append (the settlement) commits slowly
                nursery.start_soon(open_gate_later)
                return int(input["a"]) + int(input["b"])

            pipeline = ToolPipeline([add], journal=journal)
            start = trio.current_time()
            with trio.fail_after(60):
                record = await pipeline.execute(ToolCall("c1", "add", {"a": 2, "b": 3}), origin)
            returned_after = trio.current_time() - start
            store.hold = None
            stored = for_call(await events_of(inner, stream), "c1")
    assert observed["history_while_held"] == 0
    assert observed["held"] == [ToolCompleted]
    assert [type(e) for e in observed["stored_while_held"]] == [ToolScheduled, ToolStarted]
    assert returned_after >= 5
    settled = stored[-1]
    assert isinstance(settled, ToolCompleted)
    assert result_from_json(settled.result) == record.result
    assert record.result.output == 5
    assert list(pipeline.history) == [record]


@pytest.mark.parametrize("mode", ["before", "after"])
async def test_a_failed_settlement_raises_and_publishes_nothing(mode: str) -> None:
    faulty = FaultyStore(MemoryStore())
    items: list[Any] = []

    async def on_item(item: Any) -> None:
        items.append(item)

    async with open_journal(faulty, session_id=SID) as journal:
        origin = await start_turn(journal)
        stream = journal.stream_id()

        @define_tool(name="ping", description="Ping.", input_schema={"type": "object"}, side_effect="idempotent")
        async def ping(input: dict[str, Any], ctx: Any) -> str:
            faulty.fail_next(mode)  # the next write is the settlement
            return "pong"

        pipeline = ToolPipeline([ping], journal=journal)
        with pytest.raises(SettlementError):
            await pipeline.execute(ToolCall("c1", "ping", {}), origin, on_item=on_item)
        assert len(pipeline.history) == 0
        assert items == []
        assert journal.fenced
        stored = [type(e) for e in for_call(await events_of(faulty, stream), "c1")]
        if mode == "before":
            assert stored == [ToolScheduled, ToolStarted]
        else:
            assert stored == [ToolScheduled, ToolStarted, ToolCompleted]
        await journal.reconcile()
        state = journal.projection().tool("c1")
        assert state is not None
        assert state.state is (ToolState.STARTED if mode == "before" else ToolState.COMPLETED)


async def test_a_pure_start_is_not_awaited_when_opted_out_but_lands_before_the_settlement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inner = MemoryStore(clock=trio.current_time)
    observed: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        store = GatedStore(inner, nursery)
        gate = trio.Event()
        async with open_journal(store, session_id=SID, durable_pure_starts=False) as journal:
            origin = await start_turn(journal)
            stream = journal.stream_id()

            async def hold_the_start(request: Any, call_next: Any) -> ToolResult:
                store.hold = gate  # the next append is tool_started
                result: ToolResult = await call_next()
                return result

            async def open_gate_later() -> None:
                await trio.sleep(5)
                observed["stored_before_gate"] = [type(e) for e in for_call(await events_of(inner, stream), "c1")]
                gate.set()

            @define_tool(name="lookup", description="Look up.", input_schema={"type": "object"}, side_effect="pure")
            async def lookup(input: dict[str, Any], ctx: Any) -> str:
                store.hold = None
                pending = journal._pending_starts.get("c1")
                observed["pending"] = pending is not None and not pending.done
                observed["stored_in_body"] = [type(e) for e in for_call(await events_of(inner, stream), "c1")]
                observed["ran_at"] = trio.current_time()
                nursery.start_soon(open_gate_later)
                return "found"

            pipeline = ToolPipeline([lookup], middleware=[hold_the_start], journal=journal)
            start = trio.current_time()
            with trio.fail_after(60):  # mock time: a regression that awaits the start deadlocks, fails fast
                record = await pipeline.execute(ToolCall("c1", "lookup", {"q": "x"}), origin)
            elapsed = trio.current_time() - start
            assert journal._pending_starts == {}
            stored = [type(e) for e in for_call(await events_of(inner, stream), "c1")]
    assert observed["pending"] is True
    # The tool ran before its start (and the scheduling, deferred into the start's batch) was committed ...
    assert observed["stored_in_body"] == []
    assert observed["ran_at"] - start < 5
    assert observed["stored_before_gate"] == []  # ... and the settlement waited for them
    assert elapsed >= 5
    assert stored == [ToolScheduled, ToolStarted, ToolCompleted]
    assert record.result.output == "found"


async def test_a_pure_start_that_never_landed_fails_the_settlement_and_publishes_nothing() -> None:
    faulty = FaultyStore(MemoryStore())
    ran: list[str] = []
    async with open_journal(faulty, session_id=SID, durable_pure_starts=False) as journal:
        origin = await start_turn(journal)
        stream = journal.stream_id()

        async def refuse_the_start(request: Any, call_next: Any) -> ToolResult:
            faulty.fail_next("before")  # the next write is tool_started, which is not awaited
            result: ToolResult = await call_next()
            return result

        @define_tool(name="lookup", description="Look up.", input_schema={"type": "object"}, side_effect="pure")
        async def lookup(input: dict[str, Any], ctx: Any) -> str:
            ran.append("lookup")
            return "found"

        pipeline = ToolPipeline([lookup], middleware=[refuse_the_start], journal=journal)
        with pytest.raises(SettlementError):
            await pipeline.execute(ToolCall("c1", "lookup", {}), origin)
        assert ran == ["lookup"]  # a pure tool may run before its start is durable ...
        assert len(pipeline.history) == 0  # ... but its result is never published without it
        # The scheduling was deferred into the start's batch: neither landed.
        assert for_call(await events_of(faulty, stream), "c1") == []
        assert journal.fenced


async def test_non_pure_starts_are_always_awaited(autojump_clock: trio.testing.MockClock) -> None:
    inner = MemoryStore(clock=trio.current_time)
    observed: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        store = GatedStore(inner, nursery)
        gate = trio.Event()
        async with open_journal(store, session_id=SID, durable_pure_starts=False) as journal:
            origin = await start_turn(journal)
            stream = journal.stream_id()

            async def open_gate_later() -> None:
                await trio.sleep(5)
                store.hold = None
                gate.set()

            async def hold_the_start(request: Any, call_next: Any) -> ToolResult:
                store.hold = gate
                nursery.start_soon(open_gate_later)
                result: ToolResult = await call_next()
                return result

            @define_tool(
                name="upsert", description="Upsert.", input_schema={"type": "object"}, side_effect="idempotent"
            )
            async def upsert(input: dict[str, Any], ctx: Any) -> str:
                observed["pending"] = dict(journal._pending_starts)
                observed["stored_in_body"] = [type(e) for e in for_call(await events_of(inner, stream), "c1")]
                observed["ran_at"] = trio.current_time()
                return "ok"

            pipeline = ToolPipeline([upsert], middleware=[hold_the_start], journal=journal)
            start = trio.current_time()
            await pipeline.execute(ToolCall("c1", "upsert", {}), origin)
    assert observed["pending"] == {}
    assert observed["stored_in_body"] == [ToolScheduled, ToolStarted]
    assert observed["ran_at"] - start >= 5


async def test_lease_lost_while_the_tool_runs_raises_and_settles_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(clock=trio.current_time)
    finished: list[str] = []
    raised: list[BaseException] = []
    records: list[Any] = []
    with pytest.raises(LeaseLostError):
        async with open_journal(store, session_id=SID, owner="a", lease_ttl=10) as journal:
            origin = await start_turn(journal)
            stream = journal.stream_id()

            @define_tool(
                name="deploy", description="Deploy.", input_schema={"type": "object"}, side_effect="idempotent"
            )
            async def deploy(input: dict[str, Any], ctx: Any) -> str:
                await _revoke_by_release(store, journal)  # another owner takes over
                await trio.sleep(1000)
                finished.append("deploy")
                return "deployed"

            pipeline = ToolPipeline([deploy], journal=journal)
            try:
                records.append(await pipeline.execute(ToolCall("c1", "deploy", {}), origin))
            except LeaseLostError as exc:
                raised.append(exc)
    assert len(raised) == 1 and records == []
    assert finished == []
    assert len(pipeline.history) == 0
    assert [type(e) for e in for_call(await events_of(store, stream), "c1")] == [ToolScheduled, ToolStarted]


async def test_lease_lost_before_the_settlement_is_refused_by_the_store() -> None:
    store = MemoryStore()
    raised: list[BaseException] = []
    with pytest.raises(LeaseLostError):
        async with open_journal(store, session_id=SID, owner="a", lease_ttl=30) as journal:
            origin = await start_turn(journal)
            stream = journal.stream_id()

            @define_tool(
                name="send", description="Send.", input_schema={"type": "object"}, side_effect="non_idempotent"
            )
            async def send(input: dict[str, Any], ctx: Any) -> str:
                await _revoke_by_release(store, journal)  # the tool returns at once: only the store notices
                return "sent"

            pipeline = ToolPipeline([send], journal=journal)
            try:
                await pipeline.execute(ToolCall("c1", "send", {}), origin)
            except LeaseLostError as exc:
                raised.append(exc)
    assert len(raised) == 1
    assert isinstance(raised[0], StaleFencingTokenError)
    assert len(pipeline.history) == 0
    assert [type(e) for e in for_call(await events_of(store, stream), "c1")] == [ToolScheduled, ToolStarted]


# ---------------------------------------------------------------- 7. recovery


@attrs.define
class Counters:
    runs: dict[str, int] = attrs.Factory(dict)
    keys: dict[str, str] = attrs.Factory(dict)
    reconciles: list[tuple[str, dict[str, Any], str]] = attrs.Factory(list)
    middleware: int = 0

    def ran(self, name: str, ctx: Any) -> None:
        self.runs[name] = self.runs.get(name, 0) + 1
        self.keys[ctx.tool_call_id] = ctx.idempotency_key

    @property
    def total(self) -> int:
        return sum(self.runs.values())


TRANSFER_RESULT = ToolResult.success({"transfer": "already done"}, display="found by reconcile")


def make_tools(counters: Counters) -> dict[str, Tool[Any]]:
    schema: dict[str, Any] = {"type": "object"}

    @define_tool(name="lookup", description="Pure.", input_schema=schema, side_effect="pure", kind="readonly")
    async def lookup(input: dict[str, Any], ctx: Any) -> str:
        counters.ran("lookup", ctx)
        return "looked up"

    @define_tool(name="upsert", description="Idempotent.", input_schema=schema, side_effect="idempotent", kind="write")
    async def upsert(input: dict[str, Any], ctx: Any) -> str:
        counters.ran("upsert", ctx)
        return "upserted"

    @define_tool(name="charge", description="No reconcile.", input_schema=schema, side_effect="non_idempotent")
    async def charge(input: dict[str, Any], ctx: Any) -> str:
        counters.ran("charge", ctx)
        return "charged"

    async def transfer_reconcile(input: dict[str, Any], key: str) -> ToolResult | None:
        counters.reconciles.append(("transfer", input, key))
        return TRANSFER_RESULT

    @define_tool(
        name="transfer",
        description="Reconciles.",
        input_schema=schema,
        side_effect="non_idempotent",
        reconcile=transfer_reconcile,
    )
    async def transfer(input: dict[str, Any], ctx: Any) -> str:
        counters.ran("transfer", ctx)
        return "transferred"

    async def notify_reconcile(input: dict[str, Any], key: str) -> ToolResult | None:
        counters.reconciles.append(("notify", input, key))
        return None

    @define_tool(
        name="notify",
        description="Cannot tell.",
        input_schema=schema,
        side_effect="non_idempotent",
        reconcile=notify_reconcile,
    )
    async def notify(input: dict[str, Any], ctx: Any) -> str:
        counters.ran("notify", ctx)
        return "notified"

    return {tool.name: tool for tool in (lookup, upsert, charge, transfer, notify)}


def counting_middleware(counters: Counters) -> Any:
    async def count(request: Any, call_next: Any) -> ToolResult:
        counters.middleware += 1
        result: ToolResult = await call_next()
        return result

    return count


DONE_RESULT = ToolResult.success({"id": 7}, display="saved", metadata={"rows": 1})


async def crash_with_unfinished_work(store: JournalStore) -> None:
    """The first life of the session: writes what a session would, then 'crashes' (leaves the block)."""
    async with open_journal(store, session_id=SID) as journal:
        await start_turn(journal)
        idem, pure, non = SideEffect.IDEMPOTENT, SideEffect.PURE, SideEffect.NON_IDEMPOTENT
        await journal.append(
            scheduled("c-done", "upsert", idem), started("c-done", idem), completed("c-done", DONE_RESULT)
        )
        await journal.append(scheduled("c-sched", "upsert", idem, key="stored-key-sched"))
        await journal.append(scheduled("c-pure", "lookup", pure), started("c-pure", pure, {"q": "final"}))
        await journal.append(scheduled("c-idem", "upsert", idem, key="stored-key-idem"), started("c-idem", idem))
        await journal.append(scheduled("c-charge", "charge", non), started("c-charge", non))
        await journal.append(scheduled("c-transfer", "transfer", non), started("c-transfer", non, {"amount": 5}))
        await journal.append(scheduled("c-notify", "notify", non), started("c-notify", non))
        await journal.append(
            scheduled("c-denied", "upsert", idem),
            PermissionRequested(**REQ, call_id="c-denied", permission_id="perm-1"),
            PermissionResolved(**REQ, call_id="c-denied", permission_id="perm-1", decision=PermissionDecision.DENY),
        )
        await journal.append(ModelAttemptStarted(**REQ, attempt_id="attempt-1", model="test-model"))


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_recovery_decides_and_writes_but_never_runs_anything(kind: str, tmp_path: Path) -> None:
    counters = Counters()
    tools = make_tools(counters)
    async with make_store(kind, tmp_path) as store:
        await crash_with_unfinished_work(store)
        async with open_journal(store, session_id=SID) as journal:
            stream = journal.stream_id()
            before = await events_of(store, stream)
            pipeline = ToolPipeline(tools.values(), middleware=[counting_middleware(counters)], journal=journal)
            report = await journal.recover(tools=pipeline.tools)
            after = await events_of(store, stream)
            assert journal.recovered

            # Nothing ran: no tool, no middleware. Only the reconcile checks.
            assert counters.total == 0 and counters.middleware == 0
            assert sorted(name for name, _, _ in counters.reconciles) == ["notify", "transfer"]
            assert ("transfer", {"amount": 5}, "key-c-transfer") in counters.reconciles

            A = ToolRecoveryAction
            assert dict(report.decisions) == {
                "c-sched": A.RUN,
                "c-pure": A.RERUN,
                "c-idem": A.RERUN_SAME_KEY,
                "c-charge": A.SETTLE_OUTCOME_UNKNOWN,
                "c-transfer": A.RECONCILE,
                "c-notify": A.RECONCILE,
                "c-denied": A.CANCEL,
            }
            assert report.replayed == ("c-done",)
            assert {s.call_id: s.idempotency_key for s in report.to_execute} == {
                "c-sched": "stored-key-sched",
                "c-pure": "key-c-pure",
                "c-idem": "stored-key-idem",
            }
            assert sorted(report.outcome_unknown) == ["c-charge", "c-notify"]
            assert report.reconciled == ("c-transfer",)
            assert report.cancelled == ("c-denied",)

            new = after[len(before) :]
            assert after[: len(before)] == before
            # The settled call: replayed, nothing new written, the stored result intact.
            assert for_call(new, "c-done") == []
            done = journal.call("c-done")
            assert done is not None and done.result == DONE_RESULT
            # Calls to run again get a decision only.
            for call_id, action in (("c-sched", A.RUN), ("c-pure", A.RERUN), ("c-idem", A.RERUN_SAME_KEY)):
                written = for_call(new, call_id)
                assert len(written) == 1 and isinstance(written[0], RecoveryDecision)
                assert written[0].decision is action
            # A started non_idempotent call without reconcile: never re-run, outcome unknown.
            charge = for_call(new, "c-charge")
            assert [type(e) for e in charge] == [RecoveryDecision, ToolOutcomeUnknown]
            assert isinstance(charge[0], RecoveryDecision) and charge[0].decision is A.SETTLE_OUTCOME_UNKNOWN
            assert isinstance(charge[1], ToolOutcomeUnknown) and charge[1].reason is OutcomeUnknownReason.NO_RECONCILE
            # reconcile told the outcome: settled with it.
            transfer = for_call(new, "c-transfer")
            assert [type(e) for e in transfer] == [RecoveryDecision, ToolCompleted]
            record = journal.call("c-transfer")
            assert record is not None and record.result == TRANSFER_RESULT
            # reconcile could not tell: outcome unknown.
            notify = for_call(new, "c-notify")
            assert [type(e) for e in notify] == [RecoveryDecision, ToolOutcomeUnknown]
            assert isinstance(notify[1], ToolOutcomeUnknown)
            assert notify[1].reason is OutcomeUnknownReason.PROCESS_RESTART
            assert [type(e) for e in for_call(new, "c-denied")] == [RecoveryDecision, ToolCancelled]
            aborted = [e for e in new if isinstance(e, ModelAttemptAborted)]
            assert len(aborted) == 1 and aborted[0].attempt_id == "attempt-1"
            assert aborted[0].reason is ModelAbortReason.PROCESS_RESTART
            for call_id in ("c-charge", "c-transfer", "c-notify", "c-denied"):
                state = journal.projection().tool(call_id)
                assert state is not None and state.state.settled


async def test_recovered_calls_run_again_through_a_fresh_pipeline() -> None:
    counters = Counters()
    tools = make_tools(counters)
    store = MemoryStore()
    await crash_with_unfinished_work(store)
    async with open_journal(store, session_id=SID) as journal:
        report = await journal.recover(tools=tools)
        assert counters.total == 0
        pipeline = ToolPipeline(tools.values(), middleware=[counting_middleware(counters)], journal=journal)
        origin = CallOrigin(session_id=SID, agent_id=journal.root_agent_id, **REQ)
        stream = journal.stream_id()

        by_id = {s.call_id: s for s in report.to_execute}
        # The stored idempotency key is required.
        head = await store.head(stream)
        with pytest.raises(JournalError):
            await pipeline.execute(
                ToolCall("c-sched", "upsert", by_id["c-sched"].model_input), origin, idempotency_key="another-key"
            )
        assert await store.head(stream) == head and counters.total == 0

        for call in report.to_execute:
            record = await pipeline.execute(
                ToolCall(call.call_id, call.tool_name, call.model_input), origin, idempotency_key=call.idempotency_key
            )
            assert record.result.ok
            assert counters.keys[call.call_id] == call.idempotency_key
            state = journal.projection().tool(call.call_id)
            assert state is not None and state.state is ToolState.COMPLETED
        assert counters.runs == {"lookup": 1, "upsert": 2}
        assert counters.middleware == 3
        attempts = {call_id: journal.call(call_id).attempts for call_id in by_id}  # type: ignore[union-attr]
        assert attempts == {"c-sched": 1, "c-pure": 2, "c-idem": 2}
        started_events = [e for e in for_call(await events_of(store, stream), "c-pure") if isinstance(e, ToolStarted)]
        assert len(started_events) == 2  # the journal accepted a second tool_started after the rerun decision

        # Settled (replayed, reconciled, unknown, cancelled) and freshly re-run calls may not run again.
        head = await store.head(stream)
        for call_id, tool, key in (
            ("c-done", "upsert", "key-c-done"),
            ("c-charge", "charge", "key-c-charge"),
            ("c-transfer", "transfer", "key-c-transfer"),
            ("c-denied", "upsert", "key-c-denied"),
            ("c-pure", "lookup", "key-c-pure"),
        ):
            with pytest.raises(JournalError):
                await pipeline.execute(ToolCall(call_id, tool, {"n": 1}), origin, idempotency_key=key)
        assert await store.head(stream) == head
        assert counters.runs == {"lookup": 1, "upsert": 2}


async def test_a_recovered_call_cannot_be_rerun_as_another_tool() -> None:
    counters = Counters()
    tools = make_tools(counters)
    store = MemoryStore()
    await crash_with_unfinished_work(store)
    async with open_journal(store, session_id=SID) as journal:
        report = await journal.recover(tools=tools)
        call = next(s for s in report.to_execute if s.call_id == "c-sched")
        assert call.tool_name == "upsert"
        pipeline = ToolPipeline(tools.values(), journal=journal)
        origin = CallOrigin(session_id=SID, agent_id=journal.root_agent_id, **REQ)
        with pytest.raises(JournalError):
            await pipeline.execute(
                ToolCall("c-sched", "lookup", {"q": "other"}), origin, idempotency_key=call.idempotency_key
            )
        assert counters.total == 0


CRASH_STATES = st.sampled_from(["scheduled", "started", "settled"])
EFFECTS = st.sampled_from([SideEffect.PURE, SideEffect.IDEMPOTENT, SideEffect.NON_IDEMPOTENT])
RECONCILES = st.sampled_from(["none", "result", "unknown"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(st.tuples(CRASH_STATES, EFFECTS, RECONCILES), min_size=1, max_size=6))
async def test_after_recovery_every_call_is_settled_or_decided(calls: list[tuple[str, SideEffect, str]]) -> None:
    ran: list[str] = []

    def tool_for(index: int, effect: SideEffect, reconcile: str) -> Tool[Any]:
        async def run(input: dict[str, Any], ctx: Any) -> str:
            ran.append(ctx.tool_call_id)
            return "ran"

        async def check(input: dict[str, Any], key: str) -> ToolResult | None:
            return ToolResult.success("reconciled") if reconcile == "result" else None

        has = effect is SideEffect.NON_IDEMPOTENT and reconcile != "none"
        return define_tool(
            run,
            name=f"tool{index}",
            description="generated",
            input_schema={"type": "object"},
            side_effect=effect,
            reconcile=check if has else None,
        )

    tools = {f"tool{i}": tool_for(i, effect, rec) for i, (_, effect, rec) in enumerate(calls)}
    store = MemoryStore()
    async with open_journal(store, session_id=SID) as journal:
        await start_turn(journal)
        for index, (state, effect, _) in enumerate(calls):
            call_id = f"c{index}"
            events: list[Any] = [scheduled(call_id, f"tool{index}", effect)]
            if state in ("started", "settled"):
                events.append(started(call_id, effect))
            if state == "settled":
                events.append(completed(call_id, ToolResult.success(index)))
            await journal.append(*events)
    async with open_journal(store, session_id=SID) as journal:
        report = await journal.recover(tools=tools)
        to_execute = {s.call_id for s in report.to_execute}
        for index, (state, effect, rec) in enumerate(calls):
            call_id = f"c{index}"
            record = journal.projection().tool(call_id)
            assert record is not None
            assert record.state.settled or record.decision is not None
            if state == "settled":
                assert call_id in report.replayed and call_id not in report.decisions
            elif state == "scheduled":
                assert report.decisions[call_id] is ToolRecoveryAction.RUN and call_id in to_execute
            elif effect is SideEffect.NON_IDEMPOTENT:
                assert call_id not in to_execute
                assert record.state.settled
                expected = ToolState.COMPLETED if rec == "result" else ToolState.OUTCOME_UNKNOWN
                assert record.state is expected
            else:
                assert call_id in to_execute
        assert ran == []
    # A second crash before anything ran: recovery again is consistent with the first.
    async with open_journal(store, session_id=SID) as journal:
        again = await journal.recover(tools=tools)
        assert {s.call_id for s in again.to_execute} == to_execute
        assert ran == []


# ---------------------------------------------------------------- 8. corrupt stored data


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_stored_events_that_break_the_rules_make_open_fail(kind: str, tmp_path: Path) -> None:
    async with make_store(kind, tmp_path) as store:
        stream = f"{SID}/root"
        lease = await store.acquire_lease(SID, "writer", 30)
        now = store.clock()
        bad = ToolCompleted(**REQ, call_id="never-scheduled", result=result_to_json(ToolResult.success(1)))
        await store.append(
            AppendBatch(
                SID,
                stream,
                lease.token,
                (
                    EventEnvelope(
                        stream_id=stream, seq=1, event=SessionCreated(session_id=SID, agent_id="root"), recorded_at=now
                    ),
                    EventEnvelope(stream_id=stream, seq=2, event=bad, recorded_at=now),
                ),
            )
        )
        await store.release_lease(lease)
        with pytest.raises(JournalCorruptError) as info:
            async with open_journal(store, session_id=SID, owner="reader"):
                pytest.fail("a corrupt stream must not open")
        message = str(info.value)
        assert stream in message and "seq 2" in message
        assert await store.head(stream) == 2  # nothing was added to it
        # The failed open gave its lease back.
        other = await store.acquire_lease(SID, "someone-else", 30)
        assert other.owner == "someone-else"


# ---------------------------------------------------------------- permission updates and call states


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_permission_updates_are_read_back_in_order_on_reopen(kind: str, tmp_path: Path) -> None:
    from trio_agent._journal._events import PermissionUpdated

    async with make_store(kind, tmp_path) as store:
        async with open_journal(store, session_id=SID) as journal:
            await journal.append(PermissionUpdated(request_id="r0", source="handler", update={"mode": "plan"}))
            await start_turn(journal)
            await journal.append(
                PermissionUpdated(request_id="request", source="tool", call_id="c1", update={"allow": ["x"]})
            )
        async with open_journal(store, session_id=SID) as reopened:
            updates = reopened.projection().permission_updates
            assert [(u.source, u.update, u.call_id) for u in updates] == [
                ("handler", {"mode": "plan"}, None),
                ("tool", {"allow": ["x"]}, "c1"),
            ]


async def test_call_state_follows_the_projection() -> None:
    from trio_agent._tools._definition import ToolBehavior
    from trio_agent._tools._journal import ScheduledCall

    async with open_journal(MemoryStore(), session_id=SID) as journal:
        origin = await start_turn(journal)
        event = scheduled("c1", side_effect=SideEffect.IDEMPOTENT)
        call = ScheduledCall(
            "c1",
            "upsert",
            {"n": 1},
            ToolBehavior(SideEffect.IDEMPOTENT, ToolKind.EXECUTE, InterruptBehavior.BLOCK, False),
            "key-c1",
            SID,
            origin.agent_id,
            origin.request_id,
            origin.turn_id,
        )
        assert journal.call_state(call) is None
        await journal.append(event)
        assert journal.call_state(call) == "scheduled"
        await journal.append(started("c1", SideEffect.IDEMPOTENT))
        assert journal.call_state(call) == "started"
        await journal.append(
            RecoveryDecision(**REQ, call_id="c1", decision=ToolRecoveryAction.RERUN_SAME_KEY, reason="restart")
        )
        assert journal.call_state(call) == "scheduled"  # it may start again
        await journal.append(started("c1", SideEffect.IDEMPOTENT), completed("c1", ToolResult.success("ok")))
        assert journal.call_state(call) == "settled"


# ---------------------------------------------------------------- leases that never expire, heartbeat lag


async def test_a_memory_store_without_a_clock_keeps_its_lease_without_a_heartbeat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nothing outside the process can take the session over: the lease never runs out, so no
    heartbeat runs and a slow event loop cannot lose it; a second holder is still refused."""
    store = MemoryStore()
    async with open_journal(store, session_id=SID, lease_ttl=1) as journal:
        assert not journal.renews_lease
        assert not [task for task in all_tasks() if task.name.endswith("_heartbeat")]
        await trio.sleep(3600)  # an hour of (mock) time with no renewal
        journal.check_ownership()
        await journal.append(accepted("r1"))
        with pytest.raises(LeaseHeldError):
            async with open_journal(store, session_id=SID, takeover_timeout=5):
                pass  # pragma: no cover
    async with open_journal(store, session_id=SID) as reopened:  # released on close: taken at once
        assert reopened.fencing_token() == 2


async def test_the_heartbeat_reports_its_lag_and_warns_past_a_third_of_the_ttl(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    class SlowRenewals(MemoryStore):
        delay = 0.0

        async def renew_lease(self, lease: Any, ttl: float) -> Any:
            await trio.sleep(self.delay)  # a loaded event loop or a slow store
            return await super().renew_lease(lease, ttl)

    store = SlowRenewals(clock=trio.current_time)
    async with open_journal(store, session_id=SID, lease_ttl=9, heartbeat_interval=3) as journal:
        assert journal.renews_lease
        assert [task for task in all_tasks() if task.name.endswith("_heartbeat")]
        await trio.sleep(7)
        assert journal.heartbeat_lag == 0
        assert not caplog.records
        store.delay = 4.0  # past a third of the TTL, still inside it
        await trio.sleep(10)
        assert journal.heartbeat_lag == pytest.approx(4.0)
        journal.check_ownership()
    warnings = [r for r in caplog.records if "renewed" in r.getMessage()]
    assert len(warnings) == 1 and "lease_ttl" in warnings[0].getMessage()


async def test_the_heartbeat_renews_while_a_long_session_loads(autojump_clock: trio.testing.MockClock) -> None:
    """Loading takes longer than the lease: renewals run from the start, so the first write is
    still ours (before, the heartbeat began after the load and the lease had lapsed locally)."""

    class SlowToLoad(MemoryStore):
        async def streams(self, session_id: str | None = None) -> Any:
            await trio.sleep(20)  # a long session read over a slow link
            return await super().streams(session_id)

    store = SlowToLoad(clock=trio.current_time)
    async with open_journal(store, session_id=SID, lease_ttl=9, heartbeat_interval=3) as journal:
        journal.check_ownership()
        assert journal.projection().head == 1  # session_created written after the load, with the lease held
    lease = await store.current_lease(SID)
    assert lease is None or lease.expires_at < trio.current_time()  # released on the way out


async def test_a_lease_lost_while_loading_fails_the_open_with_lease_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class TakenWhileLoading(MemoryStore):
        async def streams(self, session_id: str | None = None) -> Any:
            await trio.sleep(5)
            return await super().streams(session_id)

        async def renew_lease(self, lease: Any, ttl: float) -> Any:
            raise LeaseLostError("taken over")

    with pytest.raises(LeaseLostError):
        async with open_journal(TakenWhileLoading(clock=trio.current_time), session_id=SID, lease_ttl=9):
            raise AssertionError("the body must not run")  # pragma: no cover
