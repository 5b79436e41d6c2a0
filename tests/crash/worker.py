"""A crash-harness worker: one process that owns a session's journal until it dies.

Run it as ``python -m tests.crash.worker ...`` (or by path) from the repository
root; `tests.crash.harness` drives it. It prints one line per fact, flushed at
once, so a SIGKILL never loses a line that was printed:

* ``OPENED {"token": ..., "owner": ...}`` once the lease is held;
* ``RECOVERED {json}`` with what `DurableJournal.recover` decided;
* ``NEGCTRL_RERUN <call_id>`` (negative control only);
* ``CLOSED {json}`` with the turns and requests it closed after recovery;
* ``ACK <call_id>`` only after ``ToolPipeline.execute`` returned a completed call,
  i.e. after its settlement committed;
* ``CRASHING <point>`` right before it SIGKILLs itself at a crash point;
* ``DONE {json}`` when it finished its work and is about to release the lease.

Modes:

``run`` (default)
    Take the session over (waiting out a dead owner's lease), recover, re-execute
    ``report.to_execute`` through a fresh live `ToolPipeline` with each call's
    stored idempotency key, close open turns and requests, then run ``--requests``
    new requests of one turn each with ``--calls-per-turn`` calls cycling the
    ``pure`` / ``idempotent`` / ``non_idempotent`` tools.

    Every tool appends an fsynced line ``call_id,kind,idempotency_key,attempt``
    to the ``--ledger`` file: the side effect the harness checks.

    ``--crash-at KIND:N:before|after[:SIDE_EFFECT]`` SIGKILLs the process right
    before the N-th write (in this process) holding an event of KIND reaches the
    store, or right after its commit returned. KIND is an event name in
    snake_case (``tool_scheduled``, ``tool_started``, ``tool_completed``,
    ``recovery_decision``, ``turn_completed`` ...); SIDE_EFFECT restricts tool
    events to calls of that side effect.

    ``--negative-control`` breaks recovery on purpose: every started
    ``non_idempotent`` call that recovery settled ``outcome_unknown`` is run
    AGAIN (its tool function directly, past the journal, which would refuse it),
    so the harness must report a duplicate effect.

``hold`` / ``takeover`` (the SIGSTOP test)
    ``hold`` takes the lease, builds a raw append with its fencing token, prints
    ``HOLDING {json}`` and waits for a line on stdin; then submits the raw batch
    straight to the store (past every local ownership check, as a write that was
    already under way when the process was paused) and prints ``RAW_WRITE ...``,
    then tries a normal journal write and prints ``JOURNAL_WRITE ...``.
    ``takeover`` takes the lease over (waiting for expiry), appends a request,
    prints ``TOOK {json}`` and ``APPENDED {json}``, waits for a line on stdin,
    appends once more (``APPENDED``) and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio

from trio_agent import ToolResult, define_tool
from trio_agent.journal import (
    AppendBatch,
    AppendResult,
    AppendTicket,
    DurableJournal,
    EventEnvelope,
    JournalStore,
    RecoveryKind,
    RequestAccepted,
    RequestCompleted,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    TurnCompleted,
    open_journal,
    open_postgres_store,
    open_sqlite_store,
)
from trio_agent.testing import start_turn
from trio_agent.tools import CallOrigin, ToolCall, ToolPipeline

SIDE_EFFECTS = ("pure", "idempotent", "non_idempotent")
TOOL_NAMES = {"pure": "pure_tool", "idempotent": "idempotent_tool", "non_idempotent": "non_idempotent_tool"}


def say(tag: str, payload: object = None) -> None:
    """Print one protocol line and flush it (a later SIGKILL cannot lose it)."""
    if payload is None:
        line = tag
    elif isinstance(payload, str):
        line = f"{tag} {payload}"
    else:
        line = f"{tag} {json.dumps(payload, sort_keys=True)}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def append_ledger(path: str, call_id: str, kind: str, key: str, attempt: int) -> None:
    """The side effect: one line, written, flushed and fsynced before the tool returns."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{call_id},{kind},{key},{attempt}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- crash points


