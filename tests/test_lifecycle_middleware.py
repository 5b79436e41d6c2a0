"""Chat middleware through its adapter: every hook, every decision, composition across several middleware.

Named after the sections of the spec notes (`tanstack-ai.md` 1.2 composition, 1.3 decisions,
1.4 inputs, 2.7 terminal hooks, 3.2 on_chunk). The loop driver is not used: the adapter's
`Lifecycle` hooks are driven directly with real `RunContext`s, and the tool stages run in a
real `ToolPipeline`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent._abort import Abort, AbortHandle, AbortReason
from trio_agent._errors import ConfigError, MiddlewareError, MiddlewareShapeError, ModelError, RequestAbortedError
from trio_agent._lifecycle import _middleware
from trio_agent._loop._context import RunContext
from trio_agent._loop._events import CustomEvent, RunEvent
from trio_agent._loop._hooks import NO_HOOKS, Finished, ModelConfig, ToolOutcome, defines
from trio_agent._loop._rules import LoopState, StopReason
from trio_agent._models._messages import ToolCallPart, ToolSpec, Usage, UserMessage
from trio_agent._tools import _stages
from trio_agent._tools._context import ExecutionContext, ToolCall
from trio_agent._tools._definition import define_tool
from trio_agent._tools._pipeline import ToolPipeline
from trio_agent._tools._results import ToolErrorType, ToolResult
from trio_agent._tools._stages import StageRequest, ToolStages
from trio_agent.lifecycle import (
    DROP,
    AbortInfo,
    AbortRun,
    AfterToolCallInfo,
    ChatMiddleware,
    ErrorInfo,
    FinishInfo,
    IterationInfo,
    LifecycleHookError,
    MiddlewareDecisionError,
    Refuse,
    ReplaceResult,
    Skip,
    ToolCallInfo,
    ToolPhaseCompleteInfo,
    TransformArgs,
    apply_structured_output_config,
    define_chat_middleware,
    middleware_lifecycle,
)


def run_context(run_id: str = "run-1", abort: AbortHandle | None = None) -> RunContext:
    async def discard(event: RunEvent) -> None:
        return None

    return RunContext(
        run_id=run_id,
        thread_id="thread",
        agent_id="root",
        abort=abort or AbortHandle(),
        events=discard,
        messages=lambda: (),
    )


CONFIG = ModelConfig(instructions="be brief", messages=(), tools=(), options={"temperature": 1.0})
SPEC_A = ToolSpec("a", "tool a", {"type": "object"})
SPEC_B = ToolSpec("b", "tool b", {"type": "object"})


def event(name: str, run_id: str = "run-1") -> CustomEvent:
    return CustomEvent(run_id, "root", name)


# -- building and validating ------------------------------------------------------------------


def test_define_chat_middleware_rejects_an_unknown_hook_listing_the_valid_ones() -> None:
    with pytest.raises(MiddlewareShapeError, match="unknown hook 'onConfig'") as caught:
        define_chat_middleware(name="x", onConfig=lambda ctx, config: None)
    for hook in _middleware.HOOK_NAMES:
        assert hook in str(caught.value)


def test_define_chat_middleware_rejects_a_hook_that_is_not_callable_naming_it() -> None:
    with pytest.raises(MiddlewareShapeError, match="hook on_start is not callable"):
        define_chat_middleware(on_start=42)  # type: ignore[arg-type]


def test_middleware_lifecycle_rejects_what_is_not_a_list_of_middleware_naming_the_index() -> None:
    with pytest.raises(MiddlewareShapeError, match="must be a list"):
        middleware_lifecycle(define_chat_middleware(name="x"))  # type: ignore[arg-type]
    with pytest.raises(MiddlewareShapeError, match="middleware #1 is not a ChatMiddleware"):
        middleware_lifecycle([define_chat_middleware(), lambda ctx: None])  # type: ignore[list-item]


def test_a_subclass_hook_that_is_not_callable_is_a_shape_error_naming_hook_and_middleware() -> None:
    class Broken(ChatMiddleware):
        name = "broken"
        on_start = "soon"  # type: ignore[assignment]

    with pytest.raises(MiddlewareShapeError, match="on_start of middleware 'broken'"):
        middleware_lifecycle([Broken()])


def test_no_middleware_or_no_hooks_cost_nothing() -> None:
    assert middleware_lifecycle([]) is NO_HOOKS
    assert middleware_lifecycle([ChatMiddleware(), define_chat_middleware(name="empty", on_usage=None)]) is NO_HOOKS
    # Only the loop hooks a middleware needs are defined: no on_chunk, no event decorator.
    lifecycle = middleware_lifecycle([define_chat_middleware(on_start=lambda ctx: None)])
    assert defines(lifecycle, "on_start")
    assert not defines(lifecycle, "wrap_events") and not defines(lifecycle, "tool_stages")


# -- 1.2 setup, on_config, on_structured_output_config ------------------------------------------


async def test_1_2_setup_runs_every_middleware_in_order_plain_or_async() -> None:
    log: list[str] = []

    async def later(ctx: RunContext) -> None:
        await trio.lowlevel.checkpoint()
        log.append("b")

    lifecycle = middleware_lifecycle(
        [define_chat_middleware(setup=lambda ctx: log.append("a")), define_chat_middleware(setup=later)]
    )
    await lifecycle.setup(run_context())
    assert log == ["a", "b"]


async def test_1_2_on_config_pipes_and_shallow_merges() -> None:
    seen: list[ModelConfig] = []

    def first(ctx: RunContext, config: ModelConfig) -> dict[str, Any]:
        seen.append(config)
        return {"instructions": config.instructions + "!", "options": {"max_tokens": 10}}

    async def second(ctx: RunContext, config: ModelConfig) -> None:
        seen.append(config)

    def third(ctx: RunContext, config: ModelConfig) -> dict[str, Any]:
        seen.append(config)
        return {"tools": [SPEC_A, SPEC_B]}

    lifecycle = middleware_lifecycle(
        [
            define_chat_middleware(on_config=first),
            define_chat_middleware(on_config=second),
            define_chat_middleware(on_config=third),
        ]
    )
    final = await lifecycle.on_config(run_context(), CONFIG)
    assert seen[0] is CONFIG
    assert seen[1].instructions == "be brief!" and seen[2] is seen[1]
    # Shallow: options is replaced as a whole, the rest is kept.
    assert final == attrs.evolve(CONFIG, instructions="be brief!", options={"max_tokens": 10}, tools=(SPEC_A, SPEC_B))
    assert isinstance(final.tools, tuple)


async def test_1_2_on_config_may_return_a_whole_model_config() -> None:
    replacement = ModelConfig(instructions="other", messages=(), tools=(SPEC_A,))
    lifecycle = middleware_lifecycle([define_chat_middleware(on_config=lambda ctx, config: replacement)])
    assert await lifecycle.on_config(run_context(), CONFIG) is replacement


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        ({"system_prompt": "x"}, "unknown config keys"),
        ({"instructions": 3}, "not a str"),
        ({"tools": "a"}, "not a list"),
        ({"tools": [SPEC_A, SPEC_A]}, "duplicate names"),
        ({"tools": ["a"]}, "ToolSpec"),
        ({"options": [1]}, "not a mapping"),
        (42, "expected None, a partial dict or a ModelConfig"),
        ({"messages": [UserMessage("hi"), "not a message"]}, r"messages\[1\] .* not a Message"),
        # A whole ModelConfig is checked as a partial dict is (attrs checks no types).
        (attrs.evolve(CONFIG, instructions=3), "not a str"),
        (attrs.evolve(CONFIG, messages=None), "not a list"),
        (attrs.evolve(CONFIG, messages=[None]), r"messages\[0\] .* not a Message"),
        (attrs.evolve(CONFIG, tools=["a"]), "ToolSpec"),
        (attrs.evolve(CONFIG, tools=(SPEC_A, SPEC_A)), "duplicate names"),
        (attrs.evolve(CONFIG, options=None), "not a mapping"),
        (attrs.evolve(CONFIG, metadata=[1]), "not a mapping"),
    ],
)
async def test_1_3_invalid_on_config_results_are_typed_errors_naming_hook_and_middleware(
    returned: object, problem: str
) -> None:
    lifecycle = middleware_lifecycle(
        [define_chat_middleware(name="ok"), define_chat_middleware(name="bad", on_config=lambda ctx, c: returned)]
    )
    with pytest.raises(MiddlewareDecisionError, match=problem) as caught:
        await lifecycle.on_config(run_context(), CONFIG)
    assert (caught.value.hook, caught.value.middleware) == ("on_config", "bad")
    assert "on_config of middleware 'bad'" in str(caught.value)


async def test_2_6_on_structured_output_config_pipes_and_rejects_unknown_keys() -> None:
    config = {"instructions": "x", "output_schema": {"type": "object"}}
    middleware = [
        define_chat_middleware(on_structured_output_config=lambda ctx, c: {"output_schema": {"type": "array"}}),
        define_chat_middleware(on_structured_output_config=lambda ctx, c: {"instructions": str(c["output_schema"])}),
        define_chat_middleware(on_structured_output_config=lambda ctx, c: None),
    ]
    result = await apply_structured_output_config(middleware, run_context(), config)
    assert result == {"instructions": "{'type': 'array'}", "output_schema": {"type": "array"}}
    assert config == {"instructions": "x", "output_schema": {"type": "object"}}  # the input is not changed
    bad = [define_chat_middleware(name="so", on_structured_output_config=lambda ctx, c: {"tools": []})]
    with pytest.raises(MiddlewareDecisionError, match="on_structured_output_config of middleware 'so'"):
        await apply_structured_output_config(bad, run_context(), config)


async def test_2_6_on_structured_output_config_edits_in_place_count_and_never_reach_the_given_config() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    config = {"instructions": "x", "output_schema": schema}

    def nested(ctx: Any, c: Any) -> None:
        c["output_schema"]["properties"]["n"]["type"] = "string"

    seen: list[Any] = []
    middleware = [
        define_chat_middleware(on_structured_output_config=nested),
        define_chat_middleware(on_structured_output_config=lambda ctx, c: seen.append(c["output_schema"])),
    ]
    result = await apply_structured_output_config(middleware, run_context(), config)
    assert result["output_schema"] == {"type": "object", "properties": {"n": {"type": "string"}}}
    assert seen == [result["output_schema"]] and seen[0] is not result["output_schema"]  # each hook its copy
    assert schema == {"type": "object", "properties": {"n": {"type": "integer"}}}  # the input is not changed
    with pytest.raises(ConfigError, match="output_schema: not JSON: at /maximum: nan"):
        await apply_structured_output_config(middleware, run_context(), {"output_schema": {"maximum": float("nan")}})


async def test_2_6_apply_structured_output_config_cut_by_the_abort_raises_request_aborted_error() -> None:
    # The public function raises the public error of an aborted run, never the loop's internal
    # HookAborted (which only the loop knows to end the run with).
    abort = AbortHandle()
    entered = trio.Event()
    later: list[str] = []

    async def slow(ctx: Any, c: Any) -> None:
        entered.set()
        await trio.sleep_forever()

    middleware = [
        define_chat_middleware(on_structured_output_config=slow),
        define_chat_middleware(on_structured_output_config=lambda ctx, c: later.append("called")),
    ]
    config = {"instructions": "x", "output_schema": {"type": "object"}}
    async with trio.open_nursery() as nursery:

        async def abort_once_entered() -> None:
            await entered.wait()
            abort.abort(AbortReason.STEERING, "a new message")

        nursery.start_soon(abort_once_entered)
        with pytest.raises(RequestAbortedError, match="a new message") as caught:
            await apply_structured_output_config(middleware, run_context(abort=abort), config)
    assert caught.value.reason == AbortReason.STEERING.value and later == []
    # Aborted before it is called: an async hook is cut at its first await, the same error.
    with pytest.raises(RequestAbortedError) as caught:
        await apply_structured_output_config(middleware, run_context(abort=abort), config)
    assert caught.value.reason == AbortReason.STEERING.value and later == []


# -- 1.2 the hooks that observe ----------------------------------------------------------------


async def test_1_4_start_iteration_usage_and_tool_phase_hooks_get_their_infos_in_order() -> None:
    log: list[tuple[str, object]] = []

    def recorder(tag: str) -> ChatMiddleware:
        return define_chat_middleware(
            name=tag,
            on_start=lambda ctx: log.append((tag, "start")),
            on_iteration=lambda ctx, info: log.append((tag, info)),
            on_usage=lambda ctx, usage: log.append((tag, usage)),
            on_tool_phase_complete=lambda ctx, info: log.append((tag, info)),
        )

    lifecycle = middleware_lifecycle([recorder("a"), recorder("b")])
    ctx = run_context()
    outcome = ToolOutcome(ToolCallPart("c1", "echo", "{}"), ToolResult.success("x"), ran=True)
    await lifecycle.on_start(ctx)
    await lifecycle.on_iteration(ctx, 2, "msg-2")
    await lifecycle.on_usage(ctx, Usage(input_tokens=3))
    await lifecycle.on_tool_phase_complete(ctx, [outcome])
    infos: list[object] = ["start", IterationInfo(2, "msg-2"), Usage(input_tokens=3), ToolPhaseCompleteInfo((outcome,))]
    assert log == [(tag, info) for info in infos for tag in "ab"]


# -- 3.2 on_chunk ---------------------------------------------------------------------------------


class Collect:
    def __init__(self) -> None:
        self.events: list[RunEvent] = []

    async def __call__(self, event: RunEvent) -> None:
        self.events.append(event)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.events if isinstance(e, CustomEvent)]


async def test_3_2_on_chunk_keeps_replaces_expands_and_drops_and_counts_delivered_events() -> None:
    seen_by_last: list[str] = []

    def first(ctx: RunContext, e: RunEvent) -> object:
        assert isinstance(e, CustomEvent)
        return {
            "keep": None,
            "replace": event("replaced"),
            "expand": [event("x1"), event("x2")],
            "empty": [],
            "drop": DROP,
        }[e.name]

    async def last(ctx: RunContext, e: RunEvent) -> None:
        assert isinstance(e, CustomEvent)
        seen_by_last.append(e.name)

    lifecycle = middleware_lifecycle([define_chat_middleware(on_chunk=first), define_chat_middleware(on_chunk=last)])
    ctx, out = run_context(), Collect()
    sink = lifecycle.wrap_events(ctx, out)
    for name in ("keep", "replace", "expand", "empty", "drop"):
        await sink(event(name))
    assert out.names == ["keep", "replaced", "x1", "x2"]
    assert seen_by_last == out.names  # dropped events never reach later middleware
    assert ctx.chunk_index == 4


@pytest.mark.parametrize(
    ("returned", "problem"),
    [("text", "expected None, a RunEvent"), ([event("ok"), "junk"], "not a RunEvent"), (False, "expected None")],
)
async def test_3_2_an_invalid_on_chunk_result_is_a_typed_error_and_delivers_nothing(
    returned: object, problem: str
) -> None:
    lifecycle = middleware_lifecycle([define_chat_middleware(name="chunky", on_chunk=lambda ctx, e: returned)])
    ctx, out = run_context(), Collect()
    with pytest.raises(MiddlewareDecisionError, match=problem) as caught:
        await lifecycle.wrap_events(ctx, out)(event("e"))
    assert (caught.value.hook, caught.value.middleware) == ("on_chunk", "chunky")
    assert out.events == [] and ctx.chunk_index == 0


async def test_3_2_async_on_chunk_never_reorders_events() -> None:
    async def jitter(ctx: RunContext, e: RunEvent) -> None:
        await trio.sleep(random.random() / 1000)

    lifecycle = middleware_lifecycle([define_chat_middleware(on_chunk=jitter), define_chat_middleware(on_chunk=jitter)])
    out = Collect()
    sink = lifecycle.wrap_events(run_context(), out)
    for i in range(30):
        await sink(event(str(i)))
    assert out.names == [str(i) for i in range(30)]


# Per middleware, per event name: what it does with it (keep, replace, expand into two, drop).
ACTIONS = ("keep", "replace", "expand", "drop")


def apply_action(action: str, index: int, name: str) -> list[str]:
    if action == "keep":
        return [name]
    if action == "replace":
        return [f"{name}/r{index}"]
    if action == "expand":
        return [f"{name}/e{index}a", f"{name}/e{index}b"]
    return []


def plan_for(seed: int) -> Callable[[str], str]:
    """A middleware's action per event: a hash of (its seed, the event's name), so fixed per event."""
    return lambda name: ACTIONS[hash((seed, name)) % len(ACTIONS)]


def reference(plans: list[Callable[[str], str]], names: list[str]) -> tuple[list[str], list[list[str]]]:
    """The spec's list pipeline (3.2): each middleware maps the whole current list in order."""
    seen: list[list[str]] = []
    out: list[str] = []
    for name in names:
        current = [name]
        for index, plan in enumerate(plans):
            seen_here = list(current)
            current = [result for item in current for result in apply_action(plan(item), index, item)]
            if len(seen) <= index:
                seen.append([])
            seen[index].extend(seen_here)
        out.extend(current)
    return out, seen


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 2**16), min_size=0, max_size=5),
    st.lists(st.sampled_from("abcdef"), min_size=1, max_size=8),
)
def test_3_2_on_chunk_pipeline_matches_the_reference_for_any_middleware_list(
    seeds: list[int], names: list[str]
) -> None:
    plans = [plan_for(seed) for seed in seeds]
    seen: list[list[str]] = [[] for _ in plans]

    def hook(index: int) -> Callable[[RunContext, RunEvent], object]:
        async def on_chunk(ctx: RunContext, e: RunEvent) -> object:
            assert isinstance(e, CustomEvent)
            seen[index].append(e.name)
            action = plans[index](e.name)
            if action == "keep":
                return None
            if action == "drop":
                return DROP
            results = [event(name) for name in apply_action(action, index, e.name)]
            return results[0] if action == "replace" else results

        return on_chunk

    async def drive() -> tuple[list[str], int]:
        lifecycle = middleware_lifecycle([define_chat_middleware(on_chunk=hook(i)) for i in range(len(plans))])
        ctx, out = run_context(), Collect()
        sink = lifecycle.wrap_events(ctx, out)
        for name in names:
            await sink(event(name))
        return out.names, ctx.chunk_index

    out, delivered = trio.run(drive)
    expected_out, expected_seen = reference(plans, names)
    assert out == expected_out
    assert seen == (expected_seen + [[] for _ in plans])[: len(plans)]
    assert delivered == (len(out) if plans else 0)


