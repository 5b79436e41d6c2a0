"""Durable requests: what is committed before what, failed writes, subscriptions, and recovery after kill -9.

SQLite journals are opened by path (the session owns the store) and read back
through a fresh store after the session closed, so "durable" means "on disk".
The crash test runs a real worker process (``tests/session_crash/worker.py``),
SIGKILLs it while two tool calls are running and reopens the session here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from session_crash.worker import PROMPT, make_tools, read_ledger

from trio_agent import (
    ConfigError,
    DoneEvent,
    LeaseLostError,
    RequestAbortedError,
    SideEffect,
    ToolErrorType,
    ToolResult,
    ToolResultEvent,
    ToolUseEvent,
    TrioAgentError,
    define_tool,
    open_session,
)
from trio_agent.journal import (
    CaughtUp,
    DurableEvent,
    JournalCursor,
    MemoryStore,
    ModelAttemptStarted,
    OutcomeUnknownReason,
    RecoveryDecision,
    RequestAccepted,
    RequestCompleted,
    RequestInterrupted,
    RequestInterruptReason,
    SessionClosed,
    ToolCompleted,
    ToolOutcomeUnknown,
    ToolRecoveryAction,
    ToolStarted,
    TurnAborted,
    TurnAbortReason,
    TurnStarted,
    open_journal,
    open_sqlite_store,
)
from trio_agent.models import (
    AssistantMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolResultMessage,
    UserMessage,
)
from trio_agent.testing import FaultyStore, Reply, TestModel
from trio_agent.tools import SettlementError

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "session_crash" / "worker.py"
OBJECT: dict[str, Any] = {"type": "object"}


async def stored_events(path: Path, stream_id: str) -> list[Any]:
    """The committed events of one stream, read through a fresh SQLite store."""
    async with open_sqlite_store(path) as store:
        return [envelope.event for envelope in await store.read(stream_id)]


def of_type(events: list[Any], kind: type) -> list[Any]:
    return [event for event in events if isinstance(event, kind)]


class ProbingProvider:
    """Wraps a `TestModel`; awaits ``probe(request)`` right before the model is asked."""

    name = "probing"

    def __init__(self, inner: TestModel, probe: Callable[[ModelRequest], Awaitable[None]]) -> None:
        self.inner = inner
        self.model = inner.model
        self.probe = probe

    def with_model(self, model: str) -> ProbingProvider:
        return ProbingProvider(self.inner.with_model(model), self.probe)

    async def chat(self, request: ModelRequest) -> ModelResponse:  # pragma: no cover - the session streams
        await self.probe(request)
        return await self.inner.chat(request)

    def stream(self, request: ModelRequest) -> AsyncIterator[Any]:
        return self._stream(request)

    async def _stream(self, request: ModelRequest) -> AsyncIterator[Any]:
        await self.probe(request)
        async for chunk in self.inner.stream(request):
            yield chunk


# ---------------------------------------------------------------- what is durable when


async def test_request_accepted_is_durable_before_the_stream_yields(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    model = TestModel({"hello": [Reply(text="hi")]})
    async with open_session(provider=model, journal=path) as session:
        stream_id = session.journal.stream_id()
        async with session.stream("hello") as events:
            # Nothing consumed yet: the acceptance is already committed (read back through the store).
            committed = [e.event for e in await session.journal.store.read(stream_id)]
            accepted = of_type(committed, RequestAccepted)
            assert [e.input for e in accepted] == [{"prompt": "hello"}]
            seen = [event async for event in events]
        assert isinstance(seen[-1], DoneEvent) and seen[-1].request_id == accepted[0].request_id
    on_disk = await stored_events(path, stream_id)
    assert [type(e).__name__ for e in on_disk[-2:]] == ["RequestCompleted", "SessionClosed"]


async def test_a_request_whose_acceptance_cannot_be_written_never_runs() -> None:
    store = FaultyStore(MemoryStore())
    model = TestModel(default=Reply(text="should not run"))
    async with open_session(provider=model, journal=store) as session:
        store.fail_next("before")
        with pytest.raises(TrioAgentError) as caught:
            await session.send("hello")
        assert not isinstance(caught.value, BaseExceptionGroup)
        assert model.requests == []
        committed = [e.event for e in await store.inner.read(session.journal.stream_id())]
        assert of_type(committed, RequestAccepted) == []


async def test_turns_and_model_attempts_are_recorded_before_the_provider_is_called(tmp_path: Path) -> None:
    """A turn and its model attempt are in the journal's projection before the provider is called;
    they are deferred (a crash before the next write asks the model again) and written with the
    next write: the call's start, then the request's end."""

    @define_tool(name="noop", description="n", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def noop(input: dict[str, Any], ctx: Any) -> str:
        return "nothing"

    holder: list[Any] = []
    at_call: list[tuple[int, int]] = []

    async def probe(request: ModelRequest) -> None:
        journal = holder[0].journal
        at_call.append((journal.projection().head, await journal.store.head(journal.stream_id())))

    inner = TestModel({"go": [Reply(tool_calls=[("noop", {})]), Reply(text="done")]})
    path = tmp_path / "j.db"
    async with open_session(provider=ProbingProvider(inner, probe), tools=[noop], journal=path) as session:
        holder.append(session)
        session.set_model("second-model")
        assert await session.send("go") == "done"
        stored = [e.event for e in await session.journal.store.read(session.journal.stream_id())]
    assert len(at_call) == 2
    assert all(projected > written for projected, written in at_call)  # recorded, not written yet
    turns = [index for index, event in enumerate(stored) if isinstance(event, TurnStarted)]
    assert len(turns) == 2
    for turn, index in enumerate(turns, start=1):
        started, attempt = stored[index], stored[index + 1]
        assert isinstance(started, TurnStarted) and started.turn == turn
        assert isinstance(attempt, ModelAttemptStarted) and attempt.turn_id == started.turn_id
        assert attempt.model == "second-model" == inner.requests[turn - 1].model
    # The second call came after the first turn's tool settled.
    assert of_type(stored[: turns[1]], ToolCompleted) and not of_type(stored[: turns[0]], ToolCompleted)


async def test_request_interrupted_is_durable_before_abort_returns(tmp_path: Path) -> None:
    started = trio.Event()

    @define_tool(name="wait", description="w", input_schema=OBJECT, side_effect=SideEffect.IDEMPOTENT, kind="readonly")
    async def wait(input: dict[str, Any], ctx: Any) -> str:
        started.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    path = tmp_path / "j.db"
    model = TestModel({"go": [Reply(tool_calls=[("wait", {})])]})
    async with open_session(provider=model, tools=[wait], journal=path) as session:
        stream_id = session.journal.stream_id()
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                with pytest.raises(RequestAbortedError):
                    await session.send("go")

            nursery.start_soon(run)
            await started.wait()
            await session.abort()
            committed = [e.event for e in await session.journal.store.read(stream_id)]
            assert [e.reason for e in of_type(committed, RequestInterrupted)] == [RequestInterruptReason.USER_ABORT]
            assert [e.reason for e in of_type(committed, TurnAborted)] == [TurnAbortReason.REQUEST_INTERRUPTED]
            assert [type(e).__name__ for e in committed if "Tool" in type(e).__name__][-1] == "ToolCancelled"
    on_disk = await stored_events(path, stream_id)
    assert of_type(on_disk, RequestInterrupted)


# ---------------------------------------------------------------- failed writes


def settlement_breaking_tool(store: FaultyStore) -> Any:
    @define_tool(name="pay", description="p", input_schema=OBJECT, side_effect=SideEffect.IDEMPOTENT, kind="readonly")
    async def pay(input: dict[str, Any], ctx: Any) -> str:
        store.fail_next("before")  # the next write is this call's settlement
        return "paid"

    return pay


async def test_a_failed_settlement_publishes_nothing_and_fails_the_request() -> None:
    store = FaultyStore(MemoryStore())
    model = TestModel({"pay": [Reply(tool_calls=[("pay", {})]), Reply(text="must not be reached")]})
    seen: list[Any] = []
    async with open_session(provider=model, tools=[settlement_breaking_tool(store)], journal=store) as session:
        with pytest.raises(TrioAgentError) as caught:
            async with session.stream("pay") as events:
                async for event in events:
                    seen.append(event)
        assert not isinstance(caught.value, BaseExceptionGroup)
        stream_id = session.journal.stream_id()
    assert store.failed == 1
    assert any(isinstance(e, ToolUseEvent) for e in seen)
    assert not any(isinstance(e, ToolResultEvent) for e in seen)  # nothing was published
    assert len(model.requests) == 1  # the model never saw a result
    committed = [e.event for e in await store.inner.read(stream_id)]
    assert of_type(committed, ToolStarted) and not of_type(committed, ToolCompleted)


async def test_a_failed_settlement_fails_the_request_with_settlement_error() -> None:
    store = FaultyStore(MemoryStore())
    model = TestModel({"pay": [Reply(tool_calls=[("pay", {})]), Reply(text="must not be reached")]})
    async with open_session(provider=model, tools=[settlement_breaking_tool(store)], journal=store) as session:
        with pytest.raises(SettlementError):
            await session.send("pay")


async def test_a_tool_fenced_out_after_a_takeover_ends_the_session_with_lease_lost_error() -> None:
    store = MemoryStore(clock=trio.current_time)
    sessions: list[Any] = []

    @define_tool(name="fenced", description="f", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def fenced(input: dict[str, Any], ctx: Any) -> str:
        # Another process took the session over; the downstream saw its newer fencing token.
        session = sessions[0]
        await store.release_lease(session.journal.lease)
        await store.acquire_lease(session.session_id, "another-owner", 60.0)
        raise LeaseLostError("the downstream service saw a newer fencing token")

    model = TestModel({"go": [Reply(tool_calls=[("fenced", {})]), Reply(text="must not be reached")]})
    with pytest.raises(LeaseLostError):
        async with open_session(provider=model, tools=[fenced], journal=store) as session:
            sessions.append(session)
            await session.send("go")
    assert len(model.requests) == 1


async def test_a_lease_lost_error_a_tool_raises_about_another_store_fails_only_that_call() -> None:
    @define_tool(name="nested", description="n", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def nested(input: dict[str, Any], ctx: Any) -> str:
        raise LeaseLostError("the lease of the nested session's own store was lost")

    model = TestModel({"go": [Reply(tool_calls=[("nested", {})]), Reply(text="went on")]})
    async with open_session(provider=model, tools=[nested]) as session:
        assert await session.send("go") == "went on"
    answer = model.requests[-1].messages[-1]
    assert isinstance(answer, ToolResultMessage) and answer.is_error
    assert "nested session's own store" in answer.content


async def test_losing_the_lease_ends_the_session_with_lease_lost_error(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(clock=trio.current_time)
    started = trio.Event()
    cancelled: list[str] = []

    @define_tool(name="wait", description="w", input_schema=OBJECT, side_effect=SideEffect.IDEMPOTENT, kind="readonly")
    async def wait(input: dict[str, Any], ctx: Any) -> str:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.append("wait")
        raise AssertionError("unreachable")  # pragma: no cover

    model = TestModel({"go": [Reply(tool_calls=[("wait", {})])]})
    with pytest.raises(LeaseLostError) as caught:
        async with open_session(provider=model, tools=[wait], journal=store, lease_ttl=3.0) as session:
            stream_id = session.journal.stream_id()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.send, "go")
                await started.wait()
                head = await store.head(stream_id)
                # Another process takes the session over.
                await store.release_lease(session.journal.lease)
                await store.acquire_lease(session.session_id, "another-owner", 60.0)
                await trio.sleep_forever()
    assert type(caught.value) is LeaseLostError
    assert cancelled == ["wait"]
    # The fenced-out owner wrote nothing after the takeover (not even session_closed).
    assert await store.head(stream_id) == head


# ---------------------------------------------------------------- subscriptions


async def test_subscribe_durable_events_replays_then_goes_live() -> None:
    model = TestModel(default=Reply(text="answer"))
    async with open_session(provider=model) as session:
        await session.send("first")
        replayed: list[Any] = []
        live: list[Any] = []
        async with session.subscribe_durable_events(after=0) as subscription:
            async for item in subscription:
                if isinstance(item, CaughtUp):
                    caught_up = item.cursor
                    break
                replayed.append(item)
            assert [type(e.envelope.event).__name__ for e in replayed][:2] == ["SessionCreated", "RequestAccepted"]
            assert [e.envelope.seq for e in replayed] == list(range(1, len(replayed) + 1))
            assert caught_up.seq == len(replayed)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.send, "second")
                async for item in subscription:
                    assert isinstance(item, DurableEvent)
                    live.append(item)
                    if isinstance(item.envelope.event, RequestCompleted):
                        break
        assert live[0].envelope.seq == caught_up.seq + 1
        assert isinstance(live[0].envelope.event, RequestAccepted)
        assert live[0].envelope.event.input == {"prompt": "second"}
        # Resuming after a cursor (its string form) replays exactly what followed it.
        middle = replayed[3]
        async with session.subscribe_durable_events(after=str(middle.cursor)) as resumed:
            first = await resumed.__anext__()
        assert isinstance(first, DurableEvent) and first.envelope.seq == middle.envelope.seq + 1
        assert JournalCursor.parse(str(middle.cursor)) == middle.cursor


async def test_a_subscription_ends_with_session_closed(tmp_path: Path) -> None:
    model = TestModel(default=Reply(text="answer"))
    seen: list[Any] = []
    async with trio.open_nursery() as nursery, open_session(provider=model, journal=tmp_path / "j.db") as session:
        ready = trio.Event()

        async def follow() -> None:
            async with session.subscribe_durable_events() as subscription:
                async for item in subscription:
                    seen.append(item)
                    if isinstance(item, CaughtUp):
                        ready.set()

        nursery.start_soon(follow)
        await ready.wait()
        await session.send("hello")
    events = [item.envelope.event for item in seen if isinstance(item, DurableEvent)]
    assert isinstance(events[-1], SessionClosed)
    assert of_type(events, RequestCompleted)


async def test_a_subscriber_that_reads_only_after_the_session_closed_gets_every_event(tmp_path: Path) -> None:
    # The session owns its SQLite store and closes it on the way out: a subscriber that did not run
    # until then must still read everything up to session_closed (it used to end at its last read).
    model = TestModel(default=Reply(text="answer"))
    seen: list[Any] = []
    go = trio.Event()
    async with trio.open_nursery() as nursery:
        async with open_session(provider=model, journal=tmp_path / "j.db") as session:
            ready = trio.Event()

            async def follow() -> None:
                async with session.subscribe_durable_events() as subscription:
                    async for item in subscription:
                        seen.append(item)
                        if isinstance(item, CaughtUp):
                            ready.set()
                            await go.wait()  # held back until the session (and its store) closed

            nursery.start_soon(follow)
            await ready.wait()
            await session.send("hello")
        go.set()
    events = [item.envelope.event for item in seen if isinstance(item, DurableEvent)]
    assert isinstance(events[-1], SessionClosed)
    assert of_type(events, RequestCompleted)
    seqs = [item.envelope.seq for item in seen if isinstance(item, DurableEvent)]
    assert seqs == list(range(1, len(seqs) + 1))  # nothing twice, nothing skipped


# ---------------------------------------------------------------- history after a restart


async def crash_then_reopen(
    model: TestModel, tools: list[Any], run: Callable[[Any], Awaitable[None]], follow_up: str
) -> tuple[list[Any], list[Any]]:
    """Run ``run(session)``, "crash" (fence the journal so nothing more is written, not even
    session_closed), reopen the same session and send ``follow_up``; return the model's messages
    of the last request before the crash and of the follow-up."""
    inner = MemoryStore()
    store = FaultyStore(inner)
    async with open_session(provider=model, tools=tools, journal=store, session_id="restarted") as session:
        await run(session)
        before = list(model.requests[-1].messages)
        store.fail_next("before")
        with pytest.raises(TrioAgentError):
            await session.send("this write fails: the process is as good as dead")
    assert not of_type([e.event for e in await inner.read("restarted/root")], SessionClosed)
    async with open_session(provider=model, tools=tools, journal=inner, session_id="restarted") as session:
        await session.send(follow_up)
        after = list(model.requests[-1].messages)
    return before, after


def conversation(messages: list[Any]) -> list[Any]:
    """What the model saw of the conversation (without the follow-up prompt and its system message)."""
    return [m for m in messages if isinstance(m, UserMessage | AssistantMessage | ToolResultMessage)]


async def test_history_after_a_restart_is_rebuilt_from_the_journal() -> None:
    @define_tool(name="look", description="l", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def look(input: dict[str, Any], ctx: Any) -> str:
        return f"saw {input['what']}"

    model = TestModel(
        {"start": [Reply(text="looking", tool_calls=[("look", {"what": "a"})]), Reply(text="seen"), Reply(text="ok")]}
    )

    async def run(session: Any) -> None:
        assert await session.send("start") == "seen"

    before, after = await crash_then_reopen(model, [look], run, "and now?")
    assert after[-1] == UserMessage("and now?")
    assert conversation(after[:-2]) == conversation(before)
    assert after[-2] == AssistantMessage((TextPart("seen"),))


async def test_history_after_a_restart_keeps_results_in_call_order() -> None:
    gates = [trio.Event(), trio.Event()]
    gates[1].set()

    @define_tool(name="step", description="s", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def step(input: dict[str, Any], ctx: Any) -> str:
        index = int(input["i"])
        await gates[index].wait()
        gates[0].set()
        return f"r{index}"

    model = TestModel(
        {"start": [Reply(tool_calls=[("step", {"i": 0}), ("step", {"i": 1})]), Reply(text="x"), Reply(text="ok")]}
    )

    async def run(session: Any) -> None:
        await session.send("start")

    before, after = await crash_then_reopen(model, [step], run, "again")
    assert [m.content for m in before if isinstance(m, ToolResultMessage)] == ["r0", "r1"]
    assert [m.content for m in after if isinstance(m, ToolResultMessage)] == ["r0", "r1"]


async def test_history_after_a_restart_keeps_the_errors_of_rejected_calls() -> None:
    @define_tool(name="look", description="l", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def look(input: dict[str, Any], ctx: Any) -> str:
        return "looked"

    model = TestModel(
        {"start": [Reply(tool_calls=[("look", "{bad"), ("nope", {}), ("look", {})]), Reply(text="x"), Reply(text="y")]}
    )

    async def run(session: Any) -> None:
        await session.send("start")

    before, after = await crash_then_reopen(model, [look], run, "again")
    assert [r.content for r in before if isinstance(r, ToolResultMessage)][2] == "looked"
    assert [r.content for r in after if isinstance(r, ToolResultMessage)] == [
        r.content for r in before if isinstance(r, ToolResultMessage)
    ]


async def test_history_after_a_restart_keeps_joined_messages(autojump_clock: trio.testing.MockClock) -> None:
    started, release = trio.Event(), trio.Event()

    @define_tool(name="slow", description="s", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def slow(input: dict[str, Any], ctx: Any) -> str:
        started.set()
        await release.wait()
        return "slow done"

    model = TestModel({"start": [Reply(tool_calls=[("slow", {})]), Reply(text="both handled"), Reply(text="ok")]})

    async def run(session: Any) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.send, "start")
            await started.wait()
            nursery.start_soon(functools.partial(session.send, "joined message", priority="next"))
            await trio.testing.wait_all_tasks_blocked()
            release.set()

    before, after = await crash_then_reopen(model, [slow], run, "again")
    assert UserMessage("joined message") in before
    assert UserMessage("joined message") in after


# ---------------------------------------------------------------- recovery after kill -9


async def start_worker(journal: Path, ledger: Path, session_id: str, stderr: Any) -> trio.Process:
    return await trio.lowlevel.open_process(
        [sys.executable, str(WORKER), str(journal), str(ledger), session_id],
        stdout=subprocess.PIPE,
        stderr=stderr,
        cwd=str(ROOT),
    )


async def read_until(process: trio.Process, marker: bytes) -> bytes:
    assert process.stdout is not None
    data = b""
    while marker not in data:
        chunk = await process.stdout.receive_some(4096)
        if not chunk:
            raise AssertionError(f"the worker exited (rc={process.poll()}) before printing {marker!r}: {data!r}")
        data += chunk
    return data


async def test_recovery_after_kill_9_mid_request(tmp_path: Path) -> None:
    journal, ledger, session_id = tmp_path / "j.db", tmp_path / "ledger.txt", "crash-session"
    with open(tmp_path / "worker.err", "wb") as stderr:  # noqa: ASYNC230 - a file descriptor for the child
        process = await start_worker(journal, ledger, session_id, stderr)
        try:
            with trio.fail_after(60):
                await read_until(process, b"READY\n")
        finally:
            process.send_signal(signal.SIGKILL)
            await process.wait()
    assert process.returncode == -signal.SIGKILL, (tmp_path / "worker.err").read_text()

    # Both side effects happened exactly once before the crash.
    before = read_ledger(str(ledger))
    assert sorted(tool for tool, _key, _input in before) == ["charge", "upsert"]
    keys = {tool: key for tool, key, _input in before}

    model = TestModel(default=Reply(text="recovered answer"))
    with trio.fail_after(60):
        async with open_session(
            provider=model,
            tools=make_tools(str(ledger), block=False),
            journal=journal,
            session_id=session_id,
            takeover_timeout=30.0,
            permission_mode="bypass",
        ) as session:
            report = session.recovery
            assert report is not None
            calls = {call.tool_name: call for call in report.plan.items if call.tool_name is not None}
            charge_id, upsert_id = calls["charge"].call_id, calls["upsert"].call_id
            assert isinstance(charge_id, str) and isinstance(upsert_id, str)
            assert report.decisions == {
                charge_id: ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN,
                upsert_id: ToolRecoveryAction.RERUN_SAME_KEY,
            }
            assert report.outcome_unknown == (charge_id,)
            assert [(c.call_id, c.idempotency_key) for c in report.to_execute] == [(upsert_id, keys["upsert"])]
            # The idempotent call ran again (a new attempt, same key); the non_idempotent one did not.
            after = read_ledger(str(ledger))
            assert after[: len(before)] == before
            assert after[len(before) :] == [("upsert", keys["upsert"], json.dumps({"n": 2}))]
            notes = "\n".join(session.recovery_notes)
            assert charge_id in notes and "NOT run again" in notes and upsert_id in notes

            # The model is told at the next request.
            assert await session.send("what happened?") == "recovered answer"
            messages = list(model.requests[-1].messages)
            stream_id = session.journal.stream_id()
    assert messages[0] == UserMessage(PROMPT)
    # The recovery note reaches the model with the first turn after the restart (recorded with it).
    assert messages[-2] == UserMessage("what happened?")
    assert isinstance(messages[-1], UserMessage) and "recovered after a restart" in messages[-1].content
    results = {m.tool_call_id: m for m in messages if isinstance(m, ToolResultMessage)}
    assert results[charge_id].is_error and "unknown" in results[charge_id].content
    assert (results[upsert_id].is_error, results[upsert_id].content) == (False, "upsert done")
    recovered_note = [m for m in messages if isinstance(m, UserMessage) and "recovered after a restart" in m.content]
    assert len(recovered_note) == 1 and charge_id in recovered_note[0].content
    # The assistant message with both calls precedes both answers.
    assistant = next(m for m in messages if isinstance(m, AssistantMessage))
    assert {p.id for p in assistant.parts if isinstance(p, ToolCallPart)} == {charge_id, upsert_id}
    assert read_ledger(str(ledger)).count(("charge", keys["charge"], json.dumps({"n": 1}))) == 1

    events = await stored_events(journal, stream_id)
    decisions = {e.call_id: e.decision for e in of_type(events, RecoveryDecision)}
    assert decisions == {
        charge_id: ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN,
        upsert_id: ToolRecoveryAction.RERUN_SAME_KEY,
    }
    assert [e.call_id for e in of_type(events, ToolOutcomeUnknown)] == [charge_id]
    assert [e.call_id for e in of_type(events, ToolStarted)].count(upsert_id) == 2  # a new attempt
    assert [e.call_id for e in of_type(events, ToolStarted)].count(charge_id) == 1
    assert [e.call_id for e in of_type(events, ToolCompleted)] == [upsert_id]
    crashed = [e for e in of_type(events, RequestInterrupted) if e.reason is RequestInterruptReason.PROCESS_RESTART]
    assert len(crashed) == 1
    assert [e.reason for e in of_type(events, TurnAborted)] == [TurnAbortReason.PROCESS_RESTART]
    assert len(of_type(events, SessionClosed)) == 1 and isinstance(events[-1], SessionClosed)


# ---------------------------------------------------------------- a reconcile that misbehaves


@contextlib.asynccontextmanager
async def store_of(kind: str, tmp_path: Path) -> AsyncIterator[Any]:
    if kind == "memory":
        yield MemoryStore(clock=trio.current_time)
    else:
        async with open_sqlite_store(tmp_path / "j.db") as store:
            yield store


def pay_tool(
    reconcile: Callable[..., Awaitable[Any]], crash: FaultyStore | None = None, timeout: float | None = None
) -> Any:
    """A non_idempotent tool with *reconcile*; with *crash*, its settlement is never written (the
    process 'dies' after the effect), so the next open finds it started without an outcome."""

    @define_tool(
        name="pay",
        description="p",
        input_schema=OBJECT,
        side_effect=SideEffect.NON_IDEMPOTENT,
        reconcile=reconcile,
        timeout=timeout,
    )
    async def pay(input: dict[str, Any], ctx: Any) -> str:
        if crash is not None:
            crash.fail_next("before")
        return "paid"

    return pay


async def crash_after_pay(store: Any, reconcile: Callable[..., Awaitable[Any]]) -> TestModel:
    model = TestModel({"start": [Reply(tool_calls=[("pay", {"amount": 5})]), Reply(text="again 1"), Reply("again 2")]})
    faulty = FaultyStore(store)
    with pytest.raises(SettlementError):
        async with open_session(
            provider=model, tools=[pay_tool(reconcile, faulty)], journal=faulty, session_id="pay", **ALLOW_PAY
        ) as session:
            await session.send("start")
    return model


ALLOW_PAY: dict[str, Any] = {"permissions": {"allow": ["pay"]}}


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize(
    ("answer", "told"),
    [
        (ValueError("ledger offline"), "raised ValueError('ledger offline')"),
        ({"ok": True}, "returned dict, expected a ToolResult or None"),
        (ToolResult.success({1, 2}), "result.output is not JSON: set"),
        (ToolResult.success("paid", data=math.nan), "result.data is not a finite number: nan"),
        (ToolResult.success("paid", metadata={"seen": b"x"}), "result.metadata.seen is not JSON: bytes"),
        (ToolResult.failure(ToolErrorType.EXECUTION, "no", metadata={1: "x"}), "result.metadata has a non-string key"),
    ],
    ids=["raises", "dict", "set-output", "nan-data", "bytes-metadata", "int-key-metadata"],
)
async def test_a_reconcile_that_raises_or_answers_no_json_result_leaves_the_outcome_unknown(
    kind: str, answer: Any, told: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reconcile hook is the tool's code: when it fails, recovery settles the call
    outcome_unknown (it could not tell), where it failed every reopen of the session."""
    asked: list[dict[str, Any]] = []

    async def reconcile(input: dict[str, Any], key: str) -> Any:
        asked.append(input)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async with store_of(kind, tmp_path) as store:
        model = await crash_after_pay(store, reconcile)
        with caplog.at_level(logging.WARNING, logger="trio_agent.journal"):
            async with open_session(
                provider=model, tools=[pay_tool(reconcile)], journal=store, session_id="pay", **ALLOW_PAY
            ) as session:
                report = session.recovery
                assert report is not None and report.reconciled == ()
                [call_id] = report.outcome_unknown
                assert report.decisions == {call_id: ToolRecoveryAction.RECONCILE}
                assert await session.send("again") == "again 1"
                stream_id = session.journal.stream_id()
        assert asked == [{"amount": 5}]
        [warning] = [r for r in caplog.records if r.levelno == logging.WARNING and "reconcile of pay" in r.message]
        assert call_id in warning.message and told in warning.message
        # The model is told the outcome is unknown, as for a reconcile that returns None.
        note = model.requests[-1].messages[-1]
        assert isinstance(note, UserMessage) and "unknown" in note.content and call_id in note.content
        events = [envelope.event for envelope in await store.read(stream_id)]
        [decision] = of_type(events, RecoveryDecision)
        assert decision.decision is ToolRecoveryAction.RECONCILE and told in decision.reason
        [unknown] = of_type(events, ToolOutcomeUnknown)
        assert (unknown.call_id, unknown.reason) == (call_id, OutcomeUnknownReason.PROCESS_RESTART)
        # Settled now: the next open neither asks again nor fails.
        async with open_session(
            provider=model, tools=[pay_tool(reconcile)], journal=store, session_id="pay", **ALLOW_PAY
        ) as session:
            assert await session.send("and now") == "again 2"
        assert len(asked) == 1


