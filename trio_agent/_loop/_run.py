"""`run_agent_loop`: the one Trio driver of the agent loop (rules in `_rules.py`).

It calls the host only through `RunPorts` and the hooks only through one
`Lifecycle`; it never imports sessions, the journal or AG-UI.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NoReturn

import attrs
import trio

from .._abort import Abort, AbortHandle, AbortReason
from .._builders import constructor
from .._cleanup import bounded_shield
from .._errors import (
    ConfigError,
    HookInterruptedError,
    JournalError,
    LeaseLostError,
    MiddlewareError,
    ModelAbortedError,
    ModelError,
    TrioAgentError,
    error_code,
)
from .._groups import first_failure, is_cancellation, typed_error
from .._models._assemble import ModelReply, ReplyAssembler, ToolArgumentsError, parse_tool_arguments
from .._models._history import ORPHAN_ANSWER
from .._models._messages import (
    FinishReason,
    Message,
    ReasoningDelta,
    SystemMessage,
    TextDelta,
    ToolCallPart,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UsageChunk,
    UserMessage,
)
from .._tools._context import CallOrigin, ToolCall
from .._tools._pipeline import ToolExecutionRecord
from .._tools._results import ToolErrorType, ToolResult, _unstorable, json_copy, result_problem
from .._tools._stages import Allow, Deny, Skip, decide
from .._util import describe, safe_repr
from ._compose import HOOK_NAMES, part_name
from ._context import RunContext
from ._events import (
    MessagesSnapshot,
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
from ._hooks import (
    NO_HOOKS,
    ClientCall,
    ClientCallStages,
    Finished,
    HookAborted,
    Lifecycle,
    ModelConfig,
    Phase,
    ToolOutcome,
    await_under_abort,
)
from ._interrupts import (
    Approve,
    Cancel,
    ClientTool,
    Interrupt,
    InterruptIssue,
    InterruptKind,
    InterruptResolution,
    InterruptResolutions,
    InterruptResumeError,
    PauseState,
    Resume,
    ToolResume,
    answered_without_running,
    approval_interrupt,
    checked_request,
    client_tool_interrupt,
    generic_interrupt,
    validate_answers,
)
from ._ports import NeedsApproval, RunPorts, RunSpec, TurnRef, discard_events
from ._rules import LoopState, StopReason, check_call, first_text, loop_state, model_text, stops_loop, tool_error

__all__ = ["MAX_MODEL_RETRIES", "run_agent_loop"]

# on_abort / on_error failures are logged, never raised (the run's own outcome stands), here as
# well as in a composition: a lone part is not composed, and a host may hand any `Lifecycle`.
_log = logging.getLogger("trio_agent.lifecycle")

MAX_MODEL_RETRIES = 2
"""A model call is retried (when a hook asks, before it produced output) at most this often."""

_message_ids = itertools.count(1)

_DEFINED: dict[type[Lifecycle], frozenset[str]] = {}


def _defined_hooks(hooks: Lifecycle) -> frozenset[str]:
    """The hooks *hooks* overrides (`defines`), worked out once per class, not per run."""
    kind = type(hooks)
    defined = _DEFINED.get(kind)
    if defined is None:
        if len(_DEFINED) >= 256:  # classes made on the fly: the table stays small
            _DEFINED.clear()
        defined = _DEFINED[kind] = frozenset(
            name for name in HOOK_NAMES if getattr(kind, name) is not getattr(Lifecycle, name)
        )
    return defined


class _Aborted(Exception):
    """The run's abort (or stop) was seen at a safe point."""


class _Paused(Exception):
    """A boundary's batch pauses the run."""

    def __init__(self, state: PauseState) -> None:
        super().__init__("paused")
        self.state = state


@attrs.frozen
class _Entry:
    """Where a continuation goes on: the pause, its checked answers, the hooks' decision."""

    pause: PauseState
    answered: Mapping[str, ToolResult]  # call id -> the answer of a call answered without running
    decision: ToolResume


