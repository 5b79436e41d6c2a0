"""The tool pipeline's cheaper paths keep what they replace: values built through builders are
ordinary instances of their frozen classes, and the fast paths of one call change no result."""

from __future__ import annotations

import pickle
from typing import Any

import attrs
import pytest
import trio

import trio_agent as ta
from trio_agent._tools._context import execution_context, middleware_request, tool_context
from trio_agent._tools._journal import ScheduledCall, Settlement, SettlementStatus, scheduled_call, settlement
from trio_agent._tools._pipeline import ToolExecutionRecord, _execution_record


def _fence() -> int | None:
    return None


def _pairs() -> list[tuple[Any, Any]]:
    """(built through a builder, built by the constructor) with the same fields."""
    behavior = ta.ToolBehavior(ta.SideEffect.PURE, ta.ToolKind.READONLY, ta.InterruptBehavior.CANCEL, True)
    call = ta.ToolCall("c1", "add", {"a": 1})
    result = ta.ToolResult.success(3)
    scheduled_args = ("c1", "add", {"a": 1}, behavior, "k", "s", "a", "r", "t")
    settlement_args = (SettlementStatus.COMPLETED, result, {"a": 1}, True, None)
    completed = SettlementStatus.COMPLETED
    record_args = (call, {"a": 1}, result, completed, behavior, (), (), True, True, False, None, 1.0, 2.0)
    return [
        (scheduled_call(*scheduled_args), ScheduledCall(*scheduled_args)),
        (settlement(*settlement_args), Settlement(*settlement_args)),
        (_execution_record(*record_args), ToolExecutionRecord(*record_args)),
        (
            ta.ToolResult.success(3, display="d", data=[1], metadata={"m": 1}),
            ta.ToolResult(3, None, "d", [1], {"m": 1}),
        ),
    ]


@pytest.mark.parametrize("pair", _pairs(), ids=lambda pair: type(pair[1]).__name__)
def test_built_values_are_ordinary_frozen_instances(pair: tuple[Any, Any]) -> None:
    built, expected = pair
    cls = type(expected)
    assert type(built) is cls
    assert built == expected
    assert repr(built) == repr(expected)
    assert attrs.asdict(built, recurse=False) == attrs.asdict(expected, recurse=False)
    first = attrs.fields(cls)[0].name
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(built, first, None)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        delattr(built, first)
    evolved = attrs.evolve(built, **{first: getattr(expected, first)})
    assert type(evolved) is cls and evolved == expected


def test_built_values_hash_and_pickle_like_constructed_ones() -> None:
    behavior = ta.ToolBehavior(ta.SideEffect.PURE, ta.ToolKind.READONLY, ta.InterruptBehavior.CANCEL, True)
    args = ("c1", "add", {}, behavior, "k", "s", "a", "r", "t")
    built = scheduled_call(*args)
    # A dict field makes the hash fail the same way for both.
    with pytest.raises(TypeError):
        hash(built)
    with pytest.raises(TypeError):
        hash(ScheduledCall(*args))
    assert pickle.loads(pickle.dumps(built)) == ScheduledCall(*args)


def test_identity_values_are_built_with_every_field() -> None:
    handle = ta.AbortHandle()
    ctx = execution_context("s", "a", "r", "t", "c", "k", handle, _fence, ("x/y",), None, None)
    expected = ta.ExecutionContext("s", "a", "r", "t", "c", "k", handle, _fence, ("x/y",), None)
    assert type(ctx) is ta.ExecutionContext
    for field in attrs.fields(ta.ExecutionContext):
        assert getattr(ctx, field.name) == getattr(expected, field.name)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ctx.session_id = "other"  # type: ignore[misc]

    async def emit(item: ta.ToolItem) -> None:
        return None

    request = middleware_request("add", {"a": 1}, ctx, emit)
    assert type(request) is ta.ToolMiddlewareRequest
    assert (request.tool_name, request.input, request.context, request.emit) == ("add", {"a": 1}, ctx, emit)
    assert repr(request) == repr(ta.ToolMiddlewareRequest("add", {"a": 1}, ctx, emit))

    tool_ctx = tool_context(ctx, emit, None, 5.0, None)
    assert type(tool_ctx) is ta.ToolContext
    assert tool_ctx.execution is ctx and tool_ctx.emit is emit and tool_ctx.tool_call_id == "c"
    assert repr(tool_ctx) == repr(ta.ToolContext(ctx, emit, None, 5.0))


def test_tool_result_success_of_a_subclass_is_the_subclass() -> None:
    @attrs.frozen
    class MyResult(ta.ToolResult):
        pass

    result = MyResult.success(1)
    assert type(result) is MyResult and result.output == 1 and result.metadata == {}


