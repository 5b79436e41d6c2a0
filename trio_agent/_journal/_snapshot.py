"""What the journal keeps per stream, and its snapshot: a reopen that reads a row, not the stream.

A `_Stream` is everything `DurableJournal` knows about one agent stream: the
`Projection`, the `CallRecord` of every call, the command ids applied (the replay
cache) and the `ConversationFold`. A *snapshot* is all of it at one seq, so a reopen
restores it and applies only the events after it.

Rules
=====

* Format: seven lines (no NaN; JSON text never holds a raw newline):
  1. the header, one JSON object (cattrs-encoded): ``format`` (``"trio_agent.snapshot"``),
     ``version`` (`SNAPSHOT_VERSION`), ``stream_id``, ``seq``, ``projection`` (the
     projection's ``_State`` of live requests, a request as ``[state, seq, turns]``;
     the ended ones are lines of their own), ``conversation`` (the fold's state
     without its entries and outcomes, `ConversationFold.to_parts`) and ``lines``
     (the entries of each index line);
  2. the fold's entries, one JSON array;
  3. its call outcomes, then, in `_LINES` order, 4. the command ids (``[digest,
     first_seq, last_seq]``, those at or before ``seq``), 5. the ended requests,
     6. their calls (`ToolRecord`), 7. every call's `CallRecord`: each an index line
     (`_stored.StoredIndex`: the keys' CRC32 digests, a space, a JSON object).
  Lines 2-7 grow with the session's age, so they are decoded only when first needed
  (the history by the first request or a read of it; an index when a key may be in
  it, which its digests answer in constant time): a reopen does not pay for them,
  and a close writes their text back as it was read, with what is new appended.
  The checksum and the version vouch for that text meanwhile. An index line that
  fails to decode then makes the snapshot unusable (`_Stream.damaged`): the journal
  rebuilds the lines from the events (`DurableJournal._rebuild_lines`, logged) and
  asks the lookup again where it can wait for the store; elsewhere, and for the
  conversation's text, the failure is a `JournalCorruptError`. The store keeps the
  lines in one row per stream with the checksum rule of the events (`_codec`: CRC32
  of stream id, seq and the exact body bytes).
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
  decoded, has another format or version, names another stream or seq, whose live
  state does not hold together (`_state_problem`), lies past the stream's head, or
  whose tail does not apply (whatever applying it raises), is ignored with a WARNING on the
  ``trio_agent.journal`` logger and the stream is replayed in full: a snapshot can
  make a reopen faster, never different. Its lines 2-7 are checked when first decoded
  (above): a check at load would cost what their laziness saves.
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
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any, TypeVar, get_origin

import attrs
import cattrs
import trio

from .._convert import LazyConverter
from .._errors import JournalCorruptError
from .._models._messages import Message
from .._tools._results import ToolResult, result_to_json
from .._tools._results import results_converter as _results
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
from ._projection import PermissionState, Projection, RequestRecord, RequestState, ToolRecord, _State
from ._stored import StoredIndex, dumps

__all__ = [
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_GRACE",
    "SNAPSHOT_VERSION",
    "CallRecord",
    "ConversationPin",
    "decode_snapshot",
    "encode_snapshot",
    "result_from_json",
    "result_to_json",
]

SNAPSHOT_FORMAT = "trio_agent.snapshot"
SNAPSHOT_VERSION = 3
"""2: the conversation fold adds a prompt when its request starts and keeps paused calls open;
3: two lines (the entries apart), commands as arrays, and a projection that forgets the turns and
attempts of ended requests. An older snapshot is ignored (the events are replayed), never read
under the new rules."""
SNAPSHOT_GRACE = 2.0
"""Seconds the close of a journal may spend writing snapshots (at most ``commit_grace``)."""

logger = logging.getLogger("trio_agent.journal")


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
        if isinstance(self.settlement, (ToolCompleted, ToolFailed)):
            return result_from_json(self.settlement.result)
        return None


_SETTLEMENTS = (ToolCompleted, ToolFailed, ToolCancelled, ToolOutcomeUnknown)
CALL_EVENTS = frozenset({ToolScheduled, ToolStarted, *_SETTLEMENTS})  # the events a `CallRecord` follows
CALL_UPDATES = CALL_EVENTS - {ToolScheduled}  # those that read the call's record (`_Stream.track_call`)

FOLD_AFTER = 512  # unfolded events a stream may hold before it folds them on its own


class ConversationPin:
    """A stream's conversation as it stood when pinned (`_Stream.pin`), folded and decoded when first
    called, or at the latest before the stream takes its next event: a reopen can hand the history
    on without decoding it, and the first request that needs it pays once."""

    __slots__ = ("_failure", "_messages", "_stream")

    def __init__(self, stream: _Stream) -> None:
        self._stream: _Stream | None = stream
        self._messages: list[Message] | None = None
        self._failure: JournalCorruptError | None = None

    def settle(self) -> None:
        """Take the conversation now (a failure is kept for the call, never raised here)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                self._messages = stream.folded().messages()
            except JournalCorruptError as exc:
                self._failure = exc

    def __call__(self) -> list[Message]:
        """The pinned conversation (a new list each time); `JournalCorruptError` if it cannot be read."""
        if self._stream is not None:
            pins = self._stream.pins
            assert pins is not None  # an unsettled pin is among its stream's
            pins.remove(self)
            self.settle()
        if self._failure is not None:
            raise self._failure
        assert self._messages is not None
        return list(self._messages)


