"""Model middleware examples: every code block of docs/model-middleware.md, runnable.

Run it with ``python examples/model_middleware_examples.py``. Each ``demo_*`` function runs an
example against the deterministic `TestModel` and returns what happened, so the tests in
tests/test_model_middleware_examples.py check the behaviour the guide describes.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from trio_agent import ModelError, Provider, RateLimitError
from trio_agent.models import (
    AssistantMessage,
    ChatNext,
    EventsNext,
    FinishReason,
    Message,
    ModelMiddlewareError,
    ModelRequest,
    ModelResponse,
    ModelService,
    ProviderServerError,
    RetryEvent,
    RetryPolicy,
    StreamChunk,
    StreamInterruptedError,
    StreamNext,
    TextDelta,
    ToolSpec,
    UserMessage,
    WrapsChat,
    WrapsChatWithRetryEvents,
    WrapsSideQuery,
    WrapsStream,
    message_converter,
)
from trio_agent.testing import Reply, TestModel

# -- the shape of a model middleware ---------------------------------------------------------------


class CallLog(WrapsChat, WrapsSideQuery):
    """Record every non-streaming call: operation, model, message count and outcome."""

    def __init__(self, log: list[str]) -> None:
        self.log = log  # shared on purpose: a sink, not request-local state

    async def wrap_chat(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        self.log.append(f"{request.operation.value} {request.model}: {len(request.messages)} messages")
        response = await call_next(request)
        self.log.append(f"{request.operation.value} -> {response.finish_reason.value}")
        return response

    async def wrap_side_query(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        return await self.wrap_chat(request, call_next)


# -- caching ----------------------------------------------------------------------------------------


class ResponseCache(WrapsChat):
    """Answer a repeated chat request from memory; the key is everything the provider would see."""

    def __init__(self) -> None:
        self.entries: dict[str, ModelResponse] = {}  # shared on purpose: the cache itself
        self.hits = 0

    @staticmethod
    def key(request: ModelRequest) -> str:
        payload = {
            "model": request.model,
            "messages": message_converter.unstructure(list(request.messages), unstructure_as=list[Message]),
            "tools": [[tool.name, tool.description, tool.parameters] for tool in request.tools],
            "options": dict(request.options),
        }
        return json.dumps(payload, sort_keys=True, default=repr)

    async def wrap_chat(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        key = self.key(request)  # request-local: a local variable, never an attribute
        cached = self.entries.get(key)
        if cached is not None:
            self.hits += 1
            return cached  # short-circuit: the inner layers and the provider do not run
        response = await call_next(request)
        if response.finish_reason is FinishReason.STOP:  # never cache a truncated or tool-calling turn
            self.entries[key] = response
        return response


# -- routing by options -------------------------------------------------------------------------------


class TemperatureByTools(WrapsChat, WrapsStream):
    """Route by options: deterministic sampling when many tools are offered, more freedom when none are."""

    @staticmethod
    def route(request: ModelRequest) -> ModelRequest:
        if "temperature" in request.options:  # the caller decided
            return request
        temperature = 0.0 if len(request.tools) >= 3 else 0.2 if request.tools else 0.7
        return request.replace(options={**request.options, "temperature": temperature})

    async def wrap_chat(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        return await call_next(self.route(request))

    async def wrap_stream(self, request: ModelRequest, call_next: StreamNext) -> AsyncIterator[StreamChunk]:
        async for chunk in call_next(self.route(request)):
            yield chunk


class SwitchToSmallModel(WrapsChat):
    """WRONG: a middleware cannot change the model; the service rejects the request."""

    async def wrap_chat(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        return await call_next(attrs.evolve(request, model="small-model"))


def service_for(service: ModelService, messages: Sequence[Message]) -> ModelService:
    """Pick the model before the call: a new provider service wrapped with the same middleware stack."""
    return service.with_model("long-context-model") if len(messages) > 20 else service


# -- policy -------------------------------------------------------------------------------------------------

SECRET = re.compile(r"\b(?:sk-[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16})\b")


class SecretInPromptError(ModelError):
    """A request was blocked because it contains something that looks like a credential."""


def message_text(message: Message) -> str:
    """The text a message carries, whatever its kind."""
    if isinstance(message, AssistantMessage):
        return " ".join([message.text, *(call.arguments for call in message.tool_calls)])
    return message.content


class BlockSecrets(WrapsChat, WrapsSideQuery, WrapsStream, WrapsChatWithRetryEvents):
    """Refuse to send a request whose messages contain a credential; the provider is never called."""

    @staticmethod
    def check(request: ModelRequest) -> None:
        for index, message in enumerate(request.messages):
            if SECRET.search(message_text(message)):
                raise SecretInPromptError(
                    f"message {index} contains what looks like a credential; request blocked",
                    code="SECRET_IN_PROMPT",
                    retryable=False,
                )

    async def wrap_chat(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        self.check(request)
        return await call_next(request)

    async def wrap_side_query(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        self.check(request)
        return await call_next(request)

    async def wrap_stream(self, request: ModelRequest, call_next: StreamNext) -> AsyncIterator[StreamChunk]:
        self.check(request)
        async for chunk in call_next(request):
            yield chunk

    async def wrap_chat_with_retry_events(
        self, request: ModelRequest, call_next: EventsNext
    ) -> AsyncIterator[RetryEvent | ModelResponse]:
        self.check(request)
        async for item in call_next(request):
            yield item


# -- timing and metrics for streams --------------------------------------------------------------------------


@attrs.frozen
class StreamStats:
    model: str
    chunks: int
    first_chunk_after: float | None  # seconds from the start to the first chunk
    duration: float
    outcome: str  # "completed", "closed early", or the exception's class name


class StreamMetrics:  # no base class: any object with the hooks it needs
    """Time to first chunk, chunk count and duration of every stream, however it ends."""

    def __init__(self, sink: list[StreamStats]) -> None:
        self.sink = sink  # shared on purpose: where the figures go

    async def wrap_stream(self, request: ModelRequest, call_next: StreamNext) -> AsyncIterator[StreamChunk]:
        started = trio.current_time()
        chunks = 0
        first: float | None = None
        outcome = "closed early"
        try:
            async for chunk in call_next(request):
                if first is None:
                    first = trio.current_time() - started
                chunks += 1
                yield chunk  # at once: never collect chunks before passing them on
            outcome = "completed"
        except GeneratorExit:  # the consumer stopped early and the service is closing us
            raise
        except BaseException as exc:  # a provider error, a deadline (Cancelled), ...
            outcome = type(exc).__name__
            raise
        finally:
            self.sink.append(StreamStats(request.model, chunks, first, trio.current_time() - started, outcome))


# -- retry events --------------------------------------------------------------------------------------------


class RetryReporter(WrapsChatWithRetryEvents):
    """Tell the user when the service is about to retry; every item is passed on unchanged."""

    def __init__(self, notify: Callable[[str], None]) -> None:
        self.notify = notify

    async def wrap_chat_with_retry_events(
        self, request: ModelRequest, call_next: EventsNext
    ) -> AsyncIterator[RetryEvent | ModelResponse]:
        async for item in call_next(request):
            if isinstance(item, RetryEvent):
                self.notify(f"attempt {item.attempt} failed ({item.error.code}); retrying in {item.delay:g} s")
            yield item


# -- using a service -----------------------------------------------------------------------------------------


def build_service(provider: Provider, log: list[str], metrics: list[StreamStats]) -> ModelService:
    """The examples in one stack; the first entry is the outermost layer."""
    return ModelService(
        provider,
        [BlockSecrets(), CallLog(log), TemperatureByTools(), ResponseCache(), StreamMetrics(metrics)],
        retry=RetryPolicy(max_attempts=4, base_delay=0.5, max_delay=20.0),
        request_timeout=120,
    )


async def stream_text(service: ModelService, prompt: str) -> str:
    """Collect a streamed reply; leaving the block closes every layer and then the HTTP response."""
    parts: list[str] = []
    async with service.stream([UserMessage(prompt)]) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, TextDelta):
                parts.append(chunk.text)
    return "".join(parts)


async def first_sentence(service: ModelService, prompt: str) -> str:
    """Stop reading at the first full stop: the rest of the stream is closed, not drained."""
    text = ""
    async with service.stream([UserMessage(prompt)]) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, TextDelta):
                text += chunk.text
                if text.endswith("."):
                    break
    return text


async def chat_with_progress(service: ModelService, prompt: str) -> ModelResponse:
    """Wait for a reply while retry events arrive; the last item is the response."""
    async with service.chat_with_retry_events([UserMessage(prompt)]) as events:
        async for item in events:
            if isinstance(item, ModelResponse):
                return item
    raise ModelError("the retry-events stream ended without a response")


# == demos: run the examples against the TestModel ===========================================================

SEARCH = ToolSpec("search", "Search the docs", {"type": "object"})
READ = ToolSpec("read", "Read a file", {"type": "object"})
WRITE = ToolSpec("write", "Write a file", {"type": "object"})


async def demo_call_log() -> tuple[list[str], list[ModelRequest]]:
    log: list[str] = []
    model = TestModel(default=Reply("fine"))
    service = ModelService(model, [CallLog(log)])
    await service.chat([UserMessage("how are you?")])
    await service.side_query([UserMessage("summarise"), UserMessage("the conversation")])
    async with service.stream([UserMessage("streams are not logged")]) as chunks:
        async for _ in chunks:
            pass
    return log, model.requests


@attrs.frozen
class CacheDemo:
    texts: list[str]
    hits: int
    provider_calls: int


async def demo_cache() -> CacheDemo:
    model = TestModel(
        {
            "capital of France?": [Reply("Paris"), Reply("Paris, again")],
            "tell me a story": [Reply("Once upon", finish_reason=FinishReason.LENGTH), Reply("Once upon a time")],
        }
    )
    cache = ResponseCache()
    service = ModelService(model, [cache])
    texts = []
    for prompt, options in [
        ("capital of France?", None),
        ("capital of France?", None),  # hit
        ("capital of France?", {"temperature": 0.1}),  # other options: a miss
        ("tell me a story", None),  # truncated: not stored
        ("tell me a story", None),
    ]:
        response = await service.chat([UserMessage(prompt)], options=options)
        texts.append(response.message.text)
    return CacheDemo(texts, cache.hits, len(model.requests))


async def demo_routing() -> tuple[list[Any], list[Any]]:
    """The temperature the provider saw for 0, 1 and 3 tools and for an explicit choice, then for streams."""
    model = TestModel(default=Reply("ok"))
    service = ModelService(model, [TemperatureByTools()])
    await service.chat([UserMessage("a")])
    await service.chat([UserMessage("b")], tools=[SEARCH])
    await service.chat([UserMessage("c")], tools=[SEARCH, READ, WRITE])
    await service.chat([UserMessage("d")], tools=[SEARCH, READ, WRITE], options={"temperature": 1.0})
    chat_temperatures = [request.options["temperature"] for request in model.requests]
    model.requests.clear()
    async with service.stream([UserMessage("e")], tools=[SEARCH]) as chunks:
        async for _ in chunks:
            pass
    return chat_temperatures, [request.options["temperature"] for request in model.requests]


async def demo_switch_model() -> tuple[str, int, list[str]]:
    """The wrong way fails before the provider is called; the right way uses with_model."""
    model = TestModel(default=Reply("ok"), model="big-model")
    wrong = ModelService(model, [SwitchToSmallModel()])
    try:
        await wrong.chat([UserMessage("hi")])
    except ModelMiddlewareError as exc:
        error = str(exc)
    else:  # pragma: no cover - the service always rejects it
        error = ""
    calls_after_wrong = len(model.requests)
    service = ModelService(model, [TemperatureByTools()])
    short = [UserMessage("hi")]
    long = [UserMessage(f"message {i}") for i in range(30)]
    models = []
    for messages in (short, long):
        response = await service_for(service, messages).chat(messages)
        models.append(response.model)
    return error, calls_after_wrong, models


@attrs.frozen
class PolicyDemo:
    blocked: dict[str, str]  # operation -> error code
    provider_calls_while_blocked: int
    allowed_text: str


async def demo_policy() -> PolicyDemo:
    model = TestModel(default=Reply("sure"))
    service = ModelService(model, [BlockSecrets()])
    leaked = [UserMessage("deploy with key sk-abcdefghijklmnopqrstuvwxyz123456 please")]
    blocked: dict[str, str] = {}

    async def attempt(name: str, run: Callable[[], Awaitable[Any]]) -> None:
        try:
            await run()
        except SecretInPromptError as exc:
            blocked[name] = exc.code

    async def stream() -> None:
        async with service.stream(leaked) as chunks:
            async for _ in chunks:
                pass

    async def events() -> None:
        async with service.chat_with_retry_events(leaked) as items:
            async for _ in items:
                pass

    await attempt("chat", lambda: service.chat(leaked))
    await attempt("side_query", lambda: service.side_query(leaked))
    await attempt("stream", stream)
    await attempt("chat_with_retry_events", events)
    calls = len(model.requests)
    allowed = await service.chat([UserMessage("deploy with the key from the vault please")])
    return PolicyDemo(blocked, calls, allowed.message.text)


async def demo_metrics() -> list[StreamStats]:
    """A complete stream, one closed early and one failing after two chunks."""
    stats: list[StreamStats] = []
    cut = ProviderServerError("connection reset", status=502)
    model = TestModel(
        {
            "complete": [Reply("one two three", latency=0.25)],
            "early": [Reply("First sentence. Second sentence.", latency=0.1)],
            "failing": [Reply("a b c d", error=cut, fail_after_chunks=2)],
        }
    )
    service = ModelService(model, [StreamMetrics(stats)])
    await stream_text(service, "complete")
    await first_sentence(service, "early")
    with contextlib.suppress(StreamInterruptedError):
        await stream_text(service, "failing")
    return stats


async def demo_retry_events() -> tuple[list[str], str, int]:
    notes: list[str] = []
    model = TestModel(
        {
            "hello": [
                Reply(error=RateLimitError("slow down", retry_after=0.2)),
                Reply(error=ProviderServerError("overloaded", status=529)),
                Reply("hello!"),
            ]
        }
    )
    service = ModelService(model, [RetryReporter(notes.append)], retry=RetryPolicy(base_delay=0.05, jitter=False))
    response = await chat_with_progress(service, "hello")
    return notes, response.message.text, len(model.requests)


async def demo_stack() -> tuple[list[str], str, str, list[StreamStats]]:
    log: list[str] = []
    metrics: list[StreamStats] = []
    model = TestModel(default=Reply("All good. Nothing else."))
    service = build_service(model, log, metrics)
    first = await service.chat([UserMessage("status?")])
    second = await service.chat([UserMessage("status?")])  # the cache answers; CallLog still logs it
    assert first is second
    streamed = await first_sentence(service, "status, streamed?")
    return log, first.message.text, streamed, metrics


async def main() -> None:
    print("1. call log")
    log, requests = await demo_call_log()
    for line in log:
        print(f"   {line}")
    print(f"   provider saw {len(requests)} requests")

    print("2. cache")
    cache = await demo_cache()
    print(f"   answers {cache.texts}; hits={cache.hits}; provider calls={cache.provider_calls}")

    print("3. routing by options")
    chat_temperatures, stream_temperatures = await demo_routing()
    print(f"   chat temperatures {chat_temperatures}; stream temperatures {stream_temperatures}")
    error, calls, models = await demo_switch_model()
    print(f"   switching the model in middleware: {error!r} (provider calls: {calls})")
    print(f"   with_model before the call: {models}")

    print("4. policy")
    policy = await demo_policy()
    print(f"   blocked {policy.blocked}; provider calls while blocked: {policy.provider_calls_while_blocked}")
    print(f"   clean request answered {policy.allowed_text!r}")

    print("5. stream metrics")
    for stat in await demo_metrics():
        print(f"   {stat}")

    print("6. retry events")
    notes, text, calls = await demo_retry_events()
    for note in notes:
        print(f"   {note}")
    print(f"   -> {text!r} after {calls} provider calls")

    print("7. all examples in one stack")
    log, text, streamed, metrics = await demo_stack()
    print(f"   log {log}")
    print(f"   chat {text!r}; first streamed sentence {streamed!r}; stream stats {metrics}")


if __name__ == "__main__":
    trio.run(main)
