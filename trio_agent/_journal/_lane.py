"""A writer lane: one OS thread that owns a store's only write connection.

Trio tasks put work on a `queue.SimpleQueue` and wait on a `trio.Event`; the
thread blocks on the queue, drains everything queued (up to ``max_batch``),
runs it all in ONE transaction (group commit: batch size follows concurrency,
no timer), and wakes every waiter of the batch with one
``TrioToken.run_sync_soon`` only after COMMIT returned. Nothing is acknowledged
before it is on disk.

The backend supplies ``commit(items) -> outcomes``, run in the thread, which
must isolate items from one another (a savepoint each) so one refused append
never fails its neighbours. If the transaction as a whole fails, every item of
the batch gets the error.

Once submitted, work runs whether or not its waiter is still waiting: journal
order never depends on cancellation.

Work submitted inside `WriterLane.grouped` is queued as one unit: it commits in
one transaction and its waiters wake together (a session's last events and its
lease release cost one commit, not two).

A backend that never waits for another process's lock (PostgreSQL: ``SKIP
LOCKED``) answers `Deferred` for an item it could not lock; nothing was done for
it. The lane keeps such items, in order and ahead of anything queued after them,
and offers them again in its next batches (at once with new work, else after a
short pause), for ``defer_limit`` seconds at most: then they fail
(`JournalUnavailableError`, nothing written). So one session's locked row holds
only that session's work, never the lane.

Closing drains the queue for at most ``cleanup_grace`` seconds. If the thread is
still busy then (a write stuck on a lock, a dead disk or network), `aclose`
returns anyway and logs a WARNING: the transaction in progress still commits or
rolls back as a whole when it ends, every item not yet begun is refused
(`JournalUnavailableError`, nothing written), and the thread then closes its own
connection (``on_stop``). The write connection is never closed under a running
transaction, so a store is never left half-written.

However the thread ends, nothing is left waiting: if it ever fails (a bug), the lane
is closed, work it had taken but not answered gets `JournalUnavailableError`
(outcome unknown), and everything still queued or deferred gets it too (nothing
written), as does everything submitted later.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs
import trio

from .._cleanup import DEFAULT_CLEANUP_GRACE, bounded_shield
from .._errors import JournalError, JournalUnavailableError
from ._codec import snapshot_row
from ._lease import LeaseKeeper
from ._store import AppendBatch, AppendResult, AppendTicket, Lease, SnapshotWrite, check_id, check_ttl

__all__ = ["Deferred", "LaneItem", "LaneStore", "LeaseOp", "SnapshotWork", "WriterLane", "close_in_thread"]

T = TypeVar("T")

logger = logging.getLogger("trio_agent.journal")


class LaneItem(Generic[T]):
    """A waiter for one piece of lane work: pass ``item.resolve`` to `WriterLane.submit`."""

    __slots__ = ("_done", "_error", "_result", "_then")

    def __init__(self) -> None:
        self._done = trio.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._then: Callable[[object], None] | None = None

    def resolve(self, outcome: object) -> None:
        if isinstance(outcome, BaseException):
            self._error = outcome
        else:
            self._result = outcome  # type: ignore[assignment]
        self._done.set()
        if self._then is not None:
            self._then(outcome)

    def then(self, callback: Callable[[object], None]) -> None:
        """Call *callback* with the outcome once it is resolved (now, if it is already)."""
        if self._done.is_set():
            callback(self._result if self._error is None else self._error)
        else:
            self._then = callback

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def failure(self) -> BaseException | None:
        """The error it resolved with (``None`` while pending or after a success)."""
        return self._error

    def result(self) -> T:
        """The result it resolved with (after `done`, when `failure` is ``None``)."""
        return self._result  # type: ignore[return-value]

    async def wait_done(self) -> None:
        """Wait until it is resolved, whichever way."""
        await self._done.wait()

    async def wait(self) -> T:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


_STOP = object()
_DEFER_PAUSE = (0.01, 0.25)  # the pause before offering deferred work again grows from 10 ms to 250 ms


@attrs.frozen
class Deferred:
    """A commit's answer for an item it did nothing for, to be offered again (module docstring).
    ``reason`` says what it waits for, in the error if it waits past the lane's ``defer_limit``."""

    reason: str


