"""The Anthropic Messages provider: ``POST /v1/messages`` over httpx, streamed as server-sent events.

Mapping (see ``docs/providers-anthropic.md``):

* `SystemMessage` s become the top-level ``system`` (wherever they appear); consecutive
  messages of one role are merged into one turn, so consecutive `ToolResultMessage` s become
  one user turn of ``tool_result`` blocks (a user message right after them follows them).
* `ReasoningPart` s with a ``signature`` go back as ``thinking`` blocks and those with
  ``redacted_data`` as ``redacted_thinking`` blocks, unchanged; unsigned reasoning (from
  another provider) cannot be verified by Anthropic and is left out.
* `ToolCallPart` arguments are sent as the ``input`` object; arguments that are not a JSON
  object (invalid JSON from the model, or JSON a tool would refuse: non-finite numbers, nesting
  deeper than `MAX_ARGUMENT_DEPTH`) are sent as ``{}``, since the API accepts only objects.

The provider never retries: the `ModelService` retry loop owns retries. Errors are typed
(`ProviderError` and its subclasses, `ModelConnectionError`, `ModelTimeoutError`). A stream
ends at ``message_stop``, whatever the connection does afterwards.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, cast

import attrs
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
from ._assemble import DeltaMender, ToolArgumentsError, parse_tool_arguments, well_formed
from ._http import (
    ACCEPT_ENCODING,
    MAX_TOKEN_COUNT,
    BodyReader,
    SSEEvent,
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

__all__ = ["ANTHROPIC_VERSION", "API_KEY_ENV", "BASE_URL_ENV", "DEFAULT_BASE_URL", "AnthropicProvider"]

DEFAULT_BASE_URL: Final = "https://api.anthropic.com"
ANTHROPIC_VERSION: Final = "2023-06-01"
API_KEY_ENV: Final = "ANTHROPIC_API_KEY"
BASE_URL_ENV: Final = "ANTHROPIC_BASE_URL"

_LAYER: Final = "anthropic response close"

STOP_REASONS: Final[Mapping[str, FinishReason]] = {
    "end_turn": FinishReason.STOP,
    "stop_sequence": FinishReason.STOP,
    "max_tokens": FinishReason.LENGTH,
    "model_context_window_exceeded": FinishReason.LENGTH,
    "tool_use": FinishReason.TOOL_CALLS,
    "pause_turn": FinishReason.PAUSE_TURN,
    "refusal": FinishReason.REFUSAL,
}
"""Anthropic ``stop_reason`` -> `FinishReason`; any other value is a `MalformedResponseError`."""

# Anthropic error ``type`` -> our class, for an in-stream ``event: error`` (whose HTTP status was 200).
_ERROR_TYPES: Final[Mapping[str, type[ProviderError]]] = {
    "invalid_request_error": ProviderError,
    "authentication_error": AuthenticationError,
    "permission_error": AuthenticationError,
    "billing_error": ProviderError,
    "not_found_error": ModelNotFoundError,
    "request_too_large": ProviderError,
    "rate_limit_error": RateLimitError,
    "api_error": ProviderServerError,
    "timeout_error": ProviderServerError,
    "overloaded_error": ProviderServerError,
}


class AnthropicProvider:
    """The Anthropic Messages API as a `Provider`.

    Args:
        model: the model name, e.g. ``"claude-sonnet-4-5"``.
        api_key: the API key; ``None`` reads ``ANTHROPIC_API_KEY`` (missing: `ProviderConfigError`).
        base_url: the API root without ``/v1``; ``None`` reads ``ANTHROPIC_BASE_URL``, else
            ``https://api.anthropic.com``. Requests go to ``{base_url}/v1/messages``.
        client: an ``httpx.AsyncClient`` to use (never closed by the provider); ``None`` creates
            one that the provider owns and closes when its ``async with`` block exits.
        timeout: seconds for a whole non-streaming call, and for connecting / sending a streaming one.
        stream_idle_timeout: seconds a stream may stay silent before `ModelTimeoutError`
            (code ``model_stream_idle_timeout``).
        max_response_bytes: a response body (or a whole stream) larger than this is a
            `MalformedResponseError`.
        max_tokens: ``max_tokens`` when the request's options do not set it (the API requires it).
        extra_headers: headers added to every request (e.g. ``anthropic-beta``); they win over ours.
        cleanup_grace: seconds closing a response may take (shielded) before it is abandoned
            with a WARNING on the ``trio_agent`` logger.
    """

    name = "anthropic"

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
        max_tokens: int = 4096,
        extra_headers: Mapping[str, str] | None = None,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ProviderConfigError(f"the Anthropic model must be a non-empty string, got {model!r}")
        checked_api_key(api_key, provider="Anthropic")
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        if not key:
            raise ProviderConfigError(
                f"no Anthropic API key: pass api_key= or set the {API_KEY_ENV} environment variable"
            )
        source = "api_key" if api_key is not None else f"the {API_KEY_ENV} environment variable"
        checked_key_text(key, provider="Anthropic", source=source)
        extra = checked_headers(extra_headers, provider="Anthropic")
        self.model = model
        self.timeout = validate_timeout(timeout, name="timeout")
        self.stream_idle_timeout = validate_timeout(stream_idle_timeout, name="stream_idle_timeout")
        self.max_response_bytes = validate_limit(max_response_bytes, name="max_response_bytes")
        self.max_tokens = validate_limit(max_tokens, name="max_tokens")
        self.cleanup_grace = validate_cleanup_grace(cleanup_grace)
        self.base_url = _base_url(base_url)
        self._api_key = key
        self._url = self.base_url + "/v1/messages"
        self._extra_headers = extra
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(timeout=httpx.Timeout(self.timeout))

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client (owned only when the provider created it)."""
        return self._client

    @property
    def owns_client(self) -> bool:
        return self._owns_client

    def __repr__(self) -> str:
        return f"AnthropicProvider(model={self.model!r}, base_url={redacted_url(self.base_url)!r})"

    # -- resources ----------------------------------------------------------------------

    async def __aenter__(self) -> AnthropicProvider:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _open_client(self) -> httpx.AsyncClient:
        """The HTTP client, or a typed error once it is closed (httpx would raise a bare RuntimeError)."""
        if self._client.is_closed:
            raise ModelError(
                "AnthropicProvider's HTTP client is closed: use the provider inside its "
                "`async with AnthropicProvider(...) as provider` block (a provider made by with_model "
                "only while the one it came from is open), or pass an open client=httpx.AsyncClient(...)",
                code="provider_not_open",
            )
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP client if this provider created it; a given or shared client stays open."""
        if self._owns_client:
            await self._client.aclose()

    def with_model(self, model: str) -> AnthropicProvider:
        """The same configuration for *model*, sharing (not owning) this provider's HTTP client."""
        return AnthropicProvider(
            model,
            api_key=self._api_key,
            base_url=self.base_url,
            client=self._client,
            timeout=self.timeout,
            stream_idle_timeout=self.stream_idle_timeout,
            max_response_bytes=self.max_response_bytes,
            max_tokens=self.max_tokens,
            extra_headers=self._extra_headers,
            cleanup_grace=self.cleanup_grace,
        )

    # -- requests -------------------------------------------------------------------------

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {
            "x-api-key": self._api_key,
            "anthropic-version": ANTHROPIC_VERSION,
            "content-type": "application/json",
            "accept": accept,
            "accept-encoding": ACCEPT_ENCODING,
        }
        headers.update(self._extra_headers)
        return headers

    def _body(self, request: ModelRequest, *, stream: bool) -> bytes:
        payload = build_payload(request, default_max_tokens=self.max_tokens, stream=stream)
        try:
            return json_body(payload, compact=True)
        except (TypeError, ValueError) as exc:
            raise ModelError(
                f"the Anthropic request cannot be encoded as JSON: {exc}", code="model_request_invalid"
            ) from exc

    async def chat(self, request: ModelRequest) -> ModelResponse:
        """One non-streaming call; the whole call is bounded by ``timeout``."""
        client = self._open_client()
        body = self._body(request, stream=False)
        raw: bytes | None = None
        with trio.move_on_after(self.timeout):
            raw = await self._post(client, body)
        if raw is None:
            raise ModelTimeoutError(
                f"the Anthropic request exceeded its {self.timeout:g} s timeout", code="model_request_timeout"
            )
        return parse_message(load_json(raw, what="the Anthropic response"))

    async def _post(self, client: httpx.AsyncClient, body: bytes) -> bytes:
        try:
            async with client.stream(
                "POST",
                self._url,
                content=body,
                headers=self._headers("application/json"),
                timeout=httpx.Timeout(self.timeout),
            ) as response:
                await _raise_for_status(response, self.cleanup_grace)
                return await read_body(response, self.max_response_bytes, grace=self.cleanup_grace, layer=_LAYER)
        except httpx.TimeoutException as exc:
            raise _request_timeout(exc) from exc
        except httpx.LocalProtocolError:
            raise unsent_request_error("Anthropic") from None
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from exc

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        """A streaming call: an async generator whose ``aclose()`` closes the HTTP response."""
        return self._stream(request)

    async def _stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        # No nursery or cancel scope is held across a yield: `client.stream` is a plain
        # try/finally that closes the response when this generator is closed.
        client = self._open_client()
        body = self._body(request, stream=True)
        state = _StreamState()
        timeout = httpx.Timeout(self.timeout, read=self.stream_idle_timeout)
        try:
            async with client.stream(
                "POST", self._url, content=body, headers=self._headers("text/event-stream"), timeout=timeout
            ) as response:
                await _raise_for_status(response, self.cleanup_grace)
                await _check_event_stream(response, self.max_response_bytes, self.cleanup_grace)
                body_reader = BodyReader(response, self.max_response_bytes)
                what = "the Anthropic stream"
                limit = self.max_response_bytes
                reader = SSEReader(body_reader, SSEParser(limit, what=what), what=what, max_total_bytes=limit)
                try:
                    final: list[StreamChunk] = []
                    while (event := await reader.next()) is not None:
                        out = state.handle(event)
                        if state.finished:
                            final = out  # message_stop: read no further
                            break
                        for chunk in out:
                            yield chunk
                    if not state.finished:
                        if reader.json_body is not None:
                            raise _json_body_error(reader.json_body, "an event stream")
                        raise ModelConnectionError("the Anthropic stream ended before message_stop")
                    for chunk in final:
                        yield chunk
                finally:
                    await release_response(
                        response, body_reader.raw, grace=self.cleanup_grace, layer=_LAYER, finished=state.finished
                    )
        except httpx.ReadTimeout as exc:
            raise ModelTimeoutError(
                f"the Anthropic stream was idle for more than {self.stream_idle_timeout:g} s",
                code="model_stream_idle_timeout",
            ) from exc
        except httpx.TimeoutException as exc:
            raise _request_timeout(exc) from exc
        except httpx.LocalProtocolError:
            raise unsent_request_error("Anthropic") from None
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from exc


