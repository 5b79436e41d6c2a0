"""How a session's requests end when their callers or the session are cancelled (a review's findings).

* The session's block cancelled from outside (or a lost lease) while requests wait in its queue:
  the worker rejected only the one it held; the others never ended, their callers waited for
  ever and their acceptance stayed open in the journal.
* `send()` on an idle session runs the request in the caller's task; cancelled while a tool ran
  a nursery of its own, it raised a bare exception group where the queued path raises `Cancelled`.
* A message that joined (``priority="next"``) a request whose caller was then cancelled was
  told it succeeded (an empty answer); one that joined a request aborted before it started was
  lost instead of reaching the next turn.
* Leaving the block while `session.close()` ran in another task closed the journal under that
  close: no ``session_closed`` was written.
* The queue's length was read off its channel: a request handed straight to the waiting worker
  was not counted (a send without priority ran ahead of it), one aborted while it waited was,
  and more concurrent sends than it holds passed the check before their acceptance was written.
* Queued requests entered the line when their acceptance write was confirmed, so they ran in
  the order their writers woke (a store committing a group of writes may wake them last first),
  not the order the journal accepted them. Requests aborted while they waited stayed in the
  line's bounded channel: enough of them made a later acceptance raise ``trio.WouldBlock``.
* A request the session's close caught while its acceptance was written was journalled
  interrupted with reason ``user_abort``; one whose acceptance was refused before the journal
  took it ended with no error, so a message that joined it was told it succeeded (with an empty
  answer) and was dropped.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from store_helpers import LaterStore

from tests.session_helpers import stream_events, user_texts
from trio_agent import (
    ModelError,
    RequestAbortedError,
    SessionClosedError,
    ToolResult,
    define_tool,
    open_session,
)
from trio_agent._chat._chat import chat
from trio_agent._errors import InvalidTransitionError
from trio_agent._journal._durable import DurableJournal
from trio_agent._journal._events import RequestAccepted, RequestInterrupted, RequestInterruptReason, SessionClosed
from trio_agent._journal._memory import MemoryStore
from trio_agent._session._endings import open_items
from trio_agent.models import (
    FinishChunk,
    FinishReason,
    ModelRequest,
    StreamChunk,
    TextDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    UsageChunk,
)
from trio_agent.testing import Reply, TestModel


async def test_requests_queued_when_the_session_is_cancelled_all_end(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel(respond=lambda request: Reply(text="ok", latency=10))
    outcomes: dict[str, str] = {}

    async def caller(name: str, session: Any, priority: str | None) -> None:
        try:
            outcomes[name] = await session.send(name, priority=priority)
        except (RequestAbortedError, SessionClosedError) as exc:
            outcomes[name] = type(exc).__name__

    with trio.fail_after(60):  # a caller left waiting would hang the test
        async with trio.open_nursery() as outside:  # callers outside the session's block
            with trio.move_on_after(2):
                async with open_session(provider=model) as session:
                    outside.start_soon(caller, "a", session, None)  # runs in its caller's task
                    await trio.sleep(0.1)
                    for name in ("b", "c", "d"):  # the worker takes b; c and d wait in the queue
                        outside.start_soon(caller, name, session, "later")
                    await trio.sleep_forever()
    assert outcomes == {
        "a": "RequestAbortedError",
        "b": "SessionClosedError",
        "c": "SessionClosedError",
        "d": "SessionClosedError",
    }
    events = [envelope.event for envelope in await session.journal.store.read(session.journal.stream_id())]
    assert sum(isinstance(event, RequestInterrupted) for event in events) == 4
    assert isinstance(events[-1], SessionClosed) and not open_items(session.journal.projection())


@define_tool(side_effect="pure", kind="readonly", interrupt="cancel", input_schema={"type": "object"})
async def fan(input: dict[str, Any], ctx: Any) -> ToolResult:
    """A tool that runs two tasks of its own."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 100)
        nursery.start_soon(trio.sleep, 100)
    return ToolResult.success("done")


async def test_send_run_in_its_callers_task_raises_cancelled_not_a_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = TestModel(default=Reply(tool_calls=[("fan", {})]))
    raised: list[BaseException] = []
    async with open_session(provider=model, tools=[fan]) as session:
        with trio.move_on_after(5):
            try:
                await session.send("go")
            except BaseException as exc:
                raised.append(exc)
                raise
    assert len(raised) == 1 and isinstance(raised[0], trio.Cancelled)


