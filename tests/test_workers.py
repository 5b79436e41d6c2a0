"""Workers on a throw-away PostgreSQL cluster, in this process: the durable request queue,
claims, takeover, hand-off, registry, live deltas and the command line.

The multi-process kill/pause/terminate runs are in ``test_workers_processes.py``.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from workers_helpers import gated_agent, takeover_agent, until_done, until_session_state, worker

from trio_agent import ConfigError, LeaseLostError, define_agent, define_tool, open_session
from trio_agent.journal import (
    CommandConflictError,
    RequestAccepted,
    RequestCompleted,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    ToolOutcomeUnknown,
    open_journal,
    open_postgres_store,
)
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel
from trio_agent.workers import (
    Submitter,
    WorkerIdInUseError,
    list_sessions,
    list_workers,
    request_status,
    serve_sessions,
    submit,
    subscribe_live,
    wait_for_request,
)

ROOT = Path(__file__).resolve().parent.parent
OBJECT = {"type": "object"}
TERMINAL = (RequestCompleted, RequestInterrupted)


def answer(text: str = "done") -> Any:
    return define_agent(provider=TestModel(default=Reply(text)))


async def root_events(store: Any, session_id: str) -> list[Any]:
    return [envelope.event for envelope in await store.read(f"{session_id}/root")]


async def until_row_done(dsn: str, schema: str, session_id: str, request_id: str) -> tuple[str, str | None]:
    """`until_done` for a row written around submit() with ids request_status() refuses to look up."""

    def read() -> Any:
        with psycopg.connect(dsn) as conn:
            return conn.execute(
                f'SELECT state, outcome FROM "{schema}".inbox WHERE session_id = %s AND request_id = %s',
                (session_id, request_id),
            ).fetchone()

    while (row := await trio.to_thread.run_sync(read)) is None or row[0] != "done":
        await trio.sleep(0.05)
    return row[0], row[1]


def ends_of(events: list[Any], request_id: str) -> list[Any]:
    return [e for e in events if isinstance(e, TERMINAL) and e.request_id == request_id]


# ---------------------------------------------------------------- submitting


def test_submit_is_idempotent_and_refuses_a_conflicting_retry(postgres_dsn: str, fresh_pg_schema: str) -> None:
    with Submitter(postgres_dsn, schema=fresh_pg_schema) as queue:
        first = queue.submit("s1", "hello", request_id="r1")
        assert first == "r1"
        assert queue.submit("s1", "hello", request_id="r1") == "r1"  # a retry: one row
        with pytest.raises(CommandConflictError, match="different prompt"):
            queue.submit("s1", "something else", request_id="r1")
        generated = queue.submit("s1", "again")
        assert generated.startswith("req-") and generated != "r1"
        assert queue.status("s1", "r1") == queue.status("s1", "r1")
        status = queue.status("s1", "r1")
        assert status is not None and (status.state, status.outcome) == ("pending", None)
        assert queue.status("s1", "never") is None
    with psycopg.connect(postgres_dsn) as conn:
        rows = conn.execute(f'SELECT request_id FROM "{fresh_pg_schema}".inbox ORDER BY seq').fetchall()
    assert [row[0] for row in rows] == ["r1", generated]


@pytest.mark.parametrize(
    ("args", "kwargs", "names"),
    [
        (("", "hi"), {}, "session_id"),
        (("a/b", "hi"), {}, "session_id"),
        (("s", ""), {}, "prompt"),
        (("s", "   "), {}, "prompt"),
        (("s", "nul\x00byte"), {}, "NUL"),
        (("s", "hello \ud800 there"), {}, "prompt must be valid Unicode text"),
        (("s\udcff", "hi"), {}, "session_id must be valid Unicode text"),
        (("s", "hi"), {"request_id": "r\ud800"}, "request_id must be valid Unicode text"),
        (("s", 42), {}, "prompt"),
        (("s", "hi"), {"request_id": ""}, "request_id"),
        (("s", "hi"), {"priority": True}, "priority"),
        (("s", "hi"), {"priority": 2**40}, "priority"),
        (("s", "hi"), {"priority": 1.5}, "priority"),
    ],
)
def test_submit_refuses_bad_input_by_name(
    postgres_dsn: str, fresh_pg_schema: str, args: tuple[Any, ...], kwargs: dict[str, Any], names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        submit(*args, dsn=postgres_dsn, schema=fresh_pg_schema, **kwargs)
    with psycopg.connect(postgres_dsn) as conn:
        exists = conn.execute("SELECT to_regclass(%s)", (f'"{fresh_pg_schema}".inbox',)).fetchone()
        if exists is not None and exists[0] is not None:
            assert conn.execute(f'SELECT count(*) FROM "{fresh_pg_schema}".inbox').fetchone() == (0,)


def test_every_entry_point_refuses_ids_and_prompts_no_row_can_hold_by_name(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    # A lone surrogate escaped as a bare UnicodeEncodeError (the driver's), and a NUL in an id read
    # back was "the server is unreachable" (JournalUnavailableError): both are the caller's input.
    where = {"dsn": postgres_dsn, "schema": fresh_pg_schema}
    with Submitter(postgres_dsn, schema=fresh_pg_schema) as queue:
        with pytest.raises(ConfigError, match=r"^prompt must be valid Unicode text"):
            queue.submit("s", "bad \udcff byte")
        for session_id, request_id, name in [("s\x00", "r", "session_id"), ("s", "r\udcff", "request_id")]:
            with pytest.raises(ConfigError, match=f"^{name} must not contain|^{name} must be valid"):
                queue.status(session_id, request_id)
            with pytest.raises(ConfigError, match=f"^{name} must not contain|^{name} must be valid"):
                request_status(session_id, request_id, **where)
        assert queue.status("s", "r") is None  # the connection is still good
    unreachable = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"  # checked before connecting
    with pytest.raises(ConfigError, match=r"^prompt"):
        submit("s", "bad \udcff byte", dsn=unreachable)
    with pytest.raises(ConfigError, match=r"^session_id"):
        request_status("s\x00", "r", dsn=unreachable)


def test_submit_without_a_dsn_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIO_AGENT_DSN", raising=False)
    with pytest.raises(ConfigError, match="TRIO_AGENT_DSN"):
        submit("s", "hi")


def test_submit_to_an_unreachable_server_is_a_typed_error() -> None:
    from trio_agent.journal import JournalUnavailableError

    with pytest.raises(JournalUnavailableError, match="cannot connect"):
        submit("s", "hi", dsn="postgresql://nobody@127.0.0.1:1/none?connect_timeout=2")


# ---------------------------------------------------------------- serving


async def test_a_worker_serves_each_submission_once_in_priority_order(postgres_dsn: str, fresh_pg_schema: str) -> None:
    model = TestModel(respond=lambda request: Reply(f"answer to {request.messages[-1].content}"))
    spec = define_agent(provider=model)
    with Submitter(postgres_dsn, schema=fresh_pg_schema) as queue:
        queue.submit("s1", "low", request_id="low", priority=0)
        queue.submit("s1", "high", request_id="high", priority=5)
        queue.submit("s2", "other", request_id="other")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(spec, postgres_dsn, fresh_pg_schema, concurrency=2) as report:
            with trio.fail_after(30):
                outcomes = {
                    rid: await wait_for_request(store, sid, rid)
                    for sid, rid in [("s1", "low"), ("s1", "high"), ("s2", "other")]
                }
                # Submitted while the worker runs: woken by NOTIFY (or the poll), served too.
                late = await trio.to_thread.run_sync(
                    functools.partial(submit, "s2", "late", dsn=postgres_dsn, schema=fresh_pg_schema)
                )
                outcomes[late] = await wait_for_request(store, "s2", late)
        assert {rid: o.state for rid, o in outcomes.items()} == dict.fromkeys(outcomes, "completed")
        assert outcomes["high"].text == "answer to high"
        assert outcomes["high"].seq < outcomes["low"].seq  # the higher priority ran first
        events = await root_events(store, "s1")
        assert [e.request_id for e in events if isinstance(e, RequestAccepted)] == ["high", "low"]
        for sid, rid in [("s1", "low"), ("s1", "high"), ("s2", "other"), ("s2", late)]:
            assert len(ends_of(await root_events(store, sid), rid)) == 1
    assert report.served == 4
    status = request_status("s1", "low", dsn=postgres_dsn, schema=fresh_pg_schema)
    assert status is not None and (status.state, status.outcome) == ("done", "completed")


async def test_two_workers_share_sessions_and_run_each_request_exactly_once(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    spec = define_agent(provider=TestModel(default=Reply("ok", latency=0.01)))
    with Submitter(postgres_dsn, schema=fresh_pg_schema) as queue:
        ids = [(f"s{i}", queue.submit(f"s{i}", f"p{i}")) for i in range(24)]
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        worker(spec, postgres_dsn, fresh_pg_schema, concurrency=4, worker_id="w-a") as a,
        worker(spec, postgres_dsn, fresh_pg_schema, concurrency=4, worker_id="w-b") as b,
    ):
        with trio.fail_after(60):
            for sid, rid in ids:
                assert (await wait_for_request(store, sid, rid)).state == "completed"
        for sid, rid in ids:
            assert len(ends_of(await root_events(store, sid), rid)) == 1
    assert a.served + b.served == len(ids)
    assert a.claimed + b.claimed >= len(ids)


async def test_a_session_that_was_ended_refuses_its_submissions(postgres_dsn: str, fresh_pg_schema: str) -> None:
    spec = answer()
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with open_session(spec, journal=store, session_id="gone") as session:
            await session.end()
        rid = await trio.to_thread.run_sync(
            functools.partial(submit, "gone", "anyone?", dsn=postgres_dsn, schema=fresh_pg_schema)
        )
        async with worker(spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                status = await until_done(postgres_dsn, fresh_pg_schema, "gone", rid)
        assert status.outcome == "refused"
        with trio.fail_after(10):  # the submitter learns it from the journal too
            outcome = await wait_for_request(store, "gone", rid)
        assert outcome.state == "refused"
    states = {s.session_id: s.state for s in list_sessions(dsn=postgres_dsn, schema=fresh_pg_schema)}
    assert states["gone"] == "done"


# ---------------------------------------------------------------- takeover


async def test_a_dead_workers_session_is_taken_over_from_its_last_durable_point(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A worker dies (nothing more written, lease left to expire) with a request started: its
    look settled, its payment started. Another worker claims the session with a higher token,
    keeps the look, tells the payment's outcome is unknown (never paid twice), asks the model
    next, and ends the request exactly once."""
    scenario = takeover_agent()
    spec, paid, started = scenario.spec, scenario.paid, scenario.started
    rid = await trio.to_thread.run_sync(
        functools.partial(submit, "taken", "go", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    control = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="dead-worker")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        try:
            await control.open()
            [lease] = await control.claim(1, ttl=1.0)
            with pytest.raises(LeaseLostError):
                async with (
                    open_journal(store, lease=lease, lease_ttl=1.0, heartbeat_interval=0.3) as journal,
                    open_session(spec, journal=journal, unfinished="keep") as session,
                    trio.open_nursery() as nursery,
                ):
                    nursery.start_soon(session.serve_request, rid, "go")
                    with trio.fail_after(10):
                        await started.wait()
                    journal._lose(LeaseLostError("kill -9"))  # nothing more is written by it
                    await trio.sleep_forever()
        finally:
            control.close()
        before = await root_events(store, "taken")
        assert any(isinstance(e, RequestStarted) for e in before) and not ends_of(before, rid)
        async with worker(spec, postgres_dsn, fresh_pg_schema, lease_ttl=5.0) as report:
            with trio.fail_after(30):
                outcome = await wait_for_request(store, "taken", rid)
        assert outcome.state == "completed" and outcome.text == "finished with 2 results"
        events = await root_events(store, "taken")
        assert len(ends_of(events, rid)) == 1
        assert len([e for e in events if isinstance(e, ToolOutcomeUnknown)]) == 1
        assert len(paid) == 1
        current = await store.current_lease("taken")
        assert current is None or current.token > lease.token
    assert report.claimed == 1 and report.served == 1


async def test_requests_nobody_submitted_are_interrupted_by_the_takeover(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A plain process's session crashed with a request accepted: no submission stands for it,
    so a worker that takes the session over ends it (process_restart) and serves the submitted one."""
    spec = answer()
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        with pytest.raises(LeaseLostError):
            async with open_journal(store, session_id="mixed", lease_ttl=1.0, heartbeat_interval=0.3) as journal:
                await journal.append(
                    RequestAccepted(request_id="orphan", command_id="orphan", input={"prompt": "x"}),
                    command_id="orphan",
                )
                journal._lose(LeaseLostError("crashed"))
                await trio.sleep_forever()
        rid = await trio.to_thread.run_sync(
            functools.partial(submit, "mixed", "served", dsn=postgres_dsn, schema=fresh_pg_schema)
        )
        async with worker(spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(30):
                assert (await wait_for_request(store, "mixed", rid)).state == "completed"
        events = await root_events(store, "mixed")
        [orphan] = ends_of(events, "orphan")
        assert isinstance(orphan, RequestInterrupted) and orphan.reason is RequestInterruptReason.PROCESS_RESTART


async def test_a_stale_holder_cannot_move_inbox_rows(postgres_dsn: str, fresh_pg_schema: str) -> None:
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    await trio.to_thread.run_sync(
        functools.partial(submit, "fenced", "hi", request_id="r", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    old = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="old")
    new = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="new")
    try:
        await old.open()
        [stale] = await old.claim(1, ttl=0.05)
        with trio.fail_after(10):
            while not (claimed := await new.claim(1, ttl=30)):
                await trio.sleep(0.02)  # waiting for the server clock to pass the stale lease's expiry
        [fresh] = claimed
        assert fresh.token == stale.token + 1
        assert not await old.mark(stale, "r", "done", "completed")  # refused: not the holder
        assert await new.mark(fresh, "r", "taken", None)
        assert not await old.claim(1, ttl=30)  # held: SKIP LOCKED / not expired, nothing to take
    finally:
        old.close()
        new.close()
    status = request_status("fenced", "r", dsn=postgres_dsn, schema=fresh_pg_schema)
    assert status is not None and status.state == "taken"


async def test_a_stopping_worker_hands_a_running_request_off_at_once(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """Stop with a request still running past the grace: the worker gives the session up without
    recording anything and releases the lease, so another worker takes over at once (long before
    the 30 s lease would expire) and finishes the request exactly once."""
    gated = gated_agent("after the wait")
    spec, gate, entered = gated.spec, gated.gate, gated.entered
    rid = await trio.to_thread.run_sync(
        functools.partial(submit, "handed", "go", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            first = await nursery.start(
                functools.partial(
                    serve_sessions,
                    spec,
                    postgres_dsn,
                    schema=fresh_pg_schema,
                    stop=stop,
                    lease_ttl=30.0,
                    shutdown_grace=0.1,
                    poll_interval=0.2,
                    worker_id="first",
                )
            )
            with trio.fail_after(10):
                await entered.wait()
            stop.set()
        assert first.handed_off == 1 and first.served == 0
        assert not ends_of(await root_events(store, "handed"), rid)
        lease = await store.current_lease("handed")
        assert lease is None or lease.expires_at < store.clock()  # released, not left to expire
        gate.set()
        async with worker(spec, postgres_dsn, fresh_pg_schema, worker_id="second") as second:
            with trio.fail_after(10):  # far below the first worker's 30 s lease
                outcome = await wait_for_request(store, "handed", rid)
        assert outcome.state == "completed" and outcome.text == "after the wait"
        assert len(ends_of(await root_events(store, "handed"), rid)) == 1
    assert second.served == 1


# ---------------------------------------------------------------- registry, live deltas, command line


async def test_the_registry_shows_running_sessions_and_live_workers(postgres_dsn: str, fresh_pg_schema: str) -> None:
    gated = gated_agent()
    spec, gate, entered = gated.spec, gated.gate, gated.entered
    rid = await trio.to_thread.run_sync(
        functools.partial(submit, "busy", "go", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(spec, postgres_dsn, fresh_pg_schema, worker_id="reg", lease_ttl=0.9) as report:
            with trio.fail_after(10):
                await entered.wait()
            sessions = await trio.to_thread.run_sync(
                functools.partial(list_sessions, dsn=postgres_dsn, schema=fresh_pg_schema)
            )
            [busy] = [s for s in sessions if s.session_id == "busy"]
            assert busy.state == "running" and busy.worker == "reg" and busy.queued == 1
            assert busy.lease_until is not None and 0 < busy.lease_until <= 0.9
            with trio.fail_after(10):
                while True:  # the worker's heartbeat (every lease_ttl / 3) reports its load
                    workers = await trio.to_thread.run_sync(
                        functools.partial(list_workers, dsn=postgres_dsn, schema=fresh_pg_schema)
                    )
                    if workers and workers[0].hosted == 1:
                        break
                    await trio.sleep(0.05)
            [me] = workers
            assert me.worker_id == "reg" and me.live and not me.stopping and me.concurrency == 8
            gate.set()
            with trio.fail_after(10):
                await wait_for_request(store, "busy", rid)
        assert report.served == 1
    sessions = list_sessions(dsn=postgres_dsn, schema=fresh_pg_schema)
    assert [(s.session_id, s.state, s.queued) for s in sessions] == [("busy", "waiting", 0)]
    assert list_workers(dsn=postgres_dsn, schema=fresh_pg_schema) == []  # a clean stop unregisters


async def test_a_worker_restarted_under_its_id_takes_over_the_crashed_runs_row(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A crashed run's row (never unregistered) holds the id until it is stale (not seen for three
    of its heartbeats): a restart under the same id waits that long, then rewrites the whole row."""
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    def registered() -> tuple[Any, ...]:
        with psycopg.connect(postgres_dsn) as conn:
            row = conn.execute(
                f'SELECT host, pid, concurrency, interval, started_at, run_id FROM "{fresh_pg_schema}".workers'
            ).fetchone()
        assert row is not None
        return tuple(row)

    crashed = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="w1")
    try:
        await crashed.open()
        await crashed.start(concurrency=2, interval=0.1)
        await crashed.seen(concurrency=2, hosted=1, served=5, stopping=False, interval=0.1)
    finally:
        crashed.close()  # never unregistered: its row stays, as after a kill -9
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # another host, long ago
        conn.execute(
            f"UPDATE \"{fresh_pg_schema}\".workers SET host = 'gone', pid = 1, started_at = started_at - 3600".encode()
        )
    restarted = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="w1")
    try:
        with trio.fail_after(10):
            await restarted.start(concurrency=7, interval=1.0)  # once the crashed row is stale
        host, pid, concurrency, interval, started_at, run_id = await trio.to_thread.run_sync(registered)
        assert (host, pid, concurrency, interval, run_id) == (
            socket.gethostname(),
            os.getpid(),
            7,
            1.0,
            restarted.run_id,
        )
        [me] = await trio.to_thread.run_sync(functools.partial(list_workers, dsn=postgres_dsn, schema=fresh_pg_schema))
        assert me.uptime < 600  # this run's, not the crashed run's
        await restarted.seen(concurrency=7, hosted=1, served=1, stopping=False, interval=1.0)
        assert (await trio.to_thread.run_sync(registered))[4] == started_at  # a heartbeat keeps the run's start
        with pytest.raises(WorkerIdInUseError, match="'w1'"):  # the crashed run, woken, is told
            await crashed.seen(concurrency=2, hosted=1, served=5, stopping=False, interval=0.1)
    finally:
        restarted.close()
        crashed.close()


