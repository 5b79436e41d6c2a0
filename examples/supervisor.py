"""A supervisor agent with specialist subagents, called in the foreground.

Run it with ``python examples/supervisor.py``. The root agent delegates with the
``task`` tool and waits for each answer (foreground): two ``researcher`` calls in
one reply (they run at the same time), then a ``writer`` that writes
``guide.md`` from the research, then a ``reviewer`` that reads it. Each
specialist has its own system prompt and tool allowlist: the reviewer may read
but not write, and its attempt to edit the file is refused. One tool
middleware traces every agent's calls (the session's middleware stack is shared
by all its agents).

The deterministic test model plays every agent (no API key); its replies are
computed from the conversation, so the research really reaches the writer
through the supervisor. See docs/subagents.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import trio

from trio_agent import MiddlewareConfig, SubagentDefinition, Tool, ToolContext, ToolResult, define_tool, open_session
from trio_agent.models import AssistantMessage, ModelRequest, ToolResultMessage, UserMessage
from trio_agent.testing import Reply, open_test_model
from trio_agent.tools import CallNext, ToolMiddlewareRequest

DOCS = {
    "cancel scopes": "A cancel scope cancels everything inside it; move_on_after makes one with a deadline.",
    "shielding": "A shielded scope ignores outside cancellation: use it, with a deadline, for cleanup.",
}
PROMPT = "Write a short guide to Trio cancel scopes in guide.md."


def build_tools(workspace: Path) -> list[Tool[Any]]:
    def path_of(input: dict[str, Any]) -> list[str]:
        return [str(workspace / input["path"])]

    path_schema = {
        "type": "object",
        "properties": {"path": {"type": "string", "minLength": 1}},
        "required": ["path"],
        "additionalProperties": False,
    }

    @define_tool(
        side_effect="pure",
        kind="readonly",
        input_schema={
            "type": "object",
            "properties": {"query": {"type": "string", "minLength": 1}},
            "required": ["query"],
            "additionalProperties": False,
        },
    )
    async def search_docs(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Search the Trio documentation."""
        await trio.sleep(0.05)
        hits = [text for topic, text in DOCS.items() if topic in input["query"].lower()]
        return ToolResult.success(" ".join(hits) or "no match")

    @define_tool(side_effect="pure", kind="readonly", input_schema=path_schema, affected_paths=path_of)
    async def read_file(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Read a file of the workspace."""
        return ToolResult.success(await trio.Path(workspace / input["path"]).read_text())

    @define_tool(
        side_effect="idempotent",  # the same path and text leave the same file
        kind="write",
        input_schema={
            "type": "object",
            "properties": {"path": {"type": "string", "minLength": 1}, "text": {"type": "string"}},
            "required": ["path", "text"],
            "additionalProperties": False,
        },
        affected_paths=path_of,
    )
    async def write_file(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Write a file of the workspace."""
        await trio.Path(workspace / input["path"]).write_text(input["text"])
        return ToolResult.success(f"wrote {input['path']} ({len(input['text'])} characters)")

    return [search_docs, read_file, write_file]


SPECIALISTS = [
    SubagentDefinition(
        name="researcher",
        description="Finds what the documentation says about one topic.",
        system_prompt="Search the docs for the topic you are given; answer with what they say.",
        tools=["search_docs"],
    ),
    SubagentDefinition(
        name="writer",
        description="Writes a file from notes.",
        system_prompt="Write the file you are asked for from the notes you are given.",
        tools=["write_file"],
    ),
    SubagentDefinition(
        name="reviewer",
        description="Reviews a file; never edits it.",
        system_prompt="Read the file you are given and review it. You cannot edit files.",
        tools=["read_file"],  # read-only: write_file is not on its allowlist
    ),
]


def _results(messages: tuple[Any, ...], tool: str) -> list[str]:
    names = {
        part.id: part.name
        for message in messages
        if isinstance(message, AssistantMessage)
        for part in message.tool_calls
    }
    return [m.content for m in messages if isinstance(m, ToolResultMessage) and names.get(m.tool_call_id) == tool]


def model_reply(request: ModelRequest) -> Reply:
    """Every agent's reply, computed from its conversation (the test model stands in for a real one)."""
    agent = str(request.metadata.get("agent_id", ""))
    messages = request.messages
    step = sum(isinstance(m, AssistantMessage) for m in messages)
    prompt = next(m.content for m in messages if isinstance(m, UserMessage))
    if agent.startswith("researcher-"):
        if step == 0:
            return Reply("", [("search_docs", {"query": prompt})])
        return Reply(_results(messages, "search_docs")[0])
    if agent.startswith("writer-"):
        if step == 0:
            notes = prompt.split("\n", 1)[1]
            text = "# Cancel scopes\n\n" + "".join(f"- {line}\n" for line in notes.splitlines())
            return Reply("", [("write_file", {"path": "guide.md", "text": text})])
        return Reply(_results(messages, "write_file")[0])
    if agent.startswith("reviewer-"):
        if step == 0:  # it tries to edit the file too: its allowlist says no
            edit = ("write_file", {"path": "guide.md", "text": "edited"})
            return Reply("", [edit, ("read_file", {"path": "guide.md"})])
        lines = _results(messages, "read_file")[0].count("\n")
        refused = _results(messages, "write_file")[0]
        return Reply(f"guide.md reads well ({lines} lines). I left it as it is ({refused}).")
    # The supervisor.
    tasks = _results(messages, "task")
    if step == 0:
        return Reply(
            "Two researchers first, at the same time.",
            [
                ("task", {"subagent": "researcher", "prompt": "What do the docs say about cancel scopes?"}),
                ("task", {"subagent": "researcher", "prompt": "What do the docs say about shielding?"}),
            ],
        )
    if step == 1:
        notes = "\n".join(tasks[:2])
        return Reply("", [("task", {"subagent": "writer", "prompt": f"Write guide.md from these notes:\n{notes}"})])
    if step == 2:
        return Reply("", [("task", {"subagent": "reviewer", "prompt": "Review guide.md"})])
    return Reply(f"guide.md is written and reviewed. Review: {tasks[-1]}")


async def main() -> dict[str, Any]:
    trace: list[tuple[str, str, bool]] = []

    async def show_calls(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        """Tool middleware: one line per call of any agent (root and subagents share the stack)."""
        agent = request.context.agent_id
        result = await call_next()
        trace.append((agent, request.tool_name, result.ok))
        shown = str(result.output).replace("\n", " ")
        shown = shown if len(shown) < 72 else shown[:71] + "…"
        print(f"  {agent:<13} {request.tool_name:<11} {'ok ' if result.ok else 'ERR'} {shown}")
        return result

    with tempfile.TemporaryDirectory(prefix="supervisor-") as tmp:
        workspace = Path(tmp)
        async with (
            open_test_model(respond=model_reply) as model,
            open_session(
                provider=model,
                system_prompt="You lead a team of specialists; delegate with the task tool.",
                tools=build_tools(workspace),
                subagents=SPECIALISTS,
                middleware=MiddlewareConfig(tool=[show_calls]),
                permission_mode="accept_edits",  # file writes inside the workspace need no question
                workspace_roots=[workspace],
            ) as session,
        ):
            print(f"user: {PROMPT}")
            answer = await session.send(PROMPT)
            print(f"supervisor: {answer}")
        guide = (workspace / "guide.md").read_text()
    print("guide.md:\n" + "".join(f"  | {line}\n" for line in guide.splitlines()))
    return {"answer": answer, "guide": guide, "trace": trace}


if __name__ == "__main__":
    trio.run(main)
