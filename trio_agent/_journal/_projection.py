"""The projection: a pure state machine over the events of one agent stream.

Sans-I/O in the style of h11: no store, no Trio, no clock. A store feeds it
envelopes; `Projection.check` says whether one may be appended, `apply` applies
it, `recovery_plan` says what is unfinished.

Rules
=====

Everything that decides a transition lives in this file, in the tables
``_SESSION``, ``_REQUEST``, ``_TURN``, ``_ATTEMPT``, ``_TOOL``, ``_PERMISSION``,
``_SUBAGENT`` and ``_TOOL_DECISIONS`` plus a few guards in the handlers:

* Envelopes: same ``stream_id`` as the projection, ``schema_version`` known,
  ``seq`` = head + 1 (gapless, strictly increasing from 1).
* Session: ``session_created`` is the first event and happens once.
  ``session_closed`` ends a life: nothing but ``session_reopened`` may follow it,
  and nothing at all if it was ``final`` (ended for good). ``session_reopened``
  starts life n + 1 (``life`` = 2, 3 ...) on the same stream.
* Conversation: ``conversation_seeded`` only while the session is open, before
  any request, and once.
* Request: accepted -> started -> completed | failed | interrupted | paused;
  accepted -> failed | interrupted. At most one request is started and not
  ended. A request cannot end while one of its turns is open. ``run_paused``
  keeps where it paused (`Projection.pause`) until ``interrupts_resolved``
  moves it to resumed; its state must decode as a paused state (`pause_from_json`: it
  is read back on every reopen, and one that does not would leave the session
  stuck paused), also in a restored snapshot; that event names the continuation, which must be the
  started request, and it is accepted once: a replayed continuation is refused.
  ``prompt_submitted`` only for the started request, before its first turn.
* Turn: started (its request is the started one, no other turn open, numbers
  1, 2, 3 ... per request) -> completed | aborted. A turn cannot end while a
  model attempt of it runs or one of its tools is unsettled.
* Forgetting: when a request ends (completed, failed, interrupted, resumed) its
  turns and model attempts are dropped from the state: nothing can refer to them
  again (a late event of one is refused as of an unknown turn or attempt), and the
  live state, so what a reopen decodes, stays the size of what is live. Turn and
  attempt ids are unique among the live ones. The request's record moves from
  ``requests`` (the live ones) to ``ended``, and its calls (all settled) from
  ``tools`` to ``ended_tools``, where they stay so their ids are never reused (a
  snapshot keeps both as text, decoded only when an id may be in it). The
  recovery plan covers the live requests' calls.
* Model attempt: started (in the open turn, no other attempt running) ->
  completed | failed | aborted.
* Tool call: scheduled (in the open turn) -> started -> completed | failed |
  cancelled | outcome_unknown; scheduled -> failed | cancelled. Never completed
  (nor outcome_unknown) without a start; nothing after settlement.
  ``tool_started`` needs no pending, denied or cancelled permission; a second
  ``tool_started`` is only allowed after a recovery decision to re-run. The
  start's side effect (that of the final input) replaces the scheduled one,
  wider or narrower: recovery judges what was started.
* Permission: requested (call scheduled, not started, none pending) ->
  resolved (same permission id) with allow | deny | cancel; at most one per call, so a
  recovery re-run of a call that holds a grant (`Projection.permission_granted`) is not
  asked again.
* Recovery decision: only for an unsettled call and only the action its state
  and side effect allow (``_TOOL_DECISIONS``): never a re-run of a started
  ``non_idempotent`` call.
* Subagent: started (its request is started) -> completed | cancelled.
* Permission update: accepted at any time while the session is open, kept in
  order (`Projection.permission_updates`) for replay into the engine on reopen.
* Every event must carry the correlation ids of what it refers to (a tool
  event's request and turn are the ones it was scheduled in, and so on).

Invalid events raise `InvalidTransitionError` before anything is changed: each
handler validates first and changes the state only after every check passed (and
only when applying: `Projection.check` runs the same handler without the change).

The whole state is one attrs value (``_State``): a stream's snapshot (`_snapshot`)
keeps it as it is, and `Projection.restored` takes it back, so a projection restored
at seq N and fed N+1 ... M is the projection of 1 ... M.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import attrs

from .._builders import constructor
from .._lifecycle._interrupts import pause_from_json
from .._loop._interrupts import InterruptResumeError
from .._tools._definition import SideEffect
from ._errors import InvalidTransitionError, JournalCorruptError
from ._events import (
    SCHEMA_VERSION,
    ConversationSeeded,
    Event,
    EventEnvelope,
    InboxNoted,
    InterruptsResolved,
    ModelAbortReason,
    ModelAttemptAborted,
    ModelAttemptCompleted,
    ModelAttemptFailed,
    ModelAttemptStarted,
    PermissionDecision,
    PermissionRequested,
    PermissionResolved,
    PermissionUpdated,
    PromptSubmitted,
    RecoveryDecision,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    RunPaused,
    SessionClosed,
    SessionCreated,
    SessionReopened,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolRecoveryAction,
    ToolScheduled,
    ToolStarted,
    TurnAborted,
    TurnAbortReason,
    TurnCompleted,
    TurnStarted,
    event_type_name,
)

__all__ = [
    "AttemptState",
    "PermissionState",
    "Projection",
    "RecoveryItem",
    "RecoveryKind",
    "RecoveryPlan",
    "RequestState",
    "SessionState",
    "SubagentState",
    "ToolState",
    "TurnState",
]


class _Identity(enum.Enum):
    """An enum whose members hash by identity, as they compare: the transition tables are
    looked up with a state per event, and `enum.Enum.__hash__` is a Python call."""

    __hash__ = object.__hash__


class SessionState(_Identity):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"  # this life ended; it may be reopened
    ENDED = "ended"  # ended for good


class RequestState(_Identity):
    ACCEPTED = "accepted"
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    PAUSED = "paused"  # ended waiting for answers; a continuation resumes it
    RESUMED = "resumed"  # a continuation answered it


_ENDED = frozenset(
    {RequestState.COMPLETED, RequestState.FAILED, RequestState.INTERRUPTED, RequestState.RESUMED}
)  # a request in one of these has no live turn or attempt


class TurnState(_Identity):
    OPEN = "open"
    COMPLETED = "completed"
    ABORTED = "aborted"


class AttemptState(_Identity):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


class ToolState(_Identity):
    SCHEDULED = "scheduled"
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    OUTCOME_UNKNOWN = "outcome_unknown"

    @property
    def settled(self) -> bool:
        return self not in (ToolState.SCHEDULED, ToolState.STARTED)


class PermissionState(_Identity):
    NONE = "none"
    PENDING = "pending"
    ALLOWED = "allowed"
    DENIED = "denied"
    CANCELLED = "cancelled"


class SubagentState(_Identity):
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


# ---------------------------------------------------------------- the tables
# (event type, current state or None when the entity does not exist yet) -> next state

_SESSION: dict[tuple[type[Any], SessionState], SessionState] = {
    (SessionCreated, SessionState.NEW): SessionState.OPEN,
    (SessionClosed, SessionState.OPEN): SessionState.CLOSED,  # ENDED when final
    (SessionReopened, SessionState.CLOSED): SessionState.OPEN,
}

_REQUEST: dict[tuple[type[Any], RequestState | None], RequestState] = {
    (RequestAccepted, None): RequestState.ACCEPTED,
    (RequestStarted, RequestState.ACCEPTED): RequestState.STARTED,
    (RequestCompleted, RequestState.STARTED): RequestState.COMPLETED,
    (RequestFailed, RequestState.ACCEPTED): RequestState.FAILED,
    (RequestFailed, RequestState.STARTED): RequestState.FAILED,
    (RequestInterrupted, RequestState.ACCEPTED): RequestState.INTERRUPTED,
    (RequestInterrupted, RequestState.STARTED): RequestState.INTERRUPTED,
    (RunPaused, RequestState.STARTED): RequestState.PAUSED,
    (InterruptsResolved, RequestState.PAUSED): RequestState.RESUMED,
}

_TURN: dict[tuple[type[Any], TurnState | None], TurnState] = {
    (TurnStarted, None): TurnState.OPEN,
    (TurnCompleted, TurnState.OPEN): TurnState.COMPLETED,
    (TurnAborted, TurnState.OPEN): TurnState.ABORTED,
}

_ATTEMPT: dict[tuple[type[Any], AttemptState | None], AttemptState] = {
    (ModelAttemptStarted, None): AttemptState.RUNNING,
    (ModelAttemptCompleted, AttemptState.RUNNING): AttemptState.COMPLETED,
    (ModelAttemptFailed, AttemptState.RUNNING): AttemptState.FAILED,
    (ModelAttemptAborted, AttemptState.RUNNING): AttemptState.ABORTED,
}

_TOOL: dict[tuple[type[Any], ToolState | None], ToolState] = {
    (ToolScheduled, None): ToolState.SCHEDULED,
    (ToolStarted, ToolState.SCHEDULED): ToolState.STARTED,
    (ToolStarted, ToolState.STARTED): ToolState.STARTED,  # only after a re-run decision (guard)
    (ToolCompleted, ToolState.STARTED): ToolState.COMPLETED,
    (ToolFailed, ToolState.SCHEDULED): ToolState.FAILED,
    (ToolFailed, ToolState.STARTED): ToolState.FAILED,
    (ToolCancelled, ToolState.SCHEDULED): ToolState.CANCELLED,
    (ToolCancelled, ToolState.STARTED): ToolState.CANCELLED,
    (ToolOutcomeUnknown, ToolState.STARTED): ToolState.OUTCOME_UNKNOWN,
    # Permission events and recovery decisions keep the call's state.
    (PermissionRequested, ToolState.SCHEDULED): ToolState.SCHEDULED,
    (PermissionResolved, ToolState.SCHEDULED): ToolState.SCHEDULED,
    (RecoveryDecision, ToolState.SCHEDULED): ToolState.SCHEDULED,
    (RecoveryDecision, ToolState.STARTED): ToolState.STARTED,
}

_PERMISSION: dict[tuple[type[Any], PermissionState, PermissionDecision | None], PermissionState] = {
    (PermissionRequested, PermissionState.NONE, None): PermissionState.PENDING,
    (PermissionResolved, PermissionState.PENDING, PermissionDecision.ALLOW): PermissionState.ALLOWED,
    (PermissionResolved, PermissionState.PENDING, PermissionDecision.DENY): PermissionState.DENIED,
    (PermissionResolved, PermissionState.PENDING, PermissionDecision.CANCEL): PermissionState.CANCELLED,
}

_SUBAGENT: dict[tuple[type[Any], SubagentState | None], SubagentState] = {
    (SubagentStarted, None): SubagentState.RUNNING,
    (SubagentCompleted, SubagentState.RUNNING): SubagentState.COMPLETED,
    (SubagentCancelled, SubagentState.RUNNING): SubagentState.CANCELLED,
}

_STARTABLE_PERMISSIONS = frozenset({PermissionState.NONE, PermissionState.ALLOWED})

# Read per event: module names, not enum class attributes (`enum.EnumType` has a `__getattr__`).
_OPEN = SessionState.OPEN
_NO_PERMISSION = PermissionState.NONE
_UNSETTLED = (ToolState.SCHEDULED, ToolState.STARTED)

# Which recovery decisions a call may record: (state, side effect of the start) -> allowed.
# For a scheduled call the side effect does not matter (the key uses None).
_TOOL_DECISIONS: dict[tuple[ToolState, SideEffect | None], frozenset[ToolRecoveryAction]] = {
    (ToolState.SCHEDULED, None): frozenset({ToolRecoveryAction.RUN, ToolRecoveryAction.CANCEL}),
    (ToolState.STARTED, SideEffect.PURE): frozenset({ToolRecoveryAction.RERUN}),
    (ToolState.STARTED, SideEffect.IDEMPOTENT): frozenset({ToolRecoveryAction.RERUN_SAME_KEY}),
    (ToolState.STARTED, SideEffect.NON_IDEMPOTENT): frozenset(
        {ToolRecoveryAction.RECONCILE, ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN}
    ),
}
_RERUN_DECISIONS = frozenset({ToolRecoveryAction.RERUN, ToolRecoveryAction.RERUN_SAME_KEY})


# ---------------------------------------------------------------- records


@attrs.define
class RequestRecord:
    request_id: str
    state: RequestState
    seq: int
    turns: int = 0


@attrs.define
class TurnRecord:
    turn_id: str
    request_id: str
    turn: int
    state: TurnState
    seq: int


@attrs.define
class AttemptRecord:
    attempt_id: str
    request_id: str
    turn_id: str
    state: AttemptState
    seq: int


@attrs.define
class ToolRecord:
    call_id: str
    request_id: str
    turn_id: str
    tool_name: str
    side_effect: SideEffect
    idempotency_key: str
    state: ToolState
    seq: int
    started_seq: int | None = None
    permission: PermissionState = PermissionState.NONE
    permission_id: str | None = None
    decision: ToolRecoveryAction | None = None
    rerun_allowed: bool = False
    allowed_input: dict[str, Any] | None = None  # what a permission answer allowed, if it changed the input


@attrs.define
class SubagentRecord:
    subagent_id: str
    request_id: str
    state: SubagentState
    seq: int


@attrs.define
class _State:
    head: int = 0
    session: SessionState = SessionState.NEW
    session_id: str | None = None
    requests: dict[str, RequestRecord] = attrs.Factory(dict)  # accepted, started or paused
    ended: MutableMapping[str, RequestRecord] = attrs.Factory(dict)  # completed, failed, interrupted, resumed
    turns: dict[str, TurnRecord] = attrs.Factory(dict)
    attempts: dict[str, AttemptRecord] = attrs.Factory(dict)
    tools: dict[str, ToolRecord] = attrs.Factory(dict)  # the calls of live requests
    ended_tools: MutableMapping[str, ToolRecord] = attrs.Factory(dict)  # the calls of ended requests
    # Frozen sets and a tuple, replaced on change (rare): a stream holds them all its life, and
    # the empty ones cost nothing (a set or list would be an object of its own for the cyclic GC).
    permission_ids: frozenset[str] = frozenset()
    subagents: dict[str, SubagentRecord] = attrs.Factory(dict)
    active_request: str | None = None
    open_turn: str | None = None
    # Unsettled calls per turn, kept with the tool states so ending a turn need not scan every call.
    unsettled: dict[str, set[str]] = attrs.Factory(dict)
    running_attempt: str | None = None
    # Accepted permission rule changes, in stream order, for replay into the engine on reopen.
    permission_updates: tuple[PermissionUpdated, ...] = ()
    life: int = 0  # 1 after session_created, +1 per session_reopened
    seeded: bool = False
    # Paused requests not answered yet: request id -> where it paused (the run_paused state).
    paused: dict[str, dict[str, Any]] = attrs.Factory(dict)
    approved: frozenset[str] = frozenset()  # calls a person approved (a recovery re-run keeps the approval)


# The records a live request makes (one request, two turns and attempts, a call ...): built
# cheaper (see `_builders`), every field given.
_request_record: Callable[[str, RequestState, int, int], RequestRecord] = constructor(RequestRecord)
_turn_record: Callable[[str, str, int, TurnState, int], TurnRecord] = constructor(TurnRecord)
_attempt_record: Callable[[str, str, str, AttemptState, int], AttemptRecord] = constructor(AttemptRecord)
_new_tool_record: Callable[
    [
        str,
        str,
        str,
        str,
        SideEffect,
        str,
        ToolState,
        int,
        int | None,
        PermissionState,
        str | None,
        ToolRecoveryAction | None,
        bool,
        dict[str, Any] | None,
    ],
    ToolRecord,
] = constructor(ToolRecord)


def _tool_record(event: ToolScheduled, state: ToolState, seq: int) -> ToolRecord:
    return _new_tool_record(
        event.call_id, event.request_id, event.turn_id, event.tool_name, event.side_effect,
        event.idempotency_key, state, seq, None, _NO_PERMISSION, None, None, False, None,
    )  # fmt: skip


# ---------------------------------------------------------------- recovery plan


class RecoveryKind(enum.Enum):
    """Unfinished things, in the order recovery handles them (declaration order is priority)."""

    MODEL_ATTEMPT_WITHOUT_OUTCOME = "model_attempt_without_outcome"
    TOOL_STARTED_WITHOUT_OUTCOME = "tool_started_without_outcome"
    PENDING_PERMISSION = "pending_permission"
    TOOL_SCHEDULED_NOT_STARTED = "tool_scheduled_not_started"
    OPEN_TURN = "open_turn"
    OPEN_REQUEST = "open_request"  # started, no open turn, no terminal event
    REQUEST_NOT_STARTED = "request_not_started"
    RUNNING_SUBAGENT = "running_subagent"

    @property
    def priority(self) -> int:
        return _PRIORITY[self]


_PRIORITY = {kind: index for index, kind in enumerate(RecoveryKind)}


@attrs.frozen(kw_only=True)
class RecoveryItem:
    kind: RecoveryKind
    seq: int
    request_id: str
    turn_id: str | None = None
    attempt_id: str | None = None
    call_id: str | None = None
    tool_name: str | None = None
    side_effect: SideEffect | None = None
    idempotency_key: str | None = None
    permission_id: str | None = None
    subagent_id: str | None = None
    action: ToolRecoveryAction | None = None


@attrs.frozen
class RecoveryPlan:
    """Every unfinished thing of a stream, in priority order, and an action for every tool call
    of a live request.

    ``tool_actions`` covers their settled calls too (``replay_result``); the calls of ended
    requests are all settled and need nothing.
    """

    items: tuple[RecoveryItem, ...]
    tool_actions: Mapping[str, ToolRecoveryAction]

    @property
    def is_empty(self) -> bool:
        return not self.items


def _no_reconcile(tool_name: str) -> bool:
    return False


# ---------------------------------------------------------------- the projection

_MISSING = object()


class Projection:
    """The state of one agent stream, built from its events."""

    __slots__ = ("_s", "stream_id")

    def __init__(self, stream_id: str) -> None:
        if not stream_id:
            raise ValueError("stream_id must be a non-empty string")
        self.stream_id = stream_id
        self._s = _State()

    @classmethod
    def restored(cls, stream_id: str, state: _State) -> Projection:
        """The projection whose state is ``state`` (a snapshot's; it is taken, not copied);
        `JournalCorruptError` if a paused request's state does not decode."""
        for request_id, paused in state.paused.items():
            problem = _paused_state_problem(paused)
            if problem is not None:
                raise JournalCorruptError(f"the paused state of request {request_id!r} {problem}")
        projection = cls(stream_id)
        projection._s = state
        return projection

    # -- reading

    @property
    def head(self) -> int:
        """The sequence number of the last applied event (0 before the first)."""
        return self._s.head

    @property
    def life(self) -> int:
        """Which life of the session the stream is in (1 after ``session_created``)."""
        return self._s.life

    @property
    def session_state(self) -> SessionState:
        return self._s.session

    def tool(self, call_id: str) -> ToolRecord | None:
        return self._s.tools.get(call_id) or self._s.ended_tools.get(call_id)

    def live_tool(self, call_id: str) -> ToolRecord | None:
        """A call of a live request (the ended ones' are all settled and are not looked at)."""
        return self._s.tools.get(call_id)

    def request(self, request_id: str) -> RequestRecord | None:
        return self._s.requests.get(request_id) or self._s.ended.get(request_id)

    def unfinished_requests(self) -> list[RequestRecord]:
        """The requests accepted or started and not ended (a paused one waits: not listed)."""
        return [r for r in self._s.requests.values() if r.state in (RequestState.ACCEPTED, RequestState.STARTED)]

    @property
    def has_requests(self) -> bool:
        """Whether the stream ever took a request."""
        return bool(self._s.requests) or bool(self._s.ended)

    @property
    def permission_updates(self) -> tuple[PermissionUpdated, ...]:
        """Every `PermissionUpdated` of the stream, in order: replay them into the engine on reopen."""
        return self._s.permission_updates

    def snapshot(self) -> object:
        """A deep copy of the whole state; two snapshots compare equal iff the states are equal."""
        return copy.deepcopy(self._s)

    def closing_events(
        self,
        *,
        attempt_reason: ModelAbortReason = ModelAbortReason.REQUEST_INTERRUPTED,
        tool_reason: str = "session_close",
        turn_reason: TurnAbortReason = TurnAbortReason.REQUEST_INTERRUPTED,
        request_reason: RequestInterruptReason = RequestInterruptReason.SESSION_CLOSE,
        subagent_reason: str = "session_close",
    ) -> list[Event]:
        """The events that close what is open on this stream, in an order the rules accept as one batch.

        The running model attempt is aborted; calls that were scheduled but never
        started are cancelled (a pending permission first resolved ``cancel``);
        running subagents are cancelled; the open turn is aborted and every
        accepted or started request interrupted. A *started* call is never closed
        here: its outcome is for recovery to decide by its contract, so its turn
        and request stay open too. Nothing is changed; an empty list when nothing
        is open (or the session is not open).
        """
        s = self._s
        if s.session is not SessionState.OPEN:
            return []
        events: list[Event] = []
        if s.running_attempt is not None:
            attempt = s.attempts[s.running_attempt]
            events.append(
                ModelAttemptAborted(
                    request_id=attempt.request_id,
                    turn_id=attempt.turn_id,
                    attempt_id=attempt.attempt_id,
                    reason=attempt_reason,
                )
            )
        kept_open: set[str] = set()  # turns (and so requests) that a started call keeps open
        for call in s.tools.values():
            if call.state.settled:
                continue
            if call.state is ToolState.STARTED:
                kept_open.add(call.turn_id)
                continue
            ids: dict[str, Any] = {"request_id": call.request_id, "turn_id": call.turn_id, "call_id": call.call_id}
            if call.permission is PermissionState.PENDING:
                assert call.permission_id is not None
                events.append(
                    PermissionResolved(**ids, permission_id=call.permission_id, decision=PermissionDecision.CANCEL)
                )
            events.append(ToolCancelled(**ids, reason=tool_reason))
        for subagent in s.subagents.values():
            if subagent.state is SubagentState.RUNNING:
                events.append(
                    SubagentCancelled(
                        request_id=subagent.request_id, subagent_id=subagent.subagent_id, reason=subagent_reason
                    )
                )
        blocked_request: str | None = None
        if s.open_turn is not None:
            turn = s.turns[s.open_turn]
            if turn.turn_id in kept_open:
                blocked_request = turn.request_id
            else:
                events.append(TurnAborted(request_id=turn.request_id, turn_id=turn.turn_id, reason=turn_reason))
        for request in s.requests.values():
            if request.state in (RequestState.ACCEPTED, RequestState.STARTED) and request.request_id != blocked_request:
                events.append(RequestInterrupted(request_id=request.request_id, reason=request_reason))
        return events

    # -- transitions

    def check(self, envelope: EventEnvelope) -> None:
        """Raise `InvalidTransitionError` if ``envelope`` may not be applied next; change nothing."""
        self._step(envelope, False)

    def apply(self, envelope: EventEnvelope) -> None:
        """Apply ``envelope``, or raise `InvalidTransitionError` and leave the state unchanged."""
        self._step(envelope, True)

    def apply_atomic(self, envelopes: Sequence[EventEnvelope]) -> None:
        """Apply every envelope, or none: on a refusal the state is as before, and it is raised.

        Only what the envelopes can touch is saved first (the records named by their ids,
        and the few scalars), so the cost does not grow with the stream.
        """
        if len(envelopes) == 1:
            self._step(envelopes[0], True)  # one refusal changes nothing: nothing to save
            return
        saved = self._save(envelopes)
        try:
            for envelope in envelopes:
                self._step(envelope, True)
        except BaseException:
            self._restore(saved)
            raise

    _TOUCHED = (
        ("request_id", "requests"),
        ("request_id", "ended"),
        ("turn_id", "turns"),
        ("attempt_id", "attempts"),
        ("call_id", "tools"),
        ("call_id", "ended_tools"),
        ("subagent_id", "subagents"),
    )
    _SCALARS = ("head", "session", "session_id", "active_request", "open_turn", "running_attempt", "life", "seeded")

    def _save(self, envelopes: Sequence[EventEnvelope]) -> dict[str, Any]:
        s = self._s
        records: list[tuple[MutableMapping[str, Any], str, Any]] = []
        unsettled: dict[str, set[str] | None] = {}
        orders: dict[str, list[str]] = {}
        for envelope in envelopes:
            event = envelope.event
            for attribute, table_name in self._TOUCHED:
                key = getattr(event, attribute, None)
                if isinstance(key, str):
                    table: MutableMapping[str, Any] = getattr(s, table_name)
                    record = table.get(key, _MISSING)
                    records.append((table, key, _MISSING if record is _MISSING else copy.copy(record)))
            turn_id = getattr(event, "turn_id", None)
            if isinstance(turn_id, str) and turn_id not in unsettled:
                current = s.unsettled.get(turn_id)
                unsettled[turn_id] = None if current is None else set(current)
            ending = self._ending(event)
            if ending is not None and not orders:  # the live tables' order comes back too
                orders = {name: list(getattr(s, name)) for name in ("requests", "turns", "attempts", "tools")}
            if ending is not None:  # what `_forget` may drop or move comes back on a rollback
                for table in (s.turns, s.attempts, s.tools):
                    for key, record in table.items():
                        if record.request_id == ending:
                            records.append((table, key, copy.copy(record)))
                            if table is s.tools:
                                records.append((s.ended_tools, key, _MISSING))
                for turn_id in [key for key, turn in s.turns.items() if turn.request_id == ending]:
                    if turn_id not in unsettled:
                        current = s.unsettled.get(turn_id)
                        unsettled[turn_id] = None if current is None else set(current)
        return {
            "scalars": {name: getattr(s, name) for name in self._SCALARS},
            "records": records,
            "unsettled": unsettled,
            "permission_ids": s.permission_ids,  # these three are immutable: kept, not copied
            "permission_updates": s.permission_updates,
            "paused": dict(s.paused),
            "approved": s.approved,
            "orders": orders,
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        s = self._s
        for name, value in saved["scalars"].items():
            setattr(s, name, value)
        for table, key, record in reversed(saved["records"]):  # the first saved copy wins
            if record is _MISSING:
                table.pop(key, None)
            else:
                table[key] = record
        for turn_id, calls in saved["unsettled"].items():
            if calls is None:
                s.unsettled.pop(turn_id, None)
            else:
                s.unsettled[turn_id] = calls
        s.permission_ids = saved["permission_ids"]
        s.permission_updates = saved["permission_updates"]
        s.paused = saved["paused"]
        s.approved = saved["approved"]
        for name, order in saved["orders"].items():  # records put back at the end go back in place
            table = getattr(s, name)
            setattr(s, name, {key: table[key] for key in order})

    def _step(self, envelope: EventEnvelope, apply: bool) -> None:
        """Judge ``envelope`` by the rules and, if ``apply``, move the state past it.

        Each handler validates first and changes the state only after every check passed (and
        only when applying): a refusal leaves the state as it was.
        """
        s = self._s
        if envelope.stream_id != self.stream_id:
            raise InvalidTransitionError(
                f"event from stream {envelope.stream_id!r} on stream {self.stream_id!r}", seq=envelope.seq
            )
        if envelope.schema_version != SCHEMA_VERSION:
            raise InvalidTransitionError(f"unknown schema version {envelope.schema_version!r}", seq=envelope.seq)
        if envelope.seq != s.head + 1:
            raise InvalidTransitionError(f"sequence {envelope.seq} does not follow head {s.head}", seq=envelope.seq)
        event = envelope.event
        handler = _HANDLERS.get(type(event))
        if handler is None:  # pragma: no cover - every event type has a handler
            raise InvalidTransitionError(f"no rule for {type(event).__name__}", seq=envelope.seq)
        if s.session is not _OPEN and not isinstance(event, (SessionCreated, SessionReopened)):
            raise self._error(envelope, f"the session is {s.session.value}")
        handler(self, envelope, event, apply)
        if apply:
            s.head = envelope.seq

    @staticmethod
    def _error(envelope: EventEnvelope, message: str) -> InvalidTransitionError:
        return InvalidTransitionError(f"{event_type_name(type(envelope.event))} (seq {envelope.seq}): {message}")

    def _next(self, table: Mapping[Any, Any], key: tuple[Any, ...], envelope: EventEnvelope, what: str) -> Any:
        try:
            return table[key]
        except KeyError:
            raise self._not_allowed(envelope, what, key[1]) from None

    @classmethod
    def _not_allowed(cls, envelope: EventEnvelope, what: str, state: object) -> InvalidTransitionError:
        """The refusal of an event the table has no transition for (the busiest handlers look
        their table up in line; the others use `_next`)."""
        named = state.value if isinstance(state, enum.Enum) else "absent"
        return cls._error(envelope, f"not allowed when {what} is {named}")

    # -- session

    def _session(
        self, envelope: EventEnvelope, event: SessionCreated | SessionClosed | SessionReopened, apply: bool
    ) -> None:
        s = self._s
        new = self._next(_SESSION, (type(event), s.session), envelope, "the session")
        if not isinstance(event, SessionCreated) and event.session_id != s.session_id:
            raise self._error(envelope, f"session {event.session_id!r} is not {s.session_id!r}")
        if isinstance(event, SessionClosed) and event.final:
            new = SessionState.ENDED
        if isinstance(event, SessionReopened) and event.life != s.life + 1:
            raise self._error(envelope, f"life {event.life} does not follow life {s.life}")
        if not apply:
            return
        s.session = new
        if isinstance(event, SessionCreated):
            s.session_id = event.session_id
            s.life = 1
        elif isinstance(event, SessionReopened):
            s.life = event.life

    def _seed(self, envelope: EventEnvelope, event: ConversationSeeded, apply: bool) -> None:
        if self._s.seeded:
            raise self._error(envelope, "the conversation was already seeded")
        if self.has_requests:
            raise self._error(envelope, "a conversation is seeded before any request")
        if apply:
            self._s.seeded = True

    # -- requests

    def _request(
        self,
        envelope: EventEnvelope,
        event: RequestAccepted
        | RequestStarted
        | RequestCompleted
        | RequestFailed
        | RequestInterrupted
        | RunPaused
        | InterruptsResolved,
        apply: bool,
    ) -> None:
        s = self._s
        request_id = event.request_id
        # An ended one only to name its state in the refusal (`request`, in line).
        record = s.requests.get(request_id) or s.ended.get(request_id)
        if isinstance(event, InterruptsResolved):
            self._resolved(envelope, event, record, apply)
            return
        state = None if record is None else record.state
        new = _REQUEST.get((type(event), state))
        if new is None:
            raise self._not_allowed(envelope, "the request", state)
        if isinstance(event, RunPaused):
            # Read back by every reopen (`Projection.pause`): refused here, where the stream is
            # read, not later as a continuation that can never be answered. Pauses are rare.
            problem = _paused_state_problem(event.state)
            if problem is not None:
                raise self._error(envelope, f"its state {problem}")
        if isinstance(event, RequestStarted) and s.active_request is not None:
            raise self._error(envelope, f"request {s.active_request!r} is still running")
        if s.open_turn is not None and s.turns[s.open_turn].request_id == request_id:
            raise self._error(envelope, f"turn {s.open_turn!r} of the request is still open")
        if not apply:
            return
        if record is None:
            s.requests[request_id] = _request_record(request_id, new, envelope.seq, 0)
            return
        record.state = new
        if new is RequestState.STARTED:
            s.active_request = request_id
        elif s.active_request == request_id:
            s.active_request = None
        if isinstance(event, RunPaused):
            s.paused[request_id] = event.state
        if new in _ENDED:
            s.ended[request_id] = s.requests.pop(request_id)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        # Only live requests have records here, so these scans do not grow with the stream.
        s = self._s
        for turn in list(s.turns.values()):
            if turn.request_id == request_id:
                del s.turns[turn.turn_id]
                s.unsettled.pop(turn.turn_id, None)
        for attempt in list(s.attempts.values()):
            if attempt.request_id == request_id:
                del s.attempts[attempt.attempt_id]
        for call in list(s.tools.values()):
            if call.request_id == request_id:
                s.ended_tools[call.call_id] = s.tools.pop(call.call_id)
                if call.call_id in s.approved:  # settled for good: its approval has nothing left to do
                    s.approved = s.approved - {call.call_id}
        # A dict emptied by deletions keeps its table; `clear` gives it back (an idle session's
        # live tables are all empty, and thousands of sessions may be idle).
        if not s.requests:
            s.requests.clear()
        if not s.turns:
            s.turns.clear()
        if not s.attempts:
            s.attempts.clear()
        if not s.tools:
            s.tools.clear()
        if not s.unsettled:
            s.unsettled.clear()
        if not s.paused:
            s.paused.clear()

    def _ending(self, event: Event) -> str | None:
        """The request ``event`` may end (so `_forget` its turns and attempts), if any."""
        if isinstance(event, (RequestCompleted, RequestFailed, RequestInterrupted, InterruptsResolved)):
            return event.request_id
        return None

    def _resolved(
        self, envelope: EventEnvelope, event: InterruptsResolved, record: RequestRecord | None, apply: bool
    ) -> None:
        s = self._s
        if record is None or record.state is not RequestState.PAUSED:
            state = "absent" if record is None else record.state.value
            raise self._error(envelope, f"request {event.request_id!r} is {state}, not paused (answered already?)")
        if s.active_request != event.continuation_id:
            raise self._error(envelope, f"the continuation {event.continuation_id!r} is not the started request")
        if not apply:
            return
        record.state = RequestState.RESUMED
        s.paused.pop(event.request_id, None)
        s.approved = s.approved.union(event.approved)
        s.ended[event.request_id] = s.requests.pop(event.request_id)
        self._forget(event.request_id)

    def approved_calls(self) -> frozenset[str]:
        """The calls a person approved by resuming a paused request."""
        return self._s.approved

    def permission_granted(self, call_id: str) -> bool:
        """Whether unsettled call *call_id* holds a durable grant, which answers the ask of a
        recovery re-run (a call is asked at most once: its permission id is the call's): a person
        approved it (`approved_calls`), a handler or hook allowed it (``permission_resolved``
        allow), or it started (nothing starts unless it was let through)."""
        record = self._s.tools.get(call_id)
        if record is None or record.state.settled:
            return False
        return (
            record.state is ToolState.STARTED
            or record.permission is PermissionState.ALLOWED
            or call_id in self._s.approved
        )

    def _prompt(self, envelope: EventEnvelope, event: PromptSubmitted, apply: bool) -> None:
        if self._s.active_request != event.request_id:
            raise self._error(envelope, f"request {event.request_id!r} is not the started request")
        if self._s.requests[event.request_id].turns:
            raise self._error(envelope, f"request {event.request_id!r} already started a turn")

    def pause(self) -> tuple[str, dict[str, Any]] | None:
        """The paused request waiting for answers, if any: (request id, its run_paused state)."""
        if not self._s.paused:
            return None
        request_id = next(reversed(self._s.paused))
        return request_id, self._s.paused[request_id]

    # -- turns

    def _turn(self, envelope: EventEnvelope, event: TurnStarted | TurnCompleted | TurnAborted, apply: bool) -> None:
        s = self._s
        record = s.turns.get(event.turn_id)
        state = None if record is None else record.state
        new = _TURN.get((type(event), state))
        if new is None:
            raise self._not_allowed(envelope, "the turn", state)
        if isinstance(event, TurnStarted):
            if s.active_request != event.request_id:
                raise self._error(envelope, f"request {event.request_id!r} is not the started request")
            if s.open_turn is not None:
                raise self._error(envelope, f"turn {s.open_turn!r} is still open")
            request = s.requests[event.request_id]
            if event.turn != request.turns + 1:
                raise self._error(envelope, f"turn number {event.turn} does not follow {request.turns}")
            if apply:
                s.turns[event.turn_id] = _turn_record(event.turn_id, event.request_id, event.turn, new, envelope.seq)
                request.turns = event.turn
                s.open_turn = event.turn_id
            return
        assert record is not None
        if record.request_id != event.request_id:
            raise self._error(envelope, f"turn {event.turn_id!r} belongs to request {record.request_id!r}")
        if s.running_attempt is not None:
            raise self._error(envelope, f"model attempt {s.running_attempt!r} is still running")
        unsettled = s.unsettled.get(event.turn_id)
        if unsettled:
            raise self._error(envelope, f"tool calls {sorted(unsettled)} are not settled")
        if apply:
            record.state = new
            s.open_turn = None

    def _require_open_turn(self, envelope: EventEnvelope, request_id: str, turn_id: str) -> None:
        if self._s.open_turn != turn_id:
            raise self._error(envelope, f"turn {turn_id!r} is not the open turn")
        if self._s.turns[turn_id].request_id != request_id:
            raise self._error(envelope, f"turn {turn_id!r} does not belong to request {request_id!r}")

    # -- model attempts

    def _attempt(
        self,
        envelope: EventEnvelope,
        event: ModelAttemptStarted | ModelAttemptCompleted | ModelAttemptFailed | ModelAttemptAborted,
        apply: bool,
    ) -> None:
        s = self._s
        record = s.attempts.get(event.attempt_id)
        state = None if record is None else record.state
        new = _ATTEMPT.get((type(event), state))
        if new is None:
            raise self._not_allowed(envelope, "the model attempt", state)
        if record is None:
            self._require_open_turn(envelope, event.request_id, event.turn_id)
            if s.running_attempt is not None:
                raise self._error(envelope, f"model attempt {s.running_attempt!r} is still running")
            if apply:
                s.attempts[event.attempt_id] = _attempt_record(
                    event.attempt_id, event.request_id, event.turn_id, new, envelope.seq
                )
                s.running_attempt = event.attempt_id
            return
        if record.request_id != event.request_id or record.turn_id != event.turn_id:
            raise self._error(envelope, f"model attempt {event.attempt_id!r} belongs to another request or turn")
        if apply:
            record.state = new
            s.running_attempt = None

    # -- tools, permissions and recovery decisions

    def _tool(
        self,
        envelope: EventEnvelope,
        event: ToolScheduled
        | ToolStarted
        | ToolCompleted
        | ToolFailed
        | ToolCancelled
        | ToolOutcomeUnknown
        | PermissionRequested
        | PermissionResolved
        | RecoveryDecision,
        apply: bool,
    ) -> None:
        s = self._s
        # An ended one only to name its state in the refusal (`tool`, in line).
        record = s.tools.get(event.call_id) or s.ended_tools.get(event.call_id)
        state = None if record is None else record.state
        new = _TOOL.get((type(event), state))
        if new is None:
            raise self._not_allowed(envelope, "the call", state)
        if record is None:
            assert isinstance(event, ToolScheduled)
            self._require_open_turn(envelope, event.request_id, event.turn_id)
            if apply:
                calls = s.unsettled.get(event.turn_id)
                if calls is None:
                    s.unsettled[event.turn_id] = {event.call_id}
                else:
                    calls.add(event.call_id)
                s.tools[event.call_id] = _tool_record(event, new, envelope.seq)
            return
        if record.request_id != event.request_id or record.turn_id != event.turn_id:
            raise self._error(envelope, f"call {event.call_id!r} belongs to another request or turn")
        permission = record.permission
        decision = record.decision
        rerun_allowed = record.rerun_allowed
        side_effect = record.side_effect
        if isinstance(event, ToolStarted):
            if record.state is ToolState.STARTED and not record.rerun_allowed:
                raise self._error(envelope, "the call was already started and no re-run was decided")
            if permission not in _STARTABLE_PERMISSIONS:
                raise self._error(envelope, f"the call's permission is {permission.value}")
            # The start's contract replaces the scheduled one, wider or narrower: middleware may
            # transform the input (spec), and recovery must judge the side effect that was started.
            side_effect = event.side_effect
            rerun_allowed = False
        elif isinstance(event, PermissionRequested):
            permission = self._next(
                _PERMISSION, (PermissionRequested, record.permission, None), envelope, "the call's permission"
            )
            if event.permission_id in s.permission_ids:
                raise self._error(envelope, f"permission id {event.permission_id!r} was already used")
        elif isinstance(event, PermissionResolved):
            permission = self._next(
                _PERMISSION, (PermissionResolved, record.permission, event.decision), envelope, "the call's permission"
            )
            if event.permission_id != record.permission_id:
                raise self._error(envelope, f"permission {event.permission_id!r} is not the pending one")
        elif isinstance(event, RecoveryDecision):
            key_effect = None if record.state is ToolState.SCHEDULED else record.side_effect
            allowed = _TOOL_DECISIONS.get((record.state, key_effect), frozenset())
            if event.decision not in allowed:
                raise self._error(
                    envelope,
                    f"{event.decision.value} is not allowed for a {record.state.value} {record.side_effect.value} call",
                )
            if event.decision is ToolRecoveryAction.RUN and permission not in _STARTABLE_PERMISSIONS:
                raise self._error(envelope, f"the call's permission is {permission.value}")
            decision = event.decision
            rerun_allowed = event.decision in _RERUN_DECISIONS
        if not apply:
            return
        record.state = new
        if new not in _UNSETTLED:
            calls = s.unsettled.get(record.turn_id)
            if calls is not None:
                calls.discard(record.call_id)
        record.permission = permission
        record.decision = decision
        record.rerun_allowed = rerun_allowed
        record.side_effect = side_effect
        if isinstance(event, ToolStarted):
            record.started_seq = envelope.seq
        elif isinstance(event, PermissionRequested):
            record.permission_id = event.permission_id
            s.permission_ids = s.permission_ids | {event.permission_id}
        elif isinstance(event, PermissionResolved) and event.decision is PermissionDecision.ALLOW:
            record.allowed_input = event.input

    # -- permission rule changes

    def _permission_update(self, envelope: EventEnvelope, event: PermissionUpdated, apply: bool) -> None:
        # Accepted at any time while the session is open (checked for every event): a rule can
        # change between requests too (a permission engine or handler outside any call).
        if apply:
            self._s.permission_updates += (event,)

    # -- the inbox

    def _noted(self, envelope: EventEnvelope, event: InboxNoted, apply: bool) -> None:
        # Accepted at any time while the session is open (checked for every event): a note enters
        # the inbox between requests too (a background subagent's report, recovery's notes). What is
        # owed of them is the conversation fold's (`ConversationFold.undelivered_notes`).
        return None

    # -- subagents

    def _subagent(
        self, envelope: EventEnvelope, event: SubagentStarted | SubagentCompleted | SubagentCancelled, apply: bool
    ) -> None:
        s = self._s
        record = s.subagents.get(event.subagent_id)
        new = self._next(_SUBAGENT, (type(event), None if record is None else record.state), envelope, "the subagent")
        if record is None:
            if s.active_request != event.request_id:
                raise self._error(envelope, f"request {event.request_id!r} is not the started request")
            if isinstance(event, SubagentStarted) and event.call_id is not None:
                call = s.tools.get(event.call_id)
                if call is None or call.state is not ToolState.STARTED:
                    raise self._error(envelope, f"call {event.call_id!r} is not running")
            if apply:
                s.subagents[event.subagent_id] = SubagentRecord(event.subagent_id, event.request_id, new, envelope.seq)
            return
        if record.request_id != event.request_id:
            raise self._error(envelope, f"subagent {event.subagent_id!r} belongs to request {record.request_id!r}")
        if apply:
            record.state = new

    # -- recovery

    def recovery_plan(
        self, has_reconcile: Callable[[str], bool] = _no_reconcile, *, agent_continues: bool = True
    ) -> RecoveryPlan:
        """Every unfinished thing in priority order, and the action for every tool call.

        ``has_reconcile(tool_name)`` says whether a tool has a ``reconcile``: a
        started ``non_idempotent`` call without an outcome is reconciled if so,
        else settled ``outcome_unknown``. It is never re-run.

        ``agent_continues=False``: the stream's agent never runs again (a subagent after a
        restart), so a call it scheduled and never started is cancelled, not run: its effect
        never began and no model would read its result. A started call is finished by its
        contract all the same (the world may already hold part of its effect).
        """
        s = self._s
        items: list[RecoveryItem] = []
        actions: dict[str, ToolRecoveryAction] = {}
        for attempt in s.attempts.values():
            if attempt.state is AttemptState.RUNNING:
                items.append(
                    RecoveryItem(
                        kind=RecoveryKind.MODEL_ATTEMPT_WITHOUT_OUTCOME,
                        seq=attempt.seq,
                        request_id=attempt.request_id,
                        turn_id=attempt.turn_id,
                        attempt_id=attempt.attempt_id,
                    )
                )
        for call in s.tools.values():
            action = _tool_action(call, has_reconcile, agent_continues)
            actions[call.call_id] = action
            common: dict[str, Any] = {
                "request_id": call.request_id,
                "turn_id": call.turn_id,
                "call_id": call.call_id,
                "tool_name": call.tool_name,
                "side_effect": call.side_effect,
                "idempotency_key": call.idempotency_key,
                "action": action,
            }
            if call.state is ToolState.STARTED:
                kind = RecoveryKind.TOOL_STARTED_WITHOUT_OUTCOME
                items.append(RecoveryItem(kind=kind, seq=call.started_seq or call.seq, **common))
            elif call.state is ToolState.SCHEDULED:
                if call.permission is PermissionState.PENDING:
                    items.append(
                        RecoveryItem(
                            kind=RecoveryKind.PENDING_PERMISSION,
                            seq=call.seq,
                            permission_id=call.permission_id,
                            **common,
                        )
                    )
                items.append(RecoveryItem(kind=RecoveryKind.TOOL_SCHEDULED_NOT_STARTED, seq=call.seq, **common))
        for turn in s.turns.values():
            if turn.state is TurnState.OPEN:
                items.append(
                    RecoveryItem(
                        kind=RecoveryKind.OPEN_TURN, seq=turn.seq, request_id=turn.request_id, turn_id=turn.turn_id
                    )
                )
        for request in s.requests.values():
            if request.state is RequestState.ACCEPTED:
                items.append(
                    RecoveryItem(kind=RecoveryKind.REQUEST_NOT_STARTED, seq=request.seq, request_id=request.request_id)
                )
            elif request.state is RequestState.STARTED and s.open_turn is None:
                items.append(
                    RecoveryItem(kind=RecoveryKind.OPEN_REQUEST, seq=request.seq, request_id=request.request_id)
                )
        for subagent in s.subagents.values():
            if subagent.state is SubagentState.RUNNING:
                items.append(
                    RecoveryItem(
                        kind=RecoveryKind.RUNNING_SUBAGENT,
                        seq=subagent.seq,
                        request_id=subagent.request_id,
                        subagent_id=subagent.subagent_id,
                    )
                )
        items.sort(key=lambda item: (item.kind.priority, item.seq))
        return RecoveryPlan(tuple(items), actions)


def _tool_action(
    call: ToolRecord, has_reconcile: Callable[[str], bool], agent_continues: bool = True
) -> ToolRecoveryAction:
    if call.state.settled:
        return ToolRecoveryAction.REPLAY_RESULT
    if call.state is ToolState.SCHEDULED:
        if call.permission in (PermissionState.DENIED, PermissionState.CANCELLED) or not agent_continues:
            return ToolRecoveryAction.CANCEL
        return ToolRecoveryAction.RUN
    if call.side_effect is SideEffect.PURE:
        return ToolRecoveryAction.RERUN
    if call.side_effect is SideEffect.IDEMPOTENT:
        return ToolRecoveryAction.RERUN_SAME_KEY
    if has_reconcile(call.tool_name):
        return ToolRecoveryAction.RECONCILE
    return ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN


_Handler = Callable[[Projection, EventEnvelope, Any, bool], None]

_HANDLERS: dict[type[Any], _Handler] = {
    SessionCreated: Projection._session,
    SessionClosed: Projection._session,
    SessionReopened: Projection._session,
    ConversationSeeded: Projection._seed,
    RequestAccepted: Projection._request,
    RequestStarted: Projection._request,
    RequestCompleted: Projection._request,
    RequestFailed: Projection._request,
    RequestInterrupted: Projection._request,
    RunPaused: Projection._request,
    PromptSubmitted: Projection._prompt,
    InterruptsResolved: Projection._request,
    TurnStarted: Projection._turn,
    TurnCompleted: Projection._turn,
    TurnAborted: Projection._turn,
    ModelAttemptStarted: Projection._attempt,
    ModelAttemptCompleted: Projection._attempt,
    ModelAttemptFailed: Projection._attempt,
    ModelAttemptAborted: Projection._attempt,
    ToolScheduled: Projection._tool,
    ToolStarted: Projection._tool,
    ToolCompleted: Projection._tool,
    ToolFailed: Projection._tool,
    ToolCancelled: Projection._tool,
    ToolOutcomeUnknown: Projection._tool,
    PermissionRequested: Projection._tool,
    PermissionResolved: Projection._tool,
    RecoveryDecision: Projection._tool,
    PermissionUpdated: Projection._permission_update,
    InboxNoted: Projection._noted,
    SubagentStarted: Projection._subagent,
    SubagentCompleted: Projection._subagent,
    SubagentCancelled: Projection._subagent,
}


def _paused_state_problem(state: object) -> str | None:
    """What keeps a ``run_paused`` state from decoding (`pause_from_json`), or ``None``."""
    try:
        pause_from_json(state)
    except InterruptResumeError as exc:
        return "does not decode: " + "; ".join(issue.message for issue in exc.issues)
    return None
