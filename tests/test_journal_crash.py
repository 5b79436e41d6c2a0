"""kill -9 crash tests of the durable journal, and the SIGSTOP lease-takeover test.

Real worker processes (``tests/crash/worker.py``) run tool calls against a real
store and are SIGKILLed at every journal boundary (systematic crash points) and
at random moments; each next worker takes the session over once the dead
owner's lease expired and recovers it. `tests.crash.harness` then checks the
invariants from the durable events, the side-effect ledger and the ACK lines
(see its docstring). The negative control proves the checker catches a
recovery that re-runs a started ``non_idempotent`` call.

The CI versions are short; ``-m stress`` runs the long ones (30+ random kills,
several seeds).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from crash.harness import (
    DUPLICATE_NON_IDEMPOTENT,
    CrashHarness,
    CrashPoint,
    HarnessResult,
    StoreSpec,
    recovery_points,
    run_campaign,
    sigstop_takeover,
    systematic_points,
)

# Every tool-event crash point of non_idempotent calls, a few of the others, and
# a chain of crashes inside recovery itself (decisions, re-runs).
CI_POINTS: list[CrashPoint] = [
    *systematic_points(side_effects=["non_idempotent"]),
    CrashPoint("tool_started", "before", "idempotent", "new"),
    CrashPoint("tool_completed", "before", "idempotent", "new"),
    *recovery_points()[:5],
]
CI_RANDOM_KILLS = 5
STRESS_POINTS: list[CrashPoint] = [*systematic_points(), *recovery_points()]
STRESS_RANDOM_KILLS = 40


@pytest.fixture
def sqlite_spec(tmp_path: Path) -> StoreSpec:
    return StoreSpec.sqlite(tmp_path / "journal.db")


@pytest.fixture
def pg_spec(request: pytest.FixtureRequest) -> StoreSpec:
    for module in ("psycopg", "trio_agent._journal._postgres"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the PostgreSQL store needs {module}, which is not available")
    dsn: str = request.getfixturevalue("postgres_dsn")
    schema: str = request.getfixturevalue("fresh_pg_schema")
    return StoreSpec.postgres(dsn, schema)


def assert_campaign(result: HarnessResult, *, points: int, random_kills: int) -> None:
    stats = result.stats
    assert result.violations == [], result.summary()
    # Every systematic crash point was reached (the worker killed itself there) ...
    assert stats["crash_points_not_reached"] == [], result.summary()
    assert stats["kills_systematic"] == points, result.summary()
    # ... every random kill landed while the worker was running calls ...
    assert stats["kills_random"] == random_kills, result.summary()
    # ... and the clean final worker recovered the rest and exited 0.
    final = result.runs[-1]
    assert final.role == "final" and final.returncode == 0 and final.done, result.summary()
    # Work was really done and ACKed (and each ACK was checked against the journal).
    assert stats["acked"] >= 10, result.summary()
    assert stats["ledger_lines"] >= stats["acked"], result.summary()
    # Recovery met each situation: re-run pure, re-run idempotent with its key, and refuse to
    # re-run a started non_idempotent call. (A call's scheduling is written with its start, so
    # a never-started call needs a sibling that started: see test_journal_durable.py, deferred events.)
    decisions = stats["recovery_decisions"]
    for action in ("rerun", "rerun_same_key", "settle_outcome_unknown"):
        assert decisions.get(action, 0) >= 1, result.summary()
    assert stats["settled_as"].get("ToolOutcomeUnknown", 0) >= 1, result.summary()
    # At-least-once made visible: an idempotent call whose effect landed before the
    # crash ran again with the same key (allowed; the downstream dedups by key).
    assert stats["effects_twice_by_side_effect"].get("idempotent", 0) >= 1, result.summary()
    assert stats["effects_twice_by_side_effect"].get("non_idempotent", 0) == 0, result.summary()


# ---------------------------------------------------------------- CI versions


async def test_crash_harness_sqlite(sqlite_spec: StoreSpec, tmp_path: Path) -> None:
    result = await run_campaign(sqlite_spec, tmp_path / "run", points=CI_POINTS, random_kills=CI_RANDOM_KILLS, seed=1)
    assert_campaign(result, points=len(CI_POINTS), random_kills=CI_RANDOM_KILLS)


async def test_crash_harness_postgres(pg_spec: StoreSpec, tmp_path: Path) -> None:
    result = await run_campaign(pg_spec, tmp_path / "run", points=CI_POINTS, random_kills=CI_RANDOM_KILLS, seed=1)
    assert_campaign(result, points=len(CI_POINTS), random_kills=CI_RANDOM_KILLS)
    assert result.stats["store"] == "postgres"


async def _crash_after_effect(
    spec: StoreSpec, workdir: Path, *, negative_control: bool
) -> tuple[CrashHarness, HarnessResult]:
    """A non_idempotent call dies after its effect, before its settlement; then one recovery."""
    harness = CrashHarness(spec, workdir, session_id="negative-control" if negative_control else "control")
    crashed = await harness.run_worker(
        role="systematic", crash=CrashPoint("tool_completed", "before", "non_idempotent", "new")
    )
    assert crashed.killed and crashed.crash_fired
    if negative_control:
        await harness.run_negative_control()
    else:
        await harness.finish(requests=0)
    return harness, await harness.check()


async def test_negative_control_catches_rerun_of_started_non_idempotent_call(tmp_path: Path) -> None:
    # The real recovery settles the call outcome_unknown and never re-runs it ...
    harness, control = await _crash_after_effect(
        StoreSpec.sqlite(tmp_path / "a.db"), tmp_path / "a", negative_control=False
    )
    assert control.violations == [], control.summary()
    assert control.stats["recovery_decisions"] == {"settle_outcome_unknown": 1}, control.summary()
    assert control.stats["settled_as"]["ToolOutcomeUnknown"] == 1, control.summary()
    # The checker is not vacuous: an ACK the journal never settled and an effect of an
    # unknown call are reported too.
    harness.runs[0].lines.append("ACK call-never-scheduled")
    with harness.ledger.open("a") as ledger:
        ledger.write("call-never-scheduled,pure,some-key,1\n")
    tampered = await harness.check()
    assert sorted(tampered.violations) == [
        "ACKed call call-never-scheduled is not settled in the journal",
        "ledger effect of call call-never-scheduled that was never scheduled",
    ], tampered.summary()
    # ... a recovery that re-runs it must be caught by the checker.
    _, broken = await _crash_after_effect(StoreSpec.sqlite(tmp_path / "b.db"), tmp_path / "b", negative_control=True)
    assert broken.stats["negative_control_reruns"] == 1, broken.summary()
    duplicates = [v for v in broken.violations if v.startswith(DUPLICATE_NON_IDEMPOTENT)]
    assert len(duplicates) == 1, broken.summary()
    assert "hit the ledger 2 times" in duplicates[0]


# ---------------------------------------------------------------- SIGSTOP takeover


async def _check_takeover(spec: StoreSpec, workdir: Path) -> None:
    result = await sigstop_takeover(spec, workdir)
    old, new = result.holder["token"], result.taker["token"]
    assert new > old, result
    # The paused holder's write, already past its local checks, is refused by the store's fence ...
    assert result.raw_write.get("refused") == "StaleFencingTokenError", result.holder_lines
    # ... its next journal write is refused too (lease lost), and its journal block ends with LeaseLostError.
    assert result.journal_write.get("refused") in ("LeaseLostError", "StaleFencingTokenError"), result.holder_lines
    assert result.holder_exit == {"error": "LeaseLostError"}, result.holder_lines
    # The new owner was not disturbed: it appended after the zombie's attempt and exited cleanly.
    assert result.taker_returncode == 0, result.taker_lines
    # The store holds the holder's events up to the takeover and only B's after it.
    head = result.holder["head"]
    assert head >= 1
    assert [name for seq, name, _ in result.events if seq > head] == [
        "RequestAccepted",
        "RequestStarted",
        "RequestCompleted",
    ], result.events
    assert {request for seq, _, request in result.events if seq > head} == {"from-b-1"}
    assert not any(request and request.startswith("zombie") for _, _, request in result.events)
    assert sorted(result.tokens) == [seq for seq, _, _ in result.events]
    assert all(token == old for seq, token in result.tokens.items() if seq <= head), result.tokens
    assert all(token == new for seq, token in result.tokens.items() if seq > head), result.tokens
    assert result.lease_token == new


async def test_sigstop_takeover_sqlite(sqlite_spec: StoreSpec, tmp_path: Path) -> None:
    await _check_takeover(sqlite_spec, tmp_path)


async def test_sigstop_takeover_postgres(pg_spec: StoreSpec, tmp_path: Path) -> None:
    await _check_takeover(pg_spec, tmp_path)


# ---------------------------------------------------------------- stress versions


@pytest.mark.stress
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("seed", "parallel"), [(1, False), (2, False), (3, True)])
async def test_crash_harness_sqlite_stress(sqlite_spec: StoreSpec, tmp_path: Path, seed: int, parallel: bool) -> None:
    result = await run_campaign(
        sqlite_spec,
        tmp_path / "run",
        points=STRESS_POINTS,
        random_kills=STRESS_RANDOM_KILLS,
        seed=seed,
        parallel=parallel,
    )
    assert_campaign(result, points=len(STRESS_POINTS), random_kills=STRESS_RANDOM_KILLS)


@pytest.mark.stress
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("seed", "parallel"), [(1, False), (2, True)])
async def test_crash_harness_postgres_stress(pg_spec: StoreSpec, tmp_path: Path, seed: int, parallel: bool) -> None:
    result = await run_campaign(
        pg_spec,
        tmp_path / "run",
        points=STRESS_POINTS,
        random_kills=STRESS_RANDOM_KILLS,
        seed=seed,
        parallel=parallel,
    )
    assert_campaign(result, points=len(STRESS_POINTS), random_kills=STRESS_RANDOM_KILLS)
