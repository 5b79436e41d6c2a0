"""Damaged SQLite journals: checksums, invalid text, byte flips, and the version-1 migration.

The rule under test (``trio_agent/_journal/_codec.py``): whatever damage a file
takes, a read returns exactly what was written, a prefix of it (whole
transactions lost, as a torn WAL tail loses them), or raises
`JournalCorruptError` naming the stream and seq. Never other data, never
`JournalUnavailableError` (which would mean "retry").

Byte-flip campaigns are deterministic: seeded positions over a small journal the
test writes itself. `flip_campaign` is also what the figures in
docs/durability.md were measured with (more seeds, same code).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import sqlite3
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from trio_agent._errors import JournalCorruptError, JournalError, StaleFencingTokenError
from trio_agent._journal._codec import decode_row, row_checksum
from trio_agent._journal._events import (
    Event,
    EventEnvelope,
    RequestAccepted,
    RequestStarted,
    SessionCreated,
    ToolCompleted,
    ToolScheduled,
    TurnStarted,
)
from trio_agent._journal._sqlite import STORE_FORMAT, V1_FORMAT, open_sqlite_store
from trio_agent._journal._store import AppendBatch, Lease, command_digest, encode_body, stream_id_for
from trio_agent._tools._definition import InterruptBehavior, SideEffect, ToolKind

LONG_TTL = 3600.0
REQ = {"request_id": "req-1", "turn_id": "turn-1"}


def event_for(session: str, seq: int) -> Event:
    """Varied events; every fourth a `tool_scheduled` with an idempotency key (what a flip must never change)."""
    kind = seq % 4
    if seq == 1:
        return SessionCreated(session_id=session, agent_id="root")
    if kind == 0:
        return ToolScheduled(
            **REQ,
            call_id=f"call-{seq}",
            tool_name="charge",
            model_input={"amount": seq, "note": "pay the invoice"},
            side_effect=SideEffect.NON_IDEMPOTENT,
            kind=ToolKind.EXECUTE,
            interrupt=InterruptBehavior.BLOCK,
            concurrency_safe=False,
            idempotency_key=f"{session}:root:call-{seq}",
        )
    if kind == 1:
        return ToolCompleted(**REQ, call_id=f"call-{seq - 1}", result={"ok": True, "output": f"paid {seq}"})
    if kind == 2:
        return RequestAccepted(request_id=f"req-{seq}", command_id=f"cmd-{seq}", input={"prompt": "hello"})
    if seq % 8 == 3:
        return TurnStarted(request_id="req-1", turn_id=f"turn-{seq}", turn=seq)
    return RequestStarted(request_id=f"req-{seq}")


def envelopes(session: str, first: int, count: int) -> list[EventEnvelope]:
    stream = stream_id_for(session, "root")
    return [
        EventEnvelope(stream_id=stream, seq=seq, event=event_for(session, seq), recorded_at=1_700_000_000.0 + seq)
        for seq in range(first, first + count)
    ]


SESSIONS = ("alpha", "beta", "gamma")
BATCHES = 6  # per session, of 4 events: 72 events, about 20 kB


async def write_journal(path: Path) -> dict[str, list[EventEnvelope]]:
    """A small journal, written and closed (so checkpointed); returns what each stream holds."""
    written: dict[str, list[EventEnvelope]] = {}
    async with open_sqlite_store(path) as store:
        await _fill(store, written)
    return written


async def _fill(store: Any, written: dict[str, list[EventEnvelope]]) -> None:
    leases = {session: await store.acquire_lease(session, "writer", LONG_TTL) for session in SESSIONS}
    for index in range(BATCHES):
        for session in SESSIONS:  # interleaved, so the streams' rows share pages
            batch = envelopes(session, index * 4 + 1, 4)
            lease: Lease = leases[session]
            await store.append(
                AppendBatch(
                    session,
                    batch[0].stream_id,
                    lease.token,
                    batch,
                    command_id=f"c{index}",
                    command_digest=command_digest(batch),
                )
            )
            written.setdefault(batch[0].stream_id, []).extend(batch)


def read_journal(path: Path, written: dict[str, list[EventEnvelope]]) -> str:
    """Open ``path`` as a recovering writer would and read every stream; classify the result.

    ``intact``: everything as written; ``prefix``: each stream a prefix of what was written;
    ``detected``: a `JournalCorruptError`. Anything else raises AssertionError.
    """

    async def run() -> str:
        outcome = "intact"
        try:
            async with open_sqlite_store(path) as store:
                for stream, expected in written.items():
                    try:
                        got = await store.read(stream)
                    except JournalCorruptError as exc:
                        assert stream in str(exc) or str(path) in str(exc), exc
                        outcome = "detected"
                        continue
                    assert got == expected[: len(got)], f"{stream}: other data than written"
                    assert [encode_body(e) for e in got] == [encode_body(e) for e in expected[: len(got)]]
                    if len(got) < len(expected) and outcome == "intact":
                        outcome = "prefix"
        except JournalCorruptError:
            return "detected"
        return outcome

    return trio.run(run)


def flip_campaign(pristine: Path, data_file: str, positions: Sequence[int], seed: int, work: Path) -> Counter[str]:
    """Flip one byte (XOR a random non-zero value) of ``data_file`` ("db" or "wal") per position,
    on a fresh copy of ``pristine`` each time, and classify what a reader gets."""
    rng = random.Random(seed)
    tally: Counter[str] = Counter()
    written = json.loads((pristine / "written.json").read_text())
    expected = {stream: [_decode(body) for body in bodies] for stream, bodies in written.items()}
    for position in positions:
        case = work / f"case-{position}"
        shutil.copytree(pristine, case)
        target = case / ("journal.db" if data_file == "db" else "journal.db-wal")
        data = bytearray(target.read_bytes())
        data[position] ^= rng.randrange(1, 256)
        target.write_bytes(bytes(data))
        try:
            tally[read_journal(case / "journal.db", expected)] += 1
        except AssertionError as exc:
            raise AssertionError(f"a flip at {data_file} byte {position} was read as other data: {exc}") from exc
        except JournalError as exc:
            raise AssertionError(f"a flip at {data_file} byte {position} raised {type(exc).__name__}: {exc}") from exc
        shutil.rmtree(case)
    return tally


def _decode(body: str) -> EventEnvelope:
    from trio_agent._journal._events import decode_event

    return decode_event(json.loads(body))


def _save_written(directory: Path, written: dict[str, list[EventEnvelope]]) -> None:
    (directory / "written.json").write_text(
        json.dumps({stream: [encode_body(e) for e in items] for stream, items in written.items()})
    )


async def checkpointed_journal(directory: Path) -> Path:
    """A journal whose every commit is in the main file (the store was closed: WAL checkpointed)."""
    await trio.Path(directory).mkdir()
    written = await write_journal(directory / "journal.db")
    assert not (directory / "journal.db-wal").exists()
    _save_written(directory, written)
    return directory


async def wal_journal(directory: Path, staging: Path) -> Path:
    """A journal whose commits are still in the WAL: main file and WAL copied while the store is open."""
    await trio.Path(directory).mkdir()
    await trio.Path(staging).mkdir()
    written: dict[str, list[EventEnvelope]] = {}
    async with open_sqlite_store(staging / "journal.db") as store:
        await _fill(store, written)
        # Everything is acknowledged and the writer is idle: the two files are a consistent image.
        shutil.copy(staging / "journal.db", directory / "journal.db")
        shutil.copy(staging / "journal.db-wal", directory / "journal.db-wal")
    _save_written(directory, written)
    return directory


def body_positions(path: Path, rng: random.Random, count: int) -> list[int]:
    """Positions inside stored event bodies (found by their text in the file)."""
    data = path.read_bytes()
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        bodies = [row[0].encode() for row in conn.execute("SELECT body FROM journal_events")]
    spans = [(start, len(body)) for body in bodies if (start := data.find(body)) >= 0]
    assert len(spans) > len(bodies) // 2
    picks = []
    for _ in range(count):
        start, length = rng.choice(spans)
        picks.append(start + rng.randrange(length))
    return picks


# ---------------------------------------------------------------- byte flips


async def test_byte_flips_in_the_main_file_are_detected_or_read_as_written(tmp_path: Path) -> None:
    pristine = await checkpointed_journal(tmp_path / "pristine")
    size = (pristine / "journal.db").stat().st_size
    rng = random.Random(7)
    anywhere = [rng.randrange(size) for _ in range(60)]
    in_bodies = body_positions(pristine / "journal.db", rng, 60)
    tally = await trio.to_thread.run_sync(flip_campaign, pristine, "db", anywhere + in_bodies, 8, tmp_path / "work")
    assert sum(tally.values()) == 120
    # Flips inside bodies are what the checksum exists for: most of them land in string
    # values that still parse, and every one must be caught.
    assert tally["detected"] >= 60, tally


async def test_byte_flips_in_the_wal_lose_whole_transactions_at_most(tmp_path: Path) -> None:
    pristine = await wal_journal(tmp_path / "pristine", tmp_path / "staging")
    size = (pristine / "journal.db-wal").stat().st_size
    rng = random.Random(11)
    positions = [rng.randrange(size) for _ in range(80)]
    tally = await trio.to_thread.run_sync(flip_campaign, pristine, "wal", positions, 12, tmp_path / "work")
    assert sum(tally.values()) == 80
    assert tally["prefix"] > 0, tally  # the WAL's own frame checksums cut the log at the damage


# ---------------------------------------------------------------- rows edited behind the store's back


def _sql(path: Path, statement: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(statement, parameters).fetchall()
        conn.commit()
        return rows


def _edit_body(path: Path, stream: str, seq: int, edit: Any, *, fix_checksum: bool = False) -> None:
    [(body,)] = _sql(path, "SELECT body FROM journal_events WHERE stream_id=? AND seq=?", (stream, seq))
    new = edit(body)
    _sql(path, "UPDATE journal_events SET body=? WHERE stream_id=? AND seq=?", (new, stream, seq))
    if fix_checksum:
        raw = new if isinstance(new, bytes) else new.encode()
        _sql(
            path,
            "UPDATE journal_events SET checksum=? WHERE stream_id=? AND seq=?",
            (row_checksum(stream, seq, raw), stream, seq),
        )


async def test_a_body_edited_into_other_valid_json_is_caught_by_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    written = await write_journal(path)
    stream = stream_id_for("beta", "root")
    # seq 4 is a tool_scheduled: change its idempotency key, keeping the JSON valid and decodable.
    _edit_body(path, stream, 4, lambda body: body.replace("beta:root:call-4", "beta:root:call-9"))
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match=f"{stream}#4 is corrupt: checksum mismatch"):
            await store.read(stream)
        assert await store.read(stream, limit=3) == written[stream][:3]
        assert await store.read(stream, after=4) == written[stream][4:]


async def test_a_row_moved_to_another_stream_or_seq_fails_its_checksum(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    await write_journal(path)
    stream = stream_id_for("alpha", "root")
    # Move row 5 of alpha to seq 30 past the head, and fix the body's own claim: only the checksum can tell.
    _sql(path, "DELETE FROM journal_events WHERE stream_id=? AND seq=6", (stream,))
    _sql(path, "UPDATE journal_events SET seq=6 WHERE stream_id=? AND seq=5", (stream,))
    _edit_body(path, stream, 6, lambda body: body.replace('"seq":5', '"seq":6'))
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match=f"{stream}#5"):  # now missing
            await store.read(stream)
        with pytest.raises(JournalCorruptError, match=f"{stream}#6 is corrupt: checksum mismatch"):
            await store.read(stream, after=5)


async def test_invalid_utf8_in_a_body_is_corrupt_not_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    written = await write_journal(path)
    stream = stream_id_for("gamma", "root")
    bad = b'{"schema_version":1,"note":"\xff\xfe"}'
    _sql(path, "UPDATE journal_events SET body=CAST(? AS TEXT) WHERE stream_id=? AND seq=2", (bad, stream))
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match=f"{stream}#2 is corrupt: checksum mismatch"):
            await store.read(stream)
    # With a checksum that matches the bad bytes, the UTF-8 check reports it.
    _sql(
        path, "UPDATE journal_events SET checksum=? WHERE stream_id=? AND seq=2", (row_checksum(stream, 2, bad), stream)
    )
    for readonly in (False, True):
        async with open_sqlite_store(path, readonly=readonly) as store:
            with pytest.raises(JournalCorruptError, match=f"{stream}#2 is corrupt: UnicodeDecodeError"):
                await store.read(stream)
            assert await store.read(stream, limit=1) == written[stream][:1]


@pytest.mark.parametrize(
    "event",
    [{"type": ["tool_started"]}, {"type": {"a": 1}}, {"type": None}, [], "x"],
    ids=["type_list", "type_object", "type_null", "event_list", "event_string"],
)
async def test_any_decoding_failure_of_a_stored_row_is_corrupt(tmp_path: Path, event: object) -> None:
    path = tmp_path / "journal.db"
    await write_journal(path)
    stream = stream_id_for("alpha", "root")

    def edit(body: str) -> str:
        data = json.loads(body)
        data["event"] = event
        return json.dumps(data)

    _edit_body(path, stream, 3, edit, fix_checksum=True)  # a checksum that matches: the decoder must judge
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match=f"{stream}#3 is corrupt"):
            await store.read(stream)


async def test_a_head_past_the_last_row_is_reported_never_read_as_the_whole_stream(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    written = await write_journal(path)
    stream = stream_id_for("alpha", "root")
    last = len(written[stream])
    _sql(path, "DELETE FROM journal_events WHERE stream_id=? AND seq=?", (stream, last))
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match=f"{stream}#{last} is corrupt: the row is missing"):
            await store.read(stream)
        assert await store.read(stream, limit=last - 1) == written[stream][: last - 1]
    _sql(path, "UPDATE journal_streams SET head=? WHERE stream_id=?", (last - 2, stream))
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match="past the stream's head"):
            await store.read(stream)


# ---------------------------------------------------------------- version 1 files

V1_SCHEMA = (
    "CREATE TABLE journal_meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE journal_streams(stream_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, head INTEGER NOT NULL)",
    "CREATE INDEX journal_streams_session ON journal_streams(session_id, stream_id)",
    "CREATE TABLE journal_events(stream_id TEXT NOT NULL, seq INTEGER NOT NULL, token INTEGER NOT NULL,"
    " body TEXT NOT NULL, PRIMARY KEY(stream_id, seq)) WITHOUT ROWID",
    "CREATE TABLE journal_leases(session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL,"
    " expires_at REAL NOT NULL)",
    "CREATE TABLE journal_commands(stream_id TEXT NOT NULL, command_id TEXT NOT NULL, digest TEXT NOT NULL,"
    " first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, PRIMARY KEY(stream_id, command_id)) WITHOUT ROWID",
)
"""The tables exactly as schema version 1 (``trio_agent.journal/1``) created them."""


def write_v1_file(path: Path, sessions: Sequence[str] = SESSIONS, events: int = 12) -> dict[str, list[EventEnvelope]]:
    """A journal as version-1 code wrote it: no checksum column, format marker ``/1``, a held lease."""
    written: dict[str, list[EventEnvelope]] = {}
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        for statement in V1_SCHEMA:
            conn.execute(statement)
        conn.execute("INSERT INTO journal_meta VALUES ('format', ?)", (V1_FORMAT,))
        for session in sessions:
            items = envelopes(session, 1, events)
            stream = items[0].stream_id
            written[stream] = items
            conn.executemany(
                "INSERT INTO journal_events VALUES (?, ?, 1, ?)", [(stream, e.seq, encode_body(e)) for e in items]
            )
            conn.execute("INSERT INTO journal_streams VALUES (?, ?, ?)", (stream, session, events))
            conn.execute("INSERT INTO journal_leases VALUES (?, 'writer', 1, 1e300)", (session,))
            conn.execute(
                "INSERT INTO journal_commands VALUES (?, 'c0', ?, 1, ?)", (stream, command_digest(items), events)
            )
        conn.commit()
    return written


def _columns(path: Path) -> list[str]:
    return [row[1] for row in _sql(path, "PRAGMA table_info(journal_events)")]


async def test_a_version_1_file_is_read_as_it_is_and_migrated_on_first_write_open(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    written = write_v1_file(path)
    stream = stream_id_for("alpha", "root")

    async with open_sqlite_store(path, readonly=True) as store:  # read-only: nothing migrated
        for name, items in written.items():
            assert await store.read(name) == items
    assert _columns(path) == ["stream_id", "seq", "token", "body"]
    assert _sql(path, "SELECT value FROM journal_meta") == [(V1_FORMAT,)]

    async with open_sqlite_store(path) as store:  # the first write-open migrates, in one transaction
        for name, items in written.items():
            assert await store.read(name) == items
            assert [c.command_id for c in await store.commands(name)] == ["c0"]
        lease = await store.current_lease("alpha")
        assert lease == Lease("alpha", "writer", 1, 1e300)
        more = envelopes("alpha", 13, 2)
        await store.append(AppendBatch("alpha", stream, lease.token, more))
        assert await store.read(stream) == written[stream] + more
    assert _columns(path) == ["stream_id", "seq", "token", "body", "checksum"]
    assert _sql(path, "SELECT value FROM journal_meta") == [(STORE_FORMAT,)]
    for row_stream, seq, body, checksum in _sql(path, "SELECT stream_id, seq, body, checksum FROM journal_events"):
        assert checksum == row_checksum(row_stream, seq, body.encode())

    # From now on an old row is protected like a new one.
    _edit_body(path, stream, 2, lambda body: body.replace("req-2", "req-7"))
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match=f"{stream}#2 is corrupt: checksum mismatch"):
            await store.read(stream)
    # And a version-1 writer still attached to the file is refused, never trusted (checksum NOT NULL).
    with pytest.raises(sqlite3.IntegrityError):
        _sql(path, "INSERT INTO journal_events(stream_id, seq, token, body) VALUES ('x/root', 1, 1, '{}')")


async def test_a_failed_migration_leaves_the_version_1_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio_agent._journal._sqlite as sqlite_module

    path = tmp_path / "journal.db"
    written = write_v1_file(path)
    calls = 0

    def failing(stream_id: object, seq: object, body: object) -> int:
        nonlocal calls
        calls += 1
        if calls > 10:
            raise RuntimeError("the disk is on fire")
        return 0

    monkeypatch.setattr(sqlite_module, "_sql_checksum", failing)
    with pytest.raises(JournalError):
        async with open_sqlite_store(path):
            pass
    assert calls > 10
    assert _columns(path) == ["stream_id", "seq", "token", "body"]
    assert _sql(path, "SELECT value FROM journal_meta") == [(V1_FORMAT,)]
    monkeypatch.undo()
    async with open_sqlite_store(path) as store:
        for name, items in written.items():
            assert await store.read(name) == items


# ---------------------------------------------------------------- the write lock


class _Clock:
    """A settable store clock (read by the writer thread)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_lease_expiry_is_judged_after_the_write_lock_is_taken(tmp_path: Path) -> None:
    """A writer that waited for another process's write lock judges the lease by the clock at
    the time it got the lock, not before it waited: an expired lease must not look valid."""
    path = tmp_path / "journal.db"
    clock = _Clock()
    stream = stream_id_for("sess", "root")
    async with open_sqlite_store(path, clock=clock) as store:
        lease = await store.acquire_lease("sess", "A", 10.0)
        assert store._writer is not None
        token = trio.lowlevel.current_trio_token()
        begun = trio.Event()

        def trace(statement: str) -> None:  # runs in the writer thread, before the statement waits
            if statement == "BEGIN IMMEDIATE":
                token.run_sync_soon(begun.set)

        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            store._writer.set_trace_callback(trace)
            ticket = store.submit(AppendBatch("sess", stream, lease.token, envelopes("sess", 1, 1)))
            with trio.fail_after(10):
                await begun.wait()
            clock.now += 60.0  # the lease expires while the writer waits for the lock
            other.execute("COMMIT")
        with trio.fail_after(10), pytest.raises(StaleFencingTokenError):
            await ticket.wait()
        store._writer.set_trace_callback(None)
        assert await store.read(stream) == []


