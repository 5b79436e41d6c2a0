"""Bad model output, storage faults and crashes never break a session (the faults issue).

Session-level regression tests: untrusted model replies answered as invalid input
while the session goes on, a stream that always ends, unknown outcomes reported
from the journal after a crash during recovery.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import trio
import trio.testing

from tests.test_journal_durable import GatedStore
from trio_agent import (
    JournalError,
    ModelError,
    RequestAbortedError,
    SideEffect,
    ToolKind,
    TrioAgentError,
    define_tool,
    open_session,
)
from trio_agent.journal import (
    MemoryStore,
    RequestFailed,
    ToolOutcomeUnknown,
)
from trio_agent.models import ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object"}


def echo_tool() -> Any:
    @define_tool(
        name="echo", description="echoes", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def echo(input: dict[str, Any], ctx: Any) -> str:
        return json.dumps(input)[:100]

    return echo


HOSTILE_ARGUMENTS = [
    '{"x": NaN}',
    '{"x": Infinity}',
    '{"x": -Infinity}',
    '{"x": 1e999}',
    '{"x": ' + "1" * 4301 + "}",
    "[" * 990 + "]" * 990,
    '{"a":' * 900 + "1" + "}" * 900,
    '{"x": "\\ud800"}',
    '{"\\udc00": 1}',
    '{"emoji": "\u2028\u2029\u0085 😀", "nul": "a\\u0000b"}',
    '{"big": "' + "x" * 200_000 + '"}',
    '{"n": -0.0, "m": 1e308, "k": 123456789012345678901234567890}',
    "not json",
    "[1, 2]",
    '"a string"',
    "",
    '{"ok": 1}',
]


def hostile_reply(rng: random.Random) -> Reply:
    calls: list[tuple[str, Any]] = []
    for _ in range(rng.randint(1, 5)):
        arguments = rng.choice(HOSTILE_ARGUMENTS)
        calls.append(("echo", arguments))
    return Reply(tool_calls=calls)


async def run_hostile_session(seed: int) -> None:
    rng = random.Random(seed)
    replies = iter([hostile_reply(rng), Reply(text="first done"), hostile_reply(rng), Reply(text="second done")])
    model = TestModel(respond=lambda request: next(replies))
    store = MemoryStore()
    async with open_session(provider=model, tools=[echo_tool()], journal=store) as session:
        assert await session.send("one") == "first done"
        assert await session.send("two") == "second done"
    # Every call the model made got an answer before the next model call.
    for request in model.requests:
        called = [
            part.id
            for m in request.messages
            for part in getattr(m, "parts", ())
            if type(part).__name__ == "ToolCallPart"
        ]
        answered = [m.tool_call_id for m in request.messages if isinstance(m, ToolResultMessage)]
        assert sorted(called) == sorted(answered)
        assert len(set(called)) == len(called)  # unique ids, even when the model repeats them


@pytest.mark.parametrize("seed", range(40))
async def test_hostile_model_replies_are_answered_and_the_session_goes_on(seed: int) -> None:
    await run_hostile_session(seed)


@pytest.mark.stress
@pytest.mark.parametrize("block", range(20))
async def test_hostile_model_replies_long(block: int) -> None:
    for seed in range(1000 + block * 100, 1000 + (block + 1) * 100):
        await run_hostile_session(seed)


async def test_duplicate_call_ids_in_one_reply_each_get_an_answer() -> None:
    replies = iter(
        [
            Reply(tool_calls=[("echo", {"n": 1}), ("echo", {"n": 2})]),
            Reply(text="done"),
        ]
    )

    def respond(request: Any) -> Reply:
        return next(replies)

    model = TestModel(respond=respond)
    async with open_session(provider=model, tools=[echo_tool()]) as session:
        assert await session.send("go") == "done"
    answers = [m for m in model.requests[1].messages if isinstance(m, ToolResultMessage)]
    assert len(answers) == 2


class HangingFailureStore(GatedStore):
    """Holds every batch that records a failed request (a store too slow to record it)."""

    def submit(self, batch: Any) -> Any:
        if any(isinstance(envelope.event, RequestFailed) for envelope in batch.envelopes):
            self.hold = trio.Event()  # never set
            try:
                return super().submit(batch)
            finally:
                self.hold = None
        return super().submit(batch)


async def test_a_stream_ends_even_when_recording_its_failure_overruns(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel(default=Reply(error=ModelError("the model is down", code="DOWN")))
    async with trio.open_nursery() as nursery:
        store = HangingFailureStore(MemoryStore(), nursery)
        async with open_session(provider=model, journal=store, cleanup_grace=2) as session:
            with trio.fail_after(60):
                with pytest.raises(TrioAgentError):
                    async with session.stream("hello") as events:
                        async for _ in events:
                            pass
                # The journal could not confirm the write: the next request says why.
                with pytest.raises(JournalError):
                    await session.send("again")
        nursery.cancel_scope.cancel()


def crash_tools(gate: trio.Event, started: list[str]) -> list[Any]:
    @define_tool(
        name="pay",
        description="pays once",
        input_schema=OBJECT,
        side_effect=SideEffect.NON_IDEMPOTENT,
        kind=ToolKind.READONLY,
    )
    async def pay(input: dict[str, Any], ctx: Any) -> str:
        started.append("pay")
        await gate.wait()
        return "paid"

    @define_tool(
        name="fetch",
        description="fetches",
        input_schema=OBJECT,
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.READONLY,
    )
    async def fetch(input: dict[str, Any], ctx: Any) -> str:
        started.append("fetch")
        await gate.wait()
        return "fetched"

    return [pay, fetch]


async def test_an_unknown_outcome_is_still_reported_after_a_crash_during_recovery(tmp_path: Any) -> None:
    path = tmp_path / "j.db"
    model = TestModel(default=Reply(text="ok"), script={"go": [Reply(tool_calls=[("pay", {}), ("fetch", {})])]})
    never, started = trio.Event(), []
    # 1. Both calls start; the process "crashes" (the journal is fenced) while they run.
    async with (
        open_session(provider=model, tools=crash_tools(never, started), journal=path, session_id="c") as s,
        trio.open_nursery() as nursery,
    ):

        async def send() -> None:
            with pytest.raises((RequestAbortedError, JournalError)):
                await s.send("go")

        nursery.start_soon(send)
        while len(started) < 2:
            await trio.testing.wait_all_tasks_blocked()
        s.journal._fence("test: crash")
        nursery.cancel_scope.cancel()
    # 2. Recovery settles `pay` outcome_unknown, then dies while re-running `fetch`.
    crashing: list[str] = []

    @define_tool(
        name="fetch",
        description="fetches",
        input_schema=OBJECT,
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.READONLY,
    )
    async def fetch_and_crash(input: dict[str, Any], ctx: Any) -> str:
        crashing.append("fetch")
        holder[0]._fence("test: crash during recovery")
        return "fetched"

    holder: list[Any] = []
    pay = crash_tools(never, [])[0]
    original_execute: Any = None

    from trio_agent._tools._pipeline import ToolPipeline

    original_execute = ToolPipeline.execute

    async def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not holder:
            holder.append(self.journal)
        return await original_execute(self, *args, **kwargs)

    ToolPipeline.execute = execute  # type: ignore[method-assign]
    try:
        with pytest.raises(TrioAgentError):
            async with open_session(provider=model, tools=[pay, fetch_and_crash], journal=path, session_id="c"):
                pass
    finally:
        ToolPipeline.execute = original_execute  # type: ignore[method-assign]
    assert crashing == ["fetch"]
    # 3. The next reopen (where `fetch` re-runs to its end) still tells the user and the model about `pay`.
    released = trio.Event()
    released.set()
    async with open_session(provider=model, tools=crash_tools(released, []), journal=path, session_id="c") as s:
        unknown = s.recovery.outcome_unknown if s.recovery is not None else ()
        events = [e.event for e in await s.journal.store.read(s.journal.stream_id())]
        pay_id = next(e.call_id for e in events if isinstance(e, ToolOutcomeUnknown))
        assert pay_id in unknown
        assert any("pay" in note for note in s.recovery_notes)


async def test_a_call_re_run_before_a_crash_during_recovery_is_still_told() -> None:
    # Recovery re-ran one call to its end, then the process died re-running the other: the next
    # recovery found the first settled and never said it had been re-run (its note was in memory).
    from trio_agent.journal import RecoveryDecision, open_journal

    store = MemoryStore()
    model = TestModel(
        default=Reply(text="ok"),
        script={"go": [Reply(tool_calls=[("fetch", {"n": 1}), ("fetch", {"n": 2})]), Reply(text="we were fetching")]},
    )
    life = ["running"]
    ran: list[int] = []
    journals: list[Any] = []

    @define_tool(
        name="fetch",
        description="fetches",
        input_schema=OBJECT,
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.READONLY,
    )
    async def fetch(input: dict[str, Any], ctx: Any) -> str:
        ran.append(input["n"])
        if life[0] == "running":
            await trio.sleep_forever()
        if life[0] == "recovering" and len(ran) == 4:
            journals[-1]._fence("test: the process dies re-running the second call")
        return "fetched"

    options: dict[str, Any] = {"provider": model, "tools": [fetch]}
    # 1. Both calls start; the process dies while they run.
    async with (
        open_journal(store, session_id="c") as journal,
        open_session(journal=journal, **options) as s,
        trio.open_nursery() as nursery,
    ):

        async def send() -> None:
            with pytest.raises((RequestAbortedError, JournalError)):
                await s.send("go")

        nursery.start_soon(send)
        while len(ran) < 2:
            await trio.testing.wait_all_tasks_blocked()
        journal._fence("test: crash")
        nursery.cancel_scope.cancel()
    # 2. Recovery re-runs one call to its end and dies re-running the other.
    life[0] = "recovering"
    with pytest.raises(TrioAgentError):
        async with open_journal(store, session_id="c") as journal:
            journals.append(journal)
            async with open_session(journal=journal, **options):
                pass  # pragma: no cover - the recovery dies
    assert len(ran) == 4
    events = [e.event for e in await store.read("c/root")]
    assert len([e for e in events if isinstance(e, RecoveryDecision)]) == 2
    # 3. The next recovery re-runs the one left and tells of both re-runs.
    life[0] = "done"
    async with open_session(journal=store, session_id="c", **options) as s:
        notes = list(s.recovery_notes)
        await s.send("where were we?")
    call_ids = {e.call_id for e in events if isinstance(e, RecoveryDecision)}
    after = [envelope.event for envelope in await store.read("c/root")]
    decided = [e.decision.value for e in after if isinstance(e, RecoveryDecision)]
    assert decided == ["rerun_same_key"] * 3  # the second recovery decides the call left as the first did
    assert sorted(notes) == sorted(f"re-ran fetch call {call_id}: ok" for call_id in call_ids)
    told = [m.content for m in model.requests[-1].messages if isinstance(m, UserMessage)]
    assert all(any(note in text for text in told) for note in notes)  # the model learns both