def _event_kind(event: object) -> str:
    """``ToolScheduled`` -> ``tool_scheduled``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(event).__name__).lower()


class CrashPoint:
    """``KIND:N:before|after[:SIDE_EFFECT[:SCOPE]]``; SIDE_EFFECT ``*`` is any; SCOPE is ``any`` (default),
    ``new`` (calls this worker scheduled) or ``recovered`` (calls an earlier worker scheduled)."""

    def __init__(self, spec: str, gen: int) -> None:
        parts = spec.split(":")
        if len(parts) not in (3, 4, 5) or parts[2] not in ("before", "after"):
            raise SystemExit(f"bad --crash-at {spec!r}: want KIND:N:before|after[:SIDE_EFFECT[:SCOPE]]")
        self.spec = spec
        self.kind = parts[0]
        self.n = int(parts[1])
        self.when = parts[2]
        self.side_effect = parts[3] if len(parts) >= 4 and parts[3] != "*" else None
        self.scope = parts[4] if len(parts) == 5 else "any"
        if self.side_effect is not None and self.side_effect not in SIDE_EFFECTS:
            raise SystemExit(f"bad side effect in --crash-at {spec!r}")
        if self.scope not in ("any", "new", "recovered"):
            raise SystemExit(f"bad scope in --crash-at {spec!r}")
        self.prefix = f"g{gen}-"
        self.seen = 0


def die(point: CrashPoint) -> None:
    say("CRASHING", point.spec)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("SIGKILL did not kill us")  # pragma: no cover


class CrashStore:
    """A store proxy that SIGKILLs the process at one write, before it is submitted or after it committed.

    Everything else passes through to the inner store.
    """

    def __init__(self, inner: JournalStore, point: CrashPoint | None) -> None:
        self.inner = inner
        self.clock = inner.clock
        self.point = point
        self.journal: DurableJournal | None = None

    def _side_effect(self, event: Any) -> str | None:
        effect = getattr(event, "side_effect", None)
        if effect is not None:
            return str(effect.value)
        call_id = getattr(event, "call_id", None)
        if call_id is None or self.journal is None:
            return None
        record = self.journal.call(call_id)
        return None if record is None else str(record.scheduled.side_effect.value)

    def _matches(self, batch: AppendBatch) -> bool:
        point = self.point
        if point is None:
            return False
        for envelope in batch.envelopes:
            event = envelope.event
            if _event_kind(event) != point.kind:
                continue
            if point.side_effect is not None and self._side_effect(event) != point.side_effect:
                continue
            call_id = getattr(event, "call_id", None)
            mine = call_id is not None and call_id.startswith(point.prefix)
            if point.scope != "any" and call_id is not None and mine != (point.scope == "new"):
                continue
            return True
        return False

    def submit(self, batch: AppendBatch) -> AppendTicket:
        point = self.point
        if point is not None and self._matches(batch):
            point.seen += 1
            if point.seen == point.n:
                if point.when == "before":
                    die(point)
                return _KillAfterCommit(batch, self.inner.submit(batch), point)
        return self.inner.submit(batch)

    async def append(self, batch: AppendBatch) -> AppendResult:
        return await self.submit(batch).wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _KillAfterCommit(AppendTicket):
    """Resolves like the inner ticket; once the commit succeeded, the process dies."""

    def __init__(self, batch: AppendBatch, inner: AppendTicket, point: CrashPoint) -> None:
        super().__init__(batch)
        self._inner = inner
        self._point = point

    @property
    def done(self) -> bool:
        return self._inner.done

    def outcome(self) -> AppendResult:
        return self._inner.outcome()

    async def wait(self) -> AppendResult:
        result = await self._inner.wait()  # a refusal raises here: nothing committed, no crash
        die(self._point)
        return result


# ---------------------------------------------------------------- stores and tools


@contextlib.asynccontextmanager
async def open_store(args: argparse.Namespace) -> AsyncIterator[JournalStore]:
    if args.store == "sqlite":
        async with open_sqlite_store(args.path) as sqlite_store:
            yield sqlite_store
    else:
        async with open_postgres_store(args.dsn, schema=args.schema) as pg_store:
            yield pg_store


def make_tools(ledger: str, attempts: Callable[[str], int]) -> dict[str, Any]:
    """One tool per side effect; each appends its ledger line (the effect) and returns."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tools: dict[str, Any] = {}
    for kind in SIDE_EFFECTS:

        async def run(input: dict[str, Any], ctx: Any, kind: str = kind) -> ToolResult:
            attempt = attempts(ctx.tool_call_id)
            # In a thread: a slow fsync must not starve the lease heartbeat.
            await trio.to_thread.run_sync(append_ledger, ledger, ctx.tool_call_id, kind, ctx.idempotency_key, attempt)
            return ToolResult.success({"n": input["n"], "kind": kind})

        tool = define_tool(
            run,
            name=TOOL_NAMES[kind],
            description=f"appends a {kind} line to the ledger",
            side_effect=kind,
            input_schema=schema,
        )
        tools[tool.name] = tool
    return tools


# ---------------------------------------------------------------- run mode