async def test_the_longest_write_hold_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    clock = _Clock()
    held = trio.Event()
    release = trio.Event()
    token = trio.lowlevel.current_trio_token()
    holding = [False]

    def slow_clock() -> float:  # read inside the transaction: holding here holds the write lock
        if holding[0]:
            holding[0] = False
            token.run_sync_soon(held.set)
            trio.from_thread.run(release.wait, trio_token=token)
        return clock()

    async with open_sqlite_store(path, clock=slow_clock) as store:
        assert store.statistics() == {"batches": 0, "items": 0, "longest_write_hold": 0.0}
        lease = await store.acquire_lease("sess", "A", LONG_TTL)
        quick = store.statistics()["longest_write_hold"]
        assert 0.0 < quick < 0.25
        holding[0] = True
        stream = stream_id_for("sess", "root")
        ticket = store.submit(AppendBatch("sess", stream, lease.token, envelopes("sess", 1, 1)))
        with trio.fail_after(10):
            await held.wait()
        await trio.sleep(0.3)  # the duration being measured, not a synchronisation
        release.set()
        with trio.fail_after(10):
            await ticket.wait()
        stats = store.statistics()
        assert stats["longest_write_hold"] >= 0.3
        assert (stats["batches"], stats["items"]) == (2, 2)


