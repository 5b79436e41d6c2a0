"""Tool results, typed tool errors and the items a tool streams while it runs."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import attrs
import cattrs

from .._builders import constructor
from .._json import is_json, json_problem
from .._util import describe, instance_of, safe_repr

__all__ = [
    "Effect",
    "JsonObject",
    "Progress",
    "ToolError",
    "ToolErrorType",
    "ToolFailure",
    "ToolItem",
    "ToolMessage",
    "ToolResult",
    "describe",
    "result_problem",
    "result_to_json",
]

JsonObject: TypeAlias = dict[str, Any]
"""A JSON object as decoded by ``json.loads``: tool input is always one."""


def json_copy(value: Any) -> Any:
    """A copy of JSON containers (dicts and lists); immutable leaves are shared."""
    # Exactly dicts and lists are copied (leaves, subclasses included, are shared). Tested with
    # `is`, not `in (dict, list)`: a miss there compares the types, a call each.
    kind = type(value)
    if kind is dict:
        copy = value.copy()
        for key, item in copy.items():  # replacing a key's value does not disturb the iteration
            kind = type(item)
            if kind is dict or kind is list:
                copy[key] = json_copy(item)
        return copy
    if kind is list:
        copy = value.copy()
        for index, item in enumerate(copy):
            kind = type(item)
            if kind is dict or kind is list:
                copy[index] = json_copy(item)
        return copy
    return value


class ToolErrorType(enum.Enum):
    """The kinds of tool failure the model and the journal distinguish."""

    VALIDATION = "validation"
    PERMISSION_DENIED = "permission_denied"
    EXECUTION = "execution"
    INTERRUPTED = "interrupted"
    TIMEOUT = "timeout"
    NETWORK = "network"


@attrs.frozen
class ToolError:
    """Why a tool call failed. ``code`` is a stable machine-readable detail (e.g. ``"steering"``)."""

    type: ToolErrorType = attrs.field(validator=instance_of(ToolErrorType))
    message: str
    code: str | None = None
    details: Mapping[str, Any] | None = None


@attrs.frozen
class ToolResult:
    """The one result of a tool call: a success, or an error carrying a `ToolError`.

    ``output`` is what the model sees; ``display`` is an optional summary for people;
    ``data`` is structured output for programs; ``metadata`` is free-form.
    """

    output: Any
    error: ToolError | None = None
    display: str | None = None
    data: Any = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        """Whether this is a success."""
        return self.error is None

    @classmethod
    def success(
        cls,
        output: Any,
        *,
        display: str | None = None,
        data: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ToolResult:
        if cls is not ToolResult:
            return cls(output, None, display, data, {} if metadata is None else dict(metadata))
        # Most tools return one: built cheaper (see `_builders`).
        return _result(output, None, display, data, {} if metadata is None else dict(metadata))

    @classmethod
    def failure(
        cls,
        type: ToolErrorType,
        message: str,
        *,
        code: str | None = None,
        details: Mapping[str, Any] | None = None,
        output: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ToolResult:
        """An error result; the model sees *output*, by default ``"Error: <message>"``."""
        error = ToolError(type, message, code, details)
        return cls(f"Error: {message}" if output is None else output, error, None, None, dict(metadata or {}))


_result: Callable[[Any, ToolError | None, str | None, Any, Mapping[str, Any]], ToolResult] = constructor(ToolResult)

results_converter = cattrs.Converter()
"""Turns a `ToolResult` into its stored form and back (`result_to_json`, the journal's ``result_from_json``)."""

_SCALARS = frozenset({type(None), bool, int, float, str})


def result_to_json(result: ToolResult) -> dict[str, Any]:
    """A `ToolResult` as stored in the journal (JSON-compatible; non-JSON output is refused)."""
    output, display = result.output, result.display
    if (
        type(output) in _SCALARS
        and result.error is None
        and result.data is None
        and (display is None or type(display) is str)
        and type(result.metadata) is dict
        and not result.metadata
    ):
        # The usual success, a plain value: what the converter gives it (a test holds them together).
        return {"output": output, "error": None, "display": display, "data": None, "metadata": {}}
    data: dict[str, Any] = results_converter.unstructure(result, ToolResult)
    copied: dict[str, Any] = json_copy(data)
    return copied


def result_problem(result: ToolResult) -> str | None:
    """Why *result* cannot be stored (its stored form, `result_to_json`, is no JSON: a set, bytes,
    ``NaN``, a dict with an ``int`` key, an object, in ``output``, ``data`` or ``metadata``), naming
    where; ``None`` if it can. The journal applies the same rule when the call is settled.

    A field of the wrong type is named too (``error`` not a `ToolError` or ``None``, ``display`` not
    a string or ``None``, ``metadata`` not a mapping, an error's ``message`` or ``code`` not a
    string): the class does not check them, and what reads them later (the journal, the model's
    text, a stream) would fail there.

    The usual success (JSON output and nothing else) is judged without building its stored form.
    """
    metadata = result.metadata
    if (
        result.error is None
        and result.data is None
        and type(metadata) is dict  # not just empty: `[]`, `None` or `0` would pass `not metadata`
        and not metadata
        and (result.display is None or type(result.display) is str)
        and is_json(result.output)
    ):
        return None
    problem = _field_problem(result)
    if problem is not None:
        return problem
    try:
        stored = result_to_json(result)
    except Exception as exc:  # the converter cannot take it apart
        return f"result cannot be converted to JSON: {describe(exc, 'repr')}"
    return json_problem(stored, "result")


def _field_problem(result: ToolResult) -> str | None:
    """Which field of *result* has a type the class does not allow (`result_problem`), or ``None``."""
    error = result.error
    if error is not None:
        if not isinstance(error, ToolError):
            return f"result.error must be a ToolError or None, not {type(error).__name__}"
        if not isinstance(error.type, ToolErrorType):
            return f"result.error.type must be a ToolErrorType, not {type(error.type).__name__}"
        if not isinstance(error.message, str):
            return f"result.error.message must be a string, not {type(error.message).__name__}"
        if error.code is not None and not isinstance(error.code, str):
            return f"result.error.code must be a string or None, not {type(error.code).__name__}"
        if error.details is not None and not isinstance(error.details, Mapping):
            return f"result.error.details must be a mapping or None, not {type(error.details).__name__}"
    if result.display is not None and not isinstance(result.display, str):
        return f"result.display must be a string or None, not {type(result.display).__name__}"
    if not isinstance(result.metadata, Mapping):
        return f"result.metadata must be a mapping, not {type(result.metadata).__name__}"
    return None


def _unstorable(result: ToolResult, source: str) -> ToolResult:
    """The error result that replaces *result*, which is no JSON the journal can store (`result_problem`):
    that call fails, where the settlement would otherwise fail the request and its other calls."""
    return ToolResult.failure(
        ToolErrorType.EXECUTION,
        f"{source} a non-JSON result: {result_problem(result)}",
        code="invalid_result",
    )


def _error_type(value: object, what: str = "ToolFailure", error: type[ValueError] = ValueError) -> ToolErrorType:
    """*value* as a `ToolErrorType` (its member or its value, e.g. ``"timeout"``); *error* naming it
    (as *what*'s type) otherwise."""
    if isinstance(value, ToolErrorType):
        return value
    try:
        return ToolErrorType(value)
    except Exception:  # the enum's own ValueError formats the value with %r, which may raise anything
        allowed = ", ".join(repr(member.value) for member in ToolErrorType)
        raise error(f"{what} type {safe_repr(value)} is not a ToolErrorType (one of {allowed})") from None


class ToolFailure(Exception):
    """Raise inside a tool to fail the call with a chosen `ToolErrorType`.

    Any other exception from a tool becomes an ``execution`` error result.
    """

    def __init__(
        self, message: str, *, type: ToolErrorType | str = ToolErrorType.EXECUTION, code: str | None = None
    ) -> None:
        super().__init__(message)
        # Checked here, where the tool raises it: a bad type is the tool's own error (an execution
        # error result naming it), never a failure of whoever turns this into a result later.
        self.type = _error_type(type)
        self.code = code

    def to_result(self) -> ToolResult:
        return ToolResult.failure(self.type, str(self), code=self.code)


@attrs.frozen
class Progress:
    """A progress report; never durable, streamed to observers only."""

    message: str | None = None
    completed: float | None = None
    total: float | None = None
    data: Any = None


@attrs.frozen
class ToolMessage:
    """A message for people while the tool runs (``summary`` plus optional structured detail)."""

    summary: str
    detail: Any = None


@attrs.frozen
class Effect:
    """A request to the session (e.g. ``"new_messages"``, ``"permission_updates"``).

    Effects are not applied while the tool runs: the pipeline collects them and
    the session applies them after the call has been settled.
    """

    kind: str
    payload: Any = None


ToolItem: TypeAlias = Progress | ToolMessage | Effect
"""What a tool streams with ``await ctx.emit(item)``."""
