"""Human in the loop on sessions: a request that pauses, survives a restart and resumes (issue 14)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.session_helpers import results
from trio_agent import DoneEvent, PausedReply, SessionPausedError, SideEffect, ToolKind, define_tool, open_session
from trio_agent.journal import InterruptsResolved, MemoryStore, RunPaused, read_conversation
from trio_agent.lifecycle import (
    Approve,
    Cancel,
    ChatMiddleware,
    InterruptKind,
    InterruptResumeError,
    Phase,
    Reject,
    Respond,
    define_client_tool,
    define_interrupt,
)
from trio_agent.models import AssistantMessage, ToolCallPart, ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel

ROOT = Path(__file__).resolve().parents[1]
PAUSE_WORKER = ROOT / "tests" / "session_crash" / "pause_worker.py"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
    "required": ["path", "text"],
}
CONFIRM = define_client_tool(
    "confirm",
    "asks the user",
    input_schema={"type": "object"},
    output_schema={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
)


def make_write(ran: list[dict[str, Any]]) -> Any:
    @define_tool(
        name="write", description="writes", input_schema=SCHEMA, side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.WRITE,
    )  # fmt: skip
    async def write(input: dict[str, Any], ctx: Any) -> str:
        ran.append(dict(input))
        return f"wrote {input['path']}"

    return write


def echo_model(*calls: tuple[str, dict[str, Any]]) -> TestModel:
    def respond(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            answers = [m.content for m in request.messages if isinstance(m, ToolResultMessage)]
            return Reply(text="done: " + " | ".join(answers))
        return Reply(tool_calls=list(calls))

    return TestModel(respond=respond)


def session_of(model: TestModel, ran: list[dict[str, Any]], **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "provider": model,
        "tools": [make_write(ran)],
        "permissions": {"ask": ["write"]},
        "permission_asks": "interrupt",
        **kwargs,
    }
    return open_session(**options)


async def test_a_request_pauses_for_an_approval_and_resume_runs_the_call() -> None:
    ran: list[dict[str, Any]] = []
    async with session_of(echo_model(("write", {"path": "a", "text": "x"})), ran) as session:
        reply = await session.send("write a")
        assert isinstance(reply, PausedReply) and reply == ""
        [interrupt] = reply.interrupts
        assert interrupt.kind is InterruptKind.APPROVAL and interrupt.tool_name == "write"
        assert session.paused is not None and session.paused.interrupts == reply.interrupts
        assert ran == []
        with pytest.raises(SessionPausedError, match="resume"):
            await session.send("something else")
        answer = await session.resume([Approve(interrupt.id)])
        assert answer == "done: wrote a" and not isinstance(answer, PausedReply)
        assert ran == [{"path": "a", "text": "x"}] and session.paused is None
        with pytest.raises(InterruptResumeError) as caught:  # a second continuation of one pause
            await session.resume([Approve(interrupt.id)])
        assert caught.value.code == "stale"
        # The session goes on: the model asks again, and that pause is cancelled.
        again = await session.send("again")
        assert isinstance(again, PausedReply) and again.interrupts[0].id != interrupt.id
        assert "cancelled" in await session.resume([Cancel(again.interrupts[0].id)])
        store_messages = await read_conversation(session.journal.store, session.session_id)
    replies = [m for m in store_messages if isinstance(m, AssistantMessage)]
    calls = [part.id for m in replies for part in m.parts if isinstance(part, ToolCallPart)]
    answers = [m.tool_call_id for m in store_messages if isinstance(m, ToolResultMessage)]
    assert sorted(calls) == sorted(answers)  # every call answered exactly once in the rebuilt history


@pytest.mark.parametrize(
    ("answer", "expected_ran", "fragment"),
    [
        (lambda i: Approve(i, edited_args={"path": "b", "text": "y"}), [{"path": "b", "text": "y"}], "wrote b"),
        (lambda i: Reject(i, "not there"), [], "not there"),
        (lambda i: Cancel(i), [], "cancelled by the user"),
    ],
)
async def test_approve_with_edits_reject_and_cancel_on_a_session(
    answer: Any, expected_ran: list[dict[str, Any]], fragment: str
) -> None:
    ran: list[dict[str, Any]] = []
    async with session_of(echo_model(("write", {"path": "a", "text": "x"})), ran) as session:
        reply = await session.send("write a")
        text = await session.resume([answer(reply.interrupts[0].id)])
        history = await read_conversation(session.journal.store, session.session_id)
    assert ran == expected_ran and fragment in text
    # The rebuilt history answers the call the way the live run did.
    [result] = [m for m in history if isinstance(m, ToolResultMessage)]
    assert fragment in result.content


@pytest.mark.parametrize(
    "edited",
    [{"path": "a", "text": float("inf")}, {"path": "a", "text": json.loads("[" * 250 + "]" * 250)}],
    ids=["not finite", "too deep"],
)
async def test_answers_no_journal_can_keep_are_refused_and_the_session_stays_paused(edited: dict[str, Any]) -> None:
    # They passed the answer check and failed the continuation when it recorded them: the
    # request ended failed instead of the resume being refused with the pause kept.
    ran: list[dict[str, Any]] = []
    async with session_of(echo_model(("write", {"path": "a", "text": "x"})), ran) as session:
        reply = await session.send("write a")
        [interrupt] = reply.interrupts
        with pytest.raises(InterruptResumeError) as caught:
            await session.resume([Approve(interrupt.id, edited_args=edited)])
        [issue] = [issue for issue in caught.value.issues if issue.code == "invalid_payload"]
        assert issue.interrupt_id == interrupt.id and f"answers.{interrupt.id}.edited_args" in issue.message
        assert session.paused is not None and ran == []
        assert await session.resume([Approve(interrupt.id)]) == "done: wrote a"
    assert ran == [{"path": "a", "text": "x"}]


@pytest.mark.parametrize("answers", [None, "approve", {"approval_call_1": "approve"}, iter(())])
async def test_answers_that_are_not_a_list_are_refused_as_chat_refuses_them(answers: Any) -> None:
    ran: list[dict[str, Any]] = []
    async with session_of(echo_model(("write", {"path": "a", "text": "x"})), ran) as session:
        reply = await session.send("write a")
        with pytest.raises(InterruptResumeError) as caught:
            await session.resume(answers)
        assert [(issue.code, issue.message) for issue in caught.value.issues] == [
            ("invalid_payload", "answers must be a list")
        ]
        assert session.paused is not None and ran == []
        assert await session.resume([Approve(reply.interrupts[0].id)]) == "done: wrote a"


async def test_a_mixed_batch_of_an_approval_a_client_tool_and_a_question_on_a_session() -> None:
    choice = define_interrupt("choice", response_schema={"type": "string"})

    class Ask(ChatMiddleware):
        def on_interrupt_boundary(self, ctx: Any) -> Any:
            if ctx.phase is Phase.BEFORE_TOOLS and ctx.parent_run_id is None:
                return [choice.request("c", "which?")]
            return None

    ran: list[dict[str, Any]] = []
    model = echo_model(("confirm", {}), ("write", {"path": "a", "text": "x"}))
    async with session_of(
        model, ran, tools=[make_write(ran), CONFIRM], lifecycle=[Ask()], interrupts=[choice]
    ) as session:
        reply = await session.send("go")
        kinds = [i.kind for i in reply.interrupts]
        assert kinds == [InterruptKind.APPROVAL, InterruptKind.CLIENT_TOOL, InterruptKind.GENERIC]
        approval, client, question = reply.interrupts
        with pytest.raises(InterruptResumeError) as caught:
            await session.resume([Approve(approval.id), Respond(client.id, {"ok": "yes"})])
        assert {i.code for i in caught.value.issues} == {"invalid_tool_output", "missing"}
        assert session.paused is not None and ran == []  # still paused, nothing ran
        answers = [Approve(approval.id), Respond(client.id, {"ok": True}), Respond(question.id, "x")]
        text = await session.resume(answers)
    assert text == 'done: {"ok": true} | wrote a' and ran == [{"path": "a", "text": "x"}]


async def test_a_stream_ends_paused_with_the_questions_on_its_done_event() -> None:
    ran: list[dict[str, Any]] = []
    async with session_of(echo_model(("write", {"path": "a", "text": "x"})), ran) as session:
        async with session.stream("write a") as events:
            seen = [event async for event in events]
        done = seen[-1]
        assert isinstance(done, DoneEvent) and done.stop_reason == "interrupted"
        assert [i.id for i in done.interrupts] == [i.id for i in session.paused.interrupts]


async def test_a_paused_session_survives_a_clean_close_and_resumes_in_a_new_life(tmp_path: Path) -> None:
    ran: list[dict[str, Any]] = []
    journal = tmp_path / "s.db"
    model = echo_model(("write", {"path": "a", "text": "x"}))
    async with session_of(model, ran, journal=str(journal), session_id="s") as session:
        reply = await session.send("write a")
        asked = reply.interrupts
    async with session_of(model, ran, journal=str(journal), session_id="s") as session:
        assert session.paused is not None and session.paused.interrupts == asked
        # Recovery treated the paused call as not started: nothing was decided or run for it.
        assert session.recovery is None or not session.recovery.to_execute
        text = await session.resume([Approve(asked[0].id)])
        events = [e.event for e in await session.journal.store.read(session.journal.stream_id())]
    assert text == "done: wrote a" and ran == [{"path": "a", "text": "x"}]
    assert [type(e) for e in events if isinstance(e, RunPaused | InterruptsResolved)] == [RunPaused, InterruptsResolved]


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_a_paused_reply_with_a_refused_call_reads_back_and_resumes_as_it_ran(tmp_path: Path, where: str) -> None:
    # The journal's fold answered the refused call while the pause was open: the history read
    # back (and a reopened session's) held an answer the live one did not, and a resume after a
    # reopen answered that call twice (the continuation answers every call of the reply).
    ran: list[dict[str, Any]] = []
    journal: Any = MemoryStore() if where == "memory" else str(tmp_path / "s.db")
    model = echo_model(("nope", {}), ("write", {"path": "a", "text": "x"}))
    async with session_of(model, ran, journal=journal, session_id="s") as session:
        reply = await session.send("go")
        asked = reply.interrupts
        live = list(session.messages())
        store = session.journal.store
        assert [type(m) for m in live] == [UserMessage, AssistantMessage]  # nothing answered yet
        assert await read_conversation(store, "s") == live
    async with session_of(model, ran, journal=journal, session_id="s") as session:
        assert list(session.messages()) == live
        text = await session.resume([Approve(asked[0].id)])
        history = list(session.messages())
        assert await read_conversation(session.journal.store, "s") == history
    assert ran == [{"path": "a", "text": "x"}]
    assert text == "done: Error: unknown tool 'nope' (available: write) | wrote a"
    calls = [part.id for part in live[1].parts if isinstance(part, ToolCallPart)]
    assert [m.tool_call_id for m in results(model.requests[-1])] == calls  # each once, in call order
    assert [m.tool_call_id for m in history if isinstance(m, ToolResultMessage)] == calls


class EndsTheContinuation(ChatMiddleware):
    """Its ``on_start`` ends the continuation, after the journal took the answers and before the
    tool phase: it fails, or it cancels *scope* (the caller's, around ``resume``)."""

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None

    async def on_start(self, ctx: Any) -> None:
        if ctx.parent_run_id is None:
            return
        if self.scope is None:
            raise RuntimeError("on_start failed")
        self.scope.cancel()
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize("where", ["memory", "sqlite"])
@pytest.mark.parametrize("ends", ["hook", "cancel"])
async def test_a_continuation_that_ends_before_its_tool_phase_answers_its_calls_as_the_journal_does(
    tmp_path: Path, where: str, ends: str
) -> None:
    # The journal answers a rejected call (and a refused call of the paused reply) with the
    # continuation's interrupts_resolved; the live history answered every call of a continuation
    # that failed or was cancelled before its tool phase "no result was recorded (interrupted)",
    # so the next request's model read something else than a reopened session would.
    ran: list[dict[str, Any]] = []
    journal: Any = MemoryStore() if where == "memory" else str(tmp_path / "s.db")
    model = echo_model(("write", {"path": "a", "text": "x"}), ("nope", {}), ("write", {"path": "b", "text": "y"}))
    ender = EndsTheContinuation()
    async with session_of(model, ran, journal=journal, session_id="s", lifecycle=[ender]) as session:
        reply = await session.send("go")
        first, second = reply.interrupts
        answers = [Reject(first.id, "not that one"), Approve(second.id)]
        if ends == "hook":
            with pytest.raises(Exception, match="on_start failed"):
                await session.resume(answers)
        else:
            with trio.CancelScope() as ender.scope:
                await session.resume(answers)
            assert ender.scope.cancelled_caught
        assert session.paused is None and ran == []
        live = list(session.messages())
        store = session.journal.store
        assert await read_conversation(store, "s") == live
        assert [(m.content, m.is_error) for m in live if isinstance(m, ToolResultMessage)] == [
            ("Error: not that one", True),
            ("Error: unknown tool 'nope' (available: write)", True),
            ("no result was recorded (interrupted)", True),
        ]
    async with session_of(model, ran, journal=journal, session_id="s") as session:
        assert list(session.messages()) == live


async def test_a_paused_session_killed_with_sigkill_resumes_in_a_new_process(tmp_path: Path) -> None:
    sys.path.insert(0, str(PAUSE_WORKER.parent))
    from pause_worker import make_deploy, model  # type: ignore[import-not-found]

    journal, ledger = tmp_path / "j.db", tmp_path / "ledger.txt"
    with open(tmp_path / "worker.err", "wb") as stderr:  # noqa: ASYNC230 - a file descriptor for the child
        process = await trio.lowlevel.open_process(
            [sys.executable, str(PAUSE_WORKER), str(journal), str(ledger), "paused"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=str(ROOT),
        )
        try:
            data = b""
            with trio.fail_after(60):
                assert process.stdout is not None
                while b"\n" not in data:
                    chunk = await process.stdout.receive_some(4096)
                    if not chunk:
                        raise AssertionError(f"the worker exited: {(tmp_path / 'worker.err').read_text()}")
                    data += chunk
        finally:
            process.send_signal(signal.SIGKILL)
            await process.wait()
    assert data.startswith(b"PAUSED ")
    asked = json.loads(data[len(b"PAUSED ") :])
    assert not ledger.exists()  # the call waited for its approval: nothing ran before the kill
    with trio.fail_after(60):
        async with open_session(
            provider=model(),
            tools=[make_deploy(str(ledger))],
            journal=str(journal),
            session_id="paused",
            takeover_timeout=30.0,
            permissions={"ask": ["deploy"]},
            permission_asks="interrupt",
        ) as session:
            assert session.paused is not None
            assert [i.id for i in session.paused.interrupts] == asked
            text = await session.resume([Approve(asked[0])])
            with pytest.raises(InterruptResumeError):
                await session.resume([Approve(asked[0])])
    assert text == "done: deployed 2"
    assert ledger.read_text().splitlines() == ['{"version": 2}']  # ran exactly once


async def test_a_handler_session_never_pauses_and_a_bad_option_is_refused() -> None:
    from trio_agent import ConfigError

    with pytest.raises(ConfigError, match="permission_asks"):
        async with open_session(provider=TestModel(default=Reply(text="x")), permission_asks="later"):
            pass
    ran: list[dict[str, Any]] = []
    model = echo_model(("write", {"path": "a", "text": "x"}))
    async with open_session(provider=model, tools=[make_write(ran)], permissions={"ask": ["write"]}) as session:
        text = await session.send("write a")  # no handler: denied, as before
    assert not isinstance(text, PausedReply) and ran == [] and "denied" in text.lower()


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"allowed_tools": ["write"]}, id="not-in-allowed"),
        pytest.param({"allowed_tools": []}, id="allowed-empty"),
        pytest.param({"disallowed_tools": ["confirm"]}, id="disallowed"),
    ],
)
async def test_the_tool_filter_applies_to_client_tools(options: dict[str, Any]) -> None:
    """A client tool the allowed/disallowed lists leave out is neither offered nor called: its call
    is refused like any other tool's, so the request does not pause."""
    ran: list[dict[str, Any]] = []
    model = echo_model(("confirm", {}))
    async with session_of(model, ran, tools=[make_write(ran), CONFIRM], **options) as session:
        reply = await session.send("confirm")
    assert "confirm" not in {tool.name for tool in model.requests[0].tools}
    assert not isinstance(reply, PausedReply)
    assert "Error: unknown tool 'confirm'" in reply


