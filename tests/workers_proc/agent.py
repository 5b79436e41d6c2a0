"""The agent the multi-process worker tests run (``--agent agent:spec``, with this directory on
PYTHONPATH): the model asks for one ``charge`` call, then answers.

``charge`` is ``non_idempotent`` and its effect is fenced downstream, as docs/durability.md
advises: it inserts its row into ``<schema>.effects`` only while the session's lease row still
holds the call's fencing token, in the same statement. A worker paused past its lease whose
charge runs after the takeover is refused there, so a charge lands at most once per call.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
import trio

from trio_agent import define_agent, define_tool
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel

DSN = os.environ.get("WORKERS_TEST_DSN", "")
SCHEMA = os.environ.get("WORKERS_TEST_SCHEMA", "trio_agent")
EFFECT_SECONDS = float(os.environ.get("WORKERS_TEST_EFFECT_SECONDS", "0.2"))


def create_effects(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".effects('
            " session_id text NOT NULL, call_key text NOT NULL, token bigint NOT NULL, pid integer NOT NULL)"
        )


def _charge(session_id: str, key: str, token: int) -> bool:
    with psycopg.connect(DSN, autocommit=True) as conn:
        done = conn.execute(
            f'INSERT INTO "{SCHEMA}".effects(session_id, call_key, token, pid) SELECT %s, %s, %s, %s'
            f' WHERE EXISTS (SELECT 1 FROM "{SCHEMA}".leases WHERE session_id = %s AND token = %s)',
            (session_id, key, token, os.getpid(), session_id, token),
        )
        return done.rowcount == 1


@define_tool(
    name="charge",
    description="Charge the customer once.",
    input_schema={"type": "object"},
    side_effect="non_idempotent",
    kind="readonly",
)
async def charge(input: dict[str, Any], ctx: Any) -> str:
    await ctx.ensure_owner()
    token = ctx.fencing_token
    if not await trio.to_thread.run_sync(_charge, ctx.session_id, ctx.idempotency_key, token):
        raise RuntimeError("refused downstream: a stale fencing token")
    await trio.sleep(EFFECT_SECONDS)  # the kills and pauses land while calls run
    return "charged"


def _respond(request: Any) -> Reply:
    if isinstance(request.messages[-1], ToolResultMessage):
        return Reply("charged once", latency=0.01)
    return Reply(tool_calls=[("charge", {})], latency=0.01)


def spec() -> Any:
    return define_agent(provider=TestModel(respond=_respond), tools=[charge])
