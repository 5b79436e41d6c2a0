"""Exception groups inside the library, one exception at the public boundary.

Rules (one place, used by the pipeline, the agent loop and the session):

1. Inside the library, an exception that *contains* a ``trio.Cancelled`` is a
   cancellation, unless it also holds one of our typed errors: a tool or a
   middleware may run its own nursery, whose group wraps the cancellation. Such a
   group is re-raised unchanged (Trio's cancel scopes need the ``Cancelled`` leaves).
2. When a group holds a typed error (`TrioAgentError`) beside ``Cancelled``, the
   typed error wins: lease loss first, then journal errors, then the rest.
3. Public boundaries (``send``, ``stream``, ``open_session``, ``start_subagent``,
   ``chat``) never raise groups of their own: a group made only of ``Cancelled``
   leaves becomes one leaf ``Cancelled``; a group with a typed error becomes that
   error; beside other errors the ``Cancelled`` leaves are dropped (as a Trio cancel
   scope drops its own) and those errors go on: one as itself, several as a group.
4. Work the library runs side by side that a caller sees as one step (a turn's tool
   calls, with their hooks) fails as the same work run alone would: a group of
   foreign errors (no typed error, no cancellation) becomes its first leaf, the
   others noted on it (`first_failure`), so ``on_error`` and the caller get one
   exception whether a turn had one call or several.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NoReturn

import trio

from ._errors import JournalError, LeaseLostError, SettlementError, TrioAgentError
from ._util import describe

__all__ = [
    "STRAY_CANCELLED",
    "contains_cancelled",
    "first_failure",
    "is_cancellation",
    "leaves",
    "raise_alone",
    "raise_for_boundary",
    "stray_cancellation",
    "typed_error",
    "unwrap_for_boundary",
]

# Which typed error wins when several are in one group.
_PRECEDENCE: tuple[type[BaseException], ...] = (LeaseLostError, SettlementError, JournalError, TrioAgentError)


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """Every non-group exception inside *exc*, depth first (just *exc* if it is no group)."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            yield from leaves(sub)
    else:
        yield exc


def contains_cancelled(exc: BaseException) -> bool:
    """True for ``trio.Cancelled`` and for a group with a ``Cancelled`` leaf."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(isinstance(leaf, trio.Cancelled) for leaf in leaves(exc))
    return False


def typed_error(exc: BaseException) -> TrioAgentError | None:
    """The typed error that wins in *exc* (itself if it is one), or ``None``."""
    if isinstance(exc, TrioAgentError):
        return exc
    if not isinstance(exc, BaseExceptionGroup):
        return None
    found = [leaf for leaf in leaves(exc) if isinstance(leaf, TrioAgentError)]
    for kind in _PRECEDENCE:
        for leaf in found:
            if isinstance(leaf, kind):
                assert isinstance(leaf, TrioAgentError)
                return leaf
    return None


def is_cancellation(exc: BaseException) -> bool:
    """Rule 1: cancellation that no typed error overrides."""
    return contains_cancelled(exc) and typed_error(exc) is None


def cancelled_around(scope: trio.CancelScope) -> bool:
    """Whether *scope* is cancelled, by itself or by a scope around it. Trio has no public way to
    ask the second; the scope's cancel status knows it (read defensively: absent, it is not)."""
    if scope.cancel_called:
        return True
    status = getattr(scope, "_cancel_status", None)
    return getattr(status, "effectively_cancelled", False) is True


STRAY_CANCELLED = (
    "though nothing around it was cancelled (a Cancelled of a cancel scope of its own, raised outside that scope)"
)
"""What a message adds to the exception of user code that raised a `stray_cancellation`."""


