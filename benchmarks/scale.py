"""N concurrent sessions, each serving one request, against a hand-written Trio floor (issue 17).

Issue 17 asks for "10,000 concurrent sessions without collapse". This script opens N sessions of one
`define_agent` spec at once (default N = 100, 1,000 and 10,000; ``--short``: 50 and 200), lets every
session send its request(s) together, then closes them all, and reports what that costs.

The workload of one request is the one of ``benchmarks/agent_turn.py``: the model answers the prompt
with one tool call ``add(a=1, b=2)`` (a ``pure`` tool that passes one checkpoint), the tool returns 3, the
model answers ``"done"``, only when add's result is 3 and no tool result of the turn is an error
(otherwise "the tool failed: ...", a violation below). The model is `trio_agent.testing.TestModel` with
``respond=``: every reply has a latency (``Reply(latency=...)``, a ``trio.sleep``) of ``--latency-ms`` (5 ms)
with a uniform jitter of ``--jitter`` (±20%), drawn from a seeded RNG in call order. The model does not
record its requests (10,000 sessions would keep 20,000 request objects alive otherwise).

Each N runs, in this order, with the sessions of one run all alive at once:
  - floor (the "direct" figures): a hand-written Trio loop doing the same N concurrent requests with the
    same latencies: ``trio.sleep`` for the model, the tool function awaited (its result checked, as the
    agent's model checks it), ``trio.sleep`` again; no session, no journal. Timed from "go" (all tasks
    started and waiting) until the last request ended.
    It is the CPU-bound ideal the agent is compared with (the ratio is agent wall / floor wall);
  - agent, variant ``plain``: N sessions (``open_session(spec, journal=...)``) each opened (phase
    "open", all at once), then every session sends its ``--requests`` request(s) one after the other,
    all sessions together (phase "requests"; per-request latency is the time ``session.send`` took),
    then every session closes (phase "close"). "total" is open + requests + close;
  - agent, variant ``mixed``: the same with ``--subagent-fraction`` (10%) of the sessions asking for a
    background subagent (the model calls the built-in ``task`` tool with ``background: true`` beside
    ``add``; the session waits for the subagent's handle before it counts as finished) and
    ``--abort-fraction`` (10%) of the requests aborted with ``session.abort()`` at a random moment
    (uniform in [0, 2.5 x latency] after the send). An abort that comes after the request ended, or
    before it started running, does nothing and the request completes: ``abort()`` acts on the running
    request only, and under load a request waits (accepted, not yet running) for a long time, so at large
    N most aborts miss; the table shows aborted / called. The floor of this variant mirrors it: an extra sleeping task
    per subagent, a ``move_on_after`` at the same moment per abort. Which sessions and requests are
    chosen is seeded (``--seed``).

The journal: ``--journal memory`` (the default: a ``MemoryStore`` per session, what ``journal=None``
gives), ``sqlite`` (one SQLite store shared by every session of a run, a new file per run in a temporary
directory, as a server would share one) or ``both``.

Reported per N and run: wall seconds per phase, the ratio to the floor, requests/s (over the requests
phase), latency p50/p99 per request, GC share of the wall (``gc.callbacks`` timing over the whole run),
CPU seconds (``time.process_time``, the whole process: with SQLite the writer thread's too), peak RSS so
far (``ru_maxrss``: it only grows, so a row includes every earlier run), Trio tasks per session while the
sessions sit idle after their request (the task tree walked from the root task, minus the one task per
session this harness uses to hold it open), aborted requests, subagents started, and leases lost
(`trio_agent.LeaseLostError` seen by any session, from ``send`` or from its ``open_session`` block).

Then, in a separate phase (``--idle-sessions``, default 1,000; ``--short`` 200; 0 skips it), heap per idle
session: that many sessions are opened, each serves one request, then all sit idle; measured with
``tracemalloc`` on (which slows everything a lot, hence the smaller N) after ``gc.collect()``: traced bytes,
GC-tracked objects (``len(gc.get_objects())``) and Trio tasks, as deltas over the same harness holding a
do-nothing stand-in instead of a session, divided by N.

Invariant check, after every agent run: every session opened and closed without an error; every request
``send`` returned ``"done"`` (so its tools worked) or raised `RequestAbortedError`; in the journal (memory:
each session's store; SQLite: the file reopened after the store closed) every stream of the session ends with
``session_closed``, every accepted request has ``request_completed`` or ``request_interrupted`` (a
``request_failed`` is a violation), every scheduled tool call is settled and none ``tool_failed`` (the
workload's tools never fail: a failed call is the tool path broken), every subagent started is
recorded completed or cancelled, and the journal's counts match what the callers saw; and the Trio
task count is back to its baseline once the sessions closed. It prints ``invariants: ok`` or the
violations, and the script exits with status 1 when any was found. WARNING records logged by trio_agent
are counted and shown (not violations).

Targets (issue 17; printed as a verdict, never asserted): at 10,000 sessions (memory journal, plain
variant) total wall <= 10 s, GC <= 20% of the wall, heap <= 16 KiB and <= 1 Trio task per idle session,
no lease lost, the invariant check clean. Trio runs on one thread, so the process uses one core.

``--gc-freeze`` calls ``gc.collect(); gc.freeze()`` after start-up (imports, specs, a warm-up request):
the application-level option docs/performance.md measures (the objects alive then are never scanned
again by the cyclic GC). ``--gc-threshold N`` sets the young generation's threshold (Python's default
is 700 allocations): the other knob measured there.

Prints a table and, as the last line, one JSON object (``"benchmark": "scale"``; the floor's figures
are the keys with "direct"). ``--sessions 10000`` runs only the sizes given; ``--variants plain`` only
that variant. ``--progress`` (the default when stderr is a terminal) writes a line per phase to stderr;
see ``_progress.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import random
import resource
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing
from _gc import GC
from _progress import add_progress_option, note, start_progress
from _workload import ADD_CALL, ADD_RESULT, PROMPT, add, add_numbers, turn_failure

import trio_agent as ta
from trio_agent import journal as tj
from trio_agent.testing import Reply, TestModel

PROMPT_WITH_HELPER = "add 1 and 2, and start a helper in the background"
HELPER_PROMPT = "check the sum"
HELPER = ta.SubagentDefinition(name="helper", description="Checks a sum.", system_prompt="Check sums.", tools=[])

TARGET_SESSIONS = 10_000
TARGET_WALL_S = 10.0
TARGET_GC_SHARE = 0.20
TARGET_HEAP_BYTES = 16 * 1024
TARGET_TASKS = 1.0
VARIANTS = ("plain", "mixed")

# -- the workload -------------------------------------------------------------------------------------------


EXPECTED = {"add": ADD_RESULT}  # what a working tool returns; any tool's error result is a failure too
TASK_CALL = ("task", {"subagent": HELPER.name, "prompt": HELPER_PROMPT, "background": True})


class Latency:
    """Model latency: ``base`` seconds times a uniform factor in [1 - jitter, 1 + jitter], seeded."""

    def __init__(self, base: float, jitter: float, seed: int) -> None:
        self.base = base
        self.jitter = jitter
        self.seed = seed
        self.rng = random.Random(seed)

    def reset(self) -> None:
        """The same sequence again: every run (floor and agent) draws the same latencies in call order."""
        self.rng = random.Random(self.seed)

    def __call__(self) -> float:
        return self.base * self.rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)


def make_respond(latency: Latency) -> Callable[[ta.ModelRequest], Reply]:
    """The model: the tool call(s) for a prompt; once the tool results are in, "done" only if they worked
    (add returned 3, no result is an error: `_workload.turn_failure`), "the tool failed: ..." otherwise,
    which the invariant check counts; the helper answers its own prompt."""

    def respond(request: ta.ModelRequest) -> Reply:
        seconds = latency()
        messages = request.messages
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if isinstance(message, ta.ToolResultMessage):
                failure = turn_failure(messages, index, EXPECTED)
                return Reply("done" if failure is None else f"the tool failed: {failure}", latency=seconds)
            if isinstance(message, ta.UserMessage):
                if message.content == PROMPT:
                    return Reply(tool_calls=[ADD_CALL], latency=seconds)
                if message.content == PROMPT_WITH_HELPER:
                    return Reply(tool_calls=[ADD_CALL, TASK_CALL], latency=seconds)
                if message.content == HELPER_PROMPT:
                    return Reply("checked", latency=seconds)
                # else: a background subagent's note joined the conversation; look further back
        raise AssertionError(f"unexpected conversation: {request.messages!r}")

    return respond


class _Unrecorded(list[ta.ModelRequest]):
    """``TestModel.requests`` that keeps nothing: 10,000 sessions would keep every request alive."""

    def append(self, request: ta.ModelRequest) -> None:
        pass


def make_model(latency: Latency) -> TestModel:
    model = TestModel(respond=make_respond(latency))
    model.requests = _Unrecorded()
    return model


@attrs.frozen
class Plan:
    """One session's script: whether it starts a helper subagent, and per request an abort delay or None."""

    helper: bool
    aborts: tuple[float | None, ...]