# -- 1.3 tool-call hooks, driven through a real tool pipeline ------------------------------------


class Echo:
    def __init__(self) -> None:
        self.inputs: list[dict[str, Any]] = []
        schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}

        async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
            self.inputs.append(dict(inp))
            if inp["q"] == "fail":
                raise RuntimeError("tool broke")
            return ToolResult.success(f"echo:{inp['q']}")

        self.tool = define_tool(run, name="echo", description="echo", input_schema=schema, side_effect="pure")
        self.pipeline = ToolPipeline([self.tool])

    async def call(self, stages: ToolStages | None, q: Any = "hi", call_id: str = "c1") -> ToolResult:
        record = await self.pipeline.execute(ToolCall(call_id, "echo", {"q": q}), stages=stages)
        return record.result


async def test_1_3_before_tool_call_is_first_win_and_transform_args_reach_the_tool() -> None:
    log: list[tuple[str, ToolCallInfo]] = []

    def before(tag: str, decision: object) -> ChatMiddleware:
        def hook(ctx: RunContext, call: ToolCallInfo) -> object:
            log.append((tag, call))
            return decision

        return define_chat_middleware(name=tag, on_before_tool_call=hook)

    lifecycle = middleware_lifecycle(
        [before("a", None), before("b", TransformArgs({"q": "changed"})), before("c", TransformArgs({"q": "no"}))]
    )
    echo = Echo()
    result = await echo.call(lifecycle.tool_stages(run_context()), q="hi")
    assert result.output == "echo:changed"
    assert echo.inputs == [{"q": "changed"}]
    assert [tag for tag, _ in log] == ["a", "b"]  # c is never asked
    assert log[0][1] == ToolCallInfo("echo", "c1", {"q": "hi"})


