"""Hook events: lifecycle callbacks registered by a session and its plugins, and their dispatch.

A hook is ``async def hook(input: HookInput) -> HookOutput | None`` registered
for one `HookEvent`. `HookRunner.dispatch` runs an event's callbacks::

    session hooks (registration order), then each plugin's (plugin order, then list order)
      -> every callback runs, in order, each with its own copy of the ORIGINAL input
      -> the results are folded in order: modified input merged (shallow),
         additional context concatenated, until the first ``skip`` or ``abort``
    one deadline per event, shared by all its callbacks

A hook that raises, returns something other than a `HookOutput` or ``None``,
or misses the deadline makes ``dispatch`` raise a `HookError`; the caller
decides what that means. The tool-stage adapters (`pre_tool_stage`,
`post_tool_stage`) fail closed: the model sees an error result. See
docs/hooks.md for the per-event table.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeAlias

import attrs
import trio

from .._abort import AbortHandle
from .._config import validate_timeout
from .._errors import (
    ConfigError,
    HookAbortedError,
    HookError,
    HookInterruptedError,
    HookReturnError,
    HookTimeoutError,
    LeaseLostError,
)
from .._groups import STRAY_CANCELLED, contains_cancelled, stray_cancellation, typed_error
from .._json import json_problem
from .._loop._rules import model_text
from .._tools._context import ExecutionContext
from .._tools._results import JsonObject, ToolError, ToolErrorType, ToolResult, describe, json_copy
from .._tools._stages import Allow, Deny, PostStage, Stage, StageRequest
from .._util import instance_of, safe_repr

__all__ = [
    "DEFAULT_HOOK_DEADLINE",
    "DEFAULT_HOOK_DEADLINES",
    "HOOK_INPUT_CLASSES",
    "HookAbortedError",
    "HookAction",
    "HookCallback",
    "HookDecision",
    "HookError",
    "HookEvent",
    "HookInput",
    "HookInterruptedError",
    "HookOutput",
    "HookRegistry",
    "HookReturnError",
    "HookRunner",
    "HookTimeoutError",
    "PermissionRequestInput",
    "PostToolUseFailureInput",
    "PostToolUseInput",
    "PreToolUseInput",
    "RegisteredHook",
    "SessionEndInput",
    "SessionStartInput",
    "StopInput",
    "SubagentStartInput",
    "SubagentStopInput",
    "UserPromptSubmitInput",
    "post_tool_stage",
    "pre_tool_stage",
    "typed_input",
]

logger = logging.getLogger("trio_agent.hooks")


class HookEvent(enum.Enum):
    """The events a session dispatches to hooks.

    Values are snake_case like every other enum of trio_agent; the reference's
    PascalCase names are accepted too: ``HookEvent("PreToolUse") is HookEvent.PRE_TOOL_USE``.
    """

    SESSION_START = "session_start"
    USER_PROMPT_SUBMIT = "user_prompt_submit"
    PRE_TOOL_USE = "pre_tool_use"
    PERMISSION_REQUEST = "permission_request"
    POST_TOOL_USE = "post_tool_use"
    POST_TOOL_USE_FAILURE = "post_tool_use_failure"
    SUBAGENT_START = "subagent_start"
    SUBAGENT_STOP = "subagent_stop"
    STOP = "stop"
    SESSION_END = "session_end"

    @property
    def title(self) -> str:
        """The reference's PascalCase name, e.g. ``"PreToolUse"``."""
        return _TITLES[self]

    @classmethod
    def _missing_(cls, value: object) -> HookEvent | None:
        if isinstance(value, str):
            return _BY_TITLE.get(value)
        return None


_TITLES = {event: "".join(part.capitalize() for part in event.value.split("_")) for event in HookEvent}
_BY_TITLE = {title: event for event, title in _TITLES.items()}


class HookAction(enum.Enum):
    """What a hook asks for; see docs/hooks.md for what each means per event."""

    CONTINUE = "continue"
    SKIP = "skip"
    ABORT = "abort"


# -- input and output --------------------------------------------------------------


