"""Hooks and plugins beyond `trio_agent.define_plugin`: actions, typed inputs, errors, resolution.

A hook callback receives a `trio_agent.HookInput` (one of the typed inputs here, by
event) and returns a `trio_agent.HookOutput` whose ``action`` is a `HookAction`::

    from trio_agent.plugins import HookAction, PreToolUseInput
"""

from __future__ import annotations

from ._session._hooks import (
    DEFAULT_HOOK_DEADLINES,
    HookAbortedError,
    HookAction,
    HookCallback,
    HookInterruptedError,
    HookRegistry,
    HookReturnError,
    HookTimeoutError,
    PermissionRequestInput,
    PostToolUseFailureInput,
    PostToolUseInput,
    PreToolUseInput,
    RegisteredHook,
    SessionEndInput,
    SessionStartInput,
    StopInput,
    SubagentStartInput,
    SubagentStopInput,
    UserPromptSubmitInput,
)
from ._session._plugins import (
    MiddlewareConfigError,
    RegisteredTool,
    ResolvedPlugins,
    TrustLevel,
    UnknownToolError,
    resolve_plugins,
)
from ._util import fixup_module_metadata as _fixup_module_metadata

__all__ = [
    "DEFAULT_HOOK_DEADLINES",
    "HookAbortedError",
    "HookAction",
    "HookCallback",
    "HookInterruptedError",
    "HookRegistry",
    "HookReturnError",
    "HookTimeoutError",
    "MiddlewareConfigError",
    "PermissionRequestInput",
    "PostToolUseFailureInput",
    "PostToolUseInput",
    "PreToolUseInput",
    "RegisteredHook",
    "RegisteredTool",
    "ResolvedPlugins",
    "SessionEndInput",
    "SessionStartInput",
    "StopInput",
    "SubagentStartInput",
    "SubagentStopInput",
    "TrustLevel",
    "UnknownToolError",
    "UserPromptSubmitInput",
    "resolve_plugins",
]

_fixup_module_metadata(__name__, globals())
