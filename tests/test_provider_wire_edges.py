"""Edges of the HTTP providers' wire handling, run for real against the local fake server: a
wait hint that cannot be read, credentials and headers that HTTP cannot carry, and compressed
bodies however the network splits them or however many gzip members they hold."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fake_server import Scripted, open_fake_server, queue_handler
from tests.test_provider_wire import make_provider
from trio_agent import ProviderError, RateLimitError
from trio_agent.models import ModelResponse, ModelService, RetryEvent, RetryPolicy, UserMessage

KINDS = ["openai", "anthropic"]
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
