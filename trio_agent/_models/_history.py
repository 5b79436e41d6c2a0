"""Repairs to a conversation before it goes to a model.

Rules
=====

* Every `ToolCallPart` of an `AssistantMessage` needs a `ToolResultMessage` with
  its id somewhere in the history; providers refuse a call left unanswered. A
  call without one (its run was interrupted, its result never published) gets
  an error answer among the answers right after its assistant message, where its
  place in the message's call order puts it: the live loop answers a turn's calls
  in call order, so a history repaired here reads as the live one did.
* Nothing else changes: messages keep their order and identity.

A history given from outside (``open_session(history=...)``) must already be a
conversation a provider accepts (`validate_history`): user, assistant and tool
result messages only (the system prompt is the session's own); it starts with a
user message; every tool call is answered by the tool results that directly
follow its assistant message, each call once, before the next user or assistant
message; call ids are unique in the whole history. Each message holds what its
class says (strings where the class has strings; an assistant message holds content
parts; a call id and a tool name are non-empty strings of well-formed Unicode): the
classes do not check their fields when built (a conversation builds messages every
turn), so a history from outside is checked here, once. A call id or a tool name
holding a surrogate code point is refused: the request body sends every surrogate as
U+FFFD (or joins a pair), so two distinct ids would reach the server as one and their
results could not be told apart. A wrong value is named by `safe_repr`: it may be
anything (nested past the recursion limit, an int too long to print, a raising
``__repr__``), and the error must be the `HistoryError`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import overload

from .._errors import HistoryError
from .._util import safe_repr
from ._assemble import has_surrogate
from ._messages import (
    AssistantMessage,
    Message,
    ReasoningPart,
    SystemMessage,
    TextPart,
    ToolCallPart,
    ToolResultMessage,
    UserMessage,
)

__all__ = ["ORPHAN_ANSWER", "CallIdIndex", "MessageView", "answer_orphan_calls", "validate_history"]

ORPHAN_ANSWER = "no result was recorded (interrupted)"
"""The answer (an error) of a call that has none."""


def answer_orphan_calls(history: Iterable[Message], *, awaiting: Collection[str] = ()) -> list[Message]:
    """``history`` with every unanswered tool call answered (see the module rules), except the
    calls in *awaiting* (a paused run's calls: their answers come with its continuation)."""
    messages = list(history)
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolResultMessage)}
    answered.update(awaiting)
    out: list[Message] = []
    index, size = 0, len(messages)
    while index < size:
        message = messages[index]
        out.append(message)
        index += 1
        if not isinstance(message, AssistantMessage):
            continue
        calls = [part.id for part in message.parts if isinstance(part, ToolCallPart)]
        orphans = [call_id for call_id in calls if call_id not in answered]
        if not orphans:
            continue
        # Merged into the answers that follow the message by call order: an orphan goes before
        # the first answer of a later call (answers of no call of this message keep their place).
        place = {call_id: number for number, call_id in enumerate(calls)}
        due = 0
        while index < size:
            answer = messages[index]
            if not isinstance(answer, ToolResultMessage):
                break
            at = place.get(answer.tool_call_id)
            while at is not None and due < len(orphans) and place[orphans[due]] < at:
                out.append(ToolResultMessage(orphans[due], ORPHAN_ANSWER, is_error=True))
                due += 1
            out.append(answer)
            index += 1
        out.extend(ToolResultMessage(call_id, ORPHAN_ANSWER, is_error=True) for call_id in orphans[due:])
    return out


def validate_history(history: object) -> tuple[Message, ...]:
    """*history* as a tuple, if it is a conversation a provider accepts; else `HistoryError`
    naming the first message that is wrong (see the module rules)."""
    if isinstance(history, (str, bytes)) or not isinstance(history, Sequence):
        raise HistoryError(f"history must be a list of messages, not {type(history).__name__}", index=None)
    messages = tuple(history)
    seen: set[str] = set()
    pending: dict[str, None] = {}  # calls of the last assistant message not answered yet, in order
    for index, message in enumerate(messages):
        where = f"history[{index}]"
        if isinstance(message, SystemMessage):
            raise HistoryError(
                f"{where} is a system message: give the system prompt as instructions= "
                "(chat()) or system_prompt= (a session's agent)",
                index=index,
            )
        if not isinstance(message, UserMessage | AssistantMessage | ToolResultMessage):
            raise HistoryError(f"{where} is not a message: {safe_repr(message, _SHOWN)}", index=index)
        problem = _content_problem(message)
        if problem is not None:
            raise HistoryError(f"{where}: {problem}", index=index)
        if index == 0 and not isinstance(message, UserMessage):
            raise HistoryError(f"{where}: a conversation starts with a user message", index=index)
        if isinstance(message, ToolResultMessage):
            if message.tool_call_id not in pending:
                raise HistoryError(
                    f"{where} answers tool call {safe_repr(message.tool_call_id, _SHOWN)}, which is not an "
                    "unanswered call of the assistant message before it",
                    index=index,
                )
            del pending[message.tool_call_id]
            continue
        if pending:
            raise HistoryError(
                f"{where}: tool call(s) {_ids(pending)} of the assistant message before it "
                "are not answered (give a tool result message for each, right after it)",
                index=index,
            )
        if isinstance(message, AssistantMessage):
            for part in message.parts:
                if isinstance(part, ToolCallPart):
                    if part.id in seen:
                        raise HistoryError(
                            f"{where}: tool call id {safe_repr(part.id, _SHOWN)} is used twice", index=index
                        )
                    seen.add(part.id)
                    pending[part.id] = None
    if pending:
        raise HistoryError(
            f"history[{len(messages) - 1}]: tool call(s) {_ids(pending)} are not answered",
            index=len(messages) - 1,
        )
    return messages


