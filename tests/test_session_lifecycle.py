"""Chat middleware in sessions: one stack per spec, run for the root and for foreground and
background subagents with per-run state only in the context; its order against Stop hooks;
routed subagent persistence called by the session for every subagent it starts."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from tests.session_helpers import stream_events
from trio_agent import (
    DoneEvent,
    HookEvent,
    HookInput,
    HookOutput,
    ModelError,
    SubagentDefinition,
    SubagentEvent,
    SubagentStatus,
    TextDeltaEvent,
    ToolContext,
    ToolResult,
    define_agent,
    define_tool,
    open_session,
)
from trio_agent._lifecycle._middleware import ChatMiddleware
from trio_agent._loop._context import RunContext
from trio_agent._loop._events import RunEvent
from trio_agent.lifecycle import (
    DROP,
    StepStarted,
    SubagentRunInfo,
    SubagentRunResult,
    TextMessageContent,
    ToolCallEnd,
    ToolCallResult,
)
from trio_agent.testing import Reply, TestModel

ECHO_SCHEMA = {"type": "object", "properties": {"x": {"type": "string"}}}
HELPER = SubagentDefinition("helper", "a helper", "You are the helper.")


@define_tool(name="echo", side_effect="pure", kind="readonly", input_schema=ECHO_SCHEMA)
async def echo(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
    """Echo x."""
    return ToolResult.success(f"echo:{input.get('x', '')}")


def task(prompt: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    return ("task", {"subagent": "helper", "prompt": prompt, **extra})


class Recorder(ChatMiddleware):
    """Records (agent name, hook) per run; its per-run marker lives in ctx.state only."""

    def __init__(self) -> None:
        self.hooks: list[tuple[str, str, str]] = []  # (run id, agent name, hook)
        self.bleed: list[str] = []

    def _saw(self, ctx: RunContext, hook: str) -> None:
        if ctx.state.get("run") != ctx.run_id or ctx.metadata.get("agent_id") != ctx.agent_id:
            self.bleed.append(f"{hook} of {ctx.run_id} saw {ctx.state.get('run')}")
        self.hooks.append((ctx.run_id, ctx.metadata["agent_name"], hook))

    async def setup(self, ctx: RunContext) -> None:
        assert "run" not in ctx.state  # a fresh context per run
        ctx.state["run"] = ctx.run_id
        await trio.lowlevel.checkpoint()  # let concurrent runs interleave

    async def on_config(self, ctx: RunContext, config: Any) -> None:
        self._saw(ctx, "on_config")
        await trio.lowlevel.checkpoint()

    def on_chunk(self, ctx: RunContext, event: RunEvent) -> None:
        self._saw(ctx, "on_chunk")

    async def on_before_tool_call(self, ctx: RunContext, call: Any) -> None:
        self._saw(ctx, "on_before_tool_call")
        await trio.lowlevel.checkpoint()

    def on_after_tool_call(self, ctx: RunContext, info: Any) -> None:
        self._saw(ctx, "on_after_tool_call")

    def on_should_continue(self, ctx: RunContext, state: Any) -> None:
        self._saw(ctx, "on_should_continue")

    def on_finish(self, ctx: RunContext, info: Any) -> None:
        self._saw(ctx, "on_finish")

    def on_abort(self, ctx: RunContext, info: Any) -> None:
        self._saw(ctx, "on_abort")

    def on_error(self, ctx: RunContext, info: Any) -> None:
        self._saw(ctx, "on_error")


EVERY_HOOK = {
    "on_config",
    "on_chunk",
    "on_before_tool_call",
    "on_after_tool_call",
    "on_should_continue",
    "on_finish",
}


def script(tag: str = "") -> dict[str, list[Reply]]:
    return {
        f"go{tag}": [
            Reply(tool_calls=[("echo", {"x": "root"}), task(f"fg job{tag}"), task(f"bg job{tag}", background=True)]),
            Reply("root done"),
        ],
        f"fg job{tag}": [Reply(tool_calls=[("echo", {"x": "fg"})]), Reply("fg done")],
        f"bg job{tag}": [Reply(tool_calls=[("echo", {"x": "bg"})]), Reply("bg done")],
    }


def subagent_script() -> TestModel:
    return TestModel(script())


async def test_chat_middleware_runs_for_the_root_and_foreground_and_background_subagents() -> None:
    recorder = Recorder()
    model = subagent_script()
    spec = define_agent(provider=model, tools=[echo], subagents=[HELPER], lifecycle=[recorder])
    async with open_session(spec) as session:
        assert await session.send("go") == "root done"
        [handle] = session.subagents.values()
        await handle.wait()
        assert handle.status is SubagentStatus.COMPLETED
    by_run: dict[str, set[str]] = {}
    names: dict[str, str] = {}
    for run_id, agent, hook in recorder.hooks:
        by_run.setdefault(run_id, set()).add(hook)
        names[run_id] = agent
    assert sorted(names.values()) == ["helper", "helper", "root"]  # one run each: root, fg, bg
    for run_id, hooks in by_run.items():
        assert hooks == EVERY_HOOK, names[run_id]
    assert recorder.bleed == []
    # Exactly one terminal hook per run.
    terminal = Counter(run for run, _, hook in recorder.hooks if hook in ("on_finish", "on_abort", "on_error"))
    assert set(terminal.values()) == {1}


async def test_concurrent_runs_of_two_sessions_of_one_spec_keep_their_own_state() -> None:
    recorder = Recorder()
    model = TestModel({**script(" A"), **script(" B")})
    spec = define_agent(provider=model, tools=[echo], subagents=[HELPER], lifecycle=[recorder])

    async def run(tag: str) -> None:
        async with open_session(spec) as session:
            assert await session.send(f"go{tag}") == "root done"
            for handle in list(session.subagents.values()):
                await handle.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, " A")
        nursery.start_soon(run, " B")
    runs = {run for run, _, _ in recorder.hooks}
    assert len(runs) == 6  # two sessions x (root, foreground, background), one stack
    assert recorder.bleed == []
    # The runs really overlapped: hooks of different runs interleave.
    order = [run for run, _, _ in recorder.hooks]
    switches = sum(1 for a, b in itertools.pairwise(order) if a != b)
    assert switches > len(runs)


async def test_stop_hooks_ask_first_then_chat_middleware_may_veto_the_extra_turn() -> None:
    order: list[str] = []

    async def not_yet(inp: HookInput) -> HookOutput | None:
        order.append("Stop")
        return HookOutput.skip("Please double-check.")

    class Veto(ChatMiddleware):
        def on_should_continue(self, ctx: RunContext, state: Any) -> bool:
            order.append("on_should_continue")
            return False

    model = TestModel({"go": [Reply("first answer"), Reply("checked answer")]})
    spec = define_agent(provider=model, hooks={HookEvent.STOP: [not_yet]}, lifecycle=[Veto()])
    async with open_session(spec) as session:
        assert await session.send("go") == "first answer"
    assert order == ["Stop", "on_should_continue"]
    assert len(model.requests) == 1  # the vetoed continuation never reached the model

    # Without a veto the Stop hook's extra turn runs.
    order.clear()

    class Allow(ChatMiddleware):
        def on_should_continue(self, ctx: RunContext, state: Any) -> None:
            order.append("on_should_continue")

    calls = 0

    async def once(inp: HookInput) -> HookOutput | None:
        nonlocal calls
        calls += 1
        order.append("Stop")
        return HookOutput.skip("Please double-check.") if calls == 1 else None

    model = TestModel({"go": [Reply("first answer"), Reply("checked answer")]})
    spec = define_agent(provider=model, hooks={HookEvent.STOP: [once]}, lifecycle=[Allow()])
    async with open_session(spec) as session:
        assert await session.send("go") == "checked answer"
    assert order == ["Stop", "on_should_continue", "Stop"]


class Store:
    """A routed subagent persistence that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []  # (what, subagent id, detail)
        self.infos: dict[str, SubagentRunInfo] = {}

    async def start(self, info: SubagentRunInfo) -> None:
        self.infos[info.subagent_id] = info
        self.calls.append(("start", info.subagent_id, info.background))
        await trio.lowlevel.checkpoint()

    async def chunk(self, info: SubagentRunInfo, event: RunEvent) -> None:
        self.calls.append(("chunk", info.subagent_id, type(event).__name__))

    async def finish(self, info: SubagentRunInfo, result: SubagentRunResult) -> None:
        self.calls.append(("finish", info.subagent_id, result.text))

    async def abort(self, info: SubagentRunInfo, reason: str) -> None:
        self.calls.append(("abort", info.subagent_id, reason))


