"""What the journal records of a call's input is never a dict that user code can change behind its back.

The model's input (``tool_scheduled``) and the checked final input (``tool_started``, what the tool
runs with) are the call's. User code that would otherwise hold them gets its own copy, so a change
it makes in place reaches neither the tool nor the journal (and so skips no check): ``guard`` stages
and ``on_guard_tool_call`` (after the check), the tool's resolver and ``affected_paths`` (asked about
the model's input before it is scheduled, and about the final input), a typed tool's own input.
Before the check, a change made in place is the input the call goes on with, checked like any other
(``TransformArgs``, ``Allow(input=...)``).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from tests.session_helpers import run_request, stream_events
from trio_agent import ToolContext, ToolResult, define_tool, open_session
from trio_agent._journal._events import ToolScheduled, ToolStarted
from trio_agent._loop._context import RunContext
from trio_agent._loop._events import RunEvent, ToolCallEnd
from trio_agent._loop._hooks import ClientCall, ClientCallStages
from trio_agent._loop._run import _screen_client_call
from trio_agent._models._messages import ToolCallPart
from trio_agent.lifecycle import define_chat_middleware, define_client_tool, middleware_lifecycle
from trio_agent.testing import Reply, TestModel, call_tool
from trio_agent.tools import AbortHandle, InMemoryToolJournal, StageRequest, ToolPipeline, ToolStages

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"x": {"type": "string"}},
    "required": ["x"],
    "additionalProperties": False,
}
MODEL_INPUT = {"x": "1"}
# What a misbehaving callback writes into the dict it was given: a value the schema refuses, and one
# that is no JSON at all (which a journal cannot store: it failed the whole request).
CHANGES: dict[str, Any] = {"against the schema": 5, "not JSON": {1, 2}}


def run_context() -> RunContext:
    async def discard(event: RunEvent) -> None:
        return None

    return RunContext(
        run_id="run-1", thread_id="thread", agent_id="root", abort=AbortHandle(), events=discard, messages=lambda: ()
    )


class Echo:
    """A tool that keeps the input it ran with; *options* are its callables."""

    def __init__(self, **options: Any) -> None:
        self.ran_with: list[dict[str, Any]] = []

        async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
            self.ran_with.append(dict(inp))
            return ToolResult.success("ok")

        self.tool = define_tool(
            run, name="echo", description="echo", side_effect="pure", kind="readonly", input_schema=SCHEMA, **options
        )


def started_inputs(journal: InMemoryToolJournal) -> list[Any]:
    return [entry.data["input"] for entry in journal.entries if entry.kind in ("scheduled", "started")]


# -- after the check: guards ------------------------------------------------------------------------


def raw_guard(value: Any) -> ToolStages:
    async def guard(request: StageRequest) -> None:
        request.input["x"] = value

    return ToolStages(guard=[guard])


def lifecycle_guard(value: Any) -> ToolStages:
    def guard(ctx: Any, call: Any) -> None:
        call.args["x"] = value

    stages = middleware_lifecycle([define_chat_middleware(on_guard_tool_call=guard)]).tool_stages(run_context())
    assert stages is not None
    return stages


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("guards", [raw_guard, lifecycle_guard], ids=["guard stage", "on_guard_tool_call"])
async def test_a_guard_changing_the_final_input_in_place_changes_neither_the_run_nor_the_record(
    guards: Any, change: str
) -> None:
    echo, journal = Echo(), InMemoryToolJournal()
    pipeline = ToolPipeline([echo.tool], stages=guards(CHANGES[change]), journal=journal)
    record = await call_tool(pipeline, "echo", dict(MODEL_INPUT))
    assert record.result.ok, record.result
    assert echo.ran_with == [MODEL_INPUT]
    assert started_inputs(journal) == [MODEL_INPUT, MODEL_INPUT]  # the started entry is what the tool ran with
    assert record.effective_input == MODEL_INPUT


async def test_in_a_session_a_guard_putting_no_json_into_the_input_fails_nothing() -> None:
    # Before: the started event's JSON check refused the changed input and the whole request failed.
    echo = Echo()

    def guard(ctx: Any, call: Any) -> None:
        call.args["x"] = {1, 2}

    model = TestModel({"go": [Reply(tool_calls=[("echo", dict(MODEL_INPUT))]), Reply(text="done")]})
    middleware = [define_chat_middleware(on_guard_tool_call=guard)]
    async with open_session(provider=model, tools=[echo.tool], lifecycle=middleware) as session:
        _, done = await run_request(session, "go")
        events = await stream_events(session)
    assert done.text == "done" and done.error is None
    assert echo.ran_with == [MODEL_INPUT]
    assert [e.input for e in events if isinstance(e, ToolStarted)] == [MODEL_INPUT]


async def test_a_client_tools_guard_cannot_change_what_goes_to_the_client() -> None:
    client_tool = define_client_tool("pick", input_schema=SCHEMA)

    def guard(ctx: Any, call: Any) -> None:
        call.args["x"] = {1, 2}

    lifecycle = middleware_lifecycle([define_chat_middleware(on_guard_tool_call=guard)])
    stages = lifecycle.client_call_stages(run_context())
    part = ToolCallPart("c1", "pick", '{"x": "1"}')
    final = await _screen_client_call(part, dict(MODEL_INPUT), client_tool, stages, lambda: False)
    assert final == MODEL_INPUT


async def test_a_raw_client_guard_stage_cannot_change_what_goes_to_the_client() -> None:
    client_tool = define_client_tool("pick", input_schema=SCHEMA)

    async def guard(call: ClientCall) -> None:
        call.input["x"] = {1, 2}

    part = ToolCallPart("c1", "pick", '{"x": "1"}')
    stages = ClientCallStages(guard=(guard,))
    final = await _screen_client_call(part, dict(MODEL_INPUT), client_tool, stages, lambda: False)
    assert final == MODEL_INPUT


@pytest.mark.parametrize("where", ["on_chunk", "stream reader"])
async def test_a_tool_call_end_changed_in_place_changes_neither_the_call_nor_its_record(where: str) -> None:
    # ToolCallEnd.input was the very dict the call was then scheduled with: an on_chunk hook that
    # wrote into it changed the journalled model input (and what the tool ran with).
    echo = Echo()
    seen: list[Any] = []

    def change(event: Any) -> None:
        if isinstance(event, ToolCallEnd):
            seen.append(dict(event.input))
            event.input["x"] = {1, 2}

    def on_chunk(ctx: Any, event: Any) -> Any:
        change(event)
        return event

    model = TestModel({"go": [Reply(tool_calls=[("echo", dict(MODEL_INPUT))]), Reply(text="done")]})
    lifecycle = [define_chat_middleware(on_chunk=on_chunk)] if where == "on_chunk" else []
    async with open_session(provider=model, tools=[echo.tool], lifecycle=lifecycle) as session:
        async with session.stream("go") as stream:
            async for event in stream:
                if where == "stream reader":
                    change(getattr(event, "event", event))
        events = await stream_events(session)
    assert echo.ran_with == [MODEL_INPUT]
    assert [e.model_input for e in events if isinstance(e, ToolScheduled)] == [MODEL_INPUT]
    assert [e.input for e in events if isinstance(e, ToolStarted)] == [MODEL_INPUT]
    if where == "on_chunk":
        assert seen == [MODEL_INPUT]


# -- the tool's own callables ---------------------------------------------------------------------


class Changing:
    """A tool callable that writes into the input it was given, then answers *result*."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls = 0

    def __call__(self, inp: dict[str, Any]) -> Any:
        self.calls += 1
        inp["x"] = {1, 2}
        return self.result


