"""A worker's own connections: the control connection (claims, inbox, registry) and the
inbox listener.

Rules
=====

* Control statements run on a few sync psycopg connections (autocommit: each statement is
  its own transaction), each in a worker thread, at most ``pool`` at a time. A cancelled
  caller does not wait for its statement: a server that stopped answering must not hold a
  stop. What such a statement did is harmless: a claim is given back (its thread releases
  the leases it took when it finds its caller gone), a park is one statement (done whole or
  not at all), an inbox move is fenced and repeated by the next holder. A broken connection
  is dropped and the next call opens another. TCP keepalives (and a user timeout) end a
  connection to a server that vanished, so its thread comes back.
* One run per worker id (`_sql`): `Control.start` registers the run only when the id is
  free, and waits out a row still seen (a crashed run's goes stale; a live one's is seen
  again: `WorkerIdInUseError`). Heartbeats write only the run's own row; a run whose id was
  taken over (it was frozen past three heartbeats) learns it from its next one.
* The listener is pumped natively (`trio.lowlevel.wait_readable`), no thread. A
  notification is only a hint to look again; a lost connection is reopened with a
  backoff, and polling with jitter covers whatever it missed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

import attrs
import psycopg
import trio
from psycopg import sql
from psycopg.rows import TupleRow

from .._cleanup import DEFAULT_CLEANUP_GRACE, bounded_shield
from .._errors import ConfigError, JournalUnavailableError
from .._journal._postgres import pump_notifications
from .._journal._store import Lease
from ._conn import connect, connection_info
from ._queue import ensure_tables
from ._sql import Statements

__all__ = ["Control", "ControlError", "InboxListener", "WorkerIdInUseError"]

_log = logging.getLogger("trio_agent.workers")

_Conn = psycopg.Connection[TupleRow]
T = TypeVar("T")


class ControlError(JournalUnavailableError):
    """A worker's own statement failed (the database unreachable, a connection lost): a failure
    of the worker's bookkeeping, not of the session it was serving."""


class WorkerIdInUseError(ConfigError):
    """Another live run holds this worker id: each worker needs its own. ``host`` and ``pid`` are
    that run's. Raised by `serve_sessions` at start (its id is refused), or when a run that was
    not seen for three heartbeats (frozen) finds its id taken over by a newer run (it stops)."""

    def __init__(self, message: str, *, worker_id: str = "", host: str = "", pid: int = 0) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.host = host
        self.pid = pid


Row = tuple[str, str, int, int, str | None, str | None]
"""A submission taken: (request id, prompt, priority, seq, answers, answers_for); ``answers`` (JSON
text) is ``None`` for a prompt (`_sql`)."""


@attrs.frozen
class _Holder:
    """The run that holds a worker id, as its row says (``now``: the server's clock)."""

    run_id: str | None
    host: str
    pid: int
    seen_at: float
    interval: float
    stopping: bool
    now: float


