"""Repairs to a conversation before it goes to a model.

Rules
=====

* Every `ToolCallPart` of an `AssistantMessage` needs a `ToolResultMessage` with
  its id somewhere in the history; providers refuse a call left unanswered. A
  call without one (its run was interrupted, its result never published) gets
  an error answer right after its assistant message, in call order, ahead of
  any answers already there.
* Nothing else changes: messages keep their order and identity.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._messages import AssistantMessage, Message, ToolCallPart, ToolResultMessage

__all__ = ["ORPHAN_ANSWER", "answer_orphan_calls"]

ORPHAN_ANSWER = "no result was recorded (interrupted)"
"""The answer (an error) of a call that has none."""


def answer_orphan_calls(history: Iterable[Message]) -> list[Message]:
    """``history`` with every unanswered tool call answered (see the module rules)."""
    messages = list(history)
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolResultMessage)}
    out: list[Message] = []
    for message in messages:
        out.append(message)
        if isinstance(message, AssistantMessage):
            for part in message.parts:
                if isinstance(part, ToolCallPart) and part.id not in answered:
                    out.append(ToolResultMessage(part.id, ORPHAN_ANSWER, is_error=True))
    return out