async def run_agent_loop(
    spec: RunSpec,
    ports: RunPorts,
    hooks: Lifecycle = NO_HOOKS,
    *,
    ctx: RunContext | None = None,
    finalize: Callable[[Finished], Awaitable[Finished]] | None = None,
    resume: Resume | None = None,
) -> Finished:
    """Run one agent run to its end and return how it ended.

    An SDK abort (``ports.abort``) or a stop (``ports.stop``) ends it with
    ``StopReason.ABORTED`` after what was committed is settled and answered; a
    non-terminal hook the abort cuts short (`HookAborted`, see `_hooks`) ends it so
    where it is.
    Failures raise (``LeaseLostError`` and ``JournalError`` included) after
    ``on_error``; a cancellation from outside propagates unchanged, after ``on_abort``
    (bounded by ``cleanup_grace``, no ``RunFinished``). Exactly one of
    ``on_finish`` / ``on_abort`` / ``on_error`` runs, after ``RunFinished`` /
    ``RunError`` went out, shielded and bounded by ``cleanup_grace`` (a
    cancellation landing in it goes on after every part was told). A host with a last step of the run (``chat()``'s
    structured-output call) passes ``finalize``: awaited with the outcome of a run
    that ended neither paused nor aborted, before ``RunFinished`` and the terminal
    hook, it returns the outcome the run ends with; its failure fails the run
    (``RunError``, ``on_error``), an abort during it ends the run aborted. Every
    event, these included, passes the hooks' ``wrap_events``.
    """
    events = ports.events
    if ctx is None:
        ctx = RunContext(
            run_id=spec.run_id,
            thread_id=spec.thread_id,
            agent_id=spec.agent_id,
            abort=ports.abort,
            events=events,
            messages=lambda: ports.conversation.view(()),
        )
    run = _Run(spec, ports, hooks, ctx, resume)
    ctx.can_pause = spec.can_pause
    if resume is not None:
        ctx.parent_run_id = resume.parent_run_id
    try:
        if "setup" in run.hooked:
            # Cut by the run's abort, it ends there; the run ends aborted after RunStarted (`_Run.loop`).
            try:  # noqa: SIM105 - a suppress() per hook call would cost more than this hook point
                await hooks.setup(ctx)
            except HookAborted:
                pass
        run.events = ctx._events = hooks.wrap_events(ctx, events)
        # The hot paths build no event nobody reads: none when the sink discards them, and, with a
        # host that says when anything listens, none while nothing does. A hook that wraps the sink
        # reads them all.
        if run.events is events:
            run._discards = events is discard_events
            run._listening = ports.listening
        outcome = await run.loop()
        if outcome.pause is not None:
            # Paused: the conversation so far, then the batch; no terminal hook (the run goes on later).
            await run._close_step()
            await run.events(MessagesSnapshot(spec.run_id, spec.agent_id, outcome.pause.messages))
            await run.events(
                RunFinished(spec.run_id, spec.agent_id, "interrupt", outcome.text, outcome.pause.interrupts)
            )
            await _run_deferred(ctx, spec.cleanup_grace)
            return outcome
        if finalize is not None and not outcome.aborted:
            outcome = await run.finalize(finalize, outcome)
        if not run.quiet:
            await run.events(RunFinished(spec.run_id, spec.agent_id, outcome.stop_reason.value, outcome.text))
    except BaseException as exc:
        try:
            if typed_error(exc) is not None or isinstance(exc, Exception):
                with bounded_shield(spec.cleanup_grace, "reporting a failed run (RunError, on_error)"):
                    if isinstance(exc, Exception):
                        with contextlib.suppress(Exception):
                            await run._close_step()
                        error = RunError(spec.run_id, spec.agent_id, describe(exc, "text"), error_code(exc))
                        try:
                            await run.events(error)
                        except Exception:
                            # The hooks' wrap_events failed on it (an on_chunk that fails on every
                            # event): the stream still ends with its terminal event, unwrapped.
                            if run.events is not events:
                                with contextlib.suppress(Exception):
                                    await events(error)
                    try:
                        await hooks.on_error(ctx, exc)
                    except Exception:
                        _log.exception("on_error of %s failed", part_name(hooks))
            elif is_cancellation(exc):
                # Cancelled from outside (a cancel scope around the run): the run ends aborted, so
                # its terminal hook is on_abort, bounded and shielded as the cleanup is.
                with bounded_shield(spec.cleanup_grace, "telling the hooks a cancelled run ended (on_abort)"):
                    try:
                        await hooks.on_abort(ctx, ports.abort.reason or _CANCELLED)
                    except Exception:
                        _log.exception("on_abort of %s failed", part_name(hooks))
        finally:
            await _run_deferred(ctx, spec.cleanup_grace)
        raise
    try:
        # Shielded (bounded) as the hooks of a failed or cancelled run are: a cancellation from
        # outside landing in one part's hook would otherwise leave every later part without its
        # terminal hook. It goes on once they all were told.
        if outcome.aborted:
            assert outcome.abort is not None
            if "on_abort" in run.hooked:
                with bounded_shield(spec.cleanup_grace, "telling the hooks a run was aborted (on_abort)"):
                    try:
                        await hooks.on_abort(ctx, outcome.abort)
                    except Exception:
                        _log.exception("on_abort of %s failed", part_name(hooks))
                await trio.lowlevel.checkpoint_if_cancelled()
        elif "on_finish" in run.hooked:
            with bounded_shield(spec.cleanup_grace, "telling the hooks a run finished (on_finish)"):
                await hooks.on_finish(ctx, outcome)
            await trio.lowlevel.checkpoint_if_cancelled()
    finally:
        await _run_deferred(ctx, spec.cleanup_grace)
    return outcome


_CANCELLED = Abort(AbortReason.USER_ABORT, "the run was cancelled from outside")
"""What `on_abort` hears of a run cancelled from outside without an abort of its own."""


async def _run_deferred(ctx: RunContext, grace: float) -> None:
    if not ctx.has_deferred:
        return  # the usual case: no shield to build (a cancel scope costs more than the check)
    with bounded_shield(grace, "running a run's deferred functions"):
        await ctx.run_deferred()


