"""Several worker processes against a throw-away PostgreSQL cluster, with faults.

Sessions are submitted from this process; worker processes (``python -m trio_agent worker``
running ``tests/workers_proc/agent.py``) are killed (SIGKILL) and restarted, one is paused
(SIGSTOP) past its lease and resumed, one is stopped (SIGTERM) mid-run. Then:

* every request finishes exactly once from the submitter's point of view (one terminal
  event in its session's journal, its inbox row done), none is lost, no session is stuck;
* no ``non_idempotent`` effect lands twice (the effects table, fenced downstream);
* the paused worker's writes are refused: along every stream the fencing tokens never go
  down, and the paused worker reports the sessions it lost;
* every worker stopped with SIGTERM exits cleanly.

The short run is in CI; the long one (500 sessions, faults at random) is behind ``stress``.
"""

from __future__ import annotations

import collections
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
import trio
from psycopg import sql

from trio_agent._journal._postgres import _channel as journal_channel
from trio_agent._workers._sql import inbox_channel
from trio_agent.journal import RequestCompleted, RequestFailed, RequestInterrupted, open_postgres_store
from trio_agent.workers import Submitter

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "workers_proc"))
from agent import create_effects  # noqa: E402

LEASE_TTL = 1.0
TERMINAL = (RequestCompleted, RequestFailed, RequestInterrupted)