@pytest.mark.parametrize(("tool_timeout", "session_timeout", "waited"), [(5.0, 600.0, 5.0), (None, 42.0, 42.0)])
async def test_a_reconcile_that_never_answers_cannot_tell_within_its_timeout(
    tool_timeout: float | None, session_timeout: float, waited: float, autojump_clock: trio.testing.MockClock
) -> None:
    """A hanging reconcile held the session's open for ever; it is bounded by its tool's
    timeout, else by the session's tool timeout, and then settles the call outcome_unknown."""
    store = MemoryStore(clock=trio.current_time)

    async def reconcile(input: dict[str, Any], key: str) -> ToolResult | None:
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    model = await crash_after_pay(store, reconcile)
    began = trio.current_time()
    async with open_session(
        provider=model,
        tools=[pay_tool(reconcile, timeout=tool_timeout)],
        journal=store,
        session_id="pay",
        tool_timeout=session_timeout,
        **ALLOW_PAY,
    ) as session:
        assert trio.current_time() - began == pytest.approx(waited)
        report = session.recovery
        assert report is not None and len(report.outcome_unknown) == 1
        assert await session.send("again") == "again 1"
    [decision] = of_type([e.event for e in await store.read("pay/root")], RecoveryDecision)
    assert f"did not answer within {waited:g} s" in decision.reason
    assert len(of_type([e.event for e in await store.read("pay/root")], ToolOutcomeUnknown)) == 1