class _Run:
    """The state of one run (never shared between runs)."""

    def __init__(
        self, spec: RunSpec, ports: RunPorts, hooks: Lifecycle, ctx: RunContext, resume: Resume | None = None
    ) -> None:
        self.spec = spec
        self.ports = ports
        self.hooks = hooks
        self.ctx = ctx
        self.events = ports.events
        # A request taken over from an earlier process goes on counting the turns it took
        # there: its turn ids number on, and they count against the strategy's limit.
        self.state = loop_state(spec.turns_before, 0, 0, None)
        self.text = ""
        self.turns = spec.turns_before
        self.resume = resume
        self.step_open = False
        self.open_turn: TurnRef | None = None
        self.message_id: str | None = None  # the open turn's message: its tool calls' parent
        self.turn_offset = 0  # a continuation numbers its own turns from 1 (set in `_continue`)
        # The hooks it defines: one it does not is not awaited at all (nor given a cancel scope).
        self.hooked = hooked = _defined_hooks(hooks)
        self.asks_at_boundaries = "on_interrupt_boundary" in hooked
        self._history: Sequence[Message] = ()  # the history view `_config` handed out last
        self._configures = "on_config" in hooked
        self._metadata: dict[str, Any] | None = None  # `_config`'s copy of the run's model metadata
        self.turn_inputs: Sequence[str] = ()  # what joined the current turn (kept by a pause before the model)
        self.turn_finish: FinishReason | None = None  # why the current turn's reply finished
        self.approved: dict[str, dict[str, Any]] = {}  # call id -> the arguments a person approved
        self._discards = False  # set by `run_agent_loop` (see there), as is:
        self._listening: Callable[[], bool] | None = None
        self.usage: Usage | None = None  # what the model calls reported, added up in order
        self._last_ref: TurnRef | None = None  # `_turn_ref`'s last answer, and the attempt it names
        self._last_attempt = 0

    @property
    def quiet(self) -> bool:
        """Whether no event built now would be read (`run_agent_loop` says when)."""
        listening = self._listening
        return self._discards or (listening is not None and not listening())

    # -- the loop

    async def loop(self) -> Finished:
        spec, ports, hooks, ctx = self.spec, self.ports, self.hooks, self.ctx
        hooked, abort = self.hooked, ports.abort
        # A hook the run's abort cuts (`HookAborted`) ends the run aborted. The ones before
        # RunStarted end where they are (none is called once the run is aborted), and the run
        # ends after RunStarted, at its first safe point.
        if self._configures and not abort.aborted:
            # What it returns shapes no call: every call's on_config starts from the run's own (`_config`).
            try:  # noqa: SIM105 - a suppress() per hook call would cost more than this hook point
                await hooks.on_config(ctx, self._config())
            except HookAborted:
                pass
        try:
            # An abort while the answers are judged ends the run aborted, its pause still open.
            entry = await self._resolve(self.resume) if self.resume is not None else None
            if "on_start" in hooked and not abort.aborted:
                try:  # noqa: SIM105 - a suppress() per hook call would cost more than this hook point
                    await hooks.on_start(ctx)
                except HookAborted:
                    pass
            if not self.quiet:
                await self.events(RunStarted(spec.run_id, spec.agent_id, spec.thread_id))
            if entry is not None:
                outcome = await self._continue(entry)
                if outcome is not None:
                    return outcome
            while True:
                self._check_abort()
                if not spec.strategy(self.state):
                    ports.inbox.close()
                    return self._finished(StopReason.MAX_TURNS)
                self.turns += 1
                turn = self.turns
                inputs: Sequence[str]
                inputs, steering = ports.inbox.begin_turn()
                ports.conversation.extend(UserMessage(text) for text in inputs)
                if not inputs:
                    # The usual turn takes nothing: its empty list is not kept for the turn (the
                    # frames below and `turn_inputs` would hold it: one object more per run in flight).
                    inputs = ()
                self.turn_inputs = inputs
                message_id = f"{self._turn_id(turn)}-m{next(_message_ids)}"
                ctx.iteration = turn - 1
                ctx.phase = Phase.BEFORE_MODEL
                if "on_iteration" in hooked:
                    await hooks.on_iteration(ctx, turn - 1, message_id)
                config = self._config()
                if self._configures:
                    config = await hooks.on_config(ctx, config)
                outcome = await self._turn(turn, message_id, config, inputs, steering)
                if outcome is not None:
                    return outcome
        except (_Aborted, HookAborted):
            ports.inbox.close()
            await self._close_step()
            stop = self.ports.stop
            return self._finished(StopReason.ABORTED, self.ports.abort.reason or (stop.reason if stop else None))
        except _Paused as paused:
            ports.inbox.close()
            if self.open_turn is not None:  # the turn ends with the pause; its calls wait unscheduled
                await ports.recorder.turn_completed(self.open_turn)
            return self._finished(StopReason.INTERRUPTED, pause=paused.state)

    async def finalize(self, step: Callable[[Finished], Awaitable[Finished]], outcome: Finished) -> Finished:
        """The host's last step of a run that ended (`run_agent_loop`); an abort ends the run aborted."""
        abort = self.ports.abort
        if not abort.aborted:
            try:
                return await step(outcome)
            except HookAborted:
                pass  # a hook of it (chat()'s on_structured_output_config, on_config, on_usage) was cut
            except ModelAbortedError:
                if not abort.aborted:
                    raise
        return self._finished(StopReason.ABORTED, abort.reason)

    async def _close_step(self) -> None:
        """End the open step (an abort, a pause or a failure cut it short): every step ends."""
        if self.step_open:
            self.step_open = False
            if not self.quiet:
                await self.events(StepFinished(self.spec.run_id, self.spec.agent_id, f"turn-{self.turns}"))

    async def _turn(
        self,
        turn: int,
        message_id: str,
        config: ModelConfig,
        inputs: Sequence[str],
        steering: AbortHandle,
        *,
        asked: bool = False,
    ) -> Finished | None:
        """One turn from its model call on; ``None``: go on with the next turn."""
        spec, ports, ctx = self.spec, self.ports, self.ctx
        turn_id = self._turn_id(turn)
        self.message_id = message_id
        self.step_open = True
        if not self.quiet:
            await self.events(StepStarted(spec.run_id, spec.agent_id, f"turn-{turn}"))
        if not asked:
            await self._boundary(Phase.BEFORE_MODEL)
        reply = await self._model_step(turn, turn_id, message_id, config, inputs)
        if reply is None:
            raise _Aborted
        ctx.phase = Phase.AFTER_MODEL
        message, rejected, arguments = reply
        self.turn_finish = message.finish_reason
        ports.conversation.extend((message.message,))
        self.text = first_text(message.message.parts) or self.text
        calls = list(message.tool_calls)
        self.open_turn = self._turn_ref(turn, 1) if calls else None  # a reply without calls ends its turn
        await self._boundary(Phase.AFTER_MODEL, calls, rejected)
        return await self._tools_and_after(turn, turn_id, calls, rejected, arguments, steering, message.finish_reason)

    async def _tools_and_after(
        self,
        turn: int,
        turn_id: str,
        calls: list[ToolCallPart],
        rejected: dict[str, ToolResult],
        arguments: dict[str, dict[str, Any]],
        steering: AbortHandle,
        finish: FinishReason,
        *,
        answered: Mapping[str, ToolResult] | None = None,
    ) -> Finished | None:
        spec, ports, hooks, ctx = self.spec, self.ports, self.hooks, self.ctx
        outcomes: list[ToolOutcome] = []
        if calls:
            ctx.phase = Phase.BEFORE_TOOLS
            await self._gate(calls, rejected, arguments, answered)
            outcomes = await self._tool_phase(turn_id, calls, rejected, arguments, steering)
            ctx.phase = Phase.AFTER_TOOLS
            if "on_tool_phase_complete" in self.hooked:
                # Told of an aborted phase too; cut by the abort, the run ends below (`_check_abort`).
                try:  # noqa: SIM105 - a suppress() per hook call would cost more than this hook point
                    await hooks.on_tool_phase_complete(ctx, outcomes)
                except HookAborted:
                    pass
        self.state = self.state.after_turn(len(calls), finish)
        self.step_open = False
        if not self.quiet:
            await self.events(StepFinished(spec.run_id, spec.agent_id, f"turn-{turn}"))
        self._check_abort()
        if calls:
            await ports.recorder.turn_completed(self._turn_ref(turn, 1))
            self.open_turn = None
            if any(stops_loop(outcome.result) for outcome in outcomes):
                ports.inbox.close()
                return self._finished(StopReason.PERMISSION_DENIED)
            # The turn is complete and recorded: a pause here resumes with the next turn.
            await self._boundary(Phase.AFTER_TOOLS)
            return await self._after_tools()
        return await self._after_reply_without_calls(finish)

    async def _after_tools(self) -> Finished | None:
        if "should_continue" in self.hooked and not await self.hooks.should_continue(self.ctx, self.state):
            self.ports.inbox.close()
            return self._finished(StopReason.VETOED)
        return None

    async def _should_continue(self) -> bool:
        return "should_continue" not in self.hooked or await self.hooks.should_continue(self.ctx, self.state)

    async def _before_stop(self) -> str | None:
        if "before_stop" not in self.hooked:
            return None
        try:
            return await self.hooks.before_stop(self.ctx, self.state)
        except HookInterruptedError as exc:
            # A session's Stop hook that the run's abort interrupted: the run's abort, no failure.
            if exc.abort is None or exc.abort is not self.ports.abort.reason:
                raise
            raise _Aborted from None

    async def _after_reply_without_calls(self, finish: FinishReason) -> Finished | None:
        spec, ports = self.spec, self.ports
        # A reply without calls: its turn ended with the attempt.
        if ports.inbox.has_pending():  # a message joined: it gets its turn, unless vetoed
            if await self._should_continue():
                return None
            ports.inbox.close()
            return self._finished(StopReason.VETOED)
        more = await self._before_stop()
        if more is not None:
            ports.inbox.add(more)  # one more round; dropped if the run ends first
            if not spec.strategy(self.state):
                ports.inbox.close()
                return self._finished(StopReason.MAX_TURNS)
            if not await self._should_continue():
                ports.inbox.close()
                return self._finished(StopReason.VETOED)
            return None
        if ports.inbox.has_pending():  # a message joined while the Stop hooks ran
            if await self._should_continue():
                return None
            ports.inbox.close()
            return self._finished(StopReason.VETOED)
        # From here on a joining message starts a new run instead (no await before close).
        ports.inbox.close()
        cut = finish.value == "length"
        return self._finished(StopReason.MAX_TOKENS if cut else StopReason.END_TURN)

    # -- interrupts

    async def _boundary(
        self,
        phase: Phase,
        calls: Sequence[ToolCallPart] = (),
        rejected: Mapping[str, ToolResult] | None = None,
        pending: Sequence[Interrupt] = (),
    ) -> None:
        """Ask every hook at *phase*; pause with *pending* and their requests if there is any."""
        self.ctx.phase = phase
        if not self.asks_at_boundaries:  # no hook asks: four awaits a turn saved
            if pending:
                self._pause(phase, list(pending), calls, rejected or {})
            return
        try:
            requests = await self.hooks.on_interrupt_boundary(self.ctx)
        except HookAborted:
            self._abort_turn(calls, rejected or {})
        batch = [*pending, *(self._generic(request) for request in requests)]
        if batch:
            self._pause(phase, batch, calls, rejected or {})

    def _generic(self, request: object) -> Interrupt:
        # Chat middleware hand back what `checked_request` passed (checked once); any other part's
        # requests are held to the same rules here, before a pause (or its journal record) holds one.
        try:
            request = checked_request(request)
        except ConfigError as exc:
            raise MiddlewareError(
                f"on_interrupt_boundary of {part_name(self.hooks)} returned an invalid request: {exc}"
            ) from None
        if not self.spec.can_pause:
            raise MiddlewareError(
                f"on_interrupt_boundary asked {request.definition.id!r} in a run that cannot pause "
                "(a subagent's): ask only when ctx.can_pause"
            )
        registered = self.spec.interrupts.get(request.definition.id)
        if registered is not request.definition:
            raise MiddlewareError(
                f"interrupt definition {request.definition.id!r} is not registered on this run "
                "(chat(interrupts=[...]), open_session(interrupts=[...]) or the middleware's `interrupts`)"
            )
        return generic_interrupt(request)

    def _pause(
        self,
        phase: Phase,
        batch: list[Interrupt],
        calls: Sequence[ToolCallPart],
        rejected: Mapping[str, ToolResult],
    ) -> NoReturn:
        if self._aborted():
            # Abort wins over a pause (it may have landed while the gate's screen or a boundary
            # hook that it did not cut ran).
            self._abort_turn(calls, rejected)
        ids = [item.id for item in batch]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise MiddlewareError(f"one batch asked the same question twice: {', '.join(duplicates)}")
        # Every call of the reply waits, the refused ones with their answer: all are answered
        # together, in call order, when the run goes on (as a journal rebuilds them).
        raise _Paused(
            PauseState(
                phase=phase,
                interrupts=tuple(batch),
                messages=tuple(self.ports.conversation.view(())),
                pending_calls=tuple(calls),
                turns=self.turns,
                state=self.state,
                text=self.text,
                refused={part.id: rejected[part.id] for part in calls if part.id in rejected},
                inputs=tuple(self.turn_inputs) if phase is Phase.BEFORE_MODEL else (),
                finish=self.turn_finish if phase in (Phase.AFTER_MODEL, Phase.BEFORE_TOOLS) else None,
            )
        )

    def _abort_turn(self, calls: Sequence[ToolCallPart], rejected: Mapping[str, ToolResult]) -> NoReturn:
        """End the run aborted before the reply's calls run: the refused calls with their answers,
        the others unrun (no result: `_answer` gives them a rebuilt history's answer)."""
        self._answer(list(calls), [rejected.get(part.id) for part in calls])
        raise _Aborted

    async def _gate(
        self,
        calls: list[ToolCallPart],
        rejected: dict[str, ToolResult],
        arguments: dict[str, dict[str, Any]],
        answered: Mapping[str, ToolResult] | None,
    ) -> None:
        """Before any call runs: apply the continuation's answers, screen the rest, pause if a
        person must answer first (approvals, then client tools, then the hooks' questions)."""
        spec, gate, ctx = self.spec, self.ports.gate, self.ctx
        approvals: list[Interrupt] = []
        client: list[Interrupt] = []
        client_stages: ClientCallStages | None = None
        asked_stages = False
        for part in calls:
            if part.id not in arguments:
                continue
            if answered is not None and part.id in answered:  # answered without running
                del arguments[part.id]
                rejected[part.id] = answered[part.id]
                continue
            args = arguments[part.id]
            approved = self.approved.get(part.id)
            if approved is not None:
                arguments[part.id] = approved
            elif gate is not None:
                verdict = await gate.screen(ToolCall(part.id, part.name, args), ctx)
                if isinstance(verdict, NeedsApproval):
                    approvals.append(approval_interrupt(part, args, verdict.message))
                    continue
            client_tool = spec.client_tools.get(part.name)
            if client_tool is not None:
                if not asked_stages:
                    client_stages, asked_stages = self.hooks.client_call_stages(ctx), True
                # The pipeline's journal is the run's: a lost lease ends the run only if it is that one's.
                screen = (part, arguments[part.id], client_tool, client_stages, self.ports.tools.lease_lost)
                if client_stages is None:
                    screened = await _screen_client_call(*screen)
                else:  # the hooks' before / guard stages, under the run's abort (the pipeline's are under it too)
                    try:
                        screened = await await_under_abort(self.ports.abort, _screen_client_call(*screen))
                    except HookAborted:  # (a continuation's answers not applied yet among them)
                        self._abort_turn(calls, {**answered, **rejected} if answered else rejected)
                if isinstance(screened, ToolResult):  # refused, invalid or skipped: answered, not sent
                    del arguments[part.id]
                    rejected[part.id] = screened
                    continue
                arguments[part.id] = screened
                client.append(client_tool_interrupt(part, screened, client_tool))
        if answered is not None and not (approvals or client):
            return  # resumed past this boundary: it is not asked again
        await self._boundary(Phase.BEFORE_TOOLS, calls, rejected, [*approvals, *client])

    async def _resolve(self, resume: Resume) -> _Entry:
        """Check the continuation's answers (nothing runs if one is wrong), ask the hooks, record
        the answers (a journal refuses a replay), and work out the calls answered without running."""
        spec, gate, ctx = self.spec, self.ports.gate, self.ctx
        pause = resume.pause
        if self.ports.recorder.pause_is_open(resume.parent_run_id) is False:  # the journal can tell now
            raise InterruptResumeError(
                [InterruptIssue(None, "stale", f"run {resume.parent_run_id!r} is not paused (answered already?)")]
            )
        answers, issues = validate_answers(pause, resume.answers, spec.client_tools)
        # An answer already found wrong (edited_args that are no JSON object, or no JSON) is not
        # judged by the table as well: its check would run on them, or conclude() refuse a list.
        wrong = [issue.interrupt_id for issue in issues]  # (an id may be anything: no set)
        calls = {part.id: part for part in pause.pending_calls}
        refused: dict[str, ToolResult] = {}  # approved, but the table refuses the call now
        for interrupt in pause.interrupts:
            answer = answers.get(interrupt.id)
            if interrupt.kind is not InterruptKind.APPROVAL or not isinstance(answer, Approve) or interrupt.id in wrong:
                continue
            part = calls.get(interrupt.tool_call_id or "")
            if part is None:
                issues.append(InterruptIssue(interrupt.id, "stale", "the call this approval is for is not pending"))
                continue
            if gate is None:
                issues.append(InterruptIssue(interrupt.id, "stale", "this run has no permission table to judge the "
                                             "approval: continue with the paused run's permissions="))  # fmt: skip
                continue
            original = dict(interrupt.input or {})
            edited = answer.edited_args
            decision = await gate.approve(ToolCall(part.id, part.name, original), edited, ctx)
            if isinstance(decision, Deny):
                if edited is not None:
                    issues.append(InterruptIssue(interrupt.id, "invalid_edited_args", decision.message))
                else:  # unedited and refused now (a rule changed): the call is answered with the refusal
                    refused[part.id] = decision.to_result()
                continue
            if isinstance(decision, Allow):
                self.approved[part.id] = dict(decision.input if decision.input is not None else (edited or original))
        # An abort that landed while the table judged an approval cut its checks short: their
        # denials are the abort's, no refusal of the call or of the edit.
        self._check_abort()
        if issues:
            raise InterruptResumeError(issues)
        resolutions = InterruptResolutions(
            tuple(
                InterruptResolution(
                    interrupt,
                    "cancelled" if isinstance(answers[interrupt.id], Cancel) else "resolved",
                    getattr(answers[interrupt.id], "value", None),
                )
                for interrupt in pause.interrupts
                if interrupt.kind is InterruptKind.GENERIC
            )
        )
        resumed = ToolResume.CONTINUE
        if resolutions and "on_interrupt_resolution" in self.hooked:
            resumed = await self.hooks.on_interrupt_resolution(ctx, resolutions) or ToolResume.CONTINUE
        answered = {**answered_without_running(pause, answers, resumed), **refused}
        approved = [part_id for part_id in self.approved if part_id not in answered]
        self._check_abort()  # (one that landed in on_interrupt_resolution): the pause is not consumed
        try:
            await self.ports.recorder.interrupts_resolved(
                resume.parent_run_id, spec.run_id, answers, answered, approved
            )
        except JournalError as exc:  # the journal refuses a second answer to one pause
            raise InterruptResumeError(
                [InterruptIssue(None, "stale", f"paused run {resume.parent_run_id!r} cannot be resumed: {exc}")]
            ) from None
        self.turns = pause.turns
        self.state = pause.state
        self.text = pause.text
        # This run numbers its own turns from 1 (a journal checks that); the count goes on. It
        # opens the paused turn again unless the turn was over (after its tools, or a reply
        # without calls).
        reopens = pause.phase is Phase.BEFORE_MODEL or (
            pause.phase in (Phase.AFTER_MODEL, Phase.BEFORE_TOOLS) and bool(pause.pending_calls)
        )
        self.turn_offset = pause.turns - (1 if reopens else 0)
        return _Entry(pause, answered, resumed)

    async def _continue(self, entry: _Entry) -> Finished | None:
        """Go on from where the run paused; ``None``: go on with the next turn."""
        pause, ports, ctx = entry.pause, self.ports, self.ctx
        pending = list(pause.pending_calls)
        if entry.decision is ToolResume.STOP:
            answers = {**entry.answered, **pause.refused}
            self._answer(pending, [answers[part.id] for part in pending])
            ports.inbox.close()
            return self._finished(StopReason.VETOED)
        phase = pause.phase
        if phase is Phase.AFTER_TOOLS:
            return await self._after_tools()
        turn = self.turns
        ctx.iteration = max(turn - 1, 0)
        steering = AbortHandle()
        if phase is Phase.BEFORE_MODEL:
            ctx.phase = Phase.BEFORE_MODEL
            # A new assistant message: its iteration starts as every turn's does (`loop`).
            message_id = f"{self._turn_id(turn)}-m{next(_message_ids)}"
            if "on_iteration" in self.hooked:
                await self.hooks.on_iteration(ctx, turn - 1, message_id)
            config = self._config()
            if self._configures:
                config = await self.hooks.on_config(ctx, config)
            # The turn's input is in the conversation (and journalled with run_paused) already.
            return await self._turn(turn, message_id, config, (), steering, asked=True)
        # Paused after the reply or before its tools: the tool phase of that reply, in a turn of its own.
        finish = pause.finish or FinishReason.TOOL_CALLS
        self.step_open = True
        await self.events(StepStarted(self.spec.run_id, self.spec.agent_id, f"turn-{turn}"))
        if not pending:  # a reply without calls: its turn ended with the attempt
            return await self._tools_and_after(turn, self._turn_id(turn), [], {}, {}, steering, finish)
        ref = self._turn_ref(turn, 1)
        await ports.recorder.turn_started(ref)
        self.open_turn = ref
        rejected: dict[str, ToolResult] = dict(pause.refused)
        arguments: dict[str, dict[str, Any]] = {}
        for part in pending:
            if part.id in rejected:
                continue
            try:
                arguments[part.id] = parse_tool_arguments(part.arguments)
            except ToolArgumentsError as exc:
                rejected[part.id] = tool_error(exc.message, exc.code)
        # After the reply, the tool phase has not met its boundary yet: it is asked as usual.
        answered = entry.answered if phase is Phase.BEFORE_TOOLS or entry.decision is ToolResume.CANCEL else None
        return await self._tools_and_after(
            turn, ref.turn_id, pending, rejected, arguments, steering, finish, answered=answered
        )

    def _aborted(self) -> bool:
        stop = self.ports.stop
        return self.ports.abort.aborted or (stop is not None and stop.aborted)

    def _check_abort(self) -> None:
        if self._aborted():
            raise _Aborted

    def _finished(self, reason: StopReason, abort: Abort | None = None, pause: PauseState | None = None) -> Finished:
        usage = self.usage
        if usage is None:
            usage = Usage()
        return _finished(reason, self.text, self.turns, self.state, abort, pause, usage)

    def _config(self) -> ModelConfig:
        """The run's own config, where every ``on_config`` starts (init, each model call, each retry;
        ``chat()``'s structured-output call too): what a hook returns shapes that call alone, so a
        hook that adds to it adds once per call, not once more per call."""
        spec = self.spec
        # The history without the system prompt: the prompt is ``instructions``, which a hook may
        # change; the model call puts it first (`_messages`).
        messages = self._history = self.ports.conversation.view(())
        metadata = self._metadata
        if metadata is None or self._configures:
            # A hook's own copy each call (one it changed in place must not reach the next call);
            # with no on_config hook nothing changes it, and the run's one copy serves every call.
            metadata = self._metadata = dict(spec.model_metadata)
        return _model_config(spec.instructions(), messages, spec.offered, {}, metadata)

    def _messages(self, config: ModelConfig) -> Sequence[Message]:
        """What the model call sends: the config's instructions as the system prompt, then its messages."""
        if not config.instructions:
            return config.messages
        system = SystemMessage(config.instructions)
        if config.messages is self._history:  # the history itself: a view, no copy
            return self.ports.conversation.view((system,))
        return (system, *config.messages)

    def _turn_id(self, turn: int) -> str:
        return f"{self.spec.run_id}-t{turn - self.turn_offset}"

    def _turn_ref(self, turn: int, attempt: int) -> TurnRef:
        local = turn - self.turn_offset  # a continuation numbers its own turns from 1
        last = self._last_ref  # a turn names its first attempt three times (model call, calls, end)
        if last is not None and last.turn == local and attempt == self._last_attempt:
            return last
        turn_id = f"{self.spec.run_id}-t{local}"
        ref = self._last_ref = TurnRef(self.spec.run_id, self.spec.agent_id, local, turn_id, f"{turn_id}-a{attempt}")
        self._last_attempt = attempt
        return ref

    # -- one model call (with the retries a hook asks for)

    async def _model_step(
        self, turn: int, turn_id: str, message_id: str, config: ModelConfig, inputs: Sequence[str]
    ) -> tuple[ModelReply, dict[str, ToolResult], dict[str, dict[str, Any]]] | None:
        spec, ports, hooks, ctx, hooked = self.spec, self.ports, self.hooks, self.ctx, self.hooked
        attempt = 1
        while True:
            ref = self._turn_ref(turn, attempt)
            await ports.recorder.model_call_started(ref, ports.model.model, opens_turn=attempt == 1)
            try:
                # One call streamed into the assembler and the events (inline, not a method: one
                # coroutine level less per request in flight); ``None``: aborted. The events keep the
                # documented grammar on every way out: reasoning and text blocks never nest and are
                # closed before the call's usage (reported once per call, what its last `UsageChunk`
                # said: the counts are cumulative) and before anything after the call.
                # Ids already used on this stream are taken: a model that repeats one gets a new one.
                assembler = ReplyAssembler(reserved=ports.conversation.call_ids())
                events = self.events
                run_id, agent_id = spec.run_id, spec.agent_id
                text_open = reasoning_open = False
                produced = aborted = False
                failed: ModelError | None = None
                quiet = self.quiet
                abort, unlink = (ports.abort, _no_unlink) if ports.stop is None else _either(ports.abort, ports.stop)
                ctx.phase = Phase.MODEL_STREAM
                try:
                    async with ports.model.stream(
                        self._messages(config),
                        tools=config.tools,
                        abort=abort,
                        options=config.options,
                        metadata=config.metadata,
                    ) as chunks:
                        async for chunk in chunks:
                            assembler.feed(chunk)
                            if isinstance(chunk, TextDelta):
                                produced = True
                                if quiet:
                                    continue
                                if reasoning_open:
                                    reasoning_open = False
                                    await events(ReasoningEnd(run_id, agent_id, message_id))
                                if not text_open:
                                    text_open = True
                                    await events(TextMessageStart(run_id, agent_id, message_id))
                                await events(TextMessageContent(run_id, agent_id, message_id, chunk.text))
                            elif isinstance(chunk, ReasoningDelta):
                                produced = True
                                if chunk.text and not quiet and not reasoning_open:
                                    if text_open:  # the model thinks again mid-answer: its text message ends first
                                        text_open = False
                                        await events(TextMessageEnd(run_id, agent_id, message_id))
                                    reasoning_open = True
                                    await events(ReasoningStart(run_id, agent_id, message_id))
                                if chunk.text and not quiet:
                                    await events(ReasoningContent(run_id, agent_id, message_id, chunk.text))
                            elif not isinstance(chunk, UsageChunk):
                                produced = True
                except ModelError as error:
                    if isinstance(error, ModelAbortedError) and self._aborted():
                        aborted = True  # the run's abort (or stop) ended the call: no failure of the model's
                    elif not produced:
                        # A ModelAbortedError nothing of the run's asked for (a middleware or provider
                        # raised its own) is the call's failure, as any ModelError: an aborted end with no
                        # abort behind it failed an assertion after RunFinished(aborted) had gone out.
                        raise _RetryableFailure(error) from None
                    else:
                        await ports.recorder.model_call_failed(ref, error)
                        failed = error
                except Exception:
                    # A hook failed mid-stream: the blocks it left open still end, before `RunError`.
                    with contextlib.suppress(Exception):
                        if reasoning_open:
                            await events(ReasoningEnd(run_id, agent_id, message_id))
                        if text_open:
                            await events(TextMessageEnd(run_id, agent_id, message_id))
                    raise
                finally:
                    unlink()
                if reasoning_open:
                    await events(ReasoningEnd(run_id, agent_id, message_id))
                if text_open:
                    await events(TextMessageEnd(run_id, agent_id, message_id))
                if failed is not None:
                    raise failed
                usage = assembler.reported_usage
                if usage is not None:  # what the call reported, aborted or not: once per call
                    total = self.usage
                    self.usage = usage if total is None else total + usage
                    if "on_usage" in self.hooked:
                        # Told of an aborted call too; cut by the abort, the run ends at its next safe point.
                        try:  # noqa: SIM105 - a suppress() per hook call would cost more than this hook point
                            await self.hooks.on_usage(ctx, usage)
                        except HookAborted:
                            pass
                    if not quiet:
                        await events(UsageReported(run_id, agent_id, usage))
                reply = None if aborted else assembler.finish()
            except _RetryableFailure as failure:
                await ports.recorder.model_call_failed(ref, failure.error)
                if attempt <= MAX_MODEL_RETRIES and await self._wants_retry(failure.error):
                    attempt += 1
                    ctx.phase = Phase.BEFORE_MODEL  # the retried call is configured as the first was
                    config = self._config()
                    if self._configures:
                        config = await hooks.on_config(ctx, config)
                    continue
                # Its own cause kept (the provider's exception): `from None` would overwrite it.
                model_error = failure.error
                raise model_error from model_error.__cause__
            if reply is None:
                stop = ports.stop
                await ports.recorder.model_call_aborted(ref, ports.abort.reason or (stop.reason if stop else None))
                return None
            break
        # Everything a model sends is untrusted: a call that must not run is answered before any runs.
        tools: Mapping[str, object] = ports.tools.tools
        if spec.client_tools:
            tools = {**tools, **spec.client_tools}
        cut_off = frozenset(reply.cut_off)
        rejected: dict[str, ToolResult] = {}
        arguments: dict[str, dict[str, Any]] = {}
        for part in reply.tool_calls:
            checked = check_call(
                part, finish=reply.finish_reason, cut_off=part.id in cut_off, tools=tools, allowed=spec.allowed
            )
            if isinstance(checked, ToolResult):
                if checked.error is not None and checked.error.code == "max_tokens" and "on_cut_off_call" in hooked:
                    # Cut by the abort, the call keeps the loop's own answer (no call runs after an abort).
                    try:  # noqa: SIM105 - a suppress() per hook call would cost more than this hook point
                        checked = _cut_off_answer(await hooks.on_cut_off_call(ctx, part, checked), hooks)
                    except HookAborted:
                        pass
                rejected[part.id] = checked
            else:
                arguments[part.id] = checked
        await ports.recorder.model_call_completed(
            ref, reply, inputs=inputs, rejected={call_id: model_text(r) for call_id, r in rejected.items()}
        )
        return reply, rejected, arguments

    async def _wants_retry(self, error: ModelError) -> bool:
        if "on_model_error" not in self.hooked:
            return False
        ctx = self.ctx
        ctx._retry_open, ctx._retry_requested = True, False
        try:
            return await self.hooks.on_model_error(ctx, error) or ctx._retry_requested
        finally:
            ctx._retry_open, ctx._retry_requested = False, False

    # -- one tool phase

    async def _tool_phase(
        self,
        turn_id: str,
        calls: list[ToolCallPart],
        rejected: Mapping[str, ToolResult],
        arguments: Mapping[str, dict[str, Any]],
        steering: AbortHandle,
    ) -> list[ToolOutcome]:
        """Run one turn's calls concurrently (a lone call in this task); one call's failure never
        destroys another's result.

        Each call's answer lands in its slot the moment its result is known (no await in
        between); on every way out, a cancellation from outside included, the answers join
        the history in call order, each from what the journal recorded for it or else from
        its slot, so a settled result is never lost to the model.
        """
        slots: list[ToolResult | None] = [None] * len(calls)
        ran = [False] * len(calls)  # per call: whether its tool's body was entered (the pipeline's record)
        stages = self.hooks.tool_stages(self.ctx)
        gate = self.ports.gate
        if gate is not None:  # the gate's decisions come first: the table decided before any call ran
            stages = gate.stages() if stages is None else gate.stages().then(stages)
        # A stop reaches `cancel` tools as steering does (its `block` tools finish).
        stop = self.ports.stop
        token = -1
        if stop is not None:

            def steer(abort: Abort) -> None:
                steering.abort(abort.reason, abort.message)

            token = stop.add_listener(steer)

        try:
            if len(calls) == 1:  # nothing to run beside it: no task of its own
                part = calls[0]
                await self._run_call(
                    turn_id, part, _checked(part, rejected, arguments), slots, ran, 0, steering, stages
                )
            else:
                async with trio.open_nursery() as nursery:
                    for index, part in enumerate(calls):
                        nursery.start_soon(
                            self._run_call,
                            turn_id,
                            part,
                            _checked(part, rejected, arguments),
                            slots,
                            ran,
                            index,
                            steering,
                            stages,
                        )
        except BaseExceptionGroup as group:
            # One exception, as a lone call would raise (a cancellation goes on unchanged).
            failure = first_failure(group)
            if failure is group:
                raise
            raise failure from failure.__cause__  # its own cause kept, the group hidden
        finally:
            if stop is not None:
                stop.remove_listener(token)
            self._answer(calls, slots)
        return [
            _tool_outcome(part, tool_error("no result", "internal") if result is None else result, entered)
            for part, result, entered in zip(calls, slots, ran, strict=True)
        ]

    def _answer(self, calls: list[ToolCallPart], slots: list[ToolResult | None]) -> None:
        """Append the turn's answers to the history in call order (synchronous: nothing can cut it short)."""
        recorder = self.ports.recorder
        answers: list[Message] = []
        for part, result in zip(calls, slots, strict=True):
            # What the journal says the call ended with wins: a rebuilt history reads the same.
            try:
                answer = recorder.settled_answer(part.id)
            except JournalError:
                answer = None
            if answer is None:
                if result is not None:  # rejected before it ran, or never settled
                    answer = _tool_result_message(part.id, model_text(result), not result.ok)
                else:
                    # No result (its task was cancelled beside a sibling's failure): every call gets an
                    # answer, or the next request would carry a call without one. The answer a rebuilt
                    # history gives it (`answer_orphan_calls`), so both read the same.
                    answer = _tool_result_message(part.id, ORPHAN_ANSWER, True)
            answers.append(answer)
        self.ports.conversation.extend(answers)

    async def _run_call(
        self,
        turn_id: str,
        part: ToolCallPart,
        checked: ToolResult | dict[str, Any],
        slots: list[ToolResult | None],
        ran: list[bool],
        index: int,
        steering: AbortHandle,
        stages: Any,
    ) -> None:
        spec, ports = self.spec, self.ports
        events = self.events
        run_id, agent_id = spec.run_id, spec.agent_id
        quiet = self.quiet
        if not quiet:
            await events(ToolCallStart(run_id, agent_id, part.id, part.name, self.message_id))
            await events(ToolCallArgs(run_id, agent_id, part.id, part.arguments))
        if isinstance(checked, ToolResult):  # refused before it could run
            slots[index] = checked
            if not quiet:
                await events(ToolCallEnd(run_id, agent_id, part.id, part.name, part.arguments))
                await events(ToolCallResult(run_id, agent_id, part.id, part.name, checked))
            return
        if not quiet:
            # The event's own copy: an on_chunk hook or a reader that changes it in place must not
            # change what the call is scheduled (and journalled) with, nor what it runs with.
            await events(ToolCallEnd(run_id, agent_id, part.id, part.name, json_copy(checked)))
        call_events = _CallEvents(self, part, checked, announced=not quiet)
        origin = CallOrigin(spec.session_id, agent_id, run_id, turn_id, spec.lineage)
        record: ToolExecutionRecord | None = None
        try:
            record = await ports.tools.execute(
                ToolCall(part.id, part.name, checked),
                origin,
                abort=ports.abort,
                steering=steering,
                on_item=call_events.on_item,
                stages=stages,
            )
        except (LeaseLostError, JournalError):
            raise  # nothing about this call may be published: the run fails
        except TrioAgentError as exc:
            result = tool_error(describe(exc), "internal")
        else:
            result = record.result
            ran[index] = record.tool_ran
        slots[index] = result  # no await since the call settled: the answer is never lost
        if record is not None and record.effects:
            await ports.effects(agent_id, part.id, record.effects)  # only now: the call is settled
        if await call_events.heard():
            await events(ToolCallResult(run_id, agent_id, part.id, part.name, result))


