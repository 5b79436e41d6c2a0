"""The OpenAI-compatible provider over real HTTP against a local fake server (nothing of ours is mocked).

Fixtures in tests/fixtures/openai are recorded-shape wire payloads; the first test checks each of them
(every SSE data event too) against the official ``openai`` SDK types, so they cannot drift from the API.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import sys
import tracemalloc
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fake_server import (
    FakeServer,
    Gate,
    Scripted,
    encoded,
    gzip_bomb,
    open_fake_server,
    queue_handler,
    retry_after_responses,
)
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from trio_agent import (
    AuthenticationError,
    ConfigError,
    HistoryError,
    ModelError,
    ModelTimeoutError,
    Provider,
    ProviderError,
    RateLimitError,
    SideEffect,
    ToolKind,
    chat,
    define_tool,
)
from trio_agent._cleanup import DEFAULT_CLEANUP_GRACE
from trio_agent._models._assemble import ReplyAssembler
from trio_agent._models._openai import OpenAIProvider
from trio_agent._models._providers import create_provider
from trio_agent.models import (
    AssistantMessage,
    FinishChunk,
    FinishReason,
    MalformedResponseError,
    ModelConnectionError,
    ModelNotFoundError,
    ModelRequest,
    ModelService,
    Operation,
    ProviderConfigError,
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
    ToolResultMessage,
    ToolSpec,
    Usage,
    UsageChunk,
    UserMessage,
)

FIXTURES = Path(__file__).parent / "fixtures" / "openai"
MODEL = "gpt-4o-mini"
HELLO = (UserMessage("hi"),)


# -- helpers --------------------------------------------------------------------------------------


def fixture_json(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def fixture_sse(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def sse_events(raw: bytes) -> list[bytes]:
    """The fixture's events (each with its blank line), comments included as their own events."""
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def sse_data(raw: bytes) -> list[str]:
    """The data payloads of an SSE body (a small independent parser, for fixture validation)."""
    payloads = []
    for block in raw.decode().split("\n\n"):
        data = [line[len("data:") :].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
        if data:
            payloads.append("\n".join(data))
    return payloads


def awkward_pieces(raw: bytes) -> list[bytes]:
    """Split *raw* mid-JSON, mid-line, inside multi-byte characters and between the two newlines
    that end an event, plus every 11 bytes."""
    cuts = set(range(11, len(raw), 11))
    cuts |= {index + 1 for index in range(len(raw) - 1) if raw[index : index + 2] == b"\n\n"}
    cuts |= {index for index in range(1, len(raw)) if raw[index] & 0xC0 == 0x80}  # inside a UTF-8 sequence
    cuts |= {raw.index(b"[DONE]") + 3}
    bounds = [0, *sorted(cuts), len(raw)]
    pieces = [raw[start:end] for start, end in itertools.pairwise(bounds) if end > start]
    assert b"".join(pieces) == raw
    return pieces


def chunk_event(delta: dict[str, Any], finish: str | None = None, *, valid: bool = True, **extra: Any) -> bytes:
    """One ``chat.completion.chunk`` SSE event; checked against the SDK type unless deliberately invalid."""
    payload = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 1754000000,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }
    if valid:
        ChatCompletionChunk.model_validate(payload)
    return f"data: {json.dumps(payload)}\n\n".encode()


def completion(message: dict[str, Any], finish: Any = "stop", **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1754000000,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
        **extra,
    }


DONE = b"data: [DONE]\n\n"


def provider_for(server: FakeServer, **kwargs: Any) -> OpenAIProvider:
    kwargs.setdefault("api_key", "sk-test")
    kwargs.setdefault("base_url", server.url + "/v1")
    return OpenAIProvider(MODEL, **kwargs)


def request(
    *messages: Any,
    tools: Sequence[ToolSpec] = (),
    options: dict[str, Any] | None = None,
    operation: Operation = Operation.STREAM,
) -> ModelRequest:
    return ModelRequest(operation, MODEL, messages or HELLO, tuple(tools), options or {})


async def collect(provider: OpenAIProvider, req: ModelRequest, into: list[StreamChunk] | None = None) -> list[Any]:
    chunks: list[Any] = [] if into is None else into
    async with aclosing(provider.stream(req)) as stream:
        async for chunk in stream:
            chunks.append(chunk)
    return chunks


async def wait_closed(event: trio.Event) -> None:
    with trio.fail_after(5):  # a hang guard, not synchronisation
        await event.wait()


# -- fixtures vs the official SDK types -------------------------------------------------------------


def test_fixtures_validate_against_the_official_sdk_types() -> None:
    text = ChatCompletion.model_validate(fixture_json("chat_text.json"))
    assert text.choices[0].finish_reason == "stop" and text.choices[0].message.content
    tools = ChatCompletion.model_validate(fixture_json("chat_tool_calls.json"))
    assert len(tools.choices[0].message.tool_calls or []) == 2
    usage_only = ChatCompletionChunk.model_validate(fixture_json("chunk_usage_only.json"))
    assert usage_only.choices == [] and usage_only.usage is not None
    for name in ("stream_text.sse", "stream_tool_calls.sse"):
        raw = fixture_sse(name)
        assert b": keep-alive\n" in raw and raw.endswith(DONE)
        payloads = sse_data(raw)
        assert payloads[-1] == "[DONE]"
        chunks = [ChatCompletionChunk.model_validate(json.loads(data)) for data in payloads[:-1]]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None  # the include_usage chunk
        assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in chunks)
    streamed_calls = {
        call.index
        for data in sse_data(fixture_sse("stream_tool_calls.sse"))[:-1]
        for choice in ChatCompletionChunk.model_validate(json.loads(data)).choices
        for call in choice.delta.tool_calls or []
    }
    assert streamed_calls == {0, 1}
    for status in (401, 404, 429, 500):
        ErrorObject.model_validate(fixture_json(f"error_{status}.json")["error"])


# -- chat ----------------------------------------------------------------------------------------------


async def test_chat_text_completion() -> None:
    async with (
        open_fake_server(queue_handler(Scripted.json(fixture_json("chat_text.json")))) as server,
        provider_for(server) as provider,
    ):
        response = await provider.chat(request(operation=Operation.CHAT))
    assert response.message == AssistantMessage((TextPart("Hello! How can I help you today? 👋"),))
    assert response.finish_reason is FinishReason.STOP
    assert response.usage == Usage(19, 10, 29, cached_input_tokens=0, reasoning_tokens=0)
    assert response.model == "gpt-4o-mini-2024-07-18"
    assert response.id == "chatcmpl-BzX1fQ9uT3nq0aKpLr2Yc8dE7vW5s"
    (seen,) = server.requests
    assert (seen.method, seen.path) == ("POST", "/v1/chat/completions")
    assert seen.headers["authorization"] == "Bearer sk-test"
    assert seen.headers["content-type"] == "application/json"
    assert seen.json() == {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def test_chat_parallel_tool_calls() -> None:
    async with (
        open_fake_server(queue_handler(Scripted.json(fixture_json("chat_tool_calls.json")))) as server,
        provider_for(server) as provider,
    ):
        response = await provider.chat(request(operation=Operation.CHAT))
    assert response.message.tool_calls == (
        ToolCallPart("call_Vx2kP9qL4mN7rT1s", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ToolCallPart("call_Hq8wE3yU6iO0pA5d", "get_time", '{"timezone": "Europe/Paris"}'),
    )
    assert response.message.text == ""
    assert response.finish_reason is FinishReason.TOOL_CALLS
    assert response.usage == Usage(82, 51, 133, cached_input_tokens=64, reasoning_tokens=12)


async def test_request_body_maps_messages_tools_and_options() -> None:
    weather = ToolSpec(
        "get_weather", "Weather for a city", {"type": "object", "properties": {"city": {"type": "string"}}}
    )
    conversation = (
        SystemMessage("be brief"),
        UserMessage("weather and time in Paris?"),
        AssistantMessage(
            (
                ReasoningPart("the user wants two tools", signature="sig"),
                TextPart("Checking."),
                ToolCallPart("call_1", "get_weather", '{"city": "Paris"}'),
                ToolCallPart("call_2", "get_time", "{}"),
            )
        ),
        ToolResultMessage("call_1", "18 C"),
        ToolResultMessage("call_2", "no such tool", is_error=True),
        AssistantMessage((ToolCallPart("call_3", "get_weather", '{"city": "Lyon"}'),)),
        ToolResultMessage("call_3", "20 C"),
        AssistantMessage((TextPart("Done."),)),
    )
    handler = queue_handler(
        Scripted.json(fixture_json("chat_text.json")), Scripted.sse(awkward_pieces(fixture_sse("stream_text.sse")))
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        options = {
            "temperature": 0.2,
            "max_tokens": 100,
            "stream_options": {"chunk_size": 3},
            "extra_body": {"top_k": 5},
        }
        await provider.chat(request(*conversation, tools=[weather], options=options, operation=Operation.CHAT))
        await collect(provider, request(*conversation, tools=[weather], options=options))
    expected_messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather and time in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no such tool"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_3",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_3", "content": "20 C"},
        {"role": "assistant", "content": "Done."},
    ]
    expected_tools = [{"type": "function", "function": {"name": "get_weather", **_spec_fields(weather)}}]
    chat_body, stream_body = (seen.json() for seen in server.requests)
    assert chat_body == {
        "model": MODEL,
        "messages": expected_messages,
        "tools": expected_tools,
        "temperature": 0.2,
        "max_tokens": 100,
        "top_k": 5,
    }  # no stream / stream_options on a non-streaming call; extra_body merged in
    assert stream_body == {
        **chat_body,
        "stream": True,
        "stream_options": {"chunk_size": 3, "include_usage": True},
    }
    assert server.requests[1].headers["accept"] == "text/event-stream"


def _spec_fields(spec: ToolSpec) -> dict[str, Any]:
    return {"description": spec.description, "parameters": spec.parameters}


@pytest.mark.parametrize("key", ["model", "messages", "tools", "stream"])
async def test_options_cannot_override_what_the_provider_sets(key: str) -> None:
    async with open_fake_server(queue_handler()) as server, provider_for(server) as provider:
        with pytest.raises(ModelError, match=repr(key)) as caught:
            await provider.chat(request(options={key: "x"}, operation=Operation.CHAT))
        assert caught.value.code == "provider_reserved_option"
        with pytest.raises(ModelError, match=repr(key)):
            await collect(provider, request(options={key: "x"}))
    assert server.requests == []


@pytest.mark.parametrize("stop", [5, ["END", 5], {"END"}, b"END"])
async def test_a_stop_option_that_is_no_string_or_list_of_strings_is_named(stop: object) -> None:
    async with open_fake_server(queue_handler()) as server, provider_for(server) as provider:
        with pytest.raises(ModelError, match="'stop' must be a string or a list of strings") as caught:
            await provider.chat(request(options={"stop": stop}, operation=Operation.CHAT))
        assert caught.value.code == "provider_bad_option"
        with pytest.raises(ModelError, match="'stop'"):
            await collect(provider, request(options={"stop": stop}))
    assert server.requests == []


@pytest.mark.parametrize("api_key", [5, b"sk-bytes", ["sk"]])
def test_an_api_key_that_is_no_string_is_a_config_error(api_key: Any) -> None:
    for build in (
        lambda: OpenAIProvider(MODEL, api_key=api_key),
        lambda: create_provider("openai", MODEL, api_key=api_key),
    ):
        with pytest.raises(ProviderConfigError, match=f"api_key must be a string, got {type(api_key).__name__}"):
            build()


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("tool_calls", FinishReason.TOOL_CALLS),
        ("function_call", FinishReason.TOOL_CALLS),
        ("content_filter", FinishReason.CONTENT_FILTER),
    ],
)
async def test_finish_reasons_are_mapped(wire: str, reason: FinishReason) -> None:
    body = completion({"content": "x"}, wire)
    ChatCompletion.model_validate(body)
    stream = Scripted.sse([chunk_event({"content": "x"}), chunk_event({}, wire), DONE])
    async with (
        open_fake_server(queue_handler(Scripted.json(body), stream)) as server,
        provider_for(server) as provider,
    ):
        assert (await provider.chat(request(operation=Operation.CHAT))).finish_reason is reason
        assert (await collect(provider, request()))[-1] == FinishChunk(reason)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (completion({"content": "x"}, "sleepy"), "unknown choices[0].finish_reason 'sleepy'"),
        (completion({"content": None}, None), "missing choices[0].finish_reason"),
        (completion({"content": ""}, ""), "missing choices[0].finish_reason"),
        ({"id": "x", "object": "chat.completion"}, "missing choices"),
        (completion({"content": "x"}) | {"choices": []}, "choices is empty"),
        ({"choices": [{"index": 0, "finish_reason": "stop"}]}, "missing choices[0].message"),
        (completion({"content": 7}), "choices[0].message.content must be a string"),
        (
            completion({"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
            "missing choices[0].message.tool_calls[0].id",
        ),
        (
            completion({"tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}),
            "missing choices[0].message.tool_calls[0].function.name",
        ),
        (completion({"content": "x"}, usage={"completion_tokens": 1}), "missing usage.prompt_tokens"),
        (
            completion({"content": "x"}, usage={"prompt_tokens": -1000000, "completion_tokens": 1}),
            "usage.prompt_tokens must be a token count from 0 to 9007199254740991, got -1000000",
        ),
        (
            completion({"content": "x"}, usage={"prompt_tokens": 1, "completion_tokens": 10**40}),
            "usage.completion_tokens must be a token count",
        ),
        (
            completion(
                {"content": "x"},
                usage={"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": -7}},
            ),
            "usage.prompt_tokens_details.cached_tokens must be a token count",
        ),
        (
            # Each count in range, their sum (the total left out) past it: ModelService refused it, so
            # a stream failed as provider_failed after its text was published.
            completion({"content": "x"}, usage={"prompt_tokens": 2**53 - 1, "completion_tokens": 7}),
            "usage.prompt_tokens + usage.completion_tokens (the total_tokens left out) must be a token count "
            "from 0 to 9007199254740991, got 9007199254740998",
        ),
        (
            completion({"content": "x"}, usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2**53}),
            "usage.total_tokens must be a token count",
        ),
        ([1, 2], "response body must be an object"),
    ],
)
async def test_malformed_completions_name_what_is_wrong(body: Any, named: str) -> None:
    async with open_fake_server(queue_handler(Scripted.json(body))) as server, provider_for(server) as provider:
        with pytest.raises(MalformedResponseError) as caught:
            await provider.chat(request(operation=Operation.CHAT))
    assert named in str(caught.value)
    assert not caught.value.retryable


