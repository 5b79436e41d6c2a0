"""`serve_sessions`: one worker process serving sessions from a PostgreSQL schema.

Rules
=====

* Claim: while it has free slots (``concurrency``), the worker claims runnable
  sessions (`_sql`: ``FOR UPDATE SKIP LOCKED``, a new fencing token each), never one it
  still hosts. It looks again when a submission's NOTIFY arrives, when one of its
  sessions is released, and otherwise every ``poll_interval`` (+-20% jitter). Nothing spins.
* Host: a claimed session is opened on its claimed lease (`open_journal(lease=...)`)
  and with ``unfinished="keep"``: the previous holder's accepted requests stay
  runnable and started ones go on from their last durable point. Each submission not
  done is served once, by `Session.serve_request` (idempotent by request id), the ones
  the journal already knows first, then by priority and age; its row is marked done with
  the journal's outcome only once that outcome is durable. The session is kept while it
  has work and released when idle (closed cleanly; the lease given back, so the next
  submission is claimed at once, by any worker).
* A submission of answers (`submit_answers`) is served in the same order, by resuming the
  paused session with them (`_serve_answers`) as request *request_id*: the continuation's id
  is the row's, so `wait_for_request` finds its end and a worker that takes the session over
  finds it in the journal (ended: marked; started: it goes on; accepted: resumed again, once).
  Answers the pause refuses fail the row (the continuation is recorded failed); a session not
  paused, or paused on another request than the one the row names, refuses it (``stale``),
  and so does a row whose answers do not decode. Either way the row stores the code and the
  reason, and the session is served on: never the worker's failure, nor the session's.
* A submission no session would accept (a bad id or prompt, written around `submit`, or a
  prompt over ``max_prompt_bytes``: submitted with a larger limit) is marked done ``refused``
  before the journal sees it; so are the submissions of a session ended for good. Ids are judged
  by the rule they were submitted under (``validate_id(stored=True)``): one queued before C1
  controls were refused in ids is served.
* Open requests the journal holds without a submission (a plain process's requests
  that crashed) are recorded interrupted by the restart, as a plain reopen would.
* A session that fails to open or serve is parked, not released: the worker holds its
  lease for one more TTL without serving it (the registry says ``failed``), so a broken
  session is retried once per ``lease_ttl``, never in a loop. One session's failure (a bug
  included) never stops the worker or its other sessions.
* Stop (``stop`` set, SIGTERM in the CLI): no more claims and no new requests; the
  running ones get ``shutdown_grace`` seconds to finish, then are handed off: the
  worker gives the session up without recording anything (as if it died) and releases
  the lease at once, so another worker takes it over, with a higher token, from its
  last durable point. Cancelling `serve_sessions` instead closes its sessions as a
  session close does (running requests are recorded interrupted).
* Retention: every heartbeat interval, each worker deletes done submissions marked done
  more than ``inbox_retention`` seconds ago (`_sql`), in batches until none is left.
* Identity: the run registers under ``worker_id`` before it claims anything, and only if no
  other live run holds that id (`Control.start`: `WorkerIdInUseError`). A run that finds its
  id taken over (it was frozen past three heartbeats and a newer run took the id) stops: it
  hands its sessions off at once and raises `WorkerIdInUseError`.
* Live deltas (``live=True``): `_live`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import trio

from .._cleanup import DEFAULT_CLEANUP_GRACE, bounded_shield, validate_cleanup_grace
from .._config import finite_seconds, short_repr, validate_id, validate_limit
from .._errors import (
    ConfigError,
    JournalError,
    LeaseLostError,
    SessionClosedError,
    TrioAgentError,
    error_code,
)
from .._journal._durable import DurableJournal, open_journal
from .._journal._events import RequestInterrupted, RequestInterruptReason
from .._journal._lease import check_seconds, default_owner
from .._journal._postgres import PostgresStore, open_postgres_store
from .._journal._projection import RequestState
from .._journal._store import Lease, check_id, stream_id_for
from .._loop._interrupts import InterruptAnswer, InterruptIssue, InterruptResumeError
from .._session._endings import record_request_end
from .._session._open import open_session
from .._session._session import Session
from .._session._spec import AgentSpec
from .._session._stream import EventSink, discard
from ._answers import decode_answers
from ._conn import connection_info
from ._control import Control, ControlError, InboxListener, Row, WorkerIdInUseError, jittered
from ._live import LivePublisher
from ._queue import DEFAULT_INBOX_RETENTION, DEFAULT_MAX_PROMPT_BYTES, _check_prompt, _check_schema, resolve_dsn
from ._sql import Statements

__all__ = ["WorkerReport", "serve_sessions"]

_log = logging.getLogger("trio_agent.workers")

_UNFINISHED = (RequestState.ACCEPTED, RequestState.STARTED)
_PRUNE_BATCH = 1000  # done submissions deleted per statement


@attrs.define
class WorkerReport:
    """What one `serve_sessions` run did (returned when it stops)."""

    worker_id: str
    claimed: int = 0
    served: int = 0
    handed_off: int = 0
    lost_sessions: int = 0  # taken over while held (paused past the lease, the store unreachable)
    failed_sessions: int = 0  # could not be opened or served: parked for a lease TTL
    refused: int = 0  # submissions no session would accept
    notifications: int = 0
    pruned: int = 0  # done submissions this worker deleted past the inbox retention
    live_sent: int = 0
    live_dropped: int = 0


def _next_row(journal: DurableJournal, rows: Iterable[Row]) -> Row:
    """The submission to serve next: one an earlier holder left open in the journal first (it may
    be half-way), then the highest priority, then the oldest (prompts and answers alike)."""
    projection = journal.projection()

    def order(row: Row) -> tuple[bool, int, int]:
        request_id, _, priority, seq, _, _ = row
        return (projection.request(request_id) is None, -priority, seq)

    return min(rows, key=order)


_Served = tuple[str, str | None, str | None]
"""How a row ended, as it is marked: (outcome, code, reason)."""


def _stale(message: str) -> InterruptResumeError:
    return InterruptResumeError([InterruptIssue(None, "stale", message)])


async def _serve_answers(
    session: Session,
    request_id: str,
    answers: Sequence[InterruptAnswer],
    answers_for: str | None,
    sink: EventSink,
) -> tuple[RequestState, TrioAgentError | None]:
    """Resume *session* with *answers* as request *request_id*, at most once: `serve_request` for
    a continuation. Returns how the journal says it ended, and the error it ended with (a failed
    continuation: answers the pause refused, say). `InterruptResumeError` when nothing was
    written: the session is not paused (``stale``), or paused on another request than
    *answers_for*. Lease loss, or a journal that could not record the end, raises, as
    `serve_request` does: the store, not this process, knows how it ended.

    The continuation is the one `Session.resume` makes (its checks: open, paused, idle), run as
    the row's request id (`Session._serve_continuation`)."""
    journal = session.journal
    record = journal.projection().request(request_id)
    if record is not None and record.state is RequestState.STARTED:
        # An earlier holder's continuation, past its answers: it goes on from its last durable point.
        return await session._serve_request(request_id, "", sink, queued=True), None
    if record is not None and record.state is not RequestState.ACCEPTED:
        return record.state, None  # ended: never run again
    paused = session.paused
    if paused is None:
        raise _stale(f"session {session.session_id!r} is not paused: nothing to resume (answered already?)")
    if answers_for is not None and paused.run_id != answers_for:
        raise _stale(
            f"session {session.session_id!r} is paused on request {paused.run_id!r}, not {answers_for!r} "
            "(that one was answered already?)"
        )
    return await session._serve_continuation(request_id, answers, sink, accepted_before=record is not None)


