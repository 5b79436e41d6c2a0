"""Reading a submitted request back, from any process: its outcome from the journal, and its
live text deltas.

Rules
=====

* `wait_for_request` reads the session's root stream (`subscribe_durable_events`:
  replay, then live) until the request's one terminal event: ``request_completed``,
  ``request_failed``, ``request_interrupted``, or ``run_paused`` (it waits for answers).
  A session closed and reopened between requests ends one subscription; the wait goes
  on after it from the same cursor. The journal is the truth about every request that
  ran. One that never could is not in it: a submission a worker refused (a row written
  around `submit` whose request id or prompt no session accepts) is marked ``refused``
  in the workers' inbox only, so on a `PostgresStore` the wait also reads that row (in
  the store's schema, every ``poll_interval``: one statement for all the waits of the
  store) and ends ``refused`` (while the row is kept:
  workers prune done rows past their ``inbox_retention``); and ids no journal
  can hold are a `ConfigError` at once, never a wait for what cannot come.
* `subscribe_live` LISTENs for the deltas a worker publishes (``serve_sessions(live=
  True)``). They are not durable: a subscriber that connects late, or a notification
  PostgreSQL drops, misses text; ``n`` counts a request's deltas so a gap shows. Read
  the outcome with `wait_for_request`.
"""

from __future__ import annotations

import json
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from types import TracebackType
from typing import Any

import attrs
import psycopg
import trio
from psycopg import sql
from psycopg.rows import TupleRow

from .._config import validate_id
from .._errors import ConfigError, JournalError, JournalUnavailableError
from .._groups import raise_for_boundary
from .._journal._durable import ROOT_AGENT
from .._journal._events import RequestCompleted, RequestFailed, RequestInterrupted, RunPaused, SessionClosed
from .._journal._postgres import PostgresStore
from .._journal._store import JournalStore, SharedPoll, check_id, stream_id_for
from .._journal._subscribe import DurableEvent, subscribe_durable_events
from .._lifecycle._interrupts import pause_from_json
from .._loop._interrupts import Interrupt, InterruptResumeError
from ._conn import connect, connection_info
from ._queue import _check_schema, resolve_dsn
from ._sql import Statements, live_channel

__all__ = ["LiveDelta", "LiveSubscription", "RequestOutcome", "subscribe_live", "wait_for_request"]


@attrs.frozen
class RequestOutcome:
    """How a request ended, as its session's journal recorded it.

    ``state``: ``completed`` (``text`` is the answer), ``failed`` (``error``),
    ``interrupted`` (``reason``), ``paused`` (waiting for answers to an interrupt) or
    ``refused`` (the session was ended for good before it ran, or a worker refused the
    submission without running it; ``reason`` says which). ``interrupts`` (when paused): the
    questions to answer (`submit_answers`, by their ``id``).
    ``seq`` is the terminal event's position in the root stream (0 for a refusal the inbox
    holds). ``code``: the failure's code as the journal recorded it (continuation answers the
    pause refused: ``unknown_interrupt``, ``missing`` ...), or the code a worker stored with
    its refusal (``stale``); else ``None``.
    """

    request_id: str
    state: str
    text: str = ""
    error: str | None = None
    reason: str | None = None
    seq: int = 0
    code: str | None = None
    interrupts: tuple[Interrupt, ...] = ()


def _outcome(request_id: str, event: object, seq: int, seen: bool) -> RequestOutcome | None:
    if isinstance(event, SessionClosed) and event.final and not seen:
        return RequestOutcome(request_id, "refused", reason="the session was ended for good", seq=seq)
    if getattr(event, "request_id", None) != request_id:
        return None
    if isinstance(event, RequestCompleted):
        return RequestOutcome(request_id, "completed", text=str((event.output or {}).get("text", "")), seq=seq)
    if isinstance(event, RequestFailed):
        return RequestOutcome(request_id, "failed", error=event.error.message, seq=seq, code=event.error.code)
    if isinstance(event, RequestInterrupted):
        return RequestOutcome(request_id, "interrupted", reason=str(event.reason.value), seq=seq)
    if isinstance(event, RunPaused):
        return RequestOutcome(request_id, "paused", seq=seq, interrupts=_questions(event))
    return None


def _questions(event: RunPaused) -> tuple[Interrupt, ...]:
    """The questions a pause asks (none if its state does not decode: the wait still ends paused)."""
    try:
        return tuple(pause_from_json(event.state).interrupts)
    except InterruptResumeError:
        return ()


