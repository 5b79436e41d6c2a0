"""Chat middleware and the loop's lifecycle hooks: the public names.

``chat()`` (exported from ``trio_agent``) runs the loop without a session and yields a
`ChatRun` of `RunEvent` s and a `ChatResult`. Write middleware by subclassing
`ChatMiddleware` (or with `define_chat_middleware`) and hand a list of them to a chat run
or a session (``lifecycle=``); `middleware_lifecycle` is what turns that
list into the loop's `Lifecycle`. Middleware share typed values through capabilities
(`create_capability`, ``requires`` / ``provides``; ``docs/capabilities.md``).
See ``docs/lifecycle.md``::

    from trio_agent.lifecycle import ChatMiddleware, DROP, TransformArgs
"""

from __future__ import annotations

from ._chat._chat import ChatResult, ChatRun, StructuredOutputError
from ._lifecycle._capabilities import (
    Capability,
    CapabilityError,
    CapabilityRegistry,
    create_capability,
    validate_capabilities,
)
from ._lifecycle._decisions import (
    DROP,
    AbortInfo,
    AbortRun,
    AfterToolCallDecision,
    AfterToolCallInfo,
    BeforeToolCallDecision,
    Drop,
    ErrorInfo,
    FinishInfo,
    GuardToolCallDecision,
    IterationInfo,
    MiddlewareDecisionError,
    Refuse,
    ReplaceResult,
    Skip,
    ToolCallInfo,
    ToolPhaseCompleteInfo,
    TransformArgs,
)
from ._lifecycle._middleware import (
    HOOK_NAMES,
    ChatMiddleware,
    ChunkDecision,
    ConfigChange,
    apply_structured_output_config,
    define_chat_middleware,
    middleware_lifecycle,
)
from ._lifecycle._routing import RoutedSubagentPersistence, SubagentRunInfo, SubagentRunResult
from ._loop._compose import LifecycleHookError, compose_lifecycle
from ._loop._context import RetryNotAllowedError, RunContext
from ._loop._events import (
    CustomEvent,
    ReasoningContent,
    ReasoningEnd,
    ReasoningStart,
    RunError,
    RunEvent,
    RunFinished,
    RunStarted,
    StepFinished,
    StepStarted,
    TextMessageContent,
    TextMessageEnd,
    TextMessageStart,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallProgress,
    ToolCallResult,
    ToolCallStart,
    UsageReported,
)
from ._loop._hooks import NO_HOOKS, Finished, Lifecycle, ModelConfig, Phase, ToolOutcome
from ._loop._rules import LoopState, LoopStrategy, StopReason, combine_strategies, max_iterations, until_finish_reason
from ._util import fixup_module_metadata as _fixup_module_metadata

__all__ = [
    "DROP",
    "HOOK_NAMES",
    "NO_HOOKS",
    "AbortInfo",
    "AbortRun",
    "AfterToolCallDecision",
    "AfterToolCallInfo",
    "BeforeToolCallDecision",
    "Capability",
    "CapabilityError",
    "CapabilityRegistry",
    "ChatMiddleware",
    "ChatResult",
    "ChatRun",
    "ChunkDecision",
    "ConfigChange",
    "CustomEvent",
    "Drop",
    "ErrorInfo",
    "FinishInfo",
    "Finished",
    "GuardToolCallDecision",
    "IterationInfo",
    "Lifecycle",
    "LifecycleHookError",
    "LoopState",
    "LoopStrategy",
    "MiddlewareDecisionError",
    "ModelConfig",
    "Phase",
    "ReasoningContent",
    "ReasoningEnd",
    "ReasoningStart",
    "Refuse",
    "ReplaceResult",
    "RetryNotAllowedError",
    "RoutedSubagentPersistence",
    "RunContext",
    "RunError",
    "RunEvent",
    "RunFinished",
    "RunStarted",
    "Skip",
    "StepFinished",
    "StepStarted",
    "StopReason",
    "StructuredOutputError",
    "SubagentRunInfo",
    "SubagentRunResult",
    "TextMessageContent",
    "TextMessageEnd",
    "TextMessageStart",
    "ToolCallArgs",
    "ToolCallEnd",
    "ToolCallInfo",
    "ToolCallProgress",
    "ToolCallResult",
    "ToolCallStart",
    "ToolOutcome",
    "ToolPhaseCompleteInfo",
    "TransformArgs",
    "UsageReported",
    "apply_structured_output_config",
    "combine_strategies",
    "compose_lifecycle",
    "create_capability",
    "define_chat_middleware",
    "max_iterations",
    "middleware_lifecycle",
    "until_finish_reason",
    "validate_capabilities",
]

_fixup_module_metadata(__name__, globals())
