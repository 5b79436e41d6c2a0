"""Plugins: named bundles of model and tool middleware, hooks and tools, resolved once per session.

::

    define_plugin(name="review", middleware=MiddlewareConfig(model=[...], tool=[...]),
                  hooks={HookEvent.USER_PROMPT_SUBMIT: [...]}, tools=[review_tool])

`define_plugin` validates everything when the plugin is defined, so a broken
plugin fails at import time with a `ConfigError`. `resolve_plugins` runs once
at session start: session middleware outermost, then plugins in list order,
each plugin's list in its own order; session hooks before plugin hooks; one
tool registry in which a duplicate name rejects the session (nothing is
silently replaced). See docs/plugins.md.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import attrs

from .._errors import ConfigError, MiddlewareShapeError
from .._models._service import ModelLayers, model_middleware_runs_problem
from .._tools._chain import ToolLayers, ToolMiddleware
from .._tools._definition import Tool
from .._util import safe_repr
from ._hooks import HookCallback, HookEvent, HookRegistry

__all__ = [
    "PLUGIN_NAME_PATTERN",
    "MiddlewareConfig",
    "MiddlewareConfigError",
    "Plugin",
    "RegisteredTool",
    "ResolvedPlugins",
    "TrustLevel",
    "UnknownToolError",
    "check_model_middleware_runs",
    "define_plugin",
    "resolve_plugins",
    "tool_names",
]

PLUGIN_NAME_PATTERN = r"[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?"
"""1-64 lowercase letters, digits, dots, underscores or hyphens; first and last a letter or digit."""

_PLUGIN_NAME = re.compile(PLUGIN_NAME_PATTERN)


class MiddlewareConfigError(ConfigError, MiddlewareShapeError):
    """A middleware entry of a `MiddlewareConfig` has the wrong shape.

    Both a `ConfigError` (it is caught at registration) and a `MiddlewareShapeError`
    (what `ToolPipeline` and `ModelService` raise for the same mistake).
    """


def check_model_middleware_runs(owner: str, layers: Iterable[object], *, runs: Sequence[str], why: str) -> None:
    """`MiddlewareConfigError` for model middleware that defines none of the wrappers *runs* (those
    of the calls its caller makes): it would silently never run. *why* says so to the user. The
    check is the model service's (`model_middleware_runs_problem`); the error is this module's."""
    problem = model_middleware_runs_problem(layers, runs)
    if problem is not None:
        raise MiddlewareConfigError(f"{owner} {problem}: {why}")


class TrustLevel(enum.Enum):
    """How far a tool's source is trusted (recorded on each `RegisteredTool`; nothing filters on it)."""

    TRUSTED = "trusted"  # built-in tools and the session's own tools
    WORKSPACE = "workspace"  # plugin tools
    REMOTE = "remote"  # tools from remote servers (e.g. MCP)


class UnknownToolError(ConfigError, KeyError):
    """`ResolvedPlugins.tool` was asked for a name no tool is registered under. Also a `KeyError`
    (a lookup by name that found nothing), so code catching that goes on working."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # not KeyError's repr of the message


def tool_names(value: object, what: str) -> tuple[str, ...] | None:
    """A list of tool names (``allowed_tools``, ``disallowed_tools``), read exactly once: a generator
    is used up by one pass, so the check and the filter must share this tuple (else a disallowed
    tool would stay allowed). ``None`` stays ``None`` (no filter)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(f"{what} must be a list of tool names, not {value!r}")
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"{what} must be a list of tool names, not {value!r} (it holds {name!r})")
    return names


