"""Lifecycle middleware through ``chat()`` end to end: abort from every hook, errors from every hook,
exactly one terminal hook per run, nothing left running (issue 13, "Bad input")."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import SideEffect, ToolKind, define_tool
from trio_agent._chat._chat import chat
from trio_agent._lifecycle._middleware import ChatMiddleware
from trio_agent._loop._context import RetryNotAllowedError
from trio_agent._loop._rules import StopReason
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object"}


@define_tool(name="echo", description="echo", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY)
async def echo(input: dict[str, Any], ctx: Any) -> str:
    return "echoed"


def tool_then_text() -> TestModel:
    def respond(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            return Reply(text="done")
        return Reply(tool_calls=[("echo", {})])

    return TestModel(respond=respond)


class Terminal(ChatMiddleware):
    """Records which terminal hooks ran."""

    def __init__(self) -> None:
        self.terminal: list[str] = []

    def on_finish(self, ctx: Any, info: Any) -> None:
        self.terminal.append("finish")

    def on_abort(self, ctx: Any, info: Any) -> None:
        self.terminal.append("abort")

    def on_error(self, ctx: Any, info: Any) -> None:
        self.terminal.append("error")


ABORTING_HOOKS = [
    "on_config",
    "on_start",
    "on_iteration",
    "on_chunk",
    "on_before_tool_call",
    "on_after_tool_call",
    "on_usage",
    "on_tool_phase_complete",
    "on_should_continue",
]


def aborting(hook: str) -> ChatMiddleware:
    def abort_here(ctx: Any, *args: Any) -> None:
        ctx.abort(f"aborted in {hook}")

    middleware = ChatMiddleware()
    setattr(middleware, hook, abort_here)
    return middleware


@pytest.mark.parametrize("hook", ABORTING_HOOKS)
async def test_an_abort_from_any_hook_ends_the_run_with_exactly_one_on_abort(hook: str) -> None:
    terminal = Terminal()
    with trio.fail_after(10):
        async with chat(tool_then_text(), "go", tools=[echo], middleware=[aborting(hook), terminal]) as run:
            result = await run.result()
    assert result.stop_reason is StopReason.ABORTED
    assert terminal.terminal == ["abort"]


def raising(hook: str) -> ChatMiddleware:
    def fail_here(ctx: Any, *args: Any) -> None:
        raise RuntimeError(f"boom in {hook}")

    middleware = ChatMiddleware()
    setattr(middleware, hook, fail_here)
    return middleware


RAISING_HOOKS = ["on_config", "on_start", "on_iteration", "on_chunk", "on_usage", "on_should_continue"]


@pytest.mark.parametrize("hook", RAISING_HOOKS)
async def test_an_error_from_a_hook_fails_the_run_with_exactly_one_on_error(hook: str) -> None:
    terminal = Terminal()
    with trio.fail_after(10):
        async with chat(tool_then_text(), "go", tools=[echo], middleware=[raising(hook), terminal]) as run:
            with pytest.raises(RuntimeError, match=f"boom in {hook}"):
                await run.result()
    assert terminal.terminal == ["error"]


async def test_a_normal_run_has_exactly_one_on_finish() -> None:
    terminal = Terminal()
    async with chat(tool_then_text(), "go", tools=[echo], middleware=[terminal]) as run:
        result = await run.result()
    assert result.text == "done"
    assert terminal.terminal == ["finish"]


async def test_model_errors_retry_at_most_twice_and_never_reach_the_stream() -> None:
    from trio_agent import ModelError

    calls: list[int] = []

    def respond(request: Any) -> Reply:
        calls.append(1)
        return Reply(error=ModelError("refused", code="REFUSED", retryable=False))  # no transport retry

    class Retry(ChatMiddleware):
        def on_model_error(self, ctx: Any, error: Any) -> None:
            ctx.retry()

    terminal = Terminal()
    async with chat(TestModel(respond=respond), "go", middleware=[Retry(), terminal]) as run:
        with pytest.raises(ModelError):
            await run.result()
    assert len(calls) == 3  # the call and its two retries
    assert terminal.terminal == ["error"]


async def test_on_config_runs_again_with_phase_before_model_after_a_retry() -> None:
    from trio_agent import ModelError

    phases: list[str] = []

    class Retry(ChatMiddleware):
        def on_config(self, ctx: Any, config: Any) -> None:
            phases.append(ctx.phase.value)

        def on_model_error(self, ctx: Any, error: Any) -> None:
            ctx.retry()

    model = TestModel(default=[Reply(error=ModelError("flaky", retryable=False)), Reply(text="ok")])
    result = await chat(model, "hi", middleware=[Retry()])
    assert result.text == "ok"
    assert phases == ["init", "before_model", "before_model"]


async def test_a_retry_asked_outside_on_model_error_is_a_typed_error() -> None:
    class Early(ChatMiddleware):
        def on_start(self, ctx: Any) -> None:
            ctx.retry()

    async with chat(TestModel(default=Reply(text="x")), "go", middleware=[Early()]) as run:
        with pytest.raises(RetryNotAllowedError):
            await run.result()


async def test_instructions_changed_in_on_config_reach_the_model_call() -> None:
    from trio_agent.models import SystemMessage, UserMessage

    class Terse(ChatMiddleware):
        def on_config(self, ctx: Any, config: Any) -> Any:
            assert not any(isinstance(m, SystemMessage) for m in config.messages)  # the prompt is separate
            return {"instructions": config.instructions + " Answer in one sentence."}

    model = TestModel(default=Reply(text="ok"))
    async with chat(model, "hi", instructions="Be helpful.", middleware=[Terse()]) as run:
        await run.result()
    assert model.requests[0].messages == (SystemMessage("Be helpful. Answer in one sentence."), UserMessage("hi"))


async def test_a_hook_that_hangs_while_a_failed_run_is_reported_is_bounded(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    from trio_agent import ModelError

    class Hangs(ChatMiddleware):
        async def on_error(self, ctx: Any, info: Any) -> None:
            await trio.sleep_forever()  # a shielded wait must not be unbounded

    model = TestModel(default=Reply(error=ModelError("gone", retryable=False)))
    started = trio.current_time()
    with pytest.raises(ModelError):
        async with chat(model, "hi", middleware=[Hangs()], cleanup_grace=2.0) as run:
            await run.result()
    assert trio.current_time() - started == pytest.approx(2.0)
    assert any("reporting a failed run" in record.getMessage() for record in caplog.records)


class BreaksOnToolCallStart(ChatMiddleware):
    def on_chunk(self, ctx: Any, event: Any) -> None:
        from trio_agent.lifecycle import ToolCallStart

        if isinstance(event, ToolCallStart):
            raise ValueError("on_chunk bug")


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("form", ["await", "block"])
async def test_a_plain_hook_error_in_a_turn_of_several_calls_fails_the_run_as_with_one_call(
    calls: int, form: str
) -> None:
    errors: list[BaseException] = []

    class Errors(ChatMiddleware):
        def on_error(self, ctx: Any, info: Any) -> None:
            errors.append(info.error)

    model = TestModel(default=[Reply(tool_calls=[("echo", {})] * calls), Reply(text="done")])
    middleware = [BreaksOnToolCallStart(), Errors()]
    with pytest.raises(ValueError, match="on_chunk bug") as caught:
        if form == "await":
            await chat(model, "hi", tools=[echo], middleware=middleware)
        else:
            async with chat(model, "hi", tools=[echo], middleware=middleware) as run:
                await run.result()
    assert not isinstance(caught.value, BaseExceptionGroup)
    assert errors == [caught.value]  # on_error got the same one exception


class Quiet(ChatMiddleware):
    """A second middleware: with it, the failing one is composed."""

    def on_usage(self, ctx: Any, usage: Any) -> None:
        return None


@pytest.mark.parametrize("parts", [1, 2])
async def test_a_failing_on_abort_or_on_error_is_logged_however_many_middleware(
    parts: int, caplog: pytest.LogCaptureFixture
) -> None:
    class BadAbort(ChatMiddleware):
        def on_iteration(self, ctx: Any, info: Any) -> None:
            ctx.abort("stop now")

        def on_abort(self, ctx: Any, info: Any) -> None:
            raise RuntimeError("on_abort broke")

    class BadError(ChatMiddleware):
        def on_start(self, ctx: Any) -> None:
            raise ValueError("the run's real error")

        def on_error(self, ctx: Any, info: Any) -> None:
            raise RuntimeError("on_error broke")

    extra: list[ChatMiddleware] = [Quiet()] if parts == 2 else []
    with caplog.at_level(logging.ERROR, logger="trio_agent.lifecycle"):
        result = await chat(TestModel(default=Reply(text="hi")), "go", middleware=[BadAbort(), *extra])
        assert result.stop_reason is StopReason.ABORTED
        with pytest.raises(ValueError, match="the run's real error"):
            await chat(TestModel(default=Reply(text="hi")), "go", middleware=[BadError(), *extra])
    logged = [record.getMessage() for record in caplog.records if record.name == "trio_agent.lifecycle"]
    assert logged == ["on_abort of BadAbort failed", "on_error of BadError failed"]


@pytest.mark.parametrize("form", ["await", "async with"])
async def test_a_run_cancelled_from_outside_ends_with_on_abort(
    autojump_clock: trio.testing.MockClock, form: str
) -> None:
    class Watch(Terminal):
        async def on_abort(self, ctx: Any, info: Any) -> None:
            await trio.sleep(0.5)  # shielded (and bounded): the cancellation does not cut it short
            self.terminal.append(f"abort: {info.reason} ({info.kind.value})")

    watch = Watch()
    model = TestModel(default=Reply(text="hi", latency=5))
    with trio.move_on_after(1) as scope:
        if form == "await":
            await chat(model, "go", middleware=[watch])
        else:
            async with chat(model, "go", middleware=[watch]) as run:
                await run.result()
    assert scope.cancelled_caught
    assert len(watch.terminal) == 1 and watch.terminal[0].startswith("abort: ")


async def test_the_on_abort_of_a_run_cancelled_from_outside_is_bounded(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    class Hangs(ChatMiddleware):
        async def on_abort(self, ctx: Any, info: Any) -> None:
            await trio.sleep_forever()

    started = trio.current_time()
    with trio.move_on_after(1):
        await chat(TestModel(default=Reply(text="hi", latency=5)), "go", middleware=[Hangs()], cleanup_grace=2.0)
    assert trio.current_time() - started == pytest.approx(3.0)
    assert any("a cancelled run ended" in record.getMessage() for record in caplog.records)


class HoldsItsTerminalHook(ChatMiddleware):
    """An async on_finish / on_abort that waits (a flush to a remote service, say) until released."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()
        self.done = False

    async def _hold(self) -> None:
        self.entered.set()
        await self.release.wait()
        self.done = True

    async def on_finish(self, ctx: Any, info: Any) -> None:
        await self._hold()

    async def on_abort(self, ctx: Any, info: Any) -> None:
        await self._hold()


