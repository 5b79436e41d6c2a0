"""`run_agent_loop`: the one Trio driver of the agent loop (rules in `_rules.py`).

It calls the host only through `RunPorts` and the hooks only through one
`Lifecycle`; it never imports sessions, the journal or AG-UI.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from typing import Any

import trio

from .._abort import Abort, AbortHandle
from .._errors import JournalError, LeaseLostError, ModelAbortedError, ModelError, TrioAgentError
from .._groups import typed_error
from .._models._assemble import ModelReply, ReplyAssembler
from .._models._messages import (
    Message,
    ReasoningDelta,
    SystemMessage,
    TextDelta,
    ToolCallPart,
    ToolResultMessage,
    UsageChunk,
    UserMessage,
)
from .._tools._context import CallOrigin, ToolCall
from .._tools._pipeline import ToolExecutionRecord
from .._tools._results import ToolResult
from ._context import RunContext
from ._events import (
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
from ._hooks import NO_HOOKS, Finished, Lifecycle, ModelConfig, Phase, ToolOutcome
from ._ports import RunPorts, RunSpec, TurnRef
from ._rules import LoopState, StopReason, check_call, first_text, model_text, stops_loop, tool_error

__all__ = ["MAX_MODEL_RETRIES", "run_agent_loop"]

MAX_MODEL_RETRIES = 2
"""A model call is retried (when a hook asks, before it produced output) at most this often."""

_message_ids = itertools.count(1)


class _Aborted(Exception):
    """The run's abort (or stop) was seen at a safe point."""


