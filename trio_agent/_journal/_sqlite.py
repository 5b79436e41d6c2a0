"""The SQLite journal store: the embedded default.

* WAL with ``synchronous=FULL``: the WAL is fsynced at every COMMIT, so a
  committed event survives an OS crash or power loss (if the disk honours
  flushes). A torn tail of the WAL fails its checksum and is never read as committed.
* One writer thread (`WriterLane`) owns the only write connection and group
  commits: every append queued while it was busy goes into one ``BEGIN
  IMMEDIATE`` transaction, one savepoint per append, and waiters are woken only
  after COMMIT returned.
* Readers use their own read-only connections in Trio worker threads (WAL lets
  them read while the writer writes), bounded by their own limiter so tool
  threads cannot starve the journal.
* Several processes may share one file: ``BEGIN IMMEDIATE`` serialises their
  writers, and the lease check inside each append's transaction is the fence.
  Live subscribers in another process learn of appends by polling: one read of the
  heads of every waited-on stream per ``poll_interval``, however many wait (`AppendWaits`).

The clock decides lease expiry and is called from the writer thread, inside the
write transaction (after the lock is taken), so it must be thread-safe (the
default is `time.time`).

Every event row carries the checksum of `_codec` (schema version 2). A version-1
file is migrated on its first write-open, in one transaction: the ``checksum``
column is added and filled for every existing row, which is thereby taken on
trust. A read-only store reads a version-1 file as it is, verifying no checksum.

Snapshots (`_snapshot`) live in ``journal_snapshots`` (one row per stream: seq, the
token that wrote it, the body bytes and their checksum by the same rule). The table,
and an index of commands by position, are created if missing on every write-open,
with no format change: they are additive, code that predates them never reads them,
and a snapshot stays true whatever is appended after it (events are never rewritten),
so a file can go back and forth between versions. A read-only store of a file that
has no such table reads no snapshot.

Bodies are encoded and checksummed before ``BEGIN IMMEDIATE``, so the write lock
is held only for the checks and a few set-wide statements; the longest hold is
`statistics()` ``["longest_write_hold"]``.

Closing is bounded by ``cleanup_grace`` (see `WriterLane`): a write still running
then finishes, commits or rolls back whole, in the writer thread after `aclose`
returned, and that thread closes the write connection itself.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import attrs
import trio

from .._cleanup import DEFAULT_CLEANUP_GRACE, validate_cleanup_grace
from .._config import validate_limit
from .._errors import (
    ConfigError,
    JournalCorruptError,
    JournalError,
    LeaseLostError,
)
from .._util import safe_repr
from ._codec import EventRow, commit_encoded, decode_range, row_checksum, row_error, verify_snapshot
from ._events import EventEnvelope
from ._lane import LaneStore, LeaseOp, SnapshotWork, WriterLane, close_in_thread
from ._lease import keeping_leases
from ._store import (
    AppendBatch,
    AppendResult,
    AppendWaits,
    Clock,
    CommandRecord,
    Lease,
    LeaseRow,
    StreamInfo,
    decide_append,
    decide_lease,
    decide_snapshot,
    releases,
    unavailable,
    wall_clock,
)

__all__ = ["DamagedStream", "SQLiteStore", "open_sqlite_store"]

STORE_FORMAT = "trio_agent.journal/2"
V1_FORMAT = "trio_agent.journal/1"
"""Before event checksums: migrated on the first write-open, read as it is by a read-only store."""

_EVENTS_TABLE = (
    "CREATE TABLE IF NOT EXISTS {name}("
    " stream_id TEXT NOT NULL, seq INTEGER NOT NULL, token INTEGER NOT NULL, body TEXT NOT NULL,"
    " checksum INTEGER NOT NULL, PRIMARY KEY(stream_id, seq)) WITHOUT ROWID"
)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS journal_meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS journal_streams("
    " stream_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, head INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS journal_streams_session ON journal_streams(session_id, stream_id)",
    _EVENTS_TABLE.format(name="journal_events"),
    "CREATE TABLE IF NOT EXISTS journal_leases("
    " session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL, expires_at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS journal_commands("
    " stream_id TEXT NOT NULL, command_id TEXT NOT NULL, digest TEXT NOT NULL,"
    " first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, PRIMARY KEY(stream_id, command_id)) WITHOUT ROWID",
    # Additive, created if missing (see the module docstring): no format change.
    "CREATE INDEX IF NOT EXISTS journal_commands_seq ON journal_commands(stream_id, first_seq)",
    "CREATE TABLE IF NOT EXISTS journal_snapshots("
    " stream_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, token INTEGER NOT NULL, body BLOB NOT NULL,"
    " checksum INTEGER NOT NULL)",
)

_UPSERT_SNAPSHOT = (
    "INSERT INTO journal_snapshots(stream_id, seq, token, body, checksum) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT(stream_id) DO UPDATE SET seq=excluded.seq, token=excluded.token, body=excluded.body,"
    " checksum=excluded.checksum"
)


_INSERT_EVENTS = "INSERT INTO journal_events(stream_id, seq, token, body, checksum) VALUES (?, ?, ?, ?, ?)"


def _sql_checksum(stream_id: object, seq: object, body: object) -> int:
    """`row_checksum` as an SQL function, for the migration (a value of the wrong type: -1, never a match)."""
    if not isinstance(stream_id, bytes) or type(seq) is not int or not isinstance(body, bytes):
        return -1
    return row_checksum(stream_id, seq, body)


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Version 1 -> 2, inside the caller's write transaction: rebuild the events table with a
    ``checksum NOT NULL`` column filled from the rows as they are (taken on trust). NOT NULL
    without a default, so a version-1 process still writing to the file is refused, not trusted."""
    conn.create_function("trio_agent_row_checksum", 3, _sql_checksum, deterministic=True)
    conn.execute("DROP TABLE IF EXISTS journal_events_v2")
    conn.execute(_EVENTS_TABLE.format(name="journal_events_v2"))
    conn.execute(
        "INSERT INTO journal_events_v2(stream_id, seq, token, body, checksum)"
        " SELECT stream_id, seq, token, body,"
        " trio_agent_row_checksum(CAST(stream_id AS BLOB), seq, CAST(body AS BLOB)) FROM journal_events"
    )
    conn.execute("DROP TABLE journal_events")
    conn.execute("ALTER TABLE journal_events_v2 RENAME TO journal_events")
    conn.execute("UPDATE journal_meta SET value=? WHERE key='format'", (STORE_FORMAT,))


