"""The PostgreSQL journal store: several workers on several machines share one database.

* psycopg 3 **sync** connections only (its asyncio API does not run under Trio).
* One writer thread (`WriterLane`) owns the write connection and group commits:
  every append and lease operation queued while it was busy goes into ONE
  transaction. That transaction first locks the lease rows of every session it
  touches (``SELECT ... FOR UPDATE SKIP LOCKED``: it never waits, so two stores
  never deadlock and one row held elsewhere, by a process frozen half-way through
  a write, never holds the writer: that session's items are answered `Deferred`
  and wait alone, offered again in the next batches, for ``statement_timeout`` at
  most), reads the clock, the streams' heads and the command
  ids it needs, checks every item in order under those locks, then writes all
  accepted items with a few multi-row statements and commits: two pipelined
  round trips per batch whatever its size (one more when it acquires a lease).
  A refused item (stale token, sequence conflict, foreign stream, conflicting
  command, lease held) is refused before anything is written, so it never fails
  its neighbours. If a write fails anyway (a race with a stream created by
  another session, a damaged table), the batch is rolled back and redone with
  one SAVEPOINT per item, so only the culprit fails. If the transaction as a
  whole fails, every item of the batch gets `JournalUnavailableError`, except when
  the connection was lost before COMMIT was handed to it (the server dropped it:
  a restart, a failover, an idle timeout): nothing was written, so the batch is
  redone once on a fresh connection.
* The fence is checked inside the transaction that writes: the lease row is
  locked ``FOR UPDATE`` and its token and expiry compared there. By default
  (``clock=None``) the database server's ``clock_timestamp()`` decides expiry,
  so the machines' clocks do not matter.
* Readers use their own autocommit connections in Trio worker threads, bounded
  by their own limiters so tool threads cannot starve the journal. A pooled one
  the server dropped is replaced and the read (safe to repeat) run again, once. A read
  cancelled by a cancel scope is aborted on the server (``cancel_safe``) and the
  `trio.Cancelled` is delivered once the thread is back, or after
  ``cleanup_grace`` at most (the thread then closes its connection when it is
  back); ``statement_timeout`` bounds every statement server-side, and a
  transaction left idle as long is ended by the server
  (``idle_in_transaction_session_timeout``, unless the DSN sets its own).
* Connecting is cancellable: a connection made after its caller stopped waiting
  is closed by its thread. Closing the store is bounded by ``cleanup_grace``
  (see `WriterLane`: a write still running then commits or rolls back whole
  after `aclose` returned, and its thread closes the write connection).
* `wait_for_append` is woken in-process after a commit, by LISTEN/NOTIFY from
  other processes (one ``NOTIFY`` per group-commit transaction and stream,
  payload ``"<stream_id>:<head>"``, read natively with
  `trio.lowlevel.wait_readable`), and otherwise by a poll every ``poll_interval``: one
  statement reads the heads of every waited-on stream, however many tasks wait (`AppendWaits`).
  NOTIFY is only a wake-up hint: callers always re-read.

The clock, when given, is called from the writer thread, so it must be thread-safe.

Every event row carries the checksum of `_codec` (schema version 2), verified on
every read. A version-1 schema is migrated when a store first opens it, in one
transaction under the schema's advisory lock: the ``checksum`` column is added and
filled for every existing row (taken on trust), then made NOT NULL, so a
version-1 process still writing there is refused, never trusted. Bodies are
encoded and checksummed before the transaction begins; the longest transaction
is `statistics()` ``["longest_write_hold"]``.

Snapshots (`_snapshot`) live in the ``snapshots`` table (one row per stream: seq, the
token that wrote it, the body bytes and their checksum by the same rule), written
through the writer lane and fenced like appends, in the same transaction. The table
and an index of commands by position are created if missing when a store opens the
schema, with no format change: they are additive, older workers sharing the schema
never read them, and a snapshot stays true whatever is appended after it, so workers
of both versions can run side by side.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, LiteralString, TypeVar

import attrs
import psycopg
import psycopg.errors
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow

from .._cleanup import DEFAULT_CLEANUP_GRACE, bounded_shield, validate_cleanup_grace
from .._config import MAX_TIMEOUT, finite_seconds, validate_limit
from .._errors import (
    ForeignStreamError,
    JournalCorruptError,
    JournalError,
    JournalUnavailableError,
    LeaseLostError,
)
from .._groups import raise_alone
from ._codec import EventRow, commit_encoded, decode_range, row_checksum, row_error, verify_snapshot
from ._events import EventEnvelope
from ._lane import Deferred, LaneStore, LeaseOp, SnapshotWork, WriterLane, close_in_thread
from ._lease import LeaseKeeper
from ._store import (
    AppendBatch,
    AppendResult,
    AppendWaits,
    Clock,
    CommandRecord,
    Lease,
    StreamInfo,
    decide_append,
    decide_lease,
    decide_snapshot,
    releases,
    unavailable,
)

__all__ = ["PostgresStore", "open_postgres_store", "pump_notifications"]

STORE_FORMAT = "trio_agent.journal.postgres/2"
V1_FORMAT = "trio_agent.journal.postgres/1"
"""Before event checksums: migrated when a store opens the schema."""
_MIGRATE_CHUNK = 1000

_Conn = psycopg.Connection[TupleRow]
T = TypeVar("T")

_TCP_DEFAULTS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
"""The store's connections' TCP keepalives and user timeout (ms), as the workers' connections set
them; a DSN's own values win."""
_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_NOTIFY_PAYLOAD_MAX = 7999  # PostgreSQL refuses payloads of 8000 bytes or more
_CANCEL_RETRY = 0.25  # re-send a cancel request this often until the read thread is back
_MAX_READERS = 4

_SCHEMA: tuple[LiteralString, ...] = (
    "CREATE SCHEMA IF NOT EXISTS {s}",
    "CREATE TABLE IF NOT EXISTS {s}.meta(key text PRIMARY KEY, value text NOT NULL)",
    "CREATE TABLE IF NOT EXISTS {s}.streams("
    " stream_id text PRIMARY KEY, session_id text NOT NULL, head bigint NOT NULL)",
    "CREATE TABLE IF NOT EXISTS {s}.events("
    " stream_id text NOT NULL, seq bigint NOT NULL, token bigint NOT NULL, body text NOT NULL,"
    " checksum bigint NOT NULL, PRIMARY KEY(stream_id, seq))",
    # A row with token 0 is a placeholder (no lease yet) so acquisitions can lock it.
    "CREATE TABLE IF NOT EXISTS {s}.leases("
    " session_id text PRIMARY KEY, owner text NOT NULL, token bigint NOT NULL, expires_at double precision NOT NULL)",
    "CREATE TABLE IF NOT EXISTS {s}.commands("
    " stream_id text NOT NULL, command_id text NOT NULL, digest text NOT NULL,"
    " first_seq bigint NOT NULL, last_seq bigint NOT NULL, PRIMARY KEY(stream_id, command_id))",
    "CREATE TABLE IF NOT EXISTS {s}.snapshots("
    " stream_id text PRIMARY KEY, seq bigint NOT NULL, token bigint NOT NULL, body bytea NOT NULL,"
    " checksum bigint NOT NULL)",
)
_INDEXES: dict[str, LiteralString] = {
    "streams_session": "CREATE INDEX IF NOT EXISTS streams_session ON {s}.streams(session_id, stream_id)",
    # Additive, created if missing (see the module docstring): no format change.
    "commands_seq": "CREATE INDEX IF NOT EXISTS commands_seq ON {s}.commands(stream_id, first_seq)",
}
"""Created after the tables, and only when `_Q_EXISTING` does not find them: CREATE INDEX takes a
SHARE lock on its table even when IF NOT EXISTS finds the index, so running it on every open made
the open wait behind any write in progress (a process frozen mid-batch: until statement_timeout),
and every other store's writes queue behind that lock request meanwhile."""

