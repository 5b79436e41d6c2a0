"""Pluggable decision stages inside the tool core (hooks, permissions, guards).

The pipeline runs them in this order, all empty by default::

    pre_tool    (pipe: each may replace the input; a Deny ends the call)
    permission  (pipe: each may replace the input; a Deny ends the call)
    before      (first decision wins)
    -> input schema check
    guard       (first decision wins; sees the final, checked input)
    ... slot, locks, tool_started, the tool ...
    post_tool   (pipe over the result; an error result stays an error)

A stage callback that raises (or answers nonsense) fails closed: the call ends
with a ``hook_error`` result the model sees. Before the tool, the tool does not
run; after it (post_tool), its output is withheld, so a failed redaction never
passes the raw result on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeAlias, TypeVar

import attrs

from .._errors import ConfigError, LeaseLostError
from .._groups import STRAY_CANCELLED, stray_cancellation
from .._util import callable_name, safe_repr
from ._context import ExecutionContext
from ._definition import Tool, ToolBehavior
from ._results import JsonObject, ToolErrorType, ToolResult, _error_type, _unstorable, describe, result_problem

__all__ = ["Allow", "Deny", "PostStage", "Skip", "Stage", "StageDecision", "StageRequest", "ToolStages"]

_Request = TypeVar("_Request")


@attrs.frozen
class StageRequest:
    """What a stage callback sees: the tool, the current input, the context and the resolved behaviour.

    ``tool_ran`` is true only for a ``post_tool`` stage after the tool itself ran; a post stage
    that sees a before stage's `Skip` result (the tool never ran) gets false, as every earlier
    stage does."""

    tool: Tool[object]
    input: JsonObject
    context: ExecutionContext
    behavior: ToolBehavior
    tool_ran: bool = False


@attrs.frozen
class Allow:
    """Let the call go on, optionally with new input."""

    input: JsonObject | None = None


def _deny_type(value: object) -> ToolErrorType:
    """A `ToolErrorType` or its value (``"timeout"``), as `ToolFailure` takes it; else `ConfigError`."""
    return _error_type(value, "Deny", ConfigError)


def _skip_result(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, ToolResult):
        raise ConfigError(f"Skip takes a ToolResult, got {type(value).__name__}: {safe_repr(value)}")


@attrs.frozen
class Deny:
    """End the call with an error result the model sees. ``type`` is a `ToolErrorType` or its value."""

    message: str
    type: ToolErrorType = attrs.field(default=ToolErrorType.PERMISSION_DENIED, converter=_deny_type)
    code: str | None = None

    def to_result(self) -> ToolResult:
        return ToolResult.failure(self.type, self.message, code=self.code)


@attrs.frozen
class Skip:
    """End the call with *result* without running the tool (a before stage's "skip"); post stages
    still see it. A success is recorded with a synthetic start, as a short-circuit is."""

    result: ToolResult = attrs.field(validator=_skip_result)


StageDecision: TypeAlias = Allow | Deny | Skip
Stage: TypeAlias = Callable[[StageRequest], Awaitable[StageDecision | None]]
PostStage: TypeAlias = Callable[[StageRequest, ToolResult], Awaitable[ToolResult | None]]


def _tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)


@attrs.frozen
class ToolStages:
    """The stage callbacks of one pipeline (see the module docstring for their semantics)."""

    pre_tool: tuple[Stage, ...] = attrs.field(default=(), converter=_tuple)
    permission: tuple[Stage, ...] = attrs.field(default=(), converter=_tuple)
    before: tuple[Stage, ...] = attrs.field(default=(), converter=_tuple)
    guard: tuple[Stage, ...] = attrs.field(default=(), converter=_tuple)
    post_tool: tuple[PostStage, ...] = attrs.field(default=(), converter=_tuple)

    def then(self, other: ToolStages) -> ToolStages:
        """These stages, followed by *other*'s in each slot."""
        if not (other.pre_tool or other.permission or other.before or other.guard or other.post_tool):
            return self
        return ToolStages(
            (*self.pre_tool, *other.pre_tool),
            (*self.permission, *other.permission),
            (*self.before, *other.before),
            (*self.guard, *other.guard),
            (*self.post_tool, *other.post_tool),
        )

    def __attrs_post_init__(self) -> None:
        for stage_name in ("pre_tool", "permission", "before", "guard", "post_tool"):
            for index, callback in enumerate(getattr(self, stage_name)):
                if not callable(callback):
                    raise ConfigError(f"{stage_name} stage #{index} is not callable: {safe_repr(callback)}")


async def decide(
    stage: str,
    callback: Callable[[_Request], Awaitable[StageDecision | None]],
    request: _Request,
    own_lease_lost: Callable[[], bool],
) -> StageDecision | None:
    """The decision of one deciding stage on *request*: a tool's call (the pipeline's stages) or a
    client tool's (`ClientCallStages`, before the call goes to the client). A stage that raises or
    answers nonsense refuses the call (stages fail closed); only a ``before`` stage may `Skip`, and
    a skip whose result is no JSON fails that call, as does a `Deny` that cannot end it (`deny_problem`:
    its message or code of the wrong type or empty). A `LeaseLostError` goes on only when
    *own_lease_lost()* says it is the journal's own: a stage may drive a store of its own."""
    try:
        decision = await callback(request)
    except Exception as exc:
        if isinstance(exc, LeaseLostError) and own_lease_lost():
            raise
        return Deny(
            f"{stage} stage {_stage_name(callback)} failed: {describe(exc, 'repr')}",
            ToolErrorType.EXECUTION,
            "hook_error",
        )
    except BaseException as exc:
        if not stray_cancellation(exc):
            raise  # a cancellation from outside goes on
        return Deny(
            f"{stage} stage {_stage_name(callback)} failed: it raised {describe(exc, 'repr')} {STRAY_CANCELLED}",
            ToolErrorType.EXECUTION,
            "hook_error",
        )
    if decision is None or isinstance(decision, Allow):
        return decision
    if isinstance(decision, Deny):
        problem = deny_problem(decision)
        if problem is None:
            return decision
        # As a Skip's junk result: that call fails, not the settlement (which would leave it open).
        return Deny(
            f"{stage} stage {_stage_name(callback)} returned a Deny whose {problem}",
            ToolErrorType.EXECUTION,
            "hook_error",
        )
    if isinstance(decision, Skip) and stage == "before":
        result = decision.result  # a ToolResult: `Skip` checks it when it is made
        if result_problem(result) is not None:
            # As for a tool's result: that call fails, not the settlement (or the pause that holds it).
            return Skip(_unstorable(result, f"{stage} stage {_stage_name(callback)} skipped with"))
        return decision
    return Deny(
        f"{stage} stage {_stage_name(callback)} returned {safe_repr(decision)}, expected Allow, Deny or None",
        ToolErrorType.EXECUTION,
        "hook_error",
    )


def deny_problem(deny: Deny) -> str | None:
    """Why *deny* cannot end a call (its message not a non-empty string, its code neither ``None``
    nor one, or its result no JSON the journal can store: `result_problem`), or ``None``. Only a
    refusal pays for it: a settlement that failed on one would leave its call open."""
    message, code = deny.message, deny.code
    if not isinstance(message, str) or not message:
        return f"message is {safe_repr(message)}, not a non-empty string"
    if code is not None and (not isinstance(code, str) or not code):
        return f"code is {safe_repr(code)}, not a non-empty string or None"
    problem = result_problem(deny.to_result())
    return None if problem is None else f"result is not JSON: {problem}"


def failed_stage_result(problem: str) -> ToolResult:
    """The result of a call one of whose stages failed (*problem* names it): a ``hook_error``."""
    return Deny(problem, ToolErrorType.EXECUTION, "hook_error").to_result()


def _stage_name(callback: object) -> str:
    # Only for a message: a callback's repr is not made for every call that passes.
    return callable_name(callback)
