"""Subagents in real sessions: definitions, the foreground ``task`` tool, nesting under the scheduler's
buckets, background subagents (handles, durability, delivery, ``task_output``), crashes, unknown
names, leaving the session, and one shared middleware stack under 101 concurrent agents."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.session_helpers import results, run_request, stream_events, user_texts
from trio_agent import (
    ConfigError,
    DoneEvent,
    HookEvent,
    HookInput,
    ModelError,
    ModelMiddleware,
    RequestAbortedError,
    SessionBusyError,
    SessionClosedError,
    SubagentDefinition,
    SubagentEvent,
    SubagentHandle,
    SubagentStatus,
    Tool,
    ToolContext,
    ToolResult,
    ToolResultEvent,
    ToolUseEvent,
    TrioAgentError,
    UnknownSubagentError,
    define_tool,
    open_session,
)
from trio_agent._journal._events import (
    ModelAttemptStarted,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    SessionClosed,
    SessionCreated,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    ToolCancelled,
)
from trio_agent._journal._memory import MemoryStore
from trio_agent._journal._store import AppendBatch, AppendResult, AppendTicket
from trio_agent._session._plugins import MiddlewareConfig
from trio_agent._session._subagents import SubagentSupervisor
from trio_agent.models import ModelRequest, StreamChunk, SystemMessage, TextDelta, ToolCallEnd, UserMessage
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import SchedulerLimits, ToolMiddlewareRequest, ToolScheduler

# -- helpers -----------------------------------------------------------------------------


def make_tool(name: str, log: list[Any] | None = None, *, kind: str = "readonly") -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if log is not None:
            log.append((name, ctx.agent_id, dict(inp)))
        return ToolResult.success(f"{name}:{inp.get('x', '')}")

    return define_tool(
        run,
        name=name,
        description=f"the {name} tool",
        side_effect="pure" if kind == "readonly" else "idempotent",
        kind=kind,
        input_schema={"type": "object", "properties": {"x": {"type": "string"}}},
    )


def gated_tool(gate: trio.Event, started: list[str], exits: list[str], name: str = "wait_gate") -> Tool[Any]:
    """A read-only tool that waits for ``gate``; records who started it and who left it (also when cancelled)."""

    async def run(inp: dict[str, Any], ctx: ToolContext) -> ToolResult:
        started.append(ctx.agent_id)
        try:
            await gate.wait()
        finally:
            exits.append(ctx.agent_id)
        return ToolResult.success("gate passed")

    return define_tool(
        run, name=name, description="waits", side_effect="pure", kind="readonly", input_schema={"type": "object"}
    )


def task(prompt: str, subagent: str = "helper", **extra: Any) -> tuple[str, dict[str, Any]]:
    return ("task", {"subagent": subagent, "prompt": prompt, **extra})


HELPER = SubagentDefinition("helper", "a helper", "You are the helper.")


def requests_of(model: TestModel, agent_id: str) -> list[ModelRequest]:
    return [r for r in model.requests if r.metadata["agent_id"] == agent_id]


def children(session: Any) -> list[str]:
    return [agent for agent in session.journal.agents if agent != session.root_agent_id]


def status(handle: SubagentHandle) -> SubagentStatus:
    """The handle's status now (a call, so type checkers do not narrow it across awaits)."""
    return handle.status


def live_tasks() -> set[trio.lowlevel.Task]:
    found: set[trio.lowlevel.Task] = set()
    root = trio.lowlevel.current_root_task()
    assert root is not None
    stack = [root]
    while stack:
        current = stack.pop()
        found.add(current)
        for nursery in current.child_nurseries:
            stack.extend(nursery.child_tasks)
    return found


# ======================================================================== definitions


async def test_the_system_prompt_reaches_the_subagent_as_a_system_message() -> None:
    model = TestModel({"go": [Reply(tool_calls=[task("sub")]), Reply(text="ok")], "sub": [Reply(text="child")]})
    async with open_session(provider=model, system_prompt="You are root.", subagents=[HELPER]) as session:
        await session.send("go")
        [child] = children(session)
    [child_request] = requests_of(model, child)
    assert child_request.messages[0] == SystemMessage("You are the helper.")
    assert not any(isinstance(m, SystemMessage) and "root" in m.content for m in child_request.messages)
    assert user_texts(child_request) == ["sub"]
    assert requests_of(model, "root")[0].messages[0] == SystemMessage("You are root.")


@pytest.mark.parametrize(
    ("sub_tools", "expected"),
    [
        pytest.param(None, {"read", "write"}, id="inherits"),
        pytest.param(["read", "run"], {"read"}, id="intersected"),
        pytest.param([], set(), id="empty-none"),
        pytest.param(["task", "task_output", "read"], {"read"}, id="never-task-tools"),
    ],
)
async def test_the_tool_allowlist_is_intersected_with_the_sessions(
    sub_tools: list[str] | None, expected: set[str]
) -> None:
    log: list[Any] = []
    definition = SubagentDefinition("helper", "h", "You help.", tools=sub_tools)
    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("sub")]), Reply(text="ok")],
            "sub": [Reply(tool_calls=[(n, {"x": n}) for n in ("read", "write", "run", "task")]), Reply(text="c")],
        }
    )
    async with open_session(
        provider=model,
        tools=[make_tool("read", log), make_tool("write", log, kind="write"), make_tool("run", log, kind="execute")],
        allowed_tools=["read", "write", "task"],
        subagents=[definition],
        permission_mode="bypass",
    ) as session:
        await session.send("go")
        [child] = children(session)
    first, second = requests_of(model, child)
    assert {spec.name for spec in first.tools} == expected
    assert {name for name, agent, _ in log if agent == child} == expected
    assert [m.is_error for m in results(second)] == [n not in expected for n in ("read", "write", "run", "task")]


async def test_model_override_and_max_turns() -> None:
    definition = SubagentDefinition("helper", "h", "You help.", model="small-model", max_turns=2)
    log: list[Any] = []
    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("sub")]), Reply(text="ok")],
            "sub": [Reply(tool_calls=[("read", {"x": str(i)})]) for i in range(5)],
        }
    )
    async with open_session(provider=model, tools=[make_tool("read", log)], subagents=[definition]) as session:
        await session.send("go")
        [child] = children(session)
        child_events = await stream_events(session, child)
        root_events = await stream_events(session)
    child_requests = requests_of(model, child)
    assert len(child_requests) == 2, "max_turns bounds the subagent's model calls"
    assert {r.model for r in child_requests} == {"small-model"}
    assert {r.model for r in requests_of(model, "root")} == {"test-model"}
    assert {e.model for e in child_events if isinstance(e, ModelAttemptStarted)} == {"small-model"}
    assert {e.model for e in root_events if isinstance(e, ModelAttemptStarted)} == {"test-model"}
    assert len(log) == 2


@pytest.mark.parametrize("background", [False, True])
async def test_the_parent_is_told_that_a_subagent_stopped_at_its_turn_limit(background: bool) -> None:
    # An answer cut off by max_turns is often empty: never reported as if the subagent finished.
    definition = SubagentDefinition("helper", "h", "You help.", max_turns=1)
    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("sub", background=background)]), Reply(text="ok"), Reply(text="fine")],
            "sub": [Reply(tool_calls=[("read", {})]), Reply(text="never")],
        }
    )
    async with open_session(provider=model, tools=[make_tool("read")], subagents=[definition]) as session:
        await session.send("go")
        if background:
            [handle] = session.subagents.values()
            assert await handle.wait() == ""  # its answer itself is unchanged
            await session.send("next")  # the note joins the root's next turn (this one's, or a later)
    if background:
        [told] = {text for request in requests_of(model, "root") for text in user_texts(request) if "helper-1" in text}
        assert told.startswith("[background subagent helper-1 (helper) completed]")
    else:
        [result] = results(requests_of(model, "root")[-1])
        assert not result.is_error
        told = result.content
    assert "[subagent helper-1 stopped before it finished: it reached its turn limit (1)]" in told


# ======================================================================== foreground


async def test_foreground_task_parent_waits_and_the_answer_is_the_tool_result() -> None:
    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("sub")]), Reply(text="parent done")],
            "sub": [Reply(tool_calls=[("read", {"x": "1"})]), Reply(text="the child's answer")],
        }
    )
    async with open_session(provider=model, tools=[make_tool("read")], subagents=[HELPER]) as session:
        seen, done = await run_request(session, "go")
        [child] = children(session)
        root_events = await stream_events(session)
        child_events = await stream_events(session, child)
    assert done.text == "parent done"
    # The parent's second call comes after both of the child's.
    assert [r.metadata["agent_id"] for r in model.requests] == ["root", child, child, "root"]
    [message] = results(model.requests[-1])
    assert message.content == "the child's answer" and not message.is_error
    [task_result] = [e for e in seen if isinstance(e, ToolResultEvent) and e.agent_id == "root"]
    assert task_result.result.data == {"subagent": "helper"}
    # Durable on the parent's stream, with the task call's id; the child has its own stream.
    [started] = [e for e in root_events if isinstance(e, SubagentStarted)]
    [completed] = [e for e in root_events if isinstance(e, SubagentCompleted)]
    assert started.subagent_id == completed.subagent_id == child
    assert started.call_id == task_result.call_id and started.request_id == done.request_id
    assert isinstance(child_events[0], SessionCreated) and child_events[0].parent_agent_id == session.root_agent_id
    assert any(isinstance(e, RequestCompleted) for e in child_events)
    assert not any(isinstance(e, SubagentStarted) for e in child_events)


