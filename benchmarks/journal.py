"""Durable journal throughput, side by side with a hand-written raw store doing the same work.

Runs, in one process and interleaved round by round:
  1. durable appends: 1, 10, 100 and 1000 concurrent writers, each a Trio task appending
     single-event batches (no command id) to its own stream under a held lease and awaiting
     every ack (appends/s, ack latency p50/p99), on SQLite (WAL, synchronous=FULL, a temporary
     file on disk, never tmpfs) and on PostgreSQL (a throw-away cluster from tests/pg_cluster.py)
     when the server binaries and `trio_agent.journal.open_postgres_store` are available;
  2. the raw floor: the same appends as a hand-written group-commit loop in one plain thread
     (no Trio, no trio_agent code inside the timed loop), one transaction per batch of the size
     the durable writer achieved at that writer count (its average, rounded). Each batch, timed:
     every event is JSON-encoded (``orjson.dumps``, the store's encoder, of the dict `encode_event`
     gives for the same envelope, built untimed; byte for byte the store's body, which also checks
     that the data is of JSON's own types first) and checksummed (CRC32 over the
     stream id, seq and body, the store's rule), then in one transaction exactly the statements
     the store's writer runs for such a batch:
       SQLite (``sqlite3``, WAL+FULL): ``BEGIN IMMEDIATE``; the batch's lease rows read with
       ``SELECT ... FROM journal_leases WHERE session_id IN (...)`` and its streams' heads with
       ``SELECT ... FROM journal_streams WHERE stream_id IN (...)`` (500 ids a statement), each
       event's lease token and expiry and its seq against the head checked in Python; one
       ``executemany`` INSERT into ``journal_events`` (stream, seq, token, body, checksum), one
       ``executemany`` upsert of the heads into ``journal_streams`` (indexed by session); COMMIT.
       PostgreSQL (``psycopg``, autocommit connection, two pipelines): ``BEGIN``, the lease rows
       locked ``FOR UPDATE`` in session order, ``clock_timestamp()``, the heads; the same checks;
       then the new streams inserted and the others' heads updated (``unnest``), the events
       inserted with one ``unnest`` INSERT, one ``pg_notify`` per stream, ``COMMIT``.
     The tables an append touches (events, streams, leases) are created as the store creates
     them, columns, keys and indexes alike; the lease rows are written before the clock starts
     (the durable run acquires its leases untimed too). The commands table is neither created
     nor written: these appends carry no command id, so the store does not touch it either. The
     durable/raw ratio at every writer count (target: >= 50 % at 100 writers), and the CPU each
     spends per event in this process;
  3. durable tool calls: 100 sessions (one `open_journal` each, one SQLite store), each running
     sequential calls of a trivial tool through ``ToolPipeline(journal=journal)``:
     ``non_idempotent`` (scheduled, started, settled: 3 awaited commits), ``pure`` with durable
     starts (also 3) and ``pure`` with ``durable_pure_starts=False`` (the start is submitted
     without waiting, but the settlement still waits for it); beside the same 100 tasks calling the
     tool function directly; and each journal configuration from one session alone (latency).

Prints a table and, as the last line, one JSON object. ``--short`` runs a quick version;
``--writers 100`` (or ``1,100``...) measures only those writer counts. ``--progress`` (the default
when stderr is a terminal) writes a line per writer count and section to stderr; see ``_progress.py``.
The exit status is 1 when the PostgreSQL rows failed (a broken store is reported, never measured as
skipped); a PostgreSQL that is not there is skipped with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson
import trio
from _progress import add_progress_option, note, start_progress

import trio_agent as ta
from trio_agent.journal import (
    AppendBatch,
    EventEnvelope,
    ToolStarted,
    encode_event,
    open_journal,
    open_sqlite_store,
)
from trio_agent.testing import start_turn

TESTS_DIR = str(Path(__file__).resolve().parent.parent / "tests")  # the throw-away PostgreSQL cluster lives there

WRITERS_FULL = (1, 10, 100, 1000)
WRITERS_SHORT = (1, 10, 100)
# Total events per measurement (split evenly over the writers).
EVENTS_FULL = {1: 2000, 10: 15000, 100: 30000, 1000: 30000}
EVENTS_SHORT = {1: 150, 10: 600, 100: 1500}
TARGET_RATIO_AT_100 = 0.5

SESSIONS_FULL, CALLS_FULL = 100, 60
SESSIONS_SHORT, CALLS_SHORT = 10, 15
SOLO_CALLS_FULL, SOLO_CALLS_SHORT = 300, 30  # the same calls from one session alone: latency, not throughput

# durable-trio.md §2.2 (2-vCPU EPYC VM, ext4 on virtio, fdatasync ~138 us; SQLite 3.40.1, trio 0.35).
REFERENCE_RAW = {1: 5_510, 10: 65_936, 100: 330_748, 1000: 619_362}  # events/s, events per commit = writers
REFERENCE_GROUP = {  # writers: (events/s, avg batch, ack p50 us, ack p99 us)
    1: (4_202, 1, 221, 483),
    10: (34_636, 10, 261, 504),
    100: (111_216, 100, 814, 4_600),
    1000: (103_503, 848, 8_400, 21_700),
}
REFERENCE_PG = "2.8k fenced appends/s autocommit, 7.2k/s per-statement in one transaction (§2.5)"
REFERENCE_TOOLS = "100 agents, FULL: 22k calls/s started durable, 29k calls/s started async (§2.3)"


# -- helpers -----------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def disk_dir() -> tuple[str, str]:
    """A temporary directory on a real disk (tmpfs would hide the fsync) and its filesystem type."""
    for base in (tempfile.gettempdir(), "/var/tmp", str(Path(__file__).resolve().parent)):
        kind = fs_type(base)
        if kind not in ("tmpfs", "ramfs"):
            return tempfile.mkdtemp(prefix="trio-agent-journal-bench-", dir=base), kind
    raise SystemExit("no disk-backed directory for the SQLite files (all candidates are tmpfs)")


def fs_type(path: str) -> str:
    """The filesystem type of ``path`` from /proc/mounts (longest matching mount point)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) < 3:
                continue
            point = parts[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, parts[2]
    return kind


def event_for(stream_id: str, seq: int, now: float) -> EventEnvelope:
    """A realistic ~230-byte event (a tool start with a small input)."""
    started = ToolStarted(
        request_id="request-1",
        turn_id="turn-1",
        call_id=f"call-{seq}",
        input={"path": "src/module.py", "pattern": "def main", "limit": 20},
        side_effect=ta.SideEffect.NON_IDEMPOTENT,
    )
    return EventEnvelope(stream_id=stream_id, seq=seq, event=started, recorded_at=now)


def stream_of(writer: int) -> tuple[str, str]:
    session = f"bench-{writer}"
    return session, f"{session}/root"


FloorEvent = tuple[str, str, int, dict[str, Any]]
"""One event for the raw floor: session id, stream id, seq and the event as the dict the store encodes."""

FLOOR_TOKEN = 1  # the lease token of every floor session (its lease rows are written before the clock starts)
FLOOR_LEASE_OWNER = "bench"


def floor_events(writers: int, per_writer: int) -> list[FloorEvent]:
    """The events the durable run appends, in the order group commit sees them (round robin), each as
    the dict `encode_event` makes of the same envelope (built here, untimed: the floor times the JSON)."""
    now = time.time()
    events = []
    for seq in range(1, per_writer + 1):
        for writer in range(writers):
            session, stream_id = stream_of(writer)
            events.append((session, stream_id, seq, encode_event(event_for(stream_id, seq, now), validate=False)))
    return events


def floor_rows(chunk: list[FloorEvent]) -> list[tuple[str, int, int, str, int]]:
    """The floor's encoding, inside its timed loop: the JSON body and its CRC32 (the store's rule:
    over ``b"<len(stream)>:<stream>:<seq>:" + body``), as event rows ``(stream, seq, token, body, crc)``."""
    rows = []
    for _, stream_id, seq, data in chunk:
        body = orjson.dumps(data).decode("ascii")
        stream = stream_id.encode()
        checksum = zlib.crc32(body.encode(), zlib.crc32(b"%d:%b:%d:" % (len(stream), stream, seq)))
        rows.append((stream_id, seq, FLOOR_TOKEN, body, checksum))
    return rows


def check_floor_encoding() -> None:
    """The floor writes exactly the rows the store would write for the same envelope (checked once, untimed)."""
    from trio_agent._journal._codec import encode_rows  # the store's own encoder, to compare with

    session, stream_id = stream_of(0)
    envelope = event_for(stream_id, 1, time.time())
    expected = encode_rows(AppendBatch(session, stream_id, FLOOR_TOKEN, (envelope,)))
    got = floor_rows([(session, stream_id, 1, encode_event(envelope, validate=False))])
    if got != expected:
        raise SystemExit(f"the raw floor's rows differ from the store's:\n  floor {got}\n  store {expected}")


def floor_check(
    chunk: list[FloorEvent],
    leases: dict[str, tuple[str, int, float]],
    heads: dict[str, tuple[str, int]],
    now: float,
) -> dict[str, tuple[str, int]]:
    """The floor's checks, in the transaction: each event's lease (token, expiry) and its seq against the
    stream's head (and the stream's session); returns the new heads of the streams written."""
    written: dict[str, tuple[str, int]] = {}
    for session_id, stream_id, seq, _ in chunk:
        lease = leases.get(session_id)
        if lease is None or lease[1] != FLOOR_TOKEN or lease[2] <= now:
            raise RuntimeError(f"raw floor: lease of {session_id!r} lost")
        stream = heads.get(stream_id)
        if (stream is not None and stream[0] != session_id) or (0 if stream is None else stream[1]) != seq - 1:
            raise RuntimeError(f"raw floor: {stream_id!r} is at {stream}, the append starts at {seq}")
        heads[stream_id] = written[stream_id] = (session_id, seq)
    return written


def in_plain_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a fresh OS thread (no Trio anywhere) and return its result."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="raw floor")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


# -- 1. durable appends ------------------------------------------------------------------------------------


@attrs.frozen
class AppendRun:
    per_s: float
    p50_us: float
    p99_us: float
    batch: float | None  # the average group-commit batch (None: the store does not tell)
    cpu_us: float  # process CPU (every thread of this process) per event
    trio_cpu_us: float  # of which the Trio thread
    longest_hold_ms: float | None = None  # the longest write transaction (lock taken to COMMIT returned)


def lane_counts(store: Any) -> tuple[int, int] | None:
    lane = getattr(store, "_lane", None)
    if lane is None or not hasattr(lane, "batches") or not hasattr(lane, "items"):
        return None
    return int(lane.batches), int(lane.items)


async def durable_appends(store: Any, writers: int, per_writer: int) -> AppendRun:
    """``writers`` tasks, each appending ``per_writer`` single-event batches to its own stream."""
    leases: dict[int, Any] = {}

    async def take(writer: int) -> None:
        session, _ = stream_of(writer)
        leases[writer] = await store.acquire_lease(session, "bench", 3600.0)

    async with trio.open_nursery() as nursery:
        for writer in range(writers):
            nursery.start_soon(take, writer)
    latencies: list[float] = []
    clock = store.clock

    async def write(writer: int) -> None:
        session, stream_id = stream_of(writer)
        token = leases[writer].token
        record = latencies.append
        for seq in range(1, per_writer + 1):
            batch = AppendBatch(session, stream_id, token, (event_for(stream_id, seq, clock()),))
            sent = time.perf_counter()
            await store.append(batch)
            record(time.perf_counter() - sent)

    gc.collect()
    before = lane_counts(store)
    cpu, trio_cpu = time.process_time(), time.thread_time()
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for writer in range(writers):
            nursery.start_soon(write, writer)
    elapsed = time.perf_counter() - start
    cpu, trio_cpu = time.process_time() - cpu, time.thread_time() - trio_cpu
    after = lane_counts(store)
    batch = None
    if before is not None and after is not None and after[0] > before[0]:
        batch = (after[1] - before[1]) / (after[0] - before[0])
    count = writers * per_writer
    return AppendRun(
        count / elapsed,
        percentile(latencies, 0.5) * 1e6,
        percentile(latencies, 0.99) * 1e6,
        batch,
        cpu / count * 1e6,
        trio_cpu / count * 1e6,
    )


def with_longest_hold(run: AppendRun, store: Any) -> AppendRun:
    hold = store.statistics().get("longest_write_hold")
    return attrs.evolve(run, longest_hold_ms=None if hold is None else hold * 1e3)


async def sqlite_appends(path: str, writers: int, per_writer: int) -> AppendRun:
    async with open_sqlite_store(path) as store:
        return with_longest_hold(await durable_appends(store, writers, per_writer), store)


async def postgres_appends(dsn: str, schema: str, writers: int, per_writer: int) -> AppendRun:
    from trio_agent.journal import open_postgres_store

    async with open_postgres_store(dsn, schema=schema) as store:
        return with_longest_hold(await durable_appends(store, writers, per_writer), store)


# -- 2. raw floors -----------------------------------------------------------------------------------------


@attrs.frozen
class RawRun:
    per_s: float
    cpu_us: float  # CPU of the floor's thread per event, encoding included (for PostgreSQL: the client's only)


# The SQLite store's tables an append touches, as it creates them (`trio_agent/_journal/_sqlite.py`).
SQLITE_FLOOR_SCHEMA = (
    "CREATE TABLE journal_streams(stream_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, head INTEGER NOT NULL)",
    "CREATE INDEX journal_streams_session ON journal_streams(session_id, stream_id)",
    "CREATE TABLE journal_events(stream_id TEXT NOT NULL, seq INTEGER NOT NULL, token INTEGER NOT NULL,"
    " body TEXT NOT NULL, checksum INTEGER NOT NULL, PRIMARY KEY(stream_id, seq)) WITHOUT ROWID",
    "CREATE TABLE journal_leases("
    " session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL, expires_at REAL NOT NULL)",
)
SQLITE_INSERT_EVENTS = "INSERT INTO journal_events(stream_id, seq, token, body, checksum) VALUES (?, ?, ?, ?, ?)"
SQLITE_UPSERT_HEADS = (
    "INSERT INTO journal_streams(stream_id, session_id, head) VALUES (?, ?, ?)"
    " ON CONFLICT(stream_id) DO UPDATE SET head=excluded.head"
)
IN_LIST = 500  # ids per ``IN (...)`` lookup, as the store's prefetch


def raw_sqlite(path: str, events: list[FloorEvent], batch: int) -> RawRun:
    """The store's group commit by hand: per ``batch`` events, encode and checksum them, then in one
    ``BEGIN IMMEDIATE`` transaction read and check the leases and heads, insert the events, upsert the heads."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        for statement in SQLITE_FLOOR_SCHEMA:
            conn.execute(statement)
        sessions = sorted({event[0] for event in events})
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO journal_leases(session_id, owner, token, expires_at) VALUES (?, ?, ?, ?)",
            [(session, FLOOR_LEASE_OWNER, FLOOR_TOKEN, time.time() + 3600.0) for session in sessions],
        )
        conn.execute("COMMIT")
        chunks = [events[i : i + batch] for i in range(0, len(events), batch)]
        cpu, start = time.thread_time(), time.perf_counter()
        for chunk in chunks:
            rows = floor_rows(chunk)  # before the lock, as the store encodes before BEGIN
            session_ids = sorted({event[0] for event in chunk})
            stream_ids = sorted({event[1] for event in chunk})
            conn.execute("BEGIN IMMEDIATE")
            now = time.time()
            leases: dict[str, tuple[str, int, float]] = {}
            heads: dict[str, tuple[str, int]] = {}
            for i in range(0, len(session_ids), IN_LIST):
                part = session_ids[i : i + IN_LIST]
                query = (
                    "SELECT session_id, owner, token, expires_at FROM journal_leases"
                    f" WHERE session_id IN ({','.join('?' * len(part))})"
                )
                for row in conn.execute(query, part):
                    leases[row[0]] = (row[1], row[2], row[3])
            for i in range(0, len(stream_ids), IN_LIST):
                part = stream_ids[i : i + IN_LIST]
                query = (
                    "SELECT stream_id, session_id, head FROM journal_streams"
                    f" WHERE stream_id IN ({','.join('?' * len(part))})"
                )
                for row in conn.execute(query, part):
                    heads[row[0]] = (row[1], row[2])
            written = floor_check(chunk, leases, heads, now)
            conn.executemany(SQLITE_INSERT_EVENTS, rows)
            conn.executemany(
                SQLITE_UPSERT_HEADS, [(stream, session, head) for stream, (session, head) in written.items()]
            )
            conn.execute("COMMIT")
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        return RawRun(len(events) / elapsed, cpu / len(events) * 1e6)
    finally:
        conn.close()


# The PostgreSQL store's tables an append touches, as it creates them (`trio_agent/_journal/_postgres.py`).
PG_FLOOR_SCHEMA = (
    "CREATE SCHEMA {s}",
    "CREATE TABLE {s}.streams(stream_id text PRIMARY KEY, session_id text NOT NULL, head bigint NOT NULL)",
    "CREATE INDEX ON {s}.streams(session_id, stream_id)",
    "CREATE TABLE {s}.events(stream_id text NOT NULL, seq bigint NOT NULL, token bigint NOT NULL, body text NOT NULL,"
    " checksum bigint NOT NULL, PRIMARY KEY(stream_id, seq))",
    "CREATE TABLE {s}.leases("
    " session_id text PRIMARY KEY, owner text NOT NULL, token bigint NOT NULL, expires_at double precision NOT NULL)",
)


def raw_postgres(dsn: str, schema: str, events: list[FloorEvent], batch: int) -> RawRun:
    """The PostgreSQL store's group commit by hand: per ``batch`` events, encode and checksum them, then one
    transaction in two pipelines: lock the lease rows, read the clock and the heads; check; write and commit."""
    import psycopg

    q_lock = (
        f"SELECT session_id, owner, token, expires_at FROM {schema}.leases"
        " WHERE session_id = ANY(%s::text[]) ORDER BY session_id FOR UPDATE"
    )
    q_now = "SELECT extract(epoch FROM clock_timestamp())::float8"
    q_heads = f"SELECT stream_id, session_id, head FROM {schema}.streams WHERE stream_id = ANY(%s::text[])"
    q_new_streams = (
        f"INSERT INTO {schema}.streams(stream_id, session_id, head)"
        " SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[])"
    )
    q_heads_set = (
        f"UPDATE {schema}.streams AS t SET head = v.head FROM unnest(%s::text[], %s::bigint[]) AS v(stream_id, head)"
        " WHERE t.stream_id = v.stream_id"
    )
    q_events = (
        f"INSERT INTO {schema}.events(stream_id, seq, token, body, checksum)"
        " SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::text[], %s::bigint[])"
    )
    q_notify = "SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p"
    channel = f"{schema}_journal"
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in PG_FLOOR_SCHEMA:
            conn.execute(statement.format(s=schema))
        sessions = sorted({event[0] for event in events})
        conn.execute(
            f"INSERT INTO {schema}.leases(session_id, owner, token, expires_at) SELECT s, %s, %s, %s"
            " FROM unnest(%s::text[]) AS s",
            (FLOOR_LEASE_OWNER, FLOOR_TOKEN, time.time() + 3600.0, sessions),
        )
        chunks = [events[i : i + batch] for i in range(0, len(events), batch)]
        cpu, start = time.thread_time(), time.perf_counter()
        for chunk in chunks:
            rows = floor_rows(chunk)
            session_ids = sorted({event[0] for event in chunk})
            stream_ids = sorted({event[1] for event in chunk})
            with conn.pipeline():
                conn.execute("BEGIN")
                lease_cursor = conn.execute(q_lock, (session_ids,))
                now_cursor = conn.execute(q_now)
                heads_cursor = conn.execute(q_heads, (stream_ids,))
            now_row = now_cursor.fetchone()
            assert now_row is not None
            leases = {row[0]: (row[1], int(row[2]), float(row[3])) for row in lease_cursor.fetchall()}
            heads = {row[0]: (row[1], int(row[2])) for row in heads_cursor.fetchall()}
            existing = set(heads)
            written = sorted(floor_check(chunk, leases, heads, float(now_row[0])).items())
            created = [(stream, session, head) for stream, (session, head) in written if stream not in existing]
            moved = [(stream, head) for stream, (_, head) in written if stream in existing]
            with conn.pipeline():
                if created:
                    conn.execute(q_new_streams, tuple(list(column) for column in zip(*created, strict=True)))
                if moved:
                    conn.execute(q_heads_set, ([stream for stream, _ in moved], [head for _, head in moved]))
                conn.execute(q_events, tuple(list(column) for column in zip(*rows, strict=True)))
                conn.execute(q_notify, (channel, [f"{stream}:{head}" for stream, (_, head) in written]))
                conn.execute("COMMIT")
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        return RawRun(len(events) / elapsed, cpu / len(events) * 1e6)


# -- 3. durable tool calls ---------------------------------------------------------------------------------


@attrs.frozen
class BumpInput:
    n: int


async def _bump(input: BumpInput, ctx: ta.ToolContext) -> ta.ToolResult:
    """Return n + 1."""
    return ta.ToolResult.success(input.n + 1)


bump_once = ta.define_tool(_bump, name="bump", side_effect="non_idempotent", kind="execute")
bump_pure = ta.define_tool(_bump, name="bump", side_effect="pure", kind="readonly")

TOOL_CONFIGS = {
    # name: (tool, durable_pure_starts, awaited commits per call, label)
    "non_idempotent": (bump_once, True, "3", "non_idempotent (scheduled+started+settled)"),
    "pure_durable_starts": (bump_pure, True, "3", "pure, durable_pure_starts=True"),
    "pure_async_starts": (bump_pure, False, "2+1", "pure, durable_pure_starts=False"),
}


@attrs.frozen
class ToolRun:
    per_s: float
    p50_us: float
    p99_us: float
    cpu_us: float  # process CPU per call (both threads)


async def _noop_emit(item: ta.ToolItem) -> None:
    return None


async def direct_tool_calls(sessions: int, calls: int) -> ToolRun:
    """The floor: the same tasks calling the tool function itself, no pipeline, no journal."""
    latencies: list[float] = []

    async def session(index: int) -> None:
        ctx = ta.ToolContext(
            ta.ExecutionContext(f"s{index}", "root", "r", "t", "c", "k", ta.AbortHandle(), lambda: None), _noop_emit
        )
        value = BumpInput(index)
        for _ in range(calls):
            sent = time.perf_counter()
            result = await bump_once.run(value, ctx)
            latencies.append(time.perf_counter() - sent)
            assert result.output == index + 1

    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(sessions):
            nursery.start_soon(session, index)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    count = sessions * calls
    return ToolRun(
        count / elapsed, percentile(latencies, 0.5) * 1e6, percentile(latencies, 0.99) * 1e6, cpu / count * 1e6
    )


async def durable_tool_calls(path: str, config: str, sessions: int, calls: int) -> ToolRun:
    tool, durable_pure_starts, _, _ = TOOL_CONFIGS[config]
    latencies: list[float] = []
    finished: list[float] = []
    cpu_end = 0.0
    ready = 0
    all_ready = trio.Event()
    go = trio.Event()

    async def session(store: Any, index: int) -> None:
        nonlocal ready, cpu_end
        async with open_journal(
            store, session_id=f"{config}-{index}", durable_pure_starts=durable_pure_starts, lease_ttl=600.0
        ) as journal:
            origin = await start_turn(journal)
            pipeline = ta.ToolPipeline([tool], journal=journal, history_limit=0)
            ready += 1
            if ready == sessions:
                all_ready.set()
            await go.wait()
            for number in range(calls):
                call = ta.ToolCall(f"call-{number}", "bump", {"n": number})
                sent = time.perf_counter()
                record = await pipeline.execute(call, origin)
                latencies.append(time.perf_counter() - sent)
                assert record.result.output == number + 1, record
            finished.append(time.perf_counter())
            if len(finished) == sessions:
                cpu_end = time.process_time()

    async with open_sqlite_store(path) as store, trio.open_nursery() as nursery:
        for index in range(sessions):
            nursery.start_soon(session, store, index)
        await all_ready.wait()
        gc.collect()
        cpu, start = time.process_time(), time.perf_counter()
        go.set()
    elapsed = max(finished) - start
    count = sessions * calls
    return ToolRun(
        count / elapsed,
        percentile(latencies, 0.5) * 1e6,
        percentile(latencies, 0.99) * 1e6,
        (cpu_end - cpu) / count * 1e6,
    )


# -- PostgreSQL availability -------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres(enabled: bool) -> Iterator[tuple[str | None, str]]:
    """Yield ``(dsn, status)``: a throw-away cluster's DSN, or None and why PostgreSQL is skipped."""
    if not enabled:
        yield None, "skipped: --no-postgres"
        return
    try:
        importlib.import_module("trio_agent._journal._postgres")
        importlib.import_module("psycopg")  # the raw floor needs it too
    except ImportError as exc:
        yield None, f"skipped: the PostgreSQL store is not importable ({exc})"
        return
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    try:
        from pg_cluster import PostgresUnavailable, pg_cluster  # type: ignore[import-not-found]
    except ImportError as exc:
        yield None, f"skipped: tests/pg_cluster.py is not importable ({exc})"
        return
    with contextlib.ExitStack() as stack:
        try:
            dsn = stack.enter_context(pg_cluster())
        except (PostgresUnavailable, RuntimeError, OSError) as exc:
            yield None, f"skipped: no PostgreSQL server ({str(exc).splitlines()[0]})"
            return
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            sync = conn.execute("SHOW synchronous_commit").fetchone()
            fsync = conn.execute("SHOW fsync").fetchone()
        version = row[0] if row else "?"
        yield (
            dsn,
            (
                f"measured: PostgreSQL {version} (fsync={fsync[0] if fsync else '?'}, "
                f"synchronous_commit={sync[0] if sync else '?'})"
            ),
        )


# -- the run -----------------------------------------------------------------------------------------------


def median_run(runs: list[AppendRun]) -> AppendRun:
    batches = [run.batch for run in runs if run.batch is not None]
    return AppendRun(
        statistics.median(run.per_s for run in runs),
        statistics.median(run.p50_us for run in runs),
        statistics.median(run.p99_us for run in runs),
        statistics.median(batches) if batches else None,
        statistics.median(run.cpu_us for run in runs),
        statistics.median(run.trio_cpu_us for run in runs),
        max((run.longest_hold_ms for run in runs if run.longest_hold_ms is not None), default=None),
    )


def median_raw(runs: list[RawRun]) -> RawRun:
    return RawRun(statistics.median(run.per_s for run in runs), statistics.median(run.cpu_us for run in runs))


def median_tool(runs: list[ToolRun]) -> ToolRun:
    return ToolRun(
        statistics.median(run.per_s for run in runs),
        statistics.median(run.p50_us for run in runs),
        statistics.median(run.p99_us for run in runs),
        statistics.median(run.cpu_us for run in runs),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="quick run for smoke tests")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-postgres", action="store_true", help="skip the PostgreSQL columns")
    parser.add_argument("--sessions", type=int, default=None, help="concurrent sessions for the tool calls")
    parser.add_argument("--calls", type=int, default=None, help="sequential tool calls per session")
    parser.add_argument(
        "--writers",
        default=None,
        help=f"comma-separated writer counts to measure, of {','.join(map(str, WRITERS_FULL))} (default: all; "
        f"--short: {','.join(map(str, WRITERS_SHORT))})",
    )
    add_progress_option(parser)
    args = parser.parse_args(argv)
    events = EVENTS_SHORT if args.short else EVENTS_FULL
    writer_counts = WRITERS_SHORT if args.short else WRITERS_FULL
    if args.writers is not None:
        try:
            chosen = {int(part) for part in args.writers.split(",") if part.strip()}
        except ValueError:
            parser.error(f"--writers: not a list of integers: {args.writers!r}")
        if not chosen or not chosen <= set(events):
            parser.error(f"--writers: choose among {','.join(map(str, sorted(events)))}")
        writer_counts = tuple(sorted(chosen))
    start_progress("journal", args)
    rounds = args.rounds or (1 if args.short else 3)
    sessions = args.sessions or (SESSIONS_SHORT if args.short else SESSIONS_FULL)
    calls = args.calls or (CALLS_SHORT if args.short else CALLS_FULL)
    solo_calls = SOLO_CALLS_SHORT if args.short else SOLO_CALLS_FULL

    workdir, fs_kind = disk_dir()
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    check_floor_encoding()
    floor_input = {n: floor_events(n, events[n] // n) for n in writer_counts}
    mean_body = statistics.fmean(len(row[3]) for row in floor_rows(floor_input[writer_counts[-1]][:1000]))
    sqlite_runs: dict[int, list[AppendRun]] = {n: [] for n in writer_counts}
    sqlite_raw: dict[int, list[RawRun]] = {n: [] for n in writer_counts}
    pg_runs: dict[int, list[AppendRun]] = {n: [] for n in writer_counts}
    pg_raw: dict[int, list[RawRun]] = {n: [] for n in writer_counts}
    tool_runs: dict[str, list[ToolRun]] = {name: [] for name in ("direct", *TOOL_CONFIGS)}
    solo_runs: dict[str, list[ToolRun]] = {name: [] for name in TOOL_CONFIGS}
    counter = 0
    pg_failed: str | None = None

    def fresh(name: str) -> str:
        nonlocal counter
        counter += 1
        return os.path.join(workdir, f"{counter:03d}-{name}.db")

    try:
        with postgres(not args.no_postgres) as (dsn, pg_status):
            note(f"PostgreSQL: {pg_status}")
            for round_ in range(rounds):
                for n in writer_counts:
                    note(f"round {round_ + 1}/{rounds}: appends, {n} writers")
                    per_writer = events[n] // n
                    run = trio.run(sqlite_appends, fresh(f"durable-w{n}"), n, per_writer)
                    sqlite_runs[n].append(run)
                    batch = max(1, round(run.batch if run.batch is not None else n))
                    raw = functools.partial(raw_sqlite, fresh(f"raw-w{n}"), floor_input[n], batch)
                    sqlite_raw[n].append(in_plain_thread(raw))
                    if dsn is not None and pg_failed is None:
                        try:
                            run = trio.run(postgres_appends, dsn, f"bench_r{round_}_w{n}", n, per_writer)
                            batch = max(1, round(run.batch if run.batch is not None else n))
                            raw = functools.partial(raw_postgres, dsn, f"raw_r{round_}_w{n}", floor_input[n], batch)
                            pg_raw[n].append(in_plain_thread(raw))
                            pg_runs[n].append(run)
                        except Exception as exc:  # a broken store must not hide the SQLite figures
                            pg_failed = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                note(f"round {round_ + 1}/{rounds}: tool calls, {sessions} sessions x {calls} calls")
                tool_runs["direct"].append(trio.run(direct_tool_calls, sessions, calls))
                for name in TOOL_CONFIGS:
                    tool_runs[name].append(trio.run(durable_tool_calls, fresh(f"tools-{name}"), name, sessions, calls))
                    solo_runs[name].append(trio.run(durable_tool_calls, fresh(f"solo-{name}"), name, 1, solo_calls))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total = time.perf_counter() - began
    load_after = os.getloadavg()[0]

    sqlite = {n: median_run(sqlite_runs[n]) for n in writer_counts}
    sqlite_floor = {n: median_raw(sqlite_raw[n]) for n in writer_counts}
    has_pg = dsn is not None and pg_failed is None
    if pg_failed is not None:
        pg_status = pg_failed
    pg = {n: median_run(pg_runs[n]) for n in writer_counts} if has_pg else {}
    pg_floor = {n: median_raw(pg_raw[n]) for n in writer_counts} if has_pg else {}
    tools = {name: median_tool(runs) for name, runs in tool_runs.items()}

    def paired(runs: list[AppendRun], floors: list[RawRun]) -> float:
        """Median over rounds of durable/raw, each pair measured back to back (so under the same noise)."""
        return statistics.median(run.per_s / floor.per_s for run, floor in zip(runs, floors, strict=True))

    def best(runs: list[AppendRun], floors: list[RawRun]) -> float:
        """Best durable over best raw: each side's least disturbed round."""
        return max(run.per_s for run in runs) / max(floor.per_s for floor in floors)

    sqlite_ratio = {n: paired(sqlite_runs[n], sqlite_raw[n]) for n in writer_counts}
    sqlite_best = {n: best(sqlite_runs[n], sqlite_raw[n]) for n in writer_counts}
    pg_ratio = {n: paired(pg_runs[n], pg_raw[n]) for n in writer_counts} if has_pg else {}
    pg_best = {n: best(pg_runs[n], pg_raw[n]) for n in writer_counts} if has_pg else {}
    solo = {name: median_tool(runs) for name, runs in solo_runs.items()}

    # -- the tables
    print(
        f"journal: durable appends vs the raw store, {rounds} round(s) (median), "
        f"trio {trio.__version__}, SQLite {sqlite3.sqlite_version}, Python {sys.version.split()[0]}"
    )
    print(
        f"CAVEAT: this machine has {os.cpu_count()} cores and is a slow, noisy VM (other jobs may share it): "
        "read ratios and CPU per event, not absolutes."
    )
    print(
        f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after the run "
        "(above ~1 other jobs competed; the durable path, with its thread hand-offs, suffers more than the raw floor)"
    )
    print(
        f"SQLite: WAL, synchronous=FULL, files in {workdir} ({fs_kind}); one event = {mean_body:.0f} B of JSON; "
        "each writer appends single-event batches to its own stream under a held lease and awaits each ack."
    )
    print(f"PostgreSQL: {pg_status}")
    holds = ", ".join(
        f"{n} writers {run.longest_hold_ms:.2f} ms" for n, run in sqlite.items() if run.longest_hold_ms is not None
    )
    print(f"SQLite longest write transaction (lock taken to COMMIT returned; other processes wait this long): {holds}")
    print()
    header = (
        f"{'writers':>7} {'events':>7} | {'SQLite/s':>9} {'p50 us':>8} {'p99 us':>8} {'batch':>6} "
        f"{'raw/s':>9} {'dur/raw':>7} {'best':>5}"
    )
    if has_pg:
        header += f" | {'PG/s':>8} {'p50 us':>8} {'p99 us':>8} {'batch':>6} {'raw/s':>8} {'dur/raw':>7} {'best':>5}"
    else:
        header += " | PostgreSQL"
    print(header)
    for n in writer_counts:
        run, floor = sqlite[n], sqlite_floor[n]
        shown = f"{run.batch:.1f}" if run.batch is not None else "n/a"
        line = (
            f"{n:>7} {events[n] // n * n:>7} | {run.per_s:>9.0f} {run.p50_us:>8.0f} {run.p99_us:>8.0f} {shown:>6} "
            f"{floor.per_s:>9.0f} {sqlite_ratio[n]:>7.0%} {sqlite_best[n]:>5.0%}"
        )
        if has_pg:
            prun, pfloor = pg[n], pg_floor[n]
            pbatch = f"{prun.batch:.1f}" if prun.batch is not None else f"{n}*"
            line += (
                f" | {prun.per_s:>8.0f} {prun.p50_us:>8.0f} {prun.p99_us:>8.0f} {pbatch:>6} "
                f"{pfloor.per_s:>8.0f} {pg_ratio[n]:>7.0%} {pg_best[n]:>5.0%}"
            )
        else:
            line += f" | {pg_status}"
        print(line)
    print(
        "  raw/s = the floor: the store's work by hand in a plain thread without Trio, one transaction per batch "
        "of the size the durable writer achieved (rounded): each event orjson-encoded and CRC32'd (timed), then "
        "the leases and heads read and checked, the events inserted, the heads written, COMMIT"
        + (" (PostgreSQL: leases locked FOR UPDATE, server clock, pipelined, one NOTIFY per stream)" if has_pg else "")
        + ("; * = the store does not report its batches, the writer count is assumed" if has_pg else "")
    )
    print(
        "  dur/raw = median over rounds of durable/raw measured back to back; best = best durable round / best raw "
        "round (the least disturbed of each)"
    )
    print()
    print("CPU per event in this process, us (durable: all threads, of which the Trio thread; raw: its one thread;")
    print("PostgreSQL: the client side only, the server's CPU is not counted)")
    header = f"{'writers':>7} | {'SQLite durable':>14} {'(trio)':>7} {'raw':>6}"
    if has_pg:
        header += f" | {'PG durable':>10} {'(trio)':>7} {'raw':>6}"
    print(header)
    for n in writer_counts:
        run, floor = sqlite[n], sqlite_floor[n]
        line = f"{n:>7} | {run.cpu_us:>14.1f} {run.trio_cpu_us:>7.1f} {floor.cpu_us:>6.1f}"
        if has_pg:
            line += f" | {pg[n].cpu_us:>10.1f} {pg[n].trio_cpu_us:>7.1f} {pg_floor[n].cpu_us:>6.1f}"
        print(line)
    print()
    print(
        "reference (durable-trio.md §2.2, SQLite WAL+FULL; group commit from trio vs raw at batch = writers, where raw "
        "was pre-encoded inserts into one table, a lower bar than this script's floor):"
    )
    print(f"{'writers':>7} | {'group/s':>9} {'p50 us':>8} {'p99 us':>8} {'batch':>6} {'raw/s':>9} {'dur/raw':>7}")
    for n, (per_s, batch_ref, p50, p99) in REFERENCE_GROUP.items():
        print(
            f"{n:>7} | {per_s:>9,} {p50:>8,} {p99:>8,} {batch_ref:>6} {REFERENCE_RAW[n]:>9,} "
            f"{per_s / REFERENCE_RAW[n]:>7.0%}"
        )
    print(f"  PostgreSQL reference: {REFERENCE_PG}")
    print()
    ratio_100 = sqlite_ratio.get(100)
    met = ratio_100 is not None and ratio_100 >= TARGET_RATIO_AT_100
    if ratio_100 is None:
        print("target (SQLite durable at 100 writers >= 50 % of the raw floor): not measured (see --writers)")
    elif met:
        print(
            f"target met: SQLite durable at 100 writers reaches {ratio_100:.0%} of the raw floor "
            f"(target >= {TARGET_RATIO_AT_100:.0%}; {sqlite_best[100]:.0%} best vs best)"
        )
    else:
        print(
            f"open target: SQLite durable at 100 writers reaches {ratio_100:.0%} of the raw floor against a target "
            f"of {TARGET_RATIO_AT_100:.0%} ({sqlite_best[100]:.0%} best vs best; the floor runs the same statements "
            "and encoding from one thread, while each durable append also builds an AppendBatch, crosses from Trio "
            "to the writer thread and back, and goes through the store's general checks)"
        )
    if has_pg and 100 in pg_ratio:
        print(
            f"        PostgreSQL at 100 writers: {pg_ratio[100]:.0%} of its raw floor ({pg_best[100]:.0%} best vs best)"
        )
    print()
    print(
        f"tool calls: {sessions} concurrent sessions x {calls} sequential calls (and 1 session x {solo_calls}), "
        "one open_journal per session on one SQLite store, ToolPipeline(journal=journal)"
    )
    print(
        f"{'configuration':<44}{'commits':>8}{'calls/s':>10}{'p50 us':>9}{'p99 us':>9}{'CPU us':>8}"
        f"{'x direct':>9} |{'1 session/s':>12}{'p50 us':>8}"
    )
    direct = tools["direct"]
    print(
        f"{'raw Trio: the tool function called directly':<44}{'0':>8}{direct.per_s:>10.0f}{direct.p50_us:>9.1f}"
        f"{direct.p99_us:>9.1f}{direct.cpu_us:>8.1f}{1.0:>9.0f} |"
    )
    for name, (_, _, commits, label) in TOOL_CONFIGS.items():
        many, one = tools[name], solo[name]
        print(
            f"{label:<44}{commits:>8}{many.per_s:>10.0f}{many.p50_us:>9.0f}{many.p99_us:>9.0f}{many.cpu_us:>8.0f}"
            f"{direct.per_s / many.per_s:>9.0f} |{one.per_s:>12.0f}{one.p50_us:>8.0f}"
        )
    durable_starts, async_starts = tools["pure_durable_starts"], tools["pure_async_starts"]
    gain = async_starts.per_s / durable_starts.per_s - 1
    solo_saving = 1 - solo["pure_async_starts"].p50_us / solo["pure_durable_starts"].p50_us
    print(
        f"  durable_pure_starts=False (pure tools only; the start is still written, not awaited): "
        f"{gain:+.0%} calls/s at {sessions} sessions, {solo_saving:.0%} of the per-call p50 at 1 session"
    )
    print(f"  reference: {REFERENCE_TOOLS}")
    print(f"  (whole run: {total:.1f} s)")

    figures: dict[str, Any] = {
        "benchmark": "journal",
        "rounds": rounds,
        "sqlite_fs": fs_kind,
        "event_bytes": round(mean_body, 1),
        "postgres": pg_status,
    }
    for prefix, measured, floors, ratios, bests in (
        ("sqlite", sqlite, sqlite_floor, sqlite_ratio, sqlite_best),
        ("pg", pg, pg_floor, pg_ratio, pg_best),
    ):
        for n, run in measured.items():
            figures[f"{prefix}_w{n}_appends_per_s"] = round(run.per_s, 1)
            figures[f"{prefix}_w{n}_ack_p50_us"] = round(run.p50_us, 1)
            figures[f"{prefix}_w{n}_ack_p99_us"] = round(run.p99_us, 1)
            if run.batch is not None:
                figures[f"{prefix}_w{n}_avg_batch"] = round(run.batch, 2)
            figures[f"{prefix}_w{n}_cpu_us_per_event"] = round(run.cpu_us, 2)
            figures[f"{prefix}_w{n}_trio_cpu_us_per_event"] = round(run.trio_cpu_us, 2)
            figures[f"{prefix}_w{n}_raw_per_s"] = round(floors[n].per_s, 1)
            figures[f"{prefix}_w{n}_raw_cpu_us_per_event"] = round(floors[n].cpu_us, 2)
            figures[f"{prefix}_w{n}_ratio"] = round(ratios[n], 3)
            figures[f"{prefix}_w{n}_ratio_best"] = round(bests[n], 3)
            if run.longest_hold_ms is not None:
                figures[f"{prefix}_w{n}_longest_write_hold_ms"] = round(run.longest_hold_ms, 2)
    figures["target_ratio_at_100"] = TARGET_RATIO_AT_100
    if ratio_100 is not None:
        figures["target_met_at_100"] = bool(met)
    figures["tool_sessions"] = sessions
    figures["tool_calls_per_session"] = calls
    figures["tools_direct_calls_per_s"] = round(direct.per_s, 1)
    figures["tools_direct_us_per_call"] = round(1e6 / direct.per_s, 4)
    for name in TOOL_CONFIGS:
        many, one = tools[name], solo[name]
        figures[f"tools_{name}_calls_per_s"] = round(many.per_s, 1)
        figures[f"tools_{name}_p50_us"] = round(many.p50_us, 1)
        figures[f"tools_{name}_p99_us"] = round(many.p99_us, 1)
        figures[f"tools_{name}_cpu_us_per_call"] = round(many.cpu_us, 1)
        figures[f"tools_{name}_1_session_calls_per_s"] = round(one.per_s, 1)
        figures[f"tools_{name}_1_session_p50_us"] = round(one.p50_us, 1)
    figures["pure_async_starts_throughput_gain"] = round(gain, 3)
    figures["pure_async_starts_1_session_p50_saving"] = round(solo_saving, 3)
    figures["seconds"] = round(total, 1)
    figures["load_before"] = round(load_before, 2)
    figures["load_after"] = round(load_after, 2)
    print(json.dumps(figures))
    if pg_failed is not None:
        print(f"journal: the PostgreSQL rows {pg_failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
