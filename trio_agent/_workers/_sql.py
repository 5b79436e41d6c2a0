"""The worker tables beside the journal's, and every statement on them.

Rules
=====

* The tables are additive (created if missing, in the journal's schema, under an
  advisory lock): ``inbox`` (submissions), ``registry`` (what a worker last said about
  a session) and ``workers`` (live workers and their load). They hold hints and
  submissions; the journal's streams stay the truth about every request.
* ``inbox`` is unique on (session id, request id), so a retried submission is one row.
  A row moves ``pending`` -> ``taken`` (a worker is serving it) -> ``done`` (its outcome
  is in the journal). Only the session's lease holder moves rows: every such write
  checks the holder's fencing token in the same statement, so a paused former holder
  changes nothing.
* A row is a prompt (``prompt``) or answers to a paused request (``answers``: the answers as
  JSON, ``prompt`` empty; ``answers_for``: the paused request they answer, if the submitter
  named it). ``code`` and ``reason`` say why a row failed or was refused when the worker knows
  (answers that did not resume the session); NULL otherwise. These four columns were added
  after the table: a table made by an earlier version gets them (nullable, so its rows read as
  prompts, and a worker of an earlier version refuses an answers row: its prompt is empty).
* Retention: ``done`` rows are deleted once they were marked done longer ago than the
  workers' ``inbox_retention`` (every worker prunes, in batches; the journal keeps every
  outcome of a request that ran). Rows not ``done`` are never pruned.
* ``workers`` holds one row per worker id, written by one run at a time (``run_id``): a run
  registers only if the id is free (no row, or a row not seen for three of its heartbeat
  intervals), and its heartbeats and its unregistering touch only its own run's row.
* A session is runnable when it has a row not ``done`` and its lease is free (expired,
  released or never taken). A claim takes such sessions with ``FOR UPDATE SKIP
  LOCKED``, so claiming workers never wait for each other, and gives each a new,
  higher fencing token by the server's clock, as `decide_lease` would.
"""

from __future__ import annotations

from typing import LiteralString

from psycopg import sql

from .._journal._postgres import _channel

__all__ = ["INBOX_ADDED", "SCHEMA", "Statements", "inbox_channel", "live_channel"]

SCHEMA: tuple[LiteralString, ...] = (
    "CREATE SCHEMA IF NOT EXISTS {s}",
    # The journal's lease table (the same definition): submissions add placeholder rows to it.
    "CREATE TABLE IF NOT EXISTS {s}.leases("
    " session_id text PRIMARY KEY, owner text NOT NULL, token bigint NOT NULL, expires_at double precision NOT NULL)",
    "CREATE TABLE IF NOT EXISTS {s}.inbox("
    " seq bigserial PRIMARY KEY, session_id text NOT NULL, request_id text NOT NULL, prompt text NOT NULL,"
    " priority integer NOT NULL, submitted_at double precision NOT NULL, state text NOT NULL,"
    " outcome text, updated_at double precision NOT NULL, UNIQUE(session_id, request_id))",
    "CREATE INDEX IF NOT EXISTS inbox_open ON {s}.inbox(session_id) WHERE state <> 'done'",
    # What pruning looks up: done rows by when they were marked done (`inbox_retention`).
    "CREATE INDEX IF NOT EXISTS inbox_done ON {s}.inbox(updated_at) WHERE state = 'done'",
    "CREATE TABLE IF NOT EXISTS {s}.registry("
    " session_id text PRIMARY KEY, state text NOT NULL, worker_id text NOT NULL, updated_at double precision NOT NULL)",
    "CREATE TABLE IF NOT EXISTS {s}.workers("
    " worker_id text PRIMARY KEY, host text NOT NULL, pid integer NOT NULL, concurrency integer NOT NULL,"
    " hosted integer NOT NULL, served bigint NOT NULL, stopping boolean NOT NULL, interval double precision NOT NULL,"
    " started_at double precision NOT NULL, seen_at double precision NOT NULL)",
    # Which run of a worker id the row is (a table made by an earlier version gets the column).
    "ALTER TABLE {s}.workers ADD COLUMN IF NOT EXISTS run_id text",
    # Answers to a paused request, and why a row failed (a table made by an earlier version gets them).
    "ALTER TABLE {s}.inbox ADD COLUMN IF NOT EXISTS answers text, ADD COLUMN IF NOT EXISTS answers_for text,"
    " ADD COLUMN IF NOT EXISTS code text, ADD COLUMN IF NOT EXISTS reason text",
)

