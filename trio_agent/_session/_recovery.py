"""Beginning a session's life: new, reopened after a clean close, or recovered after a crash.

Rules
=====

* A session ended for good is refused (`SessionClosedError`); ``history=`` only
  seeds a session with no conversation yet (`ConfigError`).
* A cleanly closed session starts a new life (``session_reopened``); its
  conversation is rebuilt from the journal.
* On every stream still open, the journal's recovery plan is applied: calls it
  allows are re-run live, unknown outcomes are told, and what the crash left open
  (turns, requests, subagents) is closed as interrupted by the restart.
* What the model must learn (recovery notes, background subagents whose outcome it
  never saw) goes to the root's inbox, so it is recorded with its next model call.
* Permission rule updates the journal holds are replayed into the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._errors import ConfigError, SessionClosedError, TrioAgentError
from .._journal._conversation import encode_conversation, fold_conversation
from .._journal._durable import DurableJournal, RecoveryReport, unknown_outcome_result
from .._journal._events import (
    ConversationSeeded,
    ModelAttemptCompleted,
    RequestCompleted,
    RequestInterrupted,
    RequestInterruptReason,
    SessionReopened,
    SubagentCancelled,
    SubagentCompleted,
    TurnAborted,
    TurnAbortReason,
)
from .._journal._projection import RequestState, SessionState, ToolState, TurnState
from .._models._messages import Message
from .._tools._context import CallOrigin, ToolCall
from .._tools._definition import Tool
from ._endings import request_is_open
from ._host import SessionHost
from ._permissions import update_from_json

__all__ = ["Life", "begin_life", "rebuild_history"]


@attrs.define
class Life:
    """Which life this is, and what recovering it did."""

    number: int = 1
    recovery: RecoveryReport | None = None
    notes: list[str] = attrs.Factory(list)


async def begin_life(host: SessionHost, tools: Mapping[str, Tool[Any]], history: Sequence[Message] | None) -> Life:
    """Begin this life of the session (module rules)."""
    journal = host.journal
    projection = journal.projection()
    state = projection.session_state
    if state is SessionState.ENDED:
        raise SessionClosedError(
            f"session {host.session_id!r} was ended for good (session.end()); it can be read "
            "(journal show, read_conversation) but not continued: open a new session id"
        )
    if history is not None:
        if state is not SessionState.OPEN or projection._s.requests or projection._s.seeded:
            raise ConfigError(
                f"history= seeds a new session, but session {host.session_id!r} already has a conversation"
            )
        await journal.append(ConversationSeeded(session_id=host.session_id, conversation=encode_conversation(history)))
    life = Life(number=projection.life)
    if state is SessionState.CLOSED:
        # A new life on the same streams: the conversation is rebuilt from the journal below.
        life.number += 1
        await journal.append(SessionReopened(session_id=host.session_id, life=life.number))
    await _recover(host, tools, life)
    if host.permissions is not None:
        stored = journal.projection().permission_updates
        if stored:
            host.permissions.replay_updates([update_from_json(event.update) for event in stored])
    return life


async def _recover(host: SessionHost, tools: Mapping[str, Tool[Any]], life: Life) -> None:
    """Apply the journal's recovery plan on every stream and re-run what it allows, live."""
    journal = host.journal
    for agent_id in list(journal.agents):
        projection = journal.projection(agent_id)
        if projection.session_state is not SessionState.OPEN:
            continue
        plan = journal.recovery_plan(agent_id, tools=tools)
        if plan.is_empty:
            continue
        # Told from the journal, not from the last process's memory: a call an earlier
        # recovery settled outcome_unknown, in a request that recovery never got to close
        # (the process died again), is still news to the model and the user.
        earlier = [
            call.call_id
            for call in projection._s.tools.values()
            if call.state is ToolState.OUTCOME_UNKNOWN and request_is_open(projection, call.request_id)
        ]
        report = await journal.recover(agent_id, tools=tools)
        if earlier:
            merged = tuple(dict.fromkeys([*earlier, *report.outcome_unknown]))
            report = attrs.evolve(report, outcome_unknown=merged)
        if agent_id == host.root.agent_id:
            life.recovery = report
        # Subagents that ran before the restart (not those a re-executed call may start below).
        stale = [
            record for record in journal.projection(agent_id)._s.subagents.values() if record.state.value == "running"
        ]
        for scheduled in report.to_execute:
            origin = CallOrigin(host.session_id, agent_id, scheduled.request_id, scheduled.turn_id)
            record = await host.pipeline.execute(
                ToolCall(scheduled.call_id, scheduled.tool_name, dict(scheduled.model_input)),
                origin,
                idempotency_key=scheduled.idempotency_key,
            )
            life.notes.append(
                f"re-ran {scheduled.tool_name} call {scheduled.call_id}: {'ok' if record.result.ok else 'error'}"
            )
        for call_id in report.outcome_unknown:
            call = journal.call(call_id, agent_id)
            name = call.scheduled.tool_name if call is not None else "?"
            life.notes.append(str(unknown_outcome_result(call_id, name).output))
        # Close what the crash left open, then rebuild the conversation from the journal.
        projection = journal.projection(agent_id)  # appends may have replaced the object
        for turn in list(projection._s.turns.values()):
            if turn.state is TurnState.OPEN:
                await journal.append(
                    TurnAborted(
                        request_id=turn.request_id, turn_id=turn.turn_id, reason=TurnAbortReason.PROCESS_RESTART
                    ),
                    agent_id=agent_id,
                )
        for request in list(projection._s.requests.values()):
            if request.state in (RequestState.ACCEPTED, RequestState.STARTED):
                await journal.append(
                    RequestInterrupted(request_id=request.request_id, reason=RequestInterruptReason.PROCESS_RESTART),
                    agent_id=agent_id,
                )
        for subagent in stale:
            if subagent.state.value == "running":
                await journal.append(
                    SubagentCancelled(
                        request_id=subagent.request_id, subagent_id=subagent.subagent_id, reason="process_restart"
                    ),
                    agent_id=agent_id,
                )
    events = [envelope.event for envelope in await journal.store.read(journal.stream_id())]
    host.root.history = fold_conversation(events)
    notes = host.inbox.setdefault(host.root.agent_id, [])
    if life.notes:
        notes.append("[session recovered after a restart]\n" + "\n".join(life.notes))
    notes.extend(await _undelivered_subagent_notes(journal, events))
    if not notes:
        del host.inbox[host.root.agent_id]