async def test_foreground_subagent_events_appear_in_the_parents_stream() -> None:
    model = TestModel({"go": [Reply(tool_calls=[task("sub")]), Reply(text="ok")], "sub": [Reply(text="child")]})
    async with open_session(provider=model, subagents=[HELPER]) as session:
        seen, _ = await run_request(session, "go")
        [child] = children(session)
    events = [e for e in seen if isinstance(e, SubagentEvent)]
    assert [(e.subagent_id, e.status, e.background) for e in events] == [
        (child, SubagentStatus.RUNNING, False),
        (child, SubagentStatus.COMPLETED, False),
    ]


class Barrier(ModelMiddleware):
    """Holds every subagent's first model call until ``size`` subagents are inside it at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.arrived = 0
        self.released = trio.Event()

    async def wrap_stream(
        self, request: ModelRequest, call_next: Callable[[ModelRequest | None], AsyncIterator[StreamChunk]]
    ) -> AsyncIterator[StreamChunk]:
        if request.metadata["agent_id"] != "root" and not results(request):
            self.arrived += 1
            if self.arrived == self.size:
                self.released.set()
            await self.released.wait()
        async for chunk in call_next(request):
            yield chunk


@pytest.mark.parametrize("readonly_slots", [None, 1])
async def test_nested_foreground_subagents_cannot_deadlock(
    readonly_slots: int | None, autojump_clock: trio.testing.MockClock
) -> None:
    """15 parallel ``task`` calls (read-only, more than the bucket's 10 slots), each subagent calling
    read-only tools: all 15 subagents are inside their model call at the same moment (the barrier),
    which needs every parent call to have given its slot back, and all complete."""
    count = 15
    log: list[Any] = []
    script: dict[str, list[Reply]] = {
        "go": [Reply(tool_calls=[task(f"job-{i}") for i in range(count)]), Reply(text="all done")]
    }
    for i in range(count):
        script[f"job-{i}"] = [
            Reply(tool_calls=[("read", {"x": f"{i}a"}), ("read", {"x": f"{i}b"})]),
            Reply(text=f"result-{i}"),
        ]
    model = TestModel(script)
    barrier = Barrier(count)
    async with open_session(
        provider=model,
        tools=[make_tool("read", log)],
        subagents=[HELPER],
        middleware=MiddlewareConfig(model=[barrier]),
    ) as session:
        if readonly_slots is not None:
            session.pipeline.scheduler = ToolScheduler(SchedulerLimits(readonly=readonly_slots))
        assert session.pipeline.scheduler.limits.readonly < count
        with trio.fail_after(300):  # a deadlock jumps the clock here instead of hanging
            assert await session.send("go") == "all done"
        stats = session.pipeline.scheduler.statistics().buckets["readonly"]
    assert barrier.released.is_set()
    assert [m.content for m in results(model.requests[-1])] == [f"result-{i}" for i in range(count)]
    assert len(log) == 2 * count
    assert stats[:2] == (0, 0), "every slot was given back"


# ======================================================================== background


async def test_start_subagent_returns_a_handle_at_once_and_reports_durably() -> None:
    gate = trio.Event()
    started: list[str] = []
    exits: list[str] = []
    model = TestModel(
        {
            "first": [Reply(text="root one"), Reply(text="root two")],
            "bg": [Reply(tool_calls=[("wait_gate", {})]), Reply(text="background answer")],
        }
    )
    async with open_session(provider=model, tools=[gated_tool(gate, started, exits)], subagents=[HELPER]) as session:
        await session.send("first")
        before = len(model.requests)
        handle = await session.start_subagent("helper", "bg")
        assert status(handle) is SubagentStatus.RUNNING and handle.name == "helper"
        assert len(model.requests) == before, "start_subagent returns before the subagent ran"
        assert session.subagents[handle.id] is handle
        await trio.testing.wait_all_tasks_blocked()
        assert started == [handle.id] and status(handle) is SubagentStatus.RUNNING
        gate.set()
        assert await handle.wait() == "background answer"
        assert status(handle) is SubagentStatus.COMPLETED
        root_events = await stream_events(session)
        [start] = [e for e in root_events if isinstance(e, SubagentStarted)]
        [done] = [e for e in root_events if isinstance(e, SubagentCompleted)]
        assert start.subagent_id == done.subagent_id == handle.id
        assert start.call_id is None and start.request_id == done.request_id
        # The completion reaches the parent model at its next turn.
        assert await session.send("next") == "root two"
    note = f"[background subagent {handle.id} (helper) completed]: background answer"
    assert note in user_texts(model.requests[-1])
    assert note not in user_texts(model.requests[0])


async def test_start_subagent_while_a_request_is_accepted_starts_under_it_without_waiting_for_its_end() -> None:
    # A request run in its caller's task is current from before its acceptance is written: a
    # start meanwhile waits for the request to start, not for the whole request to end.
    from store_helpers import LaterStore

    store = LaterStore()
    gate = trio.Event()
    started: list[str] = []
    model = TestModel(
        {
            "warm": [Reply(text="warmed"), Reply(tool_calls=[("wait_gate", {})]), Reply(text="root done")],
            "bg": [Reply(text="background answer")],
        }
    )
    async with trio.open_nursery() as writer:
        writer.start_soon(store.run)
        async with open_session(
            provider=model, journal=store, tools=[gated_tool(gate, started, [])], subagents=[HELPER]
        ) as session:
            await session.send("warm")
            store.gate = trio.Event()  # the next acceptance waits for its commit
            handles: list[SubagentHandle] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.send, "first")
                await trio.testing.wait_all_tasks_blocked()  # "first" is being accepted

                async def start() -> None:
                    handles.append(await session.start_subagent("helper", "bg"))

                nursery.start_soon(start)
                await trio.testing.wait_all_tasks_blocked()
                store.gate.set()
                await trio.testing.wait_all_tasks_blocked()
                # The root request waits in its tool, and the subagent was started under it.
                assert started[:1] == [session.root_agent_id]
                assert len(handles) == 1, "start_subagent waited for the end of the request"
                assert await handles[0].wait() == "background answer"
                gate.set()
            root_events = await stream_events(session)
            [start] = [e for e in root_events if isinstance(e, SubagentStarted)]
            first = [e.request_id for e in root_events if isinstance(e, RequestCompleted)][1]
            assert start.request_id == first
        writer.cancel_scope.cancel()


async def test_start_subagent_between_requests_that_meets_the_close_raises_session_closed_error() -> None:
    # One start holds the request slot (its SubagentStart hook waits), a second waits for the slot,
    # and the session closes meanwhile: both are told the session closed, nothing is left open and
    # the root's stream ends with its session_closed.
    gate = trio.Event()

    async def hook(inp: HookInput) -> None:
        await gate.wait()

    outcomes: list[str] = []

    async def start(prompt: str) -> None:
        try:
            await session.start_subagent("helper", prompt)
        except TrioAgentError as exc:
            outcomes.append(type(exc).__name__)
        else:
            outcomes.append("started")

    model = TestModel(default=Reply("never"))
    async with (
        open_session(provider=model, subagents=[HELPER], hooks={HookEvent.SUBAGENT_START: [hook]}) as session,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(start, "first")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(start, "second")
        await trio.testing.wait_all_tasks_blocked()
        await session.close()
        gate.set()
    assert outcomes == ["SessionClosedError", "SessionClosedError"]
    root = await stream_events(session)
    assert not any(isinstance(e, RequestAccepted) for e in root)
    assert isinstance(root[-1], SessionClosed)
    assert model.requests == []


@pytest.mark.parametrize("bad", [123, None, "", "   "])
async def test_a_bad_prompt_is_refused_before_anything_is_written(bad: Any) -> None:
    # As send() does: a prompt is a non-empty string, never its str() sent to the model and journalled.
    model = TestModel(default=Reply("ok"))
    async with open_session(provider=model, subagents=[HELPER]) as session:
        with pytest.raises(ConfigError, match="prompt"):
            await session.start_subagent("helper", bad)
        assert children(session) == [] and model.requests == []
        assert not any(isinstance(e, RequestAccepted) for e in await stream_events(session))
        handle = await session.start_subagent("helper", "job")
        assert await handle.wait() == "ok"
        with pytest.raises(ConfigError, match="prompt"):
            handle.resume(bad)
        assert status(handle) is SubagentStatus.COMPLETED
        handle.resume("more")  # the refused resume changed nothing
        assert await handle.wait() == "ok"
        accepted = [e.input for e in await stream_events(session, handle.id) if isinstance(e, RequestAccepted)]
    assert accepted == [{"prompt": "job"}, {"prompt": "more"}]
    assert [user_texts(request)[-1] for request in model.requests] == ["job", "more"]


@pytest.mark.parametrize("background", [False, True])
async def test_a_blank_task_prompt_is_a_validation_error_for_the_model(background: bool) -> None:
    model = TestModel(
        {"go": [Reply(tool_calls=[task("   ", background=background)]), Reply(text="parent ok")]},
        default=Reply(text="the child must not run"),
    )
    async with open_session(provider=model, subagents=[HELPER]) as session:
        assert await session.send("go") == "parent ok"
        assert children(session) == []
    [message] = results(model.requests[-1])
    assert message.is_error and "blank" in message.content


async def test_a_background_task_survives_the_request_that_started_it() -> None:
    gate = trio.Event()
    started: list[str] = []
    exits: list[str] = []
    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("bg", background=True)]), Reply(text="started it"), Reply(text="seen it")],
            "bg": [Reply(tool_calls=[("wait_gate", {})]), Reply(text="late answer")],
        }
    )
    async with open_session(provider=model, tools=[gated_tool(gate, started, exits)], subagents=[HELPER]) as session:
        seen, done = await run_request(session, "go")
        assert done.text == "started it"
        [task_result] = [e for e in seen if isinstance(e, ToolResultEvent)]
        task_id = task_result.result.data["task_id"]
        handle = session.subagents[task_id]
        await trio.testing.wait_all_tasks_blocked()
        # The request is over; the subagent still runs in the session's nursery.
        assert status(handle) is SubagentStatus.RUNNING and started == [task_id] and exits == []
        gate.set()
        assert await handle.wait() == "late answer"
        root_events = await stream_events(session)
        [start] = [e for e in root_events if isinstance(e, SubagentStarted)]
        assert start.call_id == task_result.call_id and start.request_id == done.request_id
        assert any(isinstance(e, SubagentCompleted) and e.subagent_id == task_id for e in root_events)
        assert await session.send("and now?") == "seen it"
    assert f"[background subagent {task_id} (helper) completed]: late answer" in user_texts(model.requests[-1])


async def test_cancel_resume_and_kill() -> None:
    gate = trio.Event()
    started: list[str] = []
    exits: list[str] = []
    model = TestModel(
        {
            "first": [Reply(tool_calls=[("wait_gate", {})]), Reply(text="resumed answer")],
            "second": [Reply(tool_calls=[("wait_gate", {})])],
        }
    )
    async with open_session(provider=model, tools=[gated_tool(gate, started, exits)], subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "first")
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(SessionBusyError):
            handle.resume("too early")
        handle.cancel()
        assert await handle.wait() is None
        assert status(handle) is SubagentStatus.IDLE and exits == [handle.id]
        child_events = await stream_events(session, handle.id)
        assert any(isinstance(e, ToolCancelled) for e in child_events)
        assert any(isinstance(e, RequestInterrupted) for e in child_events)
        # Cancel is not final: nothing is reported to the parent yet.
        assert not any(isinstance(e, (SubagentCancelled, SubagentCompleted)) for e in await stream_events(session))
        handle.resume("please finish")
        assert status(handle) is SubagentStatus.RUNNING
        assert await handle.wait() == "resumed answer"
        assert status(handle) is SubagentStatus.COMPLETED
        assert "please finish" in user_texts(requests_of(model, handle.id)[-1])

        other = await session.start_subagent("helper", "second")
        await trio.testing.wait_all_tasks_blocked()
        other.kill()
        await other.wait()
        assert status(other) is SubagentStatus.CANCELLED
        with pytest.raises(SessionClosedError):
            other.resume("again")
        root_events = await stream_events(session)
    cancelled = [e for e in root_events if isinstance(e, SubagentCancelled)]
    assert [(e.subagent_id, e.reason) for e in cancelled] == [(other.id, "cancelled")]
    assert [e.subagent_id for e in root_events if isinstance(e, SubagentCompleted)] == [handle.id]


async def test_cancel_right_after_start_or_resume_stops_the_work_before_it_runs() -> None:
    # Its status reads running at once, before its task took the work up: cancel() reaches it then.
    model = TestModel({"first": [Reply("first answer")], "second": [Reply("second answer")]}, default=Reply("third"))
    async with open_session(provider=model, subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "first")
        assert status(handle) is SubagentStatus.RUNNING
        handle.cancel()
        assert await handle.wait() is None
        assert status(handle) is SubagentStatus.IDLE
        handle.resume("second")
        assert status(handle) is SubagentStatus.RUNNING
        handle.cancel()
        assert await handle.wait() is None
        assert status(handle) is SubagentStatus.IDLE
        assert requests_of(model, handle.id) == [], "cancelled work never reaches the model"
        assert not any(isinstance(e, RequestCompleted) for e in await stream_events(session, handle.id))
        handle.resume("third")  # still resumable
        assert await handle.wait() == "third"
        root_events = await stream_events(session)
    assert not any(isinstance(e, SubagentCancelled) for e in root_events)
    assert [e.subagent_id for e in root_events if isinstance(e, SubagentCompleted)] == [handle.id]


async def test_a_subagent_killed_before_its_work_ran_is_recorded_cancelled_not_killed() -> None:
    # `killed` is the reason for a subagent killed while idle; this one's status read running.
    model = TestModel(default=Reply("never"))
    async with open_session(provider=model, subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "work")
        handle.kill()
        await handle.wait()
        assert status(handle) is SubagentStatus.CANCELLED
        root_events = await stream_events(session)
    cancelled = [(e.subagent_id, e.reason) for e in root_events if isinstance(e, SubagentCancelled)]
    assert cancelled == [(handle.id, "cancelled")]


async def test_resume_after_cancel_sends_a_history_where_every_tool_call_is_answered() -> None:
    gate = trio.Event()
    model = TestModel({"first": [Reply(tool_calls=[("wait_gate", {})]), Reply(text="resumed answer")]})
    async with open_session(provider=model, tools=[gated_tool(gate, [], [])], subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "first")
        await trio.testing.wait_all_tasks_blocked()
        handle.cancel()
        await handle.wait()
        handle.resume("please finish")
        await handle.wait()
    last = requests_of(model, handle.id)[-1]
    asked = {part.id for m in last.messages for part in getattr(m, "parts", ()) if hasattr(part, "arguments")}
    answered = {m.tool_call_id for m in results(last)}
    assert asked <= answered


async def test_resume_after_completion_runs_the_new_prompt(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel({"first": [Reply(text="first answer"), Reply(text="second answer")]})
    async with open_session(provider=model, subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "first")
        assert await handle.wait() == "first answer"
        handle.resume("and another thing")
        with trio.fail_after(60):  # the bug: this would wait forever
            assert await handle.wait() == "second answer"


def task_output_model(gate: trio.Event) -> TestModel:
    """Root: start a background task, check it without blocking (and an unknown id), then wait for it."""

    def respond(request: ModelRequest) -> Reply:
        if request.metadata["agent_id"] != "root":
            return Reply(text="background answer") if results(request) else Reply(tool_calls=[("wait_gate", {})])
        seen = results(request)
        if not seen:
            return Reply(tool_calls=[task("bg", background=True)])
        match = re.search(r"background subagent (\S+);", seen[0].content)
        assert match is not None
        task_id = match.group(1)
        if len(seen) == 1:
            return Reply(
                tool_calls=[("task_output", {"task_id": task_id, "block": False}), ("task_output", {"task_id": "nope"})]
            )
        if len(seen) == 3:
            return Reply(tool_calls=[("task_output", {"task_id": task_id, "block": True})])
        return Reply(text="finished")

    return TestModel(respond=respond)


async def test_task_output_checks_and_waits() -> None:
    gate = trio.Event()
    model = task_output_model(gate)
    async with open_session(provider=model, tools=[gated_tool(gate, [], [])], subagents=[HELPER]) as session:
        inputs: dict[str, dict[str, Any]] = {}
        outputs: dict[str, ToolResult] = {}
        async with session.stream("go") as events:
            async for event in events:
                if isinstance(event, ToolUseEvent):
                    inputs[event.call_id] = event.input
                    if event.input.get("block") is True:
                        [handle] = session.subagents.values()
                        assert status(handle) is SubagentStatus.RUNNING  # task_output has something to wait for
                        gate.set()
                if isinstance(event, ToolResultEvent) and event.tool_name == "task_output":
                    outputs[event.call_id] = event.result
        assert events.text == "finished"
    [handle] = session.subagents.values()

    def output(**match: Any) -> ToolResult:
        [found] = [r for c, r in outputs.items() if all(inputs[c].get(k) == v for k, v in match.items())]
        return found

    running = output(task_id=handle.id, block=False)
    unknown = output(task_id="nope")
    waited = output(task_id=handle.id, block=True)
    assert running.data == {"task_id": handle.id, "status": "running"}
    assert unknown.error is not None and unknown.error.code == "unknown_task"
    assert waited.data == {"task_id": handle.id, "status": "completed"}
    assert "background answer" in str(waited.output)


# ======================================================================== crashes


async def test_a_background_subagent_crash_is_reported_not_raised() -> None:
    model = TestModel(
        {
            "first": [Reply(text="root one"), Reply(text="root two")],
            "bg": [Reply(error=ModelError("the model exploded", code="BOOM"))],
        }
    )
    async with open_session(provider=model, subagents=[HELPER]) as session:
        await session.send("first")
        handle = await session.start_subagent("helper", "bg")
        assert await handle.wait() is None
        assert status(handle) is SubagentStatus.FAILED
        assert handle.error is not None and "the model exploded" in handle.error
        root_events = await stream_events(session)
        [cancelled] = [e for e in root_events if isinstance(e, SubagentCancelled)]
        assert cancelled.subagent_id == handle.id and cancelled.reason == "failed"
        assert any(isinstance(e, RequestFailed) for e in await stream_events(session, handle.id))
        # The session is fine, and the parent hears about it at its next turn.
        assert await session.send("next") == "root two"
    notes = [t for t in user_texts(model.requests[-1]) if t.startswith(f"[background subagent {handle.id}")]
    assert len(notes) == 1 and "failed" in notes[0] and "the model exploded" in notes[0]


async def test_a_foreground_subagent_crash_is_a_tool_error_for_the_parent() -> None:
    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("sub")]), Reply(text="parent recovered")],
            "sub": [Reply(error=ModelError("child model down", code="DOWN"))],
        }
    )
    async with open_session(provider=model, subagents=[HELPER]) as session:
        _, done = await run_request(session, "go")
        [child] = children(session)
        root_events = await stream_events(session)
        child_events = await stream_events(session, child)
    assert done.text == "parent recovered" and done.stop_reason == "end_turn"
    [message] = results(model.requests[-1])
    assert message.is_error and "child model down" in message.content
    [cancelled] = [e for e in root_events if isinstance(e, SubagentCancelled)]
    assert cancelled.subagent_id == child
    assert any(isinstance(e, RequestFailed) for e in child_events)


async def test_a_tool_crash_inside_a_subagent_is_the_subagents_tool_error() -> None:
    @define_tool(
        name="crash", description="crashes", side_effect="pure", kind="readonly", input_schema={"type": "object"}
    )
    async def crash(inp: dict[str, Any], ctx: ToolContext) -> ToolResult:
        raise RuntimeError("tool bug")

    model = TestModel(
        {
            "go": [Reply(tool_calls=[task("sub")]), Reply(text="parent ok")],
            "sub": [Reply(tool_calls=[("crash", {})]), Reply(text="child coped")],
        }
    )
    async with open_session(provider=model, tools=[crash], subagents=[HELPER]) as session:
        assert await session.send("go") == "parent ok"
        [child] = children(session)
    [message] = results(requests_of(model, child)[-1])
    assert message.is_error and "tool bug" in message.content
    assert [m.content for m in results(model.requests[-1])] == ["child coped"]


async def test_unknown_subagent_names() -> None:
    model = TestModel({"go": [Reply(tool_calls=[task("sub", subagent="ghost")]), Reply(text="ok")]})
    async with open_session(provider=model, subagents=[HELPER]) as session:
        seen, done = await run_request(session, "go")
        assert children(session) == []
        with pytest.raises(UnknownSubagentError, match="ghost"):
            await session.start_subagent("ghost", "x")
        assert children(session) == []
    assert done.text == "ok"
    [result] = [e.result for e in seen if isinstance(e, ToolResultEvent)]
    assert result.error is not None and result.error.code == "unknown_subagent"
    [message] = results(model.requests[-1])
    assert message.is_error and "ghost" in message.content and "helper" in message.content


@pytest.mark.parametrize("name", [["helper"], {"n": 1}, 123, None], ids=["list", "dict", "int", "none"])
async def test_a_subagent_name_that_is_not_a_string_is_an_unknown_subagent(name: Any) -> None:
    # A list or a dict (unhashable) raised a raw TypeError from the definitions' lookup.
    model = TestModel({"next": [Reply(text="fine")]})
    async with open_session(provider=model, subagents=[HELPER]) as session:
        with pytest.raises(UnknownSubagentError, match=r"unknown subagent .* \(defined: helper\)"):
            await session.start_subagent(name, "x")
        assert children(session) == []
        assert await session.send("next") == "fine"


async def test_the_session_stays_usable_after_an_unknown_subagent_name() -> None:
    model = TestModel({"next": [Reply(text="fine")]})
    async with open_session(provider=model, subagents=[HELPER]) as session:
        with pytest.raises(UnknownSubagentError):
            await session.start_subagent("ghost", "x")
        assert await session.send("next") == "fine"


@pytest.mark.parametrize("window", ["just-accepted", "just-finished"])
async def test_start_subagent_while_a_request_starts_or_finishes(window: str) -> None:
    model = TestModel({"go": [Reply(text="root answer")], "bg": [Reply(text="bg answer")]})
    async with open_session(provider=model, subagents=[HELPER]) as session:
        handle = None
        async with session.stream("go") as events:
            if window == "just-accepted":
                handle = await session.start_subagent("helper", "bg")
            async for event in events:
                if window == "just-finished" and isinstance(event, DoneEvent):
                    handle = await session.start_subagent("helper", "bg")
        assert events.text == "root answer"
        assert handle is not None and await handle.wait() == "bg answer"


async def test_a_restart_cancels_the_calls_a_subagent_scheduled_and_never_started() -> None:
    """The process dies while a background subagent's first call runs and its second waits for
    the only slot. The subagent never runs again after the restart, so the waiting call is
    settled cancelled: recovery ran it (a non_idempotent send) for nobody to read."""
    from trio_agent import LeaseLostError, define_agent
    from trio_agent.journal import MemoryStore, RecoveryDecision, ToolRecoveryAction, ToolScheduled, open_journal

    sent: list[Any] = []
    sending, restarted = trio.Event(), trio.Event()

    @define_tool(name="send", input_schema={"type": "object"}, side_effect="non_idempotent", kind="readonly")
    async def send(inp: dict[str, Any], ctx: ToolContext) -> str:
        """Sends a message (must not happen twice)."""
        sent.append(inp["n"])
        sending.set()
        await restarted.wait()  # holds the slot until the process dies
        return "sent"

    model = TestModel({"bg": [Reply(tool_calls=[("send", {"n": 1}), ("send", {"n": 2})])]})
    spec = define_agent(provider=model, tools=[send], subagents=[HELPER], scheduler_limits=SchedulerLimits(readonly=1))
    store = MemoryStore()
    with pytest.raises(LeaseLostError):
        async with open_journal(store, session_id="s") as journal, open_session(spec, journal=journal) as session:
            handle = await session.start_subagent("helper", "bg")
            await sending.wait()
            await trio.testing.wait_all_tasks_blocked()
            await journal.flush()  # the waiting call's tool_scheduled is durable, as any later write makes it
            journal._lose(LeaseLostError("the process died"))
            await trio.sleep_forever()
    lease = await store.current_lease("s")
    assert lease is not None
    await store.release_lease(lease)
    [waiting] = [n for n in (1, 2) if n not in sent]
    restarted.set()
    async with open_session(spec, journal=store, session_id="s") as session:
        child = await stream_events(session, handle.id)
    assert sent == [3 - waiting], "recovery started the call of a subagent that never runs again"
    [scheduled] = [e for e in child if isinstance(e, ToolScheduled) and e.model_input == {"n": waiting}]
    decisions = {e.call_id: e.decision for e in child if isinstance(e, RecoveryDecision)}
    assert decisions[scheduled.call_id] is ToolRecoveryAction.CANCEL
    assert [e.call_id for e in child if isinstance(e, ToolCancelled)] == [scheduled.call_id]
    root = await stream_events(session)
    assert [e.reason for e in root if isinstance(e, SubagentCancelled)] == ["process_restart"]


@pytest.mark.parametrize("narrowed", [None, "definition", "session"])
async def test_a_restart_re_runs_a_subagents_call_under_its_allowlist(narrowed: str | None) -> None:
    """A subagent's pure call started when the process died runs again at the reopen, under that
    subagent's allowlist as the spec of the new life gives it: it ran with no filter at all (the
    permission stage knew no agent of that id), so a tool since taken from the subagent (or the
    session) still ran."""
    from trio_agent import LeaseLostError, define_agent
    from trio_agent.journal import MemoryStore, ToolCompleted, open_journal

    looked: list[str] = []
    looking, restarted = trio.Event(), trio.Event()

    @define_tool(name="look", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
    async def look(inp: dict[str, Any], ctx: ToolContext) -> str:
        """Looks around."""
        looked.append(ctx.agent_id)
        looking.set()
        await restarted.wait()  # runs until the process dies
        return "looked"

    other = make_tool("other")
    model = TestModel({"bg": [Reply(tool_calls=[("look", {})])]})
    looker = SubagentDefinition("looker", "looks", "You look.", tools=["look", "other"])
    store = MemoryStore()
    spec = define_agent(provider=model, tools=[look, other], subagents=[looker])
    with pytest.raises(LeaseLostError):
        async with open_journal(store, session_id="s") as journal, open_session(spec, journal=journal) as session:
            handle = await session.start_subagent("looker", "bg")
            await looking.wait()
            journal._lose(LeaseLostError("the process died"))
            await trio.sleep_forever()
    lease = await store.current_lease("s")
    assert lease is not None
    await store.release_lease(lease)
    restarted.set()
    options: dict[str, Any] = {"provider": model, "tools": [look, other], "subagents": [looker]}
    if narrowed == "definition":
        options["subagents"] = [attrs.evolve(looker, tools=["other"])]
    elif narrowed == "session":
        options["allowed_tools"] = ["other"]
    async with open_session(define_agent(**options), journal=store, session_id="s") as session:
        child = await stream_events(session, handle.id)
    settled = [e for e in child if isinstance(e, (ToolCompleted, ToolCancelled))]
    if narrowed is None:
        assert looked == [handle.id, handle.id] and isinstance(settled[-1], ToolCompleted)
    else:
        assert looked == [handle.id], "a tool the subagent may no longer use ran again"
        [denied] = settled
        assert isinstance(denied, ToolCancelled) and denied.reason == "permission_denied"
        assert f"not available to agent {handle.id!r}" in denied.result["output"]


# ======================================================================== subagent ids across lives


CHECKOUT = Path(__file__).resolve().parent.parent
SUBAGENT_WORKER = CHECKOUT / "tests" / "session_crash" / "subagent_worker.py"


async def subagent_ids_of_one_life(session: Any, *, hang: trio.Event | None = None) -> list[str]:
    """A foreground subagent (the root's task call), then a background one; the ids this life made."""
    before = set(session.journal.agents)
    assert await session.send("go") == "root done"
    background = await session.start_subagent("helper", "bg")
    if hang is None:
        assert await background.wait() == "bg done"
    else:
        await hang.wait()
    return [agent for agent in session.journal.agents if agent not in before]


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
@pytest.mark.parametrize("first_life_ends", ["close", "crash"])
async def test_a_reopened_session_gives_new_subagents_ids_after_those_its_journal_holds(
    store_kind: str, first_life_ends: str, tmp_path: Path
) -> None:
    """Subagent ids count per session and name from 1; a reopened session goes on after the ids its
    journal holds (the counter was the process's: a new process handed out ``helper-1`` again, and
    its ``session_created`` failed on the stream already there)."""
    from trio_agent import LeaseLostError, define_agent
    from trio_agent.journal import MemoryStore, open_journal, open_sqlite_store

    hanging, restarted = trio.Event(), trio.Event()

    @define_tool(name="hang", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
    async def hang(inp: dict[str, Any], ctx: ToolContext) -> str:
        """Runs until the process dies (recovery runs it again, to its end)."""
        hanging.set()
        await restarted.wait()
        return "hung"

    def spec(*, bg: Reply) -> Any:
        model = TestModel(
            {
                "go": [Reply(tool_calls=[task("sub")]), Reply(text="root done")],
                "sub": [Reply(text="helper done")],
                "bg": [bg],
            }
        )
        return define_agent(provider=model, tools=[hang], subagents=[HELPER])

    async with contextlib.AsyncExitStack() as stack:
        store: Any = MemoryStore()
        if store_kind == "sqlite":
            store = await stack.enter_async_context(open_sqlite_store(tmp_path / "j.db"))
        if first_life_ends == "close":
            async with open_session(spec(bg=Reply(text="bg done")), journal=store, session_id="s") as session:
                first = await subagent_ids_of_one_life(session)
        else:
            with pytest.raises(LeaseLostError):
                async with (
                    open_journal(store, session_id="s") as journal,
                    open_session(spec(bg=Reply(tool_calls=[("hang", {})])), journal=journal) as session,
                ):
                    first = await subagent_ids_of_one_life(session, hang=hanging)
                    await journal.flush()
                    journal._lose(LeaseLostError("the process died"))
                    await trio.sleep_forever()
            lease = await store.current_lease("s")
            assert lease is not None
            await store.release_lease(lease)
            restarted.set()
        async with open_session(spec(bg=Reply(text="bg done")), journal=store, session_id="s") as session:
            second = await subagent_ids_of_one_life(session)
            root = await stream_events(session)
    assert first == ["helper-1", "helper-2"]
    assert second == ["helper-3", "helper-4"], "the reopened session reused an id of its journal"
    assert [e.subagent_id for e in root if isinstance(e, SubagentCompleted)][-2:] == second


async def test_subagent_ids_count_per_session() -> None:
    """Two sessions of one spec in one process each number their subagents from 1, per name."""
    from trio_agent import define_agent
    from trio_agent.journal import MemoryStore

    other = SubagentDefinition("other", "another helper", "You help too.")
    spec = define_agent(provider=TestModel(default=Reply(text="done")), subagents=[HELPER, other])
    store = MemoryStore()
    async with (
        open_session(spec, journal=store, session_id="a") as a,
        open_session(spec, journal=store, session_id="b") as b,
    ):
        made = [await session.start_subagent(name, "go") for session in (a, b, a) for name in ("helper", "other")]
        for handle in made:
            await handle.wait()
    assert [handle.id for handle in made] == ["helper-1", "other-1", "helper-1", "other-1", "helper-2", "other-2"]


async def test_a_new_process_never_reuses_a_subagent_id_the_journal_holds(tmp_path: Path) -> None:
    """The defect as a user meets it: three lives of one session, each a process of its own (every
    counter of the library starts afresh), the first closed cleanly, the second crashing while a
    subagent runs. Each later life gives its subagents new ids, and they run."""
    from trio_agent.journal import open_sqlite_store

    journal = tmp_path / "j.db"
    lives: list[list[str]] = []
    for mode in ("close", "crash", "close"):
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, str(SUBAGENT_WORKER), str(journal), "s", mode],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                cwd=str(CHECKOUT),
                env={**os.environ, "PYTHONPATH": str(CHECKOUT)},  # this checkout's trio_agent
            )
        assert done.returncode == (3 if mode == "crash" else 0), done.stderr.decode()
        lives.append(json.loads(done.stdout.decode().strip().splitlines()[-1]))
        if mode == "crash":  # the dead process still holds the lease
            async with open_sqlite_store(journal) as store:
                lease = await store.current_lease("s")
                assert lease is not None
                await store.release_lease(lease)
    assert lives == [["helper-1", "helper-2"], ["helper-3", "helper-4"], ["helper-5", "helper-6"]]


