"""Every call settles under every cancellation (the settlement issue), at the session level.

One regression test per defect: cancellations landing inside a journal write
(a store that holds chosen batches), nurseries inside tools, exception groups
at the boundary, steering of a foreground subagent, results an abort keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from tests.test_journal_durable import GatedStore
from tests.test_session import events_of, gated_tool, of_type, unsettled_requests
from trio_agent import (
    AbortReason,
    HookEvent,
    MiddlewareConfig,
    ModelMiddleware,
    PermissionDeniedEvent,
    PermissionUpdate,
    RequestAbortedError,
    SideEffect,
    SubagentDefinition,
    ToolKind,
    TrioAgentError,
    define_tool,
    open_session,
)
from trio_agent.journal import (
    MemoryStore,
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
    ToolCompleted,
)
from trio_agent.models import AssistantMessage, ReasoningPart, ToolResultMessage
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import Effect

OBJECT: dict[str, Any] = {"type": "object"}


class HoldingStore(GatedStore):
    """Holds (until ``release``) the first submitted batch whose events match ``when``."""

    def __init__(self, inner: Any, nursery: trio.Nursery) -> None:
        super().__init__(inner, nursery)
        self.when: Callable[[Any], bool] | None = None
        self.submitted = trio.Event()
        self.release = trio.Event()

    def submit(self, batch: Any) -> Any:
        when = self.when
        if when is not None and any(when(envelope.event) for envelope in batch.envelopes):
            self.when = None
            self.hold = self.release
            try:
                return super().submit(batch)
            finally:
                self.hold = None
                self.submitted.set()
        return super().submit(batch)


def outcomes_of_subagents(journal: list[Any]) -> dict[str, int]:
    """How many outcomes each started subagent has on a stream."""
    counts = {event.subagent_id: 0 for event in of_type(journal, SubagentStarted)}
    for event in journal:
        if isinstance(event, SubagentCompleted | SubagentCancelled):
            counts[event.subagent_id] = counts.get(event.subagent_id, 0) + 1
    return counts


HELPER = SubagentDefinition("helper", "helps", "You help.")


async def test_a_cancelled_start_subagent_between_requests_leaves_the_session_usable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = TestModel({"job": [Reply(text="job done")]}, default=Reply(text="fine"))
    async with trio.open_nursery() as nursery:
        store = HoldingStore(MemoryStore(), nursery)
        async with open_session(provider=model, journal=store, subagents=[HELPER]) as session:
            # The deadline lands while the holder request's accepted + started write commits.
            store.when = lambda event: isinstance(event, RequestAccepted) and "start_subagent" in event.input

            async def release_soon() -> None:
                await store.submitted.wait()
                await trio.sleep(2)  # later than the caller's deadline, within the commit grace
                store.release.set()

            nursery.start_soon(release_soon)
            with trio.move_on_after(1) as scope:
                await session.start_subagent("helper", "job")
            assert scope.cancelled_caught
            assert await session.send("hello") == "fine"
            journal = await events_of(store, session.journal.stream_id())
            assert unsettled_requests(journal) == []
            assert [e.reason for e in of_type(journal, RequestInterrupted)] == [RequestInterruptReason.USER_ABORT]


async def test_a_background_start_cancelled_after_subagent_started_records_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = TestModel({"job": [Reply(text="job done")]}, default=Reply(text="fine"))
    async with trio.open_nursery() as nursery:
        store = HoldingStore(MemoryStore(), nursery)
        async with open_session(provider=model, journal=store, subagents=[HELPER]) as session:
            store.when = lambda event: isinstance(event, SubagentStarted)

            async def release_soon() -> None:
                await store.submitted.wait()
                await trio.sleep(2)
                store.release.set()

            nursery.start_soon(release_soon)
            with trio.move_on_after(1) as scope:
                await session.start_subagent("helper", "job")
            assert scope.cancelled_caught
            journal = await events_of(store, session.journal.stream_id())
            assert outcomes_of_subagents(journal) == {e.subagent_id: 1 for e in of_type(journal, SubagentStarted)}
            assert len(of_type(journal, SubagentStarted)) == 1
            assert unsettled_requests(journal) == []
            assert await session.send("hello") == "fine"


@pytest.mark.parametrize("how", ["leave the block", "close"])
async def test_the_close_waits_for_a_start_between_requests_and_tells_it_the_session_closed(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    # The start's holder request is open on the root's stream while the subagent's stream is made
    # (held here). A close meanwhile waits for the start to end its holder request (failed: the
    # session closed), then closes every stream: nothing is left to recovery.
    model = TestModel(default=Reply(text="fine"))
    outcome: list[str] = []
    async with trio.open_nursery() as nursery:
        store = HoldingStore(MemoryStore(), nursery)
        async with (
            trio.open_nursery() as starters,
            open_session(provider=model, journal=store, subagents=[HELPER]) as session,
        ):
            await session.send("hello")  # the root's stream is written

            async def start() -> None:
                try:
                    await session.start_subagent("helper", "job")
                except TrioAgentError as exc:
                    outcome.append(type(exc).__name__)

            store.when = lambda event: isinstance(event, SessionCreated)  # the subagent's stream
            starters.start_soon(start)
            await store.submitted.wait()

            async def release_soon() -> None:
                await trio.sleep(1)
                store.release.set()

            starters.start_soon(release_soon)
            if how == "close":
                await session.close()
    assert outcome == ["SessionClosedError"]
    for agent_id in session.journal.agents:
        journal = await events_of(store, session.journal.stream_id(agent_id))
        assert unsettled_requests(journal) == []
        assert isinstance(journal[-1], SessionClosed), agent_id
    root = await events_of(store, session.journal.stream_id())
    assert len(of_type(root, RequestFailed)) == 1
    assert set(outcomes_of_subagents(root).values()) <= {1}


async def test_an_abort_while_a_foreground_subagent_starts_records_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = TestModel(
        {"delegate": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "job"})]), Reply(text="done")]},
        default=Reply(text="fine"),
    )
    async with trio.open_nursery() as nursery:
        store = HoldingStore(MemoryStore(), nursery)
        async with open_session(provider=model, journal=store, subagents=[HELPER]) as session:
            store.when = lambda event: isinstance(event, SubagentStarted)
            errors: list[BaseException] = []

            async def send() -> None:
                try:
                    await session.send("delegate")
                except RequestAbortedError as exc:
                    errors.append(exc)

            nursery.start_soon(send)
            await store.submitted.wait()
            nursery.start_soon(session.abort)
            await trio.testing.wait_all_tasks_blocked()
            store.release.set()
            await trio.testing.wait_all_tasks_blocked()
            journal = await events_of(store, session.journal.stream_id())
            assert len(of_type(journal, SubagentStarted)) == 1
            assert set(outcomes_of_subagents(journal).values()) == {1}
            assert unsettled_requests(journal) == []
            assert len(errors) == 1
            assert isinstance(await session.send("again"), str)  # the session goes on


async def test_a_session_block_cancelled_from_outside_raises_one_cancelled() -> None:
    slow, started, _release = gated_tool("slow")
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})]), Reply(text="never")]})
    store = MemoryStore()
    caught: list[type[BaseException]] = []
    with trio.CancelScope() as outer:
        try:
            async with open_session(provider=model, tools=[slow], journal=store) as session:
                session._nursery.start_soon(session.send, "go")  # type: ignore[union-attr]
                await started.wait()
                outer.cancel()
                await trio.sleep_forever()
        except BaseException as exc:
            caught.append(type(exc))
            raise
    assert caught == [trio.Cancelled]
    journal = await events_of(store, session.journal.stream_id())
    # The block was closed from outside: the running request records the close, not a user abort.
    assert [e.reason for e in of_type(journal, RequestInterrupted)] == [RequestInterruptReason.SESSION_CLOSE]
    assert unsettled_requests(journal) == []


def ticker_tool(name: str, started: trio.Event) -> Any:
    """A tool that runs a progress ticker in a nursery of its own (its cancellation is a group)."""

    @define_tool(
        name=name,
        description="ticks",
        input_schema=OBJECT,
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
        interrupt="block",
    )
    async def tool(input: dict[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            started.set()
            await trio.sleep_forever()
        return "never"

    return tool


async def test_a_tool_with_its_own_nursery_cancelled_from_outside_is_cancellation() -> None:
    started = trio.Event()
    model = TestModel({"go": [Reply(tool_calls=[("ticker", {})]), Reply(text="never")]}, default=Reply(text="fine"))
    store = MemoryStore()
    async with open_session(provider=model, tools=[ticker_tool("ticker", started)], journal=store) as session:
        caught: list[BaseException] = []
        with trio.CancelScope() as scope:

            async def cancel_when_started() -> None:
                await started.wait()
                scope.cancel()

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_when_started)
                    await session.send("go")
            except BaseException as exc:
                caught.append(exc)
                raise
        assert scope.cancelled_caught
        journal = await events_of(store, session.journal.stream_id())
        cancelled = of_type(journal, ToolCancelled)
        assert len(cancelled) == 1
        assert not of_type(journal, ToolCompleted)
        assert unsettled_requests(journal) == []
        assert isinstance(await session.send("again"), str)  # the session goes on


async def test_finished_sibling_results_survive_a_subagent_cancel(autojump_clock: trio.testing.MockClock) -> None:
    slow, slow_started, _release = gated_tool("slow", interrupt="block")

    @define_tool(
        name="fast", description="fast", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def fast(input: dict[str, Any], ctx: Any) -> str:
        return "fast result"

    model = TestModel(
        {
            "job": [Reply(tool_calls=[("fast", {}), ("slow", {})])],
            "more": [Reply(text="resumed")],
        },
        default=Reply(text="fine"),
    )
    store = MemoryStore()
    async with open_session(provider=model, tools=[fast, slow], journal=store, subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "job")
        await slow_started.wait()
        await trio.testing.wait_all_tasks_blocked()
        handle.cancel()
        await handle.wait()
        live = list(handle.agent.history)
        rebuilt = await session._rebuild_history(handle.id)
        answers = {m.tool_call_id: m.content for m in live if isinstance(m, ToolResultMessage)}
        assert "fast result" in answers.values()
        assert [m for m in live if isinstance(m, ToolResultMessage)] == [
            m for m in rebuilt if isinstance(m, ToolResultMessage)
        ]


async def test_steering_a_foreground_subagent_lets_its_block_tools_finish(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    slow, slow_started, release = gated_tool("slow", interrupt="block", log=log)
    model = TestModel(
        {
            "delegate": [
                Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "job"})]),
                Reply(text="parent done"),
            ],
            "job": [Reply(tool_calls=[("slow", {})]), Reply(text="child would go on")],
        },
        default=Reply(text="fine"),
    )
    store = MemoryStore()
    async with open_session(provider=model, tools=[slow], journal=store, subagents=[HELPER]) as session:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.send, "delegate")
            await slow_started.wait()
            nursery.start_soon(lambda: session.send("change of plan", priority="now"))
            await trio.testing.wait_all_tasks_blocked()
            assert log == []  # the block tool was not cancelled by the steering
            release.set()
        assert log == ["slow:finished"]
        (child_id,) = [agent for agent in session.journal.agents if agent != session.root_agent_id]
        child = await events_of(store, session.journal.stream_id(child_id))
        assert [e.reason for e in of_type(child, RequestInterrupted)] == [RequestInterruptReason.STEERING]
        assert len(of_type(child, ToolCompleted)) == 1
        parent = await events_of(store, session.journal.stream_id())
        assert [e.reason for e in of_type(parent, ToolCancelled)] == ["steering"]
        assert unsettled_requests(parent) == []


class HoldRootsFirstCall(ModelMiddleware):
    """Holds the root's first model call inside its stream until ``release`` is set."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()

    async def wrap_stream(self, request: Any, call_next: Any) -> Any:  # type: ignore[override]
        if request.metadata["agent_id"] == "root" and not self.entered.is_set():
            self.entered.set()
            await self.release.wait()
        async for chunk in call_next(request):
            yield chunk