async def test_1_3_the_input_schema_checks_transformed_args_and_guards_see_the_final_ones() -> None:
    guard_log: list[tuple[str, dict[str, Any]]] = []

    def guard(tag: str, decision: object = None) -> ChatMiddleware:
        def hook(ctx: RunContext, call: ToolCallInfo) -> object:
            guard_log.append((tag, dict(call.args)))
            return decision

        return define_chat_middleware(name=tag, on_guard_tool_call=hook)

    transform = define_chat_middleware(on_before_tool_call=lambda ctx, call: TransformArgs({"q": call.args["q"] * 2}))
    lifecycle = middleware_lifecycle([transform, guard("g1"), guard("g2", Refuse("no echo today")), guard("g3")])
    echo = Echo()
    result = await echo.call(lifecycle.tool_stages(run_context()), q="hi")
    assert guard_log == [("g1", {"q": "hihi"}), ("g2", {"q": "hihi"})]  # until one decides; g3 not asked
    assert not result.ok and result.error is not None
    assert result.error.type is ToolErrorType.PERMISSION_DENIED and result.error.message == "no echo today"
    assert echo.inputs == []

    bad = middleware_lifecycle([define_chat_middleware(on_before_tool_call=lambda ctx, call: TransformArgs({"q": 1}))])
    guard_log.clear()
    refused = await Echo().call(bad.tool_stages(run_context()))
    assert refused.error is not None and refused.error.code == "invalid_input"