# -- configuration ----------------------------------------------------------------------------


def _base_url(base_url: str | None) -> str:
    source = "base_url"
    if base_url is None:
        env = os.environ.get(BASE_URL_ENV)
        if env:
            base_url, source = env, BASE_URL_ENV
        else:
            base_url = DEFAULT_BASE_URL
    return checked_base_url(base_url, provider="Anthropic", source=source, example=DEFAULT_BASE_URL)


# -- request mapping --------------------------------------------------------------------------


def build_payload(request: ModelRequest, *, default_max_tokens: int, stream: bool) -> dict[str, Any]:
    """The ``/v1/messages`` body for *request* (messages, tools and the supported options)."""
    system, messages = convert_messages(request.messages)
    options = request.options
    payload: dict[str, Any] = {
        "model": request.model,
        "max_tokens": options.get("max_tokens") or default_max_tokens,
        "messages": messages,
    }
    if system:
        payload["system"] = system[0] if len(system) == 1 else [{"type": "text", "text": text} for text in system]
    if request.tools:
        payload["tools"] = [convert_tool(tool) for tool in request.tools]
    payload.update(_convert_options(options, has_tools=bool(request.tools)))
    if stream:
        payload["stream"] = True
    extra = options.get("extra_body")
    if isinstance(extra, Mapping):
        payload.update(extra)
    return payload


