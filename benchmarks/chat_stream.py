"""Cost of ``on_chunk`` chat middleware on a streamed answer, side by side with the raw model stream.

The workload: one 2,000-token answer (the test model streams it a word per chunk, so 2,000 text
chunks, then a usage and a finish chunk), no tools.

Runs, in one process and interleaved round by round:
  - direct (the floor): the same `TestModel` reply consumed straight from the model service,
    ``async with ModelService(model).stream(messages) as chunks: async for chunk in chunks``;
  - ``chat(model, prompt, middleware=[...])`` with 0, 1, 3 and 10 pass-through middleware (a
    `ChatMiddleware` whose ``on_chunk`` returns ``None``), every event consumed with
    ``async for event in run``: the loop's assembly, a `TextMessageContent` event per chunk, the
    middleware's ``on_chunk`` per event, and the run's bounded channel to the reader.

Reported per configuration: µs per chunk (process CPU time of one whole run / 2,000, the median
over rounds); the fixed overhead of ``chat()`` over the raw stream per chunk (chat with 0
middleware minus direct); the per-middleware slope (``(t10 - t0) / 10`` per chunk, and a
least-squares slope over 0, 1, 3, 10 as a check). Target: at most 1 µs per chunk per middleware.

Prints a table and, as the last line, one JSON object. ``--short`` runs a quick version.
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

import trio_agent as ta
from trio_agent._chat._chat import chat
from trio_agent.lifecycle import ChatMiddleware
from trio_agent.testing import Reply, TestModel

TOKENS = 2_000
MIDDLEWARE_COUNTS = (0, 1, 3, 10)
TARGET_PER_MIDDLEWARE_US = 1.0
PROMPT = "tell me a long story"
ANSWER = " ".join(f"w{index % 97}" for index in range(TOKENS))


class PassChunk(ChatMiddleware):
    """A pass-through ``on_chunk``: keeps every event."""

    def on_chunk(self, ctx: Any, event: Any) -> None:
        return None


def make_model() -> TestModel:
    return TestModel(default=Reply(ANSWER))


async def run_direct(model: TestModel) -> int:
    service = ta.ModelService(model)
    chunks_seen = 0
    async with service.stream([ta.UserMessage(PROMPT)]) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, ta.TextDelta):
                chunks_seen += 1
    return chunks_seen


async def run_chat(model: TestModel, middleware: list[ChatMiddleware]) -> int:
    chunks_seen = 0
    async with chat(model, PROMPT, middleware=middleware) as run:
        async for event in run:
            if type(event).__name__ == "TextMessageContent":
                chunks_seen += 1
        result = await run.result()
    assert result.text == ANSWER, result.text[:80]
    return chunks_seen


async def time_once(config: str, model: TestModel, stacks: dict[str, list[ChatMiddleware]]) -> float:
    """CPU µs per chunk for one run of *config*."""
    gc.collect()
    start = time.process_time()
    if config == "direct":
        seen = await run_direct(model)
    else:
        seen = await run_chat(model, stacks[config])
    elapsed = time.process_time() - start
    assert seen == TOKENS, (config, seen)
    return elapsed / TOKENS * 1e6


def config_names() -> list[str]:
    return ["direct", *(f"chat_{count}" for count in MIDDLEWARE_COUNTS)]


async def measure(rounds: int, runs_per_round: int) -> dict[str, list[float]]:
    model = make_model()
    stacks = {f"chat_{count}": [PassChunk() for _ in range(count)] for count in MIDDLEWARE_COUNTS}
    samples: dict[str, list[float]] = {name: [] for name in config_names()}
    for name in config_names():  # warm-up: first-call paths, caches
        await time_once(name, model, stacks)
    for round_index in range(rounds):
        note(f"round {round_index + 1}/{rounds}: {len(config_names())} configurations x {runs_per_round} runs")
        # Interleaved, the order rotated each round, so drift on a shared machine hits every config alike.
        names = config_names()
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            runs = [await time_once(name, model, stacks) for _ in range(runs_per_round)]
            samples[name].append(statistics.median(runs))
    return samples


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a quick run (fewer rounds)")
    parser.add_argument("--rounds", type=int, default=None)
    add_progress_option(parser)
    args = parser.parse_args()
    start_progress("chat_stream", args)
    rounds = args.rounds or (3 if args.short else 9)
    runs_per_round = 2 if args.short else 5

    samples = trio.run(measure, rounds, runs_per_round)
    median = {name: statistics.median(values) for name, values in samples.items()}
    spread = {name: (min(values), max(values)) for name, values in samples.items()}
    direct = median["direct"]
    t0, t10 = median["chat_0"], median["chat_10"]
    slope = (t10 - t0) / 10
    fitted = least_squares_slope(
        [float(c) for c in MIDDLEWARE_COUNTS], [median[f"chat_{c}"] for c in MIDDLEWARE_COUNTS]
    )
    fixed = t0 - direct
    first = median["chat_1"] - t0  # the first layer, and the delivered-chunk counter any on_chunk list adds
    further = (t10 - median["chat_1"]) / 9
    met = slope <= TARGET_PER_MIDDLEWARE_US

    print(
        f"chat_stream: one {TOKENS:,}-token streamed answer ({TOKENS:,} text chunks), "
        f"{rounds} rounds x {runs_per_round} runs, process CPU time, medians"
    )
    print(f"python {platform.python_version()}, trio {trio.__version__}")
    print()
    print(f"{'configuration':<34} {'µs/chunk':>9} {'min':>8} {'max':>8} {'vs direct':>10}")
    labels = {
        "direct": "direct: ModelService.stream",
        **{f"chat_{c}": f"chat(), {c} on_chunk middleware" for c in MIDDLEWARE_COUNTS},
    }
    for name in config_names():
        low, high = spread[name]
        print(f"{labels[name]:<34} {median[name]:>9.3f} {low:>8.3f} {high:>8.3f} {median[name] / direct:>9.2f}x")
    print()
    print(f"fixed overhead of chat() over the raw stream: {fixed:.3f} µs per chunk")
    print(f"per middleware per chunk: {slope:.3f} µs ((t10 - t0) / 10); least-squares over 0/1/3/10: {fitted:.3f} µs")
    print(
        f"  of which: the first middleware {first:.3f} µs (with the chunk counter it brings), "
        f"each further {further:.3f} µs"
    )
    if met:
        verdict = f"target met: {slope:.3f} µs <= {TARGET_PER_MIDDLEWARE_US} µs per chunk per middleware"
        if slope > 0.9 * TARGET_PER_MIDDLEWARE_US:
            verdict += " (within 10% of the line: a noisier run can land on either side)"
    else:
        verdict = (
            f"open target: {slope:.3f} µs per chunk per middleware against a target of {TARGET_PER_MIDDLEWARE_US} µs "
            f"(each on_chunk layer is an async sink decorator: one awaited call into the layer, the hook call, "
            f"an isawaitable check and the decision check; compare the raw stream's {direct:.3f} µs per chunk on "
            f"this machine)"
        )
    print(verdict)

    figures: dict[str, Any] = {
        "benchmark": "chat_stream",
        "tokens": TOKENS,
        "rounds": rounds,
        "direct_us_per_chunk": direct,
        **{f"chat_{c}_middleware_us_per_chunk": median[f"chat_{c}"] for c in MIDDLEWARE_COUNTS},
        "fixed_overhead_us_per_chunk": fixed,
        "per_middleware_us_per_chunk": slope,
        "per_middleware_fit_us_per_chunk": fitted,
        "first_middleware_us_per_chunk": first,
        "further_middleware_us_per_chunk": further,
        "target_per_middleware_us": TARGET_PER_MIDDLEWARE_US,
        "target_met": met,
    }
    sys.stdout.flush()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
