"""Every shielded clean-up of the model service and the journal stores is bounded by ``cleanup_grace``.

A clean-up that overruns is abandoned and logged as a WARNING on the ``trio_agent``
logger naming the layer. Trio-time tests use the mock clock; where a real thread
blocks (a store write), the thread waits on a `threading.Event` the test controls
and the bound is a small real grace, checked by what has (not) happened yet rather
than by how fast it went.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import ConfigError, ModelMiddleware, ModelTimeoutError
from trio_agent._errors import JournalUnavailableError
from trio_agent._journal._events import EventEnvelope, RequestStarted
from trio_agent._journal._lane import LaneItem, WriterLane
from trio_agent._journal._sqlite import SQLiteStore, open_sqlite_store
from trio_agent._journal._store import AppendBatch, AppendResult, Lease, stream_id_for
from trio_agent.models import (
    AssistantMessage,
    FinishReason,
    ModelRequest,
    ModelResponse,
    ModelService,
    ProviderServerError,
    RetryPolicy,
    StreamChunk,
    TextDelta,
    TextPart,
    UserMessage,
)

MESSAGES = [UserMessage("hello")]
STUCK = 1000.0  # how long a misbehaving clean-up would take: far beyond every bound here
RELEASE_AFTER = 10.0  # real seconds after which a stuck test thread lets go anyway (so a regression fails, not hangs)
REAL_GRACE = 0.2


def overruns(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trio_agent" and r.levelno == logging.WARNING]


# ---------------------------------------------------------------- model service


class Provider:
    """A provider streaming ``chunks`` deltas; its stream's ``finally`` may hang (``stuck_close``)."""

    name = "fake"

    def __init__(self, chunks: int = 3, *, stuck_close: bool = False, model: str = "m") -> None:
        self.chunks = chunks
        self.stuck_close = stuck_close
        self.model = model
        self.closed = False

    def with_model(self, model: str) -> Provider:
        return Provider(self.chunks, stuck_close=self.stuck_close, model=model)

    async def chat(self, request: ModelRequest) -> ModelResponse:
        await trio.lowlevel.checkpoint()
        return ModelResponse(AssistantMessage((TextPart("hi"),)), FinishReason.STOP)

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        try:
            for index in range(self.chunks):
                await trio.lowlevel.checkpoint()
                yield TextDelta(str(index))
        finally:
            self.closed = True
            if self.stuck_close:
                await trio.sleep(STUCK)  # an HTTP response whose close never completes


class StuckCleanup(ModelMiddleware):
    """A stream middleware whose ``finally`` awaits for 1,000 s."""

    def __init__(self) -> None:
        self.cleaned = False

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> AsyncIterator[StreamChunk]:
        try:
            async for chunk in call_next(request):
                yield chunk
        finally:
            await trio.sleep(STUCK)
            self.cleaned = True  # never reached: the bound cuts the sleep short