async def test_1_3_guards_run_for_calls_before_hooks_let_through_unchanged() -> None:
    seen: list[str] = []
    lifecycle = middleware_lifecycle(
        [
            define_chat_middleware(on_before_tool_call=lambda ctx, call: None),
            define_chat_middleware(on_guard_tool_call=lambda ctx, call: seen.append(call.call_id)),
        ]
    )
    result = await Echo().call(lifecycle.tool_stages(run_context()), call_id="c9")
    assert result.output == "echo:hi" and seen == ["c9"]


@pytest.mark.parametrize("hook", ["on_before_tool_call", "on_guard_tool_call"])
async def test_1_3_abort_run_aborts_the_run_and_the_call_ends_interrupted(hook: str) -> None:
    ctx = run_context()
    hooks: dict[str, Any] = {hook: lambda ctx, call: AbortRun("budget spent")}
    lifecycle = middleware_lifecycle([define_chat_middleware(**hooks)])
    echo = Echo()
    result = await echo.call(lifecycle.tool_stages(ctx))
    assert ctx.aborted
    assert result.error is not None and result.error.type is ToolErrorType.INTERRUPTED
    assert "budget spent" in result.error.message
    assert echo.inputs == []


def stage_request(echo: Echo, args: dict[str, Any], call_id: str = "c1") -> StageRequest:
    context = ExecutionContext("s", "root", "r", "t", call_id, f"k-{call_id}", AbortHandle(), lambda: None)
    return StageRequest(echo.tool, args, context, echo.tool.behavior)


