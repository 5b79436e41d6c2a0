"""Every hook point of the loop, in the order it acts: the `Lifecycle` a host hands the driver.

A `Lifecycle` defines any of these; the base class's are no-ops, so a part defines
only what it needs. Hosts compose several parts (a session's hook events, chat
middleware) with `compose_lifecycle`, which builds one chain per hook, once, from
the parts that define it, with the spec's composition rule for each:

==========================  ============================================================
hook                        composition
==========================  ============================================================
setup                       all, in order
on_config                   pipe (each sees the previous one's config); every call starts
                            from the run's own config, never an earlier call's answer
on_start, on_iteration      all, in order
wrap_events                 pipe of sink decorators (none defined: the sink unchanged)
on_model_error              any part asking to retry retries (at most 2 per model call)
on_usage                    all, in order
tool_stages                 concatenated: before (first decision wins), guard (in order
                            until one decides), post (replacements chain)
client_call_stages          concatenated, as tool_stages' before and guard: a client
                            tool's call, before it is sent to the client
on_cut_off_call             pipe over the answer (the driver fails that call, invalid_result,
                            on one that is no storable ToolResult)
on_tool_phase_complete      all, in order
on_interrupt_boundary       concatenated, in order: one batch per boundary (each request
                            held to InterruptDefinition.request's checks)
on_interrupt_resolution     all; the most restrictive wins (stop > cancel > continue)
before_stop                 the first message wins (a message means one more turn)
should_continue             AND, short-circuit on the first False
on_finish                   all, isolated: one failure re-raised, several grouped
on_abort, on_error          all, isolated: failures logged, never raised
==========================  ============================================================

The run's abort ends the non-terminal hooks (all but on_finish / on_abort / on_error) that
the loop awaits outside the tool pipeline and the model call (those two have their own): a
part awaits the user code of such a hook with `await_under_abort` (a cancel scope the abort
cancels, only around code that can block: a plain function has nothing to cut, and a scope
costs more than a hook call), and the `HookAborted` it raises ends the run aborted (on_abort,
never on_error). Chat middleware do (`_lifecycle/_middleware.py`); a session's Stop hooks end
alike (their dispatch raises ``HookInterruptedError`` with the run's abort). A hook that
returns, the abort set or not, lets the run go on to its next safe point, where it ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import attrs
import trio

from .._abort import Abort, AbortHandle
from .._errors import ModelError
from .._groups import contains_cancelled, typed_error
from .._models._messages import Message, ToolCallPart, ToolSpec, Usage
from .._tools._results import ToolResult
from .._tools._stages import Allow, Deny, Skip, ToolStages
from ._ports import RunEventSink
from ._rules import LoopState, Phase, StopReason

if TYPE_CHECKING:
    from ._interrupts import InterruptRequest, InterruptResolutions, PauseState, ToolResume

__all__ = [
    "NO_HOOKS",
    "ClientCall",
    "ClientCallStages",
    "ClientStage",
    "Finished",
    "Lifecycle",
    "ModelConfig",
    "Phase",
    "ToolOutcome",
]
# (`HookAborted` and `await_under_abort` are the loop's and its hosts' own, not public.)

T = TypeVar("T")


@attrs.frozen
class ModelConfig:
    """What the next model call sends: ``on_config`` may return a changed copy (``attrs.evolve``).

    ``instructions`` is the system prompt (sent first); ``messages`` is the conversation
    after it, without a system message."""

    instructions: str
    messages: Sequence[Message]
    tools: tuple[ToolSpec, ...]
    options: Mapping[str, Any] = attrs.field(factory=dict)
    metadata: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class ToolOutcome:
    """One call of a tool phase: how it was answered."""

    call: ToolCallPart
    result: ToolResult
    # Whether the tool's body was entered (the pipeline's ``tool_ran``). False: answered without
    # running: cut off, unknown tool, bad arguments, refused or skipped by a stage, never settled.
    ran: bool


@attrs.frozen
class ClientCall:
    """A call to a client tool as a `ClientCallStages` stage sees it (before it goes to the client)."""

    tool_name: str
    call_id: str
    input: dict[str, Any]


ClientStage: TypeAlias = Callable[[ClientCall], Awaitable[Allow | Deny | Skip | None]]


@attrs.frozen
class ClientCallStages:
    """What runs before a client tool's call is sent to the client, as a tool's ``before`` and
    ``guard`` stages run before it runs: ``before`` (first decision wins; ``Allow(input)``
    replaces the input, ``Skip(result)`` answers the call), then the tool's input schema, then
    ``guard`` (in order until one decides). A ``Deny`` answers the call with its refusal."""

    before: tuple[ClientStage, ...] = ()
    guard: tuple[ClientStage, ...] = ()

    def then(self, other: ClientCallStages) -> ClientCallStages:
        """These stages, followed by *other*'s in each slot."""
        return ClientCallStages((*self.before, *other.before), (*self.guard, *other.guard))