def convert_tool(tool: ToolSpec) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": tool.name, "input_schema": tool.parameters}
    if tool.description:
        spec["description"] = tool.description
    return spec


def _convert_options(options: Mapping[str, Any], *, has_tools: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "metadata", "service_tier"):
        if options.get(key) is not None:
            out[key] = options[key]
    for key in ("stop_sequences", "stop"):
        if options.get(key) is not None:
            out["stop_sequences"] = stop_sequences(options[key], option=key)
            break
    thinking = options.get("thinking")
    if isinstance(thinking, bool):
        pass  # a bare flag carries no budget; give a dict or a budget in tokens
    elif isinstance(thinking, int):
        out["thinking"] = {"type": "enabled", "budget_tokens": thinking}
    elif isinstance(thinking, Mapping):
        out["thinking"] = dict(thinking)
    choice = options.get("tool_choice")
    tool_choice: dict[str, Any] | None = None
    if isinstance(choice, str):
        tool_choice = {"type": "any" if choice == "required" else choice}
    elif isinstance(choice, Mapping):
        tool_choice = dict(choice)
    if options.get("parallel_tool_calls") is False and has_tools:
        tool_choice = tool_choice or {"type": "auto"}
        tool_choice["disable_parallel_tool_use"] = True
    if tool_choice is not None:
        out["tool_choice"] = tool_choice
    return out


