"""Assembling an agent's parts from its options: once per `AgentSpec`, plus what each session adds.

Per spec (`build_agent_parts`, shared by every session of the spec):

* Tools: built-ins, session tools and plugin tools (``resolve_plugins``:
  duplicates rejected, plugin tools tagged ``plugin:<name>`` / ``workspace``),
  then the allowed/disallowed filter (omitted = all, empty = none).
* One model and one tool middleware stack: session middleware outermost, then
  plugins in order. Shared by the root agent and every subagent.
* One `HookRunner` (session hooks before plugin hooks) and its PreToolUse and
  PostToolUse pipeline stages (the post stage also when only PreToolUse hooks exist: it
  carries their context to the result).

Per session (`AgentParts.session_engine`, `session_stages`): the session's own rule
updates and journal, and the agents' allowlists.

* One `PermissionEngine` as the pipeline's permission stage, derived from the
  spec's (`permission_engine`, checked once with the spec), given every
  tool's ``signature_content`` and ``check_permissions``. PermissionRequest
  hooks run before the permission handler (a skip or abort denies; a modified
  input is what the handler sees); with no handler they can only deny, and a
  call that needs an answer is refused with code ``no_handler``. The engine's
  asks are journalled (``permission_requested`` / ``permission_resolved``) on
  the calling agent's stream.
* Checks that reject the session (`ConfigError`) or warn before it starts:
  model middleware that does not define ``wrap_stream`` (sessions stream every
  model turn, so it would never run); a ``Name:content`` rule naming a tool
  whose calls have no signature content, or whose content is not in the form
  the tool's call content takes (stripped, a path normalised: it could never
  match; `PermissionRules.check_tools`); one WARNING
  on the ``trio_agent.permissions`` logger per tool whose calls will all be
  denied (`PermissionEngine.never_allowed`). A rule added while the session runs
  (a rule update) is judged by the same check in the engine (`never_matches`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from .._errors import ConfigError
from .._journal._durable import DurableJournal
from .._journal._events import PermissionDecision, PermissionRequested, PermissionResolved
from .._models._messages import ToolSpec
from .._models._service import ModelLayers
from .._permissions._engine import (
    PermissionEngine,
    PermissionHandler,
    PermissionRecord,
    PermissionRecorder,
    PermissionRequest,
    SignatureContent,
    logger,
)
from .._permissions._rules import (
    PathPolicy,
    PermissionAllow,
    PermissionDeny,
    PermissionMode,
    PermissionResult,
    PermissionRules,
    ToolFilter,
    ToolPermissionCheck,
    rules_from,
)
from .._tools._chain import ToolLayers
from .._tools._definition import Tool
from .._tools._results import json_copy
from .._tools._stages import StageDecision, ToolStages
from ._hooks import HookAction, HookEvent, HookInput, HookRegistry, HookRunner, post_tool_stage, pre_tool_stage
from ._plugins import MiddlewareConfig, Plugin, check_model_middleware_runs, resolve_plugins, tool_names
from ._requests import _Agent

__all__ = ["AgentFilters", "AgentParts", "build_agent_parts", "session_stages"]


@attrs.frozen(eq=False)
class AgentParts:
    """What an agent spec validates and composes once; shared by every session opened from it."""

    tools: Mapping[str, Tool[Any]]  # the registry, in registration order
    allowed: frozenset[str]
    model_middleware: ModelLayers  # checked once, here: a session's services check nothing again
    tool_middleware: ToolLayers
    hooks: HookRunner
    hook_stages: ToolStages  # PreToolUse / PostToolUse; the permission stage is per session
    rules: PermissionRules | None
    permission_mode: PermissionMode | str
    permission_handler: PermissionHandler | None
    workspace_roots: tuple[str, ...] | None
    ask_timeout: float = 600.0  # the engine's: checked by it (`PermissionEngine`), a ConfigError if bad
    # The spec's permission engine (`permission_engine`), checked once; each session derives its own.
    engine: PermissionEngine | None = None
    root_filter: ToolFilter | None = None  # ``allowed`` as the engine's filter of the root's calls
    # Tool name -> (the tool, the `ToolSpec` the model is offered for it): one per tool for every
    # session (`SessionHost._run_parts`), not a copy of its schema each.
    tool_specs: dict[str, tuple[Tool[Any], ToolSpec]] = attrs.field(factory=dict, init=False, repr=False)

    @property
    def workspace(self) -> str | None:
        return self.workspace_roots[0] if self.workspace_roots else None

    def session_engine(self, record: PermissionRecorder, agents: Mapping[str, _Agent]) -> PermissionEngine:
        """A session's permission engine: the spec's, with the session's own records and rule
        updates, checking every agent's calls against its own allowlist (subagents included)."""
        template = self.engine
        if template is None:
            template = permission_engine(self, record=None, agent_filter=_no_filter)
        return template.derive(record=record, tool_filter=AgentFilters(agents))


