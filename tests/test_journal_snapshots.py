"""Stream snapshots: a reopen restores each stream from its snapshot and applies only the tail.

* Equivalence (hypothesis): for any valid stream and any snapshot point, the journal
  restored from snapshot + tail holds exactly the state a full replay builds (projection,
  call records, recovery plan, command ids, conversation), on MemoryStore and SQLite; the
  incremental conversation fold equals `fold_conversation` however it is split.
* Damage: a snapshot that fails its checksum, cannot be decoded, has an unknown version,
  lies past the head or whose tail does not apply is ignored with a WARNING, and the
  journal loads as from the events alone. An index line that does not decode (met by the
  first lookup that needs it, a reopen decodes none) is rebuilt from the events, and the
  next snapshot is written from the rebuilt state.
* Fencing: the store refuses a snapshot like an append (stale or expired token, foreign
  stream, past the head); a journal that lost its lease saves none.
* Cost: after 200 close/reopen cycles, a reopen reads a bounded number of events.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_journal_projection import scheduled, started, valid_sequences
from tests.test_journal_stores import lease_on
from trio_agent._errors import (
    ConfigError,
    ForeignStreamError,
    InvalidTransitionError,
    JournalCorruptError,
    JournalError,
    StaleFencingTokenError,
)
from trio_agent._journal._codec import row_checksum
from trio_agent._journal._conversation import ConversationFold, ModelReplyRecord, fold_conversation
from trio_agent._journal._durable import DurableJournal, open_journal
from trio_agent._journal._events import (
    ConversationSeeded,
    Event,
    EventEnvelope,
    InboxNoted,
    InterruptsResolved,
    ModelAttemptCompleted,
    ModelAttemptStarted,
    OutcomeUnknownReason,
    RequestAccepted,
    RequestCompleted,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    RunPaused,
    SessionClosed,
    SessionCloseReason,
    SessionCreated,
    SessionReopened,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    TurnCompleted,
    TurnStarted,
)
from trio_agent._journal._memory import MemoryStore
from trio_agent._journal._projection import RequestState
from trio_agent._journal._snapshot import (
    _LINES,
    FOLD_AFTER,
    SNAPSHOT_VERSION,
    _Stream,
    decode_snapshot,
    encode_snapshot,
)
from trio_agent._journal._store import stream_id_for
from trio_agent._journal._stored import StoredIndex
from trio_agent._models._messages import ToolCallPart, UserMessage
from trio_agent.journal import open_sqlite_store

SID = "s"
ROOT = stream_id_for(SID, "root")
LOGGER = "trio_agent.journal"


def restamp(envelopes: list[EventEnvelope], stream_id: str = ROOT) -> list[EventEnvelope]:
    return [attrs.evolve(e, stream_id=stream_id) for e in envelopes]


def replayed(envelopes: list[EventEnvelope], stream_id: str = ROOT) -> _Stream:
    stream = _Stream(stream_id, stream_id.rsplit("/", 1)[1])
    for envelope in envelopes:
        stream.apply(envelope)
    return stream


# ================================================================ the codec, pure


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_sequences(), st.data())
def test_restored_from_any_point_plus_tail_equals_the_full_replay(envelopes: list[EventEnvelope], data: Any) -> None:
    envelopes = restamp(envelopes)
    cut = data.draw(st.integers(1, len(envelopes)), label="snapshot at")
    prefix = replayed(envelopes[:cut])
    stream = decode_snapshot(ROOT, "root", cut, encode_snapshot(prefix))
    for envelope in envelopes[cut:]:
        stream.apply(envelope)
    full = replayed(envelopes)
    assert stream.projection.snapshot() == full.projection.snapshot()
    assert stream.calls == full.calls
    assert stream.projection.recovery_plan() == full.projection.recovery_plan()
    assert stream.projection.recovery_plan(lambda name: True) == full.projection.recovery_plan(lambda name: True)
    assert stream.folded() == full.folded()
    assert stream.snapshot_seq == cut
    # The encoding is stable: the same state gives the same bytes.
    assert encode_snapshot(stream) == encode_snapshot(full)


def test_a_snapshot_must_name_its_own_stream_and_seq() -> None:
    stream = replayed(
        [EventEnvelope(stream_id=ROOT, seq=1, event=SessionCreated(session_id=SID, agent_id="root"), recorded_at=0.0)]
    )
    body = encode_snapshot(stream)
    with pytest.raises(JournalCorruptError, match="holds s/root@1"):
        decode_snapshot(ROOT, "root", 2, body)
    with pytest.raises(JournalCorruptError, match="holds s/root@1"):
        decode_snapshot("s/other", "other", 1, body)


# ================================================================ the conversation fold, pure

CALLS = ["c1", "c2", "c3"]


SUBAGENTS = ("sub", "fg")


@st.composite
def conversation_events(draw: Any) -> list[Event]:
    """Events the fold reads, in any order (the fold does not judge transitions)."""
    ids = {"request_id": "r", "turn_id": "t"}
    text = st.text(max_size=4)
    settlement = st.sampled_from(CALLS).flatmap(
        lambda call: st.sampled_from(
            [
                ToolCompleted(**ids, call_id=call, result={"output": "ok"}),
                ToolCompleted(**ids, call_id=call, result={"output": {"n": 1}}, published=False),
                ToolFailed(**ids, call_id=call, result={"output": "bad"}),
                ToolCancelled(**ids, call_id=call, reason="stop"),
                ToolCancelled(**ids, call_id=call, reason="stop", result={"output": "cancelled"}),
                ToolOutcomeUnknown(**ids, call_id=call, reason=OutcomeUnknownReason.PROCESS_RESTART),
            ]
        )
    )

    def attempt(n: int) -> Any:
        calls = st.lists(st.sampled_from(CALLS), unique=True, max_size=3)
        inputs = st.lists(st.one_of(text, st.sampled_from(NOTES)), max_size=3)
        return st.tuples(inputs, text, calls, st.data()).map(
            lambda t: ModelAttemptCompleted(
                **ids,
                attempt_id=f"a{n}",
                response=ModelReplyRecord(
                    inputs=t[0],
                    text=t[1],
                    tool_calls=[ToolCallPart(c, "tool", "{}") for c in t[2]],
                    rejected={c: "rejected" for c in t[2][:1] if t[3].draw(st.booleans())},
                ).to_payload(),
            )
        )

    one = st.one_of(
        text.map(lambda p: RequestAccepted(request_id="r", command_id="c", input={"prompt": p})),
        st.just(RequestAccepted(request_id="h", command_id="h", input={"start_subagent": "x"})),
        st.integers(0, 9).flatmap(attempt),
        settlement,
        st.tuples(st.sampled_from(SUBAGENTS), st.booleans()).map(
            lambda t: SubagentStarted(request_id="r", subagent_id=t[0], background=t[1])
        ),
        st.sampled_from(SUBAGENTS).map(lambda sub: SubagentCompleted(request_id="r", subagent_id=sub)),
        st.sampled_from(SUBAGENTS).map(lambda sub: SubagentCancelled(request_id="r", subagent_id=sub, reason="gone")),
        st.sampled_from([None, {}, {"text": "answer"}]).map(lambda o: RequestCompleted(request_id="r", output=o)),
        st.just(
            ConversationSeeded(session_id=SID, conversation={"messages": [{"type": "UserMessage", "content": "s"}]})
        ),
        st.lists(st.sampled_from(NOTES), min_size=1, max_size=3).map(lambda notes: InboxNoted(messages=notes)),
    )
    return _unique_call_ids(draw(st.lists(one, max_size=30)))


NOTES = ["n1", "n2", ""]


def owed_notes(events: list[Event]) -> list[str]:
    """What a reopen owes the model: every noted message, in order, until a completed model attempt
    whose inputs hold it, after every earlier one still owed (in order, others between)."""
    owed: list[str] = []
    for event in events:
        if isinstance(event, InboxNoted):
            owed += event.messages
        elif isinstance(event, ModelAttemptCompleted):
            inputs = list(ModelReplyRecord.from_payload(event.response).inputs)
            while owed and owed[0] in inputs:
                inputs = inputs[inputs.index(owed[0]) + 1 :]
                owed.pop(0)
    return owed


def _unique_call_ids(events: list[Event]) -> list[Event]:
    """*events* with each call id a reply repeats renamed (a live reply never repeats one; a stored
    one that does is corrupt): a settlement still settles the first call of its id."""
    taken: set[str] = set()
    out: list[Event] = []
    for event in events:
        if isinstance(event, ModelAttemptCompleted):
            record = ModelReplyRecord.from_payload(event.response)
            renamed = {c.id: c.id if c.id not in taken else f"{c.id}~{len(taken)}" for c in record.tool_calls}
            taken.update(renamed.values())
            record = attrs.evolve(
                record,
                tool_calls=[attrs.evolve(c, id=renamed[c.id]) for c in record.tool_calls],
                rejected={renamed[k]: v for k, v in record.rejected.items()},
            )
            event = attrs.evolve(event, response=record.to_payload())
        out.append(event)
    return out


def session_notes(events: list[Event]) -> list[Event]:
    """What the session scans: subagent outcomes after the last completed model attempt, but for
    the outcome of a foreground subagent (its `task` call's result told the model): one that ends
    a start with ``background`` false not ended yet."""
    notes: list[Event] = []
    foreground: list[str] = []
    for event in events:
        if isinstance(event, ModelAttemptCompleted):
            notes.clear()
        elif isinstance(event, SubagentStarted):
            if not event.background:
                foreground.append(event.subagent_id)
        elif isinstance(event, SubagentCompleted | SubagentCancelled):
            if event.subagent_id in foreground:
                foreground.remove(event.subagent_id)
            else:
                notes.append(event)
    return notes


def test_a_fold_state_stored_before_foreground_subagents_were_kept_still_reads() -> None:
    """A snapshot's fold state from before the fold kept its running foreground subagents (no
    ``foreground``) reads as none running: its journal has no foreground start either."""
    fold = ConversationFold()
    fold.feed(SubagentCompleted(request_id="r", subagent_id="sub"))
    state, entries, outcomes = fold.to_parts()
    assert state.pop("foreground") == []
    reread = ConversationFold.from_parts(json.loads(json.dumps(state)), entries, outcomes)
    reread.feed(SubagentCancelled(request_id="r", subagent_id="other", reason="gone"))
    assert [e.subagent_id for e in reread.outcomes_since_reply] == ["sub", "other"]
    old = fold.to_json()
    del old["foreground"]
    assert ConversationFold.from_json(old) == fold


def test_a_note_is_owed_until_a_model_call_takes_it_and_one_noted_meanwhile_stays_owed() -> None:
    """A model call takes its inbox whole, first among its inputs: the notes it holds go, in order,
    past messages of the inbox that are no note (a subagent outcome's) and the request's joined ones;
    a note noted while the call ran was not in its inbox and stays owed, even when a joined message
    after it reads the same as a later note."""

    def attempt(n: int, *inputs: str) -> ModelAttemptCompleted:
        payload = ModelReplyRecord(inputs=inputs, text="ok").to_payload()
        return ModelAttemptCompleted(request_id="r", turn_id="t", attempt_id=f"a{n}", response=payload)

    fold = ConversationFold()
    fold.feed(InboxNoted(messages=("a", "b")))
    fold.feed(InboxNoted(messages=("c",), request_id="r"))
    assert fold.undelivered_notes == ("a", "b", "c")
    fold.feed(attempt(1, "a", "[outcome]", "b", "joined"))  # "c" was noted while the call ran
    assert fold.undelivered_notes == ("c",)
    fold.feed(InboxNoted(messages=("d",)))
    fold.feed(attempt(2, "d"))  # "d" is not taken before the owed "c"
    assert fold.undelivered_notes == ("c", "d")
    fold.feed(RunPaused(request_id="r", state={"inputs": ["c", "d"]}))  # a pause before its model call took them
    assert fold.undelivered_notes == ()
    assert fold.to_parts()[0]["noted"] == []
    fold.feed(InboxNoted(messages=("e",)))
    reread = ConversationFold.from_json(json.loads(json.dumps(fold.to_json())))
    assert reread.undelivered_notes == ("e",)
    old = fold.to_json()
    del old["noted"]  # a state stored before notes were journalled: none owed
    assert ConversationFold.from_json(old).undelivered_notes == ()


def session_answer(events: list[Event]) -> dict[str, Any] | None:
    answers = [e.output for e in events if isinstance(e, RequestCompleted) and e.output]
    return answers[-1] if answers else None


@settings(max_examples=300, deadline=None)
@given(conversation_events(), st.lists(st.integers(0, 30), max_size=4))
def test_the_incremental_fold_equals_the_fold_however_it_is_split(events: list[Event], cuts: list[int]) -> None:
    fold = ConversationFold()
    start = 0
    for cut in [*sorted(min(c, len(events)) for c in cuts), len(events)]:
        for event in events[start:cut]:
            fold.feed(event)
        start = max(start, cut)
        # What a snapshot keeps, through JSON text and back: the whole state, or the two parts
        # (the stored entries' text kept undecoded while events append after it, reused, and only
        # the new entries encoded: equal to encoding them all).
        if cut % 2:
            assert fold.messages() == fold_conversation(events[:start])
            fold = ConversationFold.from_json(json.loads(json.dumps(fold.to_json())))
        else:
            state, entries, outcomes = fold.to_parts()
            reread = ConversationFold.from_parts(json.loads(json.dumps(state)), entries, outcomes)
            assert reread.messages() == fold_conversation(events[:start])
            assert json.loads(entries) == reread.to_json()["entries"]
            assert json.loads(outcomes.partition(b" ")[2]) == reread.to_json()["outcomes"]
            fold = ConversationFold.from_parts(json.loads(json.dumps(state)), entries, outcomes)
    assert fold.messages() == fold_conversation(events)
    assert list(fold.outcomes_since_reply) == session_notes(events)
    assert list(fold.undelivered_notes) == owed_notes(events)
    assert fold.last_output == session_answer(events)


def test_the_fold_reports_a_bad_payload_and_keeps_it_in_line() -> None:
    bad = ModelAttemptCompleted(request_id="r", turn_id="t", attempt_id="a1", response={"text": 5})
    stream = _Stream(ROOT, "root")
    stream.track(RequestAccepted(request_id="r", command_id="c", input={"prompt": "hi"}))
    stream.track(RequestStarted(request_id="r"))
    stream.track(bad)
    for _ in range(2):  # asking again reports it again
        with pytest.raises(JournalCorruptError, match="model attempt a1"):
            stream.folded()
    assert stream.fold.messages() == [UserMessage("hi")]
    with pytest.raises(JournalCorruptError):
        ConversationFold.from_json({"entries": "nope"})


# ================================================================ through the journal, on real stores


@asynccontextmanager
async def backend(kind: str) -> AsyncIterator[Any]:
    if kind == "memory":
        yield MemoryStore()
        return
    with tempfile.TemporaryDirectory() as directory:
        async with open_sqlite_store(Path(directory) / "j.db") as sqlite_store:
            yield sqlite_store


async def write_through_journal(journal: DurableJournal, envelopes: list[EventEnvelope]) -> None:
    for envelope in envelopes:
        event = envelope.event
        command = event.command_id if isinstance(event, RequestAccepted) else None
        await journal.append(event, command_id=command)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes=valid_sequences(max_len=40), data=st.data())
async def test_a_reopen_from_snapshot_and_tail_equals_a_full_replay(
    kind: str, envelopes: list[EventEnvelope], data: Any
) -> None:
    envelopes = restamp(envelopes)
    cut = data.draw(st.integers(1, len(envelopes)), label="snapshot at")
    async with backend(kind) as store:
        # open_journal writes the stream's session_created itself: the sequence's first event.
        async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
            await write_through_journal(journal, envelopes[1:cut])
            assert await journal.snapshot_all() == [ROOT]
        async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
            assert journal._streams[ROOT].snapshot_seq == cut
            await write_through_journal(journal, envelopes[cut:])  # appends on a restored projection
        async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
            stored = await store.read(ROOT)
            assert [e.event for e in stored] == [e.event for e in envelopes]
            full = replayed(stored)
            stream = journal._streams[ROOT]
            assert stream.snapshot_seq == cut
            assert journal.projection().snapshot() == full.projection.snapshot()
            assert stream.calls == full.calls
            assert journal.recovery_plan() == full.projection.recovery_plan()
            assert journal.conversation() == fold_conversation(e.event for e in stored)
            commands = {e.event.command_id for e in envelopes if isinstance(e.event, RequestAccepted)}
            assert set(stream.commands) == commands
            # A command applied before the snapshot is recognised: its replay appends nothing.
            for envelope in envelopes[:cut]:
                if isinstance(envelope.event, RequestAccepted):
                    result = await journal.append(envelope.event, command_id=envelope.event.command_id)
                    assert result.replayed and result.first_seq == envelope.seq
            assert journal.projection().head == len(envelopes)


async def test_requests_that_end_without_starting_leave_nothing_in_the_snapshot() -> None:
    """An aborted or refused request that never started is forgotten by the fold when it ends:
    its input does not ride in every later snapshot (which grew with each such request)."""
    store = MemoryStore()
    prompt = "never-started-" * 20
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        for index in range(5):
            rid = f"r{index}"
            await journal.append(RequestAccepted(request_id=rid, command_id=rid, input={"prompt": prompt}))
            await journal.append(RequestInterrupted(request_id=rid, reason=RequestInterruptReason.USER_ABORT))
        await journal.append(RequestAccepted(request_id="ok", command_id="ok", input={"prompt": "hello"}))
        await journal.append(RequestStarted(request_id="ok"))
        assert await journal.snapshot_all() == [ROOT]
    found = await store.load_snapshot(ROOT)
    assert found is not None
    assert prompt.encode() not in bytes(found[1])
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        assert journal._streams[ROOT].snapshot_seq == found[0]
        assert journal.conversation() == [UserMessage("hello")]


async def test_a_crash_after_a_snapshot_recovers_from_snapshot_and_tail() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        await journal.append(RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "go"}))
        await journal.append(RequestStarted(request_id="r1"), TurnStarted(request_id="r1", turn_id="t1", turn=1))
        assert await journal.snapshot_all() == [ROOT]
        # The process dies after this commit: nothing closes the attempt, no snapshot follows.
        await journal.append(ModelAttemptStarted(request_id="r1", turn_id="t1", attempt_id="a1", model="m"))
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        assert journal._streams[ROOT].snapshot_seq == 4
        full = replayed(await store.read(ROOT))
        assert journal.recovery_plan() == full.projection.recovery_plan()
        await journal.recover()
        assert journal.projection().snapshot() != full.projection.snapshot()  # recovery wrote the abort
    assert replayed(await store.read(ROOT)).projection.recovery_plan() == journal.recovery_plan()


@pytest.fixture
def warnings_of(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    yield caplog


def snapshot_row_of(store: Any) -> tuple[int, bytes, int]:
    snap = store._streams[ROOT].snapshot
    assert snap is not None
    return snap  # type: ignore[no-any-return]


async def a_closed_session(store: Any, requests: int = 3) -> list[Event]:
    """A session of a few requests, closed cleanly (its snapshot written on the way out)."""
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        for n in range(requests):
            await one_request(journal, n)
        await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
    return [e.event for e in await store.read(ROOT)]


async def one_request(journal: DurableJournal, n: int) -> None:
    rid, tid, aid = (
        f"r{journal.projection().life}-{n}",
        f"t{journal.projection().life}-{n}",
        f"a{journal.projection().life}-{n}",
    )
    await journal.append(RequestAccepted(request_id=rid, command_id=rid, input={"prompt": f"p{n}"}), command_id=rid)
    await journal.append(
        RequestStarted(request_id=rid),
        TurnStarted(request_id=rid, turn_id=tid, turn=1),
        ModelAttemptStarted(request_id=rid, turn_id=tid, attempt_id=aid, model="m"),
    )
    await journal.append(
        ModelAttemptCompleted(
            request_id=rid, turn_id=tid, attempt_id=aid, response=ModelReplyRecord(text=f"a{n}").to_payload()
        ),
        TurnCompleted(request_id=rid, turn_id=tid, has_tool_calls=False),
        RequestCompleted(request_id=rid, output={"text": f"a{n}"}),
    )


def damage_memory(store: MemoryStore, how: str) -> None:
    seq, body, checksum = snapshot_row_of(store)
    if how == "flip a byte":
        middle = len(body) // 2
        store._streams[ROOT].snapshot = (
            seq,
            body[:middle] + bytes([body[middle] ^ 0x01]) + body[middle + 1 :],
            checksum,
        )
        return
    header, *rest = body.split(b"\n")
    data = json.loads(header)
    if how == "edit the JSON":
        data["projection"]["requests"] = "nope"
    elif how == "unknown version":
        data["version"] = SNAPSHOT_VERSION + 1
    elif how == "another stream":
        data["stream_id"] = "s/other"
    elif how == "a tail that does not follow":
        data["projection"]["session"] = "ended"  # the tail's session_reopened cannot follow
    if how == "past the head":
        seq += 5
        text = body
    else:
        text = b"\n".join([json.dumps(data).encode(), *rest])
    store._streams[ROOT].snapshot = (seq, text, row_checksum(ROOT, seq, text))


DAMAGE = [
    "flip a byte",
    "edit the JSON",
    "unknown version",
    "another stream",
    "past the head",
    "a tail that does not follow",
]


@pytest.mark.parametrize("how", DAMAGE)
async def test_a_damaged_snapshot_is_ignored_with_a_warning(how: str, warnings_of: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    events = await a_closed_session(store)
    if how == "a tail that does not follow":
        async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
            await journal.append(SessionReopened(session_id=SID, life=2))
        events = [e.event for e in await store.read(ROOT)]
    damage_memory(store, how)
    warnings_of.clear()
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        stream = journal._streams[ROOT]
        assert stream.snapshot_seq == 0  # replayed in full
        assert journal.projection().snapshot() == replayed(await store.read(ROOT)).projection.snapshot()
        assert journal.conversation() == fold_conversation(events)
        assert set(stream.commands) == {"r1-0", "r1-1", "r1-2"}
    warned = [r for r in warnings_of.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "ignoring the snapshot of s/root" in warned[0].getMessage()


async def test_sqlite_a_damaged_snapshot_row_is_ignored_with_a_warning(
    tmp_path: Path, warnings_of: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "j.db"
    async with open_sqlite_store(path) as store:
        events = await a_closed_session(store)
        assert (await store.load_snapshot(ROOT)) is not None
    with sqlite3.connect(path) as conn:
        (body,) = conn.execute("SELECT body FROM journal_snapshots WHERE stream_id=?", (ROOT,)).fetchone()
        flipped = bytes(body[:10]) + bytes([body[10] ^ 0x20]) + bytes(body[11:])
        conn.execute("UPDATE journal_snapshots SET body=? WHERE stream_id=?", (flipped, ROOT))
    warnings_of.clear()
    async with open_sqlite_store(path) as store:
        with pytest.raises(JournalCorruptError, match=r"stored snapshot s/root@\d+ is corrupt: checksum mismatch"):
            await store.load_snapshot(ROOT)
        async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
            assert journal._streams[ROOT].snapshot_seq == 0
            assert journal.conversation() == fold_conversation(events)
    assert any("checksum mismatch" in r.getMessage() for r in warnings_of.records if r.name == LOGGER)


async def a_session_left_mid_request(store: MemoryStore, *, tail: bool) -> None:
    """A session whose snapshot holds a live request: started, its turn open, a model attempt
    running; with ``tail``, the attempt completed after the snapshot."""
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        await one_request(journal, 0)
        await journal.append(RequestAccepted(request_id="r", command_id="r", input={"prompt": "p"}), command_id="r")
        await journal.append(
            RequestStarted(request_id="r"),
            TurnStarted(request_id="r", turn_id="t", turn=1),
            ModelAttemptStarted(request_id="r", turn_id="t", attempt_id="a", model="m"),
        )
    if tail:
        async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
            await journal.append(ATTEMPT_COMPLETED)


ATTEMPT_COMPLETED = ModelAttemptCompleted(
    request_id="r", turn_id="t", attempt_id="a", response=ModelReplyRecord(text="x").to_payload()
)


def rewrite_header(store: MemoryStore, how: str) -> None:
    """Rewrite the snapshot's header as *how* says, with a right checksum: a snapshot another
    version of the code could have written, or a restore or a hand edit, that a checksum cannot tell."""
    seq, body, _ = snapshot_row_of(store)
    header, *rest = body.split(b"\n")
    data = json.loads(header)
    projection = data["projection"]
    if how == "open_turn names no turn":
        projection["open_turn"] = "ghost"
    elif how == "running_attempt names no attempt":
        projection["running_attempt"] = "ghost"
    elif how == "active_request names no request":
        projection["active_request"] = "ghost"
    elif how == "a turn filed under another id":
        projection["turns"]["t"]["turn_id"] = "ghost"
    elif how == "an attempt of no request":
        projection["attempts"]["a"]["request_id"] = ""
    elif how == "no live turn for an open one":
        projection["turns"] = {}
    elif how == "a negative count of entries":
        data["lines"]["ended_requests"] = -1
    if how == "a header nested past the recursion limit":
        text = b'{"format":"trio_agent.snapshot","version":3,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    else:
        text = json.dumps(data).encode()
    text = b"\n".join([text, *rest])
    store._streams[ROOT].snapshot = (seq, text, row_checksum(ROOT, seq, text))


CONTRADICTIONS = [
    "open_turn names no turn",
    "running_attempt names no attempt",
    "active_request names no request",
    "a turn filed under another id",
    "an attempt of no request",
    "no live turn for an open one",
    "a negative count of entries",
    "a header nested past the recursion limit",
]


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("how", CONTRADICTIONS)
async def test_a_snapshot_that_contradicts_itself_is_ignored_with_a_warning(
    how: str, tail: bool, warnings_of: pytest.LogCaptureFixture
) -> None:
    """Its checksum is right but its state does not hold together: the stream is replayed in
    full (never a KeyError or ValueError out of the open, or out of the session's next write)."""
    store = MemoryStore()
    await a_session_left_mid_request(store, tail=tail)
    rewrite_header(store, how)
    warnings_of.clear()
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        assert journal._streams[ROOT].snapshot_seq == 0  # replayed in full
        assert journal.projection().snapshot() == replayed(await store.read(ROOT)).projection.snapshot()
        assert journal.projection().has_requests
        if not tail:
            await journal.append(ATTEMPT_COMPLETED)
        await journal.append(
            TurnCompleted(request_id="r", turn_id="t", has_tool_calls=False),
            RequestCompleted(request_id="r", output={"text": "x"}),
        )
        assert journal.projection().request("r").state is RequestState.COMPLETED  # type: ignore[union-attr]
    warned = [r.getMessage() for r in warnings_of.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "ignoring the snapshot of s/root" in warned[0], warned
    assert "cannot be used" in warned[0]  # refused as it was decoded, before any event met it


async def test_a_tail_that_fails_on_a_snapshot_for_any_reason_makes_the_snapshot_ignored(
    monkeypatch: pytest.MonkeyPatch, warnings_of: pytest.LogCaptureFixture
) -> None:
    """A contradiction the decoding does not see (here: its check turned off) shows when the tail
    applies, as whatever the projection raises: the snapshot is wrong, the events decide."""
    import trio_agent._journal._snapshot as snapshot_module

    store = MemoryStore()
    await a_session_left_mid_request(store, tail=False)
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        # A request event of the tail: the projection looks the open turn up.
        await journal.append(RequestAccepted(request_id="r2", command_id="r2", input={"prompt": "q"}), command_id="r2")
    rewrite_header(store, "open_turn names no turn")
    monkeypatch.setattr(snapshot_module, "_state_problem", lambda state: None)
    warnings_of.clear()
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        assert journal._streams[ROOT].snapshot_seq == 0
        assert journal.projection().snapshot() == replayed(await store.read(ROOT)).projection.snapshot()
    warned = [r.getMessage() for r in warnings_of.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "does not follow its snapshot" in warned[0] and "KeyError" in warned[0], warned


async def test_sqlite_a_read_only_store_of_a_file_without_snapshots_reads_none(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with open_sqlite_store(path) as store:
        await a_closed_session(store)
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE journal_snapshots")  # a file written before snapshots existed
    async with open_sqlite_store(path, readonly=True) as store:
        assert await store.load_snapshot(ROOT) is None
        assert len(await store.read(ROOT)) > 0
    async with open_sqlite_store(path) as store:  # a write-open adds the table back, no format change
        assert await store.load_snapshot(ROOT) is None
        async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
            await journal.append(SessionReopened(session_id=SID, life=2))
        assert await store.load_snapshot(ROOT) is not None


# ================================================================ fencing


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param != "postgres":
        async with backend(request.param) as store:
            yield store
        return
    from trio_agent._journal._postgres import open_postgres_store

    dsn = request.getfixturevalue("postgres_dsn")
    async with open_postgres_store(dsn, schema=request.getfixturevalue("fresh_pg_schema")) as store:
        yield store


async def test_the_store_refuses_a_snapshot_like_an_append(any_store: Any) -> None:
    store = any_store
    lease = await lease_on(store, SID, "worker-1", ttl=60)
    stream = _Stream(ROOT, "root")
    envelope = EventEnvelope(
        stream_id=ROOT, seq=1, event=SessionCreated(session_id=SID, agent_id="root"), recorded_at=0.0
    )
    with pytest.raises(JournalError, match="does not exist"):
        await store.save_snapshot(SID, ROOT, 1, lease.token, b"{}")
    from trio_agent.journal import AppendBatch

    await store.append(AppendBatch(SID, ROOT, lease.token, [envelope]))
    stream.apply(envelope)
    body = encode_snapshot(stream)
    with pytest.raises(JournalError, match="the stream's head is 1"):
        await store.save_snapshot(SID, ROOT, 2, lease.token, body)
    with pytest.raises(ForeignStreamError):
        other = await lease_on(store, "other", "worker-1", ttl=60)
        await store.save_snapshot("other", ROOT, 1, other.token, body)
    await store.save_snapshot(SID, ROOT, 1, lease.token, body)
    assert await store.load_snapshot(ROOT) == (1, body)
    # A takeover: the old owner's token is stale for snapshots as for appends.
    await store.release_lease(lease)
    taken = await lease_on(store, SID, "worker-2", ttl=60)
    with pytest.raises(StaleFencingTokenError, match="snapshot to 's/root' with fencing token"):
        await store.save_snapshot(SID, ROOT, 1, lease.token, b"stale")
    assert await store.load_snapshot(ROOT) == (1, body)
    await store.save_snapshot(SID, ROOT, 1, taken.token, body + b" ")
    assert await store.load_snapshot(ROOT) == (1, body + b" ")
    assert await store.load_snapshot("s/none") is None


async def test_a_journal_that_lost_its_lease_saves_no_snapshot(warnings_of: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    with pytest.raises(Exception) as info:  # LeaseLostError
        async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
            await journal.append(RequestAccepted(request_id="r", command_id="r", input={"prompt": "x"}))
            await store.release_lease(journal.lease)
            await store.acquire_lease(SID, "thief", 60)  # another process takes the session over
            assert await journal.snapshot_all() == []  # refused by the store: logged, ignored
    assert "lease" in str(info.value)
    assert await store.load_snapshot(ROOT) is None
    assert any("StaleFencingTokenError" in r.getMessage() for r in warnings_of.records if r.name == LOGGER)


# ================================================================ reopen cost


class CountingStore:
    """Passes everything through, counting the events `read` returns."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.clock = inner.clock
        self.events_read = 0

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[EventEnvelope]:
        got: list[EventEnvelope] = await self.inner.read(stream_id, after=after, limit=limit)
        self.events_read += len(got)
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def cycles(store: CountingStore, count: int, every: int) -> list[int]:
    """``count`` lives of one session (reopen, one request, close); the events read by each open."""
    reads: list[int] = []
    for n in range(count):
        store.events_read = 0
        async with open_journal(store, session_id=SID, snapshot_every=every) as journal:
            reads.append(store.events_read)
            if journal.projection().life >= 1 and journal.projection().session_state.value == "closed":
                await journal.append(SessionReopened(session_id=SID, life=journal.projection().life + 1))
            await one_request(journal, n)
            await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
    return reads


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_200_close_reopen_cycles_keep_the_reads_of_a_reopen_bounded(kind: str, tmp_path: Path) -> None:
    every = 16
    per_life = 9  # session_reopened, 7 events of a request, session_closed
    async with backend(kind) as inner:
        store = CountingStore(inner)
        reads = await cycles(store, 200, every)
        # A reopen reads at most the events since the last snapshot (fewer than `every`, as
        # a snapshot is written on the way out once `every` events piled up), never the journal.
        assert max(reads[1:]) < every + per_life, reads
        assert len(await inner.read(ROOT)) == 200 * per_life
        store.events_read = 0
        async with open_journal(store, session_id=SID) as journal:
            assert store.events_read < every + per_life
            history = journal.conversation()
            assert history == fold_conversation(e.event for e in await inner.read(ROOT))
            assert len(history) == 400
            assert journal.conversation_fold().last_output == {"text": "a199"}
            assert set(journal._streams[ROOT].commands) == {f"r{life}-{life - 1}" for life in range(1, 201)}


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_reopen_decodes_neither_the_history_nor_the_command_ids(kind: str) -> None:
    # What grows with the session's age stays the text it was stored as until it is needed: the
    # history by a read (or a pin's next event), the command ids and ended requests by an id that
    # may be among them.
    async with backend(kind) as store:
        await cycles(CountingStore(store), 30, every=16)
        _, body, _ = snapshot_row_of(store) if kind == "memory" else (0, (await store.load_snapshot(ROOT))[1], 0)
        assert len(body.split(b"\n")) == 3 + len(_LINES)
        async with open_journal(store, session_id=SID, snapshot_every=16) as journal:
            stream = journal._streams[ROOT]
            assert stream.commands.stored and stream.fold._stored is not None
            await journal.append(SessionReopened(session_id=SID, life=journal.projection().life + 1))
            pinned = journal.deferred_conversation()
            before = fold_conversation(e.event for e in await store.read(ROOT))
            assert stream.commands.stored and stream.fold._stored is not None
            await one_request(journal, 99)  # its events settle the pin; a new command id decodes nothing
            assert stream.commands.stored and stream.commands.get("r31-99") is not None
            ended = journal.projection()._s.ended
            assert isinstance(ended, StoredIndex) and ended.stored and len(ended) == 31
            assert journal.projection().request("r31-99").state is RequestState.COMPLETED  # type: ignore[union-attr]
            assert ended.stored
            reused = RequestAccepted(request_id="r5-4", command_id="another", input={})
            with pytest.raises(InvalidTransitionError, match="completed"):
                await journal.append(reused)  # an ended id is never reused: looked up in the stored text
            assert not ended.stored
            replayed_command = RequestAccepted(request_id="r3-2", command_id="r3-2", input={"prompt": "p2"})
            assert (await journal.append(replayed_command, command_id="r3-2")).replayed  # an old one: decoded
            assert not stream.commands.stored and "r31-99" in stream.commands
            everything = fold_conversation(e.event for e in await store.read(ROOT))
            assert pinned() == before and len(before) == 60
            assert journal.conversation() == everything == [*before, UserMessage("p99"), everything[-1]]
            await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
        async with open_journal(store, session_id=SID) as journal:
            assert journal.conversation() == everything
            assert set(journal._streams[ROOT].commands) == {f"r{n}-{n - 1}" for n in range(1, 31)} | {"r31-99"}


async def with_a_call(journal: DurableJournal, n: int) -> None:
    """Request ``r{n}``: one turn whose call ``c{n}`` completes, then the request does."""
    rid, tid, aid, cid = f"r{n}", f"t{n}", f"a{n}", f"c{n}"
    ids = {"request_id": rid, "turn_id": tid}
    reply = ModelReplyRecord(tool_calls=(ToolCallPart(cid, "tool", json.dumps({"x": n})),)).to_payload()
    await journal.append(RequestAccepted(request_id=rid, command_id=rid, input={"prompt": f"p{n}"}), command_id=rid)
    await journal.append(
        RequestStarted(request_id=rid),
        TurnStarted(**ids, turn=1),
        ModelAttemptStarted(**ids, attempt_id=aid, model="m"),
        ModelAttemptCompleted(**ids, attempt_id=aid, response=reply),
        scheduled(cid, **ids),
        started(cid, **ids),
        ToolCompleted(**ids, call_id=cid, result={"output": n}),
        TurnCompleted(**ids, has_tool_calls=True),
        RequestCompleted(request_id=rid),
    )


async def test_a_reopen_decodes_no_call_of_an_ended_request_until_one_is_asked_for() -> None:
    store = MemoryStore()

    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        for n in range(5):
            await with_a_call(journal, n)
        await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        stream, state = journal._streams[ROOT], journal.projection()._s
        assert state.tools == {} and len(state.ended_tools) == 5
        assert isinstance(state.ended_tools, StoredIndex) and state.ended_tools.stored and stream.calls.stored
        await journal.append(SessionReopened(session_id=SID, life=2))
        await with_a_call(journal, 5)  # a new call id: nothing stored is decoded
        assert state.ended_tools.stored and stream.calls.stored
        record = journal.call("c2")  # an old one: its record is read from the stored text
        assert record is not None and record.result is not None and record.result.output == 2
        assert not stream.calls.stored
        reused = scheduled("c1", request_id="r9", turn_id="t9")
        await journal.append(RequestAccepted(request_id="r9", command_id="r9", input={"prompt": "p9"}), command_id="r9")
        await journal.append(RequestStarted(request_id="r9"), TurnStarted(request_id="r9", turn_id="t9", turn=1))
        with pytest.raises(InvalidTransitionError, match="completed"):
            await journal.append(reused)  # an old call id is never reused
        assert not state.ended_tools.stored
        history = journal.conversation()
        assert history == fold_conversation(e.event for e in await store.read(ROOT))


CALL_C1 = {"id": "c1", "name": "tool", "arguments": "{}"}


async def test_an_approval_is_forgotten_with_its_request_so_a_reopen_reads_no_ended_call() -> None:
    store = MemoryStore()
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        append = journal.append
        await append(RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "p"}), command_id="r1")
        await append(RequestStarted(request_id="r1"))
        paused = {"phase": "before_tools", "interrupts": [], "messages": [], "pending_calls": [CALL_C1]}
        await append(RunPaused(request_id="r1", state=paused))
        await append(RequestAccepted(request_id="r2", command_id="r2", input={"resume": "r1"}), command_id="r2")
        await append(RequestStarted(request_id="r2"))
        await append(InterruptsResolved(request_id="r1", continuation_id="r2", answers={}, approved=("c1",)))
        ids = {"request_id": "r2", "turn_id": "t1"}
        assert journal.projection().approved_calls() == {"c1"}  # a recovery re-run keeps it meanwhile
        await append(TurnStarted(**ids, turn=1))
        await append(
            scheduled("c1", **ids), started("c1", **ids), ToolCompleted(**ids, call_id="c1", result={"output": "ok"})
        )
        await append(TurnCompleted(**ids, has_tool_calls=True), RequestCompleted(request_id="r2"))
        assert journal.projection().approved_calls() == frozenset()
        await append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
    async with open_journal(store, session_id=SID) as journal:
        ended = journal.projection()._s.ended_tools
        assert isinstance(ended, StoredIndex) and ended.stored and len(ended) == 1


async def test_a_close_that_changed_neither_writes_their_text_back_as_read() -> None:
    store = MemoryStore()
    await a_closed_session(store, requests=4)
    _, first, _ = snapshot_row_of(store)
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        await journal.append(SessionReopened(session_id=SID, life=2))
        await journal.append(SessionClosed(session_id=SID, reason=SessionCloseReason.COMPLETED))
        stream = journal._streams[ROOT]
        assert stream.fold._stored is not None and stream.commands.stored
    seq, second, _ = snapshot_row_of(store)
    assert seq == 4 * 7 + 4 and first.split(b"\n")[1:] == second.split(b"\n")[1:]
    assert first.split(b"\n")[0] != second.split(b"\n")[0]


BAD_LINES = {
    "entries": (1, b'[{"type":"Nope"}]', "stored conversation cannot be decoded"),
    "outcomes": (2, b'{"c1":{"type":"Nope"}}', "stored call outcomes cannot be decoded"),
}


@pytest.mark.parametrize("which", sorted(BAD_LINES))
async def test_a_stored_conversation_that_cannot_be_decoded_fails_where_it_is_needed(which: str) -> None:
    # The checksum vouches for the text; a conversation this code cannot read (never written by
    # it) is reported when first needed, and nothing is changed. (An index line is rebuilt from
    # the events instead: `test_an_index_line_that_does_not_decode_is_rebuilt_from_the_events`.)
    store = MemoryStore()
    events = await a_closed_session(store)
    seq, body, _ = snapshot_row_of(store)
    lines = body.split(b"\n")
    line, bad, message = BAD_LINES[which]
    lines[line] = bad
    if which == "outcomes":  # its count, in the header, says one
        lines[0] = lines[0].replace(b'"outcomes_count":0', b'"outcomes_count":1')
    text = b"\n".join(lines)
    store._streams[ROOT].snapshot = (seq, text, row_checksum(ROOT, seq, text))
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        assert journal._streams[ROOT].snapshot_seq == seq  # used: nothing was decoded yet
        await journal.append(SessionReopened(session_id=SID, life=2))
        for _ in range(2):  # asking again reports it again
            with pytest.raises(JournalCorruptError, match=message):
                journal.conversation()
    assert [e.event for e in await store.read(ROOT)] == [*events, SessionReopened(session_id=SID, life=2)]


# ---------------------------------------------------------------- an index line that does not decode

MID_CALL = {"request_id": "r3", "turn_id": "t3"}


async def a_session_left_mid_call(store: Any) -> list[EventEnvelope]:
    """Requests r0-r2, each with a completed call, then r3 with call c3 scheduled: a snapshot
    whose four index lines all hold entries, and a live call whose record is in one of them."""
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        for n in range(3):
            await with_a_call(journal, n)
        await journal.append(RequestAccepted(request_id="r3", command_id="r3", input={"prompt": "p3"}), command_id="r3")
        await journal.append(RequestStarted(request_id="r3"), TurnStarted(**MID_CALL, turn=1))
        await journal.append(scheduled("c3", **MID_CALL))
    envelopes: list[EventEnvelope] = await store.read(ROOT)
    return envelopes


INDEX_DAMAGE = {
    # No usable digests: any lookup decodes the text.
    "garbage": lambda line: b"zz {not json",
    # The digests kept, the JSON broken: only a key among them decodes it (and a close that
    # decoded nothing would write the text back as it was read).
    "broken JSON behind its digests": lambda line: line[: line.index(b" ") + 1] + b'{"x":',
}


def damage_index_line(store: MemoryStore, which: str, how: str) -> int:
    """Damage one index line of the stored snapshot, the checksum recomputed (a writer's bug or
    a forgery: no check at load sees it). Returns the snapshot's seq."""
    seq, body, _ = snapshot_row_of(store)
    lines = body.split(b"\n")
    line = 3 + _LINES.index(which)
    lines[line] = INDEX_DAMAGE[how](lines[line])
    text = b"\n".join(lines)
    store._streams[ROOT].snapshot = (seq, text, row_checksum(ROOT, seq, text))
    return seq


async def assert_as_a_full_replay(journal: DurableJournal, store: Any) -> None:
    """Every index of the root stream holds what a replay of its events (and the store's commands) gives."""
    full = replayed(await store.read(ROOT))
    stream, state = journal._streams[ROOT], journal.projection()._s
    assert dict(stream.calls) == full.calls
    assert dict(state.ended) == full.projection._s.ended
    assert dict(state.ended_tools) == full.projection._s.ended_tools
    assert journal.projection().snapshot() == full.projection.snapshot()
    commands = {c.command_id: (c.digest, c.first_seq, c.last_seq) for c in await store.commands(ROOT)}
    assert dict(stream.commands) == commands


def damage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]


@pytest.mark.parametrize("how", sorted(INDEX_DAMAGE))
@pytest.mark.parametrize("which", _LINES)
async def test_an_index_line_that_does_not_decode_is_rebuilt_from_the_events(
    which: str, how: str, warnings_of: pytest.LogCaptureFixture
) -> None:
    # A reopen does not decode the index lines (that is what makes it fast), so damage that a
    # recomputed checksum hides is met by the first lookup that needs the line. The snapshot is
    # then unusable: its lines are rebuilt from the events, the lookup answers as a replay
    # would, and the next snapshot is written from the rebuilt state. Never a JournalCorruptError
    # to whoever asked, never a session that can take no more commands.
    store = MemoryStore()
    await a_session_left_mid_call(store)
    seq = damage_index_line(store, which, how)
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        stream = journal._streams[ROOT]
        assert stream.snapshot_seq == seq and not damage_warnings(warnings_of)  # used: nothing decoded yet
        # The live call's record is in the calls line; its start reads it.
        await journal.append(started("c3", **MID_CALL))
        await journal.append(
            ToolCompleted(**MID_CALL, call_id="c3", result={"output": 3}),
            TurnCompleted(**MID_CALL, has_tool_calls=True),
            RequestCompleted(request_id="r3"),
        )
        # An old command is replayed (the commands line), an ended request id or call id is
        # refused as ended (the ended requests' line, their calls' line).
        again = RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "p1"})
        assert (await journal.append(again, command_id="r1")).replayed
        with pytest.raises(InvalidTransitionError, match="completed"):
            await journal.append(RequestAccepted(request_id="r1", command_id="other", input={"prompt": "p"}))
        await journal.append(RequestAccepted(request_id="r9", command_id="r9", input={"prompt": "p9"}), command_id="r9")
        await journal.append(RequestStarted(request_id="r9"), TurnStarted(request_id="r9", turn_id="t9", turn=1))
        with pytest.raises(InvalidTransitionError, match="completed"):
            await journal.append(scheduled("c1", request_id="r9", turn_id="t9"))
        record = journal.call("c1")
        assert record is not None and record.result is not None and record.result.output == 1
        await assert_as_a_full_replay(journal, store)
        warned = damage_warnings(warnings_of)
        assert len(warned) == 1 and "rebuilding its indexes from the events" in warned[0]
        assert not stream.damaged() and stream.snapshot_seq == 0  # no usable snapshot now
    head = len(await store.read(ROOT))
    assert snapshot_row_of(store)[0] == head  # written anew from the rebuilt state
    warnings_of.clear()
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        assert journal._streams[ROOT].snapshot_seq == head
        await assert_as_a_full_replay(journal, store)  # every line of the new snapshot decodes
    assert not damage_warnings(warnings_of)


@pytest.mark.parametrize("which", ["ended_requests", "ended_tools", "calls"])
async def test_a_read_that_meets_a_damaged_index_line_raises_until_the_close_rewrites_it(
    which: str, warnings_of: pytest.LogCaptureFixture
) -> None:
    # A read outside the journal's writes (`call`, `projection().request` / `.tool`) cannot read
    # the events: it raises, and the close rebuilds the lines and saves the snapshot anew, even
    # with no event since.
    store = MemoryStore()
    await a_session_left_mid_call(store)
    seq = damage_index_line(store, which, "broken JSON behind its digests")
    read = {
        "ended_requests": lambda journal: journal.projection().request("r1"),
        "ended_tools": lambda journal: journal.projection().tool("c1"),
        "calls": lambda journal: journal.call("c1"),
    }[which]
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        for _ in range(2):
            with pytest.raises(JournalCorruptError, match="cannot be decoded"):
                read(journal)
        assert journal._streams[ROOT].damaged()
    assert len(damage_warnings(warnings_of)) == 1
    assert snapshot_row_of(store)[0] == seq  # the same events: the row rewritten in place
    warnings_of.clear()
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        assert journal._streams[ROOT].snapshot_seq == seq
        assert read(journal) is not None
        await assert_as_a_full_replay(journal, store)
    assert not damage_warnings(warnings_of)


class GatedStore(CountingStore):
    """Reads wait for ``gate`` while it is set (``reading`` says one waits)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate: trio.Event | None = None
        self.reading = trio.Event()

    async def read(self, stream_id: str, *, after: int = 0, limit: int | None = None) -> list[EventEnvelope]:
        if self.gate is not None:
            self.reading.set()
            await self.gate.wait()
        return await super().read(stream_id, after=after, limit=limit)


async def test_a_rebuild_cancelled_changes_nothing_and_one_racing_a_write_keeps_it(
    warnings_of: pytest.LogCaptureFixture,
) -> None:
    inner = MemoryStore()
    await a_session_left_mid_call(inner)
    damage_index_line(inner, "calls", "broken JSON behind its digests")
    store = GatedStore(inner)
    async with open_journal(store, session_id=SID, snapshot_every=1) as journal:
        stream = journal._streams[ROOT]
        head = journal.projection().head
        # Cancelled while it reads the events: the stream is as it was, and still says why.
        store.gate = trio.Event()
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(journal.append, started("c3", **MID_CALL))
                await store.reading.wait()
                scope.cancel()
        assert stream.calls.stored and stream.damaged() and stream.rebuilding is None
        assert journal.projection().head == head and len(await inner.read(ROOT)) == head
        # Again, with a command written while the lines are rebuilt: it is kept.
        store.gate, store.reading = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(journal.append, started("c3", **MID_CALL))
            await store.reading.wait()
            await journal.append(
                RequestAccepted(request_id="r9", command_id="r9", input={"prompt": "p9"}), command_id="r9"
            )
            assert stream.calls.stored  # the rebuild still waits
            store.gate.set()
            store.gate = None
        assert journal.call("c3").attempts == 1  # type: ignore[union-attr]
        assert "r9" in stream.commands and journal.projection().head == head + 2
        await assert_as_a_full_replay(journal, inner)
    assert len(damage_warnings(warnings_of)) == 2  # one per rebuild that started


@pytest.mark.parametrize("min_events", ["x", 1.5, True, None])
async def test_snapshot_all_refuses_a_min_events_that_is_no_count(min_events: Any) -> None:
    store = MemoryStore()
    async with open_journal(store, session_id=SID, snapshot_every=None) as journal:
        await one_request(journal, 0)
        with pytest.raises(ConfigError, match="min_events"):
            await journal.snapshot_all(min_events=min_events)
        assert await journal.snapshot_all(min_events=0) == [ROOT]  # as 1: every stream that moved
    assert store._streams[ROOT].snapshot is not None


async def test_without_snapshots_a_reopen_reads_the_whole_journal() -> None:
    store = CountingStore(MemoryStore())
    reads = await cycles(store, 20, every=10**9)
    assert reads[-1] == 19 * 9  # the control: the bound above is the snapshots' doing


@pytest.mark.parametrize("every", [None, 16])
async def test_only_a_journal_that_snapshots_folds_its_conversation_as_it_goes(every: int | None) -> None:
    # Folding costs a decode per model reply; a journal whose fold no snapshot will need
    # (a MemoryStore's, by default) folds only when its conversation is asked for.
    requests = FOLD_AFTER // 7 + 2  # more events than a stream holds unfolded when it snapshots
    async with open_journal(MemoryStore(), session_id=SID, snapshot_every=every) as journal:
        for n in range(requests):
            await one_request(journal, n)
        stream = journal._streams[ROOT]
        if every is None:
            assert len(stream.unfolded) == stream.projection.head
            assert stream.fold.messages() == []
        else:
            assert len(stream.unfolded) <= FOLD_AFTER
        history = journal.conversation()
        assert stream.unfolded == []
        assert history == fold_conversation(e.event for e in await journal.store.read(ROOT))
        assert len(history) == 2 * requests


# ================================================================ PostgreSQL


async def test_postgres_round_trip(
    postgres_dsn: str, fresh_pg_schema: str, warnings_of: pytest.LogCaptureFixture
) -> None:
    from trio_agent._journal._postgres import open_postgres_store

    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as pg:
        store = CountingStore(pg)
        await cycles(store, 30, every=16)
        seq, body = await pg.load_snapshot(ROOT) or (0, b"")
        assert 0 < seq <= await pg.head(ROOT)
        store.events_read = 0
        async with open_journal(store, session_id=SID) as journal:
            assert journal._streams[ROOT].snapshot_seq == seq
            assert store.events_read == await pg.head(ROOT) - seq
            full = replayed(await pg.read(ROOT))
            assert journal.projection().snapshot() == full.projection.snapshot()
            assert journal.conversation() == full.folded().messages()
            lease = journal.lease
        taken = await pg.acquire_lease(SID, "worker-2", 60)
        with pytest.raises(StaleFencingTokenError):
            await pg.save_snapshot(SID, ROOT, seq, lease.token, body)
        await pg.release_lease(taken)
    async with open_postgres_store(postgres_dsn, schema=fresh_pg_schema) as pg:
        import psycopg

        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {fresh_pg_schema}.snapshots SET checksum = checksum + 1")
        with pytest.raises(JournalCorruptError, match="checksum mismatch"):
            await pg.load_snapshot(ROOT)
        warnings_of.clear()
        store = CountingStore(pg)
        async with open_journal(store, session_id=SID) as journal:
            assert journal._streams[ROOT].snapshot_seq == 0
            assert store.events_read == await pg.head(ROOT)
        assert any("checksum mismatch" in r.getMessage() for r in warnings_of.records if r.name == LOGGER)