def make_plans(n: int, variant: str, args: argparse.Namespace) -> list[Plan]:
    if variant == "plain":
        return [Plan(False, (None,) * args.requests)] * n
    rng = random.Random(args.seed * 1_000_003 + n)
    latency = args.latency_ms / 1000
    plans: list[Plan] = []
    for _ in range(n):
        helper = rng.random() < args.subagent_fraction
        aborts = tuple(
            rng.uniform(0.0, 2.5 * latency) if rng.random() < args.abort_fraction else None
            for _ in range(args.requests)
        )
        plans.append(Plan(helper, aborts))
    return plans


# -- measuring ----------------------------------------------------------------------------------------------


class WarningCounter(logging.Handler):
    """WARNING and above from the ``trio_agent`` loggers (abandoned clean-ups, overruns...)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


WARNINGS = WarningCounter()


class Barrier:
    """Set once ``n`` tasks arrived; remembers when."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.event = trio.Event()
        self.at = 0.0
        if n <= 0:
            self._set()

    def _set(self) -> None:
        self.at = time.perf_counter()
        self.event.set()

    def arrive(self) -> None:
        self.left -= 1
        if self.left == 0:
            self._set()

    async def wait(self) -> None:
        await self.event.wait()


def all_tasks() -> list[trio.lowlevel.Task]:
    """Every Trio task of the run: the tree below the root task, through every child nursery."""
    root = trio.lowlevel.current_root_task()
    assert root is not None
    tasks, stack = [], [root]
    while stack:
        task = stack.pop()
        tasks.append(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return tasks


def count_tasks() -> int:
    return len(all_tasks())


def task_names() -> Counter[str]:
    return Counter(task.name for task in all_tasks())


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 / 1024 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


@attrs.define
class Run:
    """One run: N sessions (or floor tasks) of one variant and journal."""

    kind: str  # "floor" or "agent"
    variant: str
    journal: str  # "" for the floor
    n: int
    requests: int
    open_s: float = 0.0
    request_s: float = 0.0
    close_s: float = 0.0
    cpu_s: float = 0.0
    gc_s: float = 0.0
    gc_full: int = 0
    latencies: list[float] = attrs.Factory(list)
    completed: int = 0
    aborted: int = 0
    abort_calls: int = 0
    helpers: int = 0
    leases_lost: int = 0
    tasks_per_session: float = math.nan
    peak_rss_mib: float = 0.0
    warnings: int = 0
    violations: list[str] = attrs.Factory(list)

    @property
    def total_s(self) -> float:
        return self.open_s + self.request_s + self.close_s

    @property
    def label(self) -> str:
        return f"direct floor, {self.variant}" if self.kind == "floor" else f"agent {self.variant}, {self.journal}"

    def quantile(self, q: float) -> float:
        values = sorted(self.latencies)
        return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


class Meter:
    """Wall, CPU and GC time from `start` to `stop`."""

    def start(self) -> None:
        self.gc0, self.full0, self.cpu0 = GC.total, GC.full, time.process_time()

    def stop(self, run: Run) -> None:
        run.cpu_s = time.process_time() - self.cpu0
        run.gc_s = GC.total - self.gc0
        run.gc_full = GC.full - self.full0


# -- the floor: the same concurrent requests by hand ---------------------------------------------------------


async def run_floor(n: int, variant: str, plans: Sequence[Plan], latency: Latency, requests: int) -> Run:
    run = Run("floor", variant, "", n, requests)
    latency.reset()
    ready, done, go = Barrier(n), Barrier(n), trio.Event()

    async def helper() -> None:
        await trio.sleep(latency())  # the subagent's one model call

    async def serve(plan: Plan, helpers: trio.Nursery | None) -> None:
        for index, delay in enumerate(plan.aborts):
            began = time.perf_counter()
            with trio.move_on_after(math.inf if delay is None else delay) as scope:
                await trio.sleep(latency())  # the model's tool call
                if helpers is not None and index == 0:
                    helpers.start_soon(helper)
                    run.helpers += 1
                if await add_numbers(1, 2) != 3:  # the agent's model checks the tool's result too
                    raise AssertionError("add(1, 2) did not return 3")
                await trio.sleep(latency())  # the model's answer
            run.latencies.append(time.perf_counter() - began)
            if scope.cancelled_caught:
                run.aborted += 1
                run.abort_calls += 1
            else:
                run.completed += 1

    async def one(plan: Plan) -> None:
        ready.arrive()
        await go.wait()
        if plan.helper:
            async with trio.open_nursery() as helpers:
                await serve(plan, helpers)
        else:
            await serve(plan, None)
        done.arrive()

    gc.collect()
    meter = Meter()
    async with trio.open_nursery() as nursery:
        for plan in plans:
            nursery.start_soon(one, plan)
        await ready.wait()
        meter.start()
        start = time.perf_counter()
        go.set()
        await done.wait()
        run.request_s = done.at - start
        meter.stop(run)
    run.peak_rss_mib = peak_rss_mib()
    return run


# -- the agent -----------------------------------------------------------------------------------------------


@attrs.define
class SessionRecord:
    """What one session's caller saw, for the invariant check."""

    index: int
    session_id: str
    store: Any = None  # the memory store to read afterwards (memory journal only)
    completed: int = 0
    aborted: int = 0
    abort_calls: int = 0  # session.abort() called while the send was still waiting
    errors: list[str] = attrs.Factory(list)
    lease_lost: bool = False
    closed: bool = False


async def send_one(session: ta.Session, prompt: str, delay: float | None, record: SessionRecord) -> None:
    """One request; with a delay, ``session.abort()`` that many seconds after it was sent."""

    def outcome(answer: str) -> None:
        if answer == "done":
            record.completed += 1
        else:
            record.errors.append(f"send returned {answer!r}")

    try:
        if delay is None:
            outcome(await session.send(prompt))
            return
        waiting = trio.CancelScope()

        async def abort_later() -> None:
            with waiting:
                await trio.sleep(delay)
            if not waiting.cancelled_caught:
                record.abort_calls += 1
                await session.abort()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abort_later)
            try:
                outcome(await session.send(prompt))
            except ta.RequestAbortedError:
                record.aborted += 1
            finally:
                waiting.cancel()  # too late to abort: the request ended (an abort already under way finishes)
    except ta.RequestAbortedError:
        record.errors.append("RequestAbortedError without an abort")
    except ta.LeaseLostError as exc:
        record.lease_lost = True
        record.errors.append(f"LeaseLostError from send: {exc}")
    except Exception as exc:  # reported as a violation, the run goes on
        record.errors.append(f"{type(exc).__name__} from send: {exc}")