class AgentFilters:
    """``agent_id -> ToolFilter``: the allowlist of each live agent (an agent that is gone: none)."""

    __slots__ = ("_agents",)

    def __init__(self, agents: Mapping[str, _Agent]) -> None:
        self._agents = agents

    def __call__(self, agent_id: str) -> ToolFilter:
        agent = self._agents.get(agent_id)
        return _NO_FILTER if agent is None else agent.tool_filter()


def _check_streaming(middleware: MiddlewareConfig | None, plugins: Sequence[Plugin]) -> None:
    """Sessions only stream: model middleware without ``wrap_stream`` would silently never run."""
    owners: list[tuple[str, tuple[object, ...]]] = [("session", () if middleware is None else middleware.model)]
    owners.extend((f"plugin {plugin.name!r}", plugin.middleware.model) for plugin in plugins)
    for owner, layers in owners:
        check_model_middleware_runs(
            owner,
            layers,
            runs=("wrap_stream",),
            why="a session streams every model turn, so it would never run; define wrap_stream "
            "(an async generator that iterates call_next(request))",
        )


def build_agent_parts(
    *,
    builtin_tools: Sequence[Tool[Any]],
    tools: Sequence[Tool[Any]],
    plugins: Sequence[Plugin],
    middleware: MiddlewareConfig | None,
    hooks: Mapping[Any, Sequence[Any]] | None,
    allowed_tools: Iterable[str] | None,
    disallowed_tools: Iterable[str] | None,
    permissions: Any,
    permission_mode: PermissionMode | str,
    permission_handler: PermissionHandler | None,
    workspace_roots: Sequence[str | os.PathLike[str]] | None,
    hook_deadlines: Mapping[HookEvent, float] | None,
    asks_by_pausing: bool = False,
    ask_timeout: float = 600.0,
) -> AgentParts:
    """Validate an agent's options and compose its parts (once per spec; module docstring)."""
    if middleware is not None and not isinstance(middleware, MiddlewareConfig):
        raise ConfigError(f"middleware must be a MiddlewareConfig(model=[...], tool=[...]), not {middleware!r}")
    if isinstance(plugins, (str, bytes)) or not isinstance(plugins, Sequence):
        raise ConfigError(f"plugins must be a list of define_plugin(...) results, not {plugins!r}")
    session_hooks = None if hooks is None else HookRegistry(hooks, source="session")
    resolved = resolve_plugins(middleware, plugins, builtin_tools, tools, session_hooks=session_hooks)
    _check_streaming(middleware, resolved.plugins)
    selected = resolved.select(
        allowed=tool_names(allowed_tools, "allowed_tools"), disallowed=tool_names(disallowed_tools, "disallowed_tools")
    )
    registry = {entry.name: entry.tool for entry in resolved.tools}
    rules = rules_from(permissions)
    if rules is not None:
        rules.check_tools(registry.values())
    runner = HookRunner(resolved.hooks, deadlines=hook_deadlines)
    # Checked by the policy's own rules (one path or several; none is a ConfigError, never "no policy").
    roots = None if workspace_roots is None else PathPolicy(workspace_roots).workspace_roots
    parts = AgentParts(
        tools=registry,
        allowed=frozenset(entry.name for entry in selected),
        model_middleware=ModelLayers.check(resolved.model_middleware),
        tool_middleware=ToolLayers.check(resolved.tool_middleware),
        hooks=runner,
        hook_stages=ToolStages(
            pre_tool=[pre_tool_stage(runner)] if runner.has_hooks(HookEvent.PRE_TOOL_USE) else [],
            # PreToolUse context reaches the result through the post stage: needed with either kind.
            post_tool=[post_tool_stage(runner)] if any(runner.has_hooks(event) for event in _TOOL_HOOK_EVENTS) else [],
        ),
        rules=rules,
        permission_mode=permission_mode,
        permission_handler=permission_handler,
        workspace_roots=roots,
        ask_timeout=ask_timeout,
    )
    # The engine's checks (a bad rule, a tool that can never run) belong to the definition too.
    engine = permission_engine(parts, record=None, agent_filter=_no_filter)
    if not asks_by_pausing:  # a request that asks by pausing needs no handler
        _warn_never_allowed(parts)
    try:
        root_filter: ToolFilter | None = ToolFilter(allowed=parts.allowed)
    except ConfigError:
        root_filter = None  # a name no rule could name: refused at the call, as before (`_Agent.tool_filter`)
    return attrs.evolve(parts, engine=engine, root_filter=root_filter)


