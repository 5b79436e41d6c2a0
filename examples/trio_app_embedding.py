"""A Trio application that runs a session beside its own tasks.

Run it with ``python examples/trio_app_embedding.py``. One nursery holds the
application's tasks: a ticker (the app stays responsive while agents work), a
producer that sends prompts with priorities (as a chat UI would), a dispatcher
that hands them to the session, and a watchdog. It shows what each priority does
while a request runs:

* no priority: refused with `SessionBusyError` (one request at a time);
* ``"next"``: joins the running request at its next turn;
* ``"later"``: queued as a new request, run after the current one;
* ``"now"``: joins and steers: a running ``interrupt="cancel"`` tool is cancelled;

then ``session.abort()`` from the watchdog (the caller gets `RequestAbortedError`),
``session.set_model()``, and a last request on the same session. The deterministic
test model answers (its script is keyed by the conversation's first message). See
docs/sessions.md.
"""

from __future__ import annotations

from typing import Any

import trio

from trio_agent import (
    RequestAbortedError,
    SessionBusyError,
    ToolContext,
    ToolResult,
    define_tool,
    open_session,
)
from trio_agent.testing import Reply, open_test_model

FIRST = "Summarize today's logs."
SCRIPT = {
    # Every request of the root agent reads this script in order: one conversation.
    FIRST: [
        Reply("Reading the logs.", [("tail_logs", {"lines": 50})], latency=0.02),
        Reply("50 lines, all services up; 2 errors, as you asked me to count.", latency=0.02),
        Reply("Status update: all services up, 2 errors under investigation.", latency=0.02),
        Reply("Scanning the archive.", [("scan_archive", {})], latency=0.02),
        Reply("Stopped scanning, as you asked: nothing unusual so far.", latency=0.02),
        Reply("Rebuilding the search index.", [("rebuild_index", {})], latency=0.02),
        Reply("Yes, still here: the index rebuild was aborted; everything else is done.", latency=0.02),
    ]
}
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}


@define_tool(
    side_effect="pure",
    kind="readonly",
    input_schema={"type": "object", "properties": {"lines": {"type": "integer", "minimum": 1}}},
)
async def tail_logs(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
    """The last lines of today's logs."""
    await trio.sleep(0.3)
    return ToolResult.success(f"{input.get('lines', 10)} lines, 2 errors")


@define_tool(side_effect="pure", kind="readonly", interrupt="cancel", input_schema=EMPTY)
async def scan_archive(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
    """Scan the whole archive (slow; a new message with priority "now" cancels it)."""
    await trio.sleep(10)
    return ToolResult.success("nothing unusual")


@define_tool(side_effect="idempotent", kind="execute", input_schema=EMPTY)
async def rebuild_index(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
    """Rebuild the search index (slow)."""
    await trio.sleep(10)
    return ToolResult.success("index rebuilt")


async def main() -> dict[str, Any]:
    start = trio.current_time()
    outcomes: dict[str, str] = {}
    finished: dict[str, trio.Event] = {}
    ticks = 0

    def say(who: str, text: str) -> None:
        print(f"{trio.current_time() - start:5.2f}s  {who:<10} {text}")

    async with (
        open_test_model(SCRIPT) as model,
        open_session(
            provider=model,
            tools=[tail_logs, scan_archive, rebuild_index],
            permissions={"allow": ["rebuild_index"]},  # an "execute" tool: the default mode would ask
        ) as session,
        trio.open_nursery() as app,
    ):

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.25)
                ticks += 1
                say("ticker", f"tick {ticks} (the app's own task keeps running)")

        async def ask(prompt: str, priority: str | None) -> None:
            try:
                answer = await session.send(prompt, priority=priority)
            except SessionBusyError as exc:
                outcomes[prompt] = "busy"
                say("session", f"refused {prompt!r}: {exc}")
            except RequestAbortedError as exc:
                outcomes[prompt] = "aborted"
                say("session", f"aborted {prompt!r}: {exc}")
            else:
                outcomes[prompt] = answer
                say("agent", f"{answer}   (for {prompt!r})")
            finally:
                finished[prompt].set()

        async def dispatcher(prompts: trio.MemoryReceiveChannel[tuple[str, str | None]]) -> None:
            async with trio.open_nursery() as asks, prompts:
                async for prompt, priority in prompts:
                    asks.start_soon(ask, prompt, priority)

        async def producer(prompts: trio.MemorySendChannel[tuple[str, str | None]]) -> None:
            async def send(prompt: str, priority: str | None = None, *, then: float = 0.1) -> trio.Event:
                finished[prompt] = trio.Event()
                say("user", f"{prompt!r}" + (f" (priority={priority!r})" if priority else ""))
                await prompts.send((prompt, priority))
                await trio.sleep(then)
                return finished[prompt]

            async with prompts:
                first = await send(FIRST)  # runs at once; its tool takes 0.3 s
                await send("Count the errors too.", "next")  # joins it at its next turn
                later = await send("Then draft a status update.", "later")  # queued behind it
                await send("What time is it?")  # refused: a request is running
                await first.wait()
                await later.wait()
                scan = await send("Scan the whole archive.")  # its tool would take 10 s...
                await send("Stop scanning, just tell me what you have.", "now")  # ...a steering message cancels it
                await scan.wait()
                rebuild = await send("Rebuild the search index.")
                await watchdog()  # aborts it
                await rebuild.wait()
                session.set_model("test-model-large")  # the same middleware stack, another model
                await send(f"Are you still there? (now on {session.model})")

        async def watchdog() -> None:
            say("watchdog", "the request runs too long: session.abort()")
            await session.abort(message="the watchdog's deadline passed")

        app.start_soon(ticker)
        send_channel, receive_channel = trio.open_memory_channel[tuple[str, str | None]](16)
        async with trio.open_nursery() as work:
            work.start_soon(dispatcher, receive_channel)
            work.start_soon(producer, send_channel)
        app.cancel_scope.cancel()  # the work is done: stop the ticker (the session closes next)
    say("app", f"done: {len(outcomes)} prompts, {ticks} ticks")
    return {"outcomes": outcomes, "ticks": ticks}


if __name__ == "__main__":
    trio.run(main)
