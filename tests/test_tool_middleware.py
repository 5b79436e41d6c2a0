"""Tool middleware around the tool pipeline: transforms, short-circuits, rules, lease, journal and stages.

The durable order under test (spec "Durable side-effect boundary")::

    on_tool_scheduled -> ownership -> middleware -> stages / slot / locks -> on_execution_started (FINAL input)
    -> tool -> middleware unwind -> ownership -> on_tool_settled -> publish
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_agent import (
    ConfigError,
    InterruptBehavior,
    JournalError,
    LeaseLostError,
    Progress,
    SideEffect,
    Tool,
    ToolDefinitionError,
    ToolErrorType,
    ToolFailure,
    ToolMessage,
    ToolResult,
    define_tool,
)
from trio_agent.middleware import MiddlewareShapeError, NextCalledTwiceError
from trio_agent.testing import FailingJournal, ItemRecorder, LeaseStub, call_tool
from trio_agent.tools import (
    AbortHandle,
    Allow,
    BehaviorOverride,
    Deny,
    Effect,
    ExecutionContext,
    FaultCode,
    InMemoryToolJournal,
    SettlementError,
    SettlementStatus,
    Skip,
    StageRequest,
    ToolCall,
    ToolMiddlewareRequest,
    ToolPipeline,
    ToolStages,
)

# -- helpers -------------------------------------------------------------------

ECHO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"q": {"type": "string"}, "mode": {"type": "string"}, "dry": {"type": "boolean"}},
    "required": ["q"],
    "additionalProperties": False,
}


def echo_output(inp: dict[str, Any]) -> str:
    return f"echo:{inp['q']}"


class Runs:
    """What the tools saw: one entry per run, in order."""

    def __init__(self) -> None:
        self.inputs: list[dict[str, Any]] = []
        self.log: list[tuple[Any, ...]] | None = None

    def note(self, inp: dict[str, Any]) -> None:
        self.inputs.append(dict(inp))
        if self.log is not None:
            self.log.append(("tool", dict(inp)))


def echo_tool(runs: Runs, *, name: str = "echo", **kwargs: Any) -> Tool[Any]:
    kwargs.setdefault("side_effect", "pure")

    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        runs.note(inp)
        return ToolResult.success(echo_output(inp))

    return define_tool(run, name=name, description="echo the query", input_schema=ECHO_SCHEMA, **kwargs)


def behaving_tool(runs: Runs, *, name: str = "guarded") -> Tool[Any]:
    """Interrupt ``cancel`` unless mode == "block"; side effect ``non_idempotent`` unless dry (then ``pure``)."""

    def resolve(inp: dict[str, Any]) -> BehaviorOverride | None:
        return BehaviorOverride(
            interrupt=InterruptBehavior.BLOCK if inp.get("mode") == "block" else None,
            side_effect=SideEffect.PURE if inp.get("dry") else None,
        )

    return echo_tool(runs, name=name, side_effect="non_idempotent", interrupt="cancel", resolve_behavior=resolve)


class LoggingJournal(InMemoryToolJournal):
    """An in-memory journal that also writes each event into a shared log, at the moment it is written."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.log = log

    async def on_tool_scheduled(self, call: Any) -> None:
        self.log.append(("scheduled", dict(call.model_input)))
        await super().on_tool_scheduled(call)

    async def on_execution_started(self, call: Any, input: Any, side_effect: Any, *, synthetic: bool) -> None:
        self.log.append(("started", dict(input), synthetic))
        await super().on_execution_started(call, input, side_effect, synthetic=synthetic)

    async def on_tool_settled(self, call: Any, settlement: Any) -> None:
        self.log.append(("settled", settlement.status, settlement.effective_input, settlement.result.output))
        await super().on_tool_settled(call, settlement)


def entry(journal: InMemoryToolJournal, call_id: str, kind: str) -> dict[str, Any]:
    (found,) = [e.data for e in journal.entries if e.call_id == call_id and e.kind == kind]
    return found


def codes(record: Any) -> list[FaultCode]:
    return [fault.code for fault in record.faults]


