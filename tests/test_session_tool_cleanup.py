"""A session's ``cleanup_grace`` reaches its tools."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import define_tool, open_session
from trio_agent.testing import Reply, TestModel


def _model() -> TestModel:
    return TestModel(default=[Reply(tool_calls=[("stuck", {})]), Reply(text="done")])


@pytest.mark.parametrize("grace", [1.5, 30.0])
async def test_a_session_s_cleanup_grace_bounds_its_tools_cleanup_scope(
    autojump_clock: trio.testing.MockClock, grace: float
) -> None:
    bounds: list[float] = []

    async def stuck(inp: dict[str, Any], ctx: Any) -> str:
        with ctx.cleanup_scope() as scope:
            bounds.append(scope.deadline - trio.current_time())
        return "ok"

    tool = define_tool(stuck, description="x", side_effect="pure", input_schema={"type": "object"})
    async with open_session(
        provider=_model(), model="m", tools=[tool], permissions={"allow": ["stuck"]}, cleanup_grace=grace
    ) as session:
        await session.send("hi")
    assert bounds == [grace]