class Persisting(ChatMiddleware):
    def __init__(self, store: Store) -> None:
        self.routed_subagent_persistence = store


async def test_routed_persistence_stores_every_foreground_and_background_subagent_run() -> None:
    store = Store()
    spec = define_agent(provider=subagent_script(), tools=[echo], subagents=[HELPER], lifecycle=[Persisting(store)])
    async with open_session(spec) as session:
        await session.send("go")
        [handle] = session.subagents.values()
        await handle.wait()
        root_id = session.root_agent_id
    starts = [(sid, background) for what, sid, background in store.calls if what == "start"]
    assert len(starts) == 2 and sorted(b for _, b in starts) == [False, True]
    assert root_id not in store.infos  # only subagents are routed
    for subagent_id, background in starts:
        mine = [(what, detail) for what, sid, detail in store.calls if sid == subagent_id]
        assert mine[0] == ("start", background)
        assert mine[-1] == ("finish", "bg done" if background else "fg done")
        chunks = [detail for what, detail in mine if what == "chunk"]
        assert "ToolCallResult" in chunks and "RunFinished" in chunks
        assert [what for what, _ in mine].count("finish") == 1
        info = store.infos[subagent_id]
        assert info.parent_agent_id == root_id and info.name == "helper"
        assert (info.call_id is not None) and info.prompt in ("fg job", "bg job")