class Control:
    """The worker's control connections (module rules)."""

    def __init__(
        self,
        dsn: str,
        statements: Statements,
        *,
        worker_id: str,
        statement_timeout: float = 30.0,
        pool: int = 4,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    ) -> None:
        timeout_ms = round(statement_timeout * 1000)
        self.conninfo = connection_info(dsn, name="trio_agent worker", settings={"statement_timeout": timeout_ms})
        self.statements = statements
        self.q = statements.q
        self.worker_id = worker_id
        self.cleanup_grace = cleanup_grace
        self._idle: list[_Conn] = []
        self._idle_lock = threading.Lock()
        self._slots = trio.CapacityLimiter(pool)
        self._closed = False
        self.run_id = uuid.uuid4().hex  # which run of the worker id this is (its row in ``workers``)

    async def _run(self, work: Callable[[_Conn], T]) -> T:
        def attempt(conn: _Conn) -> T:
            try:
                result = work(conn)
            except psycopg.Error:
                if conn.closed or conn.broken:
                    conn.close()
                else:
                    self._give_back(conn)
                raise
            except BaseException:
                conn.close()
                raise
            self._give_back(conn)
            return result

        def run() -> T:
            with self._idle_lock:
                pooled = self._idle.pop() if self._idle else None
            if pooled is not None and not pooled.closed:
                try:
                    return attempt(pooled)
                except psycopg.OperationalError:
                    if not pooled.closed:
                        raise
                    # A pooled connection the server had closed while it sat idle (a restart, a
                    # failover, an idle timeout): once more on a fresh one.
            try:
                return attempt(connect(self.conninfo))
            except psycopg.Error as exc:
                raise ControlError(f"a worker statement failed: {str(exc).strip()}") from None

        # Abandoned if the caller is cancelled: a server that stopped answering must not hold a
        # stop or a cancellation (the thread gives its connection back, or closes it, when done).
        try:
            return await trio.to_thread.run_sync(run, limiter=self._slots, abandon_on_cancel=True)
        except psycopg.Error as exc:  # the pooled attempt's own error, when it was not retried
            raise ControlError(f"a worker statement failed: {str(exc).strip()}") from None
        except JournalUnavailableError as exc:  # cannot connect
            raise ControlError(str(exc)) from None

    def _give_back(self, conn: _Conn) -> None:
        with self._idle_lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()  # the thread of an abandoned statement came back after `close`

    async def open(self) -> None:
        await self._run(lambda conn: ensure_tables(conn, self.statements))

    def close(self) -> None:
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def claim(self, count: int, ttl: float, *, exclude: list[str] | None = None) -> list[Lease]:
        """Take up to *count* runnable sessions' leases (oldest waiting work first), none of
        *exclude* (the sessions this worker still hosts).

        A claim its caller stopped waiting for (cancelled) is given back, never left leased to
        nobody for a TTL: by its thread, on the same connection, if it is still running then;
        else (it had finished, its answer not yet taken) here, for ``cleanup_grace`` at most."""
        lock = threading.Lock()
        abandoned = False
        answered: list[Lease] = []

        def work(conn: _Conn) -> list[Lease]:
            rows = conn.execute(self.q["claim"], (exclude or [], count, self.worker_id, ttl)).fetchall()
            leases = [Lease(session_id, owner, token, expires_at) for session_id, owner, token, expires_at in rows]
            with lock:
                if not abandoned:
                    answered.extend(leases)
                    return leases
            if leases:
                self._give_back_leases(conn, leases)
            return []

        try:
            return await self._run(work)
        except BaseException:
            with lock:
                abandoned = True
                leftovers = answered[:]
            if leftovers:
                with (
                    bounded_shield(self.cleanup_grace, "giving back a claim whose caller was cancelled"),
                    contextlib.suppress(ControlError),  # they run out instead
                ):
                    await self._run(lambda conn: self._give_back_leases(conn, leftovers))
            raise

    def _give_back_leases(self, conn: _Conn, leases: list[Lease]) -> None:
        """Release *leases* (each only if still this claim's: owner and token) and wake the
        workers: their sessions have work and no holder."""
        conn.execute(
            self.q["unclaim"],
            ([lease.session_id for lease in leases], [lease.token for lease in leases], self.worker_id),
        )
        for lease in leases:
            conn.execute(self.q["notify"], (self.statements.inbox_channel, lease.session_id))

    async def park(self, session_id: str, ttl: float) -> Lease | None:
        """Take *session_id*'s lease for *ttl* seconds and register it ``failed``, in one statement,
        if its lease is free by the server's clock; ``None`` if someone holds it."""

        def work(conn: _Conn) -> Lease | None:
            row = conn.execute(self.q["park"], (session_id, self.worker_id, ttl)).fetchone()
            return None if row is None else Lease(*row)

        return await self._run(work)

    async def take(self, lease: Lease) -> list[Row]:
        """Take the session's submissions not done (fenced by *lease*); none if it is not ours."""
        params = (lease.session_id, lease.owner, lease.token)
        return await self._run(lambda conn: conn.execute(self.q["take"], params).fetchall())

    async def finish_and_take(
        self, lease: Lease, request_id: str, outcome: str, *, code: str | None = None, reason: str | None = None
    ) -> list[Row]:
        """Mark *request_id* done with *outcome* (and why: *code*, *reason*) and take the rest, in
        one round trip (fenced)."""
        sid, owner, token = lease.session_id, lease.owner, lease.token
        params = (outcome, code, reason, sid, request_id, owner, token, sid, owner, token)
        return await self._run(lambda conn: conn.execute(self.q["finish_and_take"], params).fetchall())

    async def mark(
        self,
        lease: Lease,
        request_id: str,
        state: str,
        outcome: str | None,
        *,
        code: str | None = None,
        reason: str | None = None,
    ) -> bool:
        """Move a submission (fenced by *lease*); whether the holder's write landed."""

        def work(conn: _Conn) -> bool:
            params = (state, outcome, code, reason, lease.session_id, request_id, lease.owner, lease.token)
            return conn.execute(self.q["mark"], params).rowcount == 1

        return await self._run(work)

    async def prune(self, retention: float, limit: int) -> int:
        """Delete up to *limit* done submissions marked done more than *retention* seconds ago (by
        the server's clock); how many went."""
        return await self._run(lambda conn: conn.execute(self.q["prune"], (retention, limit)).rowcount)

    async def register(self, lease: Lease, state: str) -> None:
        """Say what the session is now (fenced by *lease*)."""
        params = (state, self.worker_id, lease.session_id, lease.owner, lease.token)
        await self._run(lambda conn: conn.execute(self.q["register"], params))

    async def notify(self, session_id: str) -> None:
        """Wake the workers: the session has work and no holder."""
        await self._run(lambda conn: conn.execute(self.q["notify"], (self.statements.inbox_channel, session_id)))

    async def start(self, *, concurrency: int, interval: float, give_up: trio.Event | None = None) -> bool:
        """Register this run under its worker id, which must be free (module rules); ``False`` if
        *give_up* was set while it waited (nothing registered).

        A row that another run still heartbeats is waited for until it is seen again
        (`WorkerIdInUseError`: a live worker holds the id, unless it is stopping) or not for three
        of its intervals (gone: a crashed run's row is taken over). A run restarted after a crash
        thus waits at most that long, as its sessions' leases do."""
        params = (self.worker_id, socket.gethostname(), os.getpid(), concurrency, interval, self.run_id)

        def attempt(conn: _Conn) -> _Holder | None:
            while True:
                if conn.execute(self.q["worker_start"], params).fetchone() is not None:
                    return None
                holder = conn.execute(self.q["worker_holder"], (self.worker_id,)).fetchone()
                if holder is not None:  # else unregistered meanwhile: free now
                    return _Holder(*holder)

        first: _Holder | None = None
        give_up = trio.Event() if give_up is None else give_up
        while (holder := await self._run(attempt)) is not None:
            if first is not None and holder.run_id == first.run_id and holder.seen_at > first.seen_at:
                if not holder.stopping:
                    raise self._in_use(holder)
            elif first is None:
                _log.warning(
                    "worker id %r: a run on %s (pid %s) was seen %.1f s ago; waiting until it is seen again "
                    "(a live worker: refused) or not for three heartbeats (gone: taken over)",
                    self.worker_id,
                    holder.host,
                    holder.pid,
                    holder.now - holder.seen_at,
                )
            first = holder
            # Look again after one of its heartbeats, or once it is stale, whichever comes first.
            stale_in = holder.seen_at + 3 * holder.interval - holder.now
            with trio.move_on_after(max(min(holder.interval * 1.1, stale_in), 0.0) + 0.05):
                await give_up.wait()
            if give_up.is_set():
                return False
        return True

    def _in_use(self, holder: _Holder) -> WorkerIdInUseError:
        return WorkerIdInUseError(
            f"worker id {self.worker_id!r} is in use by another live worker (host {holder.host}, "
            f"pid {holder.pid}): give each worker its own id (--worker-id), or none (the default is unique)",
            worker_id=self.worker_id,
            host=holder.host,
            pid=holder.pid,
        )

    async def seen(self, *, concurrency: int, hosted: int, served: int, stopping: bool, interval: float) -> None:
        """Say this run is alive (its own row only); `WorkerIdInUseError` if another run took the
        worker id over (this one was not seen for three heartbeats: frozen past them)."""
        params = (
            self.worker_id,
            socket.gethostname(),
            os.getpid(),
            concurrency,
            hosted,
            served,
            stopping,
            interval,
            self.run_id,
        )

        def work(conn: _Conn) -> _Holder | None:
            if conn.execute(self.q["worker_seen"], params).fetchone() is not None:
                return None
            holder = conn.execute(self.q["worker_holder"], (self.worker_id,)).fetchone()
            return None if holder is None else _Holder(*holder)

        holder = await self._run(work)
        if holder is not None:
            raise self._in_use(holder)

    async def gone(self) -> None:
        """Unregister this run (its own row only: never one that took the id over)."""
        await self._run(lambda conn: conn.execute(self.q["worker_gone"], (self.worker_id, self.run_id)))

    async def publish(self, channel: str, payloads: list[str]) -> None:
        """NOTIFY every payload on *channel* (live deltas: not durable, best effort)."""
        statement = b"SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p"
        await self._run(lambda conn: conn.execute(statement, (channel, payloads)))


