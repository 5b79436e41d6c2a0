"""The agent-turn workload shared by agent_turn.py and scale.py: one tool, ``add(a=1, b=2)``.

The model answers a prompt with a call to it, the tool returns the sum, the model answers "done"
(each script scripts the model its own way). ``add_numbers`` is the tool's work, which the
hand-written floors await directly.
"""

from __future__ import annotations

import attrs
import trio

import trio_agent as ta


@attrs.frozen
class AddInput:
    a: int
    b: int


async def add_numbers(a: int, b: int) -> int:
    """The tool's work, shared by the agent and the floor: one checkpoint, like the fake model."""
    await trio.lowlevel.checkpoint()
    return a + b


@ta.define_tool(side_effect="pure", kind="readonly")
async def add(input: AddInput, ctx: ta.ToolContext) -> ta.ToolResult:
    """Add two integers."""
    return ta.ToolResult.success(await add_numbers(input.a, input.b))
