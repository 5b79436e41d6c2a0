"""`open_session`: a session of an `AgentSpec` (or of keyword options, which build one).

Order, each step depending only on the ones before it: the journal (opened here,
or given: then the caller keeps it), the provider (a name is created and closed
here), the model service, the permission engine (recording into the journal),
the tool pipeline, the host, the nursery, the subagent supervisor, the request
queue, the `Session`. Nothing is bound late.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal

import trio

from .._cleanup import DEFAULT_CLEANUP_GRACE, validate_cleanup_grace
from .._config import validate_id, validate_timeout
from .._errors import ConfigError, require_trio
from .._groups import contains_cancelled, typed_error, unwrap_for_boundary
from .._journal._durable import DurableJournal, open_journal
from .._journal._events import PERMISSION_UPDATE_SOURCES, PermissionUpdated, SessionCloseReason
from .._journal._memory import MemoryStore
from .._journal._registry import shared_sqlite_store
from .._journal._store import JournalStore
from .._lifecycle._capabilities import validate_capabilities
from .._lifecycle._middleware import ChatMiddleware
from .._loop._interrupts import ClientTool, InterruptDefinition
from .._models._history import validate_history
from .._models._messages import Message
from .._models._service import ModelService, Provider, RetryPolicy
from .._permissions._engine import PermissionHandler, UpdatesApplied
from .._permissions._rules import PermissionMode, PermissionRules, PermissionUpdate, ToolFilter, update_to_json
from .._tools._definition import Tool
from .._tools._pipeline import ToolPipeline
from .._tools._scheduler import SchedulerLimits, ToolScheduler
from .._tools._stages import StageDecision
from ._hooks import HookCallback, HookEvent
from ._host import SessionHost
from ._plugins import MiddlewareConfig, Plugin
from ._requests import RequestQueue, _Agent
from ._session import Session
from ._spec import AgentSpec, PermissionAsks, define_agent
from ._subagents import SubagentDefinition, SubagentSupervisor
from ._wiring import journal_permissions, permission_engine, session_stages

__all__ = ["open_session"]

JournalOption = DurableJournal | JournalStore | str | os.PathLike[str] | None


@asynccontextmanager
async def open_session(
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
) -> AsyncIterator[Session]:
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
    require_trio("open_session()")
    options: dict[str, Any] = {
        "provider": provider,
        "model": model,
        "system_prompt": system_prompt,
        "tools": tools,
        "plugins": plugins,
        "middleware": middleware,
        "lifecycle": lifecycle,
        "hooks": hooks,
        "allowed_tools": allowed_tools,
        "disallowed_tools": disallowed_tools,
        "permissions": permissions,
        "permission_mode": permission_mode,
        "permission_handler": permission_handler,
        "max_turns": max_turns,
        "subagents": subagents,
        "workspace_roots": workspace_roots,
        "hook_deadlines": hook_deadlines,
        "retry": retry,
        "scheduler_limits": scheduler_limits,
        "model_request_timeout": model_request_timeout,
        "tool_timeout": tool_timeout,
        "permission_asks": permission_asks,
        "interrupts": interrupts,
    }
    if spec is None:
        if provider is None:
            raise ConfigError("open_session needs an AgentSpec (define_agent) or provider=")
        spec = define_agent(**options)
    elif not isinstance(spec, AgentSpec):
        raise ConfigError(f"open_session takes an AgentSpec (define_agent(...)), not {spec!r}")
    else:
        given = sorted(name for name, value in options.items() if value != _DEFAULTS[name])
        if given:
            raise ConfigError(f"agent options {given} belong to define_agent; pass them there, not with a spec")
    cleanup_grace = validate_cleanup_grace(cleanup_grace)
    close_timeout = validate_timeout(close_timeout, name="close_timeout")
    seed = None if history is None else validate_history(history)
    if session_id is not None:
        validate_id(session_id, name="session_id")
    if isinstance(journal, DurableJournal) and session_id not in (None, journal.session_id):
        raise ConfigError(f"session_id {session_id!r} differs from the given journal's {journal.session_id!r}")
    if unfinished not in ("interrupt", "keep"):
        raise ConfigError(f"unfinished must be 'interrupt' or 'keep', not {unfinished!r}")
    if not isinstance(durable_pure_starts, bool):
        raise ConfigError(f"durable_pure_starts must be True or False, not {durable_pure_starts!r}")
    if isinstance(journal, DurableJournal) and durable_pure_starts != journal.durable_pure_starts:
        raise ConfigError("durable_pure_starts belongs to open_journal for a journal given open")
    try:
        async with AsyncExitStack() as stack:
            provider_obj = await _provider(stack, spec)  # a missing API key fails before any journal opens
            validate_capabilities(spec.middleware, provider_obj)  # the adapter's requires too
            durable = await _journal(
                stack, journal, session_id, lease_ttl, takeover_timeout, cleanup_grace, durable_pure_starts
            )
            service = ModelService(
                provider_obj,
                spec.parts.model_middleware,
                retry=spec.retry,
                request_timeout=spec.model_request_timeout,
                cleanup_grace=cleanup_grace,
            )
            root = _Agent(
                agent_id=durable.root_agent_id,
                name="root",
                system_prompt=spec.system_prompt,
                allowed=spec.parts.allowed,
                max_turns=spec.max_turns,
            )
            agents = {root.agent_id: root}  # the host's live registry of agents that make calls

            def agent_filter(agent_id: str) -> ToolFilter:
                # Every agent's calls are checked against its own allowlist (subagents included).
                agent = agents.get(agent_id)
                return ToolFilter(allowed=None if agent is None else sorted(agent.allowed))

            engine = permission_engine(spec.parts, record=journal_permissions(durable), agent_filter=agent_filter)
            # What a person answered by resuming a paused request, per call, for the permission stage.
            decided: dict[tuple[str, str], StageDecision] = {}
            pipeline = ToolPipeline(
                spec.parts.tools.values(),
                middleware=spec.parts.tool_middleware,
                journal=durable,
                scheduler=ToolScheduler(spec.scheduler_limits),
                stages=session_stages(spec.parts, engine, decided),
                timeout=spec.tool_timeout,
                workspace=spec.parts.workspace,
                unwind_grace=spec.unwind_grace,
                settle_grace=cleanup_grace,
                history_limit=0,  # the journal is the session's record of its calls
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
            )
            queue = RequestQueue(durable, root, max_queued=64, cleanup_grace=cleanup_grace)
            # Write-ahead: a rule update is durable before the engine applies it.
            engine.on_updates_applied = _permission_journal(host, queue)
            close_reason = SessionCloseReason.COMPLETED
            async with trio.open_nursery() as nursery:
                supervisor = SubagentSupervisor(
                    host, dict(spec.definitions), nursery, persistence=spec.subagent_persistence
                )
                session = Session(
                    host=host, queue=queue, supervisor=supervisor, nursery=nursery, close_timeout=close_timeout
                )
                if spec.task_tools is not None:
                    stack.enter_context(spec.task_tools.serving(durable.session_id, supervisor))
                queue.serve_in(nursery, host.run_request)
                try:
                    await session._start(spec.parts.tools, seed, keep_requests=unfinished == "keep")
                    yield session
                except BaseException:
                    close_reason = SessionCloseReason.ERROR
                    raise
                finally:
                    await session._close(close_reason)
                    nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # A public boundary never raises a group. The body's own error (even a user's exception
        # group) comes out unchanged; a failure of the session's tasks comes out as one typed
        # error; a cancellation from outside comes out as one `trio.Cancelled`.
        if len(group.exceptions) == 1:
            only = group.exceptions[0]
            if not isinstance(only, BaseExceptionGroup) or (typed_error(only) is None and not contains_cancelled(only)):
                raise only  # noqa: B904 - `from` would overwrite the error's own cause
        single = unwrap_for_boundary(group)
        if single is group:
            raise
        raise single from None


# What each agent option is when not given (`provider` has none in define_agent).
_DEFAULTS: dict[str, Any] = {
    **{name: parameter.default for name, parameter in inspect.signature(define_agent).parameters.items()},
    "provider": None,
}


async def _journal(
    stack: AsyncExitStack,
    journal: JournalOption,
    session_id: str | None,
    lease_ttl: float,
    takeover_timeout: float,
    cleanup_grace: float,
    durable_pure_starts: bool,
) -> DurableJournal:
    """The session's journal: the given one (its owner closes it), or one opened on *stack*."""
    if isinstance(journal, DurableJournal):
        if journal.closed:
            raise ConfigError("the given DurableJournal is closed")
        return journal
    if journal is None:
        store: JournalStore = MemoryStore()
    elif isinstance(journal, (str, os.PathLike)):
        # One store per file and Trio run, shared by every session that names it.
        store = await stack.enter_async_context(shared_sqlite_store(os.fspath(journal), cleanup_grace=cleanup_grace))
    else:
        store = journal
    return await stack.enter_async_context(
        open_journal(
            store,
            session_id=session_id,
            lease_ttl=lease_ttl,
            takeover_timeout=takeover_timeout,
            commit_grace=cleanup_grace,
            durable_pure_starts=durable_pure_starts,
        )
    )


