"""A session's ``cleanup_grace`` reaches its tools, and a tool that ignores its cancellation is
reported while it overruns (not only once it ends)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import RequestAbortedError, ToolUseEvent, define_tool, open_session
from trio_agent.testing import Reply, TestModel


def _model() -> TestModel:
    return TestModel(default=[Reply(tool_calls=[("stuck", {})]), Reply(text="done")])


@pytest.mark.parametrize("grace", [1.5, 30.0])
async def test_a_session_s_cleanup_grace_bounds_its_tools_cleanup_scope(
    autojump_clock: trio.testing.MockClock, grace: float
) -> None:
    bounds: list[float] = []

    async def stuck(inp: dict[str, Any], ctx: Any) -> str:
        with ctx.cleanup_scope() as scope:
            bounds.append(scope.deadline - trio.current_time())
        return "ok"

    tool = define_tool(stuck, description="x", side_effect="pure", input_schema={"type": "object"})
    async with open_session(
        provider=_model(), model="m", tools=[tool], permissions={"allow": ["stuck"]}, cleanup_grace=grace
    ) as session:
        await session.send("hi")
    assert bounds == [grace]


class Seen(logging.Handler):
    """The ``trio_agent`` WARNINGs (time, text); an event per marker, set by the first with it."""

    def __init__(self, *markers: str) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []
        self.events = {marker: trio.Event() for marker in markers}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.records.append((trio.current_time(), text))
        for marker, event in self.events.items():
            if marker in text:
                event.set()


@pytest.fixture
def seen() -> Iterator[Seen]:
    handler = Seen("has not stopped", "leaving the session")
    logger = logging.getLogger("trio_agent")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _stubborn(release: trio.Event, started: trio.Event) -> Any:
    async def stuck(inp: dict[str, Any], ctx: Any) -> str:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):  # ignores its abort until released
                await release.wait()
        return "never"  # pragma: no cover

    return define_tool(stuck, description="x", side_effect="pure", input_schema={"type": "object"})


async def test_session_abort_waits_for_a_tool_that_ignores_it_and_the_overrun_is_logged_meanwhile(
    autojump_clock: trio.testing.MockClock, seen: Seen
) -> None:
    release, started = trio.Event(), trio.Event()
    returned: list[float] = []
    async with open_session(
        provider=_model(), model="m", tools=[_stubborn(release, started)], permissions={"allow": ["stuck"]},
        cleanup_grace=3.0, close_timeout=5.0,
    ) as session:  # fmt: skip

        async def send() -> None:
            with pytest.raises(RequestAbortedError):
                await session.send("hi")

        async def abort() -> None:
            await session.abort()
            returned.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(send)
                await started.wait()
                aborted_at = trio.current_time()
                nursery.start_soon(abort)
                with trio.fail_after(100):  # (virtual time)
                    await seen.events["has not stopped"].wait()
                assert trio.current_time() == aborted_at + 3.0  # the session's grace, not the pipeline's 5 s
                assert returned == []  # abort() waits for the tool
                [(_, text)] = seen.records
                assert text.startswith("tool 'stuck' (call 'call_") and "aborted (user_abort)" in text
                await trio.sleep(10)  # (virtual time) the tool holds out past close_timeout too
                assert returned == []
            finally:
                release.set()  # (a failed assertion must not leave it stuck)
    assert returned == [aborted_at + 13.0]


async def test_leaving_a_session_whose_tool_ignores_its_abort_logs_what_the_exit_waits_for(
    autojump_clock: trio.testing.MockClock, seen: Seen
) -> None:
    release, started = trio.Event(), trio.Event()

    async def release_when_the_exit_says_so() -> None:
        with trio.move_on_after(500):  # (virtual time) no warning: released anyway, and the test fails below
            await seen.events["leaving the session"].wait()
        release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_when_the_exit_says_so)
        async with open_session(
            provider=_model(), model="m", tools=[_stubborn(release, started)], permissions={"allow": ["stuck"]},
            cleanup_grace=3.0, close_timeout=5.0,
        ) as session:  # fmt: skip
            async with session.stream("hi") as events:
                async for event in events:
                    if isinstance(event, ToolUseEvent):
                        break
            await started.wait()
        left = trio.current_time()
    texts = [text for _, text in seen.records]
    [waits] = [text for text in texts if text.startswith("leaving the session")]
    assert "tool 'stuck' (call 'call_" in waits
    assert any(text.startswith("tool 'stuck' (call 'call_") and "has not stopped" in text for text in texts)
    assert any(text.startswith("tool 'stuck' (call 'call_") and " stopped " in text for text in texts)
    assert left < 500  # released when the exit said what it waited for
