"""``trio-agent worker | submit | answer | sessions | workers``: the workers from the command line."""

from __future__ import annotations

import importlib
import json
import signal
import sys
from collections.abc import Callable
from typing import Any

import attrs
import trio

from .._errors import ConfigError, TrioAgentError
from ._queue import DEFAULT_INBOX_RETENTION, DEFAULT_MAX_PROMPT_BYTES

__all__ = ["answers_from_options", "load_spec", "run_answer", "run_listing", "run_submit", "run_worker"]


def load_spec(target: str | None) -> Any:
    """``module:attribute`` -> the `AgentSpec` it names (or a callable that returns one);
    ``None``: the offline agent."""
    from .._session._spec import AgentSpec

    if target is None:
        from ._offline import offline_spec

        return offline_spec()
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"error: --agent must be module:attribute (e.g. myapp.agents:spec), not {target!r}")
    try:
        found: Any = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(found, AgentSpec) and callable(found):
            found = found()
    except Exception as exc:  # the user's module: whatever it raises is reported, not a traceback
        raise SystemExit(f"error: cannot load --agent {target}: {type(exc).__name__}: {exc}") from None
    if not isinstance(found, AgentSpec):
        raise SystemExit(f"error: --agent {target} is not an AgentSpec (define_agent(...)), nor returns one")
    return found


async def _worker(spec: Any, options: dict[str, Any]) -> Any:
    """Serve until stopped; one exception out, never a group (`run_worker` prints a typed one)."""
    from .._groups import unwrap_for_boundary

    try:
        return await _serve_with_signals(spec, options)
    except BaseExceptionGroup as group:
        # A failure of `serve_sessions` (its start too: an unreachable database) comes out of
        # this nursery wrapped beside the signal task's cancellation.
        single = unwrap_for_boundary(group)
        if single is group:
            raise
        raise single from None


async def _serve_with_signals(spec: Any, options: dict[str, Any]) -> Any:
    from ._serve import serve_sessions

    stop = trio.Event()
    finished = trio.Event()
    async with trio.open_nursery() as nursery:

        async def signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for number in received:
                    if stop.is_set():  # a second signal: stop now (running requests are interrupted)
                        nursery.cancel_scope.cancel()
                        return
                    print(f"{signal.Signals(number).name}: stopping (again to stop at once)", file=sys.stderr)
                    stop.set()

        async def serving(task_status: trio.TaskStatus[Any]) -> None:
            await serve_sessions(spec, stop=stop, task_status=task_status, **options)
            finished.set()

        nursery.start_soon(signals)
        report = await nursery.start(serving)
        print(f"worker {report.worker_id} serving (concurrency {options['concurrency']})", flush=True)
        await finished.wait()
        nursery.cancel_scope.cancel()
    return report


def run_worker(
    *,
    dsn: str | None,
    agent: str | None,
    concurrency: int,
    schema: str,
    lease_ttl: float,
    poll_interval: float,
    shutdown_grace: float,
    live: bool,
    worker_id: str | None,
    inbox_retention: float | None = DEFAULT_INBOX_RETENTION,
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
) -> int:
    spec = load_spec(agent)
    if agent is None:
        print("the offline test model answers (no API key needed); --agent module:spec for yours", flush=True)
    options: dict[str, Any] = {
        "dsn": dsn,
        "concurrency": concurrency,
        "schema": schema,
        "lease_ttl": lease_ttl,
        "poll_interval": poll_interval,
        "shutdown_grace": shutdown_grace,
        "live": live,
        "worker_id": worker_id,
        "inbox_retention": inbox_retention,  # None keeps done rows
        "max_prompt_bytes": max_prompt_bytes,
    }
    try:
        report = trio.run(_worker, spec, options)
    except TrioAgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(attrs.asdict(report)), flush=True)
    return 0


def run_submit(
    *,
    dsn: str | None,
    schema: str,
    session_id: str,
    prompt: str,
    request_id: str | None,
    priority: int,
    wait: float | None,
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
) -> int:
    from ._queue import submit

    def submit_one(target: str) -> str:
        return submit(
            session_id,
            prompt,
            request_id=request_id,
            priority=priority,
            dsn=target,
            schema=schema,
            max_prompt_bytes=max_prompt_bytes,
        )

    return _submit_and_wait(dsn, schema, session_id, wait, submit_one)