class _Isolate(Exception):
    """The batched write failed in a way one item may have caused: redo it item by item."""


_UNWRITABLE: tuple[type[Exception], ...] = (UnicodeError, ValueError, sqlite3.InterfaceError, sqlite3.DataError)
"""What the driver or SQLite raises for one item it cannot bind or keep (an id it cannot encode, a
value past SQLite's length limit: SQLITE_TOOBIG is `sqlite3.DataError`): that item's refusal alone."""
_UNWRITABLE_ROWS: tuple[type[Exception], ...] = (*_UNWRITABLE, sqlite3.IntegrityError)
"""The same, and a constraint one item's rows break, where they are written."""


class _Rejected(Exception):
    """Carries a per-item refusal out of a savepoint."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_BUSY_TIMEOUT = 30.0
"""Seconds a connection waits for another's lock before SQLite answers busy (tests shorten it)."""


def _connect(path: str, *, readonly: bool) -> sqlite3.Connection:
    # ``timeout`` is SQLite's busy timeout: the driver sets it on the connection.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT)
    if readonly:
        try:
            conn.execute("PRAGMA query_only=ON")
        except BaseException:
            conn.close()  # now: an error's traceback would otherwise keep the file open
            raise
    return conn


_DAMAGE_CODES = frozenset({1, 11, 26})
"""SQLITE_ERROR (our own fixed statements fail only if the schema was damaged: "no such
column"), SQLITE_CORRUPT, SQLITE_NOTADB. Busy, locked, I/O and full stay `JournalUnavailableError`."""


