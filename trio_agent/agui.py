"""AG-UI: a run's events in the Agent User Interaction protocol, and their SSE framing.

`AgUiEncoder` turns the loop's `RunEvent` s (what ``chat()`` yields) into AG-UI
events; `to_wire` gives each one's JSON (camelCase, with its ``type``), and
`sse_event` frames it for a ``text/event-stream`` response::

    from trio_agent import chat
    from trio_agent.agui import AgUiEncoder, sse_event

    async with chat(model, "hi") as run:
        encoder = AgUiEncoder(thread_id="t1")
        async for event in run:
            for data in encoder.wire(event):
                await send(sse_event(data))

The mapping, loop event by loop event, is in ``docs/web.md``.
"""

from __future__ import annotations

from ._agui._encode import TOOL_PROGRESS, AgUiEncoder, messages_to_agui, usage_to_agui
from ._agui._sse import CONTENT_TYPE, KEEP_ALIVE, sse_comment, sse_event
from ._agui._wire import (
    PROTOCOL_VERSION,
    AgUiEvent,
    AgUiMessage,
    AssistantMessage,
    CustomEvent,
    FunctionCall,
    Interrupt,
    MessagesSnapshotEvent,
    ReasoningEndEvent,
    ReasoningMessageContentEvent,
    ReasoningMessageEndEvent,
    ReasoningMessageStartEvent,
    ReasoningStartEvent,
    RunErrorEvent,
    RunFinishedEvent,
    RunOutcome,
    RunStartedEvent,
    StepFinishedEvent,
    StepStartedEvent,
    SubagentErrorEvent,
    SubagentFinishedEvent,
    SubagentOutcome,
    SubagentStartedEvent,
    SystemMessage,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    TokenUsage,
    ToolCall,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
    ToolMessage,
    UserMessage,
    json_value,
    to_wire,
)
from ._util import fixup_module_metadata as _fixup_module_metadata

__all__ = [
    "CONTENT_TYPE",
    "KEEP_ALIVE",
    "PROTOCOL_VERSION",
    "TOOL_PROGRESS",
    "AgUiEncoder",
    "AgUiEvent",
    "AgUiMessage",
    "AssistantMessage",
    "CustomEvent",
    "FunctionCall",
    "Interrupt",
    "MessagesSnapshotEvent",
    "ReasoningEndEvent",
    "ReasoningMessageContentEvent",
    "ReasoningMessageEndEvent",
    "ReasoningMessageStartEvent",
    "ReasoningStartEvent",
    "RunErrorEvent",
    "RunFinishedEvent",
    "RunOutcome",
    "RunStartedEvent",
    "StepFinishedEvent",
    "StepStartedEvent",
    "SubagentErrorEvent",
    "SubagentFinishedEvent",
    "SubagentOutcome",
    "SubagentStartedEvent",
    "SystemMessage",
    "TextMessageContentEvent",
    "TextMessageEndEvent",
    "TextMessageStartEvent",
    "TokenUsage",
    "ToolCall",
    "ToolCallArgsEvent",
    "ToolCallEndEvent",
    "ToolCallResultEvent",
    "ToolCallStartEvent",
    "ToolMessage",
    "UserMessage",
    "json_value",
    "messages_to_agui",
    "sse_comment",
    "sse_event",
    "to_wire",
    "usage_to_agui",
]

_fixup_module_metadata(__name__, globals())
