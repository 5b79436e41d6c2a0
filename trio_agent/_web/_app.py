"""An agent behind a URL: AG-UI over server-sent events, an ASGI app served under Trio.

Rules
=====

* ``POST /runs`` takes AG-UI's ``RunAgentInput`` (``application/json``, at most
  ``max_body`` bytes, all of them within ``body_timeout`` seconds) and answers
  ``text/event-stream``: the run's AG-UI events, one SSE event each (`trio_agent.agui`).
  Before the stream starts, a request that cannot run gets an HTTP error with a JSON body
  ``{"error": code, "message": ..., "problems": [...]}``: 401 ``unauthorized``, 415
  ``unsupported_media_type``, 413 ``body_too_large``, 408 ``body_timeout``, 400
  ``invalid_json``, 422 ``invalid_input`` (every problem with its JSON path) or
  ``invalid_answers``, 409 ``run_in_progress`` (a run id already running, or another run of
  the thread: one at a time, so a pause never replaces another) or ``nothing_to_resume``.
  Once streaming, a failure is one ``RUN_ERROR`` event and the stream ends.
* A stream has one terminal event (``RUN_FINISHED`` or ``RUN_ERROR``), its last: the
  run's own is held back until the run has ended (its terminal hooks and deferred
  functions ran), so what they emit comes before it and a pause is kept before its
  client reads it. An error after the run finished (an ``on_finish`` that raised) is
  logged, not sent; a pause that cannot be kept ends the stream with ``RUN_ERROR``.
* A run is one ``chat()`` run of the app's agent: the input's messages are its
  history, the input's tools are client tools (the run pauses for their output), the
  app's tools run on the server. It is SDK-owned work: a client that disconnects
  aborts it (committed tool results are kept, as for any abort), and so does
  ``POST /runs/{run_id}/abort`` (202; 404 for a run that is not running).
* A run that pauses ends its stream with ``RUN_FINISHED`` (``interrupt`` outcome);
  the app keeps the paused state (signed with the app's key) by thread, at most
  ``max_paused`` threads, the least recently paused dropped first. A continuation is a
  ``RunAgentInput`` on the same thread with ``resume`` entries (its ``messages`` are
  ignored: the paused state has the history); it is accepted once.
* Backpressure: the run's events go through a channel of ``buffer`` frames to the
  response; a client that reads slowly slows the run, one that stops reading holds at
  most that many frames (then the run waits, until the client goes away or `serve`'s
  ``write_timeout`` closes its connection). Frames
  already waiting are written together (up to 64 KiB). An idle stream gets a
  ``: keep-alive`` comment every ``keep_alive`` seconds.
* Authentication is not optional: ``create_app`` takes ``auth``, a callable on the
  request (plain or async) returning whether to serve it. `local_only` serves only
  loopback clients, `bearer_token` a shared secret.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import functools
import hmac
import inspect
import ipaddress
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from .._abort import AbortHandle, AbortReason
from .._agui._encode import AgUiEncoder, messages_to_agui
from .._agui._input import InputError, RunInput, answers_for, check_history, parse_run_input
from .._agui._sse import CONTENT_TYPE, KEEP_ALIVE, sse_event
from .._agui._wire import MessagesSnapshotEvent, RunErrorEvent, to_wire
from .._chat._chat import _Prepared, chat
from .._config import validate_id, validate_limit, validate_timeout
from .._errors import ConfigError, JournalError, LeaseLostError, SessionClosedError, TrioAgentError, error_code
from .._journal._sqlite import open_sqlite_store
from .._journal._store import JournalStore
from .._lifecycle._interrupts import PausedRun, check_signing_key
from .._loop._events import RunError, RunFinished
from .._loop._interrupts import ClientTool, InterruptResumeError, validate_answers
from .._models._messages import UserMessage
from .._session._plugins import MiddlewareConfig
from .._session._requests import RequestQueue
from .._session._spec import AgentSpec, define_agent
from .._tools._definition import Tool
from .._util import describe
from ._threads import LiveRun, ThreadHub, _Thread, open_hub

__all__ = ["Auth", "bearer_token", "create_app", "local_only"]

logger = logging.getLogger("trio_agent.web")

_STATIC = Path(__file__).parent / "static"
PAUSED_BYTES = 64 * 1024 * 1024
"""What the paused runs of one app may hold (their JSON), whatever ``max_paused`` allows."""

Auth = Callable[[Request], bool | Awaitable[bool]]
"""Whether to serve a request (plain or async)."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_of(value: str) -> str:
    """The host of a ``Host`` header or an ``Origin`` (``http://h:p``), without the port."""
    rest = value.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1 : rest.find("]")] if "]" in rest else rest
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def local_only(request: Request) -> bool:
    """Serve loopback clients only (the default of ``python -m trio_agent serve``): the peer is a
    loopback address, and so are the ``Host`` the request names and its ``Origin`` if it has one, so
    a web page elsewhere cannot reach the app through a name it rebinds to 127.0.0.1."""
    peer = request.client.host if request.client is not None else ""
    if not _is_loopback(peer):
        return False
    if not _is_loopback(_host_of(request.headers.get("host", ""))):
        return False
    origin = request.headers.get("origin")
    return origin is None or _is_loopback(_host_of(origin))


