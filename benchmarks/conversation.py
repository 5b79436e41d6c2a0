"""Conversations that continue: what a long history and many lives cost.

Two measurements, in one process:

  - long session: one in-memory session answers R requests in a row (the test model answers each with one
    tool call, then text: two model calls and one tool call per request); the CPU time per request over the
    first window and over the last window, and their ratio. The model request reads the history through a
    copy-free view, so the ratio should stay near 1 (before: 1.45 after 2,000 requests). Beside it, the
    floor: a plain Trio loop that appends the same messages to a list and hands the model a view of it.
  - close / reopen: one session on a SQLite file is opened, sent one message (answered with one tool call,
    then text) and closed C times; the wall
    time of each open (the lease, the snapshot and the events after it, the projection; the history and
    the command ids stay undecoded until needed) over the first and the last window, in a store held open
    (a server) and by path (a restarted process: the store's open, with SQLite's quick_check of the whole
    file, comes on top); and the first send after each reopen, which decodes the history it sends.

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
from _workload import respond

import trio_agent as ta
from trio_agent.journal import open_sqlite_store
from trio_agent.testing import TestModel


@ta.define_tool(name="add", description="adds", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
async def add(input: dict[str, Any], ctx: Any) -> int:
    return int(input.get("a", 0)) + int(input.get("b", 0))


# The model (`_workload.respond`, the floor's too) asks for add(a=1, b=2) and answers "done" only when it
# returned 3: every request, the floor's included, is checked to end with "done" (outside the timed part),
# so a broken tool path fails the run instead of measuring cheaper requests.


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
            answer = await session.send(f"request {index}")
            times.append(time.process_time() - start)
            assert answer == "done", answer
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
        assert reply.message.text == "done", history[-3:]
    first = statistics.median(times[:window]) * 1e6
    last = statistics.median(times[-window:]) * 1e6
    return {"first_us": first, "last_us": last, "ratio": last / first}


async def reopen_cycles(cycles: int, window: int, directory: str) -> dict[str, float]:
    """``cycles`` lives of one session (open, one request, close) on one SQLite file; the wall time
    of each open. The first and the last ``window`` lives open by path, as a restarted process does
    (the store is opened too: its integrity check reads the whole file); the lives between open in a
    store the benchmark holds open, as a server does, and their first and last windows are compared."""
    path = os.path.join(directory, "cycles.db")
    model = TestModel(respond=respond)  # a tool call and an answer per life: calls, results, commands all grow
    restarts: list[float] = []
    held: list[float] = []
    first_send: list[float] = []

    async def life(index: int, journal: Any, opens: list[float]) -> None:
        _tick("close / reopen", index, cycles)
        start = time.perf_counter()
        async with ta.open_session(provider=model, tools=[add], journal=journal, session_id="cycles") as session:
            opens.append(time.perf_counter() - start)
            sent = time.perf_counter()
            answer = await session.send(f"message {index}")
            first_send.append(time.perf_counter() - sent)
            assert answer == "done", answer

    for index in range(window):
        await life(index, path, restarts)
    async with open_sqlite_store(path) as store:
        for index in range(window, cycles - window):
            await life(index, store, held)
    for index in range(cycles - window, cycles):
        await life(index, path, restarts)
    async with ta.open_session(provider=model, tools=[add], journal=path, session_id="cycles") as session:
        readable = len(session.messages())

    def ratio(opens: list[float]) -> tuple[float, float, float]:
        first, last = statistics.median(opens[:window]) * 1e3, statistics.median(opens[-window:]) * 1e3
        return first, last, last / first

    held_first, held_last, held_ratio = ratio(held)
    restart_first, restart_last, restart_ratio = ratio(restarts)
    send_first, send_last, send_ratio = ratio(first_send)
    return {
        "first_ms": held_first,
        "last_ms": held_last,
        "ratio": held_ratio,
        "restart_first_ms": restart_first,
        "restart_last_ms": restart_last,
        "restart_ratio": restart_ratio,
        "send_first_ms": send_first,
        "send_last_ms": send_last,
        "send_ratio": send_ratio,
        "messages": readable,
    }


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
    print(f"close / reopen, {cycles} lives of one SQLite session (wall ms, medians of first and last {cycle_window})")
    print(f"  {'':<40} {'first':>8} {'last':>8} {'last/first':>11}")
    for name, key in (
        ("reopen, store held open (a server)", ""),
        ("reopen by path (a restart: + the store)", "restart_"),
        ("first send after the reopen", "send_"),
    ):
        first, last = reopen[f"{key}first_ms"], reopen[f"{key}last_ms"]
        print(f"  {name:<40} {first:>8.2f} {last:>8.2f} {last / first:>11.2f}")
    print(f"  the conversation after the last cycle: {int(reopen['messages'])} messages, all readable")
    figures: dict[str, Any] = {"benchmark": "conversation", "requests": requests, "cycles": cycles}
    for name, row, key, unit in (
        ("session", session, "", "us"),
        ("direct", floor, "", "us"),
        ("reopen", reopen, "", "ms"),
        ("restart", reopen, "restart_", "ms"),
        ("first_send", reopen, "send_", "ms"),
    ):
        figures[f"{name}_first_{unit}"] = round(row[f"{key}first_{unit}"], 3)
        figures[f"{name}_last_{unit}"] = round(row[f"{key}last_{unit}"], 3)
        figures[f"{name}_last_over_first"] = round(row[f"{key}ratio"], 3)
    figures["messages_after_cycles"] = int(reopen["messages"])
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