async def test_a_completion_that_is_not_json_is_malformed() -> None:
    scripted = Scripted(200, [("content-type", "application/json")], [b'{"id": "chatcmpl-x", "choi'], chunked=False)
    async with open_fake_server(queue_handler(scripted)) as server, provider_for(server) as provider:
        with pytest.raises(MalformedResponseError, match="not valid JSON"):
            await provider.chat(request(operation=Operation.CHAT))


async def test_json_nested_too_deeply_to_parse_is_malformed_not_a_bare_recursion_error() -> None:
    depth = sys.getrecursionlimit() + 100  # valid JSON, nested deeper than the json module can recurse
    deep = b"[" * depth + b"]" * depth
    deep_event = b'data: {"choices": ' + deep + b"}\n\n"
    handler = queue_handler(
        Scripted(200, [("content-type", "application/json")], [deep], chunked=False),
        Scripted.sse([deep_event]),
        Scripted.sse([deep_event]),
        Scripted(400, [("content-type", "application/json")], [deep], chunked=False),
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        with pytest.raises(MalformedResponseError, match="the chat completion nests arrays and objects too deeply"):
            await provider.chat(request(operation=Operation.CHAT))
        with pytest.raises(MalformedResponseError, match="an SSE event nests arrays and objects too deeply"):
            await collect(provider, request())
        # Through the service: the provider's typed error, not a bare error reported as provider_failed.
        service = ModelService(provider, retry=RetryPolicy(max_attempts=1))
        with pytest.raises(MalformedResponseError, match="too deeply"):
            async with service.stream(HELLO) as chunks:
                async for _ in chunks:
                    pass
        # An error body that cannot be parsed is shown as text, whatever the reason.
        with pytest.raises(ProviderError, match=r"HTTP 400 .*: \[\[\[") as caught:
            await provider.chat(request(operation=Operation.CHAT))
    assert type(caught.value) is ProviderError and caught.value.status == 400


async def test_oversize_bodies_are_rejected_without_buffering_them() -> None:
    big = completion({"content": "x" * 5000})
    chunked = Scripted(
        200,
        [("content-type", "application/json")],
        [json.dumps(big).encode()[i : i + 500] for i in range(0, 5200, 500)],
    )
    async with open_fake_server(queue_handler(Scripted.json(big), chunked, Scripted.json(big))) as server:
        async with provider_for(server, max_response_bytes=4096) as small:
            with pytest.raises(MalformedResponseError, match="max_response_bytes=4096"):
                await small.chat(request(operation=Operation.CHAT))  # content-length says too big
            with pytest.raises(MalformedResponseError, match="max_response_bytes=4096"):
                await small.chat(request(operation=Operation.CHAT))  # chunked: counted while reading
        async with provider_for(server, max_response_bytes=6000) as large:
            assert (await large.chat(request(operation=Operation.CHAT))).message.text == "x" * 5000


@pytest.mark.parametrize("operation", [Operation.CHAT, Operation.STREAM])
async def test_a_compressed_bomb_is_refused_at_max_response_bytes_with_memory_bounded(operation: Operation) -> None:
    """128 MiB of zeros gzipped to 128 KiB, with a 1 MiB bound: refused once 1 MiB is decoded.
    httpx decoded each network read whole before a byte was counted (64 KiB read, 64 MiB decoded)."""
    limit = 2**20
    content_type = "application/json" if operation is Operation.CHAT else "text/event-stream"
    bomb = gzip_bomb(128, b'{"choices": "' if operation is Operation.CHAT else b"data: ")
    scripted = Scripted(200, [("content-type", content_type), ("content-encoding", "gzip")], [bomb], chunked=False)
    async with open_fake_server(queue_handler(scripted)) as server, provider_for(server, max_response_bytes=limit) as p:
        tracemalloc.start()
        try:
            with pytest.raises(MalformedResponseError, match=f"larger than max_response_bytes={limit}"):
                if operation is Operation.CHAT:
                    await p.chat(request(operation=Operation.CHAT))
                else:
                    await collect(p, request())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 8 * limit  # the bound plus a few reads, not a decoded network read
    assert server.requests[0].headers["accept-encoding"] == "gzip, deflate"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate"])
async def test_gzip_and_deflate_bodies_are_decoded_as_they_arrive(encoding: str) -> None:
    wire = "deflate" if encoding == "raw-deflate" else encoding
    body = encoded(json.dumps(completion({"content": "ünïcode " * 50})).encode(), encoding)
    events = [chunk_event({"content": "a" * 70_000}), chunk_event({"content": "b"}, "stop"), DONE]
    stream = encoded(b"".join(events), encoding)
    responses = [
        Scripted(
            200, [("content-type", kind), ("content-encoding", wire)], [data[i : i + 7] for i in range(0, len(data), 7)]
        )
        for kind, data in (("application/json", body), ("text/event-stream", stream))
    ]
    async with open_fake_server(queue_handler(*responses)) as server, provider_for(server) as provider:
        reply = await provider.chat(request(operation=Operation.CHAT))
        chunks = await collect(provider, request())
    assert reply.message.text == "ünïcode " * 50
    assert "".join(chunk.text for chunk in chunks if isinstance(chunk, TextDelta)) == "a" * 70_000 + "b"


@pytest.mark.parametrize("encoding", ["zstd", "br", "gzip, gzip", "compress"])
async def test_an_encoding_the_provider_did_not_ask_for_is_refused_by_name(encoding: str) -> None:
    """Decoding a zstd or brotli body cannot be bounded as it goes: the provider asks for gzip and
    deflate only, and a server that sends another encoding anyway fails the call (malformed)."""
    body = b"\x28\xb5\x2f\xfd not really compressed"
    responses = [
        Scripted(200, [("content-type", kind), ("content-encoding", encoding)], [body])
        for kind in ("application/json", "text/event-stream")
    ]
    async with open_fake_server(queue_handler(*responses)) as server, provider_for(server) as provider:
        with pytest.raises(MalformedResponseError, match=f"encoded as '{encoding}'.*asks for gzip, deflate only"):
            await provider.chat(request(operation=Operation.CHAT))
        with pytest.raises(MalformedResponseError, match=f"encoded as '{encoding}'"):
            await collect(provider, request())
    assert [seen.headers["accept-encoding"] for seen in server.requests] == ["gzip, deflate"] * 2


async def test_compatible_server_variants_are_accepted() -> None:
    """reasoning_content (vLLM, DeepSeek, llama.cpp), a usage chunk with choices null, no usage details."""
    body = completion({"content": "4", "reasoning_content": "2+2"}, usage={"prompt_tokens": 3, "completion_tokens": 2})
    stream = Scripted.sse(
        [
            chunk_event({"role": "assistant", "reasoning_content": "thinking"}),
            chunk_event({"content": "4"}),
            chunk_event({}, "stop"),
            b'data: {"id":"x","object":"chat.completion.chunk","choices":null,'
            b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n',
            DONE,
        ]
    )
    async with (
        open_fake_server(queue_handler(Scripted.json(body), stream)) as server,
        provider_for(server) as provider,
    ):
        response = await provider.chat(request(operation=Operation.CHAT))
        chunks = await collect(provider, request())
    assert response.message.parts == (ReasoningPart("2+2"), TextPart("4"))
    assert response.usage == Usage(3, 2, 5)
    assert chunks == [
        ReasoningDelta("thinking"),
        TextDelta("4"),
        UsageChunk(Usage(3, 2, 5)),
        FinishChunk(FinishReason.STOP),
    ]


async def test_an_error_object_with_status_200_is_a_typed_error() -> None:
    async with (
        open_fake_server(queue_handler(Scripted.json(fixture_json("error_500.json")))) as server,
        provider_for(server) as provider,
    ):
        with pytest.raises(ProviderServerError, match="The server had an error"):
            await provider.chat(request(operation=Operation.CHAT))


# -- HTTP errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "error_type", "retryable", "text"),
    [
        (401, fixture_json("error_401.json"), AuthenticationError, False, "Incorrect API key provided"),
        (
            403,
            {"error": {"message": "not allowed", "type": "permission_error"}},
            AuthenticationError,
            False,
            "not allowed",
        ),
        (404, fixture_json("error_404.json"), ModelNotFoundError, False, "gpt-nope` does not exist"),
        (429, fixture_json("error_429.json"), RateLimitError, True, "Rate limit reached"),
        (500, fixture_json("error_500.json"), ProviderServerError, True, "The server had an error"),
        (503, {"detail": "upstream overloaded"}, ProviderServerError, True, "upstream overloaded"),
        (
            400,
            {"error": {"message": "bad temperature", "code": "invalid_value"}},
            ProviderError,
            False,
            "bad temperature",
        ),
        (408, {"error": "request timed out"}, ProviderError, True, "request timed out"),
    ],
)
async def test_http_errors_are_typed_before_any_body_is_parsed(
    status: int, body: Any, error_type: type[ProviderError], retryable: bool, text: str
) -> None:
    request_id = [("x-request-id", "req_8f3a")]
    handler = queue_handler(
        Scripted.json(body, status=status, headers=request_id), Scripted.json(body, status=status, headers=request_id)
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        with pytest.raises(error_type) as chat_error:
            await provider.chat(request(operation=Operation.CHAT))
        chunks: list[StreamChunk] = []
        with pytest.raises(error_type) as stream_error:
            await collect(provider, request(), chunks)
    assert chunks == []
    for caught in (chat_error, stream_error):
        assert type(caught.value) is error_type
        assert caught.value.status == status
        assert caught.value.retryable is retryable
        assert text in str(caught.value) and f"HTTP {status}" in str(caught.value)
        assert "req_8f3a" in str(caught.value)


@pytest.mark.parametrize("operation", [Operation.CHAT, Operation.STREAM])
async def test_an_error_body_that_cannot_be_read_leaves_the_status_to_decide(operation: Operation) -> None:
    """A body cut mid-way, or in an encoding the provider refuses: the status still types the error."""
    start = [b'{"error": {"message": "Incorrect API']
    responses = (
        Scripted(401, [("content-type", "application/json")], start, cut=True),
        Scripted(429, [("content-type", "application/json"), ("retry-after", "7")], start, cut=True),
        Scripted(429, [("content-encoding", "zstd"), ("retry-after", "7")], [b"\x28\xb5\x2f\xfd"]),
    )
    async with open_fake_server(queue_handler(*responses)) as server, provider_for(server) as provider:
        for error_type in (AuthenticationError, RateLimitError, RateLimitError):
            with pytest.raises(ProviderError) as caught:
                if operation is Operation.CHAT:
                    await provider.chat(request(operation=Operation.CHAT))
                else:
                    await collect(provider, request())
            assert type(caught.value) is error_type
            assert caught.value.status in (401, 429)
            if error_type is RateLimitError:
                assert isinstance(caught.value, RateLimitError) and caught.value.retry_after == 7.0


async def test_a_plain_text_error_body_is_quoted() -> None:
    scripted = Scripted(502, [("content-type", "text/html")], [b"<html>Bad Gateway</html>"])
    async with open_fake_server(queue_handler(scripted)) as server, provider_for(server) as provider:
        with pytest.raises(ProviderServerError, match="Bad Gateway") as caught:
            await provider.chat(request(operation=Operation.CHAT))
    assert caught.value.status == 502


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([("retry-after", "2")], 2.0),
        ([("retry-after", "0.25")], 0.25),
        ([("retry-after-ms", "1500"), ("retry-after", "9")], 1.5),
        ([("retry-after", "soon")], None),
        ([], None),
    ],
)
async def test_rate_limit_retry_after(headers: list[tuple[str, str]], expected: float | None) -> None:
    handler = queue_handler(Scripted.json(fixture_json("error_429.json"), status=429, headers=headers))
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        with pytest.raises(RateLimitError) as caught:
            await provider.chat(request(operation=Operation.CHAT))
    assert caught.value.retry_after == expected


