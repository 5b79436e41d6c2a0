"""`define_agent`: an agent's definition, validated and composed once, opened by many sessions.

Rules
=====

* Everything that does not depend on one session is checked and built here, once:
  the tool registry (built-ins, the agent's tools, plugin tools), the allowlist,
  the model and tool middleware stacks, the hook runner and its tool stages, the
  permission rules, the subagent definitions, and the lifecycle: the session's
  hook events (`SESSION_HOOKS`) composed with the chat middleware.
* A bad option raises a `ConfigError` (`MiddlewareShapeError` for chat middleware)
  before any session exists.
* Per session, `open_session` adds only the journal, the tool pipeline with the
  session's scheduler buckets and permission engine (derived from the spec's), and
  the session's state. The model service on the spec's own provider is made once
  per spec (`AgentSpec.model_service`); a provider named by string is created per
  session, and so is its service.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from .._config import validate_limit, validate_timeout
from .._errors import ConfigError
from .._lifecycle._interrupts import registered_interrupts, split_client_tools
from .._lifecycle._middleware import ChatMiddleware, middleware_lifecycle
from .._loop._compose import compose_lifecycle
from .._loop._hooks import Lifecycle
from .._loop._interrupts import ClientTool, InterruptDefinition
from .._models._service import ModelService, Provider, RetryPolicy
from .._permissions._engine import PermissionHandler, check_answerer
from .._permissions._rules import PermissionMode, PermissionRules
from .._tools._definition import Tool
from .._tools._scheduler import SchedulerLimits
from ._hooks import HookCallback, HookEvent
from ._host import SESSION_HOOKS
from ._plugins import MiddlewareConfig, Plugin, tool_names
from ._subagents import RoutedSubagentPersistence, SubagentDefinition, routed_persistence_of
from ._task_tools import TaskTools
from ._wiring import AgentParts, build_agent_parts

__all__ = ["AgentSpec", "PermissionAsks", "define_agent"]

PermissionAsks = Literal["handler", "interrupt"]
"""How a session asks a person about a call: a handler while the call waits, or by pausing the request."""


@attrs.frozen(eq=False)
class AgentSpec:
    """An agent defined once (`define_agent`); ``open_session(spec)`` opens a session of it.

    Immutable and shared: every session opened from it uses the same validated
    parts (``parts``), the same composed ``lifecycle`` and the same tool objects.
    """

    provider: Provider | str
    model: str | None
    system_prompt: str
    max_turns: int
    retry: RetryPolicy | None
    scheduler_limits: SchedulerLimits
    model_request_timeout: float
    tool_timeout: float
    hook_deadlines: Mapping[HookEvent, float]
    definitions: Mapping[str, SubagentDefinition]
    parts: AgentParts
    middleware: tuple[ChatMiddleware, ...]
    lifecycle: Lifecycle
    subagent_persistence: tuple[RoutedSubagentPersistence, ...]
    task_tools: TaskTools | None = attrs.field(repr=False)
    permission_asks: PermissionAsks = "handler"
    interrupts: Mapping[str, InterruptDefinition] = attrs.field(factory=dict)
    client_tools: Mapping[str, ClientTool] = attrs.field(factory=dict)
    # The model services of its sessions on its own provider, by cleanup grace (`model_service`).
    _services: dict[float, ModelService] = attrs.field(factory=dict, init=False, repr=False)

    @property
    def unwind_grace(self) -> float:
        """How long a cancelled call's PostToolUse hooks may still run."""
        return max(2.0, self.hook_deadlines.get(HookEvent.POST_TOOL_USE, 0.0) + 1.0)

    def model_service(self, provider: Provider, cleanup_grace: float) -> ModelService:
        """A session's model service: on the spec's own provider, one shared by its sessions (a
        service holds configuration only: another model is another service, `with_model`)."""
        if provider is not self.provider:
            return self._new_service(provider, cleanup_grace)
        service = self._services.get(cleanup_grace)
        if service is None:
            service = self._services[cleanup_grace] = self._new_service(provider, cleanup_grace)
        return service

    def _new_service(self, provider: Provider, cleanup_grace: float) -> ModelService:
        return ModelService(
            provider,
            self.parts.model_middleware,
            retry=self.retry,
            request_timeout=self.model_request_timeout,
            cleanup_grace=cleanup_grace,
        )