# (signature_content is asked only by the permission engine, which gives it a copy itself.)
CALLABLES: dict[str, Any] = {"resolve_behavior": None, "affected_paths": []}


@pytest.mark.parametrize("name", list(CALLABLES))
async def test_the_tools_callables_get_their_own_copy_of_the_input(name: str) -> None:
    changing = Changing(CALLABLES[name])
    echo = Echo(**{name: changing})
    model = TestModel({"go": [Reply(tool_calls=[("echo", dict(MODEL_INPUT))]), Reply(text="done")]})
    # A session: the permission engine asks both about the model's input, the pipeline the resolver
    # (to schedule the call) and affected_paths (for the final input's file locks).
    async with open_session(provider=model, tools=[echo.tool]) as session:
        _, done = await run_request(session, "go")
        events = await stream_events(session)
    assert changing.calls > 0
    assert done.text == "done" and done.error is None
    assert echo.ran_with == [MODEL_INPUT]
    assert [e.model_input for e in events if isinstance(e, ToolScheduled)] == [MODEL_INPUT]
    assert [e.input for e in events if isinstance(e, ToolStarted)] == [MODEL_INPUT]
    # Without the engine: the pipeline's own questions.
    echo, journal = Echo(**{name: Changing(CALLABLES[name])}), InMemoryToolJournal()
    record = await call_tool(ToolPipeline([echo.tool], journal=journal), "echo", dict(MODEL_INPUT))
    assert record.result.ok and echo.ran_with == [MODEL_INPUT]
    assert started_inputs(journal) == [MODEL_INPUT, MODEL_INPUT]