async def test_rate_limit_retry_after_http_date_and_exhausted_quota() -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    quota = {
        "error": {
            "message": "You exceeded your current quota",
            "type": "insufficient_quota",
            "code": "insufficient_quota",
        }
    }
    handler = queue_handler(
        Scripted.json(fixture_json("error_429.json"), status=429, headers=[("retry-after", when)]),
        Scripted.json(quota, status=429),
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        with pytest.raises(RateLimitError) as dated:
            await provider.chat(request(operation=Operation.CHAT))
        with pytest.raises(RateLimitError, match="exceeded your current quota") as exhausted:
            await provider.chat(request(operation=Operation.CHAT))
    assert dated.value.retry_after is not None and 25 <= dated.value.retry_after <= 30
    assert exhausted.value.retryable is False  # waiting does not refill a quota


@pytest.mark.parametrize("operation", [Operation.CHAT, Operation.STREAM])
@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (503, ProviderServerError),
        (500, ProviderServerError),
        (529, ProviderServerError),
        (408, ProviderError),
        (409, ProviderError),
    ],
)
async def test_every_retryable_status_carries_the_servers_retry_after(
    operation: Operation, status: int, error_type: type[ProviderError]
) -> None:
    """A 503 with ``Retry-After`` (or any 5xx, 408, 409) lost it: only a 429 kept the server's wait
    hint, so the retry loop came back sooner than the server asked."""
    body = {"error": {"message": "busy", "type": "server_error"}}
    responses, expected = retry_after_responses(status, body, b'{"error": {"mess')
    async with open_fake_server(queue_handler(*responses)) as server, provider_for(server) as provider:
        for wanted in expected:
            with pytest.raises(ProviderError) as caught:
                if operation is Operation.CHAT:
                    await provider.chat(request(operation=Operation.CHAT))
                else:
                    await collect(provider, request())
            assert type(caught.value) is error_type
            assert (caught.value.status, caught.value.retryable) == (status, True)
            after = caught.value.retry_after
            if wanted is None:
                assert after is None
            else:
                assert after is not None and wanted[0] <= after <= wanted[1]


@pytest.mark.parametrize(
    ("status", "error_type"),
    [(400, ProviderError), (401, AuthenticationError), (403, AuthenticationError), (404, ModelNotFoundError)],
)
async def test_a_non_retryable_status_ignores_retry_after(status: int, error_type: type[ProviderError]) -> None:
    """A wait hint on a status that waiting does not mend changes nothing: not retryable, no ``retry_after``."""
    scripted = Scripted.json({"error": {"message": "no"}}, status=status, headers=[("retry-after", "7")])
    async with open_fake_server(queue_handler(scripted)) as server, provider_for(server) as provider:
        with pytest.raises(ProviderError) as caught:
            await provider.chat(request(operation=Operation.CHAT))
    assert type(caught.value) is error_type
    assert (caught.value.status, caught.value.retryable, caught.value.retry_after) == (status, False, None)


async def test_connection_refused_is_a_retryable_connection_error() -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with OpenAIProvider(MODEL, api_key="k", base_url=f"http://127.0.0.1:{port}/v1") as provider:
        with pytest.raises(ModelConnectionError) as chat_error:
            await provider.chat(request(operation=Operation.CHAT))
        with pytest.raises(ModelConnectionError):
            await collect(provider, request())
    assert chat_error.value.retryable


# -- streaming ------------------------------------------------------------------------------------


async def test_stream_text_split_at_awkward_byte_boundaries() -> None:
    pieces = awkward_pieces(fixture_sse("stream_text.sse"))
    async with open_fake_server(queue_handler(Scripted.sse(pieces))) as server, provider_for(server) as provider:
        chunks = await collect(provider, request())
    assert chunks == [
        TextDelta("Héllo"),
        TextDelta(", wörld"),
        TextDelta(" 🌍!"),
        UsageChunk(Usage(24, 7, 31, cached_input_tokens=16, reasoning_tokens=0)),
        FinishChunk(FinishReason.STOP),
    ]
    body = server.requests[0].json()
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_stream_parallel_tool_calls_assembled_per_index() -> None:
    pieces = awkward_pieces(fixture_sse("stream_tool_calls.sse"))
    async with open_fake_server(queue_handler(Scripted.sse(pieces))) as server, provider_for(server) as provider:
        chunks = await collect(provider, request())
    weather = '{"city": "Paris", "unit": "celsius"}'
    clock = '{"timezone": "Europe/Paris"}'
    assert chunks == [
        ToolCallStart(0, "call_Vx2kP9qL4mN7rT1s", "get_weather"),
        ToolCallDelta(0, '{"ci'),
        ToolCallDelta(0, 'ty": "Pa'),
        ToolCallDelta(0, 'ris", "unit"'),
        ToolCallDelta(0, ': "celsius"}'),
        ToolCallStart(1, "call_Hq8wE3yU6iO0pA5d", "get_time"),
        ToolCallDelta(1, '{"time'),
        ToolCallDelta(1, 'zone": "Europe/'),
        ToolCallDelta(1, 'Paris"}'),
        ToolCallEnd(0, "call_Vx2kP9qL4mN7rT1s", "get_weather", weather),
        ToolCallEnd(1, "call_Hq8wE3yU6iO0pA5d", "get_time", clock),
        UsageChunk(Usage(82, 51, 133, cached_input_tokens=0, reasoning_tokens=0)),
        FinishChunk(FinishReason.TOOL_CALLS),
    ]


async def test_stream_interleaved_tool_calls_and_ends_at_done_without_usage() -> None:
    """Pieces of two calls interleave (even in one delta); a server that ignores include_usage sends no usage."""
    events = [
        chunk_event(
            {"tool_calls": [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}}]}
        ),
        chunk_event(
            {
                "tool_calls": [
                    {"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": '{"x"'}},
                    {"index": 0, "function": {"arguments": '"k": 1'}},
                ]
            }
        ),
        chunk_event(
            {
                "tool_calls": [
                    {"index": 1, "function": {"arguments": ": 2}"}},
                    {"index": 0, "function": {"arguments": "}"}},
                ]
            }
        ),
        chunk_event({}, "tool_calls"),
        DONE,
    ]
    async with open_fake_server(queue_handler(Scripted.sse(events))) as server, provider_for(server) as provider:
        chunks = await collect(provider, request())
    assert [chunk for chunk in chunks if isinstance(chunk, ToolCallEnd)] == [
        ToolCallEnd(0, "a", "f", '{"k": 1}'),
        ToolCallEnd(1, "b", "g", '{"x": 2}'),
    ]
    assert not any(isinstance(chunk, UsageChunk) for chunk in chunks)
    assert chunks[-1] == FinishChunk(FinishReason.TOOL_CALLS)


