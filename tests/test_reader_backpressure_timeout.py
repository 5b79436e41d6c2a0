"""A slow reader of a run's events is not charged to the model's ``request_timeout``, nor to the
timeout of a tool whose progress it reads.

The loop publishes each chunk of a model reply while the model call is open. A reader that
falls behind (the bounded event channel full) makes the publication wait: that wait is the
reader's, not the provider's, so it does not count against the request deadline (it did: a
reader that took 2 s per event timed a 1 s deadline out although the model had answered).
What still counts: the wait for the provider and the middleware, and the block's own work.
An abort during a blocked publication still cuts the call at once. The same for a tool that
streams progress (`ctx.emit`): its timeout bounds its own time, and an abort while its progress
waits for the reader cuts it at once (``ToolCancelled``, the abort's reason). And for a foreground
subagent's events, which its ``task`` call passes on: a slow reader of them is not charged to the
call's ``tool_timeout``, the subagent's own model waits are.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    AbortHandle,
    AbortReason,
    ModelAbortedError,
    ModelTimeoutError,
    Progress,
    SubagentDefinition,
    Tool,
    ToolContext,
    ToolErrorType,
    ToolProgressEvent,
    ToolResult,
    ToolResultEvent,
    ToolUseEvent,
    define_tool,
    open_session,
)
from trio_agent._chat._chat import ChatResult, chat
from trio_agent._loop._events import TextMessageContent, ToolCallProgress, ToolCallResult
from trio_agent._loop._rules import StopReason
from trio_agent.journal import (
    MemoryStore,
    ModelAttemptAborted,
    ModelAttemptStarted,
    RequestInterrupted,
    SubagentCancelled,
    SubagentCompleted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
)
from trio_agent.models import (
    FinishChunk,
    FinishReason,
    ModelRequest,
    ModelResponse,
    ModelService,
    StreamChunk,
    TextDelta,
    UserMessage,
    waiting_for_reader,
)
from trio_agent.testing import Reply, TestModel

WORDS = 400  # more deltas than a run's 256-event channel holds: the loop waits for its reader


def long_reply() -> TestModel:
    return TestModel(default=Reply(text=" ".join(["w"] * WORDS)))


class PacedModel:
    """A provider that waits *pause* seconds (trio time) before each of its *count* chunks."""

    name = "paced"
    model = "paced-model"

    def __init__(self, count: int, pause: float) -> None:
        self.count = count
        self.pause = pause

    async def chat(self, request: ModelRequest) -> ModelResponse:  # pragma: no cover - streams only
        raise NotImplementedError

    def with_model(self, model: str) -> PacedModel:  # pragma: no cover - streams only
        return self

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[StreamChunk]:
        for _ in range(self.count):
            await trio.sleep(self.pause)
            yield TextDelta("w ")
        yield FinishChunk(FinishReason.STOP)


# -- chat(): a reader that takes 2 s an event, a 1 s deadline


async def test_a_slow_chat_reader_does_not_time_the_model_call_out(autojump_clock: trio.testing.MockClock) -> None:
    service = ModelService(long_reply(), request_timeout=1)
    deltas = 0
    async with chat(service, "hi") as run:
        async for event in run:
            if isinstance(event, TextMessageContent):
                deltas += 1
            await trio.sleep(2)
        result = await run.result()
    assert deltas == WORDS
    assert result.stop_reason is StopReason.END_TURN
    assert result.text.count("w") == WORDS
    assert trio.current_time() > 2 * WORDS  # the reader did take its time


async def test_the_provider_s_own_waits_still_time_a_slow_chat_reader_s_call_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 300 chunks 0.01 s apart: 3 s of the provider's against a 1 s deadline. The reader's 2 s an
    # event are not counted; the provider's waits are, so the call still times out, after about
    # 100 chunks (and long after 1 s of trio time has passed: the reader's waits are excluded).
    async with chat(ModelService(PacedModel(300, 0.01), request_timeout=1), "hi") as run:
        deltas = 0
        async for event in run:
            deltas += isinstance(event, TextMessageContent)
            await trio.sleep(2)
        with pytest.raises(ModelTimeoutError):
            await run.result()
    assert 90 <= deltas <= 110
    assert trio.current_time() > 100


async def test_an_abort_during_a_blocked_publication_cuts_the_call_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    service = ModelService(long_reply(), request_timeout=1)
    async with chat(service, "hi") as run:
        async for _ in run:
            await trio.sleep(100)  # the channel fills; the loop waits for us (its deadline held)
            started = trio.current_time()
            run.abort("enough")
            break
        result = await run.result()
    assert result.stop_reason is StopReason.ABORTED
    assert trio.current_time() == started  # not a tick of trio time waited for the model call to end


# -- sessions: the same, on a session's event stream


async def test_a_slow_session_reader_does_not_time_the_model_call_out(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore()
    async with open_session(provider=long_reply(), model_request_timeout=1, journal=store) as session:
        async with session.stream("hi") as events:
            async for _ in events:
                await trio.sleep(2)
        assert events.done is not None
        assert events.done.stop_reason == "end_turn"
        assert events.text.count("w") == WORDS


async def test_an_abort_of_a_session_request_blocked_on_its_reader_is_recorded_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    async with open_session(provider=long_reply(), model_request_timeout=1, journal=store) as session:
        async with session.stream("hi") as events:
            async for _ in events:
                await trio.sleep(100)  # the channel fills: the model call waits for us, its deadline stopped
                started = trio.current_time()
                await events.abort("enough")
                break
        assert trio.current_time() == started
        records = [envelope.event for envelope in await store.read(session.journal.stream_id())]
    kinds = [type(record) for record in records]
    assert kinds.count(ModelAttemptStarted) == 1
    assert kinds.count(ModelAttemptAborted) == 1
    assert kinds.count(RequestInterrupted) == 1


# -- ModelService.stream used directly: the block's time counts, a declared wait on a reader does not


async def test_a_direct_stream_s_consumer_time_counts_against_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    service = ModelService(long_reply(), request_timeout=1)
    with pytest.raises(ModelTimeoutError):
        async with service.stream([UserMessage("hi")]) as chunks:
            async for _ in chunks:
                await trio.sleep(0.5)  # the block's own work: counted


async def test_a_direct_stream_s_declared_reader_wait_does_not_count(autojump_clock: trio.testing.MockClock) -> None:
    service = ModelService(long_reply(), request_timeout=1)
    send, receive = trio.open_memory_channel[StreamChunk](4)
    received = 0

    async def slow_reader() -> None:
        nonlocal received
        async for _ in receive:
            received += 1
            await trio.sleep(2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow_reader)
        async with send, service.stream([UserMessage("hi")]) as chunks:
            async for chunk in chunks:
                try:
                    send.send_nowait(chunk)
                except trio.WouldBlock:
                    with waiting_for_reader():
                        await send.send(chunk)
    assert received > WORDS
    assert trio.current_time() > 2 * WORDS


async def test_a_declared_reader_wait_still_ends_at_an_abort(autojump_clock: trio.testing.MockClock) -> None:
    service = ModelService(long_reply(), request_timeout=1)
    handle = AbortHandle()
    send, _receive = trio.open_memory_channel[StreamChunk](0)  # nobody ever reads
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_abort_later, handle, 30.0)
        with pytest.raises(ModelAbortedError):
            async with service.stream([UserMessage("hi")], abort=handle) as chunks:
                async for chunk in chunks:
                    with waiting_for_reader():
                        await send.send(chunk)
        assert trio.current_time() == 30  # cut at the abort: not at the 1 s deadline, nor never


async def _abort_later(handle: AbortHandle, seconds: float) -> None:
    await trio.sleep(seconds)
    handle.abort(AbortReason.USER_ABORT, "enough")


async def test_the_deadline_goes_on_after_a_declared_wait(autojump_clock: trio.testing.MockClock) -> None:
    # 0.6 s of the provider's, then a 10 s wait on a reader (not counted), then 0.6 s more of the
    # provider's: 1.2 s counted against 1 s, so the call times out at 10.6 + 0.4 = 11.0.
    service = ModelService(PacedModel(4, 0.3), request_timeout=1)
    with pytest.raises(ModelTimeoutError):
        async with service.stream([UserMessage("hi")]) as chunks:
            count = 0
            async for _ in chunks:
                count += 1
                if count == 2:
                    with waiting_for_reader():
                        await trio.sleep(10)
    assert trio.current_time() == pytest.approx(11.0)


async def test_outside_a_stream_a_declared_wait_changes_nothing(autojump_clock: trio.testing.MockClock) -> None:
    with waiting_for_reader():
        await trio.sleep(1)
    assert trio.current_time() == 1


class FromAnotherService:
    """Stream middleware that answers from another service's stream, opened inside the outer block
    (in its task): two blocks open at once, the inner one entered last."""

    def __init__(self, inner: ModelService) -> None:
        self.inner = inner

    async def wrap_stream(self, request: ModelRequest, call_next: object) -> AsyncIterator[StreamChunk]:
        async with self.inner.stream(request.messages) as chunks:
            async for chunk in chunks:
                yield chunk


async def test_a_declared_wait_holds_every_block_the_task_has_open(autojump_clock: trio.testing.MockClock) -> None:
    inner = ModelService(long_reply(), request_timeout=1)
    outer = ModelService(long_reply(), [FromAnotherService(inner)], request_timeout=1)
    count = 0
    async with outer.stream([UserMessage("hi")]) as chunks:
        async for _ in chunks:
            count += 1
            with waiting_for_reader():
                await trio.sleep(2)
    assert count > WORDS


def test_a_block_never_left_is_not_kept_past_its_run() -> None:
    # The blocks `waiting_for_reader` finds are the run's own: a block entered and never left (its
    # coroutine dropped) must not keep its task and its block alive in the process after the run.
    service = ModelService(long_reply(), request_timeout=1)
    tasks: list[weakref.ReferenceType[trio.lowlevel.Task]] = []

    async def enter_and_drop() -> None:
        block = service.stream([UserMessage("hi")])
        await block.__aenter__()
        tasks.append(weakref.ref(trio.lowlevel.current_task()))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(enter_and_drop)

    trio.run(main)
    gc.collect()
    assert tasks and tasks[0]() is None


# -- a tool's progress: a slow reader is not charged to the tool's timeout either

ITEMS = 400  # more progress items than a run's (or a stream's) 256-event channel holds


def progress_tool(*, timeout: float | None = None, pause: float = 0.0, in_child: bool = False) -> Tool[Any]:
    """Emits ITEMS progress items (*pause* seconds of its own before each), from its own task or
    (*in_child*) from a task it starts, then answers "streamed"."""

    async def emit_all(ctx: ToolContext) -> None:
        for index in range(ITEMS):
            if pause:
                await trio.sleep(pause)
            await ctx.emit(Progress(f"item {index}"))

    async def run(input: dict[str, Any], ctx: ToolContext) -> str:
        if in_child:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(emit_all, ctx)
        else:
            await emit_all(ctx)
        return "streamed"

    return define_tool(
        run,
        name="stream",
        description="streams progress",
        input_schema=OBJECT,
        side_effect="pure",
        kind="readonly",
        timeout=timeout,
    )


OBJECT: dict[str, Any] = {"type": "object"}


def calls_the_tool() -> TestModel:
    return TestModel({"go": [Reply(tool_calls=[("stream", {})]), Reply(text="all done")]})


async def chat_with_a_slow_reader(tool: Tool[Any], seconds: float) -> tuple[list[ToolResult], int, ChatResult]:
    results: list[ToolResult] = []
    progress = 0
    async with chat(calls_the_tool(), "go", tools=[tool]) as run:
        async for event in run:
            if isinstance(event, ToolCallProgress):
                progress += 1
            elif isinstance(event, ToolCallResult):
                results.append(event.result)
            await trio.sleep(seconds)
        result = await run.result()
    return results, progress, result


@pytest.mark.parametrize("in_child", [False, True], ids=["from its task", "from a task of its own"])
async def test_a_slow_chat_reader_does_not_time_a_tool_s_progress_out(
    autojump_clock: trio.testing.MockClock, in_child: bool
) -> None:
    results, progress, result = await chat_with_a_slow_reader(progress_tool(timeout=1, in_child=in_child), 2)
    assert progress == ITEMS
    assert [r.output for r in results] == ["streamed"]
    assert result.stop_reason is StopReason.END_TURN and result.text == "all done"
    assert trio.current_time() > 2 * ITEMS  # the reader did take its time


async def test_the_tool_s_own_time_still_times_a_slow_chat_reader_s_tool_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 400 items 0.01 s apart: 4 s of the tool's own against its 1 s timeout. The reader's waits are
    # not counted; the tool's are, so it still times out, after about 100 items.
    results, progress, _ = await chat_with_a_slow_reader(progress_tool(timeout=1, pause=0.01), 2)
    [timed_out] = results
    assert timed_out.error is not None and timed_out.error.type is ToolErrorType.TIMEOUT
    assert 90 <= progress <= 110
    assert trio.current_time() > 100


async def test_an_abort_during_a_tool_s_blocked_publication_cuts_the_call_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with chat(calls_the_tool(), "go", tools=[progress_tool(timeout=1)]) as run:
        async for event in run:
            if isinstance(event, ToolCallProgress):
                await trio.sleep(100)  # the channel fills: the tool waits for us, its deadline held
                started = trio.current_time()
                run.abort("enough")
                break
        result = await run.result()
    assert result.stop_reason is StopReason.ABORTED
    assert trio.current_time() == started  # not a tick of trio time waited for the tool to stop


async def test_a_slow_session_reader_does_not_time_a_tool_s_progress_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    async with open_session(
        provider=calls_the_tool(), tools=[progress_tool()], tool_timeout=1, journal=store
    ) as session:
        progress = 0
        results: list[ToolResult] = []
        async with session.stream("go") as events:
            async for event in events:
                if isinstance(event, ToolProgressEvent):
                    progress += 1
                elif isinstance(event, ToolResultEvent):
                    results.append(event.result)
                await trio.sleep(2)
        assert events.done is not None and events.done.stop_reason == "end_turn"
        records = [envelope.event for envelope in await store.read(session.journal.stream_id())]
    assert progress == ITEMS
    assert [r.output for r in results] == ["streamed"]
    assert [type(r) for r in records if isinstance(r, (ToolCompleted, ToolFailed, ToolCancelled))] == [ToolCompleted]
    assert trio.current_time() > 2 * ITEMS


async def test_an_abort_of_a_session_tool_blocked_on_its_reader_is_recorded_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    async with open_session(
        provider=calls_the_tool(), tools=[progress_tool()], tool_timeout=1, journal=store
    ) as session:
        async with session.stream("go") as events:
            async for event in events:
                if isinstance(event, ToolProgressEvent):
                    await trio.sleep(100)  # the stream fills: the tool waits for us, its deadline held
                    started = trio.current_time()
                    await events.abort("enough")
                    break
        assert trio.current_time() == started
        records = [envelope.event for envelope in await store.read(session.journal.stream_id())]
    [cancelled] = [r for r in records if isinstance(r, (ToolCompleted, ToolFailed, ToolCancelled))]
    assert isinstance(cancelled, ToolCancelled)
    assert cancelled.reason == "user_abort"
    assert sum(isinstance(r, RequestInterrupted) for r in records) == 1


# -- a foreground subagent's events: its task call's timeout does not count a slow reader either

HELPER = SubagentDefinition("helper", "a helper", "You are the helper.")
TASK = ("task", {"subagent": "helper", "prompt": "sub"})


def delegates(*child: Reply) -> TestModel:
    """The root calls ``task`` (a foreground helper), whose model answers *child* (by default one
    long reply: more events than the request's 256-event stream holds)."""
    return TestModel(
        {
            "go": [Reply(tool_calls=[TASK]), Reply(text="all done")],
            "sub": list(child) or [Reply(text=" ".join(["w"] * WORDS))],
        }
    )


def noop_tool() -> Tool[Any]:
    async def run(input: dict[str, Any], ctx: ToolContext) -> str:
        return "done"

    return define_tool(
        run, name="noop", description="does nothing", input_schema=OBJECT, side_effect="pure", kind="readonly"
    )


async def read_slowly(model: TestModel) -> tuple[list[ToolResult], list[Any], list[Any]]:
    """A session whose reader takes 2 s an event, with a 1 s tool_timeout: the task call's
    results, and the root's and the child's journal records."""
    store = MemoryStore()
    results: list[ToolResult] = []
    async with open_session(
        provider=model, tools=[noop_tool()], subagents=[HELPER], tool_timeout=1, journal=store
    ) as session:
        async with session.stream("go") as events:
            async for event in events:
                if isinstance(event, ToolResultEvent) and event.agent_id == session.root_agent_id:
                    results.append(event.result)
                await trio.sleep(2)
        assert events.done is not None and events.done.stop_reason == "end_turn"
        [child] = [agent for agent in session.journal.agents if agent != session.root_agent_id]
        records = [envelope.event for envelope in await store.read(session.journal.stream_id())]
        child_records = [envelope.event for envelope in await store.read(session.journal.stream_id(child))]
    return results, records, child_records


def settled(records: list[Any]) -> list[Any]:
    return [r for r in records if isinstance(r, (ToolCompleted, ToolFailed, ToolCancelled))]


async def test_a_slow_session_reader_does_not_time_a_foreground_subagent_s_task_call_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    [result], records, _ = await read_slowly(delegates())
    assert result.error is None and result.output.count("w") == WORDS
    assert [type(r) for r in settled(records)] == [ToolCompleted]
    assert [type(r) for r in records if isinstance(r, (SubagentCompleted, SubagentCancelled))] == [SubagentCompleted]
    assert trio.current_time() > 2 * WORDS  # the reader did take its time


@pytest.mark.parametrize(("latency", "times_out"), [(0.3, False), (0.6, True)])
async def test_the_subagent_s_own_time_still_times_a_slow_reader_s_task_call_out(
    autojump_clock: trio.testing.MockClock, latency: float, times_out: bool
) -> None:
    # The child's model calls wait 0.6 s, then *latency*, for the provider: that is the task
    # call's own time (1 s allowed), the reader's 2 s an event in between is not.
    first = Reply(text=" ".join(["w"] * WORDS), tool_calls=[("noop", {})], latency=0.6)
    [result], records, child_records = await read_slowly(delegates(first, Reply(text="child done", latency=latency)))
    # Timed out (or not) in the child's second model call, long after the reader kept it waiting.
    assert sum(isinstance(r, ModelAttemptStarted) for r in child_records) == 2
    if times_out:
        assert result.error is not None and result.error.type is ToolErrorType.TIMEOUT
        assert [type(r) for r in settled(records)] == [ToolFailed]
    else:
        assert result.error is None and result.output == "child done"
        assert [type(r) for r in settled(records)] == [ToolCompleted]


async def test_an_abort_during_a_foreground_subagent_s_blocked_publication_is_recorded_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    async with open_session(provider=delegates(), subagents=[HELPER], tool_timeout=1, journal=store) as session:
        async with session.stream("go") as events:
            async for event in events:
                if isinstance(event, ToolUseEvent):
                    await trio.sleep(100)  # the stream fills: the child waits for us, the call's deadline held
                    started = trio.current_time()
                    await events.abort("enough")
                    break
        assert trio.current_time() == started
        [child] = [agent for agent in session.journal.agents if agent != session.root_agent_id]
        records = [envelope.event for envelope in await store.read(session.journal.stream_id())]
        child_records = [envelope.event for envelope in await store.read(session.journal.stream_id(child))]
    [cancelled] = settled(records)
    assert isinstance(cancelled, ToolCancelled) and cancelled.reason == "user_abort"
    [ended] = [r for r in records if isinstance(r, (SubagentCompleted, SubagentCancelled))]
    assert isinstance(ended, SubagentCancelled)
    assert sum(isinstance(r, RequestInterrupted) for r in records) == 1
    assert sum(isinstance(r, RequestInterrupted) for r in child_records) == 1
    assert sum(isinstance(r, ModelAttemptAborted) for r in child_records) == 1