def _optional(kind: type | tuple[type, ...]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    return attrs.validators.optional(instance_of(kind))


def _mapping_copy(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"extra must be a mapping, got {type(value).__name__}")
    return dict(value)


@attrs.frozen
class HookInput:
    """What a hook callback receives: the base of the ten per-event input classes.

    A callback gets the class of its event (`PreToolUseInput`, `UserPromptSubmitInput`,
    ...; see `HOOK_INPUT_CLASSES` and docs/hooks.md), whose fields that the event
    always sets are typed as such (``PreToolUseInput.tool_name`` is a ``str``).
    The fields of other events stay readable and are ``None``, so a callback
    typed ``HookInput`` keeps working. ``HookInput(event=..., ...)`` still builds
    an input of any event; `HookRunner.dispatch` turns it into the event's class.

    Every callback gets its own copy of the event's ORIGINAL input: a change made
    by one callback (in place or through ``modified_input``) is never seen by the
    next one. Inside a callback, ``trio.current_effective_deadline()`` is the
    event's deadline.
    """

    event: HookEvent = attrs.field(validator=instance_of(HookEvent))
    session_id: str = attrs.field(validator=instance_of(str))
    agent_id: str = attrs.field(default="root", validator=instance_of(str))
    tool_name: str | None = attrs.field(default=None, validator=_optional(str))
    tool_call_id: str | None = attrs.field(default=None, validator=_optional(str))
    tool_input: JsonObject | None = attrs.field(default=None, validator=_optional(dict))
    tool_result: ToolResult | None = attrs.field(default=None, validator=_optional(ToolResult))
    error: ToolError | None = attrs.field(default=None, validator=_optional(ToolError))
    prompt: str | None = attrs.field(default=None, validator=_optional(str))
    subagent_id: str | None = attrs.field(default=None, validator=_optional(str))
    subagent_type: str | None = attrs.field(default=None, validator=_optional(str))
    last_message: str | None = attrs.field(default=None, validator=_optional(str))
    reason: str | None = attrs.field(default=None, validator=_optional(str))
    extra: Mapping[str, Any] = attrs.field(factory=dict, converter=_mapping_copy)

    def __attrs_post_init__(self) -> None:
        own = _EVENT_FIELDS.get(type(self))
        if own is None:
            return
        foreign = [name for name in _EVENT_SPECIFIC if name not in own and getattr(self, name) is not None]
        if foreign:
            raise TypeError(
                f"{type(self).__name__} has no {', '.join(foreign)}: {self.event.title} hooks receive "
                f"{', '.join(sorted(own)) or 'only session_id, agent_id and extra'}"
            )


_EVENT_SPECIFIC = (
    "tool_name",
    "tool_call_id",
    "tool_input",
    "tool_result",
    "error",
    "prompt",
    "subagent_id",
    "subagent_type",
    "last_message",
    "reason",
)


def _is_event(expected: HookEvent) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not expected:
            raise TypeError(f"{type(instance).__name__} is the input of {expected.title}, not of {safe_repr(value)}")

    return check


@attrs.frozen
class SessionStartInput(HookInput):
    """SessionStart: ``session_id`` and ``agent_id`` (the root agent)."""

    event: HookEvent = attrs.field(
        default=HookEvent.SESSION_START, kw_only=True, validator=_is_event(HookEvent.SESSION_START)
    )


@attrs.frozen
class UserPromptSubmitInput(HookInput):
    """UserPromptSubmit: ``prompt``, the text of the request (``user_prompt`` is the same)."""

    event: HookEvent = attrs.field(
        default=HookEvent.USER_PROMPT_SUBMIT, kw_only=True, validator=_is_event(HookEvent.USER_PROMPT_SUBMIT)
    )
    prompt: str = attrs.field(kw_only=True, validator=instance_of(str))

    @property
    def user_prompt(self) -> str:
        """The spec's name (``userPrompt``) for ``prompt``."""
        return self.prompt


@attrs.frozen
class PreToolUseInput(HookInput):
    """PreToolUse: ``tool_name``, ``tool_call_id``, ``tool_input``; ``extra`` has ``request_id`` and ``turn_id``."""

    event: HookEvent = attrs.field(
        default=HookEvent.PRE_TOOL_USE, kw_only=True, validator=_is_event(HookEvent.PRE_TOOL_USE)
    )
    tool_name: str = attrs.field(kw_only=True, validator=instance_of(str))
    tool_input: JsonObject = attrs.field(kw_only=True, validator=instance_of(dict))


@attrs.frozen
class PermissionRequestInput(HookInput):
    """PermissionRequest: the tool call, ``reason`` (why it asks) and ``extra`` (affected paths, tool kind)."""

    event: HookEvent = attrs.field(
        default=HookEvent.PERMISSION_REQUEST, kw_only=True, validator=_is_event(HookEvent.PERMISSION_REQUEST)
    )
    tool_name: str = attrs.field(kw_only=True, validator=instance_of(str))
    tool_input: JsonObject = attrs.field(kw_only=True, validator=instance_of(dict))


@attrs.frozen
class PostToolUseInput(HookInput):
    """PostToolUse: the tool call (final input) and its successful ``tool_result``."""

    event: HookEvent = attrs.field(
        default=HookEvent.POST_TOOL_USE, kw_only=True, validator=_is_event(HookEvent.POST_TOOL_USE)
    )
    tool_name: str = attrs.field(kw_only=True, validator=instance_of(str))
    tool_input: JsonObject = attrs.field(kw_only=True, validator=instance_of(dict))
    tool_result: ToolResult = attrs.field(kw_only=True, validator=instance_of(ToolResult))


@attrs.frozen
class PostToolUseFailureInput(HookInput):
    """PostToolUseFailure: the tool call, its failed ``tool_result`` and that result's ``error``."""

    event: HookEvent = attrs.field(
        default=HookEvent.POST_TOOL_USE_FAILURE, kw_only=True, validator=_is_event(HookEvent.POST_TOOL_USE_FAILURE)
    )
    tool_name: str = attrs.field(kw_only=True, validator=instance_of(str))
    tool_input: JsonObject = attrs.field(kw_only=True, validator=instance_of(dict))
    tool_result: ToolResult = attrs.field(kw_only=True, validator=instance_of(ToolResult))
    error: ToolError = attrs.field(kw_only=True, validator=instance_of(ToolError))


@attrs.frozen
class SubagentStartInput(HookInput):
    """SubagentStart: ``subagent_id`` (its new id), ``subagent_type`` (its definition's name), ``prompt``."""

    event: HookEvent = attrs.field(
        default=HookEvent.SUBAGENT_START, kw_only=True, validator=_is_event(HookEvent.SUBAGENT_START)
    )
    subagent_id: str = attrs.field(kw_only=True, validator=instance_of(str))
    subagent_type: str = attrs.field(kw_only=True, validator=instance_of(str))
    prompt: str = attrs.field(kw_only=True, validator=instance_of(str))


@attrs.frozen
class SubagentStopInput(HookInput):
    """SubagentStop: ``subagent_id``, ``subagent_type`` and its ``last_message`` (``None`` if it wrote none)."""

    event: HookEvent = attrs.field(
        default=HookEvent.SUBAGENT_STOP, kw_only=True, validator=_is_event(HookEvent.SUBAGENT_STOP)
    )
    subagent_id: str = attrs.field(kw_only=True, validator=instance_of(str))
    subagent_type: str = attrs.field(kw_only=True, validator=instance_of(str))


@attrs.frozen
class StopInput(HookInput):
    """Stop: ``last_message``, the root agent's final answer (``None`` if it wrote none)."""

    event: HookEvent = attrs.field(default=HookEvent.STOP, kw_only=True, validator=_is_event(HookEvent.STOP))


@attrs.frozen
class SessionEndInput(HookInput):
    """SessionEnd: ``reason``, ``"completed"`` or ``"error"``."""

    event: HookEvent = attrs.field(
        default=HookEvent.SESSION_END, kw_only=True, validator=_is_event(HookEvent.SESSION_END)
    )
    reason: str = attrs.field(kw_only=True, validator=instance_of(str))


HOOK_INPUT_CLASSES: Mapping[HookEvent, type[HookInput]] = MappingProxyType(
    {
        HookEvent.SESSION_START: SessionStartInput,
        HookEvent.USER_PROMPT_SUBMIT: UserPromptSubmitInput,
        HookEvent.PRE_TOOL_USE: PreToolUseInput,
        HookEvent.PERMISSION_REQUEST: PermissionRequestInput,
        HookEvent.POST_TOOL_USE: PostToolUseInput,
        HookEvent.POST_TOOL_USE_FAILURE: PostToolUseFailureInput,
        HookEvent.SUBAGENT_START: SubagentStartInput,
        HookEvent.SUBAGENT_STOP: SubagentStopInput,
        HookEvent.STOP: StopInput,
        HookEvent.SESSION_END: SessionEndInput,
    }
)
"""The input class a callback of each event receives."""

_TOOL_FIELDS = frozenset({"tool_name", "tool_call_id", "tool_input"})
_EVENT_FIELDS: Mapping[type[HookInput], frozenset[str]] = {
    SessionStartInput: frozenset(),
    UserPromptSubmitInput: frozenset({"prompt"}),
    PreToolUseInput: _TOOL_FIELDS,
    PermissionRequestInput: _TOOL_FIELDS | {"reason"},
    PostToolUseInput: _TOOL_FIELDS | {"tool_result"},
    PostToolUseFailureInput: _TOOL_FIELDS | {"tool_result", "error"},
    SubagentStartInput: frozenset({"subagent_id", "subagent_type", "prompt"}),
    SubagentStopInput: frozenset({"subagent_id", "subagent_type", "last_message"}),
    StopInput: frozenset({"last_message"}),
    SessionEndInput: frozenset({"reason"}),
}


def typed_input(value: HookInput) -> HookInput:
    """*value* as an instance of its event's input class (itself if it already is one).

    Raises:
        ConfigError: a field the event always sets is missing, or a field of another event is set.
    """
    cls = HOOK_INPUT_CLASSES[value.event]
    if type(value) is cls:
        return value
    fields = {field.name: getattr(value, field.name) for field in attrs.fields(HookInput)}
    fields = {name: item for name, item in fields.items() if item is not None}
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ConfigError(f"not a valid {value.event.title} hook input: {exc}") from None


def _action(value: object) -> HookAction:
    if isinstance(value, HookAction):
        return value
    try:
        return HookAction(value)
    except Exception:  # the enum's own ValueError formats the value with %r, which may raise anything
        raise ValueError(f"action must be 'continue', 'skip' or 'abort', got {safe_repr(value)}") from None


@attrs.frozen
class HookOutput:
    """What a hook callback returns (``None`` means "continue, no changes").

    ``modified_input``: for tool events a JSON object merged shallowly over the
    input; for prompt events (UserPromptSubmit, SubagentStart) a string,
    ``{"prompt": str}`` or the spec's ``{"userPrompt": str}``. ``modified_output`` (PostToolUse, PostToolUseFailure)
    replaces the result's model-visible output; ``None`` means unchanged.
    ``additional_context`` is text for the model, concatenated across callbacks.
    ``reason`` explains a ``skip`` or ``abort``.
    """

    action: HookAction = attrs.field(default=HookAction.CONTINUE, converter=_action)
    modified_input: JsonObject | str | None = attrs.field(default=None, validator=_optional((dict, str)))
    modified_output: Any = None
    additional_context: str | None = attrs.field(default=None, validator=_optional(str))
    reason: str | None = attrs.field(default=None, validator=_optional(str))

    @classmethod
    def modify(
        cls, input: JsonObject | str | None = None, *, output: Any = None, context: str | None = None
    ) -> HookOutput:
        """Continue with changes: new input, new output and/or additional context."""
        return cls(HookAction.CONTINUE, input, output, context)

    @classmethod
    def context(cls, text: str) -> HookOutput:
        """Continue and add *text* to what the model sees."""
        return cls(additional_context=text)

    @classmethod
    def skip(cls, reason: str | None = None, *, context: str | None = None) -> HookOutput:
        """Skip the event's action (e.g. do not run the tool); ends the folding of later results."""
        return cls(HookAction.SKIP, additional_context=context, reason=reason)

    @classmethod
    def abort(cls, reason: str | None = None) -> HookOutput:
        """Abort the event's action (e.g. fail the tool call or the request); ends the folding."""
        return cls(HookAction.ABORT, reason=reason)


HookCallback: TypeAlias = Callable[[Any], Awaitable[HookOutput | None]]
"""``async def hook(input: PreToolUseInput) -> HookOutput | None``: the argument is the event's
input class (see `HOOK_INPUT_CLASSES`), a `HookInput`; annotating it ``HookInput`` works too."""


@attrs.frozen
class HookDecision:
    """The folded outcome of one dispatch.

    ``modified_input`` is the merge of the callbacks' modifications (a JSON
    object; ``{"prompt": str}`` for prompt events), ``None`` if none changed it.
    ``modified_output`` is the last non-``None`` one. ``additional_context`` holds
    each callback's text in order. For ``skip`` and ``abort``, ``reason`` and
    ``decided_by``/``source`` name the callback that decided; its own changes are
    included, those of later callbacks are not. ``ran`` names every callback that ran.
    """

    event: HookEvent
    action: HookAction = HookAction.CONTINUE
    modified_input: JsonObject | None = None
    modified_output: Any = None
    additional_context: tuple[str, ...] = ()
    reason: str | None = None
    decided_by: str | None = None
    source: str | None = None
    ran: tuple[str, ...] = ()

    @property
    def prompt(self) -> str | None:
        """The replaced prompt of a prompt event, if a hook changed it."""
        if self.modified_input is None:
            return None
        value = self.modified_input.get("prompt")
        return value if isinstance(value, str) else None

    @property
    def context_text(self) -> str | None:
        """The additional context joined by blank lines, or ``None``."""
        return "\n\n".join(self.additional_context) if self.additional_context else None

    def apply_to(self, original: JsonObject) -> JsonObject:
        """*original* with the modifications merged in (shallow); a new dict."""
        merged = dict(original)
        if self.modified_input is not None:
            merged.update(self.modified_input)
        return merged

    def raise_for_abort(self) -> None:
        """Raise `HookAbortedError` if a hook answered ``abort``."""
        if self.action is HookAction.ABORT:
            raise HookAbortedError(
                f"{self.event.title} hook {self.decided_by} ({self.source}) aborted: "
                f"{self.reason or 'no reason given'}",
                event=self.event,
                reason=self.reason,
                callback=self.decided_by,
                source=self.source,
            )


# -- the registry --------------------------------------------------------------------


def _callable_name(callback: object) -> str:
    name = getattr(callback, "__qualname__", None)
    if isinstance(name, str):
        return str.__str__(name)  # exactly a str: it is formatted with !r in messages
    if isinstance(callback, functools.partial):
        return f"partial({_callable_name(callback.func)})"
    return type(callback).__name__


def _check_callback(callback: object, *, where: str) -> None:
    if not callable(callback):
        raise ConfigError(f"{where} is not callable: got {type(callback).__name__} {safe_repr(callback)}")
    target: object = callback
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isroutine(target) or inspect.isclass(target)):
        target = type(target).__call__
    if inspect.isasyncgenfunction(target) or not inspect.iscoroutinefunction(target):
        raise ConfigError(
            f"{where} ({_callable_name(callback)}) must be an `async def hook(input) -> HookOutput | None`"
        )
    try:
        inspect.signature(callback).bind(None)
    except TypeError as exc:
        raise ConfigError(
            f"{where} ({_callable_name(callback)}) must accept one argument (the HookInput): {exc}"
        ) from None
    except ValueError:  # no signature available: trust it
        pass


