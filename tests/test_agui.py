"""AG-UI events (issue 15, part 1): the loop's events as AG-UI wire JSON, checked against the
protocol's own models (the ``ag-ui-protocol`` package, a test dependency), and their SSE framing."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import attrs
import pytest
from ag_ui.core import Event as AgUiEventModel
from ag_ui.core import Message as AgUiMessageModel
from pydantic import TypeAdapter

from trio_agent import ModelError, ToolResult, chat, define_tool
from trio_agent.agui import (
    KEEP_ALIVE,
    TOOL_PROGRESS,
    AgUiEncoder,
    json_value,
    messages_to_agui,
    sse_comment,
    sse_event,
    to_wire,
)
from trio_agent.agui import CustomEvent as WireCustomEvent
from trio_agent.lifecycle import (
    ChatMiddleware,
    CustomEvent,
    MessagesSnapshot,
    ReasoningContent,
    ReasoningEnd,
    ReasoningStart,
    RunError,
    RunFinished,
    RunStarted,
    StepFinished,
    StepStarted,
    TextMessageContent,
    TextMessageEnd,
    TextMessageStart,
    ToolCallProgress,
    UsageReported,
)
from trio_agent.models import AssistantMessage, SystemMessage, TextPart, ToolCallPart, ToolResultMessage, Usage
from trio_agent.models import UserMessage as TaUserMessage
from trio_agent.testing import Reply, TestModel

EVENTS: TypeAdapter[Any] = TypeAdapter(AgUiEventModel)
MESSAGES: TypeAdapter[Any] = TypeAdapter(AgUiMessageModel)


def valid(wire: dict[str, Any]) -> dict[str, Any]:
    """The event as the protocol's models read it back: every field we sent, nothing lost."""
    model = EVENTS.validate_python(wire)
    assert model.model_dump(by_alias=True, exclude_none=True, mode="json") == json.loads(json.dumps(wire))
    return wire