def bearer_token(token: str) -> Auth:
    """Serve requests that carry ``Authorization: Bearer <token>`` (the scheme in any case, as
    RFC 7235 has it; the token compared in constant time, byte for byte). The token is visible
    ASCII: a header's bytes have no agreed text encoding, so any other secret could match nothing
    (or only what one client's encoding made of it)."""
    if not isinstance(token, str) or not token:
        raise ConfigError("bearer_token() needs a non-empty token")
    if not all("!" <= char <= "~" for char in token):
        raise ConfigError("a bearer token must be visible ASCII (no spaces, controls or other characters)")
    expected = token.encode("ascii")

    def check(request: Request) -> bool:
        # Starlette decodes header bytes as Latin-1: encoding back gives the bytes the client sent.
        scheme, _, credentials = request.headers.get("authorization", "").encode("latin-1").partition(b" ")
        return hmac.compare_digest(credentials.strip(b" \t"), expected) and scheme.lower() == b"bearer"

    return check


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _error(status: int, code: str, message: str, problems: Sequence[str] = (), **more: str) -> JSONResponse:
    body: dict[str, Any] = {"error": code, "message": message, **more}
    if problems:
        body["problems"] = list(problems)
    return JSONResponse(body, status_code=status)


class _Server:
    """What one app keeps between requests: the runs in flight and the paused threads."""

    def __init__(
        self,
        model: Any,
        *,
        tools: Sequence[Tool[Any] | ClientTool],
        chat_options: Mapping[str, Any],
        keep_alive: float,
        max_body: int,
        body_timeout: float,
        buffer: int,
        max_paused: int,
        signing_key: bytes,
    ) -> None:
        self.model = model
        self.tools = tuple(tools)
        self.chat_options = dict(chat_options)
        self.keep_alive = keep_alive
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.buffer = buffer
        self.max_paused = max_paused
        self.signing_key = signing_key
        self.runs: dict[str, Callable[[], object]] = {}  # run id -> stop it
        self.thread_runs: dict[str, str] = {}  # thread id -> its run in flight (without threads)
        self.threads: tuple[AgentSpec, Any] | None = None  # (spec, journal) when threads are sessions
        self.hub: ThreadHub | None = None
        self.paused: collections.OrderedDict[str, PausedRun] = collections.OrderedDict()
        self.paused_sizes: dict[str, int] = {}
        self.paused_bytes = 0

    def keep_paused(self, thread_id: str, paused: PausedRun) -> None:
        """Keep a thread's paused run; the least recently paused go first past ``max_paused``
        runs or `PAUSED_BYTES` of their JSON (a paused run carries its whole history)."""
        self.drop_paused(thread_id)
        size = len(json.dumps(paused.to_json(), default=str))
        self.paused[thread_id] = paused.signed(self.signing_key)
        self.paused_sizes[thread_id] = size
        self.paused_bytes += size
        while self.paused and (len(self.paused) > self.max_paused or self.paused_bytes > PAUSED_BYTES):
            self.drop_paused(next(iter(self.paused)))

    def drop_paused(self, thread_id: str) -> PausedRun | None:
        self.paused_bytes -= self.paused_sizes.pop(thread_id, 0)
        return self.paused.pop(thread_id, None)


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or ``None`` past *limit* bytes (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


_SSE_HEADERS = [
    (b"content-type", CONTENT_TYPE.encode() + b"; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies: do not buffer a stream
]


def _sse_response(response: Response) -> None:
    """A 200 event stream's status and headers. No Content-Length: the body is a stream (Response's
    own ``__init__`` would declare 0, so the SSE responses set these instead of calling it)."""
    response.status_code = 200
    response.background = None
    response.raw_headers = list(_SSE_HEADERS)


class _RunStream(Response):
    """The SSE response of one run: the run, the client and the keep-alive in one nursery."""

    def __init__(self, server: _Server, run_input: RunInput, start: Callable[[AbortHandle], Any]) -> None:
        _sse_response(self)
        self.server = server
        self.run_input = run_input
        self.start = start  # opens the chat run (an async context manager) with this abort handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server, run_id, thread_id = self.server, self.run_input.run_id, self.run_input.thread_id
        abort = AbortHandle()
        # Taken with no checkpoint since `runs` checked both were free: one run per thread, so a
        # second pause cannot replace the first in the thread's slot.
        server.runs[run_id] = functools.partial(abort.abort, AbortReason.USER_ABORT, "stopped by the client")
        server.thread_runs[thread_id] = run_id
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            frames_in, frames_out = trio.open_memory_channel[bytes](server.buffer)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run, abort, frames_in)
                nursery.start_soon(_watch_disconnect, receive, abort)
                try:
                    await self._forward(frames_out, send)
                except OSError:  # the client went away while we wrote to it
                    abort.abort(AbortReason.USER_ABORT, "the client disconnected")
                finally:
                    frames_out.close()  # the run stops sending (its block aborts the run)
                nursery.cancel_scope.cancel()  # the run has ended: stop watching the client
        finally:
            server.runs.pop(run_id, None)
            if server.thread_runs.get(thread_id) == run_id:
                del server.thread_runs[thread_id]

    async def _forward(self, frames: trio.MemoryReceiveChannel[bytes], send: Send) -> None:
        while True:
            with trio.move_on_after(self.server.keep_alive) as idle:
                try:
                    frame = await frames.receive()
                except trio.EndOfChannel:
                    break
            frame = KEEP_ALIVE if idle.cancelled_caught else _with_ready(frame, frames)
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _run(self, abort: AbortHandle, frames: trio.MemorySendChannel[bytes]) -> None:
        run_input = self.run_input
        encoder = AgUiEncoder(thread_id=run_input.thread_id, run_id=run_input.run_id)
        # The run's RunFinished / RunError, held back until the run has ended: what it emits after
        # it (on_finish, on_error, a deferred function) goes out before it, AG-UI's last event, and
        # a pause is kept before its client reads RUN_FINISHED and may answer it.
        end: RunFinished | RunError | None = None
        failure: Exception | None = None
        async with frames:
            try:
                async with self.start(abort) as run:
                    async for event in run:
                        if isinstance(event, (RunFinished, RunError)) and event.run_id == run_input.run_id:
                            end = event
                            continue
                        for data in encoder.wire(event):
                            await frames.send(sse_event(data))
                    result = await run.result()
                if result.paused is not None:
                    self.server.keep_paused(run_input.thread_id, result.paused)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the client is gone: leaving the block aborted the run
            except Exception as exc:
                failure = exc
            try:
                for data in self._ending(encoder, end, failure):
                    await frames.send(sse_event(data))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    def _ending(
        self, encoder: AgUiEncoder, end: RunFinished | RunError | None, failure: Exception | None
    ) -> list[dict[str, Any]]:
        """The stream's one terminal event: the run's own, unless it cannot be: a pause that was not
        kept cannot be answered, and a run that failed without saying so, or whose end cannot be
        written, fails. An error after the run's own end (an ``on_finish`` that failed) is logged."""
        run_input = self.run_input
        if isinstance(end, RunFinished) and failure is not None:
            if end.outcome == "interrupt":
                end = None  # the pause was not kept: RUN_ERROR, below, not an interrupt nobody can answer
            else:
                logger.warning(
                    "run %r of thread %r failed after it finished (its RUN_FINISHED is the stream's end): %s",
                    run_input.run_id,
                    run_input.thread_id,
                    failure,
                    exc_info=failure,
                )
        if end is not None:
            try:
                return encoder.wire(end)
            except Exception as exc:  # an encoder's bug: the stream still ends, with the error
                failure = exc
        if failure is None:  # pragma: no cover - the loop always ends a run it did not fail with its end
            failure = RuntimeError("the run ended without its end")
        if isinstance(failure, TrioAgentError):
            message, code = describe(failure, "text"), error_code(failure) or "run_failed"
        else:
            # Whatever failed (the run, keeping its pause, writing an event of it: an encoder's bug), the
            # stream says so and ends: an error let out of here would leave the client with no end.
            logger.error("run %r of thread %r failed", run_input.run_id, run_input.thread_id, exc_info=failure)
            message, code = f"the run failed: {describe(failure)}", "run_failed"
        return [to_wire(RunErrorEvent(message=message, code=code))]


_BATCH = 64 * 1024  # bytes of ready frames written in one piece


def _with_ready(frame: bytes, frames: trio.MemoryReceiveChannel[bytes]) -> bytes:
    """*frame* and the frames already waiting behind it, up to `_BATCH` bytes: one write for a
    burst (the run produces faster than the socket takes them), one per frame when it does not."""
    batch = [frame]
    size = len(frame)
    while size < _BATCH:
        try:
            more = frames.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break
        batch.append(more)
        size += len(more)
    return frame if len(batch) == 1 else b"".join(batch)


async def _watch_disconnect(receive: Receive, abort: AbortHandle) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            abort.abort(AbortReason.USER_ABORT, "the client disconnected")
            return


_CHAT = inspect.signature(chat)
_SET_PER_RUN = frozenset({"agent_or_model", "messages", "resume", "answers", "abort", "signing_key", "tools"})
"""chat()'s arguments that create_app gives each run itself (``tools`` and ``signing_key`` are its own)."""
_AGENT_NAMES = {
    "instructions": "system_prompt",
    "middleware": "lifecycle",
    "permissions": "permissions",
    "permission_mode": "permission_mode",
    "workspace_roots": "workspace_roots",
    "interrupts": "interrupts",
}
"""Chat options a thread's agent takes too, by their name in create_app (chat()'s) -> define_agent's.
``model_middleware`` and ``tool_middleware`` make its ``MiddlewareConfig`` (`_agent_options`)."""
_LAYERS = ("model_middleware", "tool_middleware")
_RENAMED = {"system_prompt": "instructions", "lifecycle": "middleware"}
"""define_agent's names for chat options: create_app takes chat()'s name in both modes."""
_AGENT_ONLY = frozenset(inspect.signature(define_agent).parameters) - {
    "provider",
    "tools",
    "permission_asks",
    "middleware",
    *_RENAMED,
    *_AGENT_NAMES.values(),
}
"""Options only a thread's agent takes (``max_turns``, ``hooks``, ``plugins`` ...)."""
_CHAT_ONLY = frozenset(_CHAT.parameters) - _SET_PER_RUN - set(_AGENT_NAMES) - set(_LAYERS)
"""Options only a chat() run takes (``output_schema``, ``strategy``, ``metadata`` ...)."""


def _chat_options(options: Mapping[str, Any], *, threads: bool) -> dict[str, Any]:
    """create_app's chat options, by name: those the mode takes (docs/web.md, "Chat options"), or a
    `ConfigError` naming each other one and what to use instead. The same name means the same
    thing in both modes: ``instructions`` is the system prompt, ``middleware`` chat middleware."""
    both = set(_AGENT_NAMES) | set(_LAYERS)
    takes = sorted(both | (_AGENT_ONLY if threads else _CHAT_ONLY))
    mode = "with threads=" if threads else "without threads="
    problems: list[str] = []
    for name in options:
        if name in _SET_PER_RUN:
            problems.append(f"{name}= is set by create_app() for each run itself")
        elif name == "permission_asks":
            problems.append('permission_asks= is "interrupt" for the threads\' agent (for another, give agent=)')
        elif name in _RENAMED:
            problems.append(f"{name}= is called {_RENAMED[name]}= in create_app() (with or without threads)")
        elif name in _AGENT_ONLY and not threads:
            problems.append(f"{name}= applies only with threads= (an option of the threads' agent, define_agent())")
        elif name in _CHAT_ONLY and threads:
            problems.append(f"{name}= applies only without threads= (an option of a chat() run)")
        elif name not in takes:
            close = difflib.get_close_matches(name, takes + list(_RENAMED), n=1)
            problems.append(f"{name}= is not a chat option" + (f" (did you mean {close[0]}=?)" if close else ""))
    if problems:
        listed = ", ".join(f"{name}=" for name in takes)
        raise ConfigError(f"create_app(): {'; '.join(problems)}. Chat options {mode}: {listed}")
    if isinstance(options.get("middleware"), MiddlewareConfig):
        raise ConfigError(
            "create_app(middleware=...) takes chat middleware (a list of ChatMiddleware), with or without "
            "threads; a MiddlewareConfig's layers go in model_middleware= and tool_middleware="
        )
    instructions = options.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ConfigError(f"instructions must be a string, not {instructions!r:.200}")
    metadata = options.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a mapping, not {metadata!r:.200}")
    return dict(options)


def _chat_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """chat()'s arguments by name, defaults included: what one call of it holds (its ``locals()``)."""
    bound = _CHAT.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _agent_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Checked chat options (`_chat_options` with threads) as define_agent's arguments. chat()'s
    ``None`` for ``instructions`` and ``permission_mode`` is its default: define_agent's default too."""
    agent = {
        _AGENT_NAMES.get(name, name): value
        for name, value in options.items()
        if name not in _LAYERS and not (value is None and name in ("instructions", "permission_mode"))
    }
    if any(name in options for name in _LAYERS):
        agent["middleware"] = MiddlewareConfig(
            model=options.get("model_middleware", ()), tool=options.get("tool_middleware", ())
        )
    return agent


def create_app(
    model: Any,
    *,
    auth: Auth,
    tools: Sequence[Tool[Any] | ClientTool] = (),
    keep_alive: float = 15.0,
    max_body: int = 1_000_000,
    body_timeout: float = 30.0,
    buffer: int = 64,
    max_paused: int = 1_000,
    signing_key: bytes | None = None,
    threads: str | os.PathLike[str] | JournalStore | None = None,
    agent: AgentSpec | None = None,
    page: bool = True,
    **chat_options: Any,
) -> Starlette:
    """An ASGI app (Starlette) serving ``model`` as AG-UI runs (see the module rules).

    ``model`` and ``chat_options`` (``instructions``, ``middleware``, ``permissions``,
    ``permission_mode``, ``strategy`` ...) are what each run passes to ``chat()``;
    ``tools`` run on the server. Serve it with `serve` (Hypercorn under Trio).

    ``page`` serves the chat page at ``/`` (its files under ``/static``).

    With ``threads`` (a SQLite path or a `JournalStore`), a thread is a durable session
    of ``agent`` (default: ``define_agent(provider=model, tools=tools, permission_asks="interrupt",
    ...)`` with the chat options, see `_agent_options`): see `_threads` for what that changes.

    The chat options are checked here, names and values (`_chat_options`): a ``ConfigError``
    names one that the mode does not take, never a 200 then a ``RUN_ERROR`` for every request.
    """
    if not callable(auth):
        raise TypeError("create_app() needs auth=, a callable on the request (local_only, bearer_token(...))")
    if agent is not None:
        if threads is None:
            raise ConfigError("create_app(agent=...) needs threads=: the agent is what a thread's session runs")
        if chat_options or tools:
            given = ", ".join(f"{name}=" for name in [*(["tools"] if tools else []), *chat_options])
            raise ConfigError(
                f"create_app(agent=...) takes the agent as defined: give {given} to its define_agent() instead"
            )
    options = _chat_options(chat_options, threads=threads is not None)
    signing_key = secrets.token_bytes(32) if signing_key is None else check_signing_key(signing_key)
    if threads is None:
        # Checked here, not at serve time, where a bad value broke every request after its 200:
        # the run's own checks (chat()'s), on what each run passes.
        _Prepared(_chat_arguments(model, "check", tools=tools, signing_key=signing_key, **options))
    server = _Server(
        model,
        tools=tools,
        chat_options=options if threads is None else {},
        keep_alive=validate_timeout(keep_alive, name="keep_alive"),
        max_body=validate_limit(max_body, name="max_body"),
        body_timeout=validate_timeout(body_timeout, name="body_timeout"),
        buffer=validate_limit(buffer, name="buffer", minimum=0),
        max_paused=validate_limit(max_paused, name="max_paused"),
        signing_key=signing_key,
    )

    async def authorized(request: Request) -> bool:
        verdict = auth(request)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return verdict is True

    async def runs(request: Request) -> Response:
        if not await authorized(request):
            return _error(401, "unauthorized", "this request is not authorized")
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            return _error(415, "unsupported_media_type", f"POST a RunAgentInput as application/json, not {media!r}")
        # A deadline for the whole body: a client that stalls must not hold its connection and
        # this task for ever (Hypercorn bounds only the headers; see _serve for its read_timeout).
        body: bytes | None = None
        with trio.move_on_after(server.body_timeout) as reading:
            body = await _read_body(request, server.max_body)
        if reading.cancelled_caught:
            return _error(408, "body_timeout", f"the body did not arrive within {server.body_timeout:g} seconds")
        if body is None:
            return _error(413, "body_too_large", f"the body is larger than {server.max_body} bytes")
        try:
            data = json.loads(body, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            return _error(400, "invalid_json", f"the body is not JSON: {what}")
        try:
            run_input = parse_run_input(data)
        except InputError as exc:
            return _error(422, "invalid_input", "the RunAgentInput cannot be read", exc.problems)
        if server.threads is not None:
            if server.hub is None:  # served without its lifespan (the hub lives there)
                return _error(
                    503, "threads_unavailable", "the app's threads start with its lifespan, which did not run"
                )
            return await _thread_run(server, server.hub, run_input)
        if run_input.run_id in server.runs:
            return _error(409, "run_in_progress", f"run {run_input.run_id!r} is already running")
        running = server.thread_runs.get(run_input.thread_id)
        if running is not None:
            return _error(409, "run_in_progress", f"thread {run_input.thread_id!r} is running {running!r}")
        known = {tool.name for tool in server.tools}
        tools_of_run = [*server.tools, *(tool for tool in run_input.tools if tool.name not in known)]
        ids = {"run_id": run_input.run_id, "thread_id": run_input.thread_id}
        metadata = {**(server.chat_options.get("metadata") or {}), **ids}
        options = {
            **server.chat_options,
            "tools": tools_of_run,
            "signing_key": server.signing_key,
            "metadata": metadata,
        }
        if run_input.resume:
            paused = server.paused.get(run_input.thread_id)
            if paused is None:
                return _error(409, "nothing_to_resume", f"thread {run_input.thread_id!r} has no paused run")
            try:
                answers = answers_for(run_input.resume, paused.state.interrupts)
                _check_answers(paused, answers, server.signing_key, tools_of_run)
            except InterruptResumeError as exc:
                return _error(422, "invalid_answers", str(exc), [issue.message for issue in exc.issues])
            server.drop_paused(run_input.thread_id)  # accepted once

            def start(abort: AbortHandle) -> Any:
                return chat(server.model, resume=paused, answers=answers, abort=abort, **options)

        else:
            if not run_input.messages:
                return _error(422, "invalid_input", "the RunAgentInput has no message to answer", ["$.messages: empty"])
            try:
                check_history(run_input)  # what chat() would refuse once streaming, as a RUN_ERROR
            except InputError as exc:
                return _error(422, "invalid_input", "the RunAgentInput's messages are not a conversation", exc.problems)

            def start(abort: AbortHandle) -> Any:
                return chat(server.model, list(run_input.messages), abort=abort, **options)

        return _RunStream(server, run_input, start)

    async def abort_run(request: Request) -> Response:
        if not await authorized(request):
            return _error(401, "unauthorized", "this request is not authorized")
        stop = server.runs.get(request.path_params["run_id"])
        if stop is None:
            return _error(404, "unknown_run", f"run {request.path_params['run_id']!r} is not running")
        stop()
        return JSONResponse({"aborted": True}, status_code=202)

    async def thread_view(request: Request) -> Response:
        if not await authorized(request):
            return _error(401, "unauthorized", "this request is not authorized")
        if server.threads is None:
            return _error(404, "no_threads", "this app keeps no threads (create_app(threads=...))")
        if server.hub is None:
            return _error(503, "threads_unavailable", "the app's threads start with its lifespan, which did not run")
        return await _thread_view(server, server.hub, request.path_params["thread_id"])

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if server.threads is None:
            yield
            return
        spec, journal = server.threads
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(journal, (str, os.PathLike)):
                journal = await stack.enter_async_context(open_sqlite_store(os.fspath(journal)))
            server.hub = await stack.enter_async_context(open_hub(spec, journal))
            try:
                yield
            finally:
                server.hub = None

    if threads is not None:
        spec = agent or define_agent(
            provider=model, tools=tools, permission_asks="interrupt", **_agent_options(options)
        )
        server.threads = (spec, threads)
    routes: list[Route | Mount] = [
        Route("/runs", runs, methods=["POST"]),
        Route("/runs/{run_id}/abort", abort_run, methods=["POST"]),
        Route("/threads/{thread_id}", thread_view, methods=["GET"]),
    ]
    if page:

        async def index(request: Request) -> Response:
            # The page holds nothing secret (a browser's navigation cannot send a token anyway):
            # the endpoints it calls are the ones that ask `auth`.
            return FileResponse(_STATIC / "index.html", media_type="text/html")

        routes.append(Route("/", index, methods=["GET"]))
        routes.append(Mount("/static", app=StaticFiles(directory=_STATIC), name="static"))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.agui = server
    return app


def _check_answers(paused: PausedRun, answers: Sequence[Any], key: bytes, tools: Sequence[object]) -> None:
    """Refuse answers the run would refuse, before the stream starts (an HTTP 422, not an event)."""
    paused.verify(key)
    client_tools = {tool.name: tool for tool in tools if isinstance(tool, ClientTool)}
    _, issues = validate_answers(paused.state, answers, client_tools)
    if issues:
        raise InterruptResumeError(issues)


class _Follow(Response):
    """The SSE response of a client following a thread: ``prefix`` frames, then the live run's
    frames from its start (a reconnect replays them), until the run ends. A client that goes
    away only stops following; one owed frames that were dropped (it read too slowly, or it came
    after the run's first frames were dropped) gets a ``RUN_ERROR`` ``fell_behind`` and its stream
    ends (never a stream with a hole in it, nor a run's stream without its start)."""

    def __init__(self, server: _Server, prefix: Sequence[bytes], live: LiveRun | None) -> None:
        _sse_response(self)
        self.server = server
        self.prefix = list(prefix)
        self.live = live

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with trio.open_nursery() as nursery:

            async def stop_on_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_disconnect)
            with contextlib.suppress(OSError):  # the client went away while we wrote: the run goes on
                await self._forward(send)
            nursery.cancel_scope.cancel()

    async def _forward(self, send: Send) -> None:
        async def write(body: bytes) -> None:
            await send({"type": "http.response.body", "body": body, "more_body": True})

        if self.prefix:
            await write(b"".join(self.prefix))
        live, sent = self.live, 0  # owed every frame of the run, from its RUN_STARTED
        while live is not None:
            frames = live.since(sent)
            if frames is None:
                await write(_fell_behind(live, sent))
                break
            batch, end = frames
            if batch:
                sent = end
                await write(b"".join(batch))
                continue
            if live.done:
                break
            with trio.move_on_after(self.server.keep_alive) as idle:
                await live.changed()
            if idle.cancelled_caught:
                await write(KEEP_ALIVE)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _fell_behind(live: LiveRun, sent: int) -> bytes:
    """The ``RUN_ERROR`` of a follower owed frame ``sent`` of ``live``, which was dropped."""
    if sent == 0:  # nothing of the run sent yet: it came after the run's first frames were dropped
        message = (
            f"run {live.run_id!r} went more than {live.max_bytes} bytes of events past its start, and those were "
            "dropped: it cannot be replayed from its start (it goes on). GET /threads/{thread_id} for the "
            "conversation (once the run has ended, all of it)"
        )
    else:
        message = (
            f"this client read too slowly: run {live.run_id!r} went more than {live.max_bytes} bytes of events "
            "ahead of it, and those were dropped. Its stream ends here: GET /threads/{thread_id} again for a "
            "fresh MESSAGES_SNAPSHOT"
        )
    return sse_event(to_wire(RunErrorEvent(message=message, code="fell_behind")))


async def _open_thread(stack: contextlib.AsyncExitStack, hub: ThreadHub, thread_id: str) -> _Thread | Response:
    """The thread, in use until ``stack`` closes (see `ThreadHub.use`), or the HTTP error to answer:
    503 when its session cannot be opened here now (its store failed or refused, another process
    holds its lease, the server is stopping). Anything else is a fault of ours, not a 503: the id
    was checked at the door by the session's own rules."""
    try:
        return await stack.enter_async_context(hub.use(thread_id))
    except (JournalError, LeaseLostError, SessionClosedError) as exc:
        return _error(503, "thread_unavailable", f"thread {thread_id!r} cannot be opened: {exc}")


class _StopFirst:
    """A stop of a run whose request is still opening its thread's session (``server.runs``
    holds it meanwhile): kept, so the run is stopped as it starts."""

    def __init__(self) -> None:
        self.asked = False

    def __call__(self) -> None:
        self.asked = True


async def _thread_run(server: _Server, hub: ThreadHub, run_input: RunInput) -> Response:
    """``POST /runs`` on a thread backed by a session (see `_threads`). The run id takes its stop
    at once, before the thread's session opens (which may take a while): a stop that comes
    meanwhile is kept for the run, not refused as unknown while the run then runs to its end."""
    run_id = run_input.run_id
    stop_first: _StopFirst | None = None
    if run_id not in server.runs:  # else that run's own stop (a retry of it), or another's id: left as it is
        stop_first = server.runs[run_id] = _StopFirst()
    try:
        async with contextlib.AsyncExitStack() as stack:
            thread = await _open_thread(stack, hub, run_input.thread_id)
            if isinstance(thread, Response):
                return thread
            return _start_thread_run(server, hub, thread, run_input, stop_first)
    finally:  # no run started (an error, a replay): the id is free again
        if stop_first is not None and server.runs.get(run_id) is stop_first:
            del server.runs[run_id]


def _start_thread_run(
    server: _Server, hub: ThreadHub, thread: _Thread, run_input: RunInput, stop_first: _StopFirst | None
) -> Response:
    """The run's stream on the open ``thread`` (the request holds it), or why it cannot start;
    ``stop_first`` is the run id's stop while this request opened the thread."""
    run_id, live = run_input.run_id, thread.live
    asked = _asked(run_input)
    if live is not None and live.run_id == run_id:
        if live.input != asked:  # not a retry: answers or a new message would be dropped unseen
            return _error(
                409,
                "run_id_taken",
                f"run {run_id!r} of thread {run_input.thread_id!r} was asked something else: post a new runId",
            )
        return _Follow(server, (), live)  # the same run again (a client coming back, a retry): replayed
    if server.runs.get(run_id, stop_first) is not stop_first:
        return _error(409, "run_in_progress", f"run {run_id!r} is already running")
    session = thread.session
    ran = session.journal.projection().request(run_id)
    if ran is not None:  # a run of this thread whose events are gone (another run since, a restart): never again
        return _error(
            409,
            "run_ended",
            f"run {run_id!r} already ran on thread {run_input.thread_id!r} (it is {ran.state.value}) and its "
            "events are no longer kept: GET /threads/{thread_id} for the conversation, or post a new runId",
            state=ran.state.value,
        )
    if thread.busy:
        assert live is not None
        return _error(409, "run_in_progress", f"thread {run_input.thread_id!r} is running {live.run_id!r}")
    start: Callable[[Callable[[], object]], LiveRun]  # the run, once it may start (given what to do at its end)
    if run_input.resume:
        paused = session.paused
        if paused is None:
            return _error(409, "nothing_to_resume", f"thread {run_input.thread_id!r} has no paused run")
        try:
            answers = answers_for(run_input.resume, paused.state.interrupts)
        except InterruptResumeError as exc:
            return _error(422, "invalid_answers", str(exc), [issue.message for issue in exc.issues])
        _, issues = validate_answers(paused.state, answers, hub.spec.client_tools)
        if issues:
            return _error(422, "invalid_answers", str(InterruptResumeError(issues)), [i.message for i in issues])
        start = functools.partial(hub.start_resume, thread, run_input.thread_id, run_id, answers)
    else:
        last = run_input.messages[-1] if run_input.messages else None
        if not isinstance(last, UserMessage):
            problem = "$.messages: the last message must be the user's (the thread's history is the session's)"
            return _error(422, "invalid_input", "nothing new to answer on this thread", [problem])
        try:
            RequestQueue.check_message(last.content, None)  # the session's own check of a prompt
        except ConfigError as exc:
            where = f"$.messages[{run_input.message_index[-1]}].content"
            problem = f"{where}: {exc} (a thread takes the text of the last message: its text parts, joined)"
            return _error(422, "invalid_input", "nothing new to answer on this thread", [problem])
        if session.paused is not None:
            return _error(409, "thread_paused", f"thread {run_input.thread_id!r} waits for answers (resume it)")
        start = functools.partial(hub.start_request, thread, run_input.thread_id, run_id, last.content)

    def done() -> None:
        if server.runs.get(run_id) is stop:
            del server.runs[run_id]

    live = start(done)
    live.input = asked
    stop = live.request_stop
    server.runs[run_id] = stop
    if stop_first is not None and stop_first.asked:
        stop()  # it takes effect as the run's request opens (`LiveRun.request_stop`)
    return _Follow(server, (), live)


def _asked(run_input: RunInput) -> object:
    """What a thread's run is asked: its answers, or the text of its last message (a retry of the
    run posts the same; the rest of the input is not read on a thread)."""
    if run_input.resume:
        return ("resume", run_input.resume)
    last = run_input.messages[-1] if run_input.messages else None
    return ("prompt", last.content if isinstance(last, UserMessage) else None)


async def _thread_view(server: _Server, hub: ThreadHub, thread_id: str) -> Response:
    """``GET /threads/{id}``: the conversation so far, then the live run if there is one."""
    try:
        exists = await _thread_exists(hub, thread_id)
    except JournalError as exc:  # the store failed: as when the thread's session cannot be opened
        return _error(503, "thread_unavailable", f"thread {thread_id!r} cannot be read: {exc}")
    if not exists:
        return _error(404, "unknown_thread", f"thread {thread_id!r} does not exist")
    async with contextlib.AsyncExitStack() as stack:
        thread = await _open_thread(stack, hub, thread_id)
        if isinstance(thread, Response):
            return thread
        return _follow_thread(server, hub, thread)


def _follow_thread(server: _Server, hub: ThreadHub, thread: _Thread) -> Response:
    """The open ``thread``'s conversation (a snapshot), then its live run if one runs."""
    live = thread.live if thread.busy else None
    messages = thread.session.messages()
    if live is not None and live.first == 0:  # the live run's own messages come with its replayed events
        messages = messages[: live.history_len]
    # else the run's start is gone: its replay is a RUN_ERROR (see _Follow), after the conversation as it is now
    prefix = [sse_event(to_wire(MessagesSnapshotEvent(messages=messages_to_agui(messages))))]
    paused = hub.paused_frame(thread)
    if live is None and paused is not None:
        prefix.append(paused)
    return _Follow(server, prefix, live)


async def _thread_exists(hub: ThreadHub, thread_id: str) -> bool:
    try:
        validate_id(thread_id, name="thread id")
    except ConfigError:
        return False  # no session can have this id
    store = hub.journal
    return bool(await store.streams(thread_id))
