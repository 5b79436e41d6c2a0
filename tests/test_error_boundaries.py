"""Typed errors at the public boundaries, when user code misbehaves (a review's findings).

* An exception whose ``__str__`` / ``__repr__`` raises: recording a request's end formatted it
  (``ErrorInfo.of``: ``str(error)``), so the request stayed ``started`` in the journal, ``send()``
  raised the library's own ``RuntimeError`` and every later ``send()`` was refused; the loop's
  ``RunError``, the model service's messages and the other places that tell a user's exception
  replaced it with that ``RuntimeError`` too. One helper tells them all (`describe`), never raising.
* ``await chat()`` let a bare exception group out (a tool's own nursery, cancelled from outside,
  whose cleanup raised), where the block form and ``send()`` raise one exception; ``send()`` let
  that foreign error out untyped.
* A ``trio.Cancelled`` user code raised of its own (its scope already left: nothing around it
  cancelled) left ``send()`` / ``chat()`` as a cancellation nobody made, from tool middleware, a
  session hook, model middleware, a provider, a lifecycle hook, a tool stage or a permission
  handler. It is that layer's failure now; a real cancellation still goes on.
* A request this session started and could not end in the journal made the next ``send()`` say
  an earlier owner had left it (``unfinished='keep'``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from cancel_helpers import cancelled_of_its_own, nursery_failing_in_cleanup

from trio_agent import (
    HookError,
    HookEvent,
    JournalFencedError,
    MiddlewareConfig,
    MiddlewareError,
    ModelError,
    RequestAbortedError,
    SettlementError,
    SideEffect,
    UnfinishedRequestError,
    define_tool,
    open_session,
)
from trio_agent._chat._chat import chat
from trio_agent._errors import ModelMiddlewareError
from trio_agent._groups import first_failure
from trio_agent._journal._events import ErrorInfo, RequestFailed, RequestInterrupted, RequestInterruptReason
from trio_agent._tools._results import describe
from trio_agent.journal import MemoryStore, open_journal
from trio_agent.lifecycle import LifecycleHookError, ToolCallResult, define_chat_middleware
from trio_agent.models import ModelRequest, ModelResponse, StreamChunk, ToolResultMessage
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object"}


class Unprintable(Exception):
    """A user's exception whose ``__str__`` and ``__repr__`` raise."""

    def __str__(self) -> str:
        raise RuntimeError("str boom")

    def __repr__(self) -> str:
        raise RuntimeError("repr boom")

    @property
    def code(self) -> str:
        raise RuntimeError("code boom")


UNPRINTABLE = "Unprintable (unprintable: its __str__ and __repr__ failed)"


@define_tool(name="ok", description="answers", input_schema=OBJECT, side_effect=SideEffect.PURE)
async def ok(input: dict[str, Any], ctx: Any) -> str:
    return "ok"


def calling_ok() -> TestModel:
    return TestModel(default=[Reply(tool_calls=[("ok", {})]), Reply("done")])


async def stored_events(session: Any) -> list[Any]:
    return [envelope.event for envelope in await session.journal.store.read(session.journal.stream_id())]


# -- an exception that cannot be told -------------------------------------------------------------------------


def test_what_the_journal_keeps_of_an_unprintable_exception() -> None:
    info = ErrorInfo.of(Unprintable())
    assert (info.message, info.code, info.retryable) == (UNPRINTABLE, None, False)
    assert describe(Unprintable()) == UNPRINTABLE


