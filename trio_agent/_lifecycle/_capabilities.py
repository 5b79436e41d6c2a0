"""Capabilities: typed values one middleware provides in ``setup`` and others read.

Rules
=====

* `create_capability` makes a handle, a `Capability[T]` (``T``: the value's type, for the
  type checker only). **Identity is the handle object, not its name**: two handles named
  ``"db"`` are two capabilities; the name is for messages.
* A middleware declares ``requires``, ``provides`` and ``optional_requires``: tuples of
  handles (class attributes of `ChatMiddleware`, keywords of `define_chat_middleware`).
  Anything else in them is a `MiddlewareShapeError` naming the middleware and the entry.
* Before anything runs, `validate_capabilities` (also called by `middleware_lifecycle`,
  without an adapter) checks the adapters' ``requires`` first (``chat()``: the model service's
  and its provider's), then every middleware's
  ``requires``, against the union of every middleware's ``provides``; the first gap is a
  `CapabilityError`. The order of the list is not checked (a provider may come after its
  consumer), and ``optional_requires`` is never checked.
* Per run, ``ctx.capabilities`` (a `CapabilityRegistry`) holds the values. After every
  middleware's ``setup`` ran, each declared ``provides`` must hold a value, else the run
  fails with a `CapabilityError` (``on_error`` runs).
* ``get`` of a capability nobody provided (yet) raises `CapabilityError`; ``get_optional``
  returns ``None``. A second ``provide`` of one handle wins and logs a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, cast, final

from .._errors import ConfigError, MiddlewareShapeError
from .._util import safe_repr

if TYPE_CHECKING:
    from ._middleware import ChatMiddleware

__all__ = [
    "Capability",
    "CapabilityError",
    "CapabilityRegistry",
    "Declared",
    "capability_handles",
    "check_provided",
    "create_capability",
    "declared_capabilities",
    "validate_capabilities",
]

T = TypeVar("T")

_log = logging.getLogger("trio_agent.lifecycle")


class CapabilityError(ConfigError):
    """A capability is required, declared or read but not provided; ``capability`` is the handle (if any)."""

    def __init__(self, message: str, *, capability: Capability[Any] | None = None) -> None:
        super().__init__(message)
        self.capability = capability


@final
class Capability(Generic[T]):
    """A capability handle: list it in ``requires`` / ``provides``, pass it to ``ctx.get`` and
    ``ctx.provide``. Make one with `create_capability`. Compared by identity, never by name."""

    __slots__ = ("name", "value_type")

    name: str
    value_type: type[T] | None

    def __init__(self, name: str, value_type: type[T] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise CapabilityError(f"a capability's name must be a non-empty string, got {safe_repr(name)}")
        self.name = str.__str__(name)  # a str subclass's own methods (its repr) are the caller's code
        self.value_type = value_type

    def __repr__(self) -> str:
        kind = getattr(self.value_type, "__qualname__", None)
        return f"<Capability {self.name!r}{f' ({kind})' if kind else ''}>"

    # A copied middleware still names the same capability.
    def __copy__(self) -> Capability[T]:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Capability[T]:
        return self


def create_capability(name: str, value_type: type[T] | None = None) -> Capability[T]:
    """A new capability handle named *name* (for messages), distinct from every other handle.

    The value type comes from *value_type* (``create_capability("db", Database)``) or from
    the annotation (``DB: Capability[Database] = create_capability("db")``, the form for
    protocols, abstract classes and generic types). It is for the type checker only.

    Raises:
        CapabilityError: *name* is not a non-empty string.
    """
    return Capability(name, value_type)


def _named(capabilities: Iterable[Capability[Any]]) -> str:
    names = list(dict.fromkeys(handle.name for handle in capabilities))
    return ", ".join(names) if names else "none"


@final
class CapabilityRegistry:
    """The capabilities of one run (``ctx.capabilities``): a value per handle."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[Capability[Any], object] = {}

    def __repr__(self) -> str:
        return f"<CapabilityRegistry: {_named(self._values)}>"

    def provide(self, handle: Capability[T], value: T) -> None:
        """Set *handle*'s value for this run; a second provide wins, with a warning."""
        _check_handle(handle, "provide")
        if handle in self._values:
            _log.warning("capability %r provided more than once; last provider wins", handle.name)
        self._values[handle] = value

    def get(self, handle: Capability[T]) -> T:
        """*handle*'s value.

        Raises:
            CapabilityError: nothing provided it (yet).
        """
        _check_handle(handle, "get")
        try:
            return cast("T", self._values[handle])
        except KeyError:
            raise CapabilityError(
                f"Capability {handle.name!r} was requested but never provided. "
                "Ensure a middleware provides it in setup(), ordered before this consumer.",
                capability=handle,
            ) from None

    def get_optional(self, handle: Capability[T]) -> T | None:
        """*handle*'s value, or ``None`` when nothing provided it."""
        _check_handle(handle, "get_optional")
        return cast("T | None", self._values.get(handle))

    def has(self, handle: Capability[Any]) -> bool:
        """Whether *handle* was provided in this run."""
        _check_handle(handle, "has")
        return handle in self._values

    def provided(self) -> tuple[str, ...]:
        """The names of the provided capabilities, in the order they were first provided."""
        return tuple(handle.name for handle in self._values)


