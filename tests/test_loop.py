"""Loop tests with fake ports (no journal, no session): the rules of `trio_agent/_loop/_rules.py`, one by one.

The ports are fakes kept in lists (a list conversation, a scripted inbox, a recorder that logs its
calls, an event list, an effect list); the model is the deterministic `TestModel` behind a real
`ModelService` (its own retries off, so only the loop retries), and the tools run through a real
`ToolPipeline` with an `InMemoryToolJournal`. Nothing sleeps to synchronise: tools wait on
`trio.Event` s, and the test that needs time uses the autojump clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent._abort import Abort, AbortHandle
from trio_agent._errors import ConfigError, JournalError, ModelError
from trio_agent._loop._context import RetryNotAllowedError, RunContext
from trio_agent._loop._events import (
    ReasoningContent,
    ReasoningEnd,
    ReasoningStart,
    RunError,
    RunEvent,
    RunFinished,
    RunStarted,
    StepFinished,
    StepStarted,
    TextMessageContent,
    TextMessageEnd,
    TextMessageStart,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallProgress,
    ToolCallResult,
    ToolCallStart,
    UsageReported,
)
from trio_agent._loop._hooks import NO_HOOKS, Finished, Lifecycle, ToolOutcome
from trio_agent._loop._ports import RunPorts, RunSpec, TurnRef
from trio_agent._loop._rules import (
    LoopState,
    StopReason,
    combine_strategies,
    max_iterations,
    until_finish_reason,
)
from trio_agent._loop._run import MAX_MODEL_RETRIES, run_agent_loop
from trio_agent._models._assemble import ModelReply
from trio_agent._models._messages import (
    AssistantMessage,
    FinishChunk,
    FinishReason,
    Message,
    ReasoningDelta,
    ReasoningPart,
    StreamChunk,
    TextDelta,
    ToolCallPart,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UsageChunk,
    UserMessage,
)
from trio_agent._models._messages import ToolCallStart as ToolCallStartChunk
from trio_agent._models._service import ModelRequest, ModelService, RetryPolicy
from trio_agent._tools._definition import InterruptBehavior, SideEffect, Tool, ToolKind, define_tool
from trio_agent._tools._journal import InMemoryToolJournal
from trio_agent._tools._pipeline import ToolPipeline
from trio_agent._tools._results import Effect, ToolErrorType, ToolResult
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object"}

# -- fake ports ---------------------------------------------------------------------------------------------


class ListConversation:
    """A `Conversation` over a plain list."""

    def __init__(self, messages: Iterable[Message]) -> None:
        self.history: list[Message] = list(messages)

    def view(self, prefix: tuple[Message, ...]) -> Sequence[Message]:
        return (*prefix, *self.history)

    def extend(self, messages: Iterable[Message]) -> None:
        self.history.extend(messages)

    def call_ids(self) -> Collection[str]:
        return {
            part.id for message in self.history if isinstance(message, AssistantMessage) for part in message.tool_calls
        }

    def answers(self) -> list[ToolResultMessage]:
        return [message for message in self.history if isinstance(message, ToolResultMessage)]

    def calls(self) -> list[ToolCallPart]:
        return [
            part for message in self.history if isinstance(message, AssistantMessage) for part in message.tool_calls
        ]


class ScriptedInbox:
    """An `Inbox` whose input per turn is scripted (``turns[i]`` joins turn i+1); ``add`` queues more."""

    def __init__(self, turns: Sequence[Sequence[str]] = ()) -> None:
        self.turns: deque[list[str]] = deque(list(batch) for batch in turns)
        self.pending: list[str] = []
        self.steering: list[AbortHandle] = []
        self.closed = False
        self.dropped: list[str] = []

    def begin_turn(self) -> tuple[list[str], AbortHandle]:
        scripted = self.turns.popleft() if self.turns else []
        taken, self.pending = [*scripted, *self.pending], []
        handle = AbortHandle()
        self.steering.append(handle)
        return taken, handle

    def has_pending(self) -> bool:
        return bool(self.pending) or bool(self.turns and self.turns[0])

    def add(self, text: str) -> None:
        self.pending.append(text)

    def close(self) -> None:
        self.closed = True
        self.dropped.extend(self.pending)
        self.pending.clear()


@attrs.frozen
class Recorded:
    name: str
    attempt_id: str
    detail: Mapping[str, Any] = attrs.field(factory=dict)


class ListRecorder:
    """A `RunRecorder` that keeps every call in ``calls``; a name in ``fail_on`` raises `JournalError`."""

    def __init__(self, fail_on: Collection[str] = ()) -> None:
        self.calls: list[Recorded] = []
        self.fail_on = set(fail_on)
        self.settled: dict[str, ToolResultMessage] = {}

    async def _record(self, name: str, turn: TurnRef, **detail: Any) -> None:
        await trio.lowlevel.checkpoint()
        if name in self.fail_on:
            raise JournalError(f"injected failure recording {name}")
        self.calls.append(Recorded(name, turn.attempt_id if name != "turn_completed" else turn.turn_id, detail))

    async def model_call_started(self, turn: TurnRef, model: str, *, opens_turn: bool) -> None:
        await self._record("started", turn, opens_turn=opens_turn, model=model)

    async def model_call_completed(
        self, turn: TurnRef, reply: ModelReply, *, inputs: Sequence[str], rejected: Mapping[str, str]
    ) -> None:
        await self._record("completed", turn, inputs=tuple(inputs), rejected=dict(rejected), reply=reply)

    async def model_call_failed(self, turn: TurnRef, error: ModelError) -> None:
        await self._record("failed", turn, code=error.code)

    async def model_call_aborted(self, turn: TurnRef, abort: Abort | None) -> None:
        await self._record("aborted", turn, abort=abort)

    async def turn_completed(self, turn: TurnRef) -> None:
        await self._record("turn_completed", turn)

    async def turn_started(self, turn: TurnRef) -> None:
        await self._record("turn_started", turn)

    async def interrupts_resolved(
        self, paused_run_id: str, run_id: str, answers: Any, answered: Any, approved: Any = ()
    ) -> None:
        await trio.lowlevel.checkpoint()

    def pause_is_open(self, paused_run_id: str) -> bool | None:
        return None

    def settled_answer(self, call_id: str) -> ToolResultMessage | None:
        return self.settled.get(call_id)

    def named(self, name: str) -> list[Recorded]:
        return [call for call in self.calls if call.name == name]

    def attempts(self) -> list[tuple[str, str]]:
        return [(call.name, call.attempt_id) for call in self.calls if call.name != "turn_completed"]


class Fakes:
    """One run's spec and fake ports, kept for inspection."""

    def __init__(
        self,
        replies: Iterable[Reply] | Callable[[ModelRequest], Reply] = (),
        tools: Sequence[Tool[Any]] = (),
        *,
        allowed: Collection[str] | None = None,
        strategy: Callable[[LoopState], bool] | None = None,
        inbox: Sequence[Sequence[str]] = (),
        fail_on: Collection[str] = (),
        instructions: str = "",
    ) -> None:
        if callable(replies):
            self.model = TestModel(respond=replies)
        else:
            self.model = TestModel(default=list(replies))
        self.conversation = ListConversation([UserMessage("go")])
        self.inbox = ScriptedInbox(inbox)
        self.recorder = ListRecorder(fail_on)
        self.events: list[RunEvent] = []
        self.effects: list[tuple[str, str, tuple[Effect, ...]]] = []
        self.watchers: list[Callable[[RunEvent], None]] = []
        self.abort = AbortHandle()
        self.stop = AbortHandle()
        self.pipeline = ToolPipeline(tools, journal=InMemoryToolJournal())
        self.spec = RunSpec(
            run_id="run",
            agent_id="root",
            thread_id="thread",
            instructions=lambda: instructions,
            offered=tuple(ToolSpec(tool.name, tool.description, dict(tool.input_schema)) for tool in tools),
            allowed=frozenset(tool.name for tool in tools) if allowed is None else frozenset(allowed),
            strategy=strategy or max_iterations(10),
        )
        self.ports = RunPorts(
            model=ModelService(self.model, retry=RetryPolicy(max_attempts=1)),
            tools=self.pipeline,
            conversation=self.conversation,
            inbox=self.inbox,
            recorder=self.recorder,
            events=self._event,
            effects=self._effect,
            abort=self.abort,
            stop=self.stop,
        )

    async def _event(self, event: RunEvent) -> None:
        self.events.append(event)
        for watch in self.watchers:
            watch(event)
        await trio.lowlevel.checkpoint()

    async def _effect(self, agent_id: str, call_id: str, effects: Sequence[Effect]) -> None:
        self.effects.append((agent_id, call_id, tuple(effects)))

    async def run(self, hooks: Lifecycle = NO_HOOKS) -> Finished:
        return await run_agent_loop(self.spec, self.ports, hooks)

    def kinds(self) -> list[str]:
        return [type(event).__name__ for event in self.events]

    def results(self) -> dict[str, ToolResult]:
        return {event.call_id: event.result for event in self.events if isinstance(event, ToolCallResult)}


