"""The Anthropic Messages provider, run for real over HTTP against the local fake server.

Fixtures in ``tests/fixtures/anthropic`` are in the exact wire format and are validated
against the official SDK's types, so they cannot drift from the API.
"""

from __future__ import annotations

import email.utils
import json
import logging
import re
import socket
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pydantic
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tests.fake_server import (
    FakeServer,
    Gate,
    Scripted,
    encoded,
    gzip_bomb,
    open_fake_server,
    queue_handler,
    retry_after_responses,
)
from trio_agent import (
    AuthenticationError,
    ConfigError,
    ModelError,
    ModelTimeoutError,
    Provider,
    ProviderError,
    RateLimitError,
    chat,
)
from trio_agent._cleanup import DEFAULT_CLEANUP_GRACE
from trio_agent._models._anthropic import AnthropicProvider, retry_after_seconds
from trio_agent._models._assemble import ReplyAssembler
from trio_agent._models._providers import create_provider
from trio_agent._models._service import ModelRequest
from trio_agent.models import (
    AssistantMessage,
    FinishChunk,
    FinishReason,
    MalformedResponseError,
    Message,
    ModelConnectionError,
    ModelNotFoundError,
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

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "anthropic"
JSON = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(FIXTURES.glob("*.json"))}
SSE = {path.stem: path.read_bytes() for path in sorted(FIXTURES.glob("*.sse"))}

MODEL = "claude-sonnet-4-5-20250929"
KEY = "sk-ant-test-key"
SIGNATURE = JSON["tool_use_thinking"]["content"][0]["signature"]
STREAM_TEXT = "Hello! Grüße aus Zürich 🌍 — how can I help?"


def sse_events(name: str) -> list[bytes]:
    """The fixture's events, one ``event:/data:`` block (with its blank line) each."""
    return [block + b"\n\n" for block in SSE[name].split(b"\n\n") if block.strip()]


def parse_sse(raw: bytes) -> list[tuple[str, Any]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            # split("\n"), not splitlines(): U+2028, U+2029 and U+0085 in the data end no line
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def event(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


def request(
    messages: Sequence[Message] = (UserMessage("Hi"),),
    *,
    tools: Sequence[ToolSpec] = (),
    options: dict[str, Any] | None = None,
    operation: Operation = Operation.CHAT,
) -> ModelRequest:
    return ModelRequest(operation, MODEL, tuple(messages), tuple(tools), options or {})


@asynccontextmanager
async def serve(*responses: Scripted, **settings: Any) -> AsyncIterator[tuple[FakeServer, AnthropicProvider]]:
    async with (
        open_fake_server(queue_handler(*responses)) as server,
        AnthropicProvider(MODEL, api_key=KEY, base_url=server.url, **settings) as provider,
    ):
        yield server, provider


async def collect(provider: AnthropicProvider, req: ModelRequest) -> list[StreamChunk]:
    chunks: list[StreamChunk] = []
    stream = provider.stream(req)
    try:
        async for chunk in stream:
            chunks.append(chunk)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return chunks


def text_of(chunks: Sequence[StreamChunk]) -> str:
    return "".join(chunk.text for chunk in chunks if isinstance(chunk, TextDelta))


# -- fixtures match the official SDK ----------------------------------------------------------------


def test_fixtures_match_the_official_sdk_types() -> None:
    responses = [name for name in JSON if not name.startswith("error_")]
    errors = [name for name in JSON if name.startswith("error_")]
    assert len(responses) >= 5 and len(errors) == 4 and len(SSE) >= 4
    for name in responses:
        anthropic.types.Message.model_validate(JSON[name])
    for name in errors:
        anthropic.types.ErrorResponse.model_validate(JSON[name])
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    seen = set()
    for name, raw in SSE.items():
        events = parse_sse(raw)
        assert events[0][0] == "message_start", name
        for event_name, payload in events:
            seen.add(event_name)
            assert payload["type"] == event_name, name
            if event_name == "ping":
                assert payload == {"type": "ping"}
            elif event_name == "error":
                anthropic.types.ErrorResponse.model_validate(payload)
            else:
                adapter.validate_python(payload)
    assert seen >= {"message_start", "content_block_start", "content_block_delta", "content_block_stop"}
    assert seen >= {"message_delta", "message_stop", "ping", "error"}
    # The check has teeth: a malformed event is refused.
    with pytest.raises(pydantic.ValidationError):
        adapter.validate_python({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}})


# -- non-streaming ------------------------------------------------------------------------------------


async def test_chat_text_reply_sends_the_wire_format() -> None:
    async with serve(Scripted.json(JSON["text_reply"]), extra_headers={"anthropic-beta": "test-beta"}) as (
        server,
        provider,
    ):
        assert isinstance(provider, Provider)
        response = await provider.chat(request([SystemMessage("Be brief."), UserMessage("Hi")]))
    assert response.message == AssistantMessage((TextPart("Hello! How can I help you today? 🌍"),))
    assert response.finish_reason is FinishReason.STOP
    assert response.usage == Usage(21, 12, 33, cached_input_tokens=8, cache_creation_input_tokens=5)
    assert (response.model, response.id) == (MODEL, "msg_01XFDUDYJgAACzvnptvVoYEL")
    [sent] = server.requests
    assert (sent.method, sent.path) == ("POST", "/v1/messages")
    assert sent.headers["x-api-key"] == KEY
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["anthropic-beta"] == "test-beta"
    assert sent.json() == {
        "model": MODEL,
        "max_tokens": 4096,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }


async def test_chat_thinking_then_tool_use() -> None:
    async with serve(Scripted.json(JSON["tool_use_thinking"])) as (_, provider):
        response = await provider.chat(request())
    assert response.message.parts == (
        ReasoningPart("The user wants the weather in Paris. I should call get_weather.", SIGNATURE),
        TextPart("I'll check the current weather in Paris."),
        ToolCallPart(
            "toolu_01A09q90qw90lq917835lq9", "get_weather", '{"location": "Paris, France", "unit": "celsius"}'
        ),
    )
    assert response.finish_reason is FinishReason.TOOL_CALLS
    assert response.usage.reasoning_tokens == 40
    assert response.usage.total_tokens == 472 + 91


async def test_signed_thinking_round_trips_unchanged_with_tool_results() -> None:
    fixture = JSON["tool_use_thinking"]
    async with serve(Scripted.json(fixture), Scripted.json(JSON["text_reply"])) as (server, provider):
        first = await provider.chat(request([SystemMessage("Use tools."), UserMessage("Weather in Paris?")]))
        follow_up: list[Message] = [
            SystemMessage("Use tools."),
            UserMessage("Weather in Paris?"),
            first.message,
            ToolResultMessage("toolu_01A09q90qw90lq917835lq9", "18°C, sunny"),
        ]
        await provider.chat(request(follow_up))
    body = server.requests[1].json()
    assert body["system"] == "Use tools."
    assistant, results = body["messages"][1], body["messages"][2]
    # The assistant turn goes back exactly as the server produced it, signature included.
    assert assistant == {"role": "assistant", "content": fixture["content"]}
    assert assistant["content"][0] == {
        "type": "thinking",
        "thinking": fixture["content"][0]["thinking"],
        "signature": SIGNATURE,
    }
    assert results == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                "content": "18°C, sunny",
                "is_error": False,
            }
        ],
    }


async def test_redacted_thinking_round_trips_unchanged() -> None:
    fixture = JSON["redacted_thinking"]
    async with serve(Scripted.json(fixture), Scripted.json(JSON["text_reply"])) as (server, provider):
        first = await provider.chat(request())
        assert first.message.parts[0] == ReasoningPart("", redacted_data=fixture["content"][0]["data"])
        assert first.message.parts[1] == ReasoningPart("Continuing from the redacted part.", SIGNATURE)
        await provider.chat(request([UserMessage("Hi"), first.message, UserMessage("And?")]))
    assert server.requests[1].json()["messages"][1] == {"role": "assistant", "content": fixture["content"]}


