"""The reply assembler (stream chunks -> one assistant message) and tool-argument parsing.

Settlement issue item 13: reasoning must survive assembly with its signature,
ahead of the tool calls, and every call of a reply gets a unique, stable id.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agent._json import MAX_JSON_INT_BITS
from trio_agent._models._anthropic import convert_messages
from trio_agent._models._assemble import (
    CUT_OFF_NAME,
    DeltaMender,
    ModelReply,
    ReplyAssembler,
    ToolArgumentsError,
    assign_call_ids,
    parse_tool_arguments,
    well_formed,
)
from trio_agent._models._messages import (
    AssistantMessage,
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
    UserMessage,
)

SIGNATURE = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrk=="
WEATHER, TIME = "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "toolu_01NoArgsTool000000000001"
WEATHER_ARGS = '{"location": "Paris, France", "unit": "celsius"}'

# The chunks the Anthropic provider yields for tests/fixtures/anthropic/stream_thinking_tool_use.sse
# (asserted in test_anthropic_provider.py): extended thinking, text, then two tool calls.
ANTHROPIC_THINKING_TOOLS: list[StreamChunk] = [
    ReasoningDelta("The user wants the weather"),
    ReasoningDelta(" and the time in Paris."),
    ReasoningDelta(signature=SIGNATURE),
    TextDelta("Checking both."),
    ToolCallStart(0, WEATHER, "get_weather"),
    ToolCallDelta(0, '{"location": "Pa'),
    ToolCallDelta(0, 'ris, France", "un'),
    ToolCallDelta(0, 'it": "celsius"}'),
    ToolCallEnd(0, WEATHER, "get_weather", WEATHER_ARGS),
    ToolCallStart(1, TIME, "get_time"),
    ToolCallEnd(1, TIME, "get_time", "{}"),
    UsageChunk(Usage(472, 89, 561, cached_input_tokens=100, cache_creation_input_tokens=0)),
    FinishChunk(FinishReason.TOOL_CALLS),
]


def assemble(chunks: Sequence[StreamChunk], *, reserved: Sequence[str] = ()) -> ModelReply:
    assembler = ReplyAssembler(reserved=reserved)
    for chunk in chunks:
        assembler.feed(chunk)
    return assembler.finish()


def call(index: int, call_id: str, name: str = "t", arguments: str = "{}") -> list[StreamChunk]:
    return [
        ToolCallStart(index, call_id, name),
        ToolCallDelta(index, arguments),
        ToolCallEnd(index, call_id, name, arguments),
    ]


# ---------------------------------------------------------------- text, usage, finish


def test_text_deltas_join_into_one_part() -> None:
    reply = assemble([TextDelta("Hel"), TextDelta("lo"), TextDelta(""), TextDelta(" world")])
    assert reply.message == AssistantMessage((TextPart("Hello world"),))
    assert reply.finish_reason is FinishReason.STOP  # no FinishChunk: stop
    assert reply.usage == Usage()
    assert reply.cut_off == ()
    assert reply.renamed == {}


def test_empty_stream_and_empty_text_give_no_parts() -> None:
    assert assemble([]).message == AssistantMessage(())
    assert assemble([TextDelta(""), FinishChunk(FinishReason.STOP)]).message == AssistantMessage(())


HIGH, LOW = "\ud83d", "\ude00"  # the UTF-16 halves of U+1F600, as JSON "\\ud83d" escapes decode apart


def test_a_surrogate_pair_split_across_deltas_is_joined_and_lone_halves_replaced() -> None:
    """A proxy slicing UTF-16 splits an emoji over two events; kept as two lone surrogates, the
    reply could never be encoded again and every later request of the session would fail."""
    reply = assemble(
        [
            ReasoningDelta(f"think {HIGH}"),
            ReasoningDelta(f"{LOW} and {LOW}"),
            ReasoningDelta(signature="sig"),
            TextDelta(f"smile {HIGH}"),
            TextDelta(f"{LOW}!{HIGH}"),
            ToolCallStart(0, f"id{HIGH}", f"t{LOW}"),
            ToolCallEnd(0, f"id{HIGH}", f"t{LOW}", f'{{"s": "{HIGH}{LOW}{HIGH}"}}'),
            ToolCallStart(1, "cut", f"n{HIGH}"),
        ]
    )
    assert reply.message.parts == (
        ReasoningPart("think \U0001f600 and \ufffd", "sig"),
        TextPart("smile \U0001f600!\ufffd"),
        ToolCallPart("id\ufffd", "t\ufffd", '{"s": "\U0001f600\ufffd"}'),
        ToolCallPart("cut", "n\ufffd", ""),
    )
    assert json.dumps(reply.message.parts[2].arguments, ensure_ascii=False).encode()  # encodable
    assert assemble([TextDelta(f"a{HIGH}"), TextDelta(LOW)]).message == AssistantMessage((TextPart("a\U0001f600"),))


DELTA_TEXT = st.text(alphabet=st.sampled_from(["a", "é", HIGH, LOW, "\U0001f600", "\udbff", "\udc00"]), max_size=5)


@given(st.lists(DELTA_TEXT, max_size=8))
def test_mended_deltas_are_well_formed_and_join_as_the_assembled_text(deltas: list[str]) -> None:
    """What a provider publishes, delta by delta, is valid Unicode, and adds up to the reply's text."""
    mender = DeltaMender()
    published = [mender.mend(delta) for delta in deltas] + [mender.flush()]
    for piece in published:
        piece.encode("utf-8")
    assert "".join(published) == well_formed("".join(deltas))
    assert assemble([TextDelta(delta) for delta in deltas]).message.text == well_formed("".join(deltas))