# ---------------------------------------------------------------- a damaged schema


def _damage_schema(path: Path, table: str, old: bytes, new: bytes) -> None:
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA writable_schema=ON")
        [(sql,)] = conn.execute("SELECT CAST(sql AS BLOB) FROM sqlite_master WHERE name=?", (table,)).fetchall()
        assert old in sql
        conn.execute("UPDATE sqlite_master SET sql=CAST(? AS TEXT) WHERE name=?", (sql.replace(old, new), table))


@pytest.mark.parametrize(
    ("old", "new"),
    [(b"value TEXT", b"valuf TEXT"), (b"journal_meta(", b"journal_meta\xd7(")],
    ids=["renamed_column", "schema_text_not_utf8"],
)
async def test_a_damaged_schema_is_corrupt_not_unavailable(tmp_path: Path, old: bytes, new: bytes) -> None:
    """Found by the byte-flip campaign: a flip in the stored schema text made opening fail with
    "no such column" (reported as `JournalUnavailableError`, i.e. retry) or a raw UnicodeDecodeError."""
    path = tmp_path / "journal.db"
    await write_journal(path)
    _damage_schema(path, "journal_meta", old, new)
    for readonly in (False, True):
        with pytest.raises(JournalCorruptError):
            async with open_sqlite_store(path, readonly=readonly):
                pass