_COLUMNS: dict[str, dict[str, str]] = {
    "meta": {"key": "text", "value": "text"},
    "streams": {"stream_id": "text", "session_id": "text", "head": "bigint"},
    "events": {"stream_id": "text", "seq": "bigint", "token": "bigint", "body": "text", "checksum": "bigint"},
    "leases": {"session_id": "text", "owner": "text", "token": "bigint", "expires_at": "double precision"},
    "commands": {
        "stream_id": "text",
        "command_id": "text",
        "digest": "text",
        "first_seq": "bigint",
        "last_seq": "bigint",
    },
    "snapshots": {"stream_id": "text", "seq": "bigint", "token": "bigint", "body": "bytea", "checksum": "bigint"},
}
"""The columns of every table `_SCHEMA` creates: a table found under one of these names in a schema
without a format row is taken as the journal's only if it has exactly these (the workers' tables
create ``leases`` so; another application's ``events`` is refused)."""
_Q_EXISTING: LiteralString = (
    "SELECT c.relname, c.relkind::text, a.attname, format_type(a.atttypid, a.atttypmod)"
    " FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
    " LEFT JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped"
    " WHERE n.nspname = %s AND c.relname = ANY(%s::text[])"
)
_Q_FORMAT: LiteralString = "SELECT value FROM {s}.meta WHERE key = 'format'"
_Q_SET_FORMAT: LiteralString = "INSERT INTO {s}.meta(key, value) VALUES ('format', %s)"
_Q_PLACEHOLDERS: LiteralString = (
    "INSERT INTO {s}.leases(session_id, owner, token, expires_at)"
    " SELECT s, '', 0, '-Infinity'::float8 FROM unnest(%s::text[]) AS s ORDER BY s"
    " ON CONFLICT (session_id) DO NOTHING"
)
# Never waits: a row another transaction holds is skipped, and only its session's items wait (`Deferred`).
_Q_LOCK_LEASES: LiteralString = (
    "SELECT session_id, owner, token, expires_at FROM {s}.leases"
    " WHERE session_id = ANY(%s::text[]) ORDER BY session_id FOR UPDATE SKIP LOCKED"
)
_Q_LEASE_ROWS: LiteralString = "SELECT session_id FROM {s}.leases WHERE session_id = ANY(%s::text[])"
_Q_NOW: LiteralString = "SELECT extract(epoch FROM clock_timestamp())::float8"
_Q_STREAMS_OF: LiteralString = "SELECT stream_id, session_id, head FROM {s}.streams WHERE stream_id = ANY(%s::text[])"
_Q_COMMANDS_OF: LiteralString = (
    "SELECT c.stream_id, c.command_id, c.digest, c.first_seq, c.last_seq FROM {s}.commands AS c"
    " JOIN unnest(%s::text[], %s::text[]) AS k(stream_id, command_id)"
    " ON c.stream_id = k.stream_id AND c.command_id = k.command_id"
)
_Q_INSERT_STREAMS: LiteralString = (
    "INSERT INTO {s}.streams(stream_id, session_id, head) SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[])"
)
_Q_UPDATE_HEADS: LiteralString = (
    "UPDATE {s}.streams AS t SET head = v.head FROM unnest(%s::text[], %s::bigint[]) AS v(stream_id, head)"
    " WHERE t.stream_id = v.stream_id"
)
# The bodies go in binary (%b): psycopg's text form of an array escapes every backslash and quote
# of every element with a regex substitution in Python, which costs time and memory out of all
# proportion to a body dense with JSON escapes (a \u0001 per control character: 9 MB of them,
# 54 MB of JSON, took 6 s and 3 GB); the binary form is each element's bytes, length-prefixed.
_Q_INSERT_EVENTS: LiteralString = (
    "INSERT INTO {s}.events(stream_id, seq, token, body, checksum)"
    " SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %b::text[], %s::bigint[])"
)
_Q_SET_FORMAT_V2: LiteralString = "UPDATE {s}.meta SET value = %s WHERE key = 'format'"
_Q_MIGRATE_ADD: LiteralString = "ALTER TABLE {s}.events ADD COLUMN IF NOT EXISTS checksum bigint"
# The exact stored bytes, as the checksum covers them.
_Q_MIGRATE_ROWS: LiteralString = "SELECT stream_id, seq, convert_to(body, 'UTF8') FROM {s}.events"
_Q_MIGRATE_SET: LiteralString = (
    "UPDATE {s}.events AS t SET checksum = v.checksum"
    " FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) AS v(stream_id, seq, checksum)"
    " WHERE t.stream_id = v.stream_id AND t.seq = v.seq"
)
_Q_MIGRATE_NOT_NULL: LiteralString = "ALTER TABLE {s}.events ALTER COLUMN checksum SET NOT NULL"
_Q_INSERT_COMMANDS: LiteralString = (
    "INSERT INTO {s}.commands(stream_id, command_id, digest, first_seq, last_seq)"
    " SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[], %s::bigint[])"
)
_Q_UPDATE_LEASES: LiteralString = (
    "UPDATE {s}.leases AS t SET owner = v.owner, token = v.token, expires_at = v.expires_at"
    " FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::float8[]) AS v(session_id, owner, token, expires_at)"
    " WHERE t.session_id = v.session_id"
)
_Q_NOTIFY: LiteralString = "SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p"
# The head comes with the rows (one statement, one snapshot) so a missing row is noticed, never skipped.
_BIGINT_MIN, _BIGINT_MAX = -(2**63), 2**63 - 1
"""PostgreSQL's bigint: a bound past it fails the statement ("bigint out of range")."""


_NULL: Any = "NULL"
"""A NULL checksum as `decode_range` is given it: a stored value that is no checksum (damage)."""


def _bigint(after: int) -> int:
    """A ``seq > after`` bound in bigint's range, meaning the same: no seq lies past the largest."""
    return max(_BIGINT_MIN, min(after, _BIGINT_MAX))


def _bigint_limit(limit: int | None) -> int | None:
    """A ``LIMIT`` in bigint's range (``None``: none): more rows than bigint counts is no limit."""
    return None if limit is None or limit > _BIGINT_MAX else max(limit, 0)


_Q_READ: LiteralString = (
    "(SELECT s.head, e.seq, e.body, e.checksum FROM {s}.streams AS s LEFT JOIN LATERAL ("
    " SELECT seq, body, checksum FROM {s}.events AS ev WHERE ev.stream_id = s.stream_id AND ev.seq > %(after)s"
    " ORDER BY ev.seq LIMIT %(limit)s::bigint) AS e ON true"
    " WHERE s.stream_id = %(stream)s)"
    # Without a stream row, the first event past `after` (a head of NULL): events without a stream
    # are damage to report, never an empty stream. In the same statement, so the same snapshot (a
    # stream committed between two statements would look like that); a one-time filter when the
    # stream row exists, so a read costs one more primary-key probe.
    " UNION ALL (SELECT NULL, ev.seq, NULL, NULL FROM {s}.events AS ev"
    " WHERE ev.stream_id = %(stream)s AND ev.seq > %(after)s"
    " AND NOT EXISTS (SELECT FROM {s}.streams WHERE stream_id = %(stream)s)"
    " ORDER BY ev.seq LIMIT least(%(limit)s::bigint, 1))"
    " ORDER BY 2"
)
_Q_STREAM: LiteralString = "SELECT session_id, head FROM {s}.streams WHERE stream_id = %s"
_Q_FIRST_SEQ: LiteralString = "SELECT min(seq) FROM {s}.events WHERE stream_id = %s"
_Q_ALL_STREAMS: LiteralString = "SELECT stream_id, session_id, head FROM {s}.streams ORDER BY stream_id"
_Q_SESSION_STREAMS: LiteralString = (
    "SELECT stream_id, session_id, head FROM {s}.streams WHERE session_id = %s ORDER BY stream_id"
)
_Q_COMMAND: LiteralString = (
    "SELECT digest, first_seq, last_seq FROM {s}.commands WHERE stream_id = %s AND command_id = %s"
)
_Q_COMMANDS: LiteralString = (
    "SELECT command_id, digest, first_seq, last_seq FROM {s}.commands WHERE stream_id = %s AND first_seq > %s"
    " ORDER BY first_seq"
)
_Q_UPSERT_SNAPSHOTS: LiteralString = (
    "INSERT INTO {s}.snapshots(stream_id, seq, token, body, checksum)"
    " SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::bytea[], %s::bigint[])"
    " ON CONFLICT (stream_id) DO UPDATE SET seq = excluded.seq, token = excluded.token, body = excluded.body,"
    " checksum = excluded.checksum"
)
_Q_SNAPSHOT: LiteralString = "SELECT seq, body, checksum FROM {s}.snapshots WHERE stream_id = %s"
_Q_LEASE: LiteralString = "SELECT owner, token, expires_at FROM {s}.leases WHERE session_id = %s AND token > 0"
_Q_LEASE_NOW: LiteralString = (
    "SELECT owner, token, expires_at, extract(epoch FROM clock_timestamp())::float8 FROM {s}.leases"
    " WHERE session_id = %s AND token > 0"
)


class _Rejected(Exception):
    """Carries a per-item refusal out of the planner."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Dropped(Exception):
    """A pooled read connection turned out lost (the server dropped it while it sat idle): the
    read is redone on a fresh one. Its cause is the driver's error."""


