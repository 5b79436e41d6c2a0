"""A paused old owner wakes up after a takeover (the faults issue, item 4).

The old process is "paused": its lease runs out by the store's clock and a new
owner takes over and recovers, while the old process's own clock says nothing
happened (as after SIGSTOP). Then it wakes up inside a tool call:

1. paused before ``ctx.ensure_owner()``: the check asks the store, is refused,
   and the effect never happens;
2. paused between ``ensure_owner()`` and the effect: only a downstream that
   refuses stale fencing tokens can stop the late write. The new owner's
   ``reconcile`` gets its fencing token and raises the ledger's floor, so the
   old owner's write is refused and the journal's "not sent" stays true.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import LeaseLostError, SideEffect, ToolErrorType, ToolKind, ToolResult, define_tool
from trio_agent._tools._context import ToolCall
from trio_agent._tools._pipeline import ToolPipeline
from trio_agent.journal import MemoryStore, ToolCompleted, ToolFailed, open_journal
from trio_agent.testing import start_turn

SID = "zombie"
OBJECT: dict[str, Any] = {"type": "object"}


class StaleTokenError(Exception):
    pass


class Ledger:
    """A downstream that refuses writes carrying a fencing token below its floor."""

    def __init__(self, *, fencing: bool = True) -> None:
        self.fencing = fencing
        self.floor = 0
        self.entries: dict[str, int] = {}

    def write(self, key: str, token: int | None) -> None:
        if self.fencing and (token is None or token < self.floor):
            raise StaleTokenError(f"token {token} is below the floor {self.floor}")
        self.entries[key] = token

    def raise_floor(self, token: int | None) -> None:
        if token is not None:
            self.floor = max(self.floor, token)


class StoreClock:
    """The store's clock, apart from Trio's: advancing it expires a lease the old process still trusts."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def payment_tool(ledger: Ledger, resume: trio.Event, paused: trio.Event, *, pause_before_check: bool) -> Any:
    async def reconcile(input: dict[str, Any], key: str, *, fencing_token: int | None) -> ToolResult | None:
        ledger.raise_floor(fencing_token)  # from now on the old owner's token is refused
        if key in ledger.entries:
            return ToolResult.success("sent")
        return ToolResult.failure(ToolErrorType.EXECUTION, "not sent", code="not_sent")

    @define_tool(
        name="pay",
        description="pays once",
        input_schema=OBJECT,
        side_effect=SideEffect.NON_IDEMPOTENT,
        kind=ToolKind.READONLY,
        reconcile=reconcile,
    )
    async def pay(input: dict[str, Any], ctx: Any) -> str:
        if pause_before_check:
            paused.set()
            await resume.wait()
        await ctx.ensure_owner()
        if not pause_before_check:
            paused.set()
            await resume.wait()
        ledger.write(ctx.idempotency_key, ctx.fencing_token)
        return "paid"

    return pay


@pytest.mark.parametrize("pause_before_check", [True, False])
async def test_a_paused_old_owner_never_performs_an_effect_the_journal_says_did_not_happen(
    pause_before_check: bool, autojump_clock: trio.testing.MockClock
) -> None:
    clock = StoreClock()
    store = MemoryStore(clock=clock)
    # Paused before the check: ensure_owner alone stops it, even with a downstream that does not fence.
    ledger = Ledger(fencing=not pause_before_check)
    paused, resume, old_done = trio.Event(), trio.Event(), trio.Event()
    tool = payment_tool(ledger, resume, paused, pause_before_check=pause_before_check)
    old_outcome: list[BaseException] = []

    async def old_owner() -> None:
        try:
            # A long TTL and heartbeat: while "paused" it renews nothing and notices nothing.
            async with open_journal(store, session_id=SID, owner="old", lease_ttl=1000, heartbeat_interval=800) as old:
                origin = await start_turn(old)
                pipeline = ToolPipeline([tool], journal=old)
                await pipeline.execute(ToolCall("c1", "pay", {}), origin)
        except LeaseLostError as exc:
            old_outcome.append(exc)
        finally:
            old_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(old_owner)
        await paused.wait()
        clock.now += 2000  # the old lease expires by the store's clock
        async with open_journal(store, session_id=SID, owner="new", lease_ttl=30) as new:
            report = await new.recover(tools={"pay": tool})
            assert report.reconciled == ("c1",)
            resume.set()  # the old process wakes up
            await old_done.wait()
            events = [envelope.event for envelope in await store.read(new.stream_id())]
    settled = [event for event in events if isinstance(event, ToolCompleted | ToolFailed)]
    assert len(settled) == 1 and isinstance(settled[0], ToolFailed)  # the journal says: not sent
    assert ledger.entries == {}  # and it is true
    assert len(old_outcome) == 1  # the old owner learnt it lost the lease
