"""The one exception hierarchy of trio_agent.

Every error that crosses a public boundary is one of these (never a bare
``ExceptionGroup``); cancellation stays Trio's own ``trio.Cancelled``::

    TrioAgentError
     ├── ConfigError               bad configuration value (timeouts, limits, ...)  [ValueError]
     │    ├── HistoryError         a given history is no valid conversation (``index``)
     │    └── CapabilityError      a capability nobody provides, or read before it was (lifecycle)
     ├── InterruptResumeError      a continuation that cannot resume a paused run (``issues``)
     ├── ToolDefinitionError       a tool definition breaks the contract           [ValueError]
     │    └── ToolBehaviorError    a behaviour resolver widened or returned junk
     ├── ToolInputError            tool input fails the tool's input schema         [ValueError]
     ├── MiddlewareError           middleware misuse
     │    ├── MiddlewareShapeError non-callable or wrongly shaped middleware       [TypeError]
     │    └── NextCalledTwiceError ``next() called multiple times``
     ├── FileLockTimeoutError      waiting for a file lock exceeded its bound       [TimeoutError]
     ├── JournalError              the journal refused or failed a write
     │    ├── SettlementError      a settlement could not be made durable; nothing was published
     │    ├── JournalCorruptError  stored data cannot be decoded (bad file, unknown schema version; ``intact``)
     │    ├── InvalidTransitionError  the projection refuses an event; nothing was written (``seq``)
     │    ├── CommandConflictError the same command id with other content (``command_id``)
     │    ├── SequenceConflictError another writer appended to the stream (``stream_id``)
     │    ├── ForeignStreamError   a stream or cursor of another session or stream
     │    ├── CursorError          a subscription cursor past the head or from another stream
     │    ├── JournalFencedError   an earlier write's outcome is unknown: reconcile first
     │    ├── JournalUnavailableError  the store failed or timed out mid-write (outcome unknown)
     │    └── LeaseHeldError       another owner holds an unexpired lease (``owner``, ``expires_at``, ``now``)
     ├── SessionError              a session refused a request
     │    ├── SessionBusyError     a request is running and no ``priority`` was given
     │    ├── SessionClosedError   the session is closed (or closing)
     │    ├── SessionPausedError   a request waits for answers: ``session.resume(...)`` first
     │    ├── RequestAbortedError  the request was aborted (``reason``)
     │    └── UnknownSubagentError no subagent definition has that name        [ValueError]
     ├── HookError                 a hook raised, returned garbage or missed its deadline (``event``)
     │    ├── HookReturnError      a hook returned something that is not a HookOutput       [TypeError]
     │    ├── HookTimeoutError     an event's hooks missed its deadline                     [TimeoutError]
     │    ├── HookInterruptedError the request's abort interrupted the dispatch
     │    └── HookAbortedError     a hook answered ``abort``
     ├── LeaseLostError            the execution lease is gone (external: "broken")
     │    └── StaleFencingTokenError  the store refused a write carrying an old fencing token
     └── ModelError                a model call failed (``code``, ``retryable``)
          ├── ProviderError        the provider answered with an error (``status``, ``retry_after``)
          │    ├── AuthenticationError    401 / 403
          │    ├── ModelNotFoundError     404
          │    ├── RateLimitError         429 (``retry_after``)
          │    ├── ProviderServerError    5xx, retryable (``retry_after``)
          │    └── MalformedResponseError  a payload or SSE stream we cannot parse, or too large
          ├── ModelConnectionError  the connection failed (retryable)
          ├── ModelTimeoutError     request deadline or stream idle timeout      [TimeoutError]
          ├── StreamInterruptedError the stream failed after chunks were published (never retried)
          ├── ModelAbortedError     the request's AbortHandle was aborted (``abort`` has the reason)
          └── ModelMiddlewareError  model middleware raised or changed operation, model or abort

    ProviderConfigError (a ConfigError): unknown provider, missing API key, invalid base URL.

Lease failures are their own type on purpose: they fail closed and never become
ordinary tool results.

Pickling. Every error survives ``pickle`` (a worker process, a thread pool, a log
handler): it comes back as the same class with the same ``args``, attributes and
notes, without its constructor being called again (many take keyword-only
arguments, which ``args`` does not hold). Its attributes must be picklable too.

Error codes. Every machine-readable ``code`` is snake_case, in errors
(``HookError.code``, ``ModelError.code``) and in results (``ToolError.code``,
``stop_reason``) alike, and the same situation has the same code in both: a
failing hook is ``hook_error`` whether it surfaces as a `HookError` or as a tool
result. A `ModelError` raised without a code gets its class name in snake_case
(``rate_limit_error``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._abort import Abort
    from ._journal._events import EventEnvelope
    from ._session._hooks import HookEvent
    from ._tools._results import ToolResult

__all__ = [
    "AuthenticationError",
    "CommandConflictError",
    "ConfigError",
    "CursorError",
    "FileLockTimeoutError",
    "ForeignStreamError",
    "HistoryError",
    "HookAbortedError",
    "HookError",
    "HookInterruptedError",
    "HookReturnError",
    "HookTimeoutError",
    "InvalidTransitionError",
    "JournalCorruptError",
    "JournalError",
    "JournalFencedError",
    "JournalUnavailableError",
    "LeaseHeldError",
    "LeaseLostError",
    "MalformedResponseError",
    "MiddlewareError",
    "MiddlewareShapeError",
    "ModelAbortedError",
    "ModelConnectionError",
    "ModelError",
    "ModelMiddlewareError",
    "ModelNotFoundError",
    "ModelTimeoutError",
    "NextCalledTwiceError",
    "ProviderConfigError",
    "ProviderError",
    "ProviderServerError",
    "RateLimitError",
    "RequestAbortedError",
    "SequenceConflictError",
    "SessionBusyError",
    "SessionClosedError",
    "SessionError",
    "SessionPausedError",
    "SettlementError",
    "StaleFencingTokenError",
    "StreamInterruptedError",
    "ToolBehaviorError",
    "ToolDefinitionError",
    "ToolInputError",
    "TrioAgentError",
    "UnfinishedRequestError",
    "UnknownSubagentError",
    "require_trio",
]


class TrioAgentError(Exception):
    """Base class of every error raised by trio_agent."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduce calls ``cls(*args)`` on load, which an error whose constructor
        # takes keyword-only arguments (or builds its message from others) refuses. The state
        # goes third, so pickle sets it after the error exists: an attribute that refers back to
        # the error (a cycle) comes back too. OSError keeps errno and the rest outside __dict__.
        state = dict(self.__dict__)
        if isinstance(self, OSError):
            for name in ("errno", "strerror", "filename", "filename2"):
                value = getattr(self, name)
                if value is not None:
                    state[name] = value
        return _unpickled, (type(self), self.args), state or None


