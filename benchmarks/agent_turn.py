"""One agent request end to end through `open_session`, side by side with a hand-written Trio loop (the floor).

The workload is python-peers.md §4: a user prompt, the model answers with one tool call ``add(a=1, b=2)``, the
tool returns 3, the model answers ``"done"``: two streamed model calls and one tool call per request, all fake
and zero-latency (the model and the tool each pass one Trio checkpoint).

Runs, in one process and interleaved round by round:
  - agent: ``open_session(provider=TestModel(respond=...), tools=[add], middleware=MiddlewareConfig(model=[3
    pass-through wrap_stream layers], tool=[3 pass-through layers]))`` with the default in-memory journal; one
    request is ``await session.send(prompt)``;
  - floor (the "direct" loop): the same `TestModel` streamed directly (same requests, same 6 + 3 chunks),
    the tool call parsed from the chunks, the tool function awaited, the messages appended to the
    conversation, the model called again; no middleware, no journal, no event stream;
  - floor + layers: the floor with 3 pass-through async-generator layers around the model stream, 3 closure
    layers around the tool and a Python list as the journal (14 records per request), the floor loop of
    python-peers.md §4.3: what "3 layers and a journal" cost at the least;
  - each in three shapes: sequential (one session, N requests in a row; a fresh session each round, its
    first request untimed), and 100 and 1,000 concurrent sessions (each its own session, opened and warmed
    by one request untimed; then K requests each, one at a time per session, all sessions started together;
    none closes before the last one finished). Reported: CPU and wall µs per request, requests/s, requests
    per CPU-second, GC share and per-request latency p50/p99. Trio runs on one thread, so the process uses
    one core: requests per CPU-second is requests/s per core;
  - a long session: the cost of a request after W earlier requests in the same session (the agent's
    history and journal grow; so does the floor's history);
  - peers (python-peers.md §4.3), when installed: pydantic-ai ``Agent.run`` with ``FunctionModel`` and 3
    pass-through capabilities, in a separate ``asyncio.run`` in this process (it cannot run under Trio);
    each run is a fresh conversation (no history carried between runs), as in §4.3, and "K requests per
    session" are K runs in a row in one coroutine.
    Not a project dependency: ``pip install pydantic-ai-slim`` to include it; skipped otherwise.

Target: the agent costs at most 3x the floor per request, sequentially and at 100 and 1,000 sessions. The
verdict uses CPU time per request (process time), which other load on a shared machine does not inflate;
the wall-clock ratios are reported beside it.

Prints a table and, as the last line, one JSON object. ``--short`` runs a quick version (20 and 100
sessions instead of 100 and 1,000: opening 1,000 sessions alone takes seconds). ``--progress`` (the default
when stderr is a terminal) writes a line per round to stderr; see ``_progress.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import trio
from _progress import add_progress_option, note, start_progress

import trio_agent as ta
from trio_agent.testing import Reply, TestModel

LAYERS = 3
TARGET_RATIO = 3.0
PROMPT = "add 1 and 2"

# -- the workload -------------------------------------------------------------------------------------------


@attrs.frozen
class AddInput:
    a: int
    b: int


async def add_numbers(a: int, b: int) -> int:
    """The tool's work, shared by the agent and the floor: one checkpoint, like the fake model."""
    await trio.lowlevel.checkpoint()
    return a + b


@ta.define_tool(side_effect="pure", kind="readonly")
async def add(input: AddInput, ctx: ta.ToolContext) -> ta.ToolResult:
    """Add two integers."""
    return ta.ToolResult.success(await add_numbers(input.a, input.b))


TOOL_SPECS = (ta.ToolSpec(add.name, add.description, dict(add.input_schema)),)
CALL_REPLY = Reply(tool_calls=[("add", {"a": 1, "b": 2})])
ANSWER_REPLY = Reply("done")


def respond(request: ta.ModelRequest) -> Reply:
    """A tool call for a new prompt, the answer once the tool result is the last message."""
    return ANSWER_REPLY if isinstance(request.messages[-1], ta.ToolResultMessage) else CALL_REPLY


class PassStream(ta.ModelMiddleware):
    async def wrap_stream(self, request: ta.ModelRequest, call_next: Any) -> AsyncIterator[ta.StreamChunk]:
        async for chunk in call_next(request):
            yield chunk