async def test_live_deltas_reach_a_subscriber_in_another_connection(postgres_dsn: str, fresh_pg_schema: str) -> None:
    text = "streamed " * 40
    spec = answer(text)
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with (
            await subscribe_live("live", dsn=postgres_dsn, schema=fresh_pg_schema) as deltas,
            await subscribe_live("someone-else", dsn=postgres_dsn, schema=fresh_pg_schema) as others,
            worker(spec, postgres_dsn, fresh_pg_schema),
        ):
            rid = await trio.to_thread.run_sync(
                functools.partial(submit, "live", "hi", dsn=postgres_dsn, schema=fresh_pg_schema)
            )
            seen: list[Any] = []
            with trio.fail_after(20):
                async for delta in deltas:
                    seen.append(delta)
                    if "".join(d.text for d in seen) == text:
                        break
            outcome = await wait_for_request(store, "live", rid)
            with trio.move_on_after(0.2):
                await others.__anext__()
                raise AssertionError("a delta of another session reached the wrong subscriber")
        assert outcome.text == text
        assert {d.request_id for d in seen} == {rid} and [d.n for d in seen] == list(range(1, len(seen) + 1))


async def test_the_command_line_submits_waits_and_lists(postgres_dsn: str, fresh_pg_schema: str) -> None:
    env = {**os.environ, "TRIO_AGENT_DSN": postgres_dsn}
    cli = [sys.executable, "-m", "trio_agent"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)

    from trio_agent._workers._offline import offline_spec

    async with worker(offline_spec(), postgres_dsn, fresh_pg_schema, worker_id="cli-worker"):
        done = await trio.to_thread.run_sync(
            functools.partial(run, "submit", "calc", "add 2 and 40", "--schema", fresh_pg_schema, "--wait", "60")
        )
        assert done.returncode == 0, done.stderr
        request_id, outcome = done.stdout.strip().splitlines()
        assert json.loads(outcome)["text"] == "the sum is 42.0" and json.loads(outcome)["request_id"] == request_id
        listed = await trio.to_thread.run_sync(functools.partial(run, "sessions", "--schema", fresh_pg_schema))
        assert listed.returncode == 0 and "calc" in listed.stdout and "SESSION" in listed.stdout
        workers = await trio.to_thread.run_sync(
            functools.partial(run, "workers", "--schema", fresh_pg_schema, "--json")
        )
        assert [w["worker_id"] for w in json.loads(workers.stdout)] == ["cli-worker"]


