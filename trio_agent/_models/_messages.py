"""The message model: conversation messages, content parts, usage, finish reasons and stream chunks.

Values are frozen attrs classes; `message_converter` (de)serialises them with
cattrs, tagging unions by a ``type`` field so a stored conversation round-trips.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias, TypeVar

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union

from .._builders import constructor
from .._convert import LazyConverter

__all__ = [
    "AssistantMessage",
    "ContentPart",
    "FinishChunk",
    "FinishReason",
    "Message",
    "ModelResponse",
    "ReasoningDelta",
    "ReasoningPart",
    "StreamChunk",
    "SystemMessage",
    "TextDelta",
    "TextPart",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallPart",
    "ToolCallStart",
    "ToolResultMessage",
    "ToolSpec",
    "Usage",
    "UsageChunk",
    "UserMessage",
    "message_converter",
]


class FinishReason(enum.Enum):
    """Why the model stopped. Provider values are mapped explicitly (see the providers guide)."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"
    PAUSE_TURN = "pause_turn"  # Anthropic: a long-running turn was paused; send it back to continue
    REFUSAL = "refusal"  # Anthropic: the model refused for safety reasons


MAX_TOKEN_COUNT = 2**53 - 1
"""The largest token count a `Usage` may hold (exact as a JSON number everywhere, and a session's
totals stay far inside a 64-bit journal column). A provider treats a larger or a negative count
from a server as it treats a count of the wrong type, and so a total it computes (input + output)
that passes the bound; `ModelService` refuses a `Usage` with one (or with a count that is no int)
from a custom provider or a middleware, streamed (`UsageChunk`) or not (`ModelResponse.usage`)."""


@attrs.frozen
class Usage:
    """Token counts; the details are ``None`` where a provider does not report them."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    cached_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    reasoning_tokens: int | None = None

    def __add__(self, other: Usage) -> Usage:
        return _usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.total_tokens + other.total_tokens,
            _add_details(self.cached_input_tokens, other.cached_input_tokens),
            _add_details(self.cache_creation_input_tokens, other.cache_creation_input_tokens),
            _add_details(self.reasoning_tokens, other.reasoning_tokens),
        )


def _add_details(a: int | None, b: int | None) -> int | None:
    return None if a is None and b is None else (a or 0) + (b or 0)


# A run adds a usage per model call: built cheaper (see `_builders`), every field given.
_usage: Callable[[int, int, int, int | None, int | None, int | None], Usage] = constructor(Usage)


@attrs.frozen
class TextPart:
    text: str


@attrs.frozen
class ReasoningPart:
    """Model reasoning. ``signature`` (Anthropic thinking) must be sent back unchanged with tool use;
    ``redacted_data`` carries an Anthropic ``redacted_thinking`` block."""

    text: str
    signature: str | None = None
    redacted_data: str | None = None


@attrs.frozen
class ToolCallPart:
    """A tool call requested by the model. ``arguments`` is the raw JSON text as the model produced it."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> Any:
        """The arguments as a JSON value (``{}`` for none); raises ``ValueError`` on what is not JSON,
        ``NaN`` or an infinite number, or nesting deeper than the assembler accepts (an error the
        model must see), never ``RecursionError``: the text is the model's, so untrusted."""
        from ._assemble import parse_json_value  # the assembler imports this module

        return parse_json_value(self.arguments or "{}")


ContentPart: TypeAlias = TextPart | ReasoningPart | ToolCallPart


@attrs.frozen
class SystemMessage:
    content: str


@attrs.frozen
class UserMessage:
    content: str


def _parts_tuple(parts: Iterable[ContentPart]) -> tuple[ContentPart, ...]:
    return tuple(parts)


@attrs.frozen
class AssistantMessage:
    parts: tuple[ContentPart, ...] = attrs.field(default=(), converter=_parts_tuple)

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.parts if isinstance(part, TextPart))

    @property
    def tool_calls(self) -> tuple[ToolCallPart, ...]:
        return tuple(part for part in self.parts if isinstance(part, ToolCallPart))


@attrs.frozen
class ToolResultMessage:
    """The answer to one tool call, paired with it by ``tool_call_id``."""

    tool_call_id: str
    content: str
    is_error: bool = False


Message: TypeAlias = SystemMessage | UserMessage | AssistantMessage | ToolResultMessage

MESSAGE_CLASSES: frozenset[type] = frozenset(typing.get_args(Message))
"""The classes a `Message` is, for the checks that a value is one (a set: the common exact-class
test is one lookup)."""


@attrs.frozen
class ToolSpec:
    """A tool as the model sees it: name, description and JSON Schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]


@attrs.frozen
class ModelResponse:
    """One complete (non-streaming) model reply."""

    message: AssistantMessage
    finish_reason: FinishReason
    usage: Usage = Usage()
    model: str = ""
    id: str = ""
    finish_explanation: str | None = None  # the server's words on why it stopped (an Anthropic refusal's)


# -- stream chunks ------------------------------------------------------------------------


@attrs.frozen
class TextDelta:
    text: str


@attrs.frozen
class ReasoningDelta:
    """A piece of reasoning; ``signature`` and ``redacted_data`` arrive whole (Anthropic)."""

    text: str = ""
    signature: str | None = None
    redacted_data: str | None = None


@attrs.frozen
class ToolCallStart:
    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallDelta:
    index: int
    arguments: str


@attrs.frozen
class ToolCallEnd:
    """A tool call whose arguments are complete (assembled from the deltas)."""

    index: int
    id: str
    name: str
    arguments: str


@attrs.frozen
class UsageChunk:
    usage: Usage


@attrs.frozen
class FinishChunk:
    """The last chunk. ``explanation``: the server's words on why it stopped, when it gave any
    (an Anthropic refusal's ``stop_details.explanation``)."""

    reason: FinishReason
    explanation: str | None = None


StreamChunk: TypeAlias = (
    TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | UsageChunk | FinishChunk
)

# -- serialisation --------------------------------------------------------------------------

T = TypeVar("T")


def configure_messages(converter: cattrs.Converter) -> cattrs.Converter:
    """Teach *converter* the message unions (tagged by ``type``); other wire formats embed messages."""
    configure_tagged_union(ContentPart, converter, tag_name="type")
    configure_tagged_union(Message, converter, tag_name="type")
    configure_tagged_union(StreamChunk, converter, tag_name="type")
    return converter


message_converter: cattrs.Converter = LazyConverter(configure=configure_messages, forbid_extra_keys=True)
"""The cattrs converter for messages, responses and chunks (unions tagged by ``type``)."""
