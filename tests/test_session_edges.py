"""Session edge cases found while documenting: queued aborts, a full queue, late joiners,
subagent starts between requests, and hooks around a refused reopen."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import trio
import trio.testing

from tests.test_session import events_of, gated_tool, unsettled_requests
from trio_agent import (
    ConfigError,
    HookEvent,
    HookInput,
    RequestAbortedError,
    SessionBusyError,
    SessionClosedError,
    SubagentDefinition,
    open_session,
)
from trio_agent.journal import MemoryStore, RequestInterrupted, RequestInterruptReason, open_journal, read_conversation
from trio_agent.models import ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel


async def test_cancelling_a_queued_send_records_it_at_once_and_it_never_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, release = gated_tool("slow")
    store = MemoryStore()
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="first done")]})
    async with open_session(provider=model, tools=[slow], journal=store) as session, trio.open_nursery() as nursery:
        nursery.start_soon(session.send, "first")
        await started.wait()
        with trio.move_on_after(1) as scope:
            await session.send("never run", priority="later")
        assert scope.cancelled_caught
        # Recorded interrupted while the first request still runs (no wait for the worker).
        journal = await events_of(store, session.journal.stream_id())
        interrupted = [e.request_id for e in journal if isinstance(e, RequestInterrupted)]
        assert len(interrupted) == 1
        release.set()
    assert all("never run" not in str(m) for r in model.requests for m in r.messages)
    assert unsettled_requests(await events_of(store, session.journal.stream_id())) == []


async def test_a_full_queue_refuses_before_anything_is_written(autojump_clock: trio.testing.MockClock) -> None:
    slow, started, release = gated_tool("slow")
    store = MemoryStore()
    replies = iter([Reply(tool_calls=[("slow", {})])])
    model = TestModel(respond=lambda request: next(replies, Reply(text="ok")))
    async with open_session(provider=model, tools=[slow], journal=store) as session, trio.open_nursery() as nursery:
        nursery.start_soon(session.send, "first")
        await started.wait()
        capacity = session._queue.max_queued

        async def later(prompt: str) -> None:
            await session.send(prompt, priority="later")

        for index in range(capacity):
            nursery.start_soon(later, f"queued {index}")
        await trio.testing.wait_all_tasks_blocked()
        before = await session.journal.store.head(session.journal.stream_id())
        with pytest.raises(SessionBusyError, match="already queued"):
            await session.send("one too many", priority="later")
        assert await session.journal.store.head(session.journal.stream_id()) == before
        release.set()


async def test_a_message_joining_the_last_turn_reaches_the_next_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, release = gated_tool("slow")
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})]), Reply(text="second")]})
    async with open_session(provider=model, tools=[slow], max_turns=1) as session:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.send, "go")
            await started.wait()
            joined = trio.Event()

            async def join() -> None:
                await session.send("late note", priority="next")
                joined.set()

            nursery.start_soon(join)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        await session.send("again")
    texts = [m.content for m in model.requests[-1].messages if isinstance(m, UserMessage)]
    assert "late note" in texts


async def test_a_subagent_started_between_requests_is_not_a_user_message_after_a_restart(tmp_path: Any) -> None:
    path = tmp_path / "j.db"
    helper = SubagentDefinition("helper", "helps", "You help.")
    model = TestModel({"background job": [Reply(text="bg done")]}, default=Reply(text="fine"))
    async with open_session(provider=model, journal=path, subagents=[helper], session_id="s1") as session:
        handle = await session.start_subagent("helper", "background job")
        await handle.wait()
        # Crash-like end: the journal is fenced, so the close records nothing and the session stays open.
        session.journal._fence("test: simulate a crash")
    async with open_session(provider=model, journal=path, subagents=[helper], session_id="s1") as session:
        await session.send("after restart")
    messages = model.requests[-1].messages
    assert not any(isinstance(m, UserMessage) and m.content == "background job" for m in messages)
    assert not any(isinstance(m, ToolResultMessage) for m in messages)


async def test_session_end_does_not_run_when_an_ended_session_is_refused(tmp_path: Any) -> None:
    path = tmp_path / "j.db"
    calls: list[str] = []

    async def start(input: HookInput) -> None:
        calls.append("start")

    async def end(input: HookInput) -> None:
        calls.append("end")

    hooks: Any = {HookEvent.SESSION_START: [start], HookEvent.SESSION_END: [end]}
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model, journal=path, session_id="s1", hooks=hooks) as session:
        await session.send("hello")
        await session.end()
    assert calls == ["start", "end"]
    with pytest.raises(SessionClosedError, match="ended for good"):
        async with open_session(provider=model, journal=path, session_id="s1", hooks=hooks):
            pass
    assert calls == ["start", "end"]


async def test_effects_are_applied_after_the_call_is_settled() -> None:
    from trio_agent import PermissionUpdate, SideEffect, ToolKind, define_tool
    from trio_agent.tools import Effect

    seen_settled: list[bool] = []

    @define_tool(
        name="note",
        description="asks the session to tell the model something",
        input_schema={"type": "object"},
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
    )
    async def note(input: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Effect("new_messages", ["remember: the sky is green"]))
        await ctx.emit(Effect("permission_updates", [PermissionUpdate.add("write_thing", behavior="allow")]))
        return "noted"

    @define_tool(
        name="write_thing",
        description="a write tool that would ask in default mode",
        input_schema={"type": "object"},
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.WRITE,
    )
    async def write_thing(input: dict[str, Any], ctx: Any) -> str:
        return "written"

    model = TestModel(
        {
            "go": [
                Reply(tool_calls=[("note", {})]),
                Reply(tool_calls=[("write_thing", {})]),
                Reply(text="done"),
            ]
        }
    )
    async with open_session(provider=model, tools=[note, write_thing]) as session:
        assert await session.send("go") == "done"
        projection = session.journal.projection()
        seen_settled.append(all(record.state.settled for record in projection._s.tools.values()))
    second = model.requests[1].messages
    assert any(isinstance(m, UserMessage) and m.content == "remember: the sky is green" for m in second)
    # Without the rule update, the write tool would have been denied (default mode, nobody to ask).
    [written] = [m for m in model.requests[2].messages if isinstance(m, ToolResultMessage)][-1:]
    assert written.content == "written" and not written.is_error
    assert seen_settled == [True]


async def test_a_stream_reader_can_abort_while_the_channel_is_full(autojump_clock: trio.testing.MockClock) -> None:
    from trio_agent import Progress, ToolUseEvent, define_tool

    @define_tool(
        name="tail",
        description="streams many lines",
        side_effect="pure",
        kind="readonly",
        input_schema={"type": "object"},
        interrupt="cancel",
    )
    async def tail(input: dict[str, Any], ctx: Any) -> str:
        for index in range(10_000):
            await ctx.emit(Progress(f"line {index}"))
        return "ok"

    model = TestModel({"go": [Reply(tool_calls=[("tail", {})]), Reply(text="done")]})
    async with open_session(provider=model, tools=[tail]) as session:
        with trio.fail_after(30):
            async with session.stream("go") as events:
                async for event in events:
                    if isinstance(event, ToolUseEvent):
                        await trio.testing.wait_all_tasks_blocked()  # the channel fills up meanwhile
                        await session.abort()  # the reader itself stops the agent: must not deadlock
                        break
    interrupted = [e for e in await events_of(session.journal.store, session.journal.stream_id())]
    assert any(isinstance(e, RequestInterrupted) for e in interrupted)


async def test_the_bodys_own_exception_group_comes_out_unchanged() -> None:
    model = TestModel(default=Reply(text="ok"))
    with pytest.raises(ExceptionGroup) as caught:
        async with open_session(provider=model):
            raise ExceptionGroup("mine", [ValueError("a"), KeyError("b")])
    assert caught.value.message == "mine"
    assert [type(e) for e in caught.value.exceptions] == [ValueError, KeyError]


async def test_a_send_racing_the_close_is_refused_and_recorded(tmp_path: Any) -> None:
    path = tmp_path / "j.db"
    model = TestModel(default=Reply(text="hi"))
    outcome: list[BaseException] = []
    async with trio.open_nursery() as outer, open_session(provider=model, journal=path, session_id="s1") as session:

        async def late() -> None:
            try:
                await session.send("late request")
            except SessionClosedError as exc:
                outcome.append(exc)

        outer.start_soon(late)
        # Leave the block while the late request's accept is being committed.
        while not session.journal.projection().has_requests:
            await trio.lowlevel.checkpoint()
    assert len(outcome) == 1
    from trio_agent.journal import open_sqlite_store

    async with open_sqlite_store(path, readonly=True) as store:
        kinds = [type(e.event).__name__ for e in await store.read("s1/root")]
    assert kinds == ["SessionCreated", "RequestAccepted", "RequestInterrupted", "SessionClosed"]


async def test_cancelling_a_send_is_a_cancellation_even_if_its_write_failed() -> None:
    from trio_agent.testing import FaultyStore

    store = FaultyStore(MemoryStore())
    model = TestModel(default=Reply(text="hi"))
    async with open_session(provider=model, journal=store) as session:
        store.fail_next("after")  # the accept lands but reports failure, just as the caller is cancelled
        with trio.move_on_after(0) as scope:
            await session.send("x")
        assert scope.cancelled_caught


async def test_recovery_reruns_a_scheduled_background_task_without_cancelling_it(tmp_path: Any) -> None:
    from trio_agent import InterruptBehavior, SideEffect, ToolKind
    from trio_agent.journal import (
        ModelAttemptCompleted,
        ModelAttemptStarted,
        RequestAccepted,
        RequestStarted,
        SubagentCancelled,
        SubagentCompleted,
        SubagentStarted,
        ToolScheduled,
        TurnStarted,
        open_journal,
        open_sqlite_store,
    )

    path = tmp_path / "j.db"
    ids = {"request_id": "r1", "turn_id": "t1"}
    task_input = {"subagent": "helper", "prompt": "bg work", "background": True}
    async with open_sqlite_store(path) as store, open_journal(store, session_id="s1") as journal:
        await journal.append(RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "go"}))
        await journal.append(
            RequestStarted(request_id="r1"),
            TurnStarted(turn=1, **ids),
            ModelAttemptStarted(attempt_id="a1", model="test-model", **ids),
        )
        await journal.append(
            ModelAttemptCompleted(
                attempt_id="a1",
                response={"text": "", "tool_calls": [{"id": "c1", "name": "task", "arguments": "{}"}]},
                **ids,
            ),
            ToolScheduled(
                call_id="c1",
                tool_name="task",
                model_input=task_input,
                side_effect=SideEffect.NON_IDEMPOTENT,
                kind=ToolKind.READONLY,
                interrupt=InterruptBehavior.CANCEL,
                concurrency_safe=False,
                idempotency_key="s1:root:c1",
                **ids,
            ),
        )
        # The process "dies" here: the call was scheduled, never started.
        journal._fence("test: crash")
    helper = SubagentDefinition("helper", "helps", "You help.")
    model = TestModel({"bg work": [Reply(text="bg done")]}, default=Reply(text="fine"))
    async with open_session(
        provider=model, journal=path, session_id="s1", subagents=[helper], takeover_timeout=0.0
    ) as session:
        [handle] = session.subagents.values()
        assert await handle.wait() == "bg done"
        events = await events_of(session.journal.store, session.journal.stream_id())
    started = [e.subagent_id for e in events if isinstance(e, SubagentStarted)]
    assert started == [handle.id]
    assert [e.subagent_id for e in events if isinstance(e, SubagentCompleted)] == [handle.id]
    assert not [e for e in events if isinstance(e, SubagentCancelled)]


async def test_send_on_an_idle_session_runs_in_the_callers_task() -> None:
    tasks: list[trio.lowlevel.Task] = []

    def respond(request: Any) -> Reply:
        tasks.append(trio.lowlevel.current_task())  # the model is streamed by the request's task
        return Reply(text="ok")

    async with open_session(provider=TestModel(respond=respond)) as session:
        assert await session.send("one") == "ok"
        assert await session.send("two") == "ok"
    assert tasks == [trio.lowlevel.current_task()] * 2


async def test_a_cancelled_caller_interrupts_the_request_it_runs_as_a_user_abort(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, started, _release = gated_tool("slow")
    store = MemoryStore()
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="fine")]})
    async with open_session(provider=model, tools=[slow], journal=store) as session:
        with trio.move_on_after(5) as scope:
            await session.send("first")
        assert scope.cancelled_caught and started.is_set()
        journal = await events_of(store, session.journal.stream_id())
        assert [e.reason for e in journal if isinstance(e, RequestInterrupted)] == [RequestInterruptReason.USER_ABORT]
        # The slot is free again: the next request runs.
        assert await session.send("again") == "fine"
    assert unsettled_requests(await events_of(store, session.journal.stream_id())) == []


async def test_a_request_taken_by_the_worker_is_recorded_when_the_session_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The first request runs in its caller's task; the second waits in the worker for the slot
    # when the session's nursery is cancelled (what a crashing session task does).
    slow, started, _release = gated_tool("slow")
    store = MemoryStore()
    model = TestModel({"first": [Reply(tool_calls=[("slow", {})]), Reply(text="never")]})
    outcomes: dict[str, BaseException | str] = {}

    async def send(session: Any, prompt: str, priority: str | None) -> None:
        try:
            outcomes[prompt] = await session.send(prompt, priority=priority)
        except (SessionClosedError, RequestAbortedError) as exc:
            outcomes[prompt] = exc

    with trio.fail_after(60):
        async with (
            trio.open_nursery() as outer,
            open_session(provider=model, tools=[slow], journal=store) as session,
        ):
            outer.start_soon(send, session, "first", None)
            await started.wait()
            outer.start_soon(send, session, "queued", "later")
            await trio.testing.wait_all_tasks_blocked()
            assert session._queue.queued == 1
            session._nursery.cancel_scope.cancel()
            await trio.sleep_forever()
    assert isinstance(outcomes["first"], RequestAbortedError)
    assert isinstance(outcomes["queued"], SessionClosedError)
    journal = await events_of(store, session.journal.stream_id())
    reasons = [e.reason for e in journal if isinstance(e, RequestInterrupted)]
    assert reasons == [RequestInterruptReason.SESSION_CLOSE] * 2
    assert unsettled_requests(journal) == []


async def test_a_request_run_by_the_block_itself_records_session_close_when_the_block_is_cancelled() -> None:
    slow, started, _release = gated_tool("slow")
    store = MemoryStore()
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})]), Reply(text="never")]})
    with trio.CancelScope() as outer:
        async with open_session(provider=model, tools=[slow], journal=store) as session:

            async def cancel_when_started() -> None:
                await started.wait()
                outer.cancel()  # from a scope around the session, while the block's send() runs

            session._nursery.start_soon(cancel_when_started)  # type: ignore[union-attr]
            await session.send("go")
    assert outer.cancelled_caught
    journal = await events_of(store, session.journal.stream_id())
    assert [e.reason for e in journal if isinstance(e, RequestInterrupted)] == [RequestInterruptReason.SESSION_CLOSE]
    assert unsettled_requests(journal) == []


async def test_queued_requests_record_session_close_when_the_block_is_cancelled_from_outside() -> None:
    """The callers of queued requests (a send, a stream) are cancelled with the session block: their
    requests were recorded ``user_abort`` although the session's end cancelled them (docs: the
    session block cancelled from outside records ``session_close``)."""
    slow, started, _release = gated_tool("slow")
    store = MemoryStore()
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})]), Reply(text="never")]})

    async def stream(session: Any, prompt: str) -> None:
        async with session.stream(prompt, priority="later") as events:
            async for _ in events:
                pass  # pragma: no cover

    with trio.CancelScope() as outer:
        async with open_session(provider=model, tools=[slow], journal=store) as session, trio.open_nursery() as nursery:
            nursery.start_soon(session.send, "go")
            await started.wait()
            for i in range(3):
                nursery.start_soon(functools.partial(session.send, f"queued {i}", priority="later"))
                nursery.start_soon(stream, session, f"streamed {i}")
            await trio.testing.wait_all_tasks_blocked()
            assert session._queue.queued == 6
            outer.cancel()
    assert outer.cancelled_caught
    journal = await events_of(store, session.journal.stream_id())
    reasons = [e.reason for e in journal if isinstance(e, RequestInterrupted)]
    assert reasons == [RequestInterruptReason.SESSION_CLOSE] * 7
    assert unsettled_requests(journal) == []


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("a\x85b", id="C1-next-line"),
        pytest.param("a\x9b31mb", id="C1-CSI"),
        pytest.param("a\u2028b", id="line-separator"),
        pytest.param("a\u2029b", id="paragraph-separator"),
        pytest.param("a\u202eb", id="bidi-override"),
        pytest.param("a\u200bb", id="zero-width-space"),
        pytest.param("a\x1fb", id="C0"),
    ],
)
async def test_a_session_id_with_control_or_invisible_characters_is_refused(bad: str) -> None:
    """C1 controls (U+0085, the CSI U+009B) slipped through: only C0 and DEL were refused."""
    with pytest.raises(ConfigError, match=rf"session_id must not contain control characters: .*U\+{ord(bad[1]):04X}"):
        async with open_session(provider=TestModel(default=Reply(text="x")), session_id=bad):
            pass  # pragma: no cover


async def test_a_session_made_before_the_c1_rule_is_still_read_and_reopened_through_its_journal() -> None:
    """Journals never re-check ids: a session whose id predates the rule is read as before, and
    reopened through open_journal (open_session(session_id=...) is the door that refuses it)."""
    store, legacy = MemoryStore(), "legacy\x85id"
    first = TestModel(default=Reply(text="first"))
    async with open_journal(store, session_id=legacy) as journal, open_session(provider=first, journal=journal) as s:
        assert await s.send("one") == "first"
    assert len(await read_conversation(store, legacy)) == 2  # the prompt and the answer
    second = TestModel(default=Reply(text="second"))
    async with open_journal(store, session_id=legacy) as journal, open_session(provider=second, journal=journal) as s:
        assert await s.send("two") == "second"
        assert len(s.messages()) == 4
