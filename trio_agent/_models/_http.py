"""What the HTTP providers share: base-URL validation, ``retry-after`` parsing, JSON loading of
server data, bounded reading and decoding of a body, a bounded server-sent-events parser and the
bounded release of a response."""

from __future__ import annotations

import collections
import contextlib
import datetime
import email.utils
import json
import math
import re
import time
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import attrs
import httpx
import trio

from .._cleanup import bounded_shield
from .._errors import MalformedResponseError, ModelError, ProviderConfigError
from ._assemble import well_formed
from ._messages import MAX_TOKEN_COUNT

__all__ = [
    "ACCEPT_ENCODING",
    "ERROR_BODY_LIMIT",
    "MAX_TOKEN_COUNT",
    "BodyReader",
    "SSEEvent",
    "SSEParser",
    "SSEReader",
    "checked_api_key",
    "checked_base_url",
    "checked_headers",
    "checked_key_text",
    "json_body",
    "load_json",
    "read_body",
    "read_error_body",
    "redacted_url",
    "release_response",
    "retry_after_seconds",
    "stop_sequences",
    "unsent_request_error",
]


def checked_base_url(base_url: object, *, provider: str, source: str, example: str) -> str:
    """*base_url* without a trailing slash, or a `ProviderConfigError` naming *source* and the problem."""
    problem: str | None = None
    url: httpx.URL | None = None
    if not isinstance(base_url, str):
        problem = "it is not a string"
    else:
        try:
            url = httpx.URL(base_url.strip())
        except (httpx.InvalidURL, TypeError, ValueError) as exc:
            problem = str(exc)
        else:
            if url.scheme not in ("http", "https"):
                problem = "the scheme must be http or https"
            elif not url.host:
                problem = "it has no host"
            elif url.query or url.fragment:
                problem = "it must not have a query or fragment"
    if problem is not None or url is None:
        shown = redacted_url(base_url) if isinstance(base_url, str) else base_url
        raise ProviderConfigError(
            f"invalid {source} {shown!r} for the {provider} provider: {problem}; expected a URL such as {example!r}"
        )
    return str(url).rstrip("/")


# The userinfo of a URL's authority (``alice:token@``): everything between ``://`` and the last
# ``@`` before the path, query or fragment.
_USERINFO = re.compile(r"(?<=://)[^/?#]*@")


def redacted_url(url: str) -> str:
    """*url* with its userinfo (``https://user:secret@host``, sent by httpx as Basic auth) shown as
    ``***``: a credential, which no message or repr may show (as `checked_api_key` never shows a key)."""
    return _USERINFO.sub("***@", url, count=1)


def checked_api_key(api_key: object, *, provider: str) -> None:
    """A `ProviderConfigError` unless *api_key* is ``None`` (read from the environment) or a string
    (its type is named, never its value: it may be a secret)."""
    if api_key is not None and not isinstance(api_key, str):
        raise ProviderConfigError(f"the {provider} provider's api_key must be a string, got {type(api_key).__name__}")


def checked_key_text(key: str, *, provider: str, source: str) -> None:
    """A `ProviderConfigError` unless *key* (an API key, from *source*) can be sent in a header:
    visible ASCII only. Its problem is named, never its value.

    A key read from a file with its newline, or pasted with an invisible character, was taken and
    failed every call: httpx refuses it at each send, as a connection error (retried, its message
    showing the key) or a bare `UnicodeEncodeError`."""
    problem = _unsendable(key, blanks_inside=False)
    if problem is not None:
        raise ProviderConfigError(
            f"the {provider} provider's API key ({source}) {problem}: an API key must be visible ASCII "
            "characters only (its value is not shown)"
        )


# RFC 9110 ``token``: what a header name may be.
_HEADER_NAME = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")