async def close_unfinished(journal: DurableJournal) -> dict[str, list[str]]:
    """Close what recovery leaves open: turns (completed), started requests (completed), unstarted ones."""
    closed: dict[str, list[str]] = {"turns": [], "requests": [], "interrupted": []}
    for _ in range(10):
        plan = journal.recovery_plan()
        progressed = False
        for item in plan.items:
            if item.kind is RecoveryKind.OPEN_TURN:
                assert item.turn_id is not None
                await journal.append(
                    TurnCompleted(request_id=item.request_id, turn_id=item.turn_id, has_tool_calls=True)
                )
                closed["turns"].append(item.turn_id)
                progressed = True
                break
            if item.kind is RecoveryKind.OPEN_REQUEST:
                await journal.append(RequestCompleted(request_id=item.request_id, output={"recovered": True}))
                closed["requests"].append(item.request_id)
                progressed = True
                break
            if item.kind is RecoveryKind.REQUEST_NOT_STARTED:
                await journal.append(
                    RequestInterrupted(request_id=item.request_id, reason=RequestInterruptReason.PROCESS_RESTART)
                )
                closed["interrupted"].append(item.request_id)
                progressed = True
                break
        if not progressed:
            return closed
    raise RuntimeError(f"recovery left unfinished work: {journal.recovery_plan().items}")


async def execute_and_ack(pipeline: ToolPipeline, call: ToolCall, origin: CallOrigin, key: str | None) -> None:
    record = await pipeline.execute(call, origin, idempotency_key=key)
    if record.status.value == "completed" and record.result.ok:
        say("ACK", call.id)
    else:
        say("NACK", {"call_id": call.id, "status": record.status.value})


async def run_mode(args: argparse.Namespace) -> None:
    point = CrashPoint(args.crash_at, args.gen) if args.crash_at else None
    async with open_store(args) as inner:
        store = CrashStore(inner, point)
        async with open_journal(
            store,
            session_id=args.session,
            owner=f"{args.owner}:{os.getpid()}",
            lease_ttl=args.lease_ttl,
            heartbeat_interval=args.lease_ttl / 5,
            takeover_timeout=args.takeover_timeout,
        ) as journal:
            store.journal = journal
            say("OPENED", {"token": journal.fencing_token(), "owner": journal.owner})

            def attempts(call_id: str) -> int:
                record = journal.call(call_id)
                return 0 if record is None else record.attempts

            tools = make_tools(args.ledger, attempts)
            report = await journal.recover(tools=tools)
            say(
                "RECOVERED",
                {
                    "decisions": {call_id: action.value for call_id, action in report.decisions.items()},
                    "to_execute": [scheduled.call_id for scheduled in report.to_execute],
                    "outcome_unknown": list(report.outcome_unknown),
                    "replayed": len(report.replayed),
                },
            )
            if args.negative_control:
                # THE BUG ON PURPOSE: re-run started non_idempotent calls whose outcome is unknown.
                for call_id in report.outcome_unknown:
                    record = journal.call(call_id)
                    assert record is not None
                    scheduled = record.scheduled
                    append_ledger(
                        args.ledger, call_id, scheduled.side_effect.value, scheduled.idempotency_key,
                        record.attempts + 1,
                    )  # fmt: skip
                    say("NEGCTRL_RERUN", call_id)
            # A fresh live pipeline: recovered calls run as new attempts with their stored keys.
            pipeline = ToolPipeline(tools.values(), journal=journal)
            for scheduled in report.to_execute:
                origin = CallOrigin(
                    session_id=journal.session_id,
                    agent_id=journal.root_agent_id,
                    request_id=scheduled.request_id,
                    turn_id=scheduled.turn_id,
                )
                call = ToolCall(scheduled.call_id, scheduled.tool_name, dict(scheduled.model_input))
                await execute_and_ack(pipeline, call, origin, scheduled.idempotency_key)
            say("CLOSED", await close_unfinished(journal))

            kinds = itertools.cycle(SIDE_EFFECTS)
            counter = itertools.count()
            for index in range(args.requests):
                request_id = f"g{args.gen}-r{index}"
                origin = await start_turn(journal, request_id=request_id, turn_id=f"{request_id}-t1")
                calls = [
                    ToolCall(f"{request_id}-c{j}", TOOL_NAMES[next(kinds)], {"n": next(counter)})
                    for j in range(args.calls_per_turn)
                ]
                if args.parallel:
                    async with trio.open_nursery() as nursery:
                        for call in calls:
                            nursery.start_soon(execute_and_ack, pipeline, call, origin, None)
                else:
                    for call in calls:
                        await execute_and_ack(pipeline, call, origin, None)
                await journal.append(
                    TurnCompleted(request_id=request_id, turn_id=origin.turn_id, has_tool_calls=bool(calls))
                )
                await journal.append(RequestCompleted(request_id=request_id, output={"calls": len(calls)}))
            say("DONE", {"crash_point_seen": None if point is None else point.seen})


# ---------------------------------------------------------------- hold / takeover modes (SIGSTOP)