@attrs.frozen
class RegisteredHook:
    """One callback with where it came from (``"session"`` or ``"plugin:<name>"``)."""

    callback: HookCallback = attrs.field(repr=False)
    source: str
    name: str


class HookRegistry:
    """An immutable, validated table of hook callbacks by event.

    ``HookRegistry({HookEvent.PRE_TOOL_USE: [audit]}, source="session")``: keys
    must be `HookEvent` members, values sequences of ``async def`` callbacks;
    anything else raises `ConfigError`. `HookRegistry.combine` concatenates
    registries per event, in the order given (the session's first).
    """

    __slots__ = ("_hooks",)

    def __init__(
        self, hooks: Mapping[HookEvent, Sequence[HookCallback]] | None = None, *, source: str = "session"
    ) -> None:
        if not isinstance(source, str) or not source:
            raise ConfigError(f"hook source must be a non-empty string, got {safe_repr(source)}")
        table: dict[HookEvent, tuple[RegisteredHook, ...]] = {}
        if hooks is not None:
            if not isinstance(hooks, Mapping):
                raise ConfigError(f"{source} hooks must be a mapping of HookEvent to callbacks, got {safe_repr(hooks)}")
            for event, callbacks in hooks.items():
                if not isinstance(event, HookEvent):
                    hint = ""
                    if isinstance(event, str):
                        with contextlib.suppress(ValueError):
                            hint = f" (did you mean HookEvent.{HookEvent(event).name}?)"
                    raise ConfigError(f"{source} hooks: key {safe_repr(event)} is not a HookEvent{hint}")
                if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
                    raise ConfigError(
                        f"{source} hooks[{event.name}] must be a sequence of callbacks, got {type(callbacks).__name__}"
                    )
                entries = []
                for index, callback in enumerate(callbacks):
                    _check_callback(callback, where=f"{source} hooks[{event.name}][{index}]")
                    entries.append(RegisteredHook(callback, source, _callable_name(callback)))
                if entries:
                    table[event] = tuple(entries)
        self._hooks: Mapping[HookEvent, tuple[RegisteredHook, ...]] = MappingProxyType(table)

    @classmethod
    def combine(cls, *registries: HookRegistry) -> HookRegistry:
        """One registry with each event's callbacks concatenated in the order of *registries*."""
        table: dict[HookEvent, list[RegisteredHook]] = {}
        for registry in registries:
            if not isinstance(registry, HookRegistry):
                raise ConfigError(f"expected a HookRegistry, got {safe_repr(registry)}")
            for event, entries in registry._hooks.items():
                table.setdefault(event, []).extend(entries)
        combined = cls()
        combined._hooks = MappingProxyType({event: tuple(entries) for event, entries in table.items()})
        return combined

    def for_event(self, event: HookEvent) -> tuple[RegisteredHook, ...]:
        """The callbacks of *event*, in dispatch order."""
        return self._hooks.get(event, ())

    @property
    def events(self) -> frozenset[HookEvent]:
        return frozenset(self._hooks)

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._hooks.values())

    def __repr__(self) -> str:
        counts = ", ".join(f"{event.title}: {len(entries)}" for event, entries in self._hooks.items())
        return f"<HookRegistry {counts or 'empty'}>"


