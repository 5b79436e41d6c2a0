"""The worker's built-in offline agent (no API key): it adds the numbers a prompt holds with a tool."""

from __future__ import annotations

import re
from typing import Any

import trio

from .._models._messages import ToolResultMessage, UserMessage
from .._session._spec import AgentSpec, define_agent
from .._tools._definition import define_tool
from .._tools._results import ToolResult
from ..testing import Reply, TestModel

__all__ = ["offline_spec"]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@define_tool(
    name="add",
    description="Add numbers.",
    input_schema={
        "type": "object",
        "properties": {"numbers": {"type": "array", "items": {"type": "number"}}},
        "required": ["numbers"],
    },
    side_effect="pure",
    kind="readonly",
)
async def _add(input: dict[str, Any], ctx: Any) -> ToolResult:
    await trio.lowlevel.checkpoint()
    return ToolResult.success(sum(float(n) for n in input["numbers"]))


def _respond(request: Any) -> Reply:
    last = request.messages[-1]
    if isinstance(last, UserMessage):
        numbers = [float(n) for n in _NUMBER.findall(str(last.content))]
        if numbers:
            return Reply(tool_calls=[("add", {"numbers": numbers})])
        return Reply(f"you said: {last.content}")
    if isinstance(last, ToolResultMessage):
        return Reply(f"the sum is {last.content}")
    return Reply("done")


def offline_spec() -> AgentSpec:
    return define_agent(provider=TestModel(respond=_respond, model="offline"), tools=[_add])
