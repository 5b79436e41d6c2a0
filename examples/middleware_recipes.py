"""Tool middleware recipes: every example of docs/middleware-guide.md, runnable.

Run it with ``python examples/middleware_recipes.py``. Each ``demo_*`` function
builds a small pipeline, runs a few calls and returns what happened, so the tests
in tests/test_middleware_recipes.py can check the same behaviour the guide
describes.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from trio_agent import (
    InterruptBehavior,
    Progress,
    SideEffect,
    Tool,
    ToolContext,
    ToolKind,
    ToolMessage,
    ToolMiddleware,
    ToolResult,
    define_tool,
)
from trio_agent.middleware import MiddlewareNext, NextCalledTwiceError, compose_middleware
from trio_agent.testing import ItemRecorder, call_tool
from trio_agent.tools import (
    AbortHandle,
    BehaviorOverride,
    CallNext,
    Effect,
    Emit,
    InMemoryToolJournal,
    StageRequest,
    ToolExecutionRecord,
    ToolItem,
    ToolMiddlewareRequest,
    ToolPipeline,
    ToolStages,
)

# ---------------------------------------------------------------------------
# Tools the demos call
# ---------------------------------------------------------------------------

SEARCH_SCHEMA = {
    "type": "object",
    "properties": {"query": {"type": "string", "minLength": 1}},
    "required": ["query"],
}


@define_tool(side_effect="pure", kind="readonly", input_schema=SEARCH_SCHEMA)
async def search(input: dict[str, Any], ctx: ToolContext) -> str:
    """Search the documentation."""
    return f"3 results for {input['query']!r}"


@define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
async def read_config(input: dict[str, Any], ctx: ToolContext) -> str:
    """Read the service configuration."""
    return "endpoint = https://api.example.com\napi_key = sk-live-4f9a8b7c6d5e4f3a\n"


def make_quote_tool() -> tuple[Tool[Any], list[dict[str, Any]]]:
    """A pure tool, and the list of inputs it actually ran with."""
    runs: list[dict[str, Any]] = []

    @define_tool(
        side_effect="pure",
        kind="readonly",
        input_schema={"type": "object", "properties": {"pair": {"type": "string"}}, "required": ["pair"]},
    )
    async def get_quote(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Look up an exchange rate."""
        runs.append(input)
        return ToolResult.success(f"{input['pair']} = 1.0842", data={"pair": input["pair"], "rate": 1.0842})

    return get_quote, runs


@define_tool(side_effect="idempotent", kind="write", input_schema={"type": "object"})
async def download(input: dict[str, Any], ctx: ToolContext) -> str:
    """Download a file, reporting progress in ten steps."""
    for step in range(1, 11):
        await ctx.emit(Progress(f"chunk {step}", completed=step, total=10))
    await ctx.emit(ToolMessage("download finished"))
    await ctx.emit(Effect("new_messages", ["report.pdf is ready"]))
    return "saved report.pdf"


# ---------------------------------------------------------------------------
# 1. Audit logging
# ---------------------------------------------------------------------------

audit_log = logging.getLogger("middleware_recipes.audit")


