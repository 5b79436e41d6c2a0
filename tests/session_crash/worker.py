"""A session worker that is killed -9 in the middle of a request.

Run: ``python tests/session_crash/worker.py JOURNAL_DB LEDGER SESSION_ID``.

It opens a session on the SQLite journal (``lease_ttl=2``, ``permission_mode="bypass"``:
both tools are ``write`` tools, which the default mode would ask about) whose model asks, in
one turn, for a ``non_idempotent`` call (``charge``) and an ``idempotent`` call
(``upsert``). Both tools append an fsynced line ``tool,idempotency_key,input``
to the ledger (the side effect) and then block forever. Once both lines are in
the ledger the worker prints ``READY`` (flushed); the test then SIGKILLs it.

`make_tools` is shared with the test, which reopens the session in-process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import trio

from trio_agent import SideEffect, ToolKind, define_tool, open_session
from trio_agent.testing import Reply, TestModel

PROMPT = "charge the card and upsert the record"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


def _ledger_line(ledger: str, tool: str, key: str, input: dict[str, Any]) -> None:
    with open(ledger, "a", encoding="utf-8") as file:
        file.write(f"{tool},{key},{json.dumps(input, sort_keys=True)}\n")
        file.flush()
        os.fsync(file.fileno())


def read_ledger(ledger: str) -> list[tuple[str, str, str]]:
    if not os.path.exists(ledger):
        return []
    with open(ledger, encoding="utf-8") as file:
        return [tuple(line.rstrip("\n").split(",", 2)) for line in file if line.strip()]  # type: ignore[misc]


def make_tools(ledger: str, *, block: bool, both_started: trio.Event | None = None) -> list[Any]:
    started: set[str] = set()

    async def side_effect(tool: str, input: dict[str, Any], key: str) -> str:
        _ledger_line(ledger, tool, key, input)
        started.add(tool)
        if both_started is not None and started >= {"charge", "upsert"}:
            both_started.set()
        if block:
            await trio.sleep_forever()
        return f"{tool} done"

    @define_tool(
        name="charge",
        description="charge a card (not safe to repeat)",
        input_schema=SCHEMA,
        side_effect=SideEffect.NON_IDEMPOTENT,
        kind=ToolKind.WRITE,
    )
    async def charge(input: dict[str, Any], ctx: Any) -> str:
        return await side_effect("charge", input, ctx.idempotency_key)

    @define_tool(
        name="upsert",
        description="upsert a record (safe to repeat with the same key)",
        input_schema=SCHEMA,
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.WRITE,
    )
    async def upsert(input: dict[str, Any], ctx: Any) -> str:
        return await side_effect("upsert", input, ctx.idempotency_key)

    return [charge, upsert]


async def main(journal: str, ledger: str, session_id: str) -> None:
    model = TestModel({PROMPT: [Reply(text="doing both", tool_calls=[("charge", {"n": 1}), ("upsert", {"n": 2})])]})
    both = trio.Event()
    async with (
        open_session(
            provider=model,
            tools=make_tools(ledger, block=True, both_started=both),
            journal=journal,
            session_id=session_id,
            lease_ttl=2.0,  # short, so the test takes the session over within seconds
            permission_mode="bypass",
        ) as session,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(session.send, PROMPT)
        await both.wait()
        print("READY", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    journal_path, ledger_path, session = sys.argv[1:4]
    trio.run(main, journal_path, ledger_path, session)