def tool_delta(index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        delta |= {"id": call_id, "type": "function"}
        delta["function"]["name"] = name
    return delta


async def test_parallel_tool_calls_sent_with_one_reused_index_stay_apart() -> None:
    """Ollama, LiteLLM and other gateways send every parallel call with index 0 and its own id:
    they were merged into one call (the first name, both arguments joined)."""
    events = [
        chunk_event({"role": "assistant", "tool_calls": [tool_delta(0, '{"path": "a.py"}', "call_a", "write")]}),
        chunk_event({"tool_calls": [tool_delta(0, '{"path"', "call_b", "delete")]}),
        chunk_event({"tool_calls": [tool_delta(0, ': "b.py"}')]}),  # no id: continues the latest call
        chunk_event({"tool_calls": [tool_delta(1, "{}", "call_c", "list")]}),  # wire index 1 is taken: moved on
        chunk_event({"tool_calls": [tool_delta(1, "", "call_c", "list")]}),  # its own id repeated: the same call
        chunk_event({}, "tool_calls"),
        DONE,
    ]
    async with open_fake_server(queue_handler(Scripted.sse(events))) as server, provider_for(server) as provider:
        chunks = await collect(provider, request())
    assert [chunk for chunk in chunks if isinstance(chunk, ToolCallStart)] == [
        ToolCallStart(0, "call_a", "write"),
        ToolCallStart(1, "call_b", "delete"),
        ToolCallStart(2, "call_c", "list"),
    ]
    assert [chunk for chunk in chunks if isinstance(chunk, ToolCallEnd)] == [
        ToolCallEnd(0, "call_a", "write", '{"path": "a.py"}'),
        ToolCallEnd(1, "call_b", "delete", '{"path": "b.py"}'),
        ToolCallEnd(2, "call_c", "list", "{}"),
    ]
    assert chunks[-1] == FinishChunk(FinishReason.TOOL_CALLS)


async def test_invalid_tool_arguments_pass_through_unchanged() -> None:
    broken = '{"city": Par'
    body = completion(
        {
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": broken}}],
        },
        "tool_calls",
    )
    ChatCompletion.model_validate(body)
    stream = Scripted.sse(
        [
            chunk_event(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": '},
                        }
                    ]
                }
            ),
            chunk_event({"tool_calls": [{"index": 0, "function": {"arguments": "Par"}}]}),
            chunk_event({}, "tool_calls"),
            DONE,
        ]
    )
    async with (
        open_fake_server(queue_handler(Scripted.json(body), stream)) as server,
        provider_for(server) as provider,
    ):
        response = await provider.chat(request(operation=Operation.CHAT))
        chunks = await collect(provider, request())
    (part,) = response.message.tool_calls
    assert part == ToolCallPart("c1", "get_weather", broken)
    with pytest.raises(ValueError):
        part.parsed_arguments()  # the agent loop turns this into a model-visible tool error
    assert ToolCallEnd(0, "c1", "get_weather", broken) in chunks


async def test_a_stream_cut_mid_way_is_a_retryable_connection_error() -> None:
    events = sse_events(fixture_sse("stream_text.sse"))
    cut_in_event = [*events[:3], events[3][:25]]
    async with (
        open_fake_server(queue_handler(Scripted.sse(cut_in_event, cut=True))) as server,
        provider_for(server) as provider,
    ):
        chunks: list[StreamChunk] = []
        with pytest.raises(ModelConnectionError) as caught:
            await collect(provider, request(), chunks)
    assert caught.value.retryable
    assert chunks == [TextDelta("Héllo")]


async def test_a_stream_that_ends_before_its_finish_reason_is_a_retryable_error() -> None:
    events = [chunk_event({"content": "Hel"}), chunk_event({"content": "lo"})]  # then the body ends
    async with open_fake_server(queue_handler(Scripted.sse(events))) as server, provider_for(server) as provider:
        chunks: list[StreamChunk] = []
        with pytest.raises(ModelConnectionError, match=r"before `data: \[DONE\]`") as caught:
            await collect(provider, request(), chunks)
    assert caught.value.retryable
    assert chunks == [TextDelta("Hel"), TextDelta("lo")]


async def test_a_body_that_ends_after_the_finish_reason_is_a_finished_answer() -> None:
    """No ``[DONE]``: the finish_reason already said the reply is complete (usage is reported when sent)."""
    without_usage = [chunk_event({"content": "Hi"}), chunk_event({}, "stop")]
    events = [event for event in sse_events(fixture_sse("stream_text.sse")) if event != DONE]
    handler = queue_handler(Scripted.sse(without_usage), Scripted.sse(events))
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        assert await collect(provider, request()) == [TextDelta("Hi"), FinishChunk(FinishReason.STOP)]
        chunks = await collect(provider, request())
    assert chunks[-2:] == [
        UsageChunk(Usage(24, 7, 31, cached_input_tokens=16, reasoning_tokens=0)),
        FinishChunk(FinishReason.STOP),
    ]


@pytest.mark.parametrize(
    ("events", "error_type", "text"),
    [
        (
            [chunk_event({"content": "a"}), b'data: {"id": "x", "choices": [{"delta": \n\n'],
            MalformedResponseError,
            "not valid JSON",
        ),
        (
            [chunk_event({"content": "a"}), chunk_event({}, "sleepy", valid=False), DONE],
            MalformedResponseError,
            "unknown choices[0].finish_reason",
        ),
        ([chunk_event({"role": "assistant"}), DONE], MalformedResponseError, "missing finish_reason in the stream"),
        (
            [chunk_event({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]})],
            MalformedResponseError,
            "choices[0].delta.tool_calls[0].id",
        ),
        ([b"data: [1, 2]\n\n"], MalformedResponseError, "must be a JSON object"),
        (
            [b'data: {"error": {"message": "The server had an error", "type": "server_error", "code": null}}\n\n'],
            ProviderServerError,
            "The server had an error",
        ),
        (
            [b'event: error\ndata: {"error": {"message": "slow down", "type": "rate_limit_error"}}\n\n'],
            RateLimitError,
            "slow down",
        ),
        (
            [b'data: {"error": {"object": "error", "message": "bad input", "code": 400}}\n\n'],
            ProviderError,
            "bad input",
        ),
    ],
)
async def test_bad_stream_events_raise_typed_errors(
    events: list[bytes], error_type: type[ModelError], text: str
) -> None:
    async with open_fake_server(queue_handler(Scripted.sse(events))) as server, provider_for(server) as provider:
        with pytest.raises(error_type) as caught:
            await collect(provider, request())
    assert type(caught.value) is error_type
    assert text in str(caught.value)


async def test_a_200_stream_that_is_not_sse() -> None:
    error = Scripted.json(fixture_json("error_401.json"))
    page = Scripted(200, [("content-type", "text/html")], [b"<html>login</html>"])
    async with open_fake_server(queue_handler(error, page)) as server, provider_for(server) as provider:
        with pytest.raises(AuthenticationError, match="Incorrect API key"):
            await collect(provider, request())
        with pytest.raises(MalformedResponseError, match="expected a text/event-stream"):
            await collect(provider, request())


# -- closing and cancellation ------------------------------------------------------------------------


