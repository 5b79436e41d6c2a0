"""An abort while a chat middleware hook runs outside the tool pipeline and the model call.

`session.abort()` and ``chat()``'s abort handle cancel the hook the loop is awaiting (its
setup, on_config, on_start, on_iteration, on_interrupt_boundary, on_usage, on_model_error,
on_after_tool_call of a cut-off call, on_tool_phase_complete, on_should_continue, a session's
Stop hook, a client tool's screening, the structured-output step): the request ends at once as
an abort (``on_abort``, `RequestAbortedError` / an aborted `ChatResult`), never as a failure.
Every hook here would sleep an hour: with the clock jumping, a hook the abort does not cut
shows as an hour gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    AbortHandle,
    FinishReason,
    HookEvent,
    ModelError,
    RequestAbortedError,
    SideEffect,
    StopReason,
    ToolKind,
    Usage,
    chat,
    define_tool,
    open_session,
)
from trio_agent.lifecycle import ChatMiddleware, Phase, define_client_tool
from trio_agent.models import ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel

HOUR = 3600.0
USAGE = Usage(input_tokens=1, output_tokens=1, total_tokens=2)


async def _run_tool(inp: dict[str, Any], ctx: Any) -> str:
    return "ok"


TOOL = define_tool(
    _run_tool,
    name="t",
    description="t",
    side_effect=SideEffect.PURE,
    kind=ToolKind.READONLY,
    input_schema={"type": "object"},
)
PICK = define_client_tool("pick", "picks one", input_schema={"type": "object"})


class Slow(ChatMiddleware):
    """Sleeps an hour in *hook* the first time it is reached (at *phase*, when given); records
    the terminal hooks."""

    def __init__(self, hook: str, phase: Phase | None = None) -> None:
        self.hook = hook
        self.phase = phase
        self.entered = trio.Event()
        self.ends: list[str] = []
        for name in ("on_finish", "on_abort", "on_error"):
            setattr(self, name, self._recorder(name))

        async def slow(ctx: Any, *args: Any) -> None:
            if self.entered.is_set() or (self.phase is not None and ctx.phase is not self.phase):
                return None
            self.entered.set()
            await trio.sleep(HOUR)
            return None

        setattr(self, hook, slow)

    def _recorder(self, name: str) -> Callable[..., None]:
        def record(ctx: Any, info: Any) -> None:
            self.ends.append(name)

        return record


def _respond(case: str) -> Callable[[Any], Reply]:
    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        if isinstance(last, UserMessage) and last.content == "again":
            return Reply(text="fine", usage=USAGE)
        if isinstance(last, ToolResultMessage):
            return Reply(text="done", usage=USAGE)
        if case == "model_error":
            return Reply(error=ModelError("flaky", retryable=False))
        if case == "cut_off":
            return Reply(tool_calls=[("t", {})], finish_reason=FinishReason.LENGTH, usage=USAGE)
        if case == "client":
            return Reply(tool_calls=[("pick", {})], usage=USAGE)
        if case == "no_calls":
            return Reply(text="done", usage=USAGE)
        return Reply(tool_calls=[("t", {})], usage=USAGE)

    return respond


# (hook, the phase it sleeps at, the model's script)
SESSION_CASES = [
    ("setup", None, "tools"),
    ("on_config", Phase.INIT, "tools"),
    ("on_config", Phase.BEFORE_MODEL, "tools"),
    ("on_start", None, "tools"),
    ("on_iteration", None, "tools"),
    ("on_interrupt_boundary", Phase.BEFORE_MODEL, "tools"),
    ("on_interrupt_boundary", Phase.AFTER_MODEL, "tools"),
    ("on_interrupt_boundary", Phase.BEFORE_TOOLS, "tools"),
    ("on_interrupt_boundary", Phase.AFTER_TOOLS, "tools"),
    ("on_usage", None, "tools"),
    ("on_model_error", None, "model_error"),
    ("on_after_tool_call", None, "cut_off"),
    ("on_tool_phase_complete", None, "tools"),
    ("on_should_continue", None, "tools"),
]
CHAT_CASES = [
    *SESSION_CASES,
    ("on_before_tool_call", None, "client"),
    ("on_structured_output_config", None, "no_calls"),
    ("on_config", Phase.STRUCTURED_OUTPUT, "no_calls"),
]


def _case_id(case: tuple[str, Phase | None, str]) -> str:
    hook, phase, _ = case
    return hook if phase is None else f"{hook}-{phase.value}"


@pytest.mark.parametrize("case", SESSION_CASES, ids=_case_id)
async def test_session_abort_cuts_a_slow_hook_and_the_request_ends_aborted(
    case: tuple[str, Phase | None, str], autojump_clock: trio.testing.MockClock
) -> None:
    hook, phase, script = case
    slow = Slow(hook, phase)
    model = TestModel(respond=_respond(script))
    async with open_session(provider=model, tools=[TOOL], lifecycle=[slow]) as session:
        async with trio.open_nursery() as nursery:

            async def abort_in_the_hook() -> None:
                await slow.entered.wait()
                await session.abort()

            nursery.start_soon(abort_in_the_hook)
            with pytest.raises(RequestAbortedError) as raised:
                await session.send("go")
        assert raised.value.reason == "user_abort"
        assert trio.current_time() < 1.0, "the abort waited for the hook"
        assert slow.ends == ["on_abort"]
        # The history the session goes on with is the one its journal rebuilds, and it goes on.
        assert list(session.messages()) == await session._rebuild_history(session.root_agent_id)
        assert await session.send("again") == "fine"


@pytest.mark.parametrize("case", CHAT_CASES, ids=_case_id)
async def test_chat_abort_handle_cuts_a_slow_hook_and_the_run_ends_aborted(
    case: tuple[str, Phase | None, str], autojump_clock: trio.testing.MockClock
) -> None:
    hook, phase, script = case
    slow = Slow(hook, phase)
    abort = AbortHandle()
    schema = {"type": "object"} if hook == "on_structured_output_config" or phase is Phase.STRUCTURED_OUTPUT else None
    async with trio.open_nursery() as nursery:

        async def abort_in_the_hook() -> None:
            await slow.entered.wait()
            abort.abort()

        nursery.start_soon(abort_in_the_hook)
        result = await chat(
            TestModel(respond=_respond(script)),
            "go",
            tools=[TOOL, PICK],
            middleware=[slow],
            abort=abort,
            output_schema=schema,
        )
    assert result.stop_reason is StopReason.ABORTED
    assert trio.current_time() < 1.0, "the abort waited for the hook"
    assert slow.ends == ["on_abort"]
    # Every call of the history has its answer.
    calls = {part.id for message in result.messages for part in getattr(message, "tool_calls", ())}
    answered = {message.tool_call_id for message in result.messages if isinstance(message, ToolResultMessage)}
    assert calls == answered


async def test_an_abort_while_a_stop_hook_runs_ends_the_run_aborted_not_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    entered = trio.Event()
    ends: list[str] = []

    async def stop_hook(inp: Any) -> None:
        entered.set()
        await trio.sleep(HOUR)

    class Ends(ChatMiddleware):
        def on_finish(self, ctx: Any, info: Any) -> None:
            ends.append("on_finish")

        def on_abort(self, ctx: Any, info: Any) -> None:
            ends.append("on_abort")

        def on_error(self, ctx: Any, info: Any) -> None:
            ends.append("on_error")

    model = TestModel(default=Reply(text="done"))
    session_cm = open_session(provider=model, hooks={HookEvent.STOP: [stop_hook]}, lifecycle=[Ends()])
    async with session_cm as session, trio.open_nursery() as nursery:

        async def abort_in_the_hook() -> None:
            await entered.wait()
            await session.abort()

        nursery.start_soon(abort_in_the_hook)
        with pytest.raises(RequestAbortedError):
            await session.send("go")
    assert trio.current_time() < 1.0
    assert ends == ["on_abort"]


async def test_a_hook_that_aborts_the_run_itself_and_awaits_is_cut_there(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``ctx.abort()`` inside an ``async`` hook: its next await is cut, and the run ends aborted there."""
    seen: list[str] = []

    class Abandon(ChatMiddleware):
        async def on_iteration(self, ctx: Any, info: Any) -> None:
            ctx.abort("enough")
            await trio.sleep(HOUR)
            seen.append("not cut")

        def on_config(self, ctx: Any, config: Any) -> None:
            seen.append(ctx.phase.value)

        def on_abort(self, ctx: Any, info: Any) -> None:
            seen.append(f"abort: {info.reason}")

    model = TestModel(default=Reply(text="never"))
    result = await chat(model, "go", middleware=[Abandon()])
    assert result.stop_reason is StopReason.ABORTED
    assert trio.current_time() < 1.0
    assert model.requests == []  # no model call after the abort
    assert seen == ["init", "abort: enough"]


async def test_a_hook_whose_own_nursery_fails_in_its_cleanup_after_the_abort_ends_the_run_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The abort cancels a hook's own nursery, whose cleanup raises: that is the abort's, no failure."""
    entered = trio.Event()
    ends: list[str] = []

    async def child() -> None:
        try:
            await trio.sleep(HOUR)
        finally:
            raise ValueError("cleanup failed")  # the cleanup error this test is about

    class Nursery(ChatMiddleware):
        async def on_iteration(self, ctx: Any, info: Any) -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(child)
                entered.set()

        def on_abort(self, ctx: Any, info: Any) -> None:
            ends.append("on_abort")

        def on_error(self, ctx: Any, info: Any) -> None:
            ends.append("on_error")

    abort = AbortHandle()
    async with trio.open_nursery() as outer:

        async def abort_in_the_hook() -> None:
            await entered.wait()
            abort.abort()

        outer.start_soon(abort_in_the_hook)
        result = await chat(TestModel(default=Reply(text="never")), "go", middleware=[Nursery()], abort=abort)
    assert result.stop_reason is StopReason.ABORTED
    assert ends == ["on_abort"]
    assert trio.current_time() < 1.0
