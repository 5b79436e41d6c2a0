"""The deterministic test model: scripted replies, keyed per conversation, with latency on demand."""

from __future__ import annotations

import heapq
import itertools
import json
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from .._config import seconds_problem
from .._errors import ConfigError, ModelError
from .._json import json_problem
from .._util import safe_repr
from ._messages import (
    AssistantMessage,
    FinishChunk,
    FinishReason,
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
    Usage,
    UsageChunk,
    UserMessage,
)
from ._service import ModelRequest

__all__ = ["Reply", "TestModel", "conversation_key", "open_test_model"]


@attrs.frozen
class Reply:
    """One scripted model reply.

    ``tool_calls`` maps to `ToolCallPart` s: give ``(name, arguments)`` pairs where
    arguments is a dict (serialised to JSON) or a raw string (to script invalid JSON).
    ``error`` makes the call fail with that `ModelError` instead; ``fail_after_chunks``
    makes a stream fail after that many chunks (after all of them if the reply has fewer: a
    stream given ``fail_after_chunks`` always fails), with ``error`` if given, else a
    retryable ``test_stream_cut`` `ModelError`; ``chat`` fails alike (with ``error``, else
    ``test_stream_cut``), so both operations agree on whether a reply fails. ``latency`` delays
    the reply (seconds, driven by the model's one timer task when opened with `open_test_model`).

    Each field is checked when the reply is made (`ConfigError` naming it): a script's
    mistake fails where it is written, not inside a model call, and never in the timer
    task that a whole `open_test_model` shares (a ``NaN`` latency there failed every
    conversation).
    """

    text: str = ""
    tool_calls: Sequence[tuple[str, Any]] = ()
    reasoning: str | None = None
    reasoning_signature: str | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: ModelError | None = None
    fail_after_chunks: int | None = None
    latency: float = 0.0

    def __attrs_post_init__(self) -> None:
        problem = _reply_problem(self)
        if problem is not None:
            raise ConfigError(f"Reply.{problem}")

    def response(self, model: str, ids: Iterator[int] | None = None) -> ModelResponse:
        """This reply as a model's response; tool call and response ids are numbered from *ids*
        (a `TestModel` passes its own counter, so one script gives the same ids in every run)."""
        ids = itertools.count(1) if ids is None else ids
        parts: list[Any] = []
        if self.reasoning is not None:
            parts.append(ReasoningPart(self.reasoning, self.reasoning_signature))
        if self.text:
            parts.append(TextPart(self.text))
        for name, arguments in self.tool_calls:
            raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
            parts.append(ToolCallPart(f"call_{next(ids)}", name, raw))
        reason = self.finish_reason or (FinishReason.TOOL_CALLS if self.tool_calls else FinishReason.STOP)
        usage = self.usage or _estimate_usage(self.text, parts)
        return ModelResponse(AssistantMessage(tuple(parts)), reason, usage, model, f"test-{next(ids)}")


def _reply_problem(reply: Reply) -> str | None:
    """What is wrong with ``reply``'s fields (``field: why``), or ``None``."""
    for name in ("text", "reasoning", "reasoning_signature"):
        value = getattr(reply, name)
        if not isinstance(value, str) and not (value is None and name != "text"):
            return f"{name} must be a string, got {type(value).__name__}"
    if isinstance(reply.tool_calls, (str, bytes)) or not isinstance(reply.tool_calls, Sequence):
        return f"tool_calls must be a sequence of (name, arguments) pairs, got {type(reply.tool_calls).__name__}"
    for index, call in enumerate(reply.tool_calls):
        where = f"tool_calls[{index}]"
        if not isinstance(call, (tuple, list)) or len(call) != 2 or not isinstance(call[0], str) or not call[0]:
            return f"{where} must be a (name, arguments) pair with a non-empty name, got {safe_repr(call, 80)}"
        arguments = call[1]
        if not isinstance(arguments, str):
            problem = json_problem(arguments, f"{where}.arguments")
            if problem is not None:  # JSON text would not carry it (a raw string scripts invalid JSON)
                return problem
    for name, kind in (("finish_reason", FinishReason), ("usage", Usage), ("error", ModelError)):
        value = getattr(reply, name)
        if value is not None and not isinstance(value, kind):
            return f"{name} must be a {kind.__name__} or None, got {type(value).__name__}"
    count = reply.fail_after_chunks
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        return f"fail_after_chunks must be a whole number >= 0 or None, got {safe_repr(count, 80)}"
    problem = seconds_problem(reply.latency, allow_zero=True)
    return None if problem is None else f"latency {problem}"