async def passthrough(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
    return await call_next()


def short_circuit_ok(output: str, entered: list[str] | None = None, tag: str = "sc") -> Any:
    async def mw(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        if entered is not None:
            entered.append(tag)
        return ToolResult.success(output)

    return mw


class StageSpy:
    """Stage callbacks that record each call; by default they allow without changes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def stage(self, name: str, decision: Any = None) -> Any:
        async def callback(request: StageRequest) -> Any:
            self.calls.append((name, dict(request.input)))
            return decision

        callback.__qualname__ = name
        return callback

    def post(self, name: str, replacement: ToolResult | None = None) -> Any:
        async def callback(request: StageRequest, result: ToolResult) -> ToolResult | None:
            self.calls.append((name, dict(request.input)))
            return replacement

        return callback

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


# -- transforming input --------------------------------------------------------


async def test_transformed_input_reaches_tool_journal_history_in_durable_order() -> None:
    log: list[tuple[Any, ...]] = []
    runs = Runs()
    runs.log = log

    async def trim(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        log.append(("mw before", dict(request.input)))
        result = await call_next(request.replace(input={"q": request.input["q"].strip()}))
        log.append(("mw after", result.output))
        return attrs.evolve(result, output=f"[{result.output}]")

    journal = LoggingJournal(log)
    pipeline = ToolPipeline([echo_tool(runs)], middleware=[trim], journal=journal)
    record = await call_tool(pipeline, "echo", {"q": "  hi  "}, call_id="c1")

    model_input = {"q": "  hi  "}
    final_input = {"q": model_input["q"].strip()}
    wrapped = f"[{echo_output(final_input)}]"
    assert log == [
        ("scheduled", model_input),
        ("mw before", model_input),
        ("started", final_input, False),
        ("tool", final_input),
        ("mw after", echo_output(final_input)),
        ("settled", SettlementStatus.COMPLETED, final_input, wrapped),
    ]
    assert runs.inputs == [final_input]
    assert journal.kinds("c1") == ["scheduled", "started", "settled"]
    assert entry(journal, "c1", "scheduled")["input"] == model_input
    assert entry(journal, "c1", "started")["input"] == final_input
    assert entry(journal, "c1", "settled")["result"].output == wrapped
    assert record.effective_input == final_input
    assert record.result.output == wrapped
    assert record.status is SettlementStatus.COMPLETED
    assert record.tool_ran and not record.synthetic_start and record.published
    assert list(pipeline.history) == [record]


async def test_two_input_transforms_compose_outer_first() -> None:
    runs = Runs()

    def appender(suffix: str) -> Any:
        async def mw(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
            return await call_next(request.replace(input={"q": request.input["q"] + suffix}))

        return mw

    pipeline = ToolPipeline([echo_tool(runs)], middleware=[appender("-a"), appender("-b")])
    record = await call_tool(pipeline, "echo", {"q": "x"})
    assert runs.inputs == [{"q": "x-a-b"}]
    assert record.effective_input == {"q": "x-a-b"}
    assert record.result.output == echo_output({"q": "x-a-b"})


# -- streamed items ------------------------------------------------------------


def streaming_tool(name: str = "stream") -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        for i in range(5):
            await ctx.emit(Progress(message=f"p{i}", completed=i, total=4))
            if i == 2:
                await ctx.emit(ToolMessage("halfway", detail={"i": i}))
                await ctx.emit(Effect("new_messages", ["note"]))
        await ctx.emit(Effect("permission_updates", {"allow": ["x"]}))
        return "done"

    return define_tool(run, name=name, description="streams", side_effect="pure", input_schema={"type": "object"})


STREAMED: list[Any] = [
    Progress(message="p0", completed=0, total=4),
    Progress(message="p1", completed=1, total=4),
    Progress(message="p2", completed=2, total=4),
    ToolMessage("halfway", detail={"i": 2}),
    Effect("new_messages", ["note"]),
    Progress(message="p3", completed=3, total=4),
    Progress(message="p4", completed=4, total=4),
    Effect("permission_updates", {"allow": ["x"]}),
]


@pytest.mark.parametrize("layers", [0, 1, 3])
async def test_items_reach_on_item_in_order_and_effects_are_collected(layers: int) -> None:
    async def rewrite_input(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next(request.replace(input={**request.input}))

    middleware = [passthrough, rewrite_input, passthrough][:layers]
    pipeline = ToolPipeline([streaming_tool()], middleware=middleware)
    recorder = ItemRecorder()
    record = await call_tool(pipeline, "stream", {}, on_item=recorder)
    assert record.result == ToolResult.success("done")
    assert recorder.items == [item for item in STREAMED if not isinstance(item, Effect)]
    assert list(record.effects) == [item for item in STREAMED if isinstance(item, Effect)]


async def test_emit_wrapper_sees_every_item_in_order_and_forwards() -> None:
    seen: list[Any] = []

    async def observe(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        outer = request.emit

        async def emit(item: Any) -> None:
            seen.append(item)
            await outer(item)

        return await call_next(emit=emit)

    pipeline = ToolPipeline([streaming_tool()], middleware=[observe])
    recorder = ItemRecorder()
    record = await call_tool(pipeline, "stream", {}, on_item=recorder)
    assert seen == STREAMED
    assert recorder.items == [item for item in STREAMED if not isinstance(item, Effect)]
    assert list(record.effects) == [item for item in STREAMED if isinstance(item, Effect)]
    assert record.result.ok


def drop_odd_progress(outer: Any) -> Any:
    async def emit(item: Any) -> None:
        if isinstance(item, Progress) and item.completed % 2:
            return
        await outer(item)

    return emit


def shout_messages(outer: Any) -> Any:
    async def emit(item: Any) -> None:
        if isinstance(item, ToolMessage):
            item = ToolMessage(item.summary.upper(), detail="rewritten")
        await outer(item)

    return emit


def expected_filtered(items: list[Any]) -> list[Any]:
    expected = []
    for item in items:
        if isinstance(item, Effect) or (isinstance(item, Progress) and item.completed % 2):
            continue
        expected.append(
            ToolMessage(item.summary.upper(), detail="rewritten") if isinstance(item, ToolMessage) else item
        )
    return expected


async def test_emit_wrapper_filters_progress_and_rewrites_messages() -> None:
    async def filter_and_rewrite(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next(emit=shout_messages(drop_odd_progress(request.emit)))

    pipeline = ToolPipeline([streaming_tool()], middleware=[filter_and_rewrite])
    recorder = ItemRecorder()
    record = await call_tool(pipeline, "stream", {}, on_item=recorder)
    assert recorder.items == expected_filtered(STREAMED)
    assert list(record.effects) == [item for item in STREAMED if isinstance(item, Effect)]


async def test_emit_wrappers_of_several_layers_compose() -> None:
    emits_seen: list[Any] = []

    async def outer_layer(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        emits_seen.append(request.emit)
        wrapper = drop_odd_progress(request.emit)
        emits_seen.append(wrapper)
        # a changed input keeps the wrapper passed alongside it
        return await call_next(request.replace(input={"changed": True}), emit=wrapper)

    async def middle_layer(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        emits_seen.append(request.emit)
        return await call_next()

    async def inner_layer(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        emits_seen.append(request.emit)
        return await call_next(emit=shout_messages(request.emit))

    pipeline = ToolPipeline([streaming_tool()], middleware=[outer_layer, middle_layer, inner_layer])
    recorder = ItemRecorder()
    record = await call_tool(pipeline, "stream", {}, on_item=recorder)
    _sink, wrapper, middle_emit, inner_emit = emits_seen
    assert middle_emit is wrapper and inner_emit is wrapper
    assert recorder.items == expected_filtered(STREAMED)
    assert list(record.effects) == [item for item in STREAMED if isinstance(item, Effect)]
    assert record.effective_input == {"changed": True}


async def test_request_built_without_emit_inherits_the_current_emit() -> None:
    async def rebuild(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next(ToolMiddlewareRequest(request.tool_name, {"rebuilt": True}, request.context))

    pipeline = ToolPipeline([streaming_tool()], middleware=[rebuild])
    recorder = ItemRecorder()
    record = await call_tool(pipeline, "stream", {}, on_item=recorder)
    assert record.effective_input == {"rebuilt": True}
    assert recorder.items == [item for item in STREAMED if not isinstance(item, Effect)]
    assert len(record.effects) == 2


async def test_short_circuit_can_emit_items() -> None:
    async def cached(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await request.emit(Progress(message="from cache"))
        await request.emit(Effect("new_messages", ["cached"]))
        return ToolResult.success("cached")

    runs = Runs()
    recorder = ItemRecorder()
    record = await call_tool(ToolPipeline([echo_tool(runs)], middleware=[cached]), "echo", {"q": "x"}, on_item=recorder)
    assert record.result == ToolResult.success("cached")
    assert recorder.items == [Progress(message="from cache")]
    assert record.effects == (Effect("new_messages", ["cached"]),)
    assert runs.inputs == []


@pytest.mark.parametrize("junk", ["text", 42, {"kind": "x"}, None])
@pytest.mark.parametrize("wrapped", [False, True])
async def test_emitting_a_non_item_raises_type_error_inside_the_tool(junk: Any, wrapped: bool) -> None:
    caught: list[BaseException] = []

    async def run(inp: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Progress(message="ok"))
        try:
            await ctx.emit(junk)
        except TypeError as exc:
            caught.append(exc)
            raise
        return "unreachable"

    tool = define_tool(run, name="junk", description="junk", side_effect="pure", input_schema={"type": "object"})
    pipeline = ToolPipeline([tool], middleware=[passthrough] if wrapped else [])
    recorder = ItemRecorder()
    record = await call_tool(pipeline, "junk", {}, on_item=recorder)
    assert len(caught) == 1
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.EXECUTION
    assert "TypeError" in record.result.error.message
    assert record.status is SettlementStatus.FAILED
    assert recorder.items == [Progress(message="ok")]


# -- transforming results, onion order ----------------------------------------


async def test_result_redaction_while_unwinding() -> None:
    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        return ToolResult.success("user=alice password=hunter2", data={"password": "hunter2"})

    async def redact(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        result = await call_next()
        return attrs.evolve(result, output=result.output.replace("hunter2", "***"), data=None)

    journal = InMemoryToolJournal()
    tool = define_tool(run, name="secret", description="s", side_effect="pure", input_schema={"type": "object"})
    record = await call_tool(ToolPipeline([tool], middleware=[redact], journal=journal), "secret", {}, call_id="r1")
    assert record.result == ToolResult.success("user=alice password=***")
    assert entry(journal, "r1", "settled")["result"] == record.result
    assert "hunter2" not in repr(journal.entries)


async def test_three_layer_onion_order() -> None:
    log: list[str] = []

    def layer(name: str) -> Any:
        async def mw(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
            log.append(f"{name} before")
            result = await call_next()
            log.append(f"{name} after")
            return attrs.evolve(result, output=f"{name}({result.output})")

        return mw

    async def run(inp: dict[str, Any], ctx: Any) -> str:
        log.append("tool")
        return "core"

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    record = await call_tool(ToolPipeline([tool], middleware=[layer("a"), layer("b"), layer("c")]), "t", {})
    assert log == ["a before", "b before", "c before", "tool", "c after", "b after", "a after"]
    assert record.result.output == "a(b(c(core)))"


# -- short-circuits ----------------------------------------------------------


def spied_stages(spy: StageSpy) -> ToolStages:
    return ToolStages(
        pre_tool=[spy.stage("pre_tool")],
        permission=[spy.stage("permission")],
        before=[spy.stage("before")],
        guard=[spy.stage("guard")],
        post_tool=[spy.post("post_tool")],
    )


async def test_successful_short_circuit_records_synthetic_start_and_skips_stages() -> None:
    runs = Runs()
    spy = StageSpy()

    async def make_dry(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next(request.replace(input={**request.input, "dry": True}))

    journal = InMemoryToolJournal()
    tool = behaving_tool(runs)
    pipeline = ToolPipeline(
        [tool],
        middleware=[make_dry, short_circuit_ok("from cache")],
        journal=journal,
        stages=spied_stages(spy),
    )
    record = await call_tool(pipeline, "guarded", {"q": "x"}, call_id="sc1")

    effective = {"q": "x", "dry": True}
    assert runs.inputs == []
    assert spy.calls == []
    assert record.result == ToolResult.success("from cache")
    assert record.status is SettlementStatus.COMPLETED
    assert record.synthetic_start and not record.tool_ran
    assert record.effective_input == effective
    assert journal.kinds("sc1") == ["scheduled", "started", "settled"]
    assert entry(journal, "sc1", "scheduled")["side_effect"] == tool.resolve_behavior({"q": "x"}).side_effect.value
    started = entry(journal, "sc1", "started")
    assert started == {
        "input": effective,
        "side_effect": tool.resolve_behavior(effective).side_effect.value,
        "synthetic": True,
    }
    # the resolved (narrowed) side effect differs from the scheduled one: it was really resolved
    assert started["side_effect"] != entry(journal, "sc1", "scheduled")["side_effect"]
    assert entry(journal, "sc1", "settled")["status"] == "completed"


async def test_error_short_circuit_settles_from_scheduled() -> None:
    runs = Runs()
    spy = StageSpy()

    async def refuse(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return ToolResult.failure(ToolErrorType.EXECUTION, "quota exceeded", code="quota")

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], middleware=[refuse], journal=journal, stages=spied_stages(spy))
    record = await call_tool(pipeline, "echo", {"q": "x"}, call_id="e1")
    assert journal.kinds("e1") == ["scheduled", "settled"]
    assert entry(journal, "e1", "settled")["status"] == "failed"
    assert record.status is SettlementStatus.FAILED
    assert record.result.error is not None and record.result.error.code == "quota"
    assert not record.synthetic_start and not record.tool_ran
    assert runs.inputs == [] and spy.calls == []


# -- pre-run rules -------------------------------------------------------------


def fresh_context(request: ToolMiddlewareRequest) -> ExecutionContext:
    ctx = request.context
    return ExecutionContext(
        ctx.session_id,
        ctx.agent_id,
        ctx.request_id,
        ctx.turn_id,
        ctx.tool_call_id,
        ctx.idempotency_key,
        ctx.abort,
        lambda: None,
    )


VIOLATIONS: dict[str, tuple[Any, str]] = {
    "rename": (lambda req: ToolMiddlewareRequest("other", req.input, req.context), "cannot change the tool name"),
    "context_evolved": (
        lambda req: ToolMiddlewareRequest(req.tool_name, req.input, attrs.evolve(req.context)),
        "cannot replace the execution context",
    ),
    "context_fresh": (
        lambda req: ToolMiddlewareRequest(req.tool_name, req.input, fresh_context(req)),
        "cannot replace the execution context",
    ),
    "interrupt": (
        lambda req: req.replace(input={**req.input, "mode": "block"}),
        "cannot change the tool interrupt behavior",
    ),
}


@pytest.mark.parametrize("swallow", [False, True], ids=["raise", "swallow"])
@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("violation", sorted(VIOLATIONS))
async def test_pre_run_rules_at_every_layer_before_nested_short_circuit(
    violation: str, position: int, swallow: bool
) -> None:
    make_request, phrase = VIOLATIONS[violation]
    runs = Runs()
    other_runs = Runs()
    entered: list[str] = []

    async def violate(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        entered.append(f"L{position}")
        try:
            return await call_next(make_request(request))
        except Exception:
            if not swallow:
                raise
            return ToolResult.success("swallowed")

    def plain(i: int) -> Any:
        async def mw(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
            entered.append(f"L{i}")
            return await call_next()

        return mw

    layers: list[Any] = [plain(i) for i in range(position)] + [violate]
    # every layer inside the violating one would short-circuit with success
    layers += [short_circuit_ok("cached", entered, f"L{i}") for i in range(position + 1, 3)]
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline(
        [behaving_tool(runs), echo_tool(other_runs, name="other")], middleware=layers, journal=journal
    )
    record = await call_tool(pipeline, "guarded", {"q": "x", "mode": "normal"}, call_id="v1")

    assert entered == [f"L{i}" for i in range(position + 1)]
    assert runs.inputs == [] and other_runs.inputs == []
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.EXECUTION
    assert "Tool middleware failed" in record.result.error.message
    assert phrase in record.result.error.message
    assert record.status is SettlementStatus.FAILED
    assert not record.tool_ran and not record.synthetic_start
    assert journal.kinds("v1") == ["scheduled", "settled"]


async def test_input_change_keeping_interrupt_behavior_is_allowed() -> None:
    runs = Runs()

    async def change(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next(request.replace(input={**request.input, "mode": "other"}))

    pipeline = ToolPipeline([behaving_tool(runs)], middleware=[change])
    record = await call_tool(pipeline, "guarded", {"q": "x", "mode": "normal"})
    assert record.result == ToolResult.success(echo_output({"q": "x"}))
    assert runs.inputs == [{"q": "x", "mode": "other"}]


async def test_retrying_call_next_after_a_violation_does_not_run_the_tool() -> None:
    runs = Runs()
    errors: list[BaseException] = []

    async def retry(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        try:
            return await call_next(ToolMiddlewareRequest("other", request.input, request.context))
        except Exception as exc:
            errors.append(exc)
        return await call_next()

    record = await call_tool(ToolPipeline([echo_tool(runs)], middleware=[retry]), "echo", {"q": "x"})
    assert runs.inputs == []
    assert len(errors) == 1
    assert record.result.error is not None
    assert "cannot change the tool name" in record.result.error.message


async def test_in_place_input_mutation_cannot_change_interrupt_behavior() -> None:
    runs = Runs()

    async def mutate(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        request.input["mode"] = "block"
        return await call_next()

    pipeline = ToolPipeline([behaving_tool(runs)], middleware=[mutate])
    record = await call_tool(pipeline, "guarded", {"q": "x", "mode": "normal"})
    assert runs.inputs == []
    assert record.result.error is not None
    assert "cannot change the tool interrupt behavior" in record.result.error.message


async def test_in_place_input_mutation_started_records_side_effect_of_final_input() -> None:
    runs = Runs()
    tool = behaving_tool(runs)

    async def mutate(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        request.input["dry"] = False
        return await call_next()

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([tool], middleware=[mutate], journal=journal)
    await call_tool(pipeline, "guarded", {"q": "x", "dry": True}, call_id="m2")
    (final_input,) = runs.inputs
    started = entry(journal, "m2", "started")
    assert started["input"] == final_input
    assert started["side_effect"] == tool.resolve_behavior(final_input).side_effect.value
    assert started["side_effect"] != entry(journal, "m2", "scheduled")["side_effect"]


async def test_in_place_input_mutation_does_not_rewrite_the_scheduled_entry() -> None:
    runs = Runs()

    async def mutate(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        request.input["q"] = "changed"
        return await call_next()

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], middleware=[mutate], journal=journal)
    record = await call_tool(pipeline, "echo", {"q": "model"}, call_id="m3")
    assert runs.inputs == [{"q": "changed"}]
    assert entry(journal, "m3", "scheduled")["input"] == {"q": "model"}
    assert entry(journal, "m3", "started")["input"] == {"q": "changed"}
    assert record.effective_input == {"q": "changed"}


async def test_in_place_input_mutation_does_not_rewrite_the_model_call() -> None:
    runs = Runs()

    async def mutate(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        request.input["q"] = "changed"
        return await call_next()

    pipeline = ToolPipeline([echo_tool(runs)], middleware=[mutate])
    call = ToolCall("m4", "echo", {"q": "model"})
    record = await pipeline.execute(call)
    assert runs.inputs == [{"q": "changed"}]
    assert call.input == {"q": "model"}
    assert record.call.input == {"q": "model"}


# -- after-core rules ----------------------------------------------------------


def counting_tool(counter: list[int], *, fail: bool = False, name: str = "count") -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        counter.append(1)
        if fail:
            raise RuntimeError("core broke")
        return f"core-{len(counter)}"

    return define_tool(run, name=name, description="c", side_effect="pure", input_schema={"type": "object"})


@pytest.mark.parametrize("swallow", [False, True])
async def test_second_call_next_raises_and_core_runs_once(swallow: bool) -> None:
    counter: list[int] = []
    raised: list[BaseException] = []

    async def twice(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        first = await call_next()
        try:
            await call_next()
        except NextCalledTwiceError as exc:
            raised.append(exc)
            if not swallow:
                raise
        return first

    record = await call_tool(ToolPipeline([counting_tool(counter)], middleware=[twice]), "count", {})
    assert len(counter) == 1
    assert len(raised) == 1 and "next() called multiple times" in str(raised[0])
    assert record.result == ToolResult.success("core-1")
    assert FaultCode.NEXT_CALLED_TWICE in codes(record)
    assert record.status is SettlementStatus.COMPLETED


async def test_second_call_next_from_inner_layer_with_new_input() -> None:
    counter: list[int] = []

    async def twice(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await call_next()
        return await call_next(request.replace(input={"again": True}))

    record = await call_tool(ToolPipeline([counting_tool(counter)], middleware=[passthrough, twice]), "count", {})
    assert len(counter) == 1
    assert record.result == ToolResult.success("core-1")
    assert FaultCode.NEXT_CALLED_TWICE in codes(record)


async def test_failed_core_cannot_be_turned_into_success() -> None:
    counter: list[int] = []

    async def whitewash(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await call_next()
        return ToolResult.success("all good")

    record = await call_tool(ToolPipeline([counting_tool(counter, fail=True)], middleware=[whitewash]), "count", {})
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.EXECUTION
    assert "core broke" in record.result.error.message
    assert record.status is SettlementStatus.FAILED
    assert codes(record) == [FaultCode.FAILED_CORE_TURNED_SUCCESS]


async def test_failed_core_may_be_transformed_as_an_error() -> None:
    counter: list[int] = []

    async def reword(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        result = await call_next()
        return attrs.evolve(result, output="Error: reworded")

    record = await call_tool(ToolPipeline([counting_tool(counter, fail=True)], middleware=[reword]), "count", {})
    assert record.result.output == "Error: reworded"
    assert record.faults == ()


def sleeping_tool(timeout: float | None = None) -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        await trio.sleep_forever()
        return "never"

    return define_tool(
        run, name="sleepy", description="s", side_effect="pure", input_schema={"type": "object"}, timeout=timeout
    )


@pytest.mark.parametrize(
    "replacement",
    [ToolResult.success("fine"), ToolResult.failure(ToolErrorType.EXECUTION, "other")],
    ids=["success", "other-error"],
)
async def test_timeout_cannot_be_overwritten(autojump_clock: Any, replacement: ToolResult) -> None:
    seen: list[ToolResult] = []

    async def overwrite(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        seen.append(await call_next())
        return replacement

    start = trio.current_time()
    record = await call_tool(ToolPipeline([sleeping_tool(timeout=0.01)], middleware=[overwrite]), "sleepy", {})
    assert trio.current_time() - start == pytest.approx(0.01)
    assert record.result == seen[0]
    assert record.result.error is not None and record.result.error.type is ToolErrorType.TIMEOUT
    assert record.tool_ran
    assert codes(record) == [FaultCode.TIMEOUT_OVERWRITTEN]


async def test_cancellation_cannot_be_overwritten() -> None:
    abort = AbortHandle()

    async def overwrite(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await call_next()
        return ToolResult.success("fine")

    pipeline = ToolPipeline([sleeping_tool()], middleware=[overwrite])
    records = []
    async with trio.open_nursery() as nursery:

        async def go() -> None:
            records.append(await call_tool(pipeline, "sleepy", {}, abort=abort))

        nursery.start_soon(go)
        await trio.testing.wait_all_tasks_blocked()
        abort.abort()
    (record,) = records
    assert record.result.error is not None and record.result.error.type is ToolErrorType.INTERRUPTED
    assert record.status is SettlementStatus.CANCELLED
    assert codes(record) == [FaultCode.CANCELLATION_OVERWRITTEN]


async def test_middleware_raising_after_core_keeps_core_result() -> None:
    counter: list[int] = []

    async def explode(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await call_next()
        raise ValueError("after")

    journal = InMemoryToolJournal()
    record = await call_tool(
        ToolPipeline([counting_tool(counter)], middleware=[explode], journal=journal), "count", {}, call_id="a1"
    )
    assert record.result == ToolResult.success("core-1")
    assert codes(record) == [FaultCode.MIDDLEWARE_RAISED_AFTER_CORE]
    assert "ValueError" in record.faults[0].message
    assert journal.kinds("a1") == ["scheduled", "started", "settled"]


async def test_middleware_raising_before_core_is_an_error_result() -> None:
    counter: list[int] = []

    async def explode(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        raise ValueError("before")

    journal = InMemoryToolJournal()
    record = await call_tool(
        ToolPipeline([counting_tool(counter)], middleware=[explode], journal=journal), "count", {}, call_id="b1"
    )
    assert counter == []
    assert record.result.error is not None
    assert record.result.error.message.startswith("Tool middleware failed")
    assert "before" in record.result.error.message
    assert record.status is SettlementStatus.FAILED
    assert journal.kinds("b1") == ["scheduled", "settled"]


@pytest.mark.parametrize("call_core", [False, True])
async def test_middleware_returning_non_tool_result(call_core: bool) -> None:
    counter: list[int] = []

    async def wrong(request: ToolMiddlewareRequest, call_next: Any) -> Any:
        if call_core:
            await call_next()
        return {"not": "a ToolResult"}

    record = await call_tool(ToolPipeline([counting_tool(counter)], middleware=[wrong]), "count", {})
    if call_core:
        assert record.result == ToolResult.success("core-1")
        assert codes(record) == [FaultCode.MIDDLEWARE_RAISED_AFTER_CORE]
    else:
        assert counter == []
        assert record.result.error is not None
        assert "Tool middleware failed" in record.result.error.message
        assert "expected ToolResult" in record.result.error.message


# -- lease ---------------------------------------------------------------------


async def test_lease_revoked_before_execute_raises_and_middleware_is_never_entered() -> None:
    counter: list[int] = []
    entered: list[str] = []

    async def spy(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        entered.append("mw")
        return await call_next()

    lease = LeaseStub()
    pipeline = ToolPipeline([counting_tool(counter)], middleware=[spy], journal=lease)
    lease.revoke()
    with pytest.raises(LeaseLostError):
        await call_tool(pipeline, "count", {}, call_id="l1")
    assert entered == [] and counter == []
    assert "settled" not in lease.kinds("l1")
    assert list(pipeline.history) == []


@pytest.mark.parametrize("layers", [0, 1])
async def test_lease_revoked_while_tool_runs_is_never_a_result(layers: int) -> None:
    lease = LeaseStub()
    ran: list[int] = []

    async def run(inp: dict[str, Any], ctx: Any) -> str:
        ran.append(1)
        lease.revoke()
        return "done"

    async def catch_all(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        try:
            return await call_next()
        except Exception:
            return ToolResult.success("covered up")

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    pipeline = ToolPipeline([tool], middleware=[catch_all][:layers], journal=lease)
    with pytest.raises(LeaseLostError):
        await call_tool(pipeline, "t", {}, call_id="l2")
    assert ran == [1]
    assert lease.kinds("l2") == ["scheduled", "started"]
    assert list(pipeline.history) == []


async def test_lease_revoked_during_unwind_is_raised_before_settlement() -> None:
    lease = LeaseStub()
    counter: list[int] = []

    async def revoke_after(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        result = await call_next()
        lease.revoke()
        return result

    pipeline = ToolPipeline([counting_tool(counter)], middleware=[revoke_after], journal=lease)
    with pytest.raises(LeaseLostError):
        await call_tool(pipeline, "count", {}, call_id="l3")
    assert counter == [1]
    assert "settled" not in lease.kinds("l3")
    assert list(pipeline.history) == []


WHERE_A_LEASE_LOSS_IS_RAISED = ["tool", "before stage", "post_tool stage", "middleware"]


def lease_losing_pipeline(where: str, lease: LeaseStub, *, own: bool) -> ToolPipeline:
    """A pipeline whose tool, stage or middleware raises `LeaseLostError`: for this journal's lease
    (*own*: it revokes the lease first) or for a store of its own (this lease still holds)."""

    def lose() -> None:
        if own:
            lease.revoke()
        raise LeaseLostError("the lease of the store it drives was lost")

    async def run(inp: dict[str, Any], ctx: Any) -> str:
        if where == "tool":
            lose()
        return "done"

    async def before(request: StageRequest) -> None:
        lose()

    async def post_tool(request: StageRequest, result: ToolResult) -> None:
        lose()

    async def middleware(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        lose()
        raise AssertionError("unreachable")

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    stages = ToolStages(
        before=[before] if where == "before stage" else [], post_tool=[post_tool] if where == "post_tool stage" else []
    )
    return ToolPipeline([tool], journal=lease, stages=stages, middleware=[middleware] if where == "middleware" else [])


@pytest.mark.parametrize("where", WHERE_A_LEASE_LOSS_IS_RAISED)
async def test_a_lease_loss_a_tool_stage_or_middleware_raises_for_another_store_fails_only_that_call(
    where: str,
) -> None:
    lease = LeaseStub()
    pipeline = lease_losing_pipeline(where, lease, own=False)
    record = await call_tool(pipeline, "t", {}, call_id="c1")
    assert lease.kinds("c1")[-1] == "settled"
    assert list(pipeline.history) == [record]
    if where == "post_tool stage":  # a post_tool stage that raises is a fault too, and fails the call
        assert [fault.code for fault in record.faults] == [FaultCode.MIDDLEWARE_RAISED_AFTER_CORE]
    assert record.status is SettlementStatus.FAILED
    assert record.result.error is not None and record.result.error.type is ToolErrorType.EXECUTION
    assert "the lease of the store it drives was lost" in record.result.error.message


@pytest.mark.parametrize("where", WHERE_A_LEASE_LOSS_IS_RAISED)
async def test_a_lease_loss_a_tool_stage_or_middleware_raises_for_this_journal_is_raised(where: str) -> None:
    lease = LeaseStub()
    pipeline = lease_losing_pipeline(where, lease, own=True)
    with pytest.raises(LeaseLostError):
        await call_tool(pipeline, "t", {}, call_id="c1")
    assert "settled" not in lease.kinds("c1")
    assert list(pipeline.history) == []


async def test_lease_revoked_before_a_short_circuit_is_raised() -> None:
    lease = LeaseStub()

    async def revoke_and_answer(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        lease.revoke()
        return ToolResult.success("cached")

    pipeline = ToolPipeline([counting_tool([])], middleware=[revoke_and_answer], journal=lease)
    with pytest.raises(LeaseLostError):
        await call_tool(pipeline, "count", {}, call_id="l4")
    assert lease.kinds("l4") == ["scheduled"]
    assert list(pipeline.history) == []


# -- journal failures ------------------------------------------------------------


async def test_scheduled_write_failure_raises_before_middleware() -> None:
    counter: list[int] = []
    entered: list[str] = []

    async def spy(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        entered.append("mw")
        return await call_next()

    journal = FailingJournal("scheduled")
    pipeline = ToolPipeline([counting_tool(counter)], middleware=[spy], journal=journal)
    with pytest.raises(JournalError):
        await call_tool(pipeline, "count", {})
    assert entered == [] and counter == []
    assert journal.entries == []
    assert list(pipeline.history) == []


@pytest.mark.parametrize("layers", [0, 1])
async def test_started_write_failure_propagates_and_tool_does_not_run(layers: int) -> None:
    counter: list[int] = []

    async def catch_all(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        try:
            return await call_next()
        except Exception:
            return ToolResult.success("covered up")

    journal = FailingJournal("started")
    pipeline = ToolPipeline([counting_tool(counter)], middleware=[catch_all][:layers], journal=journal)
    with pytest.raises(JournalError) as info:
        await call_tool(pipeline, "count", {}, call_id="j2")
    assert not isinstance(info.value, SettlementError)
    assert counter == []
    # The journal still takes writes (it is not fenced): the call is closed, cancelled and unpublished.
    assert journal.kinds("j2") == ["scheduled", "settled"]
    assert entry(journal, "j2", "settled")["status"] == "cancelled"
    assert entry(journal, "j2", "settled")["published"] is False
    assert list(pipeline.history) == []


class FailFirstStart(InMemoryToolJournal):
    """Fails the first tool_started write only, as a transient store error would."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    async def on_execution_started(self, call: Any, input: Any, side_effect: Any, *, synthetic: bool) -> None:
        if not self.failures:
            self.failures += 1
            raise JournalError("transient failure writing tool_started")
        await super().on_execution_started(call, input, side_effect, synthetic=synthetic)


async def test_started_write_failure_cannot_be_swallowed_into_a_short_circuit() -> None:
    counter: list[int] = []

    async def swallow(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        try:
            return await call_next()
        except JournalError:
            return ToolResult.success("pretend it ran")

    journal = FailFirstStart()
    pipeline = ToolPipeline([counting_tool(counter)], middleware=[swallow], journal=journal)
    with pytest.raises(JournalError):
        await call_tool(pipeline, "count", {}, call_id="j5")
    assert journal.failures == 1
    assert counter == []
    assert journal.kinds("j5") == ["scheduled", "settled"]  # closed as cancelled, never a success
    assert entry(journal, "j5", "settled")["status"] == "cancelled"
    assert list(pipeline.history) == []


async def test_synthetic_start_write_failure_propagates() -> None:
    journal = FailingJournal("started")
    pipeline = ToolPipeline([counting_tool([])], middleware=[short_circuit_ok("cached")], journal=journal)
    with pytest.raises(JournalError):
        await call_tool(pipeline, "count", {}, call_id="j3")
    assert journal.kinds("j3") == ["scheduled", "settled"]  # closed as cancelled, unpublished
    assert entry(journal, "j3", "settled")["status"] == "cancelled"
    assert entry(journal, "j3", "settled")["published"] is False
    assert list(pipeline.history) == []


@pytest.mark.parametrize("layers", [0, 1])
async def test_settlement_failure_raises_and_publishes_nothing(layers: int) -> None:
    counter: list[int] = []
    journal = FailingJournal("settled")
    recorder = ItemRecorder()
    pipeline = ToolPipeline([counting_tool(counter)], middleware=[passthrough][:layers], journal=journal)
    with pytest.raises(SettlementError):
        await call_tool(pipeline, "count", {}, call_id="j4", on_item=recorder)
    assert counter == [1]
    assert journal.kinds("j4") == ["scheduled", "started"]
    assert list(pipeline.history) == []


# -- stages ------------------------------------------------------------------------


async def test_pre_tool_allow_with_input_modifies_input() -> None:
    runs = Runs()
    journal = InMemoryToolJournal()
    stages = ToolStages(pre_tool=[StageSpy().stage("pre", Allow(input={"q": "from-stage"}))])
    pipeline = ToolPipeline([echo_tool(runs)], stages=stages, journal=journal)
    record = await call_tool(pipeline, "echo", {"q": "model"}, call_id="s1")
    assert runs.inputs == [{"q": "from-stage"}]
    assert entry(journal, "s1", "started")["input"] == {"q": "from-stage"}
    assert record.effective_input == {"q": "from-stage"}
    assert record.result == ToolResult.success(echo_output({"q": "from-stage"}))


async def test_permission_deny_cancels_without_running() -> None:
    runs = Runs()
    spy = StageSpy()
    journal = InMemoryToolJournal()
    stages = ToolStages(
        permission=[spy.stage("permission", Deny("not allowed here"))],
        before=[spy.stage("before")],
        guard=[spy.stage("guard")],
    )
    pipeline = ToolPipeline([echo_tool(runs)], stages=stages, journal=journal)
    record = await call_tool(pipeline, "echo", {"q": "x"}, call_id="s2")
    assert runs.inputs == []
    assert spy.names() == ["permission"]
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.PERMISSION_DENIED
    assert record.status is SettlementStatus.CANCELLED
    assert journal.kinds("s2") == ["scheduled", "settled"]
    assert entry(journal, "s2", "settled")["status"] == "cancelled"


@pytest.mark.parametrize("stage", ["pre_tool", "permission", "before", "guard"])
async def test_raising_stage_fails_closed(stage: str) -> None:
    runs = Runs()

    async def broken(request: StageRequest) -> Any:
        raise RuntimeError("hook crashed")

    pipeline = ToolPipeline([echo_tool(runs)], stages=ToolStages(**{stage: [broken]}))
    record = await call_tool(pipeline, "echo", {"q": "x"})
    assert runs.inputs == []
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.EXECUTION
    assert record.result.error.code == "hook_error"
    assert "hook crashed" in record.result.error.message


@pytest.mark.parametrize("first", [Allow(), Allow(input={"q": "first"}), Deny("no")], ids=repr)
async def test_before_stage_first_decision_wins(first: Any) -> None:
    runs = Runs()
    spy = StageSpy()
    stages = ToolStages(before=[spy.stage("before1", first), spy.stage("before2", Allow(input={"q": "second"}))])
    record = await call_tool(ToolPipeline([echo_tool(runs)], stages=stages), "echo", {"q": "model"})
    assert spy.names() == ["before1"]
    if isinstance(first, Deny):
        assert runs.inputs == [] and not record.result.ok
    else:
        expected = first.input or {"q": "model"}
        assert runs.inputs == [expected]


async def test_before_stage_without_decision_passes_on() -> None:
    runs = Runs()
    spy = StageSpy()
    stages = ToolStages(before=[spy.stage("before1", None), spy.stage("before2", Allow(input={"q": "second"}))])
    await call_tool(ToolPipeline([echo_tool(runs)], stages=stages), "echo", {"q": "model"})
    assert spy.names() == ["before1", "before2"]
    assert runs.inputs == [{"q": "second"}]


async def test_guard_sees_final_validated_input() -> None:
    runs = Runs()
    spy = StageSpy()

    async def add_mode(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next(request.replace(input={**request.input, "mode": "normal"}))

    stages = ToolStages(
        pre_tool=[spy.stage("pre", Allow(input={"q": "pre"}))],
        before=[spy.stage("before", Allow(input={"q": "final", "mode": "normal"}))],
        guard=[spy.stage("guard")],
    )
    pipeline = ToolPipeline([behaving_tool(runs)], middleware=[add_mode], stages=stages)
    await call_tool(pipeline, "guarded", {"q": "model"})
    assert spy.calls == [
        ("pre", {"q": "model", "mode": "normal"}),
        ("before", {"q": "pre"}),
        ("guard", {"q": "final", "mode": "normal"}),
    ]
    assert runs.inputs == [{"q": "final", "mode": "normal"}]


async def test_input_failing_schema_after_stages_is_a_validation_error() -> None:
    runs = Runs()
    spy = StageSpy()
    journal = InMemoryToolJournal()
    stages = ToolStages(pre_tool=[spy.stage("pre", Allow(input={"q": 5}))], guard=[spy.stage("guard")])
    pipeline = ToolPipeline([echo_tool(runs)], stages=stages, journal=journal)
    record = await call_tool(pipeline, "echo", {"q": "fine"}, call_id="s3")
    assert runs.inputs == []
    assert spy.names() == ["pre"]
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.VALIDATION
    assert record.result.error.code == "invalid_input"
    assert journal.kinds("s3") == ["scheduled", "settled"]


async def test_post_tool_replaces_success() -> None:
    runs = Runs()
    spy = StageSpy()
    stages = ToolStages(post_tool=[spy.post("post", ToolResult.success("replaced"))])
    record = await call_tool(ToolPipeline([echo_tool(runs)], stages=stages), "echo", {"q": "x"})
    assert record.result == ToolResult.success("replaced")
    assert spy.calls == [("post", {"q": "x"})]


async def test_post_tool_cannot_turn_error_into_success() -> None:
    counter: list[int] = []
    spy = StageSpy()
    stages = ToolStages(post_tool=[spy.post("post", ToolResult.success("replaced"))])
    record = await call_tool(ToolPipeline([counting_tool(counter, fail=True)], stages=stages), "count", {})
    assert spy.names() == ["post"]
    assert record.result.error is not None and "core broke" in record.result.error.message
    assert record.status is SettlementStatus.FAILED


async def test_post_tool_may_turn_success_into_error() -> None:
    runs = Runs()
    failure = ToolResult.failure(ToolErrorType.EXECUTION, "rejected by post hook")
    stages = ToolStages(post_tool=[StageSpy().post("post", failure)])
    record = await call_tool(ToolPipeline([echo_tool(runs)], stages=stages), "echo", {"q": "x"})
    assert record.result == failure
    assert record.status is SettlementStatus.FAILED


# -- tool outcomes -----------------------------------------------------------------


async def test_unknown_tool_is_a_validation_error() -> None:
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(Runs())], journal=journal)
    record = await call_tool(pipeline, "nope", {"q": "x"}, call_id="u1")
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.VALIDATION
    assert record.result.error.code == "unknown_tool"
    assert "echo" in record.result.error.message
    assert record.status is SettlementStatus.FAILED
    assert list(pipeline.history) == [record]


@pytest.mark.parametrize(
    ("behaviour", "error_type", "output"),
    [
        ("raise", ToolErrorType.EXECUTION, None),
        ("network", ToolErrorType.NETWORK, None),
        ("plain", None, {"answer": 42}),
        ("none", None, None),
    ],
)
async def test_tool_outcomes(behaviour: str, error_type: ToolErrorType | None, output: Any) -> None:
    async def run(inp: dict[str, Any], ctx: Any) -> Any:
        if behaviour == "raise":
            raise KeyError("missing")
        if behaviour == "network":
            raise ToolFailure("connection reset", type=ToolErrorType.NETWORK, code="econnreset")
        return output

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    record = await call_tool(ToolPipeline([tool]), "t", {})
    if error_type is None:
        assert record.result == ToolResult.success(output)
        assert record.status is SettlementStatus.COMPLETED
    else:
        assert record.result.error is not None
        assert record.result.error.type is error_type
        assert record.status is SettlementStatus.FAILED
        if behaviour == "network":
            assert record.result.error.code == "econnreset"
            assert "connection reset" in record.result.error.message
        else:
            assert "KeyError" in record.result.error.message


class _BrokenFailure(ToolFailure):
    def __init__(self, message: str, how: str) -> None:
        super().__init__(message)
        self.how = how

    def to_result(self) -> ToolResult:
        if self.how == "raises":
            raise RuntimeError("no result")
        return ToolResult.success("not an error")


@pytest.mark.parametrize(
    ("failure", "error_type", "code", "mentions"),
    [
        # A value of ToolErrorType is taken as that type (as define_tool takes side_effect="pure").
        (lambda: ToolFailure("upstream timed out", type="timeout"), ToolErrorType.TIMEOUT, None, "upstream"),
        # Not a type: ToolFailure itself refuses it, inside the tool: that call's execution error.
        (lambda: ToolFailure("x", type="bogus"), ToolErrorType.EXECUTION, "tool_error", "'bogus'"),
        # Whatever a ToolFailure's to_result does, the call gets an error result.
        (lambda: _BrokenFailure("x", "raises"), ToolErrorType.EXECUTION, "tool_error", "no result"),
        (lambda: _BrokenFailure("x", "succeeds"), ToolErrorType.EXECUTION, "tool_error", "a success"),
    ],
)
async def test_tool_failure_of_any_shape_fails_its_call_alone(
    failure: Callable[[], ToolFailure], error_type: ToolErrorType, code: str | None, mentions: str
) -> None:
    async def run(inp: dict[str, Any], ctx: Any) -> Any:
        raise failure()

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    record = await call_tool(ToolPipeline([tool]), "t", {})
    assert record.status is SettlementStatus.FAILED
    assert record.result.error is not None
    assert record.result.error.type is error_type
    assert record.result.error.code == code
    assert mentions in record.result.error.message


class _StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ failed")


class _NothingPrints(_StrRaises):
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ failed")


class _StrNotAString(Exception):
    def __str__(self) -> Any:
        return 42


class _FailureStrRaises(ToolFailure):
    def __str__(self) -> str:
        raise RuntimeError("__str__ failed")


_UNPRINTABLE: list[Callable[[], Exception]] = [_StrRaises, _NothingPrints, _StrNotAString]


def test_describe_never_raises_and_keeps_what_it_can_read() -> None:
    from trio_agent._tools._results import describe

    assert describe(ValueError("bad")) == "ValueError: bad"
    assert describe(KeyError("path"), "repr") == "KeyError('path')"
    assert describe(ValueError("bad"), "text") == "bad"
    assert describe(_StrRaises()) == "_StrRaises()"  # the repr, when the message cannot be read
    assert describe(_StrNotAString(), "text") == "_StrNotAString()"
    for form in ("typed", "repr", "text"):
        assert describe(_NothingPrints(), form).startswith("_NothingPrints (unprintable")  # type: ignore[arg-type]


def _raising_in(where: str, make: Callable[[], Exception]) -> dict[str, Any]:
    """A pipeline's parts (the tool's callbacks, a middleware, a stage), *make*'s exception raised in *where*."""

    def raise_it(*_: Any) -> Any:
        raise make()

    async def run(inp: dict[str, Any], ctx: Any) -> Any:
        if where == "tool":
            raise make()
        if where == "tool_failure":
            raise _FailureStrRaises("x")
        return "ok"

    async def middleware(request: Any, call_next: Any) -> ToolResult:
        if where == "middleware":
            raise make()
        result: ToolResult = await call_next()
        return result

    async def pre(request: Any) -> None:
        raise_it()

    async def post(request: Any, result: ToolResult) -> None:
        raise_it()

    tool = define_tool(
        run,
        name="t",
        description="t",
        side_effect="pure",
        input_schema={"type": "object"},
        resolve_behavior=raise_it if where == "resolver" else None,
        affected_paths=raise_it if where == "affected_paths" else None,
    )
    stages = ToolStages(pre_tool=[pre] if where == "pre_tool" else [], post_tool=[post] if where == "post_tool" else [])
    return {"tools": [tool], "middleware": [middleware] if where == "middleware" else [], "stages": stages}


@pytest.mark.parametrize("make", _UNPRINTABLE)
@pytest.mark.parametrize(
    "where", ["tool", "tool_failure", "middleware", "pre_tool", "post_tool", "resolver", "affected_paths"]
)
async def test_an_exception_that_cannot_be_printed_still_fails_only_its_call(
    where: str, make: Callable[[], Exception]
) -> None:
    # Its __str__ or __repr__ raising (or returning no string) broke the describing of the
    # failure: the call raised out of execute instead of settling with an error result.
    parts = _raising_in(where, make)
    pipeline = ToolPipeline(parts["tools"], middleware=parts["middleware"], stages=parts["stages"])
    record = await call_tool(pipeline, "t", {})
    assert record.status is SettlementStatus.FAILED
    error = record.result.error
    assert error is not None and error.type is ToolErrorType.EXECUTION
    assert type(error.message) is str
    name = _FailureStrRaises.__name__ if where == "tool_failure" else make.__name__
    assert name in error.message


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"x": {1, 2}}, "the input.x is not JSON: set"),
        ({"x": float("nan")}, "the input.x is not a finite number: nan"),
        ({"x": (1, 2)}, "the input.x is not JSON: tuple"),
        ({"x": object()}, "the input.x is not JSON: object"),
        ({1: "x"}, "the input has a non-string key 1"),
        ({"x": [10**1000]}, "the input.x[0] is an integer too large for JSON (3322 bits, at most 2048)"),
    ],
)
@pytest.mark.parametrize("durable", [False, True], ids=["memory journal", "durable journal"])
async def test_a_call_whose_input_is_not_json_fails_alone_as_invalid_input(
    bad: dict[Any, Any], problem: str, durable: bool
) -> None:
    # A durable journal's event check raised ValueError out of execute() (the turn lost, its other
    # calls too); with the in-memory one the tool ran with a set or NaN as its input.
    from trio_agent.journal import MemoryStore, open_journal
    from trio_agent.testing import start_turn

    ran: list[Any] = []

    async def run(inp: dict[str, Any], ctx: Any) -> str:
        ran.append(inp)
        return "ran"

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    async with open_journal(MemoryStore(), session_id="s") as durable_journal:
        origin = await start_turn(durable_journal) if durable else None
        journal = durable_journal if durable else InMemoryToolJournal()
        pipeline = ToolPipeline([tool], journal=journal)
        record = await pipeline.execute(ToolCall("c1", "t", bad), origin)
        assert record.status is SettlementStatus.FAILED and not record.tool_ran and ran == []
        error = record.result.error
        assert error is not None and (error.type, error.code) == (ToolErrorType.VALIDATION, "invalid_input")
        assert error.message == f"invalid input for tool 't': at <root>: {problem}"
        assert error.details == {"errors": [f"at <root>: {problem}"]}
        # Refused before it was scheduled: the journal holds nothing of it, and the next call runs.
        if durable:
            assert durable_journal.call("c1") is None
        else:
            assert journal.kinds("c1") == []  # type: ignore[attr-defined]
        largest = (1 << 2048) - 1  # MAX_JSON_INT_BITS
        ok = await pipeline.execute(ToolCall("c2", "t", {"x": [1, largest]}), origin)
        assert ok.status is SettlementStatus.COMPLETED and ran == [{"x": [1, largest]}]