def checked_headers(headers: object, *, provider: str) -> dict[str, str]:
    """*headers* (``extra_headers``) as a dict, or a `ProviderConfigError` naming the header (never
    its value, which may be a secret: an ``api-key`` for a gateway) that HTTP cannot carry: a name
    that is not a token, a value that is not visible ASCII (spaces and tabs allowed between its
    characters), such as one that ends with the newline of the file it was read from."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise ProviderConfigError(
            f"the {provider} provider's extra_headers must be a mapping of header names to values, "
            f"got {type(headers).__name__}"
        )
    checked: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            shown = f"{name!r:.100}" if isinstance(name, str) else f"of type {type(name).__name__}"
            raise ProviderConfigError(
                f"the {provider} provider's extra header name {shown} is not a valid HTTP header name "
                "(letters, digits and !#$%&'*+-.^_`|~ only)"
            )
        if not isinstance(value, str):
            raise ProviderConfigError(
                f"the {provider} provider's extra header {name!r} must have a string value, got {type(value).__name__}"
            )
        problem = _unsendable(value, blanks_inside=True)
        if problem is not None:
            raise ProviderConfigError(
                f"the {provider} provider's extra header {name!r} has a value that {problem}: a header value "
                "must be visible ASCII characters, with spaces or tabs only between them (its value is not shown)"
            )
        checked[name] = value
    return checked


def _unsendable(text: str, *, blanks_inside: bool) -> str | None:
    """Why *text* cannot be sent as a header value (``None``: it can), described without showing
    it: a character that is no part of a secret (a newline, a zero-width space) is named by its
    code point."""
    if text.endswith(("\r", "\n")):
        return f"ends with a line break (U+{ord(text[-1]):04X}; a value read from a file keeps its newline)"
    for char in text:
        if "\x21" <= char <= "\x7e" or (blanks_inside and char in " \t"):
            continue
        if char in " \t":
            return "contains a space or tab"
        point = f"U+{ord(char):04X}"
        if char in "\r\n":
            return f"contains a line break ({point})"
        if char < " " or char == "\x7f":
            return f"contains a control character ({point})"
        return f"contains a non-ASCII character ({point})"
    if text != text.strip(" \t"):
        return "starts or ends with a space or tab"
    return None


def unsent_request_error(where: str) -> ModelError:
    """The error for an `httpx.LocalProtocolError`: the HTTP library refused to send a request as
    invalid HTTP (a header that a given client adds, say; the provider's own are checked when it
    is made). Sending it again fails the same way, so it is not retryable, and the library's
    message is not shown: it quotes the offending header's value, which may be a secret."""
    return ModelError(
        f"the request to {where} was not sent: the HTTP library refused it as invalid HTTP (a header "
        "name or value that HTTP cannot carry, such as one set on the given httpx client; the "
        "library's message is not shown, as it quotes the value)",
        code="provider_bad_request",
    )