async def test_an_in_memory_session_pauses_and_resumes_too() -> None:
    ran: list[dict[str, Any]] = []
    async with session_of(echo_model(("write", {"path": "a", "text": "x"})), ran, journal=MemoryStore()) as session:
        reply = await session.send("write a")
        assert await session.resume([Approve(reply.interrupts[0].id)]) == "done: wrote a"


async def test_stop_from_the_resolution_finishes_a_session_request_and_streams_the_continuation() -> None:
    from trio_agent.lifecycle import ToolResume

    choice = define_interrupt("go_on", response_schema={"type": "boolean"})

    class Gate(ChatMiddleware):
        interrupts = (choice,)

        def on_interrupt_boundary(self, ctx: Any) -> Any:
            if ctx.phase is Phase.BEFORE_TOOLS and ctx.parent_run_id is None:
                return [choice.request("go", "go on?")]
            return None

        def on_interrupt_resolution(self, ctx: Any, resolutions: Any) -> Any:
            [answer] = resolutions.of(choice)
            return ToolResume.CONTINUE if answer.response else ToolResume.STOP

    ran: list[dict[str, Any]] = []
    model = echo_model(("write", {"path": "a", "text": "x"}))
    async with session_of(model, ran, permissions={"allow": ["write"]}, lifecycle=[Gate()]) as session:
        reply = await session.send("write a")
        calls_before = len(model.requests)
        async with session.resume_stream([Respond(reply.interrupts[0].id, False)]) as events:
            seen = [event async for event in events]
        assert isinstance(seen[-1], DoneEvent) and seen[-1].stop_reason == "vetoed"
        assert ran == [] and len(model.requests) == calls_before and session.paused is None
        reply = await session.send("write a")  # the stopped call was answered: the history is valid
        text = await session.resume([Respond(reply.interrupts[0].id, True)])
    # The model saw the stopped call's answer, then the new call's.
    assert text == "done: Error: cancelled: the run was stopped | wrote a"
    assert ran == [{"path": "a", "text": "x"}]


async def test_a_session_checks_the_model_adapters_required_capabilities() -> None:
    from trio_agent.lifecycle import CapabilityError, create_capability

    model = TestModel(default=Reply(text="x"))
    model.requires = (create_capability("sandbox"),)  # type: ignore[attr-defined]
    with pytest.raises(CapabilityError, match="sandbox"):
        async with open_session(provider=model):
            pass