class _Stream:
    """One stream's state (module docstring). A session lives long and thousands may be alive, so
    what it keeps is what some reader needs, made when first needed, in forms the cyclic GC can
    leave alone where there is a choice: the replay cache holds tuples of text and numbers, and
    nothing is allocated for a fold, pins or deferred events that a stream does not have."""

    __slots__ = (
        "_fold",
        "agent_id",
        "calls",
        "commands",
        "deferred",
        "pins",
        "projection",
        "rebuilding",
        "snapshot_seq",
        "stream_id",
        "unfolded",
    )

    def __init__(self, stream_id: str, agent_id: str) -> None:
        self.stream_id = stream_id
        self.agent_id = agent_id
        self.projection = Projection(stream_id)
        # Command id -> (digest, first_seq, last_seq): the replay cache. A dict until a snapshot
        # writes it; a snapshot's part stays text until needed (`command_index`).
        self.commands: MutableMapping[str, tuple[str, int, int]] = {}
        self.calls: MutableMapping[str, CallRecord] = {}  # every call (a snapshot's part stays text until needed)
        self._fold: ConversationFold | None = None  # made when first fed or read (`fold`)
        # Events applied but not folded yet: folding waits until someone asks (or they pile up).
        self.unfolded: list[Event] = []
        self.snapshot_seq = 0  # the seq of the snapshot this stream was restored from or last saved at
        self.rebuilding: trio.Event | None = None  # set while its snapshot's lines are rebuilt (`_rebuild_lines`)
        self.pins: list[ConversationPin] | None = None  # unsettled: settled before the next event is tracked
        # Applied by `DurableJournal.defer`, not written yet: the stream's next append carries them.
        self.deferred: tuple[EventEnvelope, ...] = ()

    @property
    def fold(self) -> ConversationFold:
        """The incremental fold of the events fed so far (not caught up: see `folded`)."""
        fold = self._fold
        if fold is None:
            fold = self._fold = ConversationFold()
        return fold

    @fold.setter
    def fold(self, fold: ConversationFold) -> None:
        self._fold = fold

    def pin(self) -> ConversationPin:
        """The conversation as it stands now, read later (see `ConversationPin`)."""
        pin = ConversationPin(self)
        if self.pins is None:
            self.pins = [pin]
        else:
            self.pins.append(pin)
        return pin

    def settle_pins(self) -> None:
        """Settle the pins before anything moves (a failure stays with its pin)."""
        pins, self.pins = self.pins, None
        for pin in pins or ():
            pin.settle()

    def apply(self, envelope: EventEnvelope, *, fold_after: int | None = FOLD_AFTER) -> None:
        if self.pins:
            self.settle_pins()
        self.projection.apply(envelope)
        self.track(envelope.event, fold_after)

    def track(self, event: Event, fold_after: int | None = FOLD_AFTER) -> None:
        """Record *event*; fold the pending events once more than *fold_after* wait (``None``:
        only when someone asks, for a journal that never snapshots: its fold may never be needed)."""
        if self.pins:
            self.settle_pins()
        if type(event) in CALL_EVENTS:  # the projection took it: its type is exact
            self.track_call(event)
        self.unfolded.append(event)
        if fold_after is not None and len(self.unfolded) > fold_after:
            self._catch_up(strict=False)

    def read_call(self, event: Event) -> None:
        """Read the record `track_call` will update for ``event`` (one of `CALL_UPDATES`), before
        anything moves: a stored line that does not decode raises here, with nothing changed."""
        if isinstance(event, (ToolStarted, *_SETTLEMENTS)):
            self.calls.get(event.call_id)

    def track_call(self, event: Event) -> None:
        """Record a call's event (one of `CALL_EVENTS`) in its `CallRecord`."""
        if isinstance(event, ToolScheduled):
            self.calls[event.call_id] = CallRecord(event)
        elif isinstance(event, ToolStarted):
            record = self.calls[event.call_id]
            record.started_input = dict(event.input)
            record.attempts += 1
        elif isinstance(event, _SETTLEMENTS):
            self.calls[event.call_id].settlement = event

    def damaged(self) -> list[str]:
        """What of the snapshot's index lines a lookup found not to decode (`StoredIndex.damage`):
        the lines `rebuild_lines` replaces."""
        state = self.projection._s
        return [
            index.damage
            for index in (self.commands, state.ended, state.ended_tools, self.calls)
            if isinstance(index, StoredIndex) and index.damage is not None
        ]

    def rebuild_lines(self, rebuilt: _Stream, commands: Mapping[str, tuple[str, int, int]]) -> None:
        """Replace every index line still stored as text by the entries of ``rebuilt`` (the events
        up to the snapshot's seq or later, applied to a new stream) and ``commands`` (the store's):
        what each line stands for, as a replay has it. The entries set since stay. One step."""
        state, fresh = self.projection._s, rebuilt.projection._s
        pairs: tuple[tuple[MutableMapping[str, Any], Mapping[str, Any]], ...] = (
            (self.commands, commands),
            (state.ended, fresh.ended),
            (state.ended_tools, fresh.ended_tools),
            (self.calls, rebuilt.calls),
        )
        for index, items in pairs:
            if isinstance(index, StoredIndex) and index.stored:
                index.rebuild(items)

    def fold_some(self) -> None:
        """Fold what waits, as far as it folds (a payload it cannot read waits for `folded`)."""
        self._catch_up(strict=False)

    def _catch_up(self, *, strict: bool) -> None:
        done = 0
        fold = self.fold
        try:
            for event in self.unfolded:
                fold.feed(event)
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


