"""The permission engine: a session's layer over the decision table.

One `PermissionEngine` serves a session: its root agent and every subagent
(the tool pipeline is shared, and `PermissionRequest.agent_id` tells who is
calling). `PermissionEngine.decide` walks the decision table, whose stages
0-11 are pure functions in `trio_agent._permissions._table` (the table is in
that module's docstring), runs the tool's own check between them (stage 3,
user code that may be async), and asks where the table says ask (stages
12-13: the PermissionRequest hooks, then the handler, under one deadline and
the call's abort, each ask recorded ``requested`` / ``resolved``).

The engine also holds the session layer the table reads: remembered
signatures and session allow / deny rules, changed by answers' rule updates
and `PermissionEngine.accept_updates`.

For an answer given elsewhere (a run that pauses for a person instead of
asking a handler in-process): `PermissionEngine.evaluate` walks 0-11 and
returns the `AskNeeded` where `decide` would ask; `PermissionEngine.conclude`
turns the answer into a `Decision` (source ``interrupt``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

import attrs
import trio
import trio.lowlevel

from .._abort import AbortHandle
from .._config import validate_timeout
from .._errors import ConfigError, LeaseLostError
from .._groups import STRAY_CANCELLED, contains_cancelled, is_cancellation, stray_cancellation, typed_error
from .._journal._events import PermissionDecision
from .._json import json_problem
from .._tools._context import ExecutionContext
from .._tools._definition import SideEffect, Tool, ToolKind
from .._tools._results import JsonObject, describe, json_copy
from .._tools._stages import Allow, Stage, StageDecision, StageRequest
from .._util import safe_repr
from ._rules import (
    MODE_TABLE,
    PathPolicy,
    PermissionAllow,
    PermissionAsk,
    PermissionDeny,
    PermissionMode,
    PermissionResult,
    PermissionRules,
    PermissionUpdate,
    Rule,
    RuleBehavior,
    ToolFilter,
    ToolPermissionCheck,
    as_mode,
    never_matches,
)
from ._table import (
    AskNeeded,
    AskReason,
    Decision,
    DecisionSource,
    Policy,
    Subject,
    after_check,
    check_failed,
    deny,
    evaluate_after_screen,
    screen_rest,
    subject,
)

__all__ = [
    "PermissionEngine",
    "PermissionHandler",
    "PermissionHook",
    "PermissionPhase",
    "PermissionRecord",
    "PermissionRecorder",
    "PermissionRequest",
    "SignatureContent",
    "UpdatesApplied",
]

logger = logging.getLogger("trio_agent.permissions")

_NO_RULES = PermissionRules()  # immutable: every engine without rules shares it
_ALLOW_AS_IS = Allow(None)  # the stage's allow of a call's own input (immutable: shared)
# An empty session layer: an engine makes its own collections when it first changes (an idle
# session that was never asked keeps none), and until then shares its template's `Policy`.
_NO_APPROVALS: frozenset[str] = frozenset()
_NO_SESSION_RULES: tuple[Rule, ...] = ()


@attrs.frozen(eq=False)
class PermissionRequest:
    """What a PermissionRequest hook and the permission handler see.

    ``input`` is the engine's copy (return ``PermissionAllow(updated_input=...)``
    to change it); ``abort`` is the call's handle and ``deadline`` the Trio time
    at which the engine stops waiting and denies. ``agent_id`` is ``"root"`` or
    a subagent's id.
    """

    tool_name: str
    input: JsonObject
    signature: str
    mode: PermissionMode
    tool_kind: ToolKind
    side_effect: SideEffect
    affected_paths: tuple[str, ...]
    reason: AskReason
    message: str | None
    rule: str | None
    agent_id: str
    session_id: str
    request_id: str
    turn_id: str
    tool_call_id: str
    permission_id: str
    deadline: float
    abort: AbortHandle = attrs.field(repr=False)
    # How the engine that made this request builds it for another input (`with_input`).
    _restate: Callable[[PermissionRequest, JsonObject], Awaitable[PermissionRequest | PermissionDeny]] | None = (
        attrs.field(default=None, repr=False, alias="restate")
    )

    async def with_input(self, input: JsonObject) -> PermissionRequest | PermissionDeny:
        """This request for *input* instead, built as the engine built it: stages 0-5 run on
        *input* and give its signature, resolved kind and side effect, affected paths (and reason
        ``tool`` if the tool's own check asks about it); a `PermissionDeny` with the refusing
        stage's message if one of them refuses it, or if *input* is not a JSON object.

        For a layer between the engine and the handler that changes the input (a session's
        PermissionRequest hooks): what the handler is shown is then what would run, and what its
        ``remember`` approves. `ConfigError` for a request no engine made.
        """
        if self._restate is None:
            raise ConfigError("with_input() needs a request made by a PermissionEngine")
        return await self._restate(self, input)


class _Restate:
    """`PermissionRequest.with_input` of one ask: the engine, the tool and the call it is for."""

    __slots__ = ("context", "engine", "tool")

    def __init__(self, engine: PermissionEngine, tool: Tool[Any], context: ExecutionContext) -> None:
        self.engine = engine
        self.tool = tool
        self.context = context

    async def restate(self, request: PermissionRequest, input: JsonObject) -> PermissionRequest | PermissionDeny:
        tool = self.tool
        problem = json_problem(input, "input") if isinstance(input, dict) else "it is not a JSON object"
        if problem is not None:
            return PermissionDeny(f"the changed input of tool {tool.name!r} is not JSON: {problem}")
        screened = await self.engine._screen(tool, input, self.context)
        if isinstance(screened, Decision):
            refusal = screened.message or "permission denied"
            return PermissionDeny(f"the changed input was refused: {refusal}", stop_loop=screened.stop_loop)
        tool_ask = screened.tool_ask
        return attrs.evolve(
            request,
            input=json_copy(screened.input),
            signature=screened.signature,
            tool_kind=screened.behavior.kind,
            side_effect=screened.behavior.side_effect,
            affected_paths=screened.paths,
            reason=AskReason.TOOL if tool_ask is not None else request.reason,
            message=tool_ask.message if tool_ask is not None else request.message,
            rule=None if tool_ask is not None else request.rule,
        )


PermissionHandler: TypeAlias = Callable[[PermissionRequest], Awaitable[PermissionResult | None]]
"""``async def handler(request) -> PermissionAllow | PermissionDeny | PermissionAsk | None``."""

PermissionHook: TypeAlias = PermissionHandler
"""A PermissionRequest hook has the handler's shape; ``None`` or `PermissionAsk` passes to the next answerer."""


def is_async_callable(value: object) -> bool:
    """Whether calling *value* makes a coroutine, as `define_tool` decides for a tool's run: an
    ``async def`` function (a bound method or a `functools.partial` of one too) or an object whose
    ``__call__`` is one. A sync answerer was accepted, then failed every ask with a TypeError."""
    return inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(type(value).__call__)


def check_answerer(value: object, what: str) -> None:
    """`ConfigError` naming *what* unless *value* is an async callable (`is_async_callable`)."""
    if not is_async_callable(value):
        raise ConfigError(
            f"{what} must be an async callable (an `async def` function of a PermissionRequest), got {safe_repr(value)}"
        )


SignatureContent: TypeAlias = Callable[[JsonObject], str | None]
"""A tool's ``signature_content(input)``: the part after ``Name:`` in its signature (``None``/"" for none)."""


class UpdatesApplied(Protocol):
    """``on_updates_applied(updates, *, source, call_id)``, sync or async: rule updates are about to apply.

    ``source`` is who issued them (``"handler"``, ``"hook"`` or ``"interrupt"`` for an answer,
    ``"set_mode"`` for `PermissionEngine.set_mode`, ``"forget_session"``, or what
    `PermissionEngine.accept_updates` was given, e.g. ``"tool"``); ``call_id`` the tool call
    they came with.
    """

    def __call__(
        self, updates: tuple[PermissionUpdate, ...], /, *, source: str, call_id: str | None
    ) -> Awaitable[None] | None: ...


PermissionPhase: TypeAlias = Literal["requested", "resolved"]


@attrs.frozen(eq=False)
class PermissionRecord:
    """What the engine hands the recorder: the request, and for ``resolved`` the decision."""

    permission_id: str
    request: PermissionRequest
    decision: Decision | None = None

    @property
    def outcome(self) -> PermissionDecision | None:
        return None if self.decision is None else self.decision.outcome


PermissionRecorder: TypeAlias = Callable[[PermissionPhase, PermissionRecord], Awaitable[None]]
"""``async def record(phase, record)``: ``"requested"`` before asking, ``"resolved"`` after (make both durable)."""


@attrs.frozen(eq=False)
class _Answer:
    source: DecisionSource
    result: PermissionAllow | PermissionDeny | None = None
    message: str | None = None


@attrs.frozen
class _CheckCut:
    """A tool's own check cut short by the call's abort (``ABORT``) or the deadline (``TOOL``)."""

    source: DecisionSource
    abort_message: str | None

    def message(self, tool: Tool[Any], timeout: float) -> str:
        if self.source is DecisionSource.ABORT:
            return f"permission check of tool {tool.name!r} cancelled: {self.abort_message}"
        return f"permission check of tool {tool.name!r} gave no answer within {timeout:g} s"


T = TypeVar("T")


async def _within_bounds(awaitable: Awaitable[T], deadline: float, abort: AbortHandle) -> tuple[T | None, bool]:
    """*awaitable* awaited under an ask's two bounds, *deadline* and the call's *abort*: (its result,
    ``None`` if a bound cut it short; whether the deadline was reached). The caller reads
    ``abort.reason`` first, then the deadline: a cut by either, even a late answer, is refused.

    The awaited code's own nursery, cancelled by a bound and whose cleanup raised, reaches here
    as a group that trio passed through our scopes: that cancellation is the bound's, decided by
    the caller; anything else (an outer cancellation, a lost lease) goes on."""
    deadline_scope = trio.CancelScope(deadline=deadline)
    result: T | None = None
    try:
        with trio.CancelScope() as abort_scope:
            token = abort.add_listener(lambda _abort: abort_scope.cancel())
            try:
                with deadline_scope:
                    result = await awaitable
            finally:
                abort.remove_listener(token)
    except BaseExceptionGroup as group:
        typed = typed_error(group)
        if typed is not None:
            raise typed from group
        if not (deadline_scope.cancel_called or abort_scope.cancel_called) or contains_cancelled(group):
            raise
    return result, deadline_scope.cancel_called


def _callable_name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def _checked_updates(updates: Iterable[PermissionUpdate], argument: str) -> tuple[PermissionUpdate, ...]:
    if isinstance(updates, PermissionUpdate):
        return (updates,)
    if not isinstance(updates, Iterable) or isinstance(updates, (str, bytes, Mapping)):
        raise ConfigError(f"{argument} takes a PermissionUpdate or a list of them, got {updates!r}")
    checked = tuple(updates)
    for update in checked:
        if not isinstance(update, PermissionUpdate):
            raise ConfigError(f"expected a PermissionUpdate, got {update!r}")
    return checked


def _no_handler_message(
    name: str,
    signature: str,
    kind: ToolKind,
    mode: PermissionMode,
    reason: AskReason,
    message: str | None,
    rule: Rule | str | None,
) -> str:
    """What the model sees when a call needed an answer and nobody can give one: why, and what would fix it."""
    head = f"{signature} needs permission and there is no permission handler to ask, so the call was denied"
    allow = f'permissions={{"allow": ["{name}"]}}'
    if reason is AskReason.TOOL:
        why = f"the tool's own check asks{f' ({message})' if message else ''}"
        fix = "only a permission_handler= can answer a tool's own ask"
    elif reason is AskReason.RULE:
        why = f"it matches ask rule {str(rule)!r}"
        fix = f"to let it run, open the session with a permission_handler=, or drop the ask rule and use {allow}"
    else:
        why = f"{mode.value} mode asks before {kind.value} tools"
        fix = (
            f"to let it run, open the session with {allow} or a permission_handler=, "
            f'or define the tool with kind="readonly" if it only reads'
        )
    return f"{head} ({why}). This is the session's configuration, not the call: {fix}."


class _Signatures:
    """``Name`` or ``Name:content`` of a call: the content from the engine's mapping or callable,
    else the tool's own (`Tool.signature_content_for`)."""

    __slots__ = ("content_fn", "content_map")

    def __init__(
        self,
        content_map: Mapping[str, SignatureContent],
        content_fn: Callable[[str, JsonObject], str | None] | None,
    ) -> None:
        self.content_map = content_map
        self.content_fn = content_fn

    def __call__(self, tool: Tool[Any], input: JsonObject) -> str:
        content = self.content(tool, input)
        return tool.name if not content else f"{tool.name}:{content}"

    def content(self, tool: Tool[Any], input: JsonObject) -> str | None:
        fn: Callable[[JsonObject], object] | None = self.content_map.get(tool.name)
        if fn is not None:
            value: object = fn(json_copy(input))
        elif self.content_fn is not None:
            value = self.content_fn(tool.name, json_copy(input))
        elif tool.signature_content is None and type(tool).signature_content_for is Tool.signature_content_for:
            # The tool's conventional field, read by the library (nothing of the input is handed out).
            return tool.signature_content_for(input)
        else:
            # The tool's own: define_tool(signature_content=).
            return tool.signature_content_for(json_copy(input))
        if value is None:
            return None
        if not isinstance(value, str):
            raise TypeError(f"signature content must be a string or None, got {safe_repr(value)}")
        return value or None


class _PermissionStage:
    """`PermissionEngine.as_stage`: a bound method of this (two fields) rather than a closure (a
    function, its cells and their tuple): every session keeps one as long as it lives."""

    __slots__ = ("answered", "engine")

    def __init__(self, engine: PermissionEngine, answered: dict[tuple[str, str], StageDecision] | None) -> None:
        self.engine = engine
        self.answered = answered

    async def permission_stage(self, request: StageRequest) -> StageDecision | None:
        answered = self.answered
        if answered:
            context = request.context
            given = answered.pop((context.agent_id, context.tool_call_id), None)
            if given is not None:
                return given
        engine, tool, input = self.engine, request.tool, request.input
        if engine.allows_outright(tool, request.context.agent_id) and not tool.input_errors(input):
            return _ALLOW_AS_IS  # what the table would decide, without walking it
        decision = await engine.decide(tool, input, request.context)
        return decision.to_stage_decision(input)

    permission_stage.__qualname__ = "PermissionEngine.permission_stage"  # the name a stage's error shows


class PermissionEngine:
    """Decides whether tool calls may run (the table is in `trio_agent._permissions._table`'s docstring).

    Args:
        rules: the configured allow / ask / deny rules (default: none).
        mode: the permission mode (changeable later through `mode`).
        handler: answers asks (``async (PermissionRequest) -> result``); asked after the hooks.
        hooks: PermissionRequest hooks, asked in order before the handler; the first allow or
            deny decides, as the handler's would, whether there is a handler or not.
        path_policy: keeps affected paths inside the workspace (default: no path policy).
        record: ``async record(phase, PermissionRecord)``, called with ``"requested"``
            before an ask and ``"resolved"`` after it, so the session can make both
            durable. An exception from it propagates (the pipeline fails closed).
        tool_checks: tool name -> the tool's own ``check_permissions(input)``; a tool
            not listed uses its `Tool.check_permissions` (``define_tool(check_permissions=)``).
        signature_content: tool name -> ``signature_content(input)``, or one callable
            ``(tool_name, input) -> str | None`` for all tools; a tool not covered uses
            `Tool.signature_content_for` (``define_tool(signature_content=)``, else the
            tool's conventional field such as ``command``).
        tool_filter: a `ToolFilter`, or ``agent_id -> ToolFilter``, enforced on calls.
        ask_timeout: seconds an ask (hooks and handler together) may take, and each run of a
            tool's own async check (default 600); past it the call is denied.
        record_grace: bound on the shielded ``resolved`` write after a cancellation (default 10 s).
        on_updates_applied: told about every rule update an answer or `accept_updates`
            applies (see `UpdatesApplied`); also settable later as ``engine.on_updates_applied``.
    """

    # Slotted: every session holds one (`derive`), and thousands may be alive.
    __slots__ = (
        "_approved",
        "_bare_policy",
        "_content_fn",
        "_content_map",
        "_handler",
        "_hooks",
        "_made_policy",
        "_mode",
        "_path_policy",
        "_record",
        "_rules",
        "_session_allow",
        "_session_deny",
        "_tool_checks",
        "_tool_filter",
        "_updating",
        "ask_timeout",
        "on_updates_applied",
        "record_grace",
    )

    def __init__(
        self,
        rules: PermissionRules | None = None,
        *,
        mode: PermissionMode | str = PermissionMode.DEFAULT,
        handler: PermissionHandler | None = None,
        hooks: PermissionHook | Sequence[PermissionHook] | None = None,
        path_policy: PathPolicy | None = None,
        record: PermissionRecorder | None = None,
        tool_checks: Mapping[str, ToolPermissionCheck] | None = None,
        signature_content: Mapping[str, SignatureContent] | Callable[[str, JsonObject], str | None] | None = None,
        tool_filter: ToolFilter | Callable[[str], ToolFilter] | None = None,
        ask_timeout: float = 600.0,
        record_grace: float = 10.0,
        on_updates_applied: UpdatesApplied | None = None,
    ) -> None:
        if rules is None:
            rules = _NO_RULES
        if not isinstance(rules, PermissionRules):
            raise ConfigError(f"rules must be PermissionRules, got {rules!r}")
        self._rules = rules
        self._mode = as_mode(mode)
        if handler is not None:
            check_answerer(handler, "handler")
        self._handler = handler
        if hooks is None:
            hook_list: tuple[PermissionHook, ...] = ()
        elif callable(hooks):
            hook_list = (hooks,)
        elif isinstance(hooks, Iterable) and not isinstance(hooks, (str, bytes, Mapping)):
            hook_list = tuple(hooks)
        else:
            raise ConfigError(f"hooks must be an async callable or a list of them, got {hooks!r}")
        for index, hook in enumerate(hook_list):
            check_answerer(hook, f"PermissionRequest hook #{index}")
        self._hooks = hook_list
        if path_policy is not None and not isinstance(path_policy, PathPolicy):
            raise ConfigError(f"path_policy must be a PathPolicy, got {path_policy!r}")
        self._path_policy = path_policy
        if record is not None and not callable(record):
            raise ConfigError(f"record must be an async callable, got {record!r}")
        self._record = record
        if tool_checks is not None and not isinstance(tool_checks, Mapping):
            raise ConfigError(f"tool_checks must be a mapping of tool name -> check_permissions, got {tool_checks!r}")
        self._tool_checks = dict(tool_checks or {})
        for name, check in self._tool_checks.items():
            if not callable(check):
                raise ConfigError(f"tool_checks[{name!r}] is not callable: {check!r}")
        self._content_map: dict[str, SignatureContent] = {}
        self._content_fn: Callable[[str, JsonObject], str | None] | None = None
        if isinstance(signature_content, Mapping):
            self._content_map = dict(signature_content)
            for name, fn in self._content_map.items():
                if not callable(fn):
                    raise ConfigError(f"signature_content[{name!r}] is not callable: {fn!r}")
        elif signature_content is not None:
            if not callable(signature_content):
                raise ConfigError(f"signature_content must be a mapping or a callable, got {signature_content!r}")
            self._content_fn = signature_content
        if tool_filter is not None and not isinstance(tool_filter, ToolFilter) and not callable(tool_filter):
            raise ConfigError(f"tool_filter must be a ToolFilter or a callable, got {tool_filter!r}")
        self._tool_filter = tool_filter
        self.ask_timeout = validate_timeout(ask_timeout, name="permission ask_timeout")
        self.record_grace = validate_timeout(record_grace, name="permission record_grace")
        if on_updates_applied is not None and not callable(on_updates_applied):
            raise ConfigError(f"on_updates_applied must be callable, got {on_updates_applied!r}")
        self.on_updates_applied: UpdatesApplied | None = on_updates_applied
        # The session layer, changed by answers (rule updates, remember) and `accept_updates`:
        # shared empty ones until it first changes (`_approvals`, `_rule_lists`).
        self._approved: set[str] | frozenset[str] = _NO_APPROVALS
        self._session_allow: list[Rule] | tuple[Rule, ...] = _NO_SESSION_RULES
        self._session_deny: list[Rule] | tuple[Rule, ...] = _NO_SESSION_RULES
        self._made_policy: Policy | None = None  # `_policy`
        self._bare_policy: Policy | None = None  # `_empty_layer_policy`
        self._updating: trio.Lock | None = None  # `accept_updates`: made at the first reported update

    def derive(
        self,
        *,
        record: PermissionRecorder | None,
        tool_filter: ToolFilter | Callable[[str], ToolFilter] | None,
    ) -> PermissionEngine:
        """A new engine with this one's configuration (rules, mode, answerers, path policy, the
        tools' checks and contents, bounds), its own *record* and *tool_filter*, and an empty
        session layer: what a session opened from one agent definition gets, checked once."""
        if record is not None and not callable(record):
            raise ConfigError(f"record must be an async callable, got {record!r}")
        if tool_filter is not None and not isinstance(tool_filter, ToolFilter) and not callable(tool_filter):
            raise ConfigError(f"tool_filter must be a ToolFilter or a callable, got {tool_filter!r}")
        engine = object.__new__(PermissionEngine)
        engine._rules = self._rules
        engine._mode = self._mode
        engine._handler = self._handler
        engine._hooks = self._hooks
        engine._path_policy = self._path_policy
        engine._record = record
        engine._tool_checks = self._tool_checks  # never changed after construction: shared
        engine._content_map = self._content_map
        engine._content_fn = self._content_fn
        engine._tool_filter = tool_filter
        engine.ask_timeout = self.ask_timeout
        engine.record_grace = self.record_grace
        engine.on_updates_applied = None
        engine._approved = _NO_APPROVALS
        engine._session_allow = _NO_SESSION_RULES
        engine._session_deny = _NO_SESSION_RULES
        # What the table reads of the new engine is this one's, with an empty session layer: shared.
        engine._made_policy = self._empty_layer_policy()
        engine._bare_policy = None
        engine._updating = None
        return engine

    # -- configuration ---------------------------------------------------------

    @property
    def rules(self) -> PermissionRules:
        """The configured rules (never changed by answers)."""
        return self._rules

    @property
    def mode(self) -> PermissionMode:
        return self._mode

    @mode.setter
    def mode(self, value: PermissionMode | str) -> None:
        mode = as_mode(value)
        if self.on_updates_applied is not None:
            # The change must be reported (a session journals it) before it takes effect, which a
            # property cannot wait for; changed here it would be lost on reopen (plan failing open).
            raise ConfigError(
                f"this engine records its permission changes (a session journals them), so its mode is "
                f"changed with `await permissions.set_mode({mode.value!r})`, not by assignment"
            )
        self._mode = mode

    async def set_mode(self, mode: PermissionMode | str) -> None:
        """Switch the permission mode for the next decisions: a ``set_mode`` `PermissionUpdate`
        through `accept_updates` (source ``"set_mode"``), so a session journals it first and a
        reopened session keeps it. A bad mode is a `ConfigError` (nothing changes)."""
        await self.accept_updates([PermissionUpdate.set_mode(mode)], source="set_mode")

    @property
    def approved_signatures(self) -> frozenset[str]:
        """Signatures remembered for the session (exact matches)."""
        return frozenset(self._approved)

    @property
    def session_allow_rules(self) -> tuple[Rule, ...]:
        return tuple(self._session_allow)

    @property
    def session_deny_rules(self) -> tuple[Rule, ...]:
        return tuple(self._session_deny)

    async def accept_updates(
        self, updates: Iterable[PermissionUpdate], *, source: str, call_id: str | None = None
    ) -> tuple[PermissionUpdate, ...]:
        """Apply live rule updates (a tool's ``permission_updates`` effect, say) and report them.

        Every item is checked first (`ConfigError`, nothing reported or applied): each must be a
        `PermissionUpdate`, and no rule of one may be one that could never match a call of a tool
        this engine knows as written (`never_matches`, the judgement `PermissionRules.check_tools`
        makes of configured rules: ``Read:./.env`` would deny nothing, since a call's content is
        ``.env``); a ``remove`` of a rule the session layer holds is always taken. Then
        `on_updates_applied` is called (and awaited if async) *before* the
        updates take effect, so a journal can make them durable first: if it
        raises, nothing is applied and the error propagates. A cancellation
        while it runs applies them anyway and goes on: the write it interrupted
        may have committed (a session's journal confirms such a write, or
        fences), and what is live must not lag what a reopen replays.
        Concurrent calls take effect one at a time, in the order their reports
        were made, so the live mode and rules end as the journal's do.
        Returns the updates applied.
        """
        checked = _checked_updates(updates, "accept_updates")
        self._check_rules(checked)
        return await self._report_and_apply(checked, source, call_id)

    async def _report_and_apply(
        self, checked: tuple[PermissionUpdate, ...], source: str, call_id: str | None
    ) -> tuple[PermissionUpdate, ...]:
        """`accept_updates` past its checks: report *checked* (`on_updates_applied`), then apply them."""
        if not checked:
            return ()
        callback = self.on_updates_applied
        if callback is None:
            self._apply(checked)  # nothing to wait for: no other update can come in between
            return checked
        lock = self._updating
        if lock is None:
            lock = self._updating = trio.Lock()
        async with lock:  # fair (FIFO): report and apply one update at a time, in report order
            try:
                outcome = callback(checked, source=source, call_id=call_id)
                if inspect.isawaitable(outcome):
                    await outcome
            except BaseException as exc:
                if is_cancellation(exc):
                    self._apply(checked)
                raise
            self._apply(checked)
        return checked

    def replay_updates(self, updates: Iterable[PermissionUpdate]) -> None:
        """Apply stored rule updates again (a reopened session), without calling `on_updates_applied`.

        Applied as they were accepted, never refused for their rules: a journal written before
        live updates were checked (`accept_updates`) may hold a rule that can never match. Such a
        rule is kept as it was (it matched nothing then and matches nothing now; the live layer
        stays what the journal says, so a later ``remove`` or `forget_session` takes it out), and
        each is logged once as a WARNING on the ``trio_agent.permissions`` logger."""
        checked = _checked_updates(updates, "replay_updates")
        for update in checked:
            refused = self._refused_rule((update,))
            if refused is not None:
                logger.warning(
                    "replayed a stored permission update as it was, though it would be refused now: %s "
                    "(it was accepted before such rules were checked; it matches no call)",
                    refused,
                )
            self._apply((update,))  # in order: a later update's remove exemption reads the layer as it was

    def apply_updates(self, updates: Iterable[PermissionUpdate]) -> None:
        """Apply rule updates to the session layer, without calling `on_updates_applied`.

        Checked as `accept_updates` checks them (`ConfigError`, nothing applied). For updates
        that must be reported (journalled), use `accept_updates`.
        """
        checked = _checked_updates(updates, "apply_updates")
        self._check_rules(checked)
        self._apply(checked)

    def _check_rules(self, updates: tuple[PermissionUpdate, ...]) -> None:
        """`ConfigError` for the first rule of *updates* that `_refused_rule` refuses."""
        refused = self._refused_rule(updates)
        if refused is not None:
            raise ConfigError(f"{refused}; nothing of these permission updates was applied")

    def _refused_rule(self, updates: Iterable[PermissionUpdate]) -> str | None:
        """Why the first refused rule of *updates* is refused, or ``None``: a rule that could never
        match a call of the tool it names as written (`never_matches`, the judgement
        `PermissionRules.check_tools` makes of configured rules), judged for the tools this engine
        knows (`_known_tool`). An added deny rule ``Read:./.env`` would deny nothing (a call's
        content is ``.env``), an added allow rule grant nothing; a ``remove`` of such a rule would
        take nothing out (a grant would stay), unless the session layer holds that very rule (a
        journal from before these checks may have put it there): removing it is always taken."""
        for update in updates:
            if update.mode is not None:
                continue
            held: Sequence[Rule] = ()
            if update.action == "remove":
                held = self._session_allow if update.behavior is RuleBehavior.ALLOW else self._session_deny
            for rule in update.rules:
                tool = self._known_tool(rule.tool)
                problem = None if tool is None or rule in held else never_matches(rule, tool)
                if problem is not None:
                    return f"permission update {update.action} {update.behavior.value} rule {rule.text!r} {problem}"
        return None

    def _known_tool(self, name: str) -> Tool[Any] | None:
        """The tool *name* whose calls' signature content this engine makes as the tool itself does:
        its ``signature_content=`` entry is that tool's own `Tool.signature_content_for` (a session
        gives one for every tool of its spec). ``None`` for any other name: the engine does not
        know the tool, or a content function of its own decides the content's form."""
        fn = self._content_map.get(name)
        owner = getattr(fn, "__self__", None)
        if (
            isinstance(owner, Tool)
            and owner.name == name
            and getattr(fn, "__func__", None) is type(owner).signature_content_for
        ):
            return owner
        return None

    def _apply(self, updates: tuple[PermissionUpdate, ...]) -> None:
        """Adding a rule with one behaviour takes it out of the other session list (so the session layer
        never conflicts with itself); removing works on the session layer only; ``set_mode`` switches
        the mode (the table's policy follows it)."""
        if not updates:
            return
        for update in updates:
            if update.mode is not None:
                self._mode = update.mode
                continue
            allow, deny = self._rule_lists()
            target = allow if update.behavior is RuleBehavior.ALLOW else deny
            other = deny if update.behavior is RuleBehavior.ALLOW else allow
            for rule in update.rules:
                if update.action == "add":
                    if rule in other:
                        other.remove(rule)
                    if rule not in target:
                        target.append(rule)
                elif rule in target:
                    target.remove(rule)

    def never_allowed(self, tool: Tool[Any]) -> str | None:
        """Why every call of *tool* will be denied as things stand, or ``None`` when some call could run.

        Only the sure cases: no handler and no hooks (either may allow what it is
        asked about); no allow rule that could match the tool; no wholesale deny
        rule (that refusal is deliberate); and either the mode asks for the tool's
        kind (no behaviour resolver that could narrow it, not ``plan``, whose refusal
        is deliberate) or an ask rule covers every call (not in bypass).
        """
        if self._handler is not None or self._hooks:
            return None
        name = tool.name
        for rule in (*self._rules.rules(RuleBehavior.ALLOW), *self._session_allow):
            if (rule.tool_prefix and name.startswith(rule.tool)) or rule.tool == name:
                return None
        for rule in self._rules.rules(RuleBehavior.DENY):
            if rule.matches_call(name, None):
                return None
        mode = self._mode
        if mode is not PermissionMode.BYPASS:
            for rule in self._rules.rules(RuleBehavior.ASK):
                if rule.matches_call(name, None):
                    return f"it matches ask rule {rule.text!r}"
        if tool.resolver is None and MODE_TABLE[mode][tool.kind] is RuleBehavior.ASK:
            return f"permission mode {mode.value!r} asks before {tool.kind.value} tools"
        return None

    def remember(self, signature: str) -> None:
        """Approve this exact signature for the rest of the session."""
        if not isinstance(signature, str) or not signature:
            raise ConfigError(f"a signature must be a non-empty string, got {signature!r}")
        self._approvals().add(signature)

    async def forget_session(self) -> None:
        """Drop every session approval and session rule.

        The rules go as updates (``remove``) through `accept_updates`, so whoever records the
        updates records this too: a session's journal, whose reopen would otherwise replay the
        rules it had granted. The remembered signatures were never recorded: they just go.
        """
        removals = [
            PermissionUpdate.remove(*rules, behavior=behavior)
            for rules, behavior in ((self._session_allow, RuleBehavior.ALLOW), (self._session_deny, RuleBehavior.DENY))
            if rules
        ]
        if removals:
            # What the layer holds, removed as it is: no rule check (`_refused_rule` takes such a remove anyway).
            await self._report_and_apply(tuple(removals), "forget_session", None)
        if isinstance(self._approved, set):
            self._approved.clear()

    def _approvals(self) -> set[str]:
        """The engine's own set of remembered signatures, made when the first is remembered."""
        approved = self._approved
        if not isinstance(approved, set):
            approved = self._approved = set()
            self._made_policy = None  # the policy reads the engine's own collections
        return approved

    def _rule_lists(self) -> tuple[list[Rule], list[Rule]]:
        """The engine's own session allow and deny lists, made at the first rule update."""
        allow, deny = self._session_allow, self._session_deny
        if not isinstance(allow, list) or not isinstance(deny, list):
            allow = self._session_allow = list(allow)
            deny = self._session_deny = list(deny)
            self._made_policy = None  # the policy reads the engine's own collections
        return allow, deny

    def signature(self, tool: Tool[Any], input: JsonObject) -> str:
        """``Name`` or ``Name:content`` for a call of *tool* with *input* (raises what the callable raises)."""
        return _Signatures(self._content_map, self._content_fn)(tool, input)

    def as_stage(self, answered: dict[tuple[str, str], StageDecision] | None = None) -> Stage:
        """This engine as a ``permission`` stage for `ToolStages`.

        *answered* holds decisions made elsewhere for single calls, by (agent id, call id): a
        person's answer to a paused request (`conclude`), kept for a recovery re-run too. The
        stage takes such a decision once, instead of walking the table again.
        """
        return _PermissionStage(self, answered).permission_stage

    # -- the table -------------------------------------------------------------

    async def decide(self, tool: Tool[Any], input: JsonObject, context: ExecutionContext) -> Decision:
        """Walk the decision table for one call of *tool* with *input*.

        Raises only what the recorder raises, `LeaseLostError`, or
        ``trio.Cancelled``; everything a tool, hook or handler does wrong
        becomes a deny.
        """
        verdict = await self.evaluate(tool, input, context)
        if isinstance(verdict, AskNeeded):
            return await self._ask(tool, verdict, context)
        return verdict

    async def evaluate(self, tool: Tool[Any], input: JsonObject, context: ExecutionContext) -> Decision | AskNeeded:
        """Stages 0-11 for one call, exactly as `decide` walks them; `AskNeeded` where `decide` would ask.

        The tool's own check runs (stage 3); nobody is asked, nothing is
        recorded, the session layer is not changed. Answer an `AskNeeded` with
        `conclude`. Raises only `LeaseLostError` or ``trio.Cancelled``.
        """
        screened = await self._screen(tool, input, context)
        if isinstance(screened, Decision):
            return screened
        return evaluate_after_screen(tool, screened, self._policy())

    async def conclude(
        self,
        tool: Tool[Any],
        ask: AskNeeded,
        context: ExecutionContext,
        answer: PermissionAllow | PermissionDeny,
    ) -> Decision:
        """Conclude *ask* (from `evaluate`) with an *answer* given elsewhere, e.g. in a continuation run.

        An allow stands only if stages 0-5 pass again on its input
        (``updated_input``, else the asked input), in the mode and with the
        rules of now, as for a handler's allow in `decide`: an edit that the
        schema, the path policy, the tool's check, a deny rule or plan mode
        refuses is denied (by that stage). A tool-level ask on that input is
        satisfied by this answer. An allow that stood applies its
        ``rule_updates`` (through `accept_updates`, source ``"interrupt"``)
        and ``remember``. A deny answer denies, with its message and
        ``stop_loop``. The decision's source is ``interrupt`` unless a stage
        of 0-5 denied the allow; ``asked`` is true and ``permission_id`` is
        ``None``: the engine records nothing (whoever asked records).
        """
        if not isinstance(ask, AskNeeded):
            raise ConfigError(f"conclude() needs the AskNeeded that evaluate() returned, got {ask!r}")
        if ask.tool_name != tool.name:
            raise ConfigError(f"this ask is for tool {ask.tool_name!r}, not {tool.name!r}")
        if not isinstance(answer, (PermissionAllow, PermissionDeny)):
            raise ConfigError(f"an answer is a PermissionAllow or a PermissionDeny, got {answer!r}")
        if isinstance(answer, PermissionAllow):
            # Before anything is decided: a refused rule update fails this answer, and changes nothing.
            self._check_rules(answer.rule_updates)
        decision = await self._conclude(tool, ask, context, _Answer(DecisionSource.INTERRUPT, answer), None)
        if decision.allowed and isinstance(answer, PermissionAllow):
            await self._apply_answer(answer, DecisionSource.INTERRUPT, decision, context)
        return decision

    async def _screen(self, tool: Tool[Any], input: JsonObject, context: ExecutionContext) -> Subject | Decision:
        """Stages 0-5, the ones that can only deny (or make the call ask); run again after an allow answer."""
        policy = self._policy()
        screened = subject(
            tool, input, policy, tool_filter=self._filter_for(context.agent_id), agent_id=context.agent_id
        )
        if isinstance(screened, Decision):
            return screened
        # 3. The tool's own check: user code, maybe async, so it runs here, between the pure stages.
        check = self._check_for(tool)
        if check is not None:
            try:
                outcome: object = check(json_copy(screened.input))
                if inspect.isawaitable(outcome):
                    outcome = await self._bounded_check(outcome, context.abort)
            except LeaseLostError:
                raise
            except Exception as exc:
                return check_failed(tool, screened, exc)
            if isinstance(outcome, _CheckCut):
                return deny(screened.input, screened.signature, outcome.source, outcome.message(tool, self.ask_timeout))
            policy = self._policy()  # the rules and the mode as they are after the check
            screened = after_check(tool, screened, outcome, policy)
            if isinstance(screened, Decision):
                return screened
        return screen_rest(tool, screened, policy)

    async def _bounded_check(self, outcome: Awaitable[object], abort: AbortHandle) -> object:
        """Await a tool's own async check under the ask's bounds: ``ask_timeout`` and the call's
        abort (a check that never returns would hold the call, and its request, forever). A check
        that either bound cut short, even one that answered late, gives a `_CheckCut`."""
        result, timed_out = await _within_bounds(outcome, trio.current_time() + self.ask_timeout, abort)
        if abort.reason is not None:
            return _CheckCut(DecisionSource.ABORT, abort.reason.message)
        if timed_out:
            return _CheckCut(DecisionSource.TOOL, None)
        return result

    def _policy(self) -> Policy:
        """What the table reads of this engine, as it stands now: made again when the mode changes
        or the session layer gets its own collections (it is read through them; the rest never
        changes)."""
        policy = self._made_policy
        if policy is None or policy.mode is not self._mode:
            signatures = _Signatures(self._content_map, self._content_fn)  # holds no engine: no cycle
            policy = self._made_policy = Policy(
                self._rules, self._mode, self._approved, self._session_allow, self._session_deny,
                self._path_policy, signatures,
            )  # fmt: skip
        return policy

    def _empty_layer_policy(self) -> Policy:
        """`_policy` of an engine derived from this one before its session layer changes (made once
        per mode, then shared by every such engine)."""
        policy = self._bare_policy
        if policy is None or policy.mode is not self._mode:
            signatures = _Signatures(self._content_map, self._content_fn)
            policy = self._bare_policy = Policy(
                self._rules, self._mode, _NO_APPROVALS, _NO_SESSION_RULES, _NO_SESSION_RULES,
                self._path_policy, signatures,
            )  # fmt: skip
        return policy

    def allows_outright(self, tool: Tool[Any], agent_id: str) -> bool:
        """Whether the table, as it stands, allows every schema-valid call of *tool* by *agent_id*
        whatever its input: nothing of the input is read past its schema (no tool check, behaviour
        resolver, signature content or affected paths), no deny or ask rule could match, no path
        policy applies, the mode allows the tool's kind and the agent's tool filter the tool.
        Then `decide` would allow such a call (stage 10, or an allow rule or approval before it),
        asking and recording nothing: the permission stage skips the walk. (A filter that refuses
        is asked again by `decide`, which denies.)"""
        if (
            type(tool) is not Tool
            or tool.check_permissions is not None
            or tool.resolver is not None
            or tool.affected_paths is not None
            or tool.signature_content is not None
        ):
            return False
        if (
            self._path_policy is not None
            or self._content_fn is not None
            or self._session_deny
            or tool.name in self._tool_checks
        ):
            return False
        content = self._content_map.get(tool.name)
        # The tool's own conventional field (what sessions register for every tool) reads the
        # input and cannot fail; anything else might deny a call for its content.
        if content is not None and (
            getattr(content, "__self__", None) is not tool
            or getattr(content, "__func__", None) is not Tool.signature_content_for
        ):
            return False
        mode = self._mode
        if MODE_TABLE[mode][tool.kind] is not RuleBehavior.ALLOW:
            return False
        rules = self._rules
        if rules is not _NO_RULES and (
            rules.rules(RuleBehavior.DENY) or (mode is not PermissionMode.BYPASS and rules.rules(RuleBehavior.ASK))
        ):
            return False
        tool_filter = self._filter_for(agent_id)
        return tool_filter is None or tool_filter.allows(tool.name)

    def _check_for(self, tool: Tool[Any]) -> ToolPermissionCheck | None:
        check = self._tool_checks.get(tool.name)
        if check is None:
            check = tool.check_permissions
        return check

    def _filter_for(self, agent_id: str) -> ToolFilter | None:
        tool_filter = self._tool_filter
        if tool_filter is None or isinstance(tool_filter, ToolFilter):
            return tool_filter
        return tool_filter(agent_id)

    # -- the ask ---------------------------------------------------------------

    async def _ask(self, tool: Tool[Any], ask: AskNeeded, context: ExecutionContext) -> Decision:
        """Stage 12-13: the hooks, then the handler; record requested / resolved around it."""
        answerers: list[tuple[DecisionSource, PermissionHandler]] = [(DecisionSource.HOOK, h) for h in self._hooks]
        if self._handler is not None:
            answerers.append((DecisionSource.HANDLER, self._handler))
        signature = ask.signature
        if not answerers:
            return deny(
                ask.input, signature, DecisionSource.NO_HANDLER,
                _no_handler_message(tool.name, signature, ask.tool_kind, self._mode, ask.reason, ask.message, ask.rule),
            )  # fmt: skip
        abort = context.abort
        if abort.reason is not None:
            return deny(ask.input, signature, DecisionSource.ABORT, f"permission not asked: {abort.reason.message}")
        permission_id = f"{context.tool_call_id}:permission"
        request = PermissionRequest(
            tool_name=tool.name,
            input=json_copy(ask.input),
            signature=signature,
            mode=self._mode,
            tool_kind=ask.tool_kind,
            side_effect=ask.side_effect,
            affected_paths=ask.affected_paths,
            reason=ask.reason,
            message=ask.message,
            rule=ask.rule,
            agent_id=context.agent_id,
            session_id=context.session_id,
            request_id=context.request_id,
            turn_id=context.turn_id,
            tool_call_id=context.tool_call_id,
            permission_id=permission_id,
            deadline=trio.current_time() + self.ask_timeout,
            abort=abort,
            restate=_Restate(self, tool, context).restate,
        )
        if self._record is not None:
            await self._record("requested", PermissionRecord(permission_id, request))
        answer = _Answer(DecisionSource.NO_ANSWER)
        try:
            answer = await self._consult(answerers, request, abort)
            decision = await self._conclude(tool, ask, context, answer, permission_id)
        except BaseException as exc:
            # Cancelled from outside while asking (also as a group: a hook or handler may open a
            # nursery): resolve the request as cancelled, then go on cancelling.
            if not is_cancellation(exc):
                raise
            cancelled = Decision(
                False, DecisionSource.ABORT, ask.input, signature, "permission request cancelled",
                asked=True, permission_id=permission_id,
            )  # fmt: skip
            await self._record_shielded(PermissionRecord(permission_id, request, cancelled), swallow=True)
            raise
        if decision.source is DecisionSource.ABORT:
            # The call's abort: the write is shielded, then an outer cancellation (the pipeline's) proceeds.
            await self._record_shielded(PermissionRecord(permission_id, request, decision), swallow=False)
            await trio.lowlevel.checkpoint_if_cancelled()
            return decision
        if self._record is not None:
            await self._record("resolved", PermissionRecord(permission_id, request, decision))
        if decision.allowed and isinstance(answer.result, PermissionAllow):
            # Only an allow that stood applies its side effects, and only once it is recorded.
            await self._apply_answer(answer.result, answer.source, decision, context)
        return decision

    async def _consult(
        self,
        answerers: Sequence[tuple[DecisionSource, PermissionHandler]],
        request: PermissionRequest,
        abort: AbortHandle,
    ) -> _Answer:
        """The first allow or deny of the answerers, bounded by the deadline and the call's abort."""
        answer, timed_out = await _within_bounds(self._first_answer(answerers, request), request.deadline, abort)
        if abort.reason is not None:
            return _Answer(DecisionSource.ABORT, message=f"permission request cancelled: {abort.reason.message}")
        if timed_out:
            # Even an answer that came in after the deadline (a handler that ignored the cancellation) is refused.
            return _Answer(
                DecisionSource.TIMEOUT,
                message=f"permission request for {request.signature} got no answer within {self.ask_timeout:g} s",
            )
        assert answer is not None  # neither bound cut it short: the answerers' answer
        return answer

    async def _first_answer(
        self, answerers: Sequence[tuple[DecisionSource, PermissionHandler]], request: PermissionRequest
    ) -> _Answer:
        for source, answerer in answerers:
            who = f"permission {source.value} {_callable_name(answerer)}"
            try:
                result: object = await answerer(request)
            except LeaseLostError:
                raise
            except Exception as exc:
                return _Answer(DecisionSource.ERROR, message=f"{who} failed: {describe(exc, 'repr')}")
            except BaseException as exc:
                if not stray_cancellation(exc):
                    raise  # the deadline's or the abort's cancellation, or one from outside
                told = f"it raised {describe(exc, 'repr')} {STRAY_CANCELLED}"
                return _Answer(DecisionSource.ERROR, message=f"{who} failed: {told}")
            if isinstance(result, PermissionAllow) and result.rule_updates:
                refused = self._refused_rule(result.rule_updates)
                if refused is not None:
                    # The answerer's mistake fails its answer (a deny, source error), never the session.
                    logger.warning(
                        "%s answered %s with a rule update that was refused: %s", who, request.signature, refused
                    )
                    return _Answer(
                        DecisionSource.ERROR, message=f"{who} answered with a refused rule update: {refused}"
                    )
            if isinstance(result, (PermissionAllow, PermissionDeny)):
                return _Answer(source, result)
            if result is not None and not isinstance(result, PermissionAsk):
                return _Answer(
                    DecisionSource.ERROR,
                    message=f"{who} returned {safe_repr(result)}, expected PermissionAllow, PermissionDeny, "
                    "PermissionAsk or None",
                )
        if self._handler is None:
            # Only hooks were asked and none answered: the same refusal as having nobody to ask.
            return _Answer(
                DecisionSource.NO_HANDLER,
                message=_no_handler_message(
                    request.tool_name, request.signature, request.tool_kind, request.mode,
                    request.reason, request.message, request.rule,
                ),
            )  # fmt: skip
        return _Answer(
            DecisionSource.NO_ANSWER, message=f"nobody answered the permission request for {request.signature}"
        )

    async def _conclude(
        self,
        tool: Tool[Any],
        ask: AskNeeded,
        context: ExecutionContext,
        answer: _Answer,
        permission_id: str | None,
    ) -> Decision:
        result = answer.result
        if isinstance(result, PermissionAllow):
            new_input = ask.input if result.updated_input is None else result.updated_input
            # A set, NaN or a non-string key would pass the schema and then fail the whole request.
            problem = None if new_input is ask.input else json_problem(new_input, "updated_input")
            if problem is not None:
                return Decision(
                    False, DecisionSource.ERROR, ask.input, ask.signature,
                    f"the permission {answer.source.value}'s updated_input is not JSON: {problem}",
                    asked=True, permission_id=permission_id,
                )  # fmt: skip
            # An allow is final only if stages 0-5 still pass: on the updated input, in the current mode,
            # with the current rules (plan mode denies even after a handler allows). A tool-level ask
            # on the new input is satisfied by this very answer; a tool-level deny still denies.
            screened = await self._screen(tool, new_input, context)
            if isinstance(screened, Decision):
                return attrs.evolve(screened, asked=True, permission_id=permission_id)
            message = f"allowed by the permission {answer.source.value}"
            return Decision(
                True, answer.source, screened.input, screened.signature, message,
                asked=True, permission_id=permission_id,
            )  # fmt: skip
        if isinstance(result, PermissionDeny):
            return Decision(
                False, answer.source, ask.input, ask.signature, result.message, result.stop_loop,
                asked=True, permission_id=permission_id,
            )  # fmt: skip
        message = answer.message or "permission denied"
        if answer.source is DecisionSource.NO_ANSWER:
            message = f"{message}; denied"
        return Decision(
            False, answer.source, ask.input, ask.signature, message, asked=True, permission_id=permission_id
        )

    async def _apply_answer(
        self, result: PermissionAllow, source: DecisionSource, decision: Decision, context: ExecutionContext
    ) -> None:
        """The side effects of an allow that stood: its rule updates (checked when the answer came:
        `_first_answer`, `conclude`), then ``remember`` (the final signature)."""
        await self._report_and_apply(result.rule_updates, source.value, context.tool_call_id)
        if result.remember:
            self._approvals().add(decision.signature)

    async def _record_shielded(self, record: PermissionRecord, *, swallow: bool) -> None:
        if self._record is None:
            return
        with trio.CancelScope(shield=True, deadline=trio.current_time() + self.record_grace):
            try:
                await self._record("resolved", record)
            except Exception:
                if not swallow:
                    raise
