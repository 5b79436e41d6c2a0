"""What the journal's lean per-event path keeps: its own constructors build exactly what the
event classes build (and refuse what they refuse, with the same errors), the reused JSON writers
give `json.dumps`'s text and errors, and a projection's records and emptied tables are as before."""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import sys
import uuid
from typing import Any

import attrs
import orjson
import pytest
import trio

from trio_agent._journal._durable import open_journal
from trio_agent._journal._errors import JournalCorruptError
from trio_agent._journal._events import (
    EventEnvelope,
    ModelAttemptCompleted,
    ModelAttemptStarted,
    RequestAccepted,
    RequestCompleted,
    RequestStarted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolScheduled,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
    decode_event,
    encode_event,
    model_attempt_completed,
    model_attempt_started,
    place_event,
    request_accepted,
    request_completed,
    request_started,
    tool_cancelled,
    tool_completed,
    tool_failed,
    tool_scheduled,
    tool_started,
    turn_completed,
    turn_started,
)
from trio_agent._journal._memory import MemoryStore
from trio_agent._journal._projection import (
    AttemptRecord,
    AttemptState,
    RequestRecord,
    RequestState,
    ToolRecord,
    ToolState,
    TurnRecord,
    TurnState,
    _attempt_record,
    _request_record,
    _tool_record,
    _turn_record,
)
from trio_agent._journal._store import (
    AppendBatch,
    AppendResult,
    _write_body,
    _write_digest,
    append_result,
    command_digest,
    encode_body,
)
from trio_agent._tools._definition import InterruptBehavior, SideEffect, ToolKind

KIND = next(iter(ToolKind))
INTERRUPT = next(iter(InterruptBehavior))

CONSTRUCTORS: list[tuple[Any, type[Any]]] = [
    (request_started, RequestStarted),
    (request_accepted, RequestAccepted),
    (request_completed, RequestCompleted),
    (turn_started, TurnStarted),
    (turn_completed, TurnCompleted),
    (model_attempt_started, ModelAttemptStarted),
    (model_attempt_completed, ModelAttemptCompleted),
    (tool_scheduled, ToolScheduled),
    (tool_started, ToolStarted),
    (tool_completed, ToolCompleted),
    (tool_failed, ToolFailed),
    (tool_cancelled, ToolCancelled),
]


def _good(cls: type[Any]) -> dict[str, Any]:
    """A distinct valid value per field (so fields passed in the wrong order would show)."""
    values: dict[str, Any] = {}
    for field in attrs.fields(cls):
        kind = field.type.__name__ if isinstance(field.type, type) else str(field.type)
        if kind in ("str", "str | None"):
            values[field.name] = f"{field.name}-value"
        elif kind == "int":
            values[field.name] = 3
        elif kind == "bool":
            values[field.name] = field.name != "synthetic"
        elif "JsonObject" in kind or "dict" in kind:
            values[field.name] = {field.name: [1, 2.5, None, {"x": "y"}]}
        elif kind == "SideEffect":
            values[field.name] = SideEffect.IDEMPOTENT
        elif kind == "ToolKind":
            values[field.name] = KIND
        elif kind == "InterruptBehavior":
            values[field.name] = INTERRUPT
        else:  # pragma: no cover - a new field type: teach this test
            raise AssertionError(f"{cls.__name__}.{field.name}: {field.type}")
    return values


