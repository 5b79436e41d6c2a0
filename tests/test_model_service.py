"""ModelService with the TestModel: composition, invariants, streams, retries, deadlines, with_model, concurrency."""

from __future__ import annotations

import math
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cancel_helpers import cancelled_of_its_own, nursery_failing_in_cleanup
from trio_agent import (
    AuthenticationError,
    ConfigError,
    ModelError,
    ModelMiddleware,
    ModelTimeoutError,
    ProviderError,
    RateLimitError,
    chat,
)
from trio_agent._models._service import _chunk_ok, _chunk_problem, _response_ok, _response_problem
from trio_agent.middleware import MiddlewareShapeError, NextCalledTwiceError
from trio_agent.models import (
    AssistantMessage,
    FinishChunk,
    FinishReason,
    ModelAbortedError,
    ModelConnectionError,
    ModelMiddlewareError,
    ModelRequest,
    ModelResponse,
    ModelService,
    Operation,
    ProviderServerError,
    ReasoningDelta,
    ReasoningPart,
    RetryEvent,
    RetryPolicy,
    StreamChunk,
    StreamInterruptedError,
    SystemMessage,
    TextDelta,
    TextPart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallPart,
    ToolCallStart,
    ToolSpec,
    Usage,
    UsageChunk,
    UserMessage,
    WrapsChat,
    WrapsStream,
)
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import AbortHandle

MESSAGES = [UserMessage("hello")]
NO_JITTER = RetryPolicy(jitter=False)
WRAPPER = {
    Operation.CHAT: "wrap_chat",
    Operation.SIDE_QUERY: "wrap_side_query",
    Operation.STREAM: "wrap_stream",
    Operation.CHAT_WITH_RETRY_EVENTS: "wrap_chat_with_retry_events",
}
ALL_OPS = list(Operation)
CHAT_OPS = [Operation.CHAT, Operation.SIDE_QUERY, Operation.CHAT_WITH_RETRY_EVENTS]
CANNED = ModelResponse(AssistantMessage((TextPart("from the cache"),)), FinishReason.STOP)


# -- helpers ------------------------------------------------------------------------------------------


async def run_op(
    service: ModelService,
    op: Operation,
    messages: list[Any] = MESSAGES,
    *,
    options: dict[str, Any] | None = None,
    abort: AbortHandle | None = None,
) -> Any:
    """Run *op*; chat and side_query return the response, the iterator operations a list of items."""
    if op is Operation.CHAT:
        return await service.chat(messages, options=options, abort=abort)
    if op is Operation.SIDE_QUERY:
        return await service.side_query(messages, options=options, abort=abort)
    if op is Operation.STREAM:
        async with service.stream(messages, options=options, abort=abort) as chunks:
            return [chunk async for chunk in chunks]
    async with service.chat_with_retry_events(messages, options=options, abort=abort) as events:
        return [event async for event in events]


def final_text(op: Operation, result: Any) -> str:
    if op in (Operation.CHAT, Operation.SIDE_QUERY):
        return str(result.message.text)
    if op is Operation.STREAM:
        return "".join(chunk.text for chunk in result if isinstance(chunk, TextDelta))
    assert isinstance(result[-1], ModelResponse)
    return str(result[-1].message.text)


Transform = Callable[[ModelRequest], Any]


def make_layer(
    op: Operation,
    name: str,
    log: list[str],
    *,
    transform: Transform | None = None,
    short: bool = False,
) -> object:
    """A middleware defining only *op*'s wrapper: logs ``name>`` / ``name<``, may transform or short-circuit."""

    def forward(request: ModelRequest) -> Any:
        return request if transform is None else transform(request)

    if op in (Operation.CHAT, Operation.SIDE_QUERY):

        async def wrap(self: object, request: ModelRequest, next: Any) -> ModelResponse:
            log.append(f"{name}>")
            if short:
                return CANNED
            response = await next(forward(request))
            log.append(f"{name}<")
            return response

    else:
        short_item: Any = TextDelta("short") if op is Operation.STREAM else CANNED

        async def wrap(self: object, request: ModelRequest, next: Any) -> AsyncIterator[Any]:  # type: ignore[misc]
            log.append(f"{name}>")
            if short:
                yield short_item
                return
            async for item in next(forward(request)):
                yield item
            log.append(f"{name}<")

    return type(f"Layer_{name}", (), {WRAPPER[op]: wrap})()


# -- composition ----------------------------------------------------------------------------------------


async def test_each_operation_composes_only_the_middleware_defining_its_wrapper() -> None:
    log: list[str] = []

    class ChatAndStream(ModelMiddleware):
        async def wrap_chat(self, request: ModelRequest, call_next: Any) -> ModelResponse:
            log.append("A.chat>")
            response = await call_next(request)
            log.append("A.chat<")
            return response

        async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
            log.append("A.stream>")
            async for chunk in call_next(request):
                yield chunk
            log.append("A.stream<")

    class SideOnly(ModelMiddleware):
        async def wrap_side_query(self, request: ModelRequest, call_next: Any) -> ModelResponse:
            log.append("B.side>")
            response = await call_next(request)
            log.append("B.side<")
            return response

    class EventsOnly(ModelMiddleware):
        async def wrap_chat_with_retry_events(self, request: ModelRequest, call_next: Any) -> AsyncIterator[Any]:
            log.append("C.events>")
            async for item in call_next(request):
                yield item
            log.append("C.events<")

    class ChatOnly:  # duck-typed: no base class needed
        async def wrap_chat(self, request: ModelRequest, call_next: Any) -> ModelResponse:
            log.append("D.chat>")
            response = await call_next(request)
            log.append("D.chat<")
            return response

    model = TestModel(default=Reply("hi"))
    service = ModelService(model, [ChatAndStream(), SideOnly(), EventsOnly(), ChatOnly()])
    expected = {
        Operation.CHAT: ["A.chat>", "D.chat>", "D.chat<", "A.chat<"],
        Operation.SIDE_QUERY: ["B.side>", "B.side<"],
        Operation.STREAM: ["A.stream>", "A.stream<"],
        Operation.CHAT_WITH_RETRY_EVENTS: ["C.events>", "C.events<"],
    }
    for op in ALL_OPS:
        log.clear()
        result = await run_op(service, op)
        assert final_text(op, result) == "hi"
        assert log == expected[op], op
    assert [request.operation for request in model.requests] == ALL_OPS


@pytest.mark.parametrize("op", ALL_OPS)
async def test_first_registered_is_outermost(op: Operation) -> None:
    log: list[str] = []
    model = TestModel(default=Reply("ok"))
    service = ModelService(model, [make_layer(op, name, log) for name in "abc"])
    assert final_text(op, await run_op(service, op)) == "ok"
    assert log == ["a>", "b>", "c>", "c<", "b<", "a<"]


@pytest.mark.parametrize("op", ALL_OPS)
async def test_short_circuit_skips_inner_layers_and_the_provider(op: Operation) -> None:
    log: list[str] = []
    model = TestModel(default=Reply("real"))
    layers = [make_layer(op, "a", log), make_layer(op, "cache", log, short=True), make_layer(op, "c", log)]
    result = await run_op(ModelService(model, layers), op)
    assert final_text(op, result) in {"from the cache", "short"}
    assert log == ["a>", "cache>", "a<"]
    assert model.requests == []


@pytest.mark.parametrize("op", ALL_OPS)
async def test_middleware_may_transform_messages_tools_and_options(op: Operation) -> None:
    log: list[str] = []
    seen_by_inner: list[ModelRequest] = []
    spec = ToolSpec("lookup", "Look something up", {"type": "object"})

    def add_system_and_temperature(request: ModelRequest) -> ModelRequest:
        return request.replace(
            messages=[SystemMessage("be terse"), *request.messages],
            options={**request.options, "temperature": 0.2},
        )

    def add_tool(request: ModelRequest) -> ModelRequest:
        seen_by_inner.append(request)
        return request.replace(tools=[*request.tools, spec])

    model = TestModel(default=Reply("ok"))
    service = ModelService(
        model,
        [
            make_layer(op, "outer", log, transform=add_system_and_temperature),
            make_layer(op, "inner", log, transform=add_tool),
        ],
    )
    await run_op(service, op, options={"conversation_id": "c1"})
    assert seen_by_inner[0].messages == (SystemMessage("be terse"), *MESSAGES)
    [sent] = model.requests
    assert sent.operation is op and sent.model == "test-model"
    assert sent.messages == (SystemMessage("be terse"), UserMessage("hello"))
    assert sent.tools == (spec,)
    assert dict(sent.options) == {"conversation_id": "c1", "temperature": 0.2}


# -- invariants: operation, model and abort --------------------------------------------------------------


def _other_op(op: Operation) -> Operation:
    return ALL_OPS[(ALL_OPS.index(op) + 1) % len(ALL_OPS)]


CHANGES: dict[str, tuple[Transform, str]] = {
    "operation": (lambda r: attrs.evolve(r, operation=_other_op(r.operation)), "cannot change the model operation"),
    "model": (lambda r: attrs.evolve(r, model="some-other-model"), "cannot change the active model"),
    "abort-replaced": (lambda r: attrs.evolve(r, abort=AbortHandle()), "cannot replace the abort handle"),
    "abort-dropped": (lambda r: attrs.evolve(r, abort=None), "cannot replace the abort handle"),
    "not-a-request": (lambda r: {"model": r.model}, r"next\(\) takes a ModelRequest"),
}


@pytest.mark.parametrize("inner", ["short-circuit", "provider"])
@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("op", ALL_OPS)
async def test_changing_operation_model_or_abort_is_rejected_at_every_boundary(
    op: Operation, change: str, position: int, inner: str
) -> None:
    transform, message = CHANGES[change]
    log: list[str] = []
    layers = [make_layer(op, f"pass{i}", log) for i in range(position)]
    layers.append(make_layer(op, "changer", log, transform=transform))
    if inner == "short-circuit":
        layers.append(make_layer(op, "short", log, short=True))
    model = TestModel(default=Reply("never"))
    with pytest.raises(ModelMiddlewareError, match=message):
        await run_op(ModelService(model, layers), op, abort=AbortHandle())
    assert log == [f"pass{i}>" for i in range(position)] + ["changer>"], "no inner layer ran"
    assert len(model.requests) == 0, "the provider was never called"


@pytest.mark.parametrize("op", [Operation.STREAM, Operation.CHAT_WITH_RETRY_EVENTS])
async def test_call_refuses_streaming_operations_as_the_caller_s_mistake(op: Operation) -> None:
    """The caller's request, not a layer's change: it was a ModelMiddlewareError, with no middleware."""
    model = TestModel(default=Reply("x"))
    service = ModelService(model)
    with pytest.raises(ConfigError, match=f"call\\(\\) runs chat or side_query requests, not {op.value}"):
        await service.call(service.request(op, MESSAGES))
    assert model.requests == []


async def test_call_refuses_a_request_for_another_model_or_what_is_no_request() -> None:
    """A request prepared on with_model()'s service was sent by this one, to the other model (and
    anything else failed as a bare AttributeError): the door checks as a layer's boundary does."""
    model = TestModel(default=Reply("x"), model="small-model")
    service = ModelService(model)
    foreign = service.with_model("huge-model").request(Operation.CHAT, MESSAGES)
    with pytest.raises(ConfigError, match="for model 'huge-model', and this service sends to 'small-model'"):
        await service.call(foreign)
    with pytest.raises(ConfigError, match="call\\(\\) takes a ModelRequest, not dict"):
        await service.call({"operation": "chat"})  # type: ignore[arg-type]
    assert model.requests == []
    own = ModelRequest(Operation.SIDE_QUERY, "small-model", MESSAGES)  # the same model, built by hand: fine
    assert (await service.call(own)).message.text == "x"
    assert [request.model for request in model.requests] == ["small-model"]


# -- next() twice and failing middleware ---------------------------------------------------------------------


def twice_layer(op: Operation) -> object:
    if op in (Operation.CHAT, Operation.SIDE_QUERY):

        async def wrap(self: object, request: ModelRequest, next: Any) -> ModelResponse:
            await next(request)
            return await next(request)

    else:

        async def wrap(self: object, request: ModelRequest, next: Any) -> AsyncIterator[Any]:  # type: ignore[misc]
            async for item in next(request):
                yield item
            async for item in next(request):
                yield item

    return type("Twice", (), {WRAPPER[op]: wrap})()


@pytest.mark.parametrize("op", ALL_OPS)
async def test_next_called_twice_is_an_error_and_the_provider_runs_once(op: Operation) -> None:
    model = TestModel(default=Reply("once"))
    with pytest.raises(ModelMiddlewareError) as caught:
        await run_op(ModelService(model, [make_layer(op, "outer", []), twice_layer(op)]), op)
    assert isinstance(caught.value.__cause__, NextCalledTwiceError)
    assert len(model.requests) == 1


def raising_layer(op: Operation, error: BaseException, *, after_next: bool) -> object:
    if op in (Operation.CHAT, Operation.SIDE_QUERY):

        async def wrap(self: object, request: ModelRequest, next: Any) -> ModelResponse:
            if after_next:
                await next(request)
            raise error

    else:

        async def wrap(self: object, request: ModelRequest, next: Any) -> AsyncIterator[Any]:  # type: ignore[misc]
            if after_next:
                async for item in next(request):
                    yield item
            raise error

    return type("Raising", (), {WRAPPER[op]: wrap})()


@pytest.mark.parametrize("after_next", [False, True])
@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_raising_middleware_becomes_model_middleware_error_with_its_cause(
    op: Operation, after_next: bool
) -> None:
    error = ValueError("middleware bug")
    model = TestModel(default=Reply("x"))
    service = ModelService(model, [make_layer(op, "outer", []), raising_layer(op, error, after_next=after_next)])
    with pytest.raises(ModelMiddlewareError) as caught:
        await run_op(service, op)
    assert caught.value.__cause__ is error
    assert len(model.requests) == int(after_next)


