"""The conversation in the journal: the typed model-attempt payload and the fold that reads it back.

The writer (`reply_record` -> `ModelReplyRecord.to_payload`, or `reply_payload`
in one step) and the reader (`ModelReplyRecord.from_payload`, `fold_conversation`)
live together so the history a session rebuilds is exactly the one its loop had.

Rules
=====

* Payload (``ModelAttemptCompleted.response``): ``inputs`` (user texts that
  joined before the attempt), ``text``, ``reasoning`` (parts with their
  ``signature`` / ``redacted_data``), ``tool_calls`` (``id``/``name``/
  ``arguments`` with the ids the assembler assigned), ``rejected`` (call id ->
  the error text the model got instead of a run), ``finish_reason``, ``usage``.
* Reading is strict about types and unknown keys but every key may be missing
  (its empty value, ``stop``, zero usage): the first payload shape had no
  ``reasoning`` and only input/output tokens, and journals hold it. Anything
  else raises `JournalCorruptError` naming the offending field.
* The assistant message of a record: reasoning, then the text (if any), then
  the calls, the order the assembler gives a live reply.
* Fold, over one agent stream's events in order:
  - `RequestStarted` -> the ``prompt`` its `RequestAccepted` carried, as a user
    message (a ``chat()`` run: its given ``messages``, which replace the history before
    it: each run is given its whole history, what its model sees), except the holder requests of
    ``start_subagent`` and continuations (``resume``: they carry no prompt). A request
    that never started (refused or aborted while queued) adds nothing, as live, and
    the incremental fold forgets its input when it ends;
  - `PromptSubmitted` -> replaces that prompt with what the UserPromptSubmit hooks made of
    it (a rewritten prompt, added context; nothing when skipped);
  - `ModelAttemptCompleted` -> its inputs as user messages, the assistant
    message, then each call's answer in call order: the rejection text, else the
    published `ToolCompleted` / `ToolFailed` result (``output`` as is when a
    string, else its JSON), else "outcome unknown" for `ToolOutcomeUnknown`
    (the last such event of a call counts, wherever it is in the stream);
  - `RunPaused` -> the input that joined a turn paused before its model call, as
    user messages; its pending calls (every call of the paused reply) wait
    unanswered until `InterruptsResolved`, whose ``results`` answer the calls a
    person answered without running them (rejected, cancelled, a client tool's
    output): no orphan answer, and no answer for the calls the reply's checks
    refused either (the live loop answers them with the others, in call order,
    when the run goes on; answered already, a resume read them twice). A
    ``chat()`` run given its whole history forgets the pauses before it: their
    calls are no longer in the history, and a later reply may reuse their ids;
  - every call still unanswered then gets `answer_orphan_calls`' answer.
  Failed and aborted attempts contribute nothing.
* The incremental fold (`ConversationFold`) gives the same history for the same
  events fed in any number of steps: a call's answer is kept as a place
  (`PendingAnswer`) in the history and the settlements as a map, and the places are
  filled, then orphans answered, only when `messages` is asked; its state
  (`to_json` / `from_json`) is what a stream's snapshot keeps. It also keeps what
  the session needs on reopen without reading the stream: the background subagent
  outcomes recorded since the last completed model attempt (a foreground subagent's,
  ``subagent_started`` with ``background`` false, is left out: its ``task`` call's result
  told the model; the fold keeps the ids of those still running for that), the last
  non-empty request output, and the notes still owed to the model (`undelivered_notes`):
  each `InboxNoted` message, in the order noted, until a model call takes it. A model
  call takes its inbox whole, first among its inputs and in the order it was noted, so
  a `ModelAttemptCompleted` (or a `RunPaused` before its model call) drops, from the
  oldest owed note on, each note its ``inputs`` hold in that order (messages of the
  inbox that are no note, e.g. a subagent outcome's, and the request's own joined
  messages are passed over); a note noted while the call was under way is not among
  them and stays owed. A failed or aborted attempt takes nothing.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.strategies import configure_tagged_union

from .._convert import LazyConverter
from .._errors import HistoryError, JournalError
from .._models._assemble import ModelReply
from .._models._history import answer_orphan_calls, validate_history
from .._models._messages import (
    AssistantMessage,
    ContentPart,
    FinishReason,
    Message,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultMessage,
    Usage,
    UserMessage,
    configure_messages,
    message_converter,
)
from .._tools._results import JsonObject
from ._errors import InvalidTransitionError, JournalCorruptError
from ._events import (
    ConversationSeeded,
    Event,
    InboxNoted,
    InterruptsResolved,
    ModelAttemptCompleted,
    PromptSubmitted,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestStarted,
    RunPaused,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    event_converter,
)
from ._projection import Projection
from ._store import JournalStore, stream_id_for
from ._stored import StoredIndex

__all__ = [
    "OUTCOME_UNKNOWN_ANSWER",
    "WITHHELD_ANSWER",
    "ConversationFold",
    "ModelReplyRecord",
    "PendingAnswer",
    "decode_conversation",
    "encode_conversation",
    "fold_conversation",
    "read_conversation",
    "reply_payload",
    "reply_record",
    "settled_answer",
]

WITHHELD_ANSWER = "tool result withheld: middleware did not finish unwinding in time"
"""The answer (an error) of a call whose result was persisted but not published."""

OUTCOME_UNKNOWN_ANSWER = "outcome unknown after a restart"
"""The answer (an error) of a call settled ``outcome_unknown``."""

# Tuples for isinstance: a ``A | B`` union is built anew each time the expression runs.
_ANSWERED = (ToolCompleted, ToolFailed, ToolCancelled)
_SETTLEMENTS = (ToolCompleted, ToolFailed, ToolCancelled, ToolOutcomeUnknown)
_SUBAGENT_OUTCOMES = (SubagentCompleted, SubagentCancelled)
_SUBAGENT_EVENTS = (SubagentStarted, SubagentCompleted, SubagentCancelled)
_REQUEST_ENDS = (RequestCompleted, RequestFailed, RequestInterrupted)


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _reasoning(values: Iterable[ReasoningPart]) -> tuple[ReasoningPart, ...]:
    return tuple(values)


def _calls(values: Iterable[ToolCallPart]) -> tuple[ToolCallPart, ...]:
    return tuple(values)


def _frozen_map(values: Mapping[str, str]) -> Mapping[str, str]:
    return types.MappingProxyType(dict(values))


@attrs.frozen(kw_only=True)
class ModelReplyRecord:
    """The journal form of one completed model attempt."""

    inputs: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    text: str = ""
    reasoning: tuple[ReasoningPart, ...] = attrs.field(default=(), converter=_reasoning)
    tool_calls: tuple[ToolCallPart, ...] = attrs.field(default=(), converter=_calls)
    rejected: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_map)
    finish_reason: FinishReason = FinishReason.STOP
    usage: Usage = attrs.field(factory=Usage)

    def message(self) -> AssistantMessage:
        parts: list[ContentPart] = [*self.reasoning]
        if self.text:
            parts.append(TextPart(self.text))
        parts.extend(self.tool_calls)
        return AssistantMessage(tuple(parts))

    def to_payload(self) -> dict[str, Any]:
        """The JSON object for ``ModelAttemptCompleted.response``."""
        payload: dict[str, Any] = _converter.unstructure(self, ModelReplyRecord)
        return payload

    @classmethod
    def from_payload(cls, payload: object) -> ModelReplyRecord:
        """The record of a stored payload (either shape); `JournalCorruptError` names what is wrong."""
        if not isinstance(payload, dict):
            raise JournalCorruptError(f"a model reply payload must be a JSON object, not {type(payload).__name__}")
        try:
            record = _converter.structure(payload, cls)
        except Exception as exc:
            details = "; ".join(cattrs.transform_error(exc, path="response"))
            raise JournalCorruptError(f"invalid model reply payload: {details}") from exc
        if record.tool_calls:
            # A live reply's ids are non-empty and unique (the assembler assigns them); a provider
            # refuses a history with an empty or repeated one (repeats across replies: `_check_call_ids`).
            ids = [call.id for call in record.tool_calls]
            if "" in ids or len(set(ids)) != len(ids):
                raise JournalCorruptError(f"invalid model reply payload: its tool call ids {ids!r} are not unique ids")
        return record


def reply_record(
    reply: ModelReply, *, inputs: Iterable[str] = (), rejected: Mapping[str, str] | None = None
) -> ModelReplyRecord:
    """The record of an assembled reply; ``rejected`` maps call ids of the reply to their error text."""
    calls = reply.message.tool_calls
    rejected = dict(rejected or {})
    unknown = rejected.keys() - {call.id for call in calls}
    if unknown:  # a writer bug: the fold would silently lose these answers
        raise ValueError(f"rejected ids that are no call of the reply: {sorted(unknown)}")
    return ModelReplyRecord(
        inputs=inputs,
        text=reply.message.text,
        reasoning=reply.reasoning,
        tool_calls=calls,
        rejected=rejected,
        finish_reason=reply.finish_reason,
        usage=reply.usage,
    )


def reply_payload(
    reply: ModelReply, *, inputs: Iterable[str] = (), rejected: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``reply_record(reply, ...).to_payload()``, built without the record: what a live reply writes.

    One pass over the message's parts, and the converter's own hooks for the parts and the
    usage, so the payload is the record's, key for key (a test holds them together).
    """
    reasoning_hook, call_hook, usage_hook = _payload_hooks()
    texts: list[str] = []
    reasoning: list[Any] = []
    calls: list[Any] = []
    ids: set[str] = set()
    for part in reply.message.parts:
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, ReasoningPart):
            reasoning.append(reasoning_hook(part))
        elif isinstance(part, ToolCallPart):
            calls.append(call_hook(part))
            ids.add(part.id)
    answered = dict(rejected or {})
    unknown = answered.keys() - ids
    if unknown:  # a writer bug: the fold would silently lose these answers
        raise ValueError(f"rejected ids that are no call of the reply: {sorted(unknown)}")
    return {
        "inputs": list(inputs),
        "text": "".join(texts),
        "reasoning": reasoning,
        "tool_calls": calls,
        "rejected": answered,
        "finish_reason": reply.finish_reason.value,
        "usage": usage_hook(reply.usage),
    }


