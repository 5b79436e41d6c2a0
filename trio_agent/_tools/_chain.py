"""The tool middleware chain: ``async def mw(request, call_next)`` layers, an onion around the core.

`ToolLayers` checks the layers once (an `AgentSpec` keeps them checked); `_compose` builds the
chain with the generic composer (`trio_agent._middleware`) once per layers object, and every
pipeline of those layers shares it. A run of the chain carries its `_Call`: the chain holds no
pipeline and no per-call state.

Rules
=====

* The outermost layer gets the pipeline's own request; `_guard` checks every request passed
  inward, at each layer boundary and before the core: same type, context and tool name, and an
  input whose interrupt behaviour is the scheduled one. A break ends the call with an error
  result (`_GuardViolation`) and the tool does not run.
* ``call_next`` is called at most once per layer (`NextCalledTwiceError`). What it returns runs
  the inner layers only when awaited (`_CallNext`): a ``call_next()`` never awaited leaves
  nothing behind, and one awaited after the chain returned runs nothing and gets a fault result.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import CoroutineType, TracebackType
from typing import Any, Protocol

from .._errors import MiddlewareShapeError, NextCalledTwiceError, ToolBehaviorError
from .._middleware import (
    CheckedLayers,
    Composed,
    ComposedNext,
    PassedChecks,
    check_middleware_shape,
    compose_middleware,
)
from .._util import callable_name
from ._call import _Call
from ._context import Emit, ToolMiddlewareRequest, _inherit_emit
from ._results import ToolErrorType, ToolResult

__all__ = ["CallNext", "ToolLayers", "ToolMiddleware"]


class CallNext(Protocol):
    """``await call_next(request=None, *, emit=None)`` runs the inner layers and the core."""

    def __call__(
        self, request: ToolMiddlewareRequest | None = None, *, emit: Emit | None = None
    ) -> Awaitable[ToolResult]: ...


ToolMiddleware = Callable[[ToolMiddlewareRequest, CallNext], Awaitable[ToolResult]]
"""``async def mw(request, call_next) -> ToolResult``."""


def _check_tool_middleware(layer: object, index: int) -> None:
    # Callable with (request, call_next): the generic check; then what a tool layer adds: async def.
    check_middleware_shape(layer, what="tool middleware", index=index)
    what = f"tool middleware #{index}"
    target = layer if inspect.isroutine(layer) or isinstance(layer, functools.partial) else type(layer).__call__
    if inspect.isasyncgenfunction(target):
        raise MiddlewareShapeError(
            f"{what} ({callable_name(layer)}) is an async generator; tool middleware is "
            "`async def mw(request, call_next) -> ToolResult` and transforms items by passing emit= to call_next"
        )
    if not inspect.iscoroutinefunction(target):
        raise MiddlewareShapeError(f"{what} ({callable_name(layer)}) must be an `async def mw(request, call_next)`")


class ToolLayers(CheckedLayers):
    """Tool middleware checked once (`check`): a `ToolPipeline` built from it checks nothing again.

    An `AgentSpec` holds its layers as one, so opening a session re-validates nothing.
    """

    __slots__ = ()
    _sequence_error = "middleware must be a sequence of tool middleware, got {}"
    _passed = PassedChecks()  # a chat() run per request must not inspect the same functions again

    @staticmethod
    def _check_layer(layer: object, index: int) -> None:
        _check_tool_middleware(layer, index)


class _GuardViolation(Exception):
    """A middleware broke a pre-run rule; the call ends with an error and the tool does not run."""


def _early_return_result() -> ToolResult:
    return ToolResult.failure(
        ToolErrorType.EXECUTION,
        "Tool middleware fault: call_next() was entered after the middleware chain had returned; "
        "nothing ran (the call was already settled)",
        code="middleware_early_return",
    )


def _guard(state: _Call, request: ToolMiddlewareRequest) -> None:
    """The chain's check, before every inner layer and the core: identity, name and interrupt behaviour."""
    if state.door_closed:
        return  # the chain already returned: the entry is refused when it is awaited
    if (
        type(request) is ToolMiddlewareRequest
        and request.context is state.ctx
        and request.tool_name == state.tool.name
        and request.input == state.scheduled.model_input  # not replaced, nor changed in place
    ):
        state.effective_input = request.input
        return
    try:
        if not isinstance(request, ToolMiddlewareRequest):
            raise _GuardViolation(f"call_next() takes a ToolMiddlewareRequest, got {type(request).__name__}")
        if request.tool_name != state.tool.name:
            raise _GuardViolation("Tool middleware cannot change the tool name")
        if request.context is not state.ctx:
            raise _GuardViolation("Tool middleware cannot replace the execution context")
        if request.input != state.scheduled.model_input:  # replaced, or changed in place
            if not isinstance(request.input, dict):
                raise _GuardViolation("Tool middleware must pass a JSON object as input")
            try:
                behavior = state.tool.resolve_behavior(request.input)
            except ToolBehaviorError as exc:
                raise _GuardViolation(str(exc)) from None
            if behavior.interrupt is not state.behavior.interrupt:
                raise _GuardViolation("Tool middleware cannot change the tool interrupt behavior")
    except _GuardViolation as exc:
        if state.violation is None:
            state.violation = str(exc)
        raise
    state.effective_input = request.input


