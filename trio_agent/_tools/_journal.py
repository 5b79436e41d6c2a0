"""The journal outlet of the tool pipeline.

The pipeline reports each call to a `ToolJournal`:

    on_tool_scheduled  -> (ownership check) -> on_execution_started -> (ownership check) -> on_tool_settled

``on_tool_scheduled`` is awaited before anyone sees the call, ``on_execution_started``
with the FINAL input before the side effect starts, ``on_tool_settled`` before the
result is published. The durable journal implements this protocol; the
`InMemoryToolJournal` here is the default and keeps events in a list.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from .._builders import constructor
from .._errors import JournalError
from ._definition import SideEffect, ToolBehavior
from ._results import JsonObject, ToolResult, json_copy

__all__ = [
    "InMemoryToolJournal",
    "JournalEntry",
    "ScheduledCall",
    "Settlement",
    "SettlementStatus",
    "ToolJournal",
]


class SettlementStatus(enum.Enum):
    """How a tool call ended, as the journal records it."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    OUTCOME_UNKNOWN = "outcome_unknown"


@attrs.frozen
class ScheduledCall:
    """A call as scheduled: model input, resolved behaviour and idempotency key."""

    call_id: str
    tool_name: str
    model_input: JsonObject
    behavior: ToolBehavior
    idempotency_key: str
    session_id: str
    agent_id: str
    request_id: str
    turn_id: str


@attrs.frozen
class Settlement:
    """The final outcome of a call.

    ``published`` is False when the result was persisted but withheld from the
    model and the stream (the middleware unwind missed its deadline after the core
    completed, so transforms such as redaction could not be applied).
    ``reason`` says why a call was cancelled.
    """

    status: SettlementStatus
    result: ToolResult
    effective_input: JsonObject | None
    published: bool = True
    reason: str | None = None


# The pipeline builds one of each per call: built cheaper (see `_builders`), every field given.
scheduled_call: Callable[[str, str, JsonObject, ToolBehavior, str, str, str, str, str], ScheduledCall] = constructor(
    ScheduledCall
)
settlement: Callable[[SettlementStatus, ToolResult, JsonObject | None, bool, str | None], Settlement] = constructor(
    Settlement
)


class ToolJournal(Protocol):
    """What the pipeline needs from a journal.

    Settlement writes run in a shielded scope bounded by the pipeline's
    ``settle_grace``, unless the journal's class itself declares
    ``never_blocks = True`` (or a ``never_blocks`` property that is true for the
    instance) to promise that its settlement (`on_tool_settled`) never checkpoints:
    then nothing could interrupt it anyway. Subclasses do not inherit the promise.
    """

    def check_ownership(self) -> None:
        """Raise `LeaseLostError` if this worker no longer owns the execution lease."""

    def fencing_token(self) -> int | None:
        """The current lease's fencing token, if there is a lease."""

    async def ensure_owner(self) -> None:
        """Confirm ownership with the store now (raise `LeaseLostError` if it is gone)."""

    async def on_tool_scheduled(self, call: ScheduledCall) -> None: ...

    async def on_execution_started(
        self, call: ScheduledCall, input: JsonObject, side_effect: SideEffect, *, synthetic: bool
    ) -> None: ...

    async def on_tool_settled(self, call: ScheduledCall, settlement: Settlement) -> None: ...

    def call_state(self, call: ScheduledCall) -> str | None:
        """Where the journal holds *call* now: ``"scheduled"`` (it may start), ``"started"``,
        ``"settled"``, or ``None`` (not held).

        The pipeline asks after a write raised (a cancellation can land while a
        write is being confirmed): a call the journal holds open is then settled,
        so none stays open for ever. A journal without this method is treated as
        holding a call whose write was interrupted by a cancellation.
        """


class JournalEntry:
    """One event of the in-memory journal: ``kind`` is ``scheduled``, ``started`` or ``settled``.

    A plain class: the journal makes three per call (frozen attrs would cost a call per field).
    """

    __slots__ = ("call_id", "data", "kind")

    def __init__(self, kind: str, call_id: str, data: dict[str, Any]) -> None:
        self.kind = kind
        self.call_id = call_id
        self.data = data

    def __repr__(self) -> str:
        return f"JournalEntry(kind={self.kind!r}, call_id={self.call_id!r}, data={self.data!r})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not JournalEntry:
            return NotImplemented
        return (self.kind, self.call_id, self.data) == (other.kind, other.call_id, other.data)

    __hash__ = None  # type: ignore[assignment]  # like its data, a dict: compared, never hashed


class InMemoryToolJournal:
    """A non-durable `ToolJournal` that checks the call lifecycle and keeps events in a list.

    It rejects invalid transitions (started twice, settled twice, completed
    without a start) with `JournalError`, so a pipeline bug cannot hide.
    ``keep_entries=False`` checks the lifecycle only and keeps no events (`entries`
    stays empty): for a pipeline whose journal nobody reads.
    """

    never_blocks = True  # no method awaits anything: settlement needs no shield
    # And a write that raises has changed nothing: the pipeline need not probe the call's state around it.
    _atomic_writes = True

    def __init__(self, *, keep_entries: bool = True) -> None:
        self.entries: list[JournalEntry] = []
        self._state: dict[str, str] = {}
        self._keep = keep_entries

    def check_ownership(self) -> None:
        return None

    def fencing_token(self) -> int | None:
        return None

    async def ensure_owner(self) -> None:
        await trio.lowlevel.checkpoint()

    async def on_tool_scheduled(self, call: ScheduledCall) -> None:
        if call.call_id in self._state:
            raise JournalError(f"tool call {call.call_id!r} was already scheduled")
        self._state[call.call_id] = "scheduled"
        if not self._keep:
            return
        self.entries.append(
            JournalEntry(
                "scheduled",
                call.call_id,
                {
                    "tool": call.tool_name,
                    "input": json_copy(call.model_input),
                    # `_value_` (the enum's documented slot) rather than the `value` property: no call.
                    "side_effect": call.behavior.side_effect._value_,
                },
            )
        )

    async def on_execution_started(
        self, call: ScheduledCall, input: JsonObject, side_effect: SideEffect, *, synthetic: bool
    ) -> None:
        state = self._state.get(call.call_id)
        if state != "scheduled":
            raise JournalError(f"tool call {call.call_id!r} cannot start from state {state!r}")
        self._state[call.call_id] = "started"
        if not self._keep:
            return
        self.entries.append(
            JournalEntry(
                "started",
                call.call_id,
                {"input": json_copy(input), "side_effect": side_effect._value_, "synthetic": synthetic},
            )
        )

    def call_state(self, call: ScheduledCall) -> str | None:
        return self._state.get(call.call_id)

    async def on_tool_settled(self, call: ScheduledCall, settlement: Settlement) -> None:
        state = self._state.get(call.call_id)
        if state not in ("scheduled", "started"):
            raise JournalError(f"tool call {call.call_id!r} cannot settle from state {state!r}")
        if settlement.status is SettlementStatus.COMPLETED and state != "started":
            raise JournalError(f"tool call {call.call_id!r} completed without a recorded start")
        self._state[call.call_id] = "settled"
        if not self._keep:
            return
        self.entries.append(
            JournalEntry(
                "settled",
                call.call_id,
                {
                    "status": settlement.status._value_,
                    "result": settlement.result,
                    "published": settlement.published,
                    "reason": settlement.reason,
                },
            )
        )

    def kinds(self, call_id: str) -> list[str]:
        """The event kinds recorded for one call, in order (for tests)."""
        return [entry.kind for entry in self.entries if entry.call_id == call_id]
