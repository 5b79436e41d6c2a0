"""The generic onion composer that the tool and model chains are built on, and the checked layer tuples."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, Self, TypeVar

from ._errors import MiddlewareShapeError, NextCalledTwiceError
from ._util import safe_repr

__all__ = [
    "CheckedLayers",
    "Composed",
    "ComposedNext",
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
        raise MiddlewareShapeError(f"{what} #{index} is not callable: got {safe_repr(layer)}")
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
    _sequence_error = "middleware must be a sequence, got {}"
    _passed: PassedChecks

    @staticmethod
    def _check_layer(layer: object, index: int) -> None:
        """Raise `MiddlewareShapeError` unless *layer* (at *index*) is a layer of this kind."""
        raise NotImplementedError

    @classmethod
    def check(cls, middleware: Sequence[Any]) -> Self:
        """The layers, each checked (`MiddlewareShapeError` names the first bad one).

        The same layer objects as the last check of this class get the same layers object back,
        with what was built from them (`derived`): a ``chat()`` run per request passes its list
        again. One per class, so what that keeps alive is one stack of layers.
        """
        if type(middleware) is cls:
            return middleware
        kind = type(middleware)
        if kind is list or kind is tuple:
            if not middleware:
                return cls._empty()
            last: Self | None = cls.__dict__.get("_last")
            if last is not None and len(last) == len(middleware):
                for given, kept in zip(middleware, last, strict=True):
                    if given is not kept:
                        break
                else:
                    return last
        elif isinstance(middleware, (str, bytes)) or not isinstance(middleware, Sequence):
            raise MiddlewareShapeError(cls._sequence_error.format(safe_repr(middleware)))
        passed = cls._passed
        known = passed._passed  # `layer in passed`, inline: asked per layer of every chat() run
        for index, layer in enumerate(middleware):
            ref = known.get(id(layer))
            if ref is not None and ref() is layer:
                continue
            cls._check_layer(layer, index)
            passed.add(layer)
        layers = cls(middleware)
        if layers:
            setattr(cls, "_last", layers)  # noqa: B010 - on the class itself, not inherited
        return layers

    @classmethod
    def _empty(cls) -> Self:
        """No layers: one shared object per class (nothing to check, nothing built from it differs)."""
        empty = cls.__dict__.get("_no_layers")
        if empty is None:
            empty = cls()
            setattr(cls, "_no_layers", empty)  # noqa: B010 - on the class itself, not inherited
        return empty

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
    referenced is simply checked every time. Kept by identity (a layer's own ``__eq__`` or
    ``__hash__`` is never called), and asked once per layer per pipeline or model service.
    """

    __slots__ = ("_passed",)

    def __init__(self) -> None:
        self._passed: dict[int, weakref.ref[object]] = {}

    def __contains__(self, layer: object) -> bool:
        ref = self._passed.get(id(layer))
        return ref is not None and ref() is layer

    def add(self, layer: object) -> None:
        key = id(layer)
        passed = self._passed

        def forget(ref: weakref.ref[object]) -> None:
            if passed.get(key) is ref:  # not a later object that got the same id
                del passed[key]

        with contextlib.suppress(TypeError):  # not weakly referable: checked every time
            passed[key] = weakref.ref(layer, forget)


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
    callers that already checked the layers once.
    """
    try:
        layers = tuple(middleware)
    except TypeError:  # not iterable: a shape error like any other (api.md)
        raise MiddlewareShapeError(f"middleware must be a list of middleware, got {safe_repr(middleware)}") from None
    if validate:
        for index, layer in enumerate(layers):
            check_middleware_shape(layer, what="middleware", index=index)
    if not callable(terminal):
        raise MiddlewareShapeError(f"terminal is not callable: got {safe_repr(terminal)}")
    return Composed(layers, terminal, check)


# The chain is two small classes rather than closures: a closure that hands itself down (each
# `next` calling `dispatch`) is a reference cycle per call, which only the cyclic GC can free.
# A composed chain keeps nothing of a run, so one chain can serve every run (`CheckedLayers.derived`).


class Composed:
    """A composed chain (what `compose_middleware` returns): each run makes one `ComposedNext` per layer it enters."""

    __slots__ = ("_check", "_layers", "_terminal")

    def __init__(self, layers: tuple[Any, ...], terminal: Callable[..., Any], check: Callable[..., None] | None):
        self._layers = layers
        self._terminal = terminal
        self._check = check

    def __call__(self, request: Any) -> Any:
        if self._check is not None:
            self._check(request)
        if not self._layers:
            return self._terminal(request)
        return self._layers[0](request, ComposedNext(self, 1, request, None))

    def start(self, request: Any, run: object, link: type[ComposedNext]) -> Any:
        """A run that carries *run*: what its check and terminal need besides the request, so they
        are called as ``check(run, request)`` and ``terminal(run, request)`` and a chain composed once
        serves every run. Its ``next`` is a *link*: a `ComposedNext` subclass that changes how ``next``
        is called, not what it does (the tool pipeline's takes ``emit=`` and enters the inner layers
        when its result is awaited). *request* is the caller's own, so it is not checked."""
        if not self._layers:
            return self._terminal(run, request)
        return self._layers[0](request, link(self, 1, request, run))


class ComposedNext:
    """``next(request=None)`` of one layer: the inner layers, with the current request or a new one.

    Each layer gets its own, and the inner layer at position *index* is entered only by it: so
    calling it a second time is exactly a second ``next()`` of one execution chain. Calling it is
    two steps, which a subclass may take at different times: `_admit` (the rules at the boundary)
    and `_enter` (the inner layer, or the terminal).
    """

    __slots__ = ("_chain", "_current", "_index", "_run", "_used")

    def __init__(self, chain: Composed, index: int, current: Any, run: object) -> None:
        self._chain = chain
        self._index = index
        self._current = current
        self._run = run  # None, or what the run carries (`Composed.start`)
        self._used = False

    def __call__(self, replacement: Any = None, /) -> Any:
        # `_admit` then `_enter`, inline: the model chains take this path at every layer of every call.
        if self._used:
            raise NextCalledTwiceError()
        self._used = True
        current = self._current if replacement is None else replacement
        chain = self._chain
        run = self._run
        check = chain._check
        if check is not None:
            if run is None:
                check(current)
            else:
                check(run, current)
        index = self._index
        if index == len(chain._layers):
            return chain._terminal(current) if run is None else chain._terminal(run, current)
        return chain._layers[index](current, type(self)(chain, index + 1, current, run))

    def _admit(self, current: Any) -> None:
        """``next`` once per layer, and the chain's check of the request the inner layer gets."""
        if self._used:
            raise NextCalledTwiceError()
        self._used = True
        check = self._chain._check
        if check is not None:
            if self._run is None:
                check(current)
            else:
                check(self._run, current)

    def _enter(self, current: Any) -> Any:
        """The inner layer with *current* and its own next (of this one's class), or the terminal."""
        chain = self._chain
        index = self._index
        run = self._run
        if index == len(chain._layers):
            return chain._terminal(current) if run is None else chain._terminal(run, current)
        return chain._layers[index](current, type(self)(chain, index + 1, current, run))
