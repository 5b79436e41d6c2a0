"""`open_session`: a session of an `AgentSpec` (or of keyword options, which build one).

Order, each step depending only on the ones before it: the provider (a name is
created and closed here), the journal (opened here, or given: then the caller
keeps it), the model service (the spec's, on its own provider), the permission
engine (derived from the spec's, recording into the journal), the tool pipeline,
the host, the request queue, the nursery, the subagent supervisor, the `Session`.
Nothing is bound late. The block is a plain class (`_SessionBlock`): it leaves what
it entered in reverse, as the nested ``async with`` blocks would, and keeps no
generator frame or exit stack while the session is open.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import MappingProxyType, TracebackType
from typing import Any, Generic, Literal, NoReturn, TypeVar, cast

import trio

from .._cleanup import DEFAULT_CLEANUP_GRACE, validate_cleanup_grace
from .._config import validate_id, validate_timeout
from .._errors import ConfigError, require_trio
from .._groups import contains_cancelled, typed_error, unwrap_for_boundary
from .._journal._durable import DurableJournal, _JournalBlock, is_journal_store, open_journal
from .._journal._events import PERMISSION_UPDATE_SOURCES, PermissionUpdated, SessionCloseReason
from .._journal._lease import check_seconds, check_timing
from .._journal._memory import MemoryStore
from .._journal._registry import shared_sqlite_store
from .._journal._store import JournalStore
from .._lifecycle._capabilities import validate_capabilities
from .._lifecycle._middleware import ChatMiddleware
from .._loop._interrupts import ClientTool, InterruptDefinition
from .._models._history import validate_history
from .._models._messages import Message
from .._models._service import Provider, RetryPolicy
from .._permissions._engine import PermissionHandler
from .._permissions._rules import PermissionMode, PermissionRules, PermissionUpdate, update_to_json
from .._tools._definition import Tool
from .._tools._pipeline import ToolPipeline
from .._tools._scheduler import SchedulerLimits, ToolScheduler
from .._tools._stages import StageDecision
from .._util import safe_repr
from ._hooks import HookCallback, HookEvent
from ._host import SessionHost
from ._plugins import MiddlewareConfig, Plugin
from ._requests import RequestQueue, _Agent
from ._session import Session
from ._spec import AgentSpec, PermissionAsks, define_agent
from ._subagents import SubagentDefinition, SubagentSupervisor
from ._task_tools import TaskTools
from ._wiring import journal_permissions, session_stages

__all__ = ["open_session"]

JournalOption = DurableJournal | JournalStore | str | os.PathLike[str] | None

_T = TypeVar("_T")

_NO_DEFINITIONS: Mapping[str, SubagentDefinition] = MappingProxyType({})

_log = logging.getLogger("trio_agent")


def open_session(
    spec: AgentSpec | None = None,
    /,
    *,
    provider: Provider | str | None = None,
    model: str | None = None,
    system_prompt: str = "",
    tools: Sequence[Tool[Any] | ClientTool] = (),
    plugins: Sequence[Plugin] = (),
    middleware: MiddlewareConfig | None = None,
    lifecycle: Sequence[ChatMiddleware] = (),
    hooks: Mapping[HookEvent, Sequence[HookCallback]] | None = None,
    allowed_tools: Sequence[str] | None = None,
    disallowed_tools: Sequence[str] | None = None,
    permissions: PermissionRules | Mapping[str, Sequence[str]] | None = None,
    permission_mode: PermissionMode | str = PermissionMode.DEFAULT,
    permission_handler: PermissionHandler | None = None,
    max_turns: int = 20,
    subagents: Sequence[SubagentDefinition] = (),
    workspace_roots: Sequence[str | os.PathLike[str]] | None = None,
    hook_deadlines: Mapping[HookEvent, float] | None = None,
    retry: RetryPolicy | None = None,
    scheduler_limits: SchedulerLimits | None = None,
    model_request_timeout: float = 600.0,
    tool_timeout: float = 600.0,
    journal: JournalOption = None,
    session_id: str | None = None,
    lease_ttl: float = 30.0,
    takeover_timeout: float = 0.0,
    durable_pure_starts: bool = True,
    cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    close_timeout: float = 30.0,
    history: Sequence[Message] | None = None,
    permission_asks: PermissionAsks = "handler",
    interrupts: Sequence[InterruptDefinition] = (),
    unfinished: Literal["interrupt", "keep"] = "interrupt",
    permission_ask_timeout: float = 600.0,
) -> AbstractAsyncContextManager[Session]:
    """Open a session: ``async with open_session(spec) as session`` (the spec's ``createSession``).

    *spec* is an `AgentSpec` (`define_agent`); without one, the agent options
    (``provider=``, ``model=``, ``tools=`` ... everything `define_agent` takes) build
    one for this session. Giving both is a `ConfigError`.

    ``provider`` is a `Provider` (the caller owns it) or a provider name
    (``"openai"``, ``"anthropic"``: the session creates and closes it; ``model`` is
    then required). ``journal`` is an open `DurableJournal` (used as is; the
    caller keeps it open and owns its lease), a `JournalStore`, a SQLite file path
    (opened and closed by the session) or ``None`` (an in-memory store: same rules,
    no durability). Reopening an existing ``session_id`` on a durable journal
    continues it: a cleanly closed session starts a new life with its
    conversation rebuilt from the journal, a crashed one is recovered first (see
    ``Session.recovery``); a session ended for good (``session.end()``) is refused.
    ``history`` seeds a new session with earlier messages (validated; recorded in
    the journal, so a rebuilt conversation has them). Leaving the block cancels what still
    runs, records it, and writes one ``session_closed`` per agent stream.

    ``durable_pure_starts=False`` lets ``pure`` tools start without waiting for their
    ``tool_started`` commit, on a journal the session opens (`open_journal`'s option;
    an open `DurableJournal` keeps its own).

    ``unfinished`` says what reopening does with the root's requests a crash (or a
    worker's hand-off) left open: ``"interrupt"`` records them interrupted by the
    restart; ``"keep"`` (what a worker taking the session over uses) leaves accepted
    ones runnable and started ones to go on from their last durable point, each run by
    `Session.serve_request`. Calls are recovered by their contracts either way.

    ``cleanup_grace`` bounds every shielded clean-up after a cancellation
    (recording outcomes, closing streams and stores; an overrun is logged as a
    WARNING on the ``trio_agent`` logger); ``close_timeout`` bounds leaving the
    block as a whole.

    Raises `ConfigError` (bad options, duplicate tools or plugins, bad rules)
    before anything starts; errors at the boundary are trio_agent errors, never
    exception groups, and a cancellation from outside is one ``trio.Cancelled``.
    """
    # In define_agent's order (`_AGENT_OPTIONS`): checked with their defaults when the block opens.
    agent_options: tuple[Any, ...] = (
        provider, model, system_prompt, tools, plugins, middleware, lifecycle, hooks, allowed_tools,
        disallowed_tools, permissions, permission_mode, permission_handler, max_turns, subagents,
        workspace_roots, hook_deadlines, retry, scheduler_limits, model_request_timeout, tool_timeout,
        permission_asks, interrupts, permission_ask_timeout,
    )  # fmt: skip
    return _SessionBlock(
        spec,
        agent_options,
        _Options(
            journal, session_id, lease_ttl, takeover_timeout, durable_pure_starts, cleanup_grace, close_timeout,
            history, unfinished,
        ),
    )  # fmt: skip


class _Options:
    """`open_session`'s options that are not the agent's, as given (checked when the block opens)."""

    __slots__ = (
        "cleanup_grace",
        "close_timeout",
        "durable_pure_starts",
        "history",
        "journal",
        "lease_ttl",
        "session_id",
        "takeover_timeout",
        "unfinished",
    )

    def __init__(
        self,
        journal: JournalOption,
        session_id: str | None,
        lease_ttl: float,
        takeover_timeout: float,
        durable_pure_starts: bool,
        cleanup_grace: float,
        close_timeout: float,
        history: Sequence[Message] | None,
        unfinished: str,
    ) -> None:
        self.journal = journal
        self.session_id = session_id
        self.lease_ttl = lease_ttl
        self.takeover_timeout = takeover_timeout
        self.durable_pure_starts = durable_pure_starts
        self.cleanup_grace = cleanup_grace
        self.close_timeout = close_timeout
        self.history = history
        self.unfinished = unfinished


class _SessionKey:
    """One open session's token (`ExecutionContext.session_key`): compared by identity, so two sessions
    with one session_id (in two stores) are two keys."""

    __slots__ = ("session_id",)

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"<session {self.session_id!r} key {id(self):#x}>"


class _SessionBlock:
    """``async with open_session(...)``: what the block opens, in order, and leaves in reverse.

    Opening enters the provider (one named by string), then the journal, then the session's
    nursery, and starts the session in it; leaving closes the session, then leaves the
    nursery, the journal and the provider, exactly as the nested ``async with`` blocks of
    that order would (`_leave`). No generator frame or exit stack outlives the opening.
    """

    __slots__ = ("_journal_cm", "_nursery", "_nursery_cm", "_options", "_provider_cm", "_routed", "_session")

    def __init__(self, spec: AgentSpec | None, agent_options: tuple[Any, ...], options: _Options) -> None:
        self._options: tuple[AgentSpec | None, tuple[Any, ...], _Options] | None = (spec, agent_options, options)
        self._provider_cm: AbstractAsyncContextManager[Provider] | None = None
        self._journal_cm: AbstractAsyncContextManager[DurableJournal] | None = None
        self._nursery_cm: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._nursery: trio.Nursery | None = None
        self._routed: tuple[TaskTools, _SessionKey] | None = None  # the spec's task tools route this session
        self._session: Session | None = None  # from the start of its life on: it must be closed

    async def __aenter__(self) -> Session:
        try:
            try:
                return await self._enter()
            except BaseException as exc:
                if self._provider_cm is None:
                    raise  # nothing was opened yet
                await self._leave(exc)
                raise RuntimeError("open_session: an exit swallowed the error that stopped the opening") from exc
        except BaseExceptionGroup as group:
            _raise_at_boundary(group)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            try:
                await self._leave(exc)
            except BaseExceptionGroup as group:
                _raise_at_boundary(group)
        except BaseException as out:
            if out is exc:  # the body's own error goes on as itself
                out.__traceback__ = tb
                return False
            raise
        finally:
            # What the block opened is closed: a caller that keeps the block keeps none of it.
            self._session = self._nursery = self._nursery_cm = self._journal_cm = self._provider_cm = None
        return False

    async def _enter(self) -> Session:
        require_trio("open_session()")
        given = self._options
        if given is None:
            raise RuntimeError("an open_session(...) block can be entered once")
        self._options = None
        spec, agent_options, options = given
        if spec is None:
            if agent_options[0] is None:  # provider
                raise ConfigError("open_session needs an AgentSpec (define_agent) or provider=")
            spec = define_agent(**dict(zip(_AGENT_OPTIONS, agent_options, strict=True)))
        elif not isinstance(spec, AgentSpec):
            raise ConfigError(f"open_session takes an AgentSpec (define_agent(...)), not {spec!r}")
        elif agent_options != _AGENT_DEFAULTS:
            named = sorted(
                name
                for name, value, default in zip(_AGENT_OPTIONS, agent_options, _AGENT_DEFAULTS, strict=True)
                if value != default
            )
            if named:
                raise ConfigError(f"agent options {named} belong to define_agent; pass them there, not with a spec")
        journal, session_id, unfinished = options.journal, options.session_id, options.unfinished
        cleanup_grace = validate_cleanup_grace(options.cleanup_grace)
        close_timeout = validate_timeout(options.close_timeout, name="close_timeout")
        seed = None if options.history is None else validate_history(options.history)
        if session_id is not None:
            validate_id(session_id, name="session_id")
        journal = _check_journal_option(journal)
        # open_journal checks these too, but only once a SQLite file was made: checked before anything opens.
        check_timing(options.lease_ttl, None)
        check_seconds("takeover_timeout", options.takeover_timeout, allow_zero=True)
        if isinstance(journal, DurableJournal) and session_id not in (None, journal.session_id):
            raise ConfigError(f"session_id {session_id!r} differs from the given journal's {journal.session_id!r}")
        if unfinished not in ("interrupt", "keep"):
            raise ConfigError(f"unfinished must be 'interrupt' or 'keep', not {unfinished!r}")
        durable_pure_starts = options.durable_pure_starts
        if not isinstance(durable_pure_starts, bool):
            raise ConfigError(f"durable_pure_starts must be True or False, not {durable_pure_starts!r}")
        if isinstance(journal, DurableJournal) and durable_pure_starts != journal.durable_pure_starts:
            raise ConfigError("durable_pure_starts belongs to open_journal for a journal given open")

        # A missing API key fails before any journal opens.
        provider_cm, provider_obj = _provider(spec)
        if provider_obj is None:  # one named by string: created here, closed with the session
            provider_obj = await provider_cm.__aenter__()
        self._provider_cm = provider_cm
        if spec.middleware or getattr(provider_obj, "requires", None) is not None:
            validate_capabilities(spec.middleware, provider_obj)  # the adapter's requires too
        journal_cm = _journal(
            journal, session_id, options.lease_ttl, options.takeover_timeout, cleanup_grace, durable_pure_starts
        )
        durable = await journal_cm.__aenter__()
        self._journal_cm = journal_cm
        service = spec.model_service(provider_obj, cleanup_grace)
        root = _Agent(
            agent_id=durable.root_agent_id,
            name="root",
            system_prompt=spec.system_prompt,
            allowed=spec.parts.allowed,
            max_turns=spec.max_turns,
            tool_filter=spec.parts.root_filter,
        )
        agents = {root.agent_id: root}  # the host's live registry of agents that make calls
        engine = spec.parts.session_engine(journal_permissions(durable), agents)
        # What a person answered by resuming a paused request, per call, for the permission stage.
        decided: dict[tuple[str, str], StageDecision] = {}
        # This open session's own token: the spec's shared task tools find its supervisor by it.
        session_key = _SessionKey(durable.session_id)
        pipeline = ToolPipeline(
            spec.parts.tools.values(),
            middleware=spec.parts.tool_middleware,
            journal=durable,
            scheduler=ToolScheduler(spec.scheduler_limits),
            stages=session_stages(spec.parts, engine, decided),
            timeout=spec.tool_timeout,
            workspace=spec.parts.workspace,
            unwind_grace=spec.unwind_grace,
            # The session's one bound for clean-up: a tool's ctx.cleanup_scope() and the time a
            # cancelled tool may take to stop before it is reported.
            cleanup_grace=cleanup_grace,
            settle_grace=cleanup_grace,
            history_limit=0,  # the journal is the session's record of its calls
            session_key=session_key,
        )
        host = SessionHost(
            journal=durable,
            service=service,
            pipeline=pipeline,
            root=root,
            hooks=spec.parts.hooks,
            lifecycle=spec.lifecycle,
            permissions=engine,
            agents=agents,
            cleanup_grace=cleanup_grace,
            interrupts=spec.interrupts,
            client_tools=spec.client_tools,
            decided=decided,
            asks_by_pausing=spec.permission_asks == "interrupt",
            tracks_running=bool(spec.definitions),  # only the task tool's foreground subagents look
            tool_specs=spec.parts.tool_specs,
        )
        # The host's notes, not the host: the host reaches the queue through its engine (`_RecordUpdates`).
        queue = RequestQueue(durable, root, max_queued=64, cleanup_grace=cleanup_grace, notes=host.notes)
        # Write-ahead: a rule update is durable before the engine applies it.
        engine.on_updates_applied = _RecordUpdates(host, queue)
        nursery_cm = trio.open_nursery()
        nursery = await nursery_cm.__aenter__()  # no checkpoint since the journal's block was entered
        self._nursery_cm, self._nursery = nursery_cm, nursery
        if isinstance(journal_cm, _JournalBlock):
            # What a lost lease cancels: the nursery holds all the session runs, and the body.
            journal_cm.use_body_nursery(nursery)
        # A session's own copy of the definitions (none defined: one empty mapping for all).
        definitions = dict(spec.definitions) if spec.definitions else _NO_DEFINITIONS
        supervisor = SubagentSupervisor(host, definitions, nursery, persistence=spec.subagent_persistence)
        session = Session(host=host, queue=queue, supervisor=supervisor, nursery=nursery, close_timeout=close_timeout)
        task_tools = spec.task_tools
        if task_tools is not None:
            task_tools.route(session_key, supervisor)
            self._routed = (task_tools, session_key)
        queue.serve_in(nursery, host)
        self._session = session
        await session._start(spec.parts.tools, seed, keep_requests=unfinished == "keep")
        return session

    async def _leave(self, exc: BaseException | None) -> None:
        """Leave what `_enter` entered, innermost first, as these nested blocks would with *exc*
        coming out of the innermost (the body, or a failed start)::

            async with provider:                  # _provider_cm
                async with journal:               # _journal_cm
                    try:
                        async with nursery:       # _nursery_cm
                            try: <the body>
                            finally: close the session, then cancel what still runs
                    finally: unroute the task tools

        Raises what comes out of the outermost; returns if nothing does.
        """
        try:
            try:
                try:
                    try:
                        try:
                            if exc is not None:
                                raise exc
                        finally:
                            session = self._session
                            if session is not None:
                                await session._close(
                                    SessionCloseReason.ERROR if exc is not None else SessionCloseReason.COMPLETED,
                                    # A journal given open is its owner's to close.
                                    journal_closes=not isinstance(self._journal_cm, (_Given, type(None))),
                                )
                            # What still runs (the heartbeat at least, on an expiring store) stops;
                            # a nursery with no task to wait for is left uncancelled.
                            nursery = self._nursery
                            if nursery is not None and nursery.child_tasks:
                                nursery.cancel_scope.cancel()
                                if session is not None:
                                    _report_stuck_tools(session)
                    except BaseException as error:
                        if self._nursery_cm is None or not await self._nursery_cm.__aexit__(
                            type(error), error, error.__traceback__
                        ):
                            raise
                    else:
                        if self._nursery_cm is not None:
                            await self._nursery_cm.__aexit__(None, None, None)
                finally:
                    routed = self._routed
                    if routed is not None:
                        routed[0].unroute(routed[1])
            except BaseException as error:
                if self._journal_cm is None or not await self._journal_cm.__aexit__(
                    type(error), error, error.__traceback__
                ):
                    raise
            else:
                if self._journal_cm is not None:
                    await self._journal_cm.__aexit__(None, None, None)
        except BaseException as error:
            if self._provider_cm is None or not await self._provider_cm.__aexit__(
                type(error), error, error.__traceback__
            ):
                raise
        else:
            if self._provider_cm is not None:
                await self._provider_cm.__aexit__(None, None, None)


def _report_stuck_tools(session: Session) -> None:
    """The block's exit waits for every task of the session: say so when a tool that ignores its
    cancellation past its cleanup grace holds it (its start was logged when its grace ran out)."""
    stuck = session.pipeline.overrunning_calls()
    if stuck:
        _log.warning(
            "leaving the session %s waits for %s, which ignored its cancellation past cleanup_grace; "
            "the block exits when it ends",
            session.session_id,
            ", ".join(stuck),
        )


def _raise_at_boundary(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """A public boundary never raises a group (called while *group* is handled). The body's own
    error (even a user's exception group) comes out unchanged; a failure of the session's tasks
    comes out as one typed error; a cancellation from outside comes out as one `trio.Cancelled`."""
    if len(group.exceptions) == 1:
        only = group.exceptions[0]
        if not isinstance(only, BaseExceptionGroup) or (typed_error(only) is None and not contains_cancelled(only)):
            raise only  # no `from`: it would overwrite the error's own cause
    single = unwrap_for_boundary(group)
    if single is group:
        raise  # the group being handled, unchanged
    raise single from None


# The agent options `open_session` takes for `define_agent`, in its order, and each one's default
# (`provider` has none in define_agent).
_AGENT_OPTIONS: tuple[str, ...] = tuple(inspect.signature(define_agent).parameters)
_AGENT_DEFAULTS: tuple[Any, ...] = tuple(
    None if name == "provider" else parameter.default
    for name, parameter in inspect.signature(define_agent).parameters.items()
)


def _journal(
    journal: JournalOption,
    session_id: str | None,
    lease_ttl: float,
    takeover_timeout: float,
    cleanup_grace: float,
    durable_pure_starts: bool,
) -> AbstractAsyncContextManager[DurableJournal]:
    """The session's journal: the given one (its owner closes it), or one the block opens and closes."""
    if isinstance(journal, DurableJournal):
        if journal.closed:
            raise ConfigError("the given DurableJournal is closed")
        return _Given(journal)
    if isinstance(journal, (str, os.PathLike)):
        return _sqlite_journal(
            os.fspath(journal), session_id, lease_ttl, takeover_timeout, cleanup_grace, durable_pure_starts
        )
    block = open_journal(
        MemoryStore() if journal is None else journal,
        session_id=session_id,
        lease_ttl=lease_ttl,
        takeover_timeout=takeover_timeout,
        commit_grace=cleanup_grace,
        durable_pure_starts=durable_pure_starts,
    )
    # The session's nursery is the body's scope (`_SessionBlock._enter`): one scope fewer per session.
    return cast("_JournalBlock", block).lend_body()


@asynccontextmanager
async def _sqlite_journal(
    path: str,
    session_id: str | None,
    lease_ttl: float,
    takeover_timeout: float,
    cleanup_grace: float,
    durable_pure_starts: bool,
) -> AsyncIterator[DurableJournal]:
    # One store per file and Trio run, shared by every session that names it.
    async with (
        shared_sqlite_store(path, cleanup_grace=cleanup_grace) as store,
        open_journal(
            store,
            session_id=session_id,
            lease_ttl=lease_ttl,
            takeover_timeout=takeover_timeout,
            commit_grace=cleanup_grace,
            durable_pure_starts=durable_pure_starts,
        ) as durable,
    ):
        yield durable


def _check_journal_option(journal: JournalOption) -> JournalOption:
    """*journal* checked (a `ConfigError` before anything opens); a file path as the str SQLite opens."""
    if journal is None or isinstance(journal, DurableJournal):
        return journal
    if isinstance(journal, (str, os.PathLike)):
        from .._journal._sqlite import sqlite_path  # the driver loads when a SQLite journal is asked for

        # A NUL character or an __fspath__ giving bytes was a raw ValueError / TypeError on opening.
        return sqlite_path(journal, "journal")
    if not is_journal_store(journal):
        raise ConfigError(
            "journal must be a DurableJournal, a JournalStore, a SQLite file path or None, "
            f"not {type(journal).__name__} {safe_repr(journal)}"
        )
    return journal


def _provider(spec: AgentSpec) -> tuple[AbstractAsyncContextManager[Provider], Provider | None]:
    """The block that holds the spec's provider, and the provider if given (else the block makes
    it when entered): one named by string is created then and closed with the session; a given
    one is left open (`_LEFT_OPEN`: shared, no object of its own kept per session)."""
    provider, model = spec.provider, spec.model
    if isinstance(provider, str):
        return _named_provider(provider, model or ""), None
    return _LEFT_OPEN, provider.with_model(model) if model and model != provider.model else provider


class _Given(Generic[_T]):
    """``async with`` of something the caller owns: enters as it, leaves it open (`contextlib.nullcontext`
    without an instance dict: a session keeps one as long as it lives)."""

    __slots__ = ("_value",)

    def __init__(self, value: _T) -> None:
        self._value = value

    async def __aenter__(self) -> _T:
        return self._value

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


_LEFT_OPEN: _Given[Any] = _Given(None)
"""The provider's block when the caller gave it: leaving it leaves the provider open."""


@asynccontextmanager
async def _named_provider(name: str, model: str) -> AsyncIterator[Provider]:
    from .._models._providers import create_provider  # providers import optional HTTP clients

    created: Any = create_provider(name, model)
    if hasattr(created, "__aenter__"):
        async with created:
            yield created
    else:
        yield created


class _RecordUpdates:
    """Record accepted rule updates on the root stream (replayed into the engine on reopen).

    Holds the host's parts, not the host: the host holds the engine that holds this, and a
    cycle would leave a closed session to the cyclic GC.
    """

    __slots__ = ("call_origins", "journal", "queue")

    def __init__(self, host: SessionHost, queue: RequestQueue) -> None:
        self.journal = host.journal
        self.call_origins = host.call_origins
        self.queue = queue

    async def __call__(self, updates: Sequence[PermissionUpdate], *, source: str, call_id: str | None) -> None:
        origin = self.call_origins.get(call_id) if call_id is not None else None
        current = self.queue.current
        request_id = origin if origin is not None else (current.request_id if current is not None else "session")
        kind = source if source in PERMISSION_UPDATE_SOURCES else "permission_engine"
        await self.journal.append(
            *(
                PermissionUpdated(request_id=request_id, source=kind, update=update_to_json(update), call_id=call_id)
                for update in updates
            )
        )
