"""The typed model-attempt payload (`ModelReplyRecord`) and the fold that rebuilds a history from events.

Settlement issue item 13: a rebuilt history has the reasoning (with its
signature) the model produced; journals written before the fix still read.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agent import SideEffect, ToolKind, define_tool, open_session
from trio_agent._journal._conversation import (
    OUTCOME_UNKNOWN_ANSWER,
    WITHHELD_ANSWER,
    ConversationFold,
    ModelReplyRecord,
    encode_conversation,
    fold_conversation,
    reply_record,
)
from trio_agent._journal._errors import JournalCorruptError
from trio_agent._journal._events import (
    ConversationSeeded,
    ErrorInfo,
    Event,
    EventEnvelope,
    InterruptsResolved,
    ModelAttemptCompleted,
    ModelAttemptFailed,
    ModelAttemptStarted,
    OutcomeUnknownReason,
    RequestAccepted,
    RequestStarted,
    RunPaused,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    decode_event,
    encode_event,
)
from trio_agent._models._assemble import ReplyAssembler
from trio_agent._models._history import ORPHAN_ANSWER, answer_orphan_calls
from trio_agent._models._messages import (
    AssistantMessage,
    FinishChunk,
    FinishReason,
    Message,
    ReasoningDelta,
    ReasoningPart,
    StreamChunk,
    TextDelta,
    TextPart,
    ToolCallEnd,
    ToolCallPart,
    ToolCallStart,
    ToolResultMessage,
    Usage,
    UsageChunk,
    UserMessage,
)
from trio_agent.testing import Reply, TestModel

IDS: dict[str, Any] = {"request_id": "r1", "turn_id": "r1-t1"}
SIGNATURE = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrk=="


def assemble(chunks: list[StreamChunk]) -> Any:
    assembler = ReplyAssembler()
    for chunk in chunks:
        assembler.feed(chunk)
    return assembler.finish()


def through_journal(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload as a store gives it back: encoded, JSON text, decoded (strictly)."""
    envelope = EventEnvelope(
        stream_id="s1:root",
        seq=1,
        event=ModelAttemptCompleted(attempt_id="r1-t1-a1", response=payload, **IDS),
        recorded_at=0.0,
    )
    decoded = decode_event(json.loads(json.dumps(encode_event(envelope))))
    assert isinstance(decoded.event, ModelAttemptCompleted)
    return decoded.event.response


# ---------------------------------------------------------------- the record


def test_regression_reasoning_and_signature_survive_the_journal() -> None:
    """assemble -> record -> payload -> journal -> from_payload -> message(): nothing lost, same order."""
    reply = assemble(
        [
            ReasoningDelta("Weather first"),
            ReasoningDelta(", then time."),
            ReasoningDelta(signature=SIGNATURE),
            ReasoningDelta(redacted_data="opaque"),
            TextDelta("Checking."),
            ToolCallStart(0, "toolu_1", "get_weather"),
            ToolCallEnd(0, "toolu_1", "get_weather", '{"city": "Paris"}'),
            ToolCallStart(1, "", "get_time"),
            ToolCallEnd(1, "", "get_time", "{}"),
            UsageChunk(Usage(10, 20, 30, cached_input_tokens=4, cache_creation_input_tokens=0, reasoning_tokens=12)),
            FinishChunk(FinishReason.TOOL_CALLS),
        ]
    )
    record = reply_record(reply, inputs=["also this"], rejected={"call_1": "unknown tool 'get_time'"})
    restored = ModelReplyRecord.from_payload(through_journal(record.to_payload()))
    assert restored == record
    assert restored.message() == reply.message
    assert restored.message().parts[:2] == (
        ReasoningPart("Weather first, then time.", SIGNATURE),
        ReasoningPart("", redacted_data="opaque"),
    )
    assert [call.id for call in restored.tool_calls] == ["toolu_1", "call_1"]  # the assigned id is recorded
    assert restored.usage.reasoning_tokens == 12 and restored.finish_reason is FinishReason.TOOL_CALLS


