"""Helpers for testing code built on trio_agent: the same ones our own tests use.

- `ItemRecorder`: an ``on_item`` callback that keeps every streamed item.
- `call_tool`: run one call through a pipeline with generated ids.
- `FailingJournal`: an in-memory journal whose writes can be made to fail.
- `LeaseStub`: an in-memory tool journal whose ownership can be revoked.
- `TestModel`, `Reply`, `open_test_model`: the deterministic model (also the demo's
  offline default): scripted replies keyed per conversation, or a function of the request.
- `start_turn`: write the request and turn events a durable journal needs before
  tool calls (what a session does), returning the `CallOrigin` for the calls.
- `FaultyStore`: wraps any journal store and makes writes fail before or after
  the commit, or hang, on demand (the "store fails mid-write" cases).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Self

import attrs

from ._abort import AbortHandle
from ._config import validate_limit
from ._errors import ConfigError, JournalError, JournalUnavailableError, LeaseLostError
from ._journal._durable import DurableJournal
from ._journal._events import RequestAccepted, RequestStarted, TurnStarted
from ._journal._store import AppendBatch, AppendResult, AppendTicket, JournalStore
from ._models._test_model import Reply, TestModel, conversation_key, open_test_model
from ._tools._context import CallOrigin, ToolCall
from ._tools._definition import SideEffect
from ._tools._journal import InMemoryToolJournal, ScheduledCall, Settlement
from ._tools._pipeline import ToolExecutionRecord, ToolPipeline
from ._tools._results import JsonObject, ToolItem
from ._util import fixup_module_metadata as _fixup_module_metadata
from ._util import safe_repr

__all__ = [
    "FailingJournal",
    "FaultyStore",
    "ItemRecorder",
    "LeaseStub",
    "Reply",
    "TestModel",
    "call_tool",
    "conversation_key",
    "open_test_model",
    "start_turn",
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
    # A mapping is copied (the call's own, as the loop's are); anything else goes as it is, for
    # ToolCall to refuse typed (ToolInputError) where dict() raised a raw ValueError or TypeError.
    arguments = {} if input is None else dict(input) if isinstance(input, Mapping) else input
    call = ToolCall(call_id or f"call-{next(_ids)}", name, arguments)
    return await pipeline.execute(call, origin, abort=abort, steering=steering, on_item=on_item)


_FAILURE_POINTS = ("scheduled", "started", "settled")


def _failure_point(name: object) -> str:
    """*name*, if `FailingJournal` checks it; else a `ConfigError`, not a journal that silently
    never fails (``"setled"``)."""
    if not isinstance(name, str) or name not in _FAILURE_POINTS:
        raise ConfigError(f"FailingJournal fails on {', '.join(map(repr, _FAILURE_POINTS))}, not {safe_repr(name)}")
    return name


class _FailurePoints(set[str]):
    """`FailingJournal.fail_on`: a set whose every way of adding a name checks it (``fail_on.add``
    too, not only an assignment). A refused name changes nothing."""

    def add(self, name: str) -> None:
        super().add(_failure_point(name))

    def update(self, *others: Iterable[str]) -> None:
        super().update([_failure_point(name) for other in others for name in other])

    def __ior__(self, other: AbstractSet[str]) -> Self:  # type: ignore[override,misc]
        self.update(other)
        return self

    def symmetric_difference_update(self, other: Iterable[str]) -> None:
        super().symmetric_difference_update([_failure_point(name) for name in other])

    def __ixor__(self, other: AbstractSet[str]) -> Self:  # type: ignore[override,misc]
        self.symmetric_difference_update(other)
        return self


class FailingJournal(InMemoryToolJournal):
    """An `InMemoryToolJournal` whose writes fail on demand.

    Set ``fail_on`` to any of ``"scheduled"``, ``"started"``, ``"settled"`` (another name is a
    `ConfigError`, given here or assigned to ``fail_on`` later).
    """

    def __init__(self, *fail_on: str) -> None:
        super().__init__()
        self.fail_on = fail_on

    @property
    def fail_on(self) -> set[str]:
        return self._fail_on  # a _FailurePoints: fail_on.add("setled") is refused as well

    @fail_on.setter
    def fail_on(self, names: Iterable[str]) -> None:
        if isinstance(names, str):  # one name, not its letters
            names = (names,)
        elif not isinstance(names, Iterable):
            raise ConfigError(f"FailingJournal.fail_on must be a set of names, got {safe_repr(names)}")
        self._fail_on = _FailurePoints(map(_failure_point, names))

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


async def start_turn(
    journal: DurableJournal,
    *,
    request_id: str = "request",
    turn_id: str = "turn",
    turn: int = 1,
    agent_id: str | None = None,
    prompt: str = "test",
) -> CallOrigin:
    """Record an accepted, started request and an open turn (as a session does) and return its origin."""
    projection = journal.projection(agent_id)
    events: list[Any] = []
    if projection.request(request_id) is None:
        events += [
            RequestAccepted(request_id=request_id, command_id=f"cmd-{request_id}", input={"prompt": prompt}),
            RequestStarted(request_id=request_id),
        ]
    events.append(TurnStarted(request_id=request_id, turn_id=turn_id, turn=turn))
    await journal.append(*events, agent_id=agent_id)
    return CallOrigin(
        session_id=journal.session_id,
        agent_id=agent_id or journal.root_agent_id,
        request_id=request_id,
        turn_id=turn_id,
    )


class FaultyStore:
    """A journal store wrapper whose next writes fail on demand; everything else passes through.

    ``fail_next(mode, count=1)`` arms the next ``count`` appends:

    * ``"before"``: refused before reaching the store (nothing written), raising
      `JournalUnavailableError`;
    * ``"after"``: written and committed, then `JournalUnavailableError` is raised
      anyway: the caller cannot know the outcome;
    * ``"hang"``: never answers (until the caller's deadline or cancellation);
      nothing is written.

    Another mode, or a ``count`` that is not a whole number >= 1, is a `ConfigError`.
    """

    def __init__(self, inner: JournalStore) -> None:
        self.inner = inner
        self.clock = inner.clock
        self._armed: list[str] = []
        self.failed = 0

    def fail_next(self, mode: str, count: int = 1) -> None:
        # Checked here: a count of -3 armed nothing and "2" raised a raw TypeError.
        if not isinstance(mode, str) or mode not in ("before", "after", "hang"):
            raise ConfigError(f"unknown fault mode {safe_repr(mode)} (give 'before', 'after' or 'hang')")
        self._armed.extend([mode] * validate_limit(count, name="FaultyStore.fail_next count"))

    def submit(self, batch: AppendBatch) -> AppendTicket:
        if not self._armed:
            return self.inner.submit(batch)
        mode = self._armed.pop(0)
        self.failed += 1
        ticket = AppendTicket(batch)
        if mode == "before":
            ticket._resolve(JournalUnavailableError("injected store failure before the write"))
        elif mode == "after":
            return _CommittedThenFailed(batch, self.inner.submit(batch))
        return ticket

    async def append(self, batch: AppendBatch) -> AppendResult:
        return await self.submit(batch).wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _CommittedThenFailed(AppendTicket):
    """Waits for the real commit, then reports a failure: the outcome looks unknown."""

    def __init__(self, batch: AppendBatch, inner: AppendTicket) -> None:
        super().__init__(batch)
        self._inner = inner

    @property
    def done(self) -> bool:
        return self._inner.done

    def outcome(self) -> AppendResult:
        raise JournalUnavailableError("injected store failure after the commit: outcome unknown")

    async def wait(self) -> AppendResult:
        with contextlib.suppress(JournalError):
            await self._inner.wait()
        return self.outcome()


_fixup_module_metadata(__name__, globals())