async def test_a_now_message_while_the_model_answers_lets_that_replys_task_call_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The turn's steering signal was set before the `task` call started: its listener fired at
    # once and stopped the subagent before its first model call, though `task` is a block call,
    # which such a reply runs.
    model = TestModel(
        {
            "delegate": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "job"})]), Reply("parent done")],
            "job": [Reply(text="child done")],
        },
        default=Reply(text="fine"),
    )
    hold = HoldRootsFirstCall()
    store = MemoryStore()
    async with open_session(
        provider=model, journal=store, subagents=[HELPER], middleware=MiddlewareConfig(model=[hold])
    ) as session:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.send, "delegate")
            await hold.entered.wait()
            nursery.start_soon(lambda: session.send("hurry", priority="now"))
            await trio.testing.wait_all_tasks_blocked()
            hold.release.set()
        (child_id,) = [agent for agent in session.journal.agents if agent != session.root_agent_id]
        child = await events_of(store, session.journal.stream_id(child_id))
        assert of_type(child, RequestCompleted) and not of_type(child, RequestInterrupted)
        parent = await events_of(store, session.journal.stream_id())
        assert of_type(parent, SubagentCompleted) and not of_type(parent, ToolCancelled)
        answers = [m.content for m in session.messages() if isinstance(m, ToolResultMessage)]
        assert answers == ["child done"]