@functools.cache
def _payload_hooks() -> tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[Any], Any]]:
    return (
        _converter.get_unstructure_hook(ReasoningPart),
        _converter.get_unstructure_hook(ToolCallPart),
        _converter.get_unstructure_hook(Usage),
    )


def settled_answer(settlement: Event | None) -> ToolResultMessage | None:
    """The model's answer for a call, from the event that settled it (``None``: no answer yet).

    One rule for the live loop and the fold, so a live history and a rebuilt one agree.
    """
    if isinstance(settlement, _ANSWERED):
        result = settlement.result
        if not settlement.published:
            return ToolResultMessage(settlement.call_id, WITHHELD_ANSWER, is_error=True)
        if result is None:  # cancelled, in a journal written before cancellations kept their answer
            reason = settlement.reason if isinstance(settlement, ToolCancelled) else "no result"
            return ToolResultMessage(settlement.call_id, f"the tool call was cancelled ({reason})", is_error=True)
        output = result.get("output")
        return ToolResultMessage(
            settlement.call_id,
            output if isinstance(output, str) else json.dumps(output),
            is_error=not isinstance(settlement, ToolCompleted),
        )
    if isinstance(settlement, ToolOutcomeUnknown):
        return ToolResultMessage(settlement.call_id, OUTCOME_UNKNOWN_ANSWER, is_error=True)
    return None