def _usable_session_id(session_id: str) -> bool:
    try:
        # A queued session is served by the rules it was submitted under (it may predate the C1 rule).
        validate_id(session_id, name="session_id", stored=True)
        check_id(stream_id_for(session_id, "root"), "stream id")
    except TrioAgentError:
        return False
    return "/" not in session_id


async def _hint(statement: Awaitable[object]) -> None:
    """A registry write or a wake-up after the real work is done: a failure is logged, not acted on."""
    try:
        await statement
    except ControlError as exc:
        _log.debug("a worker hint failed: %s", exc)


class _Hosted:
    __slots__ = ("failed", "handing_off", "journal", "lease")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.journal: DurableJournal | None = None
        self.handing_off = False
        self.failed = False


class _Worker:
    def __init__(
        self,
        spec: AgentSpec,
        store: PostgresStore,
        control: Control,
        *,
        concurrency: int,
        lease_ttl: float,
        poll_interval: float,
        cleanup_grace: float,
        live: bool,
        inbox_retention: float | None = None,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    ) -> None:
        self.spec = spec
        self.store = store
        self.control = control
        self.statements = control.statements
        self.concurrency = concurrency
        self.lease_ttl = lease_ttl
        self.poll_interval = poll_interval
        self.cleanup_grace = cleanup_grace
        self.inbox_retention = inbox_retention
        self.max_prompt_bytes = max_prompt_bytes
        self.report = WorkerReport(control.worker_id)
        self.hosted: dict[str, _Hosted] = {}
        self.stopping = False
        self.halt = trio.Event()  # stop serving: the caller's stop, or the id taken over
        self.superseded: WorkerIdInUseError | None = None
        self._wake = trio.Event()
        self._drained = trio.Event()
        self._claiming_done = trio.Event()
        self._rng = random.Random()
        self.live = LivePublisher(control, control.statements.live_channel) if live else None

    def wake(self, _payload: str = "") -> None:
        self._wake.set()

    # -- claiming

    async def claim_loop(self, sessions: trio.Nursery) -> None:
        try:
            await self._claim_until_stopping(sessions)
        finally:
            self._claiming_done.set()

    async def _claim_until_stopping(self, sessions: trio.Nursery) -> None:
        while not self.stopping:
            self._wake = trio.Event()  # before looking: whatever lands from now on wakes us
            free = self.concurrency - len(self.hosted)
            if free > 0:
                sent = trio.current_time()
                try:
                    leases = await self.control.claim(free, self.lease_ttl, exclude=list(self.hosted))
                except TrioAgentError as exc:
                    _log.warning("claiming sessions failed (retrying): %s", exc)
                    leases = []
                for lease in leases:
                    hosted = self.hosted[lease.session_id] = _Hosted(lease)
                    self.report.claimed += 1
                    sessions.start_soon(self.host, hosted, sent, name=f"worker session {lease.session_id}")
                if leases and len(leases) == free:
                    continue  # maybe more waiting: look again once a slot frees (the loop waits below)
            with trio.move_on_after(jittered(self.poll_interval, self._rng.random())):
                await self._wake.wait()

    # -- hosting one session

    async def host(self, hosted: _Hosted, sent: float) -> None:
        session_id = hosted.lease.session_id
        try:
            try:
                if not _usable_session_id(session_id):  # written around submit(): no journal takes it
                    await self._refuse_rows(hosted.lease, f"session id {session_id!r} is not one a journal accepts")
                    await self.store.release_lease(hosted.lease)
                    return
                async with open_journal(
                    self.store,
                    lease=hosted.lease,
                    lease_sent=sent,
                    lease_ttl=self.lease_ttl,
                    commit_grace=self.cleanup_grace,
                ) as journal:
                    hosted.journal = journal
                    await self._open_and_serve(journal, hosted)
                if self.stopping:  # released: what it left queued goes to another worker now
                    await _hint(self.control.notify(session_id))
            except LeaseLostError as exc:
                if hosted.handing_off:
                    self.report.handed_off += 1
                    await self._release(hosted)
                else:
                    self.report.lost_sessions += 1
                    _log.warning("worker %s lost session %s: %s", self.report.worker_id, session_id, exc)
            except ControlError as exc:
                # The worker's own bookkeeping failed, not the session: it was closed and released
                # as usual, and whatever is not marked done is served again by its next holder.
                _log.warning("worker %s released session %s: %s", self.report.worker_id, session_id, exc)
            except Exception as exc:  # one session's failure (a bug included) never stops the worker
                hosted.failed = True
                self.report.failed_sessions += 1
                _log.error(
                    "session %s failed on worker %s (parked for %s s): %s",
                    session_id,
                    self.report.worker_id,
                    self.lease_ttl,
                    exc,
                    exc_info=not isinstance(exc, TrioAgentError),
                )
                await self._park(session_id)
        except Exception:  # bookkeeping itself (the store gone): logged, never the worker's end
            _log.exception("worker %s: cleaning up after session %s failed", self.report.worker_id, session_id)
        finally:
            if self.hosted.get(session_id) is hosted:
                del self.hosted[session_id]
            if not self.hosted and self.stopping:
                self._drained.set()
            if not hosted.failed:
                self.wake()  # a slot is free, and the session may have work that came in meanwhile

    async def _open_and_serve(self, journal: DurableJournal, hosted: _Hosted) -> None:
        try:
            async with open_session(
                self.spec, journal=journal, unfinished="keep", cleanup_grace=self.cleanup_grace
            ) as session:
                await self._serve(session, journal)  # the claim registered it running
                state = "paused" if session.paused is not None else "idle"
        except SessionClosedError:
            await self._refuse_all(journal, "the session was ended for good; submit to a new session id")
            return
        if not hosted.handing_off:
            await _hint(self.control.register(journal.lease, state))

    async def _serve(self, session: Session, journal: DurableJournal) -> None:
        """Serve the session's submissions until none is left: one round trip per request."""
        waiting = {row[0]: row for row in await self.control.take(journal.lease)}
        await self._interrupt_unsubmitted(journal, set(waiting))
        while waiting and not self.stopping:
            row = _next_row(journal, waiting.values())
            request_id, prompt, _, _, answers, answers_for = row
            sink = self.live.sink_for(journal.session_id, request_id) if self.live is not None else discard
            if answers is not None:
                served = await self._answer(session, journal, request_id, answers, answers_for, sink)
            else:
                served = await self._prompt(session, journal, request_id, prompt, sink)
            if served is None:
                return  # going away: the next holder goes on from the journal
            outcome, code, reason = served
            del waiting[request_id]
            # Marked done only now: the outcome is durable (serve_request raised otherwise).
            for taken in await self.control.finish_and_take(
                journal.lease, request_id, outcome, code=code, reason=reason
            ):
                waiting[taken[0]] = taken

    async def _prompt(
        self, session: Session, journal: DurableJournal, request_id: str, prompt: str, sink: EventSink
    ) -> _Served | None:
        """Serve a prompt's row: how to mark it, or ``None`` if the worker goes away first."""
        try:
            if journal.projection().request(request_id) is None:  # one it holds was accepted: it runs
                _check_prompt(prompt, self.max_prompt_bytes)  # submit()'s rule: past it, never journaled
            # Queued: its id is judged by the rule it was submitted under (see _usable_session_id).
            ended = await session._serve_request(request_id, prompt, sink, queued=True)
        except ConfigError as exc:  # refused before anything ran: a submission written around submit()
            if journal.projection().request(request_id) is not None:
                raise  # it ran: whatever this is, it is not a refusal of the submission
            _log.warning("session %s: request %r refused: %s", journal.session_id, request_id, exc)
            self.report.refused += 1
            return "refused", None, None
        return self._ended(journal, request_id, ended)

    async def _answer(
        self,
        session: Session,
        journal: DurableJournal,
        request_id: str,
        answers: str,
        answers_for: str | None,
        sink: EventSink,
    ) -> _Served | None:
        """Serve a row of answers (module rules): how to mark it, or ``None`` if the worker goes away."""
        try:
            if journal.projection().request(request_id) is None:  # (one it holds was taken under its rule)
                validate_id(request_id, name="request_id", stored=True)  # as a queued prompt's
            ended, error = await _serve_answers(session, request_id, decode_answers(answers), answers_for, sink)
        except (InterruptResumeError, ConfigError) as exc:  # refused before anything was written
            if journal.projection().request(request_id) is not None:
                raise  # it ran: whatever this is, it is not a refusal of the submission
            _log.warning("session %s: answers %r refused: %s", journal.session_id, request_id, exc)
            self.report.refused += 1
            return "refused", error_code(exc), str(exc)
        served = self._ended(journal, request_id, ended)
        if served is not None and error is not None:
            _log.info("session %s: answers %r failed: %s", journal.session_id, request_id, error)
            return served[0], error_code(error), str(error)
        return served

    def _ended(self, journal: DurableJournal, request_id: str, ended: RequestState) -> _Served | None:
        if ended in _UNFINISHED:
            if self.stopping or journal.lost:
                return None
            raise JournalError(f"request {request_id!r} is still {ended.value} after being served")
        self.report.served += 1
        return ended.value, None, None

    async def _interrupt_unsubmitted(self, journal: DurableJournal, submitted: set[str]) -> None:
        """Open root requests that no submission stands for: nobody waits for them, so they end."""
        for record in journal.projection().unfinished_requests():
            if record.request_id not in submitted:
                await record_request_end(
                    journal,
                    journal.root_agent_id,
                    record.request_id,
                    RequestInterrupted(request_id=record.request_id, reason=RequestInterruptReason.PROCESS_RESTART),
                )

    async def _refuse_all(self, journal: DurableJournal, why: str) -> None:
        await self._refuse_rows(journal.lease, why)

    async def _refuse_rows(self, lease: Lease, why: str) -> None:
        """Mark every submission of the session done ``refused`` (fenced by *lease*)."""
        _log.warning("session %s: %s", lease.session_id, why)
        for request_id, *_ in await self.control.take(lease):
            await self.control.mark(lease, request_id, "done", "refused")
            self.report.refused += 1
        await self.control.register(lease, "ended")

    async def _park(self, session_id: str) -> None:
        """Hold a failed session's lease for one TTL without serving it: the retry's backoff, for
        every worker. (Another worker that claimed it meanwhile keeps it.)

        One statement takes the lease and registers it ``failed``, judging the lease free by the
        server's clock, as claims do: a cancellation at any await finds both done or neither
        (taken apart, one landing between them left the session leased, shown running on a
        worker that was not serving it), and a live lease is never taken, not even one under this
        worker id (`acquire_lease` would take its own owner's lease again)."""
        try:
            await self.control.park(session_id, self.lease_ttl)
        except TrioAgentError as exc:
            _log.debug("parking session %s: %s", session_id, exc)

    async def _release(self, hosted: _Hosted) -> None:
        """Give a handed-off session's lease back now, and wake whoever may take it."""
        journal = hosted.journal
        lease = journal.lease if journal is not None else hosted.lease
        with bounded_shield(self.cleanup_grace, "handing a session off"):
            try:
                await self.store.release_lease(lease)
                await self.control.notify(lease.session_id)
            except TrioAgentError as exc:
                _log.warning("handing off session %s: %s (its lease runs out instead)", lease.session_id, exc)

    # -- registry

    async def heartbeat(self) -> None:
        interval = self.lease_ttl / 3
        while True:
            try:
                await self.control.seen(
                    concurrency=self.concurrency,
                    hosted=len(self.hosted),
                    served=self.report.served,
                    stopping=self.stopping,
                    interval=interval,
                )
            except WorkerIdInUseError as exc:
                # Another run took the id over while this one was not seen (frozen): two runs must
                # never serve under one id, and this is the stale one. It stops.
                _log.error("worker %s stops: %s", self.report.worker_id, exc)
                self.superseded = exc
                self.halt.set()
                return
            except TrioAgentError as exc:
                _log.debug("worker heartbeat failed: %s", exc)
            await trio.sleep(interval)

    async def prune(self) -> None:
        """Delete done submissions past the retention, every heartbeat interval (jittered), a
        batch at a time until none is left (a backlog goes at once, other workers skipping the
        rows one is deleting). A failure is logged and tried again next time."""
        retention = self.inbox_retention
        if retention is None:
            return
        while True:
            try:
                while (deleted := await self.control.prune(retention, _PRUNE_BATCH)) > 0:
                    self.report.pruned += deleted
                    if deleted < _PRUNE_BATCH:
                        break
            except TrioAgentError as exc:
                _log.debug("pruning the inbox failed: %s", exc)
            await trio.sleep(jittered(self.lease_ttl / 3, self._rng.random()))

    # -- stopping

    async def stop(self, grace: float) -> None:
        """No more claims or requests; *grace* seconds for running requests, then hand the rest off."""
        self.stopping = True
        self.wake()
        await self._claiming_done.wait()  # a claim in flight lands, and its sessions are hosted (then let go)
        if not self.hosted:
            return
        with trio.move_on_after(grace):
            await self._drained.wait()
        for hosted in list(self.hosted.values()):
            journal = hosted.journal
            hosted.handing_off = True
            if journal is not None:
                journal.held.lose(LeaseLostError("handed off: the worker is shutting down"))
        await self._drained.wait()


