"""What the journal keeps per stream, and its snapshot: a reopen that reads a row, not the stream.

A `_Stream` is everything `DurableJournal` knows about one agent stream: the
`Projection`, the `CallRecord` of every call, the command ids applied (the replay
cache) and the `ConversationFold`. A *snapshot* is all of it at one seq, so a reopen
restores it and applies only the events after it.

Rules
=====

* Format: one JSON object (cattrs-encoded, ASCII, no NaN) with ``format``
  (``"trio_agent.snapshot"``), ``version`` (`SNAPSHOT_VERSION`), ``stream_id``,
  ``seq``, ``projection`` (the projection's whole ``_State``), ``calls`` (call id ->
  `CallRecord`, settlements tagged like events), ``commands`` (every command id whose
  events are at or before ``seq``) and ``conversation`` (`ConversationFold.to_json`).
  The store keeps it in one row per stream with the checksum rule of the events
  (`_codec`: CRC32 of stream id, seq and the exact body bytes).
* Written (`DurableJournal.snapshot_all`) for a stream whose head moved at least
  ``snapshot_every`` events past its last snapshot, when the journal is healthy:
  lease held, not fenced, every submitted start committed. `open_journal` does it on
  its way out, before it releases the lease, bounded (`SNAPSHOT_GRACE` at most) and
  best effort: a failure is logged and ignored, the events stay the truth. The store
  fences it like an append (current token, the session's stream, ``seq`` <= head), so
  a snapshot never stands for events that are not committed, nor comes from a process
  that lost its lease.
* Commands: the snapshot's are the journal's cache merged with the store's commands
  since the previous snapshot, read when it is written (so a command whose append was
  cancelled in flight is not lost); a reopen adds the store's commands after ``seq``.
* Read: `open_journal` (and `reconcile`) take each stream's snapshot, restore from it
  and apply the events after ``seq``. A snapshot that fails its checksum, cannot be
  decoded, has another format or version, names another stream or seq, lies past the
  stream's head, or whose tail does not apply, is ignored with a WARNING on the
  ``trio_agent.journal`` logger and the stream is replayed in full: a snapshot can
  make a reopen faster, never different.
* The fold is lazy: events wait unfolded until the conversation is asked for. A
  journal that snapshots folds once `FOLD_AFTER` events wait (its snapshots need the
  fold anyway, so the work is spread out); one that never snapshots (a `MemoryStore`'s,
  by default) folds only when asked: a session that is never reopened decodes no
  model reply twice.
* No schema version change: the table is additive (created if missing) and a
  snapshot stays true whatever is appended after it, because events are never
  rewritten; code that predates snapshots ignores them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any, get_origin

import attrs
import cattrs

from .._convert import LazyConverter
from .._errors import JournalCorruptError
from .._tools._results import ToolResult, json_copy
from ._conversation import ConversationFold
from ._events import (
    Event,
    EventEnvelope,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolScheduled,
    ToolStarted,
    event_converter,
)
from ._projection import Projection, _State
from ._store import AppendResult

__all__ = [
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_GRACE",
    "SNAPSHOT_VERSION",
    "CallRecord",
    "decode_snapshot",
    "encode_snapshot",
    "result_from_json",
    "result_to_json",
]

SNAPSHOT_FORMAT = "trio_agent.snapshot"
SNAPSHOT_VERSION = 2
"""2: the conversation fold adds a prompt when its request starts and keeps paused calls open;
a version-1 snapshot is ignored (the events are replayed), never read under the new rules."""
SNAPSHOT_GRACE = 2.0
"""Seconds the close of a journal may spend writing snapshots (at most ``commit_grace``)."""

logger = logging.getLogger("trio_agent.journal")

_results = cattrs.Converter()


def result_to_json(result: ToolResult) -> dict[str, Any]:
    """A `ToolResult` as stored in the journal (JSON-compatible; non-JSON output is refused)."""
    data: dict[str, Any] = _results.unstructure(result, ToolResult)
    copied: dict[str, Any] = json_copy(data)
    return copied


def result_from_json(data: Mapping[str, Any]) -> ToolResult:
    try:
        return _results.structure(dict(data), ToolResult)
    except Exception as exc:
        raise JournalCorruptError(f"a stored tool result cannot be decoded: {exc}") from exc


Settlement = ToolCompleted | ToolFailed | ToolCancelled | ToolOutcomeUnknown


@attrs.define
class CallRecord:
    """What the journal knows about one tool call beyond the projection's state."""

    scheduled: ToolScheduled
    started_input: dict[str, Any] | None = None
    attempts: int = 0
    settlement: Settlement | None = None

    @property
    def result(self) -> ToolResult | None:
        """The stored result of a completed or failed call."""
        if isinstance(self.settlement, ToolCompleted | ToolFailed):
            return result_from_json(self.settlement.result)
        return None


