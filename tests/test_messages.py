"""The message model: cattrs round trips through JSON, usage arithmetic, assistant helpers, strict structuring."""

from __future__ import annotations

import json
from typing import Any

import cattrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent.models import (
    AssistantMessage,
    ContentPart,
    FinishChunk,
    FinishReason,
    Message,
    ModelResponse,
    ReasoningDelta,
    ReasoningPart,
    StreamChunk,
    SystemMessage,
    TextDelta,
    TextPart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallPart,
    ToolCallStart,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UsageChunk,
    UserMessage,
    message_converter,
)

# -- strategies ------------------------------------------------------------------------------

text = st.text(max_size=30)
maybe_text = st.none() | text
count = st.integers(min_value=0, max_value=2**40)
maybe_count = st.none() | count

usages = st.builds(
    Usage,
    input_tokens=count,
    output_tokens=count,
    total_tokens=count,
    cached_input_tokens=maybe_count,
    cache_creation_input_tokens=maybe_count,
    reasoning_tokens=maybe_count,
)

# Tool arguments are raw model text: valid JSON, broken JSON or anything at all.
raw_arguments = st.one_of(
    st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4).map(json.dumps),
    st.sampled_from(['{"a": ', "not json", "", "[1, 2", '{"a": 1}}']),
    text,
)

text_parts = st.builds(TextPart, text)
reasoning_parts = st.builds(ReasoningPart, text, signature=maybe_text, redacted_data=maybe_text)
tool_call_parts = st.builds(ToolCallPart, id=text, name=text, arguments=raw_arguments)
content_parts = st.one_of(text_parts, reasoning_parts, tool_call_parts)

assistant_messages = st.builds(AssistantMessage, st.lists(content_parts, max_size=6).map(tuple))
messages = st.one_of(
    st.builds(SystemMessage, text),
    st.builds(UserMessage, text),
    assistant_messages,
    st.builds(ToolResultMessage, tool_call_id=text, content=text, is_error=st.booleans()),
)
conversations = st.lists(messages, max_size=12)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
tool_specs = st.builds(
    ToolSpec, name=text, description=text, parameters=st.dictionaries(st.text(max_size=8), json_values, max_size=5)
)
finish_reasons = st.sampled_from(FinishReason)
responses = st.builds(
    ModelResponse, message=assistant_messages, finish_reason=finish_reasons, usage=usages, model=text, id=text
)
chunks = st.one_of(
    st.builds(TextDelta, text),
    st.builds(ReasoningDelta, text, signature=maybe_text, redacted_data=maybe_text),
    st.builds(ToolCallStart, index=st.integers(0, 64), id=text, name=text),
    st.builds(ToolCallDelta, index=st.integers(0, 64), arguments=raw_arguments),
    st.builds(ToolCallEnd, index=st.integers(0, 64), id=text, name=text, arguments=raw_arguments),
    st.builds(UsageChunk, usages),
    st.builds(FinishChunk, finish_reasons),
)


def through_json(value: Any, as_type: Any) -> Any:
    """unstructure -> json.dumps -> json.loads -> structure, as a stored conversation would travel."""
    data = message_converter.unstructure(value, unstructure_as=as_type)
    wire = json.dumps(data)
    return message_converter.structure(json.loads(wire), as_type)


# -- round trips -------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(conversation=conversations)
def test_conversation_round_trips_through_json(conversation: list[Message]) -> None:
    back = through_json(conversation, list[Message])
    assert back == conversation
    assert [type(message) for message in back] == [type(message) for message in conversation]


@settings(max_examples=100, deadline=None)
@given(message=messages)
def test_each_message_round_trips_and_is_tagged(message: Message) -> None:
    data = message_converter.unstructure(message, unstructure_as=Message)
    assert isinstance(data["type"], str)
    back = through_json(message, Message)
    assert back == message and type(back) is type(message)


@settings(max_examples=100, deadline=None)
@given(part=content_parts)
def test_each_content_part_round_trips(part: ContentPart) -> None:
    back = through_json(part, ContentPart)
    assert back == part and type(back) is type(part)


@settings(max_examples=100, deadline=None)
@given(chunk=chunks)
def test_each_stream_chunk_round_trips(chunk: StreamChunk) -> None:
    back = through_json(chunk, StreamChunk)
    assert back == chunk and type(back) is type(chunk)


@settings(max_examples=100, deadline=None)
@given(response=responses)
def test_model_response_round_trips(response: ModelResponse) -> None:
    back = through_json(response, ModelResponse)
    assert back == response
    assert isinstance(back.message.parts, tuple)
    assert back.finish_reason is response.finish_reason


@settings(max_examples=50, deadline=None)
@given(usage=usages)
def test_usage_round_trips(usage: Usage) -> None:
    assert through_json(usage, Usage) == usage