class BodyTracker(httpx.AsyncBaseTransport):
    """httpx's real transport, counting response bodies not yet closed: a check, right when a call
    returns, that the provider closed its response itself (not a garbage-collector finaliser later)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.open_bodies = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        self.open_bodies += 1
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_TrackedBody(response.stream, self),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class _TrackedBody(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, tracker: BodyTracker) -> None:
        self.inner = inner
        self.tracker = tracker
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self.inner:
            yield piece

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.tracker.open_bodies -= 1
        await self.inner.aclose()


async def test_aclose_closes_the_http_response_before_it_returns() -> None:
    events = sse_events(fixture_sse("stream_text.sse"))
    gate = trio.Event()
    tracker = BodyTracker()
    async with (
        open_fake_server(queue_handler(Scripted.sse([*events[:3], Gate(gate), *events[3:]]))) as server,
        httpx.AsyncClient(transport=tracker) as client,
    ):
        provider = provider_for(server, client=client)
        stream = provider.stream(request())
        assert await anext(stream) == TextDelta("Héllo")
        assert tracker.open_bodies == 1
        closed = server.closed
        await stream.aclose()
        assert tracker.open_bodies == 0  # closed by aclose itself, before it returned
        # Let the server move on: it notices the closed socket (had the client kept the connection,
        # the server would finish the response and wait for a next request instead).
        gate.set()
        await wait_closed(closed)
        assert server.closed_connections == 1


async def test_leaving_a_service_stream_early_closes_the_connection() -> None:
    """No gate: the server is stuck sending megabytes the client never reads, until the client hangs up."""
    events = sse_events(fixture_sse("stream_text.sse"))
    flood = [b": keep-alive " + b"x" * 65536 + b"\n\n"] * 64
    tracker = BodyTracker()
    async with (
        open_fake_server(queue_handler(Scripted.sse([*events[:3], *flood, *events[3:]]))) as server,
        httpx.AsyncClient(transport=tracker) as client,
    ):
        service = ModelService(provider_for(server, client=client))
        closed = server.closed
        async with service.stream(HELLO) as chunks:
            async for chunk in chunks:
                assert chunk == TextDelta("Héllo")
                break
        assert tracker.open_bodies == 0
        await wait_closed(closed)


async def test_a_cancel_scope_around_a_stream_closes_the_response_promptly() -> None:
    events = sse_events(fixture_sse("stream_text.sse"))
    gate = trio.Event()
    got_first = trio.Event()
    received: list[StreamChunk] = []
    tracker = BodyTracker()
    async with (
        open_fake_server(queue_handler(Scripted.sse([*events[:3], Gate(gate), *events[3:]]))) as server,
        httpx.AsyncClient(transport=tracker) as client,
    ):
        provider = provider_for(server, client=client)
        closed = server.closed

        async def cancel_when_blocked(scope: trio.CancelScope) -> None:
            await got_first.wait()
            await trio.testing.wait_all_tasks_blocked()  # the consumer waits for bytes the gate holds back
            scope.cancel()

        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_blocked, scope)
                async for chunk in provider.stream(request()):
                    received.append(chunk)
                    got_first.set()
        assert scope.cancelled_caught
        assert received == [TextDelta("Héllo")]
        assert tracker.open_bodies == 0
        gate.set()
        await wait_closed(closed)


async def test_a_finished_stream_releases_its_connection_for_reuse() -> None:
    """When the stream ends, the rest of the body that has arrived (``[DONE]``, the end of the chunked
    body) is read without waiting, so the next call reuses the same connection."""
    pieces = awkward_pieces(fixture_sse("stream_text.sse"))
    tracker = BodyTracker()
    async with (
        open_fake_server(queue_handler(Scripted.sse(pieces), Scripted.sse(pieces))) as server,
        httpx.AsyncClient(transport=tracker) as client,
    ):
        provider = provider_for(server, client=client)
        for _ in range(2):
            chunks: list[StreamChunk] = []
            async for chunk in provider.stream(request()):  # runs to its natural end
                chunks.append(chunk)
                if isinstance(chunk, FinishChunk):
                    # The consumer handles the last chunk; meanwhile the server sends the rest of its body.
                    await trio.testing.wait_all_tasks_blocked()
            assert chunks[-1] == FinishChunk(FinishReason.STOP)
            assert tracker.open_bodies == 0
        await trio.testing.wait_all_tasks_blocked()
        assert len(server.requests) == 2 and server.closed_connections == 0


# -- timeouts ----------------------------------------------------------------------------------------


async def test_stream_idle_timeout() -> None:
    events = sse_events(fixture_sse("stream_text.sse"))
    never = trio.Event()
    handler = queue_handler(Scripted.sse([*events[:3], Gate(never)]), Scripted.sse([Gate(never)]))
    async with open_fake_server(handler) as server, provider_for(server, stream_idle_timeout=0.2) as provider:
        chunks: list[StreamChunk] = []
        with pytest.raises(ModelTimeoutError) as after_chunk:
            await collect(provider, request(), chunks)
        with pytest.raises(ModelTimeoutError) as before_chunk:
            await collect(provider, request())
    assert chunks == [TextDelta("Héllo")]
    for caught in (after_chunk, before_chunk):
        assert caught.value.code == "model_stream_idle_timeout"
        assert "stream_idle_timeout" in str(caught.value)


async def test_chat_read_timeout_is_a_request_timeout() -> None:
    never = trio.Event()
    stalled = Scripted(200, [("content-type", "application/json")], [Gate(never), b"{}"], chunked=False)
    async with open_fake_server(queue_handler(stalled)) as server, provider_for(server, timeout=0.2) as provider:
        with pytest.raises(ModelTimeoutError) as caught:
            await provider.chat(request(operation=Operation.CHAT))
    assert caught.value.code == "model_request_timeout"
    assert isinstance(caught.value, TimeoutError)


async def test_timeout_bounds_a_whole_chat_call_not_only_each_read() -> None:
    """A body that trickles in (each gap shorter than the timeout) still ends at ``timeout`` in total."""
    gates = [trio.Event() for _ in range(3)]
    body = json.dumps(fixture_json("chat_text.json")).encode()
    pieces: list[bytes | Gate] = [body[:10], Gate(gates[0]), body[10:20], Gate(gates[1]), body[20:30]]
    pieces += [Gate(gates[2]), body[30:]]
    trickle = Scripted(200, [("content-type", "application/json")], pieces, chunked=False)

    # Real time has to pass for a real HTTP timeout (no mock clock drives httpx's sockets): each gap
    # is shorter than the 0.5 s budget, three of them are longer. Nothing waits on this for ordering.
    gap = 0.3

    async def open_gates_slowly() -> None:
        for gate in gates:
            await trio.sleep(gap)
            gate.set()

    async with (
        open_fake_server(queue_handler(trickle)) as server,
        provider_for(server, timeout=0.5) as provider,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(open_gates_slowly)
        with pytest.raises(ModelTimeoutError, match=r"took longer than timeout=0\.5 s") as caught:
            await provider.chat(request(operation=Operation.CHAT))
        nursery.cancel_scope.cancel()
    assert caught.value.code == "model_request_timeout"


# -- through ModelService: retries have one owner ------------------------------------------------------


async def test_service_retries_an_error_before_the_first_chunk() -> None:
    handler = queue_handler(
        Scripted.json(fixture_json("error_500.json"), status=500),
        Scripted.sse(awkward_pieces(fixture_sse("stream_text.sse"))),
        Scripted.json(fixture_json("error_429.json"), status=429, headers=[("retry-after", "0")]),
        Scripted.json(fixture_json("chat_text.json")),
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        service = ModelService(provider, retry=RetryPolicy(base_delay=0))
        async with service.stream(HELLO) as chunks:
            text = "".join([chunk.text async for chunk in chunks if isinstance(chunk, TextDelta)])
        assert text == "Héllo, wörld 🌍!"
        assert len(server.requests) == 2
        response = await service.chat(HELLO)
        assert response.finish_reason is FinishReason.STOP
        assert len(server.requests) == 4


async def test_service_waits_the_retry_after_of_a_503() -> None:
    """The service retried a 503 with retry-after at once (base_delay=0): only a 429's hint counted."""
    handler = queue_handler(
        Scripted.json(fixture_json("error_500.json"), status=503, headers=[("retry-after-ms", "20")]),
        Scripted.json(fixture_json("chat_text.json")),
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        service = ModelService(provider, retry=RetryPolicy(base_delay=0, jitter=False))
        async with service.chat_with_retry_events(HELLO) as events:
            items = [item async for item in events]
    retried = items[0]
    assert isinstance(retried, RetryEvent) and isinstance(retried.error, ProviderServerError)
    assert retried.delay == 0.02 and len(items) == 2 and len(server.requests) == 2


async def test_service_never_retries_after_a_published_chunk() -> None:
    events = sse_events(fixture_sse("stream_text.sse"))
    error_event = b'data: {"error": {"message": "The server had an error", "type": "server_error"}}\n\n'
    handler = queue_handler(
        Scripted.sse(events[:3], cut=True),
        Scripted.sse([*events[:3], error_event]),
        Scripted.sse(events),  # would succeed, but must never be asked for
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        service = ModelService(provider, retry=RetryPolicy(base_delay=0))
        for expected_requests, cause in ((1, ModelConnectionError), (2, ProviderServerError)):
            received: list[StreamChunk] = []
            with pytest.raises(StreamInterruptedError) as caught:
                async with service.stream(HELLO) as chunks:
                    async for chunk in chunks:
                        received.append(chunk)
            assert received == [TextDelta("Héllo")]
            assert isinstance(caught.value.__cause__, cause)
            assert not caught.value.retryable
            assert len(server.requests) == expected_requests


# -- configuration and client ownership --------------------------------------------------------------


def test_missing_api_key_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ProviderConfigError, match="OPENAI_API_KEY"):
        OpenAIProvider(MODEL)
    monkeypatch.setenv("OPENAI_API_KEY", "")
    with pytest.raises(ProviderConfigError, match="OPENAI_API_KEY"):
        OpenAIProvider(MODEL)


@pytest.mark.parametrize(
    "url", ["ftp://example.com/v1", "localhost:8000/v1", "http://", "/v1", "http://h/v1?x=1", "http://[::1"]
)
def test_invalid_base_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ProviderConfigError, match="base_url") as caught:
        OpenAIProvider(MODEL, api_key="k", base_url=url)
    assert repr(url) in str(caught.value)


def test_base_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert OpenAIProvider(MODEL, api_key="k").base_url == "https://api.openai.com/v1"
    monkeypatch.setenv("OPENAI_BASE_URL", "http://localhost:11434/v1/")
    assert OpenAIProvider(MODEL, api_key="k").base_url == "http://localhost:11434/v1"
    monkeypatch.setenv("OPENAI_BASE_URL", "localhost:11434")
    with pytest.raises(ProviderConfigError, match="OPENAI_BASE_URL"):
        OpenAIProvider(MODEL, api_key="k")


def test_bad_limits_are_config_errors() -> None:
    with pytest.raises(ProviderConfigError):
        OpenAIProvider("", api_key="k")
    bad: list[dict[str, Any]] = [{"timeout": 0}, {"stream_idle_timeout": -1}, {"max_response_bytes": 0}]
    for kwargs in bad:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            OpenAIProvider(MODEL, api_key="k", **kwargs)


async def test_api_key_from_the_environment_and_extra_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    referer = {"HTTP-Referer": "https://example.org"}
    async with (
        open_fake_server(queue_handler(Scripted.json(fixture_json("chat_text.json")))) as server,
        OpenAIProvider(MODEL, base_url=server.url + "/v1", extra_headers=referer) as provider,
    ):
        assert isinstance(provider, Provider) and provider.name == "openai" and provider.model == MODEL
        await provider.chat(request(operation=Operation.CHAT))
    headers = server.requests[0].headers
    assert headers["authorization"] == "Bearer sk-from-env"
    assert headers["http-referer"] == "https://example.org"


async def test_an_owned_client_is_closed_on_exit() -> None:
    handler = queue_handler(Scripted.json(fixture_json("chat_text.json")))
    async with open_fake_server(handler) as server:
        provider = provider_for(server)
        with pytest.raises(ModelError, match="async with") as not_open:
            await provider.chat(request(operation=Operation.CHAT))
        assert not_open.value.code == "provider_not_open"
        async with provider:
            await provider.chat(request(operation=Operation.CHAT))
            closed = server.closed  # the keep-alive connection stays open in the client's pool
            assert server.closed_connections == 0
        await wait_closed(closed)  # leaving the block closed the client and its connections
        with pytest.raises(ModelError, match="async with"):
            await collect(provider, request())


async def test_a_given_client_is_never_closed_and_with_model_shares_it() -> None:
    handler = queue_handler(*[Scripted.json(fixture_json("chat_text.json"))] * 3)
    async with open_fake_server(handler) as server, httpx.AsyncClient() as client:
        provider = provider_for(server, client=client)
        await provider.chat(request(operation=Operation.CHAT))  # usable without `async with`
        async with provider as entered:
            other = entered.with_model("gpt-4o")
            assert (other.model, other.base_url) == ("gpt-4o", provider.base_url)
            await other.chat(ModelRequest(Operation.CHAT, "gpt-4o", HELLO))
        assert not client.is_closed
        await provider.chat(request(operation=Operation.CHAT))
    assert [seen.json()["model"] for seen in server.requests] == [MODEL, "gpt-4o", MODEL]


async def test_a_given_client_that_was_closed_is_a_typed_error() -> None:
    """A client= closed by its owner raised httpx's bare RuntimeError from chat/stream; the typed
    error of a provider without an open client (as the Anthropic provider's), nothing sent."""
    async with open_fake_server(queue_handler()) as server:
        client = httpx.AsyncClient()
        await client.aclose()
        provider = provider_for(server, client=client)
        for calling in (provider, provider.with_model("gpt-4o")):
            with pytest.raises(ModelError, match="closed") as chat_error:
                await calling.chat(request(operation=Operation.CHAT))
            with pytest.raises(ModelError, match="closed") as stream_error:
                await collect(calling, request())
            assert chat_error.value.code == stream_error.value.code == "provider_not_open"
    assert server.requests == []


async def test_with_model_never_owns_the_client() -> None:
    handler = queue_handler(*[Scripted.json(fixture_json("chat_text.json"))] * 2)
    async with open_fake_server(handler) as server:
        async with provider_for(server) as provider:
            other = provider.with_model("gpt-4o")
            async with other:  # entering and leaving the derived provider does not close the shared client
                await other.chat(ModelRequest(Operation.CHAT, "gpt-4o", HELLO))
            await provider.chat(request(operation=Operation.CHAT))
            service = ModelService(provider).with_model("gpt-4o")
            assert service.model == "gpt-4o"
        with pytest.raises(ModelError, match="async with"):  # the owner closed it on exit
            await other.chat(ModelRequest(Operation.CHAT, "gpt-4o", HELLO))


