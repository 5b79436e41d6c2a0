"""Human in the loop on ``chat()``: interrupts, approvals, client tools, continuations (issue 14)."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from trio_agent import PermissionAsk, SideEffect, ToolKind, define_tool, open_session
from trio_agent._chat._chat import chat
from trio_agent._errors import ConfigError, LeaseLostError, MiddlewareError, MiddlewareShapeError
from trio_agent._lifecycle._interrupts import PausedRun, answers_from_json, answers_to_json
from trio_agent._lifecycle._middleware import ChatMiddleware
from trio_agent._loop._events import MessagesSnapshot, RunError, RunFinished, ToolCallResult
from trio_agent._loop._interrupts import (
    Approve,
    Cancel,
    InterruptKind,
    InterruptResumeError,
    Reject,
    Respond,
    ToolResume,
    define_client_tool,
    define_interrupt,
    most_restrictive,
)
from trio_agent._loop._rules import Phase, StopReason
from trio_agent.lifecycle import Refuse, Skip, TransformArgs
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel

KEY = b"k" * 32
WRITE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
    "required": ["path", "text"],
}


def make_write(ran: list[dict[str, Any]]) -> Any:
    @define_tool(
        name="write",
        description="writes a file",
        input_schema=WRITE_SCHEMA,
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.WRITE,
    )
    async def write(input: dict[str, Any], ctx: Any) -> str:
        ran.append(dict(input))
        return f"wrote {input['path']}"

    return write


def make_read(ran: list[str]) -> Any:
    @define_tool(
        name="read",
        description="reads",
        input_schema={"type": "object"},
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
    )
    async def read(input: dict[str, Any], ctx: Any) -> str:
        ran.append("read")
        return "contents"

    return read


def calls_then_echo(*calls: tuple[str, dict[str, Any]]) -> TestModel:
    """Asks for *calls* once, then says what the tools answered."""

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        if isinstance(last, ToolResultMessage):
            answers = [m.content for m in request.messages if isinstance(m, ToolResultMessage)]
            return Reply(text="done: " + " | ".join(answers))
        return Reply(tool_calls=list(calls))

    return TestModel(respond=respond)


async def run_chat(model: Any, messages: Any = None, **kwargs: Any) -> tuple[list[Any], Any]:
    async with chat(model, messages, **kwargs) as run:
        events = [event async for event in run]
        result = await run.result()
    return events, result


class Recorder(ChatMiddleware):
    def __init__(self) -> None:
        self.terminal: list[str] = []
        self.boundaries: list[Phase] = []

    def on_finish(self, ctx: Any, info: Any) -> None:
        self.terminal.append("finish")

    def on_abort(self, ctx: Any, info: Any) -> None:
        self.terminal.append("abort")

    def on_error(self, ctx: Any, info: Any) -> None:
        self.terminal.append("error")


# ---------------------------------------------------------------- approvals


async def test_a_call_a_rule_asks_about_pauses_the_run_before_it_runs() -> None:
    ran: list[dict[str, Any]] = []
    recorder = Recorder()
    events, result = await run_chat(
        calls_then_echo(("write", {"path": "a.txt", "text": "hi"})),
        "write it",
        tools=[make_write(ran)],
        permissions={"ask": ["write"]},
        middleware=[recorder],
    )
    assert ran == []
    assert result.stop_reason is StopReason.INTERRUPTED
    [interrupt] = result.interrupts
    assert interrupt.kind is InterruptKind.APPROVAL
    assert interrupt.tool_name == "write" and interrupt.input == {"path": "a.txt", "text": "hi"}
    assert interrupt.id == f"approval_{interrupt.tool_call_id}"
    # The pause ends the stream: a snapshot, then RunFinished with the batch; no terminal hook.
    assert isinstance(events[-2], MessagesSnapshot) and isinstance(events[-1], RunFinished)
    assert events[-1].outcome == "interrupt" and events[-1].interrupts == result.interrupts
    assert recorder.terminal == []


async def test_approve_runs_the_call_and_the_run_goes_on() -> None:
    ran: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(ran)]
    _, paused = await run_chat(model, "write it", tools=tools, permissions={"ask": ["write"]})
    recorder = Recorder()
    events, result = await run_chat(
        model, tools=tools, permissions={"ask": ["write"]}, middleware=[recorder],
        resume=paused.paused, answers=[Approve(paused.interrupts[0].id)],
    )  # fmt: skip
    assert ran == [{"path": "a.txt", "text": "hi"}]
    assert result.stop_reason is StopReason.END_TURN
    assert result.text == "done: wrote a.txt"
    assert recorder.terminal == ["finish"]
    assert any(isinstance(e, ToolCallResult) and e.result.ok for e in events)


async def test_approve_with_edited_arguments_runs_the_edit() -> None:
    ran: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(ran)]
    _, paused = await run_chat(model, "w", tools=tools, permissions={"ask": ["write"]})
    edit = {"path": "b.txt", "text": "edited"}
    _, result = await run_chat(
        model, tools=tools, permissions={"ask": ["write"]},
        resume=paused.paused, answers=[Approve(paused.interrupts[0].id, edited_args=edit)],
    )  # fmt: skip
    assert ran == [edit]
    assert result.text == "done: wrote b.txt"


@pytest.mark.parametrize(
    ("edit", "permissions", "fragment"),
    [
        ({"path": "b.txt"}, {"ask": ["write"]}, "text"),  # fails the schema
        ({"path": "/etc/passwd", "text": "x"}, {"ask": ["write"], "deny": ["write:/etc/*"]}, "denied"),
    ],
)
async def test_an_edit_the_table_refuses_is_a_typed_error_and_nothing_runs(
    edit: dict[str, Any], permissions: dict[str, Any], fragment: str
) -> None:
    ran: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(ran)]
    _, paused = await run_chat(model, "w", tools=tools, permissions=permissions)
    calls_before = len(model.requests)
    with pytest.raises(InterruptResumeError) as caught:
        await run_chat(
            model, tools=tools, permissions=permissions,
            resume=paused.paused, answers=[Approve(paused.interrupts[0].id, edited_args=edit)],
        )  # fmt: skip
    [issue] = caught.value.issues
    assert issue.code == "invalid_edited_args" and fragment in issue.message
    assert ran == [] and len(model.requests) == calls_before
    # The paused state is unchanged: a valid answer still resumes it.
    _, result = await run_chat(
        model, tools=tools, permissions=permissions, resume=paused.paused, answers=[Approve(paused.interrupts[0].id)]
    )
    assert ran == [{"path": "a.txt", "text": "hi"}] and result.stop_reason is StopReason.END_TURN


async def test_reject_answers_the_call_with_the_message_the_model_reads() -> None:
    ran: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(ran)]
    _, paused = await run_chat(model, "w", tools=tools, permissions={"ask": ["write"]})
    _, result = await run_chat(
        model, tools=tools, permissions={"ask": ["write"]},
        resume=paused.paused, answers=[Reject(paused.interrupts[0].id, "not that file")],
    )  # fmt: skip
    assert ran == []
    assert "not that file" in result.text


async def test_cancel_answers_the_call_cancelled() -> None:
    ran: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(ran)]
    _, paused = await run_chat(model, "w", tools=tools, permissions={"ask": ["write"]})
    _, result = await run_chat(
        model, tools=tools, permissions={"ask": ["write"]},
        resume=paused.paused, answers=[Cancel(paused.interrupts[0].id)],
    )  # fmt: skip
    assert ran == [] and "cancelled" in result.text


async def test_a_tool_that_asks_for_itself_pauses_even_in_bypass() -> None:
    ran: list[dict[str, Any]] = []

    @define_tool(name="deploy", description="deploys", input_schema={"type": "object"},
                 side_effect=SideEffect.NON_IDEMPOTENT, kind=ToolKind.EXECUTE,
                 check_permissions=lambda input: PermissionAsk("deploys to production"))  # fmt: skip
    async def deploy(input: dict[str, Any], ctx: Any) -> str:
        ran.append(input)
        return "deployed"

    _, result = await run_chat(calls_then_echo(("deploy", {})), "ship", tools=[deploy])
    [interrupt] = result.interrupts
    assert interrupt.kind is InterruptKind.APPROVAL and "production" in interrupt.message
    assert ran == []


async def test_while_an_approval_is_pending_no_call_of_its_batch_runs() -> None:
    wrote: list[dict[str, Any]] = []
    read: list[str] = []
    model = calls_then_echo(("read", {}), ("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_read(read), make_write(wrote)]
    _, paused = await run_chat(model, "w", tools=tools, permissions={"ask": ["write"]})
    assert wrote == [] and read == []
    assert [i.tool_name for i in paused.interrupts] == ["write"]
    _, result = await run_chat(
        model, tools=tools, permissions={"ask": ["write"]},
        resume=paused.paused, answers=[Approve(paused.interrupts[0].id)],
    )  # fmt: skip
    assert read == ["read"] and len(wrote) == 1
    assert result.text == "done: contents | wrote a.txt"


# ---------------------------------------------------------------- client tools


CONFIRM = define_client_tool(
    "confirm",
    "asks the user to confirm",
    input_schema={"type": "object", "properties": {"question": {"type": "string"}}},
    output_schema={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
)


async def test_a_client_tool_call_pauses_and_the_continuation_carries_its_result() -> None:
    model = calls_then_echo(("confirm", {"question": "sure?"}))
    _, paused = await run_chat(model, "ask me", tools=[CONFIRM])
    [interrupt] = paused.interrupts
    assert interrupt.kind is InterruptKind.CLIENT_TOOL and interrupt.input == {"question": "sure?"}
    assert interrupt.response_schema == CONFIRM.output_schema
    _, result = await run_chat(
        model, tools=[CONFIRM], resume=paused.paused, answers=[Respond(interrupt.id, {"ok": True})]
    )
    assert result.text == 'done: {"ok": true}'


async def test_a_client_tool_result_must_match_its_output_schema() -> None:
    model = calls_then_echo(("confirm", {"question": "sure?"}))
    _, paused = await run_chat(model, "ask me", tools=[CONFIRM])
    with pytest.raises(InterruptResumeError) as caught:
        await run_chat(
            model, tools=[CONFIRM], resume=paused.paused, answers=[Respond(paused.interrupts[0].id, {"ok": 3})]
        )
    assert [issue.code for issue in caught.value.issues] == ["invalid_tool_output"]


class ScreensClientCalls(ChatMiddleware):
    """Records what on_before_tool_call / on_guard_tool_call saw; decides as told."""

    def __init__(self, before: Any = None, guard: Any = None) -> None:
        self.before, self.guard = before, guard
        self.seen: list[tuple[str, str, dict[str, Any], Any]] = []

    def on_before_tool_call(self, ctx: Any, call: Any) -> Any:
        self.seen.append(("before", call.tool_name, dict(call.args), call.tool))
        return self.before

    def on_guard_tool_call(self, ctx: Any, call: Any) -> Any:
        self.seen.append(("guard", call.tool_name, dict(call.args), call.tool))
        return self.guard


async def test_the_guard_hook_refuses_a_client_tool_call_before_it_reaches_the_client() -> None:
    model = calls_then_echo(("confirm", {"question": "sure?"}))
    screen = ScreensClientCalls(guard=Refuse("client tools are off today"))
    _, result = await run_chat(model, "ask me", tools=[CONFIRM], middleware=[screen])
    assert result.paused is None and result.stop_reason is StopReason.END_TURN
    assert result.text == "done: Error: client tools are off today"
    assert screen.seen == [
        ("before", "confirm", {"question": "sure?"}, None),
        ("guard", "confirm", {"question": "sure?"}, None),
    ]


async def test_the_before_hook_transforms_a_client_tool_call_then_its_schema_checks_it() -> None:
    model = calls_then_echo(("confirm", {"question": "sure?"}))
    screen = ScreensClientCalls(before=TransformArgs({"question": "really sure?"}))
    _, paused = await run_chat(model, "ask me", tools=[CONFIRM], middleware=[screen])
    [interrupt] = paused.interrupts
    assert interrupt.input == {"question": "really sure?"}
    assert screen.seen[-1] == ("guard", "confirm", {"question": "really sure?"}, None)
    # Answered: the hooks are not asked again on the continuation.
    _, result = await run_chat(model, tools=[CONFIRM], middleware=[screen], resume=paused.paused,
                               answers=[Respond(interrupt.id, {"ok": True})])  # fmt: skip
    assert result.text == 'done: {"ok": true}' and len(screen.seen) == 2
    bad = ScreensClientCalls(before=TransformArgs({"question": 3}))
    _, result = await run_chat(model, "ask me", tools=[CONFIRM], middleware=[bad])
    assert result.paused is None and "invalid input for tool 'confirm'" in result.text
    assert [seen[0] for seen in bad.seen] == ["before"]  # the guard sees only checked input


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({1, 2}, "the input.extra is not JSON: set"),
        ((1, 2), "the input.extra is not JSON: tuple"),
        (math.nan, "the input.extra is not a finite number: nan"),
        (1 << 3000, "the input.extra is an integer too large for JSON"),
    ],
    ids=["set", "tuple", "nan", "huge-int"],
)
@pytest.mark.parametrize("journalled", [False, True])
async def test_a_client_tool_call_a_hook_gave_non_json_input_is_refused_as_not_json(
    value: Any, problem: str, journalled: bool
) -> None:
    """The model's arguments are parsed JSON, but a before hook may replace them with anything: the
    client tool's schema check says it is no JSON (its validator reads a set or tuple as an array,
    NaN or a huge int as null, and passed them), where the pause failed the run on it."""
    from trio_agent.journal import MemoryStore, open_journal

    model = calls_then_echo(("confirm", {"question": "sure?"}))
    screen = ScreensClientCalls(before=TransformArgs({"question": "q", "extra": value}))
    async with open_journal(MemoryStore(), session_id="s") as journal:
        _, result = await run_chat(
            model, "ask me", tools=[CONFIRM], middleware=[screen], journal=journal if journalled else None
        )
    assert result.paused is None and result.stop_reason is StopReason.END_TURN
    assert result.text.startswith("done: Error: invalid input for tool 'confirm': at <root>: ")
    assert problem in result.text
    assert [seen[0] for seen in screen.seen] == ["before"]  # the guard sees only checked input
    [line] = CONFIRM.input_errors({"question": "q", "extra": value})
    assert line.startswith("at <root>: ") and problem in line


def test_an_interrupt_payload_that_is_no_json_is_refused_when_the_question_is_made() -> None:
    # The same check as a client tool's input: an open payload_schema passed a set or NaN.
    question = define_interrupt("pick", payload_schema={"type": "object"})
    for payload, problem in (({"a": {1}}, "a is not JSON: set"), ({"a": math.nan}, "a is not a finite number")):
        with pytest.raises(ConfigError, match="interrupt 'pick': invalid payload: at <root>: ") as caught:
            question.request("k", "which?", payload=payload)
        assert problem in str(caught.value)


async def test_the_before_hook_may_answer_a_client_tool_call_itself() -> None:
    model = calls_then_echo(("confirm", {"question": "sure?"}))
    screen = ScreensClientCalls(before=Skip({"ok": True}))
    _, result = await run_chat(model, "ask me", tools=[CONFIRM], middleware=[screen])
    assert result.paused is None and result.text == 'done: {"ok": true}'


PING = define_client_tool("ping", "pings the user", input_schema={"type": "object"})


class SkipsConfirmWithASet(ChatMiddleware):
    def on_before_tool_call(self, ctx: Any, call: Any) -> Any:
        return Skip({1, 2}) if call.tool_name == "confirm" else None


async def test_a_client_call_skipped_with_a_non_json_result_fails_alone_and_the_pause_serialises() -> None:
    model = calls_then_echo(("confirm", {"question": "sure?"}), ("ping", {}))
    options: dict[str, Any] = {"tools": [CONFIRM, PING], "middleware": [SkipsConfirmWithASet()]}
    _, paused = await run_chat(model, "ask me", **options)
    [interrupt] = paused.interrupts  # the other call still goes to the client
    assert interrupt.tool_name == "ping"
    data = json.loads(json.dumps(paused.paused.to_json()))  # the pause is JSON
    [refused] = data["state"]["refused"].values()
    assert refused["error"]["code"] == "invalid_result"
    _, result = await run_chat(model, resume=PausedRun.from_json(data), answers=[Respond(interrupt.id, {})], **options)
    assert result.text.startswith("done: Error: before stage") and "non-JSON result" in result.text
    assert result.text.endswith(" | {}")


class LosesALease(ChatMiddleware):
    """A guard stage that raises LeaseLostError: of a store it drives, or after *journal*'s own lease is lost."""

    def __init__(self, journal: Any = None) -> None:
        self.journal = journal

    def on_guard_tool_call(self, ctx: Any, call: Any) -> Any:
        if self.journal is not None:
            self.journal._lose(LeaseLostError("taken over"))
        raise LeaseLostError("another store's lease")