def test_last_usage_and_last_finish_win() -> None:
    reply = assemble(
        [
            UsageChunk(Usage(5, 1, 6)),
            TextDelta("x"),
            FinishChunk(FinishReason.STOP),
            UsageChunk(Usage(5, 9, 14, reasoning_tokens=3)),
            FinishChunk(FinishReason.LENGTH),
        ]
    )
    assert reply.usage == Usage(5, 9, 14, reasoning_tokens=3)
    assert reply.finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------- reasoning


def test_anthropic_thinking_keeps_its_signature_ahead_of_text_and_calls() -> None:
    reply = assemble(ANTHROPIC_THINKING_TOOLS)
    assert reply.message.parts == (
        ReasoningPart("The user wants the weather and the time in Paris.", SIGNATURE),
        TextPart("Checking both."),
        ToolCallPart(WEATHER, "get_weather", WEATHER_ARGS),
        ToolCallPart(TIME, "get_time", "{}"),
    )
    assert reply.reasoning == (ReasoningPart("The user wants the weather and the time in Paris.", SIGNATURE),)
    assert reply.finish_reason is FinishReason.TOOL_CALLS
    assert reply.usage == Usage(472, 89, 561, cached_input_tokens=100, cache_creation_input_tokens=0)
    assert reply.renamed == {}


def test_assembled_thinking_goes_back_to_anthropic_before_tool_use() -> None:
    """The defect itself: the next request must carry the signed thinking block, first."""
    reply = assemble(ANTHROPIC_THINKING_TOOLS)
    _, turns = convert_messages((UserMessage("Weather and time in Paris?"), reply.message))
    blocks = turns[1]["content"]
    assert blocks[0] == {
        "type": "thinking",
        "thinking": "The user wants the weather and the time in Paris.",
        "signature": SIGNATURE,
    }
    assert [block["type"] for block in blocks] == ["thinking", "text", "tool_use", "tool_use"]


def test_text_and_signature_in_one_chunk() -> None:
    # The test model sends a whole reasoning part as one delta.
    reply = assemble([ReasoningDelta("thought", "sig"), TextDelta("answer")])
    assert reply.message.parts == (ReasoningPart("thought", "sig"), TextPart("answer"))


def test_a_signature_ends_the_part_and_new_reasoning_starts_another() -> None:
    reply = assemble(
        [
            ReasoningDelta("one"),
            ReasoningDelta(signature="s1"),
            ReasoningDelta("two"),
            ReasoningDelta(" more"),
            ReasoningDelta(signature="s2"),
        ]
    )
    assert reply.message.parts == (ReasoningPart("one", "s1"), ReasoningPart("two more", "s2"))


def test_a_signature_alone_is_a_part_with_empty_text() -> None:
    assert assemble([ReasoningDelta(signature="s")]).message.parts == (ReasoningPart("", "s"),)


