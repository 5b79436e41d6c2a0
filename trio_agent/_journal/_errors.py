"""Errors of the journal core; both are `JournalError` subclasses."""

from __future__ import annotations

from .._errors import JournalError

__all__ = ["InvalidTransitionError", "JournalCorruptError"]


class JournalCorruptError(JournalError):
    """Durable data cannot be decoded: unknown field, missing id, bad enum or unknown schema version."""


class InvalidTransitionError(JournalError):
    """An event is not allowed in the projection's current state; nothing was applied.

    ``seq`` is the rejected envelope's sequence number.
    """

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq
