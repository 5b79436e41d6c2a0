"""The loop's events as AG-UI events: one encoder per run stream.

Rules
=====

* The root run is the one named when the encoder is made (else the first
  ``RunStarted``); its ``RunStarted`` / ``RunFinished`` / ``RunError`` are
  ``RUN_STARTED`` / ``RUN_FINISHED`` / ``RUN_ERROR``. Any other run on the stream
  is a subagent's: ``SUBAGENT_STARTED`` / ``SUBAGENT_FINISHED`` /
  ``SUBAGENT_ERROR``, and each of its events carries ``subagentRunId`` (its run
  id), so interleaved runs stay apart. A run's first event opens it on the wire
  whatever it is: a ``CustomEvent`` may come before its ``RunStarted`` (a
  middleware's ``on_start`` emits one), and AG-UI wants ``RUN_STARTED`` first, so
  such an event is preceded by the ``RUN_STARTED`` (``SUBAGENT_STARTED``) and the
  ``RunStarted`` that follows adds nothing.
* ``RunFinished``: outcome ``interrupt`` is an ``interrupt`` outcome with the
  run's interrupts (a subagent: ``suspended`` with their ids); ``aborted`` is
  ``cancelled``; every other stop reason is ``success``, the stop reason in
  ``result.stopReason`` and the final text in ``result.text``. The usage the run
  reported (``UsageReported``, one per model call) is summed into ``usage``.
* Reasoning: ``ReasoningStart`` is ``REASONING_START`` then
  ``REASONING_MESSAGE_START``, ``ReasoningEnd`` the two ends in reverse. Each
  reasoning block has its own message id, ``<message id>:reasoning-<n>`` (``n``
  counts the stream's blocks): the loop gives a turn's reasoning and its text one
  message id, and an AG-UI client keeps one message per id, so a shared id would
  fold the answer into a reasoning message (which the next request's history
  leaves out).
* ``ToolCallResult`` is ``TOOL_CALL_RESULT`` with the text the model reads of
  the result, message id ``<call id>:result``; ``ToolCallProgress`` (no AG-UI
  counterpart) is ``CUSTOM`` named ``trio_agent.tool_progress``.
* ``MessagesSnapshot`` is ``MESSAGES_SNAPSHOT``, a message's id its position
  (``m0``, ``m1`` ...; reasoning parts are left out).
* A run's terminal event is its last: AG-UI refuses a stream with anything after
  ``RUN_FINISHED`` / ``RUN_ERROR``. So once the root run has ended, every later event
  (of any run) is dropped, and once a subagent's run has ended, its own later events
  are: a middleware's ``on_finish`` / ``on_error`` or a deferred function may emit
  after the loop sent its ``RunFinished`` / ``RunError``. The first event dropped of a
  run is logged (WARNING, on ``trio_agent.agui``), the rest at DEBUG. A host that
  wants such events delivered holds the root run's terminal event back until the
  run's events end and encodes it last (the web endpoint does).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from .._loop._events import (
    CustomEvent,
    MessagesSnapshot,
    ReasoningContent,
    ReasoningEnd,
    ReasoningStart,
    RunError,
    RunEvent,
    RunFinished,
    RunStarted,
    StepFinished,
    StepStarted,
    TextMessageContent,
    TextMessageEnd,
    TextMessageStart,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallProgress,
    ToolCallResult,
    ToolCallStart,
    UsageReported,
)
from .._loop._interrupts import Interrupt
from .._loop._rules import model_text
from .._models._messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolResultMessage,
    Usage,
    UserMessage,
)
from . import _wire as w

__all__ = ["AgUiEncoder", "interrupt_to_agui", "messages_to_agui", "usage_to_agui"]

TOOL_PROGRESS = "trio_agent.tool_progress"

logger = logging.getLogger("trio_agent.agui")


def messages_to_agui(messages: Iterable[Message]) -> tuple[w.AgUiMessage, ...]:
    """A conversation as AG-UI messages, ids by position (``m0``, ``m1`` ...)."""
    out: list[w.AgUiMessage] = []
    for index, message in enumerate(messages):
        mid = f"m{index}"
        if isinstance(message, UserMessage):
            out.append(w.UserMessage(id=mid, content=message.content))
        elif isinstance(message, SystemMessage):
            out.append(w.SystemMessage(id=mid, content=message.content))
        elif isinstance(message, ToolResultMessage):
            error = message.content if message.is_error else None
            out.append(w.ToolMessage(id=mid, content=message.content, tool_call_id=message.tool_call_id, error=error))
        elif isinstance(message, AssistantMessage):
            calls = tuple(
                w.ToolCall(id=call.id, function=w.FunctionCall(name=call.name, arguments=call.arguments))
                for call in message.tool_calls
            )
            out.append(w.AssistantMessage(id=mid, content=message.text or None, tool_calls=calls or None))
    return tuple(out)


def usage_to_agui(usage: Sequence[Usage], model: str | None = None) -> tuple[w.TokenUsage, ...] | None:
    """The usage of a run's model calls, summed (``None`` if none was reported)."""
    if not usage:
        return None
    total = usage[0]
    for more in usage[1:]:
        total = total + more
    return (
        w.TokenUsage(
            model=model,
            input_tokens=total.input_tokens,
            output_tokens=total.output_tokens,
            total_tokens=sum(u.total_tokens or u.input_tokens + u.output_tokens for u in usage),
            reasoning_tokens=total.reasoning_tokens,
            cached_input_tokens=total.cached_input_tokens,
        ),
    )