def _encode_command(command_id: str, value: tuple[str, int, int]) -> list[Any]:
    return list(value)


def _decode_command(command_id: str, row: Any) -> tuple[str, int, int]:
    if not (isinstance(row, list) and len(row) == 3 and type(row[0]) is str and _seqs(row[1], row[2])):
        raise TypeError(f"command {command_id!r}: {row!r} is not [digest, first_seq, last_seq]")
    return row[0], row[1], row[2]


def command_index(text: bytes | memoryview | None = None, count: int = 0) -> StoredIndex[tuple[str, int, int]]:
    """A stream's replay cache: command id -> (digest, first_seq, last_seq), stored as ``[digest, first, last]``."""
    return StoredIndex(encode=_encode_command, decode=_decode_command, what="command ids", line=text, count=count)


def _seqs(first: object, last: object) -> bool:
    return type(first) is int and type(last) is int and 0 < first <= last


_REQUEST_STATES = {state.value: state for state in RequestState}


def _encode_request(request_id: str, record: RequestRecord) -> list[Any]:
    return [record.state.value, record.seq, record.turns]


def _decode_request(request_id: str, row: Any) -> RequestRecord:
    if not (
        isinstance(row, list)
        and len(row) == 3
        and row[0] in _REQUEST_STATES
        and type(row[1]) is int
        and type(row[2]) is int
    ):
        raise TypeError(f"request {request_id!r}: {row!r} is not [state, seq, turns]")
    return RequestRecord(request_id, _REQUEST_STATES[row[0]], row[1], row[2])


