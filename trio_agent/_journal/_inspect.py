"""``python -m trio_agent journal show PATH [--session ID]``: a readable timeline of a journal.

Read-only: it never writes to the journal and never takes a lease. It is what one reads a
damaged journal with, so it trusts nothing stored: a damaged row ends its own stream's
timeline (``damaged at #N``) and no other, a damaged stream or lease row is shown as such in
its place (the other streams and sessions in full), and a payload of an unexpected shape is
described as such, never a crash. Stored text is shown as data: a control character or a lone surrogate
(a tool's output may hold one; the journal keeps it escaped) is shown escaped (``\\x1b``,
``\\ud800``), so no stored text drives the terminal or fails to print.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence

import attrs

from .._errors import JournalCorruptError, JournalError
from ._events import (
    ConversationSeeded,
    EventEnvelope,
    InboxNoted,
    InterruptsResolved,
    ModelAttemptAborted,
    ModelAttemptCompleted,
    ModelAttemptFailed,
    ModelAttemptStarted,
    PermissionRequested,
    PermissionResolved,
    PromptSubmitted,
    RecoveryDecision,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestStarted,
    RunPaused,
    SessionClosed,
    SessionCreated,
    SessionReopened,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolScheduled,
    ToolStarted,
    TurnAborted,
    TurnCompleted,
    TurnStarted,
    event_type_name,
)
from ._sqlite import DamagedStream, SQLiteStore
from ._store import JournalStore, Lease, StreamInfo

__all__ = ["CallSummary", "render_timeline", "summarize_calls"]


@attrs.define
class CallSummary:
    """One tool call as the journal tells it."""

    call_id: str
    tool_name: str
    side_effect: str
    scheduled_at: float
    started_at: float | None = None
    settled_at: float | None = None
    outcome: str = "unsettled"
    attempts: int = 0
    decisions: list[str] = attrs.Factory(list)

    @property
    def duration(self) -> float | None:
        """Seconds from the (last) start to the settlement."""
        if self.started_at is None or self.settled_at is None:
            return None
        return self.settled_at - self.started_at


def summarize_calls(envelopes: Sequence[EventEnvelope]) -> list[CallSummary]:
    """Every tool call of one stream, in scheduling order."""
    calls: dict[str, CallSummary] = {}
    for envelope in envelopes:
        event = envelope.event
        if isinstance(event, ToolScheduled):
            calls[event.call_id] = CallSummary(
                event.call_id, event.tool_name, event.side_effect.value, envelope.recorded_at
            )
            continue
        call = calls.get(getattr(event, "call_id", "") or "")
        if call is None:
            continue
        if isinstance(event, ToolStarted):
            call.started_at = envelope.recorded_at
            call.attempts += 1
        elif isinstance(event, ToolCompleted | ToolFailed | ToolCancelled | ToolOutcomeUnknown):
            call.settled_at = envelope.recorded_at
            call.outcome = event_type_name(type(event)).removeprefix("tool_")
            if isinstance(event, ToolCompleted | ToolFailed) and not event.published:
                call.outcome += " (withheld)"
        elif isinstance(event, RecoveryDecision):
            call.decisions.append(f"{event.decision.value}: {event.reason}")
    return list(calls.values())


def _describe(event: object) -> str:
    if isinstance(event, SessionCreated):
        parent = f" (subagent of {event.parent_agent_id})" if event.parent_agent_id else ""
        return f"agent {event.agent_id} created{parent}"
    if isinstance(event, SessionClosed):
        return f"session closed: {event.reason.value}" + (" (ended for good)" if event.final else "")
    if isinstance(event, SessionReopened):
        return f"--- life {event.life}: session reopened ---"
    if isinstance(event, ConversationSeeded):
        messages = event.conversation.get("messages", [])
        if not isinstance(messages, list):
            return f"conversation seeded (its messages are {type(messages).__name__}, not a list)"
        return f"conversation seeded with {len(messages)} message(s)"
    if isinstance(event, RequestAccepted):
        return f"request {event.request_id} accepted {_preview(str(event.input.get('prompt', '')), 60)!r}"
    if isinstance(event, RequestCompleted):
        return f"request {event.request_id} completed"
    if isinstance(event, RequestFailed):
        return f"request {event.request_id} failed: {event.error.message}"
    if isinstance(event, RequestInterrupted):
        return f"request {event.request_id} interrupted: {event.reason.value}"
    if isinstance(event, RequestStarted):
        return f"request {event.request_id} started"
    if isinstance(event, PromptSubmitted):
        shown = " / ".join(_preview(text, 40) for text in event.messages) or "nothing (skipped)"
        return f"request {event.request_id} prompt after hooks: {shown}"
    if isinstance(event, RunPaused):
        interrupts = event.state.get("interrupts", [])
        if not isinstance(interrupts, list):
            return f"request {event.request_id} paused (its interrupts are {type(interrupts).__name__}, not a list)"
        asked = [str(item.get("id")) for item in interrupts if isinstance(item, dict)]
        return f"request {event.request_id} paused, waiting for: {', '.join(asked) or 'nothing'}"
    if isinstance(event, InterruptsResolved):
        answers = event.answers.items()
        kinds = ", ".join(f"{key}={value.get('type')}" for key, value in answers if isinstance(value, dict))
        return f"request {event.request_id} answered by {event.continuation_id}: {kinds}"
    if isinstance(event, ModelAttemptAborted):
        return f"model attempt {event.attempt_id} aborted: {event.reason.value}"
    if isinstance(event, TurnStarted):
        return f"turn {event.turn} started"
    if isinstance(event, TurnCompleted):
        return "turn completed" + (" (tool calls)" if event.has_tool_calls else "")
    if isinstance(event, TurnAborted):
        return f"turn aborted: {event.reason.value}"
    if isinstance(event, ModelAttemptStarted):
        return f"model attempt {event.attempt_id} on {event.model}"
    if isinstance(event, ModelAttemptCompleted):
        return f"model attempt {event.attempt_id} completed"
    if isinstance(event, ModelAttemptFailed):
        return f"model attempt {event.attempt_id} failed: {event.error.message}"
    if isinstance(event, ToolScheduled):
        arguments = _preview(json.dumps(event.model_input, ensure_ascii=False), 60)
        return f"{event.call_id} {event.tool_name}({arguments}) scheduled ({event.side_effect.value})"
    if isinstance(event, ToolStarted):
        return f"{event.call_id} started" + (" (synthetic)" if event.synthetic else "")
    if isinstance(event, ToolCompleted | ToolFailed):
        verb = "completed" if isinstance(event, ToolCompleted) else "failed"
        output = _preview(str(event.result.get("output", "")), 50)
        return f"{event.call_id} {verb}: {output}" + ("" if event.published else " [withheld]")
    if isinstance(event, ToolCancelled):
        return f"{event.call_id} cancelled: {event.reason}"
    if isinstance(event, ToolOutcomeUnknown):
        return f"{event.call_id} OUTCOME UNKNOWN ({event.reason.value})"
    if isinstance(event, PermissionRequested):
        return f"{event.call_id} permission requested"
    if isinstance(event, PermissionResolved):
        return f"{event.call_id} permission {event.decision.value}"
    if isinstance(event, RecoveryDecision):
        return f"RECOVERY {event.call_id}: {event.decision.value} ({event.reason})"
    if isinstance(event, SubagentStarted):
        return f"subagent {event.subagent_id} started"
    if isinstance(event, SubagentCompleted):
        return f"subagent {event.subagent_id} completed"
    if isinstance(event, SubagentCancelled):
        return f"subagent {event.subagent_id} cancelled: {event.reason}"
    if isinstance(event, InboxNoted):
        noted = _preview(" | ".join(event.messages), 60)
        return f"inbox noted ({len(event.messages)}): {noted}"
    return event_type_name(type(event))


def _preview(text: str, width: int) -> str:
    """One line of at most *width* characters (newlines would break the timeline's columns)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


# C0 and C1 controls (ESC starts a terminal's escape sequences), lone surrogates (no encoding
# takes them) and the Unicode line and paragraph separators (a line must stay one line).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029]")


def _printable(text: str) -> str:
    """*text* with what `_UNPRINTABLE` matches escaped as Python writes it (``\\x1b``, ``\\ud800``)."""
    return _UNPRINTABLE.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), text)