async def run_agent(
    n: int,
    variant: str,
    journal_name: str,
    plans: Sequence[Plan],
    spec: ta.AgentSpec,
    store: Any,
    latency: Latency,
    args: argparse.Namespace,
) -> tuple[Run, list[SessionRecord]]:
    """N sessions: all opened, then all send their requests together, then all closed."""
    run = Run("agent", variant, journal_name, n, args.requests)
    latency.reset()
    records = [SessionRecord(index, f"scale-{variant}-{n}-{index}") for index in range(n)]
    opened, done = Barrier(n), Barrier(n)
    go, release = trio.Event(), trio.Event()
    warnings0 = len(WARNINGS.records)

    async def one(plan: Plan, record: SessionRecord) -> None:
        arrived = finished = False
        try:
            async with ta.open_session(spec, journal=store, session_id=record.session_id) as session:
                if store is None:
                    record.store = session.journal.store
                opened.arrive()
                arrived = True
                await go.wait()
                for index, delay in enumerate(plan.aborts):
                    prompt = PROMPT_WITH_HELPER if plan.helper and index == 0 else PROMPT
                    began = time.perf_counter()
                    await send_one(session, prompt, delay, record)
                    run.latencies.append(time.perf_counter() - began)
                for handle in list(session.subagents.values()):
                    await handle.wait()
                run.helpers += len(session.subagents)
                done.arrive()
                finished = True
                await release.wait()  # no session closes before every session finished
            record.closed = True
        except ta.LeaseLostError as exc:
            record.lease_lost = True
            record.errors.append(f"LeaseLostError from the session block: {exc}")
        except Exception as exc:
            record.errors.append(f"{type(exc).__name__} from the session block: {exc}")
        finally:
            if not arrived:
                opened.arrive()
            if not finished:
                done.arrive()

    gc.collect()
    baseline_tasks = count_tasks()
    meter = Meter()
    meter.start()
    start = time.perf_counter()
    with trio.move_on_after(args.run_timeout) as deadline:
        async with trio.open_nursery() as nursery:
            for plan, record in zip(plans, records, strict=True):
                nursery.start_soon(one, plan, record)
            await opened.wait()
            note(f"{n} sessions ({variant}, {journal_name}): opened in {opened.at - start:.1f} s; sending")
            go.set()
            await done.wait()
            # Every session is idle now (its requests and subagents finished); each still holds one task of
            # this harness (`one`), which is not the library's.
            run.tasks_per_session = (count_tasks() - baseline_tasks - n) / n
            note(f"{n} sessions ({variant}, {journal_name}): requests done in {done.at - opened.at:.1f} s; closing")
            release.set()
    end = time.perf_counter()
    all_open, all_done = opened.at or end, done.at or end  # `or end`: a run cut short by --run-timeout
    run.open_s, run.request_s, run.close_s = all_open - start, all_done - all_open, end - all_done
    meter.stop(run)
    run.peak_rss_mib = peak_rss_mib()
    if deadline.cancelled_caught:
        run.violations.append(f"the run did not finish within --run-timeout {args.run_timeout:g} s (cancelled)")
    left = count_tasks() - baseline_tasks
    if left:
        run.violations.append(f"{left} task(s) left over after every session closed")
    run.completed = sum(record.completed for record in records)
    run.aborted = sum(record.aborted for record in records)
    run.abort_calls = sum(record.abort_calls for record in records)
    run.leases_lost = sum(record.lease_lost for record in records)
    run.warnings = len(WARNINGS.records) - warnings0
    return run, records