@settings(max_examples=50, deadline=None)
@given(spec=tool_specs)
def test_tool_spec_round_trips(spec: ToolSpec) -> None:
    assert through_json(spec, ToolSpec) == spec


def test_every_union_member_has_its_own_tag() -> None:
    samples: dict[Any, list[Any]] = {
        Message: [SystemMessage("s"), UserMessage("u"), AssistantMessage(()), ToolResultMessage("c", "r")],
        ContentPart: [TextPart("t"), ReasoningPart("r"), ToolCallPart("i", "n", "{}")],
        StreamChunk: [
            TextDelta("t"),
            ReasoningDelta("r"),
            ToolCallStart(0, "i", "n"),
            ToolCallDelta(0, "{"),
            ToolCallEnd(0, "i", "n", "{}"),
            UsageChunk(Usage()),
            FinishChunk(FinishReason.STOP),
        ],
    }
    for union, values in samples.items():
        tags = [message_converter.unstructure(value, unstructure_as=union)["type"] for value in values]
        assert len(set(tags)) == len(values), tags
        for value in values:
            assert through_json(value, union) == value


def test_nested_parts_carry_tags_in_the_wire_format() -> None:
    message = AssistantMessage((ReasoningPart("hm", signature="sig"), TextPart("hi"), ToolCallPart("c1", "f", "{}")))
    data = json.loads(json.dumps(message_converter.unstructure(message, unstructure_as=Message)))
    assert [part["type"] for part in data["parts"]] == [
        message_converter.unstructure(part, unstructure_as=ContentPart)["type"] for part in message.parts
    ]
    assert len({part["type"] for part in data["parts"]}) == 3
    assert data["parts"][0]["signature"] == "sig"


# -- strict structuring --------------------------------------------------------------------------

REJECTED = (KeyError, ValueError, cattrs.BaseValidationError)


def _wire(value: Any, as_type: Any) -> dict[str, Any]:
    return json.loads(json.dumps(message_converter.unstructure(value, unstructure_as=as_type)))


def test_unknown_type_tag_is_rejected() -> None:
    data = _wire(UserMessage("hi"), Message)
    data["type"] = "NoSuchMessage"
    with pytest.raises(REJECTED):
        message_converter.structure(data, Message)


def test_missing_type_tag_is_rejected() -> None:
    data = _wire(UserMessage("hi"), Message)
    del data["type"]
    with pytest.raises(REJECTED):
        message_converter.structure(data, Message)


def test_unknown_tag_in_a_nested_part_is_rejected() -> None:
    data = _wire(AssistantMessage((TextPart("a"),)), Message)
    data["parts"][0]["type"] = "ImagePart"
    with pytest.raises(REJECTED):
        message_converter.structure(data, Message)


def test_unknown_chunk_tag_is_rejected() -> None:
    data = _wire(TextDelta("a"), StreamChunk)
    data["type"] = "AudioDelta"
    with pytest.raises(REJECTED):
        message_converter.structure(data, StreamChunk)


@pytest.mark.parametrize(
    ("value", "as_type"),
    [
        (UserMessage("hi"), Message),
        (ToolResultMessage("c", "out", True), Message),
        (TextDelta("a"), StreamChunk),
        (FinishChunk(FinishReason.LENGTH), StreamChunk),
        (TextPart("a"), ContentPart),
        (Usage(1, 2, 3), Usage),
        (ToolSpec("t", "d", {"type": "object"}), ToolSpec),
    ],
)
def test_extra_keys_are_rejected(value: Any, as_type: Any) -> None:
    data = _wire(value, as_type)
    assert message_converter.structure(data, as_type) == value  # the unmodified payload is fine
    data["unexpected"] = 1
    with pytest.raises(REJECTED):
        message_converter.structure(data, as_type)


def test_extra_keys_in_nested_values_are_rejected() -> None:
    response = ModelResponse(AssistantMessage((TextPart("a"),)), FinishReason.STOP, Usage(1, 1, 2))
    data = _wire(response, ModelResponse)
    data["message"]["parts"][0]["colour"] = "red"
    with pytest.raises(REJECTED):
        message_converter.structure(data, ModelResponse)
    data = _wire(response, ModelResponse)
    data["usage"]["bonus_tokens"] = 5
    with pytest.raises(REJECTED):
        message_converter.structure(data, ModelResponse)


def test_unknown_finish_reason_is_rejected() -> None:
    data = _wire(FinishChunk(FinishReason.STOP), StreamChunk)
    data["reason"] = "exploded"
    with pytest.raises(REJECTED):
        message_converter.structure(data, StreamChunk)


# -- usage ------------------------------------------------------------------------------------------


