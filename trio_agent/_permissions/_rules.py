"""The permission vocabulary: modes, rules, rule updates, answers, tool filters and the path policy.

Values only (no engine, no table): `PermissionMode` and `MODE_TABLE`, the `Rule` syntax and
the `PermissionRules` lists, a `PermissionUpdate` to the session's rules (and its JSON form for
the journal), the answers a tool's check, a hook or the handler gives (`PermissionAllow`,
`PermissionDeny`, `PermissionAsk`), the `ToolFilter` of an agent and the `PathPolicy` of a
workspace. The decision table that reads them is `trio_agent._permissions._table`.
"""

from __future__ import annotations

import enum
import os
import re
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal, TypeAlias

import attrs

from .._errors import ConfigError
from .._tools._definition import _PATH_FIELDS, Tool, ToolKind, normal_path
from .._tools._results import JsonObject
from .._util import safe_repr

__all__ = [
    "MODE_TABLE",
    "PathPolicy",
    "PermissionAllow",
    "PermissionAsk",
    "PermissionDeny",
    "PermissionMode",
    "PermissionResult",
    "PermissionRules",
    "PermissionUpdate",
    "Rule",
    "RuleBehavior",
    "RuleMatch",
    "ToolFilter",
    "ToolPermissionCheck",
    "as_mode",
    "never_matches",
    "update_from_json",
    "update_to_json",
]


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


def as_mode(value: PermissionMode | str) -> PermissionMode:
    """The `PermissionMode` that *value* is or names; `ConfigError` saying the choices if none."""
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
# What lets a shell run a second command, or write or read elsewhere, after the first one's words:
# separators and pipes, command and process substitution, redirection, line breaks.
_CHAINING = re.compile(r"[;&|`<>\n\r]|\$\(")


def chains(command: str, start: int = 0) -> bool:
    """Whether shell text *command* may run more than one command (or redirect) past index
    *start*, as far as a prefix rule can tell without a shell parser: a separator, pipe,
    substitution, redirection or line break ends after *start*. A token that begins before
    *start* and ends after it counts (``echo $`` + ``(rm -rf ~)`` is a substitution though
    neither side holds ``$(``). Quoting is not read, so a quoted ``;`` counts too (fail closed)."""
    # Every match, not one search from *start*: a token straddling the boundary begins before it.
    return any(match.end() > start for match in _CHAINING.finditer(command))


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

    def grants(self, signature: str, *, shell: bool) -> bool:
        """Whether this rule, as an allow rule, lets *signature* run: as `matches`, except that for
        a shell command (*shell*) a prefix rule never grants what goes on past its prefix into
        another command (`chains`): ``Bash:git status*`` was written for ``git status``, not for
        ``git status; rm -rf ~``, which asks instead."""
        if not self.matches(signature):
            return False
        if not (shell and self.content_prefix and self.content is not None):
            return True
        # The whole content, not the text after the prefix: `Bash:echo $*` must not grant `echo $(...)`.
        return not chains(signature.partition(":")[2], len(self.content))

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


def _unreachable(rule: Rule, tool: Tool[Any]) -> str | None:
    """Why the content rule *rule* cannot match a call of *tool* as written, or ``None``.

    Judged only where the library makes the content: the tool's conventional field (no
    ``signature_content``, `Tool.signature_content_for` not overridden), whose value is stripped
    and, for a path field, normalised (`normal_path`). The call's content is always in that form,
    so an exact rule's content must be too (``Read:./.env`` never matches ``./.env``, whose
    content is ``.env``). A prefix rule's literal part is judged with a segment appended: its
    last segment may be cut short (``Read:src/.*`` means ``src/.env`` and the like, though
    ``src/.`` alone is ``src``), but whatever comes before it must be normal (``Read:./src/*``
    and ``Read:a//*`` match no path in normal form)."""
    field = tool.signature_field
    if (
        rule.content is None
        or field is None
        or tool.signature_content is not None
        or type(tool).signature_content_for is not Tool.signature_content_for
    ):
        return None
    path = field in _PATH_FIELDS

    def form(text: str) -> str:
        stripped = text.strip()
        return normal_path(stripped) if path and stripped else stripped

    if rule.content_prefix:
        probe = rule.content + "x"  # a segment name: never '.' or '..', never stripped
        literal, normal = rule.content, form(probe)[:-1]
        if normal + "x" == probe:
            return None
        suggestion = f"{tool.name}:{normal}*" if normal else tool.name
    else:
        literal, normal = rule.content, form(rule.content)
        if normal == literal:
            return None
        suggestion = f"{tool.name}:{normal}" if normal else tool.name
    made = "stripped of surrounding whitespace"
    if path:
        made += " and normalised ('.' and '..' segments and repeated separators resolved)"
    what = "prefix" if rule.content_prefix else "content"
    became = f"is {normal!r}" if normal else "is empty"
    return (
        f"can never match as written: the signature content of a {tool.name!r} call is its {field!r} "
        f"field {made}, and the rule's {what} {literal!r} is not in that form (in that form it {became}); "
        f"write {suggestion!r}{'' if normal else ' to cover every call'}"
    )


