"""A user's value whose ``__repr__`` raises never replaces the typed error that names it.

Tool middleware and stages, permission decisions, resolvers, hooks, ``signature_content`` and the
items a tool emits are the user's code, and so is the ``__repr__`` of whatever junk they hand back.
Every message that shows such a value goes through `safe_repr`: the error raised (or the call's
error result) is ours, saying what was wrong, and never the repr's own exception.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from trio_agent import ConfigError, HookEvent, HookInput, HookOutput, ToolDefinitionError, ToolFailure, ToolResult
from trio_agent._config import validate_limit
from trio_agent._lifecycle._interrupts import registered_interrupts, split_client_tools
from trio_agent._loop._context import RunContext
from trio_agent._loop._events import CustomEvent, RunEvent
from trio_agent._loop._hooks import ModelConfig
from trio_agent._loop._interrupts import InterruptResolutions
from trio_agent._loop._rules import LoopState
from trio_agent._session._hooks import HookRegistry, HookReturnError, HookRunner, PreToolUseInput, pre_tool_stage
from trio_agent._tools._definition import define_tool
from trio_agent._util import callable_name, instance_of, safe_repr
from trio_agent.lifecycle import (
    CapabilityError,
    MiddlewareDecisionError,
    TransformArgs,
    apply_structured_output_config,
    create_capability,
    define_chat_middleware,
    define_client_tool,
    define_interrupt,
    middleware_lifecycle,
    validate_capabilities,
)
from trio_agent.middleware import MiddlewareShapeError, compose_middleware
from trio_agent.testing import call_tool
from trio_agent.tools import AbortHandle, BehaviorOverride, Deny, Skip, ToolError, ToolPipeline, ToolStages


class Unprintable:
    """Junk as a user's code may return it: not callable, and its repr raises."""

    def __repr__(self) -> str:
        raise RuntimeError("the repr of Unprintable raised")


JUNK_TEXT = "<Unprintable object, unprintable: its repr raised RuntimeError>"


def junk() -> Any:
    """An `Unprintable`, typed as anything: it goes where the API's types say it may not."""
    return Unprintable()


def run_context() -> RunContext:
    async def discard(event: RunEvent) -> None:
        return None

    return RunContext(
        run_id="run-1", thread_id="thread", agent_id="root", abort=AbortHandle(), events=discard, messages=lambda: ()
    )


# -- the describer ---------------------------------------------------------------------------------


def test_safe_repr_never_raises_and_names_the_type_of_what_it_cannot_print() -> None:
    class NotAString:
        def __repr__(self) -> Any:
            return 42

    class LoudStr(str):
        def __repr__(self) -> str:
            raise RuntimeError("loud")

    assert safe_repr(junk()) == JUNK_TEXT
    assert safe_repr([1, junk()]) == "<list object, unprintable: its repr raised RuntimeError>"
    assert safe_repr(NotAString()) == "<NotAString object, unprintable: its repr raised TypeError>"
    assert safe_repr(10**5000) == "<int object, unprintable: its repr raised ValueError>"  # past the digit limit
    assert safe_repr(LoudStr("x")) == "<LoudStr object, unprintable: its repr raised RuntimeError>"
    assert safe_repr({"a": 1}) == "{'a': 1}"
    long = safe_repr("x" * 500)
    assert long.endswith("... (502 characters)") and len(long) < 200


def test_callable_name_and_instance_of_never_raise_on_the_callers_junk() -> None:
    class OddName:
        def __getattribute__(self, name: str) -> Any:
            if name == "__qualname__":
                raise RuntimeError("no name")
            return object.__getattribute__(self, name)

        def __repr__(self) -> str:
            return "<odd>"

    assert callable_name(OddName()) == "<odd>"
    assert callable_name(junk()) == JUNK_TEXT
    assert callable_name(test_safe_repr_never_raises_and_names_the_type_of_what_it_cannot_print).startswith("test_")
    with pytest.raises(TypeError, match=r"'type' must be .*ToolErrorType.* \(got <Unprintable object"):
        ToolError(junk(), "m")
    assert "instance_of validator" in repr(instance_of(int))


