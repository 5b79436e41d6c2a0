"""trio_agent.testing's helpers on misuse: a typed error naming the mistake, never a silent no-op.

A review found `FailingJournal("setled")` (a typo) accepted and never failing, `FaultyStore.fail_next`
with a count of -3 arming nothing and one of "2" raising a raw TypeError, and `call_tool` with input
that is not an object raising a raw ValueError / TypeError from ``dict()``.
"""

from __future__ import annotations

from typing import Any

import pytest

from trio_agent import ConfigError, SideEffect, ToolInputError, define_tool
from trio_agent.journal import MemoryStore
from trio_agent.testing import FailingJournal, FaultyStore, call_tool
from trio_agent.tools import SettlementError, ToolPipeline


@define_tool(name="echo", description="Echo.", input_schema={"type": "object"}, side_effect=SideEffect.PURE)
async def echo(input: dict[str, Any], ctx: Any) -> Any:
    return input


@pytest.mark.parametrize("names", [("setled",), ("settled", "Started"), ("",), (["settled"],)])
def test_failing_journal_refuses_a_name_it_never_fails_on(names: tuple[Any, ...]) -> None:
    with pytest.raises(ConfigError, match="FailingJournal fails on 'scheduled', 'started', 'settled', not "):
        FailingJournal(*names)


async def test_failing_journal_checks_names_assigned_later_and_fails_on_the_ones_it_was_given() -> None:
    journal = FailingJournal()
    with pytest.raises(ConfigError, match="not 'setled'"):
        journal.fail_on = {"setled"}
    with pytest.raises(ConfigError, match="must be a set of names"):
        journal.fail_on = 5  # type: ignore[assignment]
    assert journal.fail_on == set()  # a refused assignment changes nothing
    journal.fail_on = "settled"  # one name, not its letters
    assert journal.fail_on == {"settled"}
    with pytest.raises(SettlementError, match="injected failure writing the settlement"):
        await call_tool(ToolPipeline([echo], journal=journal), "echo", {"a": 1})


@pytest.mark.parametrize(
    "change",
    [
        lambda points: points.add("setled"),
        lambda points: points.update({"started"}, ["Settled"]),
        lambda points: points.__ior__({"setled"}),
        lambda points: points.symmetric_difference_update(["setled"]),
        lambda points: points.__ixor__({"setled"}),
    ],
)
async def test_failing_journal_checks_names_added_in_place(change: Any) -> None:
    # `fail_on.add("setled")` made a journal that silently never failed.
    journal = FailingJournal("scheduled")
    with pytest.raises(ConfigError, match=r"not '(Settled|setled)'"):
        change(journal.fail_on)
    assert journal.fail_on == {"scheduled"}  # a refused name changes nothing
    journal.fail_on.add("settled")
    journal.fail_on |= {"started"}
    assert journal.fail_on == {"scheduled", "started", "settled"}
    journal.fail_on.discard("scheduled")
    journal.fail_on ^= {"started"}
    assert journal.fail_on == {"settled"}
    with pytest.raises(SettlementError, match="injected failure writing the settlement"):
        await call_tool(ToolPipeline([echo], journal=journal), "echo", {"a": 1})


@pytest.mark.parametrize(
    ("mode", "count", "named"),
    [
        ("boom", 1, r"unknown fault mode 'boom'"),
        (None, 1, r"unknown fault mode None"),
        ("before", -3, r"count must be a whole number >= 1, got -3"),
        ("before", 0, r"count must be a whole number >= 1, got 0"),
        ("before", "2", r"count must be a whole number >= 1, got '2'"),
        ("before", True, r"count must be a whole number >= 1, got True"),
    ],
)
async def test_faulty_store_fail_next_refuses_what_would_arm_nothing_or_fail_raw(
    mode: Any, count: Any, named: str
) -> None:
    store = FaultyStore(MemoryStore())
    with pytest.raises(ConfigError, match=named):
        store.fail_next(mode, count)
    assert store._armed == []
    store.fail_next("before", 2)
    assert store._armed == ["before", "before"]


@pytest.mark.parametrize("bad", ["abc", [1, 2], 5, [("a", 1)]], ids=repr)
async def test_call_tool_lets_the_call_refuse_input_that_is_not_an_object(bad: Any) -> None:
    # dict("abc") raised a raw ValueError, dict(5) a raw TypeError, and dict([("a", 1)]) ran the
    # tool with {"a": 1}: the input now goes as it is, and a tool call refuses it typed.
    pipeline = ToolPipeline([echo])
    with pytest.raises(ToolInputError, match=r"tool call input must be a JSON object \(dict\), got "):
        await call_tool(pipeline, "echo", bad)


async def test_call_tool_copies_a_mapping_and_defaults_to_an_empty_object() -> None:
    pipeline = ToolPipeline([echo])
    given = {"a": 1}
    assert (await call_tool(pipeline, "echo", given)).result.output == {"a": 1}
    assert (await call_tool(pipeline, "echo")).result.output == {}
