"""Answering a paused request remotely: `submit_answers` writes a row, a worker resumes the session.

On a throw-away PostgreSQL cluster (``postgres_dsn``), workers in this process: a request pauses
on an approval, answers submitted from anywhere resume it (the continuation's request id is the
row's, so `wait_for_request` finds its end); bad answers and stale ones fail or refuse that row
only, with a stored code and reason; the row survives a worker restart; rows are served in the
inbox's order; an inbox made by an earlier version is migrated.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
import trio
from workers_helpers import until_done, until_session_state, worker

from trio_agent import define_agent, define_tool
from trio_agent.journal import CommandConflictError, InterruptsResolved, RequestCompleted, open_postgres_store
from trio_agent.lifecycle import Approve, InterruptResumeError, Reject
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel
from trio_agent.workers import (
    RequestOutcome,
    Submitter,
    request_status,
    submit,
    submit_answers,
    wait_for_request,
)

ROOT = Path(__file__).resolve().parent.parent
OBJECT = {"type": "object"}


@attrs.define
class Asking:
    """An agent whose first model call deletes ``target`` (a write, asked of a person: the request
    pauses); once the call is answered it says what the tool answered."""

    spec: Any
    deleted: list[str] = attrs.Factory(list)  # the tool's effect: one entry per run


def asking_agent() -> Asking:
    asking = Asking(spec=None)

    @define_tool(name="delete", description="d", input_schema=OBJECT, side_effect="non_idempotent", kind="write")
    async def delete(input: dict[str, Any], ctx: Any) -> str:
        asking.deleted.append(str(input.get("target")))
        return f"deleted {input.get('target')}"

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        if isinstance(last, ToolResultMessage):
            return Reply(f"tool said: {last.content}")
        return Reply(tool_calls=[("delete", {"target": str(last.content)})])

    asking.spec = define_agent(provider=TestModel(respond=respond), tools=[delete], permission_asks="interrupt")
    return asking


def blocking(function: Any, *args: Any, **kwargs: Any) -> Any:
    """A blocking submitter call, from a Trio task."""
    return trio.to_thread.run_sync(functools.partial(function, *args, **kwargs))


async def paused(store: Any, dsn: str, schema: str, session_id: str, prompt: str = "report.txt") -> RequestOutcome:
    """Submit *prompt* and wait (a worker must be serving) until it ends paused; its outcome."""
    rid = await blocking(submit, session_id, prompt, dsn=dsn, schema=schema)
    outcome: RequestOutcome = await wait_for_request(store, session_id, rid)
    assert outcome.state == "paused", outcome
    await until_done(dsn, schema, session_id, rid)
    return outcome


async def root_events(store: Any, session_id: str) -> list[Any]:
    return [envelope.event for envelope in await store.read(f"{session_id}/root")]


# ---------------------------------------------------------------- answered remotely


async def test_a_remote_approval_resumes_the_paused_request_and_the_tool_runs(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    asking = asking_agent()
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema) as report:
            with trio.fail_after(20):
                asked = await paused(store, postgres_dsn, fresh_pg_schema, "s")
                [question] = asked.interrupts  # the wait says what to answer
                assert question.tool_name == "delete" and question.input == {"target": "report.txt"}
                assert asking.deleted == []
                rid = await blocking(
                    submit_answers, "s", [Approve(question.id)], dsn=postgres_dsn, schema=fresh_pg_schema
                )
                outcome = await wait_for_request(store, "s", rid)  # the continuation's end, by the row's id
                status = await until_done(postgres_dsn, fresh_pg_schema, "s", rid)
                await until_session_state(postgres_dsn, fresh_pg_schema, "s", "waiting")
        assert (outcome.state, outcome.text) == ("completed", "tool said: deleted report.txt")
        assert (status.outcome, status.code, status.reason) == ("completed", None, None)
        assert asking.deleted == ["report.txt"] and report.failed_sessions == 0
        events = await root_events(store, "s")
        [resolved] = [e for e in events if isinstance(e, InterruptsResolved)]
        assert (resolved.request_id, resolved.continuation_id) == (asked.request_id, rid)
        assert [e.request_id for e in events if isinstance(e, RequestCompleted)] == [rid]


async def test_a_remote_rejection_resumes_without_running_the_tool(postgres_dsn: str, fresh_pg_schema: str) -> None:
    asking = asking_agent()
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        worker(asking.spec, postgres_dsn, fresh_pg_schema),
    ):
        with trio.fail_after(20):
            [question] = (await paused(store, postgres_dsn, fresh_pg_schema, "s")).interrupts
            with Submitter(postgres_dsn, schema=fresh_pg_schema) as queue:  # the method, as the function
                rid = await trio.to_thread.run_sync(
                    lambda: queue.submit_answers("s", [Reject(question.id, "keep it")], request_id="no")
                )
            outcome = await wait_for_request(store, "s", rid)
    assert rid == "no" and outcome.state == "completed" and "keep it" in outcome.text
    assert asking.deleted == []


async def test_bad_answers_fail_their_row_only_and_the_pause_stays_answerable(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    asking = asking_agent()
    where = {"dsn": postgres_dsn, "schema": fresh_pg_schema}
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        worker(asking.spec, postgres_dsn, fresh_pg_schema) as report,
    ):
        with trio.fail_after(30):
            [question] = (await paused(store, postgres_dsn, fresh_pg_schema, "s")).interrupts
            unknown = await blocking(submit_answers, "s", [Approve("no-such-question")], **where)
            missing = await blocking(submit_answers, "s", [], **where)
            outcomes = [await wait_for_request(store, "s", rid) for rid in (unknown, missing)]
            statuses = [await until_done(postgres_dsn, fresh_pg_schema, "s", rid) for rid in (unknown, missing)]
            # Another session on the same worker is served meanwhile, and this one is still paused.
            other = await blocking(submit, "other", "x", **where)
            assert (await wait_for_request(store, "other", other)).state == "paused"
            await until_session_state(postgres_dsn, fresh_pg_schema, "s", "paused")
            good = await blocking(submit_answers, "s", [Approve(question.id)], **where)
            resumed = await wait_for_request(store, "s", good)
    assert [(o.state, o.code) for o in outcomes] == [("failed", "unknown_interrupt"), ("failed", "missing")]
    assert "no-such-question" in str(outcomes[0].error)
    assert [(s.outcome, s.code) for s in statuses] == [("failed", "unknown_interrupt"), ("failed", "missing")]
    assert "no-such-question" in str(statuses[0].reason) and question.id in str(statuses[1].reason)
    assert resumed.state == "completed" and asking.deleted == ["report.txt"]
    assert report.failed_sessions == 0 and report.lost_sessions == 0


async def test_a_second_answer_to_the_same_pause_is_refused_stale(postgres_dsn: str, fresh_pg_schema: str) -> None:
    asking = asking_agent()
    where = {"dsn": postgres_dsn, "schema": fresh_pg_schema}
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        worker(asking.spec, postgres_dsn, fresh_pg_schema) as report,
    ):
        with trio.fail_after(30):
            asked = await paused(store, postgres_dsn, fresh_pg_schema, "s")
            [question] = asked.interrupts
            first = await blocking(submit_answers, "s", [Approve(question.id)], **where)
            second = await blocking(submit_answers, "s", [Reject(question.id)], **where)
            assert (await wait_for_request(store, "s", first)).state == "completed"
            stale = await wait_for_request(store, "s", second)
            status = await until_done(postgres_dsn, fresh_pg_schema, "s", second)
            # A new pause: answers naming the one answered already are stale too, never applied to it.
            again = await paused(store, postgres_dsn, fresh_pg_schema, "s", "notes.txt")
            pinned = await blocking(
                submit_answers, "s", [Approve(question.id)], paused_request_id=asked.request_id, **where
            )
            pinned_outcome = await wait_for_request(store, "s", pinned)
            # Named right, they resume it.
            [new_question] = again.interrupts
            right = await blocking(
                submit_answers, "s", [Approve(new_question.id)], paused_request_id=again.request_id, **where
            )
            assert (await wait_for_request(store, "s", right)).state == "completed"
            events = await root_events(store, "s")
    assert (stale.state, stale.code, stale.seq) == ("refused", "stale", 0)
    assert "not paused" in str(stale.reason)
    assert (status.outcome, status.code) == ("refused", "stale") and "not paused" in str(status.reason)
    assert (pinned_outcome.state, pinned_outcome.code) == ("refused", "stale")
    assert asked.request_id in str(pinned_outcome.reason) and again.request_id in str(pinned_outcome.reason)
    assert asking.deleted == ["report.txt", "notes.txt"]
    assert report.refused == 2 and report.failed_sessions == 0
    assert second not in {getattr(e, "request_id", None) for e in events}  # nothing ran: nothing journaled
    assert len([e for e in events if isinstance(e, InterruptsResolved)]) == 2


async def test_answers_submitted_while_no_worker_runs_are_served_by_the_next_one(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    asking = asking_agent()
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                [question] = (await paused(store, postgres_dsn, fresh_pg_schema, "s")).interrupts
        rid = await blocking(submit_answers, "s", [Approve(question.id)], dsn=postgres_dsn, schema=fresh_pg_schema)
        status = await blocking(request_status, "s", rid, dsn=postgres_dsn, schema=fresh_pg_schema)
        assert status is not None and (status.state, status.outcome) == ("pending", None)
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema):  # a new worker process, as it were
            with trio.fail_after(20):
                outcome = await wait_for_request(store, "s", rid)
                await until_done(postgres_dsn, fresh_pg_schema, "s", rid)
    assert outcome.state == "completed" and asking.deleted == ["report.txt"]


async def test_a_continuation_that_ended_before_its_row_was_marked_is_not_run_again(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """The worker died between the continuation's end and marking its row: the next holder finds
    the continuation in the journal by the row's id and marks the row, the tool run once."""
    asking = asking_agent()
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                [question] = (await paused(store, postgres_dsn, fresh_pg_schema, "s")).interrupts
                rid = await blocking(
                    submit_answers, "s", [Approve(question.id)], dsn=postgres_dsn, schema=fresh_pg_schema
                )
                await until_done(postgres_dsn, fresh_pg_schema, "s", rid)
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(
                f"UPDATE \"{fresh_pg_schema}\".inbox SET state = 'taken', outcome = NULL WHERE request_id = %s", (rid,)
            )
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema) as report:
            with trio.fail_after(20):
                status = await until_done(postgres_dsn, fresh_pg_schema, "s", rid)
    assert status.outcome == "completed" and report.claimed == 1 and report.refused == 0
    assert asking.deleted == ["report.txt"]