def never_matches(rule: Rule, tool: Tool[Any]) -> str | None:
    """Why *rule* can never match a call of *tool* as written, or ``None``: the rest of a sentence
    that begins with the rule (``... rule 'Read:./.env' can never match as written: ...; write
    'Read:.env'``). Only a ``Name:content`` rule naming *tool* can fail: the tool's calls have no
    signature content, or its content is the tool's conventional field and the rule's content is
    not in the form that field's content takes (`_unreachable`).

    The one judgement of a rule against a tool: `PermissionRules.check_tools` (configured rules,
    before a session or ``chat()`` starts) and the engine (the rules of a live `PermissionUpdate`,
    before it is reported or applied) both apply it."""
    if rule.tool_prefix or rule.content is None or rule.tool != tool.name:
        return None
    if not tool.has_signature_content:
        return (
            f"can never match: calls of tool {tool.name!r} have no signature content (give "
            "define_tool(signature_content=...), or declare a 'command', 'file_path', 'path' or 'url' "
            f"string property); write {tool.name!r} to cover every call"
        )
    return _unreachable(rule, tool)


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

    def granting(self, signature: str, *, shell: bool) -> Rule | None:
        """The first allow rule that grants *signature* (`Rule.grants`)."""
        for rule in self._parsed[RuleBehavior.ALLOW]:
            if rule.grants(signature, shell=shell):
                return rule
        return None

    def check_tools(self, tools: Iterable[Tool[Any]]) -> None:
        """`ConfigError` for a ``Name:content`` rule naming one of *tools* that could never match
        as written (a deny rule that never denies anything): the tool's calls have no signature
        content, or the content comes from its conventional field (stripped, and a path
        normalised: `normal_path`) and the rule's content is not in that form (`never_matches`,
        which the engine also applies to the rules of a live update)."""
        by_name = {tool.name: tool for tool in tools}
        for behavior in (RuleBehavior.DENY, RuleBehavior.ALLOW, RuleBehavior.ASK):
            for rule in self._parsed[behavior]:
                tool = by_name.get(rule.tool)
                problem = None if tool is None else never_matches(rule, tool)
                if problem is not None:
                    raise ConfigError(f"permissions.{behavior.value} rule {rule.text!r} {problem}")

    def match(self, signature: str, *, shell: bool = True) -> RuleMatch | None:
        """The deciding rule for *signature*, as the engine's rule stages decide: the first deny
        rule that matches, else the first allow rule that grants it (`granting`: for a shell
        command a prefix allow rule does not grant a command chained after its prefix), else the
        first ask rule that matches; ``None`` when none does. *shell* says the content is a shell
        command (the engine's test: the tool's signature field is ``command``); it defaults to
        ``True``, the reading that never reports an allow the engine would not give."""
        rule = self.first(RuleBehavior.DENY, signature)
        if rule is not None:
            return RuleMatch(RuleBehavior.DENY, rule)
        rule = self.granting(signature, shell=shell)
        if rule is not None:
            return RuleMatch(RuleBehavior.ALLOW, rule)
        rule = self.first(RuleBehavior.ASK, signature)
        return None if rule is None else RuleMatch(RuleBehavior.ASK, rule)


# ---------------------------------------------------------------- answers