def encode_conversation(messages: Iterable[Message]) -> JsonObject:
    """The payload of `ConversationSeeded`: messages in the message converter's tagged form."""
    return {"messages": [message_converter.unstructure(message, Message) for message in messages]}


def decode_conversation(payload: object, what: str = "a seeded conversation") -> list[Message]:
    """The messages of a `ConversationSeeded` payload (or a ``chat()`` run's given ones); `JournalCorruptError`,
    naming *what*, if it holds something else or a conversation that ``history=`` / ``chat()`` would refuse."""
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        raise JournalCorruptError(f"{what} must be {{'messages': [...]}}")
    try:
        # Strict: 12345 is no text and 1 no flag (the message converter would make them "12345" and True).
        messages: list[Message] = [
            _message_converter.structure(item, Message)  # type: ignore[arg-type]
            for item in payload["messages"]
        ]
    except Exception as exc:
        details = "; ".join(cattrs.transform_error(exc, path="message"))
        raise JournalCorruptError(f"{what}: a message cannot be decoded: {details}") from None
    try:
        validate_history(messages)  # what it was checked against when given
    except HistoryError as exc:
        raise JournalCorruptError(f"{what}: {exc}") from None
    return messages


def fold_conversation(events: Iterable[Event]) -> list[Message]:
    """The history one agent stream's events tell (see the module rules)."""
    events = list(events)
    outcomes: dict[str, ToolResultMessage] = {}
    awaiting: dict[str, list[str]] = {}
    chat_runs: set[str] = set()
    for event in events:
        if isinstance(event, _SETTLEMENTS):
            answer = settled_answer(event)
            if answer is not None:
                outcomes[event.call_id] = answer
        elif isinstance(event, RunPaused):
            awaiting[event.request_id] = paused_call_ids(event)
        elif isinstance(event, InterruptsResolved):
            awaiting.pop(event.request_id, None)
            outcomes.update(resolved_answers(event))
        elif isinstance(event, RequestAccepted) and "chat" in event.input:
            chat_runs.add(event.request_id)
        elif isinstance(event, RequestStarted) and event.request_id in chat_runs:
            awaiting.clear()  # the history before it goes, the paused calls with it
    waiting = {call_id for ids in awaiting.values() for call_id in ids}
    history: list[Message] = []
    queued: dict[str, tuple[bool, list[Message]]] = {}  # accepted, not started: (a chat run?, its prompt)
    last_prompt: tuple[str, int] | None = None  # the started request whose prompt ends the history
    for event in events:
        if isinstance(event, ConversationSeeded):
            history.extend(decode_conversation(event.conversation))
        elif isinstance(event, RequestAccepted):
            queued[event.request_id] = ("chat" in event.input, accepted_messages(event.request_id, event.input))
        elif isinstance(event, RequestStarted):
            chat_run, started = queued.pop(event.request_id, (False, []))
            if chat_run:
                history.clear()  # its given messages are the whole history its model sees
            history.extend(started)
            last_prompt = (event.request_id, len(started))
        elif isinstance(event, PromptSubmitted):
            if last_prompt is not None and last_prompt[0] == event.request_id:
                del history[len(history) - last_prompt[1] :]
            history.extend(UserMessage(text) for text in event.messages)
            last_prompt = None
        elif isinstance(event, RunPaused):
            history.extend(UserMessage(text) for text in paused_inputs(event))
        elif isinstance(event, ModelAttemptCompleted):
            try:
                record = ModelReplyRecord.from_payload(event.response)
            except JournalCorruptError as exc:
                raise JournalCorruptError(f"model attempt {event.attempt_id}: {exc}") from exc
            history.extend(UserMessage(text) for text in record.inputs)
            history.append(record.message())
            for call in record.tool_calls:
                if call.id in waiting:
                    continue  # its pause is not answered: no answer yet, a refused call's neither
                if call.id in record.rejected:
                    history.append(ToolResultMessage(call.id, record.rejected[call.id], is_error=True))
                elif call.id in outcomes:
                    history.append(outcomes[call.id])
    _check_call_ids(history)
    return answer_orphan_calls(history, awaiting=waiting)