async def test_routed_persistence_hears_the_abort_of_a_killed_subagent() -> None:
    store = Store()
    gate = trio.Event()

    @define_tool(name="wait_gate", side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def wait_gate(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Wait for the gate."""
        await gate.wait()
        return ToolResult.success("passed")  # pragma: no cover - killed first

    model = TestModel({"stuck": [Reply(tool_calls=[("wait_gate", {})]), Reply("never")]})
    spec = define_agent(provider=model, tools=[wait_gate], subagents=[HELPER], lifecycle=[Persisting(store)])
    async with open_session(spec) as session:
        handle = await session.start_subagent("helper", "stuck")
        await trio.testing.wait_all_tasks_blocked()
        handle.kill()
        await handle.wait()
        assert handle.status is SubagentStatus.CANCELLED
    whats = [what for what, sid, _ in store.calls if sid == handle.id]
    assert whats[0] == "start" and whats[-1] == "abort" and "finish" not in whats
    assert whats.count("abort") == 1


async def _background_stuck_in_a_tool(how: str) -> tuple[Store, Any, list[Any], list[Any]]:
    """A background subagent waits in a tool when the session ends: closed, or cancelled from outside."""
    from trio_agent._journal._events import RequestInterrupted, SubagentCancelled

    store = Store()
    gate = trio.Event()

    @define_tool(
        name="wait_gate", side_effect="pure", kind="readonly", interrupt="cancel", input_schema={"type": "object"}
    )
    async def wait_gate(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Wait for the gate."""
        await gate.wait()
        return ToolResult.success("passed")  # pragma: no cover - the session ends first

    model = TestModel({"stuck": [Reply(tool_calls=[("wait_gate", {})]), Reply("never")]})
    spec = define_agent(provider=model, tools=[wait_gate], subagents=[HELPER], lifecycle=[Persisting(store)])
    with trio.move_on_after(5):
        async with open_session(spec) as session:
            handle = await session.start_subagent("helper", "stuck")
            await trio.testing.wait_all_tasks_blocked()
            if how == "cancelled from outside":
                await trio.sleep_forever()
    root = [e for e in await stream_events(session) if isinstance(e, SubagentCancelled)]
    child = [e for e in await stream_events(session, handle.id) if isinstance(e, RequestInterrupted)]
    return store, handle, root, child


@pytest.mark.parametrize("how", ["closed", "cancelled from outside"])
async def test_a_background_subagent_running_when_the_session_ends_is_cancelled_as_closed(
    how: str, autojump_clock: trio.testing.MockClock
) -> None:
    # Cancelled from outside, its handle stayed RUNNING, the parent stream said "killed" and the
    # routed store was never told; closed, the parent stream said "failed".
    from trio_agent._journal._events import RequestInterruptReason

    store, handle, root, child = await _background_stuck_in_a_tool(how)
    assert handle.status is SubagentStatus.CANCELLED
    assert [e.reason for e in root] == ["session closed"]
    assert [e.reason for e in child] == [RequestInterruptReason.SESSION_CLOSE]
    whats = [what for what, sid, _ in store.calls if sid == handle.id]
    assert whats[0] == "start" and whats[-1] == "abort" and whats.count("abort") == 1


@pytest.mark.parametrize("step", ["start", "chunk"])
async def test_a_routed_persistence_raising_one_of_our_journal_errors_fails_only_that_subagent(step: str) -> None:
    # A LeaseLostError from the application's store (its own journal's, say) was taken for the
    # session's own lease: the whole session ended for one subagent's bookkeeping.
    from trio_agent import LeaseLostError

    class Failing(Store):
        async def start(self, info: SubagentRunInfo) -> None:
            await super().start(info)
            if step == "start":
                raise LeaseLostError("the store's own lease was lost")

        async def chunk(self, info: SubagentRunInfo, event: RunEvent) -> None:
            raise LeaseLostError("the store's own lease was lost")

    store = Failing()
    model = TestModel({"bg": [Reply("bg done")], "root": [Reply("root done"), Reply("again")]})
    spec = define_agent(provider=model, subagents=[HELPER], lifecycle=[Persisting(store)])
    async with open_session(spec) as session:
        handle = await session.start_subagent("helper", "bg")
        await handle.wait()
        assert handle.status is SubagentStatus.FAILED and "LeaseLostError" in (handle.error or "")
        assert await session.send("root") == "root done"  # the session goes on


class Stuck(Store):
    """A store whose *step* (start or chunk) never returns: the first call only, or every one."""

    def __init__(self, step: str, *, every: bool = False) -> None:
        super().__init__()
        self.step = step
        self.every = every
        self.entered = trio.Event()

    async def _stall(self, step: str) -> None:
        if step == self.step and (self.every or not self.entered.is_set()):
            self.entered.set()
            await trio.sleep_forever()

    async def start(self, info: SubagentRunInfo) -> None:
        await super().start(info)
        await self._stall("start")

    async def chunk(self, info: SubagentRunInfo, event: RunEvent) -> None:
        await super().chunk(info, event)
        await self._stall("chunk")


async def _close_while_stuck(store: Stuck, *, cleanup_grace: float = 10.0) -> tuple[float, Any, list[Any], list[Any]]:
    """Close the session while a background subagent's routed store is stuck; how long it took."""
    from trio_agent._journal._events import SessionClosed, SubagentCancelled

    spec = define_agent(provider=TestModel(default=Reply("done")), subagents=[HELPER], lifecycle=[Persisting(store)])
    async with open_session(spec, cleanup_grace=cleanup_grace, close_timeout=30) as session:
        handle = await session.start_subagent("helper", "bg")
        await store.entered.wait()
        closing = trio.current_time()
    took = trio.current_time() - closing
    root = [e for e in await stream_events(session) if isinstance(e, SubagentCancelled)]
    child = await stream_events(session, handle.id)
    assert isinstance(child[-1], SessionClosed)  # the close was not abandoned
    return took, handle, root, child


@pytest.mark.parametrize("step", ["start", "chunk"])
async def test_the_close_cuts_a_background_subagents_routed_persistence_at_once(
    step: str, autojump_clock: trio.testing.MockClock
) -> None:
    # start() and the chunk of RunStarted ran outside the request's abort: the close waited for
    # them until close_timeout, abandoned the close and wrote no session_closed.
    from trio_agent._journal._events import RequestInterrupted, RequestInterruptReason

    store = Stuck(step)
    took, handle, root, child = await _close_while_stuck(store)
    assert took == 0
    assert handle.status is SubagentStatus.CANCELLED
    assert [e.reason for e in root] == ["session closed"]
    assert [e.reason for e in child if isinstance(e, RequestInterrupted)] == [RequestInterruptReason.SESSION_CLOSE]
    whats = [what for what, sid, _ in store.calls if sid == handle.id]
    assert whats[0] == "start" and whats[-1] == "abort" and "finish" not in whats


async def test_what_a_routed_persistence_is_told_after_the_abort_shares_cleanup_grace(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # Every chunk stalls: the one the abort lands on is cut at once, the run's last events (after
    # the abort) get cleanup_grace together, then they are cut too and the close goes on.
    store = Stuck("chunk", every=True)
    took, handle, _, _ = await _close_while_stuck(store, cleanup_grace=4.0)
    assert took == 4.0
    chunks = [detail for what, sid, detail in store.calls if what == "chunk"]
    assert chunks[0] == "RunStarted" and "RunFinished" in chunks
    assert "overran cleanup_grace (4 s) after the run was aborted" in caplog.text
    whats = [what for what, sid, _ in store.calls if sid == handle.id]
    assert whats[-1] == "abort"


# ---------------------------------------------------------------- on_chunk changes only what readers see


class Hide(ChatMiddleware):
    """Drops every event of the given types."""

    def __init__(self, *types: type) -> None:
        self.types = types

    def on_chunk(self, ctx: RunContext, event: RunEvent) -> Any:
        return DROP if isinstance(event, self.types) else None


class Thrice(ChatMiddleware):
    """Passes every StepStarted on three times."""

    def on_chunk(self, ctx: RunContext, event: RunEvent) -> Any:
        return [event, event, event] if isinstance(event, StepStarted) else None


class Results(Store):
    """Keeps each finished subagent run's result."""

    def __init__(self) -> None:
        super().__init__()
        self.results: list[SubagentRunResult] = []

    async def finish(self, info: SubagentRunInfo, result: SubagentRunResult) -> None:
        self.results.append(result)


class PersistingWith(Persisting):
    """A routed persistence and an on_chunk in one middleware."""

    def __init__(self, store: Store, on_chunk: ChatMiddleware) -> None:
        super().__init__(store)
        self.inner = on_chunk

    def on_chunk(self, ctx: RunContext, event: RunEvent) -> Any:
        return self.inner.on_chunk(ctx, event)


@pytest.mark.parametrize("middleware", [Hide(StepStarted), Thrice()], ids=["dropped", "tripled"])
async def test_an_on_chunk_that_drops_or_multiplies_step_started_changes_no_turn_count(
    middleware: ChatMiddleware,
) -> None:
    # The session counted turns from the StepStarted events that passed on_chunk: a streamed
    # request's DoneEvent said 0 (dropped) or 6 (tripled) turns for 2, and so did a subagent's
    # SubagentRunResult.
    store = Results()
    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("fg job")]), Reply("root done")],
            "fg job": [Reply(tool_calls=[("echo", {"x": "fg"})]), Reply("fg done")],
        }
    )
    spec = define_agent(provider=model, tools=[echo], subagents=[HELPER], lifecycle=[PersistingWith(store, middleware)])
    async with open_session(spec) as session:
        seen: list[Any] = []
        async with session.stream("go") as events:
            async for event in events:
                seen.append(event)
    done = seen[-1]
    assert isinstance(done, DoneEvent)
    subagent = [(result.text, result.turns) for result in store.results]
    assert ((done.text, done.turns), subagent) == (("root done", 2), [("fg done", 2)])


