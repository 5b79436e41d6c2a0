"""The model service: a provider wrapped with model middleware, one retry loop and deadlines.

::

    request deadline (outside everything)
      -> middleware that defines the operation's wrapper (first registered outermost;
         operation, model and abort handle checked at every boundary)
        -> retry loop (backoff with jitter, retry-after; never after a published chunk)
          -> provider

Streams are async context managers: ``async with service.stream(request) as chunks``.
Leaving the block closes every layer's iterator, outermost first, and then the
provider's HTTP response, before the block's exit returns.
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import random
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any, Protocol, runtime_checkable

import attrs
import trio

from .._abort import Abort, AbortHandle
from .._builders import constructor
from .._cleanup import DEFAULT_CLEANUP_GRACE, bounded_shield, validate_cleanup_grace
from .._config import MAX_TIMEOUT, finite_seconds, short_repr, validate_timeout
from .._errors import (
    ConfigError,
    MiddlewareShapeError,
    ModelAbortedError,
    ModelError,
    ModelMiddlewareError,
    ModelTimeoutError,
    ProviderError,
    StreamInterruptedError,
    TrioAgentError,
)
from .._groups import STRAY_CANCELLED, contains_cancelled, stray_cancellation, typed_error
from .._middleware import CheckedLayers, Composed, ComposedNext, MiddlewareNext, PassedChecks, compose_middleware
from .._reader_wait import FRAMES, Frame, HeldDeadline, waiting_for_reader
from .._util import describe
from ._history import MessageView
from ._messages import (
    MAX_TOKEN_COUNT,
    MESSAGE_CLASSES,
    AssistantMessage,
    FinishChunk,
    FinishReason,
    Message,
    ModelResponse,
    ReasoningDelta,
    ReasoningPart,
    StreamChunk,
    TextDelta,
    TextPart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallPart,
    ToolCallStart,
    ToolSpec,
    Usage,
    UsageChunk,
)

logger = logging.getLogger("trio_agent")

__all__ = [
    "ChatNext",
    "EventsNext",
    "ModelLayers",
    "ModelMiddleware",
    "ModelRequest",
    "ModelService",
    "Operation",
    "Provider",
    "RetryEvent",
    "RetryPolicy",
    "StreamNext",
    "WrapsChat",
    "WrapsChatWithRetryEvents",
    "WrapsSideQuery",
    "WrapsStream",
    "waiting_for_reader",
]


class Operation(enum.Enum):
    CHAT = "chat"
    SIDE_QUERY = "side_query"
    STREAM = "stream"
    CHAT_WITH_RETRY_EVENTS = "chat_with_retry_events"


def _message_tuple(messages: Iterable[Message]) -> Sequence[Message]:
    """*messages* as a tuple (kept as it is if it is one) of messages, else `ConfigError`.

    A session's copy-free view of its conversation is kept unchecked: the session checked every
    message it holds, and checking the whole conversation again every turn would cost O(n) a turn.
    Only the classes are checked here (a fast set lookup each); a history from outside has its
    fields checked where it comes in (`validate_history`)."""
    if type(messages) is MessageView:
        return messages
    if isinstance(messages, tuple):
        result = messages
    elif type(messages) is list:  # the common cases first: no ABC isinstance
        result = tuple(messages)
    elif isinstance(messages, str | bytes) or not isinstance(messages, Iterable):
        raise ConfigError(f"messages must be a sequence of messages, not {_what(messages)}")
    else:
        result = tuple(messages)
    for index, message in enumerate(result):
        if type(message) not in MESSAGE_CLASSES and not _is_kind(message, MESSAGE_CLASSES):
            raise ConfigError(
                f"messages[{index}] is not a message (SystemMessage, UserMessage, AssistantMessage or "
                f"ToolResultMessage): {_what(message)}"
            )
    return result


def _tool_tuple(tools: Iterable[ToolSpec]) -> tuple[ToolSpec, ...]:
    """*tools* as a tuple (kept as it is if it is one) of `ToolSpec`, else `ConfigError`."""
    if isinstance(tools, tuple):
        result = tools
    elif isinstance(tools, str | bytes) or not isinstance(tools, Iterable):
        raise ConfigError(f"tools must be a sequence of ToolSpec, not {_what(tools)}")
    else:
        result = tuple(tools)
    for index, tool in enumerate(result):
        if not isinstance(tool, ToolSpec):
            raise ConfigError(f"tools[{index}] is not a ToolSpec: {_what(tool)}")
    return result


def _mapping(value: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """``options`` / ``metadata`` as a dict of its own (``None``: empty), else `ConfigError`."""
    if value is None:
        return {}
    if type(value) is dict or isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(f"{name} must be a mapping (a dict) or None, not {_what(value)}")


def _options(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return _mapping(value, "options")


def _metadata(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return _mapping(value, "metadata")


def _what(item: object) -> str:
    """A wrong item, for an error message: its type and a short repr (reprlib.repr raised
    ValueError for an int too long to print)."""
    return "None" if item is None else f"{type(item).__name__} {short_repr(item)}"


def _is_kind(item: object, kinds: frozenset[type]) -> bool:
    return type(item) in kinds or isinstance(item, tuple(kinds))


@attrs.frozen(eq=False)
class ModelRequest:
    """One model call. Middleware may change ``messages``, ``tools`` and ``options`` (use `replace`);
    ``operation``, ``model`` and ``abort`` must stay."""

    operation: Operation
    model: str
    messages: Sequence[Message] = attrs.field(converter=_message_tuple)
    tools: tuple[ToolSpec, ...] = attrs.field(default=(), converter=_tool_tuple)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)
    abort: AbortHandle | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict, converter=_metadata)
    """Not sent to the provider: ids for tracing and routing (e.g. ``conversation_id``)."""

    def replace(
        self,
        *,
        messages: Sequence[Message] | None = None,
        tools: Sequence[ToolSpec] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> ModelRequest:
        # Each given field checked here (a ConfigError naming it), the kept ones as they are: they
        # were checked when this request was made.
        return _model_request(
            self.operation,
            self.model,
            self.messages if messages is None else _message_tuple(messages),
            self.tools if tools is None else _tool_tuple(tools),
            self.options if options is None else _mapping(options, "options"),
            self.abort,
            self.metadata,
        )


@attrs.frozen
class RetryEvent:
    """The service will retry: attempt ``attempt`` failed with ``error``; the next starts after ``delay`` s."""

    attempt: int
    delay: float
    error: ModelError


# What each iterator operation may yield, checked per item (a set lookup; isinstance only for a subclass).
_CHUNK_KINDS: frozenset[type] = frozenset(
    (TextDelta, ReasoningDelta, ToolCallStart, ToolCallDelta, ToolCallEnd, UsageChunk, FinishChunk)
)
_EVENT_KINDS: frozenset[type] = frozenset((RetryEvent, ModelResponse))
_KIND_NAMES = {_CHUNK_KINDS: "a stream chunk", _EVENT_KINDS: "a RetryEvent or the ModelResponse"}

# What each chunk's fields must be: (field, type, None allowed too). The class alone says nothing
# of them (attrs does not check), and a wrong one failed far from its source, as a bare error:
# TextDelta(None) in the assembler's join, FinishChunk("stop") in the journal.
_CHUNK_FIELDS: dict[type, tuple[tuple[str, type, bool], ...]] = {
    TextDelta: (("text", str, False),),
    ReasoningDelta: (("text", str, False), ("signature", str, True), ("redacted_data", str, True)),
    ToolCallStart: (("index", int, False), ("id", str, False), ("name", str, False)),
    ToolCallDelta: (("index", int, False), ("arguments", str, False)),
    ToolCallEnd: (("index", int, False), ("id", str, False), ("name", str, False), ("arguments", str, False)),
    UsageChunk: (("usage", Usage, False),),
    FinishChunk: (("reason", FinishReason, False), ("explanation", str, True)),
}
_MAX_INDEX = 2**53 - 1  # a call's stream index: a JSON number exact everywhere (and printable as an id)


def _chunk_ok(chunk: Any) -> bool:
    """Whether *chunk* is plainly a good stream chunk: of a chunk class exactly, each field of its
    type exactly (the rules of `_CHUNK_FIELDS` and `_usage_problem`). ``False`` is no verdict:
    `_chunk_problem` judges it (a subclass passes there) and says what is wrong.

    The fast answer, for what the callers' inline test of the usual chunk (a `TextDelta` whose
    text is exactly a ``str``) does not pass: one call and a few identity tests a chunk, the
    streamed kinds first (a call's argument pieces, reasoning pieces), then the few of a reply.
    `test_the_fast_chunk_check_and_the_explaining_one_agree` holds it to `_chunk_problem`."""
    kind = type(chunk)
    if kind is ToolCallDelta:
        index = chunk.index
        return type(index) is int and 0 <= index <= _MAX_INDEX and type(chunk.arguments) is str
    if kind is ReasoningDelta:
        signature, redacted = chunk.signature, chunk.redacted_data
        return (
            type(chunk.text) is str
            and (signature is None or type(signature) is str)
            and (redacted is None or type(redacted) is str)
        )
    # Start and end apart: an attribute read that sees two classes is not specialised (3.11).
    if kind is ToolCallStart:
        index = chunk.index
        return type(index) is int and 0 <= index <= _MAX_INDEX and type(chunk.id) is str and type(chunk.name) is str
    if kind is ToolCallEnd:
        index = chunk.index
        return (
            type(index) is int
            and 0 <= index <= _MAX_INDEX
            and type(chunk.id) is str
            and type(chunk.name) is str
            and type(chunk.arguments) is str
        )
    if kind is UsageChunk:
        usage = chunk.usage
        return type(usage) is Usage and _usage_ok(usage)
    if kind is FinishChunk:
        explanation = chunk.explanation
        return type(chunk.reason) is FinishReason and (explanation is None or type(explanation) is str)
    return kind is TextDelta and type(chunk.text) is str


def _chunk_problem(chunk: object) -> str | None:
    """What is wrong with *chunk* as a stream chunk, as ``<what it is>, not <what it should be>``
    (``None``: nothing): it must be of a chunk class (or a subclass) with each field of its type.
    For what `_chunk_ok` does not pass at once."""
    kind = type(chunk)
    fields = _CHUNK_FIELDS.get(kind)
    if fields is None:
        base = next((known for known in _CHUNK_FIELDS if isinstance(chunk, known)), None)
        if base is None:
            return f"{_what(chunk)}, not a stream chunk"
        fields = _CHUNK_FIELDS[base]
    for name, expected, optional in fields:
        value = getattr(chunk, name)
        if value is None and optional:
            continue
        if expected is int:
            good = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_INDEX
        else:
            good = isinstance(value, expected)
        if not good:
            wanted = f"an int from 0 to {_MAX_INDEX}" if expected is int else f"a {expected.__name__}"
            return f"a {kind.__name__} whose {name} is {_what(value)}, not {wanted}{' or None' if optional else ''}"
        if expected is Usage:
            problem = _usage_problem(value)
            if problem is not None:
                return f"a {kind.__name__} whose {name}.{problem}"
    return None


_USAGE_COUNTS = (
    ("input_tokens", False),
    ("output_tokens", False),
    ("total_tokens", False),
    ("cached_input_tokens", True),
    ("cache_creation_input_tokens", True),
    ("reasoning_tokens", True),
)


def _usage_problem(usage: Usage) -> str | None:
    """What is wrong with *usage*'s counts, as ``<field> is <what>, not <what it should be>``
    (``None``: nothing). A count must be an int from 0 to `MAX_TOKEN_COUNT` (the details may be
    ``None``): the journal reads a count back as an int only, so a float (a JSON ``3.0``) recorded
    made every later reopening of the session fail (`JournalCorruptError`)."""
    for name, optional in _USAGE_COUNTS:
        value = getattr(usage, name)
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKEN_COUNT:
            return f"{name} is {_what(value)}, not an int from 0 to {MAX_TOKEN_COUNT}{' or None' if optional else ''}"
    return None


# What each content part's fields must be, as `_CHUNK_FIELDS` says of the chunks that stream them.
_PART_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {
    TextPart: (("text", False),),
    ReasoningPart: (("text", False), ("signature", True), ("redacted_data", True)),
    ToolCallPart: (("id", False), ("name", False), ("arguments", False)),
}
# A response's own fields besides message and usage: (field, None allowed too); each a str.
_RESPONSE_STRINGS = (("model", False), ("id", False), ("finish_explanation", True))


def _usage_ok(usage: Usage) -> bool:
    """Whether *usage*'s counts are plainly good (`_usage_problem` says what is wrong), for a
    `UsageChunk` and a reply alike: a few times cheaper than the explaining loop."""
    high = MAX_TOKEN_COUNT
    inputs, outputs, total = usage.input_tokens, usage.output_tokens, usage.total_tokens
    cached, created, reasoning = usage.cached_input_tokens, usage.cache_creation_input_tokens, usage.reasoning_tokens
    return (
        type(inputs) is int
        and type(outputs) is int
        and type(total) is int
        and 0 <= inputs <= high
        and 0 <= outputs <= high
        and 0 <= total <= high
        and (cached is None or (type(cached) is int and 0 <= cached <= high))
        and (created is None or (type(created) is int and 0 <= created <= high))
        and (reasoning is None or (type(reasoning) is int and 0 <= reasoning <= high))
    )


def _response_ok(response: ModelResponse) -> bool:
    """Whether *response* is plainly a good reply: every field of its type exactly (the rules of
    `_response_problem`). ``False`` is no verdict: `_response_problem` judges it (a subclass
    passes there) and says what is wrong. A few identity tests a field and a part."""
    message = response.message
    usage = response.usage
    explanation = response.finish_explanation
    if (
        type(message) is not AssistantMessage
        or type(response.finish_reason) is not FinishReason
        or type(response.model) is not str
        or type(response.id) is not str
        or (explanation is not None and type(explanation) is not str)
        or type(usage) is not Usage
        or not _usage_ok(usage)
    ):
        return False
    parts: tuple[Any, ...] = message.parts  # (Any: a part is told by its exact type, not narrowed)
    if type(parts) is not tuple:
        return False
    for part in parts:
        kind = type(part)
        if kind is TextPart:
            if type(part.text) is not str:
                return False
        elif kind is ToolCallPart:
            if type(part.id) is not str or type(part.name) is not str or type(part.arguments) is not str:
                return False
        elif kind is ReasoningPart:
            signature, redacted = part.signature, part.redacted_data
            if (
                type(part.text) is not str
                or (signature is not None and type(signature) is not str)
                or (redacted is not None and type(redacted) is not str)
            ):
                return False
        else:
            return False
    return True


def _response_problem(response: ModelResponse) -> str | None:
    """What is wrong with *response*, as ``<field> is <what>, not <what it should be>`` (``None``:
    nothing): ``message`` an `AssistantMessage` whose parts are content parts with each field of
    its type (as the chunks that stream them are checked), ``finish_reason`` a `FinishReason`,
    ``model`` and ``id`` strings, ``finish_explanation`` a string or ``None``, and ``usage`` held
    to the rule a streamed `UsageChunk` is (`_usage_problem`), since a reply goes to the same
    totals, journal and readers whether it was streamed or not. A subclass of a type passes."""
    if _response_ok(response):
        return None
    message = response.message
    if not isinstance(message, AssistantMessage):
        return f"message is {_what(message)}, not an AssistantMessage"
    parts = message.parts
    if not isinstance(parts, tuple):
        return f"message.parts is {_what(parts)}, not a tuple of content parts"
    for number, part in enumerate(parts):
        base = next((known for known in _PART_FIELDS if isinstance(part, known)), None)
        if base is None:
            return f"message.parts[{number}] is {_what(part)}, not a TextPart, ReasoningPart or ToolCallPart"
        for name, optional in _PART_FIELDS[base]:
            problem = _not_text(getattr(part, name), optional)
            if problem is not None:
                return f"message.parts[{number}].{name} is {problem}"
    reason = response.finish_reason
    if not isinstance(reason, FinishReason):
        return f"finish_reason is {_what(reason)}, not a FinishReason"
    for name, optional in _RESPONSE_STRINGS:
        problem = _not_text(getattr(response, name), optional)
        if problem is not None:
            return f"{name} is {problem}"
    usage = response.usage
    if not isinstance(usage, Usage):
        return f"usage is {_what(usage)}, not a Usage"
    problem = _usage_problem(usage)
    return None if problem is None else f"usage.{problem}"


def _not_text(value: object, optional: bool) -> str | None:
    """What *value* is when it is no str (nor None, where *optional*), for a message; else None."""
    if isinstance(value, str) or (optional and value is None):
        return None
    return f"{_what(value)}, not a str{' or None' if optional else ''}"


def _told(exc: BaseException) -> str:
    """User code's exception in a message (`describe`), a `stray_cancellation` said to be one."""
    told = describe(exc, "repr")
    return f"{told} {STRAY_CANCELLED}" if contains_cancelled(exc) else told


def _middleware_failure(exc: BaseException) -> ModelError:
    """What a non-`ModelError` escaping the model middleware fails the call with: a `ModelError`
    inside a group (a layer awaited ``call_next`` in its own nursery) is the call's error, as it
    would be without the nursery; anything else is a middleware bug, typed with it as the cause
    (a `stray_cancellation` too: a ``Cancelled`` nothing around the call made)."""
    if isinstance(exc, BaseExceptionGroup):
        typed = typed_error(exc)
        if isinstance(typed, ModelError):
            return typed
    error = ModelMiddlewareError(f"model middleware raised {_told(exc)}")
    error.__cause__ = exc
    return error


def _provider_failure(exc: BaseException, when: str = "") -> ModelError:
    """What anything but a `ModelError` that the provider raised fails the call with (a provider
    bug, typed with it as the cause; a `stray_cancellation` too)."""
    error = ModelError(f"the provider raised {_told(exc)}{when}", code="provider_failed")
    error.__cause__ = exc
    return error


@runtime_checkable
class Provider(Protocol):
    """A model backend. ``stream`` returns an async iterator whose ``aclose()`` releases the HTTP response."""

    name: str
    model: str

    async def chat(self, request: ModelRequest) -> ModelResponse: ...

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]: ...

    def with_model(self, model: str) -> Provider: ...


