"""trio_agent: a Trio-native structured-concurrency runtime for LLM agents.

The public API is re-exported here; everything else lives in private modules.
"""

from __future__ import annotations

from ._abort import Abort as Abort
from ._abort import AbortHandle as AbortHandle
from ._abort import AbortReason as AbortReason
from ._errors import AuthenticationError as AuthenticationError
from ._errors import ConfigError as ConfigError
from ._errors import FileLockTimeoutError as FileLockTimeoutError
from ._errors import HistoryError as HistoryError
from ._errors import JournalError as JournalError
from ._errors import LeaseLostError as LeaseLostError
from ._errors import MalformedResponseError as MalformedResponseError
from ._errors import MiddlewareError as MiddlewareError
from ._errors import MiddlewareShapeError as MiddlewareShapeError
from ._errors import ModelAbortedError as ModelAbortedError
from ._errors import ModelConnectionError as ModelConnectionError
from ._errors import ModelError as ModelError
from ._errors import ModelMiddlewareError as ModelMiddlewareError
from ._errors import ModelNotFoundError as ModelNotFoundError
from ._errors import ModelTimeoutError as ModelTimeoutError
from ._errors import NextCalledTwiceError as NextCalledTwiceError
from ._errors import ProviderConfigError as ProviderConfigError
from ._errors import ProviderError as ProviderError
from ._errors import ProviderServerError as ProviderServerError
from ._errors import RateLimitError as RateLimitError
from ._errors import SettlementError as SettlementError
from ._errors import StreamInterruptedError as StreamInterruptedError
from ._errors import ToolBehaviorError as ToolBehaviorError
from ._errors import ToolDefinitionError as ToolDefinitionError
from ._errors import ToolInputError as ToolInputError
from ._errors import TrioAgentError as TrioAgentError
from ._middleware import Middleware as Middleware
from ._middleware import MiddlewareNext as MiddlewareNext
from ._middleware import compose_middleware as compose_middleware
from ._models._anthropic import AnthropicProvider as AnthropicProvider
from ._models._messages import AssistantMessage as AssistantMessage
from ._models._messages import ContentPart as ContentPart
from ._models._messages import FinishChunk as FinishChunk
from ._models._messages import FinishReason as FinishReason
from ._models._messages import Message as Message
from ._models._messages import ModelResponse as ModelResponse
from ._models._messages import ReasoningDelta as ReasoningDelta
from ._models._messages import ReasoningPart as ReasoningPart
from ._models._messages import StreamChunk as StreamChunk
from ._models._messages import SystemMessage as SystemMessage
from ._models._messages import TextDelta as TextDelta
from ._models._messages import TextPart as TextPart
from ._models._messages import ToolCallDelta as ToolCallDelta
from ._models._messages import ToolCallEnd as ToolCallEnd
from ._models._messages import ToolCallPart as ToolCallPart
from ._models._messages import ToolCallStart as ToolCallStart
from ._models._messages import ToolResultMessage as ToolResultMessage
from ._models._messages import ToolSpec as ToolSpec
from ._models._messages import Usage as Usage
from ._models._messages import UsageChunk as UsageChunk
from ._models._messages import UserMessage as UserMessage
from ._models._messages import message_converter as message_converter
from ._models._openai import OpenAIProvider as OpenAIProvider
from ._models._providers import PROVIDER_NAMES as PROVIDER_NAMES
from ._models._providers import create_provider as create_provider
from ._models._service import ModelMiddleware as ModelMiddleware
from ._models._service import ModelRequest as ModelRequest
from ._models._service import ModelService as ModelService
from ._models._service import Operation as Operation
from ._models._service import Provider as Provider
from ._models._service import RetryEvent as RetryEvent
from ._models._service import RetryPolicy as RetryPolicy
from ._tools._context import CallOrigin as CallOrigin
from ._tools._context import Emit as Emit
from ._tools._context import ExecutionContext as ExecutionContext
from ._tools._context import ToolCall as ToolCall
from ._tools._context import ToolContext as ToolContext
from ._tools._context import ToolMiddlewareRequest as ToolMiddlewareRequest
from ._tools._definition import BehaviorOverride as BehaviorOverride
from ._tools._definition import InterruptBehavior as InterruptBehavior
from ._tools._definition import SideEffect as SideEffect
from ._tools._definition import Tool as Tool
from ._tools._definition import ToolBehavior as ToolBehavior
from ._tools._definition import ToolKind as ToolKind
from ._tools._definition import define_tool as define_tool
from ._tools._lifecycle import InMemoryToolJournal as InMemoryToolJournal
from ._tools._lifecycle import JournalEntry as JournalEntry
from ._tools._lifecycle import ScheduledCall as ScheduledCall
from ._tools._lifecycle import Settlement as Settlement
from ._tools._lifecycle import SettlementStatus as SettlementStatus
from ._tools._lifecycle import ToolLifecycle as ToolLifecycle
from ._tools._pipeline import CallNext as CallNext
from ._tools._pipeline import FaultCode as FaultCode
from ._tools._pipeline import MiddlewareFault as MiddlewareFault
from ._tools._pipeline import ToolExecutionRecord as ToolExecutionRecord
from ._tools._pipeline import ToolMiddleware as ToolMiddleware
from ._tools._pipeline import ToolPipeline as ToolPipeline
from ._tools._results import Effect as Effect
from ._tools._results import JsonObject as JsonObject
from ._tools._results import Progress as Progress
from ._tools._results import ToolError as ToolError
from ._tools._results import ToolErrorType as ToolErrorType
from ._tools._results import ToolFailure as ToolFailure
from ._tools._results import ToolItem as ToolItem
from ._tools._results import ToolMessage as ToolMessage
from ._tools._results import ToolResult as ToolResult
from ._tools._scheduler import FileLockManager as FileLockManager
from ._tools._scheduler import SchedulerLimits as SchedulerLimits
from ._tools._scheduler import ToolScheduler as ToolScheduler
from ._tools._stages import Allow as Allow
from ._tools._stages import Deny as Deny
from ._tools._stages import PostStage as PostStage
from ._tools._stages import Stage as Stage
from ._tools._stages import StageRequest as StageRequest
from ._tools._stages import ToolStages as ToolStages