def stray_cancellation(exc: BaseException) -> bool:
    """Whether *exc*, just caught around user code (a middleware, a hook, a stage, a provider), is
    a cancellation nothing around that code made: a ``trio.Cancelled`` (maybe in a group of its own
    nursery) of a cancel scope of its own, raised after that scope was left. No scope around would
    catch it: it would unwind the run, the request and the caller's block as a cancellation nobody
    made, so it is that code's failure. A real cancellation (a scope around the calling task
    cancelled, shields counted: `trio.current_effective_deadline` is ``-inf``) is never one, nor a
    group with a typed error (rule 1) or a ``KeyboardInterrupt``. Only for an exception already
    caught: it walks the cancel scopes around the task, which the success path never pays for."""
    if not is_cancellation(exc):
        return False
    if not all(isinstance(leaf, (Exception, trio.Cancelled)) for leaf in leaves(exc)):
        return False  # a KeyboardInterrupt, a SystemExit beside it: they go on as they are
    return trio.current_effective_deadline() != -math.inf


def unwrap_for_boundary(exc: BaseException) -> BaseException:
    """Rule 3: the one exception a public boundary raises for *exc*.

    A non-group comes back as it is. A group becomes its winning typed error; else, made only of
    ``Cancelled`` leaves, its first one. Otherwise its ``Cancelled`` leaves are dropped, as Trio
    does: they belong to the scope that cancelled, which delivers the cancellation again at the
    next checkpoint, while the other errors (a block body's own, a task's) must go on. What is
    left becomes its single leaf when it has one; several foreign errors stay a group (the
    caller's own: flattening it would lose information), the child itself when a nursery's
    group wraps a single group (a task that raised a group of its own).
    """
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    typed = typed_error(exc)
    if typed is not None:
        return typed
    rest = _without_cancelled(exc)
    if rest is None:
        return next(leaf for leaf in leaves(exc) if isinstance(leaf, trio.Cancelled))
    if not isinstance(rest, BaseExceptionGroup):
        return rest
    all_leaves = list(leaves(rest))
    if len(all_leaves) == 1:
        return all_leaves[0]
    if len(rest.exceptions) == 1:
        return rest.exceptions[0]
    return rest


def raise_for_boundary(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise `unwrap_for_boundary` of *group* (called while *group* is handled) with its own
    cause and context, as it was raised (``raise ... from None`` would hide a user's cause)."""
    single = unwrap_for_boundary(group)
    if single is group:
        raise group
    context = single.__context__
    try:
        raise single
    finally:
        single.__context__ = context
        del single, context


def _without_cancelled(exc: BaseException) -> BaseException | None:
    """*exc* without its ``Cancelled`` leaves (``None`` if nothing else is in it); a group that
    holds none comes back as it is, a group that held some is derived anew, as
    `BaseExceptionGroup.split` makes it (which copies even the groups it leaves unchanged)."""
    if isinstance(exc, trio.Cancelled):
        return None
    if not isinstance(exc, BaseExceptionGroup) or not contains_cancelled(exc):
        return exc
    kept = [sub for sub in map(_without_cancelled, exc.exceptions) if sub is not None]
    if not kept:
        return None
    derived = exc.derive(kept)
    derived.__traceback__, derived.__cause__, derived.__context__ = exc.__traceback__, exc.__cause__, exc.__context__
    if hasattr(exc, "__notes__"):
        derived.__notes__ = list(exc.__notes__)
    return derived


def first_failure(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Rule 4: the one exception side-by-side work raises for *group*.

    Its typed error if it holds one; the group itself if it holds a cancellation or
    anything but an `Exception` (``KeyboardInterrupt``: Trio needs them as they are);
    else its first leaf, with a note naming the other failures.
    """
    typed = typed_error(group)
    if typed is not None:
        return typed
    all_leaves = list(leaves(group))
    if not all(isinstance(leaf, Exception) for leaf in all_leaves):
        return group
    first, others = all_leaves[0], all_leaves[1:]
    if others:
        first.add_note(f"{len(others)} more failure(s) beside it: " + "; ".join(describe(o, "repr") for o in others))
    return first


def raise_alone(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise the only exception of *group* as itself, with its own context (called while
    *group* is handled, for a nursery whose tasks never raise: its group can only wrap what
    its body raised or a cancellation from outside); a group of several is raised as it is."""
    if len(group.exceptions) != 1:
        raise group
    error = group.exceptions[0]
    context = error.__context__
    try:
        raise error
    finally:
        error.__context__ = context
        del error, context