def test_the_command_line_refuses_bad_input_with_a_typed_message(postgres_dsn: str, fresh_pg_schema: str) -> None:
    cli = [sys.executable, "-m", "trio_agent"]
    env = {**os.environ, "TRIO_AGENT_DSN": postgres_dsn}
    refused = subprocess.run(
        [*cli, "submit", "calc", "", "--schema", fresh_pg_schema], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and "prompt" in refused.stderr
    undecodable = subprocess.run(  # its bytes arrive as lone surrogates (a bare UnicodeEncodeError's traceback)
        [*cli, "submit", "calc", b"bad \xff byte", "--schema", fresh_pg_schema], env=env, capture_output=True
    )
    assert undecodable.returncode == 1 and undecodable.stdout == b""
    assert undecodable.stderr.decode().splitlines() == [
        "error: prompt must be valid Unicode text: it has a lone surrogate U+DCFF at 4 (bytes that are not UTF-8?)"
    ]
    env.pop("TRIO_AGENT_DSN")
    no_dsn = subprocess.run([*cli, "sessions"], env=env, capture_output=True, text=True, timeout=60)
    assert no_dsn.returncode == 1 and "TRIO_AGENT_DSN" in no_dsn.stderr
    no_agent = subprocess.run(
        [*cli, "worker", "--dsn", postgres_dsn, "--agent", "no_such_module:spec"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert no_agent.returncode != 0 and "cannot load --agent" in no_agent.stderr


async def test_serve_sessions_refuses_bad_options_by_name(postgres_dsn: str) -> None:
    spec = answer()
    for options, name in [
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": True}, "concurrency"),
        ({"lease_ttl": 0}, "lease_ttl"),
        ({"poll_interval": -1}, "poll_interval"),
        ({"schema": "bad-name"}, "schema"),
        ({"dsn": "host='unterminated"}, "DSN"),
    ]:
        options = {"dsn": postgres_dsn, **options}
        with pytest.raises(ConfigError, match=name):
            await serve_sessions(spec, **options)
    with pytest.raises(ConfigError, match="AgentSpec"):
        await serve_sessions("not a spec", postgres_dsn)  # type: ignore[arg-type]


async def test_a_request_that_pauses_is_done_paused_and_the_session_shows_paused(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    @define_tool(name="delete", description="d", input_schema=OBJECT, side_effect="non_idempotent", kind="write")
    async def delete(input: dict[str, Any], ctx: Any) -> str:
        raise AssertionError("runs only after a person approves")  # pragma: no cover

    spec = define_agent(
        provider=TestModel(default=Reply(tool_calls=[("delete", {})])),
        tools=[delete],
        permission_asks="interrupt",
    )
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        rid = await trio.to_thread.run_sync(
            functools.partial(submit, "asks", "delete it", dsn=postgres_dsn, schema=fresh_pg_schema)
        )
        async with worker(spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                outcome = await wait_for_request(store, "asks", rid)
                status = await until_done(postgres_dsn, fresh_pg_schema, "asks", rid)
                await until_session_state(postgres_dsn, fresh_pg_schema, "asks", "paused")
        assert outcome.state == "paused" and status.outcome == "paused"
        # A person answers in a process of their own: it opens the session and resumes it.
        async with open_session(spec, journal=store, session_id="asks") as session:
            assert session.paused is not None


@pytest.mark.parametrize(
    "text", ["plain " * 3000, "\x01\x02" * 3000, "\U0001f600" * 5000, "é\n" * 4000, "x", "lone \ud800 surrogate"]
)
def test_live_payloads_always_fit_a_notify_whatever_the_text(text: str) -> None:
    from trio_agent._workers._live import NOTIFY_MAX, live_payloads

    for ids in ("s", "\U0001f600" * 200):
        payloads = live_payloads(ids, ids, ids, 7, text)
        decoded = [json.loads(payload) for payload in payloads]
        assert "".join(d["t"] for d in decoded) == text
        assert [d["n"] for d in decoded] == list(range(7, 7 + len(decoded)))
        assert all(len(payload.encode("ascii")) <= NOTIFY_MAX for payload in payloads)


async def test_the_live_sink_never_waits_and_counts_what_it_drops() -> None:
    from trio_agent._session._messages import TextDeltaEvent
    from trio_agent._workers._live import LivePublisher

    publisher = LivePublisher(control=None, channel="unused", capacity=2)  # type: ignore[arg-type]
    sink = publisher.sink_for("s", "r")
    with trio.testing.assert_no_checkpoints():  # a full channel never holds the run
        for text in ["a", "b", "c", "d"]:
            await sink(TextDeltaEvent("root", text))
    assert publisher.dropped == 2


# ---------------------------------------------------------------- failures stay contained (review findings)


async def test_a_session_that_cannot_be_opened_is_parked_not_spun(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """A damaged journal fails the open: the worker holds the lease one TTL without serving
    (the registry says failing), so nobody re-claims it in a loop."""
    spec = answer()
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        open_session(spec, journal=store, session_id="broken") as session,
    ):
        await session.send("first")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE "{fresh_pg_schema}".events SET checksum = checksum + 1 WHERE seq = 2')
        conn.execute(f'DELETE FROM "{fresh_pg_schema}".snapshots')
    await trio.to_thread.run_sync(
        functools.partial(submit, "broken", "again", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    async with worker(spec, postgres_dsn, fresh_pg_schema, lease_ttl=3.0, poll_interval=0.05) as report:
        with trio.fail_after(10):
            await until_session_state(postgres_dsn, fresh_pg_schema, "broken", "failing")
            while report.failed_sessions == 0:
                await trio.sleep(0.05)  # the worker's report, filled in as it goes
        await trio.sleep(1.0)  # the scenario: a second of polling every 50 ms while it is parked
        assert report.claimed == 1 and report.failed_sessions == 1
    [status] = [s for s in list_sessions(dsn=postgres_dsn, schema=fresh_pg_schema) if s.session_id == "broken"]
    assert status.state == "failing" and status.queued == 1


async def test_parking_judges_a_live_lease_by_the_server_clock(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """Parking never takes a live lease (a replica under the same worker id may hold it): live by
    the server's clock, as claims judge it, not this host's, which may be an hour ahead."""
    import time

    from trio_agent._workers._control import Control
    from trio_agent._workers._serve import _Worker
    from trio_agent._workers._sql import Statements

    control = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="me")
    try:
        await control.open()
        async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
            parker = _Worker(
                answer(), store, control, concurrency=1, lease_ttl=5, poll_interval=1, cleanup_grace=1, live=False
            )
            held = await store.acquire_lease("s", "me", 60)
            store.clock = lambda: time.time() + 3600
            await parker._park("s")
            assert await store.current_lease("s") == held  # left alone
            await store.release_lease(held)
            store.clock = lambda: time.time() - 3600
            await parker._park("s")  # free by the server's clock: parked, whatever this host says
            parked = await store.current_lease("s")
            assert parked is not None and (parked.owner, parked.token) == ("me", held.token + 1)
    finally:
        control.close()


async def test_a_worker_never_claims_a_session_it_still_hosts(postgres_dsn: str, fresh_pg_schema: str) -> None:
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    await trio.to_thread.run_sync(
        functools.partial(submit, "mine", "hi", request_id="r", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    control = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="me")
    try:
        await control.open()
        [first] = await control.claim(1, ttl=0.05)
        with trio.fail_after(10):
            while await store_clock_before(postgres_dsn, first.expires_at):
                await trio.sleep(0.02)  # the server's clock must pass the lease's expiry
        assert await control.claim(1, ttl=30, exclude=["mine"]) == []
        [again] = await control.claim(1, ttl=30)
        assert again.token == first.token + 1
    finally:
        control.close()


async def store_clock_before(dsn: str, when: float) -> bool:
    def read() -> bool:
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        return row is not None and row[0] <= when

    return await trio.to_thread.run_sync(read)


async def test_a_cancelled_control_statement_does_not_wait_for_a_silent_server(postgres_dsn: str) -> None:
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    control = Control(postgres_dsn, Statements("t_unused"), worker_id="w")
    try:
        with trio.move_on_after(0.2) as scope:
            await control._run(lambda conn: conn.execute("SELECT pg_sleep(5)"))
        assert scope.cancelled_caught
        assert trio.current_time() - scope.deadline < 1.0  # back at once, not after the 5 s statement
    finally:
        control.close()


async def test_a_submission_written_around_submit_is_refused_not_wedging_the_session(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    spec = answer()
    good = await trio.to_thread.run_sync(
        functools.partial(submit, "wedge", "fine", request_id="good", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        for request_id, prompt in [("", "no id"), ("blank", "   ")]:
            conn.execute(
                f'INSERT INTO "{fresh_pg_schema}".inbox(session_id, request_id, prompt, priority, submitted_at,'
                " state, updated_at) VALUES ('wedge', %s, %s, 9, 0, 'pending', 0)",
                (request_id, prompt),
            )
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema, poll_interval=0.05) as store,
        worker(spec, postgres_dsn, fresh_pg_schema) as report,
    ):
        with trio.fail_after(20):
            assert (await wait_for_request(store, "wedge", good)).state == "completed"
            # A refused row leaves nothing in the journal: its waiter waited forever. It reads the
            # refusal from the inbox; an id no journal can hold is refused at once.
            refused = await wait_for_request(store, "wedge", "blank")
            with pytest.raises(ConfigError, match="request_id"):
                await wait_for_request(store, "wedge", "")
            bad = await until_row_done(postgres_dsn, fresh_pg_schema, "wedge", "")
    assert refused.state == "refused" and refused.request_id == "blank" and "refused" in str(refused.reason)
    assert bad == ("done", "refused") and report.refused == 2 and report.failed_sessions == 0


async def test_live_text_with_a_lone_surrogate_still_completes(postgres_dsn: str, fresh_pg_schema: str) -> None:
    spec = answer("broken \ud800 text")
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        worker(spec, postgres_dsn, fresh_pg_schema, live=True),
    ):
        rid = await trio.to_thread.run_sync(
            functools.partial(submit, "odd", "hi", dsn=postgres_dsn, schema=fresh_pg_schema)
        )
        with trio.fail_after(20):
            outcome = await wait_for_request(store, "odd", rid)
    assert outcome.state == "completed"


async def test_a_live_subscriber_skips_strangers_payloads_and_ends_when_closed(postgres_dsn: str) -> None:
    schema = "t_live_strangers"
    subscription = await subscribe_live("s", dsn=postgres_dsn, schema=schema)
    from trio_agent._workers._sql import live_channel

    def notify(*payloads: str) -> None:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            for payload in payloads:
                conn.execute("SELECT pg_notify(%s, %s)", (live_channel(schema), payload))

    good = json.dumps({"s": "s", "r": "r", "a": "root", "n": 1, "t": "hello"})
    strangers = ["[" * 7000, '{"s":"s","r":"r","a":"a","n":1e999,"t":"x"}', '{"n": true}', "not json", "[]"]
    await trio.to_thread.run_sync(notify, *strangers, good)
    async with subscription as deltas:
        with trio.fail_after(10):
            delta = await deltas.__anext__()
        assert (delta.text, delta.n) == ("hello", 1) and deltas.malformed == len(strangers)
        async with trio.open_nursery() as nursery:
            ended = trio.Event()

            async def read_on() -> None:
                async for _ in deltas:
                    raise AssertionError("nothing else was sent")
                ended.set()

            nursery.start_soon(read_on)
            await trio.testing.wait_all_tasks_blocked()
            await deltas.aclose()
            with trio.fail_after(5):
                await ended.wait()


def test_bad_dsn_and_schema_are_named(postgres_dsn: str) -> None:
    with pytest.raises(ConfigError, match="connection string"):
        submit("s", "hi", dsn=42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="schema"):
        submit("s", "hi", dsn=postgres_dsn, schema="schéma")


async def test_a_paused_request_answered_before_its_row_was_marked_ends_resumed_without_a_loop(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A worker died between `run_paused` and marking the row; a person answered meanwhile (the
    original request is `resumed`). The next worker marks the row done `resumed`, once."""
    from trio_agent.lifecycle import Approve

    deleted: list[str] = []

    @define_tool(name="delete", description="d", input_schema=OBJECT, side_effect="non_idempotent", kind="write")
    async def delete(input: dict[str, Any], ctx: Any) -> str:
        deleted.append(ctx.tool_call_id)
        return "deleted"

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        return Reply("all gone") if isinstance(last, ToolResultMessage) else Reply(tool_calls=[("delete", {})])

    spec = define_agent(provider=TestModel(respond=respond), tools=[delete], permission_asks="interrupt")
    rid = await trio.to_thread.run_sync(
        functools.partial(submit, "answered", "delete it", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                await until_done(postgres_dsn, fresh_pg_schema, "answered", rid)
                await until_session_state(postgres_dsn, fresh_pg_schema, "answered", "paused")
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # as if its worker died before the mark
            conn.execute(f"UPDATE \"{fresh_pg_schema}\".inbox SET state = 'taken', outcome = NULL")
        async with open_session(spec, journal=store, session_id="answered") as session:
            assert session.paused is not None
            [question] = session.paused.interrupts
            assert await session.resume([Approve(question.id)]) == "all gone"
        async with worker(spec, postgres_dsn, fresh_pg_schema, poll_interval=0.05) as report:
            with trio.fail_after(20):
                status = await until_done(postgres_dsn, fresh_pg_schema, "answered", rid)
            await trio.sleep(0.5)  # the scenario: ten polls with nothing left to claim
        assert status.outcome == "resumed" and report.claimed == 1 and len(deleted) == 1


async def test_a_worker_keeps_serving_after_its_pooled_connections_were_cut(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """The server ends the worker's idle control connections while a request runs (a restart, an
    idle timeout): marking it done retries on a fresh connection, and the healthy session is
    neither parked nor served twice."""
    gated = gated_agent()
    spec, gate, entered = gated.spec, gated.gate, gated.entered

    def cut() -> int:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'trio_agent worker' AND state = 'idle'"
            ).fetchall()
        return len(rows)

    rid = await trio.to_thread.run_sync(
        functools.partial(submit, "cut", "go", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    # No polling and a slow heartbeat: the next control statement is the request's own mark.
    async with worker(spec, postgres_dsn, fresh_pg_schema, poll_interval=60.0, lease_ttl=30.0) as report:
        with trio.fail_after(20):
            await entered.wait()
            assert await trio.to_thread.run_sync(cut) >= 1
            gate.set()
            status = await until_done(postgres_dsn, fresh_pg_schema, "cut", rid)
    assert status.outcome == "completed"
    assert report.failed_sessions == 0 and report.served == 1


def test_a_queued_session_whose_id_predates_the_c1_rule_is_still_served() -> None:
    """submit() refuses C1 controls, format characters and separators now; a session queued
    before, under the older rule, is still one a worker serves (it opens it by its journal)."""
    from trio_agent._config import validate_id
    from trio_agent._workers._serve import _usable_session_id

    with pytest.raises(ConfigError, match="U\\+0085"):
        validate_id("legacy\x85id", name="session_id")  # what submit() checks
    assert _usable_session_id("legacy\x85id")
    assert not _usable_session_id("bad/id") and not _usable_session_id("a\x1fb")


async def test_a_submission_to_a_session_id_no_journal_takes_is_refused(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # written around submit()
        await trio.to_thread.run_sync(functools.partial(submit, "ok", "x", dsn=postgres_dsn, schema=fresh_pg_schema))
        conn.execute(f'INSERT INTO "{fresh_pg_schema}".leases VALUES (%s, %s, 0, %s)', ("bad/id", "", float("-inf")))
        conn.execute(
            f'INSERT INTO "{fresh_pg_schema}".inbox(session_id, request_id, prompt, priority, submitted_at,'
            " state, updated_at) VALUES ('bad/id', 'r', 'p', 0, 0, 'pending', 0)"
        )
    async with worker(answer(), postgres_dsn, fresh_pg_schema, lease_ttl=3.0, poll_interval=0.05) as report:
        with trio.fail_after(20):
            status = await until_row_done(postgres_dsn, fresh_pg_schema, "bad/id", "r")
    assert status == ("done", "refused") and report.failed_sessions == 0 and report.refused == 1


async def test_a_graceful_stop_hosts_what_an_in_flight_claim_took_then_lets_it_go(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """Stop lands while a claim is on its way: the claim's sessions are not stranded under a lease
    nobody serves; they are released at once for the next worker."""
    from trio_agent._workers._control import Control

    claimed = trio.Event()
    resume = trio.Event()
    original = Control.claim

    async def slow_claim(self: Control, count: int, ttl: float, *, exclude: list[str] | None = None) -> Any:
        leases = await original(self, count, ttl, exclude=exclude)
        if leases:
            claimed.set()
            await resume.wait()  # the stop comes now, with the claim committed
        return leases

    rid = await trio.to_thread.run_sync(
        functools.partial(submit, "in-flight", "hi", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    Control.claim = slow_claim  # type: ignore[method-assign]
    try:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(
                    serve_sessions, answer(), postgres_dsn, schema=fresh_pg_schema, stop=stop, lease_ttl=30.0
                )
            )
            with trio.fail_after(10):
                await claimed.wait()
            stop.set()
            await trio.testing.wait_all_tasks_blocked()
            resume.set()
    finally:
        Control.claim = original  # type: ignore[method-assign]
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        worker(answer(), postgres_dsn, fresh_pg_schema),
    ):
        with trio.fail_after(10):  # far below the 30 s lease the stopped worker's claim took
            assert (await wait_for_request(store, "in-flight", rid)).state == "completed"


async def test_deltas_that_arrived_before_a_close_are_still_delivered(postgres_dsn: str) -> None:
    from trio_agent._workers._sql import live_channel

    schema = "t_live_buffered"
    deltas = await subscribe_live("s", dsn=postgres_dsn, schema=schema)

    def notify_together() -> None:  # one transaction: delivered together at its commit
        with psycopg.connect(postgres_dsn) as conn, conn.transaction():
            for n in (1, 2):
                payload = json.dumps({"s": "s", "r": "r", "a": "root", "n": n, "t": f"part {n}"})
                conn.execute("SELECT pg_notify(%s, %s)", (live_channel(schema), payload))

    await trio.to_thread.run_sync(notify_together)
    with trio.fail_after(10):
        first = await deltas.__anext__()
    await deltas.aclose()
    assert first.n == 1
    assert [delta.n async for delta in deltas] == [2]  # buffered, then the iteration ends


# ---------------------------------------------------------------- carried review findings


class _CancelAt(trio.abc.Instrument):
    """Cancels *scope* at the *n*-th point *task* reaches: when ``when="blocked"``, right after one
    of its steps ended at a checkpoint (it waits there); when ``"resumed"``, right as it is
    rescheduled (a result arrived and the task has not taken it yet). Every await is such a point."""

    def __init__(self, task: trio.lowlevel.Task, scope: trio.CancelScope, n: int, when: str) -> None:
        self.task, self.scope, self.n, self.when = task, scope, n, when
        self.points = 0

    def _count(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.points += 1
            if self.points == self.n:
                self.scope.cancel()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.when == "blocked":
            self._count(task)

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if self.when == "resumed":
            self._count(task)


async def test_parking_is_never_half_done_wherever_a_cancellation_lands(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A parked session's lease and its registry row (``failed``) are taken together or not at all:
    a cancellation at any await of `_park`, while it waits or just as a result arrives, never leaves
    the lease held with the registry unaware (the session would sit leased, shown running on a
    worker that is not serving it)."""
    from trio_agent._workers._control import Control
    from trio_agent._workers._serve import _Worker
    from trio_agent._workers._sql import Statements

    schema = fresh_pg_schema

    def reset() -> None:  # as after a failed open: the claim registered it running, the lease given back
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO \"{schema}\".leases VALUES ('s', 'me', 5, '-Infinity') ON CONFLICT (session_id)"
                " DO UPDATE SET owner = 'me', expires_at = '-Infinity'"
            )
            conn.execute(
                f"INSERT INTO \"{schema}\".registry VALUES ('s', 'running', 'me', 0) ON CONFLICT (session_id)"
                " DO UPDATE SET state = 'running', worker_id = 'me'"
            )

    def state() -> tuple[bool, bool]:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT l.owner = 'me' AND l.expires_at >= extract(epoch FROM clock_timestamp()), r.state"
                f' FROM "{schema}".leases AS l JOIN "{schema}".registry AS r USING (session_id)'
                " WHERE session_id = 's'"
            ).fetchone()
        assert row is not None
        return bool(row[0]), row[1] == "failed"

    control = Control(postgres_dsn, Statements(schema), worker_id="me", pool=1)
    try:
        await control.open()
        async with open_postgres_store(postgres_dsn, schema=schema) as store:
            parker = _Worker(
                answer(), store, control, concurrency=1, lease_ttl=30, poll_interval=1, cleanup_grace=5, live=False
            )
            for when in ("blocked", "resumed"):
                n = 1
                while True:
                    await trio.to_thread.run_sync(reset)
                    with trio.CancelScope() as scope:
                        hook = _CancelAt(trio.lowlevel.current_task(), scope, n, when)
                        trio.lowlevel.add_instrument(hook)
                        try:
                            await parker._park("s")
                        finally:
                            trio.lowlevel.remove_instrument(hook)
                    async with control._slots:  # a statement the cancelled call left running has ended
                        pass
                    leased, said_failed = await trio.to_thread.run_sync(state)
                    assert leased == said_failed, f"cancelled at {when} point {n}: leased={leased}"
                    if hook.points < n:  # _park ran to its end before the n-th point: every point tried
                        break
                    n += 1
                assert n > 1  # it has await points, and each was tried
    finally:
        control.close()


async def test_a_claim_whose_caller_is_cancelled_is_given_back_wherever_it_lands(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A cancellation at any await of a claim (its statement running, or done with its answer not
    yet taken) leaves no session leased to nobody: what the claim took is released, so the next
    worker takes it at once, not after a lease TTL."""
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    schema = fresh_pg_schema
    await trio.to_thread.run_sync(functools.partial(submit, "s", "hi", dsn=postgres_dsn, schema=schema))

    def leased() -> tuple[bool, int]:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT expires_at >= extract(epoch FROM clock_timestamp()), token"
                f" FROM \"{schema}\".leases WHERE session_id = 's'"
            ).fetchone()
            conn.execute(f"UPDATE \"{schema}\".leases SET expires_at = '-Infinity' WHERE session_id = 's'")
        assert row is not None
        return bool(row[0]), row[1]

    control = Control(postgres_dsn, Statements(schema), worker_id="me", pool=1, cleanup_grace=10)
    try:
        await control.open()
        for when in ("blocked", "resumed"):
            n = 1
            while True:
                with trio.CancelScope() as scope:
                    hook = _CancelAt(trio.lowlevel.current_task(), scope, n, when)
                    trio.lowlevel.add_instrument(hook)
                    try:
                        claimed = await control.claim(1, ttl=30)
                    finally:
                        trio.lowlevel.remove_instrument(hook)
                async with control._slots:  # a statement the cancelled call left running has ended
                    pass
                held, token = await trio.to_thread.run_sync(leased)  # (and released for the next round)
                if scope.cancelled_caught:
                    assert not held, f"cancelled at {when} point {n}: the claim (token {token}) stays leased"
                else:
                    assert held and [lease.token for lease in claimed] == [token]
                if hook.points < n:  # the claim ran to its end before the n-th point: every point tried
                    break
                n += 1
            assert n > 1
    finally:
        control.close()


async def test_a_claim_that_ended_as_its_caller_was_cancelled_is_given_back(
    postgres_dsn: str, fresh_pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: the claim's thread finished first, and its answer was dropped by the
    cancellation (nobody will host what it took): the caller gives it back before it goes on."""
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    schema = fresh_pg_schema
    await trio.to_thread.run_sync(functools.partial(submit, "s", "hi", dsn=postgres_dsn, schema=schema))
    original = trio.to_thread.run_sync
    calls = 0

    async def answer_dropped(fn: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        result = await original(fn, *args, **kwargs)
        if calls == 1:  # the claim ran to its end; now the cancellation, before its answer is taken
            scope.cancel()
            await trio.lowlevel.checkpoint()
        return result

    control = Control(postgres_dsn, Statements(schema), worker_id="me", cleanup_grace=10)
    try:
        await control.open()
        monkeypatch.setattr(trio.to_thread, "run_sync", answer_dropped)
        with trio.CancelScope() as scope:
            await control.claim(1, ttl=30)
        monkeypatch.undo()
        assert scope.cancelled_caught and calls == 2  # the claim, then its give-back
        lease = await trio.to_thread.run_sync(functools.partial(_lease_row, postgres_dsn, schema, "s"))
        assert lease[:2] == ("me", 1) and lease[2] == float("-inf")  # claimed (token 1), then released
    finally:
        control.close()


def _lease_row(dsn: str, schema: str, session_id: str) -> tuple[str, int, float]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f'SELECT owner, token, expires_at FROM "{schema}".leases WHERE session_id = %s', (session_id,)
        ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def _age_rows(dsn: str, schema: str, seconds: float, *request_ids: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f'UPDATE "{schema}".inbox SET updated_at = updated_at - %s WHERE request_id = ANY(%s)',
            (seconds, list(request_ids)),
        )


def _inbox(dsn: str, schema: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        return [
            (r, state)
            for r, state in conn.execute(f'SELECT request_id, state FROM "{schema}".inbox ORDER BY request_id')
        ]


async def test_pruning_deletes_only_done_rows_past_the_retention(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """The retention rule: a row goes once it was marked done longer ago than the retention;
    rows waiting or being served stay however old they are, and a backlog goes a batch at a time."""
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    schema = fresh_pg_schema
    with Submitter(postgres_dsn, schema=schema) as queue:
        for request_id in ("pending", "taken", "done-new", "done-1", "done-2", "done-3"):
            queue.submit("s", "hi", request_id=request_id)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE \"{schema}\".inbox SET state = 'taken' WHERE request_id = 'taken'")
        conn.execute(f"UPDATE \"{schema}\".inbox SET state = 'done' WHERE request_id LIKE 'done-%%'")
    _age_rows(postgres_dsn, schema, 7200, "pending", "taken", "done-1", "done-2", "done-3")
    control = Control(postgres_dsn, Statements(schema), worker_id="me")
    try:
        await control.open()
        assert await control.prune(3600 * 3, 10) == 0  # none is that old
        assert await control.prune(3600, 2) == 2  # a batch
        assert await control.prune(3600, 2) == 1
        assert await control.prune(3600, 2) == 0
    finally:
        control.close()
    assert _inbox(postgres_dsn, schema) == [("done-new", "done"), ("pending", "pending"), ("taken", "taken")]


async def test_a_worker_prunes_done_rows_and_their_outcomes_stay_in_the_journal(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """Done rows do not pile up: the worker deletes them past its inbox_retention. What a client
    reads stays: the outcome is in the journal, and the request id is still idempotent (a retry
    after its row went is answered from the journal, not run again)."""
    schema = fresh_pg_schema
    rid = await trio.to_thread.run_sync(functools.partial(submit, "s", "first", dsn=postgres_dsn, schema=schema))
    async with (
        open_postgres_store(postgres_dsn, schema=schema) as store,
        worker(answer("once"), postgres_dsn, schema, lease_ttl=0.6, inbox_retention=0) as report,
    ):
        with trio.fail_after(10):
            assert (await wait_for_request(store, "s", rid)).text == "once"
            while await trio.to_thread.run_sync(_inbox, postgres_dsn, schema):
                await trio.sleep(0.05)  # the next prune (every lease_ttl / 3)
        assert report.pruned == 1
        status = functools.partial(request_status, "s", rid, dsn=postgres_dsn, schema=schema)
        assert await trio.to_thread.run_sync(status) is None
        assert (await wait_for_request(store, "s", rid)).text == "once"  # from the journal
        # A retry of the same request id after its row went: marked done from the journal.
        await trio.to_thread.run_sync(
            functools.partial(submit, "s", "first", request_id=rid, dsn=postgres_dsn, schema=schema)
        )
        with trio.fail_after(10):
            while report.pruned < 2:
                await trio.sleep(0.05)
        assert len(ends_of(await root_events(store, "s"), rid)) == 1  # not run again
    assert report.served == 2  # the retry was answered with its recorded outcome


async def test_inbox_retention_is_checked_by_name(postgres_dsn: str) -> None:
    for bad in (-1, float("nan"), "7d", True):
        with pytest.raises(ConfigError, match="inbox_retention"):
            await serve_sessions(answer(), postgres_dsn, inbox_retention=bad)  # type: ignore[arg-type]


_WORKER_CLI = [sys.executable, "-m", "trio_agent", "worker"]


async def test_a_second_worker_under_a_live_workers_id_is_refused(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """Two runs never share a worker id: the second is refused, by name, before it claims
    anything (from Python and from the command line), and the first serves on untouched."""
    schema = fresh_pg_schema

    def holder() -> tuple[str, int, float]:
        with psycopg.connect(postgres_dsn) as conn:
            row = conn.execute(f'SELECT host, pid, started_at FROM "{schema}".workers').fetchone()
        assert row is not None
        return row[0], row[1], row[2]

    async with (
        open_postgres_store(postgres_dsn, schema=schema) as store,
        worker(answer("first"), postgres_dsn, schema, worker_id="dup", lease_ttl=0.6),
    ):
        before = await trio.to_thread.run_sync(holder)
        with trio.fail_after(10), pytest.raises(WorkerIdInUseError) as refused:
            await serve_sessions(answer("second"), postgres_dsn, schema=schema, worker_id="dup", lease_ttl=0.6)
        assert isinstance(refused.value, ConfigError)
        assert (refused.value.worker_id, refused.value.host, refused.value.pid) == ("dup", *before[:2])
        assert "worker id 'dup' is in use" in str(refused.value)
        cli = await trio.to_thread.run_sync(
            functools.partial(
                subprocess.run,
                [*_WORKER_CLI, "--dsn", postgres_dsn, "--schema", schema, "--worker-id", "dup", "--lease-ttl", "0.6"],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=ROOT,
            )
        )
        assert cli.returncode == 1, cli.stderr
        assert cli.stderr.splitlines()[-1].startswith("error: worker id 'dup' is in use by another live worker")
        assert "serving" not in cli.stdout
        assert await trio.to_thread.run_sync(holder) == before  # the first run's row, untouched
        rid = await trio.to_thread.run_sync(functools.partial(submit, "s", "hi", dsn=postgres_dsn, schema=schema))
        with trio.fail_after(10):
            assert (await wait_for_request(store, "s", rid)).text == "first"


async def test_a_run_whose_id_was_taken_over_stops_and_hands_its_sessions_off(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A run frozen past three heartbeats may find, when it wakes, that a newer run took its id
    over: it does not go on beside it under one name. Its next heartbeat tells it; it hands its
    sessions off at once (another worker goes on from their last durable point), leaves the newer
    run's row alone, and raises `WorkerIdInUseError`."""
    schema = fresh_pg_schema
    gated = gated_agent("after the hand-off")
    rid = await trio.to_thread.run_sync(functools.partial(submit, "held", "go", dsn=postgres_dsn, schema=schema))

    def take_over() -> None:  # what a newer run's start does to a row not seen for three heartbeats
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE \"{schema}\".workers SET run_id = 'newer', host = 'elsewhere', pid = 2")

    def rows() -> list[tuple[str, str]]:
        with psycopg.connect(postgres_dsn) as conn:
            return [(w, r) for w, r in conn.execute(f'SELECT worker_id, run_id FROM "{schema}".workers')]

    caught: list[WorkerIdInUseError] = []

    async def run(task_status: trio.TaskStatus[Any]) -> None:
        try:
            await serve_sessions(
                gated.spec, postgres_dsn, schema=schema, worker_id="dup", lease_ttl=0.6, task_status=task_status
            )
        except WorkerIdInUseError as exc:
            caught.append(exc)

    async with trio.open_nursery() as nursery:
        report = await nursery.start(run)
        with trio.fail_after(10):
            await gated.entered.wait()
            await trio.to_thread.run_sync(take_over)
    [stopped] = caught  # it ended by itself, within a heartbeat
    assert stopped.host == "elsewhere" and stopped.pid == 2 and "'dup'" in str(stopped)
    assert report.handed_off == 1 and report.served == 0
    assert await trio.to_thread.run_sync(rows) == [("dup", "newer")]  # not unregistered: not its row
    gated.gate.set()
    async with (
        open_postgres_store(postgres_dsn, schema=schema) as store,
        worker(gated.spec, postgres_dsn, schema, worker_id="next"),
    ):
        with trio.fail_after(10):  # handed off: taken over at once, not after the lease
            assert (await wait_for_request(store, "held", rid)).text == "after the hand-off"


async def test_a_stopping_worker_s_id_is_waited_for_not_refused(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """A rolling restart under one id: the new run waits while the old one says it is stopping
    (its heartbeats still come), and registers once the old one unregistered."""
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    old = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="w")
    new = Control(postgres_dsn, Statements(fresh_pg_schema), worker_id="w")
    try:
        await old.open()
        await old.start(concurrency=1, interval=1.0)
        await old.seen(concurrency=1, hosted=1, served=0, stopping=True, interval=1.0)
        started = trio.Event()

        async def start_new() -> None:
            await new.start(concurrency=1, interval=0.1)
            started.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(start_new)
            with trio.fail_after(10):
                for _ in range(4):  # the old run drains: stopping, its heartbeats still coming
                    await trio.sleep(0.4)
                    await old.seen(concurrency=1, hosted=1, served=0, stopping=True, interval=1.0)
                assert not started.is_set()  # its row is seen again, and says stopping: waited for
                await old.gone()
                await started.wait()
        [me] = await trio.to_thread.run_sync(functools.partial(list_workers, dsn=postgres_dsn, schema=fresh_pg_schema))
        assert me.live and not me.stopping
    finally:
        old.close()
        new.close()


async def test_a_workers_table_of_an_earlier_version_gets_its_run_column(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """The tables are additive: a schema an earlier version made (no ``run_id``, no ``inbox_done``)
    is completed by the first worker of this one, and a row it left is a run like any other."""
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    schema = fresh_pg_schema
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(
            f'CREATE TABLE "{schema}".workers(worker_id text PRIMARY KEY, host text NOT NULL, pid integer NOT NULL,'
            " concurrency integer NOT NULL, hosted integer NOT NULL, served bigint NOT NULL, stopping boolean NOT NULL,"
            " interval double precision NOT NULL, started_at double precision NOT NULL,"
            " seen_at double precision NOT NULL)"
        )
        conn.execute(f"INSERT INTO \"{schema}\".workers VALUES ('old', 'h', 1, 1, 0, 0, false, 0.1, 0, 0)")
    control = Control(postgres_dsn, Statements(schema), worker_id="old")
    try:
        await control.open()
        with trio.fail_after(10):
            await control.start(concurrency=3, interval=1.0)  # the old row is stale: taken over
        [me] = await trio.to_thread.run_sync(functools.partial(list_workers, dsn=postgres_dsn, schema=schema))
        assert (me.worker_id, me.concurrency, me.live) == ("old", 3, True)
        assert await control.prune(0, 10) == 0  # the inbox (and its index) exist
    finally:
        control.close()


async def test_a_stop_while_waiting_for_a_held_worker_id_ends_the_run_unregistered(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """Waiting for an id a crashed run's row still holds (up to three of its heartbeats) does not
    hold a stop: the run ends at once, having claimed and registered nothing."""
    from trio_agent._workers._control import Control
    from trio_agent._workers._sql import Statements

    schema = fresh_pg_schema
    await trio.to_thread.run_sync(functools.partial(submit, "s", "hi", dsn=postgres_dsn, schema=schema))
    crashed = Control(postgres_dsn, Statements(schema), worker_id="held")
    try:
        await crashed.open()
        await crashed.start(concurrency=1, interval=100.0)  # stale only in five minutes
    finally:
        crashed.close()
    stop = trio.Event()
    stop.set()
    with trio.fail_after(10):
        report = await serve_sessions(answer(), postgres_dsn, schema=schema, worker_id="held", stop=stop)
    assert report.claimed == 0
    [row] = await trio.to_thread.run_sync(functools.partial(list_workers, dsn=postgres_dsn, schema=schema))
    assert (row.worker_id, row.concurrency) == ("held", 1)  # the crashed run's row, left as it was
    [status] = await trio.to_thread.run_sync(functools.partial(list_sessions, dsn=postgres_dsn, schema=schema))
    assert status.state == "runnable"


@pytest.mark.parametrize("worker_id", [123, b"bytes", "", "w\x00id", "x" * 1201, "é" * 601])
async def test_a_worker_id_no_lease_or_registry_row_can_hold_is_refused_by_name(worker_id: Any) -> None:
    """An int or bytes was stored as its text, "" became a random id, and an id over 1,200 bytes
    registered and claimed, then failed every session at its close (the lease owner is indexed)."""
    unreachable = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"  # checked before connecting
    with pytest.raises(ConfigError, match=r"^worker_id must"):
        await serve_sessions(answer(), unreachable, worker_id=worker_id)


def test_the_command_line_refuses_an_empty_worker_id(postgres_dsn: str) -> None:
    refused = subprocess.run(
        [*_WORKER_CLI, "--dsn", postgres_dsn, "--worker-id", ""], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and "error: worker_id must be a non-empty string" in refused.stderr


async def test_a_worker_at_the_largest_lease_ttl_serves(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """lease_ttl may be MAX_TIMEOUT (2**31 ms); the journal connections' idle-in-transaction
    timeout asked the server for 2**31 ms, past its int, and every connection was refused."""
    from trio_agent._config import MAX_TIMEOUT

    rid = await trio.to_thread.run_sync(
        functools.partial(submit, "long", "hi", dsn=postgres_dsn, schema=fresh_pg_schema)
    )
    async with worker(answer(), postgres_dsn, fresh_pg_schema, lease_ttl=MAX_TIMEOUT) as report:
        with trio.fail_after(20):
            status = await until_done(postgres_dsn, fresh_pg_schema, "long", rid)
    assert status.outcome == "completed" and report.served == 1


async def test_submissions_queued_under_the_older_request_id_rule_are_served(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """Request ids with a C1 control (U+0085), taken before such ids were refused: one a worker
    that died had accepted into the journal, one still queued. serve_request judged the first by
    the rule for new ids before asking the journal, and that ConfigError of a request that "ran"
    parked its session every lease TTL, forever; the second was marked refused. Both are served,
    as a session queued under the older rule is (`_usable_session_id`)."""
    held, queued = "held\x85req", "queued\x85req"
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        with pytest.raises(LeaseLostError):
            async with open_journal(store, session_id="legacy", lease_ttl=1.0, heartbeat_interval=0.3) as journal:
                await journal.append(
                    RequestAccepted(request_id=held, command_id=held, input={"prompt": "go"}), command_id=held
                )
                journal._lose(LeaseLostError("the worker died before the upgrade"))
                await trio.sleep_forever()
        plain = await trio.to_thread.run_sync(
            functools.partial(submit, "legacy", "after", dsn=postgres_dsn, schema=fresh_pg_schema)
        )
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # submitted by the older version
            for request_id in (held, queued):
                conn.execute(
                    f'INSERT INTO "{fresh_pg_schema}".inbox(session_id, request_id, prompt, priority, submitted_at,'
                    " state, updated_at) VALUES ('legacy', %s, 'go', 1, 0, 'pending', 0)",
                    (request_id,),
                )
        async with worker(answer(), postgres_dsn, fresh_pg_schema, lease_ttl=2.0, poll_interval=0.05) as report:
            with trio.fail_after(20):
                for request_id in (held, queued, plain):
                    assert await until_row_done(postgres_dsn, fresh_pg_schema, "legacy", request_id) == (
                        "done",
                        "completed",
                    )
                assert (await wait_for_request(store, "legacy", held)).state == "completed"
        events = await root_events(store, "legacy")
    assert all(len(ends_of(events, request_id)) == 1 for request_id in (held, queued, plain))
    assert report.failed_sessions == 0 and report.refused == 0 and report.served == 3


_UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"


@pytest.mark.parametrize(
    ("prompt", "fits"),
    [
        ("x" * 1_000_000, True),
        ("x" * 1_000_001, False),
        ("é" * 500_000, True),  # two bytes of UTF-8 each
        ("é" * 500_001, False),
        ("a" + "\n" * 499_999 + "a", True),  # JSON writes \n
        ("a" + "\n" * 500_000 + "a", False),
        ("\x01" * 166_666 + "hi", True),  # JSON writes \u0001: six bytes each
        ("\x01" * 166_667 + "hi", False),
    ],
    ids=lambda value: f"{len(value)}x{value[1]!r}" if isinstance(value, str) else str(value),
)
def test_submit_refuses_a_prompt_over_max_prompt_bytes_as_json(prompt: str, fits: bool) -> None:
    """A prompt's size was unbounded (up to PostgreSQL's 1 GB text); one of control characters
    grows six-fold as the journal's JSON, and a 9 MB one stalled a worker's other sessions and
    renewals. Its JSON text, as UTF-8, may be at most 1,000,000 bytes by default; checked before
    connecting (here, an unreachable server is reached only by a prompt that fits)."""
    from trio_agent.journal import JournalUnavailableError
    from trio_agent.workers import DEFAULT_MAX_PROMPT_BYTES, PromptTooLargeError

    assert DEFAULT_MAX_PROMPT_BYTES == 1_000_000
    if fits:
        with pytest.raises(JournalUnavailableError):
            submit("s", prompt, dsn=_UNREACHABLE)
    else:
        with pytest.raises(PromptTooLargeError, match=r"^prompt is .* more than max_prompt_bytes=1000000") as refused:
            submit("s", prompt, dsn=_UNREACHABLE)
        assert isinstance(refused.value, ConfigError) and refused.value.limit == DEFAULT_MAX_PROMPT_BYTES


def test_max_prompt_bytes_is_set_where_submissions_are_made(postgres_dsn: str, fresh_pg_schema: str) -> None:
    from trio_agent.workers import PromptTooLargeError

    with pytest.raises(PromptTooLargeError, match="max_prompt_bytes=10"):
        submit("s", "x" * 11, dsn=_UNREACHABLE, max_prompt_bytes=10)
    for bad in (0, True, 1.5, None):
        with pytest.raises(ConfigError, match="max_prompt_bytes"):
            submit("s", "hi", dsn=_UNREACHABLE, max_prompt_bytes=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="max_prompt_bytes"):
            Submitter(_UNREACHABLE, max_prompt_bytes=bad)  # type: ignore[arg-type]
    with Submitter(postgres_dsn, schema=fresh_pg_schema, max_prompt_bytes=10) as queue:
        with pytest.raises(PromptTooLargeError):
            queue.submit("s", '"quoted"!')  # 9 characters, 11 bytes as JSON
        assert queue.submit("s", "x" * 10, request_id="r") == "r"
    with Submitter(postgres_dsn, schema=fresh_pg_schema) as queue:
        assert queue.submit("s", "x" * 2_000, request_id="long") == "long"
        with pytest.raises(PromptTooLargeError):  # a conflict check never reads a prompt it refuses
            queue.submit("s", "x" * 1_000_001, request_id="long")


async def test_a_worker_refuses_a_queued_prompt_over_its_max_prompt_bytes(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A row over the worker's limit (submitted with a larger one, or written around submit())
    never reaches the journal: it is marked refused, as other rows no session accepts, and the
    session's other work is served. A request the journal already holds (accepted before the
    limit, by a worker that died) is served whatever its size: it was accepted."""
    held = "x" * 300
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        with pytest.raises(LeaseLostError):
            async with open_journal(store, session_id="big", lease_ttl=1.0, heartbeat_interval=0.3) as journal:
                await journal.append(
                    RequestAccepted(request_id="held", command_id="held", input={"prompt": held}), command_id="held"
                )
                journal._lose(LeaseLostError("the worker died"))
                await trio.sleep_forever()

        def queue() -> tuple[str, str]:
            with Submitter(postgres_dsn, schema=fresh_pg_schema, max_prompt_bytes=1000) as queue:
                queue.submit("big", held, request_id="held", priority=1)
                queue.submit("big", "\x01" * 20 + " hi", request_id="escaped", priority=1)  # 123 bytes as JSON
                return queue.submit("big", "y" * 200, request_id="large"), queue.submit("big", "small")

        large, small = await trio.to_thread.run_sync(queue)
        async with worker(answer(), postgres_dsn, fresh_pg_schema, lease_ttl=2.0, max_prompt_bytes=100) as report:
            with trio.fail_after(20):
                refused = await wait_for_request(store, "big", large)
                assert (await wait_for_request(store, "big", small)).state == "completed"
                assert (await wait_for_request(store, "big", "held")).state == "completed"
                assert (await wait_for_request(store, "big", "escaped")).state == "refused"
        events = await root_events(store, "big")
    assert refused.state == "refused"
    assert not [e for e in events if isinstance(e, RequestAccepted) and e.request_id in ("escaped", large)]
    assert report.refused == 2 and report.served == 2 and report.failed_sessions == 0


def test_the_command_line_takes_max_prompt_bytes_for_submit_and_worker(postgres_dsn: str) -> None:
    # --max-prompt-bytes reaches submit() (refused before connecting) and serve_sessions (a bad value
    # is argparse's error, status 2, before anything starts).
    cli = [sys.executable, "-m", "trio_agent"]
    refused = subprocess.run(
        [*cli, "submit", "s", "x" * 20, "--dsn", postgres_dsn, "--max-prompt-bytes", "10"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "max_prompt_bytes" in refused.stderr, refused.stderr
    bad = subprocess.run(
        [*_WORKER_CLI, "--dsn", postgres_dsn, "--max-prompt-bytes", "0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--max-prompt-bytes" in bad.stderr, bad.stderr
