"""The deterministic TestModel: per-conversation scripts, replies, streams, errors and one-timer latency."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent import ConfigError, ModelError, RateLimitError
from trio_agent.models import (
    AssistantMessage,
    FinishChunk,
    FinishReason,
    ModelRequest,
    ModelResponse,
    Operation,
    ProviderServerError,
    ReasoningDelta,
    ReasoningPart,
    StreamChunk,
    SystemMessage,
    TextDelta,
    TextPart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    UsageChunk,
    UserMessage,
)
from trio_agent.testing import Reply, TestModel, conversation_key, open_test_model


def request(
    user: str = "hello",
    *,
    conversation_id: str | None = None,
    model: str = "test-model",
    operation: Operation = Operation.CHAT,
    system: str | None = None,
) -> ModelRequest:
    messages: list[Any] = [] if system is None else [SystemMessage(system)]
    messages.append(UserMessage(user))
    options = {} if conversation_id is None else {"conversation_id": conversation_id}
    return ModelRequest(operation, model, messages, options=options)


async def collect(model: TestModel, req: ModelRequest) -> list[StreamChunk]:
    return [chunk async for chunk in model.stream(req)]


# -- conversation keys ---------------------------------------------------------------------------


def test_conversation_key_prefers_metadata_then_options() -> None:
    both = ModelRequest(
        Operation.CHAT,
        "m",
        [UserMessage("hi")],
        options={"conversation_id": "from-options"},
        metadata={"conversation_id": "from-metadata"},
    )
    assert conversation_key(both) == "from-metadata"
    only_metadata = ModelRequest(Operation.CHAT, "m", [UserMessage("hi")], metadata={"conversation_id": 7})
    assert conversation_key(only_metadata) == "7"


def test_conversation_key_prefers_the_conversation_id_option() -> None:
    assert conversation_key(request("hi", conversation_id="c-7")) == "c-7"
    assert conversation_key(request("hi")) == "hi"
    assert conversation_key(request("hi", system="be brief")) == "hi"  # the first USER message
    later = ModelRequest(
        Operation.CHAT,
        "m",
        [UserMessage("first"), AssistantMessage((TextPart("a"),)), UserMessage("second")],
    )
    assert conversation_key(later) == "first"
    assert conversation_key(ModelRequest(Operation.CHAT, "m", [SystemMessage("s")])) == ""
    assert conversation_key(ModelRequest(Operation.CHAT, "m", [], options={"conversation_id": 12})) == "12"


async def test_scripts_are_keyed_per_conversation() -> None:
    model = TestModel({"a": [Reply("a1"), Reply("a2")], "b": [Reply("b1")], "by-id": [Reply("id1")]})
    assert (await model.chat(request("b"))).message.text == "b1"
    assert (await model.chat(request("a"))).message.text == "a1"
    assert (await model.chat(request("ignored", conversation_id="by-id"))).message.text == "id1"
    assert (await model.chat(request("a"))).message.text == "a2"
    assert [conversation_key(r) for r in model.requests] == ["b", "a", "by-id", "a"]


async def test_fifty_concurrent_conversations_each_get_their_own_replies_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rng = random.Random(1234)
    turns = 6
    latencies = [0.0, 0.1, 0.25, 1.0]
    script = {f"conv-{c}": [Reply(f"{c}:{t}", latency=rng.choice(latencies)) for t in range(turns)] for c in range(50)}
    received: dict[int, list[str]] = {c: [] for c in range(50)}

    async with open_test_model(script) as model:

        async def conversation(c: int) -> None:
            for _ in range(turns):
                # Rotate through the three keying modes; all name the same script.
                mode = len(received[c]) % 3
                if mode == 0:
                    req = request(f"conv-{c}")
                elif mode == 1:
                    req = request("anything", conversation_id=f"conv-{c}")
                else:
                    req = ModelRequest(
                        Operation.CHAT, "test-model", [UserMessage("x")], metadata={"conversation_id": f"conv-{c}"}
                    )
                if len(received[c]) == 3:
                    chunks = await collect(model, req)
                    received[c].append("".join(ch.text for ch in chunks if isinstance(ch, TextDelta)))
                else:
                    received[c].append((await model.chat(req)).message.text)
                for _ in range(rng.randrange(3)):
                    await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for c in range(50):
                nursery.start_soon(conversation, c)

    assert received == {c: [f"{c}:{t}" for t in range(turns)] for c in range(50)}
    assert len(model.requests) == 50 * turns


# -- defaults, respond= and exhaustion -------------------------------------------------------------


async def test_default_single_reply_repeats_for_every_unscripted_key() -> None:
    model = TestModel({"a": [Reply("scripted")]}, default=Reply("fallback"))
    assert (await model.chat(request("x"))).message.text == "fallback"
    assert (await model.chat(request("y"))).message.text == "fallback"
    assert (await model.chat(request("a"))).message.text == "scripted"
    assert (await model.chat(request("x"))).message.text == "fallback"


async def test_default_list_is_consumed_in_order_then_exhausted() -> None:
    model = TestModel(default=[Reply("one"), Reply("two")])
    assert (await model.chat(request("x"))).message.text == "one"
    assert (await model.chat(request("y"))).message.text == "two"
    with pytest.raises(ModelError) as caught:
        await model.chat(request("z"))
    assert caught.value.code == "test_model_exhausted"
    assert not caught.value.retryable


async def test_exhausted_script_raises_test_model_exhausted() -> None:
    model = TestModel({"a": [Reply("only")]})
    assert (await model.chat(request("a"))).message.text == "only"
    with pytest.raises(ModelError, match="'a'") as caught:
        await model.chat(request("a"))
    assert caught.value.code == "test_model_exhausted"
    with pytest.raises(ModelError) as caught:
        await collect(model, request("never-scripted"))
    assert caught.value.code == "test_model_exhausted"


async def test_exhausted_script_does_not_fall_back_to_the_default() -> None:
    model = TestModel({"a": [Reply("only")]}, default=Reply("fallback"))
    await model.chat(request("a"))
    with pytest.raises(ModelError) as caught:
        await model.chat(request("a"))
    assert caught.value.code == "test_model_exhausted"


async def test_respond_function_sees_each_request() -> None:
    seen: list[ModelRequest] = []

    def respond(req: ModelRequest) -> Reply:
        seen.append(req)
        return Reply(f"echo {req.messages[-1].content} via {req.model} #{req.options.get('n')}")  # type: ignore[union-attr]

    model = TestModel({"ignored": [Reply("never")]}, respond=respond, model="m-1")
    first = request("ping", model="m-1")
    response = await model.chat(first)
    assert response.message.text == "echo ping via m-1 #None"
    second = ModelRequest(Operation.STREAM, "m-1", [UserMessage("pong")], options={"n": 2})
    text = "".join(c.text for c in await collect(model, second) if isinstance(c, TextDelta))
    assert text == "echo pong via m-1 #2"
    assert seen == [first, second]
    assert model.requests == [first, second]


async def test_requests_are_recorded_even_when_the_reply_is_an_error() -> None:
    error = ProviderServerError("boom", status=503)
    model = TestModel(default=Reply(error=error))
    req = request("x")
    with pytest.raises(ProviderServerError) as caught:
        await model.chat(req)
    assert caught.value is error
    assert model.requests == [req]


async def test_a_script_gives_the_same_ids_however_many_models_ran_before_it() -> None:
    # The ids came from one counter for the whole process: a second run of the same script
    # (a fresh model) got other tool call and response ids, so a "deterministic" run was not.
    async def run_once() -> list[str]:
        model = TestModel(default=[Reply(tool_calls=[("t", {}), ("u", {})]), Reply("done", [("t", {})])])
        ids: list[str] = []
        for _ in range(2):
            response = await model.chat(request("x"))
            ids += [call.id for call in response.message.tool_calls] + [response.id]
        return ids

    first = await run_once()
    assert first == ["call_1", "call_2", "test-3", "call_4", "test-5"]
    assert await run_once() == first


async def test_with_model_shares_the_id_counter_so_ids_stay_unique_across_names() -> None:
    model = TestModel(default=Reply(tool_calls=[("t", {})]))
    other = model.with_model("model-b")
    calls = [(await used.chat(request("x"))).message.tool_calls[0].id for used in (model, other, model)]
    assert calls == ["call_1", "call_3", "call_5"]


async def test_with_model_shares_scripts_and_requests() -> None:
    model = TestModel({"a": [Reply("1"), Reply("2")]}, model="model-a")
    other = model.with_model("model-b")
    assert other is not model and other.model == "model-b" and model.model == "model-a"
    assert (await model.chat(request("a", model="model-a"))).model == "model-a"
    response = await other.chat(request("a", model="model-b"))
    assert response.message.text == "2" and response.model == "model-b"
    assert [r.model for r in model.requests] == ["model-a", "model-b"]
    assert other.requests is model.requests


# -- reply content ---------------------------------------------------------------------------------


async def test_text_reply() -> None:
    model = TestModel(default=Reply("Hello there, friend"))
    response = await model.chat(request("x"))
    assert isinstance(response, ModelResponse)
    assert response.message == AssistantMessage((TextPart("Hello there, friend"),))
    assert response.finish_reason is FinishReason.STOP
    assert response.model == "test-model"
    assert response.id
    # estimated usage: 10 input tokens, one output token per word
    assert response.usage == Usage(input_tokens=10, output_tokens=3, total_tokens=13)


async def test_tool_calls_dict_arguments_become_json_and_raw_strings_are_kept() -> None:
    model = TestModel(
        default=Reply(
            "Let me look.",
            tool_calls=[("search", {"query": "trio", "limit": 3}), ("broken", '{"a": '), ("empty", {})],
        )
    )
    response = await model.chat(request("x"))
    calls = response.message.tool_calls
    assert [call.name for call in calls] == ["search", "broken", "empty"]
    assert json.loads(calls[0].arguments) == {"query": "trio", "limit": 3}
    assert calls[0].parsed_arguments() == {"query": "trio", "limit": 3}
    assert calls[1].arguments == '{"a": '
    with pytest.raises(ValueError):
        calls[1].parsed_arguments()
    assert calls[2].parsed_arguments() == {}
    assert len({call.id for call in calls}) == 3
    assert response.finish_reason is FinishReason.TOOL_CALLS
    assert response.message.text == "Let me look."
    second = await model.chat(request("x"))
    assert not {c.id for c in calls} & {c.id for c in second.message.tool_calls}, "ids are unique per reply"


async def test_explicit_usage_and_reasoning() -> None:
    usage = Usage(100, 20, 120, cached_input_tokens=50, reasoning_tokens=7)
    model = TestModel(default=Reply("answer", reasoning="because", reasoning_signature="sig", usage=usage))
    response = await model.chat(request("x"))
    assert response.usage == usage
    assert response.message.parts == (ReasoningPart("because", "sig"), TextPart("answer"))
    assert response.message.text == "answer"


async def test_length_finish_reason_marks_truncation() -> None:
    model = TestModel(
        default=Reply(
            "cut off mid", tool_calls=[("write", '{"path": "a.txt", "con')], finish_reason=FinishReason.LENGTH
        )
    )
    response = await model.chat(request("x"))
    assert response.finish_reason is FinishReason.LENGTH
    assert response.message.tool_calls[0].arguments == '{"path": "a.txt", "con'
    chunks = await collect(model, request("x"))
    assert chunks[-1] == FinishChunk(FinishReason.LENGTH)


async def test_error_reply_raises_the_scripted_error() -> None:
    error = RateLimitError("slow down", retry_after=3)
    model = TestModel({"a": [Reply(error=error), Reply("after")]})
    with pytest.raises(RateLimitError) as caught:
        await model.chat(request("a"))
    assert caught.value is error and caught.value.retry_after == 3
    assert (await model.chat(request("a"))).message.text == "after"


async def test_stream_error_before_any_chunk() -> None:
    error = ProviderServerError("down", status=500)
    model = TestModel(default=Reply("never seen", error=error))
    chunks: list[StreamChunk] = []
    with pytest.raises(ProviderServerError) as caught:
        async for chunk in model.stream(request("x")):
            chunks.append(chunk)
    assert caught.value is error
    assert chunks == []


@pytest.mark.parametrize("cut", [0, 1, 3, 5])
async def test_stream_fails_after_the_given_number_of_chunks(cut: int) -> None:
    error = ProviderServerError("connection reset", status=502)
    model = TestModel(default=Reply("one two three four five six", error=error, fail_after_chunks=cut))
    chunks: list[StreamChunk] = []
    with pytest.raises(ProviderServerError) as caught:
        async for chunk in model.stream(request("x")):
            chunks.append(chunk)
    assert caught.value is error
    assert chunks == [TextDelta(w) for w in ["one", " two", " three", " four", " five"]][:cut]


async def test_stream_cut_without_an_error_uses_a_retryable_default() -> None:
    model = TestModel(default=Reply("a b c", fail_after_chunks=2))
    chunks: list[StreamChunk] = []
    with pytest.raises(ModelError) as caught:
        async for chunk in model.stream(request("x")):
            chunks.append(chunk)
    assert caught.value.code == "test_stream_cut" and caught.value.retryable
    assert chunks == [TextDelta("a"), TextDelta(" b")]


@pytest.mark.parametrize("cut", [3, 4, 50])  # "a b" streams 4 chunks: text, text, usage, finish
@pytest.mark.parametrize("scripted", [True, False], ids=["error", "no-error"])
async def test_a_cut_past_the_streams_last_chunk_fails_it_at_its_end(cut: int, scripted: bool) -> None:
    # It ended normally, the scripted error dropped, while chat() on the same reply raised it.
    error = ModelError("boom", code="boom") if scripted else None
    model = TestModel(default=Reply("a b", error=error, fail_after_chunks=cut))
    chunks: list[StreamChunk] = []
    with pytest.raises(ModelError) as streamed:
        async for chunk in model.stream(request("x")):
            chunks.append(chunk)
    assert [type(chunk) for chunk in chunks] == [TextDelta, TextDelta, UsageChunk, FinishChunk][:cut]
    if scripted:
        assert streamed.value is error
        with pytest.raises(ModelError) as chatted:  # the two operations agree
            await model.chat(request("x"))
        assert chatted.value is error
    else:
        assert streamed.value.code == "test_stream_cut" and streamed.value.retryable


@pytest.mark.parametrize("cut", [0, 1, 50])
async def test_a_reply_cut_without_an_error_fails_a_chat_as_it_fails_a_stream(cut: int) -> None:
    # A chat call on it succeeded, so a run failed or not depending on whether its loop streamed.
    model = TestModel(default=Reply("hello world", fail_after_chunks=cut))
    with pytest.raises(ModelError) as streamed:
        await collect(model, request("x"))
    with pytest.raises(ModelError) as chatted:
        await model.chat(request("x"))
    for caught in (streamed, chatted):
        assert caught.value.code == "test_stream_cut" and caught.value.retryable


# -- streaming chunk sequence ----------------------------------------------------------------------

words = st.text(alphabet=st.characters(codec="utf-8", exclude_characters=" "), min_size=1, max_size=6)
texts = st.lists(words, min_size=0, max_size=8).map(" ".join)
arguments = st.one_of(
    st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
    st.sampled_from(['{"a": ', "", "x"]),
)
tool_call_lists = st.lists(st.tuples(st.sampled_from(["search", "read", "write"]), arguments), max_size=3)


def check_stream_against_response(chunks: list[StreamChunk], response: ModelResponse) -> None:
    """The chunk grammar: reasoning?, text deltas, per call Start Delta* End, UsageChunk, FinishChunk."""
    assert isinstance(chunks[-1], FinishChunk) and chunks[-1].reason is response.finish_reason
    assert chunks[-2] == UsageChunk(response.usage)
    assert not any(isinstance(c, (UsageChunk, FinishChunk)) for c in chunks[:-2])
    body = chunks[:-2]
    reasoning = [p for p in response.message.parts if isinstance(p, ReasoningPart)]
    if reasoning:
        assert body[0] == ReasoningDelta(reasoning[0].text, reasoning[0].signature)
        body = body[1:]
    text = "".join(c.text for c in body if isinstance(c, TextDelta))
    assert text == response.message.text
    calls = response.message.tool_calls
    starts = [c for c in body if isinstance(c, ToolCallStart)]
    ends = [c for c in body if isinstance(c, ToolCallEnd)]
    assert [(s.index, s.name) for s in starts] == [(i, call.name) for i, call in enumerate(calls)]
    assert [(e.index, e.name, e.arguments) for e in ends] == [(i, c.name, c.arguments) for i, c in enumerate(calls)]
    for index in range(len(calls)):
        start = body.index(starts[index])
        end = body.index(ends[index])
        assert start < end
        between = body[start + 1 : end]
        assert all(isinstance(c, ToolCallDelta) and c.index == index for c in between)
        assert "".join(c.arguments for c in between) == ends[index].arguments  # type: ignore[union-attr]
        assert starts[index].id == ends[index].id
    # text deltas come before any tool call chunk
    kinds = [type(c) for c in body]
    if starts:
        assert TextDelta not in kinds[kinds.index(ToolCallStart) :]


@settings(max_examples=60, deadline=None)
@given(text=texts, tool_calls=tool_call_lists, reasoning=st.none() | st.text(max_size=10))
def test_stream_chunk_sequence_matches_the_reply(text: str, tool_calls: list[Any], reasoning: str | None) -> None:
    reply = Reply(text, tool_calls=tool_calls, reasoning=reasoning, reasoning_signature="s" if reasoning else None)
    model = TestModel(default=reply)

    async def main() -> tuple[list[StreamChunk], ModelResponse]:
        return await collect(model, request("x")), await model.chat(request("x"))

    chunks, response = trio.run(main)
    check_stream_against_response(chunks, response)
    assert len([c for c in chunks if isinstance(c, TextDelta)]) == (len(text.split(" ")) if text else 0)


async def test_stream_of_text_and_two_tool_calls_exactly() -> None:
    model = TestModel(default=Reply("I will", tool_calls=[("read", {"p": "a"}), ("read", "{}")], usage=Usage(1, 2, 3)))
    chunks = await collect(model, request("x"))
    first_id = chunks[2].id  # type: ignore[union-attr]
    second_id = chunks[6].id  # type: ignore[union-attr]
    assert chunks == [
        TextDelta("I"),
        TextDelta(" will"),
        ToolCallStart(0, first_id, "read"),
        ToolCallDelta(0, '{"p":'),
        ToolCallDelta(0, ' "a"}'),
        ToolCallEnd(0, first_id, "read", '{"p": "a"}'),
        ToolCallStart(1, second_id, "read"),
        ToolCallDelta(1, "{"),
        ToolCallDelta(1, "}"),
        ToolCallEnd(1, second_id, "read", "{}"),
        UsageChunk(Usage(1, 2, 3)),
        FinishChunk(FinishReason.TOOL_CALLS),
    ]
    assert first_id != second_id


# -- latency and the timer task ----------------------------------------------------------------------


async def test_two_thousand_concurrent_requests_complete_together(autojump_clock: trio.testing.MockClock) -> None:
    before = trio.lowlevel.current_statistics().tasks_living
    finished: list[float] = []
    async with open_test_model(default=Reply("done", latency=1.0)) as model:
        assert trio.lowlevel.current_statistics().tasks_living == before + 1, "one timer task"
        start = trio.current_time()

        async def one(i: int) -> None:
            response = await model.chat(request(f"r{i}"))
            assert response.message.text == "done"
            finished.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for i in range(2000):
                nursery.start_soon(one, i)
        assert trio.current_time() == start + 1.0
    assert finished == [start + 1.0] * 2000
    assert len(model.requests) == 2000
    assert trio.lowlevel.current_statistics().tasks_living == before, "the timer task is gone after the block"


async def test_latencies_wake_in_deadline_order(autojump_clock: trio.testing.MockClock) -> None:
    latencies = [3.0, 0.5, 2.0, 0.0, 1.0, 0.5]
    order: list[tuple[str, float]] = []
    async with open_test_model({f"k{i}": [Reply(f"k{i}", latency=s)] for i, s in enumerate(latencies)}) as model:
        start = trio.current_time()

        async def one(i: int) -> None:
            response = await model.chat(request(f"k{i}"))
            order.append((response.message.text, trio.current_time() - start))

        async with trio.open_nursery() as nursery:
            for i in range(len(latencies)):
                nursery.start_soon(one, i)
    assert sorted(order, key=lambda item: item[1]) == order
    assert sorted(order) == sorted((f"k{i}", s) for i, s in enumerate(latencies))


async def test_latency_applies_before_the_first_stream_chunk(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_model(default=Reply("a b", latency=2.5)) as model:
        start = trio.current_time()
        seen: list[tuple[StreamChunk, float]] = []
        async for chunk in model.stream(request("x")):
            seen.append((chunk, trio.current_time() - start))
    assert [t for _, t in seen] == [2.5] * 4


async def test_latency_without_the_timer_uses_plain_sleep(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel(default=Reply("x", latency=4.0))
    start = trio.current_time()
    await model.chat(request("x"))
    assert trio.current_time() - start == 4.0


async def test_timer_task_is_gone_even_when_requests_are_still_waiting(autojump_clock: trio.testing.MockClock) -> None:
    before = trio.lowlevel.current_statistics().tasks_living
    start = trio.current_time()
    with trio.move_on_after(1.0) as scope:
        async with open_test_model(default=Reply("late", latency=10.0)) as model:
            await model.chat(request("x"))
    assert scope.cancelled_caught
    assert trio.current_time() - start == 1.0
    assert trio.lowlevel.current_statistics().tasks_living == before


async def test_cancelled_waiter_does_not_disturb_the_others(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_model({"slow": [Reply("slow", latency=5.0)], "fast": [Reply("fast", latency=1.0)]}) as model:
        start = trio.current_time()
        with trio.move_on_after(0.5):
            await model.chat(request("slow"))
        response = await model.chat(request("fast"))
        assert response.message.text == "fast"
        assert trio.current_time() - start == 1.5


async def test_errors_inside_the_block_leave_it_unwrapped() -> None:
    with pytest.raises(ModelError) as caught:
        async with open_test_model() as model:  # no script, no default
            await model.chat(request("x"))
    assert caught.value.code == "test_model_exhausted"


async def test_several_errors_raised_inside_the_block_leave_it_as_the_callers_group() -> None:
    leaves = [ValueError("a"), KeyError("b")]
    with pytest.raises(ExceptionGroup) as caught:
        async with open_test_model():
            raise ExceptionGroup("two failures", leaves)
    # the caller's own group, not one more level of "Exceptions from Trio nursery"
    assert caught.value.message == "two failures"
    assert list(caught.value.exceptions) == leaves
    assert all(a is b for a, b in zip(caught.value.exceptions, leaves, strict=True))


async def test_unwrapping_keeps_the_errors_own_cause() -> None:
    cause = ValueError("the real problem")
    with pytest.raises(ModelError) as caught:
        async with open_test_model():
            raise ModelError("wrapped") from cause
    assert caught.value.__cause__ is cause


async def test_an_unscripted_conversation_names_its_key_and_the_known_keys() -> None:
    from trio_agent import ModelError
    from trio_agent.models import ModelService, UserMessage

    model = TestModel({"hello": [Reply(text="hi")]})
    service = ModelService(model)
    with pytest.raises(ModelError, match=r"no script for conversation 'other'.*'hello'"):
        await service.chat([UserMessage("other")])
    assert (await service.chat([UserMessage("hello")])).message.parts
    with pytest.raises(ModelError, match=r"script for conversation 'hello' ran out.*'hello'"):
        await service.chat([UserMessage("hello")])


async def test_scripts_can_be_keyed_explicitly() -> None:
    from trio_agent.models import ModelService, TextPart, UserMessage

    model = TestModel(
        {"last:b": [Reply(text="for b")]},
        key=lambda request: "last:" + [m.content for m in request.messages if isinstance(m, UserMessage)][-1],
    )
    response = await ModelService(model).chat([UserMessage("a"), UserMessage("b")])
    assert response.message.parts == (TextPart("for b"),)


# -- a script's mistakes -------------------------------------------------------------------------


async def test_a_latency_that_is_not_a_finite_duration_is_refused_and_never_reaches_the_shared_timer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A NaN latency went on the timer heap that every conversation of open_test_model shares:
    # trio.move_on_at(nan) raised in the timer task and took down every conversation. An int too
    # large for a float raised OverflowError (math.isfinite) rather than the ConfigError.
    for latency in (float("nan"), float("inf"), -1.0, True, "1", 10**400, -(10**5000)):
        with pytest.raises(ConfigError, match=r"Reply\.latency must be a finite number of seconds >= 0"):
            Reply("x", latency=latency)  # type: ignore[arg-type]
    answered: list[str] = []
    async with open_test_model({"good": [Reply("fine", latency=0.5)]}) as model:

        async def good() -> None:
            answered.append((await model.chat(request("good"))).message.text)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(good)
            await trio.testing.wait_all_tasks_blocked()  # the neighbour waits on the timer
            with pytest.raises(ConfigError):
                Reply("x", latency=float("nan"))  # the mistake fails where it is written
    assert answered == ["fine"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"text": None}, r"Reply\.text must be a string, got NoneType"),
        ({"reasoning": 5}, r"Reply\.reasoning must be a string, got int"),
        ({"tool_calls": [("add",)]}, r"Reply\.tool_calls\[0\] must be a \(name, arguments\) pair"),
        ({"tool_calls": ("add", {})}, r"Reply\.tool_calls\[0\] must be a \(name, arguments\) pair"),
        ({"tool_calls": [("add", {"a": {1, 2}})]}, r"Reply\.tool_calls\[0\]\.arguments\.a is not JSON: set"),
        ({"tool_calls": [("add", {"a": float("nan")})]}, r"Reply\.tool_calls\[0\]\.arguments\.a is not a finite"),
        ({"error": ValueError("boom")}, r"Reply\.error must be a ModelError or None, got ValueError"),
        ({"finish_reason": "stop"}, r"Reply\.finish_reason must be a FinishReason or None, got str"),
        ({"fail_after_chunks": -1}, r"Reply\.fail_after_chunks must be a whole number >= 0"),
    ],
)
def test_a_reply_whose_fields_cannot_be_a_model_reply_is_refused_naming_the_field(
    fields: dict[str, Any], named: str
) -> None:
    # Each of these failed later, inside the model call, as a bare AttributeError / TypeError /
    # ValueError (or, for the error, raised itself in place of a ModelError).
    with pytest.raises(ConfigError, match=named):
        Reply(**fields)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"script": {"hi": Reply(text="x")}}, r"script\['hi'\] is one Reply: give a list"),
        ({"script": {"hi": ["x"]}}, r"script\['hi'\]\[0\] is str \('x'\), not a Reply"),
        ({"script": {"hi": "x"}}, r"script\['hi'\] must be a list of Reply, got str"),
        ({"script": {1: [Reply()]}}, r"key 1 is not a string"),
        ({"script": [Reply()]}, r"script=\) must map a conversation.s key to its replies, got list"),
        ({"default": [Reply(), None]}, r"default\[1\] is NoneType \(None\), not a Reply"),
        ({"respond": Reply()}, r"respond=\) must be a function of the request, got Reply"),
    ],
)
def test_a_script_of_the_wrong_shape_is_refused_naming_where(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TestModel(**kwargs)


@pytest.mark.parametrize("returned", [None, "hello", {"text": "hi"}])
async def test_a_respond_that_returns_no_reply_is_a_model_error_called_directly_or_streamed(returned: Any) -> None:
    model = TestModel(respond=lambda request: returned)
    with pytest.raises(ModelError, match=r"respond= returned \w+ .*, not a Reply") as caught:
        await model.chat(request())
    assert caught.value.code == "test_model_bad_reply"
    with pytest.raises(ModelError, match="not a Reply"):
        await collect(model, request())


@pytest.mark.parametrize("latency", [0.0, 0.01])
async def test_a_model_used_after_its_block_fails_typed_instead_of_waiting_forever(
    latency: float, autojump_clock: trio.testing.MockClock
) -> None:
    # With a latency it waited forever: the timer task had gone with the block, its timer kept.
    async with open_test_model(default=Reply("hello", latency=latency)) as model:
        assert (await model.chat(request())).message.text == "hello"
    clone = model.with_model("other")
    with trio.fail_after(60):
        for used in (model, clone):
            with pytest.raises(ModelError) as chatted:
                await used.chat(request())
            assert chatted.value.code == "provider_not_open" and not chatted.value.retryable
            with pytest.raises(ModelError) as streamed:
                await collect(used, request())
            assert streamed.value.code == "provider_not_open"
    assert len(model.requests) == 1  # no reply was taken after the block


async def test_a_request_still_waiting_out_its_latency_when_the_block_ends_fails_typed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outcome: list[str] = []

    async def late(model: TestModel) -> None:
        with pytest.raises(ModelError) as caught:
            await model.chat(request())
        outcome.append(caught.value.code)

    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            async with open_test_model(default=Reply("late", latency=10.0)) as model:
                outer.start_soon(late, model)
                await trio.testing.wait_all_tasks_blocked()  # it waits on the timer
            start = trio.current_time()
    assert outcome == ["provider_not_open"]
    assert trio.current_time() == start  # failed at once, not after its latency nor never


def _raises(request: ModelRequest) -> Reply:
    raise KeyError("no such step")


@pytest.mark.parametrize(
    ("model", "raised"),
    [
        (TestModel(respond=_raises), KeyError),
        (TestModel({"a": [Reply("x")]}, key=lambda request: ["a"]), TypeError),  # unhashable
        (TestModel({"a": [Reply("x")]}, key=lambda request: request.messages[5].content), IndexError),
    ],
    ids=["respond", "key-unhashable", "key-raises"],
)
async def test_a_respond_or_key_that_raises_is_a_model_error_called_directly(model: TestModel, raised: type) -> None:
    # Called directly (not through ModelService, which types it too) it was a bare KeyError or TypeError.
    with pytest.raises(ModelError) as chatted:
        await model.chat(request())
    with pytest.raises(ModelError) as streamed:
        await collect(model, request())
    for caught in (chatted, streamed):
        assert type(caught.value) is ModelError
        assert caught.value.code == "provider_failed" and not caught.value.retryable
        assert isinstance(caught.value.__cause__, raised)


class _Unprintable(Exception):
    """An object (here an exception, so respond= can raise it too) whose repr and str raise."""

    def __repr__(self) -> str:
        raise RuntimeError("repr boom")

    def __str__(self) -> str:
        raise RuntimeError("str boom")


class _Unhashable:
    def __hash__(self) -> int:
        raise ValueError("no hash")


def _raises_unprintable(request: ModelRequest) -> Reply:
    raise _Unprintable()


@pytest.mark.parametrize(
    ("model", "code", "told", "cause"),
    [
        (TestModel(respond=_raises_unprintable), "provider_failed", "_Unprintable object, unprintable", _Unprintable),
        (TestModel(respond=lambda request: _Unprintable()), "test_model_bad_reply", "unprintable", None),
        (TestModel({"a": [Reply("x")]}, key=lambda r: _Unhashable()), "provider_failed", "no hash", ValueError),
    ],
    ids=["respond-raises-unprintable", "respond-returns-unprintable", "key-hash-raises"],
)
async def test_a_script_value_whose_repr_or_hash_raises_is_still_a_model_error(
    model: TestModel, code: str, told: str, cause: type | None
) -> None:
    # Called directly, the message's repr (or the script lookup's hash) raised its own RuntimeError
    # or ValueError in place of the ModelError the docs promise.
    for call in (model.chat, lambda req: collect(model, req)):
        with pytest.raises(ModelError) as caught:
            await call(request())
        assert caught.value.code == code and told in str(caught.value)
        if cause is not None:
            assert isinstance(caught.value.__cause__, cause)