def _check_call_ids(history: list[Message]) -> None:
    """`JournalCorruptError` if two tool calls of a rebuilt history share an id. A live reply never
    repeats one (the assembler reserves the conversation's ids), a provider refuses the history, and
    only the whole history shows it (a snapshot's entries are read no sooner than this)."""
    seen: dict[str, int] = {}
    for index, message in enumerate(history):
        if isinstance(message, AssistantMessage):
            for part in message.parts:
                if isinstance(part, ToolCallPart):
                    if part.id in seen:
                        raise JournalCorruptError(
                            f"the stored conversation uses tool call id {part.id!r} twice "
                            f"(messages {seen[part.id]} and {index} of the history)"
                        )
                    seen[part.id] = index


def paused_call_ids(event: RunPaused) -> list[str]:
    """The calls a paused run waits with (not answered until its continuation)."""
    calls = event.state.get("pending_calls")
    if not isinstance(calls, list):
        return []
    return [call["id"] for call in calls if isinstance(call, dict) and isinstance(call.get("id"), str)]


def accepted_messages(request_id: str, given: dict[str, Any]) -> list[Message]:
    """What a request adds to the conversation when it starts, from its accepted input: its
    prompt; a ``chat()`` run's whole given history (``messages``); nothing for the holder request
    of a start between requests or a continuation (``resume``). `JournalCorruptError` for an
    input no writer makes (a prompt that is no string, a ``chat()`` run without messages)."""
    if "start_subagent" in given or "resume" in given:
        return []
    if "chat" in given:
        messages = decode_conversation(given, f"the messages of chat run {request_id!r}")
        if not messages:
            raise JournalCorruptError(f"chat run {request_id!r} was given no message")
        return messages
    prompt = given.get("prompt")
    if not isinstance(prompt, str):
        raise JournalCorruptError(f"the prompt of request {request_id!r} is {prompt!r:.80}, not a string")
    return [UserMessage(prompt)]


def paused_inputs(event: RunPaused) -> list[str]:
    """The input that joined a turn paused before its model call (journalled with the pause)."""
    inputs = event.state.get("inputs")
    if inputs is None:
        return []
    if not isinstance(inputs, list) or not all(isinstance(text, str) for text in inputs):
        raise JournalCorruptError(f"run_paused of {event.request_id}: inputs is {inputs!r}")
    return list(inputs)


def resolved_answers(event: InterruptsResolved) -> dict[str, ToolResultMessage]:
    """The answers of the calls a continuation answered without running them."""
    answers: dict[str, ToolResultMessage] = {}
    for call_id, result in event.results.items():
        if not isinstance(result, dict) or not isinstance(result.get("text"), str):
            raise JournalCorruptError(f"interrupts_resolved of {event.request_id}: result of {call_id} is {result!r}")
        answers[call_id] = ToolResultMessage(call_id, result["text"], is_error=bool(result.get("is_error")))
    return answers