async def test_a_lost_lease_from_a_client_call_stage_refuses_that_call_unless_it_is_the_journals() -> None:
    from trio_agent.journal import MemoryStore, open_journal

    model = calls_then_echo(("confirm", {"question": "sure?"}))
    async with open_journal(MemoryStore(), session_id="s") as journal:
        _, result = await run_chat(model, "ask me", tools=[CONFIRM], middleware=[LosesALease()], journal=journal)
    assert result.paused is None and "guard stage" in result.text and "another store's lease" in result.text
    with pytest.raises(LeaseLostError):
        async with open_journal(MemoryStore(), session_id="s") as journal:
            await run_chat(model, "ask me", tools=[CONFIRM], middleware=[LosesALease(journal)], journal=journal)


# ---------------------------------------------------------------- generic interrupts at the boundaries

CHOICE = define_interrupt(
    "choose",
    payload_schema={"type": "object", "properties": {"options": {"type": "array"}}},
    response_schema={"type": "string", "enum": ["red", "blue"]},
)


class AskAt(ChatMiddleware):
    """Asks once at *phase* (not on the continuation) and remembers the answer."""

    interrupts = (CHOICE,)

    def __init__(self, phase: Phase, resume: ToolResume | None = None) -> None:
        self.phase = phase
        self.resume = resume
        self.seen: list[Any] = []
        self.phases: list[Phase] = []

    def on_interrupt_boundary(self, ctx: Any) -> Any:
        self.phases.append(ctx.phase)
        if ctx.phase is self.phase and ctx.parent_run_id is None:
            return [CHOICE.request("color", "pick a color", payload={"options": ["red", "blue"]})]
        return None

    def on_interrupt_resolution(self, ctx: Any, resolutions: Any) -> Any:
        self.seen.extend((r.status, r.response) for r in resolutions.of(CHOICE))
        return self.resume


