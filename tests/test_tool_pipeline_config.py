"""`ToolPipeline` and `ToolScheduler` refuse arguments they cannot use at construction, naming them,
instead of raising a raw error out of the first call."""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

import pytest

from trio_agent import ConfigError, define_tool
from trio_agent.testing import call_tool
from trio_agent.tools import FileLockManager, ToolPipeline, ToolScheduler


def _tool() -> Any:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        return "ran"

    return define_tool(
        run, name="t", description="t", side_effect="pure", kind="write", input_schema={"type": "object"},
        affected_paths=lambda inp: ["f.txt"],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("scheduler", "x"),
        ("scheduler", FileLockManager()),
        ("file_locks", "x"),
        ("file_locks", ToolScheduler()),
        ("workspace", 5),
        ("workspace", b"/ws"),
        ("workspace", ["/ws"]),
    ],
)
def test_an_argument_of_the_wrong_kind_is_a_config_error_naming_it(argument: str, value: object) -> None:
    with pytest.raises(ConfigError, match=argument):
        ToolPipeline([_tool()], **{argument: value})


def test_file_locks_set_later_must_be_a_lock_manager() -> None:
    pipeline = ToolPipeline([_tool()])
    with pytest.raises(ConfigError, match="file_locks"):
        pipeline.file_locks = "x"  # type: ignore[assignment]


@pytest.mark.parametrize("limits", ["x", {"execute": 1}, 3])
def test_scheduler_limits_of_the_wrong_kind_are_a_config_error(limits: object) -> None:
    with pytest.raises(ConfigError, match="limits"):
        ToolScheduler(limits)  # type: ignore[arg-type]


def test_a_history_limit_past_what_a_deque_holds_means_no_limit_that_matters() -> None:
    pipeline = ToolPipeline([_tool()], history_limit=10**30)
    assert pipeline.history.maxlen == sys.maxsize


def _resolved(path: pathlib.Path) -> str:
    return os.path.realpath(path / "f.txt")


async def test_a_path_like_workspace_is_used_as_its_path(tmp_path: pathlib.Path) -> None:
    seen: list[dict[str, Any]] = []
    holder: list[ToolPipeline] = []

    async def run(inp: dict[str, Any], ctx: Any) -> str:
        seen.append(holder[0].file_locks.held())
        return "ran"

    tool = define_tool(
        run, name="t", description="t", side_effect="pure", kind="write", input_schema={"type": "object"},
        affected_paths=lambda inp: ["f.txt"],
    )  # fmt: skip
    pipeline = ToolPipeline([tool], workspace=tmp_path)
    holder.append(pipeline)
    assert pipeline.workspace == str(tmp_path)
    record = await call_tool(pipeline, "t", {})
    assert record.result.ok
    assert seen == [{_resolved(tmp_path): (0, True, 0)}]