async def run_agent_loop(
    spec: RunSpec,
    ports: RunPorts,
    hooks: Lifecycle = NO_HOOKS,
    *,
    ctx: RunContext | None = None,
    finish_event: bool = True,
) -> Finished:
    """Run one agent run to its end and return how it ended.

    An SDK abort (``ports.abort``) or a stop (``ports.stop``) ends it with
    ``StopReason.ABORTED`` after what was committed is settled and answered.
    Failures raise (``LeaseLostError`` and ``JournalError`` included) after
    ``on_error``; a cancellation from outside propagates unchanged. Exactly one of
    ``on_finish`` / ``on_abort`` / ``on_error`` runs, after ``RunFinished`` /
    ``RunError`` went out (a host that still has work, e.g. a structured-output
    call, passes ``finish_event=False`` and sends ``RunFinished`` itself through
    ``ctx.emit``). Every event, these included, passes the hooks' ``wrap_events``.
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
    run = _Run(spec, ports, hooks, ctx)
    try:
        await hooks.setup(ctx)
        run.events = ctx._events = hooks.wrap_events(ctx, events)
        outcome = await run.loop()
        if finish_event:
            await run.events(RunFinished(spec.run_id, spec.agent_id, outcome.stop_reason.value, outcome.text))
    except BaseException as exc:
        try:
            if typed_error(exc) is not None or isinstance(exc, Exception):
                with trio.CancelScope(shield=True):  # bounded by the hooks' own deadlines, if any
                    if isinstance(exc, Exception):
                        code = getattr(exc, "code", None)
                        with contextlib.suppress(Exception):
                            await run.events(
                                RunError(spec.run_id, spec.agent_id, str(exc), code if isinstance(code, str) else None)
                            )
                    await hooks.on_error(ctx, exc)
        finally:
            await _run_deferred(ctx)
        raise
    try:
        if outcome.aborted:
            assert outcome.abort is not None
            await hooks.on_abort(ctx, outcome.abort)
        else:
            await hooks.on_finish(ctx, outcome)
    finally:
        await _run_deferred(ctx)
    return outcome


async def _run_deferred(ctx: RunContext) -> None:
    with trio.CancelScope(shield=True):
        await ctx.run_deferred()


class _Run:
    """The state of one run (never shared between runs)."""

    def __init__(self, spec: RunSpec, ports: RunPorts, hooks: Lifecycle, ctx: RunContext) -> None:
        self.spec = spec
        self.ports = ports
        self.hooks = hooks
        self.ctx = ctx
        self.events = ports.events
        self.state = LoopState()
        self.text = ""
        self.turns = 0

    # -- the loop

    async def loop(self) -> Finished:
        spec, ports, hooks, ctx = self.spec, self.ports, self.hooks, self.ctx
        config = await hooks.on_config(ctx, self._config())
        await hooks.on_start(ctx)
        await self.events(RunStarted(spec.run_id, spec.agent_id, spec.thread_id))
        try:
            while True:
                self._check_abort()
                if not spec.strategy(self.state):
                    ports.inbox.close()
                    return self._finished(StopReason.MAX_TURNS)
                self.turns += 1
                turn = self.turns
                inputs, steering = ports.inbox.begin_turn()
                ports.conversation.extend(UserMessage(text) for text in inputs)
                turn_id = f"{spec.run_id}-t{turn}"
                message_id = f"{turn_id}-m{next(_message_ids)}"
                ctx.iteration = turn - 1
                ctx.phase = Phase.BEFORE_MODEL
                await hooks.on_iteration(ctx, turn - 1, message_id)
                config = await hooks.on_config(ctx, self._config(config))
                await self.events(StepStarted(spec.run_id, spec.agent_id, f"turn-{turn}"))
                reply = await self._model_step(turn, turn_id, message_id, config, inputs)
                if reply is None:
                    raise _Aborted
                ctx.phase = Phase.AFTER_MODEL
                message, rejected, arguments = reply
                ports.conversation.extend((message.message,))
                self.text = first_text(message.message.parts) or self.text
                calls = list(message.tool_calls)
                outcomes: list[ToolOutcome] = []
                if calls:
                    ctx.phase = Phase.BEFORE_TOOLS
                    outcomes = await self._tool_phase(turn_id, calls, rejected, arguments, steering)
                    ctx.phase = Phase.AFTER_TOOLS
                    await hooks.on_tool_phase_complete(ctx, outcomes)
                self.state = self.state.after_turn(len(calls), message.finish_reason)
                await self.events(StepFinished(spec.run_id, spec.agent_id, f"turn-{turn}"))
                self._check_abort()
                if calls:
                    await ports.recorder.turn_completed(self._turn_ref(turn, turn_id, 1))
                    if any(stops_loop(outcome.result) for outcome in outcomes):
                        ports.inbox.close()
                        return self._finished(StopReason.PERMISSION_DENIED)
                    if not await hooks.should_continue(ctx, self.state):
                        ports.inbox.close()
                        return self._finished(StopReason.VETOED)
                    continue
                # A reply without calls: its turn ended with the attempt.
                if ports.inbox.has_pending():  # a message joined: it gets its turn, unless vetoed
                    if await hooks.should_continue(ctx, self.state):
                        continue
                    ports.inbox.close()
                    return self._finished(StopReason.VETOED)
                more = await hooks.before_stop(ctx, self.state)
                if more is not None:
                    ports.inbox.add(more)  # one more round; dropped if the run ends first
                    if not spec.strategy(self.state):
                        ports.inbox.close()
                        return self._finished(StopReason.MAX_TURNS)
                    if not await hooks.should_continue(ctx, self.state):
                        ports.inbox.close()
                        return self._finished(StopReason.VETOED)
                    continue
                if ports.inbox.has_pending():  # a message joined while the Stop hooks ran
                    if await hooks.should_continue(ctx, self.state):
                        continue
                    ports.inbox.close()
                    return self._finished(StopReason.VETOED)
                # From here on a joining message starts a new run instead (no await before close).
                ports.inbox.close()
                cut = message.finish_reason.value == "length"
                return self._finished(StopReason.MAX_TOKENS if cut else StopReason.END_TURN)
        except _Aborted:
            ports.inbox.close()
            stop = self.ports.stop
            return self._finished(StopReason.ABORTED, self.ports.abort.reason or (stop.reason if stop else None))

    def _check_abort(self) -> None:
        stop = self.ports.stop
        if self.ports.abort.aborted or (stop is not None and stop.aborted):
            raise _Aborted

    def _finished(self, reason: StopReason, abort: Abort | None = None) -> Finished:
        return Finished(reason, self.text, self.turns, self.state, abort)

    def _config(self, previous: ModelConfig | None = None) -> ModelConfig:
        spec = self.spec
        instructions = spec.instructions()
        prefix = (SystemMessage(instructions),) if instructions else ()
        messages = self.ports.conversation.view(prefix)
        if previous is None:
            return ModelConfig(instructions, messages, spec.offered, {}, dict(spec.model_metadata))
        return ModelConfig(instructions, messages, previous.tools, previous.options, previous.metadata)

    def _turn_ref(self, turn: int, turn_id: str, attempt: int) -> TurnRef:
        return TurnRef(self.spec.run_id, self.spec.agent_id, turn, turn_id, f"{turn_id}-a{attempt}")

    # -- one model call (with the retries a hook asks for)

    async def _model_step(
        self, turn: int, turn_id: str, message_id: str, config: ModelConfig, inputs: list[str]
    ) -> tuple[ModelReply, dict[str, ToolResult], dict[str, dict[str, Any]]] | None:
        spec, ports, hooks, ctx = self.spec, self.ports, self.hooks, self.ctx
        attempt = 1
        while True:
            ref = self._turn_ref(turn, turn_id, attempt)
            await ports.recorder.model_call_started(ref, ports.model.model, opens_turn=attempt == 1)
            try:
                reply = await self._stream_reply(ref, message_id, config)
            except _RetryableFailure as failure:
                await ports.recorder.model_call_failed(ref, failure.error)
                if attempt <= MAX_MODEL_RETRIES and await self._wants_retry(failure.error):
                    attempt += 1
                    config = await hooks.on_config(ctx, self._config(config))
                    continue
                raise failure.error from None
            if reply is None:
                stop = ports.stop
                await ports.recorder.model_call_aborted(ref, ports.abort.reason or (stop.reason if stop else None))
                return None
            break
        # Everything a model sends is untrusted: a call that must not run is answered before any runs.
        tools = ports.tools.tools
        cut_off = frozenset(reply.cut_off)
        rejected: dict[str, ToolResult] = {}
        arguments: dict[str, dict[str, Any]] = {}
        for part in reply.tool_calls:
            checked = check_call(
                part, finish=reply.finish_reason, cut_off=part.id in cut_off, tools=tools, allowed=spec.allowed
            )
            if isinstance(checked, ToolResult):
                if checked.error is not None and checked.error.code == "max_tokens":
                    checked = await hooks.on_cut_off_call(ctx, part, checked)
                rejected[part.id] = checked
            else:
                arguments[part.id] = checked
        await ports.recorder.model_call_completed(
            ref, reply, inputs=inputs, rejected={call_id: model_text(r) for call_id, r in rejected.items()}
        )
        return reply, rejected, arguments

    async def _wants_retry(self, error: ModelError) -> bool:
        ctx = self.ctx
        ctx._retry_open, ctx._retry_requested = True, False
        try:
            return await self.hooks.on_model_error(ctx, error) or ctx._retry_requested
        finally:
            ctx._retry_open, ctx._retry_requested = False, False

    async def _stream_reply(self, ref: TurnRef, message_id: str, config: ModelConfig) -> ModelReply | None:
        """Stream one model call into the assembler and the events; ``None`` if aborted."""
        spec, ports, ctx = self.spec, self.ports, self.ctx
        # Ids already used on this stream are taken: a model that repeats one gets a new one.
        assembler = ReplyAssembler(reserved=ports.conversation.call_ids())
        feed = assembler.feed
        events = self.events
        run_id, agent_id = spec.run_id, spec.agent_id
        text_open = reasoning_open = False
        produced = False
        abort, unlink = (ports.abort, _no_unlink) if ports.stop is None else _either(ports.abort, ports.stop)
        ctx.phase = Phase.MODEL_STREAM
        try:
            async with ports.model.stream(
                config.messages,
                tools=config.tools,
                abort=abort,
                options=config.options,
                metadata=config.metadata,
            ) as chunks:
                async for chunk in chunks:
                    feed(chunk)
                    if isinstance(chunk, TextDelta):
                        produced = True
                        if reasoning_open:
                            reasoning_open = False
                            await events(ReasoningEnd(run_id, agent_id, message_id))
                        if not text_open:
                            text_open = True
                            await events(TextMessageStart(run_id, agent_id, message_id))
                        await events(TextMessageContent(run_id, agent_id, message_id, chunk.text))
                    elif isinstance(chunk, ReasoningDelta):
                        produced = True
                        if chunk.text:
                            if not reasoning_open:
                                reasoning_open = True
                                await events(ReasoningStart(run_id, agent_id, message_id))
                            await events(ReasoningContent(run_id, agent_id, message_id, chunk.text))
                    elif isinstance(chunk, UsageChunk):
                        await self.hooks.on_usage(ctx, chunk.usage)
                        await events(UsageReported(run_id, agent_id, chunk.usage))
                    else:
                        produced = True
        except ModelAbortedError:
            return None
        except ModelError as error:
            if not produced:
                raise _RetryableFailure(error) from None
            await ports.recorder.model_call_failed(ref, error)
            raise
        finally:
            unlink()
        if reasoning_open:
            await events(ReasoningEnd(run_id, agent_id, message_id))
        if text_open:
            await events(TextMessageEnd(run_id, agent_id, message_id))
        return assembler.finish()

    # -- one tool phase

    async def _tool_phase(
        self,
        turn_id: str,
        calls: list[ToolCallPart],
        rejected: Mapping[str, ToolResult],
        arguments: Mapping[str, dict[str, Any]],
        steering: AbortHandle,
    ) -> list[ToolOutcome]:
        """Run one turn's calls concurrently; one call's failure never destroys another's result.

        Each call's answer lands in its slot the moment its result is known (no await in
        between); on every way out, a cancellation from outside included, the answers join
        the history in call order, each from what the journal recorded for it or else from
        its slot, so a settled result is never lost to the model.
        """
        slots: list[ToolResult | None] = [None] * len(calls)
        stages = self.hooks.tool_stages(self.ctx)
        # A stop reaches `cancel` tools as steering does (its `block` tools finish).
        stop = self.ports.stop

        def steer(abort: Abort) -> None:
            steering.abort(abort.reason, abort.message)

        token = stop.add_listener(steer) if stop is not None else -1

        async def run_one(index: int, part: ToolCallPart) -> None:
            checked = rejected[part.id] if part.id in rejected else arguments[part.id]
            await self._run_call(turn_id, part, checked, slots, index, steering, stages)

        try:
            async with trio.open_nursery() as nursery:
                for index, part in enumerate(calls):
                    nursery.start_soon(run_one, index, part)
        except BaseExceptionGroup as group:
            typed = typed_error(group)
            if typed is None:
                raise  # a cancellation (or a foreign failure) goes on unchanged
            raise typed from None
        finally:
            if stop is not None:
                stop.remove_listener(token)
            self._answer(calls, slots)
        return [
            ToolOutcome(part, tool_error("no result", "internal") if result is None else result, part.id in arguments)
            for part, result in zip(calls, slots, strict=True)
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
            if answer is None and result is not None:  # rejected before it ran, or never settled
                answer = ToolResultMessage(part.id, model_text(result), is_error=not result.ok)
            if answer is not None:
                answers.append(answer)
        self.ports.conversation.extend(answers)

    async def _run_call(
        self,
        turn_id: str,
        part: ToolCallPart,
        checked: ToolResult | dict[str, Any],
        slots: list[ToolResult | None],
        index: int,
        steering: AbortHandle,
        stages: Any,
    ) -> None:
        spec, ports = self.spec, self.ports
        events = self.events
        run_id, agent_id = spec.run_id, spec.agent_id
        await events(ToolCallStart(run_id, agent_id, part.id, part.name))
        await events(ToolCallArgs(run_id, agent_id, part.id, part.arguments))
        if isinstance(checked, ToolResult):  # refused before it could run
            slots[index] = checked
            await events(ToolCallEnd(run_id, agent_id, part.id, part.name, part.arguments))
            await events(ToolCallResult(run_id, agent_id, part.id, part.name, checked))
            return
        await events(ToolCallEnd(run_id, agent_id, part.id, part.name, checked))

        async def on_item(item: Any) -> None:
            await events(ToolCallProgress(run_id, agent_id, part.id, item))

        origin = CallOrigin(spec.session_id, agent_id, run_id, turn_id, spec.lineage)
        record: ToolExecutionRecord | None = None
        try:
            record = await ports.tools.execute(
                ToolCall(part.id, part.name, checked),
                origin,
                abort=ports.abort,
                steering=steering,
                on_item=on_item,
                stages=stages,
            )
        except (LeaseLostError, JournalError):
            raise  # nothing about this call may be published: the run fails
        except TrioAgentError as exc:
            result = tool_error(f"{type(exc).__name__}: {exc}", "internal")
        else:
            result = record.result
        slots[index] = result  # no await since the call settled: the answer is never lost
        if record is not None and record.effects:
            await ports.effects(agent_id, part.id, record.effects)  # only now: the call is settled
        await events(ToolCallResult(run_id, agent_id, part.id, part.name, result))


class _RetryableFailure(Exception):
    """A model call failed before it produced output: a hook may ask for it again."""

    def __init__(self, error: ModelError) -> None:
        super().__init__(str(error))
        self.error = error


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
