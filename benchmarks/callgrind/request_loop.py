"""Instructions per ``session.send`` request, measured with callgrind at two commits.

The workload is `benchmarks/agent_turn.py`'s (a prompt, one streamed tool call ``add(a=1, b=2)``,
the tool, a streamed answer ``"done"``; 3 pass-through ``wrap_stream`` model middleware and 3
pass-through tool middleware; the default in-memory journal), restated here with only the public
API both commits share, so the same file drives any tree. The model is `_workload.respond`'s: it
answers ``"done"`` only when the tool returned 3 (not an error), and every request, timed or not,
must end with ``"done"``: a tree whose tool path fails costs fewer instructions, and must fail here
rather than look cheaper.

Two modes:

``run --tree PATH --requests N``
    The driver: imports ``trio_agent`` from *PATH*, opens one session, sends one untimed warm-up
    request, then *N* sequential requests, each checked to answer ``"done"``. Run it under valgrind;
    it prints what it did.

``measure --tree LABEL=PATH ... [--small 50 --large 250]``
    The orchestrator: runs the driver under ``valgrind --tool=callgrind`` with *small* and *large*
    requests for every tree and reports ``(Ir(large) - Ir(small)) / (large - small)``: the
    instructions of one request, start-up (interpreter, imports, session open) cancelled out.
    Prints a table and, as the last line, one JSON object.

Typical use (worktrees of the commits to compare; ``git worktree remove`` them afterwards)::

    git worktree add /tmp/loop_before <parent of the extraction>
    git worktree add /tmp/loop_head HEAD
    .venv/bin/python benchmarks/callgrind/request_loop.py measure \\
        --tree before=/tmp/loop_before --tree head=/tmp/loop_head

It lives in a subfolder so the benchmark smoke test (``benchmarks/*.py --short``) does not run
valgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPT = "add 1 and 2"
LAYERS = 3


def drive(tree: str, requests: int) -> None:
    sys.path.insert(0, tree)
    import attrs
    import trio

    import trio_agent as ta
    from trio_agent.testing import Reply, TestModel

    assert Path(ta.__file__).resolve().is_relative_to(Path(tree).resolve()), ta.__file__

    @attrs.frozen
    class AddInput:
        a: int
        b: int

    @ta.define_tool(side_effect="pure", kind="readonly", input_type=AddInput)
    async def add(input: AddInput, ctx: ta.ToolContext) -> ta.ToolResult:
        """Add two integers."""
        await trio.lowlevel.checkpoint()
        return ta.ToolResult.success(input.a + input.b)

    call_reply = Reply(tool_calls=[("add", {"a": 1, "b": 2})])
    answer_reply = Reply("done")

    def respond(request: ta.ModelRequest) -> Reply:
        last = request.messages[-1]
        if not isinstance(last, ta.ToolResultMessage):
            return call_reply
        return answer_reply if last.content == "3" and not last.is_error else Reply(f"the tool failed: {last.content}")

    class PassStream(ta.ModelMiddleware):
        async def wrap_stream(self, request: ta.ModelRequest, call_next: Any) -> Any:
            async for chunk in call_next(request):
                yield chunk

    async def passthrough(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        return await call_next()

    async def main() -> None:
        middleware = ta.MiddlewareConfig(model=[PassStream() for _ in range(LAYERS)], tool=[passthrough] * LAYERS)
        async with ta.open_session(provider=TestModel(respond=respond), tools=[add], middleware=middleware) as session:
            assert await session.send(PROMPT) == "done"  # warm-up: first-call paths, caches
            for _ in range(requests):
                answer = await session.send(PROMPT)
                assert answer == "done", answer

    trio.run(main)
    print(f"{requests} requests on {ta.__file__}")


def instructions(tree: str, requests: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "run",
                "--tree",
                tree,
                "--requests",
                str(requests),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"},
        )
        if done.returncode != 0:
            raise SystemExit(f"valgrind failed on {tree}:\n{done.stderr[-3000:]}")
        match = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
        if match is None:
            text = Path(out).read_text()
            match = re.search(r"^summary:\s*(\d+)", text, re.MULTILINE)
        assert match is not None, done.stderr[-2000:]
        return int(match.group(1))


def measure(trees: list[tuple[str, str]], small: int, large: int) -> None:
    rows: dict[str, dict[str, float]] = {}
    for label, path in trees:
        low = instructions(path, small)
        high = instructions(path, large)
        rows[label] = {"small": low, "large": high, "per_request": (high - low) / (large - small)}
    print(f"callgrind, instructions (Ir); per request = (Ir({large}) - Ir({small})) / {large - small}")
    print(f"{'tree':<12} {f'Ir({small})':>16} {f'Ir({large})':>16} {'per request':>14} {'vs first':>9}")
    first = next(iter(rows.values()))["per_request"]
    for label, row in rows.items():
        print(
            f"{label:<12} {row['small']:>16,.0f} {row['large']:>16,.0f} {row['per_request']:>14,.0f}"
            f" {row['per_request'] / first:>8.3f}x"
        )
    figures: dict[str, Any] = {"benchmark": "callgrind_request", "small": small, "large": large}
    for label, row in rows.items():
        figures[f"{label}_instructions_per_request"] = row["per_request"]
        figures[f"{label}_ratio_to_first"] = row["per_request"] / first
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run")
    run.add_argument("--tree", required=True)
    run.add_argument("--requests", type=int, required=True)
    meas = sub.add_parser("measure")
    meas.add_argument("--tree", action="append", required=True, help="LABEL=PATH, in report order")
    meas.add_argument("--small", type=int, default=50)
    meas.add_argument("--large", type=int, default=250)
    args = parser.parse_args()
    if args.mode == "run":
        drive(args.tree, args.requests)
    else:
        trees = [tuple(item.split("=", 1)) for item in args.tree]
        measure([(label, path) for label, path in trees], args.small, args.large)


if __name__ == "__main__":
    main()
