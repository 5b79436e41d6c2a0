"""The session's public surface: send / stream / abort / set_model, priorities, closing, bad input.

Every test drives a real `open_session` with the deterministic `TestModel`;
timing is controlled with events and ``wait_all_tasks_blocked`` (and the
autojump clock where a tool or the model would otherwise wait).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    AbortReason,
    ConfigError,
    DoneEvent,
    HookEvent,
    ModelError,
    Priority,
    Progress,
    RequestAbortedError,
    SessionBusyError,
    SessionClosedError,
    SideEffect,
    StopReason,
    TextDeltaEvent,
    ToolKind,
    ToolProgressEvent,
    ToolResult,
    ToolResultEvent,
    ToolUseEvent,
    TrioAgentError,
    UsageEvent,
    define_tool,
    open_session,
)
from trio_agent.journal import (
    MemoryStore,
    ModelAttemptAborted,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    SessionClosed,
    SessionCloseReason,
    ToolCancelled,
    ToolCompleted,
    TurnAborted,
    TurnAbortReason,
)
from trio_agent.models import AssistantMessage, ProviderConfigError, TextPart, ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel, open_test_model

OBJECT: dict[str, Any] = {"type": "object"}


def gated_tool(
    name: str, *, interrupt: str = "block", log: list[str] | None = None
) -> tuple[Any, trio.Event, trio.Event]:
    """A readonly tool that signals ``started`` and then waits for ``release``; ``log`` records how it ended."""
    started, release = trio.Event(), trio.Event()
    log = log if log is not None else []

    @define_tool(
        name=name,
        description=f"{name}: waits for the test",
        input_schema=OBJECT,
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
        interrupt=interrupt,
    )
    async def tool(input: dict[str, Any], ctx: Any) -> str:
        started.set()
        try:
            await release.wait()
        except trio.Cancelled:
            log.append(f"{name}:cancelled")
            raise
        log.append(f"{name}:finished")
        return f"{name} done"

    return tool, started, release


async def events_of(store: Any, stream_id: str) -> list[Any]:
    return [envelope.event for envelope in await store.read(stream_id)]


def of_type(events: Sequence[Any], kind: type) -> list[Any]:
    return [event for event in events if isinstance(event, kind)]


def session_task_names() -> list[str]:
    """Names of every live task anywhere in this run that runs trio_agent code."""
    names: list[str] = []

    def walk(task: trio.lowlevel.Task) -> None:
        names.append(task.name)
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    walk(root)
    return [name for name in names if name.startswith("trio_agent.")]


# ---------------------------------------------------------------- send and stream


async def test_send_returns_the_final_answer_after_tool_turns() -> None:
    @define_tool(name="add", description="add", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def add(input: dict[str, Any], ctx: Any) -> int:
        return int(input["a"]) + int(input["b"])

    model = TestModel({"sum?": [Reply(text="adding", tool_calls=[("add", {"a": 2, "b": 3})]), Reply(text="it is 5")]})
    async with open_session(provider=model, tools=[add]) as session:
        assert await session.send("sum?") == "it is 5"
    assert len(model.requests) == 2
    second = model.requests[1].messages
    assert isinstance(second[0], UserMessage) and second[0].content == "sum?"
    results = [m for m in second if isinstance(m, ToolResultMessage)]
    assert [(r.content, r.is_error) for r in results] == [("5", False)]


async def test_stream_yields_events_in_a_sensible_order() -> None:
    @define_tool(name="work", description="w", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def work(input: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Progress("halfway", completed=1, total=2))
        return f"worked {input['n']}"

    model = TestModel(
        {"go": [Reply(text="on it", tool_calls=[("work", {"n": 1}), ("work", {"n": 2})]), Reply(text="all done now")]}
    )
    async with open_session(provider=model, tools=[work]) as session:
        seen: list[Any] = []
        async with session.stream("go") as events:
            async for event in events:
                seen.append(event)
    assert isinstance(seen[-1], DoneEvent)
    assert sum(isinstance(e, DoneEvent) for e in seen) == 1
    done = seen[-1]
    assert (done.text, done.stop_reason, done.turns, done.error) == ("all done now", "end_turn", 2, None)
    assert done.stop_reason is StopReason.END_TURN  # the enum chat() uses, not a bare string
    assert events.text == "all done now"
    # Text deltas of both turns, concatenated per turn, and usage per model call.
    deltas = "".join(e.text for e in seen if isinstance(e, TextDeltaEvent))
    assert deltas == "on it" + "all done now"
    assert len(of_type(seen, UsageEvent)) == 2
    uses = {e.call_id: i for i, e in enumerate(seen) if isinstance(e, ToolUseEvent)}
    results = {e.call_id: i for i, e in enumerate(seen) if isinstance(e, ToolResultEvent)}
    progress = [(e.call_id, i) for i, e in enumerate(seen) if isinstance(e, ToolProgressEvent)]
    assert len(uses) == 2 and uses.keys() == results.keys()
    for call_id in uses:
        assert uses[call_id] < results[call_id]
    # Each call's progress arrives between its use and its result.
    assert len(progress) == 2
    for call_id, index in progress:
        assert uses[call_id] < index < results[call_id]
        assert seen[index].item == Progress("halfway", completed=1, total=2)
    # The second turn's text comes after every result of the first turn.
    first_final_delta = next(i for i, e in enumerate(seen) if isinstance(e, TextDeltaEvent) and "all" in e.text)
    assert max(results.values()) < first_final_delta
    assert {e.result.output for e in seen if isinstance(e, ToolResultEvent)} == {"worked 1", "worked 2"}
    assert all(e.agent_id == "root" for e in seen if not isinstance(e, DoneEvent))


async def test_request_events_are_journalled_in_order() -> None:
    store = MemoryStore()
    model = TestModel({"hello": [Reply(text="hi there")]})
    async with open_session(provider=model, journal=store) as session:
        assert await session.send("hello") == "hi there"
        stream_id = session.journal.stream_id()
    names = [type(e).__name__ for e in await events_of(store, stream_id)]
    assert names == [
        "SessionCreated",
        "RequestAccepted",
        "RequestStarted",
        "TurnStarted",
        "ModelAttemptStarted",
        "ModelAttemptCompleted",
        "TurnCompleted",
        "RequestCompleted",
        "SessionClosed",
    ]


async def test_set_model_applies_to_the_next_model_request() -> None:
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model) as session:
        assert session.model == "test-model"
        await session.send("one")
        assert model.requests[-1].model == "test-model"
        session.set_model("bigger-model")
        assert session.model == "bigger-model"
        await session.send("two")
        assert model.requests[-1].model == "bigger-model"
        # Switching back reuses the first service.
        session.set_model("test-model")
        await session.send("three")
        assert model.requests[-1].model == "test-model"
        with pytest.raises(ConfigError):
            session.set_model("")
        with pytest.raises(ConfigError):
            session.set_model(None)  # type: ignore[arg-type]
    # The conversation continued across model switches: the last request holds all three prompts.
    prompts = [m.content for m in model.requests[-1].messages if isinstance(m, UserMessage)]
    assert prompts == ["one", "two", "three"]


async def test_model_name_given_at_open_is_used() -> None:
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model, model="named-model") as session:
        assert session.model == "named-model"
        await session.send("hi")
    assert model.requests[-1].model == "named-model"


async def test_set_model_while_a_request_runs_applies_to_its_next_model_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, release = gated_tool("slow")
    model = TestModel({"go": [Reply(text="calling", tool_calls=[("slow", {})]), Reply(text="answer")]})
    async with open_session(provider=model, tools=[slow]) as session, trio.open_nursery() as nursery:
        nursery.start_soon(session.send, "go")
        await started.wait()
        session.set_model("big-model")  # during the tool: the request's second model call is next
        release.set()
    assert [request.model for request in model.requests] == ["test-model", "big-model"]


@pytest.mark.parametrize("pause", [1, 10])
async def test_a_reader_that_falls_behind_is_not_charged_to_model_request_timeout(
    pause: float, autojump_clock: trio.testing.MockClock
) -> None:
    # What sessions.md says: more deltas than the 256-event channel, and a reader that stops for
    # longer than model_request_timeout while the reply still streams: the model call waits for
    # the reader with its deadline held (the wait is the reader's, not the model's).
    model = TestModel(default=Reply(text=" ".join(["w"] * 400)))
    async with open_session(provider=model, model_request_timeout=5) as session:
        async with session.stream("hi") as events:
            async for _ in events:
                await trio.sleep(pause)
                pause = 0
        assert events.done is not None
        assert events.done.stop_reason == "end_turn"


async def test_leaving_the_stream_early_aborts_the_request(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    slow, started, _release = gated_tool("slow", log=log)
    store = MemoryStore()
    model = TestModel({"go": [Reply(text="starting", tool_calls=[("slow", {})]), Reply(text="next answer")]})
    async with open_session(provider=model, tools=[slow], journal=store) as session:
        async with session.stream("go") as events:
            async for event in events:
                if isinstance(event, ToolUseEvent):
                    await started.wait()
                    break
        # The request was aborted and recorded before the block returned.
        assert log == ["slow:cancelled"]
        journal = await events_of(store, session.journal.stream_id())
        interrupted = of_type(journal, RequestInterrupted)
        assert [e.reason for e in interrupted] == [RequestInterruptReason.USER_ABORT]
        assert of_type(journal, ToolCancelled)
        assert not of_type(journal, ToolCompleted)
        # The session is free for the next request.
        assert await session.send("and now?") == "next answer"


# ---------------------------------------------------------------- abort


async def test_abort_during_a_tool_interrupts_the_request_durably(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    slow, started, _release = gated_tool("slow", log=log)
    store = MemoryStore()
    # One script per conversation: the follow-up request reads "go"'s script too.
    model = TestModel({"go": [Reply(text="starting", tool_calls=[("slow", {})]), Reply(text="fine")]})
    async with open_session(provider=model, tools=[slow], journal=store) as session:
        outcome: dict[str, RequestAbortedError] = {}

        async def run() -> None:
            try:
                await session.send("go")
            except RequestAbortedError as exc:
                outcome["error"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await started.wait()
            await session.abort(AbortReason.USER_ABORT, "stop please")
            # request_interrupted is durable when abort() returns, and the tool was cancelled.
            journal = await events_of(store, session.journal.stream_id())
            assert [e.reason for e in of_type(journal, RequestInterrupted)] == [RequestInterruptReason.USER_ABORT]
            assert [e.reason for e in of_type(journal, TurnAborted)] == [TurnAbortReason.REQUEST_INTERRUPTED]
            assert log == ["slow:cancelled"]
        assert outcome["error"].reason == "user_abort"
        # Aborting with nothing running is a no-op; the session keeps working.
        await session.abort()
        assert await session.send("again") == "fine"


@pytest.mark.parametrize("fails", [False, True], ids=["completed", "failed"])
@pytest.mark.parametrize("how", ["events.abort", "session.abort", "session.close"])
async def test_abort_wakes_the_final_done_event_waiting_on_a_reader_that_does_not_read(
    how: str, fails: bool, autojump_clock: trio.testing.MockClock
) -> None:
    # 255 text deltas and the usage event fill the stream's 256 slots: the request's end is
    # recorded, and its DoneEvent (completed, or failed: sent under the cleanup shield) waits
    # on the full channel. An abort from the reader's own task must wake that send.
    words = " ".join(["w"] * 300)
    reply = Reply(text=words, fail_after_chunks=256) if fails else Reply(text=words[: 255 * 2 - 1])
    store = MemoryStore()
    async with open_session(provider=TestModel(default=reply), journal=store) as session:
        async with session.stream("hi") as events:
            await trio.testing.wait_all_tasks_blocked()
            journal = await events_of(store, session.journal.stream_id())
            ended = of_type(journal, RequestFailed if fails else RequestCompleted)
            assert len(ended) == 1  # recorded: only the DoneEvent's send is left
            with trio.fail_after(10):  # well under cleanup_grace (30 s), which bounds the failed send
                if how == "events.abort":
                    await events.abort()
                elif how == "session.abort":
                    await session.abort()
                else:
                    await session.close()
            # The stream ends (its channel closed) with what fitted; the DoneEvent was dropped.
            seen: list[Any] = []
            with pytest.raises(TrioAgentError) if fails else contextlib.nullcontext():
                async for event in events:
                    seen.append(event)
            assert len(seen) == 256 and not any(isinstance(event, DoneEvent) for event in seen)
        assert session._queue.current is None or session._queue.current.done.is_set()


async def test_abort_with_a_bad_reason_is_a_config_error_idle_or_running_and_streams_take_the_value(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, _release = gated_tool("slow")
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})]), Reply(text="done")]})
    async with open_session(provider=model, tools=[slow]) as session:
        for bad in ("bogus", 123, None):
            with pytest.raises(ConfigError, match="abort reason"):
                await session.abort(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="abort message"):
            await session.abort(message=123)  # type: ignore[arg-type]
        with pytest.raises(RequestAbortedError, match="steering"):
            async with session.stream("go") as events:
                await started.wait()
                for bad in ("bogus", 123):
                    with pytest.raises(ConfigError, match="abort reason"):
                        await session.abort(bad)  # type: ignore[arg-type]
                    with pytest.raises(ConfigError, match="abort reason"):
                        await events.abort(reason=bad)  # type: ignore[arg-type]
                # Nothing was aborted by the bad calls; the value of a reason is taken as the reason.
                assert session._queue.current is not None and not session._queue.current.abort.aborted
                await events.abort(reason="steering")
                async for _ in events:
                    pass


@pytest.mark.parametrize("internal", [AbortReason.LEASE_LOST, AbortReason.TIMEOUT, "lease_lost", "timeout"])
async def test_abort_refuses_the_sdks_own_reasons_and_leaves_the_request_running(
    internal: AbortReason | str, autojump_clock: trio.testing.MockClock
) -> None:
    """``lease_lost`` / ``timeout`` were accepted and faked those conditions: a lease said lost while
    held left the request open and broke the next send and the close; a timeout was told to the
    caller but journalled user_abort. Only the documented reasons are taken now."""
    slow, started, release = gated_tool("slow")
    store = MemoryStore()
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})]), Reply(text="done"), Reply(text="fine")]})
    value = internal.value if isinstance(internal, AbortReason) else internal
    async with open_session(provider=model, tools=[slow], journal=store) as session:
        with pytest.raises(ConfigError, match=f"abort reason '{value}' is the SDK's own"):
            await session.abort(internal)  # idle: refused all the same
        async with session.stream("go") as events:
            await started.wait()
            with pytest.raises(ConfigError, match=f"abort reason '{value}'.*'user_abort', 'steering', 'session_close'"):
                await session.abort(internal)
            with pytest.raises(ConfigError, match=f"abort reason '{value}'"):
                await events.abort(reason=internal)
            current = session._queue.current
            assert current is not None and not current.abort.aborted
            release.set()
            async for _ in events:
                pass
        assert events.text == "done"
        assert await session.send("next") == "fine"
    journal = await events_of(store, session.journal.stream_id())
    assert of_type(journal, RequestInterrupted) == [] and unsettled_requests(journal) == []
    assert isinstance(journal[-1], SessionClosed)


async def test_abort_during_the_model_call_records_the_aborted_attempt() -> None:
    store = MemoryStore()
    script = {"think": [Reply(text="slow answer", latency=1000.0)]}
    async with open_test_model(script) as model, open_session(provider=model, journal=store) as session:
        done: list[DoneEvent] = []

        async def run() -> None:
            with pytest.raises(RequestAbortedError):
                async with session.stream("think") as events:
                    async for event in events:
                        if isinstance(event, DoneEvent):
                            done.append(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()
            assert len(model.requests) == 1  # the provider is waiting on its latency
            await session.abort("user_abort")
            journal = await events_of(store, session.journal.stream_id())
            assert of_type(journal, ModelAttemptAborted)
            assert of_type(journal, RequestInterrupted)
            assert not of_type(journal, RequestCompleted)
    assert done == []  # the aborted DoneEvent is delivered by raising


# ---------------------------------------------------------------- one request at a time; priorities


async def test_second_request_without_priority_is_busy(autojump_clock: trio.testing.MockClock) -> None:
    slow, started, release = gated_tool("slow")
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="first done")]})
    async with open_session(provider=model, tools=[slow]) as session:
        answers: list[str] = []
        async with trio.open_nursery() as nursery:

            async def first() -> None:
                answers.append(await session.send("first"))

            nursery.start_soon(first)
            await started.wait()
            with pytest.raises(SessionBusyError):
                await session.send("second")
            with pytest.raises(SessionBusyError):
                async with session.stream("second"):
                    pass  # pragma: no cover - never entered
            release.set()
        assert answers == ["first done"]
    # The refused prompt never reached the model.
    assert all("second" not in [m.content for m in r.messages if isinstance(m, UserMessage)] for r in model.requests)


async def test_priority_next_joins_the_running_request_at_its_next_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, release = gated_tool("slow")
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="answer covering both")]})
    async with open_session(provider=model, tools=[slow]) as session:
        answers: dict[str, str] = {}
        async with trio.open_nursery() as nursery:

            async def send(name: str, prompt: str, priority: str | None) -> None:
                answers[name] = await session.send(prompt, priority=priority)

            nursery.start_soon(send, "first", "first", None)
            await started.wait()
            nursery.start_soon(send, "joined", "also consider this", "next")
            await trio.testing.wait_all_tasks_blocked()
            assert len(model.requests) == 1  # not yet: it waits for the current turn
            release.set()
        assert answers == {"first": "answer covering both", "joined": "answer covering both"}
    assert len(model.requests) == 2
    second = list(model.requests[1].messages)
    # The tool result of the running turn, then the joined message as a user message.
    assert isinstance(second[-2], ToolResultMessage) and second[-2].content == "slow done"
    assert second[-1] == UserMessage("also consider this")


async def test_priority_later_runs_as_a_new_request_after_the_current_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, release = gated_tool("slow")
    store = MemoryStore()
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="first answer"), Reply(text="later")]})
    async with open_session(provider=model, tools=[slow], journal=store) as session:
        order: list[tuple[str, str]] = []
        async with trio.open_nursery() as nursery:

            async def send(name: str, prompt: str, priority: str | None) -> None:
                order.append((name, await session.send(prompt, priority=priority)))

            nursery.start_soon(send, "first", "first", None)
            await started.wait()
            nursery.start_soon(send, "queued", "afterwards please", "later")
            await trio.testing.wait_all_tasks_blocked()
            assert len(model.requests) == 1
            release.set()
        assert order == [("first", "first answer"), ("queued", "later")]
        journal = await events_of(store, session.journal.stream_id())
    accepted = [e.request_id for e in of_type(journal, RequestAccepted)]
    completed = [e.request_id for e in of_type(journal, RequestCompleted)]
    started_ids = [e.request_id for e in of_type(journal, RequestStarted)]
    assert len(accepted) == 2 and completed == accepted and started_ids == accepted
    # The queued one was accepted (durably) while the first ran, but started only after the first completed.
    names = [(type(e).__name__, getattr(e, "request_id", None)) for e in journal]
    assert names.index(("RequestAccepted", accepted[1])) < names.index(("RequestCompleted", accepted[0]))
    assert names.index(("RequestCompleted", accepted[0])) < names.index(("RequestStarted", accepted[1]))
    # The later request is a new request on the same conversation.
    third = model.requests[2].messages
    assert third[-1] == UserMessage("afterwards please")
    assert UserMessage("first") in third


async def test_priority_now_steers_cancel_tools_but_not_block_tools(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    blocking, block_started, block_release = gated_tool("blocking", interrupt="block", log=log)
    cancellable, cancel_started, _never = gated_tool("cancellable", interrupt="cancel", log=log)
    model = TestModel({"first": [Reply(tool_calls=[("blocking", {}), ("cancellable", {})]), Reply(text="re-planned")]})
    async with open_session(provider=model, tools=[blocking, cancellable]) as session:
        answers: dict[str, str] = {}
        async with trio.open_nursery() as nursery:

            async def send(name: str, prompt: str, priority: str | None) -> None:
                answers[name] = await session.send(prompt, priority=priority)

            nursery.start_soon(send, "first", "first", None)
            await block_started.wait()
            await cancel_started.wait()
            nursery.start_soon(send, "steer", "change of plan", "now")
            await trio.testing.wait_all_tasks_blocked()
            # The cancel tool was interrupted at once; the block tool keeps running.
            assert log == ["cancellable:cancelled"]
            assert len(model.requests) == 1
            block_release.set()
        assert answers == {"first": "re-planned", "steer": "re-planned"}
    assert log == ["cancellable:cancelled", "blocking:finished"]
    second = list(model.requests[1].messages)
    results = {m.tool_call_id: m for m in second if isinstance(m, ToolResultMessage)}
    assert len(results) == 2
    outcomes = sorted((m.content == "blocking done", m.is_error) for m in results.values())
    assert outcomes == [(False, True), (True, False)]
    assert second[-1] == UserMessage("change of plan")


async def test_priority_now_during_the_model_call_is_applied_at_the_next_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = {"hi": [Reply(text="first thoughts", latency=10.0), Reply(text="steered answer")]}
    async with open_test_model(script) as model, open_session(provider=model) as session:
        answers: dict[str, str] = {}
        async with trio.open_nursery() as nursery:

            async def send(name: str, prompt: str, priority: str | None) -> None:
                answers[name] = await session.send(prompt, priority=priority)

            nursery.start_soon(send, "first", "hi", None)
            await trio.testing.wait_all_tasks_blocked()
            assert len(model.requests) == 1  # the model is still answering
            nursery.start_soon(send, "steer", "actually do X", "now")
    assert answers == {"first": "steered answer", "steer": "steered answer"}
    assert len(model.requests) == 2
    assert list(model.requests[1].messages)[-2:] == [
        AssistantMessage((TextPart("first thoughts"),)),
        UserMessage("actually do X"),
    ]


async def test_stream_of_a_joined_message_sees_the_rest_of_the_request(autojump_clock: trio.testing.MockClock) -> None:
    slow, started, release = gated_tool("slow")
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="final words")]})
    async with open_session(provider=model, tools=[slow]) as session:
        joined_events: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.send, "first")
            await started.wait()

            async def joined() -> None:
                async with session.stream("more", priority="next") as events:
                    async for event in events:
                        joined_events.append(event)

            nursery.start_soon(joined)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert isinstance(joined_events[-1], DoneEvent) and joined_events[-1].text == "final words"
    assert "".join(e.text for e in joined_events if isinstance(e, TextDeltaEvent)) == "final words"


@pytest.mark.parametrize("first", ["send", "stream"])
async def test_every_joined_stream_hears_of_the_running_call_before_its_result(
    first: str, autojump_clock: trio.testing.MockClock
) -> None:
    slow, started, release = gated_tool("slow")
    model = TestModel({"first": [Reply(text="looking", tool_calls=[("slow", {})]), Reply(text="final words")]})
    seen: dict[str, list[Any]] = {}
    async with open_session(provider=model, tools=[slow]) as session:

        async def read(name: str, prompt: str, priority: str | None) -> None:
            async with session.stream(prompt, priority=priority) as events:  # type: ignore[arg-type]
                seen[name] = [event async for event in events]

        async with trio.open_nursery() as nursery:
            if first == "send":
                nursery.start_soon(session.send, "first")
            else:
                nursery.start_soon(read, "original", "first", None)
            await started.wait()
            nursery.start_soon(read, "joined-1", "more", "next")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(read, "joined-2", "even more", "next")
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    for name, events in seen.items():
        calls = [type(event) for event in events if isinstance(event, (ToolUseEvent, ToolResultEvent))]
        assert calls == [ToolUseEvent, ToolResultEvent], name  # announced once, before its result


async def test_priority_next_while_the_request_finishes_is_not_lost() -> None:
    in_stop, release = trio.Event(), trio.Event()

    async def stop_hook(_input: Any) -> None:
        in_stop.set()
        await release.wait()

    model = TestModel({"hi": [Reply(text="first answer"), Reply(text="answer to the late message")]})
    async with open_session(provider=model, hooks={HookEvent.STOP: [stop_hook]}) as session:
        answers: dict[str, str] = {}
        async with trio.open_nursery() as nursery:

            async def send(name: str, prompt: str, priority: str | None) -> None:
                answers[name] = await session.send(prompt, priority=priority)

            nursery.start_soon(send, "first", "hi", None)
            await in_stop.wait()
            nursery.start_soon(send, "late", "one more thing", "next")
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    # Either the message joins (the model answers it) or it runs as its own request: never dropped.
    assert any(UserMessage("one more thing") in r.messages for r in model.requests)
    assert answers["late"] == "answer to the late message"


# ---------------------------------------------------------------- closing


async def test_leaving_the_block_cancels_and_records_running_work() -> None:
    log: list[str] = []
    slow, started, _release = gated_tool("slow", log=log)
    store = MemoryStore()
    model = TestModel({"go": [Reply(text="working", tool_calls=[("slow", {})])]})
    errors: list[BaseException] = []
    async with trio.open_nursery() as outer:
        async with open_session(provider=model, tools=[slow], journal=store) as session:

            async def run() -> None:
                try:
                    await session.send("go")
                except TrioAgentError as exc:
                    errors.append(exc)

            outer.start_soon(run)
            await started.wait()
        # The block returned: the tool was cancelled and nothing of the session still runs.
        assert log == ["slow:cancelled"]
        assert session_task_names() == []
    assert len(errors) == 1 and isinstance(errors[0], RequestAbortedError)
    assert errors[0].reason == "session_close"
    journal = await events_of(store, session.journal.stream_id())
    assert [e.reason for e in of_type(journal, RequestInterrupted)] == [RequestInterruptReason.SESSION_CLOSE]
    assert [e.reason for e in of_type(journal, TurnAborted)] == [TurnAbortReason.REQUEST_INTERRUPTED]
    assert [e.reason for e in of_type(journal, ToolCancelled)] == ["session_close"]
    closed = of_type(journal, SessionClosed)
    assert len(closed) == 1 and closed[0].reason is SessionCloseReason.COMPLETED
    assert isinstance(journal[-1], SessionClosed)
    # A closed session refuses new work.
    with pytest.raises(SessionClosedError):
        await session.send("more")


def unsettled_requests(journal: Sequence[Any]) -> list[str]:
    """Ids of accepted requests without a terminal event (completed, failed, interrupted)."""
    terminal = {e.request_id for e in journal if isinstance(e, RequestCompleted | RequestFailed | RequestInterrupted)}
    return [e.request_id for e in of_type(journal, RequestAccepted) if e.request_id not in terminal]


async def test_a_queued_request_is_settled_when_the_session_closes(autojump_clock: trio.testing.MockClock) -> None:
    slow, started, _release = gated_tool("slow")
    store = MemoryStore()
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="never")]})
    errors: dict[str, BaseException] = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as outer, open_session(provider=model, tools=[slow], journal=store) as session:

            async def send(name: str, prompt: str, priority: str | None) -> None:
                try:
                    await session.send(prompt, priority=priority)
                except TrioAgentError as exc:
                    errors[name] = exc

            outer.start_soon(send, "first", "first", None)
            await started.wait()
            outer.start_soon(send, "queued", "queued prompt", "later")
            await trio.testing.wait_all_tasks_blocked()
    journal = await events_of(store, session.journal.stream_id())
    assert isinstance(errors["first"], RequestAbortedError)
    assert isinstance(errors["queued"], SessionClosedError), repr(errors["queued"])
    assert unsettled_requests(journal) == []
    assert len(model.requests) == 1


async def test_every_queued_request_returns_when_the_session_closes(autojump_clock: trio.testing.MockClock) -> None:
    slow, started, _release = gated_tool("slow")
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="never")]})
    returned: list[str] = []
    with trio.move_on_after(600) as timeout:
        async with trio.open_nursery() as outer, open_session(provider=model, tools=[slow]) as session:

            async def send(prompt: str, priority: str | None) -> None:
                try:
                    await session.send(prompt, priority=priority)
                except TrioAgentError:
                    returned.append(prompt)

            outer.start_soon(send, "first", None)
            await started.wait()
            outer.start_soon(send, "queued 1", "later")
            outer.start_soon(send, "queued 2", "later")
            await trio.testing.wait_all_tasks_blocked()
    assert not timeout.cancelled_caught, f"only {returned} returned"
    assert sorted(returned) == ["first", "queued 1", "queued 2"]


# Regression: the subagent's request was once left 'started' with an open turn after the parent's abort.
async def test_abort_settles_the_request_of_a_running_foreground_subagent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trio_agent import SubagentDefinition

    slow, started, _release = gated_tool("slow")
    model = TestModel(
        {
            "delegate": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub job"})])],
            "sub job": [Reply(tool_calls=[("slow", {})])],
        }
    )
    async with open_session(
        provider=model, tools=[slow], subagents=[SubagentDefinition("helper", "helps", "You help.")]
    ) as session:
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                with pytest.raises(RequestAbortedError):
                    await session.send("delegate")

            nursery.start_soon(run)
            await started.wait()
            await session.abort()
        states: dict[str, list[Any]] = {}
        for agent_id in session.journal.agents:
            projection = session.journal.projection(agent_id)
            snapshot: Any = projection.snapshot()
            requests = [*snapshot.requests.values(), *snapshot.ended.values()]
            states[agent_id] = [f"request:{r.state.value}" for r in requests] + [
                f"turn:{t.state.value}" for t in snapshot.turns.values()
            ]
    assert len(states) == 2
    for agent_id, agent_states in states.items():
        assert "request:started" not in agent_states, (agent_id, agent_states)
        assert "turn:open" not in agent_states, (agent_id, agent_states)


async def test_cancelling_the_session_block_from_outside_records_the_running_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    slow, _started, _release = gated_tool("slow", log=log)
    store = MemoryStore()
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})])]})
    with trio.move_on_after(5) as timeout:
        async with open_session(provider=model, tools=[slow], journal=store) as session:
            await session.send("go")
    assert timeout.cancelled_caught
    assert log == ["slow:cancelled"]
    journal = await events_of(store, session.journal.stream_id())
    closed = of_type(journal, SessionClosed)
    assert len(closed) == 1 and isinstance(journal[-1], SessionClosed)
    assert unsettled_requests(journal) == []
    assert of_type(journal, TurnAborted)


# Regression: the task tool once ran foreground subagents with a discarding sink (no SubagentEvent at all).
async def test_stream_carries_the_events_of_a_foreground_subagent() -> None:
    from trio_agent import SubagentDefinition, SubagentEvent, SubagentStatus

    model = TestModel(
        {
            "delegate": [
                Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub job"})]),
                Reply(text="delegated"),
            ],
            "sub job": [Reply(text="sub result")],
        }
    )
    helper = SubagentDefinition("helper", "helps", "You help.")
    async with open_session(provider=model, subagents=[helper]) as session, session.stream("delegate") as events:
        seen = [event async for event in events]
    use = next(i for i, e in enumerate(seen) if isinstance(e, ToolUseEvent) and e.tool_name == "task")
    result = next(i for i, e in enumerate(seen) if isinstance(e, ToolResultEvent) and e.tool_name == "task")
    subagent = [(i, e) for i, e in enumerate(seen) if isinstance(e, SubagentEvent)]
    assert [e.status for _, e in subagent] == [SubagentStatus.RUNNING, SubagentStatus.COMPLETED]
    assert all(use < i < result for i, _ in subagent)
    sub_text = [e.text for e in seen if isinstance(e, TextDeltaEvent) and e.agent_id == subagent[0][1].subagent_id]
    assert "".join(sub_text) == "sub result"
    # The subagent's own end is not the request's end: one DoneEvent, the root's, last.
    assert sum(isinstance(e, DoneEvent) for e in seen) == 1
    assert isinstance(seen[-1], DoneEvent) and seen[-1].text == "delegated"


async def test_an_error_in_the_block_propagates_as_itself_and_closes_with_reason_error() -> None:
    class Boom(Exception):
        pass

    store = MemoryStore()
    model = TestModel(default=Reply(text="ok"))
    with pytest.raises(Boom) as caught:
        async with open_session(provider=model, journal=store) as session:
            await session.send("hello")
            raise Boom("from the body")
    assert type(caught.value) is Boom and str(caught.value) == "from the body"
    journal = await events_of(store, session.journal.stream_id())
    closed = of_type(journal, SessionClosed)
    assert len(closed) == 1 and closed[0].reason is SessionCloseReason.ERROR


async def test_an_error_inside_a_stream_block_propagates_as_itself_and_aborts_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    slow, started, _release = gated_tool("slow", log=log)
    store = MemoryStore()
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})])]})
    async with open_session(provider=model, tools=[slow], journal=store) as session:
        with pytest.raises(KeyError):
            async with session.stream("go") as events:
                async for event in events:
                    if isinstance(event, ToolUseEvent):
                        await started.wait()
                        raise KeyError("consumer failed")
        assert log == ["slow:cancelled"]
        journal = await events_of(store, session.journal.stream_id())
        assert of_type(journal, RequestInterrupted)


async def test_exactly_one_session_closed_per_agent_stream_with_subagents(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trio_agent import SubagentDefinition

    store = MemoryStore()
    model = TestModel(
        {
            "delegate": [
                Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub job"})]),
                Reply(text="delegated"),
            ],
            "sub job": [Reply(text="sub result")],
        }
    )
    async with open_session(
        provider=model, journal=store, subagents=[SubagentDefinition("helper", "helps", "You help.")]
    ) as session:
        assert await session.send("delegate") == "delegated"
        agents = list(session.journal.agents)
    assert len(agents) == 2
    infos = await store.streams(session.session_id)
    assert len(infos) == 2
    for info in infos:
        journal = await events_of(store, info.stream_id)
        assert len(of_type(journal, SessionClosed)) == 1, info.stream_id
        assert isinstance(journal[-1], SessionClosed)


# ---------------------------------------------------------------- bad input and errors at the boundary


@pytest.mark.parametrize("prompt", ["", "   ", None, 42])
async def test_bad_prompt_is_a_config_error(prompt: Any) -> None:
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model) as session:
        with pytest.raises(ConfigError):
            await session.send(prompt)
    assert model.requests == []


@pytest.mark.parametrize("priority", ["soon", "", "NOW", 1])
async def test_bad_priority_is_a_config_error(priority: Any) -> None:
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model) as session:
        with pytest.raises(ConfigError):
            await session.send("hello", priority=priority)
        assert await session.send("hello", priority="later") == "ok"
    assert len(model.requests) == 1


async def test_priority_is_an_enum_and_its_plain_names_work_too(autojump_clock: trio.testing.MockClock) -> None:
    assert [p.value for p in Priority] == ["next", "now", "later"] and Priority.NOW == "now"
    slow, started, release = gated_tool("slow")
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="both")]})
    async with open_session(provider=model, tools=[slow]) as session:
        answers: list[str] = []
        async with trio.open_nursery() as nursery:

            async def send(prompt: str, priority: Priority | None) -> None:
                answers.append(await session.send(prompt, priority=priority))

            nursery.start_soon(send, "first", None)
            await started.wait()
            nursery.start_soon(send, "joined", Priority.NEXT)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        assert answers == ["both", "both"]
        with pytest.raises(ConfigError, match="'next', 'now', 'later'"):
            await session.send("x", priority="soon")  # type: ignore[arg-type]


@pytest.mark.parametrize("max_turns", [0, -1, 1.5, True, "3", None])
async def test_bad_max_turns_is_a_config_error(max_turns: Any) -> None:
    with pytest.raises(ConfigError):
        async with open_session(provider=TestModel(), max_turns=max_turns):
            pytest.fail("the session must not open")  # pragma: no cover


async def test_unknown_provider_name_is_a_provider_config_error() -> None:
    with pytest.raises(ProviderConfigError) as caught:
        async with open_session(provider="no-such-provider", model="m"):
            pytest.fail("the session must not open")  # pragma: no cover
    assert isinstance(caught.value, ConfigError)
    assert "no-such-provider" in str(caught.value)


async def test_provider_by_name_needs_a_model() -> None:
    with pytest.raises(ConfigError):
        async with open_session(provider="test"):
            pytest.fail("the session must not open")  # pragma: no cover


async def test_provider_by_name_test_runs() -> None:
    async with open_session(provider="test", model="offline") as session:
        assert session.model == "offline"
        # The named test provider has no script: the request fails with a typed ModelError.
        with pytest.raises(ModelError):
            await session.send("anything")


async def test_model_error_surfaces_from_send_as_a_model_error() -> None:
    store = MemoryStore()
    model = TestModel(
        {"hi": [Reply(error=ModelError("the provider is down", code="DOWN", retryable=False)), Reply(text="back")]}
    )
    async with open_session(provider=model, journal=store) as session:
        with pytest.raises(ModelError) as caught:
            await session.send("hi")
        assert not isinstance(caught.value, BaseExceptionGroup)
        assert caught.value.code == "DOWN"
        journal = await events_of(store, session.journal.stream_id())
        assert len(of_type(journal, RequestFailed)) == 1
        assert [e.reason for e in of_type(journal, TurnAborted)] == [TurnAbortReason.ERROR]
        # The session survives a failed request.
        assert await session.send("again", priority=None) == "back"


async def test_model_error_in_a_stream_raises_after_the_events_so_far() -> None:
    model = TestModel(
        {"hi": [Reply(text="partial words here", fail_after_chunks=2, error=ModelError("cut", retryable=False))]}
    )
    async with open_session(provider=model) as session:
        seen: list[Any] = []
        with pytest.raises(ModelError):
            async with session.stream("hi") as events:
                async for event in events:
                    seen.append(event)
    assert [e.text for e in seen if isinstance(e, TextDeltaEvent)] == ["partial", " words"]
    assert not any(isinstance(e, DoneEvent) for e in seen)


async def test_a_tool_raising_becomes_an_error_result_not_a_session_error() -> None:
    @define_tool(name="explode", description="x", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def explode(input: dict[str, Any], ctx: Any) -> ToolResult:
        raise RuntimeError("kaboom")

    model = TestModel({"try": [Reply(tool_calls=[("explode", {})]), Reply(text="it failed, sorry")]})
    async with open_session(provider=model, tools=[explode]) as session:
        assert await session.send("try") == "it failed, sorry"
    result = [m for m in model.requests[1].messages if isinstance(m, ToolResultMessage)]
    assert len(result) == 1 and result[0].is_error and "kaboom" in result[0].content


async def test_send_after_close_is_a_session_closed_error() -> None:
    async with open_session(provider=TestModel(default=Reply(text="ok"))) as session:
        pass
    with pytest.raises(SessionClosedError):
        await session.send("late")
    with pytest.raises(SessionClosedError):
        async with session.stream("late"):
            pass  # pragma: no cover


@pytest.mark.parametrize("agent_id", [123, "x" * 2000, "a\x00b"])
async def test_a_subscription_to_an_agent_no_stream_can_have_is_a_config_error(agent_id: Any) -> None:
    # It was accepted and waited for ever for a stream that could never exist.
    from trio_agent import ConfigError

    async with open_session(provider=TestModel(default=Reply(text="ok"))) as session:
        with pytest.raises(ConfigError):
            async with session.subscribe_durable_events(agent_id=agent_id):
                pass  # pragma: no cover - refused before it opens
