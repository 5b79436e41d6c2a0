"""A session request's events as AG-UI events (a web thread backed by a durable session).

A session streams `SessionEvent` s, coarser than the loop's: text deltas per agent,
a tool call once its input is final, results, subagent status, usage, the end.

Rules
=====

* `start` is ``RUN_STARTED``; the request's ``DoneEvent`` (or `aborted`, for a request
  whose stream ended with `RequestAbortedError` because it was stopped) is ``RUN_FINISHED``
  (outcome ``interrupt`` with the interrupts for a pause, ``cancelled`` for an abort, else
  ``success``; result ``{stopReason, text}``; the usage summed) or, for an error (a
  ``DoneEvent`` with one, or `failed` for a stream that raised it), ``RUN_ERROR``. Text
  messages still open are ended first.
* Text deltas of an agent open a text message (id ``<run id>-t<n>``) that stays open
  until that agent's next tool call or the end: one message per stretch of text.
* ``ToolUseEvent`` is ``TOOL_CALL_START``, ``TOOL_CALL_ARGS`` (the final input as
  JSON), ``TOOL_CALL_END``; ``ToolResultEvent`` is ``TOOL_CALL_RESULT`` (the text the
  model reads); progress and permission denials are ``CUSTOM`` events
  (``trio_agent.tool_progress``, ``trio_agent.permission_denied``).
* A subagent (``SubagentEvent``): running is ``SUBAGENT_STARTED``, completed
  ``SUBAGENT_FINISHED`` (result ``{summary}``), failed or cancelled ``SUBAGENT_ERROR``
  (idle is a ``CUSTOM`` ``trio_agent.subagent_idle``); events of an agent other than the
  root carry its id as ``subagentRunId``.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from .._loop._rules import StopReason, model_text
from .._models._messages import Usage
from .._session._messages import (
    DoneEvent,
    PermissionDeniedEvent,
    SubagentEvent,
    SubagentStatus,
    TextDeltaEvent,
    ToolProgressEvent,
    ToolResultEvent,
    ToolUseEvent,
    UsageEvent,
)
from . import _wire as w
from ._encode import TOOL_PROGRESS, interrupt_to_agui, usage_to_agui

__all__ = ["SessionAgUiEncoder"]

PERMISSION_DENIED = "trio_agent.permission_denied"
SUBAGENT_IDLE = "trio_agent.subagent_idle"


class SessionAgUiEncoder:
    """Turns one session request's events into AG-UI events (see the module rules)."""

    def __init__(self, *, thread_id: str, run_id: str, root_agent_id: str) -> None:
        self.thread_id = thread_id
        self.run_id = run_id
        self.root_agent_id = root_agent_id
        self._open: dict[str, str] = {}  # agent id -> its open text message
        self._ids = itertools.count(1)
        self._usage: list[Usage] = []

    def _sub(self, agent_id: str) -> str | None:
        return None if agent_id == self.root_agent_id else agent_id

    def _close(self, agent_id: str) -> list[w.AgUiEvent]:
        message_id = self._open.pop(agent_id, None)
        return (
            []
            if message_id is None
            else [w.TextMessageEndEvent(message_id=message_id, subagent_run_id=self._sub(agent_id))]
        )

    def start(self) -> list[w.AgUiEvent]:
        return [w.RunStartedEvent(thread_id=self.thread_id, run_id=self.run_id)]

    def encode(self, event: object) -> list[w.AgUiEvent]:
        match event:
            case TextDeltaEvent(agent_id=agent, text=text):
                sub = self._sub(agent)
                out: list[w.AgUiEvent] = []
                if agent not in self._open:
                    self._open[agent] = message_id = f"{self.run_id}-t{next(self._ids)}"
                    out.append(w.TextMessageStartEvent(message_id=message_id, subagent_run_id=sub))
                if text:
                    out.append(w.TextMessageContentEvent(message_id=self._open[agent], delta=text, subagent_run_id=sub))
                return out
            case ToolUseEvent(agent_id=agent, call_id=call_id, tool_name=name, input=given):
                sub = self._sub(agent)
                return [
                    *self._close(agent),
                    w.ToolCallStartEvent(tool_call_id=call_id, tool_call_name=name, subagent_run_id=sub),
                    w.ToolCallArgsEvent(
                        tool_call_id=call_id, delta=json.dumps(w.json_value(given)), subagent_run_id=sub
                    ),
                    w.ToolCallEndEvent(tool_call_id=call_id, subagent_run_id=sub),
                ]
            case ToolResultEvent(agent_id=agent, call_id=call_id, result=result):
                return [
                    w.ToolCallResultEvent(
                        message_id=f"{call_id}:result",
                        tool_call_id=call_id,
                        content=model_text(result),
                        subagent_run_id=self._sub(agent),
                    )
                ]
            case ToolProgressEvent(agent_id=agent, call_id=call_id, item=item):
                value = {"toolCallId": call_id, "item": w.json_value(item)}
                return [w.CustomEvent(name=TOOL_PROGRESS, value=value, subagent_run_id=self._sub(agent))]
            case PermissionDeniedEvent():
                value = {
                    "toolCallId": event.call_id,
                    "tool": event.tool,
                    "reason": event.reason,
                    "message": event.message,
                }
                return [w.CustomEvent(name=PERMISSION_DENIED, value=value, subagent_run_id=self._sub(event.agent_id))]
            case SubagentEvent():
                return self._subagent(event)
            case UsageEvent(usage=usage):
                self._usage.append(usage)
                return []
            case DoneEvent():
                return self._done(event)
        return []

    def _subagent(self, event: SubagentEvent) -> list[w.AgUiEvent]:
        sub = event.subagent_id
        if event.status is SubagentStatus.RUNNING:
            description = "background" if event.background else "foreground"
            return [w.SubagentStartedEvent(subagent_run_id=sub, name=event.name, description=description)]
        if event.status is SubagentStatus.COMPLETED:
            return [
                *self._close(sub),
                w.SubagentFinishedEvent(
                    subagent_run_id=sub, result={"summary": event.summary}, outcome=w.SubagentOutcome(type="success")
                ),
            ]
        if event.status is SubagentStatus.IDLE:
            return [w.CustomEvent(name=SUBAGENT_IDLE, value={"subagentRunId": sub, "summary": event.summary})]
        message = event.summary or f"the subagent {event.status.value}"
        return [*self._close(sub), w.SubagentErrorEvent(subagent_run_id=sub, message=message, code=event.status.value)]

    def aborted(self) -> list[w.AgUiEvent]:
        """The end of a request that was aborted (the session's stream raises instead of a ``DoneEvent``)."""
        return self._done(DoneEvent("", "", StopReason.ABORTED, 0))

    def failed(self, message: str, code: str) -> list[w.AgUiEvent]:
        """The end of a request that failed (the session's stream raises instead of a ``DoneEvent``)."""
        out: list[w.AgUiEvent] = []
        for agent in list(self._open):
            out.extend(self._close(agent))
        return [*out, w.RunErrorEvent(message=message, code=code)]

    def _done(self, event: DoneEvent) -> list[w.AgUiEvent]:
        out: list[w.AgUiEvent] = []
        for agent in list(self._open):
            out.extend(self._close(agent))
        if event.error is not None:
            out.append(w.RunErrorEvent(message=event.error, code=event.stop_reason.value))
            return out
        if event.stop_reason is StopReason.INTERRUPTED:
            outcome = w.RunOutcome(
                type="interrupt", interrupts=tuple(interrupt_to_agui(i, None) for i in event.interrupts)
            )
        elif event.stop_reason is StopReason.ABORTED:
            outcome = w.RunOutcome(type="cancelled")
        else:
            outcome = w.RunOutcome(type="success")
        result: dict[str, Any] = {"stopReason": event.stop_reason.value, "text": event.text}
        out.append(
            w.RunFinishedEvent(
                thread_id=self.thread_id,
                run_id=self.run_id,
                outcome=outcome,
                result=result,
                usage=usage_to_agui(self._usage),
            )
        )
        return out