async def test_creating_a_stream_sends_nothing_until_it_is_iterated() -> None:
    """``stream()`` is a plain async generator: no task, no request until the first ``__anext__``."""
    async with (
        open_fake_server(queue_handler(Scripted.sse(awkward_pieces(fixture_sse("stream_text.sse"))))) as server,
        provider_for(server) as provider,
    ):
        stream: AsyncGenerator[StreamChunk, None] = provider.stream(request())
        await trio.testing.wait_all_tasks_blocked()
        assert server.requests == []
        async with aclosing(stream):
            assert [chunk async for chunk in stream][-1] == FinishChunk(FinishReason.STOP)


# -- real servers: lenient where the answer is complete, bounded where the server is hostile -------------

SPLITS = {
    "whole": lambda raw: [raw],
    "awkward": awkward_pieces,
    "every_byte": lambda raw: [raw[i : i + 1] for i in range(len(raw))],
}

# Fixtures of backends that differ from OpenAI, and whether the official SDK types accept them.
BACKEND_STREAMS = {
    "stream_cortex_no_finish_reason.sse": True,  # finish_reason left out: the SDK allows null
    "stream_openrouter_empty_finish_reason.sse": False,  # finish_reason "" is no known value
    "stream_mistral_list_content.sse": False,  # delta.content is a list of chunks, not a string
    "stream_gemini_empty_tool_call_id.sse": True,  # "" is a string
    "stream_unicode_separators.sse": True,
}
BACKEND_BODIES = {
    "chat_cortex_no_finish_reason.json": False,  # choices[0].finish_reason is required
    "chat_mistral_list_content.json": False,
    "chat_gemini_empty_tool_call_id.json": True,
}


def test_backend_fixtures_against_the_official_sdk_types() -> None:
    """Where the SDK accepts a backend's payload it validates; where it rejects it, that is the difference."""
    for name, accepted in BACKEND_STREAMS.items():
        payloads = sse_data(fixture_sse(name))
        assert payloads[-1] == "[DONE]", name
        results = []
        for data in payloads[:-1]:
            try:
                ChatCompletionChunk.model_validate(json.loads(data))
                results.append(True)
            except ValueError:
                results.append(False)
        assert all(results) is accepted, name
    for name, accepted in BACKEND_BODIES.items():
        try:
            ChatCompletion.model_validate(fixture_json(name))
            valid = True
        except ValueError:
            valid = False
        assert valid is accepted, name


@pytest.mark.parametrize("split", SPLITS)
async def test_a_stream_without_finish_reason_finishes_from_its_content(split: str) -> None:
    """Snowflake Cortex sends no finish_reason; OpenRouter (some hosts) an empty one, with tool calls."""
    handler = queue_handler(
        Scripted.sse(SPLITS[split](fixture_sse("stream_cortex_no_finish_reason.sse"))),
        Scripted.sse(SPLITS[split](fixture_sse("stream_openrouter_empty_finish_reason.sse"))),
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        text = await collect(provider, request())
        tools = await collect(provider, request())
    assert text == [
        TextDelta("Snow"),
        TextDelta("flake says "),
        TextDelta("hello."),
        UsageChunk(Usage(12, 5, 17)),
        FinishChunk(FinishReason.STOP),
    ]
    assert tools == [
        ToolCallStart(0, "call_8f2a1c", "get_weather"),
        ToolCallDelta(0, '{"city": "Oslo"}'),
        ToolCallEnd(0, "call_8f2a1c", "get_weather", '{"city": "Oslo"}'),
        UsageChunk(Usage(40, 9, 49)),
        FinishChunk(FinishReason.TOOL_CALLS),
    ]


async def test_a_completion_without_finish_reason_finishes_from_its_content() -> None:
    calls = completion(
        {"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, ""
    )
    handler = queue_handler(Scripted.json(fixture_json("chat_cortex_no_finish_reason.json")), Scripted.json(calls))
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        text = await provider.chat(request(operation=Operation.CHAT))
        tools = await provider.chat(request(operation=Operation.CHAT))
    assert (text.message.text, text.finish_reason, text.usage) == (
        "Snowflake says hello.",
        FinishReason.STOP,
        Usage(12, 5, 17),
    )
    assert tools.finish_reason is FinishReason.TOOL_CALLS


@pytest.mark.parametrize("split", SPLITS)
async def test_mistral_list_content_is_text_and_reasoning(split: str) -> None:
    handler = queue_handler(
        Scripted.json(fixture_json("chat_mistral_list_content.json")),
        Scripted.sse(SPLITS[split](fixture_sse("stream_mistral_list_content.sse"))),
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        response = await provider.chat(request(operation=Operation.CHAT))
        chunks = await collect(provider, request())
    assert response.message.parts == (ReasoningPart("A greeting; answer politely."), TextPart("Bonjour à vous !"))
    assert chunks == [
        ReasoningDelta("A greeting; "),
        ReasoningDelta("answer politely."),
        TextDelta("Bonjour"),
        TextDelta(" à vous !"),
        UsageChunk(Usage(8, 22, 30)),
        FinishChunk(FinishReason.STOP),
    ]


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "ok"}],
        [{"type": "thinking", "thinking": "plain"}, {"type": "text", "text": "ok"}],
    ],
    ids=["unknown_chunk_type_skipped", "thinking_as_a_string"],
)
async def test_list_content_variants(content: list[Any]) -> None:
    async with (
        open_fake_server(queue_handler(Scripted.json(completion({"content": content})))) as server,
        provider_for(server) as provider,
    ):
        response = await provider.chat(request(operation=Operation.CHAT))
    assert response.message.text == "ok"


@pytest.mark.parametrize(
    ("content", "named"),
    [(["text"], "choices[0].message.content[0] must be an object"), (7, "must be a string or a list")],
)
async def test_content_that_is_neither_text_nor_chunks_is_malformed(content: Any, named: str) -> None:
    async with (
        open_fake_server(queue_handler(Scripted.json(completion({"content": content})))) as server,
        provider_for(server) as provider,
    ):
        with pytest.raises(MalformedResponseError) as caught:
            await provider.chat(request(operation=Operation.CHAT))
    assert named in str(caught.value)


@pytest.mark.parametrize("split", SPLITS)
async def test_an_empty_tool_call_id_passes_through(split: str) -> None:
    """Gemini sends ``"id": ""``; unique ids are the message assembler's job, not a reason to refuse."""
    handler = queue_handler(
        Scripted.json(fixture_json("chat_gemini_empty_tool_call_id.json")),
        Scripted.sse(SPLITS[split](fixture_sse("stream_gemini_empty_tool_call_id.sse"))),
    )
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        response = await provider.chat(request(operation=Operation.CHAT))
        chunks = await collect(provider, request())
    assert response.message.tool_calls == (ToolCallPart("", "get_weather", '{"city":"Rome"}'),)
    assert chunks == [
        ToolCallStart(0, "", "get_weather"),
        ToolCallDelta(0, '{"city":"Rome"}'),
        ToolCallStart(1, "", "get_time"),
        ToolCallDelta(1, '{"zone":"Europe/Rome"}'),
        ToolCallEnd(0, "", "get_weather", '{"city":"Rome"}'),
        ToolCallEnd(1, "", "get_time", '{"zone":"Europe/Rome"}'),
        UsageChunk(Usage(51, 18, 69)),
        FinishChunk(FinishReason.TOOL_CALLS),
    ]


async def test_index_less_tool_calls_with_empty_ids_are_told_apart_by_name() -> None:
    def call(**fields: Any) -> dict[str, Any]:
        return {"type": "function", **fields}

    events = [
        chunk_event({"tool_calls": [call(id="", function={"name": "f", "arguments": '{"a"'})]}, valid=False),
        chunk_event({"tool_calls": [call(function={"arguments": ": 1}"})]}, valid=False),
        chunk_event({"tool_calls": [call(id="", function={"name": "g", "arguments": "{}"})]}, valid=False),
        chunk_event({}, "tool_calls"),
        DONE,
    ]
    async with open_fake_server(queue_handler(Scripted.sse(events))) as server, provider_for(server) as provider:
        chunks = await collect(provider, request())
    assert [chunk for chunk in chunks if isinstance(chunk, ToolCallEnd)] == [
        ToolCallEnd(0, "", "f", '{"a": 1}'),
        ToolCallEnd(1, "", "g", "{}"),
    ]


async def test_a_surrogate_pair_split_across_events_is_joined_and_the_conversation_goes_on() -> None:
    """``"\\ud83d"`` then ``"\\ude00"`` (a proxy slicing UTF-16): each half alone is a lone surrogate
    that no request can encode. The deltas published are valid text (a high half waits for its
    pair; one whose pair never comes is U+FFFD), and so is the reply, so the next request is sent."""
    high, low = "\ud83d", "\ude00"
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"s": "' + high}}
    events = [
        chunk_event({"reasoning_content": f"hmm {high}"}, valid=False),
        chunk_event({"reasoning_content": low}, valid=False),
        chunk_event({"content": f"smile {high}"}, valid=False),
        chunk_event({"content": f"{low} and {high}"}, valid=False),
        chunk_event({"tool_calls": [call]}, valid=False),
        chunk_event({"tool_calls": [{"index": 0, "function": {"arguments": low + '"}'}}]}, valid=False),
        chunk_event({}, "tool_calls"),
        DONE,
    ]
    handler = queue_handler(Scripted.sse(events), Scripted.json(fixture_json("chat_text.json")))
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        chunks = await collect(provider, request())
        assembler = ReplyAssembler()
        for chunk in chunks:
            assembler.feed(chunk)
        reply = assembler.finish()
        await provider.chat(request(*HELLO, reply.message, ToolResultMessage("c1", "ok"), operation=Operation.CHAT))
    assert chunks[:8] == [
        ReasoningDelta("hmm "),
        ReasoningDelta("\U0001f600"),
        TextDelta("smile "),
        TextDelta("\U0001f600 and "),
        ToolCallStart(0, "c1", "f"),
        ToolCallDelta(0, '{"s": "'),
        ToolCallDelta(0, '\U0001f600"}'),
        TextDelta("\ufffd"),  # the high half that ended the text never got its pair
    ]
    assert chunks[8] == ToolCallEnd(0, "c1", "f", '{"s": "\U0001f600"}')
    assert reply.message.text == "smile \U0001f600 and \ufffd"
    sent = server.requests[1].json()["messages"][1]
    assert sent["content"] == "smile \U0001f600 and \ufffd"
    assert sent["tool_calls"][0]["function"]["arguments"] == '{"s": "\U0001f600"}'


class WalkCountingCalls(dict[int, Any]):
    """The stream assembler's calls, counting every walk over all of them."""

    walks = 0

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()

    def values(self) -> Any:
        self.walks += 1
        return super().values()


def test_index_less_tool_call_deltas_never_walk_all_calls() -> None:
    """Each index-less delta used to rebuild an id -> index map of every call so far (and take the
    max index): quadratic in the number of calls. The map is kept as calls start; the calls are
    walked once, when they end."""
    from trio_agent._models._openai import _StreamAssembler

    def data(delta: dict[str, Any], finish: str | None = None) -> str:
        return chunk_event(delta, finish, valid=False).decode().removeprefix("data: ")

    assembler = _StreamAssembler()
    assembler.calls = calls = WalkCountingCalls()
    n = 200
    out: list[StreamChunk] = []
    for i in range(n):
        start = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
        out += assembler.feed("message", data({"tool_calls": [start]}))
        again = {"id": f"c{i}", "type": "function", "function": {"arguments": ": "}}  # a known id continues
        rest = {"type": "function", "function": {"arguments": f"{i}}}"}}  # no id: the last call continues
        out += assembler.feed("message", data({"tool_calls": [again, rest]}))
    assert calls.walks == 0
    out += assembler.feed("message", data({}, "tool_calls"))
    assert calls.walks == 1
    ends = [chunk for chunk in out if isinstance(chunk, ToolCallEnd)]
    assert ends == [ToolCallEnd(i, f"c{i}", "f", f'{{"a": {i}}}') for i in range(n)]