@attrs.frozen
class _AddInput:
    a: int
    b: int


@ta.define_tool(side_effect="pure", kind="readonly")
async def _add(input: _AddInput, ctx: ta.ToolContext) -> ta.ToolResult:
    """Add two integers."""
    await ctx.emit(ta.Progress("adding"))
    return ta.ToolResult.success(input.a + input.b)


@ta.define_tool(
    name="echo",
    input_schema={"type": "object", "properties": {"x": {"type": "object"}}},
    side_effect="pure",
    kind="readonly",
)
async def _echo(input: dict[str, Any], ctx: ta.ToolContext) -> ta.ToolResult:
    """Change the input it got (its own copy) and return it."""
    input["x"]["changed"] = True
    return ta.ToolResult.success(input)


async def test_no_middleware_call_keeps_inputs_apart() -> None:
    items: list[ta.ToolItem] = []

    async def on_item(item: ta.ToolItem) -> None:
        items.append(item)

    journal = ta.InMemoryToolJournal()
    pipeline = ta.ToolPipeline([_add, _echo], journal=journal)
    record = await pipeline.execute(ta.ToolCall("c1", "_add", {"a": 1, "b": 2}), on_item=on_item)
    assert record.result.output == 3 and record.status is SettlementStatus.COMPLETED
    assert record.effects == () and record.faults == () and record.aborted is None
    assert items == [ta.Progress("adding")]
    # The final input is the pipeline's own copy: not the model's dict, nor the journal's.
    assert record.effective_input == {"a": 1, "b": 2}
    assert record.effective_input is not record.call.input
    started = next(entry for entry in journal.entries if entry.kind == "started")
    assert started.data["input"] == record.effective_input
    assert started.data["input"] is not record.effective_input

    model_input = {"x": {"y": 1}}
    record = await pipeline.execute(ta.ToolCall("c2", "echo", model_input))
    assert record.result.output == {"x": {"y": 1, "changed": True}}
    assert model_input == {"x": {"y": 1}}
    assert record.effective_input == {"x": {"y": 1}}


async def test_no_middleware_call_still_sees_an_abort_before_it_starts() -> None:
    handle = ta.AbortHandle()
    handle.abort(ta.AbortReason.USER_ABORT, "stop")
    pipeline = ta.ToolPipeline([_add])
    record = await pipeline.execute(ta.ToolCall("c1", "_add", {"a": 1, "b": 2}), abort=handle)
    assert record.status is SettlementStatus.CANCELLED
    assert record.aborted == ta.Abort(ta.AbortReason.USER_ABORT, "stop")
    assert not record.tool_ran


async def test_a_tool_that_aborts_its_own_call_is_stopped() -> None:
    @ta.define_tool(name="stopper", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
    async def stopper(input: dict[str, Any], ctx: ta.ToolContext) -> ta.ToolResult:
        """Abort itself, then wait."""
        ctx.abort.abort(ta.AbortReason.USER_ABORT, "enough")
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    for middleware in ([], [_passthrough]):
        pipeline = ta.ToolPipeline([stopper], middleware=middleware)
        record = await pipeline.execute(ta.ToolCall("c1", "stopper", {}))
        assert record.status is SettlementStatus.CANCELLED
        assert record.aborted == ta.Abort(ta.AbortReason.USER_ABORT, "enough")
        assert record.tool_ran


async def _passthrough(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
    return await call_next()


def test_a_constructor_is_made_from_the_fields_and_refuses_what_validates_or_converts() -> None:
    from trio_agent._builders import constructor

    @attrs.frozen
    class Plain:
        first: int
        _second: str

    build = constructor(Plain)
    made = build(1, "two")
    assert type(made) is Plain and made == Plain(1, "two")
    with pytest.raises(TypeError):
        build(1)  # every field, positionally

    @attrs.frozen
    class Checked:
        value: int = attrs.field(validator=attrs.validators.instance_of(int))

    @attrs.frozen
    class Converted:
        value: int = attrs.field(converter=int)

    for cls in (Checked, Converted):
        with pytest.raises(TypeError, match="validates or converts"):
            constructor(cls)
    assert constructor(Converted, trusted=("value",))(3) == Converted(3)

    @attrs.frozen
    class SelfChecked:
        value: int

        def __attrs_post_init__(self) -> None:
            if self.value < 0:
                raise ValueError("negative")

    with pytest.raises(TypeError, match="checks itself"):
        constructor(SelfChecked)
    assert constructor(SelfChecked, trusted=("__attrs_post_init__",))(1) == SelfChecked(1)

    @attrs.define
    class Mutable:
        value: int

    made = constructor(Mutable)(2)
    assert type(made) is Mutable and made == Mutable(2)
