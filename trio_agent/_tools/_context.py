"""Who is calling a tool, and what a running tool can see and do."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._abort import AbortHandle
from .._builders import constructor
from .._cleanup import bounded_shield
from .._errors import ToolInputError
from .._reader_wait import HeldDeadline, Holding
from .._util import safe_repr
from ._results import JsonObject, ToolItem

if TYPE_CHECKING:
    from ._definition import ToolKind
    from ._scheduler import ToolScheduler

__all__ = ["CallOrigin", "Emit", "ExecutionContext", "ToolCall", "ToolContext", "ToolMiddlewareRequest"]

Emit = Callable[[ToolItem], Awaitable[None]]
"""``await emit(item)`` streams one item outwards."""


def _is_json_object(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, dict):
        raise ToolInputError(
            f"tool call input must be a JSON object (dict), got {type(value).__name__}",
            tool_name=str(getattr(instance, "name", "")),
        )


def _is_text(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # An empty id names no call (the journal refuses it, a provider cannot send it back), an
    # empty name no tool: refused here, typed, as the input is, before any pipeline sees the call.
    if not isinstance(value, str) or not value:
        name = getattr(instance, "name", "")
        raise ToolInputError(
            f"a tool call's {attribute.name} must be a non-empty string, got {safe_repr(value)}",
            tool_name=name if isinstance(name, str) else "",
        )


@attrs.frozen
class ToolCall:
    """One tool call as the model emitted it (input already parsed from JSON).

    Raises `ToolInputError` if ``id`` or ``name`` is not a non-empty string, or ``input`` not a dict.
    """

    id: str = attrs.field(validator=_is_text)
    name: str = attrs.field(validator=_is_text)
    input: JsonObject = attrs.field(validator=_is_json_object)


@attrs.frozen
class CallOrigin:
    """The ids of the session, agent, request and turn a call belongs to.

    ``lineage`` names the calls this one runs under (``"<agent id>/<call id>"``, outermost
    first), e.g. the ``task`` call whose subagent makes it: file locks they hold cover it. The
    names are read within the pipeline's session (its ``session_key``, else the pipeline): a call
    of another session with the same ids is no ancestor.
    """

    session_id: str = "session"
    agent_id: str = "root"
    request_id: str = "request"
    turn_id: str = "turn"
    lineage: tuple[str, ...] = ()


@attrs.frozen(eq=False)
class ExecutionContext:
    """The identity of one tool execution, shared by every middleware layer and the tool.

    It is compared by identity: middleware may not replace it. ``abort`` is the
    call's own `AbortHandle` (aborted by the request abort, and by steering for
    ``cancel`` tools); ``fencing_token`` reads the current lease's fencing token,
    which tools should pass to external systems that can fence writes.
    """

    session_id: str
    agent_id: str
    request_id: str
    turn_id: str
    tool_call_id: str
    idempotency_key: str
    abort: AbortHandle
    _fence: Callable[[], int | None] = attrs.field(repr=False)
    lineage: tuple[str, ...] = ()
    _ensure: Callable[[], Awaitable[None]] | None = attrs.field(default=None, repr=False)
    # Which open session runs the call (its pipeline's `session_key`): an opaque token, since two
    # sessions may share a session_id (in two stores) and tools shared by a spec's sessions must
    # still tell them apart. None outside a session.
    session_key: object = attrs.field(default=None, repr=False)

    @property
    def fencing_token(self) -> int | None:
        return self._fence()

    async def ensure_owner(self) -> None:
        """Confirm with the journal's store that this process still owns the session (`LeaseLostError`
        if not). Call it right before an external effect; see `ToolContext.ensure_owner`."""
        if self._ensure is None:
            await trio.lowlevel.checkpoint()
        else:
            await self._ensure()

    @property
    def call_key(self) -> str:
        """``"<agent id>/<call id>"``: how descendants name this call in their ``lineage`` (unique
        within one session: the pipeline adds its session to it for a file-lock owner)."""
        return f"{self.agent_id}/{self.tool_call_id}"


async def _inherit_emit(item: ToolItem) -> None:
    """Placeholder for a request built without ``emit``: the pipeline substitutes the current emit."""
    raise RuntimeError("this request's emit was never bound; pass it through call_next")


def _bind_emit(value: Emit | None) -> Emit:
    return _inherit_emit if value is None else value


@attrs.frozen(eq=False)
class ToolMiddlewareRequest:
    """What a tool middleware sees: the tool name, the (JSON) input, the execution context, and ``emit``.

    ``emit`` is where this layer's items go (the outer layers' wrapper, or the
    pipeline's observer): a middleware that transforms items wraps it and passes
    the wrapper with ``call_next(emit=...)``. Change the input with
    ``request.replace(input=...)``; the name and context must stay.
    """

    tool_name: str
    input: JsonObject
    context: ExecutionContext
    emit: Emit = attrs.field(default=None, repr=False, converter=_bind_emit)

    def replace(self, *, input: JsonObject) -> ToolMiddlewareRequest:
        return ToolMiddlewareRequest(self.tool_name, input, self.context, self.emit)


# The pipeline builds these per call (a request per layered call): built cheaper (see `_builders`),
# every field given (a request's emit bound already: its converter would have nothing to do).
execution_context: Callable[
    [
        str,
        str,
        str,
        str,
        str,
        str,
        AbortHandle,
        Callable[[], int | None],
        tuple[str, ...],
        Callable[[], Awaitable[None]] | None,
        object,
    ],
    ExecutionContext,
] = constructor(ExecutionContext)
middleware_request: Callable[[str, JsonObject, ExecutionContext, Emit], ToolMiddlewareRequest] = constructor(
    ToolMiddlewareRequest, trusted=("emit",)
)


class _SlotHolder:
    """The scheduler slot a running call holds, so a waiting parent can give it back."""

    __slots__ = ("held", "kind", "scheduler")

    def __init__(self, scheduler: ToolScheduler, kind: ToolKind) -> None:
        self.scheduler = scheduler
        self.kind = kind
        self.held = False

    def acquire_nowait(self) -> bool:
        if self.scheduler.try_acquire(self.kind):
            self.held = True
        return self.held

    async def acquire(self) -> None:
        await self.scheduler.acquire(self.kind)
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.scheduler.release(self.kind)


@attrs.frozen(eq=False)
class ToolContext:
    """What a running tool gets as ``ctx``: the call's ids, its abort handle, ``emit`` and helpers."""

    execution: ExecutionContext
    emit: Emit
    _slot: _SlotHolder | None = attrs.field(default=None, repr=False)
    _cleanup_grace: float = attrs.field(default=5.0, repr=False)
    # The call, whose deadline a wait on a reader of what the tool publishes holds (`_publishing`):
    # the pipeline's, set by `tool_context` (not a parameter of the class: one made by hand has none).
    _call: HeldDeadline | None = attrs.field(default=None, init=False, repr=False)

    @property
    def session_id(self) -> str:
        return self.execution.session_id

    @property
    def agent_id(self) -> str:
        return self.execution.agent_id

    @property
    def request_id(self) -> str:
        return self.execution.request_id

    @property
    def turn_id(self) -> str:
        return self.execution.turn_id

    @property
    def tool_call_id(self) -> str:
        return self.execution.tool_call_id

    @property
    def idempotency_key(self) -> str:
        return self.execution.idempotency_key

    @property
    def abort(self) -> AbortHandle:
        return self.execution.abort

    @property
    def fencing_token(self) -> int | None:
        return self.execution.fencing_token

    async def ensure_owner(self) -> None:
        """Confirm, with the store, that this process still owns the session; raise `LeaseLostError` if not.

        Call it right before an external effect: it narrows the window in which an old
        owner that was paused past its lease can act after another took over. It cannot
        close it (a pause can land between this check and the effect): pass
        `fencing_token` to a downstream that refuses stale tokens, or deduplicate by
        `idempotency_key`, to close it.
        """
        await self.execution.ensure_owner()

    @contextmanager
    def cleanup_scope(self) -> Iterator[trio.CancelScope]:
        """A shielded scope for cleanup after cancellation, bounded by the pipeline's cleanup grace."""
        with bounded_shield(self._cleanup_grace, f"tool call {self.tool_call_id!r} (cleanup_scope)") as scope:
            yield scope

    def _publishing(self) -> AbstractContextManager[None]:
        """``with ctx._publishing(): await sink(event)``: an item of the call passed on other than
        by ``emit`` (a foreground subagent's events, to the stream of the request that called it),
        published as ``emit`` publishes: a wait on its reader (`waiting_for_reader`) in there is the
        reader's, not the call's, so it holds the call's deadline. Nothing is timed unless it waits."""
        call = self._call
        return nullcontext() if call is None else Holding(call)

    @asynccontextmanager
    async def slot_released(self) -> AsyncIterator[None]:
        """Give this call's scheduler slot back while waiting on nested work (e.g. a foreground subagent).

        Without this, a parent holding the last slot of a kind would deadlock
        waiting for a child that needs one. The slot is re-acquired (FIFO, behind
        earlier waiters) before the block returns.
        """
        slot = self._slot
        if slot is None or not slot.held:
            yield
            return
        slot.release()
        try:
            yield
        finally:
            # If this wait is cancelled the slot stays released; the pipeline's
            # own release at the end of the call is then a no-op.
            await slot.acquire()


tool_context: Callable[[ExecutionContext, Emit, _SlotHolder | None, float, HeldDeadline | None], ToolContext] = (
    constructor(ToolContext)
)
