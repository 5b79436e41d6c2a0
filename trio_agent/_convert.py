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
    first ``structure`` / ``unstructure`` (under a lock: a store's worker thread may be
    first) moves it to the first run that needs it.
    """

    def __init__(self, configure: Callable[[cattrs.Converter], object], **options: Any) -> None:
        super().__init__(**options)
        self._configure: Callable[[cattrs.Converter], object] | None = configure  # None once configured
        self._lock = threading.RLock()
        self._busy = False

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
