"""The one exception hierarchy of trio_agent.

Every error that crosses a public boundary is one of these (never a bare
``ExceptionGroup``); cancellation stays Trio's own ``trio.Cancelled``::

    TrioAgentError
     ├── ConfigError               bad configuration value (timeouts, limits, ...)  [ValueError]
     ├── ToolDefinitionError       a tool definition breaks the contract           [ValueError]
     │    └── ToolBehaviorError    a behaviour resolver widened or returned junk
     ├── ToolInputError            tool input fails the tool's input schema         [ValueError]
     ├── MiddlewareError           middleware misuse
     │    ├── MiddlewareShapeError non-callable or wrongly shaped middleware       [TypeError]
     │    └── NextCalledTwiceError ``next() called multiple times``
     ├── FileLockTimeoutError      waiting for a file lock exceeded its bound       [TimeoutError]
     ├── JournalError              the journal refused or failed a write
     │    └── SettlementError      a settlement could not be made durable; nothing was published
     └── LeaseLostError            the execution lease is gone (external: "broken")

Lease failures are their own type on purpose: they fail closed and never become
ordinary tool results.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "FileLockTimeoutError",
    "JournalError",
    "LeaseLostError",
    "MiddlewareError",
    "MiddlewareShapeError",
    "NextCalledTwiceError",
    "SettlementError",
    "ToolBehaviorError",
    "ToolDefinitionError",
    "ToolInputError",
    "TrioAgentError",
]


class TrioAgentError(Exception):
    """Base class of every error raised by trio_agent."""


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


class LeaseLostError(TrioAgentError):
    """The execution lease was lost (taken over, expired or revoked).

    Work under a lost lease fails closed: nothing more is committed or published.
    """