# -- the invariant check ---------------------------------------------------------------------------------------

ENDED_REQUEST = (tj.RequestCompleted, tj.RequestFailed, tj.RequestInterrupted)
SETTLED_CALL = (tj.ToolCompleted, tj.ToolFailed, tj.ToolCancelled, tj.ToolOutcomeUnknown)
ENDED_SUBAGENT = (tj.SubagentCompleted, tj.SubagentCancelled)


async def check_session(store: Any, record: SessionRecord, requests: int) -> list[str]:
    """The caller's view and the journal agree, and the journal left nothing open."""
    where = record.session_id
    problems = [f"{where}: {error}" for error in record.errors]
    if not record.closed:
        problems.append(f"{where}: the session block did not exit cleanly")
    streams = await store.streams(record.session_id)
    root_id = tj.stream_id_for(record.session_id, "root")
    if root_id not in {info.stream_id for info in streams}:
        return [*problems, f"{where}: no root stream in the journal"]
    subagent_streams = 0
    for info in streams:
        events = [envelope.event for envelope in await store.read(info.stream_id)]
        name = info.stream_id
        if not events or not isinstance(events[-1], tj.SessionClosed):
            last = type(events[-1]).__name__ if events else "nothing"
            problems.append(f"{name}: does not end with session_closed (last: {last})")
        accepted = [event.request_id for event in events if isinstance(event, tj.RequestAccepted)]
        ended = {event.request_id: event for event in events if isinstance(event, ENDED_REQUEST)}
        for request_id in accepted:
            outcome = ended.get(request_id)
            if outcome is None:
                problems.append(f"{name}: request {request_id} has no durable outcome")
            elif isinstance(outcome, tj.RequestFailed):
                problems.append(f"{name}: request {request_id} failed: {outcome.error}")
        scheduled = {event.call_id: event.tool_name for event in events if isinstance(event, tj.ToolScheduled)}
        settled = {event.call_id for event in events if isinstance(event, SETTLED_CALL)}
        if scheduled.keys() - settled:
            problems.append(f"{name}: tool calls never settled: {sorted(scheduled.keys() - settled)}")
        # Settled is not enough: the workload's tools never fail, so a failed call is the tool path broken.
        for event in events:
            if isinstance(event, tj.ToolFailed):
                tool = scheduled.get(event.call_id, "?")
                problems.append(f"{name}: tool call {event.call_id} ({tool}) failed: {str(event.result)[:200]}")
        started = {event.subagent_id for event in events if isinstance(event, tj.SubagentStarted)}
        finished = {event.subagent_id for event in events if isinstance(event, ENDED_SUBAGENT)}
        if started - finished:
            problems.append(f"{name}: subagents without a recorded end: {sorted(started - finished)}")
        if name == root_id:
            subagent_streams = len(started)
            completed = sum(isinstance(event, tj.RequestCompleted) for event in ended.values())
            interrupted = sum(isinstance(event, tj.RequestInterrupted) for event in ended.values())
            if len(accepted) != requests:
                problems.append(f"{name}: {len(accepted)} requests accepted, {requests} sent")
            if (completed, interrupted) != (record.completed, record.aborted):
                problems.append(
                    f"{name}: journal says {completed} completed / {interrupted} interrupted, "
                    f"the callers saw {record.completed} / {record.aborted}"
                )
    if len(streams) != 1 + subagent_streams:
        problems.append(f"{where}: {len(streams)} streams for {subagent_streams} subagent(s) started")
    return problems


