"""`compose_lifecycle`: many `Lifecycle` parts as one, a chain per hook built once.

Rules
=====

* Only the parts that define a hook (`defines`) take part in its chain; a hook no
  part defines is not overridden at all, so the driver pays nothing for it
  (``wrap_events`` then returns the sink itself: zero cost per event).
* Zero parts compose to `NO_HOOKS`; one part composes to that part itself (the driver,
  `run_agent_loop`, logs a failing ``on_abort`` / ``on_error`` of whatever lifecycle it runs,
  so a lone part's failure is not raised either).
  Composed parts are flattened, so nesting compositions changes nothing.
* Per hook, in list order:

  - ``setup``, ``on_start``, ``on_iteration``, ``on_usage``,
    ``on_tool_phase_complete``: every part, in order.
  - ``on_config``, ``on_cut_off_call``: a pipe (each part gets the previous one's value).
  - ``wrap_events``: a pipe of sink decorators, the first part outermost, so part #0
    sees each event first and the events flow through the parts in list order.
  - ``on_model_error``: every part is called; the call is retried if any asked.
  - ``tool_stages``, ``client_call_stages``: the parts' stages concatenated slot by slot
    (``None``: none).
  - ``on_interrupt_boundary``: every part; the requests are concatenated in part order.
  - ``on_interrupt_resolution``: every part; the most restrictive answer wins
    (``stop`` > ``cancel`` > ``continue``; ``None`` has no effect).
  - ``before_stop``: the first part giving a message wins; later parts are not asked.
  - ``should_continue``: AND, short-circuit on the first ``False``.
  - ``on_finish``: every part, each isolated; afterwards one failure is re-raised as
    is, several are raised as one `LifecycleHookError` naming each failing part.
  - ``on_abort``, ``on_error``: every part, each isolated; failures are logged on the
    ``trio_agent.lifecycle`` logger and never raised, so the run's real outcome stands.

* Isolation catches ``Exception`` only: ``trio.Cancelled`` always propagates.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, cast

from .._abort import Abort
from .._errors import ModelError, TrioAgentError
from .._models._messages import ToolCallPart, Usage
from .._tools._results import ToolResult
from .._tools._stages import ToolStages
from .._util import describe
from ._hooks import NO_HOOKS, ClientCallStages, Finished, Lifecycle, ModelConfig, ToolOutcome, defines
from ._interrupts import InterruptRequest, InterruptResolutions, ToolResume, most_restrictive
from ._ports import RunEventSink
from ._rules import LoopState

__all__ = ["HOOK_NAMES", "LifecycleHookError", "compose_lifecycle", "part_name"]

_log = logging.getLogger("trio_agent.lifecycle")

HOOK_NAMES: tuple[str, ...] = (
    "setup",
    "on_config",
    "on_start",
    "on_iteration",
    "wrap_events",
    "on_model_error",
    "on_usage",
    "tool_stages",
    "client_call_stages",
    "on_cut_off_call",
    "on_tool_phase_complete",
    "on_interrupt_boundary",
    "on_interrupt_resolution",
    "before_stop",
    "should_continue",
    "on_finish",
    "on_abort",
    "on_error",
)
"""Every hook of `Lifecycle`, in the order the loop reaches them."""


class LifecycleHookError(TrioAgentError):
    """Several parts' ``on_finish`` hooks failed; ``failures`` holds (part name, error) in part order."""

    def __init__(self, hook: str, failures: Sequence[tuple[str, Exception]]) -> None:
        self.hook = hook
        self.failures: tuple[tuple[str, Exception], ...] = tuple(failures)
        listed = "; ".join(f"{name!r}: {describe(exc)}" for name, exc in self.failures)
        super().__init__(f"{hook} failed in {len(self.failures)} parts: {listed}")


def part_name(part: object) -> str:
    """How errors and logs name a part: its ``name`` if it has one, else its class."""
    name = getattr(part, "name", None)
    return name if isinstance(name, str) and name else type(part).__qualname__


class _Composed(Lifecycle):
    """The state of a composition; the hooks come from `_Hooks`, only those some part defines."""

    def __init__(self, parts: tuple[Lifecycle, ...]) -> None:
        self.parts = parts
        self.chains: dict[str, tuple[Lifecycle, ...]] = {
            name: tuple(part for part in parts if defines(part, name)) for name in HOOK_NAMES
        }

    def __repr__(self) -> str:
        return f"<composed lifecycle of {', '.join(part_name(part) for part in self.parts)}>"


