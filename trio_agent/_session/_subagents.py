"""Subagents: their definitions, background handles, and the supervisor that starts every one.

Rules
=====

* A subagent's id is ``<name>-<n>``, n counting the session's subagents of that name;
  a reopened session goes on after the ids its journal holds (never reuses a stream).
* A subagent's allowlist is its definition's, intersected with the root's; it never
  gets the task tools (no unbounded recursion). SubagentStart hooks may replace its
  prompt; a skip or abort refuses it.
* ``subagent_started`` is recorded on the parent's stream before the subagent runs;
  from then on every way out records its one end there (completed, or cancelled
  with a reason), also when it never ran. Work whose ``request_completed`` the journal
  took is completed, whatever cancellation lands after (`record_raised`).
* Foreground: runs inside the calling ``task`` call (which takes no scheduler slot;
  a caller holding one gives it back meanwhile); the parent's abort reaches it, the
  parent's steering stops it (its ``cancel`` tools stop, its ``block`` tools finish).
  Background: a task of the session's nursery, idle between prompts, reporting each
  outcome to the parent's next turn.
* A subagent is among the host's ``agents`` (whose allowlists the permission engine
  checks its calls against) from just before it can make calls: a start refused,
  failed or cancelled before that leaves no entry. A foreground one leaves with its
  ``task`` call.
* Routed persistence: for every run of every subagent it starts, the supervisor
  calls each `RoutedSubagentPersistence` of the agent's chat middleware: ``start``
  once before the run, ``chunk`` per delivered run event, then exactly one of
  ``finish`` (completed) or ``abort`` (failed, cancelled, refused). ``start`` and
  ``chunk`` failures fail the run; ``finish`` / ``abort`` failures are logged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import attrs
import trio

from .._abort import Abort, AbortHandle, AbortReason
from .._config import validate_id
from .._errors import (
    ConfigError,
    InvalidTransitionError,
    JournalError,
    LeaseLostError,
    MiddlewareError,
    SessionBusyError,
    SessionClosedError,
    SettlementError,
    UnknownSubagentError,
)
from .._groups import cancelled_around, is_cancellation
from .._journal._events import (
    RequestInterrupted,
    RequestInterruptReason,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
)
from .._journal._projection import RequestState
from .._lifecycle._routing import RoutedSubagentPersistence, SubagentRunInfo, SubagentRunResult
from .._loop._events import RunEvent
from .._loop._hooks import HookAborted, await_under_abort
from .._loop._rules import StopReason
from .._models._history import answer_orphan_calls
from .._tools._context import ToolContext
from .._util import safe_repr
from ._endings import record_request_end
from ._hooks import HookAbortedError, HookAction, HookEvent
from ._host import SessionHost
from ._messages import DoneEvent, SessionEvent, SubagentEvent, SubagentStatus
from ._requests import _WORKING_FOR, RequestQueue, _Agent, _Request, accept_on
from ._stream import EventSink, discard

__all__ = [
    "RoutedSubagentPersistence",
    "SubagentDefinition",
    "SubagentHandle",
    "SubagentRunInfo",
    "SubagentRunResult",
    "SubagentSupervisor",
]

_log = logging.getLogger("trio_agent.session")

TASK_TOOL_NAMES = frozenset({"task", "task_output"})


def numbered_agent_id(agent_id: str) -> tuple[str, int] | None:
    """``(name, n)`` of a subagent id made as ``<name>-<n>``, else ``None``. Only ASCII digits
    count: str.isdigit() takes others too ("helper-\u0661"), which no id made here holds."""
    name, _, digits = agent_id.rpartition("-")
    if name and digits.isascii() and digits.isdigit():
        return name, int(digits)
    return None


def told_parent(request: _Request) -> str:
    """What the parent's model is told of a subagent's completed work: its answer, and why it
    stopped when it did not finish (its turn limit, say), never an empty answer that reads as done."""
    reason = request.stop_reason
    if reason is StopReason.END_TURN:
        return request.text
    agent = request.agent
    why = f"it reached its turn limit ({agent.max_turns})" if reason is StopReason.MAX_TURNS else reason.value
    note = f"[subagent {agent.agent_id} stopped before it finished: {why}]"
    return f"{request.text}\n\n{note}" if request.text else note


def _optional_names(value: Any) -> Any:
    """An allowlist as a tuple; anything that is not an iterable of names (a ``str``, whose
    characters are no names) is left as given for `SubagentDefinition` to refuse."""
    if value is None or isinstance(value, (str, bytes)):
        return value
    try:
        return tuple(value)
    except TypeError:
        return value


@attrs.frozen
class SubagentDefinition:
    """A named subagent: its own system prompt, a tool allowlist (intersected with the
    session's; ``None`` = all of the session's tools, empty = none), model and turn limit."""

    name: str
    description: str
    system_prompt: str
    tools: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_names)
    model: str | None = None
    max_turns: int | None = None

    def __attrs_post_init__(self) -> None:
        """Every field checked where the definition is written (`ConfigError` naming it)."""
        if not isinstance(self.name, str) or not self.name or len(self.name) > 64:
            raise ConfigError(f"subagent name must be 1-64 characters, not {safe_repr(self.name)}")
        validate_id(self.name, name="subagent name", max_length=64)  # it names the subagent's stream
        where = f"subagent {self.name!r}"
        for field in ("description", "system_prompt"):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise ConfigError(f"{where}: {field} must be a str, not {safe_repr(value)}")
        tools = self.tools
        if tools is not None and not (
            isinstance(tools, tuple) and all(isinstance(tool, str) and tool for tool in tools)
        ):
            raise ConfigError(
                f"{where}: tools must be None (all of the session's tools) or a list of tool names "
                f"(non-empty strings; a single name is a list of one), not {safe_repr(tools)}"
            )
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ConfigError(
                f"{where}: model must be None (the session's) or a model name, not {safe_repr(self.model)}"
            )
        max_turns = self.max_turns
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ConfigError(f"{where}: max_turns must be None or a positive int, not {safe_repr(max_turns)}")


# ---------------------------------------------------------------- routed persistence (types in _lifecycle/_routing.py)


def routed_persistence_of(middleware: Sequence[object]) -> tuple[RoutedSubagentPersistence, ...]:
    """The ``routed_subagent_persistence`` of each middleware that has one, in list order.

    Raises:
        ConfigError: one that does not implement `RoutedSubagentPersistence`.
    """
    found: list[RoutedSubagentPersistence] = []
    for index, item in enumerate(middleware):
        store = getattr(item, "routed_subagent_persistence", None)
        if store is None:
            continue
        if not isinstance(store, RoutedSubagentPersistence):
            raise ConfigError(
                f"lifecycle middleware #{index}: routed_subagent_persistence must define async "
                f"start, chunk, finish and abort, not {store!r}"
            )
        found.append(store)
    return tuple(found)


def _persistence_failed(store: object, step: str, info: SubagentRunInfo, exc: Exception) -> MiddlewareError:
    """What an application's routed persistence raised, as the failure of this subagent's run alone:
    even one of our own errors (a `LeaseLostError` from the store's own journal, say) is not the
    session's, which would end the session for a neighbour's bookkeeping."""
    return MiddlewareError(
        f"routed subagent persistence {store!r} failed in {step} for {info.subagent_id}: {type(exc).__name__}: {exc}"
    )


class _Routed:
    """One subagent run told to every routed persistence (module rules).

    ``start`` and ``chunk`` run under the run's abort, as the loop's non-terminal hooks do: one
    the abort lands on is cut at once (the run then ends aborted at its first safe point), so a
    slow store never holds an abort or the session's close. What is delivered after the abort
    (the run's last events) shares ``cleanup_grace`` from then on, as the terminal hooks get it;
    what overruns it is cut and logged.
    """

    __slots__ = ("ending_by", "grace", "info", "started", "stores")

    def __init__(self, stores: tuple[RoutedSubagentPersistence, ...], info: SubagentRunInfo, grace: float) -> None:
        self.stores = stores
        self.info = info
        self.grace = grace
        self.started: list[RoutedSubagentPersistence] = []
        self.ending_by: float | None = None  # once the run was aborted: when what it delivers is cut

    async def start(self, request: _Request) -> None:
        info = self.info
        for store in self.stores:
            # A start the abort cut counts as started: it is told the run's end (abort).
            await self._deliver(request, store, "start", store.start(info))
            self.started.append(store)  # only a store that started is told the end
        if not self.stores:
            return
        stores = self.stores

        async def observe(event: RunEvent) -> None:
            for store in stores:
                await self._deliver(request, store, "chunk", store.chunk(info, event))

        request.observe = observe

    async def _deliver(
        self, request: _Request, store: RoutedSubagentPersistence, step: str, call: Coroutine[Any, Any, None]
    ) -> None:
        """Await a store's *step*: cut by the request's abort, or after it bounded (class rules);
        its failure fails the run."""
        abort = request.abort
        try:
            if not abort.aborted:
                with contextlib.suppress(HookAborted):  # cut: the run ends aborted, the store is told so
                    await await_under_abort(abort, call)
                return
            ending_by = self.ending_by
            if ending_by is None:
                ending_by = self.ending_by = trio.current_time() + self.grace
            with trio.move_on_at(ending_by) as bound:
                await call
            if bound.cancelled_caught:
                _log.warning(
                    "routed subagent persistence %r: %s for %s overran cleanup_grace (%g s) after the run was "
                    "aborted; it was cut",
                    store,
                    step,
                    self.info.subagent_id,
                    self.grace,
                )
        except Exception as exc:
            raise _persistence_failed(store, step, self.info, exc) from exc

    async def end(self, request: _Request, status: SubagentStatus) -> None:
        started, self.started = self.started, []
        for store in started:
            try:
                if status is SubagentStatus.COMPLETED:
                    result = SubagentRunResult(request.text, request.stop_reason.value, request.turns)
                    await store.finish(self.info, result)
                else:
                    await store.abort(self.info, str(request.error) if request.error else status.value)
            except Exception:
                _log.exception("routed subagent persistence %r failed for %s", store, self.info.subagent_id)


# ---------------------------------------------------------------- handles


class SubagentHandle:
    """A background subagent: ``status``, ``wait()``, ``cancel()`` (stop its current work;
    `resume` continues it) and ``kill()`` (final)."""

    def __init__(self, agent: _Agent, parent_id: str, request_id: str, *, call_id: str | None = None) -> None:
        self.agent = agent
        self.parent_id = parent_id
        self.parent_request_id = request_id
        self.call_id = call_id
        self.status = SubagentStatus.RUNNING
        self.result: str | None = None
        self.error: str | None = None
        self._finished = trio.Event()
        # The scope of the work queued or running now: made with its prompt (`_arm`), so a
        # cancel() reaches work its task has not taken up yet, whose status reads running already.
        self._work_scope: trio.CancelScope | None = None
        self._request: _Request | None = None  # the work running now
        self._killed = False
        self._prompts: list[tuple[str, trio.CancelScope]] = []
        self._wake = trio.Event()
        self._recorded = False  # its final outcome is on the parent's stream
        self._task_done = trio.Event()  # its task in the session's nursery ended

    @property
    def id(self) -> str:
        return self.agent.agent_id

    @property
    def name(self) -> str:
        return self.agent.name

    async def wait(self) -> str | None:
        """Wait until the current work ends (completed, failed, cancelled or idle); return its result."""
        await self._finished.wait()
        return self.result

    def cancel(self) -> None:
        """Stop the current work; the subagent stays resumable (`resume`)."""
        if self._work_scope is not None:
            self._work_scope.cancel()

    def kill(self) -> None:
        """Stop for good (recorded as cancelled if it never completed)."""
        self._killed = True
        self.cancel()
        self._wake.set()

    def resume(self, prompt: str) -> None:
        """Give an idle (cancelled or finished) subagent more work."""
        RequestQueue.check_message(prompt, None)  # as send(): a non-empty string
        if self._killed:
            raise SessionClosedError(f"subagent {self.id} was killed")
        if self.status is SubagentStatus.RUNNING or not self._finished.is_set():
            raise SessionBusyError(f"subagent {self.id} is still running (or still recording its outcome)")
        self._arm(prompt)
        self._finished = trio.Event()
        self.status = SubagentStatus.RUNNING
        self.result = self.error = None  # the earlier work's, not what this work will give
        self._wake.set()

    def _arm(self, prompt: str) -> None:
        """Queue *prompt* as the next work, with the cancel scope it will run in."""
        scope = self._work_scope = trio.CancelScope()
        self._prompts.append((prompt, scope))


# ---------------------------------------------------------------- the supervisor


class SubagentSupervisor:
    """Starts, runs, reports and closes every subagent of one session (module rules)."""

    # Slotted, as every object an idle session keeps (thousands may be alive).
    __slots__ = (
        "_numbers",
        "definitions",
        "host",
        "nursery",
        "persistence",
        "subagents",
    )

    def __init__(
        self,
        host: SessionHost,
        definitions: Mapping[str, SubagentDefinition],
        nursery: trio.Nursery,
        persistence: tuple[RoutedSubagentPersistence, ...] = (),
    ) -> None:
        self.host = host
        self.definitions = definitions
        self.nursery = nursery
        self.persistence = persistence
        self.subagents: dict[str, SubagentHandle] = {}
        self._numbers: dict[str, int] | None = None  # per name, the last n given (`_new_agent_id`)

    def definition(self, name: str) -> SubagentDefinition:
        # Definitions are named by strings: anything else (a list, unhashable) names none of them,
        # rather than a raw TypeError from the lookup.
        definition = self.definitions.get(name) if isinstance(name, str) else None
        if definition is None:
            known = ", ".join(sorted(self.definitions)) or "none"
            raise UnknownSubagentError(f"unknown subagent {safe_repr(name)} (defined: {known})")
        return definition

    def _make_agent(self, definition: SubagentDefinition, parent_id: str) -> _Agent:
        root = self.host.root
        return _Agent(
            agent_id=self._new_agent_id(definition.name),
            name=definition.name,
            system_prompt=definition.system_prompt,
            allowed=self._allowed(definition),
            max_turns=definition.max_turns or root.max_turns,
            parent_id=parent_id,
            model=definition.model,
        )

    def _new_agent_id(self, name: str) -> str:
        """``<name>-<n>``: n counts this session's subagents of *name* from 1, going on after the
        largest n its journal holds. The journal is the only memory a reopened session has (a new
        process, even): a counter of the process handed out an id whose stream was already there,
        and the new subagent failed on its ``session_created``. Read once, at the first subagent
        (an idle session never pays for it); after that only this supervisor makes such ids."""
        numbers = self._numbers
        if numbers is None:
            numbers = self._numbers = {}
            # The root's id too: its stream may not be written yet (a new session defers it).
            for agent_id in (self.host.root.agent_id, *self.host.journal.agents):
                numbered = numbered_agent_id(agent_id)
                if numbered is not None:
                    base, number = numbered
                    numbers[base] = max(numbers.get(base, 0), number)
        number = numbers[name] = numbers.get(name, 0) + 1
        return f"{name}-{number}"

    def _allowed(self, definition: SubagentDefinition) -> frozenset[str]:
        """The tools a subagent of *definition* may use: its allowlist within the session's."""
        root = self.host.root
        allowed = root.allowed if definition.tools is None else root.allowed & frozenset(definition.tools)
        return allowed - TASK_TOOL_NAMES

    def recovered_agent(self, agent_id: str, parent_id: str) -> _Agent:
        """The subagent of an earlier life whose stream is *agent_id*, as far as recovery needs it:
        the allowlist its calls are re-run under. Its definition is the one its id names
        (``<name>-<n>``, as `_make_agent` makes it); an id naming no definition of this session
        may use no tool."""
        numbered = numbered_agent_id(agent_id)
        name = agent_id if numbered is None else numbered[0]
        definition = None if numbered is None else self.definitions.get(name)
        root = self.host.root
        return _Agent(
            agent_id=agent_id,
            name=name,
            system_prompt="" if definition is None else definition.system_prompt,
            allowed=frozenset() if definition is None else self._allowed(definition),
            max_turns=root.max_turns,
            parent_id=parent_id,
        )

    def _routed(
        self, agent: _Agent, request: _Request, parent_request_id: str, call_id: str | None, *, background: bool
    ) -> _Routed:
        assert agent.parent_id is not None
        info = SubagentRunInfo(
            session_id=self.host.session_id,
            subagent_id=agent.agent_id,
            name=agent.name,
            parent_agent_id=agent.parent_id,
            parent_request_id=parent_request_id,
            request_id=request.request_id,
            prompt=request.prompt,
            background=background,
            call_id=call_id,
        )
        return _Routed(self.persistence, info, self.host.cleanup_grace)

    async def _subagent_start(self, agent: _Agent, prompt: str) -> str:
        """SubagentStart hooks: may replace the prompt; skip or abort refuses the subagent."""
        decision = await self.host.dispatch(
            HookEvent.SUBAGENT_START,
            agent.agent_id,
            subagent_id=agent.agent_id,
            subagent_type=agent.name,
            prompt=prompt,
        )
        decision.raise_for_abort()
        if decision.action is HookAction.SKIP:
            refused = HookAbortedError(
                f"a SubagentStart hook refused subagent {agent.name!r}: {decision.reason or 'skip'}",
                event=HookEvent.SUBAGENT_START,
                reason=decision.reason,
                callback=decision.decided_by,
                source=decision.source,
            )
            refused.code = "hook_skip"
            raise refused
        if decision.prompt is not None:  # never blank: `_checked` refuses that (HookReturnError)
            prompt = decision.prompt
        if decision.context_text:
            prompt = f"{prompt}\n\n{decision.context_text}"
        return prompt

    async def record_end(self, parent_id: str, event: SubagentCompleted | SubagentCancelled) -> bool:
        """Record a subagent's one outcome on its parent's stream, if it is still running there."""
        journal = self.host.journal
        if journal.lost or journal.fenced or journal.closed:
            return False
        record = journal.projection(parent_id)._s.subagents.get(event.subagent_id)
        if record is None or record.state.value != "running":
            return False
        try:
            await journal.append(event, agent_id=parent_id)
        except InvalidTransitionError:
            raise
        except (JournalError, LeaseLostError) as exc:
            _log.warning("could not record the end of subagent %s: %s", event.subagent_id, exc)
            return False
        return True

    # -- background

    async def spawn_background(
        self, name: str, prompt: str, parent_id: str, request_id: str, *, call_id: str | None
    ) -> SubagentHandle:
        agent, prompt = await self.prepare_background(name, prompt, parent_id)
        return await self.launch_background(agent, prompt, parent_id, request_id, call_id=call_id)

    async def prepare_background(self, name: str, prompt: str, parent_id: str) -> tuple[_Agent, str]:
        """The subagent's agent and its prompt as the SubagentStart hooks leave it (a refusal
        raises). Nothing is journalled yet: `launch_background` starts it."""
        if self.host.closing:
            raise SessionClosedError("the session is closed")
        agent = self._make_agent(self.definition(name), parent_id)
        return agent, await self._subagent_start(agent, prompt)

    async def launch_background(
        self, agent: _Agent, prompt: str, parent_id: str, request_id: str, *, call_id: str | None
    ) -> SubagentHandle:
        """Record the start of a prepared subagent under *request_id* and run it in the session's nursery."""
        host = self.host
        if host.closing:  # the hooks may have run into the close
            raise SessionClosedError("the session is closed")
        await host.journal.open_agent(agent.agent_id, parent_agent_id=parent_id)
        try:
            # Once submitted, subagent_started is in the projection: every way out must end it.
            await host.journal.append(
                SubagentStarted(request_id=request_id, subagent_id=agent.agent_id, call_id=call_id),
                agent_id=parent_id,
            )
            if host.closing:
                raise SessionClosedError("the session closed while the subagent was starting")
            handle = SubagentHandle(agent, parent_id, request_id, call_id=call_id)
            handle._arm(prompt)
            # No await from here: the task's own `finally` records its outcome from now on.
            self.nursery.start_soon(self._background_main, handle)
            self.subagents[agent.agent_id] = handle
            # It makes calls from here on. Registered no earlier: a start that fails or is cancelled
            # before this point (the hooks, open_agent, the holder request) leaves nothing behind.
            host.agents[agent.agent_id] = agent
        except BaseException as exc:
            # It never runs, and says so.
            why = "session closed" if host.closing or isinstance(exc, SessionClosedError) else "start interrupted"
            with host.cleanup_scope("recording a subagent that never started"):
                await self.record_end(
                    parent_id, SubagentCancelled(request_id=request_id, subagent_id=agent.agent_id, reason=why)
                )
            raise
        return handle

    async def _background_main(self, handle: SubagentHandle) -> None:
        """The task of one background subagent: runs its prompts until killed or the session ends.

        Between prompts it is idle (completed, failed or cancelled work) and can be
        resumed. Its start was recorded on the parent's stream; its end is recorded
        once: completed at its first completion, cancelled when killed before that.
        Each prompt's work ends through `_end_work` on every way out, a cancellation of
        the session's nursery from outside (a scope around the session) included.
        """
        host = self.host
        agent = handle.agent
        # Its task works for no request between prompts: not for the one whose tool started it
        # (a task inherits its starter's context), which it outlives.
        _WORKING_FOR.set(None)
        try:
            while not handle._killed:
                if not handle._prompts:
                    handle._wake = trio.Event()
                    await handle._wake.wait()
                    continue
                prompt, scope = handle._prompts.pop(0)
                request = _Request(prompt, discard, agent)
                routed = self._routed(agent, request, handle.parent_request_id, handle.call_id, background=True)
                # The earlier work's outcome goes: a failure of this work must not read as its answer.
                handle.result = handle.error = None
                handle._request = request

                def cancel_reason(scope: trio.CancelScope = scope) -> RequestInterruptReason:
                    # Its own scope cancelled (cancel(), kill()) is the user's doing, unless the session ends.
                    if scope.cancel_called and not self._session_ends():
                        return RequestInterruptReason.USER_ABORT
                    return RequestInterruptReason.SESSION_CLOSE

                request.cancel_reason = cancel_reason
                handle.status = SubagentStatus.RUNNING
                # What runs for this work (its tools, hooks, routed persistence) works for its
                # request: a `Session.close` from there waits for it instead of being waited for.
                working = _WORKING_FOR.set(request)
                try:
                    with scope:
                        try:
                            # Cancelled before it was taken up: it ends here, nothing written for it.
                            await trio.lowlevel.checkpoint_if_cancelled()
                            await routed.start(request)
                            await accept_on(host.journal, agent.agent_id, request)
                            await host.run_request(request)
                        except (LeaseLostError, SettlementError):
                            raise
                        except Exception as exc:  # a subagent crash is reported, never unhandled
                            handle.status = SubagentStatus.FAILED
                            handle.error = f"{type(exc).__name__}: {exc}"
                except BaseException as exc:
                    if not is_cancellation(exc):
                        raise
                    # Cancelled from outside: the session ends (its block, a scope around it).
                    await self._end_work(handle, request, routed, cancelled=True)
                    raise
                finally:
                    _WORKING_FOR.reset(working)
                await self._end_work(handle, request, routed, cancelled=scope.cancelled_caught)
        finally:
            # Killed with work it had not taken up yet (its status read running): cancelled, as a
            # kill while it runs is; `killed` is for a subagent that was idle.
            had_work = handle.status is SubagentStatus.RUNNING
            if handle.status in (SubagentStatus.RUNNING, SubagentStatus.IDLE):
                handle.status = SubagentStatus.CANCELLED  # its task ends: nothing can resume it
            if not handle._recorded:
                handle._recorded = True
                with host.cleanup_scope("recording a subagent's end"):
                    await self.record_end(
                        handle.parent_id,
                        SubagentCancelled(
                            request_id=handle.parent_request_id,
                            subagent_id=handle.id,
                            reason="session closed"
                            if self._session_ends()
                            else (SubagentStatus.CANCELLED.value if had_work else "killed"),
                        ),
                    )
            handle._finished.set()
            handle._task_done.set()

    async def _end_unended(self, request: _Request) -> None:
        """A subagent's request accepted but cancelled before it ran ends here, interrupted for the
        reason its cancellation gives (`record_request_end` is a no-op for one that ended)."""
        await record_request_end(
            self.host.journal,
            request.agent.agent_id,
            request.request_id,
            RequestInterrupted(request_id=request.request_id, reason=request.cancel_reason()),
        )

    def _completed(self, request: _Request) -> bool:
        """Whether the journal took *request*'s completion (then a cancellation landing after it,
        while it was committed say, leaves it completed: `record_raised`)."""
        record = self.host.journal.projection(request.agent.agent_id).request(request.request_id)
        return record is not None and record.state is RequestState.COMPLETED

    def _session_ends(self) -> bool:
        """The session closes, or its nursery is cancelled (by itself or a scope around the session)."""
        return self.host.closing or cancelled_around(self.nursery.cancel_scope)

    async def _end_work(self, handle: SubagentHandle, request: _Request, routed: _Routed, *, cancelled: bool) -> None:
        """One prompt's work ended: its request's end is durable, the handle says how it ended,
        the routed persistence and the parent are told (shielded: it also runs while cancelled)."""
        host = self.host
        agent = handle.agent
        handle._request = handle._work_scope = None
        if not request.done.is_set():
            # It never ran (its start or acceptance failed, or it was cancelled first): nothing
            # else finishes it, and the session's close waits for it.
            request.finish()
        if cancelled and self._completed(request):
            cancelled = False  # the work finished (durably) before the cancel arrived
        # The session's close aborts the work (its calls settle with that reason): an abort, not a failure.
        aborted = handle.status is not SubagentStatus.FAILED and request.abort.aborted and request.error is not None
        if cancelled or aborted:
            with host.cleanup_scope("recording a cancelled subagent request"):
                await self._end_unended(request)
            # A resumed conversation must answer every tool call the cancelled work left open.
            agent.history = answer_orphan_calls(agent.history)
            ends = handle._killed or self._session_ends()
            handle.status = SubagentStatus.CANCELLED if ends else SubagentStatus.IDLE
            handle.result = None
        elif handle.status is not SubagentStatus.FAILED:
            if request.error is not None:
                handle.status = SubagentStatus.FAILED
                handle.error = str(request.error)
            else:
                handle.status = SubagentStatus.COMPLETED
                handle.result = request.text
        with host.cleanup_scope("storing a subagent run's end"):
            await routed.end(request, handle.status)
        await self._report(handle, told_parent(request))
        handle._finished.set()

    async def _report(self, handle: SubagentHandle, answer: str) -> None:
        """Tell the parent (its next turn) and record the first final outcome on its stream."""
        status = handle.status
        closed = status is SubagentStatus.CANCELLED and self._session_ends()
        summary = answer if status is SubagentStatus.COMPLETED else (handle.error or status.value)
        with self.host.cleanup_scope("recording a subagent's outcome"):
            told = False  # its outcome, recorded now, tells the note after a reopen
            if not handle._recorded and status in (
                SubagentStatus.COMPLETED,
                SubagentStatus.FAILED,
                SubagentStatus.CANCELLED,
            ):
                handle._recorded = True
                if status is SubagentStatus.COMPLETED:
                    event: Any = SubagentCompleted(request_id=handle.parent_request_id, subagent_id=handle.id)
                else:
                    event = SubagentCancelled(
                        request_id=handle.parent_request_id,
                        subagent_id=handle.id,
                        reason="session closed" if closed else status.value,
                    )
                told = await self.record_end(handle.parent_id, event)
            note = f"[background subagent {handle.id} ({handle.name}) {status.value}]: {summary or ''}"
            if told:
                # Owed until the parent's next model reply (`ConversationFold.outcomes_since_reply`):
                # a reopen tells it from the outcome, so it is not journalled a second time.
                self.host.inbox.setdefault(handle.parent_id, []).append(note)
                return
            try:
                # No outcome tells it (a later work's report, an idle one's): journalled itself,
                # durably, as the subagent's request end it reports already is.
                await self.host.note(handle.parent_id, [note], subagent_id=handle.id)
            except (JournalError, LeaseLostError) as exc:  # in the inbox all the same, for this life
                _log.warning("could not journal the report of subagent %s: %s", handle.id, exc)

    # -- foreground

    async def run_foreground(self, name: str, prompt: str, ctx: ToolContext, sink: EventSink) -> str:
        """Run a subagent inside the calling tool's execution; the caller's slot is given back meanwhile.

        The parent's abort reaches the child's work. Steering of the parent's request
        reaches it as a steering abort of the child's request: its ``cancel`` tools are
        cancelled, its ``block`` tools finish and settle, then the child's request ends
        interrupted (steering) and `RequestAbortedError` is raised.
        """
        host = self.host
        agent = self._make_agent(self.definition(name), ctx.agent_id)
        # Its calls descend from the calling tool's: file locks that call holds cover them.
        agent.lineage = (*ctx.execution.lineage, ctx.execution.call_key)
        prompt = await self._subagent_start(agent, prompt)
        await host.journal.open_agent(agent.agent_id, parent_agent_id=ctx.agent_id)

        async def publish(event: SessionEvent) -> None:
            # Published as the task call's ``emit`` publishes its items: a wait on the stream's
            # reader is the reader's, so it holds the call's deadline (not the child's model calls'
            # or tools' waits: those count, in the child's own frames and in the call's time).
            with ctx._publishing():
                await sink(event)

        async def child_sink(event: SessionEvent) -> None:
            # The child's events join the parent's stream; its DoneEvent is not the parent's.
            if not isinstance(event, DoneEvent):
                await publish(event)

        request = _Request(prompt, child_sink, agent)
        request.cancel_reason = self._cancelled_by_parent
        routed = self._routed(agent, request, ctx.request_id, ctx.tool_call_id, background=False)

        def forward_abort(abort: Abort) -> None:
            request.abort.abort(abort.reason, abort.message)

        def forward_steering(abort: Abort) -> None:
            request.stop.abort(abort.reason, abort.message)
            request.steering.abort(abort.reason, abort.message)

        listeners: list[tuple[AbortHandle, int]] = []
        status = SubagentStatus.FAILED
        failure = "cancelled"  # why it ended without a request error of its own
        try:
            # Once submitted, subagent_started is in the projection: the `finally` ends it.
            await host.journal.append(
                SubagentStarted(
                    request_id=ctx.request_id, subagent_id=agent.agent_id, call_id=ctx.tool_call_id, background=False
                ),
                agent_id=ctx.agent_id,
            )
            listeners.append((ctx.abort, ctx.abort.add_listener(forward_abort)))
            parent = host.running.get((ctx.agent_id, ctx.request_id))
            # Only steering that arrives from now on: a turn's signal set already (a "now" message
            # while the model was still answering with this call) steers that reply's calls, whose
            # `block` ones, this `task` call included, run (a listener would fire at once).
            if parent is not None and not parent.steering.aborted:
                listeners.append((parent.steering, parent.steering.add_listener(forward_steering)))
            await publish(SubagentEvent(ctx.agent_id, agent.agent_id, name, SubagentStatus.RUNNING, background=False))
            host.agents[agent.agent_id] = agent  # it makes calls from here on (the `finally` takes it out)
            async with ctx.slot_released():
                await routed.start(request)
                await accept_on(host.journal, agent.agent_id, request)
                await host.run_request(request)
                # Decided now: taking the slot back awaits, and a cancellation there keeps this end.
                status = SubagentStatus.COMPLETED if request.error is None else SubagentStatus.FAILED
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            for handle, token in listeners:
                handle.remove_listener(token)
            with host.cleanup_scope("recording a foreground subagent's end"):
                await self._end_unended(request)
                if status is SubagentStatus.FAILED and request.error is None and self._completed(request):
                    status = SubagentStatus.COMPLETED  # cancelled once its completion was taken
                if status is SubagentStatus.COMPLETED:
                    event: Any = SubagentCompleted(request_id=ctx.request_id, subagent_id=agent.agent_id)
                else:
                    event = SubagentCancelled(
                        request_id=ctx.request_id, subagent_id=agent.agent_id, reason=str(request.error or failure)
                    )
                await self.record_end(ctx.agent_id, event)
                await routed.end(request, status)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await publish(SubagentEvent(ctx.agent_id, agent.agent_id, name, status, False, request.text[:200]))
            host.agents.pop(agent.agent_id, None)  # it will make no more calls
            if not request.done.is_set():
                request.finish()  # it never ran: its stream channels end, nothing waits for it
        if request.error is not None:
            raise request.error
        return told_parent(request)

    def _cancelled_by_parent(self) -> RequestInterruptReason:
        # A foreground child is cancelled with its parent's tool call: the parent's abort or deadline,
        # or the session's end (also a scope around the session), as its root request says then.
        return RequestInterruptReason.SESSION_CLOSE if self._session_ends() else RequestInterruptReason.USER_ABORT

    # -- closing

    async def close(self) -> None:
        """Abort background work with the close's reason (its calls settle with it), then stop it."""
        for handle in list(self.subagents.values()):
            work = handle._request
            if work is not None:
                work.abort.abort(AbortReason.SESSION_CLOSE, "the session is closing")
        for handle in list(self.subagents.values()):
            work = handle._request
            if work is not None:
                await work.done.wait()
        for handle in list(self.subagents.values()):
            handle.kill()
        for handle in list(self.subagents.values()):
            await handle._task_done.wait()