def _outcome(make: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return make(*args, **kwargs)
    except Exception as exc:
        return (type(exc), str(exc))


@pytest.mark.parametrize(("make", "cls"), CONSTRUCTORS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_checked_constructor_builds_what_the_class_builds(make: Any, cls: type[Any]) -> None:
    values = _good(cls)
    built = make(*values.values())
    assert type(built) is cls
    assert built == cls(**values)
    assert encode_event(place_event("s/root", 1, built, 1.0)) == encode_event(
        EventEnvelope(stream_id="s/root", seq=1, event=cls(**values), recorded_at=1.0)
    )
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        built.request_id = "other"


class _Text(str):
    pass


@pytest.mark.parametrize(("make", "cls"), CONSTRUCTORS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_checked_constructor_refuses_what_the_class_refuses(make: Any, cls: type[Any]) -> None:
    values = _good(cls)
    bad_values: list[Any] = ["", None, 0, True, 1.5, float("nan"), {"x": float("inf")}, {"x": object()}, [1]]
    bad_values += [{1: "x"}, SideEffect.PURE, _Text("sub"), _Text(""), -1]
    for name in values:
        for bad in bad_values:
            changed = {**values, name: bad}
            assert _outcome(make, *changed.values()) == _outcome(cls, **changed), (name, bad)


def test_envelopes_and_store_values_built_in_place_are_the_classes_own() -> None:
    event = request_started("r1")
    envelope = place_event("s/root", 4, event, 2.5)
    assert type(envelope) is EventEnvelope
    assert envelope == EventEnvelope(stream_id="s/root", seq=4, event=event, recorded_at=2.5)
    with pytest.raises(TypeError, match="not a journal event"):
        place_event("s/root", 1, "nope", 1.0)  # type: ignore[arg-type]
    batch = AppendBatch.placed("s", "s/root", 7, (envelope,))
    assert type(batch) is AppendBatch
    assert batch == AppendBatch("s", "s/root", 7, (envelope,))
    result = append_result("s/root", 1, 2, False)
    assert type(result) is AppendResult
    assert result == AppendResult("s/root", 1, 2)
    assert append_result("s/root", 1, 2, True) == AppendResult("s/root", 1, 2, replayed=True)


@pytest.mark.parametrize(
    "value",
    [{"a": 1, "b": [1.5, "é\u2028", None, True]}, [{"z": 1, "a": 2}], {}, "x"],
)
def test_the_reused_json_writers_write_what_json_dumps_writes(value: Any) -> None:
    assert _write_body(value) == json.dumps(value, separators=(",", ":"), allow_nan=False)
    assert _write_digest(value) == json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


class _Plain(enum.Enum):
    A = "a"
    NAN = float("nan")


class _Level(str, enum.Enum):  # noqa: UP042 - the shape orjson mishandled
    """A str enum whose value is not its text: orjson would write the value, the standard library the text."""

    def __new__(cls, value: int, label: str) -> _Level:
        member = str.__new__(cls, label)
        member._value_ = value
        return member

    HIGH = (3, "high")


class _Unvalued(str, enum.Enum):  # noqa: UP042 - the shape orjson mishandled
    """A str enum whose ``value`` raises: orjson (with its subclass option) crashed the process on it."""

    FAST = "fast"

    @property
    def value(self) -> str:  # type: ignore[override]
        raise LookupError("no value")


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _cyclic() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["self"] = value
    return value


@pytest.mark.parametrize(
    "value",
    [
        {"a": float("nan")},
        {"a": object()},
        {(1,): 2},
        {"a": {1, 2}},
        {1: 2, "a": 1},
        _cyclic(),
        # orjson writes these (a non-finite float as null, a datetime, a decimal): refused all the same.
        {"a": None, "b": [1.5, {"c": float("inf")}]},
        [None, float("-inf")],
        {"a": datetime.datetime(2026, 1, 1)},
        {"a": decimal.Decimal("1.5")},
        # orjson writes any enum by its value and a UUID as text; the standard library refuses them.
        {"a": _Plain.A},
        {"a": _Plain.NAN, "b": None},
        {"a": uuid.UUID(int=1)},
        {"a": orjson.Fragment(b"NaN")},
    ],
)
def test_the_reused_json_writers_refuse_what_json_dumps_refuses(value: Any) -> None:
    for write, sort_keys in ((_write_body, False), (_write_digest, True)):
        for _ in range(2):  # a failure leaves nothing behind for the next call
            assert _outcome(write, value) == _outcome(
                json.dumps, value, separators=(",", ":"), sort_keys=sort_keys, allow_nan=False
            )


class _Colour(enum.StrEnum):
    RED = "red"


@pytest.mark.parametrize(
    "value",
    [
        {"ascii": "plain", "n": None, "floats": [0.1, 1e-07, 1e-05, 1e16, -0.0, 5e-324], "i": -(2**63)},
        {"big": 2**70, "small": -(2**70)},  # past orjson's 64 bits
        {"text": "h\u00e9 \u2028 \U0001f600", "surrogate": "\ud800"},  # escaped: the stored text is ASCII
        {"colour": _Colour.RED, "key": _Colour.RED},
        {"level": _Level.HIGH, "mode": _Unvalued.FAST, "flag": enum.IntFlag("F", "X").X},
        _nested(300),  # deeper than orjson goes
        {"control": '\x00\x1f\n"\\'},
    ],
    ids=["mixed", "big-int", "non-ascii", "str-enum", "odd-enums", "deep", "control"],
)
def test_a_stored_body_holds_what_json_dumps_would_store(value: Any) -> None:
    text = _write_body(value)
    assert text.isascii()
    assert json.loads(text) == json.loads(json.dumps(value, separators=(",", ":"), allow_nan=False))
    assert json.loads(text) == json.loads(json.dumps(value))


def test_stored_text_and_digests_are_unchanged() -> None:
    # Pinned texts: a stored journal and a command's digest must read the same as before.
    envelope = place_event("s/root", 2, request_accepted("r1", "r1", {"prompt": "hé"}), 1.25)
    assert encode_body(envelope) == (
        '{"stream_id":"s/root","seq":2,"event":{"request_id":"r1","command_id":"r1",'
        '"input":{"prompt":"h\\u00e9"},"type":"request_accepted"},"schema_version":1,"recorded_at":1.25}'
    )
    assert decode_event(json.loads(encode_body(envelope))) == envelope
    assert command_digest((envelope,)) == command_digest(
        (
            EventEnvelope(
                stream_id="x/y",
                seq=9,
                event=RequestAccepted(request_id="r1", command_id="r1", input={"prompt": "hé"}),
                recorded_at=0.0,
            ),
        )
    )


def test_a_corrupt_stored_event_is_still_refused() -> None:
    data = encode_event(place_event("s/root", 1, turn_started("r1", "t1", 1), 1.0))
    data["event"]["turn_id"] = ""
    with pytest.raises(JournalCorruptError):
        decode_event(data)


def test_projection_records_built_in_place_are_the_classes_own() -> None:
    assert _request_record("r", RequestState.ACCEPTED, 3, 0) == RequestRecord("r", RequestState.ACCEPTED, 3)
    assert _turn_record("t", "r", 2, TurnState.OPEN, 4) == TurnRecord("t", "r", 2, TurnState.OPEN, 4)
    assert _attempt_record("a", "r", "t", AttemptState.RUNNING, 5) == AttemptRecord(
        "a", "r", "t", AttemptState.RUNNING, 5
    )
    event = tool_scheduled("r", "t", "c", "add", {}, SideEffect.PURE, KIND, INTERRUPT, True, "k")
    assert _tool_record(event, ToolState.SCHEDULED, 6) == ToolRecord(
        call_id="c",
        request_id="r",
        turn_id="t",
        tool_name="add",
        side_effect=SideEffect.PURE,
        idempotency_key="k",
        state=ToolState.SCHEDULED,
        seq=6,
    )
    for record in (_request_record("r", RequestState.ACCEPTED, 3, 0), _tool_record(event, ToolState.SCHEDULED, 6)):
        for field in attrs.fields(type(record)):
            getattr(record, field.name)  # every slot is filled


async def test_an_idle_stream_gives_back_its_emptied_tables() -> None:
    async with open_journal(MemoryStore()) as journal:
        for n in range(3):
            rid = f"r{n}"
            await journal.append(request_accepted(rid, rid, {"prompt": "hi"}), request_started(rid))
            journal.defer(turn_started(rid, f"{rid}-t1", 1), model_attempt_started(rid, f"{rid}-t1", "a1", "m"))
            journal.defer(
                tool_scheduled(rid, f"{rid}-t1", f"{rid}-c", "add", {}, SideEffect.PURE, KIND, INTERRUPT, True, "k")
            )
            await journal.append(tool_started(rid, f"{rid}-t1", f"{rid}-c", {}, SideEffect.PURE, False))
            await journal.append(tool_completed(rid, f"{rid}-t1", f"{rid}-c", {"output": 3}, True))
            journal.defer(model_attempt_completed(rid, f"{rid}-t1", "a1", {"text": "ok"}))
            journal.defer(turn_completed(rid, f"{rid}-t1", True))
            await journal.append(request_completed(rid, {"text": "done"}))
        state = journal.projection()._s
        empty = sys.getsizeof({})
        for table in (state.requests, state.turns, state.attempts, state.tools, state.unsettled, state.paused):
            assert not table
            assert sys.getsizeof(table) == empty
        assert journal.projection().request("r2") is not None
        assert journal.projection().request("r2").state is RequestState.COMPLETED  # type: ignore[union-attr]
        await trio.lowlevel.checkpoint()
