"""Worker processes on PostgreSQL against one process on SQLite: throughput, latency, takeover, idle cost.

The workload (``_workers_agent.py``): one request = the model (a `TestModel`, every reply delayed
20 ms) asks for one call of the ``pure`` tool ``add(a=1, b=2)``, the tool runs, the model answers
``"done"``: two model calls. Every request is the one request of a new session (R sessions). Every
request must end completed with ``"done"``, which the model answers only when the tool worked.

Measured, in one run and in this order:
  1. in-process, memory journal (the "direct" figures): R requests through ``open_session(spec,
     session_id=...)`` (the in-memory journal) and ``Session.serve_request`` (what a worker calls),
     C = 16 sessions at a time in one Trio process;
  2. one process on SQLite: the same, every session on one shared SQLite store (``open_sqlite_store``,
     WAL, synchronous=FULL, a file on disk), as one server process would share it;
  3. PostgreSQL workers, W = 1, 2 and 4 processes (``python -m trio_agent worker --concurrency 16
     --poll-interval 0.2``, the default 30 s lease TTL, live deltas on), each row on a fresh schema of
     one throw-away cluster (tests/pg_cluster.py). The workers are started, and each has printed its
     ready line, before anything is timed. This process then keeps 16 x W requests in flight (a closed
     loop: each of 16 x W clients submits a request of a new session with one shared `Submitter`, waits
     for its outcome with `wait_for_request` on its own `open_postgres_store`, and submits the next);
     16 x W untimed warm-up requests go first. Latency is submit to the terminal event read back;
     requests/s is R over the wall of the timed requests. Then every worker gets SIGTERM and its JSON
     report (the requests each served) is read. The CPU of the worker processes (/proc/<pid>/stat,
     user + system) and of this process over the timed part is reported per request.
  For rows 1 and 2 latency is open_session to serve_request returned (the terminal event committed),
  in flight C = 16, so a 1-worker row and the SQLite row have the same number of requests in flight.
  "x SQLite" is a row's requests/s over the SQLite row's.
  4. takeover: two workers (``--concurrency 1 --lease-ttl 1 --poll-interval 0.2``) on a fresh schema;
     one request whose tool (``nap``) sleeps 2 s is submitted; once its ``tool_started`` is durable,
     the worker holding the session's lease (the ``leases`` table's owner) gets SIGKILL. The lease's
     ``expires_at`` (server clock; read after the victim is dead, so no renewal can follow) is compared
     with the ``recorded_at`` of the session's next durable event (written by the survivor; same host,
     same clock): "takeover" is expiry to that event; kill to that event is shown too. The taken-over
     request must then complete on the survivor. Median over 3 trials (``--short``: 1).
  5. worker idle CPU: two workers with nothing to serve, one with the defaults (poll 2 s, lease TTL
     30 s, what the headline ``idle_cpu_percent`` is) and one as in the rows (poll 0.2 s), both ready and
     settled for 1 s (``--short``: 0.3 s), then their CPU time (/proc/<pid>/stat) over 10 s
     (``--short``: 1 s), as % of one core.
  6. the PostgreSQL journal at 100 writers against its raw floor, by benchmarks/journal.py's own
     functions (``postgres_appends``, ``raw_postgres``; see its docstring): 30,000 events, median of 3
     paired rounds (``--short``: 1,500 events, 1 round). Last measured at 19 %; the target is >= 40 %.

Sizes: R = 400 per row (``--short``: R = 24 and only 1 worker; ``--requests`` overrides R).
Every process runs on the same machine (2 cores here): the clients, the workers and the server share
it, so more workers than cores add contention, not capacity. Without PostgreSQL server binaries the
PostgreSQL rows and sections are reported skipped (the in-process rows still run); when PostgreSQL is
there and they fail, the failure is reported, the other figures are printed, and the exit status is 1.
The worker processes run the ``trio_agent`` this process imports (``python -P -m trio_agent worker``).

Prints a table and, as the last line, one JSON object (``"benchmark": "workers"``; the in-process
memory row is the keys with "direct"). ``--progress`` (the default when stderr is a terminal) writes a
line per section to stderr; see ``_progress.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import attrs
import trio
from _progress import add_progress_option, note, start_progress
from _workers_agent import MODEL_LATENCY, NAP_PROMPT, PROMPT, spec

import trio_agent as ta
from trio_agent.journal import RequestState, ToolStarted, open_sqlite_store

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
AGENT = "_workers_agent:spec"

CONCURRENCY = 16  # sessions per worker process, and in flight in the in-process rows
POLL_INTERVAL = 0.2
REQUESTS_FULL, REQUESTS_SHORT = 400, 24
WORKERS_FULL, WORKERS_SHORT = (1, 2, 4), (1,)
TAKEOVER_TRIALS_FULL, TAKEOVER_TRIALS_SHORT = 3, 1
TAKEOVER_TTL = 1.0
IDLE_FULL, IDLE_SHORT = 10.0, 1.0
JOURNAL_WRITERS = 100
JOURNAL_ROUNDS_FULL, JOURNAL_ROUNDS_SHORT = 3, 1
JOURNAL_LAST_MEASURED = 0.19
JOURNAL_TARGET = 0.40
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def load_journal_benchmark() -> ModuleType:
    """benchmarks/journal.py as a module (its functions are reused here, not copied)."""
    found = sys.modules.get("_bench_journal")
    if found is not None:
        return found
    loader = importlib.util.spec_from_file_location("_bench_journal", BENCH_DIR / "journal.py")
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    sys.modules["_bench_journal"] = module
    loader.loader.exec_module(module)
    return module


jb = load_journal_benchmark()
percentile = jb.percentile


# -- worker processes ---------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process *pid* so far (/proc/<pid>/stat)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15)


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()  # from field 3 (state) on


def find_postmaster(dsn: str) -> int | None:
    """The pid of the local PostgreSQL server listening on the DSN's port (None: not found, e.g. remote)."""
    words = dict(part.split("=", 1) for part in dsn.split() if "=" in part)
    port = words.get("port")
    if port is None:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().decode("utf-8", "replace").split("\0")
            if argv and argv[0].endswith("postgres") and f"port={port}" in argv:
                return int(entry)
    return None