# -- dispatch --------------------------------------------------------------------------

DEFAULT_HOOK_DEADLINE = 60.0
"""Seconds one event's callbacks may take together, unless the event has its own default."""

DEFAULT_HOOK_DEADLINES: Mapping[HookEvent, float] = MappingProxyType(
    {event: 5.0 if event is HookEvent.SESSION_END else DEFAULT_HOOK_DEADLINE for event in HookEvent}
)
"""The default deadline per event: 60 s, SessionEnd 5 s (it runs while the session closes)."""


class _InputKind(enum.Enum):
    NONE = 0  # no modified_input accepted
    OBJECT = 1  # a JSON object, merged shallowly
    PROMPT = 2  # a string or {"prompt": str}


_INPUT_KIND = {
    HookEvent.USER_PROMPT_SUBMIT: _InputKind.PROMPT,
    HookEvent.SUBAGENT_START: _InputKind.PROMPT,
    HookEvent.PRE_TOOL_USE: _InputKind.OBJECT,
    HookEvent.PERMISSION_REQUEST: _InputKind.OBJECT,
}
_PROMPT_KEYS = frozenset({"prompt", "userPrompt"})  # ours, and the spec's name
_OUTPUT_EVENTS = frozenset({HookEvent.POST_TOOL_USE, HookEvent.POST_TOOL_USE_FAILURE})