__version__ = "0.1.0"


from ._chat._chat import chat as chat
from ._errors import CommandConflictError as CommandConflictError
from ._errors import CursorError as CursorError
from ._errors import ForeignStreamError as ForeignStreamError
from ._errors import InvalidTransitionError as InvalidTransitionError
from ._errors import JournalCorruptError as JournalCorruptError
from ._errors import JournalFencedError as JournalFencedError
from ._errors import JournalUnavailableError as JournalUnavailableError
from ._errors import LeaseHeldError as LeaseHeldError
from ._errors import RequestAbortedError as RequestAbortedError
from ._errors import SequenceConflictError as SequenceConflictError
from ._errors import SessionBusyError as SessionBusyError
from ._errors import SessionClosedError as SessionClosedError
from ._errors import SessionError as SessionError
from ._errors import StaleFencingTokenError as StaleFencingTokenError
from ._errors import UnknownSubagentError as UnknownSubagentError
from ._lifecycle._routing import RoutedSubagentPersistence as RoutedSubagentPersistence
from ._lifecycle._routing import SubagentRunInfo as SubagentRunInfo
from ._lifecycle._routing import SubagentRunResult as SubagentRunResult
from ._session._hooks import HookAbortedError as HookAbortedError
from ._session._hooks import HookAction as HookAction
from ._session._hooks import HookDecision as HookDecision
from ._session._hooks import HookError as HookError
from ._session._hooks import HookEvent as HookEvent
from ._session._hooks import HookInput as HookInput
from ._session._hooks import HookInterruptedError as HookInterruptedError
from ._session._hooks import HookOutput as HookOutput
from ._session._hooks import HookReturnError as HookReturnError
from ._session._hooks import HookTimeoutError as HookTimeoutError
from ._session._messages import DoneEvent as DoneEvent
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
from ._session._permissions import PathPolicy as PathPolicy
from ._session._permissions import PermissionAllow as PermissionAllow
from ._session._permissions import PermissionAsk as PermissionAsk
from ._session._permissions import PermissionDeny as PermissionDeny
from ._session._permissions import PermissionMode as PermissionMode
from ._session._permissions import PermissionRequest as PermissionRequest
from ._session._permissions import PermissionRules as PermissionRules
from ._session._permissions import PermissionUpdate as PermissionUpdate
from ._session._permissions import ToolFilter as ToolFilter
from ._session._plugins import MiddlewareConfig as MiddlewareConfig
from ._session._plugins import Plugin as Plugin
from ._session._plugins import TrustLevel as TrustLevel
from ._session._plugins import define_plugin as define_plugin
from ._session._session import Session as Session
from ._session._spec import AgentSpec as AgentSpec
from ._session._spec import define_agent as define_agent
from ._session._stream import SessionEventStream as SessionEventStream
from ._session._subagents import SubagentDefinition as SubagentDefinition
from ._session._subagents import SubagentHandle as SubagentHandle
from .journal import CaughtUp as CaughtUp
from .journal import DurableEvent as DurableEvent
from .journal import DurableJournal as DurableJournal
from .journal import JournalCursor as JournalCursor
from .journal import JournalStore as JournalStore
from .journal import MemoryStore as MemoryStore
from .journal import RecoveryReport as RecoveryReport
from .journal import SQLiteStore as SQLiteStore
from .journal import open_journal as open_journal
from .journal import open_postgres_store as open_postgres_store
from .journal import open_sqlite_store as open_sqlite_store
from .journal import subscribe_durable_events as subscribe_durable_events