def _take_notes(noted: list[str], inputs: Iterable[str]) -> None:
    """Drop from *noted* (owed notes, oldest first) those a model call with *inputs* took: from
    the oldest on, each found among the inputs in order; the first not found and every later
    one stay owed (noted while the call was under way, they were not in its inbox)."""
    taken = 0
    count = len(noted)
    for text in inputs:
        if text == noted[taken]:
            taken += 1
            if taken == count:
                break
    del noted[:taken]


# ---------------------------------------------------------------- the incremental fold


@attrs.frozen
class PendingAnswer:
    """The place of a call's answer in the history, filled from the settlements on output."""

    call_id: str


SubagentOutcome = SubagentCompleted | SubagentCancelled


@attrs.define
class _FoldState:
    entries: list[Message | PendingAnswer] = attrs.Factory(list)
    # The last settlement of each call (a snapshot's part stays text until the history is asked for).
    outcomes: MutableMapping[str, ToolResultMessage] = attrs.Factory(dict)
    since_reply: list[SubagentOutcome] = attrs.Factory(list)
    # Foreground subagents started and not ended yet: their outcome is no note (a state stored
    # before this existed has none, as its journal has no foreground subagent).
    foreground: list[str] = attrs.Factory(list)
    last_output: dict[str, Any] | None = None
    # Inbox notes no model call took yet, in the order noted (a state stored before this existed
    # has none, as its journal has no `InboxNoted`).
    noted: list[str] = attrs.Factory(list)
    awaiting: dict[str, list[str]] = attrs.Factory(dict)  # paused request -> its calls waiting for answers
    queued: dict[str, dict[str, Any]] = attrs.Factory(dict)  # accepted, not started: its input waits
    last_prompt: tuple[str, int] | None = None  # the started request whose prompt ends the entries


_Entry = Message | PendingAnswer


