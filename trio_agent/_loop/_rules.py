"""The rules of the one agent loop, sans-I/O (no Trio, no journal, no session).

Rules
=====

A run is a sequence of turns. A turn is one model call (retried at most twice, only
before it produced output, only when a hook asks) followed by its tool phase.

* Before a turn: the strategy decides whether another turn may start (a session's
  ``max_turns`` is ``max_iterations``); the inbox is taken (joined messages,
  background reports, a Stop continuation): it joins the history before the model
  call and is recorded with the attempt.
* After a reply:
  - calls cut off by the output limit never run; each is answered ``max_tokens``;
  - calls to unknown or disallowed tools, or with arguments that are not a JSON
    object (see `parse_tool_arguments`), are rejected and answered before any call
    of the reply runs, and recorded with the attempt;
  - the rest run concurrently; answers join the history in call order.
* After the tool phase: a denial with ``stop_loop`` ends the run
  (``permission_denied``); otherwise the strategy and ``should_continue`` decide.
* After a reply without calls: if the inbox has input, continue; else ask
  ``before_stop`` (a message means one more turn); else end (``end_turn``, or
  ``max_tokens`` when the reply was cut off by its length limit).
* ``should_continue`` is ANDed with the strategy at every continue; a ``False``
  ends the run gracefully (``vetoed``).
* Abort wins over everything; a committed tool result is still settled and answered.
* Exactly one terminal outcome per run: finished | aborted | failed.
"""

from __future__ import annotations

import enum
import inspect
import json
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import attrs

from .._builders import constructor
from .._errors import ConfigError
from .._models._assemble import ToolArgumentsError, parse_tool_arguments
from .._models._messages import FinishReason, TextPart, ToolCallPart
from .._tools._results import ToolErrorType, ToolResult

__all__ = [
    "LoopState",
    "LoopStrategy",
    "Phase",
    "StopReason",
    "check_call",
    "check_strategy",
    "combine_strategies",
    "max_iterations",
    "model_text",
    "stops_loop",
    "strategy_answer",
    "tool_error",
    "until_finish_reason",
]


class Phase(enum.Enum):
    """Where a run is (``ctx.phase``); the four boundaries are where it may pause."""

    INIT = "init"
    BEFORE_MODEL = "before_model"
    MODEL_STREAM = "model_stream"
    AFTER_MODEL = "after_model"
    BEFORE_TOOLS = "before_tools"
    AFTER_TOOLS = "after_tools"
    STRUCTURED_OUTPUT = "structured_output"


class StopReason(enum.StrEnum):
    """Why a run ended (a `StrEnum`: ``StopReason.END_TURN == "end_turn"``)."""

    END_TURN = "end_turn"  # the model answered without calls and nothing asked for more
    MAX_TURNS = "max_turns"  # the strategy allowed no further turn
    MAX_TOKENS = "max_tokens"  # the last reply was cut off by the output limit
    PERMISSION_DENIED = "permission_denied"  # a denial asked to stop the loop
    VETOED = "vetoed"  # a should_continue hook said no
    SKIPPED = "skipped"  # the prompt never reached the model (a host's hook skipped it)
    ABORTED = "aborted"
    ERROR = "error"
    INTERRUPTED = "interrupted"  # paused with a batch of questions; a continuation resumes it


@attrs.frozen
class LoopState:
    """What strategies and ``should_continue`` see: the run so far."""

    iteration: int = 0  # turns completed
    tool_call_count: int = 0
    last_turn_tool_call_count: int = 0
    last_finish_reason: FinishReason | None = None

    def after_turn(self, calls: int, finish: FinishReason) -> LoopState:
        return loop_state(self.iteration + 1, self.tool_call_count + calls, calls, finish)


# One a turn: built cheaper (see `_builders`), every field given.
loop_state: Callable[[int, int, int, FinishReason | None], LoopState] = constructor(LoopState)


LoopStrategy = Callable[[LoopState], bool]
"""``strategy(state) -> bool``: may another turn start? A plain function: the loop never awaits it."""


_NO_STATE = object()  # what `check_strategy` binds: only the number of arguments is checked


def check_strategy(strategy: object, what: str) -> None:
    """`ConfigError` unless *strategy* (named *what* to the user) can be a `LoopStrategy`: a
    callable, not an ``async def`` (its coroutine, never awaited, is truthy: the run never stops)."""
    if not callable(strategy):
        raise ConfigError(f"{what} must be a LoopStrategy (a function of LoopState), not {strategy!r}")
    if inspect.iscoroutinefunction(strategy) or inspect.isasyncgenfunction(strategy):
        raise ConfigError(
            f"{what} {_strategy_name(strategy)} is an async function: a LoopStrategy is a plain function "
            "of LoopState answering True or False (the loop never awaits it)"
        )
    try:
        signature = inspect.signature(strategy)
    except (TypeError, ValueError):  # no signature to read (some builtins): its first call tells
        return
    try:
        signature.bind(_NO_STATE)
    except TypeError:
        raise ConfigError(f"{what} {_strategy_name(strategy)}{signature} cannot be called with one LoopState") from None


