"""What both HTTP providers share on the wire, run for real against the local fake server: a
reply is read the same however the network splits it, decoding never starves the Trio loop, and
credentials in a ``base_url`` are sent, never shown."""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import trio

from tests.fake_server import Scripted, gzip_bomb, open_fake_server, queue_handler
from trio_agent._models._http import _DECODE_STEP, BodyReader
from trio_agent._models._service import ModelRequest
from trio_agent.models import (
    AnthropicProvider,
    FinishChunk,
    FinishReason,
    ModelConnectionError,
    ModelService,
    OpenAIProvider,
    Operation,
    ProviderConfigError,
    ProviderServerError,
    StreamChunk,
    StreamInterruptedError,
    TextDelta,
    Usage,
    UsageChunk,
    UserMessage,
)

Provider = OpenAIProvider | AnthropicProvider
SECRET = "s3cret-token"


def openai_event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    payload = {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(payload)}\n\n".encode()


def anthropic_event(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


OPENAI_REPLY = openai_event({"content": "Hi"}) + openai_event({}, "stop")
ANTHROPIC_EVENTS = [
    anthropic_event(payload)
    for payload in [
        {"type": "message_start", "message": {"usage": {"input_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
        {"type": "message_stop"},
    ]
]
ANTHROPIC_REPLY = b"".join(ANTHROPIC_EVENTS)
FINISHED = {
    "openai": [TextDelta("Hi"), FinishChunk(FinishReason.STOP)],
    "anthropic": [TextDelta("Hi"), UsageChunk(Usage(1, 1, 2)), FinishChunk(FinishReason.STOP)],
}
LIMIT = 2048


def make_provider(kind: str, url: str, **settings: Any) -> Provider:
    if kind == "openai":
        return OpenAIProvider("gpt", api_key="k", base_url=url + "/v1", **settings)
    return AnthropicProvider("claude", api_key="k", base_url=url, **settings)


async def collect(provider: Provider) -> list[StreamChunk]:
    chunks: list[StreamChunk] = []
    stream = provider.stream(ModelRequest(Operation.STREAM, provider.model, (UserMessage("hi"),)))
    try:
        async for chunk in stream:
            chunks.append(chunk)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return chunks


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize(
    "junk",
    [b"data: \xff\xfe not UTF-8\n\n", b"data: " + b"x" * 2 * LIMIT],
    ids=["not-utf8", "over-the-bound"],
)
@pytest.mark.parametrize("together", [True, False], ids=["one-piece", "two-pieces"])
async def test_a_finished_reply_then_junk_is_finished_however_the_network_splits_it(
    kind: str, junk: bytes, together: bool
) -> None:
    """A complete reply then an unreadable line (not UTF-8, or past max_response_bytes): when both
    came in one network read the parser dropped the reply's events with the line, and the call
    failed as malformed; in two reads it was a finished reply. It is finished either way."""
    reply = OPENAI_REPLY if kind == "openai" else ANTHROPIC_REPLY
    pieces = [reply + junk] if together else [reply, junk]
    async with (
        open_fake_server(queue_handler(Scripted.sse(pieces))) as server,
        make_provider(kind, server.url, max_response_bytes=LIMIT) as provider,
    ):
        assert await collect(provider) == FINISHED[kind]


async def test_decoding_input_already_received_lets_other_tasks_run() -> None:
    """16 KiB of gzip on the wire is 16 MiB decoded: all of it came in a read or two, and was
    decoded (and parsed, by a stream's reader) without a checkpoint, freezing every other task
    of the process. A task that notes the bytes read each time it runs shows a checkpoint is
    reached every `_DECODE_STEP` decoded bytes (at most two steps can pass between its turns)."""
    size = 16 * 2**20
    body = gzip_bomb(size // 2**20)
    scripted = Scripted(200, [("content-type", "text/event-stream"), ("content-encoding", "gzip")], [body])
    decoded = 0
    seen: list[int] = []

    async def note_progress() -> None:
        while True:
            await trio.lowlevel.checkpoint()
            seen.append(decoded)

    async with (
        open_fake_server(queue_handler(scripted)) as server,
        httpx.AsyncClient() as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(note_progress)
        async with client.stream("GET", server.url, headers={"accept-encoding": "gzip"}) as response:
            async for piece in BodyReader(response, size):
                decoded += len(piece)
        nursery.cancel_scope.cancel()
    assert decoded == size
    gaps = [later - earlier for earlier, later in zip([0, *seen], [*seen, decoded], strict=True)]
    assert max(gaps) <= 4 * _DECODE_STEP, max(gaps)


# -- credentials in base_url ------------------------------------------------------------------------


def assert_hidden(texts: Sequence[str]) -> None:
    for text in texts:
        assert SECRET not in text and "alice" not in text, text
        assert "***@127.0.0.1" in text or "***@h" in text, text


def with_userinfo(url: str) -> str:
    return url.replace("http://", f"http://alice:{SECRET}@")


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_credentials_in_base_url_are_sent_but_never_shown(kind: str) -> None:
    """``http://alice:token@gateway/v1`` (httpx sends the userinfo as Basic auth) was shown whole in
    the provider's repr and in the OpenAI provider's error messages, so in logs, journals and
    StreamInterruptedError texts. The userinfo shows as ``***``; the request still carries it."""
    # The reply's first text published, then the connection dropped: a StreamInterruptedError.
    published = openai_event({"content": "Hi"}) if kind == "openai" else b"".join(ANTHROPIC_EVENTS[:3])
    cut = Scripted.sse([published], cut=True)
    failed = Scripted.json({"error": {"message": "down", "type": "server_error"}}, status=500)
    texts: list[str] = []
    async with (
        open_fake_server(queue_handler(failed, cut)) as server,
        make_provider(kind, with_userinfo(server.url)) as provider,
    ):
        texts.append(repr(provider))
        with pytest.raises(ProviderServerError) as http_error:
            await collect(provider)
        with pytest.raises(StreamInterruptedError) as interrupted:
            async with ModelService(provider).stream([UserMessage("hi")]) as stream:
                async for _ in stream:
                    pass
    texts += [str(http_error.value), str(interrupted.value)]
    if kind == "openai":
        assert_hidden(texts)
        assert "/v1/chat/completions" in str(http_error.value)
    else:
        assert_hidden(texts[:1])
        assert not any(SECRET in text for text in texts)
    sent = server.requests[0]
    assert sent.headers["authorization"] == "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_credentials_in_an_unreachable_or_invalid_base_url_are_not_shown(kind: str) -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with make_provider(kind, with_userinfo(f"http://127.0.0.1:{port}")) as provider:
        with pytest.raises(ModelConnectionError) as refused:
            await collect(provider)
    assert SECRET not in str(refused.value)
    if kind == "openai":
        assert_hidden([str(refused.value)])
    for invalid in (f"ftp://alice:{SECRET}@h/v1", f"http://alice:{SECRET}@h/v1?x=1"):
        with pytest.raises(ProviderConfigError) as config_error:
            if kind == "openai":
                OpenAIProvider("gpt", api_key="k", base_url=invalid)
            else:
                AnthropicProvider("claude", api_key="k", base_url=invalid)
        assert_hidden([str(config_error.value)])