# -- inside a tool call: the call fails with our error, the tool's output never leaks ----------------


async def echo_run(inp: dict[str, Any], ctx: Any) -> ToolResult:
    return ToolResult.success("raw output")


async def emit_junk(inp: dict[str, Any], ctx: Any) -> ToolResult:
    await ctx.emit(junk())
    return ToolResult.success("raw output")


async def fail_with_junk_type(inp: dict[str, Any], ctx: Any) -> ToolResult:
    raise ToolFailure("no", type=junk())


def echo(**options: Any) -> Any:
    run = options.pop("run", echo_run)
    return define_tool(
        run, name="echo", description="echo", side_effect="pure", input_schema={"type": "object"}, **options
    )


async def junk_stage(request: Any, *result: Any) -> Any:
    return junk()


async def skip_with_junk(request: Any) -> Any:
    return Skip(junk())


def staged(slot: str) -> ToolPipeline:
    return ToolPipeline([echo()], stages=ToolStages(**{slot: [junk_stage]}))


def lifecycle_stages(**hooks: Any) -> ToolStages:
    stages = middleware_lifecycle([define_chat_middleware(name="mw", **hooks)]).tool_stages(run_context())
    assert stages is not None
    return stages


def session_hook_stages(output: Any) -> ToolStages:
    async def hook(inp: HookInput) -> Any:
        return output

    runner = HookRunner(HookRegistry({HookEvent.PRE_TOOL_USE: [hook]}))
    return ToolStages(pre_tool=[pre_tool_stage(runner)])


CALL_SITES: dict[str, tuple[Callable[[], Any], str, str]] = {
    # site kind: (the pipeline, the result's error code, what its message says)
    "an item the tool emits": (
        lambda: ToolPipeline([echo(run=emit_junk)]),
        "tool_error",
        f"emit() takes Progress, ToolMessage or Effect items, got {JUNK_TEXT}",
    ),
    "a ToolFailure type the tool raises": (
        lambda: ToolPipeline([echo(run=fail_with_junk_type)]),
        "tool_error",
        f"ToolFailure type {JUNK_TEXT} is not a ToolErrorType",
    ),
    **{
        f"a {slot} stage's decision": (
            functools.partial(staged, slot),
            "hook_error",
            f"{slot} stage junk_stage returned {JUNK_TEXT}, expected Allow, Deny or None",
        )
        for slot in ("pre_tool", "permission", "before", "guard")
    },
    "a before stage's Skip": (
        lambda: ToolPipeline([echo()], stages=ToolStages(before=[skip_with_junk])),
        "hook_error",
        f"Skip takes a ToolResult, got Unprintable: {JUNK_TEXT}",
    ),
    "a post_tool stage's result": (
        lambda: ToolPipeline([echo()], stages=ToolStages(post_tool=[junk_stage])),
        "hook_error",
        f"post_tool stage junk_stage returned {JUNK_TEXT}, expected a ToolResult or None; the output of 'echo'",
    ),
    "a behaviour resolver's answer": (
        lambda: ToolPipeline([echo(resolve_behavior=lambda inp: junk())]),
        "behavior_error",
        f"behaviour resolver must return BehaviorOverride or None, got {JUNK_TEXT}",
    ),
    "a field of a resolver's answer": (
        lambda: ToolPipeline([echo(resolve_behavior=lambda inp: BehaviorOverride(kind=junk()))]),
        "behavior_error",
        f"resolved kind {JUNK_TEXT} is not a ToolKind",
    ),
    "on_before_tool_call's decision": (
        lambda: ToolPipeline([echo()], stages=lifecycle_stages(on_before_tool_call=lambda ctx, call: junk())),
        "hook_error",
        f"on_before_tool_call of middleware 'mw' returned {JUNK_TEXT}; expected None, TransformArgs",
    ),
    "on_before_tool_call's TransformArgs": (
        lambda: ToolPipeline(
            [echo()], stages=lifecycle_stages(on_before_tool_call=lambda ctx, call: TransformArgs(junk()))
        ),
        "hook_error",
        f"returned TransformArgs with {JUNK_TEXT}, not a dict",
    ),
    "on_guard_tool_call's decision": (
        lambda: ToolPipeline([echo()], stages=lifecycle_stages(on_guard_tool_call=lambda ctx, call: junk())),
        "hook_error",
        f"on_guard_tool_call of middleware 'mw' returned {JUNK_TEXT}; expected None, Refuse or AbortRun",
    ),
    "on_after_tool_call's decision": (
        lambda: ToolPipeline([echo()], stages=lifecycle_stages(on_after_tool_call=lambda ctx, info: junk())),
        "hook_error",
        f"on_after_tool_call of middleware 'mw' returned {JUNK_TEXT}; expected None or ReplaceResult",
    ),
    "a session hook's return": (
        lambda: ToolPipeline([echo()], stages=session_hook_stages(junk())),
        "hook_error",
        f"returned Unprintable {JUNK_TEXT}, expected HookOutput or None",
    ),
    "a session hook's modified_input": (
        lambda: ToolPipeline([echo()], stages=session_hook_stages(HookOutput.modify({junk(): 1}))),
        "hook_error",
        "returned modified_input <dict object, unprintable: its repr raised RuntimeError>; expected a JSON object",
    ),
}


