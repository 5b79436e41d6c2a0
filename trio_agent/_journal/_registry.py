"""One SQLite store per (Trio run, real path), shared by every session that names the file.

Sessions opened with ``journal="x.db"`` used to open a store each: a thousand
sessions meant a thousand writer threads competing for one file's write lock
(``database is locked``, seconds of p99). A file has one writer at a time
anyway, so every session of a Trio run that names the same file (by its real
path) shares one store and its group commit. The registry lives in a
`trio.lowlevel.RunVar` (no global state outlives the run) and counts its users:
the first opens the store, the last to leave closes it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, cast

import trio

from .._cleanup import DEFAULT_CLEANUP_GRACE
from .._errors import JournalUnavailableError

if TYPE_CHECKING:
    from ._sqlite import SQLiteStore

__all__ = ["shared_sqlite_store"]


class _Entry:
    __slots__ = ("closer", "error", "ready", "store", "users")

    def __init__(self) -> None:
        self.store: SQLiteStore | None = None
        # The opener's exit, run by the last user (it holds no nursery or cancel scope,
        # so any task may run it).
        self.closer: AbstractAsyncContextManager[SQLiteStore] | None = None
        self.error: BaseException | None = None
        self.ready = trio.Event()
        self.users = 1


_REGISTRY: trio.lowlevel.RunVar[dict[str, _Entry]] = trio.lowlevel.RunVar("trio_agent.shared_sqlite_stores")


def _registry() -> dict[str, _Entry]:
    try:
        return _REGISTRY.get()
    except LookupError:
        registry: dict[str, _Entry] = {}
        _REGISTRY.set(registry)
        return registry


@asynccontextmanager
async def shared_sqlite_store(
    path: str | os.PathLike[str], *, cleanup_grace: float = DEFAULT_CLEANUP_GRACE
) -> AsyncIterator[SQLiteStore]:
    """The run's store for the SQLite file at *path*, opened by its first user, closed by its last."""
    key = str(await trio.Path(path).resolve())  # the real path: links and ./ name one file
    registry = _registry()
    entry = registry.get(key)
    if entry is None:
        entry = registry[key] = _Entry()
        from ._sqlite import SQLiteStoreBlock, open_sqlite_store  # the driver loads on first use

        opener = open_sqlite_store(path, cleanup_grace=cleanup_grace)
        # Entered by the first user's task and left by the last one's: no task of its own.
        cast(SQLiteStoreBlock, opener).keep_leases = False
        try:
            entry.store = await opener.__aenter__()
            entry.closer = opener
        except BaseException as exc:
            entry.error = exc
            if registry.get(key) is entry:
                del registry[key]
            raise
        finally:
            entry.ready.set()
    else:
        entry.users += 1
        try:
            await entry.ready.wait()
        except BaseException:
            entry.users -= 1
            raise
        if entry.store is None:
            entry.users -= 1
            raise JournalUnavailableError(f"opening the journal {key!r} failed: {entry.error}")
    store = entry.store
    try:
        yield store
    finally:
        entry.users -= 1
        if entry.users == 0:
            if registry.get(key) is entry:
                del registry[key]  # a session opening the file from now on opens it afresh
            assert entry.closer is not None
            await entry.closer.__aexit__(None, None, None)