def _fresh(value: HookInput) -> HookInput:
    """A copy whose mutable parts (tool input, result output, extra) belong to one callback."""
    changes: dict[str, Any] = {}
    if value.tool_input is not None:
        changes["tool_input"] = json_copy(value.tool_input)
    if value.extra:
        changes["extra"] = json_copy(dict(value.extra))
    result = value.tool_result
    if result is not None and isinstance(result.output, (dict, list)):
        changes["tool_result"] = attrs.evolve(result, output=json_copy(result.output))
    return attrs.evolve(value, **changes) if changes else value


def _checked(event: HookEvent, hook: RegisteredHook, value: object) -> HookOutput | None:
    """Validate one callback's return value for *event*; normalise prompt input to ``{"prompt": str}``."""
    if value is None:
        return None

    def bad(detail: str) -> HookReturnError:
        return HookReturnError(
            f"{event.title} hook {hook.name} ({hook.source}) {detail}",
            event=event,
            callback=hook.name,
            source=hook.source,
        )

    if not isinstance(value, HookOutput):
        raise bad(f"returned {type(value).__name__} {safe_repr(value)}, expected HookOutput or None")
    kind = _INPUT_KIND.get(event, _InputKind.NONE)
    modified = value.modified_input
    if modified is not None:
        if kind is _InputKind.NONE:
            raise bad("returned modified_input, which this event does not accept")
        if kind is _InputKind.PROMPT:
            if isinstance(modified, dict):
                keys = set(modified)
                if len(keys) != 1 or not keys <= _PROMPT_KEYS or not isinstance(next(iter(modified.values())), str):
                    raise bad(
                        f"returned modified_input {safe_repr(modified)}; expected a string, "
                        "{'prompt': str} or {'userPrompt': str}"
                    )
                modified = {"prompt": next(iter(modified.values()))}
            else:
                modified = {"prompt": modified}
            if not modified["prompt"].strip():
                # As a prompt sent so (`ConfigError`); a hook that means "don't send it" skips.
                raise bad("returned an empty prompt; to keep the prompt from the model, return HookOutput.skip()")
        else:
            if not isinstance(modified, dict) or not all(isinstance(key, str) for key in modified):
                raise bad(f"returned modified_input {safe_repr(modified)}; expected a JSON object (dict with str keys)")
            problem = json_problem(modified, "modified_input")
            if problem is not None:  # the tool's input is journalled: JSON all the way down
                raise bad(f"returned a modified_input that is not JSON: {problem}")
            modified = json_copy(modified)
        value = attrs.evolve(value, modified_input=modified)
    if value.modified_output is not None:
        if event not in _OUTPUT_EVENTS:
            raise bad("returned modified_output, which only PostToolUse and PostToolUseFailure accept")
        problem = json_problem(value.modified_output, "modified_output")
        if problem is not None:  # the result is journalled: JSON all the way down
            raise bad(f"returned a modified_output that is not JSON: {problem}")
    return value