@pytest.mark.parametrize("phase", [Phase.BEFORE_MODEL, Phase.AFTER_MODEL, Phase.BEFORE_TOOLS, Phase.AFTER_TOOLS])
async def test_a_generic_interrupt_pauses_at_each_boundary_and_resumes_there(phase: Phase) -> None:
    ran: list[str] = []
    model = calls_then_echo(("read", {}))
    asker = AskAt(phase)
    tools = [make_read(ran)]
    _, paused = await run_chat(model, "go", tools=tools, middleware=[asker])
    assert paused.stop_reason is StopReason.INTERRUPTED and paused.paused.state.phase is phase
    [interrupt] = paused.interrupts
    assert interrupt.kind is InterruptKind.GENERIC and interrupt.payload == {"options": ["red", "blue"]}
    model_calls = len(model.requests)
    assert model_calls == (0 if phase is Phase.BEFORE_MODEL else 1)
    assert ran == ([] if phase is not Phase.AFTER_TOOLS else ["read"])
    _, result = await run_chat(model, tools=tools, middleware=[asker], resume=paused.paused,
                               answers=[Respond(interrupt.id, "blue")])  # fmt: skip
    assert asker.seen == [("resolved", "blue")]
    assert result.stop_reason is StopReason.END_TURN and result.text == "done: contents"
    assert ran == ["read"]  # the call ran exactly once, wherever the pause was
    assert len(model.requests) == 2