# ---------------------------------------------------------------- the rule itself


@given(
    seq=st.integers(1, 96),
    session=st.sampled_from(SESSIONS),
    position=st.integers(0, 10_000),
    xor=st.integers(1, 255),
    part=st.sampled_from(["body", "stream", "seq"]),
)
def test_any_one_byte_change_fails_the_checksum(seq: int, session: str, position: int, xor: int, part: str) -> None:
    [envelope] = envelopes(session, seq, 1)
    stream, body = envelope.stream_id, encode_body(envelope).encode()
    checksum = row_checksum(stream, seq, body)
    assert decode_row(stream, seq, body, checksum) == envelope
    if part == "body":
        damaged = bytearray(body)
        damaged[position % len(body)] ^= xor
        body = bytes(damaged)
    elif part == "stream":
        raw = bytearray(stream.encode())
        raw[position % len(raw)] ^= xor & 0x7F or 1  # stays ASCII text
        stream = raw.decode()
    else:
        seq ^= xor
    with pytest.raises(JournalCorruptError, match=re.escape(f"{stream}#{seq} is corrupt: checksum mismatch")):
        decode_row(stream, seq, body, checksum)


def _created(session_id: str, token: int) -> AppendBatch:
    from trio_agent._journal._events import place_event

    stream = f"{session_id}/root"
    event = SessionCreated(session_id=session_id, agent_id="root", parent_agent_id=None)
    return AppendBatch(session_id, stream, token, [place_event(stream, 1, event, 1.0)])