def server_cpu_seconds(postmaster: int | None) -> float | None:
    """CPU seconds of the whole PostgreSQL server so far: the postmaster, its reaped children (cutime,
    cstime: backends that exited) and its live children (every backend and background process)."""
    if postmaster is None:
        return None
    try:
        fields = _stat_fields(postmaster)
    except OSError:
        return None
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                child = _stat_fields(int(entry))
                if int(child[1]) == postmaster:
                    ticks += int(child[11]) + int(child[12])
    return ticks / CLK_TCK


class Worker:
    """One ``python -m trio_agent worker`` process: its stdout pumped by a thread, its stderr in a file."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.worker_id: str | None = None
        self.signalled = False  # SIGTERM sent (once: a second one means "stop at once", or kills a stopping worker)
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed by `close`
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self.stderr, env=env, cwd=str(ROOT), text=True, bufsize=1
        )
        self.thread = threading.Thread(target=self._pump, name=f"stdout of {name}", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if line.startswith("worker ") and " serving (concurrency " in line:
                self.worker_id = line.split(" ", 2)[1]
                self.ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before ready: {self.why()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {self.why()}")

    def stop(self, timeout: float = STOP_TIMEOUT) -> dict[str, Any] | None:
        """SIGTERM, wait, and the JSON report the worker prints last (None if it printed none)."""
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.name} did not stop within {timeout:.0f} s of SIGTERM") from None
        self.thread.join(5)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.why()}")
        with contextlib.suppress(IndexError, ValueError):
            report = json.loads(self.lines[-1])
            if isinstance(report, dict):
                return report
        return None

    def terminate(self) -> None:
        if not self.signalled and self.proc.poll() is None:
            self.signalled = True
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode("utf-8", "replace")

    def why(self) -> str:
        """Its last stderr line, then the last 20 lines of its stderr (for the stderr of this process)."""
        lines = self.stderr_text().splitlines()
        return f"{lines[-1] if lines else '(no stderr)'}\n" + "\n".join(lines[-20:])

    def complaints(self) -> list[str]:
        """Its stderr lines, but the one a SIGTERM always prints."""
        return [line for line in self.stderr_text().splitlines() if line.strip() and "stopping (again" not in line]

    def close(self) -> None:
        self.kill()
        self.thread.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()


class Fleet:
    """Every worker process this run starts; `close` kills and reaps whatever still runs."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.started: list[Worker] = []
        self.complaints: list[str] = []
        self.postmaster = find_postmaster(dsn)
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            part for part in (str(BENCH_DIR), os.environ.get("PYTHONPATH", "")) if part
        )

    def start(
        self,
        schema: str,
        *,
        concurrency: int = CONCURRENCY,
        poll_interval: float | None = POLL_INTERVAL,
        lease_ttl: float | None = None,
        shutdown_grace: float = 5.0,
    ) -> Worker:
        # -P: `-m` would put the working directory (the checkout) first on sys.path, so the workers would run
        # its trio_agent rather than the one this process runs (PYTHONPATH's tree, or the installed one).
        argv = [sys.executable, "-P", "-m", "trio_agent", "worker", "--dsn", self.dsn, "--agent", AGENT]
        argv += ["--schema", schema, "--concurrency", str(concurrency), "--shutdown-grace", str(shutdown_grace)]
        if poll_interval is not None:
            argv += ["--poll-interval", str(poll_interval)]
        if lease_ttl is not None:
            argv += ["--lease-ttl", str(lease_ttl)]
        worker = Worker(argv, self.env, f"worker {len(self.started) + 1} ({schema})")
        self.started.append(worker)
        return worker

    def stop_all(self, workers: list[Worker]) -> list[dict[str, Any] | None]:
        for worker in workers:  # all signalled first: they stop together
            worker.terminate()
        reports = [worker.stop() for worker in workers]
        for worker in workers:
            self.complaints.extend(f"{worker.name}: {line}" for line in worker.complaints())
        return reports

    def close(self) -> None:
        for worker in self.started:
            worker.close()