@define_tool(name="add", description="adds", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
async def add(input: dict[str, Any], ctx: Any) -> ToolResult:
    return ToolResult.success(int(input["a"]) + int(input["b"]))


def respond(request: Any) -> Reply:
    if isinstance(request.messages[-1], ToolResultMessage):
        return Reply(text="the sum is 3", usage=Usage(input_tokens=7, output_tokens=3, total_tokens=10))
    return Reply(
        reasoning="adding", tool_calls=[("add", {"a": 1, "b": 2})], usage=Usage(input_tokens=5, output_tokens=2)
    )


async def wire_of_chat(**kwargs: Any) -> list[dict[str, Any]]:
    encoder = AgUiEncoder(thread_id="thread-1")
    out: list[dict[str, Any]] = []
    async with chat(TestModel(respond=respond), "add 1 and 2", tools=[add], **kwargs) as run:
        async for event in run:
            out.extend(valid(data) for data in encoder.wire(event))
    return out


async def test_a_chat_run_with_reasoning_and_a_tool_call_is_a_valid_ag_ui_stream() -> None:
    wire = await wire_of_chat()
    types = [data["type"] for data in wire]
    assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED"
    assert wire[0]["threadId"] == "thread-1" and wire[0]["runId"] == wire[-1]["runId"]
    step = types.index("STEP_STARTED")
    assert types[step : step + 3] == ["STEP_STARTED", "REASONING_START", "REASONING_MESSAGE_START"]
    assert types.index("REASONING_MESSAGE_END") + 1 == types.index("REASONING_END")
    call = [types.index(t) for t in ("TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "TOOL_CALL_RESULT")]
    assert call == sorted(call)
    start = wire[call[0]]
    assert start["toolCallName"] == "add" and json.loads(wire[call[1]]["delta"]) == {"a": 1, "b": 2}
    assert wire[call[3]] == {
        "type": "TOOL_CALL_RESULT",
        "messageId": f"{start['toolCallId']}:result",
        "toolCallId": start["toolCallId"],
        "content": "3",
        "role": "tool",
    }
    text = "".join(data["delta"] for data in wire if data["type"] == "TEXT_MESSAGE_CONTENT")
    assert text == "the sum is 3"
    finished = wire[-1]
    assert finished["outcome"] == {"type": "success"}
    assert finished["result"] == {"stopReason": "end_turn", "text": "the sum is 3"}
    assert finished["usage"] == [{"inputTokens": 12, "outputTokens": 5, "totalTokens": 17}]  # two calls, summed
    assert all("subagentRunId" not in data for data in wire)


async def test_a_paused_run_finishes_with_an_interrupt_outcome() -> None:
    wire = await wire_of_chat(permissions={"ask": ["add"]})
    finished = wire[-1]
    assert [data["type"] for data in wire[-2:]] == ["MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    (interrupt,) = finished["outcome"]["interrupts"]
    assert finished["outcome"]["type"] == "interrupt" and interrupt["id"].startswith("approval_")
    assert interrupt["toolCallId"] and interrupt["metadata"]["kind"] == "approval"
    assert interrupt["metadata"]["toolName"] == "add" and interrupt["metadata"]["input"] == {"a": 1, "b": 2}
    snapshot = wire[-2]["messages"]
    assert [m["role"] for m in snapshot] == ["user", "assistant"]
    assert snapshot[1]["toolCalls"][0]["function"]["name"] == "add"


def test_a_subagent_run_interleaved_with_its_parent_carries_its_run_id() -> None:
    encoder = AgUiEncoder(thread_id="t", run_id="root")
    events = [
        RunStarted("root", "main", "t"),
        StepStarted("root", "main", "step-1"),
        RunStarted("sub", "researcher", "t"),
        TextMessageStart("root", "main", "m1"),
        StepStarted("sub", "researcher", "step-1"),
        TextMessageContent("root", "main", "m1", "hel"),
        TextMessageStart("sub", "researcher", "s1"),
        TextMessageContent("sub", "researcher", "s1", "found"),
        TextMessageEnd("sub", "researcher", "s1"),
        StepFinished("sub", "researcher", "step-1"),
        RunFinished("sub", "researcher", "end_turn", "found"),
        TextMessageContent("root", "main", "m1", "lo"),
        TextMessageEnd("root", "main", "m1"),
        StepFinished("root", "main", "step-1"),
        RunStarted("sub2", "critic", "t"),
        RunError("sub2", "critic", "it broke", "model_error"),
        RunFinished("root", "main", "end_turn", "hello"),
    ]
    wire = [valid(data) for event in events for data in encoder.wire(event)]
    by_run: dict[str | None, list[str]] = {}
    for data in wire:
        by_run.setdefault(data.get("subagentRunId"), []).append(data["type"])
    assert by_run["sub"] == [
        "SUBAGENT_STARTED",
        "STEP_STARTED",
        "TEXT_MESSAGE_START",
        "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END",
        "STEP_FINISHED",
        "SUBAGENT_FINISHED",
    ]
    assert by_run["sub2"] == ["SUBAGENT_STARTED", "SUBAGENT_ERROR"]
    assert by_run[None][0] == "RUN_STARTED" and by_run[None][-1] == "RUN_FINISHED"
    assert "".join(d["delta"] for d in wire if d.get("messageId") == "m1" and "delta" in d) == "hello"
    started = next(d for d in wire if d["type"] == "SUBAGENT_STARTED")
    assert started == {"type": "SUBAGENT_STARTED", "subagentRunId": "sub", "name": "researcher"}


def fold(wire: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """What an AG-UI client keeps of a stream's messages: one message per id (its role, its text)."""
    kept: dict[str, tuple[str, str]] = {}
    for data in wire:
        if data["type"] in ("TEXT_MESSAGE_START", "REASONING_MESSAGE_START"):
            role = "assistant" if data["type"] == "TEXT_MESSAGE_START" else "reasoning"
            kept.setdefault(data["messageId"], (role, ""))
        elif data["type"] in ("TEXT_MESSAGE_CONTENT", "REASONING_MESSAGE_CONTENT"):
            role, text = kept[data["messageId"]]
            kept[data["messageId"]] = (role, text + data["delta"])
    return kept


async def test_reasoning_and_the_answer_are_two_messages_not_one() -> None:
    # The loop gives a turn's reasoning and its text one message id, and the encoder passed it on:
    # a client folded the answer into the reasoning message, and the next history lost the answer.
    encoder = AgUiEncoder(thread_id="t")
    wire: list[dict[str, Any]] = []
    async with chat(TestModel(default=Reply(reasoning="let me think", text="It is 42.")), "hi") as run:
        async for event in run:
            wire.extend(valid(data) for data in encoder.wire(event))
    assert sorted(fold(wire).values()) == [("assistant", "It is 42."), ("reasoning", "let me think")]
    reasoning = {d["messageId"] for d in wire if d["type"].startswith("REASONING")}
    (text_id,) = {d["messageId"] for d in wire if d["type"].startswith("TEXT_MESSAGE")}
    assert reasoning == {f"{text_id}:reasoning-1"}  # every event of the block, one id


async def test_a_tool_call_names_the_assistant_message_it_belongs_to() -> None:
    # TOOL_CALL_START carried no parentMessageId, so a client split one assistant turn (its text
    # and its calls) into several messages, and posted that split history back.
    def text_and_call(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            return Reply(text="done")
        return Reply(text="adding now", tool_calls=[("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})])

    encoder = AgUiEncoder(thread_id="t")
    wire: list[dict[str, Any]] = []
    async with chat(TestModel(respond=text_and_call), "add", tools=[add]) as run:
        async for event in run:
            wire.extend(valid(data) for data in encoder.wire(event))
    first_text = next(d["messageId"] for d in wire if d["type"] == "TEXT_MESSAGE_START")
    parents = [d.get("parentMessageId") for d in wire if d["type"] == "TOOL_CALL_START"]
    assert parents == [first_text, first_text]


def test_each_reasoning_block_of_a_message_has_its_own_id() -> None:
    encoder = AgUiEncoder(thread_id="t")
    events = [
        RunStarted("r", "a", "t"),
        TextMessageStart("r", "a", "m"),
        TextMessageContent("r", "a", "m", "first "),
        TextMessageEnd("r", "a", "m"),
        ReasoningStart("r", "a", "m"),
        ReasoningContent("r", "a", "m", "hmm"),
        ReasoningEnd("r", "a", "m"),
        TextMessageStart("r", "a", "m"),
        TextMessageContent("r", "a", "m", "second"),
        TextMessageEnd("r", "a", "m"),
        ReasoningStart("r", "a", "m"),
        ReasoningContent("r", "a", "m", "again"),
        ReasoningEnd("r", "a", "m"),
        RunFinished("r", "a", "end_turn", "first second"),
    ]
    wire = [valid(data) for event in events for data in encoder.wire(event)]
    assert fold(wire) == {
        "m": ("assistant", "first second"),
        "m:reasoning-1": ("reasoning", "hmm"),
        "m:reasoning-2": ("reasoning", "again"),
    }


def test_errors_progress_custom_values_and_empty_deltas() -> None:
    encoder = AgUiEncoder(thread_id="t")

    class Odd:
        def __str__(self) -> str:
            return "odd"

    events = [
        RunStarted("r", "a", "t"),
        TextMessageStart("r", "a", "m"),
        TextMessageContent("r", "a", "m", ""),  # AG-UI deltas are non-empty: left out
        TextMessageEnd("r", "a", "m"),
        ToolCallProgress("r", "a", "c1", {"done": 0.5}),
        CustomEvent("r", "a", "note", {"odd": Odd(), "nan": float("nan"), "items": (1, 2)}),
        UsageReported("r", "a", Usage(input_tokens=1, output_tokens=1)),
        RunError("r", "a", "boom", "model_error"),
    ]
    wire = [valid(data) for event in events for data in encoder.wire(event)]
    assert [d["type"] for d in wire] == [
        "RUN_STARTED",
        "TEXT_MESSAGE_START",
        "TEXT_MESSAGE_END",
        "CUSTOM",
        "CUSTOM",
        "RUN_ERROR",
    ]
    assert wire[3] == {"type": "CUSTOM", "name": TOOL_PROGRESS, "value": {"toolCallId": "c1", "item": {"done": 0.5}}}
    assert wire[4]["value"] == {"odd": "odd", "nan": "nan", "items": [1, 2]}
    assert wire[5] == {"type": "RUN_ERROR", "message": "boom", "code": "model_error"}


def test_json_value_never_fails_on_a_value_that_contains_itself_nests_deeply_or_cannot_be_printed() -> None:
    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no")

    @attrs.define
    class Node:
        child: Any = None

    node = Node()
    node.child = node
    cyclic: dict[str, Any] = {}
    cyclic["me"] = cyclic
    shared = [1]
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    written = json_value(
        {"node": node, "cyclic": cyclic, "twice": [shared, shared], "odd": Unprintable(), "deep": deep}
    )
    assert written["node"] == {"child": str(node)}
    assert written["cyclic"] == {"me": "{'me': {...}}"}
    assert written["twice"] == [[1], [1]]  # met twice, never inside itself: written both times
    assert written["odd"] == "<Unprintable>"
    cut = written["deep"]
    for _ in range(199):
        (cut,) = cut
    assert cut == "<list nested more than 200 levels deep>"
    valid(to_wire(WireCustomEvent(name="n", value=written)))
    sse_event(to_wire(WireCustomEvent(name="n", value=written)))


def test_an_int_too_long_to_print_is_written_as_text_in_every_path_that_takes_any_value() -> None:
    # json_value passed it on as a number, and json.dumps then refused it (ValueError: the
    # interpreter's limit on int-to-text conversion): the frame, and so the run, failed.
    from trio_agent import ToolProgressEvent, ToolUseEvent
    from trio_agent._agui._session_encode import SessionAgUiEncoder

    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(4300)
    try:
        big, fits = 10**4300, 10**4299  # 4301 digits, one more than may be printed; 4300
        said = "<int with more than 4300 digits>"
        assert json_value({"n": big, "ok": fits, "items": [-big, True, 7], big: 1}) == {
            "n": said,
            "ok": fits,
            "items": [said, True, 7],
            said: 1,  # a key too
        }
        encoder = AgUiEncoder(thread_id="t", run_id="r")
        loop = [RunStarted("r", "a", "t"), CustomEvent("r", "a", "n", big), ToolCallProgress("r", "a", "c", [big])]
        wire = [data for event in loop for data in encoder.wire(event)]
        session = SessionAgUiEncoder(thread_id="t", run_id="r", root_agent_id="a")
        wire += [to_wire(out) for out in session.encode(ToolUseEvent("a", "c", "count", {"n": big}))]
        wire += [to_wire(out) for out in session.encode(ToolProgressEvent("a", "c", {"n": big}))]
        frames = [sse_event(valid(data)) for data in wire]  # every frame can be written
        calls = ["TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END"]
        assert [data["type"] for data in wire[1:]] == ["CUSTOM", "CUSTOM", *calls, "CUSTOM"]
        assert wire[1]["value"] == said and wire[2]["value"]["item"] == [said]
        assert json.loads(wire[4]["delta"]) == {"n": said} and wire[6]["value"]["item"] == {"n": said}
        assert len(frames) == 7
    finally:
        sys.set_int_max_str_digits(limit)


def test_an_event_before_its_runs_run_started_comes_after_the_run_started() -> None:
    # "CustomEvent may come anywhere": a middleware's on_start emits one before RunStarted, and
    # an AG-UI client refuses a stream whose first event is not RUN_STARTED.
    encoder = AgUiEncoder(thread_id="t", run_id="r")
    events = [
        CustomEvent("r", "a", "hello", 1),
        RunStarted("r", "a", "t"),
        CustomEvent("sub", "helper", "early", 2),
        RunStarted("sub", "helper", "t"),
        RunFinished("sub", "helper", "end_turn", ""),
        RunFinished("r", "a", "end_turn", ""),
    ]
    wire = [valid(data) for event in events for data in encoder.wire(event)]
    assert [(d["type"], d.get("subagentRunId")) for d in wire] == [
        ("RUN_STARTED", None),
        ("CUSTOM", None),
        ("SUBAGENT_STARTED", "sub"),
        ("CUSTOM", "sub"),
        ("SUBAGENT_FINISHED", "sub"),
        ("RUN_FINISHED", None),
    ]
    assert wire[0] == {"type": "RUN_STARTED", "threadId": "t", "runId": "r"}
    assert wire[2] == {"type": "SUBAGENT_STARTED", "subagentRunId": "sub", "name": "helper"}


class EmitsAfterTheEnd(ChatMiddleware):
    """Emits from ``on_finish`` / ``on_error`` and from a deferred function: after the loop's
    ``RunFinished`` / ``RunError``."""

    async def on_start(self, ctx: Any) -> None:
        async def flush() -> None:
            await ctx.emit_custom("flushed", 1)

        ctx.defer(flush)

    async def on_finish(self, ctx: Any, *args: Any) -> None:
        await ctx.emit_custom("metrics", {"done": True})

    async def on_error(self, ctx: Any, *args: Any) -> None:
        await ctx.emit_custom("metrics", {"failed": True})


@pytest.mark.parametrize("fails", [False, True])
async def test_nothing_follows_a_runs_terminal_event_and_what_would_is_logged(
    fails: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # A middleware's on_finish (on_error) and a deferred function emit after the loop sent its
    # RunFinished (RunError): they were written after RUN_FINISHED, and an AG-UI client refuses
    # the whole stream there ("The run has already finished").
    reply = Reply(error=ModelError("down", retryable=False)) if fails else Reply(text="hi")
    encoder = AgUiEncoder(thread_id="t")
    wire: list[dict[str, Any]] = []
    events: list[Any] = []
    with caplog.at_level(logging.DEBUG, logger="trio_agent.agui"):
        async with chat(TestModel(default=reply), "hi", middleware=[EmitsAfterTheEnd()]) as run:
            async for event in run:
                events.append(event)
                wire.extend(valid(data) for data in encoder.wire(event))
    end = "RUN_ERROR" if fails else "RUN_FINISHED"
    assert [type(e).__name__ for e in events[-3:]] == [
        "RunError" if fails else "RunFinished",
        "CustomEvent",
        "CustomEvent",
    ]
    assert wire[-1]["type"] == end and [d["type"] for d in wire].count(end) == 1
    assert "CUSTOM" not in [d["type"] for d in wire]
    dropped = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "trio_agent.agui"]
    assert [level for level, _ in dropped] == ["WARNING", "DEBUG"]
    assert dropped[0][1].startswith("CustomEvent of run ") and "came after the run's end" in dropped[0][1]


def test_once_the_root_run_ended_nothing_follows_and_a_subagents_end_is_its_last() -> None:
    encoder = AgUiEncoder(thread_id="t", run_id="r")
    events = [
        RunStarted("r", "a", "t"),
        RunStarted("sub", "helper", "t"),
        RunFinished("sub", "helper", "end_turn", ""),
        CustomEvent("sub", "helper", "late", 1),  # the subagent's, after its end
        RunStarted("bg", "helper", "t"),
        CustomEvent("r", "a", "on", 2),  # the root's, while a subagent runs: kept
        RunFinished("r", "a", "end_turn", ""),
        CustomEvent("bg", "helper", "after the root", 3),  # the stream has ended
        RunFinished("r", "a", "end_turn", "again"),
        RunError("bg", "helper", "boom"),
    ]
    wire = [valid(data) for event in events for data in encoder.wire(event)]
    assert [(d["type"], d.get("subagentRunId")) for d in wire] == [
        ("RUN_STARTED", None),
        ("SUBAGENT_STARTED", "sub"),
        ("SUBAGENT_FINISHED", "sub"),
        ("SUBAGENT_STARTED", "bg"),
        ("CUSTOM", None),
        ("RUN_FINISHED", None),
    ]


def test_an_aborted_run_is_cancelled() -> None:
    encoder = AgUiEncoder(thread_id="t")
    encoder.wire(RunStarted("r", "a", "t"))
    (finished,) = encoder.wire(RunFinished("r", "a", "aborted", ""))
    assert valid(finished)["outcome"] == {"type": "cancelled"}


def test_a_conversation_as_ag_ui_messages() -> None:
    history = [
        SystemMessage("be brief"),
        TaUserMessage("add"),
        AssistantMessage([TextPart("on it"), ToolCallPart("c1", "add", '{"a":1}')]),
        ToolResultMessage("c1", "boom", is_error=True),
        AssistantMessage([TextPart("sorry")]),
    ]
    wire = [to_wire(message) for message in messages_to_agui(history)]
    for data in wire:
        MESSAGES.validate_python(data)
    assert wire == [
        {"role": "system", "id": "m0", "content": "be brief"},
        {"role": "user", "id": "m1", "content": "add"},
        {
            "role": "assistant",
            "id": "m2",
            "content": "on it",
            "toolCalls": [{"id": "c1", "function": {"name": "add", "arguments": '{"a":1}'}, "type": "function"}],
        },
        {"role": "tool", "id": "m3", "content": "boom", "toolCallId": "c1", "error": "boom"},
        {"role": "assistant", "id": "m4", "content": "sorry"},
    ]
    snapshot = AgUiEncoder(thread_id="t").wire(MessagesSnapshot("r", "a", tuple(history)))
    assert valid(snapshot[-1])["messages"] == wire  # after the RUN_STARTED its first event opens


def test_sse_framing() -> None:
    frame = sse_event({"type": "CUSTOM", "name": "n", "value": "line\nbreak é \ud800"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert json.loads(frame[6:].decode()) == {"type": "CUSTOM", "name": "n", "value": "line\nbreak é ?"}
    assert KEEP_ALIVE == b": keep-alive\n\n" and sse_comment("a\nb") == b": a b\n\n"
    with pytest.raises(ValueError):
        sse_event({"value": float("inf")})


def test_a_session_requests_events_with_a_subagent_are_a_valid_ag_ui_stream() -> None:
    from trio_agent import DoneEvent, SubagentEvent, TextDeltaEvent, ToolResultEvent, ToolUseEvent, UsageEvent
    from trio_agent._agui._session_encode import SessionAgUiEncoder
    from trio_agent._session._messages import SubagentStatus
    from trio_agent.lifecycle import StopReason

    encoder = SessionAgUiEncoder(thread_id="t", run_id="r", root_agent_id="root")
    events: list[object] = [
        TextDeltaEvent("root", "let me "),
        TextDeltaEvent("root", "look"),
        SubagentEvent("root", "sub-1", "researcher", SubagentStatus.RUNNING, background=True),
        TextDeltaEvent("sub-1", "found it"),
        ToolUseEvent("root", "c1", "add", {"a": 1, "b": 2}),
        ToolUseEvent("sub-1", "c2", "search", {"q": "x"}),
        ToolResultEvent("sub-1", "c2", "search", ToolResult.success("a page")),
        SubagentEvent("root", "sub-1", "researcher", SubagentStatus.COMPLETED, background=True, summary="done"),
        ToolResultEvent("root", "c1", "add", ToolResult.success(3)),
        UsageEvent("root", Usage(input_tokens=3, output_tokens=4)),
        TextDeltaEvent("root", "3"),
        DoneEvent("req", "let me look3", StopReason.END_TURN, 2),
    ]
    wire = [valid(to_wire(out)) for out in encoder.start()]
    wire += [valid(to_wire(out)) for event in events for out in encoder.encode(event)]
    by_run: dict[str | None, list[str]] = {}
    for data in wire:
        by_run.setdefault(data.get("subagentRunId"), []).append(data["type"])
    assert by_run["sub-1"] == [
        "SUBAGENT_STARTED",
        "TEXT_MESSAGE_START",
        "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END",
        "TOOL_CALL_START",
        "TOOL_CALL_ARGS",
        "TOOL_CALL_END",
        "TOOL_CALL_RESULT",
        "SUBAGENT_FINISHED",
    ]
    root = by_run[None]
    assert root[0] == "RUN_STARTED" and root[-1] == "RUN_FINISHED"
    assert root.count("TEXT_MESSAGE_START") == root.count("TEXT_MESSAGE_END") == 2  # text, a call, text
    assert wire[-1]["usage"] == [{"inputTokens": 3, "outputTokens": 4, "totalTokens": 7}]
    aborted = SessionAgUiEncoder(thread_id="t", run_id="r2", root_agent_id="root")
    opened = aborted.encode(TextDeltaEvent("root", "partial"))
    (end, finished) = aborted.aborted()
    assert [to_wire(e)["type"] for e in opened] == ["TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT"]
    assert valid(to_wire(end))["type"] == "TEXT_MESSAGE_END" and valid(to_wire(finished))["outcome"] == {
        "type": "cancelled"
    }
