"""One model stream -> one reply: the assembler every model call of the loop goes through.

Sans-I/O: no Trio, no clock. The loop feeds each `StreamChunk` to
`ReplyAssembler.feed` as it arrives and calls `ReplyAssembler.finish` once the
stream ended; the `ModelReply` is what the history and the journal receive.

Rules
=====

* Parts: the assistant message holds the reasoning parts first (arrival order),
  then one `TextPart` with all the text (if any text arrived), then the tool
  calls by stream index. Anthropic wants thinking blocks before ``tool_use``;
  the other providers read text and calls apart, so this order suits all.
* Reasoning: consecutive `ReasoningDelta` text joins one `ReasoningPart`. A
  ``signature`` attaches to the part being built (an empty one if none is) and
  ends it. A ``redacted_data`` delta is a part of its own. Any text or tool call
  chunk ends the part being built, so reasoning is never merged across them.
* Tool calls: a call is known from its `ToolCallStart` and complete with its
  `ToolCallEnd` (which carries the whole arguments, so deltas are not kept).
  A started call whose end never came is *cut off*: it becomes
  ``ToolCallPart(id, name or "_cut_off", "")`` and its assigned id is listed in
  `ModelReply.cut_off`; such a call must never run.
* Call ids: every call of a reply gets a unique id, computed from the chunks
  alone (the same chunks always give the same ids). Non-empty ids are kept on
  their first occurrence (in index order). Then, in index order, an empty id
  becomes ``call_<index>`` and a repeated id stays the base; a base already
  taken gets ``~2``, ``~3`` ... (the first suffix free). Ids passed as
  ``reserved`` (those already in the conversation) count as taken.
  `ModelReply.renamed` maps each changed id (assigned -> original).
* Usage: the last `UsageChunk` wins (providers send cumulative counts).
  Finish: the last `FinishChunk` wins; none means ``stop``.
* Text is well-formed: every string of the reply (text, reasoning, call ids,
  names and arguments) has a UTF-16 surrogate pair split across two deltas
  joined into its character, and any other lone surrogate replaced by U+FFFD
  (`well_formed`). A JSON ``\\ud83d`` escape decodes to a lone surrogate, which
  no request or journal can encode: one kept would fail every later request.

`parse_tool_arguments` turns a call's raw arguments into the object a tool
gets, or a `ToolArgumentsError` whose message the model reads.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from .._builders import constructor
from .._json import MAX_JSON_INT_BITS
from ._messages import (
    AssistantMessage,
    ContentPart,
    FinishChunk,
    FinishReason,
    ReasoningDelta,
    ReasoningPart,
    StreamChunk,
    TextDelta,
    TextPart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallPart,
    ToolCallStart,
    Usage,
    UsageChunk,
)

__all__ = [
    "CUT_OFF_NAME",
    "MAX_ARGUMENT_DEPTH",
    "DeltaMender",
    "JSONTextError",
    "ModelReply",
    "ReplyAssembler",
    "ToolArgumentsError",
    "assign_call_ids",
    "has_surrogate",
    "parse_json_value",
    "parse_tool_arguments",
    "well_formed",
]

CUT_OFF_NAME = "_cut_off"
"""The name of a cut-off call whose start carried no name."""

_SUFFIX = "~"  # <id>~2: a separator no provider uses in its own ids, so a renamed id never looks original


@attrs.frozen
class ModelReply:
    """One assembled model reply."""

    message: AssistantMessage
    finish_reason: FinishReason
    usage: Usage = attrs.field(factory=Usage)
    cut_off: tuple[str, ...] = ()
    """Assigned ids of the calls whose end never arrived (in index order)."""
    renamed: Mapping[str, str] = attrs.field(factory=dict)
    """Assigned id -> the id the model sent ("" when it sent none), for calls whose id changed."""

    @property
    def tool_calls(self) -> tuple[ToolCallPart, ...]:
        return self.message.tool_calls

    @property
    def reasoning(self) -> tuple[ReasoningPart, ...]:
        return tuple(part for part in self.message.parts if isinstance(part, ReasoningPart))


class ReplyAssembler:
    """Feeds on the chunks of one stream; `finish` returns the `ModelReply`. One reply per assembler."""

    __slots__ = (
        "_ended",
        "_finish",
        "_reasoning",
        "_reasoning_text",
        "_reserved",
        "_started",
        "_text",
        "_usage",
    )

    def __init__(self, *, reserved: Collection[str] = ()) -> None:
        self._reserved = reserved  # only asked `in`: a long conversation's ids are never copied
        self._text: list[str] = []
        self._reasoning: list[ReasoningPart] | tuple[()] = ()  # made by the first reasoning part
        self._reasoning_text: list[str] | None = None  # the part being built, None when none is
        self._started: dict[int, ToolCallStart] = {}
        self._ended: dict[int, ToolCallEnd] = {}
        self._finish = FinishReason.STOP
        self._usage = _NO_USAGE

    def feed(self, chunk: StreamChunk) -> None:
        # Ordered by frequency: text and argument deltas are nearly every chunk.
        if isinstance(chunk, TextDelta):
            if self._reasoning_text is not None:
                self._close_reasoning(None)
            self._text.append(chunk.text)
        elif isinstance(chunk, ToolCallDelta):
            if self._reasoning_text is not None:
                self._close_reasoning(None)
        elif isinstance(chunk, ReasoningDelta):
            self._feed_reasoning(chunk)
        elif isinstance(chunk, ToolCallStart):
            if self._reasoning_text is not None:
                self._close_reasoning(None)
            self._started[chunk.index] = chunk
        elif isinstance(chunk, ToolCallEnd):
            if self._reasoning_text is not None:
                self._close_reasoning(None)
            self._ended[chunk.index] = chunk
        elif isinstance(chunk, UsageChunk):
            self._usage = chunk.usage
        elif isinstance(chunk, FinishChunk):
            self._finish = chunk.reason
        else:  # pragma: no cover - the StreamChunk union is closed
            raise TypeError(f"not a stream chunk: {chunk!r}")

    @property
    def reported_usage(self) -> Usage | None:
        """The call's usage so far (the last `UsageChunk`: the counts are cumulative), ``None``
        while it reported none."""
        return None if self._usage is _NO_USAGE else self._usage

    def _feed_reasoning(self, chunk: ReasoningDelta) -> None:
        if chunk.text:
            if self._reasoning_text is None:
                self._reasoning_text = []
            self._reasoning_text.append(chunk.text)
        if chunk.signature is not None:
            if self._reasoning_text is None:
                self._reasoning_text = []
            self._close_reasoning(chunk.signature)
        if chunk.redacted_data is not None:
            if self._reasoning_text is not None:
                self._close_reasoning(None)
            self._add_reasoning(ReasoningPart("", redacted_data=well_formed(chunk.redacted_data)))

    def _add_reasoning(self, part: ReasoningPart) -> None:
        if self._reasoning:
            self._reasoning.append(part)
        else:
            self._reasoning = [part]

    def _close_reasoning(self, signature: str | None) -> None:
        assert self._reasoning_text is not None
        self._add_reasoning(ReasoningPart(well_formed("".join(self._reasoning_text)), _optional(signature)))
        self._reasoning_text = None

    def finish(self) -> ModelReply:
        if self._reasoning_text is not None:
            self._close_reasoning(None)
        if not self._started and not self._ended:  # no calls: nothing to name
            text = well_formed("".join(self._text))
            parts: list[ContentPart] = [*self._reasoning, TextPart(text)] if text else [*self._reasoning]
            return _model_reply(_assistant_message(tuple(parts)), self._finish, self._usage, (), _NO_RENAMES)
        indices = sorted(self._started.keys() | self._ended.keys())
        originals: list[str] = []
        for index in indices:
            end = self._ended.get(index)
            start = self._started.get(index)
            originals.append(
                well_formed((end.id if end is not None else "") or (start.id if start is not None else ""))
            )
        assigned = assign_call_ids(indices, originals, self._reserved)
        calls: list[ToolCallPart] = []
        cut_off: list[str] = []
        renamed: dict[str, str] = {}
        for index, original, call_id in zip(indices, originals, assigned, strict=True):
            end = self._ended.get(index)
            if end is not None:
                calls.append(_tool_call_part(call_id, well_formed(end.name), well_formed(end.arguments)))
            else:
                start = self._started[index]
                calls.append(ToolCallPart(call_id, well_formed(start.name) or CUT_OFF_NAME, ""))
                cut_off.append(call_id)
            if call_id != original:
                renamed[call_id] = original
        text = well_formed("".join(self._text))
        parts = [*self._reasoning]
        if text:
            parts.append(TextPart(text))
        parts.extend(calls)
        return _model_reply(
            _assistant_message(tuple(parts)),
            self._finish,
            self._usage,
            tuple(cut_off),
            MappingProxyType(renamed) if renamed else _NO_RENAMES,
        )


# ---------------------------------------------------------------- surrogates

_SURROGATE = re.compile("[\ud800-\udfff]")


def well_formed(text: str) -> str:
    """*text* as valid Unicode: surrogate pairs (halves that arrived apart) joined into their
    character, any other lone surrogate replaced by U+FFFD. The same object when it has none."""
    if text.isascii() or _SURROGATE.search(text) is None:  # isascii() is O(1): the usual case
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def has_surrogate(text: str) -> bool:
    """Whether *text* holds a surrogate code point (lone, or a pair of halves): text that is not
    well-formed Unicode, which `well_formed` (and so every request body) would change."""
    return not text.isascii() and _SURROGATE.search(text) is not None


def _optional(text: str | None) -> str | None:
    return None if text is None else well_formed(text)


class DeltaMender:
    """Makes one channel of stream deltas (a text, a reasoning, a call's arguments) well-formed as
    they are published: a high surrogate that ends a delta is held back and sent with the next
    one (its low half, split off by a proxy slicing UTF-16, comes first thing there); any other
    lone surrogate becomes U+FFFD. `flush` returns what is still held, as U+FFFD, when the
    channel ends. The deltas joined (with the flush) equal `well_formed` of the raw ones joined.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = ""

    def mend(self, text: str) -> str:
        if self._held:
            text, self._held = self._held + text, ""
        elif text.isascii() or _SURROGATE.search(text) is None:  # the usual case: a cheap check
            return text
        if text and "\ud800" <= text[-1] <= "\udbff":
            text, self._held = text[:-1], text[-1]
        return well_formed(text)

    def flush(self) -> str:
        """U+FFFD for a high surrogate still held (its pair never came), else ``""``."""
        held, self._held = self._held, ""
        return "\ufffd" if held else ""


_NO_RENAMES: Mapping[str, str] = MappingProxyType({})
# Two a request: built cheaper (see `_builders`), every field given (a message's parts a tuple).
_assistant_message: Callable[[tuple[ContentPart, ...]], AssistantMessage] = constructor(
    AssistantMessage, trusted=("parts",)
)
_tool_call_part: Callable[[str, str, str], ToolCallPart] = constructor(ToolCallPart)
_model_reply: Callable[[AssistantMessage, FinishReason, Usage, tuple[str, ...], Mapping[str, str]], ModelReply] = (
    constructor(ModelReply)
)
_NO_USAGE = Usage()  # immutable: one for every reply that reports none


class _Taken:
    """The ids taken: this reply's own, and *reserved* (only asked, never copied)."""

    __slots__ = ("new", "reserved")

    def __init__(self, reserved: Collection[str]) -> None:
        self.new: set[str] = set()
        self.reserved = reserved

    def __contains__(self, call_id: object) -> bool:
        return call_id in self.new or call_id in self.reserved

    def add(self, call_id: str) -> None:
        self.new.add(call_id)


def assign_call_ids(indices: list[int], originals: list[str], reserved: Collection[str] = ()) -> list[str]:
    """Unique ids for calls at ``indices`` that the model named ``originals`` (see the module rules)."""
    taken = _Taken(reserved)
    assigned: list[str | None] = [None] * len(originals)
    # First occurrences keep their id, so a renamed call can never take a later call's real id.
    for position, original in enumerate(originals):
        if original and original not in taken:
            taken.add(original)
            assigned[position] = original
    # Per base, the suffix to try next (1: the base itself). The ones below it are taken and stay
    # taken, so a base's suffixes are probed once in all: probing from 2 for every repeat was quadratic.
    next_suffix: dict[str, int] = {}
    for position, (index, original) in enumerate(zip(indices, originals, strict=True)):
        if assigned[position] is not None:
            continue
        base = original or f"call_{index}"
        n = next_suffix.get(base, 1)
        candidate = base if n == 1 else f"{base}{_SUFFIX}{n}"
        while candidate in taken:
            n += 1
            candidate = f"{base}{_SUFFIX}{n}"
        next_suffix[base] = n + 1
        taken.add(candidate)
        assigned[position] = candidate
    return [call_id for call_id in assigned if call_id is not None]


# ---------------------------------------------------------------- tool arguments

MAX_ARGUMENT_DEPTH = 64
"""The deepest nesting of arrays and objects accepted in tool arguments."""

# A string (closed or running to the end) or a bracket; a string always matches, so the scan is linear.
_TOKENS = re.compile(r'"(?:[^"\\]+|\\.)*"?|[\[\]{}]', re.DOTALL)
_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}