@pytest.mark.parametrize(("table", "edit"), [("journal_leases", "token=9e999"), ("journal_leases", "owner=x'ff'")])
async def test_a_mistyped_stored_lease_row_fails_its_own_session_alone_in_a_group_commit(
    tmp_path: Path, table: str, edit: str
) -> None:
    # An edited file: SQLite keeps 9e999 as a REAL infinity in an INTEGER column. int() of it raised
    # OverflowError, which failed the whole group: the neighbour's append and lease renewal too.
    path = tmp_path / "journal.db"
    async with open_sqlite_store(str(path)) as store:
        lease_a = await store.acquire_lease("A", "me", 60)
        lease_b = await store.acquire_lease("B", "me", 60)
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            conn.execute(f"UPDATE {table} SET {edit} WHERE session_id='A'")
        with store.grouped():
            appended_a = store.submit(_created("A", lease_a.token))
            appended_b = store.submit(_created("B", lease_b.token))
            renewed_b = store.submit_renew(lease_b, 60)
        with pytest.raises(JournalCorruptError):
            await appended_a.wait()
        assert (await appended_b.wait()).first_seq == 1
        assert (await renewed_b.wait()).token == lease_b.token
        with pytest.raises(JournalCorruptError):
            await store.current_lease("A")


@pytest.mark.parametrize("head", ["9e999", "-1"])
async def test_a_mistyped_stored_head_is_damage_to_its_stream_alone(tmp_path: Path, head: str) -> None:
    path = tmp_path / "journal.db"
    async with open_sqlite_store(str(path)) as store:
        lease_a = await store.acquire_lease("A", "me", 60)
        lease_b = await store.acquire_lease("B", "me", 60)
        await store.append(_created("A", lease_a.token))
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            conn.execute(f"UPDATE journal_streams SET head={head} WHERE stream_id='A/root'")
        with store.grouped():
            appended_a = store.submit(_created("A", lease_a.token))
            appended_b = store.submit(_created("B", lease_b.token))
        with pytest.raises(JournalCorruptError, match="the stored rows of 'A/root' are damaged"):
            await appended_a.wait()
        assert (await appended_b.wait()).first_seq == 1
        with pytest.raises(JournalCorruptError):
            await store.stream_info("A/root")
        with pytest.raises(JournalCorruptError):
            await store.streams("A")