# ======================================================================== leaving the session


async def test_leaving_the_session_cancels_background_subagents_and_records_it() -> None:
    gate = trio.Event()
    started: list[str] = []
    exits: list[str] = []
    model = TestModel(
        {
            **{f"bg-{i}": [Reply(tool_calls=[("wait_gate", {})])] for i in range(3)},
            "quick": [Reply(text="quick answer")],
        }
    )
    before = live_tasks()
    async with open_session(provider=model, tools=[gated_tool(gate, started, exits)], subagents=[HELPER]) as session:
        running = [await session.start_subagent("helper", f"bg-{i}") for i in range(3)]
        quick = await session.start_subagent("helper", "quick")
        await trio.testing.wait_all_tasks_blocked()
        assert status(quick) is SubagentStatus.COMPLETED
        assert sorted(started) == sorted(h.id for h in running)
        assert len(live_tasks()) > len(before)
    assert live_tasks() == before, "no task outlives the session"
    assert sorted(exits) == sorted(h.id for h in running), "every blocked tool saw the cancellation"
    for handle in running:
        assert status(handle) is SubagentStatus.CANCELLED
    root_events = await stream_events(session)
    cancelled = {e.subagent_id for e in root_events if isinstance(e, SubagentCancelled)}
    assert cancelled == {h.id for h in running}
    assert [e.subagent_id for e in root_events if isinstance(e, SubagentCompleted)] == [quick.id]
    for handle in running:
        child_events = await stream_events(session, handle.id)
        interrupted = [e for e in child_events if isinstance(e, RequestInterrupted)]
        assert [e.reason for e in interrupted] == [RequestInterruptReason.SESSION_CLOSE]
        assert sum(isinstance(e, SessionClosed) for e in child_events) == 1
        assert isinstance(child_events[-1], SessionClosed)
    assert sum(isinstance(e, SessionClosed) for e in root_events) == 1


