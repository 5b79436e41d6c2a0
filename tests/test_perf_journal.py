"""What the journal's cheaper per-event path keeps exactly as it was (issue 17).

A live reply's payload is built in one step (`reply_payload`) and must be the record's
(`reply_record(...).to_payload()`) key for key; the journal builds its own envelopes and
batches without their constructors' checks and must give what the constructors give; the
memory store makes the event a reader waits on only when one waits; a command id no store
can keep is refused before the projection moves; a plain result is stored as the converter
stores it.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent import ConfigError
from trio_agent._journal._conversation import reply_payload, reply_record
from trio_agent._journal._durable import open_journal
from trio_agent._journal._events import (
    EventEnvelope,
    ModelAttemptCompleted,
    RequestAccepted,
    RequestStarted,
    model_attempt_replied,
    place_event,
)
from trio_agent._journal._memory import MemoryStore
from trio_agent._journal._projection import RequestState, SessionState, ToolState
from trio_agent._journal._run_recorder import JournalRecorder
from trio_agent._journal._snapshot import _results, result_to_json
from trio_agent._journal._store import AppendBatch, command_digest
from trio_agent._journal._stored import StoredIndex
from trio_agent._json import json_problem
from trio_agent._loop._ports import TurnRef
from trio_agent._models._assemble import ReplyAssembler
from trio_agent._models._messages import (
    MAX_TOKEN_COUNT,
    FinishChunk,
    FinishReason,
    ReasoningDelta,
    StreamChunk,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    UsageChunk,
)
from trio_agent._models._service import _chunk_problem
from trio_agent._tools._results import ToolErrorType, ToolResult, json_copy


def assemble(chunks: list[StreamChunk]) -> Any:
    assembler = ReplyAssembler()
    for chunk in chunks:
        assembler.feed(chunk)
    return assembler.finish()


REPLIES = [
    [TextDelta("done"), FinishChunk(FinishReason.STOP)],
    [
        ReasoningDelta("Weather first"),
        ReasoningDelta(signature="sig"),
        ReasoningDelta(redacted_data="opaque"),
        TextDelta("Checking."),
        TextDelta(" Twice."),
        ToolCallStart(0, "toolu_1", "get_weather"),
        ToolCallEnd(0, "toolu_1", "get_weather", '{"city": "Paris"}'),
        ToolCallStart(1, "", "get_time"),
        ToolCallEnd(1, "", "get_time", "{}"),
        UsageChunk(Usage(10, 20, 30, cached_input_tokens=4, cache_creation_input_tokens=0, reasoning_tokens=12)),
        FinishChunk(FinishReason.TOOL_CALLS),
    ],
    [ToolCallStart(0, "c", "add"), ToolCallEnd(0, "c", "add", '{"a": 1}'), FinishChunk(FinishReason.LENGTH)],
]


@pytest.mark.parametrize("chunks", REPLIES)
@pytest.mark.parametrize("inputs", [(), ["also this", "and this"]])
def test_reply_payload_is_the_records_payload(chunks: list[StreamChunk], inputs: list[str]) -> None:
    reply = assemble(chunks)
    rejected = {reply.tool_calls[-1].id: "unknown tool"} if reply.tool_calls else None
    expected = reply_record(reply, inputs=inputs, rejected=rejected).to_payload()
    payload = reply_payload(reply, inputs=inputs, rejected=rejected)
    assert payload == expected
    # Key order too: it is the order of the stored JSON text.
    assert json.dumps(payload) == json.dumps(expected)


def test_reply_payload_refuses_rejections_of_calls_it_does_not_have() -> None:
    reply = assemble([TextDelta("x"), FinishChunk(FinishReason.STOP)])
    with pytest.raises(ValueError, match="rejected ids"):
        reply_payload(reply, rejected={"b": "x"})


def test_placed_envelope_and_batch_are_the_constructors() -> None:
    event = RequestStarted(request_id="r1")
    placed = place_event("s/root", 3, event, 1.5)
    built = EventEnvelope(stream_id="s/root", seq=3, event=event, recorded_at=1.5)
    assert placed == built and hash(placed) == hash(built) and repr(placed) == repr(built)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        placed.seq = 4  # type: ignore[misc]
    batch = AppendBatch.placed("s", "s/root", 7, (placed,), "c", command_digest((placed,)))
    assert batch == AppendBatch("s", "s/root", 7, (built,), "c", command_digest((built,)))
    assert (batch.first_seq, batch.last_seq) == (3, 3)


def test_state_enums_hash_by_identity_and_still_read_by_value() -> None:
    assert {ToolState.STARTED: 1}[ToolState("started")] == 1
    assert RequestState("paused") is RequestState.PAUSED and SessionState.OPEN.value == "open"
    assert ToolState.COMPLETED.settled and not ToolState.STARTED.settled


def test_stored_index_get_reads_through_the_stored_text() -> None:
    index: StoredIndex[int] = StoredIndex(encode=lambda key, value: value, decode=lambda key, row: row, what="t")
    index["a"] = 1
    text, count = index.to_text()
    stored: StoredIndex[int] = StoredIndex(
        encode=lambda key, value: value, decode=lambda key, row: row, what="t", line=text, count=count
    )
    assert stored.get("b") is None and stored.get("b", 5) == 5 and stored.stored  # absent: text left alone
    assert stored.get("a") == 1 and not stored.stored


async def test_a_reader_waiting_on_the_memory_store_wakes_on_the_next_append() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id="s") as journal:
        stream_id = journal.stream_id()
        head = await store.head(stream_id)
        woke = trio.Event()

        async def wait() -> None:
            await store.wait_for_append(stream_id, head)
            woke.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert not woke.is_set()
            await journal.append(RequestAccepted(request_id="r", command_id="r", input={"prompt": "p"}))
            with trio.fail_after(1):
                await woke.wait()


async def test_a_command_id_no_store_can_keep_is_refused_before_the_projection_moves() -> None:
    async with open_journal(MemoryStore(), session_id="s") as journal:
        head = journal.projection().head
        with pytest.raises(ConfigError, match="command id"):
            await journal.append(
                RequestAccepted(request_id="r", command_id="r", input={"prompt": "p"}), command_id="bad\x00id"
            )
        assert journal.projection().head == head and not journal.fenced
        await journal.append(RequestAccepted(request_id="r", command_id="r", input={"prompt": "p"}), command_id="r")
        assert journal.projection().request("r") is not None


@pytest.mark.parametrize(
    "result",
    [
        ToolResult.success(3),
        ToolResult.success("text", display="shown"),
        ToolResult.success(None),
        ToolResult.success(2.5),
        ToolResult.success(True),
        ToolResult.success({"a": [1, {"b": None}]}, metadata={"m": 1}),
        ToolResult.success(3, data={"rows": 1}),
        ToolResult.failure(ToolErrorType.EXECUTION, "boom", code="c"),
    ],
)
def test_a_results_json_is_the_converters(result: ToolResult) -> None:
    expected = json_copy(_results.unstructure(result, ToolResult))
    assert result_to_json(result) == expected
    assert json.dumps(result_to_json(result)) == json.dumps(expected)


# ---------------------------------------------------------------- a live reply's record is JSON by construction


class _Text(str):
    """Text of a str subclass: a chunk may carry one (the service's check accepts subclasses)."""


_texts = st.one_of(st.text(max_size=12), st.text(max_size=6).map(_Text))
_indexes = st.integers(min_value=0, max_value=2**53 - 1) | st.integers(min_value=0, max_value=3)
_counts = st.integers(min_value=0, max_value=MAX_TOKEN_COUNT)
_optional_counts = st.none() | _counts
_chunk = st.one_of(
    st.builds(TextDelta, _texts),
    st.builds(ReasoningDelta, _texts, st.none() | _texts, st.none() | _texts),
    st.builds(ToolCallStart, _indexes, _texts, _texts),
    st.builds(ToolCallDelta, _indexes, _texts),
    st.builds(ToolCallEnd, _indexes, _texts, _texts, _texts),
    st.builds(
        UsageChunk, st.builds(Usage, _counts, _counts, _counts, _optional_counts, _optional_counts, _optional_counts)
    ),
    st.builds(FinishChunk, st.sampled_from(FinishReason), st.none() | _texts),
)


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(_chunk, max_size=12), inputs=st.lists(_texts, max_size=3), data=st.data())
def test_reply_payloads_are_json_by_construction(chunks: list[StreamChunk], inputs: list[str], data: Any) -> None:
    # Whatever chunks the model service lets through, the record of their reply is JSON an event may
    # carry: the journal stores it unwalked (`model_attempt_replied`), as the checked event would.
    assert all(_chunk_problem(chunk) is None for chunk in chunks)
    reply = assemble(chunks)
    ids = [call.id for call in reply.tool_calls]
    rejected = (
        {call_id: data.draw(_texts) for call_id in data.draw(st.lists(st.sampled_from(ids), unique=True))}
        if ids
        else None
    )
    payload = reply_payload(reply, inputs=inputs, rejected=rejected)
    assert json_problem(payload, "the response") is None
    checked = ModelAttemptCompleted(request_id="r", turn_id="t", attempt_id="a", response=payload)
    assert model_attempt_replied("r", "t", "a", payload) == checked
    assert json.loads(json.dumps(payload)) == payload


async def test_a_turn_input_that_is_not_plain_text_gets_the_events_full_check() -> None:
    # Only the reply is JSON by construction; the turn's inputs come from the host, and anything
    # but plain text is judged by the event's own check (which refuses what no journal can hold).
    deferred: list[Any] = []

    class Journal:
        def defer(self, *events: Any, agent_id: str | None = None) -> None:
            deferred.extend(events)

    recorder = JournalRecorder(Journal(), "root")  # type: ignore[arg-type]
    turn = TurnRef("r", "root", 1, "t", "a")
    reply = assemble([TextDelta("done"), FinishChunk(FinishReason.STOP)])
    await recorder.model_call_completed(turn, reply, inputs=["plain", _Text("subclass")], rejected={})
    assert deferred[0].response["inputs"] == ["plain", "subclass"]
    with pytest.raises(ValueError, match="not JSON"):
        await recorder.model_call_completed(turn, reply, inputs=["plain", {"a", "set"}], rejected={})  # type: ignore[list-item]
    assert len(deferred) == 2  # the first call's attempt and turn; nothing of the refused one
