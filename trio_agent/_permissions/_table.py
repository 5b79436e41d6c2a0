"""The decision table: may this tool call run, and with which input?

Walked top to bottom for each call; the first stage that decides ends the walk.
``docs/permissions.md`` holds the same table for people; the tests pin every row.

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
                                  with updated input (input replaced, 1-2 run again). An
                                  async check is bounded by ``ask_timeout`` and the call's
                                  abort (the engine's, around this table): either denies
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

This module holds stages 0-11 as pure functions: no awaits, no recording, no state changed
(the path policy's symlink resolution reads the file system; nothing else is touched besides
the arguments). The tool's own check (stage 3) is user code that may be async, so the caller
runs it between two calls::

    subject(tool, input, policy, ...)          0-2    Subject | Decision (a deny)
    (the caller runs the tool's check, if any)
    after_check(tool, subject, outcome, ...)   3      Subject | Decision (a deny)
    screen_rest(tool, subject, policy)         4-5    Subject | Decision (a deny)
    evaluate_after_screen(tool, subject, ...)  6-11   Decision | AskNeeded

Stages 0-5 can only deny (or mark the call for a tool-level ask); they run again on the input
an allow answer gives. Where the table says "ask" it returns an `AskNeeded`: the session's
`PermissionEngine` (``trio_agent._permissions._engine``) asks its hooks and handler there
(12-13), or hands the `AskNeeded` to whoever will answer elsewhere (`PermissionEngine.evaluate`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence, Set
from typing import Any

import attrs

from .._errors import LeaseLostError, ToolBehaviorError
from .._journal._events import PermissionDecision
from .._json import json_problem
from .._tools._definition import SideEffect, Tool, ToolBehavior, ToolKind
from .._tools._results import JsonObject, ToolErrorType, describe, json_copy
from .._tools._stages import Allow, Deny
from .._util import safe_repr
from ._rules import (
    MODE_TABLE,
    PathPolicy,
    PermissionAllow,
    PermissionAsk,
    PermissionDeny,
    PermissionMode,
    PermissionRules,
    Rule,
    RuleBehavior,
    ToolFilter,
)

__all__ = [
    "AskNeeded",
    "AskReason",
    "Decision",
    "DecisionSource",
    "Policy",
    "Subject",
    "after_check",
    "check_failed",
    "deny",
    "evaluate_after_screen",
    "read",
    "screen_rest",
    "subject",
    "tool_signature",
]


class AskReason(enum.Enum):
    """Why the engine asks: the tool's own check, an ask rule, or the mode (the default ask)."""

    TOOL = "tool"
    RULE = "rule"
    MODE = "mode"


class DecisionSource(enum.Enum):
    """Which stage of the table decided (``interrupt``: an answer given elsewhere, `PermissionEngine.conclude`)."""

    FILTER = "filter"
    VALIDATION = "validation"
    PATH_POLICY = "path_policy"
    TOOL = "tool"
    RULE = "rule"
    SESSION = "session"
    MODE = "mode"
    HOOK = "hook"
    HANDLER = "handler"
    INTERRUPT = "interrupt"
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
    ``asked`` says a hook, the handler or (for an ``interrupt``) someone elsewhere
    was consulted; ``permission_id`` names the request the engine recorded, if it
    recorded one. ``rule`` is the text of the deciding rule, if a rule decided.
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


@attrs.frozen
class AskNeeded:
    """Where the table says "ask" (stages 6, 9, 11): what a person or a handler must answer.

    The fields are those of a `PermissionRequest` that the table knows (no ids,
    no mode, no deadline): the call's input as the table saw it (the call's own
    object unless the tool's check normalised it; copy it before handing it
    out), its signature, why it asks, the tool check's message (reason ``tool``),
    the ask rule's text (reason ``rule``), and the resolved kind, side effect
    and affected paths of that input. Answer it with
    `PermissionEngine.conclude`.
    """

    tool_name: str
    input: JsonObject
    signature: str
    reason: AskReason
    message: str | None
    rule: str | None
    tool_kind: ToolKind
    side_effect: SideEffect
    affected_paths: tuple[str, ...]


def tool_signature(tool: Tool[Any], input: JsonObject) -> str:
    """``Name`` or ``Name:content``, the content from the tool itself (`Tool.signature_content_for`)."""
    content = tool.signature_content_for(json_copy(input))
    return tool.name if not content else f"{tool.name}:{content}"


