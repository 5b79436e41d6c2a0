"""Conversations that continue: what a long history and many lives cost.

Two measurements, in one process:

  - long session: one in-memory session answers R requests in a row (the test model answers each with one
    tool call, then text: two model calls and one tool call per request); the CPU time per request over the
    first window and over the last window, and their ratio. The model request reads the history through a
    copy-free view, so the ratio should stay near 1 (before: 1.45 after 2,000 requests). Beside it, the
    floor: a plain Trio loop that appends the same messages to a list and hands the model a view of it.
  - close / reopen: one session on a SQLite file is opened, sent one message and closed C times; the wall
    time of each open (the reopen: the lease, the streams read, the projection and the conversation rebuilt
    from the journal) over the first and the last window. Reopening reads the whole stream, so its cost
    grows with the journal: the ratio says by how much (a projection snapshot would make it flat; see
    docs/sessions.md).

Prints a table and, as its last line, one JSON object. ``--short`` runs a quick version.
``--progress`` (the default when stderr is a terminal) writes a progress line to stderr every 10 % of each
measurement; see ``_progress.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import trio
from _progress import add_progress_option, note, start_progress

import trio_agent as ta
from trio_agent.testing import Reply, TestModel


@ta.define_tool(name="add", description="adds", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
async def add(input: dict[str, Any], ctx: Any) -> int:
    return int(input.get("a", 0)) + int(input.get("b", 0))


def respond(request: ta.ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ta.ToolResultMessage):
        return Reply(text="done")
    return Reply(tool_calls=[("add", {"a": 1, "b": 2})])


def _tick(what: str, index: int, total: int) -> None:
    """A progress line at every tenth of ``total`` (outside the timed part of each step)."""
    step = max(1, total // 10)
    if index % step == 0:
        note(f"{what}: {index}/{total}")


async def long_session(requests: int, window: int) -> dict[str, float]:
    model = TestModel(respond=respond)
    times: list[float] = []
    async with ta.open_session(provider=model, tools=[add]) as session:
        for index in range(requests):
            _tick("long session", index, requests)
            start = time.process_time()
            await session.send(f"request {index}")
            times.append(time.process_time() - start)
    first = statistics.median(times[:window]) * 1e6
    last = statistics.median(times[-window:]) * 1e6
    return {"first_us": first, "last_us": last, "ratio": last / first}


async def long_floor(requests: int, window: int) -> dict[str, float]:
    """The same conversation in a plain loop: messages appended to a list, the model given a view of it."""
    from trio_agent._models._history import MessageView

    model = TestModel(respond=respond)
    history: list[ta.Message] = []
    times: list[float] = []
    for index in range(requests):
        _tick("plain Trio loop", index, requests)
        start = time.process_time()
        history.append(ta.UserMessage(f"request {index}"))
        while True:
            reply = await model.chat(ta.ModelRequest(ta.Operation.CHAT, "test-model", MessageView(history)))
            history.append(reply.message)
            calls = [p for p in reply.message.parts if isinstance(p, ta.ToolCallPart)]
            if not calls:
                break
            for call in calls:
                history.append(ta.ToolResultMessage(call.id, str(await add.run(json.loads(call.arguments), None))))
        times.append(time.process_time() - start)
    first = statistics.median(times[:window]) * 1e6
    last = statistics.median(times[-window:]) * 1e6
    return {"first_us": first, "last_us": last, "ratio": last / first}


async def reopen_cycles(cycles: int, window: int, directory: str) -> dict[str, float]:
    path = os.path.join(directory, "cycles.db")
    model = TestModel(default=Reply(text="ok"))
    opens: list[float] = []
    for index in range(cycles):
        _tick("close / reopen", index, cycles)
        start = time.perf_counter()
        async with ta.open_session(provider=model, journal=path, session_id="cycles") as session:
            opens.append(time.perf_counter() - start)
            await session.send(f"message {index}")
    async with ta.open_session(provider=model, journal=path, session_id="cycles") as session:
        readable = len(session.messages())
    first = statistics.median(opens[:window]) * 1e3
    last = statistics.median(opens[-window:]) * 1e3
    return {"first_ms": first, "last_ms": last, "ratio": last / first, "messages": readable}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="quick run for smoke tests")
    add_progress_option(parser)
    args = parser.parse_args(argv)
    start_progress("conversation", args)
    requests, cycles = (200, 40) if args.short else (2000, 1000)
    window = max(10, requests // 20)
    cycle_window = max(5, cycles // 20)
    session = trio.run(long_session, requests, window)
    floor = trio.run(long_floor, requests, window)
    with tempfile.TemporaryDirectory() as directory:
        reopen = trio.run(reopen_cycles, cycles, cycle_window, directory)

    print(f"long session, {requests} requests (CPU us per request, median of the first and the last {window})")
    print(f"  {'':<22} {'first':>10} {'last':>10} {'last/first':>11}")
    for name, row in (("trio_agent session", session), ("plain Trio loop", floor)):
        print(f"  {name:<22} {row['first_us']:>10.1f} {row['last_us']:>10.1f} {row['ratio']:>11.2f}")
    print(f"close / reopen, {cycles} cycles on one SQLite session (wall ms per open, first and last {cycle_window})")
    print(f"  first {reopen['first_ms']:.2f} ms, last {reopen['last_ms']:.2f} ms, ratio {reopen['ratio']:.2f}")
    print(f"  the conversation after the last cycle: {int(reopen['messages'])} messages, all readable")
    figures = {
        "benchmark": "conversation",
        "requests": requests,
        "session_first_us": round(session["first_us"], 1),
        "session_last_us": round(session["last_us"], 1),
        "session_last_over_first": round(session["ratio"], 3),
        "direct_first_us": round(floor["first_us"], 1),
        "direct_last_us": round(floor["last_us"], 1),
        "direct_last_over_first": round(floor["ratio"], 3),
        "cycles": cycles,
        "reopen_first_ms": round(reopen["first_ms"], 3),
        "reopen_last_ms": round(reopen["last_ms"], 3),
        "reopen_last_over_first": round(reopen["ratio"], 3),
        "messages_after_cycles": int(reopen["messages"]),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