async def test_a_continuation_handed_off_half_way_goes_on_on_the_next_worker(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """A worker stops while the continuation's (idempotent) tool runs: it hands the session off
    unrecorded, and the next worker finds the continuation started, by the row's id, and goes on
    from its last durable point to the end `wait_for_request` reports."""
    gate, entered = trio.Event(), trio.Event()
    runs: list[str] = []

    @define_tool(name="touch", description="t", input_schema=OBJECT, side_effect="idempotent", kind="write")
    async def touch(input: dict[str, Any], ctx: Any) -> str:
        runs.append(ctx.tool_call_id)
        entered.set()
        await gate.wait()
        return "touched"

    def respond(request: Any) -> Reply:
        # Recovery adds a note after the results (a user message): any result answers.
        results = [m for m in request.messages if isinstance(m, ToolResultMessage)]
        return Reply(f"tool said: {results[-1].content}") if results else Reply(tool_calls=[("touch", {})])

    spec = define_agent(provider=TestModel(respond=respond), tools=[touch], permission_asks="interrupt")
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(spec, postgres_dsn, fresh_pg_schema, shutdown_grace=0) as first:
            with trio.fail_after(20):
                [question] = (await paused(store, postgres_dsn, fresh_pg_schema, "s")).interrupts
                rid = await blocking(
                    submit_answers, "s", [Approve(question.id)], dsn=postgres_dsn, schema=fresh_pg_schema
                )
                await entered.wait()
        assert first.handed_off == 1
        status = await blocking(request_status, "s", rid, dsn=postgres_dsn, schema=fresh_pg_schema)
        assert status is not None and status.state == "taken"
        gate.set()
        async with worker(spec, postgres_dsn, fresh_pg_schema) as second:
            with trio.fail_after(20):
                outcome = await wait_for_request(store, "s", rid)
                status = await until_done(postgres_dsn, fresh_pg_schema, "s", rid)
        events = await root_events(store, "s")
    assert (outcome.state, outcome.text) == ("completed", "tool said: touched")
    assert status.outcome == "completed" and second.refused == 0 and second.failed_sessions == 0
    assert len(runs) == 2  # idempotent: run again by the next worker, from its last durable point
    assert len([e for e in events if isinstance(e, InterruptsResolved)]) == 1


async def test_a_continuation_only_accepted_when_its_worker_died_is_resumed_once(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    """The worker died right after the continuation's ``request_accepted``: the pause still stands,
    and the next worker resumes it with the row's answers, under the same id, accepted once."""
    from trio_agent import LeaseLostError, open_session
    from trio_agent.journal import RequestAccepted, open_journal

    asking = asking_agent()
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                asked = await paused(store, postgres_dsn, fresh_pg_schema, "s")
        [question] = asked.interrupts
        rid = await blocking(submit_answers, "s", [Approve(question.id)], dsn=postgres_dsn, schema=fresh_pg_schema)
        # A worker took the row, accepted the continuation and died (nothing more written).
        with pytest.raises(LeaseLostError):
            async with (
                open_journal(store, session_id="s") as journal,
                open_session(asking.spec, journal=journal, unfinished="keep"),
            ):
                lease = journal.lease
                accepted = RequestAccepted(request_id=rid, command_id=rid, input={"resume": asked.request_id})
                await journal.append(accepted, command_id=rid)
                journal._lose(LeaseLostError("the worker died"))
                await trio.sleep_forever()
        await store.release_lease(lease)  # (its expiry, sooner)
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE \"{fresh_pg_schema}\".inbox SET state = 'taken' WHERE request_id = %s", (rid,))
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                outcome = await wait_for_request(store, "s", rid)
        events = await root_events(store, "s")
    assert outcome.state == "completed" and asking.deleted == ["report.txt"]
    assert len([e for e in events if isinstance(e, RequestAccepted) and e.request_id == rid]) == 1
    [resolved] = [e for e in events if isinstance(e, InterruptsResolved)]
    assert resolved.continuation_id == rid


async def test_rows_are_served_in_inbox_order_answers_then_the_prompt_after_them(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    asking = asking_agent()
    where = {"dsn": postgres_dsn, "schema": fresh_pg_schema}
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                [question] = (await paused(store, postgres_dsn, fresh_pg_schema, "s")).interrupts
        # Both wait together: the worker takes them in one go.
        answered = await blocking(submit_answers, "s", [Approve(question.id)], **where)
        later = await blocking(submit, "s", "notes.txt", **where)
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema):
            with trio.fail_after(20):
                first = await wait_for_request(store, "s", answered)
                second = await wait_for_request(store, "s", later)
    assert first.state == "completed" and second.state == "paused"  # the prompt ran on a session resumed
    assert first.seq < second.seq and asking.deleted == ["report.txt"]


async def test_answers_the_row_cannot_decode_are_refused(postgres_dsn: str, fresh_pg_schema: str) -> None:
    """Rows written around submit_answers(): answers that are not answers, a request id no journal
    holds; each refused, nothing run, the session still paused and answerable."""
    asking = asking_agent()
    insert = (
        f'INSERT INTO "{fresh_pg_schema}".inbox(session_id, request_id, prompt, priority, answers, submitted_at,'
        " state, updated_at) VALUES ('s', %s, '', 0, %s, 0, 'pending', 0)"
    )
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        worker(asking.spec, postgres_dsn, fresh_pg_schema),
    ):
        with trio.fail_after(20):
            [question] = (await paused(store, postgres_dsn, fresh_pg_schema, "s")).interrupts
            with psycopg.connect(postgres_dsn, autocommit=True) as conn:
                conn.execute(insert, ("junk", '[{"type": "approve"}]'))
                good = json.dumps([{"type": "approve", "interrupt_id": question.id}])
                conn.execute(insert, ("bad\x01id", good))
                conn.execute("SELECT pg_notify(%s, 's')", (f"{fresh_pg_schema}_inbox",))
            outcome = await wait_for_request(store, "s", "junk")
            while True:  # an id request_status() refuses to look up: the row, read directly
                with psycopg.connect(postgres_dsn) as conn:
                    row = conn.execute(
                        f'SELECT state, outcome, reason FROM "{fresh_pg_schema}".inbox WHERE request_id = %s',
                        ("bad\x01id",),
                    ).fetchone()
                if row is not None and row[0] == "done":
                    break
                await trio.sleep(0.05)
            await until_session_state(postgres_dsn, fresh_pg_schema, "s", "paused")
            answered = await blocking(
                submit_answers, "s", [Approve(question.id)], dsn=postgres_dsn, schema=fresh_pg_schema
            )
            assert (await wait_for_request(store, "s", answered)).state == "completed"
    assert (outcome.state, outcome.code) == ("refused", "invalid_payload") and "interrupt_id" in str(outcome.reason)
    assert row[1] == "refused" and "request_id" in str(row[2])
    assert asking.deleted == ["report.txt"]


