"""Assembling a session's parts from `open_session`'s options.

* Tools: built-ins, session tools and plugin tools (``resolve_plugins``:
  duplicates rejected, plugin tools tagged ``plugin:<name>`` / ``workspace``),
  then the allowed/disallowed filter (omitted = all, empty = none).
* One model and one tool middleware stack: session middleware outermost, then
  plugins in order. Shared by the root agent and every subagent.
* One `HookRunner` (session hooks before plugin hooks) and its PreToolUse and
  PostToolUse pipeline stages.
* One `PermissionEngine` as the pipeline's permission stage. PermissionRequest
  hooks run before the permission handler (a skip or abort denies; a modified
  input is what the handler sees); the engine's asks are journalled
  (``permission_requested`` / ``permission_resolved``) on the calling agent's stream.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .._errors import ConfigError
from .._journal._events import PermissionRequested, PermissionResolved
from .._tools._definition import Tool
from .._tools._stages import ToolStages
from ._hooks import HookAction, HookEvent, HookInput, HookRegistry, HookRunner, post_tool_stage, pre_tool_stage
from ._permissions import (
    PathPolicy,
    PermissionAllow,
    PermissionDeny,
    PermissionEngine,
    PermissionHandler,
    PermissionMode,
    PermissionRecord,
    PermissionRequest,
    PermissionResult,
    PermissionRules,
    ToolFilter,
)
from ._plugins import MiddlewareConfig, Plugin, ResolvedPlugins, resolve_plugins

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["SessionParts", "build_session_parts"]


@attrs.define
class SessionParts:
    resolved: ResolvedPlugins
    tools: dict[str, Tool[Any]]
    allowed: set[str]
    model_middleware: tuple[Any, ...]
    tool_middleware: tuple[Any, ...]
    stages: ToolStages
    runner: HookRunner
    permissions: PermissionEngine
    workspace: str | None
    _session: list[Session] = attrs.Factory(list)

    def bind(self, session: Session) -> None:
        self._session.append(session)


def _rules(permissions: Any) -> PermissionRules | None:
    if permissions is None or isinstance(permissions, PermissionRules):
        return permissions
    if isinstance(permissions, Mapping):
        unknown = set(permissions) - {"allow", "ask", "deny"}
        if unknown:
            raise ConfigError(f"permissions takes 'allow', 'ask' and 'deny' lists, not {sorted(unknown)}")
        return PermissionRules(
            allow=tuple(permissions.get("allow", ())),
            ask=tuple(permissions.get("ask", ())),
            deny=tuple(permissions.get("deny", ())),
        )
    raise ConfigError(f"permissions must be a PermissionRules or a mapping of rule lists, not {permissions!r}")


def build_session_parts(
    *,
    builtin_tools: Sequence[Tool[Any]],
    tools: Sequence[Tool[Any]],
    plugins: Sequence[Plugin],
    middleware: MiddlewareConfig | None,
    hooks: Mapping[Any, Sequence[Any]] | None,
    allowed_tools: Sequence[str] | None,
    disallowed_tools: Sequence[str] | None,
    permissions: Any,
    permission_mode: PermissionMode | str,
    permission_handler: PermissionHandler | None,
    workspace_roots: Sequence[str | os.PathLike[str]] | None,
    hook_deadlines: Mapping[HookEvent, float] | None,
    agent_filter: Callable[[str], ToolFilter],
) -> SessionParts:
    if middleware is not None and not isinstance(middleware, MiddlewareConfig):
        raise ConfigError(f"middleware must be a MiddlewareConfig(model=[...], tool=[...]), not {middleware!r}")
    if isinstance(plugins, (str, bytes)) or not isinstance(plugins, Sequence):
        raise ConfigError(f"plugins must be a list of define_plugin(...) results, not {plugins!r}")
    session_hooks = None if hooks is None else HookRegistry(hooks, source="session")
    resolved = resolve_plugins(middleware, plugins, builtin_tools, tools, session_hooks=session_hooks)
    for label, names in (("allowed_tools", allowed_tools), ("disallowed_tools", disallowed_tools)):
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
            raise ConfigError(f"{label} must be a list of tool names, not {names!r}")
    selected = resolved.select(allowed=allowed_tools, disallowed=tuple(disallowed_tools or ()))
    registry = {entry.name: entry.tool for entry in resolved.tools}
    runner = HookRunner(resolved.hooks, deadlines=hook_deadlines)
    roots = [os.path.abspath(os.fspath(root)) for root in workspace_roots] if workspace_roots else None
    holder: list[Session] = []

    async def record(phase: str, entry: PermissionRecord) -> None:
        session = holder[0]
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
            outcome = entry.outcome
            assert outcome is not None
            event = PermissionResolved(**ids, decision=outcome)
        await session.journal.append(event, agent_id=request.agent_id)

    has_permission_hooks = runner.has_hooks(HookEvent.PERMISSION_REQUEST)

    async def ask(request: PermissionRequest) -> PermissionResult | None:
        """PermissionRequest hooks, then the user's handler; nobody answering means deny (engine)."""
        current = request
        modified = False
        if has_permission_hooks:
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
                current = attrs.evolve(request, input=decision.apply_to(request.input))
                modified = True
        if permission_handler is None:
            return None
        answer = await permission_handler(current)
        if modified and isinstance(answer, PermissionAllow) and answer.updated_input is None:
            return attrs.evolve(answer, updated_input=dict(current.input))
        return answer

    engine = PermissionEngine(
        _rules(permissions),
        mode=permission_mode,
        handler=ask if (permission_handler is not None or has_permission_hooks) else None,
        path_policy=PathPolicy(roots) if roots else None,
        record=record,
        tool_filter=agent_filter,
    )
    stages = ToolStages(
        pre_tool=[pre_tool_stage(runner)] if runner.has_hooks(HookEvent.PRE_TOOL_USE) else [],
        permission=[engine.as_stage()],
        post_tool=[post_tool_stage(runner)]
        if runner.has_hooks(HookEvent.POST_TOOL_USE) or runner.has_hooks(HookEvent.POST_TOOL_USE_FAILURE)
        else [],
    )
    parts = SessionParts(
        resolved=resolved,
        tools=registry,
        allowed={entry.name for entry in selected},
        model_middleware=tuple(resolved.model_middleware),
        tool_middleware=tuple(resolved.tool_middleware),
        stages=stages,
        runner=runner,
        permissions=engine,
        workspace=roots[0] if roots else None,
    )
    parts._session = holder
    return parts