class Hooks(Lifecycle):
    """A lifecycle that logs the hooks it saw; tests override what they need."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.outcomes: list[ToolOutcome] = []

    async def on_tool_phase_complete(self, ctx: Any, outcomes: Sequence[ToolOutcome]) -> None:
        self.outcomes.extend(outcomes)

    async def on_finish(self, ctx: Any, outcome: Finished) -> None:
        self.log.append(("on_finish", outcome.stop_reason))

    async def on_abort(self, ctx: Any, abort: Abort) -> None:
        self.log.append(("on_abort", abort.reason))

    async def on_error(self, ctx: Any, error: BaseException) -> None:
        self.log.append(("on_error", type(error).__name__))

    def terminal(self) -> list[Any]:
        return [entry for entry in self.log if entry[0] in ("on_finish", "on_abort", "on_error")]


# -- tools ---------------------------------------------------------------------------------------------------


def make_tool(
    name: str, run: Callable[[dict[str, Any]], Any], *, interrupt: InterruptBehavior = InterruptBehavior.BLOCK
) -> Tool[Any]:
    async def body(input: dict[str, Any], ctx: Any) -> Any:
        return await run(input)

    return define_tool(
        body,
        name=name,
        description=f"the {name} tool",
        input_schema=OBJECT,
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
        interrupt=interrupt,
    )


class Counter:
    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    async def __call__(self, input: dict[str, Any]) -> Any:
        self.runs.append(input)
        await trio.lowlevel.checkpoint()
        return int(input.get("a", 0)) + int(input.get("b", 0))


def add_tool() -> tuple[Tool[Any], Counter]:
    counter = Counter()
    return make_tool("add", counter), counter


# -- rules after a reply: cut-off, rejected, ordered answers ----------------------------------------------------


async def test_calls_of_a_reply_cut_off_by_its_length_limit_never_run_and_are_answered_max_tokens() -> None:
    add, counter = add_tool()
    cut = Reply(tool_calls=[("add", {"a": 1}), ("add", {"a": 2})], finish_reason=FinishReason.LENGTH)
    fakes = Fakes([cut, Reply("ok")], [add])
    seen: list[str] = []

    class CutOff(Hooks):
        async def on_cut_off_call(self, ctx: Any, call: ToolCallPart, result: ToolResult) -> ToolResult:
            seen.append(call.id)
            return result

    hooks = CutOff()
    finished = await fakes.run(hooks)
    assert counter.runs == []
    calls = fakes.conversation.calls()
    answers = fakes.conversation.answers()
    assert [answer.tool_call_id for answer in answers] == [call.id for call in calls]
    assert all(answer.is_error and "cut off" in answer.content for answer in answers)
    assert all(result.error is not None and result.error.code == "max_tokens" for result in fakes.results().values())
    assert seen == [call.id for call in calls]
    assert [outcome.ran for outcome in hooks.outcomes] == [False, False]
    completed = fakes.recorder.named("completed")[0]
    assert set(completed.detail["rejected"]) == {call.id for call in calls}
    assert finished.stop_reason is StopReason.END_TURN and finished.turns == 2


class ChunkProvider:
    """A provider replying with raw chunk lists (a stream that ends inside a call)."""

    model = "chunks"
    name = "chunks"

    def __init__(self, replies: Iterable[Sequence[StreamChunk]]) -> None:
        self.replies = deque(replies)
        self.requests: list[ModelRequest] = []

    async def chat(self, request: ModelRequest) -> Any:
        raise NotImplementedError

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        chunks = self.replies.popleft()

        async def gen() -> AsyncIterator[StreamChunk]:
            for chunk in chunks:
                await trio.lowlevel.checkpoint()
                yield chunk

        return gen()


async def test_a_call_whose_end_never_arrived_is_cut_off_and_answered_max_tokens() -> None:
    add, counter = add_tool()
    fakes = Fakes([], [add])
    provider = ChunkProvider(
        [
            [ToolCallStartChunk(0, "c1", "add"), FinishChunk(FinishReason.STOP)],
            [TextDelta("fine"), FinishChunk(FinishReason.STOP)],
        ]
    )
    fakes.ports = attrs.evolve(fakes.ports, model=ModelService(provider, retry=RetryPolicy(max_attempts=1)))
    finished = await fakes.run()
    assert counter.runs == []
    (answer,) = fakes.conversation.answers()
    assert answer.is_error and "cut off" in answer.content
    assert fakes.recorder.named("completed")[0].detail["rejected"].keys() == {answer.tool_call_id}
    assert finished.stop_reason is StopReason.END_TURN


async def test_a_reply_without_calls_cut_off_by_its_length_limit_ends_max_tokens() -> None:
    fakes = Fakes([Reply("half an ans", finish_reason=FinishReason.LENGTH)])
    finished = await fakes.run()
    assert finished.stop_reason is StopReason.MAX_TOKENS
    assert finished.text == "half an ans"
    assert fakes.inbox.closed


async def test_unknown_disallowed_and_bad_argument_calls_are_rejected_and_recorded_before_any_call_runs() -> None:
    fakes: Fakes
    rejected_when_ran: list[Collection[str]] = []

    async def probe(input: dict[str, Any]) -> str:
        # The refusals were recorded with the attempt before this (the only valid call) began.
        rejected_when_ran.append(set(fakes.recorder.named("completed")[-1].detail["rejected"]))
        await trio.lowlevel.checkpoint()
        return "probed"

    secret_runs = Counter()
    reply = Reply(
        tool_calls=[
            ("nowhere", {}),
            ("secret", {}),
            ("probe", "not json"),
            ("probe", "[1, 2]"),
            ("probe", {}),
        ]
    )
    fakes = Fakes(
        [reply, Reply("done")],
        [make_tool("probe", probe), make_tool("secret", secret_runs)],
        allowed={"probe"},
    )
    hooks = Hooks()
    await fakes.run(hooks)
    calls = fakes.conversation.calls()
    refused = {call.id for call in calls[:4]}
    completed = fakes.recorder.named("completed")[0]
    assert set(completed.detail["rejected"]) == refused
    assert rejected_when_ran == [refused]
    assert secret_runs.runs == []
    codes = [fakes.results()[call.id].error for call in calls[:4]]
    assert [error.code if error else None for error in codes][:2] == ["unknown_tool", "tool_not_allowed"]
    assert all(error is not None and error.type is ToolErrorType.VALIDATION for error in codes)
    answers = fakes.conversation.answers()
    assert [answer.tool_call_id for answer in answers] == [call.id for call in calls]
    assert [answer.is_error for answer in answers] == [True, True, True, True, False]
    assert "unknown tool 'nowhere'" in answers[0].content and "probe" in answers[0].content
    assert [outcome.ran for outcome in hooks.outcomes] == [False, False, False, False, True]
    # The refused calls are told as such on the stream too: their ToolCallEnd carries the raw text.
    ends = {event.call_id: event.input for event in fakes.events if isinstance(event, ToolCallEnd)}
    assert ends[calls[2].id] == "not json" and ends[calls[4].id] == {}


async def _ordered_run(order: Sequence[int]) -> tuple[list[str], list[str], list[str]]:
    """Calls 0..n-1 of one reply; call ``order[k]`` finishes k-th. Returns (call ids, answer ids, result ids)."""
    gates = [trio.Event() for _ in order]
    rank = {call: position for position, call in enumerate(order)}

    async def step(input: dict[str, Any]) -> int:
        position = rank[int(input["n"])]
        if position > 0:
            await gates[position - 1].wait()
        gates[position].set()
        return int(input["n"])

    fakes = Fakes(
        [Reply(tool_calls=[("step", {"n": n}) for n in range(len(order))]), Reply("done")], [make_tool("step", step)]
    )
    await fakes.run()
    calls = [call.id for call in fakes.conversation.calls()]
    answers = [answer.tool_call_id for answer in fakes.conversation.answers()]
    results = [event.call_id for event in fakes.events if isinstance(event, ToolCallResult)]
    return calls, answers, results


async def test_answers_join_the_history_in_call_order_when_the_last_call_finishes_first() -> None:
    calls, answers, results = await _ordered_run([2, 1, 0])
    assert answers == calls
    assert results == calls[::-1]  # the stream tells them as they settle


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 5).flatmap(lambda n: st.permutations(range(n))))
def test_answers_join_in_call_order_whatever_order_calls_finish(order: list[int]) -> None:
    calls, answers, results = trio.run(_ordered_run, order)
    assert answers == calls
    assert results == [calls[n] for n in order]


async def test_the_journal_s_settled_answer_wins_over_the_live_result() -> None:
    add, _ = add_tool()
    fakes = Fakes(
        lambda request: (
            Reply("done")
            if isinstance(request.messages[-1], ToolResultMessage)
            else Reply(tool_calls=[("add", {"a": 1})])
        ),
        [add],
    )

    def remember(event: RunEvent) -> None:
        if isinstance(event, ToolCallStart):
            fakes.recorder.settled[event.call_id] = ToolResultMessage(event.call_id, "as the journal has it")

    fakes.watchers.append(remember)
    await fakes.run()
    (answer,) = fakes.conversation.answers()
    assert answer.content == "as the journal has it"


# -- after the tool phase ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "denial",
    [
        ToolResult.failure(ToolErrorType.PERMISSION_DENIED, "no", code="stop_loop"),
        ToolResult.failure(ToolErrorType.PERMISSION_DENIED, "no", metadata={"stop_loop": True}),
    ],
    ids=["code", "metadata"],
)
async def test_a_stop_loop_denial_ends_the_run_permission_denied(denial: ToolResult) -> None:
    async def deny(input: dict[str, Any]) -> ToolResult:
        await trio.lowlevel.checkpoint()
        return denial

    class Asked(Hooks):
        async def should_continue(self, ctx: Any, state: LoopState) -> bool:
            self.log.append(("should_continue",))
            return True

    fakes = Fakes([Reply(tool_calls=[("deny", {})]), Reply("never asked")], [make_tool("deny", deny)])
    hooks = Asked()
    finished = await fakes.run(hooks)
    assert finished.stop_reason is StopReason.PERMISSION_DENIED
    assert len(fakes.model.requests) == 1
    assert ("should_continue",) not in hooks.log
    assert hooks.terminal() == [("on_finish", StopReason.PERMISSION_DENIED)]
    assert fakes.inbox.closed
    assert isinstance(fakes.events[-1], RunFinished) and fakes.events[-1].outcome == "permission_denied"


async def test_should_continue_false_ends_the_run_vetoed_with_the_state_so_far() -> None:
    add, counter = add_tool()
    states: list[LoopState] = []

    class Veto(Hooks):
        async def should_continue(self, ctx: Any, state: LoopState) -> bool:
            states.append(state)
            return False

    fakes = Fakes([Reply(tool_calls=[("add", {"a": 1}), ("add", {"b": 2})]), Reply("never")], [add])
    finished = await fakes.run(Veto())
    assert finished.stop_reason is StopReason.VETOED
    assert len(counter.runs) == 2 and len(fakes.model.requests) == 1
    assert states == [LoopState(1, 2, 2, FinishReason.TOOL_CALLS)]
    assert finished.state == states[0]


# -- the inbox and before_stop ----------------------------------------------------------------------------------


async def test_inbox_input_joins_before_the_model_call_and_is_recorded_as_inputs() -> None:
    fakes = Fakes([Reply("first"), Reply("second")], inbox=[["steer one", "steer two"], ["then this"]])
    finished = await fakes.run()
    first, second = fakes.model.requests
    assert list(first.messages) == [UserMessage("go"), UserMessage("steer one"), UserMessage("steer two")]
    # A reply without calls while the inbox holds input: one more turn, the input first.
    assert first.messages[-1] == UserMessage("steer two") and second.messages[-1] == UserMessage("then this")
    inputs = [call.detail["inputs"] for call in fakes.recorder.named("completed")]
    assert inputs == [("steer one", "steer two"), ("then this",)]
    assert finished.stop_reason is StopReason.END_TURN and finished.turns == 2 and finished.text == "second"


async def test_before_stop_returning_a_message_means_one_more_turn() -> None:
    asked: list[LoopState] = []

    class OneMore(Hooks):
        async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
            asked.append(state)
            return "keep going" if len(asked) == 1 else None

    fakes = Fakes([Reply("a"), Reply("b")])
    finished = await fakes.run(OneMore())
    assert finished.stop_reason is StopReason.END_TURN and finished.turns == 2
    assert fakes.model.requests[1].messages[-1] == UserMessage("keep going")
    assert [call.detail["inputs"] for call in fakes.recorder.named("completed")] == [(), ("keep going",)]
    assert [state.iteration for state in asked] == [1, 2]


async def test_a_before_stop_message_past_the_strategy_ends_max_turns_and_is_dropped() -> None:
    class OneMore(Hooks):
        async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
            return "again"

    fakes = Fakes([Reply("a"), Reply("b")], strategy=max_iterations(1))
    finished = await fakes.run(OneMore())
    assert finished.stop_reason is StopReason.MAX_TURNS
    assert len(fakes.model.requests) == 1
    assert fakes.inbox.closed and fakes.inbox.dropped == ["again"]


async def test_a_before_stop_message_is_vetoed_by_should_continue() -> None:
    class OneMoreButNo(Hooks):
        async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
            return "again"

        async def should_continue(self, ctx: Any, state: LoopState) -> bool:
            return False

    fakes = Fakes([Reply("a"), Reply("b")])
    finished = await fakes.run(OneMoreButNo())
    assert len(fakes.model.requests) == 1
    # The rules say a False from should_continue ends the run "vetoed" at every continue.
    assert finished.stop_reason is StopReason.VETOED


# -- strategies -------------------------------------------------------------------------------------------------


def test_strategies_are_pure_functions_of_the_loop_state() -> None:
    state = LoopState()
    assert max_iterations(2)(state) and not max_iterations(2)(LoopState(2))
    stop_on_stop = until_finish_reason("stop")
    assert stop_on_stop(state) and stop_on_stop(LoopState(1, 1, 1, FinishReason.TOOL_CALLS))
    assert not stop_on_stop(LoopState(1, 0, 0, FinishReason.STOP))
    both = combine_strategies(max_iterations(5), lambda s: s.tool_call_count < 3)
    assert both(LoopState(1, 2, 2)) and not both(LoopState(1, 3, 3)) and not both(LoopState(5, 0, 0))
    assert state.after_turn(2, FinishReason.TOOL_CALLS).after_turn(1, FinishReason.STOP) == LoopState(
        2, 3, 1, FinishReason.STOP
    )
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError):
            max_iterations(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("strategy", "turns"),
    [
        (max_iterations(3), 3),
        (until_finish_reason("tool_calls"), 1),
        (combine_strategies(max_iterations(5), lambda state: state.tool_call_count < 4), 2),
        (combine_strategies(max_iterations(1), until_finish_reason("stop")), 1),
    ],
    ids=["max_iterations", "until_finish_reason", "combined-count", "combined-max"],
)
async def test_the_strategy_bounds_the_turns(strategy: Callable[[LoopState], bool], turns: int) -> None:
    add, counter = add_tool()
    fakes = Fakes(lambda request: Reply(tool_calls=[("add", {"a": 1}), ("add", {"a": 2})]), [add], strategy=strategy)
    finished = await fakes.run()
    assert finished.stop_reason is StopReason.MAX_TURNS
    assert finished.turns == turns and len(fakes.model.requests) == turns
    assert len(counter.runs) == 2 * turns
    # Every call of every turn is answered, even when the strategy ends the run after the tool phase.
    assert len(fakes.conversation.answers()) == 2 * turns


# -- abort and stop -----------------------------------------------------------------------------------------------


async def test_an_abort_before_the_run_ends_it_aborted_without_a_model_call() -> None:
    fakes = Fakes([Reply("never")])
    fakes.abort.abort(message="before")
    hooks = Hooks()
    finished = await fakes.run(hooks)
    assert finished.stop_reason is StopReason.ABORTED and finished.turns == 0
    assert fakes.model.requests == []
    assert fakes.kinds() == ["RunStarted", "RunFinished"]
    assert hooks.terminal() == [("on_abort", finished.abort.reason if finished.abort else None)]
    assert fakes.inbox.closed


async def test_an_abort_during_the_model_call_ends_it_aborted_and_records_the_attempt_aborted() -> None:
    fakes: Fakes

    def respond(request: ModelRequest) -> Reply:
        fakes.abort.abort(message="while the model thinks")
        return Reply("an answer nobody reads", latency=1.0)

    fakes = Fakes(respond)
    hooks = Hooks()
    finished = await fakes.run(hooks)
    assert finished.stop_reason is StopReason.ABORTED
    assert fakes.recorder.attempts() == [("started", "run-t1-a1"), ("aborted", "run-t1-a1")]
    assert not any(isinstance(message, AssistantMessage) for message in fakes.conversation.history)
    assert [entry[0] for entry in hooks.terminal()] == ["on_abort"]
    assert isinstance(fakes.events[-1], RunFinished) and fakes.events[-1].outcome == "aborted"


async def test_an_abort_during_tools_ends_it_aborted_with_the_committed_result_answered() -> None:
    quick_done = trio.Event()

    async def quick(input: dict[str, Any]) -> int:
        await trio.lowlevel.checkpoint()
        return 3

    async def hang(input: dict[str, Any]) -> int:
        await quick_done.wait()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    fakes = Fakes(
        [Reply(tool_calls=[("quick", {}), ("hang", {})]), Reply("never")],
        [make_tool("quick", quick), make_tool("hang", hang)],
    )

    def abort_once_quick_is_committed(event: RunEvent) -> None:
        if isinstance(event, ToolCallResult) and event.tool_name == "quick":
            fakes.abort.abort(message="user left")
            quick_done.set()

    fakes.watchers.append(abort_once_quick_is_committed)
    hooks = Hooks()
    finished = await fakes.run(hooks)
    assert finished.stop_reason is StopReason.ABORTED
    quick_answer, hang_answer = fakes.conversation.answers()
    assert [quick_answer.tool_call_id, hang_answer.tool_call_id] == [c.id for c in fakes.conversation.calls()]
    assert quick_answer.content == "3" and not quick_answer.is_error
    assert hang_answer.is_error
    assert len(fakes.model.requests) == 1
    assert [entry[0] for entry in hooks.terminal()] == ["on_abort"]
    assert fakes.recorder.named("turn_completed") == []  # an aborted turn is not completed by the loop


async def test_a_stop_lets_block_tools_finish_and_cancels_cancel_tools() -> None:
    started = {"block": trio.Event(), "cancel": trio.Event()}
    release = trio.Event()

    async def blocker(input: dict[str, Any]) -> str:
        started["block"].set()
        await release.wait()
        return "finished anyway"

    async def canceller(input: dict[str, Any]) -> str:
        started["cancel"].set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    fakes = Fakes(
        [Reply(tool_calls=[("blocker", {}), ("canceller", {})]), Reply("never")],
        [
            make_tool("blocker", blocker, interrupt=InterruptBehavior.BLOCK),
            make_tool("canceller", canceller, interrupt=InterruptBehavior.CANCEL),
        ],
    )
    outcome: list[Finished] = []

    async def run() -> None:
        outcome.append(await fakes.run())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await started["block"].wait()
        await started["cancel"].wait()
        fakes.stop.abort(message="finish what runs, then stop")
        release.set()
    (finished,) = outcome
    assert finished.stop_reason is StopReason.ABORTED
    block_answer, cancel_answer = fakes.conversation.answers()
    assert block_answer.content == "finished anyway" and not block_answer.is_error
    assert cancel_answer.is_error
    cancelled = fakes.results()[cancel_answer.tool_call_id]
    assert cancelled.error is not None and cancelled.error.type is ToolErrorType.INTERRUPTED
    assert len(fakes.model.requests) == 1
    assert not fakes.abort.aborted  # a stop is not an SDK abort


# -- exactly one terminal hook ----------------------------------------------------------------------------------


def _finishing() -> Fakes:
    return Fakes([Reply("fine")])


def _aborting() -> Fakes:
    fakes = Fakes([Reply("never")])
    fakes.abort.abort()
    return fakes


def _model_failing() -> Fakes:
    return Fakes([Reply(error=ModelError("the model broke", code="BROKEN", retryable=False))])


def _journal_failing() -> Fakes:
    return Fakes([Reply("fine")], fail_on={"completed"})


@pytest.mark.parametrize(
    ("make", "terminal", "last"),
    [
        (_finishing, "on_finish", RunFinished),
        (_aborting, "on_abort", RunFinished),
        (_model_failing, "on_error", RunError),
        (_journal_failing, "on_error", RunError),
    ],
    ids=["finished", "aborted", "model-error", "journal-error"],
)
async def test_exactly_one_terminal_hook_runs(make: Callable[[], Fakes], terminal: str, last: type) -> None:
    fakes = make()
    hooks = Hooks()
    try:
        await fakes.run(hooks)
    except (ModelError, JournalError) as exc:
        assert terminal == "on_error"
        assert hooks.terminal() == [("on_error", type(exc).__name__)]
    else:
        assert terminal != "on_error"
    (entry,) = hooks.terminal()
    assert entry[0] == terminal
    assert isinstance(fakes.events[-1], last)
    assert sum(isinstance(event, (RunFinished, RunError)) for event in fakes.events) == 1


async def test_a_journal_error_from_the_recorder_fails_the_run() -> None:
    fakes = Fakes([Reply("fine")], fail_on={"started"})
    hooks = Hooks()
    with pytest.raises(JournalError, match="injected"):
        await fakes.run(hooks)
    assert hooks.terminal() == [("on_error", "JournalError")]
    assert fakes.model.requests == []
    assert isinstance(fakes.events[-1], RunError)


# -- model retries ------------------------------------------------------------------------------------------------


def _flaky(code: str = "FLAKY") -> Reply:
    return Reply(error=ModelError("try again", code=code, retryable=False))


class Retrying(Hooks):
    def __init__(self, *, via: str = "ctx") -> None:
        super().__init__()
        self.via = via
        self.errors: list[str | None] = []

    async def on_model_error(self, ctx: Any, error: ModelError) -> bool:
        self.errors.append(error.code)
        if self.via == "ctx":
            ctx.retry()
            return False
        return True


@pytest.mark.parametrize("via", ["ctx", "return"])
async def test_a_retry_asked_by_on_model_error_reruns_the_call_with_a_new_attempt_id(via: str) -> None:
    fakes = Fakes([_flaky(), Reply("second time lucky")])
    hooks = Retrying(via=via)
    finished = await fakes.run(hooks)
    assert finished.stop_reason is StopReason.END_TURN and finished.text == "second time lucky"
    assert hooks.errors == ["FLAKY"]
    assert fakes.recorder.attempts() == [
        ("started", "run-t1-a1"),
        ("failed", "run-t1-a1"),
        ("started", "run-t1-a2"),
        ("completed", "run-t1-a2"),
    ]
    assert [call.detail["opens_turn"] for call in fakes.recorder.named("started")] == [True, False]
    assert finished.turns == 1


async def test_a_model_call_is_retried_at_most_twice() -> None:
    fakes = Fakes([_flaky("F1"), _flaky("F2"), _flaky("F3"), Reply("never reached")])
    hooks = Retrying()
    with pytest.raises(ModelError, match="try again"):
        await fakes.run(hooks)
    assert MAX_MODEL_RETRIES == 2
    assert hooks.errors == ["F1", "F2"]  # the third failure is not offered for a retry
    assert [call.attempt_id for call in fakes.recorder.named("started")] == ["run-t1-a1", "run-t1-a2", "run-t1-a3"]
    assert len(fakes.model.requests) == 3
    assert hooks.terminal() == [("on_error", "ModelError")]


async def test_a_model_call_is_never_retried_after_it_produced_output() -> None:
    broken = Reply("one two three four", fail_after_chunks=2, error=ModelError("cut", code="CUT", retryable=False))
    fakes = Fakes([broken, Reply("never reached")])
    hooks = Retrying()
    with pytest.raises(ModelError, match="cut"):
        await fakes.run(hooks)
    assert hooks.errors == []
    assert fakes.recorder.attempts() == [("started", "run-t1-a1"), ("failed", "run-t1-a1")]
    assert len(fakes.model.requests) == 1


async def test_without_a_hook_asking_a_model_error_fails_the_run() -> None:
    fakes = Fakes([_flaky(), Reply("never reached")])
    hooks = Hooks()
    with pytest.raises(ModelError):
        await fakes.run(hooks)
    assert len(fakes.model.requests) == 1
    assert hooks.terminal() == [("on_error", "ModelError")]


async def test_ctx_retry_outside_on_model_error_raises() -> None:
    class Early(Hooks):
        async def on_iteration(self, ctx: Any, iteration: int, message_id: str) -> None:
            ctx.retry()

    hooks = Early()
    with pytest.raises(RetryNotAllowedError):
        await Fakes([Reply("never")]).run(hooks)
    assert hooks.terminal() == [("on_error", "RetryNotAllowedError")]
    ctx = RunContext(run_id="r", thread_id="t", agent_id="a", abort=AbortHandle(), events=_discard, messages=list)
    with pytest.raises(RetryNotAllowedError):
        ctx.retry()


async def _discard(event: RunEvent) -> None:
    return None


# -- events -------------------------------------------------------------------------------------------------------


async def test_the_events_of_one_run_in_order() -> None:
    add, _ = add_tool()
    fakes = Fakes([Reply("let me add", tool_calls=[("add", {"a": 1, "b": 2})]), Reply("it is 3")], [add])
    await fakes.run()
    kinds = [kind for kind in fakes.kinds() if kind != "UsageReported"]

    def text(words: int) -> list[str]:  # the test model streams a word per chunk
        return ["TextMessageStart", *["TextMessageContent"] * words, "TextMessageEnd"]

    tool = ["ToolCallStart", "ToolCallArgs", "ToolCallEnd", "ToolCallResult"]
    assert kinds == [
        "RunStarted",
        *["StepStarted", *text(3), *tool, "StepFinished"],
        *["StepStarted", *text(3), "StepFinished"],
        "RunFinished",
    ]
    assert sum(isinstance(event, UsageReported) for event in fakes.events) == 2
    steps = [event.step for event in fakes.events if isinstance(event, StepStarted)]
    assert steps == ["turn-1", "turn-2"]
    finished = fakes.events[-1]
    assert isinstance(finished, RunFinished) and finished.outcome == "end_turn" and finished.text == "it is 3"


async def test_a_reply_with_reasoning_streams_reasoning_events_before_its_text() -> None:
    fakes = Fakes([Reply("the answer", reasoning="thinking hard", reasoning_signature="sig")])
    await fakes.run()
    kinds = [kind for kind in fakes.kinds() if kind != "UsageReported"]
    assert kinds == [
        "RunStarted",
        "StepStarted",
        "ReasoningStart",
        "ReasoningContent",
        "ReasoningEnd",
        "TextMessageStart",
        "TextMessageContent",
        "TextMessageContent",
        "TextMessageEnd",
        "StepFinished",
        "RunFinished",
    ]
    (content,) = [event for event in fakes.events if isinstance(event, ReasoningContent)]
    assert content.delta == "thinking hard"
    ids = {
        event.message_id
        for event in fakes.events
        if isinstance(event, (ReasoningStart, ReasoningEnd, ReasoningContent, TextMessageStart, TextMessageEnd))
    }
    assert len(ids) == 1
    (message,) = [m for m in fakes.conversation.history if isinstance(m, AssistantMessage)]
    assert ReasoningPart("thinking hard", "sig") in message.parts


# A scripted reply: (reasoning?, text?, calls, cut by length?), calls as kinds.
CALL_KINDS = st.sampled_from(["ok", "unknown", "disallowed", "bad_args", "fails"])
REPLIES = st.tuples(
    st.booleans(),
    st.booleans(),
    st.lists(CALL_KINDS, max_size=3),
    st.booleans(),
)


def _reply(reasoning: bool, text: bool, calls: list[str], cut: bool, turn: int) -> Reply:
    arguments = {
        "ok": ("add", {"a": turn}),
        "unknown": ("nowhere", {}),
        "disallowed": ("secret", {}),
        "bad_args": ("add", "{not json"),
        "fails": ("boom", {}),
    }
    return Reply(
        f"turn {turn} words" if text else "",
        tool_calls=[arguments[kind] for kind in calls],
        reasoning="hmm" if reasoning else None,
        finish_reason=FinishReason.LENGTH if cut and calls else None,
    )


def check_well_nested(events: Sequence[RunEvent]) -> None:
    """Every start has its end, in order; every tool call has exactly one result, inside its step."""
    assert isinstance(events[0], RunStarted)
    assert isinstance(events[-1], (RunFinished, RunError))
    assert sum(isinstance(event, (RunStarted, RunFinished, RunError)) for event in events) == 2
    step: str | None = None
    open_message: tuple[str, str] | None = None  # ("text" | "reasoning", message id)
    calls: dict[str, list[str]] = {}
    step_calls: set[str] = set()
    for event in events[1:-1]:
        match event:
            case StepStarted():
                assert step is None, "steps do not nest"
                step, step_calls = event.step, set()
            case StepFinished():
                assert step == event.step and open_message is None
                for call_id in step_calls:
                    assert calls[call_id][-1] == "result", f"call {call_id} had no result in its step"
                step = None
            case TextMessageStart() | ReasoningStart():
                assert step is not None and open_message is None and not step_calls
                open_message = ("text" if isinstance(event, TextMessageStart) else "reasoning", event.message_id)
            case TextMessageContent() | ReasoningContent():
                kind = "text" if isinstance(event, TextMessageContent) else "reasoning"
                assert open_message == (kind, event.message_id)
            case TextMessageEnd() | ReasoningEnd():
                kind = "text" if isinstance(event, TextMessageEnd) else "reasoning"
                assert open_message == (kind, event.message_id)
                open_message = None
            case ToolCallStart():
                assert step is not None and open_message is None and event.call_id not in calls
                calls[event.call_id] = ["start"]
                step_calls.add(event.call_id)
            case ToolCallArgs():
                assert calls[event.call_id] == ["start"]
                calls[event.call_id].append("args")
            case ToolCallEnd():
                assert calls[event.call_id] == ["start", "args"]
                calls[event.call_id].append("end")
            case ToolCallProgress():
                assert calls[event.call_id][-1] in ("end", "progress")
            case ToolCallResult():
                assert calls[event.call_id] == ["start", "args", "end"]
                calls[event.call_id].append("result")
            case UsageReported():
                assert step is not None and open_message is None, "usage comes after the call's text"
            case _:
                raise AssertionError(f"unexpected event {event!r}")
    assert step is None and open_message is None
    assert all(seen == ["start", "args", "end", "result"] for seen in calls.values())


async def _scripted_run(script: list[tuple[bool, bool, list[str], bool]]) -> Fakes:
    async def boom(input: dict[str, Any]) -> Any:
        await trio.lowlevel.checkpoint()
        raise RuntimeError("the tool broke")

    add, _ = add_tool()
    secret = make_tool("secret", Counter())
    replies = [_reply(*entry, turn) for turn, entry in enumerate(script, 1)]
    replies.append(Reply("the end"))  # a last reply without calls
    fakes = Fakes(
        replies,
        [add, secret, make_tool("boom", boom)],
        allowed={"add", "boom"},
        strategy=max_iterations(len(replies)),
    )
    await fakes.run()
    return fakes


@settings(max_examples=40, deadline=None)
@given(st.lists(REPLIES, max_size=4))
def test_events_are_well_nested_and_every_call_has_exactly_one_result(
    script: list[tuple[bool, bool, list[str], bool]],
) -> None:
    fakes = trio.run(_scripted_run, script)
    check_well_nested(fakes.events)
    calls = fakes.conversation.calls()
    answers = fakes.conversation.answers()
    results = [event for event in fakes.events if isinstance(event, ToolCallResult)]
    assert sorted(event.call_id for event in results) == sorted(call.id for call in calls)
    assert [answer.tool_call_id for answer in answers] == [call.id for call in calls]
    # Each assistant message's answers come right after it, in call order.
    history = fakes.conversation.history
    for position, message in enumerate(history):
        if isinstance(message, AssistantMessage) and message.tool_calls:
            following = history[position + 1 : position + 1 + len(message.tool_calls)]
            assert [m.tool_call_id for m in following if isinstance(m, ToolResultMessage)] == [
                part.id for part in message.tool_calls
            ]


def test_the_nesting_check_can_fail() -> None:
    """The negative control: a result before the call's end, or a step left open, is caught."""
    base: list[RunEvent] = [
        RunStarted("r", "a", "t"),
        StepStarted("r", "a", "turn-1"),
        ToolCallStart("r", "a", "c", "add"),
        ToolCallArgs("r", "a", "c", "{}"),
        ToolCallEnd("r", "a", "c", "add", {}),
        ToolCallResult("r", "a", "c", "add", ToolResult.success(1)),
        StepFinished("r", "a", "turn-1"),
        RunFinished("r", "a", "end_turn"),
    ]
    check_well_nested(base)
    swapped = [*base[:4], base[5], base[4], *base[6:]]
    with pytest.raises(AssertionError):
        check_well_nested(swapped)
    with pytest.raises(AssertionError):
        check_well_nested([*base[:5], *base[6:]])  # a call without a result
    with pytest.raises(AssertionError):
        check_well_nested([*base[:6], base[7]])  # a step never finished


