"""The agent loop: model <-> tools until the model stops or ``max_turns``.

Parallel calls of one turn run concurrently and in isolation, their results
reach the model in call order, and every call id is answered exactly once:
also for invalid JSON, unknown tools and calls cut off by the output limit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_agent import (
    DoneEvent,
    SideEffect,
    ToolErrorType,
    ToolKind,
    ToolResult,
    ToolResultEvent,
    ToolUseEvent,
    define_tool,
    open_session,
)
from trio_agent.journal import MemoryStore, ToolCompleted, ToolFailed, ToolScheduled, TurnCompleted
from trio_agent.models import (
    AssistantMessage,
    FinishChunk,
    FinishReason,
    ModelRequest,
    ModelResponse,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallPart,
    ToolCallStart,
    ToolResultMessage,
)
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object"}


def tool_results(messages: Any) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


def call_ids(messages: Any) -> list[str]:
    """The ids of the tool calls of the last assistant message in ``messages``."""
    assistant = [m for m in messages if isinstance(m, AssistantMessage)][-1]
    return [p.id for p in assistant.parts if isinstance(p, ToolCallPart)]


async def collect(session: Any, prompt: str) -> list[Any]:
    seen: list[Any] = []
    async with session.stream(prompt) as events:
        async for event in events:
            seen.append(event)
    return seen


def counting_tool(name: str = "count") -> tuple[Any, list[dict[str, Any]]]:
    runs: list[dict[str, Any]] = []

    @define_tool(
        name=name,
        description="counts its runs",
        input_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": False},
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
    )
    async def tool(input: dict[str, Any], ctx: Any) -> str:
        runs.append(dict(input))
        return f"ran {input.get('n')}"

    return tool, runs


# ---------------------------------------------------------------- stopping


async def test_loop_runs_until_the_model_stops() -> None:
    count, runs = counting_tool()
    model = TestModel(
        {
            "go": [
                Reply(tool_calls=[("count", {"n": 1})]),
                Reply(tool_calls=[("count", {"n": 2})]),
                Reply(text="stopped by itself"),
            ]
        }
    )
    async with open_session(provider=model, tools=[count], max_turns=10) as session:
        seen = await collect(session, "go")
    done = seen[-1]
    assert isinstance(done, DoneEvent)
    assert (done.text, done.stop_reason, done.turns) == ("stopped by itself", "end_turn", 3)
    assert runs == [{"n": 1}, {"n": 2}]
    assert len(model.requests) == 3
    # Each request carries every earlier result.
    assert [r.content for r in tool_results(model.requests[2].messages)] == ["ran 1", "ran 2"]


async def test_max_turns_stops_the_loop() -> None:
    count, runs = counting_tool()
    model = TestModel(default=Reply(text="again", tool_calls=[("count", {"n": 7})]))
    store = MemoryStore()
    async with open_session(provider=model, tools=[count], max_turns=3, journal=store) as session:
        seen = await collect(session, "loop forever")
        journal = [e.event for e in await store.read(session.journal.stream_id())]
    done = seen[-1]
    assert isinstance(done, DoneEvent)
    assert (done.stop_reason, done.turns, done.error) == ("max_turns", 3, None)
    assert len(model.requests) == 3
    assert len(runs) == 3
    assert sum(isinstance(e, TurnCompleted) for e in journal) == 3


async def test_max_turns_one_allows_exactly_one_model_call() -> None:
    count, runs = counting_tool()
    model = TestModel(default=Reply(tool_calls=[("count", {"n": 1})]))
    async with open_session(provider=model, tools=[count], max_turns=1) as session:
        seen = await collect(session, "once")
    assert isinstance(seen[-1], DoneEvent) and seen[-1].stop_reason == "max_turns"
    assert len(model.requests) == 1 and len(runs) == 1


async def test_final_reply_cut_off_by_the_output_limit_stops_with_max_tokens() -> None:
    model = TestModel({"long": [Reply(text="and then the", finish_reason=FinishReason.LENGTH)]})
    async with open_session(provider=model) as session:
        seen = await collect(session, "long")
    assert isinstance(seen[-1], DoneEvent)
    assert (seen[-1].stop_reason, seen[-1].text) == ("max_tokens", "and then the")


# ---------------------------------------------------------------- parallel calls


async def test_parallel_calls_of_one_turn_run_concurrently(autojump_clock: trio.testing.MockClock) -> None:
    arrived: list[str] = []
    both = trio.Event()

    @define_tool(name="meet", description="m", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def meet(input: dict[str, Any], ctx: Any) -> str:
        arrived.append(input["who"])
        if len(arrived) == 2:
            both.set()
        # Neither call can finish unless the other one runs at the same time.
        with trio.fail_after(30):
            await both.wait()
        return f"{input['who']} met"

    model = TestModel({"meet": [Reply(tool_calls=[("meet", {"who": "a"}), ("meet", {"who": "b"})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[meet]) as session:
        assert await session.send("meet") == "ok"
    assert sorted(arrived) == ["a", "b"]
    results = tool_results(model.requests[1].messages)
    assert [(r.content, r.is_error) for r in results] == [("a met", False), ("b met", False)]


async def test_results_reach_the_model_in_call_order_even_when_finishing_in_reverse(
    autojump_clock: trio.testing.MockClock,
) -> None:
    finished: list[int] = []
    gates = [trio.Event() for _ in range(4)]
    gates[3].set()

    @define_tool(name="step", description="s", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def step(input: dict[str, Any], ctx: Any) -> str:
        index = int(input["i"])
        await gates[index].wait()  # call i finishes only after call i+1 finished
        finished.append(index)
        if index:
            gates[index - 1].set()
        return f"result {index}"

    calls = [("step", {"i": i}) for i in range(4)]
    model = TestModel({"order": [Reply(tool_calls=calls), Reply(text="done")]})
    async with open_session(provider=model, tools=[step]) as session:
        seen = await collect(session, "order")
    assert finished == [3, 2, 1, 0]
    # Published as they finished ...
    published = [e.result.output for e in seen if isinstance(e, ToolResultEvent)]
    assert published == ["result 3", "result 2", "result 1", "result 0"]
    # ... but the model gets them in call order, one answer per call id.
    messages = model.requests[1].messages
    results = tool_results(messages)
    assert [r.tool_call_id for r in results] == call_ids(messages)
    assert [r.content for r in results] == [f"result {i}" for i in range(4)]


async def test_sibling_isolation_failure_and_timeout_never_destroy_other_results(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: dict[str, trio.Event] = {"boom": trio.Event(), "timeout": trio.Event()}

    @define_tool(name="boom", description="raises", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def boom(input: dict[str, Any], ctx: Any) -> str:
        events["boom"].set()
        raise ValueError("the boom tool failed")

    @define_tool(
        name="hang", description="hangs", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly", timeout=5
    )
    async def hang(input: dict[str, Any], ctx: Any) -> str:
        try:
            await trio.sleep_forever()
        finally:
            events["timeout"].set()

    @define_tool(name="good", description="fine", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def good(input: dict[str, Any], ctx: Any) -> ToolResult:
        # Finishes only after both siblings failed.
        await events["boom"].wait()
        await events["timeout"].wait()
        return ToolResult.success("good result", data={"fine": True})

    store = MemoryStore()
    model = TestModel(
        {"mixed": [Reply(tool_calls=[("boom", {}), ("good", {}), ("hang", {})]), Reply(text="handled all three")]}
    )
    async with open_session(provider=model, tools=[boom, good, hang], journal=store) as session:
        seen = await collect(session, "mixed")
        journal = [e.event for e in await store.read(session.journal.stream_id())]
    assert isinstance(seen[-1], DoneEvent) and seen[-1].text == "handled all three"
    results = tool_results(model.requests[1].messages)
    assert [r.tool_call_id for r in results] == call_ids(model.requests[1].messages)
    boom_result, good_result, hang_result = results
    assert boom_result.is_error and "the boom tool failed" in boom_result.content
    assert (good_result.is_error, good_result.content) == (False, "good result")
    assert hang_result.is_error
    by_name = {e.tool_name: e.result for e in seen if isinstance(e, ToolResultEvent)}
    assert by_name["hang"].error is not None and by_name["hang"].error.type is ToolErrorType.TIMEOUT
    assert by_name["boom"].error is not None and by_name["boom"].error.type is ToolErrorType.EXECUTION
    assert by_name["good"].ok and by_name["good"].data == {"fine": True}
    # All three settled durably.
    assert sum(isinstance(e, ToolCompleted) for e in journal) == 1
    assert (
        sum(isinstance(e, ToolFailed) for e in journal) + sum(type(e).__name__ == "ToolCancelled" for e in journal) == 2
    )


# ---------------------------------------------------------------- every call is answered


async def test_invalid_json_arguments_become_an_error_the_model_sees() -> None:
    count, runs = counting_tool()
    model = TestModel(
        {
            "bad": [
                Reply(tool_calls=[("count", "{bad"), ("count", {"n": 1}), ("count", "[1, 2]")]),
                Reply(text="I will fix my arguments"),
            ]
        }
    )
    async with open_session(provider=model, tools=[count]) as session:
        seen = await collect(session, "bad")
    assert seen[-1].text == "I will fix my arguments"
    assert runs == [{"n": 1}]  # only the valid call ran
    messages = model.requests[1].messages
    results = tool_results(messages)
    assert [r.tool_call_id for r in results] == call_ids(messages)
    assert [r.is_error for r in results] == [True, False, True]
    assert "JSON" in results[0].content and "JSON" in results[2].content
    assert results[1].content == "ran 1"
    assert sum(isinstance(e, ToolResultEvent) for e in seen) == 3


async def test_unknown_tool_becomes_an_error_and_the_loop_continues() -> None:
    count, runs = counting_tool()
    model = TestModel({"oops": [Reply(tool_calls=[("no_such_tool", {}), ("count", {"n": 2})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[count]) as session:
        assert await session.send("oops") == "ok"
    results = tool_results(model.requests[1].messages)
    assert [r.tool_call_id for r in results] == call_ids(model.requests[1].messages)
    assert results[0].is_error and "no_such_tool" in results[0].content and "count" in results[0].content
    assert (results[1].is_error, results[1].content) == (False, "ran 2")
    assert runs == [{"n": 2}]


async def test_schema_violation_becomes_an_error_and_the_loop_continues() -> None:
    count, runs = counting_tool()
    model = TestModel({"typo": [Reply(tool_calls=[("count", {"n": "seven"})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[count]) as session:
        assert await session.send("typo") == "ok"
    results = tool_results(model.requests[1].messages)
    assert len(results) == 1 and results[0].is_error and "n" in results[0].content
    assert runs == []


async def test_calls_of_a_turn_cut_off_by_the_output_limit_never_run() -> None:
    count, runs = counting_tool()
    model = TestModel(
        {
            "cut": [
                Reply(tool_calls=[("count", {"n": 1}), ("count", {"n": 2})], finish_reason=FinishReason.LENGTH),
                Reply(text="I was cut off"),
            ]
        }
    )
    store = MemoryStore()
    async with open_session(provider=model, tools=[count], journal=store) as session:
        seen = await collect(session, "cut")
        journal = [e.event for e in await store.read(session.journal.stream_id())]
    assert runs == []
    assert not any(isinstance(e, ToolScheduled) for e in journal)
    # The calls are announced and answered with the error (every result follows its use), never run.
    answered = [e for e in seen if isinstance(e, ToolResultEvent)]
    assert len(answered) == 2 and all(not e.result.ok and e.result.error.code == "max_tokens" for e in answered)
    messages = model.requests[1].messages
    results = tool_results(messages)
    assert [r.tool_call_id for r in results] == call_ids(messages)
    assert len(results) == 2 and all(r.is_error and "cut off" in r.content for r in results)
    assert isinstance(seen[-1], DoneEvent) and seen[-1].stop_reason == "end_turn"


class CutMidCallProvider:
    """A provider whose first reply starts a tool call that never ends (the stream stops at the length limit)."""

    name = "cut"

    def __init__(self, model: str = "cut-model") -> None:
        self.model = model
        self.requests: list[ModelRequest] = []

    def with_model(self, model: str) -> CutMidCallProvider:
        return self

    async def chat(self, request: ModelRequest) -> ModelResponse:  # pragma: no cover - the session streams
        raise NotImplementedError

    def stream(self, request: ModelRequest) -> AsyncIterator[Any]:
        return self._stream(request)

    async def _stream(self, request: ModelRequest) -> AsyncIterator[Any]:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        if len(self.requests) == 1:
            yield ToolCallStart(0, "whole-call", "count")
            yield ToolCallDelta(0, '{"n": 1}')
            yield ToolCallEnd(0, "whole-call", "count", '{"n": 1}')
            yield ToolCallStart(1, "half-call", "count")
            yield ToolCallDelta(1, '{"n": ')
            yield FinishChunk(FinishReason.LENGTH)
        else:
            yield TextDelta("recovered")
            yield FinishChunk(FinishReason.STOP)


async def test_a_call_cut_off_mid_stream_still_gets_an_answer() -> None:
    count, runs = counting_tool()
    provider = CutMidCallProvider()
    async with open_session(provider=provider, tools=[count]) as session:
        assert await session.send("go") == "recovered"
    assert runs == []  # a length-cut turn runs none of its calls, complete or not
    messages = provider.requests[1].messages
    ids = call_ids(messages)
    assert len(ids) == 2 and ids[0] == "whole-call"
    results = tool_results(messages)
    assert [r.tool_call_id for r in results] == ids
    assert all(r.is_error for r in results)


async def test_every_tool_result_event_follows_a_tool_use_event() -> None:
    count, _runs = counting_tool()
    model = TestModel({"bad": [Reply(tool_calls=[("count", "{bad"), ("nope", {})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[count]) as session:
        seen = await collect(session, "bad")
    results = [(i, e.call_id) for i, e in enumerate(seen) if isinstance(e, ToolResultEvent)]
    assert len(results) == 2
    for index, call_id in results:
        assert any(isinstance(e, ToolUseEvent) and e.call_id == call_id for e in seen[:index]), call_id


# ---------------------------------------------------------------- property: order and exactly-once answers


@st.composite
def parallel_turns(draw: st.DrawFn) -> tuple[int, list[int], list[bool]]:
    n = draw(st.integers(min_value=1, max_value=8))
    order = draw(st.permutations(list(range(n))))
    failing = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return n, list(order), failing


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=parallel_turns())
async def test_results_in_call_order_and_every_call_answered_once(case: tuple[int, list[int], list[bool]]) -> None:
    n, order, failing = case
    running = 0
    all_running = trio.Event()
    gates = [trio.Event() for _ in range(n + 1)]
    gates[0].set()
    finished: list[int] = []

    @define_tool(name="p", description="p", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def parallel(input: dict[str, Any], ctx: Any) -> str:
        nonlocal running
        index = int(input["i"])
        running += 1
        if running == n:
            all_running.set()
        await all_running.wait()  # every call of the turn runs at the same time ...
        position = order.index(index)
        await gates[position].wait()  # ... and they finish in the drawn order
        finished.append(index)
        gates[position + 1].set()
        if failing[index]:
            raise RuntimeError(f"failure {index}")
        return f"value {index}"

    model = TestModel({"many": [Reply(tool_calls=[("p", {"i": i}) for i in range(n)]), Reply(text="end")]})
    store = MemoryStore()
    with trio.fail_after(30):
        async with open_session(provider=model, tools=[parallel], journal=store) as session:
            seen = await collect(session, "many")
            journal = [e.event for e in await store.read(session.journal.stream_id())]
    assert finished == order
    messages = model.requests[1].messages
    ids = call_ids(messages)
    results = tool_results(messages)
    assert len(ids) == n and len(set(ids)) == n
    assert [r.tool_call_id for r in results] == ids
    for index, result in enumerate(results):
        if failing[index]:
            assert result.is_error and f"failure {index}" in result.content
        else:
            assert (result.is_error, result.content) == (False, f"value {index}")
    published = [e.call_id for e in seen if isinstance(e, ToolResultEvent)]
    assert sorted(published) == sorted(ids)
    settled = [e.call_id for e in journal if isinstance(e, ToolCompleted | ToolFailed)]
    assert sorted(settled) == sorted(ids)
    assert isinstance(seen[-1], DoneEvent) and seen[-1].text == "end"
