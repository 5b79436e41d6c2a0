"""Behaviour that a `chat()` run per request keeps on its cheaper paths (issue 17): the model stream
chain composed once per layers, the last checked model layers given back for the same objects, no
lifecycle or capability work for a run without middleware (an adapter's own requirement still
checked), and client tools still split and checked for clashes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import trio_agent as ta
import trio_agent.tools
from trio_agent._loop._hooks import NO_HOOKS
from trio_agent._models._service import ModelLayers
from trio_agent.lifecycle import (
    CapabilityError,
    create_capability,
    define_client_tool,
    middleware_lifecycle,
    validate_capabilities,
)
from trio_agent.middleware import MiddlewareShapeError
from trio_agent.models import ModelMiddlewareError, ModelRequest, ModelService, StreamChunk, TextDelta, UserMessage
from trio_agent.testing import Reply, TestModel


class Tag(ta.ModelMiddleware):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        self.log.append(f"open {self.name}")
        try:
            async for chunk in call_next(request):
                yield chunk
        finally:
            self.log.append(f"close {self.name}")


def test_the_same_tool_layer_objects_get_the_layers_checked_last_with_their_chain() -> None:
    async def one(request: Any, call_next: Any) -> Any:
        return await call_next()

    async def two(request: Any, call_next: Any) -> Any:
        return await call_next()

    first = ta.tools.ToolPipeline([], middleware=[one, two])
    second = ta.tools.ToolPipeline([], middleware=[one, two])
    assert second.middleware is first.middleware and second._chain is first._chain
    assert ta.tools.ToolPipeline([], middleware=[two, one])._chain is not first._chain


def test_the_same_layer_objects_get_the_layers_checked_last() -> None:
    log: list[str] = []
    first, second = Tag("a", log), Tag("b", log)
    layers = ModelLayers.check([first, second])
    assert ModelLayers.check([first, second]) is layers
    assert ModelLayers.check((first, second)) is layers
    # Other objects, another order or another length: layers of their own.
    other = ModelLayers.check([second, first])
    assert other is not layers and list(other) == [second, first]
    assert ModelLayers.check([first]) is not layers
    third = Tag("a", log)
    assert list(ModelLayers.check([first, third])) == [first, third]


async def test_services_of_one_layers_object_share_one_composed_stream_chain() -> None:
    log: list[str] = []
    layers = ModelLayers.check([Tag("outer", log), Tag("inner", log)])
    model = TestModel(default=[Reply("one"), Reply("two")])
    one, two = ModelService(model, layers), ModelService(model, layers)
    assert one._open_chains is two._open_chains
    for service, expected in ((one, "one"), (two, "two")):
        log.clear()
        async with service.stream([UserMessage("hi")]) as chunks:
            text = "".join([chunk.text async for chunk in chunks if isinstance(chunk, TextDelta)])
        assert text == expected
        # Each call opens its own iterators, entered outermost first and closed by the generators' ends.
        assert log == ["open outer", "open inner", "close inner", "close outer"]


async def test_a_layer_that_returns_no_iterator_is_a_typed_error_on_the_composed_chain() -> None:
    class Bad(ta.ModelMiddleware):
        async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
            async for chunk in call_next(request):
                yield chunk

    service = ModelService(TestModel(default=Reply("x")), [Bad()])

    def not_an_iterator(request: ModelRequest) -> Any:
        return object()

    service._stream_terminal = not_an_iterator  # type: ignore[method-assign]
    with pytest.raises(ModelMiddlewareError, match="must return an async iterator"):
        async with service.stream([UserMessage("hi")]) as chunks:
            async for _ in chunks:
                pass


def test_no_middleware_is_no_lifecycle_but_an_adapters_requirement_is_still_checked() -> None:
    assert middleware_lifecycle([]) is NO_HOOKS
    assert middleware_lifecycle(()) is NO_HOOKS
    validate_capabilities([])  # nothing requires anything

    class Adapter:
        requires: tuple[Any, ...] = (create_capability("needed-by-adapter"),)

    with pytest.raises(CapabilityError, match="needed-by-adapter"):
        validate_capabilities([], Adapter())
    with pytest.raises(MiddlewareShapeError):
        middleware_lifecycle(None)  # type: ignore[arg-type]


async def test_chat_still_refuses_a_tool_and_a_client_tool_of_one_name() -> None:
    @ta.define_tool(side_effect="pure")  # type: ignore[arg-type]  # typed parameters: no ToolContext
    async def lookup(query: str) -> str:
        """Look something up."""
        return query

    client = define_client_tool("lookup", "client side")
    with pytest.raises(ta.ConfigError, match="share the name 'lookup'"):
        await ta.chat(TestModel(default=Reply("x")), "hi", tools=[lookup, client])


def test_values_a_run_builds_through_generated_constructors_are_the_classes_own() -> None:
    from trio_agent._chat._chat import ChatResult, _chat_result
    from trio_agent._loop._hooks import Finished, ModelConfig, ToolOutcome
    from trio_agent._loop._rules import LoopState, StopReason, loop_state
    from trio_agent._loop._run import _finished, _model_config, _tool_outcome, _tool_result_message
    from trio_agent._models._assemble import ModelReply, _assistant_message, _model_reply, _tool_call_part
    from trio_agent._models._messages import (
        AssistantMessage,
        FinishReason,
        TextPart,
        ToolCallPart,
        ToolResultMessage,
        Usage,
    )
    from trio_agent._models._service import Operation, _model_request

    usage = Usage(1, 2, 3, None, 4, None)
    state = LoopState(1, 2, 1, FinishReason.STOP)
    part = ToolCallPart("c1", "add", "{}")
    message = AssistantMessage((TextPart("hi"), part))
    result = ta.ToolResult.success(3)
    pairs = [
        (_model_config("i", (), (), {}, {"m": 1}), ModelConfig("i", (), (), {}, {"m": 1})),
        (loop_state(1, 2, 1, FinishReason.STOP), state),
        (
            _finished(StopReason.END_TURN, "t", 2, state, None, None, usage),
            Finished(StopReason.END_TURN, "t", 2, state, usage=usage),
        ),
        (_tool_outcome(part, result, True), ToolOutcome(part, result, True)),
        (_tool_result_message("c1", "3", False), ToolResultMessage("c1", "3")),
        (_assistant_message((TextPart("hi"), part)), message),
        (_tool_call_part("c1", "add", "{}"), part),
        (
            _model_reply(message, FinishReason.STOP, usage, (), {}),
            ModelReply(message, FinishReason.STOP, usage, (), {}),
        ),
        (usage + Usage(1, 1, 2), Usage(2, 3, 5, None, 4, None)),
        (
            _chat_result("t", (), StopReason.END_TURN, FinishReason.STOP, usage, 1, None, None),
            ChatResult("t", (), StopReason.END_TURN, FinishReason.STOP, usage, 1),
        ),
        (
            _model_request(Operation.STREAM, "m", (UserMessage("hi"),), (), {}, None, {}),
            ModelRequest(Operation.STREAM, "m", [UserMessage("hi")]),
        ),
    ]
    for built, expected in pairs:
        assert type(built) is type(expected)
        if not isinstance(expected, ModelRequest):  # compared by identity (eq=False)
            assert built == expected
        assert repr(built) == repr(expected)
