"""Hook events: registry validation, dispatch order and folding, deadlines, typed errors, and the tool-stage
adapters running inside a real `ToolPipeline` (tool hooks fail closed; the journal stays valid)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cancel_helpers import nursery_failing_in_cleanup
from trio_agent import (
    AbortReason,
    ConfigError,
    LeaseLostError,
    Tool,
    ToolErrorType,
    ToolFailure,
    ToolResult,
    TrioAgentError,
    define_tool,
)
from trio_agent._session._hooks import (
    DEFAULT_HOOK_DEADLINES,
    HOOK_CONTEXT_KEY,
    HookAbortedError,
    HookAction,
    HookDecision,
    HookError,
    HookEvent,
    HookInput,
    HookInterruptedError,
    HookOutput,
    HookRegistry,
    HookReturnError,
    HookRunner,
    HookTimeoutError,
    PermissionRequestInput,
    PostToolUseFailureInput,
    PostToolUseInput,
    PreToolUseInput,
    SessionEndInput,
    SessionStartInput,
    StopInput,
    SubagentStartInput,
    SubagentStopInput,
    UserPromptSubmitInput,
    post_tool_stage,
    pre_tool_stage,
    typed_input,
)
from trio_agent.testing import call_tool
from trio_agent.tools import (
    AbortHandle,
    InMemoryToolJournal,
    SettlementStatus,
    Skip,
    StageRequest,
    ToolPipeline,
    ToolStages,
)

# -- helpers -------------------------------------------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"q": {"type": "string"}, "mode": {"type": "string"}},
    "required": ["q"],
    "additionalProperties": False,
}


class Runs:
    def __init__(self) -> None:
        self.inputs: list[dict[str, Any]] = []


def echo_tool(runs: Runs, *, name: str = "echo", fail: str | None = None, timeout: float | None = None) -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        runs.inputs.append(dict(inp))
        if fail == "raise":
            raise ToolFailure(f"boom:{inp['q']}", code="tool_code")
        if fail == "sleep":
            await trio.sleep_forever()
        return ToolResult.success(f"echo:{inp['q']}", metadata={"m": 1})

    return define_tool(run, name=name, description="echo", input_schema=SCHEMA, side_effect="pure", timeout=timeout)


_REQUIRED: dict[HookEvent, dict[str, Any]] = {
    HookEvent.USER_PROMPT_SUBMIT: {"prompt": "p"},
    HookEvent.PRE_TOOL_USE: {"tool_name": "t", "tool_input": {}},
    HookEvent.PERMISSION_REQUEST: {"tool_name": "t", "tool_input": {}},
    HookEvent.POST_TOOL_USE: {"tool_name": "t", "tool_input": {}, "tool_result": ToolResult.success("ok")},
    HookEvent.SUBAGENT_START: {"subagent_id": "a1", "subagent_type": "helper", "prompt": "p"},
    HookEvent.SUBAGENT_STOP: {"subagent_id": "a1", "subagent_type": "helper"},
    HookEvent.SESSION_END: {"reason": "completed"},
}


def hook_input(event: HookEvent = HookEvent.PRE_TOOL_USE, **fields: Any) -> HookInput:
    """A flat HookInput (as the session builds one) with the fields the event always has."""
    fields.setdefault("session_id", "s1")
    for name, value in _REQUIRED.get(event, {}).items():
        fields.setdefault(name, value)
    return HookInput(event=event, **fields)


def named(name: str, output: Any = None, log: list[str] | None = None) -> Any:
    async def hook(inp: HookInput) -> Any:
        if log is not None:
            log.append(name)
        return output

    hook.__qualname__ = name
    return hook


def runner_for(event: HookEvent, *hooks: Any, **kwargs: Any) -> HookRunner:
    return HookRunner(HookRegistry({event: list(hooks)}), **kwargs)


def pipeline_with(runner: HookRunner, tool: Tool[Any], journal: InMemoryToolJournal) -> ToolPipeline:
    stages = ToolStages(pre_tool=[pre_tool_stage(runner)], post_tool=[post_tool_stage(runner)])
    return ToolPipeline([tool], stages=stages, journal=journal)


# -- the event enum --------------------------------------------------------------


def test_the_ten_events_have_snake_values_and_pascal_aliases() -> None:
    titles = {event.title for event in HookEvent}
    assert titles == {
        "UserPromptSubmit",
        "PreToolUse",
        "PostToolUse",
        "PostToolUseFailure",
        "PermissionRequest",
        "Stop",
        "SubagentStart",
        "SubagentStop",
        "SessionStart",
        "SessionEnd",
    }
    for event in HookEvent:
        assert event.value == event.name.lower()
        assert HookEvent(event.title) is event
        assert HookEvent(event.value) is event
    with pytest.raises(ValueError):
        HookEvent("pretooluse")


# -- registry validation -------------------------------------------------------------


async def _ok(inp: HookInput) -> None:
    return None


class AsyncCallable:
    async def __call__(self, inp: HookInput) -> HookOutput:
        return HookOutput.context("from an object")


def _sync(inp: HookInput) -> None:
    return None


async def _agen(inp: HookInput) -> Any:
    yield None


async def _two(inp: HookInput, other: int) -> None:
    return None


@pytest.mark.parametrize(
    ("hooks", "fragment"),
    [
        ({"PreToolUse": [_ok]}, "did you mean HookEvent.PRE_TOOL_USE"),
        ({"nope": [_ok]}, "is not a HookEvent"),
        ({HookEvent.STOP: _ok}, "must be a sequence"),
        ({HookEvent.STOP: "abc"}, "must be a sequence"),
        ({HookEvent.STOP: [42]}, "is not callable"),
        ({HookEvent.STOP: [_sync]}, "must be an `async def"),
        ({HookEvent.STOP: [_agen]}, "must be an `async def"),
        ({HookEvent.STOP: [_two]}, "must accept one argument"),
        ({HookEvent.STOP: [AsyncCallable]}, "must be an `async def"),
        ([(HookEvent.STOP, [_ok])], "must be a mapping"),
    ],
)
def test_registry_rejects_bad_keys_and_values(hooks: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        HookRegistry(hooks)
    assert fragment in str(info.value)


def test_registry_accepts_async_callables_and_partials_and_keeps_order_and_source() -> None:
    instance = AsyncCallable()
    partial = functools.partial(_two, other=1)
    registry = HookRegistry({HookEvent.STOP: [instance, partial, _ok], HookEvent.SESSION_END: []}, source="plugin:x")
    entries = registry.for_event(HookEvent.STOP)
    assert [entry.callback for entry in entries] == [instance, partial, _ok]
    assert {entry.source for entry in entries} == {"plugin:x"}
    assert entries[2].name == "_ok"
    assert registry.events == frozenset({HookEvent.STOP})  # empty lists are dropped
    assert len(registry) == 3
    assert registry.for_event(HookEvent.PRE_TOOL_USE) == ()


def test_combine_concatenates_per_event_in_the_given_order() -> None:
    a, b, c = named("a"), named("b"), named("c")
    session = HookRegistry({HookEvent.STOP: [a], HookEvent.SESSION_START: [a]})
    plugin = HookRegistry({HookEvent.STOP: [b, c]}, source="plugin:p")
    combined = HookRegistry.combine(session, plugin)
    assert [(e.name, e.source) for e in combined.for_event(HookEvent.STOP)] == [
        ("a", "session"),
        ("b", "plugin:p"),
        ("c", "plugin:p"),
    ]
    assert [e.name for e in combined.for_event(HookEvent.SESSION_START)] == ["a"]
    with pytest.raises(ConfigError):
        HookRegistry.combine(session, {HookEvent.STOP: [a]})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "deadlines",
    [{HookEvent.STOP: 0}, {HookEvent.STOP: -1}, {HookEvent.STOP: math.nan}, {HookEvent.STOP: "1"}, {"stop": 1.0}],
)
def test_runner_rejects_bad_deadlines(deadlines: Any) -> None:
    with pytest.raises(ConfigError):
        HookRunner(HookRegistry(), deadlines=deadlines)


def test_default_deadlines() -> None:
    runner = HookRunner(HookRegistry(), deadlines={HookEvent.STOP: 2.5})
    assert runner.deadlines[HookEvent.STOP] == 2.5
    assert runner.deadlines[HookEvent.SESSION_END] == DEFAULT_HOOK_DEADLINES[HookEvent.SESSION_END] == 5.0
    assert runner.deadlines[HookEvent.PRE_TOOL_USE] == 60.0
    assert set(runner.deadlines) == set(HookEvent)


def test_hook_output_validates_its_fields() -> None:
    assert HookOutput("skip").action is HookAction.SKIP
    with pytest.raises(ValueError, match="continue"):
        HookOutput("stop")
    with pytest.raises(TypeError):
        HookOutput(modified_input=["not", "an", "object"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        HookOutput(additional_context=3)  # type: ignore[arg-type]
    assert HookOutput.skip("r", context="c") == HookOutput(HookAction.SKIP, None, None, "c", "r")
    assert HookOutput.abort("r").action is HookAction.ABORT
    assert HookOutput.modify({"a": 1}, context="c").modified_input == {"a": 1}


# -- dispatch: order, original input, folding -------------------------------------------


async def test_no_hooks_is_a_continue_decision() -> None:
    decision = await HookRunner(HookRegistry()).dispatch(HookEvent.STOP, hook_input(HookEvent.STOP))
    assert decision == HookDecision(HookEvent.STOP)


async def test_dispatch_checks_its_arguments() -> None:
    runner = runner_for(HookEvent.STOP, named("a"))
    with pytest.raises(ConfigError, match="needs a HookInput of that event"):
        await runner.dispatch(HookEvent.STOP, hook_input(HookEvent.SESSION_END))
    with pytest.raises(ConfigError, match="must be a HookEvent"):
        await runner.dispatch("stop", hook_input(HookEvent.STOP))  # type: ignore[arg-type]


async def test_session_hooks_run_before_plugin_hooks_each_in_registration_order() -> None:
    log: list[str] = []
    session = HookRegistry({HookEvent.SESSION_START: [named("s1", log=log), named("s2", log=log)]})
    p1 = HookRegistry({HookEvent.SESSION_START: [named("p1a", log=log), named("p1b", log=log)]}, source="plugin:one")
    p2 = HookRegistry({HookEvent.SESSION_START: [named("p2", log=log)]}, source="plugin:two")
    runner = HookRunner(HookRegistry.combine(session, p1, p2))
    decision = await runner.dispatch(HookEvent.SESSION_START, hook_input(HookEvent.SESSION_START))
    assert log == ["s1", "s2", "p1a", "p1b", "p2"]
    assert decision.ran == ("s1", "s2", "p1a", "p1b", "p2")
    assert decision.action is HookAction.CONTINUE


async def test_every_callback_gets_the_original_input_even_if_one_mutates_it() -> None:
    seen: list[dict[str, Any]] = []

    async def mutate(inp: HookInput) -> HookOutput:
        assert inp.tool_input is not None
        seen.append(dict(inp.tool_input))
        inp.tool_input["q"] = "mutated in place"
        inp.tool_input["nested"]["x"] = 99
        return HookOutput.modify({"q": "first"})

    async def look(inp: HookInput) -> HookOutput:
        assert inp.tool_input is not None
        seen.append({"q": inp.tool_input["q"], "nested": dict(inp.tool_input["nested"])})
        return HookOutput.modify({"extra": 1})

    original = {"q": "orig", "nested": {"x": 1}}
    runner = runner_for(HookEvent.PRE_TOOL_USE, mutate, look)
    decision = await runner.dispatch(HookEvent.PRE_TOOL_USE, hook_input(tool_name="t", tool_input=original))
    assert seen[1] == {"q": "orig", "nested": {"x": 1}}
    assert original == {"q": "orig", "nested": {"x": 1}}
    assert decision.modified_input == {"q": "first", "extra": 1}
    assert decision.apply_to(original) == {"q": "first", "nested": {"x": 1}, "extra": 1}


async def test_results_fold_until_the_first_skip_but_all_callbacks_run() -> None:
    log: list[str] = []
    runner = runner_for(
        HookEvent.PRE_TOOL_USE,
        named("a", HookOutput.modify({"q": "a", "k": 1}, context="ctx-a"), log),
        named("b", None, log),
        named("c", HookOutput.modify({"q": "c"}, context="ctx-c"), log),
        named("d", HookOutput.skip("enough", context="ctx-d"), log),
        named("e", HookOutput.abort("later abort is ignored"), log),
        named("f", HookOutput.modify({"q": "f"}, context="ctx-f"), log),
    )
    decision = await runner.dispatch(HookEvent.PRE_TOOL_USE, hook_input(tool_input={"q": "x"}))
    assert log == ["a", "b", "c", "d", "e", "f"]
    assert decision.action is HookAction.SKIP
    assert decision.reason == "enough"
    assert (decision.decided_by, decision.source) == ("d", "session")
    assert decision.modified_input == {"q": "c", "k": 1}
    assert decision.additional_context == ("ctx-a", "ctx-c", "ctx-d")
    assert decision.context_text == "ctx-a\n\nctx-c\n\nctx-d"


async def test_abort_decision_raises_typed_error_on_request() -> None:
    runner = runner_for(HookEvent.USER_PROMPT_SUBMIT, named("ok"), named("guard", HookOutput.abort("no secrets")))
    decision = await runner.dispatch(HookEvent.USER_PROMPT_SUBMIT, hook_input(HookEvent.USER_PROMPT_SUBMIT, prompt="p"))
    assert decision.action is HookAction.ABORT
    with pytest.raises(HookAbortedError) as info:
        decision.raise_for_abort()
    assert (info.value.event, info.value.callback, info.value.reason) == (
        HookEvent.USER_PROMPT_SUBMIT,
        "guard",
        "no secrets",
    )
    assert info.value.code == "hook_abort"
    HookDecision(HookEvent.STOP).raise_for_abort()  # continue: nothing raised


@pytest.mark.parametrize("event", [HookEvent.USER_PROMPT_SUBMIT, HookEvent.SUBAGENT_START])
async def test_prompt_events_take_a_string_or_a_prompt_object(event: HookEvent) -> None:
    runner = runner_for(
        event, named("a", HookOutput.modify("[a] hi")), named("b", HookOutput.modify({"prompt": "[b]"}))
    )
    decision = await runner.dispatch(event, hook_input(event, prompt="hi"))
    assert decision.prompt == "[b]"
    only_string = runner_for(event, named("a", HookOutput.modify("[a] hi")))
    assert (await only_string.dispatch(event, hook_input(event, prompt="hi"))).prompt == "[a] hi"


@pytest.mark.parametrize("event", [HookEvent.USER_PROMPT_SUBMIT, HookEvent.SUBAGENT_START])
async def test_prompt_events_take_the_specs_user_prompt_key(event: HookEvent) -> None:
    runner = runner_for(event, named("a", HookOutput.modify({"userPrompt": "[spec] hi"})))
    decision = await runner.dispatch(event, hook_input(event, prompt="hi"))
    assert decision.prompt == "[spec] hi"
    assert decision.modified_input == {"prompt": "[spec] hi"}
    both = runner_for(event, named("a", HookOutput.modify({"userPrompt": "x", "prompt": "y"})))
    with pytest.raises(HookReturnError, match="userPrompt"):
        await both.dispatch(event, hook_input(event, prompt="hi"))


# -- per-event input classes ----------------------------------------------------------------

_CLASSES = {
    HookEvent.SESSION_START: SessionStartInput,
    HookEvent.USER_PROMPT_SUBMIT: UserPromptSubmitInput,
    HookEvent.PRE_TOOL_USE: PreToolUseInput,
    HookEvent.PERMISSION_REQUEST: PermissionRequestInput,
    HookEvent.POST_TOOL_USE: PostToolUseInput,
    HookEvent.POST_TOOL_USE_FAILURE: PostToolUseFailureInput,
    HookEvent.SUBAGENT_START: SubagentStartInput,
    HookEvent.SUBAGENT_STOP: SubagentStopInput,
    HookEvent.STOP: StopInput,
    HookEvent.SESSION_END: SessionEndInput,
}


@pytest.mark.parametrize("event", list(HookEvent))
async def test_each_event_hands_its_callbacks_its_own_input_class(event: HookEvent) -> None:
    seen: list[HookInput] = []

    async def record(inp: HookInput) -> None:
        seen.append(inp)

    fields: dict[str, Any] = {}
    if event is HookEvent.POST_TOOL_USE_FAILURE:
        failure = ToolResult.failure(ToolErrorType.EXECUTION, "boom")
        fields = {"tool_name": "t", "tool_input": {}, "tool_result": failure, "error": failure.error}
    flat = hook_input(event, **fields)
    assert type(flat) is HookInput
    await runner_for(event, record).dispatch(event, flat)
    [got] = seen
    assert type(got) is _CLASSES[event]
    assert isinstance(got, HookInput) and got.event is event and got.session_id == "s1"
    # The other events' fields stay readable (None), so callbacks typed HookInput keep working.
    assert got.last_message is None


def test_event_inputs_type_the_fields_their_event_always_sets() -> None:
    pre = PreToolUseInput(session_id="s", tool_name="Bash", tool_input={"command": "ls"})
    assert (pre.event, pre.tool_name, pre.prompt) == (HookEvent.PRE_TOOL_USE, "Bash", None)
    prompt = UserPromptSubmitInput(session_id="s", prompt="hello")
    assert prompt.user_prompt == "hello"
    with pytest.raises(TypeError, match="tool_name"):
        PreToolUseInput(session_id="s", tool_input={})  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="has no prompt"):
        PreToolUseInput(session_id="s", tool_name="t", tool_input={}, prompt="x")
    with pytest.raises(TypeError, match="input of PreToolUse"):
        PreToolUseInput(event=HookEvent.STOP, session_id="s", tool_name="t", tool_input={})
    assert typed_input(pre) is pre
    with pytest.raises(ConfigError, match="not a valid UserPromptSubmit hook input"):
        typed_input(HookInput(event=HookEvent.USER_PROMPT_SUBMIT, session_id="s"))


def test_hook_errors_live_in_the_error_tree_and_old_imports_still_work() -> None:
    import trio_agent._errors as errors
    import trio_agent._session._hooks as hooks

    for name in ("HookError", "HookReturnError", "HookTimeoutError", "HookInterruptedError", "HookAbortedError"):
        assert getattr(hooks, name) is getattr(errors, name)
        assert issubclass(getattr(errors, name), TrioAgentError)
        assert name in (errors.__doc__ or "")


# -- garbage returns and raising hooks ----------------------------------------------------


@pytest.mark.parametrize(
    ("event", "returned", "fragment"),
    [
        (HookEvent.STOP, {"action": "continue"}, "expected HookOutput or None"),
        (HookEvent.STOP, "continue", "expected HookOutput or None"),
        (HookEvent.STOP, True, "expected HookOutput or None"),
        (HookEvent.SESSION_START, HookOutput.modify({"a": 1}), "does not accept"),
        (HookEvent.STOP, HookOutput(modified_output="x"), "only PostToolUse"),
        (HookEvent.PRE_TOOL_USE, HookOutput.modify("a string"), "expected a JSON object"),
        (HookEvent.PRE_TOOL_USE, HookOutput.modify({1: "int key"}), "expected a JSON object"),  # type: ignore[dict-item]
        (
            HookEvent.USER_PROMPT_SUBMIT,
            HookOutput.modify({"prompt": "x", "more": 1}),
            "expected a string, {'prompt': str}",
        ),
        (HookEvent.USER_PROMPT_SUBMIT, HookOutput.modify({"prompt": 3}), "expected a string, {'prompt': str}"),
        # Non-JSON inside the object: refused here, not later by the pipeline (middleware_error).
        (HookEvent.PRE_TOOL_USE, HookOutput.modify({"x": {1, 2}}), "modified_input.x is not JSON: set"),
        (HookEvent.PRE_TOOL_USE, HookOutput.modify({"x": [math.nan]}), "modified_input.x[0] is not a finite"),
        (HookEvent.PERMISSION_REQUEST, HookOutput.modify({"x": {1: 2}}), "modified_input.x has a non-string key"),
        (HookEvent.POST_TOOL_USE, HookOutput(modified_output={"a": object()}), "modified_output.a is not JSON"),
        # An empty prompt is no prompt (as send refuses one); "don't send it" is a skip.
        (HookEvent.USER_PROMPT_SUBMIT, HookOutput.modify(""), "returned an empty prompt"),
        (HookEvent.USER_PROMPT_SUBMIT, HookOutput.modify({"userPrompt": " \n"}), "returned an empty prompt"),
        (HookEvent.SUBAGENT_START, HookOutput.modify({"prompt": ""}), "returned an empty prompt"),
    ],
)
async def test_garbage_returns_raise_a_typed_error_naming_event_and_callback(
    event: HookEvent, returned: Any, fragment: str
) -> None:
    log: list[str] = []
    runner = runner_for(event, named("good", None, log), named("junk", returned, log), named("after", None, log))
    with pytest.raises(HookReturnError) as info:
        await runner.dispatch(event, hook_input(event))
    assert fragment in str(info.value)
    assert info.value.event is event
    assert info.value.callback == "junk"
    assert info.value.source == "session"
    assert info.value.code == "hook_invalid_return"
    assert isinstance(info.value, HookError)
    assert log == ["good", "junk"]


async def test_a_raising_hook_is_a_hook_error_with_the_cause() -> None:
    log: list[str] = []

    async def broken(inp: HookInput) -> None:
        raise KeyError("nope")

    runner = runner_for(HookEvent.SUBAGENT_STOP, named("first", None, log), broken, named("never", None, log))
    with pytest.raises(HookError) as info:
        await runner.dispatch(HookEvent.SUBAGENT_STOP, hook_input(HookEvent.SUBAGENT_STOP))
    assert type(info.value) is HookError
    assert isinstance(info.value, TrioAgentError)
    assert isinstance(info.value.__cause__, KeyError)
    assert info.value.callback.endswith("broken")  # type: ignore[union-attr]
    assert "SubagentStop hook" in str(info.value)
    assert log == ["first"]


async def test_lease_loss_from_a_hook_propagates_untouched() -> None:
    async def lost(inp: HookInput) -> None:
        raise LeaseLostError("gone")

    with pytest.raises(LeaseLostError):
        await runner_for(HookEvent.STOP, lost).dispatch(HookEvent.STOP, hook_input(HookEvent.STOP))


# -- deadlines and aborts --------------------------------------------------------------


def sleeper(name: str, seconds: float, log: list[str]) -> Any:
    async def hook(inp: HookInput) -> None:
        log.append(f"{name}:start")
        await trio.sleep(seconds)
        log.append(f"{name}:end")

    hook.__qualname__ = name
    return hook


async def test_one_deadline_is_shared_by_all_callbacks_of_an_event(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    runner = runner_for(HookEvent.STOP, sleeper("a", 40, log), sleeper("b", 40, log), sleeper("c", 1, log))
    start = trio.current_time()
    with pytest.raises(HookTimeoutError) as info:
        await runner.dispatch(HookEvent.STOP, hook_input(HookEvent.STOP))
    assert trio.current_time() - start == pytest.approx(60.0)
    assert log == ["a:start", "a:end", "b:start"]
    assert (info.value.callback, info.value.seconds, info.value.code) == ("b", 60.0, "hook_timeout")
    assert isinstance(info.value, TimeoutError)


async def test_per_event_deadlines_and_session_end_default(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    registry = HookRegistry({HookEvent.SESSION_END: [sleeper("end", 6, log)], HookEvent.STOP: [sleeper("s", 6, log)]})
    runner = HookRunner(registry, deadlines={HookEvent.STOP: 10})
    await runner.dispatch(HookEvent.STOP, hook_input(HookEvent.STOP))  # 6 s < 10 s
    start = trio.current_time()
    with pytest.raises(HookTimeoutError):
        await runner.dispatch(HookEvent.SESSION_END, hook_input(HookEvent.SESSION_END))
    assert trio.current_time() - start == pytest.approx(5.0)
    assert log == ["s:start", "s:end", "end:start"]


async def test_a_callback_sees_the_event_deadline(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[float] = []

    async def look(inp: HookInput) -> None:
        seen.append(trio.current_effective_deadline() - trio.current_time())

    await runner_for(HookEvent.STOP, look, deadlines={HookEvent.STOP: 7}).dispatch(
        HookEvent.STOP, hook_input(HookEvent.STOP)
    )
    assert seen == [pytest.approx(7.0)]


async def test_a_callback_swallowing_the_deadline_still_times_out(autojump_clock: trio.testing.MockClock) -> None:
    async def stubborn(inp: HookInput) -> HookOutput:
        with contextlib.suppress(trio.Cancelled):  # wrong, but must not turn a missed deadline into success
            await trio.sleep(100)
        return HookOutput.context("late")

    with pytest.raises(HookTimeoutError):
        await runner_for(HookEvent.STOP, stubborn).dispatch(HookEvent.STOP, hook_input(HookEvent.STOP))


async def test_a_callback_whose_own_nursery_fails_while_the_deadline_cancels_it_times_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Trio hands the rest of the nursery's group through the deadline's scope: a bare
    # ExceptionGroup left dispatch instead of the hook's typed timeout.
    async def with_helpers(inp: HookInput) -> None:
        await nursery_failing_in_cleanup()

    with pytest.raises(HookTimeoutError) as info:
        await runner_for(HookEvent.STOP, with_helpers).dispatch(HookEvent.STOP, hook_input(HookEvent.STOP))
    assert isinstance(info.value.__cause__, BaseExceptionGroup)


async def test_outside_cancellation_propagates_as_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    runner = runner_for(HookEvent.STOP, sleeper("a", 30, log))
    with trio.move_on_after(10) as outer:
        await runner.dispatch(HookEvent.STOP, hook_input(HookEvent.STOP))
    assert outer.cancelled_caught
    assert log == ["a:start"]


async def test_the_callers_abort_interrupts_the_hooks(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    abort = AbortHandle()
    runner = runner_for(HookEvent.STOP, sleeper("a", 30, log), sleeper("b", 1, log))

    async def abort_soon() -> None:
        await trio.sleep(3)
        abort.abort(AbortReason.USER_ABORT, "user pressed stop")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(abort_soon)
        with pytest.raises(HookInterruptedError) as info:
            await runner.dispatch(HookEvent.STOP, hook_input(HookEvent.STOP), abort=abort)
    assert info.value.abort.reason is AbortReason.USER_ABORT
    assert info.value.callback == "a"
    assert log == ["a:start"]
    # Already aborted: nothing runs.
    with pytest.raises(HookInterruptedError):
        await runner.dispatch(HookEvent.STOP, hook_input(HookEvent.STOP), abort=abort)
    assert log == ["a:start"]


async def test_an_unused_abort_handle_leaves_no_listener_behind() -> None:
    abort = AbortHandle()
    runner = runner_for(HookEvent.STOP, named("a", HookOutput.context("x")))
    decision = await runner.dispatch(HookEvent.STOP, hook_input(HookEvent.STOP), abort=abort)
    assert decision.additional_context == ("x",)
    assert abort._first is None and not abort._listeners


# -- PreToolUse through a real pipeline ----------------------------------------------------


async def test_pre_tool_use_modifies_the_input_the_tool_and_journal_see() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    seen: list[HookInput] = []

    async def rewrite(inp: HookInput) -> HookOutput:
        seen.append(inp)
        return HookOutput.modify({"q": inp.tool_input["q"].upper()})  # type: ignore[index]

    pipeline = pipeline_with(runner_for(HookEvent.PRE_TOOL_USE, rewrite), echo_tool(runs), journal)
    record = await call_tool(pipeline, "echo", {"q": "hi", "mode": "m"}, call_id="c1")
    assert runs.inputs == [{"q": "HI", "mode": "m"}]
    assert record.result.output == "echo:HI"
    assert record.effective_input == {"q": "HI", "mode": "m"}
    assert journal.kinds("c1") == ["scheduled", "started", "settled"]
    assert journal.entries[1].data["input"] == {"q": "HI", "mode": "m"}
    (inp,) = seen
    assert (inp.event, inp.tool_name, inp.tool_call_id, inp.tool_input) == (
        HookEvent.PRE_TOOL_USE,
        "echo",
        "c1",
        {"q": "hi", "mode": "m"},
    )
    assert (inp.session_id, inp.agent_id) == ("session", "root")


async def test_a_raising_pre_tool_use_hook_denies_the_call_fail_closed() -> None:
    runs, journal = Runs(), InMemoryToolJournal()

    async def broken(inp: HookInput) -> None:
        raise RuntimeError("policy service down")

    pipeline = pipeline_with(runner_for(HookEvent.PRE_TOOL_USE, broken), echo_tool(runs), journal)
    record = await call_tool(pipeline, "echo", {"q": "hi"}, call_id="c1")
    assert runs.inputs == []
    assert not record.tool_ran
    error = record.result.error
    assert error is not None
    assert (error.type, error.code) == (ToolErrorType.EXECUTION, "hook_error")
    assert "PreToolUse hook" in record.result.output
    assert "policy service down" in record.result.output
    assert "was not run" in record.result.output
    assert record.status is SettlementStatus.FAILED
    assert journal.kinds("c1") == ["scheduled", "settled"]


async def test_a_pre_tool_use_hook_raising_an_unprintable_exception_still_denies_the_call() -> None:
    # The HookError's message told the exception by its repr: one whose __repr__ (and __str__)
    # raised made the hook's failure raise out of the pipeline instead of denying the call.
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str")

        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    async def broken(inp: HookInput) -> None:
        raise Unprintable

    runs, journal = Runs(), InMemoryToolJournal()
    pipeline = pipeline_with(runner_for(HookEvent.PRE_TOOL_USE, broken), echo_tool(runs), journal)
    record = await call_tool(pipeline, "echo", {"q": "hi"}, call_id="c1")
    assert runs.inputs == [] and record.status is SettlementStatus.FAILED
    assert record.result.error is not None and record.result.error.code == "hook_error"
    assert "Unprintable" in record.result.output


garbage = st.one_of(
    st.integers(),
    st.text(max_size=5),
    st.booleans(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=2),
    st.just(HookOutput(modified_output="only for post hooks")),
    st.just(HookOutput.modify("a string is not a tool input")),
)


@settings(max_examples=40, deadline=None)
@given(returned=garbage)
def test_a_pre_tool_use_hook_returning_garbage_denies_the_call(returned: Any) -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    pipeline = pipeline_with(runner_for(HookEvent.PRE_TOOL_USE, named("junk", returned)), echo_tool(runs), journal)
    record = trio.run(functools.partial(call_tool, pipeline, "echo", {"q": "hi"}, call_id="c1"))
    assert runs.inputs == []
    assert record.result.error is not None
    assert record.result.error.code == "hook_error"
    assert "PreToolUse hook junk (session)" in record.result.output
    assert journal.kinds("c1") == ["scheduled", "settled"]


@pytest.mark.parametrize("value", [{1, 2}, math.inf, {"deep": [{3: "int key"}]}, object()])
async def test_a_pre_tool_use_hook_returning_nested_non_json_denies_with_hook_error(value: Any) -> None:
    # Was accepted by the hook check and refused later by the pipeline: code middleware_error.
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(HookEvent.PRE_TOOL_USE, named("junk", HookOutput.modify({"mode": value})))
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "hi"}, call_id="c1")
    assert runs.inputs == []
    assert record.result.error is not None
    assert (record.result.error.type, record.result.error.code) == (ToolErrorType.EXECUTION, "hook_error")
    assert "PreToolUse hook junk (session) returned a modified_input that is not JSON" in record.result.output
    assert journal.kinds("c1") == ["scheduled", "settled"]


async def test_a_late_pre_tool_use_hook_denies_with_a_timeout(autojump_clock: trio.testing.MockClock) -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(HookEvent.PRE_TOOL_USE, sleeper("slow", 100, []), deadlines={HookEvent.PRE_TOOL_USE: 3})
    pipeline = pipeline_with(runner, echo_tool(runs), journal)
    start = trio.current_time()
    record = await call_tool(pipeline, "echo", {"q": "hi"}, call_id="c1")
    assert trio.current_time() - start == pytest.approx(3.0)
    assert runs.inputs == []
    assert record.result.error is not None
    assert (record.result.error.type, record.result.error.code) == (ToolErrorType.EXECUTION, "hook_timeout")
    assert "missed their 3 s deadline" in record.result.output
    assert journal.kinds("c1") == ["scheduled", "settled"]


async def test_pre_tool_use_skip_settles_cancelled_from_scheduled_with_the_reason() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(HookEvent.PRE_TOOL_USE, named("cache", HookOutput.skip("already answered", context="see X")))
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "hi"}, call_id="c1")
    assert runs.inputs == []
    assert record.status is SettlementStatus.CANCELLED
    assert record.result.error is not None
    assert (record.result.error.type, record.result.error.code) == (ToolErrorType.PERMISSION_DENIED, "hook_skip")
    assert "skipped the call to 'echo': already answered" in record.result.output
    assert "see X" in record.result.output
    # No tool_started: the call settles straight from scheduled, which the journal accepts.
    assert journal.kinds("c1") == ["scheduled", "settled"]
    assert journal.entries[-1].data["reason"] == "hook_skip"
    assert not record.synthetic_start


async def test_pre_tool_use_abort_fails_the_call_without_running_it() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(HookEvent.PRE_TOOL_USE, named("ok"), named("guard", HookOutput.abort("rm -rf")))
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "hi"}, call_id="c1")
    assert runs.inputs == []
    assert record.status is SettlementStatus.FAILED
    assert record.result.error is not None
    assert record.result.error.code == "hook_abort"
    assert "PreToolUse hook guard (session) aborted the call to 'echo': rm -rf" in record.result.output
    assert journal.kinds("c1") == ["scheduled", "settled"]


async def test_pre_tool_use_context_lands_in_the_result_metadata() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    registry = HookRegistry(
        {
            HookEvent.PRE_TOOL_USE: [named("pre", HookOutput.context("pre-ctx"))],
            HookEvent.POST_TOOL_USE: [named("post", HookOutput.context("post-ctx"))],
        }
    )
    runner = HookRunner(registry)
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "hi"}, call_id="c1")
    assert record.result.ok
    assert record.result.metadata[HOOK_CONTEXT_KEY] == ("pre-ctx", "post-ctx")
    assert record.result.output == "echo:hi\npre-ctx\npost-ctx"  # the model reads it, in order
    assert journal.entries[-1].data["result"].output == record.result.output
    assert record.result.metadata["m"] == 1
    assert len(runner._pending_context) == 0


async def test_hook_context_follows_a_json_output_as_the_model_reads_it() -> None:
    async def structured(inp: dict[str, Any], ctx: Any) -> ToolResult:
        return ToolResult.success({"rows": [1, 2]}, data={"rows": [1, 2]})

    tool = define_tool(structured, name="rows", description="rows", input_schema=SCHEMA, side_effect="pure")
    runner = runner_for(HookEvent.PRE_TOOL_USE, named("pre", HookOutput.context("cached")))
    record = await call_tool(pipeline_with(runner, tool, InMemoryToolJournal()), "rows", {"q": "x"})
    assert record.result.output == '{"rows": [1, 2]}\ncached'
    assert record.result.data == {"rows": [1, 2]}  # for programs: unchanged


async def test_pre_tool_use_context_without_post_hooks_still_reaches_the_result() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(HookEvent.PRE_TOOL_USE, named("pre", HookOutput.context("only-pre")))
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "hi"})
    assert record.result.metadata[HOOK_CONTEXT_KEY] == ("only-pre",)
    assert record.result.output == "echo:hi\nonly-pre"  # text for the model, after the output


async def test_stages_without_hooks_change_nothing() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    record = await call_tool(pipeline_with(HookRunner(HookRegistry()), echo_tool(runs), journal), "echo", {"q": "a"})
    assert record.result == ToolResult.success("echo:a", metadata={"m": 1})
    assert runs.inputs == [{"q": "a"}]


@pytest.mark.parametrize("skipped", [ToolResult.success("cached"), ToolResult.failure(ToolErrorType.EXECUTION, "no")])
async def test_post_tool_stage_passes_a_before_stage_skip_by(skipped: ToolResult) -> None:
    # A before stage's Skip goes through the post_tool stages with tool_ran=False: the tool never
    # ran, so neither PostToolUse nor PostToolUseFailure may see it (a later post stage still does).
    runs, fired, seen = Runs(), [], []
    registry = HookRegistry(
        {
            HookEvent.PRE_TOOL_USE: [named("pre", HookOutput.context("pre-ctx"))],
            HookEvent.POST_TOOL_USE: [named("post", HookOutput.modify(output="hooked"), fired)],
            HookEvent.POST_TOOL_USE_FAILURE: [named("failure", HookOutput.modify(output="hooked"), fired)],
        }
    )
    runner = HookRunner(registry)

    async def skip(request: StageRequest) -> Skip | None:
        return Skip(skipped) if request.input["q"] == "skip" else None

    async def after(request: StageRequest, result: ToolResult) -> None:
        seen.append((request.input["q"], request.tool_ran))

    stages = ToolStages(pre_tool=[pre_tool_stage(runner)], before=[skip], post_tool=[post_tool_stage(runner), after])
    pipeline = ToolPipeline([echo_tool(runs)], stages=stages, journal=InMemoryToolJournal())
    record = await call_tool(pipeline, "echo", {"q": "skip"}, call_id="c1")
    assert (runs.inputs, fired, seen) == ([], [], [("skip", False)])
    assert record.result.output == f"{skipped.output}\npre-ctx"  # PreToolUse ran; its context stays
    assert record.result.ok is skipped.ok and len(runner._pending_context) == 0
    record = await call_tool(pipeline, "echo", {"q": "run"}, call_id="c2")
    assert (runs.inputs, fired, seen[1:]) == ([{"q": "run"}], ["post"], [("run", True)])
    assert record.result.output == "hooked\npre-ctx"


# -- PostToolUse / PostToolUseFailure through a real pipeline ---------------------------------


async def test_post_tool_use_replaces_the_output_and_the_journal_records_it() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    seen: list[HookInput] = []

    async def redact(inp: HookInput) -> HookOutput:
        seen.append(inp)
        return HookOutput.modify(output=str(inp.tool_result.output).replace("secret", "***"))  # type: ignore[union-attr]

    failure_hook = named("never", HookOutput.modify(output="wrong event"))
    registry = HookRegistry({HookEvent.POST_TOOL_USE: [redact], HookEvent.POST_TOOL_USE_FAILURE: [failure_hook]})
    record = await call_tool(
        pipeline_with(HookRunner(registry), echo_tool(runs), journal), "echo", {"q": "secret"}, call_id="c1"
    )
    assert record.result.output == "echo:***"
    assert record.result.ok
    assert journal.entries[-1].data["result"].output == "echo:***"
    (inp,) = seen
    assert inp.event is HookEvent.POST_TOOL_USE
    assert inp.tool_input == {"q": "secret"}
    assert inp.tool_result is not None and inp.tool_result.output == "echo:secret"
    assert inp.error is None


async def test_post_tool_use_abort_turns_success_into_an_execution_error() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(HookEvent.POST_TOOL_USE, named("scan", HookOutput.abort("looks like a credential")))
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "hi"}, call_id="c1")
    assert runs.inputs == [{"q": "hi"}]  # the tool ran
    assert record.result.error is not None
    assert (record.result.error.type, record.result.error.code) == (ToolErrorType.EXECUTION, "hook_abort")
    assert "looks like a credential" in record.result.output
    assert "echo:hi" not in record.result.output
    assert record.status is SettlementStatus.FAILED
    assert journal.kinds("c1") == ["scheduled", "started", "settled"]


async def test_a_raising_post_tool_use_hook_withholds_the_output() -> None:
    runs, journal = Runs(), InMemoryToolJournal()

    async def redactor(inp: HookInput) -> None:
        raise ValueError("redaction model unavailable")

    runner = runner_for(HookEvent.POST_TOOL_USE, redactor)
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "pw"}, call_id="c1")
    assert runs.inputs == [{"q": "pw"}]
    assert record.result.error is not None
    assert record.result.error.code == "hook_error"
    assert "redaction model unavailable" in record.result.output
    assert "echo:pw" not in record.result.output
    assert journal.entries[-1].data["result"].output == record.result.output


async def test_post_tool_use_skip_keeps_earlier_changes_and_ignores_later_ones() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(
        HookEvent.POST_TOOL_USE,
        named("a", HookOutput.modify(output="from a")),
        named("b", HookOutput.skip("done")),
        named("c", HookOutput.modify(output="from c")),
    )
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "hi"})
    assert record.result == ToolResult.success("from a", metadata={"m": 1})


async def test_post_tool_use_failure_keeps_the_error_and_may_rewrite_its_text() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    seen: list[HookInput] = []

    async def explain(inp: HookInput) -> HookOutput:
        seen.append(inp)
        return HookOutput(modified_output="Error: try a shorter query", additional_context="hint")

    success_hook = named("never", HookOutput.abort("wrong event"))
    registry = HookRegistry({HookEvent.POST_TOOL_USE_FAILURE: [explain], HookEvent.POST_TOOL_USE: [success_hook]})
    record = await call_tool(
        pipeline_with(HookRunner(registry), echo_tool(runs, fail="raise"), journal), "echo", {"q": "x"}, call_id="c1"
    )
    assert record.result.output == "Error: try a shorter query\nhint"
    assert record.result.error is not None
    assert (record.result.error.type, record.result.error.code) == (ToolErrorType.EXECUTION, "tool_code")
    assert record.result.metadata[HOOK_CONTEXT_KEY] == ("hint",)
    (inp,) = seen
    assert inp.event is HookEvent.POST_TOOL_USE_FAILURE
    assert inp.error is not None and inp.error.message == "boom:x"


async def test_post_tool_use_failure_abort_and_skip_never_turn_an_error_into_success() -> None:
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(HookEvent.POST_TOOL_USE_FAILURE, named("a", HookOutput.abort("give up")))
    record = await call_tool(pipeline_with(runner, echo_tool(runs, fail="raise"), journal), "echo", {"q": "x"})
    assert record.result.error is not None
    assert record.result.error.code == "tool_code"
    assert record.result.output == "Error: boom:x"
    assert record.result.metadata["hook_abort"] == "give up"


async def test_a_raising_post_tool_use_failure_hook_keeps_the_original_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs, journal = Runs(), InMemoryToolJournal()

    async def broken(inp: HookInput) -> None:
        raise RuntimeError("hook bug")

    runner = runner_for(HookEvent.POST_TOOL_USE_FAILURE, broken)
    with caplog.at_level(logging.WARNING, logger="trio_agent.hooks"):
        record = await call_tool(pipeline_with(runner, echo_tool(runs, fail="raise"), journal), "echo", {"q": "x"})
    assert record.result.output == "Error: boom:x"
    assert record.result.error is not None
    assert (record.result.error.type, record.result.error.code) == (ToolErrorType.EXECUTION, "tool_code")
    assert "hook bug" in record.result.metadata["hook_error"]
    assert any("hook bug" in message for message in caplog.messages)


async def test_failure_hooks_do_not_run_for_a_timed_out_tool(autojump_clock: trio.testing.MockClock) -> None:
    # The pipeline cancels the core on a timeout and settles the timeout as is: post_tool stages are not entered.
    runs, journal = Runs(), InMemoryToolJournal()
    log: list[str] = []
    runner = runner_for(HookEvent.POST_TOOL_USE_FAILURE, named("a", HookOutput.modify(output="Error: slow"), log))
    record = await call_tool(
        pipeline_with(runner, echo_tool(runs, fail="sleep", timeout=2), journal), "echo", {"q": "x"}, call_id="c1"
    )
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.TIMEOUT
    assert record.result.output == "Error: The tool call did not finish in time and was stopped (timed out after 2 s)."
    assert log == []
    assert journal.kinds("c1") == ["scheduled", "started", "settled"]


def test_stage_factories_need_a_runner() -> None:
    with pytest.raises(ConfigError):
        pre_tool_stage(HookRegistry())  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        post_tool_stage(None)  # type: ignore[arg-type]


async def test_post_tool_hooks_are_also_bounded_by_the_pipeline_unwind_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # After the tool returned, the rest runs under the pipeline's unwind_grace (2 s by default): a slower
    # PostToolUse hook makes the pipeline persist the raw result and withhold it, whatever the hook deadline.
    runs, journal = Runs(), InMemoryToolJournal()
    runner = runner_for(HookEvent.POST_TOOL_USE, sleeper("slow", 5, []))
    record = await call_tool(pipeline_with(runner, echo_tool(runs), journal), "echo", {"q": "x"}, call_id="c1")
    assert runs.inputs == [{"q": "x"}]
    assert not record.published
    assert record.result.error is not None
    assert record.result.error.code == "unwind_deadline_missed"
    assert journal.entries[-1].data["published"] is False
    # With a grace above the hook's 5 s the hook completes and the result is published.
    stages = ToolStages(post_tool=[post_tool_stage(runner)])
    roomy = ToolPipeline([echo_tool(runs)], stages=stages, unwind_grace=10)
    assert (await call_tool(roomy, "echo", {"q": "y"})).result.output == "echo:y"