class _Retry(Exception):
    """The fast path failed before COMMIT and nothing was written: redo the batch item by item."""


class _Unsent(Exception):
    """The write connection was lost before COMMIT was handed to it: the server rolled the
    transaction back, so nothing of the batch was written (the placeholder lease rows it may
    have made in autocommit are what any acquisition makes). Its cause is the driver's error."""


@attrs.define
class _State:
    """What one transaction knows, under its locks: updated as items are planned."""

    leases: dict[str, tuple[str, int, float]]  # session -> (owner, token, expires_at); token 0: no lease
    streams: dict[str, tuple[str, int]]  # stream -> (session, head), existing streams only
    commands: dict[tuple[str, str], CommandRecord]
    now: float
    unplaced: dict[str, BaseException] = attrs.Factory(dict)  # session -> why its lease row could not be made
    busy: frozenset[str] = frozenset()  # sessions whose lease row another transaction holds: deferred
    damaged: dict[str, BaseException] = attrs.Factory(dict)  # session -> why its lease row is damage
    damaged_streams: dict[str, BaseException] = attrs.Factory(dict)  # stream -> why its row is damage
    damaged_commands: dict[tuple[str, str], BaseException] = attrs.Factory(dict)  # why a command row is damage


@attrs.frozen
class _Change:
    """The writes of one accepted item."""

    events: tuple[EventRow, ...] = ()  # (stream_id, seq, token, body, checksum)
    stream: tuple[str, str, int, bool] | None = None  # (stream_id, session_id, head, created)
    command: CommandRecord | None = None
    lease: tuple[str, str, int, float] | None = None  # (session_id, owner, token, expires_at)
    snapshot: SnapshotWork | None = None

    def apply(self, state: _State) -> None:
        if self.stream is not None:
            stream_id, session_id, head, _ = self.stream
            state.streams[stream_id] = (session_id, head)
        if self.command is not None:
            state.commands[(self.command.stream_id, self.command.command_id)] = self.command
        if self.lease is not None:
            session_id, owner, token, expires_at = self.lease
            state.leases[session_id] = (owner, token, expires_at)


@attrs.define
class _Writes:
    """Accepted changes merged into a few multi-row statements."""

    events: list[EventRow] = attrs.Factory(list)
    created: dict[str, tuple[str, int]] = attrs.Factory(dict)
    heads: dict[str, int] = attrs.Factory(dict)
    commands: list[CommandRecord] = attrs.Factory(list)
    leases: dict[str, tuple[str, int, float]] = attrs.Factory(dict)
    snapshots: dict[str, SnapshotWork] = attrs.Factory(dict)

    def add(self, change: _Change) -> None:
        self.events.extend(change.events)
        if change.snapshot is not None:
            self.snapshots[change.snapshot.write.stream_id] = change.snapshot  # the last one of a stream wins
        if change.stream is not None:
            stream_id, session_id, head, created = change.stream
            if created or stream_id in self.created:
                self.created[stream_id] = (session_id, head)
            else:
                self.heads[stream_id] = head
        if change.command is not None:
            self.commands.append(change.command)
        if change.lease is not None:
            session_id, owner, token, expires_at = change.lease
            self.leases[session_id] = (owner, token, expires_at)

    def notifications(self) -> list[str]:
        heads = {**{stream_id: head for stream_id, (_, head) in self.created.items()}, **self.heads}
        payloads = [f"{stream_id}:{head}" for stream_id, head in sorted(heads.items())]
        return [p for p in payloads if len(p.encode()) <= _NOTIFY_PAYLOAD_MAX]


def _stored_int(value: Any) -> Any:
    """A stored integer as an int: as it is, or, from a column retyped by hand (text, numeric), the
    integer it holds exactly; else *value* unchanged, for the caller to report as damage."""
    if type(value) is int:
        return value
    try:
        number = int(value)  # text: integer text only; a number: checked to be whole below
    except (TypeError, ValueError, ArithmeticError):
        return value
    return number if isinstance(value, str) or number == value else value


def _stored_float(value: Any) -> float | None:
    """A stored time as a float (from a retyped column too); ``None`` if it holds none, or NaN."""
    if type(value) is not float:
        try:
            value = float(value)
        except (TypeError, ValueError, ArithmeticError):
            return None
    return None if value != value else value


def _lease_row(session_id: str, owner: Any, token: Any, expires_at: Any) -> tuple[str, int, float]:
    """A stored lease row (owner, token, expires_at), checked: a value that is none of these (a
    column retyped by hand) is damage to that session's lease alone, and so is an expiry of NaN
    (never written): it compares as neither expired nor valid, so acquiring and fencing would
    disagree."""
    if type(owner) is str and type(token) is int and type(expires_at) is float and expires_at == expires_at:
        return owner, token, expires_at
    stored_token, expires = _stored_int(token), _stored_float(expires_at)
    if type(owner) is not str or type(stored_token) is not int:
        problem = f"its owner and token are {owner!r} and {token!r}, not text and an integer"
    elif expires is None:
        problem = "its expiry is NaN" if type(expires_at) is float else f"its expiry is {expires_at!r}, not a number"
    else:
        return owner, stored_token, expires
    raise JournalCorruptError(f"the stored lease of session {session_id!r} is damaged: {problem}")


def _stream_head(stream_id: str, head: Any) -> int:
    """A stored head, checked: one below 0 is damage (the store never writes one; taken as a head,
    it would put even a subscription from the start past it), and so is one that holds no integer
    (a column retyped by hand)."""
    if type(head) is int and head >= 0:
        return head
    value = _stored_int(head)
    if type(value) is int and value >= 0:
        return value
    problem = f"{value} (below 0)" if type(value) is int else f"{head!r}, not an integer"
    raise row_error(stream_id, "head", f"the stream's row is damaged: the stored head is {problem}")


def _stream_row(stream_id: str, session_id: Any, head: Any) -> tuple[str, int]:
    """A stored stream row (session_id, head), checked as `_stream_head` checks the head."""
    if type(session_id) is not str:
        raise row_error(stream_id, "head", f"the stream's row is damaged: its session id is {session_id!r}, not text")
    return session_id, _stream_head(stream_id, head)


def _command_record(stream_id: str, command_id: str, digest: Any, first_seq: Any, last_seq: Any) -> CommandRecord:
    """A stored command row, checked: a value that holds none of its column's (a column retyped by
    hand) is damage to that stream's command records alone."""
    first, last = _stored_int(first_seq), _stored_int(last_seq)
    if type(digest) is str and type(first) is int and type(last) is int:
        return CommandRecord(stream_id, command_id, digest, first, last)
    raise JournalCorruptError(
        f"the stored command records of {stream_id!r} are damaged: command {command_id!r} holds"
        f" {digest!r}, {first_seq!r} and {last_seq!r}, not text and two integers"
    )


def _channel(schema: str, purpose: str = "journal") -> str:
    """The NOTIFY channel for *purpose* in *schema* (hashed when the name would pass 63 bytes)."""
    name = f"{schema}_{purpose}"
    if len(name.encode()) > 63:
        name = f"trio_agent_{purpose}_" + hashlib.sha256(schema.encode()).hexdigest()[:24]
    return name


def _describe(params: dict[str, Any]) -> str:
    """Where a DSN points, for messages: host, port and database, never the password."""
    host = str(params.get("host") or params.get("hostaddr") or "the default host")
    port = params.get("port")
    dbname = params.get("dbname")
    where = f"{host}:{port}" if port else host
    return f"{where}/{dbname}" if dbname else where


def _scrub(text: str, password: str | None) -> str:
    return text.replace(password, "***") if password else text


def _storable(*values: str | None) -> bool:
    """Whether PostgreSQL text can hold every value (no NUL, valid UTF-8: no lone surrogate)."""
    for value in values:
        if value is None:
            continue
        if "\x00" in value:
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def _unstorable(work: Any) -> JournalError | None:
    if isinstance(work, SnapshotWork):
        if _storable(work.write.session_id, work.write.stream_id):
            return None
        return JournalError(f"snapshot of {work.write.stream_id!r} refused: PostgreSQL text cannot hold its ids")
    if isinstance(work, AppendBatch):
        if _storable(work.session_id, work.stream_id, work.command_id, work.command_digest):
            return None  # the bodies are ASCII JSON
        return JournalError(f"append to {work.stream_id!r} refused: PostgreSQL text cannot hold one of its ids")
    if _storable(work.session_id, work.owner):
        return None
    return JournalError(f"lease on {work.session_id!r} refused: PostgreSQL text cannot hold its session id or owner")


