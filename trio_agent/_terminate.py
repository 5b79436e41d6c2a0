"""The command line's Ctrl-C and SIGTERM: both end a run as a cancellation.

The run is cancelled, so its sessions close and record how they ended, their leases are
released and temporary files go. Ctrl-C is received like SIGTERM rather than left to
Trio's ``KeyboardInterrupt``, which Python raises at whatever line of our code runs when
the signal lands: between an ``async with``'s enter and its block, its exit never runs
(an async generator left suspended, "Exception ignored" at exit). A second Ctrl-C (or
SIGTERM) while the clean-up runs stops the process at once: the clean-up gets
`HARD_EXIT_AFTER` seconds more, then the process exits without it. Trio's own
``KeyboardInterrupt`` could not do that: it waits for every task, and one in a shielded
scope (a write to a client that stopped reading, a thread) may never end.
The commands exit with 128 + the signal's number, as a shell reports for a stopped process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import trio

__all__ = ["HARD_EXIT_AFTER", "INTERRUPTED", "TERMINATED", "until_stopped"]

INTERRUPTED = 128 + signal.SIGINT
TERMINATED = 128 + signal.SIGTERM
HARD_EXIT_AFTER = 0.5
"""How long the clean-up may go on after a second signal."""


def _said(stopped_by: signal.Signals) -> str:
    return "interrupted" if stopped_by is signal.SIGINT else "terminated"


def _hard_exit(status: int, line: str) -> None:
    """End the process now, its clean-up unfinished: *line* on stderr, then exit *status*. Standard
    output is not flushed: a reader that stopped reading it could hold the exit up."""
    with contextlib.suppress(OSError, ValueError):  # a closed or broken stderr: the status still says it
        print(line, file=sys.stderr, flush=True)
    os._exit(status)


async def until_stopped(
    main: Callable[[], Awaitable[object]], *, said: Callable[[signal.Signals], str] = _said
) -> signal.Signals | None:
    """Run *main* to its end (``None``), or until Ctrl-C or SIGTERM cancels it, its clean-up
    done (that signal). A second signal during the clean-up gives it `HARD_EXIT_AFTER` seconds,
    then exits the process (status 128 + the first signal's number, ``said(first signal)`` on
    stderr: what the command says when it stops)."""
    stopped_by: signal.Signals | None = None
    # The receiver stays until *main* has ended: a second signal during its clean-up is ours too.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        async with trio.open_nursery() as nursery:
            running = trio.CancelScope()

            async def watch() -> None:
                nonlocal stopped_by
                async for number in received:
                    if stopped_by is None:
                        stopped_by = signal.Signals(number)
                        running.cancel()
                        continue
                    # A second signal: the clean-up has a moment more (this task is cancelled
                    # when *main* ends), then the process goes without it.
                    await trio.sleep(HARD_EXIT_AFTER)
                    _hard_exit(128 + stopped_by, said(stopped_by))

            nursery.start_soon(watch)
            with running:
                await main()
            nursery.cancel_scope.cancel()
    return stopped_by
