"""What a stage, a middleware or the tool's own callbacks make of a call's input fails that call alone.

A review found three ways out of the pipeline that bypassed its typed results: the tool's
``affected_paths`` raising, and input a stage allowed with that the schema check cannot read,
left ``execute`` as bare exceptions on the fast path (and as a ``middleware_error`` blaming the
middleware on the layered one), so a `chat()` run lost its turn and its neighbour calls; and a
stage could change the interrupt behaviour, which only middleware was refused. And the heap of
running calls kept every call that finished beside a long-running one alive.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import trio_agent as ta
from trio_agent._tools._definition import InterruptBehavior
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import (
    AbortHandle,
    Allow,
    BehaviorOverride,
    InMemoryToolJournal,
    ToolCall,
    ToolPipeline,
    ToolStages,
)


async def _write(input: dict[str, Any], ctx: Any) -> ta.ToolResult:
    return ta.ToolResult.success("written")


WRITE = ta.define_tool(
    _write,
    name="write",
    description="Write a file.",
    side_effect="idempotent",
    kind="write",
    input_schema={"type": "object", "properties": {"path": {"type": "string"}}},
    affected_paths=lambda value: [value["path"]],  # raises KeyError without a path
)


async def _passthrough(request: Any, call_next: Any) -> ta.ToolResult:
    result: ta.ToolResult = await call_next()
    return result


async def _allow(request: Any) -> Allow:
    return Allow()


SHAPES: dict[str, dict[str, Any]] = {
    "fast path": {},
    "a guard stage": {"stages": ToolStages(guard=[_allow])},
    "middleware": {"middleware": [_passthrough]},
}


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_affected_paths_that_raise_fail_the_call_alone_the_same_way_on_every_path(shape: str) -> None:
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline([WRITE], journal=journal, **SHAPES[shape])
    record = await pipeline.execute(ToolCall("c1", "write", {}))
    assert record.status.value == "failed" and not record.tool_ran
    assert record.result.error is not None and record.result.error.code == "tool_error"
    assert "affected paths of tool 'write' failed: KeyError('path')" in record.result.error.message
    assert journal.kinds("c1")[-1] == "settled"  # as any failed call


@pytest.mark.parametrize("bad", [{"path": b"x"}, {"path": {1, 2}}, {"path": object()}, {1: "x"}])
async def test_input_a_stage_allowed_that_is_not_json_fails_the_call_as_invalid_input(bad: dict[Any, Any]) -> None:
    async def replace(request: Any) -> Allow:
        return Allow(input=bad)

    pipeline = ToolPipeline([WRITE], journal=InMemoryToolJournal(), stages=ToolStages(pre_tool=[replace]))
    record = await pipeline.execute(ToolCall("c1", "write", {"path": "a"}))
    assert record.status.value == "failed" and not record.tool_ran
    assert record.result.error is not None and record.result.error.code == "invalid_input"


async def test_a_chat_turn_keeps_its_other_calls_when_one_calls_affected_paths_raise() -> None:
    async def slow(input: dict[str, Any], ctx: Any) -> ta.ToolResult:
        await trio.lowlevel.checkpoint()
        return ta.ToolResult.success("slow finished")

    neighbour = ta.define_tool(
        slow, name="slow", description="Slow.", side_effect="pure", kind="readonly", input_schema={"type": "object"}
    )
    model = TestModel(script={"go": [Reply(tool_calls=[("write", {}), ("slow", {})]), Reply(text="done")]})
    result = await ta.chat(model, "go", tools=[WRITE, neighbour])
    assert result.text == "done"
    answers = {
        message.content for message in model.requests[-1].messages if type(message).__name__ == "ToolResultMessage"
    }
    assert "slow finished" in answers
    assert any("affected paths of tool 'write' failed" in answer for answer in answers)


async def test_a_stage_cannot_change_the_interrupt_behaviour_as_middleware_cannot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def run(input: dict[str, Any], ctx: Any) -> ta.ToolResult:
        await trio.sleep(10)
        return ta.ToolResult.success("finished")

    def resolve(value: dict[str, Any]) -> BehaviorOverride | None:
        return BehaviorOverride(interrupt=InterruptBehavior.BLOCK) if value.get("mode") == "long" else None

    tool = ta.define_tool(
        run,
        name="t",
        description="Runs.",
        side_effect="pure",
        kind="readonly",
        interrupt="cancel",
        input_schema={"type": "object", "properties": {"mode": {"type": "string"}}},
        resolve_behavior=resolve,
    )

    async def to_long(request: Any) -> Allow:
        return Allow(input={"mode": "long"})

    pipeline = ToolPipeline([tool], journal=InMemoryToolJournal(), stages=ToolStages(pre_tool=[to_long]))
    steering = AbortHandle()
    async with trio.open_nursery() as nursery:

        async def steer() -> None:
            await trio.sleep(1)
            steering.abort(ta.AbortReason.STEERING)

        nursery.start_soon(steer)
        record = await pipeline.execute(ToolCall("c1", "t", {"mode": "short"}), steering=steering)
    assert record.status.value == "failed" and not record.tool_ran
    assert record.result.error is not None and record.result.error.code == "behavior_error"
    assert "interrupt behavior" in record.result.error.message


async def test_calls_that_finished_beside_a_long_running_call_are_not_kept_alive() -> None:
    # The pipeline's heap of running calls (kept so that new starts wait for a cancelled call
    # that overruns its cleanup) dropped finished entries only from its top: beside a long call
    # (a subagent's, say), every call that finished after it stayed alive with its result.
    release = trio.Event()

    async def run(input: dict[str, Any], ctx: Any) -> ta.ToolResult:
        if input.get("long"):
            await release.wait()
        return ta.ToolResult.success("x" * 1000)

    tool = ta.define_tool(
        run, name="t", description="Runs.", side_effect="pure", kind="readonly", input_schema={"type": "object"}
    )
    pipeline = ToolPipeline([tool], journal=InMemoryToolJournal(keep_entries=False), history_limit=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pipeline.execute, ToolCall("long", "t", {"long": True}))
        await trio.testing.wait_all_tasks_blocked()
        for index in range(50):
            await pipeline.execute(ToolCall(f"c{index}", "t", {}))
        assert len(pipeline._cleanup_heap) == 1  # the long call's own entry only
        release.set()
    assert pipeline._cleanup_heap is None  # dropped once empty


@pytest.mark.parametrize(
    ("call_id", "name", "field"),
    [("", "write", "id"), (None, "write", "id"), (7, "write", "id"), ("c1", "", "name"), ("c1", None, "name")],
)
def test_a_tool_call_without_an_id_or_a_name_is_refused_typed(call_id: Any, name: Any, field: str) -> None:
    # An empty call id reached the durable journal, whose event validator raised a bare ValueError
    # out of `execute` (after nothing was written); the in-memory journal took it.
    with pytest.raises(ta.ToolInputError, match=f"a tool call's {field} must be a non-empty string") as info:
        ToolCall(call_id, name, {})
    assert info.value.tool_name == (name if isinstance(name, str) else "")


async def _items(input: dict[str, Any], ctx: Any) -> ta.ToolResult:
    return ta.ToolResult.success(f"{len(input['items'])} items")


ITEMS = ta.define_tool(
    _items,
    name="items",
    description="Take items.",
    side_effect="pure",
    input_schema={
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string", "pattern": "^y$"}}},
        "required": ["items"],
    },
)
MAYBE_MORE = "... and maybe more: only the first is looked for in an input over 4096 characters"


async def test_a_huge_input_failing_everywhere_is_invalid_input_naming_its_first_issue_only() -> None:
    """jsonschema_rs builds every error before the first is read: a model's 200,000 failing items
    were 200,000 error objects (seconds of the event loop, for every session of the process) and a
    multi-megabyte invalid_input message. A long input is reported by its first issue."""
    pipeline = ToolPipeline([ITEMS], journal=InMemoryToolJournal())
    record = await pipeline.execute(ToolCall("c1", "items", {"items": ["x"] * 200_000}))
    assert record.status.value == "failed" and not record.tool_ran
    error = record.result.error
    assert error is not None and error.code == "invalid_input"
    assert error.details == {"errors": ['at items/0: "x" does not match "^y$"', MAYBE_MORE]}
    assert len(error.message) < 250
    # A good one is accepted whatever its length.
    record = await pipeline.execute(ToolCall("c2", "items", {"items": ["y"] * 200_000}))
    assert record.status.value == "completed" and record.result.output == "200000 items"


def test_an_input_failing_many_ways_lists_its_first_20_issues_and_counts_the_rest() -> None:
    errors = ITEMS.input_errors({"items": ["x"] * 50})
    assert errors[:2] == ('at items/0: "x" does not match "^y$"', 'at items/1: "x" does not match "^y$"')
    assert len(errors) == 21 and errors[-1] == "... and 30 more"
    with pytest.raises(ta.ToolInputError) as caught:
        ITEMS.validate_input({"items": ["x"] * 50})
    assert str(caught.value).endswith('at items/19: "x" does not match "^y$"; ... and 30 more')


def test_an_input_issue_is_cut_to_a_bounded_length() -> None:
    """An issue quotes the value: a long string failing the schema was quoted in full."""
    (issue,) = ITEMS.input_errors({"items": ["x" * 3000]})
    assert issue.startswith('at items/0: "xxx') and issue.endswith("... (3035 characters)") and len(issue) < 350


def test_lone_surrogates_in_an_input_are_listed_as_other_issues_are() -> None:
    errors = ITEMS.input_errors({"items": [f"x{chr(0xD800)}{'y' * 400}"] * 30})
    assert len(errors) == 21 and errors[-1] == "... and 10 more"
    assert errors[0].startswith("at items/0: string 'x\\ud800yyy") and len(errors[0]) < 350