async def test_request_mapping_of_messages_tools_and_options() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    messages: list[Message] = [
        SystemMessage("You are terse."),
        UserMessage("Weather and time?"),
        AssistantMessage(
            (
                ReasoningPart("unsigned reasoning from another provider"),
                TextPart(""),
                TextPart("Checking."),
                ToolCallPart("t1", "get_weather", '{"city": "Paris"}'),
                ToolCallPart("t2", "get_time", "{not json"),
            )
        ),
        ToolResultMessage("t1", "18°C"),
        ToolResultMessage("t2", "arguments were not valid JSON", is_error=True),
        UserMessage("Thanks"),
        SystemMessage("Answer in French."),
    ]
    tools = [ToolSpec("get_weather", "Weather for a city", schema), ToolSpec("get_time", "", {"type": "object"})]
    options = {
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 1000,
        "thinking": 2048,
        "stop": "END",
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "conversation_id": "not an Anthropic option",
        "extra_body": {"metadata": {"user_id": "u-1"}},
    }
    async with serve(Scripted.json(JSON["text_reply"])) as (server, provider):
        await provider.chat(request(messages, tools=tools, options=options))
    assert server.requests[0].json() == {
        "model": MODEL,
        "max_tokens": 1000,
        "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in French."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather and time?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "get_time", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "18°C", "is_error": False},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": "arguments were not valid JSON",
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        "tools": [
            {"name": "get_weather", "description": "Weather for a city", "input_schema": schema},
            {"name": "get_time", "input_schema": {"type": "object"}},
        ],
        "temperature": 0.2,
        "top_p": 0.9,
        "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u-1"},
    }


async def test_blank_texts_and_empty_error_results_never_poison_the_conversation() -> None:
    """Anthropic refuses (400) an empty or whitespace-only text block and an error tool_result
    without content: such a message in the history failed every later request of the session."""
    history: list[Message] = [
        SystemMessage(" \n"),
        UserMessage(" "),
        AssistantMessage((TextPart("\n\n"),)),  # only blank text: the turn is dropped, the user turns merge
        UserMessage("list files"),
        AssistantMessage((TextPart("\n\n"), ToolCallPart("toolu_1", "ls", "{}"), ToolCallPart("toolu_2", "cat", "{}"))),
        ToolResultMessage("toolu_1", "", is_error=True),  # a tool that failed without a message
        ToolResultMessage("toolu_2", " \t"),
        UserMessage("\t"),
        AssistantMessage((TextPart("Done."),)),
        UserMessage(""),  # the last turn blank: kept, or the request would end on the assistant
    ]
    async with serve(Scripted.json(JSON["text_reply"])) as (server, provider):
        await provider.chat(request(history))
    sent = server.requests[0].json()
    assert "system" not in sent
    assert sent["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "list files"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}},
                {"type": "tool_use", "id": "toolu_2", "name": "cat", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "(no content)", "is_error": True},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "", "is_error": False},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": [{"type": "text", "text": "(no content)"}]},
    ]


@pytest.mark.parametrize(
    "arguments",
    [
        '{"n": 1e999}',  # valid JSON whose number is beyond a float: parsed to inf
        '{"n": NaN}',
        '{"n": -Infinity}',
        '{"a": ' + "[" * 3000 + "]" * 3000 + "}",  # deeper than the json module can recurse
        '{"a": ' + "[" * 65 + "]" * 65 + "}",  # deeper than any tool accepts
    ],
)
async def test_tool_arguments_a_tool_would_refuse_never_poison_the_conversation(arguments: str) -> None:
    """The arguments were refused to the tool; the conversation goes on, the call sent with ``{}``."""
    history: list[Message] = [
        UserMessage("compute"),
        AssistantMessage((ToolCallPart("t1", "calc", arguments),)),
        ToolResultMessage("t1", "the arguments are not valid", is_error=True),
        UserMessage("again"),
    ]
    async with serve(Scripted.json(JSON["text_reply"]), Scripted.sse(sse_events("stream_text"))) as (server, provider):
        await provider.chat(request(history))
        await collect(provider, request(history, operation=Operation.STREAM))
    for recorded in server.requests:
        assert recorded.json()["messages"][1]["content"] == [
            {"type": "tool_use", "id": "t1", "name": "calc", "input": {}}
        ]


async def test_thinking_config_dict_and_provider_max_tokens() -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    async with serve(Scripted.json(JSON["text_reply"]), max_tokens=2048) as (server, provider):
        await provider.chat(request(options={"thinking": thinking, "stop_sequences": ["A", "B"], "top_k": 5}))
    body = server.requests[0].json()
    assert (body["max_tokens"], body["thinking"], body["stop_sequences"], body["top_k"]) == (
        2048,
        thinking,
        ["A", "B"],
        5,
    )


@pytest.mark.parametrize(
    ("stop_reason", "expected"),
    [
        ("end_turn", FinishReason.STOP),
        ("stop_sequence", FinishReason.STOP),
        ("max_tokens", FinishReason.LENGTH),
        ("model_context_window_exceeded", FinishReason.LENGTH),
        ("tool_use", FinishReason.TOOL_CALLS),
        ("pause_turn", FinishReason.PAUSE_TURN),
        ("refusal", FinishReason.REFUSAL),
    ],
)
async def test_stop_reason_mapping(stop_reason: str, expected: FinishReason) -> None:
    payload = {**JSON["text_reply"], "stop_reason": stop_reason}
    anthropic.types.Message.model_validate(payload)
    async with serve(Scripted.json(payload)) as (_, provider):
        assert (await provider.chat(request())).finish_reason is expected


async def test_pause_turn_and_refusal_fixtures() -> None:
    async with serve(Scripted.json(JSON["pause_turn"]), Scripted.json(JSON["refusal"])) as (_, provider):
        paused = await provider.chat(request())
        refused = await provider.chat(request())
    assert paused.finish_reason is FinishReason.PAUSE_TURN
    assert paused.message.parts == (TextPart("Let me search for that."),)  # the server-tool block is skipped
    assert refused.finish_reason is FinishReason.REFUSAL
    assert refused.message.text == "I can't help with that."


@pytest.mark.parametrize("stop_reason", ["banana", None])
async def test_unknown_stop_reason_is_malformed(stop_reason: str | None) -> None:
    async with serve(Scripted.json({**JSON["text_reply"], "stop_reason": stop_reason})) as (_, provider):
        with pytest.raises(MalformedResponseError, match="stop_reason"):
            await provider.chat(request())


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"type": "error"}',
        b'{"type": "message", "content": [{"type": "text"}], "stop_reason": "end_turn"}',
    ],
)
async def test_unparseable_chat_responses_are_malformed(body: bytes) -> None:
    scripted = Scripted(200, [("content-type", "application/json")], [body], chunked=False)
    async with serve(scripted) as (_, provider):
        with pytest.raises(MalformedResponseError):
            await provider.chat(request())


# -- HTTP errors --------------------------------------------------------------------------------------

ErrorCase = tuple[int, Any, tuple[tuple[str, str], ...], type[ProviderError], bool, str]
ERROR_CASES: list[ErrorCase] = [
    (401, JSON["error_401"], (), AuthenticationError, False, "invalid x-api-key"),
    (
        403,
        {"type": "error", "error": {"type": "permission_error", "message": "no access"}},
        (),
        AuthenticationError,
        False,
        "no access",
    ),
    (404, JSON["error_404"], (), ModelNotFoundError, False, "claude-nonexistent-1"),
    (429, JSON["error_429"], (("retry-after", "7"),), RateLimitError, True, "rate limit"),
    (529, JSON["error_529"], (), ProviderServerError, True, "Overloaded"),
    (
        500,
        {"type": "error", "error": {"type": "api_error", "message": "Internal error"}},
        (),
        ProviderServerError,
        True,
        "Internal",
    ),
    (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: bad"}},
        (),
        ProviderError,
        False,
        "max_tokens",
    ),
]


@pytest.mark.parametrize("streaming", [False, True], ids=["chat", "stream"])
@pytest.mark.parametrize(
    ("status", "body", "headers", "error_type", "retryable", "text"),
    ERROR_CASES,
    ids=[str(case[0]) for case in ERROR_CASES],
)
async def test_http_status_mapping(
    streaming: bool,
    status: int,
    body: Any,
    headers: tuple[tuple[str, str], ...],
    error_type: type[ProviderError],
    retryable: bool,
    text: str,
) -> None:
    scripted = Scripted.json(body, status=status, headers=[*headers, ("request-id", "req_42")])
    async with serve(scripted) as (_, provider):
        with pytest.raises(ProviderError) as caught:
            if streaming:
                await collect(provider, request())
            else:
                await provider.chat(request())
    error = caught.value
    assert type(error) is error_type
    assert (error.status, error.retryable) == (status, retryable)
    assert text in str(error) and "req_42" in str(error)
    if status == 429:
        assert isinstance(error, RateLimitError) and error.retry_after == 7.0


