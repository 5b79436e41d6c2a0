"""Scheduler slots by tool kind, and fair reader/writer file locks."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable

import attrs
import trio

from .._config import validate_limit
from .._errors import FileLockTimeoutError
from .._util import safe_repr
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
    ancestor's hold never stands in its way (and a call whose ancestor holds the lock goes ahead of
    the queue, which waits for that ancestor). Every other hold does, a sibling's included: two
    calls under one ancestor exclude each other as any two calls do.
    """

    readers: int = 0
    writers: int = 0  # more than one only where a descendant writes under its ancestor's exclusive hold
    waiters: deque[_Waiter] = attrs.field(factory=deque)
    holds: list[tuple[str, bool]] = attrs.field(factory=list)  # (owner, exclusive) of holds that said who

    def idle(self) -> bool:
        return self.readers == 0 and self.writers == 0 and not self.waiters

    def _ancestor_holds(self, lineage: tuple[str, ...]) -> bool:
        return any(owner in lineage for owner, _ in self.holds)

    def _blocked(self, exclusive: bool, lineage: tuple[str, ...]) -> bool:
        """Whether a hold other than an ancestor's (in *lineage*) excludes the request: any hold a
        write, a write a read."""
        if exclusive:
            others = self.readers + self.writers
            if others and lineage:
                others -= sum(1 for owner, _ in self.holds if owner in lineage)
            return others > 0
        writers = self.writers
        if writers and lineage:
            writers -= sum(1 for owner, held_exclusive in self.holds if held_exclusive and owner in lineage)
        return writers > 0

    def try_grant(self, exclusive: bool, owner: str | None = None, lineage: tuple[str, ...] = ()) -> bool:
        # Behind the queue unless an ancestor holds the lock: what is queued waits for that ancestor,
        # which waits for this call.
        if self.waiters and not (lineage and self._ancestor_holds(lineage)):
            return False
        if self._blocked(exclusive, lineage):
            return False
        self._grant(exclusive, owner)
        return True

    def _grant(self, exclusive: bool, owner: str | None) -> None:
        if exclusive:
            self.writers += 1
        else:
            self.readers += 1
        if owner is not None:
            self.holds.append((owner, exclusive))

    def release(self, exclusive: bool, owner: str | None = None) -> None:
        if exclusive:
            self.writers -= 1
        else:
            self.readers -= 1
        if owner is not None:
            self.holds.remove((owner, exclusive))
        self.wake()

    def wake(self) -> None:
        waiters = self.waiters
        while waiters:
            head = waiters[0]
            if self._blocked(head.exclusive, head.lineage):
                break
            waiters.popleft()
            self._hand_over(head)
        if waiters and self.holds:
            # A waiter whose ancestor holds the lock goes ahead of the head (which waits for that
            # ancestor, and the ancestor for it) once no other hold is in its way.
            for waiter in [waiter for waiter in waiters if waiter.lineage]:
                if self._ancestor_holds(waiter.lineage) and not self._blocked(waiter.exclusive, waiter.lineage):
                    waiters.remove(waiter)
                    self._hand_over(waiter)

    def _hand_over(self, waiter: _Waiter) -> None:
        self._grant(waiter.exclusive, waiter.owner)
        waiter.granted = True
        waiter.event.set()


class FileLockManager:
    """Per-path locks: shared for read-only, concurrency-safe calls, exclusive otherwise.

    Paths are normalised and locked in sorted order, so two calls that need
    overlapping sets cannot deadlock. Waiting is fair (FIFO) and bounded.

    Locks belong to the call tree: a call that names its ``owner`` and its
    ``lineage`` (the calls it runs under, e.g. ``task`` -> subagent -> tool) never
    waits for its ancestors' holds (they wait for it) and goes ahead of the queue
    where one of them holds the path. It still takes a hold of its own, so every
    other hold keeps it out as for any call: a sibling's (two calls under one
    ancestor exclude each other), and an unrelated reader's beside a reading ancestor.
    """

    def __init__(self) -> None:
        self._locks: dict[str, _PathLock] = {}

    @staticmethod
    def normalise(paths: Iterable[str], root: str | None = None) -> tuple[str, ...]:
        """*paths* joined to *root* (default the working directory) and resolved with
        `os.path.realpath`, as the permission path policy resolves them: two names of one file (a
        symlink, ``..``) are one lock. De-duplicated and sorted. Raises `ValueError` for a path
        with a NUL byte (no file has that name) and `TypeError` for one that is not a `str`."""
        if isinstance(paths, str):
            raise TypeError(f"normalise takes a collection of paths, not the one str {safe_repr(paths)}")
        base = root or os.getcwd()
        resolved: set[str] = set()
        for path in paths:
            if not isinstance(path, str):
                raise TypeError(f"a path to lock must be a str, not {safe_repr(path)}")
            if "\x00" in path:
                raise ValueError(f"path {safe_repr(path)} contains a NUL byte")
            resolved.add(os.path.realpath(os.path.join(base, path)))
        return tuple(sorted(resolved))

    def try_acquire_all(
        self,
        paths: tuple[str, ...],
        exclusive: bool,
        *,
        owner: str | None = None,
        lineage: tuple[str, ...] = (),
    ) -> tuple[str, ...] | None:
        """Take every path (already normalised and sorted) now, or none and return ``None``: for a
        caller that must not wait while it holds something else."""
        taken: list[str] = []
        for path in paths:
            lock = self._locks.get(path)
            if lock is None:
                lock = self._locks[path] = _PathLock()
            if not lock.try_grant(exclusive, owner, lineage):
                self._forget_if_idle(path, lock)
                self.release_all(taken, exclusive=exclusive, owner=owner)
                return None
            taken.append(path)
        return paths

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

        Returns the paths taken (release them with the same *exclusive* and *owner*).
        """
        acquired: list[str] = []
        index = 0
        try:
            with trio.fail_after(bound):
                for index, path in enumerate(paths):  # noqa: B007 - the index names the path that timed out
                    await self._acquire(path, exclusive, owner, lineage)
                    acquired.append(path)
        except trio.TooSlowError:
            self.release_all(acquired, exclusive=exclusive, owner=owner)
            raise FileLockTimeoutError(paths[index], bound) from None
        except BaseException:
            self.release_all(acquired, exclusive=exclusive, owner=owner)
            raise
        return tuple(acquired)

    async def _acquire(self, path: str, exclusive: bool, owner: str | None, lineage: tuple[str, ...]) -> None:
        lock = self._locks.get(path)
        if lock is None:
            lock = self._locks[path] = _PathLock()
        if lock.try_grant(exclusive, owner, lineage):
            return
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
        return {path: (lock.readers, lock.writers > 0, len(lock.waiters)) for path, lock in self._locks.items()}
