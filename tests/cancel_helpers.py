"""Cancellations as tests need them.

Work that runs its own nursery and fails in its cleanup when a scope around it cancels it.

Trio then passes the rest of the nursery's group (without its ``Cancelled``) through the
cancelling scope: every scope of ours around user code must end such work as the cancellation
would have, never let the bare ``ExceptionGroup`` out.
"""

from __future__ import annotations

from typing import NoReturn

import trio


async def failing_child() -> None:
    try:
        await trio.sleep_forever()
    finally:
        raise ValueError("cleanup failed")


async def nursery_failing_in_cleanup() -> NoReturn:
    """Wait forever in a nursery whose other task raises ``ValueError`` when it is cancelled."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(failing_child)
        await trio.sleep_forever()
    raise AssertionError("unreachable")


async def cancelled_of_its_own() -> trio.Cancelled:
    """A ``Cancelled`` of a scope that has already exited: nothing around the caller is cancelled."""
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.sleep_forever()
        except trio.Cancelled as exc:
            return exc
    raise AssertionError("unreachable")