async def test_closing_a_stream_whose_middleware_cleanup_hangs_takes_cleanup_grace(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    provider = Provider(chunks=5)
    stuck = StuckCleanup()
    service = ModelService(provider, [stuck], cleanup_grace=2)
    started = trio.current_time()
    async with service.stream(MESSAGES) as chunks:
        async for _ in chunks:
            break
    assert trio.current_time() - started == 2.0
    assert not stuck.cleaned
    assert provider.closed  # the layer behind the stuck one is still closed (its finally does not await)
    [message] = overruns(caplog)
    assert "model middleware #0 (StuckCleanup)" in message
    assert "2 s" in message


async def test_a_request_deadline_is_extended_by_at_most_cleanup_grace(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    service = ModelService(Provider(chunks=5), [StuckCleanup()], request_timeout=1, cleanup_grace=3)
    started = trio.current_time()
    with pytest.raises(ModelTimeoutError):
        async with service.stream(MESSAGES) as chunks:
            async for _ in chunks:
                await trio.sleep_forever()  # the consumer is busy with a chunk when the deadline passes
    assert trio.current_time() - started == 1.0 + 3.0
    assert any("StuckCleanup" in message for message in overruns(caplog))


async def test_an_outside_cancellation_is_delayed_by_at_most_cleanup_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    service = ModelService(Provider(chunks=5), [StuckCleanup()], cleanup_grace=0.5)
    started = trio.current_time()
    with trio.move_on_after(1) as scope:
        async with service.stream(MESSAGES) as chunks:
            async for _ in chunks:
                await trio.sleep_forever()
    assert scope.cancelled_caught
    assert trio.current_time() - started == 1.5


async def test_a_provider_stream_whose_close_hangs_is_abandoned_and_named(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    service = ModelService(Provider(chunks=5, stuck_close=True), cleanup_grace=2)
    started = trio.current_time()
    async with service.stream(MESSAGES) as chunks:
        async for _ in chunks:
            break
    assert trio.current_time() - started == 2.0
    assert any("the fake provider stream" in message for message in overruns(caplog))


async def test_all_layers_together_share_one_cleanup_grace(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A stuck middleware and a stuck provider close: 2 s in all, not 2 s each.
    caplog.set_level(logging.WARNING, logger="trio_agent")
    service = ModelService(Provider(chunks=5, stuck_close=True), [StuckCleanup()], cleanup_grace=2)
    started = trio.current_time()
    async with service.stream(MESSAGES) as chunks:
        async for _ in chunks:
            break
    assert trio.current_time() - started == 2.0


class FlakyStream:
    """A provider stream that fails at once (retryably) and whose ``aclose`` hangs."""

    def __init__(self) -> None:
        self.closing = False

    def __aiter__(self) -> FlakyStream:
        return self

    async def __anext__(self) -> StreamChunk:
        await trio.lowlevel.checkpoint()
        raise ProviderServerError("overloaded", status=503)

    async def aclose(self) -> None:
        self.closing = True
        await trio.sleep(STUCK)


class FlakyProvider(Provider):
    """The first stream attempt is a `FlakyStream`; later ones work."""

    name = "flaky"

    def __init__(self) -> None:
        super().__init__(chunks=2)
        self.attempts: list[object] = []

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        attempt: AsyncIterator[StreamChunk] = FlakyStream() if not self.attempts else super().stream(request)
        self.attempts.append(attempt)
        return attempt


async def test_closing_a_failed_attempt_before_a_retry_is_bounded(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    provider = FlakyProvider()
    service = ModelService(provider, retry=RetryPolicy(jitter=False, base_delay=0.5), cleanup_grace=2)
    started = trio.current_time()
    async with service.stream(MESSAGES) as chunks:
        received = [chunk async for chunk in chunks]
    assert received == [TextDelta("0"), TextDelta("1")]
    assert trio.current_time() - started == 2.0 + 0.5  # the bounded close, then the backoff
    first = provider.attempts[0]
    assert isinstance(first, FlakyStream) and first.closing
    assert any("the flaky provider stream" in message for message in overruns(caplog))


async def test_a_clean_close_logs_nothing(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    async with ModelService(Provider(chunks=5), cleanup_grace=2).stream(MESSAGES) as chunks:
        async for _ in chunks:
            break
    assert overruns(caplog) == []


@pytest.mark.parametrize(
    "bad",
    [
        *(0, -1, float("nan"), float("inf"), "10", True),
        # ints too large for a float (OverflowError) or to print (ValueError): still a ConfigError
        pytest.param(10**400, id="huge-int"),
        pytest.param(-(10**400), id="huge-negative-int"),
        pytest.param(10**5000, id="unprintable-int"),
    ],
)
def test_cleanup_grace_is_validated(bad: Any) -> None:
    with pytest.raises(ConfigError, match="cleanup_grace"):
        ModelService(Provider(), cleanup_grace=bad)


def test_with_model_keeps_the_cleanup_grace() -> None:
    service = ModelService(Provider(), cleanup_grace=1.5)
    assert service.cleanup_grace == 1.5
    assert service.with_model("other").cleanup_grace == 1.5


# ---------------------------------------------------------------- the writer lane


async def test_a_writer_lane_stuck_in_a_commit_closes_within_the_grace(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    entered, release = threading.Event(), threading.Event()
    committed: list[object] = []
    stopped_after: list[list[object]] = []

    def commit(works: Sequence[Any]) -> list[object]:
        if "stuck" in works:
            entered.set()
            release.wait(RELEASE_AFTER)
        committed.extend(works)
        return ["ok"] * len(works)

    lane = WriterLane("test writer", commit, on_stop=lambda: stopped_after.append(list(committed)))
    lane.start()
    stuck: LaneItem[str] = LaneItem()
    behind: LaneItem[str] = LaneItem()
    try:
        lane.submit("stuck", stuck.resolve)
        assert await trio.to_thread.run_sync(entered.wait, RELEASE_AFTER)
        lane.submit("behind", behind.resolve)
        await lane.aclose(REAL_GRACE)
        # Returned while the commit is still running: the bound, not the thread, ended the wait.
        assert not lane.stopped
        assert committed == []
    finally:
        release.set()
    [message] = overruns(caplog)
    assert "test writer" in message and "0.2 s" in message
    with trio.fail_after(RELEASE_AFTER):
        assert await stuck.wait() == "ok"  # the work in progress finishes whole
        with pytest.raises(JournalUnavailableError, match="closed before"):
            await behind.wait()  # nothing not yet begun is written after the close
    await trio.to_thread.run_sync(lane._stopped.wait, RELEASE_AFTER)
    assert committed == ["stuck"]
    assert stopped_after == [["stuck"]]  # the thread closes its connection itself, after its commit


async def test_a_writer_lane_drains_everything_when_it_is_in_time() -> None:
    seen: list[object] = []

    def commit(works: Sequence[Any]) -> list[object]:
        seen.extend(works)
        return ["ok"] * len(works)

    lane = WriterLane("test writer", commit)
    lane.start()
    items = [LaneItem[str]() for _ in range(5)]
    for index, item in enumerate(items):
        lane.submit(index, item.resolve)
    await lane.aclose(REAL_GRACE * 50)
    assert lane.stopped
    assert seen == [0, 1, 2, 3, 4]
    assert all(item.done for item in items)


# ---------------------------------------------------------------- SQLite


def envs(stream_id: str, first: int, count: int) -> list[EventEnvelope]:
    return [
        EventEnvelope(stream_id=stream_id, seq=seq, event=RequestStarted(request_id=f"r{seq}"), recorded_at=1.5)
        for seq in range(first, first + count)
    ]


def batch(lease: Lease, stream_id: str, envelopes: Sequence[EventEnvelope]) -> AppendBatch:
    return AppendBatch(lease.session_id, stream_id, lease.token, envelopes)


async def test_sqlite_close_with_a_write_stuck_before_commit_is_bounded_and_the_journal_stays_consistent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_agent")
    path = tmp_path / "journal.db"
    stream = stream_id_for("sess", "root")
    entered, release = threading.Event(), threading.Event()

    def trace(statement: str) -> None:
        # In the writer thread, with the batch written but not committed.
        if statement == "COMMIT" and not release.is_set():
            entered.set()
            release.wait(RELEASE_AFTER)

    store: SQLiteStore | None = None
    try:
        async with open_sqlite_store(path, cleanup_grace=REAL_GRACE) as store:
            lease = await store.acquire_lease("sess", "A", 60.0)
            await store.append(batch(lease, stream, envs(stream, 1, 2)))
            assert store._writer is not None
            store._writer.set_trace_callback(trace)
            stuck = store.submit(batch(lease, stream, envs(stream, 3, 2)))
            assert await trio.to_thread.run_sync(entered.wait, RELEASE_AFTER)
            behind = store.submit(batch(lease, stream, envs(stream, 5, 1)))
        lane = store._lane
        assert lane is not None
        assert not lane.stopped  # the close returned while the write was stuck
        assert not stuck.done
    finally:
        release.set()
    assert any("journal writer (journal.db)" in m and "0.2 s" in m for m in overruns(caplog))
    with trio.fail_after(RELEASE_AFTER):
        assert await stuck.wait() == AppendResult(stream, 3, 4)
        with pytest.raises(JournalUnavailableError):
            await behind.wait()
    await trio.to_thread.run_sync(lane._stopped.wait, RELEASE_AFTER)
    assert store._writer is None  # closed by the writer thread, after its transaction
    async with open_sqlite_store(path) as again:
        assert await again.read(stream) == envs(stream, 1, 4)
        assert await again.head(stream) == 4


@pytest.mark.parametrize("bad", [0, -0.5, float("nan")])
async def test_sqlite_cleanup_grace_is_validated(tmp_path: Path, bad: float) -> None:
    with pytest.raises(ConfigError, match="cleanup_grace"):
        async with open_sqlite_store(tmp_path / "j.db", cleanup_grace=bad):
            pass  # pragma: no cover