class WriterLane:
    """Runs ``commit`` batches in a dedicated thread; see the module docstring."""

    def __init__(
        self,
        name: str,
        commit: Callable[[Sequence[Any]], list[object]],
        *,
        on_committed: Callable[[Sequence[Any], list[object]], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        max_batch: int = 1000,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
        defer_limit: float | None = None,
    ) -> None:
        self._name = name
        self._defers = defer_limit is not None  # else the commit never answers `Deferred`: never looked for
        self._defer_limit = math.inf if defer_limit is None else defer_limit
        self._commit = commit
        self._on_committed = on_committed
        self._on_stop = on_stop
        self._max_batch = max_batch
        self.cleanup_grace = cleanup_grace
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stopped = threading.Event()  # the thread has ended (its connection closed)
        self._done = trio.Event()  # the same, seen from Trio
        self._abandoned = threading.Event()  # aclose stopped waiting: begin nothing new
        self._closed = False
        self._group: list[tuple[Any, Callable[[object], None]]] | None = None
        # Work the commit answered `Deferred`, in submission order, and since when (monotonic) by id.
        self._deferred: list[tuple[Any, Callable[[object], None]]] = []
        self._deferred_since: dict[int, float] = {}
        self.batches = 0
        self.items = 0

    def start(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def submit(self, work: Any, resolve: Callable[[object], None]) -> None:
        """Queue ``work``; ``resolve(outcome)`` runs in the Trio thread after its commit."""
        if self._closed:
            resolve(JournalUnavailableError(f"{self._name} is closed; nothing was written"))
            return
        if self._group is not None:
            self._group.append((work, resolve))
            return
        self._queue.put((work, resolve))

    def grouped(self) -> _Group:
        """A block whose submissions are queued as one unit, on leaving it: one transaction."""
        return _Group(self)

    @property
    def stopped(self) -> bool:
        """Whether the thread has ended (after an abandoned drain it may end later than `aclose`)."""
        return self._stopped.is_set()

    async def aclose(self, grace: float | None = None) -> None:
        """Finish everything queued, then stop the thread; waits at most *grace* seconds
        (default: ``cleanup_grace``), shielded. See the module docstring for what an overrun leaves."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        if self._thread is None:
            self._on_stopped()  # never started: nothing to drain
            return
        with bounded_shield(self.cleanup_grace if grace is None else grace, f"the {self._name}") as scope:
            await self._done.wait()
        if scope.cancelled_caught:
            self._abandoned.set()

    def _on_stopped(self) -> None:
        try:
            if self._on_stop is not None:
                self._on_stop()
        finally:
            self._stopped.set()
            self._done.set()

    def _run(self) -> None:
        taken: list[tuple[Any, Callable[[object], None]]] = []  # the batch not yet answered
        try:
            stop = False
            while True:
                if self._deferred:
                    batch = taken = self._deferred  # first: it was queued before anything still queued
                    self._deferred = []
                    first: Any = None
                    if stop:  # nothing more will come: only the pause (or the close giving up)
                        self._abandoned.wait(self._defer_pause())
                    else:
                        with contextlib.suppress(queue.Empty):
                            first = self._queue.get(timeout=self._defer_pause())
                    if first is _STOP:
                        stop = True
                    elif first is not None:
                        batch += first if type(first) is list else [first]
                else:
                    if stop:
                        return
                    first = self._queue.get()
                    if first is _STOP:
                        return
                    # A group (a list) stays whole, even past ``max_batch``.
                    batch = taken = first if type(first) is list else [first]
                while not stop and len(batch) < self._max_batch:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is _STOP:
                        stop = True
                        break
                    if type(more) is list:
                        batch += more
                    else:
                        batch.append(more)
                if self._abandoned.is_set():
                    refused = JournalUnavailableError(f"{self._name} was closed before this was written; nothing was")
                    self._wake(batch, [refused] * len(batch))
                    taken = []
                    if stop:
                        return
                    continue
                try:
                    outcomes = self._commit([work for work, _ in batch])
                except BaseException as exc:
                    error = JournalUnavailableError(f"{self._name}: the commit failed: {type(exc).__name__}: {exc}")
                    error.__cause__ = exc
                    outcomes = [error] * len(batch)
                self.batches += 1
                if self._defers and (self._deferred_since or any(type(o) is Deferred for o in outcomes)):
                    batch, outcomes = self._keep_deferred(batch, outcomes)
                self.items += len(batch)
                self._wake(batch, outcomes)
                taken = []
        except Exception:
            logger.exception("%s failed; what it held is answered with JournalUnavailableError", self._name)
        finally:
            # Normally empty; after a failure of this thread, what it had not answered yet.
            unanswered = self._unanswered(taken)
            try:
                if self._on_stop is not None:
                    with contextlib.suppress(Exception):  # closing a connection: nobody left to tell
                        self._on_stop()
            finally:
                self._stopped.set()
                assert self._token is not None
                # After the last batch's wake-up (run_sync_soon keeps order), so aclose sees it done.
                with contextlib.suppress(trio.RunFinishedError):
                    self._token.run_sync_soon(self._ended, unanswered)

    def _unanswered(
        self, taken: list[tuple[Any, Callable[[object], None]]]
    ) -> list[tuple[Callable[[object], None], BaseException]]:
        """In the thread, as it ends: the work it took but never answered (a failure between
        taking a batch and waking it: its outcome is unknown) and the work it kept deferred
        (nothing written), each once."""
        unknown = JournalUnavailableError(f"{self._name} stopped before answering this; its outcome is unknown")
        unwritten = JournalUnavailableError(f"{self._name} stopped before this was written; nothing was")
        answers: dict[int, tuple[Callable[[object], None], BaseException]] = {}
        for items, error in ((self._deferred, unwritten), (taken, unknown)):
            for item in items:
                answers[id(item)] = (item[1], error)  # a deferred item of the taken batch: unknown
        self._deferred = []
        return list(answers.values())

    def _ended(self, unanswered: list[tuple[Callable[[object], None], BaseException]]) -> None:
        """In the Trio thread (where `submit` runs, so nothing slips in between): the thread has
        ended. Close the lane and answer everything it left, and everything still queued."""
        self._closed = True  # from now on `submit` refuses at once
        unwritten = JournalUnavailableError(f"{self._name} stopped before this was written; nothing was")
        while True:
            try:
                queued = self._queue.get_nowait()
            except queue.Empty:
                break
            if queued is not _STOP:
                unanswered += [(resolve, unwritten) for _, resolve in (queued if type(queued) is list else [queued])]
        try:
            for resolve, error in unanswered:
                resolve(error)
        finally:
            self._done.set()

    def _defer_pause(self) -> float:
        """How long to wait for new work before offering the deferred again: half what the oldest
        has waited, within `_DEFER_PAUSE` (a lock held for long is asked about less often)."""
        waited = time.monotonic() - min(self._deferred_since.values())
        low, high = _DEFER_PAUSE
        return min(max(waited / 2, low), high)

    def _keep_deferred(
        self, batch: list[tuple[Any, Callable[[object], None]]], outcomes: list[object]
    ) -> tuple[list[tuple[Any, Callable[[object], None]]], list[object]]:
        """Keep the items the commit deferred (until ``defer_limit``); return the ones to wake."""
        now = time.monotonic()
        since = self._deferred_since
        resolved: list[tuple[Any, Callable[[object], None]]] = []
        answers: list[object] = []
        for item, outcome in zip(batch, outcomes, strict=True):
            key = id(item[0])
            if type(outcome) is Deferred:
                first = since.setdefault(key, now)
                if now - first < self._defer_limit:
                    self._deferred.append(item)
                    continue
                outcome = JournalUnavailableError(
                    f"{self._name}: {outcome.reason} for {now - first:.1f} s; nothing was written"
                )
            since.pop(key, None)
            resolved.append(item)
            answers.append(outcome)
        return resolved, answers

    def _wake(self, batch: list[tuple[Any, Callable[[object], None]]], outcomes: list[object]) -> None:
        def wake() -> None:
            for (_, resolve), outcome in zip(batch, outcomes, strict=True):
                resolve(outcome)
            if self._on_committed is not None:
                self._on_committed([work for work, _ in batch], outcomes)

        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):  # nobody is left to wake
            self._token.run_sync_soon(wake)


class _Group:
    """`WriterLane.grouped`: what was submitted is queued even if the block raised (each item has
    a waiter); a group entered inside another is part of it."""

    __slots__ = ("_items", "_lane", "_outermost")

    def __init__(self, lane: WriterLane) -> None:
        self._lane = lane
        self._items: list[tuple[Any, Callable[[object], None]]] = []
        self._outermost = False

    def __enter__(self) -> None:
        if self._lane._group is None:
            self._lane._group = self._items
            self._outermost = True

    def __exit__(self, *exc_info: object) -> None:
        if self._outermost:
            self._lane._group = None
            if self._lane._closed:  # closed while the block ran: nothing would take them from the queue
                refused = JournalUnavailableError(f"{self._lane._name} is closed; nothing was written")
                for _, resolve in self._items:
                    resolve(refused)
            elif self._items:
                self._lane._queue.put(self._items)


async def close_in_thread(close: Callable[[], None], grace: float, layer: str) -> None:
    """Run *close* (closing connections) in a fresh thread, waiting for it at most *grace* seconds.

    The thread is started even when no time is left, so the connections are closed
    eventually; an overrun is logged and *close* runs on unobserved. An error from a
    *close* that finished in time is raised here.
    """
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            close()
        except BaseException as exc:
            errors.append(exc)

    def report(_: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    trio.lowlevel.start_thread_soon(run, report, name=f"trio_agent: {layer}")
    with bounded_shield(grace, layer):
        await done.wait()
    if done.is_set() and errors:
        raise errors[0]


@attrs.frozen
class LeaseOp:
    """A lease operation for a writer lane: ``kind`` is ``acquire``, ``renew`` or ``release``."""

    kind: str
    session_id: str
    owner: str
    token: int
    ttl: float


@attrs.frozen
class SnapshotWork:
    """A snapshot for a writer lane, checksummed before it is queued (never under the write lock)."""

    write: SnapshotWrite
    checksum: int

    @property
    def session_id(self) -> str:
        return self.write.session_id


class LaneStore:
    """The write side every lane-backed store shares: appends, snapshots and lease operations
    all go through the store's `WriterLane`, so they commit in submission order, in group commits.

    Ids are checked (`check_id`) before anything is queued, so a bad one fails alone.
    """

    _lane: WriterLane | None
    cleanup_grace: float = DEFAULT_CLEANUP_GRACE  # the store's own setting replaces it
    leases_expire = True  # other processes may take a session over: a holder renews its lease
    _lease_keeper: LeaseKeeper | None = None
    """Set while the block that opened the store runs its `LeaseKeeper`: the journals renew
    their leases through it instead of a heartbeat task each."""
    longest_write_hold: float = 0.0
    """The longest a write transaction of this store held the database's write lock (seconds)."""

    def _held(self, seconds: float) -> None:
        """Called by the writer thread after each write transaction ended."""
        if seconds > self.longest_write_hold:
            self.longest_write_hold = seconds

    def statistics(self) -> dict[str, float | int]:
        """Counters of the writer: ``batches`` (transactions), ``items`` (appends and lease
        operations) and ``longest_write_hold`` (seconds from the write lock taken to COMMIT
        returned, the longest so far: every other writer of the database waits that long)."""
        lane = self._lane
        return {
            "batches": 0 if lane is None else lane.batches,
            "items": 0 if lane is None else lane.items,
            "longest_write_hold": self.longest_write_hold,
        }

    def _not_open(self) -> str:
        return f"the {type(self).__name__} is not open"

    def submit(self, batch: AppendBatch) -> AppendTicket:
        if self._lane is None:
            raise JournalError(self._not_open())
        ticket = AppendTicket(batch)
        self._lane.submit(batch, ticket._resolve)
        return ticket

    async def append(self, batch: AppendBatch) -> AppendResult:
        return await self.submit(batch).wait()

    def grouped(self) -> contextlib.AbstractContextManager[None]:
        """A block whose appends and lease operations, submitted without awaiting (`submit`,
        `submit_release`), commit in one transaction and resolve together."""
        if self._lane is None:
            raise JournalError(self._not_open())
        return self._lane.grouped()

    def _submit_lease_op(self, op: LeaseOp) -> LaneItem[Any]:
        check_id(op.session_id, "session id")
        check_id(op.owner, "lease owner")
        if self._lane is None:
            raise JournalError(self._not_open())
        item: LaneItem[Any] = LaneItem()
        self._lane.submit(op, item.resolve)
        return item

    async def _lease_op(self, op: LeaseOp) -> Any:
        return await self._submit_lease_op(op).wait()

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> Lease:
        op = LeaseOp("acquire", session_id, owner, 0, check_ttl(ttl))
        await trio.lowlevel.checkpoint_if_cancelled()  # a caller cancelled already takes nothing
        item: LaneItem[Lease] = self._submit_lease_op(op)
        try:
            return await item.wait()
        except BaseException:
            # Whatever ends the wait (a cancellation, Ctrl-C: `item.wait` runs no nursery, so no
            # group reaches here): queued work is never cancelled, so the lease is granted all the
            # same and nobody would renew or release it, locking the session for a whole TTL.
            # An acquisition that failed gave nothing.
            if item.failure() is None:
                await self._release_when_granted(item)
            raise

    async def _release_when_granted(self, item: LaneItem[Lease]) -> None:
        """Wait for the lease a caller stopped waiting for and release it, before that caller goes
        on: it may close the store next, and a closed lane refuses the release. Shielded, for
        ``cleanup_grace`` at most; past that, it is released when granted (`_give_back`)."""
        answered = False
        try:
            with bounded_shield(self.cleanup_grace, "the lease of a cancelled acquisition"):
                await item.wait_done()
                answered = True
                if item.failure() is None:
                    with contextlib.suppress(JournalError):  # a closed store: the lease runs out instead
                        # Queued now, so it commits even if this wait is cut short; waited for, so
                        # the session is free by the time the caller goes on.
                        await self.submit_release(item.result()).wait_done()
        finally:
            if not answered:
                item.then(self._give_back)

    def _give_back(self, outcome: object) -> None:
        """Release a lease granted to a caller that stopped waiting for it (never raises)."""
        if isinstance(outcome, Lease):
            with contextlib.suppress(JournalError):  # a closed store: the lease runs out instead
                self.submit_release(outcome)

    def submit_renew(self, lease: Lease, ttl: float) -> LaneItem[Lease]:
        """`renew_lease`, queued: await the item for the renewed lease."""
        item: LaneItem[Lease] = self._submit_lease_op(
            LeaseOp("renew", lease.session_id, lease.owner, lease.token, check_ttl(ttl))
        )
        return item

    async def renew_lease(self, lease: Lease, ttl: float) -> Lease:
        return await self.submit_renew(lease, ttl).wait()

    def submit_acquire(self, session_id: str, owner: str, ttl: float, resolve: Callable[[object], None]) -> None:
        """`acquire_lease`, queued: ``resolve(lease or error)`` runs in the Trio thread after its commit."""
        op = LeaseOp("acquire", session_id, owner, 0, check_ttl(ttl))
        check_id(op.session_id, "session id")
        check_id(op.owner, "lease owner")
        if self._lane is None:
            raise JournalError(self._not_open())
        self._lane.submit(op, resolve)

    def submit_release(self, lease: Lease) -> LaneItem[None]:
        """`release_lease`, queued: await the item for its outcome."""
        op = LeaseOp("release", lease.session_id, lease.owner, lease.token, 1.0)
        item: LaneItem[None] = self._submit_lease_op(op)
        return item

    async def release_lease(self, lease: Lease) -> None:
        await self.submit_release(lease).wait()

    async def save_snapshot(self, session_id: str, stream_id: str, seq: int, token: int, body: bytes) -> None:
        write = SnapshotWrite(session_id, stream_id, seq, token, body)
        if self._lane is None:
            raise JournalError(self._not_open())
        work = SnapshotWork(write, snapshot_row(stream_id, seq, body)[1])
        item: LaneItem[None] = LaneItem()
        self._lane.submit(work, item.resolve)
        await item.wait()