def _is_damage(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    text = str(exc)
    if isinstance(code, int) and code & 0xFF in _DAMAGE_CODES:
        return True
    # Python's own "Could not decode to UTF-8" carries no SQLite code: stored text that is not UTF-8.
    return "not a database" in text or "malformed" in text or "decode" in text


_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
"""SQLite's INTEGER range: a bound past it binds as OverflowError, a builtin error."""


def _after(after: int) -> int:
    """A ``seq > after`` bound in SQLite's range, meaning the same: no seq lies past the largest."""
    return after if _INT_MIN <= after <= _INT_MAX else max(_INT_MIN, min(after, _INT_MAX))


def _limit(limit: int | None) -> int:
    """A ``LIMIT`` in SQLite's range (-1: none): more rows than the range counts is no limit."""
    return -1 if limit is None or limit > _INT_MAX else max(limit, 0)


class _StoredValueError(ValueError):
    """A stored value of another type than its column's (an edited or damaged file): that row is
    damage. A `ValueError`, so a write that meets it is redone item by item and fails alone."""


def _int(value: object) -> int:
    if type(value) is int:
        return value
    raise _StoredValueError(f"a stored count or token is not an integer: {value!r}")


def _head(value: object) -> int:
    """A stored head: a count of events, never below 0 (the store never writes one; a subscription
    would take it for the caller's cursor being past the head)."""
    head = _int(value)
    if head < 0:
        raise _StoredValueError(f"the stored head is {head} (below 0)")
    return head


def _float(value: object) -> float:
    if type(value) is float and value == value:  # not NaN (an expiry may be infinite)
        return value
    if type(value) is int:
        return float(value)
    raise _StoredValueError(f"a stored time is not a number: {value!r}")


def _text(value: object) -> str:
    if type(value) is str:
        return value
    raise _StoredValueError(f"a stored id is not text: {value!r}")


def _lease_row(owner: object, token: object, expires_at: object) -> LeaseRow:
    """A stored lease row (owner, token, expires_at), checked."""
    return (_text(owner), _int(token), _float(expires_at))


def _stream_row(session_id: object, head: object) -> tuple[str, int]:
    """A stored stream row (session_id, head), checked."""
    return (_text(session_id), _head(head))


def _damaged(work: Any, exc: _StoredValueError) -> JournalCorruptError:
    """The error of a write whose stored rows are damaged: it fails alone, as damage."""
    if isinstance(work, LeaseOp):
        return _lease_damage(work.session_id, exc)
    error = JournalCorruptError(
        f"the stored rows of {work.write.stream_id if isinstance(work, SnapshotWork) else work.stream_id!r}"
        f" are damaged: {exc}"
    )
    error.__cause__ = exc
    return error


def _lease_damage(session_id: str, exc: _StoredValueError) -> JournalCorruptError:
    """A damaged lease row fails its own session alone, and says whose it is."""
    error = JournalCorruptError(f"the stored lease of session {session_id!r} is damaged: {exc}")
    error.__cause__ = exc
    return error


def _command_damage(stream_id: str, exc: _StoredValueError) -> JournalCorruptError:
    error = JournalCorruptError(f"the stored command records of {stream_id!r} are damaged: {exc}")
    error.__cause__ = exc
    return error


@attrs.frozen
class DamagedStream:
    """A ``journal_streams`` row holding a value of another type than its column's (an edited file),
    as `SQLiteStore._listed_streams` lists it: the damage of that stream alone."""

    stream_id: str  # as stored; its repr when the stored one is no text
    session_id: str | None  # as stored, else the session the stream id names (None: it names none)
    error: JournalCorruptError  # names ``stream#head``


def _stream_row_of(stream_id: object, session_id: object, head: object) -> StreamInfo | DamagedStream:
    """A stored stream row, checked: a value of another type is that stream's damage, named."""
    try:
        return StreamInfo(_text(stream_id), _text(session_id), _head(head))
    except _StoredValueError as exc:
        name = stream_id if type(stream_id) is str else repr(stream_id)
        error = row_error(name, "head", f"the stream's row is damaged: {exc}")
        error.__cause__ = exc
        if type(session_id) is not str:  # stream ids are "<session>/<agent>", neither holding a "/"
            session_id = name.partition("/")[0] if type(stream_id) is str and "/" in name else None
        return DamagedStream(name, session_id, error)


def _bindable(text: str) -> bool:
    """Whether SQLite can bind *text* (valid UTF-8: no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _corrupt(path: str, exc: BaseException) -> JournalCorruptError:
    error = JournalCorruptError(f"{path} is not a readable trio_agent journal: {exc}")
    error.__cause__ = exc
    return error


def _open_error(path: str, exc: sqlite3.DatabaseError | UnicodeDecodeError) -> JournalError:
    """What an open that failed with ``exc`` raises: damage is `JournalCorruptError`; a file
    SQLite could not open or lock (busy, locked, I/O, permissions, a directory) is
    `JournalUnavailableError`."""
    if isinstance(exc, sqlite3.OperationalError) and not _is_damage(exc):
        return unavailable(exc, f"cannot open the journal {path}")
    return _corrupt(path, exc)


class SQLiteStore(LaneStore):
    """A `JournalStore` in one SQLite file. Open it with `open_sqlite_store`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Clock = wall_clock,
        poll_interval: float = 0.05,
        readonly: bool = False,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    ) -> None:
        self.cleanup_grace = validate_cleanup_grace(cleanup_grace)
        self.path = os.fspath(path)
        self.readonly = readonly
        self.clock = clock
        self.poll_interval = poll_interval
        self._writer: sqlite3.Connection | None = None
        self._lane: WriterLane | None = None
        self._readers: list[sqlite3.Connection] = []  # idle read connections
        self._readers_closed = False  # from the close on: a read in flight closes its own connection
        self._reader_lock = threading.Lock()
        self._read_limiter = trio.CapacityLimiter(4)
        self._changed = AppendWaits()
        self._closed = False
        self._verify = True  # the rows carry checksums (schema version 2)
        self._snapshots: bool | None = None if readonly else True  # whether journal_snapshots exists

    def _not_open(self) -> str:
        return (
            "the SQLite store is read-only" if self.readonly else "the SQLite store is not open (use open_sqlite_store)"
        )

    # -- opening and closing

    def _open_writer(self) -> sqlite3.Connection:
        try:
            conn = _connect(self.path, readonly=False)
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
            raise _open_error(self.path, exc) from exc
        try:
            self._prepare_writer(conn)
        except BaseException as exc:
            # Closed now, not when the error's traceback is dropped: it holds the file and its -wal/-shm open.
            conn.close()
            if isinstance(exc, (sqlite3.DatabaseError, UnicodeDecodeError)):  # UnicodeDecodeError: damaged schema text
                raise _open_error(self.path, exc) from exc
            raise
        return conn

    def _prepare_writer(self, conn: sqlite3.Connection) -> None:
        # Read-only checks first: a file that is not a journal of ours (another application's
        # database, another format, damage) is refused as it was, before WAL mode is set (which
        # rewrites the file's header and stays).
        conn.execute("BEGIN")
        try:
            self._journal_format(conn)
        finally:
            if conn.in_transaction:  # not after an error SQLite rolled back itself: that would hide it
                conn.execute("ROLLBACK")
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise JournalCorruptError(f"{self.path} failed SQLite's integrity check: {check}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise JournalError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = self._journal_format(conn)  # again under the lock: another process may have written since
            for statement in _SCHEMA:
                conn.execute(statement)
            if found is None:
                conn.execute("INSERT INTO journal_meta(key, value) VALUES ('format', ?)", (STORE_FORMAT,))
            elif found == V1_FORMAT:
                _migrate_v1(conn)  # the same transaction: a crash leaves the file at version 1
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _journal_format(self, conn: sqlite3.Connection) -> str | None:
        """The file's journal format (None: a new file, or a journal's tables without the format row),
        read inside the caller's transaction; `JournalCorruptError` for a file that is not a journal
        of this code's: another application's database, another format."""
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            return None
        if "journal_meta" not in tables:
            raise JournalCorruptError(
                f"{self.path} is another application's SQLite database (tables: "
                f"{', '.join(sorted(tables)[:5])}), not a trio_agent journal; it was left unchanged"
            )
        row = conn.execute("SELECT value FROM journal_meta WHERE key='format'").fetchone()
        if row is None:
            return None
        if row[0] not in (STORE_FORMAT, V1_FORMAT):
            raise JournalCorruptError(f"{self.path} holds journal format {row[0]!r}; this code reads {STORE_FORMAT!r}")
        found: str = row[0]
        return found

    def _check_readable(self) -> None:
        if not os.path.exists(self.path):
            raise JournalError(f"no journal at {self.path}")
        # The readers' own kind of connection (read-write, query_only), not ``mode=ro``: a ``mode=ro``
        # connection creates the ``-wal``/``-shm`` files of a WAL journal but can never remove them,
        # so a file found damaged here (no reader ever opens it) kept both behind.  The last
        # read-write connection to close removes them, as SQLite does for every reader.
        try:
            with contextlib.closing(_connect(self.path, readonly=True)) as conn:
                row = conn.execute("SELECT value FROM journal_meta WHERE key='format'").fetchone()
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
            # As the write-open: damage is corrupt; busy, locked, permissions, a directory are not.
            raise _open_error(self.path, exc) from exc
        if row is None or row[0] not in (STORE_FORMAT, V1_FORMAT):
            found = None if row is None else row[0]
            raise JournalCorruptError(f"{self.path} holds journal format {found!r}; this code reads {STORE_FORMAT!r}")
        # Never migrated from here: a version-1 file is read as it is, without checksums.
        self._verify = row[0] == STORE_FORMAT

    async def _open(self, max_batch: int) -> None:
        max_batch = validate_limit(max_batch, name="max_batch")  # before the file is touched
        if self.readonly:
            await trio.to_thread.run_sync(self._check_readable)
            return
        self._writer = await trio.to_thread.run_sync(self._open_writer)
        self._lane = WriterLane(
            f"trio_agent journal writer ({os.path.basename(self.path)})",
            self._commit,
            on_committed=self._committed,
            on_stop=self._close_writer,  # in the writer thread: never under a running transaction
            max_batch=max_batch,
            cleanup_grace=self.cleanup_grace,
        )
        self._lane.start()

    async def aclose(self) -> None:
        """Drain the writer and close every connection, within ``cleanup_grace`` seconds in all."""
        if self._closed:
            return
        self._closed = True
        deadline = trio.current_time() + self.cleanup_grace
        try:
            if self._lane is not None:
                await self._lane.aclose(self.cleanup_grace)
            else:
                self._close_writer()  # read-only, or the writer thread never started: nothing is running
            name = os.path.basename(self.path)
            grace = max(deadline - trio.current_time(), 0.0)
            await close_in_thread(self._close_readers, grace, f"the SQLite journal's read connections ({name})")
        finally:
            self._changed.wake_all()

    def _close_writer(self) -> None:
        conn, self._writer = self._writer, None
        if conn is not None:
            conn.close()

    def _close_readers(self) -> None:
        # Only the idle ones: a connection a read in flight uses is closed by that read when it ends
        # (closed under it, the read raised sqlite3's own error, or its rollback did).
        with self._reader_lock:
            self._readers_closed = True
            idle, self._readers = self._readers, []
        for conn in idle:
            conn.close()

    # -- the writer thread

    def _commit(self, works: Sequence[Any]) -> list[object]:
        """One transaction for everything queued: checks in Python, then a few set-wide statements.

        If writing fails unexpectedly (an id the driver cannot encode...), the
        transaction is rolled back and redone with one savepoint per item, so only
        the culprit fails. Bodies are encoded and checksummed first, before the write
        lock is taken: other writers of the file wait only for the checks and the writes.
        """
        return commit_encoded(works, self._commit_encoded)

    def _commit_encoded(self, works: Sequence[Any], encoded: list[list[EventRow]]) -> list[object]:
        conn = self._writer
        assert conn is not None
        try:
            return self._commit_batched(conn, works, encoded)
        except _Isolate:
            return self._commit_isolated(conn, works, encoded)
        except BaseException as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            error = unavailable(exc, f"journal {self.path}: the transaction failed")
            return [error] * len(works)

    def _commit_batched(
        self, conn: sqlite3.Connection, works: Sequence[Any], encoded: list[list[EventRow]]
    ) -> list[object]:
        outcomes: list[object] = []
        leases: dict[str, LeaseRow | None] = {}
        streams: dict[str, tuple[str, int] | None] = {}
        commands: dict[tuple[str, str], tuple[str, int, int] | None] = {}
        rows: list[EventRow] = []
        heads: dict[str, tuple[str, int]] = {}
        new_commands: list[tuple[str, str, str, int, int]] = []
        conn.execute("BEGIN IMMEDIATE")
        locked = time.perf_counter()
        try:
            now = self.clock()  # once the lock is held: a wait for it never makes an expired lease look valid
            self._prefetch(conn, works, leases, streams)
            for work, work_rows in zip(works, encoded, strict=True):
                if isinstance(work, SnapshotWork):
                    try:
                        outcomes.append(self._apply_snapshot(conn, work, now, leases, streams))
                    except _Rejected as rejected:
                        outcomes.append(rejected.error)
                    except _UNWRITABLE as exc:
                        conn.execute("ROLLBACK")
                        raise _Isolate from exc
                    continue
                if not isinstance(work, AppendBatch):
                    leases.pop(work.session_id, None)  # the lease row changes now
                    try:
                        outcomes.append(self._apply_lease(conn, work, now))
                    except _Rejected as rejected:
                        outcomes.append(rejected.error)
                    except _UNWRITABLE as exc:
                        # An id the driver cannot bind (past the door's check): redo item by item.
                        conn.execute("ROLLBACK")
                        raise _Isolate from exc
                    continue
                try:
                    outcomes.append(self._check_append(conn, work, now, leases, streams, commands))
                except _Rejected as rejected:
                    outcomes.append(rejected.error)
                    continue
                if outcomes[-1] is not None and getattr(outcomes[-1], "replayed", False):
                    continue
                rows.extend(work_rows)
                streams[work.stream_id] = heads[work.stream_id] = (work.session_id, work.last_seq)
                if work.command_id is not None:
                    assert work.command_digest is not None
                    commands[(work.stream_id, work.command_id)] = (work.command_digest, work.first_seq, work.last_seq)
                    new_commands.append(
                        (work.stream_id, work.command_id, work.command_digest, work.first_seq, work.last_seq)
                    )
            try:
                conn.executemany(_INSERT_EVENTS, rows)
                conn.executemany(
                    "INSERT INTO journal_streams(stream_id, session_id, head) VALUES (?, ?, ?)"
                    " ON CONFLICT(stream_id) DO UPDATE SET head=excluded.head",
                    [(stream_id, session, head) for stream_id, (session, head) in heads.items()],
                )
                if new_commands:
                    conn.executemany(
                        "INSERT INTO journal_commands(stream_id, command_id, digest, first_seq, last_seq)"
                        " VALUES (?, ?, ?, ?, ?)",
                        new_commands,
                    )
            except (
                UnicodeError,
                ValueError,
                TypeError,
                sqlite3.InterfaceError,
                sqlite3.DataError,
                sqlite3.IntegrityError,
            ) as exc:  # `_UNWRITABLE_ROWS`, or a value of a type the driver cannot bind: perhaps one item's doing
                conn.execute("ROLLBACK")
                raise _Isolate from exc
            conn.execute("COMMIT")
        except _Isolate:
            raise
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise
        finally:
            self._held(time.perf_counter() - locked)
        return outcomes

    @staticmethod
    def _prefetch(
        conn: sqlite3.Connection,
        works: Sequence[Any],
        leases: dict[str, LeaseRow | None],
        streams: dict[str, tuple[str, int] | None],
    ) -> None:
        """Read the lease and head rows a batch needs with a few ``IN (...)`` queries, not one per append."""
        session_ids = sorted({w.session_id for w in works if isinstance(w, AppendBatch)})
        stream_ids = sorted({w.stream_id for w in works if isinstance(w, AppendBatch)})
        try:
            for start in range(0, len(session_ids), 500):
                chunk = session_ids[start : start + 500]
                for session_id in chunk:
                    leases[session_id] = None
                marks = ",".join("?" * len(chunk))
                query = f"SELECT session_id, owner, token, expires_at FROM journal_leases WHERE session_id IN ({marks})"
                for row in conn.execute(query, chunk):
                    leases[row[0]] = _lease_row(*row[1:])
            for start in range(0, len(stream_ids), 500):
                chunk = stream_ids[start : start + 500]
                for stream_id in chunk:
                    streams[stream_id] = None
                marks = ",".join("?" * len(chunk))
                query = f"SELECT stream_id, session_id, head FROM journal_streams WHERE stream_id IN ({marks})"
                for row in conn.execute(query, chunk):
                    streams[row[0]] = _stream_row(*row[1:])
        except _UNWRITABLE:
            # An id the driver cannot bind: fall back to per-append lookups, which refuse it alone.
            leases.clear()
            streams.clear()

    @staticmethod
    def _check_append(
        conn: sqlite3.Connection,
        batch: AppendBatch,
        now: float,
        leases: dict[str, LeaseRow | None],
        streams: dict[str, tuple[str, int] | None],
        commands: dict[tuple[str, str], tuple[str, int, int] | None],
    ) -> AppendResult:
        """The store's four rules for one append, against this transaction's view (cached per batch)."""
        try:
            if batch.session_id not in leases:
                row = conn.execute(
                    "SELECT owner, token, expires_at FROM journal_leases WHERE session_id=?", (batch.session_id,)
                ).fetchone()
                leases[batch.session_id] = None if row is None else _lease_row(*row)
            if batch.stream_id not in streams:
                row = conn.execute(
                    "SELECT session_id, head FROM journal_streams WHERE stream_id=?", (batch.stream_id,)
                ).fetchone()
                streams[batch.stream_id] = None if row is None else _stream_row(*row)
            key = (batch.stream_id, batch.command_id or "")
            if batch.command_id is not None and key not in commands:
                row = conn.execute(
                    "SELECT digest, first_seq, last_seq FROM journal_commands WHERE stream_id=? AND command_id=?", key
                ).fetchone()
                commands[key] = None if row is None else (_text(row[0]), _int(row[1]), _int(row[2]))
        except _StoredValueError as exc:  # this append's rows are damaged: it fails alone
            raise _Rejected(JournalCorruptError(f"the stored rows of {batch.stream_id!r} are damaged: {exc}")) from exc
        except _UNWRITABLE as exc:
            raise _Rejected(JournalError(f"the store cannot keep this append: {type(exc).__name__}: {exc}")) from exc
        try:
            return decide_append(
                batch,
                lease=leases[batch.session_id],
                stream=streams[batch.stream_id],
                command=None if batch.command_id is None else commands[(batch.stream_id, batch.command_id)],
                now=now,
            )
        except (JournalError, LeaseLostError) as refusal:
            raise _Rejected(refusal) from None

    def _commit_isolated(
        self, conn: sqlite3.Connection, works: Sequence[Any], encoded: list[list[EventRow]]
    ) -> list[object]:
        """The fallback: one savepoint per item, so an item that cannot be written fails alone."""
        outcomes: list[object] = []
        conn.execute("BEGIN IMMEDIATE")
        locked = time.perf_counter()
        try:
            now = self.clock()
            for work, work_rows in zip(works, encoded, strict=True):
                conn.execute("SAVEPOINT item")  # one name: the statement cache keeps it prepared
                try:
                    if isinstance(work, AppendBatch):
                        outcome: object = self._apply_append(conn, work, work_rows, now)
                    elif isinstance(work, SnapshotWork):
                        outcome = self._apply_snapshot(conn, work, now, {}, {})
                    else:
                        outcome = self._apply_lease(conn, work, now)
                except _Rejected as rejected:
                    conn.execute("ROLLBACK TO item")
                    outcome = rejected.error
                except _StoredValueError as exc:  # a row it reads is damaged (a `ValueError`: caught first)
                    conn.execute("ROLLBACK TO item")
                    outcome = _damaged(work, exc)
                except _UNWRITABLE_ROWS as exc:
                    conn.execute("ROLLBACK TO item")
                    what = {AppendBatch: "append", SnapshotWork: "snapshot"}.get(type(work), "lease operation")
                    outcome = JournalError(f"the store cannot keep this {what}: {type(exc).__name__}: {exc}")
                conn.execute("RELEASE item")
                outcomes.append(outcome)
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            error = unavailable(exc, f"journal {self.path}: the transaction failed")
            return [error] * len(works)
        finally:
            self._held(time.perf_counter() - locked)
        return outcomes

    @staticmethod
    def _apply_append(conn: sqlite3.Connection, batch: AppendBatch, rows: list[EventRow], now: float) -> AppendResult:
        """The fallback path: one append checked and written on its own (inside its savepoint)."""
        streams: dict[str, tuple[str, int] | None] = {}
        result = SQLiteStore._check_append(conn, batch, now, {}, streams, {})
        if result.replayed:
            return result
        stream = streams[batch.stream_id]
        conn.executemany(_INSERT_EVENTS, rows)
        if stream is None:
            conn.execute(
                "INSERT INTO journal_streams(stream_id, session_id, head) VALUES (?, ?, ?)",
                (batch.stream_id, batch.session_id, batch.last_seq),
            )
        else:
            conn.execute("UPDATE journal_streams SET head=? WHERE stream_id=?", (batch.last_seq, batch.stream_id))
        if batch.command_id is not None:
            conn.execute(
                "INSERT INTO journal_commands(stream_id, command_id, digest, first_seq, last_seq)"
                " VALUES (?, ?, ?, ?, ?)",
                (batch.stream_id, batch.command_id, batch.command_digest, batch.first_seq, batch.last_seq),
            )
        return result

    @staticmethod
    def _apply_snapshot(
        conn: sqlite3.Connection,
        work: SnapshotWork,
        now: float,
        leases: dict[str, LeaseRow | None],
        streams: dict[str, tuple[str, int] | None],
    ) -> None:
        """Check one snapshot against this transaction's view (the batch's earlier appends
        included) and write it."""
        write = work.write
        if write.session_id not in leases:
            row = conn.execute(
                "SELECT owner, token, expires_at FROM journal_leases WHERE session_id=?", (write.session_id,)
            ).fetchone()
            leases[write.session_id] = None if row is None else _lease_row(*row)
        if write.stream_id not in streams:
            row = conn.execute(
                "SELECT session_id, head FROM journal_streams WHERE stream_id=?", (write.stream_id,)
            ).fetchone()
            streams[write.stream_id] = None if row is None else _stream_row(*row)
        try:
            decide_snapshot(write, lease=leases[write.session_id], stream=streams[write.stream_id], now=now)
        except (JournalError, LeaseLostError) as refusal:
            raise _Rejected(refusal) from None
        conn.execute(_UPSERT_SNAPSHOT, (write.stream_id, write.seq, write.token, write.body, work.checksum))

    @staticmethod
    def _apply_lease(conn: sqlite3.Connection, op: LeaseOp, now: float) -> Lease | None:
        found = conn.execute(
            "SELECT owner, token, expires_at FROM journal_leases WHERE session_id=?", (op.session_id,)
        ).fetchone()
        row: LeaseRow | None = None if found is None else _lease_row(*found)
        if op.kind == "release":
            if releases(row, op.token):
                conn.execute("UPDATE journal_leases SET expires_at=? WHERE session_id=?", (-1e300, op.session_id))
            return None
        try:
            lease = decide_lease(op.kind, op.session_id, op.owner, op.token, op.ttl, row, now)
        except (JournalError, LeaseLostError) as refusal:
            raise _Rejected(refusal) from None
        assert lease is not None
        conn.execute(
            "INSERT INTO journal_leases(session_id, owner, token, expires_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT(session_id) DO UPDATE SET owner=excluded.owner, token=excluded.token,"
            " expires_at=excluded.expires_at",
            (lease.session_id, lease.owner, lease.token, lease.expires_at),
        )
        return lease

    def _committed(self, works: Sequence[Any], outcomes: list[object]) -> None:
        for work, outcome in zip(works, outcomes, strict=True):
            if isinstance(work, AppendBatch) and isinstance(outcome, AppendResult) and not outcome.replayed:
                self._changed.wake(work.stream_id)

    # -- writes

    # -- reads

    def _with_reader(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._reader_lock:
            if self._readers_closed:
                raise JournalError("the SQLite store is closed")
            conn = self._readers.pop() if self._readers else None
        if conn is None:
            try:
                conn = _connect(self.path, readonly=True)
            except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # a driver's error never escapes a read
                raise _open_error(self.path, exc) from exc
        try:
            return fn(conn)
        except JournalError:
            raise
        except (UnicodeDecodeError, _StoredValueError) as exc:  # text that is not UTF-8, a mistyped value: damage
            raise _corrupt(self.path, exc) from exc
        except (UnicodeError, ValueError, sqlite3.InterfaceError) as exc:
            raise JournalError(f"journal {self.path}: the query cannot be run: {type(exc).__name__}: {exc}") from exc
        except sqlite3.OperationalError as exc:
            if _is_damage(exc):
                raise _corrupt(self.path, exc) from exc
            raise unavailable(exc, f"journal {self.path}: a read failed") from exc
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, exc) from exc
        finally:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            with self._reader_lock:
                closing = self._readers_closed
                if not closing:
                    self._readers.append(conn)
            if closing:
                conn.close()

    async def _read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        if self._closed:
            raise JournalError("the SQLite store is closed")
        return await trio.to_thread.run_sync(self._with_reader, fn, limiter=self._read_limiter)

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[EventEnvelope]:
        # The body as stored bytes: the checksum covers them, and text that is not UTF-8 is damage to report.
        statement = (
            f"SELECT seq, CAST(body AS BLOB), {'checksum' if self._verify else 'NULL'} FROM journal_events"
            " WHERE stream_id=? AND seq>? ORDER BY seq LIMIT ?"
        )

        def query(conn: sqlite3.Connection) -> list[EventEnvelope]:
            conn.execute("BEGIN")  # one snapshot for the head and the rows
            found = conn.execute("SELECT head FROM journal_streams WHERE stream_id=?", (stream_id,)).fetchone()
            rows = conn.execute(statement, (stream_id, _after(after), _limit(limit))).fetchall()
            conn.execute("COMMIT")
            head = None if found is None else found[0]
            if head is not None and type(head) is not int:
                raise row_error(stream_id, "head", f"the stream's head is {head!r}")
            return decode_range(stream_id, after=after, limit=limit, head=head, rows=rows)

        result: list[EventEnvelope] = await self._read(query)
        return result

    async def head(self, stream_id: str) -> int:
        info = await self.stream_info(stream_id)
        return 0 if info is None else info.head

    async def stream_info(self, stream_id: str) -> StreamInfo | None:
        def query(conn: sqlite3.Connection) -> StreamInfo | None:
            row = conn.execute(
                "SELECT session_id, head FROM journal_streams WHERE stream_id=?", (stream_id,)
            ).fetchone()
            if row is None:
                return None
            info = _stream_row_of(stream_id, row[0], row[1])
            if isinstance(info, DamagedStream):
                raise info.error
            return info

        result: StreamInfo | None = await self._read(query)
        return result

    async def streams(self, session_id: str | None = None) -> list[StreamInfo]:
        """`JournalStore.streams`; a damaged stream row raises `JournalCorruptError` naming its stream."""
        infos: list[StreamInfo] = []
        for row in await self._listed_streams(session_id):
            if isinstance(row, DamagedStream):
                raise row.error
            infos.append(row)
        return infos

    async def _listed_streams(self, session_id: str | None = None) -> list[StreamInfo | DamagedStream]:
        """`streams`, a damaged row listed as a `DamagedStream` in its place (for ``journal show``,
        which shows every other stream). A row whose session id is no text is one of the session
        its stream id names: it cannot match the session id, so the range of those names is read too."""

        def query(conn: sqlite3.Connection) -> list[StreamInfo | DamagedStream]:
            if session_id is None:
                rows = conn.execute("SELECT stream_id, session_id, head FROM journal_streams ORDER BY stream_id")
            else:
                # "<session>/" up to "<session>0" ("0" follows "/"): every "<session>/<agent>".
                rows = conn.execute(
                    "SELECT stream_id, session_id, head FROM journal_streams WHERE session_id=? UNION ALL"
                    " SELECT stream_id, session_id, head FROM journal_streams WHERE stream_id>=? AND stream_id<?"
                    " AND typeof(session_id)<>'text' ORDER BY stream_id",
                    (session_id, f"{session_id}/", f"{session_id}0"),
                )
            return [_stream_row_of(*row) for row in rows.fetchall()]

        result: list[StreamInfo | DamagedStream] = await self._read(query)
        return result

    async def command(self, stream_id: str, command_id: str) -> CommandRecord | None:
        def query(conn: sqlite3.Connection) -> CommandRecord | None:
            row = conn.execute(
                "SELECT digest, first_seq, last_seq FROM journal_commands WHERE stream_id=? AND command_id=?",
                (stream_id, command_id),
            ).fetchone()
            if row is None:
                return None
            try:
                return CommandRecord(stream_id, command_id, _text(row[0]), _int(row[1]), _int(row[2]))
            except _StoredValueError as exc:
                raise _command_damage(stream_id, exc) from exc

        result: CommandRecord | None = await self._read(query)
        return result

    async def commands(self, stream_id: str, *, after: int = 0) -> list[CommandRecord]:
        def query(conn: sqlite3.Connection) -> list[CommandRecord]:
            rows = conn.execute(
                "SELECT command_id, digest, first_seq, last_seq FROM journal_commands WHERE stream_id=?"
                " AND first_seq>? ORDER BY first_seq",
                (stream_id, _after(after)),
            ).fetchall()
            try:
                return [
                    CommandRecord(stream_id, _text(row[0]), _text(row[1]), _int(row[2]), _int(row[3])) for row in rows
                ]
            except _StoredValueError as exc:
                raise _command_damage(stream_id, exc) from exc

        result: list[CommandRecord] = await self._read(query)
        return result

    async def load_snapshot(self, stream_id: str) -> tuple[int, bytes] | None:
        def query(conn: sqlite3.Connection) -> tuple[int, bytes] | None:
            if self._snapshots is None:
                # A read-only store may read a file from before snapshots: no table, no snapshot.
                found = conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type='table' AND name='journal_snapshots'"
                ).fetchone()
                self._snapshots = found is not None
            if not self._snapshots:
                return None
            row = conn.execute(
                "SELECT seq, body, checksum FROM journal_snapshots WHERE stream_id=?", (stream_id,)
            ).fetchone()
            return None if row is None else verify_snapshot(stream_id, row[0], row[1], row[2])

        result: tuple[int, bytes] | None = await self._read(query)
        return result

    async def current_lease(self, session_id: str) -> Lease | None:
        def query(conn: sqlite3.Connection) -> Lease | None:
            row = conn.execute(
                "SELECT owner, token, expires_at FROM journal_leases WHERE session_id=?", (session_id,)
            ).fetchone()
            if row is None:
                return None
            try:
                return Lease(session_id, _text(row[0]), _int(row[1]), _float(row[2]))
            except _StoredValueError as exc:
                raise _lease_damage(session_id, exc) from exc

        result: Lease | None = await self._read(query)
        return result

    async def wait_for_append(self, stream_id: str, after: int) -> None:
        """Return once *stream_id* grew past *after*: at once for a commit of this store, within
        ``poll_interval`` for one of another process (ONE read of every waited-on stream's head
        per interval, however many wait: `AppendWaits`), or when the store closes."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        await self._changed.wait_for_append(stream_id, after, heads=self._heads, interval=self.poll_interval)

    async def _heads(self, stream_ids: Sequence[str]) -> dict[str, int | JournalError]:
        """The heads of *stream_ids* in one read (a stream with no row: absent); a damaged row's
        stream gets its `JournalCorruptError`, as `head` raises it. An id SQLite cannot bind (a lone
        surrogate: `check_id` keeps it out of the file) names no stream, and fails no one else's read."""
        stream_ids = [stream_id for stream_id in stream_ids if _bindable(stream_id)]

        def query(conn: sqlite3.Connection) -> dict[str, int | JournalError]:
            found: dict[str, int | JournalError] = {}
            conn.execute("BEGIN")  # one snapshot for every chunk
            for start in range(0, len(stream_ids), 500):
                chunk = stream_ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                statement = f"SELECT stream_id, session_id, head FROM journal_streams WHERE stream_id IN ({marks})"
                for row in conn.execute(statement, chunk).fetchall():
                    info = _stream_row_of(*row)
                    if type(row[0]) is str:
                        found[row[0]] = info.error if isinstance(info, DamagedStream) else info.head
            conn.execute("COMMIT")
            return found

        result: dict[str, int | JournalError] = await self._read(query)
        return result