def interrupt_to_agui(interrupt: Interrupt, subagent_run_id: str | None = None) -> w.Interrupt:
    """One of our interrupts as AG-UI's (what it has no field for goes in ``metadata``)."""
    metadata = {
        "kind": interrupt.kind.value,
        "toolName": interrupt.tool_name,
        "input": interrupt.input,
        "definitionId": interrupt.definition_id,
        "key": interrupt.key,
        "payload": interrupt.payload,
    }
    return w.Interrupt(
        id=interrupt.id,
        reason=interrupt.reason or interrupt.kind.value,
        message=interrupt.message or None,
        tool_call_id=interrupt.tool_call_id,
        response_schema=w.json_value(interrupt.response_schema) if interrupt.response_schema is not None else None,
        metadata=w.json_value({key: value for key, value in metadata.items() if value is not None}),
        subagent_run_id=subagent_run_id,
    )


class AgUiEncoder:
    """Turns one stream of `RunEvent` s into AG-UI events (see the module rules).

    ``encode(event)`` gives the AG-UI events for one loop event (none, one or two),
    in order; `to_wire` gives their JSON. Keep one encoder per stream: it remembers
    the root run, each run's usage and the runs that ended (their later events are
    dropped: see the module rules).
    """

    def __init__(self, *, thread_id: str, run_id: str | None = None) -> None:
        self.thread_id = thread_id
        self.run_id = run_id  # the root run (the first RunStarted's if None)
        self._usage: dict[str, list[Usage]] = {}
        self._reasoning: dict[tuple[str, str], str] = {}  # (run id, message id) -> its open reasoning message
        self._reasoning_ids = itertools.count(1)
        self._started: set[str] = set()  # the runs open on the wire (RUN_STARTED / SUBAGENT_STARTED), not ended
        self._ended: set[str] = set()  # the runs that sent their terminal event
        self._dropped: set[str] = set()  # the runs whose late events were dropped (and said so)
        self._closed = False  # the root run ended: so did the stream

    def _sub(self, run_id: str) -> str | None:
        if self.run_id is None:
            self.run_id = run_id
        return None if run_id == self.run_id else run_id

    def encode(self, event: RunEvent) -> list[w.AgUiEvent]:
        run_id = event.run_id
        if run_id in self._started:
            return self._encode(event, self._sub(run_id))
        if self._closed or run_id in self._ended:
            return self._late(event)
        sub = self._sub(run_id)
        self._started.add(run_id)  # its first event, RunStarted or not, opens it on the wire
        opened: w.AgUiEvent = (
            w.RunStartedEvent(thread_id=self.thread_id, run_id=event.run_id)
            if sub is None
            else w.SubagentStartedEvent(subagent_run_id=sub, name=event.agent_id)
        )
        return [opened, *self._encode(event, sub)]

    def _encode(self, event: RunEvent, sub: str | None) -> list[w.AgUiEvent]:
        match event:
            case RunStarted():
                return []  # the run was opened by its first event (this one, or one before it)
            case RunFinished():
                return [self._finished(event, sub)]
            case RunError():
                self._usage.pop(event.run_id, None)
                self._end_run(event.run_id, sub)
                if sub is None:
                    return [w.RunErrorEvent(message=event.message, code=event.code)]
                return [w.SubagentErrorEvent(subagent_run_id=sub, message=event.message, code=event.code)]
            case StepStarted():
                return [w.StepStartedEvent(step_name=event.step, subagent_run_id=sub)]
            case StepFinished():
                return [w.StepFinishedEvent(step_name=event.step, subagent_run_id=sub)]
            case TextMessageStart():
                return [w.TextMessageStartEvent(message_id=event.message_id, subagent_run_id=sub)]
            case TextMessageContent():
                if not event.delta:  # AG-UI requires a non-empty delta
                    return []
                return [w.TextMessageContentEvent(message_id=event.message_id, delta=event.delta, subagent_run_id=sub)]
            case TextMessageEnd():
                return [w.TextMessageEndEvent(message_id=event.message_id, subagent_run_id=sub)]
            case ReasoningStart():
                reasoning_id = f"{event.message_id}:reasoning-{next(self._reasoning_ids)}"
                self._reasoning[event.run_id, event.message_id] = reasoning_id
                return [
                    w.ReasoningStartEvent(message_id=reasoning_id, subagent_run_id=sub),
                    w.ReasoningMessageStartEvent(message_id=reasoning_id, subagent_run_id=sub),
                ]
            case ReasoningContent():
                if not event.delta:
                    return []
                reasoning_id = self._reasoning_id(event.run_id, event.message_id)
                return [w.ReasoningMessageContentEvent(message_id=reasoning_id, delta=event.delta, subagent_run_id=sub)]
            case ReasoningEnd():
                reasoning_id = self._reasoning_id(event.run_id, event.message_id)
                self._reasoning.pop((event.run_id, event.message_id), None)
                return [
                    w.ReasoningMessageEndEvent(message_id=reasoning_id, subagent_run_id=sub),
                    w.ReasoningEndEvent(message_id=reasoning_id, subagent_run_id=sub),
                ]
            case ToolCallStart():
                return [
                    w.ToolCallStartEvent(
                        tool_call_id=event.call_id,
                        tool_call_name=event.tool_name,
                        parent_message_id=event.parent_message_id,
                        subagent_run_id=sub,
                    )
                ]
            case ToolCallArgs():
                return [w.ToolCallArgsEvent(tool_call_id=event.call_id, delta=event.delta, subagent_run_id=sub)]
            case ToolCallEnd():
                return [w.ToolCallEndEvent(tool_call_id=event.call_id, subagent_run_id=sub)]
            case ToolCallResult():
                return [
                    w.ToolCallResultEvent(
                        message_id=f"{event.call_id}:result",
                        tool_call_id=event.call_id,
                        content=model_text(event.result),
                        subagent_run_id=sub,
                    )
                ]
            case ToolCallProgress():
                value = {"toolCallId": event.call_id, "item": w.json_value(event.item)}
                return [w.CustomEvent(name=TOOL_PROGRESS, value=value, subagent_run_id=sub)]
            case UsageReported():
                self._usage.setdefault(event.run_id, []).append(event.usage)
                return []
            case CustomEvent():
                return [w.CustomEvent(name=event.name, value=w.json_value(event.value), subagent_run_id=sub)]
            case MessagesSnapshot():
                if sub is not None:
                    return []  # a subagent's history is not the thread's
                return [w.MessagesSnapshotEvent(messages=messages_to_agui(event.messages))]
        return []  # pragma: no cover - every RunEvent is matched above

    def _reasoning_id(self, run_id: str, message_id: str) -> str:
        """The open reasoning block's message id (one the loop did not start gets the block id
        ``:reasoning`` rather than the text's id)."""
        return self._reasoning.get((run_id, message_id), f"{message_id}:reasoning")

    def _end_run(self, run_id: str, sub: str | None) -> None:
        """The run sent its terminal event: nothing of it follows (nothing at all, for the root).
        Forget its reasoning blocks left open (it ended inside one)."""
        self._ended.add(run_id)
        if sub is None:  # the root's end is the stream's: no run is open on it any more
            self._closed = True
            self._started.clear()
        else:
            self._started.discard(run_id)
        for key in [key for key in self._reasoning if key[0] == run_id]:
            del self._reasoning[key]

    def _late(self, event: RunEvent) -> list[w.AgUiEvent]:
        """Nothing for an event after its run's end (or the root run's): AG-UI refuses it there."""
        first = event.run_id not in self._dropped
        self._dropped.add(event.run_id)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s of run %r came after %s on the AG-UI stream of thread %r: dropped%s",
            type(event).__name__,
            event.run_id,
            "the run's end" if event.run_id in self._ended else f"the end of run {self.run_id!r}",
            self.thread_id,
            " (and so is anything more of it)" if first else "",
        )
        return []

    def _finished(self, event: RunFinished, sub: str | None) -> w.AgUiEvent:
        self._end_run(event.run_id, sub)
        usage = usage_to_agui(self._usage.pop(event.run_id, []))
        interrupts = tuple(interrupt_to_agui(interrupt, sub) for interrupt in event.interrupts)
        result: dict[str, Any] = {"stopReason": event.outcome, "text": event.text}
        if sub is not None:
            if event.outcome == "interrupt":
                outcome = w.SubagentOutcome(type="suspended", interrupt_ids=tuple(i.id for i in interrupts))
            else:
                outcome = w.SubagentOutcome(type="success")
            return w.SubagentFinishedEvent(subagent_run_id=sub, result=result, outcome=outcome)
        if event.outcome == "interrupt":
            run_outcome = w.RunOutcome(type="interrupt", interrupts=interrupts)
        elif event.outcome == "aborted":
            run_outcome = w.RunOutcome(type="cancelled")
        else:
            run_outcome = w.RunOutcome(type="success")
        return w.RunFinishedEvent(
            thread_id=self.thread_id, run_id=event.run_id, outcome=run_outcome, result=result, usage=usage
        )

    def wire(self, event: RunEvent) -> list[dict[str, Any]]:
        """``encode(event)`` as JSON objects."""
        return [w.to_wire(out) for out in self.encode(event)]
