"""The projection: every transition rule, property tests over event sequences, the recovery plan."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_agent._journal._errors import InvalidTransitionError, JournalCorruptError
from trio_agent._journal._events import (
    ErrorInfo,
    EventEnvelope,
    ModelAbortReason,
    ModelAttemptAborted,
    ModelAttemptCompleted,
    ModelAttemptFailed,
    ModelAttemptStarted,
    OutcomeUnknownReason,
    PermissionDecision,
    PermissionRequested,
    PermissionResolved,
    PermissionUpdated,
    RecoveryDecision,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    SessionClosed,
    SessionCloseReason,
    SessionCreated,
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
    decode_event,
    encode_event,
)
from trio_agent._journal._projection import (
    PermissionState,
    Projection,
    RecoveryKind,
    RequestState,
    SessionState,
    ToolState,
)
from trio_agent._tools._definition import InterruptBehavior, SideEffect, ToolKind

STREAM = "root"
RT = {"request_id": "r1", "turn_id": "t1"}


def env(event: Any, seq: int, stream: str = STREAM, version: int = 1) -> EventEnvelope:
    return EventEnvelope(stream_id=stream, seq=seq, event=event, schema_version=version, recorded_at=float(seq))


class Stream:
    """Applies events with consecutive sequence numbers."""

    def __init__(self) -> None:
        self.p = Projection(STREAM)
        self.log: list[EventEnvelope] = []

    def next_env(self, event: Any) -> EventEnvelope:
        return env(event, self.p.head + 1)

    def add(self, *events: Any) -> Stream:
        for event in events:
            envelope = self.next_env(event)
            self.p.apply(envelope)
            self.log.append(envelope)
        return self

    def reject(self, event: Any, match: str | None = None) -> InvalidTransitionError:
        before = self.p.snapshot()
        head = self.p.head
        with pytest.raises(InvalidTransitionError, match=match) as info:
            self.p.check(self.next_env(event))
        with pytest.raises(InvalidTransitionError, match=match):
            self.p.apply(self.next_env(event))
        assert self.p.snapshot() == before
        assert self.p.head == head
        return info.value


def scheduled(call_id: str = "c1", side_effect: SideEffect = SideEffect.PURE, tool: str = "tool", **ids: str) -> Any:
    return ToolScheduled(
        **(ids or RT),
        call_id=call_id,
        tool_name=tool,
        model_input={"x": 1},
        side_effect=side_effect,
        kind=ToolKind.READONLY,
        interrupt=InterruptBehavior.CANCEL,
        concurrency_safe=True,
        idempotency_key=f"key-{call_id}",
    )


def started(call_id: str = "c1", side_effect: SideEffect = SideEffect.PURE, **ids: str) -> Any:
    return ToolStarted(**(ids or RT), call_id=call_id, input={"x": 2}, side_effect=side_effect)


def completed(call_id: str = "c1") -> Any:
    return ToolCompleted(**RT, call_id=call_id, result={"ok": True})


def failed(call_id: str = "c1") -> Any:
    return ToolFailed(**RT, call_id=call_id, result={"error": "x"})


def cancelled(call_id: str = "c1") -> Any:
    return ToolCancelled(**RT, call_id=call_id, reason="request_interrupted")


def unknown(call_id: str = "c1") -> Any:
    return ToolOutcomeUnknown(**RT, call_id=call_id, reason=OutcomeUnknownReason.PROCESS_RESTART)


def decision(action: ToolRecoveryAction, call_id: str = "c1") -> Any:
    return RecoveryDecision(**RT, call_id=call_id, decision=action, reason="recovery")


def in_turn() -> Stream:
    return Stream().add(
        SessionCreated(session_id="s1", agent_id="root"),
        RequestAccepted(request_id="r1", command_id="cmd1", input={}),
        RequestStarted(request_id="r1"),
        TurnStarted(**RT, turn=1),
    )


# ---------------------------------------------------------------- envelope rules


def test_sequence_must_be_gapless_from_one() -> None:
    p = Projection(STREAM)
    with pytest.raises(InvalidTransitionError, match="sequence 2"):
        p.apply(env(SessionCreated(session_id="s1", agent_id="root"), 2))
    p.apply(env(SessionCreated(session_id="s1", agent_id="root"), 1))
    accepted = RequestAccepted(request_id="r1", command_id="c", input={})
    for seq in (1, 3, 100):
        with pytest.raises(InvalidTransitionError, match="sequence"):
            p.apply(env(accepted, seq))
    p.apply(env(accepted, 2))
    assert p.head == 2


def test_other_stream_and_unknown_version_are_rejected() -> None:
    s = Stream().add(SessionCreated(session_id="s1", agent_id="root"))
    with pytest.raises(InvalidTransitionError, match="stream"):
        s.p.apply(env(RequestStarted(request_id="r1"), 2, stream="other"))
    with pytest.raises(InvalidTransitionError, match="schema version"):
        s.p.apply(env(RequestStarted(request_id="r1"), 2, version=2))
    with pytest.raises(ValueError):
        Projection("")


# ---------------------------------------------------------------- session


def test_session_created_first_and_once() -> None:
    s = Stream()
    assert s.p.session_state is SessionState.NEW
    s.reject(RequestAccepted(request_id="r1", command_id="c", input={}), "session is new")
    s.add(SessionCreated(session_id="s1", agent_id="root"))
    s.reject(SessionCreated(session_id="s1", agent_id="root"), "session is open")


def test_session_closed_is_terminal() -> None:
    s = Stream().add(SessionCreated(session_id="s1", agent_id="root"))
    s.reject(SessionClosed(session_id="other", reason=SessionCloseReason.USER), "session")
    s.add(SessionClosed(session_id="s1", reason=SessionCloseReason.COMPLETED))
    assert s.p.session_state is SessionState.CLOSED
    s.reject(RequestAccepted(request_id="r1", command_id="c", input={}), "closed")
    s.reject(SessionClosed(session_id="s1", reason=SessionCloseReason.USER), "closed")
    s.reject(SessionCreated(session_id="s1", agent_id="root"), "closed")


# ---------------------------------------------------------------- requests and turns


def test_request_lifecycle() -> None:
    s = Stream().add(SessionCreated(session_id="s1", agent_id="root"))
    s.reject(RequestStarted(request_id="r1"), "absent")
    s.add(RequestAccepted(request_id="r1", command_id="c", input={}))
    s.reject(RequestAccepted(request_id="r1", command_id="c", input={}), "accepted")
    s.reject(RequestCompleted(request_id="r1"), "accepted")
    s.add(RequestAccepted(request_id="r2", command_id="c2", input={}), RequestStarted(request_id="r1"))
    s.reject(RequestStarted(request_id="r2"), "still running")
    s.add(RequestCompleted(request_id="r1"))
    assert s.p.request("r1") is not None and s.p.request("r1").state is RequestState.COMPLETED  # type: ignore[union-attr]
    s.reject(RequestFailed(request_id="r1", error=ErrorInfo(message="x")), "completed")
    s.add(RequestStarted(request_id="r2"), RequestFailed(request_id="r2", error=ErrorInfo(message="x")))
    s.add(RequestAccepted(request_id="r3", command_id="c3", input={}))
    s.add(RequestInterrupted(request_id="r3", reason=RequestInterruptReason.USER_ABORT))
    s.reject(RequestStarted(request_id="r3"), "interrupted")


def test_turn_rules() -> None:
    s = Stream().add(
        SessionCreated(session_id="s1", agent_id="root"), RequestAccepted(request_id="r1", command_id="c", input={})
    )
    s.reject(TurnStarted(**RT, turn=1), "not the started request")
    s.add(RequestStarted(request_id="r1"))
    s.reject(TurnStarted(**RT, turn=2), "turn number")
    s.add(TurnStarted(**RT, turn=1))
    s.reject(TurnStarted(request_id="r1", turn_id="t2", turn=2), "still open")
    s.reject(RequestCompleted(request_id="r1"), "still open")
    s.reject(RequestInterrupted(request_id="r1", reason=RequestInterruptReason.USER_ABORT), "still open")
    s.reject(TurnCompleted(request_id="other", turn_id="t1", has_tool_calls=False), "belongs to request")
    s.add(TurnCompleted(**RT, has_tool_calls=False))
    s.reject(TurnAborted(**RT, reason=TurnAbortReason.ERROR), "completed")
    s.reject(TurnStarted(request_id="r1", turn_id="t1", turn=2), "completed")
    s.add(TurnStarted(request_id="r1", turn_id="t2", turn=2))
    s.add(TurnAborted(request_id="r1", turn_id="t2", reason=TurnAbortReason.ERROR))
    s.add(RequestCompleted(request_id="r1"))


def test_an_ended_request_forgets_its_turns_and_attempts() -> None:
    # The state stays the size of what is live: a snapshot (and so a reopen) does not grow with
    # the requests a session has answered. Late events of a forgotten turn or attempt are refused.
    s = in_turn().add(
        ModelAttemptStarted(**RT, attempt_id="a1", model="m"),
        ModelAttemptCompleted(**RT, attempt_id="a1", response={}),
        scheduled(),
        started(),
        completed(),
        TurnCompleted(**RT, has_tool_calls=True),
    )
    assert set(s.p._s.turns) == {"t1"} and set(s.p._s.attempts) == {"a1"} and "t1" in s.p._s.unsettled
    s.add(RequestCompleted(request_id="r1"))
    assert (s.p._s.turns, s.p._s.attempts, s.p._s.unsettled) == ({}, {}, {})
    assert s.p.request("r1") is not None and s.p.tool("c1") is not None  # requests and calls are kept
    s.reject(TurnAborted(**RT, reason=TurnAbortReason.ERROR), "absent")
    s.reject(ModelAttemptCompleted(**RT, attempt_id="a1", response={}), "absent")
    s.reject(completed(), "completed")
    s.reject(RequestAccepted(request_id="r1", command_id="c", input={}), "completed")


def test_a_refused_batch_that_ends_a_request_keeps_the_live_tables_in_their_order() -> None:
    # Equal is not enough: the order carries into snapshots (stable bytes) and recovery plans.
    s = Stream().add(SessionCreated(session_id="s1", agent_id="root"))
    s.add(RequestAccepted(request_id="r0", command_id="c0", input={}))
    s.add(RequestAccepted(request_id="r1", command_id="c1", input={}), RequestStarted(request_id="r1"))
    s.add(TurnStarted(**RT, turn=1))
    for call in ("c1", "c2"):
        s.add(scheduled(call), started(call), completed(call))
    s.add(RequestAccepted(request_id="r2", command_id="c2", input={}), TurnCompleted(**RT, has_tool_calls=True))
    order = {name: list(getattr(s.p._s, name)) for name in ("requests", "turns", "tools")}
    batch = [RequestCompleted(request_id="r1"), RequestStarted(request_id="r1")]
    with pytest.raises(InvalidTransitionError):
        s.p.apply_atomic([env(event, s.p.head + 1 + index) for index, event in enumerate(batch)])
    assert (
        {name: list(getattr(s.p._s, name)) for name in order}
        == order
        == {
            "requests": ["r0", "r1", "r2"],
            "turns": ["t1"],
            "tools": ["c1", "c2"],
        }
    )


def test_a_refused_batch_that_ends_a_request_keeps_its_turns_and_attempts() -> None:
    s = in_turn().add(
        ModelAttemptStarted(**RT, attempt_id="a1", model="m"),
        ModelAttemptCompleted(**RT, attempt_id="a1", response={}),
    )
    before = s.p.snapshot()
    batch = [
        TurnCompleted(**RT, has_tool_calls=False),
        RequestCompleted(request_id="r1"),
        RequestStarted(request_id="r1"),
    ]
    with pytest.raises(InvalidTransitionError, match="completed"):
        s.p.apply_atomic([env(event, s.p.head + 1 + index) for index, event in enumerate(batch)])
    assert s.p.snapshot() == before and set(s.p._s.turns) == {"t1"} and set(s.p._s.attempts) == {"a1"}


def test_turn_cannot_end_with_running_model_attempt_or_unsettled_tools() -> None:
    s = in_turn().add(ModelAttemptStarted(**RT, attempt_id="a1", model="m"))
    s.reject(TurnCompleted(**RT, has_tool_calls=False), "still running")
    s.add(ModelAttemptCompleted(**RT, attempt_id="a1", response={}), scheduled())
    s.reject(TurnCompleted(**RT, has_tool_calls=True), "not settled")
    s.add(started())
    s.reject(TurnAborted(**RT, reason=TurnAbortReason.ERROR), "not settled")
    s.add(completed(), TurnCompleted(**RT, has_tool_calls=True))


def test_model_attempt_rules() -> None:
    s = in_turn()
    s.reject(ModelAttemptCompleted(**RT, attempt_id="a1", response={}), "absent")
    s.reject(ModelAttemptStarted(request_id="r1", turn_id="t9", attempt_id="a1", model="m"), "not the open turn")
    s.add(ModelAttemptStarted(**RT, attempt_id="a1", model="m"))
    s.reject(ModelAttemptStarted(**RT, attempt_id="a2", model="m"), "still running")
    s.reject(ModelAttemptStarted(**RT, attempt_id="a1", model="m"), "running")
    s.add(ModelAttemptFailed(**RT, attempt_id="a1", error=ErrorInfo(message="x")))
    s.reject(ModelAttemptAborted(**RT, attempt_id="a1", reason=ModelAbortReason.STEERING), "failed")
    s.add(ModelAttemptStarted(**RT, attempt_id="a2", model="m"))
    s.add(ModelAttemptAborted(**RT, attempt_id="a2", reason=ModelAbortReason.STEERING))


# ---------------------------------------------------------------- tools


def test_tool_happy_path_and_settled_is_final() -> None:
    s = in_turn().add(scheduled(), started(), completed())
    record = s.p.tool("c1")
    assert record is not None and record.state is ToolState.COMPLETED
    for event in (completed(), failed(), cancelled(), unknown(), started(), scheduled()):
        s.reject(event, "completed")
    s.reject(decision(ToolRecoveryAction.RERUN), "completed")


@pytest.mark.parametrize("settle", [failed, cancelled, unknown, completed])
def test_settlements_from_started(settle: Any) -> None:
    s = in_turn().add(scheduled(), started(), settle())
    assert s.p.tool("c1").state.settled  # type: ignore[union-attr]
    s.reject(settle(), "call is")


@pytest.mark.parametrize("settle", [failed, cancelled])
def test_scheduled_can_fail_or_cancel(settle: Any) -> None:
    in_turn().add(scheduled(), settle())


@pytest.mark.parametrize("settle", [completed, unknown])
def test_never_completed_or_unknown_without_start(settle: Any) -> None:
    in_turn().add(scheduled()).reject(settle(), "scheduled")


def test_tool_needs_open_turn_and_matching_ids() -> None:
    s = in_turn()
    s.reject(started(), "absent")
    s.reject(scheduled(request_id="r1", turn_id="t2"), "not the open turn")
    s.add(scheduled())
    s.reject(scheduled(), "scheduled")
    s.reject(started(request_id="r1", turn_id="t2"), "another request or turn")
    s.add(started())
    s.reject(started(), "already started")


def test_started_side_effect_may_narrow() -> None:
    s = in_turn().add(scheduled(side_effect=SideEffect.IDEMPOTENT))
    s.add(started(side_effect=SideEffect.PURE))
    assert s.p.tool("c1").side_effect is SideEffect.PURE  # type: ignore[union-attr]
    assert s.p.recovery_plan().tool_actions["c1"] is ToolRecoveryAction.RERUN


def test_started_side_effect_may_widen_and_recovery_judges_the_started_one() -> None:
    # Middleware may transform the input (spec); the final input's contract is what was started.
    s = in_turn().add(scheduled(side_effect=SideEffect.PURE))
    assert s.p.recovery_plan().tool_actions["c1"] is ToolRecoveryAction.RUN
    s.add(started(side_effect=SideEffect.NON_IDEMPOTENT))
    assert s.p.tool("c1").side_effect is SideEffect.NON_IDEMPOTENT  # type: ignore[union-attr]
    plan = s.p.recovery_plan()
    assert plan.tool_actions["c1"] is ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN
    (item,) = [i for i in plan.items if i.call_id == "c1"]
    assert item.side_effect is SideEffect.NON_IDEMPOTENT
    assert s.p.recovery_plan(lambda name: True).tool_actions["c1"] is ToolRecoveryAction.RECONCILE


def permission_updated(n: int, call_id: str | None = None, source: str = "tool") -> Any:
    return PermissionUpdated(request_id="r1", source=source, update={"rule": f"allow-{n}"}, call_id=call_id)


def test_permission_updates_are_kept_in_order_while_the_session_is_open() -> None:
    s = Stream()
    s.reject(permission_updated(0), "new")  # nothing before session_created
    s.add(SessionCreated(session_id="s1", agent_id="root"), permission_updated(1, source="permission_engine"))
    s.add(RequestAccepted(request_id="r1", command_id="cmd1", input={}), RequestStarted(request_id="r1"))
    s.add(TurnStarted(**RT, turn=1), scheduled(), started(), permission_updated(2, call_id="c1"), completed())
    s.add(TurnCompleted(**RT, has_tool_calls=True), permission_updated(3, source="handler"))
    assert [u.update["rule"] for u in s.p.permission_updates] == ["allow-1", "allow-2", "allow-3"]
    assert s.p.permission_updates[1].call_id == "c1"
    s.add(SessionClosed(session_id="s1", reason=SessionCloseReason.USER))
    s.reject(permission_updated(4), "closed")
    # Replaying the stream gives the same list (what a reopen hands to the permission engine).
    replayed = Projection(STREAM)
    for envelope in s.log:
        replayed.apply(envelope)
    assert replayed.permission_updates == s.p.permission_updates


def test_a_refused_batch_drops_its_permission_updates() -> None:
    s = in_turn().add(permission_updated(1))
    batch = [env(permission_updated(2), s.p.head + 1), env(completed("nope"), s.p.head + 2)]
    before = s.p.snapshot()
    with pytest.raises(InvalidTransitionError):
        s.p.apply_atomic(batch)
    assert s.p.snapshot() == before
    assert [u.update["rule"] for u in s.p.permission_updates] == ["allow-1"]


def test_permission_rules() -> None:
    s = in_turn().add(scheduled())
    req = PermissionRequested(**RT, call_id="c1", permission_id="p1")
    s.reject(PermissionResolved(**RT, call_id="c1", permission_id="p1", decision=PermissionDecision.ALLOW), "none")
    s.add(req)
    assert s.p.tool("c1").permission is PermissionState.PENDING  # type: ignore[union-attr]
    s.reject(req, "pending")
    s.reject(started(), "pending")
    s.reject(PermissionResolved(**RT, call_id="c1", permission_id="p2", decision=PermissionDecision.ALLOW), "p2")
    s.add(PermissionResolved(**RT, call_id="c1", permission_id="p1", decision=PermissionDecision.ALLOW))
    s.reject(PermissionRequested(**RT, call_id="c1", permission_id="p3"), "allowed")
    s.add(started())
    s.reject(PermissionRequested(**RT, call_id="c1", permission_id="p4"), "started")
    # A permission id is never reused, even by another call.
    s.add(scheduled("c2"))
    s.reject(PermissionRequested(**RT, call_id="c2", permission_id="p1"), "already used")


@pytest.mark.parametrize("verdict", [PermissionDecision.DENY, PermissionDecision.CANCEL])
def test_denied_permission_blocks_start(verdict: PermissionDecision) -> None:
    s = in_turn().add(
        scheduled(),
        PermissionRequested(**RT, call_id="c1", permission_id="p1"),
        PermissionResolved(**RT, call_id="c1", permission_id="p1", decision=verdict),
    )
    s.reject(started(), "permission")
    s.reject(decision(ToolRecoveryAction.RUN), "permission")
    assert s.p.recovery_plan().tool_actions["c1"] is ToolRecoveryAction.CANCEL
    s.add(decision(ToolRecoveryAction.CANCEL), cancelled())


def test_a_durable_grant_is_an_allow_or_a_start_and_a_call_without_one_may_be_asked_on_its_re_run() -> None:
    # Recovery re-runs a call without asking again when it holds a grant (the journal takes one ask
    # per call); a call scheduled with no permission asked yet is asked on its re-run, as live.
    s = in_turn().add(scheduled())
    assert not s.p.permission_granted("c1") and not s.p.permission_granted("nope")
    s.add(decision(ToolRecoveryAction.RUN), PermissionRequested(**RT, call_id="c1", permission_id="c1:permission"))
    assert not s.p.permission_granted("c1")  # pending
    s.add(PermissionResolved(**RT, call_id="c1", permission_id="c1:permission", decision=PermissionDecision.ALLOW))
    assert s.p.permission_granted("c1")
    s.reject(PermissionRequested(**RT, call_id="c1", permission_id="c1:permission"), "allowed")
    s.add(started(), scheduled("c2"), started("c2"))
    assert s.p.permission_granted("c2")  # started without an ask (a rule or the mode let it through)
    s.add(completed("c2"))
    assert not s.p.permission_granted("c2")  # settled: nothing to re-run
    s.add(scheduled("c3"), PermissionRequested(**RT, call_id="c3", permission_id="c3:permission"))
    s.add(PermissionResolved(**RT, call_id="c3", permission_id="c3:permission", decision=PermissionDecision.DENY))
    assert not s.p.permission_granted("c3")


# ---------------------------------------------------------------- recovery decisions


@pytest.mark.parametrize(
    ("side_effect", "allowed"),
    [
        (SideEffect.PURE, {ToolRecoveryAction.RERUN}),
        (SideEffect.IDEMPOTENT, {ToolRecoveryAction.RERUN_SAME_KEY}),
        (SideEffect.NON_IDEMPOTENT, {ToolRecoveryAction.RECONCILE, ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN}),
    ],
)
def test_decisions_for_started_calls(side_effect: SideEffect, allowed: set[ToolRecoveryAction]) -> None:
    for action in ToolRecoveryAction:
        s = in_turn().add(scheduled(side_effect=side_effect), started(side_effect=side_effect))
        if action in allowed:
            s.add(decision(action))
        else:
            s.reject(decision(action), "not allowed")


def test_rerun_decision_allows_exactly_one_more_start() -> None:
    s = in_turn().add(scheduled(side_effect=SideEffect.IDEMPOTENT), started(side_effect=SideEffect.IDEMPOTENT))
    s.reject(started(side_effect=SideEffect.IDEMPOTENT), "no re-run")
    s.add(decision(ToolRecoveryAction.RERUN_SAME_KEY), started(side_effect=SideEffect.IDEMPOTENT))
    s.reject(started(side_effect=SideEffect.IDEMPOTENT), "no re-run")
    s.add(completed())


def test_non_idempotent_started_call_is_never_restarted() -> None:
    ni = SideEffect.NON_IDEMPOTENT
    s = in_turn().add(scheduled(side_effect=ni), started(side_effect=ni))
    s.add(decision(ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN))
    s.reject(started(side_effect=ni), "no re-run")
    s.add(unknown())


def test_decisions_for_scheduled_calls() -> None:
    s = in_turn().add(scheduled())
    for action in (ToolRecoveryAction.RERUN, ToolRecoveryAction.REPLAY_RESULT, ToolRecoveryAction.RECONCILE):
        s.reject(decision(action), "not allowed")
    s.add(decision(ToolRecoveryAction.RUN), started(), completed())


# ---------------------------------------------------------------- subagents


def test_subagent_rules() -> None:
    s = in_turn()
    s.reject(SubagentCompleted(request_id="r1", subagent_id="x"), "absent")
    s.reject(SubagentStarted(request_id="r9", subagent_id="x"), "not the started request")
    s.reject(SubagentStarted(request_id="r1", subagent_id="x", call_id="c1"), "not running")
    s.add(scheduled(), started(), SubagentStarted(request_id="r1", subagent_id="x", call_id="c1"))
    s.reject(SubagentStarted(request_id="r1", subagent_id="x"), "running")
    s.reject(SubagentCompleted(request_id="r2", subagent_id="x"), "belongs to request")
    s.add(SubagentCompleted(request_id="r1", subagent_id="x"))
    s.reject(SubagentCancelled(request_id="r1", subagent_id="x", reason="r"), "completed")
    s.add(
        SubagentStarted(request_id="r1", subagent_id="y"),
        SubagentCancelled(request_id="r1", subagent_id="y", reason="r"),
    )


# ---------------------------------------------------------------- recovery plan


def test_empty_and_finished_streams_have_empty_plans() -> None:
    assert Projection(STREAM).recovery_plan().is_empty
    s = in_turn().add(scheduled(), started(), completed(), TurnCompleted(**RT, has_tool_calls=True))
    s.add(RequestCompleted(request_id="r1"))
    plan = s.p.recovery_plan()
    assert plan.is_empty
    assert plan.tool_actions == {}  # an ended request's calls are all settled: nothing to decide
    assert s.p.tool("c1").state is ToolState.COMPLETED  # type: ignore[union-attr]
    s = in_turn().add(scheduled(), started(), completed())
    assert s.p.recovery_plan().tool_actions == {"c1": ToolRecoveryAction.REPLAY_RESULT}


def test_recovery_plan_priority_order() -> None:
    s = Stream().add(
        SessionCreated(session_id="s1", agent_id="root"),
        RequestAccepted(request_id="r1", command_id="c1", input={}),
        RequestStarted(request_id="r1"),
        RequestAccepted(request_id="r2", command_id="c2", input={}),
        SubagentStarted(request_id="r1", subagent_id="sub"),
        TurnStarted(**RT, turn=1),
        scheduled("waiting"),
        scheduled("asking"),
        PermissionRequested(**RT, call_id="asking", permission_id="p1"),
        scheduled("running", SideEffect.NON_IDEMPOTENT, tool="charge"),
        started("running", SideEffect.NON_IDEMPOTENT),
        scheduled("done"),
        started("done"),
        completed("done"),
        ModelAttemptStarted(**RT, attempt_id="a1", model="m"),
    )
    plan = s.p.recovery_plan(has_reconcile=lambda name: name == "charge")
    kinds = [item.kind for item in plan.items]
    assert kinds == [
        RecoveryKind.MODEL_ATTEMPT_WITHOUT_OUTCOME,
        RecoveryKind.TOOL_STARTED_WITHOUT_OUTCOME,
        RecoveryKind.PENDING_PERMISSION,
        RecoveryKind.TOOL_SCHEDULED_NOT_STARTED,
        RecoveryKind.TOOL_SCHEDULED_NOT_STARTED,
        RecoveryKind.OPEN_TURN,
        RecoveryKind.REQUEST_NOT_STARTED,
        RecoveryKind.RUNNING_SUBAGENT,
    ]
    assert [item.priority for item in (k for k in kinds)] == sorted(k.priority for k in kinds)
    assert plan.items[0].attempt_id == "a1"
    assert plan.items[1].call_id == "running"
    assert plan.items[1].action is ToolRecoveryAction.RECONCILE
    assert plan.items[2].permission_id == "p1"
    assert [item.call_id for item in plan.items[3:5]] == ["waiting", "asking"]
    assert plan.items[6].request_id == "r2"
    assert plan.items[7].subagent_id == "sub"
    assert plan.tool_actions == {
        "waiting": ToolRecoveryAction.RUN,
        "asking": ToolRecoveryAction.RUN,
        "running": ToolRecoveryAction.RECONCILE,
        "done": ToolRecoveryAction.REPLAY_RESULT,
    }


def test_started_request_without_turn_is_listed() -> None:
    s = in_turn().add(TurnCompleted(**RT, has_tool_calls=False))
    assert [item.kind for item in s.p.recovery_plan().items] == [RecoveryKind.OPEN_REQUEST]


@pytest.mark.parametrize(
    ("side_effect", "has_reconcile", "action"),
    [
        (SideEffect.PURE, False, ToolRecoveryAction.RERUN),
        (SideEffect.PURE, True, ToolRecoveryAction.RERUN),
        (SideEffect.IDEMPOTENT, False, ToolRecoveryAction.RERUN_SAME_KEY),
        (SideEffect.IDEMPOTENT, True, ToolRecoveryAction.RERUN_SAME_KEY),
        (SideEffect.NON_IDEMPOTENT, True, ToolRecoveryAction.RECONCILE),
        (SideEffect.NON_IDEMPOTENT, False, ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN),
    ],
)
def test_tool_action_per_side_effect(side_effect: SideEffect, has_reconcile: bool, action: ToolRecoveryAction) -> None:
    s = in_turn().add(scheduled(side_effect=side_effect, tool="t"), started(side_effect=side_effect))
    plan = s.p.recovery_plan(has_reconcile=lambda name: has_reconcile)
    assert plan.tool_actions == {"c1": action}
    (item,) = [i for i in plan.items if i.call_id == "c1"]
    assert item.kind is RecoveryKind.TOOL_STARTED_WITHOUT_OUTCOME
    assert item.action is action
    assert item.idempotency_key == "key-c1"
    # The plan's action is always one the projection accepts as a decision.
    if action is not ToolRecoveryAction.REPLAY_RESULT:
        s.add(decision(action))


@pytest.mark.parametrize("settle", [completed, failed, cancelled, unknown])
@pytest.mark.parametrize("side_effect", list(SideEffect))
def test_settled_calls_are_replayed_never_rerun(settle: Any, side_effect: SideEffect) -> None:
    s = in_turn().add(scheduled(side_effect=side_effect), started(side_effect=side_effect), settle())
    plan = s.p.recovery_plan(has_reconcile=lambda name: True)
    assert plan.tool_actions == {"c1": ToolRecoveryAction.REPLAY_RESULT}
    assert all(item.call_id != "c1" for item in plan.items)


# ---------------------------------------------------------------- property tests


@attrs.define
class _Model:
    """An independent, minimal model used to walk the state machine."""

    session: str = "new"
    accepted: list[str] = attrs.Factory(list)
    active: str | None = None
    turns: dict[str, int] = attrs.Factory(dict)
    turn: str | None = None
    attempt: str | None = None
    tools: dict[str, dict[str, Any]] = attrs.Factory(dict)
    subagents: list[str] = attrs.Factory(list)
    permission_updates: int = 0
    n: int = 0

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"


def _candidates(m: _Model) -> list[Any]:
    """Every (kind of) valid next event, with the model update to make once drawn."""
    out: list[Any] = []
    if m.session == "new":
        return [("create", SessionCreated(session_id="s", agent_id="root"))]
    if m.session == "closed":
        return []
    out.append(("close", SessionClosed(session_id="s", reason=SessionCloseReason.SHUTDOWN)))
    out.append(("permission_update", None))
    if len(m.accepted) < 3:
        out.append(("accept", None))
    if m.active is None:
        for rid in m.accepted:
            out.append(("start_request", RequestStarted(request_id=rid)))
            out.append(
                ("interrupt_accepted", RequestInterrupted(request_id=rid, reason=RequestInterruptReason.USER_ABORT))
            )
    if m.active is not None and m.turn is None:
        out.append(("start_turn", None))
        out.append(("complete_request", RequestCompleted(request_id=m.active)))
        out.append(("fail_request", RequestFailed(request_id=m.active, error=ErrorInfo(message="x"))))
        out.append(("subagent", None))
    for sub in m.subagents:
        out.append(("subagent_done", SubagentCompleted(request_id=sub.split("/")[0], subagent_id=sub)))
    if m.turn is not None:
        ids = {"request_id": m.active, "turn_id": m.turn}
        if m.attempt is None:
            out.append(("start_attempt", None))
        else:
            out.append(("end_attempt", ModelAttemptCompleted(**ids, attempt_id=m.attempt, response={})))
            out.append(
                ("end_attempt", ModelAttemptAborted(**ids, attempt_id=m.attempt, reason=ModelAbortReason.STEERING))
            )
        out.append(("schedule", None))
        open_tools = False
        for call_id, t in m.tools.items():
            if t["state"] == "settled":
                continue
            open_tools = True
            c = {**ids, "call_id": call_id}
            se = t["side_effect"]
            if t["state"] == "scheduled":
                if t["perm"] in ("none", "allow"):
                    # The final input's contract may be narrower or wider than the scheduled one.
                    for started_se in SideEffect:
                        out.append(("start_tool", ToolStarted(**c, input={}, side_effect=started_se)))
                if t["perm"] == "none":
                    out.append(("ask", PermissionRequested(**c, permission_id=f"p-{call_id}")))
                if t["perm"] == "pending":
                    for verdict in PermissionDecision:
                        out.append(("answer", PermissionResolved(**c, permission_id=f"p-{call_id}", decision=verdict)))
                out.append(("settle", ToolCancelled(**c, reason="r")))
                out.append(("settle", ToolFailed(**c, result={})))
            else:
                if t["rerun"]:
                    out.append(("start_tool", ToolStarted(**c, input={}, side_effect=se)))
                elif t["decision"] is None:
                    for action in _ALLOWED[se]:
                        out.append(("decide", RecoveryDecision(**c, decision=action, reason="restart")))
                out.append(("settle", ToolCompleted(**c, result={"ok": 1})))
                out.append(("settle", ToolFailed(**c, result={})))
                out.append(("settle", ToolOutcomeUnknown(**c, reason=OutcomeUnknownReason.PROCESS_RESTART)))
                out.append(("settle", ToolCancelled(**c, reason="r")))
        if m.attempt is None and not open_tools:
            out.append(("end_turn", TurnCompleted(**ids, has_tool_calls=bool(m.tools))))
            out.append(("end_turn", TurnAborted(**ids, reason=TurnAbortReason.ERROR)))
    return out


_ALLOWED = {
    SideEffect.PURE: [ToolRecoveryAction.RERUN],
    SideEffect.IDEMPOTENT: [ToolRecoveryAction.RERUN_SAME_KEY],
    SideEffect.NON_IDEMPOTENT: [ToolRecoveryAction.RECONCILE, ToolRecoveryAction.SETTLE_OUTCOME_UNKNOWN],
}


def _step(m: _Model, kind: str, event: Any, draw: Any) -> Any:
    if kind == "create":
        m.session = "open"
    elif kind == "close":
        m.session = "closed"
    elif kind == "accept":
        rid = m.fresh("r")
        m.accepted.append(rid)
        m.turns[rid] = 0
        event = RequestAccepted(request_id=rid, command_id=f"cmd-{rid}", input={"prompt": f"p{m.n}"})
    elif kind == "start_request":
        m.accepted.remove(event.request_id)
        m.active = event.request_id
    elif kind == "interrupt_accepted":
        m.accepted.remove(event.request_id)
    elif kind in ("complete_request", "fail_request"):
        m.active = None
    elif kind == "start_turn":
        assert m.active is not None
        m.turn = m.fresh("t")
        m.turns[m.active] += 1
        m.tools = {}
        event = TurnStarted(request_id=m.active, turn_id=m.turn, turn=m.turns[m.active])
    elif kind == "subagent":
        sub = f"{m.active}/{m.fresh('sub')}"
        m.subagents.append(sub)
        event = SubagentStarted(request_id=m.active, subagent_id=sub)  # type: ignore[arg-type]
    elif kind == "subagent_done":
        m.subagents.remove(event.subagent_id)
    elif kind == "start_attempt":
        m.attempt = m.fresh("a")
        event = ModelAttemptStarted(request_id=m.active, turn_id=m.turn, attempt_id=m.attempt, model="m")  # type: ignore[arg-type]
    elif kind == "end_attempt":
        m.attempt = None
    elif kind == "schedule":
        call_id = m.fresh("c")
        se = draw(st.sampled_from(list(SideEffect)))
        m.tools[call_id] = {"state": "scheduled", "side_effect": se, "perm": "none", "rerun": False, "decision": None}
        event = scheduled(call_id, se, request_id=m.active, turn_id=m.turn)  # type: ignore[arg-type]
    elif kind == "permission_update":
        m.permission_updates += 1
        event = PermissionUpdated(
            request_id=m.active or "r0", source="permission_engine", update={"n": m.n}, call_id=None
        )
    elif kind == "start_tool":
        m.tools[event.call_id]["state"] = "started"
        m.tools[event.call_id]["side_effect"] = event.side_effect
        m.tools[event.call_id]["rerun"] = False
    elif kind == "decide":
        m.tools[event.call_id]["decision"] = event.decision
        m.tools[event.call_id]["rerun"] = event.decision in (
            ToolRecoveryAction.RERUN,
            ToolRecoveryAction.RERUN_SAME_KEY,
        )
    elif kind == "ask":
        m.tools[event.call_id]["perm"] = "pending"
    elif kind == "answer":
        m.tools[event.call_id]["perm"] = event.decision.value
    elif kind == "settle":
        m.tools[event.call_id]["state"] = "settled"
    elif kind == "end_turn":
        m.turn = None
        m.tools = {}
    return event


@st.composite
def valid_sequences(draw: Any, max_len: int = 60) -> list[EventEnvelope]:
    m = _Model()
    events: list[EventEnvelope] = []
    length = draw(st.integers(1, max_len))
    while len(events) < length:
        options = _candidates(m)
        if not options:
            break
        kinds = sorted({k for k, _ in options if k != "close"} or {"close"})
        if len(events) >= 1 and draw(st.sampled_from(range(40))) == 39:
            kinds = ["close"]
        kind = draw(st.sampled_from(kinds))
        kind, event = draw(st.sampled_from([o for o in options if o[0] == kind]))
        event = _step(m, kind, event, draw)
        events.append(env(event, len(events) + 1))
    return events


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sequences())
def test_valid_sequences_always_apply(envelopes: list[EventEnvelope]) -> None:
    p = Projection(STREAM)
    for e in envelopes:
        p.check(e)
        p.apply(e)
        assert decode_event(encode_event(e)) == e
    assert p.head == len(envelopes)
    plan = p.recovery_plan()
    assert [item.kind.priority for item in plan.items] == sorted(item.kind.priority for item in plan.items)
    for call_id, action in plan.tool_actions.items():
        record = p.tool(call_id)
        assert record is not None
        assert (action is ToolRecoveryAction.REPLAY_RESULT) == record.state.settled


def _mutations(p: Projection, nxt: EventEnvelope, history: list[EventEnvelope]) -> list[EventEnvelope]:
    """Invalid next envelopes for projection ``p`` whose valid next envelope is ``nxt``."""
    seq = p.head + 1
    out = [
        attrs.evolve(nxt, seq=seq + 1),
        attrs.evolve(nxt, stream_id="elsewhere"),
    ]
    if seq > 1:
        out.append(attrs.evolve(nxt, seq=seq - 1))
    settled = (ToolCompleted, ToolFailed, ToolCancelled, ToolOutcomeUnknown)
    for old in history:
        ev = old.event
        if isinstance(ev, settled):  # settle twice (with any settlement)
            out.append(
                env(ToolFailed(request_id=ev.request_id, turn_id=ev.turn_id, call_id=ev.call_id, result={}), seq)
            )
            out.append(attrs.evolve(old, seq=seq))
        if isinstance(ev, SessionClosed | SessionCreated | RequestAccepted | TurnStarted | ToolScheduled):
            out.append(attrs.evolve(old, seq=seq))  # creations are never repeated
    for call_id in list(p._s.tools):
        record = p.tool(call_id)
        assert record is not None
        if record.state is ToolState.SCHEDULED:  # completed without started
            ids = {"request_id": record.request_id, "turn_id": record.turn_id, "call_id": call_id}
            out.append(env(ToolCompleted(**ids, result={}), seq))
            out.append(env(ToolOutcomeUnknown(**ids, reason=OutcomeUnknownReason.PROCESS_RESTART), seq))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sequences(), st.data())
def test_single_event_mutations_are_rejected_without_change(envelopes: list[EventEnvelope], data: Any) -> None:
    cut = data.draw(st.integers(0, len(envelopes) - 1))
    p = Projection(STREAM)
    for e in envelopes[:cut]:
        p.apply(e)
    nxt = envelopes[cut]
    bad = data.draw(st.sampled_from(_mutations(p, nxt, envelopes[:cut])))
    before = p.snapshot()
    with pytest.raises(InvalidTransitionError):
        p.check(bad)
    with pytest.raises(InvalidTransitionError):
        p.apply(bad)
    assert p.snapshot() == before
    assert p.head == cut
    # An unknown field never even decodes.
    raw = encode_event(nxt)
    raw["event"]["unexpected"] = True
    with pytest.raises(JournalCorruptError):
        decode_event(raw)
    # The projection is still usable: the valid event applies.
    p.apply(nxt)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sequences())
def test_nothing_applies_after_close(envelopes: list[EventEnvelope]) -> None:
    p = Projection(STREAM)
    for e in envelopes:
        p.apply(e)
    if p.session_state is not SessionState.OPEN:
        return
    p.apply(env(SessionClosed(session_id="s", reason=SessionCloseReason.USER), p.head + 1))
    before = p.snapshot()
    for e in envelopes[1:]:
        with pytest.raises(InvalidTransitionError, match="closed"):
            p.apply(attrs.evolve(e, seq=p.head + 1))
    assert p.snapshot() == before


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sequences())
def test_only_live_requests_have_turns_and_attempts(envelopes: list[EventEnvelope]) -> None:
    p = Projection(STREAM)
    for e in envelopes:
        p.apply(e)
        s = p._s
        live = {r.request_id for r in s.requests.values() if r.state.value in ("accepted", "started", "paused")}
        assert {t.request_id for t in s.turns.values()} <= live
        assert {a.request_id for a in s.attempts.values()} <= live
        assert set(s.unsettled) <= set(s.turns)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sequences(), st.data())
def test_apply_atomic_applies_a_valid_batch_or_nothing(envelopes: list[EventEnvelope], data: Any) -> None:
    """A batch of valid events lands exactly as one by one; a batch whose last event is invalid
    leaves the state exactly as before (whatever the earlier events of the batch touched)."""
    cut = data.draw(st.integers(0, len(envelopes) - 1))
    size = data.draw(st.integers(1, len(envelopes) - cut))
    p = Projection(STREAM)
    for e in envelopes[:cut]:
        p.apply(e)
    batch = envelopes[cut : cut + size]
    before = p.snapshot()
    # Invalid tail: the batch's valid prefix followed by an event that cannot follow it.
    q = Projection(STREAM)
    for e in envelopes[: cut + size - 1]:
        q.apply(e)
    bad = data.draw(st.sampled_from(_mutations(q, batch[-1], envelopes[: cut + size - 1])))
    with pytest.raises(InvalidTransitionError):
        p.apply_atomic([*batch[:-1], bad])
    assert p.snapshot() == before
    assert p.head == cut
    # The valid batch lands as if applied one by one.
    p.apply_atomic(batch)
    one_by_one = Projection(STREAM)
    for e in envelopes[: cut + size]:
        one_by_one.apply(e)
    assert p.snapshot() == one_by_one.snapshot()


# ---------------------------------------------------------------- closing events


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sequences())
def test_closing_events_close_everything_but_started_calls(envelopes: list[EventEnvelope]) -> None:
    p = Projection(STREAM)
    for e in envelopes:
        p.apply(e)
    events = p.closing_events()
    if p.session_state is not SessionState.OPEN:
        assert events == []
        return
    p.apply_atomic([env(event, p.head + 1 + index) for index, event in enumerate(events)])  # one valid batch
    s = p._s
    started = {c.turn_id for c in s.tools.values() if c.state is ToolState.STARTED}
    assert all(c.state in (ToolState.STARTED,) or c.state.settled for c in s.tools.values())
    assert s.running_attempt is None
    assert all(a.state.value != "running" for a in s.subagents.values())
    assert s.open_turn is None or s.open_turn in started
    still_open = [r.request_id for r in s.requests.values() if r.state.value in ("accepted", "started")]
    assert still_open == ([] if s.open_turn is None else [s.turns[s.open_turn].request_id])
    assert p.closing_events() == []  # what is left is recovery's
    plan_kinds = {item.kind.value for item in p.recovery_plan().items}
    assert plan_kinds <= {"tool_started_without_outcome", "open_turn"}


def test_closing_events_with_reasons_and_a_pending_permission() -> None:
    s = in_turn().add(
        ModelAttemptStarted(**RT, attempt_id="a1", model="m"),
        scheduled("c1"),
        PermissionRequested(**RT, call_id="c1", permission_id="p1"),
        scheduled("c2"),
    )
    events = s.p.closing_events(
        attempt_reason=ModelAbortReason.STEERING,
        tool_reason="user_abort",
        turn_reason=TurnAbortReason.ERROR,
        request_reason=RequestInterruptReason.USER_ABORT,
    )
    assert events == [
        ModelAttemptAborted(**RT, attempt_id="a1", reason=ModelAbortReason.STEERING),
        PermissionResolved(**RT, call_id="c1", permission_id="p1", decision=PermissionDecision.CANCEL),
        ToolCancelled(**RT, call_id="c1", reason="user_abort"),
        ToolCancelled(**RT, call_id="c2", reason="user_abort"),
        TurnAborted(**RT, reason=TurnAbortReason.ERROR),
        RequestInterrupted(request_id="r1", reason=RequestInterruptReason.USER_ABORT),
    ]
    s.add(*events)
    assert s.p.recovery_plan().is_empty
