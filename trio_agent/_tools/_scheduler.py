"""Scheduler slots by tool kind, and fair reader/writer file locks."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable

import attrs
import trio

from .._config import validate_limit
from .._errors import FileLockTimeoutError
from ._definition import ToolKind

__all__ = ["FileLockManager", "SchedulerLimits", "ToolScheduler"]


@attrs.frozen
class SchedulerLimits:
    """How many calls of each kind may run at once."""

    readonly: int = attrs.field(default=10)
    write: int = attrs.field(default=10)
    execute: int = attrs.field(default=3)

    def __attrs_post_init__(self) -> None:
        for kind in ("readonly", "write", "execute"):
            validate_limit(getattr(self, kind), name=f"scheduler limit {kind!r}")

    def for_kind(self, kind: ToolKind) -> int:
        return int(getattr(self, kind.value))


_DEFAULT_LIMITS = SchedulerLimits()  # immutable: shared by every scheduler made without limits


@attrs.frozen
class SchedulerStatistics:
    """Per kind: ``(borrowed, waiting, total)``."""

    buckets: dict[str, tuple[int, int, int]]


@attrs.define(eq=False)
class _Waiter:
    exclusive: bool
    owner: str | None = None
    event: trio.Event = attrs.field(factory=trio.Event)
    granted: bool = False
    lineage: tuple[str, ...] = ()  # the calls it runs under (file locks only)


class _Bucket:
    """A FIFO counting semaphore whose slots are owned by calls, not tasks.

    Slots are handed directly to the first waiter on release (no barging), and a
    waiter cancelled after its slot was handed over gives it back.
    """

    __slots__ = ("free", "total", "waiters")

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self.waiters: deque[_Waiter] | None = None  # made by the first wait (a deque holds ~600 bytes)

    def try_acquire(self) -> bool:
        if self.free and not self.waiters:
            self.free -= 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            try:
                await trio.lowlevel.checkpoint()
            except BaseException:
                self.release()
                raise
            return
        waiter = _Waiter(exclusive=True)
        if self.waiters is None:
            self.waiters = deque()
        waiters = self.waiters
        waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release()
            else:
                waiters.remove(waiter)
            raise

    def release(self) -> None:
        if self.waiters:
            waiter = self.waiters.popleft()
            waiter.granted = True
            waiter.event.set()
        else:
            self.free += 1


class ToolScheduler:
    """FIFO buckets of slots, one per `ToolKind` (defaults: readonly 10, write 10, execute 3).

    Each pipeline makes its own scheduler; pass one scheduler to several
    pipelines to share the buckets explicitly. Slots are held on behalf of the
    call (not the task), waiting is cancellable, and a slot granted to a
    cancelled waiter is given back.
    """

    def __init__(self, limits: SchedulerLimits | None = None) -> None:
        self.limits = limits if limits is not None else _DEFAULT_LIMITS
        # Made on first use: most sessions use one or two kinds, and an idle session should be small.
        # Keyed by the kind's value: a string hashes in C, an enum member through its Python `__hash__`.
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, kind: ToolKind) -> _Bucket:
        bucket = self._buckets.get(kind._value_)
        if bucket is None:
            bucket = self._buckets[kind._value_] = _Bucket(self.limits.for_kind(kind))
        return bucket

    def try_acquire(self, kind: ToolKind) -> bool:
        """Take a slot without waiting; False if none is free or others are already waiting."""
        bucket = self._buckets.get(kind._value_) or self._bucket(kind)
        # `bucket.try_acquire()`, inline: asked by every call.
        if bucket.free and not bucket.waiters:
            bucket.free -= 1
            return True
        return False

    async def acquire(self, kind: ToolKind) -> None:
        """Wait (FIFO, cancellable) for a slot of *kind*."""
        await self._bucket(kind).acquire()

    def release(self, kind: ToolKind) -> None:
        bucket = self._buckets.get(kind._value_) or self._bucket(kind)
        if bucket.waiters:
            bucket.release()
        else:
            bucket.free += 1  # `bucket.release()`, inline: done by every call

    def statistics(self) -> SchedulerStatistics:
        buckets = {}
        for kind in ToolKind:
            bucket = self._bucket(kind)
            buckets[kind.value] = (bucket.total - bucket.free, len(bucket.waiters or ()), bucket.total)
        return SchedulerStatistics(buckets)


@attrs.define(eq=False)
class _PathLock:
    """A fair reader/writer lock: grants strictly in arrival order, so readers never starve a writer.

    Holds belong to the call tree (`FileLockManager`): a call's ancestors wait for it, so an
    ancestor's hold never stands in its way where that hold already covers the call, and a call
    may write where its ancestors (and no one else) only read.
    """

    readers: int = 0
    writer: bool = False
    waiters: deque[_Waiter] = attrs.field(factory=deque)
    owners: list[str] = attrs.field(factory=list)  # the calls holding it (those that said who they are)
    writer_owner: str | None = None  # the call holding it exclusively, if it said who it is

    def idle(self) -> bool:
        return self.readers == 0 and not self.writer and not self.waiters

    def covers(self, exclusive: bool, lineage: tuple[str, ...]) -> bool:
        """Whether an ancestor in *lineage* holds it in a way that covers the request: exclusively,
        or at all for a shared request. (An ancestor that only reads does not cover a write: an
        unrelated reader may hold it beside that ancestor.)"""
        owners = self.owners
        if not owners:
            return False
        if self.writer and self.writer_owner is not None and self.writer_owner in lineage:
            return True
        return not exclusive and any(call in lineage for call in owners)

    def _only_ancestors_read(self, lineage: tuple[str, ...]) -> bool:
        """No writer, and every reader is an ancestor in *lineage*: they wait for the call, so it may
        write (ahead of the queue: what is queued waits for those ancestors, who wait for it)."""
        if self.writer or not lineage or not self.readers:
            return False
        return sum(1 for call in self.owners if call in lineage) == self.readers

    def try_grant(self, exclusive: bool, owner: str | None = None, lineage: tuple[str, ...] = ()) -> bool:
        if exclusive and lineage and self._only_ancestors_read(lineage):
            self._grant(True, owner)
            return True
        if self.waiters:
            return False
        if exclusive:
            if self.readers == 0 and not self.writer:
                self._grant(True, owner)
                return True
            return False
        if not self.writer:
            self._grant(False, owner)
            return True
        return False

    def _grant(self, exclusive: bool, owner: str | None) -> None:
        if exclusive:
            self.writer = True
            self.writer_owner = owner
        else:
            self.readers += 1
        if owner is not None:
            self.owners.append(owner)

    def release(self, exclusive: bool, owner: str | None = None) -> None:
        if exclusive:
            self.writer = False
            self.writer_owner = None
        else:
            self.readers -= 1
        if owner is not None:
            self.owners.remove(owner)
        self.wake()

    def wake(self) -> None:
        waiters = self.waiters
        while waiters:
            head = waiters[0]
            if head.exclusive:
                if (self.readers or self.writer) and not self._only_ancestors_read(head.lineage):
                    break
            elif self.writer:
                break
            waiters.popleft()
            self._hand_over(head)
        if waiters and not self.writer:
            # A writer queued behind the head whose only obstacle now is its ancestors' reads: it
            # goes first (the head waits for those ancestors, and they for it).
            for waiter in waiters:
                if waiter.exclusive and self._only_ancestors_read(waiter.lineage):
                    waiters.remove(waiter)
                    self._hand_over(waiter)
                    break

    def _hand_over(self, waiter: _Waiter) -> None:
        self._grant(waiter.exclusive, waiter.owner)
        waiter.granted = True
        waiter.event.set()


class FileLockManager:
    """Per-path locks: shared for read-only, concurrency-safe calls, exclusive otherwise.

    Paths are normalised and locked in sorted order, so two calls that need
    overlapping sets cannot deadlock. Waiting is fair (FIFO) and bounded.

    Locks belong to the call tree: a call that names its ``owner`` and its
    ``lineage`` (the calls it runs under, e.g. ``task`` -> subagent -> tool) takes a
    path without waiting where an ancestor's hold covers it (the ancestor holds it
    exclusively, or the call only reads), and writes a path that only its ancestors
    read (they wait for it, so they never run at the same time). Otherwise it waits
    like any call: an unrelated reader beside a reading ancestor keeps a writer out.
    """

    def __init__(self) -> None:
        self._locks: dict[str, _PathLock] = {}

    @staticmethod
    def normalise(paths: Iterable[str], root: str | None = None) -> tuple[str, ...]:
        base = root or os.getcwd()
        return tuple(sorted({os.path.normpath(os.path.join(base, path)) for path in paths}))

    async def acquire_all(
        self,
        paths: tuple[str, ...],
        exclusive: bool,
        bound: float,
        *,
        owner: str | None = None,
        lineage: tuple[str, ...] = (),
    ) -> tuple[str, ...]:
        """Acquire every path (already normalised and sorted) or none; raises `FileLockTimeoutError`.

        Returns the paths actually taken (release those, with the same *owner*):
        a path an ancestor in *lineage* holds is covered by its hold and not taken again.
        """
        acquired: list[str] = []
        index = 0
        try:
            with trio.fail_after(bound):
                for index, path in enumerate(paths):  # noqa: B007 - the index names the path that timed out
                    if await self._acquire(path, exclusive, owner, lineage):
                        acquired.append(path)
        except trio.TooSlowError:
            self.release_all(acquired, exclusive=exclusive, owner=owner)
            raise FileLockTimeoutError(paths[index], bound) from None
        except BaseException:
            self.release_all(acquired, exclusive=exclusive, owner=owner)
            raise
        return tuple(acquired)

    async def _acquire(self, path: str, exclusive: bool, owner: str | None, lineage: tuple[str, ...]) -> bool:
        lock = self._locks.get(path)
        if lock is None:
            lock = self._locks[path] = _PathLock()
        elif lineage and lock.covers(exclusive, lineage):
            await trio.lowlevel.checkpoint()
            return False  # an ancestor's hold covers this call
        if lock.try_grant(exclusive, owner, lineage):
            return True
        waiter = _Waiter(exclusive, owner, lineage=lineage)
        lock.waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                lock.release(exclusive, owner)
            else:
                lock.waiters.remove(waiter)
                lock.wake()  # a reader queued behind a cancelled writer may go now
            self._forget_if_idle(path, lock)
            raise
        return True

    def release_all(self, paths: Iterable[str], *, exclusive: bool, owner: str | None = None) -> None:
        for path in paths:
            lock = self._locks[path]
            lock.release(exclusive, owner)
            self._forget_if_idle(path, lock)

    def _forget_if_idle(self, path: str, lock: _PathLock) -> None:
        if lock.idle() and self._locks.get(path) is lock:
            del self._locks[path]

    def held(self) -> dict[str, tuple[int, bool, int]]:
        """For tests and diagnostics: path -> (readers, writer held, waiters)."""
        return {path: (lock.readers, lock.writer, len(lock.waiters)) for path, lock in self._locks.items()}