NO_CONTENT: Final = "(no content)"
"""Sent where Anthropic requires text and the history has none: a user turn whose messages are all
blank, and an error tool result without content."""


def _blank(text: str) -> bool:
    return not text or text.isspace()


def convert_messages(messages: Sequence[Message]) -> tuple[list[str], list[dict[str, Any]]]:
    """(system texts, Anthropic messages). Consecutive messages of one role become one turn.

    Anthropic refuses (HTTP 400) a text block that is empty or only whitespace, and an error
    ``tool_result`` without content; one such message in the history would fail every later
    request of the conversation. Blank texts are left out; a user turn left empty by that keeps
    its place with `NO_CONTENT` (dropping it would end the request on an assistant turn, which
    Anthropic continues as a prefill), and so does an error result's empty content. An assistant
    turn left empty is dropped: the user turns around it merge, as the API merges them.
    """
    system: list[str] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        elif blocks or role == "user":  # an emptied user turn keeps its place (filled below)
            turns.append({"role": role, "content": blocks})

    for message in messages:
        if isinstance(message, SystemMessage):
            if not _blank(message.content):
                system.append(message.content)
        elif isinstance(message, UserMessage):
            add("user", [] if _blank(message.content) else [{"type": "text", "text": message.content}])
        elif isinstance(message, ToolResultMessage):
            content = message.content
            if _blank(content):
                content = NO_CONTENT if message.is_error else ""
            add(
                "user",
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": _wire_id(message.tool_call_id),
                        "content": content,
                        "is_error": message.is_error,
                    }
                ],
            )
        elif isinstance(message, AssistantMessage):
            add("assistant", [block for part in message.parts if (block := _assistant_block(part)) is not None])
        else:  # pragma: no cover - the Message union is closed
            raise TypeError(f"not a message: {message!r}")
    for turn in turns:
        if not turn["content"]:
            turn["content"].append({"type": "text", "text": NO_CONTENT})
    return system, turns


def _assistant_block(part: ContentPart) -> dict[str, Any] | None:
    if isinstance(part, ReasoningPart):
        if part.redacted_data is not None:
            return {"type": "redacted_thinking", "data": part.redacted_data}
        if part.signature is not None:
            return {"type": "thinking", "thinking": part.text, "signature": part.signature}
        return None  # unsigned reasoning (another provider's): Anthropic would reject it
    if isinstance(part, TextPart):
        return None if _blank(part.text) else {"type": "text", "text": part.text}
    return {"type": "tool_use", "id": _wire_id(part.id), "name": part.name, "input": _tool_input(part.arguments)}


# Characters `_wire_id` rewrites: the ones Anthropic refuses, and ``-``, its escape character.
_WIRE_ID_ESCAPED = re.compile(r"[^A-Za-z0-9_]")


