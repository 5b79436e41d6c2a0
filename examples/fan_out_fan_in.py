"""Fan-out / fan-in over background subagents, driven from application code.

Run it with ``python examples/fan_out_fan_in.py``. The application starts one
background ``forecaster`` subagent per city with `Session.start_subagent`
(fan-out): they run at the same time, as tasks of the session's nursery. It
waits for their handles (fan-in), then asks the root agent to pick a city: the
root finds the subagents' results in its conversation, because a finished
background subagent reports to the agent that started it, at that agent's next
turn.

The deterministic test model plays every agent (no API key): a forecaster
calls the ``forecast`` tool, then answers with what it returned; the root
reads the reports and picks the warmest sunny city. See docs/subagents.md.
"""

from __future__ import annotations

import re
from typing import Any

import trio

from trio_agent import SubagentDefinition, ToolContext, ToolResult, define_tool, open_session
from trio_agent.models import ModelRequest, ToolResultMessage, UserMessage
from trio_agent.testing import Reply, open_test_model

CITIES = ["Lisbon", "Oslo", "Paris", "Rome"]
WEATHER = {
    "Lisbon": ("sunny", 24),
    "Oslo": ("rain", 9),
    "Paris": ("cloudy", 17),
    "Rome": ("sunny", 27),
}
TOOL_SECONDS = 0.2  # each forecast takes this long: together they take about as long as one


@define_tool(
    side_effect="pure",
    kind="readonly",
    input_schema={
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
async def forecast(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
    """Tomorrow's weather for a city."""
    await trio.sleep(TOOL_SECONDS)  # a slow weather service
    sky, celsius = WEATHER[input["city"]]
    return ToolResult.success(f"{input['city']}: {sky}, {celsius} °C", data={"sky": sky, "celsius": celsius})


FORECASTER = SubagentDefinition(
    name="forecaster",
    description="Looks up tomorrow's weather for one city.",
    system_prompt="Look up the forecast for the city you are given and report it in one line.",
    tools=["forecast"],  # its allowlist: nothing else
    max_turns=3,
)


def model_reply(request: ModelRequest) -> Reply:
    """The test model's reply, computed from the conversation (a real model would write it)."""
    messages = request.messages
    results = [m.content for m in messages if isinstance(m, ToolResultMessage)]
    prompts = [m.content for m in messages if isinstance(m, UserMessage)]
    if str(request.metadata.get("agent_id", "")).startswith("forecaster-"):
        city = prompts[0].removeprefix("Forecast for ")
        if not results:
            return Reply("", [("forecast", {"city": city})])
        return Reply(results[-1])
    # The root: the background subagents' reports are in its conversation, one message each.
    reports = re.findall(r"completed\]: (\w+): (\w+), (\d+) °C", "\n".join(prompts))
    sunny = [(int(celsius), city) for city, sky, celsius in reports if sky == "sunny"]
    if not sunny:
        return Reply("No sunny city tomorrow: stay in.")
    celsius, city = max(sunny)
    return Reply(f"Go to {city}: sunny and {celsius} °C, the warmest sunny city of the {len(reports)}.")


async def main() -> dict[str, Any]:
    async with (
        open_test_model(respond=model_reply) as model,
        open_session(provider=model, tools=[forecast], subagents=[FORECASTER]) as session,
    ):
        started = trio.current_time()
        # Fan out: each call returns at once with a handle; the subagent runs in the session's nursery.
        handles = [await session.start_subagent("forecaster", f"Forecast for {city}") for city in CITIES]
        print(f"fan-out: {len(handles)} background subagents: {', '.join(h.id for h in handles)}")

        # Fan in: they all run already, so waiting for them in order costs nothing extra.
        findings: dict[str, str] = {}
        for city, handle in zip(CITIES, handles, strict=True):
            result = await handle.wait()
            findings[city] = result or f"({handle.status.value}: {handle.error})"
            print(f"  {handle.id:<14} {handle.status.value:<9} {findings[city]}")
        elapsed = trio.current_time() - started
        sequential = len(CITIES) * TOOL_SECONDS
        print(f"fan-in: {len(findings)} results in {elapsed:.2f} s (one after another: {sequential:.1f} s)")

        # The root agent sees the subagents' reports at its next turn.
        answer = await session.send("Where should we go for a picnic tomorrow?")
        print(f"root: {answer}")
    return {"findings": findings, "answer": answer, "elapsed": elapsed}


if __name__ == "__main__":
    trio.run(main)
