"""The generic onion composer that the tool and model chains are built on."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, Self, TypeVar

from ._errors import MiddlewareShapeError, NextCalledTwiceError

__all__ = [
    "CheckedLayers",
    "Middleware",
    "MiddlewareNext",
    "PassedChecks",
    "check_middleware_shape",
    "compose_middleware",
]

Req = TypeVar("Req")
Res = TypeVar("Res")
Req_contra = TypeVar("Req_contra", contravariant=True)
Res_co = TypeVar("Res_co", covariant=True)
T = TypeVar("T")


class MiddlewareNext(Protocol[Req_contra, Res_co]):
    """``next(request=None)``: run the inner layers; ``None`` passes the current request."""

    def __call__(self, request: Req_contra | None = None, /) -> Res_co: ...


Middleware = Callable[[Req, MiddlewareNext[Req, Res]], Res]


def check_middleware_shape(layer: object, *, what: str, index: int, params: int = 2) -> None:
    """Raise `MiddlewareShapeError` unless *layer* can be called with *params* positional arguments."""
    if not callable(layer):
        raise MiddlewareShapeError(f"{what} #{index} is not callable: got {type(layer).__name__} {layer!r}")
    try:
        signature = inspect.signature(layer)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return
    try:
        signature.bind(*range(params))
    except TypeError as exc:
        raise MiddlewareShapeError(
            f"{what} #{index} ({_name(layer)}) must accept {params} positional arguments "
            f"(request, next); its signature is {signature}: {exc}"
        ) from None


class CheckedLayers(tuple[Any, ...]):
    """A tuple of middleware layers, each checked once (`check`): whatever is built from one checks
    nothing again. Subclasses say what a layer must be (`_check_layer`) and keep their own
    `PassedChecks`, so a layer passed to many runs is inspected once.
    """

    # No __slots__: `derived` keeps what is built from the layers on the object itself.
    _sequence_error = "middleware must be a sequence, got {!r}"
    _passed: PassedChecks

    @staticmethod
    def _check_layer(layer: object, index: int) -> None:
        """Raise `MiddlewareShapeError` unless *layer* (at *index*) is a layer of this kind."""
        raise NotImplementedError

    @classmethod
    def check(cls, middleware: Sequence[Any]) -> Self:
        """The layers, each checked (`MiddlewareShapeError` names the first bad one)."""
        if type(middleware) is cls:
            return middleware
        if isinstance(middleware, (str, bytes)) or not isinstance(middleware, Sequence):
            raise MiddlewareShapeError(cls._sequence_error.format(middleware))
        passed = cls._passed
        for index, layer in enumerate(middleware):
            if layer in passed:
                continue
            cls._check_layer(layer, index)
            passed.add(layer)
        return cls(middleware)

    def derived(self, key: str, build: Callable[[Self], T]) -> T:
        """What *build* makes of these layers alone (a composed chain), made once per layers
        object: sessions opened from one spec share it. *build* must not keep this object."""
        made: dict[str, Any] = self.__dict__
        if key not in made:
            made[key] = build(self)
        return made[key]  # type: ignore[no-any-return]


class PassedChecks:
    """The layers that passed a shape check, so the same object is not inspected again.

    Weak: a layer is forgotten with its last reference. A layer that cannot be weakly
    referenced (or hashed) is simply checked every time.
    """

    __slots__ = ("_passed",)

    def __init__(self) -> None:
        self._passed: weakref.WeakSet[object] = weakref.WeakSet()

    def __contains__(self, layer: object) -> bool:
        try:
            return layer in self._passed
        except TypeError:
            return False

    def add(self, layer: object) -> None:
        with contextlib.suppress(TypeError):
            self._passed.add(layer)


def _name(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def compose_middleware(
    middleware: Sequence[Middleware[Req, Res]],
    terminal: Callable[[Req], Res],
    *,
    check: Callable[[Req], None] | None = None,
    validate: bool = True,
) -> Callable[[Req], Res]:
    """Compose *middleware* around *terminal* into one callable (Koa-style onion).

    The first registered layer is the outermost: code before ``next()`` runs in
    registration order, code after it in reverse. ``next(request)`` replaces the
    request for the inner layers, ``next()`` passes the current one, and a layer
    that never calls ``next`` short-circuits (the terminal does not run). One
    execution chain may call ``next`` once per layer; a second call raises
    `NextCalledTwiceError` ("next() called multiple times") so a tool or model is
    never run twice.

    The result type is opaque, so the same composer serves plain values and
    awaitables. *check*, if given, sees every request before it enters a layer or
    the terminal; raising there stops the chain before the inner layer runs.

    The layer list is copied when composing, so later changes to *middleware* do
    not affect the composed chain. ``validate=False`` skips the shape check, for
    callers that already checked the layers once and compose per call.
    """
    layers = tuple(middleware)
    if validate:
        for index, layer in enumerate(layers):
            check_middleware_shape(layer, what="middleware", index=index)
    if not callable(terminal):
        raise MiddlewareShapeError(f"terminal is not callable: got {terminal!r}")
    return _Composed(layers, terminal, check)


# The chain is three small classes rather than closures: a closure that hands itself down (each
# `next` calling `dispatch`) is a reference cycle per call, which only the cyclic GC can free.


class _Composed:
    __slots__ = ("_check", "_layers", "_terminal")

    def __init__(self, layers: tuple[Any, ...], terminal: Callable[[Any], Any], check: Callable[[Any], None] | None):
        self._layers = layers
        self._terminal = terminal
        self._check = check

    def __call__(self, request: Any) -> Any:
        return _Run(self).dispatch(0, request)


class _Run:
    """One execution chain: the last dispatched position, so a second ``next()`` is caught."""

    __slots__ = ("_composed", "_last")

    def __init__(self, composed: _Composed) -> None:
        self._composed = composed
        self._last = -1

    def dispatch(self, index: int, current: Any) -> Any:
        # A call at or below the last dispatched position is a second next() from some layer.
        if index <= self._last:
            raise NextCalledTwiceError()
        self._last = index
        composed = self._composed
        if composed._check is not None:
            composed._check(current)
        if index == len(composed._layers):
            return composed._terminal(current)
        return composed._layers[index](current, _Next(self, index + 1, current))


class _Next:
    """``next(request=None)`` of one layer: the inner layers, with the current request or a new one."""

    __slots__ = ("_current", "_index", "_run")

    def __init__(self, run: _Run, index: int, current: Any) -> None:
        self._run = run
        self._index = index
        self._current = current

    def __call__(self, replacement: Any = None, /) -> Any:
        return self._run.dispatch(self._index, self._current if replacement is None else replacement)