class _Hooks(_Composed):
    """The chained hooks; never instantiated: `_composed_class` copies the needed ones."""

    async def setup(self, ctx: Any) -> None:
        for part in self.chains["setup"]:
            await part.setup(ctx)

    async def on_config(self, ctx: Any, config: ModelConfig) -> ModelConfig:
        for part in self.chains["on_config"]:
            config = await part.on_config(ctx, config)
        return config

    async def on_start(self, ctx: Any) -> None:
        for part in self.chains["on_start"]:
            await part.on_start(ctx)

    async def on_iteration(self, ctx: Any, iteration: int, message_id: str) -> None:
        for part in self.chains["on_iteration"]:
            await part.on_iteration(ctx, iteration, message_id)

    def wrap_events(self, ctx: Any, sink: RunEventSink) -> RunEventSink:
        # Wrapped innermost first, so the first part's decorator is the one the driver calls.
        for part in reversed(self.chains["wrap_events"]):
            sink = part.wrap_events(ctx, sink)
        return sink

    async def on_model_error(self, ctx: Any, error: ModelError) -> bool:
        retry = False
        for part in self.chains["on_model_error"]:
            # Every part is told, even after one asked to retry: they observe as well as decide.
            retry = await part.on_model_error(ctx, error) or retry
        return retry

    async def on_usage(self, ctx: Any, usage: Usage) -> None:
        for part in self.chains["on_usage"]:
            await part.on_usage(ctx, usage)

    def tool_stages(self, ctx: Any) -> ToolStages | None:
        stages: ToolStages | None = None
        for part in self.chains["tool_stages"]:
            more = part.tool_stages(ctx)
            if more is not None:
                stages = more if stages is None else stages.then(more)
        return stages

    def client_call_stages(self, ctx: Any) -> ClientCallStages | None:
        stages: ClientCallStages | None = None
        for part in self.chains["client_call_stages"]:
            more = part.client_call_stages(ctx)
            if more is not None:
                stages = more if stages is None else stages.then(more)
        return stages

    async def on_cut_off_call(self, ctx: Any, call: ToolCallPart, result: ToolResult) -> ToolResult:
        for part in self.chains["on_cut_off_call"]:
            result = await part.on_cut_off_call(ctx, call, result)
        return result

    async def on_tool_phase_complete(self, ctx: Any, outcomes: Sequence[ToolOutcome]) -> None:
        for part in self.chains["on_tool_phase_complete"]:
            await part.on_tool_phase_complete(ctx, outcomes)

    async def on_interrupt_boundary(self, ctx: Any) -> Sequence[InterruptRequest]:
        requests: list[InterruptRequest] = []
        for part in self.chains["on_interrupt_boundary"]:
            requests.extend(await part.on_interrupt_boundary(ctx))
        return requests

    async def on_interrupt_resolution(self, ctx: Any, resolutions: InterruptResolutions) -> ToolResume | None:
        answers = [
            await part.on_interrupt_resolution(ctx, resolutions) for part in self.chains["on_interrupt_resolution"]
        ]
        return most_restrictive(answers)

    async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
        for part in self.chains["before_stop"]:
            message = await part.before_stop(ctx, state)
            if message is not None:
                return message
        return None

    async def should_continue(self, ctx: Any, state: LoopState) -> bool:
        for part in self.chains["should_continue"]:
            if not await part.should_continue(ctx, state):
                return False
        return True

    async def on_finish(self, ctx: Any, outcome: Finished) -> None:
        failures: list[tuple[str, Exception]] = []
        for part in self.chains["on_finish"]:
            try:
                await part.on_finish(ctx, outcome)
            except Exception as exc:
                failures.append((part_name(part), exc))
        if len(failures) == 1:
            raise failures[0][1]
        if failures:
            raise LifecycleHookError("on_finish", failures)

    async def on_abort(self, ctx: Any, abort: Abort) -> None:
        for part in self.chains["on_abort"]:
            try:
                await part.on_abort(ctx, abort)
            except Exception:
                _log.exception("on_abort of %s failed", part_name(part))

    async def on_error(self, ctx: Any, error: BaseException) -> None:
        for part in self.chains["on_error"]:
            try:
                await part.on_error(ctx, error)
            except Exception:
                _log.exception("on_error of %s failed", part_name(part))


@functools.cache
def _composed_class(hooks: frozenset[str]) -> type[_Composed]:
    # A class that overrides exactly the hooks some part defines, so `defines` stays true
    # of the composition (it can be composed again) and every other hook stays the no-op.
    namespace = {name: _Hooks.__dict__[name] for name in HOOK_NAMES if name in hooks}
    return cast("type[_Composed]", type("ComposedLifecycle", (_Composed,), namespace))


def compose_lifecycle(*parts: Lifecycle) -> Lifecycle:
    """One `Lifecycle` running *parts* by the composition rule of each hook (module docstring)."""
    flat: list[Lifecycle] = []
    for index, part in enumerate(parts):
        if not isinstance(part, Lifecycle):
            from .._errors import ConfigError

            raise ConfigError(f"lifecycle part #{index} is not a Lifecycle: {part!r}")
        flat.extend(part.parts if isinstance(part, _Composed) else (part,))
    # A part that defines no hook (NO_HOOKS, say) would only cost a composition.
    flat = [part for part in flat if any(defines(part, name) for name in HOOK_NAMES)]
    if not flat:
        return NO_HOOKS
    if len(flat) == 1:
        return flat[0]
    hooks = frozenset(name for name in HOOK_NAMES if any(defines(part, name) for part in flat))
    return _composed_class(hooks)(tuple(flat))
