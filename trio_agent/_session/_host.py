"""A session as a host of the one agent loop: what its runs share, and one request as one run.

The loop (`trio_agent._loop`) knows nothing of sessions. `SessionHost` holds what
every run of a session shares (journal, model services, tool pipeline, the agents,
their inboxes, the composed lifecycle) and runs one request of one agent as one
loop run, handing it:

* a `RunSpec` built from the agent (instructions read at every model call, the
  offered tools, the allowlist, ``max_turns`` as the strategy);
* `RunPorts`: the agent's history as the conversation, the request's joined
  messages and the session's background reports as the inbox, the journal as the
  recorder, the request's event sink (run events mapped to session events), the
  session's effect handling, the request's abort and stop handles; for a root
  request, whether anything reads its events (``listening``: none are built while
  nothing does, and what the session keeps of a run does not depend on them);
* the lifecycle composed once per agent spec: `SESSION_HOOKS` (the Stop /
  SubagentStop hook events as ``before_stop``; the outermost ``wrap_events``, so
  the session keeps a run's events as the loop emitted them whatever ``on_chunk``
  does) first, then the chat middleware.
  It serves every run of every session of the spec, so what is per run reaches
  the hooks through the `RunContext`: ``ctx.metadata`` holds ``session_id``,
  ``agent_id``, ``agent_name``, ``parent_agent_id`` and ``request_id``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from .._abort import AbortHandle
from .._cleanup import bounded_shield
from .._errors import ConfigError, JournalError, LeaseLostError, SessionPausedError
from .._journal._durable import DurableJournal
from .._journal._events import InboxNoted, PromptSubmitted, RunPaused, request_completed, request_started
from .._journal._run_recorder import JournalRecorder
from .._lifecycle._approvals import PermissionGate
from .._lifecycle._interrupts import PausedRun, pause_from_json, pause_to_json
from .._loop._context import RunContext
from .._loop._events import (
    RunEvent,
    StepStarted,
    TextMessageContent,
    TextMessageEnd,
    TextMessageStart,
    ToolCallEnd,
    ToolCallProgress,
    ToolCallResult,
    UsageReported,
)
from .._loop._hooks import Lifecycle
from .._loop._interrupts import ClientTool, InterruptDefinition, InterruptKind
from .._loop._ports import RunEventSink, RunPorts, RunSpec
from .._loop._rules import LoopState, StopReason, first_text
from .._loop._run import run_agent_loop
from .._models._history import MessageView
from .._models._messages import AssistantMessage, Message, ToolCallPart, ToolSpec, UserMessage
from .._models._service import ModelService
from .._permissions._engine import PermissionEngine
from .._permissions._rules import PermissionUpdate
from .._tools._definition import Tool
from .._tools._pipeline import ToolPipeline
from .._tools._results import Effect
from .._tools._stages import StageDecision
from ._endings import answer_unanswered_calls
from ._hooks import HookAction, HookDecision, HookEvent, HookInput, HookRunner
from ._messages import (
    DoneEvent,
    PermissionDeniedEvent,
    TextDeltaEvent,
    ToolProgressEvent,
    ToolResultEvent,
    ToolUseEvent,
    UsageEvent,
)
from ._requests import RunParts, _Agent, _Request, drain_holds, record_interrupted, record_raised
from ._stream import discard

__all__ = ["SESSION_HOOKS", "AgentConversation", "RequestInbox", "SessionHooks", "SessionHost"]

_log = logging.getLogger("trio_agent.session")
_NOTHING_RAN = {event: HookDecision(event) for event in HookEvent}  # a dispatch with no hook registered

_RUN = "trio_agent.session.run"  # ctx.metadata key of the `_RunInfo` (private to this module)
_NONE: Mapping[str, Any] = MappingProxyType({})  # no interrupts / client tools: one for every session


class _RunInfo:
    """What the session's own hooks need of one run."""

    __slots__ = ("agent", "events", "host", "request")

    def __init__(self, host: SessionHost, agent: _Agent, request: _Request, events: _RunEvents) -> None:
        self.host = host
        self.agent = agent
        self.request = request
        self.events = events


