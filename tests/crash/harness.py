"""The kill -9 crash harness (docs: /work/shared/reference/durable-trio.md §1.3, §1.4).

`CrashHarness` drives `tests/crash/worker.py` processes on ONE session of one
store (SQLite file or PostgreSQL schema, see `StoreSpec`):

* ``run_systematic(points)``: one worker per `CrashPoint`; it SIGKILLs itself
  right before a write of an event kind reaches the store, or right after its
  commit returned;
* ``run_random(count)``: workers the harness SIGKILLs at seeded random offsets
  after their first ``ACK``;
* ``finish()``: a clean worker that recovers, runs a little new work and exits 0.

Each new worker takes the session over after the dead owner's lease expired and
recovers it. `check` then judges the run from the durable events only (read
back from the store), the side-effect ledger and the workers' ``ACK`` lines:

1. every ACKed call is settled (completed) in the journal;
2. no ``non_idempotent`` call has more than one ledger line
   (``duplicate non_idempotent effect``) nor more than one start;
3. every scheduled call is settled or has a recovery decision (after a clean
   final worker: everything is settled and the recovery plan is empty);
4. every ledger line belongs to a scheduled call, carries its stored
   idempotency key, and follows a durable ``tool_started`` of that attempt;
5. every worker that was not killed exited cleanly, and every call a worker
   executed completed (the tools never fail).

Stats: calls per side effect, recovery decisions by action, how many
idempotent / pure calls really hit the ledger twice (at-least-once made
visible), kills, crash points reached.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from trio_agent.journal import (
    EventEnvelope,
    JournalStore,
    Projection,
    RecoveryDecision,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolScheduled,
    ToolStarted,
    open_postgres_store,
    open_sqlite_store,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("worker.py")
SIDE_EFFECTS = ("pure", "idempotent", "non_idempotent")
TOOL_EVENT_KINDS = ("tool_scheduled", "tool_started", "tool_completed")
DUPLICATE_NON_IDEMPOTENT = "duplicate non_idempotent effect"


class HarnessError(Exception):
    """The harness itself could not go on (a worker hung, never printed what it must)."""


# ---------------------------------------------------------------- stores


@attrs.frozen
class StoreSpec:
    """Where the journal lives: a SQLite file, or a schema of a PostgreSQL database."""

    kind: str  # "sqlite" | "postgres"
    path: str | None = None
    dsn: str | None = None
    schema: str | None = None

    @classmethod
    def sqlite(cls, path: str | os.PathLike[str]) -> StoreSpec:
        return cls("sqlite", path=os.fspath(path))

    @classmethod
    def postgres(cls, dsn: str, schema: str) -> StoreSpec:
        return cls("postgres", dsn=dsn, schema=schema)

    def worker_args(self) -> list[str]:
        if self.kind == "sqlite":
            assert self.path is not None
            return ["--store", "sqlite", "--path", self.path]
        assert self.dsn is not None and self.schema is not None
        return ["--store", "postgres", "--dsn", self.dsn, "--schema", self.schema]

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[JournalStore]:
        if self.kind == "sqlite":
            assert self.path is not None
            async with open_sqlite_store(self.path) as sqlite_store:
                yield sqlite_store
        else:
            assert self.dsn is not None and self.schema is not None
            async with open_postgres_store(self.dsn, schema=self.schema) as pg_store:
                yield pg_store

    def event_tokens(self, stream_id: str) -> dict[int, int]:
        """seq -> fencing token of every stored event of a stream (read from the tables directly)."""
        if self.kind == "sqlite":
            import sqlite3

            assert self.path is not None
            with contextlib.closing(sqlite3.connect(self.path)) as conn:
                rows = conn.execute(
                    "SELECT seq, token FROM journal_events WHERE stream_id=? ORDER BY seq", (stream_id,)
                ).fetchall()
        else:
            import psycopg
            from psycopg import sql

            assert self.dsn is not None and self.schema is not None
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                query = sql.SQL("SELECT seq, token FROM {}.events WHERE stream_id = %s ORDER BY seq").format(
                    sql.Identifier(self.schema)
                )
                rows = conn.execute(query, (stream_id,)).fetchall()
        return {int(seq): int(token) for seq, token in rows}


# ---------------------------------------------------------------- crash points


@attrs.frozen
class CrashPoint:
    """Kill right ``before`` the ``n``-th write of ``kind`` reaches the store, or right ``after`` it committed."""

    kind: str
    when: str
    side_effect: str | None = None
    scope: str = "any"  # "any" | "new" (calls of this worker) | "recovered" (calls of earlier workers)
    n: int = 1

    @property
    def spec(self) -> str:
        return f"{self.kind}:{self.n}:{self.when}:{self.side_effect or '*'}:{self.scope}"


def systematic_points(
    side_effects: Iterable[str] = SIDE_EFFECTS,
    kinds: Iterable[str] = TOOL_EVENT_KINDS,
    whens: Iterable[str] = ("before", "after"),
    scope: str = "new",
) -> list[CrashPoint]:
    """Every (kind, before/after) crash point for every side effect, on calls of the crashing worker."""
    return [
        CrashPoint(kind, when, side_effect, scope) for side_effect in side_effects for kind in kinds for when in whens
    ]


def recovery_points() -> list[CrashPoint]:
    """Crashes during recovery itself; each follows a point that leaves the matching work behind."""
    return [
        # an idempotent call started, no outcome -> the next worker decides rerun_same_key ...
        CrashPoint("tool_started", "after", "idempotent", "new"),
        # ... and dies right after that decision committed, before the re-run
        CrashPoint("recovery_decision", "after"),
        # the next one dies right after the re-run's second tool_started committed
        CrashPoint("tool_started", "after", "idempotent", "recovered"),
        # a pure call dies after its effect; the next worker dies before writing the rerun decision
        CrashPoint("tool_completed", "before", "pure", "new"),
        CrashPoint("recovery_decision", "before"),
        # a non_idempotent call dies after its effect; the next worker dies before settling it unknown
        CrashPoint("tool_completed", "before", "non_idempotent", "new"),
        CrashPoint("recovery_decision", "before"),
        # a scheduled call; the next worker dies right after its run decision, before running it
        CrashPoint("tool_scheduled", "after", "non_idempotent", "new"),
        CrashPoint("recovery_decision", "after"),
    ]


# ---------------------------------------------------------------- workers


@attrs.define
class WorkerRun:
    """One worker process and what it printed."""

    gen: int
    role: str  # "systematic" | "random" | "final" | "negative_control"
    crash: CrashPoint | None = None
    kill_after: float | None = None
    negative_control: bool = False
    lines: list[str] = attrs.field(factory=list)
    returncode: int | None = None
    duration: float = 0.0
    stderr_path: str = ""

    def tagged(self, tag: str) -> list[str]:
        prefix = tag + " "
        return [line[len(prefix) :] for line in self.lines if line.startswith(prefix) or line == tag]

    @property
    def acks(self) -> list[str]:
        return self.tagged("ACK")

    @property
    def recovered(self) -> list[dict[str, Any]]:
        return [json.loads(text) for text in self.tagged("RECOVERED")]

    @property
    def crash_fired(self) -> bool:
        return bool(self.tagged("CRASHING"))

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL

    @property
    def done(self) -> bool:
        return bool(self.tagged("DONE"))

    def stderr_tail(self, limit: int = 3000) -> str:
        try:
            return Path(self.stderr_path).read_text(errors="replace")[-limit:]
        except OSError:
            return ""


class LineReader:
    """Lines from a Trio receive stream (a subprocess's stdout)."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def lines(self) -> AsyncIterator[str]:
        while True:
            index = self.buffer.find(b"\n")
            if index >= 0:
                line = bytes(self.buffer[:index]).decode(errors="replace")
                del self.buffer[: index + 1]
                yield line
                continue
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                if self.buffer:
                    yield bytes(self.buffer).decode(errors="replace")
                    self.buffer.clear()
                return
            self.buffer += chunk


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.asynccontextmanager
async def spawn(argv: Sequence[str], stderr_path: Path, *, stdin: bool = False) -> AsyncIterator[trio.Process]:
    """A worker process (cwd = the repository root), killed if still alive when the block exits."""
    stderr = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, *argv],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=str(REPO_ROOT),
            env=worker_env(),
        )
    finally:
        os.close(stderr)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


