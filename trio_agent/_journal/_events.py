"""Durable journal events and their strict (de)serialisation.

Every event is a frozen attrs class that carries the correlation ids it needs
(``request_id``, ``turn_id``, ``attempt_id``, ``call_id`` ...), each validated
non-empty at construction. An `EventEnvelope` places one event on one agent's
stream at a sequence number. On the wire an envelope is a JSON-compatible dict
whose ``event`` is tagged by its ``type`` (``"tool_scheduled"`` ...).

`decode_event` is strict: unknown fields, missing ids, wrongly typed values, bad
enum values, non-finite numbers and unknown schema versions all raise
`JournalCorruptError`. Token deltas and progress are never durable events.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union

from .._builders import checked_constructor, constructor
from .._convert import LazyConverter
from .._errors import error_code
from .._json import explain_json, is_json
from .._tools._definition import InterruptBehavior, SideEffect, ToolKind
from .._tools._results import json_copy
from .._util import describe
from ._errors import JournalCorruptError

__all__ = [
    "PERMISSION_UPDATE_SOURCES",
    "SCHEMA_VERSION",
    "ConversationSeeded",
    "ErrorInfo",
    "Event",
    "EventEnvelope",
    "InboxNoted",
    "InterruptsResolved",
    "ModelAbortReason",
    "ModelAttemptAborted",
    "ModelAttemptCompleted",
    "ModelAttemptFailed",
    "ModelAttemptStarted",
    "OutcomeUnknownReason",
    "PermissionDecision",
    "PermissionRequested",
    "PermissionResolved",
    "PermissionUpdated",
    "PromptSubmitted",
    "RecoveryDecision",
    "RequestAccepted",
    "RequestCompleted",
    "RequestFailed",
    "RequestInterruptReason",
    "RequestInterrupted",
    "RequestStarted",
    "RunPaused",
    "SessionCloseReason",
    "SessionClosed",
    "SessionCreated",
    "SessionReopened",
    "SubagentCancelled",
    "SubagentCompleted",
    "SubagentStarted",
    "ToolCancelled",
    "ToolCompleted",
    "ToolFailed",
    "ToolOutcomeUnknown",
    "ToolRecoveryAction",
    "ToolScheduled",
    "ToolStarted",
    "TurnAbortReason",
    "TurnAborted",
    "TurnCompleted",
    "TurnStarted",
    "decode_event",
    "encode_event",
    "event_converter",
    "event_type_name",
]

SCHEMA_VERSION = 1
"""The only schema version this code reads and writes."""

JsonObject: TypeAlias = dict[str, Any]


# ---------------------------------------------------------------- validators


def _non_empty(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty string, not {value!r}")


def _optional_non_empty(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _non_empty(instance, attribute, value)


def _json_object(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is dict and is_json(value):
        return  # the common case, in one call
    if not isinstance(value, dict):
        raise ValueError(f"{attribute.name} must be a JSON object, not {type(value).__name__}")
    explain_json(value, attribute.name)


def _optional_json_object(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _json_object(instance, attribute, value)


PERMISSION_UPDATE_SOURCES = frozenset({"tool", "permission_engine", "handler"})
"""Who may change the permission rules: the tool itself (its own ``permission_updates`` effect),
the permission engine, or a permission handler's answer. Never middleware or a plugin's middleware
(a plugin's tool is a tool: its own effect counts)."""


def _update_source(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or value not in PERMISSION_UPDATE_SOURCES:
        raise ValueError(f"{attribute.name} must be one of {sorted(PERMISSION_UPDATE_SOURCES)}, not {value!r}")


def _positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, not {value!r}")


def _id() -> Any:
    return attrs.field(validator=_non_empty)


# ---------------------------------------------------------------- enums


class SessionCloseReason(enum.Enum):
    COMPLETED = "completed"
    USER = "user"
    SHUTDOWN = "shutdown"
    ERROR = "error"


class RequestInterruptReason(enum.Enum):
    USER_ABORT = "user_abort"
    SESSION_CLOSE = "session_close"
    STEERING = "steering"
    PROCESS_RESTART = "process_restart"


class TurnAbortReason(enum.Enum):
    REQUEST_INTERRUPTED = "request_interrupted"
    ERROR = "error"
    PROCESS_RESTART = "process_restart"
    RECOVERY_REQUIRED = "recovery_required"


class ModelAbortReason(enum.Enum):
    REQUEST_INTERRUPTED = "request_interrupted"
    STEERING = "steering"
    PROCESS_RESTART = "process_restart"


class OutcomeUnknownReason(enum.Enum):
    PROCESS_RESTART = "process_restart"
    COMMIT_OUTCOME_UNKNOWN = "commit_outcome_unknown"
    NO_RECONCILE = "no_reconcile"


class PermissionDecision(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    CANCEL = "cancel"


class ToolRecoveryAction(enum.Enum):
    """What recovery does with one tool call (see the projection's recovery plan).

    ``replay_result``: settled, the stored result is replayed and the tool never re-run.
    ``run``: scheduled but never started, it may run.
    ``cancel``: scheduled, its permission was denied or cancelled: settle it cancelled.
    ``rerun``: a ``pure`` call started without an outcome runs again.
    ``rerun_same_key``: an ``idempotent`` one runs again with the same idempotency key.
    ``reconcile``: a ``non_idempotent`` one whose tool has a ``reconcile`` is reconciled.
    ``settle_outcome_unknown``: a ``non_idempotent`` one without it settles ``outcome_unknown``.
    """

    REPLAY_RESULT = "replay_result"
    RUN = "run"
    CANCEL = "cancel"
    RERUN = "rerun"
    RERUN_SAME_KEY = "rerun_same_key"
    RECONCILE = "reconcile"
    SETTLE_OUTCOME_UNKNOWN = "settle_outcome_unknown"


# ---------------------------------------------------------------- payload parts


@attrs.frozen(kw_only=True)
class ErrorInfo:
    message: str = attrs.field(validator=attrs.validators.instance_of(str))
    code: str | None = attrs.field(default=None, validator=_optional_non_empty)
    retryable: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        """What the journal keeps of *error*: its message (cut to 2,000 characters), and its
        ``code`` and ``retryable`` where it has them (a `ModelError`, a `HookError` ...).

        Never raises: *error* is often user code's, whose ``__str__`` (or a property) may raise,
        and a failure here would leave the request it ends unrecorded (`describe`)."""
        try:
            retryable = getattr(error, "retryable", False) is True
        except Exception:  # a property of user code's that raises: not retryable
            retryable = False
        return cls(message=describe(error, "text")[:2000], code=error_code(error), retryable=retryable)


# ---------------------------------------------------------------- events


@attrs.frozen(kw_only=True)
class SessionCreated:
    session_id: str = _id()
    agent_id: str = _id()
    parent_agent_id: str | None = attrs.field(default=None, validator=_optional_non_empty)


@attrs.frozen(kw_only=True)
class SessionClosed:
    """The end of a session's life. ``final``: ended for good, it can be read but never reopened."""

    session_id: str = _id()
    reason: SessionCloseReason = attrs.field(validator=attrs.validators.instance_of(SessionCloseReason))
    final: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


@attrs.frozen(kw_only=True)
class SessionReopened:
    """A new life of a cleanly closed session: same streams, the conversation goes on. ``life``
    counts from 2 (the first life starts with ``session_created``)."""

    session_id: str = _id()
    life: int = attrs.field(validator=_positive)


@attrs.frozen(kw_only=True)
class ConversationSeeded:
    """Messages a new session starts from (``open_session(history=...)``), each encoded by the
    message converter: ``conversation = {"messages": [...]}``. Only before the first request."""

    session_id: str = _id()
    conversation: JsonObject = attrs.field(validator=_json_object)


@attrs.frozen(kw_only=True)
class RequestAccepted:
    request_id: str = _id()
    command_id: str = _id()
    input: JsonObject = attrs.field(validator=_json_object)


@attrs.frozen(kw_only=True)
class RequestStarted:
    request_id: str = _id()


@attrs.frozen(kw_only=True)
class RequestCompleted:
    request_id: str = _id()
    output: JsonObject | None = attrs.field(default=None, validator=_optional_json_object)


@attrs.frozen(kw_only=True)
class RequestFailed:
    request_id: str = _id()
    error: ErrorInfo = attrs.field(validator=attrs.validators.instance_of(ErrorInfo))


@attrs.frozen(kw_only=True)
class RequestInterrupted:
    request_id: str = _id()
    reason: RequestInterruptReason = attrs.field(validator=attrs.validators.instance_of(RequestInterruptReason))


def _ids(values: Iterable[str]) -> tuple[str, ...]:
    ids = tuple(values)
    if not all(isinstance(value, str) for value in ids):
        raise TypeError(f"expected strings, got {ids!r}")
    return ids


@attrs.frozen(kw_only=True)
class PromptSubmitted:
    """What a started request's prompt became after the UserPromptSubmit hooks: the user
    ``messages`` that joined the conversation instead of the accepted prompt (a rewritten
    prompt, then added context; none when a hook skipped it). Written only when a hook
    changed something."""

    request_id: str = _id()
    messages: tuple[str, ...] = attrs.field(default=(), converter=_ids)


def _notes(values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, (str, bytes, dict)):  # one text is no list of them (nor its characters)
        raise TypeError(f"messages must be a list of strings, not {type(values).__name__}")
    notes = _ids(values)
    if not notes:
        raise ValueError("messages must hold at least one message")
    return notes


@attrs.frozen(kw_only=True)
class InboxNoted:
    """``messages`` entered the agent's inbox: its next model call takes them as input (after
    the prompt). Written only when something enters it: a tool's ``new_messages`` effect, a
    background subagent's report that no ``subagent_completed`` / ``subagent_cancelled`` tells
    (a later work's, an idle one's), a message that joined a request which ended before a turn
    took it, recovery's notes. Owed until a model call journals them among its ``inputs``
    (`ConversationFold.undelivered_notes`): a reopened session puts those back in the inbox.
    ``request_id``: the request whose run they came from, if any; ``subagent_id``: the
    background subagent that reported them, if any. Journals written before it existed have
    none: what their inboxes held was lost with the process, as it then was."""

    messages: tuple[str, ...] = attrs.field(converter=_notes)
    request_id: str | None = attrs.field(default=None, validator=_optional_non_empty)
    subagent_id: str | None = attrs.field(default=None, validator=_optional_non_empty)


@attrs.frozen(kw_only=True)
class RunPaused:
    """The request ended paused: ``state`` is where it paused (the batch of questions, the calls
    waiting for answers, the loop's counters), as `PausedRun` JSON without the history."""

    request_id: str = _id()
    state: JsonObject = attrs.field(validator=_json_object)


@attrs.frozen(kw_only=True)
class InterruptsResolved:
    """The paused request ``request_id`` was answered by the continuation ``continuation_id``
    (a started request): the ``answers`` as given, and the ``results`` the model reads for the
    calls answered without running (call id -> ``{"text", "is_error"}``)."""

    request_id: str = _id()
    continuation_id: str = _id()
    answers: JsonObject = attrs.field(validator=_json_object)
    results: JsonObject = attrs.field(factory=dict, validator=_json_object)
    approved: tuple[str, ...] = attrs.field(default=(), converter=_ids)  # calls a person approved


@attrs.frozen(kw_only=True)
class TurnStarted:
    request_id: str = _id()
    turn_id: str = _id()
    turn: int = attrs.field(validator=_positive)


@attrs.frozen(kw_only=True)
class TurnCompleted:
    request_id: str = _id()
    turn_id: str = _id()
    has_tool_calls: bool = attrs.field(validator=attrs.validators.instance_of(bool))


@attrs.frozen(kw_only=True)
class TurnAborted:
    request_id: str = _id()
    turn_id: str = _id()
    reason: TurnAbortReason = attrs.field(validator=attrs.validators.instance_of(TurnAbortReason))


@attrs.frozen(kw_only=True)
class ModelAttemptStarted:
    request_id: str = _id()
    turn_id: str = _id()
    attempt_id: str = _id()
    model: str = _id()


@attrs.frozen(kw_only=True)
class ModelAttemptCompleted:
    request_id: str = _id()
    turn_id: str = _id()
    attempt_id: str = _id()
    response: JsonObject = attrs.field(validator=_json_object)


@attrs.frozen(kw_only=True)
class ModelAttemptFailed:
    request_id: str = _id()
    turn_id: str = _id()
    attempt_id: str = _id()
    error: ErrorInfo = attrs.field(validator=attrs.validators.instance_of(ErrorInfo))


@attrs.frozen(kw_only=True)
class ModelAttemptAborted:
    request_id: str = _id()
    turn_id: str = _id()
    attempt_id: str = _id()
    reason: ModelAbortReason = attrs.field(validator=attrs.validators.instance_of(ModelAbortReason))


@attrs.frozen(kw_only=True)
class ToolScheduled:
    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    tool_name: str = _id()
    model_input: JsonObject = attrs.field(validator=_json_object)
    side_effect: SideEffect = attrs.field(validator=attrs.validators.instance_of(SideEffect))
    kind: ToolKind = attrs.field(validator=attrs.validators.instance_of(ToolKind))
    interrupt: InterruptBehavior = attrs.field(validator=attrs.validators.instance_of(InterruptBehavior))
    concurrency_safe: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    idempotency_key: str = _id()


@attrs.frozen(kw_only=True)
class ToolStarted:
    """The FINAL input (after middleware and permission), durable before the side effect."""

    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    input: JsonObject = attrs.field(validator=_json_object)
    side_effect: SideEffect = attrs.field(validator=attrs.validators.instance_of(SideEffect))
    synthetic: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


@attrs.frozen(kw_only=True)
class ToolCompleted:
    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    result: JsonObject = attrs.field(validator=_json_object)
    published: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


@attrs.frozen(kw_only=True)
class ToolFailed:
    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    result: JsonObject = attrs.field(validator=_json_object)
    published: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


@attrs.frozen(kw_only=True)
class ToolCancelled:
    """A call that ended without a result of its tool's own. ``result`` is the answer the
    model was given (an interrupted or denied result), so a rebuilt history tells it the
    same; journals written before it existed have none."""

    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    reason: str = _id()
    result: JsonObject | None = attrs.field(default=None, validator=_optional_json_object)
    published: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


@attrs.frozen(kw_only=True)
class ToolOutcomeUnknown:
    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    reason: OutcomeUnknownReason = attrs.field(validator=attrs.validators.instance_of(OutcomeUnknownReason))


@attrs.frozen(kw_only=True)
class PermissionRequested:
    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    permission_id: str = _id()
    message: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )


@attrs.frozen(kw_only=True)
class PermissionResolved:
    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    permission_id: str = _id()
    decision: PermissionDecision = attrs.field(validator=attrs.validators.instance_of(PermissionDecision))
    # The input an allow covers when the answer changed it (a handler's or hook's updated_input):
    # a recovery re-run of the call runs that, not the model's. None: the asked input (and every
    # journal written before it existed).
    input: JsonObject | None = attrs.field(default=None, validator=_optional_json_object)


@attrs.frozen(kw_only=True)
class PermissionUpdated:
    """One accepted change of the permission rules, in the order it was applied.

    On reopen the session replays every one of a stream (`Projection.permission_updates`)
    into its permission engine. ``update`` describes the rule change or the mode switch
    (its shape is the session's); ``call_id`` names the tool call it came from, if any.
    """

    request_id: str = _id()
    source: str = attrs.field(validator=_update_source)
    update: JsonObject = attrs.field(validator=_json_object)
    call_id: str | None = attrs.field(default=None, validator=_optional_non_empty)


@attrs.frozen(kw_only=True)
class SubagentStarted:
    """On the parent's stream: ``subagent_id`` names the child's own stream. ``background``: it
    reports its outcomes to the parent's next turn (a foreground one answers its ``task`` call
    instead); journals written before it existed have none, and read every subagent as background,
    as recovery then did."""

    request_id: str = _id()
    subagent_id: str = _id()
    call_id: str | None = attrs.field(default=None, validator=_optional_non_empty)
    background: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


@attrs.frozen(kw_only=True)
class SubagentCompleted:
    request_id: str = _id()
    subagent_id: str = _id()


@attrs.frozen(kw_only=True)
class SubagentCancelled:
    request_id: str = _id()
    subagent_id: str = _id()
    reason: str = _id()


@attrs.frozen(kw_only=True)
class RecoveryDecision:
    request_id: str = _id()
    turn_id: str = _id()
    call_id: str = _id()
    decision: ToolRecoveryAction = attrs.field(validator=attrs.validators.instance_of(ToolRecoveryAction))
    reason: str = _id()


Event: TypeAlias = (
    SessionCreated
    | SessionClosed
    | SessionReopened
    | ConversationSeeded
    | RequestAccepted
    | RequestStarted
    | RequestCompleted
    | RequestFailed
    | RequestInterrupted
    | PromptSubmitted
    | InboxNoted
    | RunPaused
    | InterruptsResolved
    | TurnStarted
    | TurnCompleted
    | TurnAborted
    | ModelAttemptStarted
    | ModelAttemptCompleted
    | ModelAttemptFailed
    | ModelAttemptAborted
    | ToolScheduled
    | ToolStarted
    | ToolCompleted
    | ToolFailed
    | ToolCancelled
    | ToolOutcomeUnknown
    | PermissionRequested
    | PermissionResolved
    | PermissionUpdated
    | SubagentStarted
    | SubagentCompleted
    | SubagentCancelled
    | RecoveryDecision
)

EVENT_TYPES: tuple[type[Any], ...] = Event.__args__


def _finite(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, not {value!r}")


def _event(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, EVENT_TYPES):
        raise ValueError(f"{attribute.name} is not a journal event: {type(value).__name__}")


@attrs.frozen(kw_only=True)
class EventEnvelope:
    """One event at ``seq`` (1, 2, 3 ... without gaps) on the stream of one agent."""

    stream_id: str = _id()
    seq: int = attrs.field(validator=_positive)
    event: Event = attrs.field(validator=_event)
    schema_version: int = SCHEMA_VERSION
    recorded_at: float = attrs.field(validator=_finite)


_EVENT_TYPE_SET = frozenset(EVENT_TYPES)


# The journal checks what it places (`place_event`): an envelope built without its validators.
_placed: Callable[[str, int, Event, int, float], EventEnvelope] = constructor(
    EventEnvelope, trusted=("stream_id", "seq", "event", "schema_version", "recorded_at")
)


def place_event(stream_id: str, seq: int, event: Event, recorded_at: float) -> EventEnvelope:
    """The journal's own envelope for *event*, built without the constructor's validators.

    The journal checked the stream id, counts ``seq`` itself and takes ``recorded_at`` from
    its store's clock; only the event comes from its caller, so only its type is checked. A
    request writes a dozen envelopes, and their validators were a measurable part of it.
    """
    if type(event) not in _EVENT_TYPE_SET and not isinstance(event, EVENT_TYPES):
        raise TypeError(f"not a journal event: {type(event).__name__}")
    return _placed(stream_id, seq, event, SCHEMA_VERSION, recorded_at)


_InstanceOf: type[Any] = type(attrs.validators.instance_of(int))
_Optional: type[Any] = type(attrs.validators.optional(attrs.validators.instance_of(int)))


def _check_source(validator: object, name: str, names: dict[str, object]) -> str | None:
    """The expression that accepts *name*'s value when *validator* would (``None``: none known).

    Each test is exact (``type(x) is str``, not ``isinstance``): a value it does not accept goes
    to the class's own constructor, which accepts it or raises what it always raised."""
    if validator is _non_empty:
        return f"(type({name}) is str and {name} != '')"
    if validator is _optional_non_empty:
        return f"({name} is None or (type({name}) is str and {name} != ''))"
    if validator is _json_object or validator is _optional_json_object:
        names["is_json"] = is_json
        test = f"(type({name}) is dict and is_json({name}))"
        return test if validator is _json_object else f"({name} is None or {test})"
    if validator is _positive:
        return f"(type({name}) is int and {name} >= 1)"
    known: Any = validator
    if isinstance(known, _Optional):
        inner = _check_source(known.validator, name, names)
        return None if inner is None else f"({name} is None or {inner})"
    if isinstance(known, _InstanceOf) and isinstance(known.type, type):
        names[f"_{name}_type"] = known.type
        return f"type({name}) is _{name}_type"
    return None


# The events the journal's own writers build on every request, in field order (all fields).
request_started: Callable[[str], RequestStarted] = checked_constructor(RequestStarted, _check_source)
request_accepted: Callable[[str, str, JsonObject], RequestAccepted] = checked_constructor(
    RequestAccepted, _check_source
)
request_completed: Callable[[str, JsonObject | None], RequestCompleted] = checked_constructor(
    RequestCompleted, _check_source
)
turn_started: Callable[[str, str, int], TurnStarted] = checked_constructor(TurnStarted, _check_source)
turn_completed: Callable[[str, str, bool], TurnCompleted] = checked_constructor(TurnCompleted, _check_source)
model_attempt_started: Callable[[str, str, str, str], ModelAttemptStarted] = checked_constructor(
    ModelAttemptStarted, _check_source
)
model_attempt_completed: Callable[[str, str, str, JsonObject], ModelAttemptCompleted] = checked_constructor(
    ModelAttemptCompleted, _check_source
)
# The record of an assembled reply (`reply_payload`), whose every leaf is a checked chunk's text or
# bounded count, or the loop's own text: JSON by construction (`test_reply_payloads_are_json_by_construction`),
# not walked again. Its ids are the turn's, checked as its `ModelAttemptStarted` was built.
model_attempt_replied: Callable[[str, str, str, JsonObject], ModelAttemptCompleted] = constructor(
    ModelAttemptCompleted, trusted=("request_id", "turn_id", "attempt_id", "response")
)
tool_scheduled: Callable[
    [str, str, str, str, JsonObject, SideEffect, ToolKind, InterruptBehavior, bool, str], ToolScheduled
] = checked_constructor(ToolScheduled, _check_source)
tool_started: Callable[[str, str, str, JsonObject, SideEffect, bool], ToolStarted] = checked_constructor(
    ToolStarted, _check_source
)
# The same, for an input the caller has just copied with `copy_if_json` (so it is JSON, and a dict
# no one else holds): not walked a second time.
tool_scheduled_copied: Callable[
    [str, str, str, str, JsonObject, SideEffect, ToolKind, InterruptBehavior, bool, str], ToolScheduled
] = checked_constructor(ToolScheduled, _check_source, trusted=("model_input",))
tool_started_copied: Callable[[str, str, str, JsonObject, SideEffect, bool], ToolStarted] = checked_constructor(
    ToolStarted, _check_source, trusted=("input",)
)
tool_completed: Callable[[str, str, str, JsonObject, bool], ToolCompleted] = checked_constructor(
    ToolCompleted, _check_source
)
tool_failed: Callable[[str, str, str, JsonObject, bool], ToolFailed] = checked_constructor(ToolFailed, _check_source)
tool_cancelled: Callable[[str, str, str, str, JsonObject | None, bool], ToolCancelled] = checked_constructor(
    ToolCancelled, _check_source
)


# ---------------------------------------------------------------- converter

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def event_type_name(cls: type[Any]) -> str:
    """The wire tag of an event class: ``ToolScheduled`` -> ``"tool_scheduled"``."""
    return _CAMEL.sub("_", cls.__name__).lower()


def _strict(kind: type[Any]) -> Any:
    def hook(value: object, _: object) -> Any:
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return hook


def _json_hook(value: object, _: object) -> Any:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _texts_hook(value: object, _: object) -> tuple[str, ...]:
    # cattrs iterates any iterable: "abc" would read as ("a", "b", "c"), a dict as its keys.
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of strings, got {type(value).__name__}")
    for item in value:
        if type(item) is not str:
            raise TypeError(f"expected a list of strings, got an item of type {type(item).__name__}")
    return tuple(value)


def _configure_events(converter: cattrs.Converter) -> None:
    for kind in (str, int, float, bool):
        converter.register_structure_hook(kind, _strict(kind))
    converter.register_structure_hook_func(lambda t: t == tuple[str, ...], _texts_hook)
    converter.register_structure_hook_func(lambda t: t == JsonObject, _json_hook)
    converter.register_unstructure_hook_func(lambda t: t == JsonObject, lambda value: value)
    configure_tagged_union(Event, converter, tag_generator=event_type_name, tag_name="type")


event_converter: cattrs.Converter = LazyConverter(configure=_configure_events, forbid_extra_keys=True)
"""The strict converter of journal events (tagged union on ``"type"``), configured on first use."""


def encode_event(envelope: EventEnvelope, *, validate: bool = True) -> dict[str, Any]:
    """The JSON-compatible dict of an envelope.

    Every field of an event is type-checked when the event is built (attrs
    validators), so junk cannot get this far; ``validate=True`` additionally
    decodes the result again, proving the round trip (the journal's hot path
    skips that second pass).
    """
    if envelope.schema_version != SCHEMA_VERSION:
        raise JournalCorruptError(f"cannot encode schema version {envelope.schema_version!r}")
    data: dict[str, Any] = event_converter.unstructure(envelope, EventEnvelope)
    if validate:
        decode_event(data)
    return data


def decode_event(data: dict[str, Any]) -> EventEnvelope:
    """Decode and validate one envelope; any defect raises `JournalCorruptError`."""
    if not isinstance(data, dict):
        raise JournalCorruptError(f"an envelope must be a dict, not {type(data).__name__}")
    version = data.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise JournalCorruptError(f"unknown schema version {version!r} (this code reads {SCHEMA_VERSION})")
    event = data.get("event")
    if isinstance(event, dict):
        tag = event.get("type")
        if not isinstance(tag, str) or tag not in _TAGS:  # a list or an object is no tag (and unhashable)
            raise JournalCorruptError(f"unknown event type {tag!r}")
    try:
        return event_converter.structure(json_copy(data), EventEnvelope)
    except Exception as exc:
        details = "; ".join(_messages(exc)) or repr(exc)
        raise JournalCorruptError(f"invalid journal envelope: {details}") from exc


_TAGS = frozenset(event_type_name(cls) for cls in EVENT_TYPES)


def _messages(exc: BaseException) -> list[str]:
    if isinstance(exc, BaseExceptionGroup):
        out = [str(note) for note in getattr(exc, "__notes__", [])]
        for sub in exc.exceptions:
            out.extend(_messages(sub))
        return out
    text = f"{type(exc).__name__}: {exc}"
    notes: list[object] = getattr(exc, "__notes__", [])
    return [f"{text} ({'; '.join(str(n) for n in notes)})" if notes else text]