@pytest.mark.parametrize("split", SPLITS)
async def test_unicode_line_separators_in_output_are_text(split: str) -> None:
    """U+2028, U+2029 and U+0085 end no SSE line (httpx-sse < 0.4.2 split on them)."""
    pieces = SPLITS[split](fixture_sse("stream_unicode_separators.sse"))
    async with open_fake_server(queue_handler(Scripted.sse(pieces))) as server, provider_for(server) as provider:
        chunks = await collect(provider, request())
    assert chunks == [
        TextDelta("line\u2028sep"),
        TextDelta("para\u2029sep"),
        TextDelta("next\u0085line"),
        UsageChunk(Usage(9, 6, 15)),
        FinishChunk(FinishReason.STOP),
    ]


FOREVER = 3600.0  # a stream_idle_timeout nothing in these tests reaches unless the stream waits for it


@pytest.mark.parametrize(
    "ending",
    ["done", "usage_after_finish", "finish_with_usage"],
)
async def test_the_terminal_event_ends_the_stream_whatever_the_connection_does(
    ending: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The server never closes the body after the terminal event: the stream still ends at once
    (on this mock clock any wait, even for the idle timeout, would show as elapsed time)."""
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    never = trio.Event()
    events = {
        "done": [chunk_event({"content": "x"}), chunk_event({}, "stop"), DONE],
        "usage_after_finish": [
            chunk_event({"content": "x"}),
            chunk_event({}, "stop"),
            b"data: " + json.dumps(fixture_json("chunk_usage_only.json") | {"usage": usage}).encode() + b"\n\n",
        ],
        "finish_with_usage": [chunk_event({"content": "x"}), chunk_event({}, "stop", usage=usage)],
    }[ending]
    async with (
        open_fake_server(queue_handler(Scripted.sse([*events, Gate(never)]))) as server,
        provider_for(server, stream_idle_timeout=FOREVER) as provider,
    ):
        started = trio.current_time()
        chunks = await collect(provider, request())
        assert trio.current_time() == started
    assert chunks[0] == TextDelta("x") and chunks[-1] == FinishChunk(FinishReason.STOP)
    assert (UsageChunk(Usage(3, 1, 4)) in chunks) is (ending != "done")


async def test_a_usage_report_before_the_finish_reason_does_not_end_the_stream_at_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Some servers report usage in early chunks too: any usage seen before the finish_reason made
    the finish chunk end the stream, so the final report after it was never read and the early,
    partial one was published. Only a report in or after the finish_reason's event ends it."""

    def usage(completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": 10, "completion_tokens": completion_tokens, "total_tokens": 10 + completion_tokens}

    never = trio.Event()
    final = b"data: " + json.dumps(fixture_json("chunk_usage_only.json") | {"usage": usage(50)}).encode() + b"\n\n"
    events = [
        chunk_event({"content": "Hi"}, usage=usage(1)),
        chunk_event({"content": " there"}),
        chunk_event({}, "stop"),
        final,
        Gate(never),  # no [DONE], the connection held: the final report itself ends the stream
    ]
    async with (
        open_fake_server(queue_handler(Scripted.sse(events))) as server,
        provider_for(server, stream_idle_timeout=FOREVER) as provider,
    ):
        started = trio.current_time()
        chunks = await collect(provider, request())
        assert trio.current_time() == started
    assert chunks == [
        TextDelta("Hi"),
        TextDelta(" there"),
        UsageChunk(Usage(10, 50, 60)),
        FinishChunk(FinishReason.STOP),
    ]


async def test_after_a_finish_reason_without_usage_the_wait_for_the_rest_is_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    never = trio.Event()
    events = [chunk_event({"content": "x"}), chunk_event({}, "length"), Gate(never)]
    async with (
        open_fake_server(queue_handler(Scripted.sse(events))) as server,
        provider_for(server, stream_idle_timeout=FOREVER) as provider,
    ):
        started = trio.current_time()
        chunks = await collect(provider, request())
        assert trio.current_time() - started == 1.0  # _TRAILER_SECONDS, not the idle timeout
    assert chunks == [TextDelta("x"), FinishChunk(FinishReason.LENGTH)]


async def test_junk_after_the_finish_reason_keeps_the_complete_answer() -> None:
    # The answer was published with its finish; an unreadable event in the usage trailer then
    # failed the whole stream (a StreamInterruptedError for an answer that was complete).
    events = [chunk_event({"content": "x"}), chunk_event({}, "stop"), b"data: {not json\n\n", DONE]
    async with open_fake_server(queue_handler(Scripted.sse(events))) as server, provider_for(server) as provider:
        chunks = await collect(provider, request())
    assert chunks == [TextDelta("x"), FinishChunk(FinishReason.STOP)]


@pytest.mark.parametrize(
    "error_event", [b"event: error\ndata: \n\n", b'data: {"error": {"message": "late", "type": "server_error"}}\n\n']
)
async def test_an_error_event_after_the_finish_reason_keeps_the_complete_answer(error_event: bytes) -> None:
    """After the finish_reason only the usage report and [DONE] may come: an error event there
    failed a complete, published answer (a StreamInterruptedError through the service), while an
    unreadable event was ignored. It is ignored too; before the finish_reason it still fails."""
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    after = [chunk_event({"content": "x"}), chunk_event({}, "stop"), error_event, chunk_event({}, usage=usage), DONE]
    before = [chunk_event({"content": "x"}), error_event, chunk_event({}, "stop"), DONE]
    async with (
        open_fake_server(queue_handler(Scripted.sse(after), Scripted.sse(after), Scripted.sse(before))) as server,
        provider_for(server) as provider,
    ):
        chunks = await collect(provider, request())
        async with ModelService(provider).stream(list(HELLO)) as through_service:
            served = [chunk async for chunk in through_service]
        with pytest.raises(ProviderError):
            await collect(provider, request())
    assert chunks == served == [TextDelta("x"), FinishChunk(FinishReason.STOP)]


async def test_an_unterminated_line_over_max_response_bytes_is_refused_while_it_is_read() -> None:
    """16 MiB without a newline, with a 64 KiB bound: refused after about the bound, not buffered whole
    (the server then stalls forever: a provider that waited for the line's end would hang)."""
    limit = 64 * 1024
    piece = b"x" * 65536
    never = trio.Event()
    flood: list[bytes | Gate] = [b'data: {"id": "', *[piece] * 256, Gate(never)]
    async with (
        open_fake_server(queue_handler(Scripted.sse(flood))) as server,
        provider_for(server, max_response_bytes=limit, stream_idle_timeout=FOREVER) as provider,
    ):
        tracemalloc.start()
        try:
            with trio.fail_after(30):  # a hang guard, not synchronisation
                with pytest.raises(MalformedResponseError, match=f"larger than max_response_bytes={limit}") as caught:
                    await collect(provider, request())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert not caught.value.retryable
    assert peak < 16 * limit  # the bound plus a read or two, not the 16 MiB line


async def test_a_whole_stream_over_max_response_bytes_is_refused() -> None:
    """Each event small, the stream endless: only the per-event bound was checked, so a server that
    never finished its reply grew it (and the consumer's copy) without bound. As for Anthropic,
    max_response_bytes bounds the whole stream."""
    limit = 8192
    events = [chunk_event({"content": "x" * 50}) for _ in range(100)]  # about 25 KB, each event ~250 bytes
    async with (
        open_fake_server(queue_handler(Scripted.sse([*events, chunk_event({}, "stop"), DONE]))) as server,
        provider_for(server, max_response_bytes=limit) as provider,
    ):
        chunks: list[StreamChunk] = []
        with pytest.raises(MalformedResponseError, match=f"larger than max_response_bytes={limit} in total") as caught:
            await collect(provider, request(), chunks)
    assert not caught.value.retryable
    assert 0 < len(chunks) < 40 and not any(isinstance(chunk, FinishChunk) for chunk in chunks)


async def test_a_json_body_sent_as_an_event_stream_over_the_bound_is_refused() -> None:
    body = json.dumps({"error": {"message": "x" * 5000, "type": "server_error"}}).encode()
    scripted = Scripted(200, [("content-type", "text/event-stream")], [body[:100], body[100:]])
    async with (
        open_fake_server(queue_handler(scripted)) as server,
        provider_for(server, max_response_bytes=1000) as provider,
    ):
        with pytest.raises(MalformedResponseError, match="JSON body larger than max_response_bytes=1000") as caught:
            await collect(provider, request())
    assert not caught.value.retryable


@pytest.mark.parametrize(
    ("name", "error_type", "retryable"),
    [
        ("error_429.json", RateLimitError, True),
        ("error_500.json", ProviderServerError, True),
        ("error_401.json", AuthenticationError, False),
    ],
)
async def test_a_json_error_served_as_an_event_stream_is_the_servers_error(
    name: str, error_type: type[ProviderError], retryable: bool
) -> None:
    body = b"\n" + json.dumps(fixture_json(name), indent=2).encode()
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]
    scripted = Scripted(200, [("content-type", "text/event-stream; charset=utf-8")], pieces)
    async with open_fake_server(queue_handler(scripted)) as server, provider_for(server) as provider:
        with pytest.raises(ProviderError) as caught:
            await collect(provider, request())
    assert type(caught.value) is error_type and caught.value.retryable is retryable
    assert fixture_json(name)["error"]["message"][:20] in str(caught.value)


async def test_a_json_body_that_is_no_error_served_as_an_event_stream_is_malformed() -> None:
    scripted = Scripted(
        200, [("content-type", "text/event-stream")], [json.dumps(completion({"content": "x"})).encode()]
    )
    async with open_fake_server(queue_handler(scripted)) as server, provider_for(server) as provider:
        with pytest.raises(MalformedResponseError, match="got a JSON body") as caught:
            await collect(provider, request())
    assert not caught.value.retryable


# -- bounded clean-up --------------------------------------------------------------------------------

STUCK = 1000.0  # how long the stuck response's close would take, unbounded


class StuckCloseTransport(httpx.AsyncBaseTransport):
    """Serves *pieces* as a response whose close takes STUCK seconds (a peer that never lets go)."""

    def __init__(self, content_type: str, pieces: Sequence[bytes]) -> None:
        self.content_type = content_type
        self.pieces = pieces
        self.closes_finished = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": self.content_type}, stream=_StuckBody(self))


class _StuckBody(httpx.AsyncByteStream):
    def __init__(self, transport: StuckCloseTransport) -> None:
        self.transport = transport

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.transport.pieces:
            yield piece

    async def aclose(self) -> None:
        await trio.sleep(STUCK)
        self.transport.closes_finished += 1


def overruns(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if "overran" in record.getMessage()]


@pytest.mark.parametrize("operation", [Operation.STREAM, Operation.CHAT])
async def test_a_response_whose_close_hangs_is_abandoned_after_cleanup_grace(
    operation: Operation, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream left early, or a chat body refused half-read: the response is closed under a shield
    bounded by cleanup_grace (unbounded, this test would take STUCK seconds)."""
    caplog.set_level(logging.WARNING, logger="trio_agent")
    if operation is Operation.STREAM:
        transport = StuckCloseTransport("text/event-stream", sse_events(fixture_sse("stream_text.sse")))
    else:
        body = json.dumps(fixture_json("chat_text.json")).encode()
        transport = StuckCloseTransport("application/json", [body[:100], body[100:]])
    async with httpx.AsyncClient(transport=transport) as client:
        limit = 150 if operation is Operation.CHAT else 2**20
        provider = OpenAIProvider(
            MODEL, api_key="k", base_url="http://stuck/v1", client=client, cleanup_grace=2, max_response_bytes=limit
        )
        started = trio.current_time()
        if operation is Operation.STREAM:
            stream = provider.stream(request())
            assert await anext(stream) == TextDelta("Héllo")
            await stream.aclose()  # the consumer leaves early: the response must be closed
        else:
            with pytest.raises(MalformedResponseError, match="max_response_bytes=150"):
                await provider.chat(request(operation=Operation.CHAT))
        assert trio.current_time() - started == 2.0
    assert transport.closes_finished == 0
    [message] = overruns(caplog)
    assert "openai response close" in message and "2 s" in message


async def test_cleanup_grace_is_validated_carried_by_with_model_and_accepted_by_create_provider() -> None:
    assert OpenAIProvider(MODEL, api_key="k").cleanup_grace == DEFAULT_CLEANUP_GRACE
    provider = OpenAIProvider(MODEL, api_key="k", cleanup_grace=0.5)
    assert provider.with_model("gpt-4o").cleanup_grace == 0.5
    made = create_provider("openai", MODEL, api_key="k", cleanup_grace=3)
    assert isinstance(made, OpenAIProvider) and made.cleanup_grace == 3.0
    for bad in (0, -1, float("nan"), "1", True):
        with pytest.raises(ConfigError, match="cleanup_grace"):
            OpenAIProvider(MODEL, api_key="k", cleanup_grace=bad)  # type: ignore[arg-type]


async def test_lone_surrogates_in_the_history_are_sent_as_replacement_characters() -> None:
    # Text a tool returned or a user sent (a file read with surrogateescape, say) made every later
    # request of the conversation fail to encode: one bad string failed the session for good.
    call = ToolCallPart("c1", "f", "{}")
    history = (
        UserMessage("a \udc80 b"),
        AssistantMessage((call,)),
        ToolResultMessage("c1", "half \ud83d pair \ud83d\ude00"),
    )
    handler = queue_handler(Scripted.json(fixture_json("chat_text.json")))
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        await provider.chat(request(*history, operation=Operation.CHAT))
    sent = server.requests[0].json()["messages"]
    assert sent[0]["content"] == "a \ufffd b"
    assert sent[2]["content"] == "half \ufffd pair \U0001f600"


# -- call ids that are not well-formed Unicode --------------------------------------------------------


def text_stream(text: str) -> Scripted:
    return Scripted.sse([chunk_event({"role": "assistant", "content": text}), chunk_event({}, "stop"), DONE])


@define_tool(
    name="delete",
    description="deletes",
    input_schema={"type": "object"},
    side_effect=SideEffect.PURE,
    kind=ToolKind.READONLY,
)
async def delete(input: dict[str, Any], ctx: Any) -> str:
    return f"{input['what']} deleted"


async def test_a_history_whose_call_ids_differ_only_in_lone_surrogates_is_refused_before_sending() -> None:
    """Both ids reached the server as ``"c\ufffd"`` (the body mends every lone surrogate), with
    two results: which call failed could no longer be told."""
    history = [
        UserMessage("hi"),
        AssistantMessage((ToolCallPart("c\ud800", "delete", '{"what": "A"}'), ToolCallPart("c\udc00", "delete", "{}"))),
        ToolResultMessage("c\ud800", "A deleted"),
        ToolResultMessage("c\udc00", "B FAILED", is_error=True),
        UserMessage("which one failed?"),
    ]
    async with open_fake_server(queue_handler(text_stream("ok"))) as server, provider_for(server) as provider:
        with pytest.raises(HistoryError, match=r"parts\[0\]\.id 'c\\ud800' is not well-formed Unicode"):
            await chat(provider, history)
    assert server.requests == []


async def test_streamed_call_ids_that_differ_only_in_lone_surrogates_stay_apart_on_the_wire() -> None:
    """The live path: the reply assembler mends each id, and the second ``"c\ufffd"`` is a repeat it
    renames, so each result still answers its own call in the next request."""
    calls = [
        {"index": 0, "id": "c\ud800", "type": "function", "function": {"name": "delete", "arguments": '{"what": "A"}'}},
        {"index": 1, "id": "c\udc00", "type": "function", "function": {"name": "delete", "arguments": '{"what": "B"}'}},
    ]
    first = Scripted.sse([chunk_event({"tool_calls": calls}, valid=False), chunk_event({}, "tool_calls"), DONE])
    handler = queue_handler(first, text_stream("done"))
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        result = await chat(provider, "delete A and B", tools=[delete])
    assert result.text == "done"
    sent = server.requests[1].json()["messages"]
    ids = [call["id"] for call in sent[1]["tool_calls"]]
    assert ids == ["c\ufffd", "c\ufffd~2"]
    assert [(m["tool_call_id"], m["content"]) for m in sent[2:]] == [(ids[0], "A deleted"), (ids[1], "B deleted")]
    assert [m.tool_call_id for m in result.messages if isinstance(m, ToolResultMessage)] == ids


# -- bounds the service holds a provider to ---------------------------------------------------------


async def test_a_streamed_usage_whose_sum_passes_the_bound_is_malformed_not_a_provider_failure() -> None:
    """The provider summed two counts in range past MAX_TOKEN_COUNT and published the UsageChunk,
    which ModelService refused as ``provider_failed``: a bug of ours, after the text was out."""
    usage = {"prompt_tokens": 2**53 - 1, "completion_tokens": 7}
    # No total_tokens (compatible servers leave it out), so not the SDK's shape.
    events = [chunk_event({"content": "the answer"}, "stop", valid=False, usage=usage), DONE]
    async with open_fake_server(queue_handler(Scripted.sse(events))) as server, provider_for(server) as provider:
        with pytest.raises(MalformedResponseError, match=r"usage.prompt_tokens \+ usage.completion_tokens") as caught:
            async with ModelService(provider, retry=RetryPolicy(max_attempts=1)).stream(HELLO) as chunks:
                async for _ in chunks:
                    pass
    assert caught.value.code != "provider_failed"


@pytest.mark.parametrize(
    "calls",
    [
        [{"index": 10**30, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        # A reused index with a new id moves the call to the next free index: past the bound here.
        [
            {"index": 2**53 - 1, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"index": 2**53 - 1, "id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ],
    ],
    ids=["huge", "next-past-the-bound"],
)
async def test_a_tool_call_index_past_the_bound_is_malformed_not_a_provider_failure(calls: list[Any]) -> None:
    events = [chunk_event({"tool_calls": calls}, valid=False), chunk_event({}, "tool_calls"), DONE]
    async with open_fake_server(queue_handler(Scripted.sse(events))) as server, provider_for(server) as provider:
        with pytest.raises(MalformedResponseError, match=r"9007199254740991") as caught:
            async with ModelService(provider, retry=RetryPolicy(max_attempts=1)).stream(HELLO) as chunks:
                async for _ in chunks:
                    pass
    assert caught.value.code != "provider_failed"


async def test_a_tool_call_at_the_largest_index_streams() -> None:
    call = {"index": 2**53 - 1, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events = [chunk_event({"tool_calls": [call]}, valid=False), chunk_event({}, "tool_calls"), DONE]
    async with (
        open_fake_server(queue_handler(Scripted.sse(events))) as server,
        provider_for(server) as provider,
        ModelService(provider).stream(HELLO) as chunks,
    ):
        received = [chunk async for chunk in chunks]
    assert received[0] == ToolCallStart(2**53 - 1, "a", "f")


# -- structured output (chat(output_schema=...)) ----------------------------------------------------

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


async def test_chat_with_an_output_schema_sends_it_as_response_format_not_as_an_unknown_field() -> None:
    """``output_schema`` went into the body as a top-level field, which OpenAI refuses (HTTP 400
    for an unknown parameter): structured output through this provider always failed."""
    answer = Scripted.json(completion({"content": '{"x": 3}'}))
    async with open_fake_server(queue_handler(text_stream("thinking"), answer)) as server, provider_for(server) as p:
        result = await chat(p, "where?", output_schema=POINT)
    assert result.structured_output == {"x": 3}
    body = server.requests[1].json()
    assert "output_schema" not in body
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "structured_output", "schema": POINT, "strict": False},
    }
    assert json.dumps(POINT) in body["messages"][-1]["content"]  # the prompt still says it too
    assert "response_format" not in server.requests[0].json()  # the run's own turns: none


async def test_an_output_schema_whose_root_is_no_object_is_left_to_the_prompt() -> None:
    """Structured Outputs take an object at the root only: another root is asked for in the prompt."""
    answer = Scripted.json(completion({"content": "[1, 2]"}))
    async with open_fake_server(queue_handler(text_stream("ok"), answer)) as server, provider_for(server) as p:
        result = await chat(p, "list?", output_schema={"type": "array", "items": {"type": "integer"}})
    assert result.structured_output == [1, 2]
    body = server.requests[1].json()
    assert "output_schema" not in body and "response_format" not in body


async def test_a_response_format_option_given_with_an_output_schema_is_kept() -> None:
    handler = queue_handler(*[Scripted.json(completion({"content": "{}"}))] * 2)
    async with open_fake_server(handler) as server, provider_for(server) as provider:
        given = {"type": "json_object"}
        await provider.chat(
            request(options={"output_schema": POINT, "response_format": given}, operation=Operation.CHAT)
        )
        extra = {"output_schema": POINT, "extra_body": {"response_format": given}}  # extra_body is merged last
        await provider.chat(request(options=extra, operation=Operation.CHAT))
    for seen in server.requests:
        assert seen.json()["response_format"] == given and "output_schema" not in seen.json()


@pytest.mark.parametrize("schema", [True, "object", ["object"]], ids=["bool", "str", "list"])
async def test_an_output_schema_option_that_is_no_mapping_is_refused_before_sending(schema: object) -> None:
    async with open_fake_server(queue_handler()) as server, provider_for(server) as provider:
        with pytest.raises(ModelError, match="request option 'output_schema' must be a JSON Schema object") as caught:
            await provider.chat(request(options={"output_schema": schema}, operation=Operation.CHAT))
    assert caught.value.code == "provider_bad_option"
    assert server.requests == []