@pytest.mark.parametrize("taken_over", [False, True], ids=["another-store", "own-lease"])
async def test_a_lease_lost_error_from_reconcile_ends_the_open_only_when_the_lease_is_lost(taken_over: bool) -> None:
    store = MemoryStore(clock=trio.current_time)
    journals: list[Any] = []

    async def reconcile(input: dict[str, Any], key: str) -> ToolResult | None:
        if taken_over:
            # Another process took the session over while this one was recovering it.
            await store.release_lease(journals[0].lease)
            await store.acquire_lease("pay", "another-owner", 60.0)
        raise LeaseLostError("the lease of the payment service's own store was lost")

    model = await crash_after_pay(store, reconcile)
    if taken_over:
        with pytest.raises(LeaseLostError):
            async with open_journal(store, session_id="pay") as journal:
                journals.append(journal)
                async with open_session(provider=model, tools=[pay_tool(reconcile)], journal=journal, **ALLOW_PAY):
                    raise AssertionError("unreachable")  # pragma: no cover
        # The fenced-out owner settled nothing.
        assert not of_type([e.event for e in await store.read("pay/root")], RecoveryDecision)
        return
    async with (
        open_journal(store, session_id="pay") as journal,
        open_session(provider=model, tools=[pay_tool(reconcile)], journal=journal, **ALLOW_PAY) as session,
    ):
        report = session.recovery
        assert report is not None and len(report.outcome_unknown) == 1
    [decision] = of_type([e.event for e in await store.read("pay/root")], RecoveryDecision)
    assert "payment service's own store" in decision.reason


