"""The agent ``benchmarks/workers.py`` serves, in its worker processes and in-process alike.

``trio-agent worker --agent _workers_agent:spec`` (with this directory on ``PYTHONPATH``) loads it.
One request: the model (a `TestModel`, every reply delayed by ``MODEL_LATENCY`` = 20 ms) answers the
prompt with one call of the ``pure`` tool ``add(a=1, b=2)`` (``_workload.py``, the workload of
agent_turn.py and scale.py), the tool returns 3, the model answers ``"done"``: two model calls. The
model answers ``"done"`` only when the tool's result is what it returns when it works (add "3", nap
"rested", not an error: ``_workload.turn_failure``), "the tool failed: ..." otherwise, which
workers.py refuses.

The prompt ``NAP_PROMPT`` asks instead for one call of ``nap``, a ``pure`` tool that sleeps
``NAP_SECONDS``: the slow request the takeover measurement kills its worker in the middle of.
Not a benchmark itself (the leading underscore keeps it out of the smoke test).
"""

from __future__ import annotations

import attrs
import trio
from _workload import ADD_CALL, ADD_RESULT, add, turn_failure

import trio_agent as ta
from trio_agent.testing import Reply, TestModel

__all__ = ["MODEL_LATENCY", "NAP_PROMPT", "NAP_SECONDS", "PROMPT", "nap", "spec"]

MODEL_LATENCY = 0.020  # seconds, every model reply
PROMPT = "add 1 and 2"
NAP_PROMPT = "take a nap"
NAP_SECONDS = 2.0
EXPECTED = {"add": ADD_RESULT, "nap": "rested"}  # what each tool returns when it works


@attrs.frozen
class NapInput:
    seconds: float


@ta.define_tool(side_effect="pure", kind="readonly")
async def nap(input: NapInput, ctx: ta.ToolContext) -> ta.ToolResult:
    """Sleep for a while, then say so."""
    await trio.sleep(input.seconds)
    return ta.ToolResult.success("rested")


def respond(request: ta.ModelRequest) -> Reply:
    """The tool call for the request's prompt; once its result is in, ``"done"`` if the tool worked."""
    messages = request.messages
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, ta.ToolResultMessage):
            failure = turn_failure(messages, index, EXPECTED)
            return Reply("done" if failure is None else f"the tool failed: {failure}", latency=MODEL_LATENCY)
        if isinstance(message, ta.UserMessage):
            if message.content == NAP_PROMPT:
                return Reply(tool_calls=[("nap", {"seconds": NAP_SECONDS})], latency=MODEL_LATENCY)
            return Reply(tool_calls=[ADD_CALL], latency=MODEL_LATENCY)
    raise AssertionError(f"unexpected conversation: {request.messages!r}")


class _Unrecorded(list[ta.ModelRequest]):
    """``TestModel.requests`` that keeps nothing: a long-lived worker would keep every request alive."""

    def append(self, request: ta.ModelRequest) -> None:
        pass


def spec() -> ta.AgentSpec:
    """The agent (a fresh `TestModel` each call; one per worker process)."""
    model = TestModel(respond=respond)
    model.requests = _Unrecorded()
    return ta.define_agent(provider=model, tools=[add, nap])