async def _undelivered_subagent_notes(journal: DurableJournal, events: Sequence[Any]) -> list[str]:
    """Background subagents whose outcome was recorded after the last model call of the root
    (so its note never reached the model, e.g. killed by the previous close)."""
    last_call = max((i for i, e in enumerate(events) if isinstance(e, ModelAttemptCompleted)), default=-1)
    notes: list[str] = []
    for event in events[last_call + 1 :]:
        if isinstance(event, SubagentCompleted):
            text = await _subagent_answer(journal, event.subagent_id)
            notes.append(f"[background subagent {event.subagent_id} completed]: {text}")
        elif isinstance(event, SubagentCancelled):
            notes.append(f"[background subagent {event.subagent_id} cancelled]: {event.reason}")
    return notes


async def _subagent_answer(journal: DurableJournal, subagent_id: str) -> str:
    try:
        events = await journal.store.read(journal.stream_id(subagent_id))
    except TrioAgentError:
        return ""
    answers = [e.event.output for e in events if isinstance(e.event, RequestCompleted) and e.event.output]
    return str(answers[-1].get("text", "")) if answers else ""


async def rebuild_history(journal: DurableJournal, agent_id: str) -> list[Message]:
    """The conversation as the journal tells it (`fold_conversation`)."""
    events = await journal.store.read(journal.stream_id(agent_id))
    return fold_conversation(envelope.event for envelope in events)
