"""A real HTTP/1.1 server on 127.0.0.1 for provider tests (trio + h11, no mocks of our code).

Each test scripts responses (status, headers, body pieces sent one by one, optional
gates to pause between pieces, an abrupt cut), and reads back what the server saw:
the requests, and when each connection was closed by the client.

    async with open_fake_server(handler) as server:
        provider = OpenAIProvider("gpt", api_key="k", base_url=server.url + "/v1")
"""

from __future__ import annotations

import email.utils
import functools
import json
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import h11
import trio


@attrs.frozen
class Gate:
    """Wait for this event before sending the next body piece."""

    event: trio.Event


@attrs.define
class Scripted:
    """One scripted response. Body pieces are bytes (sent as separate chunks) or `Gate` s."""

    status: int = 200
    headers: Sequence[tuple[str, str]] = ()
    body: Sequence[bytes | Gate] = ()
    cut: bool = False  # drop the connection after the pieces, without finishing the response
    chunked: bool = True

    @classmethod
    def json(cls, payload: Any, status: int = 200, headers: Sequence[tuple[str, str]] = ()) -> Scripted:
        return cls(
            status,
            [("content-type", "application/json"), *headers],
            [json.dumps(payload).encode()],
            chunked=False,
        )

    @classmethod
    def sse(cls, pieces: Sequence[bytes | str | Gate], *, cut: bool = False, status: int = 200) -> Scripted:
        body = [piece.encode() if isinstance(piece, str) else piece for piece in pieces]
        return cls(status, [("content-type", "text/event-stream"), ("cache-control", "no-cache")], body, cut=cut)


@attrs.define
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.define
class FakeServer:
    url: str = ""
    requests: list[Recorded] = attrs.field(factory=list)
    closed_connections: int = 0
    closed: trio.Event = attrs.field(factory=trio.Event)  # set each time a client closes a connection


Handler = Callable[[Recorded], Scripted]


async def _serve_one(stream: trio.SocketStream, server: FakeServer, handler: Handler) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            # Read one request.
            request: h11.Request | None = None
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    conn.receive_data(data)
                    if not data and conn.their_state is not h11.DONE:
                        return
                    continue
                if isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            assert request is not None
            recorded = Recorded(
                request.method.decode(),
                request.target.decode(),
                {name.decode().lower(): value.decode() for name, value in request.headers},
                body,
            )
            server.requests.append(recorded)
            scripted = handler(recorded)
            headers = list(scripted.headers)
            pieces = list(scripted.body)
            if scripted.chunked:
                headers.append(("transfer-encoding", "chunked"))
            else:
                total = sum(len(piece) for piece in pieces if isinstance(piece, bytes))
                headers.append(("content-length", str(total)))
            await stream.send_all(conn.send(h11.Response(status_code=scripted.status, headers=headers)))
            for piece in pieces:
                if isinstance(piece, Gate):
                    await piece.event.wait()
                    continue
                if piece:
                    await stream.send_all(conn.send(h11.Data(data=piece)))
            if scripted.cut:
                return  # abrupt: the finally closes the socket mid-response
            await stream.send_all(conn.send(h11.EndOfMessage()))
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
        pass
    finally:
        server.closed_connections += 1
        server.closed.set()
        server.closed = trio.Event()
        await stream.aclose()


@asynccontextmanager
async def open_fake_server(handler: Handler) -> AsyncIterator[FakeServer]:
    """Serve *handler* on 127.0.0.1 (a free port) until the block exits."""
    server = FakeServer()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, lambda stream: _serve_one(stream, server, handler), 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        server.url = f"http://127.0.0.1:{port}"
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


def queue_handler(*responses: Scripted) -> Handler:
    """A handler that answers with *responses* in order."""
    pending = list(responses)

    def handle(request: Recorded) -> Scripted:
        if not pending:
            return Scripted.json({"error": {"message": "no scripted response left"}}, status=500)
        return pending.pop(0)

    return handle


_WBITS = {"gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS, "raw-deflate": -zlib.MAX_WBITS}


def encoded(data: bytes, encoding: str) -> bytes:
    """*data* compressed for a ``content-encoding``: ``gzip``, ``deflate`` (zlib-wrapped) or
    ``raw-deflate`` (what some servers send as ``deflate``: no zlib header)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, _WBITS[encoding])
    return compressor.compress(data) + compressor.flush()


@functools.cache
def gzip_bomb(decoded_mib: int, prefix: bytes = b"") -> bytes:
    """A gzip body of *prefix* then zero bytes, *decoded_mib* MiB decoded and about 1000 times
    smaller on the wire (every 64 KiB of it that a client reads decodes to about 64 MiB)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, _WBITS["gzip"])
    zeros = bytes(2**20)
    pieces = [compressor.compress(prefix), *(compressor.compress(zeros) for _ in range(decoded_mib))]
    return b"".join(pieces) + compressor.flush()


def retry_after_responses(
    status: int, body: Any, cut_body: bytes
) -> tuple[list[Scripted], list[tuple[float, float] | None]]:
    """Responses of *status* with each form of the wait hint, and the ``retry_after`` (a range: a
    date is read against the clock) each should give; the last, with *cut_body*, is cut mid-way."""
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    forms: list[tuple[list[tuple[str, str]], tuple[float, float] | None]] = [
        ([("retry-after", "7")], (7.0, 7.0)),
        ([("retry-after", when)], (25.0, 31.0)),
        ([("retry-after-ms", "1500"), ("retry-after", "9")], (1.5, 1.5)),
        ([("retry-after", "soon")], None),  # no number, no date: no hint, and no crash
        ([("retry-after", "nan"), ("retry-after-ms", "inf")], None),
        ([("retry-after", "1_0"), ("retry-after-ms", "+5")], None),  # float()'s grammar, not delay-seconds
        ([], None),
    ]
    responses = [Scripted.json(body, status=status, headers=headers) for headers, _ in forms]
    cut = Scripted(status, [("content-type", "application/json"), ("retry-after", "7")], [cut_body], cut=True)
    return [*responses, cut], [*(expected for _, expected in forms), (7.0, 7.0)]