def _checked(
    part: ToolCallPart, rejected: Mapping[str, ToolResult], arguments: Mapping[str, dict[str, Any]]
) -> ToolResult | dict[str, Any]:
    """A call's answer if it was refused before it could run, else its parsed arguments."""
    return rejected[part.id] if part.id in rejected else arguments[part.id]


class _CallEvents:
    """The events of one tool call for a listener that may arrive while it runs (one object, not
    two closures and their cells: thousands of calls may be in flight)."""

    __slots__ = ("announced", "checked", "part", "run")

    def __init__(self, run: _Run, part: ToolCallPart, checked: dict[str, Any], *, announced: bool) -> None:
        self.run = run
        self.part = part
        self.checked = checked
        self.announced = announced

    async def heard(self) -> bool:
        """Whether anything listens now; one that arrived while the call ran hears of it first."""
        if self.announced:
            return True
        run = self.run
        if run.quiet:
            return False
        self.announced = True
        part, events, run_id, agent_id = self.part, run.events, run.spec.run_id, run.spec.agent_id
        await events(ToolCallStart(run_id, agent_id, part.id, part.name, run.message_id))
        await events(ToolCallArgs(run_id, agent_id, part.id, part.arguments))
        await events(ToolCallEnd(run_id, agent_id, part.id, part.name, json_copy(self.checked)))
        return True

    async def on_item(self, item: Any) -> None:
        if await self.heard():
            run = self.run
            await run.events(ToolCallProgress(run.spec.run_id, run.spec.agent_id, self.part.id, item))


