"""A journal store for tests whose writes land later, as a writer thread's do."""

from __future__ import annotations

import math

import trio

from trio_agent import JournalUnavailableError
from trio_agent._journal._memory import MemoryStore
from trio_agent._journal._store import AppendBatch, AppendResult, AppendTicket


class LaterStore(MemoryStore):
    """A memory store whose writes commit later, in submission order, from a task of its own
    (`run`): ``delay`` seconds after their turn comes, and only while ``gate`` is set. It has no
    ``commit`` of its own, so a journal awaits each write's ticket. ``fail_next``: the next write
    fails with an unknown outcome, nothing written."""

    __slots__ = ("_receive", "_send", "delay", "fail_next", "gate")

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay = delay
        self.fail_next = False
        self.gate = trio.Event()
        self.gate.set()
        self._send, self._receive = trio.open_memory_channel[tuple[AppendBatch, AppendTicket]](math.inf)

    def submit(self, batch: AppendBatch) -> AppendTicket:
        ticket = AppendTicket(batch)
        self._send.send_nowait((batch, ticket))
        return ticket

    async def run(self) -> None:
        async for batch, ticket in self._receive:
            if self.delay:
                await trio.sleep(self.delay)
            await self.gate.wait()
            outcome: AppendResult | BaseException
            if self.fail_next:
                self.fail_next = False
                outcome = JournalUnavailableError("the writer failed")
            else:
                try:
                    outcome = MemoryStore.commit(self, batch)
                except Exception as exc:
                    outcome = exc
            ticket._resolve(outcome)