def sqlite_path(path: object, what: str = "open_sqlite_store's path") -> str:
    """*path* as the file name SQLite opens; a `ConfigError` naming *what* when it cannot be one.

    Checked before anything touches the file system: not a path (``None``, a number) was a raw
    `TypeError`, a NUL character a raw `ValueError`, an empty path an open that failed on WAL mode
    (SQLite opens a temporary database for it). ``bytes`` are refused as ``open_session`` refuses
    them: the path is a text file name."""
    try:
        name = os.fspath(path) if isinstance(path, os.PathLike) else path
    except Exception as exc:  # an __fspath__ of the caller's that raises
        raise ConfigError(f"{what} {safe_repr(path)} gave no file path: {safe_repr(exc)}") from exc
    if not isinstance(name, str):
        raise ConfigError(
            f"{what} must be a file path (a str or an os.PathLike), not {type(name).__name__} {safe_repr(name)}"
        )
    if not name:
        raise ConfigError(f"{what} is empty: name the journal's file")
    if "\x00" in name:
        raise ConfigError(f"{what} {safe_repr(name)} holds a NUL character, which no file name can")
    return name


def open_sqlite_store(
    path: str | os.PathLike[str],
    *,
    clock: Clock = wall_clock,
    poll_interval: float = 0.05,
    max_batch: int = 1000,
    readonly: bool = False,
    cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
) -> AbstractAsyncContextManager[SQLiteStore]:
    """Open (creating if needed) the SQLite journal at ``path``; the store's writer thread lives inside the block.

    Raises `JournalCorruptError` if the file is not a readable journal (damaged,
    truncated, another format, another application's database). With
    ``readonly=True`` nothing is ever written (no writer thread, no lease
    operations, no schema changes) and the file must already be a journal.

    ``max_batch`` (a whole number >= 1, else `ConfigError`) bounds the items of one group commit.

    Closing (leaving the block) takes at most ``cleanup_grace`` seconds (default 10);
    a write still running then completes or rolls back whole after the block is left.

    The leases of the sessions journaled in the store are renewed from one task of the
    block (`LeaseKeeper`), in one transaction per round, not by a heartbeat task each.

    A ``path`` that cannot name a file (not a ``str`` or an ``os.PathLike`` of one, empty, or
    holding a NUL character) is a `ConfigError`.
    """
    path = sqlite_path(path)
    store = SQLiteStore(path, clock=clock, poll_interval=poll_interval, readonly=readonly, cleanup_grace=cleanup_grace)
    return SQLiteStoreBlock(store, max_batch, keep_leases=True)


class SQLiteStoreBlock:
    """`open_sqlite_store`'s block; without ``keep_leases`` (the run's shared store, which one
    task may enter and another leave) it runs no task, and each session renews its own lease."""

    __slots__ = ("_keeping", "_max_batch", "_store", "keep_leases")

    def __init__(self, store: SQLiteStore, max_batch: int, *, keep_leases: bool) -> None:
        self._store = store
        self._max_batch = max_batch
        self.keep_leases = keep_leases
        self._keeping: keeping_leases | None = None

    async def __aenter__(self) -> SQLiteStore:
        store = self._store
        await store._open(self._max_batch)
        if self.keep_leases and not store.readonly:
            keeping = keeping_leases(store)
            try:
                await keeping.__aenter__()
            except BaseException:
                await store.aclose()
                raise
            self._keeping = keeping
        return store

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        try:
            keeping = self._keeping
            return False if keeping is None else await keeping.__aexit__(exc_type, exc, traceback)
        finally:
            await self._store.aclose()