async def check_run(run: Run, records: Sequence[SessionRecord], sqlite_path: Path | None) -> None:
    if sqlite_path is None:
        for record in records:
            if record.store is None:
                run.violations.append(f"{record.session_id}: never opened")
                continue
            run.violations += await check_session(record.store, record, run.requests)
        return
    async with tj.open_sqlite_store(sqlite_path) as store:  # reopened: what is durable
        for record in records:
            run.violations += await check_session(store, record, run.requests)


# -- idle sessions: heap, objects and tasks per session -------------------------------------------------------


class _StandIn:
    """What the harness holds instead of a session in the baseline pass."""

    async def send(self, prompt: str) -> str:
        await trio.lowlevel.checkpoint()
        return "done"


@asynccontextmanager
async def open_stand_in() -> AsyncIterator[Any]:
    yield _StandIn()


@attrs.define
class Idle:
    journal: str
    n: int
    heap_bytes: float = math.nan
    objects: float = math.nan
    tasks: float = math.nan
    task_kinds: dict[str, float] = attrs.Factory(dict)  # per session, by task name
    violations: list[str] = attrs.Factory(list)


@attrs.frozen
class Held:
    """Deltas while n sessions (or stand-ins) sat idle, and the tasks left once they closed."""

    traced: int
    objects: int
    tasks: Counter[str]
    left: int


async def hold_idle(n: int, opener: Callable[[int], AbstractAsyncContextManager[Any]]) -> Held:
    """Open n, one request each, all idle: deltas of traced bytes, GC objects and tasks (by name)."""
    gc.collect()
    names0, objects0, traced0 = task_names(), len(gc.get_objects()), tracemalloc.get_traced_memory()[0]
    parked, release = Barrier(n), trio.Event()
    failures: list[str] = []

    async def hold(index: int) -> None:
        try:
            async with opener(index) as session:
                answer = await session.send(PROMPT)
                if answer != "done":
                    failures.append(f"idle session {index}: send returned {answer!r}")
                parked.arrive()
                await release.wait()
        except Exception as exc:
            failures.append(f"idle session {index}: {type(exc).__name__}: {exc}")
            parked.arrive()

    async with trio.open_nursery() as nursery:
        for index in range(n):
            nursery.start_soon(hold, index)
        await parked.wait()
        await trio.testing.wait_all_tasks_blocked(0.01)
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - traced0
        objects = len(gc.get_objects()) - objects0
        tasks = task_names()
        tasks.subtract(names0)
        release.set()
    if failures:
        raise RuntimeError("; ".join(failures[:5]))
    return Held(traced, objects, tasks, count_tasks() - names0.total())


async def measure_idle(n: int, journal_name: str, spec: ta.AgentSpec, store: Any) -> Idle:
    idle = Idle(journal_name, n)
    tracemalloc.start()
    try:
        base = await hold_idle(n, lambda index: open_stand_in())
        sessions = await hold_idle(
            n, lambda index: ta.open_session(spec, journal=store, session_id=f"idle-{journal_name}-{index}")
        )
    except RuntimeError as exc:
        idle.violations.append(f"idle phase ({journal_name}): {exc}")
        return idle
    finally:
        tracemalloc.stop()
    idle.heap_bytes = (sessions.traced - base.traced) / n
    idle.objects = (sessions.objects - base.objects) / n
    kinds = sessions.tasks.copy()
    kinds.subtract(base.tasks)
    idle.tasks = kinds.total() / n
    idle.task_kinds = {name: count / n for name, count in kinds.most_common() if count}
    if sessions.left:
        idle.violations.append(f"idle phase ({journal_name}): {sessions.left} task(s) left after the sessions closed")
    return idle


# -- the whole run ---------------------------------------------------------------------------------------------