@pytest.mark.parametrize("streaming", [False, True], ids=["chat", "stream"])
async def test_an_error_body_that_cannot_be_read_leaves_the_status_to_decide(streaming: bool) -> None:
    """A body cut mid-way (or in an encoding the provider refuses) was a retryable connection error:
    a 401 retried, a 429 without its retry-after. The status alone types the error."""
    start = [b'{"type": "error", "error": {"type": "authentication_error", "mess']
    responses = (
        Scripted(401, [("content-type", "application/json")], start, cut=True),
        Scripted(429, [("content-type", "application/json"), ("retry-after", "7")], start, cut=True),
        Scripted(429, [("content-encoding", "zstd"), ("retry-after", "7")], [b"\x28\xb5\x2f\xfd"]),
    )
    async with serve(*responses) as (_, provider):
        for error_type in (AuthenticationError, RateLimitError, RateLimitError):
            with pytest.raises(ProviderError) as caught:
                if streaming:
                    await collect(provider, request(operation=Operation.STREAM))
                else:
                    await provider.chat(request())
            assert type(caught.value) is error_type
            assert caught.value.status in (401, 429)
            assert caught.value.retryable is (error_type is RateLimitError)
            if error_type is RateLimitError:
                assert isinstance(caught.value, RateLimitError) and caught.value.retry_after == 7.0


async def test_non_json_error_body_is_quoted() -> None:
    scripted = Scripted(502, [("content-type", "text/html")], [b"<html>bad gateway</html>"], chunked=False)
    async with serve(scripted) as (_, provider):
        with pytest.raises(ProviderServerError, match="bad gateway") as caught:
            await provider.chat(request())
    assert caught.value.status == 502


def test_retry_after_forms() -> None:
    assert retry_after_seconds(httpx.Headers({"retry-after": "2.5"})) == 2.5
    assert retry_after_seconds(httpx.Headers({"retry-after-ms": "1500", "retry-after": "9"})) == 1.5
    assert retry_after_seconds(httpx.Headers({"retry-after": "soon"})) is None
    assert retry_after_seconds(httpx.Headers({})) is None
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    seconds = retry_after_seconds(httpx.Headers({"retry-after": date}))
    assert seconds is not None and 25 <= seconds <= 31
    past = email.utils.formatdate(time.time() - 30, usegmt=True)
    assert retry_after_seconds(httpx.Headers({"retry-after": past})) == 0.0


@pytest.mark.parametrize(
    "value",
    ["1_0", "1e3", "+5", "-5", "nan", "inf", "0x10", ".5", "1.", "1 0", "5\n", "\u00a05", "\u0661", "9" * 400],
)
def test_retry_after_numbers_are_ascii_digits_only(value: str) -> None:
    """``float()`` read the wait hint: ``1_0`` was 10 seconds, ``1e3`` 1000, ``+5`` 5, an Arabic-Indic
    digit 1. RFC 9110's delay-seconds is ASCII digits (a decimal fraction allowed): anything else is
    no hint, like an unreadable date; a ``retry-after-ms`` so malformed gives way to ``retry-after``."""
    raw = value.encode()
    assert retry_after_seconds(httpx.Headers([(b"retry-after", raw)])) is None
    assert retry_after_seconds(httpx.Headers([(b"retry-after-ms", raw)])) is None
    assert retry_after_seconds(httpx.Headers([(b"retry-after-ms", raw), (b"retry-after", b"3")])) == 3.0


def test_retry_after_numbers_that_are_delay_seconds() -> None:
    for value, seconds in (("0", 0.0), ("007", 7.0), ("1.5", 1.5), (" 5\t", 5.0)):  # OWS is no part of a value
        assert retry_after_seconds(httpx.Headers([(b"retry-after", value.encode())])) == seconds
        assert retry_after_seconds(httpx.Headers([(b"retry-after-ms", value.encode())])) == seconds / 1000


@pytest.mark.parametrize("streaming", [False, True], ids=["chat", "stream"])
@pytest.mark.parametrize(
    ("status", "body", "error_type"),
    [
        (529, JSON["error_529"], ProviderServerError),
        (503, {"type": "error", "error": {"type": "api_error", "message": "unavailable"}}, ProviderServerError),
        (500, {"type": "error", "error": {"type": "api_error", "message": "Internal error"}}, ProviderServerError),
        (408, {"type": "error", "error": {"type": "timeout_error", "message": "slow"}}, ProviderError),
        (409, {"type": "error", "error": {"type": "conflict", "message": "again"}}, ProviderError),
    ],
    ids=["529", "503", "500", "408", "409"],
)
async def test_every_retryable_status_carries_the_servers_retry_after(
    streaming: bool, status: int, body: Any, error_type: type[ProviderError]
) -> None:
    """A 529 (overloaded) or 503 with ``retry-after`` (or any 5xx, 408, 409) lost it: only a 429
    kept the server's wait hint, so the retry loop came back sooner than the server asked."""
    responses, expected = retry_after_responses(status, body, b'{"type": "err')
    async with serve(*responses) as (_, provider):
        for wanted in expected:
            with pytest.raises(ProviderError) as caught:
                if streaming:
                    await collect(provider, request(operation=Operation.STREAM))
                else:
                    await provider.chat(request())
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
    body = {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}
    async with serve(Scripted.json(body, status=status, headers=[("retry-after", "7")])) as (_, provider):
        with pytest.raises(ProviderError) as caught:
            await provider.chat(request())
    assert type(caught.value) is error_type
    assert (caught.value.status, caught.value.retryable, caught.value.retry_after) == (status, False, None)


# -- streaming ----------------------------------------------------------------------------------------


def _every(size: int) -> Callable[[bytes], list[bytes]]:
    return lambda data: [data[i : i + size] for i in range(0, len(data), size)]


def _inside_utf8(data: bytes) -> list[bytes]:
    cuts = sorted({data.index("🌍".encode()) + k for k in (1, 2, 3)} | {data.index("ü".encode()) + 1})
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def _crlf_split_between_cr_and_lf(data: bytes) -> list[bytes]:
    data = data.replace(b"\n", b"\r\n")
    return [piece + b"\r" for piece in data.split(b"\r")[:-1]] + [data.split(b"\r")[-1]]


SPLITS: dict[str, Callable[[bytes], list[bytes]]] = {
    "whole": lambda data: [data],
    "every_byte": _every(1),
    "every_7_bytes": _every(7),
    "inside_utf8_characters": _inside_utf8,
    "crlf_split_between_cr_and_lf": _crlf_split_between_cr_and_lf,
    "cr_line_endings": lambda data: _every(5)(data.replace(b"\n", b"\r")),
}


@pytest.mark.parametrize("split", SPLITS, ids=list(SPLITS))
async def test_stream_text_with_ping_and_awkward_splits(split: str) -> None:
    pieces = SPLITS[split](SSE["stream_text"])
    assert b"".join(pieces).replace(b"\r\n", b"\n").replace(b"\r", b"\n") == SSE["stream_text"]
    async with serve(Scripted.sse(pieces)) as (server, provider):
        chunks = await collect(provider, request(operation=Operation.STREAM))
    assert text_of(chunks) == STREAM_TEXT
    assert chunks[-2:] == [
        UsageChunk(Usage(25, 15, 40, cached_input_tokens=10, cache_creation_input_tokens=0)),
        FinishChunk(FinishReason.STOP),
    ]
    assert sum(isinstance(chunk, UsageChunk) for chunk in chunks) == 1
    sent = server.requests[0]
    assert sent.json()["stream"] is True and sent.headers["accept"] == "text/event-stream"