def _request_events(request_id: str) -> tuple[RequestAccepted, RequestStarted]:
    return (
        RequestAccepted(request_id=request_id, command_id=f"cmd-{request_id}", input={"prompt": request_id}),
        RequestStarted(request_id=request_id),
    )


async def read_stdin_line() -> str:
    line: str = await trio.to_thread.run_sync(sys.stdin.readline)
    return line.strip()


async def hold_mode(args: argparse.Namespace) -> None:
    async with open_store(args) as store:
        try:
            async with open_journal(
                store,
                session_id=args.session,
                owner=f"hold:{os.getpid()}",
                lease_ttl=args.lease_ttl,
                # The first renewal is far off: the test stops us long before it (never mid-transaction).
                heartbeat_interval=args.lease_ttl * 0.7,
                takeover_timeout=args.takeover_timeout,
            ) as journal:
                stream_id = journal.stream_id()
                head = journal.projection().head
                # A write prepared while we own the lease, as if it was under way when we were paused.
                zombie = RequestAccepted(request_id="zombie-raw", command_id="cmd-zombie-raw", input={"p": "x"})
                envelope = EventEnvelope(stream_id=stream_id, seq=head + 1, event=zombie, recorded_at=store.clock())
                batch = AppendBatch(journal.session_id, stream_id, journal.fencing_token() or 0, (envelope,))
                say("HOLDING", {"token": journal.fencing_token(), "head": head, "stream_id": stream_id})
                await read_stdin_line()
                with trio.CancelScope(shield=True):
                    try:
                        with trio.fail_after(10):
                            result = await store.submit(batch).wait()
                    except Exception as exc:
                        say("RAW_WRITE", {"refused": type(exc).__name__, "message": str(exc)})
                    else:
                        say("RAW_WRITE", {"accepted": [result.first_seq, result.last_seq]})
                    try:
                        with trio.fail_after(10):
                            result = await journal.append(*_request_events("zombie-journal"))
                    except Exception as exc:
                        say("JOURNAL_WRITE", {"refused": type(exc).__name__, "message": str(exc)})
                    else:
                        say("JOURNAL_WRITE", {"accepted": [result.first_seq, result.last_seq]})
                await trio.lowlevel.checkpoint()
        except Exception as exc:
            say("EXIT", {"error": type(exc).__name__})
            return
        say("EXIT", {"error": None})


async def takeover_mode(args: argparse.Namespace) -> None:
    async with (
        open_store(args) as store,
        open_journal(
            store,
            session_id=args.session,
            owner=f"takeover:{os.getpid()}",
            lease_ttl=args.lease_ttl,
            takeover_timeout=args.takeover_timeout,
        ) as journal,
    ):
        say("TOOK", {"token": journal.fencing_token(), "head": journal.projection().head})
        result = await journal.append(*_request_events("from-b-1"))
        say("APPENDED", {"first_seq": result.first_seq, "last_seq": result.last_seq})
        await read_stdin_line()
        result = await journal.append(RequestCompleted(request_id="from-b-1", output={"done": True}))
        say("APPENDED", {"first_seq": result.first_seq, "last_seq": result.last_seq})
    say("EXIT", {"error": None})


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tests.crash.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("run", "hold", "takeover"), default="run")
    parser.add_argument("--store", choices=("sqlite", "postgres"), required=True)
    parser.add_argument("--path", help="the SQLite file")
    parser.add_argument("--dsn", help="the PostgreSQL DSN")
    parser.add_argument("--schema", help="the PostgreSQL schema")
    parser.add_argument("--session", required=True)
    parser.add_argument("--ledger", help="the side-effect ledger file")
    parser.add_argument("--gen", type=int, default=0, help="generation: makes request and call ids unique")
    parser.add_argument("--owner", default="worker")
    parser.add_argument("--requests", type=int, default=0)
    parser.add_argument("--calls-per-turn", type=int, default=3)
    parser.add_argument("--parallel", action="store_true", help="run a turn's calls concurrently")
    parser.add_argument("--lease-ttl", type=float, default=0.5)
    parser.add_argument("--takeover-timeout", type=float, default=30.0)
    parser.add_argument("--crash-at")
    parser.add_argument("--negative-control", action="store_true")
    args = parser.parse_args(argv)
    if args.store == "sqlite" and not args.path:
        parser.error("--store sqlite needs --path")
    if args.store == "postgres" and not (args.dsn and args.schema):
        parser.error("--store postgres needs --dsn and --schema")
    if args.mode == "run" and not args.ledger:
        parser.error("--mode run needs --ledger")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mode = {"run": run_mode, "hold": hold_mode, "takeover": takeover_mode}[args.mode]
    trio.run(mode, args)


if __name__ == "__main__":
    if __package__ in (None, ""):  # run by path: make the repository importable
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
