"""The demo behind ``python -m trio_agent demo``: an orchestration on one session.

A root agent surveys a temporary workspace. It lists the files, fans out one
background ``summarizer`` subagent per note (the ``task`` tool with
``background=true``) while it starts a slow ``research`` call, which a user
message sent with ``priority="now"`` steers away. It waits for the summaries
with ``task_output``, asks a foreground ``reviewer`` subagent to check the
configuration file, and writes ``report.md``. Every tool call of every agent
goes through one middleware stack: the demo's live view, then two plugins
(``audit``: audit log and redaction of secrets; ``read-cache``: repeated reads
served from memory). Everything is journalled in a SQLite file; a summary of
that journal closes the run.

Offline by default: the deterministic test model plays every agent (its replies
are computed from the conversation, so the data flows through the tools for
real). ``--provider openai|anthropic --model NAME`` runs the same session on a
real model (the API key comes from ``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY``).
See docs/demo.md.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import signal
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import attrs
import trio

from . import (
    ConfigError,
    DoneEvent,
    HookEvent,
    HookInput,
    HookOutput,
    MiddlewareConfig,
    ModelMiddleware,
    Plugin,
    Priority,
    Progress,
    Provider,
    Session,
    SessionEvent,
    SideEffect,
    SubagentDefinition,
    SubagentEvent,
    SubagentHandle,
    SubagentStatus,
    TextDeltaEvent,
    Tool,
    ToolContext,
    ToolKind,
    ToolMessage,
    ToolProgressEvent,
    ToolResult,
    ToolResultEvent,
    ToolUseEvent,
    UsageEvent,
    define_plugin,
    define_tool,
    open_session,
)
from ._groups import unwrap_for_boundary  # the demo's own Ctrl-C handling, not an API
from ._journal._inspect import summarize_calls  # what `python -m trio_agent journal` prints
from ._terminate import INTERRUPTED, TERMINATED, until_stopped
from .journal import EventEnvelope, ModelAttemptCompleted, RequestCompleted, ToolStarted, open_sqlite_store
from .models import (
    AssistantMessage,
    Message,
    ModelRequest,
    StreamChunk,
    ToolCallEnd,
    ToolCallPart,
    ToolResultMessage,
    UserMessage,
)
from .testing import Reply, open_test_model
from .tools import CallNext, ToolMiddlewareRequest

__all__ = ["DEMO_PROMPT", "STEERING_MESSAGE", "run_demo"]

DEMO_PROMPT = "Survey the workspace and write report.md."
STEERING_MESSAGE = "Skip the research: the summaries are enough."
ROOT_PROMPT = """You coordinate a survey of a small workspace of text files.
1. Call list_files.
2. In ONE reply: start one `summarizer` subagent per file under notes/ with the task tool and
   background=true (prompt: "Summarize <path>"), and call research on the workspace's theme.
3. Wait for every summarizer with task_output (block=true).
4. Run the `reviewer` subagent in the foreground (task tool, no background) with the prompt
   "Check config/settings.ini for secrets, and spot-check <the first note's path>".
