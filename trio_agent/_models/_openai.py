"""The OpenAI-compatible Chat Completions provider, over httpx (streams read with our bounded SSE parser).

Works with OpenAI and every server that speaks ``POST {base_url}/chat/completions``
(vLLM, Ollama, llama.cpp server, LM Studio, OpenRouter, ...). The provider never
retries: it maps each failure to one typed `ModelError` and the `ModelService`
retry loop decides. The provider owns the HTTP client it creates (use it as
``async with OpenAIProvider(...) as provider``) and never closes one it was given.

Streams are async generators that hold no cancel scope or nursery across a
``yield``: the HTTP response is opened with ``async with client.stream(...)``
inside the generator, so ``aclose()`` (or a cancellation) closes it before it returns.

Lenient where a server is lenient, bounded where it is hostile (see ``docs/providers.md``):
a reply that is complete and unambiguous is accepted (no ``finish_reason``, list-shaped
``content``, an empty tool-call id); a line, an event or a body over ``max_response_bytes``,
and a connection held open after the reply ended, are bounded.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType
from typing import Any, NoReturn

import httpx
import trio

from .._cleanup import DEFAULT_CLEANUP_GRACE, validate_cleanup_grace
from .._config import validate_limit, validate_timeout
from .._errors import (
    AuthenticationError,
    MalformedResponseError,
    ModelConnectionError,
    ModelError,
    ModelNotFoundError,
    ModelTimeoutError,
    ProviderConfigError,
    ProviderError,
    ProviderServerError,
    RateLimitError,
)
from .._util import safe_repr
from ._assemble import DeltaMender
from ._http import (
    ACCEPT_ENCODING,
    MAX_TOKEN_COUNT,
    BodyReader,
    SSEParser,
    SSEReader,
    checked_api_key,
    checked_base_url,
    checked_headers,
    checked_key_text,
    json_body,
    load_json,
    read_body,
    read_error_body,
    redacted_url,
    release_response,
    retry_after_seconds,
    stop_sequences,
    unsent_request_error,
)
from ._messages import (
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
)
from ._service import ModelRequest

__all__ = ["DEFAULT_OPENAI_BASE_URL", "OpenAIProvider"]

DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1"
# After a finish_reason without usage, how long the stream waits for the usage report or `[DONE]`
# (a server that ignores include_usage and holds the connection open costs this, not the idle timeout).
_TRAILER_SECONDS = 1.0
_LAYER = "openai response close"

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,  # the deprecated functions API
    "content_filter": FinishReason.CONTENT_FILTER,
}

# The largest tool-call index a stream may use: the bound `ModelService` holds a chunk's index to
# (a JSON number exact everywhere), so a larger one is this server's malformed reply, not our bug.
_MAX_CALL_INDEX = MAX_TOKEN_COUNT

# Keys of the request body the provider sets itself; ``request.options`` may not set them.
_RESERVED_OPTIONS = ("model", "messages", "tools", "stream")

# Error ``type`` / ``code`` values (OpenAI and common compatible servers) -> error class.
_AUTH_KINDS = frozenset(
    {"invalid_api_key", "authentication_error", "permission_error", "insufficient_permissions", "unauthorized"}
)
_NOT_FOUND_KINDS = frozenset({"model_not_found", "not_found_error", "notfounderror"})
_RATE_LIMIT_KINDS = frozenset({"rate_limit_exceeded", "rate_limit_error", "ratelimiterror", "insufficient_quota"})
_SERVER_KINDS = frozenset(
    {"server_error", "internal_error", "internal_server_error", "api_error", "overloaded_error", "service_unavailable"}
)


class _ClientSlot:
    """The HTTP client shared by a provider and the providers `OpenAIProvider.with_model` made from it."""

    __slots__ = ("client",)

    def __init__(self, client: httpx.AsyncClient | None) -> None:
        self.client = client


class OpenAIProvider:
    """A `Provider` for OpenAI-compatible Chat Completions servers.

    Args:
        model: the model name sent as ``model``.
        api_key: the bearer token; default ``OPENAI_API_KEY`` (required: local servers
            that ignore it accept any value).
        base_url: the API root, ending before ``/chat/completions``; default
            ``OPENAI_BASE_URL``, else ``https://api.openai.com/v1``.
        client: an ``httpx.AsyncClient`` to use; it is never closed by the provider.
            Without one, use the provider as ``async with OpenAIProvider(...) as provider``:
            it opens its own client there and closes it on exit.
        timeout: seconds for connecting, writing, waiting for a free connection and,
            for ``chat``, waiting for the response (each phase on its own).
        stream_idle_timeout: seconds a stream may go without receiving a byte
            (the HTTP read timeout of streaming requests).
        max_response_bytes: the largest body accepted: a non-streaming body, a whole stream, and
            so each SSE event (or line) of a stream.
        extra_headers: headers added to every request (e.g. OpenRouter's ``HTTP-Referer``).
        cleanup_grace: seconds closing a response may take (shielded) before it is abandoned
            with a WARNING on the ``trio_agent`` logger.
    """

    name = "openai"

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        client: httpx.AsyncClient | None = None,
        timeout: float = 600.0,
        stream_idle_timeout: float = 300.0,
        max_response_bytes: int = 32 * 2**20,
        extra_headers: Mapping[str, str] | None = None,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ProviderConfigError(f"the OpenAI model must be a non-empty string, got {model!r}")
        checked_api_key(api_key, provider="OpenAI")
        source = "api_key"
        if api_key is None:
            api_key = os.environ.get("OPENAI_API_KEY")
            source = "the OPENAI_API_KEY environment variable"
        if not api_key:
            raise ProviderConfigError(
                "no API key for the OpenAI provider: set the OPENAI_API_KEY environment variable or pass "
                "api_key= (local OpenAI-compatible servers accept any value)"
            )
        checked_key_text(api_key, provider="OpenAI", source=source)
        extra = checked_headers(extra_headers, provider="OpenAI")
        from_env = base_url is None
        if base_url is None:
            base_url = os.environ.get("OPENAI_BASE_URL") or DEFAULT_OPENAI_BASE_URL
        self.model = model
        self.base_url = _validate_base_url(base_url, from_env=from_env)
        self.timeout = validate_timeout(timeout, name="timeout")
        self.stream_idle_timeout = validate_timeout(stream_idle_timeout, name="stream_idle_timeout")
        self.max_response_bytes = validate_limit(max_response_bytes, name="max_response_bytes")
        self.cleanup_grace = validate_cleanup_grace(cleanup_grace)
        self._api_key = api_key
        self._extra_headers = extra
        self._url = self.base_url + "/chat/completions"
        self._shown_url = redacted_url(self._url)  # for messages: credentials in the URL are not shown
        self._slot = _ClientSlot(client)
        self._owns_client = client is None

    def __repr__(self) -> str:
        return f"OpenAIProvider(model={self.model!r}, base_url={redacted_url(self.base_url)!r})"

    # -- client ownership ---------------------------------------------------------------

    async def __aenter__(self) -> OpenAIProvider:
        if self._owns_client and self._slot.client is None:
            self._slot.client = httpx.AsyncClient()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._owns_client and self._slot.client is not None:
            client, self._slot.client = self._slot.client, None
            await client.aclose()

    def with_model(self, model: str) -> OpenAIProvider:
        """A provider for *model* with the same settings, sharing (never owning) this one's HTTP client."""
        if not isinstance(model, str) or not model:
            raise ProviderConfigError(f"the OpenAI model must be a non-empty string, got {model!r}")
        clone = OpenAIProvider.__new__(OpenAIProvider)
        clone.__dict__.update(self.__dict__)
        clone.model = model
        clone._owns_client = False
        return clone

    def _client(self) -> httpx.AsyncClient:
        """The HTTP client, or a typed error without an open one (httpx would raise a bare
        RuntimeError for a given client its owner closed)."""
        client = self._slot.client
        if client is None or client.is_closed:
            state = "no open HTTP client" if client is None else "a closed HTTP client"
            raise ModelError(
                f"OpenAIProvider has {state}: use it as `async with OpenAIProvider(...) as provider` "
                "or pass an open client=httpx.AsyncClient(...)",
                code="provider_not_open",
            )
        return client

    # -- requests -----------------------------------------------------------------------

    def _headers(self, accept: str) -> dict[str, str]:
        return {
            "authorization": f"Bearer {self._api_key}",
            "content-type": "application/json",
            "accept": accept,
            "accept-encoding": ACCEPT_ENCODING,
            **self._extra_headers,
        }

    def _body(self, request: ModelRequest, *, stream: bool) -> bytes:
        options = dict(request.options)
        for key in _RESERVED_OPTIONS:
            if key in options:
                raise ModelError(
                    f"request option {key!r} is set by the OpenAI provider and cannot be overridden",
                    code="provider_reserved_option",
                )
        if options.get("stop") is not None:
            stop_sequences(options["stop"], option="stop")  # checked only: a string goes as a string
        stream_options = options.pop("stream_options", None)
        extra_body = options.pop("extra_body", None)
        output_schema = options.pop("output_schema", None)  # ours, not a Chat Completions field
        body: dict[str, Any] = {**options, "model": request.model, "messages": _messages(request.messages)}
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
        if output_schema is not None and options.get("response_format") is None:
            response_format = _response_format(output_schema)
            if response_format is not None:
                body["response_format"] = response_format
        if isinstance(extra_body, Mapping):
            body.update(extra_body)  # the escape hatch, as in the other providers: merged last
        if stream:
            body["stream"] = True
            extra = dict(stream_options) if isinstance(stream_options, Mapping) else {}
            body["stream_options"] = {**extra, "include_usage": True}
        try:
            return json_body(body)
        except (TypeError, ValueError) as exc:
            raise ModelError(f"the request body is not JSON-serialisable: {exc}", code="provider_bad_request") from exc

    async def chat(self, request: ModelRequest) -> ModelResponse:
        """One non-streaming completion: ``POST {base_url}/chat/completions``, bounded by ``timeout``."""
        client = self._client()
        content = self._body(request, stream=False)
        with trio.move_on_after(self.timeout):
            return await self._chat(client, content, request.model)
        raise ModelTimeoutError(
            f"the chat completion from {self._shown_url} took longer than timeout={self.timeout:g} s",
            code="model_request_timeout",
        )

    async def _chat(self, client: httpx.AsyncClient, content: bytes, model: str) -> ModelResponse:
        try:
            async with client.stream(
                "POST",
                self._url,
                content=content,
                headers=self._headers("application/json"),
                timeout=httpx.Timeout(self.timeout),
            ) as response:
                if not response.is_success:
                    raise await self._http_error(response)
                body = await read_body(response, self.max_response_bytes, grace=self.cleanup_grace, layer=_LAYER)
        except httpx.LocalProtocolError:
            raise unsent_request_error(self._shown_url) from None
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, streaming=False) from exc
        return _parse_completion(load_json(body, what="the chat completion", status=response.status_code), model)

    async def stream(self, request: ModelRequest) -> AsyncGenerator[StreamChunk, None]:
        """A streamed completion (SSE). ``aclose()`` closes the HTTP response before it returns.

        The stream ends at ``data: [DONE]``, or at a usage report in or after the finish_reason's
        event, whatever the connection does afterwards; after a finish_reason without usage it waits at
        most ``_TRAILER_SECONDS`` for the rest. A body that ends after the finish_reason is complete.
        """
        client = self._client()
        content = self._body(request, stream=True)
        assembler = _StreamAssembler()
        try:
            async with client.stream(
                "POST",
                self._url,
                content=content,
                headers=self._headers("text/event-stream"),
                timeout=httpx.Timeout(self.timeout, read=self.stream_idle_timeout),
            ) as response:
                if not response.is_success:
                    raise await self._http_error(response)
                content_type = response.headers.get("content-type", "")
                if "text/event-stream" not in content_type.lower():
                    body = await read_body(response, self.max_response_bytes, grace=self.cleanup_grace, layer=_LAYER)
                    _raise_for_body(body)
                    raise MalformedResponseError(
                        f"expected a text/event-stream response, got {content_type or 'no content-type'!r}; "
                        f"body starts {_preview(body)}",
                        status=response.status_code,
                    )
                body_reader = BodyReader(response, self.max_response_bytes)
                what = "the chat completion stream"
                # The whole stream is bounded too: a server that never ends its reply must not grow
                # the reply (kept by the consumer, and the tool calls here) without bound.
                limit = self.max_response_bytes
                reader = SSEReader(body_reader, SSEParser(limit, what=what), what=what, max_total_bytes=limit)
                try:
                    while assembler.finish is None and not assembler.ended:
                        event = await reader.next()
                        if event is None:
                            break
                        for chunk in assembler.feed(event.event, event.data):
                            yield chunk
                    if reader.json_body is not None:
                        _raise_for_body(reader.json_body)
                        raise MalformedResponseError(
                            f"expected server-sent events, got a JSON body starting {_preview(reader.json_body)}",
                            status=response.status_code,
                        )
                    tail: list[StreamChunk] = []
                    if assembler.finish is not None and not assembler.ended and not reader.eof:
                        # No yield in here, so the scope is never held across one.
                        with trio.move_on_after(_TRAILER_SECONDS):
                            try:
                                while not assembler.ended and (event := await reader.next()) is not None:
                                    tail += assembler.feed(event.event, event.data)
                            except (httpx.TransportError, MalformedResponseError, ProviderError):
                                # The answer is complete: the finish_reason ends the generation, and
                                # after it the wire format has only the usage report and `[DONE]`. A
                                # broken connection, an unreadable event or an error event there
                                # changes nothing (the usage it might have carried is lost).
                                pass
                    if not assembler.ended and assembler.finish is None:
                        raise ModelConnectionError("the chat completion stream ended before `data: [DONE]`")
                    tail += assembler.done()
                    for chunk in tail:
                        yield chunk
                finally:
                    await release_response(
                        response, body_reader.raw, grace=self.cleanup_grace, layer=_LAYER, finished=assembler.ended
                    )
        except httpx.LocalProtocolError:
            raise unsent_request_error(self._shown_url) from None
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, streaming=True) from exc

    # -- errors -------------------------------------------------------------------------

    async def _http_error(self, response: httpx.Response) -> ProviderError:
        """The typed error for a non-2xx response (its body read up to a small bound)."""
        body = await read_error_body(response, grace=self.cleanup_grace, layer=_LAYER)
        status = response.status_code
        message, kind = _error_details(body)
        text = f"HTTP {status} from {self._shown_url}"
        if kind:
            text += f" ({kind})"
        text += f": {message or response.reason_phrase or 'no error message'}"
        request_id = response.headers.get("x-request-id")
        if request_id:
            text += f" [request id {request_id}]"
        if status in (401, 403):
            return AuthenticationError(text, status=status)
        if status == 404:
            return ModelNotFoundError(f"{text} (model {self.model!r})", status=status)
        # Every retryable status carries the server's wait hint: a 503 sends its retry-after as a
        # 429 does, and the retry loop should wait that long.
        if status == 429:
            error = RateLimitError(text, status=status, retry_after=retry_after_seconds(response.headers))
            if kind == "insufficient_quota":
                error.retryable = False  # an exhausted quota does not come back by waiting
            return error
        if status >= 500:
            return ProviderServerError(text, status=status, retry_after=retry_after_seconds(response.headers))
        if status in (408, 409):
            return ProviderError(text, status=status, retryable=True, retry_after=retry_after_seconds(response.headers))
        return ProviderError(text, status=status)

    def _transport_error(self, exc: httpx.HTTPError, *, streaming: bool) -> ModelError:
        if isinstance(exc, httpx.TimeoutException):
            if streaming and isinstance(exc, httpx.ReadTimeout):
                return ModelTimeoutError(
                    f"the stream from {self._shown_url} sent nothing for {self.stream_idle_timeout:g} s "
                    "(stream_idle_timeout)",
                    code="model_stream_idle_timeout",
                )
            return ModelTimeoutError(
                f"the request to {self._shown_url} timed out ({type(exc).__name__}, timeout={self.timeout:g} s)",
                code="model_request_timeout",
                retryable=isinstance(exc, httpx.ConnectTimeout),
            )
        if isinstance(exc, httpx.DecodingError):
            return MalformedResponseError(f"cannot decode the response from {self._shown_url}: {exc}")
        return ModelConnectionError(f"the connection to {self._shown_url} failed: {type(exc).__name__}: {exc}")


