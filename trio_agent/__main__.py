"""Command line (``trio-agent`` or ``python -m trio_agent``): ``demo``, ``serve``, ``journal show PATH``,
and the PostgreSQL workers: ``worker``, ``submit``, ``answer``, ``sessions``, ``workers``."""

from __future__ import annotations

# Only the standard library at the top: until main() runs, a Ctrl-C is a traceback (Python's
# KeyboardInterrupt), so the package's own modules (Trio, the demo) are imported in it.
import argparse
import contextlib
import functools
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

INTERRUPTED = 128 + signal.SIGINT  # as `_terminate` says them, without importing Trio for it
TERMINATED = 128 + signal.SIGTERM

# The demo's notes, one background subagent each: 5000 take about 25 s and 450 MB offline. Past
# some bound a typo (an extra zero or six) is hours of work and gigabytes of files, not a demo.
MAX_DEMO_CALLS = 5000

_WORKER_COMMANDS = ("worker", "submit", "answer", "sessions", "workers")

# What each command needs beyond the package itself, by extra: checked before anything runs, so
# a missing one is one line, not a traceback from deep inside (or a group from inside trio.run).
_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "serve": ("web", ("starlette", "hypercorn")),
    **{command: ("postgres", ("psycopg",)) for command in _WORKER_COMMANDS},
}

_UNSET = object()  # an option not given (its default lives in a module imported later)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _at_most(limit: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _positive(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{value} is not <= {limit}")
        return value

    return parse


def _retention(text: str) -> float | None:
    """``--inbox-retention``: seconds >= 0, or ``none`` (keep done rows)."""
    from ._config import seconds_problem

    if text.strip().lower() == "none":
        return None
    refused = argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0, nor none (keep done rows)")
    try:
        value = float(text)
    except ValueError:
        raise refused from None
    if seconds_problem(value, allow_zero=True) is not None:  # below 0, NaN, infinite
        raise refused
    return value


def _seconds(text: str) -> float:
    from ._config import MAX_TIMEOUT

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0 and at most {MAX_TIMEOUT:g}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535; 0: any free port)")
    return value


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("trio_agent")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree without install
        return "unknown"


