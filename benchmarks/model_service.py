"""Cost of the model service around a provider, side by side with calling the provider directly.

Runs, in one process and interleaved round by round:
  - chat: the TestModel called directly (``await model.chat(request)``, the floor) and through
    `ModelService.chat` with 0, 1, 3 and 10 pass-through ``wrap_chat`` layers (µs per call; the
    least-squares slope over the layer counts is the cost of one layer);
  - stream: a 1,000-word reply (1,000 ``TextDelta`` chunks plus usage and finish) consumed directly
    from ``model.stream(request)`` and through ``service.stream`` with 0, 1, 3 and 10 pass-through
    ``wrap_stream`` layers (µs per chunk, and per chunk per layer);
  - raw Trio primitives (a bare CancelScope, a checkpoint) as a yardstick for this machine; figures are
    also reported normalised to the reference machine, where a bare CancelScope costs 4.8 µs.

Further sections plug in through `EXTRA_SECTIONS`: a function ``measure(short) -> Section`` adds rows to
the table and figures to the JSON line. ``measure_sse_parsing`` is one: chunks/s of the OpenAI provider
parsing a 1,000-chunk SSE stream over real HTTP from a local server, beside the same bytes read raw.

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
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from _progress import add_progress_option, note, start_progress

import trio_agent as ta
from trio_agent.testing import Reply, TestModel

LAYER_COUNTS = (0, 1, 3, 10)
TESTS_DIR = str(Path(__file__).resolve().parent.parent / "tests")  # the tests' local HTTP server lives there
TARGET_PER_LAYER_CALL_US = 2.0
TARGET_PER_LAYER_CHUNK_US = 1.0
# The reference machine behind the targets measured a bare CancelScope at 4.8 us (trio 0.35).
REFERENCE_SCOPE_US = 4.8
STREAM_WORDS = 1000

MESSAGES = [ta.UserMessage("benchmark")]


class PassChat(ta.ModelMiddleware):
    async def wrap_chat(self, request: ta.ModelRequest, call_next: Any) -> ta.ModelResponse:
        return await call_next(request)


class PassStream(ta.ModelMiddleware):
    async def wrap_stream(self, request: ta.ModelRequest, call_next: Any) -> AsyncIterator[ta.StreamChunk]:
        async for chunk in call_next(request):
            yield chunk


# -- chat and stream, one slice at a time -----------------------------------------------------------------
#
# Configurations are interleaved slice by slice (a batch of calls, one stream), so noise on this VM spreads
# over all of them instead of landing on whichever configuration happened to run during a slow second.

SLICE = 100  # chat calls per slice


async def chat_slice_direct(model: TestModel, count: int) -> float:
    request = ta.ModelRequest(ta.Operation.CHAT, model.model, MESSAGES)
    start = time.perf_counter()
    for _ in range(count):
        await model.chat(request)
    elapsed = time.perf_counter() - start
    model.requests.clear()
    return elapsed


async def chat_slice_service(service: ta.ModelService, model: TestModel, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        response = await service.chat(MESSAGES)
    elapsed = time.perf_counter() - start
    assert response.message.text == "ok", response
    model.requests.clear()
    return elapsed


async def stream_once_direct(model: TestModel) -> tuple[float, int]:
    request = ta.ModelRequest(ta.Operation.STREAM, model.model, MESSAGES)
    chunks = 0
    start = time.perf_counter()
    async for _chunk in model.stream(request):
        chunks += 1
    elapsed = time.perf_counter() - start
    model.requests.clear()
    return elapsed, chunks


async def stream_once_service(service: ta.ModelService, model: TestModel) -> tuple[float, int]:
    chunks = 0
    start = time.perf_counter()
    async with service.stream(MESSAGES) as iterator:
        async for _chunk in iterator:
            chunks += 1
    elapsed = time.perf_counter() - start
    model.requests.clear()
    return elapsed, chunks


# -- yardstick --------------------------------------------------------------------------------------------


async def time_scope(calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        with trio.CancelScope():  # noqa: ASYNC100 - the bare scope is what we measure
            pass
    return (time.perf_counter() - start) / calls * 1e6


def time_compose_per_layer(calls: int) -> float:
    """What `ModelService.call` spends composing the chain (shape checks included) for each layer, per call."""
    layers = [PassChat().wrap_chat for _ in range(10)]

    def check(request: object) -> None:
        return None

    def terminal(request: object) -> object:
        return request

    start = time.perf_counter()
    for _ in range(calls):
        ta.compose_middleware(layers, terminal, check=check, validate=False)
    return (time.perf_counter() - start) / calls / len(layers) * 1e6


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


async def measure(calls: int, streams: int, rounds: int) -> tuple[dict[str, float], int]:
    chat_model = TestModel(default=Reply("ok"))
    stream_model = TestModel(default=Reply(" ".join(f"w{i}" for i in range(STREAM_WORDS))))
    chat_services = {n: ta.ModelService(chat_model, [PassChat() for _ in range(n)]) for n in LAYER_COUNTS}
    stream_services = {n: ta.ModelService(stream_model, [PassStream() for _ in range(n)]) for n in LAYER_COUNTS}

    chat_runs: dict[str, Callable[[int], Any]] = {"chat_direct": lambda k: chat_slice_direct(chat_model, k)}
    stream_runs: dict[str, Callable[[], Any]] = {"stream_direct": lambda: stream_once_direct(stream_model)}
    for n in LAYER_COUNTS:
        chat_runs[f"chat_layers_{n}"] = lambda k, n=n: chat_slice_service(chat_services[n], chat_model, k)
        stream_runs[f"stream_layers_{n}"] = lambda n=n: stream_once_service(stream_services[n], stream_model)
    samples: dict[str, list[float]] = {
        name: [] for name in [*chat_runs, *stream_runs, "scope", "checkpoint", "compose_per_layer"]
    }

    for run in chat_runs.values():  # warm-up
        await run(SLICE)
    _, chunks_per_stream = await stream_runs["stream_layers_3"]()

    for round_index in range(rounds):
        note(f"round {round_index + 1}/{rounds}: chat, {calls} calls per configuration")
        gc.collect()
        chat_time = dict.fromkeys(chat_runs, 0.0)
        done = 0
        while done < calls:
            count = min(SLICE, calls - done)
            names = list(chat_runs)
            shift = (done // SLICE + round_index) % len(names)  # rotate who goes first
            for name in names[shift:] + names[:shift]:
                chat_time[name] += await chat_runs[name](count)
            done += count
        for name, elapsed in chat_time.items():
            samples[name].append(elapsed / calls * 1e6)

        note(f"round {round_index + 1}/{rounds}: stream, {streams} streams per configuration")
        gc.collect()
        stream_time = dict.fromkeys(stream_runs, 0.0)
        stream_chunks = dict.fromkeys(stream_runs, 0)
        for index in range(streams):
            names = list(stream_runs)
            shift = (index + round_index) % len(names)
            for name in names[shift:] + names[:shift]:
                elapsed, chunks = await stream_runs[name]()
                assert chunks == chunks_per_stream, (name, chunks, chunks_per_stream)
                stream_time[name] += elapsed
                stream_chunks[name] += chunks
        for name, elapsed in stream_time.items():
            samples[name].append(elapsed / stream_chunks[name] * 1e6)

        samples["scope"].append(await time_scope(calls))
        samples["checkpoint"].append(await time_checkpoint(calls))
        samples["compose_per_layer"].append(time_compose_per_layer(max(calls // 10, 100)))
    return {name: statistics.median(values) for name, values in samples.items()}, chunks_per_stream


# -- pluggable sections -------------------------------------------------------------------------------------


@attrs.frozen
class Section:
    """Extra rows for the table (label, value, unit) and extra figures for the JSON line."""

    title: str
    rows: tuple[tuple[str, float, str], ...] = ()
    figures: dict[str, Any] = attrs.field(factory=dict)


# -- streaming provider parsing --------------------------------------------------------------------------
# --- provider parsing: the OpenAI provider parsing a 1,000-chunk SSE stream from a local server ---


def _sse_body(chunks: int) -> bytes:
    events = []
    for index in range(chunks):
        payload = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "bench",
            "choices": [{"index": 0, "delta": {"content": f"w{index} "}, "finish_reason": None}],
        }
        events.append(f"data: {json.dumps(payload)}\n\n")
    final = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    events.append(f"data: {json.dumps(final)}\n\n")
    events.append("data: [DONE]\n\n")
    return "".join(events).encode()


async def _measure_sse(chunks: int, rounds: int) -> dict[str, float]:
    """Chunks per second of OpenAIProvider.stream over real HTTP from a local server (127.0.0.1)."""
    sys.path.insert(0, TESTS_DIR)
    from fake_server import Scripted, open_fake_server  # the tests' real local HTTP server

    body = _sse_body(chunks)
    # Send the body in pieces of ~16 KiB, as a server flushing as it goes would.
    pieces = [body[i : i + 16384] for i in range(0, len(body), 16384)]

    def handler(request: object) -> Scripted:
        return Scripted.sse(pieces)

    samples: list[float] = []
    raw_samples: list[float] = []
    async with (
        open_fake_server(handler) as server,
        ta.OpenAIProvider("bench", api_key="bench", base_url=server.url + "/v1") as provider,
    ):
        request = ta.ModelRequest(ta.Operation.STREAM, "bench", (ta.UserMessage("hi"),))
        for _ in range(rounds + 1):  # the first round warms the connection pool
            start = time.perf_counter()
            stream = provider.stream(request)
            count = 0
            try:
                async for chunk in stream:
                    if isinstance(chunk, ta.TextDelta):
                        count += 1
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            elapsed = time.perf_counter() - start
            assert count == chunks, count
            samples.append(chunks / elapsed)
        # The floor: the same bytes read over the same HTTP connection, no SSE or JSON parsing.
        async with httpx.AsyncClient() as client:
            for _ in range(rounds + 1):
                start = time.perf_counter()
                async with client.stream("POST", server.url + "/v1/chat/completions", json={}) as response:
                    async for _piece in response.aiter_bytes():
                        pass
                raw_samples.append(chunks / (time.perf_counter() - start))
    return {
        "sse_chunks_per_s": statistics.median(samples[1:]),
        "raw_http_chunks_per_s": statistics.median(raw_samples[1:]),
    }


def measure_sse_parsing(short: bool) -> Section:
    chunks, rounds = 1000, (3 if short else 15)
    figures = trio.run(_measure_sse, chunks, rounds)
    parsed, raw = figures["sse_chunks_per_s"], figures["raw_http_chunks_per_s"]
    return Section(
        f"OpenAI provider parsing a {chunks}-chunk SSE stream from 127.0.0.1 ({rounds} rounds, median)",
        (
            ("provider.stream (SSE + JSON)", parsed, "chunks/s"),
            ("same bytes, raw httpx read", raw, "chunks/s (no parsing: the floor)"),
            ("parsing cost per chunk", 1e6 / parsed - 1e6 / raw, "us"),
        ),
        {
            "sse_parsing_chunks_per_s": round(parsed, 1),
            "sse_raw_http_chunks_per_s": round(raw, 1),
            "sse_parsing_us_per_chunk": round(1e6 / parsed - 1e6 / raw, 3),
        },
    )


# Each entry is called as ``section(short)`` after the core measurements, in order.
EXTRA_SECTIONS: tuple[Callable[[bool], Section], ...] = (measure_sse_parsing,)


# -- report --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="quick run for smoke tests")
    parser.add_argument("--calls", type=int, default=None, help="chat calls per configuration and round")
    parser.add_argument("--streams", type=int, default=None, help="1,000-chunk streams per configuration and round")
    parser.add_argument("--rounds", type=int, default=None)
    add_progress_option(parser)
    args = parser.parse_args(argv)
    start_progress("model_service", args)
    calls = args.calls or (1000 if args.short else 20_000)
    streams = args.streams or (10 if args.short else 40)
    rounds = args.rounds or (3 if args.short else 7)

    medians, chunks_per_stream = trio.run(measure, calls, streams, rounds)
    scope = medians["scope"]
    machine = scope / REFERENCE_SCOPE_US

    chat_direct = medians["chat_direct"]
    chat_base = medians["chat_layers_0"]
    chat_per_layer = slope([(n, medians[f"chat_layers_{n}"]) for n in LAYER_COUNTS])
    chat_fixed = chat_base - chat_direct
    stream_direct = medians["stream_direct"]
    stream_base = medians["stream_layers_0"]
    stream_per_layer = slope([(n, medians[f"stream_layers_{n}"]) for n in LAYER_COUNTS])
    stream_fixed = stream_base - stream_direct

    print(f"model service: trio {trio.__version__}, {rounds} rounds (median); machine yardstick x{machine:.2f}")
    print(f"chat: {calls} calls per configuration and round")
    print(f"{'configuration':<30}{'us/call':>10}{'x direct':>10}{'+us vs 0':>10}{'normalised':>12}")
    print(f"{'TestModel.chat directly':<30}{chat_direct:>10.2f}{1.0:>10.1f}{'':>10}{chat_direct / machine:>12.2f}")
    for n in LAYER_COUNTS:
        value = medians[f"chat_layers_{n}"]
        print(
            f"{f'service.chat, {n} layers':<30}{value:>10.2f}{value / chat_direct:>10.1f}"
            f"{value - chat_base:>10.2f}{value / machine:>12.2f}"
        )
    print()
    print(f"stream: {streams} streams of {chunks_per_stream} chunks per configuration and round")
    print(f"{'configuration':<30}{'us/chunk':>10}{'x direct':>10}{'+us vs 0':>10}{'normalised':>12}")
    print(
        f"{'TestModel.stream directly':<30}{stream_direct:>10.3f}{1.0:>10.1f}{'':>10}{stream_direct / machine:>12.3f}"
    )
    for n in LAYER_COUNTS:
        value = medians[f"stream_layers_{n}"]
        print(
            f"{f'service.stream, {n} layers':<30}{value:>10.3f}{value / stream_direct:>10.1f}"
            f"{value - stream_base:>10.3f}{value / machine:>12.3f}"
        )
    print()
    print(f"{'trio CancelScope (bare)':<30}{scope:>10.2f} us  (reference machine: {REFERENCE_SCOPE_US} us)")
    print(f"{'trio checkpoint':<30}{medians['checkpoint']:>10.2f} us")
    print(
        f"{'compose_middleware, per layer':<30}{medians['compose_per_layer']:>10.2f} us  "
        "(paid on every chat call; layers are validated once, when the service is built)"
    )

    extra_figures: dict[str, Any] = {}
    for section_fn in EXTRA_SECTIONS:
        note(f"section {section_fn.__name__}")
        section = section_fn(args.short)
        print()
        print(section.title)
        for label, value, unit in section.rows:
            print(f"{label:<30}{value:>10.2f} {unit}")
        extra_figures.update(section.figures)

    print()
    print(
        f"per wrap_chat layer: {chat_per_layer:.2f} us per call, normalised {chat_per_layer / machine:.2f} us "
        f"(target <= {TARGET_PER_LAYER_CALL_US} us)"
    )
    print(
        f"per wrap_stream layer: {stream_per_layer:.3f} us per chunk, normalised {stream_per_layer / machine:.3f} us "
        f"(target <= {TARGET_PER_LAYER_CHUNK_US} us)"
    )
    print(
        f"fixed service cost (0 layers - direct): {chat_fixed:.2f} us per call "
        f"({chat_fixed / scope:.2f} CancelScopes), {stream_fixed:.3f} us per chunk "
        f"({stream_fixed / scope:.2f} CancelScopes)"
    )
    figures = {
        "benchmark": "model_service",
        "calls": calls,
        "streams": streams,
        "chunks_per_stream": chunks_per_stream,
        "rounds": rounds,
        "chat_direct_us": round(chat_direct, 3),
        **{f"chat_layers_{n}_us": round(medians[f"chat_layers_{n}"], 3) for n in LAYER_COUNTS},
        "chat_per_layer_us": round(chat_per_layer, 3),
        "chat_per_layer_normalised_us": round(chat_per_layer / machine, 3),
        "chat_fixed_us": round(chat_fixed, 3),
        "chat_fixed_normalised_us": round(chat_fixed / machine, 3),
        "stream_direct_us_per_chunk": round(stream_direct, 4),
        **{f"stream_layers_{n}_us_per_chunk": round(medians[f"stream_layers_{n}"], 4) for n in LAYER_COUNTS},
        "stream_per_layer_us_per_chunk": round(stream_per_layer, 4),
        "stream_per_layer_normalised_us_per_chunk": round(stream_per_layer / machine, 4),
        "stream_fixed_us_per_chunk": round(stream_fixed, 4),
        "stream_fixed_normalised_us_per_chunk": round(stream_fixed / machine, 4),
        "stream_direct_chunks_per_s": round(1e6 / stream_direct, 1),
        "stream_layers_0_chunks_per_s": round(1e6 / stream_base, 1),
        "cancel_scope_us": round(scope, 3),
        "checkpoint_us": round(medians["checkpoint"], 3),
        "compose_per_layer_us": round(medians["compose_per_layer"], 3),
        "machine_factor": round(machine, 3),
        "chat_per_layer_within_target": chat_per_layer <= TARGET_PER_LAYER_CALL_US,
        "stream_per_layer_within_target": stream_per_layer <= TARGET_PER_LAYER_CHUNK_US,
        **extra_figures,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