# ---------------------------------------------------------------- results


@attrs.define
class HarnessResult:
    violations: list[str]
    stats: dict[str, Any]
    runs: list[WorkerRun]

    def summary(self) -> str:
        lines = [f"violations: {len(self.violations)}"]
        lines += [f"  - {violation}" for violation in self.violations[:30]]
        lines.append("stats: " + json.dumps(self.stats, sort_keys=True))
        return "\n".join(lines)


def _settled(event: object) -> bool:
    return isinstance(event, ToolCompleted | ToolFailed | ToolCancelled | ToolOutcomeUnknown)


@attrs.define
class _Call:
    scheduled: ToolScheduled
    starts: int = 0
    settlement: object | None = None
    decisions: list[str] = attrs.field(factory=list)


# ---------------------------------------------------------------- the harness


class CrashHarness:
    """Crash, take over and recover one session again and again; then check the invariants.

    Args:
        store: where the journal lives.
        workdir: a directory for the ledger and the workers' stderr files.
        session_id: the session every worker works on.
        seed: seeds the random kill offsets.
        lease_ttl: the workers' lease ttl (a dead owner's lease blocks takeover this long).
        requests_per_worker: new requests a crash-point worker runs (it should crash before the end).
        worker_timeout: bound on one worker's whole life (a hang fails instead of blocking).
        parallel: run each turn's calls concurrently in the workers.
    """

    def __init__(
        self,
        store: StoreSpec,
        workdir: Path,
        *,
        session_id: str = "crash-session",
        seed: int = 0,
        lease_ttl: float = 1.0,
        requests_per_worker: int = 4,
        worker_timeout: float = 60.0,
        parallel: bool = False,
    ) -> None:
        self.store = store
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ledger = self.workdir / "ledger.csv"
        self.session_id = session_id
        self.random = random.Random(seed)
        self.lease_ttl = lease_ttl
        self.requests_per_worker = requests_per_worker
        self.worker_timeout = worker_timeout
        self.parallel = parallel
        self.runs: list[WorkerRun] = []
        self.started_at = time.monotonic()

    # -- driving workers

    async def run_worker(
        self,
        *,
        role: str,
        crash: CrashPoint | None = None,
        kill_after: float | None = None,
        negative_control: bool = False,
        requests: int | None = None,
    ) -> WorkerRun:
        """Run one worker to its end: its own crash, our SIGKILL ``kill_after`` s after its first ACK, or exit."""
        gen = len(self.runs)
        run = WorkerRun(gen, role, crash, kill_after, negative_control)
        run.stderr_path = str(self.workdir / f"worker-{gen}.stderr")
        self.runs.append(run)
        if requests is None:
            requests = 100_000 if kill_after is not None else self.requests_per_worker
        argv = [
            str(WORKER),
            *self.store.worker_args(),
            "--session", self.session_id,
            "--ledger", str(self.ledger),
            "--gen", str(gen),
            "--owner", f"{role}-{gen}",
            "--requests", str(requests),
            "--lease-ttl", str(self.lease_ttl),
            "--takeover-timeout", str(max(self.lease_ttl * 20, 10.0)),
        ]  # fmt: skip
        if crash is not None:
            argv += ["--crash-at", crash.spec]
        if negative_control:
            argv.append("--negative-control")
        if self.parallel:
            argv.append("--parallel")
        started = time.monotonic()
        first_ack = trio.Event()
        try:
            with trio.fail_after(self.worker_timeout):
                async with spawn(argv, Path(run.stderr_path)) as process, trio.open_nursery() as nursery:

                    async def read() -> None:
                        assert process.stdout is not None
                        async for line in LineReader(process.stdout).lines():
                            run.lines.append(line)
                            if line.startswith("ACK "):
                                first_ack.set()

                    nursery.start_soon(read)
                    nemesis_scope = trio.CancelScope()
                    if kill_after is not None:
                        # Kill at a random moment once the worker is past takeover and recovery.
                        async def nemesis() -> None:
                            with nemesis_scope:
                                await first_ack.wait()
                                await trio.sleep(kill_after)
                                process.send_signal(signal.SIGKILL)

                        nursery.start_soon(nemesis)
                    run.returncode = await process.wait()
                    nemesis_scope.cancel()
                    # The reader ends at EOF on stdout, which the exit just closed.
        except trio.TooSlowError:
            raise HarnessError(
                f"worker {gen} ({role}, crash={crash and crash.spec}) did not end within {self.worker_timeout} s;"
                f" last lines {run.lines[-5:]}\nstderr:\n{run.stderr_tail()}"
            ) from None
        finally:
            run.duration = time.monotonic() - started
        return run

    async def run_systematic(self, points: Iterable[CrashPoint]) -> None:
        for point in points:
            await self.run_worker(role="systematic", crash=point)

    async def run_random(self, count: int, *, low: float = 0.005, high: float = 0.08) -> None:
        for _ in range(count):
            await self.run_worker(role="random", kill_after=self.random.uniform(low, high))

    async def run_negative_control(self) -> None:
        await self.run_worker(role="negative_control", negative_control=True, requests=0)

    async def finish(self, requests: int = 1) -> WorkerRun:
        """A clean worker: recovers what is left, runs ``requests`` new requests and exits 0."""
        return await self.run_worker(role="final", requests=requests)

    # -- checking

    def read_ledger(self) -> list[tuple[str, str, str, int]]:
        if not self.ledger.exists():
            return []
        rows = []
        for line in self.ledger.read_text().splitlines():
            call_id, kind, key, attempt = line.rsplit(",", 3)
            rows.append((call_id, kind, key, int(attempt)))
        return rows

    async def read_events(self) -> dict[str, list[EventEnvelope]]:
        events: dict[str, list[EventEnvelope]] = {}
        async with self.store.open() as store:
            for info in await store.streams(self.session_id):
                events[info.stream_id] = await store.read(info.stream_id)
        return events

    async def check(self) -> HarnessResult:
        violations: list[str] = []
        streams = await self.read_events()
        calls: dict[str, _Call] = {}
        decisions: collections.Counter[str] = collections.Counter()
        plan_items: list[str] = []
        for stream_id, envelopes in streams.items():
            projection = Projection(stream_id)
            for envelope in envelopes:
                try:
                    projection.apply(envelope)
                except Exception as exc:  # the stored stream breaks the journal's own rules
                    violations.append(f"stored event {stream_id}#{envelope.seq} is invalid: {exc}")
                    break
                event = envelope.event
                if isinstance(event, ToolScheduled):
                    calls[event.call_id] = _Call(event)
                    continue
                call = calls.get(getattr(event, "call_id", None) or "")
                if call is None:
                    continue
                if isinstance(event, ToolStarted):
                    call.starts += 1
                elif isinstance(event, RecoveryDecision):
                    call.decisions.append(event.decision.value)
                    decisions[event.decision.value] += 1
                elif _settled(event):
                    call.settlement = event
            plan_items += [f"{stream_id}: {item.kind.value} {item.call_id or item.request_id}" for item in
                           projection.recovery_plan().items]  # fmt: skip

        ledger = self.read_ledger()
        effects: dict[str, list[tuple[str, str, int]]] = collections.defaultdict(list)
        for call_id, kind, key, attempt in ledger:
            effects[call_id].append((kind, key, attempt))

        acked = [call_id for run in self.runs for call_id in run.acks]
        # 1. every ACKed call is settled, as completed
        for call_id in acked:
            call = calls.get(call_id)
            if call is None or call.settlement is None:
                violations.append(f"ACKed call {call_id} is not settled in the journal")
            elif not isinstance(call.settlement, ToolCompleted):
                violations.append(f"ACKed call {call_id} is settled {type(call.settlement).__name__}, not completed")
        # 2. at most one effect and one start per non_idempotent call
        for call_id, call in calls.items():
            if call.scheduled.side_effect.value != "non_idempotent":
                continue
            if len(effects.get(call_id, ())) > 1:
                violations.append(
                    f"{DUPLICATE_NON_IDEMPOTENT}: call {call_id} hit the ledger {len(effects[call_id])} times"
                )
            if call.starts > 1:
                violations.append(f"non_idempotent call {call_id} was started {call.starts} times")
        # 3. every scheduled call is settled or has a recovery decision
        for call_id, call in calls.items():
            if call.settlement is None and not call.decisions:
                violations.append(f"scheduled call {call_id} is neither settled nor has a recovery decision")
        # 4. effects belong to scheduled calls, use the stored key, follow a durable start
        for call_id, rows in effects.items():
            call = calls.get(call_id)
            if call is None:
                violations.append(f"ledger effect of call {call_id} that was never scheduled")
                continue
            for kind, key, attempt in rows:
                if key != call.scheduled.idempotency_key:
                    violations.append(
                        f"call {call_id} ran with key {key!r}, not its stored {call.scheduled.idempotency_key!r}"
                    )
                if kind != call.scheduled.side_effect.value:
                    violations.append(f"call {call_id} ran as {kind}, scheduled as {call.scheduled.side_effect.value}")
                if attempt < 1 or attempt > call.starts:
                    violations.append(
                        f"effect of call {call_id} attempt {attempt} has no durable tool_started "
                        f"({call.starts} recorded)"
                    )
        # 5. workers ended as planned (and no call of theirs ended other than completed)
        final_clean = False
        for run in self.runs:
            label = f"worker {run.gen} ({run.role}, crash={run.crash and run.crash.spec})"
            violations += [f"{label}: a call did not complete: {text}" for text in run.tagged("NACK")]
            if run.killed:
                continue
            if run.returncode != 0 or not run.done:
                violations.append(f"{label} exited with {run.returncode}: {run.stderr_tail(1500)}")
            elif run.role == "final":
                final_clean = True
        if final_clean and self.runs[-1].role == "final":
            unsettled = [call_id for call_id, call in calls.items() if call.settlement is None]
            if unsettled:
                violations.append(f"after the clean final run, calls are still unsettled: {unsettled[:10]}")
            if plan_items:
                violations.append(f"after the clean final run, recovery still has work: {plan_items[:10]}")

        by_effect: collections.Counter[str] = collections.Counter(
            call.scheduled.side_effect.value for call in calls.values()
        )
        settled_as: collections.Counter[str] = collections.Counter(
            type(call.settlement).__name__ for call in calls.values() if call.settlement is not None
        )
        twice: collections.Counter[str] = collections.Counter(
            calls[call_id].scheduled.side_effect.value
            for call_id, rows in effects.items()
            if len(rows) > 1 and call_id in calls
        )
        systematic = [run for run in self.runs if run.role == "systematic"]
        stats: dict[str, Any] = {
            "store": self.store.kind,
            "workers": len(self.runs),
            "events": sum(len(envelopes) for envelopes in streams.values()),
            "calls": len(calls),
            "calls_by_side_effect": dict(by_effect),
            "settled_as": dict(settled_as),
            "acked": len(acked),
            "ledger_lines": len(ledger),
            "recovery_decisions": dict(decisions),
            "effects_twice_by_side_effect": dict(twice),
            "kills_systematic": sum(run.crash_fired and run.killed for run in systematic),
            "crash_points_not_reached": [run.crash.spec for run in systematic if run.crash and not run.crash_fired],
            "kills_random": sum(run.killed for run in self.runs if run.role == "random"),
            "random_workers_finished_before_kill": sum(not run.killed for run in self.runs if run.role == "random"),
            "negative_control_reruns": sum(len(run.tagged("NEGCTRL_RERUN")) for run in self.runs),
            "seconds": round(time.monotonic() - self.started_at, 2),
        }
        return HarnessResult(violations, stats, list(self.runs))


