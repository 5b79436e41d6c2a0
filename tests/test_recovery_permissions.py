"""Recovery re-runs of calls whose permission was already decided: a durable grant answers the
re-run's ask (a call is asked at most once), the table's denies still hold, and a started call
runs again with the input it started with; a call a person approved with edited arguments runs
with the edit, started or not.

Each process 'dies' at one write (`CrashStore`): that write and every later one are lost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    PermissionAllow,
    PermissionRequest,
    PermissionUpdate,
    SideEffect,
    TrioAgentError,
    define_tool,
    open_session,
)
from trio_agent._journal._events import (
    PermissionRequested,
    PermissionResolved,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolRecoveryAction,
    ToolScheduled,
    ToolStarted,
)
from trio_agent._journal._store import AppendBatch, AppendResult, AppendTicket
from trio_agent.journal import JournalUnavailableError, MemoryStore, open_sqlite_store, read_conversation
from trio_agent.lifecycle import Approve, Reject
from trio_agent.models import ModelRequest, ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import SchedulerLimits

SCHEMA: dict[str, Any] = {"type": "object"}


class CrashStore:
    """Passes writes through until the first batch holding an event *dies_at* picks: from it on,
    nothing is written (the process died)."""

    def __init__(self, inner: Any, dies_at: Callable[[Any], bool]) -> None:
        self.inner, self.clock, self.dies_at, self.dead = inner, inner.clock, dies_at, False

    def submit(self, batch: AppendBatch) -> AppendTicket:
        if any(self.dies_at(envelope.event) for envelope in batch.envelopes):
            self.dead = True
        if not self.dead:
            return self.inner.submit(batch)  # type: ignore[no-any-return]
        ticket = AppendTicket(batch)
        ticket._resolve(JournalUnavailableError("the process died"))
        return ticket

    async def append(self, batch: AppendBatch) -> AppendResult:
        return await self.submit(batch).wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def at(kind: type, nth: int = 1) -> Callable[[Any], bool]:
    """The *nth* write of an event of *kind* (call ids are the test model's, counted process-wide)."""
    seen = 0

    def dies(event: Any) -> bool:
        nonlocal seen
        seen += isinstance(event, kind)
        return seen == nth and isinstance(event, kind)

    return dies


@asynccontextmanager
async def store_of(kind: str, tmp_path: Path) -> AsyncIterator[Any]:
    if kind == "memory":
        yield MemoryStore(clock=trio.current_time)
    else:
        async with open_sqlite_store(tmp_path / "j.db") as store:
            yield store


def model(*calls: dict[str, Any]) -> TestModel:
    """One call of ``write_file`` per input in *calls*, one turn each, on "go"; then "done"."""

    def last_user(request: ModelRequest) -> str:
        users = [m.content for m in request.messages if isinstance(m, UserMessage)]
        return str(users[-1]) if users else ""

    turns = [Reply(tool_calls=[("write_file", dict(call))]) for call in calls]
    return TestModel(key=last_user, script={"go": [*turns, Reply(text="done")]}, default=Reply(text="fine"))


def write_tool(ran: list[dict[str, Any]], during: Callable[[], Any] | None = None) -> Any:
    @define_tool(name="write_file", description="writes", input_schema=SCHEMA, side_effect=SideEffect.IDEMPOTENT,
                 kind="write")  # fmt: skip
    async def write_file(input: dict[str, Any], ctx: Any) -> str:
        ran.append(dict(input))
        if during is not None:
            await during()
        return "written"

    return write_file


async def events_of(store: Any, session_id: str) -> list[Any]:
    return [envelope.event for envelope in await store.read(f"{session_id}/root")]


async def live_then_crash(store: Any, dies_at: Callable[[Any], bool], **options: Any) -> None:
    with pytest.raises(TrioAgentError):
        async with open_session(journal=CrashStore(store, dies_at), session_id="s", **options) as session:
            await session.send("go")


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize("crash", [ToolStarted, ToolCompleted], ids=["at-start", "at-settlement"])
async def test_a_call_a_handler_allowed_is_recovered_without_asking_again(
    kind: str, crash: type, tmp_path: Path
) -> None:
    # The re-run asked again: the journal refused the second ask of the call, its permission stage
    # failed (hook_error) and the tool never ran: a `run` call silently never happened, and a
    # half-done idempotent one (`rerun_same_key`) was settled failed.
    asks: list[str] = []
    ran: list[dict[str, Any]] = []

    async def handler(request: PermissionRequest) -> PermissionAllow:
        asks.append(request.tool_call_id)
        return PermissionAllow()

    options: dict[str, Any] = {"provider": model({"p": "a"}), "tools": [write_tool(ran)], "permission_handler": handler}
    async with store_of(kind, tmp_path) as store:
        await live_then_crash(store, at(crash), **options)
        [call_id] = asks
        ran_before = len(ran)
        assert ran_before == (0 if crash is ToolStarted else 1)
        async with open_session(journal=store, session_id="s", **options) as session:
            assert session.recovery is not None
            action = ToolRecoveryAction.RUN if crash is ToolStarted else ToolRecoveryAction.RERUN_SAME_KEY
            assert session.recovery.decisions == {call_id: action}
            assert session.recovery_notes == [f"re-ran write_file call {call_id}: ok"]
        events = await events_of(store, "s")
    assert asks == [call_id]  # the grant of the first life answered the re-run
    assert ran == [{"p": "a"}] * (ran_before + 1)
    assert len([e for e in events if isinstance(e, PermissionRequested)]) == 1
    assert [e.call_id for e in events if isinstance(e, ToolCompleted)] == [call_id]
    assert not [e for e in events if isinstance(e, ToolFailed)]


async def test_a_started_call_runs_again_with_the_input_its_handler_allowed() -> None:
    # The grant covered the handler's edit, which only the start recorded: a re-run from the
    # model's input would run what nobody allowed, under the same idempotency key.
    asks: list[str] = []
    ran: list[dict[str, Any]] = []

    async def handler(request: PermissionRequest) -> PermissionAllow:
        asks.append(request.tool_call_id)
        return PermissionAllow(updated_input={"p": "safe"})

    store = MemoryStore()
    options: dict[str, Any] = {
        "provider": model({"p": "anywhere"}), "tools": [write_tool(ran)], "permission_handler": handler,
    }  # fmt: skip
    await live_then_crash(store, at(ToolCompleted), **options)
    [call_id] = asks
    async with open_session(journal=store, session_id="s", **options) as session:
        assert session.recovery_notes == [f"re-ran write_file call {call_id}: ok"]
    assert asks == [call_id]
    assert ran == [{"p": "safe"}, {"p": "safe"}]
    started = [e.input for e in await events_of(store, "s") if isinstance(e, ToolStarted)]
    assert started == [{"p": "safe"}, {"p": "safe"}]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_call_that_had_not_started_runs_with_the_input_its_handler_allowed(kind: str, tmp_path: Path) -> None:
    # Crash before the start: only the answer knew of the handler's edit, and the re-run ran the
    # model's own input under the grant, which nobody allowed. The answer now records what it allowed.
    asks: list[str] = []
    ran: list[dict[str, Any]] = []

    async def handler(request: PermissionRequest) -> PermissionAllow:
        asks.append(request.tool_call_id)
        return PermissionAllow(updated_input={"p": "safe"})

    options: dict[str, Any] = {
        "provider": model({"p": "anywhere"}), "tools": [write_tool(ran)], "permission_handler": handler,
    }  # fmt: skip
    async with store_of(kind, tmp_path) as store:
        await live_then_crash(store, at(ToolStarted), **options)
        [call_id] = asks
        assert ran == []
        async with open_session(journal=store, session_id="s", **options) as session:
            assert session.recovery_notes == [f"re-ran write_file call {call_id}: ok"]
        events = await events_of(store, "s")
    assert asks == [call_id] and ran == [{"p": "safe"}]
    [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
    assert resolved.input == {"p": "safe"}
    assert [e.input for e in events if isinstance(e, ToolStarted)] == [{"p": "safe"}]


async def test_an_answer_that_keeps_the_asked_input_records_none() -> None:
    # Only a changed input is recorded (old journals have none: the asked input).
    async def handler(request: PermissionRequest) -> PermissionAllow:
        return PermissionAllow()

    store = MemoryStore()
    ran: list[dict[str, Any]] = []
    async with open_session(
        journal=store, session_id="s", provider=model({"p": "a"}), tools=[write_tool(ran)], permission_handler=handler
    ) as session:
        await session.send("go")
    [resolved] = [e for e in await events_of(store, "s") if isinstance(e, PermissionResolved)]
    assert resolved.input is None and ran == [{"p": "a"}]


async def test_a_started_call_nobody_was_asked_about_is_not_asked_on_its_re_run() -> None:
    # call_2 started on a remembered approval (never journalled): the re-run's table asked, and
    # the journal refused an ask about a started call, so it failed with hook_error instead.
    asks: list[str] = []
    ran: list[dict[str, Any]] = []

    async def handler(request: PermissionRequest) -> PermissionAllow:
        asks.append(request.tool_call_id)
        return PermissionAllow(remember=True)

    store = MemoryStore()
    options: dict[str, Any] = {
        "provider": model({"p": "a"}, {"p": "a"}), "tools": [write_tool(ran)], "permission_handler": handler,
    }  # fmt: skip
    await live_then_crash(store, at(ToolCompleted, 2), **options)
    [first] = asks
    assert len(ran) == 2
    async with open_session(journal=store, session_id="s", **options) as session:
        assert session.recovery is not None
        [(second, action)] = session.recovery.decisions.items()
        assert second != first and action is ToolRecoveryAction.RERUN_SAME_KEY
        assert session.recovery_notes == [f"re-ran write_file call {second}: ok"]
    assert asks == [first] and len(ran) == 3
    events = await events_of(store, "s")
    assert [e.call_id for e in events if isinstance(e, PermissionRequested)] == [first]


async def test_a_deny_rule_recorded_after_the_grant_still_denies_the_re_run() -> None:
    # The grant answers the ask only: the table is walked again under the rules the journal holds.
    asks: list[str] = []
    ran: list[dict[str, Any]] = []
    live: list[Any] = []

    async def handler(request: PermissionRequest) -> PermissionAllow:
        asks.append(request.tool_call_id)
        return PermissionAllow()

    async def deny_it() -> None:
        if len(ran) == 1:
            await live[0].permissions.accept_updates(
                [PermissionUpdate.add("write_file", behavior="deny")], source="handler"
            )

    store = MemoryStore()
    options: dict[str, Any] = {
        "provider": model({"p": "a"}), "tools": [write_tool(ran, deny_it)], "permission_handler": handler,
    }  # fmt: skip
    with pytest.raises(TrioAgentError):
        async with open_session(journal=CrashStore(store, at(ToolCompleted)), session_id="s", **options) as session:
            live.append(session)
            await session.send("go")
    [call_id] = asks
    async with open_session(journal=store, session_id="s", **options) as session:
        assert session.recovery_notes == [f"re-ran write_file call {call_id}: error"]
    assert (asks, len(ran)) == ([call_id], 1)
    # Settled cancelled (the pipeline's settlement of a started call that did not run again).
    [settled] = [e for e in await events_of(store, "s") if isinstance(e, ToolCancelled)]
    assert settled.result is not None and settled.result["error"]["type"] == "permission_denied"


# ---------------------------------------------------------------- a person's approval (interrupts)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize("started", [False, True], ids=["before-start", "after-start"])
async def test_a_call_a_person_approved_with_edits_runs_with_the_edits_after_a_crash(
    kind: str, started: bool, tmp_path: Path
) -> None:
    # The continuation schedules an approved call with its approved input (the edit), so the
    # journal records the edit where recovery reads a call's input (tool_scheduled, and
    # tool_started once started): a re-run never runs the model's arguments, which nobody
    # approved, and a rejected call of the same batch stays answered by its rejection, never run.
    ran: list[dict[str, Any]] = []
    calls = [("write_file", {"p": "one"}), ("write_file", {"p": "two"}), ("write_file", {"p": "three"})]
    options: dict[str, Any] = {
        "provider": TestModel(script={"go": [Reply(tool_calls=calls), Reply(text="done")]}, key=lambda _: "go"),
        # The first call to run waits until the other is scheduled (blocked on the slot): its
        # writes make that schedule durable, and the crash lands at the second call's start (or
        # settlement). Which approved call runs first is Trio's choice: both are edited.
        "tools": [write_tool(ran, trio.testing.wait_all_tasks_blocked)],
        "scheduler_limits": SchedulerLimits(write=1),
        "permissions": {"ask": ["write_file"]},
        "permission_asks": "interrupt",
    }
    edits: dict[str, dict[str, Any]] = {}
    async with store_of(kind, tmp_path) as store:
        with pytest.raises(TrioAgentError):
            crash = CrashStore(store, at(ToolCompleted if started else ToolStarted, 2))
            async with open_session(journal=crash, session_id="s", **options) as session:
                reply = await session.send("go")
                one, two, three = reply.interrupts
                edits.update({str(one.tool_call_id): {"p": "safe-1"}, str(two.tool_call_id): {"p": "safe-2"}})
                await session.resume(
                    [Approve(one.id, edited_args={"p": "safe-1"}), Approve(two.id, edited_args={"p": "safe-2"}),
                     Reject(three.id, "no")]
                )  # fmt: skip
        assert len(ran) == 1 + started and all(input in edits.values() for input in ran)
        async with open_session(journal=store, session_id="s", **options) as session:
            assert session.recovery is not None
            [(call_id, action)] = session.recovery.decisions.items()
            assert action is (ToolRecoveryAction.RERUN_SAME_KEY if started else ToolRecoveryAction.RUN)
            assert session.recovery_notes == [f"re-ran write_file call {call_id}: ok"]
            rebuilt = tuple(await read_conversation(store, "s"))
            assert session.messages() == rebuilt
        events = await events_of(store, "s")
    # Both ran once, each with its edit; the one the crash caught again (with its edit only).
    assert sorted(map(str, ran)) == sorted(map(str, [*edits.values(), *([edits[call_id]] if started else [])]))
    assert ran[-1] == edits[call_id]
    assert [e.model_input for e in events if isinstance(e, ToolScheduled) and e.call_id == call_id] == [edits[call_id]]
    assert [e.input for e in events if isinstance(e, ToolStarted) and e.call_id == call_id] == [edits[call_id]] * (
        1 + started
    )
    assert not [e for e in events if isinstance(e, PermissionRequested)]  # the approval answered the re-run's ask
    answers = {m.tool_call_id: m for m in rebuilt if isinstance(m, ToolResultMessage)}
    assert [(m.content, m.is_error) for id, m in answers.items() if id in edits] == [("written", False)] * 2
    [rejected] = [m for id, m in answers.items() if id not in edits]
    assert (rejected.content, rejected.is_error) == ("Error: no", True)
