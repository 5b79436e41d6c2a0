"""File locks: one lock per file whatever its name, path items that are not paths, and waits that
never sit on part of a call's paths (so a call tree and an unrelated call cannot deadlock)."""

from __future__ import annotations

import os
import pathlib
from collections import defaultdict
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from trio_agent import define_tool
from trio_agent._util import safe_repr
from trio_agent.testing import call_tool
from trio_agent.tools import FileLockManager, SettlementStatus, ToolPipeline

# -- one file, one lock ---------------------------------------------------------------


class Inside:
    """A write tool that blocks until its call's event is set, recording who is inside."""

    def __init__(self) -> None:
        self.events: defaultdict[str, trio.Event] = defaultdict(trio.Event)
        self.inside: set[str] = set()
        self.started: list[str] = []
        self.overlaps: list[set[str]] = []

    def tool(self, paths: Any = None) -> Any:
        async def write(inp: dict[str, Any], ctx: Any) -> str:
            key = inp["id"]
            self.started.append(key)
            self.inside.add(key)
            if len(self.inside) > 1:
                self.overlaps.append(set(self.inside))
            try:
                await self.events[key].wait()
            finally:
                self.inside.discard(key)
            return key

        return define_tool(
            write,
            name="write",
            description="writes",
            side_effect="non_idempotent",
            kind="write",
            input_schema={"type": "object"},
            affected_paths=paths or (lambda inp: inp["paths"]),
        )


_OBJECT = object()


def workspace_with_link(tmp_path: pathlib.Path) -> str:
    """``<ws>/real/f.txt`` and ``<ws>/link`` -> ``<ws>/real``."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f.txt").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    return str(tmp_path)


def real_name(ws: str) -> str:
    """What ``<ws>/link/f.txt`` resolves to."""
    return os.path.join(os.path.realpath(ws), "real", "f.txt")


@pytest.mark.parametrize("alias", ["link/f.txt", "real/../link/f.txt", "LINK_ABS"])
async def test_a_file_named_through_a_symlink_shares_the_lock_of_its_real_name(
    tmp_path: pathlib.Path, alias: str
) -> None:
    ws = workspace_with_link(tmp_path)
    if alias == "LINK_ABS":
        alias = os.path.join(ws, "link", "f.txt")
    gate = Inside()
    pipeline = ToolPipeline([gate.tool()], workspace=ws)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call_tool, pipeline, "write", {"id": "real", "paths": ["real/f.txt"]})
        await wait_all_tasks_blocked()
        nursery.start_soon(call_tool, pipeline, "write", {"id": "alias", "paths": [alias]})
        await wait_all_tasks_blocked()
        assert gate.started == ["real"]  # the alias waits for the lock of the file it names
        assert pipeline.file_locks.held() == {real_name(ws): (0, True, 1)}
        gate.events["real"].set()
        await wait_all_tasks_blocked()
        assert gate.started == ["real", "alias"]
        gate.events["alias"].set()
    assert gate.overlaps == []
    assert pipeline.file_locks.held() == {}


def test_normalise_resolves_symlinks_like_the_path_policy(tmp_path: pathlib.Path) -> None:
    ws = workspace_with_link(tmp_path)
    assert FileLockManager.normalise(["link/f.txt", "real/f.txt", "./link/../real/f.txt"], ws) == (real_name(ws),)


@pytest.mark.parametrize(
    ("given", "item"),
    [
        (["real/f.txt", ["real/f.txt"]], ["real/f.txt"]),  # str() of it would lock "<ws>/['real/f.txt']"
        ([b"real/f.txt"], b"real/f.txt"),
        ([1, 2], 1),
        ([None], None),
        ([_OBJECT], _OBJECT),
    ],
)
async def test_an_affected_path_that_is_not_a_str_fails_the_call_naming_it(
    tmp_path: pathlib.Path, given: list[Any], item: object
) -> None:
    ws = workspace_with_link(tmp_path)
    gate = Inside()
    gate.events["w"].set()  # should it run, it returns at once
    pipeline = ToolPipeline([gate.tool(lambda inp: given)], workspace=ws)
    record = await call_tool(pipeline, "write", {"id": "w"})
    assert record.status is SettlementStatus.FAILED
    assert record.result.error is not None
    assert record.result.error.code == "tool_error"
    assert safe_repr(item) in record.result.error.message
    assert not record.tool_ran
    assert gate.started == []
    assert pipeline.file_locks.held() == {}


async def test_a_path_with_a_nul_byte_fails_the_call(tmp_path: pathlib.Path) -> None:
    gate = Inside()
    gate.events["w"].set()
    pipeline = ToolPipeline([gate.tool()], workspace=str(tmp_path))
    record = await call_tool(pipeline, "write", {"id": "w", "paths": ["a\x00b"]})
    assert record.result.error is not None and record.result.error.code == "tool_error"
    assert "NUL" in record.result.error.message
    assert not record.tool_ran


async def test_path_like_items_are_locked_as_the_paths_they_name(tmp_path: pathlib.Path) -> None:
    ws = workspace_with_link(tmp_path)
    seen: list[dict[str, tuple[int, bool, int]]] = []
    holder: list[ToolPipeline] = []

    async def write(inp: dict[str, Any], ctx: Any) -> str:
        seen.append(holder[0].file_locks.held())
        return "ok"

    tool = define_tool(
        write, name="write", description="w", side_effect="pure", kind="write", input_schema={"type": "object"},
        affected_paths=lambda inp: [pathlib.PurePosixPath("link/f.txt")],
    )  # fmt: skip
    assert tool.paths_for({}) == ("link/f.txt",)
    pipeline = ToolPipeline([tool], workspace=ws)
    holder.append(pipeline)
    record = await call_tool(pipeline, "write", {})
    assert record.result.ok
    assert seen == [{real_name(ws): (0, True, 0)}]


def test_paths_for_refuses_an_item_that_is_not_a_path() -> None:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        return "ok"

    tool = define_tool(
        run, name="t", description="t", side_effect="pure", input_schema={"type": "object"},
        affected_paths=lambda inp: ["a", ["b"]],
    )  # fmt: skip
    with pytest.raises(TypeError, match=r"\['b'\]"):
        tool.paths_for({})
