"""`define_agent`: one validated, composed spec opened by many sessions; an already-open journal;
the retry policy and scheduler limits it carries; typed errors for bad input."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    AgentSpec,
    ConfigError,
    HookEvent,
    RateLimitError,
    SubagentDefinition,
    ToolContext,
    ToolResult,
    define_agent,
    define_plugin,
    define_tool,
    open_session,
)
from trio_agent._errors import MiddlewareShapeError
from trio_agent._journal._projection import SessionState
from trio_agent._lifecycle._middleware import ChatMiddleware
from trio_agent._loop._context import RunContext
from trio_agent._loop._hooks import ModelConfig
from trio_agent.journal import MemoryStore, open_journal
from trio_agent.lifecycle import define_client_tool
from trio_agent.models import RetryPolicy, ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import SchedulerLimits

ECHO_SCHEMA = {"type": "object", "properties": {"x": {"type": "string"}}}


def echo_tool() -> Any:
    @define_tool(name="echo", side_effect="pure", kind="readonly", input_schema=ECHO_SCHEMA)
    async def echo(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Echo x."""
        return ToolResult.success(f"echo:{input.get('x', '')}:{ctx.session_id}")

    return echo


class SeesSession(ChatMiddleware):
    """Records which session each run's on_config belongs to (per-run state only in ctx)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def on_config(self, ctx: RunContext, config: ModelConfig) -> None:
        ctx.state.setdefault("session", ctx.metadata["session_id"])
        assert ctx.state["session"] == ctx.metadata["session_id"]
        self.seen.append((ctx.metadata["session_id"], ctx.run_id))


async def test_one_spec_opened_by_many_concurrent_sessions_shares_its_composed_parts() -> None:
    sees = SeesSession()
    model = TestModel(respond=lambda request: _echo_then_answer(request))
    spec = define_agent(provider=model, tools=[echo_tool()], lifecycle=[sees], system_prompt="be brief")
    answers: dict[str, str] = {}
    sessions: list[Any] = []
    all_open = trio.Event()
    release = trio.Event()

    async def one(index: int) -> None:
        async with open_session(spec, journal=MemoryStore()) as session:
            sessions.append(session)
            if len(sessions) == 5:
                all_open.set()
            answers[session.session_id] = await session.send(f"prompt {index}")
            await release.wait()  # all five are open at once while they are compared

    async with trio.open_nursery() as nursery:
        for index in range(5):
            nursery.start_soon(one, index)
        await all_open.wait()
        await trio.testing.wait_all_tasks_blocked()
        # Shared: the validated registry, the composed stacks, the hook runner, the lifecycle.
        for session in sessions:
            assert session.pipeline.tools["echo"] is spec.parts.tools["echo"]
            assert session.pipeline.middleware is spec.parts.tool_middleware
            assert session._host.lifecycle is spec.lifecycle
            assert session._host.hooks is spec.parts.hooks
            assert session._host.service.middleware is spec.parts.model_middleware
        # Per session: its own pipeline, scheduler buckets, permission engine, history, journal.
        assert len({id(s.pipeline) for s in sessions}) == 5
        assert len({id(s.pipeline.scheduler) for s in sessions}) == 5
        assert len({id(s.permissions) for s in sessions}) == 5
        assert len({id(s.journal) for s in sessions}) == 5
        assert len({s.session_id for s in sessions}) == 5
        for session in sessions:
            prompts = [m.content for m in session.messages() if isinstance(m, UserMessage)]
            assert len(prompts) == 1 and prompts[0].startswith("prompt ")
            assert answers[session.session_id] == f"done in {session.session_id}"
        release.set()
    # Every run's middleware state stayed its own: two model calls per session, each keyed right.
    assert sorted({session for session, _ in sees.seen}) == sorted(answers)
    assert len(sees.seen) == 5 * 3  # per run: on_config at init, then before each of two model calls


def _echo_then_answer(request: Any) -> Reply:
    session_id = request.metadata["session_id"]
    if not any(isinstance(m, ToolResultMessage) for m in request.messages):
        return Reply(tool_calls=[("echo", {"x": "hi"})])
    return Reply(f"done in {session_id}")


async def test_an_open_durable_journal_is_used_and_left_open() -> None:
    spec = define_agent(provider=TestModel(default=Reply("ok")))
    async with open_journal(MemoryStore()) as journal:
        async with open_session(spec, journal=journal) as session:
            assert session.journal is journal
            assert session.session_id == journal.session_id
            assert await session.send("hello") == "ok"
        # The session closed its life, not the journal: the caller still owns it.
        assert not journal.closed
        assert journal.projection().session_state is SessionState.CLOSED
        async with open_session(spec, journal=journal) as again:
            assert again.life == 2
            assert [m.content for m in again.messages() if isinstance(m, UserMessage)] == ["hello"]
        assert not journal.closed
        with pytest.raises(ConfigError, match="differs"):
            async with open_session(spec, journal=journal, session_id="another-one"):
                pass  # pragma: no cover
    assert journal.closed


@pytest.mark.parametrize(("attempts", "succeeds"), [(1, False), (2, True)])
async def test_the_retry_policy_takes_effect(attempts: int, succeeds: bool) -> None:
    model = TestModel({"hi": [Reply(error=RateLimitError("slow down", retry_after=0)), Reply("fine")]})
    spec = define_agent(provider=model, retry=RetryPolicy(max_attempts=attempts, base_delay=0, jitter=False))
    async with open_session(spec) as session:
        if succeeds:
            assert await session.send("hi") == "fine"
        else:
            with pytest.raises(RateLimitError):
                await session.send("hi")
    assert len(model.requests) == 2 if succeeds else 1


@pytest.mark.parametrize(("limit", "expected"), [(1, 1), (3, 3)])
async def test_scheduler_limits_take_effect(limit: int, expected: int) -> None:
    running = 0
    most = 0

    @define_tool(name="probe", side_effect="pure", kind="readonly", input_schema=ECHO_SCHEMA)
    async def probe(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Count the calls that run at once."""
        nonlocal running, most
        running += 1
        most = max(most, running)
        await trio.testing.wait_all_tasks_blocked()  # every call that can start has started
        running -= 1
        return ToolResult.success("ok")

    calls = [("probe", {"x": str(i)}) for i in range(3)]
    model = TestModel({"go": [Reply(tool_calls=calls), Reply("done")]})
    spec = define_agent(provider=model, tools=[probe], scheduler_limits=SchedulerLimits(readonly=limit))
    async with open_session(spec) as session:
        assert session.pipeline.scheduler.limits.readonly == limit
        assert await session.send("go") == "done"
    assert most == expected


