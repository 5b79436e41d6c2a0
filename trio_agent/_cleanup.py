"""One bound for every shielded clean-up.

A shield protects work that must finish after a cancellation (recording what was
decided, closing a stream or a connection). Unbounded, it turns a 1 s deadline
into however long the slowest ``finally`` takes. Every shield in the library is
therefore a `bounded_shield`: shielded, with a deadline of ``grace`` seconds; a
clean-up that overruns is abandoned and logged as a WARNING on the
``trio_agent`` logger, naming the layer and the time it was given.
"""

from __future__ import annotations

import logging
from types import TracebackType

import trio

from ._config import validate_timeout

__all__ = ["DEFAULT_CLEANUP_GRACE", "bounded_shield", "validate_cleanup_grace"]

DEFAULT_CLEANUP_GRACE = 10.0
"""Seconds a shielded clean-up may take before it is abandoned (``cleanup_grace``)."""

logger = logging.getLogger("trio_agent")


def validate_cleanup_grace(value: object) -> float:
    return validate_timeout(value, name="cleanup_grace")


class bounded_shield:  # lower-case: used like trio's own context managers
    """``with bounded_shield(grace, "what is cleaned up"):`` a shielded scope bounded by *grace* seconds.

    The scope is available as ``as scope``; ``scope.cancelled_caught`` tells whether
    the bound cut the clean-up short (then a WARNING was logged).
    """

    __slots__ = ("_scope", "_started", "bound", "grace", "layer")

    def __init__(self, grace: float, layer: str, *, bound: str = "cleanup_grace") -> None:
        self.grace = grace
        self.layer = layer
        self.bound = bound  # the option that set *grace*, named in the warning
        self._started = 0.0

    def __enter__(self) -> trio.CancelScope:
        self._started = started = trio.current_time()
        # The deadline given to the constructor: setting it on a made scope costs a third more.
        self._scope = trio.CancelScope(shield=True, deadline=started + self.grace)
        return self._scope.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        suppressed = self._scope.__exit__(exc_type, exc, tb)
        if self._scope.cancelled_caught:
            logger.warning(
                "clean-up of %s overran its %.3g s bound (%s) after %.3g s; it was abandoned",
                self.layer,
                self.grace,
                self.bound,
                trio.current_time() - self._started,
            )
        return suppressed