async def wait_for_request(store: JournalStore, session_id: str, request_id: str) -> RequestOutcome:
    """Wait until request *request_id* of *session_id* ends, and return how (module rules).

    *store* is any open journal store of that journal (in another process:
    `open_postgres_store` on the workers' DSN and schema). Put a deadline around it
    (``trio.fail_after``) if the wait must be bounded.
    """
    # What a worker checks before it serves a row: an id that fails here is never in a journal.
    validate_id(session_id, name="session_id", stored=True)
    check_id(stream_id_for(session_id, ROOT_AGENT), "session_id (as a stream id)")
    validate_id(request_id, name="request_id", stored=True)
    if not isinstance(store, PostgresStore):  # no workers' inbox beside it: the journal alone
        return await _journal_outcome(store, session_id, request_id)
    found: list[RequestOutcome] = []
    try:
        async with trio.open_nursery() as nursery:

            async def first(wait: Callable[[Any, str, str], Awaitable[RequestOutcome]]) -> None:
                found.append(await wait(store, session_id, request_id))
                nursery.cancel_scope.cancel()

            nursery.start_soon(first, _journal_outcome)
            nursery.start_soon(first, _refusal)
    except BaseExceptionGroup as group:  # one error out (the journal's, typed), never a group
        raise_for_boundary(group)
    return found[0]


async def _journal_outcome(store: JournalStore, session_id: str, request_id: str) -> RequestOutcome:
    stream_id = stream_id_for(session_id, ROOT_AGENT)
    seq = 0
    seen = False  # the request appeared in the stream
    while True:
        async with subscribe_durable_events(store, stream_id, after=min(seq, await store.head(stream_id))) as events:
            async for item in events:
                if isinstance(item, DurableEvent):
                    seq = item.envelope.seq
                    event = item.envelope.event
                    seen = seen or getattr(event, "request_id", None) == request_id
                    found = _outcome(request_id, event, seq, seen)
                    if found is not None:
                        return found
        # The stream ended at a session_closed: the next life (or the first) appends after it.
        await store.wait_for_append(stream_id, seq)


_Submission = tuple[str, str]
"""A submission's (session id, request id)."""

_Why = tuple[str | None, str | None]
"""Why a worker refused a submission, as its row says: (code, reason), either ``None`` if not stored."""

_REFUSED = (
    "SELECT i.session_id, i.request_id{why} FROM {{s}}.inbox AS i JOIN unnest(%s::text[], %s::text[])"
    " AS k(session_id, request_id) ON i.session_id = k.session_id AND i.request_id = k.request_id"
    " WHERE i.state = 'done' AND i.outcome = 'refused'"
)


class _Refusals:
    """The `wait_for_request`\\ s of one store reading its workers' inbox for their refusal: ONE
    statement per ``poll_interval`` for all of them (`SharedPoll`), however many there are."""

    __slots__ = ("_queries", "_statements", "waits")

    def __init__(self, store: PostgresStore) -> None:
        self._statements = Statements(store.schema)
        ident = sql.Identifier(store.schema)
        # An inbox an earlier version made, that no worker or submitter of this one migrated yet,
        # has no code and reason: its refusals are still read.
        self._queries = {
            added: sql.SQL(_REFUSED.format(why=", i.code, i.reason" if added else ", NULL, NULL"))
            .format(s=ident)
            .as_bytes(None)
            for added in (True, False)
        }
        self.waits: SharedPoll[_Submission, _Why] = SharedPoll()

    async def refused(self, store: PostgresStore, submissions: Sequence[_Submission]) -> dict[_Submission, _Why]:
        """Which of *submissions* the inbox has done ``refused``, and why, in one statement (a failed
        read: none; the journal's own wait reports the store's failures, and this one never spins
        on them)."""
        statements, queries = self._statements, self._queries

        def read(conn: _Conn) -> dict[_Submission, _Why]:
            table = statements.inbox_table
            found = conn.execute(statements.q["inbox_present"], (table, table)).fetchone()
            if found is None or not found[0]:
                return {}
            keys = ([session for session, _ in submissions], [request for _, request in submissions])
            return {(row[0], row[1]): (row[2], row[3]) for row in conn.execute(queries[found[1]], keys).fetchall()}

        try:
            return await store.run_read(read)
        except JournalError:
            return {}


_REFUSALS: weakref.WeakKeyDictionary[PostgresStore, _Refusals] = weakref.WeakKeyDictionary()
"""Per store (never kept alive by it: a `_Refusals` holds no reference to its store)."""