async def test_a_message_that_joined_a_request_whose_caller_was_cancelled_is_told_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = TestModel(respond=lambda request: Reply(text="answer", latency=10))
    joined: list[object] = []
    async with open_session(provider=model) as session, trio.open_nursery() as nursery:

        async def owner() -> None:
            with trio.move_on_after(3):
                await session.send("first")  # idle session: runs in this task

        async def joiner() -> None:
            try:
                joined.append(await session.send("more", priority="next"))
            except RequestAbortedError as exc:
                joined.append(exc)

        nursery.start_soon(owner)
        await trio.sleep(2)
        nursery.start_soon(joiner)
    assert len(joined) == 1 and isinstance(joined[0], RequestAbortedError), joined


async def test_a_message_that_joined_a_request_aborted_before_it_started_reaches_the_next_turn() -> None:
    store = LaterStore()
    model = TestModel(default=Reply(text="ok"))
    async with trio.open_nursery() as writer:
        writer.start_soon(store.run)
        async with open_session(provider=model, journal=store) as session:
            await session.send("warm")
            store.gate = trio.Event()  # the next acceptance waits for its commit
            told: dict[str, object] = {}
            async with trio.open_nursery() as nursery:

                async def first() -> None:
                    try:
                        await session.send("first")
                    except RequestAbortedError as exc:
                        told["first"] = exc

                async def join() -> None:
                    try:
                        await session.send("remember this", priority="next")
                    except RequestAbortedError as exc:
                        told["joined"] = exc

                nursery.start_soon(first)
                await trio.testing.wait_all_tasks_blocked()  # "first" is being accepted
                nursery.start_soon(join)
                await trio.testing.wait_all_tasks_blocked()  # the message joined it
                aborting = trio.Event()

                async def abort() -> None:
                    aborting.set()
                    await session.abort()

                nursery.start_soon(abort)
                await aborting.wait()
                store.gate.set()
            assert set(told) == {"first", "joined"}
            await session.send("next one")
            seen = [
                message.content for message in model.requests[-1].messages if type(message).__name__ == "UserMessage"
            ]
            assert seen == ["warm", "next one", "remember this"]
        writer.cancel_scope.cancel()


async def test_leaving_the_block_while_another_task_closes_the_session_waits_for_that_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trio_agent import HookEvent

    async def slow_end(input: Any) -> None:
        await trio.sleep(1)

    model = TestModel(default=Reply(text="ok"))
    closed_at: list[float] = []
    async with trio.open_nursery() as outside:
        async with open_session(provider=model, hooks={HookEvent.SESSION_END: [slow_end]}) as session:
            await session.send("hi")

            async def closer() -> None:
                await session.close()
                closed_at.append(trio.current_time())

            outside.start_soon(closer)
            await trio.testing.wait_all_tasks_blocked()  # the close runs its SessionEnd hook
        left_at = trio.current_time()
    assert closed_at and left_at >= closed_at[0]  # the block did not close the journal under it
    events = [envelope.event for envelope in await session.journal.store.read(session.journal.stream_id())]
    assert isinstance(events[-1], SessionClosed)


async def test_a_request_handed_straight_to_the_waiting_worker_counts_as_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Counted off the channel's buffer, a request handed straight to a worker waiting on an empty
    # channel was not queued: a send() without priority then ran first, in its caller's task.
    from trio_agent import SessionBusyError

    order: list[str] = []

    def respond(request: Any) -> Reply:
        prompt = [message for message in request.messages if type(message).__name__ == "UserMessage"][-1].content
        order.append(prompt)
        return Reply(text=f"ok:{prompt}")

    async with open_session(provider=TestModel(respond=respond)) as session:
        async with session.stream("s0") as events:  # a stream's request always goes to the worker
            async for _ in events:
                pass
        await trio.testing.wait_all_tasks_blocked()  # the worker waits on its empty channel
        async with session.stream("s1") as events:
            with pytest.raises(SessionBusyError):  # it was not: "x" ran first, in its caller's task
                await session.send("x")
            async for _ in events:
                pass
    assert order == ["s0", "s1"]


async def test_a_request_aborted_while_it_waited_is_not_counted_as_queued() -> None:
    async with open_session(provider=TestModel(default=Reply(text="ok"))) as session:
        async with session.stream("a"):
            pass  # left at once: its request, still waiting for the worker, is recorded interrupted
        assert await session.send("b") == "ok"  # not SessionBusyError: nothing waits any more


