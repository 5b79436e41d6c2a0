"""Journal errors live in the one hierarchy of `trio_agent._errors`; re-exported here for the journal modules."""

from __future__ import annotations

from .._errors import InvalidTransitionError, JournalCorruptError

__all__ = ["InvalidTransitionError", "JournalCorruptError"]