async def test_stream_thinking_signature_and_tool_calls() -> None:
    weather_id, time_id = "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "toolu_01NoArgsTool000000000001"
    async with serve(Scripted.sse(sse_events("stream_thinking_tool_use"))) as (_, provider):
        chunks = await collect(provider, request(operation=Operation.STREAM))
    arguments = '{"location": "Paris, France", "unit": "celsius"}'
    assert chunks == [
        ReasoningDelta("The user wants the weather"),
        ReasoningDelta(" and the time in Paris."),
        ReasoningDelta(signature=SIGNATURE),
        TextDelta("Checking both."),
        ToolCallStart(0, weather_id, "get_weather"),
        ToolCallDelta(0, '{"location": "Pa'),
        ToolCallDelta(0, 'ris, France", "un'),
        ToolCallDelta(0, 'it": "celsius"}'),
        ToolCallEnd(0, weather_id, "get_weather", arguments),
        ToolCallStart(1, time_id, "get_time"),
        ToolCallEnd(1, time_id, "get_time", "{}"),
        UsageChunk(Usage(472, 89, 561, cached_input_tokens=100, cache_creation_input_tokens=0)),
        FinishChunk(FinishReason.TOOL_CALLS),
    ]


async def test_streamed_signature_round_trips_in_the_next_request() -> None:
    responses = (Scripted.sse(sse_events("stream_thinking_tool_use")), Scripted.json(JSON["text_reply"]))
    async with serve(*responses) as (server, provider):
        chunks = await collect(provider, request(operation=Operation.STREAM))
        reasoning = "".join(chunk.text for chunk in chunks if isinstance(chunk, ReasoningDelta))
        [signature] = [chunk.signature for chunk in chunks if isinstance(chunk, ReasoningDelta) and chunk.signature]
        calls = [
            ToolCallPart(chunk.id, chunk.name, chunk.arguments) for chunk in chunks if isinstance(chunk, ToolCallEnd)
        ]
        assistant = AssistantMessage((ReasoningPart(reasoning, signature), TextPart(text_of(chunks)), *calls))
        results = [ToolResultMessage(call.id, "ok") for call in calls]
        await provider.chat(request([UserMessage("Weather and time in Paris?"), assistant, *results]))
    sent = server.requests[1].json()["messages"]
    assert sent[1]["content"][0] == {
        "type": "thinking",
        "thinking": "The user wants the weather and the time in Paris.",
        "signature": SIGNATURE,
    }
    assert sent[1]["content"][2]["input"] == {"location": "Paris, France", "unit": "celsius"}
    assert [block["tool_use_id"] for block in sent[2]["content"]] == [call.id for call in calls]


async def test_stream_carries_redacted_thinking_and_skips_unknown_events() -> None:
    first, *_ = sse_events("stream_text")
    pieces = [
        first,
        b'event: future_event\ndata: {"type": "future_event"}\n\n',
        b": a comment line\n\n",
        event(
            {"type": "content_block_start", "index": 0, "content_block": {"type": "redacted_thinking", "data": "abc"}}
        ),
        event({"type": "content_block_stop", "index": 0}),
        event(
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
            }
        ),
        event({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{}"}}),
        event({"type": "content_block_stop", "index": 1}),
        event({"type": "content_block_start", "index": 2, "content_block": {"type": "text", "text": "Done"}}),
        event({"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "."}}),
        event({"type": "content_block_stop", "index": 2}),
        event({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}),
        event({"type": "message_stop"}),
    ]
    async with serve(Scripted.sse(pieces)) as (_, provider):
        chunks = await collect(provider, request(operation=Operation.STREAM))
    assert chunks[:3] == [ReasoningDelta(redacted_data="abc"), TextDelta("Done"), TextDelta(".")]
    assert chunks[-1] == FinishChunk(FinishReason.STOP)


async def test_stream_error_event_is_a_typed_retryable_error() -> None:
    async with serve(Scripted.sse(sse_events("stream_error_before_content"))) as (_, provider):
        with pytest.raises(ProviderServerError, match="overloaded_error: Overloaded") as caught:
            await collect(provider, request(operation=Operation.STREAM))
    assert caught.value.retryable and caught.value.status is None


@pytest.mark.parametrize(
    ("kind", "error_type", "retryable"),
    [
        ("rate_limit_error", RateLimitError, True),
        ("api_error", ProviderServerError, True),
        ("invalid_request_error", ProviderError, False),
        ("something_new_error", ProviderError, False),
    ],
)
async def test_stream_error_event_types(kind: str, error_type: type[ProviderError], retryable: bool) -> None:
    first, *_ = sse_events("stream_text")
    pieces = [first, event({"type": "error", "error": {"type": kind, "message": "nope"}})]
    async with serve(Scripted.sse(pieces)) as (_, provider):
        with pytest.raises(ProviderError) as caught:
            await collect(provider, request(operation=Operation.STREAM))
    assert type(caught.value) is error_type and caught.value.retryable is retryable


async def test_stream_cut_mid_way_is_a_connection_error() -> None:
    async with serve(Scripted.sse(sse_events("stream_text")[:4], cut=True)) as (_, provider):
        chunks: list[StreamChunk] = []
        with pytest.raises(ModelConnectionError) as caught:
            async for chunk in provider.stream(request(operation=Operation.STREAM)):
                chunks.append(chunk)
    assert chunks == [TextDelta("Hello")] and caught.value.retryable


async def test_stream_ending_without_message_stop_is_a_connection_error() -> None:
    async with serve(Scripted.sse(sse_events("stream_text")[:-1])) as (_, provider):
        with pytest.raises(ModelConnectionError, match="message_stop"):
            await collect(provider, request(operation=Operation.STREAM))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (b"event: content_block_delta\ndata: {not json\n\n", "not valid JSON"),
        (b"event: content_block_delta\ndata: [1, 2]\n\n", "not an object"),
        (
            event({"type": "content_block_delta", "index": 9, "delta": {"type": "text_delta", "text": "x"}}),
            "unknown block",
        ),
        (b"event: ping\ndata: \xff\xfe\n\n", "UTF-8"),
        # Without an event: line the type is the data's: anything but a string is malformed.
        (b'data: {"type": ["content_block_delta"]}\n\n', "no valid type"),
        (b'data: {"type": {"a": 1}}\n\n', "no valid type"),
        (b'data: {"index": 0}\n\n', "no valid type"),
    ],
)
async def test_stream_bad_events_are_malformed(bad: bytes, match: str) -> None:
    events = sse_events("stream_text")
    async with serve(Scripted.sse([*events[:2], bad, *events[2:]])) as (_, provider):
        with pytest.raises(MalformedResponseError, match=match):
            await collect(provider, request(operation=Operation.STREAM))


async def test_a_surrogate_pair_split_across_events_is_joined_and_the_conversation_goes_on() -> None:
    """``"\\ud83d"`` then ``"\\ude00"`` (a proxy slicing UTF-16): each half alone is a lone surrogate
    that no request can encode. The deltas published are valid text (a high half waits for its
    pair; one whose pair never comes is U+FFFD), and so is the reply, so the next request is sent."""
    high, low = "\ud83d", "\ude00"

    def delta(index: int, **fields: str) -> bytes:
        return event({"type": "content_block_delta", "index": index, "delta": fields})

    def start(index: int, block: dict[str, Any]) -> bytes:
        return event({"type": "content_block_start", "index": index, "content_block": block})

    events = [
        event({"type": "message_start", "message": {"usage": {"input_tokens": 5}}}),
        start(0, {"type": "thinking", "thinking": ""}),
        delta(0, type="thinking_delta", thinking=f"hmm {high}"),
        delta(0, type="thinking_delta", thinking=f"{low} {high}"),
        delta(0, type="signature_delta", signature=SIGNATURE),
        event({"type": "content_block_stop", "index": 0}),
        start(1, {"type": "text", "text": f"smile {high}"}),
        delta(1, type="text_delta", text=f"{low}!{high}"),
        event({"type": "content_block_stop", "index": 1}),
        start(2, {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}),
        delta(2, type="input_json_delta", partial_json='{"s": "' + high),
        delta(2, type="input_json_delta", partial_json=low + '"}'),
        event({"type": "content_block_stop", "index": 2}),
        event({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}),
        event({"type": "message_stop"}),
    ]
    async with serve(Scripted.sse(events), Scripted.json(JSON["text_reply"])) as (server, provider):
        chunks = await collect(provider, request(operation=Operation.STREAM))
        assembler = ReplyAssembler()
        for chunk in chunks:
            assembler.feed(chunk)
        reply = assembler.finish()
        await provider.chat(request([UserMessage("Hi"), reply.message, ToolResultMessage("toolu_1", "ok")]))
    assert chunks[:11] == [
        ReasoningDelta("hmm "),
        ReasoningDelta("\U0001f600 "),
        ReasoningDelta("\ufffd"),  # the signature ended the reasoning before a pair came
        ReasoningDelta(signature=SIGNATURE),
        TextDelta("smile "),
        TextDelta("\U0001f600!"),
        TextDelta("\ufffd"),  # at the block's end
        ToolCallStart(0, "toolu_1", "f"),
        ToolCallDelta(0, '{"s": "'),
        ToolCallDelta(0, '\U0001f600"}'),
        ToolCallEnd(0, "toolu_1", "f", '{"s": "\U0001f600"}'),
    ]
    assert server.requests[1].json()["messages"][1]["content"] == [
        {"type": "thinking", "thinking": "hmm \U0001f600 \ufffd", "signature": SIGNATURE},
        {"type": "text", "text": "smile \U0001f600!\ufffd"},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"s": "\U0001f600"}},
    ]


