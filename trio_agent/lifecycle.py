"""Chat middleware and the loop's lifecycle hooks: the public names.

Write middleware by subclassing `ChatMiddleware` (or with `define_chat_middleware`)
and hand a list of them to a chat run; `middleware_lifecycle` is what turns that
list into the loop's `Lifecycle`. See ``docs/lifecycle.md``::

    from trio_agent.lifecycle import ChatMiddleware, DROP, TransformArgs
"""

from __future__ import annotations

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
from ._loop._compose import LifecycleHookError, compose_lifecycle
from ._loop._context import RetryNotAllowedError, RunContext
from ._loop._hooks import NO_HOOKS, Finished, Lifecycle, ModelConfig, Phase, ToolOutcome

__all__ = [
    "DROP",
    "HOOK_NAMES",
    "NO_HOOKS",
    "AbortInfo",
    "AbortRun",
    "AfterToolCallDecision",
    "AfterToolCallInfo",
    "BeforeToolCallDecision",
    "ChatMiddleware",
    "ChunkDecision",
    "ConfigChange",
    "Drop",
    "ErrorInfo",
    "FinishInfo",
    "Finished",
    "GuardToolCallDecision",
    "IterationInfo",
    "Lifecycle",
    "LifecycleHookError",
    "MiddlewareDecisionError",
    "ModelConfig",
    "Phase",
    "Refuse",
    "ReplaceResult",
    "RetryNotAllowedError",
    "RunContext",
    "Skip",
    "ToolCallInfo",
    "ToolOutcome",
    "ToolPhaseCompleteInfo",
    "TransformArgs",
    "apply_structured_output_config",
    "compose_lifecycle",
    "define_chat_middleware",
    "middleware_lifecycle",
]