@pytest.mark.parametrize("how", ["kill", "session-close"])
async def test_killing_an_idle_subagent_is_final_and_recorded(how: str) -> None:
    gate = trio.Event()
    model = TestModel({"idle": [Reply(tool_calls=[("wait_gate", {})])]})
    async with open_session(provider=model, tools=[gated_tool(gate, [], [])], subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "idle")
        await trio.testing.wait_all_tasks_blocked()
        handle.cancel()
        await handle.wait()
        assert status(handle) is SubagentStatus.IDLE
        if how == "kill":
            handle.kill()
            await handle.wait()
            await trio.testing.wait_all_tasks_blocked()
    assert status(handle) is SubagentStatus.CANCELLED
    root_events = await stream_events(session)
    assert [e.subagent_id for e in root_events if isinstance(e, SubagentCancelled)] == [handle.id]


async def test_the_session_closes_while_a_foreground_subagent_runs() -> None:
    gate = trio.Event()
    started: list[str] = []
    exits: list[str] = []
    model = TestModel(
        {"go": [Reply(tool_calls=[task("sub")]), Reply(text="never")], "sub": [Reply(tool_calls=[("wait_gate", {})])]}
    )
    failures: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        before = live_tasks()
        async with open_session(
            provider=model, tools=[gated_tool(gate, started, exits)], subagents=[HELPER]
        ) as session:

            async def send() -> None:
                try:
                    await session.send("go")
                except Exception as exc:
                    failures.append(exc)

            nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            [child] = children(session)
            assert started == [child]
        # The session is closed; the request's caller got its answer.
        await trio.testing.wait_all_tasks_blocked()
        assert live_tasks() == before
    assert exits == [child]
    assert len(failures) == 1 and isinstance(failures[0], RequestAbortedError)
    root_events = await stream_events(session)
    assert any(isinstance(e, SubagentCancelled) and e.subagent_id == child for e in root_events)
    assert any(isinstance(e, RequestInterrupted) for e in root_events)
    child_events = await stream_events(session, child)
    assert any(isinstance(e, ToolCancelled) for e in child_events)
    assert sum(isinstance(e, SessionClosed) for e in child_events) == 1