class _RetryableFailure(Exception):
    """A model call failed before it produced output: a hook may ask for it again."""

    def __init__(self, error: ModelError) -> None:
        super().__init__(describe(error, "text"))
        self.error = error


# Made a few times a run: built cheaper (see `_builders`), every field given.
_model_config: Callable[
    [str, Sequence[Message], tuple[ToolSpec, ...], Mapping[str, Any], Mapping[str, Any]], ModelConfig
] = constructor(ModelConfig)
_tool_outcome: Callable[[ToolCallPart, ToolResult, bool], ToolOutcome] = constructor(ToolOutcome)
_tool_result_message: Callable[[str, str, bool], ToolResultMessage] = constructor(ToolResultMessage)
_finished: Callable[[StopReason, str, int, LoopState, Abort | None, PauseState | None, Usage], Finished] = constructor(
    Finished
)


def _cut_off_answer(answer: object, hooks: Lifecycle) -> ToolResult:
    """What the hooks' ``on_cut_off_call`` left of a cut-off call's answer, as a post_tool stage's
    replacement is checked: one that is no `ToolResult`, or no JSON the journal and a pause can hold,
    fails that call (``invalid_result``), never the run. (Chat middleware name themselves first.)"""
    if not isinstance(answer, ToolResult):
        return ToolResult.failure(
            ToolErrorType.EXECUTION,
            f"on_cut_off_call of {part_name(hooks)} returned {safe_repr(answer)}, not a ToolResult",
            code="invalid_result",
        )
    if result_problem(answer) is not None:
        return _unstorable(answer, f"on_cut_off_call of {part_name(hooks)} returned")
    return answer