@pytest.mark.parametrize(
    ("hook", "returned", "problem"),
    [
        ("on_before_tool_call", Refuse("x"), "expected None, TransformArgs, Skip or AbortRun"),
        ("on_before_tool_call", TransformArgs(["q"]), "not a dict"),  # type: ignore[arg-type]
        ("on_before_tool_call", True, "expected None"),
        ("on_guard_tool_call", TransformArgs({"q": "x"}), "expected None, Refuse or AbortRun"),
        ("on_guard_tool_call", Skip("x"), "expected None, Refuse or AbortRun"),
    ],
)
async def test_1_3_invalid_tool_call_decisions_are_typed_errors_naming_hook_and_middleware(
    hook: str, returned: object, problem: str
) -> None:
    lifecycle = middleware_lifecycle([define_chat_middleware(name="tooly", **{hook: lambda ctx, call: returned})])
    stages = lifecycle.tool_stages(run_context())
    assert stages is not None
    stage = (stages.before or stages.guard)[0]
    with pytest.raises(MiddlewareDecisionError, match=problem) as caught:
        await stage(stage_request(Echo(), {"q": "x"}))
    assert (caught.value.hook, caught.value.middleware) == (hook, "tooly")
    # In the pipeline the stage fails closed: the call ends with an error naming the middleware.
    result = await Echo().call(stages)
    assert result.error is not None and result.error.code == "hook_error" and "tooly" in result.error.message


