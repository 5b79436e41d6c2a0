"""What chat middleware hooks return, and what they are handed.

Decisions are frozen values; ``None`` always means "no decision" (keep, pass
through, allow). Hook inputs (``*Info``) are frozen values too: a hook changes
the run only through what it returns or through the `RunContext`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

import attrs

from .._abort import AbortReason
from .._errors import MiddlewareError
from .._loop._hooks import ToolOutcome
from .._loop._rules import StopReason
from .._tools._definition import Tool
from .._tools._results import JsonObject, ToolError, ToolResult

__all__ = [
    "DROP",
    "AbortInfo",
    "AbortRun",
    "AfterToolCallDecision",
    "AfterToolCallInfo",
    "BeforeToolCallDecision",
    "Drop",
    "ErrorInfo",
    "FinishInfo",
    "GuardToolCallDecision",
    "IterationInfo",
    "MiddlewareDecisionError",
    "Refuse",
    "ReplaceResult",
    "Skip",
    "ToolCallInfo",
    "ToolPhaseCompleteInfo",
    "TransformArgs",
]


class MiddlewareDecisionError(MiddlewareError):
    """A middleware hook returned something its hook does not accept (``hook``, ``middleware``)."""

    def __init__(self, hook: str, middleware: str, problem: str) -> None:
        self.hook = hook
        self.middleware = middleware
        super().__init__(f"{hook} of middleware {middleware!r} {problem}")


class Drop(enum.Enum):
    """The type of `DROP` (an enum, so type checkers know it has one value)."""

    DROP = "drop"

    def __repr__(self) -> str:
        return "DROP"


DROP: Final = Drop.DROP
"""``on_chunk`` returns it to drop the event: later middleware and the consumer never see it.

A sentinel because Python has one ``None`` and ``on_chunk`` needs two answers that
TypeScript spells ``undefined`` (keep) and ``null`` (drop). An empty list drops too.
"""


# -- on_before_tool_call ---------------------------------------------------------


@attrs.frozen
class TransformArgs:
    """Run the tool with *args* instead of the model's; the input schema checks them next."""

    args: JsonObject


@attrs.frozen
class Skip:
    """Do not run the tool: the call succeeds with *result*.

    A `ToolResult` is used as it is; any other value becomes ``ToolResult.success(result)``.
    """

    result: Any


@attrs.frozen
class AbortRun:
    """Abort the whole run (``on_abort``, never ``on_error``); this call ends interrupted."""

    reason: str = "aborted by middleware"


# -- on_guard_tool_call ------------------------------------------------------------


@attrs.frozen
class Refuse:
    """Do not run the tool: the call ends with an error the model reads (*message*)."""

    message: str
    code: str = "refused"


# -- on_after_tool_call ------------------------------------------------------------


@attrs.frozen
class ReplaceResult:
    """What the model and the stream see instead of the call's result.

    A `ToolResult` replaces the whole result; any other value replaces only the
    output the model reads. Either way an error stays an error: replacing an error
    result keeps its `ToolError` and takes only the replacement's output.
    """

    result: Any


BeforeToolCallDecision: TypeAlias = TransformArgs | Skip | AbortRun | None
GuardToolCallDecision: TypeAlias = Refuse | AbortRun | None
AfterToolCallDecision: TypeAlias = ReplaceResult | None


# -- hook inputs -------------------------------------------------------------------


@attrs.frozen
class IterationInfo:
    """``on_iteration``: the turn about to call the model (0-based) and its assistant message id."""

    iteration: int
    message_id: str


@attrs.frozen
class ToolCallInfo:
    """``on_before_tool_call`` / ``on_guard_tool_call``: the call as it stands.

    In ``on_before_tool_call`` *args* are what the model sent; in ``on_guard_tool_call``
    they are the final args, after every transform and the input schema check.
    """

    tool_name: str
    call_id: str
    args: JsonObject
    tool: Tool[object] | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class AfterToolCallInfo:
    """``on_after_tool_call``: the call and its result so far (after earlier replacements).

    For a call cut off by the output limit ``ok`` is false, ``error.code`` is
    ``"max_tokens"`` and ``args`` is the raw, incomplete argument text.
    """

    tool_name: str
    call_id: str
    args: Any
    result: ToolResult

    @property
    def ok(self) -> bool:
        return self.result.ok

    @property
    def error(self) -> ToolError | None:
        return self.result.error


@attrs.frozen
class ToolPhaseCompleteInfo:
    """``on_tool_phase_complete``: every call of the phase and how it was answered, in call order."""

    outcomes: Sequence[ToolOutcome]


@attrs.frozen
class FinishInfo:
    """``on_finish``: why the run ended, its final text, its turns and how long it took (seconds)."""

    stop_reason: StopReason
    text: str
    turns: int
    duration: float


@attrs.frozen
class AbortInfo:
    """``on_abort``: the abort's message, its kind and how long the run took (seconds)."""

    reason: str
    duration: float
    kind: AbortReason = AbortReason.USER_ABORT


@attrs.frozen
class ErrorInfo:
    """``on_error``: the error that ended the run and how long the run took (seconds)."""

    error: BaseException
    duration: float
