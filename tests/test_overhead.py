"""The hot path's shape (issue 17): what a request leaves behind, and what an idle session holds.

Speed itself is measured in benchmarks/ (agent_turn.py, scale.py), never asserted here. These
tests pin the properties the speed rests on: a request's objects die by reference counting (no
reference cycles for the cyclic GC), and an idle session runs one task.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import trio_agent as ta
from trio_agent.journal import open_sqlite_store
from trio_agent.testing import Reply, TestModel


@attrs.frozen
class AddInput:
    a: int
    b: int


@ta.define_tool(side_effect="pure", kind="readonly", input_type=AddInput)
async def add(input: AddInput, ctx: ta.ToolContext) -> ta.ToolResult:
    """Add two integers."""
    await trio.lowlevel.checkpoint()
    return ta.ToolResult.success(input.a + input.b)


def respond(request: ta.ModelRequest) -> Reply:
    if isinstance(request.messages[-1], ta.ToolResultMessage):
        return Reply("done")
    return Reply(tool_calls=[("add", {"a": 1, "b": 2})])


class PassStream(ta.ModelMiddleware):
    async def wrap_stream(self, request: ta.ModelRequest, call_next: Any) -> AsyncIterator[ta.StreamChunk]:
        async for chunk in call_next(request):
            yield chunk


async def passthrough(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
    return await call_next()


MIDDLEWARE = ta.MiddlewareConfig(model=[PassStream(), PassStream()], tool=[passthrough, passthrough])


@contextmanager
def cyclic_garbage() -> Iterator[list[int]]:
    """Count what only the cyclic GC could free of what the block allocated."""
    found: list[int] = []
    gc.collect()
    gc.disable()
    try:
        yield found
        found.append(gc.collect())
    finally:
        gc.enable()


async def chat_once(model: TestModel) -> None:
    async with ta.chat(
        model, "add 1 and 2", tools=[add], model_middleware=[PassStream()], tool_middleware=[passthrough]
    ) as run:
        assert (await run.result()).text == "done"


@pytest.mark.parametrize("shape", ["chat", "reused session", "fresh session", "fresh session, SQLite"])
async def test_a_request_leaves_no_reference_cycles(shape: str, tmp_path: Any) -> None:
    model = TestModel(respond=respond)
    spec = ta.define_agent(provider=model, tools=[add], middleware=MIDDLEWARE)
    async with AsyncExitStack() as stack:
        # A server holds its SQLite store open for every session (a store's own thread and lane
        # are its lifetime's, not a request's).
        journal = await stack.enter_async_context(open_sqlite_store(tmp_path / "j.db")) if "SQLite" in shape else None
        found = await _count_cycles(shape, model, spec, journal)
    assert found == [0], f"{found[0]} objects in reference cycles after 5 requests ({shape})"


async def _count_cycles(shape: str, model: TestModel, spec: ta.AgentSpec, journal: Any) -> list[int]:
    async def fresh() -> None:
        async with ta.open_session(spec, journal=journal) as session:
            assert await session.send("add 1 and 2") == "done"

    async with ta.open_session(spec) as reused:
        requests: dict[str, Callable[[], Awaitable[Any]]] = {
            "chat": lambda: chat_once(model),
            "reused session": lambda: reused.send("add 1 and 2"),
            "fresh session": fresh,
            "fresh session, SQLite": fresh,
        }
        request = requests[shape]
        for _ in range(2):  # first-call caches
            await request()
        with cyclic_garbage() as found:
            for _ in range(5):
                await request()
    return found


def _tasks() -> list[trio.lowlevel.Task]:
    tasks, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        tasks.append(task)
        todo.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return tasks


async def test_an_idle_session_on_the_memory_journal_runs_one_task() -> None:
    spec = ta.define_agent(provider=TestModel(respond=respond), tools=[add])
    before = Counter(task.name for task in _tasks())
    async with ta.open_session(spec) as session:
        assert await session.send("add 1 and 2") == "done"
        await trio.testing.wait_all_tasks_blocked()
        added = Counter(task.name for task in _tasks()) - before
    assert added == Counter({"trio_agent.session.request_worker": 1}), added
