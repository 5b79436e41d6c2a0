"""Every error of the library survives pickling: a worker process, a thread pool or a log handler
that pickles an exception gets the same error back (type, message, attributes, notes), including
the errors whose constructors take keyword-only arguments."""

from __future__ import annotations

import copy
import importlib
import pickle
import pkgutil
from typing import Any

import pytest

import trio_agent as ta
from trio_agent._abort import Abort, AbortReason
from trio_agent._chat._chat import StructuredOutputError
from trio_agent._errors import (
    CommandConflictError,
    FileLockTimeoutError,
    HistoryError,
    HookAbortedError,
    HookError,
    HookInterruptedError,
    HookReturnError,
    HookTimeoutError,
    LeaseHeldError,
    ModelError,
    RequestAbortedError,
    SequenceConflictError,
    ToolInputError,
    TrioAgentError,
    UnfinishedRequestError,
)
from trio_agent._lifecycle._decisions import MiddlewareDecisionError
from trio_agent._loop._compose import LifecycleHookError
from trio_agent._loop._interrupts import InterruptIssue, InterruptResumeError
from trio_agent._session._hooks import HookEvent


def _import_everything() -> None:
    """Every module of the package, so that every error class exists (some load lazily)."""
    for module in pkgutil.walk_packages(ta.__path__, "trio_agent."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


_import_everything()


def _all_errors() -> list[type[TrioAgentError]]:
    found: list[type[TrioAgentError]] = []
    pending: list[type[TrioAgentError]] = [TrioAgentError]
    while pending:
        cls = pending.pop()
        if cls.__module__.startswith("trio_agent."):  # not the subclasses other tests define
            found.append(cls)
        pending.extend(cls.__subclasses__())
    return sorted(set(found), key=lambda cls: cls.__qualname__)


# The errors whose constructors take more than a message, built as the library builds them.
BUILT: dict[type[TrioAgentError], TrioAgentError] = {
    CommandConflictError: CommandConflictError("command 'c1' was applied with other content", command_id="c1"),
    FileLockTimeoutError: FileLockTimeoutError("/tmp/a.txt", 2.5),
    HistoryError: HistoryError("message 3 is not a message", index=3),
    HookAbortedError: HookAbortedError(
        "the hook aborted", event=HookEvent.PRE_TOOL_USE, reason="no", callback="guard", source="session"
    ),
    HookError: HookError("a hook raised", event=HookEvent.STOP, callback="cb", source="plugin:p", code="hook_error"),
    HookInterruptedError: HookInterruptedError(
        "aborted while hooks ran", event=HookEvent.STOP, abort=Abort(AbortReason.USER_ABORT, "stop"), callback="cb"
    ),
    HookReturnError: HookReturnError("returned 3", event=HookEvent.STOP, callback="cb"),
    HookTimeoutError: HookTimeoutError("too slow", event=HookEvent.STOP, seconds=1.5, callback="cb", source="session"),
    LeaseHeldError: LeaseHeldError("held by w1", owner="w1", expires_at=12.5),
    RequestAbortedError: RequestAbortedError(
        "aborted", reason="user", results={"call_1": ta.ToolResult.success({"sum": 3})}
    ),
    SequenceConflictError: SequenceConflictError("s/root is at 4", stream_id="s/root", expected=5, actual=4),
    ToolInputError: ToolInputError("bad input", tool_name="add", errors=("$.a: not an integer",)),
    UnfinishedRequestError: UnfinishedRequestError("request 'r1' is kept", request_id="r1"),
    InterruptResumeError: InterruptResumeError([InterruptIssue("i1", "unknown_interrupt", "no such interrupt")]),
    LifecycleHookError: LifecycleHookError("on_finish", [("audit", ValueError("boom"))]),
    MiddlewareDecisionError: MiddlewareDecisionError("on_config", "audit", "returned 3"),
    StructuredOutputError: StructuredOutputError("not the schema", issues=("$.x: missing",), text="{}"),
}


def _example(cls: type[TrioAgentError]) -> TrioAgentError:
    built = BUILT.get(cls)
    if built is not None:
        return built
    return cls("something went wrong")  # every other error takes its message alone


def _state(error: BaseException) -> dict[str, Any]:
    return {key: value for key, value in vars(error).items() if key != "__notes__"}


@pytest.mark.parametrize("cls", _all_errors(), ids=lambda cls: cls.__qualname__)
def test_an_error_survives_pickling(cls: type[TrioAgentError]) -> None:
    error = _example(cls)
    error.add_note("while doing something")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error)
    assert back.args == error.args
    assert repr(_state(back)) == repr(_state(error))  # by repr: an exception inside equals only itself
    assert back.__notes__ == ["while doing something"]


def test_the_errors_with_keyword_arguments_are_all_covered() -> None:
    # An error class added with a constructor that needs more than a message must get an example.
    for cls in _all_errors():
        if cls in BUILT:
            continue
        try:
            cls("something went wrong")
        except TypeError as exc:  # pragma: no cover - the failure message names the class
            pytest.fail(f"{cls.__qualname__} needs an example in BUILT: {exc}")


class _Holder:
    error: TrioAgentError


def test_an_attribute_that_refers_back_to_the_error_comes_back() -> None:
    error = RequestAbortedError("aborted", reason="user")
    holder = _Holder()
    holder.error = error
    error.holder = holder  # type: ignore[attr-defined]
    error.me = error  # type: ignore[attr-defined]
    for back in (pickle.loads(pickle.dumps(error)), copy.deepcopy(error)):
        assert back.me is back
        assert back.holder.error is back
        assert back.reason == "user"


class _Timeout(TrioAgentError, TimeoutError):
    pass


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_an_os_error_keeps_errno_and_filename(protocol: int) -> None:
    error = _Timeout(110, "timed out", "/tmp/f")
    back = pickle.loads(pickle.dumps(error, protocol))
    assert (back.errno, back.strerror, back.filename, str(back)) == (110, "timed out", "/tmp/f", str(error))
    lock = pickle.loads(pickle.dumps(FileLockTimeoutError("/tmp/a", 2.5), protocol))
    assert (lock.path, str(lock)) == ("/tmp/a", "waited more than 2.5 s for the lock on /tmp/a")


def test_a_model_error_keeps_its_code_and_retryable_flag() -> None:
    error = ModelError("rate limited", code="rate_limited", retryable=True)
    back = pickle.loads(pickle.dumps(error))
    assert (back.code, back.retryable, str(back)) == (error.code, error.retryable, str(error))