async def test_json_nested_too_deeply_to_parse_is_malformed_not_a_bare_recursion_error() -> None:
    events = sse_events("stream_text")
    depth = sys.getrecursionlimit() + 100  # valid JSON, nested deeper than the json module can recurse
    deep = b"[" * depth + b"]" * depth
    deep_event = b'event: content_block_delta\ndata: {"delta": ' + deep + b"}\n\n"
    async with serve(
        Scripted(200, [("content-type", "application/json")], [deep], chunked=False),
        Scripted.sse([*events[:2], deep_event, *events[2:]]),
        Scripted.sse([*events[:2], deep_event, *events[2:]]),
        Scripted(529, [("content-type", "application/json")], [deep], chunked=False),
    ) as (_, provider):
        with pytest.raises(MalformedResponseError, match="the Anthropic response nests arrays and objects too deeply"):
            await provider.chat(request())
        with pytest.raises(MalformedResponseError, match="an Anthropic stream event nests arrays and objects too"):
            await collect(provider, request(operation=Operation.STREAM))
        # Through the service: the provider's typed error, not a bare error reported as provider_failed.
        service = ModelService(provider, retry=RetryPolicy(max_attempts=1))
        with pytest.raises(MalformedResponseError, match="too deeply"):
            async with service.stream([UserMessage("Hi")]) as chunks:
                async for _ in chunks:
                    pass
        # An error body that cannot be parsed is shown as text, whatever the reason.
        with pytest.raises(ProviderServerError, match=r"Anthropic API error 529: \[\[\[") as caught:
            await provider.chat(request())
    assert caught.value.status == 529