class ToolArgumentsError(ValueError):
    """Arguments a tool cannot receive; ``message`` is written for the model that produced them."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Refused(Exception):
    """Raised from inside the JSON parser's hooks; carries the model-facing message."""


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a valid JSON number; use a finite number or null")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused(f"the number {text[:40]} is too large (beyond a 64-bit float)")
    return value


# Fewer digits than this is always within MAX_JSON_INT_BITS (10**616 < 2**2048): most ints are not measured.
_SHORT_INT = len(str(1 << MAX_JSON_INT_BITS)) - 1


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # longer than sys.get_int_max_str_digits()
        raise _Refused(
            f"an integer with {len(text.lstrip('-'))} digits is too long "
            f"(at most {sys.get_int_max_str_digits()} digits); send it as a string"
        ) from None
    # The shared JSON rule's bound (`MAX_JSON_INT_BITS`): a larger one would be refused later, by the
    # journal or the tool's input check, as a value that is no JSON rather than as the model's text.
    if len(text) > _SHORT_INT and value.bit_length() > MAX_JSON_INT_BITS:
        raise _Refused(
            f"an integer with {len(text.lstrip('-'))} digits is too large "
            f"(at most {MAX_JSON_INT_BITS} bits, about {_SHORT_INT} digits); send it as a string"
        )
    return value