# -- configuration ---------------------------------------------------------------------------


def _validate_base_url(base_url: str, *, from_env: bool) -> str:
    source = "OPENAI_BASE_URL" if from_env and base_url != DEFAULT_OPENAI_BASE_URL else "base_url"
    return checked_base_url(base_url, provider="OpenAI", source=source, example=DEFAULT_OPENAI_BASE_URL)


# -- request mapping ---------------------------------------------------------------------------


def _messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    mapped: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            mapped.append({"role": "system", "content": message.content})
        elif isinstance(message, UserMessage):
            mapped.append({"role": "user", "content": message.content})
        elif isinstance(message, AssistantMessage):
            # Reasoning parts are dropped: Chat Completions takes no reasoning input.
            calls = message.tool_calls
            text = message.text
            entry: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                entry["tool_calls"] = [
                    {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                    for call in calls
                ]
            mapped.append(entry)
        elif isinstance(message, ToolResultMessage):
            mapped.append({"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content})
        else:  # pragma: no cover - the Message union is closed
            raise ModelError(f"cannot send message {message!r} to an OpenAI-compatible server")
    return mapped


STRUCTURED_OUTPUT_NAME = "structured_output"
"""``response_format.json_schema.name`` of a request with the ``output_schema`` option."""


def _response_format(schema: object) -> dict[str, Any] | None:
    """The ``response_format`` for the ``output_schema`` option: Structured Outputs' ``json_schema``
    for a schema whose root is an object (the only root OpenAI takes there), ``None`` for any other
    (the request's prompt carries it, as for every provider). Not strict: strict mode takes a
    subset of JSON Schema (every property required, ``additionalProperties: false``) and refuses
    any other schema with HTTP 400, and the answer is checked against the schema anyway."""
    if not isinstance(schema, Mapping):
        raise ModelError(
            f"request option 'output_schema' must be a JSON Schema object (a mapping), got {safe_repr(schema)}",
            code="provider_bad_option",
        )
    if schema.get("type") != "object":
        return None
    return {
        "type": "json_schema",
        "json_schema": {"name": STRUCTURED_OUTPUT_NAME, "schema": dict(schema), "strict": False},
    }


def _tool(spec: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": spec.name, "description": spec.description, "parameters": spec.parameters},
    }


# -- response parsing ----------------------------------------------------------------------------


def _malformed(what: str) -> NoReturn:
    raise MalformedResponseError(f"malformed chat completion: {what}")


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        _malformed(f"missing {where}")
    if not isinstance(value, dict):
        _malformed(f"{where} must be an object, got {type(value).__name__}")
    return value


def _optional_str(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    _malformed(f"{where} must be a string, got {type(value).__name__}")


def _required_str(value: Any, where: str) -> str:
    text = _optional_str(value, where)
    if not text:
        _malformed(f"missing {where}")
    return text


def _optional_int(container: dict[str, Any], key: str, where: str) -> int | None:
    """A token count: an integer from 0 to `MAX_TOKEN_COUNT`, else malformed (``None`` when absent)."""
    value = container.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        _malformed(f"{where}.{key} must be an integer, got {value!r}")
    if not 0 <= value <= MAX_TOKEN_COUNT:
        _malformed(f"{where}.{key} must be a token count from 0 to {MAX_TOKEN_COUNT}, got {value}")
    return value


def _required_int(container: dict[str, Any], key: str, where: str) -> int:
    value = _optional_int(container, key, where)
    if value is None:
        _malformed(f"missing {where}.{key}")
    return value


def _arguments(value: Any, where: str) -> str:
    """Tool-call arguments exactly as the model produced them (invalid JSON passes through)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # a few compatible servers send an object instead of JSON text
        return json.dumps(value, ensure_ascii=False)
    _malformed(f"{where} must be a string, got {type(value).__name__}")


def _finish_reason(value: Any, where: str) -> FinishReason | None:
    """The mapped finish_reason; ``None`` when absent or empty (Snowflake Cortex, some OpenRouter
    hosts), for the caller to decide from the reply itself."""
    if value is None or value == "":
        return None
    reason = _FINISH_REASONS.get(value) if isinstance(value, str) else None
    if reason is None:
        _malformed(f"unknown {where} {value!r}")
    return reason


def _inferred_finish(has_tool_calls: bool, has_text: bool, where: str) -> FinishReason:
    """A reply without a finish_reason is finished if it has tool calls or text; empty, it is ambiguous."""
    if has_tool_calls:
        return FinishReason.TOOL_CALLS
    if has_text:
        return FinishReason.STOP
    _malformed(f"missing {where} (and no content or tool calls to finish from)")


def _tool_call_id(value: Any, where: str) -> str:
    """A tool-call id; an empty one (Gemini) passes through as is, for the message assembler to name."""
    if not isinstance(value, str):
        _malformed(f"missing {where}" if value is None else f"{where} must be a string, got {type(value).__name__}")
    return value


def _content_pieces(value: Any, where: str) -> list[tuple[bool, str]]:
    """``(is_reasoning, text)`` pieces of a ``content`` field: a string, or Mistral's list of chunks
    (``{"type": "text", "text"}`` and ``{"type": "thinking", "thinking": [text chunks]}``).
    Chunk types with no place in our model (images, references, ...) are skipped."""
    if value is None:
        return []
    if isinstance(value, str):
        return [(False, value)] if value else []
    if not isinstance(value, list):
        _malformed(f"{where} must be a string or a list, got {type(value).__name__}")
    pieces: list[tuple[bool, str]] = []
    for position, raw in enumerate(value):
        item = _object(raw, f"{where}[{position}]")
        kind = item.get("type")
        if kind == "text":
            text = _optional_str(item.get("text"), f"{where}[{position}].text")
            if text:
                pieces.append((False, text))
        elif kind == "thinking":
            thinking = item.get("thinking")
            inner = _content_pieces(thinking, f"{where}[{position}].thinking")
            pieces.extend((True, text) for _, text in inner)
    return pieces


def _parse_usage(value: Any, where: str) -> Usage:
    usage = _object(value, where)
    prompt = _required_int(usage, "prompt_tokens", where)
    completion = _required_int(usage, "completion_tokens", where)
    total = _optional_int(usage, "total_tokens", where)
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    cached = cache_write = reasoning = None
    if prompt_details is not None:
        details = _object(prompt_details, f"{where}.prompt_tokens_details")
        cached = _optional_int(details, "cached_tokens", f"{where}.prompt_tokens_details")
        cache_write = _optional_int(details, "cache_write_tokens", f"{where}.prompt_tokens_details")
    if completion_details is not None:
        details = _object(completion_details, f"{where}.completion_tokens_details")
        reasoning = _optional_int(details, "reasoning_tokens", f"{where}.completion_tokens_details")
    if total is None:
        # Their sum stands in for it, and is a count like any other: two counts each in range can
        # add up past the bound (which `ModelService` would refuse after the reply was published).
        total = prompt + completion
        if total > MAX_TOKEN_COUNT:
            _malformed(
                f"{where}.prompt_tokens + {where}.completion_tokens (the total_tokens left out) must be a "
                f"token count from 0 to {MAX_TOKEN_COUNT}, got {total}"
            )
    return Usage(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=total,
        cached_input_tokens=cached,
        cache_creation_input_tokens=cache_write,
        reasoning_tokens=reasoning,
    )


def _reasoning_text(container: dict[str, Any]) -> str | None:
    """Reasoning some compatible servers add (``reasoning_content``: vLLM, DeepSeek, llama.cpp;
    ``reasoning``: OpenRouter, Ollama)."""
    for key in ("reasoning_content", "reasoning"):
        value = container.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _parse_completion(payload: Any, model: str) -> ModelResponse:
    body = _object(payload, "response body")
    if body.get("error") is not None and body.get("choices") is None:
        _raise_error_payload(body, status=None)
    choices = body.get("choices")
    if not isinstance(choices, list):
        _malformed("missing choices" if choices is None else "choices must be a list")
    if not choices:
        _malformed("choices is empty")
    choice = _object(choices[0], "choices[0]")
    message = _object(choice.get("message"), "choices[0].message")
    parts: list[ContentPart] = []
    pieces = _content_pieces(message.get("content"), "choices[0].message.content")
    reasoning = _reasoning_text(message) or "".join(text for thought, text in pieces if thought)
    if reasoning:
        parts.append(ReasoningPart(reasoning))
    text = "".join(text for thought, text in pieces if not thought)
    refusal = _optional_str(message.get("refusal"), "choices[0].message.refusal")
    if text:
        parts.append(TextPart(text))
    elif refusal:
        parts.append(TextPart(refusal))
    raw_calls = message.get("tool_calls")
    if raw_calls is not None:
        if not isinstance(raw_calls, list):
            _malformed("choices[0].message.tool_calls must be a list")
        for position, raw in enumerate(raw_calls):
            where = f"choices[0].message.tool_calls[{position}]"
            call = _object(raw, where)
            function = _object(call.get("function"), f"{where}.function")
            parts.append(
                ToolCallPart(
                    _tool_call_id(call.get("id"), f"{where}.id"),
                    _required_str(function.get("name"), f"{where}.function.name"),
                    _arguments(function.get("arguments"), f"{where}.function.arguments"),
                )
            )
    where = "choices[0].finish_reason"
    reason = _finish_reason(choice.get("finish_reason"), where)
    if reason is None:
        reason = _inferred_finish(any(isinstance(part, ToolCallPart) for part in parts), bool(text or refusal), where)
    usage = Usage() if body.get("usage") is None else _parse_usage(body["usage"], "usage")
    return ModelResponse(
        AssistantMessage(parts),
        reason,
        usage,
        _optional_str(body.get("model"), "model") or model,
        _optional_str(body.get("id"), "id") or "",
    )


class _ToolCallState:
    __slots__ = ("arguments", "id", "index", "mender", "name")

    def __init__(self, index: int, id: str, name: str) -> None:
        self.index = index
        self.id = id
        self.name = name
        self.arguments: list[str] = []
        self.mender = DeltaMender()


class _StreamAssembler:
    """Turns ``chat.completion.chunk`` events into stream chunks; assembles tool-call arguments per index.

    Only choice 0 is read. Tool calls end (`ToolCallEnd`) when the finish_reason arrives (or at the
    end); usage is kept (the last report wins) and sent at the end, then the `FinishChunk`.
    ``ended``: the reply is over: ``[DONE]``, or a usage report in the finish_reason's event or
    after it (one before it is no final report: cumulative counts may still come).
    """

    def __init__(self) -> None:
        self.calls: dict[int, _ToolCallState] = {}
        # For deltas without an index: the call of each id (the latest with it) and the highest
        # index, kept as calls start (rebuilt on every delta, they made a stream quadratic).
        self.index_of_id: dict[str, int] = {}
        self.last_index = -1
        # The call each wire index now stands for: a server that sends every call with index 0
        # (Ollama, LiteLLM and other gateways) moves it to a fresh index for each new id.
        self.index_of_wire: dict[int, int] = {}
        # A surrogate pair split across two events ("\ud83d" then "\ude00") is joined, per channel.
        self.text = DeltaMender()
        self.reasoning = DeltaMender()
        self.calls_ended = False
        self.has_text = False
        self.finish: FinishReason | None = None
        self.usage: Usage | None = None
        self.ended = False

    def feed(self, event: str, data: str) -> list[StreamChunk]:
        if data.startswith("[DONE]"):
            self.ended = True
            return []
        if not data.strip():
            if event == "error":
                raise ProviderError("the stream sent an error event without details")
            return []  # an event without data, e.g. a ping
        payload = load_json(data, what="an SSE event")
        if not isinstance(payload, dict):
            _malformed(f"an SSE event must be a JSON object, got {data[:200]!r}")
        if event == "error" or payload.get("error") is not None:
            _raise_error_payload(payload, status=None)
        out: list[StreamChunk] = []
        reports_usage = payload.get("usage") is not None
        if reports_usage:
            self.usage = _parse_usage(payload["usage"], "usage")
        choices = payload.get("choices")
        if choices is not None:  # null in a usage-only chunk of some servers, instead of []
            if not isinstance(choices, list):
                _malformed("choices must be a list")
            for position, raw in enumerate(choices):
                choice = _object(raw, f"choices[{position}]")
                index = choice.get("index", 0)
                if index != 0:
                    continue  # n > 1: only the first choice is used
                self._choice(choice, out)
        if self.finish is not None and reports_usage:
            self.ended = True  # nothing of value can follow: only `[DONE]`
        return out

    def _choice(self, choice: dict[str, Any], out: list[StreamChunk]) -> None:
        delta = choice.get("delta")
        delta = {} if delta is None else _object(delta, "choices[0].delta")
        reasoning = _reasoning_text(delta)
        if reasoning is not None and (reasoning := self.reasoning.mend(reasoning)):
            out.append(ReasoningDelta(reasoning))
        for thought, text in _content_pieces(delta.get("content"), "choices[0].delta.content"):
            if thought:
                if text := self.reasoning.mend(text):
                    out.append(ReasoningDelta(text))
            else:
                self.has_text = True
                if text := self.text.mend(text):
                    out.append(TextDelta(text))
        refusal = _optional_str(delta.get("refusal"), "choices[0].delta.refusal")
        if refusal:
            self.has_text = True
            if refusal := self.text.mend(refusal):
                out.append(TextDelta(refusal))
        raw_calls = delta.get("tool_calls")
        if raw_calls is not None:
            if not isinstance(raw_calls, list):
                _malformed("choices[0].delta.tool_calls must be a list")
            for position, raw in enumerate(raw_calls):
                self._tool_call_delta(_object(raw, f"choices[0].delta.tool_calls[{position}]"), position, out)
        reason = _finish_reason(choice.get("finish_reason"), "choices[0].finish_reason")
        if reason is not None:
            self.finish = reason
            self._flush(out)
            self._end_calls(out)

    def _flush(self, out: list[StreamChunk]) -> None:
        """A high surrogate still held for its pair, which did not come, as U+FFFD."""
        if reasoning := self.reasoning.flush():
            out.append(ReasoningDelta(reasoning))
        if text := self.text.flush():
            out.append(TextDelta(text))

    def _tool_call_delta(self, call: dict[str, Any], position: int, out: list[StreamChunk]) -> None:
        where = f"choices[0].delta.tool_calls[{position}]"
        function = call.get("function")
        function = {} if function is None else _object(function, f"{where}.function")
        index = self._call_index(call, function, where)
        if isinstance(wire := call.get("index"), int):
            self.index_of_wire[wire] = index  # id-less deltas with this index continue this call
        state = self.calls.get(index)
        if state is None:
            if self.calls_ended:
                _malformed(f"tool call {index} started after the finish_reason")
            if index > _MAX_CALL_INDEX:  # the next free index after a call at the largest one
                _malformed(f"{where} starts a tool call past index {_MAX_CALL_INDEX}")
            state = _ToolCallState(
                index,
                _tool_call_id(call.get("id"), f"{where}.id (first delta of tool call {index})"),
                _required_str(function.get("name"), f"{where}.function.name (first delta of tool call {index})"),
            )
            self.calls[index] = state
            if state.id:
                self.index_of_id[state.id] = index
            self.last_index = max(self.last_index, index)
            out.append(ToolCallStart(index, state.id, state.name))
        elif self.calls_ended:
            _malformed(f"tool call {index} continued after the finish_reason")
        piece = _arguments(function.get("arguments"), f"{where}.function.arguments")
        if piece and (piece := state.mender.mend(piece)):
            state.arguments.append(piece)
            out.append(ToolCallDelta(index, piece))

    def _call_index(self, call: dict[str, Any], function: dict[str, Any], where: str) -> int:
        """The index of the call a tool-call delta belongs to (a new index: it starts one)."""
        call_id = call.get("id")
        wire = call.get("index")
        if wire is None:
            # Some compatible servers (Gemini) omit the index: a delta with a new id, or with an
            # empty id and a name, starts a call; one with a known id continues it; others the last.
            if isinstance(call_id, str) and call_id in self.index_of_id:
                return self.index_of_id[call_id]
            if not self.calls or (isinstance(call_id, str) and (call_id or function.get("name"))):
                return self.last_index + 1
            return self.last_index
        if isinstance(wire, bool) or not isinstance(wire, int) or not 0 <= wire <= _MAX_CALL_INDEX:
            _malformed(f"{where}.index must be an integer from 0 to {_MAX_CALL_INDEX}, got {safe_repr(wire)}")
        index = self.index_of_wire.get(wire, wire)
        state = self.calls.get(index)
        if state is not None and isinstance(call_id, str) and call_id and call_id != state.id:
            # A known index with another id: a new call (OpenAI sends the id only in a call's first
            # delta; servers that repeat it repeat the same one). Reused indexes move to a fresh one.
            return self.index_of_id.get(call_id, self.last_index + 1)
        return index

    def _end_calls(self, out: list[StreamChunk]) -> None:
        if self.calls_ended:
            return
        self.calls_ended = True
        for index in sorted(self.calls):
            state = self.calls[index]
            if held := state.mender.flush():
                state.arguments.append(held)
                out.append(ToolCallDelta(index, held))
            out.append(ToolCallEnd(index, state.id, state.name, "".join(state.arguments)))

    def done(self) -> list[StreamChunk]:
        reason = self.finish
        if reason is None:
            reason = _inferred_finish(bool(self.calls), self.has_text, "finish_reason in the stream")
        out: list[StreamChunk] = []
        self._flush(out)
        self._end_calls(out)
        if self.usage is not None:
            out.append(UsageChunk(self.usage))
        out.append(FinishChunk(reason))
        return out


# -- error bodies ------------------------------------------------------------------------------


def _preview(body: bytes) -> str:
    return repr(body[:200].decode("utf-8", "replace"))


def _error_details(body: bytes) -> tuple[str, str]:
    """(message, kind) from an error body: OpenAI's ``{"error": {"message", "type", "code"}}`` or a
    compatible server's variant (``{"error": "..."}``, ``{"detail": ...}``, ``{"message": ...}``)."""
    try:
        payload = load_json(body, what="the error body")
    except MalformedResponseError:
        return body[:500].decode("utf-8", "replace").strip(), ""
    return _payload_details(payload)


def _payload_details(payload: Any) -> tuple[str, str]:
    if not isinstance(payload, dict):
        return str(payload)[:500], ""
    error = payload.get("error", payload)
    if isinstance(error, str):
        return error, ""
    if not isinstance(error, dict):
        return str(error)[:500], ""
    message = error.get("message") or error.get("detail") or payload.get("detail") or ""
    code = error.get("code")
    kind = code if isinstance(code, str) and code else error.get("type")
    return (message if isinstance(message, str) else json.dumps(message)[:500]), (kind if isinstance(kind, str) else "")


def _raise_error_payload(payload: dict[str, Any], *, status: int | None) -> NoReturn:
    """Raise the typed error for an error object sent with a 2xx status (in a stream or a body)."""
    message, kind = _payload_details(payload)
    error = payload.get("error")
    if status is None and isinstance(error, dict):
        for key in ("status", "code"):
            value = error.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 400 <= value < 600:
                status = value  # e.g. vLLM: {"error": {"code": 500, ...}}
                break
    error_type = error.get("type") if isinstance(error, dict) else None
    kinds = {value.lower() for value in (kind, error_type) if isinstance(value, str) and value}
    text = f"the server sent an error{f' ({kind})' if kind else ''}: {message or 'no error message'}"
    if kinds & _RATE_LIMIT_KINDS or status == 429:
        rate_limited = RateLimitError(text, status=status)
        if "insufficient_quota" in kinds:
            rate_limited.retryable = False
        raise rate_limited
    if kinds & _AUTH_KINDS or status in (401, 403):
        raise AuthenticationError(text, status=status)
    if kinds & _NOT_FOUND_KINDS or status == 404:
        raise ModelNotFoundError(text, status=status)
    if kinds & _SERVER_KINDS or (status is not None and status >= 500):
        raise ProviderServerError(text, status=status)
    raise ProviderError(text, status=status)


def _raise_for_body(body: bytes) -> None:
    """If a non-SSE body (where SSE was expected) is an error object, raise it as a typed error."""
    try:
        payload = load_json(body, what="the body")
    except MalformedResponseError:
        return
    if isinstance(payload, dict) and payload.get("error") is not None:
        _raise_error_payload(payload, status=None)
