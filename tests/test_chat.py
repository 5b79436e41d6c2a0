"""``chat()``: one run of the agent loop without a session (issue 13)."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
import trio
import trio.testing
from cancel_helpers import cancelled_of_its_own

from trio_agent import ConfigError, ModelError, RequestAbortedError, SideEffect, ToolKind, define_tool
from trio_agent._chat._chat import StructuredOutputError, chat
from trio_agent._errors import HistoryError
from trio_agent._groups import unwrap_for_boundary
from trio_agent._lifecycle._middleware import ChatMiddleware, define_chat_middleware
from trio_agent._loop._events import (
    RunError,
    RunFinished,
    RunStarted,
    StepFinished,
    StepStarted,
    TextMessageContent,
    TextMessageEnd,
    TextMessageStart,
    ToolCallEnd,
    ToolCallResult,
    ToolCallStart,
)
from trio_agent._loop._rules import StopReason, combine_strategies, max_iterations, until_finish_reason
from trio_agent._models._history import ORPHAN_ANSWER
from trio_agent.journal import (
    MemoryStore,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    open_journal,
    read_conversation,
)
from trio_agent.lifecycle import MiddlewareDecisionError
from trio_agent.models import ModelAbortedError, ModelService, SystemMessage, ToolResultMessage, Usage, UserMessage
from trio_agent.plugins import MiddlewareConfigError
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object"}


@define_tool(name="add", description="adds", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY)
async def add(input: dict[str, Any], ctx: Any) -> int:
    return int(input.get("a", 0)) + int(input.get("b", 0))


def adder() -> TestModel:
    def respond(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            return Reply(text=f"the sum is {request.messages[-1].content}")
        return Reply(tool_calls=[("add", {"a": 1, "b": 2})])

    return TestModel(respond=respond)


async def test_a_plain_answer_streams_its_events_and_ends_with_a_result() -> None:
    model = TestModel(default=Reply(text="hello there"))
    async with chat(model, "hi") as run:
        events = [event async for event in run]
        result = await run.result()
    kinds = [type(event) for event in events]
    assert kinds[0] is RunStarted and kinds[-1] is RunFinished
    assert kinds.index(StepStarted) < kinds.index(TextMessageStart) < kinds.index(TextMessageEnd)
    assert kinds.index(TextMessageEnd) < kinds.index(StepFinished)
    assert "".join(e.delta for e in events if isinstance(e, TextMessageContent)) == "hello there"
    assert result.text == "hello there"
    assert result.stop_reason is StopReason.END_TURN
    assert result.messages[0] == UserMessage("hi")
    assert all(event.run_id == run.run_id for event in events)


async def test_a_tool_call_runs_and_its_answer_reaches_the_model() -> None:
    async with chat(adder(), "add 1 and 2", tools=[add]) as run:
        events = [event async for event in run]
        result = await run.result()
    assert result.text == "the sum is 3"
    assert result.turns == 2
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    results = [e for e in events if isinstance(e, ToolCallResult)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [e.tool_name for e in starts] == ["add"] and results[0].result.output == 3
    assert ends[0].input == {"a": 1, "b": 2}


async def test_the_default_strategy_stops_after_five_iterations() -> None:
    model = TestModel(default=Reply(tool_calls=[("add", {"a": 1})]))
    async with chat(model, "loop", tools=[add]) as run:
        result = await run.result()
    assert result.turns == 5
    assert result.stop_reason is StopReason.MAX_TURNS


async def test_a_strategy_until_a_finish_reason() -> None:
    model = TestModel(default=Reply(tool_calls=[("add", {"a": 1})]))
    async with chat(model, "loop", tools=[add], strategy=until_finish_reason("tool_calls")) as run:
        result = await run.result()
    assert result.turns == 1


async def test_structured_output_is_validated_against_the_schema() -> None:
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}

    def respond(request: Any) -> Reply:
        if "output_schema" in request.options:
            return Reply(text=json.dumps({"sum": 3}))
        return Reply(text="three")

    async with chat(TestModel(respond=respond), "sum?", output_schema=schema) as run:
        result = await run.result()
    assert result.structured_output == {"sum": 3}

    bad = TestModel(respond=lambda request: Reply(text='{"sum": "three"}'))
    async with chat(bad, "sum?", output_schema=schema) as run:
        with pytest.raises(StructuredOutputError) as caught:
            await run.result()
    assert caught.value.issues and "sum" in caught.value.issues[0]


ONLY_Y: dict[str, Any] = {"type": "array", "items": {"type": "string", "pattern": "^y$"}}


async def structured_error(answer: str, schema: dict[str, Any]) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as caught:
        await chat(TestModel(default=[Reply(text="hello"), Reply(text=answer)]), "hi", output_schema=schema)
    return caught.value


async def test_a_structured_answer_failing_many_ways_lists_its_first_20_issues_and_counts_the_rest() -> None:
    """Every issue was listed, and joined into the message: 200,000 for a 1 MB answer."""
    error = await structured_error(json.dumps(["x"] * 50), ONLY_Y)
    assert error.issues[:2] == ('at 0: "x" does not match "^y$"', 'at 1: "x" does not match "^y$"')
    assert len(error.issues) == 21 and error.issues[-1] == "... and 30 more"
    assert str(error).endswith('at 19: "x" does not match "^y$"; ... and 30 more')


async def test_a_structured_answer_issue_is_cut_to_a_bounded_length() -> None:
    """An issue quotes the value: a long string failing a schema was quoted in full."""
    error = await structured_error(json.dumps("x" * 3000), {"type": "integer"})
    (issue,) = error.issues
    assert issue.startswith('at <root>: "xxx') and issue.endswith("... (3038 characters)")
    assert len(issue) < 350 and len(str(error)) < 450


async def test_lone_surrogates_in_a_structured_answer_are_listed_as_other_issues_are() -> None:
    error = await structured_error(json.dumps([f"x{chr(0xD800)}{'y' * 400}"] * 30), ONLY_Y)
    assert len(error.issues) == 21 and error.issues[-1] == "... and 10 more"
    assert error.issues[0].startswith("at 0: string 'x\\ud800yyy") and len(error.issues[0]) < 350


async def test_a_long_structured_answer_names_its_first_issue_only() -> None:
    """jsonschema_rs builds every error before the first is read: 200,000 of them for a 1 MB answer
    failing on every item took seconds of the event loop (and a 7 MB message). A long answer is
    reported by its first issue (validate() stops there)."""
    answer = json.dumps(["x"] * 20_000)  # 100,000 characters
    error = await structured_error(answer, ONLY_Y)
    assert error.issues == (
        'at 0: "x" does not match "^y$"',
        "... and maybe more: only the first is looked for in an answer over 4096 characters",
    )
    assert len(str(error)) < 250 and error.text == answer
    # One that passes is accepted whatever its length.
    result = await chat(
        TestModel(default=[Reply(text="hello"), Reply(text=json.dumps(["y"] * 20_000))]), "hi", output_schema=ONLY_Y
    )
    assert result.structured_output == ["y"] * 20_000


@pytest.mark.parametrize(("items", "threaded"), [(100, False), (5000, True)])
async def test_a_long_structured_answer_is_checked_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch, items: int, threaded: bool
) -> None:
    """Reading a long answer is Python (its depth, its numbers: about 0.35 s a megabyte), and it
    ran on the event loop: every other task of the process stood still meanwhile."""
    import threading

    import trio_agent._chat._chat as chat_module

    checked = chat_module._checked_answer
    where: list[bool] = []

    def spy(response: Any, validator: Any) -> Any:
        where.append(threading.current_thread() is not threading.main_thread())
        return checked(response, validator)

    monkeypatch.setattr(chat_module, "_checked_answer", spy)
    answer = json.dumps(["y"] * items)  # 500 or 25,000 characters
    result = await chat(TestModel(default=[Reply(text="hello"), Reply(text=answer)]), "hi", output_schema=ONLY_Y)
    assert result.structured_output == ["y"] * items and where == [threaded]


class ChatOnly:
    """Model middleware with only ``wrap_chat``: a chat() run streams its turns, so it runs only for
    output_schema's structured-output call."""

    def __init__(self) -> None:
        self.calls = 0

    async def wrap_chat(self, request: Any, call_next: Any) -> Any:
        self.calls += 1
        return await call_next(request)