def test_the_payload_shape() -> None:
    record = ModelReplyRecord(
        inputs=["hi"],
        text="t",
        reasoning=[ReasoningPart("r", "s")],
        tool_calls=[ToolCallPart("c1", "n", "{}")],
        rejected={"c1": "no"},
        finish_reason=FinishReason.LENGTH,
        usage=Usage(1, 2, 3),
    )
    assert record.to_payload() == {
        "inputs": ["hi"],
        "text": "t",
        "reasoning": [{"text": "r", "signature": "s", "redacted_data": None}],
        "tool_calls": [{"id": "c1", "name": "n", "arguments": "{}"}],
        "rejected": {"c1": "no"},
        "finish_reason": "length",
        "usage": {
            "input_tokens": 1,
            "output_tokens": 2,
            "total_tokens": 3,
            "cached_input_tokens": None,
            "cache_creation_input_tokens": None,
            "reasoning_tokens": None,
        },
    }


def test_message_order_is_reasoning_text_calls() -> None:
    record = ModelReplyRecord(text="t", reasoning=[ReasoningPart("r")], tool_calls=[ToolCallPart("c", "n", "")])
    assert record.message() == AssistantMessage((ReasoningPart("r"), TextPart("t"), ToolCallPart("c", "n", "")))
    assert ModelReplyRecord().message() == AssistantMessage(())


# The exact shape `_AgentRun._model_call` wrote before reasoning was recorded.
OLD_PAYLOAD: dict[str, Any] = {
    "inputs": ["joined"],
    "text": "Let me look.",
    "tool_calls": [
        {"id": "call_1", "name": "read", "arguments": '{"path": "a"}'},
        {"id": "call_2", "name": "nope", "arguments": "{}"},
    ],
    "rejected": {"call_2": "unknown tool 'nope' (available: read)"},
    "finish_reason": "tool_calls",
    "usage": {"input_tokens": 12, "output_tokens": 7},
}


def test_the_old_payload_shape_still_reads() -> None:
    record = ModelReplyRecord.from_payload(through_journal(OLD_PAYLOAD))
    assert record == ModelReplyRecord(
        inputs=["joined"],
        text="Let me look.",
        tool_calls=[ToolCallPart("call_1", "read", '{"path": "a"}'), ToolCallPart("call_2", "nope", "{}")],
        rejected={"call_2": "unknown tool 'nope' (available: read)"},
        finish_reason=FinishReason.TOOL_CALLS,
        usage=Usage(input_tokens=12, output_tokens=7),
    )


def test_a_partial_old_payload_reads_with_empty_defaults() -> None:
    # Written by hand in tests/test_session_edges.py; the old fold read it with .get defaults.
    record = ModelReplyRecord.from_payload(
        {"text": "", "tool_calls": [{"id": "c1", "name": "task", "arguments": "{}"}]}
    )
    assert record == ModelReplyRecord(tool_calls=[ToolCallPart("c1", "task", "{}")])


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        ([], "JSON object"),
        ({"text": 5}, "response.text"),
        ({"inputs": "abc"}, "response.inputs"),  # a string is not a list of inputs
        ({"inputs": ["a", 3]}, "response.inputs[1]"),
        ({"tool_calls": [{"id": "c", "name": "n", "arguments": "{}"}, {"id": "c"}]}, "response.tool_calls[1].name"),
        ({"tool_calls": {"id": "c"}}, "response.tool_calls"),
        ({"reasoning": [{"text": "x", "signature": 7}]}, "response.reasoning[0].signature"),
        ({"rejected": {"c": 1}}, "response.rejected"),
        ({"rejected": ["c"]}, "response.rejected"),
        ({"finish_reason": "bored"}, "response.finish_reason"),
        ({"usage": {"input_tokens": "12"}}, "response.usage.input_tokens"),
        ({"usage": {"input_tokens": True}}, "response.usage.input_tokens"),
        ({"usage": {"input": 1}}, "input"),
        ({"content": "x"}, "content"),  # another shape altogether
    ],
)
def test_a_malformed_payload_is_journal_corruption(payload: Any, names: str) -> None:
    with pytest.raises(JournalCorruptError) as info:
        ModelReplyRecord.from_payload(payload)
    assert names in str(info.value)


def test_reply_record_refuses_rejections_of_calls_it_does_not_have() -> None:
    reply = assemble([ToolCallStart(0, "a", "t"), ToolCallEnd(0, "a", "t", "{}")])
    with pytest.raises(ValueError, match="'b'"):
        reply_record(reply, rejected={"b": "x"})
    assert reply_record(reply).rejected == {}