async def test_a_cancelled_foreground_subagent_records_request_interrupted() -> None:
    gate = trio.Event()
    model = TestModel(
        {"go": [Reply(tool_calls=[task("sub")]), Reply(text="never")], "sub": [Reply(tool_calls=[("wait_gate", {})])]}
    )
    async with open_session(provider=model, tools=[gated_tool(gate, [], [])], subagents=[HELPER]) as session:
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(RequestAbortedError):
                    await session.send("go")

            nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            await session.abort()
        [child] = children(session)
        child_events = await stream_events(session, child)
    assert [e.reason for e in child_events if isinstance(e, RequestInterrupted)] == [RequestInterruptReason.USER_ABORT]


# ======================================================================== one middleware stack, 101 agents

AGENTS = 100


def agent_tags() -> list[str]:
    return ["agent-root", *(f"agent-{i:03d}" for i in range(AGENTS))]


def tag_of(request: ModelRequest) -> str:
    return next(m.content for m in request.messages if isinstance(m, UserMessage))


def respond(request: ModelRequest) -> Reply:
    tag = tag_of(request)
    if results(request):
        return Reply(text=f"done {tag}")
    return Reply(tool_calls=[("echo", {"x": tag})])


async def spin(count: int) -> None:
    for _ in range(count):
        await trio.lowlevel.checkpoint()


