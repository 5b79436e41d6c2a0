"""The command line's Ctrl-C and SIGTERM: both end a run as a cancellation.

The run is cancelled, so its sessions close and record how they ended, their leases are
released and temporary files go. Ctrl-C is received like SIGTERM rather than left to
Trio's ``KeyboardInterrupt``, which Python raises at whatever line of our code runs when
the signal lands: between an ``async with``'s enter and its block, its exit never runs
(an async generator left suspended, "Exception ignored" at exit). A second Ctrl-C while
the clean-up runs is a plain ``KeyboardInterrupt`` again: the receiver is gone by then.
The commands exit with 128 + the signal's number, as a shell reports for a stopped process.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import trio

__all__ = ["INTERRUPTED", "TERMINATED", "until_stopped"]

INTERRUPTED = 128 + signal.SIGINT
TERMINATED = 128 + signal.SIGTERM


async def until_stopped(main: Callable[[], Awaitable[object]]) -> signal.Signals | None:
    """Run *main* to its end (``None``), or until Ctrl-C or SIGTERM cancels it, its clean-up
    done (that signal)."""
    stopped_by: signal.Signals | None = None
    async with trio.open_nursery() as nursery:

        async def watch(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            nonlocal stopped_by
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                task_status.started()  # installed before *main* runs
                async for number in received:
                    stopped_by = signal.Signals(number)
                    nursery.cancel_scope.cancel()
                    return

        await nursery.start(watch)
        await main()
        nursery.cancel_scope.cancel()
    return stopped_by