def _fold(event: HookEvent, outputs: Sequence[tuple[RegisteredHook, HookOutput | None]]) -> HookDecision:
    merged: JsonObject | None = None
    output: Any = None
    contexts: list[str] = []
    ran = tuple(hook.name for hook, _ in outputs)
    for hook, value in outputs:
        if value is None:
            continue
        if isinstance(value.modified_input, dict):
            merged = {**(merged or {}), **value.modified_input}
        if value.modified_output is not None:
            output = value.modified_output
        if value.additional_context:
            contexts.append(value.additional_context)
        if value.action is not HookAction.CONTINUE:
            return HookDecision(
                event, value.action, merged, output, tuple(contexts), value.reason, hook.name, hook.source, ran
            )
    return HookDecision(event, HookAction.CONTINUE, merged, output, tuple(contexts), ran=ran)


class HookRunner:
    """Dispatches events to the callbacks of a `HookRegistry` under per-event deadlines.

    Args:
        registry: the callbacks (build it with `HookRegistry.combine`, session first).
        deadlines: seconds per event, overriding `DEFAULT_HOOK_DEADLINES` (60 s, SessionEnd 5 s).

    Stateless apart from the PreToolUse context waiting for its call's result,
    so one runner serves the session and all its agents concurrently.
    """

    def __init__(self, registry: HookRegistry, *, deadlines: Mapping[HookEvent, float] | None = None) -> None:
        if not isinstance(registry, HookRegistry):
            raise ConfigError(f"registry must be a HookRegistry, got {safe_repr(registry)}")
        table = dict(DEFAULT_HOOK_DEADLINES)
        if deadlines is not None:
            if not isinstance(deadlines, Mapping):
                raise ConfigError(
                    f"hook deadlines must be a mapping of HookEvent to seconds, got {safe_repr(deadlines)}"
                )
            for event, seconds in deadlines.items():
                if not isinstance(event, HookEvent):
                    raise ConfigError(f"hook deadlines: key {safe_repr(event)} is not a HookEvent")
                table[event] = validate_timeout(seconds, name=f"{event.title} hook deadline")
        self.registry = registry
        self.deadlines: Mapping[HookEvent, float] = MappingProxyType(table)
        # PreToolUse context of calls allowed to run, picked up by the post-tool stage of the same call.
        self._pending_context: weakref.WeakKeyDictionary[ExecutionContext, tuple[str, ...]] = (
            weakref.WeakKeyDictionary()
        )

    def has_hooks(self, event: HookEvent) -> bool:
        return bool(self.registry.for_event(event))

    async def dispatch(self, event: HookEvent, input: HookInput, *, abort: AbortHandle | None = None) -> HookDecision:
        """Run *event*'s callbacks and fold their results into a `HookDecision`.

        Every callback runs, in order, with its own copy of *input*; the results
        are then folded in order until the first ``skip`` or ``abort``. With no
        callbacks it returns a ``continue`` decision at once (no checkpoint).

        Raises:
            HookError: a callback raised (the exception is ``__cause__``).
            HookReturnError: a callback returned garbage.
            HookTimeoutError: the callbacks together missed the event's deadline.
            HookInterruptedError: *abort* was aborted before or during the dispatch.
            trio.Cancelled: cancellation from outside propagates unchanged.
            LeaseLostError: raised by a callback, propagates unchanged.
        """
        if not isinstance(event, HookEvent):
            raise ConfigError(f"event must be a HookEvent, got {safe_repr(event)}")
        if not isinstance(input, HookInput) or input.event is not event:
            raise ConfigError(f"dispatch({event.title}) needs a HookInput of that event, got {safe_repr(input)}")
        hooks = self.registry.for_event(event)
        if not hooks:
            return HookDecision(event)
        input = typed_input(input)
        if abort is not None and abort.reason is not None:
            raise HookInterruptedError(
                f"{event.title} hooks were not run: {abort.reason.message}", event=event, abort=abort.reason
            )
        seconds = self.deadlines[event]
        outputs: list[tuple[RegisteredHook, HookOutput | None]] = []
        current: RegisteredHook | None = None
        scope = trio.CancelScope(deadline=trio.current_time() + seconds)
        cleanup: BaseExceptionGroup[BaseException] | None = None
        try:
            with scope:
                token = abort.add_listener(lambda _: scope.cancel()) if abort is not None else None
                try:
                    for hook in hooks:
                        current = hook
                        try:
                            value = await hook.callback(_fresh(input))
                        except LeaseLostError:
                            raise
                        except BaseException as exc:
                            if not isinstance(exc, Exception) and not stray_cancellation(exc):
                                raise  # our deadline's or abort's cancellation (below), or one from outside
                            told = describe(exc, "repr")
                            if not isinstance(exc, Exception):
                                told = f"it raised {told} {STRAY_CANCELLED}"
                            raise HookError(
                                f"{event.title} hook {hook.name} ({hook.source}) failed: {told}",
                                event=event,
                                callback=hook.name,
                                source=hook.source,
                            ) from exc
                        outputs.append((hook, _checked(event, hook, value)))
                finally:
                    if abort is not None and token is not None:
                        abort.remove_listener(token)
        except BaseExceptionGroup as group:
            # A callback's own nursery that this scope cancelled (deadline, abort) and whose cleanup
            # raised: trio passes the rest of its group through the scope. The cancellation ends
            # the dispatch as below; anything else (an outer cancellation, a lost lease) goes on.
            typed = typed_error(group)
            if typed is not None:
                raise typed from group
            if not scope.cancel_called or contains_cancelled(group):
                raise
            cleanup = group
        if scope.cancel_called:
            # Also when a callback swallowed the Cancelled: a missed deadline is a missed deadline.
            name = current.name if current is not None else None
            if abort is not None and abort.reason is not None:
                raise HookInterruptedError(
                    f"{event.title} hook {name} was interrupted: {abort.reason.message}",
                    event=event,
                    abort=abort.reason,
                    callback=name,
                ) from cleanup
            raise HookTimeoutError(
                f"{event.title} hooks missed their {seconds:g} s deadline (still running: {name})",
                event=event,
                seconds=seconds,
                callback=name,
                source=current.source if current is not None else None,
            ) from cleanup
        return _fold(event, outputs)

    # -- PreToolUse context travelling to the call's result --------------------------

    def _stash_context(self, context: ExecutionContext, texts: tuple[str, ...]) -> None:
        self._pending_context[context] = self._pending_context.get(context, ()) + texts

    def _take_context(self, context: ExecutionContext) -> tuple[str, ...]:
        return self._pending_context.pop(context, ())