def test_redacted_thinking_is_its_own_part() -> None:
    reply = assemble(
        [
            ReasoningDelta("open"),
            ReasoningDelta(redacted_data="opaque-1"),
            ReasoningDelta(redacted_data="opaque-2"),
            ReasoningDelta("signed"),
            ReasoningDelta(signature="s"),
            TextDelta("done"),
        ]
    )
    assert reply.message.parts == (
        ReasoningPart("open"),  # unsigned: ended by the redacted block
        ReasoningPart("", redacted_data="opaque-1"),
        ReasoningPart("", redacted_data="opaque-2"),
        ReasoningPart("signed", "s"),
        TextPart("done"),
    )


def test_unsigned_reasoning_is_kept_and_empty_deltas_add_nothing() -> None:
    # OpenAI-compatible reasoning: text only, never signed.
    reply = assemble([ReasoningDelta(""), ReasoningDelta("think"), ReasoningDelta("ing"), TextDelta("ok")])
    assert reply.message.parts == (ReasoningPart("thinking"), TextPart("ok"))


def test_interleaved_reasoning_and_text_keep_arrival_order_within_each_kind() -> None:
    reply = assemble(
        [
            ReasoningDelta("first"),
            TextDelta("a"),
            ReasoningDelta("second"),
            *call(0, "c1"),
            ReasoningDelta("third"),
            ReasoningDelta(signature="s3"),
            TextDelta("b"),
        ]
    )
    assert reply.message.parts == (
        ReasoningPart("first"),  # text in between ends an unsigned part: never merged across it
        ReasoningPart("second"),
        ReasoningPart("third", "s3"),
        TextPart("ab"),
        ToolCallPart("c1", "t", "{}"),
    )


# ---------------------------------------------------------------- tool calls


def test_calls_are_ordered_by_index_not_arrival() -> None:
    reply = assemble([*call(2, "c"), *call(0, "a"), *call(1, "b"), TextDelta("x")])
    assert [part.id for part in reply.message.tool_calls] == ["a", "b", "c"]
    assert reply.message.parts[0] == TextPart("x")


def test_the_end_chunk_carries_the_arguments() -> None:
    chunks: list[StreamChunk] = [
        ToolCallStart(0, "a", "t"),
        ToolCallDelta(0, '{"x"'),
        ToolCallDelta(0, ": 1}"),
        ToolCallEnd(0, "a", "t", '{"x": 1}'),
    ]
    assert assemble(chunks).tool_calls == (ToolCallPart("a", "t", '{"x": 1}'),)


def test_an_end_without_a_start_is_a_call() -> None:
    assert assemble([ToolCallEnd(0, "a", "t", "{}")]).tool_calls == (ToolCallPart("a", "t", "{}"),)


def test_cut_off_calls_are_listed_and_never_carry_arguments() -> None:
    reply = assemble(
        [
            *call(0, "done"),
            ToolCallStart(1, "half", "write"),
            ToolCallDelta(1, '{"path": "/tm'),
            ToolCallStart(2, "", ""),
            FinishChunk(FinishReason.LENGTH),
        ]
    )
    assert reply.tool_calls == (
        ToolCallPart("done", "t", "{}"),
        ToolCallPart("half", "write", ""),
        ToolCallPart("call_2", CUT_OFF_NAME, ""),
    )
    assert reply.cut_off == ("half", "call_2")
    assert reply.renamed == {"call_2": ""}
    assert reply.finish_reason is FinishReason.LENGTH


def test_empty_ids_become_call_index() -> None:
    reply = assemble([*call(0, ""), *call(3, "")])
    assert [part.id for part in reply.tool_calls] == ["call_0", "call_3"]
    assert reply.renamed == {"call_0": "", "call_3": ""}


def test_the_end_id_wins_and_the_start_id_fills_an_empty_one() -> None:
    reply = assemble(
        [
            ToolCallStart(0, "from-start", "t"),
            ToolCallEnd(0, "", "t", "{}"),
            ToolCallStart(1, "s", "t"),
            ToolCallEnd(1, "e", "t", "{}"),
        ]
    )
    assert [part.id for part in reply.tool_calls] == ["from-start", "e"]