@pytest.mark.parametrize("site", list(CALL_SITES))
async def test_junk_whose_repr_raises_fails_the_call_with_the_error_naming_it(site: str) -> None:
    build, code, fragment = CALL_SITES[site]
    record = await call_tool(build(), "echo", {"q": "x"})
    error = record.result.error
    assert error is not None, record.result  # fails closed: the raw output is never the answer
    assert error.code == code
    assert fragment in error.message
    assert "raw output" not in str(record.result.output)


def test_signature_content_returning_junk_raises_the_typed_error() -> None:
    tool = echo(signature_content=lambda inp: junk())
    with pytest.raises(TypeError, match="signature content must be a string or None, got <Unprintable object"):
        tool.signature_content_for({"q": "x"})


# -- the loop's hooks: a `MiddlewareDecisionError` naming the hook and the middleware ----------------

CONFIG = ModelConfig(instructions="be brief", messages=(), tools=(), options={})


async def on_config(returned: object) -> object:
    lifecycle = middleware_lifecycle([define_chat_middleware(name="mw", on_config=lambda ctx, c: returned)])
    return await lifecycle.on_config(run_context(), CONFIG)


async def on_chunk(returned: object) -> object:
    lifecycle = middleware_lifecycle([define_chat_middleware(name="mw", on_chunk=lambda ctx, e: returned)])

    async def sink(event: RunEvent) -> None:
        return None

    await lifecycle.wrap_events(run_context(), sink)(CustomEvent("run-1", "root", "e"))
    return None


async def should_continue(returned: object) -> object:
    lifecycle = middleware_lifecycle([define_chat_middleware(name="mw", on_should_continue=lambda ctx, s: returned)])
    return await lifecycle.should_continue(run_context(), LoopState(iteration=1, tool_call_count=0))


async def interrupt_boundary(returned: object) -> object:
    lifecycle = middleware_lifecycle([define_chat_middleware(name="mw", on_interrupt_boundary=lambda ctx: returned)])
    return await lifecycle.on_interrupt_boundary(run_context())


async def interrupt_resolution(returned: object) -> object:
    hook = define_chat_middleware(name="mw", on_interrupt_resolution=lambda ctx, r: returned)
    return await middleware_lifecycle([hook]).on_interrupt_resolution(run_context(), InterruptResolutions())


async def structured_output_config(returned: object) -> object:
    hook = define_chat_middleware(name="mw", on_structured_output_config=lambda ctx, c: returned)
    return await apply_structured_output_config([hook], run_context(), {"instructions": "x", "output_schema": {}})