async def _refusal(store: PostgresStore, session_id: str, request_id: str) -> RequestOutcome:
    """Once the workers' inbox in *store*'s schema has this submission done ``refused``: a row no
    session accepted leaves nothing in the journal. Never returns while there is none (no inbox,
    no such row, or one served: the journal says how it ended). The waits of a store share their
    reads of the inbox: one per ``poll_interval`` (`_Refusals`)."""
    refusals = _REFUSALS.get(store)
    if refusals is None:
        refusals = _REFUSALS[store] = _Refusals(store)
    submission = (session_id, request_id)
    told: list[_Why] = []

    def ready(why: _Why) -> bool:
        told.append(why)
        return True

    with refusals.waits.registered(submission, ready) as waiter:
        first = (await refusals.refused(store, [submission])).get(submission)  # its own first look
        if first is not None:
            told.append(first)
        else:
            await refusals.waits.wait(waiter, partial(refusals.refused, store), store.poll_interval)
    code, why = told[-1] if told else (None, None)
    if why is None:
        why = "a worker refused the submission without running it: no session accepts its request id or prompt"
    return RequestOutcome(request_id, "refused", reason=why, code=code)


@attrs.frozen
class LiveDelta:
    """A piece of a request's text as a worker streamed it (not durable)."""

    session_id: str
    request_id: str
    agent_id: str
    n: int
    text: str


_Conn = psycopg.Connection[TupleRow]


def _delta(data: object) -> LiveDelta | None:
    if not isinstance(data, dict):
        return None
    session_id, request_id, agent_id, n, text = (data.get(key) for key in ("s", "r", "a", "n", "t"))
    if (
        isinstance(session_id, str)
        and isinstance(request_id, str)
        and isinstance(agent_id, str)
        and isinstance(text, str)
        and type(n) is int
        and n >= 1
    ):
        return LiveDelta(session_id, request_id, agent_id, n, text)
    return None


class LiveSubscription:
    """``async for delta in subscription``: the live deltas of one session (module rules)."""

    def __init__(self, conn: _Conn, session_id: str | None) -> None:
        self._conn = conn
        self._session_id = session_id
        self._ready: deque[LiveDelta] = deque()
        self.malformed = 0  # payloads that were not a worker's (counted, skipped)

    def __aiter__(self) -> LiveSubscription:
        return self

    async def __anext__(self) -> LiveDelta:
        if self._ready:  # what arrived before a close is still delivered
            return self._ready.popleft()
        if self._conn.closed:
            raise StopAsyncIteration
        pgconn = self._conn.pgconn
        fd = self._conn.fileno()
        while not self._ready:
            try:
                pgconn.consume_input()
                while (notify := pgconn.notifies()) is not None:
                    self._take(notify.extra.decode("utf-8", "replace"))
            except psycopg.Error as exc:
                raise JournalUnavailableError(f"the live subscription's connection failed: {exc}") from None
            if not self._ready:
                try:
                    await trio.lowlevel.wait_readable(fd)
                except trio.ClosedResourceError:  # closed by `aclose` from another task
                    raise StopAsyncIteration from None
        return self._ready.popleft()

    def _take(self, payload: str) -> None:
        # Any role that may connect can NOTIFY this channel: a payload is untrusted.
        try:
            delta = _delta(json.loads(payload))
        except Exception:  # too deep, too large a number, not JSON: skipped and counted
            delta = None
        if delta is None:
            self.malformed += 1
        elif self._session_id is None or delta.session_id == self._session_id:
            self._ready.append(delta)

    async def aclose(self) -> None:
        """Stop listening; a task reading the subscription ends its iteration."""
        if not self._conn.closed:
            trio.lowlevel.notify_closing(self._conn.fileno())
            self._conn.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> LiveSubscription:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


async def subscribe_live(
    session_id: str | None = None, *, dsn: str | None = None, schema: str = "trio_agent"
) -> LiveSubscription:
    """Listen for live deltas of *session_id* (``None``: every session):
    ``async with await subscribe_live(sid, dsn=...) as deltas: async for delta in deltas``.

    Listening starts before this returns: every delta published from then on is seen.
    """
    channel = live_channel(_check_schema(schema))
    target = resolve_dsn(dsn)
    if session_id is not None and not isinstance(session_id, str):
        raise ConfigError(f"session_id must be a string or None, not {session_id!r}")

    conninfo = connection_info(target, name="trio_agent live")

    def connect_listening() -> _Conn:
        conn = connect(conninfo)
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except psycopg.Error as exc:
            conn.close()
            raise JournalUnavailableError(f"cannot LISTEN: {str(exc).strip()}") from None
        return conn

    return LiveSubscription(await trio.to_thread.run_sync(connect_listening), session_id)