@attrs.frozen(eq=False)
class Policy:
    """Everything besides the call that the table reads, as it stands when the table is walked.

    ``approved`` (remembered signatures), ``session_allow`` and ``session_deny``
    are the session layer; an engine passes its own collections (the table reads
    them and keeps nothing). ``signature`` computes ``Name`` or ``Name:content``
    and may raise (the call is then denied).
    """

    rules: PermissionRules = attrs.field(factory=PermissionRules)
    mode: PermissionMode = PermissionMode.DEFAULT
    approved: Set[str] = frozenset()
    session_allow: Sequence[Rule] = ()
    session_deny: Sequence[Rule] = ()
    path_policy: PathPolicy | None = None
    signature: Callable[[Tool[Any], JsonObject], str] = tool_signature


@attrs.frozen(eq=False)
class Subject:
    """One input under evaluation, with what the table needs from it (stages 0-5 passed so far)."""

    input: JsonObject
    behavior: ToolBehavior
    signature: str
    paths: tuple[str, ...]
    tool_ask: PermissionAsk | None = None


def deny(
    input: JsonObject,
    signature: str,
    source: DecisionSource,
    message: str,
    *,
    stop_loop: bool = False,
    rule: Rule | None = None,
) -> Decision:
    """A deny `Decision`."""
    return Decision(False, source, input, signature, message, stop_loop, None if rule is None else rule.text)


def _allow(subject: Subject, source: DecisionSource, message: str, rule: Rule | None = None) -> Decision:
    return Decision(True, source, subject.input, subject.signature, message, rule=None if rule is None else rule.text)


def _ask(tool: Tool[Any], subject: Subject, reason: AskReason, message: str | None, rule: Rule | None) -> AskNeeded:
    return AskNeeded(
        tool_name=tool.name,
        input=subject.input,
        signature=subject.signature,
        reason=reason,
        message=message,
        rule=None if rule is None else rule.text,
        tool_kind=subject.behavior.kind,
        side_effect=subject.behavior.side_effect,
        affected_paths=subject.paths,
    )


# -- stages 0-5: the ones that can only deny (or make the call ask) -----------------------------------


def subject(
    tool: Tool[Any],
    input: JsonObject,
    policy: Policy,
    *,
    tool_filter: ToolFilter | None = None,
    agent_id: str = "root",
) -> Subject | Decision:
    """Stages 0-2: the calling agent's tool filter, then `read` (validation, behaviour, signature, paths)."""
    # 0. The tool filter of the calling agent.
    if tool_filter is not None and not tool_filter.allows(tool.name):
        return deny(
            input, tool.name, DecisionSource.FILTER, f"tool {tool.name!r} is not available to agent {agent_id!r}"
        )
    return read(tool, input, policy)


def read(tool: Tool[Any], input: JsonObject, policy: Policy) -> Subject | Decision:
    """Stages 1-2 on *input*: validation, behaviour, signature, affected paths; the path policy."""
    # Validation first: nobody is asked about a call that would fail its schema, and the tool's
    # resolver, signature and affected-paths callables only ever see valid input.
    errors = tool.input_errors(input)
    if errors:
        return deny(
            input, tool.name, DecisionSource.VALIDATION,
            f"invalid input for tool {tool.name!r}: " + "; ".join(errors),
        )  # fmt: skip
    try:
        behavior = tool.resolve_behavior(input)
    except ToolBehaviorError as exc:
        return deny(input, tool.name, DecisionSource.TOOL, str(exc))
    try:
        signature = policy.signature(tool, input)
    except LeaseLostError:
        raise
    except Exception as exc:
        return deny(
            input,
            tool.name,
            DecisionSource.TOOL,
            f"signature content of tool {tool.name!r} failed: {describe(exc, 'repr')}",
        )
    try:
        paths = tool.paths_for(input)
    except LeaseLostError:
        raise
    except Exception as exc:
        return deny(
            input,
            signature,
            DecisionSource.PATH_POLICY,
            f"affected paths of tool {tool.name!r} failed: {describe(exc, 'repr')}",
        )
    if policy.path_policy is not None:
        problem = policy.path_policy.check(paths)
        if problem is not None:
            return deny(input, signature, DecisionSource.PATH_POLICY, problem)
    return Subject(input, behavior, signature, paths)