# ---------------------------------------------------------------- submitting answers


def test_submit_answers_is_idempotent_and_refuses_other_content(postgres_dsn: str, fresh_pg_schema: str) -> None:
    with Submitter(postgres_dsn, schema=fresh_pg_schema) as queue:
        assert queue.submit_answers("s", [Approve("q")], request_id="a") == "a"
        assert queue.submit_answers("s", (Approve("q"),), request_id="a") == "a"  # a retry: one row
        for other in (
            lambda: queue.submit_answers("s", [Approve("q", {"x": 1})], request_id="a"),
            lambda: queue.submit_answers("s", [Approve("q")], request_id="a", paused_request_id="r"),
            lambda: queue.submit("s", "a prompt", request_id="a"),
        ):
            with pytest.raises(CommandConflictError):
                other()
        queue.submit("s", "a prompt", request_id="p")
        with pytest.raises(CommandConflictError):
            queue.submit_answers("s", [Approve("q")], request_id="p")
        generated = queue.submit_answers("s", [Approve("q")])
        assert generated.startswith("req-")
        status = queue.status("s", "a")
        assert status is not None and (status.state, status.outcome, status.code, status.reason) == (
            "pending",
            None,
            None,
            None,
        )
    with psycopg.connect(postgres_dsn) as conn:
        rows = conn.execute(
            f'SELECT request_id, prompt, answers FROM "{fresh_pg_schema}".inbox ORDER BY seq'
        ).fetchall()
    assert [(r[0], r[1]) for r in rows] == [("a", ""), ("p", "a prompt"), (generated, "")]
    assert json.loads(rows[0][2]) == [{"type": "approve", "interrupt_id": "q", "edited_args": None}]
    assert rows[1][2] is None