def test_duplicate_ids_get_numbered_suffixes() -> None:
    reply = assemble([*call(0, "x"), *call(1, "x"), *call(2, "x")])
    assert [part.id for part in reply.tool_calls] == ["x", "x~2", "x~3"]
    assert reply.renamed == {"x~2": "x", "x~3": "x"}


def test_a_generated_id_never_takes_a_real_id_of_a_later_call() -> None:
    # The model's own "call_0" (index 1) keeps its id; the empty one at index 0 moves aside.
    reply = assemble([*call(0, ""), *call(1, "call_0"), *call(2, "x"), *call(3, "x"), *call(4, "x~2")])
    assert [part.id for part in reply.tool_calls] == ["call_0~2", "call_0", "x", "x~3", "x~2"]
    assert reply.renamed == {"call_0~2": "", "x~3": "x"}


def test_reserved_ids_count_as_taken() -> None:
    reply = assemble([*call(0, "a"), *call(1, "")], reserved=["a", "call_1"])
    assert [part.id for part in reply.tool_calls] == ["a~2", "call_1~2"]


ID_ALPHABET = st.sampled_from(["", "a", "b", "call_0", "call_1", "a~2", "call_0~2"])


@given(
    st.lists(st.tuples(st.integers(0, 8), ID_ALPHABET), max_size=12, unique_by=lambda pair: pair[0]),
    st.lists(ID_ALPHABET, max_size=3),
)
def test_assigned_ids_are_unique_stable_and_keep_first_real_ids(
    calls: list[tuple[int, str]], reserved: list[str]
) -> None:
    chunks = [chunk for index, call_id in calls for chunk in call(index, call_id)]
    first = assemble(chunks, reserved=reserved)
    ids = [part.id for part in first.tool_calls]
    assert len(set(ids)) == len(ids) == len(calls)
    assert all(ids) and not set(ids) & {r for r in reserved if r}
    assert assemble(chunks, reserved=reserved) == first  # stable: same chunks, same ids
    originals = dict(calls)
    seen: set[str] = set(reserved)
    for index, call_id in zip(sorted(originals), ids, strict=True):
        original = originals[index]
        if original and original not in seen:  # a first occurrence keeps its id
            assert call_id == original
        seen.add(original)
        assert first.renamed.get(call_id, call_id) == original


def first_free_suffixes(indices: list[int], originals: list[str], reserved: Sequence[str]) -> list[str]:
    """The module's naming rule spelled out naively: a base already taken gets the first free ``~n``."""
    taken = set(reserved)
    assigned: list[str | None] = [None] * len(originals)
    for position, original in enumerate(originals):
        if original and original not in taken:
            taken.add(original)
            assigned[position] = original
    for position, (index, original) in enumerate(zip(indices, originals, strict=True)):
        if assigned[position] is None:
            base = candidate = original or f"call_{index}"
            n = 2
            while candidate in taken:
                candidate, n = f"{base}~{n}", n + 1
            taken.add(candidate)
            assigned[position] = candidate
    return [call_id for call_id in assigned if call_id is not None]


@given(st.lists(ID_ALPHABET, max_size=16), st.lists(ID_ALPHABET, max_size=4))
def test_assign_call_ids_follows_the_first_free_suffix_rule(originals: list[str], reserved: list[str]) -> None:
    indices = list(range(len(originals)))
    assert assign_call_ids(indices, originals, reserved) == first_free_suffixes(indices, originals, reserved)


class CountingIds(set[str]):
    """Reserved ids that count how often they are asked."""

    asked = 0

    def __contains__(self, call_id: object) -> bool:
        self.asked += 1
        return super().__contains__(call_id)


def test_renaming_many_repeats_of_one_id_probes_each_suffix_once() -> None:
    """A model that names every call alike (and did so all conversation long): each suffix is tried
    once, not once per repeat, which was quadratic (16,000 repeats blocked the event loop 15 s)."""
    n = 1000
    reserved = CountingIds(["x", *(f"x~{k}" for k in range(2, n + 1))])
    assigned = assign_call_ids(list(range(n)), ["x"] * n, reserved)
    assert assigned == [f"x~{k}" for k in range(n + 1, 2 * n + 1)]
    assert reserved.asked <= 3 * n