async def test_the_boundary_hooks_run_at_all_four_phases_in_order() -> None:
    asker = AskAt(Phase.INIT)  # never asks
    await run_chat(calls_then_echo(("read", {})), "go", tools=[make_read([])], middleware=[asker])
    assert asker.phases == [
        Phase.BEFORE_MODEL, Phase.AFTER_MODEL, Phase.BEFORE_TOOLS, Phase.AFTER_TOOLS,
        Phase.BEFORE_MODEL, Phase.AFTER_MODEL,
    ]  # fmt: skip


async def test_stop_from_the_resolution_finishes_the_run_without_a_model_call() -> None:
    model = calls_then_echo(("read", {}))
    ran: list[str] = []
    recorder = Recorder()
    _, paused = await run_chat(model, "go", tools=[make_read(ran)], middleware=[AskAt(Phase.BEFORE_TOOLS)])
    asker = AskAt(Phase.BEFORE_TOOLS, resume=ToolResume.STOP)
    _, result = await run_chat(
        model, tools=[make_read(ran)], middleware=[asker, recorder],
        resume=paused.paused, answers=[Respond(paused.interrupts[0].id, "red")],
    )  # fmt: skip
    assert ran == [] and len(model.requests) == 1
    assert result.stop_reason is StopReason.VETOED and recorder.terminal == ["finish"]
    # The pending call is answered, so the history stays valid for another run.
    assert isinstance(result.messages[-1], ToolResultMessage) and "stopped" in result.messages[-1].content