@contextlib.contextmanager
def fleet_of(dsn: str) -> Iterator[Fleet]:
    fleet = Fleet(dsn)
    try:
        yield fleet
    finally:
        fleet.close()


# -- the runs ----------------------------------------------------------------------------------------------


@attrs.frozen
class Row:
    label: str
    processes: int
    in_flight: int
    requests: int
    per_s: float
    p50_ms: float
    p99_ms: float
    cpu_ms: float  # CPU of the serving process(es) per request
    client_cpu_ms: float | None = None  # this process's, when the serving is elsewhere
    server_cpu_ms: float | None = None  # the PostgreSQL server's
    served: tuple[int, ...] = ()  # requests each worker served (from its report), warm-up included


async def closed_loop(
    one: Callable[[str], Awaitable[float]], prefix: str, count: int, in_flight: int
) -> tuple[list[float], float]:
    """``in_flight`` clients, each running ``one(session_id)`` for the next of ``count`` sessions until none
    is left; returns the latencies and the wall."""
    latencies: list[float] = []
    numbers = itertools.count()

    async def client() -> None:
        while (number := next(numbers)) < count:
            latencies.append(await one(f"{prefix}-{number}"))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(min(in_flight, count)):
            nursery.start_soon(client)
    return latencies, time.perf_counter() - start


async def in_process(label: str, sqlite_path: str | None, requests: int, in_flight: int) -> Row:
    """One Trio process serving every request itself: the memory journal, or one shared SQLite store."""
    agent = spec()
    async with contextlib.AsyncExitStack() as stack:
        store = None if sqlite_path is None else await stack.enter_async_context(open_sqlite_store(sqlite_path))

        async def one(session_id: str) -> float:
            sent = time.perf_counter()
            async with ta.open_session(agent, journal=store, session_id=session_id) as session:
                ended = await session.serve_request("r1", PROMPT)
                latency = time.perf_counter() - sent
                last = session.messages()[-1]
            if ended is not RequestState.COMPLETED:
                raise RuntimeError(f"{label}: request of {session_id} ended {ended}")
            # The model answers "done" only when the tool worked: a completed request is not enough.
            if not (isinstance(last, ta.AssistantMessage) and last.text == "done"):
                raise RuntimeError(f"{label}: request of {session_id} answered {last!r}")
            return latency

        await closed_loop(one, "warm", in_flight, in_flight)
        cpu = time.process_time()
        latencies, wall = await closed_loop(one, "s", requests, in_flight)
        cpu = time.process_time() - cpu
    return Row(
        label,
        1,
        in_flight,
        requests,
        requests / wall,
        percentile(latencies, 0.5) * 1e3,
        percentile(latencies, 0.99) * 1e3,
        cpu / requests * 1e3,
    )


