"""The permission engine: may this tool call run, with which input?

One `PermissionEngine` serves a session: its root agent and every subagent
(the tool pipeline is shared, and `PermissionRequest.agent_id` tells who is
calling). `PermissionEngine.decide` walks the decision table below, top to
bottom; the first stage that decides ends the walk. ``docs/permissions.md``
holds the same table for people; the tests pin every row.

====  ==========================  ============================================================
  #   stage                       what it can decide
====  ==========================  ============================================================
  0   tool filter (per agent)     deny: the tool is not available to this agent
  1   validation, behaviour,      deny: the input fails the tool's schema (every mode), or the
      signature                   tool's resolver or signature callable failed
  2   path policy                 deny: an affected path has ``..``, leaves every workspace
                                  root, or escapes through a symlink (every mode, bypass too)
  3   the tool's own check        deny (final, no hook or handler is asked); ask (forces the
                                  ask at 11: no rule, approval or mode can skip it); allow
                                  with updated input (input replaced, 1-2 run again)
  4   deny rules                  deny (configured and session deny rules, every mode)
  5   mode hard limit             deny: ``plan`` and the call is not read-only (no rule,
                                  approval, hook or handler can lift it)
  6   tool-level ask (from 3)     ask (reason ``tool``)
  7   session approvals           allow: a remembered signature or a session allow rule
  8   allow rules                 allow (hooks and the handler are not asked)
  9   ask rules                   ask (reason ``rule``); skipped in ``bypass``
 10   mode table                  allow where `MODE_TABLE` says allow for the resolved kind
 11   default                     ask (reason ``mode``)
 12   the ask                     PermissionRequest hooks in order, then the handler; the
                                  first allow or deny wins (ask / None = no answer, next).
                                  An allow is final only after 0-5 pass again on the
                                  (possibly updated) input; then its rule updates and
                                  ``remember`` apply. One deadline covers the whole ask;
                                  the call's abort cancels it. Timeout, abort, a raising
                                  or misbehaving hook/handler: deny.
 13   nobody answered             deny (source ``no_handler`` when there is no handler at all;
                                  its stage `Deny` has code ``"no_handler"``)
====  ==========================  ============================================================

Mode table (resolved kind of the call's current input)::

                  readonly  write  execute
    default       allow     ask    ask
    accept_edits  allow     allow  ask
    plan          allow     DENY   DENY      (DENY is the hard limit of stage 5)
    bypass        allow     allow  allow     (ask rules are skipped; deny rules, the path
                                              policy, the tool's check and validation still apply)
"""

from __future__ import annotations

import enum
import inspect
import logging
import os
import re
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias

import attrs
import trio
import trio.lowlevel

from .._abort import AbortHandle
from .._config import validate_timeout
from .._errors import ConfigError, LeaseLostError, ToolBehaviorError
from .._journal._events import PermissionDecision
from .._tools._context import ExecutionContext
from .._tools._definition import SideEffect, Tool, ToolBehavior, ToolKind
from .._tools._results import JsonObject, ToolErrorType, json_copy
from .._tools._stages import Allow, Deny, Stage, StageRequest

__all__ = [
    "MODE_TABLE",
    "AskReason",
    "Decision",
    "DecisionSource",
    "PathPolicy",
    "PermissionAllow",
    "PermissionAsk",
    "PermissionDeny",
    "PermissionEngine",
    "PermissionHandler",
    "PermissionHook",
    "PermissionMode",
    "PermissionPhase",
    "PermissionRecord",
    "PermissionRecorder",
    "PermissionRequest",
    "PermissionResult",
    "PermissionRules",
    "PermissionUpdate",
    "Rule",
    "RuleBehavior",
    "RuleMatch",
    "SignatureContent",
    "ToolFilter",
    "ToolPermissionCheck",
    "UpdatesApplied",
    "update_from_json",
    "update_to_json",
]

logger = logging.getLogger("trio_agent.permissions")


# ---------------------------------------------------------------- modes and rules


class PermissionMode(enum.Enum):
    """How much a session lets through without asking (see `MODE_TABLE`)."""

    DEFAULT = "default"
    ACCEPT_EDITS = "accept_edits"
    PLAN = "plan"
    BYPASS = "bypass"


class RuleBehavior(enum.Enum):
    """What a permission rule (or a mode-table cell) says about a call."""

    ALLOW = "allow"
    ASK = "ask"
    DENY = "deny"


_A, _Q, _D = RuleBehavior.ALLOW, RuleBehavior.ASK, RuleBehavior.DENY
_R, _W, _X = ToolKind.READONLY, ToolKind.WRITE, ToolKind.EXECUTE

MODE_TABLE: Mapping[PermissionMode, Mapping[ToolKind, RuleBehavior]] = types.MappingProxyType(
    {
        PermissionMode.DEFAULT: types.MappingProxyType({_R: _A, _W: _Q, _X: _Q}),
        PermissionMode.ACCEPT_EDITS: types.MappingProxyType({_R: _A, _W: _A, _X: _Q}),
        PermissionMode.PLAN: types.MappingProxyType({_R: _A, _W: _D, _X: _D}),
        PermissionMode.BYPASS: types.MappingProxyType({_R: _A, _W: _A, _X: _A}),
    }
)
"""What each mode does with a call of each resolved kind when no rule decided.

``DENY`` cells are a hard limit applied before any rule or answer can allow
(stage 5); ``ALLOW`` cells apply after the rules (stage 10); ``ASK`` falls
through to the default ask.
"""