_PROVIDER_MEMBERS = ("model", "chat", "stream")


def is_provider(value: object) -> bool:
    """Whether *value* has what a `ModelService` reads of its provider: ``model``, ``chat`` and
    ``stream`` (a provider class has no ``model``: it is set on the instance)."""
    return hasattr(value, "stream") and hasattr(value, "chat") and hasattr(value, "model")


def not_a_provider(who: str, value: object, wanted: str = "a model provider") -> str:
    """The error message for *value* given to *who* as a provider (`is_provider` said no)."""
    if isinstance(value, type):
        return f"{who} needs {wanted}, got the class {value.__name__}: pass an instance, {value.__name__}(...)"
    missing = [name for name in _PROVIDER_MEMBERS if not hasattr(value, name)]
    lacks = " or ".join((", ".join(missing[:-1]), missing[-1])) if len(missing) > 1 else missing[0]
    return (
        f"{who} needs {wanted}, got {_what(value)}, which has no {lacks} (a provider has model, chat and "
        "stream: OpenAIProvider, AnthropicProvider, TestModel ...)"
    )


ChatNext = MiddlewareNext[ModelRequest, Awaitable[ModelResponse]]
"""``call_next`` in `WrapsChat.wrap_chat` and `WrapsSideQuery.wrap_side_query`: ``await call_next(request)``."""

