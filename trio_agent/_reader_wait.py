"""Waits on a reader that no deadline counts: `waiting_for_reader`.

What a run produces reaches its reader through a bounded channel (``chat()``'s events, a
session's stream); a reader that falls behind makes the publication wait. That wait is the
reader's: no deadline of what produced the item counts it, neither a model stream block's
``request_timeout`` nor a running tool's timeout.

Each task has a chain of frames (`Frame`, innermost first, under the task's key in `FRAMES`): what
it has open whose deadline such a wait holds. A model stream block is one while it is open
(``_OpenIterators``, its own `HeldDeadline`); a tool's publication is one around each item the
tool emits (`Holding` the call's deadline, in whichever task emits it: the tool's own or one the
tool started), and around each event of a foreground subagent that its ``task`` call passes on
(`ToolContext._publishing`, in whichever of the subagent's tasks publishes it). A wait walks its
task's chain and holds each deadline found: the scope's deadline is set to infinity while any wait
holds it (waits in several tasks may hold one tool's deadline at once: they are counted), and once
the last one ends it gets what was left of it when the first began. Nothing is timed per item:
only a wait that blocks reads the clock (twice).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["FRAMES", "Frame", "HeldDeadline", "Holding", "open_frames", "waiting_for_reader"]


class HeldDeadline:
    """Something whose deadline a wait on a reader holds (a model stream block, a tool call).
    ``_held`` is the hold while a wait holds it (else ``None``): set it to ``None`` in ``__init__``."""

    __slots__ = ("_held",)

    _held: _Held | None

    def _reader_scope(self) -> trio.CancelScope | None:
        """The scope whose deadline a wait holds now (``None``: nothing to hold)."""
        raise NotImplementedError

    def _reader_held(self) -> float:
        """Told that the first wait began (the scope's deadline is infinite now); what it returns
        is given back to `_reader_resumed`."""
        return math.nan

    def _reader_resumed(self, waited: float, held: float) -> None:
        """Told that the last wait ended, *waited* seconds after the first began (the scope's
        deadline is what was left of it, from now); *held* is what `_reader_held` returned."""

    def _held_deadline(self, scope: trio.CancelScope) -> float:
        """*scope*'s deadline as it stands: while a wait holds it, what was left of it when the
        first wait began, from now."""
        held = self._held
        if held is None:
            return scope.deadline
        return held.deadline + (trio.current_time() - held.since)


class _Held:
    """A deadline held: its scope, the deadline it had, when the first wait began, how many wait,
    and what `HeldDeadline._reader_held` returned."""

    __slots__ = ("deadline", "scope", "since", "told", "waits")

    def __init__(self, scope: trio.CancelScope, since: float) -> None:
        self.scope = scope
        self.deadline = scope.deadline
        self.since = since
        self.waits = 1
        self.told = math.nan


class Frame:
    """One link of a task's chain (`FRAMES`): something the task has open whose deadline a wait
    on a reader holds, and the frame the task had open when it was entered (``_enclosing``)."""

    __slots__ = ()

    _enclosing: Frame | None

    def _frame_deadline(self) -> HeldDeadline:
        raise NotImplementedError


FRAMES: contextvars.ContextVar[dict[trio.lowlevel.Task, Frame] | None] = contextvars.ContextVar(
    "trio_agent_reader_frames", default=None
)
"""Each task's innermost frame, under the task's key in a dict its context holds: set by the
first frame a task enters (the tasks it starts afterwards share the dict, each under its own key),
never process-wide, so a frame never left (a coroutine dropped unclosed) ends with its tasks. Set
once, never per frame: a context variable set and reset per model stream block cost 0.5% of a
request (and a `trio.lowlevel.RunVar` looked up per block as much). Each frame keeps the one it
was entered in (``_enclosing``) and the dict it is in; an entry lives while its frame is open."""


def open_frames() -> dict[trio.lowlevel.Task, Frame]:
    """The dict `FRAMES` holds in this context (made and set if there is none yet)."""
    frames = FRAMES.get()
    if frames is None:
        frames = {}
        FRAMES.set(frames)
    return frames


class Holding(Frame):
    """``with Holding(deadline): ...``: while the block runs, a wait on a reader in this task holds
    *deadline* too (a tool call's, around an item its tool emits)."""

    __slots__ = ("_deadline", "_enclosing", "_frames", "_task")

    def __init__(self, deadline: HeldDeadline) -> None:
        self._deadline = deadline

    def _frame_deadline(self) -> HeldDeadline:
        return self._deadline

    def __enter__(self) -> None:
        task = self._task = trio.lowlevel.current_task()
        frames = self._frames = open_frames()
        self._enclosing = frames.get(task)
        frames[task] = self

    def __exit__(self, *exc_info: object) -> None:
        frames, task = self._frames, self._task
        if frames.get(task) is self:
            enclosing = self._enclosing
            if enclosing is None:
                del frames[task]
            else:
                frames[task] = enclosing


@contextmanager
def waiting_for_reader() -> Iterator[None]:
    """``with waiting_for_reader(): await send.send(item)``: the time spent waiting here is the
    reader's, so it counts against neither a model call's ``request_timeout`` nor a tool's timeout.

    Wrap what waits for whoever reads what a run passes on (a full channel, a slow client): while
    it waits, every model stream block this task has open holds its deadline, and so does a
    running tool whose item (``ctx.emit``, or a foreground subagent's event for its ``task`` call)
    this task is passing on, from the tool's own task or one the tool started; each goes on with
    what was left of it once the wait ends (a tool's with the last of the waits holding it). An
    abort still cancels the call at once. Elsewhere (outside a block and a tool's ``emit``, or in a
    task other than theirs) it changes nothing. Wrap only the wait itself, e.g. after a
    ``send_nowait`` raised ``trio.WouldBlock``: it reads the clock twice.
    ``chat()`` and sessions wrap every wait on their event readers."""
    frames = FRAMES.get()
    frame = None if frames is None else frames.get(trio.lowlevel.current_task())
    holders: list[HeldDeadline] = []
    scopes: list[trio.CancelScope] = []
    while frame is not None:
        holder = frame._frame_deadline()
        scope = holder._reader_scope()
        if scope is not None:
            holders.append(holder)
            scopes.append(scope)
        frame = frame._enclosing
    if not holders:
        yield
        return
    since = trio.current_time()
    for holder, scope in zip(holders, scopes, strict=True):
        held = holder._held
        if held is None:  # the first wait to hold it
            holder._held = held = _Held(scope, since)
            scope.deadline = math.inf
            held.told = holder._reader_held()
        else:  # a wait holds it already (this task's, or another task's on the same tool)
            held.waits += 1
    try:
        yield
    finally:
        now = math.nan
        for holder in holders:
            held = holder._held
            assert held is not None
            held.waits -= 1
            if not held.waits:  # the last one: the deadline goes on with what was left of it
                holder._held = None
                if now != now:  # (NaN: not read yet)
                    now = trio.current_time()
                waited = now - held.since
                held.scope.deadline = held.deadline + waited
                holder._reader_resumed(waited, held.told)