def _is_sequence(value: object) -> TypeGuard[Sequence[Any]]:
    """An ordered collection (a list, a tuple): not a set, a dict or a generator, whose order is not
    the one written (or which one pass uses up), and not a string."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _layers(value: object, what: str) -> tuple[Any, ...]:
    # The order is the layer order (first = outermost): a set would shuffle it.
    if not _is_sequence(value):
        raise MiddlewareConfigError(f"{what} middleware must be a sequence (list or tuple), got {safe_repr(value)}")
    return tuple(value)


def _model_layers(value: object) -> tuple[object, ...]:
    return _layers(value, "model")


def _tool_layers(value: object) -> tuple[ToolMiddleware, ...]:
    return _layers(value, "tool")


@attrs.frozen
class MiddlewareConfig:
    """Model and tool middleware, each list first = outermost. Validated on construction.

    ``model`` entries are model middleware objects (`ModelMiddleware` subclasses or
    objects defining its wrappers); ``tool`` entries are
    ``async def mw(request, call_next) -> ToolResult``.
    """

    model: tuple[object, ...] = attrs.field(default=(), converter=_model_layers)
    tool: tuple[ToolMiddleware, ...] = attrs.field(default=(), converter=_tool_layers)

    def __attrs_post_init__(self) -> None:
        # The very checks the model service and the pipeline make; a layer that passed them is
        # remembered, so the spec's services do not inspect it again.
        try:
            ModelLayers.check(self.model)
            ToolLayers.check(self.tool)
        except MiddlewareShapeError as exc:
            raise MiddlewareConfigError(str(exc)) from None


def _check_name(name: object) -> str:
    if not isinstance(name, str) or _PLUGIN_NAME.fullmatch(name) is None:
        raise ConfigError(
            f"plugin name {name!r} is invalid: it must be 1-64 lowercase letters, numbers, dots, underscores, "
            "or hyphens, and start and end with a letter or number"
        )
    return name


def _plugin_tools(tools: object, name: str) -> tuple[Tool[Any], ...]:
    if not _is_sequence(tools):
        raise ConfigError(
            f"plugin {name!r}: tools must be a sequence of Tool (a list or tuple), got {safe_repr(tools)}"
        )
    tool_tuple = tuple(tools)
    seen: set[str] = set()
    for tool in tool_tuple:
        if not isinstance(tool, Tool):
            raise ConfigError(f"plugin {name!r}: expected a Tool (see define_tool), got {safe_repr(tool)}")
        if tool.name in seen:
            raise ConfigError(f"plugin {name!r} defines tool {tool.name!r} twice")
        seen.add(tool.name)
    return tool_tuple


@attrs.frozen
class Plugin:
    """A validated plugin. Build one with `define_plugin`.

    Built directly (or with `attrs.evolve`), it is checked the same way: a bad name, middleware
    that is not a `MiddlewareConfig`, hooks that are not a `HookRegistry` whose every hook has the
    source ``"plugin:<name>"`` (`source_id`) or tools that are not a sequence of distinct `Tool` s
    are a `ConfigError`.
    """

    name: str
    middleware: MiddlewareConfig
    hooks: HookRegistry = attrs.field(repr=False)
    tools: tuple[Tool[Any], ...]

    def __attrs_post_init__(self) -> None:
        # define_plugin's checks, here, so that no Plugin skips them (resolve_plugins read a junk
        # middleware with an AttributeError, and a bad name became a tool source).
        name = _check_name(self.name)
        if not isinstance(self.middleware, MiddlewareConfig):
            raise ConfigError(
                f"plugin {name!r}: middleware must be a MiddlewareConfig(model=[...], tool=[...]), "
                f"got {safe_repr(self.middleware)}"
            )
        if not isinstance(self.hooks, HookRegistry):
            raise ConfigError(f"plugin {name!r}: hooks must be a HookRegistry, got {safe_repr(self.hooks)}")
        # Its hooks are the plugin's: a failure, a decision or a deadline names them by this source,
        # so a registry built for another source (the default 'session') would be misattributed.
        source = self.source_id
        for event in HookEvent:
            for entry in self.hooks.for_event(event):
                if entry.source != source:
                    raise ConfigError(
                        f"plugin {name!r}: hooks must be a HookRegistry with source {source!r}, but hook "
                        f"{entry.name!r} of {event.title} has source {entry.source!r} "
                        f"(build it with HookRegistry(hooks, source={source!r}), or use define_plugin)"
                    )
        object.__setattr__(self, "tools", _plugin_tools(self.tools, name))

    @property
    def source_id(self) -> str:
        """``"plugin:<name>"``: the source of its tools and hooks."""
        return f"plugin:{self.name}"


def define_plugin(
    *,
    name: str,
    middleware: MiddlewareConfig | None = None,
    hooks: Mapping[HookEvent, Sequence[HookCallback]] | None = None,
    tools: Sequence[Tool[Any]] = (),
) -> Plugin:
    """Define a plugin; every part is checked now and a problem raises `ConfigError`.

    Args:
        name: 1-64 lowercase letters, numbers, dots, underscores or hyphens,
            starting and ending with a letter or number.
        middleware: its model and tool middleware (inside the session's own).
        hooks: callbacks by `HookEvent` (run after the session's hooks).
        tools: its tools, registered with ``source_id="plugin:<name>"`` and trust ``workspace``.
    """
    checked = _check_name(name)  # before the hooks, whose errors name the plugin's source
    registry = HookRegistry(hooks, source=f"plugin:{checked}")
    # Plugin checks its parts however it is built; the tools are made a tuple for it here.
    return Plugin(
        checked, MiddlewareConfig() if middleware is None else middleware, registry, _plugin_tools(tools, checked)
    )


@attrs.frozen
class RegisteredTool:
    """A tool in the session's registry, with its source (``builtin``, ``session``, ``plugin:<name>``) and trust."""

    tool: Tool[Any]
    source_id: str
    trust_level: TrustLevel

    @property
    def name(self) -> str:
        return self.tool.name


@attrs.frozen
class ResolvedPlugins:
    """What a session is built from: ordered middleware, hooks and the tool registry.

    ``model_middleware`` and ``tool_middleware`` go to `ModelService` and
    `ToolPipeline` (and, unchanged, to every subagent); ``hooks`` to a
    `HookRunner`; ``tools`` is in registration order: built-ins, session tools,
    then each plugin's.
    """

    model_middleware: tuple[object, ...]
    tool_middleware: tuple[ToolMiddleware, ...]
    hooks: HookRegistry = attrs.field(repr=False)
    tools: tuple[RegisteredTool, ...]
    plugins: tuple[Plugin, ...]

    def tool(self, name: str) -> RegisteredTool:
        """The registered tool called *name*; `UnknownToolError` (a `ConfigError` and a `KeyError`)
        naming the registered ones if there is none."""
        for entry in self.tools:
            if entry.name == name:
                return entry
        known = ", ".join(repr(entry.name) for entry in self.tools) or "none"
        raise UnknownToolError(f"no tool named {name!r} is registered (registered: {known})")

    def select(
        self,
        *,
        allowed: Iterable[str] | None = None,
        disallowed: Iterable[str] | None = (),
    ) -> tuple[RegisteredTool, ...]:
        """The tools that pass the session's filters, whatever their source.

        ``allowed=None`` keeps every name and an empty list none; ``disallowed``
        applies after it. Plugin tools get no exemption. Each list is read once
        (a generator works); anything but a list of names is a `ConfigError`.
        """
        allowed_names = tool_names(allowed, "allowed tools")
        allowed_set = None if allowed_names is None else set(allowed_names)
        disallowed_set = set(tool_names(disallowed, "disallowed tools") or ())
        return tuple(
            entry
            for entry in self.tools
            if (allowed_set is None or entry.name in allowed_set) and entry.name not in disallowed_set
        )


def resolve_plugins(
    session_middleware: MiddlewareConfig | None,
    plugins: Sequence[Plugin],
    builtin_tools: Sequence[Tool[Any]] = (),
    session_tools: Sequence[Tool[Any]] = (),
    *,
    session_hooks: HookRegistry | Mapping[HookEvent, Sequence[HookCallback]] | None = None,
) -> ResolvedPlugins:
    """Resolve a session's middleware, hooks and tools (once, at session start).

    Order: the session's middleware is outermost, then each plugin's in *plugins*
    order, each list in its own order; session hooks run before plugin hooks.
    Raises `ConfigError` for a plugin registered twice, anything that is not a
    `Plugin` or `Tool`, or a tool name registered twice (naming both sources).
    """
    if session_middleware is None:
        session_middleware = MiddlewareConfig()
    elif not isinstance(session_middleware, MiddlewareConfig):
        raise ConfigError(f"session middleware must be a MiddlewareConfig, got {session_middleware!r}")
    # The order is the layer and hook order: a set of plugins would shuffle it.
    if not _is_sequence(plugins):
        raise ConfigError(f"plugins must be a sequence of Plugin (a list or tuple), got {safe_repr(plugins)}")
    plugin_tuple = tuple(plugins)
    names: set[str] = set()
    for plugin in plugin_tuple:
        if not isinstance(plugin, Plugin):
            raise ConfigError(f"plugins must be made with define_plugin, got {plugin!r}")
        if plugin.name in names:
            raise ConfigError(f"plugin {plugin.name!r} is registered more than once")
        names.add(plugin.name)

    if session_hooks is None or isinstance(session_hooks, HookRegistry):
        session_registry = session_hooks or HookRegistry()
    else:
        session_registry = HookRegistry(session_hooks, source="session")

    registry: dict[str, RegisteredTool] = {}

    def register(tools: object, source_id: str, trust: TrustLevel) -> None:
        if not _is_sequence(tools):  # the registry's order is the order tools are offered in
            raise ConfigError(f"{source_id} tools must be a sequence of Tool (a list or tuple), got {safe_repr(tools)}")
        for tool in tools:
            if not isinstance(tool, Tool):
                raise ConfigError(f"{source_id} tools: expected a Tool (see define_tool), got {tool!r}")
            existing = registry.get(tool.name)
            if existing is not None:
                where = "twice" if existing.source_id == source_id else f"by {existing.source_id} and {source_id}"
                raise ConfigError(
                    f"duplicate tool name {tool.name!r}: registered {where}; nothing is silently replaced"
                )
            registry[tool.name] = RegisteredTool(tool, source_id, trust)

    register(builtin_tools, "builtin", TrustLevel.TRUSTED)
    register(session_tools, "session", TrustLevel.TRUSTED)
    for plugin in plugin_tuple:
        register(plugin.tools, plugin.source_id, TrustLevel.WORKSPACE)

    return ResolvedPlugins(
        model_middleware=session_middleware.model + tuple(m for p in plugin_tuple for m in p.middleware.model),
        tool_middleware=session_middleware.tool + tuple(t for p in plugin_tuple for t in p.middleware.tool),
        hooks=HookRegistry.combine(session_registry, *(plugin.hooks for plugin in plugin_tuple)),
        tools=tuple(registry.values()),
        plugins=plugin_tuple,
    )