def stop_sequences(value: object, *, option: str) -> list[str]:
    """The request option *option* (``stop``, ``stop_sequences``) as a list of strings; it must be a
    string or a list (or tuple) of strings, else a `ModelError` naming it fails the call before
    anything is sent (the server would refuse it, or the body could not be built)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return list(value)
    raise ModelError(
        f"request option {option!r} must be a string or a list of strings, got {value!r:.200}",
        code="provider_bad_option",
    )


# RFC 9110's delay-seconds is ``1*DIGIT`` (ASCII); a decimal fraction (``1.5``, which servers
# send) is the one leniency. Not float()'s grammar: that takes ``1_0`` (as 10), ``1e3``, a sign,
# ``nan`` / ``inf``, non-ASCII digits (U+0661) and whitespace of every kind.
_DELAY_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def _delay_seconds(value: str) -> float | None:
    """*value* (a header's) as a number of ``delay-seconds``, else ``None``. Only the whitespace
    HTTP allows around a field value (space, tab) is not part of it (RFC 9110 5.5)."""
    value = value.strip(" \t")
    if _DELAY_SECONDS.fullmatch(value) is None:
        return None
    number = float(value)
    # More digits than a float holds (over 308) overflow to inf: no hint, as before.
    return number if math.isfinite(number) else None


def retry_after_seconds(headers: httpx.Headers) -> float | None:
    """The server's wait hint in seconds: ``retry-after-ms``, else ``retry-after`` (seconds or an HTTP
    date); ``None`` when neither is there or can be read (a header from the server never fails the call).

    A number is ASCII digits with at most a decimal fraction (``7``, ``1.5``): no sign, exponent,
    underscore, ``nan`` / ``inf`` or non-ASCII digit, which are no hint, like an unreadable date."""
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        number = _delay_seconds(value)
        if number is not None:
            return number / divisor
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        remaining = when.timestamp() - time.time()
    except Exception:
        # A date the email parser cannot read raises whatever its arithmetic meets (ValueError,
        # IndexError, or OverflowError for a zone offset like +99999999999999999999), as may
        # `timestamp()` at the ends of the calendar: none is a hint, and none may fail the call
        # (a 429 or a 503 would no longer be retried).
        return None
    return max(remaining, 0.0)


def json_body(payload: object, *, compact: bool = False) -> bytes:
    """*payload* as a request body: UTF-8 JSON, raw non-ASCII text, no NaN or infinity (`ValueError`).

    A lone surrogate anywhere in it (a tool's output or a user's text read with
    ``surrogateescape``; a model's own text is mended as it is assembled) cannot be UTF-8: it is
    sent as U+FFFD, as its pair halves are joined, instead of failing this request and every later
    one of the conversation. Text without one is encoded once, as before."""
    separators = (",", ":") if compact else None
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=separators)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return well_formed(text).encode()


def load_json(data: str | bytes, *, what: str, status: int | None = None) -> Any:
    """*data* (sent by a server) parsed as JSON, or a `MalformedResponseError` that names *what*
    and shows the start of *data*.

    JSON nested deeper than the parser can recurse raises `RecursionError`, which is not a
    `ValueError`: caught here as well, so a hostile body fails its call as malformed like any
    other unreadable body, instead of escaping as a bare error.
    """
    try:
        return json.loads(data)
    except ValueError as exc:
        problem = f"is not valid JSON ({exc})"
    except RecursionError:
        problem = "nests arrays and objects too deeply to be parsed"
    start = data[:200].decode("utf-8", "replace") if isinstance(data, bytes) else data[:200]
    raise MalformedResponseError(f"{what} {problem}: {start!r}", status=status) from None


# -- reading a body ---------------------------------------------------------------------------------

ACCEPT_ENCODING = "gzip, deflate"
"""The ``accept-encoding`` of every provider request: zlib's encodings, whose output can be bounded
while it is decoded. httpx would advertise zstd (and br) as well when their packages are installed,
and decodes each network read whole before a caller can count a byte: 16 KiB of zstd can be
512 MiB of zeros, all allocated at once."""

ERROR_BODY_LIMIT = 64 * 1024
"""An error response's body is read up to this size, for its message; the rest is dropped."""

_DECODE_STEP = 64 * 1024  # the most decoded bytes one read of a body returns
_CODINGS = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}


def compressed_bound(limit: int) -> int:
    """The most compressed bytes a body whose decoded bytes are bounded by *limit* may take: twice
    *limit*, plus 64 KiB for headers (a gzip member's name or extra field) and the framing of a
    small body. Deflate grows what it cannot compress by a few bytes per stored block, and a gzip
    member costs 18 bytes: a body within *limit* stays far below this, even one member per
    flushed event, unless it is mostly bytes that decode to nothing."""
    return 2 * limit + _DECODE_STEP


def _zlib_header(head: bytes) -> bool:
    """*head* (at least two bytes) starts a zlib stream (RFC 1950): compression method 8 and a
    header check that makes ``CMF*256 + FLG`` a multiple of 31. Raw deflate from a real encoder
    never does: its first byte's low bits are a block type and zero padding, never 8."""
    return head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0


class _ReadBody:
    """A body httpx has already read and decoded, handed out as a raw body is: in pieces of at
    most `_DECODE_STEP` bytes (its reader counts them against the limit as they come)."""

    __slots__ = ("_body", "_offset")

    def __init__(self, body: bytes) -> None:
        self._body = body
        self._offset = 0

    def __aiter__(self) -> _ReadBody:
        return self

    async def __anext__(self) -> bytes:
        await trio.lowlevel.checkpoint()
        start = self._offset
        if start >= len(self._body):
            raise StopAsyncIteration
        self._offset = start + _DECODE_STEP
        return self._body[start : start + _DECODE_STEP]


