"""Routed subagent persistence: how a chat middleware stores the subagent runs a session routes work to.

A middleware that wants them sets its ``routed_subagent_persistence`` attribute to an
object with async ``start``, ``chunk``, ``finish`` and ``abort``; the session's subagent
supervisor calls it for every foreground and background subagent it starts (an app
never calls it).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from .._loop._events import RunEvent

__all__ = ["RoutedSubagentPersistence", "SubagentRunInfo", "SubagentRunResult"]


@attrs.frozen
class SubagentRunInfo:
    """One run of a subagent, as routed persistence sees it."""

    session_id: str
    subagent_id: str
    name: str
    parent_agent_id: str
    parent_request_id: str
    request_id: str  # the subagent's own request (its run id)
    prompt: str
    background: bool
    call_id: str | None  # the parent's ``task`` call, if a tool started it


@attrs.frozen
class SubagentRunResult:
    """How a subagent run that completed ended."""

    text: str
    stop_reason: str
    turns: int


@runtime_checkable
class RoutedSubagentPersistence(Protocol):
    """Stores the subagent runs a session routes work to. Set it as the
    ``routed_subagent_persistence`` attribute of a chat middleware given to
    ``define_agent(lifecycle=[...])``; the session calls it, an app never does."""

    async def start(self, info: SubagentRunInfo) -> None: ...

    async def chunk(self, info: SubagentRunInfo, event: RunEvent) -> None: ...

    async def finish(self, info: SubagentRunInfo, result: SubagentRunResult) -> None: ...

    async def abort(self, info: SubagentRunInfo, reason: str) -> None: ...
