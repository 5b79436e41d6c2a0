"""A session as a host of the one agent loop: the loop's ports over a request of one agent.

The loop (`trio_agent._loop`) knows nothing of sessions. For each request the
session hands it:

* a `RunSpec` built from the agent (instructions read at every model call, the
  offered tools, the allowlist, ``max_turns`` as the strategy);
* `RunPorts`: the agent's history as the conversation, the request's joined
  messages and the session's background reports as the inbox, the journal as the
  recorder, the request's event sink (run events mapped to session events), the
  session's effect handling, the request's abort and stop handles;
* `SessionHooks`: the session's Stop / SubagentStop hook events as ``before_stop``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .._abort import AbortHandle
from .._journal._run_recorder import JournalRecorder
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
from .._loop._ports import RunPorts, RunSpec
from .._loop._rules import LoopState, first_text
from .._models._history import MessageView
from .._models._messages import AssistantMessage, Message
from .._tools._results import Effect
from ._hooks import HookAction, HookEvent
from ._messages import (
    PermissionDeniedEvent,
    TextDeltaEvent,
    ToolProgressEvent,
    ToolResultEvent,
    ToolUseEvent,
    UsageEvent,
)

if TYPE_CHECKING:
    from ._session import Session, _Agent, _Request

__all__ = ["AgentConversation", "RequestInbox", "SessionHooks", "run_ports", "run_spec"]


class AgentConversation:
    """An agent's history: appended to, read by the model through a copy-free view."""

    __slots__ = ("agent",)

    def __init__(self, agent: _Agent) -> None:
        self.agent = agent

    def view(self, prefix: tuple[Message, ...]) -> Sequence[Message]:
        return MessageView(self.agent.history, prefix)

    def extend(self, messages: Iterable[Message]) -> None:
        self.agent.history.extend(messages)

    def call_ids(self) -> Collection[str]:
        return self.agent.call_index.update(self.agent.history)


class RequestInbox:
    """Messages that joined the request (priority next/now), the session's background reports for
    the agent, and a Stop hook's continuation."""

    __slots__ = ("agent_id", "request", "session")

    def __init__(self, session: Session, agent_id: str, request: _Request) -> None:
        self.session = session
        self.agent_id = agent_id
        self.request = request

    def begin_turn(self) -> tuple[list[str], AbortHandle]:
        request = self.request
        inputs = self.session._inbox.pop(self.agent_id, [])
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
        request.accepting = False
        request.continuation = None
        # No message that joined may be lost: what is pending reaches the agent's next request.
        if request.pending:
            self.session._inbox.setdefault(self.agent_id, []).extend(request.pending)
            request.pending.clear()


class SessionHooks(Lifecycle):
    """The session's Stop / SubagentStop hook events as the loop's ``before_stop``."""

    __slots__ = ("agent", "request", "session")

    def __init__(self, session: Session, agent: _Agent, request: _Request) -> None:
        self.session = session
        self.agent = agent
        self.request = request

    async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
        session, agent, request = self.session, self.agent, self.request
        last = _last_text(agent.history)
        if agent.parent_id is None:
            decision = await session._dispatch(HookEvent.STOP, agent.agent_id, last_message=last, abort=request.abort)
        else:
            decision = await session._dispatch(
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


def _last_text(history: Sequence[Message]) -> str:
    for message in reversed(history):
        if isinstance(message, AssistantMessage):
            text = first_text(message.parts)
            if text:
                return text
    return ""


def run_spec(session: Session, agent: _Agent, request: _Request) -> RunSpec:
    context = session._context

    def instructions() -> str:
        return "\n\n".join([agent.system_prompt, *context]).strip()

    return RunSpec(
        run_id=request.request_id,
        agent_id=agent.agent_id,
        thread_id=session.session_id,
        instructions=instructions,
        offered=tuple(agent.specs or ()),
        allowed=agent.allowed,
        strategy=agent.strategy(),
        model_metadata={"session_id": session.session_id, "agent_id": agent.agent_id},
        lineage=agent.lineage,
        session_id=session.session_id,
    )


def run_ports(session: Session, agent: _Agent, request: _Request) -> RunPorts:
    agent_id = agent.agent_id
    sink = request.sink
    text: list[str] = []

    async def events(event: RunEvent) -> None:
        # The loop's events, as the session's stream has always shown them.
        if isinstance(event, TextMessageContent):
            text.append(event.delta)
            await request.sink(TextDeltaEvent(agent_id, event.delta))
        elif isinstance(event, UsageReported):
            await request.sink(UsageEvent(agent_id, event.usage))
        elif isinstance(event, ToolCallEnd):
            request.call_ids.append(event.call_id)
            session._call_origins[event.call_id] = request.request_id
            await request.sink(ToolUseEvent(agent_id, event.call_id, event.tool_name, event.input))
        elif isinstance(event, ToolCallProgress):
            await request.sink(ToolProgressEvent(agent_id, event.call_id, event.item))
        elif isinstance(event, ToolCallResult):
            session._call_origins.pop(event.call_id, None)
            error = event.result.error
            if error is not None and error.code == "no_handler":
                # A refusal nobody could have approved is made visible, not only told to the model.
                await request.sink(
                    PermissionDeniedEvent(agent_id, event.call_id, event.tool_name, "no_handler", error.message)
                )
            await request.sink(ToolResultEvent(agent_id, event.call_id, event.tool_name, event.result))
        elif isinstance(event, TextMessageStart):
            text.clear()
        elif isinstance(event, TextMessageEnd):
            if text:
                request.text = "".join(text)
        elif isinstance(event, StepStarted):
            request.turns += 1

    async def effects(agent_id_: str, call_id: str, items: Sequence[Effect]) -> None:
        try:
            for effect in items:
                await session._apply_effect(agent, effect, call_id)
        finally:
            session._call_origins.pop(call_id, None)

    del sink
    return RunPorts(
        model=session._service_for(agent),
        tools=session.pipeline,
        conversation=AgentConversation(agent),
        inbox=RequestInbox(session, agent_id, request),
        recorder=JournalRecorder(session.journal, agent_id),
        events=events,
        effects=effects,
        abort=request.abort,
        stop=request.stop,
    )