@attrs.frozen
class Drive:
    latencies: list[float]
    wall: float
    worker_cpu: float  # over the timed part, seconds: the worker processes
    client_cpu: float  # this process
    server_cpu: float | None  # the PostgreSQL server


async def drive_workers(fleet: Fleet, schema: str, workers: list[Worker], requests: int, in_flight: int) -> Drive:
    """Submit and wait, a closed loop of ``in_flight`` clients; the figures of the timed part."""
    from trio_agent.journal import open_postgres_store
    from trio_agent.workers import Submitter, wait_for_request

    dsn = fleet.dsn
    submitter = Submitter(dsn, schema=schema)
    lock = trio.Lock()  # one Submitter: one connection, used by one thread at a time
    try:
        async with open_postgres_store(dsn, schema=schema) as store:

            async def one(session_id: str) -> float:
                sent = time.perf_counter()
                async with lock:
                    await trio.to_thread.run_sync(
                        functools.partial(submitter.submit, session_id, PROMPT, request_id="r1")
                    )
                outcome = await wait_for_request(store, session_id, "r1")
                latency = time.perf_counter() - sent
                if outcome.state != "completed" or outcome.text != "done":  # "done": the tool worked
                    raise RuntimeError(f"request of {session_id} ended {outcome}")
                return latency

            await closed_loop(one, "warm", in_flight, in_flight)
            before = [cpu_seconds(worker.pid) for worker in workers]
            server = server_cpu_seconds(fleet.postmaster)
            cpu = time.process_time()
            latencies, wall = await closed_loop(one, "s", requests, in_flight)
            cpu = time.process_time() - cpu
            spent = sum(cpu_seconds(worker.pid) - b for worker, b in zip(workers, before, strict=True))
            server_after = server_cpu_seconds(fleet.postmaster)
    finally:
        submitter.close()
    server_spent = None if server is None or server_after is None else server_after - server
    return Drive(latencies, wall, spent, cpu, server_spent)


def pg_workers_row(fleet: Fleet, count: int, requests: int) -> Row:
    schema = f"bench_workers_{count}"
    workers = [fleet.start(schema) for _ in range(count)]
    for worker in workers:
        worker.wait_ready()
    in_flight = CONCURRENCY * count

    async def run() -> Drive:
        with trio.fail_after(max(120.0, requests * 0.5)):
            return await drive_workers(fleet, schema, workers, requests, in_flight)

    drive = trio.run(run)
    reports = fleet.stop_all(workers)
    served = tuple(int(report.get("served", 0)) if report else 0 for report in reports)
    noun = "process" if count == 1 else "processes"
    return Row(
        f"PostgreSQL, {count} worker {noun}",
        count,
        in_flight,
        requests,
        requests / drive.wall,
        percentile(drive.latencies, 0.5) * 1e3,
        percentile(drive.latencies, 0.99) * 1e3,
        drive.worker_cpu / requests * 1e3,
        drive.client_cpu / requests * 1e3,
        None if drive.server_cpu is None else drive.server_cpu / requests * 1e3,
        served,
    )


# -- takeover ----------------------------------------------------------------------------------------------


@attrs.frozen
class Takeover:
    expiry_to_event_s: float
    kill_to_event_s: float
    kill_to_completed_s: float
    first_event: str


def lease_row(dsn: str, schema: str, session_id: str) -> tuple[str, int, float] | None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT owner, token, expires_at FROM {schema}.leases WHERE session_id = %s", (session_id,)
        ).fetchone()
    return None if row is None else (str(row[0]), int(row[1]), float(row[2]))