texts = st.text(max_size=8)
records = st.builds(
    ModelReplyRecord,
    inputs=st.lists(texts, max_size=3),
    text=texts,
    reasoning=st.lists(st.builds(ReasoningPart, texts, st.none() | texts, st.none() | texts), max_size=3),
    # A reply's call ids are non-empty and unique (the assembler's; a stored reply with others is corrupt).
    tool_calls=st.lists(
        st.builds(ToolCallPart, st.text(min_size=1, max_size=8), texts, texts), max_size=3, unique_by=lambda c: c.id
    ),
    rejected=st.dictionaries(texts, texts, max_size=3),
    finish_reason=st.sampled_from(FinishReason),
    usage=st.builds(
        Usage,
        st.integers(0, 10**9),
        st.integers(0, 10**9),
        st.integers(0, 10**9),
        st.none() | st.integers(0, 10**9),
        st.none() | st.integers(0, 10**9),
        st.none() | st.integers(0, 10**9),
    ),
)


@given(records)
def test_every_record_round_trips_through_the_journal(record: ModelReplyRecord) -> None:
    assert ModelReplyRecord.from_payload(through_journal(record.to_payload())) == record


# ---------------------------------------------------------------- orphan answers


def test_unanswered_calls_are_answered_right_after_their_message() -> None:
    calls = AssistantMessage((TextPart("x"), ToolCallPart("a", "t", ""), ToolCallPart("b", "t", "")))
    history: list[Message] = [
        UserMessage("go"),
        calls,
        ToolResultMessage("b", "ok"),
        AssistantMessage((TextPart("done"),)),
    ]
    assert answer_orphan_calls(history) == [
        UserMessage("go"),
        calls,
        ToolResultMessage("a", ORPHAN_ANSWER, is_error=True),
        ToolResultMessage("b", "ok"),
        AssistantMessage((TextPart("done"),)),
    ]
    assert answer_orphan_calls([UserMessage("go")]) == [UserMessage("go")]
    assert ORPHAN_ANSWER == "no result was recorded (interrupted)"


def orphan(call_id: str) -> ToolResultMessage:
    return ToolResultMessage(call_id, ORPHAN_ANSWER, is_error=True)


def test_orphan_answers_keep_the_call_order_of_their_message() -> None:
    # The unanswered calls' answers went first, ahead of the answers already there: a-c-e-b-d
    # here, where the live loop (which answers a turn's calls in call order) has a-b-c-d-e.
    calls = AssistantMessage(tuple(ToolCallPart(i, "t", "") for i in "abcde"))
    history: list[Message] = [UserMessage("go"), calls, ToolResultMessage("b", "B"), ToolResultMessage("d", "D")]
    assert answer_orphan_calls(history) == [
        UserMessage("go"),
        calls,
        orphan("a"),
        ToolResultMessage("b", "B"),
        orphan("c"),
        ToolResultMessage("d", "D"),
        orphan("e"),
    ]
    # A waiting call gets none, and the rest keep their order around it.
    assert answer_orphan_calls(history, awaiting=["c"]) == [
        UserMessage("go"),
        calls,
        orphan("a"),
        ToolResultMessage("b", "B"),
        ToolResultMessage("d", "D"),
        orphan("e"),
    ]
    # Answers already there are never moved, even out of call order: an orphan goes before the
    # first answer of a later call.
    moved: list[Message] = [UserMessage("go"), calls, ToolResultMessage("d", "D"), ToolResultMessage("b", "B")]
    assert answer_orphan_calls(moved) == [
        UserMessage("go"),
        calls,
        orphan("a"),
        orphan("c"),
        ToolResultMessage("d", "D"),
        ToolResultMessage("b", "B"),
        orphan("e"),
    ]


def test_a_rebuilt_turn_answers_a_refused_call_and_a_lost_one_in_call_order() -> None:
    # A crash after the reply: "rej" was refused with the reply, "lost" (after it) never settled.
    # The lost call's answer went right after the message, ahead of the refusal of the call before it.
    record = ModelReplyRecord(
        tool_calls=[ToolCallPart("rej", "nope", "{}"), ToolCallPart("lost", "read", "{}")],
        rejected={"rej": "unknown tool 'nope'"},
        finish_reason=FinishReason.TOOL_CALLS,
    )
    events: list[Event] = [
        RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "hi"}),
        RequestStarted(request_id="r1"),
        attempt("r1-t1-a1", record.to_payload()),
    ]
    assert fold_both(events) == [
        UserMessage("hi"),
        record.message(),
        ToolResultMessage("rej", "unknown tool 'nope'", is_error=True),
        orphan("lost"),
    ]