def _mode(value: PermissionMode | str) -> PermissionMode:
    if isinstance(value, PermissionMode):
        return value
    try:
        return PermissionMode(value)
    except ValueError:
        allowed = ", ".join(repr(mode.value) for mode in PermissionMode)
        raise ConfigError(f"permission mode must be one of {allowed}, got {value!r}") from None


def _behavior(value: RuleBehavior | str) -> RuleBehavior:
    if isinstance(value, RuleBehavior):
        return value
    try:
        return RuleBehavior(value)
    except ValueError:
        raise ConfigError(f"rule behavior must be 'allow', 'ask' or 'deny', got {value!r}") from None


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_PREFIX = re.compile(r"[A-Za-z0-9_-]{0,63}\*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@attrs.frozen
class Rule:
    """One parsed permission rule.

    Syntax (``text``)::

        *                 every call of every tool
        Name              every call of tool Name (whatever its signature content)
        Prefix*           every call of every tool whose name starts with Prefix
        Name:*            the same as Name
        Name:content      calls of Name whose signature content is exactly ``content``
        Name:prefix*      calls of Name whose signature content starts with ``prefix``

    ``*`` is only allowed as the last character; the content may itself contain
    ``:`` (the tool name ends at the first one). Two rules are equal when they
    match the same calls (``Bash`` == ``Bash:*``); ``text`` is the spelling.
    """

    text: str = attrs.field(eq=False)
    tool: str
    tool_prefix: bool
    content: str | None
    content_prefix: bool

    @classmethod
    def parse(cls, text: object) -> Rule:
        """Parse *text*; raise `ConfigError` saying what is wrong with it."""
        if isinstance(text, Rule):
            return text
        if not isinstance(text, str):
            raise ConfigError(f"a permission rule must be a string, got {text!r}")
        if not text.strip():
            raise ConfigError("empty permission rule")
        if text != text.strip():
            raise ConfigError(f"permission rule {text!r} has leading or trailing whitespace")
        if _CONTROL.search(text):
            raise ConfigError(f"permission rule {text!r} contains a control character")
        name, sep, content = text.partition(":")
        star_inside = "*" in text[:-1]
        if star_inside:
            raise ConfigError(f"permission rule {text!r}: '*' is only allowed as the last character (a prefix)")
        if not sep:
            if name.endswith("*"):
                if not _TOOL_PREFIX.fullmatch(name):
                    raise ConfigError(f"permission rule {text!r}: {name[:-1]!r} is not a tool-name prefix")
                return cls(text, name[:-1], True, None, False)
            if not _TOOL_NAME.fullmatch(name):
                raise ConfigError(
                    f"permission rule {text!r}: {name!r} is not a tool name (1-64 letters, digits, '_' or '-')"
                )
            return cls(text, name, False, None, False)
        if not _TOOL_NAME.fullmatch(name):
            raise ConfigError(
                f"permission rule {text!r}: {name!r} is not a tool name (1-64 letters, digits, '_' or '-'); "
                "a rule with ':content' names exactly one tool"
            )
        if not content:
            raise ConfigError(f"permission rule {text!r}: empty content after ':' (write {name!r} or '{name}:*')")
        if content == "*":
            return cls(text, name, False, None, False)
        if content.endswith("*"):
            return cls(text, name, False, content[:-1], True)
        return cls(text, name, False, content, False)

    def __str__(self) -> str:
        return self.text

    def matches(self, signature: str) -> bool:
        """Whether this rule matches the signature ``Name`` or ``Name:content``."""
        name, sep, content = signature.partition(":")
        return self.matches_call(name, content if sep else None)

    def matches_call(self, tool_name: str, content: str | None) -> bool:
        """Whether this rule matches a call of *tool_name* with signature *content* (``None``: no content)."""
        if self.tool_prefix:
            return tool_name.startswith(self.tool)
        if tool_name != self.tool:
            return False
        if self.content is None:
            return True
        if content is None:
            return False
        return content.startswith(self.content) if self.content_prefix else content == self.content


def _rule_texts(value: Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        raise ConfigError(f"permission rules must be a list of rule strings, got the single string {value!r}")
    try:
        return tuple(value)
    except TypeError:
        raise ConfigError(f"permission rules must be a list of rule strings, got {value!r}") from None


@attrs.frozen
class RuleMatch:
    """The rule that decided, and how."""

    behavior: RuleBehavior
    rule: Rule


@attrs.frozen
class PermissionRules:
    """The ``allow``, ``ask`` and ``deny`` rule lists (see `Rule` for the syntax).

    Validated at construction (`ConfigError`): every rule must parse, and one
    rule may not appear in two lists (``Bash`` in allow and ``Bash:*`` in deny
    is the same rule: a conflict). Repeats within one list are dropped.
    Precedence when several rules match a signature: deny > allow > ask.
    """

    allow: tuple[str, ...] = attrs.field(default=(), converter=_rule_texts)
    ask: tuple[str, ...] = attrs.field(default=(), converter=_rule_texts)
    deny: tuple[str, ...] = attrs.field(default=(), converter=_rule_texts)
    _parsed: Mapping[RuleBehavior, tuple[Rule, ...]] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        parsed: dict[RuleBehavior, tuple[Rule, ...]] = {}
        seen: dict[Rule, tuple[RuleBehavior, Rule]] = {}
        for behavior in (RuleBehavior.DENY, RuleBehavior.ALLOW, RuleBehavior.ASK):
            rules: list[Rule] = []
            for index, text in enumerate(getattr(self, behavior.value)):
                try:
                    rule = Rule.parse(text)
                except ConfigError as exc:
                    raise ConfigError(f"permissions.{behavior.value}[{index}]: {exc}") from None
                previous = seen.get(rule)
                if previous is not None:
                    other_behavior, other = previous
                    if other_behavior is behavior:
                        continue  # a repeat within one list
                    spelled = "" if other.text == rule.text else f" (as {other.text!r})"
                    raise ConfigError(
                        f"conflicting permission rules: {rule.text!r} is in both "
                        f"permissions.{other_behavior.value}{spelled} and permissions.{behavior.value}"
                    )
                seen[rule] = (behavior, rule)
                rules.append(rule)
            parsed[behavior] = tuple(rules)
        object.__setattr__(self, "_parsed", types.MappingProxyType(parsed))

    def rules(self, behavior: RuleBehavior) -> tuple[Rule, ...]:
        """The parsed rules of one list, in order."""
        return self._parsed[behavior]

    def first(self, behavior: RuleBehavior, signature: str) -> Rule | None:
        """The first rule of one list that matches *signature*."""
        for rule in self._parsed[behavior]:
            if rule.matches(signature):
                return rule
        return None

    def match(self, signature: str) -> RuleMatch | None:
        """The deciding rule for *signature*: deny > allow > ask; ``None`` when no rule matches."""
        for behavior in (RuleBehavior.DENY, RuleBehavior.ALLOW, RuleBehavior.ASK):
            rule = self.first(behavior, signature)
            if rule is not None:
                return RuleMatch(behavior, rule)
        return None


# ---------------------------------------------------------------- answers


def _update_rules(value: Iterable[str | Rule]) -> tuple[Rule, ...]:
    if isinstance(value, (str, bytes)):
        raise ConfigError(f"PermissionUpdate.rules must be a list of rules, got the single string {value!r}")
    rules = tuple(Rule.parse(text) for text in value)
    if not rules:
        raise ConfigError("PermissionUpdate.rules is empty")
    return rules


def _update_behavior(value: RuleBehavior | str) -> RuleBehavior:
    behavior = _behavior(value)
    if behavior is RuleBehavior.ASK:
        raise ConfigError("a PermissionUpdate adds or removes allow or deny rules, not ask rules")
    return behavior


def _check_action(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("add", "remove"):
        raise ConfigError(f"PermissionUpdate.action must be 'add' or 'remove', got {value!r}")


@attrs.frozen
class PermissionUpdate:
    """A change to the session's rules, carried by a `PermissionAllow`.

    ``add`` allow rules become session approvals, ``add`` deny rules session
    deny rules; ``remove`` takes rules out of the session layer again. The
    configured `PermissionRules` are never changed (a session allow cannot lift
    a configured deny: deny wins).
    """

    action: Literal["add", "remove"] = attrs.field(validator=_check_action)
    rules: tuple[Rule, ...] = attrs.field(converter=_update_rules)
    behavior: RuleBehavior = attrs.field(default=RuleBehavior.ALLOW, converter=_update_behavior)

    @classmethod
    def add(cls, *rules: str | Rule, behavior: RuleBehavior | str = RuleBehavior.ALLOW) -> PermissionUpdate:
        return cls("add", rules, behavior)

    @classmethod
    def remove(cls, *rules: str | Rule, behavior: RuleBehavior | str = RuleBehavior.ALLOW) -> PermissionUpdate:
        return cls("remove", rules, behavior)


def update_to_json(update: PermissionUpdate) -> JsonObject:
    """``{"action": "add"|"remove", "behavior": "allow"|"deny", "rules": [rule text, ...]}`` (for the journal)."""
    if not isinstance(update, PermissionUpdate):
        raise ConfigError(f"expected a PermissionUpdate, got {update!r}")
    return {"action": update.action, "behavior": update.behavior.value, "rules": [rule.text for rule in update.rules]}


def update_from_json(value: object) -> PermissionUpdate:
    """The `PermissionUpdate` that `update_to_json` made *value* from; `ConfigError` if *value* is not one."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"a stored permission update must be a JSON object, got {value!r}")
    keys = set(value)
    if keys != {"action", "behavior", "rules"}:
        raise ConfigError(
            f"a stored permission update has the keys 'action', 'behavior' and 'rules', got {sorted(map(str, keys))}"
        )
    rules = value["rules"]
    if not isinstance(rules, list) or not all(isinstance(rule, str) for rule in rules):
        raise ConfigError(f"a stored permission update's rules must be a list of strings, got {rules!r}")
    behavior = value["behavior"]
    if not isinstance(behavior, str):
        raise ConfigError(f"a stored permission update's behavior must be a string, got {behavior!r}")
    return PermissionUpdate(value["action"], rules, behavior)


def _optional_json_object(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"updated_input must be a JSON object (dict) or None, got {type(value).__name__}")


def _updates(value: Iterable[PermissionUpdate]) -> tuple[PermissionUpdate, ...]:
    updates = tuple(value)
    for update in updates:
        if not isinstance(update, PermissionUpdate):
            raise ConfigError(f"rule_updates must hold PermissionUpdate objects, got {update!r}")
    return updates


def _non_empty_message(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"a permission denial needs a message for the model, got {value!r}")


@attrs.frozen
class PermissionAllow:
    """Let the call run.

    ``updated_input`` replaces the input (the signature and path policy are
    recomputed from it); ``rule_updates`` change the session's rules;
    ``remember`` approves this exact signature for the rest of the session.
    A tool's own check may return this to normalise input; its rule updates
    and ``remember`` are ignored there.
    """

    updated_input: JsonObject | None = attrs.field(default=None, validator=_optional_json_object)
    rule_updates: tuple[PermissionUpdate, ...] = attrs.field(default=(), converter=_updates)
    remember: bool = False


@attrs.frozen
class PermissionDeny:
    """Refuse the call; ``message`` is what the model sees. ``stop_loop`` also ends the agent loop."""

    message: str = attrs.field(validator=_non_empty_message)
    stop_loop: bool = False


@attrs.frozen
class PermissionAsk:
    """No decision here: ask (a tool's check) or pass to the next answerer (a hook or the handler)."""

    message: str | None = None


PermissionResult: TypeAlias = PermissionAllow | PermissionDeny | PermissionAsk


class AskReason(enum.Enum):
    """Why the engine asks: the tool's own check, an ask rule, or the mode (the default ask)."""

    TOOL = "tool"
    RULE = "rule"
    MODE = "mode"


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


PermissionHandler: TypeAlias = Callable[[PermissionRequest], Awaitable[PermissionResult | None]]
"""``async def handler(request) -> PermissionAllow | PermissionDeny | PermissionAsk | None``."""

PermissionHook: TypeAlias = PermissionHandler
"""A PermissionRequest hook has the handler's shape; ``None`` or `PermissionAsk` passes to the next answerer."""

ToolPermissionCheck: TypeAlias = Callable[[JsonObject], PermissionResult | Awaitable[PermissionResult | None] | None]
"""A tool's own ``check_permissions(input)`` (sync or async); ``None`` means no objection."""

SignatureContent: TypeAlias = Callable[[JsonObject], str | None]
"""A tool's ``signature_content(input)``: the part after ``Name:`` in its signature (``None``/"" for none)."""


class UpdatesApplied(Protocol):
    """``on_updates_applied(updates, *, source, call_id)``, sync or async: rule updates are about to apply.

    ``source`` is who issued them (``"handler"`` or ``"hook"`` for an answer, or
    what `PermissionEngine.accept_updates` was given, e.g. ``"tool"``); ``call_id``
    the tool call they came with.
    """

    def __call__(
        self, updates: tuple[PermissionUpdate, ...], /, *, source: str, call_id: str | None
    ) -> Awaitable[None] | None: ...


# ---------------------------------------------------------------- decisions


class DecisionSource(enum.Enum):
    """Which stage of the table decided."""

    FILTER = "filter"
    VALIDATION = "validation"
    PATH_POLICY = "path_policy"
    TOOL = "tool"
    RULE = "rule"
    SESSION = "session"
    MODE = "mode"
    HOOK = "hook"
    HANDLER = "handler"
    NO_ANSWER = "no_answer"
    NO_HANDLER = "no_handler"
    TIMEOUT = "timeout"
    ABORT = "abort"
    ERROR = "error"


@attrs.frozen(eq=False)
class Decision:
    """The engine's verdict on one call.

    ``input`` is the final input (the same object that was passed in unless an
    answer or the tool's check replaced it); ``signature`` is computed from it.
    ``asked`` says a hook or the handler was consulted (then ``permission_id``
    names the request that was recorded). ``rule`` is the text of the deciding
    rule, if a rule decided.
    """

    allowed: bool
    source: DecisionSource
    input: JsonObject
    signature: str
    message: str | None = None
    stop_loop: bool = False
    rule: str | None = None
    asked: bool = False
    permission_id: str | None = None

    @property
    def outcome(self) -> PermissionDecision:
        """The journal's view: allow, deny, or cancel (the call was aborted while asking)."""
        if self.allowed:
            return PermissionDecision.ALLOW
        if self.source is DecisionSource.ABORT:
            return PermissionDecision.CANCEL
        return PermissionDecision.DENY

    def to_stage_decision(self, original_input: JsonObject | None = None) -> Allow | Deny:
        """The tool pipeline's view: `Allow` (with the input if it changed) or a ``permission_denied`` `Deny`.

        A ``stop_loop`` denial carries code ``"stop_loop"``; a call that needed an
        answer when the engine has no handler carries code ``"no_handler"``;
        input that fails the tool's schema is a ``validation`` error (code
        ``"invalid_input"``), as the pipeline's own schema check would report it.
        """
        if self.allowed:
            return Allow(None if self.input is original_input else self.input)
        if self.source is DecisionSource.VALIDATION:
            return Deny(self.message or "invalid input", ToolErrorType.VALIDATION, "invalid_input")
        code = "stop_loop" if self.stop_loop else "no_handler" if self.source is DecisionSource.NO_HANDLER else None
        return Deny(self.message or "permission denied", ToolErrorType.PERMISSION_DENIED, code)


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


# ---------------------------------------------------------------- tool filter


def _allowed_names(value: Iterable[str] | None) -> frozenset[str] | None:
    return None if value is None else _names(value, "allowed")


def _disallowed_names(value: Iterable[str] | None) -> frozenset[str]:
    return frozenset() if value is None else _names(value, "disallowed")


def _names(value: Iterable[str], field: str) -> frozenset[str]:
    if isinstance(value, (str, bytes)):
        raise ConfigError(f"{field} tools must be a list of tool names, got the single string {value!r}")
    try:
        names = frozenset(value)
    except TypeError:
        raise ConfigError(f"{field} tools must be a list of tool names, got {value!r}") from None
    for name in names:
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ConfigError(f"{field} tools: {name!r} is not a tool name")
    return names


@attrs.frozen
class ToolFilter:
    """Which tools an agent may use: ``allowed`` minus ``disallowed``.

    The same meaning everywhere (session, subagent, plugin): ``None`` (omitted)
    means no filter, a list means exactly that set, so ``allowed=[]`` allows
    nothing and ``disallowed=None`` or ``[]`` removes nothing.
    """

    allowed: frozenset[str] | None = attrs.field(default=None, converter=_allowed_names)
    disallowed: frozenset[str] = attrs.field(default=None, converter=_disallowed_names)

    def allows(self, name: str) -> bool:
        return (self.allowed is None or name in self.allowed) and name not in self.disallowed

    def filter(self, names: Iterable[str]) -> set[str]:
        """The names this filter lets through."""
        return {name for name in names if self.allows(name)}

    def intersect(self, other: ToolFilter) -> ToolFilter:
        """A filter allowing exactly what both allow (a subagent's allowlist within its session's)."""
        if self.allowed is None:
            allowed = other.allowed
        elif other.allowed is None:
            allowed = self.allowed
        else:
            allowed = self.allowed & other.allowed
        return ToolFilter(allowed, self.disallowed | other.disallowed)


# ---------------------------------------------------------------- path policy


def _roots(value: Iterable[str | os.PathLike[str]] | str | os.PathLike[str]) -> tuple[str, ...]:
    items: Iterable[object] = [value] if isinstance(value, (str, bytes, os.PathLike)) else value
    roots: list[str] = []
    for root in items:
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError(f"workspace root must be a path, got {root!r}")
        text = os.fspath(root)
        if not isinstance(text, str) or not text or "\x00" in text:
            raise ConfigError(f"workspace root must be a non-empty path, got {root!r}")
        roots.append(os.path.abspath(text))
    if not roots:
        raise ConfigError("PathPolicy needs at least one workspace root")
    return tuple(roots)


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([root, path]) == root


_SEPARATORS = re.compile(r"[\\/]")


@attrs.frozen
class PathPolicy:
    """Keep tools with affected paths inside the workspace roots.

    Each affected path is taken relative to the first root (absolute paths stay
    as they are) and denied when it has a ``..`` component (even one that would
    stay inside), when it resolves outside every root, or when a symlink in it
    leads out (resolved with `os.path.realpath`, which follows every existing
    component, dangling links included, and keeps the missing rest as written).
    Roots are made absolute at construction and resolved the same way.

    The check runs when the permission is decided; the sandbox, not this
    policy, must stop a symlink swapped in between the check and the tool's use.
    """

    workspace_roots: tuple[str, ...] = attrs.field(converter=_roots)
    _resolved: tuple[str, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_resolved", tuple(os.path.realpath(root) for root in self.workspace_roots))

    def violation(self, path: str) -> str | None:
        """Why *path* is denied, or ``None`` when it is inside the workspace."""
        if not isinstance(path, str) or not path:
            return f"affected path {path!r} is empty or not a string"
        if "\x00" in path:
            return f"affected path {path!r} contains a NUL byte"
        if ".." in _SEPARATORS.split(path):
            return f"affected path {path!r} contains a '..' component"
        joined = os.path.join(self.workspace_roots[0], path)
        try:
            real = os.path.realpath(joined)
        except (UnicodeError, ValueError):
            # e.g. a lone surrogate the file system encoding cannot take: fail closed, with a reason.
            return f"affected path {path!r} is not a valid file name"
        if any(_inside(real, root) for root in self._resolved):
            return None
        lexical = os.path.normpath(joined)
        if any(_inside(lexical, root) for root in (*self.workspace_roots, *self._resolved)):
            return f"affected path {path!r} escapes the workspace through a symlink (it resolves to {real!r})"
        roots = ", ".join(self.workspace_roots)
        return f"affected path {path!r} is outside the workspace roots ({roots})"

    def check(self, paths: Iterable[str]) -> str | None:
        """The first violation among *paths*, or ``None``."""
        for path in paths:
            problem = self.violation(path)
            if problem is not None:
                return problem
        return None


# ---------------------------------------------------------------- the engine


@attrs.frozen(eq=False)
class _Subject:
    """One input under evaluation, with what the table needs from it."""

    input: JsonObject
    behavior: ToolBehavior
    signature: str
    paths: tuple[str, ...]
    tool_ask: PermissionAsk | None = None


@attrs.frozen(eq=False)
class _Answer:
    source: DecisionSource
    result: PermissionAllow | PermissionDeny | None = None
    message: str | None = None


def _callable_name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def _checked_updates(updates: Iterable[PermissionUpdate]) -> tuple[PermissionUpdate, ...]:
    if isinstance(updates, PermissionUpdate):
        return (updates,)
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


class PermissionEngine:
    """Decides whether tool calls may run (see the module docstring for the table).

    Args:
        rules: the configured allow / ask / deny rules (default: none).
        mode: the permission mode (changeable later through `mode`).
        handler: answers asks (``async (PermissionRequest) -> result``); asked after the hooks.
        hooks: PermissionRequest hooks, asked in order before the handler.
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
        ask_timeout: seconds an ask (hooks and handler together) may take (default 600).
        record_grace: bound on the shielded ``resolved`` write after a cancellation (default 10 s).
        on_updates_applied: told about every rule update an answer or `accept_updates`
            applies (see `UpdatesApplied`); also settable later as ``engine.on_updates_applied``.
    """

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
            rules = PermissionRules()
        if not isinstance(rules, PermissionRules):
            raise ConfigError(f"rules must be PermissionRules, got {rules!r}")
        self._rules = rules
        self._mode = _mode(mode)
        if handler is not None and not callable(handler):
            raise ConfigError(f"permission handler must be an async callable, got {handler!r}")
        self._handler = handler
        if hooks is None:
            hook_list: tuple[PermissionHook, ...] = ()
        elif callable(hooks):
            hook_list = (hooks,)
        else:
            hook_list = tuple(hooks)
        for index, hook in enumerate(hook_list):
            if not callable(hook):
                raise ConfigError(f"PermissionRequest hook #{index} is not callable: {hook!r}")
        self._hooks = hook_list
        if path_policy is not None and not isinstance(path_policy, PathPolicy):
            raise ConfigError(f"path_policy must be a PathPolicy, got {path_policy!r}")
        self._path_policy = path_policy
        if record is not None and not callable(record):
            raise ConfigError(f"record must be an async callable, got {record!r}")
        self._record = record
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
        # The session layer, changed by answers (rule updates, remember) and `accept_updates`.
        self._approved: set[str] = set()
        self._session_allow: list[Rule] = []
        self._session_deny: list[Rule] = []

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
        self._mode = _mode(value)

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

        Every item is checked first (`ConfigError`, nothing applied). Then
        `on_updates_applied` is called (and awaited if async) *before* the
        updates take effect, so a journal can make them durable first: if it
        raises, nothing is applied and the error propagates. Returns the updates
        applied (none: no callback).
        """
        checked = _checked_updates(updates)
        if not checked:
            return ()
        callback = self.on_updates_applied
        if callback is not None:
            outcome = callback(checked, source=source, call_id=call_id)
            if inspect.isawaitable(outcome):
                await outcome
        self._apply(checked)
        return checked

    def replay_updates(self, updates: Iterable[PermissionUpdate]) -> None:
        """Apply stored rule updates again (a reopened session), without calling `on_updates_applied`."""
        self._apply(_checked_updates(updates))

    def apply_updates(self, updates: Iterable[PermissionUpdate]) -> None:
        """Apply rule updates to the session layer, without calling `on_updates_applied`.

        For updates that must be reported (journalled), use `accept_updates`.
        """
        self._apply(_checked_updates(updates))

    def _apply(self, updates: tuple[PermissionUpdate, ...]) -> None:
        """Adding a rule with one behaviour takes it out of the other session list (so the session layer
        never conflicts with itself); removing works on the session layer only."""
        for update in updates:
            target = self._session_allow if update.behavior is RuleBehavior.ALLOW else self._session_deny
            other = self._session_deny if update.behavior is RuleBehavior.ALLOW else self._session_allow
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

        Only the sure cases: no handler; no allow rule that could match the tool;
        no wholesale deny rule (that refusal is deliberate); and either the mode asks
        for the tool's kind (no behaviour resolver that could narrow it, not ``plan``,
        whose refusal is deliberate) or an ask rule covers every call (not in bypass).
        """
        if self._handler is not None:
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
        self._approved.add(signature)

    def forget_session(self) -> None:
        """Drop every session approval and session rule."""
        self._approved.clear()
        self._session_allow.clear()
        self._session_deny.clear()

    def signature(self, tool: Tool[Any], input: JsonObject) -> str:
        """``Name`` or ``Name:content`` for a call of *tool* with *input* (raises what the callable raises)."""
        content = self._content(tool, input)
        return tool.name if not content else f"{tool.name}:{content}"

    def as_stage(self) -> Stage:
        """This engine as a ``permission`` stage for `ToolStages`."""

        async def permission_stage(request: StageRequest) -> Allow | Deny | None:
            decision = await self.decide(request.tool, request.input, request.context)
            return decision.to_stage_decision(request.input)

        permission_stage.__qualname__ = "PermissionEngine.permission_stage"
        return permission_stage

    # -- the table -------------------------------------------------------------

    async def decide(self, tool: Tool[Any], input: JsonObject, context: ExecutionContext) -> Decision:
        """Walk the decision table for one call of *tool* with *input*.

        Raises only what the recorder raises, `LeaseLostError`, or
        ``trio.Cancelled``; everything a tool, hook or handler does wrong
        becomes a deny.
        """
        screened = await self._screen(tool, input, context)
        if isinstance(screened, Decision):
            return screened
        subject = screened
        signature = subject.signature

        # 6. A tool-level ask is answered only by asking: no approval, rule or mode skips it.
        if subject.tool_ask is not None:
            return await self._ask(tool, subject, context, AskReason.TOOL, subject.tool_ask.message, None)
        # 7. Session approvals: remembered signatures and session allow rules.
        if signature in self._approved:
            return self._allow(subject, DecisionSource.SESSION, "approved for this session")
        for rule in self._session_allow:
            if rule.matches(signature):
                return self._allow(subject, DecisionSource.SESSION, f"session rule {rule.text!r}", rule)
        # 8. Allow rules: the hooks and the handler are not asked.
        rule_ = self._rules.first(RuleBehavior.ALLOW, signature)
        if rule_ is not None:
            return self._allow(subject, DecisionSource.RULE, f"allowed by rule {rule_.text!r}", rule_)
        mode = self._mode
        # 9. Ask rules beat the mode's allow, except in bypass (bypass means "do not ask me").
        if mode is not PermissionMode.BYPASS:
            rule_ = self._rules.first(RuleBehavior.ASK, signature)
            if rule_ is not None:
                return await self._ask(tool, subject, context, AskReason.RULE, None, rule_)
        # 10. The mode table.
        if MODE_TABLE[mode][subject.behavior.kind] is RuleBehavior.ALLOW:
            kind = subject.behavior.kind.value
            return self._allow(subject, DecisionSource.MODE, f"{mode.value} mode allows {kind} tools")
        # 11. The default: ask.
        return await self._ask(tool, subject, context, AskReason.MODE, None, None)

    async def _screen(self, tool: Tool[Any], input: JsonObject, context: ExecutionContext) -> _Subject | Decision:
        """Stages 0-5, the ones that can only deny (or make the call ask); run again after an allow answer."""
        # 0. The tool filter of the calling agent.
        tool_filter = self._filter_for(context.agent_id)
        if tool_filter is not None and not tool_filter.allows(tool.name):
            return self._deny(
                input, tool.name, DecisionSource.FILTER,
                f"tool {tool.name!r} is not available to agent {context.agent_id!r}",
            )  # fmt: skip
        # 1-2. Validation, behaviour, signature, paths; the path policy.
        subject = self._subject(tool, input)
        if isinstance(subject, Decision):
            return subject
        # 3. The tool's own check.
        check = self._check_for(tool)
        if check is not None:
            try:
                outcome = check(json_copy(subject.input))
                if inspect.isawaitable(outcome):
                    outcome = await outcome
            except LeaseLostError:
                raise
            except Exception as exc:
                return self._deny(
                    subject.input, subject.signature, DecisionSource.TOOL,
                    f"permission check of tool {tool.name!r} failed: {exc!r}",
                )  # fmt: skip
            if isinstance(outcome, PermissionDeny):
                # Final: a tool's deny is never put to the hooks or the handler.
                return self._deny(
                    subject.input, subject.signature, DecisionSource.TOOL, outcome.message, stop_loop=outcome.stop_loop
                )
            if isinstance(outcome, PermissionAsk):
                subject = attrs.evolve(subject, tool_ask=outcome)
            elif isinstance(outcome, PermissionAllow):
                # "No objection", optionally with normalised input; not a final allow.
                if outcome.updated_input is not None:
                    subject = self._subject(tool, outcome.updated_input)
                    if isinstance(subject, Decision):
                        return subject
            elif outcome is not None:
                return self._deny(
                    subject.input, subject.signature, DecisionSource.TOOL,
                    f"permission check of tool {tool.name!r} returned {outcome!r}, "
                    "expected PermissionAllow, PermissionDeny, PermissionAsk or None",
                )  # fmt: skip
        signature = subject.signature
        # 4. Deny rules, configured then session; they hold in every mode, bypass included.
        rule = self._rules.first(RuleBehavior.DENY, signature)
        if rule is None:
            rule = next((r for r in self._session_deny if r.matches(signature)), None)
        if rule is not None:
            return self._deny(
                subject.input, signature, DecisionSource.RULE, f"{signature} is denied by rule {rule.text!r}", rule=rule
            )
        # 5. The mode's hard limit: plan denies anything not read-only, whatever allows it later.
        mode = self._mode
        kind = subject.behavior.kind
        if MODE_TABLE[mode][kind] is RuleBehavior.DENY:
            return self._deny(
                subject.input, signature, DecisionSource.MODE,
                f"{mode.value} mode denies {kind.value} tools: {tool.name!r} is not read-only",
            )  # fmt: skip
        return subject

    def _subject(self, tool: Tool[Any], input: JsonObject) -> _Subject | Decision:
        # Validation first: nobody is asked about a call that would fail its schema, and the tool's
        # resolver, signature and affected-paths callables only ever see valid input.
        errors = tool.input_errors(input)
        if errors:
            return self._deny(
                input, tool.name, DecisionSource.VALIDATION,
                f"invalid input for tool {tool.name!r}: " + "; ".join(errors),
            )  # fmt: skip
        try:
            behavior = tool.resolve_behavior(input)
        except ToolBehaviorError as exc:
            return self._deny(input, tool.name, DecisionSource.TOOL, str(exc))
        try:
            signature = self.signature(tool, input)
        except LeaseLostError:
            raise
        except Exception as exc:
            return self._deny(
                input, tool.name, DecisionSource.TOOL, f"signature content of tool {tool.name!r} failed: {exc!r}"
            )
        try:
            paths = tool.paths_for(input)
        except LeaseLostError:
            raise
        except Exception as exc:
            return self._deny(
                input, signature, DecisionSource.PATH_POLICY, f"affected paths of tool {tool.name!r} failed: {exc!r}"
            )
        policy = self._path_policy
        if policy is not None:
            problem = policy.check(paths)
            if problem is not None:
                return self._deny(input, signature, DecisionSource.PATH_POLICY, problem)
        return _Subject(input, behavior, signature, paths)

    def _content(self, tool: Tool[Any], input: JsonObject) -> str | None:
        fn: Callable[[JsonObject], object] | None = self._content_map.get(tool.name)
        if fn is not None:
            value: object = fn(json_copy(input))
        elif self._content_fn is not None:
            value = self._content_fn(tool.name, json_copy(input))
        else:
            # The tool's own: define_tool(signature_content=), else its conventional field.
            return tool.signature_content_for(json_copy(input))
        if value is None:
            return None
        if not isinstance(value, str):
            raise TypeError(f"signature content must be a string or None, got {value!r}")
        return value or None

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

    @staticmethod
    def _allow(subject: _Subject, source: DecisionSource, message: str, rule: Rule | None = None) -> Decision:
        return Decision(
            True, source, subject.input, subject.signature, message, rule=None if rule is None else rule.text
        )

    @staticmethod
    def _deny(
        input: JsonObject,
        signature: str,
        source: DecisionSource,
        message: str,
        *,
        stop_loop: bool = False,
        rule: Rule | None = None,
    ) -> Decision:
        return Decision(False, source, input, signature, message, stop_loop, None if rule is None else rule.text)

    # -- the ask ---------------------------------------------------------------

    async def _ask(
        self,
        tool: Tool[Any],
        subject: _Subject,
        context: ExecutionContext,
        reason: AskReason,
        message: str | None,
        rule: Rule | None,
    ) -> Decision:
        """Stage 12-13: the hooks, then the handler; record requested / resolved around it."""
        answerers: list[tuple[DecisionSource, PermissionHandler]] = [(DecisionSource.HOOK, h) for h in self._hooks]
        if self._handler is not None:
            answerers.append((DecisionSource.HANDLER, self._handler))
        signature = subject.signature
        if not answerers:
            return self._deny(
                subject.input, signature, DecisionSource.NO_HANDLER,
                _no_handler_message(tool.name, signature, subject.behavior.kind, self._mode, reason, message, rule),
            )  # fmt: skip
        abort = context.abort
        if abort.reason is not None:
            return self._deny(
                subject.input, signature, DecisionSource.ABORT, f"permission not asked: {abort.reason.message}"
            )
        permission_id = f"{context.tool_call_id}:permission"
        request = PermissionRequest(
            tool_name=tool.name,
            input=json_copy(subject.input),
            signature=signature,
            mode=self._mode,
            tool_kind=subject.behavior.kind,
            side_effect=subject.behavior.side_effect,
            affected_paths=subject.paths,
            reason=reason,
            message=message,
            rule=None if rule is None else rule.text,
            agent_id=context.agent_id,
            session_id=context.session_id,
            request_id=context.request_id,
            turn_id=context.turn_id,
            tool_call_id=context.tool_call_id,
            permission_id=permission_id,
            deadline=trio.current_time() + self.ask_timeout,
            abort=abort,
        )
        if self._record is not None:
            await self._record("requested", PermissionRecord(permission_id, request))
        answer = _Answer(DecisionSource.NO_ANSWER)
        try:
            answer = await self._consult(answerers, request, abort)
            decision = await self._conclude(tool, subject, context, answer, permission_id)
        except trio.Cancelled:
            # Cancelled from outside while asking: resolve the request as cancelled, then go on cancelling.
            cancelled = Decision(
                False, DecisionSource.ABORT, subject.input, signature, "permission request cancelled",
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
            await self.accept_updates(
                answer.result.rule_updates, source=answer.source.value, call_id=context.tool_call_id
            )
            if answer.result.remember:
                self._approved.add(decision.signature)
        return decision

    async def _consult(
        self,
        answerers: Sequence[tuple[DecisionSource, PermissionHandler]],
        request: PermissionRequest,
        abort: AbortHandle,
    ) -> _Answer:
        """The first allow or deny of the answerers, bounded by the deadline and the call's abort."""
        answer = _Answer(DecisionSource.NO_ANSWER)
        with trio.CancelScope() as abort_scope:
            token = abort.add_listener(lambda _abort: abort_scope.cancel())
            try:
                with trio.CancelScope(deadline=request.deadline) as deadline_scope:
                    answer = await self._first_answer(answerers, request)
            finally:
                abort.remove_listener(token)
        if abort.reason is not None:
            return _Answer(DecisionSource.ABORT, message=f"permission request cancelled: {abort.reason.message}")
        if deadline_scope.cancel_called:
            # Even an answer that came in after the deadline (a handler that ignored the cancellation) is refused.
            return _Answer(
                DecisionSource.TIMEOUT,
                message=f"permission request for {request.signature} got no answer within {self.ask_timeout:g} s",
            )
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
                return _Answer(DecisionSource.ERROR, message=f"{who} failed: {exc!r}")
            if isinstance(result, (PermissionAllow, PermissionDeny)):
                return _Answer(source, result)
            if result is not None and not isinstance(result, PermissionAsk):
                return _Answer(
                    DecisionSource.ERROR,
                    message=f"{who} returned {result!r}, expected PermissionAllow, PermissionDeny, "
                    "PermissionAsk or None",
                )
        if self._handler is None:
            # Only hooks were asked, and they cannot grant: the same refusal as having nobody to ask.
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
        self, tool: Tool[Any], subject: _Subject, context: ExecutionContext, answer: _Answer, permission_id: str
    ) -> Decision:
        result = answer.result
        if isinstance(result, PermissionAllow):
            new_input = subject.input if result.updated_input is None else result.updated_input
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
                False, answer.source, subject.input, subject.signature, result.message, result.stop_loop,
                asked=True, permission_id=permission_id,
            )  # fmt: skip
        message = answer.message or "permission denied"
        if answer.source is DecisionSource.NO_ANSWER:
            message = f"{message}; denied"
        return Decision(
            False, answer.source, subject.input, subject.signature, message, asked=True, permission_id=permission_id
        )

    async def _record_shielded(self, record: PermissionRecord, *, swallow: bool) -> None:
        if self._record is None:
            return
        with trio.CancelScope(shield=True, deadline=trio.current_time() + self.record_grace):
            try:
                await self._record("resolved", record)
            except Exception:
                if not swallow:
                    raise
