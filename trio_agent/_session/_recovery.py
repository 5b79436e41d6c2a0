"""Beginning a session's life: new, reopened after a clean close, or recovered after a crash.

Rules
=====

* A session ended for good is refused (`SessionClosedError`); ``history=`` only
  seeds a session with no conversation yet (`ConfigError`).
* A cleanly closed session starts a new life (``session_reopened``); its
  conversation is rebuilt from the journal.
* Permission rule updates the journal holds are replayed into the engine first:
  what recovery re-runs is decided under the session's rules of the last life.
* On every stream still open, the journal's recovery plan is applied: calls it
  allows are re-run live, unknown outcomes are told, and what the crash left open
  (turns, requests, subagents) is closed as interrupted by the restart, except, when
  the opener keeps them (a worker taking a session over), the requests: accepted ones
  stay runnable and started ones go on from their last durable point
  (`Session.serve_request`).
* A re-run call whose permission was durably granted (a person's approval, a handler's or
  hook's allow, or its start) is not asked again (one ask per call): the grant answers the
  table's ask, and the table's denies still hold. A started call runs with the input it
  started with. Any other call's permission is decided, and asked, as live.
* What the model must learn goes to the root's inbox, so it is recorded with its next
  model call: first the inbox notes of the last life no model call took
  (`ConversationFold.undelivered_notes`), then the recovery notes (journalled as
  ``inbox_noted`` per stream, before that stream's open requests are closed, so a later
  life still owes them), then background subagents whose outcome it never saw. The
  recovery notes are read from the journal, so a crash during recovery loses none: the
  re-runs and unknown outcomes of an earlier recovery, in a request it never closed, are
  told again (a note that reads as one still owed is not noted a second time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from .._errors import ConfigError, SessionClosedError, TrioAgentError
from .._journal._conversation import encode_conversation
from .._journal._durable import DurableJournal, RecoveryReport, unknown_outcome_result
from .._journal._events import (
    ConversationSeeded,
    RequestInterrupted,
    RequestInterruptReason,
    SessionReopened,
    SubagentCancelled,
    SubagentCompleted,
    ToolRecoveryAction,
    TurnAborted,
    TurnAbortReason,
)
from .._journal._projection import RequestState, SessionState, ToolState, TurnState
from .._models._messages import Message
from .._permissions._engine import PermissionEngine
from .._permissions._rules import PermissionAllow, PermissionMode, PermissionUpdate, update_from_json
from .._permissions._table import AskNeeded
from .._tools._context import CallOrigin, ToolCall
from .._tools._definition import Tool
from .._tools._results import JsonObject, json_copy
from .._tools._stages import StageDecision, StageRequest, ToolStages
from ._endings import request_is_open
from ._host import SessionHost
from ._requests import _Agent

__all__ = ["Life", "begin_life", "rebuild_history"]


@attrs.define
class Life:
    """Which life this is, and what recovering it did."""

    number: int = 1
    recovery: RecoveryReport | None = None
    notes: list[str] = attrs.Factory(list)


async def begin_life(
    host: SessionHost,
    tools: Mapping[str, Tool[Any]],
    history: Sequence[Message] | None,
    *,
    keep_requests: bool = False,
    subagent_of: Callable[[str, str], _Agent] | None = None,
) -> Life | None:
    """Begin this life of the session (module rules); ``None``: the first life of a session created
    now, with nothing to recover, rebuild or replay. ``subagent_of(agent_id, parent_id)``: the
    subagent of an earlier life with that stream (its allowlist), for re-running its calls."""
    journal = host.journal
    projection = journal.projection()
    state = projection.session_state
    created_now = state is SessionState.OPEN and _only_created(journal)
    if history is None and created_now:
        await _journal_starting_mode(host)
        return None
    if state is SessionState.ENDED:
        raise SessionClosedError(
            f"session {host.session_id!r} was ended for good (session.end()); it can be read "
            "(journal show, read_conversation) but not continued: open a new session id"
        )
    if history is not None:
        if state is not SessionState.OPEN or projection.has_requests or projection._s.seeded:
            raise ConfigError(
                f"history= seeds a new session, but session {host.session_id!r} already has a conversation"
            )
        await journal.append(ConversationSeeded(session_id=host.session_id, conversation=encode_conversation(history)))
    life = Life(number=projection.life)
    if state is SessionState.CLOSED:
        # A new life on the same streams: the conversation is rebuilt from the journal below.
        life.number += 1
        await journal.append(SessionReopened(session_id=host.session_id, life=life.number))
    # The session's rules as the journal holds them before anything runs again: recovery re-runs
    # calls through the live permission stage, which must see the rules of the last life.
    if created_now:
        await _journal_starting_mode(host)  # a new session seeded with history=
    elif host.permissions is not None:
        # The mode too: a session that started in another mode than default journalled it
        # (`_journal_starting_mode`), so one that did not started in default, whatever
        # permission_mode= this open was given.
        replayed = [update_from_json(event.update) for event in journal.projection().permission_updates]
        if replayed or host.permissions.mode is not PermissionMode.DEFAULT:
            host.permissions.replay_updates([PermissionUpdate.set_mode(PermissionMode.DEFAULT), *replayed])
    await _recover(host, tools, life, keep_requests, subagent_of)
    return life


# The decisions that let recovery run a call again, and the ends such a run is told by (an
# outcome_unknown one is told as unknown).
_RERUN_DECISIONS = frozenset({ToolRecoveryAction.RUN, ToolRecoveryAction.RERUN, ToolRecoveryAction.RERUN_SAME_KEY})
_RERUN_ENDS = frozenset({ToolState.COMPLETED, ToolState.FAILED, ToolState.CANCELLED})


async def _journal_starting_mode(host: SessionHost) -> None:
    """A new session's starting mode, journalled as a ``set_mode`` update unless it is the default
    (no event then: a reopen that finds no ``set_mode`` starts from default), so that a reopen
    keeps the mode, whatever ``permission_mode=`` it is given."""
    engine = host.permissions
    if engine is not None and engine.mode is not PermissionMode.DEFAULT:
        await engine.set_mode(engine.mode)


def _granted_stages(host: SessionHost, agent_id: str, call_id: str) -> ToolStages | None:
    """For the re-run of a call whose permission was durably granted (`Projection.permission_granted`):
    a last ``pre_tool`` stage that decides its permission for the permission stage, which asks
    nobody then. ``None`` for any other call: its permission stage decides (and may ask) as live."""
    engine = host.permissions
    journal = host.journal
    if engine is None or not journal.projection(agent_id).permission_granted(call_id):
        return None
    call = journal.call(call_id, agent_id)
    granted = call.started_input if call is not None else None
    if granted is None:  # not started: what its permission answer allowed, if that changed the input
        record = journal.projection(agent_id).tool(call_id)
        granted = record.allowed_input if record is not None else None
    return ToolStages(pre_tool=[_Granted(engine, host.decided, granted).stage])


@attrs.frozen
class _Granted:
    """The permission of a recovery re-run whose call holds a durable grant.

    The call may not be asked again: its one ask was answered (its permission id is the call's,
    and the journal takes one ask per call), or it started, which it did only once let through.
    So the grant answers the ask, but the table is walked again, under the rules the journal
    holds: a deny (a rule added since, plan mode) still denies, as for a person's approval
    (`PermissionEngine.conclude`). A call that started is judged on, and runs with, the input it
    started with: what its grant covered (a handler's edit included), and what a re-run under the
    same idempotency key must repeat. One that did not is judged on the input its answer allowed
    when the answer changed it (``permission_resolved`` records it), never on the model's. The
    decision goes to the permission stage through `SessionHost.decided`, as a continuation's
    approvals do.
    """

    engine: PermissionEngine
    decided: dict[tuple[str, str], StageDecision]
    granted_input: JsonObject | None  # the input it started with, else the one its answer allowed

    async def stage(self, request: StageRequest) -> None:
        tool, context, engine = request.tool, request.context, self.engine
        given = request.input if self.granted_input is None else json_copy(self.granted_input)
        verdict = await engine.evaluate(tool, given, context)
        if isinstance(verdict, AskNeeded):
            verdict = await engine.conclude(tool, verdict, context, PermissionAllow())
        self.decided[context.agent_id, context.tool_call_id] = verdict.to_stage_decision(request.input)


def _only_created(journal: DurableJournal) -> bool:
    """Nothing but ``session_created`` on any stream: nothing to recover, no conversation to
    rebuild, no rules to replay."""
    return all(journal.projection(agent).head == 1 for agent in journal.agents)


async def _recover(
    host: SessionHost,
    tools: Mapping[str, Tool[Any]],
    life: Life,
    keep_requests: bool,
    subagent_of: Callable[[str, str], _Agent] | None,
) -> None:
    """Apply the journal's recovery plan on every stream and re-run what it allows, live."""
    journal = host.journal
    root_id = host.root.agent_id
    # What the root's inbox held when the last life ended, in the order noted: owed first, as it
    # was noted first (`ConversationFold.undelivered_notes`), and not journalled again.
    owed = journal.conversation_fold().undelivered_notes
    if owed:
        host.inbox.setdefault(root_id, []).extend(owed)
    for agent_id in list(journal.agents):
        projection = journal.projection(agent_id)
        if projection.session_state is not SessionState.OPEN:
            continue
        told = len(life.notes)  # the notes of the streams before this one are journalled
        # A subagent never runs again after a restart (its handle died with the process): what
        # it scheduled and never started is cancelled, not started for nobody to read.
        continues = agent_id == host.root.agent_id
        plan = journal.recovery_plan(agent_id, tools=tools, agent_continues=continues)
        if plan.is_empty:
            continue
        # Told from the journal, not from the last process's memory: what an earlier recovery
        # did, in a request it never got to close (the process died again), is still news to
        # the model and the user: a call it settled outcome_unknown, and a call it re-ran to
        # its end (this recovery finds it settled and would not say it was ever re-run).
        earlier: list[str] = []
        for tracked in projection._s.tools.values():
            if not request_is_open(projection, tracked.request_id):
                continue
            if tracked.state is ToolState.OUTCOME_UNKNOWN:
                earlier.append(tracked.call_id)
            elif tracked.decision in _RERUN_DECISIONS and tracked.state in _RERUN_ENDS:
                outcome = "ok" if tracked.state is ToolState.COMPLETED else "error"
                life.notes.append(f"re-ran {tracked.tool_name} call {tracked.call_id}: {outcome}")
        report = await journal.recover(
            agent_id, tools=tools, agent_continues=continues, reconcile_timeout=host.pipeline.timeout
        )
        if earlier:
            merged = tuple(dict.fromkeys([*earlier, *report.outcome_unknown]))
            report = attrs.evolve(report, outcome_unknown=merged)
        if agent_id == host.root.agent_id:
            life.recovery = report
        # Subagents that ran before the restart (not those a re-executed call may start below).
        stale = [
            record for record in journal.projection(agent_id)._s.subagents.values() if record.state.value == "running"
        ]
        # A subagent's calls are re-run under its own allowlist, as its live calls were: the
        # permission stage checks an agent the session knows (one it does not know has no filter).
        stand_in = agent_id not in host.agents and report.to_execute and subagent_of is not None
        if stand_in:
            assert subagent_of is not None
            host.agents[agent_id] = subagent_of(agent_id, host.root.agent_id)
        try:
            for scheduled in report.to_execute:
                origin = CallOrigin(host.session_id, agent_id, scheduled.request_id, scheduled.turn_id)
                try:
                    record = await host.pipeline.execute(
                        ToolCall(scheduled.call_id, scheduled.tool_name, dict(scheduled.model_input)),
                        origin,
                        idempotency_key=scheduled.idempotency_key,
                        stages=_granted_stages(host, agent_id, scheduled.call_id),
                    )
                finally:
                    # Taken by the permission stage, unless an earlier stage ended the call.
                    host.decided.pop((agent_id, scheduled.call_id), None)
                life.notes.append(
                    f"re-ran {scheduled.tool_name} call {scheduled.call_id}: {'ok' if record.result.ok else 'error'}"
                )
        finally:
            if stand_in:
                host.agents.pop(agent_id, None)  # it makes no more calls
        for call_id in report.outcome_unknown:
            call = journal.call(call_id, agent_id)
            name = call.scheduled.tool_name if call is not None else "?"
            life.notes.append(str(unknown_outcome_result(call_id, name).output))
        note = _RECOVERED + "\n".join(life.notes[told:]) if len(life.notes) > told else None
        if note is not None and note not in owed:
            # Journalled (`SessionHost.note`) before this stream's requests are closed below: once
            # they are, no later recovery can tell these again. A crash between the two leaves
            # them open, and the next recovery tells them again: owed already when it reads the
            # same (not noted twice), else told twice, never not at all.
            await host.note(root_id, [note])
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
            keep = keep_requests and agent_id == host.root.agent_id
            if request.state in (RequestState.ACCEPTED, RequestState.STARTED) and not keep:
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
    # From memory (the snapshot the journal loaded plus the events after it), when first needed:
    # the first request, or `Session.messages`. Opening decodes no history.
    host.root.defer_history(journal.deferred_conversation())
    # Background subagents' outcomes the root's model never saw: told from the outcome events
    # (their notes are not journalled, `SubagentSupervisor._report`).
    outcomes = _undelivered_subagent_notes(journal)
    if outcomes:
        host.inbox.setdefault(root_id, []).extend(outcomes)


_RECOVERED = "[session recovered after a restart]\n"


def _undelivered_subagent_notes(journal: DurableJournal) -> list[str]:
    """Background subagents whose outcome was recorded after the last model call of the root
    (so its note never reached the model, e.g. killed by the previous close). A foreground
    subagent's outcome is none of them: its ``task`` call's result told the model (or the call's
    own settlement does, when the request ended first), as in a live session."""
    notes: list[str] = []
    for event in journal.conversation_fold().outcomes_since_reply:
        if isinstance(event, SubagentCompleted):
            answer = _subagent_answer(journal, event.subagent_id)
            notes.append(f"[background subagent {event.subagent_id} completed]: {answer}")
        else:
            notes.append(f"[background subagent {event.subagent_id} cancelled]: {event.reason}")
    return notes


def _subagent_answer(journal: DurableJournal, subagent_id: str) -> str:
    try:
        output = journal.conversation_fold(subagent_id).last_output
    except TrioAgentError:
        return ""
    return str((output or {}).get("text", ""))


async def rebuild_history(journal: DurableJournal, agent_id: str) -> list[Message]:
    """The conversation as the journal tells it (the fold of its stream, kept by the journal)."""
    await trio.lowlevel.checkpoint()
    return journal.conversation(agent_id)