# ---------------------------------------------------------------- the fold


def attempt(attempt_id: str, payload: dict[str, Any], turn_id: str = "r1-t1") -> ModelAttemptCompleted:
    return ModelAttemptCompleted(request_id="r1", turn_id=turn_id, attempt_id=attempt_id, response=payload)


def test_fold_over_real_events() -> None:
    thinking = ReasoningPart("plan", SIGNATURE)
    first = ModelReplyRecord(
        inputs=["steer"],
        text="working",
        reasoning=[thinking],
        tool_calls=[
            ToolCallPart("rej", "nope", "{}"),
            ToolCallPart("ok", "read", "{}"),
            ToolCallPart("err", "read", "{}"),
            ToolCallPart("unknown", "write", "{}"),
            ToolCallPart("hidden", "read", "{}"),
            ToolCallPart("lost", "read", "{}"),
        ],
        rejected={"rej": "unknown tool 'nope'"},
        finish_reason=FinishReason.TOOL_CALLS,
    )
    second = ModelReplyRecord(text="done")
    tool: dict[str, Any] = {"request_id": "r1", "turn_id": "r1-t1"}
    events: list[Event] = [
        RequestAccepted(request_id="h1", command_id="h1", input={"start_subagent": "helper"}),  # no prompt
        RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "hello"}),
        RequestStarted(request_id="r1"),
        ModelAttemptStarted(attempt_id="r1-t1-a1", model="m", **tool),
        attempt("r1-t1-a1", first.to_payload()),
        ToolCompleted(call_id="ok", result={"output": "file text"}, **tool),
        ToolFailed(call_id="err", result={"output": {"error": "denied"}}, **tool),
        ToolOutcomeUnknown(call_id="unknown", reason=OutcomeUnknownReason.PROCESS_RESTART, **tool),
        ToolCompleted(call_id="hidden", result={"output": "never shown"}, published=False, **tool),
        ModelAttemptFailed(attempt_id="r1-t2-a1", error=ErrorInfo(message="boom"), request_id="r1", turn_id="r1-t2"),
        attempt("r1-t2-a2", second.to_payload(), turn_id="r1-t2"),
        RequestAccepted(request_id="r2", command_id="r2", input={"prompt": ""}),  # an empty prompt, as sent
        RequestStarted(request_id="r2"),
        RequestAccepted(request_id="r3", command_id="r3", input={"prompt": "never started"}),  # adds nothing
    ]
    assert fold_conversation(events) == [
        UserMessage("hello"),
        UserMessage("steer"),
        AssistantMessage((thinking, TextPart("working"), *first.tool_calls)),
        # In call order, the unanswered call's answer included (as the live loop answers a turn).
        ToolResultMessage("rej", "unknown tool 'nope'", is_error=True),
        ToolResultMessage("ok", "file text"),
        ToolResultMessage("err", '{"error": "denied"}', is_error=True),
        ToolResultMessage("unknown", OUTCOME_UNKNOWN_ANSWER, is_error=True),
        ToolResultMessage("hidden", WITHHELD_ANSWER, is_error=True),  # its result was never published
        ToolResultMessage("lost", ORPHAN_ANSWER, is_error=True),
        AssistantMessage((TextPart("done"),)),
        UserMessage(""),
    ]


def test_fold_of_an_old_journal() -> None:
    events: list[Event] = [
        RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "hi"}),
        RequestStarted(request_id="r1"),
        attempt("a1", OLD_PAYLOAD),
        ToolCompleted(call_id="call_1", result={"output": ["a", 1]}, **IDS),
    ]
    assert fold_conversation(events) == [
        UserMessage("hi"),
        UserMessage("joined"),
        AssistantMessage(
            (
                TextPart("Let me look."),
                ToolCallPart("call_1", "read", '{"path": "a"}'),
                ToolCallPart("call_2", "nope", "{}"),
            )
        ),
        ToolResultMessage("call_1", '["a", 1]'),
        ToolResultMessage("call_2", "unknown tool 'nope' (available: read)", is_error=True),
    ]


def test_fold_names_the_attempt_of_a_corrupt_payload() -> None:
    with pytest.raises(JournalCorruptError, match=r"model attempt r1-t1-a7: .*response\.text"):
        fold_conversation([attempt("r1-t1-a7", {"text": ["not", "text"]})])


