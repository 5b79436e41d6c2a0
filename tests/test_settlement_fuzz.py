"""Abort-timing fuzz: every way to cancel, at random moments, against the settlement invariant.

Each trial opens a session on a `MemoryStore` whose clock is Trio's (a
`MockClock` with autojump, so every wait is virtual and a trial takes
milliseconds), runs a request whose model fans out to tools, some running
their own nurseries, some behind a tool middleware with a nursery of its own,
and a foreground subagent; then cancels it one of five ways at a random
moment. The invariant (see docs/design/cancellation.md):

* every scheduled call is settled, every accepted request and every started
  subagent has exactly one outcome, on every stream;
* the stream ends with ``session_closed`` and nothing is open under it;
* a cancellation from outside reaches the caller as ``trio.Cancelled``, never a group;
* the session (and a cancelled subagent) stays usable afterwards;
* after ``SubagentHandle.cancel()``, the subagent's live history answers the same
  calls with the same results as the history rebuilt from the journal.

A few hundred trials run in CI; ``-m stress`` runs 10,000.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    MiddlewareConfig,
    RequestAbortedError,
    SessionClosedError,
    SideEffect,
    SubagentDefinition,
    ToolKind,
    define_tool,
    open_session,
)
from trio_agent.journal import (
    MemoryStore,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    SessionClosed,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolScheduled,
)
from trio_agent.models import ModelRequest, ToolResultMessage, UserMessage
from trio_agent.testing import Reply, open_test_model

OBJECT: dict[str, Any] = {"type": "object"}
SOURCES = ("sdk_abort", "cancel_send", "cancel_session", "cancel_subagent", "start_subagent_deadline")


def _tools() -> list[Any]:
    @define_tool(
        name="fast", description="fast", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def fast(input: dict[str, Any], ctx: Any) -> str:
        return f"fast {input.get('n', 0)}"

    @define_tool(
        name="slow",
        description="sleeps, maybe with a ticker nursery",
        input_schema=OBJECT,
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.READONLY,
        interrupt="block",
    )
    async def slow(input: dict[str, Any], ctx: Any) -> str:
        if input.get("nursery"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                await trio.sleep(float(input.get("t", 1)))
                nursery.cancel_scope.cancel()
        else:
            await trio.sleep(float(input.get("t", 1)))
        return f"slow {input.get('t')}"

    @define_tool(
        name="stoppable",
        description="sleeps; cancelled by steering",
        input_schema=OBJECT,
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
        interrupt="cancel",
    )
    async def stoppable(input: dict[str, Any], ctx: Any) -> str:
        await trio.sleep(float(input.get("t", 1)))
        return "stoppable done"

    return [fast, slow, stoppable]


async def ticker_middleware(request: Any, call_next: Any) -> Any:
    """A tool middleware running a ticker in a nursery of its own around the call."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        result = await call_next()
        nursery.cancel_scope.cancel()
    return result