def _update_rules(value: Iterable[str | Rule]) -> tuple[Rule, ...]:
    if isinstance(value, (str, bytes)):
        raise ConfigError(f"PermissionUpdate.rules must be a list of rules, got the single string {value!r}")
    if not isinstance(value, Iterable):
        raise ConfigError(f"PermissionUpdate.rules must be a list of rules, got {value!r}")
    return tuple(Rule.parse(text) for text in value)


def _update_behavior(value: RuleBehavior | str) -> RuleBehavior:
    behavior = _behavior(value)
    if behavior is RuleBehavior.ASK:
        raise ConfigError("a PermissionUpdate adds or removes allow or deny rules, not ask rules")
    return behavior


def _update_mode(value: PermissionMode | str | None) -> PermissionMode | None:
    return None if value is None else as_mode(value)


def _check_action(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("add", "remove", "set_mode"):
        raise ConfigError(f"PermissionUpdate.action must be 'add', 'remove' or 'set_mode', got {value!r}")


@attrs.frozen
class PermissionUpdate:
    """A change to the session's permissions, carried by a `PermissionAllow` (or given to
    `PermissionEngine.accept_updates`).

    ``add`` allow rules become session approvals, ``add`` deny rules session
    deny rules; ``remove`` takes rules out of the session layer again. The
    configured `PermissionRules` are never changed (a session allow cannot lift
    a configured deny: deny wins). ``set_mode`` switches the permission mode
    (``mode``; no rules): a session journals it like a rule change, so a
    reopened session keeps it.
    """

    action: Literal["add", "remove", "set_mode"] = attrs.field(validator=_check_action)
    rules: tuple[Rule, ...] = attrs.field(default=(), converter=_update_rules)
    behavior: RuleBehavior = attrs.field(default=RuleBehavior.ALLOW, converter=_update_behavior)
    mode: PermissionMode | None = attrs.field(default=None, converter=_update_mode)

    def __attrs_post_init__(self) -> None:
        if self.action == "set_mode":
            if self.mode is None:
                raise ConfigError("a set_mode PermissionUpdate needs the mode to set")
            if self.rules:
                raise ConfigError("a set_mode PermissionUpdate sets the mode only: give its rules in an add or remove")
        else:
            if not self.rules:
                raise ConfigError("PermissionUpdate.rules is empty")
            if self.mode is not None:
                raise ConfigError(f"an {self.action!r} PermissionUpdate changes rules, not the mode: use set_mode")

    @classmethod
    def add(cls, *rules: str | Rule, behavior: RuleBehavior | str = RuleBehavior.ALLOW) -> PermissionUpdate:
        return cls("add", rules, behavior)

    @classmethod
    def remove(cls, *rules: str | Rule, behavior: RuleBehavior | str = RuleBehavior.ALLOW) -> PermissionUpdate:
        return cls("remove", rules, behavior)

    @classmethod
    def set_mode(cls, mode: PermissionMode | str) -> PermissionUpdate:
        return cls("set_mode", mode=mode)


def update_to_json(update: PermissionUpdate) -> JsonObject:
    """``{"action": "add"|"remove", "behavior": "allow"|"deny", "rules": [rule text, ...]}``, or
    ``{"action": "set_mode", "mode": "plan"}`` (for the journal)."""
    if not isinstance(update, PermissionUpdate):
        raise ConfigError(f"expected a PermissionUpdate, got {update!r}")
    if update.mode is not None:
        return {"action": update.action, "mode": update.mode.value}
    return {"action": update.action, "behavior": update.behavior.value, "rules": [rule.text for rule in update.rules]}


def update_from_json(value: object) -> PermissionUpdate:
    """The `PermissionUpdate` that `update_to_json` made *value* from; `ConfigError` if *value* is not one."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"a stored permission update must be a JSON object, got {value!r}")
    keys = set(value)
    if value.get("action") == "set_mode":
        if keys != {"action", "mode"}:
            raise ConfigError(
                f"a stored set_mode permission update has the keys 'action' and 'mode', got {sorted(map(str, keys))}"
            )
        mode = value["mode"]
        if not isinstance(mode, str):
            raise ConfigError(f"a stored permission update's mode must be a string, got {mode!r}")
        return PermissionUpdate("set_mode", mode=mode)
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
    # Its content is judged where the answer is concluded (the engine denies input that is not
    # JSON): an answer may carry edits still to be judged, e.g. a person's edited arguments.
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"updated_input must be a JSON object (dict) or None, got {type(value).__name__}")


def _updates(value: Iterable[PermissionUpdate]) -> tuple[PermissionUpdate, ...]:
    if not isinstance(value, Iterable):
        raise ConfigError(f"rule_updates must be a list of PermissionUpdate objects, got {value!r}")
    updates = tuple(value)
    for update in updates:
        if not isinstance(update, PermissionUpdate):
            raise ConfigError(f"rule_updates must hold PermissionUpdate objects, got {update!r}")
    return updates


def _flag(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # Exactly a bool: remember="no" or stop_loop="yes" would count as true.
    if type(value) is not bool:
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be True or False, got {value!r}")


def _non_empty_message(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"a permission denial needs a message for the model, got {value!r}")


@attrs.frozen
class PermissionAllow:
    """Let the call run.

    ``updated_input`` replaces the input (the signature and path policy are
    recomputed from it); ``rule_updates`` change the session's rules;
    ``remember`` approves this exact signature for the rest of the session (for a tool
    whose calls have no signature content that is ``Name``: every later call of the tool).
    A tool's own check may return this to normalise input; its rule updates
    and ``remember`` are ignored there.
    """

    updated_input: JsonObject | None = attrs.field(default=None, validator=_optional_json_object)
    rule_updates: tuple[PermissionUpdate, ...] = attrs.field(default=(), converter=_updates)
    remember: bool = attrs.field(default=False, validator=_flag)


@attrs.frozen
class PermissionDeny:
    """Refuse the call; ``message`` is what the model sees. ``stop_loop`` also ends the agent loop."""

    message: str = attrs.field(validator=_non_empty_message)
    stop_loop: bool = attrs.field(default=False, validator=_flag)


def _optional_message(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # Checked here, not where the ask is journalled: there a number the model put in the input
    # failed the event's own validator, as a TypeError naming nothing the user wrote.
    if value is not None and not isinstance(value, str):
        kind = type(value).__name__
        raise ConfigError(f"PermissionAsk.message must be a string or None, got {kind} {safe_repr(value)}")


@attrs.frozen
class PermissionAsk:
    """No decision here: ask (a tool's check) or pass to the next answerer (a hook or the handler).

    ``message`` (a string or ``None``) says why; anything else is a `ConfigError`."""

    message: str | None = attrs.field(default=None, validator=_optional_message)


PermissionResult: TypeAlias = PermissionAllow | PermissionDeny | PermissionAsk


ToolPermissionCheck: TypeAlias = Callable[[JsonObject], PermissionResult | Awaitable[PermissionResult | None] | None]
"""A tool's own ``check_permissions(input)`` (sync or async); ``None`` means no objection."""


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
    items: Iterable[object]
    if isinstance(value, (str, bytes, os.PathLike)):
        items = [value]
    elif isinstance(value, Iterable) and not isinstance(value, Mapping):
        items = value
    else:
        raise ConfigError(f"workspace roots must be a path or a list of paths, got {value!r:.200}")
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


def rules_from(permissions: object) -> PermissionRules | None:
    """``permissions=`` as given to a session or ``chat()``: `PermissionRules`, a mapping of the
    ``allow`` / ``ask`` / ``deny`` lists, or ``None``."""
    if permissions is None or isinstance(permissions, PermissionRules):
        return permissions
    if isinstance(permissions, Mapping):
        unknown = set(permissions) - {"allow", "ask", "deny"}
        if unknown:
            raise ConfigError(f"permissions takes 'allow', 'ask' and 'deny' lists, not {sorted(unknown)}")
        lists = {key: permissions.get(key, ()) for key in ("allow", "ask", "deny")}
        for key, value in lists.items():
            if isinstance(value, (str, bytes)):  # tuple() of it would make one rule of each letter
                raise ConfigError(f"permissions[{key!r}] must be a list of rule strings, not the string {value!r}")
        return PermissionRules(**lists)
    raise ConfigError(f"permissions must be a PermissionRules or a mapping of rule lists, not {permissions!r}")
