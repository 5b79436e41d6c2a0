"""Journal events: strict encode/decode round trips and rejections."""

from __future__ import annotations

import copy
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agent._errors import JournalError
from trio_agent._journal._errors import InvalidTransitionError, JournalCorruptError
from trio_agent._journal._events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    ConversationSeeded,
    ErrorInfo,
    EventEnvelope,
    InboxNoted,
    InterruptsResolved,
    ModelAbortReason,
    ModelAttemptAborted,
    ModelAttemptCompleted,
    ModelAttemptFailed,
    ModelAttemptStarted,
    OutcomeUnknownReason,
    PermissionDecision,
    PermissionRequested,
    PermissionResolved,
    PermissionUpdated,
    PromptSubmitted,
    RecoveryDecision,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    RunPaused,
    SessionClosed,
    SessionCloseReason,
    SessionCreated,
    SessionReopened,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolRecoveryAction,
    ToolScheduled,
    ToolStarted,
    TurnAborted,
    TurnAbortReason,
    TurnCompleted,
    TurnStarted,
    decode_event,
    encode_event,
    event_type_name,
)
from trio_agent._tools._definition import InterruptBehavior, SideEffect, ToolKind

RT = {"request_id": "r1", "turn_id": "t1"}
CALL = {**RT, "call_id": "c1"}
ATTEMPT = {**RT, "attempt_id": "a1"}

SAMPLES: list[Any] = [
    SessionCreated(session_id="s1", agent_id="root"),
    SessionCreated(session_id="s1", agent_id="child", parent_agent_id="root"),
    SessionClosed(session_id="s1", reason=SessionCloseReason.USER),
    RequestAccepted(request_id="r1", command_id="cmd1", input={"text": "hi", "n": [1, 2.5, None, True]}),
    RequestStarted(request_id="r1"),
    RequestCompleted(request_id="r1", output={"text": "bye"}),
    RequestCompleted(request_id="r1"),
    RequestFailed(request_id="r1", error=ErrorInfo(message="boom", code="E1", retryable=True)),
    RequestInterrupted(request_id="r1", reason=RequestInterruptReason.STEERING),
    TurnStarted(**RT, turn=1),
    TurnCompleted(**RT, has_tool_calls=True),
    TurnAborted(**RT, reason=TurnAbortReason.PROCESS_RESTART),
    ModelAttemptStarted(**ATTEMPT, model="test-model"),
    ModelAttemptCompleted(**ATTEMPT, response={"content": "x"}),
    ModelAttemptFailed(**ATTEMPT, error=ErrorInfo(message="no")),
    ModelAttemptAborted(**ATTEMPT, reason=ModelAbortReason.REQUEST_INTERRUPTED),
    ToolScheduled(
        **CALL,
        tool_name="write_file",
        model_input={"path": "a"},
        side_effect=SideEffect.NON_IDEMPOTENT,
        kind=ToolKind.WRITE,
        interrupt=InterruptBehavior.BLOCK,
        concurrency_safe=False,
        idempotency_key="k1",
    ),
    ToolStarted(**CALL, input={"path": "b"}, side_effect=SideEffect.IDEMPOTENT, synthetic=True),
    ToolCompleted(**CALL, result={"ok": True}),
    ToolFailed(**CALL, result={"error": "x"}, published=False),
    ToolCancelled(**CALL, reason="permission_denied"),
    ToolOutcomeUnknown(**CALL, reason=OutcomeUnknownReason.PROCESS_RESTART),
    PermissionRequested(**CALL, permission_id="p1", message="ok?"),
    PermissionResolved(**CALL, permission_id="p1", decision=PermissionDecision.DENY),
    PermissionUpdated(request_id="r1", call_id="c1", source="tool", update={"add": [{"tool": "x", "allow": True}]}),
    PermissionUpdated(request_id="r1", source="permission_engine", update={}),
    SubagentStarted(request_id="r1", subagent_id="sub1", call_id="c1"),
    SubagentStarted(request_id="r1", subagent_id="sub2", call_id="c2", background=False),
    SubagentCompleted(request_id="r1", subagent_id="sub1"),
    SubagentCancelled(request_id="r1", subagent_id="sub1", reason="user"),
    RecoveryDecision(**CALL, decision=ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN, reason="no reconcile"),
    SessionClosed(session_id="s1", reason=SessionCloseReason.USER, final=True),
    SessionReopened(session_id="s1", life=2),
    ConversationSeeded(session_id="s1", conversation={"messages": [{"type": "UserMessage", "content": "hi"}]}),
    RunPaused(request_id="r1", state={"phase": "before_tools", "pending_calls": [{"id": "c1"}]}),
    PromptSubmitted(request_id="r1", messages=("[review] hi", "context")),
    InboxNoted(messages=("remember: the sky is green",), request_id="r1"),
    InboxNoted(messages=("[background subagent sub1 (helper) idle]: idle", ""), subagent_id="sub1"),
    InterruptsResolved(
        request_id="r1",
        continuation_id="r2",
        answers={"approval_c1": {"type": "reject", "interrupt_id": "approval_c1", "message": "no"}},
        results={"c1": {"text": "no", "is_error": True}},
    ),
]