async def test_more_concurrent_sends_than_the_queue_holds_are_refused_and_none_is_left_open() -> None:
    # The queue's length was checked before the acceptance was written (an await): more sends than
    # it holds passed the check, and the extra ones raised trio.WouldBlock after being accepted,
    # left open for ever.
    from trio_agent import SessionBusyError

    store = LaterStore()
    release = trio.Event()

    @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def hold(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Holds the first request."""
        await release.wait()
        return ToolResult.success("done")

    def respond(request: Any) -> Reply:
        if len(request.messages) == 1 and request.messages[0].content == "first":
            return Reply(tool_calls=[("hold", {})])
        return Reply(text="ok")

    refused = 0
    async with trio.open_nursery() as writer:
        writer.start_soon(store.run)
        async with open_session(provider=TestModel(respond=respond), tools=[hold], journal=store) as session:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.send, "first")
                await trio.testing.wait_all_tasks_blocked()  # "first" waits in its tool
                store.gate = trio.Event()  # every acceptance now waits for its commit

                async def later(index: int) -> None:
                    nonlocal refused
                    try:
                        await session.send(f"later {index}", priority="later")
                    except SessionBusyError:
                        refused += 1

                for index in range(70):
                    nursery.start_soon(later, index)
                await trio.testing.wait_all_tasks_blocked()
                store.gate.set()
                release.set()
            assert refused == 70 - 64
            assert not open_items(session.journal.projection())
        writer.cancel_scope.cancel()


class LastFirstStore(LaterStore):
    """Commits the writes that wait in submission order, then wakes their writers last first, one
    at a time (as a store that commits a group of writes at once may wake them)."""

    async def run(self) -> None:
        async for batch, ticket in self._receive:
            await self.gate.wait()
            waiting = [(batch, ticket)]
            while True:
                try:
                    waiting.append(self._receive.receive_nowait())
                except trio.WouldBlock:
                    break
            outcomes = [MemoryStore.commit(self, batch) for batch, _ in waiting]
            for (_, ticket), outcome in reversed(list(zip(waiting, outcomes, strict=True))):
                ticket._resolve(outcome)
                await trio.testing.wait_all_tasks_blocked()  # its writer goes on before the next wakes


async def test_queued_requests_run_in_the_order_the_journal_accepted_them() -> None:
    store = LastFirstStore()
    release = trio.Event()

    @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def hold(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Holds the first request."""
        await release.wait()
        return ToolResult.success("done")

    ran: list[str] = []

    def respond(request: Any) -> Reply:
        prompt = user_texts(request)[-1]
        if prompt == "first":
            return Reply(tool_calls=[("hold", {})])
        ran.append(prompt)
        return Reply(text="ok")

    async with trio.open_nursery() as writer:
        writer.start_soon(store.run)
        async with open_session(provider=TestModel(respond=respond), tools=[hold], journal=store) as session:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.send, "first")
                await trio.testing.wait_all_tasks_blocked()  # "first" waits in its tool
                store.gate = trio.Event()  # the acceptances below wait, then are confirmed together
                for index in range(4):
                    nursery.start_soon(functools.partial(session.send, f"later {index}", priority="later"))
                    await trio.testing.wait_all_tasks_blocked()  # submitted in this order
                store.gate.set()
                await trio.testing.wait_all_tasks_blocked()
                release.set()
            events = await stream_events(session)
            accepted = [event.input["prompt"] for event in events if isinstance(event, RequestAccepted)]
        writer.cancel_scope.cancel()
    assert accepted == ["first", "later 0", "later 1", "later 2", "later 3"]
    assert ran == accepted[1:]