def _check_handle(handle: object, method: str) -> None:
    if not isinstance(handle, Capability):
        raise CapabilityError(
            f"capabilities.{method}() takes a handle from create_capability(), got {safe_repr(handle)}"
        )


# -- declarations and validation --------------------------------------------------------------


class Declared(NamedTuple):
    """What one middleware declares, checked."""

    name: str
    requires: tuple[Capability[Any], ...]
    provides: tuple[Capability[Any], ...]
    optional_requires: tuple[Capability[Any], ...]


def _middleware_name(middleware: object) -> str:
    name = getattr(middleware, "name", None)
    # Exactly a str: a subclass's own methods (its repr, in our messages) are the caller's code.
    return str.__str__(name) if isinstance(name, str) and name else type(middleware).__name__


def capability_handles(
    value: object, field: str, owner: str, error: type[Exception] = MiddlewareShapeError
) -> tuple[Capability[Any], ...]:
    """*value* (a declaration) as a tuple of handles; *error* names *owner*, *field* and the bad entry."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise error(f"{field} of {owner} must be a tuple of capability handles, got {safe_repr(value)}")
    for entry in value:
        if not isinstance(entry, Capability):
            raise error(
                f"{field} of {owner} holds {safe_repr(entry)}, which is not a capability handle "
                "(make one with create_capability)"
            )
    return tuple(value)


def declared_capabilities(middleware: object) -> Declared:
    """The checked ``requires`` / ``provides`` / ``optional_requires`` of *middleware*.

    Raises:
        MiddlewareShapeError: one is not a list or tuple of handles.
    """
    name = _middleware_name(middleware)
    owner = f"middleware {name!r}"
    return Declared(
        name,
        capability_handles(getattr(middleware, "requires", ()), "requires", owner),
        capability_handles(getattr(middleware, "provides", ()), "provides", owner),
        capability_handles(getattr(middleware, "optional_requires", ()), "optional_requires", owner),
    )


def _adapter_name(adapter: object) -> str:
    for attr in ("name", "model"):
        value = getattr(adapter, attr, None)
        if isinstance(value, str) and value:
            return str.__str__(value)
    return type(adapter).__name__


def _missing(kind: str, owner: str, handle: Capability[Any], provided: Sequence[Capability[Any]]) -> CapabilityError:
    hint = ""
    if any(other.name == handle.name for other in provided):
        hint = (
            f" (a different handle named {handle.name!r} is provided: handles match by identity, "
            "so import the provider's handle)"
        )
    return CapabilityError(
        f"{kind} {owner!r} requires capability {handle.name!r}. Provided capabilities: {_named(provided)}. "
        f"Add a middleware that provides {handle.name!r}.{hint}",
        capability=handle,
    )


def validate_capabilities(middleware: Sequence[ChatMiddleware], *adapters: object) -> None:
    """Check, before a run, that every required capability is provided by some middleware.

    The provided set is the union of every middleware's ``provides``; each *adapter*'s
    ``requires`` (an optional attribute of any object: a model service and the provider it
    wraps, say; ``None`` is skipped) are checked first, in the order given, then each
    middleware's, in list order. Order is not checked; ``optional_requires`` never is.

    Raises:
        CapabilityError: the first requirement nobody provides; the message names who requires
            what and lists the provided capabilities (``none`` when there are none).
        MiddlewareShapeError: *middleware* is not a list or tuple, or a declaration is not
            a tuple of handles.
    """
    if not isinstance(middleware, (list, tuple)):
        raise MiddlewareShapeError(
            f"validate_capabilities: middleware must be a list of ChatMiddleware, got {safe_repr(middleware)}"
        )
    needs: list[tuple[object, object]] = []  # named only when it declares something (most do not)
    for adapter in adapters:
        requires = getattr(adapter, "requires", None)  # None has none
        if requires is not None:
            needs.append((adapter, requires))
    if not middleware and not needs:
        return  # nothing requires anything (a chat() run per request asks this)
    declared = [declared_capabilities(item) for item in middleware]
    provided = list(dict.fromkeys(handle for item in declared for handle in item.provides))
    known = set(provided)
    for adapter, requires in needs:
        name = _adapter_name(adapter)
        for handle in capability_handles(requires, "requires", f"adapter {name!r}", CapabilityError):
            if handle not in known:
                raise _missing("Adapter", name, handle, provided)
    for item in declared:
        for handle in item.requires:
            if handle not in known:
                raise _missing("Middleware", item.name, handle, provided)


def check_provided(registry: CapabilityRegistry, declared: Iterable[Declared]) -> None:
    """After every ``setup``: each declared ``provides`` holds a value.

    Raises:
        CapabilityError: the first one that does not.
    """
    for item in declared:
        for handle in item.provides:
            if not registry.has(handle):
                raise CapabilityError(
                    f"Middleware {item.name!r} declares it provides {handle.name!r} "
                    "but never called provide() in setup().",
                    capability=handle,
                )