class InFlight:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


class ToolProbe:
    """Shared tool middleware: notes (tag, agent) on entry, checkpoints, and reports what it believes at exit."""

    stateful = False

    def __init__(self, plan: dict[str, int], seen: list[tuple[str, str, str, Any]]) -> None:
        self.plan = plan
        self.seen = seen
        self.in_flight = InFlight()

    async def __call__(self, request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        tag, agent = request.input["x"], request.context.agent_id
        if self.stateful:
            self.tag, self.agent = tag, agent  # the bug under test: request state on the shared object
        self.in_flight.enter()
        await spin(self.plan[tag])
        result: ToolResult = await call_next()
        await spin(self.plan[tag])
        self.in_flight.leave()
        if self.stateful:
            tag, agent = self.tag, self.agent
        self.seen.append(("tool", tag, agent, result.output))
        return result


class StatefulToolProbe(ToolProbe):
    stateful = True


class ModelProbe(ModelMiddleware):
    """Shared model middleware: the same idea around ``wrap_stream``."""

    stateful = False

    def __init__(self, plan: dict[str, int], seen: list[tuple[str, str, str, Any]]) -> None:
        self.plan = plan
        self.seen = seen
        self.in_flight = InFlight()

    async def wrap_stream(
        self, request: ModelRequest, call_next: Callable[[ModelRequest | None], AsyncIterator[StreamChunk]]
    ) -> AsyncIterator[StreamChunk]:
        tag, agent = tag_of(request), str(request.metadata["agent_id"])
        if self.stateful:
            self.tag, self.agent = tag, agent
        self.in_flight.enter()
        await spin(self.plan[tag])
        produced: list[str] = []
        async for chunk in call_next(request):
            if isinstance(chunk, TextDelta):
                produced.append(chunk.text)
            elif isinstance(chunk, ToolCallEnd):
                produced.append(chunk.arguments)
            yield chunk
        await spin(self.plan[tag])
        self.in_flight.leave()
        if self.stateful:
            tag, agent = self.tag, self.agent
        self.seen.append(("model", tag, agent, "".join(produced)))


class StatefulModelProbe(ModelProbe):
    stateful = True


def mismatches(seen: list[tuple[str, str, str, Any]], agent_of: dict[str, str]) -> list[str]:
    """The check: what each probe believed at exit must belong to the call it wrapped."""
    wrong = []
    for layer, tag, agent, output in seen:
        if agent_of.get(tag) != agent:
            wrong.append(f"{layer}: tag {tag} is agent {agent_of.get(tag)}, not {agent}")
        expected = {f"echo:{tag}"} if layer == "tool" else {f"done {tag}", json.dumps({"x": tag})}
        if output not in expected:
            wrong.append(f"{layer}: {tag} produced {output!r}")
    return wrong


class Gate:
    """Holds callers until ``size`` of them arrived, then lets everyone through (no timing involved)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.arrived = 0
        self.open = trio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived >= self.size:
            self.open.set()
        await self.open.wait()


class FirstCallGate(ModelMiddleware):
    """Outside the probes: every agent's first model call waits until all 101 agents are there."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def wrap_stream(
        self, request: ModelRequest, call_next: Callable[[ModelRequest | None], AsyncIterator[StreamChunk]]
    ) -> AsyncIterator[StreamChunk]:
        if not results(request):
            await self.gate.wait()
        async for chunk in call_next(request):
            yield chunk


async def run_agents(tool_probe: ToolProbe, model_probe: ModelProbe) -> dict[str, str]:
    """The root agent and 100 background subagents through one session (so one middleware stack).

    Two gates make the overlap certain whatever the probes' checkpoints: all 101 first model calls are
    released together, and the first 10 tool calls (the read-only bucket's size) wait for each other
    inside the tool, so at least 10 tool calls are inside the tool probe at once."""
    tool_gate = Gate(10)

    @define_tool(name="echo", description="echo", side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def echo(inp: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await tool_gate.wait()
        return ToolResult.success(f"echo:{inp['x']}")

    worker = SubagentDefinition("worker", "works", "You work.")
    model = TestModel(respond=respond)
    agent_of: dict[str, str] = {}
    async with open_session(
        provider=model,
        tools=[echo],
        subagents=[worker],
        middleware=MiddlewareConfig(model=[FirstCallGate(Gate(AGENTS + 1)), model_probe], tool=[tool_probe]),
    ) as session:
        agent_of["agent-root"] = session.root_agent_id
        handles = []
        # Started outside a request (see test_start_subagent_while_a_request_starts_or_finishes); they run
        # while the others start and while the root agent's request runs.
        for tag in agent_tags()[1:]:
            handle = await session.start_subagent("worker", tag)
            agent_of[tag] = handle.id
            handles.append((tag, handle))
        with trio.fail_after(60):
            assert await session.send("agent-root") == "done agent-root"
        for tag, handle in handles:
            assert await handle.wait() == f"done {tag}"
            assert status(handle) is SubagentStatus.COMPLETED
    return agent_of


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 4), min_size=AGENTS + 1, max_size=AGENTS + 1))
def test_one_middleware_stack_serves_101_concurrent_agents(checkpoints: list[int]) -> None:
    plan = dict(zip(agent_tags(), checkpoints, strict=True))
    seen: list[tuple[str, str, str, Any]] = []
    tool_probe, model_probe = ToolProbe(plan, seen), ModelProbe(plan, seen)
    agent_of = trio.run(run_agents, tool_probe, model_probe)
    assert mismatches(seen, agent_of) == []
    assert sum(1 for s in seen if s[0] == "tool") == AGENTS + 1
    assert sum(1 for s in seen if s[0] == "model") == 2 * (AGENTS + 1)
    # They really were called concurrently (the gates guarantee it; this checks the harness).
    assert tool_probe.in_flight.peak >= 10 and model_probe.in_flight.peak >= 10


@pytest.mark.parametrize("stateful", ["tool", "model"])
def test_the_check_catches_middleware_that_keeps_request_state_on_self(stateful: str) -> None:
    """Negative control: the same harness and check must FAIL for a middleware keeping the current call on self."""
    plan = dict.fromkeys(agent_tags(), 2)
    seen: list[tuple[str, str, str, Any]] = []
    tool_probe = (StatefulToolProbe if stateful == "tool" else ToolProbe)(plan, seen)
    model_probe = (StatefulModelProbe if stateful == "model" else ModelProbe)(plan, seen)
    agent_of = trio.run(run_agents, tool_probe, model_probe)
    assert tool_probe.in_flight.peak >= 10 and model_probe.in_flight.peak >= 10
    found = mismatches(seen, agent_of)
    assert found, "state kept on the shared instance must be detected"
    assert all(line.startswith(stateful) for line in found)