def _wire_id(call_id: str) -> str:
    """A call id as Anthropic accepts it (``^[a-zA-Z0-9_-]+$``), one-to-one.

    Ids from other providers may hold other characters, and the reply assembler marks a
    repeated id with ``~2``. ``-`` is the escape character: it becomes ``--``, and any other
    character Anthropic refuses becomes ``-<code point in hex>-``. Each character's code is
    read back unambiguously (``--`` or ``-`` + hex digits + ``-``, never starting alike), so
    distinct ids stay distinct and the same id always maps the same way. Ids of letters, digits
    and ``_`` (Anthropic's own ``toolu_...``, OpenAI's ``call_...``) are sent unchanged.
    """
    if not _WIRE_ID_ESCAPED.search(call_id):
        return call_id
    return _WIRE_ID_ESCAPED.sub(_escape_id_character, call_id)


def _escape_id_character(match: re.Match[str]) -> str:
    character = match.group()
    return "--" if character == "-" else f"-{ord(character):x}-"


def _tool_input(arguments: str) -> dict[str, Any]:
    """The ``input`` object for a tool call: its JSON arguments, or ``{}`` when they are not a JSON
    object that can be sent back.

    Parsed as a tool receives them (`parse_tool_arguments`): a number beyond a float (``1e999``),
    ``NaN`` or nesting too deep parse with plain ``json.loads`` but could never be encoded again
    (or overflow the stack), and every later request of the conversation would fail.
    """
    try:
        return parse_tool_arguments(arguments)
    except ToolArgumentsError:
        return {}


# -- response mapping -------------------------------------------------------------------------