class ConversationFold:
    """`fold_conversation`, one event at a time (see the module rules).

    ``fold.feed(e)`` for each event of a stream in order, then ``fold.messages()``
    equals ``fold_conversation`` of those events, however the feeding was split
    and whether or not the state went through `to_json` / `from_json` (or
    `to_parts` / `from_parts`) between.

    The entries and the outcomes are the parts that grow with the conversation, so
    `from_parts` keeps them as the JSON text they were stored as: events append after
    that text without decoding it, and it is decoded only when the history is asked for
    (or an event takes back what it holds); `to_parts` reuses it and encodes only what
    was added since (a reopen and a close cost what changed).
    """

    __slots__ = ("_encoded", "_s", "_stored")

    def __init__(self) -> None:
        self._s = _FoldState()
        # The first n entries as stored and not decoded yet: ``_s.entries`` holds those after them.
        self._stored: tuple[bytes | memoryview, int] | None = None
        self._encoded: tuple[bytes | memoryview, int] | None = None  # the JSON text of the first n entries

    def _length(self) -> int:
        return len(self._s.entries) + (self._stored[1] if self._stored is not None else 0)

    def _entries(self) -> list[Message | PendingAnswer]:
        """Every entry (decoding the stored ones first, if they are still text)."""
        if self._stored is not None:
            text, count = self._stored
            try:
                stored = _fold_converter.structure(json.loads(bytes(text)), list[_Entry])
            except Exception as exc:
                raise JournalCorruptError(f"the stored conversation cannot be decoded: {_details(exc)}") from exc
            if len(stored) != count:
                raise JournalCorruptError(f"the stored conversation holds {len(stored)} entries, not {count}")
            self._s.entries[:0] = stored
            self._stored = None
        return self._s.entries

    def feed(self, event: Event) -> None:
        """Fold one event; a payload that cannot be read raises `JournalCorruptError` and changes nothing."""
        s = self._s
        if isinstance(event, _SETTLEMENTS):
            answer = settled_answer(event)
            if answer is not None:
                s.outcomes[event.call_id] = answer
        elif isinstance(event, ConversationSeeded):
            s.entries.extend(decode_conversation(event.conversation))
        elif isinstance(event, RequestAccepted):
            # An input that cannot be read fails here, changing nothing.
            accepted_messages(event.request_id, event.input)
            s.queued[event.request_id] = dict(event.input)
        elif isinstance(event, RequestStarted):
            given = s.queued.pop(event.request_id, None)
            started = accepted_messages(event.request_id, given) if given is not None else []
            if given is not None and "chat" in given:
                # A chat() run is given its whole history, what its model sees: it replaces the fold's,
                # and the calls of a pause before it are no longer in it (a later reply may reuse an id).
                self._stored = self._encoded = None
                s.entries.clear()
                s.awaiting.clear()
            s.entries.extend(started)
            s.last_prompt = (event.request_id, len(started))
        elif isinstance(event, PromptSubmitted):
            # Nothing joins between a request's start and its prompt's hooks: the tail is its prompt.
            if s.last_prompt is not None and s.last_prompt[0] == event.request_id:
                cut = self._length() - s.last_prompt[1]
                if self._encoded is not None and cut < self._encoded[1]:  # its text holds entries that go
                    self._encoded = self._stored if self._stored is not None and cut >= self._stored[1] else None
                if self._stored is not None and cut < self._stored[1]:
                    self._entries()  # what goes is in the stored text: read it first
                del s.entries[cut - self._length() + len(s.entries) :]
            s.entries.extend(UserMessage(text) for text in event.messages)
            s.last_prompt = None
        elif isinstance(event, ModelAttemptCompleted):
            try:
                record = ModelReplyRecord.from_payload(event.response)
            except JournalCorruptError as exc:
                raise JournalCorruptError(f"model attempt {event.attempt_id}: {exc}") from exc
            entries = s.entries
            entries.extend(UserMessage(text) for text in record.inputs)
            entries.append(record.message())
            for call in record.tool_calls:
                if call.id in record.rejected:
                    entries.append(ToolResultMessage(call.id, record.rejected[call.id], is_error=True))
                else:
                    entries.append(PendingAnswer(call.id))
            s.since_reply.clear()
            if s.noted:
                _take_notes(s.noted, record.inputs)
        elif isinstance(event, _SUBAGENT_EVENTS):
            if isinstance(event, SubagentStarted):
                if not event.background:
                    s.foreground.append(event.subagent_id)
            elif event.subagent_id in s.foreground:
                s.foreground.remove(event.subagent_id)  # its `task` call's result told the model
            else:
                s.since_reply.append(event)
        elif isinstance(event, RunPaused):
            inputs = paused_inputs(event)
            s.awaiting[event.request_id] = paused_call_ids(event)
            s.entries.extend(UserMessage(text) for text in inputs)
            if s.noted:
                _take_notes(s.noted, inputs)
        elif isinstance(event, InboxNoted):
            s.noted.extend(event.messages)
        elif isinstance(event, InterruptsResolved):
            answers = resolved_answers(event)
            s.awaiting.pop(event.request_id, None)
            s.outcomes.update(answers)
        elif isinstance(event, _REQUEST_ENDS):
            # A request that ended without starting (refused, aborted while queued) leaves nothing
            # waiting: its input would otherwise ride in every snapshot of the stream for ever.
            s.queued.pop(event.request_id, None)
            if isinstance(event, RequestCompleted) and event.output:
                s.last_output = dict(event.output)

    def messages(self) -> list[Message]:
        """The history so far (a new list)."""
        outcomes = dict(self._s.outcomes.items())  # decoded once here, not looked up in stored text per call
        # The calls of a pause not answered yet: no answer of theirs is shown, not even a refused
        # call's (kept as an entry since its reply), until the pause is resolved.
        waiting = {call_id for ids in self._s.awaiting.values() for call_id in ids}
        history: list[Message] = []
        for entry in self._entries():
            if isinstance(entry, PendingAnswer):
                answer = outcomes.get(entry.call_id)
                if answer is not None and entry.call_id not in waiting:
                    history.append(answer)
            elif waiting and isinstance(entry, ToolResultMessage) and entry.tool_call_id in waiting:
                continue
            else:
                history.append(entry)
        _check_call_ids(history)
        return answer_orphan_calls(history, awaiting=waiting)

    def answers(self, call_ids: Iterable[str]) -> dict[str, ToolResultMessage]:
        """The answer `messages` gives each of *call_ids* that has one of its own (its settlement, a
        continuation's answer, or the refusal of its reply's checks), by call id; a call of a pause
        not answered yet, or without any, is left out (`messages` would give it the orphan answer).

        For a host whose run ended without answering some calls: the journal's answer wins, so its
        history reads as the one rebuilt from the journal. Reads the entries from the end.
        """
        wanted = set(call_ids)
        for ids in self._s.awaiting.values():
            wanted.difference_update(ids)
        found: dict[str, ToolResultMessage] = {}
        if not wanted:
            return found
        outcomes = self._s.outcomes
        for entry in reversed(self._entries()):
            if isinstance(entry, PendingAnswer):
                call_id = entry.call_id
                answer = outcomes.get(call_id) if call_id in wanted else None
            elif isinstance(entry, ToolResultMessage) and entry.tool_call_id in wanted:
                call_id, answer = entry.tool_call_id, entry
            else:
                continue
            if answer is not None:
                found[call_id] = answer
            wanted.discard(call_id)  # its place is found: answered there or not at all
            if not wanted:
                break
        return found

    @property
    def outcomes_since_reply(self) -> tuple[SubagentCompleted | SubagentCancelled, ...]:
        """The `SubagentCompleted` / `SubagentCancelled` events of background subagents after the
        last completed model attempt (all of them if there is none): outcomes whose note may never
        have reached the model."""
        return tuple(self._s.since_reply)

    @property
    def undelivered_notes(self) -> tuple[str, ...]:
        """The messages `InboxNoted` put in the agent's inbox that no journalled model call has
        taken yet, in the order noted: what a reopened session owes the model (module rules)."""
        return tuple(self._s.noted)

    @property
    def last_output(self) -> dict[str, Any] | None:
        """The output of the last `RequestCompleted` that had a non-empty one (a subagent's answer)."""
        return None if self._s.last_output is None else dict(self._s.last_output)

    def to_json(self) -> dict[str, Any]:
        """The fold's state as JSON-compatible data."""
        self._entries()
        data: dict[str, Any] = _fold_converter.unstructure(self._s, _FoldState)
        return data

    @classmethod
    def from_json(cls, data: object) -> ConversationFold:
        """A fold from `to_json` data; `JournalCorruptError` if it holds something else."""
        fold = cls()
        try:
            fold._s = _fold_converter.structure(data, _FoldState)
        except Exception as exc:
            raise JournalCorruptError(f"invalid conversation fold state: {_details(exc)}") from exc
        return fold

    def to_parts(self) -> tuple[dict[str, Any], bytes, bytes]:
        """The state without its entries and outcomes (JSON-compatible, with their counts), the entries
        as one compact ASCII JSON array and the outcomes as one JSON object: what a snapshot stores, in
        parts so `from_parts` can leave the last two undecoded."""
        entries = self._s.entries
        skipped = self._stored[1] if self._stored is not None else 0  # entries[i] is entry skipped + i
        if self._encoded is not None and self._encoded[1] >= skipped:
            stored_text, count = self._encoded
            text = bytes(stored_text)
            added = b",".join(_dumps(_fold_converter.unstructure(e, _Entry)) for e in entries[count - skipped :])
            if added:
                text = text[:-1] + (b"," if count else b"") + added + b"]"
        else:
            text = _dumps(_fold_converter.unstructure(self._entries(), list[_Entry]))
        encoded = self._encoded = (text, self._length())
        outcomes = self._s.outcomes
        if not isinstance(outcomes, StoredIndex):
            outcomes = self._s.outcomes = _outcome_index(dict(outcomes))
        outcome_text, outcome_count = outcomes.to_text()
        data: dict[str, Any] = _fold_converter.unstructure(attrs.evolve(self._s, entries=[], outcomes={}), _FoldState)
        del data["entries"], data["outcomes"]
        data["entries_count"], data["outcomes_count"] = encoded[1], outcome_count
        return data, text, outcome_text

    @classmethod
    def from_parts(cls, state: object, entries: bytes | memoryview, outcomes: bytes | memoryview) -> ConversationFold:
        """A fold from `to_parts`; the entries and outcomes are decoded when first needed
        (`JournalCorruptError` then, or now for a state that holds something else)."""
        counts = ("entries_count", "outcomes_count")
        if not isinstance(state, dict) or any(type(state.get(key)) is not int for key in counts):
            raise JournalCorruptError("invalid conversation fold state: expected entries_count and outcomes_count")
        if "entries" in state or "outcomes" in state:
            raise JournalCorruptError("invalid conversation fold state: its entries and outcomes are stored apart")
        data = dict(state)
        count, outcome_count = data.pop("entries_count"), data.pop("outcomes_count")
        fold = cls.from_json({**data, "entries": [], "outcomes": {}})
        fold._stored = fold._encoded = (entries, count)
        fold._s.outcomes = _outcome_index(text=outcomes, count=outcome_count)
        return fold

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConversationFold):
            return False
        self._entries()
        other._entries()
        return self._s == other._s

    __hash__ = None  # type: ignore[assignment]  # mutable