def ended_index(text: bytes | memoryview | None = None, count: int = 0) -> StoredIndex[RequestRecord]:
    """The projection's ended requests, stored as ``[state, seq, turns]``."""
    return StoredIndex(encode=_encode_request, decode=_decode_request, what="ended requests", line=text, count=count)


def _record_index(
    kind: type[Any], call_id_of: Callable[[Any], str], what: str, text: bytes | memoryview | None, count: int
) -> StoredIndex[Any]:
    """An index of attrs records of calls, by call id, stored as the converter has them."""

    def encode(key: str, record: Any) -> Any:
        return _converter.unstructure(record, kind)

    def decode(key: str, row: Any) -> Any:
        record = _converter.structure(row, kind)
        if call_id_of(record) != key:
            raise TypeError(f"the row of call {key!r} is of call {call_id_of(record)!r}")
        return record

    return StoredIndex(encode=encode, decode=decode, what=what, line=text, count=count)


def ended_tools_index(text: bytes | memoryview | None = None, count: int = 0) -> StoredIndex[ToolRecord]:
    """The projection's calls of ended requests."""
    index: StoredIndex[ToolRecord] = _record_index(
        ToolRecord, lambda record: record.call_id, "calls of ended requests", text, count
    )
    return index


def call_index(text: bytes | memoryview | None = None, count: int = 0) -> StoredIndex[CallRecord]:
    """A stream's `CallRecord` of every call."""
    index: StoredIndex[CallRecord] = _record_index(
        CallRecord, lambda record: record.scheduled.call_id, "call records", text, count
    )
    return index


_LINES = ("commands", "ended_requests", "ended_tools", "calls")
"""The index lines after the header and the entries, in this order (their sizes: ``_Body.lines``)."""


@attrs.frozen
class _Body:
    format: str
    version: int
    stream_id: str
    seq: int
    projection: _State
    conversation: dict[str, Any]
    lines: dict[str, int]  # each index line (`_LINES`) -> its entries


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
    if not isinstance(event, _SETTLEMENTS):
        raise TypeError(f"expected a settlement, got {type(event).__name__}")
    return event


def _unstructure_settlement(value: Settlement | None) -> Any:
    return None if value is None else event_converter.unstructure(value, Event)


def _structure_requests(value: object, _: object) -> dict[str, RequestRecord]:
    # The live requests (few): the rows of the ended ones, checked the same way.
    if not isinstance(value, dict):
        raise TypeError(f"expected an object of requests, got {type(value).__name__}")
    return {request_id: _decode_request(request_id, row) for request_id, row in value.items()}


def _is_ended(kind: Any) -> bool:
    return kind in (MutableMapping[str, RequestRecord], MutableMapping[str, ToolRecord])


def _no_ended(value: object, _: object) -> dict[str, Any]:
    if value != {}:
        raise TypeError("the ended requests and their calls are not in the header")
    return {}


def _is_set(kind: Any) -> bool:
    return kind in (set, frozenset) or get_origin(kind) in (set, frozenset)


