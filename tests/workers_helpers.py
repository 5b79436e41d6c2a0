"""What the worker tests share: a worker in this process and waits on the inbox, and the agent of
the takeover tests (in-memory and PostgreSQL): the model asks for a settled
``look``, then a ``pay`` that starts and never ends (the worker dies there), then answers with
how many results it saw."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from trio_agent import define_agent, define_tool
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel
from trio_agent.workers import list_sessions, request_status, serve_sessions

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


# ---------------------------------------------------------------- a worker, and the inbox


@asynccontextmanager
async def worker(spec: Any, dsn: str, schema: str, **options: Any) -> AsyncIterator[Any]:
    """A worker in this process; stopped (gracefully) when the block ends."""
    stop = trio.Event()
    options.setdefault("poll_interval", 0.2)
    async with trio.open_nursery() as nursery:
        report = await nursery.start(functools.partial(serve_sessions, spec, dsn, schema=schema, stop=stop, **options))
        try:
            yield report
        finally:
            stop.set()


async def until_done(dsn: str, schema: str, session_id: str, request_id: str) -> Any:
    """Poll the inbox (another process's table: nothing to wait on) until the row is done."""
    while True:
        status = await trio.to_thread.run_sync(
            functools.partial(request_status, session_id, request_id, dsn=dsn, schema=schema)
        )
        if status is not None and status.state == "done":
            return status
        await trio.sleep(0.05)


async def until_session_state(dsn: str, schema: str, session_id: str, state: str) -> None:
    while True:
        sessions = await trio.to_thread.run_sync(functools.partial(list_sessions, dsn=dsn, schema=schema))
        if any(s.session_id == session_id and s.state == state for s in sessions):
            return
        await trio.sleep(0.05)