def envelope(event: Any, seq: int = 1) -> EventEnvelope:
    return EventEnvelope(stream_id="root", seq=seq, event=event, recorded_at=1234.5)


def test_every_event_type_has_a_sample() -> None:
    assert {type(sample) for sample in SAMPLES} == set(EVENT_TYPES)


def test_errors_are_journal_errors() -> None:
    assert issubclass(JournalCorruptError, JournalError)
    assert issubclass(InvalidTransitionError, JournalError)


def test_tag_names() -> None:
    assert event_type_name(ToolScheduled) == "tool_scheduled"
    assert event_type_name(ModelAttemptStarted) == "model_attempt_started"
    assert event_type_name(TurnAborted) == "turn_aborted"
    assert len({event_type_name(cls) for cls in EVENT_TYPES}) == len(EVENT_TYPES)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(event: Any) -> None:
    env = envelope(event, seq=7)
    data = encode_event(env)
    assert data["event"]["type"] == event_type_name(type(event))
    assert data["schema_version"] == SCHEMA_VERSION
    before = copy.deepcopy(data)
    assert decode_event(data) == env
    assert data == before  # decoding never mutates its input


def _ids(event: Any) -> list[tuple[str, bool]]:
    """The id fields of an event, each with whether it is required."""
    return [
        (f.name, f.default is attrs.NOTHING)
        for f in attrs.fields(type(event))
        if f.name.endswith("_id") and getattr(event, f.name) is not None
    ]


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_missing_or_empty_ids_are_rejected(event: Any) -> None:
    data = encode_event(envelope(event))
    assert _ids(event)
    for name, required in _ids(event):
        bad_values: list[Any] = ["", 5, None] if required else ["", 5]
        for value in bad_values:
            bad = copy.deepcopy(data)
            bad["event"][name] = value
            with pytest.raises(JournalCorruptError):
                decode_event(bad)
        if required:
            bad = copy.deepcopy(data)
            del bad["event"][name]
            with pytest.raises(JournalCorruptError, match=name):
                decode_event(bad)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_unknown_fields_are_rejected(event: Any) -> None:
    data = encode_event(envelope(event))
    bad = copy.deepcopy(data)
    bad["event"]["surprise"] = 1
    with pytest.raises(JournalCorruptError, match="surprise"):
        decode_event(bad)
    bad = copy.deepcopy(data)
    bad["surprise"] = 1
    with pytest.raises(JournalCorruptError, match="surprise"):
        decode_event(bad)


@pytest.mark.parametrize(
    "field",
    ["side_effect", "kind", "interrupt"],
)
def test_bad_enum_values_are_rejected(field: str) -> None:
    data = encode_event(envelope(SAMPLES[16]))
    data["event"][field] = "bogus"
    with pytest.raises(JournalCorruptError, match="bogus"):
        decode_event(data)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(schema_version=2), "schema version"),
        (lambda d: d.update(schema_version="1"), "schema version"),
        (lambda d: d.pop("schema_version"), "schema version"),
        (lambda d: d["event"].update(type="tool_exploded"), "unknown event type"),
        (lambda d: d["event"].pop("type"), "unknown event type"),
        (lambda d: d.update(seq=0), "seq"),
        (lambda d: d.update(seq="1"), "int"),
        (lambda d: d.update(seq=True), "int"),
        (lambda d: d.update(recorded_at=float("nan")), "finite"),
        (lambda d: d.update(stream_id=""), "stream_id"),
        (lambda d: d["event"].update(concurrency_safe="yes"), "bool"),
        (lambda d: d["event"].update(model_input=[1]), "JSON object"),
        (lambda d: d["event"].update(model_input={"x": float("inf")}), "finite"),
        (lambda d: d["event"].update(tool_name=3), "str"),
    ],
)
def test_structural_rejections(mutate: Any, match: str) -> None:
    data = encode_event(envelope(SAMPLES[16]))
    mutate(data)
    with pytest.raises(JournalCorruptError, match=match):
        decode_event(data)


def test_not_a_dict_is_rejected() -> None:
    with pytest.raises(JournalCorruptError):
        decode_event([])  # type: ignore[arg-type]


def test_constructing_invalid_events_fails() -> None:
    with pytest.raises(ValueError):
        ToolCancelled(**CALL, reason="")
    with pytest.raises(ValueError):
        RequestStarted(request_id="")
    with pytest.raises(ValueError):
        TurnStarted(**RT, turn=0)
    with pytest.raises(ValueError):
        RequestAccepted(request_id="r", command_id="c", input={"x": object()})
    with pytest.raises(ValueError):
        EventEnvelope(stream_id="s", seq=1, event="nope", recorded_at=0.0)  # type: ignore[arg-type]


