"""What the session's lean paths keep exact (issue 17).

A root request's loop builds no event while nobody reads them (`RunPorts.listening`): what the
session keeps of the run (its text, turns and calls) must not depend on hearing them, also for a
stream that joins halfway. A close with nothing to wait for runs without a shield and must still
record itself inside a cancelled scope. A request run in its caller's task holds the request slot
without a lock; what waits for the slot meanwhile waits for it.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    AbortReason,
    DoneEvent,
    RequestAbortedError,
    SideEffect,
    StopReason,
    TextDeltaEvent,
    ToolKind,
    ToolResultEvent,
    ToolUseEvent,
    define_agent,
    define_tool,
    open_session,
)
from trio_agent.journal import MemoryStore, RequestCompleted, SessionClosed, SessionCloseReason
from trio_agent.models import ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object"}


def gated_tool(name: str) -> tuple[Any, trio.Event, trio.Event]:
    started, release = trio.Event(), trio.Event()

    @define_tool(name=name, description=name, input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY)
    async def tool(input: dict[str, Any], ctx: Any) -> str:
        started.set()
        await release.wait()
        return f"{name} done"

    return tool, started, release


@define_tool(
    name="quick", description="quick", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
)
async def quick(input: dict[str, Any], ctx: Any) -> str:
    return "quick done"


def three_turns() -> list[Reply]:
    return [
        Reply(text="looking", tool_calls=[("quick", {})]),
        Reply(text="still looking", tool_calls=[("slow", {})]),
        Reply(text="final words"),
    ]


async def test_a_stream_that_joins_a_quiet_request_gets_its_whole_turn_count_and_text(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, release = gated_tool("slow")
    model = TestModel({"first": three_turns()})
    async with open_session(provider=model, tools=[quick, slow]) as session:
        joined: list[Any] = []
        answers: list[str] = []
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                answers.append(await session.send("first"))

            nursery.start_soon(send)
            await started.wait()  # turns 1 and 2 ran with nobody listening

            async def join() -> None:
                async with session.stream("more", priority="next") as events:
                    joined.extend([event async for event in events])

            nursery.start_soon(join)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    done = joined[-1]
    assert isinstance(done, DoneEvent)
    assert (done.text, done.turns, done.stop_reason) == ("final words", 3, StopReason.END_TURN)
    assert "".join(e.text for e in joined if isinstance(e, TextDeltaEvent)) == "final words"
    assert answers == ["final words"]
    # The call that ran when it joined: announced to the stream, then its result (not only the text).
    assert [type(e).__name__ for e in joined if isinstance(e, (ToolUseEvent, ToolResultEvent))] == [
        "ToolUseEvent",
        "ToolResultEvent",
    ]
    assert next(e for e in joined if isinstance(e, ToolResultEvent)).result.output == "slow done"


async def test_a_stream_from_the_start_counts_the_same_turns() -> None:
    slow, _started, release = gated_tool("slow")
    release.set()
    model = TestModel({"first": three_turns()})
    async with open_session(provider=model, tools=[quick, slow]) as session, session.stream("first") as events:
        streamed = [event async for event in events]
    done = streamed[-1]
    assert isinstance(done, DoneEvent)
    assert (done.text, done.turns) == ("final words", 3)


async def test_a_quiet_request_records_the_text_of_its_last_reply_with_text() -> None:
    model = TestModel({"go": [Reply(text="the answer", tool_calls=[("quick", {})]), Reply(tool_calls=[("quick", {})])]})
    store = MemoryStore()
    async with open_session(define_agent(provider=model, tools=[quick], max_turns=2), journal=store) as session:
        assert await session.send("go") == "the answer"
        stream_id = session.journal.stream_id()
    events = [envelope.event for envelope in await store.read(stream_id)]
    (completed,) = [event for event in events if isinstance(event, RequestCompleted)]
    assert completed.output == {"text": "the answer"}


async def test_an_abort_of_a_quiet_request_keeps_the_committed_results(autojump_clock: trio.testing.MockClock) -> None:
    slow, started, _release = gated_tool("slow")
    model = TestModel({"go": [Reply(tool_calls=[("quick", {})]), Reply(tool_calls=[("slow", {})])]})
    async with open_session(provider=model, tools=[quick, slow]) as session:
        errors: list[RequestAbortedError] = []
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(RequestAbortedError) as caught:
                    await session.send("go")
                errors.append(caught.value)

            nursery.start_soon(send)
            await started.wait()
            await session.abort(AbortReason.USER_ABORT, "stop")
    (error,) = errors
    assert [result.output for result in error.results.values()] == ["quick done"]


async def test_a_close_inside_a_cancelled_scope_still_records_itself() -> None:
    store = MemoryStore()
    model = TestModel(default=Reply(text="hi"))
    with trio.CancelScope() as scope:
        async with open_session(provider=model, journal=store) as session:
            assert await session.send("x") == "hi"
            stream_id = session.journal.stream_id()
            scope.cancel()
    events = [envelope.event for envelope in await store.read(stream_id)]
    assert [event.reason for event in events if isinstance(event, SessionClosed)] == [SessionCloseReason.COMPLETED]


async def test_what_waits_for_the_slot_of_a_request_run_in_its_callers_task_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, release = gated_tool("slow")

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        if isinstance(last, UserMessage) and last.content == "first":
            return Reply(tool_calls=[("slow", {})])
        return Reply(text="one" if isinstance(last, ToolResultMessage) else "two")

    model = TestModel(respond=respond)
    async with open_session(provider=model, tools=[slow]) as session:
        order: list[str] = []
        async with trio.open_nursery() as nursery:

            async def send(prompt: str, priority: Any = None) -> None:
                order.append(await session.send(prompt, priority=priority))

            nursery.start_soon(send, "first")
            await started.wait()  # runs in its caller's task, holding the slot
            nursery.start_soon(send, "second", "later")  # the worker takes it and waits for the slot
            await trio.testing.wait_all_tasks_blocked()
            assert order == []
            release.set()
        assert order == ["one", "two"]
        assert await session.send("third") == "two"  # the slot is free again