async def test_model_middleware_that_would_never_run_is_refused_before_the_run() -> None:
    model = TestModel(respond=lambda request: Reply(text="3" if "output_schema" in request.options else "three"))
    with pytest.raises(MiddlewareConfigError, match=r"chat\(\) model middleware #0 \(ChatOnly\).*not wrap_stream"):
        await chat(model, "sum?", model_middleware=[ChatOnly()])
    assert model.requests == []  # refused before any model call
    # With output_schema its wrap_chat runs for the structured-output call: accepted, and it runs.
    layer = ChatOnly()
    result = await chat(model, "sum?", model_middleware=[layer], output_schema={"type": "integer"})
    assert (result.structured_output, layer.calls) == (3, 1)


class StructuredLog(ChatMiddleware):
    """Logs the hooks around the structured-output call."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def on_config(self, ctx: Any, config: Any) -> None:
        self.log.append(f"on_config:{ctx.phase.value}")

    def on_structured_output_config(self, ctx: Any, config: Any) -> None:
        self.log.append("on_structured_output_config")

    def on_usage(self, ctx: Any, usage: Usage) -> None:
        self.log.append(f"on_usage:{usage.total_tokens}")

    def on_finish(self, ctx: Any, info: Any) -> None:
        self.log.append("on_finish")

    def on_abort(self, ctx: Any, info: Any) -> None:
        self.log.append("on_abort")

    def on_error(self, ctx: Any, info: Any) -> None:
        self.log.append(f"on_error:{type(info.error).__name__}")

    def on_start(self, ctx: Any) -> None:
        ctx.defer(lambda: self.log.append("deferred"))


async def test_the_structured_output_call_is_the_runs_last_step_before_its_terminal_hook() -> None:
    replies = [
        Reply(text="hello", usage=Usage(input_tokens=1, output_tokens=1, total_tokens=2)),
        Reply(text='{"a": 1}', usage=Usage(input_tokens=100, output_tokens=100, total_tokens=200)),
    ]
    spy = StructuredLog()
    async with chat(TestModel(default=replies), "hi", middleware=[spy], output_schema=OBJECT) as run:
        events = [event async for event in run]
        result = await run.result()
    assert spy.log == [
        "on_config:init",
        "on_config:before_model",
        "on_usage:2",
        "on_structured_output_config",
        "on_config:structured_output",
        "on_usage:200",
        "on_finish",
        "deferred",
    ]
    assert [type(event).__name__ for event in events[-3:]] == ["StepFinished", "UsageReported", "RunFinished"]
    assert result.structured_output == {"a": 1}
    assert result.usage.total_tokens == 202  # both calls


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (Reply(text="not json"), StructuredOutputError),
        (Reply(text="[" * 100_000 + "]" * 100_000), StructuredOutputError),  # never a RecursionError
        (Reply(text="NaN"), StructuredOutputError),
        (Reply(error=ModelError("overloaded", retryable=False)), ModelError),
    ],
    ids=["not-json", "deeply-nested", "nan", "model-error"],
)
async def test_a_failing_structured_output_call_fails_the_run_with_run_error_and_on_error(
    answer: Reply, error: type[Exception]
) -> None:
    spy = StructuredLog()
    model = TestModel(default=[Reply(text="hello"), answer])
    async with chat(model, "hi", middleware=[spy], output_schema={"type": "number"}) as run:
        events = [event async for event in run]
        with pytest.raises(error):
            await run.result()
    assert spy.log[-2:] == [f"on_error:{error.__name__}", "deferred"]
    assert "on_finish" not in spy.log
    assert isinstance(events[-1], RunError)
    assert not any(isinstance(event, RunFinished) for event in events)


async def test_an_abort_during_the_structured_output_call_ends_the_run_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    spy = StructuredLog()
    model = TestModel(default=[Reply(text="hello"), Reply(text='{"a": 1}', latency=60)])
    async with chat(model, "hi", middleware=[spy], output_schema=OBJECT) as run:
        async for event in run:
            if isinstance(event, StepFinished):
                break
        await trio.testing.wait_all_tasks_blocked()  # the structured-output call waits for its answer
        started = trio.current_time()
        run.abort("stop now")
        result = await run.result()
    assert trio.current_time() - started < 1  # the call took the abort: it did not wait out its answer
    assert result.stop_reason is StopReason.ABORTED and result.structured_output is None
    assert spy.log[-2:] == ["on_abort", "deferred"]


async def test_structured_output_is_checked_against_the_schema_a_hook_sent() -> None:
    sent: list[Any] = []

    def respond(request: Any) -> Reply:
        sent.append(request.options.get("output_schema"))
        return Reply(text="hello") if len(sent) == 1 else Reply(text='{"items": [1, 2]}')

    def wrap(ctx: Any, config: Any) -> Any:
        items = config["output_schema"]
        return {"output_schema": {"type": "object", "properties": {"items": items}, "required": ["items"]}}

    middleware = [define_chat_middleware(on_structured_output_config=wrap)]
    result = await chat(TestModel(respond=respond), "hi", output_schema={"type": "array"}, middleware=middleware)
    assert sent[-1]["required"] == ["items"]
    assert result.structured_output == {"items": [1, 2]}


@pytest.mark.parametrize(
    "change",
    [
        {"output_schema": {"type": 5}},
        {"output_schema": True},
        {"messages": 5},
        {"messages": [UserMessage("hi"), {"role": "user", "content": "be brief"}]},
        {"options": None},
    ],
    ids=["invalid-schema", "schema-not-an-object", "messages", "an-item-not-a-message", "options"],
)
async def test_an_on_structured_output_config_value_its_key_cannot_hold_is_a_decision_error(
    change: dict[str, Any],
) -> None:
    model = TestModel(default=[Reply(text="hello"), Reply(text="[1]")])
    middleware = [define_chat_middleware(name="bad", on_structured_output_config=lambda ctx, config: change)]
    with pytest.raises(MiddlewareDecisionError, match="on_structured_output_config of middleware 'bad'"):
        await chat(model, "hi", output_schema={"type": "array"}, middleware=middleware)
    assert len(model.requests) == 1  # the structured-output call was never sent


NUMBER_N: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def answering(answer: str) -> TestModel:
    return TestModel(default=[Reply(text="thinking"), Reply(text=answer)])


async def test_a_schema_a_hook_edits_in_place_is_the_one_sent_and_checked_and_the_callers_stays_as_it_was() -> None:
    def to_string(ctx: Any, config: Any) -> None:
        config["output_schema"]["properties"]["n"]["type"] = "string"  # nested, in place, nothing returned

    schema = json.loads(json.dumps(NUMBER_N))
    model = answering('{"n": "three"}')
    middleware = [define_chat_middleware(name="edit", on_structured_output_config=to_string)]
    result = await chat(model, "hi", output_schema=schema, middleware=middleware)
    assert model.requests[-1].options["output_schema"]["properties"]["n"] == {"type": "string"}
    assert result.structured_output == {"n": "three"}  # checked against what was sent
    assert schema == NUMBER_N  # the caller's dict is its own
    assert (await chat(answering('{"n": 3}'), "hi", output_schema=schema)).structured_output == {"n": 3}


async def test_a_schema_the_caller_changes_while_the_run_runs_changes_nothing_of_it() -> None:
    schema = json.loads(json.dumps(NUMBER_N))

    @define_tool(name="meddle", description="edits", input_schema=OBJECT, side_effect=SideEffect.PURE)
    async def meddle(input: dict[str, Any], ctx: Any) -> str:
        schema["properties"]["n"]["type"] = "string"
        return "done"

    model = TestModel(default=[Reply(tool_calls=[("meddle", {})]), Reply(text="ok"), Reply(text='{"n": 3}')])
    result = await chat(model, "hi", tools=[meddle], output_schema=schema)
    assert model.requests[-1].options["output_schema"] == NUMBER_N
    assert NUMBER_N["properties"]["n"] == {"type": "integer"} and result.structured_output == {"n": 3}


async def test_a_schema_a_hook_changes_only_as_json_tells_apart_is_a_change() -> None:
    # 1 == True in Python, not in a schema: the answer is checked against the schema sent.
    middleware = [define_chat_middleware(on_structured_output_config=lambda ctx, c: {"output_schema": {"const": True}})]
    result = await chat(answering("true"), "hi", output_schema={"const": 1}, middleware=middleware)
    assert result.structured_output is True


def edit_in_place(ctx: Any, config: Any) -> None:
    config["output_schema"]["type"] = 5


def edit_and_hand_back(ctx: Any, config: Any) -> Any:
    config["output_schema"]["type"] = 5
    return {"output_schema": config["output_schema"]}


def put_nan(ctx: Any, config: Any) -> None:
    config["output_schema"]["properties"]["n"]["const"] = float("nan")


def put_unserializable(ctx: Any, config: Any) -> None:
    config["output_schema"]["description"] = object()


@pytest.mark.parametrize(
    ("hook", "problem"),
    [
        (edit_in_place, "left output_schema edited in place, which is not valid JSON Schema"),
        (edit_and_hand_back, "set output_schema, which is not valid JSON Schema"),
        (put_nan, "which is not JSON: at /properties/n/const: nan, not a finite number"),
        (put_unserializable, "which is not JSON: at /description: a value of type object"),
        (lambda ctx, c: {"output_schema": {"maximum": float("inf")}}, "at /maximum: inf, not a finite number"),
        (lambda ctx, c: {"output_schema": {"enum": {1, 2}}}, "at /enum: a value of type set"),
    ],
    ids=["in-place", "in-place-handed-back", "nan-in-place", "object-in-place", "infinity", "set"],
)
async def test_every_bad_schema_a_hook_leaves_is_a_decision_error_before_the_call(hook: Any, problem: str) -> None:
    model = answering('{"n": 3}')
    middleware = [define_chat_middleware(name="bad", on_structured_output_config=hook)]
    with pytest.raises(MiddlewareDecisionError, match="on_structured_output_config of middleware 'bad'") as caught:
        await chat(model, "hi", output_schema=json.loads(json.dumps(NUMBER_N)), middleware=middleware)
    assert problem in str(caught.value)
    assert len(model.requests) == 1  # the structured-output call was never sent


async def test_a_schema_given_as_any_mapping_is_sent_and_checked_as_plain_json() -> None:
    proxy = types.MappingProxyType
    given = proxy({"type": "object", "properties": proxy({"n": proxy({"enum": (1, 2)})}), "required": ("n",)})
    model = answering('{"n": 2}')
    swap = define_chat_middleware(on_structured_output_config=lambda ctx, c: {"output_schema": proxy(dict(given))})
    result = await chat(model, "hi", output_schema=given, middleware=[swap])
    sent = model.requests[-1].options["output_schema"]
    assert sent == {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    assert type(sent) is dict and type(sent["properties"]["n"]["enum"]) is list
    assert result.structured_output == {"n": 2}


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"properties": {"n": {"const": float("nan")}}}, "at /properties/n/const: nan, not a finite number"),
        ({"maximum": float("inf")}, "at /maximum: inf, not a finite number"),
        ({"minimum": float("-inf")}, "at /minimum: -inf, not a finite number"),
        ({"properties": {1: {}}}, "at /properties: a key that is not a string: 1"),
        ({"enum": [b"x"]}, "at /enum/0: a value of type bytes"),
        ({"a/b": {"~": [object()]}}, "at /a~1b/~0/0: a value of type object"),
    ],
    ids=["nan", "infinity", "minus-infinity", "int-key", "bytes", "pointer-escapes"],
)
@pytest.mark.parametrize("form", ["await", "block"])
async def test_a_schema_that_is_not_json_is_config_error_before_anything_runs(
    schema: dict[Any, Any], problem: str, form: str
) -> None:
    spy = StructuredLog()
    model = answering("{}")
    with pytest.raises(ConfigError, match=r"^output_schema: not JSON: ") as caught:
        if form == "await":
            await chat(model, "hi", middleware=[spy], output_schema=schema)
        else:
            async with chat(model, "hi", middleware=[spy], output_schema=schema):
                raise AssertionError("the block is never entered")
    assert problem in str(caught.value)
    assert spy.log == [] and model.requests == []


async def test_a_schema_nested_too_deep_or_holding_itself_is_config_error_naming_both_ends_of_the_path() -> None:
    itself: dict[str, Any] = {"type": "object", "properties": {}}
    itself["properties"]["self"] = itself
    with pytest.raises(ConfigError, match=r"at /properties/self/properties/self/\.\.\. 192 more \.\.\./") as caught:
        await chat(answering("{}"), "hi", output_schema=itself)
    assert str(caught.value).endswith("containers nested deeper than 200 levels")


async def test_an_on_structured_output_config_that_hands_back_what_it_got_changes_nothing() -> None:
    # The messages are the history's view (no list): handed back as they are, they need no check.
    model = TestModel(default=[Reply(text="hello"), Reply(text="[1]")])
    middleware = [define_chat_middleware(name="same", on_structured_output_config=lambda ctx, config: dict(config))]
    result = await chat(model, "hi", output_schema={"type": "array"}, middleware=middleware)
    assert result.structured_output == [1]
    sent = model.requests[-1].messages  # the history as it was, then the request for the answer
    assert [type(message).__name__ for message in sent] == ["UserMessage", "AssistantMessage", "UserMessage"]


async def test_leaving_the_block_early_aborts_the_run_and_keeps_committed_results(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = TestModel({"go": [Reply(tool_calls=[("add", {"a": 2})]), Reply(text="late")]})
    async with chat(model, "go", tools=[add]) as run:
        async for event in run:
            if isinstance(event, ToolCallResult):
                break
    result = await run.result()
    assert result.stop_reason in (StopReason.ABORTED, StopReason.END_TURN)
    answers = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert answers and answers[0].content == "2"


class StuckOnAbort(ChatMiddleware):
    async def on_abort(self, ctx: Any, info: Any) -> None:
        await trio.sleep_forever()  # a clean-up that never ends


async def test_leaving_the_block_early_waits_for_the_run_at_most_cleanup_grace(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # The answer takes a while: the block is left while the run still waits for it.
    model = TestModel({"go": [Reply(tool_calls=[("add", {"a": 2})]), Reply(text="late", latency=60)]})
    async with chat(model, "go", tools=[add], middleware=[StuckOnAbort()], cleanup_grace=3) as run:
        async for event in run:
            if isinstance(event, ToolCallResult):
                left = trio.current_time()
                break
    assert trio.current_time() - left == pytest.approx(3)  # the bound, not forever
    assert any("ending a chat run whose block was left early" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("grace", [1.5, 30.0])
async def test_a_chat_run_s_cleanup_grace_bounds_its_tools_cleanup_scope(
    autojump_clock: trio.testing.MockClock, grace: float
) -> None:
    # As a session's: the run's one bound for clean-up reaches its tools (they had the pipeline's 5 s).
    bounds: list[float] = []

    @define_tool(name="tidy", description="tidies", input_schema=OBJECT, side_effect=SideEffect.PURE)
    async def tidy(input: dict[str, Any], ctx: Any) -> str:
        with ctx.cleanup_scope() as scope:
            bounds.append(scope.deadline - trio.current_time())
        return "ok"

    model = TestModel(default=[Reply(tool_calls=[("tidy", {})]), Reply(text="done")])
    result = await chat(model, "go", tools=[tidy], cleanup_grace=grace)
    assert result.text == "done" and bounds == [grace]


async def test_a_durable_chat_run_is_recorded_as_a_request() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id="c1") as journal:
        async with chat(adder(), "add", tools=[add], journal=journal) as run:
            result = await run.result()
        events = [e.event for e in await store.read(journal.stream_id())]
    assert result.text == "the sum is 3"
    assert any(isinstance(e, RequestStarted) for e in events)
    assert isinstance(events[-1], RequestCompleted)


async def test_a_journal_of_chat_runs_given_their_whole_history_reads_back_as_the_last_run_saw_it() -> None:
    # Each run's given messages were appended to the ones before: the history read back held the
    # first run twice, and (since stored conversations are checked) read as corrupt.
    store = MemoryStore()
    async with open_journal(store, session_id="c1") as journal:
        first = await chat(adder(), "add", tools=[add], journal=journal)
        second = await chat(adder(), [*first.messages, UserMessage("again")], tools=[add], journal=journal)
        assert journal.conversation() == list(second.messages)
    assert await read_conversation(store, "c1") == list(second.messages)


async def journal_events(store: MemoryStore, journal: Any) -> list[Any]:
    return [e.event for e in await store.read(journal.stream_id())]


@pytest.mark.parametrize("form", ["await", "block"])
async def test_a_durable_chat_run_cancelled_from_outside_is_recorded_interrupted(
    form: str, autojump_clock: trio.testing.MockClock
) -> None:
    store = MemoryStore()
    async with open_journal(store, session_id="c1") as journal:
        with trio.move_on_after(5) as scope:
            slow = TestModel(default=Reply(text="late", latency=60))
            if form == "await":
                await chat(slow, "hi", journal=journal)
            else:
                async with chat(slow, "hi", journal=journal) as run:
                    await run.result()
        assert scope.cancelled_caught
        events = await journal_events(store, journal)
        assert isinstance(events[-1], RequestInterrupted)
        assert events[-1].reason is RequestInterruptReason.USER_ABORT
        # The journal takes the next run.
        result = await chat(TestModel(default=Reply(text="ok")), "again", journal=journal)
        assert result.text == "ok" and isinstance((await journal_events(store, journal))[-1], RequestCompleted)


async def test_a_durable_chat_run_left_while_a_tool_outlasts_cleanup_grace_is_recorded_interrupted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    @define_tool(name="slow", description="slow", input_schema=OBJECT, side_effect=SideEffect.PURE,
                 kind=ToolKind.READONLY)  # fmt: skip
    async def slow(input: dict[str, Any], ctx: Any) -> str:
        await trio.sleep(60)
        return "done"

    store = MemoryStore()
    model = TestModel(default=[Reply(tool_calls=[("slow", {})]), Reply(text="ok")])
    async with open_journal(store, session_id="c1") as journal:
        async with chat(model, "go", tools=[slow], journal=journal, cleanup_grace=1) as run:
            async for event in run:
                if isinstance(event, ToolCallEnd):
                    break
        events = await journal_events(store, journal)
        assert isinstance(events[-1], RequestInterrupted)
        result = await chat(TestModel(default=Reply(text="ok")), "again", journal=journal)
        assert result.text == "ok"


async def test_a_durable_chat_run_aborted_during_a_tool_is_recorded_interrupted() -> None:
    release = trio.Event()

    @define_tool(name="held", description="held", input_schema=OBJECT, side_effect=SideEffect.PURE,
                 kind=ToolKind.READONLY)  # fmt: skip
    async def held(input: dict[str, Any], ctx: Any) -> str:
        await release.wait()
        return "done"

    store = MemoryStore()
    model = TestModel(default=[Reply(tool_calls=[("held", {})]), Reply(text="never")])
    async with open_journal(store, session_id="c1") as journal:
        async with chat(model, "go", tools=[held], journal=journal) as run:
            async for event in run:
                if isinstance(event, ToolCallEnd):
                    run.abort("stop")  # the tool finishes (it blocks aborts); the run ends aborted
                    release.set()
            result = await run.result()
        assert result.stop_reason is StopReason.ABORTED
        assert isinstance((await journal_events(store, journal))[-1], RequestInterrupted)
        assert (await chat(TestModel(default=Reply(text="ok")), "again", journal=journal)).text == "ok"


async def test_a_durable_chat_run_failing_mid_turn_is_recorded_failed_and_the_journal_goes_on() -> None:
    def breaks_on_text(ctx: Any, event: Any) -> None:
        if isinstance(event, TextMessageContent):
            raise ValueError("a hook broke")

    store = MemoryStore()
    async with open_journal(store, session_id="c1") as journal:
        with pytest.raises(ValueError):
            await chat(
                TestModel(default=Reply(text="a b c")),
                "hi",
                journal=journal,
                middleware=[define_chat_middleware(on_chunk=breaks_on_text)],
            )
        assert isinstance((await journal_events(store, journal))[-1], RequestFailed)
        result = await chat(TestModel(default=Reply(text="ok")), "again", journal=journal)
        assert result.text == "ok"


class Counting(ChatMiddleware):
    """Counts per run in ctx.state: shared by many runs, it must never mix them up."""

    def on_start(self, ctx: Any) -> None:
        ctx.state["chunks"] = 0

    def on_chunk(self, ctx: Any, event: Any) -> None:
        ctx.state["chunks"] += 1

    def on_finish(self, ctx: Any, info: Any) -> None:
        ctx.state["finished"] = True
        seen.append((ctx.run_id, ctx.state["chunks"]))


seen: list[tuple[str, int]] = []


async def test_one_middleware_list_shared_by_a_thousand_concurrent_runs() -> None:
    seen.clear()
    middleware = [Counting()]
    counts: dict[str, int] = {}

    async def one(index: int) -> None:
        model = TestModel(default=Reply(text=" ".join(["w"] * (index % 7 + 1))))
        async with chat(model, f"hi {index}", middleware=middleware) as run:
            events = [event async for event in run]
            counts[run.run_id] = len(events)
            await run.result()

    async with trio.open_nursery() as nursery:
        for index in range(1000):
            nursery.start_soon(one, index)
    assert len(seen) == 1000
    # Each run counted its own events only: every event of its stream, and no other run's.
    assert all(count == counts[run_id] for run_id, count in seen)


async def test_bad_input_is_refused_before_anything_runs() -> None:
    from trio_agent import ConfigError
    from trio_agent.middleware import MiddlewareShapeError

    with pytest.raises(ConfigError):
        async with chat(TestModel(), ""):
            pass
    with pytest.raises(MiddlewareShapeError):
        async with chat(TestModel(), "hi", middleware=[object()]):  # type: ignore[list-item]
            pass
    with pytest.raises(ConfigError, match="output_schema"):
        async with chat(TestModel(), "hi", output_schema={"type": 7}):
            pass


# -- ``await chat(...)``: the run in the caller's task, the result only -------------------------------------


async def test_awaiting_chat_runs_in_the_callers_task_and_returns_what_the_block_form_returns() -> None:
    tasks: list[object] = []

    @define_tool(name="where", description="where it runs", input_schema=OBJECT, side_effect=SideEffect.PURE)
    async def where(input: dict[str, Any], ctx: Any) -> str:
        tasks.append(trio.lowlevel.current_task())
        return "here"

    def respond(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            return Reply(text="done", usage=Usage(input_tokens=5, output_tokens=2, total_tokens=7))
        return Reply(tool_calls=[("where", {})], usage=Usage(input_tokens=3, output_tokens=1, total_tokens=4))

    awaited = await chat(TestModel(respond=respond), "go", tools=[where])
    async with chat(TestModel(respond=respond), "go", tools=[where]) as run:
        streamed = await run.result()
    assert tasks[0] is trio.lowlevel.current_task()  # no task of its own
    assert tasks[1] is not trio.lowlevel.current_task()  # the block form runs beside the block
    assert (awaited.text, awaited.turns, awaited.stop_reason) == (streamed.text, streamed.turns, streamed.stop_reason)
    assert [type(m) for m in awaited.messages] == [type(m) for m in streamed.messages]  # call ids differ
    # The usage is what the model calls reported, whether or not anybody read the events.
    assert awaited.usage == streamed.usage == Usage(input_tokens=8, output_tokens=3, total_tokens=11)


async def test_awaiting_chat_raises_the_runs_error_and_refuses_bad_input() -> None:
    from trio_agent import ConfigError, ModelError

    with pytest.raises(ConfigError):
        await chat(TestModel(), "")
    failing = TestModel(default=Reply(error=ModelError("down", code="server_error", retryable=False)))
    with pytest.raises(ModelError, match="down"):
        await chat(failing, "hi")


async def test_chat_middleware_still_sees_every_event_of_an_awaited_run() -> None:
    seen.clear()
    result = await chat(TestModel(default=Reply(text="a b c")), "hi", middleware=[Counting()])
    async with chat(TestModel(default=Reply(text="a b c")), "hi") as run:
        streamed = [event async for event in run]
    assert result.text == "a b c"
    assert seen and seen[0][1] == len(streamed)  # on_chunk saw the events the stream would have carried


async def test_cancelling_the_caller_of_an_awaited_chat_cancels_its_run(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel(default=Reply(text="late", latency=60))
    with trio.move_on_after(5) as scope:
        await chat(model, "hi")
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(5)


async def test_a_chat_call_is_entered_or_awaited_once() -> None:
    model = TestModel(default=Reply(text="hi"))
    call = chat(model, "hi")
    async with call as run:
        await run.result()
    with pytest.raises(RuntimeError, match="once"):
        async with call:
            pass
    awaited = chat(model, "hi")
    await awaited
    with pytest.raises(RuntimeError, match="once"):
        await awaited
    with pytest.raises(RuntimeError, match="once"):
        async with awaited:
            pass
    assert len(model.requests) == 2  # one model call per run, never a second run of a call


@pytest.mark.parametrize(
    "bad",
    [
        {"strategy": 5},
        {"tools": [object()]},
        {"tools": add},  # one tool, not a list
        {"output_schema": True},
        {"output_schema": "x"},
        {"metadata": [1]},
        {"instructions": 5},
    ],
    ids=lambda bad: "-".join(f"{key}={type(value).__name__}" for key, value in bad.items()),
)
@pytest.mark.parametrize("form", ["await", "block"])
async def test_bad_arguments_raise_config_error_before_anything_runs(bad: dict[str, Any], form: str) -> None:
    spy = StructuredLog()
    model = TestModel(default=Reply(text="hi"))
    with pytest.raises(ConfigError):
        if form == "await":
            await chat(model, "hi", middleware=[spy], **bad)
        else:
            async with chat(model, "hi", middleware=[spy], **bad):
                raise AssertionError("the block is never entered")
    assert spy.log == [] and model.requests == []


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"tool_middleware": 5}, "chat(tool_middleware=...) must be a list or tuple of tool middleware, got 5"),
        ({"tool_middleware": "ab"}, "chat(tool_middleware=...) must be a list or tuple of tool middleware, got 'ab'"),
        ({"tool_middleware": [5]}, "chat(tool_middleware=...): tool middleware #0 is not callable: got 5"),
        ({"model_middleware": 5}, "chat(model_middleware=...) must be a list or tuple of model middleware, got 5"),
        (
            {"model_middleware": b"x"},
            "chat(model_middleware=...) must be a list or tuple of model middleware, got b'x'",
        ),
        ({"model_middleware": [5]}, "chat(model_middleware=...): model middleware #0 (int) defines none of"),
    ],
    ids=["tool-int", "tool-str", "tool-item", "model-int", "model-bytes", "model-item"],
)
@pytest.mark.parametrize("form", ["await", "block"])
async def test_junk_tool_or_model_middleware_is_a_config_error_naming_the_parameter(
    bad: dict[str, Any], message: str, form: str
) -> None:
    from trio_agent.middleware import MiddlewareShapeError

    model = TestModel(default=Reply(text="hi"))
    with pytest.raises(MiddlewareConfigError) as caught:
        if form == "await":
            await chat(model, "hi", **bad)
        else:
            async with chat(model, "hi", **bad):
                raise AssertionError("the block is never entered")
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, MiddlewareShapeError)
    assert str(caught.value).startswith(message)
    assert model.requests == []


@define_tool(name="stray", description="raises its own Cancelled", input_schema=OBJECT, side_effect=SideEffect.PURE)
async def stray(input: dict[str, Any], ctx: Any) -> str:
    raise await cancelled_of_its_own()


@define_tool(name="ok", description="answers", input_schema=OBJECT, side_effect=SideEffect.PURE)
async def ok(input: dict[str, Any], ctx: Any) -> str:
    await trio.testing.wait_all_tasks_blocked()  # still running while its sibling fails
    return "ok"


@pytest.mark.parametrize("calls", [[("stray", {}), ("ok", {})], [("stray", {})]])
async def test_a_cancelled_a_tool_raises_of_its_own_is_its_error_and_its_siblings_go_on(
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    model = TestModel(script={"go": [Reply(tool_calls=calls), Reply(text="done")]})
    try:
        result = await chat(model, "go", tools=[stray, ok])
    except trio.Cancelled:  # a Cancelled out of a test would end it silently, as passed
        pytest.fail("the tool's own Cancelled left chat() as a cancellation")
    assert result.text == "done"
    answers = [m for m in model.requests[-1].messages if isinstance(m, ToolResultMessage)]
    assert [(m.is_error, "not cancelled" in m.content) for m in answers[:1]] == [(True, True)]
    assert [(m.is_error, m.content) for m in answers[1:]] == [(False, "ok")] * (len(calls) - 1)


async def test_every_call_of_a_turn_is_answered_when_a_call_ends_without_a_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tools port whose execute lets a stray Cancelled out ends its call's task without a result,
    # and the turn's nursery cancels the sibling (and takes the Cancelled): the next request still
    # answers both calls. (The pipeline itself never does: every layer's stray Cancelled is that
    # layer's failure, see the next test.)
    from trio_agent._tools._pipeline import ToolPipeline

    original = ToolPipeline.execute

    async def execute(self: Any, call: Any, *args: Any, **kwargs: Any) -> Any:
        if call.name == "stray":
            raise await cancelled_of_its_own()
        return await original(self, call, *args, **kwargs)

    monkeypatch.setattr(ToolPipeline, "execute", execute)
    calls: list[tuple[str, dict[str, Any]]] = [("stray", {}), ("ok", {})]
    model = TestModel(script={"go": [Reply(tool_calls=calls), Reply(text="done")]})
    result = await chat(model, "go", tools=[stray, ok])
    assert result.text == "done"
    answers = [m for m in model.requests[-1].messages if isinstance(m, ToolResultMessage)]
    assert len(answers) == 2
    assert all(m.is_error for m in answers)
    assert answers[0].content == ORPHAN_ANSWER


async def test_a_cancelled_a_tool_middleware_raises_of_its_own_is_its_calls_error() -> None:
    # Its stray Cancelled unwound the turn as a cancellation nobody made (or, alone, left chat() as
    # a bare Cancelled): it is the middleware's failure, its call's error; the sibling goes on.
    async def stray_middleware(request: Any, call_next: Any) -> Any:
        if request.tool_name == "stray":
            raise await cancelled_of_its_own()
        return await call_next()

    calls: list[tuple[str, dict[str, Any]]] = [("stray", {}), ("ok", {})]
    model = TestModel(script={"go": [Reply(tool_calls=calls), Reply(text="done")]})
    try:
        result = await chat(model, "go", tools=[stray, ok], tool_middleware=[stray_middleware])
    except trio.Cancelled:  # a Cancelled out of a test would end it silently, as passed
        pytest.fail("the middleware's own Cancelled left chat() as a cancellation")
    assert result.text == "done"
    answers = [m for m in model.requests[-1].messages if isinstance(m, ToolResultMessage)]
    assert [(m.is_error, m.content) for m in answers[1:]] == [(False, "ok")]
    assert answers[0].is_error and answers[0].content.startswith("Error: Tool middleware failed: Cancelled(")
    assert "nothing around it was cancelled" in answers[0].content


# -- the block's boundary: one exception out, as a Trio nursery and the awaited form give it -------------


@define_tool(name="slow", description="slow", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY)
async def slow_tool(input: dict[str, Any], ctx: Any) -> str:
    await trio.sleep(60)
    return "done"


async def test_the_blocks_own_error_goes_on_beside_a_cancellation_from_outside(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The scope around the block cancels the run as the body raises (no checkpoint between): the
    # run's Cancelled belongs to that scope, the body's ValueError must go on (it was swallowed).
    model = TestModel(default=[Reply(tool_calls=[("slow", {})]), Reply(text="done")])
    with pytest.raises(ValueError, match="the body's own") as raised, trio.CancelScope() as scope:
        async with chat(model, "go", tools=[slow_tool]) as run:
            async for event in run:
                if isinstance(event, ToolCallEnd):
                    scope.cancel()
                    raise ValueError("the body's own error") from KeyError("its cause")
    assert isinstance(raised.value.__cause__, KeyError)  # raised as it was, its cause kept


class Fanout(ChatMiddleware):
    """A hook that runs two checks side by side, both failing: the run fails with their group."""

    async def on_start(self, ctx: Any) -> None:
        async def check(n: int) -> None:
            raise LookupError(f"check {n} failed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(check, 1)
            nursery.start_soon(check, 2)


async def test_a_runs_exception_group_is_raised_alike_by_both_forms() -> None:
    with pytest.raises(ExceptionGroup) as awaited:
        await chat(TestModel(default=Reply(text="x")), "hi", middleware=[Fanout()])
    with pytest.raises(ExceptionGroup) as streamed:
        async with chat(TestModel(default=Reply(text="x")), "hi", middleware=[Fanout()]) as run:
            await run.result()
    # The run's group itself, never wrapped in one more nursery group by the block.
    for caught in (awaited, streamed):
        assert sorted(map(str, caught.value.exceptions)) == ["check 1 failed", "check 2 failed"]


async def test_unwrap_for_boundary_keeps_the_errors_beside_cancelled_leaves() -> None:
    cancelled = await cancelled_of_its_own()
    mine = ValueError("mine")
    assert unwrap_for_boundary(BaseExceptionGroup("n", [cancelled, mine])) is mine
    only = unwrap_for_boundary(BaseExceptionGroup("n", [cancelled, BaseExceptionGroup("m", [cancelled])]))
    assert only is cancelled  # nothing but cancellations: one Cancelled
    two = [KeyError("a"), KeyError("b")]
    rest = unwrap_for_boundary(BaseExceptionGroup("n", [cancelled, *two]))
    assert isinstance(rest, ExceptionGroup) and list(rest.exceptions) == two  # the Cancelled dropped
    inner = ExceptionGroup("inner", two)
    assert unwrap_for_boundary(ExceptionGroup("nursery", [inner])) is inner  # a task's group, as it is
    typed = ConfigError("typed")
    assert unwrap_for_boundary(BaseExceptionGroup("n", [cancelled, mine, typed])) is typed  # typed still wins


# -- run.result() of a run that ended without one ---------------------------------------------------------


@define_tool(name="stubborn", description="finishes its work", input_schema=OBJECT, side_effect=SideEffect.PURE,
             kind=ToolKind.READONLY)  # fmt: skip
async def stubborn(input: dict[str, Any], ctx: Any) -> str:
    with trio.CancelScope(shield=True):  # a clean-up that takes a while
        await trio.sleep(60)
    return "ok"


async def test_the_result_of_a_run_left_early_that_overran_cleanup_grace_is_request_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = TestModel(default=[Reply(tool_calls=[("stubborn", {})]), Reply(text="done")])
    async with chat(model, "go", tools=[stubborn], cleanup_grace=1) as run:
        async for event in run:
            if isinstance(event, ToolCallEnd):
                break
    with pytest.raises(RequestAbortedError, match="cancelled before it ended") as raised:
        await run.result()
    assert raised.value.reason == "user_abort"


async def test_the_result_of_a_run_cancelled_around_its_block_is_request_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.move_on_after(5) as scope:
        async with chat(TestModel(default=Reply(text="late", latency=60)), "hi") as run:
            await trio.sleep_forever()
    assert scope.cancelled_caught
    with pytest.raises(RequestAbortedError, match="cancelled before it ended"):
        await run.result()


# -- arguments: typed errors where they are given ----------------------------------------------------------


async def async_strategy(state: Any) -> bool:
    return bool(state.iteration < 2)


async def test_a_model_service_with_middleware_that_would_never_run_is_refused() -> None:
    model = TestModel(default=Reply(text="secret"))
    layer = ChatOnly()
    with pytest.raises(MiddlewareConfigError, match=r"model middleware #0 \(ChatOnly\).*not wrap_stream"):
        await chat(ModelService(model, [layer]), "hi")
    assert model.requests == [] and layer.calls == 0
    # With output_schema its wrap_chat runs for the structured-output call: accepted, and it runs.
    answers = TestModel(default=[Reply(text="hello"), Reply(text='{"a": 1}')])
    result = await chat(ModelService(answers, [layer]), "hi", output_schema=OBJECT)
    assert (result.structured_output, layer.calls) == ({"a": 1}, 1)


@pytest.mark.parametrize("form", ["await", "block"])
async def test_an_async_strategy_is_refused_before_the_run(form: str) -> None:
    model = TestModel(default=Reply(tool_calls=[("add", {})]))
    with pytest.raises(ConfigError, match="async_strategy is an async function"):
        if form == "await":
            await chat(model, "loop", tools=[add], strategy=async_strategy)
        else:
            async with chat(model, "loop", tools=[add], strategy=async_strategy):
                raise AssertionError("the block is never entered")
    assert model.requests == []


async def test_a_strategy_answering_anything_but_a_bool_fails_the_run_with_config_error() -> None:
    class Later:  # a callable object whose __call__ is async: only its answer tells
        async def __call__(self, state: Any) -> bool:
            return True

    model = TestModel(default=Reply(tool_calls=[("add", {})]))
    for strategy in (lambda state: "yes", Later()):
        with pytest.raises(ConfigError, match="not True or False"):
            await chat(model, "loop", tools=[add], strategy=strategy)
    assert model.requests == []  # asked before the first turn
    wrapped = combine_strategies(max_iterations(3), lambda state: 1)
    with pytest.raises(ConfigError, match="answered 1, not True or False"):
        await chat(model, "loop", tools=[add], strategy=wrapped)


@pytest.mark.parametrize(
    "make",
    [
        lambda: combine_strategies(5),  # type: ignore[arg-type]
        lambda: combine_strategies(max_iterations(2), async_strategy),  # type: ignore[arg-type]
        lambda: combine_strategies(max_iterations(2), lambda: True),  # type: ignore[arg-type]
        lambda: combine_strategies(),
        lambda: until_finish_reason("done"),
        lambda: until_finish_reason(),
    ],
    ids=[
        "combine-not-callable",
        "combine-async",
        "combine-no-argument",
        "combine-none",
        "finish-reason-unknown",
        "finish-reason-none",
    ],
)
def test_a_strategy_combinator_refuses_bad_arguments_where_it_is_called(make: Any) -> None:
    with pytest.raises(ConfigError):
        make()


@pytest.mark.parametrize(
    "bad",
    [{"journal": "j.db"}, {"abort": True}, {"abort": trio.Event()}, {"strategy": lambda: True}],
    ids=["journal=str", "abort=bool", "abort=Event", "strategy=no-argument"],
)
@pytest.mark.parametrize("form", ["await", "block"])
async def test_a_journal_abort_or_strategy_of_the_wrong_kind_is_config_error(bad: dict[str, Any], form: str) -> None:
    model = TestModel(default=Reply(text="hi"))
    name = next(iter(bad))
    with pytest.raises(ConfigError, match=f"{name} must be|cannot be called with one LoopState"):
        if form == "await":
            await chat(model, "hi", **bad)
        else:
            async with chat(model, "hi", **bad):
                raise AssertionError("the block is never entered")
    assert model.requests == []


# -- structured output: the service retries, the answer may be fenced -------------------------------------


async def test_a_retryable_failure_of_the_structured_output_call_is_retried_by_the_service(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # on_model_error's ctx.retry() is not offered for it; the ModelService's RetryPolicy retries it as any call.
    failure = Reply(error=ModelError("overloaded", code="server_error", retryable=True))
    model = TestModel(default=[Reply(text="hello"), failure, Reply(text='{"a": 1}')])
    result = await chat(model, "hi", output_schema=OBJECT)
    assert result.structured_output == {"a": 1}
    assert len(model.requests) == 3


@pytest.mark.parametrize("fence", ["```json\n{fenced}\n```", "```JSON\n{fenced}\n```", "```Json {fenced}```"])
async def test_a_fenced_structured_output_answer_is_read_whatever_the_case_of_its_tag(fence: str) -> None:
    answer = fence.replace("{fenced}", '{"a": 1}')
    result = await chat(TestModel(default=[Reply(text="hello"), Reply(text=answer)]), "hi", output_schema=OBJECT)
    assert result.structured_output == {"a": 1}


@pytest.mark.parametrize(
    ("answer", "schema", "issue"),
    [
        ('"\\ud800"', {"type": "string"}, "at <root>: string '\\ud800'"),  # the validator would fail on it
        ('{"\\ud800": 1}', OBJECT, "at <root>: key '\\ud800'"),  # nor would it read this key
        ('{"k": ["\\udfff"]}', {"type": "object", "properties": {"k": {"type": "array"}}}, "at k/0: string"),
    ],
    ids=["string", "unread-key", "nested"],
)
async def test_a_lone_surrogate_in_the_structured_output_answer_is_a_structured_output_error(
    answer: str, schema: dict[str, Any], issue: str
) -> None:
    # The answer is valid JSON text, but its escape decodes to text no encoding can hold.
    spy = StructuredLog()
    async with chat(
        TestModel(default=[Reply(text="hello"), Reply(text=answer)]), "hi", middleware=[spy], output_schema=schema
    ) as run:
        events = [event async for event in run]
        with pytest.raises(StructuredOutputError, match="not valid Unicode") as caught:
            await run.result()
    assert caught.value.issues[0].startswith(issue) and "lone surrogate" in caught.value.issues[0]
    str(caught.value).encode("utf-8")  # the message itself encodes: the surrogate is shown escaped
    assert spy.log[-2:] == ["on_error:StructuredOutputError", "deferred"]
    assert isinstance(events[-1], RunError)
    # An escaped surrogate pair is one character: accepted.
    pair = await chat(
        TestModel(default=[Reply(text="hello"), Reply(text='"\\ud83d\\ude00"')]), "hi", output_schema={"type": "string"}
    )
    assert pair.structured_output == "\U0001f600"


async def test_a_system_message_in_the_messages_names_instructions() -> None:
    with pytest.raises(HistoryError, match=r"messages\[0\]|history\[0\]") as raised:
        await chat(TestModel(), [SystemMessage("be brief"), UserMessage("hi")])
    assert "instructions=" in str(raised.value) and raised.value.index == 0


# -- a reader that aborts and reads on sees the whole end of the stream -------------------------------------

LONG_REPLY = " ".join(f"w{index}" for index in range(1000))  # far more text events than the channel holds


def assert_well_formed(events: list[Any]) -> None:
    """Every block that opened is closed, in order, and exactly one terminal event ends the stream."""
    open_text = open_steps = 0
    for event in events[:-1]:
        assert not isinstance(event, (RunFinished, RunError)), "a terminal event before the end"
        if isinstance(event, TextMessageStart):
            assert open_text == 0
            open_text += 1
        elif isinstance(event, TextMessageContent):
            assert open_text == 1, "text outside its message"
        elif isinstance(event, TextMessageEnd):
            assert open_text == 1
            open_text -= 1
        elif isinstance(event, StepStarted):
            assert open_steps == 0
            open_steps += 1
        elif isinstance(event, StepFinished):
            assert open_steps == 1 and open_text == 0
            open_steps -= 1
    assert (open_text, open_steps) == (0, 0)
    assert isinstance(events[0], RunStarted) and isinstance(events[-1], (RunFinished, RunError))


class Emitted(ChatMiddleware):
    """What the run emitted: every event passes ``on_chunk`` on its way to the stream."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_chunk(self, ctx: Any, event: Any) -> None:
        self.events.append(event)