@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_model_error_raised_by_middleware_passes_unchanged(op: Operation) -> None:
    error = ModelError("blocked by policy", code="POLICY_BLOCKED")
    model = TestModel(default=Reply("x"))
    with pytest.raises(ModelError) as caught:
        await run_op(ModelService(model, [raising_layer(op, error, after_next=False)]), op)
    assert caught.value is error
    assert model.requests == []


@pytest.mark.parametrize(
    "error",
    [
        AuthenticationError("bad key", status=401),
        ProviderError("bad request", status=400),
        ModelError("plain", code="X"),
    ],
    ids=["auth", "400", "plain"],
)
@pytest.mark.parametrize("op", ALL_OPS)
async def test_provider_model_errors_propagate_unchanged(op: Operation, error: ModelError) -> None:
    log: list[str] = []
    model = TestModel(default=Reply(error=error))
    service = ModelService(model, [make_layer(op, "a", log), make_layer(op, "b", log)], retry=NO_JITTER)
    with pytest.raises(ModelError) as caught:
        await run_op(service, op)
    assert caught.value is error
    assert log == ["a>", "b>"]
    assert len(model.requests) == 1


class BrokenProvider:
    """A provider with a bug: it raises a plain exception, not a ModelError."""

    name = "broken"
    model = "m"

    def __init__(self, error: Exception, *, after_chunks: int = 0) -> None:
        self.error = error
        self.after_chunks = after_chunks
        self.calls = 0

    def with_model(self, model: str) -> BrokenProvider:
        return self

    async def chat(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        raise self.error

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        self.calls += 1
        for index in range(self.after_chunks):
            yield TextDelta(str(index))
        raise self.error


@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_provider_bug_becomes_a_typed_model_error_and_is_not_retried(op: Operation) -> None:
    error = KeyError("choices")
    provider = BrokenProvider(error)
    with pytest.raises(ModelError) as caught:
        await run_op(ModelService(provider, [make_layer(op, "a", [])], retry=NO_JITTER), op)
    assert type(caught.value) is ModelError
    assert caught.value.code == "provider_failed" and not caught.value.retryable
    assert caught.value.__cause__ is error
    assert provider.calls == 1


class EagerChatProvider(BrokenProvider):
    """A provider whose chat is a plain def that fails building its request (raising when called,
    before any await), or an async def that raises ``StopAsyncIteration`` (an exhausted iterator
    read inside it)."""

    def chat(self, request: ModelRequest) -> Any:  # type: ignore[override]
        self.calls += 1
        if isinstance(self.error, StopAsyncIteration):
            return self._stops()
        raise self.error

    async def _stops(self) -> ModelResponse:
        await trio.lowlevel.checkpoint()
        raise self.error


@pytest.mark.parametrize("error", [ValueError("bad request body"), StopAsyncIteration()], ids=["sync", "stop"])
@pytest.mark.parametrize("op", CHAT_OPS)
async def test_a_provider_chat_bug_raised_when_called_or_a_stop_is_a_provider_error_not_middleware(
    op: Operation, error: Exception
) -> None:
    """Both escaped the provider's typing as themselves and were blamed on the middleware (with none)."""
    provider = EagerChatProvider(error)
    with pytest.raises(ModelError) as caught:
        await run_op(ModelService(provider, retry=NO_JITTER), op)
    assert type(caught.value) is ModelError
    assert caught.value.code == "provider_failed" and not caught.value.retryable
    assert caught.value.__cause__ is error
    assert provider.calls == 1


async def test_a_provider_bug_after_published_chunks_interrupts_the_stream() -> None:
    error = KeyError("delta")
    provider = BrokenProvider(error, after_chunks=2)
    received: list[StreamChunk] = []
    with pytest.raises(StreamInterruptedError) as caught:
        async with ModelService(provider, retry=NO_JITTER).stream(MESSAGES) as chunks:
            async for chunk in chunks:
                received.append(chunk)
    assert received == [TextDelta("0"), TextDelta("1")]
    assert caught.value.code == "provider_failed"
    assert caught.value.__cause__.__cause__ is error  # type: ignore[union-attr]


def wrong_item_layer(op: Operation, item: object) -> object:
    """A layer that calls the inner layers and then answers (chat) or yields (iterators) *item*."""
    if op in (Operation.CHAT, Operation.SIDE_QUERY):

        async def wrap(self: object, request: ModelRequest, next: Any) -> Any:
            await next(request)
            return item

    else:

        async def wrap(self: object, request: ModelRequest, next: Any) -> AsyncIterator[Any]:  # type: ignore[misc]
            async for _ in next(request):
                yield item

    return type("WrongItem", (), {WRAPPER[op]: wrap})()


@pytest.mark.parametrize("item", [None, {"text": "a"}, "junk", TextDelta("a")], ids=["none", "dict", "str", "other"])
@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_layer_answering_the_wrong_type_is_a_model_middleware_error_naming_it(op: Operation, item: Any) -> None:
    if op is Operation.STREAM and isinstance(item, TextDelta):
        item = CANNED  # a chunk is right for a stream: a response is not
    service = ModelService(TestModel(default=Reply("x")), [make_layer(op, "outer", []), wrong_item_layer(op, item)])
    expected = rf"model middleware #0 \(Layer_outer\): {WRAPPER[op]} .*inner layer"
    with pytest.raises(ModelMiddlewareError, match=expected) as caught:
        await run_op(service, op)
    assert ("None" if item is None else type(item).__name__) in str(caught.value)
    service = ModelService(TestModel(default=Reply("x")), [wrong_item_layer(op, item)])
    with pytest.raises(ModelMiddlewareError, match=rf"#0 \(WrongItem\): {WRAPPER[op]} (returned|yielded)"):
        await run_op(service, op)


# Responses whose usage a streamed UsageChunk could not carry: ModelService.chat let them through
# (unchecked), to be added to a run's totals and journalled, against the MAX_TOKEN_COUNT rule.
BAD_USAGES = {
    "negative": (Usage(-5, 1, 1), r"usage\.input_tokens is int -5, not an int from 0 to 9007199254740991"),
    "float": (Usage(1, 1.5, 2), r"usage\.output_tokens is float 1\.5, not an int"),  # type: ignore[arg-type]
    "past-the-bound": (Usage(1, 1, 2**70), r"usage\.total_tokens is int 1180591620717411303424, not an int"),
    "detail": (Usage(1, 1, 2, reasoning_tokens=-1), r"usage\.reasoning_tokens is int -1, not an int .* or None"),
    "no-usage": (None, r"usage is None, not a Usage"),
}


class UsageProvider(TestModel):
    """A custom provider whose chat answers a response with *usage* as given."""

    def __init__(self, usage: Any) -> None:
        super().__init__(default=Reply("unused"))
        self.usage = usage

    async def chat(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        return ModelResponse(AssistantMessage((TextPart("x"),)), FinishReason.STOP, self.usage)


@pytest.mark.parametrize(("usage", "words"), BAD_USAGES.values(), ids=BAD_USAGES.keys())
@pytest.mark.parametrize("op", CHAT_OPS)
async def test_a_provider_response_whose_usage_a_stream_could_not_carry_is_a_provider_failed_error(
    op: Operation, usage: Any, words: str
) -> None:
    provider = UsageProvider(usage)
    with pytest.raises(ModelError) as caught:
        await run_op(ModelService(provider, retry=NO_JITTER), op)
    assert type(caught.value) is ModelError and caught.value.code == "provider_failed"
    assert re.search(f"the provider's chat returned a ModelResponse whose {words}", str(caught.value))
    assert len(provider.requests) == 1  # a provider bug: not retried


@pytest.mark.parametrize(("usage", "words"), BAD_USAGES.values(), ids=BAD_USAGES.keys())
@pytest.mark.parametrize("op", CHAT_OPS)
async def test_a_layer_response_whose_usage_a_stream_could_not_carry_is_a_model_middleware_error(
    op: Operation, usage: Any, words: str
) -> None:
    bad = ModelResponse(AssistantMessage((TextPart("x"),)), FinishReason.STOP, usage)
    service = ModelService(TestModel(default=Reply("x")), [wrong_item_layer(op, bad)])
    with pytest.raises(ModelMiddlewareError) as caught:
        await run_op(service, op)
    assert re.search(
        rf"#0 \(WrongItem\): {WRAPPER[op]} (returned|yielded) a ModelResponse whose {words}", str(caught.value)
    )


@pytest.mark.parametrize("op", CHAT_OPS)
async def test_a_response_with_every_count_at_its_bound_passes(op: Operation) -> None:
    top = 2**53 - 1
    usage = Usage(top, top, top, cached_input_tokens=0, cache_creation_input_tokens=top, reasoning_tokens=None)
    result = await run_op(ModelService(UsageProvider(usage)), op)
    response = result[-1] if op is Operation.CHAT_WITH_RETRY_EVENTS else result
    assert response.usage == usage


class TextDeltaPlus(TextDelta):
    """A chunk of a subclass: still a chunk."""


async def test_a_subclass_of_a_chunk_type_passes() -> None:
    async def wrap(self: object, request: ModelRequest, next: Any) -> AsyncIterator[Any]:
        async for chunk in next(request):
            yield TextDeltaPlus(chunk.text) if isinstance(chunk, TextDelta) else chunk

    layer = type("Plus", (), {"wrap_stream": wrap})()
    chunks = await run_op(ModelService(TestModel(default=Reply("a b")), [layer]), Operation.STREAM)
    assert [type(chunk) for chunk in chunks[:2]] == [TextDeltaPlus, TextDeltaPlus]


class JunkProvider(BrokenProvider):
    """A provider with a bug: its chat answers a string, its stream yields a dict."""

    def __init__(self) -> None:
        super().__init__(ValueError("unused"))
        self.requests: list[ModelRequest] = []

    async def chat(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        return "not a response"  # type: ignore[return-value]

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        yield {"text": "a"}  # type: ignore[misc]


@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_provider_answering_the_wrong_type_is_a_provider_error_not_middleware(op: Operation) -> None:
    provider = JunkProvider()
    with pytest.raises(ModelError) as caught:
        await run_op(ModelService(provider, [make_layer(op, "a", [])], retry=NO_JITTER), op)
    assert type(caught.value) is ModelError and caught.value.code == "provider_failed"
    assert "the provider's" in str(caught.value)
    assert len(provider.requests) == 1


class ChunksProvider(TestModel):
    """A custom provider whose stream yields *chunks* as given (a stream's chunks are untrusted)."""

    def __init__(self, chunks: list[Any]) -> None:
        super().__init__(default=Reply("unused"))
        self.chunks = chunks

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[StreamChunk]:
        for chunk in self.chunks:
            await trio.lowlevel.checkpoint()
            yield chunk


class ChunksLayer(WrapsStream):
    """A layer that reads the inner stream and then yields *chunks* of its own."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        async for _ in call_next(request):
            pass
        for chunk in self.chunks:
            yield chunk


class Text(str):
    """A str subclass (what some libraries hand out): a chunk's text may be one."""


# Chunks of the right classes with a field of the wrong type: each failed far from its source, as a
# bare error (the assembler's join, the journal's reader) or not at all (carried into the history).
BAD_CHUNKS = {
    "text-none": (TextDelta(None), "a TextDelta whose text is None, not a str"),  # type: ignore[arg-type]
    "text-bytes": (TextDelta(b"x"), "a TextDelta whose text is bytes b'x', not a str"),  # type: ignore[arg-type]
    "subclass-text-int": (TextDeltaPlus(3), "a TextDeltaPlus whose text is int 3, not a str"),  # type: ignore[arg-type]
    "reasoning-signature": (
        ReasoningDelta("r", signature=5),  # type: ignore[arg-type]
        "a ReasoningDelta whose signature is int 5, not a str or None",
    ),
    "start-index-none": (ToolCallStart(None, "a", "t"), "a ToolCallStart whose index is None, not an int"),  # type: ignore[arg-type]
    "start-index-bool": (ToolCallStart(True, "a", "t"), "a ToolCallStart whose index is bool True, not an int"),
    "start-index-negative": (ToolCallStart(-1, "a", "t"), "a ToolCallStart whose index is int -1, not an int"),
    "start-index-huge": (ToolCallStart(10**5000, "", "t"), "a ToolCallStart whose index is int .*, not an int"),
    "delta-arguments": (ToolCallDelta(0, None), "a ToolCallDelta whose arguments is None, not a str"),  # type: ignore[arg-type]
    "end-id-int": (ToolCallEnd(0, 5, "t", "{}"), "a ToolCallEnd whose id is int 5, not a str"),  # type: ignore[arg-type]
    "usage-none": (UsageChunk(None), "a UsageChunk whose usage is None, not a Usage"),  # type: ignore[arg-type]
    "usage-dict": (UsageChunk({"input_tokens": 1}), "a UsageChunk whose usage is dict .*, not a Usage"),  # type: ignore[arg-type]
    # A float count was journalled, and every later reopening of the session failed (JournalCorruptError).
    "usage-float": (
        UsageChunk(Usage(12.0, 3.0, 15.0)),  # type: ignore[arg-type]
        r"a UsageChunk whose usage.input_tokens is float 12.0, not an int from 0 to 9007199254740991",
    ),
    "usage-bool": (UsageChunk(Usage(1, True, 2)), "a UsageChunk whose usage.output_tokens is bool True, not an int"),
    "usage-negative-detail": (
        UsageChunk(Usage(1, 1, 2, reasoning_tokens=-1)),
        r"a UsageChunk whose usage.reasoning_tokens is int -1, not an int from 0 to \d+ or None",
    ),
    "usage-huge": (UsageChunk(Usage(2**53, 0, 2**53)), "a UsageChunk whose usage.input_tokens is int 9007199254740992"),
    "finish-str": (FinishChunk("stop"), "a FinishChunk whose reason is str 'stop', not a FinishReason"),  # type: ignore[arg-type]
    "finish-explanation": (
        FinishChunk(FinishReason.REFUSAL, 1),  # type: ignore[arg-type]
        "a FinishChunk whose explanation is int 1, not a str or None",
    ),
}


@pytest.mark.parametrize(("chunk", "words"), BAD_CHUNKS.values(), ids=BAD_CHUNKS.keys())
@pytest.mark.parametrize("layers", [0, 1], ids=["no-layer", "passing-layer"])
async def test_a_provider_chunk_with_a_field_of_the_wrong_type_is_a_provider_failed_model_error(
    chunk: Any, words: str, layers: int
) -> None:
    """A class-only check let them through, to escape as a bare TypeError or AttributeError (or be
    journalled). Through a layer that passes it on, the provider is still blamed, not the layer."""
    provider = ChunksProvider([chunk, FinishChunk(FinishReason.STOP)])
    service = ModelService(provider, [Tap("tap", [])][:layers], retry=NO_JITTER)
    with pytest.raises(ModelError) as caught:
        await run_op(service, Operation.STREAM)
    assert type(caught.value) is ModelError and caught.value.code == "provider_failed"
    assert re.search(f"the provider's stream yielded {words}", str(caught.value))
    assert len(provider.requests) == 1  # a provider bug: not retried


async def test_a_provider_bad_chunk_after_published_ones_interrupts_the_stream() -> None:
    provider = ChunksProvider([TextDelta("a"), FinishChunk("stop")])  # type: ignore[arg-type]
    with pytest.raises(StreamInterruptedError, match="whose reason is str 'stop'") as caught:
        await run_op(ModelService(provider), Operation.STREAM)
    assert caught.value.code == "provider_failed"


@pytest.mark.parametrize(("chunk", "words"), BAD_CHUNKS.values(), ids=BAD_CHUNKS.keys())
async def test_a_layer_chunk_with_a_field_of_the_wrong_type_is_a_model_middleware_error_naming_it(
    chunk: Any, words: str
) -> None:
    service = ModelService(TestModel(default=Reply("x")), [ChunksLayer([chunk])])
    with pytest.raises(ModelMiddlewareError) as caught:
        await run_op(service, Operation.STREAM)
    assert re.search(rf"model middleware #0 \(ChunksLayer\): wrap_stream yielded {words}", str(caught.value))


async def test_chunks_with_fields_of_subclasses_or_optional_none_pass() -> None:
    chunks: list[StreamChunk] = [
        TextDelta(Text("a")),
        TextDeltaPlus("b"),
        ReasoningDelta("r", signature=None, redacted_data=None),
        ToolCallStart(0, Text("id"), "t"),
        ToolCallDelta(0, "{}"),
        ToolCallEnd(0, "id", "t", "{}"),
        UsageChunk(Usage(1, 2, 3, cached_input_tokens=0, reasoning_tokens=2**53 - 1)),
        FinishChunk(FinishReason.TOOL_CALLS, None),
    ]
    assert await run_op(ModelService(ChunksProvider(chunks)), Operation.STREAM) == chunks
    assert await run_op(ModelService(TestModel(default=Reply("x")), [ChunksLayer(chunks)]), Operation.STREAM) == chunks


# The edges first: hypothesis draws the first strategies of a one_of most often.
_COUNTS = st.one_of(
    st.sampled_from([None, -1, 2**53 - 1, 2**53, 10**30, True, 3.0, "3"]),
    st.integers(min_value=-2, max_value=3),
)
_FIELD_VALUES = st.one_of(
    _COUNTS,
    st.text(max_size=3),
    st.builds(Text, st.text(max_size=3)),
    st.binary(max_size=2),
    st.sampled_from(list(FinishReason)),
    st.builds(Usage, _COUNTS, _COUNTS, _COUNTS, _COUNTS, _COUNTS, _COUNTS),
)
_CHUNK_CLASSES = [
    TextDelta,
    TextDeltaPlus,
    ReasoningDelta,
    ToolCallStart,
    ToolCallDelta,
    ToolCallEnd,
    UsageChunk,
    FinishChunk,
]


def _mostly(good: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """*good* five times in six, else *other*: values of the right type, and now and then one that is not."""
    return st.integers(0, 5).flatmap(lambda pick: good if pick else other)


_GOOD_COUNTS = st.one_of(st.none(), st.integers(min_value=0, max_value=2**53 - 1))
_GOOD_VALUES = {
    "text": st.text(max_size=3),
    "signature": st.none() | st.text(max_size=3),
    "redacted_data": st.none() | st.text(max_size=3),
    "index": st.integers(min_value=0, max_value=2**53 - 1),
    "id": st.text(max_size=3),
    "name": st.text(max_size=3),
    "arguments": st.text(max_size=3),
    "usage": st.builds(
        Usage,
        *(_mostly(st.integers(min_value=0, max_value=5), _COUNTS) for _ in range(3)),
        *(_mostly(_GOOD_COUNTS, _COUNTS) for _ in range(3)),
    ),
    "reason": st.sampled_from(list(FinishReason)),
    "explanation": st.none() | st.text(max_size=3),
}


@st.composite
def any_chunk(draw: st.DrawFn) -> Any:
    """A chunk of any class, each field mostly of its type (else anything): both verdicts, often."""
    kind = draw(st.sampled_from(_CHUNK_CLASSES))
    fields = [field.name for field in attrs.fields(kind)]
    return kind(*(draw(_mostly(_GOOD_VALUES[name], _FIELD_VALUES)) for name in fields))


@given(any_chunk())
@settings(max_examples=1000, deadline=None)
def test_the_fast_chunk_check_and_the_explaining_one_agree(chunk: Any) -> None:
    """_chunk_ok (the fast one, exact classes and types only) never passes what _chunk_problem
    refuses, and refuses nothing of an exact class with exact field types that it passes."""
    ok, problem = _chunk_ok(chunk), _chunk_problem(chunk)
    if ok:
        assert problem is None
    values = [getattr(chunk, field.name) for field in attrs.fields(type(chunk))]
    if type(chunk) is not TextDeltaPlus and not any(type(value) is Text for value in values):
        assert ok == (problem is None), (chunk, problem)


# Responses with a field other than usage of the wrong type: the service let them through, and
# they failed far from their source as a bare AttributeError (chat(output_schema=...) reading
# ``message.parts`` of None) or a journal that could not record ``finish_reason="stop"``.
_TEXT = AssistantMessage((TextPart("x"),))
BAD_RESPONSES = {
    "message-none": (ModelResponse(None, FinishReason.STOP), r"message is None, not an AssistantMessage"),  # type: ignore[arg-type]
    "message-str": (ModelResponse("{}", FinishReason.STOP), r"message is str '\{\}', not an AssistantMessage"),  # type: ignore[arg-type]
    "part-str": (
        ModelResponse(AssistantMessage(("x",)), FinishReason.STOP),  # type: ignore[arg-type]
        r"message\.parts\[0\] is str 'x', not a TextPart, ReasoningPart or ToolCallPart",
    ),
    "part-text": (
        ModelResponse(AssistantMessage((TextPart("a"), TextPart(None))), FinishReason.STOP),  # type: ignore[arg-type]
        r"message\.parts\[1\]\.text is None, not a str$",
    ),
    "call-name": (
        ModelResponse(AssistantMessage((ToolCallPart("c1", 7, "{}"),)), FinishReason.TOOL_CALLS),  # type: ignore[arg-type]
        r"message\.parts\[0\]\.name is int 7, not a str$",
    ),
    "reasoning-signature": (
        ModelResponse(AssistantMessage((ReasoningPart("r", b"s"),)), FinishReason.STOP),  # type: ignore[arg-type]
        r"message\.parts\[0\]\.signature is bytes b's', not a str or None",
    ),
    "finish-str": (ModelResponse(_TEXT, "stop"), r"finish_reason is str 'stop', not a FinishReason"),  # type: ignore[arg-type]
    "model-none": (ModelResponse(_TEXT, FinishReason.STOP, model=None), r"model is None, not a str$"),  # type: ignore[arg-type]
    "id-int": (ModelResponse(_TEXT, FinishReason.STOP, id=3), r"id is int 3, not a str$"),  # type: ignore[arg-type]
    "explanation": (
        ModelResponse(_TEXT, FinishReason.STOP, finish_explanation=["no"]),  # type: ignore[arg-type]
        r"finish_explanation is list \['no'\], not a str or None",
    ),
}


class ResponseProvider(TestModel):
    """A custom provider whose chat answers *response* as given (a provider's answer is untrusted)."""

    def __init__(self, response: Any) -> None:
        super().__init__(default=Reply("unused"))
        self.response = response

    async def chat(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        return self.response  # type: ignore[no-any-return]


@pytest.mark.parametrize(("response", "words"), BAD_RESPONSES.values(), ids=BAD_RESPONSES.keys())
@pytest.mark.parametrize("op", CHAT_OPS)
async def test_a_provider_response_with_a_field_of_the_wrong_type_is_a_provider_failed_error(
    op: Operation, response: Any, words: str
) -> None:
    provider = ResponseProvider(response)
    with pytest.raises(ModelError) as caught:
        await run_op(ModelService(provider, [make_layer(op, "a", [])], retry=NO_JITTER), op)
    assert type(caught.value) is ModelError and caught.value.code == "provider_failed"
    assert re.search(f"the provider's chat returned a ModelResponse whose {words}", str(caught.value))
    assert len(provider.requests) == 1  # a provider bug: not retried


@pytest.mark.parametrize(("response", "words"), BAD_RESPONSES.values(), ids=BAD_RESPONSES.keys())
@pytest.mark.parametrize("op", CHAT_OPS)
async def test_a_layer_response_with_a_field_of_the_wrong_type_is_a_model_middleware_error_naming_it(
    op: Operation, response: Any, words: str
) -> None:
    service = ModelService(TestModel(default=Reply("x")), [wrong_item_layer(op, response)])
    with pytest.raises(ModelMiddlewareError) as caught:
        await run_op(service, op)
    assert re.search(
        rf"#0 \(WrongItem\): {WRAPPER[op]} (returned|yielded) a ModelResponse whose {words}", str(caught.value)
    )


async def test_a_layer_response_without_a_message_fails_chat_with_a_schema_as_the_layer_s_error() -> None:
    """End to end: the structured-output reader got ``message=None`` and failed with a bare AttributeError."""

    class NoMessage(WrapsChat):
        async def wrap_chat(self, request: ModelRequest, call_next: Any) -> ModelResponse:
            await call_next()
            return ModelResponse(None, FinishReason.STOP)  # type: ignore[arg-type]

    model = TestModel(default=[Reply("done"), Reply("{}")])
    with pytest.raises(ModelMiddlewareError, match=r"wrap_chat returned a ModelResponse whose message is None"):
        await chat(model, "hi", model_middleware=[NoMessage()], output_schema={"type": "object"})


class TextPartPlus(TextPart):
    """A part of a subclass: still a part."""


@pytest.mark.parametrize("op", CHAT_OPS)
async def test_a_response_with_fields_of_subclasses_or_optional_none_passes(op: Operation) -> None:
    parts = (
        TextPartPlus(Text("a")),
        ReasoningPart("r", signature=None, redacted_data=None),
        ReasoningPart("r", signature="s", redacted_data="d"),
        ToolCallPart(Text("c1"), "add", "{}"),
    )
    response = ModelResponse(AssistantMessage(parts), FinishReason.TOOL_CALLS, Usage(1, 1, 2), Text("m"), "", None)
    result = await run_op(ModelService(ResponseProvider(response), [make_layer(op, "a", [])]), op)
    assert (result[-1] if op is Operation.CHAT_WITH_RETRY_EVENTS else result) is response


_PART_CLASSES = [TextPart, TextPartPlus, ReasoningPart, ToolCallPart]


@st.composite
def any_response(draw: st.DrawFn) -> Any:
    """A response each of whose fields (and each part's) is mostly of its type, else anything."""

    def part(draw: st.DrawFn) -> Any:
        kind = draw(st.sampled_from(_PART_CLASSES))
        return kind(*(draw(_mostly(_GOOD_VALUES[field.name], _FIELD_VALUES)) for field in attrs.fields(kind)))

    parts = draw(st.lists(_mostly(st.composite(part)(), _FIELD_VALUES), max_size=3))
    return ModelResponse(
        draw(_mostly(st.just(AssistantMessage(tuple(parts))), _FIELD_VALUES)),
        draw(_mostly(st.sampled_from(list(FinishReason)), _FIELD_VALUES)),
        draw(_mostly(_GOOD_VALUES["usage"], _FIELD_VALUES)),
        draw(_mostly(st.text(max_size=3), _FIELD_VALUES)),
        draw(_mostly(st.text(max_size=3), _FIELD_VALUES)),
        draw(_mostly(st.none() | st.text(max_size=3), _FIELD_VALUES)),
    )


def _exact(response: ModelResponse) -> bool:
    """Whether nothing in *response* is of a subclass (which only the explaining check passes)."""
    message = response.message
    values: list[Any] = [response.model, response.id, response.finish_explanation]
    if isinstance(message, AssistantMessage):
        values += [
            getattr(part, field.name)
            for part in message.parts
            if attrs.has(type(part))
            for field in attrs.fields(type(part))
        ]
        values += list(message.parts)
    return not any(type(value) in (Text, TextPartPlus) for value in values)


@given(any_response())
@settings(max_examples=1000, deadline=None)
def test_the_fast_response_check_and_the_explaining_one_agree(response: Any) -> None:
    ok, problem = _response_ok(response), _response_problem(response)
    if ok:
        assert problem is None
    if _exact(response):
        assert ok == (problem is None), (response, problem)


class PlainDefStream:
    """``wrap_stream`` as a plain def returning an iterator (allowed): it runs when the block is entered."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        if self.error is not None:
            raise self.error
        call_next(request)
        return call_next(request)  # type: ignore[no-any-return]


@pytest.mark.parametrize("raises", [True, False], ids=["raises", "next-twice"])
async def test_a_plain_def_stream_wrapper_failing_when_called_is_a_model_middleware_error(raises: bool) -> None:
    error = ValueError("bad wrapper")
    model = TestModel(default=Reply("x"))
    with pytest.raises(ModelMiddlewareError) as caught:
        await run_op(ModelService(model, [PlainDefStream(error if raises else None)]), Operation.STREAM)
    if raises:
        assert caught.value.__cause__ is error
    else:
        assert isinstance(caught.value.__cause__, NextCalledTwiceError)
    assert model.requests == []


def nursery_layer(op: Operation) -> object:
    """Awaits (or iterates) ``call_next`` inside a nursery of its own, beside a heartbeat task."""
    if op in (Operation.CHAT, Operation.SIDE_QUERY):

        async def wrap(self: object, request: ModelRequest, next: Any) -> Any:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                try:
                    return await next(request)
                finally:
                    nursery.cancel_scope.cancel()

    else:

        async def wrap(self: object, request: ModelRequest, next: Any) -> AsyncIterator[Any]:  # type: ignore[misc]
            items = []
            async with trio.open_nursery() as nursery:  # closed before any yield
                nursery.start_soon(trio.sleep_forever)
                try:
                    items = [item async for item in next(request)]
                finally:
                    nursery.cancel_scope.cancel()
            for item in items:
                yield item

    return type("Nursery", (), {WRAPPER[op]: wrap})()


@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_provider_error_grouped_by_a_layer_nursery_stays_that_error(op: Operation) -> None:
    error = RateLimitError("slow down", status=429)
    model = TestModel(default=Reply(error=error))
    service = ModelService(model, [nursery_layer(op)], retry=RetryPolicy(max_attempts=1))
    with pytest.raises(RateLimitError) as caught:
        await run_op(service, op)
    assert caught.value is error


@pytest.mark.parametrize("op", ALL_OPS)
async def test_an_already_aborted_request_fails_even_when_a_layer_answers_without_awaiting(op: Operation) -> None:
    handle = AbortHandle()
    handle.abort()
    service = ModelService(TestModel(default=Reply("x")), [make_layer(op, "cache", [], short=True)])
    with pytest.raises(ModelAbortedError):
        await run_op(service, op, abort=handle)


async def test_an_already_aborted_stream_runs_no_plain_def_layer() -> None:
    """A plain-def wrap_stream runs when it is called: it ran (and billed, logged...) on an
    aborted handle, which fails the call before any layer runs, as chat() always did."""
    ran: list[str] = []

    class Counts:
        def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
            ran.append("wrap_stream")
            return call_next(request)  # type: ignore[no-any-return]

    handle = AbortHandle()
    handle.abort()
    model = TestModel(default=Reply("x"))
    body: list[str] = []
    with pytest.raises(ModelAbortedError):
        async with ModelService(model, [Counts()]).stream(MESSAGES, abort=handle):
            body.append("entered")
    assert ran == [] and body == []
    assert model.requests == []


async def test_iterating_a_stream_outside_its_block_is_a_typed_error() -> None:
    model = TestModel(default=Reply("x"))
    stream: Any = ModelService(model).stream(MESSAGES)
    with pytest.raises(ModelError, match="outside its `async with` block") as caught:
        async for _ in stream:
            pass
    assert caught.value.code == "model_stream_not_entered"
    with pytest.raises(ModelError, match="outside its `async with` block"):
        await stream.__anext__()
    assert model.requests == []


ITERATOR_OPS = [Operation.STREAM, Operation.CHAT_WITH_RETRY_EVENTS]


def open_block(service: ModelService, op: Operation) -> Any:
    if op is Operation.STREAM:
        return service.stream(MESSAGES)
    return service.chat_with_retry_events(MESSAGES)


@pytest.mark.parametrize("layered", [False, True], ids=["bare", "layered"])
@pytest.mark.parametrize("op", ITERATOR_OPS)
async def test_a_stream_block_left_cannot_be_entered_again(op: Operation, layered: bool) -> None:
    """Entered again, it sent the request a second time (or, with a layer, blamed the layer:
    a ModelMiddlewareError); retry events' block raised a bare AttributeError."""
    model = TestModel(default=Reply("a b"))
    service = ModelService(model, [make_layer(op, "L", [])] if layered else [])
    block = open_block(service, op)
    async with block as items:
        assert [item async for item in items]
    with pytest.raises(ModelError, match="entered again") as caught:
        async with block:
            pytest.fail("the block ran again")
    assert type(caught.value) is ModelError and caught.value.code == "model_stream_reused"
    assert len(model.requests) == 1


@pytest.mark.parametrize("op", ITERATOR_OPS)
async def test_a_stream_block_entered_inside_itself_is_refused_and_leaves_no_deadline(op: Operation) -> None:
    """Nested, the second entry stacked a second deadline scope: trio's "Cancel scope stack
    corrupted", and the outer block's deadline stayed on the task, to cancel it later."""
    model = TestModel(default=Reply("a b"))
    service = ModelService(model, request_timeout=5)
    block = open_block(service, op)
    body: list[str] = []
    with pytest.raises(ModelError, match="entered again") as caught:
        async with block as outer:
            assert trio.current_effective_deadline() < math.inf  # the block's deadline
            async with block:
                body.append("inner")
    assert caught.value.code == "model_stream_reused" and body == []
    assert trio.current_effective_deadline() == math.inf  # no deadline scope left on the task
    with pytest.raises(ModelError, match="entered again"):  # still one request, one block
        async with block:
            pass
    assert outer is not None and model.requests == []


@pytest.mark.parametrize("op", ALL_OPS)
async def test_metadata_reaches_the_provider_and_survives_replace(op: Operation) -> None:
    def transform(request: ModelRequest) -> ModelRequest:
        return request.replace(messages=[SystemMessage("s"), *request.messages], options={"temperature": 0})

    model = TestModel(default=Reply("ok"))
    service = ModelService(model, [make_layer(op, "t", [], transform=transform)])
    metadata = {"conversation_id": "conv-9", "trace": "abc"}
    if op is Operation.CHAT:
        await service.chat(MESSAGES, metadata=metadata)
    elif op is Operation.SIDE_QUERY:
        await service.side_query(MESSAGES, metadata=metadata)
    elif op is Operation.STREAM:
        async with service.stream(MESSAGES, metadata=metadata) as chunks:
            async for _ in chunks:
                pass
    else:
        async with service.chat_with_retry_events(MESSAGES, metadata=metadata) as events:
            async for _ in events:
                pass
    [sent] = model.requests
    assert dict(sent.metadata) == metadata
    assert dict(sent.options) == {"temperature": 0}
    assert sent.messages[0] == SystemMessage("s")


# -- streams: unbuffered and deterministic close -------------------------------------------------------------


class LoggingProvider:
    """A provider whose stream logs each chunk it produces and its own ``finally``."""

    name = "logging"

    def __init__(self, log: list[str], chunks: int = 5, *, stall_after: int | None = None, model: str = "m") -> None:
        self.log = log
        self.chunks = chunks
        self.stall_after = stall_after
        self.model = model
        self.requests: list[ModelRequest] = []

    def with_model(self, model: str) -> LoggingProvider:
        return LoggingProvider(self.log, self.chunks, stall_after=self.stall_after, model=model)

    async def chat(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        return CANNED

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        try:
            for index in range(self.chunks):
                if index == self.stall_after:
                    self.log.append("provider stalls")
                    await trio.sleep_forever()
                await trio.lowlevel.checkpoint()
                self.log.append(f"provider {index}")
                yield TextDelta(str(index))
        finally:
            self.log.append("provider finally")


class Tap(ModelMiddleware):
    """A pass-through ``wrap_stream`` that logs every chunk and its ``finally``."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        try:
            async for chunk in call_next(request):
                self.log.append(f"{self.name} {getattr(chunk, 'text', type(chunk).__name__)}")
                yield chunk
        finally:
            self.log.append(f"{self.name} finally")


async def test_stream_chunks_pass_through_unbuffered() -> None:
    log: list[str] = []
    service = ModelService(LoggingProvider(log, chunks=3), [Tap("outer", log), Tap("inner", log)])
    async with service.stream(MESSAGES) as chunks:
        async for chunk in chunks:
            log.append(f"consumer {chunk.text}")  # type: ignore[union-attr]
    per_chunk = [[f"provider {i}", f"inner {i}", f"outer {i}", f"consumer {i}"] for i in range(3)]
    assert log == [entry for group in per_chunk for entry in group] + [
        "provider finally",
        "inner finally",
        "outer finally",
    ]


async def test_early_break_closes_every_layer_outermost_first_then_the_provider_before_exit() -> None:
    log: list[str] = []
    provider = LoggingProvider(log, chunks=100)
    service = ModelService(provider, [Tap("outer", log), Tap("middle", log), Tap("inner", log)])
    async with service.stream(MESSAGES) as chunks:
        async for chunk in chunks:
            log.append(f"consumer {chunk.text}")  # type: ignore[union-attr]
            if chunk.text == "1":  # type: ignore[union-attr]
                break
    assert log == [
        "provider 0",
        "inner 0",
        "middle 0",
        "outer 0",
        "consumer 0",
        "provider 1",
        "inner 1",
        "middle 1",
        "outer 1",
        "consumer 1",
        "outer finally",
        "middle finally",
        "inner finally",
        "provider finally",
    ]


async def test_consumer_error_closes_deterministically_and_propagates() -> None:
    log: list[str] = []
    service = ModelService(LoggingProvider(log, chunks=10), [Tap("outer", log), Tap("inner", log)])
    error = KeyError("consumer bug")
    with pytest.raises(KeyError) as caught:
        async with service.stream(MESSAGES) as chunks:
            async for _ in chunks:
                raise error
    assert caught.value is error
    assert log[-3:] == ["outer finally", "inner finally", "provider finally"]


async def test_outside_cancellation_closes_deterministically() -> None:
    log: list[str] = []
    service = ModelService(LoggingProvider(log, chunks=10, stall_after=2), [Tap("outer", log), Tap("inner", log)])
    with trio.CancelScope() as scope:
        async with service.stream(MESSAGES) as chunks:
            async for chunk in chunks:
                log.append(f"consumer {chunk.text}")  # type: ignore[union-attr]
                if chunk.text == "1":  # type: ignore[union-attr]
                    scope.cancel()  # the next __anext__ is cancelled before it reaches the provider
    assert scope.cancelled_caught
    # Closed by the service as on any early exit: outermost first, the provider last.
    assert log[-3:] == ["outer finally", "inner finally", "provider finally"]
    assert "consumer 1" in log and "consumer 2" not in log


async def test_a_stream_opened_but_never_iterated_never_calls_the_provider() -> None:
    log: list[str] = []
    model = TestModel(default=Reply("x"))
    async with ModelService(model, [Tap("outer", log)]).stream(MESSAGES):
        pass
    assert model.requests == []
    assert log == []


class BadCleanup(ModelMiddleware):
    """A wrap_stream whose cleanup raises."""

    def __init__(self, log: list[str], error: Exception) -> None:
        self.log = log
        self.error = error

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        try:
            async for chunk in call_next(request):
                yield chunk
        finally:
            self.log.append("bad finally")
            raise self.error


async def test_a_failing_cleanup_still_closes_the_inner_layers_and_the_provider() -> None:
    log: list[str] = []
    error = RuntimeError("cleanup failed")
    service = ModelService(
        LoggingProvider(log, chunks=10), [Tap("outer", log), BadCleanup(log, error), Tap("inner", log)]
    )
    with pytest.raises(ModelMiddlewareError) as caught:
        async with service.stream(MESSAGES) as chunks:
            async for _ in chunks:
                break
    assert caught.value.__cause__ is error
    assert log[-4:] == ["outer finally", "bad finally", "inner finally", "provider finally"]


class StrayCleanup(ModelMiddleware):
    """A wrap_stream whose cleanup raises a Cancelled of a scope of its own (nothing cancelled it)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        try:
            async for chunk in call_next(request):
                yield chunk
        finally:
            self.log.append("stray finally")
            raise await cancelled_of_its_own()


async def test_a_cleanup_raising_a_cancelled_of_its_own_is_the_layers_failure() -> None:
    # It left the block as a cancellation nobody made (no scope around would catch it).
    log: list[str] = []
    service = ModelService(LoggingProvider(log, chunks=10), [StrayCleanup(log), Tap("inner", log)])
    try:
        with pytest.raises(ModelMiddlewareError, match="nothing around it was cancelled") as caught:
            async with service.stream(MESSAGES) as chunks:
                async for _ in chunks:
                    break
    except trio.Cancelled:  # a Cancelled out of a test would end it silently, as passed
        pytest.fail("the layer's own Cancelled left the block as a cancellation")
    assert isinstance(caught.value.__cause__, trio.Cancelled)
    assert log[-3:] == ["stray finally", "inner finally", "provider finally"]


class StrayClosingProvider(LoggingProvider):
    """A provider whose stream, closed, raises a Cancelled of a scope of its own."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        try:
            yield TextDelta("0")
            yield TextDelta("1")
        finally:
            raise await cancelled_of_its_own()


async def test_a_provider_stream_raising_a_cancelled_of_its_own_when_closed_is_its_failure() -> None:
    service = ModelService(StrayClosingProvider([]), [Tap("outer", [])])
    try:
        with pytest.raises(ModelError, match="nothing around it was cancelled") as caught:
            async with service.stream(MESSAGES) as chunks:
                async for _ in chunks:
                    break
    except trio.Cancelled:
        pytest.fail("the provider's own Cancelled left the block as a cancellation")
    assert caught.value.code == "provider_failed" and isinstance(caught.value.__cause__, trio.Cancelled)


class StrayChatProvider(LoggingProvider):
    async def chat(self, request: ModelRequest) -> ModelResponse:
        raise await cancelled_of_its_own()


class StrayChat(ModelMiddleware):
    async def wrap_chat(self, request: ModelRequest, call_next: Any) -> ModelResponse:
        raise await cancelled_of_its_own()


class StrayPlainStream(ModelMiddleware):
    def __init__(self, cancelled: trio.Cancelled) -> None:
        self.cancelled = cancelled

    def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        raise self.cancelled  # a plain def: raised as the block is entered


@pytest.mark.parametrize("where", ["provider chat", "chat middleware", "plain-def stream middleware"])
async def test_a_cancelled_of_user_codes_own_in_a_model_call_is_its_failure(where: str) -> None:
    if where == "provider chat":
        service, error = ModelService(StrayChatProvider([])), ModelError
    else:
        layer = StrayChat() if where == "chat middleware" else StrayPlainStream(await cancelled_of_its_own())
        service, error = ModelService(LoggingProvider([]), [layer]), ModelMiddlewareError
    try:
        with pytest.raises(error, match="nothing around it was cancelled") as caught:
            if where == "plain-def stream middleware":
                async with service.stream(MESSAGES):
                    pass
            else:
                await service.chat(MESSAGES)
    except trio.Cancelled:
        pytest.fail("its own Cancelled left the call as a cancellation")
    assert isinstance(caught.value.__cause__, trio.Cancelled)


async def test_a_failing_cleanup_does_not_swallow_an_outside_cancellation() -> None:
    log: list[str] = []
    service = ModelService(LoggingProvider(log, chunks=10), [BadCleanup(log, RuntimeError("cleanup failed"))])
    with trio.CancelScope() as scope:
        async with service.stream(MESSAGES) as chunks:
            async for _ in chunks:
                scope.cancel()
                await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert log[-2:] == ["bad finally", "provider finally"]


async def test_a_failing_cleanup_leaves_the_block_s_own_error_with_a_note() -> None:
    """As the guide says: the consumer's error wins; the cleanup's is noted on it."""
    log: list[str] = []
    service = ModelService(LoggingProvider(log, chunks=10), [BadCleanup(log, RuntimeError("cleanup failed"))])
    with pytest.raises(KeyError) as caught:
        async with service.stream(MESSAGES) as chunks:
            async for _ in chunks:
                raise KeyError("consumer's own")
    assert caught.value.__notes__ == ["also, closing a model stream layer raised RuntimeError('cleanup failed')"]


class AwaitingCleanup(ModelMiddleware):
    """A wrap_stream whose ``finally`` awaits, once bare and once under a shield of its own."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        try:
            async for chunk in call_next(request):
                yield chunk
        finally:
            try:
                await trio.sleep(0.01)
                self.log.append(f"{self.name} bare await ran")
            except trio.Cancelled:
                self.log.append(f"{self.name} bare await cancelled")
            with trio.CancelScope(deadline=trio.current_time() + 1, shield=True):
                await trio.sleep(0.01)
                self.log.append(f"{self.name} shielded await ran")


async def test_a_deadline_during_a_read_runs_cleanups_innermost_first_unshielded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """As the guide says: Cancelled comes up through the generators, so only a layer's own shield lets it await."""
    log: list[str] = []
    service = ModelService(
        LoggingProvider([], chunks=10, stall_after=1),
        [AwaitingCleanup("outer", log), AwaitingCleanup("inner", log)],
        request_timeout=5,
    )
    with pytest.raises(ModelTimeoutError):
        async with service.stream(MESSAGES) as chunks:
            async for _ in chunks:
                pass
    assert log == [
        "inner bare await cancelled",
        "inner shielded await ran",
        "outer bare await cancelled",
        "outer shielded await ran",
    ]


async def test_a_cancellation_between_chunks_runs_cleanups_outermost_first_shielded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    service = ModelService(
        LoggingProvider([], chunks=10), [AwaitingCleanup("outer", log), AwaitingCleanup("inner", log)]
    )
    with trio.CancelScope() as scope:
        async with service.stream(MESSAGES) as chunks:
            async for _ in chunks:
                scope.cancel()  # the consumer is cancelled in its own code, between chunks
                await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert log == [
        "outer bare await ran",
        "outer shielded await ran",
        "inner bare await ran",
        "inner shielded await ran",
    ]


async def test_class_based_stream_wrappers_also_close_outermost_first() -> None:
    log: list[str] = []

    class Wrapped:
        def __init__(self, inner: AsyncIterator[StreamChunk]) -> None:
            self.inner = inner

        def __aiter__(self) -> Wrapped:
            return self

        async def __anext__(self) -> StreamChunk:
            return await self.inner.__anext__()

        async def aclose(self) -> None:
            log.append("classy aclose")

    class Classy:
        def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
            return Wrapped(call_next(request))

    service = ModelService(LoggingProvider(log, chunks=10), [Classy(), Tap("inner", log)])
    async with service.stream(MESSAGES) as chunks:
        async for _ in chunks:
            break
    assert log[-3:] == ["classy aclose", "inner finally", "provider finally"]


# -- retries -------------------------------------------------------------------------------------------------


def expected_delays(policy: RetryPolicy, errors: list[ModelError]) -> list[float]:
    return [policy.delay(attempt, error, random.Random(0)) for attempt, error in enumerate(errors, start=1)]


@pytest.mark.parametrize("op", [Operation.CHAT, Operation.SIDE_QUERY])
async def test_retryable_errors_are_retried_with_backoff(op: Operation, autojump_clock: trio.testing.MockClock) -> None:
    errors: list[ModelError] = [ProviderServerError("503", status=503), ModelConnectionError("reset")]
    model = TestModel({"hello": [*(Reply(error=e) for e in errors), Reply("finally")]})
    start = trio.current_time()
    response = await run_op(ModelService(model, retry=NO_JITTER), op)
    assert response.message.text == "finally"
    assert len(model.requests) == 3
    assert trio.current_time() - start == sum(expected_delays(NO_JITTER, errors)) == 0.5 + 1.0


async def test_retries_stop_at_max_attempts_and_raise_the_last_error(autojump_clock: trio.testing.MockClock) -> None:
    errors = [ProviderServerError(f"fail {i}", status=500) for i in range(5)]
    policy = RetryPolicy(max_attempts=4, base_delay=1.0, max_delay=3.0, jitter=False)
    model = TestModel({"hello": [*(Reply(error=e) for e in errors), Reply("never")]})
    start = trio.current_time()
    with pytest.raises(ProviderServerError) as caught:
        await ModelService(model, retry=policy).chat(MESSAGES)
    assert caught.value is errors[3]
    assert len(model.requests) == 4
    assert trio.current_time() - start == 1.0 + 2.0 + 3.0  # capped at max_delay


@pytest.mark.parametrize(
    ("retry_after", "waited"),
    # No number (a custom provider's NaN, string or bool): the backoff, as with none.
    [
        (7, 7.0),
        (0.25, 0.25),
        (100, 30.0),
        (-5, 0.0),
        (None, 0.5),
        (math.inf, 30.0),
        (math.nan, 0.5),
        ("5", 0.5),
        (True, 0.5),
        # Ints too large for a float: clamped as given (float() of them raised OverflowError).
        pytest.param(10**400, 30.0, id="huge"),
        pytest.param(-(10**400), 0.0, id="huge-negative"),
    ],
)
async def test_rate_limit_honours_retry_after(
    retry_after: float | None, waited: float, autojump_clock: trio.testing.MockClock
) -> None:
    model = TestModel({"hello": [Reply(error=RateLimitError("429", retry_after=retry_after)), Reply("ok")]})
    start = trio.current_time()
    response = await ModelService(model, retry=NO_JITTER).chat(MESSAGES)
    assert response.message.text == "ok"
    assert trio.current_time() - start == waited
    assert len(model.requests) == 2


@pytest.mark.parametrize(
    "error",
    [
        ProviderServerError("503", status=503, retry_after=7),
        ProviderError("408", status=408, retryable=True, retry_after=7),
    ],
)
async def test_a_server_error_honours_retry_after(error: ProviderError, autojump_clock: trio.testing.MockClock) -> None:
    """A 503's (or 529's, 408's) retry_after was ignored: only a RateLimitError's was waited for."""
    model = TestModel({"hello": [Reply(error=error), Reply("ok")]})
    start = trio.current_time()
    response = await ModelService(model, retry=NO_JITTER).chat(MESSAGES)
    assert response.message.text == "ok"
    assert trio.current_time() - start == 7.0
    assert len(model.requests) == 2


@pytest.mark.parametrize(
    "error",
    [
        AuthenticationError("401", status=401),
        ProviderError("400", status=400),
        ModelError("plain"),
        ProviderServerError("marked final", status=500, retryable=False),
    ],
    ids=["auth", "400", "plain", "server-not-retryable"],
)
async def test_non_retryable_errors_are_not_retried(error: ModelError, autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel({"hello": [Reply(error=error), Reply("never")]})
    start = trio.current_time()
    with pytest.raises(ModelError) as caught:
        await ModelService(model, retry=NO_JITTER).chat(MESSAGES)
    assert caught.value is error
    assert len(model.requests) == 1
    assert trio.current_time() == start


async def test_an_error_marked_retryable_is_retried(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel({"hello": [Reply(error=ModelError("flaky", retryable=True)), Reply("ok")]})
    assert (await ModelService(model, retry=NO_JITTER).chat(MESSAGES)).message.text == "ok"
    assert len(model.requests) == 2


async def test_max_attempts_one_disables_retries() -> None:
    error = ProviderServerError("500", status=500)
    model = TestModel({"hello": [Reply(error=error), Reply("never")]})
    with pytest.raises(ProviderServerError):
        await ModelService(model, retry=RetryPolicy(max_attempts=1)).chat(MESSAGES)
    assert len(model.requests) == 1


async def test_retries_happen_inside_the_middleware(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    model = TestModel({"hello": [Reply(error=ProviderServerError("500", status=500)), Reply("ok")]})
    service = ModelService(model, [make_layer(Operation.CHAT, "mw", log)], retry=NO_JITTER)
    await service.chat(MESSAGES)
    assert log == ["mw>", "mw<"], "middleware runs once per call; the retry loop is inside it"
    assert len(model.requests) == 2


@settings(max_examples=200, deadline=None)
@given(
    attempt=st.integers(1, 20),
    base=st.floats(0.001, 10),
    cap=st.floats(0.001, 60),
    seed=st.integers(0, 2**32),
)
def test_full_jitter_delay_is_within_the_backoff_ceiling(attempt: int, base: float, cap: float, seed: int) -> None:
    policy = RetryPolicy(base_delay=base, max_delay=cap)
    ceiling = min(base * 2 ** (attempt - 1), cap)
    delay = policy.delay(attempt, ProviderServerError("x"), random.Random(seed))
    assert 0.0 <= delay <= ceiling
    assert RetryPolicy(base_delay=base, max_delay=cap, jitter=False).delay(attempt, ModelError("x"), None) == ceiling  # type: ignore[arg-type]


async def test_a_policy_of_many_attempts_retries_past_attempt_1024(autojump_clock: trio.testing.MockClock) -> None:
    """``base_delay * 2**(attempt-1)`` overflowed a float at attempt 1025; the OverflowError was
    reported as a ModelMiddlewareError blaming the middleware. The doubling stops at max_delay."""
    attempts = 1100
    errors = [ModelConnectionError(f"refused {i}") for i in range(attempts)]
    model = TestModel({"hello": [Reply(error=error) for error in errors]})
    policy = RetryPolicy(max_attempts=attempts, base_delay=0.5, max_delay=2.0, jitter=False)
    start = trio.current_time()
    with pytest.raises(ModelConnectionError) as caught:
        await ModelService(model, retry=policy, request_timeout=10_000).chat(MESSAGES)
    assert caught.value is errors[-1]
    assert len(model.requests) == attempts
    assert trio.current_time() - start == 0.5 + 1.0 + 2.0 * (attempts - 3)
    assert RetryPolicy(max_delay=30.0, jitter=False).delay(10**6, errors[0], random.Random(0)) == 30.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", -1),
        ("max_attempts", 2.5),
        ("max_attempts", True),
        ("base_delay", -0.5),
        ("base_delay", math.nan),
        ("base_delay", math.inf),
        ("base_delay", "1"),
        ("max_delay", -1),
        ("max_delay", 10.0**9),
        ("max_delay", math.nan),
        pytest.param("max_delay", 10**400, id="max_delay-huge"),  # too large for a float
        pytest.param("max_delay", 10**5000, id="max_delay-unprintable"),  # repr raised ValueError
        ("jitter", "yes"),
        ("jitter", 1),
    ],
)
def test_a_nonsense_retry_policy_is_a_config_error(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"RetryPolicy.{field} must be"):
        RetryPolicy(**{field: value})


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"retry": RetryPolicy}, r"retry must be a RetryPolicy or None, not type .*: pass RetryPolicy\(\.\.\.\)"),
        ({"retry": {"max_attempts": 5}}, "retry must be a RetryPolicy or None, not dict"),
        ({"retry": 3}, "retry must be a RetryPolicy or None, not int 3"),
        ({"rng": 42}, "rng must be a random.Random or None, not int 42"),
        ({"rng": random}, "rng must be a random.Random or None, not module"),
    ],
)
def test_a_retry_or_rng_of_the_wrong_kind_is_a_config_error_when_built(options: dict[str, Any], words: str) -> None:
    """Both are first used at a retryable error: accepted, they failed that call as a middleware bug."""
    with pytest.raises(ConfigError, match=words):
        ModelService(TestModel(), **options)


class NoModelProvider:
    """A half-written custom provider: everything but ``model``."""

    name = "half"

    async def chat(self, request: ModelRequest) -> ModelResponse:
        raise AssertionError("never called")

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    ("provider", "words"),
    [
        (None, "got None, which has no model, chat or stream"),
        (NoModelProvider(), "got NoModelProvider .*, which has no model "),
        (TestModel, r"got the class TestModel: pass an instance, TestModel\(\.\.\.\)"),
        ("gpt-4o", "got str 'gpt-4o', which has no model, chat or stream"),
    ],
)
async def test_a_service_of_something_that_is_no_provider_is_a_config_error_when_built(
    provider: Any, words: str
) -> None:
    """Accepted, it failed the first call with a bare AttributeError (the provider's model)."""
    with pytest.raises(ConfigError, match=f"ModelService needs a model provider, {words}"):
        ModelService(provider)
    with pytest.raises(ConfigError, match=f"chat\\(\\) needs a model provider or a ModelService, {words}"):
        async with chat(provider, "hi") as run:
            await run.result()


async def test_a_policy_and_a_generator_of_their_kinds_are_accepted(autojump_clock: trio.testing.MockClock) -> None:
    class Seeded(random.Random):
        """A subclass (as random.SystemRandom is) is a generator too."""

    model = TestModel({"hello": [Reply(error=ProviderServerError("503", status=503)), Reply("ok")]})
    service = ModelService(model, retry=RetryPolicy(max_attempts=2), rng=Seeded(1))
    assert (await service.chat(MESSAGES)).message.text == "ok"
    assert ModelService(TestModel(), retry=None, rng=None).retry == RetryPolicy()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_jittered_delays_are_reported_and_slept(seed: int, autojump_clock: trio.testing.MockClock) -> None:
    errors = [ProviderServerError(f"e{i}", status=503) for i in range(4)]
    model = TestModel({"hello": [*(Reply(error=e) for e in errors), Reply("ok")]})
    policy = RetryPolicy(max_attempts=5, base_delay=1.0, max_delay=4.0)
    service = ModelService(model, retry=policy, rng=random.Random(seed))
    times: list[float] = []
    start = trio.current_time()
    async with service.chat_with_retry_events(MESSAGES) as events:
        items = []
        async for item in events:
            items.append(item)
            times.append(trio.current_time() - start)
    retry_events = items[:-1]
    assert [e.attempt for e in retry_events] == [1, 2, 3, 4]
    ceilings = [1.0, 2.0, 4.0, 4.0]
    assert all(0 <= e.delay <= c for e, c in zip(retry_events, ceilings, strict=True))
    assert len({e.delay for e in retry_events}) == 4, "jitter draws a fresh delay each time"
    assert times[-1] == pytest.approx(sum(e.delay for e in retry_events), abs=1e-9)


# -- retry events --------------------------------------------------------------------------------------------


async def test_chat_with_retry_events_yields_events_then_the_response(autojump_clock: trio.testing.MockClock) -> None:
    first, second = ProviderServerError("503", status=503), RateLimitError("429", retry_after=2)
    model = TestModel({"hello": [Reply(error=first), Reply(error=second), Reply("done")]})
    service = ModelService(model, retry=NO_JITTER)
    start = trio.current_time()
    seen: list[tuple[Any, float]] = []
    async with service.chat_with_retry_events(MESSAGES) as events:
        async for item in events:
            seen.append((item, trio.current_time() - start))
    assert [item for item, _ in seen[:2]] == [RetryEvent(1, 0.5, first), RetryEvent(2, 2.0, second)]
    assert [t for _, t in seen] == [0.0, 0.5, 2.5]
    response = seen[2][0]
    assert isinstance(response, ModelResponse) and response.message.text == "done"
    assert seen[0][0].error is first and seen[1][0].error is second


async def test_wrap_chat_with_retry_events_sees_every_event(autojump_clock: trio.testing.MockClock) -> None:
    observed: list[Any] = []

    class Observe(ModelMiddleware):
        async def wrap_chat_with_retry_events(self, request: ModelRequest, call_next: Any) -> AsyncIterator[Any]:
            async for item in call_next(request):
                observed.append(item)
                if not isinstance(item, RetryEvent):  # hide retries from the caller
                    yield item

    errors = [ProviderServerError("a", status=500), ProviderServerError("b", status=502)]
    model = TestModel({"hello": [*(Reply(error=e) for e in errors), Reply("ok")]})
    result = await run_op(ModelService(model, [Observe()], retry=NO_JITTER), Operation.CHAT_WITH_RETRY_EVENTS)
    assert [type(item) for item in observed] == [RetryEvent, RetryEvent, ModelResponse]
    assert [(e.attempt, e.delay, e.error) for e in observed[:2]] == [(1, 0.5, errors[0]), (2, 1.0, errors[1])]
    assert result == [observed[2]]


async def test_retry_events_then_the_final_error(autojump_clock: trio.testing.MockClock) -> None:
    errors = [ProviderServerError(str(i), status=500) for i in range(3)]
    model = TestModel({"hello": [Reply(error=e) for e in errors]})
    items: list[Any] = []
    with pytest.raises(ProviderServerError) as caught:
        async with ModelService(model, retry=NO_JITTER).chat_with_retry_events(MESSAGES) as events:
            async for item in events:
                items.append(item)
    assert caught.value is errors[2]
    assert items == [RetryEvent(1, 0.5, errors[0]), RetryEvent(2, 1.0, errors[1])]


async def test_plain_chat_reports_no_retry_events_to_the_events_middleware(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    model = TestModel({"hello": [Reply(error=ProviderServerError("x", status=500)), Reply("ok")]})
    service = ModelService(model, [make_layer(Operation.CHAT_WITH_RETRY_EVENTS, "events", log)], retry=NO_JITTER)
    assert (await service.chat(MESSAGES)).message.text == "ok"
    assert log == []


# -- stream retries ------------------------------------------------------------------------------------------


async def test_stream_failing_before_its_first_chunk_is_retried(autojump_clock: trio.testing.MockClock) -> None:
    error = ProviderServerError("overloaded", status=529)
    model = TestModel({"hello": [Reply(error=error, fail_after_chunks=0), Reply("second try")]})
    start = trio.current_time()
    chunks = await run_op(ModelService(model, retry=NO_JITTER), Operation.STREAM)
    assert final_text(Operation.STREAM, chunks) == "second try"
    assert len(model.requests) == 2
    assert trio.current_time() - start == 0.5


async def test_stream_failing_after_published_chunks_is_never_retried(autojump_clock: trio.testing.MockClock) -> None:
    error = ProviderServerError("connection reset", status=502, code="UPSTREAM_RESET")
    model = TestModel({"hello": [Reply("a b c d e", error=error, fail_after_chunks=3), Reply("never")]})
    received: list[StreamChunk] = []
    with pytest.raises(StreamInterruptedError) as caught:
        async with ModelService(model, [Tap("tap", [])], retry=NO_JITTER).stream(MESSAGES) as chunks:
            async for chunk in chunks:
                received.append(chunk)
    assert received == [TextDelta("a"), TextDelta(" b"), TextDelta(" c")]
    assert len(model.requests) == 1
    assert caught.value.__cause__ is error
    assert caught.value.code == "UPSTREAM_RESET"
    assert not caught.value.retryable


async def test_an_idle_timeout_after_published_chunks_stays_a_timeout() -> None:
    """As the request deadline's does: `except TimeoutError` catches every timeout of a call."""
    error = ModelTimeoutError("no byte for 300 s", code="model_stream_idle_timeout")
    model = TestModel(default=Reply("a b c", fail_after_chunks=2, error=error))
    received: list[StreamChunk] = []
    with pytest.raises(ModelTimeoutError) as caught:
        async with ModelService(model, retry=NO_JITTER).stream(MESSAGES) as chunks:
            async for chunk in chunks:
                received.append(chunk)
    assert caught.value is error and not caught.value.retryable
    assert received == [TextDelta("a"), TextDelta(" b")]
    assert len(model.requests) == 1


async def test_a_timeout_marked_retryable_after_published_chunks_is_interrupted() -> None:
    """It went on as itself, saying it could be retried, though nothing is retried after a chunk."""
    error = ModelTimeoutError("connect timeout", code="model_request_timeout", retryable=True)
    model = TestModel(default=Reply("a b c", fail_after_chunks=1, error=error))
    with pytest.raises(StreamInterruptedError) as caught:
        await run_op(ModelService(model, retry=NO_JITTER), Operation.STREAM)
    assert caught.value.__cause__ is error and not caught.value.retryable
    assert caught.value.code == "model_request_timeout"
    assert len(model.requests) == 1


async def test_stream_non_retryable_error_before_first_chunk_propagates_unchanged() -> None:
    error = AuthenticationError("401", status=401)
    model = TestModel({"hello": [Reply(error=error), Reply("never")]})
    with pytest.raises(AuthenticationError) as caught:
        await run_op(ModelService(model, retry=NO_JITTER), Operation.STREAM)
    assert caught.value is error
    assert len(model.requests) == 1


async def test_stream_retry_closes_the_failed_attempt_before_the_next(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []

    class FlakyProvider(LoggingProvider):
        async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
            self.requests.append(request)
            attempt = len(self.requests)
            try:
                await trio.lowlevel.checkpoint()
                if attempt == 1:
                    raise ModelConnectionError("refused")
                yield TextDelta("ok")
            finally:
                self.log.append(f"attempt {attempt} closed")

    provider = FlakyProvider(log)
    chunks = await run_op(ModelService(provider, retry=NO_JITTER), Operation.STREAM)
    assert chunks == [TextDelta("ok")]
    assert log == ["attempt 1 closed", "attempt 2 closed"]


class BadCloseStream:
    """A provider stream (a class, as an HTTP response is) whose ``aclose()`` raises: its first read
    fails with *error* (else it yields one chunk and ends)."""

    def __init__(self, error: ModelError | None) -> None:
        self.error = error
        self.read = False

    def __aiter__(self) -> BadCloseStream:
        return self

    async def __anext__(self) -> StreamChunk:
        await trio.lowlevel.checkpoint()
        if self.error is not None:
            raise self.error
        if self.read:
            raise StopAsyncIteration
        self.read = True
        return TextDelta("hi")

    async def aclose(self) -> None:
        raise RuntimeError("connection reset during close")


class BadCloseProvider(LoggingProvider):
    """Its streams are *streams*, one an attempt."""

    def __init__(self, streams: list[BadCloseStream]) -> None:
        super().__init__([])
        self.streams = streams

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:  # type: ignore[override]
        self.requests.append(request)
        return self.streams[len(self.requests) - 1]


async def test_a_failed_attempt_whose_close_raises_is_still_retried_with_the_close_noted(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The close's error replaced the retryable one, as a middleware bug (with no middleware): no retry."""
    provider = BadCloseProvider([BadCloseStream(ProviderServerError("503", status=503)), BadCloseStream(None)])
    assert await run_op(ModelService(provider, retry=NO_JITTER), Operation.STREAM) == [TextDelta("hi")]
    assert len(provider.requests) == 2
    assert "closing a failed attempt of the logging provider stream raised" in caplog.text
    assert "connection reset during close" in caplog.text


async def test_a_last_failed_attempt_whose_close_raises_raises_its_own_error_with_a_note() -> None:
    error = ProviderServerError("503", status=503)
    provider = BadCloseProvider([BadCloseStream(error)])
    with pytest.raises(ProviderServerError) as caught:
        await run_op(ModelService(provider, retry=RetryPolicy(max_attempts=1)), Operation.STREAM)
    assert caught.value is error
    assert caught.value.__notes__ == [
        "also, closing the provider's failed stream raised RuntimeError('connection reset during close')"
    ]


async def test_a_provider_stream_whose_close_raises_is_a_provider_error_not_middleware() -> None:
    provider = BadCloseProvider([BadCloseStream(None)])
    with pytest.raises(ModelError) as caught:
        async with ModelService(provider, [Tap("tap", [])]).stream(MESSAGES) as chunks:
            async for _ in chunks:
                break  # leaves it open: the block's exit closes it
    assert type(caught.value) is ModelError and caught.value.code == "provider_failed"
    assert isinstance(caught.value.__cause__, RuntimeError)


class ReadsOnAfterErrors(ModelMiddleware):
    """Catches a stream error and keeps reading (to log it and go on) until the stream ends."""

    def __init__(self) -> None:
        self.errors: list[ModelError] = []

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        inner = call_next(request)
        while True:
            try:
                chunk = await inner.__anext__()
            except StopAsyncIteration:
                return
            except ModelError as error:
                self.errors.append(error)
                continue
            yield chunk


@pytest.mark.parametrize("max_attempts", [3, 1])
async def test_a_stream_that_raised_stays_finished_and_never_replays(max_attempts: int) -> None:
    """After chunks (StreamInterruptedError) or on the last attempt, reading on ends the stream:
    the provider is not asked again and nothing published is sent twice."""
    error = ModelConnectionError("connection reset")
    chunks_before = 2 if max_attempts == 3 else 0
    model = TestModel({"hello": [Reply("a b c", error=error, fail_after_chunks=chunks_before), Reply("again")]})
    layer = ReadsOnAfterErrors()
    service = ModelService(model, [layer], retry=RetryPolicy(max_attempts=max_attempts, jitter=False))
    received = await run_op(service, Operation.STREAM)
    assert received == [TextDelta("a"), TextDelta(" b")][:chunks_before]
    assert len(model.requests) == 1
    assert len(layer.errors) == 1


async def test_a_stream_read_after_its_block_opens_no_new_request() -> None:
    model = TestModel(default=Reply("a b c"))
    async with ModelService(model).stream(MESSAGES) as chunks:
        assert await chunks.__anext__() == TextDelta("a")
    with pytest.raises(StopAsyncIteration):
        await chunks.__anext__()
    assert len(model.requests) == 1


async def test_a_stream_left_unread_opens_no_request_when_read_after_its_block() -> None:
    """The provider's stream was never opened, so leaving the block did not mark it finished:
    reading it afterwards sent a request outside the deadline, which nothing ever closed."""
    model = TestModel(default=Reply("a b c"))
    async with ModelService(model).stream(MESSAGES) as chunks:
        pass
    with pytest.raises(StopAsyncIteration):
        await chunks.__anext__()
    assert model.requests == []


class KeepsCallNext:
    """Keeps its call_next (e.g. to refresh a cache later) and answers from the cache; with
    *call*, it also calls it in time and keeps what that returned, unawaited or unread."""

    def __init__(self, op: Operation, *, call: bool) -> None:
        self.kept: list[Any] = []
        self.started: list[Any] = []
        self.call = call
        name = WRAPPER[op]
        if op in (Operation.CHAT, Operation.SIDE_QUERY):

            async def wrap(request: ModelRequest, call_next: Any) -> ModelResponse:
                self.keep(request, call_next)
                return CANNED

        else:
            item: Any = TextDelta("cached") if op is Operation.STREAM else CANNED

            async def wrap(request: ModelRequest, call_next: Any) -> AsyncIterator[Any]:  # type: ignore[misc]
                self.keep(request, call_next)
                yield item

        setattr(self, name, wrap)

    def keep(self, request: ModelRequest, call_next: Any) -> None:
        if self.call:
            self.started.append(call_next(request))
        else:
            self.kept.append(call_next)


@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_call_next_kept_past_its_call_runs_nothing(op: Operation) -> None:
    """It reached the provider: outside request_timeout and past an aborted handle (chat), or with
    a provider stream the service never closed (stream). Now the door is closed, as on the tool side."""
    model = TestModel(default=Reply("real", latency=50))
    keeper = KeepsCallNext(op, call=False)
    service = ModelService(model, [keeper], request_timeout=1)
    handle = AbortHandle()
    await run_op(service, op, abort=handle)
    handle.abort()
    with pytest.raises(ModelMiddlewareError, match="after the model call had ended") as caught:
        keeper.kept[0](None)
    assert caught.value.code == "middleware_early_return"
    assert model.requests == []


@pytest.mark.parametrize("op", ALL_OPS)
async def test_what_a_call_next_returned_in_time_runs_nothing_after_its_call(op: Operation) -> None:
    model = TestModel(default=Reply("real"))
    keeper = KeepsCallNext(op, call=True)
    await run_op(ModelService(model, [keeper]), op)
    started = keeper.started[0]
    if op in (Operation.CHAT, Operation.SIDE_QUERY):
        with pytest.raises(ModelMiddlewareError, match="after the model call had ended"):
            await started
    else:  # closed with the block (the provider's stream was never opened: it is finished)
        with pytest.raises(StopAsyncIteration):
            await started.__anext__()
    assert model.requests == []


class SlowProvider:
    """A provider whose chat and whose stream's chunks each take *delay* s; it logs, with the time,
    when its work is cancelled, finishes, and when its stream is closed."""

    name = "slow"
    model = "m"

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.log: list[str] = []
        self.started = trio.Event()

    def with_model(self, model: str) -> SlowProvider:
        return self

    async def _wait(self) -> None:
        self.started.set()
        try:
            await trio.sleep(self.delay)
        except trio.Cancelled:
            self.log.append(f"cancelled at {trio.current_time():g}")
            raise

    async def chat(self, request: ModelRequest) -> ModelResponse:
        await self._wait()
        self.log.append(f"answered at {trio.current_time():g}")
        return CANNED

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        try:
            for index in range(3):
                await self._wait()
                self.log.append(f"chunk {index} at {trio.current_time():g}")
                yield TextDelta(str(index))
        finally:
            self.log.append(f"closed at {trio.current_time():g}")


class InBackground:
    """Runs its call_next in a task of a nursery that outlives the call (a "refresh the cache in the
    background" layer, a "tee to a logger" one); once the provider started, it answers from its
    cache (or, *waits*, after the background task is done). `outcomes`: what that task got."""

    def __init__(self, op: Operation, nursery: trio.Nursery, provider: SlowProvider, *, waits: bool = False) -> None:
        self.outcomes: list[Any] = []
        done = trio.Event()

        async def background(call_next: Any) -> None:
            try:
                if op in (Operation.CHAT, Operation.SIDE_QUERY):
                    self.outcomes.append(await call_next())
                else:
                    self.outcomes.append([item async for item in call_next()])
            except ModelError as error:
                self.outcomes.append(error)
            done.set()

        async def answer(call_next: Any) -> None:
            nursery.start_soon(background, call_next)
            await provider.started.wait()
            if waits:
                await done.wait()

        if op in (Operation.CHAT, Operation.SIDE_QUERY):

            async def wrap(request: ModelRequest, call_next: Any) -> ModelResponse:
                await answer(call_next)
                return CANNED

        else:
            item: Any = TextDelta("cached") if op is Operation.STREAM else CANNED

            async def wrap(request: ModelRequest, call_next: Any) -> AsyncIterator[Any]:  # type: ignore[misc]
                await answer(call_next)
                yield item

        setattr(self, WRAPPER[op], wrap)


@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_call_next_run_in_another_task_is_cancelled_when_its_call_ends(
    op: Operation, autojump_clock: trio.testing.MockClock
) -> None:
    """Only a call_next *called* after the end ran nothing: one called in time from a task of its
    own ran the provider on past the call, its deadline and its abort (chat), or was read on after
    the block, whose closing failed ("already running") and left it open (stream)."""
    provider = SlowProvider(50)
    handle = AbortHandle()
    async with trio.open_nursery() as nursery:
        layer = InBackground(op, nursery, provider)
        await run_op(ModelService(provider, [layer], request_timeout=10), op, abort=handle)
        provider.log.append(f"call returned at {trio.current_time():g}")
        handle.abort()
    assert trio.current_time() == 0  # the background task ended with the call
    if op is Operation.STREAM:  # closed before the block's exit returned
        assert provider.log == ["cancelled at 0", "closed at 0", "call returned at 0"]
    else:
        assert sorted(provider.log) == ["call returned at 0", "cancelled at 0"]
    [outcome] = layer.outcomes
    assert isinstance(outcome, ModelMiddlewareError) and outcome.code == "middleware_early_return"
    assert "ran in another task was still running: it was cancelled" in str(outcome)


@pytest.mark.parametrize("stop", ["deadline", "abort"])
@pytest.mark.parametrize("op", ALL_OPS)
async def test_a_call_next_run_in_another_task_stops_at_its_call_s_deadline_or_abort(
    op: Operation, stop: str, autojump_clock: trio.testing.MockClock
) -> None:
    provider = SlowProvider(50)
    handle = AbortHandle()
    expected = ModelTimeoutError if stop == "deadline" else ModelAbortedError
    async with trio.open_nursery() as nursery:
        if stop == "abort":

            async def abort_at_3() -> None:
                await trio.sleep(3)
                handle.abort()

            nursery.start_soon(abort_at_3)
        layer = InBackground(op, nursery, provider, waits=True)
        with pytest.raises(expected):
            await run_op(
                ModelService(provider, [layer], request_timeout=3 if stop == "deadline" else 60), op, abort=handle
            )
    assert provider.log[0] == "cancelled at 3"  # not "answered at 50"
    [outcome] = layer.outcomes
    assert isinstance(outcome, ModelError)


async def test_a_provider_stream_handed_to_another_task_after_its_first_read_is_closed_there(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only the first read decides where a stream's reads run (a check per chunk would cost a tenth
    of one): a stream first read in the block's task and then handed over is not cut at the end.
    Closing it under that read raised "already running" (blamed on the closing) and left it open
    for good; now the layer is named, and the stream is closed at that task's next read."""

    class SecondRead(SlowProvider):
        """Its ``started`` is set when its second chunk is being read."""

        async def _wait(self) -> None:
            self.waits = getattr(self, "waits", 0) + 1
            if self.waits == 1:
                await trio.sleep(self.delay)
            else:
                await super()._wait()

    provider = SecondRead(50)
    reads: list[Any] = []

    class HandsOver:
        def __init__(self, nursery: trio.Nursery) -> None:
            self.nursery = nursery

        async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
            chunks = call_next()
            first = await chunks.__anext__()
            self.nursery.start_soon(read_on, chunks)
            await provider.started.wait()
            yield first

    async def read_on(chunks: Any) -> None:
        async for chunk in chunks:
            reads.append(chunk)

    async with trio.open_nursery() as nursery:
        service = ModelService(provider, [HandsOver(nursery)], request_timeout=1000)
        with pytest.raises(ModelMiddlewareError, match="being read in another task when its model call ended"):
            async with service.stream(MESSAGES) as chunks:
                async for _ in chunks:
                    break
    assert reads == [TextDelta("1")]  # the read under way when the block was left, and nothing after
    assert provider.log == ["chunk 0 at 50", "chunk 1 at 100", "closed at 100"]


class EagerStreamProvider(LoggingProvider):
    """Builds its request when ``stream()`` is called (a plain def, as the protocol allows); the first call fails."""

    def __init__(self, log: list[str], error: Exception) -> None:
        super().__init__(log)
        self.error = error

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:  # type: ignore[override]
        self.requests.append(request)
        if len(self.requests) == 1:
            raise self.error
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[StreamChunk]:
        await trio.lowlevel.checkpoint()
        yield TextDelta("ok")


async def test_a_provider_stream_call_that_raises_is_retried_like_a_failed_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = EagerStreamProvider([], ModelConnectionError("refused"))
    assert await run_op(ModelService(provider, retry=NO_JITTER), Operation.STREAM) == [TextDelta("ok")]
    assert len(provider.requests) == 2


async def test_a_provider_stream_call_with_a_bug_is_a_provider_error_not_middleware() -> None:
    error = ValueError("bad option")
    provider = EagerStreamProvider([], error)
    with pytest.raises(ModelError) as caught:
        await run_op(ModelService(provider, [Tap("tap", [])], retry=NO_JITTER), Operation.STREAM)
    assert type(caught.value) is ModelError and caught.value.code == "provider_failed"
    assert caught.value.__cause__ is error
    assert len(provider.requests) == 1


# -- deadlines -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [Operation.CHAT, Operation.SIDE_QUERY])
async def test_a_wrap_that_never_returns_hits_the_request_deadline(
    op: Operation, autojump_clock: trio.testing.MockClock
) -> None:
    seen: list[type[BaseException]] = []

    async def stuck(self: object, request: ModelRequest, next: Any) -> ModelResponse:
        try:
            await trio.sleep_forever()
        except BaseException as exc:
            seen.append(type(exc))
            raise
        raise AssertionError("unreachable")

    model = TestModel(default=Reply("x"))
    service = ModelService(model, [type("Stuck", (), {WRAPPER[op]: stuck})()], request_timeout=5)
    start = trio.current_time()
    with pytest.raises(ModelTimeoutError) as caught:
        await run_op(service, op)
    assert caught.value.code == "model_request_timeout"
    assert isinstance(caught.value, TimeoutError)
    assert trio.current_time() - start == 5.0
    assert seen == [trio.Cancelled], "the deadline is outside the middleware: it only sees cancellation"
    assert model.requests == []


@pytest.mark.parametrize("op", [Operation.CHAT, Operation.SIDE_QUERY])
async def test_a_wrap_whose_own_nursery_fails_as_the_deadline_cancels_it_is_a_timeout(
    op: Operation, autojump_clock: trio.testing.MockClock
) -> None:
    # Trio passes the rest of the nursery's group through the deadline's scope: a bare
    # ExceptionGroup left the call instead of the request's timeout.
    async def with_helpers(self: object, request: ModelRequest, next: Any) -> ModelResponse:
        await nursery_failing_in_cleanup()

    helpers = type("Helpers", (), {WRAPPER[op]: with_helpers})()
    service = ModelService(TestModel(default=Reply("x")), [helpers], request_timeout=5)
    with pytest.raises(ModelTimeoutError) as caught:
        await run_op(service, op)
    assert isinstance(caught.value.__cause__, BaseExceptionGroup)


async def test_a_wrap_stream_whose_own_nursery_fails_as_the_deadline_cancels_it_is_a_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Helpers(ModelMiddleware):
        async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
            await nursery_failing_in_cleanup()
            async for chunk in call_next(request):  # pragma: no cover - the deadline comes first
                yield chunk

    with pytest.raises(ModelTimeoutError) as caught:
        async with ModelService(TestModel(default=Reply("x")), [Helpers()], request_timeout=5).stream(
            MESSAGES
        ) as chunks:
            async for _ in chunks:
                pass  # pragma: no cover
    assert isinstance(caught.value.__cause__, BaseExceptionGroup)


async def test_a_slow_provider_within_the_deadline_succeeds(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel(default=Reply("in time", latency=4.9))
    assert (await ModelService(model, request_timeout=5).chat(MESSAGES)).message.text == "in time"


async def test_retry_sleeps_count_against_the_request_deadline(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel(default=Reply(error=ProviderServerError("500", status=500)))
    policy = RetryPolicy(max_attempts=10, base_delay=4.0, max_delay=60.0, jitter=False)
    start = trio.current_time()
    with pytest.raises(ModelTimeoutError) as caught:
        await ModelService(model, retry=policy, request_timeout=5).chat(MESSAGES)
    assert caught.value.code == "model_request_timeout"
    assert trio.current_time() - start == 5.0
    assert len(model.requests) == 2  # t=0 and t=4; the next would start at t=12


async def test_a_stream_that_stalls_hits_the_request_deadline(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    service = ModelService(LoggingProvider(log, chunks=10, stall_after=2), [Tap("tap", log)], request_timeout=5)
    received: list[StreamChunk] = []
    start = trio.current_time()
    with pytest.raises(ModelTimeoutError) as caught:
        async with service.stream(MESSAGES) as chunks:
            async for chunk in chunks:
                received.append(chunk)
    assert caught.value.code == "model_request_timeout"
    assert trio.current_time() - start == 5.0
    assert received == [TextDelta("0"), TextDelta("1")]
    assert log[-2:] == ["provider finally", "tap finally"]


async def test_a_wrap_stream_that_stalls_hits_the_request_deadline(autojump_clock: trio.testing.MockClock) -> None:
    class Stall(ModelMiddleware):
        async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
            async for chunk in call_next(request):
                yield chunk
                await trio.sleep_forever()

    model = TestModel(default=Reply("one two three"))
    received: list[StreamChunk] = []
    with pytest.raises(ModelTimeoutError) as caught:
        async with ModelService(model, [Stall()], request_timeout=5).stream(MESSAGES) as chunks:
            async for chunk in chunks:
                received.append(chunk)
    assert caught.value.code == "model_request_timeout"
    assert received == [TextDelta("one")]


async def test_retry_events_stream_hits_the_request_deadline(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel(default=Reply("late", latency=60))
    start = trio.current_time()
    with pytest.raises(ModelTimeoutError):
        await run_op(ModelService(model, request_timeout=5), Operation.CHAT_WITH_RETRY_EVENTS)
    assert trio.current_time() - start == 5.0


# -- with_model ----------------------------------------------------------------------------------------------


async def test_with_model_builds_a_new_service_with_the_same_stack() -> None:
    seen: list[str] = []

    class RecordModel(ModelMiddleware):
        async def wrap_chat(self, request: ModelRequest, call_next: Any) -> ModelResponse:
            seen.append(request.model)
            return await call_next(request)

        async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
            seen.append(request.model)
            async for chunk in call_next(request):
                yield chunk

    model = TestModel(default=Reply("hi"), model="model-a")
    policy = RetryPolicy(max_attempts=7)
    service_a = ModelService(model, [RecordModel()], retry=policy, request_timeout=42)
    service_b = service_a.with_model("model-b")
    assert service_b is not service_a
    assert service_b.middleware is service_a.middleware
    assert service_b.retry == policy and service_b.request_timeout == 42
    assert (service_a.model, service_b.model) == ("model-a", "model-b")

    assert (await service_a.chat(MESSAGES)).model == "model-a"
    assert (await service_b.chat(MESSAGES)).model == "model-b"
    await run_op(service_b, Operation.STREAM)
    await run_op(service_a, Operation.STREAM)
    assert seen == ["model-a", "model-b", "model-b", "model-a"]
    assert [r.model for r in model.requests] == ["model-a", "model-b", "model-b", "model-a"]


async def test_with_model_keeps_the_model_invariant_per_service() -> None:
    def to_a(request: ModelRequest) -> ModelRequest:
        return attrs.evolve(request, model="model-a")

    model = TestModel(default=Reply("hi"), model="model-a")
    service_a = ModelService(model, [make_layer(Operation.CHAT, "pin", [], transform=to_a)])
    assert (await service_a.chat(MESSAGES)).message.text == "hi"  # unchanged model: fine
    with pytest.raises(ModelMiddlewareError, match="active model"):
        await service_a.with_model("model-b").chat(MESSAGES)  # the middleware cannot switch it back
    assert [r.model for r in model.requests] == ["model-a"]


# -- bad input -----------------------------------------------------------------------------------------------


class NoWrappers:
    def wrap_something_else(self, request: Any, next: Any) -> Any:
        return next(request)


class SyncChat(ModelMiddleware):
    def wrap_chat(self, request: ModelRequest, call_next: Any) -> Any:
        return call_next(request)


class SyncSideQuery:
    def wrap_side_query(self, request: ModelRequest, call_next: Any) -> Any:
        return call_next(request)


async def _plain_function(request: Any, next: Any) -> Any:
    return await next(request)


class Bare(ModelMiddleware):
    """Subclasses the protocol and defines no wrapper."""


@pytest.mark.parametrize(
    "layer",
    [NoWrappers(), Bare(), object(), _plain_function, SyncChat(), SyncSideQuery()],
    ids=["no-wrappers", "bare-subclass", "object", "plain-function", "sync-wrap-chat", "sync-wrap-side-query"],
)
def test_wrongly_shaped_middleware_is_rejected(layer: object) -> None:
    with pytest.raises(MiddlewareShapeError, match="#1"):
        ModelService(TestModel(), [make_layer(Operation.CHAT, "ok", []), layer])


@pytest.mark.parametrize("middleware", ["wrap_chat", b"x", make_layer(Operation.CHAT, "x", []), None])
def test_middleware_must_be_a_sequence(middleware: Any) -> None:
    with pytest.raises(MiddlewareShapeError):
        ModelService(TestModel(), middleware)


@pytest.mark.parametrize("name", ["wrap_stream", "wrap_chat_with_retry_events"])
def test_a_coroutine_iterator_wrapper_is_rejected_at_construction(name: str) -> None:
    async def wrapper(self: object, request: ModelRequest, next: Any) -> Any:
        return next(request)

    with pytest.raises(MiddlewareShapeError, match=name):
        ModelService(TestModel(), [type("CoroutineWrapper", (), {name: wrapper})()])


@pytest.mark.parametrize("name", ["wrap_stream", "wrap_chat_with_retry_events"])
def test_a_sync_generator_iterator_wrapper_is_rejected_at_construction(name: str) -> None:
    def wrapper(self: object, request: ModelRequest, next: Any) -> Any:  # `async` forgotten
        yield from next(request)

    with pytest.raises(MiddlewareShapeError, match=f"{name} must return an async iterator.*generator function"):
        ModelService(TestModel(), [type("SyncGeneratorWrapper", (), {name: wrapper})()])


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        ({"messages": None}, "messages must be a sequence of messages, not None"),
        ({"messages": "hello"}, "messages must be a sequence of messages, not str"),
        ({"messages": [UserMessage("q"), "hi"]}, r"messages\[1\] is not a message.*str 'hi'"),
        ({"messages": (UserMessage("q"), {"role": "user"})}, r"messages\[1\] is not a message.*dict"),
        ({"tools": None}, "tools must be a sequence of ToolSpec, not None"),
        ({"tools": ["t"]}, r"tools\[0\] is not a ToolSpec: str 't'"),
        ({"options": [("temperature", 1)]}, "options must be a mapping"),
        ({"metadata": "trace-1"}, "metadata must be a mapping"),
    ],
)
@pytest.mark.parametrize("op", ALL_OPS)
async def test_bad_call_arguments_are_a_config_error_naming_them(
    op: Operation, arguments: dict[str, Any], words: str
) -> None:
    model = TestModel(default=Reply("x"))
    service = ModelService(model)
    arguments = {"messages": MESSAGES, **arguments}
    if op is Operation.SIDE_QUERY and "tools" in arguments:
        arguments.pop("tools")
        arguments["options"] = "temperature=1"
        words = "options must be a mapping"
    with pytest.raises(ConfigError, match=words):
        if op in (Operation.CHAT, Operation.SIDE_QUERY):
            await getattr(service, op.value)(**arguments)
        else:
            async with getattr(service, op.value)(**arguments) as items:
                pytest.fail(f"a bad request opened: {items!r}")
    assert model.requests == []


def test_a_request_built_or_replaced_with_bad_messages_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="messages must be a sequence"):
        ModelRequest(Operation.CHAT, "m", None)  # type: ignore[arg-type]
    request = ModelRequest(Operation.CHAT, "m", MESSAGES)
    with pytest.raises(ConfigError, match=r"messages\[0\] is not a message"):
        request.replace(messages=["hi"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"tools\[0\] is not a ToolSpec"):
        request.replace(tools=[{"name": "t"}])  # type: ignore[list-item]


def test_a_request_built_or_replaced_with_options_or_metadata_that_are_no_mapping_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"options must be a mapping.*list"):
        ModelRequest(Operation.CHAT, "m", MESSAGES, options=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"metadata must be a mapping.*str 'abc'"):
        ModelRequest(Operation.CHAT, "m", MESSAGES, metadata="abc")  # type: ignore[arg-type]
    request = ModelRequest(Operation.CHAT, "m", MESSAGES, options={"temperature": 1}, metadata={"trace": "t"})
    with pytest.raises(ConfigError, match=r"options must be a mapping.*str 'temperature'"):
        request.replace(options="temperature")  # type: ignore[arg-type]
    replaced = request.replace(options={"temperature": 0})
    assert replaced.options == {"temperature": 0} and replaced.metadata == {"trace": "t"}
    assert replaced.messages is request.messages and replaced.abort is request.abort


async def test_a_layer_replacing_options_with_no_mapping_fails_as_the_layer_not_the_provider() -> None:
    """The options reached the provider, whose AttributeError was blamed on it (provider_failed)."""

    class BadOptions(WrapsChat):
        async def wrap_chat(self, request: ModelRequest, call_next: Any) -> Any:
            return await call_next(request.replace(options="temperature=0"))  # type: ignore[arg-type]

    model = TestModel(default=Reply("x"))
    with pytest.raises(ModelMiddlewareError, match="options must be a mapping") as caught:
        await ModelService(model, [BadOptions()]).chat(MESSAGES)
    assert isinstance(caught.value.__cause__, ConfigError)
    assert model.requests == []


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, "5", True, None, 10**12])
def test_invalid_request_timeout_is_a_config_error(timeout: Any) -> None:
    with pytest.raises(ConfigError, match="request_timeout"):
        ModelService(TestModel(), request_timeout=timeout)


def test_valid_request_timeouts_are_accepted() -> None:
    assert ModelService(TestModel(), request_timeout=5).request_timeout == 5.0
    assert ModelService(TestModel(), request_timeout=0.25).request_timeout == 0.25


# -- concurrency: one middleware instance, many tasks --------------------------------------------------------


class RequestLocalState(ModelMiddleware):
    """Keeps request-local state in a local: correct under concurrency."""

    async def wrap_chat(self, request: ModelRequest, call_next: Any) -> ModelResponse:
        marker = request.options["marker"]
        for _ in range(request.options["pauses"]):
            await trio.lowlevel.checkpoint()
        return await call_next(request.replace(options={**request.options, "echo": marker}))


class StateOnSelf(ModelMiddleware):
    """Keeps request-local state on the shared instance: the negative control."""

    async def wrap_chat(self, request: ModelRequest, call_next: Any) -> ModelResponse:
        self.marker = request.options["marker"]
        for _ in range(request.options["pauses"]):
            await trio.lowlevel.checkpoint()
        return await call_next(request.replace(options={**request.options, "echo": self.marker}))


def echo(request: ModelRequest) -> Reply:
    return Reply(str(request.options["echo"]))


async def mismatches(layer: object, pauses: list[int]) -> list[int]:
    """Run one chat per entry of *pauses* concurrently through one shared *layer*; return the tasks that got
    somebody else's answer."""
    service = ModelService(TestModel(respond=echo), [make_layer(Operation.CHAT, "outer", []), layer])
    answers: dict[int, str] = {}

    async def one(index: int) -> None:
        response = await service.chat(
            [UserMessage(f"task {index}")], options={"marker": f"m{index}", "pauses": pauses[index]}
        )
        answers[index] = response.message.text

    async with trio.open_nursery() as nursery:
        for index in range(len(pauses)):
            nursery.start_soon(one, index)
    assert len(answers) == len(pauses)
    return [index for index, text in answers.items() if text != f"m{index}"]


TASKS = 200


@settings(max_examples=15, deadline=None)
@given(pauses=st.lists(st.integers(0, 6), min_size=TASKS, max_size=TASKS))
def test_request_local_state_survives_concurrency(pauses: list[int]) -> None:
    assert trio.run(mismatches, RequestLocalState(), pauses) == []


@settings(max_examples=15, deadline=None)
@given(pauses=st.lists(st.integers(1, 6), min_size=TASKS, max_size=TASKS))
def test_the_same_check_catches_state_kept_on_the_middleware(pauses: list[int]) -> None:
    assert trio.run(mismatches, StateOnSelf(), pauses) != []


async def test_concurrent_streams_through_one_stack_stay_separate(autojump_clock: trio.testing.MockClock) -> None:
    script = {f"c{i}": [Reply(" ".join(f"{i}.{w}" for w in range(8)), latency=(i % 5) * 0.1)] for i in range(50)}
    model = TestModel(script)
    service = ModelService(model, [Tap("a", []), Tap("b", [])])
    texts: dict[int, str] = {}

    async def one(i: int) -> None:
        async with service.stream([UserMessage(f"c{i}")]) as chunks:
            parts = []
            async for chunk in chunks:
                if isinstance(chunk, TextDelta):
                    parts.append(chunk.text)
                    await trio.lowlevel.checkpoint()
                else:
                    assert isinstance(chunk, (UsageChunk, FinishChunk))
            texts[i] = "".join(parts)

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(one, i)
    assert texts == {i: " ".join(f"{i}.{w}" for w in range(8)) for i in range(50)}


# Keep the helper type honest for mypy users reading this file.
_: Callable[..., Awaitable[Any]] = run_op
