"""Every await point is a place a cancellation can land: a session request cut at each task step.

One request (the model calls the pure tool ``add``, the tool returns, the model answers
``"done"``) is cut at its k-th task step, for k = 1, 2, ... until it completes uncut, in three
ways: ``session.abort()``, a cancel scope around ``send``, and the session block cancelled from
outside. Then the session is reopened on the same store, and what the journal holds must be
whole: every request ended once, every call settled once (never "outcome unknown" for a pure
tool), every tool call of the rebuilt conversation answered, the tool never run more often than
it was started, and nothing but the documented exception escaped. The memory store commits at
once; the second store commits one scheduling step after each write (as a store with a writer
does), so every journal write is a point to cut at too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import MiddlewareConfig, RequestAbortedError, ToolResult, define_tool, open_session
from trio_agent.journal import AppendBatch, AppendResult, AppendTicket, MemoryStore, read_conversation, stream_id_for
from trio_agent.models import AssistantMessage, ModelRequest, ToolCallPart, ToolResultMessage
from trio_agent.testing import Reply, TestModel

NUMBERS = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ENDINGS = {"RequestCompleted", "RequestFailed", "RequestInterrupted"}
SETTLEMENTS = {"ToolCompleted", "ToolFailed", "ToolCancelled", "ToolOutcomeUnknown"}
MAX_STEPS = 200  # a guard: the longest variant completes uncut after about 25 steps


def respond(request: ModelRequest) -> Reply:
    if isinstance(request.messages[-1], ToolResultMessage):
        return Reply("done")
    return Reply("adding", [("add", {"a": 2, "b": 3})])


async def passthrough(request: Any, call_next: Any) -> Any:
    await trio.lowlevel.checkpoint()
    return await call_next(request)


class CommitsLater:
    """A `MemoryStore` whose commits land one scheduling step after their submission, from a
    writer task in *nursery*; every other call checkpoints first."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.inner = MemoryStore()
        self._send, receive = trio.open_memory_channel[AppendTicket](float("inf"))
        nursery.start_soon(self._writer, receive)

    async def _writer(self, receive: trio.MemoryReceiveChannel[AppendTicket]) -> None:
        async for ticket in receive:
            await trio.lowlevel.checkpoint()
            outcome: AppendResult | BaseException
            try:
                outcome = self.inner.commit(ticket.batch)
            except Exception as exc:
                outcome = exc
            ticket._resolve(outcome)

    def submit(self, batch: AppendBatch) -> AppendTicket:
        ticket = AppendTicket(batch)
        self._send.send_nowait(ticket)
        return ticket

    async def append(self, batch: AppendBatch) -> AppendResult:
        return await self.submit(batch).wait()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name in {"read", "head", "stream_info", "streams", "command", "commands", "load_snapshot"}:

            async def checkpointed(*args: Any, **kwargs: Any) -> Any:
                await trio.lowlevel.checkpoint()
                return await attribute(*args, **kwargs)

            return checkpointed
        return attribute


class CutAt(trio.abc.Instrument):
    """Calls *cut* before the k-th step, while armed, of any task but the excluded ones (the
    request runs in the sender's task and in tasks of the session)."""

    def __init__(self, k: int, cut: Callable[[], None]) -> None:
        self.k = k
        self.cut = cut
        self.steps = 0
        self.armed = False
        self.fired = False
        self.excluded: set[trio.lowlevel.Task] = set()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.armed and not self.fired and task not in self.excluded:
            self.steps += 1
            if self.steps == self.k:
                self.fired = True
                self.cut()


def problems_in(events: list[Any], conversation: list[Any], runs: int) -> list[str]:
    problems: list[str] = []
    ends: dict[str, list[str]] = {}
    calls: dict[str, list[str]] = {}
    for event in events:
        name = type(event).__name__
        if name == "RequestAccepted":
            ends.setdefault(event.request_id, [])
        elif name in ENDINGS:
            ends.setdefault(event.request_id, []).append(name)
        elif name.startswith("Tool") and hasattr(event, "call_id"):
            calls.setdefault(event.call_id, []).append(name)
    problems += [f"request {request} ended {got}" for request, got in ends.items() if len(got) != 1]
    for call, got in calls.items():
        if len([name for name in got if name in SETTLEMENTS]) != 1 or "ToolOutcomeUnknown" in got:
            problems.append(f"call {call}: {got}")
    asked = [
        part.id
        for message in conversation
        if isinstance(message, AssistantMessage)
        for part in message.parts
        if isinstance(part, ToolCallPart)
    ]
    answered = {message.tool_call_id for message in conversation if isinstance(message, ToolResultMessage)}
    problems += [f"tool call {call} unanswered" for call in asked if call not in answered]
    started = sum(type(event).__name__ == "ToolStarted" for event in events)
    if runs > started:
        problems.append(f"the tool ran {runs} times, started {started}")
    return problems


