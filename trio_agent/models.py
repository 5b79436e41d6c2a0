"""Models: messages, stream chunks, the model service and the providers.

An application names a model with `trio_agent.create_provider` (or passes any
`trio_agent.Provider`); this module holds the conversation types, the `ModelService`
(retries, middleware, abort; `waiting_for_reader` keeps a wait on a stream's reader out of
its deadline), the model middleware protocols (`ModelMiddleware` and one per
hook: `WrapsChat`, `WrapsSideQuery`, `WrapsStream`, `WrapsChatWithRetryEvents`; their
``call_next`` types `ChatNext`, `StreamNext`, `EventsNext`) and the concrete providers.
`OpenAIProvider`, `AnthropicProvider` and `PROVIDER_NAMES` load their HTTP client on first use::

    from trio_agent.models import ModelService, UserMessage
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import (
    HistoryError,
    MalformedResponseError,
    ModelAbortedError,
    ModelConnectionError,
    ModelMiddlewareError,
    ModelNotFoundError,
    ProviderConfigError,
    ProviderServerError,
    StreamInterruptedError,
)
from ._models._messages import (
    AssistantMessage,
    ContentPart,
    FinishChunk,
    FinishReason,
    Message,
    ModelResponse,
    ReasoningDelta,
    ReasoningPart,
    StreamChunk,
    SystemMessage,
    TextDelta,
    TextPart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallPart,
    ToolCallStart,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UsageChunk,
    UserMessage,
    message_converter,
)
from ._models._service import (
    ChatNext,
    EventsNext,
    ModelMiddleware,
    ModelRequest,
    ModelService,
    Operation,
    RetryEvent,
    RetryPolicy,
    StreamNext,
    WrapsChat,
    WrapsChatWithRetryEvents,
    WrapsSideQuery,
    WrapsStream,
    waiting_for_reader,
)
from ._util import fixup_module_metadata as _fixup_module_metadata
from ._util import import_lazy as _import_lazy

if TYPE_CHECKING:
    from ._models._anthropic import AnthropicProvider
    from ._models._openai import OpenAIProvider
    from ._models._providers import PROVIDER_NAMES

# The providers import httpx: loaded on first use.
_LAZY: dict[str, str] = {
    "AnthropicProvider": "trio_agent._models._anthropic",
    "OpenAIProvider": "trio_agent._models._openai",
    "PROVIDER_NAMES": "trio_agent._models._providers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _import_lazy(__name__, _LAZY, name, globals())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PROVIDER_NAMES",
    "AnthropicProvider",
    "AssistantMessage",
    "ChatNext",
    "ContentPart",
    "EventsNext",
    "FinishChunk",
    "FinishReason",
    "HistoryError",
    "MalformedResponseError",
    "Message",
    "ModelAbortedError",
    "ModelConnectionError",
    "ModelMiddleware",
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
    "StreamNext",
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
    "WrapsChat",
    "WrapsChatWithRetryEvents",
    "WrapsSideQuery",
    "WrapsStream",
    "message_converter",
    "waiting_for_reader",
]

_fixup_module_metadata(__name__, globals())