def _estimate_usage(text: str, parts: Sequence[Any]) -> Usage:
    output = len(text.split()) + sum(len(getattr(part, "arguments", "")) // 4 for part in parts)
    return Usage(input_tokens=10, output_tokens=output, total_tokens=10 + output)


def conversation_key(request: ModelRequest) -> str:
    """Which script a request reads from: ``metadata["conversation_id"]`` (or, for older callers,
    ``options["conversation_id"]``), else the first user message."""
    key = request.metadata.get("conversation_id", request.options.get("conversation_id"))
    if key is not None:
        return str(key)
    for message in request.messages:
        if isinstance(message, UserMessage):
            return message.content
    return ""


Responder = Callable[[ModelRequest], Reply]


def _scripts(script: object) -> dict[str, deque[Reply]]:
    """A ``script=`` as queues by key; its shape is checked here (`ConfigError` naming the key)."""
    if script is None:
        return {}
    if not isinstance(script, Mapping):
        got = type(script).__name__
        raise ConfigError(f"TestModel(script=) must map a conversation's key to its replies, got {got}")
    scripts: dict[str, deque[Reply]] = {}
    for key, replies in script.items():
        if not isinstance(key, str):
            shown = safe_repr(key, 80)
            raise ConfigError(f"TestModel(script=) key {shown} is not a string (a conversation's key is one)")
        scripts[key] = _replies(replies, f"script[{key!r}]")
    return scripts


def _replies(replies: object, where: str) -> deque[Reply]:
    """``replies`` (a list of `Reply` s, in order) as a queue; ``where`` names it in the error."""
    if isinstance(replies, Reply):
        raise ConfigError(f"TestModel {where} is one Reply: give a list of the replies, in order ([Reply(...)])")
    if isinstance(replies, (str, bytes)) or not isinstance(replies, Iterable):
        raise ConfigError(f"TestModel {where} must be a list of Reply, got {type(replies).__name__}")
    queue = deque(replies)
    for index, reply in enumerate(queue):
        if not isinstance(reply, Reply):
            shown = safe_repr(reply, 80)
            raise ConfigError(f"TestModel {where}[{index}] is {type(reply).__name__} ({shown}), not a Reply")
    return queue


def _not_open() -> ModelError:
    # The code real providers use for a call outside their open block: one `except` serves both.
    return ModelError(
        "test model used after its open_test_model block ended (the block's timer drives replies' "
        "latency): call it inside the block, or use TestModel(...) directly",
        code="provider_not_open",
    )


class _Timer:
    """One task wakes every delayed request: thousands of waiters cost one sleeping task.

    Closed when its `open_test_model` block ends: its task is gone, so a request waiting then,
    or made later, fails with `_not_open` instead of waiting for a wake-up that never comes."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, trio.Event]] = []
        self._seq = itertools.count()
        self._changed = trio.Event()
        self.closed = False

    async def sleep(self, seconds: float) -> None:
        if self.closed:
            raise _not_open()
        deadline = trio.current_time() + seconds
        event = trio.Event()
        heapq.heappush(self._heap, (deadline, next(self._seq), event))
        self._changed.set()
        await event.wait()
        if self.closed and trio.current_time() < deadline:  # woken by close(), its latency not served
            raise _not_open()

    def close(self) -> None:
        self.closed = True
        for _, _, event in self._heap:
            event.set()
        self._heap.clear()

    async def run(self) -> None:
        while True:
            now = trio.current_time()
            while self._heap and self._heap[0][0] <= now:
                heapq.heappop(self._heap)[2].set()
            self._changed = trio.Event()
            deadline = self._heap[0][0] if self._heap else float("inf")
            with trio.move_on_at(deadline):
                await self._changed.wait()


class TestModel:
    """A `Provider` with deterministic replies, for tests and offline runs.

    The simplest is ``respond``: a function from the request to its `Reply`
    (``TestModel(respond=lambda request: Reply(text="hi"))``); it sees the whole
    request, so it can answer by the last message, the tools offered, anything.

    Or a ``script``: a mapping from a conversation's *key* to the replies that
    conversation gets, in order, so concurrent conversations never take each other's
    replies. The key of a request is ``key(request)``; by default (`conversation_key`)
    its ``metadata["conversation_id"]`` if set, else the content of its **first user
    message**, so every request of one session (which keeps its history) reads the
    same script, one reply per model call, across requests. A conversation whose
    script ran out, or that has none while no ``default`` is given, is an error that
    names the conversation's key and the known keys. ``default`` answers
    conversations without a script (a list consumed in order, or one reply repeated).
    ``requests`` records every request the model received.
    """

    __test__ = False  # not a pytest test class
    name = "test"

    def __init__(
        self,
        script: Mapping[str, Iterable[Reply]] | None = None,
        *,
        default: Reply | Iterable[Reply] | None = None,
        respond: Responder | None = None,
        model: str = "test-model",
        timer: _Timer | None = None,
        key: Callable[[ModelRequest], str] | None = None,
    ) -> None:
        self.model = model
        self._key = key or conversation_key
        self._scripts = _scripts(script)
        self._default_one = default if isinstance(default, Reply) else None
        self._default_queue = None if default is None or isinstance(default, Reply) else _replies(default, "default")
        if respond is not None and not callable(respond):
            raise ConfigError(f"TestModel(respond=) must be a function of the request, got {type(respond).__name__}")
        self._respond = respond
        self._timer = timer
        # Its own numbering of tool call and response ids: a script gives the same ids however
        # many other models ran before it in the process (a shared counter made runs differ).
        self._ids = itertools.count(1)
        self.requests: list[ModelRequest] = []

    def with_model(self, model: str) -> TestModel:
        clone = TestModel(model=model, respond=self._respond, timer=self._timer, key=self._key)
        clone._scripts = self._scripts
        clone._default_one = self._default_one
        clone._default_queue = self._default_queue
        clone.requests = self.requests
        clone._ids = self._ids  # one model's conversations, whichever name: ids stay unique across them
        return clone

    def _next_reply(self, request: ModelRequest) -> Reply:
        if self._timer is not None and self._timer.closed:
            raise _not_open()
        self.requests.append(request)
        if self._respond is not None:
            reply = _called("respond=", self._respond, request)
            if not isinstance(reply, Reply):  # a provider's failure is a ModelError, whoever calls it
                raise ModelError(
                    f"test model's respond= returned {type(reply).__name__} ({safe_repr(reply, 80)}), not a Reply",
                    code="test_model_bad_reply",
                )
            return reply
        key = _called("key=", self._key, request)
        try:
            queue = self._scripts.get(key)
        except Exception as exc:  # unhashable (a list), or its own __hash__/__eq__ raised: the script's, typed
            raise _failed("key=", exc) from exc
        if queue is not None:
            if queue:
                return queue.popleft()
            raise ModelError(
                f"test model's script for conversation {safe_repr(key)} ran out (each model call takes one reply; "
                f"scripted conversations: {self._known()})",
                code="test_model_exhausted",
            )
        if self._default_queue:
            return self._default_queue.popleft()
        if self._default_one is not None:
            return self._default_one
        raise ModelError(
            f"test model has no script for conversation {safe_repr(key)} and no default reply left "
            f"(scripted conversations: {self._known()}; a conversation's key is its first user message "
            "unless key= says otherwise)",
            code="test_model_exhausted",
        )

    def _known(self) -> str:
        keys = sorted(self._scripts)
        shown = ", ".join(repr(key[:40]) for key in keys[:10])
        return (shown + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")) or "none"

    async def _wait(self, seconds: float) -> None:
        if seconds <= 0:
            await trio.lowlevel.checkpoint()
        elif self._timer is not None:
            await self._timer.sleep(seconds)
        else:
            await trio.sleep(seconds)

    async def chat(self, request: ModelRequest) -> ModelResponse:
        reply = self._next_reply(request)
        await self._wait(reply.latency)
        if reply.error is not None:
            raise reply.error
        if reply.fail_after_chunks is not None:  # a reply whose stream fails fails as a chat too
            raise _stream_cut()
        return reply.response(request.model, self._ids)

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        return self._stream(request)

    async def _stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        reply = self._next_reply(request)
        await self._wait(reply.latency)
        if reply.error is not None and reply.fail_after_chunks is None:
            raise reply.error
        response = reply.response(request.model, self._ids)
        cut = reply.fail_after_chunks
        for count, chunk in enumerate(_chunks(response)):
            if cut is not None and count >= cut:
                break
            yield chunk
        if cut is not None:  # cut mid-way, or at the end when the reply has fewer chunks: it fails either way
            raise reply.error or _stream_cut()


def _stream_cut() -> ModelError:
    return ModelError("scripted stream failure", code="test_stream_cut", retryable=True)


def _called(what: str, function: Callable[[ModelRequest], Any], request: ModelRequest) -> Any:
    """*function* (the script's ``respond=`` or ``key=``) on *request*; what it raises is a ModelError."""
    try:
        return function(request)
    except ModelError:
        raise
    except Exception as exc:  # a provider's failure is a ModelError, whoever calls it
        raise _failed(what, exc) from exc


def _failed(what: str, exc: Exception) -> ModelError:
    # The code the model service gives a provider's bare exception: the same whether called
    # directly or through the service, and not retried (a script's bug does not go away).
    return ModelError(f"test model's {what} raised {safe_repr(exc)}", code="provider_failed", retryable=False)


def _chunks(response: ModelResponse) -> Iterable[StreamChunk]:
    index = 0
    for part in response.message.parts:
        if isinstance(part, ReasoningPart):
            yield ReasoningDelta(part.text, part.signature)
        elif isinstance(part, TextPart):
            words = part.text.split(" ")
            for position, word in enumerate(words):
                yield TextDelta(word if position == 0 else " " + word)
        elif isinstance(part, ToolCallPart):
            yield ToolCallStart(index, part.id, part.name)
            middle = len(part.arguments) // 2
            for piece in (part.arguments[:middle], part.arguments[middle:]):
                if piece:
                    yield ToolCallDelta(index, piece)
            yield ToolCallEnd(index, part.id, part.name, part.arguments)
            index += 1
    yield UsageChunk(response.usage)
    yield FinishChunk(response.finish_reason)


@asynccontextmanager
async def open_test_model(
    script: Mapping[str, Iterable[Reply]] | None = None,
    *,
    default: Reply | Iterable[Reply] | None = None,
    respond: Responder | None = None,
    model: str = "test-model",
) -> AsyncIterator[TestModel]:
    """A `TestModel` whose latencies are driven by one timer task owned by this context.

    The model is for the block, as a real provider is for its ``async with``: a call after the
    block ends, or still waiting out its latency when it ends, fails with `ModelError` code
    ``provider_not_open`` (the timer task is gone; it never hangs)."""
    timer = _Timer()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer.run)
            try:
                yield TestModel(script, default=default, respond=respond, model=model, timer=timer)
            finally:
                timer.close()  # the timer task goes with the block: later waits fail, never hang
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The timer task never fails, so a group holds the block's own error: raise it as itself.
        if len(group.exceptions) == 1:
            raise group.exceptions[0]  # noqa: B904 - `from` would overwrite the error's own __cause__
        raise