async def _two_sessions(path: Path) -> None:
    """Sessions s and t, one stream of five events each (the first request a command), closed."""
    from trio_agent._journal._durable import open_journal

    async with open_sqlite_store(str(path)) as store:
        for session in ("s", "t"):
            async with open_journal(store, session_id=session, snapshot_every=None) as journal:
                for index in range(4):
                    accepted = RequestAccepted(request_id=f"r{index}", command_id=f"c{index}", input={})
                    await journal.append(accepted, command_id=f"c{index}" if index == 0 else None)


async def _replayed(store: Any, stream_id: str) -> list[int]:
    from trio_agent._journal._subscribe import DurableEvent, subscribe_durable_events

    seqs: list[int] = []
    async with subscribe_durable_events(store, stream_id) as sub:
        async for item in sub:
            if not isinstance(item, DurableEvent):
                return seqs  # CaughtUp
            seqs.append(item.envelope.seq)
    return seqs


# One stored value of another type than its column's, as an edited file holds it.
# A negative head is an int, but no head the store writes: a subscription from the start took it
# for the caller's cursor being past the head (CursorError), not damage.
_STREAM_ROW_EDITS = ["head='abc'", "head=3.5", "head=-1", "session_id=x'00ff'"]


@pytest.mark.parametrize("edit", _STREAM_ROW_EDITS)
async def test_a_mistyped_stream_row_fails_the_reads_of_its_stream_alone_naming_it(tmp_path: Path, edit: str) -> None:
    # It was a whole-file "not a readable trio_agent journal" naming no stream, and the listing
    # of every session's streams failed with it.
    path = tmp_path / "journal.db"
    await _two_sessions(path)
    _sql(path, f"UPDATE journal_streams SET {edit} WHERE stream_id='s/root'")
    named = re.escape("stored event s/root#head is corrupt: the stream's row is damaged")
    async with open_sqlite_store(str(path), readonly=True) as store:
        with pytest.raises(JournalCorruptError, match=named):
            await store.stream_info("s/root")
        with pytest.raises(JournalCorruptError, match=named):
            await store.streams("s")  # the session its stream id names, whatever its row says
        with pytest.raises(JournalCorruptError, match=named):
            await store.streams()
        with pytest.raises(JournalCorruptError, match=named):
            await _replayed(store, "s/root")
        assert [info.stream_id for info in await store.streams("t")] == ["t/root"]
        assert await _replayed(store, "t/root") == [1, 2, 3, 4, 5]
        rows = await store._listed_streams()
        assert [type(row).__name__ for row in rows] == ["DamagedStream", "StreamInfo"]
        assert rows[0].stream_id == "s/root" and rows[0].session_id == "s"


