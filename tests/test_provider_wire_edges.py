"""Edges of the HTTP providers' wire handling, run for real against the local fake server: a
wait hint that cannot be read, credentials and headers that HTTP cannot carry, and compressed
bodies however the network splits them or however many gzip members they hold."""

from __future__ import annotations

import gzip
import itertools
import json
import traceback
from typing import Any

import httpx
import pytest
import trio

from tests.fake_server import Gate, Scripted, encoded, open_fake_server, queue_handler
from tests.test_provider_wire import ANTHROPIC_REPLY, FINISHED, OPENAI_REPLY, Provider, collect, make_provider
from trio_agent import ModelError, ProviderError, RateLimitError
from trio_agent._models._http import BodyReader
from trio_agent._models._service import ModelRequest
from trio_agent.models import (
    AnthropicProvider,
    MalformedResponseError,
    ModelResponse,
    ModelService,
    OpenAIProvider,
    Operation,
    ProviderConfigError,
    RetryEvent,
    RetryPolicy,
    UserMessage,
)

KINDS = ["openai", "anthropic"]
REPLIES = {"openai": OPENAI_REPLY, "anthropic": ANTHROPIC_REPLY}
CHAT_BODIES: dict[str, Any] = {
    "openai": {
        "id": "c",
        "model": "gpt",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
    },
    "anthropic": {
        "type": "message",
        "id": "m",
        "model": "claude",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 1},
    },
}


def error_body(kind: str) -> dict[str, Any]:
    if kind == "openai":
        return {"error": {"message": "slow down", "type": "rate_limit_error"}}
    return {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}


# -- a wait hint that cannot be read ----------------------------------------------------------------

UNREADABLE_DATES = [
    "Mon, 01 Jan 2020 00:00:00 +99999999999999999999",  # the date parser's OverflowError
    "+0100 Feb +0100 99:99:99 +9999999999999999999999 0",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize("value", UNREADABLE_DATES)
async def test_a_retry_after_date_that_cannot_be_read_is_no_hint_and_the_call_is_retried(
    kind: str, status: int, value: str
) -> None:
    """An HTTP date with a zone offset too large for the date parser raised a bare OverflowError
    out of the error's construction: the 429 or 503 became ``provider_failed`` and was never
    retried. It is no hint (``retry_after=None``), as a value that is no date at all."""
    refused = Scripted.json(error_body(kind), status=status, headers=[("retry-after", value)])
    async with (
        open_fake_server(queue_handler(refused, Scripted.json(CHAT_BODIES[kind]))) as server,
        make_provider(kind, server.url) as provider,
    ):
        service = ModelService(provider, retry=RetryPolicy(base_delay=0, jitter=False))
        async with service.chat_with_retry_events([UserMessage("hi")]) as events:
            items = [item async for item in events]
    retried, answered = items
    assert isinstance(retried, RetryEvent) and isinstance(retried.error, ProviderError)
    assert (retried.error.status, retried.error.retryable, retried.error.retry_after) == (status, True, None)
    assert isinstance(retried.error, RateLimitError) is (status == 429)
    assert isinstance(answered, ModelResponse) and answered.message.text == "Hi"
    assert len(server.requests) == 2


# -- credentials and headers that HTTP cannot carry -------------------------------------------------

SECRET = "SECRET-4c1f"
UNSENDABLE_KEYS = {
    "newline": (f"sk-{SECRET}\n", "ends with a line break (U+000A"),
    "crlf": (f"sk-{SECRET}\r\n", "ends with a line break (U+000A"),
    "inner-cr": (f"sk-{SECRET}\rx", "contains a line break (U+000D)"),
    "zero-width-space": (f"sk-{SECRET}\u200b", "contains a non-ASCII character (U+200B)"),
    "escape": (f"sk-\x1b{SECRET}", "contains a control character (U+001B)"),
    "space": (f"sk {SECRET}", "contains a space or tab"),
}
ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


def make_unopened(kind: str, **settings: Any) -> Provider:
    if kind == "openai":
        return OpenAIProvider("gpt", base_url="http://127.0.0.1:9/v1", **settings)
    return AnthropicProvider("claude", base_url="http://127.0.0.1:9", **settings)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(UNSENDABLE_KEYS))