async def cut_once(
    k: int, way: str, store_kind: str, layers: bool
) -> tuple[bool, list[str], list[Any], list[Any], int]:
    """Whether the cut fired, what is wrong, and the evidence: the root's events, the rebuilt
    conversation, how often the tool ran."""
    runs = 0

    @define_tool(side_effect="pure", kind="readonly", input_schema=NUMBERS)
    async def add(input: dict[str, Any], ctx: Any) -> ToolResult:
        """Add two numbers."""
        nonlocal runs
        runs += 1
        await trio.lowlevel.checkpoint()
        return ToolResult.success(str(input["a"] + input["b"]))

    model = TestModel(respond=respond)
    middleware = MiddlewareConfig(tool=[passthrough] * 3) if layers else None
    problems: list[str] = []
    block_scope, send_scope = trio.CancelScope(), trio.CancelScope()
    abort_now = trio.Event()
    cut = {"abort": abort_now.set, "scope": send_scope.cancel, "block": block_scope.cancel}[way]
    instrument = CutAt(k, cut)
    async with trio.open_nursery() as harness:
        store: Any = CommitsLater(harness) if store_kind == "commits_later" else MemoryStore()
        trio.lowlevel.add_instrument(instrument)
        try:
            with block_scope:
                async with (
                    open_session(
                        provider=model, tools=[add], middleware=middleware, journal=store, session_id="s1"
                    ) as session,
                    trio.open_nursery() as nursery,
                ):

                    async def aborter() -> None:
                        instrument.excluded.add(trio.lowlevel.current_task())
                        await abort_now.wait()
                        await session.abort()

                    nursery.start_soon(aborter)
                    await trio.testing.wait_all_tasks_blocked()
                    instrument.armed = True
                    try:
                        with send_scope:
                            answer = await session.send("What is 2 + 3?")
                            if answer != "done":
                                problems.append(f"send answered {answer!r}")
                    except RequestAbortedError:
                        if way != "abort":
                            problems.append("RequestAbortedError without an abort")
                    instrument.armed = False
                    nursery.cancel_scope.cancel()
        finally:
            instrument.armed = False
            trio.lowlevel.remove_instrument(instrument)
        async with open_session(provider=model, tools=[add], middleware=middleware, journal=store, session_id="s1"):
            pass
        reader = store.inner if isinstance(store, CommitsLater) else store
        events = [envelope.event for envelope in await reader.read(stream_id_for("s1", "root"))]
        conversation = await read_conversation(reader, "s1")
        harness.cancel_scope.cancel()
    return instrument.fired, problems + problems_in(events, conversation, runs), events, conversation, runs


@pytest.mark.parametrize("way", ["abort", "scope", "block"])
@pytest.mark.parametrize(
    ("store_kind", "layers"), [("memory", False), ("memory", True), ("commits_later", False), ("commits_later", True)]
)
def test_a_request_cut_at_any_step_leaves_a_whole_journal(way: str, store_kind: str, layers: bool) -> None:
    found: dict[int, list[str]] = {}
    for k in range(1, MAX_STEPS + 1):
        clock = trio.testing.MockClock(autojump_threshold=0)
        fired, problems, *_ = trio.run(cut_once, k, way, store_kind, layers, clock=clock)
        if problems:
            found[k] = problems
        if not fired:
            break
    else:
        pytest.fail(f"the request was still cut after {MAX_STEPS} steps")
    assert k > 3  # the sweep reached into the request (a cut at its first steps only would prove little)
    assert found == {}


def test_the_sweep_s_checks_find_a_journal_that_is_not_whole() -> None:
    # The checks must be able to fail: a whole journal passes, and each planted fault is named.
    clock = trio.testing.MockClock(autojump_threshold=0)
    fired, problems, events, conversation, runs = trio.run(cut_once, MAX_STEPS, "scope", "memory", False, clock=clock)
    assert not fired and problems == [] and runs == 1
    names = [type(event).__name__ for event in events]
    unended = [event for event in events if type(event).__name__ != "RequestCompleted"]
    unsettled = [event for event in events if type(event).__name__ != "ToolCompleted"]
    assert "RequestCompleted" in names and "ToolCompleted" in names
    assert any(problem.startswith("request ") for problem in problems_in(unended, conversation, runs))
    assert any(problem.startswith("call ") for problem in problems_in(unsettled, conversation, runs))
    assert problems_in(events, conversation, runs + 1) == ["the tool ran 2 times, started 1"]
    unanswered = [message for message in conversation if not isinstance(message, ToolResultMessage)]
    assert any("unanswered" in problem for problem in problems_in(events, unanswered, runs))