def _clock(stamp: float) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(stamp)) + f".{int((stamp % 1) * 1000):03d}"
    except (OverflowError, ValueError, OSError):  # no wall-clock time (a lease held "for ever", 1e300)
        return "--:--:--.---"


def _stream_order(stream_id: str) -> tuple[bool, tuple[str | tuple[int, str], ...]]:
    """The root stream first, then the subagents' by id, numbers as numbers (``root``,
    ``reviewer-7``, ``summarizer-2``, ``summarizer-10``)."""
    agent = stream_id.rsplit("/", 1)[-1]
    # re.split with a group alternates text and digits, so equal positions compare like with like.
    # A run of digits is ordered by its length without leading zeros, then its text: int() of an
    # edited file's run of thousands of digits raises ValueError (Python's digit limit).
    parts = re.split(r"([0-9]+)", agent)
    return (
        agent != "root",
        tuple((len(part.lstrip("0")), part) if index % 2 else part for index, part in enumerate(parts)),
    )


def _lease_state(lease: Lease | None) -> str:
    if lease is None:
        return ""
    if lease.expires_at < time.time():  # released (a closed session) or lapsed (a crashed one)
        return f", lease token {lease.token} ({lease.owner}, not held)"
    until = _clock(lease.expires_at)
    until = "" if until.startswith("-") else f" until {until}"
    return f", lease token {lease.token} ({lease.owner}, held{until})"


