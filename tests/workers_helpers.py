"""The agent of the takeover tests (in-memory and PostgreSQL): the model asks for a settled
``look``, then a ``pay`` that starts and never ends (the worker dies there), then answers with
how many results it saw."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from trio_agent import define_agent, define_tool
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel

OBJECT = {"type": "object"}


@attrs.define
class Takeover:
    spec: Any
    model: TestModel
    paid: list[str] = attrs.Factory(list)  # the payments' idempotency keys, one per run of pay
    started: trio.Event = attrs.Factory(trio.Event)


def takeover_agent() -> Takeover:
    def respond(request: Any) -> Reply:
        results = [m for m in request.messages if isinstance(m, ToolResultMessage)]
        if not results:
            return Reply(tool_calls=[("look", {})])
        if len(results) == 1:
            return Reply(tool_calls=[("pay", {})])
        return Reply(f"finished with {len(results)} results")

    model = TestModel(respond=respond)
    scenario = Takeover(spec=None, model=model)

    @define_tool(name="pay", description="p", input_schema=OBJECT, side_effect="non_idempotent", kind="readonly")
    async def pay(input: dict[str, Any], ctx: Any) -> str:
        scenario.paid.append(ctx.idempotency_key)
        scenario.started.set()
        await trio.sleep_forever()
        return "paid"  # pragma: no cover

    @define_tool(name="look", description="l", input_schema=OBJECT, side_effect="pure", kind="readonly")
    async def look(input: dict[str, Any], ctx: Any) -> str:
        return "looked"

    scenario.spec = define_agent(provider=model, tools=[look, pay])
    return scenario


@attrs.define
class Gated:
    """An agent whose request holds in a ``wait`` call until ``gate`` is set (``entered`` says it
    is there), then answers ``answer``."""

    spec: Any
    gate: trio.Event = attrs.Factory(trio.Event)
    entered: trio.Event = attrs.Factory(trio.Event)


def gated_agent(answer: str = "fine") -> Gated:
    gated = Gated(spec=None)

    @define_tool(name="wait", description="w", input_schema=OBJECT, side_effect="pure", kind="readonly")
    async def wait(input: dict[str, Any], ctx: Any) -> str:
        gated.entered.set()
        await gated.gate.wait()
        return "waited"

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        return Reply(answer) if isinstance(last, ToolResultMessage) else Reply(tool_calls=[("wait", {})])

    gated.spec = define_agent(provider=TestModel(respond=respond), tools=[wait])
    return gated