def strategy_answer(strategy: LoopStrategy, state: LoopState) -> bool:
    """What *strategy* (one given from outside) answers for *state*, checked: anything but a
    bool is a `ConfigError` naming it (a truthy non-bool, a coroutine, would never stop a run)."""
    allowed = strategy(state)
    if allowed is True or allowed is False:
        return allowed
    if inspect.iscoroutine(allowed):
        allowed.close()  # never awaited: closed, rather than a "never awaited" warning
    raise ConfigError(
        f"the strategy {_strategy_name(strategy)} answered {allowed!r}, not True or False "
        "(a LoopStrategy says whether another turn may start)"
    )


def _strategy_name(strategy: object) -> str:
    return str(getattr(strategy, "__qualname__", None) or repr(strategy))


def max_iterations(limit: int) -> LoopStrategy:
    """At most *limit* turns (a session's ``max_turns``; ``chat()`` defaults to 5)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"max_iterations needs a whole number >= 1, got {limit!r}")

    def strategy(state: LoopState) -> bool:
        return state.iteration < limit

    strategy.__qualname__ = f"max_iterations({limit})"
    return strategy


def until_finish_reason(*reasons: FinishReason | str) -> LoopStrategy:
    """Stop once the last reply finished for one of *reasons* (e.g. ``"stop"``): at least one,
    each a `FinishReason` or its value, else `ConfigError`."""
    if not reasons:
        raise ConfigError("until_finish_reason needs at least one finish reason (it would never stop a run)")
    try:
        wanted = frozenset(FinishReason(reason) for reason in reasons)
    except ValueError:
        known = ", ".join(repr(reason.value) for reason in FinishReason)
        raise ConfigError(f"until_finish_reason takes finish reasons ({known}), got {reasons!r}") from None

    def strategy(state: LoopState) -> bool:
        return state.last_finish_reason not in wanted

    strategy.__qualname__ = f"until_finish_reason({', '.join(sorted(r.value for r in wanted))})"
    return strategy


def combine_strategies(*strategies: LoopStrategy) -> LoopStrategy:
    """All of *strategies* must allow another turn (AND). At least one, each a `LoopStrategy`,
    else `ConfigError`; each part's answer is checked (`strategy_answer`)."""
    parts = tuple(strategies)
    if not parts:
        raise ConfigError("combine_strategies needs at least one strategy (none would never stop a run)")
    for index, part in enumerate(parts):
        check_strategy(part, f"combine_strategies part #{index}")

    def strategy(state: LoopState) -> bool:
        return all(strategy_answer(part, state) for part in parts)

    strategy.__qualname__ = f"combine_strategies({', '.join(map(_strategy_name, parts))})"
    return strategy


def tool_error(message: str, code: str) -> ToolResult:
    """The answer of a call that was refused before it could run (the model reads *message*)."""
    return ToolResult.failure(ToolErrorType.VALIDATION, message, code=code)


def check_call(
    part: ToolCallPart,
    *,
    finish: FinishReason,
    cut_off: bool,
    tools: Collection[str],
    allowed: Collection[str],
) -> ToolResult | dict[str, Any]:
    """The answer of a call that must not run, or its parsed arguments if it may."""
    if cut_off or finish is FinishReason.LENGTH:
        return tool_error(
            "the model's output was cut off by its length limit before this call was complete; it was not run",
            "max_tokens",
        )
    if part.name not in tools:
        known = ", ".join(sorted(set(allowed) & set(tools))) or "none"
        return tool_error(f"unknown tool {part.name!r} (available: {known})", "unknown_tool")
    if part.name not in allowed:
        return tool_error(f"tool {part.name!r} is not available to this agent", "tool_not_allowed")
    try:
        return parse_tool_arguments(part.arguments)
    except ToolArgumentsError as exc:
        return tool_error(exc.message, exc.code)


def stops_loop(result: ToolResult) -> bool:
    """A permission denial that asked to stop the loop (handler ``stop_loop`` or a PermissionRequest abort)."""
    return bool(result.metadata.get("stop_loop")) or (result.error is not None and result.error.code == "stop_loop")


# ``json.dumps(..., default=str)``, with one encoder: with any keyword ``dumps`` builds a new one per call.
_TEXT_ENCODER = json.JSONEncoder(default=str)


def model_text(result: ToolResult) -> str:
    """What the model reads of a result."""
    output = result.output
    return output if isinstance(output, str) else _TEXT_ENCODER.encode(output)


def rejected_texts(rejected: Mapping[str, ToolResult]) -> dict[str, str]:
    return {call_id: model_text(result) for call_id, result in rejected.items()}


def first_text(parts: Iterable[object]) -> str:
    return "".join(part.text for part in parts if isinstance(part, TextPart))
