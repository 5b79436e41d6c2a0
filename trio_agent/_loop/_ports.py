"""What the loop needs from whoever hosts it (a session, a ``chat()`` call), as protocols.

The loop imports nothing from sessions, the journal or AG-UI: a host hands it a
`RunSpec` (data that differs between the root agent, a subagent and a chat call)
and `RunPorts` (the model, the tools and four outlets), and the loop calls them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from .._abort import Abort, AbortHandle
from .._cleanup import DEFAULT_CLEANUP_GRACE
from .._errors import ModelError
from .._models._assemble import ModelReply
from .._models._messages import Message, ToolResultMessage, ToolSpec
from .._models._service import ModelService
from .._tools._context import ToolCall
from .._tools._pipeline import ToolPipeline
from .._tools._results import Effect, JsonObject, ToolResult
from .._tools._stages import StageDecision, ToolStages
from ._events import RunEvent
from ._interrupts import ClientTool, InterruptAnswer, InterruptDefinition
from ._rules import LoopStrategy

__all__ = [
    "Conversation",
    "EffectSink",
    "Inbox",
    "NeedsApproval",
    "RunEventSink",
    "RunPorts",
    "RunRecorder",
    "RunSpec",
    "ToolGate",
    "TurnRef",
]


class Conversation(Protocol):
    """The history one run reads and extends. A session keeps one per agent; ``chat()`` one per call."""

    def view(self, prefix: tuple[Message, ...]) -> Sequence[Message]:
        """The history as the model gets it now, after *prefix* (the system prompt), without copying it."""

    def extend(self, messages: Iterable[Message]) -> None: ...

    def call_ids(self) -> Collection[str]:
        """The tool call ids used so far (kept up to date without rereading the history)."""


class Inbox(Protocol):
    """Input that joins a running run at its next turn (steering, background reports, a Stop continuation)."""

    def begin_turn(self) -> tuple[list[str], AbortHandle]:
        """Take what is pending, and the steering handle of the new turn (the host aborts it on priority 'now')."""

    def has_pending(self) -> bool: ...

    def add(self, text: str) -> None:
        """Input for the next turn from inside the run (a Stop hook's "one more round")."""

    def close(self) -> None:
        """Stop accepting (what still arrives goes to the host's next run). No await may come between
        the last ``has_pending()`` that returned False and this call."""


# RunSpec, RunPorts and TurnRef are made per run or per model call and never changed: plain slotted
# classes (`attrs.define`), whose __init__ assigns, not frozen ones that call object.__setattr__ per field.


@attrs.define(unsafe_hash=True)  # hashable by value, as it was frozen: a recorder may key by it
class TurnRef:
    """Names one turn of one run (a session's request id is its run id)."""

    run_id: str
    agent_id: str
    turn: int
    turn_id: str
    attempt_id: str


class RunRecorder(Protocol):
    """The loop's journal outlet, as `ToolJournal` is the pipeline's. Each method returns once
    what it records is durable (a host without a journal records nothing)."""

    async def model_call_started(self, turn: TurnRef, model: str, *, opens_turn: bool) -> None:
        """A model attempt begins; the first of a turn opens the turn too (a session writes both in one append)."""

    async def model_call_completed(
        self, turn: TurnRef, reply: ModelReply, *, inputs: Sequence[str], rejected: Mapping[str, str]
    ) -> None:
        """The reply, the inputs that joined before it, and the answers of the calls refused before
        they could run; a reply without calls also ends the turn."""

    async def model_call_failed(self, turn: TurnRef, error: ModelError) -> None: ...

    async def model_call_aborted(self, turn: TurnRef, abort: Abort | None) -> None: ...

    async def turn_completed(self, turn: TurnRef) -> None: ...

    async def turn_started(self, turn: TurnRef) -> None:
        """A turn without a model call: a continuation's tool phase of the reply its run paused after."""

    async def interrupts_resolved(
        self,
        paused_run_id: str,
        run_id: str,
        answers: Mapping[str, InterruptAnswer],
        answered: Mapping[str, ToolResult],
        approved: Sequence[str] = (),
    ) -> None:
        """Run *run_id* answers paused run *paused_run_id*: checked *answers* by interrupt id, the
        answers of the calls that will not run, and the calls a person *approved* (a recovery
        re-run keeps the approval). A journal refuses a second answer to one pause."""

    def pause_is_open(self, paused_run_id: str) -> bool | None:
        """Whether *paused_run_id* still waits for answers (``None``: no journal to tell)."""

    def settled_answer(self, call_id: str) -> ToolResultMessage | None:
        """The answer the journal holds for a settled call (``None``: no journal, or not settled).

        The loop prefers it to the live result, so a live history and one rebuilt from the
        journal agree; it also finds the answer of a call whose result arrived as the run was
        cancelled.
        """


@attrs.frozen
class NeedsApproval:
    """A gate's verdict: this call runs only after a person approves it (the run pauses)."""

    message: str


class ToolGate(Protocol):
    """Screens every call of a tool phase before any of them runs (a run that asks a person by
    pausing, instead of asking a handler while the call waits). One gate per run."""

    async def screen(self, call: ToolCall, ctx: Any) -> StageDecision | NeedsApproval:
        """Allow (maybe with normalised input), Deny, or NeedsApproval; remembers the decision."""

    async def approve(self, call: ToolCall, edited_args: JsonObject | None, ctx: Any) -> StageDecision:
        """A person approved *call* (maybe with edited arguments): the decision that stands
        after the table ran again on the final arguments; remembers it."""

    def stages(self) -> ToolStages:
        """The stages that apply the remembered decisions inside the pipeline."""


RunEventSink = Callable[[RunEvent], Awaitable[None]]
"""Where the run's events go (a channel with backpressure, a mapping to session events, nowhere)."""

EffectSink = Callable[[str, str, Sequence[Effect]], Awaitable[None]]
"""``await effects(agent_id, call_id, effects)``: what a settled call asked of its host."""


@attrs.define
class RunSpec:
    """What differs between the root agent, a subagent and a ``chat()`` call: data, never branches."""

    run_id: str
    agent_id: str
    thread_id: str
    instructions: Callable[[], str]  # read at every model call (a host's context may grow)
    offered: tuple[ToolSpec, ...]
    allowed: Collection[str]
    strategy: LoopStrategy
    model_metadata: Mapping[str, Any] = attrs.field(factory=dict)
    lineage: tuple[str, ...] = ()  # the calls this run runs under (file locks follow the call tree)
    session_id: str = "session"
    client_tools: Mapping[str, ClientTool] = attrs.field(factory=dict)  # tools the client runs (a call pauses)
    interrupts: Mapping[str, InterruptDefinition] = attrs.field(factory=dict)  # registered, by id
    can_pause: bool = True  # False: a subagent's run (its host cannot hold a pause)
    cleanup_grace: float = DEFAULT_CLEANUP_GRACE  # bounds the shielded reporting after a failure
    turns_before: int = 0  # turns this run recorded in an earlier process (a request taken over)


@attrs.define
class RunPorts:
    model: ModelService
    tools: ToolPipeline
    conversation: Conversation
    inbox: Inbox
    recorder: RunRecorder
    events: RunEventSink
    effects: EffectSink
    abort: AbortHandle  # the run's: reaches the model call and every tool call
    # "Finish what runs, then stop" (cancel tools stop, block tools finish); None: this run is never
    # stopped that way (a session's root request), which saves linking a handle per model call.
    stop: AbortHandle | None = None
    gate: ToolGate | None = None  # screens each batch before any call runs (None: calls ask in the pipeline)
    # Whether anything reads `events` now (None: always, unless it is `discard_events`): the loop
    # builds no event while nothing does (a session with no subscriber, say).
    listening: Callable[[], bool] | None = None


async def discard_events(event: RunEvent) -> None:
    return None


async def no_effects(agent_id: str, call_id: str, effects: Sequence[Effect]) -> None:
    return None


def results_of(outcomes: Iterable[tuple[str, ToolResult]]) -> dict[str, ToolResult]:
    return dict(outcomes)