@attrs.frozen
class _Timeline:
    text: str
    damage: list[JournalCorruptError]  # one per damaged stream, in the order shown


async def render_timeline(store: JournalStore, *, session_id: str | None = None, agent_id: str | None = None) -> str:
    """The readable timeline of every session (or one, or one agent of it) in ``store``; a damaged
    stream is shown up to its damaged row, then ``damaged at #N``."""
    return (await _timeline(store, session_id=session_id, agent_id=agent_id)).text


async def _read_stream(store: JournalStore, stream_id: str) -> tuple[list[EventEnvelope], JournalCorruptError | None]:
    """A stream's events up to its first damaged row (if any), and the damage."""
    try:
        return await store.read(stream_id), None
    except JournalCorruptError as exc:
        return list(exc.intact), exc


async def _stream_rows(store: JournalStore, session_id: str | None) -> list[StreamInfo | DamagedStream]:
    """The streams to show; a SQLite store lists a damaged stream row in its place (only SQLite
    can hold a value of another type than its column's), so the others are shown all the same."""
    if isinstance(store, SQLiteStore):
        return await store._listed_streams(session_id)
    return list(await store.streams(session_id))


async def _lease_line(store: JournalStore, session: str) -> tuple[str, JournalCorruptError | None]:
    """The header's lease part, and the damage of a lease row that cannot be read."""
    try:
        return _lease_state(await store.current_lease(session)), None
    except JournalCorruptError as exc:
        return ", lease row damaged", exc