# -- tool-stage adapters ---------------------------------------------------------------

HOOK_CONTEXT_KEY = "hook_context"
"""Result metadata key holding the tool hooks' additional context (a tuple of strings, in order)."""


def _tool_input(event: HookEvent, request: StageRequest, result: ToolResult | None = None) -> HookInput:
    ctx = request.context
    fields: dict[str, Any] = {}
    if result is not None:
        fields["tool_result"] = result
        if result.error is not None:
            fields["error"] = result.error
    return HOOK_INPUT_CLASSES[event](
        event=event,
        session_id=ctx.session_id,
        agent_id=ctx.agent_id,
        tool_name=request.tool.name,
        tool_call_id=ctx.tool_call_id,
        tool_input=request.input,
        extra={"request_id": ctx.request_id, "turn_id": ctx.turn_id},
        **fields,
    )


def _with_context(message: str, texts: Iterable[str]) -> str:
    extra = "\n".join(texts)
    return f"{message}\n{extra}" if extra else message


def pre_tool_stage(runner: HookRunner) -> Stage:
    """A ``pre_tool`` stage running the PreToolUse hooks. It fails closed.

    * continue: ``Allow(input=...)`` with the merged modifications, or ``None`` if none;
      additional context is added to the call's result (the model's text) by `post_tool_stage`.
    * skip: ``Deny`` (``permission_denied``, code ``hook_skip``): the tool does not run
      and the call settles ``cancelled`` straight from ``scheduled`` (no ``tool_started``).
    * abort: ``Deny`` (``execution``, code ``hook_abort``): settles ``failed`` from ``scheduled``.
    * a hook raising or returning garbage (``hook_error``) or missing the deadline
      (``hook_timeout``): ``Deny`` (``execution``), the model sees why; the tool does not run.
    """
    if not isinstance(runner, HookRunner):
        raise ConfigError(f"pre_tool_stage needs a HookRunner, got {safe_repr(runner)}")
    event = HookEvent.PRE_TOOL_USE

    async def pre_tool_use(request: StageRequest) -> Allow | Deny | None:
        if not runner.has_hooks(event):
            return None
        tool = request.tool.name
        try:
            decision = await runner.dispatch(event, _tool_input(event, request))
        except HookTimeoutError as exc:
            return Deny(f"{exc}; the call to {tool!r} was not run", ToolErrorType.EXECUTION, "hook_timeout")
        except HookError as exc:
            return Deny(f"{exc}; the call to {tool!r} was not run", ToolErrorType.EXECUTION, "hook_error")
        who = f"{event.title} hook {decision.decided_by} ({decision.source})"
        why = decision.reason or "no reason given"
        if decision.action is HookAction.ABORT:
            message = _with_context(f"{who} aborted the call to {tool!r}: {why}", decision.additional_context)
            return Deny(message, ToolErrorType.EXECUTION, "hook_abort")
        if decision.action is HookAction.SKIP:
            message = _with_context(f"{who} skipped the call to {tool!r}: {why}", decision.additional_context)
            return Deny(message, ToolErrorType.PERMISSION_DENIED, "hook_skip")
        if decision.additional_context:
            runner._stash_context(request.context, decision.additional_context)
        if decision.modified_input is not None:
            return Allow(input=decision.apply_to(request.input))
        return None

    return pre_tool_use