class AbortsAtStart(ChatMiddleware):
    def on_start(self, ctx: Any) -> None:
        ctx.abort("stop now")


@pytest.mark.parametrize("ending", ["finish", "abort"])
@pytest.mark.parametrize("form", ["await", "async with"])
async def test_a_cancellation_landing_in_a_terminal_hook_still_tells_every_later_middleware(
    ending: str, form: str
) -> None:
    holds, terminal = HoldsItsTerminalHook(), Terminal()
    middleware = [*([AbortsAtStart()] if ending == "abort" else []), holds, terminal]
    scope = trio.CancelScope()
    reached: list[str] = []

    async def caller() -> None:
        with scope:
            if form == "await":
                await chat(TestModel(default=Reply(text="hi")), "go", middleware=middleware)
            else:
                async with chat(TestModel(default=Reply(text="hi")), "go", middleware=middleware) as run:
                    await run.result()
            reached.append("after the run")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            await holds.entered.wait()
            scope.cancel()  # lands in the first middleware's terminal hook
            await trio.testing.wait_all_tasks_blocked()
            assert not holds.done and terminal.terminal == []  # shielded: the hook is not cut short
            holds.release.set()
    assert holds.done
    assert terminal.terminal == [ending]  # the later middleware was told too, exactly once
    assert scope.cancelled_caught and reached == []  # then the cancellation went on