async def _timeline(store: JournalStore, *, session_id: str | None, agent_id: str | None) -> _Timeline:
    streams = every = await _stream_rows(store, session_id)
    if session_id is not None and not streams:
        raise JournalError(f"the journal has no session {session_id!r}")
    if agent_id is not None:
        streams = [info for info in streams if info.stream_id.rsplit("/", 1)[-1] == agent_id]
        if not streams:
            where = f" in session {session_id!r}" if session_id else ""
            known = sorted({info.stream_id.rsplit("/", 1)[-1] for info in every}, key=_stream_order)
            listed = ", ".join(known[:8]) + (f" and {len(known) - 8} more" if len(known) > 8 else "")
            raise JournalError(f"the journal has no agent {agent_id!r}{where}; its agents: {listed or 'none'}")
    lines: list[str] = []
    damage: list[JournalCorruptError] = []
    sessions: dict[str | None, list[StreamInfo | DamagedStream]] = {}
    for info in streams:
        sessions.setdefault(info.session_id, []).append(info)
    for rows in sessions.values():
        rows.sort(key=lambda row: _stream_order(row.stream_id))
    # A stream row that names no session (its stream id is no text either) comes last.
    for session, rows in sorted(sessions.items(), key=lambda item: item[0] is None):
        if session is None:
            lines.append(f"streams of no readable session: {len(rows)}")
        else:
            holder, lease_damage = await _lease_line(store, session)
            lines.append(f"session {session}: {len(rows)} agent stream(s){holder}")
            if lease_damage is not None:
                damage.append(lease_damage)
                lines.append(f"  lease row damaged: {lease_damage}")
        for row in rows:
            stream_id = row.stream_id
            if isinstance(row, DamagedStream):
                damage.append(row.error)
                lines.append(f"  stream {stream_id} (its stream row is damaged)")
                lines.append(f"    damaged at #head: {row.error}; this stream is not shown")
                continue
            envelopes, damaged = await _read_stream(store, stream_id)
            lives = 1 + sum(isinstance(envelope.event, SessionReopened) for envelope in envelopes)
            lived = f", {lives} lives" if lives > 1 else ""
            # The read names the damaged row in its message; it is the one after what it decoded.
            at = f", damaged at #{len(envelopes) + 1}" if damaged is not None else ""
            lines.append(f"  stream {stream_id} ({len(envelopes)} events{lived}{at})")
            start = envelopes[0].recorded_at if envelopes else 0.0
            for envelope in envelopes:
                offset = envelope.recorded_at - start
                lines.append(
                    f"    {envelope.seq:>5}  {_clock(envelope.recorded_at)}  +{offset:8.3f}s  "
                    f"{_describe(envelope.event)}"
                )
            if damaged is not None:
                damage.append(damaged)
                lines.append(f"    damaged at #{len(envelopes) + 1}: {damaged}; the rest of this stream is not shown")
            calls = summarize_calls(envelopes)
            if calls:
                lines.append("    calls:")
                for call in calls:
                    took = "-" if call.duration is None else f"{call.duration * 1000:.1f} ms"
                    lines.append(
                        f"      {call.call_id:<14} {call.tool_name:<16} {call.side_effect:<15} "
                        f"{call.outcome:<18} {took:>10}  attempts {call.attempts}"
                    )
                    for decision in call.decisions:
                        lines.append(f"        recovery: {decision}")
                outcomes: dict[str, int] = {}
                for call in calls:
                    outcomes[call.outcome] = outcomes.get(call.outcome, 0) + 1
                summary = ", ".join(f"{count} {name}" for name, count in sorted(outcomes.items()))
                lines.append(f"    {len(calls)} call(s): {summary}")
    if not lines:
        lines.append("the journal is empty")
    # Every line holds stored text (ids, names, payload previews, damage messages): escaped once, here.
    return _Timeline("\n".join(map(_printable, lines)), damage)


def show_journal(path: str, session_id: str | None = None, agent_id: str | None = None) -> int:
    """The ``journal show`` command; returns the exit status."""
    import sys

    import trio

    from ._sqlite import open_sqlite_store

    if not os.path.exists(path):
        print(f"error: no journal at {path}", file=sys.stderr)
        return 1
    if os.path.isdir(path):
        found = _databases_in(path)
        hint = f"; the SQLite files in it: {', '.join(found)}" if found else " (it holds no SQLite file)"
        print(f"error: {path} is a directory, not a journal file{hint}", file=sys.stderr)
        return 1

    async def run() -> _Timeline:
        async with open_sqlite_store(path, readonly=True) as store:
            return await _timeline(store, session_id=session_id, agent_id=agent_id)

    try:
        timeline = trio.run(run)
    except JournalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(timeline.text)
    for damaged in timeline.damage:  # shown in the timeline too; the status says the journal is damaged
        print(_printable(f"error: {damaged}"), file=sys.stderr)
    return 1 if timeline.damage else 0


def _databases_in(directory: str, limit: int = 5) -> list[str]:
    """Paths of the SQLite files directly in ``directory`` (by their header), at most ``limit``."""
    found: list[str] = []
    for name in sorted(os.listdir(directory)):
        candidate = os.path.join(directory, name)
        if not os.path.isfile(candidate):  # never open a FIFO or a device: reading it could block
            continue
        try:
            with open(candidate, "rb") as file:
                header = file.read(16)
        except OSError:  # unreadable
            continue
        if header == b"SQLite format 3\x00":
            found.append(candidate)
            if len(found) == limit:
                break
    return found
