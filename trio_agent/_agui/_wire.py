"""AG-UI on the wire: the protocol's events and messages as attrs values, and their JSON.

The classes mirror the AG-UI protocol (version `PROTOCOL_VERSION`) with snake_case
fields; `to_wire` gives the JSON object a client reads: camelCase keys, the
``type`` discriminator first (``role`` for a message), fields that are ``None``
left out. A nested subagent's events carry ``subagent_run_id``.

Rules
=====

* One converter (cattrs) writes every class: a field ``tool_call_id`` is the key
  ``toolCallId``; the class's ``TYPE`` (an AG-UI ``EventType`` name) is ``type``.
* Values the protocol types as "any JSON" (a custom event's value, a run's result,
  an interrupt's metadata) are written through `json_value`: JSON as it is, an
  attrs value through its fields, anything else as its ``str`` (a wire event is
  never refused for an odd value a hook put there); a container that contains
  itself is written as its ``str`` where it repeats, and nesting past
  `MAX_JSON_DEPTH` (200) is cut there. An int too long for the interpreter to
  print (more than ``sys.get_int_max_str_digits()`` digits, 4300 by default:
  ``json.dumps`` raises on it) is written as a string saying so.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Mapping
from typing import Any, ClassVar, TypeAlias

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override

from .._convert import LazyConverter
from .._json import MAX_JSON_DEPTH

__all__ = [
    "PROTOCOL_VERSION",
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
    "to_wire",
]

PROTOCOL_VERSION = "1.0"
"""The AG-UI protocol version these shapes follow."""


# ---------------------------------------------------------------- pieces


@attrs.frozen(kw_only=True)
class TokenUsage:
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    reasoning_tokens: int | None = None
    cached_input_tokens: int | None = None


@attrs.frozen(kw_only=True)
class Interrupt:
    """One question of a paused run (``RUN_FINISHED`` with an ``interrupt`` outcome)."""

    id: str
    reason: str
    message: str | None = None
    tool_call_id: str | None = None
    response_schema: Mapping[str, Any] | None = None
    metadata: Mapping[str, Any] | None = None
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class RunOutcome:
    """``success``, ``cancelled`` or ``interrupt`` (then with its ``interrupts``)."""

    type: str
    interrupts: tuple[Interrupt, ...] | None = None


@attrs.frozen(kw_only=True)
class SubagentOutcome:
    """``success``, or ``suspended`` waiting on ``interrupt_ids``."""

    type: str
    interrupt_ids: tuple[str, ...] | None = None


@attrs.frozen(kw_only=True)
class FunctionCall:
    name: str
    arguments: str


@attrs.frozen(kw_only=True)
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


# ---------------------------------------------------------------- messages (MESSAGES_SNAPSHOT)


@attrs.frozen(kw_only=True)
class UserMessage:
    ROLE: ClassVar[str] = "user"
    id: str
    content: str


@attrs.frozen(kw_only=True)
class SystemMessage:
    ROLE: ClassVar[str] = "system"
    id: str
    content: str


@attrs.frozen(kw_only=True)
class AssistantMessage:
    ROLE: ClassVar[str] = "assistant"
    id: str
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None


@attrs.frozen(kw_only=True)
class ToolMessage:
    ROLE: ClassVar[str] = "tool"
    id: str
    content: str
    tool_call_id: str
    error: str | None = None


AgUiMessage: TypeAlias = UserMessage | SystemMessage | AssistantMessage | ToolMessage


# ---------------------------------------------------------------- events


@attrs.frozen(kw_only=True)
class RunStartedEvent:
    TYPE: ClassVar[str] = "RUN_STARTED"
    thread_id: str
    run_id: str
    parent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class RunFinishedEvent:
    TYPE: ClassVar[str] = "RUN_FINISHED"
    thread_id: str
    run_id: str
    outcome: RunOutcome | None = None
    result: Any = None
    usage: tuple[TokenUsage, ...] | None = None


@attrs.frozen(kw_only=True)
class RunErrorEvent:
    TYPE: ClassVar[str] = "RUN_ERROR"
    message: str
    code: str | None = None


@attrs.frozen(kw_only=True)
class StepStartedEvent:
    TYPE: ClassVar[str] = "STEP_STARTED"
    step_name: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class StepFinishedEvent:
    TYPE: ClassVar[str] = "STEP_FINISHED"
    step_name: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class TextMessageStartEvent:
    TYPE: ClassVar[str] = "TEXT_MESSAGE_START"
    message_id: str
    role: str = "assistant"
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class TextMessageContentEvent:
    TYPE: ClassVar[str] = "TEXT_MESSAGE_CONTENT"
    message_id: str
    delta: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class TextMessageEndEvent:
    TYPE: ClassVar[str] = "TEXT_MESSAGE_END"
    message_id: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ReasoningStartEvent:
    TYPE: ClassVar[str] = "REASONING_START"
    message_id: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ReasoningMessageStartEvent:
    TYPE: ClassVar[str] = "REASONING_MESSAGE_START"
    message_id: str
    role: str = "reasoning"
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ReasoningMessageContentEvent:
    TYPE: ClassVar[str] = "REASONING_MESSAGE_CONTENT"
    message_id: str
    delta: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ReasoningMessageEndEvent:
    TYPE: ClassVar[str] = "REASONING_MESSAGE_END"
    message_id: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ReasoningEndEvent:
    TYPE: ClassVar[str] = "REASONING_END"
    message_id: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ToolCallStartEvent:
    TYPE: ClassVar[str] = "TOOL_CALL_START"
    tool_call_id: str
    tool_call_name: str
    parent_message_id: str | None = None
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ToolCallArgsEvent:
    TYPE: ClassVar[str] = "TOOL_CALL_ARGS"
    tool_call_id: str
    delta: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ToolCallEndEvent:
    TYPE: ClassVar[str] = "TOOL_CALL_END"
    tool_call_id: str
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class ToolCallResultEvent:
    TYPE: ClassVar[str] = "TOOL_CALL_RESULT"
    message_id: str
    tool_call_id: str
    content: str
    role: str = "tool"
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class MessagesSnapshotEvent:
    TYPE: ClassVar[str] = "MESSAGES_SNAPSHOT"
    messages: tuple[AgUiMessage, ...]


@attrs.frozen(kw_only=True)
class CustomEvent:
    TYPE: ClassVar[str] = "CUSTOM"
    name: str
    value: Any = None
    subagent_run_id: str | None = None


@attrs.frozen(kw_only=True)
class SubagentStartedEvent:
    TYPE: ClassVar[str] = "SUBAGENT_STARTED"
    subagent_run_id: str
    name: str
    description: str | None = None


@attrs.frozen(kw_only=True)
class SubagentFinishedEvent:
    TYPE: ClassVar[str] = "SUBAGENT_FINISHED"
    subagent_run_id: str
    result: Any = None
    outcome: SubagentOutcome | None = None


@attrs.frozen(kw_only=True)
class SubagentErrorEvent:
    TYPE: ClassVar[str] = "SUBAGENT_ERROR"
    subagent_run_id: str
    message: str
    code: str | None = None


AgUiEvent: TypeAlias = (
    RunStartedEvent
    | RunFinishedEvent
    | RunErrorEvent
    | StepStartedEvent
    | StepFinishedEvent
    | TextMessageStartEvent
    | TextMessageContentEvent
    | TextMessageEndEvent
    | ReasoningStartEvent
    | ReasoningMessageStartEvent
    | ReasoningMessageContentEvent
    | ReasoningMessageEndEvent
    | ReasoningEndEvent
    | ToolCallStartEvent
    | ToolCallArgsEvent
    | ToolCallEndEvent
    | ToolCallResultEvent
    | MessagesSnapshotEvent
    | CustomEvent
    | SubagentStartedEvent
    | SubagentFinishedEvent
    | SubagentErrorEvent
)


# ---------------------------------------------------------------- the converter


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.title() for word in rest)


def json_value(value: object) -> Any:
    """``value`` as JSON data: JSON as it is, attrs values and mappings by their fields,
    sequences item by item, an enum by its value, anything else (and a non-finite
    number) as its ``str`` (or, if its ``str`` raises, its type's name in ``<>``); an
    int with more digits than the interpreter prints (``sys.get_int_max_str_digits()``)
    as ``"<int with more than N digits>"``.

    Never fails and stays bounded: a container that contains itself is written as its
    ``str`` where it comes round again, and containers nested past `MAX_JSON_DEPTH`
    are cut there, written as a string that says so (the result must still go through
    ``json.dumps``, whose own recursion has a limit)."""
    return _json_value(value, 0, set())


def _json_value(value: object, depth: int, inside: set[int]) -> Any:
    if value is None or isinstance(value, (bool, str, int)):
        if isinstance(value, enum.Enum):
            value = value.value
        if isinstance(value, int) and value.bit_length() > _PRINTABLE_BITS:
            return _long_int(value)
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return _json_value(value.value, depth, inside)
    is_attrs = attrs.has(type(value))
    if not (is_attrs or isinstance(value, (Mapping, list, tuple))):
        return _text(value)
    if id(value) in inside:  # it contains itself: written once, then as its str where it repeats
        return _text(value)
    if depth >= MAX_JSON_DEPTH:
        return f"<{type(value).__name__} nested more than {MAX_JSON_DEPTH} levels deep>"
    inside.add(id(value))
    try:
        if isinstance(value, Mapping):
            return {_text(key): _json_value(item, depth + 1, inside) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [_json_value(item, depth + 1, inside) for item in value]
        names = [field.name for field in attrs.fields(type(value))]  # type: ignore[arg-type]
        return {_camel(name): _json_value(getattr(value, name), depth + 1, inside) for name in names}
    finally:
        inside.discard(id(value))


_PRINTABLE_BITS = 2_000
"""An int of at most this many bits has at most 603 digits: printable whatever the interpreter's
limit on int-to-text conversion (``sys.set_int_max_str_digits``: 0, or at least 640)."""


def _long_int(value: int) -> int | str:
    """*value* if ``json.dumps`` can print it, else a string saying what it is: past the interpreter's
    limit on int-to-text conversion (`sys.get_int_max_str_digits`) printing it raises."""
    try:
        int.__repr__(value)
    except ValueError:
        return _too_long()
    return value


def _too_long() -> str:
    return f"<int with more than {sys.get_int_max_str_digits()} digits>"


def _text(value: object) -> str:
    """``str(value)``; a ``__str__`` that raises (or recurses without end) gives the type's name."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:
        return _too_long() if type(value) is int else f"<{type(value).__name__}>"


_WIRE = frozenset(value for value in list(globals().values()) if isinstance(value, type) and attrs.has(value))
"""Every class above (taken here: the public module renames their ``__module__``)."""


def _is_wire(kind: Any) -> bool:
    return kind in _WIRE


def _wire_hook(kind: type[Any], converter: cattrs.Converter) -> Any:
    overrides = {
        field.name: override(rename=_camel(field.name), omit_if_default=field.default is None)
        for field in attrs.fields(kind)
    }
    fields = make_dict_unstructure_fn(kind, converter, **overrides)  # type: ignore[arg-type]
    tag = ("type", kind.TYPE) if hasattr(kind, "TYPE") else ("role", kind.ROLE) if hasattr(kind, "ROLE") else None

    def unstructure(value: Any) -> dict[str, Any]:
        data: dict[str, Any] = fields(value)
        return data if tag is None else {tag[0]: tag[1], **data}

    return unstructure


def _configure(converter: cattrs.Converter) -> None:
    converter.register_unstructure_hook_factory(_is_wire, lambda kind: _wire_hook(kind, converter))
    converter.register_unstructure_hook_func(lambda kind: kind == Mapping[str, Any], json_value)


_converter = LazyConverter(configure=_configure)


def to_wire(event: AgUiEvent | AgUiMessage | Interrupt) -> dict[str, Any]:
    """The JSON object a client reads for ``event`` (camelCase keys, its ``type`` or ``role``)."""
    data: dict[str, Any] = _converter.unstructure(event, type(event))
    return data