async def takeover_trial(fleet: Fleet, trial: int) -> Takeover:
    from trio_agent.journal import open_postgres_store
    from trio_agent.workers import Submitter, wait_for_request

    dsn = fleet.dsn
    schema = f"bench_takeover_{trial}"
    session_id, stream_id = "napper", "napper/root"
    pair = [
        fleet.start(schema, concurrency=1, lease_ttl=TAKEOVER_TTL, shutdown_grace=1.0, poll_interval=POLL_INTERVAL)
        for _ in range(2)
    ]
    for worker in pair:
        await trio.to_thread.run_sync(worker.wait_ready)
    async with open_postgres_store(dsn, schema=schema) as store:
        with Submitter(dsn, schema=schema) as submitter:
            await trio.to_thread.run_sync(functools.partial(submitter.submit, session_id, NAP_PROMPT, request_id="r1"))
        seen = 0
        with trio.fail_after(30):  # until the nap has started, durably
            while True:
                read = await store.read(stream_id, after=seen)
                if any(isinstance(envelope.event, ToolStarted) for envelope in read):
                    break
                seen = read[-1].seq if read else seen
                await store.wait_for_append(stream_id, seen)
        holder = await trio.to_thread.run_sync(lease_row, dsn, schema, session_id)
        assert holder is not None
        victims = [worker for worker in pair if worker.worker_id == holder[0]]
        if len(victims) != 1:
            raise RuntimeError(f"takeover: the lease owner {holder[0]!r} is none of {[w.worker_id for w in pair]}")
        victim = victims[0]
        survivor = next(worker for worker in pair if worker is not victim)
        head = await store.head(stream_id)
        victim.proc.kill()
        killed = time.time()
        await trio.to_thread.run_sync(victim.proc.wait)
        await trio.sleep(0.05)  # a renewal the victim sent before dying has landed or never will
        lease = await trio.to_thread.run_sync(lease_row, dsn, schema, session_id)
        assert lease is not None
        if lease[0] != holder[0]:
            raise RuntimeError(f"takeover: the lease moved to {lease[0]!r} before it expired")
        expires_at = lease[2]
        with trio.fail_after(30):
            while await store.head(stream_id) <= head:
                await store.wait_for_append(stream_id, head)
        following = (await store.read(stream_id, after=head, limit=1))[0]
        with trio.fail_after(30):
            outcome = await wait_for_request(store, session_id, "r1")
        completed = time.time()
    if outcome.state != "completed" or outcome.text != "done":  # "done": the nap's result came back
        raise RuntimeError(f"takeover: the taken-over request ended {outcome}")
    fleet.stop_all([survivor])
    fleet.complaints.extend(f"{victim.name} (killed): {line}" for line in victim.complaints())
    return Takeover(
        following.recorded_at - expires_at,
        following.recorded_at - killed,
        completed - killed,
        type(following.event).__name__,
    )


# -- idle CPU ----------------------------------------------------------------------------------------------


@attrs.frozen
class Idle:
    worker_percent: float  # CPU of the idle worker, % of one core
    server_percent: float | None  # of the PostgreSQL server meanwhile (its own background work included)
    resolution_percent: float  # one clock tick over the window


def idle_cpu(fleet: Fleet, seconds: float, poll_interval: float | None, schema: str, settle: float = 1.0) -> Idle:
    """The CPU an idle worker (and the server, meanwhile) uses, as % of one core."""
    worker = fleet.start(schema, poll_interval=poll_interval)
    worker.wait_ready()
    time.sleep(settle)  # start-up work (the first heartbeat, the first claims) settles
    before, server = cpu_seconds(worker.pid), server_cpu_seconds(fleet.postmaster)
    start = time.perf_counter()
    time.sleep(seconds)
    after, server_after = cpu_seconds(worker.pid), server_cpu_seconds(fleet.postmaster)
    wall = time.perf_counter() - start
    fleet.stop_all([worker])
    server_percent = None if server is None or server_after is None else (server_after - server) / wall * 100
    return Idle((after - before) / wall * 100, server_percent, 100 / CLK_TCK / wall)


# -- the PostgreSQL journal at 100 writers -----------------------------------------------------------------


@attrs.frozen
class JournalRatio:
    ratio: float
    durable_per_s: float
    raw_per_s: float
    batch: float
    rounds: int
    events: int