async def test_kill_and_the_close_keep_a_finished_subagent_completed() -> None:
    # Both set CANCELLED on every killed handle, so a completed one showed CANCELLED beside its result.
    model = TestModel({"a": [Reply(text="answer A")], "b": [Reply(text="answer B")]})
    async with open_session(provider=model, subagents=[HELPER]) as session:
        a = await session.start_subagent("helper", "a")
        b = await session.start_subagent("helper", "b")
        assert (await a.wait(), await b.wait()) == ("answer A", "answer B")
        a.kill()
        await trio.testing.wait_all_tasks_blocked()
        assert status(a) is SubagentStatus.COMPLETED and a.result == "answer A"
    assert status(b) is SubagentStatus.COMPLETED and b.result == "answer B"
    root_events = await stream_events(session)
    assert sorted(e.subagent_id for e in root_events if isinstance(e, SubagentCompleted)) == sorted([a.id, b.id])
    assert not any(isinstance(e, SubagentCancelled) for e in root_events)


async def test_start_subagent_under_another_agent_needs_a_known_agent_that_runs_a_request() -> None:
    # An unknown parent raised a bare JournalError, an idle one an InvalidTransitionError (or
    # recorded the start under the root's request on the other agent's stream).
    from trio_agent import ConfigError

    gate = trio.Event()
    started: list[str] = []
    model = TestModel(
        {
            "bg": [Reply(tool_calls=[("wait_gate", {})]), Reply(text="bg done")],
            "nested": [Reply(text="nested done")],
            "root": [Reply(text="root")],
        }
    )
    async with open_session(provider=model, subagents=[HELPER], tools=[gated_tool(gate, started, [])]) as session:
        with pytest.raises(ConfigError, match="no-such-agent"):
            await session.start_subagent("helper", "x", parent_agent_id="no-such-agent")
        bg = await session.start_subagent("helper", "bg")
        await trio.testing.wait_all_tasks_blocked()
        nested = await session.start_subagent("helper", "nested", parent_agent_id=bg.id)
        assert await nested.wait() == "nested done"
        gate.set()
        assert await bg.wait() == "bg done"
        with pytest.raises(ConfigError, match="runs no request"):
            await session.start_subagent("helper", "x", parent_agent_id=bg.id)
        assert await session.send("root") == "root"
        bg_events = await stream_events(session, bg.id)
    [start] = [e for e in bg_events if isinstance(e, SubagentStarted)]
    [bg_request] = [e.request_id for e in bg_events if isinstance(e, RequestCompleted)]
    assert start.subagent_id == nested.id and start.request_id == bg_request
    assert not any(isinstance(e, SubagentStarted) and e.subagent_id == nested.id for e in await stream_events(session))


async def test_one_spec_serves_subagents_to_two_sessions_with_one_session_id_in_two_stores() -> None:
    from trio_agent import define_agent
    from trio_agent.journal import MemoryStore

    model = TestModel(
        {
            "go a": [Reply(tool_calls=[task("sub a")]), Reply(text="a done")],
            "go b": [Reply(tool_calls=[task("sub b")]), Reply(text="b done")],
            "sub a": [Reply(text="child a")],
            "sub b": [Reply(text="child b")],
        }
    )
    spec = define_agent(provider=model, subagents=[HELPER])
    store_a, store_b = MemoryStore(), MemoryStore()
    async with (
        open_session(spec, journal=store_a, session_id="user-session") as a,
        open_session(spec, journal=store_b, session_id="user-session") as b,
    ):
        # Each task call reaches the supervisor of the session that made it, not the first one opened.
        for session, prompt, answer in ((b, "go b", "child b"), (a, "go a", "child a")):
            assert await session.send(prompt) == prompt.replace("go", "").strip() + " done"
            [message] = results(model.requests[-1])
            assert message.content == answer and not message.is_error
            [child] = children(session)
            [started] = [e for e in await stream_events(session) if isinstance(e, SubagentStarted)]
            assert started.subagent_id == child
            assert any(isinstance(e, RequestCompleted) for e in await stream_events(session, child))


async def test_a_background_subagent_whose_acceptance_fails_does_not_hold_up_the_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Its request never ran, so nothing finished it: the close waited for it until close_timeout.
    from trio_agent import JournalUnavailableError, TrioAgentError
    from trio_agent._journal._store import AppendTicket
    from trio_agent.journal import MemoryStore, RequestAccepted

    class DiesWithTheSubagentsAcceptance(MemoryStore):
        """The subagent's request_accepted write fails after a while, and every write after it."""

        def __init__(self, nursery: trio.Nursery) -> None:
            super().__init__()
            self.nursery = nursery
            self.dead = False

        def submit(self, batch: Any) -> AppendTicket:
            accepting = any(isinstance(e.event, RequestAccepted) for e in batch.envelopes)
            if self.dead or (accepting and "/helper-" in batch.stream_id):
                ticket = AppendTicket(batch)
                if self.dead:
                    ticket._resolve(JournalUnavailableError("the store died"))
                    return ticket
                self.dead = True

                async def fail_later() -> None:
                    await trio.sleep(0.2)
                    ticket._resolve(JournalUnavailableError("the store died"))

                self.nursery.start_soon(fail_later)
                return ticket
            return super().submit(batch)

    model = TestModel({"go": [Reply(tool_calls=[task("sub", background=True)]), Reply(text="root done")]})
    async with trio.open_nursery() as nursery:
        store = DiesWithTheSubagentsAcceptance(nursery)
        started = trio.current_time()
        with pytest.raises(TrioAgentError):
            async with open_session(provider=model, journal=store, subagents=[HELPER], close_timeout=3) as session:
                await session.send("go")
        assert trio.current_time() - started < 3


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        # A str was taken as the tuple of its characters: an allowlist of tools "s", "e", ...
        ({"tools": "search_docs"}, "tools"),
        ({"tools": [1, None]}, "tools"),
        ({"tools": [""]}, "tools"),
        ({"tools": 5}, "tools"),
        ({"system_prompt": None}, "system_prompt"),
        ({"description": 5}, "description"),
        ({"model": 3}, "model"),
        ({"model": ""}, "model"),
        ({"max_turns": True}, "max_turns"),
        ({"max_turns": 0}, "max_turns"),
    ],
)
def test_a_bad_subagent_definition_field_is_a_config_error_naming_it(fields: dict[str, Any], named: str) -> None:
    written = {"name": "h", "description": "d", "system_prompt": "p", **fields}
    with pytest.raises(ConfigError, match=rf"subagent 'h': {named} must"):
        SubagentDefinition(**written)


def test_a_subagent_definition_takes_any_iterable_of_tool_names() -> None:
    assert SubagentDefinition("h", "", "", tools=(name for name in ["a", "b"])).tools == ("a", "b")
    assert SubagentDefinition("h", "d", "p", tools=[], model="m", max_turns=2).tools == ()


def test_only_an_id_of_ascii_digits_names_the_definition_a_recovered_subagent_runs_under() -> None:
    # '<name>-<n>' was read twice: numbering took ASCII digits only, recovery any str.isdigit()
    # digit, so a stream 'helper-\u0661' (ARABIC-INDIC DIGIT ONE, never an id made here) was
    # recovered with helper's tools.
    root = types.SimpleNamespace(agent_id="root", allowed=frozenset({"read", "write"}), max_turns=5)
    host: Any = types.SimpleNamespace(root=root)
    supervisor = SubagentSupervisor(host, {"helper": HELPER}, nursery=None)  # type: ignore[arg-type]
    made = supervisor.recovered_agent("helper-1", "root")
    assert (made.name, made.allowed) == ("helper", frozenset({"read", "write"}))
    foreign = supervisor.recovered_agent("helper-\u0661", "root")
    assert (foreign.name, foreign.allowed, foreign.system_prompt) == ("helper-\u0661", frozenset(), "")


# ======================================================================== the task tools hold no slot