def _configure(converter: cattrs.Converter) -> None:
    for kind in (str, int, float, bool):
        converter.register_structure_hook(kind, _strict(kind))
    converter.register_structure_hook_func(lambda t: t == (Settlement | None), _structure_settlement)
    converter.register_unstructure_hook_func(lambda t: t == (Settlement | None), _unstructure_settlement)
    converter.register_unstructure_hook_func(_is_set, lambda value: sorted(value))  # a stable body
    converter.register_structure_hook_func(lambda t: t == dict[str, RequestRecord], _structure_requests)
    converter.register_unstructure_hook_func(
        lambda t: t == dict[str, RequestRecord],
        lambda requests: {key: _encode_request(key, record) for key, record in requests.items()},
    )
    # The ended requests and their calls are lines of their own; the header holds none.
    converter.register_structure_hook_func(_is_ended, _no_ended)
    converter.register_unstructure_hook_func(_is_ended, lambda _: {})
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


def encode_snapshot(stream: _Stream, commands: Iterable[tuple[str, str, int, int]] = ()) -> bytes:
    """The snapshot of ``stream`` at its head: ``commands`` (id, digest, first, last) are added to its
    own cache (those past the head are left out). `JournalCorruptError` if the conversation cannot be
    folded."""
    fold = stream.folded()
    state, entries, outcomes = fold.to_parts()
    seq = stream.projection.head
    cache = stream.commands = _as_index(stream.commands, command_index)
    for command_id, digest, first_seq, last_seq in commands:
        if command_id not in cache:
            cache[command_id] = (digest, first_seq, last_seq)
    projection = stream.projection._s
    texts = {
        "commands": cache.to_text(keep=lambda _, value: value[2] <= seq),
        "ended_requests": _as_index(projection.ended, ended_index).to_text(),
        "ended_tools": _as_index(projection.ended_tools, ended_tools_index).to_text(),
        "calls": _as_index(stream.calls, call_index).to_text(),
    }
    body = _Body(
        format=SNAPSHOT_FORMAT,
        version=SNAPSHOT_VERSION,
        stream_id=stream.stream_id,
        seq=seq,
        projection=projection,
        conversation=state,
        lines={name: texts[name][1] for name in _LINES},
    )
    header = dumps(_converter.unstructure(body, _Body))
    return b"\n".join((header, entries, outcomes, *(texts[name][0] for name in _LINES)))


V = TypeVar("V")


def _as_index(items: MutableMapping[str, V], make: Callable[[], StoredIndex[V]]) -> StoredIndex[V]:
    if isinstance(items, StoredIndex):
        return items
    index = make()
    index.update(items)
    return index


def _lines(body: bytes) -> list[memoryview]:
    """The body's lines as views (the archive lines are not copied until they are decoded)."""
    view = memoryview(body)
    lines: list[memoryview] = []
    start = 0
    while (cut := body.find(b"\n", start)) >= 0:
        lines.append(view[start:cut])
        start = cut + 1
    lines.append(view[start:])
    return lines