async def test_a_host_that_says_nothing_listens_gets_no_events_until_something_does() -> None:
    async def three(input: dict[str, Any]) -> int:
        return 3

    fakes = Fakes([Reply(tool_calls=[("add", {})]), Reply(text="done")], [make_tool("add", three)])
    listening = False
    fakes.ports = attrs.evolve(fakes.ports, listening=lambda: listening)

    class ListenAfterTools(Hooks):
        async def on_tool_phase_complete(self, ctx: Any, outcomes: Sequence[ToolOutcome]) -> None:
            nonlocal listening
            assert fakes.events == []  # nothing was built while nothing listened
            listening = True  # a subscriber arrives after the tool phase

    outcome = await fakes.run(ListenAfterTools())
    assert outcome.text == "done"
    # From then on every event is built: the turn's end, the second turn, the run's end.
    assert fakes.kinds() == [
        "StepFinished",
        "StepStarted",
        "TextMessageStart",
        "TextMessageContent",
        "TextMessageEnd",
        "UsageReported",
        "StepFinished",
        "RunFinished",
    ]
    assert outcome.usage.total_tokens > 0  # both calls' usage, reported or not


# -- the event grammar on every way out, and usage once per model call ----------------------------------------


def chunk_fakes(*replies: Sequence[StreamChunk]) -> Fakes:
    fakes = Fakes([])
    service = ModelService(ChunkProvider(replies), retry=RetryPolicy(max_attempts=1))
    fakes.ports = attrs.evolve(fakes.ports, model=service)
    return fakes