async def test_background_subagents_holding_every_slot_never_keep_the_root_from_its_task_tools(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`task` and `task_output` drew from the read-only bucket: background subagents whose long
    read-only calls held all of it kept the root's `task_output` (and `task`) waiting for ever."""
    limit = SchedulerLimits().readonly
    inside: list[str] = []
    all_inside = trio.Event()

    @define_tool(name="tail_logs", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
    async def tail_logs(inp: dict[str, Any], ctx: ToolContext) -> str:
        """Follows the logs until stopped."""
        inside.append(ctx.agent_id)
        if len(inside) == limit:
            all_inside.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    watcher = SubagentDefinition("watcher", "watches logs", "Watch.", tools=["tail_logs"])
    reporter = SubagentDefinition("reporter", "reports", "Report.", tools=[])
    model = TestModel(
        {
            **{f"watch {i}": [Reply(tool_calls=[("tail_logs", {})])] for i in range(limit)},
            "check": [
                Reply(
                    tool_calls=[
                        ("task_output", {"task_id": "watcher-1", "block": False}),
                        task("quick"),
                        task("later", subagent="reporter", background=True),
                    ]
                ),
                Reply(tool_calls=[("task_output", {"task_id": "reporter-1", "block": True})]),
                Reply(text="checked"),
            ],
            "quick": [Reply(text="quick answer")],
            "later": [Reply(text="later answer")],
        }
    )
    async with open_session(provider=model, tools=[tail_logs], subagents=[watcher, HELPER, reporter]) as session:
        watchers = [await session.start_subagent("watcher", f"watch {i}") for i in range(limit)]
        await all_inside.wait()
        assert session.pipeline.scheduler.statistics().buckets["readonly"][:2] == (limit, 0)
        with trio.fail_after(60):  # the bug: the root's calls waited for a slot for ever
            assert await session.send("check") == "checked"
        first, second = ([m.content for m in results(r)] for r in requests_of(model, "root")[1:])
        assert first == [
            "task watcher-1: running",
            "quick answer",
            "started background subagent reporter-1; its result arrives at a later turn",
        ]
        assert second[-1] == "task reporter-1: completed\nlater answer"
        for handle in watchers:
            handle.kill()


# ======================================================================== after a reopen


async def test_a_reopened_session_tells_the_model_of_background_subagents_only() -> None:
    """Recovery's notes took every subagent outcome after the root's last model reply: a foreground
    subagent aborted with its request was told, after a reopen, as a background subagent, though
    its `task` call's result told the model already (a live session sends no such note)."""
    inside: list[str] = []
    both_inside = trio.Event()

    @define_tool(name="hold", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
    async def hold(inp: dict[str, Any], ctx: ToolContext) -> str:
        """Runs until stopped."""
        inside.append(ctx.agent_id)
        if len(inside) == 2:
            both_inside.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    def respond(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        if isinstance(last, UserMessage) and last.content == "go":
            return Reply(tool_calls=[task("fg")])
        if isinstance(last, UserMessage) and last.content in ("fg", "bg"):
            return Reply(tool_calls=[("hold", {})])
        return Reply(text="ok")

    def notes(model: TestModel) -> list[str]:
        return [text for text in user_texts(model.requests[-1]) if text.startswith("[")]

    store = MemoryStore()
    model = TestModel(respond=respond)
    async with open_session(provider=model, tools=[hold], subagents=[HELPER], journal=store) as session:
        background = await session.start_subagent("helper", "bg")
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(RequestAbortedError):
                    await session.send("go")

            nursery.start_soon(send)
            await both_inside.wait()
            await session.abort()  # the foreground subagent ends with its request
        [foreground] = [agent for agent in inside if agent != background.id]
    # The abort ended the foreground one, the close the background one, both after the root's last
    # reply: only the background one's note is owed.
    model = TestModel(respond=respond)
    async with open_session(
        provider=model, tools=[hold], subagents=[HELPER], journal=store, session_id=session.session_id
    ) as reopened:
        assert await reopened.send("reopened") == "ok"
    assert notes(model) == [f"[background subagent {background.id} cancelled]: session closed"]
    assert not any(foreground in text for text in user_texts(model.requests[-1]))


# ======================================================================== stopped as its end is written


class HeldStore(MemoryStore):
    """A memory store that commits every write at once, but holds the confirmation of the first
    write of a *kind* event on the stream of *agent_id* until ``release`` is set (its waiter waits,
    as for a slow writer); ``held`` is set when the waiter starts waiting, ``cancelled`` when a
    cancellation reaches it there. No ``commit`` of its own, so the journal awaits every ticket."""

    def __init__(self, kind: type[Any], agent_id: str) -> None:
        super().__init__()
        self.kind = kind
        self.suffix = f"/{agent_id}"
        self.held = trio.Event()
        self.cancelled = trio.Event()
        self.release = trio.Event()
        self._taken = False

    def submit(self, batch: AppendBatch) -> AppendTicket:
        ticket = super().submit(batch)
        if self._taken or not batch.stream_id.endswith(self.suffix):
            return ticket
        if not any(isinstance(envelope.event, self.kind) for envelope in batch.envelopes):
            return ticket
        self._taken = True
        store = self

        class Held(AppendTicket):
            async def wait(self) -> AppendResult:
                store.held.set()
                try:
                    await store.release.wait()
                except trio.Cancelled:
                    store.cancelled.set()
                    raise
                return await ticket.wait()

        held = Held(batch)
        held._resolve(ticket.outcome())
        return held


@pytest.mark.parametrize("how", ["cancel", "kill", "outer"])
async def test_background_work_stays_completed_when_stopped_while_its_completion_is_written(how: str) -> None:
    """cancel(), kill() or a scope around the session landing while the work's `request_completed`
    was confirmed turned it into failed work with no answer (and `subagent_cancelled` on the
    parent's stream), though the journal holds it completed: it stays completed, with its answer."""
    store = HeldStore(RequestCompleted, "helper-1")
    model = TestModel({"work": [Reply(text="the answer")]})
    with trio.CancelScope() as outer:
        async with open_session(provider=model, subagents=[HELPER], journal=store) as session:
            handle = await session.start_subagent("helper", "work")
            await store.held.wait()
            if how == "outer":
                outer.cancel()
            else:
                getattr(handle, how)()
            with trio.CancelScope(shield=True):
                await store.cancelled.wait()
                store.release.set()
                await handle.wait()
    assert outer.cancelled_caught is (how == "outer")
    assert (status(handle), handle.result, handle.error) == (SubagentStatus.COMPLETED, "the answer", None)
    root_events = await stream_events(session)
    assert [e.subagent_id for e in root_events if isinstance(e, SubagentCompleted)] == [handle.id]
    assert not any(isinstance(e, SubagentCancelled) for e in root_events)


async def test_a_foreground_subagent_stays_completed_when_its_call_is_aborted_while_its_completion_is_written() -> None:
    store = HeldStore(RequestCompleted, "helper-1")
    model = TestModel({"go": [Reply(tool_calls=[task("sub")]), Reply(text="never")], "sub": [Reply(text="answer")]})
    async with open_session(provider=model, subagents=[HELPER], journal=store) as session:
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(RequestAbortedError):
                    await session.send("go")

            nursery.start_soon(send)
            await store.held.wait()
            nursery.start_soon(session.abort)  # cancels the task call, which waits for the write
            await store.cancelled.wait()
            store.release.set()
        root_events = await stream_events(session)
    assert [e.subagent_id for e in root_events if isinstance(e, SubagentCompleted)] == ["helper-1"]
    assert not any(isinstance(e, SubagentCancelled) for e in root_events)


# ======================================================================== a resumed subagent's result


async def test_a_resumed_subagent_whose_new_work_fails_gives_no_earlier_answer() -> None:
    """wait() and task_output returned the previous work's answer beside the new work's error."""
    model = TestModel(
        {
            "job 1": [Reply(text="answer to job 1"), Reply(error=ModelError("model down"))],
            "check": [Reply(tool_calls=[("task_output", {"task_id": "helper-1"})]), Reply(text="ok")],
        }
    )
    async with open_session(provider=model, subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "job 1")
        assert await handle.wait() == "answer to job 1"
        handle.resume("job 2")
        assert handle.result is None, "running new work, it has no answer yet"
        assert await handle.wait() is None
        assert status(handle) is SubagentStatus.FAILED and handle.error is not None and "model down" in handle.error
        assert await session.send("check") == "ok"
    [output] = [m.content for m in results(requests_of(model, "root")[-1])]
    assert output.startswith("task helper-1: failed\nerror: ") and "answer to job 1" not in output


# ======================================================================== a start that never ran


async def test_a_foreground_start_cancelled_as_its_stream_is_created_leaves_no_agent_behind() -> None:
    """The subagent joined the host's agents (the permission engine's allowlists) right after its
    SubagentStart hooks, before its stream was created: a cancellation there left it in for good."""
    store = HeldStore(SessionCreated, "helper-1")
    model = TestModel({"go": [Reply(tool_calls=[task("sub")]), Reply(text="never")]})
    async with open_session(provider=model, subagents=[HELPER], journal=store) as session:
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(RequestAbortedError):
                    await session.send("go")

            nursery.start_soon(send)
            await store.held.wait()
            nursery.start_soon(session.abort)
            await store.cancelled.wait()
            store.release.set()
        assert set(session._host.agents) == {session.root_agent_id}


async def test_a_background_start_cancelled_as_its_stream_is_created_leaves_no_agent_behind() -> None:
    store = HeldStore(SessionCreated, "helper-1")
    async with open_session(provider=TestModel(default=Reply("never")), subagents=[HELPER], journal=store) as session:
        async with trio.open_nursery() as nursery:
            starting = trio.CancelScope()

            async def start() -> None:
                with starting:
                    await session.start_subagent("helper", "work")
                    raise AssertionError("it started")

            nursery.start_soon(start)
            await store.held.wait()
            starting.cancel()
            await store.cancelled.wait()
            store.release.set()
        assert starting.cancelled_caught
        assert set(session._host.agents) == {session.root_agent_id}
        assert session.subagents == {}