async def test_1_3_skip_ends_the_call_with_its_result_without_running_the_tool() -> None:
    lifecycle = middleware_lifecycle([define_chat_middleware(name="cache", on_before_tool_call=lambda c, i: Skip(7))])
    stages = lifecycle.tool_stages(run_context())
    assert stages is not None
    stage_skip = getattr(_stages, "Skip", None)
    if stage_skip is None:
        # The pipeline cannot honour it yet: refused loudly, never turned into an error result silently.
        with pytest.raises(MiddlewareError, match="returned Skip, which this tool pipeline cannot honour"):
            await stages.before[0](stage_request(Echo(), {"q": "x"}))
        return
    decision = await stages.before[0](stage_request(Echo(), {"q": "x"}))
    assert decision == stage_skip(ToolResult.success(7))
    echo = Echo()
    result = await echo.call(stages)
    assert result.ok and result.output == 7 and echo.inputs == []


async def test_1_3_skip_maps_to_the_pipelines_skip_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    @attrs.frozen
    class StageSkip:
        result: ToolResult

    monkeypatch.setattr(_middleware, "_STAGE_SKIP", StageSkip)
    kept = ToolResult.success("cached", display="from cache")
    lifecycle = middleware_lifecycle(
        [define_chat_middleware(on_before_tool_call=lambda ctx, call: Skip(kept if call.args["q"] == "k" else "v"))]
    )
    stages = lifecycle.tool_stages(run_context())
    assert stages is not None
    decisions: list[object] = [await stages.before[0](stage_request(Echo(), {"q": q})) for q in ("k", "v")]
    assert decisions == [StageSkip(kept), StageSkip(ToolResult.success("v"))]


async def test_1_3_replace_result_chains_and_an_error_stays_an_error() -> None:
    infos: list[AfterToolCallInfo] = []

    def after(tag: str) -> ChatMiddleware:
        def hook(ctx: RunContext, info: AfterToolCallInfo) -> object:
            infos.append(info)
            return ReplaceResult(f"{info.result.output}+{tag}")

        return define_chat_middleware(name=tag, on_after_tool_call=hook)

    observer = define_chat_middleware(on_after_tool_call=lambda ctx, info: infos.append(info))
    lifecycle = middleware_lifecycle([after("a"), observer, after("b")])
    echo = Echo()
    ok = await echo.call(lifecycle.tool_stages(run_context()))
    assert ok.ok and ok.output == "echo:hi+a+b"
    assert [info.result.output for info in infos] == ["echo:hi", "echo:hi+a", "echo:hi+a"]
    assert infos[0].ok and infos[0].call_id == "c1" and infos[0].args == {"q": "hi"}

    infos.clear()
    failed = await echo.call(lifecycle.tool_stages(run_context()), q="fail", call_id="c2")
    assert not failed.ok and failed.error is not None and failed.error.code == "tool_error"
    assert failed.output.endswith("+a+b")
    assert not infos[0].ok and infos[0].error is not None

    # A success ToolResult offered for an error result keeps the error, taking only the output.
    to_success = middleware_lifecycle(
        [define_chat_middleware(on_after_tool_call=lambda ctx, info: ReplaceResult(ToolResult.success("fine")))]
    )
    still_failed = await echo.call(to_success.tool_stages(run_context()), q="fail", call_id="c3")
    assert still_failed.error is not None and still_failed.output == "fine"


async def test_1_3_invalid_after_tool_call_decision_is_a_typed_error() -> None:
    lifecycle = middleware_lifecycle([define_chat_middleware(name="late", on_after_tool_call=lambda c, i: "new")])
    stages = lifecycle.tool_stages(run_context())
    assert stages is not None
    with pytest.raises(MiddlewareDecisionError, match="on_after_tool_call of middleware 'late'"):
        await stages.post_tool[0](stage_request(Echo(), {"q": "x"}), ToolResult.success("old"))


async def test_1_3_after_tool_call_sees_a_cut_off_call_with_code_max_tokens_and_may_replace_it() -> None:
    infos: list[AfterToolCallInfo] = []

    def note(ctx: RunContext, info: AfterToolCallInfo) -> object:
        infos.append(info)
        return ReplaceResult("the answer was cut off; ask again") if len(infos) == 1 else None

    lifecycle = middleware_lifecycle([define_chat_middleware(on_after_tool_call=note)] * 2)
    call = ToolCallPart("c7", "echo", '{"q": "hal')
    cut_off = ToolResult.failure(ToolErrorType.VALIDATION, "cut off", code="max_tokens")
    result = await lifecycle.on_cut_off_call(run_context(), call, cut_off)
    assert [(info.ok, info.error.code if info.error else None) for info in infos] == [
        (False, "max_tokens"),
        (False, "max_tokens"),
    ]
    assert infos[0].call_id == "c7" and infos[0].args == '{"q": "hal'
    assert result.error is not None and result.error.code == "max_tokens"
    assert result.output == "the answer was cut off; ask again"