async def test_token_counts_out_of_range_are_ignored_as_counts_of_the_wrong_type() -> None:
    """Anthropic's usage parsing ignores a count that is not an integer; a negative or absurd one
    is no count either, and must never reach the usage totals and hooks."""
    events = sse_events("stream_text")
    events[0] = event(
        {
            "type": "message_start",
            "message": {"usage": {"input_tokens": -1000000, "cache_read_input_tokens": -5, "output_tokens": "1"}},
        }
    )
    events[-2] = event({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": -3}})
    body = JSON["text_reply"] | {
        "usage": {"input_tokens": 10**40, "output_tokens": 4, "cache_creation_input_tokens": -1}
    }
    async with serve(Scripted.sse(events), Scripted.json(body)) as (_, provider):
        chunks = await collect(provider, request(operation=Operation.STREAM))
        response = await provider.chat(request())
    assert [chunk for chunk in chunks if isinstance(chunk, UsageChunk)] == [UsageChunk(Usage(0, 0, 0))]
    assert response.usage == Usage(0, 4, 4)


async def test_stream_unknown_stop_reason_is_malformed() -> None:
    events = sse_events("stream_text")
    events[-2] = event({"type": "message_delta", "delta": {"stop_reason": "banana"}, "usage": {"output_tokens": 1}})
    async with serve(Scripted.sse(events)) as (_, provider):
        with pytest.raises(MalformedResponseError, match="banana"):
            await collect(provider, request(operation=Operation.STREAM))


async def test_stream_with_a_non_event_stream_body_is_malformed() -> None:
    async with serve(Scripted.json(JSON["text_reply"])) as (_, provider):
        with pytest.raises(MalformedResponseError, match="text/event-stream"):
            await collect(provider, request(operation=Operation.STREAM))


# -- size limits ----------------------------------------------------------------------------------------


async def test_oversize_bodies_are_malformed() -> None:
    big = json.dumps({**JSON["text_reply"], "content": [{"type": "text", "text": "x" * 5000}]}).encode()
    chunked = Scripted(200, [("content-type", "application/json")], [big[:100], big[100:]], chunked=True)
    async with serve(
        Scripted.json(json.loads(big)), chunked, Scripted.sse(sse_events("stream_text")), max_response_bytes=1000
    ) as (_, provider):
        with pytest.raises(MalformedResponseError, match="max_response_bytes"):
            await provider.chat(request())  # declared content-length
        with pytest.raises(MalformedResponseError, match="max_response_bytes"):
            await provider.chat(request())  # counted while reading
        with pytest.raises(MalformedResponseError, match="max_response_bytes"):
            await collect(provider, request(operation=Operation.STREAM))


@pytest.mark.parametrize("streaming", [False, True], ids=["chat", "stream"])
async def test_a_compressed_bomb_is_refused_at_max_response_bytes_with_memory_bounded(streaming: bool) -> None:
    """128 MiB of zeros gzipped to 128 KiB, with a 1 MiB bound: refused once 1 MiB is decoded.
    httpx decoded each network read whole before a byte was counted (64 KiB read, 64 MiB decoded)."""
    limit = 2**20
    content_type = "text/event-stream" if streaming else "application/json"
    bomb = gzip_bomb(128, b": " if streaming else b'{"type": "')
    scripted = Scripted(200, [("content-type", content_type), ("content-encoding", "gzip")], [bomb], chunked=False)
    async with serve(scripted, max_response_bytes=limit) as (server, provider):
        tracemalloc.start()
        try:
            with pytest.raises(MalformedResponseError, match="max_response_bytes"):
                if streaming:
                    await collect(provider, request(operation=Operation.STREAM))
                else:
                    await provider.chat(request())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 8 * limit  # the bound plus a few reads, not a decoded network read
    assert server.requests[0].headers["accept-encoding"] == "gzip, deflate"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate"])
async def test_gzip_and_deflate_bodies_are_decoded_as_they_arrive(encoding: str) -> None:
    wire = "deflate" if encoding == "raw-deflate" else encoding
    responses = [
        Scripted(
            200, [("content-type", kind), ("content-encoding", wire)], [data[i : i + 7] for i in range(0, len(data), 7)]
        )
        for kind, data in (
            ("application/json", encoded(json.dumps(JSON["text_reply"]).encode(), encoding)),
            ("text/event-stream", encoded(SSE["stream_text"], encoding)),
        )
    ]
    async with serve(*responses) as (_, provider):
        reply = await provider.chat(request())
        chunks = await collect(provider, request(operation=Operation.STREAM))
    assert reply.message.text == JSON["text_reply"]["content"][0]["text"]
    assert text_of(chunks) == STREAM_TEXT


@pytest.mark.parametrize("encoding", ["zstd", "br", "gzip, gzip"])
async def test_an_encoding_the_provider_did_not_ask_for_is_refused_by_name(encoding: str) -> None:
    body = b"\x28\xb5\x2f\xfd not really compressed"
    responses = [
        Scripted(200, [("content-type", kind), ("content-encoding", encoding)], [body])
        for kind in ("application/json", "text/event-stream")
    ]
    async with serve(*responses) as (_, provider):
        with pytest.raises(MalformedResponseError, match=f"encoded as '{encoding}'.*asks for gzip, deflate only"):
            await provider.chat(request())
        with pytest.raises(MalformedResponseError, match=f"encoded as '{encoding}'"):
            await collect(provider, request(operation=Operation.STREAM))


# -- closing and cancellation -------------------------------------------------------------------------


@pytest.mark.parametrize("through", ["provider", "service"])
async def test_consumer_stopping_early_closes_the_connection(through: str) -> None:
    gate = trio.Event()
    events = sse_events("stream_text")
    async with serve(Scripted.sse([*events[:4], Gate(gate), *events[4:]])) as (server, provider):
        closed = server.closed
        if through == "provider":
            stream = provider.stream(request(operation=Operation.STREAM))
            assert await stream.__anext__() == TextDelta("Hello")
            await stream.aclose()  # type: ignore[attr-defined]
        else:
            service = ModelService(provider, retry=RetryPolicy(base_delay=0))
            async with service.stream([UserMessage("Hi")]) as chunks:
                async for chunk in chunks:
                    assert chunk == TextDelta("Hello")
                    break
        # The close returned while the server was still holding the rest of the stream back.
        assert not gate.is_set() and server.closed_connections == 0
        gate.set()
        with trio.fail_after(5):
            await closed.wait()
        assert server.closed_connections == 1


async def test_cancel_scope_around_a_streaming_call_closes_promptly() -> None:
    gate = trio.Event()
    first = trio.Event()
    events = sse_events("stream_text")
    received: list[StreamChunk] = []
    async with serve(Scripted.sse([*events[:4], Gate(gate), *events[4:]])) as (server, provider):
        service = ModelService(provider, retry=RetryPolicy(base_delay=0))
        closed = server.closed

        async def consume(scope: trio.CancelScope) -> None:
            with scope:
                async with service.stream([UserMessage("Hi")]) as chunks:
                    async for chunk in chunks:
                        received.append(chunk)
                        first.set()

        scope = trio.CancelScope()
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, scope)
                await first.wait()
                scope.cancel()  # the consumer is blocked reading the held-back stream
        assert scope.cancelled_caught and not gate.is_set()
        assert received == [TextDelta("Hello")]
        gate.set()
        with trio.fail_after(5):
            await closed.wait()


# -- through the service: retries only before the first chunk -----------------------------------------


async def test_service_retries_a_stream_error_before_any_chunk() -> None:
    responses = (Scripted.sse(sse_events("stream_error_before_content")), Scripted.sse(sse_events("stream_text")))
    async with serve(*responses) as (server, provider):
        service = ModelService(provider, retry=RetryPolicy(base_delay=0))
        async with service.stream([UserMessage("Hi")]) as chunks:
            received = [chunk async for chunk in chunks]
    assert text_of(received) == STREAM_TEXT
    assert len(server.requests) == 2


async def test_service_retries_an_overloaded_status_and_a_cut_before_any_chunk() -> None:
    responses = (
        Scripted.json(JSON["error_529"], status=529),
        Scripted.sse(sse_events("stream_text")[:2], cut=True),
        Scripted.sse(sse_events("stream_text")),
    )
    async with serve(*responses) as (server, provider):
        service = ModelService(provider, retry=RetryPolicy(base_delay=0))
        async with service.stream([UserMessage("Hi")]) as chunks:
            received = [chunk async for chunk in chunks]
    assert text_of(received) == STREAM_TEXT
    assert len(server.requests) == 3


async def test_service_chat_retries_rate_limits_with_retry_after() -> None:
    responses = (
        Scripted.json(JSON["error_429"], status=429, headers=[("retry-after", "0")]),
        Scripted.json(JSON["text_reply"]),
    )
    async with serve(*responses) as (server, provider):
        service = ModelService(provider, retry=RetryPolicy(base_delay=0))
        response = await service.chat([UserMessage("Hi")])
    assert response.message.text.startswith("Hello") and len(server.requests) == 2


async def test_service_waits_the_retry_after_of_an_overloaded_529() -> None:
    """The service retried a 529 with retry-after at once (base_delay=0): only a 429's hint counted."""
    responses = (
        Scripted.json(JSON["error_529"], status=529, headers=[("retry-after-ms", "20")]),
        Scripted.json(JSON["text_reply"]),
    )
    async with serve(*responses) as (server, provider):
        service = ModelService(provider, retry=RetryPolicy(base_delay=0, jitter=False))
        async with service.chat_with_retry_events([UserMessage("Hi")]) as events:
            items = [item async for item in events]
    retried = items[0]
    assert isinstance(retried, RetryEvent) and isinstance(retried.error, ProviderServerError)
    assert retried.delay == 0.02 and len(items) == 2 and len(server.requests) == 2


@pytest.mark.parametrize("failure", ["error_event", "cut"])
async def test_service_stream_failing_after_chunks_is_interrupted_not_retried(failure: str) -> None:
    if failure == "error_event":
        failing = Scripted.sse(sse_events("stream_error_after_text"))
    else:
        failing = Scripted.sse(sse_events("stream_text")[:4], cut=True)
    async with serve(failing, Scripted.sse(sse_events("stream_text"))) as (server, provider):
        service = ModelService(provider, retry=RetryPolicy(base_delay=0))
        received: list[StreamChunk] = []
        with pytest.raises(StreamInterruptedError) as caught:
            async with service.stream([UserMessage("Hi")]) as chunks:
                async for chunk in chunks:
                    received.append(chunk)
    assert len(received) == 1 and isinstance(received[0], TextDelta)
    assert not caught.value.retryable
    assert len(server.requests) == 1


# -- timeouts and connection failures -----------------------------------------------------------------


async def test_stream_idle_timeout() -> None:
    never = trio.Event()
    async with serve(Scripted.sse([sse_events("stream_text")[0], Gate(never)]), stream_idle_timeout=0.3) as (
        _,
        provider,
    ):
        with pytest.raises(ModelTimeoutError) as caught:
            await collect(provider, request(operation=Operation.STREAM))
    assert caught.value.code == "model_stream_idle_timeout"


async def test_chat_request_timeout() -> None:
    never = trio.Event()
    stalled = Scripted(200, [("content-type", "application/json")], [b'{"type":', Gate(never)])
    async with serve(stalled, timeout=0.3) as (_, provider):
        with pytest.raises(ModelTimeoutError) as caught:
            await provider.chat(request())
    assert caught.value.code == "model_request_timeout"


@pytest.mark.parametrize("streaming", [False, True], ids=["chat", "stream"])
async def test_connection_refused_is_a_retryable_connection_error(streaming: bool) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with AnthropicProvider(MODEL, api_key=KEY, base_url=f"http://127.0.0.1:{port}") as provider:
        with pytest.raises(ModelConnectionError) as caught:
            if streaming:
                await collect(provider, request())
            else:
                await provider.chat(request())
    assert caught.value.retryable


# -- configuration and resources ----------------------------------------------------------------------


def test_missing_api_key_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ProviderConfigError, match="ANTHROPIC_API_KEY"):
        AnthropicProvider(MODEL)
    with pytest.raises(ProviderConfigError, match="ANTHROPIC_API_KEY"):
        AnthropicProvider(MODEL, api_key="")


@pytest.mark.parametrize("api_key", [5, b"sk-bytes", ["sk"]])
def test_an_api_key_that_is_no_string_is_a_config_error(api_key: Any) -> None:
    for build in (
        lambda: AnthropicProvider(MODEL, api_key=api_key),
        lambda: create_provider("anthropic", MODEL, api_key=api_key),
    ):
        with pytest.raises(ProviderConfigError, match=f"api_key must be a string, got {type(api_key).__name__}"):
            build()


@pytest.mark.parametrize("option", ["stop", "stop_sequences"])
@pytest.mark.parametrize("stop", [5, ["END", 5], {"END"}])
async def test_a_stop_option_that_is_no_string_or_list_of_strings_is_named(option: str, stop: object) -> None:
    """It raised a bare TypeError (a provider_failed error through the service)."""
    async with serve() as (server, provider):
        with pytest.raises(ModelError, match=f"{option!r} must be a string or a list of strings") as caught:
            await provider.chat(request(options={option: stop}))
        assert caught.value.code == "provider_bad_option"
        with pytest.raises(ModelError, match=repr(option)):
            await collect(provider, request(options={option: stop}, operation=Operation.STREAM))
        with pytest.raises(ModelError, match=repr(option)) as through_service:
            await ModelService(provider).chat([UserMessage("Hi")], options={option: stop})
        assert through_service.value.code == "provider_bad_option"
    assert server.requests == []


async def test_a_call_after_the_provider_closed_is_a_typed_error() -> None:
    """A call after the `async with` block (or on a with_model provider whose source closed) raised
    httpx's bare RuntimeError; the OpenAI provider's typed error, code provider_not_open."""
    async with serve() as (server, provider):
        pass
    derived = provider.with_model("claude-other")
    for calling in (provider, derived):
        with pytest.raises(ModelError, match="client is closed") as chat_error:
            await calling.chat(request())
        with pytest.raises(ModelError, match="client is closed") as stream_error:
            await collect(calling, request(operation=Operation.STREAM))
        assert chat_error.value.code == stream_error.value.code == "provider_not_open"
    assert server.requests == []