def _responder(rng: random.Random, *, delegate: bool) -> Callable[[ModelRequest], Reply]:
    def respond(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        latency = rng.choice([0.0, 0.1, 0.5, 1.0])
        if isinstance(last, ToolResultMessage):
            return Reply(text="done", latency=latency)
        calls: list[tuple[str, Any]] = []
        for n in range(rng.randint(1, 4)):
            kind = rng.choice(["fast", "slow", "slow", "stoppable"])
            calls.append((kind, {"n": n, "t": rng.choice([0.2, 0.7, 1.5, 3.0]), "nursery": rng.random() < 0.5}))
        is_root = any(isinstance(m, UserMessage) and m.content.startswith("go") for m in request.messages)
        if delegate and is_root and rng.random() < 0.5:
            calls.append(("task", {"subagent": "helper", "prompt": "sub job"}))
        return Reply(tool_calls=calls, latency=latency)

    return respond


def check_journal(store: MemoryStore, *, session_closed: bool) -> None:
    """The settlement invariant on every stream of the store."""
    for stream_id, stream in store._streams.items():
        events = [envelope.event for envelope in stream.rows]
        scheduled = [e.call_id for e in events if isinstance(e, ToolScheduled)]
        settled = [
            e.call_id for e in events if isinstance(e, ToolCompleted | ToolFailed | ToolCancelled | ToolOutcomeUnknown)
        ]
        assert sorted(scheduled) == sorted(settled), f"{stream_id}: unsettled calls {set(scheduled) - set(settled)}"
        accepted = [e.request_id for e in events if isinstance(e, RequestAccepted)]
        ended = [e.request_id for e in events if isinstance(e, RequestCompleted | RequestFailed | RequestInterrupted)]
        assert sorted(accepted) == sorted(ended), f"{stream_id}: requests without one outcome"
        started = [e.subagent_id for e in events if isinstance(e, SubagentStarted)]
        outcomes = [e.subagent_id for e in events if isinstance(e, SubagentCompleted | SubagentCancelled)]
        assert sorted(started) == sorted(outcomes), f"{stream_id}: subagents without one outcome"
        if session_closed:
            assert isinstance(events[-1], SessionClosed), f"{stream_id}: ends with {events[-1]!r}"
            assert sum(isinstance(e, SessionClosed) for e in events) == 1


def _answers(history: list[Any]) -> dict[str, tuple[str, bool]]:
    return {m.tool_call_id: (m.content, m.is_error) for m in history if isinstance(m, ToolResultMessage)}


async def run_trial(seed: int) -> None:
    rng = random.Random(seed)
    source = SOURCES[seed % len(SOURCES)]
    store = MemoryStore(clock=trio.current_time)
    helper = SubagentDefinition("helper", "helps", "You help.", tools=("fast", "slow", "stoppable"))
    middleware = MiddlewareConfig(tool=[ticker_middleware]) if rng.random() < 0.5 else None
    moment = rng.uniform(0.0, 4.0)
    outside_cancels: list[BaseException] = []
    session_cancelled = False
    async with open_test_model(respond=_responder(rng, delegate=source != "cancel_subagent")) as model:
        with trio.CancelScope() as session_scope:
            try:
                async with open_session(
                    provider=model,
                    tools=_tools(),
                    journal=store,
                    subagents=[helper],
                    middleware=middleware,
                    lease_ttl=1e6,
                ) as session:
                    if source == "sdk_abort":
                        async with trio.open_nursery() as nursery:

                            async def abort_later() -> None:
                                await trio.sleep(moment)
                                await session.abort()

                            nursery.start_soon(abort_later)
                            with contextlib.suppress(RequestAbortedError):
                                await session.send("go")
                            nursery.cancel_scope.cancel()
                    elif source == "cancel_send":
                        with trio.move_on_after(moment):
                            try:
                                await session.send("go")
                            except trio.Cancelled as exc:
                                outside_cancels.append(exc)
                                raise
                    elif source == "cancel_session":
                        session_nursery = session._nursery
                        assert session_nursery is not None

                        async def cancel_later() -> None:
                            await trio.sleep(moment)
                            session_scope.cancel()

                        session_nursery.start_soon(cancel_later)
                        await session.send("go")
                        await trio.sleep_forever()
                    elif source == "cancel_subagent":
                        handle = await session.start_subagent("helper", "sub job")
                        await trio.sleep(moment)
                        handle.cancel()
                        await handle.wait()
                        live = _answers(handle.agent.history)
                        rebuilt = _answers(await session._rebuild_history(handle.id))
                        assert live == rebuilt
                        handle.resume("sub job again")
                        await handle.wait()
                    else:
                        with trio.move_on_after(moment):
                            handle = await session.start_subagent("helper", "sub job")
                            await handle.wait()
                    if source != "cancel_session":
                        # The session stays usable.
                        assert isinstance(await session.send("go again"), str)
            except trio.Cancelled:
                session_cancelled = True
                raise
            except SessionClosedError:
                pass
    if source == "cancel_session":
        assert session_scope.cancelled_caught or not session_cancelled
    check_journal(store, session_closed=True)
    for exc in outside_cancels:
        assert isinstance(exc, trio.Cancelled)


CI_TRIALS = 250


@pytest.mark.parametrize("block", range(5))
async def test_settlement_holds_under_every_cancellation(block: int, autojump_clock: trio.testing.MockClock) -> None:
    for seed in range(block * CI_TRIALS // 5, (block + 1) * CI_TRIALS // 5):
        try:
            await run_trial(seed)
        except BaseException as exc:
            raise AssertionError(f"trial seed={seed} ({SOURCES[seed % len(SOURCES)]}) failed: {exc!r}") from exc


@pytest.mark.stress
@pytest.mark.parametrize("block", range(40))
async def test_settlement_fuzz_long(block: int, autojump_clock: trio.testing.MockClock) -> None:
    for seed in range(10_000 + block * 250, 10_000 + (block + 1) * 250):
        try:
            await run_trial(seed)
        except BaseException as exc:
            raise AssertionError(f"trial seed={seed} ({SOURCES[seed % len(SOURCES)]}) failed: {exc!r}") from exc
