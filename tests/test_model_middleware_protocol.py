"""Model middleware is a Protocol: any object with the wrappers it needs, no base class required.

`ModelMiddleware` requires no member (typing has no optional protocol members); each wrapper has
its own protocol (`WrapsChat`, `WrapsSideQuery`, `WrapsStream`, `WrapsChatWithRetryEvents`)
for a type checker to check it. The service composes only the wrappers an object defines and
rejects a shape it cannot run when it is built, naming the object and the wrapper names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from typecheck import mypy_strict

from trio_agent import ModelMiddleware
from trio_agent.middleware import MiddlewareShapeError
from trio_agent.models import (
    ChatNext,
    ModelRequest,
    ModelResponse,
    ModelService,
    StreamChunk,
    StreamNext,
    TextDelta,
    UserMessage,
    WrapsChat,
    WrapsChatWithRetryEvents,
    WrapsSideQuery,
    WrapsStream,
)
from trio_agent.testing import Reply, TestModel

WRAPPERS = "wrap_chat, wrap_side_query, wrap_stream, wrap_chat_with_retry_events"


class Shout:
    """A plain class, no base class, with only ``wrap_stream``."""

    def __init__(self) -> None:
        self.calls = 0

    async def wrap_stream(self, request: ModelRequest, call_next: StreamNext) -> AsyncIterator[StreamChunk]:
        self.calls += 1
        async for chunk in call_next(request):
            yield TextDelta(chunk.text.upper()) if isinstance(chunk, TextDelta) else chunk


async def test_a_plain_class_with_only_wrap_stream_is_model_middleware() -> None:
    shout = Shout()
    model = TestModel(default=Reply("hello there"))
    service = ModelService(model, [shout])
    async with service.stream([UserMessage("hi")]) as chunks:
        text = "".join([chunk.text async for chunk in chunks if isinstance(chunk, TextDelta)])
    assert text == "HELLO THERE"
    assert shout.calls == 1
    # Only the stream composes it: a chat goes straight to the model.
    assert (await service.chat([UserMessage("hi")])).message.text == "hello there"
    assert shout.calls == 1


class Checked(WrapsChat, WrapsStream):
    """Lists the wrapper protocols as bases: a type checker checks both wrappers."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def wrap_chat(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        self.log.append("chat")
        return await call_next()

    async def wrap_stream(self, request: ModelRequest, call_next: StreamNext) -> AsyncIterator[StreamChunk]:
        self.log.append("stream")
        async for chunk in call_next():
            yield chunk


class OldStyle(ModelMiddleware):
    """Subclassing the protocol explicitly, as before it was one, keeps working."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def wrap_side_query(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        self.log.append("side")
        return await call_next(request)


async def test_wrapper_protocol_bases_and_explicit_subclasses_compose_only_their_wrappers() -> None:
    log: list[str] = []
    service = ModelService(TestModel(default=Reply("ok")), [Checked(log), OldStyle(log)])
    assert (await service.chat([UserMessage("a")])).message.text == "ok"
    assert (await service.side_query([UserMessage("b")])).message.text == "ok"
    async with service.stream([UserMessage("c")]) as chunks:
        assert [chunk async for chunk in chunks]
    async with service.chat_with_retry_events([UserMessage("d")]) as events:
        assert [event async for event in events]
    assert log == ["chat", "side", "stream"]


class ListsAProtocolOnly(WrapsStream, WrapsSideQuery):
    """Lists wrapper protocols but defines neither wrapper: the inherited stubs do not count."""


class HalfStub(WrapsChat, WrapsChatWithRetryEvents):
    async def wrap_chat(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        return await call_next(request)


async def test_an_inherited_protocol_stub_is_not_a_wrapper() -> None:
    with pytest.raises(MiddlewareShapeError, match=f"#0 \\(ListsAProtocolOnly\\) defines none of the .*{WRAPPERS}"):
        ModelService(TestModel(), [ListsAProtocolOnly()])  # type: ignore[abstract]
    service = ModelService(TestModel(default=Reply("ok")), [HalfStub()])  # type: ignore[abstract]
    async with service.chat_with_retry_events([UserMessage("d")]) as events:
        assert [type(event).__name__ async for event in events] == ["ModelResponse"]


class NotCallable:
    wrap_stream = "upper"


class NoneIsNotDefined:
    wrap_chat = None

    async def wrap_side_query(self, request: ModelRequest, call_next: ChatNext) -> ModelResponse:
        return await call_next(request)


@pytest.mark.parametrize(
    ("layer", "pattern"),
    [
        (object(), rf"^model middleware #0 \(object\) defines none of the model middleware wrappers {WRAPPERS}$"),
        (42, rf"^model middleware #0 \(int\) defines none of the model middleware wrappers {WRAPPERS}$"),
        (
            NotCallable(),
            rf"^model middleware #0 \(NotCallable\): wrap_stream is not callable \(got str 'upper'\); "
            rf"the wrappers are {WRAPPERS}$",
        ),
        (Shout, r"^model middleware #0 \(class Shout\) is a class, not an instance: pass Shout\(\.\.\.\)$"),
        (type("Empty", (), {}), rf"^model middleware #0 \(class Empty\) defines none of .* wrappers {WRAPPERS}$"),
        (len, rf"^model middleware #0 \(builtin_function_or_method len\) defines none of .* {WRAPPERS}$"),
    ],
    ids=["object", "int", "not-callable-wrapper", "class-not-instance", "empty-class", "function"],
)
def test_a_wrong_shape_names_the_object_and_the_wrappers(layer: Any, pattern: str) -> None:
    with pytest.raises(MiddlewareShapeError, match=pattern):
        ModelService(TestModel(), [layer])


async def test_a_wrapper_set_to_none_is_not_defined() -> None:
    service = ModelService(TestModel(default=Reply("ok")), [NoneIsNotDefined()])
    assert (await service.chat([UserMessage("a")])).message.text == "ok"
    assert (await service.side_query([UserMessage("a")])).message.text == "ok"


def test_a_plain_class_type_checks_under_mypy_strict(tmp_path: Path) -> None:
    """A plain class with one wrapper is a `ModelMiddleware` for mypy --strict: in a list annotated
    with it, for `ModelService` and for `chat()`. A wrapper protocol as a base checks the signature."""
    status, report = mypy_strict(
        tmp_path,
        "good.py",
        "from collections.abc import AsyncIterator\n"
        "from trio_agent import ModelMiddleware, Provider, chat\n"
        "from trio_agent.models import ModelRequest, ModelService, StreamChunk, StreamNext\n"
        "class Shout:\n"
        "    async def wrap_stream(\n"
        "        self, request: ModelRequest, call_next: StreamNext\n"
        "    ) -> AsyncIterator[StreamChunk]:\n"
        "        async for chunk in call_next():\n"
        "            yield chunk\n"
        "def build(provider: Provider) -> ModelService:\n"
        "    layers: list[ModelMiddleware] = [Shout()]\n"
        "    chat(provider, 'hi', model_middleware=[Shout()])\n"
        "    return ModelService(provider, [*layers, Shout()])\n",
    )
    assert status == 0, report
    status, report = mypy_strict(
        tmp_path,
        "bad.py",
        "from trio_agent.models import ModelRequest, StreamChunk, StreamNext, WrapsStream\n"
        "class Wrong(WrapsStream):\n"
        "    async def wrap_stream(self, request: ModelRequest, call_next: StreamNext) -> StreamChunk:\n"
        "        return await call_next().__anext__()\n",
    )
    assert status == 1 and "bad.py:3" in report and "wrap_stream" in report, report