5. Write report.md with write_report: one line per note, then the review.
6. Answer with one short paragraph."""

_SECRET = re.compile(r"(password|token)\s*=\s*(?!\[redacted\])[^\s'\"]+")
_TOPICS = [
    ("Structured concurrency", "Every task has a parent nursery, so no work outlives the code that started it."),
    ("Cancel scopes", "A cancel scope stops the work inside it; a shielded scope lets cleanup finish."),
    ("Memory channels", "Bounded channels give back-pressure: a fast producer waits for a slow consumer."),
    ("Durable journals", "Every event is committed before anyone acts on it, so a restart can recover."),
    ("Subagents", "A subagent has its own prompt and tools and reports back to the agent that started it."),
    ("Middleware", "Middleware wraps every call in layers: audit, redaction and caching compose."),
    ("Hooks", "Hooks observe the session's lifecycle and may veto what is about to happen."),
    ("Permissions", "Rules, modes and a handler decide, per call, whether a tool may run."),
]


# ---------------------------------------------------------------- the workspace and its tools


async def _make_workspace(root: Path, notes: int) -> None:
    """Write the notes and the configuration under *root*.

    A checkpoint per note: the run's Ctrl-C and SIGTERM are a cancellation (`until_stopped`),
    which lands only at a checkpoint; a plain loop of thousands of writes left them unanswered
    until the last note. What was written goes with the demo's temporary directory."""
    (root / "notes").mkdir(parents=True)
    (root / "config").mkdir()
    for index in range(notes):
        await trio.lowlevel.checkpoint()
        title, sentence = _TOPICS[index % len(_TOPICS)]
        body = "\n".join(
            [f"# {title}", "", sentence] + [f"Point {k + 1}: {sentence.lower()}" for k in range(index % 3)]
        )
        slug = title.lower().replace(" ", "-")
        (root / "notes" / f"{index + 1:02d}-{slug}.md").write_text(body + "\n")
    (root / "config" / "settings.ini").write_text(
        "[service]\nendpoint = https://api.example.com\nuser = demo\npassword=hunter2\n"
    )


_PATH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"path": {"type": "string", "minLength": 1, "description": "a path relative to the workspace"}},
    "required": ["path"],
    "additionalProperties": False,
}