@pytest.mark.parametrize("at", [1, 3, 200])
async def test_a_reader_that_aborts_and_reads_on_gets_every_closing_event_and_the_terminal_one(at: int) -> None:
    emitted = Emitted()
    async with chat(TestModel(default=Reply(text=LONG_REPLY)), "hi", middleware=[emitted]) as run:
        events: list[Any] = []
        async for event in run:
            events.append(event)
            if len(events) == at:
                run.abort("enough")  # the run goes on emitting into a full channel: its closing events
    assert events == emitted.events  # every one, in order
    assert_well_formed(events)
    assert isinstance(events[-1], RunFinished) and events[-1].outcome == "aborted"
    assert (await run.result()).stop_reason is StopReason.ABORTED


async def test_a_run_aborted_while_its_reader_waits_keeps_every_event_for_it() -> None:
    emitted = Emitted()
    async with chat(TestModel(default=Reply(text=LONG_REPLY)), "hi", middleware=[emitted]) as run:
        await trio.testing.wait_all_tasks_blocked()  # the run fills the channel and waits for its reader
        run.abort("enough")  # cancels the model call, whose event waited for room: kept all the same
        await trio.testing.wait_all_tasks_blocked()  # the aborted run ends without its reader
        assert run._done.is_set()
        events = [event async for event in run]
    assert len(events) > 256 and events == emitted.events  # the channel's, then those past it, in order
    assert_well_formed(events)
    assert isinstance(events[-1], RunFinished) and events[-1].outcome == "aborted"