_NO_FILTER = ToolFilter(allowed=None)
_TOOL_HOOK_EVENTS = (HookEvent.PRE_TOOL_USE, HookEvent.POST_TOOL_USE, HookEvent.POST_TOOL_USE_FAILURE)


def _no_filter(agent_id: str) -> ToolFilter:
    return _NO_FILTER


def _warn_never_allowed(parts: AgentParts) -> None:
    if parts.permission_handler is not None:
        return  # the handler may allow any call it is asked about
    # The session's PermissionRequest hooks can only deny (`hooks_only`), though the engine takes
    # them as hooks that may allow: judge the rules and the mode alone, as an engine with no answerer.
    engine = PermissionEngine(parts.rules, mode=parts.permission_mode)
    for name, tool in parts.tools.items():
        why = engine.never_allowed(tool) if name in parts.allowed else None
        if why is not None:
            # Logged, not warnings.warn (suites run with -W error): the model only sees the denials.
            logger.warning(
                "tool %r can never run in this session: %s, no allow rule matches it and there is no "
                "permission_handler to ask, so every call will be denied. Pass permissions="
                '{"allow": ["%s"]}, a permission_handler=, or define it with kind="readonly" if it only reads',
                name, why, name,
            )  # fmt: skip


def journal_permissions(journal: DurableJournal) -> PermissionRecorder:
    """The engine's asks, journalled (``permission_requested`` / ``permission_resolved``) on the
    calling agent's stream."""
    return _RecordAsks(journal)


class _RecordAsks:
    __slots__ = ("journal",)

    def __init__(self, journal: DurableJournal) -> None:
        self.journal = journal

    async def __call__(self, phase: str, entry: PermissionRecord) -> None:
        request = entry.request
        ids: dict[str, Any] = {
            "request_id": request.request_id,
            "turn_id": request.turn_id,
            "call_id": request.tool_call_id,
            "permission_id": entry.permission_id,
        }
        if phase == "requested":
            event: Any = PermissionRequested(**ids, message=request.message)
        else:
            decision = entry.decision
            assert decision is not None
            outcome = decision.outcome
            # An allow of a changed input records what it covers: a re-run after a crash runs that.
            allowed = decision.input if outcome is PermissionDecision.ALLOW else None
            changed = allowed is not None and allowed != request.input
            event = PermissionResolved(**ids, decision=outcome, input=json_copy(allowed) if changed else None)
        await self.journal.append(event, agent_id=request.agent_id)


