"""Serving the app: Hypercorn under Trio, bound to loopback unless told otherwise.

Hypercorn writes to a connection inside a shielded cancel scope, with no bound: a client that
stops reading (its connection left open) held that write, the connection's task and with it
``serve`` for ever, cancelled or shut down (and the command line, Ctrl-C or not). Here Hypercorn
serves each connection on a stream of ours instead (its own ``serve`` takes no listeners): a write
that the client takes nothing of for ``write_timeout`` seconds closes the connection, and so does
the end of the connection's task (``serve`` cancelled, or its shutdown's grace over). Closing the
socket is what wakes a write, shielded or not.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app

from .._config import validate_timeout

__all__ = ["GRACEFUL_TIMEOUT", "WRITE_TIMEOUT", "serve"]

WRITE_TIMEOUT = 30.0
"""How long a write to a client may wait for it to take a piece (`_PIECE`) before its connection is closed."""
GRACEFUL_TIMEOUT = 2.0
"""How long a response in progress may go on once ``shutdown_trigger`` returned."""
_PIECE = 64 * 1024


class _Connection(trio.abc.HalfCloseableStream):
    """An accepted connection, as Hypercorn serves it: its writes bounded (see the module)."""

    def __init__(self, stream: trio.SocketStream, write_timeout: float) -> None:
        self.stream = stream
        self.socket = stream.socket  # Hypercorn reads both ends' addresses from it
        self.write_timeout = write_timeout

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with memoryview(data) as view:
            for start in range(0, max(len(view), 1), _PIECE):  # one piece at a time: a slow reader is no stalled one
                with trio.move_on_after(self.write_timeout) as bound:  # Hypercorn's shield does not stop our own
                    await self.stream.send_all(view[start : start + _PIECE])
                if bound.cancelled_caught:  # part of a piece may have gone: the connection cannot go on
                    self.close()
                    raise trio.BrokenResourceError(f"the client took nothing for {self.write_timeout:g} s")

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()

    def close(self) -> None:
        """Close it now: a task waiting to write or read on it wakes (with `trio.ClosedResourceError`)."""
        self.stream.socket.close()


async def _close_when_cancelled(connection: _Connection) -> None:
    try:
        await trio.sleep_forever()
    finally:
        connection.close()


async def _serve_connection(
    serve_stream: Callable[[_Connection], Awaitable[None]], write_timeout: float, stream: trio.SocketStream
) -> None:
    """One connection's task: Hypercorn serves it; when the task ends or is cancelled, it is closed,
    so a write stuck in Hypercorn's shield ends too (and with it the task)."""
    connection = _Connection(stream, write_timeout)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_close_when_cancelled, connection)
        await serve_stream(connection)
        nursery.cancel_scope.cancel()


async def _until(trigger: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    await trigger()
    scope.cancel()


async def serve(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    write_timeout: float = WRITE_TIMEOUT,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (ASGI) with Hypercorn in this Trio run until cancelled (or ``shutdown_trigger``
    returns). ``port=0`` takes a free port; ``nursery.start(serve, app, port=0)`` returns the bound
    URLs. The default ``host`` is loopback: serving other machines is a choice, never an accident.

    Cancelled, it closes every connection at once; once ``shutdown_trigger`` returns, it accepts no
    more, closes the idle connections and gives the responses in progress `GRACEFUL_TIMEOUT`
    seconds to end before it closes theirs. A client that takes nothing of a write for
    ``write_timeout`` seconds has its connection closed (as a disconnect)."""
    write_timeout = validate_timeout(write_timeout, name="write_timeout")
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = "-"
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.keep_alive_timeout = 30.0
    # read_timeout stays None: Hypercorn applies it to every read of the connection, a streaming
    # response's too, so a client silent for that long (every SSE client: it only reads) would be
    # disconnected and its run aborted. The app bounds a request body itself (`body_timeout`).
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    # What follows is Hypercorn's own `worker_serve` (hypercorn.trio.run), HTTP only, with our
    # connections: the app's lifespan around the serving, then a grace for the responses.
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            listeners: list[trio.SocketListener] = []
            binds: list[str] = []
            for sock in config.create_sockets().insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                bind = f"http://{repr_socket_addr(sock.family, sock.getsockname())}"
                binds.append(bind)
                await config.log.info(f"Running on {bind} (CTRL + C to quit)")
            serve_stream = functools.partial(
                TCPServer, wrapped, config, context, ConnectionState(lifespan_state.copy())
            )
            handler = functools.partial(_serve_connection, serve_stream, write_timeout)
            task_status.started(binds)
            try:
                async with trio.open_nursery() as accepting:
                    if shutdown_trigger is not None:
                        accepting.start_soon(_until, shutdown_trigger, accepting.cancel_scope)
                    accepting.start_soon(
                        functools.partial(trio.serve_listeners, handler, listeners, handler_nursery=connections)
                    )
            finally:
                await context.terminated.set()  # idle connections close; the others have the grace
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