def journal_at_100(dsn: str, short: bool) -> JournalRatio:
    events = (jb.EVENTS_SHORT if short else jb.EVENTS_FULL)[JOURNAL_WRITERS]
    rounds = JOURNAL_ROUNDS_SHORT if short else JOURNAL_ROUNDS_FULL
    per_writer = events // JOURNAL_WRITERS
    jb.check_floor_encoding()
    floor_input = jb.floor_events(JOURNAL_WRITERS, per_writer)
    durable, raw = [], []
    for round_ in range(rounds):
        note(f"PostgreSQL journal at {JOURNAL_WRITERS} writers, round {round_ + 1}/{rounds}")
        run = trio.run(jb.postgres_appends, dsn, f"bench_journal_r{round_}", JOURNAL_WRITERS, per_writer)
        batch = max(1, round(run.batch if run.batch is not None else JOURNAL_WRITERS))
        floor = functools.partial(jb.raw_postgres, dsn, f"bench_raw_r{round_}", floor_input, batch)
        durable.append(run)
        raw.append(jb.in_plain_thread(floor))
    return JournalRatio(
        statistics.median(d.per_s / r.per_s for d, r in zip(durable, raw, strict=True)),
        statistics.median(d.per_s for d in durable),
        statistics.median(r.per_s for r in raw),
        statistics.median(d.batch for d in durable if d.batch is not None) if any(d.batch for d in durable) else 0.0,
        rounds,
        per_writer * JOURNAL_WRITERS,
    )


# -- the run -----------------------------------------------------------------------------------------------