class UsageLog(Hooks):
    def __init__(self) -> None:
        super().__init__()
        self.usages: list[Usage] = []

    async def on_usage(self, ctx: Any, usage: Usage) -> None:
        self.usages.append(usage)


async def test_cumulative_usage_chunks_count_once_per_model_call_after_the_text() -> None:
    first = Usage(input_tokens=100, output_tokens=1, total_tokens=101)
    last = Usage(input_tokens=100, output_tokens=20, total_tokens=120)  # cumulative: it includes the first
    fakes = chunk_fakes([TextDelta("hi"), UsageChunk(first), UsageChunk(last), FinishChunk(FinishReason.STOP)])
    hooks = UsageLog()
    finished = await fakes.run(hooks)
    assert hooks.usages == [last]
    assert finished.usage == last
    assert [e.usage for e in fakes.events if isinstance(e, UsageReported)] == [last]
    kinds = fakes.kinds()
    assert kinds.index("TextMessageEnd") < kinds.index("UsageReported") < kinds.index("StepFinished")
    check_well_nested(fakes.events)


async def test_an_abort_mid_stream_closes_the_text_message_and_the_step() -> None:
    fakes = chunk_fakes([TextDelta("a"), TextDelta(" b"), TextDelta(" c"), FinishChunk(FinishReason.STOP)])

    def abort_on_text(event: RunEvent) -> None:
        if isinstance(event, TextMessageContent):
            fakes.abort.abort(message="enough")

    fakes.watchers.append(abort_on_text)
    finished = await fakes.run()
    assert finished.stop_reason is StopReason.ABORTED
    assert fakes.kinds() == [
        "RunStarted",
        "StepStarted",
        "TextMessageStart",
        "TextMessageContent",
        "TextMessageEnd",
        "StepFinished",
        "RunFinished",
    ]