async def test_requests_aborted_while_they_wait_never_fill_the_line() -> None:
    release = trio.Event()

    @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def hold(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Holds the first request."""
        await release.wait()
        return ToolResult.success("done")

    def respond(request: Any) -> Reply:
        return Reply(tool_calls=[("hold", {})]) if user_texts(request) == ["first"] else Reply(text="ok")

    answers: list[str] = []
    async with open_session(provider=TestModel(respond=respond), tools=[hold]) as session:
        async with trio.open_nursery() as nursery:

            async def later(prompt: str) -> None:
                answers.append(await session.send(prompt, priority="later"))

            nursery.start_soon(session.send, "first")
            await trio.testing.wait_all_tasks_blocked()  # "first" waits in its tool
            nursery.start_soon(later, "waits")
            await trio.testing.wait_all_tasks_blocked()  # the worker holds it, waiting for the slot
            for index in range(70):  # more than the line holds, each aborted while it waits
                async with session.stream(f"left {index}", priority="later"):
                    pass
            nursery.start_soon(later, "last")  # raised trio.WouldBlock after its acceptance, left open
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        assert answers == ["ok", "ok"]
        assert not open_items(session.journal.projection())


async def test_a_request_the_close_catches_while_it_is_accepted_is_interrupted_by_the_close() -> None:
    store = LaterStore()

    @define_tool(side_effect="pure", kind="readonly", interrupt="cancel", input_schema={"type": "object"})
    async def hold(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Holds the first request."""
        await trio.sleep_forever()
        return ToolResult.success("done")

    told: dict[str, type[BaseException]] = {}

    async def send(session: Any, prompt: str, priority: str | None = None) -> None:
        try:
            await session.send(prompt, priority=priority)
        except (RequestAbortedError, SessionClosedError) as exc:
            told[prompt] = type(exc)

    async with trio.open_nursery() as writer:
        writer.start_soon(store.run)
        model = TestModel(default=Reply(tool_calls=[("hold", {})]))
        async with open_session(provider=model, tools=[hold], journal=store) as session, trio.open_nursery() as nursery:
            nursery.start_soon(send, session, "first")
            await trio.testing.wait_all_tasks_blocked()  # "first" waits in its tool
            store.gate = trio.Event()
            nursery.start_soon(send, session, "caught", "later")
            await trio.testing.wait_all_tasks_blocked()  # its acceptance is being written
            nursery.start_soon(session.close)
            await trio.testing.wait_all_tasks_blocked()  # the close waits for the journal
            store.gate.set()
        events = await stream_events(session)
        writer.cancel_scope.cancel()
    assert told == {"first": RequestAbortedError, "caught": SessionClosedError}
    accepted = {event.input["prompt"]: event.request_id for event in events if isinstance(event, RequestAccepted)}
    ends = {event.request_id: event.reason for event in events if isinstance(event, RequestInterrupted)}
    assert ends == {
        accepted["first"]: RequestInterruptReason.SESSION_CLOSE,
        accepted["caught"]: RequestInterruptReason.SESSION_CLOSE,  # was user_abort
    }


async def test_a_message_that_joined_a_request_whose_acceptance_was_refused_is_told_and_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A refusal before the journal took the acceptance (the projection unchanged) after an await:
    # the request ended with no error, so the joined sender got "" as an answer, its message lost.
    refuse = trio.Event()
    append = DurableJournal.append

    async def refusing(self: DurableJournal, *events: Any, **kwargs: Any) -> Any:
        if isinstance(events[0], RequestAccepted) and events[0].input == {"prompt": "first"}:
            await refuse.wait()
            raise InvalidTransitionError("injected: refused before the projection changed")
        return await append(self, *events, **kwargs)

    monkeypatch.setattr(DurableJournal, "append", refusing)
    model = TestModel(default=Reply(text="ok"))
    told: dict[str, object] = {}
    async with open_session(provider=model) as session:
        async with trio.open_nursery() as nursery:

            async def first() -> None:
                with pytest.raises(InvalidTransitionError):
                    await session.send("first")

            async def join() -> None:
                try:
                    told["joined"] = await session.send("remember this", priority="next")
                except InvalidTransitionError as exc:
                    told["joined"] = exc

            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()  # "first" is being accepted
            nursery.start_soon(join)
            await trio.testing.wait_all_tasks_blocked()  # the message joined it
            refuse.set()
        assert isinstance(told["joined"], InvalidTransitionError)
        assert await session.send("next one") == "ok"
    assert user_texts(model.requests[-1]) == ["next one", "remember this"]


async def test_a_failed_request_keeps_its_error_code_in_the_journal_and_its_done_event() -> None:
    # The failure was recorded with its message only, and the DoneEvent carried no code: a web
    # thread's RUN_ERROR said `run_failed` for a rate limit, and a reader of the journal could not
    # tell a retryable failure from another.
    from trio_agent import DoneEvent, ModelError
    from trio_agent._journal._events import RequestFailed
    from trio_agent.journal import RequestState

    model = TestModel(default=Reply(error=ModelError("slow down", code="rate_limited", retryable=True)))
    seen: list[Any] = []

    async def sink(event: Any) -> None:
        seen.append(event)

    async with open_session(provider=model) as session:
        assert await session.serve_request("r1", "hi", sink=sink) is RequestState.FAILED
        failed = [event for event in await stream_events(session) if isinstance(event, RequestFailed)]
    assert [(f.error.code, f.error.retryable, "slow down" in f.error.message) for f in failed] == [
        ("rate_limited", True, True)
    ]
    done = seen[-1]
    assert isinstance(done, DoneEvent) and done.error_code == "rate_limited"


async def test_an_error_that_leaves_a_request_in_a_group_keeps_its_own_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    # send() unwrapped a group to its one error with `raise ... from None`, which wiped the error's
    # own __cause__ (a RequestAbortedError's cause is what ended the request).
    from trio_agent._session._host import SessionHost

    cause = KeyError("the store of a tool's own")

    async def failing(self: Any, request: Any) -> None:
        ended = RequestAbortedError("ended", reason="error")
        ended.__cause__ = cause
        raise ExceptionGroup("a hook's nursery", [ended])

    monkeypatch.setattr(SessionHost, "run_request", failing)
    async with open_session(provider=TestModel(default=Reply("hi"))) as session:
        with pytest.raises(RequestAbortedError) as caught:
            await session.send("go")
    assert caught.value.__cause__ is cause


class FirstStreamYields(TestModel):
    """A custom provider whose first stream yields *chunks* as given (a provider's chunks are
    untrusted); the test model answers the later ones."""

    def __init__(self, chunks: list[Any]) -> None:
        super().__init__(default=Reply("fine"))
        self.first: list[Any] | None = chunks

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        if self.first is None:
            return super().stream(request)
        chunks, self.first = self.first, None

        async def given() -> AsyncIterator[StreamChunk]:
            for chunk in chunks:
                await trio.lowlevel.checkpoint()
                yield chunk

        return given()


WRONG_FIELD_CHUNKS = {
    "text-none": [TextDelta(None)],  # type: ignore[arg-type]
    "end-id-int": [ToolCallStart(0, "a", "t"), ToolCallEnd(0, 5, "t", "{}")],  # type: ignore[arg-type]
    "finish-str": [TextDelta("hi"), FinishChunk("stop")],  # type: ignore[arg-type]
}


@pytest.mark.parametrize("chunks", WRONG_FIELD_CHUNKS.values(), ids=WRONG_FIELD_CHUNKS.keys())
async def test_a_provider_chunk_with_a_field_of_the_wrong_type_fails_that_request_as_provider_failed(
    chunks: list[Any],
) -> None:
    """They escaped chat() as a bare TypeError or AttributeError (the assembler's), and a session's
    request as RequestAbortedError('the request failed: TypeError ...'): now the provider's
    typed error, and the session goes on."""
    with pytest.raises(ModelError) as caught:
        await chat(FirstStreamYields([*chunks, FinishChunk(FinishReason.STOP)]), "hello")
    assert caught.value.code == "provider_failed" and "the provider's stream yielded" in str(caught.value)
    async with open_session(provider=FirstStreamYields([*chunks, FinishChunk(FinishReason.STOP)])) as session:
        with pytest.raises(ModelError) as caught:
            await session.send("hello")
        assert caught.value.code == "provider_failed"
        assert await session.send("again") == "fine"


async def test_a_usage_with_a_float_count_fails_that_call_and_is_never_journalled(tmp_path: Path) -> None:
    """A custom provider's UsageChunk(Usage(12.0, 3.0, 15.0)) (a JSON 3.0) was accepted and
    journalled, and every later reopening of the session failed with JournalCorruptError (the
    journal reads a count back as an int only). Now that call fails with the provider's typed
    error, and the session reopens and goes on."""
    path = tmp_path / "journal.sqlite"
    floats = Usage(12.0, 3.0, 15.0)  # type: ignore[arg-type]
    async with open_session(
        provider=FirstStreamYields([TextDelta("hi"), UsageChunk(floats), FinishChunk(FinishReason.STOP)]),
        journal=path,
        session_id="s1",
    ) as session:
        with pytest.raises(ModelError, match=r"usage\.input_tokens is float 12\.0") as caught:
            await session.send("hello")
        assert caught.value.code == "provider_failed"
    async with open_session(provider=TestModel(default=Reply("fine")), journal=path, session_id="s1") as session:
        assert await session.send("again") == "fine"


class StallingStore(LaterStore):
    """Holds the write that ends request ``stall`` (its ``request_interrupted``), and every write
    after it, until ``release`` is set."""

    __slots__ = ("release", "stall")

    def __init__(self) -> None:
        super().__init__()
        self.stall: str | None = None
        self.release = trio.Event()

    async def run(self) -> None:
        async for batch, ticket in self._receive:
            if any(
                isinstance(envelope.event, RequestInterrupted) and envelope.event.request_id == self.stall
                for envelope in batch.envelopes
            ):
                await self.release.wait()
            ticket._resolve(MemoryStore.commit(self, batch))


async def test_a_queued_request_whose_rejection_overruns_cleanup_grace_still_ends(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # The close's record of the rejection, its error, DoneEvent and finish() were one shielded
    # block: the record overran cleanup_grace, the rest was skipped, and send() waited for ever.
    grace = 1.0
    store = StallingStore()

    @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def hold(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Holds the first request."""
        await trio.sleep_forever()
        return ToolResult.success("done")  # pragma: no cover

    told: dict[str, BaseException] = {}
    later_told = trio.Event()

    async def send(session: Any, prompt: str, priority: str | None = None) -> None:
        try:
            await session.send(prompt, priority=priority)
        except (RequestAbortedError, SessionClosedError) as exc:
            told[prompt] = exc
        if prompt == "later":
            later_told.set()

    async with trio.open_nursery() as writer:
        writer.start_soon(store.run)
        model = TestModel(default=Reply(tool_calls=[("hold", {})]))
        async with (
            open_session(provider=model, tools=[hold], journal=store, cleanup_grace=grace) as session,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(send, session, "first")
            await trio.testing.wait_all_tasks_blocked()  # "first" waits in its tool
            nursery.start_soon(send, session, "later", "later")
            await trio.testing.wait_all_tasks_blocked()  # "later" is queued
            (store.stall,) = [
                event.request_id
                for event in await stream_events(session)
                if isinstance(event, RequestAccepted) and event.input["prompt"] == "later"
            ]
            nursery.start_soon(session.close)
            started = trio.current_time()
            with trio.fail_after(10 * grace):
                await later_told.wait()
            assert trio.current_time() - started >= grace  # told once its record was abandoned
            store.release.set()
        writer.cancel_scope.cancel()
    assert isinstance(told["later"], SessionClosedError)
    assert isinstance(told["first"], RequestAbortedError)
    assert "recording a request the close rejected overran" in caplog.text


async def test_a_queued_request_whose_abort_cannot_be_recorded_still_ends(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `_record_unstarted` finished the request after its record: a record that raised (the journal
    # refusing the event) skipped finish(), so the stream's reader, waiting for its end, waited for
    # ever (the worker and the close leave an aborted request to whoever aborted it).
    refused: set[str] = set()
    append = DurableJournal.append

    async def refusing(self: DurableJournal, *events: Any, **kwargs: Any) -> Any:
        if any(isinstance(event, RequestInterrupted) and event.request_id in refused for event in events):
            raise InvalidTransitionError("injected: the abort's record refused")
        return await append(self, *events, **kwargs)

    monkeypatch.setattr(DurableJournal, "append", refusing)

    @define_tool(side_effect="pure", kind="readonly", interrupt="cancel", input_schema={"type": "object"})
    async def hold(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Holds the first request."""
        await trio.sleep_forever()
        return ToolResult.success("done")  # pragma: no cover

    told: dict[str, BaseException] = {}
    read = trio.Event()

    async def send(session: Any, prompt: str) -> None:
        with pytest.raises(RequestAbortedError):
            await session.send(prompt)

    async def reader(events: Any) -> None:
        try:
            async for _ in events:
                pass
        except RequestAbortedError as exc:
            told["reader"] = exc
        read.set()

    model = TestModel(default=Reply(tool_calls=[("hold", {})]))
    async with open_session(provider=model, tools=[hold]) as session, trio.open_nursery() as nursery:
        nursery.start_soon(send, session, "first")
        await trio.testing.wait_all_tasks_blocked()  # "first" waits in its tool
        async with session.stream("later", priority="later") as events:
            refused.add(events.request.request_id)  # queued behind "first"
            nursery.start_soon(reader, events)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(InvalidTransitionError, match="injected"):
                await events.abort("not any more")  # the aborter is told the record failed
            with trio.fail_after(60):  # the reader is told the request ended
                await read.wait()
        assert events.request.done.is_set()
        assert isinstance(told["reader"], RequestAbortedError) and told["reader"].reason == "user_abort"
        assert "aborted before it started: not any more" in str(told["reader"])
        await session.abort()
