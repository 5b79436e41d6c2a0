"""One life of a session with subagents, in a process of its own.

Run: ``python tests/session_crash/subagent_worker.py JOURNAL_DB SESSION_ID close|crash``.

It opens (or reopens) the session on the SQLite journal, runs a foreground subagent (the root's
``task`` call) and starts a background one, then prints the ids of the subagents this life made
(one JSON line, flushed). ``close``: waits for the background subagent and closes the session.
``crash``: the background subagent's tool never returns; the process exits with code 3 while
it runs, without closing anything (its lease stays held: the test releases it).

A new process starts every counter of the library afresh: this is how a reopened session meets
the ids an earlier process wrote to its journal.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import trio

from trio_agent import SubagentDefinition, define_tool, open_session
from trio_agent.testing import Reply, TestModel

HELPER = SubagentDefinition("helper", "a helper", "You are the helper.")
CRASH_EXIT = 3


async def main(journal: str, session_id: str, mode: str) -> None:
    hanging = trio.Event()

    @define_tool(name="hang", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
    async def hang(input: dict[str, Any], ctx: Any) -> str:
        """Never returns in a life that crashes (the next life's recovery runs it again, to its end)."""
        hanging.set()
        if mode == "crash":
            await trio.sleep_forever()
        return "hung"

    model = TestModel(
        {
            "go": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub"})]), Reply(text="root done")],
            "sub": [Reply(text="helper done")],
            "bg": [Reply(tool_calls=[("hang", {})])] if mode == "crash" else [Reply(text="bg done")],
        }
    )
    async with open_session(
        provider=model, tools=[hang], subagents=[HELPER], journal=journal, session_id=session_id
    ) as session:
        before = set(session.journal.agents)
        assert await session.send("go") == "root done"
        background = await session.start_subagent("helper", "bg")
        made = [agent_id for agent_id in session.journal.agents if agent_id not in before]
        if mode == "crash":
            await hanging.wait()
            await session.journal.flush()
            print(json.dumps(made), flush=True)
            os._exit(CRASH_EXIT)  # dies here: no close, no lease release
        assert await background.wait() == "bg done"
    print(json.dumps(made), flush=True)


if __name__ == "__main__":
    journal_path, session, life_mode = sys.argv[1:4]
    trio.run(main, journal_path, session, life_mode)