def after_check(tool: Tool[Any], subject: Subject, outcome: object, policy: Policy) -> Subject | Decision:
    """Stage 3: what the tool's own check returned for *subject* (``None``: no objection)."""
    if isinstance(outcome, PermissionDeny):
        # Final: a tool's deny is never put to the hooks or the handler.
        return deny(subject.input, subject.signature, DecisionSource.TOOL, outcome.message, stop_loop=outcome.stop_loop)
    if isinstance(outcome, PermissionAsk):
        return attrs.evolve(subject, tool_ask=outcome)
    if isinstance(outcome, PermissionAllow):
        # "No objection", optionally with normalised input; not a final allow.
        if outcome.updated_input is None:
            return subject
        # A set, NaN or a non-string key would pass the schema and then fail the whole request.
        problem = json_problem(outcome.updated_input, "updated_input")
        if problem is not None:
            return deny(
                subject.input, subject.signature, DecisionSource.TOOL,
                f"permission check of tool {tool.name!r} returned input that is not JSON: {problem}",
            )  # fmt: skip
        return read(tool, outcome.updated_input, policy)
    if outcome is not None:
        return deny(
            subject.input, subject.signature, DecisionSource.TOOL,
            f"permission check of tool {tool.name!r} returned {safe_repr(outcome)}, "
            "expected PermissionAllow, PermissionDeny, PermissionAsk or None",
        )  # fmt: skip
    return subject


def check_failed(tool: Tool[Any], subject: Subject, error: BaseException) -> Decision:
    """Stage 3: the tool's own check raised *error*."""
    return deny(
        subject.input, subject.signature, DecisionSource.TOOL,
        f"permission check of tool {tool.name!r} failed: {describe(error, 'repr')}",
    )  # fmt: skip


def screen_rest(tool: Tool[Any], subject: Subject, policy: Policy) -> Subject | Decision:
    """Stages 4-5: deny rules (configured, then session), then the mode's hard limit."""
    signature = subject.signature
    # 4. Deny rules, configured then session; they hold in every mode, bypass included.
    rule = policy.rules.first(RuleBehavior.DENY, signature)
    if rule is None:
        rule = next((r for r in policy.session_deny if r.matches(signature)), None)
    if rule is not None:
        return deny(
            subject.input, signature, DecisionSource.RULE, f"{signature} is denied by rule {rule.text!r}", rule=rule
        )
    # 5. The mode's hard limit: plan denies anything not read-only, whatever allows it later.
    mode = policy.mode
    kind = subject.behavior.kind
    if MODE_TABLE[mode][kind] is RuleBehavior.DENY:
        return deny(
            subject.input, signature, DecisionSource.MODE,
            f"{mode.value} mode denies {kind.value} tools: {tool.name!r} is not read-only",
        )  # fmt: skip
    return subject


# -- stages 6-11: allow, or ask ---------------------------------------------------------------------


def evaluate_after_screen(tool: Tool[Any], subject: Subject, policy: Policy) -> Decision | AskNeeded:
    """Stages 6-11 for a *subject* that passed 0-5: an allow `Decision`, or `AskNeeded`."""
    signature = subject.signature
    # 6. A tool-level ask is answered only by asking: no approval, rule or mode skips it.
    if subject.tool_ask is not None:
        return _ask(tool, subject, AskReason.TOOL, subject.tool_ask.message, None)
    # 7. Session approvals: remembered signatures and session allow rules.
    if signature in policy.approved:
        return _allow(subject, DecisionSource.SESSION, "approved for this session")
    shell = tool.signature_field == "command"  # a prefix allow never grants a chained command
    for rule in policy.session_allow:
        if rule.grants(signature, shell=shell):
            return _allow(subject, DecisionSource.SESSION, f"session rule {rule.text!r}", rule)
    # 8. Allow rules: the hooks and the handler are not asked.
    rule_ = policy.rules.granting(signature, shell=shell)
    if rule_ is not None:
        return _allow(subject, DecisionSource.RULE, f"allowed by rule {rule_.text!r}", rule_)
    mode = policy.mode
    # 9. Ask rules beat the mode's allow, except in bypass (bypass means "do not ask me").
    if mode is not PermissionMode.BYPASS:
        rule_ = policy.rules.first(RuleBehavior.ASK, signature)
        if rule_ is not None:
            return _ask(tool, subject, AskReason.RULE, None, rule_)
    # 10. The mode table.
    kind = subject.behavior.kind
    if MODE_TABLE[mode][kind] is RuleBehavior.ALLOW:
        return _allow(subject, DecisionSource.MODE, f"{mode.value} mode allows {kind.value} tools")
    # 11. The default: ask.
    return _ask(tool, subject, AskReason.MODE, None, None)
