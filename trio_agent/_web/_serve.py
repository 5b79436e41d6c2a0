"""Serving the app: Hypercorn under Trio, bound to loopback unless told otherwise."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

__all__ = ["serve"]


async def serve(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (ASGI) with Hypercorn in this Trio run until cancelled (or ``shutdown_trigger``
    returns). ``port=0`` takes a free port; ``nursery.start(serve, app, port=0)`` returns the bound
    URLs. The default ``host`` is loopback: serving other machines is a choice, never an accident."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = "-"
    config.graceful_timeout = 2.0
    config.keep_alive_timeout = 30.0
    # read_timeout stays None: Hypercorn applies it to every read of the connection, a streaming
    # response's too, so a client silent for that long (every SSE client: it only reads) would be
    # disconnected and its run aborted. The app bounds a request body itself (`body_timeout`).
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