async def test_a_negative_head_is_damage_to_a_read_even_with_no_rows_to_contradict_it(tmp_path: Path) -> None:
    # decode_range read 1..head: from 1 to -1 is nothing, so the stream read as empty.
    path = tmp_path / "journal.db"
    await _two_sessions(path)
    _sql(path, "INSERT INTO journal_streams VALUES ('u/root', 'u', -1)")
    async with open_sqlite_store(str(path), readonly=True) as store:
        with pytest.raises(JournalCorruptError, match=r"u/root#head is corrupt: .* the stored head is -1 \(below 0\)"):
            await store.read("u/root")


@pytest.mark.parametrize("edit", ["owner=x'00ff'", "token='abc'", "expires_at='soon'"])
async def test_a_mistyped_lease_row_fails_the_lease_reads_of_its_session_alone_naming_it(
    tmp_path: Path, edit: str
) -> None:
    path = tmp_path / "journal.db"
    await _two_sessions(path)
    _sql(path, f"UPDATE journal_leases SET {edit} WHERE session_id='s'")
    async with open_sqlite_store(str(path), readonly=True) as store:
        with pytest.raises(JournalCorruptError, match="the stored lease of session 's' is damaged"):
            await store.current_lease("s")
        lease = await store.current_lease("t")
        assert lease is not None and lease.session_id == "t"
        assert await _replayed(store, "s/root") == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("edit", ["digest=x'00'", "first_seq='abc'", "last_seq=2.5"])
async def test_a_mistyped_command_row_fails_the_command_reads_of_its_stream_alone_naming_it(
    tmp_path: Path, edit: str
) -> None:
    path = tmp_path / "journal.db"
    await _two_sessions(path)
    _sql(path, f"UPDATE journal_commands SET {edit} WHERE stream_id='s/root'")
    async with open_sqlite_store(str(path), readonly=True) as store:
        for read in (store.command("s/root", "c0"), store.commands("s/root")):
            with pytest.raises(JournalCorruptError, match="the stored command records of 's/root' are damaged"):
                await read
        assert [record.command_id for record in await store.commands("t/root")] == ["c0"]


@pytest.mark.parametrize("edit", _STREAM_ROW_EDITS)
def test_journal_show_marks_a_damaged_stream_row_and_shows_every_other_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: str
) -> None:
    from trio_agent._journal._inspect import show_journal

    path = tmp_path / "journal.db"
    trio.run(_two_sessions, path)
    _sql(path, f"UPDATE journal_streams SET {edit} WHERE stream_id='s/root'")
    for session in (None, "s"):
        assert show_journal(str(path), session) == 1
        out, err = capsys.readouterr()
        assert "  stream s/root (its stream row is damaged)\n    damaged at #head: stored event s/root#head" in out
        assert err.startswith("error: stored event s/root#head is corrupt: the stream's row is damaged")
        assert len(err.splitlines()) == 1
    assert show_journal(str(path)) == 1
    out = capsys.readouterr().out
    assert "session t: 1 agent stream(s)" in out and "  stream t/root (5 events)" in out
    assert "request r3 accepted" in out.split("stream t/root")[1]
    assert show_journal(str(path), "t") == 0  # the other session: as if nothing were damaged
    assert "damaged" not in capsys.readouterr().out


def test_journal_show_marks_a_damaged_lease_row_and_shows_every_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trio_agent._journal._inspect import show_journal

    path = tmp_path / "journal.db"
    trio.run(_two_sessions, path)
    _sql(path, "UPDATE journal_leases SET owner=x'00ff' WHERE session_id='s'")
    assert show_journal(str(path)) == 1
    out, err = capsys.readouterr()
    assert out.startswith(
        "session s: 1 agent stream(s), lease row damaged\n"
        "  lease row damaged: the stored lease of session 's' is damaged: a stored id is not text: b'\\x00\\xff'\n"
        "  stream s/root (5 events)\n"
    )
    assert "session t: 1 agent stream(s), lease token" in out and "  stream t/root (5 events)" in out
    assert err == "error: the stored lease of session 's' is damaged: a stored id is not text: b'\\x00\\xff'\n"


async def test_a_read_in_flight_while_the_store_closes_ends_with_its_result(tmp_path: Path) -> None:
    # The close closed every read connection, the one a read in flight used too: the read raised
    # sqlite3's own error, or a JournalCorruptError, though nothing was damaged.
    import threading

    path = tmp_path / "journal.db"
    store_block = open_sqlite_store(str(path))
    store = await store_block.__aenter__()
    try:
        lease = await store.acquire_lease("A", "me", 60)
        await store.append(_created("A", lease.token))
        entered, go = threading.Event(), threading.Event()

        def slow(conn: sqlite3.Connection) -> int:
            entered.set()
            go.wait(10)
            count: int = conn.execute("SELECT count(*) FROM journal_events").fetchone()[0]
            return count

        results: list[int] = []
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                results.append(await store._read(slow))

            nursery.start_soon(read)
            await trio.to_thread.run_sync(entered.wait)
            await store.aclose()  # while the read runs
            go.set()
        assert results == [1]
        with pytest.raises(JournalError, match="closed"):
            store._with_reader(slow)
    finally:
        await store_block.__aexit__(None, None, None)