def fmt_served(served: tuple[int, ...]) -> str:
    return "/".join(str(n) for n in served) if served else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="quick run for smoke tests")
    parser.add_argument("--requests", type=int, default=None, help="requests per row (default 400; --short 40)")
    parser.add_argument("--no-postgres", action="store_true", help="only the in-process rows")
    add_progress_option(parser)
    args = parser.parse_args(argv)
    start_progress("workers", args)
    requests = args.requests or (REQUESTS_SHORT if args.short else REQUESTS_FULL)
    worker_counts = WORKERS_SHORT if args.short else WORKERS_FULL
    trials = TAKEOVER_TRIALS_SHORT if args.short else TAKEOVER_TRIALS_FULL
    idle_seconds = IDLE_SHORT if args.short else IDLE_FULL
    settle = 0.3 if args.short else 1.0
    load_before = os.getloadavg()[0]
    began = time.perf_counter()

    rows: list[Row] = []
    pg_rows: dict[int, Row] = {}
    takeovers: list[Takeover] = []
    idle: dict[str, Idle] = {}
    journal: JournalRatio | None = None
    pg_failed: str | None = None
    complaints: list[str] = []
    workdir, fs_kind = jb.disk_dir()
    try:
        note(f"in-process, memory journal: {requests} requests, {CONCURRENCY} at a time")
        rows.append(trio.run(in_process, "in-process, memory journal", None, requests, CONCURRENCY))
        note(f"one process, SQLite ({fs_kind}): {requests} requests, {CONCURRENCY} at a time")
        sqlite_path = os.path.join(workdir, "workers.db")
        rows.append(trio.run(in_process, "one process, SQLite journal", sqlite_path, requests, CONCURRENCY))
        with jb.postgres(not args.no_postgres) as (dsn, pg_status):
            note(f"PostgreSQL: {pg_status}")
            if dsn is not None:
                with fleet_of(dsn) as fleet:
                    try:
                        for count in worker_counts:
                            note(f"PostgreSQL, {count} worker process(es): {requests} requests")
                            pg_rows[count] = pg_workers_row(fleet, count, requests)
                        for trial in range(trials):
                            note(f"takeover, trial {trial + 1}/{trials}")
                            takeovers.append(trio.run(takeover_trial, fleet, trial))
                        note(f"worker idle CPU over {idle_seconds:.0f} s, defaults")
                        idle_default = idle_cpu(fleet, idle_seconds, None, "bench_idle_default", settle)
                        note(f"worker idle CPU over {idle_seconds:.0f} s, --poll-interval {POLL_INTERVAL}")
                        idle_polling = idle_cpu(fleet, idle_seconds, POLL_INTERVAL, "bench_idle_polling", settle)
                        idle = {"default": idle_default, "polling": idle_polling}  # both or neither
                    except Exception as exc:  # a broken worker must not hide the other figures
                        first = str(exc).splitlines()[0] if str(exc) else ""
                        pg_failed = f"failed: {type(exc).__name__}: {first}"
                        print(f"workers benchmark: {pg_failed}\n{exc}", file=sys.stderr)
                    finally:
                        complaints = fleet.complaints
                if pg_failed is None:
                    try:
                        journal = journal_at_100(dsn, args.short)
                    except Exception as exc:
                        first = str(exc).splitlines()[0] if str(exc) else ""
                        pg_failed = f"failed (journal): {type(exc).__name__}: {first}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if pg_failed is not None:
        pg_status = pg_failed
    total = time.perf_counter() - began
    load_after = os.getloadavg()[0]
    direct, sqlite = rows
    rows.extend(pg_rows[count] for count in sorted(pg_rows))

    # -- the table
    print(
        f"workers: one request = 2 model calls of {MODEL_LATENCY * 1e3:.0f} ms + 1 pure tool call, each request the "
        f"first of a new session; {requests} requests a row (+ untimed warm-up); trio {trio.__version__}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} cores"
    )
    print(
        "CAVEAT: clients, workers and the PostgreSQL server share this machine; 1-minute load "
        f"{load_before:.2f} before, {load_after:.2f} after"
    )
    print(f"SQLite: one store shared by the process (WAL, synchronous=FULL, {fs_kind}); PostgreSQL: {pg_status}")
    print()
    print(
        f"{'':<34}{'procs':>5}{'in flight':>10}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'x SQLite':>9}"
        f"{'CPU ms/req':>11}{'client':>7}{'server':>7}  served by each"
    )
    for row in rows:
        client = "" if row.client_cpu_ms is None else f"{row.client_cpu_ms:.1f}"
        server = "" if row.server_cpu_ms is None else f"{row.server_cpu_ms:.1f}"
        print(
            f"{row.label:<34}{row.processes:>5}{row.in_flight:>10}{row.per_s:>9.1f}{row.p50_ms:>9.1f}"
            f"{row.p99_ms:>9.1f}{row.per_s / sqlite.per_s:>9.2f}{row.cpu_ms:>11.1f}{client:>7}{server:>7}"
            f"  {fmt_served(row.served)}"
        )
    if not pg_rows:
        print(f"{'PostgreSQL worker rows':<34} {pg_status}")
    print(
        "  in flight: requests kept outstanding (a closed loop); latency: in-process open_session to "
        "serve_request returned, workers submit to the outcome read back (wait_for_request)"
    )
    print(
        "  CPU ms/req: the serving process(es), user + system; client: this process (submit, wait), server: "
        "the PostgreSQL server (ms/req); served by each: the workers' reports, warm-up included"
    )
    print(
        f"  the floor of one request is {2 * MODEL_LATENCY * 1e3:.0f} ms (the model), so {CONCURRENCY} in flight "
        f"cannot pass {CONCURRENCY / (2 * MODEL_LATENCY):.0f} req/s per {CONCURRENCY} slots"
    )
    print()
    if takeovers:
        expiry = statistics.median(t.expiry_to_event_s for t in takeovers)
        kill = statistics.median(t.kill_to_event_s for t in takeovers)
        done = statistics.median(t.kill_to_completed_s for t in takeovers)
        print(
            f"takeover (lease TTL {TAKEOVER_TTL:.0f} s, poll {POLL_INTERVAL} s, median of {len(takeovers)}): lease "
            f"expiry to the session's next durable event {expiry:.3f} s (kill to it {kill:.3f} s; first event "
            f"{takeovers[0].first_event}); the taken-over request completed {done:.2f} s after the kill"
        )
        print("  trials (expiry to event s): " + ", ".join(f"{t.expiry_to_event_s:.3f}" for t in takeovers))
    else:
        print(f"takeover: {pg_status}")
    if idle:
        print(
            f"worker idle CPU, % of one core over {idle_seconds:.0f} s "
            f"(resolution {idle['default'].resolution_percent:.2f} %):"
        )
        for key, what in (
            ("default", "defaults (poll 2 s, lease TTL 30 s)"),
            ("polling", f"--poll-interval {POLL_INTERVAL}"),
        ):
            found = idle[key]
            server = "n/a" if found.server_percent is None else f"{found.server_percent:.2f} %"
            print(f"  {what:<38} worker {found.worker_percent:.2f} %, PostgreSQL server meanwhile {server}")
    else:
        print(f"worker idle CPU: {pg_status}")
    if journal is not None:
        verdict = "target met" if journal.ratio >= JOURNAL_TARGET else "open target"
        print(
            f"PostgreSQL journal at {JOURNAL_WRITERS} writers: {journal.durable_per_s:.0f} appends/s durable "
            f"(avg batch {journal.batch:.1f}) vs {journal.raw_per_s:.0f}/s raw floor = {journal.ratio:.0%} "
            f"({verdict}: >= {JOURNAL_TARGET:.0%}; {JOURNAL_LAST_MEASURED:.0%} when last measured; {journal.events} "
            f"events, median of {journal.rounds} paired round(s); benchmarks/journal.py's functions)"
        )
    else:
        print(f"PostgreSQL journal at {JOURNAL_WRITERS} writers: {pg_status}")
    if complaints:
        print(f"worker stderr ({len(complaints)} line(s) besides the SIGTERM notice), first ones:")
        for line in complaints[:8]:
            print(f"  {line[:200]}")
    print(f"  (whole run: {total:.1f} s)")

    figures: dict[str, Any] = {
        "benchmark": "workers",
        "short": bool(args.short),
        "requests": requests,
        "concurrency": CONCURRENCY,
        "model_latency_ms": MODEL_LATENCY * 1e3,
        "postgres": pg_status,
        "direct_requests_per_s": round(direct.per_s, 2),
        "direct_p50_ms": round(direct.p50_ms, 2),
        "direct_p99_ms": round(direct.p99_ms, 2),
        "direct_cpu_ms_per_request": round(direct.cpu_ms, 3),
        "sqlite_requests_per_s": round(sqlite.per_s, 2),
        "sqlite_p50_ms": round(sqlite.p50_ms, 2),
        "sqlite_p99_ms": round(sqlite.p99_ms, 2),
        "sqlite_cpu_ms_per_request": round(sqlite.cpu_ms, 3),
    }
    for count, row in sorted(pg_rows.items()):
        key = f"pg_workers_{count}"
        figures[f"{key}_requests_per_s"] = round(row.per_s, 2)
        figures[f"{key}_p50_ms"] = round(row.p50_ms, 2)
        figures[f"{key}_p99_ms"] = round(row.p99_ms, 2)
        figures[f"{key}_vs_sqlite"] = round(row.per_s / sqlite.per_s, 3)
        figures[f"{key}_cpu_ms_per_request"] = round(row.cpu_ms, 3)
        if row.client_cpu_ms is not None:
            figures[f"{key}_client_cpu_ms_per_request"] = round(row.client_cpu_ms, 3)
        if row.server_cpu_ms is not None:
            figures[f"{key}_server_cpu_ms_per_request"] = round(row.server_cpu_ms, 3)
    if takeovers:
        figures["takeover_s"] = round(statistics.median(t.expiry_to_event_s for t in takeovers), 4)
        figures["takeover_kill_to_event_s"] = round(statistics.median(t.kill_to_event_s for t in takeovers), 4)
        figures["takeover_kill_to_completed_s"] = round(statistics.median(t.kill_to_completed_s for t in takeovers), 3)
        figures["takeover_lease_ttl_s"] = TAKEOVER_TTL
    if idle:
        figures["idle_cpu_percent"] = round(idle["default"].worker_percent, 3)
        figures["idle_cpu_percent_poll_0_2"] = round(idle["polling"].worker_percent, 3)
        for key, found in idle.items():
            if found.server_percent is not None:
                figures[f"idle_server_cpu_percent_{key}"] = round(found.server_percent, 3)
    if journal is not None:
        figures["pg_journal_100_writers_ratio"] = round(journal.ratio, 3)
        figures["pg_journal_100_writers_per_s"] = round(journal.durable_per_s, 1)
        figures["pg_journal_100_writers_raw_per_s"] = round(journal.raw_per_s, 1)
        figures["pg_journal_100_writers_target"] = JOURNAL_TARGET
    figures["worker_stderr_lines"] = len(complaints)
    figures["seconds"] = round(total, 1)
    figures["load_before"] = round(load_before, 2)
    figures["load_after"] = round(load_after, 2)
    assert all(math.isfinite(v) for v in figures.values() if isinstance(v, float))
    print(json.dumps(figures))
    # PostgreSQL there but its rows failed (a worker's request, the takeover, the journal): the figures
    # above are shown, and the run is still a failure, not a pass with rows missing.
    return 0 if pg_failed is None else 1


if __name__ == "__main__":
    sys.exit(main())