async def test_an_on_chunk_that_drops_tool_call_results_leaves_no_call_origin_behind() -> None:
    # The session forgot a call's request when it heard its ToolCallResult: with the event dropped
    # the entry stayed in the session-wide map for the rest of the session.
    model = TestModel(
        {
            "go": [Reply(tool_calls=[("echo", {"x": "root"}), task("fg job")]), Reply("root done")],
            "fg job": [Reply(tool_calls=[("echo", {"x": "fg"})]), Reply("fg done")],
        }
    )
    spec = define_agent(provider=model, tools=[echo], subagents=[HELPER], lifecycle=[Hide(ToolCallResult)])
    async with open_session(spec) as session:
        async with session.stream("go") as events:
            kinds = [type(event).__name__ async for event in events]
        assert "ToolUseEvent" in kinds and "ToolResultEvent" not in kinds  # the readers saw no result
        assert session._host.call_origins == {}


async def test_a_cancelled_subagent_leaves_no_call_origin_behind() -> None:
    # Its call never settled, so no ToolCallResult came: the call's origin outlived its request.
    model = TestModel({"stuck": [Reply(tool_calls=[("hang", {})]), Reply("never")]})

    @define_tool(name="hang", side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def hang(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Wait for ever."""
        await trio.sleep_forever()
        return ToolResult.success("never")  # pragma: no cover - cancelled

    spec = define_agent(provider=model, tools=[hang], subagents=[HELPER])
    async with open_session(spec) as session:
        handle = await session.start_subagent("helper", "stuck")
        await trio.testing.wait_all_tasks_blocked()
        assert list(session._host.call_origins.values()) == [handle._request.request_id]  # running
        handle.cancel()
        await handle.wait()
        assert handle.status is SubagentStatus.IDLE
        assert session._host.call_origins == {}


async def test_an_on_chunk_that_drops_tool_call_ends_leaves_a_subagents_rule_updates_its_own() -> None:
    # The session learnt a call's request from its ToolCallEnd: with the event dropped, a rule a
    # subagent's tool added was recorded as the root request's.
    from trio_agent import PermissionUpdate
    from trio_agent._journal._events import PermissionUpdated
    from trio_agent.tools import Effect

    @define_tool(name="grant", side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def grant(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Allow echo from now on."""
        await ctx.emit(Effect("permission_updates", PermissionUpdate.add("echo")))
        return ToolResult.success("granted")

    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("fg job")]), Reply("root done")],
            "fg job": [Reply(tool_calls=[("grant", {})]), Reply("fg done")],
        }
    )
    requests: dict[str, str] = {}

    class HideAndNote(Hide):
        async def setup(self, ctx: RunContext) -> None:
            requests[ctx.metadata["agent_name"]] = ctx.metadata["request_id"]

    spec = define_agent(provider=model, tools=[grant], subagents=[HELPER], lifecycle=[HideAndNote(ToolCallEnd)])
    async with open_session(spec) as session:
        assert await session.send("go") == "root done"
        [updated] = [e for e in await stream_events(session) if isinstance(e, PermissionUpdated)]
    assert updated.request_id == requests["helper"] != requests["root"]