# -- the typed tool's own input ---------------------------------------------------------------------


@attrs.define
class NestedInput:
    data: dict[str, Any]
    items: list[Any]


@attrs.define
class FlatInput:
    a: int
    b: str | None = None


@define_tool(side_effect="pure", kind="readonly")
async def nested(input: NestedInput, ctx: ToolContext) -> str:
    """Changes the containers of its input in place."""
    input.data["inner"]["changed"] = True
    input.items[0]["changed"] = True
    return "ok"


@define_tool(side_effect="pure", kind="readonly")
async def flat(input: FlatInput, ctx: ToolContext) -> str:
    """Scalars only."""
    return "ok"


async def test_a_typed_tool_changing_its_input_leaves_the_final_input_as_checked() -> None:
    seen: list[Any] = []

    async def post(request: StageRequest, result: ToolResult) -> None:
        seen.append(request.input)

    given = {"data": {"inner": {}}, "items": [{}]}
    pipeline = ToolPipeline([nested], stages=ToolStages(post_tool=[post]))
    record = await call_tool(pipeline, "nested", given)
    assert record.result.ok
    assert record.effective_input == given and seen == [given]


def test_only_a_typed_tool_whose_input_can_hold_containers_is_given_a_copy() -> None:
    # Scalars cannot be changed in place: structuring them from the checked input shares nothing.
    assert nested._shares_input and not flat._shares_input
    assert not Echo().tool._shares_input  # untyped: the tool gets its own copy of the dict anyway


# -- before the check ---------------------------------------------------------------------------------


async def test_on_before_tool_call_changing_args_in_place_is_checked_as_the_new_input() -> None:
    # Not behind the pipeline's back: it is the input the call goes on with, checked like TransformArgs'
    # (and the journal keeps what the model asked for).
    def before(ctx: Any, call: Any) -> None:
        call.args["x"] = {1, 2}

    stages = middleware_lifecycle([define_chat_middleware(on_before_tool_call=before)]).tool_stages(run_context())
    echo, journal = Echo(), InMemoryToolJournal()
    record = await call_tool(ToolPipeline([echo.tool], stages=stages, journal=journal), "echo", dict(MODEL_INPUT))
    assert record.result.error is not None and record.result.error.code == "invalid_input"
    assert "the input.x is not JSON: set" in record.result.error.message
    assert echo.ran_with == [] and started_inputs(journal) == [MODEL_INPUT]