StreamNext = MiddlewareNext[ModelRequest, AsyncIterator[StreamChunk]]
"""``call_next`` in `WrapsStream.wrap_stream`: ``async for chunk in call_next(request)``."""

EventsNext = MiddlewareNext[ModelRequest, AsyncIterator[RetryEvent | ModelResponse]]
"""``call_next`` in `WrapsChatWithRetryEvents.wrap_chat_with_retry_events`: iterate it."""


class ModelMiddleware(Protocol):
    """Model middleware: any object that defines one or more of the four wrappers.

    ================================  ==================================================
    ``wrap_chat``                     ``async def wrap_chat(self, request, call_next) -> ModelResponse``
    ``wrap_side_query``               ``async def wrap_side_query(self, request, call_next) -> ModelResponse``
    ``wrap_stream``                   async generator of `StreamChunk`, iterating ``call_next(request)``
    ``wrap_chat_with_retry_events``   async generator of `RetryEvent` and the `ModelResponse`
    ================================  ==================================================

    Python typing has no optional protocol members, so this protocol requires none: a plain
    class (no base class) with only the wrappers it needs is a ``ModelMiddleware``. Each wrapper
    also has its own protocol (`WrapsChat`, `WrapsSideQuery`, `WrapsStream`,
    `WrapsChatWithRetryEvents`); list them as bases to have a type checker check the wrappers'
    signatures. Subclassing ``ModelMiddleware`` itself is allowed and changes nothing.

    Each operation composes only the middleware that define its wrapper, first registered
    outermost. ``call_next`` is the same word as in tool middleware (one onion, one word):
    ``call_next(request)`` runs the inner layers and the provider, ``call_next()`` passes the
    request on unchanged. An object that defines none of the wrappers, or a wrapper of the wrong
    kind, is a `MiddlewareShapeError` when the `ModelService` is built.
    """