INBOX_ADDED: tuple[str, ...] = ("answers", "answers_for", "code", "reason")
"""The inbox's columns added after its first version (what `Statements.presence` looks for)."""

_NOW: LiteralString = "extract(epoch FROM clock_timestamp())::float8"
# The holder's fence, as the store applies it to appends: owner, token, and not expired.
_HELD: LiteralString = (
    "EXISTS (SELECT 1 FROM {s}.leases AS l WHERE l.session_id = i.session_id AND l.owner = %s AND l.token = %s"
    f" AND l.expires_at >= {_NOW})"
)

_TAKEN: LiteralString = " RETURNING i.request_id, i.prompt, i.priority, i.seq, i.answers, i.answers_for"

_STATEMENTS: dict[str, LiteralString] = {
    "lock": "SELECT pg_advisory_xact_lock(hashtext(%s))",
    "tables_present": (
        "SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL"
        " AND to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL"
        " AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = 'run_id'"
        " AND NOT attisdropped)"
        " AND (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = ANY(%s::text[])"
        " AND NOT attisdropped) = cardinality(%s::text[])"
    ),
    # The inbox, and whether it has the columns added after its first version (`INBOX_ADDED`).
    "inbox_present": (
        "SELECT to_regclass(%s) IS NOT NULL, EXISTS (SELECT 1 FROM pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attname = 'reason' AND NOT attisdropped)"
    ),
    "submit": (
        "INSERT INTO {s}.inbox(session_id, request_id, prompt, priority, answers, answers_for, submitted_at, state,"
        f" updated_at) VALUES (%s, %s, %s, %s, %s, %s, {_NOW}, 'pending', {_NOW})"
        " ON CONFLICT (session_id, request_id) DO NOTHING RETURNING seq"
    ),
    "submitted": (
        "SELECT prompt, priority, answers, answers_for FROM {s}.inbox WHERE session_id = %s AND request_id = %s"
    ),
    "placeholder": (
        "INSERT INTO {s}.leases(session_id, owner, token, expires_at) VALUES (%s, '', 0, '-Infinity'::float8)"
        " ON CONFLICT (session_id) DO NOTHING"
    ),
    "notify": "SELECT pg_notify(%s, %s)",
    "status": "SELECT state, outcome, code, reason FROM {s}.inbox WHERE session_id = %s AND request_id = %s",
    # Oldest waiting work first; within a session, the highest priority first.
    "claim": (
        f"WITH now AS (SELECT {_NOW} AS t),"
        " ready AS (SELECT l.session_id FROM {s}.leases AS l"
        " WHERE l.expires_at < (SELECT t FROM now) AND l.session_id <> ALL(%s::text[])"
        " AND EXISTS (SELECT 1 FROM {s}.inbox AS i WHERE i.session_id = l.session_id AND i.state <> 'done')"
        " ORDER BY (SELECT min(i.seq) FROM {s}.inbox AS i WHERE i.session_id = l.session_id AND i.state <> 'done')"
        " LIMIT %s FOR UPDATE OF l SKIP LOCKED),"
        " claimed AS (UPDATE {s}.leases AS t SET owner = %s, token = t.token + 1,"
        " expires_at = (SELECT t FROM now) + %s"
        " FROM ready WHERE t.session_id = ready.session_id"
        " RETURNING t.session_id, t.owner, t.token, t.expires_at),"
        # The registry learns who runs it in the same statement.
        " registered AS (INSERT INTO {s}.registry(session_id, state, worker_id, updated_at)"
        " SELECT session_id, 'running', owner, (SELECT t FROM now) FROM claimed"
        " ON CONFLICT (session_id) DO UPDATE SET state = excluded.state, worker_id = excluded.worker_id,"
        " updated_at = excluded.updated_at)"
        " SELECT session_id, owner, token, expires_at FROM claimed"
    ),
    # A claim nobody hosts (its caller was cancelled): released as the store releases (the token
    # kept, so the next holder's is higher), only where it is still this claim's.
    "unclaim": (
        "UPDATE {s}.leases AS l SET expires_at = '-Infinity'::float8"
        " FROM unnest(%s::text[], %s::bigint[]) AS c(session_id, token)"
        " WHERE l.session_id = c.session_id AND l.token = c.token AND l.owner = %s"
    ),
    # Park a failed session: take its lease for one TTL, as a claim does (only if free: never a
    # live lease, whoever holds it; a row being written is skipped) and say so in the registry, in
    # one statement, so a cancellation finds both done or neither.
    "park": (
        f"WITH now AS (SELECT {_NOW} AS t),"
        " free AS (SELECT l.session_id FROM {s}.leases AS l"
        " WHERE l.session_id = %s AND l.expires_at < (SELECT t FROM now) FOR UPDATE OF l SKIP LOCKED),"
        " parked AS (UPDATE {s}.leases AS t SET owner = %s, token = t.token + 1,"
        " expires_at = (SELECT t FROM now) + %s"
        " FROM free WHERE t.session_id = free.session_id"
        " RETURNING t.session_id, t.owner, t.token, t.expires_at),"
        " registered AS (INSERT INTO {s}.registry(session_id, state, worker_id, updated_at)"
        " SELECT session_id, 'failed', owner, (SELECT t FROM now) FROM parked"
        " ON CONFLICT (session_id) DO UPDATE SET state = excluded.state, worker_id = excluded.worker_id,"
        " updated_at = excluded.updated_at)"
        " SELECT session_id, owner, token, expires_at FROM parked"
    ),
    # Fenced: only the current holder of the session's lease (owner and token) moves its rows.
    # Take every submission not done (what a previous holder took too); done rows stay done.
    "take": (
        f"UPDATE {{s}}.inbox AS i SET state = 'taken', updated_at = {_NOW}"
        " WHERE i.session_id = %s AND i.state <> 'done' AND " + _HELD + _TAKEN
    ),
    # One round trip per request: its row done, and the submissions that arrived since taken.
    "finish_and_take": (
        "WITH done AS (UPDATE {s}.inbox AS i SET state = 'done', outcome = %s, code = %s, reason = %s,"
        f" updated_at = {_NOW}"
        " WHERE i.session_id = %s AND i.request_id = %s AND " + _HELD + " RETURNING i.seq)"
        f" UPDATE {{s}}.inbox AS i SET state = 'taken', updated_at = {_NOW}"
        " WHERE i.session_id = %s AND i.state = 'pending' AND " + _HELD + _TAKEN
    ),
    "mark": (
        f"UPDATE {{s}}.inbox AS i SET state = %s, outcome = %s, code = %s, reason = %s, updated_at = {_NOW}"
        " WHERE i.session_id = %s AND i.request_id = %s AND " + _HELD
    ),
    # Retention: done rows marked more than the given seconds ago, oldest first, a batch at a
    # time; rows another worker is deleting are skipped, never waited for.
    "prune": (
        "DELETE FROM {s}.inbox WHERE seq IN (SELECT d.seq FROM {s}.inbox AS d"
        f" WHERE d.state = 'done' AND d.updated_at < {_NOW} - %s"
        " ORDER BY d.updated_at LIMIT %s FOR UPDATE SKIP LOCKED)"
    ),
    "register": (
        "INSERT INTO {s}.registry(session_id, state, worker_id, updated_at)"
        f" SELECT i.session_id, %s, %s, {_NOW} FROM (SELECT %s::text AS session_id) AS i WHERE "
        + _HELD
        + " ON CONFLICT (session_id) DO UPDATE SET state = excluded.state, worker_id = excluded.worker_id,"
        " updated_at = excluded.updated_at"
    ),
    # A run registers under its worker id only if the id is free: no row, or the row of a run not
    # seen for three of its heartbeat intervals (gone: crashed, or frozen). Every column is then
    # this run's, its start time included. No row back: another run holds the id.
    "worker_start": (
        "INSERT INTO {s}.workers AS w(worker_id, host, pid, concurrency, hosted, served, stopping, interval,"
        f" started_at, seen_at, run_id) VALUES (%s, %s, %s, %s, 0, 0, false, %s, {_NOW}, {_NOW}, %s)"
        " ON CONFLICT (worker_id) DO UPDATE SET host = excluded.host, pid = excluded.pid,"
        " concurrency = excluded.concurrency, hosted = 0, served = 0, stopping = false,"
        " interval = excluded.interval, started_at = excluded.started_at, seen_at = excluded.seen_at,"
        " run_id = excluded.run_id"
        f" WHERE w.seen_at + 3 * w.interval < {_NOW} RETURNING true"
    ),
    "worker_holder": (
        f"SELECT run_id, host, pid, seen_at, interval, stopping, {_NOW} FROM {{s}}.workers WHERE worker_id = %s"
    ),
    # A heartbeat writes only its own run's row (or the row again, if someone deleted it). No row
    # back: another run took the id over.
    "worker_seen": (
        "INSERT INTO {s}.workers AS w(worker_id, host, pid, concurrency, hosted, served, stopping, interval,"
        f" started_at, seen_at, run_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, {_NOW}, {_NOW}, %s)"
        " ON CONFLICT (worker_id) DO UPDATE SET concurrency = excluded.concurrency, hosted = excluded.hosted,"
        " served = excluded.served, stopping = excluded.stopping, interval = excluded.interval,"
        " seen_at = excluded.seen_at WHERE w.run_id = excluded.run_id RETURNING true"
    ),
    "worker_gone": "DELETE FROM {s}.workers WHERE worker_id = %s AND run_id = %s",
    "sessions": (
        f"SELECT k.session_id, l.owner, l.token, l.expires_at, {_NOW},"
        " (SELECT count(*) FROM {s}.inbox AS i WHERE i.session_id = k.session_id AND i.state <> 'done'),"
        " r.state, r.worker_id"
        " FROM (SELECT session_id FROM {s}.registry UNION SELECT session_id FROM {s}.inbox) AS k"
        " LEFT JOIN {s}.leases AS l ON l.session_id = k.session_id"
        " LEFT JOIN {s}.registry AS r ON r.session_id = k.session_id ORDER BY k.session_id"
    ),
    "workers": (
        "SELECT worker_id, host, pid, concurrency, hosted, served, stopping, started_at, seen_at, interval,"
        f" {_NOW} FROM {{s}}.workers ORDER BY worker_id"
    ),
}