async def test_an_sdk_abort_keeps_the_committed_results(autojump_clock: trio.testing.MockClock) -> None:
    slow, slow_started, _release = gated_tool("slow", interrupt="block")

    @define_tool(
        name="fast", description="fast", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def fast(input: dict[str, Any], ctx: Any) -> str:
        return "fast result"

    model = TestModel({"go": [Reply(tool_calls=[("fast", {}), ("slow", {})]), Reply(text="never")]})
    async with open_session(provider=model, tools=[fast, slow]) as session:
        async with trio.open_nursery() as nursery:
            errors: list[RequestAbortedError] = []

            async def send() -> None:
                with pytest.raises(RequestAbortedError) as caught:
                    await session.send("go")
                errors.append(caught.value)

            nursery.start_soon(send)
            await slow_started.wait()
            await trio.testing.wait_all_tasks_blocked()
            await session.abort(AbortReason.USER_ABORT, "stop")
        (error,) = errors
        assert {result.output for result in error.results.values()} == {"fast result"}


async def test_background_calls_cancelled_by_close_carry_the_close_reason(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow, slow_started, _release = gated_tool("slow", interrupt="cancel")
    model = TestModel({"job": [Reply(tool_calls=[("slow", {})])]}, default=Reply(text="fine"))
    store = MemoryStore()
    async with open_session(provider=model, tools=[slow], journal=store, subagents=[HELPER]) as session:
        handle = await session.start_subagent("helper", "job")
        await slow_started.wait()
    child = await events_of(store, session.journal.stream_id(handle.id))
    assert [e.reason for e in of_type(child, ToolCancelled)] == ["session_close"]
    assert [e.reason for e in of_type(child, RequestInterrupted)] == [RequestInterruptReason.SESSION_CLOSE]


async def test_background_calls_cancelled_by_a_scope_around_the_session_name_a_cancellation_from_outside(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # As documented (docs/design/cancellation.md): the scope's cancellation reaches the subagent's
    # call before the close's abort could, so the call says `cancelled`; its request and its
    # outcome on the parent's stream still say the session closed.
    slow, slow_started, _release = gated_tool("slow", interrupt="cancel")
    model = TestModel({"job": [Reply(tool_calls=[("slow", {})])]}, default=Reply(text="fine"))
    store = MemoryStore()
    with trio.CancelScope() as scope:
        async with open_session(provider=model, tools=[slow], journal=store, subagents=[HELPER]) as session:
            handle = await session.start_subagent("helper", "job")
            await slow_started.wait()
            scope.cancel()
            await trio.sleep_forever()
    child = await events_of(store, session.journal.stream_id(handle.id))
    assert [e.reason for e in of_type(child, ToolCancelled)] == ["cancelled"]
    assert [e.reason for e in of_type(child, RequestInterrupted)] == [RequestInterruptReason.SESSION_CLOSE]
    parent = await events_of(store, session.journal.stream_id())
    assert [e.reason for e in of_type(parent, SubagentCancelled)] == ["session closed"]


class StuckCleanup(ModelMiddleware):
    """A stream middleware whose clean-up awaits for 1,000 s."""

    async def wrap_stream(self, request: Any, call_next: Any) -> Any:  # type: ignore[override]
        try:
            async for chunk in call_next(None):
                yield chunk
        finally:
            await trio.sleep(1000)  # runs inside the library's clean-up shield


async def test_a_stuck_stream_clean_up_is_bounded_by_cleanup_grace(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # 400 words: the reader below never reads, so the request blocks on its full event channel
    # with the middleware suspended between chunks; the deadline then closes the stream.
    model = TestModel(default=Reply(text=" ".join(["word"] * 400)))
    start = trio.current_time()
    async with open_session(
        provider=model, middleware=MiddlewareConfig(model=[StuckCleanup()]), cleanup_grace=2, close_timeout=5
    ) as session:
        with trio.move_on_after(1):
            async with session.stream("hello"):
                await trio.sleep_forever()
        # The 1 s deadline became at most 1 s + the grace (not 1,001 s).
        assert trio.current_time() - start <= 1 + 2 + 0.01
    # Leaving the block is bounded too.
    assert trio.current_time() - start <= 1 + 2 + 5 + 0.01
    assert any("overran" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("how", ["block", "close"])
async def test_a_close_that_overruns_close_timeout_is_abandoned_and_logged_not_raised(
    how: str, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async def slow_end(input: Any) -> None:
        await trio.sleep(3)

    store = MemoryStore()
    model = TestModel(default=Reply(text="ok"))
    start = trio.current_time()
    async with open_session(
        provider=model, journal=store, close_timeout=1, hooks={HookEvent.SESSION_END: [slow_end]}
    ) as session:
        assert await session.send("hi") == "ok"
        if how == "close":
            await session.close()
    assert trio.current_time() - start <= 1 + 0.01
    overran = [record.getMessage() for record in caplog.records if "overran" in record.getMessage()]
    assert overran and "close_timeout" in overran[0]
    # Abandoned before session_closed: the stream is left open, for recovery on reopen.
    assert not of_type(await events_of(store, session.journal.stream_id()), SessionClosed)


def granting_tool() -> Any:
    @define_tool(
        name="grant", description="grants", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def grant(input: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Effect("permission_updates", PermissionUpdate.add("danger")))
        return "granted"

    return grant


def danger_tool(ran: list[str]) -> Any:
    @define_tool(
        name="danger",
        description="needs permission",
        input_schema=OBJECT,
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.EXECUTE,
    )
    async def danger(input: dict[str, Any], ctx: Any) -> str:
        ran.append("danger")
        return "did it"

    return danger


async def test_a_tools_permission_update_is_journalled_and_replayed_on_reopen(tmp_path: Any) -> None:
    path = tmp_path / "j.db"
    ran: list[str] = []
    tools = [granting_tool(), danger_tool(ran)]

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        if isinstance(last, ToolResultMessage):
            return Reply(text="done")
        return Reply(tool_calls=[("grant" if last.content == "grant" else "danger", {})])

    model = TestModel(respond=respond)
    async with open_session(provider=model, tools=tools, journal=path, session_id="p1") as session:
        await session.send("grant")
        updates = session.journal.projection().permission_updates
        assert [(u.source, u.update["rules"]) for u in updates] == [("tool", ["danger"])]
        session.journal._fence("test: simulate a crash")  # the close writes nothing; reopen recovers
    async with open_session(provider=model, tools=tools, journal=path, session_id="p1") as session:
        await session.send("after restart")
    assert ran == ["danger"]  # the replayed rule allows it (no handler is configured)


async def test_a_tool_cannot_change_the_permission_mode(caplog: pytest.LogCaptureFixture) -> None:
    # A tool's permission_updates change the session's rules; a set_mode among them (a tool leaving
    # plan, or going to bypass) is ignored whole: only the application or an answer changes the mode.
    @define_tool(
        name="escalate", description="escalates", input_schema=OBJECT, side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
    )  # fmt: skip
    async def escalate(input: dict[str, Any], ctx: Any) -> str:
        updates = [PermissionUpdate.add("danger"), PermissionUpdate.set_mode("bypass")]
        await ctx.emit(Effect("permission_updates", updates))
        return "escalated"

    ran: list[str] = []
    model = TestModel(
        {"go": [Reply(tool_calls=[("escalate", {})]), Reply(tool_calls=[("danger", {})]), Reply(text="done")]}
    )
    store = MemoryStore()
    async with open_session(provider=model, tools=[escalate, danger_tool(ran)], journal=store) as session:
        await session.send("go")
        assert session.permissions is not None and session.permissions.mode.value == "default"
        assert session.permissions.session_allow_rules == ()
        assert session.journal.projection().permission_updates == ()
    assert ran == []
    assert any("not its permission mode" in record.getMessage() for record in caplog.records)


async def test_a_tools_grant_never_lifts_a_configured_deny() -> None:
    # A tool's rule updates weigh an answer's: any tool's rules, but never past a configured deny
    # (row 4 comes before every approval), even in bypass.
    ran: list[str] = []
    calls = [Reply(tool_calls=[("grant", {})]), Reply(tool_calls=[("danger", {})]), Reply(text="done")]
    async with open_session(
        provider=TestModel({"go": calls}), tools=[granting_tool(), danger_tool(ran)], journal=MemoryStore(),
        permissions={"deny": ["danger"]}, permission_mode="bypass",
    ) as session:  # fmt: skip
        await session.send("go")
        assert session.permissions is not None
        assert [rule.text for rule in session.permissions.session_allow_rules] == ["danger"]
    assert ran == []


async def test_a_middleware_cannot_grant_permissions_in_a_session() -> None:
    ran: list[str] = []

    async def granting_middleware(request: Any, call_next: Any) -> Any:
        await request.emit(Effect("permission_updates", PermissionUpdate.add("danger")))
        return await call_next()

    @define_tool(
        name="plain", description="plain", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def plain(input: dict[str, Any], ctx: Any) -> str:
        return "plain"

    model = TestModel(
        {"go": [Reply(tool_calls=[("plain", {})]), Reply(tool_calls=[("danger", {})]), Reply(text="done")]}
    )
    store = MemoryStore()
    async with open_session(
        provider=model,
        tools=[plain, danger_tool(ran)],
        middleware=MiddlewareConfig(tool=[granting_middleware]),
        journal=store,
    ) as session:
        await session.send("go")
        assert session.journal.projection().permission_updates == ()
    assert ran == []  # a grant emitted by middleware was refused: the rules still deny it


async def test_file_locks_belong_to_the_call_tree(autojump_clock: trio.testing.MockClock) -> None:
    """A tool holding a path delegates to a foreground subagent whose tool takes the same path."""
    edits: list[str] = []

    @define_tool(
        name="edit",
        description="edits a file",
        input_schema={"type": "object", "properties": {"path": {"type": "string"}}},
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.READONLY,
        affected_paths=lambda input: [input["path"]],
    )
    async def edit(input: dict[str, Any], ctx: Any) -> str:
        edits.append(input["path"])
        return "edited"

    holder: list[Any] = []

    @define_tool(
        name="review",
        description="holds a file and delegates its edit",
        input_schema={"type": "object", "properties": {"path": {"type": "string"}}},
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.READONLY,
        affected_paths=lambda input: [input["path"]],
    )
    async def review(input: dict[str, Any], ctx: Any) -> str:
        session = holder[0]
        return await session.run_foreground_subagent("helper", f"edit {input['path']}", ctx, lambda event: _noop())

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        if isinstance(last, ToolResultMessage):
            return Reply(text="done")
        if last.content.startswith("edit"):
            return Reply(tool_calls=[("edit", {"path": "notes.txt"})])
        return Reply(tool_calls=[("review", {"path": "notes.txt"})])

    helper = SubagentDefinition("helper", "helps", "You help.", tools=("edit",))
    async with open_session(
        provider=TestModel(respond=respond), tools=[edit, review], subagents=[helper], tool_timeout=100
    ) as session:
        holder.append(session)
        with trio.fail_after(20):  # the lock wait would be 30 s before failing
            assert await session.send("review notes") == "done"
        assert session.pipeline.file_locks.held() == {}  # everything taken was given back
    assert edits == ["notes.txt"]


async def _noop() -> None:
    await trio.lowlevel.checkpoint()


async def test_reasoning_with_its_signature_goes_back_to_the_model_and_into_the_journal(tmp_path: Any) -> None:
    @define_tool(
        name="look", description="looks", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def look(input: dict[str, Any], ctx: Any) -> str:
        return "seen"

    model = TestModel(
        {
            "think": [
                Reply(reasoning="let me look", reasoning_signature="sig-123", tool_calls=[("look", {})]),
                Reply(text="done"),
            ]
        }
    )
    async with open_session(provider=model, tools=[look], journal=tmp_path / "j.db") as session:
        await session.send("think")
        rebuilt = await session._rebuild_history(session.root_agent_id)
    sent = next(m for m in model.requests[1].messages if isinstance(m, AssistantMessage))
    assert ReasoningPart("let me look", "sig-123") in sent.parts
    assert next(m for m in rebuilt if isinstance(m, AssistantMessage)) == sent


async def test_a_tool_nobody_can_approve_is_refused_loudly() -> None:
    @define_tool(name="weather", description="weather", input_schema=OBJECT, side_effect=SideEffect.PURE)
    async def weather(input: dict[str, Any], ctx: Any) -> str:
        return "sunny"

    model = TestModel({"weather?": [Reply(tool_calls=[("weather", {})]), Reply(text="sorry")]})
    async with open_session(provider=model, tools=[weather]) as session, session.stream("weather?") as events:
        seen = [event async for event in events]
    denied = [event for event in seen if isinstance(event, PermissionDeniedEvent)]
    assert [(event.tool, event.reason) for event in denied] == [("weather", "no_handler")]
    answer = next(m for m in model.requests[1].messages if isinstance(m, ToolResultMessage))
    assert 'permissions={"allow": ["weather"]}' in answer.content


async def test_a_tool_returning_a_non_json_value_fails_that_call_not_the_request() -> None:
    @define_tool(name="bad", description="bad", input_schema=OBJECT, side_effect="pure", kind="readonly")
    async def bad(input: dict[str, Any], ctx: Any) -> set[int]:
        return {1, 2}

    @define_tool(name="good", description="good", input_schema=OBJECT, side_effect="pure", kind="readonly")
    async def good(input: dict[str, Any], ctx: Any) -> str:
        return "fine"

    model = TestModel({"go": [Reply(tool_calls=[("bad", {}), ("good", {})]), Reply(text="done")]})
    store = MemoryStore()
    async with open_session(provider=model, tools=[bad, good], journal=store) as session:
        assert await session.send("go") == "done"
        results = [m for m in model.requests[-1].messages if isinstance(m, ToolResultMessage)]
        assert sorted((r.is_error, r.content) for r in results) == [
            (False, "fine"),
            (True, "Error: tool 'bad' returned a non-JSON result: result.output is not JSON: set"),
        ]
        journal = await events_of(store, session.journal.stream_id())
        assert unsettled_requests(journal) == []
        settled = sorted(type(e).__name__ for e in journal if type(e).__name__ in ("ToolCompleted", "ToolFailed"))
        assert settled == ["ToolCompleted", "ToolFailed"]