async def _relay(stop: trio.Event, halt: trio.Event) -> None:
    await stop.wait()
    halt.set()


def _check_worker_id(worker_id: object) -> str:
    """*worker_id*, or the default (``None`` only): it owns leases and registry rows, so it is text a
    store can keep and index (`check_id`), and never silently replaced."""
    if worker_id is None:
        return default_owner()
    if not isinstance(worker_id, str) or not worker_id:
        raise ConfigError(f"worker_id must be a non-empty string (None: the default), not {short_repr(worker_id)}")
    return check_id(worker_id, "worker_id")


def _bounded_transactions(dsn: str, lease_ttl: float) -> str:
    """*dsn* whose sessions the server ends when idle inside a transaction for a lease TTL: a
    worker stopped (SIGSTOP, a frozen VM) half-way through a write must not hold its row locks,
    and with them its sessions, until it wakes. Its write then fails; the lease is lost anyway."""
    timeout_ms = max(round(lease_ttl * 1000), 1000)
    return connection_info(
        dsn, name="trio_agent worker journal", settings={"idle_in_transaction_session_timeout": timeout_ms}
    )


async def serve_sessions(
    spec: AgentSpec,
    dsn: str | None = None,
    *,
    concurrency: int = 8,
    schema: str = "trio_agent",
    worker_id: str | None = None,
    lease_ttl: float = 30.0,
    poll_interval: float = 2.0,
    shutdown_grace: float = 30.0,
    stop: trio.Event | None = None,
    live: bool = True,
    cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    inbox_retention: float | None = DEFAULT_INBOX_RETENTION,
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    store_options: Mapping[str, Any] | None = None,
    task_status: trio.TaskStatus[WorkerReport] = trio.TASK_STATUS_IGNORED,
) -> WorkerReport:
    """Serve the sessions submitted to *schema* of the PostgreSQL database at *dsn* (module rules).

    Runs until *stop* is set (then stops gracefully: see the rules) or it is cancelled,
    and returns a `WorkerReport`. ``dsn`` defaults to ``$TRIO_AGENT_DSN``. *spec* is
    built once for the process; every session gets only its own state. With
    ``nursery.start(serve_sessions, ...)`` it reports started (the same report object,
    filled in as it goes) once it listens and has announced itself in ``workers``.

    ``worker_id`` (default: ``host:pid:random``, unique; else a non-empty string of at most
    1,200 bytes of UTF-8 without NUL) names the run in leases and the registry; one run at a
    time may hold it. `WorkerIdInUseError` (a `ConfigError`, naming the id) if another live
    worker holds it: a row it left when it crashed is waited for until it is
    stale (three heartbeats, one ``lease_ttl``), and a stopping worker's until it unregisters.

    ``inbox_retention``: done submissions are deleted from the inbox this many seconds after
    they were marked done (default seven days; ``None`` keeps them). The outcome of every
    request that ran stays in the journal; past the retention, `request_status` answers
    ``None``, and a refusal (recorded only in the inbox) is no longer reported.

    ``max_prompt_bytes``: a submission whose prompt is larger (bytes of its JSON text; default
    `DEFAULT_MAX_PROMPT_BYTES`, as `submit`'s) is marked done ``refused`` without running, unless
    the journal already holds its request (accepted before: it runs).
    """
    if not isinstance(spec, AgentSpec):
        raise ConfigError(f"serve_sessions takes an AgentSpec (define_agent(...)), not {spec!r}")
    concurrency = validate_limit(concurrency, name="concurrency")
    lease_ttl = check_seconds("lease_ttl", lease_ttl)
    poll_interval = check_seconds("poll_interval", poll_interval)
    shutdown_grace = check_seconds("shutdown_grace", shutdown_grace, allow_zero=True)
    cleanup_grace = validate_cleanup_grace(cleanup_grace)
    if inbox_retention is not None:
        inbox_retention = finite_seconds(inbox_retention, "inbox_retention", allow_zero=True)
    max_prompt_bytes = validate_limit(max_prompt_bytes, name="max_prompt_bytes")
    if store_options and "clock" in store_options:
        raise ConfigError("store_options must not set clock: claims and fences use the database server's clock")
    statements = Statements(_check_schema(schema))
    dsn = resolve_dsn(dsn)
    store_dsn = _bounded_transactions(dsn, lease_ttl)
    control = Control(dsn, statements, worker_id=_check_worker_id(worker_id), cleanup_grace=cleanup_grace)
    try:
        await control.open()
        async with open_postgres_store(store_dsn, schema=schema, **dict(store_options or {})) as store:
            worker = _Worker(
                spec,
                store,
                control,
                concurrency=concurrency,
                lease_ttl=lease_ttl,
                poll_interval=poll_interval,
                cleanup_grace=cleanup_grace,
                live=live,
                inbox_retention=inbox_retention,
                max_prompt_bytes=max_prompt_bytes,
            )
            listener = InboxListener(dsn, statements.inbox_channel, worker.wake)
            async with trio.open_nursery() as services:
                await services.start(listener.run)
                if stop is not None:
                    services.start_soon(_relay, stop, worker.halt)
                # Before any claim: a worker id another live run holds is refused here.
                if not await control.start(concurrency=concurrency, interval=lease_ttl / 3, give_up=worker.halt):
                    task_status.started(worker.report)  # stopped while waiting for its id: it served nothing
                    services.cancel_scope.cancel()
                    return worker.report
                try:
                    services.start_soon(worker.heartbeat)
                    services.start_soon(worker.prune)
                    if worker.live is not None:
                        services.start_soon(worker.live.run)
                    async with trio.open_nursery() as sessions:
                        sessions.start_soon(worker.claim_loop, sessions)
                        task_status.started(worker.report)
                        await worker.halt.wait()  # stop set, or this run's worker id taken over
                        # Taken over: this run was frozen past its leases; hand everything off now.
                        await worker.stop(shutdown_grace if worker.superseded is None else 0.0)
                        sessions.cancel_scope.cancel()
                finally:
                    worker.report.notifications = listener.notifications
                    if worker.live is not None:
                        worker.live.close()
                        worker.report.live_sent, worker.report.live_dropped = worker.live.sent, worker.live.dropped
                    with bounded_shield(cleanup_grace, "unregistering the worker"):
                        try:
                            await control.gone()
                        except TrioAgentError as exc:
                            _log.debug("unregistering worker failed: %s", exc)
                    services.cancel_scope.cancel()
            if worker.superseded is not None:
                raise worker.superseded
            return worker.report
    except BaseExceptionGroup as group:
        from .._groups import unwrap_for_boundary

        single = unwrap_for_boundary(group)
        if single is group:
            raise
        raise single from None
    finally:
        control.close()