def _terminal(state: _Call, request: ToolMiddlewareRequest) -> Coroutine[Any, Any, ToolResult]:
    # A function of the call, like `_guard`: the composed chain holds no pipeline (the call knows
    # it), so every pipeline of the same layers shares it and a chat() run's pipeline dies by refcount.
    return state.pipeline._core(state, request.input, request.emit)


def _compose(layers: ToolLayers) -> Composed:
    """The chain of *layers* (checked: nothing to check again) around the core. Its runs carry
    the call (`Composed.start`): the guard and the terminal take it first."""
    # Typed as taking the request alone; a run's (`Composed.start`) take the call first.
    check: Any = _guard
    terminal: Any = _terminal
    chain = compose_middleware(layers, terminal, check=check, validate=False)
    assert isinstance(chain, Composed)
    return chain


async def _refused() -> ToolResult:
    return _early_return_result()


async def _awaiting(awaitable: Awaitable[ToolResult]) -> ToolResult:
    return await awaitable


class _CallNext(ComposedNext, Coroutine[Any, Any, ToolResult]):
    """The composer's ``next`` of one tool layer, called as ``call_next(request=None, *, emit=None)``;
    once called, it is also the awaitable that call returns. Its run is the call (`_Call`).

    Calling it passes the composer's rules (next once, the guard); the inner layer (or the core)
    is entered only when it is awaited: so a ``call_next()`` that is never awaited leaves no
    coroutine behind (no "never awaited" warning), the pipeline can tell what is still pending
    or running when the chain returns, and an entry after that (the door is closed) runs
    nothing and returns a fault result. It is a `Coroutine`, so ``nursery.start_soon(call_next)``
    works. One object per layer and call.
    """

    # Set when needed (so read with a guard or a default): _awaitable, once called (until awaited);
    # _gen, what `send` drives when this is run as a coroutine.
    __slots__ = ("_awaitable", "_gen")
    _run: _Call

    def __init__(self, chain: Composed, index: int, current: ToolMiddlewareRequest, run: _Call) -> None:
        # `ComposedNext.__init__`, as a site of its own: shared with the model chains' links, its
        # attribute stores would see two classes and CPython would not specialise them.
        self._chain = chain
        self._index = index
        self._current = current
        self._run = run
        self._used = False

    def __call__(self, request: ToolMiddlewareRequest | None = None, *, emit: Emit | None = None) -> _CallNext:
        state = self._run
        inner = self._current
        if request is not None or emit is not None:
            current = inner
            inner = current if request is None else request
            # The emit for inner layers: the emit= argument, else the request's own
            # (if it was bound), else the current one.
            inner_emit = inner.emit if emit is None else emit
            if inner_emit is _inherit_emit:
                inner_emit = current.emit
            if inner.emit is not inner_emit:
                inner = ToolMiddlewareRequest(inner.tool_name, inner.input, inner.context, inner_emit)
        try:
            self._admit(inner)
        except NextCalledTwiceError:
            state.next_twice = True
            raise
        self._current = inner  # what the inner layers get
        self._awaitable = True
        state.pending += 1
        return self

    def __await__(self) -> Generator[Any, Any, ToolResult]:
        try:
            awaitable = self._awaitable
        except AttributeError:  # never called, or its call was refused: nothing was returned to await
            raise TypeError("call_next must be called: `await call_next()`") from None
        if not awaitable:
            raise RuntimeError("cannot await the same call_next() twice")
        self._awaitable = False
        state = self._run
        state.pending -= 1
        if state.door_closed:  # the chain returned: nothing runs
            return _refused().__await__()
        inner = self._enter(self._current)
        if type(inner) is not CoroutineType:
            inner = _awaiting(inner)
        entered = state.entered
        assert entered is not None  # the door is open: the chain runs
        entered.append(inner)
        return inner.__await__()  # type: ignore[no-any-return]

    def _driven(self) -> Generator[Any, Any, ToolResult]:
        gen = getattr(self, "_gen", None)
        if gen is None:
            gen = self._gen = self.__await__()
        return gen

    def send(self, value: Any) -> Any:
        return self._driven().send(value)

    def throw(self, typ: Any, val: Any = None, tb: TracebackType | None = None) -> Any:
        if val is None and tb is None:
            return self._driven().throw(typ)
        return self._driven().throw(typ, val, tb)  # pragma: no cover - the legacy signature

    def close(self) -> None:
        gen = getattr(self, "_gen", None)
        if gen is not None:
            gen.close()
