"""Cost of one tool call through the pipeline, side by side with calling the tool directly.

Runs, in one process and interleaved round by round:
  - the tool function called directly (the floor),
  - the pipeline with 0, 1, 3 and 10 pass-through middleware layers (in-memory journal,
    no hooks or permissions; a fresh pipeline and journal every 500 calls, so the
    figures are not dominated by garbage collection over an ever-growing journal),
  - raw Trio primitives (a CancelScope, a checkpoint) as a yardstick for this machine.

Prints a table and, as the last line, one JSON object. ``--short`` runs a quick version.
``--progress`` (the default when stderr is a terminal) writes a line per round to stderr; see ``_progress.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import attrs
import trio
from _progress import add_progress_option, note, start_progress

import trio_agent as ta

LAYER_COUNTS = (0, 1, 3, 10)
TARGET_PER_LAYER_US = 2.0
TARGET_FIXED_US = 25.0
# The reference machine behind the targets measured a bare CancelScope at 4.8 us (trio 0.35).
REFERENCE_SCOPE_US = 4.8


@attrs.frozen
class AddInput:
    a: int
    b: int


@ta.define_tool(side_effect="pure", kind="readonly")
async def add(input: AddInput, ctx: ta.ToolContext) -> ta.ToolResult:
    """Add two integers."""
    return ta.ToolResult.success(input.a + input.b)


async def passthrough(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
    return await call_next()


async def _noop_emit(item: ta.ToolItem) -> None:
    return None


async def time_direct(calls: int) -> float:
    ctx = ta.ToolContext(ta.ExecutionContext("s", "a", "r", "t", "c", "k", ta.AbortHandle(), lambda: None), _noop_emit)
    value = AddInput(1, 2)
    start = time.perf_counter()
    for _ in range(calls):
        await add.run(value, ctx)
    return (time.perf_counter() - start) / calls * 1e6


BATCH = 500  # calls per fresh pipeline: a session-sized journal, not one that grows for the whole run


async def time_pipeline(layers: int, calls: int) -> float:
    elapsed = 0.0
    done = 0
    while done < calls:
        count = min(BATCH, calls - done)
        pipeline = ta.ToolPipeline([add], middleware=[passthrough] * layers, history_limit=0)
        tool_calls = [ta.ToolCall(f"c{i}", "add", {"a": 1, "b": 2}) for i in range(count)]
        start = time.perf_counter()
        for call in tool_calls:
            record = await pipeline.execute(call)
        elapsed += time.perf_counter() - start
        assert record.result.output == 3, record
        done += count
    return elapsed / calls * 1e6


async def time_scope(calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        with trio.CancelScope():  # noqa: ASYNC100 - the bare scope is what we measure
            pass
    return (time.perf_counter() - start) / calls * 1e6


async def time_checkpoint(calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await trio.lowlevel.checkpoint()
    return (time.perf_counter() - start) / calls * 1e6


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares µs per layer."""
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)


async def measure(calls: int, rounds: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"direct": [], "scope": [], "checkpoint": []}
    for layers in LAYER_COUNTS:
        samples[f"layers_{layers}"] = []
    await time_pipeline(3, min(calls, 2000))  # warm-up
    for round_index in range(rounds):
        note(f"round {round_index + 1}/{rounds}: {calls} calls per configuration")
        gc.collect()
        samples["direct"].append(await time_direct(calls))
        for layers in LAYER_COUNTS:
            gc.collect()
            samples[f"layers_{layers}"].append(await time_pipeline(layers, calls))
        samples["scope"].append(await time_scope(calls))
        samples["checkpoint"].append(await time_checkpoint(calls))
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--short", action="store_true", help="quick run for smoke tests")
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    add_progress_option(parser)
    args = parser.parse_args(argv)
    start_progress("tool_pipeline", args)
    calls = args.calls or (500 if args.short else 20_000)
    rounds = args.rounds or (2 if args.short else 7)

    medians = trio.run(measure, calls, rounds)
    direct = medians["direct"]
    base = medians["layers_0"]
    per_layer = slope([(n, medians[f"layers_{n}"]) for n in LAYER_COUNTS])
    # The first layer also pays for the chain itself (the scope that protects the unwind after the
    # tool committed); each further layer is only the onion step. Both are reported.
    first_layer = medians["layers_1"] - medians["layers_0"]
    per_added_layer = (medians["layers_10"] - medians["layers_1"]) / 9
    fixed = base - direct
    machine_factor = medians["scope"] / REFERENCE_SCOPE_US

    print(f"tool pipeline: one call, {calls} calls x {rounds} rounds (median), trio {trio.__version__}")
    print(f"{'configuration':<26}{'us/call':>10}{'x direct':>10}{'+us vs 0':>10}")
    print(f"{'direct tool call':<26}{direct:>10.2f}{1.0:>10.1f}{'':>10}")
    for n in LAYER_COUNTS:
        value = medians[f"layers_{n}"]
        print(f"{f'pipeline, {n} layers':<26}{value:>10.2f}{value / direct:>10.1f}{value - base:>10.2f}")
    print(f"{'trio CancelScope (bare)':<26}{medians['scope']:>10.2f}")
    print(f"{'trio checkpoint':<26}{medians['checkpoint']:>10.2f}")
    print()
    print(
        f"per middleware layer: {per_layer:.2f} us least-squares over 0/1/3/10 (target <= {TARGET_PER_LAYER_US} us); "
        f"first layer incl. chain set-up {first_layer:.2f} us; each further layer {per_added_layer:.2f} us "
        f"(normalised {per_added_layer / machine_factor:.2f} us)"
    )
    print(f"fixed pipeline cost (0 layers - direct): {fixed:.2f} us (target <= {TARGET_FIXED_US} us)")
    print(
        f"this machine runs a bare CancelScope in {medians['scope']:.2f} us vs {REFERENCE_SCOPE_US} us on the "
        f"reference machine (x{machine_factor:.2f}); fixed cost normalised to it: {fixed / machine_factor:.2f} us"
    )
    figures = {
        "benchmark": "tool_pipeline",
        "calls": calls,
        "rounds": rounds,
        "direct_us": round(direct, 3),
        **{f"layers_{n}_us": round(medians[f"layers_{n}"], 3) for n in LAYER_COUNTS},
        "per_layer_us": round(per_layer, 3),
        "first_layer_us": round(first_layer, 3),
        "per_added_layer_us": round(per_added_layer, 3),
        "per_added_layer_normalised_us": round(per_added_layer / machine_factor, 3),
        "fixed_us": round(fixed, 3),
        "fixed_in_cancel_scopes": round(fixed / medians["scope"], 2),
        "fixed_normalised_us": round(fixed / machine_factor, 3),
        "cancel_scope_us": round(medians["scope"], 3),
        "checkpoint_us": round(medians["checkpoint"], 3),
        "ratio_0_layers_vs_direct": round(base / direct, 2),
        "ratio_10_layers_vs_direct": round(medians["layers_10"] / direct, 2),
        "per_layer_within_target": per_layer <= TARGET_PER_LAYER_US,
        "fixed_within_target": fixed <= TARGET_FIXED_US,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
