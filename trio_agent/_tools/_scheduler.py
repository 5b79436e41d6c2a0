"""Scheduler slots by tool kind, and fair reader/writer file locks."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Hashable, Iterable

import attrs
import trio

from .._config import validate_limit
from .._errors import ConfigError, FileLockTimeoutError
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
    event: trio.Event = attrs.field(factory=trio.Event)
    granted: bool = False


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
        if limits is None:
            limits = _DEFAULT_LIMITS
        elif not isinstance(limits, SchedulerLimits):
            raise ConfigError(f"limits must be SchedulerLimits, not {safe_repr(limits)}")
        self.limits = limits
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


class _LockWaiter:
    """A call waiting for its paths: queued on each of them, and granted all of them at once."""

    __slots__ = ("event", "exclusive", "granted", "lineage", "owner", "paths")

    def __init__(
        self, paths: tuple[str, ...], exclusive: bool, owner: Hashable | None, lineage: tuple[Hashable, ...]
    ) -> None:
        self.paths = paths
        self.exclusive = exclusive
        self.owner = owner
        self.lineage = lineage  # the calls it runs under
        self.event = trio.Event()
        self.granted = False


@attrs.define(eq=False)
class _PathLock:
    """One path's reader/writer holds and its queue (`FileLockManager` grants).

    Holds belong to the call tree: a call's ancestors wait for it, so an ancestor's hold never
    stands in its way. Every other hold does, a sibling's included: two calls under one ancestor
    exclude each other as any two calls do.
    """

    readers: int = 0
    writers: int = 0  # more than one only where a descendant writes under its ancestor's exclusive hold
    waiters: deque[_LockWaiter] = attrs.field(factory=deque)
    holds: list[tuple[Hashable, bool]] = attrs.field(factory=list)  # (owner, exclusive) of holds that said who

    def blocked(self, exclusive: bool, lineage: tuple[Hashable, ...]) -> bool:
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

    def grant(self, exclusive: bool, owner: Hashable | None) -> None:
        if exclusive:
            self.writers += 1
        else:
            self.readers += 1
        if owner is not None:
            self.holds.append((owner, exclusive))

    def release(self, exclusive: bool, owner: Hashable | None) -> None:
        if exclusive:
            self.writers -= 1
        else:
            self.readers -= 1
        if owner is not None:
            self.holds.remove((owner, exclusive))


class FileLockManager:
    """Per-path locks: shared for read-only, concurrency-safe calls, exclusive otherwise.

    A call takes all its paths at once or waits holding none of them, so no waiter sits on part
    of its set while it waits for the rest: overlapping sets cannot deadlock, whatever their
    order. Waiting is fair and bounded: a waiter is queued on each of its paths in arrival order
    and keeps its place on the free ones too, so later calls do not overtake it there (readers
    cannot starve a writer, nor small sets a call with many paths).

    Locks belong to the call tree: a call that names its ``owner`` and its ``lineage`` (the calls
    it runs under, e.g. ``task`` -> subagent -> tool) never waits for its ancestors' holds (they
    wait for it). While one of its ancestors holds a lock here, it also goes ahead of the queued
    calls (they may be waiting for that ancestor, which waits for it: queued behind them, the tree
    and the queue would wait for each other until ``lock_timeout``). It still takes a hold of its
    own, so every other hold keeps it out as for any call: a sibling's (two calls under one
    ancestor exclude each other), and an unrelated reader's beside a reading ancestor.

    An owner (and each entry of a lineage) is any hashable that names one call among all the
    manager's users: pipelines that share a manager may repeat agent and call ids, so a
    `ToolPipeline` names its calls ``(session, call_key)``, its ``session_key`` (or, without one,
    the pipeline itself) with `ExecutionContext.call_key`, and the entries of a call's lineage
    likewise.
    """

    def __init__(self) -> None:
        self._locks: dict[str, _PathLock] = {}
        # Owner -> how many paths it holds: whose descendants go ahead of the queues.
        self._owners: dict[Hashable, int] = {}

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

    def _under_holder(self, lineage: tuple[Hashable, ...]) -> bool:
        """Whether one of the calls in *lineage* holds a lock here."""
        return not self._owners.keys().isdisjoint(lineage)

    def try_acquire_all(
        self,
        paths: tuple[str, ...],
        exclusive: bool,
        *,
        owner: Hashable | None = None,
        lineage: tuple[Hashable, ...] = (),
    ) -> tuple[str, ...] | None:
        """Take every path (already normalised and sorted) now, or none and return ``None``: for a
        caller that must not wait while it holds something else."""
        locks = self._locks
        ahead: bool | None = None  # whether it may go ahead of queued calls (asked only if one waits)
        for path in paths:
            lock = locks.get(path)
            if lock is None:
                continue  # free
            if lock.waiters:
                if ahead is None:
                    ahead = bool(lineage) and self._under_holder(lineage)
                if not ahead:
                    return None
            if lock.blocked(exclusive, lineage):
                return None
        self._take(paths, exclusive, owner)
        return paths

    async def acquire_all(
        self,
        paths: tuple[str, ...],
        exclusive: bool,
        bound: float,
        *,
        owner: Hashable | None = None,
        lineage: tuple[Hashable, ...] = (),
    ) -> tuple[str, ...]:
        """Acquire every path (already normalised and sorted) or none; raises `FileLockTimeoutError`.

        The wait holds nothing: the paths are granted together. Returns the paths taken (release
        them with the same *exclusive* and *owner*).
        """
        if self.try_acquire_all(paths, exclusive, owner=owner, lineage=lineage) is not None:
            return paths
        waiter = _LockWaiter(paths, exclusive, owner, lineage)
        locks = self._locks
        for path in paths:
            lock = locks.get(path)
            if lock is None:
                lock = locks[path] = _PathLock()
            lock.waiters.append(waiter)
        try:
            with trio.fail_after(bound):
                await waiter.event.wait()
        except BaseException as exc:
            if waiter.granted:
                # Granted after the cancellation was delivered, before this task ran on: give them back.
                self.release_all(paths, exclusive=exclusive, owner=owner)
                blocking = paths[0]
            else:
                blocking = self._leave_queues(waiter)
            if isinstance(exc, trio.TooSlowError):
                raise FileLockTimeoutError(blocking, bound) from None
            raise
        return paths

    def release_all(self, paths: Iterable[str], *, exclusive: bool, owner: Hashable | None = None) -> None:
        if not isinstance(paths, tuple):
            paths = tuple(paths)
        locks = self._locks
        for path in paths:
            locks[path].release(exclusive, owner)
        if owner is not None and paths:
            left = self._owners[owner] - len(paths)
            if left:
                self._owners[owner] = left
            else:
                del self._owners[owner]
        self._wake(paths)

    def _take(self, paths: tuple[str, ...], exclusive: bool, owner: Hashable | None) -> None:
        locks = self._locks
        for path in paths:
            lock = locks.get(path)
            if lock is None:
                lock = locks[path] = _PathLock()
            lock.grant(exclusive, owner)
        if owner is not None and paths:
            self._owners[owner] = self._owners.get(owner, 0) + len(paths)

    def _grantable(self, waiter: _LockWaiter) -> bool:
        """Whether *waiter* may have all its paths now: first in each queue (or going ahead of them,
        under a holding ancestor), and no hold but its ancestors' in its way."""
        locks = self._locks
        ahead: bool | None = None
        for path in waiter.paths:
            lock = locks[path]
            if lock.waiters[0] is not waiter:
                if ahead is None:
                    ahead = bool(waiter.lineage) and self._under_holder(waiter.lineage)
                if not ahead:
                    return False
            if lock.blocked(waiter.exclusive, waiter.lineage):
                return False
        return True

    def _wake(self, paths: Iterable[str]) -> None:
        """Grant what the holds or queues of *paths* no longer keep waiting; forget idle paths.

        A grant takes a waiter out of the queues of all its paths, so their next waiters are
        looked at too."""
        locks = self._locks
        pending = list(paths)
        while pending:
            path = pending.pop()
            lock = locks.get(path)
            if lock is None:
                continue
            waiters = lock.waiters
            if not waiters:
                if lock.readers == 0 and lock.writers == 0:
                    del locks[path]
                continue
            chosen: _LockWaiter | None = None
            head = waiters[0]
            if self._grantable(head):
                chosen = head
            elif self._owners:
                # A waiter under a holding ancestor may go ahead of the head.
                for waiter in waiters:
                    if waiter is not head and waiter.lineage and self._grantable(waiter):
                        chosen = waiter
                        break
            if chosen is not None:
                for taken in chosen.paths:
                    locks[taken].waiters.remove(chosen)
                self._take(chosen.paths, chosen.exclusive, chosen.owner)
                chosen.granted = True
                chosen.event.set()
                pending.extend(chosen.paths)

    def _leave_queues(self, waiter: _LockWaiter) -> str:
        """Take a waiter that gave up out of its queues (what queued behind it may go now); returns
        the path it waited for: the first one held against it, else the first with a call ahead."""
        locks = self._locks
        held = queued = None
        for path in waiter.paths:
            lock = locks[path]
            if held is None and lock.blocked(waiter.exclusive, waiter.lineage):
                held = path
            if queued is None and lock.waiters[0] is not waiter:
                queued = path
            lock.waiters.remove(waiter)
        self._wake(waiter.paths)
        return held or queued or waiter.paths[0]

    def held(self) -> dict[str, tuple[int, bool, int]]:
        """For tests and diagnostics: path -> (readers, writer held, waiters)."""
        return {path: (lock.readers, lock.writers > 0, len(lock.waiters)) for path, lock in self._locks.items()}
