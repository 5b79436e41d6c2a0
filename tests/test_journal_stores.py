"""The journal store conformance suite: one set of rules, run against every store.

Every test of the first part takes the parametrized ``store`` fixture and runs
against the memory store, the SQLite store (a temporary file) and the
PostgreSQL store (a fresh schema per test; skipped while that store or its
server fixture is missing). Leases there use real, short TTLs; only the expiry
tests wait past them.

Then come store-specific parts: memory-only lease and wake-up tests on Trio's
mock clock (``MemoryStore(clock=trio.current_time)`` with ``autojump_clock``),
and SQLite-only tests (corrupt files and rows, durability, pragmas).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import logging
import math
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_agent._errors import (
    CommandConflictError,
    ConfigError,
    ForeignStreamError,
    JournalCorruptError,
    JournalError,
    JournalUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    SequenceConflictError,
    StaleFencingTokenError,
)
from trio_agent._journal._events import (
    ErrorInfo,
    Event,
    EventEnvelope,
    ModelAttemptCompleted,
    PermissionDecision,
    PermissionResolved,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestStarted,
    SessionCreated,
    ToolCompleted,
    ToolScheduled,
    TurnStarted,
)
from trio_agent._journal._lane import Deferred, LaneItem, WriterLane
from trio_agent._journal._memory import MemoryStore
from trio_agent._journal._sqlite import open_sqlite_store
from trio_agent._journal._store import (
    AppendBatch,
    AppendResult,
    AppendTicket,
    CommandRecord,
    Lease,
    StreamInfo,
    command_digest,
    encode_body,
    stream_id_for,
    wall_clock,
)
from trio_agent._journal._subscribe import DurableEvent, subscribe_durable_events
from trio_agent._tools._definition import InterruptBehavior, SideEffect, ToolKind

LONG_TTL = 60.0
"""A lease that outlives any test."""

SHORT_TTL = 0.5
"""A real lease TTL for expiry tests; ``EXPIRY_WAIT`` is comfortably past it."""

EXPIRY_WAIT = 0.8

BAD_TTLS: tuple[Any, ...] = (0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "1", None)

RECORDED_AT = 1_712_345_678.123456


# ---------------------------------------------------------------- events and batches


def make_event(index: int) -> Event:
    """A varied, deterministic event: nested JSON, unicode, a NUL, big ints and awkward floats."""
    request, turn, call = f"req-{index}", f"turn-{index}", f"call-{index}"
    kind = index % 9
    if kind == 0:
        return SessionCreated(session_id=f"sess-{index}", agent_id=f"agent-{index}", parent_agent_id="root")
    if kind == 1:
        return RequestAccepted(
            request_id=request,
            command_id=f"cmd-{index}",
            input={
                "text": f"hello {index} \u2603 \U0001f600 \u00e9\u00e8",
                "nul": "a\x00b",
                "surrogate_escaped_filename": "caf\udce9.txt",
                "quotes": "\"'\\",
                "numbers": [1, 2.5, None, True, False, 2**63, 0.1 + 0.2, 1e-7, -0.0, 1e308],
            },
        )
    if kind == 2:
        return TurnStarted(request_id=request, turn_id=turn, turn=index + 1)
    if kind == 3:
        return ModelAttemptCompleted(
            request_id=request,
            turn_id=turn,
            attempt_id=f"attempt-{index}",
            response={"content": [{"type": "text", "text": "x" * 300}], "usage": {"input": index, "output": 7}},
        )
    if kind == 4:
        return ToolScheduled(
            request_id=request,
            turn_id=turn,
            call_id=call,
            tool_name="write_file",
            model_input={"path": f"/tmp/{index}", "body": "line1\nline2\ttab"},
            side_effect=SideEffect.NON_IDEMPOTENT,
            kind=ToolKind.WRITE,
            interrupt=InterruptBehavior.BLOCK,
            concurrency_safe=False,
            idempotency_key=f"key-{index}",
        )
    if kind == 5:
        return ToolCompleted(
            request_id=request, turn_id=turn, call_id=call, result={"ok": True, "deep": [[], {}, "", {"a": [1]}]}
        )
    if kind == 6:
        return RequestFailed(request_id=request, error=ErrorInfo(message="boom\nline 2", code="E1", retryable=True))
    if kind == 7:
        return PermissionResolved(
            request_id=request,
            turn_id=turn,
            call_id=call,
            permission_id=f"perm-{index}",
            decision=PermissionDecision.DENY,
        )
    return RequestStarted(request_id=request)


def envs(stream_id: str, first: int, count: int, *, base: int = 0) -> list[EventEnvelope]:
    """``count`` envelopes of ``stream_id`` from ``first``; ``base`` shifts the content (other content, same seqs)."""
    return [
        EventEnvelope(
            stream_id=stream_id,
            seq=seq,
            event=make_event(base + seq),
            recorded_at=RECORDED_AT + (base + seq) * 0.001,
        )
        for seq in range(first, first + count)
    ]


def one(stream_id: str, seq: int, event: Event) -> EventEnvelope:
    return EventEnvelope(stream_id=stream_id, seq=seq, event=event, recorded_at=RECORDED_AT)


def make_batch(
    lease: Lease, stream_id: str, envelopes: Sequence[EventEnvelope], *, command_id: str | None = None
) -> AppendBatch:
    return AppendBatch(
        lease.session_id,
        stream_id,
        lease.token,
        envelopes,
        command_id=command_id,
        command_digest=None if command_id is None else command_digest(envelopes),
    )


def shifted(envelopes: Sequence[EventEnvelope], by: int, *, recorded_by: float = 0.0) -> list[EventEnvelope]:
    return [attrs.evolve(e, seq=e.seq + by, recorded_at=e.recorded_at + recorded_by) for e in envelopes]


# ---------------------------------------------------------------- the store fixture


@attrs.frozen
class Backend:
    name: str
    dsn: Any = None
    schema: str | None = None


def _postgres_missing() -> str | None:
    if importlib.util.find_spec("trio_agent._journal._postgres") is None:
        return "the PostgreSQL store (trio_agent/_journal/_postgres.py, open_postgres_store) does not exist yet"
    return None


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_kind(request: pytest.FixtureRequest) -> Backend:
    name: str = request.param
    if name != "postgres":
        return Backend(name)
    missing = _postgres_missing()
    if missing is not None:
        pytest.skip(missing)
    try:
        dsn = request.getfixturevalue("postgres_dsn")
    except pytest.FixtureLookupError:
        pytest.skip("the session fixture postgres_dsn is not defined in tests/conftest.py yet")
    try:
        schema = request.getfixturevalue("fresh_pg_schema")  # a schema of its own, dropped afterwards
    except pytest.FixtureLookupError:
        schema = f"t_{uuid.uuid4().hex[:12]}"
    return Backend(name, dsn, schema)


@pytest.fixture
async def store(store_kind: Backend, tmp_path: Path) -> AsyncIterator[Any]:
    if store_kind.name == "memory":
        memory = MemoryStore(clock=wall_clock)  # a clock of its own: leases that expire, as the others'
        yield memory
        await memory.aclose()
    elif store_kind.name == "sqlite":
        async with open_sqlite_store(tmp_path / "journal.db") as sqlite_store:
            yield sqlite_store
    else:
        from trio_agent._journal._postgres import open_postgres_store  # lazily: it needs psycopg

        async with open_postgres_store(store_kind.dsn, schema=store_kind.schema) as pg_store:
            yield pg_store


async def lease_on(store: Any, session_id: str, owner: str = "worker-1", ttl: float = LONG_TTL) -> Lease:
    lease = await store.acquire_lease(session_id, owner, ttl)
    assert isinstance(lease, Lease)
    assert (lease.session_id, lease.owner) == (session_id, owner)
    return lease


# ================================================================ conformance: reads and writes


async def test_round_trip_preserves_envelopes_exactly(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    first = envs(stream, 1, 5)
    second = envs(stream, 6, 13)

    assert await store.append(make_batch(lease, stream, first)) == AppendResult(stream, 1, 5)
    result = await store.append(make_batch(lease, stream, second))
    assert result == AppendResult(stream, 6, 18)
    assert result.replayed is False

    everything = first + second
    back = await store.read(stream)
    assert back == everything
    # Byte-exact too: equality alone cannot tell True from 1 inside JSON payloads.
    assert [encode_body(e) for e in back] == [encode_body(e) for e in everything]
    assert [type(e.event) for e in back] == [type(e.event) for e in everything]
    assert await store.head(stream) == 18
    assert await store.stream_info(stream) == StreamInfo(stream, "sess", 18)


async def test_unknown_stream_reads_empty(store: Any) -> None:
    assert await store.read("nobody/root") == []
    assert await store.head("nobody/root") == 0
    assert await store.stream_info("nobody/root") is None
    assert await store.streams() == []
    assert await store.streams("nobody") == []
    assert await store.command("nobody/root", "cmd") is None
    assert await store.commands("nobody/root") == []
    assert await store.current_lease("nobody") is None


async def test_read_after_and_limit_page_through_a_stream(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    everything: list[EventEnvelope] = []
    for size in (1, 4, 7, 2, 9):  # 23 events in batches of several sizes
        batch = envs(stream, len(everything) + 1, size)
        await store.append(make_batch(lease, stream, batch))
        everything += batch

    paged: list[EventEnvelope] = []
    after = 0
    while page := await store.read(stream, after=after, limit=5):
        assert 1 <= len(page) <= 5
        assert [e.seq for e in page] == list(range(after + 1, after + 1 + len(page)))
        paged += page
        after = page[-1].seq
    assert paged == everything

    assert await store.read(stream, after=10) == everything[10:]
    assert await store.read(stream, after=10, limit=3) == everything[10:13]
    assert await store.read(stream, limit=1) == everything[:1]
    assert await store.read(stream, after=20, limit=100) == everything[20:]
    assert await store.read(stream, after=22) == everything[22:]
    assert await store.read(stream, after=23) == []
    assert await store.read(stream, after=1000) == []
    assert await store.read(stream, limit=0) == []
    assert await store.read(stream, limit=-1) == []  # at most -1 events: none, in every store
    assert await store.head(stream) == 23


async def test_read_with_negative_after_returns_everything(
    store: Any, store_kind: Backend, request: pytest.FixtureRequest
) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    events = envs(stream, 1, 3)
    await store.append(make_batch(lease, stream, events))
    assert await store.read(stream, after=-1) == events  # seq > -1: every event


async def test_streams_filter_by_session_and_order_by_stream_id(store: Any) -> None:
    # Ids chosen so that prefix matching ("s1" vs "s10") or a locale collation ("B" vs "a", "/" vs digits)
    # would give another answer than plain code-point order.
    layout = [
        ("s2", "a", 2),
        ("s1", "zeta", 3),
        ("s10", "root", 1),
        ("s1", "alpha", 4),
        ("s2", "B", 5),
        ("s1", "m", 1),
        ("s1", "Zed", 2),
    ]
    leases = {session: await lease_on(store, session) for session in {s for s, _, _ in layout}}
    for session, agent, count in layout:
        stream = stream_id_for(session, agent)
        await store.append(make_batch(leases[session], stream, envs(stream, 1, count)))

    expected = sorted(
        (StreamInfo(stream_id_for(session, agent), session, count) for session, agent, count in layout),
        key=lambda info: info.stream_id,
    )
    assert await store.streams() == expected
    for session in ("s1", "s2", "s10"):
        assert await store.streams(session) == [info for info in expected if info.session_id == session]
    assert [info.stream_id for info in await store.streams("s1")] == ["s1/Zed", "s1/alpha", "s1/m", "s1/zeta"]
    assert await store.streams("s") == []
    assert await store.streams("s1/") == []
    for info in expected:
        assert await store.stream_info(info.stream_id) == info
        assert await store.head(info.stream_id) == info.head


# ================================================================ conformance: gapless sequences


async def test_append_must_continue_exactly_at_the_head(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    original = envs(stream, 1, 3)
    await store.append(make_batch(lease, stream, original))

    with pytest.raises(SequenceConflictError) as gap:
        await store.append(make_batch(lease, stream, envs(stream, 5, 1)))  # head + 2
    assert (gap.value.stream_id, gap.value.expected, gap.value.actual) == (stream, 4, 3)

    for seq in (1, 2, 3):  # already used: never overwritten, not even with other content
        with pytest.raises(SequenceConflictError) as used:
            await store.append(make_batch(lease, stream, envs(stream, seq, 1, base=100)))
        assert (used.value.stream_id, used.value.actual) == (stream, 3)

    assert await store.head(stream) == 3
    assert await store.read(stream) == original

    # A new stream starts at 1; a refused first append creates nothing.
    other = stream_id_for("sess", "other")
    with pytest.raises(SequenceConflictError):
        await store.append(make_batch(lease, other, envs(other, 2, 2)))
    assert await store.stream_info(other) is None
    assert await store.read(other) == []
    assert [info.stream_id for info in await store.streams("sess")] == [stream]

    assert await store.append(make_batch(lease, stream, envs(stream, 4, 1))) == AppendResult(stream, 4, 4)
    assert await store.read(stream) == original + envs(stream, 4, 1)


async def test_a_multi_event_batch_lands_all_or_nothing(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    original = envs(stream, 1, 2)
    await store.append(make_batch(lease, stream, original))

    # Seqs 2..5: the first collides, 3..5 are free; none of them may land.
    with pytest.raises(SequenceConflictError):
        await store.append(make_batch(lease, stream, envs(stream, 2, 4, base=50)))
    assert await store.head(stream) == 2
    assert await store.read(stream) == original

    # A multi-event batch refused by the fence on a brand-new stream creates nothing.
    fresh = stream_id_for("sess", "fresh")
    with pytest.raises(StaleFencingTokenError):
        await store.append(AppendBatch("sess", fresh, lease.token + 7, envs(fresh, 1, 3)))
    assert await store.stream_info(fresh) is None

    good = envs(stream, 3, 4)
    assert await store.append(make_batch(lease, stream, good)) == AppendResult(stream, 3, 6)
    assert await store.read(stream) == original + good
    assert await store.stream_info(stream) == StreamInfo(stream, "sess", 6)


# ================================================================ conformance: fencing and leases


async def test_stale_token_after_takeover_is_refused_by_the_store(store: Any) -> None:
    stream = stream_id_for("sess", "root")
    old = await lease_on(store, "sess", "A")
    original = envs(stream, 1, 2)
    await store.append(make_batch(old, stream, original))

    await store.release_lease(old)
    new = await lease_on(store, "sess", "B")
    assert new.token > old.token

    # The old owner still believes it holds the lease and appends at the right head: the store refuses.
    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(old, stream, envs(stream, 3, 2)))
    other = stream_id_for("sess", "other")
    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(old, other, envs(other, 1, 1)))
    assert await store.read(stream) == original
    assert await store.head(stream) == 2
    assert await store.stream_info(other) is None

    assert await store.append(make_batch(new, stream, envs(stream, 3, 1))) == AppendResult(stream, 3, 3)


async def test_reacquiring_by_the_same_owner_fences_the_previous_token(store: Any) -> None:
    stream = stream_id_for("sess", "root")
    first = await lease_on(store, "sess", "A")
    second = await lease_on(store, "sess", "A")
    assert second.token > first.token
    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(first, stream, envs(stream, 1, 1)))
    assert await store.stream_info(stream) is None
    await store.append(make_batch(second, stream, envs(stream, 1, 1)))
    assert await store.head(stream) == 1


async def test_append_without_a_valid_lease_is_refused(store: Any) -> None:
    stream = stream_id_for("nolease", "root")
    for token in (0, 1, 2):
        with pytest.raises(StaleFencingTokenError):
            await store.append(AppendBatch("nolease", stream, token, envs(stream, 1, 2)))

    # Another session's lease does not cover this one, even with the same number.
    elsewhere = await lease_on(store, "elsewhere")
    with pytest.raises(StaleFencingTokenError):
        await store.append(AppendBatch("nolease", stream, elsewhere.token, envs(stream, 1, 1)))

    # A token from the future is as wrong as an old one.
    own = await lease_on(store, "owned")
    owned_stream = stream_id_for("owned", "root")
    with pytest.raises(StaleFencingTokenError):
        await store.append(AppendBatch("owned", owned_stream, own.token + 1, envs(owned_stream, 1, 1)))

    assert await store.stream_info(stream) is None
    assert await store.stream_info(owned_stream) is None
    assert await store.streams() == []


async def test_expired_lease_cannot_append_renew_or_block_a_takeover(store: Any) -> None:
    stream = stream_id_for("sess", "root")
    lease = await lease_on(store, "sess", "A", SHORT_TTL)
    first = envs(stream, 1, 1)
    await store.append(make_batch(lease, stream, first))

    await trio.sleep(EXPIRY_WAIT)  # expiry test: real time must pass the real TTL

    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(lease, stream, envs(stream, 2, 1)))
    assert await store.read(stream) == first
    with pytest.raises(LeaseLostError):
        await store.renew_lease(lease, LONG_TTL)

    # Nobody holds it any more: another owner takes over at once, with a higher token.
    taken = await lease_on(store, "sess", "B")
    assert taken.token > lease.token
    await store.release_lease(lease)  # the expired owner's release leaves the new lease alone
    current = await store.current_lease("sess")
    assert current is not None
    assert (current.owner, current.token) == ("B", taken.token)
    assert await store.append(make_batch(taken, stream, envs(stream, 2, 1))) == AppendResult(stream, 2, 2)
    # The expired token stays stale even though the stream moved on.
    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(lease, stream, envs(stream, 3, 1)))
    assert await store.head(stream) == 2


async def test_tokens_strictly_increase_across_acquisitions(store: Any) -> None:
    tokens = []
    for owner in ("A", "B", "A", "C", "C", "B"):
        lease = await lease_on(store, "sess", owner)
        tokens.append(lease.token)
        await store.release_lease(lease)
    assert all(isinstance(token, int) for token in tokens)
    assert all(later > earlier for earlier, later in itertools.pairwise(tokens))


async def test_acquire_while_another_owner_holds_the_lease(store: Any) -> None:
    held = await lease_on(store, "sess", "A")
    current = await store.current_lease("sess")
    assert current is not None
    assert (current.session_id, current.owner, current.token) == ("sess", "A", held.token)
    assert current.expires_at == pytest.approx(held.expires_at, abs=1e-3)

    with pytest.raises(LeaseHeldError) as info:
        await store.acquire_lease("sess", "B", LONG_TTL)
    assert isinstance(info.value, JournalError)
    assert info.value.owner == "A"
    assert info.value.expires_at == pytest.approx(held.expires_at, abs=1e-3)

    # The refused attempt changed nothing: same holder, same token, still able to write.
    after = await store.current_lease("sess")
    assert after is not None
    assert (after.owner, after.token) == ("A", held.token)
    stream = stream_id_for("sess", "root")
    await store.append(make_batch(held, stream, envs(stream, 1, 1)))

    # Sessions are leased independently.
    other = await lease_on(store, "sess-2", "B")
    assert other.owner == "B"


async def test_renew_extends_a_valid_lease_and_refuses_a_lost_one(store: Any) -> None:
    stream = stream_id_for("sess", "root")
    lease = await lease_on(store, "sess", "A", 5.0)
    renewed = await store.renew_lease(lease, LONG_TTL)
    assert (renewed.session_id, renewed.owner, renewed.token) == ("sess", "A", lease.token)
    assert renewed.expires_at > lease.expires_at
    current = await store.current_lease("sess")
    assert current is not None
    assert current.expires_at == pytest.approx(renewed.expires_at, abs=1e-3)
    # The older value of the same lease still names it (same owner and token).
    again = await store.renew_lease(lease, LONG_TTL)
    assert again.token == lease.token
    await store.append(make_batch(lease, stream, envs(stream, 1, 1)))  # renewing keeps the token

    await store.release_lease(again)
    with pytest.raises(LeaseLostError):
        await store.renew_lease(again, LONG_TTL)

    taken = await lease_on(store, "sess", "B")
    with pytest.raises(LeaseLostError):
        await store.renew_lease(lease, LONG_TTL)
    # The right token under another owner's name is not the lease either.
    with pytest.raises(LeaseLostError):
        await store.renew_lease(Lease("sess", "C", taken.token, taken.expires_at), LONG_TTL)
    with pytest.raises(LeaseLostError):
        await store.renew_lease(Lease("ghost", "A", 1, time.time() + LONG_TTL), LONG_TTL)
    assert await store.current_lease("ghost") is None

    # The failed renewals did not disturb the holder.
    current = await store.current_lease("sess")
    assert current is not None
    assert (current.owner, current.token) == ("B", taken.token)


async def test_release_is_idempotent_and_frees_the_lease_at_once(store: Any) -> None:
    stream = stream_id_for("sess", "root")
    lease = await lease_on(store, "sess", "A")
    await store.append(make_batch(lease, stream, envs(stream, 1, 1)))
    await store.release_lease(lease)
    await store.release_lease(lease)

    released = await store.current_lease("sess")
    assert released is None or released.expires_at < time.time()
    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(lease, stream, envs(stream, 2, 1)))

    successor = await lease_on(store, "sess", "B")  # no LeaseHeldError, no waiting for the TTL
    assert successor.token > lease.token
    await store.release_lease(lease)  # a stale release leaves the successor alone
    current = await store.current_lease("sess")
    assert current is not None
    assert (current.owner, current.token) == ("B", successor.token)
    await store.append(make_batch(successor, stream, envs(stream, 2, 1)))
    assert await store.head(stream) == 2

    await store.release_lease(Lease("ghost", "X", 1, 0.0))  # never leased: nothing to do
    assert await store.current_lease("ghost") is None


async def test_invalid_ttl_is_refused(store: Any) -> None:
    for ttl in BAD_TTLS:
        with pytest.raises(JournalError):
            await store.acquire_lease("sess", "A", ttl)
    assert await store.current_lease("sess") is None

    lease = await lease_on(store, "sess", "A")
    for ttl in BAD_TTLS:
        with pytest.raises(JournalError):
            await store.renew_lease(lease, ttl)
    current = await store.current_lease("sess")
    assert current is not None
    assert current.token == lease.token
    assert current.expires_at == pytest.approx(lease.expires_at, abs=1e-3)


# ================================================================ conformance: stream ownership


async def test_a_stream_belongs_to_one_session_for_ever(store: Any) -> None:
    lease_a = await lease_on(store, "A")
    lease_b = await lease_on(store, "B")
    stream = stream_id_for("A", "root")
    original = envs(stream, 1, 2)
    await store.append(make_batch(lease_a, stream, original))

    with pytest.raises(ForeignStreamError):
        await store.append(make_batch(lease_b, stream, envs(stream, 3, 1)))
    assert await store.read(stream) == original
    assert await store.stream_info(stream) == StreamInfo(stream, "A", 2)
    assert await store.streams("B") == []

    # Ownership is what the store recorded at the first append, not a naming convention.
    shared = "shared-name"
    await store.append(make_batch(lease_b, shared, envs(shared, 1, 1)))
    with pytest.raises(ForeignStreamError):
        await store.append(make_batch(lease_a, shared, envs(shared, 2, 1)))
    assert await store.stream_info(shared) == StreamInfo(shared, "B", 1)


# ================================================================ conformance: commands


async def test_command_replay_returns_the_first_outcome_and_conflicts_are_refused(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    plain = envs(stream, 1, 1)
    await store.append(make_batch(lease, stream, plain))

    command = envs(stream, 2, 3)
    first = await store.append(make_batch(lease, stream, command, command_id="cmd-1"))
    assert first == AppendResult(stream, 2, 4, replayed=False)
    record = CommandRecord(stream, "cmd-1", command_digest(command), 2, 4)
    assert await store.command(stream, "cmd-1") == record

    # An identical replay, at the new head and recorded later: the first outcome, nothing written.
    later = shifted(command, 3, recorded_by=100.0)
    assert command_digest(later) == command_digest(command)
    assert await store.append(make_batch(lease, stream, later, command_id="cmd-1")) == AppendResult(
        stream, 2, 4, replayed=True
    )
    # ... and at its original (now used) position.
    assert await store.append(make_batch(lease, stream, command, command_id="cmd-1")) == AppendResult(
        stream, 2, 4, replayed=True
    )
    assert await store.head(stream) == 4
    assert await store.read(stream) == plain + command

    # The same id with other content, or with part of the content, is refused.
    for content in (envs(stream, 5, 1, base=77), shifted(command[:2], 3), envs(stream, 5, 3, base=77)):
        with pytest.raises(CommandConflictError) as info:
            await store.append(make_batch(lease, stream, content, command_id="cmd-1"))
        assert info.value.command_id == "cmd-1"
    assert await store.head(stream) == 4
    assert await store.read(stream) == plain + command
    assert await store.command(stream, "cmd-1") == record
    assert await store.commands(stream) == [record]
    assert await store.command(stream, "cmd-2") is None
    assert await store.command(stream_id_for("sess", "other"), "cmd-1") is None

    # A new command continues normally.
    nxt = envs(stream, 5, 2)
    assert await store.append(make_batch(lease, stream, nxt, command_id="cmd-2")) == AppendResult(stream, 5, 6)


async def test_commands_are_listed_in_stream_order_and_keyed_by_stream(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    expected = []
    seq = 1
    for command_id, size in (("zeta", 2), ("alpha", 1), ("mid", 3)):
        batch = envs(stream, seq, size)
        await store.append(make_batch(lease, stream, batch, command_id=command_id))
        expected.append(CommandRecord(stream, command_id, command_digest(batch), seq, seq + size - 1))
        seq += size
    await store.append(make_batch(lease, stream, envs(stream, seq, 1)))  # no command id: no record
    assert await store.commands(stream) == expected  # by first_seq, not by id

    # The same command id on another stream is another command.
    other = stream_id_for("sess", "other")
    content = envs(other, 1, 2, base=500)
    assert await store.append(make_batch(lease, other, content, command_id="zeta")) == AppendResult(other, 1, 2)
    assert await store.commands(other) == [CommandRecord(other, "zeta", command_digest(content), 1, 2)]
    assert await store.commands(stream) == expected


# ================================================================ conformance: group commit and concurrency


async def test_submitted_tickets_resolve_and_failures_are_isolated(store: Any, store_kind: Backend) -> None:
    main = await lease_on(store, "gc", "w1")
    old = await lease_on(store, "gc-old", "A")
    await store.release_lease(old)
    await lease_on(store, "gc-old", "B")
    streams = [stream_id_for("gc", f"agent-{i:02}") for i in range(20)]
    expected = {stream: envs(stream, 1, 10) for stream in streams}
    stale_stream = stream_id_for("gc-old", "root")
    batches_before = store._lane.batches if store_kind.name == "sqlite" else 0

    tickets: list[AppendTicket] = []
    conflict: AppendTicket | None = None
    stale: AppendTicket | None = None
    for seq in range(1, 11):
        for index, stream in enumerate(streams):
            tickets.append(store.submit(make_batch(main, stream, [expected[stream][seq - 1]])))
            if seq == 5 and index == 3:
                conflict = store.submit(make_batch(main, stream, envs(stream, 5, 1, base=999)))
            if seq == 5 and index == 7:
                stale = store.submit(make_batch(old, stale_stream, envs(stale_stream, 1, 1)))
    assert conflict is not None and stale is not None
    assert len(tickets) == 200

    with trio.fail_after(30):
        results = [await ticket.wait() for ticket in tickets]
        with pytest.raises(SequenceConflictError):
            await conflict.wait()
        with pytest.raises(StaleFencingTokenError):
            await stale.wait()
    assert all(ticket.done for ticket in [*tickets, conflict, stale])
    assert results == [AppendResult(stream, seq, seq) for seq in range(1, 11) for stream in streams]
    assert [ticket.outcome() for ticket in tickets] == results

    for stream in streams:
        assert await store.read(stream) == expected[stream]
    assert [info.head for info in await store.streams("gc")] == [10] * 20
    assert await store.stream_info(stale_stream) is None
    if store_kind.name == "sqlite":
        assert store._lane.batches - batches_before < len(tickets)  # group commit: fewer transactions than appends


async def test_a_duplicate_command_submitted_together_lands_once(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    content = envs(stream, 1, 2)
    # A retry racing its original: both queued before either committed, plus an impostor and a neighbour.
    original = store.submit(make_batch(lease, stream, content, command_id="cmd"))
    retry = store.submit(make_batch(lease, stream, shifted(content, 0, recorded_by=1.0), command_id="cmd"))
    impostor = store.submit(make_batch(lease, stream, envs(stream, 1, 2, base=40), command_id="cmd"))
    neighbour = store.submit(make_batch(lease, stream, envs(stream, 3, 1)))
    with trio.fail_after(10):
        assert await original.wait() == AppendResult(stream, 1, 2)
        assert await retry.wait() == AppendResult(stream, 1, 2, replayed=True)
        with pytest.raises(CommandConflictError):
            await impostor.wait()
        assert await neighbour.wait() == AppendResult(stream, 3, 3)
    assert await store.read(stream) == content + envs(stream, 3, 1)
    assert await store.commands(stream) == [CommandRecord(stream, "cmd", command_digest(content), 1, 2)]


ODD_CHARACTERS = {"lone_surrogate": "\ud800", "nul": "\x00"}


@pytest.mark.parametrize("odd", list(ODD_CHARACTERS))
async def test_ids_no_store_can_keep_are_refused_at_the_door(store: Any, odd: str) -> None:
    bad = f"x{ODD_CHARACTERS[odd]}y"
    lease = await lease_on(store, "door")
    stream = stream_id_for("door", "root")
    for session, stream_id, command in ((bad, stream, None), ("door", bad, None), ("door", stream, bad)):
        with pytest.raises(ConfigError):
            AppendBatch(
                session, stream_id, lease.token, envs(stream_id, 1, 1), command, None if command is None else "d"
            )
    with pytest.raises(ConfigError, match="session id"):
        await store.acquire_lease(bad, "A", LONG_TTL)
    with pytest.raises(ConfigError, match="owner"):
        await store.acquire_lease("door", bad, LONG_TTL)
    for forged in (attrs.evolve(lease, session_id=bad), attrs.evolve(lease, owner=bad)):
        with pytest.raises(ConfigError):
            await store.renew_lease(forged, LONG_TTL)
        with pytest.raises(ConfigError):
            await store.release_lease(forged)
    assert await store.current_lease("door") == lease  # nothing reached the store


def _id_of(size: int, rng: random.Random) -> str:
    """*size* UTF-8 bytes of random four-byte characters (nothing a database could compress)."""
    assert size % 4 == 0
    return "".join(chr(rng.randrange(0x10000, 0x10FFFF)) for _ in range(size // 4))


async def test_ids_longer_than_every_store_keeps_are_refused_at_the_door_and_the_longest_are_kept(
    store: Any,
) -> None:
    """`check_id` caps ids in UTF-8 bytes, for every store alike: PostgreSQL cannot index a longer
    one, and there such an id failed its whole group commit (every neighbour's journal fenced)."""
    from trio_agent._journal._store import MAX_ID_BYTES

    rng = random.Random(7)
    too_long = _id_of(MAX_ID_BYTES + 4, rng)  # 301 characters: counted in bytes, not characters
    lease = await lease_on(store, "door")
    stream = stream_id_for("door", "root")
    for session, stream_id, command in ((too_long, stream, None), ("door", too_long, None), ("door", stream, too_long)):
        with pytest.raises(ConfigError, match=f"at most {MAX_ID_BYTES} bytes"):
            AppendBatch(
                session, stream_id, lease.token, envs(stream_id, 1, 1), command, None if command is None else "d"
            )
    with pytest.raises(ConfigError, match="session id"):
        await store.acquire_lease(too_long, "A", LONG_TTL)
    with pytest.raises(ConfigError, match="owner"):
        await store.acquire_lease("door", too_long, LONG_TTL)
    assert await store.current_lease("door") == lease  # nothing reached the store

    # The longest ids it accepts are kept, two of them in one index entry too (stream and command).
    session = _id_of(MAX_ID_BYTES - 8, rng)
    longest = await lease_on(store, session, owner=_id_of(MAX_ID_BYTES, rng))
    long_stream = session + "/" + "a" * 7
    command = _id_of(MAX_ID_BYTES, rng)
    events = envs(long_stream, 1, 2)
    appended = await store.append(
        AppendBatch(session, long_stream, longest.token, events, command, command_digest(events), longest.owner)
    )
    assert appended == AppendResult(long_stream, 1, 2)
    assert await store.read(long_stream) == events
    assert await store.command(long_stream, command) == CommandRecord(
        long_stream, command, command_digest(events), 1, 2
    )
    assert (await store.renew_lease(longest, LONG_TTL)).token == longest.token


@pytest.mark.parametrize("odd", list(ODD_CHARACTERS))
async def test_an_append_the_store_cannot_keep_fails_alone(
    store: Any, store_kind: Backend, monkeypatch: pytest.MonkeyPatch, odd: str
) -> None:
    """Past the door (as if it were missing), the writer still refuses such an append alone."""
    import trio_agent._journal._store as store_module

    monkeypatch.setattr(store_module, "check_id", lambda value, what: value, raising=False)
    lease = await lease_on(store, "odd")
    odd_stream = stream_id_for("odd", f"agent{ODD_CHARACTERS[odd]}x")
    good_streams = [stream_id_for("odd", f"agent-{i:02}") for i in range(20)]
    odd_batch: AppendBatch | None = make_batch(lease, odd_stream, envs(odd_stream, 1, 2))

    tickets = []
    odd_ticket: AppendTicket | None = None
    for index, stream in enumerate(good_streams):
        tickets.append(store.submit(make_batch(lease, stream, envs(stream, 1, 1))))
        if index == 9 and odd_batch is not None:
            odd_ticket = store.submit(odd_batch)

    with trio.fail_after(10):
        results = [await ticket.wait() for ticket in tickets]
        outcome: AppendResult | JournalError | None = None
        if odd_ticket is not None:
            try:
                outcome = await odd_ticket.wait()
            except JournalError as exc:
                outcome = exc
    assert results == [AppendResult(stream, 1, 1) for stream in good_streams]  # the neighbours never suffer
    for stream in good_streams:
        assert await store.read(stream) == envs(stream, 1, 1)
    if isinstance(outcome, AppendResult):
        assert outcome == AppendResult(odd_stream, 1, 2)
        assert await store.read(odd_stream) == envs(odd_stream, 1, 2)
    else:
        # A store may refuse such an id, but definitely: "outcome unknown" would fence the journal for nothing.
        assert not isinstance(outcome, JournalUnavailableError), outcome


@pytest.mark.parametrize("odd", list(ODD_CHARACTERS))
async def test_reads_with_an_odd_id_answer_or_raise_journal_errors(
    store: Any, store_kind: Backend, request: pytest.FixtureRequest, odd: str
) -> None:
    odd_id = f"odd{ODD_CHARACTERS[odd]}id"
    calls: list[tuple[Callable[[], Any], Any]] = [
        (lambda: store.read(odd_id), []),
        (lambda: store.head(odd_id), 0),
        (lambda: store.stream_info(odd_id), None),
        (lambda: store.command(odd_id, "c"), None),
        (lambda: store.command("s/root", odd_id), None),
        (lambda: store.commands(odd_id), []),
        (lambda: store.streams(odd_id), []),
        (lambda: store.current_lease(odd_id), None),
    ]
    for call, empty in calls:
        try:
            answer = await call()
        except JournalError:
            continue
        assert answer == empty


class _GateClock:
    """A store clock that, once armed, holds the writer thread inside its next transaction until
    `open` (the clock is read after the write lock is taken), so everything submitted meanwhile
    is committed together in the next group commit."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._armed = threading.Event()
        self._gate = threading.Event()
        self.entered = trio.Event()

    def __call__(self) -> float:
        if self._armed.is_set():
            self._armed.clear()
            self._token.run_sync_soon(self.entered.set)
            self._gate.wait(30)
        return time.time()

    def arm(self) -> None:
        self._armed.set()

    def open(self) -> None:
        self._gate.set()


@contextlib.asynccontextmanager
async def _gated_store(kind: Backend, tmp_path: Path, clock: _GateClock) -> AsyncIterator[Any]:
    if kind.name == "sqlite":
        async with open_sqlite_store(tmp_path / "journal.db", clock=clock) as sqlite_store:
            yield sqlite_store
    else:
        from trio_agent._journal._postgres import open_postgres_store

        async with open_postgres_store(kind.dsn, schema=kind.schema, clock=clock) as pg_store:
            yield pg_store


@pytest.mark.parametrize("door", ["checked", "bypassed"])
async def test_a_bad_lease_request_fails_alone_in_its_group_commit(
    store_kind: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, door: str
) -> None:
    """A lease request with a lone surrogate, queued among other sessions' appends, fails alone:
    at the door (`ConfigError`), and, past it, in the writer (a definite refusal, never
    `JournalUnavailableError` for the batch, which would fence every neighbour's journal)."""
    if store_kind.name == "memory":
        pytest.skip("the memory store has no group commit")
    if door == "bypassed":
        import trio_agent._journal._lane as lane_module

        monkeypatch.setattr(lane_module, "check_id", lambda value, what: value, raising=False)
    clock = _GateClock()
    async with _gated_store(store_kind, tmp_path, clock) as store:
        leases = [await store.acquire_lease(f"s{i}", "A", LONG_TTL) for i in range(10)]
        streams = [stream_id_for(f"s{i}", "root") for i in range(10)]
        clock.arm()
        plug = store.submit(make_batch(leases[0], streams[0], envs(streams[0], 1, 1)))
        with trio.fail_after(10):
            await clock.entered.wait()  # the writer is inside the plug's transaction
        batches = store._lane.batches
        outcomes: list[object] = []

        async def bad_request() -> None:
            try:
                outcomes.append(await store.acquire_lease("bad\ud800id", "A", LONG_TTL))
            except Exception as exc:
                outcomes.append(exc)

        tickets = [
            store.submit(make_batch(lease, s, envs(s, 1, 1)))
            for lease, s in zip(leases[1:5], streams[1:5], strict=True)
        ]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(bad_request)
            await trio.testing.wait_all_tasks_blocked()  # queued (or refused at the door)
            tickets += [
                store.submit(make_batch(lease, s, envs(s, 1, 1)))
                for lease, s in zip(leases[5:], streams[5:], strict=True)
            ]
            clock.open()
        with trio.fail_after(10):
            assert await plug.wait() == AppendResult(streams[0], 1, 1)
            results = [await ticket.wait() for ticket in tickets]
        assert results == [AppendResult(s, 1, 1) for s in streams[1:]]
        for s in streams:
            assert await store.read(s) == envs(s, 1, 1)
        [outcome] = outcomes
        if door == "checked":
            assert isinstance(outcome, ConfigError), outcome
        else:
            assert isinstance(outcome, JournalError) and not isinstance(outcome, JournalUnavailableError), outcome
            if store_kind.name == "sqlite":
                # It really shared one writer batch with the appends (plus the plug's, still running then).
                assert store._lane.batches - batches == 2


async def test_an_acquisition_cancelled_before_it_is_queued_takes_nothing(store: Any) -> None:
    """A caller whose deadline passed already (`open_journal` under ``move_on_after(0)``) queued
    its acquisition all the same: nobody held the lease it got, and the session stayed locked
    against everyone, this process too, for the whole TTL."""
    from trio_agent._journal._durable import open_journal

    with trio.CancelScope() as scope:
        scope.cancel()
        await store.acquire_lease("s1", "A", LONG_TTL)
    assert scope.cancelled_caught
    with trio.move_on_after(0) as scope:
        async with open_journal(store, session_id="s2", lease_ttl=LONG_TTL):
            pass
    assert scope.cancelled_caught
    assert await store.current_lease("s1") is None
    left = await store.current_lease("s2")  # none, or released (a store that takes it without waiting)
    assert left is None or left.expires_at == -math.inf
    for session_id in ("s1", "s2"):
        assert (await store.acquire_lease(session_id, "B", LONG_TTL)).owner == "B"  # at once


async def test_an_acquisition_cancelled_while_queued_gives_its_lease_back(store_kind: Backend, tmp_path: Path) -> None:
    """Queued lane work is never cancelled, so the lease is granted after its caller was
    cancelled: the caller waits for the grant and releases it before the cancellation goes on,
    never leaving it to its TTL."""
    if store_kind.name == "memory":
        pytest.skip("the memory store takes a lease without queueing it")
    clock = _GateClock()
    async with _gated_store(store_kind, tmp_path, clock) as store:
        other = await store.acquire_lease("other", "A", LONG_TTL)
        clock.arm()
        plug = store.submit_renew(other, LONG_TTL)
        with trio.fail_after(10):
            await clock.entered.wait()  # the writer is inside the plug's transaction
        scope = trio.CancelScope()

        async def acquire() -> None:
            with scope:
                await store.acquire_lease("s1", "A", LONG_TTL)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(acquire)
                await trio.testing.wait_all_tasks_blocked()  # queued behind the plug
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()  # cancelled, it waits for its grant
                assert not plug.done
                clock.open()
            assert scope.cancelled_caught
            # Back once its lease was granted and released: free now, for the next owner.
            left = await store.current_lease("s1")
            assert left is not None and (left.owner, left.token) == ("A", 1) and left.expires_at < time.time()
            taken = await store.acquire_lease("s1", "B", LONG_TTL)
        assert (taken.owner, taken.token) == ("B", 2)  # granted to A, given back, taken by B


async def test_a_cancelled_acquisition_whose_grant_outlasts_cleanup_grace_gives_it_back_when_it_comes(
    store_kind: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The wait for the grant is bounded by the store's ``cleanup_grace``: past it the caller goes
    on, and the lease is released when it is granted (the release follows it in the lane)."""
    if store_kind.name == "memory":
        pytest.skip("the memory store takes a lease without queueing it")
    clock = _GateClock()
    async with _gated_store(store_kind, tmp_path, clock) as store:
        other = await store.acquire_lease("other", "A", LONG_TTL)
        clock.arm()
        plug = store.submit_renew(other, LONG_TTL)
        with trio.fail_after(10):
            await clock.entered.wait()  # the writer is inside the plug's transaction
        grace, store.cleanup_grace = store.cleanup_grace, 0.01  # the gate stays shut past it
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.acquire_lease, "s1", "A", LONG_TTL)
                await trio.testing.wait_all_tasks_blocked()  # queued behind the plug
                nursery.cancel_scope.cancel()
        finally:
            store.cleanup_grace = grace
        assert not plug.done  # the caller went on before its lease was granted
        assert any("the lease of a cancelled acquisition" in r.getMessage() for r in caplog.records)
        clock.open()
        with trio.fail_after(10):
            await plug.wait()
            # Its answer (granted) came before this renewal's, so the release is queued by now.
            await store.renew_lease(other, LONG_TTL)
            taken = await store.acquire_lease("s1", "B", LONG_TTL)
        assert (taken.owner, taken.token) == ("B", 2)  # granted to A, given back, taken by B


async def test_an_acquisition_cancelled_while_queued_releases_its_lease_before_the_store_closes(
    store_kind: Backend, tmp_path: Path
) -> None:
    """The release was queued only when the grant came, after the cancelled caller had gone on: a
    caller that closed the store meanwhile (a deadline around the store's block and the journal
    opened in it) found the lane closed, so the lease stayed granted to nobody for its whole TTL.
    The cancelled acquisition now waits for its grant (shielded, ``cleanup_grace`` at most) and
    releases it before the cancellation goes on."""
    if store_kind.name == "memory":
        pytest.skip("the memory store takes a lease without queueing it")
    clock = _GateClock()
    scope = trio.CancelScope()
    queued = trio.Event()

    async def cancel_then_open_the_gate() -> None:
        await queued.wait()
        await trio.testing.wait_all_tasks_blocked()  # the acquisition waits behind the plug
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()  # the caller waits for its grant (or the close)
        clock.open()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_then_open_the_gate)
            with scope:
                async with _gated_store(store_kind, tmp_path, clock) as store:
                    other = await store.acquire_lease("other", "A", LONG_TTL)
                    clock.arm()
                    store.submit_renew(other, LONG_TTL)  # holds the writer until the gate opens
                    await clock.entered.wait()
                    queued.set()
                    await store.acquire_lease("s1", "A", LONG_TTL)
            assert scope.cancelled_caught
        async with _gated_store(store_kind, tmp_path, _GateClock()) as store:
            taken = await store.acquire_lease("s1", "B", LONG_TTL)  # at once: no LeaseHeldError
    assert (taken.owner, taken.token) == ("B", 2)  # granted to A, released, taken by B


async def test_ticket_outcome_before_resolution_and_after_cancelled_wait(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    first = envs(stream, 1, 2)
    ticket = store.submit(make_batch(lease, stream, first))
    if not ticket.done:
        with pytest.raises(JournalError):
            ticket.outcome()

    # The waiter gives up at once; the submitted write still happens, in order.
    with trio.move_on_after(0) as scope:
        await ticket.wait()
    assert scope.cancelled_caught
    with trio.fail_after(10):
        assert await store.append(make_batch(lease, stream, envs(stream, 3, 1))) == AppendResult(stream, 3, 3)
        assert await ticket.wait() == AppendResult(stream, 1, 2)
    assert await store.read(stream) == first + envs(stream, 3, 1)


async def test_concurrent_appends_to_separate_streams(store: Any) -> None:
    leases = {session: await lease_on(store, session) for session in ("c1", "c2")}
    written: dict[str, list[EventEnvelope]] = {}

    async def writer(index: int) -> None:
        session = "c1" if index % 2 else "c2"
        stream = stream_id_for(session, f"agent-{index:02}")
        events = envs(stream, 1, 15, base=index * 100)
        seq = 0
        for size in (1, 3, 1, 2, 5, 1, 2):
            chunk = events[seq : seq + size]
            assert await store.append(make_batch(leases[session], stream, chunk)) == AppendResult(
                stream, seq + 1, seq + size
            )
            seq += size
        written[stream] = events

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for index in range(12):
                nursery.start_soon(writer, index)

    assert len(written) == 12
    for stream, events in written.items():
        assert await store.head(stream) == 15
        assert await store.read(stream) == events
    assert len(await store.streams("c1")) == 6
    assert len(await store.streams("c2")) == 6


async def test_racing_writers_on_one_stream_stay_gapless(store: Any) -> None:
    lease = await lease_on(store, "race")
    stream = stream_id_for("race", "root")
    writers, each = 6, 6
    conflicts = 0

    async def writer(index: int) -> None:
        nonlocal conflicts
        written = 0
        while written < each:
            head = await store.head(stream)
            await trio.lowlevel.checkpoint()  # work between reading the head and appending: others get in
            event = RequestStarted(request_id=f"w{index}-{written}")
            try:
                result = await store.append(make_batch(lease, stream, [one(stream, head + 1, event)]))
            except SequenceConflictError:
                conflicts += 1
                continue
            assert result == AppendResult(stream, head + 1, head + 1)
            written += 1

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for index in range(writers):
                nursery.start_soon(writer, index)

    back = await store.read(stream)
    assert [e.seq for e in back] == list(range(1, writers * each + 1))
    ids = sorted(e.event.request_id for e in back if isinstance(e.event, RequestStarted))
    assert ids == sorted(f"w{i}-{k}" for i in range(writers) for k in range(each))
    assert conflicts > 0  # the writers did race (they all read head 0 first)
    assert await store.head(stream) == writers * each


# ================================================================ conformance: a damaged row


def _damage_row(store_kind: Backend, store: Any, tmp_path: Path, stream: str, seq: int, moved: EventEnvelope) -> None:
    """Damage row *seq* of *stream* the way each store can be damaged: a memory row out of place,
    a database row's body edited behind the store's back (its checksum no longer matches)."""
    if store_kind.name == "memory":
        store._streams[stream].rows[seq - 1] = moved
    elif store_kind.name == "sqlite":
        statement = "UPDATE journal_events SET body = replace(body, 'r', 'R') WHERE stream_id=? AND seq=?"
        _sqlite_write(tmp_path / "journal.db", statement, (stream, seq))
    else:
        import psycopg

        table = f'"{store_kind.schema}".events'
        with psycopg.connect(store_kind.dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {table} SET body = replace(body, 'r', 'R') WHERE seq = %s".encode(), (seq,))


async def test_a_damaged_row_hides_no_event_before_it(store_kind: Backend, store: Any, tmp_path: Path) -> None:
    from trio_agent._workers._results import wait_for_request  # lazily: it needs psycopg

    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    written = [
        one(stream, 1, RequestAccepted(request_id="r1", command_id="c1", input={"prompt": "x"})),
        one(stream, 2, RequestStarted(request_id="r1")),
        one(stream, 3, RequestCompleted(request_id="r1", output={"text": "answer"})),
        one(stream, 4, RequestAccepted(request_id="r2", command_id="c2", input={"prompt": "y"})),
        one(stream, 5, RequestAccepted(request_id="r3", command_id="c3", input={"prompt": "z"})),
    ]
    await store.append(make_batch(lease, stream, written))
    _damage_row(store_kind, store, tmp_path, stream, 5, written[3])
    # A read fails at the damaged row and says what it decoded before it.
    with pytest.raises(JournalCorruptError, match=f"{stream}#5") as failed:
        await store.read(stream)
    assert failed.value.intact == tuple(written[:4])
    # A subscription (one page holds the whole stream) delivers up to the damage, then raises for it.
    delivered: list[int] = []
    with trio.fail_after(10), pytest.raises(JournalCorruptError, match=f"{stream}#5"):
        async with subscribe_durable_events(store, stream) as sub:
            async for item in sub:
                if isinstance(item, DurableEvent):
                    delivered.append(item.envelope.seq)
    assert delivered == [1, 2, 3, 4]
    # A request that ended before the damage is read back.
    with trio.fail_after(10):
        outcome = await wait_for_request(store, "sess", "r1")
    assert (outcome.state, outcome.text, outcome.seq) == ("completed", "answer", 3)


# ================================================================ conformance: wait_for_append


async def test_wait_for_append_wakes_a_waiter_started_before_the_append(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    await store.append(make_batch(lease, stream, envs(stream, 1, 2)))
    seen: list[list[EventEnvelope]] = []

    async def waiter(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        assert await store.head(stream) == 2
        task_status.started()
        while await store.head(stream) <= 2:  # a hint: re-read after every wake-up
            await store.wait_for_append(stream, 2)
        seen.append(await store.read(stream, after=2))

    new = envs(stream, 3, 2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []  # still waiting: nothing was appended yet
            await store.append(make_batch(lease, stream, new))
    assert seen == [new]


async def test_wait_for_append_on_a_stream_that_does_not_exist_yet(store: Any) -> None:
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "later")
    seen: list[int] = []

    async def waiter() -> None:
        while await store.head(stream) == 0:
            await store.wait_for_append(stream, 0)
        seen.append(await store.head(stream))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []
            await store.append(make_batch(lease, stream, envs(stream, 1, 3)))
    assert seen == [3]


async def test_wait_for_append_returns_when_the_stream_is_already_past(store: Any) -> None:
    # An append committed between a caller's read and its wait woke no one (nobody waited yet):
    # the wait itself must see it. With an hour's poll, the poll is not what returns it (SQLite's
    # wait never looked, and such an append was delivered a whole poll_interval late).
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    await store.append(make_batch(lease, stream, envs(stream, 1, 2)))
    if hasattr(store, "poll_interval"):
        store.poll_interval = 3600.0
    with trio.fail_after(5):
        await store.wait_for_append(stream, 1)
        await store.wait_for_append(stream, 0)


async def test_abandoned_waits_leave_no_wake_up_behind(store_kind: Backend, store: Any) -> None:
    """Waits on streams that never get another append (timed out, cancelled at their await) drop
    their wake-up when the last waiter leaves; one waiter leaving does not cost another its wake-up."""
    if store_kind.name == "memory":
        pytest.skip("the memory store has no poll and no _changed (test_memory_waits_...)")
    lease = await lease_on(store, "sess")
    stream = stream_id_for("sess", "root")
    await store.append(make_batch(lease, stream, envs(stream, 1, 1)))
    store.poll_interval = 0.01  # the fallback poll runs under the waits that time out
    with trio.fail_after(10):
        for index in range(50):
            with trio.move_on_after(0.02):  # a poll that finds nothing never returns a wait: it times out
                await store.wait_for_append(stream_id_for(f"never-{index}", "root"), 0)
            with trio.move_on_after(0):  # cancelled at its first checkpoint
                await store.wait_for_append(stream_id_for(f"gone-{index}", "root"), 0)
    assert len(store._changed) == 0
    store.poll_interval = 3600.0  # from now on only an append wakes a waiter
    woken: list[str] = []

    async def waiter(name: str, scope: trio.CancelScope) -> None:
        with scope:
            await store.wait_for_append(stream, 1)
            woken.append(name)

    stays, leaves = trio.CancelScope(), trio.CancelScope()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, "stays", stays)
            nursery.start_soon(waiter, "leaves", leaves)
            await trio.testing.wait_all_tasks_blocked()
            assert len(store._changed) == 1  # one wake-up, shared
            leaves.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert len(store._changed) == 1  # still wanted by the other
            await store.append(make_batch(lease, stream, envs(stream, 2, 1)))
    assert woken == ["stays"]
    assert len(store._changed) == 0


# ================================================================ bad input (store-independent)


def test_append_batch_refuses_malformed_appends() -> None:
    stream = "s/a"
    with pytest.raises(JournalError, match="at least one"):
        AppendBatch("s", stream, 1, [])
    for seqs in ((1, 3), (2, 1), (1, 1), (1, 2, 4)):
        with pytest.raises(JournalError, match="consecutive"):
            AppendBatch("s", stream, 1, [one(stream, seq, RequestStarted(request_id="r")) for seq in seqs])
    with pytest.raises(JournalError, match="s/b"):
        AppendBatch(
            "s",
            stream,
            1,
            [one(stream, 1, RequestStarted(request_id="r")), one("s/b", 2, RequestStarted(request_id="r"))],
        )
    with pytest.raises(JournalError, match="s/b"):
        AppendBatch("s", stream, 1, envs("s/b", 1, 1))
    with pytest.raises(JournalError, match="together"):
        AppendBatch("s", stream, 1, envs(stream, 1, 1), command_id="c")
    with pytest.raises(JournalError, match="together"):
        AppendBatch("s", stream, 1, envs(stream, 1, 1), command_digest="d")
    ok = AppendBatch("s", stream, 1, envs(stream, 4, 3))
    assert (ok.first_seq, ok.last_seq, len(ok.bodies)) == (4, 6, 3)


def test_command_digest_ignores_position_and_time_only() -> None:
    base = envs("s/a", 1, 3)
    assert command_digest(base) == command_digest(shifted(base, 10, recorded_by=5.0))
    assert command_digest(base) == command_digest([attrs.evolve(e, stream_id="s/b") for e in base])
    assert command_digest(base) != command_digest(base[:2])
    assert command_digest(base) != command_digest(list(reversed(shifted(base, 0))))
    assert command_digest(base) != command_digest(envs("s/a", 1, 3, base=1))


# ================================================================ memory only: leases on the mock clock


async def test_memory_lease_expiry_follows_the_injected_clock(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    stream = stream_id_for("sess", "root")
    lease = await store.acquire_lease("sess", "A", 10.0)
    assert lease.expires_at == trio.current_time() + 10.0
    await store.append(make_batch(lease, stream, envs(stream, 1, 1)))

    await trio.sleep(6)
    renewed = await store.renew_lease(lease, 10.0)
    assert renewed.expires_at == trio.current_time() + 10.0
    await trio.sleep(6)  # past the first expiry, inside the renewal
    await store.append(make_batch(lease, stream, envs(stream, 2, 1)))
    with pytest.raises(LeaseHeldError) as info:
        await store.acquire_lease("sess", "B", 10.0)
    assert (info.value.owner, info.value.expires_at) == ("A", renewed.expires_at)

    await trio.sleep(4.5)  # now past the renewal as well
    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(lease, stream, envs(stream, 3, 1)))
    with pytest.raises(LeaseLostError):
        await store.renew_lease(renewed, 10.0)
    taken = await store.acquire_lease("sess", "B", 10.0)
    assert taken.token == lease.token + 1
    assert taken.expires_at == trio.current_time() + 10.0
    await store.release_lease(lease)
    assert await store.current_lease("sess") == taken
    assert await store.head(stream) == 2


async def test_memory_a_long_pause_fences_the_paused_writer(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    stream = stream_id_for("sess", "root")
    paused = await store.acquire_lease("sess", "A", 30.0)
    await store.append(make_batch(paused, stream, envs(stream, 1, 1)))
    await trio.sleep(3600)  # a "GC pause" of an hour on the mock clock
    successor = await store.acquire_lease("sess", "B", 30.0)
    await store.append(make_batch(successor, stream, envs(stream, 2, 1)))
    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(paused, stream, envs(stream, 3, 1)))
    # Even if the successor's lease lapses too, the paused writer's older token never becomes valid again.
    await trio.sleep(3600)
    with pytest.raises(StaleFencingTokenError):
        await store.append(make_batch(paused, stream, envs(stream, 3, 1)))
    with pytest.raises(LeaseLostError):
        await store.renew_lease(paused, 30.0)
    assert await store.head(stream) == 2


async def test_memory_wait_for_append_blocks_until_the_append(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    lease = await store.acquire_lease("sess", "A", 1e6)
    stream = stream_id_for("sess", "root")
    await store.append(make_batch(lease, stream, envs(stream, 1, 1)))
    woke: list[float] = []

    async def waiter() -> None:
        await store.wait_for_append(stream, 1)  # one call, no loop: the memory store's wake-up is exact
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(3600)  # an hour of mock time: the waiter must still be waiting
        assert woke == []
        appended_at = trio.current_time()
        await store.append(make_batch(lease, stream, envs(stream, 2, 1)))
    assert woke == [appended_at]


async def test_memory_corrupt_row_is_reported_with_stream_and_seq() -> None:
    store = MemoryStore()
    lease = await store.acquire_lease("sess", "A", LONG_TTL)
    stream = stream_id_for("sess", "root")
    events = envs(stream, 1, 4)
    await store.append(make_batch(lease, stream, events))
    # The memory store keeps the event objects: a row out of place is what corruption looks like there.
    store._streams[stream].rows[2] = events[3]
    with pytest.raises(JournalCorruptError, match=f"{stream}#3"):
        await store.read(stream)
    assert await store.read(stream, limit=2) == events[:2]


# ================================================================ SQLite only


def _sqlite_write(path: Path, statement: str, parameters: Sequence[Any] = ()) -> None:
    """Change the file behind the store's back (another process, a bad disk)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(statement, parameters)
        conn.commit()


def _sqlite_body(path: Path, stream: str, seq: int) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        body: str = conn.execute(
            "SELECT body FROM journal_events WHERE stream_id=? AND seq=?", (stream, seq)
        ).fetchone()[0]
        return body


def _json_mutation(change: Callable[[dict[str, Any]], object]) -> Callable[[str], str]:
    def mutate(body: str) -> str:
        data = json.loads(body)
        change(data)
        return json.dumps(data)

    return mutate


ROW_TAMPERING: dict[str, Callable[[str], str]] = {
    "unknown_event_field": _json_mutation(lambda d: d["event"].update(surprise=1)),
    "unknown_envelope_field": _json_mutation(lambda d: d.update(extra=True)),
    "schema_version_99": _json_mutation(lambda d: d.update(schema_version=99)),
    "unknown_event_type": _json_mutation(lambda d: d["event"].update(type="tool_exploded")),
    "missing_id": _json_mutation(lambda d: d["event"].pop("request_id")),
    "claims_other_seq": _json_mutation(lambda d: d.update(seq=7)),
    "claims_other_stream": _json_mutation(lambda d: d.update(stream_id="sess/elsewhere")),
    "not_json": lambda body: body[: len(body) // 2],
    "json_array": lambda body: "[1, 2, 3]",
    "empty": lambda body: "",
}


@pytest.mark.parametrize("tamper", list(ROW_TAMPERING), ids=list(ROW_TAMPERING))
async def test_sqlite_tampered_row_is_reported_never_skipped(tmp_path: Path, tamper: str) -> None:
    path = tmp_path / "journal.db"
    stream = stream_id_for("sess", "root")
    events = envs(stream, 1, 5)
    async with open_sqlite_store(path) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(make_batch(lease, stream, events))
        bad = ROW_TAMPERING[tamper](_sqlite_body(path, stream, 3))
        _sqlite_write(path, "UPDATE journal_events SET body=? WHERE stream_id=? AND seq=3", (bad, stream))

        for after, limit in ((0, None), (2, None), (2, 1), (0, 3)):
            with pytest.raises(JournalCorruptError) as info:
                await store.read(stream, after=after, limit=limit)
            assert f"{stream}#3" in str(info.value)
        # The rows around it are sound and still readable.
        assert await store.read(stream, limit=2) == events[:2]
        assert await store.read(stream, after=3) == events[3:]

    # Still refused after reopening: nothing repaired or dropped it silently.
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match=f"{stream}#3"):
            await store.read(stream)


async def test_sqlite_a_missing_row_is_reported_never_skipped(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    stream = stream_id_for("sess", "root")
    async with open_sqlite_store(path) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        await store.append(make_batch(lease, stream, envs(stream, 1, 5)))
        _sqlite_write(path, "DELETE FROM journal_events WHERE stream_id=? AND seq=3", (stream,))
        assert await store.head(stream) == 5
        for after, limit in ((0, None), (2, None), (2, 1)):
            with pytest.raises(JournalCorruptError) as info:
                await store.read(stream, after=after, limit=limit)
            assert stream in str(info.value)
            assert "3" in str(info.value).replace(stream, "")


def _random_file(path: Path) -> None:
    path.write_bytes(random.Random(1234).randbytes(64 * 1024))


async def test_sqlite_file_of_random_bytes_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    _random_file(path)
    with pytest.raises(JournalCorruptError):
        async with open_sqlite_store(path):
            pass


async def _journal_file(path: Path) -> None:
    async with open_sqlite_store(path) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        stream = stream_id_for("sess", "root")
        for first in range(1, 200, 20):
            await store.append(make_batch(lease, stream, envs(stream, first, 20)))


def _truncate(path: Path, keep: Callable[[int], int]) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


@pytest.mark.parametrize(
    "keep",
    [lambda size: size // 2 + 100, lambda size: size // 2, lambda size: 4096, lambda size: 50],
    ids=["half_plus_100", "half", "first_page", "50_bytes"],
)
async def test_sqlite_truncated_database_is_corrupt(tmp_path: Path, keep: Callable[[int], int]) -> None:
    path = tmp_path / "journal.db"
    await _journal_file(path)
    assert not (tmp_path / "journal.db-wal").exists() or (tmp_path / "journal.db-wal").stat().st_size == 0
    _truncate(path, keep)
    with pytest.raises(JournalCorruptError):
        async with open_sqlite_store(path):
            pass


async def test_sqlite_file_with_another_format_marker_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with open_sqlite_store(path):
        pass
    _sqlite_write(path, "UPDATE journal_meta SET value='trio_agent.journal/99' WHERE key='format'")
    with pytest.raises(JournalCorruptError, match="journal/99"):
        async with open_sqlite_store(path):
            pass
    # Refusing did not rewrite the marker.
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT value FROM journal_meta WHERE key='format'").fetchone() == (
            "trio_agent.journal/99",
        )


async def test_sqlite_writer_uses_wal_with_full_sync(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "journal.db") as store:
        assert store._writer is not None
        assert store._writer.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store._writer.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


async def test_sqlite_everything_acknowledged_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    streams = [stream_id_for("sess", f"agent-{i}") for i in range(5)]
    expected = {stream: envs(stream, 1, 8, base=i * 10) for i, stream in enumerate(streams)}
    async with open_sqlite_store(path) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        tickets = [
            store.submit(make_batch(lease, stream, expected[stream][k : k + 2], command_id=f"cmd-{k}"))
            for k in range(0, 8, 2)
            for stream in streams
        ]
        with trio.fail_after(10):
            for ticket in tickets:
                await ticket.wait()
        streams_before = await store.streams()
        commands_before = {stream: await store.commands(stream) for stream in streams}
        lease_before = await store.current_lease("sess")

    async with open_sqlite_store(path) as store:
        assert await store.streams() == streams_before
        assert [info.head for info in streams_before] == [8] * 5
        for stream in streams:
            assert await store.read(stream) == expected[stream]
            assert await store.commands(stream) == commands_before[stream]
            assert len(commands_before[stream]) == 4
        assert await store.current_lease("sess") == lease_before
        # The fence survived too: the old token still works until a takeover, then never again.
        await store.append(make_batch(lease, streams[0], envs(streams[0], 9, 1)))
        await store.release_lease(lease)
        successor = await store.acquire_lease("sess", "B", LONG_TTL)
        assert successor.token > lease.token
        with pytest.raises(StaleFencingTokenError):
            await store.append(make_batch(lease, streams[0], envs(streams[0], 10, 1)))


async def test_sqlite_two_stores_on_one_file_share_data_and_fence(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    stream = stream_id_for("sess", "root")
    async with open_sqlite_store(path) as first, open_sqlite_store(path) as second:
        old = await first.acquire_lease("sess", "A", LONG_TTL)
        events = envs(stream, 1, 3)
        await first.append(make_batch(old, stream, events))
        assert await second.read(stream) == events  # acknowledged means committed, visible to every reader
        with pytest.raises(LeaseHeldError):
            await second.acquire_lease("sess", "B", LONG_TTL)
        await first.release_lease(old)
        new = await second.acquire_lease("sess", "B", LONG_TTL)
        assert new.token > old.token
        with pytest.raises(StaleFencingTokenError):
            await first.append(make_batch(old, stream, envs(stream, 4, 1)))
        await second.append(make_batch(new, stream, envs(stream, 4, 1)))
        with pytest.raises(SequenceConflictError):
            await first.append(AppendBatch("sess", stream, new.token, envs(stream, 4, 1, base=9)))
        assert await first.read(stream) == events + envs(stream, 4, 1)


async def test_sqlite_wait_for_append_is_woken_in_process_not_by_polling(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "journal.db", poll_interval=3600) as store:
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        stream = stream_id_for("sess", "root")
        await store.append(make_batch(lease, stream, envs(stream, 1, 1)))
        woke: list[int] = []

        async def waiter() -> None:
            await store.wait_for_append(stream, 1)  # one call: with an hour's poll, only the wake-up returns it
            woke.append(await store.head(stream))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
                assert woke == []
                await store.append(make_batch(lease, stream, envs(stream, 2, 1)))
        assert woke == [2]


async def test_sqlite_a_damaged_lease_row_is_corrupt_for_every_lease_operation_and_fails_alone(
    tmp_path: Path,
) -> None:
    # A mistyped value was a ValueError the isolated pass reported as a plain JournalError.
    path = tmp_path / "journal.db"
    async with open_sqlite_store(path) as store:
        damaged = await store.acquire_lease("damaged", "A", LONG_TTL)
        neighbour = await store.acquire_lease("neighbour", "A", LONG_TTL)
        _sqlite_write(path, "UPDATE journal_leases SET expires_at='soon' WHERE session_id='damaged'")
        with store.grouped():
            renewed = store.submit_renew(damaged, LONG_TTL)
            released = store.submit_release(damaged)
            renewed_neighbour = store.submit_renew(neighbour, LONG_TTL)
        for item in (renewed, released):
            with pytest.raises(JournalCorruptError, match="lease of session 'damaged' is damaged"):
                await item.wait()
        with pytest.raises(JournalCorruptError, match="lease of session 'damaged' is damaged"):
            await store.acquire_lease("damaged", "B", LONG_TTL)
        assert (await renewed_neighbour.wait()).token == neighbour.token


# ---------------------------------------------------------------- the writer lane


@pytest.mark.parametrize("bad", [None, "100", 0, -1, 2.5, True])
async def test_sqlite_a_bad_max_batch_is_a_config_error_at_open(tmp_path: Path, bad: Any) -> None:
    # It was taken as it was: the writer thread died on its first batch and every waiter hung.
    with pytest.raises(ConfigError, match="max_batch"):
        async with open_sqlite_store(tmp_path / "journal.db", max_batch=bad):
            pass
    assert not (tmp_path / "journal.db").exists()


def _commit_wrong_count(works: Sequence[Any]) -> list[object]:
    return [Deferred("a lock")]  # a backend bug: one outcome for the whole batch


@pytest.mark.parametrize(
    ("injected", "options"),
    [
        ("max_batch=None", {"commit": lambda works: [None] * len(works), "max_batch": None}),
        ("wrong outcome count", {"commit": _commit_wrong_count, "defer_limit": 1.0}),
    ],
)
async def test_a_failure_of_the_writer_thread_answers_every_waiter_and_closes_the_lane(
    injected: str, options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    # The thread died with the batch it had taken and everything queued behind it: every waiter hung for ever.
    lane = WriterLane("test lane", **options)
    items: list[LaneItem[None]] = [LaneItem() for _ in range(4)]
    for work, item in enumerate(items[:2]):  # queued before the thread starts: the first batch takes both
        lane.submit(work, item.resolve)
    with caplog.at_level(logging.ERROR, logger="trio_agent.journal"):
        lane.start()
        with lane.grouped():  # and a group queued behind them
            for work, item in enumerate(items[2:], start=2):
                lane.submit(work, item.resolve)
        with trio.fail_after(10):
            for item in items:
                with pytest.raises(JournalUnavailableError, match="test lane stopped before"):
                    await item.wait()
    assert lane.stopped
    assert any("test lane failed" in record.getMessage() for record in caplog.records), injected
    late: LaneItem[None] = LaneItem()
    lane.submit("late", late.resolve)  # the lane is closed: refused at once, never queued
    with pytest.raises(JournalUnavailableError, match="closed"):
        await late.wait()
    with trio.fail_after(10):
        await lane.aclose()


# ---------------------------------------------------------------- docs/api.md's store listing


def _api_stores_block() -> str:
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    section = text[text.index("### Stores") :]
    return section[section.index("```python") : section.index("\n```\n")]


def _doc_parameters(text: str) -> list[str]:
    """``name`` or ``name=default`` of each parameter in a listed signature (``self``, ``*``: left out)."""
    listed = []
    for parameter in text.split(","):
        declared, _, default = parameter.partition("=")
        name = declared.split(":")[0].strip()
        if name not in ("self", "*", ""):
            listed.append(f"{name}={default.strip()}" if default else name)
    return listed


def _code_parameters(function: Callable[..., Any]) -> list[str]:
    import inspect

    listed = []
    for name, parameter in inspect.signature(function).parameters.items():
        if name == "self":
            continue
        default = parameter.default
        if default is inspect.Parameter.empty:
            listed.append(name)
        elif callable(default):
            listed.append(f"{name}={default.__module__}.{default.__name__}")
        else:
            listed.append(f"{name}={default!r}".replace("'", '"'))
    return listed


def test_api_md_lists_the_store_protocol_and_openers_as_the_code_has_them() -> None:
    # It lacked commands(after=), save_snapshot/load_snapshot, and the openers' cleanup_grace and readonly.
    import re

    from trio_agent._journal import _sqlite
    from trio_agent._journal._store import JournalStore

    block = _api_stores_block()
    documented = dict(re.findall(r"^    (?:async )?def (\w+)\(([^)]*)\)", block, re.M))
    members = sorted(
        name for name in vars(JournalStore) if not name.startswith("_") and callable(vars(JournalStore)[name])
    )
    assert sorted(documented) == members
    for name in members:
        assert _doc_parameters(documented[name]) == _code_parameters(getattr(JournalStore, name)), name
    attributes = set(re.findall(r"^    (\w+): ", block, re.M))
    assert attributes == set(JournalStore.__annotations__)
    openers = {name: " ".join(args.split()) for name, args in re.findall(r"async with (\w+)\(([^)]*)\) as", block)}
    assert _doc_parameters(openers["open_sqlite_store"]) == _code_parameters(_sqlite.open_sqlite_store)
    if _postgres_missing() is None and importlib.util.find_spec("psycopg") is not None:
        from trio_agent._journal import _postgres

        assert _doc_parameters(openers["open_postgres_store"]) == _code_parameters(_postgres.open_postgres_store)