__all__ = [
    "PROVIDER_NAMES",
    "Abort",
    "AbortHandle",
    "AbortReason",
    "AgentSpec",
    "Allow",
    "AnthropicProvider",
    "AssistantMessage",
    "AuthenticationError",
    "BehaviorOverride",
    "CallNext",
    "CallOrigin",
    "CaughtUp",
    "CommandConflictError",
    "ConfigError",
    "ContentPart",
    "CursorError",
    "Deny",
    "DoneEvent",
    "DurableEvent",
    "DurableJournal",
    "Effect",
    "Emit",
    "ExecutionContext",
    "FaultCode",
    "FileLockManager",
    "FileLockTimeoutError",
    "FinishChunk",
    "FinishReason",
    "ForeignStreamError",
    "HistoryError",
    "HookAbortedError",
    "HookAction",
    "HookDecision",
    "HookError",
    "HookEvent",
    "HookInput",
    "HookInterruptedError",
    "HookOutput",
    "HookReturnError",
    "HookTimeoutError",
    "InMemoryToolJournal",
    "InterruptBehavior",
    "InvalidTransitionError",
    "JournalCorruptError",
    "JournalCursor",
    "JournalEntry",
    "JournalError",
    "JournalFencedError",
    "JournalStore",
    "JournalUnavailableError",
    "JsonObject",
    "LeaseHeldError",
    "LeaseLostError",
    "MalformedResponseError",
    "MemoryStore",
    "Message",
    "Middleware",
    "MiddlewareConfig",
    "MiddlewareError",
    "MiddlewareFault",
    "MiddlewareNext",
    "MiddlewareShapeError",
    "ModelAbortedError",
    "ModelConnectionError",
    "ModelError",
    "ModelMiddleware",
    "ModelMiddlewareError",
    "ModelNotFoundError",
    "ModelRequest",
    "ModelResponse",
    "ModelService",
    "ModelTimeoutError",
    "NextCalledTwiceError",
    "OpenAIProvider",
    "Operation",
    "PathPolicy",
    "PermissionAllow",
    "PermissionAsk",
    "PermissionDeniedEvent",
    "PermissionDeny",
    "PermissionMode",
    "PermissionRequest",
    "PermissionRules",
    "PermissionUpdate",
    "Plugin",
    "PostStage",
    "Progress",
    "Provider",
    "ProviderConfigError",
    "ProviderError",
    "ProviderServerError",
    "RateLimitError",
    "ReasoningDelta",
    "ReasoningPart",
    "RecoveryReport",
    "RequestAbortedError",
    "RetryEvent",
    "RetryPolicy",
    "RoutedSubagentPersistence",
    "SQLiteStore",
    "ScheduledCall",
    "SchedulerLimits",
    "SequenceConflictError",
    "Session",
    "SessionBusyError",
    "SessionClosedError",
    "SessionError",
    "SessionEvent",
    "SessionEventStream",
    "Settlement",
    "SettlementError",
    "SettlementStatus",
    "SideEffect",
    "Stage",
    "StageRequest",
    "StaleFencingTokenError",
    "StreamChunk",
    "StreamInterruptedError",
    "SubagentDefinition",
    "SubagentEvent",
    "SubagentHandle",
    "SubagentRunInfo",
    "SubagentRunResult",
    "SubagentStatus",
    "SystemMessage",
    "TextDelta",
    "TextDeltaEvent",
    "TextPart",
    "Tool",
    "ToolBehavior",
    "ToolBehaviorError",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallPart",
    "ToolCallStart",
    "ToolContext",
    "ToolDefinitionError",
    "ToolError",
    "ToolErrorType",
    "ToolExecutionRecord",
    "ToolFailure",
    "ToolFilter",
    "ToolInputError",
    "ToolItem",
    "ToolKind",
    "ToolLifecycle",
    "ToolMessage",
    "ToolMiddleware",
    "ToolMiddlewareRequest",
    "ToolPipeline",
    "ToolProgressEvent",
    "ToolResult",
    "ToolResultEvent",
    "ToolResultMessage",
    "ToolScheduler",
    "ToolSpec",
    "ToolStages",
    "ToolUseEvent",
    "TrioAgentError",
    "TrustLevel",
    "UnknownSubagentError",
    "Usage",
    "UsageChunk",
    "UsageEvent",
    "UserMessage",
    "chat",
    "compose_middleware",
    "create_provider",
    "define_agent",
    "define_plugin",
    "define_tool",
    "message_converter",
    "open_journal",
    "open_postgres_store",
    "open_session",
    "open_sqlite_store",
    "subscribe_durable_events",
]