@pytest.mark.parametrize("answer", ["raises", "junk"])
async def test_1_3_an_after_tool_call_that_fails_on_a_cut_off_call_is_logged_not_the_runs_end(
    answer: str, caplog: pytest.LogCaptureFixture
) -> None:
    # It failed the whole run with the hook's bare error; a post_tool stage that fails on a call's
    # error result leaves that error, as here the cut-off.
    def broken(ctx: RunContext, info: AfterToolCallInfo) -> object:
        if answer == "raises":
            raise RuntimeError("redaction service down")
        return "junk"

    lifecycle = middleware_lifecycle([define_chat_middleware(name="redact", on_after_tool_call=broken)])
    cut_off = ToolResult.failure(ToolErrorType.VALIDATION, "cut off", code="max_tokens")
    result = await lifecycle.on_cut_off_call(run_context(), ToolCallPart("c7", "echo", '{"q'), cut_off)
    assert result == cut_off
    assert [record.getMessage() for record in caplog.records if record.name == "trio_agent.lifecycle"] == [
        "on_after_tool_call of 'redact' failed on cut-off call 'c7'"
    ]


# -- 2.5 on_should_continue, on_model_error ---------------------------------------------------------


async def test_2_5_should_continue_only_an_explicit_false_vetoes_and_short_circuits() -> None:
    asked: list[str] = []

    def cont(tag: str, answer: object) -> ChatMiddleware:
        def hook(ctx: RunContext, state: LoopState) -> object:
            asked.append(tag)
            return answer

        return define_chat_middleware(name=tag, on_should_continue=hook)

    state = LoopState(iteration=2, tool_call_count=3)
    go = middleware_lifecycle([cont("a", None), cont("b", True)])
    assert await go.should_continue(run_context(), state) is True
    stop = middleware_lifecycle([cont("c", None), cont("d", False), cont("e", True)])
    assert await stop.should_continue(run_context(), state) is False
    assert asked == ["a", "b", "c", "d"]
    bad = middleware_lifecycle([cont("f", 0)])
    with pytest.raises(MiddlewareDecisionError, match="on_should_continue of middleware 'f'"):
        await bad.should_continue(run_context(), state)


async def test_on_model_error_every_middleware_is_told_and_ctx_retry_asks_for_a_retry() -> None:
    told: list[str] = []

    def watcher(tag: str, retry: bool) -> ChatMiddleware:
        def hook(ctx: RunContext, error: ModelError) -> None:
            told.append(f"{tag}:{error}")
            if retry:
                ctx.retry()

        return define_chat_middleware(on_model_error=hook)

    lifecycle = middleware_lifecycle([watcher("a", False), watcher("b", True), watcher("c", False)])
    ctx = run_context()
    ctx._retry_open = True  # what the driver does around on_model_error
    assert await lifecycle.on_model_error(ctx, ModelError("overloaded")) is True
    assert told == ["a:overloaded", "b:overloaded", "c:overloaded"]

    quiet = middleware_lifecycle([watcher("d", False)])
    other = run_context()
    other._retry_open = True
    assert await quiet.on_model_error(other, ModelError("x")) is False


# -- 2.7 terminal hooks ---------------------------------------------------------------------------


async def test_2_7_terminal_hooks_get_their_infos_with_the_run_duration(autojump_clock: trio.testing.MockClock) -> None:
    got: list[object] = []
    lifecycle = middleware_lifecycle(
        [
            define_chat_middleware(
                on_finish=lambda ctx, info: got.append(info),
                on_abort=lambda ctx, info: got.append(info),
                on_error=lambda ctx, info: got.append(info),
            )
        ]
    )
    ctx = run_context()
    await lifecycle.setup(ctx)
    await trio.sleep(0.01)
    await lifecycle.on_finish(ctx, Finished(StopReason.VETOED, "bye", 3, LoopState()))
    await lifecycle.on_abort(ctx, Abort(AbortReason.STEERING, "new input"))
    error = RuntimeError("model gone")
    await lifecycle.on_error(ctx, error)
    finish, abort, failed = got
    assert isinstance(finish, FinishInfo) and (finish.stop_reason, finish.text, finish.turns) == (
        StopReason.VETOED,
        "bye",
        3,
    )
    assert isinstance(abort, AbortInfo) and (abort.reason, abort.kind) == ("new input", AbortReason.STEERING)
    assert isinstance(failed, ErrorInfo) and failed.error is error
    for info in (finish, abort, failed):
        assert isinstance(info, FinishInfo | AbortInfo | ErrorInfo)
        assert info.duration == pytest.approx(0.01)  # the clock is virtual: exactly the sleep