def _field(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise MalformedResponseError(f"the Anthropic {where} has no valid {key!r}: {value!r}")
    return value


def _tool_name(block: Mapping[str, Any], where: str) -> str:
    """A ``tool_use`` block's name: a non-empty string. An empty one names no tool, and sent back
    in the next request it makes the conversation one ``history=`` refuses (as OpenAI's is)."""
    name: str = _field(block, "name", str, where)
    if not name:
        raise MalformedResponseError(f"the Anthropic {where} has an empty 'name'")
    return name


def _finish_reason(value: Any) -> FinishReason:
    reason = STOP_REASONS.get(value) if isinstance(value, str) else None
    if reason is None:
        raise MalformedResponseError(f"unknown Anthropic stop_reason {value!r}")
    return reason


def _count(value: Any) -> int | None:
    """A token count, or ``None`` for anything else (a count of the wrong type or out of range is ignored)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return None


def parse_usage(raw: Any) -> Usage:
    """`Usage` from an Anthropic ``usage`` object; ``total_tokens`` = input + output tokens (``0``
    when that sum is past `MAX_TOKEN_COUNT`: not reported, as a count out of range is not)."""
    if not isinstance(raw, Mapping):
        return Usage()
    input_tokens = _count(raw.get("input_tokens")) or 0
    output_tokens = _count(raw.get("output_tokens")) or 0
    details = raw.get("output_tokens_details")
    reasoning = _count(details.get("thinking_tokens")) if isinstance(details, Mapping) else None
    total_tokens = input_tokens + output_tokens
    if total_tokens > MAX_TOKEN_COUNT:
        # Two counts in range can add up past the bound: the sum is ignored as any count out of
        # range is (`ModelService` would refuse it, after the reply was published).
        total_tokens = 0
    return Usage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        total_tokens=total_tokens,
        cached_input_tokens=_count(raw.get("cache_read_input_tokens")),
        cache_creation_input_tokens=_count(raw.get("cache_creation_input_tokens")),
        reasoning_tokens=reasoning,
    )


def parse_message(data: Any) -> ModelResponse:
    """A `ModelResponse` from an Anthropic ``message`` object (an error object sent with HTTP 200
    raises its typed error, as in a stream)."""
    if isinstance(data, Mapping) and isinstance(data.get("error"), Mapping) and "content" not in data:
        raise _error_object(data, "response")
    if not isinstance(data, Mapping) or data.get("type") != "message":
        raise MalformedResponseError(f"the Anthropic response is not a message: {str(data)[:200]}")
    blocks = _field(data, "content", list, "message")
    parts: list[ContentPart] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            raise MalformedResponseError(f"an Anthropic content block is not an object: {block!r}")
        kind = block.get("type")
        where = f"{kind} block"
        if kind == "text":
            parts.append(TextPart(_field(block, "text", str, where)))
        elif kind == "thinking":
            parts.append(ReasoningPart(_field(block, "thinking", str, where), _field(block, "signature", str, where)))
        elif kind == "redacted_thinking":
            parts.append(ReasoningPart("", redacted_data=_field(block, "data", str, where)))
        elif kind == "tool_use":
            parts.append(
                ToolCallPart(
                    _field(block, "id", str, where),
                    _tool_name(block, where),
                    json.dumps(block.get("input", {}), ensure_ascii=False),
                )
            )
        # Other block types (server tools, citations-only blocks, ...) have no place in our model.
    return ModelResponse(
        # (cast: the attrs converter ``tuple`` gives mypy an unsolvable parameter type)
        AssistantMessage(cast(Any, tuple(parts))),
        _finish_reason(data.get("stop_reason")),
        parse_usage(data.get("usage")),
        _text(data.get("model")),
        _text(data.get("id")),
        _explanation(data.get("stop_details")),
    )


def _explanation(stop_details: Any) -> str | None:
    """``stop_details.explanation`` (a refusal's, today), when the server gave one."""
    if isinstance(stop_details, Mapping):
        explanation = stop_details.get("explanation")
        if isinstance(explanation, str) and explanation:
            return explanation
    return None


def _text(value: Any, default: str = "") -> str:
    return value if isinstance(value, str) else default


# -- errors -----------------------------------------------------------------------------------


def _error_details(body: bytes) -> tuple[str | None, str]:
    """(Anthropic error type, message) from an error body ``{"type": "error", "error": {...}}``."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = load_json(text, what="the Anthropic error body")
    except MalformedResponseError:
        return None, text[:500] or "(empty body)"
    error = data.get("error") if isinstance(data, Mapping) else None
    if isinstance(error, Mapping):
        kind = error.get("type")
        message = error.get("message")
        return (kind if isinstance(kind, str) else None), (message if isinstance(message, str) else str(error))
    return None, text[:500]


async def _raise_for_status(response: httpx.Response, grace: float) -> None:
    status = response.status_code
    if 200 <= status < 300:
        return
    kind, detail = _error_details(await read_error_body(response, grace=grace, layer=_LAYER))
    message = f"Anthropic API error {status}" + (f" {kind}" if kind else "") + f": {detail}"
    request_id = response.headers.get("request-id")
    if request_id:
        message += f" (request-id {request_id})"
    if status in (401, 403):
        raise AuthenticationError(message, status=status)
    if status == 404:
        raise ModelNotFoundError(message, status=status)
    # Every retryable status carries the server's wait hint: a 529 (Anthropic's "overloaded") or a
    # 503 sends its retry-after as a 429 does, and the retry loop should wait that long.
    if status == 429:
        raise RateLimitError(message, status=status, retry_after=retry_after_seconds(response.headers))
    if status >= 500:
        raise ProviderServerError(message, status=status, retry_after=retry_after_seconds(response.headers))
    # 408 (request timeout) and 409 (conflict) are transient, as the official SDK treats them.
    if status in (408, 409):
        raise ProviderError(message, status=status, retryable=True, retry_after=retry_after_seconds(response.headers))
    raise ProviderError(message, status=status)


def _error_object(data: Mapping[str, Any], where: str) -> ProviderError:
    """The error for an error object sent with HTTP 200 (``event: error`` in a stream, or a whole
    body): typed by its ``type``; ``status`` is ``None``."""
    error = data.get("error")
    error = error if isinstance(error, Mapping) else {}
    kind = _text(error.get("type"), "unknown_error")
    detail = _text(error.get("message"), str(error))
    message = f"Anthropic {where} error {kind}: {detail}"
    cls = _ERROR_TYPES.get(kind, ProviderError)
    if cls is RateLimitError:
        return RateLimitError(message, status=None)
    return cls(message, status=None)


async def _check_event_stream(response: httpx.Response, limit: int, grace: float) -> None:
    content_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type != "text/event-stream":
        body = await read_body(response, limit, grace=grace, layer=_LAYER)
        raise _json_body_error(body, f"content-type {content_type or '(none)'!r}")


def _json_body_error(body: bytes, shape: str) -> ModelError:
    """Where a stream was expected: the server's error if *body* is an error object, else malformed."""
    try:
        data = load_json(body, what="the Anthropic body")
    except MalformedResponseError:
        data = None
    if isinstance(data, Mapping) and isinstance(data.get("error"), Mapping):
        return _error_object(data, "response")
    snippet = body[:500].decode("utf-8", "replace")
    return MalformedResponseError(f"the Anthropic stream is {shape}, not text/event-stream: {snippet!r}")


def _request_timeout(exc: httpx.TimeoutException) -> ModelTimeoutError:
    return ModelTimeoutError(
        f"the Anthropic request timed out ({type(exc).__name__})",
        code="model_request_timeout",
        retryable=isinstance(exc, httpx.ConnectTimeout),
    )


def _transport_error(exc: httpx.HTTPError) -> ModelError:
    if isinstance(exc, httpx.DecodingError):
        return MalformedResponseError(f"the Anthropic response could not be decoded: {exc}")
    return ModelConnectionError(f"the connection to Anthropic failed ({type(exc).__name__}): {exc}")


# -- streaming --------------------------------------------------------------------------------

_CONTENT_EVENTS: Final = frozenset(
    ("content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop")
)


@attrs.define
class _Block:
    kind: str
    ordinal: int = -1  # tool calls: the ordinal among the message's tool calls
    id: str = ""
    name: str = ""
    arguments: list[str] = attrs.field(factory=list)
    initial_input: Any = None
    stopped: bool = False
    # A surrogate pair split across two deltas ("\ud83d" then "\ude00") is joined.
    mender: DeltaMender = attrs.field(factory=DeltaMender)


class _StreamState:
    """Turns Anthropic stream events into `StreamChunk` s."""

    def __init__(self) -> None:
        self.blocks: dict[int, _Block] = {}
        self.tool_calls = 0
        self.usage: dict[str, Any] = {}
        self.stop_reason: Any = None
        self.explanation: str | None = None
        self.started = False
        self.finished = False

    def handle(self, event: SSEEvent) -> list[StreamChunk]:
        if self.finished:
            return []
        data = load_json(event.data, what="an Anthropic stream event")
        if not isinstance(data, dict):
            raise MalformedResponseError(f"an Anthropic stream event is not an object: {event.data[:200]!r}")
        kind = event.event if event.event and event.event != "message" else data.get("type")
        if not isinstance(kind, str):  # a list or an object would not even hash for the lookups below
            raise MalformedResponseError(f"an Anthropic stream event has no valid type: {event.data[:200]!r}")
        if kind == "error":
            raise _error_object(data, "stream")
        if kind == "ping":
            return []
        if kind == "message_start":
            message = data.get("message")
            if not isinstance(message, Mapping):
                raise MalformedResponseError("the Anthropic message_start event has no message")
            self.started = True
            self._merge_usage(message.get("usage"))
            return []
        if kind not in _CONTENT_EVENTS:
            return []  # new event types may appear (Anthropic's versioning policy): ignore them
        if not self.started:
            raise MalformedResponseError(f"the Anthropic stream sent {kind} before message_start")
        if kind == "content_block_start":
            return self._block_start(data)
        if kind == "content_block_delta":
            return self._block_delta(data)
        if kind == "content_block_stop":
            return self._block_stop(data)
        if kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, Mapping) and delta.get("stop_reason") is not None:
                self.stop_reason = delta["stop_reason"]
                self.explanation = _explanation(delta.get("stop_details"))
            self._merge_usage(data.get("usage"))
            return []
        # message_stop
        open_tools = [block.name for block in self.blocks.values() if block.kind == "tool_use" and not block.stopped]
        if open_tools:
            raise MalformedResponseError(f"the Anthropic stream stopped with unfinished tool calls {open_tools}")
        reason = _finish_reason(self.stop_reason)
        self.finished = True
        return [UsageChunk(parse_usage(self.usage)), FinishChunk(reason, self.explanation)]

    def _merge_usage(self, usage: Any) -> None:
        # message_delta counts are cumulative: a later value replaces an earlier one.
        if isinstance(usage, Mapping):
            self.usage.update({key: value for key, value in usage.items() if value is not None})

    def _index(self, data: Mapping[str, Any]) -> int:
        return int(_field(data, "index", int, f"{data.get('type')} event"))

    def _block(self, data: Mapping[str, Any]) -> _Block:
        index = self._index(data)
        block = self.blocks.get(index)
        if block is None or block.stopped:
            raise MalformedResponseError(f"the Anthropic stream sent {data.get('type')} for unknown block {index}")
        return block

    def _block_start(self, data: Mapping[str, Any]) -> list[StreamChunk]:
        index = self._index(data)
        if index in self.blocks:
            raise MalformedResponseError(f"the Anthropic stream started content block {index} twice")
        content = data.get("content_block")
        if not isinstance(content, Mapping):
            raise MalformedResponseError("the Anthropic content_block_start event has no content_block")
        kind = content.get("type")
        where = f"streamed {kind} block"
        if kind == "text":
            block = self.blocks[index] = _Block("text")
            text = content.get("text")
            return [TextDelta(text)] if isinstance(text, str) and (text := block.mender.mend(text)) else []
        if kind == "thinking":
            block = self.blocks[index] = _Block("thinking")
            chunks: list[StreamChunk] = []
            thinking = content.get("thinking")
            if isinstance(thinking, str) and (thinking := block.mender.mend(thinking)):
                chunks.append(ReasoningDelta(thinking))
            if isinstance(content.get("signature"), str) and content["signature"]:
                chunks.append(ReasoningDelta(signature=content["signature"]))
            return chunks
        if kind == "tool_use":
            block = _Block(
                "tool_use",
                self.tool_calls,
                _field(content, "id", str, where),
                _tool_name(content, where),
                initial_input=content.get("input"),
            )
            self.tool_calls += 1
            self.blocks[index] = block
            return [ToolCallStart(block.ordinal, block.id, block.name)]
        if kind == "redacted_thinking":
            self.blocks[index] = _Block("redacted_thinking")
            redacted = content.get("data")
            # Arrives whole at block start; it must travel back to the API unchanged.
            return [ReasoningDelta(redacted_data=redacted)] if isinstance(redacted, str) and redacted else []
        # Server-tool blocks have no place in our model: skip them.
        self.blocks[index] = _Block(str(kind))
        return []

    def _block_delta(self, data: Mapping[str, Any]) -> list[StreamChunk]:
        block = self._block(data)
        delta = data.get("delta")
        if not isinstance(delta, Mapping):
            raise MalformedResponseError("the Anthropic content_block_delta event has no delta")
        kind = delta.get("type")
        where = f"streamed {kind}"
        if block.kind == "text" and kind == "text_delta":
            text = block.mender.mend(_field(delta, "text", str, where))
            return [TextDelta(text)] if text else []
        if block.kind == "thinking" and kind == "thinking_delta":
            text = block.mender.mend(_field(delta, "thinking", str, where))
            return [ReasoningDelta(text)] if text else []
        if block.kind == "thinking" and kind == "signature_delta":
            held = block.mender.flush()  # the signature ends the reasoning text
            signed = ReasoningDelta(signature=_field(delta, "signature", str, where))
            return [ReasoningDelta(held), signed] if held else [signed]
        if block.kind == "tool_use" and kind == "input_json_delta":
            piece = block.mender.mend(_field(delta, "partial_json", str, where))
            if not piece:
                return []
            block.arguments.append(piece)
            return [ToolCallDelta(block.ordinal, piece)]
        if kind in ("text_delta", "thinking_delta", "signature_delta", "input_json_delta") and block.kind in (
            "text",
            "thinking",
            "tool_use",
        ):
            raise MalformedResponseError(f"the Anthropic stream sent a {kind} for a {block.kind} block")
        return []  # citations and deltas of skipped blocks

    def _block_stop(self, data: Mapping[str, Any]) -> list[StreamChunk]:
        block = self._block(data)
        block.stopped = True
        held = block.mender.flush()  # a high surrogate whose pair never came, as U+FFFD
        if block.kind != "tool_use":
            if held and block.kind == "text":
                return [TextDelta(held)]
            return [ReasoningDelta(held)] if held and block.kind == "thinking" else []
        if held:
            block.arguments.append(held)
        if block.arguments:
            arguments = "".join(block.arguments)
        elif isinstance(block.initial_input, Mapping) and block.initial_input:
            arguments = well_formed(json.dumps(block.initial_input, ensure_ascii=False))
        else:
            arguments = "{}"
        end = ToolCallEnd(block.ordinal, block.id, block.name, arguments)
        return [ToolCallDelta(block.ordinal, held), end] if held else [end]