def fold_both(events: list[Event]) -> list[Message]:
    """`fold_conversation` of *events*, checked equal to the incremental fold's history."""
    fold = ConversationFold()
    for event in events:
        fold.feed(event)
    history = fold_conversation(events)
    assert fold.messages() == history
    return history


def both_refuse(events: list[Event], match: str) -> None:
    with pytest.raises(JournalCorruptError, match=match):
        fold_conversation(events)
    fold = ConversationFold()
    with pytest.raises(JournalCorruptError, match=match):
        for event in events:
            fold.feed(event)
        fold.messages()


def call_reply(*ids: str) -> dict[str, Any]:
    return ModelReplyRecord(tool_calls=[ToolCallPart(i, "read", "{}") for i in ids]).to_payload()


@pytest.mark.parametrize(("ids", "shown"), [(("",), "['']"), (("c1", "c1"), "['c1', 'c1']")])
def test_a_stored_reply_with_an_empty_or_repeated_call_id_is_corrupt(ids: tuple[str, ...], shown: str) -> None:
    # A live reply never has either (the assembler assigns unique ids); a provider refuses both.
    with pytest.raises(JournalCorruptError, match=re.escape(shown)):
        ModelReplyRecord.from_payload(call_reply(*ids))
    both_refuse([attempt("r1-t1-a3", call_reply(*ids))], r"model attempt r1-t1-a3: .*not unique ids")


def test_a_call_id_repeated_by_a_later_reply_is_corrupt() -> None:
    events: list[Event] = [
        RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "hi"}),
        RequestStarted(request_id="r1"),
        attempt("r1-t1-a1", call_reply("c1")),
        ToolCompleted(call_id="c1", result={"output": "one"}, **IDS),
        attempt("r1-t2-a1", call_reply("c1"), turn_id="r1-t2"),
    ]
    both_refuse(events, r"tool call id 'c1' twice \(messages 1 and 3 of the history\)")
    # A seeded call's id is as taken as a reply's.
    history = encode_conversation(
        [UserMessage("a"), AssistantMessage((ToolCallPart("c1", "read", "{}"),)), ToolResultMessage("c1", "x")]
    )
    both_refuse([ConversationSeeded(session_id="s", conversation=history), *events[:3]], "tool call id 'c1' twice")
    assert fold_both(events[:4]) == [
        UserMessage("hi"),
        AssistantMessage((ToolCallPart("c1", "read", "{}"),)),
        ToolResultMessage("c1", "one"),
    ]


def seeded(*messages: Any) -> dict[str, Any]:
    return {"messages": list(messages)}


USER = {"type": "UserMessage", "content": "hi"}
CALL = {"type": "AssistantMessage", "parts": [{"type": "ToolCallPart", "id": "c1", "name": "read", "arguments": ""}]}


@pytest.mark.parametrize(
    ("conversation", "names"),
    [
        (seeded({"type": "UserMessage", "content": 12345}), r"cannot be decoded: .* expected str @ message\.content"),
        (
            seeded(USER, CALL, {"type": "ToolResultMessage", "tool_call_id": "c1", "content": "x", "is_error": 1}),
            r"cannot be decoded: .* expected bool @ message\.is_error",
        ),
        (seeded(USER, {"type": "SystemMessage", "content": "evil"}), r": history\[1\] is a system message"),
        (seeded(USER, CALL), r": history\[1\]: tool call\(s\) 'c1' are not answered"),
        (seeded({"type": "AssistantMessage", "parts": []}), "starts with a user message"),
        ({"messages": "hi"}, r" must be \{'messages'"),
    ],
)
def test_a_seeded_conversation_history_would_refuse_is_corrupt(conversation: dict[str, Any], names: str) -> None:
    # Read as strictly as `history=` checked it when given: nothing converted, nothing a provider refuses.
    both_refuse([ConversationSeeded(session_id="s", conversation=conversation)], "^a seeded conversation.*" + names)