async def test_cancel_from_the_resolution_answers_every_pending_call_cancelled() -> None:
    model = calls_then_echo(("read", {}))
    ran: list[str] = []
    _, paused = await run_chat(model, "go", tools=[make_read(ran)], middleware=[AskAt(Phase.BEFORE_TOOLS)])
    _, result = await run_chat(
        model, tools=[make_read(ran)], middleware=[AskAt(Phase.BEFORE_TOOLS, resume=ToolResume.CANCEL)],
        resume=paused.paused, answers=[Respond(paused.interrupts[0].id, "red")],
    )  # fmt: skip
    assert ran == [] and result.text.startswith("done: ") and "cancelled by the user" in result.text


async def test_a_mixed_batch_holds_approvals_then_client_tools_then_questions() -> None:
    wrote: list[dict[str, Any]] = []
    model = calls_then_echo(("confirm", {"question": "?"}), ("write", {"path": "a", "text": "b"}))
    tools = [make_write(wrote), CONFIRM]
    kwargs: dict[str, Any] = {
        "tools": tools,
        "permissions": {"ask": ["write"]},
        "middleware": [AskAt(Phase.BEFORE_TOOLS)],
    }
    _, paused = await run_chat(model, "go", **kwargs)
    kinds = [i.kind for i in paused.interrupts]
    assert kinds == [InterruptKind.APPROVAL, InterruptKind.CLIENT_TOOL, InterruptKind.GENERIC]
    approval, client, question = paused.interrupts
    _, result = await run_chat(
        model, resume=paused.paused,
        answers=[Respond(question.id, "red"), Respond(client.id, {"ok": False}), Approve(approval.id)], **kwargs,
    )  # fmt: skip
    assert wrote == [{"path": "a", "text": "b"}]
    assert result.text == 'done: {"ok": false} | wrote a'


# ---------------------------------------------------------------- bad continuations


async def test_every_bad_answer_is_named_in_one_error_and_nothing_runs() -> None:
    wrote: list[dict[str, Any]] = []
    model = calls_then_echo(("confirm", {"question": "?"}), ("write", {"path": "a", "text": "b"}))
    tools = [make_write(wrote), CONFIRM]
    _, paused = await run_chat(model, "go", tools=tools, permissions={"ask": ["write"]})
    approval, client = paused.interrupts
    recorder = Recorder()
    events: list[Any] = []
    with pytest.raises(InterruptResumeError) as caught:
        bad = [Respond(approval.id, 1), Approve("approval_nope"), Cancel(approval.id)]
        async with chat(model, tools=tools, permissions={"ask": ["write"]}, middleware=[recorder],
                        resume=paused.paused, answers=bad) as run:  # fmt: skip
            events = [event async for event in run]
            await run.result()
    codes = {(issue.interrupt_id, issue.code) for issue in caught.value.issues}
    assert codes == {
        (approval.id, "wrong_answer"), ("approval_nope", "unknown_interrupt"),
        (approval.id, "duplicate"), (client.id, "missing"),
    }  # fmt: skip
    assert wrote == [] and len(model.requests) == 1
    assert isinstance(events[-1], RunError) and events[-1].code == caught.value.code
    assert recorder.terminal == ["error"]


