"""Helpers shared by the session test modules: run a request, read a stream, pick messages."""

from __future__ import annotations

from typing import Any

import trio

from trio_agent import DoneEvent, SessionEvent
from trio_agent.models import ModelRequest, ToolResultMessage, UserMessage


async def stream_events(session: Any, agent_id: str | None = None) -> list[Any]:
    """The durable events of one agent's stream (the root's by default)."""
    return [envelope.event for envelope in await session.journal.store.read(session.journal.stream_id(agent_id))]


async def run_request(session: Any, prompt: str) -> tuple[list[SessionEvent], DoneEvent]:
    """Stream one request to its end; every event, and the final `DoneEvent`."""
    seen: list[SessionEvent] = []
    async with session.stream(prompt) as events:
        async for event in events:
            seen.append(event)
    done = seen[-1]
    assert isinstance(done, DoneEvent)
    return seen, done


def results(request: ModelRequest) -> list[ToolResultMessage]:
    return [m for m in request.messages if isinstance(m, ToolResultMessage)]


def user_texts(request: ModelRequest) -> list[str]:
    return [m.content for m in request.messages if isinstance(m, UserMessage)]


def all_tasks() -> list[trio.lowlevel.Task]:
    """Every task of the running Trio run, walked from the root task."""
    tasks, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        tasks.append(task)
        todo.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return tasks