def _state_problem(state: _State) -> str | None:
    """What in a snapshot's projection contradicts itself (a checksum vouches for the bytes, not
    for the code that wrote them), or ``None``. Only the live records are looked at (a handful):
    the ones the projection reaches by id when the next event comes. A record is filed under its
    own non-empty id, and a live turn, attempt or call belongs to a live request (and turn): the
    projection forgets them when their request ends."""
    tables: tuple[tuple[str, Mapping[str, Any], str], ...] = (
        ("requests", state.requests, "request_id"),
        ("turns", state.turns, "turn_id"),
        ("attempts", state.attempts, "attempt_id"),
        ("tools", state.tools, "call_id"),
        ("subagents", state.subagents, "subagent_id"),
    )
    for name, table, id_field in tables:
        for key, record in table.items():
            if not key or getattr(record, id_field) != key:
                return f"{name} files {getattr(record, id_field)!r} under {key!r}"
            if not record.request_id:
                return f"{name} {key!r} belongs to no request"
    for name, table, _ in tables[1:4]:
        for key, record in table.items():
            if record.request_id not in state.requests:
                return f"{name} {key!r} belongs to request {record.request_id!r}, which is not live"
            turn_id = getattr(record, "turn_id", key)  # a turn is its own
            turn = state.turns.get(turn_id)
            if turn is None or turn.request_id != record.request_id:
                return f"{name} {key!r} belongs to turn {turn_id!r}, which is not a live turn of its request"
    for name, value, table in (
        ("active_request", state.active_request, state.requests),
        ("open_turn", state.open_turn, state.turns),
        ("running_attempt", state.running_attempt, state.attempts),
    ):
        if value is not None and value not in table:
            return f"{name} names {value!r}, which is not among the live records"
    for turn_id, calls in state.unsettled.items():
        if turn_id not in state.turns or not calls.issubset(state.tools):
            return f"the unsettled calls {sorted(calls)} of turn {turn_id!r} are not live calls of a live turn"
    for call_id, call in state.tools.items():
        if call.permission is PermissionState.PENDING and not call.permission_id:
            return f"call {call_id!r} waits for a permission without an id"
    return None


def decode_snapshot(stream_id: str, agent_id: str, seq: int, body: bytes) -> _Stream:
    """The stream a stored snapshot stands for; `JournalCorruptError` says why it cannot be used."""

    def unusable(problem: str) -> JournalCorruptError:
        return JournalCorruptError(f"snapshot {stream_id}@{seq} cannot be used: {problem}")

    lines = _lines(body)
    header = bytes(lines[0])
    try:
        data = json.loads(header)
    except Exception as exc:  # not JSON, or JSON nested past the recursion limit: either way unusable
        raise unusable(f"its header does not decode: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise unusable(f"it is a JSON {type(data).__name__}, not an object")
    found = (data.get("format"), data.get("version"))
    if found != (SNAPSHOT_FORMAT, SNAPSHOT_VERSION):
        raise unusable(f"unknown format {found!r} (this code reads {(SNAPSHOT_FORMAT, SNAPSHOT_VERSION)!r})")
    if len(lines) != 3 + len(_LINES):
        raise unusable(
            f"it has {len(lines)} lines, not {3 + len(_LINES)} (state, conversation entries and outcomes, {_LINES})"
        )
    try:
        decoded = _converter.structure(data, _Body)
        fold = ConversationFold.from_parts(decoded.conversation, lines[1], lines[2])
    except Exception as exc:
        raise unusable(f"{type(exc).__name__}: {exc}") from exc
    if (decoded.stream_id, decoded.seq, decoded.projection.head) != (stream_id, seq, seq):
        raise unusable(f"it holds {decoded.stream_id}@{decoded.seq} with a projection at {decoded.projection.head}")
    stream = _Stream(stream_id, agent_id)
    if set(decoded.lines) != set(_LINES):
        raise unusable(f"its header names the lines {sorted(decoded.lines)}, not {sorted(_LINES)}")
    negative = sorted(name for name, count in decoded.lines.items() if count < 0)
    if negative:
        raise unusable(f"its header gives the lines {negative} a negative number of entries")
    problem = _state_problem(decoded.projection)
    if problem is not None:
        raise unusable(f"its projection does not hold together: {problem}")
    text = dict(zip(_LINES, lines[3:], strict=True))
    decoded.projection.ended = ended_index(text["ended_requests"], decoded.lines["ended_requests"])
    decoded.projection.ended_tools = ended_tools_index(text["ended_tools"], decoded.lines["ended_tools"])
    stream.projection = Projection.restored(stream_id, decoded.projection)
    stream.calls = call_index(text["calls"], decoded.lines["calls"])
    stream.commands = command_index(text["commands"], decoded.lines["commands"])
    stream.fold = fold
    stream.snapshot_seq = seq
    return stream
