"""The offline demo behind ``python -m trio_agent demo``.

For now it shows the model service and the tool pipeline: the offline test model
streams a plan with tool calls, which run concurrently in a nursery through
audit / redaction / cache middleware over a temporary workspace; one call is
steered away mid-run; the tool results go back to the model for its final
answer; a closing summary of the journal follows. No network, no API key.
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from ._abort import AbortHandle, AbortReason
from ._models._messages import (
    AssistantMessage,
    Message,
    StreamChunk,
    TextDelta,
    TextPart,
    ToolCallEnd,
    ToolCallPart,
    ToolResultMessage,
    UserMessage,
)
from ._models._service import ModelMiddleware, ModelRequest, ModelService
from ._models._test_model import Reply, TestModel
from ._tools._context import CallOrigin, ToolCall, ToolContext, ToolMiddlewareRequest
from ._tools._definition import SideEffect, ToolKind, define_tool
from ._tools._lifecycle import InMemoryToolJournal
from ._tools._pipeline import CallNext, ToolExecutionRecord, ToolPipeline
from ._tools._results import Progress, ToolItem, ToolMessage, ToolResult

_SECRET = re.compile(r"(password|token)=\S+")


@attrs.frozen
class WriteInput:
    path: str
    text: str


@attrs.frozen
class ReadInput:
    path: str


@attrs.frozen
class CountInput:
    text: str


@attrs.frozen
class ResearchInput:
    topic: str


def _build_tools(workspace: Path) -> list[Any]:
    def inside(path: str) -> Path:
        return workspace / path

    @define_tool(
        side_effect=SideEffect.IDEMPOTENT,
        kind=ToolKind.WRITE,
        affected_paths=lambda input: [str(inside(input["path"]))],
    )
    async def write_note(input: WriteInput, ctx: ToolContext) -> ToolResult:
        """Write a note into the workspace (same input, same file: idempotent)."""
        await trio.sleep(0.01)
        inside(input.path).write_text(input.text)
        return ToolResult.success(f"wrote {len(input.text)} characters to {input.path}")

    @define_tool(
        side_effect=SideEffect.PURE,
        kind=ToolKind.READONLY,
        affected_paths=lambda input: [str(inside(input["path"]))],
    )
    async def read_note(input: ReadInput, ctx: ToolContext) -> ToolResult:
        """Read a note from the workspace."""
        await trio.sleep(0.005)
        return ToolResult.success(inside(input.path).read_text())

    @define_tool(side_effect=SideEffect.PURE, kind=ToolKind.READONLY)
    async def word_count(input: CountInput, ctx: ToolContext) -> ToolResult:
        """Count words, reporting progress as it goes."""
        words = input.text.split()
        for index in range(0, len(words), 4):
            await ctx.emit(Progress(f"counted {min(index + 4, len(words))}", index + 4, len(words)))
            await trio.sleep(0.002)
        return ToolResult.success(len(words))

    @define_tool(side_effect=SideEffect.PURE, kind=ToolKind.READONLY, interrupt="cancel")
    async def research(input: ResearchInput, ctx: ToolContext) -> ToolResult:
        """A slow lookup that steering may interrupt."""
        await ctx.emit(ToolMessage(f"researching {input.topic}"))
        await trio.sleep(10)
        return ToolResult.success(f"findings on {input.topic}")

    return [write_note, read_note, word_count, research]


def _middleware(log: list[str]) -> list[Any]:
    async def audit(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        result = await call_next()
        log.append(f"audit {request.context.tool_call_id} {request.tool_name} -> {'ok' if result.ok else 'error'}")
        return result

    async def redact(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        result = await call_next()
        if isinstance(result.output, str) and _SECRET.search(result.output):
            return attrs.evolve(result, output=_SECRET.sub(r"\1=[redacted]", result.output))
        return result

    cache: dict[str, ToolResult] = {}

    async def cache_word_count(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        if request.tool_name != "word_count":
            return await call_next()
        key = request.input["text"]
        if key in cache:
            return cache[key]  # a side-effect-free short-circuit: recorded with a synthetic start
        result = await call_next()
        if result.ok:
            cache[key] = result
        return result

    return [audit, redact, cache_word_count]


def _plan(calls: int) -> list[ToolCall]:
    texts = ["the quick brown fox jumps over the lazy dog", "trio makes structured concurrency concrete"]
    plan: list[ToolCall] = []
    for index in range(calls):
        match index % 4:
            case 0:
                plan.append(
                    ToolCall(f"c{index}", "write_note", {"path": f"note{index}.txt", "text": "password=hunter2"})
                )
            case 1:
                plan.append(ToolCall(f"c{index}", "word_count", {"text": texts[index % 2]}))
            case 2:
                plan.append(ToolCall(f"c{index}", "write_note", {"path": "shared.txt", "text": f"line {index}"}))
            case _:
                plan.append(ToolCall(f"c{index}", "word_count", {"text": texts[index % 2]}))
    plan.append(ToolCall("slow", "research", {"topic": "cancel scopes"}))
    return plan


async def _demo(calls: int, out: Any) -> list[ToolExecutionRecord]:
    log: list[str] = []
    journal = InMemoryToolJournal()
    with tempfile.TemporaryDirectory(prefix="trio-agent-demo-") as tmp:
        workspace = Path(tmp)
        pipeline = ToolPipeline(
            _build_tools(workspace), middleware=_middleware(log), lifecycle=journal, workspace=str(workspace)
        )
        origin = CallOrigin(session_id="demo", agent_id="root", request_id="r1", turn_id="t1")
        steering = AbortHandle()
        records: list[ToolExecutionRecord] = []

        async def on_item(item: ToolItem) -> None:
            if isinstance(item, Progress):
                print(f"  progress  {item.message}", file=out)
            elif isinstance(item, ToolMessage):
                print(f"  message   {item.summary}", file=out)

        async def run(call: ToolCall) -> None:
            record = await pipeline.execute(call, origin, steering=steering, on_item=on_item)
            records.append(record)
            print(
                f"  settled   {call.id:<5} {call.name:<11} {record.status.value:<10} {record.result.output}", file=out
            )

        # The offline test model plans the work: its first reply streams text and tool calls.
        plan = _plan(calls)
        model = TestModel(
            {
                "demo": [
                    Reply(
                        "I will write the notes, count words and research, all at once.",
                        [(c.name, c.input) for c in plan],
                    ),
                    Reply("Done: notes written, words counted; the research was interrupted by you."),
                ]
            }
        )
        service = ModelService(model, [_ChunkCounter(log)])
        conversation: list[Message] = [UserMessage("Write the notes, count the words and research cancel scopes.")]
        reply = await _stream_reply(service, conversation, out)
        planned = [ToolCall(part.id, part.name, part.parsed_arguments()) for part in reply.tool_calls]

        print(f"fanning out {len(planned)} tool calls through audit, redaction and cache middleware", file=out)
        async with trio.open_nursery() as nursery:
            for call in planned:
                nursery.start_soon(run, call)
            await trio.sleep(0.05)  # let the fan-out get going before the user steers
            print("  steering  a new user message interrupts the slow research call", file=out)
            steering.abort(AbortReason.STEERING)

        by_id = {record.call.id: record for record in records}
        conversation.append(reply)
        conversation.extend(
            ToolResultMessage(call.id, str(by_id[call.id].result.output), not by_id[call.id].result.ok)
            for call in planned
        )
        await _stream_reply(service, conversation, out)

        print("second wave: the same word counts again are served by the cache middleware", file=out)
        async with trio.open_nursery() as nursery:
            for index, text in enumerate(
                ["the quick brown fox jumps over the lazy dog", "trio makes structured concurrency concrete"]
            ):
                nursery.start_soon(run, ToolCall(f"w2-{index}", "word_count", {"text": text}))

        # A follow-up read sees what the writes left behind (the redaction applied only to results).
        records.append(await pipeline.execute(ToolCall("final", "read_note", {"path": "note0.txt"}), origin))
        print(f"  settled   final read_note  {records[-1].result.output}", file=out)

    print("\njournal summary", file=out)
    statuses = Counter(record.status.value for record in records)
    print(f"  calls: {len(records)}  " + "  ".join(f"{k}: {v}" for k, v in sorted(statuses.items())), file=out)
    by_tool: dict[str, list[float]] = {}
    for record in records:
        by_tool.setdefault(record.call.name, []).append(record.duration * 1000)
    for name, durations in sorted(by_tool.items()):
        print(
            f"  {name:<11} {len(durations):>3} calls  mean {sum(durations) / len(durations):7.2f} ms"
            f"  max {max(durations):7.2f} ms",
            file=out,
        )
    synthetic = sum(1 for record in records if record.synthetic_start)
    print(f"  cache short-circuits (synthetic starts): {synthetic}", file=out)
    print(f"  journal events: {len(journal.entries)}  audit lines: {len(log)}", file=out)
    return records


class _ChunkCounter(ModelMiddleware):
    """A model middleware in the demo: counts streamed chunks (request-local state stays in locals)."""

    def __init__(self, log: list[str]) -> None:
        self._log = log

    async def wrap_stream(
        self, request: ModelRequest, next: Callable[[ModelRequest | None], AsyncIterator[StreamChunk]]
    ) -> AsyncIterator[StreamChunk]:
        count = 0
        try:
            async for chunk in next(request):
                count += 1
                yield chunk
        finally:
            self._log.append(f"model stream: {count} chunks")


async def _stream_reply(service: ModelService, conversation: list[Message], out: Any) -> AssistantMessage:
    """Stream one model reply, printing text as it arrives; return the assembled message."""
    text: list[str] = []
    calls: list[ToolCallPart] = []
    print("  model     ", end="", file=out)
    async with service.stream(conversation, metadata={"conversation_id": "demo"}) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, TextDelta):
                text.append(chunk.text)
                print(chunk.text, end="", file=out, flush=True)
            elif isinstance(chunk, ToolCallEnd):
                calls.append(ToolCallPart(chunk.id, chunk.name, chunk.arguments))
    print(f"  [{len(calls)} tool calls]" if calls else "", file=out)
    return AssistantMessage((TextPart("".join(text)), *calls))


def run_demo(*, calls: int = 12, out: Any = None) -> int:
    import sys

    trio.run(_demo, max(1, calls), out or sys.stdout)
    return 0