async def _provider(stack: AsyncExitStack, spec: AgentSpec) -> Provider:
    """The spec's provider: one named by string is created here and closed with the session."""
    provider, model = spec.provider, spec.model
    if isinstance(provider, str):
        from .._models._providers import create_provider  # providers import optional HTTP clients

        created: Any = create_provider(provider, model or "")
        if hasattr(created, "__aenter__"):
            await stack.enter_async_context(created)
        result: Provider = created
        return result
    return provider.with_model(model) if model and model != provider.model else provider


def _permission_journal(host: SessionHost, queue: RequestQueue) -> UpdatesApplied:
    """Record accepted rule updates on the root stream (replayed into the engine on reopen).

    The recorder holds the host's parts, not the host: the host holds the engine that holds
    the recorder, and a cycle would leave a closed session to the cyclic GC.
    """
    journal, call_origins = host.journal, host.call_origins

    async def record(updates: Sequence[PermissionUpdate], *, source: str, call_id: str | None) -> None:
        origin = call_origins.get(call_id) if call_id is not None else None
        current = queue.current
        request_id = origin if origin is not None else (current.request_id if current is not None else "session")
        kind = source if source in PERMISSION_UPDATE_SOURCES else "permission_engine"
        await journal.append(
            *(
                PermissionUpdated(request_id=request_id, source=kind, update=update_to_json(update), call_id=call_id)
                for update in updates
            )
        )

    return record