async def test_the_on_finish_of_a_run_cancelled_during_it_is_bounded(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    class Hangs(ChatMiddleware):
        async def on_finish(self, ctx: Any, info: Any) -> None:
            await trio.sleep_forever()

    started = trio.current_time()
    with trio.move_on_after(1) as scope:
        await chat(TestModel(default=Reply(text="hi")), "go", middleware=[Hangs(), Quiet()], cleanup_grace=2.0)
    assert scope.cancelled_caught
    assert trio.current_time() - started == pytest.approx(2.0)  # the grace, from when on_finish began
    assert any("a run finished (on_finish)" in record.getMessage() for record in caplog.records)


class FailsOnChunk(ChatMiddleware):
    """An on_chunk that fails on every event, or only on the terminal RunError."""

    def __init__(self, every: bool) -> None:
        self.every = every

    def on_chunk(self, ctx: Any, event: Any) -> None:
        from trio_agent.lifecycle import RunError

        if self.every or isinstance(event, RunError):
            raise ValueError("on_chunk bug")


class FailsAtStart(ChatMiddleware):
    def on_start(self, ctx: Any) -> None:
        raise RuntimeError("the run's own error")


@pytest.mark.parametrize("every", [True, False], ids=["fails-on-every-event", "fails-on-run-error"])
async def test_a_run_error_that_on_chunk_fails_on_still_reaches_the_stream(every: bool) -> None:
    from trio_agent.lifecycle import RunError

    # Failing on every event, on_chunk fails the run itself; else the run fails on its own.
    middleware = [FailsOnChunk(every)] if every else [FailsOnChunk(every), FailsAtStart()]
    error = ValueError if every else RuntimeError
    async with chat(TestModel(default=Reply(text="hi")), "go", middleware=middleware) as run:
        events = [event async for event in run]
        with pytest.raises(error):
            await run.result()
    assert events and isinstance(events[-1], RunError)  # the stream ends with its terminal event
    assert [type(event).__name__ for event in events].count("RunError") == 1
    assert events[-1].message == ("on_chunk bug" if every else "the run's own error")


async def test_a_tool_outcome_says_ran_only_for_a_call_whose_tool_body_was_entered() -> None:
    from trio_agent.lifecycle import Refuse, Skip, define_chat_middleware

    entered: list[str] = []

    @define_tool(
        name="note", description="note", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def note(input: dict[str, Any], ctx: Any) -> str:
        entered.append(input["as"])
        return "noted"

    calls = [("note", {"as": "refused"}), ("note", {"as": "skipped"}), ("nowhere", {}), ("note", {"as": "runs"})]
    model = TestModel(default=[Reply(tool_calls=calls), Reply(text="done")])
    outcomes: list[Any] = []
    middleware = define_chat_middleware(
        on_before_tool_call=lambda ctx, call: Skip("cached") if call.args.get("as") == "skipped" else None,
        on_guard_tool_call=lambda ctx, call: Refuse("no") if call.args.get("as") == "refused" else None,
        on_tool_phase_complete=lambda ctx, info: outcomes.extend(info.outcomes),
    )
    await chat(model, "go", tools=[note], middleware=[middleware])
    assert entered == ["runs"]
    assert [(outcome.call.name, outcome.ran) for outcome in outcomes] == [
        ("note", False),  # refused by on_guard_tool_call
        ("note", False),  # answered by on_before_tool_call's Skip
        ("nowhere", False),  # unknown tool
        ("note", True),
    ]
    assert [outcome.result.ok for outcome in outcomes] == [False, True, False, True]
