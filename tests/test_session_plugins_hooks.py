"""Plugins and hook events inside real sessions (`open_session` with the deterministic `TestModel`).

What is pinned here, against docs/plugins.md and the per-event table of docs/hooks.md:

* plugin middleware order in a real run (tool middleware and model ``wrap_stream``): the
  session's outermost, then plugins in list order, each plugin's list in its own order;
* plugin tools get no exemption (allowed/disallowed lists, permission rules, path policy);
* duplicate tool names across built-ins (``task``), session tools and plugins, duplicate and
  invalid plugin names: rejected before the session starts;
* every hook event as the session acts on it, session hooks before plugin hooks, per-event
  deadlines (autojump clock), garbage returns: typed errors or model-visible denials, never a
  wedged session.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
import trio
import trio.testing

from tests.session_helpers import run_request, stream_events, user_texts
from trio_agent import (
    ConfigError,
    HookError,
    HookEvent,
    HookInput,
    HookOutput,
    ModelMiddleware,
    PermissionAllow,
    PermissionRequest,
    RequestAbortedError,
    SubagentDefinition,
    Tool,
    ToolContext,
    ToolErrorType,
    ToolFailure,
    ToolResult,
    ToolResultEvent,
    define_plugin,
    define_tool,
    open_session,
)
from trio_agent._journal._events import (
    PermissionRequested,
    PermissionResolved,
    PromptSubmitted,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    SessionClosed,
    ToolCancelled,
    ToolFailed,
    ToolScheduled,
    ToolStarted,
)
from trio_agent._session._plugins import MiddlewareConfig
from trio_agent.journal import MemoryStore
from trio_agent.lifecycle import ChatMiddleware
from trio_agent.lifecycle import Skip as LifecycleSkip
from trio_agent.models import ModelRequest, StreamChunk, SystemMessage, ToolResultMessage
from trio_agent.plugins import HookAbortedError, HookReturnError, HookTimeoutError
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import ToolMiddlewareRequest

# -- helpers -----------------------------------------------------------------------------


def make_tool(
    name: str,
    log: list[Any] | None = None,
    *,
    kind: str = "readonly",
    paths: bool = False,
    fail: bool = False,
) -> Tool[Any]:
    """A tool that records the input it ran with (``log``) and echoes it."""

    async def run(inp: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if log is not None:
            log.append((name, ctx.agent_id, dict(inp)))
        if fail:
            raise ToolFailure(f"{name} broke on {inp.get('x')}")
        return ToolResult.success(f"{name}:{inp.get('x', '')}")

    return define_tool(
        run,
        name=name,
        description=f"the {name} tool",
        side_effect="pure" if kind == "readonly" else "idempotent",
        kind=kind,
        input_schema={
            "type": "object",
            "properties": {"x": {"type": "string"}, "path": {"type": "string"}, "extra": {"type": "string"}},
        },
        affected_paths=(lambda inp: [inp["path"]] if "path" in inp else []) if paths else None,
    )


async def stream_types(session: Any, agent_id: str | None = None) -> list[type[Any]]:
    return [type(envelope.event) for envelope in await session.journal.store.read(session.journal.stream_id(agent_id))]


def tool_results(request: ModelRequest) -> list[ToolResultMessage]:
    return [m for m in request.messages if isinstance(m, ToolResultMessage)]


def tool_layer(tag: str, log: list[str]) -> Callable[[ToolMiddlewareRequest, Any], Awaitable[ToolResult]]:
    async def layer(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        log.append(f"{tag}:before")
        result: ToolResult = await call_next()
        log.append(f"{tag}:after")
        return result

    layer.__qualname__ = f"tool_layer_{tag}"
    return layer


class StreamLayer(ModelMiddleware):
    """Model middleware that records when it is entered and left around a streamed call."""

    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag = tag
        self.log = log

    async def wrap_stream(
        self, request: ModelRequest, call_next: Callable[[ModelRequest | None], AsyncIterator[StreamChunk]]
    ) -> AsyncIterator[StreamChunk]:
        self.log.append(f"{self.tag}:before")
        async for chunk in call_next(request):
            yield chunk
        self.log.append(f"{self.tag}:after")


def onion(tags: Sequence[str]) -> list[str]:
    return [f"{t}:before" for t in tags] + [f"{t}:after" for t in reversed(tags)]


# ======================================================================== plugins


async def test_tool_and_model_middleware_order_in_a_real_session() -> None:
    """Session middleware outermost, then plugins in list order, each plugin's list in its order:
    recorded for the tool middleware around a real call and for ``wrap_stream`` around each model call."""
    tool_log: list[str] = []
    model_log: list[str] = []
    ran: list[Any] = []
    p1 = define_plugin(
        name="p1",
        middleware=MiddlewareConfig(
            model=[StreamLayer("P1a", model_log), StreamLayer("P1b", model_log)],
            tool=[tool_layer("p1a", tool_log), tool_layer("p1b", tool_log)],
        ),
    )
    p2 = define_plugin(
        name="p2",
        middleware=MiddlewareConfig(model=[StreamLayer("P2", model_log)], tool=[tool_layer("p2", tool_log)]),
        tools=[make_tool("ptool", ran)],
    )
    model = TestModel({"go": [Reply(tool_calls=[("ptool", {"x": "1"})]), Reply(text="done")]})
    async with open_session(
        provider=model,
        plugins=[p1, p2],
        middleware=MiddlewareConfig(
            model=[StreamLayer("S1", model_log), StreamLayer("S2", model_log)],
            tool=[tool_layer("s1", tool_log), tool_layer("s2", tool_log)],
        ),
    ) as session:
        assert await session.send("go") == "done"
    assert ran == [("ptool", "root", {"x": "1"})]
    assert tool_log == onion(["s1", "s2", "p1a", "p1b", "p2"])
    # Two model calls, each wrapped by the whole stack in the same order.
    assert len(model.requests) == 2
    assert model_log == onion(["S1", "S2", "P1a", "P1b", "P2"]) * 2


class ChatOnly(ModelMiddleware):
    async def wrap_chat(self, request: Any, call_next: Any) -> Any:
        return await call_next(request)  # pragma: no cover - a session never calls it


class SideQueryOnly(ModelMiddleware):
    async def wrap_side_query(self, request: Any, call_next: Any) -> Any:
        return await call_next(request)  # pragma: no cover


class RetryEventsOnly(ModelMiddleware):
    async def wrap_chat_with_retry_events(self, request: Any, call_next: Any) -> AsyncIterator[Any]:
        async for item in call_next(request):  # pragma: no cover
            yield item


class DuckChat:
    """Not a ModelMiddleware subclass: only its wrappers count."""

    async def wrap_chat(self, request: Any, call_next: Any) -> Any:
        return await call_next(request)  # pragma: no cover


class ChatAndStream(StreamLayer):
    async def wrap_chat(self, request: Any, call_next: Any) -> Any:
        return await call_next(request)  # pragma: no cover


@pytest.mark.parametrize(
    ("layer", "defined"),
    [
        (ChatOnly(), "wrap_chat"),
        (SideQueryOnly(), "wrap_side_query"),
        (RetryEventsOnly(), "wrap_chat_with_retry_events"),
        (DuckChat(), "wrap_chat"),
    ],
)
@pytest.mark.parametrize("where", ["session", "plugin"])
async def test_model_middleware_without_wrap_stream_rejects_the_session(layer: Any, defined: str, where: str) -> None:
    """A session streams every model turn: middleware that cannot wrap a stream would silently never run."""
    config = MiddlewareConfig(model=[StreamLayer("fine", []), layer])
    options: dict[str, Any] = (
        {"middleware": config} if where == "session" else {"plugins": [define_plugin(name="timing", middleware=config)]}
    )
    model = TestModel(default=Reply(text="never"))
    with pytest.raises(ConfigError) as info:
        async with open_session(provider=model, **options):
            pytest.fail("must not start")  # pragma: no cover
    message = str(info.value)
    owner = "session" if where == "session" else "plugin 'timing'"
    assert message.startswith(f"{owner} model middleware #1 ({type(layer).__name__}) defines {defined} but not")
    assert "a session streams every model turn" in message and "define wrap_stream" in message
    assert model.requests == []


async def test_model_middleware_with_wrap_stream_and_wrap_chat_runs_in_a_session() -> None:
    log: list[str] = []
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model, middleware=MiddlewareConfig(model=[ChatAndStream("both", log)])) as s:
        assert await s.send("hi") == "ok"
    assert log == ["both:before", "both:after"]


def _first_python_block(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        text = file.read()
    opening = text.index("```python")  # "```python" or "```python fragment" (needs the test's namespace)
    start = text.index("\n", opening) + 1
    return text[start : text.index("```", start)]


async def test_the_plugins_md_example_runs_in_a_session() -> None:
    """docs/plugins.md's opening example, executed: its Timing middleware times every model turn of a
    session (it used to define only wrap_chat, which a session never calls)."""
    import logging

    import attrs

    observed: list[float] = []

    class Metrics:
        def observe(self, seconds: float) -> None:
            observed.append(seconds)

    @attrs.define
    class ReviewInput:
        diff: str

    docs = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "plugins.md")
    namespace: dict[str, Any] = {
        "trio": trio,
        "metrics": Metrics(),
        "audit_log": logging.getLogger("tests.plugins_md"),
        "ReviewInput": ReviewInput,
    }
    exec(compile(_first_python_block(docs), "docs/plugins.md", "exec"), namespace)
    model = TestModel(default=Reply(text="lgtm"))
    async with open_session(provider=model, plugins=[namespace["review"]]) as session:
        assert await session.send("check this") == "lgtm"
        assert await session.send("and this") == "lgtm"
    assert len(observed) == len(model.requests) == 2
    assert all(seconds >= 0 for seconds in observed)
    assert "[review]\ncheck this" in user_texts(model.requests[0])


async def test_plugin_order_follows_the_plugins_list_not_definition_order() -> None:
    log: list[str] = []
    later = define_plugin(name="defined-first", middleware=MiddlewareConfig(tool=[tool_layer("A", log)]))
    earlier = define_plugin(name="defined-second", middleware=MiddlewareConfig(tool=[tool_layer("B", log)]))
    model = TestModel({"go": [Reply(tool_calls=[("echo", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[make_tool("echo")], plugins=[earlier, later]) as session:
        await session.send("go")
    assert log == onion(["B", "A"])


async def test_plugin_hook_and_tool_work_in_a_session() -> None:
    """A plugin's UserPromptSubmit hook changes the prompt the model sees; its tool runs and its result
    reaches the model."""
    ran: list[Any] = []

    async def tag_prompt(inp: HookInput) -> HookOutput:
        return HookOutput.modify(f"[review] {inp.prompt}")

    review = define_plugin(
        name="review", hooks={HookEvent.USER_PROMPT_SUBMIT: [tag_prompt]}, tools=[make_tool("review_diff", ran)]
    )
    model = TestModel({"[review] check": [Reply(tool_calls=[("review_diff", {"x": "d"})]), Reply(text="lgtm")]})
    async with open_session(provider=model, plugins=[review]) as session:
        assert await session.send("check") == "lgtm"
    assert user_texts(model.requests[0]) == ["[review] check"]
    assert "review_diff" in {spec.name for spec in model.requests[0].tools}
    assert ran == [("review_diff", "root", {"x": "d"})]
    assert [(m.content, m.is_error) for m in tool_results(model.requests[1])] == [("review_diff:d", False)]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"disallowed_tools": ["ptool"]}, id="disallowed"),
        pytest.param({"allowed_tools": ["echo"]}, id="not-in-allowed"),
        pytest.param({"allowed_tools": []}, id="allowed-empty"),
        pytest.param({"permissions": {"deny": ["ptool"]}}, id="deny-rule"),
        pytest.param({"permissions": {"deny": ["ptool:*"]}, "permission_mode": "bypass"}, id="deny-rule-bypass"),
    ],
)
async def test_plugin_tools_get_no_exemption_from_lists_and_rules(options: dict[str, Any]) -> None:
    ran: list[Any] = []
    plugin = define_plugin(name="web", tools=[make_tool("ptool", ran)])
    model = TestModel({"go": [Reply(tool_calls=[("ptool", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[make_tool("echo")], plugins=[plugin], **options) as session:
        assert await session.send("go") == "ok"
    assert ran == [], "a plugin tool excluded by the session's lists or rules must never run"
    [result] = tool_results(model.requests[1])
    assert result.is_error
    if "permissions" in options:
        assert "denied by rule" in result.content
    else:
        # Not even shown to the model.
        assert "ptool" not in {spec.name for spec in model.requests[0].tools}
        assert "not available" in result.content


async def test_plugin_tools_run_when_nothing_excludes_them() -> None:
    """The control of the test above: the same plugin tool, with lists that include it, runs."""
    ran: list[Any] = []
    plugin = define_plugin(name="web", tools=[make_tool("ptool", ran)])
    model = TestModel({"go": [Reply(tool_calls=[("ptool", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(
        provider=model, plugins=[plugin], allowed_tools=["ptool"], permissions={"allow": ["ptool"]}
    ) as session:
        await session.send("go")
    assert ran == [("ptool", "root", {"x": "1"})]


@pytest.mark.parametrize("where", ["outside", "dotdot", "symlink", "inside"])
async def test_plugin_tools_pass_the_path_policy(tmp_path: Any, where: str) -> None:
    workspace = tmp_path / "ws"
    outside = tmp_path / "outside"
    workspace.mkdir()
    outside.mkdir()
    os.symlink(outside, workspace / "link")
    path = {
        "outside": str(outside / "secret.txt"),
        "dotdot": "sub/../inside.txt",
        "symlink": "link/secret.txt",
        "inside": "inside.txt",
    }[where]
    ran: list[Any] = []
    plugin = define_plugin(name="fs", tools=[make_tool("pwrite", ran, kind="write", paths=True)])
    model = TestModel({"go": [Reply(tool_calls=[("pwrite", {"path": path})]), Reply(text="ok")]})
    async with open_session(
        provider=model, plugins=[plugin], workspace_roots=[workspace], permission_mode="bypass"
    ) as session:
        await session.send("go")
    [result] = tool_results(model.requests[1])
    if where == "inside":
        assert ran and not result.is_error
    else:
        assert ran == []
        assert result.is_error


@pytest.mark.parametrize(
    ("session_tools", "plugin_tools", "subagents", "sources"),
    [
        pytest.param(["task"], [], True, ("builtin", "session"), id="builtin-vs-session"),
        pytest.param([], [["task_output"]], True, ("builtin", "plugin:a"), id="builtin-vs-plugin"),
        pytest.param(["search"], [["search"]], False, ("session", "plugin:a"), id="session-vs-plugin"),
        pytest.param([], [["search"], ["search"]], False, ("plugin:a", "plugin:b"), id="plugin-vs-plugin"),
    ],
)
async def test_duplicate_tool_names_reject_the_session(
    session_tools: list[str], plugin_tools: list[list[str]], subagents: bool, sources: tuple[str, str]
) -> None:
    model = TestModel(default=Reply(text="never"))
    plugins = [
        define_plugin(name=name, tools=[make_tool(t) for t in tools])
        for name, tools in zip("ab", plugin_tools, strict=False)
    ]
    entered = False
    with pytest.raises(ConfigError, match="duplicate tool name") as info:
        async with open_session(
            provider=model,
            tools=[make_tool(t) for t in session_tools],
            plugins=plugins,
            subagents=[SubagentDefinition("helper", "helps", "You help.")] if subagents else [],
        ):
            entered = True  # pragma: no cover - the point is that this never runs
    assert not entered
    assert all(source in str(info.value) for source in sources)
    assert model.requests == []


async def test_a_session_tool_named_task_is_fine_without_subagents() -> None:
    """The built-in ``task`` tools exist only when subagents are defined."""
    ran: list[Any] = []
    model = TestModel({"go": [Reply(tool_calls=[("task", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[make_tool("task", ran)]) as session:
        await session.send("go")
    assert ran == [("task", "root", {"x": "1"})]


async def test_duplicate_plugin_names_reject_the_session() -> None:
    model = TestModel(default=Reply(text="never"))
    first = define_plugin(name="audit")
    second = define_plugin(name="audit", tools=[make_tool("other")])
    for plugins in ([first, second], [first, first]):
        with pytest.raises(ConfigError, match="audit"):
            async with open_session(provider=model, plugins=plugins):
                pytest.fail("the session must not start")  # pragma: no cover
    assert model.requests == []


@pytest.mark.parametrize("name", ["Review", "-x", "x.", "a b", "", "x" * 65, "ok\n", "a/b", None, 3])
def test_invalid_plugin_names_are_rejected(name: Any) -> None:
    with pytest.raises(ConfigError, match="plugin name"):
        define_plugin(name=name)


@pytest.mark.parametrize("name", ["review", "acme.audit", "my_plugin-2", "x", "a" * 64])
async def test_valid_plugin_names_work_in_a_session(name: str) -> None:
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model, plugins=[define_plugin(name=name)]) as session:
        assert await session.send("hi") == "ok"


# ======================================================================== UserPromptSubmit


async def test_user_prompt_submit_modified_prompt_and_context_reach_the_model() -> None:
    async def rewrite(inp: HookInput) -> HookOutput:
        return HookOutput.modify({"prompt": (inp.prompt or "").upper()}, context="extra context")

    model = TestModel({"HELLO": [Reply(text="hi there")]})
    async with open_session(provider=model, hooks={HookEvent.USER_PROMPT_SUBMIT: [rewrite]}) as session:
        assert await session.send("hello") == "hi there"
    assert user_texts(model.requests[0]) == ["HELLO", "extra context"]


async def test_user_prompt_submit_skip_makes_no_model_call() -> None:
    async def skip(inp: HookInput) -> HookOutput | None:
        return HookOutput.skip("handled locally") if (inp.prompt or "").startswith("/") else None

    model = TestModel({"/local": [Reply(text="never")], "real": [Reply(text="answered")]})
    async with open_session(provider=model, hooks={HookEvent.USER_PROMPT_SUBMIT: [skip]}) as session:
        _, done = await run_request(session, "/local")
        assert done.stop_reason == "skipped" and done.text == "" and done.turns == 0
        assert model.requests == []
        completed = [e for e in await stream_events(session) if isinstance(e, RequestCompleted)]
        assert completed[-1].output == {"skipped": "handled locally"}
        # The session goes on; the skipped prompt never entered the conversation.
        assert await session.send("real") == "answered"
    assert user_texts(model.requests[0]) == ["real"]


async def test_user_prompt_submit_abort_fails_the_request_and_the_session_stays_usable() -> None:
    async def guard(inp: HookInput) -> HookOutput | None:
        return HookOutput.abort("forbidden prompt") if "forbidden" in (inp.prompt or "") else None

    model = TestModel({"fine": [Reply(text="ok")]})
    async with open_session(provider=model, hooks={HookEvent.USER_PROMPT_SUBMIT: [guard]}) as session:
        with pytest.raises(HookAbortedError, match="forbidden prompt") as info:
            await session.send("forbidden thing")
        assert info.value.event is HookEvent.USER_PROMPT_SUBMIT
        assert model.requests == []
        assert RequestFailed in await stream_types(session)
        assert await session.send("fine") == "ok"
    assert user_texts(model.requests[0]) == ["fine"]


@pytest.mark.parametrize(
    ("returns", "error"),
    [
        pytest.param("garbage", HookReturnError, id="garbage"),
        pytest.param(HookOutput(modified_output="x"), HookReturnError, id="wrong-field"),
        pytest.param(RuntimeError("hook bug"), HookError, id="raises"),
    ],
)
async def test_user_prompt_submit_errors_are_typed_and_never_wedge_the_session(
    returns: Any, error: type[Exception]
) -> None:
    calls = 0

    async def bad(inp: HookInput) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            return None
        if isinstance(returns, Exception):
            raise returns
        return returns

    model = TestModel({"second": [Reply(text="ok")]})
    async with open_session(provider=model, hooks={HookEvent.USER_PROMPT_SUBMIT: [bad]}) as session:
        with pytest.raises(error) as info:
            await session.send("first")
        assert info.value.event is HookEvent.USER_PROMPT_SUBMIT  # type: ignore[attr-defined]
        assert await session.send("second") == "ok"
    assert len(model.requests) == 1


async def test_user_prompt_submit_deadline(autojump_clock: trio.testing.MockClock) -> None:
    async def hang(inp: HookInput) -> None:
        await trio.sleep_forever()

    model = TestModel({"second": [Reply(text="ok")]})
    async with open_session(
        provider=model,
        hooks={HookEvent.USER_PROMPT_SUBMIT: [hang]},
        hook_deadlines={HookEvent.USER_PROMPT_SUBMIT: 3.0},
    ) as session:
        start = trio.current_time()
        with pytest.raises(HookTimeoutError) as info:
            await session.send("first")
        assert info.value.seconds == 3.0
        assert trio.current_time() - start == pytest.approx(3.0)
    assert model.requests == []


@pytest.mark.parametrize("rewrite", ["", "  \n", {"prompt": ""}, {"userPrompt": " "}])
async def test_a_user_prompt_submit_rewrite_to_an_empty_prompt_fails_the_request(rewrite: Any) -> None:
    # "" was falsy: the original prompt (here, what a redaction hook removed) went to the model.
    async def redact(inp: HookInput) -> HookOutput:
        return HookOutput.modify(rewrite)

    model = TestModel(default=Reply(text="never"))
    async with open_session(provider=model, hooks={HookEvent.USER_PROMPT_SUBMIT: [redact]}) as session:
        with pytest.raises(HookReturnError, match="empty prompt"):
            await session.send("my password is hunter2")
        assert session.messages() == ()
    assert model.requests == []


@pytest.mark.parametrize("event", [HookEvent.USER_PROMPT_SUBMIT, HookEvent.STOP])
@pytest.mark.parametrize("how", ["abort", "close"])
async def test_an_abort_or_close_while_a_request_hook_runs_interrupts_the_request(event: HookEvent, how: str) -> None:
    # The dispatch's HookInterruptedError was recorded as a failure (request_failed, stop reason
    # error) and raised as is: no reason, no committed results.
    running = trio.Event()

    async def slow(inp: HookInput) -> None:
        running.set()
        await trio.sleep_forever()

    told: list[RequestAbortedError] = []
    store = MemoryStore()
    model = TestModel(default=Reply(text="hi"))
    async with (
        open_session(provider=model, hooks={event: [slow]}, journal=store, session_id="s") as session,
        trio.open_nursery() as nursery,
    ):

        async def sender() -> None:
            with pytest.raises(RequestAbortedError) as info:
                await session.send("go")
            told.append(info.value)

        nursery.start_soon(sender)
        await running.wait()
        if how == "abort":
            await session.abort()
        else:
            await session.close()
    reason = "user_abort" if how == "abort" else "session_close"
    assert [error.reason for error in told] == [reason]
    events = await stream_events(session)
    assert [event.reason.value for event in events if isinstance(event, RequestInterrupted)] == [reason]
    assert not any(isinstance(event, RequestFailed) for event in events)


@pytest.mark.parametrize("behaviour", ["raise", "abort", "garbage", "interrupted", "cancelled"])
async def test_a_prompt_user_prompt_submit_refused_stays_out_of_the_rebuilt_history(behaviour: str) -> None:
    # The started request's accepted prompt was folded into the history rebuilt on reopen, though
    # it never reached the model: the next life sent the model a prompt a hook had refused.
    running = trio.Event()

    async def refuse(inp: HookInput) -> Any:
        if inp.prompt != "refused":
            return None
        if behaviour == "raise":
            raise RuntimeError("policy service down")
        if behaviour == "abort":
            return HookOutput.abort("not this")
        if behaviour == "garbage":
            return "garbage"
        running.set()
        await trio.sleep_forever()

    store = MemoryStore()
    model = TestModel(default=Reply(text="answer"))
    hooks = {HookEvent.USER_PROMPT_SUBMIT: [refuse]}
    async with open_session(provider=model, hooks=hooks, journal=store, session_id="s") as session:
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def refused() -> None:
                with scope, contextlib.suppress(HookError, RequestAbortedError):
                    await session.send("refused")

            nursery.start_soon(refused)
            if behaviour in ("interrupted", "cancelled"):
                await running.wait()
                if behaviour == "interrupted":
                    await session.abort()
                else:
                    scope.cancel()
        assert await session.send("accepted") == "answer"
        live = session.messages()
    async with open_session(provider=model, journal=store, session_id="s") as session:
        rebuilt = session.messages()
    assert user_texts(model.requests[0]) == ["accepted"]
    assert rebuilt == live
    events = await stream_events(session)
    [refused_id] = [e.request_id for e in events if isinstance(e, RequestAccepted) and e.input == {"prompt": "refused"}]
    assert PromptSubmitted(request_id=refused_id) in events  # in its terminal batch: the prompt never joined


# ======================================================================== PreToolUse


async def test_pre_tool_use_modified_input_reaches_the_tool() -> None:
    ran: list[Any] = []

    async def add_extra(inp: HookInput) -> HookOutput:
        assert inp.tool_name == "echo" and inp.tool_input == {"x": "1"}
        return HookOutput.modify({"extra": "from-hook", "x": "changed"})

    model = TestModel({"go": [Reply(tool_calls=[("echo", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(
        provider=model, tools=[make_tool("echo", ran)], hooks={HookEvent.PRE_TOOL_USE: [add_extra]}
    ) as session:
        await session.send("go")
        events = await stream_events(session)
    assert ran == [("echo", "root", {"x": "changed", "extra": "from-hook"})]
    [scheduled] = [e for e in events if isinstance(e, ToolScheduled)]
    [started] = [e for e in events if isinstance(e, ToolStarted)]
    assert scheduled.model_input == {"x": "1"}  # what the model sent
    assert started.input == {"x": "changed", "extra": "from-hook"}  # what ran
    assert [m.content for m in tool_results(model.requests[1])] == ["echo:changed"]


@pytest.mark.parametrize(
    ("hook_result", "code", "settled"),
    [
        pytest.param(RuntimeError("policy engine down"), "hook_error", ToolFailed, id="raises"),
        pytest.param("yes please", "hook_error", ToolFailed, id="garbage"),
        pytest.param(HookOutput.modify("not an object"), "hook_error", ToolFailed, id="string-input"),
        pytest.param(HookOutput.abort("no way"), "hook_abort", ToolFailed, id="abort"),
        pytest.param(HookOutput.skip("not now"), "hook_skip", ToolCancelled, id="skip"),
    ],
)
async def test_pre_tool_use_denials_reach_the_model_and_the_tool_never_runs(
    hook_result: Any, code: str, settled: type[Any]
) -> None:
    ran: list[Any] = []

    async def hook(inp: HookInput) -> Any:
        if isinstance(hook_result, Exception):
            raise hook_result
        return hook_result

    # The root's conversation keeps its first prompt ("go") as the script key across requests.
    model = TestModel(
        {"go": [Reply(tool_calls=[("echo", {"x": "1"})]), Reply(text="recovered"), Reply(text="still here")]}
    )
    async with open_session(
        provider=model, tools=[make_tool("echo", ran)], hooks={HookEvent.PRE_TOOL_USE: [hook]}
    ) as session:
        seen, done = await run_request(session, "go")
        events = await stream_events(session)
        # Never wedged: the next request runs.
        assert await session.send("again") == "still here"
    assert ran == []
    assert done.stop_reason == "end_turn" and done.text == "recovered"
    [result_event] = [e for e in seen if isinstance(e, ToolResultEvent)]
    assert result_event.result.error is not None and result_event.result.error.code == code
    [message] = tool_results(model.requests[1])
    assert message.is_error and "echo" in message.content
    # The journal: scheduled, then settled without a tool_started.
    kinds = [type(e) for e in events if type(e) in (ToolScheduled, ToolStarted, ToolFailed, ToolCancelled)]
    assert kinds == [ToolScheduled, settled]
    if settled is ToolCancelled:
        [cancelled] = [e for e in events if isinstance(e, ToolCancelled)]
        assert cancelled.reason == "hook_skip"
        assert "not now" in message.content


async def test_pre_tool_use_deadline_fails_closed(autojump_clock: trio.testing.MockClock) -> None:
    ran: list[Any] = []
    cancelled = trio.Event()

    async def hang(inp: HookInput) -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    model = TestModel({"go": [Reply(tool_calls=[("echo", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(
        provider=model,
        tools=[make_tool("echo", ran)],
        hooks={HookEvent.PRE_TOOL_USE: [hang]},
        hook_deadlines={HookEvent.PRE_TOOL_USE: 1.0},
    ) as session:
        start = trio.current_time()
        seen, done = await run_request(session, "go")
        elapsed = trio.current_time() - start
        types = await stream_types(session)
    assert cancelled.is_set()
    assert elapsed == pytest.approx(1.0), "the PreToolUse deadline, not the 60 s default"
    assert ran == []
    assert done.text == "ok"
    [result_event] = [e for e in seen if isinstance(e, ToolResultEvent)]
    assert result_event.result.error is not None and result_event.result.error.code == "hook_timeout"
    [message] = tool_results(model.requests[1])
    assert message.is_error and "deadline" in message.content
    assert ToolStarted not in types and ToolFailed in types


# ======================================================================== PostToolUse / PostToolUseFailure


async def test_post_tool_use_modified_output_reaches_the_model() -> None:
    seen_results: list[Any] = []

    async def redact(inp: HookInput) -> HookOutput:
        seen_results.append((inp.tool_name, inp.tool_input, inp.tool_result.output if inp.tool_result else None))
        return HookOutput.modify(output="[redacted]", context="redaction applied")

    model = TestModel({"go": [Reply(tool_calls=[("echo", {"x": "secret"})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[make_tool("echo")], hooks={HookEvent.POST_TOOL_USE: [redact]}) as s:
        seen, _ = await run_request(s, "go")
    assert seen_results == [("echo", {"x": "secret"}, "echo:secret")]
    [message] = tool_results(model.requests[1])
    assert message.content == "[redacted]\nredaction applied" and not message.is_error
    [result_event] = [e for e in seen if isinstance(e, ToolResultEvent)]
    assert result_event.result.metadata["hook_context"] == ("redaction applied",)


@pytest.mark.parametrize("post_hook", [False, True], ids=["pre-only", "with-post-hook"])
async def test_pre_tool_use_context_reaches_the_model_with_or_without_post_hooks(post_hook: bool) -> None:
    """A PreToolUse hook's context is text for the model: it follows the call's output in the
    tool result the model reads (and sits in the result's metadata), whether or not a
    PostToolUse hook is registered (it once needed one, or it was dropped)."""

    async def note(inp: HookInput) -> HookOutput:
        return HookOutput.context("NOTE: from cache")

    hooks: dict[HookEvent, list[Any]] = {HookEvent.PRE_TOOL_USE: [note]}
    if post_hook:
        hooks[HookEvent.POST_TOOL_USE] = [no_op_hook]
    model = TestModel({"go": [Reply(tool_calls=[("echo", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=[make_tool("echo")], hooks=hooks) as session:
        seen, _ = await run_request(session, "go")
    [message] = tool_results(model.requests[1])
    assert message.content == "echo:1\nNOTE: from cache" and not message.is_error
    [result_event] = [e for e in seen if isinstance(e, ToolResultEvent)]
    assert result_event.result.metadata["hook_context"] == ("NOTE: from cache",)


async def no_op_hook(inp: HookInput) -> None:
    return None


async def test_post_tool_use_failure_sees_the_error_and_may_rewrite_its_output() -> None:
    got: list[Any] = []
    post_ok: list[Any] = []

    async def explain(inp: HookInput) -> HookOutput:
        got.append((inp.tool_name, inp.error.message if inp.error else None))
        return HookOutput.modify(output="Error: the tool failed; try another input")

    async def never(inp: HookInput) -> None:
        post_ok.append(inp)

    model = TestModel({"go": [Reply(tool_calls=[("broken", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(
        provider=model,
        tools=[make_tool("broken", fail=True)],
        hooks={HookEvent.POST_TOOL_USE_FAILURE: [explain], HookEvent.POST_TOOL_USE: [never]},
    ) as session:
        seen, _ = await run_request(session, "go")
    assert got == [("broken", "broken broke on 1")]
    assert post_ok == [], "PostToolUse is for successes only"
    [message] = tool_results(model.requests[1])
    assert message.is_error and message.content == "Error: the tool failed; try another input"
    [result_event] = [e for e in seen if isinstance(e, ToolResultEvent)]
    assert result_event.result.error is not None  # still the same error


class SkipUnlessRun(ChatMiddleware):
    """Answers every call but ``x == "run"`` itself (the tool never runs): an error for ``x == "err"``."""

    def __init__(self) -> None:
        self.after: list[tuple[str, bool]] = []

    def on_before_tool_call(self, ctx: Any, call: Any) -> Any:
        if call.args.get("x") == "run":
            return None
        if call.args.get("x") == "err":
            return LifecycleSkip(ToolResult.failure(ToolErrorType.EXECUTION, "cached failure"))
        return LifecycleSkip("cached")

    def on_after_tool_call(self, ctx: Any, info: Any) -> None:
        self.after.append((info.args["x"], info.ok))


async def test_post_tool_hooks_do_not_run_for_a_call_on_before_tool_call_skipped() -> None:
    # docs/hooks.md: PostToolUse runs when the tool returned a success, PostToolUseFailure for
    # errors the tool produced; a Skip's result (ok or error) fired them though the tool never ran.
    ran: list[Any] = []
    fired: list[tuple[str, Any]] = []

    async def post(inp: HookInput) -> None:
        fired.append((inp.event.value, inp.tool_input))

    async def note(inp: HookInput) -> HookOutput:
        return HookOutput.context("pre-note")

    skipper = SkipUnlessRun()
    calls = [("echo", {"x": "a"}), ("echo", {"x": "err"}), ("echo", {"x": "run"})]
    model = TestModel({"go": [Reply(tool_calls=calls), Reply(text="done")]})
    hooks = {HookEvent.PRE_TOOL_USE: [note], HookEvent.POST_TOOL_USE: [post], HookEvent.POST_TOOL_USE_FAILURE: [post]}
    async with open_session(provider=model, tools=[make_tool("echo", ran)], lifecycle=[skipper], hooks=hooks) as s:
        await s.send("go")
    assert [inp for _, _, inp in ran] == [{"x": "run"}]
    assert fired == [("post_tool_use", {"x": "run"})]  # only the call the tool ran
    assert sorted(skipper.after) == [("a", True), ("err", False), ("run", True)]  # the lifecycle hook still runs
    messages = tool_results(model.requests[1])
    # The skip's result reaches the model as given, with the PreToolUse context that ran before the skip.
    assert [(m.content, m.is_error) for m in messages] == [
        ("cached\npre-note", False),
        ("Error: cached failure\npre-note", True),
        ("echo:run\npre-note", False),
    ]


@pytest.mark.parametrize("behaviour", ["raises", "garbage"])
async def test_post_tool_use_failing_hook_withholds_the_output(behaviour: str) -> None:
    async def bad(inp: HookInput) -> Any:
        if behaviour == "raises":
            raise RuntimeError("redactor crashed")
        return 42

    ran: list[Any] = []
    model = TestModel({"go": [Reply(tool_calls=[("echo", {"x": "secret"})]), Reply(text="ok")]})
    async with open_session(
        provider=model, tools=[make_tool("echo", ran)], hooks={HookEvent.POST_TOOL_USE: [bad]}
    ) as session:
        await session.send("go")
        types = await stream_types(session)
    assert ran, "the tool did run"
    [message] = tool_results(model.requests[1])
    assert message.is_error and "withheld" in message.content
    assert "echo:secret" not in message.content
    assert ToolStarted in types and ToolFailed in types


# ======================================================================== PermissionRequest


async def test_permission_request_hook_input_and_modification_reach_the_handler_and_tool() -> None:
    ran: list[Any] = []
    hook_inputs: list[HookInput] = []
    handler_inputs: list[dict[str, Any]] = []

    async def hook(inp: HookInput) -> HookOutput:
        hook_inputs.append(inp)
        return HookOutput.modify({"x": "safer"})

    async def handler(request: PermissionRequest) -> PermissionAllow:
        handler_inputs.append(dict(request.input))
        return PermissionAllow()

    model = TestModel({"go": [Reply(tool_calls=[("write", {"x": "risky"})]), Reply(text="ok")]})
    async with open_session(
        provider=model,
        tools=[make_tool("write", ran, kind="write")],
        hooks={HookEvent.PERMISSION_REQUEST: [hook]},
        permission_handler=handler,
    ) as session:
        await session.send("go")
        types = await stream_types(session)
    [inp] = hook_inputs
    assert inp.tool_name == "write" and inp.tool_input == {"x": "risky"} and inp.extra["tool_kind"] == "write"
    assert handler_inputs == [{"x": "safer"}]
    assert ran == [("write", "root", {"x": "safer"})]
    assert PermissionRequested in types and PermissionResolved in types


@pytest.mark.parametrize("behaviour", ["skip", "raises", "garbage"])
async def test_permission_request_hook_denials_fail_closed(behaviour: str) -> None:
    ran: list[Any] = []
    handler_calls: list[Any] = []

    async def hook(inp: HookInput) -> Any:
        if behaviour == "raises":
            raise RuntimeError("approval service down")
        if behaviour == "garbage":
            return ["allow"]
        return HookOutput.skip("the reviewer said no")

    async def handler(request: PermissionRequest) -> PermissionAllow:
        handler_calls.append(request)
        return PermissionAllow()

    model = TestModel({"go": [Reply(tool_calls=[("write", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(
        provider=model,
        tools=[make_tool("write", ran, kind="write")],
        hooks={HookEvent.PERMISSION_REQUEST: [hook]},
        permission_handler=handler,
    ) as session:
        assert await session.send("go") == "ok"
    assert ran == [] and handler_calls == []
    [message] = tool_results(model.requests[1])
    assert message.is_error
    if behaviour == "skip":
        assert "the reviewer said no" in message.content


async def test_permission_request_hook_abort_denies_and_interrupts_the_request() -> None:
    ran: list[Any] = []

    async def hook(inp: HookInput) -> HookOutput:
        return HookOutput.abort("stop everything")

    model = TestModel({"go": [Reply(tool_calls=[("write", {"x": "1"})]), Reply(text="should not be asked")]})
    async with open_session(
        provider=model, tools=[make_tool("write", ran, kind="write")], hooks={HookEvent.PERMISSION_REQUEST: [hook]}
    ) as session:
        _, done = await run_request(session, "go")
    assert ran == []
    assert len(model.requests) == 1, "the loop must stop after the denial"
    assert done.stop_reason != "end_turn"


# ======================================================================== Stop


async def test_stop_skip_runs_one_more_round() -> None:
    calls: list[str | None] = []

    async def not_yet(inp: HookInput) -> HookOutput | None:
        calls.append(inp.last_message)
        return HookOutput.skip("Please double-check.") if len(calls) == 1 else None

    model = TestModel({"go": [Reply(text="first answer"), Reply(text="checked answer")]})
    async with open_session(provider=model, hooks={HookEvent.STOP: [not_yet]}) as session:
        _, done = await run_request(session, "go")
    assert done.text == "checked answer" and done.turns == 2
    assert calls == ["first answer", "checked answer"]
    assert user_texts(model.requests[1]) == ["go", "Please double-check."]


async def test_stop_last_message_is_the_final_reply_of_this_request_or_none() -> None:
    # The whole history was searched: a request whose final reply had no text handed its Stop
    # hooks an earlier request's answer.
    seen: list[str | None] = []

    async def stop(inp: HookInput) -> None:
        seen.append(inp.last_message)

    model = TestModel(default=[Reply(text="The capital is Paris."), Reply(text="")])
    async with open_session(provider=model, hooks={HookEvent.STOP: [stop]}) as session:
        assert await session.send("capital of France?") == "The capital is Paris."
        assert await session.send("and of Mars?") == ""
    assert seen == ["The capital is Paris.", None]


async def test_stop_skip_is_bounded_by_max_turns() -> None:
    async def never_stop(inp: HookInput) -> HookOutput:
        return HookOutput.skip("more")

    model = TestModel(default=Reply(text="again"))
    async with open_session(provider=model, hooks={HookEvent.STOP: [never_stop]}, max_turns=3) as session:
        _, done = await run_request(session, "go")
    assert done.stop_reason == "max_turns" and done.turns == 3
    assert len(model.requests) == 3


@pytest.mark.parametrize(
    ("returns", "error"),
    [
        pytest.param(HookOutput.abort("not acceptable"), HookAbortedError, id="abort"),
        pytest.param(HookOutput.modify({"x": 1}), HookReturnError, id="modified-input"),
        pytest.param(RuntimeError("checker down"), HookError, id="raises"),
    ],
)
async def test_stop_abort_and_errors_fail_the_request_typed(returns: Any, error: type[Exception]) -> None:
    count = 0

    async def hook(inp: HookInput) -> Any:
        nonlocal count
        count += 1
        if count > 1:
            return None
        if isinstance(returns, Exception):
            raise returns
        return returns

    model = TestModel({"go": [Reply(text="answer"), Reply(text="next answer")]})
    async with open_session(provider=model, hooks={HookEvent.STOP: [hook]}) as session:
        with pytest.raises(error):
            await session.send("go")
        assert RequestFailed in await stream_types(session)
        assert await session.send("more") == "next answer"


# ======================================================================== SubagentStart / SubagentStop


def helper_definition(**kwargs: Any) -> SubagentDefinition:
    return SubagentDefinition("helper", "a helper", "You help.", **kwargs)


async def test_subagent_start_replaces_the_prompt_and_stop_sees_the_last_message() -> None:
    starts: list[HookInput] = []
    stops: list[HookInput] = []

    async def on_start(inp: HookInput) -> HookOutput:
        starts.append(inp)
        return HookOutput.modify(f"{inp.prompt} (be brief)", context="ctx for the child")

    async def on_stop(inp: HookInput) -> None:
        stops.append(inp)

    model = TestModel(
        {
            "go": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "look"})]), Reply(text="parent ok")],
            "look (be brief)\n\nctx for the child": [Reply(text="child answer")],
        }
    )
    async with open_session(
        provider=model,
        subagents=[helper_definition()],
        hooks={HookEvent.SUBAGENT_START: [on_start], HookEvent.SUBAGENT_STOP: [on_stop]},
    ) as session:
        assert await session.send("go") == "parent ok"
    [start] = starts
    assert start.prompt == "look" and start.subagent_type == "helper" and start.subagent_id
    child_request = model.requests[1]
    assert child_request.metadata["agent_id"] == start.subagent_id
    assert user_texts(child_request) == ["look (be brief)\n\nctx for the child"]
    assert stops and all(s.subagent_id == start.subagent_id for s in stops)
    assert stops[0].last_message == "child answer"


@pytest.mark.parametrize("mode", ["foreground", "background"])
async def test_subagent_stop_runs_once_per_subagent(mode: str) -> None:
    stops: list[str | None] = []

    async def on_stop(inp: HookInput) -> None:
        stops.append(inp.subagent_id)

    model = TestModel(
        {"go": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub"})]), Reply(text="ok")]},
        default=Reply(text="child answer"),
    )
    async with open_session(
        provider=model, subagents=[helper_definition()], hooks={HookEvent.SUBAGENT_STOP: [on_stop]}
    ) as session:
        if mode == "foreground":
            await session.send("go")
        else:
            handle = await session.start_subagent("helper", "sub")
            await handle.wait()
    assert len(stops) == 1


async def test_subagent_stop_skip_runs_the_subagent_one_more_round() -> None:
    count = 0

    async def on_stop(inp: HookInput) -> HookOutput | None:
        nonlocal count
        count += 1
        return HookOutput.skip("cite your sources") if count == 1 else None

    model = TestModel(
        {
            "go": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub"})]), Reply(text="ok")],
            "sub": [Reply(text="draft"), Reply(text="final with sources")],
        }
    )
    async with open_session(
        provider=model, subagents=[helper_definition()], hooks={HookEvent.SUBAGENT_STOP: [on_stop]}
    ) as session:
        await session.send("go")
    child_requests = [r for r in model.requests if r.metadata["agent_id"] != "root"]
    assert len(child_requests) == 2
    assert user_texts(child_requests[1]) == ["sub", "cite your sources"]
    assert [m.content for m in tool_results(model.requests[-1])] == ["final with sources"]


@pytest.mark.parametrize("behaviour", ["skip", "abort", "raises"])
async def test_subagent_start_refusal_is_a_model_visible_task_error(behaviour: str) -> None:
    async def refuse(inp: HookInput) -> HookOutput:
        if behaviour == "raises":
            raise RuntimeError("quota service down")
        return HookOutput.skip("no helpers today") if behaviour == "skip" else HookOutput.abort("no helpers today")

    model = TestModel(
        {"go": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub"})]), Reply(text="parent ok")]},
        default=Reply(text="the child must not run"),
    )
    async with open_session(
        provider=model, subagents=[helper_definition()], hooks={HookEvent.SUBAGENT_START: [refuse]}
    ) as session:
        assert await session.send("go") == "parent ok"
        assert session.journal.agents == [session.root_agent_id], "no child stream was created"
    assert len(model.requests) == 2
    [message] = tool_results(model.requests[1])
    assert message.is_error
    if behaviour != "raises":
        assert "no helpers today" in message.content


async def test_subagent_start_abort_has_code_hook_abort() -> None:
    async def refuse(inp: HookInput) -> HookOutput:
        return HookOutput.abort("no helpers today")

    model = TestModel(
        {"go": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub"})]), Reply(text="parent ok")]}
    )
    async with open_session(
        provider=model, subagents=[helper_definition()], hooks={HookEvent.SUBAGENT_START: [refuse]}
    ) as session:
        seen, _ = await run_request(session, "go")
    [result_event] = [e for e in seen if isinstance(e, ToolResultEvent)]
    assert result_event.result.error is not None and result_event.result.error.code == "hook_abort"


async def test_subagent_start_hooks_run_before_a_start_between_requests_is_journalled() -> None:
    # Between requests the start takes a short request of its own on the root's stream: it is
    # opened only once the hooks let the subagent start, and never holds the prompt they replaced.
    async def redact(inp: HookInput) -> HookOutput:
        if "SECRET" in (inp.prompt or ""):
            return HookOutput.modify("[redacted]")
        return HookOutput.skip("not allowed")

    store = MemoryStore()
    model = TestModel(default=Reply(text="child answer"))
    async with open_session(
        provider=model, journal=store, subagents=[helper_definition()], hooks={HookEvent.SUBAGENT_START: [redact]}
    ) as session:
        with pytest.raises(HookAbortedError):
            await session.start_subagent("helper", "please refuse me")
        assert not any(isinstance(e, RequestAccepted) for e in await stream_events(session)), "a refusal writes nothing"
        handle = await session.start_subagent("helper", "token SECRET=hunter2")
        assert await handle.wait() == "child answer"
        root = await stream_events(session)
        child = await stream_events(session, handle.id)
    [holder] = [e for e in root if isinstance(e, RequestAccepted)]
    assert holder.input == {"start_subagent": "helper", "subagent_id": handle.id}
    assert [e.input for e in child if isinstance(e, RequestAccepted)] == [{"prompt": "[redacted]"}]
    assert "hunter2" not in repr(root) + repr(child)
    assert user_texts(model.requests[0]) == ["[redacted]"]


# ======================================================================== SessionStart / SessionEnd


async def test_session_start_context_reaches_every_model_call() -> None:
    starts: list[HookInput] = []

    async def on_start(inp: HookInput) -> HookOutput:
        starts.append(inp)
        return HookOutput.context("Project rules: be terse.")

    model = TestModel(default=Reply(text="ok"))
    async with open_session(
        provider=model, system_prompt="You are root.", hooks={HookEvent.SESSION_START: [on_start]}
    ) as session:
        assert len(starts) == 1 and starts[0].session_id == session.session_id
        assert model.requests == [], "SessionStart runs before the first request"
        await session.send("one")
        await session.send("two")
    assert len(starts) == 1
    for request in model.requests:
        assert request.messages[0] == SystemMessage("You are root.\n\nProject rules: be terse.")


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [("abort", HookAbortedError), ("raises", HookError), ("modified_input", HookReturnError)],
)
async def test_session_start_abort_or_error_fails_the_start(behaviour: str, error: type[Exception]) -> None:
    async def on_start(inp: HookInput) -> HookOutput:
        if behaviour == "raises":
            raise RuntimeError("no config")
        if behaviour == "modified_input":
            return HookOutput.modify({"x": 1})
        return HookOutput.abort("maintenance window")

    model = TestModel(default=Reply(text="never"))
    with pytest.raises(error) as info:
        async with open_session(provider=model, hooks={HookEvent.SESSION_START: [on_start]}):
            pytest.fail("the body must not run")  # pragma: no cover
    assert not isinstance(info.value, BaseExceptionGroup)
    assert model.requests == []


async def test_session_end_runs_once_on_close_with_the_reason() -> None:
    ends: list[tuple[str | None, str]] = []

    async def on_end(inp: HookInput) -> None:
        ends.append((inp.reason, inp.agent_id))

    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model, hooks={HookEvent.SESSION_END: [on_end]}) as session:
        await session.send("hi")
        assert ends == []
    assert ends == [("completed", session.root_agent_id)]
    # The body failed: still once, with reason "error", and the body's own error propagates.
    ends.clear()
    with pytest.raises(KeyError):
        async with open_session(provider=model, hooks={HookEvent.SESSION_END: [on_end]}):
            raise KeyError("boom")
    assert [reason for reason, _ in ends] == ["error"]


@pytest.mark.parametrize("behaviour", ["raises", "hangs", "abort"])
async def test_session_end_failures_never_block_the_close(
    behaviour: str, autojump_clock: trio.testing.MockClock
) -> None:
    async def on_end(inp: HookInput) -> HookOutput | None:
        if behaviour == "raises":
            raise RuntimeError("audit sink down")
        if behaviour == "hangs":
            await trio.sleep_forever()
        return HookOutput.abort("ignored")

    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model, hooks={HookEvent.SESSION_END: [on_end]}) as session:
        await session.send("hi")
        closed_at = trio.current_time()
    elapsed = trio.current_time() - closed_at
    events = await stream_events(session)
    assert sum(isinstance(e, SessionClosed) for e in events) == 1
    assert elapsed <= 5.0 + 1e-6, "SessionEnd's default deadline is 5 s"


# ======================================================================== order: session hooks, then plugin hooks


async def test_session_hooks_run_before_plugin_hooks_for_every_event() -> None:
    log: list[tuple[str, str]] = []

    def recorder(tag: str) -> Callable[[HookInput], Awaitable[None]]:
        async def hook(inp: HookInput) -> None:
            log.append((inp.event.title, tag))

        hook.__qualname__ = f"hook_{tag}"
        return hook

    events = [
        HookEvent.SESSION_START,
        HookEvent.USER_PROMPT_SUBMIT,
        HookEvent.PRE_TOOL_USE,
        HookEvent.POST_TOOL_USE,
        HookEvent.STOP,
        HookEvent.SESSION_END,
    ]
    p1 = define_plugin(name="p1", hooks={event: [recorder("p1a"), recorder("p1b")] for event in events})
    p2 = define_plugin(name="p2", hooks={event: [recorder("p2")] for event in events})
    model = TestModel({"go": [Reply(tool_calls=[("echo", {"x": "1"})]), Reply(text="ok")]})
    async with open_session(
        provider=model,
        tools=[make_tool("echo")],
        plugins=[p1, p2],
        hooks={event: [recorder("s1"), recorder("s2")] for event in events},
    ) as session:
        await session.send("go")
    order = ["s1", "s2", "p1a", "p1b", "p2"]
    assert log == [(event.title, tag) for event in events for tag in order]


async def test_later_hook_wins_the_prompt_and_plugins_see_the_original() -> None:
    """Session hook first, plugin hook second; each sees the original prompt, the later change wins."""
    seen: list[str | None] = []

    async def session_hook(inp: HookInput) -> HookOutput:
        seen.append(inp.prompt)
        return HookOutput.modify("from session")

    async def plugin_hook(inp: HookInput) -> HookOutput:
        seen.append(inp.prompt)
        return HookOutput.modify("from plugin")

    plugin = define_plugin(name="late", hooks={HookEvent.USER_PROMPT_SUBMIT: [plugin_hook]})
    model = TestModel(default=Reply(text="ok"))
    async with open_session(
        provider=model, plugins=[plugin], hooks={HookEvent.USER_PROMPT_SUBMIT: [session_hook]}
    ) as session:
        await session.send("original")
    assert seen == ["original", "original"]
    assert user_texts(model.requests[0]) == ["from plugin"]
