"""What `Session.stream` yields: session messages, one frozen class each.

Every message names the agent it comes from (``"root"`` or a subagent id), so
one stream can carry a root agent and its foreground subagents interleaved.
"""

from __future__ import annotations

import enum
from typing import Any, TypeAlias

import attrs

from .._loop._interrupts import Interrupt
from .._loop._rules import StopReason
from .._models._messages import Usage
from .._tools._results import ToolResult

__all__ = [
    "DoneEvent",
    "PausedReply",
    "PermissionDeniedEvent",
    "SessionEvent",
    "SubagentEvent",
    "SubagentStatus",
    "TextDeltaEvent",
    "ToolProgressEvent",
    "ToolResultEvent",
    "ToolUseEvent",
    "UsageEvent",
]


@attrs.frozen
class TextDeltaEvent:
    agent_id: str
    text: str


@attrs.frozen
class ToolUseEvent:
    """The model asked for a tool call (before it runs)."""

    agent_id: str
    call_id: str
    tool_name: str
    input: Any


@attrs.frozen
class ToolProgressEvent:
    """A streamed item (progress or message) of a running tool call; never durable."""

    agent_id: str
    call_id: str
    item: Any


@attrs.frozen
class ToolResultEvent:
    """A tool call's published result (after its settlement was committed)."""

    agent_id: str
    call_id: str
    tool_name: str
    result: ToolResult


@attrs.frozen
class PermissionDeniedEvent:
    """A tool call was refused in a way the user should hear about, not only the model.

    ``reason`` is ``"no_handler"``: the call needed permission and the session
    has no permission handler to ask (its result's ``error.code`` is
    ``"no_handler"``). ``message`` is what the model was told, with the fix.
    """

    agent_id: str
    call_id: str
    tool: str
    reason: str
    message: str = ""


class SubagentStatus(enum.Enum):
    RUNNING = "running"
    IDLE = "idle"  # its current work was cancelled; it can be resumed
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"  # killed: final


@attrs.frozen
class SubagentEvent:
    """A subagent of ``agent_id`` started, finished, failed or was cancelled."""

    agent_id: str
    subagent_id: str
    name: str
    status: SubagentStatus
    background: bool
    summary: str = ""


@attrs.frozen
class UsageEvent:
    agent_id: str
    usage: Usage


@attrs.frozen
class DoneEvent:
    """The request ended, and why (`StopReason`: ``END_TURN``, ``MAX_TURNS``, ``ABORTED``, ``ERROR``, ...)."""

    request_id: str
    text: str
    stop_reason: StopReason
    turns: int
    error: str | None = None
    interrupts: tuple[Interrupt, ...] = ()  # stop reason ``interrupted``: the questions it waits for
    error_code: str | None = None  # a failure's error code where it has one (``rate_limited`` ...)


class PausedReply(str):
    """What ``send()`` / ``resume()`` return when the request paused: the text so far (it is a
    ``str``), with ``paused`` (the `PausedRun`) and ``interrupts`` (the questions)."""

    paused: Any
    interrupts: tuple[Interrupt, ...]

    def __new__(cls, text: str, paused: Any) -> PausedReply:
        reply = super().__new__(cls, text)
        reply.paused = paused
        reply.interrupts = paused.state.interrupts
        return reply


SessionEvent: TypeAlias = (
    TextDeltaEvent
    | ToolUseEvent
    | ToolProgressEvent
    | ToolResultEvent
    | PermissionDeniedEvent
    | SubagentEvent
    | UsageEvent
    | DoneEvent
)