@pytest.mark.parametrize(
    ("given", "names"),
    [
        ({"prompt": {"secret": [1, 2]}}, r"the prompt of request 'r1' is \{'secret': \[1, 2\]\}, not a string"),
        ({"prompt": ["a", "b"]}, r"the prompt of request 'r1' is \['a', 'b'\]"),
        ({}, "the prompt of request 'r1' is None"),
        ({"chat": True}, r"the messages of chat run 'r1' must be \{'messages'"),
        ({"chat": True, "messages": []}, "chat run 'r1' was given no message"),
        ({"chat": True, **seeded({"type": "UserMessage", "content": 5})}, r"chat run 'r1': .*expected str"),
        ({"chat": True, **seeded({"type": "SystemMessage", "content": "x"})}, "is a system message"),
    ],
)
def test_a_request_input_no_writer_makes_is_corrupt(given: dict[str, Any], names: str) -> None:
    accepted = RequestAccepted(request_id="r1", command_id="r1", input=given)
    both_refuse([accepted, RequestStarted(request_id="r1")], names)


def test_the_inputs_writers_make_still_fold() -> None:
    events: list[Event] = [
        RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "hi"}),
        RequestStarted(request_id="r1"),
        RequestAccepted(request_id="h", command_id="h", input={"start_subagent": "helper", "prompt": "go"}),
        RequestAccepted(request_id="c", command_id="c", input={"resume": "r0"}),
        RequestAccepted(request_id="x", command_id="x", input={"chat": True, "resume": "r0"}),
        RequestAccepted(request_id="y", command_id="y", input={"chat": True, **seeded(USER)}),
    ]
    assert fold_both(events) == [UserMessage("hi")]
    # A chat() run is given its whole history: it replaces the one before it.
    assert fold_both([*events, RequestStarted(request_id="y")]) == [UserMessage("hi")]


def fold_in_two(events: list[Event], cut: int) -> list[Message]:
    """The incremental fold fed ``events[:cut]``, kept as a snapshot keeps it, then the rest."""
    first = ConversationFold()
    for event in events[:cut]:
        first.feed(event)
    state, entries, outcomes = first.to_parts()
    fold = ConversationFold.from_parts(json.loads(json.dumps(state)), entries, outcomes)
    for event in events[cut:]:
        fold.feed(event)
    return fold.messages()


def paused_reply_events(given: dict[str, Any] | None = None) -> tuple[ModelReplyRecord, list[Event]]:
    """A reply whose first call its checks refused and whose second waits for an approval (of a
    request given *given*: a prompt by default)."""
    record = ModelReplyRecord(
        tool_calls=[ToolCallPart("rej", "nope", "{}"), ToolCallPart("ask", "write", "{}")],
        rejected={"rej": "unknown tool 'nope'"},
        finish_reason=FinishReason.TOOL_CALLS,
    )
    pending = [{"id": "rej", "name": "nope", "arguments": "{}"}, {"id": "ask", "name": "write", "arguments": "{}"}]
    events: list[Event] = [
        RequestAccepted(request_id="r1", command_id="r1", input=given or {"prompt": "hi"}),
        RequestStarted(request_id="r1"),
        attempt("r1-t1-a1", record.to_payload()),
        RunPaused(request_id="r1", state={"phase": "before_tools", "interrupts": [], "pending_calls": pending}),
    ]
    return record, events


def test_a_paused_reply_answers_none_of_its_calls_until_its_pause_is_resolved() -> None:
    # The refused call was answered at once: the history read back while paused held its answer,
    # the live one did not, and a resume after a reopen answered it a second time (the
    # continuation answers every call of the reply, the refused ones included, in call order).
    record, events = paused_reply_events()
    paused = [UserMessage("hi"), record.message()]
    assert fold_both(events) == paused
    for cut in range(len(events) + 1):
        assert fold_in_two(events, cut) == paused
    ids = {"request_id": "r2", "turn_id": "r2-t1"}
    resumed = [
        *events,
        RequestAccepted(request_id="r2", command_id="r2", input={"resume": "r1"}),
        RequestStarted(request_id="r2"),
        InterruptsResolved(request_id="r1", continuation_id="r2", answers={}, approved=("ask",)),
        ToolCompleted(call_id="ask", result={"output": "wrote"}, **ids),
    ]
    answered = [
        *paused,
        ToolResultMessage("rej", "unknown tool 'nope'", is_error=True),
        ToolResultMessage("ask", "wrote"),
    ]
    assert fold_both(resumed) == answered
    for cut in range(len(resumed) + 1):
        assert fold_in_two(resumed, cut) == answered