# One decoder for every call: ``json.loads`` with hooks builds a new decoder and scanner each time.
_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_float, parse_int=_int)


def _depth(text: str) -> int:
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token == "[" or token == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif token == "]" or token == "}":
            depth -= 1
    return deepest


class JSONTextError(ValueError):
    """Text that `parse_json_value` does not read; ``problem`` completes "<the text> is/are ..."."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def parse_json_value(text: str) -> Any:
    """A model's (untrusted) *text* as a JSON value, or `JSONTextError`: nested deeper than
    `MAX_ARGUMENT_DEPTH`, ``NaN`` or an infinite number, an integer too long to convert, or
    anything else that is not JSON. The interpreter's recursion limit is never reached."""
    # Checked before parsing: the parser recurses per level, so a deep document must never reach it
    # (a text shorter than the limit cannot open more brackets than that).
    if len(text) > MAX_ARGUMENT_DEPTH and _depth(text) > MAX_ARGUMENT_DEPTH:
        raise JSONTextError(f"nested more than {MAX_ARGUMENT_DEPTH} levels deep (arrays and objects)")
    try:
        return _DECODER.decode(text)
    except _Refused as exc:
        raise JSONTextError(f"not valid: {exc}") from None
    except json.JSONDecodeError as exc:
        raise JSONTextError(f"not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:  # belt and braces: the checks above should catch these
        raise JSONTextError(f"unreadable: {exc}") from None


def parse_tool_arguments(text: str) -> dict[str, Any]:
    """The arguments of a call as a JSON object (``{}`` for empty text), or `ToolArgumentsError` ("invalid_json")."""
    if not text.strip():
        return {}
    try:
        value = parse_json_value(text)
    except JSONTextError as exc:
        raise ToolArgumentsError("invalid_json", f"the arguments are {exc.problem}") from None
    if not isinstance(value, dict):
        kind = "null" if value is None else _KINDS.get(type(value), type(value).__name__)
        raise ToolArgumentsError("invalid_json", f"the arguments must be a JSON object ({{...}}), not {kind}")
    return value