def test_assign_call_ids_alone() -> None:
    assert assign_call_ids([0, 1, 2], ["", "", "a"]) == ["call_0", "call_1", "a"]
    assert assign_call_ids([], []) == []


# ---------------------------------------------------------------- tool arguments


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("  \n\t", {}),
        ('{"a": 1, "b": [1.5, "x", null, true]}', {"a": 1, "b": [1.5, "x", None, True]}),
        ('{"s": "[[[[{{{{ brackets in a string do not nest"}', {"s": "[[[[{{{{ brackets in a string do not nest"}),
        ('{"s": "quote \\" then [["}', {"s": 'quote " then [['}),
        ('{"big": 1e308, "neg": -1.5e-300}', {"big": 1e308, "neg": -1.5e-300}),
    ],
)
def test_valid_arguments(text: str, expected: dict[str, object]) -> None:
    assert parse_tool_arguments(text) == expected


def refused(text: str) -> ToolArgumentsError:
    with pytest.raises(ToolArgumentsError) as info:
        parse_tool_arguments(text)
    assert info.value.code == "invalid_json"
    assert str(info.value) == info.value.message
    return info.value


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_constants_are_refused(constant: str) -> None:
    error = refused(f'{{"x": {constant}}}')
    assert constant in error.message and "not a valid JSON number" in error.message


@pytest.mark.parametrize("number", ["1e999", "-1e999", "123.4e500"])
def test_floats_that_overflow_are_refused(number: str) -> None:
    assert "too large" in refused(f'{{"x": {number}}}').message


def test_an_integer_past_the_digit_limit_is_refused_clearly() -> None:
    digits = sys.get_int_max_str_digits() + 1  # 4,301 by default
    error = refused('{"x": ' + "7" * digits + "}")
    assert f"{digits} digits" in error.message and "send it as a string" in error.message


def test_an_integer_past_the_json_bound_is_refused_clearly() -> None:
    # Within the digit limit but past MAX_JSON_INT_BITS: it was accepted, and a process whose
    # limit is lower (640 digits at least) could not encode it again. The shared JSON rule
    # refuses it; the model is told here, at the parse.
    largest = (1 << MAX_JSON_INT_BITS) - 1
    assert parse_tool_arguments(f'{{"x": {largest}, "y": {-largest}}}') == {"x": largest, "y": -largest}
    for text in (str(largest + 1), str(-largest - 1), "7" * sys.get_int_max_str_digits()):
        error = refused('{"x": ' + text + "}")
        assert f"at most {MAX_JSON_INT_BITS} bits" in error.message and "send it as a string" in error.message


def nested(depth: int) -> str:
    """An object whose value nests ``depth`` levels in all (the object counts as one)."""
    return '{"x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_depth_64_is_accepted_65_refused() -> None:
    assert parse_tool_arguments(nested(63))
    assert parse_tool_arguments(nested(64))
    assert "more than 64 levels" in refused(nested(65)).message


def test_ten_thousand_levels_are_refused_without_recursion() -> None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # the scan must not recurse: a parser that did would raise here
    try:
        error = refused("[" * 10_000 + "]" * 10_000)
        refused('{"a": ' + "{" * 10_000)  # unbalanced too
    finally:
        sys.setrecursionlimit(limit)
    assert "levels deep" in error.message


@pytest.mark.parametrize(
    ("text", "kind"),
    [("[1, 2]", "an array"), ('"text"', "a string"), ("3", "a number"), ("true", "a boolean"), ("null", "null")],
)
def test_a_top_level_that_is_not_an_object_is_refused(text: str, kind: str) -> None:
    assert refused(text).message == f"the arguments must be a JSON object ({{...}}), not {kind}"


def test_invalid_json_names_the_position() -> None:
    error = refused('{"a": 1,,}')
    assert error.message.startswith("the arguments are not valid JSON:") and "column" in error.message
    refused('{"a": "unterminated')


@given(st.dictionaries(st.text(), st.recursive(st.none() | st.booleans() | st.integers() | st.text(), st.lists)))
def test_round_trip_of_json_objects(value: dict[str, object]) -> None:
    assert parse_tool_arguments(json.dumps(value)) == value