async def test_a_signed_state_round_trips_through_json_and_a_tampered_one_is_refused() -> None:
    wrote: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(wrote)]
    _, paused = await run_chat(model, "w", tools=tools, permissions={"ask": ["write"]}, signing_key=KEY)
    wire = json.dumps(paused.paused.to_json())
    answers = answers_to_json([Approve(paused.interrupts[0].id)])

    forged = json.loads(wire)
    forged["state"]["pending_calls"][0]["arguments"] = json.dumps({"path": "/etc/passwd", "text": "x"})
    for state, key in [(forged, KEY), (json.loads(wire), b"x" * 32)]:
        with pytest.raises(InterruptResumeError) as caught:
            await run_chat(model, tools=tools, permissions={"ask": ["write"]}, signing_key=key,
                           resume=PausedRun.from_json(state), answers=answers_from_json(answers))  # fmt: skip
        assert caught.value.code == "tampered"
    assert wrote == []
    state = PausedRun.from_json(json.loads(wire))
    _, result = await run_chat(model, tools=tools, permissions={"ask": ["write"]}, signing_key=KEY,
                               resume=state, answers=answers_from_json(answers))  # fmt: skip
    assert wrote == [{"path": "a.txt", "text": "hi"}] and result.stop_reason is StopReason.END_TURN


@pytest.mark.parametrize("key", [b"short", "a string of thirty-two characters", 5, b""], ids=repr)
async def test_a_bad_signing_key_is_refused_before_anything_runs(key: Any) -> None:
    # It was first checked when the run paused: the model had been called and earlier tools had
    # run, and the paused state (the only way to go on) was lost to the ConfigError.
    wrote: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    with pytest.raises(ConfigError, match="signing_key must be bytes"):
        await run_chat(model, "w", tools=[make_write(wrote)], permissions={"ask": ["write"]}, signing_key=key)
    assert model.requests == [] and wrote == []


async def test_create_app_refuses_a_bad_signing_key() -> None:
    pytest.importorskip("starlette")
    from trio_agent.web import create_app, local_only

    with pytest.raises(ConfigError, match="signing_key must be bytes"):
        create_app(TestModel(), auth=local_only, signing_key=b"short")


@pytest.mark.parametrize(
    "payload",
    [{"state": {}}, [], "x", {"run_id": 1}],
)
def test_a_malformed_paused_state_is_a_typed_error(payload: Any) -> None:
    with pytest.raises(InterruptResumeError) as caught:
        PausedRun.from_json(payload)
    assert caught.value.code == "invalid_payload"


@pytest.mark.parametrize(
    "payload", [{"type": "approve"}, [{"type": "maybe", "interrupt_id": "a"}], [{"type": "reject", "interrupt_id": 3}]]
)
def test_malformed_answers_are_a_typed_error(payload: Any) -> None:
    with pytest.raises(InterruptResumeError):
        answers_from_json(payload)


def test_interrupt_definitions_check_their_payloads_and_ids() -> None:
    with pytest.raises(ConfigError):
        define_interrupt("x")  # neither schema
    with pytest.raises(ConfigError):
        CHOICE.request("k", "m", payload={"options": "not a list"})
    with pytest.raises(ConfigError):
        define_interrupt("y", response_schema={"type": "string"}).request("k", "m", payload={"a": 1})


async def test_duplicate_definition_ids_and_unregistered_definitions_are_refused() -> None:
    other = define_interrupt("choose", response_schema={"type": "string"})
    with pytest.raises(ConfigError, match="duplicate interrupt definition id 'choose'"):
        await run_chat(TestModel(default=Reply(text="x")), "go", interrupts=[other], middleware=[AskAt(Phase.INIT)])

    class Rogue(ChatMiddleware):
        def on_interrupt_boundary(self, ctx: Any) -> Any:
            return [other.request("k", "m")]

    with pytest.raises(MiddlewareError, match="not registered"):
        await run_chat(TestModel(default=Reply(text="x")), "go", middleware=[Rogue()])


@given(st.lists(st.sampled_from([None, *ToolResume])))
def test_the_most_restrictive_resolution_wins(values: list[ToolResume | None]) -> None:
    ranked = [ToolResume.CONTINUE, ToolResume.CANCEL, ToolResume.STOP]
    expected = max((v for v in values if v is not None), key=ranked.index, default=ToolResume.CONTINUE)
    assert most_restrictive(values) is expected