@pytest.mark.parametrize("from_env", [False, True], ids=["argument", "environment"])
def test_an_api_key_http_cannot_carry_is_refused_when_the_provider_is_made(
    kind: str, case: str, from_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key read from a file with its newline (or pasted with an invisible character) was taken:
    then every call failed, as a *retryable* connection error whose message showed the key (h11
    quotes the header it refuses) or as a bare UnicodeEncodeError. It is a `ProviderConfigError`
    at construction naming the problem and where the key came from, never the key."""
    key, problem = UNSENDABLE_KEYS[case]
    if from_env:
        monkeypatch.setenv(ENV[kind], key)
    with pytest.raises(ProviderConfigError) as caught:
        make_unopened(kind, **({} if from_env else {"api_key": key}))
    message = str(caught.value)
    assert problem in message and SECRET not in message
    assert (f"the {ENV[kind]} environment variable" if from_env else "(api_key)") in message


UNSENDABLE_VALUES = {
    "newline": (f"{SECRET}\n", "ends with a line break (U+000A"),
    "inner-lf": (f"{SECRET}\nx-injected: 1", "contains a line break (U+000A)"),
    "non-ascii": (f"{SECRET}é", "contains a non-ASCII character (U+00E9)"),
    "del": (f"{SECRET}\x7f", "contains a control character (U+007F)"),
    "nul": (f"{SECRET}\x00x", "contains a control character (U+0000)"),
    "leading-space": (f" {SECRET}", "starts or ends with a space or tab"),
    "trailing-tab": (f"{SECRET}\t", "starts or ends with a space or tab"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(UNSENDABLE_VALUES))
def test_an_extra_header_value_http_cannot_carry_is_refused_by_name(kind: str, case: str) -> None:
    """The same for ``extra_headers`` (a gateway's ``api-key`` read from a file): refused when the
    provider is made, naming the header, never its value."""
    value, problem = UNSENDABLE_VALUES[case]
    with pytest.raises(ProviderConfigError) as caught:
        make_unopened(kind, api_key="k", extra_headers={"api-key": value})
    message = str(caught.value)
    assert problem in message and "'api-key'" in message and SECRET not in message


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "headers",
    [{"x gateway": "v"}, {"x-gateway:": "v"}, {"": "v"}, {"x-gateway\n": "v"}, {"x-gätewäy": "v"}],
    ids=["space", "colon", "empty", "newline", "non-ascii"],
)
def test_an_extra_header_name_that_is_no_token_is_refused(kind: str, headers: dict[str, str]) -> None:
    with pytest.raises(ProviderConfigError, match="is not a valid HTTP header name"):
        make_unopened(kind, api_key="k", extra_headers=headers)


@pytest.mark.parametrize("kind", KINDS)
def test_extra_headers_that_are_not_strings_are_refused(kind: str) -> None:
    with pytest.raises(ProviderConfigError, match="'x-gateway' must have a string value, got bytes"):
        make_unopened(kind, api_key="k", extra_headers={"x-gateway": b"v"})
    with pytest.raises(ProviderConfigError, match="must be a mapping of header names to values, got list"):
        make_unopened(kind, api_key="k", extra_headers=[("x-gateway", "v")])


@pytest.mark.parametrize("kind", KINDS)
async def test_extra_header_values_with_inner_blanks_or_empty_are_sent_as_given(kind: str) -> None:
    """What HTTP allows still goes: spaces and tabs between visible characters, an empty value,
    and any token as a name."""
    headers = {"x-title": "My\tApp  v2", "x-empty": "", "X-Odd!#$%&'*+.^_`|~": "1", "x-key": "a-Z_0~!"}
    async with (
        open_fake_server(queue_handler(Scripted.sse([REPLIES[kind]]))) as server,
        make_provider(kind, server.url, extra_headers=headers) as provider,
    ):
        assert await collect(provider) == FINISHED[kind]
    sent = server.requests[0].headers
    assert {name.lower(): sent[name.lower()] for name in headers} == {name.lower(): v for name, v in headers.items()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("streaming", [False, True], ids=["chat", "stream"])
async def test_a_request_the_http_library_refuses_fails_once_without_showing_the_header(
    kind: str, streaming: bool
) -> None:
    """A header the provider cannot check (one set on the given httpx client) that h11 refuses
    raised `httpx.LocalProtocolError`, mapped to a retryable `ModelConnectionError` quoting the
    header's value: retried in vain, the secret in its message. Now a `ModelError`
    ``provider_bad_request``, not retryable, showing neither the value nor chaining the library's
    error (whose text holds it)."""
    async with (
        open_fake_server(queue_handler(Scripted.json(CHAT_BODIES[kind]))) as server,
        httpx.AsyncClient(headers={"x-gateway-key": f"{SECRET}\n"}) as client,
        make_provider(kind, server.url, client=client) as provider,
    ):
        service = ModelService(provider, retry=RetryPolicy(base_delay=0, jitter=False))
        with pytest.raises(ModelError) as caught:
            if streaming:
                async with service.stream([UserMessage("hi")]) as chunks:
                    async for _ in chunks:
                        pass
            else:
                async with service.chat_with_retry_events([UserMessage("hi")]) as events:
                    async for item in events:
                        raise AssertionError(f"no retry and no answer expected, got {item!r}")
    error = caught.value
    assert (type(error), error.code, error.retryable) == (ModelError, "provider_bad_request", False)
    assert SECRET not in "".join(traceback.format_exception(error))
    assert server.requests == []


# -- compressed bodies --------------------------------------------------------------------------------


def pieces_of(data: bytes, split: str) -> list[bytes]:
    """*data* as the network pieces (chunks, one read each) of *split*."""
    if split == "bytewise":
        return [data[i : i + 1] for i in range(len(data))]
    cut = int(split)
    return [data[:cut], data[cut:]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["deflate", "raw-deflate"])
@pytest.mark.parametrize("split", ["1", "2", "3", "bytewise"])
async def test_a_deflate_body_is_decoded_however_the_network_splits_it(kind: str, form: str, split: str) -> None:
    """``deflate`` with or without its zlib header: the form was settled by the first call to the
    decoder that raised nothing, so a raw-deflate body whose first read was one byte (too little
    for the zlib header check to fail on) was taken as zlib and failed at the next byte
    ("incorrect header check"). The form is read from the first two bytes, whichever reads bring them."""
    data = encoded(json.dumps(CHAT_BODIES[kind]).encode(), form)
    scripted = Scripted(
        200, [("content-type", "application/json"), ("content-encoding", "deflate")], pieces_of(data, split)
    )
    async with (
        open_fake_server(queue_handler(scripted)) as server,
        make_provider(kind, server.url) as provider,
    ):
        reply = await provider.chat(ModelRequest(Operation.CHAT, provider.model, (UserMessage("hi"),)))
    assert reply.message.text == "Hi"


def gzip_members(data: bytes, cuts: list[int], *, padding: bytes = b"") -> bytes:
    """*data* as gzip members, one for each slice between *cuts*, each followed by *padding*."""
    bounds = [0, *cuts, len(data)]
    return b"".join(encoded(data[start:end], "gzip") + padding for start, end in itertools.pairwise(bounds))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("padding", [b"", b"\0\0\0"], ids=["packed", "zero-padded"])
@pytest.mark.parametrize("split", ["whole", "17", "bytewise"])
async def test_every_gzip_member_of_a_stream_is_decoded(kind: str, padding: bytes, split: str) -> None:
    """A gzip body of several members (RFC 1952; a proxy that compresses each flush alone sends
    one per flush): decoding stopped at the end of the first, the rest silently dropped, so the
    reply seemed cut (``StreamInterruptedError`` once text was published). Every member is
    decoded, zero padding between them skipped as `gzip` does, however the reads split them."""
    reply = REPLIES[kind]
    data = gzip_members(reply, [5, len(reply) // 2, len(reply) - 3], padding=padding)
    body = [data] if split == "whole" else pieces_of(data, split)
    scripted = Scripted(200, [("content-type", "text/event-stream"), ("content-encoding", "gzip")], body)
    async with (
        open_fake_server(queue_handler(scripted)) as server,
        make_provider(kind, server.url) as provider,
    ):
        assert await collect(provider) == FINISHED[kind]


@pytest.mark.parametrize("kind", KINDS)
async def test_every_gzip_member_of_a_body_is_decoded_and_counted(kind: str) -> None:
    """A whole (non-streaming) body in members is read whole; all of them count against
    ``max_response_bytes``, which the first alone does not pass."""
    body = json.dumps({**CHAT_BODIES[kind], "pad": "x" * 1000}).encode()
    data = gzip_members(body, [10, 600])
    big = gzip_members(b"x" * 1500, [1000])
    responses = [
        Scripted(200, [("content-type", "application/json"), ("content-encoding", "gzip")], [payload])
        for payload in (data, big)
    ]
    async with (
        open_fake_server(queue_handler(*responses)) as server,
        make_provider(kind, server.url, max_response_bytes=1400) as provider,
    ):
        reply = await provider.chat(ModelRequest(Operation.CHAT, provider.model, (UserMessage("hi"),)))
        assert reply.message.text == "Hi"
        with pytest.raises(MalformedResponseError, match="larger than max_response_bytes=1400"):
            await provider.chat(ModelRequest(Operation.CHAT, provider.model, (UserMessage("hi"),)))


@pytest.mark.parametrize("kind", KINDS)
async def test_bytes_after_a_gzip_member_that_start_none_are_malformed(kind: str) -> None:
    """What follows a member is read as the next one: bytes that are none fail the call, instead
    of being dropped unread as everything after the first member was."""
    data = encoded(json.dumps(CHAT_BODIES[kind]).encode(), "gzip") + b"trailing junk"
    scripted = Scripted(200, [("content-type", "application/json"), ("content-encoding", "gzip")], [data])
    async with (
        open_fake_server(queue_handler(scripted)) as server,
        make_provider(kind, server.url) as provider,
    ):
        with pytest.raises(MalformedResponseError, match="could not be decoded"):
            await provider.chat(ModelRequest(Operation.CHAT, provider.model, (UserMessage("hi"),)))


@pytest.mark.parametrize(
    ("wire", "streams"),
    [("gzip", "gzip"), ("deflate", "deflate"), ("deflate", "raw-deflate"), ("deflate", "mixed")],
)
async def test_a_body_of_several_streams_decodes_whole_at_every_split(wire: str, streams: str) -> None:
    """`BodyReader` over a real response, the body split in two at every position: the decoded
    bytes are the original whatever the split (a member boundary, a zlib header, a gzip trailer
    cut anywhere)."""
    original = b"".join(b"event %d: " % n + bytes(range(n, 40)) + b"\n" for n in range(3))
    forms = ["deflate", "raw-deflate", "deflate"] if streams == "mixed" else [streams] * 3
    third = len(original) // 3
    parts = [original[:third], original[third : 2 * third], original[2 * third :]]
    data = b"".join(encoded(part, form) for part, form in zip(parts, forms, strict=True))
    responses = [Scripted(200, [("content-encoding", wire)], [data[:cut], data[cut:]]) for cut in range(1, len(data))]
    async with open_fake_server(queue_handler(*responses)) as server, httpx.AsyncClient() as client:
        for cut in range(1, len(data)):
            async with client.stream("GET", server.url) as response:
                decoded = b"".join([piece async for piece in BodyReader(response, len(original))])
            assert decoded == original, cut


# -- compressed bytes that decode to nothing --------------------------------------------------------

_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
_EMPTY_STORED_BLOCK = b"\x00\x00\x00\xff\xff"  # a non-final stored block of no bytes (a sync flush)
EMPTY_OUTPUT = {
    # (content-encoding, what starts the body, what repeats in it)
    "gzip-empty-blocks": ("gzip", _GZIP_HEADER, _EMPTY_STORED_BLOCK),
    "raw-deflate-empty-blocks": ("deflate", b"", _EMPTY_STORED_BLOCK),
    "zlib-empty-blocks": ("deflate", b"\x78\x9c", _EMPTY_STORED_BLOCK),
    "empty-gzip-members": ("gzip", b"", encoded(b"", "gzip")),
    "zero-padding": ("gzip", encoded(b"", "gzip"), b"\0" * 64),
}


def endless(start: bytes, repeated: bytes) -> list[bytes | Gate]:
    """A body of *start*, then *repeated* over and over in 16 KiB reads (256 KiB), then nothing
    more, the response left open: only a timeout would end it."""
    piece = repeated * (16 * 1024 // len(repeated))
    return [start, *([piece] * 16), Gate(trio.Event())]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("operation", [Operation.CHAT, Operation.STREAM])
@pytest.mark.parametrize("shape", list(EMPTY_OUTPUT))
async def test_compressed_bytes_that_decode_to_nothing_count_against_max_response_bytes(
    kind: str, operation: Operation, shape: str
) -> None:
    """Only decoded bytes were counted: empty deflate blocks, empty gzip members or zero padding
    between members decode to nothing, so a hostile server could send them for ever (a stream's
    idle timeout never fires while bytes arrive). The compressed bytes count as well: past twice
    ``max_response_bytes`` plus 64 KiB, the call fails as for a body too large."""
    coding, start, repeated = EMPTY_OUTPUT[shape]
    content_type = "application/json" if operation is Operation.CHAT else "text/event-stream"
    scripted = Scripted(200, [("content-type", content_type), ("content-encoding", coding)], endless(start, repeated))
    async with (
        open_fake_server(queue_handler(scripted)) as server,
        make_provider(kind, server.url, max_response_bytes=2048, timeout=30, stream_idle_timeout=30) as provider,
    ):
        with trio.fail_after(20), pytest.raises(MalformedResponseError, match="larger than max_response_bytes=2048"):
            if operation is Operation.CHAT:
                await provider.chat(ModelRequest(operation, provider.model, (UserMessage("hi"),)))
            else:
                await collect(provider)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_error_body_that_decodes_to_nothing_is_read_no_further(kind: str) -> None:
    """An error response's body is read for its message only: compressed bytes that decode to
    nothing stop its reading past their bound, and the status decides the error, as for any
    error body that cannot be read whole (a 429 keeps its retry-after)."""
    coding, start, repeated = EMPTY_OUTPUT["gzip-empty-blocks"]
    headers = [("content-type", "application/json"), ("content-encoding", coding), ("retry-after", "7")]
    scripted = Scripted(429, headers, endless(start, repeated))
    async with (
        open_fake_server(queue_handler(scripted)) as server,
        make_provider(kind, server.url, timeout=30) as provider,
    ):
        with trio.fail_after(20), pytest.raises(RateLimitError) as caught:
            await provider.chat(ModelRequest(Operation.CHAT, provider.model, (UserMessage("hi"),)))
    assert caught.value.retry_after == 7.0


# -- a client whose transport read the body (httpx.MockTransport): what httpx decoded is the body --


def mocked(kind: str, respond: Any, **settings: Any) -> Provider:
    client = httpx.AsyncClient(transport=httpx.MockTransport(respond))
    if kind == "openai":
        return OpenAIProvider("gpt", api_key="k", base_url="http://mocked/v1", client=client, **settings)
    return AnthropicProvider("claude", api_key="k", base_url="http://mocked", client=client, **settings)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("coding", ["identity", "gzip"])
async def test_a_chat_body_the_transport_already_read_is_the_reply(kind: str, coding: str) -> None:
    plain = json.dumps(CHAT_BODIES[kind]).encode()
    body = plain if coding == "identity" else gzip.compress(plain)
    headers = {"content-type": "application/json"} | ({} if coding == "identity" else {"content-encoding": "gzip"})
    provider = mocked(kind, lambda request: httpx.Response(200, content=body, headers=headers))
    response = await provider.chat(ModelRequest(Operation.CHAT, provider.model, (UserMessage("hi"),)))
    assert response.message.text == "Hi"


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("coding", ["identity", "gzip"])
async def test_a_body_the_transport_already_read_is_the_reply(kind: str, coding: str) -> None:
    body = REPLIES[kind] if coding == "identity" else gzip.compress(REPLIES[kind])
    headers = {"content-type": "text/event-stream"} | ({} if coding == "identity" else {"content-encoding": "gzip"})
    provider = mocked(kind, lambda request: httpx.Response(200, content=body, headers=headers))
    assert await collect(provider) == FINISHED[kind]


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_body_the_transport_already_read_is_bounded_as_any(kind: str) -> None:
    body = b": " + b"x" * 4096 + b"\n\n" + REPLIES[kind]
    provider = mocked(
        kind,
        lambda request: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"}),
        max_response_bytes=1024,
    )
    with pytest.raises(MalformedResponseError, match="max_response_bytes"):
        await collect(provider)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_an_error_body_the_transport_already_read_names_the_error(kind: str) -> None:
    body = json.dumps(error_body(kind)).encode()
    provider = mocked(
        kind,
        lambda request: httpx.Response(429, content=body, headers={"retry-after": "7"}),
    )
    with pytest.raises(RateLimitError) as caught:
        await collect(provider)
    assert caught.value.retry_after == 7