class SessionHost:
    """What every run of one session shares, and `run_request`: one request as one loop run."""

    # Slotted, as every object an idle session keeps (thousands may be alive).
    __slots__ = (
        "_paused",
        "_service",
        "_services",
        "agents",
        "asks_by_pausing",
        "call_origins",
        "cleanup_grace",
        "client_tools",
        "closing",
        "context",
        "decided",
        "hooks",
        "inbox",
        "interrupts",
        "journal",
        "lifecycle",
        "notes",
        "permissions",
        "pipeline",
        "root",
        "running",
        "session_id",
        "tool_specs",
        "tracks_running",
    )

    def __init__(
        self,
        *,
        journal: DurableJournal,
        service: ModelService,
        pipeline: ToolPipeline,
        root: _Agent,
        hooks: HookRunner,
        lifecycle: Lifecycle,
        permissions: PermissionEngine | None,
        cleanup_grace: float,
        agents: dict[str, _Agent] | None = None,
        interrupts: Mapping[str, InterruptDefinition] | None = None,
        client_tools: Mapping[str, ClientTool] | None = None,
        decided: dict[tuple[str, str], StageDecision] | None = None,
        asks_by_pausing: bool = False,
        tracks_running: bool = True,
        tool_specs: dict[str, tuple[Tool[Any], ToolSpec]] | None = None,
    ) -> None:
        self.journal = journal
        self.session_id = journal.session_id
        self.pipeline = pipeline
        self.root = root
        self.hooks = hooks
        self.lifecycle = lifecycle
        self.permissions = permissions
        self.cleanup_grace = cleanup_grace
        # The agents that make calls now (the permission engine checks each against its allowlist).
        self.agents: dict[str, _Agent] = agents if agents is not None else {root.agent_id: root}
        self.inbox: dict[str, list[str]] = {}  # per agent: reports and effects for its next turn
        # Shared with the request queue, which must not hold the host (`InboxNotes`).
        self.notes = InboxNotes(self.inbox, journal, root.agent_id)
        self.context: list[str] = []  # SessionStart hooks' additional context, for every model call
        # (agent id, request id) -> running request, for the task tool's foreground subagents (the
        # only reader): kept only when the session has subagents (`tracks_running`).
        self.running: dict[tuple[str, str], _Request] = {}
        self.tracks_running = tracks_running
        # Tool call id -> its request id, for whom a call's permission updates are recorded: set when
        # the loop emits the call, kept until its request ends (`run_request`).
        self.call_origins: dict[str, str] = {}
        self.closing = False
        # Pauses (docs/human-in-the-loop.md): the root agent's questions, and where it waits.
        self.interrupts: Mapping[str, InterruptDefinition] = interrupts or _NONE
        self.client_tools: Mapping[str, ClientTool] = client_tools or _NONE
        # What a person answered for a call (by resuming a pause), for the permission stage, once.
        self.decided: dict[tuple[str, str], StageDecision] = {} if decided is None else decided
        self.asks_by_pausing = asks_by_pausing  # permission_asks="interrupt"
        self.tool_specs = tool_specs  # shared by the sessions of a spec (`AgentParts.tool_specs`)
        self._paused: PausedRun | None = None  # the last pause read from the journal (decoded once)
        self._service = service
        # By model name, made when another model is first asked for (`_named`).
        self._services: dict[str, ModelService] | None = None

    @property
    def paused(self) -> PausedRun | None:
        """The root agent's request that waits for answers, as the journal tells it (so an error or
        a cancellation after ``interrupts_resolved`` can never leave the session stuck paused)."""
        pause = self.journal.projection(self.root.agent_id).pause()
        if pause is None:
            return None
        request_id, where = pause
        cached = self._paused
        if cached is None or cached.run_id != request_id:
            cached = self._paused = PausedRun(request_id, self.session_id, self.root.agent_id, pause_from_json(where))
        return cached

    # -- models

    @property
    def service(self) -> ModelService:
        return self._service

    def set_model(self, name: str, current: _Request | None = None) -> None:
        """Use model *name* from the next model call on: also in the runs going on now (*current*,
        the root's request, and the running subagents' requests) of agents with no model of their own."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"model name must be a non-empty string, not {name!r}")
        service = self._service = self._named(name)
        # The loop reads its ports' model at each model call.
        for request in (current, *self.running.values()):
            ports = request.ports if request is not None else None
            if ports is not None and request is not None and request.agent.model is None:
                ports.model = service

    def service_for(self, agent: _Agent) -> ModelService:
        if agent.model is None:
            return self._service
        return self._named(agent.model)

    def _named(self, name: str) -> ModelService:
        """The service of model *name* (one per name: the session's own first, then ones derived from
        the current one; all with the same middleware stack)."""
        services = self._services
        if services is None:
            first = self._service
            services = self._services = {first.model: first}
        service = services.get(name)
        if service is None:
            service = services[name] = self._service.with_model(name)
        return service

    # -- shared helpers

    def cleanup_scope(self, layer: str = "recording a session outcome") -> bounded_shield:
        """A shield for recording what was already decided, bounded (``cleanup_grace``) so a dead
        store cannot hang us; an overrun is logged."""
        return bounded_shield(self.cleanup_grace, layer)

    async def dispatch(
        self, event: HookEvent, agent_id: str, *, abort: AbortHandle | None = None, **fields: Any
    ) -> HookDecision:
        """Dispatch one session hook event (session hooks first, then plugin hooks)."""
        if not self.hooks.has_hooks(event):
            return _NOTHING_RAN[event]  # as the runner's: no input built, no checkpoint
        return await self.hooks.dispatch(
            event, HookInput(event=event, session_id=self.session_id, agent_id=agent_id, **fields), abort=abort
        )

    async def apply_effect(self, agent: _Agent, effect: Effect, call_id: str, request_id: str | None = None) -> None:
        """Apply what a settled tool asked of the session.

        ``new_messages`` (a string or a list of strings) reach the agent's model at
        its next turn (the root's are journalled first, `note`: a reopen still tells them);
        ``permission_updates`` (`PermissionUpdate` s, accepted only from
        the tool itself: the pipeline drops them from middleware) change the session's
        permission rules, journalled first (an effect with a ``set_mode`` is ignored whole:
        a tool does not change the mode). Other kinds are logged and ignored.
        """
        kind, payload = effect.kind, effect.payload
        if kind in ("new_messages", "permission_updates") and not (
            payload is None
            or isinstance(payload, (str, PermissionUpdate))
            or (isinstance(payload, Iterable) and not isinstance(payload, (bytes, Mapping)))
        ):
            # A tool's mistake, as a wrong item is: it may fail this effect, never the request.
            error = ConfigError(f"a {kind} effect's payload must be one item or a list of them, got {payload!r:.200}")
            _log.warning("ignored a %s effect from call %s: %s", kind, call_id, error)
            return
        if kind == "new_messages":
            messages = [payload] if isinstance(payload, str) else list(payload or [])
            # Durable before the call's answer is published: the call settled (its result is
            # durable, so a restart replays it and never runs the tool again), and only this
            # write keeps what it asked the model to be told.
            await self.note(agent.agent_id, [str(message) for message in messages], request_id=request_id)
        elif kind == "permission_updates" and self.permissions is not None:
            updates = [payload] if isinstance(payload, PermissionUpdate) else list(payload or [])
            if any(isinstance(update, PermissionUpdate) and update.mode is not None for update in updates):
                # A tool changes rules, never the mode: leaving plan would lift the hard limit that no
                # rule, approval or answer can lift, and only a person (an answer) may do that.
                _log.warning(
                    "ignored a permission_updates effect from call %s: a tool may change the session's "
                    "rules, not its permission mode (set_mode)",
                    call_id,
                )
                return
            try:
                await self.permissions.accept_updates(updates, source="tool", call_id=call_id)
            except ConfigError as exc:
                _log.warning("ignored a permission_updates effect: %s", exc)
        else:
            _log.warning("ignored an effect of unknown kind %r from agent %s", kind, agent.agent_id)

    # -- the inbox

    async def note(
        self, agent_id: str, messages: Sequence[str], *, request_id: str | None = None, subagent_id: str | None = None
    ) -> None:
        """Put *messages* in *agent_id*'s inbox (its next model call takes them) and, for the root
        agent, journal them (`InboxNoted`), returning once that is durable.

        For what the journal cannot tell again once its producer's own record is durable (a
        settled call's effect, a subagent's report after its request completed). The note is
        in the inbox and in the journal's stream before the first checkpoint: a cancellation
        while the write is confirmed leaves it noted once (the journal confirms the write or is
        fenced). A subagent's notes are not journalled: a subagent never runs after a reopen.
        """
        event = self._noted(agent_id, messages, request_id, subagent_id)
        if event is not None:
            await self.journal.append(event, agent_id=agent_id)

    def note_later(self, agent_id: str, messages: Sequence[str], *, request_id: str | None = None) -> None:
        """`note`, journalled with the stream's next write (`DurableJournal.defer`): for messages
        that joined a request that ended before a turn took them (`InboxNotes.note_later`)."""
        self.notes.note_later(agent_id, messages, request_id=request_id)

    def _noted(
        self, agent_id: str, messages: Sequence[str], request_id: str | None, subagent_id: str | None
    ) -> InboxNoted | None:
        """*messages* in the inbox now; the event that journals them (the root's only), or ``None``."""
        return noted(self.inbox, self.root.agent_id, agent_id, messages, request_id, subagent_id)

    def keep_pending(self, request: _Request) -> None:
        """No message that joined may be lost: *request* takes no more (``accepting`` false),
        and what is pending reaches its agent's next model call (`note_later`)."""
        request.accepting = False
        if request.pending:
            pending = list(request.pending)
            request.pending.clear()
            self.note_later(request.agent.agent_id, pending, request_id=request.request_id)

    # -- one request

    async def run_request(self, request: _Request) -> None:
        """One request on one agent's stream: started -> turns -> completed | failed | interrupted."""
        agent = request.agent
        journal = self.journal
        key = (agent.agent_id, request.request_id)
        if self.tracks_running:
            self.running[key] = request
        completed = False
        try:
            if request.resume is None and agent.parent_id is None and self.paused is not None:
                # Queued before (or while) the session paused: it must not run on top of the pause.
                raise SessionPausedError(
                    f"session {self.session_id!r} is paused waiting for answers: this request was not run; "
                    "answer with session.resume([...]) and send it again"
                )
            if not request.continuing:
                # Deferred: a crash before the next write leaves it accepted, which recovery treats alike.
                journal.defer(request_started(request.request_id), agent_id=agent.agent_id)
            request.mark_started()
            prompt = request.prompt
            extra: str | None = None
            if request.resume is not None or request.continuing:
                pass  # a continuation (its prompt is the answers), or a request already past its prompt
            elif agent.parent_id is None and self.hooks.has_hooks(HookEvent.USER_PROMPT_SUBMIT):
                # (With none registered the prompt joins as accepted: what a dispatch with no hook decides.)
                try:
                    decision = await self.dispatch(
                        HookEvent.USER_PROMPT_SUBMIT, agent.agent_id, prompt=prompt, abort=request.abort
                    )
                    decision.raise_for_abort()
                except BaseException:
                    # Refused, failed, timed out or interrupted: the prompt never joins. Said in the
                    # request's terminal batch (deferred), as a skip says it, or the history rebuilt
                    # from the journal would hold the accepted prompt this one never sent.
                    with contextlib.suppress(JournalError, LeaseLostError):  # nothing more is written
                        journal.defer(PromptSubmitted(request_id=request.request_id), agent_id=agent.agent_id)
                    raise
                if decision.action is HookAction.SKIP:
                    # The prompt never reaches the model; the request ends without a model call.
                    request.text = ""
                    request.stop_reason = StopReason.SKIPPED
                    await drain_holds(request)
                    await journal.append(
                        PromptSubmitted(request_id=request.request_id),  # the prompt never joined
                        request_completed(request.request_id, {"skipped": decision.reason or ""}),
                        agent_id=agent.agent_id,
                    )
                    completed = True
                    await request.sink(DoneEvent(request.request_id, "", StopReason.SKIPPED, 0))
                    return
                if decision.prompt is not None:  # never blank: `_checked` refuses that (HookReturnError)
                    prompt = decision.prompt
                extra = decision.context_text
                if prompt != request.prompt or extra:
                    # What joins the conversation is not the accepted prompt: journal it, so a
                    # history rebuilt from the journal reads as this one does.
                    joined = (prompt, extra) if extra else (prompt,)
                    await journal.append(
                        PromptSubmitted(request_id=request.request_id, messages=joined), agent_id=agent.agent_id
                    )
            if request.resume is None and not request.continuing:
                agent.history.append(UserMessage(prompt))
            if extra:
                agent.history.append(UserMessage(extra))
            conversation = AgentConversation(agent, request)
            events = _RunEvents(self, agent, request)
            ports = request.ports = self._ports(agent, request, conversation, events)
            outcome = await run_agent_loop(
                self._spec(agent, request),
                ports,
                self.lifecycle,
                ctx=self._context(agent, request, events, conversation.snapshot),
                resume=request.resume,
            )
            request.text = outcome.text or request.text
            if outcome.pause is not None:
                # Ended paused: durable before anyone is told, so a restart finds the questions.
                request.stop_reason = StopReason.INTERRUPTED
                await journal.append(
                    RunPaused(request_id=request.request_id, state=pause_to_json(outcome.pause, with_messages=False)),
                    agent_id=agent.agent_id,
                )
                completed = True
                request.paused = PausedRun(request.request_id, self.session_id, agent.agent_id, outcome.pause)
                if request.sink is not discard:
                    done = DoneEvent(request.request_id, request.text, request.stop_reason, request.turns)
                    await request.sink(attrs.evolve(done, interrupts=outcome.pause.interrupts))
            elif outcome.aborted:
                await record_interrupted(journal, request, self.cleanup_grace)
            else:
                request.stop_reason = outcome.stop_reason
                await drain_holds(request)
                await journal.append(
                    request_completed(request.request_id, {"text": request.text}),
                    agent_id=agent.agent_id,
                )
                completed = True
                if request.sink is not discard:
                    await request.sink(DoneEvent(request.request_id, request.text, request.stop_reason, request.turns))
        except BaseException as exc:
            # What joined and was not taken is noted before the end is written, which carries it.
            self.keep_pending(request)
            if not await record_raised(journal, request, exc, self.cleanup_grace):
                raise
        finally:
            gate = request.ports.gate if request.ports is not None else None
            if isinstance(gate, PermissionGate):
                gate.release()  # what the run's gate decided ends with the run
            request.ports = None  # no request <-> ports cycle left for the garbage collector
            origins = self.call_origins
            if origins:
                # Its calls' origins end with it, however it ended (a cancelled call has no result).
                request_id = request.request_id
                for call_id in request.call_ids:
                    if origins.get(call_id) == request_id:  # another agent's call may share the id
                        del origins[call_id]
            if self.tracks_running:
                self.running.pop(key, None)
            # No message that joined may be lost: whatever is still pending reaches the next turn.
            request.accepting = False
            if request.pending:
                self.keep_pending(request)
            if not completed:
                # The next request must not send the model a tool call without its answer, except
                # the calls a paused request waits with (a failed continuation leaves it paused).
                paused = self.paused if agent.parent_id is None else None
                waiting = [part.id for part in paused.state.pending_calls] if paused is not None else []
                agent.history = answer_unanswered_calls(journal, agent.agent_id, agent.history, waiting)
            request.finish()

    def _spec(self, agent: _Agent, request: _Request) -> RunSpec:
        parts = agent.run_parts
        if parts is None:
            parts = agent.run_parts = self._run_parts(agent)
        instructions, offered, allowed, metadata = parts
        root = agent.parent_id is None
        return RunSpec(
            run_id=request.request_id,
            agent_id=agent.agent_id,
            thread_id=self.session_id,
            instructions=instructions,
            offered=offered,
            allowed=allowed,
            strategy=agent.strategy(),
            model_metadata=metadata,  # read-only: the loop copies it into each model call
            lineage=agent.lineage,
            session_id=self.session_id,
            client_tools=self.client_tools if root else {},
            interrupts=self.interrupts if root else {},
            can_pause=root,
            cleanup_grace=self.cleanup_grace,
            turns_before=request.turns_before,
        )

    def _run_parts(self, agent: _Agent) -> RunParts:
        """What every run of *agent* hands the loop alike: made at its first request (the offered
        tools, the allowlist and the instructions' parts never change during a session)."""
        tools = self.pipeline.tools
        offered = tuple(self._tool_spec(tools[name]) for name in sorted(agent.allowed) if name in tools)
        allowed: Collection[str] = agent.allowed
        client_tools = self.client_tools
        if agent.parent_id is None and client_tools:  # only the root agent's requests pause
            offered += tuple(ToolSpec(t.name, t.description, dict(t.input_schema)) for t in client_tools.values())
            allowed = agent.allowed | frozenset(client_tools)
        metadata = MappingProxyType({"session_id": self.session_id, "agent_id": agent.agent_id})
        return _Instructions(agent.system_prompt, self.context), offered, allowed, metadata

    def _tool_spec(self, tool: Tool[Any]) -> ToolSpec:
        """What the model is offered for *tool*: made once per tool of the spec (its schema is read
        only), again if the session's pipeline holds another tool of that name."""
        cache = self.tool_specs
        known = None if cache is None else cache.get(tool.name)
        if known is not None and known[0] is tool:
            return known[1]
        spec = ToolSpec(tool.name, tool.description, dict(tool.input_schema))
        if cache is not None:
            cache[tool.name] = (tool, spec)
        return spec

    def _context(
        self, agent: _Agent, request: _Request, events: _RunEvents, messages: Callable[[], Sequence[Message]]
    ) -> RunContext:
        return RunContext(
            run_id=request.request_id,
            thread_id=self.session_id,
            agent_id=agent.agent_id,
            abort=request.abort,
            events=events,
            messages=messages,
            request_id=request.request_id,
            metadata={
                "session_id": self.session_id,
                "agent_id": agent.agent_id,
                "agent_name": agent.name,
                "parent_agent_id": agent.parent_id,
                "request_id": request.request_id,
                _RUN: _RunInfo(self, agent, request, events),
            },
        )

    def _ports(self, agent: _Agent, request: _Request, conversation: AgentConversation, events: _RunEvents) -> RunPorts:
        # A root request tells the loop when anything reads its events (a stream, or one that joined):
        # none are built meanwhile, and what the session itself keeps of them is kept without them
        # (`_RunEvents`). A continuation, and every subagent run, hears all of them.
        quiet_while_unread = agent.parent_id is None and request.resume is None
        if quiet_while_unread:
            request.turn_counted = False
        return RunPorts(
            model=self.service_for(agent),
            tools=self.pipeline,
            conversation=conversation,
            inbox=RequestInbox(self, agent.agent_id, request, counts_turns=quiet_while_unread),
            recorder=JournalRecorder(self.journal, agent.agent_id),
            events=events,
            effects=events.effects,
            abort=request.abort,
            stop=request.stop if agent.parent_id is not None else None,  # only a subagent is told to stop
            gate=self._gate(agent, request),
            listening=request.listening if quiet_while_unread else None,
        )

    def _gate(self, agent: _Agent, request: _Request) -> PermissionGate | None:
        """With ``permission_asks="interrupt"``, the root agent's calls are screened before any runs
        and what a person must answer pauses the request; subagents ask the handler."""
        if agent.parent_id is not None or self.permissions is None:
            return None
        screens = self.asks_by_pausing
        if not screens:
            # "handler": every call asks the handler while it waits, in a continuation too. Only
            # approvals a pause already holds (asked by an earlier life with "interrupt") need a
            # gate, to conclude them; it screens no call.
            resume = request.resume
            if resume is None or not any(item.kind is InterruptKind.APPROVAL for item in resume.pause.interrupts):
                return None
        return PermissionGate(
            self.permissions,
            self.pipeline.tools,
            session_id=self.session_id,
            abort=request.abort,
            lineage=agent.lineage,
            decisions=self.decided,
            screens=screens,
        )


class _Instructions:
    """An agent's instructions, read at every model call: its system prompt, then the session's
    SessionStart context (which may grow). Holds no agent, so an agent may keep it."""

    __slots__ = ("context", "system_prompt")

    def __init__(self, system_prompt: str, context: list[str]) -> None:
        self.system_prompt = system_prompt
        self.context = context

    def __call__(self) -> str:
        context = self.context
        if not context:
            return self.system_prompt.strip()
        return "\n\n".join([self.system_prompt, *context]).strip()


class _RunEvents:
    """One request's run events: what the session keeps of them (its text, turns and calls), and
    the session events its readers get (one dict lookup per event).

    Session events are built only for a sink that reads them (`send()` discards them). What the
    session keeps of a run does not depend on hearing the events: a root request's loop builds
    none while nobody reads them (`_Request.listening`), so the text and the calls come from the
    replies the conversation takes (`AgentConversation`), and the turns from the inbox
    (`RequestInbox`) while nobody listens. Nor does it depend on what chat middleware lets
    through: when an ``on_chunk`` wraps the run's events, the session keeps them as the loop
    emitted them, outside every ``on_chunk`` (`SessionHooks.wrap_events`), and only its readers
    get what the hooks let through (`outside`).
    """

    __slots__ = ("agent", "agent_id", "call_origins", "handlers", "host", "observe", "request")

    def __init__(self, host: SessionHost, agent: _Agent, request: _Request) -> None:
        self.host = host
        self.agent = agent
        self.agent_id = agent.agent_id
        self.request = request
        self.call_origins = host.call_origins
        self.observe = request.observe
        self.handlers = _HANDLERS  # keeps and shows each event: nothing wraps them (`outside`)

    async def __call__(self, event: RunEvent) -> None:
        observe = self.observe
        if observe is not None:
            await observe(event)
        handler = self.handlers.get(type(event))
        if handler is not None:
            await handler(self, event)

    def outside(self, wrapped: RunEventSink) -> RunEventSink:
        """The run's events as the loop emits them, kept before *wrapped* (this sink wrapped by
        the hooks) passes them on; from now on this sink only shows what reaches it."""
        self.handlers = _SHOWN
        return _KeptEvents(self, wrapped)

    async def effects(self, agent_id: str, call_id: str, items: Sequence[Effect]) -> None:
        """Apply what a settled call asked of the session (the loop's own port: no hook sees it)."""
        for effect in items:
            await self.host.apply_effect(self.agent, effect, call_id, self.request.request_id)

    # -- what the session keeps (what the loop did)

    async def _text_start(self, event: Any) -> None:
        self.request.heard_text = []

    async def _text_heard(self, event: Any) -> None:
        heard = self.request.heard_text
        if heard is not None:
            heard.append(event.delta)

    async def _text_end(self, event: Any) -> None:
        request = self.request
        if request.heard_text:
            request.text = "".join(request.heard_text)

    async def _call_started(self, event: Any) -> None:
        request = self.request
        request.call_ids.append(event.call_id)  # a continuation's calls are of an earlier reply
        self.call_origins[event.call_id] = request.request_id

    async def _step(self, event: Any) -> None:
        request = self.request
        if request.turn_counted:  # counted by the inbox while nobody listened (`RequestInbox.begin_turn`)
            request.turn_counted = False
        else:
            request.turns += 1

    # -- what the readers get

    async def _text_shown(self, event: Any) -> None:
        request = self.request
        if request.sink is not discard:
            await request.sink(TextDeltaEvent(self.agent_id, event.delta))

    async def _usage(self, event: Any) -> None:
        request = self.request
        if request.sink is not discard:
            await request.sink(UsageEvent(self.agent_id, event.usage))

    async def _call_shown(self, event: Any) -> None:
        request = self.request
        if request.sink is not discard:
            await request.sink(self._running_use(request, event))

    def _running_use(self, request: _Request, event: Any) -> ToolUseEvent:
        """The reader's `ToolUseEvent` of a call, kept among the request's running calls until its result."""
        use = ToolUseEvent(self.agent_id, event.call_id, event.tool_name, event.input)
        running = request.running_calls
        if running is None:
            running = request.running_calls = {}
        running[event.call_id] = use
        return use

    async def _tool_progress(self, event: Any) -> None:
        request = self.request
        if request.sink is not discard:
            await request.sink(ToolProgressEvent(self.agent_id, event.call_id, event.item))

    async def _result_shown(self, event: Any) -> None:
        request = self.request
        running = request.running_calls
        if running:
            running.pop(event.call_id, None)
        if request.sink is discard:
            return
        error = event.result.error
        if error is not None and error.code == "no_handler":
            # A refusal nobody could have approved is made visible, not only told to the model.
            await request.sink(
                PermissionDeniedEvent(self.agent_id, event.call_id, event.tool_name, "no_handler", error.message)
            )
        await request.sink(ToolResultEvent(self.agent_id, event.call_id, event.tool_name, event.result))

    # -- both at once, when nothing wraps the events: the usual case, so one handler per event
    # (the parts above, inlined)

    async def _text_delta(self, event: Any) -> None:
        request = self.request
        heard = request.heard_text
        if heard is not None:
            heard.append(event.delta)
        if request.sink is not discard:
            await request.sink(TextDeltaEvent(self.agent_id, event.delta))

    async def _tool_use(self, event: Any) -> None:
        request = self.request
        request.call_ids.append(event.call_id)
        self.call_origins[event.call_id] = request.request_id
        if request.sink is not discard:
            await request.sink(self._running_use(request, event))


_Handlers = dict[type, Callable[[_RunEvents, Any], Awaitable[None]]]

_HANDLERS: _Handlers = {
    TextMessageStart: _RunEvents._text_start,
    TextMessageContent: _RunEvents._text_delta,
    TextMessageEnd: _RunEvents._text_end,
    UsageReported: _RunEvents._usage,
    ToolCallEnd: _RunEvents._tool_use,
    ToolCallProgress: _RunEvents._tool_progress,
    ToolCallResult: _RunEvents._result_shown,  # only shown: its origin goes with the request
    StepStarted: _RunEvents._step,
}
"""What `_RunEvents` does with an event nothing wraps: keeps it and shows it."""

_KEPT: _Handlers = {
    TextMessageStart: _RunEvents._text_start,
    TextMessageContent: _RunEvents._text_heard,
    TextMessageEnd: _RunEvents._text_end,
    ToolCallEnd: _RunEvents._call_started,
    StepStarted: _RunEvents._step,
}
"""What the session keeps of an event the loop emitted, before any ``on_chunk`` (`_KeptEvents`)."""

_SHOWN: _Handlers = {
    TextMessageContent: _RunEvents._text_shown,
    UsageReported: _RunEvents._usage,
    ToolCallEnd: _RunEvents._call_shown,
    ToolCallProgress: _RunEvents._tool_progress,
    ToolCallResult: _RunEvents._result_shown,
}
"""What `_RunEvents` shows of an event that passed every ``on_chunk``."""


class _KeptEvents:
    """The outermost sink of a run whose events chat middleware wraps: the session keeps each
    event as the loop emitted it (`_KEPT`), then the hooks' chain gets it (and may drop, change
    or multiply it for the readers only)."""

    __slots__ = ("events", "wrapped")

    def __init__(self, events: _RunEvents, wrapped: RunEventSink) -> None:
        self.events = events
        self.wrapped = wrapped

    async def __call__(self, event: RunEvent) -> None:
        keep = _KEPT.get(type(event))
        if keep is not None:
            await keep(self.events, event)
        await self.wrapped(event)


class AgentConversation:
    """An agent's history as one request's run sees it: appended to, read by the model through a
    copy-free view. The run's replies give the request its text and its calls."""

    __slots__ = ("agent", "request")

    def __init__(self, agent: _Agent, request: _Request) -> None:
        self.agent = agent
        self.request = request

    def view(self, prefix: tuple[Message, ...]) -> Sequence[Message]:
        return MessageView(self.agent.history, prefix)

    def snapshot(self) -> Sequence[Message]:
        return MessageView(self.agent.history, ())

    def extend(self, messages: Iterable[Message]) -> None:
        history = self.agent.history
        start = len(history)
        history.extend(messages)
        if len(history) - start == 1:  # the usual call: one reply, or one turn's input
            message = history[start]
            if isinstance(message, AssistantMessage):
                self._replied(message)
            return
        for message in history[start:]:
            if isinstance(message, AssistantMessage):
                self._replied(message)

    def _replied(self, message: AssistantMessage) -> None:
        request = self.request
        if request.heard_text is not None:
            request.heard_text = None  # its text was heard as it streamed (`_RunEvents`)
        else:
            # Streamed while nobody listened: the reply's text, as the loop's own (`Finished.text`).
            text = first_text(message.parts)
            if text:
                request.text = text
        # An abort keeps the committed results of the calls (`record_interrupted`).
        call_ids = request.call_ids
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                call_ids.append(part.id)

    def call_ids(self) -> Collection[str]:
        return self.agent.call_index.update(self.agent.history)


class RequestInbox:
    """Messages that joined the request (priority next/now), the session's background reports for
    the agent, and a Stop hook's continuation."""

    __slots__ = ("agent_id", "counts_turns", "host", "inbox", "request")

    def __init__(self, host: SessionHost, agent_id: str, request: _Request, *, counts_turns: bool = False) -> None:
        self.host = host
        self.inbox = host.inbox
        self.agent_id = agent_id
        self.request = request
        self.counts_turns = counts_turns  # the loop may build no StepStarted (`_RunEvents`)

    def begin_turn(self) -> tuple[list[str], AbortHandle]:
        request = self.request
        if self.counts_turns:
            # Nobody listens: the loop will build no StepStarted for this turn, so it counts here
            # (a listener that joins before it would see the event: `_RunEvents._step` skips it).
            listening = request.listening()
            request.turn_counted = not listening
            if not listening:
                request.turns += 1
        inputs = self.inbox.pop(self.agent_id, [])
        while request.pending:
            inputs.append(request.pending.pop(0))
        if request.continuation is not None:
            inputs.append(request.continuation)
            request.continuation = None
        request.steering = AbortHandle()
        return inputs, request.steering

    def has_pending(self) -> bool:
        return bool(self.request.pending)

    def add(self, text: str) -> None:
        self.request.continuation = text  # dropped if the run ends first (the turn limit)

    def close(self) -> None:
        request = self.request
        request.continuation = None
        request.accepting = False
        if request.pending:
            # No message that joined may be lost: what is pending reaches the agent's next request
            # (noted before the run's end is written, which carries it).
            self.host.keep_pending(request)


class SessionHooks(Lifecycle):
    """The session's Stop / SubagentStop hook events as the loop's ``before_stop``, and its own
    hold on the run's events ahead of chat middleware (``wrap_events``).

    Stateless: one instance serves every run; the run's agent and request come from
    ``ctx.metadata`` (a context built by `SessionHost`). Outside a session it does nothing.
    """

    name = "session hooks"

    def wrap_events(self, ctx: Any, sink: RunEventSink) -> RunEventSink:
        """The outermost decorator (this part is the first of every session lifecycle): when chat
        middleware wraps the run's events, the session keeps them as the loop emitted them, so an
        ``on_chunk`` that drops, changes or multiplies one changes only what readers see."""
        info = ctx.metadata.get(_RUN) if isinstance(ctx, RunContext) else None
        if not isinstance(info, _RunInfo) or sink is info.events:
            return sink  # nothing wraps them: no decorator, and the loop may build none unread
        return info.events.outside(sink)

    async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
        info = ctx.metadata.get(_RUN) if isinstance(ctx, RunContext) else None
        if not isinstance(info, _RunInfo):
            return None
        host, agent, request = info.host, info.agent, info.request
        event = HookEvent.STOP if agent.parent_id is None else HookEvent.SUBAGENT_STOP
        if not host.hooks.has_hooks(event):
            return None  # what a dispatch with no hook decides (`SessionHost.dispatch`)
        last = _final_text(agent.history)
        if agent.parent_id is None:
            decision = await host.dispatch(HookEvent.STOP, agent.agent_id, last_message=last, abort=request.abort)
        else:
            decision = await host.dispatch(
                HookEvent.SUBAGENT_STOP,
                agent.agent_id,
                subagent_id=agent.agent_id,
                subagent_type=agent.name,
                last_message=last,
                abort=request.abort,
            )
        decision.raise_for_abort()
        if decision.action is HookAction.SKIP:
            # "Don't stop yet": one more round with the hook's reason as the user's message.
            return decision.context_text or decision.reason or "Continue."
        return None


SESSION_HOOKS = SessionHooks()
"""The one `SessionHooks` part every session lifecycle starts with."""


def _final_text(history: Sequence[Message]) -> str | None:
    """The text of the reply the run is about to end with (the last message: a reply without
    calls), ``None`` if it has none; never an earlier reply's."""
    last = history[-1] if history else None
    if isinstance(last, AssistantMessage):
        return first_text(last.parts) or None
    return None


def noted(
    inbox: dict[str, list[str]],
    root_agent_id: str,
    agent_id: str,
    messages: Sequence[str],
    request_id: str | None,
    subagent_id: str | None,
) -> InboxNoted | None:
    """*messages* in *agent_id*'s inbox now; the event that journals them (the root's only), or ``None``."""
    if not messages:
        return None
    inbox.setdefault(agent_id, []).extend(messages)
    if agent_id != root_agent_id:
        return None
    return InboxNoted(messages=tuple(messages), request_id=request_id, subagent_id=subagent_id)


class InboxNotes:
    """The inbox's deferred notes, for what holds no reference to the host (the request queue:
    the host reaches the queue through its permission engine, so a queue holding the host would
    make a reference cycle, and a closed session would wait for the cyclic GC)."""

    __slots__ = ("inbox", "journal", "root_agent_id")

    def __init__(self, inbox: dict[str, list[str]], journal: DurableJournal, root_agent_id: str) -> None:
        self.inbox = inbox
        self.journal = journal
        self.root_agent_id = root_agent_id

    def note_later(self, agent_id: str, messages: Sequence[str], *, request_id: str | None = None) -> None:
        """Put *messages* in *agent_id*'s inbox, journalled with the stream's next write
        (`DurableJournal.defer`): for messages that joined a request that ended before a turn took
        them. Nothing durable produced them (a join is not journalled), so a crash before that
        write loses them with their sender's call; the request's end, written next, carries them.
        Never raises: a journal that may not write is logged (it refuses the request's end too)."""
        event = noted(self.inbox, self.root_agent_id, agent_id, messages, request_id, None)
        if event is not None:
            try:
                self.journal.defer(event, agent_id=agent_id)
            except (JournalError, LeaseLostError) as exc:
                _log.warning("could not journal %d inbox message(s) of agent %s: %s", len(messages), agent_id, exc)