async def test_two_hundred_paused_runs_resume_in_random_order() -> None:
    wrote: list[dict[str, Any]] = []
    tools = [make_write(wrote)]

    def respond(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            return Reply(text="ok " + request.messages[-1].content)
        return Reply(tool_calls=[("write", {"path": request.messages[0].content, "text": "x"})])

    model = TestModel(respond=respond)
    paused: dict[str, Any] = {}

    async def start(name: str) -> None:
        _, result = await run_chat(model, name, tools=tools, permissions={"ask": ["write"]}, signing_key=KEY)
        paused[name] = result.paused

    names = [f"f{i}" for i in range(200)]
    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(start, name)
    assert wrote == [] and len(paused) == 200
    order = names[:]
    random.Random(14).shuffle(order)
    texts: dict[str, str] = {}

    async def finish(name: str) -> None:
        state = PausedRun.from_json(json.loads(json.dumps(paused[name].to_json())))
        _, result = await run_chat(model, tools=tools, permissions={"ask": ["write"]}, signing_key=KEY,
                                   resume=state, answers=[Approve(state.interrupts[0].id)])  # fmt: skip
        texts[name] = result.text

    async with trio.open_nursery() as nursery:
        for name in order:
            nursery.start_soon(finish, name)
    assert texts == {name: f"ok wrote {name}" for name in names}
    assert sorted(item["path"] for item in wrote) == sorted(names)


async def test_chat_checks_the_model_adapters_required_capabilities_first() -> None:
    from trio_agent.lifecycle import CapabilityError, create_capability

    sandbox = create_capability("sandbox")
    model = TestModel(default=Reply(text="x"))
    model.requires = (sandbox,)  # type: ignore[attr-defined]
    with pytest.raises(CapabilityError, match=r"Adapter .* requires capability 'sandbox'"):
        await run_chat(model, "go")
    assert model.requests == []


async def test_a_journal_records_the_pause_and_refuses_a_replayed_continuation() -> None:
    from trio_agent.journal import InterruptsResolved, MemoryStore, RunPaused, open_journal

    ran: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(ran)]
    store = MemoryStore()
    async with open_journal(store, session_id="s") as journal:
        kwargs: dict[str, Any] = {"tools": tools, "permissions": {"ask": ["write"]}, "journal": journal}
        _, paused = await run_chat(model, "w", **kwargs)
        answers = [Approve(paused.interrupts[0].id)]
        _, result = await run_chat(model, resume=paused.paused, answers=answers, **kwargs)
        with pytest.raises(InterruptResumeError) as caught:
            await run_chat(model, resume=paused.paused, answers=answers, **kwargs)
        events = [envelope.event for envelope in await store.read(journal.stream_id())]
    assert caught.value.code == "stale" and "not paused" in str(caught.value)
    assert result.text == "done: wrote a.txt" and ran == [{"path": "a.txt", "text": "hi"}]  # ran once
    [pause] = [e for e in events if isinstance(e, RunPaused)]
    [resolved] = [e for e in events if isinstance(e, InterruptsResolved)]
    assert pause.request_id == paused.paused.run_id == resolved.request_id
    assert pause.state["pending_calls"][0]["id"] == paused.interrupts[0].tool_call_id


async def test_a_signed_state_needs_its_key_and_an_approval_needs_the_permission_table() -> None:
    wrote: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(wrote)]
    _, paused = await run_chat(model, "w", tools=tools, permissions={"ask": ["write"]}, signing_key=KEY)
    answers = [Approve(paused.interrupts[0].id)]
    with pytest.raises(InterruptResumeError, match="pass its signing_key"):
        await run_chat(model, tools=tools, permissions={"ask": ["write"]}, resume=paused.paused, answers=answers)
    with pytest.raises(InterruptResumeError, match="permissions="):
        await run_chat(model, tools=tools, signing_key=KEY, resume=paused.paused, answers=answers)
    assert wrote == []


async def test_a_continuation_of_a_run_that_did_not_pause_is_refused_by_the_journal() -> None:
    from trio_agent.journal import MemoryStore, open_journal

    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write([])]
    async with open_journal(MemoryStore(), session_id="s") as journal:
        kwargs: dict[str, Any] = {"tools": tools, "permissions": {"ask": ["write"]}, "journal": journal}
        _, paused = await run_chat(model, "w", **kwargs)
        _, finished = await run_chat(TestModel(default=Reply(text="plain")), "hi", journal=journal)
        assert finished.stop_reason is StopReason.END_TURN
        finished_run_id = _run_id_of(journal, 2)
        forged = PausedRun(finished_run_id, paused.paused.thread_id, "root", paused.paused.state)
        with pytest.raises(InterruptResumeError) as caught:
            await run_chat(model, resume=forged, answers=[Approve(paused.interrupts[0].id)], **kwargs)
    assert caught.value.code == "stale" and finished_run_id in str(caught.value) and "not paused" in str(caught.value)


def _run_id_of(journal: Any, nth: int) -> str:
    """The request id of the *nth* request on the journal's root stream."""
    state = journal.projection()._s
    requests = sorted([*state.requests.values(), *state.ended.values()], key=lambda record: record.seq)
    return str(requests[nth - 1].request_id)