FOLD_AFTER = 512  # unfolded events a stream may hold before it folds them on its own


class _Stream:
    __slots__ = ("agent_id", "calls", "commands", "fold", "projection", "snapshot_seq", "stream_id", "unfolded")

    def __init__(self, stream_id: str, agent_id: str) -> None:
        self.stream_id = stream_id
        self.agent_id = agent_id
        self.projection = Projection(stream_id)
        self.commands: dict[str, tuple[str, AppendResult]] = {}
        self.calls: dict[str, CallRecord] = {}
        self.fold = ConversationFold()
        # Events applied but not folded yet: folding waits until someone asks (or they pile up).
        self.unfolded: list[Event] = []
        self.snapshot_seq = 0  # the seq of the snapshot this stream was restored from or last saved at

    def apply(self, envelope: EventEnvelope, *, fold_after: int | None = FOLD_AFTER) -> None:
        self.projection.apply(envelope)
        self.track(envelope.event, fold_after=fold_after)

    def track(self, event: Event, *, fold_after: int | None = FOLD_AFTER) -> None:
        """Record *event*; fold the pending events once more than *fold_after* wait (``None``:
        only when someone asks, for a journal that never snapshots: its fold may never be needed)."""
        if isinstance(event, ToolScheduled):
            self.calls[event.call_id] = CallRecord(event)
        elif isinstance(event, ToolStarted):
            record = self.calls[event.call_id]
            record.started_input = dict(event.input)
            record.attempts += 1
        elif isinstance(event, ToolCompleted | ToolFailed | ToolCancelled | ToolOutcomeUnknown):
            self.calls[event.call_id].settlement = event
        self.unfolded.append(event)
        if fold_after is not None and len(self.unfolded) > fold_after:
            self._catch_up(strict=False)

    def _catch_up(self, *, strict: bool) -> None:
        done = 0
        try:
            for event in self.unfolded:
                self.fold.feed(event)
                done += 1
        except JournalCorruptError:
            if strict:
                raise  # the bad event stays first in line: asking again reports it again
        finally:
            del self.unfolded[:done]

    def folded(self) -> ConversationFold:
        """The fold, caught up with every applied event (`JournalCorruptError` for a payload it cannot read)."""
        self._catch_up(strict=True)
        return self.fold


# ---------------------------------------------------------------- the format


@attrs.frozen
class _Command:
    command_id: str
    digest: str
    first_seq: int
    last_seq: int


@attrs.frozen
class _Body:
    format: str
    version: int
    stream_id: str
    seq: int
    projection: _State
    calls: dict[str, CallRecord]
    commands: list[_Command]
    conversation: dict[str, Any]


def _strict(kind: type[Any]) -> Any:
    # A value of the wrong type is damage, never coerced ("1" is no seq).
    def hook(value: object, _: object) -> Any:
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return hook


def _structure_settlement(value: object, _: object) -> Settlement | None:
    if value is None:
        return None
    event: Event = event_converter.structure(value, Event)  # type: ignore[arg-type]
    if not isinstance(event, ToolCompleted | ToolFailed | ToolCancelled | ToolOutcomeUnknown):
        raise TypeError(f"expected a settlement, got {type(event).__name__}")
    return event


