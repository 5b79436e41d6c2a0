"""`LazyConverter`: cattrs converters that pay for their code generation on first use."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import cattrs

__all__ = ["LazyConverter"]

T = TypeVar("T")


class LazyConverter(cattrs.Converter):
    """A cattrs converter whose hooks are registered on its first use, once.

    cattrs generates code for every class a union or a hook names when it is told about
    them; done at import, that cost lands on every ``import trio_agent``. Configuring on the
    first use (under a lock: a store's worker thread may be first) moves it to the first run
    that needs it. Every entry point configures first: ``structure`` / ``unstructure``, the
    hook getters, the ``register_*`` methods (so a hook registered by user code wins over
    the configured ones, as on a plain converter) and ``copy`` (the copy has every hook).
    """

    def __init__(
        self, *args: Any, configure: Callable[[cattrs.Converter], object] | None = None, **options: Any
    ) -> None:
        # Set before cattrs' own __init__, which may register its default hooks.
        self._configure: Callable[[cattrs.Converter], object] | None = None
        self._lock = threading.RLock()
        self._busy = False
        super().__init__(*args, **options)
        self._configure = configure  # None once configured (and for a copy)

    def _configured(self) -> None:
        # Other threads wait on the lock until the hooks are all in; a call from inside
        # `configure` itself (same thread) goes on with what is registered so far.
        with self._lock:
            if self._configure is None or self._busy:
                return
            self._busy = True
            try:
                self._configure(self)
            finally:
                self._busy = False
            self._configure = None

    def structure(self, obj: Any, cl: type[T]) -> T:
        if self._configure is not None:
            self._configured()
        return super().structure(obj, cl)

    def unstructure(self, obj: Any, unstructure_as: Any = None) -> Any:
        if self._configure is not None:
            self._configured()
        return super().unstructure(obj, unstructure_as)


def _configuring_first(name: str) -> None:
    plain = getattr(cattrs.Converter, name)

    def method(self: LazyConverter, *args: Any, **kwargs: Any) -> Any:
        if self._configure is not None:
            self._configured()
        return plain(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = plain.__doc__
    setattr(LazyConverter, name, method)


for _name in (
    "copy",
    "get_structure_hook",
    "get_unstructure_hook",
    "register_structure_hook",
    "register_structure_hook_factory",
    "register_structure_hook_func",
    "register_unstructure_hook",
    "register_unstructure_hook_factory",
    "register_unstructure_hook_func",
):
    _configuring_first(_name)