def build_tools(workspace: Path, *, research_seconds: float = 30.0) -> list[Tool[Any]]:
    """The demo's tools over ``workspace``: declared side effects, kinds and affected paths."""

    def inside(path: str) -> Path:
        return workspace / path

    def paths(input: dict[str, Any]) -> list[str]:
        return [str(inside(input["path"]))]

    @define_tool(
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        affected_paths=lambda input: [str(workspace)],
    )
    async def list_files(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """List every file of the workspace (paths relative to it)."""

        def walk() -> list[str]:
            return sorted(str(p.relative_to(workspace)) for p in workspace.rglob("*") if p.is_file())

        files = await trio.to_thread.run_sync(walk)
        return ToolResult.success("\n".join(files), data={"files": files})

    @define_tool(side_effect=SideEffect.PURE, kind=ToolKind.READONLY, input_schema=_PATH_SCHEMA, affected_paths=paths)
    async def read_file(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Read a text file of the workspace."""
        text = await trio.Path(inside(input["path"])).read_text()
        return ToolResult.success(text)

    @define_tool(side_effect=SideEffect.PURE, kind=ToolKind.READONLY, input_schema=_PATH_SCHEMA, affected_paths=paths)
    async def count_words(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Count the words and lines of a text file, reporting progress line by line."""
        lines = (await trio.Path(inside(input["path"])).read_text()).splitlines()
        words = 0
        for number, line in enumerate(lines, 1):
            words += len(line.split())
            await ctx.emit(Progress(f"line {number}/{len(lines)}", number, len(lines)))
        return ToolResult.success(f"{words} words, {len(lines)} lines", data={"words": words, "lines": len(lines)})

    @define_tool(
        side_effect=SideEffect.IDEMPOTENT,  # the same path and text leave the same file
        kind=ToolKind.WRITE,
        input_schema={
            "type": "object",
            "properties": {"path": {"type": "string", "minLength": 1}, "text": {"type": "string"}},
            "required": ["path", "text"],
            "additionalProperties": False,
        },
        affected_paths=paths,
    )
    async def write_report(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Write (or overwrite) a text file in the workspace."""
        await trio.Path(inside(input["path"])).write_text(input["text"])
        return ToolResult.success(f"wrote {len(input['text'])} characters to {input['path']}")

    @define_tool(
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
        interrupt="cancel",  # a new user message sent with priority="now" cancels it
        input_schema={
            "type": "object",
            "properties": {"topic": {"type": "string", "minLength": 1}},
            "required": ["topic"],
            "additionalProperties": False,
        },
    )
    async def research(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Research a topic in the (slow) literature; can be interrupted."""
        await ctx.emit(ToolMessage(f"researching {input['topic']!r}"))
        await trio.sleep(research_seconds)
        return ToolResult.success(f"nothing new on {input['topic']!r}")

    return [list_files, read_file, count_words, write_report, research]


SUMMARIZER = SubagentDefinition(
    name="summarizer",
    description="Summarizes one file: its title, size and gist in one line.",
    system_prompt="Summarize the file you are given in one line: path, word and line counts, title.",
    tools=["read_file", "count_words"],
    max_turns=4,
)
REVIEWER = SubagentDefinition(
    name="reviewer",
    description="Checks configuration files for leaked secrets and spot-checks notes.",
    system_prompt="Review the files you are given. Report leaked secrets. Be brief.",
    tools=["read_file", "list_files"],
    max_turns=4,
)


# ---------------------------------------------------------------- the plugins: audit, redaction, cache


@attrs.define
class AuditLog:
    """What the ``audit`` and ``read-cache`` plugins saw (shared by every agent's calls)."""

    entries: list[tuple[str, str, bool]] = attrs.Factory(list)  # (agent, tool, ok)
    redactions: int = 0
    cache_hits: int = 0


def audit_plugins(log: AuditLog) -> list[Plugin]:
    """``audit`` (audit log outermost, then redaction) and ``read-cache`` (innermost)."""

    async def audit(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        result = await call_next()
        log.entries.append((request.context.agent_id, request.tool_name, result.ok))
        return result

    async def redact(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        result = await call_next()
        if isinstance(result.output, str) and _SECRET.search(result.output):
            log.redactions += 1
            return attrs.evolve(result, output=_SECRET.sub(r"\1=[redacted]", result.output))
        return result

    cache: dict[str, ToolResult] = {}

    async def cache_reads(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        key = request.input.get("path") if request.tool_name == "read_file" else None
        if not isinstance(key, str):  # not a read, or an input the tool's validation will refuse
            return await call_next()
        if key in cache:
            log.cache_hits += 1
            hit = cache[key]  # a short-circuit: the journal records a synthetic start
            return attrs.evolve(hit, metadata={**hit.metadata, "cache": "hit"})
        result = await call_next()
        if result.ok:
            cache[key] = result
        return result

    return [
        define_plugin(name="audit", middleware=MiddlewareConfig(tool=[audit, redact])),
        define_plugin(name="read-cache", middleware=MiddlewareConfig(tool=[cache_reads])),
    ]


# ---------------------------------------------------------------- the offline script


def _results(messages: Sequence[Message], tool: str) -> list[tuple[dict[str, Any], str]]:
    """``(arguments, result text)`` of every call of ``tool`` in a conversation, in order."""
    calls: dict[str, dict[str, Any]] = {}
    found: list[tuple[dict[str, Any], str]] = []
    for message in messages:
        if isinstance(message, AssistantMessage):
            for part in message.parts:
                if isinstance(part, ToolCallPart) and part.name == tool:
                    calls[part.id] = part.parsed_arguments()
        elif isinstance(message, ToolResultMessage) and message.tool_call_id in calls:
            found.append((calls[message.tool_call_id], message.content))
    return found


def _offline_reply(request: ModelRequest) -> Reply:
    """The test model's reply for every agent: a function of the conversation so far."""
    agent = str(request.metadata.get("agent_id", "root"))
    messages = request.messages
    step = sum(isinstance(message, AssistantMessage) for message in messages)
    prompt = next((m.content for m in messages if isinstance(m, UserMessage)), "")
    latency = 0.01  # simulated model time; subagents think a little longer than the root
    if agent.startswith("summarizer-"):
        latency = 0.04
        path = prompt.removeprefix("Summarize ").strip()
        if step == 0:
            return Reply("", [("read_file", {"path": path}), ("count_words", {"path": path})], latency=latency)
        text = _results(messages, "read_file")[0][1]
        counts = _results(messages, "count_words")[0][1]
        title = text.splitlines()[0].lstrip("# ") if text else "?"
        return Reply(f"{path}: {counts}, {title!r}", latency=latency)
    if agent.startswith("reviewer-"):
        note = prompt.rsplit(" ", 1)[-1]
        if step == 0:
            return Reply(
                "", [("read_file", {"path": "config/settings.ini"}), ("read_file", {"path": note})], latency=latency
            )
        config = _results(messages, "read_file")[0][1]
        secret = next((line for line in config.splitlines() if "password" in line), "no password line")
        return Reply(
            f"config/settings.ini shows {secret}, so no secret reaches the model; {note} is intact.", latency=latency
        )
    # The root agent.
    if step == 0:
        return Reply("Let me look at the workspace first.", [("list_files", {})], latency=latency)
    files = _results(messages, "list_files")[0][1].splitlines()
    notes = [name for name in files if name.startswith("notes/")]
    if step == 1:
        calls: list[tuple[str, Any]] = [
            ("task", {"subagent": "summarizer", "prompt": f"Summarize {name}", "background": True}) for name in notes
        ]
        calls.append(("research", {"topic": "structured concurrency"}))
        return Reply(
            f"Starting {len(notes)} summarizers in the background; researching meanwhile.", calls, latency=latency
        )
    if step == 2:
        started = [re.search(r"subagent (\S+);", text) for _, text in _results(messages, "task")]
        ids = [match.group(1) for match in started if match]
        return Reply(
            "Waiting for the summaries.", [("task_output", {"task_id": i, "block": True}) for i in ids], latency=latency
        )
    if step == 3:
        review = f"Check config/settings.ini for secrets, and spot-check {notes[0]}"
        return Reply("Now the review.", [("task", {"subagent": "reviewer", "prompt": review})], latency=latency)
    if step == 4:
        summaries = [text.split("\n", 1)[-1] for _, text in _results(messages, "task_output")]
        review_text = [text for args, text in _results(messages, "task") if args.get("subagent") == "reviewer"]
        report = "# Workspace report\n\n" + "".join(f"- {line}\n" for line in summaries)
        report += f"\nReview: {review_text[0] if review_text else 'none'}\n"
        return Reply("Writing the report.", [("write_report", {"path": "report.md", "text": report})], latency=latency)
    steered = any(isinstance(m, UserMessage) and m.content == STEERING_MESSAGE for m in messages)
    research = "the research was interrupted by you" if steered else "the research found nothing new"
    return Reply(
        f"Report written to report.md: {len(notes)} notes summarized by background subagents, "
        f"the configuration reviewed, and {research}.",
        latency=latency,
    )


# ---------------------------------------------------------------- the live view


def _short(value: Any, limit: int = 70) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ReplyCounter(ModelMiddleware):
    """Model middleware (shared by every agent): counts the tool calls of each streamed reply.

    Its count is stored when the reply's stream ends, which is before the session
    runs (and reports) any of the reply's tool calls.
    """

    def __init__(self) -> None:
        self.replies: Counter[str] = Counter()
        self.tool_calls: dict[str, int] = {}

    async def wrap_stream(
        self, request: ModelRequest, call_next: Callable[[ModelRequest | None], AsyncIterator[StreamChunk]]
    ) -> AsyncIterator[StreamChunk]:
        agent = str(request.metadata.get("agent_id", "?"))
        count = 0  # request-local state lives in locals: one middleware serves every agent at once
        async for chunk in call_next(request):
            if isinstance(chunk, ToolCallEnd):
                count += 1
            yield chunk
        self.tool_calls[agent] = count
        self.replies[agent] += 1


class LiveView:
    """Prints what happens as it happens, one line per event, the agent in the first column.

    The root agent's session stream gives its text, tool calls and results; subagents'
    tool calls come from a tool middleware (the stack is shared by every agent); subagent
    starts from a SubagentStart hook; background completions from their handles.
    """

    def __init__(self, write: Callable[[str], None], root_id: str = "root") -> None:
        self._write = write  # never blocks (`_Output.live`)
        self.root_id = root_id
        self.counter = ReplyCounter()
        self._text: list[str] = []
        self._shown = 0  # root replies whose header line was printed
        self._open: set[str] = set()
        self._uses = 0  # tool calls of the current root reply seen so far
        self._research: str | None = None
        self.research_running = trio.Event()  # set once research runs alone: the moment to steer
        self.started: list[str] = []  # background task ids, in order

    def line(self, agent: str, text: str) -> None:
        self._write(f"  {agent:<14} {text}")

    # -- the root agent's session stream

    def event(self, event: SessionEvent) -> None:
        if isinstance(event, TextDeltaEvent) and event.agent_id == self.root_id:
            self._text.append(event.text)
            return
        if isinstance(event, UsageEvent):
            return
        if isinstance(event, ToolUseEvent | ToolProgressEvent | ToolResultEvent) and event.agent_id != self.root_id:
            return  # a foreground subagent's calls: shown once, by the subagent_calls middleware
        self._reply_line()
        if isinstance(event, ToolUseEvent):
            self._uses += 1
            self._open.add(event.call_id)
            if event.tool_name == "research":
                self._research = event.call_id
            self.line(event.agent_id, f"→ {event.tool_name} {_short(event.input)}")
        elif isinstance(event, ToolProgressEvent):
            item = event.item
            detail = item.summary if isinstance(item, ToolMessage) else getattr(item, "message", None)
            self.line(event.agent_id, f"  … {detail or item}")
        elif isinstance(event, ToolResultEvent):
            self._open.discard(event.call_id)
            result = event.result
            status = "ok" if result.error is None else result.error.type.value
            self.line(event.agent_id, f"← {event.tool_name} {status}: {_short(result.output)}")
            data = result.data if isinstance(result.data, dict) else {}
            if event.tool_name == "task" and data.get("status") == "running":
                self.started.append(str(data["task_id"]))
        elif isinstance(event, SubagentEvent) and event.status is not SubagentStatus.RUNNING:
            self.line(event.subagent_id, f"■ {event.status.value}: {_short(event.summary)}")
        elif isinstance(event, DoneEvent):
            self.line(self.root_id, f"■ done ({event.stop_reason}, {event.turns} turns)")
        all_started = self._uses == self.counter.tool_calls.get(self.root_id, 0)
        if self._research is not None and all_started and self._open == {self._research}:
            self.research_running.set()  # every other call of its reply has its result

    def _reply_line(self) -> None:
        """The root's text, and how many tool calls its reply made, before what follows the reply."""
        replies = self.counter.replies[self.root_id]
        if self._shown >= replies and not self._text:
            return
        self._shown = replies
        self._uses = 0
        text = "".join(self._text).strip()
        self._text.clear()
        count = self.counter.tool_calls.get(self.root_id, 0)
        plural = "" if count == 1 else "s"
        self.line(self.root_id, f"“{text}”" + (f"  [{count} tool call{plural}]" if count else ""))

    # -- subagents: a tool middleware, a hook, their handles

    async def subagent_calls(self, request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        """Session tool middleware (outermost): shows subagents' calls; the root's are on its stream."""
        agent = request.context.agent_id
        if agent == self.root_id:
            return await call_next()
        self.line(agent, f"→ {request.tool_name} {_short(request.input)}")
        result = await call_next()
        status = "ok" if result.error is None else result.error.type.value
        if result.metadata.get("cache") == "hit":
            status += " (cache hit)"
        self.line(agent, f"← {request.tool_name} {status}: {_short(result.output)}")
        return result

    async def subagent_started(self, input: HookInput) -> HookOutput | None:
        self.line(input.subagent_id or "?", f"■ started ({input.subagent_type}): {_short(input.prompt or '')}")
        return None

    async def watch(self, handle: SubagentHandle) -> None:
        result = await handle.wait()
        self.line(handle.id, f"■ {handle.status.value}: {_short(result or handle.error or '')}")


# ---------------------------------------------------------------- the output

# Lines held for a reader that falls behind before live lines are skipped: a burst of one
# scheduling round of a 5000-note run (every subagent's line at once) fits, a paused pager's
# backlog is bounded (a line is about 100 bytes).
LIVE_BACKLOG = 16_384


class _Output:
    """The demo's output, written by one task (`_write_lines`) so that a reader who pauses (a
    pager, a full pipe) stalls that task's thread, never the event loop: a print that blocked in
    the loop stopped every lease's renewal, and the run failed with `LeaseLostError`.

    `live` never blocks: when the backlog is full the line is skipped, and the next line that
    fits is preceded by how many were (`_skipped_note`). `text` (the header, the report, the
    summary) waits for room: it is never skipped."""

    def __init__(self, send: trio.MemorySendChannel[tuple[int, str]]) -> None:
        self._send = send
        self._skipped = 0

    def live(self, line: str) -> None:
        try:
            self._send.send_nowait((self._skipped, line))
        except trio.WouldBlock:
            self._skipped += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the writer stopped (the reader went away): the run is being cancelled
        else:
            self._skipped = 0

    async def text(self, text: str) -> None:
        await self._send.send((self._skipped, text))
        self._skipped = 0


def _skipped_note(count: int) -> str:
    return f"  {'':<14} … {count} line{'' if count == 1 else 's'} skipped: the reader of this output fell behind"


@asynccontextmanager
async def _open_output(out: TextIO, *, backlog: int = LIVE_BACKLOG) -> AsyncIterator[_Output]:
    """An `_Output` onto *out*; on a normal exit, everything sent is written before it returns."""
    send, receive = trio.open_memory_channel[tuple[int, str]](backlog)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_write_lines, receive, out)
        async with send:
            yield _Output(send)


async def _write_lines(receive: trio.MemoryReceiveChannel[tuple[int, str]], out: TextIO) -> None:
    """Write what arrives, a batch at a time: onto *out*'s file descriptor from a worker thread
    (abandoned if the run is cancelled while the reader does not read), or, for a stream without
    one (a StringIO), with its own ``write``, which does not block."""
    try:
        fd: int | None = out.fileno()
        out.flush()  # what was written before goes first
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError
        fd = None
    encoding = getattr(out, "encoding", None) or "utf-8"
    errors = getattr(out, "errors", None) or "strict"
    async with receive:
        async for skipped, text in receive:
            batch: list[str] = []
            while True:
                if skipped:
                    batch.append(_skipped_note(skipped))
                batch.append(text)
                try:
                    skipped, text = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            data = "\n".join(batch) + "\n"
            if fd is None:
                out.write(data)
            else:
                await trio.to_thread.run_sync(_write_all, fd, data.encode(encoding, errors), abandon_on_cancel=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# ---------------------------------------------------------------- the journal summary

LEGEND = "▸ you say  “…” the model says [its tool calls]  → a tool call  ← its result  … progress  ■ start / end"


async def summarize_journal(path: Path, session_id: str, out: TextIO, *, offline: bool = False) -> dict[str, Any]:
    """Print (and return) the closing summary of one session of a SQLite journal."""
    async with open_sqlite_store(path, readonly=True) as store:
        streams = await store.streams(session_id)
        envelopes: dict[str, list[EventEnvelope]] = {}
        for info in streams:
            envelopes[info.stream_id.split("/", 1)[1]] = list(await store.read(info.stream_id))
    calls = {agent: summarize_calls(events) for agent, events in envelopes.items()}
    every = [call for agent_calls in calls.values() for call in agent_calls]
    outcomes = Counter(call.outcome for call in every)
    events = sum(len(found) for found in envelopes.values())
    synthetic = sum(
        1 for found in envelopes.values() for e in found if isinstance(e.event, ToolStarted) and e.event.synthetic
    )
    attempts = [e.event for found in envelopes.values() for e in found if isinstance(e.event, ModelAttemptCompleted)]
    tokens_in = sum(int(a.response.get("usage", {}).get("input_tokens", 0)) for a in attempts)
    tokens_out = sum(int(a.response.get("usage", {}).get("output_tokens", 0)) for a in attempts)
    requests = sum(1 for found in envelopes.values() for e in found if isinstance(e.event, RequestCompleted))

    print("\njournal summary", file=out)
    print(f"  {path.name}: session {session_id}, {len(envelopes)} agent streams, {events} events", file=out)
    print(f"  calls: {len(every)}  " + "  ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())), file=out)
    by_tool: dict[str, list[float]] = {}
    for call in every:
        if call.duration is not None:
            by_tool.setdefault(call.tool_name, []).append(call.duration * 1000)
    for name, durations in sorted(by_tool.items()):
        print(
            f"  {name:<12} {len(durations):>3} calls  mean {sum(durations) / len(durations):8.2f} ms"
            f"  max {max(durations):8.2f} ms",
            file=out,
        )
    # Grouped by kind of agent ("summarizer-17" is one of the summarizers), so 200 notes stay one short line.
    groups: dict[str, list[int]] = {}
    for agent, found in calls.items():
        groups.setdefault(re.sub(r"-\d+$", "", agent), []).append(len(found))
    per_agent = ", ".join(
        f"{kind} {counts[0]}"
        if len(counts) == 1
        else f"{len(counts)} {kind}s {sum(counts)} (at most {max(counts)} each)"
        for kind, counts in groups.items()
    )
    print(f"  calls per agent: {per_agent}", file=out)
    print(f"  requests completed: {requests}  model calls: {len(attempts)}", file=out)
    estimated = " (estimated by the test model)" if offline else ""
    print(f"  tokens: {tokens_in} in, {tokens_out} out{estimated}", file=out)
    print(f"  calls answered from the cache (the tool did not run): {synthetic}", file=out)
    return {"calls": len(every), "outcomes": dict(outcomes), "streams": len(envelopes), "synthetic": synthetic}


# ---------------------------------------------------------------- the run


@asynccontextmanager
async def _provider(provider: str | None, model: str | None) -> AsyncIterator[Provider | str]:
    if provider is None:
        async with open_test_model(respond=_offline_reply, model=model or "test-model") as test_model:
            yield test_model
    else:
        yield provider  # created (and closed) by open_session, by name


async def _demo(out: TextIO, *, calls: int, provider: str | None, model: str | None, journal: str | None) -> None:
    async with _open_output(out) as output:
        await _run(output, calls=calls, provider=provider, model=model, journal=journal)


async def _run(output: _Output, *, calls: int, provider: str | None, model: str | None, journal: str | None) -> None:
    with tempfile.TemporaryDirectory(prefix="trio-agent-demo-") as tmp:
        workspace = Path(tmp) / "workspace"
        await _make_workspace(workspace, calls)
        journal_path = Path(journal) if journal else Path(tmp) / "journal.db"
        log = AuditLog()
        live = LiveView(output.live)
        async with _provider(provider, model) as chosen:
            async with open_session(
                provider=chosen,
                model=model,
                system_prompt=ROOT_PROMPT,
                tools=build_tools(workspace, research_seconds=30.0 if provider is None else 3.0),
                plugins=audit_plugins(log),
                middleware=MiddlewareConfig(model=[live.counter], tool=[live.subagent_calls]),
                hooks={HookEvent.SUBAGENT_START: [live.subagent_started]},
                permissions={"allow": ["write_report"]},  # a write: the default mode would ask
                workspace_roots=[workspace],
                subagents=[SUMMARIZER, REVIEWER],
                journal=journal_path,
            ) as session:
                await output.text(
                    f"trio_agent demo: model {session.model}; {calls} notes; session {session.session_id}\n"
                    f"  workspace {workspace}\n  journal   {journal_path}"
                    + ("" if journal else "  (temporary: deleted when the demo ends; --journal PATH keeps it)")
                    + f"\n  legend    {LEGEND}\n"
                )
                await _orchestrate(session, live)
                report = trio.Path(workspace / "report.md")
                if await report.exists():
                    lines = (await report.read_text()).splitlines()
                    await output.text("\nreport.md\n" + "\n".join(f"  | {line}" for line in lines))
            session_id = session.session_id
        summary = io.StringIO()
        await summarize_journal(journal_path, session_id, summary, offline=provider is None)
        print(
            f"  audit log: {len(log.entries)} entries; redacted results: {log.redactions}; "
            f"cache hits: {log.cache_hits}",
            file=summary,
        )
        if journal:
            print(f"\ninspect it: python -m trio_agent journal show {journal} --session {session_id}", file=summary)
        await output.text(summary.getvalue().removesuffix("\n"))


async def _orchestrate(session: Session, live: LiveView) -> None:
    """One request, streamed; a steering message; a watcher per background subagent."""
    async with trio.open_nursery() as nursery:

        async def steer() -> None:
            await live.research_running.wait()
            live.line("you", f"▸ (priority='now') {STEERING_MESSAGE}")
            await session.send(STEERING_MESSAGE, priority=Priority.NOW)  # joins the running request

        nursery.start_soon(steer)
        watched = 0
        live.line("you", f"▸ {DEMO_PROMPT}")
        async with session.stream(DEMO_PROMPT) as events:
            async for event in events:
                live.event(event)
                while watched < len(live.started):
                    handle = session.subagents.get(live.started[watched])
                    if handle is not None:
                        nursery.start_soon(live.watch, handle)
                    watched += 1
        # The answer is in; give background work a moment, then stop waiting (the session
        # cancels and records whatever still runs when it closes).
        with trio.move_on_after(5.0):
            for handle in list(session.subagents.values()):
                await handle.wait()
        nursery.cancel_scope.cancel()


def run_demo(
    *,
    calls: int = 6,
    out: TextIO | None = None,
    provider: str | None = None,
    model: str | None = None,
    journal: str | None = None,
) -> int:
    """Run the demo; returns the exit status (2 for a configuration error such as a missing API key)."""
    stream = out or sys.stdout
    if provider is not None and not model:
        print(f"error: --model is required with --provider {provider}", file=sys.stderr)
        return 2
    if calls < 1:
        print(f"error: --calls must be at least 1, not {calls}", file=sys.stderr)
        return 2
    try:
        demo = functools.partial(_demo, stream, calls=calls, provider=provider, model=model, journal=journal)
        stopped_by = trio.run(until_stopped, demo)
    except BaseException as raised:  # one line, never a group traceback
        exc = unwrap_for_boundary(raised) if isinstance(raised, BaseExceptionGroup) else raised
        if isinstance(exc, KeyboardInterrupt):  # a Ctrl-C before the signal receiver is installed
            print("interrupted", file=sys.stderr)
            return INTERRUPTED
        if isinstance(exc, BrokenPipeError):
            raise exc from None  # the reader of our output went away: the command line stops quietly
        if isinstance(exc, ConfigError):  # e.g. ProviderConfigError: no API key
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, Exception):  # e.g. a real model refused the request, or the network is down
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        raise
    if stopped_by is signal.SIGINT:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    if stopped_by is signal.SIGTERM:
        print("terminated", file=sys.stderr)
        return TERMINATED
    return 0