LOOP_SITES: list[tuple[Callable[[object], Awaitable[object]], object, str]] = [
    (on_config, junk(), "returned <Unprintable"),
    (on_config, {junk(): 1}, f"unknown config keys ['{JUNK_TEXT}']"),
    (on_config, {"instructions": junk()}, f"set instructions to {JUNK_TEXT}, not a str"),
    (on_config, {"options": junk()}, f"set options to {JUNK_TEXT}, not a mapping"),
    (on_config, {"messages": [junk()]}, f"set messages[0] to {JUNK_TEXT}"),
    (on_config, {"tools": [junk()]}, "each must be a ToolSpec"),
    (on_chunk, junk(), f"returned {JUNK_TEXT}; expected None, a RunEvent"),
    (on_chunk, [junk()], f"returned a list holding {JUNK_TEXT}"),
    (should_continue, junk(), f"returned {JUNK_TEXT}; expected True, False or None"),
    (interrupt_boundary, junk(), f"returned {JUNK_TEXT}; expected None or a list of InterruptRequest"),
    (interrupt_resolution, junk(), f"returned {JUNK_TEXT}; expected None or ToolResume"),
    (structured_output_config, junk(), f"returned {JUNK_TEXT}; expected None or a partial dict"),
    (structured_output_config, {junk(): 1}, f"unknown keys ['{JUNK_TEXT}']"),
    (structured_output_config, {"instructions": junk()}, f"set instructions to {JUNK_TEXT}"),
]


@pytest.mark.parametrize(("hook", "returned", "fragment"), LOOP_SITES)
async def test_a_loop_hook_returning_junk_raises_the_decision_error(
    hook: Callable[[object], Awaitable[object]], returned: object, fragment: str
) -> None:
    with pytest.raises(MiddlewareDecisionError) as caught:
        await hook(returned)
    assert caught.value.middleware == "mw"
    assert fragment in str(caught.value)


async def test_a_session_hook_returning_a_junk_action_raises_the_return_error() -> None:
    with pytest.raises(ValueError, match=f"action must be 'continue', 'skip' or 'abort', got {JUNK_TEXT}"):
        HookOutput(action=junk())

    async def hook(inp: HookInput) -> Any:
        return junk()

    runner = HookRunner(HookRegistry({HookEvent.STOP: [hook]}))
    with pytest.raises(HookReturnError, match="returned Unprintable <Unprintable object"):
        await runner.dispatch(HookEvent.STOP, HookInput(event=HookEvent.STOP, session_id="s"))


# -- configuration: junk given where a value was expected -------------------------------------------


async def a_tool_run(inp: dict[str, Any], ctx: Any) -> ToolResult:
    """A tool."""
    return ToolResult.success("ok")


def tool_with(**options: Any) -> Any:
    settings: dict[str, Any] = {"name": "t", "side_effect": "pure", "input_schema": {"type": "object"}, **options}
    return define_tool(options.pop("run", a_tool_run), **{k: v for k, v in settings.items() if k != "run"})