def _definitions(subagents: object) -> dict[str, SubagentDefinition]:
    if isinstance(subagents, (str, bytes)) or not isinstance(subagents, Sequence):
        raise ConfigError(f"subagents must be a list of SubagentDefinition, not {subagents!r}")
    definitions: dict[str, SubagentDefinition] = {}
    for definition in subagents:
        if not isinstance(definition, SubagentDefinition):
            raise ConfigError(f"subagents must be SubagentDefinition objects, not {definition!r}")
        if definition.name in definitions:
            raise ConfigError(f"subagent {definition.name!r} is defined twice")
        definitions[definition.name] = definition
    return definitions


def define_agent(
    *,
    provider: Provider | str,
    model: str | None = None,
    system_prompt: str = "",
    tools: Sequence[Tool[Any] | ClientTool] = (),
    plugins: Sequence[Plugin] = (),
    middleware: MiddlewareConfig | None = None,
    lifecycle: Sequence[ChatMiddleware] = (),
    hooks: Mapping[HookEvent, Sequence[HookCallback]] | None = None,
    allowed_tools: Iterable[str] | None = None,
    disallowed_tools: Iterable[str] | None = None,
    permissions: PermissionRules | Mapping[str, Sequence[str]] | None = None,
    permission_mode: PermissionMode | str = PermissionMode.DEFAULT,
    permission_handler: PermissionHandler | None = None,
    max_turns: int = 20,
    subagents: Sequence[SubagentDefinition] = (),
    workspace_roots: Sequence[str | os.PathLike[str]] | None = None,
    hook_deadlines: Mapping[HookEvent, float] | None = None,
    retry: RetryPolicy | None = None,
    scheduler_limits: SchedulerLimits | None = None,
    model_request_timeout: float = 600.0,
    tool_timeout: float = 600.0,
    permission_asks: PermissionAsks = "handler",
    interrupts: Sequence[InterruptDefinition] = (),
    permission_ask_timeout: float = 600.0,
) -> AgentSpec:
    """Define an agent once; open sessions of it with ``open_session(spec, ...)``.

    The options are `open_session`'s agent options (docs/sessions.md), plus:

    * ``lifecycle``: chat middleware (`ChatMiddleware`), run for every request of the
      root agent and of every subagent; composed after the session's Stop /
      SubagentStop hook events (docs/sessions.md, "Lifecycle middleware"). A
      middleware's ``routed_subagent_persistence`` stores every subagent run.
    * ``retry``: the model calls' `RetryPolicy` (default: 3 attempts with backoff).
    * ``scheduler_limits``: how many tool calls of each kind run at once, per session
      (default ``SchedulerLimits()``: 10 read-only, 10 write, 3 execute).
    * ``permission_asks``: ``"handler"`` (default) asks the ``permission_handler`` while
      the call waits; ``"interrupt"`` pauses the root agent's request instead, with one
      batch of approvals a person answers with ``session.resume(...)``
      (docs/human-in-the-loop.md). Subagents keep asking the handler.
    * ``interrupts``: the `InterruptDefinition` s middleware may ask with (and ``tools``
      may hold `ClientTool` s, run by the client: a call pauses the request).
    * ``permission_ask_timeout``: seconds one permission ask (the PermissionRequest hooks and
      the ``permission_handler`` together, or a tool's own async check) may take before the
      call is denied (default 600: a person may be slow; docs/permissions.md, "Deadline").

    Raises:
        ConfigError: a bad option (duplicate tools or plugins, bad rules, a bad limit).
        MiddlewareShapeError: ``lifecycle`` is not a list of `ChatMiddleware`.
    """
    max_turns = validate_limit(max_turns, name="max_turns")
    if not isinstance(provider, str) and not hasattr(provider, "with_model"):
        raise ConfigError(f"provider must be a Provider or a provider name, not {provider!r}")
    if model is not None and (not isinstance(model, str) or not model):
        raise ConfigError(f"model must be a non-empty model name (a string) or None, not {model!r:.200}")
    if isinstance(provider, str) and model is None:
        raise ConfigError("model is required when provider is given by name")
    if permission_handler is not None:
        check_answerer(permission_handler, "permission_handler")
    if not isinstance(system_prompt, str):
        raise ConfigError(f"system_prompt must be a string, not {system_prompt!r}")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ConfigError(f"retry must be a RetryPolicy, not {retry!r}")
    if scheduler_limits is not None and not isinstance(scheduler_limits, SchedulerLimits):
        raise ConfigError(f"scheduler_limits must be a SchedulerLimits, not {scheduler_limits!r}")
    model_request_timeout = validate_timeout(model_request_timeout, name="model_request_timeout")
    tool_timeout = validate_timeout(tool_timeout, name="tool_timeout")
    permission_ask_timeout = validate_timeout(permission_ask_timeout, name="permission_ask_timeout")
    if permission_asks not in ("handler", "interrupt"):
        raise ConfigError(f"permission_asks must be 'handler' or 'interrupt', not {permission_asks!r}")
    tools, client_tools = split_client_tools(tools)
    # Each read once, here: the same names filter the tools and the client tools.
    allowed_tools = tool_names(allowed_tools, "allowed_tools")
    disallowed_tools = tool_names(disallowed_tools, "disallowed_tools")
    registered = registered_interrupts(interrupts, list(lifecycle) if isinstance(lifecycle, (list, tuple)) else [])
    definitions = _definitions(subagents)
    # The session's own hooks first: a Stop hook's "one more turn" is asked before any veto.
    composed = compose_lifecycle(SESSION_HOOKS, middleware_lifecycle(lifecycle))  # checks the list
    middleware_list = tuple(lifecycle)
    persistence = routed_persistence_of(middleware_list)
    task_tools = TaskTools() if definitions else None
    parts = build_agent_parts(
        builtin_tools=task_tools.tools if task_tools is not None else (),
        tools=tools,
        plugins=plugins,
        middleware=middleware,
        hooks=hooks,
        allowed_tools=allowed_tools,
        disallowed_tools=disallowed_tools,
        permissions=permissions,
        permission_mode=permission_mode,
        permission_handler=permission_handler,
        workspace_roots=workspace_roots,
        hook_deadlines=hook_deadlines,
        asks_by_pausing=permission_asks == "interrupt",
        ask_timeout=permission_ask_timeout,
    )
    if client_tools:
        _check_client_tool_names(client_tools, parts.tools, task_tools, plugins)
        # The same filter as every other tool's: one the filter leaves out is neither offered nor run.
        client_tools = {
            name: tool
            for name, tool in client_tools.items()
            if (allowed_tools is None or name in allowed_tools) and name not in (disallowed_tools or ())
        }
    return AgentSpec(
        provider=provider,
        model=model,
        system_prompt=system_prompt,
        max_turns=max_turns,
        retry=retry,
        scheduler_limits=scheduler_limits or SchedulerLimits(),
        model_request_timeout=model_request_timeout,
        tool_timeout=tool_timeout,
        hook_deadlines=dict(hook_deadlines or {}),
        definitions=definitions,
        parts=parts,
        middleware=tuple(middleware_list),
        lifecycle=composed,
        subagent_persistence=persistence,
        task_tools=task_tools,
        permission_asks=permission_asks,
        interrupts=registered,
        client_tools=client_tools,
    )


def _check_client_tool_names(
    client_tools: Mapping[str, ClientTool],
    registry: Mapping[str, Tool[Any]],
    task_tools: TaskTools | None,
    plugins: Sequence[Plugin],
) -> None:
    """A client tool may not share its name with any tool of the agent: ``tools=`` (checked as they are
    split), a plugin's, or the built-in ``task`` tools (registered only after that split). The model
    would be offered two tools of one name."""
    for name in client_tools:
        if name not in registry:
            continue
        if task_tools is not None and any(tool.name == name for tool in task_tools.tools):
            owner = "a built-in subagent tool"
        else:
            found = (f"a tool of plugin {p.name!r}" for p in plugins if any(tool.name == name for tool in p.tools))
            owner = next(found, "a tool")
        raise ConfigError(f"client tool {name!r} shares its name with {owner}; the model would be offered both")