async def passthrough(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
    return await call_next()


Send = Callable[[str], Awaitable[str]]
Opener = Callable[[TestModel], AbstractAsyncContextManager[Send]]


@asynccontextmanager
async def open_agent(model: TestModel) -> AsyncIterator[Send]:
    middleware = ta.MiddlewareConfig(model=[PassStream() for _ in range(LAYERS)], tool=[passthrough] * LAYERS)
    async with ta.open_session(provider=model, tools=[add], middleware=middleware) as session:
        yield session.send


# -- the floor: a hand-written minimal Trio loop doing the same work ------------------------------------------


class FloorSession:
    """The same conversation, by hand: stream, collect, parse, call the tool, append, call again."""

    def __init__(self, model: TestModel) -> None:
        self.model = model
        self.history: list[ta.Message] = []

    async def send(self, prompt: str) -> str:
        history = self.history
        history.append(ta.UserMessage(prompt))
        while True:
            request = ta.ModelRequest(ta.Operation.STREAM, self.model.model, tuple(history), tools=TOOL_SPECS)
            text: list[str] = []
            calls: dict[int, ta.ToolCallPart] = {}
            async for chunk in self.model.stream(request):
                if isinstance(chunk, ta.TextDelta):
                    text.append(chunk.text)
                elif isinstance(chunk, ta.ToolCallEnd):
                    calls[chunk.index] = ta.ToolCallPart(chunk.id, chunk.name, chunk.arguments)
            parts: list[Any] = [ta.TextPart("".join(text))] if text else []
            parts += [calls[index] for index in sorted(calls)]
            history.append(ta.AssistantMessage(tuple(parts)))
            if not calls:
                return "".join(text)
            for index in sorted(calls):
                call = calls[index]
                arguments = AddInput(**json.loads(call.arguments))
                output = await add_numbers(arguments.a, arguments.b)
                history.append(ta.ToolResultMessage(call.id, json.dumps(output)))


@asynccontextmanager
async def open_floor(model: TestModel) -> AsyncIterator[Send]:
    yield FloorSession(model).send


def _stream_layer(inner: Callable[[ta.ModelRequest], AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def layer(request: ta.ModelRequest) -> AsyncIterator[Any]:
        async for chunk in inner(request):
            yield chunk

    return layer


def _tool_layer(inner: Callable[[int, int], Awaitable[int]]) -> Callable[[int, int], Awaitable[int]]:
    async def layer(a: int, b: int) -> int:
        return await inner(a, b)

    return layer


class LayeredFloorSession:
    """The floor with 3 pass-through layers around the model stream and the tool, and a list journal."""

    def __init__(self, model: TestModel) -> None:
        self.model = model
        self.history: list[ta.Message] = []
        self.journal: list[tuple[Any, ...]] = []
        stream: Callable[..., AsyncIterator[Any]] = model.stream
        tool: Callable[[int, int], Awaitable[int]] = add_numbers
        for _ in range(LAYERS):
            stream = _stream_layer(stream)
            tool = _tool_layer(tool)
        self.stream = stream
        self.tool = tool

    async def send(self, prompt: str) -> str:
        history, record = self.history, self.journal.append
        record(("request_accepted", prompt))
        record(("request_started",))
        history.append(ta.UserMessage(prompt))
        turn = 0
        while True:
            turn += 1
            record(("turn_started", turn))
            record(("model_attempt_started", turn))
            request = ta.ModelRequest(ta.Operation.STREAM, self.model.model, tuple(history), tools=TOOL_SPECS)
            text: list[str] = []
            calls: dict[int, ta.ToolCallPart] = {}
            async for chunk in self.stream(request):
                if isinstance(chunk, ta.TextDelta):
                    text.append(chunk.text)
                elif isinstance(chunk, ta.ToolCallEnd):
                    calls[chunk.index] = ta.ToolCallPart(chunk.id, chunk.name, chunk.arguments)
            parts: list[Any] = [ta.TextPart("".join(text))] if text else []
            parts += [calls[index] for index in sorted(calls)]
            calls_out = [(call.id, call.name, call.arguments) for call in calls.values()]
            record(("model_attempt_completed", turn, "".join(text), calls_out))
            history.append(ta.AssistantMessage(tuple(parts)))
            if not calls:
                record(("turn_completed", turn))
                record(("request_completed", "".join(text)))
                return "".join(text)
            for index in sorted(calls):
                call = calls[index]
                input = json.loads(call.arguments)
                record(("tool_scheduled", call.id, call.name, input))
                arguments = AddInput(**input)
                record(("tool_started", call.id))
                output = await self.tool(arguments.a, arguments.b)
                record(("tool_completed", call.id, output))
                history.append(ta.ToolResultMessage(call.id, json.dumps(output)))
            record(("turn_completed", turn))


@asynccontextmanager
async def open_layered_floor(model: TestModel) -> AsyncIterator[Send]:
    yield LayeredFloorSession(model).send


CONFIGS: dict[str, Opener] = {"agent": open_agent, "floor": open_floor, "floor_layered": open_layered_floor}
LABELS = {
    "agent": "trio_agent session.send",
    "floor": "floor: hand-written loop",
    "floor_layered": "floor + 3 layers + list",
}


# -- measuring ----------------------------------------------------------------------------------------------


class GcTimer:
    """Wall time spent in garbage collection (``gc.callbacks``), for the share of each measurement."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


GC = GcTimer()


@attrs.define
class Sample:
    """One timed measurement: ``requests`` requests in ``wall`` seconds, ``cpu`` process seconds."""

    requests: int
    wall: float
    cpu: float
    gc: float
    latencies: list[float] = attrs.Factory(list)  # seconds, one per request


async def time_sequential(opener: Opener, requests: int) -> Sample:
    model = TestModel(respond=respond)
    async with opener(model) as send:
        assert await send(PROMPT) == "done"  # warm-up: the session's first request is not timed
        model.requests.clear()
        gc.collect()
        latencies: list[float] = []
        gc0, cpu0, start = GC.total, time.process_time(), time.perf_counter()
        for _ in range(requests):
            began = time.perf_counter()
            assert await send(PROMPT) == "done"
            latencies.append(time.perf_counter() - began)
        wall, cpu, spent_gc = time.perf_counter() - start, time.process_time() - cpu0, GC.total - gc0
    return Sample(requests, wall, cpu, spent_gc, latencies)


async def time_concurrent(opener: Opener, sessions: int, per_session: int) -> Sample:
    """``sessions`` sessions opened (and warmed by one request each) untimed; then all send together."""
    model = TestModel(respond=respond)
    latencies: list[float] = []
    state = {"ready": 0, "finished": 0, "end": 0.0}
    all_ready, go, all_done, release = trio.Event(), trio.Event(), trio.Event(), trio.Event()

    async def one_session() -> None:
        async with opener(model) as send:
            assert await send(PROMPT) == "done"
            state["ready"] += 1
            if state["ready"] == sessions:
                all_ready.set()
            await go.wait()
            for _ in range(per_session):
                began = time.perf_counter()
                assert await send(PROMPT) == "done"
                latencies.append(time.perf_counter() - began)
            state["finished"] += 1
            if state["finished"] == sessions:
                state["end"] = time.perf_counter()
                all_done.set()
            await release.wait()  # no session closes while others are still timed

    async with trio.open_nursery() as nursery:
        for _ in range(sessions):
            nursery.start_soon(one_session)
        await all_ready.wait()
        model.requests.clear()
        gc.collect()
        gc0, cpu0, start = GC.total, time.process_time(), time.perf_counter()
        go.set()
        await all_done.wait()
        cpu, spent_gc = time.process_time() - cpu0, GC.total - gc0
        release.set()
    model.requests.clear()
    return Sample(sessions * per_session, state["end"] - start, cpu, spent_gc, latencies)


async def time_long_session(opener: Opener, earlier: int, requests: int) -> Sample:
    """Requests ``earlier + 1 ..`` of one session; the earlier ones run untimed."""
    model = TestModel(respond=respond)
    async with opener(model) as send:
        for index in range(earlier):
            assert await send(PROMPT) == "done"
            if index % 500 == 499:
                model.requests.clear()
        model.requests.clear()
        gc.collect()
        gc0, cpu0, start = GC.total, time.process_time(), time.perf_counter()
        for _ in range(requests):
            assert await send(PROMPT) == "done"
        wall, cpu, spent_gc = time.perf_counter() - start, time.process_time() - cpu0, GC.total - gc0
    return Sample(requests, wall, cpu, spent_gc, [wall / requests])


async def time_checkpoint(calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await trio.lowlevel.checkpoint()
    return (time.perf_counter() - start) / calls * 1e6


async def verify() -> dict[str, int]:
    """The agent really runs the workload: 3 + 3 layers entered, one tool call, the journal written."""
    entered = {"model": 0, "tool": 0}

    class CountingStream(ta.ModelMiddleware):
        async def wrap_stream(self, request: ta.ModelRequest, call_next: Any) -> AsyncIterator[ta.StreamChunk]:
            entered["model"] += 1
            async for chunk in call_next(request):
                yield chunk

    async def counting_tool(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        entered["tool"] += 1
        return await call_next()

    model = TestModel(respond=respond)
    middleware = ta.MiddlewareConfig(model=[CountingStream() for _ in range(LAYERS)], tool=[counting_tool] * LAYERS)
    async with ta.open_session(provider=model, tools=[add], middleware=middleware) as session:
        head = await session.journal.store.head(session.journal.stream_id())
        assert await session.send(PROMPT) == "done"
        events = await session.journal.store.read(session.journal.stream_id(), after=head)
        kinds = [type(envelope.event).__name__ for envelope in events]
        history = list(session.messages())
    assert entered == {"model": 2 * LAYERS, "tool": LAYERS}, entered
    assert len(model.requests) == 2 and {"ToolCompleted", "RequestCompleted"} <= set(kinds), kinds
    floor = FloorSession(TestModel(respond=respond))
    assert await floor.send(PROMPT) == "done"
    shape = [type(message).__name__ for message in history]
    assert shape == [type(message).__name__ for message in floor.history], (shape, floor.history)
    assert isinstance(history[2], ta.ToolResultMessage) and history[2].content == "3", history
    return {"journal_events_per_request": len(kinds)}


def _rotate(names: list[str], by: int) -> list[str]:
    by %= len(names)
    return names[by:] + names[:by]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    checks = await verify()
    names = list(CONFIGS)
    seq: dict[str, list[Sample]] = {name: [] for name in names}
    conc: dict[tuple[str, int], list[Sample]] = {(name, s): [] for name in names for s in args.sessions}
    for name in names:  # warm-up
        await time_sequential(CONFIGS[name], 20)
    checkpoints: list[float] = []
    for round_index in range(args.rounds):
        note(f"round {round_index + 1}/{args.rounds}: sequential, {args.requests} requests")
        for name in _rotate(names, round_index):
            seq[name].append(await time_sequential(CONFIGS[name], args.requests))
        for sessions, per_session in zip(args.sessions, args.per_session, strict=True):
            note(f"round {round_index + 1}/{args.rounds}: {sessions} concurrent sessions")
            for name in _rotate(names, round_index):
                conc[(name, sessions)].append(await time_concurrent(CONFIGS[name], sessions, per_session))
        checkpoints.append(await time_checkpoint(5000))
    long: dict[str, Sample] = {}
    if args.long_after:
        for name in ("agent", "floor"):
            note(f"long session ({name}): {args.requests} requests after {args.long_after}")
            long[name] = await time_long_session(CONFIGS[name], args.long_after, args.requests)
    return {"seq": seq, "conc": conc, "long": long, "checkpoint_us": statistics.median(checkpoints), **checks}


# -- peers (asyncio; python-peers.md §4.3) ---------------------------------------------------------------------


def pydantic_ai_available() -> bool:
    return importlib.util.find_spec("pydantic_ai") is not None


def measure_pydantic_ai(args: argparse.Namespace) -> dict[str, Any]:
    """pydantic-ai's ``Agent.run`` with ``FunctionModel`` and 3 pass-through capabilities, under asyncio."""
    from dataclasses import dataclass

    import pydantic_ai
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    async def model_fn(messages: list[Any], info: AgentInfo) -> ModelResponse:
        await asyncio.sleep(0)  # one checkpoint, like the Trio test model
        if any(isinstance(part, ToolReturnPart) for part in messages[-1].parts):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("add", {"a": 1, "b": 2}, tool_call_id="call_1")])

    entered = {"model": 0, "tool": 0}

    @dataclass
    class Passthrough(AbstractCapability[Any]):
        id: str = "p"
        count: bool = False

        async def wrap_model_request(self, ctx: Any, *, request_context: Any, handler: Any) -> Any:
            if self.count:
                entered["model"] += 1
            return await handler(request_context)

        async def wrap_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any) -> Any:
            if self.count:
                entered["tool"] += 1
            return await handler(args)

    def make_agent(count: bool) -> Any:
        agent = Agent(FunctionModel(model_fn), capabilities=[Passthrough(id=f"p{i}", count=count) for i in range(3)])

        @agent.tool_plain
        async def add(a: int, b: int) -> int:
            await asyncio.sleep(0)
            return a + b

        return agent

    agent = make_agent(False)

    async def run_one() -> None:
        result = await agent.run(PROMPT)
        assert result.output == "done", result.output

    async def sequential(requests: int) -> Sample:
        await run_one()
        gc.collect()
        latencies: list[float] = []
        gc0, cpu0, start = GC.total, time.process_time(), time.perf_counter()
        for _ in range(requests):
            began = time.perf_counter()
            await run_one()
            latencies.append(time.perf_counter() - began)
        wall = time.perf_counter() - start
        return Sample(requests, wall, time.process_time() - cpu0, GC.total - gc0, latencies)

    async def concurrent(sessions: int, per_session: int) -> Sample:
        latencies: list[float] = []

        async def one_session() -> None:
            for _ in range(per_session):
                began = time.perf_counter()
                await run_one()
                latencies.append(time.perf_counter() - began)

        gc.collect()
        gc0, cpu0, start = GC.total, time.process_time(), time.perf_counter()
        await asyncio.gather(*(one_session() for _ in range(sessions)))
        wall = time.perf_counter() - start
        return Sample(sessions * per_session, wall, time.process_time() - cpu0, GC.total - gc0, latencies)

    async def main() -> dict[str, Any]:
        checked = make_agent(True)
        result = await checked.run(PROMPT)
        assert result.output == "done" and entered == {"model": 2 * LAYERS, "tool": LAYERS}, (result, entered)
        await sequential(10)  # warm-up
        seq: list[Sample] = []
        conc: dict[int, list[Sample]] = {s: [] for s in args.sessions}
        for peer_round in range(args.peer_rounds):
            note(f"peer pydantic-ai: round {peer_round + 1}/{args.peer_rounds}")
            seq.append(await sequential(args.peer_requests))
            for sessions, per_session in zip(args.sessions, args.peer_per_session, strict=True):
                conc[sessions].append(await concurrent(sessions, per_session))
        return {"version": pydantic_ai.__version__, "seq": seq, "conc": conc}

    return asyncio.run(main())