_SHOWN = 80  # the most characters of a wrong value a message shows


def _ids(pending: dict[str, None]) -> str:
    return ", ".join(safe_repr(call_id, _SHOWN) for call_id in pending)


def _field_problem(
    owner: str, field: str, value: object, *, optional: bool = False, nonempty: bool = False, name: bool = False
) -> str | None:
    """What is wrong with a field's *value*, or ``None``. *name*: a call id or a tool name, which
    must be non-empty and hold no surrogate code point (see the module rules)."""
    if optional and value is None:
        return None
    if not isinstance(value, str):
        kind = "a string or None" if optional else "a string"
        return f"{owner}.{field} must be {kind}, not {type(value).__name__} {safe_repr(value, _SHOWN)}"
    if (nonempty or name) and not value:
        return f"{owner}.{field} must not be empty"
    if name and has_surrogate(value):
        return (
            f"{owner}.{field} {safe_repr(value, _SHOWN)} is not well-formed Unicode (it holds a surrogate "
            "code point, which a request sends as U+FFFD: another id or name could then read the same)"
        )
    return None


def _content_problem(message: UserMessage | AssistantMessage | ToolResultMessage) -> str | None:
    """What is wrong inside *message* (its fields), or ``None``."""
    if isinstance(message, UserMessage):
        return _field_problem("UserMessage", "content", message.content)
    if isinstance(message, ToolResultMessage):
        if not isinstance(message.is_error, bool):
            return f"ToolResultMessage.is_error must be True or False, not {safe_repr(message.is_error, _SHOWN)}"
        return _field_problem("ToolResultMessage", "tool_call_id", message.tool_call_id, name=True) or _field_problem(
            "ToolResultMessage", "content", message.content
        )
    for number, part in enumerate(message.parts):
        owner = f"parts[{number}]"
        if isinstance(part, TextPart):
            problem = _field_problem(owner, "text", part.text)
        elif isinstance(part, ReasoningPart):
            problem = (
                _field_problem(owner, "text", part.text)
                or _field_problem(owner, "signature", part.signature, optional=True)
                or _field_problem(owner, "redacted_data", part.redacted_data, optional=True)
            )
        elif isinstance(part, ToolCallPart):
            problem = (
                _field_problem(owner, "id", part.id, name=True)
                or _field_problem(owner, "name", part.name, name=True)
                or _field_problem(owner, "arguments", part.arguments)
            )
        else:
            return (
                f"{owner} of the assistant message is not a content part (TextPart, ReasoningPart or "
                f"ToolCallPart): {type(part).__name__} {safe_repr(part, _SHOWN)}"
            )
        if problem is not None:
            return problem
    return None


class MessageView(Sequence[Message]):
    """A read-only view of a conversation as it is now, made without copying it.

    A conversation only grows (messages are appended, never changed or removed; a
    repair builds a new list), so "the first *n* messages of this list" never
    changes: a model request can hold that view while the session appends. A
    ``prefix`` (the system prompt) is shown before them. Compaction, when it comes,
    replaces the list the session appends to (a summary and the recent messages);
    views made before keep the old one.
    """

    __slots__ = ("_log", "_prefix", "_stop")

    def __init__(self, log: list[Message], prefix: tuple[Message, ...] = ()) -> None:
        self._log = log
        self._prefix = prefix
        self._stop = len(log)

    def __len__(self) -> int:
        return len(self._prefix) + self._stop

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Message, ...]: ...

    def __getitem__(self, index: int | slice) -> Message | tuple[Message, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("message index out of range")
        prefix = len(self._prefix)
        return self._prefix[index] if index < prefix else self._log[index - prefix]

    def __iter__(self) -> Iterator[Message]:
        yield from self._prefix
        log = self._log
        for index in range(self._stop):
            yield log[index]

    def __add__(self, other: Sequence[Message]) -> tuple[Message, ...]:
        if isinstance(other, str | bytes) or not isinstance(other, Sequence):
            return NotImplemented
        return (*self, *other)

    def __radd__(self, other: Sequence[Message]) -> tuple[Message, ...]:
        # ``(system, *extra) + request.messages``: a middleware cannot tell a view from a tuple.
        if isinstance(other, str | bytes) or not isinstance(other, Sequence):
            return NotImplemented
        return (*other, *self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MessageView({len(self)} messages)"


class CallIdIndex(Collection[str]):
    """The tool call ids of a growing conversation, kept up to date by reading only what was appended.

    The reply assembler asks it whether an id is taken (a model that repeats an id
    from an earlier turn gets a new one). When the conversation is replaced by a new
    list (a repair, a rebuild), it is read again once.
    """

    __slots__ = ("_ids", "_log", "_seen")

    def __init__(self) -> None:
        self._log: list[Message] | None = None
        self._seen = 0
        self._ids: set[str] = set()

    def update(self, log: list[Message]) -> CallIdIndex:
        if log is not self._log:
            self._log, self._seen, self._ids = log, 0, set()
        ids = self._ids
        for index in range(self._seen, len(log)):
            message = log[index]
            if isinstance(message, AssistantMessage):
                ids.update(part.id for part in message.parts if isinstance(part, ToolCallPart))
        self._seen = len(log)
        return self

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._ids

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)
