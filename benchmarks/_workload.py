"""The agent-turn workload shared by the benchmarks: one tool, ``add(a=1, b=2)``, and the model that checks it.

The model answers a prompt with a call to it, the tool returns the sum, the model answers "done" only
when the tool's result is what the tool returns when it works ("3", and not an error); otherwise it
answers "the tool failed: ...", which every script's timed requests refuse. A run whose tool failed
costs less than one that worked: a model answering "done" to any tool result would let a broken tool
path pass, faster. ``add_numbers`` is the tool's work, which the hand-written floors await directly.

`make_respond` is the model of the single-call workloads (agent_turn.py, conversation.py,
interrupts.py): the same function object for the floor and for trio_agent, so they run the same check.
`turn_failure` is the same check for the scripts whose model walks back through the conversation
(scale.py, _workers_agent.py: latencies, several prompts, several calls in a turn).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

import trio_agent as ta
from trio_agent.testing import Reply

PROMPT = "add 1 and 2"
ADD_CALL: tuple[str, dict[str, Any]] = ("add", {"a": 1, "b": 2})
ADD_RESULT = "3"  # add's result as the model reads it: the tool result's JSON text
ANSWER = "done"


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


def failure_text(result: ta.ToolResultMessage) -> str:
    """The model's answer to a tool result that is not the working tool's: never "done"."""
    return f"the tool failed: {result.content}"


def make_respond(
    call: tuple[str, dict[str, Any]] = ADD_CALL, expected: str = ADD_RESULT
) -> Callable[[ta.ModelRequest], Reply]:
    """A zero-latency model: *call* for a new prompt; once the tool result is the last message, "done"
    when it reads *expected* and is not an error, "the tool failed: ..." otherwise.

    The replies are made once (a reply is immutable), so the model's own cost per call is the check.
    """
    call_reply = Reply(tool_calls=[call])
    answer_reply = Reply(ANSWER)

    def respond(request: ta.ModelRequest) -> Reply:
        last = request.messages[-1]
        if not isinstance(last, ta.ToolResultMessage):
            return call_reply
        return answer_reply if last.content == expected and not last.is_error else Reply(failure_text(last))

    return respond


respond = make_respond()
"""The model of agent_turn.py and conversation.py: ``add(a=1, b=2)``, then "done" only if it returned 3."""


def turn_failure(messages: Sequence[ta.Message], end: int, expected: Mapping[str, str]) -> str | None:
    """Why the tool results of one turn, the run of them ending at ``messages[end]``, did not work; None if they did.

    A result is failed when it is an error, or when its tool is in *expected* (tool name -> the result's
    text) and it reads anything else. The turn's calls are in the assistant message just before its results.
    """
    start = end
    while start > 0 and isinstance(messages[start - 1], ta.ToolResultMessage):
        start -= 1
    asked = messages[start - 1] if start > 0 else None
    names = (
        {part.id: part.name for part in asked.parts if isinstance(part, ta.ToolCallPart)}
        if isinstance(asked, ta.AssistantMessage)
        else {}
    )
    for result in messages[start : end + 1]:
        assert isinstance(result, ta.ToolResultMessage)
        name = names.get(result.tool_call_id)
        if name is None:
            return f"a result for no call of the turn ({result.tool_call_id})"
        want = expected.get(name)
        if result.is_error or (want is not None and result.content != want):
            return f"{name}: {result.content}"
    return None