def _unpickled(cls: type[TrioAgentError], args: tuple[Any, ...]) -> TrioAgentError:
    error = cls.__new__(cls, *args)
    error.args = args
    return error


class ConfigError(TrioAgentError, ValueError):
    """A configuration value is invalid; the message names the setting."""


class ToolDefinitionError(TrioAgentError, ValueError):
    """A tool definition is invalid; the message names the tool and the field."""


class ToolBehaviorError(ToolDefinitionError):
    """A tool's behaviour resolver widened its static declaration or returned an invalid value."""


class ToolInputError(TrioAgentError, ValueError):
    """Tool input does not satisfy the tool's input schema.

    ``errors`` lists one readable line per violation, each naming the JSON path.
    """

    def __init__(self, message: str, *, tool_name: str, errors: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tool_name = tool_name
        self.errors = errors


class MiddlewareError(TrioAgentError):
    """Middleware was used against its contract."""


class MiddlewareShapeError(MiddlewareError, TypeError):
    """Middleware is not callable or does not have the required shape."""


class NextCalledTwiceError(MiddlewareError):
    """One execution chain called ``next()`` more than once."""

    def __init__(self, message: str = "next() called multiple times") -> None:
        super().__init__(message)


class FileLockTimeoutError(TrioAgentError, TimeoutError):
    """Waiting for a file lock took longer than its bound. The pipeline turns it into a timeout result."""

    def __init__(self, path: str, seconds: float) -> None:
        super().__init__(f"waited more than {seconds:g} s for the lock on {path}")
        self.path = path


class JournalError(TrioAgentError):
    """The journal refused or failed a write."""


class SettlementError(JournalError):
    """A tool settlement could not be made durable, so nothing was published."""


class JournalCorruptError(JournalError):
    """Durable data cannot be decoded: a damaged file, unknown field, bad enum or unknown schema version.

    A read that meets a damaged row fails at it, naming ``stream#seq``; ``intact`` holds the
    events the same read decoded before that row, in order (empty when the damage came first or
    the error is not a read's): a reader can go up to the damage, never past it.
    """

    def __init__(self, message: str, *, intact: tuple[EventEnvelope, ...] = ()) -> None:
        super().__init__(message)
        self.intact = intact


class InvalidTransitionError(JournalError):
    """An event is not allowed in the projection's current state; nothing was applied or written.

    ``seq`` is the rejected envelope's sequence number.
    """

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


class CommandConflictError(JournalError):
    """A command id was used before with different content; the first outcome stands."""

    def __init__(self, message: str, *, command_id: str) -> None:
        super().__init__(message)
        self.command_id = command_id


class SequenceConflictError(JournalError):
    """The store's head of a stream is not where the writer expected it: someone else appended."""

    def __init__(self, message: str, *, stream_id: str, expected: int, actual: int) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual


class ForeignStreamError(JournalError):
    """A stream, event or cursor belongs to another session or stream."""


class CursorError(JournalError):
    """A subscription cursor is past the stream's head or names another stream."""


class JournalFencedError(JournalError):
    """An earlier write's outcome is unknown; the journal refuses writes until `reconcile()` ran."""


class JournalUnavailableError(JournalError):
    """The store failed or timed out during a write, so its outcome is unknown."""


class LeaseHeldError(JournalError):
    """Another owner holds an unexpired execution lease.

    ``expires_at`` is on the store's clock (the database server's, for PostgreSQL by default);
    ``now`` is that clock when the store refused, read in the same transaction (``None`` when
    not known), so ``expires_at - now`` is how long the lease has left whatever the local clock says.
    """

    def __init__(self, message: str, *, owner: str, expires_at: float, now: float | None = None) -> None:
        super().__init__(message)
        self.owner = owner
        self.expires_at = expires_at
        self.now = now


class SessionError(TrioAgentError):
    """A session refused or ended a request."""


class HistoryError(ConfigError):
    """A conversation given from outside (``history=``) is not one a provider accepts; ``index``
    is the position of the first wrong message (``None`` when the history itself is no list)."""

    def __init__(self, message: str, *, index: int | None) -> None:
        super().__init__(message)
        self.index = index


class SessionBusyError(SessionError):
    """A request is already running and the new message gave no ``priority`` (next, later or now)."""


class SessionPausedError(SessionError):
    """The session waits for answers to a paused request (``session.resume(...)``); nothing else runs."""

    code = "session_paused"


class UnfinishedRequestError(SessionError):
    """A request an earlier owner started is kept open (``open_session(..., unfinished="keep")``):
    no other request may start until `Session.serve_request` has run ``request_id`` to its end.
    Nothing was written."""

    code = "unfinished_request"

    def __init__(self, message: str, *, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class SessionClosedError(SessionError):
    """The session is closed or closing; nothing more is accepted."""


class RequestAbortedError(SessionError):
    """The request was aborted before it finished; ``reason`` says why (an `AbortReason` value).

    ``results`` maps the call id of every tool call of the request that settled
    with a committed result (completed or failed) to that `ToolResult`: an
    SDK-owned abort keeps what already happened.
    """

    def __init__(self, message: str, *, reason: str, results: Mapping[str, ToolResult] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.results: Mapping[str, ToolResult] = dict(results or {})


class UnknownSubagentError(SessionError, ValueError):
    """No subagent definition has the requested name."""


class HookError(TrioAgentError):
    """A hook failed: it raised, returned garbage or missed the event's deadline.

    ``event`` is the `HookEvent`, ``callback`` the failing callback's name,
    ``source`` where it was registered (``"session"`` or ``"plugin:<name>"``),
    ``code`` a stable machine-readable code (snake_case, the same as the tool
    result's code for the same failure). The cause, if any, is ``__cause__``.
    """

    default_code = "hook_error"

    def __init__(
        self,
        message: str,
        *,
        event: HookEvent,
        callback: str | None = None,
        source: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.event = event
        self.callback = callback
        self.source = source
        self.code = code or self.default_code


class HookTimeoutError(HookError, TimeoutError):
    """The event's callbacks did not finish within its deadline (``seconds``); ``callback`` was still running."""

    default_code = "hook_timeout"

    def __init__(
        self, message: str, *, event: HookEvent, seconds: float, callback: str | None = None, source: str | None = None
    ) -> None:
        super().__init__(message, event=event, callback=callback, source=source)
        self.seconds = seconds


class HookReturnError(HookError, TypeError):
    """A hook returned something other than a `HookOutput` or ``None``, or a field its event does not accept."""

    default_code = "hook_invalid_return"


class HookInterruptedError(HookError):
    """The caller's `AbortHandle` was aborted while the event's hooks ran; ``abort`` is its reason."""

    default_code = "hook_interrupted"

    def __init__(self, message: str, *, event: HookEvent, abort: Abort, callback: str | None = None) -> None:
        super().__init__(message, event=event, callback=callback)
        self.abort = abort


class HookAbortedError(HookError):
    """A hook answered ``abort`` (raised by `HookDecision.raise_for_abort`); ``reason`` is its reason."""

    default_code = "hook_abort"

    def __init__(
        self, message: str, *, event: HookEvent, reason: str | None, callback: str | None, source: str | None
    ) -> None:
        super().__init__(message, event=event, callback=callback, source=source)
        self.reason = reason


class LeaseLostError(TrioAgentError):
    """The execution lease was lost (taken over, expired or revoked).

    Work under a lost lease fails closed: nothing more is committed or published.
    """


class StaleFencingTokenError(LeaseLostError):
    """The store itself refused a write: its fencing token is not the lease's current one."""


class ProviderConfigError(ConfigError):
    """A provider cannot be configured: unknown name, missing API key (names the variable), bad base URL."""


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


class ModelError(TrioAgentError):
    """A model call failed.

    ``code`` is a stable machine-readable code; ``retryable`` says whether the
    service's retry loop may try again (it never does once a chunk of the call
    was published).
    """

    retryable = False

    def __init__(self, message: str, *, code: str | None = None, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.code = code or _snake_case(type(self).__name__)
        if retryable is not None:
            self.retryable = retryable


class ProviderError(ModelError):
    """The provider answered with an error status or body.

    ``retry_after`` is the server's wait hint in seconds (its ``Retry-After``), if it sent one
    with a retryable status: a 429, and as well a 5xx (a 503, Anthropic's 529 overloaded), 408
    or 409. ``None`` otherwise."""

    # A class default too: an error unpickled from before the attribute existed still has it.
    retry_after: float | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        retryable: bool | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, code=code, retryable=retryable)
        self.status = status
        self.retry_after = retry_after


class AuthenticationError(ProviderError):
    """The API key was rejected (401) or lacks permission (403)."""


class ModelNotFoundError(ProviderError):
    """The model does not exist or is not available to this key (404)."""


class RateLimitError(ProviderError):
    """Too many requests (429); ``retry_after`` is the server's hint in seconds, if any."""

    retryable = True

    def __init__(
        self,
        message: str,
        *,
        status: int | None = 429,
        code: str | None = None,
        retry_after: float | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, retryable=retryable, retry_after=retry_after)


class ProviderServerError(ProviderError):
    """The provider failed (5xx or an overloaded error); retryable, with ``retry_after`` as a 429's."""

    retryable = True


class MalformedResponseError(ProviderError):
    """A response or stream event we cannot parse, or one larger than the configured limit."""


class ModelConnectionError(ModelError):
    """The connection to the provider failed; retryable."""

    retryable = True


class ModelTimeoutError(ModelError, TimeoutError):
    """A deadline passed: ``code`` is ``model_request_timeout`` or ``model_stream_idle_timeout``."""


class StreamInterruptedError(ModelError):
    """The stream failed after some chunks were published; the call is not retried.

    A timeout is not one: the stream's idle timeout stays a `ModelTimeoutError`, as the request
    deadline does, published chunks or not (neither is retried)."""


class ModelMiddlewareError(ModelError):
    """Model middleware raised, or changed the request's operation, model or abort handle."""


class ModelAbortedError(ModelError):
    """The request's `AbortHandle` was aborted while the call ran; ``abort`` carries the typed reason."""

    def __init__(self, message: str, *, abort: Abort | None = None) -> None:
        super().__init__(message, code="model_request_aborted")
        self.abort: Abort | None = abort


def require_trio(api: str) -> None:
    """Raise a `ConfigError` with a hint if *api* is used outside a Trio run (say, under ``asyncio.run``).

    Without it an asyncio user gets Trio's bare "must be called from async context".
    """
    import sys

    import trio

    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        pass
    else:
        return
    # Never imports asyncio: a program running under it has loaded it already.
    asyncio = sys.modules.get("asyncio")
    where = "outside a Trio run"
    if asyncio is not None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            where = "under asyncio"
    raise ConfigError(
        f"{api} was called {where}, but trio_agent runs under Trio: "
        "start your program with trio.run(main) instead of asyncio.run(main())"
    )


def error_code(error: BaseException) -> str | None:
    """*error*'s ``code`` if it has one a journal or a client can keep (a non-empty string), else
    ``None``: a `ModelError`'s, a `HookError`'s, any error's that carries one."""
    try:
        code = getattr(error, "code", None)
    except Exception:  # a property of user code's that raises: no code (never a failure of its own)
        return None
    return code if isinstance(code, str) and code else None
