"""Helpers for testing code built on trio_agent: the same ones our own tests use.

- `ItemRecorder`: an ``on_item`` callback that keeps every streamed item.
- `call_tool`: run one call through a pipeline with generated ids.
- `FailingJournal`: an in-memory journal whose writes can be made to fail.
- `LeaseStub`: a lifecycle wrapper whose ownership can be revoked.
- `TestModel`, `Reply`, `open_test_model`: the deterministic model (also the demo's
  offline default): scripted replies keyed per conversation, or a function of the request.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs

from ._abort import AbortHandle
from ._errors import JournalError, LeaseLostError
from ._models._test_model import Reply, TestModel, conversation_key, open_test_model
from ._tools._context import CallOrigin, ToolCall
from ._tools._definition import SideEffect
from ._tools._lifecycle import InMemoryToolJournal, ScheduledCall, Settlement
from ._tools._pipeline import ToolExecutionRecord, ToolPipeline
from ._tools._results import JsonObject, ToolItem

__all__ = [
    "FailingJournal",
    "ItemRecorder",
    "LeaseStub",
    "Reply",
    "TestModel",
    "call_tool",
    "conversation_key",
    "open_test_model",
]

_ids = itertools.count(1)


@attrs.define
class ItemRecorder:
    """Use as ``on_item=recorder``; ``recorder.items`` keeps what arrived, in order."""

    items: list[ToolItem] = attrs.field(factory=list)

    async def __call__(self, item: ToolItem) -> None:
        self.items.append(item)


async def call_tool(
    pipeline: ToolPipeline,
    name: str,
    input: JsonObject | None = None,
    *,
    call_id: str | None = None,
    origin: CallOrigin | None = None,
    abort: AbortHandle | None = None,
    steering: AbortHandle | None = None,
    on_item: Any = None,
) -> ToolExecutionRecord:
    """Execute one call of *name* with *input*; ids are generated unless given."""
    call = ToolCall(call_id or f"call-{next(_ids)}", name, dict(input or {}))
    return await pipeline.execute(call, origin, abort=abort, steering=steering, on_item=on_item)


class FailingJournal(InMemoryToolJournal):
    """An `InMemoryToolJournal` whose writes fail on demand.

    Set ``fail_on`` to any of ``"scheduled"``, ``"started"``, ``"settled"``.
    """

    def __init__(self, *fail_on: str) -> None:
        super().__init__()
        self.fail_on = set(fail_on)

    async def on_tool_scheduled(self, call: ScheduledCall) -> None:
        if "scheduled" in self.fail_on:
            raise JournalError("injected failure writing tool_scheduled")
        await super().on_tool_scheduled(call)

    async def on_execution_started(
        self, call: ScheduledCall, input: JsonObject, side_effect: SideEffect, *, synthetic: bool
    ) -> None:
        if "started" in self.fail_on:
            raise JournalError("injected failure writing tool_started")
        await super().on_execution_started(call, input, side_effect, synthetic=synthetic)

    async def on_tool_settled(self, call: ScheduledCall, settlement: Settlement) -> None:
        if "settled" in self.fail_on:
            raise JournalError("injected failure writing the settlement")
        await super().on_tool_settled(call, settlement)


class LeaseStub(InMemoryToolJournal):
    """An in-memory journal with a fake lease: ``revoke()`` makes every ownership check fail."""

    def __init__(self, token: int = 1) -> None:
        super().__init__()
        self.token = token
        self.lost = False

    def revoke(self) -> None:
        self.lost = True

    def check_ownership(self) -> None:
        if self.lost:
            raise LeaseLostError("lease revoked by the test")

    def fencing_token(self) -> int | None:
        return self.token