def _add_context(result: ToolResult, texts: tuple[str, ...], **metadata: Any) -> ToolResult:
    """*result* with the tool hooks' context: for the model, after its output (the text it reads:
    `model_text`, so a non-string output is encoded as JSON first), and in
    ``metadata["hook_context"]`` for code. Journalled with the result, so a rebuilt history agrees."""
    if not texts and not metadata:
        return result
    merged = dict(result.metadata)
    merged.update(metadata)
    if not texts:
        return attrs.evolve(result, metadata=merged)
    merged[HOOK_CONTEXT_KEY] = tuple(merged.get(HOOK_CONTEXT_KEY, ())) + texts
    return attrs.evolve(result, output=_with_context(model_text(result), texts), metadata=merged)


def post_tool_stage(runner: HookRunner) -> PostStage:
    """A ``post_tool`` stage running PostToolUse (ok results) or PostToolUseFailure (error results).

    Both run only when the tool ran (`StageRequest.tool_ran`): a result a ``before`` stage gave
    by skipping the call (``on_before_tool_call`` returning ``Skip``) passes them by.

    PostToolUse: ``modified_output`` replaces the output; abort turns the result
    into an ``execution`` error (code ``hook_abort``); a raising, garbage-returning
    or late hook fails closed: an ``execution`` error (``hook_error`` /
    ``hook_timeout``) replaces the result, so an unvetted output never reaches the model.

    PostToolUseFailure: the result stays the same error (type and code);
    ``modified_output`` replaces its model-visible output; skip and abort end the
    folding; a failing hook keeps the original error (logged, and noted in
    ``metadata["hook_error"]``).

    Additional context of PreToolUse and these hooks is appended to the output the model
    reads, and kept in ``result.metadata["hook_context"]``. Install it whenever PreToolUse
    hooks exist, or their context never reaches the result.
    """
    if not isinstance(runner, HookRunner):
        raise ConfigError(f"post_tool_stage needs a HookRunner, got {safe_repr(runner)}")

    async def post_tool_use(request: StageRequest, result: ToolResult) -> ToolResult | None:
        pre_context = runner._take_context(request.context)
        event = HookEvent.POST_TOOL_USE if result.ok else HookEvent.POST_TOOL_USE_FAILURE
        # Only for a call the tool ran: a before stage's Skip (on_before_tool_call) is no tool result.
        if not request.tool_ran or not runner.has_hooks(event):
            return _add_context(result, pre_context) if pre_context else None
        tool = request.tool.name
        try:
            decision = await runner.dispatch(event, _tool_input(event, request, result))
        except HookError as exc:
            if result.error is None:
                code = "hook_timeout" if isinstance(exc, HookTimeoutError) else "hook_error"
                failed = ToolResult.failure(
                    ToolErrorType.EXECUTION,
                    f"{exc}; the output of {tool!r} was withheld",
                    code=code,
                    metadata=result.metadata,
                )
                return _add_context(failed, pre_context)
            logger.warning("%s; keeping the original error of %r", exc, tool)
            return _add_context(result, pre_context, hook_error=str(exc))
        texts = pre_context + decision.additional_context
        if result.error is None and decision.action is HookAction.ABORT:
            aborted = ToolResult.failure(
                ToolErrorType.EXECUTION,
                f"{event.title} hook {decision.decided_by} ({decision.source}) aborted the result of {tool!r}: "
                f"{decision.reason or 'no reason given'}",
                code="hook_abort",
                metadata=result.metadata,
            )
            return _add_context(aborted, texts)
        final = result
        if decision.modified_output is not None:
            final = attrs.evolve(final, output=decision.modified_output)
        if result.error is not None and decision.action is HookAction.ABORT:
            final = _add_context(final, (), hook_abort=decision.reason or "no reason given")
        final = _add_context(final, texts)
        return None if final is result else final

    return post_tool_use