CONFIG_SITES: dict[str, tuple[Callable[[], object], type[Exception]]] = {
    "define_tool run": (lambda: tool_with(run=junk()), ToolDefinitionError),
    "define_tool name": (lambda: tool_with(name=junk()), ToolDefinitionError),
    "define_tool side_effect": (lambda: tool_with(side_effect=junk()), ToolDefinitionError),
    "define_tool kind": (lambda: tool_with(kind=junk()), ToolDefinitionError),
    "define_tool resolve_behavior": (lambda: tool_with(resolve_behavior=junk()), ToolDefinitionError),
    "define_tool schema type": (lambda: tool_with(input_schema={"type": junk()}), ToolDefinitionError),
    "a pipeline's tool": (lambda: ToolPipeline([junk()]), ToolDefinitionError),
    "a pipeline's history_limit": (lambda: ToolPipeline([], history_limit=junk()), ConfigError),
    "a stage": (lambda: ToolStages(pre_tool=[junk()]), ConfigError),
    "a Skip's result": (lambda: Skip(junk()), ConfigError),
    "a Deny's type": (lambda: Deny("no", type=junk()), ConfigError),
    "a ToolFailure's type": (lambda: ToolFailure("no", type=junk()), ValueError),
    "a chat middleware's name": (lambda: define_chat_middleware(name=junk()), MiddlewareShapeError),
    "a chat middleware's hook": (lambda: define_chat_middleware(on_config=junk()), MiddlewareShapeError),
    "a chat middleware's requires": (lambda: define_chat_middleware(requires=junk()), MiddlewareShapeError),
    "a requires entry": (lambda: define_chat_middleware(requires=[junk()]), MiddlewareShapeError),
    "a middleware list": (lambda: middleware_lifecycle(junk()), MiddlewareShapeError),
    "a middleware list's item": (lambda: middleware_lifecycle([junk()]), MiddlewareShapeError),
    "validate_capabilities": (lambda: validate_capabilities(junk()), MiddlewareShapeError),
    "a capability's name": (lambda: create_capability(junk()), CapabilityError),
    "a run's tools": (lambda: split_client_tools(junk()), ConfigError),
    "a run's tool": (lambda: split_client_tools([junk()]), ConfigError),
    "a run's interrupts": (lambda: registered_interrupts(junk(), []), ConfigError),
    "a run's interrupt": (lambda: registered_interrupts([junk()], []), ConfigError),
    "an interrupt id": (lambda: define_interrupt(junk(), response_schema={}), ConfigError),
    "an interrupt schema": (lambda: define_interrupt("q", response_schema=junk()), ConfigError),
    "an interrupt key": (lambda: define_interrupt("q", response_schema={}).request(junk(), "m"), ConfigError),
    "an interrupt message": (
        lambda: define_interrupt("q", response_schema={}).request("k", junk()),
        ConfigError,
    ),
    "a client tool's name": (lambda: define_client_tool(junk()), ConfigError),
    "a hook registry": (lambda: HookRegistry(junk()), ConfigError),
    "a hook registry's key": (lambda: HookRegistry({junk(): []}), ConfigError),
    "a hook callback": (lambda: HookRegistry({HookEvent.STOP: [junk()]}), ConfigError),
    "a hook runner's registry": (lambda: HookRunner(junk()), ConfigError),
    "a hook input's event": (
        lambda: PreToolUseInput(event=junk(), session_id="s", tool_name="t", tool_input={}),
        TypeError,
    ),
    "a hook input's field": (lambda: HookInput(event=HookEvent.STOP, session_id=junk()), TypeError),
    "a hook output's modified_input": (lambda: HookOutput.modify(junk()), TypeError),
    "a composed middleware list": (lambda: compose_middleware(junk(), lambda r: r), MiddlewareShapeError),
    "a composed middleware layer": (lambda: compose_middleware([junk()], lambda r: r), MiddlewareShapeError),
    "a composed terminal": (lambda: compose_middleware([], junk()), MiddlewareShapeError),
    "a tool middleware list": (lambda: ToolPipeline([], middleware=junk()), MiddlewareShapeError),
    "a tool middleware layer": (lambda: ToolPipeline([], middleware=[junk()]), MiddlewareShapeError),
    "a whole number option": (lambda: validate_limit(junk(), name="max_turns"), ConfigError),
}


@pytest.mark.parametrize("site", list(CONFIG_SITES))
def test_junk_configuration_raises_the_typed_error_naming_it(site: str) -> None:
    build, error = CONFIG_SITES[site]
    with pytest.raises(error) as caught:
        build()
    assert "<Unprintable object, unprintable" in str(caught.value)


def test_a_junk_middleware_list_is_quoted_once() -> None:
    # The sequence messages put {!r} around a repr already made: got "'ab'".
    from trio_agent.models import ModelService
    from trio_agent.testing import TestModel

    for build in (lambda: ToolPipeline([], middleware="ab"), lambda: ModelService(TestModel(), "ab")):
        with pytest.raises(MiddlewareShapeError) as caught:
            build()
        assert str(caught.value).endswith("got 'ab'")