def _json_option(option: str, interrupt_id: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{option} {interrupt_id}: not JSON: {exc}") from None


def answers_from_options(
    *,
    approve: list[list[str]],
    reject: list[list[str]],
    respond: list[list[str]],
    cancel: list[str],
    answers_file: str | None,
) -> list[Any]:
    """The answers ``trio-agent answer`` was given: ``--approve ID [EDITED_ARGS_JSON]``, ``--reject
    ID [MESSAGE]``, ``--respond ID JSON``, ``--cancel ID``, and a JSON file of answers (``-``:
    stdin) as `answers_from_json` reads them. `ConfigError` for text that is not JSON or a file
    that cannot be read; `InterruptResumeError` for a file whose answers are not answers."""
    from .._lifecycle._interrupts import answers_from_json
    from .._loop._interrupts import Approve, Cancel, Reject, Respond

    answers: list[Any] = []
    if answers_file is not None:
        try:
            if answers_file == "-":
                text = sys.stdin.read()
            else:
                with open(answers_file, encoding="utf-8") as file:
                    text = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the answers file {answers_file!r}: {exc}") from None
        answers.extend(answers_from_json(_json_option("--answers", answers_file, text)))
    for interrupt_id, *edited in approve:
        answers.append(Approve(interrupt_id, _json_option("--approve", interrupt_id, edited[0]) if edited else None))
    for interrupt_id, *message in reject:
        answers.append(Reject(interrupt_id, message[0] if message else None))
    for interrupt_id, value in respond:
        answers.append(Respond(interrupt_id, _json_option("--respond", interrupt_id, value)))
    answers.extend(Cancel(interrupt_id) for interrupt_id in cancel)
    return answers


def run_answer(
    *,
    dsn: str | None,
    schema: str,
    session_id: str,
    answers: dict[str, Any],
    request_id: str | None,
    paused_request_id: str | None,
    priority: int,
    wait: float | None,
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
) -> int:
    """``trio-agent answer``: as ``submit``, with answers (*answers*: `answers_from_options`'s options)."""
    from ._queue import submit_answers

    def submit_one(target: str) -> str:
        return submit_answers(
            session_id,
            answers_from_options(**answers),
            request_id=request_id,
            paused_request_id=paused_request_id,
            priority=priority,
            dsn=target,
            schema=schema,
            max_prompt_bytes=max_prompt_bytes,
        )

    return _submit_and_wait(dsn, schema, session_id, wait, submit_one)


def _submit_and_wait(
    dsn: str | None,
    schema: str,
    session_id: str,
    wait: float | None,
    submit_one: Callable[[str], str],
) -> int:
    """Submit (``submit_one(dsn)`` returns the request id), print the id and, with *wait*, the
    outcome as JSON. The exit status: 0 done (completed, or not waited for), 1 refused, 3 not
    ended in time, 4 ended otherwise."""
    from ._queue import resolve_dsn

    request_id = None
    try:
        request_id = submit_one(target := resolve_dsn(dsn))
        print(request_id, flush=True)
        if wait is None:
            return 0
        outcome = trio.run(_wait, target, schema, session_id, request_id, wait)
    except TrioAgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except trio.TooSlowError:
        print(f"error: request {request_id} did not end within {wait} s (it stays queued)", file=sys.stderr)
        return 3
    print(json.dumps(attrs.asdict(outcome)), flush=True)
    return 0 if outcome.state == "completed" else 4


async def _wait(dsn: str, schema: str, session_id: str, request_id: str, seconds: float) -> Any:
    from .._journal._postgres import open_postgres_store
    from ._results import wait_for_request

    async with open_postgres_store(dsn, schema=schema) as store:
        with trio.fail_after(seconds):
            return await wait_for_request(store, session_id, request_id)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def _session_rows(sessions: list[Any]) -> list[list[str]]:
    def left(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds:.1f}s"

    return [[s.session_id, s.state, s.worker or "-", left(s.lease_until), f"{s.queued}"] for s in sessions]


def _worker_rows(workers: list[Any]) -> list[list[str]]:
    def state(w: Any) -> str:
        return "live" if w.live and not w.stopping else "stopping" if w.live else "gone"

    return [
        [w.worker_id, state(w), f"{w.hosted}/{w.concurrency}", f"{w.served}", f"{w.seen_ago:.1f}s", f"{w.uptime:.0f}s"]
        for w in workers
    ]


_LISTINGS = {
    "sessions": ("list_sessions", _session_rows, ["SESSION", "STATE", "WORKER", "LEASE LEFT", "QUEUED"]),
    "workers": ("list_workers", _worker_rows, ["WORKER", "STATE", "SESSIONS", "SERVED", "SEEN", "UPTIME"]),
}


def run_listing(what: str, *, dsn: str | None, schema: str, as_json: bool) -> int:
    """``trio-agent sessions`` / ``trio-agent workers``: a table, or JSON."""
    from . import _queue

    function, to_rows, header = _LISTINGS[what]
    try:
        found = getattr(_queue, function)(dsn=dsn, schema=schema)
    except TrioAgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps([attrs.asdict(item) for item in found]))
    else:
        print(_table(to_rows(found), header))
    return 0