async def run_campaign(
    store: StoreSpec,
    workdir: Path,
    *,
    points: Sequence[CrashPoint] = (),
    random_kills: int = 0,
    seed: int = 0,
    lease_ttl: float = 1.0,
    parallel: bool = False,
    session_id: str = "crash-session",
) -> HarnessResult:
    """Systematic crash points, then random kills, then a clean worker; then the checks."""
    harness = CrashHarness(store, workdir, session_id=session_id, seed=seed, lease_ttl=lease_ttl, parallel=parallel)
    await harness.run_systematic(points)
    await harness.run_random(random_kills)
    await harness.finish()
    return await harness.check()


# ---------------------------------------------------------------- SIGSTOP takeover


@attrs.define
class TakeoverResult:
    """What the SIGSTOP takeover scenario saw: both workers' lines and the stored stream."""

    holder: dict[str, Any]
    taker: dict[str, Any]
    raw_write: dict[str, Any]
    journal_write: dict[str, Any]
    holder_exit: dict[str, Any]
    holder_lines: list[str]
    taker_lines: list[str]
    taker_returncode: int | None
    events: list[tuple[int, str, str | None]]  # (seq, event type, request id)
    tokens: dict[int, int]  # seq -> fencing token
    lease_token: int | None


class _Talker:
    """A worker with a stdin pipe whose stdout lines are collected in the background."""

    def __init__(self, process: trio.Process, nursery: trio.Nursery) -> None:
        self.process = process
        self.lines: list[str] = []
        self.eof = False
        self._changed = trio.Event()
        nursery.start_soon(self._read)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in LineReader(self.process.stdout).lines():
            self.lines.append(line)
            self._changed.set()
            self._changed = trio.Event()
        self.eof = True
        self._changed.set()

    async def expect(self, tag: str, *, count: int = 1, within: float = 20.0) -> dict[str, Any]:
        """The ``count``-th line tagged ``tag`` (its JSON payload); fails after ``within`` s."""
        with trio.move_on_after(within):
            while True:
                found = [line for line in self.lines if line.startswith(tag + " ")]
                if len(found) >= count:
                    payload: dict[str, Any] = json.loads(found[count - 1][len(tag) + 1 :])
                    return payload
                if self.eof:
                    break
                await self._changed.wait()
        raise HarnessError(f"no {tag!r} line (#{count}) within {within} s or before EOF; got {self.lines}")

    async def tell(self, text: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(text.encode() + b"\n")


async def sigstop_takeover(
    store: StoreSpec, workdir: Path, *, session_id: str = "stop-session", lease_ttl: float = 0.5
) -> TakeoverResult:
    """A holds the lease and is SIGSTOPped; B takes over and appends; A is resumed and tries to write.

    A's writes (a raw batch straight to the store with its old token, then a
    normal journal write) must be refused, and the store must hold B's events
    only after the takeover.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    common = [*store.worker_args(), "--session", session_id, "--lease-ttl", str(lease_ttl), "--takeover-timeout", "20"]
    async with trio.open_nursery() as nursery:
        async with spawn([str(WORKER), "--mode", "hold", *common], workdir / "holder.stderr", stdin=True) as a_proc:
            holder = _Talker(a_proc, nursery)
            held = await holder.expect("HOLDING")
            a_proc.send_signal(signal.SIGSTOP)
            try:
                async with spawn(
                    [str(WORKER), "--mode", "takeover", *common], workdir / "taker.stderr", stdin=True
                ) as b_proc:
                    taker = _Talker(b_proc, nursery)
                    took = await taker.expect("TOOK")
                    await taker.expect("APPENDED")
                    # B holds the lease now (and keeps renewing it). Wake the zombie and let it write.
                    a_proc.send_signal(signal.SIGCONT)
                    await holder.tell("write")
                    raw = await holder.expect("RAW_WRITE")
                    journal_write = await holder.expect("JOURNAL_WRITE")
                    holder_exit = await holder.expect("EXIT")
                    # B is unaffected: it appends once more after the zombie's attempt, and exits cleanly.
                    await taker.tell("finish")
                    await taker.expect("APPENDED", count=2)
                    await taker.expect("EXIT")
                    with trio.fail_after(20):
                        taker_rc = await b_proc.wait()
                        await a_proc.wait()
            finally:
                with contextlib.suppress(ProcessLookupError):
                    a_proc.send_signal(signal.SIGCONT)
        nursery.cancel_scope.cancel()

    stream_id = held["stream_id"]
    async with store.open() as opened:
        envelopes = await opened.read(stream_id)
        lease = await opened.current_lease(session_id)
    events = [(e.seq, type(e.event).__name__, getattr(e.event, "request_id", None)) for e in envelopes]
    return TakeoverResult(
        holder=held,
        taker=took,
        raw_write=raw,
        journal_write=journal_write,
        holder_exit=holder_exit,
        holder_lines=list(holder.lines),
        taker_lines=list(taker.lines),
        taker_returncode=taker_rc,
        events=events,
        tokens=store.event_tokens(stream_id),
        lease_token=None if lease is None else lease.token,
    )
