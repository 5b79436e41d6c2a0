"""`RunContext`: what every hook of one run sees (ids, phase, turn, messages) and can do.

One context per run, shared by every hook of every lifecycle part; per-run state
lives here, never on middleware (one middleware stack serves many runs at once):
``state`` (a scratch dict) and ``capabilities`` (typed values, see
``_lifecycle/_capabilities.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .._abort import AbortHandle, AbortReason
from .._errors import ConfigError
from .._lifecycle._capabilities import Capability, CapabilityRegistry
from .._models._messages import Message
from ._events import CustomEvent, RunEvent
from ._hooks import Phase
from ._ports import RunEventSink

__all__ = ["RetryNotAllowedError", "RunContext"]

_log = logging.getLogger("trio_agent.loop")

T = TypeVar("T")


class RetryNotAllowedError(ConfigError):
    """``ctx.retry()`` outside ``on_model_error`` before any output, or past the retry limit."""


class RunContext:
    """The context of one run, handed to every hook."""

    __slots__ = (
        "_abort",
        "_capabilities",
        "_deferred",
        "_events",
        "_messages",
        "_retry_open",
        "_retry_requested",
        "agent_id",
        "can_pause",
        "chunk_index",
        "iteration",
        "metadata",
        "parent_run_id",
        "phase",
        "request_id",
        "run_id",
        "state",
        "thread_id",
    )

    def __init__(
        self,
        *,
        run_id: str,
        thread_id: str,
        agent_id: str,
        abort: AbortHandle,
        events: RunEventSink,
        messages: Callable[[], Sequence[Message]],
        request_id: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.run_id = run_id
        self.thread_id = thread_id
        self.agent_id = agent_id
        self.request_id = request_id or run_id
        self.parent_run_id: str | None = None  # the paused run a continuation goes on from
        self.can_pause = True  # False in a subagent's run: on_interrupt_boundary must not ask there
        self.phase = Phase.INIT
        self.iteration = 0
        self.chunk_index = 0
        self.metadata: dict[str, Any] = metadata or {}
        self.state: dict[str, Any] = {}  # per-run scratch space for middleware
        self._capabilities: CapabilityRegistry | None = None  # made on first use: most runs provide none
        self._abort = abort
        self._events = events
        self._messages = messages
        self._deferred: list[Callable[[], Awaitable[object]]] | tuple[()] = ()  # a list from the first defer()
        self._retry_open = False
        self._retry_requested = False

    @property
    def capabilities(self) -> CapabilityRegistry:
        """The run's capability values (``ctx.get`` / ``ctx.provide``)."""
        registry = self._capabilities
        if registry is None:
            registry = self._capabilities = CapabilityRegistry()
        return registry

    @property
    def messages(self) -> Sequence[Message]:
        """The conversation so far (read-only)."""
        return tuple(self._messages())

    def get(self, handle: Capability[T]) -> T:
        """The value of capability *handle* (``ctx.capabilities.get``).

        Raises:
            CapabilityError: nothing provided it (yet).
        """
        return self.capabilities.get(handle)

    def get_optional(self, handle: Capability[T]) -> T | None:
        """The value of capability *handle*, or ``None`` when nothing provided it."""
        return self.capabilities.get_optional(handle)

    def provide(self, handle: Capability[T], value: T) -> None:
        """Provide capability *handle* for this run (in ``setup``); a second provide wins, with a warning."""
        self.capabilities.provide(handle, value)

    @property
    def aborted(self) -> bool:
        return self._abort.aborted

    def abort(self, reason: str = "aborted by middleware") -> None:
        """Abort the run: the model call in flight and every running tool call see it."""
        self._abort.abort(AbortReason.USER_ABORT, reason)

    def defer(self, fn: Callable[[], Awaitable[object]]) -> None:
        """Run ``await fn()`` after the run ended (after its terminal hook); failures are logged."""
        if not callable(fn):
            raise ConfigError(f"defer() takes a function to call later, got {fn!r}")
        if self._deferred:
            self._deferred.append(fn)
        else:
            self._deferred = [fn]

    async def emit_custom(self, name: str, value: object = None) -> None:
        """Put a custom event on the run's stream."""
        await self._events(CustomEvent(self.run_id, self.agent_id, name, value))

    async def emit(self, event: RunEvent) -> None:
        """Put *event* on the run's stream (through the hooks' ``wrap_events`` once the run started)."""
        await self._events(event)

    def retry(self) -> None:
        """From ``on_model_error``: call the model again (``on_config`` runs again first)."""
        if not self._retry_open:
            raise RetryNotAllowedError(
                "ctx.retry() is only allowed in on_model_error, before the failed call produced output, "
                "and at most 2 times per model call"
            )
        self._retry_requested = True

    @property
    def has_deferred(self) -> bool:
        """Whether a deferred function waits to run."""
        return bool(self._deferred)

    async def run_deferred(self) -> None:
        """Run every deferred function (in order, each isolated: a failure is logged)."""
        deferred, self._deferred = self._deferred, ()
        for fn in deferred:
            try:
                await fn()
            except Exception:  # a cancellation (bare or in a group) is a BaseException: it goes on
                _log.exception("a deferred function of run %s failed", self.run_id)