# ---------------------------------------------------------------- stored payloads a reopen must refuse


def _rows(path: Path, stream: str = "s/root") -> list[tuple[int, dict[str, Any]]]:
    return [
        (seq, json.loads(body))
        for seq, body in _sql(path, "SELECT seq, body FROM journal_events WHERE stream_id=? ORDER BY seq", (stream,))
    ]


def _rewrite_event(path: Path, kind: str, edit: Any) -> int:
    """Rewrite the first stored event of type *kind* (checksum recomputed, snapshots dropped); its seq."""
    seq = next(seq for seq, row in _rows(path) if row["event"]["type"] == kind)

    def rewrite(body: str) -> str:
        row = json.loads(body)
        edit(row["event"])
        return json.dumps(row, separators=(",", ":"))

    _edit_body(path, "s/root", seq, rewrite, fix_checksum=True)
    _sql(path, "DELETE FROM journal_snapshots")  # the events decide
    return seq


async def test_a_run_paused_whose_state_does_not_decode_fails_the_open_naming_its_row(tmp_path: Path) -> None:
    from trio_agent import PausedReply, define_tool, open_session
    from trio_agent.testing import Reply, TestModel

    @define_tool(name="deploy", description="d", input_schema={"type": "object"}, side_effect=SideEffect.NON_IDEMPOTENT)
    async def deploy(input: dict[str, Any], ctx: Any) -> str:
        return "deployed"

    path = tmp_path / "j.db"

    def opened() -> Any:
        model = TestModel(default=Reply(tool_calls=[("deploy", {})]))
        options: Any = {"permissions": {"ask": ["deploy"]}, "permission_asks": "interrupt"}
        return open_session(provider=model, tools=[deploy], journal=path, session_id="s", **options)

    async with opened() as session:
        assert isinstance(await session.send("go"), PausedReply)
    seq = _rewrite_event(path, "run_paused", lambda event: event.__setitem__("state", {"bogus": 1}))
    # It was a continuation refused for ever (invalid_payload, naming no row), the session stuck paused.
    with pytest.raises(JournalCorruptError, match=rf"'s/root' .* at seq {seq}: run_paused .*does not decode"):
        async with opened():
            pass


async def test_read_conversation_refuses_a_stream_a_reopen_refuses(tmp_path: Path) -> None:
    from trio_agent import open_session
    from trio_agent.journal import read_conversation
    from trio_agent.testing import Reply, TestModel

    path = tmp_path / "j.db"
    async with open_session(provider=TestModel(default=Reply(text="hi")), journal=path, session_id="s") as session:
        await session.send("go")
    seq = _rewrite_event(path, "request_started", lambda event: event.__setitem__("request_id", "someone-else"))
    async with open_sqlite_store(path, readonly=True) as store:
        with pytest.raises(
            JournalCorruptError, match=rf"'s/root' breaks the journal's rules at seq {seq}: request_started"
        ):
            await read_conversation(store, "s")


def test_a_snapshot_whose_paused_state_does_not_decode_is_not_restored() -> None:
    # `decode_snapshot` ignores a snapshot it cannot restore (with a warning) and the events decide.
    from trio_agent._journal._projection import Projection, _State

    state = _State()
    state.paused["r1"] = {"bogus": 1}
    with pytest.raises(JournalCorruptError, match="the paused state of request 'r1' does not decode"):
        Projection.restored("s/root", state)


@pytest.mark.parametrize("messages", [[5], "a note", []], ids=["int", "str", "empty"])
async def test_an_inbox_note_whose_messages_do_not_decode_fails_the_open_naming_its_row(
    tmp_path: Path, messages: object
) -> None:
    """What a stored ``inbox_noted`` holds goes back in the inbox on reopen: one that does not
    decode is a typed error of that open (naming its row), never a note of some other text."""
    from trio_agent import define_tool, open_session
    from trio_agent.testing import Reply, TestModel
    from trio_agent.tools import Effect

    @define_tool(name="note", description="n", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
    async def note(input: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Effect("new_messages", ["remember this"]))
        return "noted"

    path = tmp_path / "j.db"

    def opened(**options: Any) -> Any:
        model = TestModel(default=Reply(tool_calls=[("note", {})]))
        return open_session(provider=model, tools=[note], journal=path, session_id="s", **options)

    async with opened(max_turns=1) as session:
        await session.send("go")
    seq = _rewrite_event(path, "inbox_noted", lambda event: event.__setitem__("messages", messages))
    with pytest.raises(JournalCorruptError, match=rf"s/root#{seq} is corrupt: .*messages"):
        async with opened():
            pass