# -- report -------------------------------------------------------------------------------------------------


def summarise(samples: list[Sample]) -> dict[str, float]:
    """Medians over rounds (CPU and wall µs/request, req/s, req per CPU-second, GC share); latency pooled."""
    latencies = sorted(value for sample in samples for value in sample.latencies)

    def quantile(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e6

    return {
        "cpu_us": statistics.median(s.cpu / s.requests * 1e6 for s in samples),
        "wall_us": statistics.median(s.wall / s.requests * 1e6 for s in samples),
        "rps": statistics.median(s.requests / s.wall for s in samples),
        "cpu_rps": statistics.median(s.requests / max(s.cpu, 1e-9) for s in samples),
        "gc": statistics.median(s.gc / s.wall for s in samples),
        "p50": quantile(0.5),
        "p99": quantile(0.99),
    }


def print_table(title: str, rows: list[tuple[str, dict[str, float]]], floor: dict[str, float]) -> None:
    print(title)
    print(
        f"{'configuration':<30}{'CPU us/req':>11}{'x floor':>8}{'wall us/req':>12}{'x floor':>8}{'req/s':>8}"
        f"{'req/CPU-s':>10}{'GC %':>6}{'lat p50 us':>12}{'lat p99 us':>12}"
    )
    for label, s in rows:
        print(
            f"{label:<30}{s['cpu_us']:>11.1f}{s['cpu_us'] / floor['cpu_us']:>8.2f}{s['wall_us']:>12.1f}"
            f"{s['wall_us'] / floor['wall_us']:>8.2f}{s['rps']:>8.0f}{s['cpu_rps']:>10.0f}{s['gc'] * 100:>6.1f}"
            f"{s['p50']:>12.0f}{s['p99']:>12.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="quick run for smoke tests")
    parser.add_argument("--requests", type=int, default=None, help="sequential requests per round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-peers", action="store_true", help="skip the asyncio peers even when installed")
    add_progress_option(parser)
    args = parser.parse_args(argv)
    start_progress("agent_turn", args)
    short = args.short
    args.requests = args.requests or (30 if short else 200)
    args.rounds = args.rounds or (1 if short else 5)
    # Short mode keeps the shapes but not the sizes: opening 1,000 sessions alone takes seconds here.
    args.sessions = (20, 100) if short else (100, 1000)
    args.per_session = (2, 1) if short else (10, 2)
    args.long_after = 100 if short else 2000
    args.peer_rounds = 1 if short else 2
    args.peer_requests = 10 if short else 100
    args.peer_per_session = (1, 1) if short else (5, 1)

    started = time.perf_counter()
    raw = trio.run(measure, args)
    peer: dict[str, Any] | None = None
    skipped: list[str] = []
    if args.no_peers:
        skipped.append("pydantic-ai (--no-peers)")
    elif pydantic_ai_available():
        peer = measure_pydantic_ai(args)
    else:
        skipped.append("pydantic-ai (not installed; pip install pydantic-ai-slim to include it)")
    elapsed = time.perf_counter() - started

    small, large = args.sessions
    shapes: list[tuple[str, str, dict[str, dict[str, float]]]] = [
        (
            "seq",
            f"sequential: one session, {args.requests} requests in a row",
            {name: summarise(samples) for name, samples in raw["seq"].items()},
        ),
        (
            "conc_small",
            f"{small} concurrent sessions x {args.per_session[0]} requests each (all started together)",
            {name: summarise(raw["conc"][(name, small)]) for name in CONFIGS},
        ),
        (
            "conc_large",
            f"{large} concurrent sessions x {args.per_session[1]} requests each (all started together)",
            {name: summarise(raw["conc"][(name, large)]) for name in CONFIGS},
        ),
    ]
    peer_summary: dict[str, dict[str, float]] = {}
    if peer is not None:
        peer_summary = {
            "seq": summarise(peer["seq"]),
            "conc_small": summarise(peer["conc"][small]),
            "conc_large": summarise(peer["conc"][large]),
        }

    print(
        f"agent turn: prompt -> model (1 tool call) -> tool -> model -> answer; {LAYERS} pass-through layers on "
        f"model and tool; trio {trio.__version__}, Python {sys.version.split()[0]}"
    )
    print(
        f"{args.rounds} rounds (median); Trio runs on one thread, so the process uses one core: req/CPU-s is "
        "requests/s per core (CPU figures are robust to other load on this machine, wall figures are not)"
    )
    print(
        f"trio_agent writes {raw['journal_events_per_request']} journal events per request (in-memory store); "
        f"a trio checkpoint costs {raw['checkpoint_us']:.2f} us here"
    )
    print()
    for key, title, table in shapes:
        rows = [(LABELS[name], table[name]) for name in CONFIGS]
        if peer is not None:
            per = {"conc_small": f" x{args.peer_per_session[0]}", "conc_large": f" x{args.peer_per_session[1]}"}
            rows.append((f"pydantic-ai {peer['version']} (asyncio){per.get(key, '')}", peer_summary[key]))
        print_table(title, rows, table["floor"])
        print()

    long: dict[str, Sample] = raw["long"]
    if long:
        seq_table = shapes[0][2]
        print(f"long session: {args.requests} requests after {args.long_after} earlier ones in the same session")
        print(f"{'configuration':<30}{'CPU us/req':>11}{'x floor':>8}{'x its seq':>10}")
        for name in ("agent", "floor"):
            value = long[name].cpu / long[name].requests * 1e6
            floor_value = long["floor"].cpu / long["floor"].requests * 1e6
            print(
                f"{LABELS[name]:<30}{value:>11.1f}{value / floor_value:>8.2f}{value / seq_table[name]['cpu_us']:>10.2f}"
            )
        print()

    ratios = {key: table["agent"]["cpu_us"] / table["floor"]["cpu_us"] for key, _, table in shapes}
    for key, _, table in shapes:
        if ratios[key] <= TARGET_RATIO:
            verdict = f"target met (<= {TARGET_RATIO:g}x)"
        else:
            verdict = (
                f"open target: {ratios[key]:.1f}x against a target of <= {TARGET_RATIO:g}x (the floor is a "
                "hand-written loop over the same model and tools; session.send adds the journal, the request "
                "queue, hooks, permissions and the tool pipeline)"
            )
        print(
            f"{key:<11} agent {table['agent']['cpu_us']:7.1f} CPU us/req = {ratios[key]:5.1f}x the floor "
            f"({table['floor']['cpu_us']:.1f} us): {verdict}; "
            f"{table['agent']['cpu_rps']:.0f} req/s per core (floor {table['floor']['cpu_rps']:.0f})"
        )
    if skipped:
        print(f"peers skipped: {', '.join(skipped)}")
    print(f"(ran in {elapsed:.1f} s)")

    figures: dict[str, Any] = {
        "benchmark": "agent_turn",
        "rounds": args.rounds,
        "layers": LAYERS,
        "seq_requests": args.requests,
        "conc_small_sessions": small,
        "conc_large_sessions": large,
        "journal_events_per_request": raw["journal_events_per_request"],
        "cores_used": 1,
        "checkpoint_us": round(raw["checkpoint_us"], 3),
        "target_ratio": TARGET_RATIO,
    }
    for key, _, table in shapes:
        for name, prefix in (("agent", "agent"), ("floor", "direct"), ("floor_layered", "direct_layered")):
            s = table[name]
            figures[f"{prefix}_{key}_cpu_us_per_request"] = round(s["cpu_us"], 2)
            figures[f"{prefix}_{key}_wall_us_per_request"] = round(s["wall_us"], 2)
            figures[f"{prefix}_{key}_requests_per_s"] = round(s["rps"], 1)
            figures[f"{prefix}_{key}_requests_per_s_per_core"] = round(s["cpu_rps"], 1)
            figures[f"{key}_gc_share_{name}"] = round(s["gc"], 3)  # may be 0.0: not a "direct" key
        figures[f"agent_{key}_latency_p50_us"] = round(table["agent"]["p50"], 1)
        figures[f"agent_{key}_latency_p99_us"] = round(table["agent"]["p99"], 1)
        figures[f"ratio_{key}_vs_floor"] = round(ratios[key], 2)
        figures[f"ratio_{key}_vs_floor_wall"] = round(table["agent"]["wall_us"] / table["floor"]["wall_us"], 2)
        figures[f"ratio_{key}_vs_layered_floor"] = round(table["agent"]["cpu_us"] / table["floor_layered"]["cpu_us"], 2)
        figures[f"{key}_within_target"] = ratios[key] <= TARGET_RATIO
    if long:
        figures["long_session_after"] = args.long_after
        figures["agent_long_session_cpu_us_per_request"] = round(long["agent"].cpu / long["agent"].requests * 1e6, 2)
        figures["direct_long_session_cpu_us_per_request"] = round(long["floor"].cpu / long["floor"].requests * 1e6, 2)
    figures["pydantic_ai_version"] = None if peer is None else peer["version"]
    for key, s in peer_summary.items():
        figures[f"pydantic_ai_{key}_cpu_us_per_request"] = round(s["cpu_us"], 2)
        figures[f"pydantic_ai_{key}_wall_us_per_request"] = round(s["wall_us"], 2)
        figures[f"pydantic_ai_{key}_requests_per_s_per_core"] = round(s["cpu_rps"], 1)
    figures["peers_skipped"] = skipped
    figures["all_within_target"] = all(within for within in (ratios[key] <= TARGET_RATIO for key in ratios))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