@pytest.mark.parametrize(
    ("answers", "match"),
    [
        ("approve q", "must be a list"),
        ([{"type": "approve", "interrupt_id": "q"}], "answer #0 is dict"),
        ([Approve("q", {"when": {1, 2}})], "not JSON"),  # type: ignore[dict-item]
        ([Approve("q", {"n": float("nan")})], "not JSON"),
    ],
)
def test_answers_that_are_not_answers_are_refused_before_connecting(answers: Any, match: str) -> None:
    unreachable = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"
    with pytest.raises(InterruptResumeError, match=match) as caught:
        submit_answers("s", answers, dsn=unreachable)
    assert caught.value.code == "invalid_payload"


def test_too_many_bytes_of_answers_are_refused_before_connecting() -> None:
    from trio_agent.workers import PromptTooLargeError

    with pytest.raises(PromptTooLargeError, match="answers are"):
        submit_answers("s", [Reject("q", "x" * 200)], dsn="host=127.0.0.1 port=1", max_prompt_bytes=100)


# ---------------------------------------------------------------- an inbox an earlier version made


_EARLIER_INBOX = (
    "CREATE TABLE {s}.inbox(seq bigserial PRIMARY KEY, session_id text NOT NULL, request_id text NOT NULL,"
    " prompt text NOT NULL, priority integer NOT NULL, submitted_at double precision NOT NULL, state text NOT NULL,"
    " outcome text, updated_at double precision NOT NULL, UNIQUE(session_id, request_id))"
)


