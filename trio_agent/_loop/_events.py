"""What a run tells the world: one event vocabulary for every face of the loop.

The events are AG-UI-shaped (run started / finished / error, step started /
finished, text message start / content / end, reasoning start / content / end,
tool call start / args / end / result, custom), as attrs values with snake_case
fields; the AG-UI face is an encoder of these. Every event carries the ``run_id``
and the ``agent_id`` it belongs to, so a subagent's events can interleave with
its parent's on one stream.

Order within a run::

    RunStarted
      ( StepStarted
          [ReasoningStart ReasoningContent* ReasoningEnd]*
          [TextMessageStart TextMessageContent* TextMessageEnd]
          [UsageReported]
          ( ToolCallStart ToolCallArgs ToolCallEnd  ToolCallProgress*  ToolCallResult )*
        StepFinished )*
    RunFinished | RunError

``CustomEvent`` may come anywhere. A run that pauses ends with ``MessagesSnapshot``
then ``RunFinished`` whose ``outcome`` is ``"interrupt"``.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import attrs

from .._models._messages import Message, Usage
from .._tools._results import ToolResult
from ._interrupts import Interrupt

__all__ = [
    "CustomEvent",
    "MessagesSnapshot",
    "ReasoningContent",
    "ReasoningEnd",
    "ReasoningStart",
    "RunError",
    "RunEvent",
    "RunFinished",
    "RunStarted",
    "StepFinished",
    "StepStarted",
    "TextMessageContent",
    "TextMessageEnd",
    "TextMessageStart",
    "ToolCallArgs",
    "ToolCallEnd",
    "ToolCallProgress",
    "ToolCallResult",
    "ToolCallStart",
    "UsageReported",
]


@attrs.frozen
class RunStarted:
    run_id: str
    agent_id: str
    thread_id: str


@attrs.frozen
class RunFinished:
    """The run ended without an error: ``outcome`` is its `StopReason` value, or ``"interrupt"``
    for a run that paused, with the batch in ``interrupts``."""

    run_id: str
    agent_id: str
    outcome: str
    text: str = ""
    interrupts: tuple[Interrupt, ...] = ()


@attrs.frozen
class MessagesSnapshot:
    """The whole conversation (without the system prompt); sent right before a pause's ``RunFinished``."""

    run_id: str
    agent_id: str
    messages: tuple[Message, ...]


@attrs.frozen
class RunError:
    run_id: str
    agent_id: str
    message: str
    code: str | None = None


@attrs.frozen
class StepStarted:
    """One turn (a model call and its tool phase); ``step`` is ``"turn-<n>"``."""

    run_id: str
    agent_id: str
    step: str


@attrs.frozen
class StepFinished:
    run_id: str
    agent_id: str
    step: str


@attrs.frozen
class TextMessageStart:
    run_id: str
    agent_id: str
    message_id: str


@attrs.frozen
class TextMessageContent:
    run_id: str
    agent_id: str
    message_id: str
    delta: str


@attrs.frozen
class TextMessageEnd:
    run_id: str
    agent_id: str
    message_id: str


@attrs.frozen
class ReasoningStart:
    run_id: str
    agent_id: str
    message_id: str


@attrs.frozen
class ReasoningContent:
    run_id: str
    agent_id: str
    message_id: str
    delta: str


@attrs.frozen
class ReasoningEnd:
    run_id: str
    agent_id: str
    message_id: str


@attrs.frozen
class ToolCallStart:
    run_id: str
    agent_id: str
    call_id: str
    tool_name: str
    parent_message_id: str | None = None


@attrs.frozen
class ToolCallArgs:
    run_id: str
    agent_id: str
    call_id: str
    delta: str


@attrs.frozen
class ToolCallEnd:
    """The call's arguments are complete; ``input`` is them parsed (or the raw text when they are
    not a JSON object: the call is then answered with an error and never runs)."""

    run_id: str
    agent_id: str
    call_id: str
    tool_name: str
    input: Any


@attrs.frozen
class ToolCallProgress:
    """A streamed item (progress or message) of a running call; never durable."""

    run_id: str
    agent_id: str
    call_id: str
    item: Any


@attrs.frozen
class ToolCallResult:
    """The call's answer, published after its settlement was committed."""

    run_id: str
    agent_id: str
    call_id: str
    tool_name: str
    result: ToolResult


@attrs.frozen
class UsageReported:
    run_id: str
    agent_id: str
    usage: Usage


@attrs.frozen
class CustomEvent:
    run_id: str
    agent_id: str
    name: str
    value: Any = None


RunEvent: TypeAlias = (
    RunStarted
    | RunFinished
    | RunError
    | StepStarted
    | StepFinished
    | TextMessageStart
    | TextMessageContent
    | TextMessageEnd
    | ReasoningStart
    | ReasoningContent
    | ReasoningEnd
    | ToolCallStart
    | ToolCallArgs
    | ToolCallEnd
    | ToolCallProgress
    | ToolCallResult
    | UsageReported
    | CustomEvent
    | MessagesSnapshot
)