class Worker:
    """One worker process; its stdout is read for the ready line and the final report."""

    def __init__(self, dsn: str, schema: str, logs: Path, number: int, concurrency: int) -> None:
        self.worker_id = f"w{number}"
        self.log = (logs / f"{self.worker_id}.log").open("w")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE / "workers_proc"), os.environ.get("PYTHONPATH", "")]),
            "WORKERS_TEST_DSN": dsn,
            "WORKERS_TEST_SCHEMA": schema,
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trio_agent",
                "worker",
                "--dsn",
                dsn,
                "--schema",
                schema,
                "--agent",
                "agent:spec",
                "--concurrency",
                str(concurrency),
                "--lease-ttl",
                str(LEASE_TTL),
                "--poll-interval",
                "0.2",
                "--shutdown-grace",
                "3",
                "--worker-id",
                self.worker_id,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lines: list[str] = []
        self.wait_for_line("serving", timeout=60)

    def wait_for_line(self, marker: str, *, timeout: float) -> str:
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([stdout], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise AssertionError(
                    f"{self.worker_id}: no line with {marker!r} within {timeout} s; log: {self.tail()}"
                )
            line = stdout.readline()
            if not line:
                raise AssertionError(f"{self.worker_id} exited ({self.process.poll()}): {self.tail()}")
            self.lines.append(line)
            if marker in line:
                return line

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def terminate(self, *, timeout: float = 30) -> dict[str, Any]:
        """SIGTERM; the clean exit's report (its last stdout line)."""
        self.process.send_signal(signal.SIGTERM)
        out, _ = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, self.tail()
        report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return report

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.log.close()


class Fleet:
    def __init__(self, dsn: str, schema: str, logs: Path, concurrency: int = 4) -> None:
        self.dsn, self.schema, self.logs, self.concurrency = dsn, schema, logs, concurrency
        self.workers: list[Worker] = []

    def start(self) -> Worker:
        worker = Worker(self.dsn, self.schema, self.logs, len(self.workers), self.concurrency)
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def done_count(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(f'SELECT count(*) FROM "{schema}".inbox WHERE state = %s', ("done",)).fetchone()
    assert row is not None
    return int(row[0])


class Watch:
    """A LISTEN connection on the journal's and the inbox's channels: the workers' appends and the
    submissions wake a wait for another process's state, which is then read again."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        for channel in (journal_channel(schema), inbox_channel(schema)):
            self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def until(self, what: str, condition: Any, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}")
            # Woken by the next append or submission; an inbox mark sends none, so a quiet
            # second also ends the wait and the state is read again.
            for _ in self.conn.notifies(timeout=min(left, 1.0), stop_after=1):
                pass

    def close(self) -> None:
        self.conn.close()


def holds_a_session(conn: psycopg.Connection[Any], schema: str, worker_id: str) -> bool:
    row = conn.execute(
        f'SELECT count(*) FROM "{schema}".leases WHERE owner = %s'
        " AND expires_at > extract(epoch FROM clock_timestamp())",
        (worker_id,),
    ).fetchone()
    return row is not None and row[0] > 0


def check_invariants(dsn: str, schema: str, submitted: list[tuple[str, str]]) -> collections.Counter[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f'SELECT session_id, request_id, state, outcome FROM "{schema}".inbox').fetchall()
        effects = conn.execute(
            f'SELECT call_key, count(*) FROM "{schema}".effects GROUP BY call_key HAVING count(*) > 1'
        ).fetchall()
        tokens = conn.execute(f'SELECT stream_id, seq, token FROM "{schema}".events ORDER BY stream_id, seq').fetchall()
    # Nothing lost, nothing stuck: every submission is done.
    assert sorted((s, r) for s, r, _, _ in rows) == sorted(submitted)
    assert {state for _, _, state, _ in rows} == {"done"}
    # No non_idempotent effect twice.
    assert effects == []
    # The fence: along every stream a token never goes down (a stale holder wrote nothing after a takeover).
    last: dict[str, int] = {}
    for stream_id, seq, token in tokens:
        assert token >= last.get(stream_id, 0), f"{stream_id}@{seq} was written with a stale token {token}"
        last[stream_id] = token

    async def terminal_events() -> collections.Counter[str]:
        ends: collections.Counter[str] = collections.Counter()
        async with open_postgres_store(dsn, schema=schema) as store:
            for session_id, request_id in submitted:
                events = [e.event for e in await store.read(f"{session_id}/root")]
                found = [e for e in events if isinstance(e, TERMINAL) and e.request_id == request_id]
                assert len(found) == 1, f"{session_id}/{request_id} ended {len(found)} times"
                ends[type(found[0]).__name__] += 1
        return ends

    return trio.run(terminal_events)


@pytest.fixture
def fleet(postgres_dsn: str, fresh_pg_schema: str, tmp_path: Path) -> Iterator[Fleet]:
    create_effects(postgres_dsn, fresh_pg_schema)
    fleet = Fleet(postgres_dsn, fresh_pg_schema, tmp_path)
    try:
        yield fleet
    finally:
        fleet.close()


def submit_all(dsn: str, schema: str, sessions: int, first: int = 0) -> list[tuple[str, str]]:
    with Submitter(dsn, schema=schema) as queue:
        return [
            (f"s{i}", queue.submit(f"s{i}", f"order {i}", request_id=f"r{i}")) for i in range(first, first + sessions)
        ]


def test_workers_survive_kill_pause_and_terminate(fleet: Fleet, postgres_dsn: str, fresh_pg_schema: str) -> None:
    schema = fresh_pg_schema
    workers = [fleet.start() for _ in range(3)]
    # Submitted in waves, so every fault lands while requests run.
    submitted = submit_all(postgres_dsn, schema, 30)
    watch = Watch(postgres_dsn, schema)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        watch.until("the first requests", lambda: done_count(conn, schema) >= 4, timeout=60)
        # kill -9 one worker mid-run and start another in its place.
        workers[0].kill()
        fleet.start()
        submitted += submit_all(postgres_dsn, schema, 30, first=30)
        # Pause one past its lease (while it holds sessions), then let it run again.
        paused = workers[1]
        watch.until("the paused worker to hold a session", lambda: holds_a_session(conn, schema, "w1"), timeout=60)
        paused.process.send_signal(signal.SIGSTOP)
        watch.until(
            "another worker to take the paused worker's sessions",
            lambda: not holds_a_session(conn, schema, "w1"),
            timeout=30,
        )
        done = done_count(conn, schema)  # it stays stopped while the others serve on
        watch.until("more requests", lambda: done_count(conn, schema) >= done + 3, timeout=60)
        paused.process.send_signal(signal.SIGCONT)
        # SIGTERM one mid-run: it finishes or hands off within its grace and exits cleanly.
        submitted += submit_all(postgres_dsn, schema, 30, first=60)
        watch.until("w2 to hold a session", lambda: holds_a_session(conn, schema, "w2"), timeout=60)
        report = workers[2].terminate()
        assert report["worker_id"] == "w2"
        fleet.start()
        watch.until("every request", lambda: done_count(conn, schema) == len(submitted), timeout=120)
    watch.close()
    reports = {worker.worker_id: worker.terminate() for worker in fleet.workers if worker.process.poll() is None}
    assert reports["w1"]["lost_sessions"] >= 1  # it woke to find its sessions taken: refused, it let them go
    ends = check_invariants(postgres_dsn, schema, submitted)
    assert ends == collections.Counter({"RequestCompleted": len(submitted)})


@pytest.mark.stress
@pytest.mark.parametrize("seed", [18, 19, 20])
def test_workers_under_random_faults_serve_five_hundred_sessions(
    fleet: Fleet, postgres_dsn: str, fresh_pg_schema: str, seed: int
) -> None:
    schema = fresh_pg_schema
    rng = random.Random(seed)
    for _ in range(4):
        fleet.start()
    submitted = submit_all(postgres_dsn, schema, 500)
    total = len(submitted)
    watch = Watch(postgres_dsn, schema)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:

        def progress(more: int, what: str) -> None:
            """Faults are paced by the work done, not by the clock: wait for *more* requests."""
            target = min(done_count(conn, schema) + more, total)
            watch.until(what, lambda: done_count(conn, schema) >= target, timeout=120)

        while done_count(conn, schema) < total:
            progress(rng.randint(5, 25), "the next requests")
            live = [w for w in fleet.workers if w.process.poll() is None]
            fault = rng.choice(["kill", "pause", "terminate", "none"])
            victim = rng.choice(live)
            if fault == "kill":
                victim.kill()
                fleet.start()
            elif fault == "pause":
                victim.process.send_signal(signal.SIGSTOP)
                progress(rng.randint(2, 10), "requests served while one worker is stopped")
                victim.process.send_signal(signal.SIGCONT)
            elif fault == "terminate":
                victim.terminate()
                fleet.start()
    watch.close()
    for worker in fleet.workers:
        if worker.process.poll() is None:
            worker.terminate()
    ends = check_invariants(postgres_dsn, schema, submitted)
    assert ends == collections.Counter({"RequestCompleted": len(submitted)})