async def test_an_inbox_an_earlier_version_made_is_migrated_and_its_rows_still_served(
    postgres_dsn: str, fresh_pg_schema: str
) -> None:
    from trio_agent._workers._sql import SCHEMA

    # The earlier version's tables: its inbox without the answers and the reasons, one row refused
    # before the upgrade and one prompt waiting.
    schema = f'"{fresh_pg_schema}"'
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        for statement in SCHEMA:
            if statement.startswith("CREATE TABLE IF NOT EXISTS {s}.inbox("):
                conn.execute(_EARLIER_INBOX.format(s=schema))
            elif not statement.startswith("ALTER TABLE {s}.inbox"):
                conn.execute(statement.format(s=schema))
        conn.execute(
            f"INSERT INTO {schema}.inbox(session_id, request_id, prompt, priority, submitted_at, state, outcome,"
            " updated_at) VALUES ('old', 'refused-before', 'x', 0, 0, 'done', 'refused', 0),"
            " ('s', 'before', 'report.txt', 0, 0, 'pending', NULL, 0)"
        )
        conn.execute(f"INSERT INTO {schema}.leases VALUES ('s', '', 0, '-Infinity'), ('old', '', 0, '-Infinity')")
    asking = asking_agent()
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store:
        # A wait reads a refusal in an inbox nobody migrated yet.
        with trio.fail_after(10):
            old = await wait_for_request(store, "old", "refused-before")
        assert (old.state, old.code) == ("refused", None) and "refused" in str(old.reason)
        async with worker(asking.spec, postgres_dsn, fresh_pg_schema):  # it migrates the inbox
            with trio.fail_after(20):
                outcome = await wait_for_request(store, "s", "before")
                [question] = outcome.interrupts
                rid = await blocking(
                    submit_answers, "s", [Approve(question.id)], dsn=postgres_dsn, schema=fresh_pg_schema
                )
                assert (await wait_for_request(store, "s", rid)).state == "completed"
    before = await blocking(request_status, "s", "before", dsn=postgres_dsn, schema=fresh_pg_schema)
    assert before is not None and (before.outcome, before.code, before.reason) == ("paused", None, None)
    assert asking.deleted == ["report.txt"]


