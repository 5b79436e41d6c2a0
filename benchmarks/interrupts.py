"""Cost of a human-in-the-loop pause: a run that pauses for an approval and resumes, side by side
with the same run approved up front and with a hand-written Trio floor.

The workload: the model asks for one ``write`` call, the tool runs, the model answers "done" (only when
the tool's result is "wrote a.txt" and not an error: ``_workload.make_respond``). Every interaction, timed
or not, must end with "done", so a broken tool path fails the run instead of measuring cheaper.
Runs, in one process and interleaved round by round:
  - floor: a hand-written Trio loop doing the same (fake model reply, call the tool, reply);
  - chat: ``chat(model, prompt, tools=[write])`` with no permission table (the call just runs);
  - allowed: the same with ``permissions={"allow": ["write"]}`` (the table is walked, nobody asked);
  - paused: ``permissions={"ask": ["write"]}`` and ``signing_key``: run 1 pauses, the paused
    state goes to JSON text and back (``to_json`` / ``json.dumps`` / ``from_json``), run 2
    resumes with ``Approve`` (signature checked, the table walked again on the answer);
  - session: one open session (in-memory journal) with ``permissions={"allow": ["write"]}``:
    ``send`` runs the call;
  - session paused: ``permission_asks="interrupt"`` and an ask rule: ``send`` pauses
    (``run_paused`` journalled), ``resume([Approve])`` goes on (``interrupts_resolved``).

Reported: CPU µs per whole interaction (median over rounds) and each as a ratio to the floor and
to ``chat``. Prints a table and, as the last line, one JSON object. ``--short`` runs a quick version.
``--progress`` (the default when stderr is a terminal) writes a line per round to stderr; see ``_progress.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from typing import Any

import trio
from _progress import add_progress_option, note, start_progress
from _workload import make_respond

from trio_agent import SideEffect, ToolKind, chat, define_tool, open_session
from trio_agent.lifecycle import Approve, PausedRun
from trio_agent.testing import TestModel

KEY = b"benchmark-signing-key-0123456789"
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


@define_tool(
    name="write", description="writes", input_schema=SCHEMA, side_effect=SideEffect.IDEMPOTENT, kind=ToolKind.WRITE
)
async def write(input: dict[str, Any], ctx: Any) -> str:
    return f"wrote {input['path']}"


respond = make_respond(("write", {"path": "a.txt"}), "wrote a.txt")


async def floor() -> str:
    """What the interaction costs written by hand: a reply, the call, a reply."""
    history: list[Any] = [("user", "write")]
    call = {"name": "write", "input": {"path": "a.txt"}}
    history.append(("assistant", call))
    await trio.lowlevel.checkpoint()
    result = f"wrote {call['input']['path']}"  # type: ignore[index]
    await trio.lowlevel.checkpoint()
    history.append(("tool", result))
    await trio.lowlevel.checkpoint()
    return "done"


async def plain(model: TestModel, permissions: Any) -> str:
    async with chat(model, "write", tools=[write], permissions=permissions) as run:
        result = await run.result()
    return result.text


async def paused(model: TestModel) -> str:
    async with chat(model, "write", tools=[write], permissions={"ask": ["write"]}, signing_key=KEY) as run:
        first = await run.result()
    assert first.paused is not None
    state = PausedRun.from_json(json.loads(json.dumps(first.paused.to_json())))
    answers = [Approve(state.interrupts[0].id)]
    async with chat(
        model, tools=[write], permissions={"ask": ["write"]}, signing_key=KEY, resume=state, answers=answers
    ) as run:
        second = await run.result()
    return second.text


async def session_send(session: Any) -> str:
    return str(await session.send("write"))


async def session_pause_resume(session: Any) -> str:
    reply = await session.send("write")
    return str(await session.resume([Approve(reply.interrupts[0].id)]))


async def measure(rounds: int, repeat: int) -> dict[str, float]:
    model = TestModel(respond=respond)
    async with (
        open_session(provider=model, tools=[write], permissions={"allow": ["write"]}) as allowed_session,
        open_session(
            provider=model, tools=[write], permissions={"ask": ["write"]}, permission_asks="interrupt"
        ) as asking_session,
    ):
        return await _measure(rounds, repeat, model, allowed_session, asking_session)


async def _measure(rounds: int, repeat: int, model: TestModel, allowed: Any, asking: Any) -> dict[str, float]:
    configs = {
        "floor": floor,
        "chat": lambda: plain(model, None),
        "allowed": lambda: plain(model, {"allow": ["write"]}),
        "paused": lambda: paused(model),
        "session": lambda: session_send(allowed),
        "session paused": lambda: session_pause_resume(asking),
    }
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for fn in configs.values():  # warm up
        assert await fn() == "done"
    for round_index in range(rounds):
        note(f"round {round_index + 1}/{rounds}: {len(configs)} configurations x {repeat}")
        for name, fn in configs.items():
            gc.collect()
            start = time.process_time()
            for _ in range(repeat):
                answer = await fn()
                assert answer == "done", (name, answer)
            samples[name].append((time.process_time() - start) / repeat * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a quick run (fewer rounds)")
    parser.add_argument("--rounds", type=int, default=None)
    add_progress_option(parser)
    args = parser.parse_args()
    start_progress("interrupts", args)
    rounds = args.rounds or (3 if args.short else 15)
    repeat = 20 if args.short else 200
    figures = trio.run(measure, rounds, repeat)
    base, chat_us = figures["floor"], figures["chat"]
    print(f"human-in-the-loop pause and resume ({rounds} rounds x {repeat}; python {platform.python_version()})")
    print(f"{'configuration':<15} {'µs / interaction':>17} {'x floor':>9} {'x chat':>8}")
    for name, value in figures.items():
        print(f"{name:<15} {value:>17.1f} {value / base:>9.1f} {value / chat_us:>8.2f}")
    print(
        json.dumps(
            {
                "benchmark": "interrupts",
                "rounds": rounds,
                "repeat": repeat,
                "us_per_interaction": {name: round(value, 2) for name, value in figures.items()},
                "direct_floor_us": round(base, 2),
                "paused_over_chat": round(figures["paused"] / chat_us, 3),
                "allowed_over_chat": round(figures["allowed"] / chat_us, 3),
                "session_paused_over_session": round(figures["session paused"] / figures["session"], 3),
                "chat_over_floor": round(chat_us / base, 2),
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
