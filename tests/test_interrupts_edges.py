"""Pauses at the edges: failed continuations, queued requests, every boundary's bookkeeping, recovery.

Each test pins a defect found in review of the interrupts work (issue 14); the live history and
the one the journal rebuilds must agree after every pause and continuation.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    ConfigError,
    ModelError,
    PausedReply,
    PermissionAllow,
    PermissionAsk,
    RequestAbortedError,
    SessionPausedError,
    SideEffect,
    ToolKind,
    TrioAgentError,
    chat,
    define_tool,
    open_session,
)
from trio_agent._models._history import ORPHAN_ANSWER
from trio_agent.journal import MemoryStore, open_journal, read_conversation
from trio_agent.lifecycle import (
    Approve,
    ChatMiddleware,
    InterruptKind,
    InterruptResumeError,
    Phase,
    Reject,
    Respond,
    StopReason,
    define_client_tool,
    define_interrupt,
    max_iterations,
)
from trio_agent.models import ToolResultMessage, UserMessage
from trio_agent.testing import FaultyStore, Reply, TestModel

SCHEMA: dict[str, Any] = {"type": "object"}
QUESTION = define_interrupt("q", response_schema={"type": "string"})


def make_write(ran: list[dict[str, Any]]) -> Any:
    @define_tool(name="write", description="writes", input_schema=SCHEMA, side_effect=SideEffect.IDEMPOTENT,
                 kind=ToolKind.WRITE)  # fmt: skip
    async def write(input: dict[str, Any], ctx: Any) -> str:
        ran.append(dict(input))
        return "wrote"

    return write


def echo(*calls: tuple[str, dict[str, Any]]) -> TestModel:
    def respond(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            answers = [m.content for m in request.messages if isinstance(m, ToolResultMessage)]
            return Reply(text="done: " + " | ".join(answers))
        return Reply(tool_calls=list(calls))

    return TestModel(respond=respond)


class AskAt(ChatMiddleware):
    """Asks one question at *phase* of turn *iteration* (never on a continuation)."""

    interrupts = (QUESTION,)

    def __init__(self, phase: Phase, iteration: int = 0) -> None:
        self.phase, self.iteration = phase, iteration

    def on_interrupt_boundary(self, ctx: Any) -> Any:
        if ctx.phase is self.phase and ctx.iteration == self.iteration and ctx.parent_run_id is None:
            return [QUESTION.request("k", "go on?")]
        return None


async def rebuilt(session: Any) -> list[Any]:
    return list(await read_conversation(session.journal.store, session.session_id))


async def test_a_continuation_that_fails_after_answering_leaves_the_session_usable() -> None:
    def respond(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            return Reply(error=ModelError("boom", retryable=False))
        return Reply(tool_calls=[("write", {})])

    ran: list[dict[str, Any]] = []
    async with open_session(provider=TestModel(respond=respond), tools=[make_write(ran)],
                            permissions={"ask": ["write"]}, permission_asks="interrupt") as session:  # fmt: skip
        reply = await session.send("go")
        with pytest.raises(ModelError):
            await session.resume([Approve(reply.interrupts[0].id)])
        # The answer was recorded (interrupts_resolved): the session is not paused any more.
        assert ran == [{}] and session.paused is None
        again = await session.send("next")
        assert isinstance(again, PausedReply)
        assert session.messages() == tuple(await rebuilt(session))


async def test_a_request_queued_behind_one_that_pauses_is_refused_not_run() -> None:
    gate = trio.Event()

    class Hold(ChatMiddleware):
        async def on_iteration(self, ctx: Any, info: Any) -> None:
            if ctx.parent_run_id is None and info.iteration == 0:
                await gate.wait()

    ran: list[dict[str, Any]] = []
    model = echo(("write", {}))
    async with open_session(provider=model, tools=[make_write(ran)], permissions={"ask": ["write"]},
                            permission_asks="interrupt", lifecycle=[Hold()]) as session:  # fmt: skip
        outcome: dict[str, Any] = {}

        async def later() -> None:
            try:
                outcome["later"] = await session.send("second", priority="later")
            except SessionPausedError as exc:
                outcome["later"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: session.send("first"))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(later)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        assert isinstance(outcome["later"], SessionPausedError)
        assert all(UserMessage("second") not in request.messages for request in model.requests)
        assert await session.resume([Approve(session.paused.interrupts[0].id)]) == "done: wrote"
        assert session.messages() == tuple(await rebuilt(session))


async def test_a_pause_after_a_reply_without_calls_resumes_cleanly() -> None:
    model = TestModel(default=Reply(text="hello"))
    async with open_session(provider=model, lifecycle=[AskAt(Phase.AFTER_MODEL)]) as session:
        reply = await session.send("hi")
        assert isinstance(reply, PausedReply)
        assert await session.resume([Respond(reply.interrupts[0].id, "y")]) == "hello"
        assert len(model.requests) == 1
        assert await session.send("again") == "hello"
        assert session.messages() == tuple(await rebuilt(session))
    async with open_journal(MemoryStore(), session_id="c") as journal:
        async with chat(model, "hi", middleware=[AskAt(Phase.AFTER_MODEL)], journal=journal) as run:
            paused = await run.result()
        async with chat(model, resume=paused.paused, answers=[Respond(paused.interrupts[0].id, "y")],
                        middleware=[AskAt(Phase.AFTER_MODEL)], journal=journal) as run:  # fmt: skip
            result = await run.result()
    assert result.stop_reason is StopReason.END_TURN and result.text == "hello"


async def test_calls_refused_before_a_pause_reach_the_model_after_it() -> None:
    async def run(middleware: list[Any]) -> tuple[Any, int]:
        model = echo(("nope", {}))
        async with chat(model, "go", tools=[make_write([])], middleware=middleware) as first:
            result = await first.result()
        if result.paused is not None:
            answers = [Respond(result.interrupts[0].id, "y")]
            async with chat(model, resume=result.paused, answers=answers, tools=[make_write([])],
                            middleware=middleware) as second:  # fmt: skip
                result = await second.result()
        return result, len(model.requests)

    plain, plain_calls = await run([])
    paused, paused_calls = await run([AskAt(Phase.BEFORE_TOOLS)])
    assert (paused.text, paused_calls, paused.stop_reason) == (plain.text, plain_calls, plain.stop_reason)
    assert "unknown tool" in paused.text and paused_calls == 2


@pytest.mark.parametrize(
    ("options", "stop"),
    [
        ({"strategy": max_iterations(1)}, StopReason.MAX_TURNS),
        ({"middleware": [type("No", (ChatMiddleware,), {"on_should_continue": lambda s, c, st: False})()]},
         StopReason.VETOED),
    ],
)  # fmt: skip
async def test_a_pause_after_tools_keeps_the_turns_bookkeeping(options: dict[str, Any], stop: StopReason) -> None:
    async def run(pause: bool) -> tuple[StopReason, int]:
        model = echo(("write", {}))
        middleware = [*options.get("middleware", []), *([AskAt(Phase.AFTER_TOOLS)] if pause else [])]
        kwargs = {"tools": [make_write([])], "middleware": middleware, "strategy": options.get("strategy")}
        async with chat(model, "go", **kwargs) as first:
            result = await first.result()
        if result.paused is not None:
            answers = [Respond(result.interrupts[0].id, "y")]
            async with chat(model, resume=result.paused, answers=answers, **kwargs) as second:
                result = await second.result()
        return result.stop_reason, len(model.requests)

    assert await run(True) == await run(False) == (stop, 1)


async def test_input_that_joined_a_turn_paused_before_its_model_call_is_journalled() -> None:
    release = trio.Event()

    @define_tool(name="wait", description="waits", input_schema=SCHEMA, side_effect=SideEffect.PURE,
                 kind=ToolKind.READONLY)  # fmt: skip
    async def wait(input: dict[str, Any], ctx: Any) -> str:
        await release.wait()
        return "waited"

    model = echo(("wait", {}))
    async with open_session(provider=model, tools=[wait], lifecycle=[AskAt(Phase.BEFORE_MODEL, 1)]) as session:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: session.send("go"))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(lambda: session.send("EXTRA NOTE", priority="next"))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        assert session.paused is not None
        assert UserMessage("EXTRA NOTE") in await rebuilt(session)  # journalled with the pause
        await session.resume([Respond(session.paused.interrupts[0].id, "y")])
        assert UserMessage("EXTRA NOTE") in model.requests[-1].messages
        assert session.messages() == tuple(await rebuilt(session))


async def test_answers_keep_call_order_live_and_rebuilt_with_a_refused_call() -> None:
    ran: list[dict[str, Any]] = []
    async with open_session(provider=echo(("nope", {}), ("write", {})), tools=[make_write(ran)],
                            permissions={"ask": ["write"]}, permission_asks="interrupt") as session:  # fmt: skip
        reply = await session.send("go")
        text = await session.resume([Approve(reply.interrupts[0].id)])
        assert text.startswith("done: Error: unknown tool") and text.endswith("| wrote")
        assert session.messages() == tuple(await rebuilt(session))


async def test_a_journalled_chat_run_rebuilds_the_history_it_was_given() -> None:
    model = echo(("write", {}))
    store = MemoryStore()
    async with (
        open_journal(store, session_id="c") as journal,
        chat(model, "write a", tools=[make_write([])], journal=journal) as run,
    ):
        result = await run.result()
    assert result.messages == tuple(await read_conversation(store, "c"))


async def test_recovery_runs_an_approved_call_again_with_its_approval() -> None:
    inner = MemoryStore()
    store = FaultyStore(inner)
    ran: list[dict[str, Any]] = []

    @define_tool(name="write", description="writes", input_schema=SCHEMA, side_effect=SideEffect.IDEMPOTENT,
                 kind=ToolKind.WRITE)  # fmt: skip
    async def write(input: dict[str, Any], ctx: Any) -> str:
        ran.append(dict(input))
        if len(ran) == 1:
            store.fail_next("before")  # the settlement of the first run never lands: a crash
        return "wrote"

    options: dict[str, Any] = {"tools": [write], "permissions": {"ask": ["write"]}, "permission_asks": "interrupt"}
    model = echo(("write", {}))
    async with open_session(provider=model, journal=store, session_id="r", **options) as session:
        reply = await session.send("go")
        with pytest.raises(TrioAgentError):
            await session.resume([Approve(reply.interrupts[0].id)])
    async with open_session(provider=model, journal=inner, session_id="r", **options) as session:
        notes = "\n".join(session.recovery_notes)
        assert len(ran) == 2 and "ok" in notes and "permission" not in notes  # re-run, still approved
        assert session.messages() == tuple(await rebuilt(session))


@pytest.mark.parametrize("mode", ["skip", "modify", "context", "none"])
async def test_what_the_prompt_hooks_made_of_a_prompt_is_what_a_rebuilt_history_reads(mode: str) -> None:
    from trio_agent import HookEvent, HookOutput

    async def hook(given: Any) -> Any:
        if mode == "skip":
            return HookOutput.skip("no")
        if mode == "modify":
            return HookOutput.modify(f"[review] {given.prompt}")
        if mode == "context":
            return HookOutput.context("extra context")
        return None

    model = TestModel(default=Reply(text="hello"))
    async with open_session(provider=model, hooks={HookEvent.USER_PROMPT_SUBMIT: [hook]}) as session:
        await session.send("hi")
        await session.send("again")
        assert session.messages() == tuple(await rebuilt(session))


class AskSlowly(ChatMiddleware):
    """Asks at *phase* of the first turn, but only after *release* (an abort lands meanwhile)."""

    interrupts = (QUESTION,)

    def __init__(self, phase: Phase) -> None:
        self.phase = phase
        self.entered, self.release = trio.Event(), trio.Event()
        self.terminal: list[str] = []

    async def on_interrupt_boundary(self, ctx: Any) -> Any:
        if ctx.phase is self.phase and not self.entered.is_set():
            self.entered.set()
            await self.release.wait()
            return [QUESTION.request("k", "go on?")]
        return None

    def on_abort(self, ctx: Any, info: Any) -> None:
        self.terminal.append("on_abort")

    def on_finish(self, ctx: Any, info: Any) -> None:
        self.terminal.append("on_finish")


@pytest.mark.parametrize("phase", [Phase.BEFORE_MODEL, Phase.AFTER_MODEL, Phase.BEFORE_TOOLS, Phase.AFTER_TOOLS])
async def test_an_abort_while_a_boundary_hook_asks_wins_over_the_pause(phase: Phase) -> None:
    ran: list[dict[str, Any]] = []
    asker = AskSlowly(phase)
    async with (
        open_journal(MemoryStore(), session_id="c") as journal,
        chat(echo(("write", {})), "go", tools=[make_write(ran)], middleware=[asker], journal=journal) as run,
    ):
        await asker.entered.wait()
        run.abort("the user pressed stop")
        asker.release.set()
        result = await run.result()
    assert result.stop_reason is StopReason.ABORTED and result.paused is None
    assert asker.terminal == ["on_abort"]
    # A call the abort left waiting never runs, and is answered: the history can go on.
    answers = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    if phase in (Phase.AFTER_MODEL, Phase.BEFORE_TOOLS):
        assert ran == [] and [(a.is_error, a.content) for a in answers] == [(True, ORPHAN_ANSWER)]  # as rebuilt
    await chat(TestModel(default=Reply(text="ok")), [*result.messages, UserMessage("again")])


async def test_an_abort_while_the_permission_screen_runs_wins_over_the_approval_pause() -> None:
    entered, release = trio.Event(), trio.Event()

    class SlowPolicy(ChatMiddleware):
        def __init__(self) -> None:
            self.terminal: list[str] = []

        def on_abort(self, ctx: Any, info: Any) -> None:
            self.terminal.append("on_abort")

    async def check(input: dict[str, Any]) -> PermissionAsk:
        entered.set()
        await release.wait()
        return PermissionAsk("deploys to production")

    ran: list[dict[str, Any]] = []

    @define_tool(name="deploy", description="deploys", input_schema=SCHEMA, side_effect=SideEffect.NON_IDEMPOTENT,
                 kind=ToolKind.EXECUTE, check_permissions=check)  # fmt: skip
    async def deploy(input: dict[str, Any], ctx: Any) -> str:
        ran.append(input)
        return "deployed"

    policy = SlowPolicy()
    async with chat(echo(("deploy", {})), "go", tools=[deploy], middleware=[policy]) as run:
        await entered.wait()
        run.abort("the user pressed stop")
        release.set()
        result = await run.result()
    assert result.stop_reason is StopReason.ABORTED and result.paused is None
    assert policy.terminal == ["on_abort"] and ran == []


async def test_a_session_abort_while_a_boundary_hook_asks_ends_the_request_aborted() -> None:
    asker = AskSlowly(Phase.BEFORE_MODEL)
    async with open_session(provider=TestModel(default=Reply(text="hi")), lifecycle=[asker]) as session:
        outcome: dict[str, Any] = {}

        async def send() -> None:
            try:
                outcome["reply"] = await session.send("go")
            except RequestAbortedError as exc:
                outcome["reply"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await asker.entered.wait()
            nursery.start_soon(session.abort)
            await trio.testing.wait_all_tasks_blocked()
            asker.release.set()
        assert isinstance(outcome["reply"], RequestAbortedError)
        assert session.paused is None and asker.terminal == ["on_abort"]
        assert await session.send("again") == "hi"
        assert session.messages() == tuple(await rebuilt(session))


# ---------------------------------------------------------------- continuations judged


class Deploys:
    """A ``deploy`` tool whose own check asks a person every time (and may be made slow)."""

    def __init__(self) -> None:
        self.checked: list[dict[str, Any]] = []
        self.ran: list[dict[str, Any]] = []
        self.slow = False
        self.entered = trio.Event()

        async def check(input: dict[str, Any]) -> PermissionAsk:
            self.checked.append(dict(input))
            if self.slow:
                self.entered.set()
                await trio.sleep_forever()  # until the call's abort cuts the check short
            return PermissionAsk("deploys to production")

        @define_tool(name="deploy", description="deploys", input_schema=SCHEMA, side_effect=SideEffect.NON_IDEMPOTENT,
                     kind=ToolKind.EXECUTE, check_permissions=check)  # fmt: skip
        async def deploy(input: dict[str, Any], ctx: Any) -> str:
            self.ran.append(dict(input))
            return "deployed"

        self.tool = deploy


@pytest.mark.parametrize(
    ("edited", "code"),
    [
        pytest.param(["v", 2], "invalid_edited_args", id="list"),
        pytest.param(("v", 2), "invalid_edited_args", id="tuple"),
        pytest.param({"v": math.nan}, "invalid_payload", id="nan"),
        pytest.param({"v": {2}}, "invalid_payload", id="set"),
        pytest.param({1: 2}, "invalid_payload", id="int-key"),
    ],
)
async def test_edited_args_found_wrong_are_one_issue_and_no_check_judges_them(edited: Any, code: str) -> None:
    # The answer is refused as the docs say (one InterruptResumeError, one issue for it), never a
    # ConfigError from judging a list, nor a second issue from running the tool's check on it.
    deploys = Deploys()
    model = echo(("deploy", {"v": 1}))
    async with chat(model, "go", tools=[deploys.tool]) as run:
        paused = await run.result()
    [question] = paused.interrupts
    with pytest.raises(InterruptResumeError) as caught:
        answers = [Approve(question.id, edited_args=edited)]
        async with chat(model, tools=[deploys.tool], resume=paused.paused, answers=answers) as run:
            await run.result()
    assert [(issue.interrupt_id, issue.code) for issue in caught.value.issues] == [(question.id, code)]
    assert deploys.checked == [{"v": 1}] and deploys.ran == []  # checked once: when it paused

    deploys.checked.clear()
    async with open_session(provider=model, tools=[deploys.tool], permission_asks="interrupt") as session:
        reply = await session.send("go")
        [question] = reply.interrupts
        with pytest.raises(InterruptResumeError) as caught:
            await session.resume([Approve(question.id, edited_args=edited)])
        assert [(issue.interrupt_id, issue.code) for issue in caught.value.issues] == [(question.id, code)]
        assert session.paused is not None and deploys.checked == [{"v": 1}]
        assert await session.resume([Approve(question.id)]) == "done: deployed"
        assert deploys.ran == [{"v": 1}]


async def test_a_handler_session_continuation_asks_the_handler_not_a_person() -> None:
    # permission_asks="handler" (the default) pauses only for what no handler answers (a client
    # tool here); its continuation asks the handler too: for the call paused beside the client
    # tool and for a later turn's call. None of them becomes an approval question.
    pick = define_client_tool("pick", "picks a version", input_schema={"type": "object"})
    asked: list[str] = []

    async def handler(request: Any) -> PermissionAllow:
        asked.append(request.tool_name)
        return PermissionAllow()

    def respond(request: Any) -> Reply:
        answers = [m.content for m in request.messages if isinstance(m, ToolResultMessage)]
        if not answers:
            return Reply(tool_calls=[("pick", {}), ("write", {"v": 1})])
        if len(answers) == 2:
            return Reply(tool_calls=[("write", {"v": 2})])
        return Reply(text="done: " + " | ".join(answers))

    ran: list[dict[str, Any]] = []
    async with open_session(provider=TestModel(respond=respond), tools=[make_write(ran), pick],
                            permissions={"ask": ["write"]}, permission_handler=handler) as session:  # fmt: skip
        reply = await session.send("go")
        assert [item.kind for item in reply.interrupts] == [InterruptKind.CLIENT_TOOL]
        text = await session.resume([Respond(reply.interrupts[0].id, 2)])
        assert not isinstance(text, PausedReply) and session.paused is None
        assert text == "done: 2 | wrote | wrote"
        assert asked == ["write", "write"] and ran == [{"v": 1}, {"v": 2}]
        assert session.messages() == tuple(await rebuilt(session))


async def test_approvals_paused_with_interrupt_are_concluded_after_a_reopen_with_the_handler() -> None:
    # A pause of a life with permission_asks="interrupt" holds approvals; a later life that asks a
    # handler still concludes them from the person's answers (the handler is not asked for them).
    store = MemoryStore()
    asked: list[str] = []

    async def handler(request: Any) -> PermissionAllow:
        asked.append(request.tool_name)
        return PermissionAllow()

    ran: list[dict[str, Any]] = []
    options: dict[str, Any] = {"tools": [make_write(ran)], "permissions": {"ask": ["write"]}, "journal": store,
                               "session_id": "h"}  # fmt: skip
    model = echo(("write", {"v": 1}))
    async with open_session(provider=model, permission_asks="interrupt", **options) as session:
        question = (await session.send("go")).interrupts[0]
    async with open_session(provider=model, permission_handler=handler, **options) as session:
        assert await session.resume([Approve(question.id, edited_args={"v": 3})]) == "done: wrote"
    assert ran == [{"v": 3}] and asked == []


@pytest.mark.parametrize("edited", [None, {"v": 9}], ids=["unedited", "edited"])
async def test_an_abort_while_a_continuation_judges_an_approval_leaves_the_pause_open(edited: Any) -> None:
    # The abort cuts the tool's check short: that is no refusal of the call (an unedited approval
    # was answered with it, the pause consumed) nor of the edit (an InterruptResumeError): the
    # request ends aborted, nothing is recorded for the answers, and the pause can still be answered.
    deploys = Deploys()
    model = echo(("deploy", {"v": 1}))
    async with open_session(provider=model, tools=[deploys.tool], permission_asks="interrupt") as session:
        reply = await session.send("go")
        [question] = reply.interrupts
        deploys.slow = True
        outcome: dict[str, Any] = {}

        async def resume() -> None:
            try:
                outcome["reply"] = await session.resume([Approve(question.id, edited_args=edited)])
            except TrioAgentError as exc:
                outcome["reply"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(resume)
            await deploys.entered.wait()
            await session.abort()
        assert isinstance(outcome["reply"], RequestAbortedError)
        assert session.paused is not None and session.paused.interrupts == (question,)
        assert not [m for m in session.messages() if isinstance(m, ToolResultMessage)]
        assert session.messages() == tuple(await rebuilt(session))
        deploys.slow = False
        assert await session.resume([Approve(question.id, edited_args=edited)]) == "done: deployed"
        assert deploys.ran == [edited or {"v": 1}]


async def test_an_abort_while_a_chat_continuation_judges_an_approval_leaves_the_journal_pause_open() -> None:
    deploys = Deploys()
    model = echo(("deploy", {"v": 1}))
    async with open_journal(MemoryStore(), session_id="c") as journal:
        async with chat(model, "go", tools=[deploys.tool], journal=journal) as run:
            paused = await run.result()
        [question] = paused.interrupts
        deploys.slow = True
        answers = [Approve(question.id)]
        async with chat(model, tools=[deploys.tool], journal=journal, resume=paused.paused, answers=answers) as run:
            await deploys.entered.wait()
            run.abort("the user pressed stop")
            result = await run.result()
        assert result.stop_reason is StopReason.ABORTED and deploys.ran == []
        deploys.slow = False  # the journal took no answer: the same pause is answered once more
        async with chat(model, tools=[deploys.tool], journal=journal, resume=paused.paused, answers=answers) as run:
            assert (await run.result()).text == "done: deployed"
        assert deploys.ran == [{"v": 1}]


async def test_an_abort_while_the_resolution_hook_runs_leaves_the_pause_open() -> None:
    class SlowResolution(ChatMiddleware):
        interrupts = (QUESTION,)

        def __init__(self) -> None:
            self.entered, self.release = trio.Event(), trio.Event()

        def on_interrupt_boundary(self, ctx: Any) -> Any:
            if ctx.phase is Phase.BEFORE_TOOLS and ctx.parent_run_id is None:
                return [QUESTION.request("k", "go on?")]
            return None

        async def on_interrupt_resolution(self, ctx: Any, resolutions: Any) -> None:
            if not self.release.is_set():
                self.entered.set()
                await self.release.wait()

    slow = SlowResolution()
    ran: list[dict[str, Any]] = []
    async with open_session(provider=echo(("write", {})), tools=[make_write(ran)], lifecycle=[slow],
                            permissions={"allow": ["write"]}) as session:  # fmt: skip
        reply = await session.send("go")
        [question] = reply.interrupts
        outcome: dict[str, Any] = {}

        async def resume() -> None:
            try:
                outcome["reply"] = await session.resume([Respond(question.id, "yes")])
            except TrioAgentError as exc:
                outcome["reply"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(resume)
            await slow.entered.wait()
            nursery.start_soon(session.abort)
            await trio.testing.wait_all_tasks_blocked()
            slow.release.set()
        assert isinstance(outcome["reply"], RequestAbortedError) and ran == []
        assert session.paused is not None and session.paused.interrupts == (question,)
        assert await session.resume([Respond(question.id, "yes")]) == "done: wrote"
        assert session.messages() == tuple(await rebuilt(session))


async def test_no_decision_of_a_gate_outlives_its_run() -> None:
    # The gate hands the pipeline its decisions through a map the session keeps; every run takes
    # back what its calls left there: a denied call's decision, the screened calls of a batch
    # that paused, the approvals of a continuation that was refused.
    ran: list[dict[str, Any]] = []

    @define_tool(name="rm", description="removes", input_schema=SCHEMA, side_effect=SideEffect.NON_IDEMPOTENT,
                 kind=ToolKind.WRITE)  # fmt: skip
    async def rm(input: dict[str, Any], ctx: Any) -> str:
        raise AssertionError("denied by a rule: never runs")

    @define_tool(name="note", description="notes", input_schema=SCHEMA, side_effect=SideEffect.IDEMPOTENT,
                 kind=ToolKind.WRITE)  # fmt: skip
    async def note(input: dict[str, Any], ctx: Any) -> str:
        return "noted"

    model = echo(("note", {}), ("rm", {}), ("write", {"n": 1}), ("write", {"n": 2}))
    permissions = {"allow": ["note"], "deny": ["rm"], "ask": ["write"]}
    async with open_session(provider=model, tools=[make_write(ran), rm, note], permissions=permissions,
                            permission_asks="interrupt") as session:  # fmt: skip
        decided = session._host.decided
        reply = await session.send("go")
        assert [item.tool_name for item in reply.interrupts] == ["write", "write"] and decided == {}
        first, second = reply.interrupts
        with pytest.raises(InterruptResumeError):
            await session.resume([Approve(first.id), Approve(second.id, edited_args={"n": math.inf})])
        assert decided == {}
        text = await session.resume([Approve(first.id), Reject(second.id, "not that one")])
        assert text.startswith("done: noted | Error") and text.endswith("wrote | Error: not that one")
        assert decided == {} and ran == [{"n": 1}]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"input_schema": "x"}, r"input_schema must be a JSON Schema object, got 'x'"),
        ({"input_schema": 5}, r"input_schema must be a JSON Schema object, got 5"),
        ({"input_schema": [("type", "object")]}, r"input_schema must be a JSON Schema object, got \["),
        ({"description": 5}, r"description must be a string, got 5"),
    ],
    ids=["schema-str", "schema-int", "schema-pairs", "description-int"],
)
def test_a_client_tool_of_wrong_typed_arguments_is_a_config_error_naming_it(kwargs: dict[str, Any], named: str) -> None:
    # dict(input_schema) ran first: a string or a number raised a raw ValueError / TypeError, and a
    # list of pairs was taken for a schema; a description of 5 was offered to the model as is.
    with pytest.raises(ConfigError, match=r"client tool 'c' " + named):
        define_client_tool("c", **kwargs)


def test_a_client_tool_keeps_its_own_copy_of_its_input_schema() -> None:
    schema: dict[str, Any] = {"type": "object"}
    tool = define_client_tool("c", input_schema=schema)
    schema["required"] = ["x"]
    assert tool.input_schema == {"type": "object"} and tool.input_errors({}) == ()
    assert define_client_tool("c").input_schema == define_client_tool("c", input_schema={}).input_schema == SCHEMA
