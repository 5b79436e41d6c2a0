"""The durable request queue, from any process: submit, answer, and read where things stand.

These are plain blocking functions over a DSN (psycopg 3, sync), usable outside
Trio; from a Trio task run them with ``trio.to_thread.run_sync``. A submission
returns once its row is committed: from then on some worker runs the request
exactly once, and its events and outcome are in the session's journal stream
(`subscribe_durable_events`, or `wait_for_request`). A submission of answers
(`submit_answers`) is a row like a prompt's: the worker that serves it resumes the
paused session with them, and the continuation's request id is the row's.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator, Sequence

import attrs
import psycopg
import psycopg.errors
from psycopg.rows import TupleRow

from .._config import short_repr, validate_id, validate_limit
from .._errors import CommandConflictError, ConfigError, JournalUnavailableError
from .._journal._postgres import _SCHEMA_NAME
from .._loop._interrupts import InterruptAnswer
from ._answers import encode_answers
from ._conn import connect, connection_info
from ._sql import Statements

__all__ = [
    "DEFAULT_INBOX_RETENTION",
    "DEFAULT_MAX_PROMPT_BYTES",
    "DSN_ENV",
    "PromptTooLargeError",
    "RequestStatus",
    "SessionStatus",
    "Submitter",
    "WorkerStatus",
    "list_sessions",
    "list_workers",
    "request_status",
    "resolve_dsn",
    "submit",
    "submit_answers",
]

DSN_ENV = "TRIO_AGENT_DSN"
"""The environment variable a DSN is read from when none is given."""

DEFAULT_INBOX_RETENTION = 7 * 24 * 3600.0
"""Seconds a done submission stays in the inbox before workers prune it (`serve_sessions`)."""

DEFAULT_MAX_PROMPT_BYTES = 1_000_000
"""The largest prompt a submission takes by default: bytes of its text as JSON writes it (UTF-8,
with JSON's escapes: a newline or a tab two bytes, another control character six). What the web
server's ``max_body`` admits by default; `submit`, `Submitter` and `serve_sessions` take
``max_prompt_bytes``."""

_Conn = psycopg.Connection[TupleRow]

# The most bytes one character takes as JSON text (``\u0001``): a prompt of at most limit / 6
# characters fits without being measured.
_MAX_JSON_CHAR = 6
_json_text = json.JSONEncoder(ensure_ascii=False).encode


class PromptTooLargeError(ConfigError):
    """A prompt larger than ``max_prompt_bytes`` (``limit``): refused by `submit` before anything is
    stored, and by a worker for a row over its own limit (marked done ``refused``)."""

    def __init__(self, message: str, *, limit: int = 0) -> None:
        super().__init__(message)
        self.limit = limit


def resolve_dsn(dsn: str | None) -> str:
    """*dsn*, or else ``$TRIO_AGENT_DSN``; `ConfigError` if neither is set."""
    if dsn is not None and not isinstance(dsn, str):
        raise ConfigError(f"dsn must be a connection string or URI, not {type(dsn).__name__}")
    found = dsn if dsn is not None else os.environ.get(DSN_ENV)
    if not found:
        raise ConfigError(f"no PostgreSQL DSN: pass dsn= (or --dsn) or set ${DSN_ENV}")
    return found


@attrs.frozen
class RequestStatus:
    """Where one submission stands in the inbox (the journal holds its events and outcome).

    ``state``: ``pending`` (no worker took it yet), ``taken`` (a worker is serving it) or
    ``done``; ``outcome`` (when done): ``completed``, ``failed``, ``interrupted``, ``paused`` or
    ``refused`` (never ran). ``code`` and ``reason``: why a submission of answers failed or was
    refused (``code`` an `InterruptIssue` code, e.g. ``stale``, ``unknown_interrupt``), else
    ``None`` (a prompt's failure is in the journal: `wait_for_request`).
    """

    session_id: str
    request_id: str
    state: str
    outcome: str | None
    code: str | None = None
    reason: str | None = None


@attrs.frozen
class SessionStatus:
    """One session as the registry sees it.

    ``state``: ``running`` (a worker holds its lease: ``worker``, until ``lease_until``
    seconds from now), ``runnable`` (work waits, no holder), ``paused`` (waiting for
    answers to an interrupt), ``waiting`` (idle, waiting for input), ``done`` (ended for
    good) or ``failing`` (it failed on ``worker``, which holds it for ``lease_until`` more
    seconds before anyone retries it; the worker's log says why). ``queued`` counts its
    submissions not done.
    """

    session_id: str
    state: str
    worker: str | None
    lease_until: float | None
    queued: int


@attrs.frozen
class WorkerStatus:
    """One worker process: ``live`` if it was seen within three of its heartbeat intervals."""

    worker_id: str
    host: str
    pid: int
    concurrency: int
    hosted: int
    served: int
    stopping: bool
    live: bool
    seen_ago: float
    uptime: float


def _connect(dsn: str) -> _Conn:
    return connect(connection_info(dsn, name="trio_agent submit"))


def ensure_tables(conn: _Conn, statements: Statements) -> None:
    """Create the worker tables if missing. Looked up first, so the usual call takes no lock and
    needs no CREATE privilege; only a missing table takes the journal's schema lock."""
    if conn.execute(statements.q["tables_present"], statements.presence).fetchone() == (True,):
        return
    with conn.transaction():
        conn.execute(statements.q["lock"], (statements.lock_key,))
        for statement in statements.create:
            conn.execute(statement)


def _check_schema(schema: object) -> str:
    """The journal store's rule (ASCII letters, digits, ``_``), so a schema a submitter accepts is
    one every worker can open."""
    if not isinstance(schema, str) or not _SCHEMA_NAME.match(schema) or len(schema.encode()) > 63:
        raise ConfigError(f"schema must be a plain SQL identifier of at most 63 bytes, not {schema!r}")
    return schema


def _check_prompt(prompt: object, max_bytes: int) -> str:
    """A prompt a session accepts and the inbox can store: non-blank text, without NUL (no
    PostgreSQL text holds one), encodable as UTF-8 (no lone surrogates: a command line's
    undecodable bytes arrive as those), at most *max_bytes* as JSON text (`PromptTooLargeError`):
    the journal stores it so, and one huge prompt held up a worker's other sessions."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("prompt must be a non-empty string")
    if "\x00" in prompt:
        raise ConfigError("prompt must not contain NUL characters")
    if len(prompt) > max_bytes:  # a byte at least per character: refused before copying anything
        raise _too_large(f"{len(prompt)} characters", max_bytes)
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"prompt must be valid Unicode text: it has a lone surrogate U+{ord(prompt[exc.start]):04X} "
            f"at {exc.start} (bytes that are not UTF-8?)"
        ) from None
    if len(prompt) * _MAX_JSON_CHAR > max_bytes:  # else it fits, whatever its characters
        size = len(_json_text(prompt).encode("utf-8")) - 2  # without the quotes
        if size > max_bytes:
            raise _too_large(f"{size} bytes as JSON", max_bytes)
    return prompt


def _too_large(size: str, limit: int) -> PromptTooLargeError:
    return PromptTooLargeError(
        f"prompt is {size}: more than max_prompt_bytes={limit} (bytes of its JSON text, UTF-8)", limit=limit
    )


def _check_ids(session_id: object, request_id: object) -> None:
    """Ids a submission could have been stored under, checked before any statement: one no row
    can hold is a `ConfigError` naming it, never a driver's error or a failed query. (A read
    keeps the older rule ids were stored under: ``stored=True``.)"""
    validate_id(session_id, name="session_id", stored=True)
    validate_id(request_id, name="request_id", stored=True)


def _check_submission(
    session_id: object, prompt: object, request_id: str | None, priority: object, max_prompt_bytes: int
) -> str:
    """The request id of a submission `submit` accepts (made if not given), else `ConfigError`."""
    request_id = _check_row(session_id, request_id, priority)
    _check_prompt(prompt, max_prompt_bytes)
    return request_id


def _check_row(session_id: object, request_id: str | None, priority: object) -> str:
    """What every submission is checked for: its ids (the request id made if not given) and priority."""
    validate_id(session_id, name="session_id")
    if request_id is None:
        request_id = f"req-{uuid.uuid4().hex[:12]}"
    validate_id(request_id, name="request_id")
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
        raise ConfigError(f"priority must be a 32-bit whole number, not {short_repr(priority)}")
    return request_id


def _check_answers(
    session_id: object,
    answers: Sequence[InterruptAnswer],
    request_id: str | None,
    paused_request_id: object,
    priority: object,
    max_prompt_bytes: int,
) -> tuple[str, str]:
    """The request id (made if not given) and the stored text of a submission of answers
    `submit_answers` accepts; `ConfigError` for an id or priority, `InterruptResumeError` for
    answers that are not ones (``invalid_payload``), `PromptTooLargeError` for too many bytes."""
    request_id = _check_row(session_id, request_id, priority)
    if paused_request_id is not None:
        validate_id(paused_request_id, name="paused_request_id", stored=True)
    text = encode_answers(answers)
    if len(text) > max_prompt_bytes:  # ASCII JSON: its length is its size
        raise PromptTooLargeError(
            f"the answers are {len(text)} bytes as JSON: more than max_prompt_bytes={max_prompt_bytes}",
            limit=max_prompt_bytes,
        )
    return request_id, text


class Submitter:
    """One connection that submits and reads statuses: ``with Submitter(dsn) as queue``.

    Not thread-safe: one per thread. `submit` (the function) opens one per call.
    ``max_prompt_bytes``: the largest prompt its `submit` takes (`DEFAULT_MAX_PROMPT_BYTES`).
    """

    def __init__(
        self, dsn: str | None = None, *, schema: str = "trio_agent", max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    ) -> None:
        self.statements = Statements(_check_schema(schema))
        self.max_prompt_bytes = validate_limit(max_prompt_bytes, name="max_prompt_bytes")
        self._conn = _connect(resolve_dsn(dsn))
        self._ready = False

    def __enter__(self) -> Submitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as exc:
            raise JournalUnavailableError(f"{what} failed: {str(exc).strip()}") from None

    def _ensure(self) -> None:
        if not self._ready:
            with self._errors("creating the worker tables"):
                ensure_tables(self._conn, self.statements)
            self._ready = True

    def submit(self, session_id: str, prompt: str, *, request_id: str | None = None, priority: int = 0) -> str:
        """Durably accept *prompt* as request *request_id* of *session_id*; returns the request id.

        Idempotent: submitting the same request id again with the same prompt and priority
        returns at once and changes nothing; with different content it raises
        `CommandConflictError` (while the row is kept: past the workers' ``inbox_retention``
        a retry is a new row, answered from the journal). ``priority``: among one session's waiting submissions the
        highest runs first (then the oldest). Some worker serving the schema runs it once. A
        prompt over ``max_prompt_bytes`` (bytes of its JSON text) is `PromptTooLargeError`.
        """
        request_id = _check_submission(session_id, prompt, request_id, priority, self.max_prompt_bytes)
        return self._insert(session_id, request_id, (prompt, priority, None, None), "a different prompt or priority")

    def submit_answers(
        self,
        session_id: str,
        answers: Sequence[InterruptAnswer],
        *,
        request_id: str | None = None,
        paused_request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Durably accept *answers* to the paused request of *session_id*; returns the request id
        of the continuation they start (what `wait_for_request` waits for).

        *answers*: what `Session.resume` takes (`Approve`, `Reject`, `Respond`, `Cancel`). The
        worker that serves the row (in the session's inbox order, as a prompt's: ``priority``,
        then age) resumes the session with them, as request *request_id*: its outcome is the
        continuation's (``completed``, ``paused`` again ...). Answers the pause refuses
        (``unknown_interrupt``, ``missing`` ...) fail the row, the continuation recorded failed;
        a session not paused (answered already: code ``stale``), or paused on another request
        than *paused_request_id* when it is given, refuses the row, and nothing runs. Either way
        the session stays as it was, and `request_status` gives the ``code`` and ``reason``.

        Idempotent as `submit`: the same request id with the same answers is one row; with other
        content `CommandConflictError`. Answers that are not answers, or not JSON, are an
        `InterruptResumeError` (``invalid_payload``) before anything is stored; more than
        ``max_prompt_bytes`` of JSON is `PromptTooLargeError`.
        """
        request_id, text = _check_answers(
            session_id, answers, request_id, paused_request_id, priority, self.max_prompt_bytes
        )
        return self._insert(session_id, request_id, ("", priority, text, paused_request_id), "different answers")

    def _insert(
        self, session_id: str, request_id: str, content: tuple[str, int, str | None, str | None], differs: str
    ) -> str:
        """One row (idempotent by request id: `CommandConflictError` for other *content*), and its NOTIFY."""
        self._ensure()
        q = self.statements.q
        with self._errors("submitting a request"), self._conn.transaction():
            self._conn.execute(q["placeholder"], (session_id,))
            row = self._conn.execute(q["submit"], (session_id, request_id, *content)).fetchone()
            if row is None:
                known = self._conn.execute(q["submitted"], (session_id, request_id)).fetchone()
                if known is not None and tuple(known) != content:
                    raise CommandConflictError(
                        f"request {request_id!r} of session {session_id!r} was already submitted with {differs}",
                        command_id=request_id,
                    )
                return request_id
            # In the transaction: delivered at its commit, never before the row is visible.
            self._conn.execute(q["notify"], (self.statements.inbox_channel, session_id))
        return request_id

    def status(self, session_id: str, request_id: str) -> RequestStatus | None:
        """Where a submission stands, or ``None`` if it was never submitted (or was done longer
        ago than the workers' ``inbox_retention``: the journal keeps its outcome)."""
        _check_ids(session_id, request_id)
        self._ensure()
        with self._errors("reading a request's status"):
            row = self._conn.execute(self.statements.q["status"], (session_id, request_id)).fetchone()
        return None if row is None else RequestStatus(session_id, request_id, *row)

    def sessions(self) -> list[SessionStatus]:
        """Every session that was submitted to or served by a worker, with its state."""
        self._ensure()
        with self._errors("listing sessions"):
            rows = self._conn.execute(self.statements.q["sessions"]).fetchall()
        return [_session_status(*row) for row in rows]

    def workers(self) -> list[WorkerStatus]:
        """Every worker registered in the schema (a crashed one stays until its row is reused)."""
        self._ensure()
        with self._errors("listing workers"):
            rows = self._conn.execute(self.statements.q["workers"]).fetchall()
        return [
            WorkerStatus(
                worker_id=worker_id,
                host=host,
                pid=pid,
                concurrency=concurrency,
                hosted=hosted,
                served=served,
                stopping=stopping,
                live=now - seen_at <= 3 * interval,
                seen_ago=max(now - seen_at, 0.0),
                uptime=max(now - started_at, 0.0),
            )
            for worker_id, host, pid, concurrency, hosted, served, stopping, started_at, seen_at, interval, now in rows
        ]


def _session_status(
    session_id: str,
    owner: str | None,
    token: int | None,
    expires_at: float | None,
    now: float,
    queued: int,
    said: str | None,
    said_by: str | None,
) -> SessionStatus:
    live = bool(owner and token and expires_at is not None and expires_at >= now)
    if said == "failed":  # parked by the worker it failed on: retried when the lease runs out
        left = expires_at - now if live and expires_at is not None else None
        return SessionStatus(session_id, "failing", said_by, left, queued)
    if live and expires_at is not None:
        return SessionStatus(session_id, "running", owner, expires_at - now, queued)
    if queued:
        return SessionStatus(session_id, "runnable", None, None, queued)
    state = {"paused": "paused", "ended": "done"}.get(said or "", "waiting")
    return SessionStatus(session_id, state, None, None, queued)


def submit(
    session_id: str,
    prompt: str,
    *,
    request_id: str | None = None,
    priority: int = 0,
    dsn: str | None = None,
    schema: str = "trio_agent",
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
) -> str:
    """Submit one request from any process (see `Submitter.submit`); returns its request id.

    ``dsn`` defaults to ``$TRIO_AGENT_DSN``. Opens and closes one connection: for many
    submissions keep a `Submitter`.
    """
    max_prompt_bytes = validate_limit(max_prompt_bytes, name="max_prompt_bytes")
    request_id = _check_submission(session_id, prompt, request_id, priority, max_prompt_bytes)  # before connecting
    with Submitter(dsn, schema=schema, max_prompt_bytes=max_prompt_bytes) as queue:
        return queue.submit(session_id, prompt, request_id=request_id, priority=priority)


def submit_answers(
    session_id: str,
    answers: Sequence[InterruptAnswer],
    *,
    request_id: str | None = None,
    paused_request_id: str | None = None,
    priority: int = 0,
    dsn: str | None = None,
    schema: str = "trio_agent",
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
) -> str:
    """Answer a paused session from any process (see `Submitter.submit_answers`); returns the
    continuation's request id. ``dsn`` defaults to ``$TRIO_AGENT_DSN``; one connection per call."""
    max_prompt_bytes = validate_limit(max_prompt_bytes, name="max_prompt_bytes")
    request_id, _ = _check_answers(  # before connecting
        session_id, answers, request_id, paused_request_id, priority, max_prompt_bytes
    )
    with Submitter(dsn, schema=schema, max_prompt_bytes=max_prompt_bytes) as queue:
        return queue.submit_answers(
            session_id, answers, request_id=request_id, paused_request_id=paused_request_id, priority=priority
        )


def request_status(
    session_id: str, request_id: str, *, dsn: str | None = None, schema: str = "trio_agent"
) -> RequestStatus | None:
    """Where one submission stands (``None``: never submitted, or done and pruned)."""
    _check_ids(session_id, request_id)  # before connecting
    with Submitter(dsn, schema=schema) as queue:
        return queue.status(session_id, request_id)


def list_sessions(*, dsn: str | None = None, schema: str = "trio_agent") -> list[SessionStatus]:
    """The registry: every session submitted to or served by a worker, and its state."""
    with Submitter(dsn, schema=schema) as queue:
        return queue.sessions()


def list_workers(*, dsn: str | None = None, schema: str = "trio_agent") -> list[WorkerStatus]:
    """Every registered worker, live or not, with its load."""
    with Submitter(dsn, schema=schema) as queue:
        return queue.workers()