async def test_a_failure_mid_stream_closes_the_text_message_and_the_step_before_run_error() -> None:
    fakes = chunk_fakes([TextDelta("a"), TextDelta(" b"), FinishChunk(FinishReason.STOP)])

    class FailOnText(Hooks):
        def wrap_events(self, ctx: Any, sink: Any) -> Any:
            async def through(event: RunEvent) -> None:
                await sink(event)
                if isinstance(event, TextMessageContent):
                    raise ValueError("a hook broke")

            return through

    with pytest.raises(ValueError):
        await fakes.run(FailOnText())
    check_well_nested(fakes.events)
    assert fakes.kinds()[-3:] == ["TextMessageEnd", "StepFinished", "RunError"]


async def test_reasoning_after_the_text_began_ends_the_text_message_first() -> None:
    fakes = chunk_fakes([TextDelta("a"), ReasoningDelta("thinking"), TextDelta("b"), FinishChunk(FinishReason.STOP)])
    await fakes.run()
    check_well_nested(fakes.events)
    assert fakes.kinds()[2:-2] == [
        "TextMessageStart",
        "TextMessageContent",
        "TextMessageEnd",
        "ReasoningStart",
        "ReasoningContent",
        "ReasoningEnd",
        "TextMessageStart",
        "TextMessageContent",
        "TextMessageEnd",
    ]