@asynccontextmanager
async def open_store(journal_name: str, path: Path) -> AsyncIterator[Any]:
    if journal_name == "memory":
        yield None  # open_session(journal=None): a MemoryStore per session
    else:
        async with tj.open_sqlite_store(path) as store:
            yield store


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    latency = Latency(args.latency_ms / 1000, args.jitter, args.seed)
    model = make_model(latency)
    specs = {
        "plain": ta.define_agent(provider=model, tools=[add]),
        "mixed": ta.define_agent(provider=model, tools=[add], subagents=[HELPER]),
    }
    async with ta.open_session(specs["mixed"]) as session:  # warm-up, and the workload is what it claims
        assert await session.send(PROMPT_WITH_HELPER) == "done"
        for handle in list(session.subagents.values()):
            assert await handle.wait() == "checked", handle.error
        messages = session.messages()
        history = [type(message).__name__ for message in messages]
        assert history[:4] == ["UserMessage", "AssistantMessage", "ToolResultMessage", "ToolResultMessage"], history
        assert turn_failure(messages, 3, EXPECTED) is None, messages  # add returned 3, the task call started
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])  # the young generation's size only
    if args.gc_freeze:
        # The application-level option docs/performance.md measures: after start-up (imports, specs,
        # the warm-up), move every object the GC tracks to a generation it never scans again.
        gc.collect()
        gc.freeze()
    floors: dict[tuple[str, int], Run] = {}
    agents: dict[tuple[str, str, int], Run] = {}
    baseline_tasks = count_tasks()
    for n in args.sessions:
        for variant in args.variants:
            plans = make_plans(n, variant, args)
            note(f"{n} sessions ({variant}): floor")
            floors[(variant, n)] = await run_floor(n, variant, plans, latency, args.requests)
            for journal_name in args.journals:
                path = workdir / f"scale-{variant}-{n}.db"
                async with open_store(journal_name, path) as store:
                    run, records = await run_agent(
                        n, variant, journal_name, plans, specs[variant], store, latency, args
                    )
                note(f"{n} sessions ({variant}, {journal_name}): closed in {run.close_s:.1f} s; checking the journal")
                await check_run(run, records, path if journal_name == "sqlite" else None)
                del records
                agents[(journal_name, variant, n)] = run
    idles: list[Idle] = []
    if args.idle_sessions:
        for journal_name in args.journals:
            note(f"idle phase ({journal_name}): {args.idle_sessions} sessions with tracemalloc on")
            async with open_store(journal_name, workdir / "idle.db") as store:
                idles.append(await measure_idle(args.idle_sessions, journal_name, specs["plain"], store))
    left = count_tasks() - baseline_tasks
    end_violations = [f"{left} task(s) left over at the end of the run"] if left else []
    return {"floors": floors, "agents": agents, "idles": idles, "end_violations": end_violations}


# -- report ----------------------------------------------------------------------------------------------------


def ms(seconds: float) -> float:
    return seconds * 1000