@pytest.mark.parametrize("url", ["not a url", "ftp://example.com", "http://", "example.com/v1", "http://h/?q=1"])
def test_invalid_base_url_is_named(url: str) -> None:
    with pytest.raises(ProviderConfigError) as caught:
        AnthropicProvider(MODEL, api_key=KEY, base_url=url)
    assert repr(url) in str(caught.value)


def test_invalid_base_url_from_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "ftp://nowhere")
    with pytest.raises(ProviderConfigError, match=r"ANTHROPIC_BASE_URL.*ftp://nowhere"):
        AnthropicProvider(MODEL, api_key=KEY)


def test_bad_limits_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="stream_idle_timeout"):
        AnthropicProvider(MODEL, api_key=KEY, stream_idle_timeout=0)
    with pytest.raises(ConfigError, match="max_response_bytes"):
        AnthropicProvider(MODEL, api_key=KEY, max_response_bytes=0)


async def test_key_and_base_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_fake_server(queue_handler(Scripted.json(JSON["text_reply"]))) as server:
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-from-env")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url + "/proxy/")
        async with AnthropicProvider(MODEL) as provider:
            assert provider.base_url == server.url + "/proxy"
            await provider.chat(request())
    assert server.requests[0].path == "/proxy/v1/messages"
    assert server.requests[0].headers["x-api-key"] == "sk-from-env"


async def test_client_ownership_and_with_model_sharing() -> None:
    async with open_fake_server(queue_handler(*[Scripted.json(JSON["text_reply"])] * 2)) as server:
        async with AnthropicProvider(MODEL, api_key=KEY, base_url=server.url) as provider:
            assert provider.owns_client
            other = provider.with_model("claude-other")
            assert (other.model, other.client, other.owns_client) == ("claude-other", provider.client, False)
            async with other:
                pass
            assert not provider.client.is_closed  # the derived provider never closes the shared client
            await other.chat(ModelRequest(Operation.CHAT, "claude-other", (UserMessage("Hi"),)))
        assert provider.client.is_closed
        given = httpx.AsyncClient()
        try:
            async with AnthropicProvider(MODEL, api_key=KEY, base_url=server.url, client=given) as borrowed:
                assert not borrowed.owns_client
                await borrowed.chat(request())
            assert not given.is_closed
        finally:
            await given.aclose()
    assert [sent.json()["model"] for sent in server.requests] == ["claude-other", MODEL]
    assert KEY not in repr(provider)


# -- real servers: lenient where the answer is complete, bounded where the server is hostile -------------

FOREVER = 3600.0  # a stream_idle_timeout nothing in these tests reaches unless the stream waits for it
EXPLANATION = JSON["refusal_with_explanation"]["stop_details"]["explanation"]


async def test_a_refusal_carries_its_explanation() -> None:
    responses = (Scripted.json(JSON["refusal_with_explanation"]), Scripted.sse(sse_events("stream_refusal")))
    async with serve(*responses) as (_, provider):
        refused = await provider.chat(request())
        chunks = await collect(provider, request(operation=Operation.STREAM))
    assert (refused.finish_reason, refused.finish_explanation) == (FinishReason.REFUSAL, EXPLANATION)
    assert chunks[0] == TextDelta("Here is how to")
    assert chunks[-1] == FinishChunk(FinishReason.REFUSAL, EXPLANATION)
    assert FinishChunk(FinishReason.STOP).explanation is None  # no details, no explanation


@pytest.mark.parametrize("split", ["whole", "every_byte", "crlf_split_between_cr_and_lf"])
async def test_unicode_line_separators_in_output_are_text(split: str) -> None:
    """U+2028, U+2029 and U+0085 end no SSE line (httpx-sse < 0.4.2 split on them)."""
    async with serve(Scripted.sse(SPLITS[split](SSE["stream_unicode_separators"]))) as (_, provider):
        chunks = await collect(provider, request(operation=Operation.STREAM))
    assert text_of(chunks) == "line\u2028sep para\u2029sep next\u0085line"
    assert chunks[-1] == FinishChunk(FinishReason.STOP)


async def test_message_stop_ends_the_stream_whatever_the_connection_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The server never closes the body after message_stop: the stream still ends at once (on this
    mock clock any wait, even for the idle timeout, would show as elapsed time)."""
    never = trio.Event()
    async with serve(Scripted.sse([*sse_events("stream_text"), Gate(never)]), stream_idle_timeout=FOREVER) as (
        _,
        provider,
    ):
        started = trio.current_time()
        chunks = await collect(provider, request(operation=Operation.STREAM))
        assert trio.current_time() == started
    assert text_of(chunks) == STREAM_TEXT and chunks[-1] == FinishChunk(FinishReason.STOP)


async def test_a_finished_stream_releases_its_connection_for_reuse() -> None:
    async with serve(Scripted.sse(sse_events("stream_text")), Scripted.sse(sse_events("stream_text"))) as (
        server,
        provider,
    ):
        for _ in range(2):
            async for chunk in provider.stream(request(operation=Operation.STREAM)):
                if isinstance(chunk, FinishChunk):
                    # The consumer handles the last chunk; meanwhile the server ends its body.
                    await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()
        assert len(server.requests) == 2 and server.closed_connections == 0


async def test_an_unterminated_line_over_max_response_bytes_is_refused_while_it_is_read() -> None:
    limit = 64 * 1024
    never = trio.Event()
    flood: list[bytes | Gate] = [sse_events("stream_text")[0], b"data: ", *[b"x" * 65536] * 64, Gate(never)]
    async with serve(Scripted.sse(flood), max_response_bytes=limit, stream_idle_timeout=FOREVER) as (_, provider):
        with trio.fail_after(30):  # a hang guard, not synchronisation
            with pytest.raises(MalformedResponseError, match="max_response_bytes") as caught:
                await collect(provider, request(operation=Operation.STREAM))
    assert not caught.value.retryable


@pytest.mark.parametrize(
    ("name", "error_type", "retryable"),
    [
        ("error_529", ProviderServerError, True),
        ("error_429", RateLimitError, True),
        ("error_401", AuthenticationError, False),
    ],
)
@pytest.mark.parametrize("shape", ["json_body_with_200", "json_served_as_event_stream", "json_for_a_stream"])
async def test_an_error_body_with_status_200_is_the_servers_typed_error(
    shape: str, name: str, error_type: type[ProviderError], retryable: bool
) -> None:
    body = json.dumps(JSON[name], indent=2).encode()
    if shape == "json_served_as_event_stream":
        scripted = Scripted(
            200, [("content-type", "text/event-stream")], [body[i : i + 5] for i in range(0, len(body), 5)]
        )
    else:
        scripted = Scripted.json(JSON[name])
    async with serve(scripted) as (_, provider):
        with pytest.raises(ProviderError) as caught:
            if shape == "json_body_with_200":
                await provider.chat(request())
            else:
                await collect(provider, request(operation=Operation.STREAM))
    assert type(caught.value) is error_type
    assert (caught.value.status, caught.value.retryable) == (None, retryable)
    assert JSON[name]["error"]["message"] in str(caught.value)


async def test_a_json_body_that_is_no_error_served_as_an_event_stream_is_malformed() -> None:
    scripted = Scripted(200, [("content-type", "text/event-stream")], [json.dumps(JSON["text_reply"]).encode()])
    async with serve(scripted) as (_, provider):
        with pytest.raises(MalformedResponseError, match="not text/event-stream") as caught:
            await collect(provider, request(operation=Operation.STREAM))
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


@pytest.mark.parametrize("operation", [Operation.STREAM, Operation.CHAT])
async def test_a_response_whose_close_hangs_is_abandoned_after_cleanup_grace(
    operation: Operation, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream left early, or a chat body refused half-read: the response is closed under a shield
    bounded by cleanup_grace (unbounded, this test would take STUCK seconds)."""
    caplog.set_level(logging.WARNING, logger="trio_agent")
    if operation is Operation.STREAM:
        transport = StuckCloseTransport("text/event-stream", sse_events("stream_text"))
    else:
        body = json.dumps(JSON["text_reply"]).encode()
        transport = StuckCloseTransport("application/json", [body[:100], body[100:]])
    async with httpx.AsyncClient(transport=transport) as client:
        limit = 150 if operation is Operation.CHAT else 2**20
        provider = AnthropicProvider(
            MODEL, api_key=KEY, base_url="http://stuck", client=client, cleanup_grace=2, max_response_bytes=limit
        )
        started = trio.current_time()
        if operation is Operation.STREAM:
            stream = provider.stream(request(operation=Operation.STREAM))
            assert await stream.__anext__() == TextDelta("Hello")
            await stream.aclose()  # type: ignore[attr-defined]
        else:
            with pytest.raises(MalformedResponseError, match="max_response_bytes"):
                await provider.chat(request())
        assert trio.current_time() - started == 2.0
    assert transport.closes_finished == 0
    [message] = [record.getMessage() for record in caplog.records if "overran" in record.getMessage()]
    assert "anthropic response close" in message and "2 s" in message