class BadStore(ChatMiddleware):
    routed_subagent_persistence = object()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        pytest.param({"max_turns": 0}, ConfigError, id="max_turns"),
        pytest.param({"retry": 3}, ConfigError, id="retry"),
        pytest.param({"scheduler_limits": {"readonly": 1}}, ConfigError, id="scheduler_limits"),
        pytest.param({"lifecycle": [object()]}, MiddlewareShapeError, id="lifecycle-item"),
        pytest.param({"lifecycle": ChatMiddleware()}, MiddlewareShapeError, id="lifecycle-not-a-list"),
        pytest.param({"lifecycle": [BadStore()]}, ConfigError, id="routed-persistence"),
        pytest.param({"subagents": [SubagentDefinition("a", "x", "y")] * 2}, ConfigError, id="subagents"),
        pytest.param({"tools": [echo_tool(), echo_tool()]}, ConfigError, id="duplicate-tools"),
        pytest.param({"model_request_timeout": -1}, ConfigError, id="timeout"),
        # An int too large for a float (OverflowError) or to print (ValueError) is still a ConfigError.
        pytest.param({"tool_timeout": 10**400}, ConfigError, id="timeout-huge-int"),
        pytest.param({"model_request_timeout": 10**5000}, ConfigError, id="timeout-unprintable-int"),
        pytest.param({"hook_deadlines": {HookEvent.PRE_TOOL_USE: 10**400}}, ConfigError, id="hook-deadline-huge"),
        pytest.param({"workspace_roots": 5}, ConfigError, id="workspace_roots-not-a-list"),
        pytest.param({"workspace_roots": {"/tmp": 1}}, ConfigError, id="workspace_roots-mapping"),
        pytest.param({"allowed_tools": 5}, ConfigError, id="allowed_tools-not-a-list"),
        pytest.param({"max_turns": -(10**5000)}, ConfigError, id="max_turns-unprintable-int"),
        pytest.param({"model": 5}, ConfigError, id="model-not-a-string"),
        pytest.param({"model": ["gpt"]}, ConfigError, id="model-a-list"),
        pytest.param({"model": ""}, ConfigError, id="model-empty"),
        pytest.param({"permission_handler": 5}, ConfigError, id="permission_handler-not-callable"),
    ],
)
def test_bad_agent_options_raise_typed_errors(options: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        define_agent(provider=TestModel(default=Reply("x")), **options)


@pytest.mark.parametrize(
    ("options", "owner"),
    [
        pytest.param({"tools": [echo_tool()]}, "a tool and a client tool share the name 'echo'", id="tools"),
        pytest.param(
            {"plugins": [define_plugin(name="extras", tools=[echo_tool()])]},
            "client tool 'echo' shares its name with a tool of plugin 'extras'",
            id="plugin",
        ),
        pytest.param(
            {"subagents": [SubagentDefinition("helper", "helps", "help")]},
            "client tool 'task' shares its name with a built-in subagent tool",
            id="builtin",
        ),
    ],
)
def test_a_client_tool_may_not_share_a_name_with_any_tool_of_the_agent(options: dict[str, Any], owner: str) -> None:
    name = "task" if "subagents" in options else "echo"
    tools = [*options.pop("tools", ()), define_client_tool(name, "runs in the client")]
    with pytest.raises(ConfigError, match=owner):
        define_agent(provider=TestModel(default=Reply("x")), tools=tools, **options)


def test_a_provider_name_needs_a_model() -> None:
    with pytest.raises(ConfigError, match="model is required"):
        define_agent(provider="openai")


async def test_open_session_refuses_a_spec_with_agent_options_or_a_non_spec() -> None:
    spec = define_agent(provider=TestModel(default=Reply("x")))
    assert isinstance(spec, AgentSpec)
    with pytest.raises(ConfigError, match="belong to define_agent"):
        async with open_session(spec, max_turns=3):
            pass  # pragma: no cover
    with pytest.raises(ConfigError, match="AgentSpec"):
        async with open_session("not a spec"):  # type: ignore[arg-type]
            pass  # pragma: no cover
    with pytest.raises(ConfigError, match="provider"):
        async with open_session():
            pass  # pragma: no cover