# ---------------------------------------------------------------- the command line


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "trio_agent", *args], capture_output=True, text=True, env=env, timeout=60, input=stdin
    )


async def test_trio_agent_answer_resumes_a_paused_session(
    postgres_dsn: str, fresh_pg_schema: str, tmp_path: Path
) -> None:
    asking = asking_agent()
    where = ("--dsn", postgres_dsn, "--schema", fresh_pg_schema)
    async with (
        open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as store,
        worker(asking.spec, postgres_dsn, fresh_pg_schema),
    ):
        with trio.fail_after(60):
            asked = await paused(store, postgres_dsn, fresh_pg_schema, "s")
            [question] = asked.interrupts
            done = await trio.to_thread.run_sync(
                lambda: run_cli(
                    "answer",
                    "s",
                    "--approve",
                    question.id,
                    '{"target": "other.txt"}',
                    "--request-id",
                    "yes",
                    "--paused-request",
                    asked.request_id,
                    "--wait",
                    "30",
                    *where,
                )
            )
            assert done.returncode == 0, done.stderr
            # Stale now: the file form, refused (exit 4: not completed), its code in the outcome.
            file = tmp_path / "answers.json"
            file.write_text(json.dumps([{"type": "reject", "interrupt_id": question.id}]))
            stale = await trio.to_thread.run_sync(
                lambda: run_cli("answer", "s", "--answers", str(file), "--wait", "30", *where)
            )
    assert done.stdout.splitlines()[0] == "yes"
    outcome = json.loads(done.stdout.splitlines()[1])
    assert (outcome["state"], outcome["text"]) == ("completed", "tool said: deleted other.txt")
    assert asking.deleted == ["other.txt"]  # the edited arguments ran
    assert stale.returncode == 4, stale.stderr
    assert json.loads(stale.stdout.splitlines()[1])["code"] == "stale"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("answer", "s"), "at least one answer"),
        (("answer", "s", "--reject", "q", "no", "extra"), "at most one more value"),
    ],
)
def test_trio_agent_answer_refuses_bad_usage(args: tuple[str, ...], message: str) -> None:
    done = run_cli(*args, "--dsn", "host=127.0.0.1 port=1")
    assert done.returncode == 2 and message in done.stderr


def test_trio_agent_answer_names_text_that_is_not_json(tmp_path: Path) -> None:
    done = run_cli("answer", "s", "--respond", "q", "{not json", "--dsn", "host=127.0.0.1 port=1")
    assert done.returncode == 1 and "--respond q: not JSON" in done.stderr
    missing = run_cli("answer", "s", "--answers", str(tmp_path / "none.json"), "--dsn", "host=127.0.0.1 port=1")
    assert missing.returncode == 1 and "cannot read the answers file" in missing.stderr