async def test_an_on_chunk_that_rewrites_text_changes_only_what_readers_see() -> None:
    # The session took a reply's text from the deltas that passed on_chunk: a foreground subagent
    # that failed after a reply was summed up with the rewritten text (one that completes ends
    # with the model's own).
    class Shout(ChatMiddleware):
        def on_chunk(self, ctx: RunContext, event: RunEvent) -> Any:
            if isinstance(event, TextMessageContent):
                return attrs.evolve(event, delta=event.delta.upper())
            return None

    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("fg job")]), Reply("root done")],
            "fg job": [
                Reply(text="let me look", tool_calls=[("echo", {"x": "a"})]),
                Reply(error=ModelError("the provider is down", retryable=False)),
            ],
        }
    )
    spec = define_agent(provider=model, tools=[echo], subagents=[HELPER], lifecycle=[Shout()])
    async with open_session(spec) as session, session.stream("go") as events:
        seen = [event async for event in events]
    # What readers saw: the subagent's deltas (forwarded) and the root's, rewritten.
    assert "".join(e.text for e in seen if isinstance(e, TextDeltaEvent)) == "LET ME LOOKROOT DONE"
    [failed] = [e for e in seen if isinstance(e, SubagentEvent) and e.status is SubagentStatus.FAILED]
    assert failed.summary == "let me look"  # the session's: the reply the loop took
