"""What the loop does with a lifecycle hook's answer before anything holds it, and the loop points
every run reaches the same way.

* A decision whose fields are of the wrong type (`Refuse`, `AbortRun`, a stage's `Deny`) fails
  its call alone with ``hook_error``: it never reaches a settlement, which would leave the call open.
* A cut-off call's replacement (``on_after_tool_call`` / ``on_cut_off_call``) that is no JSON fails
  that call with ``invalid_result``, as a post_tool stage's replacement does.
* An `InterruptRequest` built directly is held to ``definition.request()``'s checks.
* Every ``on_config`` starts from the run's own config: a hook that adds to it adds once per call.
* A continuation that resumes before the model call runs ``on_iteration``.
* A change ``on_before_tool_call`` makes to a client tool's ``call.args`` in place is taken.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.test_loop import Fakes, Hooks
from trio_agent import ToolResult, chat, define_tool, open_session
from trio_agent._errors import MiddlewareError
from trio_agent._tools._results import result_problem
from trio_agent.journal import MemoryStore, open_journal
from trio_agent.lifecycle import (
    AbortRun,
    ChatMiddleware,
    InterruptRequest,
    MiddlewareDecisionError,
    Phase,
    Refuse,
    ReplaceResult,
    Respond,
    TextMessageStart,
    define_client_tool,
    define_interrupt,
)
from trio_agent.models import FinishReason, SystemMessage, ToolCallPart, ToolResultMessage, ToolSpec
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object", "properties": {"q": {"type": "string"}}}


def make_echo(runs: list[dict[str, Any]]) -> Any:
    @define_tool(name="echo", description="echoes", side_effect="pure", kind="readonly", input_schema=OBJECT)
    async def echo(input: dict[str, Any], ctx: Any) -> ToolResult:
        runs.append(dict(input))
        return ToolResult.success("echoed")

    return echo


def calls_then_text(name: str, args: dict[str, Any] | None = None, *, cut: bool = False) -> TestModel:
    """Calls *name* once (a reply cut off by its output limit if *cut*), then says what it was answered."""

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        if isinstance(last, ToolResultMessage):
            return Reply(text="answered: " + last.content)
        return Reply(tool_calls=[(name, args or {})], finish_reason=FinishReason.LENGTH if cut else None)

    return TestModel(respond=respond)


class Guard(ChatMiddleware):
    def __init__(self, decision: object) -> None:
        self.decision = decision

    def on_guard_tool_call(self, ctx: Any, call: Any) -> Any:
        return self.decision


# -- decisions whose fields are of the wrong type -----------------------------------------------------------

BAD_GUARD_DECISIONS = [
    pytest.param(Refuse("no", code=5), "code 5", id="refuse-code-int"),  # type: ignore[arg-type]
    pytest.param(Refuse("no", code=""), "code ''", id="refuse-code-empty"),
    pytest.param(Refuse("no", code=None), "code None", id="refuse-code-none"),  # type: ignore[arg-type]
    pytest.param(Refuse(None), "message None", id="refuse-message-none"),  # type: ignore[arg-type]
    pytest.param(Refuse(123), "message 123", id="refuse-message-int"),  # type: ignore[arg-type]
    pytest.param(Refuse(""), "message ''", id="refuse-message-empty"),
    pytest.param(AbortRun(None), "reason None", id="abort-reason-none"),  # type: ignore[arg-type]
    pytest.param(AbortRun({"x": 1}), "reason {'x': 1}", id="abort-reason-dict"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("decision", "named"), BAD_GUARD_DECISIONS)
@pytest.mark.parametrize("tool", ["echo", "ask_user"])
async def test_a_guard_decision_of_the_wrong_type_fails_only_its_call_with_hook_error(
    decision: object, named: str, tool: str
) -> None:
    runs: list[dict[str, Any]] = []
    client = define_client_tool("ask_user", "asks the user", input_schema=OBJECT)
    model = calls_then_text(tool)
    result = await chat(model, "go", tools=[make_echo(runs), client], middleware=[Guard(decision)])
    assert result.stop_reason.value == "end_turn" and result.paused is None  # not sent to the client either
    assert runs == []  # the guard fails closed: the tool did not run
    [answer] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert answer.is_error
    assert "on_guard_tool_call of middleware 'Guard'" in answer.content
    assert f"with {named}" in answer.content
    assert "MiddlewareDecisionError" in answer.content


async def test_a_refuse_whose_code_is_no_string_leaves_no_journalled_call_open() -> None:
    # The code went into the settlement unchecked: the settlement failed, the call stayed open,
    # the next send() failed, and recovery on reopen ran the refused (pure) tool.
    runs: list[dict[str, Any]] = []
    store = MemoryStore()
    options: dict[str, Any] = {"model": "m", "tools": [make_echo(runs)], "journal": store, "session_id": "s1"}
    async with open_session(provider=calls_then_text("echo"), lifecycle=[Guard(Refuse("no", code=5))], **options) as s:  # type: ignore[arg-type]
        first = await s.send("go")
        second = await s.send("again")
    assert "hook_error" not in first  # the model's text: it read the refusal's error, not a crash
    assert first.startswith("answered: Error: guard stage Guard.on_guard_tool_call failed")
    assert second.startswith("answered: Error: guard stage Guard.on_guard_tool_call failed")
    async with open_session(provider=calls_then_text("echo"), lifecycle=[Guard(None)], **options) as s:
        assert await s.send("third") == "answered: echoed"
    assert runs == [{}]  # only the third request's call ran: recovery ran nothing


@pytest.mark.parametrize(
    ("deny", "named"),
    [
        pytest.param(lambda: _stages_deny("no", code=5), "code is 5", id="code-int"),
        pytest.param(lambda: _stages_deny("no", code=""), "code is ''", id="code-empty"),
        pytest.param(lambda: _stages_deny(None), "message is None", id="message-none"),
        pytest.param(lambda: _stages_deny(""), "message is ''", id="message-empty"),
    ],
)
async def test_a_stage_deny_that_cannot_end_its_call_fails_it_with_hook_error(deny: Any, named: str) -> None:
    from trio_agent._tools._pipeline import ToolPipeline
    from trio_agent._tools._stages import ToolStages
    from trio_agent.testing import call_tool

    runs: list[dict[str, Any]] = []

    async def guard(request: Any) -> Any:
        return deny()

    pipeline = ToolPipeline([make_echo(runs)], stages=ToolStages(guard=[guard]))
    record = await call_tool(pipeline, "echo", {"q": "x"})
    assert runs == []
    error = record.result.error
    assert error is not None and error.code == "hook_error"
    assert f"returned a Deny whose {named}" in error.message
    assert result_problem(record.result) is None


def _stages_deny(message: object, code: object = None) -> Any:
    from trio_agent._tools._stages import Deny

    return Deny(message, code=code)  # type: ignore[arg-type]


# -- a cut-off call's replacement ---------------------------------------------------------------------------


class Replace(ChatMiddleware):
    def __init__(self, value: object) -> None:
        self.value = value

    def on_after_tool_call(self, ctx: Any, info: Any) -> Any:
        return ReplaceResult(self.value)


ASK = define_interrupt("ask", response_schema={"type": "string"})


class AskAfterModel(ChatMiddleware):
    interrupts = (ASK,)

    def on_interrupt_boundary(self, ctx: Any) -> Any:
        if ctx.phase is Phase.AFTER_MODEL and ctx.parent_run_id is None:
            return [ASK.request("k", "ok?")]
        return None


def _circular() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


@pytest.mark.parametrize("value", [{1, 2}, _circular(), float("nan")], ids=["set", "circular", "nan"])
async def test_a_cut_off_calls_replacement_that_is_no_json_fails_that_call_with_invalid_result(value: object) -> None:
    model = calls_then_text("echo", cut=True)
    result = await chat(model, "go", tools=[make_echo([])], middleware=[Replace(value)])
    assert result.stop_reason.value == "end_turn"
    [answer] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert answer.is_error
    assert answer.content.startswith("Error: on_after_tool_call of middleware 'Replace' returned a non-JSON result")


async def test_a_pause_holding_a_cut_off_calls_bad_replacement_can_be_stored_and_resumed() -> None:
    middleware = [Replace({1, 2}), AskAfterModel()]
    async with open_journal(MemoryStore(), session_id="s") as journal:
        model = calls_then_text("echo", cut=True)
        first = await chat(model, "go", tools=[make_echo([])], middleware=middleware, journal=journal)
        assert first.paused is not None
        [refused] = first.paused.state.refused.values()
        assert refused.error is not None and refused.error.code == "invalid_result"
        json.dumps(first.paused.to_json())  # what a client is sent
        answer = [Respond(first.paused.interrupts[0].id, "yes")]
        second = await chat(
            model, resume=first.paused, answers=answer, tools=[make_echo([])], middleware=middleware, journal=journal
        )
    assert second.text.startswith("answered: Error: on_after_tool_call of middleware 'Replace' returned a non-JSON")


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ({"not": "a result"}, "returned {'not': 'a result'}, not a ToolResult"),
        (ToolResult.success({1, 2}), "returned a non-JSON result: result.output is not JSON: set"),
    ],
    ids=["dict", "set-output"],
)
async def test_a_lifecycles_cut_off_answer_that_is_no_storable_tool_result_fails_that_call(
    answer: object, problem: str
) -> None:
    class Junk(Hooks):
        name = "junk"

        async def on_cut_off_call(self, ctx: Any, call: ToolCallPart, result: ToolResult) -> Any:
            return answer

    fakes = Fakes([Reply(tool_calls=[("add", {"a": 1})], finish_reason=FinishReason.LENGTH), Reply(text="done")])
    fakes.spec.offered = (ToolSpec("add", "adds", {"type": "object"}),)
    outcome = await fakes.run(Junk())
    assert outcome.stop_reason.value == "end_turn"
    [result] = fakes.results().values()
    assert result.error is not None and result.error.code == "invalid_result"
    assert result.error.message == f"on_cut_off_call of junk {problem}"


# -- interrupt requests built directly ----------------------------------------------------------------------

PICK = define_interrupt("pick", payload_schema={"type": "object"}, response_schema={"type": "string"})


class AskDirectly(ChatMiddleware):
    interrupts = (PICK,)

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def on_interrupt_boundary(self, ctx: Any) -> Any:
        if ctx.phase is Phase.BEFORE_MODEL and ctx.parent_run_id is None:
            return [InterruptRequest(PICK, **self.fields)]
        return None


BAD_REQUESTS = [
    pytest.param({"key": "k", "message": "m", "payload": {"a": {1, 2}}}, "invalid payload", id="payload-set"),
    pytest.param({"key": "k", "message": "m", "payload": [1, 2]}, "invalid payload", id="payload-schema"),
    pytest.param({"key": "k", "message": None}, "message must be a string", id="message-none"),
    pytest.param({"key": 5, "message": "m"}, "key must be a non-empty string", id="key-int"),
    pytest.param({"key": "k", "message": "m", "reason": 3}, "reason must be a string", id="reason-int"),
]


@pytest.mark.parametrize(("fields", "problem"), BAD_REQUESTS)
async def test_an_interrupt_request_built_directly_is_checked_as_request_checks_it(
    fields: dict[str, Any], problem: str
) -> None:
    model = TestModel(default=Reply(text="x"))
    with pytest.raises(MiddlewareDecisionError, match=f"on_interrupt_boundary of middleware 'AskDirectly'.*{problem}"):
        await chat(model, "hi", middleware=[AskDirectly(**fields)])
    assert model.requests == []


async def test_a_good_interrupt_request_built_directly_pauses_as_one_from_request() -> None:
    result = await chat(TestModel(default=Reply(text="x")), "hi", middleware=[AskDirectly(key="k", message="m")])
    assert result.paused is not None
    assert [i.id for i in result.paused.interrupts] == ["pick:k"]
    json.dumps(result.paused.to_json())


async def test_a_session_whose_hook_asks_an_invalid_question_is_not_wedged() -> None:
    # It failed at the journal's run_paused (InvalidTransitionError), after the loop had paused.
    asked: list[int] = []

    class AskOnce(ChatMiddleware):
        interrupts = (PICK,)

        def on_interrupt_boundary(self, ctx: Any) -> Any:
            if ctx.phase is Phase.BEFORE_MODEL and not asked:
                asked.append(1)
                return [InterruptRequest(PICK, "k", None)]  # type: ignore[arg-type]
            return None

    async with open_session(provider=TestModel(default=Reply(text="x")), model="m", lifecycle=[AskOnce()]) as s:
        with pytest.raises(MiddlewareDecisionError, match="message must be a string"):
            await s.send("hi")
        assert s.paused is None
        assert await s.send("again") == "x"


async def test_a_lifecycles_invalid_interrupt_request_fails_the_run_typed() -> None:
    class Junk(Hooks):
        name = "junk"

        async def on_interrupt_boundary(self, ctx: Any) -> Any:
            return [InterruptRequest(PICK, "k", "m", payload={"a": {1}})]

    fakes = Fakes([Reply(text="x")])
    fakes.spec.interrupts = {"pick": PICK}
    with pytest.raises(MiddlewareError, match=r"on_interrupt_boundary of junk returned an invalid request: .*payload"):
        await fakes.run(Junk())


# -- on_config's starting config ----------------------------------------------------------------------------

EXTRA = ToolSpec("lookup", "looks things up", {"type": "object"})


async def test_every_on_config_starts_from_the_runs_own_config() -> None:
    seen: list[tuple[str, list[str], str, dict[str, Any], dict[str, Any]]] = []

    class AddTool(ChatMiddleware):
        def on_config(self, ctx: Any, config: Any) -> Any:
            seen.append(
                (ctx.phase.value, [t.name for t in config.tools], config.instructions, dict(config.options),
                 dict(config.metadata))
            )  # fmt: skip
            return {
                "tools": [*config.tools, EXTRA],
                "instructions": config.instructions + " +x",
                "options": {**config.options, "n": config.options.get("n", 0) + 1},
                "metadata": {**config.metadata, "m": config.metadata.get("m", 0) + 1},
            }

    model = calls_then_text("echo")
    result = await chat(model, "go", tools=[make_echo([])], instructions="Be brief.", middleware=[AddTool()])
    assert result.text == "answered: echoed"
    metadata = seen[0][4]
    assert "m" not in metadata  # the run's own (its ids)
    base: tuple[Any, ...] = (["echo"], "Be brief.", {}, metadata)
    assert seen == [("init", *base), ("before_model", *base), ("before_model", *base)]
    for request in model.requests:  # each call carries the one change of its own on_config
        assert [t.name for t in request.tools] == ["echo", "lookup"]
        assert request.options == {"n": 1}
        assert request.metadata == {**metadata, "m": 1}
        assert request.messages[0] == SystemMessage("Be brief. +x")


# -- on_iteration on a continuation -------------------------------------------------------------------------


async def test_a_continuation_that_resumes_before_the_model_call_runs_on_iteration_first() -> None:
    log: list[tuple[str, str, Any]] = []

    class Log(ChatMiddleware):
        interrupts = (ASK,)

        def on_iteration(self, ctx: Any, info: Any) -> None:
            log.append((ctx.run_id, "on_iteration", (info.iteration, info.message_id)))

        def on_config(self, ctx: Any, config: Any) -> None:
            log.append((ctx.run_id, "on_config", ctx.phase.value))

        def on_interrupt_boundary(self, ctx: Any) -> Any:
            if ctx.phase is Phase.BEFORE_MODEL and ctx.parent_run_id is None:
                return [ASK.request("k", "go on?")]
            return None

        def on_chunk(self, ctx: Any, event: Any) -> None:
            if isinstance(event, TextMessageStart):
                log.append((ctx.run_id, "TextMessageStart", event.message_id))

    model = TestModel(default=Reply(text="hello"))
    first = await chat(model, "hi", middleware=[Log()])
    assert first.paused is not None
    log.clear()
    answer = [Respond(first.paused.interrupts[0].id, "yes")]
    second = await chat(model, resume=first.paused, answers=answer, middleware=[Log()])
    assert second.text == "hello"
    [(_, _, (iteration, message_id))] = [entry for entry in log if entry[1] == "on_iteration"]
    assert iteration == 0
    assert [entry[1:] for entry in log] == [
        ("on_config", "init"),
        ("on_iteration", (0, message_id)),
        ("on_config", "before_model"),
        ("TextMessageStart", message_id),  # the message on_iteration was told of
    ]
    assert len({entry[0] for entry in log}) == 1  # all the continuation's


# -- a client tool's in-place edit in on_before_tool_call ------------------------------------------------------


class EditInPlace(ChatMiddleware):
    def __init__(self, value: object) -> None:
        self.value = value

    def on_before_tool_call(self, ctx: Any, call: Any) -> None:
        call.args["q"] = self.value


async def test_a_client_tools_args_edited_in_place_before_the_call_are_sent_to_the_client() -> None:
    client = define_client_tool("client", "asks the client", input_schema=OBJECT)
    model = calls_then_text("client", {"q": "model"})
    result = await chat(model, "go", tools=[client], middleware=[EditInPlace("edited in place")])
    assert result.paused is not None
    [interrupt] = result.paused.interrupts
    assert interrupt.input == {"q": "edited in place"}


async def test_a_client_tools_args_edited_in_place_are_checked_by_its_schema_next() -> None:
    client = define_client_tool("client", "asks the client", input_schema=OBJECT)
    model = calls_then_text("client", {"q": "model"})
    result = await chat(model, "go", tools=[client], middleware=[EditInPlace(5)])
    assert result.paused is None  # not sent: the schema refused what the hook left
    [answer] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert answer.is_error and "invalid input for tool 'client'" in answer.content
