"""The command line's SIGTERM: a service manager's stop ends a run as Ctrl-C does.

The run is cancelled, so its sessions close and record how they ended, their leases are
released and temporary files go; the command then exits with 143 (128 + SIGTERM), as a
shell reports for a process SIGTERM stopped.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import trio

__all__ = ["TERMINATED", "until_terminated"]

TERMINATED = 128 + signal.SIGTERM


async def until_terminated(main: Callable[[], Awaitable[object]]) -> bool:
    """Run *main* to its end, or until SIGTERM cancels it (its clean-up done); ``True`` then."""
    terminated = False
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal terminated
            with trio.open_signal_receiver(signal.SIGTERM) as received:
                async for _ in received:
                    terminated = True
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch)
        await main()
        nursery.cancel_scope.cancel()
    return terminated
