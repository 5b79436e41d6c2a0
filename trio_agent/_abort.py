"""Typed, SDK-owned aborts.

Code decides on an `AbortHandle` and its `Abort` reason, never on
``trio.Cancelled`` or a scope's display string: a deadline has no reason and
nested scopes report the outermost one. A handle does not own a cancel scope
itself; whoever runs work under it registers a listener that cancels the scope
of the phase currently running (see the tool pipeline), so a handle can be
shared by a request, its turns and its tool calls.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs

from ._errors import ConfigError

__all__ = ["USER_ABORT_REASONS", "Abort", "AbortHandle", "AbortReason", "abort_reason"]


class AbortReason(enum.Enum):
    """Why SDK-owned work was aborted."""

    USER_ABORT = "user_abort"
    STEERING = "steering"
    SESSION_CLOSE = "session_close"
    TIMEOUT = "timeout"
    LEASE_LOST = "lease_lost"


@attrs.frozen
class Abort:
    """An abort that happened: its typed reason and a message for people."""

    reason: AbortReason
    message: str


USER_ABORT_REASONS = (AbortReason.USER_ABORT, AbortReason.STEERING, AbortReason.SESSION_CLOSE)
"""The reasons a public ``abort()`` takes. ``timeout`` and ``lease_lost`` are the SDK's own
conditions: given by a caller they would fake them (a lease said lost while it is held leaves the
request open and the session unusable; a timeout the journal cannot record as one)."""


def abort_reason(reason: object, message: object) -> AbortReason:
    """A public ``abort(reason, message)``'s reason as an `AbortReason` (its value, a ``str``, is
    accepted too); a bad reason or message is a `ConfigError` naming it, whether or not anything runs.
    Only `USER_ABORT_REASONS` are accepted."""
    if not isinstance(message, str):
        raise ConfigError(f"abort message must be a str, got {message!r}")
    checked = _as_reason(reason)
    choices = ", ".join(repr(member.value) for member in USER_ABORT_REASONS)
    if checked is None:
        raise ConfigError(f"abort reason must be an AbortReason or one of {choices}, got {reason!r}")
    if checked not in USER_ABORT_REASONS:
        raise ConfigError(
            f"abort reason {checked.value!r} is the SDK's own (it reports that condition, it cannot be "
            f"asked for); abort() takes one of {choices}"
        )
    return checked


def _as_reason(reason: object) -> AbortReason | None:
    if isinstance(reason, AbortReason):
        return reason
    if isinstance(reason, str):
        try:
            return AbortReason(reason)
        except ValueError:
            return None
    return None


_DEFAULT_MESSAGES = {
    AbortReason.USER_ABORT: "aborted by the user",
    AbortReason.STEERING: "interrupted by new user input",
    AbortReason.SESSION_CLOSE: "the session closed",
    AbortReason.TIMEOUT: "timed out",
    AbortReason.LEASE_LOST: "the execution lease was lost",
}


class AbortHandle:
    """A one-shot, typed abort signal for a request, a turn or a tool call.

    ``abort()`` records the first reason and notifies listeners synchronously;
    later calls are ignored. Listeners link handles: a listener that aborts
    another handle forwards this one's reason to it.
    """

    # The first listener is kept in a slot of its own, not in a dict: the usual handle has one
    # listener at a time (the phase that runs under it), and a dict holding one is one more object
    # for the garbage collector per handle in use. A listener added while the first is there goes
    # to `_listeners` (made then); the first is always older than those, so they run in order.
    __slots__ = ("_abort", "_first", "_first_token", "_listeners", "_next_token")

    def __init__(self) -> None:
        self._abort: Abort | None = None
        self._first: Callable[[Abort], None] | None = None
        self._first_token = -1
        self._listeners: dict[int, Callable[[Abort], None]] | None = None
        self._next_token = 0

    def __repr__(self) -> str:
        state = "pending" if self._abort is None else self._abort.reason.value
        return f"<AbortHandle {state}>"

    @property
    def aborted(self) -> bool:
        """Whether `abort` has been called."""
        return self._abort is not None

    @property
    def reason(self) -> Abort | None:
        """The first abort, or ``None`` while not aborted."""
        return self._abort

    def abort(self, reason: AbortReason = AbortReason.USER_ABORT, message: str | None = None) -> bool:
        """Abort with *reason*; return ``False`` if this handle was already aborted."""
        if not isinstance(reason, AbortReason):
            raise TypeError(f"reason must be an AbortReason, got {reason!r}")
        if self._abort is not None:
            return False
        abort = self._abort = Abort(reason, message or _DEFAULT_MESSAGES[reason])
        first, listeners = self._first, self._listeners
        self._first = self._listeners = None
        if first is not None:
            first(abort)
        if listeners:
            for listener in listeners.values():  # (the dict is no longer the handle's: nothing changes it)
                listener(abort)
        return True

    def add_listener(self, listener: Callable[[Abort], None]) -> int:
        """Call *listener* once on abort (at once if already aborted); return a token for removal."""
        if self._abort is not None:
            listener(self._abort)
            return -1
        token = self._next_token
        self._next_token = token + 1
        if self._first is None and not self._listeners:
            self._first, self._first_token = listener, token
        else:
            listeners = self._listeners
            if listeners is None:
                listeners = self._listeners = {}
            listeners[token] = listener
        return token

    def remove_listener(self, token: int) -> None:
        """Forget a listener; unknown tokens are ignored (it may have fired already)."""
        if self._first is not None and token == self._first_token:
            self._first = None
        elif self._listeners:
            self._listeners.pop(token, None)
