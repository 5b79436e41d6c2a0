"""Texts a user reads verbatim (issue 16, item 8): each is a sentence in the user's words, pinned here.

* a stopped tool call: the abort's free-text reason is never glued into our sentence
  (it used to read "Error: tool call the user pressed stop");
* a bad ``model_request_timeout`` names the option the user gave, not the internal ``request_timeout``;
* ``asyncio.run`` users are told that trio_agent runs under Trio and how to start it.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import trio_agent
from trio_agent import (
    AbortHandle,
    AbortReason,
    ConfigError,
    InMemoryToolJournal,
    ModelError,
    RateLimitError,
    ToolErrorType,
    ToolPipeline,
    chat,
    define_tool,
    open_session,
)
from trio_agent.models import ModelAbortedError, ProviderServerError
from trio_agent.testing import Reply, TestModel, call_tool

SCHEMA: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def slow_tool(*, timeout: float | None = None) -> Any:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    return define_tool(run, name="slow", description="waits", input_schema=SCHEMA, side_effect="pure", timeout=timeout)


async def test_a_tool_call_stopped_by_the_user_reads_as_a_sentence() -> None:
    pipeline = ToolPipeline([slow_tool()], journal=InMemoryToolJournal())
    abort = AbortHandle()
    async with trio.open_nursery() as nursery:
        records: list[Any] = []

        async def run() -> None:
            records.append(await call_tool(pipeline, "slow", {}, abort=abort))

        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        abort.abort(AbortReason.USER_ABORT, "the user pressed stop")
    [record] = records
    error = record.result.error
    assert error is not None and error.type is ToolErrorType.INTERRUPTED
    assert error.message == "The tool call was stopped before it finished: the user pressed stop."
    assert record.result.output == "Error: The tool call was stopped before it finished: the user pressed stop."
    assert "tool call the user" not in record.result.output


async def test_a_tool_call_that_timed_out_reads_as_a_sentence(autojump_clock: trio.testing.MockClock) -> None:
    pipeline = ToolPipeline([slow_tool(timeout=2)], journal=InMemoryToolJournal())
    record = await call_tool(pipeline, "slow", {})
    error = record.result.error
    assert error is not None and error.type is ToolErrorType.TIMEOUT
    assert error.message == "The tool call did not finish in time and was stopped (timed out after 2 s)."


async def test_a_bad_model_request_timeout_names_the_option_the_user_gave() -> None:
    with pytest.raises(ConfigError) as info:
        async with open_session(provider=TestModel(default=Reply(text="x")), model_request_timeout=-1):
            pass  # pragma: no cover
    message = str(info.value)
    assert message.startswith("model_request_timeout ")
    assert "got -1" in message


def test_open_session_under_asyncio_says_to_use_trio_run() -> None:
    async def main() -> None:
        async with open_session(provider=TestModel(default=Reply(text="x"))):
            pass  # pragma: no cover

    with pytest.raises(ConfigError) as info:
        asyncio.run(main())
    assert str(info.value) == (
        "open_session() was called under asyncio, but trio_agent runs under Trio: "
        "start your program with trio.run(main) instead of asyncio.run(main())"
    )


def test_chat_under_asyncio_says_to_use_trio_run() -> None:
    async def main() -> None:
        async with chat(TestModel(default=Reply(text="x")), "hi"):
            pass  # pragma: no cover

    with pytest.raises(ConfigError, match=r"chat\(\) was called under asyncio, but trio_agent runs under Trio"):
        asyncio.run(main())


async def test_under_trio_there_is_no_hint() -> None:
    async with chat(TestModel(default=Reply(text="hello")), "hi") as run:
        assert (await run.result()).text == "hello"


# ---------------------------------------------------------------- one casing for codes

_SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")


def test_every_code_the_library_writes_is_snake_case() -> None:
    # Codes are compared by programs: one casing everywhere (`_errors` states the rule).
    package = Path(trio_agent.__file__).parent
    found = {
        (path.relative_to(package).as_posix(), code)
        for path in package.rglob("*.py")
        for code in re.findall(r"""\bcode=["']([^"']+)["']""", path.read_text())
    }
    assert len(found) > 10  # the scan itself is live
    assert not [item for item in found if not _SNAKE.fullmatch(item[1])]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ModelError("x"), "model_error"),
        (RateLimitError("x"), "rate_limit_error"),
        (ProviderServerError("x"), "provider_server_error"),
        (ModelAbortedError("x"), "model_request_aborted"),
        (ModelError("x", code="custom"), "custom"),
    ],
)
def test_a_model_error_without_a_code_is_named_in_snake_case(error: ModelError, code: str) -> None:
    assert error.code == code


async def test_an_exhausted_test_model_says_so_in_snake_case() -> None:
    with pytest.raises(ModelError) as caught:
        async with open_session(provider=TestModel()) as session:
            await session.send("hi")
    assert caught.value.code == "test_model_exhausted"