def _outcome_index(
    items: Mapping[str, ToolResultMessage] | None = None, *, text: bytes | memoryview | None = None, count: int = 0
) -> StoredIndex[ToolResultMessage]:
    def encode(call_id: str, answer: ToolResultMessage) -> Any:
        return _fold_converter.unstructure(answer, ToolResultMessage)

    def decode(call_id: str, row: Any) -> ToolResultMessage:
        answer: ToolResultMessage = _fold_converter.structure(row, ToolResultMessage)
        if answer.tool_call_id != call_id:
            raise TypeError(f"the answer of call {call_id!r} is to call {answer.tool_call_id!r}")
        return answer

    index = StoredIndex(encode=encode, decode=decode, what="call outcomes", line=text, count=count)
    index.update(items or {})
    return index


def _details(exc: BaseException) -> str:
    return "; ".join(cattrs.transform_error(exc, path="conversation")) if isinstance(exc, Exception) else str(exc)


def _dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode("ascii")


# ---------------------------------------------------------------- converter


def _strict(kind: type[Any]) -> Callable[[object, object], Any]:
    # cattrs would turn 5 into "5" and "1" into 1: stored data of the wrong type is corrupt, not coerced.
    def hook(value: object, _: object) -> Any:
        if type(value) is not kind:
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return hook