async def _passes(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
    result: ToolResult = await call_next()
    return result


@pytest.mark.parametrize("layers", [[], [_passes]], ids=["fast path", "middleware"])
async def test_emit_after_the_call_settled_raises_closed_resource_error(layers: list[Any]) -> None:
    # A task the tool left running emitted after the call had settled: its progress reached the
    # stream after the call's result, and its effect went onto a record already returned (never applied).
    settled = trio.Event()
    refused: list[BaseException] = []

    async def outlives_the_call(ctx: Any) -> None:
        await settled.wait()
        for item in (Progress("late"), Effect("new_messages", ["late"])):
            try:
                await ctx.emit(item)
            except trio.ClosedResourceError as exc:
                refused.append(exc)

    recorder = ItemRecorder()
    async with trio.open_nursery() as nursery:

        async def run(inp: dict[str, Any], ctx: Any) -> str:
            nursery.start_soon(outlives_the_call, ctx)
            await ctx.emit(Progress("while running"))
            return "ok"

        tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
        record = await call_tool(ToolPipeline([tool], middleware=layers), "t", {}, call_id="c1", on_item=recorder)
        settled.set()
    assert record.result.output == "ok" and record.effects == ()
    assert [item.message for item in recorder.items] == ["while running"]  # type: ignore[union-attr]
    assert len(refused) == 2 and all("'c1' has ended" in str(exc) for exc in refused)


# -- construction ------------------------------------------------------------------


def sync_mw(request: Any, call_next: Any) -> Any:
    return call_next()


async def agen_mw(request: Any, call_next: Any) -> Any:
    yield await call_next()


async def one_arg_mw(request: Any) -> Any:
    return None


async def three_arg_mw(request: Any, call_next: Any, extra: Any) -> Any:
    return None


@pytest.mark.parametrize("bad", [42, "mw", sync_mw, agen_mw, one_arg_mw, three_arg_mw, lambda r, n: n()], ids=repr)
async def test_bad_middleware_shape_is_rejected_naming_the_index(bad: Any) -> None:
    with pytest.raises(MiddlewareShapeError, match="#1"):
        ToolPipeline([echo_tool(Runs())], middleware=[passthrough, bad])


@pytest.mark.parametrize("bad", ["abc", passthrough, 42])
async def test_middleware_must_be_a_sequence(bad: Any) -> None:
    with pytest.raises(MiddlewareShapeError):
        ToolPipeline([echo_tool(Runs())], middleware=bad)


async def test_async_generator_middleware_is_named_as_such() -> None:
    with pytest.raises(MiddlewareShapeError, match="async generator"):
        ToolPipeline([echo_tool(Runs())], middleware=[agen_mw])


class CallableMiddleware:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        self.calls += 1
        return await call_next()

    async def method(self, request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        self.calls += 1
        return await call_next()


async def extra_default_mw(request: ToolMiddlewareRequest, call_next: Any, tag: str = "x") -> ToolResult:
    return await call_next()


async def test_valid_middleware_shapes_are_accepted() -> None:
    instance = CallableMiddleware()
    pipeline = ToolPipeline([echo_tool(Runs())], middleware=[instance, instance.method, extra_default_mw])
    record = await call_tool(pipeline, "echo", {"q": "x"})
    assert record.result.ok
    assert instance.calls == 2


async def test_partial_of_async_middleware_is_accepted() -> None:
    async def tagged(request: ToolMiddlewareRequest, call_next: Any, *, tag: str) -> ToolResult:
        result = await call_next()
        return attrs.evolve(result, output=f"{tag}:{result.output}")

    pipeline = ToolPipeline([echo_tool(Runs())], middleware=[functools.partial(tagged, tag="t")])
    record = await call_tool(pipeline, "echo", {"q": "x"})
    assert record.result.output == f"t:{echo_output({'q': 'x'})}"


async def test_duplicate_tool_names_are_rejected() -> None:
    with pytest.raises(ToolDefinitionError, match="duplicate"):
        ToolPipeline([echo_tool(Runs()), echo_tool(Runs())])


@pytest.mark.parametrize("value", [0, -1, "x", float("nan"), float("inf"), True, None])
@pytest.mark.parametrize("option", ["timeout", "lock_timeout", "cleanup_grace", "unwind_grace", "settle_grace"])
async def test_invalid_timeouts_are_config_errors(option: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=option.replace("_", ".")):
        ToolPipeline([echo_tool(Runs())], **{option: value})


@pytest.mark.parametrize("value", [0, -1, "x"])
async def test_invalid_tool_timeout_is_a_config_error(value: Any) -> None:
    with pytest.raises(ConfigError):
        sleeping_tool(timeout=value)


# -- history -----------------------------------------------------------------------


async def test_every_settled_call_is_in_history(autojump_clock: Any) -> None:
    async def slow(inp: dict[str, Any], ctx: Any) -> str:
        await trio.sleep(inp["seconds"])
        return f"slept {inp['seconds']}"

    tool = define_tool(
        slow,
        name="slow",
        description="s",
        side_effect="pure",
        input_schema={"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    )

    async def double(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        if request.input.get("cached"):
            return ToolResult.success("cached")
        return await call_next(request.replace(input={"seconds": request.input["seconds"] * 2}))

    pipeline = ToolPipeline([tool], middleware=[double])
    records = [
        await call_tool(pipeline, "slow", {"seconds": 1}),
        await call_tool(pipeline, "slow", {"seconds": 2}),
        await call_tool(pipeline, "slow", {"seconds": 0, "cached": True}),
        await call_tool(pipeline, "slow", {"seconds": "bad"}),
        await call_tool(pipeline, "missing", {}),
    ]
    assert list(pipeline.history) == records
    assert [r.call.id for r in pipeline.history] == [r.call.id for r in records]
    assert records[0].effective_input == {"seconds": 2}
    assert records[0].result == ToolResult.success("slept 2")
    assert records[0].duration == pytest.approx(2)
    assert records[1].effective_input == {"seconds": 4}
    assert records[1].duration == pytest.approx(4)
    assert records[2].result == ToolResult.success("cached") and records[2].duration == 0
    assert records[3].result.error is not None
    assert records[4].effective_input is None
    for record in records:
        assert record.scheduled_at <= record.ended_at
    for earlier, later in itertools.pairwise(records):
        assert earlier.ended_at <= later.scheduled_at


# -- property: random middleware stacks --------------------------------------------

ACTIONS = ("pass", "input", "result", "short_ok", "short_err")


def make_layer(i: int, action: str, entered: list[int]) -> Any:
    async def mw(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        entered.append(i)
        trail = request.input["trail"]
        if action == "pass":
            return await call_next()
        if action == "input":
            return await call_next(request.replace(input={"trail": [*trail, f"i{i}"]}))
        if action == "result":
            result = await call_next()
            return attrs.evolve(result, output=f"{result.output}|r{i}")
        if action == "short_ok":
            return ToolResult.success(f"sc{i}<{','.join(trail)}>")
        return ToolResult.failure(ToolErrorType.EXECUTION, f"sc{i}<{','.join(trail)}>")

    return mw


def check_journal_order(kinds: list[str]) -> None:
    assert kinds[0] == "scheduled"
    assert kinds.count("scheduled") == 1
    assert kinds.count("settled") == 1 and kinds[-1] == "settled"
    assert kinds.count("started") <= 1
    if "started" in kinds:
        assert kinds.index("started") < kinds.index("settled")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(st.sampled_from(ACTIONS), min_size=0, max_size=8), tool_fails=st.booleans())
def test_random_middleware_stacks_match_the_model(actions: list[str], tool_fails: bool) -> None:
    entered: list[int] = []
    tool_inputs: list[dict[str, Any]] = []

    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        tool_inputs.append(inp)
        if tool_fails:
            raise ToolFailure(f"tool<{','.join(inp['trail'])}>")
        return ToolResult.success(f"tool<{','.join(inp['trail'])}>")

    tool = define_tool(
        run,
        name="t",
        description="t",
        side_effect="pure",
        input_schema={
            "type": "object",
            "properties": {"trail": {"type": "array", "items": {"type": "string"}}},
            "required": ["trail"],
        },
    )
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline(
        [tool], middleware=[make_layer(i, a, entered) for i, a in enumerate(actions)], journal=journal
    )
    record = trio.run(call_tool, pipeline, "t", {"trail": []})

    # the model
    trail: list[str] = []
    stop = len(actions)
    for i, action in enumerate(actions):
        if action.startswith("short"):
            stop = i
            break
        if action == "input":
            trail.append(f"i{i}")
    text = f"<{','.join(trail)}>"
    short = actions[stop] if stop < len(actions) else None
    if short is None:
        expected = ToolResult.failure(ToolErrorType.EXECUTION, "tool" + text) if tool_fails else None
        expected = expected or ToolResult.success("tool" + text)
    elif short == "short_ok":
        expected = ToolResult.success(f"sc{stop}" + text)
    else:
        expected = ToolResult.failure(ToolErrorType.EXECUTION, f"sc{stop}" + text)
    output = expected.output
    for i in reversed(range(stop)):
        if actions[i] == "result":
            output = f"{output}|r{i}"
    expected = attrs.evolve(expected, output=output)

    assert entered == list(range(min(stop + 1, len(actions))))
    assert record.tool_ran == (short is None)
    assert tool_inputs == ([{"trail": trail}] if short is None else [])
    assert record.result == expected
    assert record.effective_input == {"trail": trail}
    assert record.faults == ()
    kinds = journal.kinds(record.call.id)
    check_journal_order(kinds)
    if short == "short_err":
        assert kinds == ["scheduled", "settled"]
    else:
        assert kinds == ["scheduled", "started", "settled"]
        started = entry(journal, record.call.id, "started")
        assert started["input"] == {"trail": trail}
        assert started["synthetic"] == (short == "short_ok")
        assert record.synthetic_start == (short == "short_ok")
    assert entry(journal, record.call.id, "settled")["result"] == expected


# -- more rules and edges -----------------------------------------------------------


async def test_non_object_input_from_middleware_is_a_violation() -> None:
    runs = Runs()

    async def listify(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next(request.replace(input=["not", "an", "object"]))  # type: ignore[arg-type]

    record = await call_tool(ToolPipeline([echo_tool(runs)], middleware=[listify]), "echo", {"q": "x"})
    assert runs.inputs == []
    assert record.result.error is not None
    assert "JSON object" in record.result.error.message


async def test_input_whose_behaviour_cannot_be_resolved_is_a_violation() -> None:
    runs = Runs()

    def resolve(inp: dict[str, Any]) -> BehaviorOverride | None:
        if inp.get("mode") == "explode":
            raise RuntimeError("resolver broke")
        return None

    tool = echo_tool(runs, name="fragile", resolve_behavior=resolve)

    async def explode(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        return await call_next(request.replace(input={**request.input, "mode": "explode"}))

    record = await call_tool(ToolPipeline([tool], middleware=[explode]), "fragile", {"q": "x"})
    assert runs.inputs == []
    assert record.result.error is not None
    assert "resolver broke" in record.result.error.message


async def test_behaviour_error_for_model_input_settles_without_middleware() -> None:
    runs = Runs()
    entered: list[str] = []

    def resolve(inp: dict[str, Any]) -> BehaviorOverride | None:
        raise RuntimeError("resolver broke")

    async def spy(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        entered.append("mw")
        return await call_next()

    journal = InMemoryToolJournal()
    tool = echo_tool(runs, name="fragile", resolve_behavior=resolve)
    pipeline = ToolPipeline([tool], middleware=[spy], journal=journal)
    record = await call_tool(pipeline, "fragile", {"q": "x"}, call_id="be")
    assert entered == [] and runs.inputs == []
    assert record.result.error is not None and record.result.error.code == "behavior_error"
    assert journal.kinds("be") == ["scheduled", "settled"]


@pytest.mark.parametrize("layers", [0, 1])
async def test_tool_mutating_its_input_does_not_change_the_recorded_final_input(layers: int) -> None:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        inp["q"] = "mutated by the tool"
        inp["extra"] = True
        return "done"

    tool = define_tool(run, name="mutator", description="m", side_effect="pure", input_schema={"type": "object"})
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([tool], middleware=[passthrough][:layers], journal=journal)
    record = await call_tool(pipeline, "mutator", {"q": "model"}, call_id="tm")
    started = entry(journal, "tm", "started")["input"]
    assert started == {"q": "model"}
    assert record.effective_input == started


async def test_abort_before_execute_never_enters_middleware() -> None:
    runs = Runs()
    entered: list[str] = []

    async def spy(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        entered.append("mw")
        return await call_next()

    abort = AbortHandle()
    abort.abort()
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], middleware=[spy], journal=journal)
    record = await call_tool(pipeline, "echo", {"q": "x"}, call_id="ab", abort=abort)
    assert entered == [] and runs.inputs == []
    assert record.result.error is not None and record.result.error.type is ToolErrorType.INTERRUPTED
    assert record.status is SettlementStatus.CANCELLED
    assert journal.kinds("ab") == ["scheduled", "settled"]


async def test_abort_while_middleware_waits_before_the_core() -> None:
    runs = Runs()
    never = trio.Event()

    async def slow_lookup(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await never.wait()
        return await call_next()

    abort = AbortHandle()
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], middleware=[slow_lookup], journal=journal)
    records = []
    async with trio.open_nursery() as nursery:

        async def go() -> None:
            records.append(await call_tool(pipeline, "echo", {"q": "x"}, call_id="aw", abort=abort))

        nursery.start_soon(go)
        await trio.testing.wait_all_tasks_blocked()
        abort.abort()
    (record,) = records
    assert runs.inputs == []
    assert record.result.error is not None and record.result.error.type is ToolErrorType.INTERRUPTED
    assert journal.kinds("aw") == ["scheduled", "settled"]


async def test_abort_after_core_completed_keeps_the_committed_result() -> None:
    runs = Runs()
    in_unwind = trio.Event()
    resume = trio.Event()

    async def slow_unwind(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        result = await call_next()
        in_unwind.set()
        await resume.wait()
        return attrs.evolve(result, output=f"[{result.output}]")

    abort = AbortHandle()
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], middleware=[slow_unwind], journal=journal)
    records = []
    async with trio.open_nursery() as nursery:

        async def go() -> None:
            records.append(await call_tool(pipeline, "echo", {"q": "x"}, call_id="ac", abort=abort))

        nursery.start_soon(go)
        await in_unwind.wait()
        abort.abort()
        await trio.testing.wait_all_tasks_blocked()
        resume.set()
    (record,) = records
    assert record.result == ToolResult.success(f"[{echo_output({'q': 'x'})}]")
    assert record.status is SettlementStatus.COMPLETED
    assert record.aborted is not None
    assert entry(journal, "ac", "settled")["status"] == "completed"


async def test_outside_cancel_during_unwind_settles_the_committed_result_then_propagates() -> None:
    runs = Runs()
    in_unwind = trio.Event()
    resume = trio.Event()

    async def slow_unwind(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        result = await call_next()
        in_unwind.set()
        await resume.wait()
        return attrs.evolve(result, output=f"[{result.output}]")

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], middleware=[slow_unwind], journal=journal)
    returned = []
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def go() -> None:
            with scope:
                returned.append(await call_tool(pipeline, "echo", {"q": "x"}, call_id="oc"))

        nursery.start_soon(go)
        await in_unwind.wait()
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        resume.set()
    assert returned == []  # the cancellation went on after settlement
    assert scope.cancelled_caught
    settled = entry(journal, "oc", "settled")
    assert settled["status"] == "completed"
    assert settled["result"] == ToolResult.success(f"[{echo_output({'q': 'x'})}]")


async def test_unwind_deadline_missed_withholds_the_result(autojump_clock: Any) -> None:
    runs = Runs()

    async def stuck(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        await call_next()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], middleware=[stuck], journal=journal, unwind_grace=3)
    start = trio.current_time()
    record = await call_tool(pipeline, "echo", {"q": "x"}, call_id="ud")
    assert trio.current_time() - start == pytest.approx(3)
    assert not record.published
    assert record.result.error is not None and record.result.error.code == "unwind_deadline_missed"
    assert codes(record) == [FaultCode.UNWIND_DEADLINE_MISSED]
    settled = entry(journal, "ud", "settled")
    assert settled["published"] is False
    assert settled["result"] == ToolResult.success(echo_output({"q": "x"}))


async def test_tool_timeout_wins_over_pipeline_timeout(autojump_clock: Any) -> None:
    pipeline = ToolPipeline([sleeping_tool(timeout=2)], timeout=5)
    start = trio.current_time()
    record = await call_tool(pipeline, "sleepy", {})
    assert trio.current_time() - start == pytest.approx(2)
    assert record.result.error is not None and record.result.error.type is ToolErrorType.TIMEOUT

    pipeline = ToolPipeline([sleeping_tool()], timeout=5)
    start = trio.current_time()
    record = await call_tool(pipeline, "sleepy", {})
    assert trio.current_time() - start == pytest.approx(5)
    assert record.result.error is not None and record.result.error.type is ToolErrorType.TIMEOUT
    assert record.status is SettlementStatus.FAILED


@pytest.mark.parametrize("answer", ["raises", "junk"])
async def test_a_post_tool_stage_that_fails_fails_the_call_closed_and_reports_a_fault(answer: str) -> None:
    # It kept the tool's raw result: a redaction stage that crashed passed the secret on to the
    # model, the stream and the journal, though stages fail closed.
    runs = Runs()

    async def broken(request: StageRequest, result: ToolResult) -> Any:
        if answer == "raises":
            raise RuntimeError("post hook crashed")
        return "redacted, honest"

    later: list[ToolResult] = []

    async def after(request: StageRequest, result: ToolResult) -> None:
        later.append(result)

    stages = ToolStages(post_tool=[broken, after])
    record = await call_tool(ToolPipeline([echo_tool(runs)], stages=stages), "echo", {"q": "secret"})
    assert runs.inputs == [{"q": "secret"}]  # the tool ran
    error = record.result.error
    assert error is not None and (error.type, error.code) == (ToolErrorType.EXECUTION, "hook_error")
    assert "broken" in error.message and "secret" not in str(record.result.output)
    assert record.status is SettlementStatus.FAILED
    assert later == [record.result]  # the stages after it see the failure, not the raw output
    if answer == "raises":
        assert codes(record) == [FaultCode.MIDDLEWARE_RAISED_AFTER_CORE]


@pytest.mark.parametrize("stage", ["pre_tool", "permission", "before", "guard"])
async def test_stage_returning_junk_fails_closed(stage: str) -> None:
    runs = Runs()

    async def junk(request: StageRequest) -> Any:
        return "yes please"

    record = await call_tool(ToolPipeline([echo_tool(runs)], stages=ToolStages(**{stage: [junk]})), "echo", {"q": "x"})
    assert runs.inputs == []
    assert record.result.error is not None and record.result.error.code == "hook_error"


@pytest.mark.parametrize("result", ["done", None, {"output": 1}], ids=repr)
async def test_a_skip_without_a_tool_result_fails_closed(result: Any) -> None:
    runs = Runs()

    async def skip(request: StageRequest) -> Skip:
        return Skip(result)

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], stages=ToolStages(before=[skip]), journal=journal)
    record = await call_tool(pipeline, "echo", {"q": "x"}, call_id="k1")
    assert runs.inputs == []
    assert record.status is SettlementStatus.FAILED
    assert record.result.error is not None and record.result.error.code == "hook_error"
    assert "Skip takes a ToolResult" in record.result.error.message
    assert journal.kinds("k1") == ["scheduled", "settled"]
    assert pipeline.scheduler.statistics().buckets["execute"] == (0, 0, 3)


def test_skip_and_deny_check_what_they_are_given() -> None:
    with pytest.raises(ConfigError, match="Skip takes a ToolResult, got str"):
        Skip("done")  # type: ignore[arg-type]
    # Deny takes an error type as ToolFailure does: the member or its value.
    assert Deny("no", type="timeout").type is ToolErrorType.TIMEOUT
    with pytest.raises(ConfigError, match="Deny type 'bogus' is not a ToolErrorType"):
        Deny("no", type="bogus")


@pytest.mark.parametrize("stage", ["pre_tool", "permission", "before", "guard"])
async def test_a_deny_with_its_type_as_a_value_ends_the_call_as_that_type(stage: str) -> None:
    runs = Runs()

    async def deny(request: StageRequest) -> Deny:
        return Deny("not allowed here", type="permission_denied")

    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([echo_tool(runs)], stages=ToolStages(**{stage: [deny]}), journal=journal)
    record = await call_tool(pipeline, "echo", {"q": "x"}, call_id="d1")
    assert runs.inputs == []
    assert record.status is SettlementStatus.CANCELLED
    assert record.result.error is not None and record.result.error.type is ToolErrorType.PERMISSION_DENIED
    assert entry(journal, "d1", "settled")["reason"] == "permission_denied"


async def test_guard_replacing_input_is_validated_again() -> None:
    runs = Runs()
    stages = ToolStages(guard=[StageSpy().stage("guard", Allow(input={"q": 7}))])
    record = await call_tool(ToolPipeline([echo_tool(runs)], stages=stages), "echo", {"q": "x"})
    assert runs.inputs == []
    assert record.result.error is not None and record.result.error.type is ToolErrorType.VALIDATION


async def test_fencing_token_is_visible_to_middleware_and_tool() -> None:
    lease = LeaseStub(token=41)
    seen: list[Any] = []

    async def run(inp: dict[str, Any], ctx: Any) -> str:
        seen.append(("tool", ctx.fencing_token, ctx.tool_call_id))
        return "ok"

    async def spy(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        seen.append(("mw", request.context.fencing_token, request.context.tool_call_id))
        lease.token += 1
        return await call_next()

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    await call_tool(ToolPipeline([tool], middleware=[spy], journal=lease), "t", {}, call_id="ft")
    assert seen == [("mw", 41, "ft"), ("tool", 42, "ft")]


async def test_concurrent_calls_keep_their_own_state() -> None:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        await trio.lowlevel.checkpoint()
        return f"out:{inp['q']}"

    async def layer(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        mine = request.input["q"]
        await trio.lowlevel.checkpoint()
        result = await call_next(request.replace(input={"q": mine + "!"}))
        await trio.lowlevel.checkpoint()
        return attrs.evolve(result, output=f"{result.output}|{mine}|{request.context.tool_call_id}")

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})
    pipeline = ToolPipeline([tool], middleware=[layer, layer])
    results: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        for i in range(20):

            async def go(i: int = i) -> None:
                results[i] = await call_tool(pipeline, "t", {"q": str(i)}, call_id=f"cc{i}")

            nursery.start_soon(go)
    for i, record in results.items():
        assert record.result.output == f"out:{i}!!|{i}!|cc{i}|{i}|cc{i}"
        assert record.effective_input == {"q": f"{i}!!"}
    assert len(pipeline.history) == 20


async def test_history_limit_keeps_the_latest_calls() -> None:
    pipeline = ToolPipeline([echo_tool(Runs())], history_limit=2)
    records = [await call_tool(pipeline, "echo", {"q": str(i)}) for i in range(4)]
    assert list(pipeline.history) == records[-2:]
    with pytest.raises(ConfigError):
        ToolPipeline([echo_tool(Runs())], history_limit=-1)


async def test_a_pipeline_without_history_keeps_nothing_however_many_share_the_empty_one() -> None:
    first, second = (ToolPipeline([echo_tool(Runs())], history_limit=0) for _ in range(2))
    for i in range(3):
        await call_tool(first, "echo", {"q": str(i)})
        await call_tool(second, "echo", {"q": str(i)})
    assert len(first.history) == len(second.history) == 0
    assert first.statistics()["history"] == 0


async def test_request_with_its_own_emit_is_honoured() -> None:
    """A request passed to call_next carrying a bound emit routes inner items through it."""

    async def run(input: dict[str, Any], ctx: Any) -> str:
        await ctx.emit(Progress("raw"))
        return "ok"

    tool = define_tool(run, name="t", description="t", side_effect="pure", input_schema={"type": "object"})

    async def upper_progress(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        outer = request.emit

        async def emit(item: Any) -> None:
            await outer(attrs.evolve(item, message=item.message.upper()) if isinstance(item, Progress) else item)

        return await call_next(attrs.evolve(request, emit=emit))

    recorder = ItemRecorder()
    pipeline = ToolPipeline([tool], middleware=[upper_progress])
    record = await call_tool(pipeline, "t", {}, on_item=recorder)
    assert record.result.output == "ok"
    assert [item.message for item in recorder.items if isinstance(item, Progress)] == ["RAW"]


async def test_a_tool_whose_own_nursery_fails_is_told_by_its_errors_not_the_group() -> None:
    # The model read "ExceptionGroup: Exceptions from Trio nursery (1 sub-exception)".
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        async def fails(message: str) -> None:
            raise ValueError(message)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails, "the disk is full")
        return "never"

    tool = define_tool(run, name="nursed", description="n", side_effect="pure", input_schema={"type": "object"})
    record = await call_tool(ToolPipeline([tool]), "nursed", {})
    assert record.result.error is not None and record.result.error.code == "tool_error"
    assert record.result.error.message == "ValueError: the disk is full"