def per_second(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def print_tables(args: argparse.Namespace, raw: dict[str, Any]) -> None:
    floors: dict[tuple[str, int], Run] = raw["floors"]
    agents: dict[tuple[str, str, int], Run] = raw["agents"]
    header = (
        f"{'configuration':<24}{'open s':>8}{'req s':>8}{'close s':>8}{'total s':>9}{'x floor':>9}{'req/s':>8}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'GC %':>6}{'CPU s':>8}{'RSS MiB':>9}{'task/ses':>9}{'abort':>10}"
        f"{'sub':>5}{'lease':>6}"
    )
    for n in args.sessions:
        print(
            f"{n:,} sessions x {args.requests} request(s), all at once (model {args.latency_ms:g} ms "
            f"±{args.jitter * 100:g}%; mixed: {args.subagent_fraction * 100:g}% subagents, "
            f"{args.abort_fraction * 100:g}% aborts)"
        )
        print(header)
        for variant in args.variants:
            floor = floors[(variant, n)]
            rows = [floor] + [agents[(journal, variant, n)] for journal in args.journals]
            for run in rows:
                is_floor = run.kind == "floor"
                wall = run.total_s
                print(
                    f"{run.label:<24}"
                    f"{'-' if is_floor else f'{run.open_s:.2f}':>8}{run.request_s:>8.2f}"
                    f"{'-' if is_floor else f'{run.close_s:.2f}':>8}{wall:>9.2f}{wall / floor.total_s:>9.1f}"
                    f"{per_second(len(run.latencies), run.request_s):>8.0f}{ms(run.quantile(0.5)):>9.1f}"
                    f"{ms(run.quantile(0.99)):>9.1f}{run.gc_s / wall * 100:>6.1f}{run.cpu_s:>8.2f}"
                    f"{run.peak_rss_mib:>9.0f}{'-' if is_floor else f'{run.tasks_per_session:.1f}':>9}"
                    f"{f'{run.aborted}/{run.abort_calls}':>10}{run.helpers:>5}{'-' if is_floor else run.leases_lost:>6}"
                )
        print()
    legend = (
        "open / req / close s: the phases (all sessions opened together; then all send; then all close); "
        "total s: their sum",
        "x floor: total / the floor's wall; req/s: over the requests phase; p50 / p99 ms: per request (the time "
        "session.send took)",
        "GC %: of the total wall; CPU s: the process's; RSS MiB: the peak so far (it only grows)",
        "task/ses: Trio tasks per session while all sit idle after their requests (minus the harness's one)",
        "abort: requests aborted / session.abort() calls made while the send still waited (an abort before the "
        "request starts running does nothing: that request completes)",
        "sub: background subagents run; lease: sessions that lost their lease",
    )
    print("\n".join(legend))
    print()
    idles: list[Idle] = raw["idles"]
    if idles:
        print(
            f"idle sessions: {args.idle_sessions:,} sessions opened, one request each, then idle; tracemalloc on "
            "for this phase only (it is slow, hence this N); deltas over the same harness holding a stand-in"
        )
        print(f"{'journal':<10}{'heap KiB/session':>18}{'GC objects/session':>20}{'tasks/session':>15}")
        for idle in idles:
            print(f"{idle.journal:<10}{idle.heap_bytes / 1024:>18.1f}{idle.objects:>20.0f}{idle.tasks:>15.2f}")
        for idle in idles:
            kinds = ", ".join(f"{name} x{count:.2f}" for name, count in idle.task_kinds.items())
            print(f"  an idle session's tasks ({idle.journal}): {kinds or 'none'}")
        print()


def verdict(args: argparse.Namespace, raw: dict[str, Any], violations: list[str]) -> dict[str, Any]:
    """Issue 17's targets at the largest N run (memory journal, plain variant when run)."""
    agents: dict[tuple[str, str, int], Run] = raw["agents"]
    n = max(args.sessions)
    journal = "memory" if "memory" in args.journals else args.journals[0]
    variant = "plain" if "plain" in args.variants else args.variants[0]
    run = agents[(journal, variant, n)]
    idle = next((idle for idle in raw["idles"] if idle.journal == journal), None)
    leases = sum(run.leases_lost for run in agents.values())
    where = f"{n:,} sessions ({journal} journal, {variant})"
    if n != TARGET_SESSIONS:
        where += f"; the targets are for {TARGET_SESSIONS:,} sessions, so at this N they show a trend only"
    print(f"targets (issue 17), judged at {where}:")
    checks: dict[str, bool] = {}

    def line(key: str, text: str, met: bool) -> None:
        checks[key] = met
        print(f"  {text:<62} {'met' if met else 'NOT MET'}")

    gc_share = run.gc_s / run.total_s
    line(
        "wall",
        f"wall (open + requests + close) {run.total_s:.2f} s, target <= {TARGET_WALL_S:g} s",
        run.total_s <= TARGET_WALL_S,
    )
    line(
        "gc", f"GC {gc_share * 100:.1f}% of the wall, target <= {TARGET_GC_SHARE * 100:g}%", gc_share <= TARGET_GC_SHARE
    )
    if idle is not None and not math.isnan(idle.heap_bytes):
        line(
            "heap",
            f"heap {idle.heap_bytes / 1024:.1f} KiB per idle session (at {idle.n:,}), target <= 16 KiB",
            idle.heap_bytes <= TARGET_HEAP_BYTES,
        )
        line(
            "tasks",
            f"{idle.tasks:.2f} Trio tasks per idle session, target <= {TARGET_TASKS:g}",
            idle.tasks <= TARGET_TASKS,
        )
    else:
        line(
            "tasks",
            f"{run.tasks_per_session:.2f} Trio tasks per idle session, target <= {TARGET_TASKS:g}",
            run.tasks_per_session <= TARGET_TASKS,
        )
    line("leases", f"{leases} lease(s) lost over every run, target 0", leases == 0)
    line("invariants", f"invariant check: {len(violations)} violation(s)", not violations)
    floor = raw["floors"][(variant, n)]
    print(
        f"  (the floor did the same requests in {floor.total_s:.3f} s: the agent took "
        f"{run.total_s / floor.total_s:.0f}x; {run.cpu_s / max(1, len(run.latencies)) * 1e6:.0f} CPU us per "
        "request, open and close included)"
    )
    return {"target_checks": checks, "all_targets_met": all(checks.values())}


def figures(
    args: argparse.Namespace, raw: dict[str, Any], verdicts: dict[str, Any], violations: list[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "benchmark": "scale",
        "sessions": list(args.sessions),
        "requests_per_session": args.requests,
        "model_latency_ms": float(args.latency_ms),
        "model_jitter": float(args.jitter),
        "subagent_fraction": float(args.subagent_fraction),
        "abort_fraction": float(args.abort_fraction),
        "journals": list(args.journals),
        "variants": list(args.variants),
        "seed": args.seed,
        "cores_used": 1,
        "target_wall_s": TARGET_WALL_S,
        "target_gc_share": TARGET_GC_SHARE,
        "target_heap_bytes_per_idle_session": float(TARGET_HEAP_BYTES),
        "target_tasks_per_idle_session": TARGET_TASKS,
    }

    def quantiles(prefix: str, run: Run) -> None:
        out[f"{prefix}_latency_p50_ms"] = round(ms(run.quantile(0.5)), 3)
        out[f"{prefix}_latency_p99_ms"] = round(ms(run.quantile(0.99)), 3)

    for (variant, n), floor in raw["floors"].items():
        prefix = f"direct_{variant}_{n}"
        out[f"{prefix}_wall_s"] = round(floor.total_s, 6)
        out[f"{prefix}_cpu_s"] = round(max(floor.cpu_s, 1e-6), 6)
        out[f"{prefix}_requests_per_s"] = round(per_second(len(floor.latencies), floor.request_s), 1)
        quantiles(prefix, floor)
        out[f"floor_{variant}_{n}_gc_share"] = round(floor.gc_s / floor.total_s, 4)  # may be 0.0: no "direct"
    for (journal, variant, n), run in raw["agents"].items():
        prefix = f"agent_{journal}_{variant}_{n}"
        floor = raw["floors"][(variant, n)]
        out[f"{prefix}_open_s"] = round(run.open_s, 4)
        out[f"{prefix}_requests_s"] = round(run.request_s, 4)
        out[f"{prefix}_close_s"] = round(run.close_s, 4)
        out[f"{prefix}_total_s"] = round(run.total_s, 4)
        out[f"{prefix}_ratio_vs_floor"] = round(run.total_s / floor.total_s, 2)
        out[f"{prefix}_requests_ratio_vs_floor"] = round(run.request_s / floor.total_s, 2)
        out[f"{prefix}_requests_per_s"] = round(per_second(len(run.latencies), run.request_s), 1)
        quantiles(prefix, run)
        out[f"{prefix}_gc_share"] = round(run.gc_s / run.total_s, 4)
        out[f"{prefix}_gc_full_collections"] = run.gc_full
        out[f"{prefix}_cpu_s"] = round(run.cpu_s, 3)
        out[f"{prefix}_cpu_us_per_request"] = round(run.cpu_s / max(1, len(run.latencies)) * 1e6, 1)
        out[f"{prefix}_peak_rss_mib"] = round(run.peak_rss_mib, 1)
        out[f"{prefix}_tasks_per_idle_session"] = round(run.tasks_per_session, 3)
        out[f"{prefix}_completed"] = run.completed
        out[f"{prefix}_aborted"] = run.aborted
        out[f"{prefix}_abort_calls"] = run.abort_calls
        out[f"{prefix}_subagents"] = run.helpers
        out[f"{prefix}_leases_lost"] = run.leases_lost
        out[f"{prefix}_warnings_logged"] = run.warnings
    for idle in raw["idles"]:
        prefix = f"idle_{idle.journal}_{idle.n}"
        if not math.isnan(idle.heap_bytes):
            out[f"{prefix}_heap_bytes_per_session"] = round(idle.heap_bytes, 1)
            out[f"{prefix}_gc_objects_per_session"] = round(idle.objects, 2)
            out[f"{prefix}_tasks_per_session"] = round(idle.tasks, 3)
    out["leases_lost"] = sum(run.leases_lost for run in raw["agents"].values())
    out["warnings_logged"] = len(WARNINGS.records)
    out["invariant_violations"] = len(violations)
    out["invariants_ok"] = not violations
    out.update(verdicts)
    # A run cut short by --run-timeout leaves NaN figures: JSON gets null instead.
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in out.items()}


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({int(part.replace("_", "").replace(",", "")) for part in text.split() if part})
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError("sessions must be positive integers")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="quick run: 50 and 200 sessions, 200 idle ones")
    parser.add_argument(
        "--sessions", nargs="+", default=None, metavar="N", help="session counts (default 100 1000 10000)"
    )
    parser.add_argument("--requests", type=int, default=1, help="requests per session, one after the other")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="model latency per call (default 5)")
    parser.add_argument("--jitter", type=float, default=0.2, help="uniform latency jitter, as a fraction (0.2)")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--variants", default="plain,mixed", help="comma-separated: plain, mixed (default both)")
    parser.add_argument("--subagent-fraction", type=float, default=0.1, help="mixed: sessions with a subagent")
    parser.add_argument("--abort-fraction", type=float, default=0.1, help="mixed: requests aborted")
    parser.add_argument("--journal", choices=("memory", "sqlite", "both"), default="memory")
    parser.add_argument("--idle-sessions", type=int, default=None, help="N of the idle phase (0 skips it)")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds per agent run before giving up")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after start-up (docs/performance.md)")
    parser.add_argument(
        "--gc-threshold", type=int, default=0, help="gc.set_threshold(N, ...) for the young generation (default: 700)"
    )
    add_progress_option(parser)
    args = parser.parse_args(argv)
    start_progress("scale", args)
    if args.sessions is None:
        args.sessions = [50, 200] if args.short else [100, 1000, 10_000]
    else:
        args.sessions = parse_sizes(" ".join(args.sessions))
    if args.idle_sessions is None:
        args.idle_sessions = 200 if args.short else 1000
    args.variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    if not args.variants or set(args.variants) - set(VARIANTS):
        parser.error(f"--variants takes a comma-separated subset of {', '.join(VARIANTS)}")
    args.journals = ["memory", "sqlite"] if args.journal == "both" else [args.journal]
    if args.requests < 1 or not 0 <= args.jitter < 1 or args.latency_ms <= 0:
        parser.error("--requests >= 1, 0 <= --jitter < 1 and --latency-ms > 0")
    logging.getLogger("trio_agent").addHandler(WARNINGS)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trio-agent-scale-") as workdir:
        raw = trio.run(measure, args, Path(workdir))
    elapsed = time.perf_counter() - started

    violations: list[str] = [
        f"{run.label} at {run.n}: {problem}" for run in raw["agents"].values() for problem in run.violations
    ]
    violations += [problem for idle in raw["idles"] for problem in idle.violations]
    violations += raw["end_violations"]

    print(
        f"scale: N concurrent sessions of one agent spec, each {args.requests} request(s) of prompt -> model (tool "
        f"call) -> add -> model -> 'done'; trio {trio.__version__}, Python {sys.version.split()[0]}; one core "
        "(Trio runs on one thread)"
    )
    print()
    print_tables(args, raw)
    verdicts = verdict(args, raw, violations)
    if WARNINGS.records:
        print(f"trio_agent logged {len(WARNINGS.records)} warning(s); the first: {WARNINGS.records[0]}")
    if violations:
        print(f"invariants: {len(violations)} violation(s)")
        for problem in violations[:20]:
            print(f"  {problem}")
        if len(violations) > 20:
            print(f"  ... and {len(violations) - 20} more")
    else:
        print("invariants: ok")
    print(f"(ran in {elapsed:.1f} s)")
    print(json.dumps(figures(args, raw, verdicts, violations)))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