class WrapsChat(ModelMiddleware, Protocol):
    """Model middleware with ``wrap_chat``: wraps `ModelService.chat`."""

    async def wrap_chat(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse: ...


class WrapsSideQuery(ModelMiddleware, Protocol):
    """Model middleware with ``wrap_side_query``: wraps `ModelService.side_query`."""

    async def wrap_side_query(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse: ...


class WrapsStream(ModelMiddleware, Protocol):
    """Model middleware with ``wrap_stream`` (an async generator): wraps `ModelService.stream`."""

    def wrap_stream(self, request: ModelRequest, call_next: StreamNext) -> AsyncIterator[StreamChunk]: ...


class WrapsChatWithRetryEvents(ModelMiddleware, Protocol):
    """Model middleware with ``wrap_chat_with_retry_events`` (an async generator)."""

    def wrap_chat_with_retry_events(
        self, request: ModelRequest, call_next: EventsNext
    ) -> AsyncIterator[RetryEvent | ModelResponse]: ...


_WRAPPERS = {
    Operation.CHAT: "wrap_chat",
    Operation.SIDE_QUERY: "wrap_side_query",
    Operation.STREAM: "wrap_stream",
    Operation.CHAT_WITH_RETRY_EVENTS: "wrap_chat_with_retry_events",
}
_WRAPPER_NAMES = ", ".join(_WRAPPERS.values())
_ASYNC_WRAPPERS = ("wrap_chat", "wrap_side_query")
_ITERATOR_WRAPPERS = ("wrap_stream", "wrap_chat_with_retry_events")

# The wrapper protocols' stubs: a class that lists a protocol as a base but does not define its
# wrapper inherits the stub, which does not count as defining it.
_STUBS = frozenset(
    vars(protocol)[name]
    for protocol, name in (
        (WrapsChat, "wrap_chat"),
        (WrapsSideQuery, "wrap_side_query"),
        (WrapsStream, "wrap_stream"),
        (WrapsChatWithRetryEvents, "wrap_chat_with_retry_events"),
    )
)


def _defines(layer: object, name: str) -> bool:
    """Whether *layer* defines the wrapper *name* (an attribute that is not ``None`` or a protocol stub)."""
    wrapper = getattr(layer, name, None)
    return wrapper is not None and getattr(wrapper, "__func__", wrapper) not in _STUBS


def _describe(layer: object) -> str:
    """How an error names a middleware: its class, or what it is when it is a class or a function."""
    if isinstance(layer, type):
        return f"class {layer.__qualname__}"
    if inspect.isroutine(layer):
        return f"{type(layer).__name__} {getattr(layer, '__qualname__', layer)}"
    return type(layer).__qualname__


def model_middleware_problem(layer: object) -> str | None:
    """What is wrong with *layer* as model middleware (``None`` if nothing), as ``(what it is) problem``.

    These are the checks `ModelService` makes once, at construction: the per-call path checks nothing.
    """
    what = f"({_describe(layer)})"
    if isinstance(layer, type) and any(_defines(layer, name) for name in _WRAPPERS.values()):
        return f"{what} is a class, not an instance: pass {layer.__qualname__}(...)"
    if not any(_defines(layer, name) for name in _WRAPPERS.values()):
        return f"{what} defines none of the model middleware wrappers {_WRAPPER_NAMES}"
    for name in _WRAPPERS.values():
        if _defines(layer, name) and not callable(getattr(layer, name)):
            value = getattr(layer, name)
            return (
                f"{what}: {name} is not callable (got {type(value).__name__} {value!r}); "
                f"the wrappers are {_WRAPPER_NAMES}"
            )
    for name in _ASYNC_WRAPPERS:
        if _defines(layer, name) and not inspect.iscoroutinefunction(getattr(layer, name)):
            return f"{what}: {name} must be an async def"
    for name in _ITERATOR_WRAPPERS:
        if not _defines(layer, name):
            continue
        wrapper = getattr(layer, name)
        if inspect.iscoroutinefunction(wrapper) or inspect.isgeneratorfunction(wrapper):
            kind = "a coroutine function" if inspect.iscoroutinefunction(wrapper) else "a (sync) generator function"
            return (
                f"{what}: {name} must return an async iterator (write it as an async generator: "
                f"`async def ...: ... yield chunk`), not be {kind}"
            )
    return None


def model_middleware_runs_problem(layers: Iterable[object], runs: Sequence[str]) -> str | None:
    """Which of *layers* (model middleware, shapes checked) defines none of the wrappers *runs*
    (those of the calls its caller makes), as ``model middleware #<i> (<type>) defines ... but not
    ...``, or ``None``: such a layer would silently never run."""
    for index, layer in enumerate(layers):
        if any(_defines(layer, name) for name in runs):
            continue
        defined = ", ".join(name for name in _WRAPPERS.values() if _defines(layer, name))
        return f"model middleware #{index} ({type(layer).__name__}) defines {defined} but not {' or '.join(runs)}"
    return None


# Two a request: built cheaper (see `_builders`), every field given as its converter makes it (the
# tuples and dicts made by `request` and `ModelRequest.replace`).
_model_request: Callable[
    [Operation, str, Sequence[Message], tuple[ToolSpec, ...], Mapping[str, Any], AbortHandle | None, Mapping[str, Any]],
    ModelRequest,
] = constructor(ModelRequest, trusted=("messages", "tools", "options", "metadata"))


class ModelLayers(CheckedLayers):
    """Model middleware checked once (`check`): a `ModelService` built from it checks nothing again.

    An `AgentSpec` holds its layers as one, so opening a session re-validates nothing.
    """

    __slots__ = ()
    _sequence_error = "model middleware must be a sequence, got {}"
    _passed = PassedChecks()  # a chat() run per request must not inspect the same objects again

    @staticmethod
    def _check_layer(layer: object, index: int) -> None:
        problem = model_middleware_problem(layer)
        if problem is not None:
            raise MiddlewareShapeError(f"model middleware #{index} {problem}")


# One generator for the process: backoff jitter needs no per-service seed (seeding reads urandom).
_JITTER = random.Random()


def _attempts(policy: RetryPolicy, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"RetryPolicy.{attribute.name} must be a whole number >= 1, got {value!r}")


def _seconds(policy: RetryPolicy, attribute: attrs.Attribute[float], value: object) -> None:
    finite_seconds(value, f"RetryPolicy.{attribute.name}", allow_zero=True, maximum=MAX_TIMEOUT)


def _flag(policy: RetryPolicy, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"RetryPolicy.{attribute.name} must be True or False, got {value!r}")


# 2**1024 overflows a float (attempt 1025 of a long policy raised OverflowError). At 2**1023 the
# ceiling is max_delay (<= MAX_TIMEOUT) for any base_delay above 1e-300.
_MAX_DOUBLINGS = 1023


@attrs.frozen
class RetryPolicy:
    """Backoff for retryable errors: ``base * 2**(attempt-1)`` capped at ``max_delay``, with full jitter;
    a server's ``retry-after`` is honoured (capped at ``max_delay``). Nonsense values are a `ConfigError`."""

    max_attempts: int = attrs.field(default=3, validator=_attempts)
    base_delay: float = attrs.field(default=0.5, validator=_seconds)
    max_delay: float = attrs.field(default=30.0, validator=_seconds)
    jitter: bool = attrs.field(default=True, validator=_flag)

    def delay(self, attempt: int, error: ModelError, rng: random.Random) -> float:
        if isinstance(error, ProviderError):
            # The server's wait hint, a 429's or a 503's (529, 408, ...) alike: a provider's
            # (possibly a custom one's) retry_after: a number of seconds, clamped to
            # [0, max_delay] (a date already past is "now"); a NaN or what is no number at all is
            # no advice, so the backoff applies as with none (trio.sleep refuses NaN). Clamped as
            # given, float() last: float() or isnan() of an int too large for a float raises
            # OverflowError (NaN is the one number unequal to itself).
            after: object = error.retry_after
            if isinstance(after, int | float) and not isinstance(after, bool) and after == after:
                return float(min(max(after, 0.0), self.max_delay))
        ceiling = min(self.base_delay * 2 ** min(attempt - 1, _MAX_DOUBLINGS), self.max_delay)
        return rng.uniform(0, ceiling) if self.jitter else ceiling


_DEFAULT_RETRY = RetryPolicy()


class _Chains(dict[Operation, tuple[Any, ...]]):
    """Each operation's wrappers (the layers' methods for it, first = outermost), found on first use:
    most services only ever stream."""

    __slots__ = ("_layers",)

    def __init__(self, layers: ModelLayers) -> None:
        super().__init__()
        self._layers = tuple(layers)

    def __missing__(self, operation: Operation) -> tuple[Any, ...]:
        name = _WRAPPERS[operation]
        chain = self[operation] = tuple(getattr(layer, name) for layer in self._layers if _defines(layer, name))
        return chain


class _OpenChains(dict[Operation, Composed]):
    """Each iterator operation's wrappers composed once (`_OpenIterators` carries what a call needs):
    every call of every service built from the same layers runs the same chain."""

    __slots__ = ("_chains",)

    def __init__(self, layers: ModelLayers) -> None:
        super().__init__()
        self._chains = layers.derived("model_chains", _Chains)

    def __missing__(self, operation: Operation) -> Composed:
        # Typed as taking the request alone; a run's (`Composed.start`) take the call first.
        check: Any = _check_open
        terminal: Any = _open_stream_terminal if operation is Operation.STREAM else _open_events_terminal
        composed = compose_middleware(self._chains[operation], terminal, check=check, validate=False)
        assert isinstance(composed, Composed)
        self[operation] = composed
        return composed


class ModelService:
    """A provider wrapped with a model middleware stack, a retry loop and a request deadline.

    Args:
        provider: the backend (an OpenAI-compatible or Anthropic provider, or the test model).
        middleware: model middleware, first = outermost; one immutable stack shared by all callers.
        retry: the retry policy (``RetryPolicy(max_attempts=1)`` disables retries).
        request_timeout: seconds for one whole call, outside the middleware (default 600).
        cleanup_grace: seconds that closing a stream (every layer's iterator and the provider's
            response, together) may take once it is left or cancelled (default 10); a clean-up that
            overruns is abandoned and logged. A deadline or a cancellation is thus delayed by at most this.
    """

    def __init__(
        self,
        provider: Provider,
        middleware: Sequence[ModelMiddleware] = (),
        *,
        retry: RetryPolicy | None = None,
        request_timeout: float = 600.0,
        rng: random.Random | None = None,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    ) -> None:
        # Checked first (`is_provider`, inline: a chat() run builds a service): a wrong one failed
        # the first call with a bare AttributeError.
        if not (hasattr(provider, "stream") and hasattr(provider, "chat") and hasattr(provider, "model")):
            raise ConfigError(not_a_provider("ModelService", provider))
        layers = ModelLayers.check(middleware)
        # Checked here: used only at the first retryable error, a wrong one failed that call as a
        # middleware bug (with no middleware at all).
        if retry is not None and not isinstance(retry, RetryPolicy):
            hint = ": pass RetryPolicy(...)" if retry is RetryPolicy else ""
            raise ConfigError(f"retry must be a RetryPolicy or None, not {_what(retry)}{hint}")
        if rng is not None and not isinstance(rng, random.Random):
            raise ConfigError(f"rng must be a random.Random or None, not {_what(rng)}")
        self.provider = provider
        self.middleware = layers
        self.retry = retry or _DEFAULT_RETRY
        self.request_timeout = validate_timeout(request_timeout, name="request_timeout")
        self.cleanup_grace = validate_cleanup_grace(cleanup_grace)
        self._rng = rng or _JITTER
        self._chains: dict[Operation, tuple[Any, ...]] = layers.derived("model_chains", _Chains)
        self._open_chains: dict[Operation, Composed] = layers.derived("model_open_chains", _OpenChains)
        # The last tools tuple checked (`_tools`), kept alive so its identity means "checked": a
        # loop passes its one tuple of ToolSpecs (checked where it was defined) every turn.
        self._checked_tools: tuple[ToolSpec, ...] = ()

    @property
    def model(self) -> str:
        return self.provider.model

    def _tools(self, tools: Sequence[ToolSpec]) -> tuple[ToolSpec, ...]:
        """*tools* checked (`_tool_tuple`); a tuple is remembered, so passing it again costs nothing
        (a tuple cannot change, and its ToolSpecs are frozen)."""
        checked = _tool_tuple(tools)
        if checked is tools:
            self._checked_tools = checked
        return checked

    def with_model(self, model: str) -> ModelService:
        """A new service for *model*: a new provider service wrapped with the same middleware stack."""
        return ModelService(
            self.provider.with_model(model),
            self.middleware,
            retry=self.retry,
            request_timeout=self.request_timeout,
            rng=self._rng,
            cleanup_grace=self.cleanup_grace,
        )

    def request(
        self,
        operation: Operation,
        messages: Sequence[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        options: Mapping[str, Any] | None = None,
        abort: AbortHandle | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ModelRequest:
        # The caller's arguments, checked (one call fails, with a ConfigError naming the argument).
        return _model_request(
            operation,
            self.provider.model,
            _message_tuple(messages),
            tools if tools is self._checked_tools or tools == () else self._tools(tools),
            {} if options is None else _mapping(options, "options"),
            abort,
            {} if metadata is None else _mapping(metadata, "metadata"),
        )

    # -- non-streaming ------------------------------------------------------------------

    async def chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        options: Mapping[str, Any] | None = None,
        abort: AbortHandle | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ModelResponse:
        return await self._call(
            self.request(Operation.CHAT, messages, tools=tools, options=options, abort=abort, metadata=metadata)
        )

    async def side_query(
        self,
        messages: Sequence[Message],
        *,
        options: Mapping[str, Any] | None = None,
        abort: AbortHandle | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ModelResponse:
        return await self._call(
            self.request(Operation.SIDE_QUERY, messages, options=options, abort=abort, metadata=metadata)
        )

    async def call(self, request: ModelRequest) -> ModelResponse:
        """Run a ``chat`` or ``side_query`` request through the middleware, retries and deadline.

        The request must be for this service's model (`request` builds one): the layers may not
        change the model, and neither may a request made elsewhere (`with_model` is the way)."""
        if not isinstance(request, ModelRequest):
            raise ConfigError(f"call() takes a ModelRequest, not {_what(request)}")
        if request.operation is not Operation.CHAT and request.operation is not Operation.SIDE_QUERY:
            # The caller's request, not a layer's change: a mistake at the door, as a foreign model is.
            raise ConfigError(
                f"call() runs chat or side_query requests, not {request.operation.value}: "
                "open a stream with stream(...), retry events with chat_with_retry_events(...)"
            )
        if request.model != self.provider.model:
            raise ConfigError(
                f"the request is for model {request.model!r}, and this service sends to {self.provider.model!r}: "
                "build it with this service's request(...), or call the service with_model() returns"
            )
        return await self._call(request)

    async def _call(self, request: ModelRequest) -> ModelResponse:
        """`call` of a request this service built (`chat`, `side_query`): nothing to check at the door."""
        _check_kept(request, request)
        if request.abort is not None and request.abort.reason is not None:
            # As a stream does: a layer that answers without awaiting must not hide the abort.
            raise self._stopped(request)
        # Once the call ended, a call_next a layer kept runs nothing: the provider would run
        # outside the deadline and past an abort, for a caller that is gone.
        ended = False
        task = trio.lowlevel.current_task()
        elsewhere: list[trio.CancelScope] | None = None  # the scopes of provider calls in other tasks

        def check(current: ModelRequest) -> None:
            if ended:
                raise _ended_next()
            _check_kept(request, current)

        async def terminal(current: ModelRequest) -> ModelResponse:
            nonlocal elsewhere
            if ended:  # called in time, awaited after the end
                raise _ended_next()
            if trio.lowlevel.current_task() is task:  # under the call's scope: its deadline, its abort
                return await self._with_retries(current)
            # Awaited in another task (a layer's own, which may outlive the call): the call's scope
            # does not reach it, so the provider runs under one of the call's own, with its
            # deadline, cancelled when the call ends (returned, failed or aborted).
            with trio.CancelScope(deadline=scope.deadline) as bound:
                if elsewhere is None:
                    elsewhere = []
                elsewhere.append(bound)
                return await self._with_retries(current)
            raise _cut_next() if ended else self._stopped(request)

        chain = compose_middleware(self._chains[request.operation], terminal, check=check, validate=False)
        try:
            with trio.move_on_after(self.request_timeout) as scope, _abort_cancels(request, scope):
                return await self._guard(chain(request), request.operation)
        except BaseExceptionGroup as group:
            raise self._stopped_with(request, scope, group) from group
        finally:
            ended = True
            if elsewhere is not None:
                for bound in elsewhere:
                    bound.cancel()
        raise self._stopped(request)

    def _layer_name(self, wrapper: object) -> str:
        """How a clean-up overrun names a middleware layer: its place in the stack and its class."""
        owner = getattr(wrapper, "__self__", wrapper)
        index = next((i for i, layer in enumerate(self.middleware) if layer is owner), None)
        return f"model middleware #{index} ({type(owner).__name__})"

    def _provider_layer(self, operation: Operation) -> str:
        what = "stream" if operation is Operation.STREAM else "call"
        return f"the {getattr(self.provider, 'name', type(self.provider).__name__)} provider {what}"

    def _stopped(self, request: ModelRequest) -> ModelError:
        """The error for a call whose scope was cancelled by us: its abort handle, else its deadline."""
        abort = request.abort.reason if request.abort is not None else None
        if abort is not None:
            return ModelAbortedError(f"model request aborted: {abort.message}", abort=abort)
        return ModelTimeoutError(
            f"model request exceeded its {self.request_timeout:g} s deadline", code="model_request_timeout"
        )

    def _stopped_with(
        self, request: ModelRequest, scope: trio.CancelScope, group: BaseExceptionGroup[Any]
    ) -> TrioAgentError:
        """The error for a group that left our deadline's scope: a middleware's own nursery that the
        deadline (or the abort) cancelled and whose cleanup raised, which trio passes through the
        scope without its ``Cancelled``. The call ends as the cancellation would have ended it (a
        typed error in the group wins); anything else (an outer cancellation) goes on unchanged."""
        typed = typed_error(group)
        if typed is not None:
            return typed
        if not scope.cancel_called or contains_cancelled(group):
            raise group
        return self._stopped(request)

    def _retry_delay(self, attempt: int, error: ModelError) -> float:
        """The wait before attempt ``attempt + 1``; re-raises *error* when it may not be retried."""
        if not error.retryable or attempt >= self.retry.max_attempts:
            raise error
        return self.retry.delay(attempt, error, self._rng)

    async def _with_retries(self, request: ModelRequest) -> ModelResponse:
        attempt = 1
        while True:
            try:
                return await _provider_chat(self.provider, request)
            except ModelError as error:
                delay = self._retry_delay(attempt, error)
            await trio.sleep(delay)
            attempt += 1

    async def _guard(self, awaitable: Awaitable[ModelResponse], operation: Operation) -> ModelResponse:
        try:
            response = await awaitable
        except ModelError:
            raise
        except BaseException as exc:  # a middleware bug: typed, with its cause (or a ModelError it grouped)
            if not isinstance(exc, Exception) and not stray_cancellation(exc):
                raise  # a cancellation from outside (or our deadline's) goes on
            error = _middleware_failure(exc)
            raise error from error.__cause__
        # The provider's answer was checked: a layer returned this (the terminal is never the outermost here).
        if type(response) is ModelResponse or isinstance(response, ModelResponse):
            problem = _response_problem(response)
            if problem is None:
                return response
            raise ModelMiddlewareError(self._wrong_item(operation, "returned", f"a ModelResponse whose {problem}"))
        raise ModelMiddlewareError(self._wrong_item(operation, "returned", f"{_what(response)}, not a ModelResponse"))

    def _wrong_item(self, operation: Operation, did: str, problem: str) -> str:
        """The error message for a wrong item out of *operation*'s outermost layer (*problem*: what
        it is, not what it should be)."""
        chain = self._chains[operation]
        inner = " (or passed it on from an inner layer)" if len(chain) > 1 else ""
        return f"{self._layer_name(chain[0])}: {_WRAPPERS[operation]} {did} {problem}{inner}"

    # -- retry events ---------------------------------------------------------------------

    def chat_with_retry_events(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        options: Mapping[str, Any] | None = None,
        abort: AbortHandle | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> AbstractAsyncContextManager[AsyncIterator[RetryEvent | ModelResponse]]:
        """``async with service.chat_with_retry_events(...) as events``: `RetryEvent` items, then the response.

        One request, for one block (as `stream`'s): entering it again is a `ModelError`."""
        request = self.request(
            Operation.CHAT_WITH_RETRY_EVENTS, messages, tools=tools, options=options, abort=abort, metadata=metadata
        )
        return self._open_iterators(request, _EVENT_KINDS)

    def _retry_events_terminal(self, request: ModelRequest) -> AsyncIterator[RetryEvent | ModelResponse]:
        return _RetryingEvents(self, request, self._retry_events(request))

    async def _retry_events(self, request: ModelRequest) -> AsyncIterator[RetryEvent | ModelResponse]:
        attempt = 1
        while True:
            try:
                response = await _provider_chat(self.provider, request)
            except ModelError as error:
                delay = self._retry_delay(attempt, error)
                yield RetryEvent(attempt, delay, error)
                await trio.sleep(delay)
                attempt += 1
                continue
            yield response
            return

    # -- streaming ------------------------------------------------------------------------------

    def stream(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        options: Mapping[str, Any] | None = None,
        abort: AbortHandle | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> AbstractAsyncContextManager[AsyncIterator[StreamChunk]]:
        """``async with service.stream(...) as chunks: async for chunk in chunks``.

        Chunks pass through unbuffered. Leaving the block closes each middleware's
        iterator (outermost first) and then the provider's HTTP response. The value is one
        request, for one block: entering it again (nested or after it was left) is a `ModelError`
        (``model_stream_reused``), and nothing is sent.
        """
        request = self.request(Operation.STREAM, messages, tools=tools, options=options, abort=abort, metadata=metadata)
        return self._open_iterators(request, _CHUNK_KINDS)

    def _stream_terminal(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        return _RetryingStream(self, request)

    def _open_iterators(self, request: ModelRequest, kinds: frozenset[type]) -> _OpenIterators:
        # No layer of the operation: the block reads the terminal, whose items are checked already.
        return _OpenIterators(self, request, kinds if self._chains[request.operation] else None)

    def _position_name(self, operation: Operation, position: int) -> str:
        """How a clean-up overrun names the layer at *position* of *operation*'s chain (the terminal last)."""
        chain = self._chains[operation]
        return self._layer_name(chain[position]) if position < len(chain) else self._provider_layer(operation)


def _check_kept(initial: ModelRequest, request: ModelRequest) -> None:
    """What every layer's ``next(request)`` must keep of the call's first request."""
    if not isinstance(request, ModelRequest):
        raise ModelMiddlewareError(f"next() takes a ModelRequest, got {type(request).__name__}")
    if request.operation is not initial.operation:
        raise ModelMiddlewareError("Model middleware cannot change the model operation")
    if request.model != initial.model:
        raise ModelMiddlewareError("Model middleware cannot change the active model")
    if request.abort is not initial.abort:
        raise ModelMiddlewareError("Model middleware cannot replace the abort handle")


def _ended_next() -> ModelMiddlewareError:
    return ModelMiddlewareError(
        "call_next() was called after the model call had ended (a middleware kept it): nothing ran",
        code="middleware_early_return",
    )


def _cut_next() -> ModelMiddlewareError:
    return ModelMiddlewareError(
        "the model call ended while a call_next a middleware ran in another task was still running: "
        "it was cancelled (a call_next is good for its own call only)",
        code="middleware_early_return",
    )


def _check_open(run: _OpenIterators, request: ModelRequest) -> None:
    if run._ended:  # the block was left: a kept call_next opens nothing (no deadline, no closing)
        raise _ended_next()
    _check_kept(run._request, request)


# Each operation's terminal (bound to its call: where its reads run, the scope they run under, as
# `_track` keeps it), composed into its chain: a block keeps no bound method of its service's.


def _open_stream_terminal(run: _OpenIterators, request: ModelRequest) -> AsyncIterator[Any]:
    return run._service._stream_terminal(request)


def _open_events_terminal(run: _OpenIterators, request: ModelRequest) -> AsyncIterator[Any]:
    return run._service._retry_events_terminal(request)


class _TrackedNext(ComposedNext):
    """``next`` of a stream layer: the iterator the inner layer (or the terminal) returns is kept
    by its position in the call's `_OpenIterators`, to be closed in order."""

    __slots__ = ()

    def __call__(self, replacement: Any = None, /) -> Any:
        iterator = super().__call__(replacement)
        run: _OpenIterators = self._run  # type: ignore[assignment]
        return run._track(self._index, iterator)


class _OpenIterators(Frame, HeldDeadline):
    """``async with``: one streaming request's composed iterators, under one deadline scope that its
    abort handle cancels; leaving closes every iterator opened, outermost first.

    A class, not a generator-based context manager: a model call opens one, and two generator
    frames per call were a measurable part of a request. The scope is entered and left in the
    consumer's task around its block (a scope per chunk would cost more than the chunk), never
    across an iterator's yield.
    """

    __slots__ = (
        "_deadline",
        "_enclosing",
        "_ended",
        "_frames",
        "_kinds",
        "_opened",
        "_outer",
        "_request",
        "_service",
        "_source",
        "_task",
        "_token",
    )

    def __init__(self, service: ModelService, request: ModelRequest, kinds: frozenset[type] | None) -> None:
        self._service = service
        self._request = request
        # What the block may see (the terminal's items are checked already); None: no layer runs,
        # so every item is the terminal's and is not checked twice.
        self._kinds = kinds
        # Position -> iterator: layer i at i, the terminal last. Closing goes by position, so the
        # order is outermost first even when a wrapper opens its inner stream eagerly. None when no
        # layer runs: the terminal's is the only one, `_outer` (one dict less per call).
        self._opened: dict[int, AsyncIterator[Any]] | None = None if kinds is None else {}
        self._outer: AsyncIterator[Any] | None = None
        self._deadline: trio.CancelScope | None = None
        self._token: int | None = None
        self._ended = False  # set when the block is left: no layer's next opens anything after
        self._source: _RetryingStream | None = None  # the provider's stream, once a layer opened it
        self._task: trio.lowlevel.Task | None = None  # the block's task, once entered
        # What its task had open when the block was entered, and the dict its task's chain is in
        # (`FRAMES`), for `waiting_for_reader`; the hold of a wait on a reader (`HeldDeadline`).
        self._enclosing: Frame | None = None
        self._frames: dict[trio.lowlevel.Task, Frame] | None = None
        self._held = None

    def _track(self, position: int, iterator: Any) -> AsyncIterator[Any]:
        """Keep the iterator of the layer at *position* (the terminal last), to be closed in order."""
        if not hasattr(iterator, "__anext__"):
            raise ModelMiddlewareError(f"a stream wrapper must return an async iterator, got {iterator!r}")
        opened = self._opened
        if opened is not None:  # (no layer: the terminal's is kept as `_outer` only)
            opened[position] = iterator
        kind = type(iterator)
        if kind is _RetryingStream:
            self._source = iterator
            iterator._run = self  # bound to its call: where its reads run, the scope they run under
        elif kind is _RetryingEvents:
            iterator._run = self
        return iterator  # type: ignore[no-any-return]

    def _current_deadline(self) -> float:
        """The block's deadline as it stands: while its task waits for a reader (`waiting_for_reader`),
        what was left of it when the wait began, from now."""
        deadline = self._deadline
        assert deadline is not None  # set when the block was entered, before any layer ran
        return self._held_deadline(deadline)

    # As a frame of its task's chain (`waiting_for_reader`), the block holds its own deadline.

    def _frame_deadline(self) -> _OpenIterators:
        return self

    def _reader_scope(self) -> trio.CancelScope | None:
        return None if self._ended else self._deadline

    async def __aenter__(self) -> AsyncIterator[Any]:
        if self._task is not None:
            # One request, one block: entered again, it would send the request twice (or, nested,
            # stack a second deadline scope on the first and corrupt the task's scope stack).
            raise self._reused()
        service, request = self._service, self._request  # the service built this request: nothing to check
        handle = request.abort
        if handle is not None and handle.reason is not None:
            # Before any layer runs, as chat() does: a plain-def wrap_stream runs when it is called.
            raise service._stopped(request)
        chain = service._open_chains[request.operation]
        task = self._task = trio.lowlevel.current_task()  # where reads run under the block's scope
        # The task's innermost frame, for `waiting_for_reader` (left in `__aexit__`).
        frames = FRAMES.get()
        if frames is None:  # the first frame of this task (and of those it started)
            frames = {}
            FRAMES.set(frames)
        self._frames = frames
        self._enclosing = frames.get(task)
        frames[task] = self
        # The deadline given to the constructor: setting it on a made scope costs a third more.
        deadline = self._deadline = trio.CancelScope(deadline=trio.current_time() + service.request_timeout)
        deadline.__enter__()
        if handle is not None:  # aborting the request cancels the scope
            self._token = handle.add_listener(self)  # (`__call__`: no closure per call)
        try:
            self._outer = self._track(0, chain.start(request, self, _TrackedNext))
        except BaseException as exc:
            # A plain-def wrapper runs here, when it is called: what it raises is typed as an
            # async generator's would be at its first step.
            if isinstance(exc, ModelError) or (not isinstance(exc, Exception) and not stray_cancellation(exc)):
                await self.__aexit__(type(exc), exc, exc.__traceback__)  # raises what replaces exc, if anything
                raise
            error = _middleware_failure(exc)
            await self.__aexit__(type(error), error, exc.__traceback__)
            raise error from error.__cause__
        return self

    def __call__(self, abort: Abort) -> None:
        """The block is its request's abort listener (while it is open): aborting cancels its scope."""
        deadline = self._deadline
        assert deadline is not None  # entered before it listens
        deadline.cancel(reason=abort.message)

    # The block's iterator is this object itself (one object less per call): it types what escapes
    # the chain, so a middleware bug becomes a ModelMiddlewareError with its cause.

    def __aiter__(self) -> _OpenIterators:
        if self._outer is None:
            raise self._not_entered()
        return self

    async def __anext__(self) -> Any:
        # An abort or deadline reaches the consumer even if the provider never checkpoints (~0.2 us).
        await trio.lowlevel.checkpoint_if_cancelled()
        outer = self._outer
        if outer is None:
            raise self._not_entered()
        try:
            item = await outer.__anext__()
        except (ModelError, StopAsyncIteration):
            raise
        except BaseException as exc:
            if not isinstance(exc, Exception) and not stray_cancellation(exc):
                raise  # a cancellation from outside (or the block's deadline) goes on
            error = _middleware_failure(exc)
            raise error from error.__cause__
        kinds = self._kinds
        if kinds is None:
            return item
        if kinds is _CHUNK_KINDS:  # the usual chunk's one field inline, as the provider's are checked
            source = self._source
            # The provider's chunk a layer passed on as it came was checked as it left the provider.
            if (
                (source is not None and item is source.last)
                or (type(item) is TextDelta and type(item.text) is str)
                or _chunk_ok(item)
            ):
                return item
        elif type(item) is RetryEvent or (type(item) is ModelResponse and _response_problem(item) is None):
            return item
        return self._odd_item(item, kinds)

    def _odd_item(self, item: object, kinds: frozenset[type]) -> Any:
        """*item*, if the block may see it (a subclass too; a chunk with its fields' types); else the
        outermost layer's error."""
        if kinds is _CHUNK_KINDS:
            problem = _chunk_problem(item)
            if problem is None:
                return item
        elif isinstance(item, ModelResponse):
            response_problem = _response_problem(item)
            if response_problem is None:
                return item
            problem = f"a ModelResponse whose {response_problem}"
        elif _is_kind(item, kinds):
            return item
        else:
            problem = f"{_what(item)}, not {_KIND_NAMES[kinds]}"
        raise ModelMiddlewareError(self._service._wrong_item(self._request.operation, "yielded", problem))

    def _not_entered(self) -> ModelError:
        return ModelError(
            "a model stream was iterated outside its `async with` block: write "
            "`async with service.stream(...) as chunks: async for chunk in chunks: ...`",
            code="model_stream_not_entered",
        )

    def _reused(self) -> ModelError:
        opened = "service.stream(...)" if self._request.operation is Operation.STREAM else "chat_with_retry_events(...)"
        return ModelError(
            f"a model stream's `async with` block was entered again: each {opened} is one request, "
            f"for one block (call {opened} again for another request); nothing was sent",
            code="model_stream_reused",
        )

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> bool:
        service, request = self._service, self._request
        self._ended = True
        error = exc
        try:
            opened = self._opened
            if opened is None:  # no layer ran: the terminal's, if it was opened
                opened = {} if self._outer is None else {0: self._outer}
            failure = await _close_all(opened, service, request.operation)
            if failure is not None:
                if exc is not None:  # the block's own error (or cancellation) wins; the cleanup's is noted
                    exc.add_note(f"also, closing a model stream layer raised {describe(failure, 'repr')}")
                elif isinstance(failure, ModelError):
                    error = failure
                else:
                    error = ModelMiddlewareError(f"closing a model stream layer raised {describe(failure, 'repr')}")
                    error.__cause__ = failure
        except BaseException as raised:  # pragma: no cover - _close_all catches what the layers raise
            error = raised
        finally:
            if self._token is not None and request.abort is not None:
                request.abort.remove_listener(self._token)
            # After the layers closed (a stream a layer opened inside this block is left first).
            task = self._task
            frames = self._frames
            if task is not None and frames is not None and frames.get(task) is self:
                enclosing = self._enclosing
                if enclosing is None:
                    del frames[task]
                else:
                    frames[task] = enclosing
        deadline = self._deadline
        assert deadline is not None
        if error is None:
            deadline.__exit__(None, None, None)
        else:
            try:
                if deadline.__exit__(type(error), error, error.__traceback__):
                    error = None  # our deadline's (or abort's) cancellation, caught here
            except BaseExceptionGroup as group:  # the rest of a middleware nursery's group (see `_stopped_with`)
                raise service._stopped_with(request, deadline, group) from group
        if error is not None:
            if error is exc:
                return False  # on its way out unchanged
            raise error
        if deadline.cancelled_caught:
            raise service._stopped(request) from None
        return False


@contextmanager
def _abort_cancels(request: ModelRequest, scope: trio.CancelScope) -> Iterator[None]:
    """While the block runs, aborting the request's handle cancels *scope* (at once if already aborted)."""
    handle = request.abort
    if handle is None:
        yield
        return
    token = handle.add_listener(lambda abort: scope.cancel(reason=abort.message))
    try:
        yield
    finally:
        handle.remove_listener(token)


async def _close_all(
    opened: dict[int, AsyncIterator[Any]], service: ModelService, operation: Operation
) -> Exception | None:
    """Close every opened iterator, outermost first (middleware cleanups, then the provider's
    HTTP response); one failing cleanup does not stop the others. Returns the first failure.

    All of it together is bounded by the service's ``cleanup_grace`` (from the first layer that
    needs closing): each layer gets what its predecessors left (its own shield, so an overrun names
    it). A layer reached with nothing left is still closed, under an expired scope: a ``finally``
    that does not await still runs.
    """
    failure: Exception | None = None
    deadline: float | None = None
    for position in sorted(opened):
        iterator = opened[position]
        aclose = getattr(iterator, "aclose", None)
        if aclose is None or (isinstance(iterator, types.AsyncGeneratorType) and iterator.ag_frame is None):
            continue  # nothing to close (a generator that ran to its end has run its finally already)
        source = iterator if isinstance(iterator, _ProviderIterator) else None
        if source is not None:
            source._run = None  # no reference cycle (a read in another task keeps the run itself)
            if source._inner is None and source._reading is None:  # `closed`, inline
                # The provider's stream ended on its own, or was never opened: no shield for nothing,
                # but finished, so that reading it later (a kept iterator, the block's) opens none.
                source._finished = True  # (`_finish`, inline: every stream that ends on its own comes here)
                source._detour = True
                continue
        if deadline is None:
            deadline = trio.current_time() + service.cleanup_grace
        if source is not None:
            source.close_by = deadline  # its own shield must not outlast ours
        with bounded_shield(max(deadline - trio.current_time(), 0.0), service._position_name(operation, position)):
            try:
                await aclose()
            except Exception as exc:
                failure = failure or exc
            except BaseException as exc:
                if not stray_cancellation(exc):
                    raise  # our bound's cancellation (the shield catches it), or KeyboardInterrupt
                failure = failure or (_provider_failure(exc) if source is not None else _middleware_failure(exc))
    return failure


async def _provider_chat(provider: Provider, request: ModelRequest) -> ModelResponse:
    """The provider's answer to ``chat``, checked (`_provider_response`). Anything but a `ModelError`
    is a provider bug, typed as such: also what a plain ``def chat`` raises when called (building
    its request), and a ``StopAsyncIteration`` (an exhausted iterator read inside it), which
    escaped as themselves and were blamed on the middleware."""
    try:
        response = await provider.chat(request)
    except ModelError:
        raise
    except BaseException as exc:
        if not isinstance(exc, Exception) and not stray_cancellation(exc):
            raise  # a cancellation from outside (or the call's deadline) goes on
        raise _provider_failure(exc) from exc
    return _provider_response(response)


def _provider_response(response: object) -> ModelResponse:
    """The provider's answer to ``chat``; anything but a `ModelResponse` with a good usage
    (`_response_problem`) is a provider bug, typed as such."""
    if type(response) is ModelResponse or isinstance(response, ModelResponse):
        problem = _response_problem(response)
        if problem is None:
            return response
        raise ModelError(f"the provider's chat returned a ModelResponse whose {problem}", code="provider_failed")
    raise ModelError(
        f"the provider's chat returned {_what(response)}, not a ModelResponse",
        code="provider_failed",
    )


class _ProviderIterator:
    """A call's terminal iterator (the provider's work with the service's retry loop), bound to its call.

    A layer may read it in a task of its own (a ``call_next`` handed to a long-lived nursery's
    task, which may outlive the call): the block's deadline scope does not reach that task, so the
    provider ran past the deadline, past an abort and after the block was left, and closing it
    under that read failed (the generator "already running"), leaving it open. So where its reads
    run is decided: in the block's task (the usual case) they run as they are, under the block's
    scope; in another task each read runs under a scope of the call's own (`_read_elsewhere`):
    the block's deadline, cancelled when the block is left, and closing waits for that read to
    leave before it closes the provider's iterator."""

    # Never read per chunk: on the class, stored by a call only when they change.
    _elsewhere = False  # reads run in another task, each under a scope of the call's
    _left: trio.Event | None = None  # set when a read in another task has left (closing waits for it)

    def __init__(self, service: ModelService, request: ModelRequest, inner: AsyncIterator[Any] | None) -> None:
        self._service = service
        self._request = request
        self._inner = inner
        self._run: _OpenIterators | None = None  # set when its call keeps it (`_OpenIterators._track`)
        # The slow path (`_detoured`): the first read (where does it run?), every read after the
        # end, every read in another task. False only while reads run in the block's task.
        self._detour = True
        self._finished = False
        self._reading: trio.CancelScope | None = None  # the scope of a read in another task, while it runs
        self.close_by = math.inf
        """When closed by `_close_all`: the trio time its bound ends (the provider close may not outlast it)."""

    def __aiter__(self) -> _ProviderIterator:
        return self

    async def __anext__(self, here: bool = False) -> Any:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """Nothing of the provider's is open, nor read in another task (not started, ended, or closed)."""
        return self._inner is None and self._reading is None

    def _finish(self) -> None:
        """Whatever ends it ends it for good, as an async generator's end: read again, it must not
        open a new provider request and replay what was already published."""
        self._finished = True
        self._detour = True

    async def _detoured(self) -> Any:
        """A read off the fast path: after the end, its end; else in the block's task the read
        itself (a stream decides that inline, at its first read), in another task under a scope
        of the call's."""
        if self._finished:
            if not self.closed:  # left open under a read in another task (see `_close_inner`)
                self.close_by = math.inf
                await self._close_inner()
            raise StopAsyncIteration
        run = self._run
        if not self._elsewhere:
            if run is None or trio.lowlevel.current_task() is run._task:
                return await self.__anext__(True)
            self._elsewhere = True
        assert run is not None
        return await self._read_elsewhere(run)

    async def _read_elsewhere(self, run: _OpenIterators) -> Any:
        """One read in a task other than the block's, under a scope of the call's: the block's
        deadline, cancelled when the block is left (`aclose`)."""
        if run._ended:  # the block was left and its closing has not reached us yet: nothing more
            self._finish()
            raise StopAsyncIteration
        with trio.CancelScope(deadline=run._current_deadline()) as scope:
            self._reading = scope
            try:
                return await self.__anext__(True)
            finally:
                self._reading = None
                if self._left is not None:
                    self._left.set()
        # Our scope's cancellation: the block was left during the read, or its deadline passed.
        raise _cut_next() if run._ended else self._service._stopped(self._request)

    async def _close_inner(self) -> None:
        """Close the provider's iterator; what its ``aclose`` raises is a provider bug, typed as such."""
        inner = self._inner
        aclose = getattr(inner, "aclose", None)
        if aclose is None:
            self._inner = None
            return
        if getattr(inner, "ag_running", False):
            # Read right now in another task that a layer handed it to after reading it in the
            # block's (only the first read decides where reads run): an async generator cannot be
            # closed under its read. It is kept, and closed at that task's next read.
            raise ModelMiddlewareError(
                "the provider's stream was being read in another task when its model call ended (a "
                "middleware handed it over): a call_next is good for its own call only"
            )
        self._inner = None
        grace = min(self._service.cleanup_grace, max(self.close_by - trio.current_time(), 0.0))
        with bounded_shield(grace, self._service._provider_layer(self._request.operation)):
            try:
                await aclose()
            except ModelError:
                raise
            except BaseException as exc:
                if not isinstance(exc, Exception) and not stray_cancellation(exc):
                    raise  # our bound's cancellation (the shield catches it), or KeyboardInterrupt
                raise _provider_failure(exc, " when its stream was closed") from exc

    async def aclose(self) -> None:
        self._finish()  # closed: never reopened
        reading = self._reading
        if reading is not None:  # a read in another task: stopped, and waited for, before closing under it
            reading.cancel()
            left = self._left = trio.Event()
            await left.wait()
        await self._close_inner()


class _RetryingStream(_ProviderIterator):
    """The provider stream with the service's retry loop: retried only before the first chunk."""

    def __init__(self, service: ModelService, request: ModelRequest) -> None:
        # The base's, inline (one frame less a call), every attribute read on the way of a chunk
        # or a call on the instance from the start: one that moves from the class to the instance
        # mid-call keeps the interpreter from specialising its reads.
        self._service = service
        self._request = request
        self._inner: AsyncIterator[StreamChunk] | None = None  # opened at the first read
        self._run = None
        self._detour = True
        self._finished = False
        self._reading = None
        self.close_by = math.inf
        self._published = False
        self._attempt = 1
        self.last: object = None
        """The last chunk it returned (checked): a layer that passes it on unchanged is not checked again."""

    async def __anext__(self, here: bool = False) -> StreamChunk:
        if self._detour and not here:  # (*here*: the detour's own read)
            run = self._run
            if self._finished or self._elsewhere or (run is not None and trio.lowlevel.current_task() is not run._task):
                return await self._detoured()  # type: ignore[no-any-return]
            # The first read, in the block's task: so are all its reads (only the first decides:
            # a task check per chunk would cost a tenth of one), as they are, under its scope.
            self._detour = False
        try:
            while True:
                try:
                    try:
                        # Opening is inside: a provider whose plain-def stream() fails at once
                        # (building the request) fails the attempt like a failing first read.
                        inner = self._inner
                        if inner is None:
                            inner = self._inner = self._service.provider.stream(self._request)
                        chunk = await inner.__anext__()
                        # The usual chunk's one field inline (most of a reply); any other is judged in full.
                        if (type(chunk) is not TextDelta or type(chunk.text) is not str) and not _chunk_ok(chunk):
                            problem = _chunk_problem(chunk)
                            if problem is not None:
                                raise ModelError(f"the provider's stream yielded {problem}", code="provider_failed")
                    except (ModelError, StopAsyncIteration):
                        raise
                    except BaseException as exc:  # anything else is a provider bug, typed as such
                        if not isinstance(exc, Exception) and not stray_cancellation(exc):
                            raise  # a cancellation from outside (or the call's deadline) goes on
                        raise _provider_failure(exc) from exc
                except StopAsyncIteration:
                    # Ended on its own: nothing left to close, so leaving the stream costs no shield.
                    self._inner = None
                    raise
                except ModelError as error:
                    await self._close_failed(error)
                    if self._published:
                        # A timeout stays a timeout (an `except TimeoutError` catches it, as it
                        # catches the request deadline's, published chunks or not); the one that
                        # says it may be retried is interrupted like any failure: it is not.
                        if isinstance(error, StreamInterruptedError) or (
                            isinstance(error, ModelTimeoutError) and not error.retryable
                        ):
                            raise
                        raise StreamInterruptedError(
                            f"the stream failed after chunks were published: {describe(error, 'text')}",
                            code=error.code,
                            retryable=False,
                        ) from error
                    await trio.sleep(self._service._retry_delay(self._attempt, error))
                    self._attempt += 1
                    continue
                self._published = True
                self.last = chunk
                return chunk
        except BaseException:
            self._finished = True  # `_finish`, inline
            self._detour = True
            raise

    async def _close_failed(self, error: ModelError) -> None:
        """Close a failed attempt's stream. *error* decides what follows (a retry, or it is raised):
        a close that fails too is noted on it and logged, never raised in its place (it was, and
        a retryable error became a middleware bug that was not retried)."""
        try:
            await self._close_inner()
        except Exception as failure:
            raised = failure.__cause__ if isinstance(failure.__cause__, Exception) else failure  # the provider's own
            error.add_note(f"also, closing the provider's failed stream raised {describe(raised, 'repr')}")
            where = self._service._provider_layer(Operation.STREAM)
            logger.warning(
                "closing a failed attempt of %s raised %s (the attempt's error: %s)",
                where,
                describe(raised, "repr"),
                describe(error, "repr"),
            )


class _RetryingEvents(_ProviderIterator):
    """The terminal of ``chat_with_retry_events``: `ModelService._retry_events` (the retry loop
    around the provider's chat, a `RetryEvent` per retry, then the response). Every read decides
    where it runs: there are few."""

    async def __anext__(self, here: bool = False) -> RetryEvent | ModelResponse:
        if not here:
            return await self._detoured()  # type: ignore[no-any-return]
        inner = self._inner
        assert inner is not None
        try:
            return await inner.__anext__()  # type: ignore[no-any-return]
        except BaseException:
            self._finish()  # the generator ended (its end, its error, a cancellation)
            if getattr(inner, "ag_frame", None) is None:
                self._inner = None  # nothing left to close
            raise
