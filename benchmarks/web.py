"""What the HTTP layer costs: a streamed answer through the AG-UI endpoint against ``chat()`` in process.

The workload: one answer of W words (the test model streams a word per chunk), no tools: about
W + 6 AG-UI events per run. Every configuration runs in one Trio run of this process, round by
round, interleaved:

  - floor, in process: W pre-built events passed through a Trio memory channel (what any
    in-process consumer pays at least);
  - ``chat()`` in process, its events consumed;
  - ``chat()`` + AG-UI: the same, each event encoded (`AgUiEncoder.wire`) and framed (`sse_event`);
  - floor, HTTP: a bare ASGI app that writes the same number of pre-built SSE frames through
    Hypercorn, read by an httpx client over loopback (what any SSE endpoint here pays at least);
  - the endpoint: ``POST /runs`` of `trio_agent.web.create_app`, read by the same client.

Reported per configuration: the time to the first event (wall, from the request or the
``chat()`` call to the first event read), events per second over the whole run (wall), and the
median over rounds; then the HTTP layer's overhead per event: (endpoint - chat + AG-UI) per event,
and the same for the floors. The client runs in the same process and on the same 2 cores, so its
parsing is counted too: the figures are for comparing, not absolutes.

Prints a table and, as the last line, one JSON object. ``--short`` runs a quick version.
``--progress`` (the default when stderr is a terminal) writes a line per round to stderr; see ``_progress.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio
from _progress import add_progress_option, note, start_progress

from trio_agent import chat
from trio_agent.agui import AgUiEncoder, sse_event
from trio_agent.testing import Reply, TestModel
from trio_agent.web import create_app, local_only, serve

Measure = Callable[[], Awaitable[tuple[float, int, float]]]  # -> (first event s, events, total s)


def answer(words: int) -> Reply:
    return Reply(text=" ".join(f"w{index}" for index in range(words)))


async def floor_in_process(events: int) -> tuple[float, int, float]:
    send, receive = trio.open_memory_channel[dict[str, Any]](64)
    start = time.perf_counter()
    first = 0.0
    count = 0
    async with trio.open_nursery() as nursery:

        async def produce() -> None:
            async with send:
                for index in range(events):
                    await send.send({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": f"w{index} "})

        nursery.start_soon(produce)
        async with receive:
            async for _ in receive:
                count += 1
                if count == 1:
                    first = time.perf_counter() - start
    return first, count, time.perf_counter() - start


async def chat_in_process(model: TestModel, *, encode: bool) -> tuple[float, int, float]:
    start = time.perf_counter()
    first = 0.0
    count = 0
    encoder = AgUiEncoder(thread_id="t")
    async with chat(model, "go") as run:
        async for event in run:
            frames = [sse_event(data) for data in encoder.wire(event)] if encode else [event]
            for _ in frames:
                count += 1
                if count == 1:
                    first = time.perf_counter() - start
    return first, count, time.perf_counter() - start


async def read_sse(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> tuple[float, int, float]:
    start = time.perf_counter()
    first = 0.0
    count = 0
    async with client.stream("POST", url, json=payload) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                count += 1
                if count == 1:
                    first = time.perf_counter() - start
    return first, count, time.perf_counter() - start


def bare_sse_app(events: int) -> Any:
    frame = sse_event({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "w "})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # Hypercorn's start-up and shut-down handshake
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        while (await receive())["type"] != "http.request":
            pass
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(events):
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def measure(words: int, rounds: int) -> dict[str, dict[str, float]]:
    model = TestModel(default=answer(words))
    samples: dict[str, list[tuple[float, int, float]]] = {}
    payload = {"threadId": "t", "runId": "r", "messages": [{"id": "u", "role": "user", "content": "go"}]}
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(functools.partial(serve, create_app(model, auth=local_only), port=0))
        events = words + 6
        bare = await nursery.start(functools.partial(serve, bare_sse_app(events), port=0))
        async with httpx.AsyncClient(timeout=60) as client:
            configurations: dict[str, Measure] = {
                "floor, in process (Trio channel)": functools.partial(floor_in_process, events),
                "chat(), in process": functools.partial(chat_in_process, model, encode=False),
                "chat() + AG-UI encoding, in process": functools.partial(chat_in_process, model, encode=True),
                "floor, HTTP (bare ASGI SSE app)": functools.partial(read_sse, client, bare[0], payload),
                "endpoint (POST /runs)": None,  # type: ignore[dict-item]
            }
            for index in range(rounds + 1):  # round 0 warms up
                note(f"round {index}/{rounds}")
                for name, run in configurations.items():
                    if run is None:
                        payload = {**payload, "runId": f"r{index}"}
                        got = await read_sse(client, endpoint[0] + "/runs", payload)
                    else:
                        got = await run()
                    if index:
                        samples.setdefault(name, []).append(got)
        nursery.cancel_scope.cancel()
    rows: dict[str, dict[str, float]] = {}
    for name, runs in samples.items():
        rows[name] = {
            "first_ms": statistics.median(first for first, _, _ in runs) * 1e3,
            "events": statistics.median(count for _, count, _ in runs),
            "events_per_s": statistics.median(count / total for _, count, total in runs),
            "us_per_event": statistics.median(total / count for _, count, total in runs) * 1e6,
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="quick run for smoke tests")
    add_progress_option(parser)
    args = parser.parse_args(argv)
    start_progress("web", args)
    words, rounds = (200, 3) if args.short else (2000, 9)
    rows = trio.run(measure, words, rounds)
    print(f"one streamed answer of {words} words, median of {rounds} rounds (wall time, client in process)")
    print(f"  {'configuration':<38} {'first event':>12} {'events':>7} {'events/s':>10} {'us/event':>9}")
    for name, row in rows.items():
        print(
            f"  {name:<38} {row['first_ms']:>9.2f} ms {row['events']:>7.0f} {row['events_per_s']:>10,.0f}"
            f" {row['us_per_event']:>9.1f}"
        )
    encoded = rows["chat() + AG-UI encoding, in process"]["us_per_event"]
    endpoint = rows["endpoint (POST /runs)"]["us_per_event"]
    http_floor = (
        rows["floor, HTTP (bare ASGI SSE app)"]["us_per_event"]
        - rows["floor, in process (Trio channel)"]["us_per_event"]
    )
    print(f"  HTTP layer per event: endpoint - chat()+AG-UI = {endpoint - encoded:.1f} us")
    print(f"  (the bare HTTP floor over the in-process floor: {http_floor:.1f} us per event)")
    figures: dict[str, Any] = {"benchmark": "web", "words": words, "rounds": rounds}
    keys = {
        "floor, in process (Trio channel)": "direct_channel",
        "chat(), in process": "chat",
        "chat() + AG-UI encoding, in process": "chat_agui",
        "floor, HTTP (bare ASGI SSE app)": "direct_http",
        "endpoint (POST /runs)": "endpoint",
    }
    for name, key in keys.items():
        figures[f"{key}_first_ms"] = round(rows[name]["first_ms"], 3)
        figures[f"{key}_events_per_s"] = round(rows[name]["events_per_s"], 1)
        figures[f"{key}_us_per_event"] = round(rows[name]["us_per_event"], 2)
    figures["http_layer_us_per_event"] = round(endpoint - encoded, 2)
    figures["direct_http_over_channel_us_per_event"] = round(http_floor, 2)
    figures["endpoint_over_chat_agui"] = round(endpoint / encoded, 3)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