class BodyReader:
    """A response's body, decoded, in reads of at most 64 KiB (``async for piece in reader``).

    The raw bytes (`raw`: the httpx reader to give `release_response`) are decoded here, not by
    httpx, so a compressed body never grows in memory faster than its reader counts it: each read
    decodes at most `_DECODE_STEP` bytes and keeps the rest of the input for the next one.
    Decoding held input reads nothing from the network, so nothing else would run: a Trio
    checkpoint is taken once every `_DECODE_STEP` decoded bytes (16 KiB of gzip can be 16 MiB of
    events or blanks for the reader to parse, all without letting another task run).
    Only ``gzip`` and ``deflate`` (`ACCEPT_ENCODING`) are decoded; a body in any other encoding
    (or in two) is a `MalformedResponseError` at its first read, naming the encoding.

    A gzip body may hold several members (RFC 1952; a proxy that compresses each flush alone
    sends one per flush), zero bytes padding them as `gzip` allows: each is decoded in turn, all
    counted alike, as are zlib streams one after another; bytes after a stream's end that start
    none are a `MalformedResponseError`, never dropped unread. A ``deflate`` stream comes with or
    without its zlib header: the form is read from its first two bytes, whichever reads bring them.

    *limit* bounds the decoded body (its caller counts the decoded bytes against it, as they are
    returned); the compressed bytes are counted here, against `compressed_bound` of it: empty
    deflate blocks, empty gzip members and zero padding decode to nothing, and a server sending
    them for ever would otherwise be read until a timeout (a stream's idle timeout never fires
    while bytes arrive). Past it: a `MalformedResponseError`, as for a body over *limit*.
    """

    def __init__(self, response: httpx.Response, limit: int) -> None:
        self._limit = limit
        self._bound = compressed_bound(limit)
        self._status = response.status_code
        self._received = 0  # compressed bytes read from the network
        self._decoded = 0  # decoded bytes returned
        try:
            # A transport may hand over a body it read itself (``httpx.MockTransport``, which tests
            # use): httpx decoded it then, and it holds nothing raw to read again.
            read: bytes | None = response.content
        except httpx.ResponseNotRead:
            read = None
        if read is not None:
            self.raw: AsyncIterator[bytes] = _ReadBody(read)
            encoding = ""
        else:
            self.raw = response.aiter_raw()
            encoding = response.headers.get("content-encoding", "")
        codings = [coding for part in encoding.split(",") if (coding := part.strip().lower()) not in ("", "identity")]
        self._problem: str | None = None
        self._coding: str | None = None  # "gzip" or "deflate"; None: the body is not encoded
        if len(codings) == 1 and codings[0] in _CODINGS:
            self._coding = _CODINGS[codings[0]]
        elif codings:
            self._problem = (
                f"the response body is encoded as {encoding!r}; the provider asks for {ACCEPT_ENCODING} "
                "only (whose output it can bound while decoding)"
            )
        # None: the next input byte starts a stream (the body's, or its next gzip member); made
        # once two bytes are there, which tell a deflate body's form.
        self._decoder: zlib._Decompress | None = None
        self._streams = 0  # streams started (gzip members, or zlib streams one after another)
        self._input = b""  # raw bytes not decoded yet
        self._drained = True  # False: the decoder may hold output the last read had no room for
        self._ended = False  # the raw body has ended
        self._unchecked = 0  # decoded bytes returned since the last checkpoint

    def __aiter__(self) -> BodyReader:
        return self

    async def __anext__(self) -> bytes:
        if self._problem is not None:
            raise MalformedResponseError(self._problem)
        if self._coding is None:
            data: bytes = await self.raw.__anext__()
            return data
        if self._unchecked >= _DECODE_STEP:
            # Here, not after decoding: the caller has handled the pieces, and none is lost to a cancellation.
            self._unchecked = 0
            await trio.lowlevel.checkpoint()
        while True:
            if self._decoder is None and self._streams and self._coding == "gzip":
                self._input = self._input.lstrip(b"\0")  # padding after a member, as `gzip` reads it
            if not self._ended and self._drained and len(self._input) < (2 if self._decoder is None else 1):
                try:
                    read = await self.raw.__anext__()
                except StopAsyncIteration:
                    self._ended = True
                    continue
                self._received += len(read)
                if self._received > self._bound:
                    raise MalformedResponseError(
                        f"the response body is larger than max_response_bytes={self._limit} allows compressed: "
                        f"over {self._bound} bytes on the wire, {self._decoded} decoded",
                        status=self._status,
                    )
                self._input += read
                continue
            decoder = self._decoder
            if decoder is None:
                if not self._input:
                    raise StopAsyncIteration
                decoder = self._decoder = self._start(self._input)
            elif not self._input and self._drained:  # the body ended inside a stream
                self._decoder = None
                if rest := decoder.flush():  # small: the last read left room unused
                    return self._counted(rest)
                continue
            try:
                out = decoder.decompress(self._input, _DECODE_STEP)
            except zlib.error as exc:
                raise MalformedResponseError(f"the response body could not be decoded: {exc}") from exc
            if decoder.eof:
                # The stream's end, all its output out: what follows starts the next stream (a
                # gzip member), which must be one. Nothing of the body is dropped unread.
                self._input = decoder.unused_data
                self._decoder = None
                self._drained = True
            else:
                self._input = decoder.unconsumed_tail
                self._drained = len(out) < _DECODE_STEP
            if out:
                return self._counted(out)

    def _start(self, head: bytes) -> zlib._Decompress:
        """A decoder for the stream that *head* starts (two bytes or more, unless the body ends sooner)."""
        self._streams += 1
        if self._coding == "gzip":
            return zlib.decompressobj(zlib.MAX_WBITS | 16)
        # "deflate" is often sent raw, without the zlib header (httpx's decoder accepts both).
        return zlib.decompressobj(zlib.MAX_WBITS if len(head) >= 2 and _zlib_header(head) else -zlib.MAX_WBITS)

    def _counted(self, out: bytes) -> bytes:
        self._unchecked += len(out)
        self._decoded += len(out)
        return out