@attrs.frozen
class Finished:
    """How a run that did not fail ended."""

    stop_reason: StopReason
    text: str
    turns: int
    state: LoopState
    abort: Abort | None = None
    pause: PauseState | None = None  # set when the run paused (stop reason ``interrupted``)
    usage: Usage = attrs.field(factory=Usage)  # the sum of what the run's model calls reported

    @property
    def aborted(self) -> bool:
        return self.stop_reason is StopReason.ABORTED

    @property
    def paused(self) -> bool:
        return self.pause is not None


class Lifecycle:
    """Hook points of the loop; every method is optional (the defaults do nothing)."""

    async def setup(self, ctx: Any) -> None:
        return None

    async def on_config(self, ctx: Any, config: ModelConfig) -> ModelConfig:
        return config

    async def on_start(self, ctx: Any) -> None:
        return None

    async def on_iteration(self, ctx: Any, iteration: int, message_id: str) -> None:
        return None

    def wrap_events(self, ctx: Any, sink: RunEventSink) -> RunEventSink:
        return sink

    async def on_model_error(self, ctx: Any, error: ModelError) -> bool:
        return False

    async def on_usage(self, ctx: Any, usage: Usage) -> None:
        return None

    def tool_stages(self, ctx: Any) -> ToolStages | None:
        return None

    def client_call_stages(self, ctx: Any) -> ClientCallStages | None:
        return None

    async def on_cut_off_call(self, ctx: Any, call: ToolCallPart, result: ToolResult) -> ToolResult:
        return result

    async def on_tool_phase_complete(self, ctx: Any, outcomes: Sequence[ToolOutcome]) -> None:
        return None

    async def on_interrupt_boundary(self, ctx: Any) -> Sequence[InterruptRequest]:
        """At each boundary (``ctx.phase``): questions that pause the run (empty: none)."""
        return ()

    async def on_interrupt_resolution(self, ctx: Any, resolutions: InterruptResolutions) -> ToolResume | None:
        return None

    async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
        return None

    async def should_continue(self, ctx: Any, state: LoopState) -> bool:
        return True

    async def on_finish(self, ctx: Any, outcome: Finished) -> None:
        return None

    async def on_abort(self, ctx: Any, abort: Abort) -> None:
        return None

    async def on_error(self, ctx: Any, error: BaseException) -> None:
        return None


NO_HOOKS = Lifecycle()
"""A lifecycle with no hooks: what a session without chat middleware or Stop hooks runs."""


def defines(part: Lifecycle, name: str) -> bool:
    """Whether *part* overrides hook *name* (composition skips the parts that do not)."""
    return getattr(type(part), name) is not getattr(Lifecycle, name)


class HookAborted(Exception):
    """A hook that the run's abort cut short (`await_under_abort`): the loop ends the run aborted."""


async def await_under_abort(abort: AbortHandle, awaitable: Awaitable[T]) -> T:
    """*awaitable* awaited under *abort*: one that lands while it runs, or landed before (it is then
    cancelled at its first checkpoint), cancels it, and `HookAborted` is raised instead of its
    answer, also when it finished regardless (swallowed the cancellation, or never checkpointed).

    A cancel scope costs more than a whole plain hook call: await only what can block here.

    A failure of the awaited code goes on as it is. Its own nursery that the abort cancelled, and
    whose cleanup raised, reaches here as a group trio passed through the scope: that is the
    abort's (as a permission ask's or a session hook's bounds judge it), unless it holds a typed
    error or a cancellation from outside."""
    scope = trio.CancelScope()
    try:
        with scope:
            token = abort.add_listener(lambda _abort: scope.cancel())
            try:
                answer = await awaitable
            finally:
                abort.remove_listener(token)
    except BaseExceptionGroup as group:
        if not scope.cancel_called or typed_error(group) is not None or contains_cancelled(group):
            raise
        raise HookAborted("the run was aborted") from group
    if scope.cancel_called:
        raise HookAborted("the run was aborted")
    return answer
