"""``session.end()`` / ``close()`` called from inside the session's own running request (a tool):
the close waited for that request, which waited for the close, until ``close_timeout``, and the
abandoned close wrote no ``session_closed`` (an end() was not final). Now the close is taken at
once, runs when the request ended, and new messages are refused meanwhile."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from tests.test_session import events_of, gated_tool, of_type, unsettled_requests
from trio_agent import SessionClosedError, SubagentDefinition, ToolResult, define_tool, open_session
from trio_agent.journal import (
    MemoryStore,
    RequestCompleted,
    RequestInterrupted,
    RequestInterruptReason,
    SessionClosed,
)
from trio_agent.testing import Reply, TestModel

CLOSE_TIMEOUT = 30.0


def closing_tool(holder: dict[str, Any], *, final: bool, log: list[str]) -> Any:
    @define_tool(name="hang_up", side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def hang_up(input: dict[str, Any], ctx: Any) -> ToolResult:
        """End the conversation."""
        session = holder["session"]
        await session.close(final=final)
        log.append("close returned")
        # Refused from now on, while this request still runs.
        with pytest.raises(SessionClosedError):
            await session.send("more", priority="later")
        return ToolResult.success("bye")

    return hang_up


async def test_end_from_a_tool_ends_the_session_for_good_after_its_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    holder: dict[str, Any] = {}
    log: list[str] = []
    model = TestModel({"go": [Reply(tool_calls=[("hang_up", {})]), Reply(text="goodbye")]})
    tool = closing_tool(holder, final=True, log=log)
    # Under the close's bound: the self-deadlock stalled close_timeout (virtual time here).
    with trio.fail_after(CLOSE_TIMEOUT / 2):
        async with open_session(
            provider=model, tools=[tool], journal=store, session_id="s1", close_timeout=CLOSE_TIMEOUT
        ) as session:
            holder["session"] = session
            assert await session.send("go") == "goodbye"
            with pytest.raises(SessionClosedError):
                await session.send("again")
    assert log == ["close returned"]
    journal = await events_of(store, session.journal.stream_id())
    assert [type(e).__name__ for e in journal[-3:]] == ["TurnCompleted", "RequestCompleted", "SessionClosed"]
    assert journal[-1].final
    with pytest.raises(SessionClosedError, match="ended for good"):
        async with open_session(provider=model, tools=[tool], journal=store, session_id="s1"):
            pass  # pragma: no cover


async def test_close_from_a_tool_of_a_worker_run_request_rejects_the_queued_and_closes_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, release = gated_tool("slow")
    store = MemoryStore()
    holder: dict[str, Any] = {}
    log: list[str] = []
    # One conversation: the second request's model calls follow the first one's.
    script = [Reply(tool_calls=[("slow", {})]), Reply(text="first done")]
    model = TestModel({"first": [*script, Reply(tool_calls=[("hang_up", {})]), Reply(text="closing")]})
    outcomes: dict[str, Any] = {}

    async def send(session: Any, prompt: str, priority: str | None) -> None:
        try:
            outcomes[prompt] = await session.send(prompt, priority=priority)
        except SessionClosedError as exc:
            outcomes[prompt] = exc

    with trio.fail_after(CLOSE_TIMEOUT / 2):
        async with (
            open_session(
                provider=model,
                tools=[slow, closing_tool(holder, final=False, log=log)],
                journal=store,
                close_timeout=CLOSE_TIMEOUT,
            ) as session,
            trio.open_nursery() as nursery,
        ):
            holder["session"] = session
            nursery.start_soon(send, session, "first", None)
            await started.wait()
            # Both wait for the worker; the second one's tool closes the session.
            nursery.start_soon(send, session, "second", "later")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(send, session, "third", "later")
            await trio.testing.wait_all_tasks_blocked()
            assert session._queue.queued == 2
            release.set()
    assert outcomes["first"] == "first done" and outcomes["second"] == "closing"
    assert isinstance(outcomes["third"], SessionClosedError)
    assert log == ["close returned"]
    journal = await events_of(store, session.journal.stream_id())
    assert len(of_type(journal, RequestCompleted)) == 2
    assert [e.reason for e in of_type(journal, RequestInterrupted)] == [RequestInterruptReason.SESSION_CLOSE]
    assert unsettled_requests(journal) == []
    assert isinstance(journal[-1], SessionClosed) and not journal[-1].final


async def test_end_from_a_background_subagents_tool_ends_the_session_after_that_work(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The close waited for every background request, the calling tool's own included: it waited
    # for itself until close_timeout, wrote no session_closed, and the session reopened.
    store = MemoryStore()
    holder: dict[str, Any] = {}
    log: list[str] = []

    @define_tool(name="hang_up", side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def hang_up(input: dict[str, Any], ctx: Any) -> ToolResult:
        """End the conversation."""
        before = trio.current_time()
        await holder["session"].end()
        log.append(f"end returned after {trio.current_time() - before:g} s")
        return ToolResult.success("bye")

    helper = SubagentDefinition("helper", "helps", "You help.", tools=["hang_up"])
    model = TestModel({"sub": [Reply(tool_calls=[("hang_up", {})]), Reply(text="sub done")]}, default=Reply("hi"))
    with trio.fail_after(CLOSE_TIMEOUT / 2):
        async with open_session(
            provider=model,
            tools=[hang_up],
            subagents=[helper],
            journal=store,
            session_id="s1",
            close_timeout=CLOSE_TIMEOUT,
        ) as session:
            holder["session"] = session
            handle = await session.start_subagent("helper", "sub")
            assert await handle.wait() == "sub done"  # the work runs to its end, then the session closes
    assert log == ["end returned after 0 s"]
    for agent_id in ("root", "helper-1"):
        journal = await events_of(store, session.journal.stream_id(agent_id))
        assert isinstance(journal[-1], SessionClosed) and journal[-1].final, agent_id
    helper_events = await events_of(store, session.journal.stream_id("helper-1"))
    assert of_type(helper_events, RequestCompleted)
    with pytest.raises(SessionClosedError, match="ended for good"):
        async with open_session(provider=model, tools=[hang_up], subagents=[helper], journal=store, session_id="s1"):
            pass  # pragma: no cover


async def test_a_close_asked_for_from_two_pieces_of_work_waits_for_both(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The root request's tool asks for the close, then a background subagent's tool asks too and
    # works on: each was promised its work runs to its end. The close waited for the first
    # caller's request only, then cut the second's work (ToolCancelled, session_close).
    store = MemoryStore()
    holder: dict[str, Any] = {}
    root_asked, bg_asked = trio.Event(), trio.Event()
    log: list[str] = []

    @define_tool(name="root_close", side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def root_close(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Close."""
        await holder["session"].close()
        root_asked.set()
        await bg_asked.wait()
        return ToolResult.success("root bye")

    @define_tool(name="bg_close", side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def bg_close(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Close."""
        await root_asked.wait()
        await holder["session"].close()
        bg_asked.set()
        await trio.sleep(5)  # the work goes on after asking for the close (trio time, autojumped)
        log.append("bg work finished")
        return ToolResult.success("bg bye")

    helper = SubagentDefinition("helper", "helps", "You help.", tools=["bg_close"])
    model = TestModel(
        {
            "sub": [Reply(tool_calls=[("bg_close", {})]), Reply(text="sub done")],
            "go": [Reply(tool_calls=[("root_close", {})]), Reply(text="root done")],
        },
        default=Reply("hi"),
    )
    with trio.fail_after(CLOSE_TIMEOUT / 2):
        async with open_session(
            provider=model,
            tools=[root_close, bg_close],
            subagents=[helper],
            journal=store,
            session_id="s1",
            close_timeout=CLOSE_TIMEOUT,
        ) as session:
            holder["session"] = session
            handle = await session.start_subagent("helper", "sub")
            assert await session.send("go") == "root done"
            assert await handle.wait() == "sub done"
    assert log == ["bg work finished"]
    helper_events = await events_of(store, session.journal.stream_id("helper-1"))
    assert of_type(helper_events, RequestCompleted) and not of_type(helper_events, RequestInterrupted)
    assert isinstance(helper_events[-1], SessionClosed)
