"""``python -m trio_agent serve``: the AG-UI endpoint (and the chat page) on this machine."""

from __future__ import annotations

import functools
import os
import signal
import sys
import tempfile
import urllib.parse
from typing import Any

import trio

from .._errors import ConfigError, TrioAgentError
from .._groups import unwrap_for_boundary
from .._terminate import INTERRUPTED, TERMINATED, until_stopped

__all__ = ["run_serve"]


def run_serve(
    *, host: str, port: int, provider: str | None, model: str | None, token: str | None, journal: str | None = None
) -> int:
    """Serve until Ctrl-C or SIGTERM. Loopback needs no token; any other host does (never open by
    accident). Every failure is one ``error: ...`` line and a non-zero status, never a traceback."""
    loopback = host in ("127.0.0.1", "localhost", "::1")
    if not loopback and not token:
        print(f"error: serving on {host} needs --token (clients send 'Authorization: Bearer <token>')", file=sys.stderr)
        return 2
    if provider is not None and not model:
        print(f"error: --model is required with --provider {provider}", file=sys.stderr)
        return 2
    serving = functools.partial(_serve, host=host, port=port, provider=provider, model=model, token=token)
    stopping = functools.partial(until_stopped, said=_said)
    try:
        if journal is not None:
            stopped_by = trio.run(stopping, functools.partial(serving, journal=journal))
        else:
            with tempfile.TemporaryDirectory() as directory:
                path = os.path.join(directory, "threads.db")
                stopped_by = trio.run(stopping, functools.partial(serving, journal=path))
    except BaseException as raised:
        exc = unwrap_for_boundary(raised) if isinstance(raised, BaseExceptionGroup) else raised
        if isinstance(exc, KeyboardInterrupt):  # a Ctrl-C before the signals were ours (trio.run starting)
            print(_said(signal.SIGINT), file=sys.stderr)
            return INTERRUPTED
        if isinstance(exc, ConfigError):  # e.g. ProviderConfigError: no API key
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, (TrioAgentError, OSError, OverflowError)):  # the journal, the address, the port
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        raise
    if stopped_by is not None:
        print(_said(stopped_by), file=sys.stderr)
        return INTERRUPTED if stopped_by is signal.SIGINT else TERMINATED
    return 0


def _said(stopped_by: signal.Signals) -> str:
    """What the command says when a signal stopped it (also when a second one cut its clean-up short)."""
    return "stopped" if stopped_by is signal.SIGINT else "stopped (SIGTERM)"


def page_address(bind: str, token: str | None) -> str:
    """The chat page's address; with a token, in the fragment as the page reads it back
    (``URLSearchParams``: a ``+`` or ``&`` in the token is escaped, or the page would get another)."""
    return f"{bind}/#{urllib.parse.urlencode({'token': token})}" if token else f"{bind}/"


async def _serve(
    *, host: str, port: int, provider: str | None, model: str | None, token: str | None, journal: str
) -> None:
    from .._journal._sqlite import open_sqlite_store
    from .._models._providers import create_provider
    from ._app import bearer_token, create_app, local_only
    from ._offline import offline_agent
    from ._serve import serve

    auth = bearer_token(token) if token else local_only
    chosen: Any
    if provider is None:
        chosen, tools, options = offline_agent()
        print("the offline test model answers (no API key needed); --provider and --model for a real one")
    else:
        chosen, tools, options = create_provider(provider, model or ""), [], {}
    # The journal opens before the port is bound: a bad path fails before anything is announced.
    async with open_sqlite_store(journal) as store, trio.open_nursery() as nursery:
        app = create_app(chosen, auth=auth, tools=tools, threads=store, **options)
        binds = await nursery.start(functools.partial(serve, app, host=host, port=port))
        for bind in binds:
            page = page_address(bind, token)
            print(f"chat page on {page} (AG-UI at {bind}/runs; threads in {journal}); Ctrl-C stops", flush=True)