def _is_tuple(kind: Any) -> bool:
    return get_origin(kind) is tuple


def _tuple_hook(kind: Any, converter: cattrs.Converter) -> Callable[[object, object], tuple[Any, ...]]:
    # cattrs iterates any iterable, so "abc" would become ("a", "b", "c"): a JSON array is required.
    item = get_args(kind)[0]
    structure_item = converter.get_structure_hook(item)

    def hook(value: object, _: object) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        out: list[Any] = []
        errors: list[Exception] = []
        for index, element in enumerate(value):
            try:
                out.append(structure_item(element, item))
            except Exception as exc:  # noted with its index, so the error names e.g. tool_calls[1].name
                exc.__notes__ = [
                    *getattr(exc, "__notes__", []),
                    IterableValidationNote(f"@ index {index}", index, item),
                ]
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"while structuring {kind!r}", errors, kind)
        return tuple(out)

    return hook


def _configure(converter: cattrs.Converter) -> None:
    for kind in (str, int, bool):
        converter.register_structure_hook(kind, _strict(kind))
    converter.register_structure_hook_factory(_is_tuple, lambda kind: _tuple_hook(kind, converter))


_converter = LazyConverter(configure=_configure, forbid_extra_keys=True)


def _configure_messages(converter: cattrs.Converter) -> None:
    _configure(converter)
    configure_messages(converter)


# Stored messages (a seeded conversation, a chat run's): the message converter's tagged form, read strictly.
_message_converter = LazyConverter(configure=_configure_messages, forbid_extra_keys=True)


def _configure_fold(converter: cattrs.Converter) -> None:
    for kind in (str, int, bool):
        converter.register_structure_hook(kind, _strict(kind))
    # Messages carry the message converter's tags (the class name); a place for an answer gets its own.
    configure_tagged_union(ContentPart, converter, tag_name="type")
    configure_tagged_union(Message | PendingAnswer, converter, tag_name="type")

    def structure_outcome(value: object, _: object) -> SubagentOutcome:
        event: Event = event_converter.structure(value, Event)  # type: ignore[arg-type]
        if not isinstance(event, _SUBAGENT_OUTCOMES):
            raise TypeError(f"expected a subagent outcome, got {type(event).__name__}")
        return event

    converter.register_structure_hook(SubagentOutcome, structure_outcome)
    converter.register_unstructure_hook(SubagentOutcome, lambda event: event_converter.unstructure(event, Event))
    converter.register_structure_hook(dict[str, Any] | None, lambda v, _: _json_object_or_none(v))


def _json_object_or_none(value: object) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"expected a JSON object or null, got {type(value).__name__}")
    return value


_fold_converter = LazyConverter(configure=_configure_fold, forbid_extra_keys=True)


async def read_conversation(store: JournalStore, session_id: str, *, agent_id: str = "root") -> list[Message]:
    """The conversation of one agent of a session, as its journal tells it (the root's by default).

    Works on a live, closed or ended session, from any process that can read the store. The
    stream is judged by the rules a reopen judges it by (`Projection`): one a reopen refuses is a
    `JournalCorruptError` naming the stream and seq here too, never a plausible history.
    """
    stream_id = stream_id_for(session_id, agent_id)
    envelopes = await store.read(stream_id)
    if not envelopes:
        raise JournalError(f"session {session_id!r} has no journal stream for agent {agent_id!r}")
    projection = Projection(stream_id)
    for envelope in envelopes:
        try:
            projection.apply(envelope)
        except InvalidTransitionError as exc:
            raise JournalCorruptError(
                f"stored stream {stream_id!r} breaks the journal's rules at seq {envelope.seq}: {exc}"
            ) from exc
    return fold_conversation(envelope.event for envelope in envelopes)