def test_usage_addition_adds_counts_and_keeps_unknown_details_unknown() -> None:
    a = Usage(10, 5, 15, cached_input_tokens=4, cache_creation_input_tokens=None, reasoning_tokens=None)
    b = Usage(1, 2, 3, cached_input_tokens=None, cache_creation_input_tokens=None, reasoning_tokens=7)
    assert a + b == Usage(11, 7, 18, cached_input_tokens=4, cache_creation_input_tokens=None, reasoning_tokens=7)


@settings(max_examples=100, deadline=None)
@given(a=usages, b=usages, c=usages)
def test_usage_addition_is_a_commutative_monoid(a: Usage, b: Usage, c: Usage) -> None:
    assert a + b == b + a
    assert (a + b) + c == a + (b + c)
    assert Usage() + a == a == a + Usage()
    total = a + b
    assert total.input_tokens == a.input_tokens + b.input_tokens
    assert total.output_tokens == a.output_tokens + b.output_tokens
    assert total.total_tokens == a.total_tokens + b.total_tokens
    for name in ("cached_input_tokens", "cache_creation_input_tokens", "reasoning_tokens"):
        x, y = getattr(a, name), getattr(b, name)
        assert getattr(total, name) == (None if x is None and y is None else (x or 0) + (y or 0))


def test_sum_of_usages() -> None:
    parts = [Usage(1, 2, 3), Usage(4, 5, 9, reasoning_tokens=2), Usage(0, 1, 1)]
    assert sum(parts, Usage()) == Usage(5, 8, 13, reasoning_tokens=2)


# -- assistant helpers -------------------------------------------------------------------------------


def test_assistant_text_joins_only_text_parts_in_order() -> None:
    message = AssistantMessage(
        (
            ReasoningPart("thinking..."),
            TextPart("Hello"),
            ToolCallPart("c1", "search", '{"q": "x"}'),
            TextPart(", world"),
        )
    )
    assert message.text == "Hello, world"
    assert AssistantMessage(()).text == ""
    assert AssistantMessage((ReasoningPart("only thoughts"),)).text == ""


def test_assistant_tool_calls_in_order() -> None:
    first = ToolCallPart("c1", "search", '{"q": "x"}')
    second = ToolCallPart("c2", "fetch", '{"url": "u"}')
    message = AssistantMessage((TextPart("a"), first, ReasoningPart("r"), second))
    assert message.tool_calls == (first, second)
    assert AssistantMessage((TextPart("a"),)).tool_calls == ()


def test_assistant_parts_are_a_tuple_even_from_a_list() -> None:
    message = AssistantMessage([TextPart("a")])  # type: ignore[arg-type]
    assert message.parts == (TextPart("a"),)
    assert hash(message) == hash(AssistantMessage((TextPart("a"),)))


@settings(max_examples=100, deadline=None)
@given(message=assistant_messages)
def test_text_and_tool_calls_partition_the_parts(message: AssistantMessage) -> None:
    assert message.text == "".join(p.text for p in message.parts if type(p) is TextPart)
    assert list(message.tool_calls) == [p for p in message.parts if type(p) is ToolCallPart]


# -- tool call arguments --------------------------------------------------------------------------------


def test_parsed_arguments_returns_the_json_value() -> None:
    assert ToolCallPart("c", "f", '{"a": [1, 2], "b": null}').parsed_arguments() == {"a": [1, 2], "b": None}
    assert ToolCallPart("c", "f", "").parsed_arguments() == {}


@pytest.mark.parametrize("raw", ['{"a": ', "not json", "{'a': 1}", '{"a": 1}}', "[1, 2"])
def test_parsed_arguments_raises_value_error_on_invalid_json(raw: str) -> None:
    part = ToolCallPart("c", "f", raw)
    with pytest.raises(ValueError):
        part.parsed_arguments()
    assert part.arguments == raw  # the raw text is kept for the model to see


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("[" * 100_000, "nested more than"),
        ('{"a": ' * 5_000 + "1" + "}" * 5_000, "nested more than"),
        ("NaN", "NaN"),
        ('{"a": Infinity}', "Infinity"),
        ('{"a": 1e999}', "too large"),
    ],
    ids=["deep-array", "deep-object", "nan", "infinity", "overflow"],
)
def test_parsed_arguments_refuses_deep_or_non_finite_json_with_value_error(raw: str, words: str) -> None:
    """Untrusted model text: a ValueError the model can see, never a RecursionError or a NaN."""
    with pytest.raises(ValueError, match=words):
        ToolCallPart("c", "f", raw).parsed_arguments()


@settings(max_examples=40, deadline=None)
@given(value=st.dictionaries(st.text(max_size=8), json_values, max_size=5))
def test_parsed_arguments_inverts_json_dumps(value: dict[str, Any]) -> None:
    assert ToolCallPart("c", "f", json.dumps(value)).parsed_arguments() == value