async def read_body(response: httpx.Response, limit: int, *, grace: float, layer: str) -> bytes:
    """The whole body, decoded and counted as it arrives (after the ``content-length`` check);
    over *limit*: `MalformedResponseError`. The response is released either way."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise MalformedResponseError(
            f"the response body ({declared} bytes) is larger than max_response_bytes={limit}",
            status=response.status_code,
        )
    pieces: list[bytes] = []
    size = 0
    reader = BodyReader(response, limit)
    try:
        async for piece in reader:
            size += len(piece)
            if size > limit:
                raise MalformedResponseError(
                    f"the response body is larger than max_response_bytes={limit}", status=response.status_code
                )
            pieces.append(piece)
    finally:
        await release_response(response, reader.raw, grace=grace, layer=layer)
    return b"".join(pieces)


async def read_error_body(response: httpx.Response, *, grace: float, layer: str) -> bytes:
    """The start of an error response's body (up to `ERROR_BODY_LIMIT` bytes), for its message.

    A body that cannot be read whole (cut, or not decodable) gives what had arrived: the status
    alone decides the error, so a 401 stays an authentication error and a 429 or a 503 keeps its
    ``retry-after``, instead of turning into a retryable connection error."""
    pieces: list[bytes] = []
    size = 0
    reader = BodyReader(response, ERROR_BODY_LIMIT)  # (compressed bytes past its bound: what arrived)
    try:
        async for piece in reader:
            pieces.append(piece[: ERROR_BODY_LIMIT - size])
            size += len(pieces[-1])
            if size >= ERROR_BODY_LIMIT:
                break
    except (httpx.HTTPError, MalformedResponseError):
        pass
    finally:
        await release_response(response, reader.raw, grace=grace, layer=layer)
    return b"".join(pieces)


# -- server-sent events -------------------------------------------------------------------------

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
_NOT_BLANK = re.compile(rb"[^ \t\r\n]")


@attrs.frozen
class SSEEvent:
    """One dispatched server-sent event (``event`` is ``"message"`` when the server named none)."""

    event: str
    data: str


class SSEParser:
    """An incremental ``text/event-stream`` parser (WHATWG rules) over raw bytes, bounded.

    Lines end in CRLF, LF or CR, possibly split across reads; they are split as bytes (the three
    are ASCII, never part of a multi-byte character) and decoded one whole line at a time, so
    only those three end a line (U+2028, U+2029 and U+0085 in model output are text, not line
    ends). ``:`` lines are comments; an event is dispatched at a blank line if it has data.

    The event being read (its data lines plus an unterminated line) may not exceed
    *max_event_bytes*: a hostile line without a newline is refused once it passes the bound,
    without buffering the rest. A body whose first non-blank byte is ``{`` or ``[`` is a JSON
    document sent as an event stream (an error, usually): it is kept whole, bounded the same way,
    as `json_body`, for the provider to turn into the server's error.

    An unreadable line (not UTF-8, over the bound) ends the parse for good, but the events
    dispatched before it in the same read are returned first and the error is raised by the next
    `feed` (or `check`): where the network splits the body cannot decide whether a reply that
    ended before the bad line is finished.
    """

    def __init__(self, max_event_bytes: int, *, what: str) -> None:
        self._limit = max_event_bytes
        self._what = what
        self._head: bytearray | None = bytearray()  # the body's start, until its first non-blank byte
        self._at_byte_zero = True  # a byte-order mark counts only there, however the reads split the body
        self._json: bytearray | None = None
        self._pending = bytearray()
        self._skip_lf = False
        self._event = ""
        self._data: list[str] = []
        self._data_bytes = 0
        self._error: MalformedResponseError | None = None  # kept for the call after the events before it

    @property
    def json_body(self) -> bytes | None:
        """The body, when it was a JSON document rather than an event stream."""
        return None if self._json is None else bytes(self._json)

    @property
    def reading_json(self) -> bool:
        """The body is a JSON document (`json_body`, without copying it)."""
        return self._json is not None

    def check(self) -> None:
        """Raise the error a `feed` kept after returning the events before it."""
        if self._error is not None:
            raise self._error

    def feed(self, data: bytes) -> list[SSEEvent]:
        """The events *data* completes; an unreadable line after some of them is raised next time."""
        self.check()
        try:
            return self._feed(data)
        except MalformedResponseError as exc:
            self._error = exc
            raise

    def _feed(self, data: bytes) -> list[SSEEvent]:
        if self._head is not None:
            started = self._start(self._head, data)
            if started is None:
                return []
            data = started
        if self._json is not None:
            if len(self._json) + len(data) > self._limit:
                raise MalformedResponseError(
                    f"{self._what} is a JSON body larger than max_response_bytes={self._limit}, not an event stream"
                )
            self._json += data
            return []
        events: list[SSEEvent] = []
        try:
            for line in self._lines(data):
                event = self._line(line)
                if event is not None:
                    events.append(event)
        except MalformedResponseError as exc:
            if not events:
                raise
            self._error = exc
        return events

    def _start(self, head: bytearray, data: bytes) -> bytes | None:
        """The body from its first non-blank byte on (with the blanks of that line), once it has
        come; ``None`` while only blanks have.

        Where the network splits the body changes nothing: the head is kept across reads, a
        byte-order mark is removed only at byte 0, and only whole blank lines (spaces or tabs, then
        a line end) are dropped (in an event stream they are lines that do nothing, in JSON
        whitespace), so the held head stays bounded. Blanks that start a line are kept: ``" data:"``
        names the field ``" data"``, which is no ``data`` field.

        The held head is only spaces and tabs (a blank line without its end yet), so only the new
        bytes are scanned: rescanning it on every read made a body of blanks quadratic.
        """
        if self._at_byte_zero:
            head += data
            if len(head) < len(_BOM) and _BOM.startswith(head):
                return None  # maybe a byte-order mark split across reads
            data = bytes(head.removeprefix(_BOM))
            head.clear()
            self._at_byte_zero = False
        first = _NOT_BLANK.search(data)
        blanks = len(data) if first is None else first.start()
        # Where the line of the first non-blank byte starts: whole blank lines before it are dropped.
        line_start = max(data.rfind(b"\n", 0, blanks), data.rfind(b"\r", 0, blanks)) + 1
        if line_start:
            head.clear()
        if first is None:
            head += data[line_start:]
            self._check(len(head))  # a line of blanks without its end yet, bounded as any line
            return None
        self._head = None
        if data[blanks] in b"{[":
            self._json = bytearray()
        return bytes(head) + data[line_start:] if head else data[line_start:]

    def _check(self, size: int) -> None:
        if size > self._limit:
            raise MalformedResponseError(f"an event of {self._what} is larger than max_response_bytes={self._limit}")

    def _lines(self, data: bytes) -> Iterator[bytes]:
        if self._skip_lf:
            self._skip_lf = False
            data = data.removeprefix(b"\n")
        position = 0
        for match in _LINE_END.finditer(data):
            if match.group() == b"\r" and match.end() == len(data):
                self._skip_lf = True  # maybe the first half of a CRLF split across reads
            piece = data[position : match.start()]
            self._check(self._data_bytes + len(self._pending) + len(piece))
            if self._pending:
                self._pending += piece
                line = bytes(self._pending)
                self._pending.clear()
            else:
                line = piece
            yield line
            position = match.end()
        if position < len(data):
            self._pending += data[position:]
            self._check(self._data_bytes + len(self._pending))

    def _line(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            if not self._data:
                self._event = ""
                return None
            event = SSEEvent(self._event or "message", "\n".join(self._data))
            self._event = ""
            self._data = []
            self._data_bytes = 0
            return event
        if raw.startswith(b":"):
            return None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedResponseError(f"{self._what} is not valid UTF-8: {exc}") from exc
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)
            self._data_bytes += len(raw)
        return None


class SSEReader:
    """Events from an httpx body iterator, one at a time (a plain object, not a generator, so
    nothing is left for a finaliser when the stream stops early).

    ``max_total_bytes`` bounds the whole body as well (both providers pass their ``max_response_bytes``):
    the bytes within it are parsed and their events returned, then the body is refused. As for an
    unreadable line (`SSEParser`), an event that ended within the bound stands however the reads
    split the body.
    """

    def __init__(
        self, body: AsyncIterator[bytes], parser: SSEParser, *, what: str, max_total_bytes: int | None = None
    ) -> None:
        self._body = body
        self._parser = parser
        self._what = what
        self._max_total = max_total_bytes
        self._received = 0
        self._queue: collections.deque[SSEEvent] = collections.deque()
        self._over: MalformedResponseError | None = None  # the total bound, passed by the last read
        self.eof = False

    @property
    def json_body(self) -> bytes | None:
        return self._parser.json_body

    async def next(self) -> SSEEvent | None:
        """The next event, or ``None`` at the end of the body."""
        while not self._queue:
            # Errors found after the events already returned: raised before anything more is read.
            self._parser.check()
            if self._over is not None:
                raise self._over
            if self.eof:
                return None
            try:
                data = await self._body.__anext__()
            except StopAsyncIteration:
                self.eof = True
                return None
            over = False
            if self._max_total is not None and len(data) > (room := self._max_total - self._received):
                data, over = data[:room], True
            self._received += len(data)
            self._queue.extend(self._parser.feed(data))
            if over:
                shape = "a JSON body" if self._parser.reading_json else "an event stream"
                self._over = MalformedResponseError(
                    f"{self._what} is {shape} larger than max_response_bytes={self._max_total} in total"
                )
        return self._queue.popleft()


# -- releasing a response --------------------------------------------------------------------------


async def release_response(
    response: httpx.Response, body: AsyncIterator[Any], *, grace: float, layer: str, finished: bool = False
) -> None:
    """Close *response* and run its reader *body* (a chain of httpx/httpcore async generators) to
    its end, so none is left suspended for a garbage-collector finaliser (encode/httpx#3686).

    *finished*: the reply ended at its terminal event; whatever of the body has already arrived
    is read first (nothing is waited for), so a body whose end is at hand returns its connection
    to the pool, and one held open by the server loses its connection instead of delaying the
    stream's end. Bounded by *grace* (`bounded_shield`): this runs when a stream is closed early
    or cancelled, and must neither be skipped nor hang.
    """
    with bounded_shield(grace, layer):
        try:
            if finished:
                with trio.CancelScope() as scope:
                    # A deadline set after entering fires at the next scheduling round: a read that
                    # finds bytes already received completes, one that would wait is cancelled.
                    scope.deadline = trio.current_time()
                    with contextlib.suppress(Exception):
                        while True:
                            await body.__anext__()
            with contextlib.suppress(Exception):  # best effort: the error that ended the stream matters more
                await response.aclose()
        finally:
            # Also when the close overran its bound: then the first checkpoint in the chain raises
            # the bound's Cancelled through every layer, which finishes them just the same.
            while True:
                try:
                    await body.__anext__()
                except Exception:  # StopAsyncIteration, or the read error of a closed connection
                    break