async def audit(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """Log every tool call before it runs and after it returns."""
    call_id = request.context.tool_call_id
    started = trio.current_time()
    audit_log.info("call %s: %s started", call_id, request.tool_name)
    result = await call_next()
    outcome = "ok" if result.error is None else result.error.type.value
    audit_log.info("call %s: %s -> %s in %.3f s", call_id, request.tool_name, outcome, trio.current_time() - started)
    return result


async def demo_audit() -> list[ToolExecutionRecord]:
    pipeline = ToolPipeline([search], middleware=[audit])
    return [
        await call_tool(pipeline, "search", {"query": "nurseries"}, call_id="audit-1"),
        await call_tool(pipeline, "search", {"query": ""}, call_id="audit-2"),  # fails the schema
    ]


# ---------------------------------------------------------------------------
# 2. Input normalisation
# ---------------------------------------------------------------------------


async def normalise_query(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """Strip surrounding whitespace from a ``query`` argument before the tool sees it."""
    query = request.input.get("query")
    if isinstance(query, str) and query != query.strip():
        request = request.replace(input={**request.input, "query": query.strip()})
    return await call_next(request)


async def demo_normalise() -> tuple[list[ToolExecutionRecord], InMemoryToolJournal]:
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([search], middleware=[normalise_query], journal=journal)
    records = [
        await call_tool(pipeline, "search", {"query": "  cancel scopes \n"}, call_id="norm-1"),
        await call_tool(pipeline, "search", {"query": "   "}, call_id="norm-2"),  # empty once stripped
    ]
    return records, journal


# ---------------------------------------------------------------------------
# 3. Result redaction while unwinding
# ---------------------------------------------------------------------------

SECRET = re.compile(r"\b(?:sk|ghp|xox[abp])[-_][A-Za-z0-9_-]{8,}")


def mask(text: str) -> str:
    return SECRET.sub("[REDACTED]", text)


async def redact_secrets(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """Mask secrets in what the model, the stream and the journal get."""
    result = await call_next()
    changes: dict[str, Any] = {}
    if isinstance(result.output, str):
        changes["output"] = mask(result.output)
    if result.display is not None:
        changes["display"] = mask(result.display)
    if result.error is not None:
        changes["error"] = attrs.evolve(result.error, message=mask(result.error.message))
    return attrs.evolve(result, **changes)


def hold_unwind(reached: trio.Event, release: trio.Event) -> ToolMiddleware:
    """Demo scaffolding: an inner layer that pauses the unwind after the tool returned.

    It stands in for slow work in the unwind, such as a call to a remote
    classification service, so the demo can abort or cancel at that moment.
    """

    async def hold(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        result = await call_next()
        reached.set()
        await release.wait()
        return result

    return hold


@attrs.define
class RedactionDemo:
    plain: ToolExecutionRecord
    aborted: ToolExecutionRecord
    outside_cancelled: bool
    outside_settled: dict[str, Any]
    missed: ToolExecutionRecord
    missed_settled: dict[str, Any]


def settled_entry(journal: InMemoryToolJournal, call_id: str) -> dict[str, Any]:
    """The data of a call's ``settled`` journal entry."""
    return next(e.data for e in journal.entries if e.call_id == call_id and e.kind == "settled")


async def demo_redaction(*, unwind_grace: float = 0.05) -> tuple[RedactionDemo, InMemoryToolJournal]:
    journal = InMemoryToolJournal()

    # a) The plain case: the tool's output is masked before settlement.
    pipeline = ToolPipeline([read_config], middleware=[redact_secrets], journal=journal)
    plain = await call_tool(pipeline, "read_config", call_id="redact-plain")

    # b) The request is aborted after the tool returned, while the unwind is still running.
    reached, release = trio.Event(), trio.Event()
    pipeline = ToolPipeline([read_config], middleware=[redact_secrets, hold_unwind(reached, release)], journal=journal)
    request_abort = AbortHandle()
    records: list[ToolExecutionRecord] = []
    async with trio.open_nursery() as nursery:

        async def run_call() -> None:
            records.append(await call_tool(pipeline, "read_config", call_id="redact-abort", abort=request_abort))

        nursery.start_soon(run_call)
        await reached.wait()
        request_abort.abort()
        release.set()

    # c) The caller's own cancel scope is cancelled at the same moment.
    reached, release = trio.Event(), trio.Event()
    pipeline = ToolPipeline([read_config], middleware=[redact_secrets, hold_unwind(reached, release)], journal=journal)
    async with trio.open_nursery() as nursery:
        caller_scope = trio.CancelScope()

        async def cancelled_caller() -> None:
            with caller_scope:
                await call_tool(pipeline, "read_config", call_id="redact-cancel")

        nursery.start_soon(cancelled_caller)
        await reached.wait()
        caller_scope.cancel()
        release.set()

    # d) The unwind never finishes: it misses the pipeline's unwind_grace.
    pipeline = ToolPipeline(
        [read_config],
        middleware=[redact_secrets, hold_unwind(trio.Event(), trio.Event())],
        journal=journal,
        unwind_grace=unwind_grace,
    )
    missed = await call_tool(pipeline, "read_config", call_id="redact-missed")

    demo = RedactionDemo(
        plain=plain,
        aborted=records[0],
        outside_cancelled=caller_scope.cancelled_caught,
        outside_settled=settled_entry(journal, "redact-cancel"),
        missed=missed,
        missed_settled=settled_entry(journal, "redact-missed"),
    )
    return demo, journal


# ---------------------------------------------------------------------------
# 4. Cache short-circuit
# ---------------------------------------------------------------------------


class ResultCache:
    """Answer repeated calls of side-effect-free tools from a cache, without running them."""

    def __init__(self, tool_names: Iterable[str]) -> None:
        self.tool_names = frozenset(tool_names)  # only tools declared side_effect="pure"
        self._results: dict[tuple[str, str], ToolResult] = {}

    async def __call__(self, request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        if request.tool_name not in self.tool_names:
            return await call_next()
        key = (request.tool_name, json.dumps(request.input, sort_keys=True))
        cached = self._results.get(key)
        if cached is not None:
            # Short-circuit: the tool, the hooks and the permission checks do not run.
            return attrs.evolve(cached, metadata={**cached.metadata, "cache": "hit"})
        result = await call_next()
        if result.ok:
            self._results[key] = result
        return result


@attrs.define
class CacheDemo:
    records: list[ToolExecutionRecord]
    tool_runs: list[dict[str, Any]]
    permission_checks: list[dict[str, Any]]
    journal: InMemoryToolJournal


async def demo_cache() -> CacheDemo:
    get_quote, runs = make_quote_tool()
    checks: list[dict[str, Any]] = []

    async def allow_and_count(request: StageRequest) -> None:
        checks.append(request.input)

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline(
        [get_quote],
        middleware=[ResultCache({"get_quote"})],
        journal=journal,
        stages=ToolStages(permission=[allow_and_count]),
    )
    records = [
        await call_tool(pipeline, "get_quote", {"pair": "EUR/USD"}, call_id="quote-1"),  # miss: runs
        await call_tool(pipeline, "get_quote", {"pair": "EUR/USD"}, call_id="quote-2"),  # hit
    ]
    return CacheDemo(records, runs, checks, journal)


# ---------------------------------------------------------------------------
# 5. Progress filter
# ---------------------------------------------------------------------------


def throttle_progress(outer: Emit, *, step: float = 0.25) -> Emit:
    """Wrap *outer*: drop Progress items that advance less than *step*, rewrite the rest."""
    last = -1.0  # state of this one wrapper: build one wrapper per call

    async def emit(item: ToolItem) -> None:
        nonlocal last
        if isinstance(item, Progress) and item.total:
            fraction = (item.completed or 0) / item.total
            if fraction - last < step and fraction < 1:
                return  # dropped
            last = fraction
            item = attrs.evolve(item, message=f"{fraction:.0%} done", data=None)  # rewritten
        await outer(item)

    return emit


async def progress_filter(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """Thin out and rewrite progress: wrap the outer emit and pass the wrapper inwards."""
    return await call_next(emit=throttle_progress(request.emit))


@attrs.define
class ProgressDemo:
    filtered: ToolExecutionRecord
    observed: list[ToolItem]


async def demo_progress() -> ProgressDemo:
    pipeline = ToolPipeline([download], middleware=[progress_filter])
    recorder = ItemRecorder()
    filtered = await call_tool(pipeline, "download", on_item=recorder)
    return ProgressDemo(filtered, recorder.items)


# ---------------------------------------------------------------------------
# What middleware must not do
# ---------------------------------------------------------------------------


async def rename_tool(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """WRONG: routes the call to another tool."""
    return await call_next(ToolMiddlewareRequest("search_v2", request.input, request.context))


async def replace_context(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """WRONG: passes a copy of the execution context."""
    return await call_next(ToolMiddlewareRequest(request.tool_name, request.input, attrs.evolve(request.context)))


async def force_dry_run(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """WRONG: dry runs resolve to interrupt="cancel", real deploys to "block"."""
    return await call_next(request.replace(input={**request.input, "dry_run": True}))


async def retry_once(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """WRONG: retries by calling call_next a second time."""
    result = await call_next()
    if not result.ok:
        result = await call_next()  # raises NextCalledTwiceError
    return result


async def pretend_success(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
    """WRONG: hides failures, cancellations and timeouts from the model."""
    result = await call_next()
    if result.error is not None:
        return ToolResult.success("(no result)")
    return result


def deploy_behavior(input: dict[str, Any]) -> BehaviorOverride | None:
    if input.get("dry_run"):
        return BehaviorOverride(side_effect=SideEffect.PURE, kind=ToolKind.READONLY, interrupt=InterruptBehavior.CANCEL)
    return None


@define_tool(
    side_effect="non_idempotent",
    kind="execute",
    interrupt="block",
    resolve_behavior=deploy_behavior,
    input_schema={
        "type": "object",
        "properties": {"service": {"type": "string"}, "dry_run": {"type": "boolean"}},
        "required": ["service"],
    },
)
async def deploy(input: dict[str, Any], ctx: ToolContext) -> str:
    """Deploy a service (or only plan it with dry_run)."""
    return f"{'planned' if input.get('dry_run') else 'deployed'} {input['service']}"


@define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
async def flaky(input: dict[str, Any], ctx: ToolContext) -> str:
    """Always fails."""
    raise ConnectionError("upstream unavailable")


def make_stuck_tool(started: trio.Event, *, timeout: float | None = None) -> Tool[Any]:
    """A tool that never finishes on its own; *started* is set once it runs."""

    @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"}, timeout=timeout)
    async def stuck(input: dict[str, Any], ctx: ToolContext) -> str:
        """Wait forever."""
        started.set()
        await trio.sleep_forever()
        return "unreachable"

    return stuck


async def demo_violations(*, tool_timeout: float = 0.05) -> dict[str, ToolExecutionRecord]:
    """Run each misbehaving middleware once; the pipeline's answer is in each record."""
    out: dict[str, ToolExecutionRecord] = {}
    tools = [search, deploy, flaky]
    for name, layer, tool, args in [
        ("rename_tool", rename_tool, "search", {"query": "x"}),
        ("replace_context", replace_context, "search", {"query": "x"}),
        ("force_dry_run", force_dry_run, "deploy", {"service": "api"}),
        ("retry_once", retry_once, "flaky", {}),
        ("pretend_success/failed", pretend_success, "flaky", {}),
    ]:
        pipeline = ToolPipeline(tools, middleware=[layer])
        out[name] = await call_tool(pipeline, tool, args)

    # A timeout overwritten: the tool's own deadline fires.
    started = trio.Event()
    pipeline = ToolPipeline([make_stuck_tool(started, timeout=tool_timeout)], middleware=[pretend_success])
    out["pretend_success/timeout"] = await call_tool(pipeline, "stuck")

    # A cancellation overwritten: the request is aborted while the tool runs.
    started = trio.Event()
    pipeline = ToolPipeline([make_stuck_tool(started)], middleware=[pretend_success])
    request_abort = AbortHandle()
    async with trio.open_nursery() as nursery:

        async def run_call() -> None:
            out["pretend_success/cancelled"] = await call_tool(pipeline, "stuck", abort=request_abort)

        nursery.start_soon(run_call)
        await started.wait()
        request_abort.abort()
    return out


# ---------------------------------------------------------------------------
# Concurrency safety
# ---------------------------------------------------------------------------


class TagCallWrong:
    """WRONG: keeps request-local state on the shared middleware object."""

    def __init__(self) -> None:
        self.call_id: str | None = None

    async def __call__(self, request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        self.call_id = request.context.tool_call_id  # another call overwrites this while we wait
        result = await call_next()
        return attrs.evolve(result, metadata={**result.metadata, "tagged": self.call_id})


class TagCallRight:
    """Right: request-local state lives in locals."""

    async def __call__(self, request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        call_id = request.context.tool_call_id
        result = await call_next()
        return attrs.evolve(result, metadata={**result.metadata, "tagged": call_id})


def make_meeting_tool(parties: int) -> Tool[Any]:
    """A tool whose calls all wait until *parties* calls are running at once."""
    arrived = 0
    everyone_here = trio.Event()

    @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def meet(input: dict[str, Any], ctx: ToolContext) -> str:
        """Wait for the other calls."""
        nonlocal arrived
        arrived += 1
        if arrived == parties:
            everyone_here.set()
        await everyone_here.wait()
        return "met"

    return meet


async def demo_concurrency(middleware: Any) -> dict[str, Any]:
    """Run two overlapping calls through one middleware instance; return call id -> tag."""
    pipeline = ToolPipeline([make_meeting_tool(2)], middleware=[middleware])
    tags: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        for call_id in ("call-a", "call-b"):

            async def run_call(call_id: str = call_id) -> None:
                record = await call_tool(pipeline, "meet", call_id=call_id)
                tags[call_id] = record.result.metadata["tagged"]

            nursery.start_soon(run_call)
    return tags


# ---------------------------------------------------------------------------
# All recipes in one stack
# ---------------------------------------------------------------------------


def build_pipeline(tools: Iterable[Tool[Any]], journal: InMemoryToolJournal) -> ToolPipeline:
    """The recipes in one stack; the first layer is the outermost."""
    return ToolPipeline(
        tools,
        middleware=[audit, normalise_query, ResultCache({"search", "read_config"}), redact_secrets],
        journal=journal,
    )


async def demo_stack() -> tuple[list[ToolExecutionRecord], InMemoryToolJournal]:
    journal = InMemoryToolJournal()
    pipeline = build_pipeline([search, read_config], journal)
    records = [
        await call_tool(pipeline, "search", {"query": "nurseries"}, call_id="stack-1"),
        await call_tool(pipeline, "search", {"query": " nurseries  "}, call_id="stack-2"),  # same key once stripped
        await call_tool(pipeline, "read_config", call_id="stack-3"),
        await call_tool(pipeline, "read_config", call_id="stack-4"),  # cached, already redacted
    ]
    return records, journal


# ---------------------------------------------------------------------------
# The generic composer
# ---------------------------------------------------------------------------


def shout(text: str, next_: MiddlewareNext[str, str]) -> str:
    return next_(text.upper())  # replaces the request for the inner layers


def exclaim(text: str, next_: MiddlewareNext[str, str]) -> str:
    return next_() + "!"  # passes the current request, transforms the result


def greet(text: str) -> str:
    return f"hello {text}"


greeting = compose_middleware([shout, exclaim], greet)


def demo_compose() -> tuple[str, str]:
    def twice(text: str, next_: MiddlewareNext[str, str]) -> str:
        next_()
        return next_()

    try:
        compose_middleware([twice], greet)("again")
    except NextCalledTwiceError as exc:
        error = str(exc)
    return greeting("world"), error


# ---------------------------------------------------------------------------


def short(result: ToolResult) -> str:
    return repr(result.output if result.error is None else f"{result.error.type.value}: {result.error.message}")


async def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="   log: %(message)s")

    print("1. audit logging")
    for record in await demo_audit():
        print(f"   -> {record.call.id}: {record.status.value}")

    print("2. input normalisation")
    records, journal = await demo_normalise()
    effective = records[0].effective_input or {}
    print(f"   model sent {records[0].call.input['query']!r}, tool ran with {effective['query']!r}")
    print(f"   journal started input: {journal.entries[1].data['input']}")
    print(f"   whitespace-only query -> {short(records[1].result)}")

    print("3. result redaction")
    demo, journal = await demo_redaction()
    print(f"   plain: {short(demo.plain.result)}")
    print(f"   abort during unwind: {demo.aborted.status.value}, aborted={demo.aborted.aborted is not None}")
    print(f"   caller cancelled during unwind: cancelled={demo.outside_cancelled}, journal has")
    print(f"      {short(demo.outside_settled['result'])}")
    print(f"   unwind deadline missed: model sees {short(demo.missed.result)}")
    print(f"      published={demo.missed.published}, journal keeps raw {short(demo.missed_settled['result'])}")

    print("4. cache short-circuit")
    cache = await demo_cache()
    for record in cache.records:
        print(
            f"   {record.call.id}: tool_ran={record.tool_ran} synthetic_start={record.synthetic_start} "
            f"journal={cache.journal.kinds(record.call.id)}"
        )
    print(f"   tool ran {len(cache.tool_runs)} time(s); permission stage ran {len(cache.permission_checks)} time(s)")

    print("5. progress filter")
    progress = await demo_progress()
    seen = [item.message if isinstance(item, Progress) else item for item in progress.observed]
    print(f"   observer got {seen}")
    print(f"   effects kept: {progress.filtered.effects}")
    print(f"   effects collected for the session: {[effect.kind for effect in progress.filtered.effects]}")

    print("6. what middleware must not do")
    for name, record in (await demo_violations()).items():
        faults = [fault.code.value for fault in record.faults]
        print(f"   {name}: tool_ran={record.tool_ran} {short(record.result)} faults={faults}")

    print("7. concurrency safety")
    print(f"   wrong: {await demo_concurrency(TagCallWrong())}")
    print(f"   right: {await demo_concurrency(TagCallRight())}")

    print("8. all recipes in one stack")
    records, journal = await demo_stack()
    for record in records:
        print(f"   {record.call.id}: tool_ran={record.tool_ran} {short(record.result)}")

    print("9. compose_middleware")
    result, error = demo_compose()
    print(f"   greeting('world') = {result!r}; calling next twice: {error!r}")


if __name__ == "__main__":
    trio.run(main)
