"""Chat middleware: the spec's ``ChatMiddleware`` hooks, run by the one agent loop.

Rules
=====

* A middleware is a `ChatMiddleware` (subclass it, or build one with
  `define_chat_middleware`). Every hook is optional and may be plain or
  ``async def``: a hook may return a value or an awaitable of it.
* `middleware_lifecycle` turns a list of middleware into one `Lifecycle`: one
  adapter part per middleware (defining only the loop hooks its middleware
  needs), composed with `compose_lifecycle`, so every per-hook chain is built once.
  Per-run state never lives on a middleware or a part: it goes in ``ctx.state``.
* Composition, in list order (the spec's table 1.2):

  ===========================  =====================================================
  setup                        all
  on_config                    pipe; ``None`` passes, a dict is shallow-merged, a
                               `ModelConfig` replaces; each call starts from the run's
                               own config
  on_structured_output_config  pipe, like on_config (`apply_structured_output_config`)
  on_start, on_iteration       all
  on_chunk                     pipe per event: ``None`` keeps, an event replaces, a
                               list expands (may be empty), `DROP` drops; a dropped
                               event never reaches later middleware
  on_before_tool_call          first decision wins (later middleware are not asked);
                               also before a client tool's call is sent to the client
  on_guard_tool_call           in order until one decides; sees the final checked args
                               (a client tool's too)
  on_after_tool_call           replacements chain; an error stays an error; also for a
                               call cut off by the output limit (code ``max_tokens``)
  on_tool_phase_complete       all
  on_interrupt_boundary        all; the requests are concatenated into one batch
  on_interrupt_resolution      all; the most restrictive wins (stop > cancel > continue)
  on_should_continue           AND, short-circuit: only an explicit ``False`` vetoes
  on_model_error               all; any ``ctx.retry()`` retries
  on_usage                     all
  on_finish                    all, isolated: one failure re-raised, several grouped
  on_abort, on_error           all, isolated: failures logged, never raised
  ===========================  =====================================================

* A hook that returns something its hook does not accept raises
  `MiddlewareDecisionError` naming the hook and the middleware. Hooks are not
  isolated except the terminal ones: an error escapes into the loop (tool-stage
  errors end the call with an error result, as every tool stage does).
* ``ctx.chunk_index`` counts the events actually delivered past the middleware.
* Capabilities (``_capabilities.py``, ``docs/capabilities.md``): ``requires``,
  ``provides`` and ``optional_requires`` are tuples of `Capability` handles.

  ===========================  =====================================================
  requires                     checked by `middleware_lifecycle` (before any run):
                               each must be in the union of all ``provides``, in any
                               list order; else `CapabilityError`
  provides                     after every ``setup`` ran, each must hold a value
                               (``ctx.provide``); else the run fails with
                               `CapabilityError` (``on_error`` runs)
  optional_requires            never checked; read with ``ctx.get_optional``
  ===========================  =====================================================
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar, cast

import attrs
import jsonschema_rs
import trio

from .._abort import Abort, AbortReason
from .._errors import ConfigError, MiddlewareError, MiddlewareShapeError, ModelError, RequestAbortedError
from .._groups import STRAY_CANCELLED, stray_cancellation
from .._json import MAX_JSON_DEPTH, MAX_JSON_INT_BITS
from .._loop._compose import compose_lifecycle
from .._loop._context import RunContext
from .._loop._events import RunEvent
from .._loop._hooks import (
    NO_HOOKS,
    ClientCall,
    ClientCallStages,
    Finished,
    HookAborted,
    Lifecycle,
    ModelConfig,
    ToolOutcome,
    await_under_abort,
)
from .._loop._interrupts import InterruptRequest, InterruptResolutions, ToolResume, checked_request
from .._loop._ports import RunEventSink
from .._loop._rules import LoopState
from .._models._messages import MESSAGE_CLASSES, ToolCallPart, ToolSpec, Usage
from .._tools import _stages
from .._tools._results import ToolErrorType, ToolResult, _unstorable, json_copy, result_problem
from .._tools._stages import Allow, Deny, StageDecision, StageRequest, ToolStages
from .._util import callable_name, describe, safe_repr
from ._capabilities import (
    Capability,
    Declared,
    capability_handles,
    check_provided,
    declared_capabilities,
    validate_capabilities,
)
from ._decisions import (
    DROP,
    AbortInfo,
    AbortRun,
    AfterToolCallDecision,
    AfterToolCallInfo,
    BeforeToolCallDecision,
    Drop,
    ErrorInfo,
    FinishInfo,
    GuardToolCallDecision,
    IterationInfo,
    MiddlewareDecisionError,
    Refuse,
    ReplaceResult,
    Skip,
    ToolCallInfo,
    ToolPhaseCompleteInfo,
    TransformArgs,
)
from ._routing import RoutedSubagentPersistence

_log = logging.getLogger("trio_agent.lifecycle")

__all__ = [
    "HOOK_NAMES",
    "ChatMiddleware",
    "ChunkDecision",
    "ConfigChange",
    "apply_structured_output_config",
    "define_chat_middleware",
    "middleware_lifecycle",
    "output_schema_json",
    "output_schema_validator",
    "structured_output_config",
]

T = TypeVar("T")
MaybeAwaitable: TypeAlias = T | Awaitable[T]

ConfigChange: TypeAlias = Mapping[str, Any] | ModelConfig | None
"""``on_config``: ``None`` passes, a partial mapping is shallow-merged, a `ModelConfig` replaces."""

ChunkDecision: TypeAlias = RunEvent | Sequence[RunEvent] | Drop | None
"""``on_chunk``: ``None`` keeps, an event replaces, a list expands (may be empty), `DROP` drops."""

HOOK_NAMES: tuple[str, ...] = (
    "setup",
    "on_config",
    "on_structured_output_config",
    "on_start",
    "on_iteration",
    "on_chunk",
    "on_before_tool_call",
    "on_guard_tool_call",
    "on_after_tool_call",
    "on_tool_phase_complete",
    "on_interrupt_boundary",
    "on_interrupt_resolution",
    "on_should_continue",
    "on_model_error",
    "on_usage",
    "on_finish",
    "on_abort",
    "on_error",
)
"""Every hook of `ChatMiddleware`, in the order a run reaches them."""

_CONFIG_FIELDS = frozenset(field.name for field in attrs.fields(ModelConfig))
_EVENT_TYPES: tuple[type, ...] = typing.get_args(RunEvent)
_MESSAGE_TYPES = tuple(MESSAGE_CLASSES)  # for isinstance()
_STARTED = "trio_agent.lifecycle.started"  # ctx.state key: when the run's setup ran (for durations)

# The pipeline's "end the call with a success, unrun" decision, once `_tools/_stages.py` has it.
_STAGE_SKIP: Callable[[ToolResult], object] | None = getattr(_stages, "Skip", None)


class ChatMiddleware:
    """Subclass and define any hooks (plain or ``async def``); see the module docstring for the rules.

    ``name`` names the middleware in errors and logs (default: the class name).
    Keep no per-run state on ``self``: one middleware serves many runs at once;
    use ``ctx.state`` (or capabilities: ``ctx.provide`` / ``ctx.get``).
    """

    name: str | None = None
    requires: tuple[Capability[Any], ...] = ()
    """Capabilities some middleware must provide (checked before the run, in any list order)."""
    provides: tuple[Capability[Any], ...] = ()
    """Capabilities this middleware provides: each must be ``ctx.provide``-d in ``setup``."""
    optional_requires: tuple[Capability[Any], ...] = ()
    """Capabilities used if present (``ctx.get_optional``); never checked."""
    routed_subagent_persistence: RoutedSubagentPersistence | None = None
    """Set it to store the subagent runs a session routes work to (see `RoutedSubagentPersistence`)."""

    def setup(self, ctx: RunContext) -> MaybeAwaitable[None]:
        """First, before the first ``on_config``, for every middleware in order."""
        return None

    def on_config(self, ctx: RunContext, config: ModelConfig) -> MaybeAwaitable[ConfigChange]:
        """Before the run (phase init) and before every model call; keys: ``instructions``,
        ``messages``, ``tools``, ``options``, ``metadata``. Each call starts from the run's own
        config (never an earlier call's answer): a change applies to that call alone."""
        return None

    def on_structured_output_config(
        self, ctx: RunContext, config: Mapping[str, Any]
    ) -> MaybeAwaitable[Mapping[str, Any] | None]:
        """Before the structured-output call, with the schema; a partial mapping is shallow-merged."""
        return None

    def on_start(self, ctx: RunContext) -> MaybeAwaitable[None]:
        """Once, after the first ``on_config`` and before any model call."""
        return None

    def on_iteration(self, ctx: RunContext, info: IterationInfo) -> MaybeAwaitable[None]:
        """At the start of each turn."""
        return None

    def on_chunk(self, ctx: RunContext, event: RunEvent) -> MaybeAwaitable[ChunkDecision]:
        """For every event of the run's stream."""
        return None

    def on_before_tool_call(self, ctx: RunContext, call: ToolCallInfo) -> MaybeAwaitable[BeforeToolCallDecision]:
        """Before a tool runs, with the model's args: `TransformArgs`, `Skip`, `AbortRun` or ``None``."""
        return None

    def on_guard_tool_call(self, ctx: RunContext, call: ToolCallInfo) -> MaybeAwaitable[GuardToolCallDecision]:
        """Just before a tool runs, with the final checked args: `Refuse`, `AbortRun` or ``None``."""
        return None

    def on_after_tool_call(self, ctx: RunContext, info: AfterToolCallInfo) -> MaybeAwaitable[AfterToolCallDecision]:
        """After a call was answered (or cut off): `ReplaceResult` or ``None``."""
        return None

    def on_tool_phase_complete(self, ctx: RunContext, info: ToolPhaseCompleteInfo) -> MaybeAwaitable[None]:
        """After every call of a turn was answered."""
        return None

    def on_interrupt_boundary(self, ctx: RunContext) -> MaybeAwaitable[Sequence[InterruptRequest] | None]:
        """At each boundary (``ctx.phase``: before / after model, before / after tools): questions
        that pause the run (`InterruptDefinition.request`); every middleware's form one batch.
        On a continuation ``ctx.parent_run_id`` is set (skip questions already answered)."""
        return None

    def on_interrupt_resolution(
        self, ctx: RunContext, resolutions: InterruptResolutions
    ) -> MaybeAwaitable[ToolResume | None]:
        """On a continuation whose batch held questions: their answers (keep them on a capability
        or in ``ctx.state``); return `ToolResume` (``stop`` > ``cancel`` > ``continue``)."""
        return None

    def on_should_continue(self, ctx: RunContext, state: LoopState) -> MaybeAwaitable[bool | None]:
        """Whether another turn may start; only ``False`` vetoes (the run then finishes normally)."""
        return None

    def on_model_error(self, ctx: RunContext, error: ModelError) -> MaybeAwaitable[None]:
        """A model call failed before any output; call ``ctx.retry()`` to call the model again."""
        return None

    def on_usage(self, ctx: RunContext, usage: Usage) -> MaybeAwaitable[None]:
        """Once per model call that reported usage."""
        return None

    def on_finish(self, ctx: RunContext, info: FinishInfo) -> MaybeAwaitable[None]:
        """The run ended normally (exactly one of on_finish / on_abort / on_error per run)."""
        return None

    def on_abort(self, ctx: RunContext, info: AbortInfo) -> MaybeAwaitable[None]:
        """The run was aborted."""
        return None

    def on_error(self, ctx: RunContext, info: ErrorInfo) -> MaybeAwaitable[None]:
        """The run failed."""
        return None


class _DefinedChatMiddleware(ChatMiddleware):
    """A middleware built from functions: each hook is an instance attribute, called without ``self``."""

    def __repr__(self) -> str:
        return f"<chat middleware {middleware_name(self)!r}>"


def define_chat_middleware(
    *,
    name: str | None = None,
    requires: Sequence[Capability[Any]] = (),
    provides: Sequence[Capability[Any]] = (),
    optional_requires: Sequence[Capability[Any]] = (),
    **hooks: Callable[..., Any] | None,
) -> ChatMiddleware:
    """A `ChatMiddleware` whose hooks are *hooks* (keyword-only, by hook name; ``None`` leaves one out)
    and whose capability declarations are *requires*, *provides* and *optional_requires*.

    Raises:
        MiddlewareShapeError: an unknown hook name (the message lists the valid ones), a hook
            that is not callable, a *name* that is not a string, or a declaration that is not
            a list or tuple of `Capability` handles (the message names the entry).
    """
    if name is not None and not isinstance(name, str):
        raise MiddlewareShapeError(f"define_chat_middleware: name must be a string, got {safe_repr(name)}")
    unknown = sorted(set(hooks) - set(HOOK_NAMES))
    if unknown:
        raise MiddlewareShapeError(
            f"define_chat_middleware: unknown hook {', '.join(map(repr, unknown))}; "
            f"valid hooks are: name, requires, provides, optional_requires, {', '.join(HOOK_NAMES)}"
        )
    middleware = _DefinedChatMiddleware()
    middleware.name = name
    owner = f"middleware {middleware_name(middleware)!r}"
    middleware.requires = capability_handles(requires, "requires", owner)
    middleware.provides = capability_handles(provides, "provides", owner)
    middleware.optional_requires = capability_handles(optional_requires, "optional_requires", owner)
    for hook, fn in hooks.items():
        if fn is None:
            continue
        if not callable(fn):
            raise MiddlewareShapeError(f"define_chat_middleware: hook {hook} is not callable: {safe_repr(fn)}")
        setattr(middleware, hook, fn)
    return middleware


def middleware_name(middleware: ChatMiddleware) -> str:
    name = middleware.name
    # Exactly a str: a subclass's own methods (its repr, in our messages) are the caller's code.
    return str.__str__(name) if isinstance(name, str) and name else type(middleware).__name__


def _key_text(key: object) -> str:
    """A key a hook returned, for a message naming it: a string as it is, anything else its repr."""
    return str.__str__(key) if isinstance(key, str) else safe_repr(key)


def _hook(middleware: ChatMiddleware, hook: str) -> Callable[..., Any] | None:
    """The middleware's *hook*, or ``None`` where it keeps the base class's no-op."""
    value = getattr(middleware, hook, None)
    if value is None:
        return None
    if getattr(value, "__func__", None) is getattr(ChatMiddleware, hook):
        return None
    if not callable(value):
        raise MiddlewareShapeError(
            f"{hook} of middleware {middleware_name(middleware)!r} is not callable: {safe_repr(value)}"
        )
    return cast("Callable[..., Any]", value)


async def _call(hook: Callable[..., Any], *args: Any) -> Any:
    try:
        value = hook(*args)
        if inspect.isawaitable(value):
            value = await value
    except BaseException as exc:
        _stray(hook, exc)
        raise
    return value


async def _cut_call(ctx: RunContext, hook: Callable[..., Any], *args: Any) -> Any:
    """`_call` for a hook the loop awaits outside the tool pipeline and the model call (none of
    on_finish / on_abort / on_error): an ``async`` one is awaited under the run's abort, which
    cuts it (`HookAborted`: the run ends aborted); a plain one has nothing to cut, and no scope."""
    try:
        value = hook(*args)
        if inspect.isawaitable(value):
            value = await await_under_abort(ctx._abort, value)
    except BaseException as exc:
        _stray(hook, exc)
        raise
    return value


def _stray(hook: Callable[..., Any], exc: BaseException) -> None:
    # A Cancelled nothing around the hook made (its own scope's, raised outside it) would
    # unwind the run as a cancellation nobody made: it is the hook's failure.
    if isinstance(exc, Exception) or not stray_cancellation(exc):
        return
    told = describe(exc, "repr")
    raise MiddlewareError(f"chat middleware hook {callable_name(hook)} raised {told} {STRAY_CANCELLED}") from exc


# -- decision checks (each names the hook and the middleware) ---------------------------------


def _merged_config(change: object, config: ModelConfig, label: str) -> ModelConfig:
    if change is None:
        return config
    whole = change if isinstance(change, ModelConfig) else None
    if isinstance(change, ModelConfig):
        if change is config:
            return config
        # A whole config is checked as a partial dict of what it changed (attrs checks no types).
        change = {
            name: value for name in _CONFIG_FIELDS if (value := getattr(change, name)) is not getattr(config, name)
        }
    elif not isinstance(change, Mapping):
        raise MiddlewareDecisionError(
            "on_config", label, f"returned {safe_repr(change)}; expected None, a partial dict or a ModelConfig"
        )
    unknown = sorted(_key_text(key) for key in change if key not in _CONFIG_FIELDS)
    if unknown:
        raise MiddlewareDecisionError(
            "on_config", label, f"returned unknown config keys {unknown}; valid keys: {sorted(_CONFIG_FIELDS)}"
        )
    # What it kept as it was needs no check (the history itself is a view, not a list).
    updates = {key: value for key, value in change.items() if value is not getattr(config, key)}
    if not updates:
        return config
    if "messages" in updates and isinstance(updates["messages"], (list, tuple)):
        for index, message in enumerate(updates["messages"]):
            if not isinstance(message, _MESSAGE_TYPES):
                raise MiddlewareDecisionError(
                    "on_config", label, f"set messages[{index}] to {safe_repr(message)}, which is not a Message"
                )
    if "instructions" in updates and not isinstance(updates["instructions"], str):
        raise MiddlewareDecisionError(
            "on_config", label, f"set instructions to {safe_repr(updates['instructions'])}, not a str"
        )
    for key in ("messages", "tools"):
        if key in updates and not isinstance(updates[key], (list, tuple)):
            raise MiddlewareDecisionError("on_config", label, f"set {key} to {safe_repr(updates[key])}, not a list")
    for key in ("options", "metadata"):
        if key in updates and not isinstance(updates[key], Mapping):
            raise MiddlewareDecisionError("on_config", label, f"set {key} to {safe_repr(updates[key])}, not a mapping")
    if "tools" in updates:
        tools = tuple(updates["tools"])
        if not all(isinstance(tool, ToolSpec) for tool in tools):
            raise MiddlewareDecisionError(
                "on_config", label, f"set tools to {safe_repr(tools)}; each must be a ToolSpec"
            )
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise MiddlewareDecisionError("on_config", label, f"set tools with duplicate names: {names}")
        updates["tools"] = tools
    if whole is not None and whole.tools is updates.get("tools", whole.tools):
        return whole  # checked, and nothing to convert
    return attrs.evolve(config, **updates)


def _chunk_events(decision: object, event: RunEvent, label: str) -> Sequence[RunEvent]:
    if decision is None:
        return (event,)
    if decision is DROP:
        return ()
    if isinstance(decision, _EVENT_TYPES):
        return (cast("RunEvent", decision),)
    if isinstance(decision, (list, tuple)):
        for item in decision:
            if not isinstance(item, _EVENT_TYPES):
                raise MiddlewareDecisionError(
                    "on_chunk", label, f"returned a list holding {safe_repr(item)}, which is not a RunEvent"
                )
        return cast("Sequence[RunEvent]", decision)
    raise MiddlewareDecisionError(
        "on_chunk", label, f"returned {safe_repr(decision)}; expected None, a RunEvent, a list of RunEvents or DROP"
    )


def _abort_call(ctx: RunContext, reason: object, hook: str, label: str) -> Deny:
    if not isinstance(reason, str) or not reason:
        raise MiddlewareDecisionError(
            hook, label, f"returned AbortRun with reason {safe_repr(reason)}, not a non-empty str"
        )
    ctx.abort(reason)
    # What the pipeline answers a call its abort interrupted (`_aborted_result`), in case the
    # abort reaches the call only after this stage returned.
    return Deny(f"tool call {reason}", ToolErrorType.INTERRUPTED, AbortReason.USER_ABORT.value)


def _skip_result(value: object) -> ToolResult:
    return value if isinstance(value, ToolResult) else ToolResult.success(value)


def _replaced(current: ToolResult, replacement: object) -> ToolResult:
    if isinstance(replacement, ToolResult):
        if current.ok or not replacement.ok:
            return replacement
        return attrs.evolve(current, output=replacement.output)  # an error stays an error
    # A bare value is what the model reads; display and data described the old output.
    return attrs.evolve(current, output=replacement, display=None, data=None)


def _after_result(decision: object, current: ToolResult, label: str) -> ToolResult | None:
    if decision is None:
        return None
    if isinstance(decision, ReplaceResult):
        return _replaced(current, decision.result)
    raise MiddlewareDecisionError(
        "on_after_tool_call", label, f"returned {safe_repr(decision)}; expected None or ReplaceResult"
    )


# -- the adapter -------------------------------------------------------------------------


class _Part(Lifecycle):
    """One middleware as a lifecycle part; the hooks come from `_PartHooks`, only those it needs."""

    def __init__(self, middleware: ChatMiddleware, hooks: Mapping[str, Callable[..., Any]]) -> None:
        self.middleware = middleware
        self.name = middleware_name(middleware)
        self.hooks = hooks
        self.timed = any(name in hooks for name in ("on_finish", "on_abort", "on_error"))

    def __repr__(self) -> str:
        return f"<lifecycle of chat middleware {self.name!r}>"

    def duration(self, ctx: RunContext) -> float:
        now = trio.current_time()
        started = ctx.state.get(_STARTED, now)
        return now - started if isinstance(started, float) else 0.0


class _PartHooks(_Part):
    """The adapted hooks; never instantiated: `_part_class` copies the ones a middleware needs."""

    async def setup(self, ctx: RunContext) -> None:
        if self.timed:
            ctx.state.setdefault(_STARTED, trio.current_time())
        hook = self.hooks.get("setup")
        if hook is not None:
            await _cut_call(ctx, hook, ctx)

    async def on_config(self, ctx: RunContext, config: ModelConfig) -> ModelConfig:
        return _merged_config(await _cut_call(ctx, self.hooks["on_config"], ctx, config), config, self.name)

    async def on_start(self, ctx: RunContext) -> None:
        await _cut_call(ctx, self.hooks["on_start"], ctx)

    async def on_interrupt_boundary(self, ctx: RunContext) -> Sequence[InterruptRequest]:
        requests = await _cut_call(ctx, self.hooks["on_interrupt_boundary"], ctx)
        if requests is None:
            return ()
        if isinstance(requests, InterruptRequest):
            requests = (requests,)
        elif not isinstance(requests, (list, tuple)) or not all(isinstance(r, InterruptRequest) for r in requests):
            raise MiddlewareDecisionError(
                "on_interrupt_boundary", self.name,
                f"returned {safe_repr(requests)}; "
                "expected None or a list of InterruptRequest (definition.request(...))",
            )  # fmt: skip
        checked: list[InterruptRequest] = []
        for request in requests:
            # One built directly (not by definition.request) is held to request()'s checks: a pause
            # must be able to hold it (the journal, to_json), and its payload is what the schema says.
            try:
                checked.append(checked_request(request))
            except ConfigError as exc:
                raise MiddlewareDecisionError(
                    "on_interrupt_boundary", self.name, f"returned an invalid InterruptRequest: {exc}"
                ) from None
        return tuple(checked)

    async def on_interrupt_resolution(self, ctx: RunContext, resolutions: InterruptResolutions) -> ToolResume | None:
        answer = await _cut_call(ctx, self.hooks["on_interrupt_resolution"], ctx, resolutions)
        if answer is None:
            return None
        try:
            return ToolResume(answer)
        except Exception:  # the enum's own ValueError formats the value with %r, which may raise anything
            raise MiddlewareDecisionError(
                "on_interrupt_resolution", self.name,
                f"returned {safe_repr(answer)}; expected None or ToolResume ('continue', 'cancel', 'stop')",
            ) from None  # fmt: skip

    async def on_iteration(self, ctx: RunContext, iteration: int, message_id: str) -> None:
        await _cut_call(ctx, self.hooks["on_iteration"], ctx, IterationInfo(iteration, message_id))

    def wrap_events(self, ctx: RunContext, sink: RunEventSink) -> RunEventSink:
        hook, label = self.hooks["on_chunk"], self.name

        async def through(event: RunEvent) -> None:
            # Awaited one event at a time, so events leave in the order they came.
            for out in _chunk_events(await _call(hook, ctx, event), event, label):
                await sink(out)

        return through

    def tool_stages(self, ctx: RunContext) -> ToolStages:
        before = self.hooks.get("on_before_tool_call")
        guard = self.hooks.get("on_guard_tool_call")
        after = self.hooks.get("on_after_tool_call")
        label = self.name

        async def before_stage(request: StageRequest) -> StageDecision | None:
            assert before is not None
            decision = await _call(before, ctx, _call_info(request))
            return _before_decision(ctx, decision, label)

        async def guard_stage(request: StageRequest) -> StageDecision | None:
            assert guard is not None
            return _guard_decision(ctx, await _call(guard, ctx, _call_info(request)), label)

        async def post_stage(request: StageRequest, result: ToolResult) -> ToolResult | None:
            assert after is not None
            info = AfterToolCallInfo(request.tool.name, request.context.tool_call_id, request.input, result)
            return _after_result(await _call(after, ctx, info), result, label)

        # Named after the middleware: the pipeline names a failing stage by its __qualname__.
        before_stage.__qualname__ = f"{label}.on_before_tool_call"
        guard_stage.__qualname__ = f"{label}.on_guard_tool_call"
        post_stage.__qualname__ = f"{label}.on_after_tool_call"
        return ToolStages(
            before=(before_stage,) if before is not None else (),
            guard=(guard_stage,) if guard is not None else (),
            post_tool=(post_stage,) if after is not None else (),
        )

    def client_call_stages(self, ctx: RunContext) -> ClientCallStages:
        # The same hooks, for a client tool's call before it goes to the client (``tool`` is None).
        before = self.hooks.get("on_before_tool_call")
        guard = self.hooks.get("on_guard_tool_call")
        label = self.name

        async def before_stage(call: ClientCall) -> StageDecision | None:
            assert before is not None
            info = ToolCallInfo(call.tool_name, call.call_id, call.input)
            return _before_decision(ctx, await _call(before, ctx, info), label)

        async def guard_stage(call: ClientCall) -> StageDecision | None:
            assert guard is not None
            # Its own copy: the input is checked by now and goes to the client (and into the pause) as it
            # is; a change made in place would skip that check (a new input goes by TransformArgs).
            info = ToolCallInfo(call.tool_name, call.call_id, json_copy(call.input))
            return _guard_decision(ctx, await _call(guard, ctx, info), label)

        before_stage.__qualname__ = f"{label}.on_before_tool_call"
        guard_stage.__qualname__ = f"{label}.on_guard_tool_call"
        return ClientCallStages(
            before=(before_stage,) if before is not None else (),
            guard=(guard_stage,) if guard is not None else (),
        )

    async def on_cut_off_call(self, ctx: RunContext, call: ToolCallPart, result: ToolResult) -> ToolResult:
        # As a post_tool stage that fails on an error result (`tool_stages`): the call's error (the
        # cut-off) stays, the failure is logged; it never fails the run.
        info = AfterToolCallInfo(call.name, call.id, call.arguments, result)
        try:
            answer = await _cut_call(ctx, self.hooks["on_after_tool_call"], ctx, info)
            replaced = _after_result(answer, result, self.name)
        except HookAborted:
            raise  # the run's abort: not a failure of the hook
        except Exception:
            _log.warning("on_after_tool_call of %r failed on cut-off call %r", self.name, call.id, exc_info=True)
            return result
        if replaced is None:
            return result
        if result_problem(replaced) is not None:
            # As a post_tool stage's replacement (`_post_stages`): that call fails, typed, not the run
            # (nor the pause that holds it, nor the journal record after RunFinished).
            return _unstorable(replaced, f"on_after_tool_call of middleware {self.name!r} returned")
        return replaced

    async def on_tool_phase_complete(self, ctx: RunContext, outcomes: Sequence[ToolOutcome]) -> None:
        await _cut_call(ctx, self.hooks["on_tool_phase_complete"], ctx, ToolPhaseCompleteInfo(tuple(outcomes)))

    async def should_continue(self, ctx: RunContext, state: LoopState) -> bool:
        decision = await _cut_call(ctx, self.hooks["on_should_continue"], ctx, state)
        if decision is None or isinstance(decision, bool):
            return decision is not False
        raise MiddlewareDecisionError(
            "on_should_continue", self.name, f"returned {safe_repr(decision)}; expected True, False or None"
        )

    async def on_model_error(self, ctx: RunContext, error: ModelError) -> bool:
        await _cut_call(ctx, self.hooks["on_model_error"], ctx, error)
        return ctx._retry_requested  # the driver opens ctx.retry() around this hook and reads the flag

    async def on_usage(self, ctx: RunContext, usage: Usage) -> None:
        await _cut_call(ctx, self.hooks["on_usage"], ctx, usage)

    async def on_finish(self, ctx: RunContext, outcome: Finished) -> None:
        info = FinishInfo(outcome.stop_reason, outcome.text, outcome.turns, self.duration(ctx))
        await _call(self.hooks["on_finish"], ctx, info)

    async def on_abort(self, ctx: RunContext, abort: Abort) -> None:
        await _call(self.hooks["on_abort"], ctx, AbortInfo(abort.message, self.duration(ctx), abort.reason))

    async def on_error(self, ctx: RunContext, error: BaseException) -> None:
        await _call(self.hooks["on_error"], ctx, ErrorInfo(error, self.duration(ctx)))


def _call_info(request: StageRequest) -> ToolCallInfo:
    return ToolCallInfo(request.tool.name, request.context.tool_call_id, request.input, request.tool)


def _before_decision(ctx: RunContext, decision: object, label: str) -> StageDecision | None:
    if decision is None:
        return None
    if isinstance(decision, TransformArgs):
        if not isinstance(decision.args, dict):
            raise MiddlewareDecisionError(
                "on_before_tool_call", label, f"returned TransformArgs with {safe_repr(decision.args)}, not a dict"
            )
        return Allow(input=decision.args)
    if isinstance(decision, Skip):
        if _STAGE_SKIP is None:
            raise MiddlewareError(
                f"on_before_tool_call of middleware {label!r} returned Skip, which this tool pipeline "
                "cannot honour yet (it has no Skip stage decision)"
            )
        return cast("StageDecision", _STAGE_SKIP(_skip_result(decision.result)))
    if isinstance(decision, AbortRun):
        return _abort_call(ctx, decision.reason, "on_before_tool_call", label)
    raise MiddlewareDecisionError(
        "on_before_tool_call", label, f"returned {safe_repr(decision)}; expected None, TransformArgs, Skip or AbortRun"
    )


def _guard_decision(ctx: RunContext, decision: object, label: str) -> StageDecision | None:
    if decision is None:
        return None
    if isinstance(decision, Refuse):
        # attrs checks no types: a code that is no string would fail the call's settlement.
        message, code = decision.message, decision.code
        if not isinstance(message, str) or not message:
            raise MiddlewareDecisionError(
                "on_guard_tool_call", label, f"returned Refuse with message {safe_repr(message)}, not a non-empty str"
            )
        if not isinstance(code, str) or not code:
            raise MiddlewareDecisionError(
                "on_guard_tool_call", label, f"returned Refuse with code {safe_repr(code)}, not a non-empty str"
            )
        return Deny(message, ToolErrorType.PERMISSION_DENIED, code)
    if isinstance(decision, AbortRun):
        return _abort_call(ctx, decision.reason, "on_guard_tool_call", label)
    raise MiddlewareDecisionError(
        "on_guard_tool_call", label, f"returned {safe_repr(decision)}; expected None, Refuse or AbortRun"
    )


# Which loop hooks each middleware hook needs (the terminal ones need setup for the clock).
_LOOP_HOOKS: Mapping[str, tuple[str, ...]] = {
    "setup": ("setup",),
    "on_config": ("on_config",),
    "on_start": ("on_start",),
    "on_iteration": ("on_iteration",),
    "on_chunk": ("wrap_events",),
    "on_before_tool_call": ("tool_stages", "client_call_stages"),
    "on_guard_tool_call": ("tool_stages", "client_call_stages"),
    "on_after_tool_call": ("tool_stages", "on_cut_off_call"),
    "on_tool_phase_complete": ("on_tool_phase_complete",),
    "on_interrupt_boundary": ("on_interrupt_boundary",),
    "on_interrupt_resolution": ("on_interrupt_resolution",),
    "on_should_continue": ("should_continue",),
    "on_model_error": ("on_model_error",),
    "on_usage": ("on_usage",),
    "on_finish": ("setup", "on_finish"),
    "on_abort": ("setup", "on_abort"),
    "on_error": ("setup", "on_error"),
}


@functools.cache
def _part_class(loop_hooks: frozenset[str]) -> type[_Part]:
    # Overrides exactly the loop hooks the middleware needs: `compose_lifecycle` leaves the
    # others out of their chains (an on_chunk-less list costs nothing per event).
    namespace = {name: _PartHooks.__dict__[name] for name in loop_hooks}
    return cast("type[_Part]", type("ChatMiddlewarePart", (_Part,), namespace))


class _CountDelivered(Lifecycle):
    """The innermost event decorator: counts the events that made it past every ``on_chunk``."""

    name = "chunk counter"

    def wrap_events(self, ctx: RunContext, sink: RunEventSink) -> RunEventSink:
        async def count(event: RunEvent) -> None:
            await sink(event)
            ctx.chunk_index += 1

        return count


class _CheckProvided(Lifecycle):
    """The last ``setup``: every declared ``provides`` holds a value by now."""

    name = "capability check"

    def __init__(self, declared: Sequence[Declared]) -> None:
        self.declared = tuple(item for item in declared if item.provides)

    async def setup(self, ctx: RunContext) -> None:
        check_provided(ctx.capabilities, self.declared)


def _checked(middleware: object, where: str) -> Sequence[ChatMiddleware]:
    if not isinstance(middleware, (list, tuple)):
        raise MiddlewareShapeError(f"{where}: middleware must be a list of ChatMiddleware, got {safe_repr(middleware)}")
    for index, item in enumerate(middleware):
        if not isinstance(item, ChatMiddleware):
            raise MiddlewareShapeError(
                f"{where}: middleware #{index} is not a ChatMiddleware "
                f"(subclass it or use define_chat_middleware): {safe_repr(item)}"
            )
    return middleware


def middleware_lifecycle(middleware: Sequence[ChatMiddleware]) -> Lifecycle:
    """The `Lifecycle` that runs *middleware* in list order (module docstring).

    Raises:
        MiddlewareShapeError: *middleware* is not a list or tuple, an item is not a
            `ChatMiddleware` (the message names its index), a hook is not callable, or a
            capability declaration is not a tuple of `Capability` handles.
        CapabilityError: a middleware requires a capability no middleware provides
            (`validate_capabilities`).
    """
    if not middleware and type(middleware) in (list, tuple):
        return NO_HOOKS  # nothing to check or compose (a chat() run per request asks this)
    checked = _checked(middleware, "middleware_lifecycle")
    validate_capabilities(checked)
    declared = [declared_capabilities(item) for item in checked]
    parts: list[Lifecycle] = []
    for item in checked:
        hooks = {name: fn for name in HOOK_NAMES if (fn := _hook(item, name)) is not None}
        loop_hooks = frozenset(loop for name in hooks for loop in _LOOP_HOOKS.get(name, ()))
        if loop_hooks:
            parts.append(_part_class(loop_hooks)(item, hooks))
    if any(item.provides for item in declared):
        parts.append(_CheckProvided(declared))
    if any("on_chunk" in part.hooks for part in parts if isinstance(part, _Part)):
        parts.append(_CountDelivered())
    return compose_lifecycle(*parts)


def output_schema_json(schema: object) -> dict[str, Any]:
    """*schema* (an output schema: a JSON Schema object) as a copy of plain JSON, or `ValueError`
    saying in one line where it is not JSON.

    A mapping becomes a dict and a tuple a list; keys must be strings, numbers finite (the
    validator reads ``NaN`` as null, and a provider's request body refuses it) and integers within
    `MAX_JSON_INT_BITS`; containers nest at most `MAX_JSON_DEPTH` deep (a dict holding itself
    too). The copy is the run's own: what the caller or a hook later does to theirs changes
    neither what is sent nor what the answer is checked against.
    """
    if not isinstance(schema, Mapping):
        raise ValueError(f"not a JSON Schema object (a mapping): {safe_repr(schema)}")
    try:
        return cast("dict[str, Any]", _plain_json(schema, 0))
    except _NotJSON as exc:
        path = exc.path[::-1]
        if len(path) > 8:  # a schema nested too deep (or holding itself): its ends tell where
            path = [*path[:4], f"... {len(path) - 8} more ...", *path[-4:]]
        where = "/" + "/".join(path) if path else "the root"
        raise ValueError(f"not JSON: at {where}: {exc.why}") from None


class _NotJSON(Exception):
    """Where (`path`, innermost key first) and why a schema is not JSON."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        self.path: list[str] = []


def _plain_json(value: object, depth: int) -> Any:
    # Exact builtins out: a subclass's own methods (a str's, an int's) are the caller's code.
    if isinstance(value, str):
        return str.__str__(value)
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        bits = int.bit_length(value)
        if bits > MAX_JSON_INT_BITS:
            raise _NotJSON(f"an integer too large for JSON ({bits} bits, at most {MAX_JSON_INT_BITS})")
        return int.__int__(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _NotJSON(f"{float.__repr__(value)}, not a finite number")
        return float.__float__(value)
    if depth >= MAX_JSON_DEPTH:
        raise _NotJSON(f"containers nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, Mapping):
        plain: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _NotJSON(f"a key that is not a string: {safe_repr(key)}")
            key = str.__str__(key)
            try:
                plain[key] = _plain_json(item, depth + 1)
            except _NotJSON as exc:
                exc.path.append(key.replace("~", "~0").replace("/", "~1"))  # a JSON Pointer's escapes
                raise
        return plain
    if isinstance(value, (list, tuple)):
        items: list[Any] = []
        for index, item in enumerate(value):
            try:
                items.append(_plain_json(item, depth + 1))
            except _NotJSON as exc:
                exc.path.append(str(index))
                raise
        return items
    raise _NotJSON(f"a value of type {type(value).__name__}, which is not JSON")


def output_schema_validator(schema: dict[str, Any]) -> jsonschema_rs.Validator:
    """*schema* (plain JSON: `output_schema_json`'s copy) compiled, or `ValueError` saying in one
    line why it is not JSON Schema."""
    try:
        return jsonschema_rs.Draft202012Validator(schema, offline=True)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError, TypeError) as exc:
        raise ValueError(f"not valid JSON Schema: {str(exc).splitlines()[0]}") from None


def _structured_change(change: Mapping[str, Any], current: Mapping[str, Any], label: str) -> None:
    """Each key of an ``on_structured_output_config`` answer holds what its call can send (as
    `_merged_config` checks ``on_config``'s); ``output_schema`` is `_schema_change`'s."""
    hook = "on_structured_output_config"
    # What it kept as it was needs no check (the history itself is a view, not a list).
    change = {key: value for key, value in change.items() if value is not current[key]}
    if "instructions" in change and not isinstance(change["instructions"], str):
        raise MiddlewareDecisionError(
            hook, label, f"set instructions to {safe_repr(change['instructions'])}, not a str"
        )
    if "messages" in change:
        messages = change["messages"]
        if not isinstance(messages, (list, tuple)):
            raise MiddlewareDecisionError(hook, label, f"set messages to {safe_repr(messages)}, not a list")
        for index, message in enumerate(messages):
            if not isinstance(message, _MESSAGE_TYPES):
                raise MiddlewareDecisionError(
                    hook, label, f"set messages[{index}] to {safe_repr(message)}, which is not a Message"
                )
    for key in ("options", "metadata"):
        if key in change and not isinstance(change[key], Mapping):
            raise MiddlewareDecisionError(hook, label, f"set {key} to {safe_repr(change[key])}, not a mapping")


def _schema_change(
    value: object, current: dict[str, Any] | None, label: str, how: str
) -> tuple[dict[str, Any], jsonschema_rs.Validator] | None:
    """The schema a hook left (*value*, *how* it did) as the run's own copy, compiled; ``None``
    when it equals *current*. Every way a hook leaves one is checked here: an invalid one is a
    `MiddlewareDecisionError` naming the hook and the middleware, before anything is sent."""
    try:
        schema = output_schema_json(value)
        # As text: what is sent. (By value, 1 == 1.0 == True, but a schema tells them apart.)
        if current is not None and json.dumps(schema) == json.dumps(current):
            return None
        return schema, output_schema_validator(schema)
    except ValueError as exc:
        raise MiddlewareDecisionError("on_structured_output_config", label, f"{how}, which is {exc}") from None


async def apply_structured_output_config(
    middleware: Sequence[ChatMiddleware], ctx: RunContext, config: Mapping[str, Any]
) -> dict[str, Any]:
    """Pipe *config* (the structured-output call's, schema included) through every
    ``on_structured_output_config``: ``None`` passes, a partial mapping is shallow-merged.
    Each hook gets its own copy of the schema: what it returns, or leaves edited in place, is
    checked, and the result holds a copy of it as plain JSON (`output_schema_json`).

    Raises:
        ConfigError: *config*'s own ``output_schema`` is not JSON (`output_schema_json`).
        MiddlewareDecisionError: a hook returned something else, a key *config* does not have,
            or a value its key cannot hold (``output_schema`` must be valid JSON Schema).
        RequestAbortedError: *ctx*'s abort cut an ``async`` hook (it landed while the hook ran,
            or before); ``reason`` is the abort's (an `AbortReason` value), as for an aborted
            ``send``. The hooks after it are not called.
    """
    config = dict(config)
    if config.get("output_schema") is not None:
        try:
            config["output_schema"] = output_schema_json(config["output_schema"])
        except ValueError as exc:
            raise ConfigError(f"output_schema: {exc}") from None
    try:
        return (await structured_output_config(middleware, ctx, config))[0]
    except HookAborted as exc:
        # The loop's own signal (it ends the run aborted), not a public error: a caller outside
        # the loop gets the one an aborted request raises. The cause (the hook's own cleanup
        # failing as a group, if any) goes on; the internal exception does not.
        abort = ctx._abort.reason
        reason = abort.reason if abort is not None else AbortReason.USER_ABORT
        told = f": {abort.message}" if abort is not None and abort.message else ""
        raise RequestAbortedError(
            f"on_structured_output_config was cut by the run's abort{told}", reason=reason.value
        ) from exc.__cause__


async def structured_output_config(
    middleware: Sequence[ChatMiddleware], ctx: RunContext, config: Mapping[str, Any]
) -> tuple[dict[str, Any], jsonschema_rs.Validator | None]:
    """`apply_structured_output_config` for a *config* whose ``output_schema`` is plain JSON
    already (``chat()``'s copy), and the validator of the schema the hooks left (``None``: they
    left it as it was, the very object given)."""
    current = dict(config)
    validator: jsonschema_rs.Validator | None = None
    for item in _checked(middleware, "apply_structured_output_config"):
        hook = _hook(item, "on_structured_output_config")
        if hook is None:
            continue
        given = dict(current)
        schema = current.get("output_schema")
        if schema is not None:
            # Its own deep copy: an edit in place must not reach the schema compiled already (nor
            # the caller's dict). A round trip of plain JSON, the cheapest deep copy of it.
            given["output_schema"] = json.loads(json.dumps(schema))
        change = await _cut_call(ctx, hook, ctx, given)
        label = middleware_name(item)
        if change is None:
            change = {}
        elif not isinstance(change, Mapping):
            raise MiddlewareDecisionError(
                "on_structured_output_config", label, f"returned {safe_repr(change)}; expected None or a partial dict"
            )
        else:
            unknown = sorted(_key_text(key) for key in change if key not in current)
            if unknown:
                raise MiddlewareDecisionError(
                    "on_structured_output_config", label, f"returned unknown keys {unknown}; valid: {sorted(current)}"
                )
        _structured_change(change, current, label)
        change = dict(change)
        returned = "output_schema" in change
        if returned or schema is not None:
            # Returned, else what it left in its copy (edited in place, or put in its config).
            left = change.pop("output_schema") if returned else given.get("output_schema")
            how = "set output_schema" if returned else "left output_schema edited in place"
            edit = _schema_change(left, schema, label, how)
            if edit is not None:
                change["output_schema"], validator = edit
        current = {**current, **change}
    return current, validator