async def test_2_7_on_finish_failures_are_isolated_and_reported_by_middleware_name() -> None:
    ran: list[str] = []

    def finisher(tag: str, fail: bool) -> ChatMiddleware:
        def hook(ctx: RunContext, info: FinishInfo) -> None:
            ran.append(tag)
            if fail:
                raise ValueError(tag)

        return define_chat_middleware(name=tag, on_finish=hook)

    finished = Finished(StopReason.END_TURN, "", 1, LoopState())
    one = middleware_lifecycle([finisher("a", False), finisher("b", True), finisher("c", False)])
    with pytest.raises(ValueError, match=r"^b$"):
        await one.on_finish(run_context(), finished)
    assert ran == ["a", "b", "c"]
    several = middleware_lifecycle([finisher("x", True), finisher("y", True)])
    with pytest.raises(LifecycleHookError) as caught:
        await several.on_finish(run_context(), finished)
    assert [name for name, _ in caught.value.failures] == ["x", "y"]


async def test_2_7_on_abort_and_on_error_failures_never_escape() -> None:
    def boom(ctx: RunContext, info: object) -> None:
        raise RuntimeError("observer broke")

    lifecycle = middleware_lifecycle(
        [define_chat_middleware(on_abort=boom, on_error=boom), define_chat_middleware(on_abort=boom, on_error=boom)]
    )
    await lifecycle.on_abort(run_context(), Abort(AbortReason.USER_ABORT, "stop"))
    await lifecycle.on_error(run_context(), RuntimeError("real error"))


# -- 1.5 one middleware list, many concurrent runs ----------------------------------------------------


class PerRunCounter(ChatMiddleware):
    """Keeps every piece of per-run state in ctx.state, as the rules require."""

    name = "per-run counter"

    async def setup(self, ctx: RunContext) -> None:
        ctx.state["events"] = 0
        ctx.state["log"] = [ctx.run_id]

    async def on_config(self, ctx: RunContext, config: ModelConfig) -> dict[str, Any]:
        await trio.sleep(random.random() / 1000)
        return {"metadata": {"run": ctx.run_id}}

    async def on_chunk(self, ctx: RunContext, e: RunEvent) -> RunEvent:
        await trio.sleep(random.random() / 1000)
        ctx.state["events"] += 1
        assert isinstance(e, CustomEvent) and e.run_id == ctx.run_id  # never another run's event
        return CustomEvent(e.run_id, e.agent_id, f"{ctx.run_id}:{ctx.state['events']}")

    def on_iteration(self, ctx: RunContext, info: IterationInfo) -> None:
        ctx.state["log"].append(info.message_id)

    async def on_finish(self, ctx: RunContext, info: FinishInfo) -> None:
        ctx.state["log"].append(f"finish {info.text}")


async def test_1_5_one_middleware_list_serves_1000_concurrent_runs_without_state_bleeding() -> None:
    lifecycle = middleware_lifecycle([PerRunCounter(), define_chat_middleware(on_chunk=lambda ctx, e: None)])
    results: dict[str, tuple[ModelConfig, list[str], RunContext]] = {}

    async def events_only(index: int) -> None:
        run_id = f"run-{index}"
        ctx = run_context(run_id)
        out = Collect()
        await lifecycle.setup(ctx)
        config = await lifecycle.on_config(ctx, CONFIG)
        sink = lifecycle.wrap_events(ctx, out)
        turns = index % 4 + 1
        for turn in range(turns):
            await lifecycle.on_iteration(ctx, turn, f"{run_id}-m{turn}")
            await sink(event("tick", run_id))
        await lifecycle.on_finish(ctx, Finished(StopReason.END_TURN, run_id, turns, LoopState()))
        results[run_id] = (config, out.names, ctx)

    async with trio.open_nursery() as nursery:
        for index in range(1000):
            nursery.start_soon(events_only, index)

    assert len(results) == 1000
    for index in range(1000):
        run_id = f"run-{index}"
        config, names, ctx = results[run_id]
        turns = index % 4 + 1
        assert config.metadata == {"run": run_id}
        assert names == [f"{run_id}:{n}" for n in range(1, turns + 1)]
        assert ctx.chunk_index == turns
        assert ctx.state["log"] == [run_id, *(f"{run_id}-m{t}" for t in range(turns)), f"finish {run_id}"]


# -- docs/lifecycle.md -----------------------------------------------------------------------------


def runnable_examples() -> list[str]:
    """The code blocks of docs/lifecycle.md marked ``<!-- runnable -->``."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "lifecycle.md").read_text()
    blocks = []
    for chunk in text.split("<!-- runnable -->")[1:]:
        body = chunk.split("```python\n", 1)[1].split("```", 1)[0]
        blocks.append(body)
    return blocks


def test_docs_mark_runnable_examples() -> None:
    assert len(runnable_examples()) == 5


@pytest.mark.parametrize("index", range(5))
async def test_docs_runnable_examples(index: int) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(runnable_examples()[index], f"docs/lifecycle.md example {index}", "exec"), namespace)
    await namespace["demo"](run_context(f"docs-{index}"))