class InboxListener:
    """LISTEN on a channel and set `wake` on every notification (module rules)."""

    def __init__(self, dsn: str, channel: str, wake: Callable[[str], None]) -> None:
        self.conninfo = connection_info(dsn, name="trio_agent worker listener")
        self.channel = channel
        self.wake = wake
        self.notifications = 0

    def _open(self) -> _Conn:
        conn = connect(self.conninfo)
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        except psycopg.Error as exc:
            conn.close()
            raise JournalUnavailableError(f"cannot LISTEN: {str(exc).strip()}") from None
        return conn

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        backoff = 0.5
        started = False
        while True:
            try:
                conn = await trio.to_thread.run_sync(self._open)
            except JournalUnavailableError:
                if not started:
                    raise
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.5
            try:
                if not started:
                    started = True
                    task_status.started()
                else:
                    self.wake("")  # notifications were lost while disconnected: look again
                with contextlib.suppress(psycopg.Error, OSError):
                    await self._pump(conn)
            finally:
                conn.close()
            await trio.sleep(backoff)

    async def _pump(self, conn: _Conn) -> None:
        await pump_notifications(conn, self._notified)

    def _notified(self, payload: str) -> None:
        self.notifications += 1
        self.wake(payload)


def jittered(seconds: float, rng_value: float) -> float:
    """*seconds* spread by +-20% (``rng_value`` in [0, 1)), so idle workers do not poll in step."""
    return seconds * (0.8 + 0.4 * rng_value)