@contextlib.contextmanager
def _signals_kept() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM are noted, not acted on, in the block (the list holds them).

    While the command's modules import (the demo's take half a second), Python's own handling
    made a Ctrl-C a KeyboardInterrupt at whatever line ran: a traceback, or, inside some import,
    lost (a weakref callback), a Rust panic, a crash; and SIGTERM's default action killed the
    process silently. Handlers someone else set are left alone."""
    noted: list[int] = []
    previous: dict[int, Any] = {}

    def note(number: int, frame: object) -> None:
        noted.append(number)

    try:
        for number, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(number) is default:
                previous[number] = signal.signal(number, note)
    except ValueError:  # not the main thread: signals are not ours to handle
        pass
    try:
        yield noted
    finally:
        for kept, handler in previous.items():
            signal.signal(kept, handler)


def main(argv: list[str] | None = None) -> int:
    try:
        with _signals_kept() as noted:
            command = _command(argv)  # parsed, its extra checked, its modules imported
        if noted:  # said as the commands say it once they run
            stopped_by = signal.Signals(noted[0])
            print("interrupted" if stopped_by is signal.SIGINT else "terminated", file=sys.stderr)
            return INTERRUPTED if stopped_by is signal.SIGINT else TERMINATED
        return command()
    except KeyboardInterrupt:  # Ctrl-C in a command without handling of its own: no traceback
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # the reader went away (``... | head``): stop quietly, as other tools do
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's last flush does not fail again
        except (OSError, ValueError):  # pragma: no cover - stdout is not a file descriptor
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the closed pipe stopped


def _command(argv: list[str] | None) -> Callable[[], int]:
    """The command *argv* asks for, ready to run: its modules imported (so `main` can keep the
    signals that land meanwhile). argparse's errors, and a missing extra, exit here (status 2)."""
    parser = argparse.ArgumentParser(prog="trio-agent", description="trio_agent command line")
    parser.add_argument("--version", action="version", version=f"trio_agent {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the orchestration demo (offline by default: no API key needed)")
    demo.add_argument(
        "--calls",
        type=_at_most(MAX_DEMO_CALLS),
        default=6,
        help=f"how many notes, one background subagent each (default 6, at most {MAX_DEMO_CALLS})",
    )
    demo.add_argument(
        "--provider", choices=["openai", "anthropic"], default=None, help="run on a real model (needs its API key)"
    )
    demo.add_argument("--model", default=None, help="the model name (required with --provider)")
    demo.add_argument("--journal", default=None, help="keep the SQLite journal at this path (default: a temp file)")
    serve = commands.add_parser("serve", help="serve an agent over AG-UI (offline test model by default)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (default: loopback only)")
    serve.add_argument("--port", type=_port, default=8000, help="the port (default 8000; 0: any free port)")
    serve.add_argument(
        "--provider", choices=["openai", "anthropic"], default=None, help="serve a real model (needs its API key)"
    )
    serve.add_argument("--model", default=None, help="the model name (required with --provider)")
    serve.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' (needed off loopback)")
    serve.add_argument("--journal", default=None, help="keep the threads in this SQLite file (default: a temp file)")
    journal = commands.add_parser("journal", help="inspect a SQLite journal")
    journal_commands = journal.add_subparsers(dest="journal_command", required=True)
    show = journal_commands.add_parser("show", help="print a readable timeline of a journal")
    show.add_argument("path", help="the SQLite journal file")
    show.add_argument("--session", default=None, help="only this session")
    show.add_argument("--agent", default=None, help="only this agent's stream (e.g. root, reviewer-7)")
    dsn_help = "the PostgreSQL DSN (default: $TRIO_AGENT_DSN)"
    worker = commands.add_parser("worker", help="serve sessions submitted to a PostgreSQL database")
    worker.add_argument("--dsn", default=None, help=dsn_help)
    worker.add_argument("--agent", default=None, help="module:attribute of an AgentSpec (default: the offline agent)")
    worker.add_argument("--concurrency", type=_positive, default=8, help="sessions served at once (default 8)")
    worker.add_argument("--schema", default="trio_agent", help="the journal's schema (default trio_agent)")
    worker.add_argument("--lease-ttl", type=_seconds, default=30.0, help="session lease TTL in seconds (default 30)")
    worker.add_argument("--poll-interval", type=_seconds, default=2.0, help="fallback polling, seconds (default 2)")
    worker.add_argument(
        "--shutdown-grace", type=_seconds, default=30.0, help="on SIGTERM, seconds to finish before handing off"
    )
    worker.add_argument("--no-live", action="store_true", help="do not publish live text deltas")
    worker.add_argument("--worker-id", default=None, help="this worker's id (default host:pid:random)")
    prompt_help = "the largest prompt, in bytes of its JSON text (default 1000000)"
    worker.add_argument("--max-prompt-bytes", type=_positive, default=None, help=prompt_help + ": past it, refused")
    worker.add_argument(
        "--inbox-retention",
        type=_retention,
        default=_UNSET,  # DEFAULT_INBOX_RETENTION, whose module needs psycopg: imported once it is checked
        metavar="SECONDS",
        help="delete done submissions this long after they were done (default 604800: seven days; none keeps them)",
    )
    submit = commands.add_parser("submit", help="submit a request to a session served by workers")
    submit.add_argument("session_id")
    submit.add_argument("prompt")
    submit.add_argument("--dsn", default=None, help=dsn_help)
    submit.add_argument("--schema", default="trio_agent")
    submit.add_argument("--request-id", default=None, help="idempotency: the same id is submitted once")
    submit.add_argument("--priority", type=int, default=0, help="higher runs first within the session")
    submit.add_argument("--wait", type=_seconds, default=None, help="wait up to N seconds; print the outcome")
    submit.add_argument("--max-prompt-bytes", type=_positive, default=None, help=prompt_help)
    answer = commands.add_parser("answer", help="answer a paused session served by workers (a worker resumes it)")
    answer.add_argument("session_id")
    answer.add_argument(
        "--approve", nargs="+", action="append", default=[], metavar=("ID", "EDITED_ARGS_JSON"),
        help="approve a call (optionally with edited arguments, a JSON object)",
    )  # fmt: skip
    answer.add_argument(
        "--reject", nargs="+", action="append", default=[], metavar=("ID", "MESSAGE"),
        help="reject a call (the model reads MESSAGE)",
    )  # fmt: skip
    answer.add_argument(
        "--respond", nargs=2, action="append", default=[], metavar=("ID", "JSON"),
        help="answer a client tool or a question with a JSON value",
    )  # fmt: skip
    answer.add_argument("--cancel", action="append", default=[], metavar="ID", help="cancel a question")
    answer.add_argument("--answers", default=None, metavar="FILE", help="a JSON list of answers (- for stdin)")
    answer.add_argument("--dsn", default=None, help=dsn_help)
    answer.add_argument("--schema", default="trio_agent")
    answer.add_argument("--request-id", default=None, help="the continuation's id (idempotency, as submit's)")
    answer.add_argument(
        "--paused-request", default=None, metavar="ID", help="refuse (stale) unless the session is paused on ID"
    )
    answer.add_argument("--priority", type=int, default=0, help="higher runs first within the session")
    answer.add_argument("--wait", type=_seconds, default=None, help="wait up to N seconds; print the outcome")
    answer.add_argument("--max-prompt-bytes", type=_positive, default=None, help="the largest answers, bytes of JSON")
    for name, what in (("sessions", "list sessions and their state"), ("workers", "list workers and their load")):
        listing = commands.add_parser(name, help=what)
        listing.add_argument("--dsn", default=None, help=dsn_help)
        listing.add_argument("--schema", default="trio_agent")
        listing.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    missing = _missing_extra(args.command)
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        raise SystemExit(2)
    if args.command == "answer":
        for option, given in (("--approve", args.approve), ("--reject", args.reject)):
            for values in given:
                if len(values) > 2:
                    answer.error(f"{option} takes an interrupt id and at most one more value, not {len(values)}")
        if not (args.approve or args.reject or args.respond or args.cancel or args.answers):
            answer.error("give at least one answer: --approve, --reject, --respond, --cancel or --answers")
    if args.command in _WORKER_COMMANDS:
        from ._workers import _cli
        from ._workers._queue import DEFAULT_INBOX_RETENTION, DEFAULT_MAX_PROMPT_BYTES

        if args.command == "worker":
            return functools.partial(
                _cli.run_worker,
                dsn=args.dsn,
                agent=args.agent,
                concurrency=args.concurrency,
                schema=args.schema,
                lease_ttl=args.lease_ttl,
                poll_interval=args.poll_interval,
                shutdown_grace=args.shutdown_grace,
                live=not args.no_live,
                worker_id=args.worker_id,
                inbox_retention=DEFAULT_INBOX_RETENTION if args.inbox_retention is _UNSET else args.inbox_retention,
                max_prompt_bytes=args.max_prompt_bytes or DEFAULT_MAX_PROMPT_BYTES,
            )
        if args.command == "submit":
            return functools.partial(
                _cli.run_submit,
                dsn=args.dsn,
                schema=args.schema,
                session_id=args.session_id,
                prompt=args.prompt,
                request_id=args.request_id,
                priority=args.priority,
                wait=args.wait,
                max_prompt_bytes=args.max_prompt_bytes or DEFAULT_MAX_PROMPT_BYTES,
            )
        if args.command == "answer":
            return functools.partial(
                _cli.run_answer,
                dsn=args.dsn,
                schema=args.schema,
                session_id=args.session_id,
                answers={
                    "approve": args.approve,
                    "reject": args.reject,
                    "respond": args.respond,
                    "cancel": args.cancel,
                    "answers_file": args.answers,
                },
                request_id=args.request_id,
                paused_request_id=args.paused_request,
                priority=args.priority,
                wait=args.wait,
                max_prompt_bytes=args.max_prompt_bytes or DEFAULT_MAX_PROMPT_BYTES,
            )
        return functools.partial(_cli.run_listing, args.command, dsn=args.dsn, schema=args.schema, as_json=args.json)
    if args.command == "demo":
        if args.model is not None and args.provider is None:
            demo.error(
                "--model needs --provider (openai or anthropic); without it the offline test model plays every agent"
            )
        from ._demo import run_demo

        return functools.partial(
            run_demo, calls=args.calls, provider=args.provider, model=args.model, journal=args.journal
        )
    if args.command == "serve":
        if args.model is not None and args.provider is None:
            serve.error("--model needs --provider (openai or anthropic); without it the offline test model answers")
        from ._web._cli import run_serve

        return functools.partial(
            run_serve,
            host=args.host,
            port=args.port,
            provider=args.provider,
            model=args.model,
            token=args.token,
            journal=args.journal,
        )
    from ._journal._inspect import show_journal  # journal show: argparse leaves no other command

    return functools.partial(show_journal, args.path, args.session, args.agent)


def _missing_extra(command: str) -> str | None:
    """What *command* lacks of its extra (``serve needs pip install 'trio_agent[web]' (...)``), or ``None``."""
    if command not in _EXTRAS:
        return None
    extra, modules = _EXTRAS[command]
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # missing, or installed without what it needs (psycopg without libpq)
            return f"{command} needs pip install 'trio_agent[{extra}]' ({exc})"
    return None


if __name__ == "__main__":
    sys.exit(main())