# Errors about the connection or the server as a whole, never about one item: a timeout or
# cancel (class 57, QueryCanceled among them, and the operator's shutdowns), a lost connection
# (class 08), a transaction ended for idling, a system error (class 58).
_BATCH_FAILURES = (
    psycopg.errors.OperatorIntervention,
    psycopg.errors.ConnectionException,
    psycopg.errors.IdleInTransactionSessionTimeout,
    psycopg.errors.SystemError,
)


def _fails_the_batch(exc: BaseException) -> bool:
    """Whether *exc* fails a whole batch. Any other server error (a constraint, an index row
    too large, a resource or program limit: psycopg raises several as `OperationalError`) may be
    one item's, so the batch is redone with a savepoint per item and only its culprit fails."""
    if isinstance(exc, _BATCH_FAILURES):
        return True
    return isinstance(exc, psycopg.OperationalError) and exc.sqlstate is None  # the client's own: the connection


def _cancel_quietly(conn: _Conn) -> None:
    with suppress(Exception):
        conn.cancel_safe(timeout=5.0)


class PostgresStore(LaneStore):
    """A `JournalStore` in one PostgreSQL schema. Open it with `open_postgres_store`."""

    def __init__(
        self,
        dsn: str,
        *,
        clock: Clock | None = None,
        schema: str = "trio_agent",
        poll_interval: float = 0.5,
        statement_timeout: float = 30.0,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    ) -> None:
        self.cleanup_grace = validate_cleanup_grace(cleanup_grace)
        if not isinstance(schema, str) or not _SCHEMA_NAME.match(schema) or len(schema.encode()) > 63:
            raise JournalError(f"schema must be a plain SQL identifier of at most 63 bytes, not {schema!r}")
        # At most MAX_TIMEOUT: PostgreSQL takes statement_timeout as an int32 of milliseconds.
        poll_interval = finite_seconds(poll_interval, "poll_interval", maximum=MAX_TIMEOUT, error=JournalError)
        statement_timeout = finite_seconds(
            statement_timeout, "statement_timeout (0: none)", allow_zero=True, maximum=MAX_TIMEOUT, error=JournalError
        )
        try:
            params: dict[str, Any] = conninfo_to_dict(dsn)
        except psycopg.Error:
            raise JournalError("the PostgreSQL DSN is not a valid connection string or URI") from None
        self.schema = schema
        self.where = _describe(params)
        self.clock: Clock = time.time if clock is None else clock
        self.poll_interval = float(poll_interval)
        self.channel = _channel(schema)
        self._lease_clock = clock
        self._password = params.get("password")
        options = str(params.get("options") or "")
        # Whole milliseconds, and never 0 for a timeout asked for: PostgreSQL reads 0 as "none".
        timeout_ms = max(1, round(statement_timeout * 1000)) if statement_timeout > 0 else 0
        options = f"{options} -c statement_timeout={timeout_ms}".strip()
        if "idle_in_transaction_session_timeout" not in options:  # the DSN's own (a worker's: its TTL) wins
            # A process frozen half-way through a write (SIGSTOP, a VM paused) must not hold its row
            # locks, and the sessions behind them, until it wakes: its transaction is ended as long.
            options += f" -c idle_in_transaction_session_timeout={timeout_ms}"
        self._defer_limit = statement_timeout if statement_timeout > 0 else math.inf
        extra: dict[str, Any] = {"options": options}
        if "connect_timeout" not in params:
            extra["connect_timeout"] = 10
        if "application_name" not in params:
            extra["application_name"] = "trio_agent journal"
        # A server that vanished (a partition, a host gone) answers nothing, not even an error:
        # statement_timeout is the server's own, so without these a write would wait for the
        # kernel's retransmissions (~15 min on Linux) and an idle connection would never learn.
        extra.update({key: value for key, value in _TCP_DEFAULTS.items() if key not in params})
        self._conninfo = make_conninfo(dsn, **extra)
        ident = sql.Identifier(schema)
        self._sql: Callable[[LiteralString], bytes] = lambda template: sql.SQL(template).format(s=ident).as_bytes(None)
        self._q = {
            name: self._sql(template)
            for name, template in globals().items()
            if name.startswith("_Q_") and isinstance(template, str)
        }
        self._writer: _Conn | None = None
        self._commit_sent = False  # the writer thread's: COMMIT was handed to the write connection
        self._listener: _Conn | None = None
        self._lane: WriterLane | None = None
        self._idle_readers: list[_Conn] = []
        self._read_slots = trio.CapacityLimiter(_MAX_READERS)
        self._read_threads = trio.CapacityLimiter(_MAX_READERS)
        self._aux_threads = trio.CapacityLimiter(2)
        self._cancel_threads = trio.CapacityLimiter(_MAX_READERS)
        self._listen_scope = trio.CancelScope()
        self._listen_done = trio.Event()
        self._listen_started = False
        self._changed = AppendWaits()
        self._closed = False
        self.notifications = 0  # NOTIFY wake-ups received (observability, tests)

    # -- connections

    def _connect(self) -> _Conn:
        try:
            return psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            message = _scrub(str(exc).strip(), self._password)
            raise JournalUnavailableError(f"cannot connect to PostgreSQL at {self.where}: {message}") from None

    def _open_writer(self) -> _Conn:
        conn = self._connect()
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"trio_agent.journal:{self.schema}",))
                # Looked at before anything is created: a schema without a format row is taken as a
                # journal only if every table of ours it holds is ours (another application's is refused).
                existing: dict[str, dict[str, str]] = {}
                indexes: set[str] = set()
                names = [*_COLUMNS, *_INDEXES]
                for name, kind, column, type_name in conn.execute(_Q_EXISTING, (self.schema, names)):
                    if name in _INDEXES:
                        indexes.add(name)
                        continue
                    columns = existing.setdefault(name, {})
                    if column is not None:
                        columns[column] = type_name if kind in ("r", "p") else f"{type_name} ({kind})"
                row = self._format_row(conn) if "meta" in existing else None
                if row is None:
                    self._check_adoptable(conn, existing)
                for statement in _SCHEMA:
                    conn.execute(self._sql(statement))
                for name, statement in _INDEXES.items():
                    if name not in indexes:  # never when it exists: see `_INDEXES`
                        conn.execute(self._sql(statement))
                if row is None:
                    conn.execute(self._q["_Q_SET_FORMAT"], (STORE_FORMAT,))
                elif row[0] == V1_FORMAT:
                    self._migrate_v1(conn)  # in this transaction: a failure leaves the schema at version 1
                elif row[0] != STORE_FORMAT:
                    raise JournalCorruptError(
                        f"schema {self.schema!r} at {self.where} holds journal format {row[0]!r};"
                        f" this code reads {STORE_FORMAT!r}"
                    )
        except BaseException as exc:
            conn.close()
            if isinstance(exc, psycopg.Error):
                message = _scrub(str(exc).strip(), self._password)
                raise JournalUnavailableError(
                    f"cannot open the journal schema {self.schema!r} at {self.where}: {message}"
                ) from exc
            raise
        return conn

    def _check_adoptable(self, conn: _Conn, existing: dict[str, dict[str, str]]) -> None:
        """Refuse (`JournalCorruptError`, nothing changed) a schema without a format row that holds
        a table of the journal's names with other columns, or a ``meta`` table with rows."""
        foreign = sorted(name for name, columns in existing.items() if columns != _COLUMNS[name])
        if not foreign and "meta" in existing and conn.execute(self._sql("SELECT 1 FROM {s}.meta LIMIT 1")).fetchone():
            foreign = ["meta (its rows)"]
        if foreign:
            raise JournalCorruptError(
                f"schema {self.schema!r} at {self.where} holds {', '.join(foreign)} unlike the journal's, and no"
                " journal format row: not a trio_agent journal (another application's tables?); it was left unchanged"
            )

    def _format_row(self, conn: _Conn) -> tuple[Any, ...] | None:
        """The schema's format row, when it has a ``meta`` table (a ``meta`` of another shape: damage)."""
        try:
            return conn.execute(self._q["_Q_FORMAT"]).fetchone()
        except (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction, psycopg.errors.DataError) as exc:
            raise JournalCorruptError(
                f"schema {self.schema!r} at {self.where} has a meta table that is not a trio_agent journal's: {exc}"
            ) from exc

    def _migrate_v1(self, conn: _Conn) -> None:
        """Version 1 -> 2 inside the open's transaction: add, fill (rows taken on trust) and
        require the checksum column. Rows are streamed through a server-side cursor."""
        q = self._q
        conn.execute(q["_Q_MIGRATE_ADD"])
        with conn.cursor(name="trio_agent_journal_migration") as rows:
            rows.execute(q["_Q_MIGRATE_ROWS"])
            while chunk := rows.fetchmany(_MIGRATE_CHUNK):
                conn.execute(
                    q["_Q_MIGRATE_SET"],
                    (
                        [stream_id for stream_id, _, _ in chunk],
                        [seq for _, seq, _ in chunk],
                        [row_checksum(stream_id, seq, bytes(body)) for stream_id, seq, body in chunk],
                    ),
                )
        conn.execute(q["_Q_MIGRATE_NOT_NULL"])
        conn.execute(q["_Q_SET_FORMAT_V2"], (STORE_FORMAT,))

    def _open_listener(self) -> _Conn:
        conn = self._connect()
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        except psycopg.Error as exc:
            conn.close()
            raise unavailable(exc, f"cannot LISTEN on PostgreSQL at {self.where}") from exc
        return conn

    async def _connect_in_thread(self, connect: Callable[[], _Conn], limiter: trio.CapacityLimiter) -> _Conn:
        """``connect()`` in a worker thread, cancellably (connect_timeout bounds the thread):
        a connection made after the caller stopped waiting is closed, never dropped open."""
        lock = threading.Lock()
        made: list[_Conn] = []
        abandoned = False

        def run() -> None:
            conn = connect()
            with lock:
                if not abandoned:
                    made.append(conn)
                    return
            conn.close()

        try:
            await trio.to_thread.run_sync(run, limiter=limiter, abandon_on_cancel=True)
        except BaseException:
            with lock:
                abandoned = True
                leftovers = made[:]
                made.clear()
            for conn in leftovers:  # made just before the cancellation won
                conn.close()
            raise
        return made[0]

    async def _open(self, max_batch: int) -> None:
        max_batch = validate_limit(max_batch, name="max_batch")  # before any connection
        self._writer = await self._connect_in_thread(self._open_writer, self._aux_threads)
        try:
            self._listener = await self._connect_in_thread(self._open_listener, self._aux_threads)
        except BaseException:
            self._close_writer()
            raise
        self._lane = WriterLane(
            f"trio_agent journal writer (postgres {self.where} {self.schema})",
            self._commit,
            on_committed=self._committed,
            on_stop=self._close_writer,  # in the writer thread: never under a running transaction
            max_batch=max_batch,
            cleanup_grace=self.cleanup_grace,
            defer_limit=self._defer_limit,  # a session's locked lease row is waited for as a statement is
        )
        self._lane.start()

    async def aclose(self) -> None:
        """Stop listening, drain the writer, close every connection: ``cleanup_grace`` seconds in all."""
        if self._closed:
            return
        self._closed = True
        deadline = trio.current_time() + self.cleanup_grace
        try:
            if self._lease_keeper is not None:
                self._lease_keeper.stop()
            self._listen_scope.cancel()
            if self._listen_started:
                with bounded_shield(self.cleanup_grace, f"the PostgreSQL journal's LISTEN task ({self.where})"):
                    await self._listen_done.wait()
            if self._lane is not None:
                await self._lane.aclose(max(deadline - trio.current_time(), 0.0))
            else:
                self._close_writer()  # the writer thread never started: nothing is running
            # Taken here, in the Trio thread that owns them; closed in a worker thread (it may block).
            conns = [self._listener, *self._idle_readers]
            self._listener = None
            self._idle_readers.clear()
            await close_in_thread(
                lambda: self._close_all(conns),
                max(deadline - trio.current_time(), 0.0),
                f"the PostgreSQL journal's connections ({self.where})",
            )
        finally:
            self._wake_all()

    def _close_writer(self) -> None:
        conn, self._writer = self._writer, None
        if conn is not None:
            conn.close()

    @staticmethod
    def _close_all(conns: Sequence[_Conn | None]) -> None:
        for conn in conns:
            if conn is not None:
                conn.close()

    # -- the writer thread

    def _writer_conn(self) -> _Conn:
        conn = self._writer
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            self._writer = None
            conn = self._writer = self._connect()
        return conn

    def _commit(self, works: Sequence[Any]) -> list[object]:
        # An id PostgreSQL text cannot hold is refused alone, before it reaches any statement.
        outcomes: list[object | None] = [_unstorable(work) for work in works]
        storable = [work for work, refused in zip(works, outcomes, strict=True) if refused is None]
        if storable:
            done = iter(commit_encoded(storable, self._commit_storable))
            outcomes = [next(done) if refused is None else refused for refused in outcomes]
        return outcomes

    def _commit_storable(self, works: Sequence[Any], encoded: list[list[EventRow]]) -> list[object]:
        # Encoded before the transaction (commit_encoded): its row locks are held only for the checks and writes.
        try:
            return self._commit_on_writer(works, encoded)
        except _Unsent:
            # The server dropped the connection (a restart, a failover, an idle timeout) and nothing
            # was written: the batch is redone once, on a fresh connection, rather than answered
            # "outcome unknown", which fences every journal with a write in it.
            pass
        try:
            return self._commit_on_writer(works, encoded)
        except _Unsent as lost:
            cause = lost.__cause__ if lost.__cause__ is not None else lost
            return [unavailable(cause, f"journal {self.where} {self.schema}: the transaction failed")] * len(works)

    def _commit_on_writer(self, works: Sequence[Any], encoded: list[list[EventRow]]) -> list[object]:
        """The batch on the write connection (reconnected if it is known lost): the fast path, then
        item by item if that failed with nothing written. Raises `_Unsent` (see `_transaction`)."""
        try:
            conn = self._writer_conn()
        except JournalError as exc:
            return [exc] * len(works)
        try:
            return self._transaction(conn, works, encoded, isolate=False)
        except _Unsent:
            raise
        except _Retry:
            pass
        except Exception as exc:
            return [unavailable(exc, f"journal {self.where} {self.schema}: the transaction failed")] * len(works)
        try:
            return self._transaction(conn, works, encoded, isolate=True)
        except _Unsent:
            raise
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc, _Retry) and exc.__cause__ is not None else exc
            return [unavailable(cause, f"journal {self.where} {self.schema}: the transaction failed")] * len(works)

    def _transaction(
        self, conn: _Conn, works: Sequence[Any], encoded: list[list[EventRow]], *, isolate: bool
    ) -> list[object]:
        """One transaction for the whole batch; raises `_Retry` if it failed before COMMIT with
        nothing written, `_Unsent` if the connection was lost before COMMIT was handed to it."""
        began = time.perf_counter()
        self._commit_sent = False
        try:
            return self._run_transaction(conn, works, encoded, isolate=isolate)
        except Exception as exc:
            # The outcome is known only if the server answered (then the transaction is rolled back),
            # or if the connection was lost before COMMIT was ever handed to it (then the server rolls
            # it back): after that, COMMIT may have been sent and applied, its answer lost.
            if conn.broken or conn.closed or isinstance(exc, psycopg.errors.ConnectionFailure):
                conn.close()
                if not self._commit_sent and isinstance(exc, psycopg.Error):
                    raise _Unsent from exc
                raise
            try:
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.execute(b"ROLLBACK")
            except Exception:
                conn.close()
                if not self._commit_sent and isinstance(exc, psycopg.Error):
                    raise _Unsent from exc
                raise exc from None
            if _fails_the_batch(exc):
                raise  # about the connection or the server, not one item: retrying would not help
            raise _Retry(str(exc)) from exc
        finally:
            self._held(time.perf_counter() - began)

    def _run_transaction(
        self, conn: _Conn, works: Sequence[Any], encoded: list[list[EventRow]], *, isolate: bool
    ) -> list[object]:
        sessions = sorted({work.session_id for work in works})
        appends = [work for work in works if isinstance(work, AppendBatch)]
        snapshots = [work.write.stream_id for work in works if isinstance(work, SnapshotWork)]
        stream_ids = sorted({batch.stream_id for batch in appends} | set(snapshots))
        keyed = [batch for batch in appends if batch.command_id is not None]
        acquiring = sorted({work.session_id for work in works if isinstance(work, LeaseOp) and work.kind == "acquire"})
        q = self._q
        unplaced: dict[str, BaseException] = {}
        if acquiring and not isolate:
            # Its own (autocommitted) statement, so a new session has a row to lock below.
            conn.execute(q["_Q_PLACEHOLDERS"], (acquiring,))
        for session_id in acquiring if isolate else ():
            try:  # one statement each: a session whose row the database refuses fails alone
                conn.execute(q["_Q_PLACEHOLDERS"], ([session_id],))
            except psycopg.Error as exc:
                if conn.broken or conn.closed or _fails_the_batch(exc):
                    raise
                unplaced[session_id] = self._refused(exc)
        with conn.pipeline():
            conn.execute(b"BEGIN")
            lease_cursor = conn.execute(q["_Q_LOCK_LEASES"], (sessions,))
            now_cursor = conn.execute(q["_Q_NOW"]) if self._lease_clock is None else None
            streams_cursor = conn.execute(q["_Q_STREAMS_OF"], (stream_ids,)) if stream_ids else None
            commands_cursor = (
                conn.execute(
                    q["_Q_COMMANDS_OF"],
                    ([batch.stream_id for batch in keyed], [batch.command_id for batch in keyed]),
                )
                if keyed
                else None
            )
        if now_cursor is not None:
            row = now_cursor.fetchone()
            assert row is not None
            now = float(row[0])
        else:
            assert self._lease_clock is not None
            now = float(self._lease_clock())
        leases: dict[str, tuple[str, int, float]] = {}
        damaged: dict[str, BaseException] = {}
        for row in lease_cursor.fetchall():
            try:
                leases[row[0]] = _lease_row(row[0], row[1], row[2], row[3])
            except JournalCorruptError as exc:  # that session's items fail alone
                damaged[row[0]] = exc
        busy: frozenset[str] = frozenset()
        if len(leases) + len(damaged) < len(sessions):  # skipped (locked elsewhere) or no row at all: one more look
            missing = [s for s in sessions if s not in leases and s not in damaged]
            rows = conn.execute(q["_Q_LEASE_ROWS"], (missing,)).fetchall()
            busy = frozenset(row[0] for row in rows)
        streams: dict[str, tuple[str, int]] = {}
        damaged_streams: dict[str, BaseException] = {}
        for row in () if streams_cursor is None else streams_cursor.fetchall():
            try:
                streams[row[0]] = _stream_row(row[0], row[1], row[2])
            except JournalCorruptError as exc:  # that stream's items fail alone
                damaged_streams[row[0]] = exc
        commands: dict[tuple[str, str], CommandRecord] = {}
        damaged_commands: dict[tuple[str, str], BaseException] = {}
        for row in () if commands_cursor is None else commands_cursor.fetchall():
            try:
                commands[(row[0], row[1])] = _command_record(*row)
            except JournalCorruptError as exc:  # the appends with that command fail alone
                damaged_commands[(row[0], row[1])] = exc
        state = _State(
            leases=leases,
            streams=streams,
            commands=commands,
            now=now,
            unplaced=unplaced,
            busy=busy,
            damaged=damaged,
            damaged_streams=damaged_streams,
            damaged_commands=damaged_commands,
        )
        outcomes: list[object] = []
        if not isolate:
            writes = _Writes()
            for work, rows in zip(works, encoded, strict=True):
                try:
                    outcome, change = self._plan(state, work, rows)
                except _Rejected as rejected:
                    outcomes.append(rejected.error)
                    continue
                if change is not None:
                    change.apply(state)
                    writes.add(change)
                outcomes.append(outcome)
            with conn.pipeline():
                self._write(conn, writes, writes.notifications())
                self._commit_sent = True  # from here on, a lost connection leaves the outcome unknown
                conn.execute(b"COMMIT")
            return outcomes
        # Item by item, one savepoint each: a failing write fails only its own item.
        notified = _Writes()
        for index, (work, rows) in enumerate(zip(works, encoded, strict=True)):
            try:
                outcome, change = self._plan(state, work, rows)
            except _Rejected as rejected:
                outcomes.append(rejected.error)
                continue
            if change is None:
                outcomes.append(outcome)
                continue
            single = _Writes()
            single.add(change)
            savepoint = f"item{index}".encode()
            try:
                with conn.pipeline():
                    conn.execute(b"SAVEPOINT " + savepoint)
                    self._write(conn, single, [])
                    conn.execute(b"RELEASE SAVEPOINT " + savepoint)
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    raise
                conn.execute(b"ROLLBACK TO SAVEPOINT " + savepoint)
                outcomes.append(self._item_error(conn, work, exc))
                continue
            change.apply(state)
            notified.add(change)
            outcomes.append(outcome)
        with conn.pipeline():
            self._write(conn, _Writes(), notified.notifications())
            self._commit_sent = True  # from here on, a lost connection leaves the outcome unknown
            conn.execute(b"COMMIT")
        return outcomes

    def _item_error(self, conn: _Conn, work: Any, exc: psycopg.Error) -> BaseException:
        if isinstance(work, AppendBatch):
            row = conn.execute(self._q["_Q_STREAM"], (work.stream_id,)).fetchone()
            if row is not None and row[0] != work.session_id:
                return ForeignStreamError(
                    f"stream {work.stream_id!r} belongs to session {row[0]!r}, not {work.session_id!r}"
                )
            if row is None and isinstance(exc, psycopg.errors.UniqueViolation):
                # Taken for a new stream, its events collided with stored ones: events without a
                # stream row are damage (as a read reports them), not a refusal worth retrying.
                found = conn.execute(self._q["_Q_FIRST_SEQ"], (work.stream_id,)).fetchone()
                if found is not None and found[0] is not None:
                    return row_error(work.stream_id, found[0], "the stream has events but no head")
        return self._refused(exc)

    def _refused(self, exc: psycopg.Error) -> JournalUnavailableError:
        error = JournalUnavailableError(
            f"journal {self.where} {self.schema}: the database refused the write: {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return error

    def _write(self, conn: _Conn, writes: _Writes, notifications: list[str]) -> None:
        q = self._q
        if writes.created:
            created = sorted(writes.created.items())
            conn.execute(
                q["_Q_INSERT_STREAMS"],
                ([s for s, _ in created], [session for _, (session, _) in created], [h for _, (_, h) in created]),
            )
        if writes.heads:
            heads = sorted(writes.heads.items())
            conn.execute(q["_Q_UPDATE_HEADS"], ([s for s, _ in heads], [h for _, h in heads]))
        if writes.events:
            events = writes.events
            conn.execute(
                q["_Q_INSERT_EVENTS"],
                (
                    [e[0] for e in events],
                    [e[1] for e in events],
                    [e[2] for e in events],
                    [e[3] for e in events],
                    [e[4] for e in events],
                ),
            )
        if writes.commands:
            commands = writes.commands
            conn.execute(
                q["_Q_INSERT_COMMANDS"],
                (
                    [c.stream_id for c in commands],
                    [c.command_id for c in commands],
                    [c.digest for c in commands],
                    [c.first_seq for c in commands],
                    [c.last_seq for c in commands],
                ),
            )
        if writes.snapshots:
            snaps = [work for _, work in sorted(writes.snapshots.items())]
            conn.execute(
                q["_Q_UPSERT_SNAPSHOTS"],
                (
                    [w.write.stream_id for w in snaps],
                    [w.write.seq for w in snaps],
                    [w.write.token for w in snaps],
                    [w.write.body for w in snaps],
                    [w.checksum for w in snaps],
                ),
            )
        if writes.leases:
            leases = sorted(writes.leases.items())
            conn.execute(
                q["_Q_UPDATE_LEASES"],
                (
                    [s for s, _ in leases],
                    [owner for _, (owner, _, _) in leases],
                    [token for _, (_, token, _) in leases],
                    [expires for _, (_, _, expires) in leases],
                ),
            )
        if notifications:
            conn.execute(q["_Q_NOTIFY"], (self.channel, notifications))

    def _plan(self, state: _State, work: Any, rows: list[EventRow]) -> tuple[object, _Change | None]:
        if work.session_id in state.busy:  # checked by nothing yet: offered again by the lane
            return Deferred(f"the lease row of session {work.session_id!r} is locked by another transaction"), None
        if work.session_id in state.damaged:
            raise _Rejected(state.damaged[work.session_id])
        if isinstance(work, AppendBatch):
            return self._plan_append(state, work, rows)
        if isinstance(work, SnapshotWork):
            return self._plan_snapshot(state, work)
        return self._plan_lease(state, work)

    @staticmethod
    def _plan_snapshot(state: _State, work: SnapshotWork) -> tuple[None, _Change]:
        # Against the state as the batch's earlier items left it: a snapshot may follow its appends.
        if work.write.stream_id in state.damaged_streams:
            raise _Rejected(state.damaged_streams[work.write.stream_id])
        try:
            decide_snapshot(
                work.write,
                lease=state.leases.get(work.write.session_id),
                stream=state.streams.get(work.write.stream_id),
                now=state.now,
            )
        except (JournalError, LeaseLostError) as refusal:
            raise _Rejected(refusal) from None
        return None, _Change(snapshot=work)

    @staticmethod
    def _plan_append(state: _State, batch: AppendBatch, rows: list[EventRow]) -> tuple[AppendResult, _Change | None]:
        if batch.stream_id in state.damaged_streams:
            raise _Rejected(state.damaged_streams[batch.stream_id])
        if batch.command_id is not None and (batch.stream_id, batch.command_id) in state.damaged_commands:
            raise _Rejected(state.damaged_commands[(batch.stream_id, batch.command_id)])
        stream = state.streams.get(batch.stream_id)
        known = None if batch.command_id is None else state.commands.get((batch.stream_id, batch.command_id))
        try:
            result = decide_append(
                batch,
                lease=state.leases.get(batch.session_id),
                stream=stream,
                command=None if known is None else (known.digest, known.first_seq, known.last_seq),
                now=state.now,
            )
        except (JournalError, LeaseLostError) as refusal:
            raise _Rejected(refusal) from None
        if result.replayed:
            return result, None
        command = None
        if batch.command_id is not None:
            assert batch.command_digest is not None
            command = CommandRecord(
                batch.stream_id, batch.command_id, batch.command_digest, batch.first_seq, batch.last_seq
            )
        change = _Change(
            events=tuple(rows),
            stream=(batch.stream_id, batch.session_id, batch.last_seq, stream is None),
            command=command,
        )
        return result, change

    @staticmethod
    def _plan_lease(state: _State, op: LeaseOp) -> tuple[Lease | None, _Change | None]:
        row = state.leases.get(op.session_id)
        if op.kind == "release":
            if row is not None and releases(row, op.token):
                return None, _Change(lease=(op.session_id, row[0], row[1], -math.inf))
            return None, None
        if op.kind == "acquire" and row is None:  # only when the placeholder statement was refused
            refused = state.unplaced.get(op.session_id)
            raise _Rejected(refused or JournalUnavailableError(f"no lease row for session {op.session_id!r}"))
        try:
            lease = decide_lease(op.kind, op.session_id, op.owner, op.token, op.ttl, row, state.now)
        except (JournalError, LeaseLostError) as refusal:
            raise _Rejected(refusal) from None
        assert lease is not None
        return lease, _Change(lease=(op.session_id, op.owner, lease.token, lease.expires_at))

    def _committed(self, works: Sequence[Any], outcomes: list[object]) -> None:
        for work, outcome in zip(works, outcomes, strict=True):
            if isinstance(work, AppendBatch) and isinstance(outcome, AppendResult) and not outcome.replayed:
                self._wake(work.stream_id)

    # -- writes

    def _not_open(self) -> str:
        return "the PostgreSQL store is not open (use open_postgres_store)"

    # -- reads

    async def run_read(self, fn: Callable[[psycopg.Connection[TupleRow]], T]) -> T:
        """``fn(conn)`` on one of the store's read connections (autocommit, in a worker thread),
        for tables kept beside the journal in its schema (the workers' inbox). As every read of the
        store: a cancellation aborts the statement, a pooled connection the server dropped is
        replaced and *fn* run once more (it must be safe to repeat), and a driver's error is a
        `JournalError`."""
        return await self._query(fn)

    async def _query(self, fn: Callable[[_Conn], T]) -> T:
        """Run ``fn`` on a read connection in a worker thread; a cancel scope aborts the statement.

        An idle pooled connection may have been dropped by the server meanwhile (a restart, a
        failover, ``idle_session_timeout``, a proxy's idle drop): one that fails with its connection
        lost is closed and the read, safe to repeat, runs once more on a fresh connection."""
        if self._closed:
            raise JournalError("the PostgreSQL store is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        async with self._read_slots:
            if self._idle_readers:
                try:
                    return await self._read_on(self._idle_readers.pop(), fn, pooled=True)
                except _Dropped:
                    pass
            conn = await self._connect_in_thread(self._connect, self._read_threads)
            try:
                await trio.lowlevel.checkpoint_if_cancelled()
            except trio.Cancelled:
                self._idle_readers.append(conn)
                raise
            return await self._read_on(conn, fn, pooled=False)

    async def _read_on(self, conn: _Conn, fn: Callable[[_Conn], T], *, pooled: bool) -> T:
        """`_query` on *conn*; raises `_Dropped` if *pooled* and its connection turned out lost."""
        borrower = object()  # released by the thread's return, which may come after we stopped waiting
        try:
            await self._read_threads.acquire_on_behalf_of(borrower)
        except trio.Cancelled:
            self._idle_readers.append(conn)
            raise
        token = trio.lowlevel.current_trio_token()
        lock = threading.Lock()
        results: list[T] = []
        errors: list[BaseException] = []
        finished = abandoned = cancelled = lost = False
        done = trio.Event()

        def run() -> None:
            nonlocal finished
            try:
                results.append(fn(conn))
            except BaseException as exc:
                errors.append(exc)
            with lock:
                finished = True
                if abandoned:  # nobody waits for it any more: this thread owns the connection
                    conn.close()

        def back(_: object) -> None:
            def wake() -> None:
                self._read_threads.release_on_behalf_of(borrower)
                done.set()

            with suppress(trio.RunFinishedError):
                token.run_sync_soon(wake)

        trio.lowlevel.start_thread_soon(run, back, name="trio_agent journal read")
        try:
            await done.wait()
        except trio.Cancelled:
            # Abort the statement on the server and wait for the thread, for cleanup_grace at most.
            cancelled = True
            with bounded_shield(self.cleanup_grace, f"a cancelled PostgreSQL read ({self.where})"):
                while not done.is_set():
                    await trio.to_thread.run_sync(
                        _cancel_quietly, conn, limiter=self._cancel_threads, abandon_on_cancel=True
                    )
                    with trio.move_on_after(_CANCEL_RETRY):
                        await done.wait()
            if not done.is_set():
                with lock:
                    abandoned = not finished
            raise
        finally:
            if not abandoned:
                lost = conn.broken or conn.closed
                reusable = not cancelled and not self._closed and not lost
                if reusable and conn.info.transaction_status == TransactionStatus.IDLE:
                    self._idle_readers.append(conn)
                else:
                    conn.close()
        if errors:
            if not isinstance(errors[0], Exception):
                raise errors[0]
            if pooled and lost and isinstance(errors[0], psycopg.Error):
                raise _Dropped from errors[0]
            raise self._read_error(errors[0])
        return results[0]

    def _read_error(self, exc: Exception) -> Exception:
        if isinstance(exc, JournalError):
            return exc
        if isinstance(exc, psycopg.errors.QueryCanceled):
            error: JournalError = JournalUnavailableError(
                f"journal {self.where} {self.schema}: a read exceeded statement_timeout: {exc}"
            )
        elif isinstance(exc, psycopg.OperationalError):
            error = unavailable(exc, f"journal {self.where} {self.schema}: a read failed")
        else:  # a driver's error about the statement, or what a value read turned into (never raw)
            error = JournalError(f"journal {self.where} {self.schema}: a read failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[EventEnvelope]:
        if not _storable(stream_id):  # never stored: PostgreSQL text cannot hold it
            await trio.lowlevel.checkpoint()
            return []
        query = self._q["_Q_READ"]

        def run(conn: _Conn) -> list[EventEnvelope]:
            params = {"after": _bigint(after), "limit": _bigint_limit(limit), "stream": stream_id}
            rows = conn.execute(query, params).fetchall()
            if not rows:
                return []  # no stream row and no events past `after`
            if rows[0][0] is None:  # events without a stream row (see `_Q_READ`): reported as damage
                return decode_range(stream_id, after=after, limit=limit, head=None, rows=[(rows[0][1], "", None)])
            # Taken as stored: decode_range reports a seq or checksum of another type as damage. A
            # NULL checksum too (a constraint dropped by hand): None would mean a version-1 row.
            events = [
                (_stored_int(seq), body, _NULL if checksum is None else _stored_int(checksum))
                for _, seq, body, checksum in rows
                if seq is not None
            ]
            head = _stream_head(stream_id, rows[0][0])
            return decode_range(stream_id, after=after, limit=limit, head=head, rows=events)

        return await self._query(run)

    async def head(self, stream_id: str) -> int:
        info = await self.stream_info(stream_id)
        return 0 if info is None else info.head

    async def stream_info(self, stream_id: str) -> StreamInfo | None:
        if not _storable(stream_id):  # never stored: PostgreSQL text cannot hold it
            await trio.lowlevel.checkpoint()
            return None
        query = self._q["_Q_STREAM"]

        def run(conn: _Conn) -> StreamInfo | None:
            row = conn.execute(query, (stream_id,)).fetchone()
            return None if row is None else StreamInfo(stream_id, *_stream_row(stream_id, row[0], row[1]))

        return await self._query(run)

    async def streams(self, session_id: str | None = None) -> list[StreamInfo]:
        if not _storable(session_id):  # never stored: PostgreSQL text cannot hold it
            await trio.lowlevel.checkpoint()
            return []

        def run(conn: _Conn) -> list[StreamInfo]:
            if session_id is None:
                cursor = conn.execute(self._q["_Q_ALL_STREAMS"])
            else:
                cursor = conn.execute(self._q["_Q_SESSION_STREAMS"], (session_id,))
            return [StreamInfo(row[0], *_stream_row(row[0], row[1], row[2])) for row in cursor.fetchall()]

        return await self._query(run)

    async def command(self, stream_id: str, command_id: str) -> CommandRecord | None:
        if not _storable(stream_id, command_id):  # never stored: PostgreSQL text cannot hold it
            await trio.lowlevel.checkpoint()
            return None
        query = self._q["_Q_COMMAND"]

        def run(conn: _Conn) -> CommandRecord | None:
            row = conn.execute(query, (stream_id, command_id)).fetchone()
            return None if row is None else _command_record(stream_id, command_id, row[0], row[1], row[2])

        return await self._query(run)

    async def commands(self, stream_id: str, *, after: int = 0) -> list[CommandRecord]:
        if not _storable(stream_id):  # never stored: PostgreSQL text cannot hold it
            await trio.lowlevel.checkpoint()
            return []
        query = self._q["_Q_COMMANDS"]

        def run(conn: _Conn) -> list[CommandRecord]:
            rows = conn.execute(query, (stream_id, _bigint(after))).fetchall()
            return [_command_record(stream_id, row[0], row[1], row[2], row[3]) for row in rows]

        return await self._query(run)

    async def load_snapshot(self, stream_id: str) -> tuple[int, bytes] | None:
        if not _storable(stream_id):  # never stored: PostgreSQL text cannot hold it
            await trio.lowlevel.checkpoint()
            return None
        query = self._q["_Q_SNAPSHOT"]

        def run(conn: _Conn) -> tuple[int, bytes] | None:
            row = conn.execute(query, (stream_id,)).fetchone()
            return None if row is None else verify_snapshot(stream_id, row[0], row[1], row[2])

        return await self._query(run)

    async def current_lease(self, session_id: str) -> Lease | None:
        if not _storable(session_id):  # never stored: PostgreSQL text cannot hold it
            await trio.lowlevel.checkpoint()
            return None
        query = self._q["_Q_LEASE"]

        def run(conn: _Conn) -> Lease | None:
            row = conn.execute(query, (session_id,)).fetchone()
            return None if row is None else Lease(session_id, *_lease_row(session_id, row[0], row[1], row[2]))

        return await self._query(run)

    async def live_lease(self, session_id: str) -> Lease | None:
        """The session's lease if it has not expired by the store's clock (the server's, read
        in the same statement, with ``clock=None``): the local clock does not matter."""
        if not _storable(session_id):  # never stored: PostgreSQL text cannot hold it
            await trio.lowlevel.checkpoint()
            return None
        query = self._q["_Q_LEASE_NOW"]
        clock = self._lease_clock

        def run(conn: _Conn) -> Lease | None:
            row = conn.execute(query, (session_id,)).fetchone()
            if row is None:
                return None
            owner, token, expires_at = _lease_row(session_id, row[0], row[1], row[2])
            now = float(row[3]) if clock is None else float(clock())
            return Lease(session_id, owner, token, expires_at) if expires_at >= now else None

        return await self._query(run)

    # -- live tailing

    def _wake(self, stream_id: str) -> None:
        self._changed.wake(stream_id)

    def _wake_all(self) -> None:
        self._changed.wake_all()

    async def wait_for_append(self, stream_id: str, after: int) -> None:
        """Return once *stream_id* grew past *after*: at once for a commit of this store, through
        NOTIFY for another process's, and otherwise (a notification lost or missed) within
        ``poll_interval``: ONE read of every waited-on stream's head per interval, however many
        wait (`AppendWaits`). Or when the store closes."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        await self._changed.wait_for_append(stream_id, after, heads=self._heads, interval=self.poll_interval)

    async def _heads(self, stream_ids: Sequence[str]) -> dict[str, int | JournalError]:
        """The heads of *stream_ids* in one statement (a stream with no row: absent); a damaged
        row's stream gets its `JournalCorruptError`, as `head` raises it."""
        wanted = [stream_id for stream_id in stream_ids if _storable(stream_id)]  # others are never stored
        if not wanted:
            await trio.lowlevel.checkpoint()
            return {}
        query = self._q["_Q_STREAMS_OF"]

        def run(conn: _Conn) -> dict[str, int | JournalError]:
            found: dict[str, int | JournalError] = {}
            for stream_id, session_id, head in conn.execute(query, (wanted,)).fetchall():
                try:
                    found[stream_id] = _stream_row(stream_id, session_id, head)[1]
                except JournalError as exc:
                    found[stream_id] = exc
            return found

        return await self._query(run)

    async def _listen(self) -> None:
        """Pump the LISTEN connection natively (no thread); reconnect if it drops."""
        try:
            with self._listen_scope:
                await self._listen_loop()
        finally:
            self._listen_done.set()

    async def _listen_loop(self) -> None:
        backoff = min(max(self.poll_interval, 0.5), 5.0)
        while True:
            conn = self._listener
            if conn is None:
                try:
                    self._listener = await self._connect_in_thread(self._open_listener, self._aux_threads)
                except JournalError:
                    await trio.sleep(backoff)
                    continue
                conn = self._listener
                assert conn is not None
                self._wake_all()  # notifications were lost while disconnected
            with suppress(psycopg.Error, OSError):
                await self._pump(conn)
            self._listener = None
            conn.close()
            await trio.sleep(backoff)

    async def _pump(self, conn: _Conn) -> None:
        await pump_notifications(conn, self._notified)

    def _notified(self, payload: str) -> None:
        stream_id, _, head = payload.rpartition(":")
        if stream_id and head.isdigit():
            self.notifications += 1
            self._wake(stream_id)


async def pump_notifications(conn: _Conn, deliver: Callable[[str], None]) -> None:
    """Hand every NOTIFY payload *conn* receives to *deliver*, for ever, natively (no thread):
    the connection's socket is waited on with `trio.lowlevel.wait_readable`. Raises
    `psycopg.Error` (or `OSError`) when the connection fails; the caller reconnects."""
    pgconn = conn.pgconn
    fd = conn.fileno()
    while True:
        pgconn.consume_input()
        while (notify := pgconn.notifies()) is not None:
            deliver(notify.extra.decode("utf-8", "replace"))
        await trio.lowlevel.wait_readable(fd)


@asynccontextmanager
async def open_postgres_store(
    dsn: str,
    *,
    clock: Clock | None = None,
    schema: str = "trio_agent",
    poll_interval: float = 0.5,
    max_batch: int = 1000,
    statement_timeout: float = 30.0,
    cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
) -> AsyncIterator[PostgresStore]:
    """Open (creating if needed) the journal in ``schema`` of the database at ``dsn``.

    The store's writer thread and its LISTEN task live inside the block.
    ``clock=None`` lets the database server's clock decide lease expiry (right
    for several machines); a clock callable is used instead when given.
    ``statement_timeout`` (seconds, 0 for none) bounds every statement server-side.
    ``cleanup_grace`` (seconds, default 10) bounds closing the store and the wait for a
    cancelled read; a write still running at close commits or rolls back whole afterwards.
    ``max_batch`` (a whole number >= 1, else `ConfigError`) bounds the items of one group commit.

    Raises `JournalUnavailableError` if the database cannot be reached (naming the
    host, never the password) and `JournalCorruptError` if the schema holds another
    journal format, or no format row and tables of the journal's names unlike its own (left unchanged).
    """
    store = PostgresStore(
        dsn,
        clock=clock,
        schema=schema,
        poll_interval=poll_interval,
        statement_timeout=statement_timeout,
        cleanup_grace=cleanup_grace,
    )
    await store._open(max_batch)  # outside the nursery: an opening error is raised as it is
    try:
        async with trio.open_nursery() as nursery:
            try:
                store._listen_started = True
                nursery.start_soon(store._listen)
                keeper = store._lease_keeper = LeaseKeeper(store)
                nursery.start_soon(keeper.run, name="trio_agent lease keeper")
                yield store
            finally:
                await store.aclose()
    except BaseExceptionGroup as group:
        # The listener and the keeper never raise: the group only wraps what the block raised.
        raise_alone(group)
    finally:
        await store.aclose()  # if the nursery never started
