"""How a request, its turn and its tool answers end: one place for each end state.

Rules
=====

* Every started request gets exactly one outcome (completed, failed or
  interrupted), recorded by `record_request_end` and nowhere else: it closes the
  request's running model attempt and open turn in the same append.
* A turn whose tool calls are not all settled is never closed over them: the end
  is not written, and recovery on reopen decides those calls by their contract.
* Nothing is written once the journal is fenced or the lease is lost; the
  session then fails with the journal's typed error, and reopening recovers.
* A projection refusal (`InvalidTransitionError`) is a bug in the caller and is
  raised, never suppressed. A store failure fences the journal (the journal
  does that itself) and is logged.
* The answer the model gets for a tool call is derived from the journal's
  record of its settlement, so the live history and the history rebuilt from
  the journal after a restart are the same.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence

from .._errors import InvalidTransitionError, JournalError, LeaseLostError
from .._journal._conversation import settled_answer
from .._journal._durable import CallRecord, DurableJournal
from .._journal._events import (
    Event,
    ModelAbortReason,
    ModelAttemptAborted,
    TurnAborted,
    TurnAbortReason,
)
from .._journal._projection import Projection, RequestState
from .._models._history import answer_orphan_calls
from .._models._messages import Message, ToolResultMessage
from .._tools._results import ToolResult

__all__ = [
    "answer_for_call",
    "answer_unanswered_calls",
    "closing_events",
    "committed_results",
    "open_items",
    "record_request_end",
    "request_is_open",
]

_log = logging.getLogger("trio_agent.session")

_OPEN = (RequestState.ACCEPTED, RequestState.STARTED)


def request_is_open(projection: Projection, request_id: str) -> bool:
    record = projection.request(request_id)
    return record is not None and record.state in _OPEN


def open_items(projection: Projection) -> list[str]:
    """What is still open on a stream (requests, turn, attempt, unsettled calls, running subagents)."""
    state = projection._s
    items = [f"request {r.request_id}" for r in state.requests.values() if r.state in _OPEN]
    if state.open_turn is not None:
        items.append(f"turn {state.open_turn}")
    if state.running_attempt is not None:
        items.append(f"model attempt {state.running_attempt}")
    items.extend(f"tool call {t.call_id}" for t in state.tools.values() if not t.state.settled)
    items.extend(f"subagent {a.subagent_id}" for a in state.subagents.values() if a.state.value == "running")
    return items


def closing_events(projection: Projection, request_id: str, reason: TurnAbortReason) -> list[Event] | None:
    """The events that close the request's running attempt and open turn, or ``None`` when
    a tool call of that turn is unsettled (the turn must stay open for recovery)."""
    state = projection._s
    turn_id = state.open_turn
    if turn_id is None or state.turns[turn_id].request_id != request_id:
        return []
    if state.unsettled.get(turn_id):
        return None
    events: list[Event] = []
    attempt_id = state.running_attempt
    if attempt_id is not None and state.attempts[attempt_id].turn_id == turn_id:
        events.append(
            ModelAttemptAborted(
                request_id=request_id,
                turn_id=turn_id,
                attempt_id=attempt_id,
                reason=ModelAbortReason.REQUEST_INTERRUPTED,
            )
        )
    events.append(TurnAborted(request_id=request_id, turn_id=turn_id, reason=reason))
    return events


async def record_request_end(
    journal: DurableJournal,
    agent_id: str,
    request_id: str,
    terminal: Event,
    *,
    turn_reason: TurnAbortReason = TurnAbortReason.REQUEST_INTERRUPTED,
) -> bool:
    """Append *terminal* (with what closes the open turn) if the request is still open.

    Returns whether it was written. The caller bounds it (a shielded clean-up
    scope when it runs after a cancellation).
    """
    if journal.lost or journal.fenced or journal.closed:
        return False
    projection = journal.projection(agent_id)
    if not request_is_open(projection, request_id):
        return False
    closing = closing_events(projection, request_id, turn_reason)
    if closing is None:
        _log.warning(
            "request %s of agent %s has unsettled tool calls; its end is left to recovery on reopen",
            request_id,
            agent_id,
        )
        return False
    try:
        await journal.append(*closing, terminal, agent_id=agent_id)
    except InvalidTransitionError:
        raise
    except (JournalError, LeaseLostError) as exc:
        _log.warning("could not record the end of request %s: %s", request_id, exc)
        return False
    return True


def answer_unanswered_calls(
    journal: DurableJournal, agent_id: str, history: Sequence[Message], awaiting: Collection[str]
) -> list[Message]:
    """*history* with every tool call still unanswered (but those in *awaiting*, a pause's) answered
    as the journal answers it, else with the orphan answer: for a request that ended without its
    run answering its calls (a continuation that failed or was cancelled after the journal took
    its answers, before the tool phase: a person's rejection, a refused call of the paused reply).
    The journal's answer wins, so the next request's model reads what a reopen would rebuild."""
    answered = answer_orphan_calls(history, awaiting=awaiting)
    if len(answered) == len(history):
        return answered  # the usual end: nothing was left unanswered
    before = {message.tool_call_id for message in history if isinstance(message, ToolResultMessage)}
    added = [m.tool_call_id for m in answered if isinstance(m, ToolResultMessage) and m.tool_call_id not in before]
    try:
        known = journal.conversation_fold(agent_id).answers(added)
    except JournalError as exc:  # a stored payload it cannot read: the orphan answers stand
        _log.warning("the journal's answers of calls %s could not be read: %s", ", ".join(added), exc)
        return answered
    if not known:
        return answered
    return [
        known.get(m.tool_call_id, m) if isinstance(m, ToolResultMessage) and m.tool_call_id not in before else m
        for m in answered
    ]


def answer_for_call(call_id: str, record: CallRecord | None) -> ToolResultMessage | None:
    """The model's answer for a call as the journal records its settlement (``None``: no answer)."""
    return None if record is None else settled_answer(record.settlement)


def committed_results(journal: DurableJournal, agent_id: str, call_ids: Iterable[str]) -> Mapping[str, ToolResult]:
    """The committed results (completed or failed) of *call_ids*, by call id."""
    results: dict[str, ToolResult] = {}
    for call_id in call_ids:
        record = journal.call(call_id, agent_id)
        if record is not None and (result := record.result) is not None:
            results[call_id] = result
    return results