async def test_events_past_the_channel_of_an_aborted_run_are_dropped_once_nobody_can_read_them() -> None:
    async with chat(TestModel(default=Reply(text=LONG_REPLY)), "hi") as run:
        await trio.testing.wait_all_tasks_blocked()
        run.abort("enough")
        await trio.testing.wait_all_tasks_blocked()
        assert run._overflow  # waiting for a reader
        assert (await run.result()).stop_reason is StopReason.ABORTED
        assert not run._overflow and [event async for event in run] == []


@pytest.mark.parametrize("after_text", [False, True])
async def test_a_model_aborted_error_nothing_of_the_run_asked_for_fails_the_call(after_text: bool) -> None:
    # A middleware (or provider) that raises ModelAbortedError of its own, the run's abort untouched:
    # the run ended "aborted" with no abort behind it and `result()` raised a bare AssertionError
    # after RunFinished(aborted) had gone out. It is the model call's failure, as any ModelError.
    class Refuse:
        async def wrap_stream(self, request: Any, call_next: Any) -> Any:
            if after_text:
                async for chunk in call_next(request):
                    yield chunk
                    break
            raise ModelAbortedError("upstream gateway aborted the request")

    seen: list[str] = []

    class Watch(ChatMiddleware):
        def on_abort(self, ctx: Any, info: Any) -> None:
            seen.append("abort")

        def on_error(self, ctx: Any, info: Any) -> None:
            seen.append(type(info.error).__name__)

    async with chat(TestModel(default=Reply("hi")), "hi", model_middleware=[Refuse()], middleware=[Watch()]) as run:
        events = [type(event).__name__ async for event in run]
        with pytest.raises(ModelAbortedError, match="upstream gateway aborted"):
            await run.result()
    assert seen == ["ModelAbortedError"]
    assert events[-1] == "RunError"
    assert "RunFinished" not in events
