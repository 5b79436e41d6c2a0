"""What a journal and its memory store keep per session, and that readers still get what they got (issue 17).

Thousands of sessions may sit idle at once, each with its own `MemoryStore`, so what they keep
is kept in forms the cyclic GC leaves alone where there is a choice: the store keeps the events
and makes their envelopes again on read (an envelope it cannot make again stays whole), command
ids as tuples of text and numbers; a journal's stream makes its fold, pins and deferred events
only when it has some, and its replay cache holds tuples too.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from trio_agent import ConfigError, LeaseLostError
from trio_agent._config import MAX_TIMEOUT, finite_seconds
from trio_agent._journal._durable import DurableJournal, open_journal
from trio_agent._journal._events import (
    Event,
    EventEnvelope,
    PermissionDecision,
    PermissionRequested,
    PermissionResolved,
    RequestAccepted,
    RequestCompleted,
    RequestStarted,
    SessionCreated,
    ToolCompleted,
    ToolScheduled,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
    place_event,
)
from trio_agent._journal._lease import check_seconds
from trio_agent._journal._memory import MemoryStore
from trio_agent._journal._snapshot import decode_snapshot, encode_snapshot
from trio_agent._journal._store import AppendBatch, CommandRecord, command_digest
from trio_agent._tools._definition import InterruptBehavior, SideEffect, ToolKind
from trio_agent.models import UserMessage

SID = "s"
ROOT = "s/root"


async def test_the_memory_store_makes_its_envelopes_again_equal() -> None:
    store = MemoryStore()
    lease = await store.acquire_lease(SID, "me", 10.0)
    events: list[Event] = [
        SessionCreated(session_id=SID, agent_id="root"),
        RequestAccepted(request_id="r", command_id="c", input={"prompt": "p"}),
        RequestStarted(request_id="r"),
    ]
    envelopes = [place_event(ROOT, seq, event, 1000.0 + seq / 7) for seq, event in enumerate(events, 1)]
    await store.append(AppendBatch(SID, ROOT, lease.token, envelopes[:1]))
    digest = command_digest(envelopes[1:])
    await store.append(AppendBatch(SID, ROOT, lease.token, envelopes[1:], "c", digest))
    assert await store.read(ROOT) == envelopes
    assert await store.read(ROOT, after=1, limit=1) == envelopes[1:2]
    assert await store.read(ROOT, after=-3, limit=2) == envelopes[:2]
    assert await store.read(ROOT, after=-3, limit=-1) == []  # as the SQL stores: at most -1 is none
    assert list(store._streams[ROOT].rows) == envelopes
    assert not any(isinstance(row, EventEnvelope) for row in store._streams[ROOT].events)
    assert await store.command(ROOT, "c") == CommandRecord(ROOT, "c", digest, 2, 3)
    assert await store.commands(ROOT) == [CommandRecord(ROOT, "c", digest, 2, 3)]
    gc.collect()
    gc.collect()
    assert not gc.is_tracked(store._streams[ROOT].commands)


async def test_an_envelope_the_store_cannot_make_again_is_kept_whole() -> None:
    store = MemoryStore()
    lease = await store.acquire_lease(SID, "me", 10.0)
    odd = [
        EventEnvelope(stream_id=ROOT, seq=1, event=SessionCreated(session_id=SID, agent_id="root"), recorded_at=5),
        EventEnvelope(stream_id=ROOT, seq=2, event=RequestStarted(request_id="r"), recorded_at=1.5, schema_version=7),
    ]
    await store.append(AppendBatch(SID, ROOT, lease.token, odd))
    read = await store.read(ROOT)
    assert read[0] is odd[0] and type(read[0].recorded_at) is int
    assert read[1] is odd[1]


async def one_request(journal: DurableJournal) -> None:
    ids: dict[str, Any] = {"request_id": "r", "turn_id": "t"}
    await journal.append(RequestAccepted(request_id="r", command_id="r", input={"prompt": "p"}), command_id="r")
    journal.defer(RequestStarted(request_id="r"))
    journal.defer(TurnStarted(**ids, turn=1))
    await journal.append(
        ToolScheduled(
            **ids,
            call_id="c",
            tool_name="add",
            model_input={"a": 1},
            side_effect=SideEffect.PURE,
            kind=ToolKind.READONLY,
            interrupt=InterruptBehavior.CANCEL,
            concurrency_safe=True,
            idempotency_key="k",
        ),
        PermissionRequested(**ids, call_id="c", permission_id="p"),
        PermissionResolved(**ids, call_id="c", permission_id="p", decision=PermissionDecision.ALLOW),
    )
    await journal.append(ToolStarted(**ids, call_id="c", input={"a": 1}, side_effect=SideEffect.PURE))
    await journal.append(ToolCompleted(**ids, call_id="c", result={"output": 2}))
    await journal.append(TurnCompleted(**ids, has_tool_calls=True), RequestCompleted(request_id="r"))


async def test_an_idle_stream_keeps_no_fold_pins_or_deferred_events_until_asked() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id=SID) as journal:
        await one_request(journal)
        stream = journal._streams[ROOT]
        assert stream._fold is None and stream.pins is None and stream.deferred == ()
        assert journal._subscriptions is None  # made by the first subscriber
        state = journal.projection()._s
        assert type(state.permission_ids) is frozenset and state.permission_ids == {"p"}
        assert state.permission_updates == () and state.approved == frozenset()
        assert stream.commands == {"r": (stream.commands["r"][0], 2, 2)}
        replayed = await journal.append(
            RequestAccepted(request_id="r", command_id="r", input={"prompt": "p"}), command_id="r"
        )
        assert replayed.replayed and (replayed.stream_id, replayed.first_seq, replayed.last_seq) == (ROOT, 2, 2)
        assert journal.conversation()[0] == UserMessage("p")
        assert stream._fold is not None
        # A snapshot of it reads back to the same state.
        restored = decode_snapshot(ROOT, "root", stream.projection.head, encode_snapshot(stream))
        assert restored.projection.snapshot() == stream.projection.snapshot()
        assert dict(restored.commands) == dict(stream.commands)


async def test_a_subscription_made_before_or_after_the_close_ends_with_it() -> None:
    store = MemoryStore()
    seen: list[object] = []

    async def follow(journal: DurableJournal) -> None:
        async with journal.subscribe_durable_events() as events:
            async for item in events:
                seen.append(item)

    async with trio.open_nursery() as nursery, open_journal(store, session_id=SID) as journal:
        nursery.start_soon(follow, journal)
        await trio.testing.wait_all_tasks_blocked()
        subscriptions = journal._subscriptions
        assert subscriptions is not None and not subscriptions.closed.is_set()
    assert subscriptions.closed.is_set() and seen
    async with open_journal(store, session_id="other") as closed:
        pass
    with trio.fail_after(1):
        await follow(closed)


async def test_a_lost_lease_still_cancels_the_body_of_a_memory_journal() -> None:
    store = MemoryStore()
    reached = False
    with pytest.raises(LeaseLostError):
        async with open_journal(store, session_id=SID) as journal:
            journal.held.lose(LeaseLostError("taken"))
            await trio.lowlevel.checkpoint()
            reached = True
    assert not reached


async def test_the_body_error_of_a_memory_journal_comes_out_as_itself() -> None:
    store = MemoryStore()
    with pytest.raises(KeyError, match="mine"):
        async with open_journal(store, session_id=SID):
            raise KeyError("mine")
    assert (await store.current_lease(SID)).expires_at == float("-inf")  # type: ignore[union-attr]  # released


async def test_a_memory_journal_opens_and_closes_without_a_scheduler_pass() -> None:
    store = MemoryStore()
    with trio.testing.assert_no_checkpoints():  # lease, load and release taken without waiting
        async with open_journal(store, session_id="s", owner="a"):
            pass
    async with open_journal(store, session_id="s", owner="b"):  # released: another owner takes it
        pass


async def test_a_memory_store_whose_leases_expire_still_waits_for_the_holder(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(clock=trio.current_time)  # leases that expire: a taker polls for the holder
    taken = trio.Event()
    async with trio.open_nursery() as nursery, open_journal(store, session_id="s", owner="a", lease_ttl=30):

        async def second() -> None:
            async with open_journal(store, session_id="s", owner="b", takeover_timeout=60):
                taken.set()

        nursery.start_soon(second)
        await trio.sleep(5)
        assert not taken.is_set()  # held, renewed: the second owner waits
    assert taken.is_set()  # released at the close: taken without waiting for the expiry
    assert trio.current_time() < 30


async def test_a_memory_journal_closes_without_a_shield_and_still_writes_inside_a_cancelled_scope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trio_agent._journal._durable as durable

    def no_shield(*args: Any) -> Any:
        raise AssertionError("the close of a memory journal needs no shield: nothing in it waits")

    monkeypatch.setattr(durable, "bounded_shield", no_shield)
    store = MemoryStore()
    with trio.CancelScope() as scope:
        async with open_journal(store, session_id=SID) as journal:
            journal.defer(RequestAccepted(request_id="r", command_id="r", input={}))
            scope.cancel()
    kinds = [type(envelope.event) for envelope in await store.read(journal.stream_id())]
    assert kinds == [SessionCreated, RequestAccepted]  # the deferred event was written at the close
    assert (await store.current_lease(SID)).expires_at == float("-inf")  # type: ignore[union-attr]  # released


async def test_a_fenced_memory_journal_writes_nothing_more_at_its_close_and_releases_its_lease() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id=SID) as journal:
        journal.defer(RequestAccepted(request_id="r", command_id="r", input={}))
        journal._fence("a test")
    kinds = [type(envelope.event) for envelope in await store.read(journal.stream_id())]
    assert kinds == [SessionCreated]
    assert (await store.current_lease(SID)).expires_at == float("-inf")  # type: ignore[union-attr]  # released


class _ReleasingLater(MemoryStore):
    """A memory store whose release waits (no `release_lease_now` of its own): the close must shield it."""

    async def release_lease(self, lease: Any) -> None:
        await trio.lowlevel.checkpoint()
        self.release_lease_now(lease)


async def test_a_memory_store_whose_release_waits_is_still_released_inside_a_cancelled_scope() -> None:
    store = _ReleasingLater()
    with trio.CancelScope() as scope:
        async with open_journal(store, session_id=SID) as journal:
            journal.defer(RequestAccepted(request_id="r", command_id="r", input={}))
            scope.cancel()
    kinds = [type(envelope.event) for envelope in await store.read(journal.stream_id())]
    assert kinds == [SessionCreated, RequestAccepted]
    assert (await store.current_lease(SID)).expires_at == float("-inf")  # type: ignore[union-attr]  # released


_SECONDS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, MAX_TIMEOUT, math.nextafter(MAX_TIMEOUT, math.inf), 5e-324]),
    st.integers(min_value=-3, max_value=10**400),
    st.booleans(),
)


@given(value=_SECONDS, allow_zero=st.booleans())
def test_the_inline_duration_check_is_the_full_one(value: Any, allow_zero: bool) -> None:
    # Each opening checks its lease timings inline for the usual float: same verdict, same value.
    try:
        expected: Any = finite_seconds(value, "t", allow_zero=allow_zero, maximum=MAX_TIMEOUT)
    except ConfigError as exc:
        expected = str(exc)
    try:
        got: Any = check_seconds("t", value, allow_zero=allow_zero)
    except ConfigError as exc:
        got = str(exc)
    assert type(got) is type(expected) and got == expected
    if type(got) is float:
        assert math.copysign(1.0, got) == math.copysign(1.0, expected)