def permission_engine(
    parts: AgentParts, *, record: PermissionRecorder | None, agent_filter: Callable[[str], ToolFilter]
) -> PermissionEngine:
    """A session's permission engine: its own rule updates and records, the spec's rules and tools."""
    runner = parts.hooks
    permission_handler = parts.permission_handler
    has_permission_hooks = runner.has_hooks(HookEvent.PERMISSION_REQUEST)

    async def run_hooks(request: PermissionRequest) -> PermissionDeny | PermissionRequest:
        """The PermissionRequest hooks: a deny, or the request the handler sees (input maybe modified)."""
        decision = await runner.dispatch(
            HookEvent.PERMISSION_REQUEST,
            HookInput(
                event=HookEvent.PERMISSION_REQUEST,
                session_id=request.session_id,
                agent_id=request.agent_id,
                tool_name=request.tool_name,
                tool_call_id=request.tool_call_id,
                tool_input=dict(request.input),
                reason=request.message,
                extra={"affected_paths": list(request.affected_paths), "tool_kind": request.tool_kind.value},
            ),
            abort=request.abort,
        )
        if decision.action is HookAction.SKIP:
            return PermissionDeny(f"a PermissionRequest hook denied the call: {decision.reason or 'skip'}")
        if decision.action is HookAction.ABORT:
            return PermissionDeny(
                f"a PermissionRequest hook stopped the request: {decision.reason or 'abort'}", stop_loop=True
            )
        if decision.modified_input is not None:
            # Built again by the engine on the new input: the handler is shown (and remembers) the
            # signature, kind and paths of what would run, and a new input the stages refuse is denied.
            return await request.with_input(decision.apply_to(request.input))
        return request

    async def ask(request: PermissionRequest) -> PermissionResult | None:
        """PermissionRequest hooks, then the user's handler (only wired when there is one)."""
        assert permission_handler is not None
        current = request
        if has_permission_hooks:
            outcome = await run_hooks(request)
            if isinstance(outcome, PermissionDeny):
                return outcome
            current = outcome
        answer = await permission_handler(current)
        if current is not request and isinstance(answer, PermissionAllow) and answer.updated_input is None:
            return attrs.evolve(answer, updated_input=dict(current.input))
        return answer

    async def hooks_only(request: PermissionRequest) -> PermissionDeny | None:
        """No handler: the hooks can still deny; nothing can allow, so the engine refuses (``no_handler``)."""
        outcome = await run_hooks(request)
        return outcome if isinstance(outcome, PermissionDeny) else None

    # The tools' own permission parts, given explicitly: the engine is built for these tools.
    registry = parts.tools
    checks: dict[str, ToolPermissionCheck] = {
        name: tool.check_permissions for name, tool in registry.items() if tool.check_permissions is not None
    }
    contents: dict[str, SignatureContent] = {name: tool.signature_content_for for name, tool in registry.items()}
    return PermissionEngine(
        parts.rules,
        mode=parts.permission_mode,
        handler=ask if permission_handler is not None else None,
        hooks=[hooks_only] if permission_handler is None and has_permission_hooks else None,
        path_policy=PathPolicy(list(parts.workspace_roots)) if parts.workspace_roots else None,
        record=record,
        tool_checks=checks,
        signature_content=contents,
        tool_filter=agent_filter,
        ask_timeout=parts.ask_timeout,
    )


def session_stages(
    parts: AgentParts, engine: PermissionEngine, answered: dict[tuple[str, str], StageDecision] | None = None
) -> ToolStages:
    """The spec's hook stages around the session's own permission stage (*answered*: what a
    person answered for single calls by resuming a pause, see `PermissionEngine.as_stage`)."""
    hooks = parts.hook_stages
    return ToolStages(pre_tool=hooks.pre_tool, permission=[engine.as_stage(answered)], post_tool=hooks.post_tool)
