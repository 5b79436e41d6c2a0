"""Reporting a tool's cleanup overrun when it starts, not only once the tool ends.

A tool that ignores its cancellation (a shielded scope, blocking code) runs on in its call's
task, so no code of the pipeline runs until it ends; meanwhile new tool starts, the request's
end, ``session.abort()`` and the session's close wait for it. When a pipeline cancels a tool
(its abort), it asks the run's one watcher task to come back at the tool's cleanup deadline; the
watcher sleeps until the earliest deadline asked about and lets that pipeline look at the calls it
watches (`ToolPipeline._report_overruns`), which logs the ones past their grace. It is a system
task because a pipeline has no nursery; it holds pipelines only by weak reference, and ends as
soon as no watched call runs (`unwatch_cleanups`), so it never outlives the stuck tool, the
session or the run. Calls that are not cancelled never reach it: nothing per call.
"""

from __future__ import annotations

import heapq
import logging
import weakref
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from ._pipeline import ToolPipeline

__all__ = ["unwatch_cleanups", "watch_cleanups"]

logger = logging.getLogger("trio_agent")


class _Watcher:
    __slots__ = ("due", "scope", "seq")

    def __init__(self) -> None:
        self.due: list[tuple[float, int, weakref.ref[ToolPipeline]]] = []
        self.scope: trio.CancelScope | None = None  # its sleep, while it sleeps
        self.seq = 0


_WATCHER: trio.lowlevel.RunVar[_Watcher | None] = trio.lowlevel.RunVar("trio_agent.cleanup_watcher", default=None)


def watch_cleanups(pipeline: ToolPipeline, at: float) -> None:
    """Have *pipeline* look at its running tools at time *at* (`ToolPipeline._report_overruns`)."""
    watcher = _WATCHER.get()
    if watcher is None:
        watcher = _Watcher()
        try:
            trio.lowlevel.spawn_system_task(_watch, watcher, name="trio_agent tool cleanup watcher")
        except RuntimeError:  # the run is shutting down: nothing left to report to
            return
        _WATCHER.set(watcher)
    watcher.seq += 1
    heapq.heappush(watcher.due, (at, watcher.seq, weakref.ref(pipeline)))
    scope = watcher.scope
    if scope is not None and at < scope.deadline:
        scope.deadline = at


def unwatch_cleanups(pipeline: ToolPipeline) -> None:
    """*pipeline* has nothing left to look at: forget it (the watcher ends if no one else is left)."""
    watcher = _WATCHER.get()
    if watcher is None:
        return
    due = watcher.due
    due[:] = [entry for entry in due if entry[2]() not in (pipeline, None)]
    heapq.heapify(due)
    scope = watcher.scope
    if scope is not None:
        if due:
            scope.deadline = due[0][0]
        else:
            scope.cancel()


async def _watch(watcher: _Watcher) -> None:
    due = watcher.due
    try:
        while due:
            with trio.CancelScope(deadline=due[0][0]) as scope:
                watcher.scope = scope
                await trio.sleep_forever()
            watcher.scope = None
            now = trio.current_time()
            while due and due[0][0] <= now:
                pipeline = heapq.heappop(due)[2]()
                if pipeline is None:
                    continue  # gone: nothing of it runs
                try:
                    pipeline._report_overruns()
                except Exception:  # a system task's error would crash the run
                    logger.exception("reporting the tool cleanup overruns of a pipeline failed")
                del pipeline
    finally:
        watcher.scope = None
        if _WATCHER.get() is watcher:
            _WATCHER.set(None)
