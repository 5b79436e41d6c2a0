"""The agent ``python -m trio_agent serve`` runs by default: the offline test model and two tools.

It answers without a network or an API key, so the page can be tried at once: a prompt
with two numbers calls ``add`` (which asks for approval first: the page shows the
question), one with "wait" calls ``wait`` for a minute (a run to stop), one with
"where" calls ``where_am_i``, the page's own client tool; anything else is echoed back a
word at a time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import trio

from .._loop._interrupts import ClientTool, define_client_tool
from .._models._messages import Message, ToolResultMessage, UserMessage
from .._models._service import ModelRequest
from .._models._test_model import Reply, TestModel
from .._tools._definition import Tool, define_tool
from .._tools._results import ToolResult

__all__ = ["offline_agent"]

_NUMBERS = re.compile(r"-?\d+")


@define_tool(
    name="add",
    description="Add two integers a and b.",
    input_schema={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    side_effect="pure",
    kind="readonly",
)
async def _add(input: dict[str, Any], ctx: Any) -> ToolResult:
    return ToolResult.success(int(input["a"]) + int(input["b"]))


@define_tool(
    name="wait",
    description="Wait this many seconds (a long task the page can stop).",
    input_schema={"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    side_effect="pure",
    kind="readonly",
    interrupt="cancel",
)
async def _wait(input: dict[str, Any], ctx: Any) -> ToolResult:
    await trio.sleep(float(input["seconds"]))
    return ToolResult.success(f"waited {input['seconds']} s")


def _last_user(messages: Sequence[Message]) -> str:
    for message in reversed(messages):
        if isinstance(message, UserMessage):
            return message.content
    return ""


def _respond(request: ModelRequest) -> Reply:
    last = request.messages[-1] if request.messages else None
    if isinstance(last, ToolResultMessage):
        verb = "failed" if last.is_error else "returned"
        return Reply(text=f"The tool {verb}: {last.content}")
    prompt = _last_user(request.messages)
    numbers = _NUMBERS.findall(prompt)
    tools = {spec.name for spec in request.tools}
    if "wait" in prompt.lower() and "wait" in tools:
        return Reply(tool_calls=[("wait", {"seconds": 60})])
    if len(numbers) >= 2 and "add" in tools:
        return Reply(tool_calls=[("add", {"a": int(numbers[0]), "b": int(numbers[1])})])
    if "where" in prompt.lower() and "where_am_i" in tools:
        return Reply(tool_calls=[("where_am_i", {})])
    return Reply(text=f"You said: {prompt}" if prompt else "Hello.")


_WHERE_AM_I = define_client_tool(
    "where_am_i", "The page's location (its host).", input_schema={"type": "object", "properties": {}}
)


def offline_agent() -> tuple[TestModel, list[Tool[Any] | ClientTool], dict[str, Any]]:
    """The model, the tools (``add`` on the server, ``where_am_i`` the page's) and the options."""
    tools: list[Tool[Any] | ClientTool] = [_add, _wait, _WHERE_AM_I]
    return TestModel(respond=_respond, model="offline"), tools, {"permissions": {"ask": ["add"]}}
