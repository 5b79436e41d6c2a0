"""A session worker that pauses for an approval and is then killed -9.

Run: ``python tests/session_crash/pause_worker.py JOURNAL_DB LEDGER SESSION_ID``.

It opens a session on the SQLite journal (``lease_ttl=2``, ``permission_asks="interrupt"``,
an ``ask`` rule for ``deploy``) whose model asks for one ``deploy`` call; the request pauses
before the call runs. The worker prints ``PAUSED <interrupt ids as JSON>`` (flushed) and waits;
the test SIGKILLs it and resumes the session in its own process. `make_deploy` and `model` are
shared with the test.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import trio

from trio_agent import SideEffect, ToolKind, define_tool, open_session
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel

PROMPT = "deploy version 2"


def make_deploy(ledger: str) -> Any:
    @define_tool(
        name="deploy",
        description="deploys a version",
        input_schema={"type": "object", "properties": {"version": {"type": "integer"}}, "required": ["version"]},
        side_effect=SideEffect.NON_IDEMPOTENT,
        kind=ToolKind.EXECUTE,
    )
    async def deploy(input: dict[str, Any], ctx: Any) -> str:
        with open(ledger, "a", encoding="utf-8") as file:  # noqa: ASYNC230 - a tiny fsynced append
            file.write(json.dumps(input) + "\n")
            file.flush()
            os.fsync(file.fileno())
        return f"deployed {input['version']}"

    return deploy


def model() -> TestModel:
    def respond(request: Any) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):
            return Reply(text="done: " + request.messages[-1].content)
        return Reply(tool_calls=[("deploy", {"version": 2})])

    return TestModel(respond=respond)


async def main(journal: str, ledger: str, session_id: str) -> None:
    async with open_session(
        provider=model(),
        tools=[make_deploy(ledger)],
        journal=journal,
        session_id=session_id,
        lease_ttl=2.0,  # short, so the test takes the session over within seconds
        permissions={"ask": ["deploy"]},
        permission_asks="interrupt",
    ) as session:
        reply = await session.send(PROMPT)
        ids = [interrupt.id for interrupt in getattr(reply, "interrupts", ())]
        print("PAUSED " + json.dumps(ids), flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    journal_path, ledger_path, session = sys.argv[1:4]
    trio.run(main, journal_path, ledger_path, session)
