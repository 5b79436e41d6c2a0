"""trio_agent: a Trio-native structured-concurrency runtime for LLM agents.

The top level holds what an application needs: open a session, define tools, agents,
plugins and permissions, read the events, catch the trunk of the errors. The rest lives
in public submodules, imported on first use:

* `trio_agent.tools`: the tool pipeline, stages, scheduler and tool journal.
* `trio_agent.models`: messages, stream chunks, the model service, the providers.
* `trio_agent.journal`: the durable journal: stores, events, projection, subscriptions.
* `trio_agent.permissions`: the permission engine, rules and policies.
* `trio_agent.plugins`: hook actions, hook inputs and errors, plugin resolution.
* `trio_agent.middleware`: the generic middleware composer.
* `trio_agent.lifecycle`: chat middleware, the loop's lifecycle hooks, run events.
* `trio_agent.testing`: the test model and helpers for testing code built on trio_agent.

``import trio_agent`` loads only the package: each name loads its part when first used
(``trio_agent.open_session`` the session stack; a provider its HTTP client, a store its
database driver), so a program pays only for what it touches.
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING, Any

from ._util import import_lazy as _import_lazy

if TYPE_CHECKING:  # the names below load on first use (``__getattr__``); type checkers see them here
    from ._abort import AbortReason as AbortReason
    from ._chat._chat import chat as chat
    from ._errors import AuthenticationError as AuthenticationError
    from ._errors import ConfigError as ConfigError
    from ._errors import HookError as HookError
    from ._errors import JournalError as JournalError
    from ._errors import LeaseLostError as LeaseLostError
    from ._errors import MiddlewareError as MiddlewareError
    from ._errors import ModelError as ModelError
    from ._errors import ModelTimeoutError as ModelTimeoutError
    from ._errors import ProviderError as ProviderError
    from ._errors import RateLimitError as RateLimitError
    from ._errors import RequestAbortedError as RequestAbortedError
    from ._errors import SessionBusyError as SessionBusyError
    from ._errors import SessionClosedError as SessionClosedError
    from ._errors import SessionError as SessionError
    from ._errors import SessionPausedError as SessionPausedError
    from ._errors import ToolDefinitionError as ToolDefinitionError
    from ._errors import ToolInputError as ToolInputError
    from ._errors import TrioAgentError as TrioAgentError
    from ._errors import UnfinishedRequestError as UnfinishedRequestError
    from ._errors import UnknownSubagentError as UnknownSubagentError
    from ._loop._rules import StopReason as StopReason
    from ._models._providers import create_provider as create_provider
    from ._models._service import ModelMiddleware as ModelMiddleware
    from ._models._service import Provider as Provider
    from ._permissions._engine import PermissionRequest as PermissionRequest
    from ._permissions._rules import PermissionAllow as PermissionAllow
    from ._permissions._rules import PermissionAsk as PermissionAsk
    from ._permissions._rules import PermissionDeny as PermissionDeny
    from ._permissions._rules import PermissionMode as PermissionMode
    from ._permissions._rules import PermissionRules as PermissionRules
    from ._permissions._rules import PermissionUpdate as PermissionUpdate
    from ._session._hooks import HookEvent as HookEvent
    from ._session._hooks import HookInput as HookInput
    from ._session._hooks import HookOutput as HookOutput
    from ._session._messages import DoneEvent as DoneEvent
    from ._session._messages import PausedReply as PausedReply
    from ._session._messages import PermissionDeniedEvent as PermissionDeniedEvent
    from ._session._messages import SessionEvent as SessionEvent
    from ._session._messages import SubagentEvent as SubagentEvent
    from ._session._messages import SubagentStatus as SubagentStatus
    from ._session._messages import TextDeltaEvent as TextDeltaEvent
    from ._session._messages import ToolProgressEvent as ToolProgressEvent
    from ._session._messages import ToolResultEvent as ToolResultEvent
    from ._session._messages import ToolUseEvent as ToolUseEvent
    from ._session._messages import UsageEvent as UsageEvent
    from ._session._open import open_session as open_session
    from ._session._plugins import MiddlewareConfig as MiddlewareConfig
    from ._session._plugins import Plugin as Plugin
    from ._session._plugins import define_plugin as define_plugin
    from ._session._requests import Priority as Priority
    from ._session._session import Session as Session
    from ._session._spec import AgentSpec as AgentSpec
    from ._session._spec import define_agent as define_agent
    from ._session._stream import SessionEventStream as SessionEventStream
    from ._session._subagents import SubagentDefinition as SubagentDefinition
    from ._session._subagents import SubagentHandle as SubagentHandle
    from ._tools._chain import ToolMiddleware as ToolMiddleware
    from ._tools._context import ToolContext as ToolContext
    from ._tools._definition import InterruptBehavior as InterruptBehavior
    from ._tools._definition import SideEffect as SideEffect
    from ._tools._definition import Tool as Tool
    from ._tools._definition import ToolKind as ToolKind
    from ._tools._definition import define_tool as define_tool
    from ._tools._results import Progress as Progress
    from ._tools._results import ToolErrorType as ToolErrorType
    from ._tools._results import ToolFailure as ToolFailure
    from ._tools._results import ToolMessage as ToolMessage
    from ._tools._results import ToolResult as ToolResult

__all__ = [
    "AbortReason",
    "AgentSpec",
    "AuthenticationError",
    "ConfigError",
    "DoneEvent",
    "HookError",
    "HookEvent",
    "HookInput",
    "HookOutput",
    "InterruptBehavior",
    "JournalError",
    "LeaseLostError",
    "MiddlewareConfig",
    "MiddlewareError",
    "ModelError",
    "ModelMiddleware",
    "ModelTimeoutError",
    "PausedReply",
    "PermissionAllow",
    "PermissionAsk",
    "PermissionDeniedEvent",
    "PermissionDeny",
    "PermissionMode",
    "PermissionRequest",
    "PermissionRules",
    "PermissionUpdate",
    "Plugin",
    "Priority",
    "Progress",
    "Provider",
    "ProviderError",
    "RateLimitError",
    "RequestAbortedError",
    "Session",
    "SessionBusyError",
    "SessionClosedError",
    "SessionError",
    "SessionEvent",
    "SessionEventStream",
    "SessionPausedError",
    "SideEffect",
    "StopReason",
    "SubagentDefinition",
    "SubagentEvent",
    "SubagentHandle",
    "SubagentStatus",
    "TextDeltaEvent",
    "Tool",
    "ToolContext",
    "ToolDefinitionError",
    "ToolErrorType",
    "ToolFailure",
    "ToolInputError",
    "ToolKind",
    "ToolMessage",
    "ToolMiddleware",
    "ToolProgressEvent",
    "ToolResult",
    "ToolResultEvent",
    "ToolUseEvent",
    "TrioAgentError",
    "UnfinishedRequestError",
    "UnknownSubagentError",
    "UsageEvent",
    "chat",
    "create_provider",
    "define_agent",
    "define_plugin",
    "define_tool",
    "open_session",
]

# Every top-level name loads on first use, so ``import trio_agent`` stays cheap and a program
# pays only for what it touches (the providers import an HTTP client, the stores a database).
_LAZY: dict[str, str] = {
    "AbortReason": "trio_agent._abort",
    "chat": "trio_agent._chat._chat",
    "AuthenticationError": "trio_agent._errors",
    "ConfigError": "trio_agent._errors",
    "HookError": "trio_agent._errors",
    "JournalError": "trio_agent._errors",
    "LeaseLostError": "trio_agent._errors",
    "MiddlewareError": "trio_agent._errors",
    "ModelError": "trio_agent._errors",
    "ModelTimeoutError": "trio_agent._errors",
    "ProviderError": "trio_agent._errors",
    "RateLimitError": "trio_agent._errors",
    "RequestAbortedError": "trio_agent._errors",
    "SessionBusyError": "trio_agent._errors",
    "SessionClosedError": "trio_agent._errors",
    "SessionError": "trio_agent._errors",
    "SessionPausedError": "trio_agent._errors",
    "ToolDefinitionError": "trio_agent._errors",
    "ToolInputError": "trio_agent._errors",
    "TrioAgentError": "trio_agent._errors",
    "UnfinishedRequestError": "trio_agent._errors",
    "UnknownSubagentError": "trio_agent._errors",
    "StopReason": "trio_agent._loop._rules",
    "ModelMiddleware": "trio_agent._models._service",
    "Provider": "trio_agent._models._service",
    "PermissionRequest": "trio_agent._permissions._engine",
    "PermissionAllow": "trio_agent._permissions._rules",
    "PermissionAsk": "trio_agent._permissions._rules",
    "PermissionDeny": "trio_agent._permissions._rules",
    "PermissionMode": "trio_agent._permissions._rules",
    "PermissionRules": "trio_agent._permissions._rules",
    "PermissionUpdate": "trio_agent._permissions._rules",
    "HookEvent": "trio_agent._session._hooks",
    "HookInput": "trio_agent._session._hooks",
    "HookOutput": "trio_agent._session._hooks",
    "DoneEvent": "trio_agent._session._messages",
    "PausedReply": "trio_agent._session._messages",
    "PermissionDeniedEvent": "trio_agent._session._messages",
    "SessionEvent": "trio_agent._session._messages",
    "SubagentEvent": "trio_agent._session._messages",
    "SubagentStatus": "trio_agent._session._messages",
    "TextDeltaEvent": "trio_agent._session._messages",
    "ToolProgressEvent": "trio_agent._session._messages",
    "ToolResultEvent": "trio_agent._session._messages",
    "ToolUseEvent": "trio_agent._session._messages",
    "UsageEvent": "trio_agent._session._messages",
    "open_session": "trio_agent._session._open",
    "MiddlewareConfig": "trio_agent._session._plugins",
    "Plugin": "trio_agent._session._plugins",
    "define_plugin": "trio_agent._session._plugins",
    "Priority": "trio_agent._session._requests",
    "Session": "trio_agent._session._session",
    "AgentSpec": "trio_agent._session._spec",
    "define_agent": "trio_agent._session._spec",
    "SessionEventStream": "trio_agent._session._stream",
    "SubagentDefinition": "trio_agent._session._subagents",
    "SubagentHandle": "trio_agent._session._subagents",
    "ToolMiddleware": "trio_agent._tools._chain",
    "ToolContext": "trio_agent._tools._context",
    "InterruptBehavior": "trio_agent._tools._definition",
    "SideEffect": "trio_agent._tools._definition",
    "Tool": "trio_agent._tools._definition",
    "ToolKind": "trio_agent._tools._definition",
    "define_tool": "trio_agent._tools._definition",
    "Progress": "trio_agent._tools._results",
    "ToolErrorType": "trio_agent._tools._results",
    "ToolFailure": "trio_agent._tools._results",
    "ToolMessage": "trio_agent._tools._results",
    "ToolResult": "trio_agent._tools._results",
    "create_provider": "trio_agent._models._providers",
}

_SUBMODULES = frozenset(
    {"journal", "lifecycle", "middleware", "models", "permissions", "plugins", "testing", "tools", "workers"}
)

# Names that were top-level before the public face was cut down (issue 16), and the module
# that holds each now. They still resolve as ``trio_agent.<name>`` (not in ``__all__`` or
# ``dir()``); new code imports them from the module named here.
_MOVED: dict[str, str] = {
    **dict.fromkeys(
        [
            "Abort",
            "AbortHandle",
            "Allow",
            "BehaviorOverride",
            "CallNext",
            "CallOrigin",
            "Deny",
            "Effect",
            "Emit",
            "ExecutionContext",
            "FaultCode",
            "FileLockManager",
            "FileLockTimeoutError",
            "InMemoryToolJournal",
            "JsonObject",
            "MiddlewareFault",
            "PostStage",
            "ScheduledCall",
            "SchedulerLimits",
            "Settlement",
            "SettlementError",
            "SettlementStatus",
            "Stage",
            "StageRequest",
            "ToolBehavior",
            "ToolBehaviorError",
            "ToolCall",
            "ToolError",
            "ToolExecutionRecord",
            "ToolItem",
            "ToolMiddlewareRequest",
            "ToolPipeline",
            "ToolScheduler",
            "ToolStages",
        ],
        "trio_agent.tools",
    ),
    **dict.fromkeys(
        [
            "PROVIDER_NAMES",
            "AnthropicProvider",
            "AssistantMessage",
            "ContentPart",
            "FinishChunk",
            "FinishReason",
            "HistoryError",
            "MalformedResponseError",
            "Message",
            "ModelAbortedError",
            "ModelConnectionError",
            "ModelMiddlewareError",
            "ModelNotFoundError",
            "ModelRequest",
            "ModelResponse",
            "ModelService",
            "OpenAIProvider",
            "Operation",
            "ProviderConfigError",
            "ProviderServerError",
            "ReasoningDelta",
            "ReasoningPart",
            "RetryEvent",
            "RetryPolicy",
            "StreamChunk",
            "StreamInterruptedError",
            "SystemMessage",
            "TextDelta",
            "TextPart",
            "ToolCallDelta",
            "ToolCallEnd",
            "ToolCallPart",
            "ToolCallStart",
            "ToolResultMessage",
            "ToolSpec",
            "Usage",
            "UsageChunk",
            "UserMessage",
            "message_converter",
        ],
        "trio_agent.models",
    ),
    **dict.fromkeys(
        [
            "CaughtUp",
            "CommandConflictError",
            "CursorError",
            "DurableEvent",
            "DurableJournal",
            "ForeignStreamError",
            "InvalidTransitionError",
            "JournalCorruptError",
            "JournalCursor",
            "JournalFencedError",
            "JournalStore",
            "JournalUnavailableError",
            "LeaseHeldError",
            "MemoryStore",
            "RecoveryReport",
            "SQLiteStore",
            "SequenceConflictError",
            "StaleFencingTokenError",
            "open_journal",
            "open_postgres_store",
            "open_sqlite_store",
            "subscribe_durable_events",
        ],
        "trio_agent.journal",
    ),
    **dict.fromkeys(["PathPolicy", "ToolFilter"], "trio_agent.permissions"),
    **dict.fromkeys(
        [
            "HookAbortedError",
            "HookAction",
            "HookInterruptedError",
            "HookReturnError",
            "HookTimeoutError",
            "TrustLevel",
        ],
        "trio_agent.plugins",
    ),
    **dict.fromkeys(
        ["Middleware", "MiddlewareNext", "MiddlewareShapeError", "NextCalledTwiceError", "compose_middleware"],
        "trio_agent.middleware",
    ),
    **dict.fromkeys(["RoutedSubagentPersistence", "SubagentRunInfo", "SubagentRunResult"], "trio_agent.lifecycle"),
    # Made private (LOOP.md §10): still reachable, no longer documented.
    "HookDecision": "trio_agent._session._hooks",
    "JournalEntry": "trio_agent._tools._journal",
    # Renamed (the word "lifecycle" now means chat middleware): the old name still resolves.
    "ToolLifecycle": "trio_agent.tools",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _import_lazy(__name__, _LAZY, name, globals())
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _MOVED:
        value = getattr(importlib.import_module(_MOVED[name]), name)
        globals()[name] = value  # found once: a moved name read in a loop costs no import each time
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES} - _MOVED.keys())  # a moved name read once is cached