def raising_on_finish() -> Any:
    calls = 0

    async def on_finish(ctx: Any, info: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Unprintable()

    return define_chat_middleware(name="m", on_finish=on_finish)


async def test_a_request_that_failed_with_an_unprintable_exception_is_recorded_and_the_session_goes_on() -> None:
    async with open_session(provider=TestModel(default=Reply("x")), lifecycle=[raising_on_finish()]) as session:
        with pytest.raises(RequestAbortedError) as caught:
            await session.send("hi")
        assert caught.value.reason == "error" and isinstance(caught.value.__cause__, Unprintable)
        assert UNPRINTABLE in str(caught.value)
        assert session.journal.projection().unfinished_requests() == []
        failed = [event for event in await stored_events(session) if isinstance(event, RequestFailed)]
        assert [event.error.message for event in failed] == [UNPRINTABLE]
        assert await session.send("again") == "x"


async def test_chat_with_a_journal_records_the_end_of_a_run_that_failed_unprintably() -> None:
    async with open_journal(MemoryStore()) as journal:
        with pytest.raises(Unprintable):
            await chat(TestModel(default=Reply("x")), "hi", journal=journal, middleware=[raising_on_finish()])
        assert journal.projection().unfinished_requests() == []


@pytest.mark.parametrize("hook", ["on_start", "on_usage"])
async def test_a_hook_that_raises_an_unprintable_exception_fails_the_run_with_it(hook: str) -> None:
    # The loop's RunError formatted it: chat() raised our RuntimeError, send() had it as the cause.
    async def failing(*args: Any) -> None:
        raise Unprintable()

    middleware = define_chat_middleware(name="m", **{hook: failing})
    with pytest.raises(Unprintable):
        await chat(TestModel(default=Reply("x")), "hi", middleware=[middleware])
    async with open_session(provider=TestModel(default=Reply("x")), lifecycle=[middleware]) as session:
        with pytest.raises(RequestAbortedError) as caught:
            await session.send("hi")
    assert isinstance(caught.value.__cause__, Unprintable)


async def test_several_on_finish_failures_that_cannot_be_told_are_one_lifecycle_hook_error() -> None:
    async def failing(*args: Any) -> None:
        raise Unprintable()

    parts = [define_chat_middleware(name=name, on_finish=failing) for name in ("a", "b")]
    with pytest.raises(LifecycleHookError) as caught:
        await chat(TestModel(default=Reply("x")), "hi", middleware=parts)
    assert str(caught.value) == f"on_finish failed in 2 parts: 'a': {UNPRINTABLE}; 'b': {UNPRINTABLE}"


def test_the_failures_beside_the_first_are_noted_even_when_they_cannot_be_told() -> None:
    first = ValueError("first")
    assert first_failure(ExceptionGroup("turn", [first, Unprintable()])) is first
    assert first.__notes__ == [f"1 more failure(s) beside it: {UNPRINTABLE}"]


class RaisingProvider(TestModel):
    """A provider whose calls raise a user exception that cannot be told."""

    async def chat(self, request: ModelRequest) -> ModelResponse:
        raise Unprintable()

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        async def chunks() -> AsyncIterator[StreamChunk]:
            raise Unprintable()
            yield

        return chunks()


class RaisingMiddleware:
    async def wrap_stream(self, request: Any, call_next: Any) -> AsyncIterator[StreamChunk]:
        raise Unprintable()
        yield


async def test_a_provider_or_model_middleware_raising_an_unprintable_exception_is_a_typed_model_error() -> None:
    # Their messages took its repr: a provider's failure became a middleware bug without its cause,
    # a middleware's failure our RuntimeError.
    async with open_session(provider=RaisingProvider()) as session:
        with pytest.raises(ModelError) as provider:
            await session.send("hi")
    assert provider.value.code == "provider_failed" and isinstance(provider.value.__cause__, Unprintable)
    assert str(provider.value) == f"the provider raised {UNPRINTABLE}"
    middleware = MiddlewareConfig(model=[RaisingMiddleware()])
    async with open_session(provider=TestModel(default=Reply("x")), middleware=middleware) as session:
        with pytest.raises(ModelMiddlewareError) as layer:
            await session.send("hi")
    assert isinstance(layer.value.__cause__, Unprintable)
    assert str(layer.value) == f"model middleware raised {UNPRINTABLE}"


async def test_an_error_out_of_a_turns_tool_calls_keeps_its_own_cause() -> None:
    # The turn's nursery group was unwrapped with `raise ... from None`, which wiped the error's own
    # __cause__ (so did a model call's error re-raised after on_model_error: a provider's exception).
    cause = KeyError("why")

    async def on_chunk(ctx: Any, event: Any) -> None:
        if isinstance(event, ToolCallResult):
            raise ValueError("cannot pass this on") from cause

    middleware = define_chat_middleware(name="m", on_chunk=on_chunk)
    model = TestModel(default=[Reply(tool_calls=[("ok", {}), ("ok", {})]), Reply("done")])  # side by side
    with pytest.raises(ValueError, match="cannot pass this on") as caught:
        await chat(model, "hi", tools=[ok], middleware=[middleware])
    assert caught.value.__cause__ is cause


# -- a group out of the awaited chat() ------------------------------------------------------------------------


def cancelling_tool(scope: trio.CancelScope) -> Any:
    """A tool that cancels *scope* (around the caller) and runs a nursery whose cleanup fails."""

    @define_tool(name="fan", description="fans out", input_schema=OBJECT, side_effect=SideEffect.PURE)
    async def fan(input: dict[str, Any], ctx: Any) -> str:
        scope.cancel()
        await nursery_failing_in_cleanup()

    return fan


def calling_fan() -> TestModel:
    return TestModel(default=[Reply(tool_calls=[("fan", {})]), Reply("done")])


async def test_awaited_chat_cancelled_while_a_tool_nursery_fails_in_cleanup_raises_one_error() -> None:
    # The block form raised the ValueError; the awaited form a BaseExceptionGroup (ExceptionGroup
    # out of the scope), though chat() never raises a group of its own.
    with trio.CancelScope() as scope, pytest.raises(ValueError, match="cleanup failed"):
        await chat(calling_fan(), "hi", tools=[cancelling_tool(scope)])
    with trio.CancelScope() as scope, pytest.raises(ValueError, match="cleanup failed"):
        async with chat(calling_fan(), "hi", tools=[cancelling_tool(scope)]) as run:
            await run.result()


async def test_send_cancelled_while_a_tool_nursery_fails_in_cleanup_raises_the_interruption_typed() -> None:
    # The ValueError left send() as it was, untyped: now the request's end as the journal has it.
    scope = trio.CancelScope()
    tools = [cancelling_tool(scope)]
    async with open_session(provider=calling_fan(), tools=tools, permissions={"allow": ["fan"]}) as session:
        with pytest.raises(RequestAbortedError) as caught, scope:
            await session.send("hi")
        assert caught.value.reason == "user_abort" and isinstance(caught.value.__cause__, ValueError)
        interrupted = [event for event in await stored_events(session) if isinstance(event, RequestInterrupted)]
        assert [event.reason for event in interrupted] == [RequestInterruptReason.USER_ABORT]
        assert session.journal.projection().unfinished_requests() == []


# -- a Cancelled of user code's own ---------------------------------------------------------------------------


async def stray(*args: Any) -> Any:
    raise await cancelled_of_its_own()


class StrayMiddleware:
    async def wrap_stream(self, request: Any, call_next: Any) -> AsyncIterator[StreamChunk]:
        raise await cancelled_of_its_own()
        yield


class StrayProvider(TestModel):
    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        async def chunks() -> AsyncIterator[StreamChunk]:
            raise await cancelled_of_its_own()
            yield

        return chunks()


STRAY = "nothing around it was cancelled"

FAILING_SITES: dict[str, tuple[dict[str, Any], type[Exception]]] = {
    "session hook": ({"hooks": {HookEvent.USER_PROMPT_SUBMIT: [stray]}}, HookError),
    "model middleware": ({"middleware": MiddlewareConfig(model=[StrayMiddleware()])}, ModelMiddlewareError),
    "provider": ({"provider": StrayProvider()}, ModelError),
    "lifecycle on_start": ({"lifecycle": [define_chat_middleware(name="m", on_start=stray)]}, MiddlewareError),
    "lifecycle on_finish": ({"lifecycle": [define_chat_middleware(name="m", on_finish=stray)]}, MiddlewareError),
}


@pytest.mark.parametrize("site", FAILING_SITES)
async def test_a_cancelled_of_user_codes_own_fails_the_request_typed(site: str) -> None:
    # It left send() as a bare Cancelled: no scope around it would catch it.
    options, error = FAILING_SITES[site]
    options = {"provider": TestModel(default=Reply("x")), **options}
    async with open_session(**options) as session:
        try:
            with pytest.raises(error) as caught:
                await session.send("hi")
        except trio.Cancelled:  # a Cancelled out of a test would end it silently, as passed
            pytest.fail("the Cancelled of user code's own left send() as a cancellation")
        assert isinstance(caught.value, RequestAbortedError) or STRAY in str(caught.value)
        assert session.journal.projection().unfinished_requests() == []


@pytest.mark.parametrize("site", ["model middleware", "provider", "lifecycle on_start"])
async def test_a_cancelled_of_user_codes_own_fails_chat_typed(site: str) -> None:
    options, error = FAILING_SITES[site]
    kwargs: dict[str, Any] = {}
    if "middleware" in options:
        kwargs["model_middleware"] = list(options["middleware"].model)
    if "lifecycle" in options:
        kwargs["middleware"] = options["lifecycle"]
    try:
        with pytest.raises(error, match=STRAY):
            await chat(options.get("provider", TestModel(default=Reply("x"))), "hi", **kwargs)
    except trio.Cancelled:
        pytest.fail("the Cancelled of user code's own left chat() as a cancellation")


async def stray_permission_handler(request: Any) -> Any:
    raise await cancelled_of_its_own()


CALL_SITES: dict[str, dict[str, Any]] = {
    "PreToolUse hook": {"hooks": {HookEvent.PRE_TOOL_USE: [stray]}},
    "PostToolUse hook": {"hooks": {HookEvent.POST_TOOL_USE: [stray]}},
    "on_before_tool_call": {"lifecycle": [define_chat_middleware(name="m", on_before_tool_call=stray)]},
    "on_after_tool_call": {"lifecycle": [define_chat_middleware(name="m", on_after_tool_call=stray)]},
    "tool middleware": {"middleware": MiddlewareConfig(tool=[stray])},
    "permission handler": {"permission_handler": stray_permission_handler},
}


@pytest.mark.parametrize("site", CALL_SITES)
async def test_a_cancelled_of_user_codes_own_around_a_call_fails_that_call(site: str) -> None:
    # Stages, hooks and middleware around a tool call fail closed: the call's error, the run goes on.
    options = CALL_SITES[site]
    permissions = {} if "permission_handler" in options else {"permissions": {"allow": ["ok"]}}
    model = calling_ok()
    async with open_session(provider=model, tools=[ok], **permissions, **options) as session:
        try:
            assert await session.send("hi") == "done"
        except trio.Cancelled:
            pytest.fail("the Cancelled of user code's own left send() as a cancellation")
    answers = [m for m in model.requests[-1].messages if isinstance(m, ToolResultMessage)]
    assert len(answers) == 1 and answers[0].is_error and STRAY in answers[0].content


def waiting_sites(entered: trio.Event) -> dict[str, dict[str, Any]]:
    async def waits(*args: Any) -> None:
        entered.set()
        await trio.sleep_forever()

    class Waits:
        async def wrap_stream(self, request: Any, call_next: Any) -> AsyncIterator[StreamChunk]:
            await waits()
            yield

    return {
        "session hook": {"hooks": {HookEvent.USER_PROMPT_SUBMIT: [waits]}},
        "model middleware": {"middleware": MiddlewareConfig(model=[Waits()])},
        "lifecycle on_start": {"lifecycle": [define_chat_middleware(name="m", on_start=waits)]},
        "tool middleware": {"middleware": MiddlewareConfig(tool=[waits])},
        "on_before_tool_call": {"lifecycle": [define_chat_middleware(name="m", on_before_tool_call=waits)]},
    }


@pytest.mark.parametrize("site", list(waiting_sites(trio.Event())))
async def test_a_real_cancellation_in_user_code_still_propagates(site: str) -> None:
    # The caller's own scope cancelled while user code waits: a cancellation, as before.
    entered = trio.Event()
    options = waiting_sites(entered)[site]
    async with open_session(provider=calling_ok(), tools=[ok], permissions={"allow": ["ok"]}, **options) as session:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_entered() -> None:
                    await entered.wait()
                    scope.cancel()

                nursery.start_soon(cancel_when_entered)
                await session.send("hi")
        assert scope.cancelled_caught
        interrupted = [e for e in await stored_events(session) if isinstance(e, RequestInterrupted)]
        assert [e.reason for e in interrupted] == [RequestInterruptReason.USER_ABORT]


# -- a request this session left open -------------------------------------------------------------------------


async def test_a_request_whose_end_could_not_be_recorded_here_is_not_blamed_on_an_earlier_owner() -> None:
    holder: list[Any] = []

    @define_tool(name="fence", description="fences", input_schema=OBJECT, side_effect=SideEffect.PURE)
    async def fence(input: dict[str, Any], ctx: Any) -> str:
        holder[0].journal._fence("test: a write of unknown outcome")
        return "x"

    model = TestModel(default=[Reply(tool_calls=[("fence", {})]), Reply("done")])
    async with open_session(provider=model, tools=[fence], permissions={"allow": ["fence"]}) as session:
        holder.append(session)
        with pytest.raises(SettlementError):  # the fence refused the call's settlement
            await session.send("hi")
        (left,) = session.journal.projection().unfinished_requests()
        with pytest.raises(JournalFencedError):  # what refuses its end, not an earlier owner
            await session.send("again")
        await session.journal.reconcile()
        with pytest.raises(UnfinishedRequestError) as caught:
            await session.send("again")
    assert caught.value.request_id == left.request_id
    assert "started here" in str(caught.value) and "earlier owner" not in str(caught.value)
