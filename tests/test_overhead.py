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
from session_helpers import all_tasks

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
    """The tool call, then "done" only when add returned 3: a request whose tool failed takes another,
    cheaper path, which must not pass for the one these tests pin."""
    last = request.messages[-1]
    if not isinstance(last, ta.ToolResultMessage):
        return Reply(tool_calls=[("add", {"a": 1, "b": 2})])
    return Reply("done") if last.content == "3" and not last.is_error else Reply(f"the tool failed: {last.content}")


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

        async def again() -> None:
            assert await reused.send("add 1 and 2") == "done"

        requests: dict[str, Callable[[], Awaitable[Any]]] = {
            "chat": lambda: chat_once(model),
            "reused session": again,
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


async def test_an_idle_session_on_the_memory_journal_runs_no_task() -> None:
    """``send()`` runs in its caller's task, and the worker starts only when a request must wait."""
    spec = ta.define_agent(provider=TestModel(respond=respond), tools=[add])
    before = Counter(task.name for task in all_tasks())
    async with ta.open_session(spec) as session:
        assert await session.send("add 1 and 2") == "done"
        await trio.testing.wait_all_tasks_blocked()
        added = Counter(task.name for task in all_tasks()) - before
    assert added == Counter(), added


async def test_the_worker_starts_when_a_request_has_to_wait() -> None:
    spec = ta.define_agent(provider=TestModel(respond=respond), tools=[add])
    before = Counter(task.name for task in all_tasks())
    async with ta.open_session(spec) as session, session.stream("add 1 and 2") as events:
        added = Counter(task.name for task in all_tasks()) - before  # a stream's request: the worker's
        async for _ in events:
            pass
    assert added == Counter({"trio_agent.session.request_worker": 1}), added


async def test_result_without_a_reader_drops_the_events_and_never_blocks_the_run() -> None:
    """``await run.result()`` with nobody iterating: what was queued is dropped and the run queues
    nothing more (no task switch per event), even past the channel's buffer."""
    long_answer = Reply(" ".join(["word"] * 1000))  # far more events than the channel holds
    model = TestModel(respond=lambda request: long_answer)
    reader = trio.lowlevel.current_task()
    steps = _Steps(reader)
    trio.lowlevel.add_instrument(steps)
    try:
        async with ta.chat(model, "talk") as run:
            with trio.fail_after(10):
                steps.count = 0
                result = await run.result()
                woken = steps.count
            assert run._receive.statistics().current_buffer_used == 0
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert result.text == long_answer.text
    assert woken < 10, f"the reader was woken {woken} times for one result()"


class _Steps(trio.abc.Instrument):
    """Counts the steps one task runs (each is a wake-up)."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


async def test_a_layer_is_inspected_once_however_many_runs_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import trio_agent._models._service as service_module
    import trio_agent._tools._chain as chain_module

    inspected: list[object] = []
    model_check, tool_check = service_module.model_middleware_problem, chain_module._check_tool_middleware

    def counting_model_check(layer: object) -> str | None:
        inspected.append(layer)
        return model_check(layer)

    def counting_tool_check(layer: object, index: int) -> None:
        inspected.append(layer)
        tool_check(layer, index)

    import trio_agent._chat._chat as chat_module

    runs_checked: list[object] = []
    runs_check = chat_module.check_model_middleware_runs

    def counting_runs_check(owner: str, layers: Any, **kwargs: Any) -> None:
        runs_checked.append(tuple(layers))
        runs_check(owner, layers, **kwargs)

    monkeypatch.setattr(service_module, "model_middleware_problem", counting_model_check)
    monkeypatch.setattr(chain_module, "_check_tool_middleware", counting_tool_check)
    monkeypatch.setattr(chat_module, "check_model_middleware_runs", counting_runs_check)
    layer, model = PassStream(), TestModel(respond=respond)

    async def tool_layer(request: ta.ToolMiddlewareRequest, call_next: ta.CallNext) -> ta.ToolResult:
        return await call_next()

    for _ in range(3):
        async with ta.chat(model, "add", tools=[add], model_middleware=[layer], tool_middleware=[tool_layer]) as run:
            assert (await run.result()).text == "done"
    assert inspected == [layer, tool_layer]
    assert runs_checked == [(layer,)]  # that chat() can run the layer: also checked once

    class NotMiddleware:
        pass

    bad = NotMiddleware()
    for _ in range(2):  # a layer that failed is checked (and refused) every time
        with pytest.raises(ta.MiddlewareShapeError):
            async with ta.chat(model, "add", model_middleware=[bad]):
                pass  # pragma: no cover
    assert inspected[2:] == [bad, bad]


@pytest.mark.parametrize("calls", [1, 3])
async def test_a_lone_tool_call_runs_in_the_requests_task_and_several_run_side_by_side(calls: int) -> None:
    tasks: list[trio.lowlevel.Task] = []

    @ta.define_tool(side_effect="pure", kind="readonly", input_type=AddInput, name="where")
    async def where(input: AddInput, ctx: ta.ToolContext) -> ta.ToolResult:
        """Add, noting the task it runs in."""
        tasks.append(trio.lowlevel.current_task())
        await trio.lowlevel.checkpoint()
        return ta.ToolResult.success(input.a + input.b)

    def respond_with(request: ta.ModelRequest) -> Reply:
        if isinstance(request.messages[-1], ta.ToolResultMessage):
            return Reply("done")
        return Reply(tool_calls=[("where", {"a": n, "b": 1}) for n in range(calls)])

    async with ta.open_session(provider=TestModel(respond=respond_with), tools=[where]) as session:
        assert await session.send("where do tools run?") == "done"
    here = trio.lowlevel.current_task()
    assert len(tasks) == calls
    if calls == 1:
        assert tasks == [here]  # send() runs the request here, and the lone call with it
    else:
        assert here not in tasks and len(set(tasks)) == calls


async def test_a_turn_checks_neither_the_loops_tools_again_nor_a_chunk_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every model call ran _tool_tuple over the loop's tools (an isinstance per tool), though they
    # are the one tuple of ToolSpecs checked where they were defined; and with no model layer each
    # chunk was type-checked by the retrying stream and again by the block's iterator.
    import trio_agent._models._service as service_module

    tool_checks: list[object] = []
    kind_checks: list[object] = []
    tool_tuple, chunk_problem = service_module._tool_tuple, service_module._chunk_problem

    def counting_tool_tuple(tools: Any) -> Any:
        tool_checks.append(tools)
        return tool_tuple(tools)

    def counting_chunk_problem(item: object) -> str | None:
        kind_checks.append(item)
        return chunk_problem(item)

    monkeypatch.setattr(service_module, "_tool_tuple", counting_tool_tuple)
    monkeypatch.setattr(service_module, "_chunk_problem", counting_chunk_problem)
    service = ta.ModelService(TestModel(respond=respond))
    tools = (ta.ToolSpec("add", "Add two integers", {"type": "object"}),)
    for _ in range(3):
        async with service.stream([ta.UserMessage("add")], tools=tools) as chunks:
            async for _chunk in chunks:
                pass
    assert tool_checks == [tools]  # checked at the first call, remembered after

    class Delta(ta.TextDelta):  # a subclass: the exact-class fast path misses, so the check is seen
        pass

    class Subclassed:
        model = "m"

        async def chat(self, request: ta.ModelRequest) -> ta.ModelResponse:  # a provider has one (never called)
            raise AssertionError("streamed only")

        async def stream(self, request: ta.ModelRequest) -> AsyncIterator[ta.StreamChunk]:
            yield Delta("hi")

    kind_checks.clear()  # the reply above had chunks of other kinds, each checked once too
    async with ta.ModelService(Subclassed()).stream([ta.UserMessage("x")]) as chunks:  # type: ignore[arg-type]
        assert [chunk async for chunk in chunks] == [Delta("hi")]
    assert len(kind_checks) == 1  # the retrying stream's check; the block's iterator trusts it

    class PassOn(ta.ModelMiddleware):
        async def wrap_stream(self, request: ta.ModelRequest, call_next: Any) -> AsyncIterator[ta.StreamChunk]:
            async for chunk in call_next(request):
                yield chunk

    kind_checks.clear()
    layered = ta.ModelService(Subclassed(), middleware=[PassOn(), PassOn()])  # type: ignore[arg-type]
    async with layered.stream([ta.UserMessage("x")]) as chunks:
        assert [chunk async for chunk in chunks] == [Delta("hi")]
    # The provider's chunk, passed on as it came, was checked as it left the provider: not again
    # at the block's iterator (a chunk a layer made itself is, as the layer's).
    assert len(kind_checks) == 1