def test_the_folds_answers_of_calls_are_the_ones_its_history_gives() -> None:
    # What a session gives the calls a failed continuation left unanswered (`answers`): the
    # answer `messages` gives each, wherever the fold's entries are (kept as stored text or not);
    # a call of a pause still open, or with no answer of its own, gets none.
    _, events = paused_reply_events()
    resolved = [
        *events,
        RequestAccepted(request_id="r2", command_id="r2", input={"resume": "r1"}),
        RequestStarted(request_id="r2"),
        InterruptsResolved(
            request_id="r1", continuation_id="r2", answers={}, results={"ask": {"text": "Error: no", "is_error": True}}
        ),
    ]
    calls = ["rej", "ask", "other"]
    for cut in range(len(resolved) + 1):
        first = ConversationFold()
        for event in resolved[:cut]:
            first.feed(event)
        state, entries, outcomes = first.to_parts()
        fold = ConversationFold.from_parts(json.loads(json.dumps(state)), entries, outcomes)
        for event in resolved[cut:]:
            fold.feed(event)
        given = {m.tool_call_id: m for m in fold.messages() if isinstance(m, ToolResultMessage)}
        assert fold.answers(calls) == given
    assert given == {
        "rej": ToolResultMessage("rej", "unknown tool 'nope'", is_error=True),
        "ask": ToolResultMessage("ask", "Error: no", is_error=True),
    }
    paused = ConversationFold()
    for event in events:
        paused.feed(event)
    assert paused.answers(calls) == {}  # the pause is open: its calls wait, the refused one too


def test_a_chat_run_given_its_history_forgets_the_pauses_before_it() -> None:
    # Its history replaces the paused calls', and its model may reuse their ids (a chat run's ids
    # are kept unique within its own history): a reply's answer of such an id is its own.
    _, events = paused_reply_events({"chat": True, **encode_conversation([UserMessage("hi")])})
    again = ModelReplyRecord(tool_calls=[ToolCallPart("rej", "nope", "{}")], rejected={"rej": "unknown tool 'nope'"})
    later: list[Event] = [
        *events,
        RequestAccepted(
            request_id="r2", command_id="r2", input={"chat": True, **encode_conversation([UserMessage("other")])}
        ),
        RequestStarted(request_id="r2"),
        ModelAttemptCompleted(request_id="r2", turn_id="r2-t1", attempt_id="r2-t1-a1", response=again.to_payload()),
    ]
    expected = [UserMessage("other"), again.message(), ToolResultMessage("rej", "unknown tool 'nope'", is_error=True)]
    assert fold_both(later) == expected
    for cut in range(len(later) + 1):
        assert fold_in_two(later, cut) == expected


# ---------------------------------------------------------------- against the live loop


async def test_the_fold_rebuilds_what_the_live_loop_built() -> None:
    @define_tool(
        name="read",
        description="reads",
        input_schema={"type": "object"},
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
    )
    async def read(input: dict[str, Any], ctx: Any) -> Any:
        return {"read": input.get("path")}

    model = TestModel(
        {
            "go": [
                Reply(text="looking", tool_calls=[("read", {"path": "a"}), ("nope", {}), ("read", "{bad json")]),
                Reply(text="done"),
            ]
        }
    )
    async with open_session(provider=model, tools=[read]) as session:
        await session.send("go")
        live = list(session.messages())
        envelopes = await session.journal.store.read(session.journal.stream_id())
    rebuilt = fold_conversation(envelope.event for envelope in envelopes)
    assert rebuilt == live
    assert len([m for m in rebuilt if isinstance(m, ToolResultMessage)]) == 3


@given(st.lists(st.text(max_size=5), max_size=20), st.lists(st.text(max_size=5), max_size=20))
def test_a_message_view_is_a_stable_snapshot_while_the_history_grows(before: list[str], after: list[str]) -> None:
    from trio_agent._models._history import MessageView
    from trio_agent._models._messages import SystemMessage

    history: list[Message] = [UserMessage(text) for text in before]
    system = (SystemMessage("sys"),)
    view = MessageView(history, system)
    expected = (*system, *history)
    history.extend(UserMessage(text) for text in after)  # the session appends after the request was made
    assert tuple(view) == expected
    assert len(view) == len(expected)
    assert view == expected and view == list(expected)
    assert [view[i] for i in range(-len(view), len(view))] == [*expected, *expected]
    assert view[1:] == expected[1:]
    assert view.__add__((UserMessage("x"),)) == (*expected, UserMessage("x"))  # request.messages + (...)