def _unstructure_settlement(value: Settlement | None) -> Any:
    return None if value is None else event_converter.unstructure(value, Event)


def _is_set(kind: Any) -> bool:
    return kind is set or get_origin(kind) is set


def _configure(converter: cattrs.Converter) -> None:
    for kind in (str, int, float, bool):
        converter.register_structure_hook(kind, _strict(kind))
    converter.register_structure_hook_func(lambda t: t == (Settlement | None), _structure_settlement)
    converter.register_unstructure_hook_func(lambda t: t == (Settlement | None), _unstructure_settlement)
    converter.register_unstructure_hook_func(_is_set, lambda value: sorted(value))  # a stable body
    # JSON objects (inputs, results, the fold's state) are taken as they are: the checksum vouched for them.
    converter.register_structure_hook_func(lambda t: t == dict[str, Any], _json_object)
    converter.register_structure_hook_func(
        lambda t: t == (dict[str, Any] | None), lambda v, _: None if v is None else _json_object(v, _)
    )


def _json_object(value: object, _: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


_converter = LazyConverter(configure=_configure, forbid_extra_keys=True, detailed_validation=False)


def encode_snapshot(stream: _Stream, commands: Iterable[_Command | tuple[str, str, int, int]] = ()) -> bytes:
    """The snapshot of ``stream`` at its head: ``commands`` are added to its own cache (those
    past the head are left out). `JournalCorruptError` if the conversation cannot be folded."""
    fold = stream.folded()
    seq = stream.projection.head
    known = {
        cid: _Command(cid, digest, result.first_seq, result.last_seq)
        for cid, (digest, result) in stream.commands.items()
    }
    for command in commands:
        entry = command if isinstance(command, _Command) else _Command(*command)
        known.setdefault(entry.command_id, entry)
    body = _Body(
        format=SNAPSHOT_FORMAT,
        version=SNAPSHOT_VERSION,
        stream_id=stream.stream_id,
        seq=seq,
        projection=stream.projection._s,
        calls=stream.calls,
        commands=sorted((c for c in known.values() if c.last_seq <= seq), key=lambda c: c.first_seq),
        conversation=fold.to_json(),
    )
    data = _converter.unstructure(body, _Body)
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode("ascii")


def decode_snapshot(stream_id: str, agent_id: str, seq: int, body: bytes) -> _Stream:
    """The stream a stored snapshot stands for; `JournalCorruptError` says why it cannot be used."""

    def unusable(problem: str) -> JournalCorruptError:
        return JournalCorruptError(f"snapshot {stream_id}@{seq} cannot be used: {problem}")

    try:
        data = json.loads(body)
    except ValueError as exc:
        raise unusable(f"it is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise unusable(f"it is a JSON {type(data).__name__}, not an object")
    found = (data.get("format"), data.get("version"))
    if found != (SNAPSHOT_FORMAT, SNAPSHOT_VERSION):
        raise unusable(f"unknown format {found!r} (this code reads {(SNAPSHOT_FORMAT, SNAPSHOT_VERSION)!r})")
    try:
        decoded = _converter.structure(data, _Body)
        fold = ConversationFold.from_json(decoded.conversation)
    except Exception as exc:
        raise unusable(f"{type(exc).__name__}: {exc}") from exc
    if (decoded.stream_id, decoded.seq, decoded.projection.head) != (stream_id, seq, seq):
        raise unusable(f"it holds {decoded.stream_id}@{decoded.seq} with a projection at {decoded.projection.head}")
    stream = _Stream(stream_id, agent_id)
    stream.projection = Projection.restored(stream_id, decoded.projection)
    stream.calls = decoded.calls
    stream.commands = {
        c.command_id: (c.digest, AppendResult(stream_id, c.first_seq, c.last_seq)) for c in decoded.commands
    }
    stream.fold = fold
    stream.snapshot_seq = seq
    return stream