async def test_durable_pure_starts_is_an_option_of_open_session(tmp_path: Path) -> None:
    """``durable_pure_starts=False`` reaches the journal the session opens: a pure tool runs
    while its start is still being written, and the start is durable before the settlement."""

    @define_tool(name="look", description="l", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def look(input: dict[str, Any], ctx: Any) -> str:
        pending = holder[0].journal._pending_starts
        seen.append(bool(pending) and not all(ticket.done for ticket in pending.values()))
        return "seen"

    holder: list[Any] = []
    seen: list[bool] = []
    model = TestModel({"go": [Reply(tool_calls=[("look", {})]), Reply(text="done")]})
    path = tmp_path / "j.db"
    async with open_session(provider=model, tools=[look], journal=path, durable_pure_starts=False) as session:
        holder.append(session)
        assert session.journal.durable_pure_starts is False
        assert await session.send("go") == "done"
        stored = [type(e.event) for e in await session.journal.store.read(session.journal.stream_id())]
    assert seen == [True]  # the tool ran before its start was committed
    assert stored.index(ToolStarted) < stored.index(ToolCompleted)
    async with open_journal(MemoryStore()) as open_one:
        with pytest.raises(ConfigError, match="durable_pure_starts"):
            async with open_session(provider=model, journal=open_one, durable_pure_starts=False):
                pass  # pragma: no cover


@pytest.mark.parametrize(
    ("options", "named"),
    [
        pytest.param({"lease_ttl": "30"}, "lease_ttl", id="lease_ttl-str"),
        pytest.param({"lease_ttl": -1}, "lease_ttl", id="lease_ttl-negative"),
        pytest.param({"lease_ttl": 1e9}, "at most", id="lease_ttl-past-every-timer"),  # a database refused it
        pytest.param({"takeover_timeout": "x"}, "takeover_timeout", id="takeover_timeout-str"),
        pytest.param({"takeover_timeout": -5}, "takeover_timeout", id="takeover_timeout-negative"),
        pytest.param({"journal": 123}, "journal must be", id="journal-int"),
    ],
)
async def test_bad_journal_options_are_refused_before_the_sqlite_file_is_made(
    tmp_path: Path, options: dict[str, Any], named: str
) -> None:
    path = tmp_path / "j.db"
    with pytest.raises(ConfigError, match=named):
        async with open_session(provider=TestModel(default=Reply("x")), **{"journal": path, **options}):
            pass  # pragma: no cover
    assert os.listdir(tmp_path) == []


class _BytesPath:
    def __fspath__(self) -> bytes:
        return b"j.db"


class _RaisingPath:
    def __fspath__(self) -> str:
        raise OSError("no path today")


@pytest.mark.parametrize(
    ("journal", "named"),
    [
        pytest.param("a\x00b.db", "holds a NUL character", id="nul"),
        pytest.param("", "is empty", id="empty"),
        pytest.param(_BytesPath(), "must be a file path .*not bytes", id="fspath-bytes"),
        pytest.param(_RaisingPath(), "gave no file path: OSError", id="fspath-raises"),
    ],
)
async def test_a_journal_path_no_file_can_have_is_a_config_error_before_anything_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal: object, named: str
) -> None:
    # A NUL character was a raw ValueError ("embedded null byte") from resolving the path.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"^journal .*{named}"):
        async with open_session(provider=TestModel(default=Reply("x")), journal=journal):  # type: ignore[arg-type]
            pass  # pragma: no cover
    assert os.listdir(tmp_path) == []