def saving_tool(ran: list[dict[str, Any]]) -> Any:
    """A write tool whose affected path is its ``path``; each input it ran with goes to *ran*."""

    @define_tool(name="save", description="saves", input_schema=WRITE_SCHEMA, side_effect=SideEffect.IDEMPOTENT,
                 kind=ToolKind.WRITE, affected_paths=lambda input: [input["path"]])  # fmt: skip
    async def save(input: dict[str, Any], ctx: Any) -> str:
        ran.append(input)
        return "saved"

    return save


async def test_an_edit_that_leaves_the_workspace_is_refused_by_the_path_policy(tmp_path: Any) -> None:
    ran: list[dict[str, Any]] = []
    save = saving_tool(ran)

    model = calls_then_echo(("save", {"path": "notes.txt", "text": "hi"}))
    kwargs: dict[str, Any] = {"tools": [save], "permissions": {"ask": ["save"]}, "workspace_roots": [tmp_path]}
    _, paused = await run_chat(model, "save", **kwargs)
    edit = Approve(paused.interrupts[0].id, edited_args={"path": "/etc/passwd", "text": "x"})
    with pytest.raises(InterruptResumeError) as caught:
        await run_chat(model, resume=paused.paused, answers=[edit], **kwargs)
    assert caught.value.code == "invalid_edited_args" and "/etc/passwd" in str(caught.value)
    assert ran == []
    _, result = await run_chat(model, resume=paused.paused, answers=[Approve(paused.interrupts[0].id)], **kwargs)
    assert ran == [{"path": "notes.txt", "text": "hi"}] and result.text == "done: saved"


async def test_a_single_workspace_root_is_one_root_and_no_root_is_a_config_error(tmp_path: Any) -> None:
    ran: list[dict[str, Any]] = []
    save = saving_tool(ran)

    # One root given as a string (not split into characters, which made "/" a root).
    model = calls_then_echo(("save", {"path": "/etc/passwd", "text": "x"}))
    _, result = await run_chat(model, "save", tools=[save], permission_mode="bypass", workspace_roots=str(tmp_path))
    assert ran == [] and "outside the workspace" in result.text
    with pytest.raises(ConfigError, match="at least one workspace root"):
        await run_chat(calls_then_echo(), "hi", tools=[save], workspace_roots=[])


@pytest.mark.parametrize("signature", ["é" * 64, "\udcff" * 64, "0" * 64, "short"])
async def test_a_forged_signature_of_any_text_is_refused_as_tampered(signature: str) -> None:
    wrote: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(wrote)]
    _, paused = await run_chat(model, "w", tools=tools, permissions={"ask": ["write"]}, signing_key=KEY)
    data = paused.paused.to_json()
    data["signature"] = signature
    with pytest.raises(InterruptResumeError) as caught:
        await run_chat(model, tools=tools, permissions={"ask": ["write"]}, signing_key=KEY,
                       resume=PausedRun.from_json(data), answers=[Approve(paused.interrupts[0].id)])  # fmt: skip
    assert caught.value.code == "tampered" and wrote == []


@pytest.mark.parametrize("answers", [None, 5, "approve", {"approval_call_1": "approve"}, iter(())])
async def test_answers_that_are_not_a_list_are_an_invalid_payload(answers: Any) -> None:
    wrote: list[dict[str, Any]] = []
    model = calls_then_echo(("write", {"path": "a.txt", "text": "hi"}))
    tools = [make_write(wrote)]
    _, paused = await run_chat(model, "w", tools=tools, permissions={"ask": ["write"]})
    with pytest.raises(InterruptResumeError) as caught:
        await chat(model, tools=tools, permissions={"ask": ["write"]}, resume=paused.paused, answers=answers)
    assert [issue.code for issue in caught.value.issues] == ["invalid_payload"]
    assert "answers must be a list" in str(caught.value) and wrote == []


class _Plain(ChatMiddleware):
    pass


class _OwnsOneInterrupt(ChatMiddleware):
    interrupts = CHOICE  # type: ignore[assignment]  # the tuple forgotten


@pytest.mark.parametrize(
    ("options", "error", "names"),
    [
        ({"middleware": _Plain()}, MiddlewareShapeError, "middleware must be a list"),
        ({"interrupts": CHOICE}, ConfigError, "interrupts must be a list"),
        ({"middleware": [_OwnsOneInterrupt()]}, MiddlewareShapeError, "interrupts of middleware #0"),
    ],
)
async def test_middleware_and_interrupts_of_the_wrong_shape_are_typed_errors(
    options: dict[str, Any], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=names):
        await chat(TestModel(default=Reply(text="hi")), "go", **options)
    session_options = {"lifecycle" if key == "middleware" else key: value for key, value in options.items()}
    with pytest.raises(error, match=names):
        async with open_session(provider=TestModel(default=Reply(text="hi")), **session_options):
            pass