def test_cleanup_grace_is_validated_and_carried_by_with_model() -> None:
    assert AnthropicProvider(MODEL, api_key=KEY).cleanup_grace == DEFAULT_CLEANUP_GRACE
    provider = AnthropicProvider(MODEL, api_key=KEY, cleanup_grace=0.5)
    assert provider.with_model("claude-other").cleanup_grace == 0.5
    made = create_provider("anthropic", MODEL, api_key=KEY, cleanup_grace=3)
    assert isinstance(made, AnthropicProvider) and made.cleanup_grace == 3.0
    for bad in (0, -1, float("nan"), "1", True):
        with pytest.raises(ConfigError, match="cleanup_grace"):
            AnthropicProvider(MODEL, api_key=KEY, cleanup_grace=bad)  # type: ignore[arg-type]


def test_call_ids_anthropic_refuses_are_mapped_to_safe_distinct_ids() -> None:
    from trio_agent._models._anthropic import convert_messages

    messages: tuple[Message, ...] = (
        UserMessage("go"),
        AssistantMessage((ToolCallPart("call_1", "a", "{}"), ToolCallPart("call_1~2", "a", "{}"))),
        ToolResultMessage("call_1", "one"),
        ToolResultMessage("call_1~2", "two"),
    )
    _, converted = convert_messages(messages)
    uses = [block["id"] for block in converted[1]["content"]]
    answers = [block["tool_use_id"] for block in converted[2]["content"]]
    assert uses == answers
    assert uses[0] == "call_1"
    assert len(set(uses)) == 2
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", call_id) for call_id in uses)


def test_wire_ids_never_collide() -> None:
    """Ids as the assembler and other providers give them: a renamed repeat (``toolu_a~2``) and a
    real id spelled like an escape of it, or ids that differ only in an unsafe character, stay
    distinct on the wire; ids Anthropic accepts as they are keep their spelling where possible."""
    from trio_agent._models._anthropic import _wire_id

    ids = ["toolu_a", "toolu_a~2", "toolu_a_7e_2", "toolu_a-7e-2", "toolu_a--7e-2", "call:1", "call_3a_1", "call-3a-1"]
    ids += ["a-b", "a--b", "a-2d-b", "a~-b", "é", "-e9-", "--", "-", "~"]
    wire = [_wire_id(call_id) for call_id in ids]
    assert len(set(wire)) == len(ids)
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", call_id) for call_id in wire)
    assert _wire_id("toolu_01T1x1fJ34qAmk2tNTrN7Up6") == "toolu_01T1x1fJ34qAmk2tNTrN7Up6"
    assert _wire_id("call_1~2") == "call_1-7e-2"


def read_wire_id(wire: str) -> str:
    """The id `_wire_id` escaped into *wire*, read back by its documented code: ``--`` is ``-``,
    ``-<hex>-`` the character of that code point."""
    out, position = [], 0
    while position < len(wire):
        if wire[position] != "-":
            out.append(wire[position])
            position += 1
        elif wire.startswith("--", position):
            out.append("-")
            position += 2
        else:
            end = wire.index("-", position + 1)
            out.append(chr(int(wire[position + 1 : end], 16)))
            position = end + 1
    return "".join(out)


@given(st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12))
def test_wire_ids_are_safe_and_read_back_to_the_id(call_id: str) -> None:
    from trio_agent._models._anthropic import _wire_id

    wire = _wire_id(call_id)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", wire)
    assert read_wire_id(wire) == call_id  # so no two ids share a wire id


async def test_lone_surrogates_in_the_history_are_sent_as_replacement_characters() -> None:
    # Text a tool returned or a user sent made every later request of the conversation fail to encode.
    call = ToolCallPart("toolu_1", "f", "{}")
    history = [UserMessage("a \udc80 b"), AssistantMessage((call,)), ToolResultMessage("toolu_1", "half \ud83d x")]
    async with serve(Scripted.json(JSON["text_reply"])) as (server, provider):
        await provider.chat(request(history))
    sent = server.requests[0].json()["messages"]
    assert "a \ufffd b" in json.dumps(sent[0], ensure_ascii=False)
    assert "half \ufffd x" in json.dumps(sent[2], ensure_ascii=False)


# -- usage sums, tool names and structured output -------------------------------------------------------


async def test_a_token_sum_past_the_bound_is_ignored_as_a_count_out_of_range() -> None:
    """Each count in range, their sum (the total the provider computes) past MAX_TOKEN_COUNT:
    ModelService refused the UsageChunk as provider_failed, after the answer was published."""
    top = 2**53 - 1
    events = sse_events("stream_text")
    events[0] = event({"type": "message_start", "message": {"usage": {"input_tokens": top, "output_tokens": 0}}})
    events[-2] = event({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 7}})
    body = JSON["text_reply"] | {"usage": {"input_tokens": top, "output_tokens": 5}}
    async with serve(Scripted.sse(events), Scripted.json(body)) as (_, provider):
        service = ModelService(provider, retry=RetryPolicy(max_attempts=1))
        async with service.stream([UserMessage("Hi")]) as stream:
            chunks = [chunk async for chunk in stream]
        response = await service.chat([UserMessage("Hi")])
    assert text_of(chunks) == STREAM_TEXT
    assert [chunk for chunk in chunks if isinstance(chunk, UsageChunk)] == [UsageChunk(Usage(top, 7, 0))]
    assert response.usage == Usage(top, 5, 0)


def tool_use_stream(name: str) -> list[bytes]:
    start = {"type": "message", "id": "msg_1", "role": "assistant", "model": MODEL, "content": [],
             "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 0}}  # fmt: skip
    block = {"type": "tool_use", "id": "toolu_1", "name": name, "input": {}}
    return [
        event({"type": "message_start", "message": start}),
        event({"type": "content_block_start", "index": 0, "content_block": block}),
        event({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{}"}}),
        event({"type": "content_block_stop", "index": 0}),
        event({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 1}}),
        event({"type": "message_stop"}),
    ]


async def test_a_tool_use_with_an_empty_name_is_malformed() -> None:
    """It was taken, sent back as ``name: ""`` in the next request, and the run's own conversation
    was then one ``chat(history=...)`` refuses (OpenAI's provider refuses it as malformed)."""
    reply = JSON["text_reply"] | {
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "", "input": {}}],
        "stop_reason": "tool_use",
    }
    async with serve(Scripted.json(reply), Scripted.sse(tool_use_stream(""))) as (server, provider):
        with pytest.raises(MalformedResponseError, match=r"the Anthropic tool_use block has an empty 'name'"):
            await provider.chat(request())
        with pytest.raises(MalformedResponseError, match=r"the Anthropic streamed tool_use block has an empty 'name'"):
            await collect(provider, request(operation=Operation.STREAM))
    assert len(server.requests) == 2


async def test_the_structured_output_call_asks_in_its_prompt_and_sends_no_output_schema_field() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    answer = JSON["text_reply"] | {"content": [{"type": "text", "text": '{"n": 1}'}]}
    async with serve(Scripted.sse(sse_events("stream_text")), Scripted.json(answer)) as (server, provider):
        result = await chat(provider, "count", output_schema=schema)
    assert result.structured_output == {"n": 1}
    body = server.requests[1].json()
    assert set(body) == {"model", "max_tokens", "messages"}
    assert json.dumps(schema) in body["messages"][-1]["content"][-1]["text"]