async def _screen_client_call(
    part: ToolCallPart,
    args: dict[str, Any],
    tool: ClientTool,
    stages: ClientCallStages | None,
    own_lease_lost: Callable[[], bool],
) -> ToolResult | dict[str, Any]:
    """A client tool's call before it goes to the client, as the pipeline screens a tool's call (with
    its rules: `decide`): the hooks' before stages (first decision wins), the tool's input schema,
    their guard stages (in order until one decides). Its final input, or the answer of a call not sent."""
    current = args
    if stages is not None:
        for stage in stages.before:
            # The call's own input, as the pipeline's before stages get it: a change made in place is
            # taken (the schema checks it next), as a transform is.
            decision = await decide("before", stage, ClientCall(part.name, part.id, current), own_lease_lost)
            if isinstance(decision, Deny):
                return decision.to_result()
            if isinstance(decision, Skip):
                return decision.result
            if isinstance(decision, Allow):
                if decision.input is not None:
                    current = decision.input
                break
    errors = tool.input_errors(current)
    if not errors and stages is not None:
        for stage in stages.guard:
            # Its own copy: the input is checked already, a change in place would skip the check.
            decision = await decide("guard", stage, ClientCall(part.name, part.id, json_copy(current)), own_lease_lost)
            if isinstance(decision, Deny):
                return decision.to_result()
            if isinstance(decision, Allow):
                if decision.input is not None:
                    current = decision.input
                    errors = tool.input_errors(current)
                break
    if errors:
        return tool_error(f"invalid input for tool {part.name!r}: " + "; ".join(errors), "invalid_input")
    return current


def _no_unlink() -> None:
    return None


def _either(first: AbortHandle, second: AbortHandle) -> tuple[AbortHandle, Any]:
    """A handle aborted when either is (a model call ends on the run's abort and on a stop)."""
    handle = AbortHandle()

    def forward(abort: Abort) -> None:
        handle.abort(abort.reason, abort.message)

    links = [(first, first.add_listener(forward)), (second, second.add_listener(forward))]

    def unlink() -> None:
        for source, token in links:
            source.remove_listener(token)

    return handle, unlink


def collect_events(sink: list[RunEvent]) -> Any:
    async def collect(event: RunEvent) -> None:
        sink.append(event)

    return collect