def test_encode_rejects_unknown_schema_version() -> None:
    with pytest.raises(JournalCorruptError):
        encode_event(EventEnvelope(stream_id="s", seq=1, event=SAMPLES[4], schema_version=9, recorded_at=0.0))


json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(), c, max_size=3))
ids = st.text(min_size=1, max_size=8)


@given(
    request_id=ids,
    command_id=ids,
    payload=st.dictionaries(st.text(), json_value, max_size=4),
    seq=st.integers(1, 2**40),
)
def test_round_trip_any_json_payload(request_id: str, command_id: str, payload: dict[str, Any], seq: int) -> None:
    env = envelope(RequestAccepted(request_id=request_id, command_id=command_id, input=payload), seq=seq)
    assert decode_event(encode_event(env)) == env


def test_permission_updated_is_tagged_and_checks_its_source() -> None:
    event = PermissionUpdated(request_id="r1", source="handler", update={"mode": "plan"})
    data = encode_event(envelope(event))
    assert data["event"]["type"] == "permission_updated"
    assert decode_event(data).event == event
    with pytest.raises(ValueError, match="source"):
        PermissionUpdated(request_id="r1", source="middleware", update={})
    data["event"]["source"] = "plugin"
    with pytest.raises(JournalCorruptError):
        decode_event(data)
    with pytest.raises(ValueError):
        PermissionUpdated(request_id="r1", source="tool", update={"x": float("nan")})


@pytest.mark.parametrize("tag", [["tool_scheduled"], {"type": "x"}, 7, None])
def test_an_event_type_that_is_not_a_string_is_corrupt_not_a_type_error(tag: object) -> None:
    from trio_agent._errors import JournalCorruptError
    from trio_agent._journal._events import SCHEMA_VERSION, decode_event

    with pytest.raises(JournalCorruptError):
        decode_event({"schema_version": SCHEMA_VERSION, "stream_id": "s/root", "seq": 1, "event": {"type": tag}})


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("depth", [200, 201, 900])
def test_how_deep_a_payload_may_nest_is_a_fixed_limit_whatever_builds_the_event(depth: int) -> None:
    # The events a session builds go through fast constructors; whether one is refused must not
    # depend on which constructor built it, nor on how deep the caller's stack is (it did: two
    # frames fewer let the fast one accept what the class refused, near the recursion limit).
    from trio_agent._journal._events import tool_started

    def by_the_class() -> object:
        return ToolStarted(
            request_id="r", turn_id="t", call_id="c", input=_nested(depth), side_effect=SideEffect.PURE, synthetic=False
        )

    def fast() -> object:
        return tool_started("r", "t", "c", _nested(depth), SideEffect.PURE, False)

    for build in (by_the_class, fast):
        if depth <= 200:
            event = build()
            envelope = EventEnvelope(stream_id="s/root", seq=1, event=event, recorded_at=1.0)  # type: ignore[arg-type]
            assert decode_event(encode_event(envelope)) == envelope  # what is accepted reads back
        else:
            with pytest.raises(ValueError, match="deeper than 200 levels"):
                build()


def test_a_stored_event_nested_deeper_than_the_limit_is_corrupt_on_read() -> None:
    envelope = EventEnvelope(
        stream_id="s/root",
        seq=1,
        event=ToolStarted(
            request_id="r", turn_id="t", call_id="c", input=_nested(150), side_effect=SideEffect.PURE, synthetic=False
        ),
        recorded_at=1.0,
    )
    data = encode_event(envelope)
    data["event"]["input"] = _nested(250)  # as a stored row another writer made
    with pytest.raises(JournalCorruptError):
        decode_event(data)


def test_a_subagent_started_written_before_background_existed_reads_as_background() -> None:
    """Old journals have no ``background``: their subagents read as background, as recovery read
    every subagent then (a foreground one's outcome is no note to the model after a reopen)."""
    data = encode_event(envelope(SubagentStarted(request_id="r1", subagent_id="sub1", call_id="c1")))
    assert data["event"].pop("background") is True
    assert decode_event(data).event == SubagentStarted(request_id="r1", subagent_id="sub1", call_id="c1")
    assert decode_event(data).event.background is True
    data["event"]["background"] = "no"
    with pytest.raises(JournalCorruptError):
        decode_event(data)


@pytest.mark.parametrize(
    "messages", [[], [5], "a note", None, [["nested"]], {"a": "b"}], ids=["empty", "int", "str", "null", "list", "dict"]
)
def test_an_inbox_note_without_a_list_of_messages_is_corrupt(messages: Any) -> None:
    """What a note holds goes back in the inbox on reopen: a stored note whose messages are not a
    non-empty list of strings is a typed error, never a note of some other text."""
    data = encode_event(envelope(InboxNoted(messages=("hi",), request_id="r1")))
    data["event"]["messages"] = messages
    with pytest.raises(JournalCorruptError, match="messages"):
        decode_event(data)
    del data["event"]["messages"]
    with pytest.raises(JournalCorruptError, match="messages"):
        decode_event(data)
    with pytest.raises((ValueError, TypeError)):
        InboxNoted(messages=messages)