def inbox_channel(schema: str) -> str:
    """The NOTIFY channel that wakes workers when a submission lands."""
    return _channel(schema, "inbox")


def live_channel(schema: str) -> str:
    """The NOTIFY channel that carries live (non-durable) deltas to other processes."""
    return _channel(schema, "live")


class Statements:
    """Every statement above, rendered once for one schema."""

    def __init__(self, schema: str) -> None:
        ident = sql.Identifier(schema)
        self.schema = schema
        self.create = [sql.SQL(statement).format(s=ident).as_bytes(None) for statement in SCHEMA]
        self.q = {name: sql.SQL(text).format(s=ident).as_bytes(None) for name, text in _STATEMENTS.items()}
        self.lock_key = f"trio_agent.journal:{schema}"  # the journal's own schema lock: one DDL at a time
        quoted = ident.as_string(None)
        self.inbox_table = f"{quoted}.inbox"
        self.table_names = tuple(
            f"{quoted}.{name}" for name in ("leases", "inbox", "inbox_open", "inbox_done", "registry", "workers")
        )
        added = list(INBOX_ADDED)
        # The tables, the run_id column, and the inbox's added columns.
        self.presence = (*self.table_names, f"{quoted}.workers", self.inbox_table, added, added)
        self.inbox_channel = inbox_channel(schema)
        self.live_channel = live_channel(schema)
