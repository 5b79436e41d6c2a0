"""``chat()``: one run of the one agent loop, without a session.

``async with chat(model, "prompt", tools=[...]) as run`` opens a nursery, runs the
loop in it and yields a `ChatRun`: iterate it for the run's `RunEvent`s (a bounded
channel: a slow reader slows the run), or ``await run.result()`` for the
`ChatResult`. Leaving the block before the run ended aborts it (an SDK abort: a
tool call whose result was committed keeps it) and waits for it to end.

With ``output_schema`` the run ends with a separate structured-output call
(``on_structured_output_config`` and ``on_config`` with phase
``structured_output`` run first; it is not offered to ``on_model_error``, so no
``ctx.retry()``, but the service's `RetryPolicy` retries a retryable failure as
for any call); its answer must be JSON that the schema accepts, else
`StructuredOutputError` lists the issues. The run keeps a copy of the schema as plain
JSON (refused up front if it is not JSON: a NaN would fail only that last call), and
each hook gets a copy of its own: what is sent is what the answer is checked against.
With ``journal`` (an open `DurableJournal`, owned by the caller) the run is
recorded as a request of the journal's root agent, as a session records one, and
ended on every way out (a cancellation from outside: interrupted); a
pause is recorded (``run_paused``) and the journal answers it once: a replayed
continuation is refused (`InterruptResumeError`, code ``stale``).
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import types
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Generator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import Any, TypeVar

import attrs
import jsonschema_rs
import trio

from .._abort import Abort, AbortHandle, AbortReason
from .._builders import constructor
from .._cleanup import DEFAULT_CLEANUP_GRACE, bounded_shield, validate_cleanup_grace
from .._errors import (
    ConfigError,
    MiddlewareShapeError,
    ModelError,
    RequestAbortedError,
    TrioAgentError,
    require_trio,
)
from .._groups import raise_for_boundary
from .._journal._conversation import encode_conversation
from .._journal._durable import DurableJournal
from .._journal._events import (
    ErrorInfo,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    RunPaused,
    TurnAbortReason,
)
from .._journal._run_recorder import JournalRecorder
from .._lifecycle._approvals import PermissionGate
from .._lifecycle._capabilities import validate_capabilities
from .._lifecycle._interrupts import (
    PausedRun,
    check_signing_key,
    continuation_answers,
    pause_to_json,
    registered_interrupts,
    split_client_tools,
)
from .._lifecycle._middleware import (
    ChatMiddleware,
    middleware_lifecycle,
    output_schema_json,
    output_schema_validator,
    structured_output_config,
)
from .._loop._context import RunContext
from .._loop._events import RunEvent, UsageReported
from .._loop._hooks import Finished, ModelConfig, Phase
from .._loop._interrupts import (
    ClientTool,
    Interrupt,
    InterruptAnswer,
    InterruptDefinition,
    Resume,
)
from .._loop._ports import RunEventSink, RunPorts, RunSpec, TurnRef, discard_events, no_effects
from .._loop._rules import LoopStrategy, StopReason, check_strategy, max_iterations, strategy_answer
from .._loop._run import run_agent_loop
from .._middleware import CheckedLayers
from .._models._assemble import JSONTextError, ModelReply, parse_json_value
from .._models._history import CallIdIndex, MessageView, validate_history
from .._models._messages import (
    FinishReason,
    Message,
    ModelResponse,
    SystemMessage,
    TextPart,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UserMessage,
)
from .._models._service import ModelLayers, ModelMiddleware, ModelService, Provider, is_provider, not_a_provider
from .._permissions._engine import PermissionEngine
from .._permissions._rules import PathPolicy, PermissionMode, PermissionRules, rules_from
from .._reader_wait import waiting_for_reader
from .._session._endings import record_request_end
from .._session._plugins import MiddlewareConfigError, check_model_middleware_runs
from .._tools._chain import ToolLayers, ToolMiddleware
from .._tools._definition import (
    LISTED_ISSUES,
    Tool,
    first_schema_issue,
    listed_issues,
    schema_issue,
    surrogate_errors,
)
from .._tools._journal import InMemoryToolJournal
from .._tools._pipeline import ToolPipeline
from .._tools._results import ToolResult
from .._util import safe_repr

__all__ = ["ChatCall", "ChatResult", "ChatRun", "StructuredOutputError", "chat"]

DEFAULT_MAX_ITERATIONS = 5
_DEFAULT_STRATEGY = max_iterations(DEFAULT_MAX_ITERATIONS)  # keeps nothing of a run: one serves every run


class StructuredOutputError(TrioAgentError):
    """The structured-output answer is not JSON the schema accepts; ``issues`` lists why."""

    code = "structured_output"  # the run's RunError code

    def __init__(self, message: str, *, issues: Sequence[str], text: str) -> None:
        super().__init__(message)
        self.issues = tuple(issues)
        self.text = text


@attrs.frozen
class ChatResult:
    """How a ``chat()`` run ended; a run that paused has ``paused`` (stop reason ``interrupted``)."""

    text: str
    messages: tuple[Message, ...]
    stop_reason: StopReason
    finish_reason: FinishReason | None
    usage: Usage
    turns: int
    structured_output: Any = None
    paused: PausedRun | None = None

    @property
    def interrupts(self) -> tuple[Interrupt, ...]:
        """The questions a paused run waits for (empty unless it paused)."""
        return () if self.paused is None else self.paused.state.interrupts


# One a run: built cheaper (see `_builders`), every field given.
_chat_result: Callable[
    [str, tuple[Message, ...], StopReason, FinishReason | None, Usage, int, Any, PausedRun | None], ChatResult
] = constructor(ChatResult)


class _ListConversation:
    __slots__ = ("history", "index")

    def __init__(self, messages: Iterable[Message]) -> None:
        self.history: list[Message] = list(messages)
        self.index = CallIdIndex()

    def call_ids(self) -> Collection[str]:
        return self.index.update(self.history)

    def view(self, prefix: tuple[Message, ...]) -> Sequence[Message]:
        return MessageView(self.history, prefix)

    def extend(self, messages: Iterable[Message]) -> None:
        self.history.extend(messages)


class _Inbox:
    """A chat run takes no input while it runs; a hook's "one more round" is its only input."""

    __slots__ = ("closed", "pending")

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.closed = False

    def begin_turn(self) -> tuple[list[str], AbortHandle]:
        taken, self.pending = self.pending, []
        return taken, AbortHandle()

    def has_pending(self) -> bool:
        return False

    def add(self, text: str) -> None:
        self.pending.append(text)

    def close(self) -> None:
        self.closed = True
        self.pending.clear()


class _NoRecorder:
    """A run without a journal records nothing, and so never waits: its methods do not checkpoint
    (a yield per model call and turn was a measurable part of a run; the model stream and the
    tools are the run's checkpoints)."""

    async def model_call_started(self, turn: TurnRef, model: str, *, opens_turn: bool) -> None:
        return None

    async def model_call_completed(
        self, turn: TurnRef, reply: ModelReply, *, inputs: Sequence[str], rejected: Mapping[str, str]
    ) -> None:
        return None

    async def model_call_failed(self, turn: TurnRef, error: ModelError) -> None:
        return None

    async def model_call_aborted(self, turn: TurnRef, abort: Abort | None) -> None:
        return None

    async def turn_completed(self, turn: TurnRef) -> None:
        return None

    async def turn_started(self, turn: TurnRef) -> None:
        return None

    async def interrupts_resolved(
        self,
        paused_run_id: str,
        run_id: str,
        answers: Mapping[str, InterruptAnswer],
        answered: Mapping[str, ToolResult],
        approved: Sequence[str] = (),
    ) -> None:
        return None  # a stateless run cannot tell a replay (docs/human-in-the-loop.md)

    def pause_is_open(self, paused_run_id: str) -> bool | None:
        return None

    def settled_answer(self, call_id: str) -> ToolResultMessage | None:
        return None


class ChatRun:
    """A running ``chat()``: ``async for event in run`` and ``await run.result()``.

    An aborted run never waits for its reader and loses no event for one that reads on: what the
    full channel cannot take waits in ``_overflow``, read after the channel.
    """

    def __init__(self, run_id: str, receive: trio.MemoryReceiveChannel[RunEvent], abort: AbortHandle) -> None:
        self.run_id = run_id
        self._receive = receive
        self._abort = abort
        # An aborted run never waits for its reader: what the full channel cannot take waits here,
        # after it, for a reader that reads on (the closing events, the terminal one). Bounded by
        # what a run emits once aborted; dropped once nobody can read (the block left, result()).
        self._overflow: collections.deque[RunEvent] = collections.deque()
        self._done = trio.Event()
        self._result: ChatResult | None = None
        self._error: BaseException | None = None
        self.unread = False
        """Set by `result`: nobody reads the events any more, so the run stops queueing them."""

    def __aiter__(self) -> ChatRun:
        return self

    async def __anext__(self) -> RunEvent:
        if self._overflow:  # only ever after an abort: the channel's events come first
            await trio.lowlevel.checkpoint()
            try:
                return self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return self._overflow.popleft()
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None

    def _unread(self) -> None:
        """Nobody reads the events any more: the run queues none, and what waits is dropped."""
        self.unread = True
        self._overflow.clear()

    def abort(self, reason: str = "aborted") -> None:
        """Abort the run (an SDK abort: committed tool results are kept)."""
        self._abort.abort(AbortReason.USER_ABORT, reason)

    async def result(self) -> ChatResult:
        """Wait for the run to end and return its result, or raise its error.

        The events nobody read are dropped, and from now on the run queues none (a task
        switch per event would cost more than the rest of the run).
        """
        self._unread()
        with suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            while True:  # what is queued; a run blocked on a full channel goes on
                self._receive.receive_nowait()
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self._result is None:
            # Cancelled before it ended: a cancel scope around the block, or the block's nursery
            # once an aborted run overran cleanup_grace. Recorded so in a journal (user_abort).
            raise RequestAbortedError(
                f"chat run {self.run_id!r} was cancelled before it ended: it has no result",
                reason=AbortReason.USER_ABORT.value,
            )
        return self._result


# What the model is offered of a tool, made once per tool (a tool is immutable): a chat() run per
# request offers the same tools again. Weak: a tool nobody holds is forgotten.
_OFFERED: weakref.WeakKeyDictionary[Tool[Any], ToolSpec] = weakref.WeakKeyDictionary()


def _offered(tool: Tool[Any]) -> ToolSpec:
    spec = _OFFERED.get(tool)
    if spec is None:
        spec = _OFFERED[tool] = ToolSpec(tool.name, tool.description, dict(tool.input_schema))
    return spec


_Layers = TypeVar("_Layers", bound=CheckedLayers)


def _layers(kind: type[_Layers], value: Any, parameter: str, what: str) -> _Layers:
    """*value* (``chat()``'s *parameter*) checked as layers of *kind*: else `MiddlewareConfigError`
    (a `ConfigError` and a `MiddlewareShapeError`) naming the parameter. The layers' own check
    runs once (the service and the pipeline take the checked layers as they are)."""
    given = type(value)
    if (given is not list and given is not tuple and given is not kind) and (
        isinstance(value, (str, bytes)) or not isinstance(value, Sequence)
    ):
        raise MiddlewareConfigError(f"chat({parameter}=...) must be a list or tuple of {what}, got {safe_repr(value)}")
    try:
        return kind.check(value)
    except MiddlewareShapeError as exc:
        raise MiddlewareConfigError(f"chat({parameter}=...): {exc}") from None


def _provider_service(
    agent_or_model: object, model_middleware: Sequence[ModelMiddleware], *, structured: bool
) -> ModelService:
    if isinstance(agent_or_model, ModelService):
        if model_middleware:
            raise ConfigError("model_middleware= is for a provider; a ModelService already has its middleware")
        service = agent_or_model
    else:
        provider: Provider = agent_or_model  # type: ignore[assignment]
        try:
            # Checks that it is a provider (`is_provider`; once per run, not here again), then the layers' shapes.
            service = ModelService(provider, model_middleware)
        except ConfigError:
            if not is_provider(provider):  # said for chat(), which takes a ModelService too
                raise ConfigError(not_a_provider("chat()", provider, "a model provider or a ModelService")) from None
            raise
    if service.middleware:
        # A given service's layers too (a wrap_chat-only one would never run). Once per layers
        # object (a chat() run per request passes its list, or its service, again), as their shapes.
        service.middleware.derived(*_CHECK_RUNS[structured])
    return service


def _check_runs(layers: Sequence[ModelMiddleware], *, structured: bool) -> bool:
    # The run streams every model turn; only output_schema's structured-output call is a chat call.
    check_model_middleware_runs(
        "chat()",
        layers,
        runs=("wrap_stream", "wrap_chat") if structured else ("wrap_stream",),
        why="chat() streams every model turn (only the structured-output call of output_schema= uses "
        "wrap_chat), so it would never run; define wrap_stream (an async generator that iterates "
        "next(request))",
    )
    return True


_CHECK_RUNS = {
    False: ("chat_runs", functools.partial(_check_runs, structured=False)),
    True: ("chat_structured_runs", functools.partial(_check_runs, structured=True)),
}


def _permission_engine(
    permissions: PermissionRules | Mapping[str, Sequence[str]] | PermissionEngine | None,
    permission_mode: PermissionMode | str | None,
    tools: Sequence[Tool[Any]],
    workspace_roots: Sequence[str | os.PathLike[str]] | str | os.PathLike[str] | None,
) -> PermissionEngine | None:
    """The table approvals are judged by; ``None`` when nothing could ever ask or deny."""
    if isinstance(permissions, PermissionEngine):
        if permission_mode is not None or workspace_roots is not None:
            raise ConfigError("permission_mode= and workspace_roots= are for rules; a PermissionEngine has its own")
        return permissions
    quiet = permissions is None and permission_mode is None and workspace_roots is None
    if quiet and not any(tool.check_permissions for tool in tools):
        return None
    permissions = rules_from(permissions)
    if permissions is not None:
        permissions.check_tools(tools)  # as a session does: a rule that can never match is refused
    # With rules, the session's default mode (reads run, writes and commands ask); with no rules
    # and no mode, only a tool that asks for itself pauses the run ("bypass" skips nothing else).
    default = PermissionMode.DEFAULT if permissions is not None else PermissionMode.BYPASS
    # As given: PathPolicy reads one path or several, and refuses no root at all (ConfigError) rather
    # than this run silently going without a path policy.
    policy = PathPolicy(workspace_roots) if workspace_roots is not None else None
    return PermissionEngine(permissions, mode=permission_mode or default, path_policy=policy)


def _check_shapes(options: Mapping[str, Any]) -> None:
    """`ConfigError` for an argument of the wrong kind, before anything runs (a run would fail
    with a raw TypeError midway, after its first hooks)."""
    strategy, metadata, instructions = options["strategy"], options["metadata"], options["instructions"]
    if strategy is not None:
        check_strategy(strategy, "strategy")
    journal, abort = options["journal"], options["abort"]
    if journal is not None and not isinstance(journal, DurableJournal):
        raise ConfigError(f"journal must be an open DurableJournal (open_journal(...)), not {journal!r}")
    if abort is not None and not isinstance(abort, AbortHandle):
        raise ConfigError(f"abort must be an AbortHandle, not {abort!r}")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a mapping, not {metadata!r}")
    if instructions is not None and not isinstance(instructions, str):
        raise ConfigError(f"instructions must be a string, not {instructions!r}")


def _initial_messages(messages: str | Sequence[Message]) -> list[Message]:
    if isinstance(messages, str):
        if not messages.strip():
            raise ConfigError("a prompt must be a non-empty string")
        return [UserMessage(messages)]
    history = list(validate_history(messages))
    if not history:
        raise ConfigError("chat() needs a prompt or at least one message")
    return history


def chat(
    agent_or_model: Provider | ModelService,
    messages: str | Sequence[Message] | None = None,
    *,
    tools: Sequence[Tool[Any] | ClientTool] = (),
    middleware: Sequence[ChatMiddleware] = (),
    model_middleware: Sequence[ModelMiddleware] = (),
    tool_middleware: Sequence[ToolMiddleware] = (),
    instructions: str | None = None,
    output_schema: Mapping[str, Any] | None = None,
    strategy: LoopStrategy | None = None,
    journal: DurableJournal | None = None,
    abort: AbortHandle | None = None,
    metadata: Mapping[str, Any] | None = None,
    cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
    interrupts: Sequence[InterruptDefinition] = (),
    permissions: PermissionRules | Mapping[str, Sequence[str]] | PermissionEngine | None = None,
    permission_mode: PermissionMode | str | None = None,
    workspace_roots: Sequence[str | os.PathLike[str]] | str | os.PathLike[str] | None = None,
    resume: PausedRun | None = None,
    answers: Sequence[InterruptAnswer] = (),
    signing_key: bytes | None = None,
) -> ChatCall:
    """One run of the agent loop without a session (module docstring).

    ``async with chat(...) as run`` runs it in a task of its own beside the block (stream its
    events, or ``await run.result()``); ``await chat(...)`` runs it in the caller's task and
    returns the `ChatResult` (no task, no event stream: the cheaper form when only the result
    is wanted).

    Raises `ConfigError` (bad arguments, an invalid history, an invalid schema or one that is not
    JSON, an ``async`` strategy, a `CapabilityError`), `MiddlewareShapeError` (middleware that is
    not a list of `ChatMiddleware`), `MiddlewareConfigError` (both: ``tool_middleware`` or
    ``model_middleware`` that is not a list of its kind, naming the parameter)
    before anything runs (when the block is entered or the call awaited); the run's own
    error from ``run.result()`` (from the ``await``), `RequestAbortedError` from
    ``run.result()`` of a run cancelled before it ended. The block raises as a Trio nursery
    would, and so does the ``await``: never a group of its own (`raise_for_boundary`).
    ``cleanup_grace`` bounds the wait for an aborted run to end when the block is left early, and
    is its tools' grace (``ctx.cleanup_scope()``, the time a cancelled tool may take to stop).

    Pauses and continuations (``docs/human-in-the-loop.md``): a run that must ask a person
    ends with ``result.paused``; run ``chat(model, resume=paused, answers=[...])`` with the
    same tools, middleware and ``signing_key`` to go on. ``permissions`` /
    ``permission_mode`` decide which calls need approval; ``workspace_roots`` keeps the
    paths a call affects inside them (the path policy, for first and edited arguments).
    """
    # The arguments by name (nothing else is bound yet): checked when the run is entered or awaited.
    return ChatCall(locals())


class ChatCall:
    """What `chat` returns: ``async with`` it for a `ChatRun`, or ``await`` it for the `ChatResult`."""

    __slots__ = ("_entered", "_options", "_used")

    def __init__(self, options: Mapping[str, Any]) -> None:
        self._options = options
        self._entered: AbstractAsyncContextManager[ChatRun] | None = None
        self._used = False

    def _use(self) -> None:
        if self._used:
            raise RuntimeError("a chat() call may be entered or awaited once (call chat() again for another run)")
        self._used = True

    def __await__(self) -> Generator[Any, None, ChatResult]:
        self._use()
        return self._result().__await__()

    async def _result(self) -> ChatResult:
        require_trio("chat()")
        prepared = _Prepared(self._options)
        try:
            # The caller's task runs the loop; nobody can read its events (hooks still see them).
            await prepared.drive(discard_events)
        except BaseExceptionGroup as group:
            # A tool's or a middleware's own nursery, cancelled from outside, whose cleanup raised:
            # one exception out, as the block form raises it (never a group of our own).
            raise_for_boundary(group)
        finally:
            prepared.unlink()
        if prepared.error is not None:
            raise prepared.error
        assert prepared.result is not None
        return prepared.result

    async def __aenter__(self) -> ChatRun:
        self._use()
        self._entered = _in_task(self._options)
        return await self._entered.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> bool | None:
        assert self._entered is not None
        return await self._entered.__aexit__(exc_type, exc, tb)


class _Prepared:
    """One chat run, checked and wired: `drive` runs it to its end (in whichever task calls it)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        cleanup_grace = validate_cleanup_grace(options["cleanup_grace"])
        model_layers = _layers(ModelLayers, options["model_middleware"], "model_middleware", "model middleware")
        tool_layers = _layers(ToolLayers, options["tool_middleware"], "tool_middleware", "tool middleware")
        service = _provider_service(
            options["agent_or_model"], model_layers, structured=options["output_schema"] is not None
        )
        resume, messages, answers = options["resume"], options["messages"], options["answers"]
        resumed: Resume | None = None
        if resume is not None:
            if messages is not None:
                raise ConfigError(
                    "chat() takes messages or resume=, not both (a continuation goes on with its history)"
                )
            if not isinstance(resume, PausedRun):
                raise ConfigError(f"resume= takes the PausedRun of a paused run, got {type(resume).__name__}")
            resume.verify(options["signing_key"])
            checked = continuation_answers(answers)
            history = list(resume.state.messages)
            resumed = Resume(resume.state, checked, resume.run_id)
        elif messages is None:
            raise ConfigError("chat() needs a prompt or at least one message")
        else:
            if answers:
                raise ConfigError("answers= go with resume= (the paused run they answer)")
            history = _initial_messages(messages)
        middleware = options["middleware"]
        _check_shapes(options)
        tools, client_tools = split_client_tools(options["tools"])
        registered = registered_interrupts(options["interrupts"], middleware)
        roots = options["workspace_roots"]
        engine = _permission_engine(options["permissions"], options["permission_mode"], tools, roots)
        # The adapters' requires first: a ModelService (a subclass may declare some) and its provider.
        validate_capabilities(middleware, service, service.provider)
        hooks = middleware_lifecycle(middleware)
        validator = None
        output_schema = options["output_schema"]
        if output_schema is not None:
            try:
                # The run's own copy, plain JSON (a NaN would fail only the last call's request):
                # what the caller later does to theirs changes neither what is sent nor the check.
                output_schema = output_schema_json(output_schema)
                validator = output_schema_validator(output_schema)
            except ValueError as exc:
                raise ConfigError(f"output_schema: {exc}") from None
        journal = options["journal"]
        # history_limit=0 and a tool journal that keeps no entries: the run's events and the durable
        # journal are its record; nothing reads the pipeline's own.
        pipeline = ToolPipeline(
            tools,
            middleware=tool_layers,
            journal=journal or InMemoryToolJournal(keep_entries=False),
            history_limit=0,
            # The run's one bound for clean-up, as a session's: a tool's ctx.cleanup_scope() and the
            # time a cancelled tool may take to stop before it is reported.
            cleanup_grace=cleanup_grace,
            settle_grace=cleanup_grace,
        )
        given = options["strategy"]
        # A given strategy's answers are checked (a bool, else ConfigError naming it); ours are bools.
        strategy = _DEFAULT_STRATEGY if given is None else functools.partial(strategy_answer, given)
        meta = dict(options["metadata"] or {})
        run_id = str(meta.get("run_id") or f"chat-{os.urandom(6).hex()}")  # 48 random bits, as uuid4().hex[:12]
        thread_id = str(meta.get("thread_id") or (resume.thread_id if resume is not None else run_id))
        agent_id = journal.root_agent_id if journal is not None else "root"
        self.abort = AbortHandle()
        self._links: list[tuple[AbortHandle, int]] = []
        if options["abort"] is not None:
            run_abort = self.abort

            def forward(outer: Abort) -> None:
                run_abort.abort(outer.reason, outer.message)

            self._links.append((options["abort"], options["abort"].add_listener(forward)))
        self.run_id, self.thread_id, self.agent_id = run_id, thread_id, agent_id
        self.cleanup_grace = cleanup_grace
        self.service, self.middleware, self.hooks = service, middleware, hooks
        self.journal, self.history, self.resume, self.resumed = journal, history, resume, resumed
        signing_key = options["signing_key"]
        if signing_key is not None:
            signing_key = check_signing_key(signing_key)  # here: a bad key found at the pause lost it
        self.output_schema, self.validator, self.signing_key = output_schema, validator, signing_key
        self.conversation = _ListConversation(history)
        offered = tuple(map(_offered, tools)) + tuple(
            ToolSpec(tool.name, tool.description, dict(tool.input_schema)) for tool in client_tools.values()
        )
        instructions = options["instructions"]
        self.spec = RunSpec(
            run_id=run_id,
            agent_id=agent_id,
            thread_id=thread_id,
            instructions=lambda: instructions or "",
            offered=offered,
            allowed=frozenset(tool.name for tool in tools) | frozenset(client_tools),
            strategy=strategy,
            model_metadata={**meta, "run_id": run_id, "thread_id": thread_id},
            session_id=journal.session_id if journal is not None else "chat",
            client_tools=client_tools,
            interrupts=registered,
            cleanup_grace=cleanup_grace,
        )
        self.gate = (
            None
            if engine is None
            else PermissionGate(engine, pipeline.tools, session_id=self.spec.session_id, abort=self.abort)
        )
        self.pipeline = pipeline
        self.metadata = meta
        self.result: ChatResult | None = None
        self.error: Exception | None = None
        self.structured: Any = None  # the structured-output answer, once checked

    def unlink(self) -> None:
        for handle, token in self._links:
            handle.remove_listener(token)
        self._links.clear()

    async def drive(self, events: RunEventSink) -> None:
        """Run the loop to its end: ``result`` or ``error`` is set (a cancellation propagates)."""
        journal, run_id, agent_id, conversation = self.journal, self.run_id, self.agent_id, self.conversation
        ports = RunPorts(
            model=self.service,
            tools=self.pipeline,
            conversation=conversation,
            inbox=_Inbox(),
            recorder=JournalRecorder(journal, agent_id) if journal is not None else _NoRecorder(),
            events=events,
            effects=no_effects,
            abort=self.abort,
            gate=self.gate,
        )
        ctx = RunContext(
            run_id=run_id,
            thread_id=self.thread_id,
            agent_id=agent_id,
            abort=self.abort,
            events=events,
            messages=lambda: conversation.history,
            metadata=self.metadata,
        )
        try:
            if journal is not None:
                # A rebuilt history reads what the run was given (a continuation: nothing new).
                resume = self.resume
                given = {"resume": resume.run_id} if resume is not None else encode_conversation(self.history)
                await journal.append(
                    RequestAccepted(request_id=run_id, command_id=run_id, input={"chat": True, **given}),
                    RequestStarted(request_id=run_id),
                )
            # With an output schema the structured-output call is the run's last step: before
            # RunFinished and the terminal hook, its failure the run's (RunError, on_error).
            finalize = None if self.validator is None else functools.partial(self._structured_output, ctx)
            outcome = await run_agent_loop(
                self.spec, ports, self.hooks, ctx=ctx, finalize=finalize, resume=self.resumed
            )
            paused = None
            if outcome.pause is not None:
                paused = PausedRun(run_id, self.thread_id, agent_id, outcome.pause)
                if self.signing_key is not None:
                    paused = paused.signed(self.signing_key)
            if journal is not None:
                await _record_end(journal, agent_id, run_id, outcome)
            self.result = _chat_result(
                outcome.text,
                tuple(conversation.history),
                outcome.stop_reason,
                outcome.state.last_finish_reason,
                outcome.usage,
                outcome.turns,
                self.structured,
                paused,
            )
        except Exception as exc:
            self.error = exc
            if journal is not None:
                failed = RequestFailed(request_id=run_id, error=ErrorInfo.of(exc))
                with bounded_shield(journal.commit_grace, "recording a failed chat run"), suppress(TrioAgentError):
                    await record_request_end(journal, agent_id, run_id, failed, turn_reason=TurnAbortReason.ERROR)
        except BaseException:
            # Cancelled from outside (a scope around the call, the block's nursery): the request
            # ends interrupted, as a session's does, else the journal refuses every later run.
            if journal is not None:
                interrupted = RequestInterrupted(request_id=run_id, reason=RequestInterruptReason.USER_ABORT)
                with bounded_shield(journal.commit_grace, "recording a cancelled chat run"), suppress(TrioAgentError):
                    await record_request_end(journal, agent_id, run_id, interrupted)
            raise

    async def _structured_output(self, ctx: RunContext, outcome: Finished) -> Finished:
        """The run's last step with ``output_schema`` (module docstring): one structured-output call
        (no ``on_model_error``: the service's retry policy only) whose answer must be JSON the
        schema accepts; its usage counts."""
        ctx.phase = Phase.STRUCTURED_OUTPUT
        spec, original, validator = self.spec, self.output_schema, self.validator
        assert original is not None and validator is not None
        # Each hook gets a copy of the run's schema; one it changed (returned, or edited in place)
        # comes back checked and compiled: the answer is checked against the schema the call sends.
        config, changed = await structured_output_config(
            self.middleware,
            ctx,
            {
                "instructions": spec.instructions(),
                "messages": self.conversation.view(()),
                "options": {},
                "metadata": dict(spec.model_metadata),
                "output_schema": original,
            },
        )
        schema = config["output_schema"]
        if changed is not None:
            validator = changed
        # on_config sees the call as on_structured_output_config left it, without the schema (the spec's order).
        call = await self.hooks.on_config(
            ctx, ModelConfig(config["instructions"], config["messages"], (), config["options"], config["metadata"])
        )
        request = (
            f"Answer with only a JSON value that this JSON Schema accepts, and nothing else:\n{json.dumps(schema)}"
        )
        prefix = (SystemMessage(call.instructions),) if call.instructions else ()
        response = await self.service.chat(
            [*prefix, *call.messages, UserMessage(request)],
            tools=call.tools,
            # A documented option key, not a server field: each provider maps it or leaves it out
            # (OpenAI: response_format), and a custom one reads the schema here.
            options={**call.options, "output_schema": schema},
            abort=self.abort,
            metadata=call.metadata,
        )
        usage = response.usage
        await self.hooks.on_usage(ctx, usage)
        await ctx.emit(UsageReported(self.run_id, self.agent_id, usage))
        if _answer_length(response) <= _THREADED_ANSWER:
            self.structured = _checked_answer(response, validator)
        else:
            # Pure, and for a long answer long (reading it is Python, about 0.35 s a megabyte): in a
            # worker thread, the loop's other tasks run meanwhile (a cancellation abandons it).
            self.structured = await trio.to_thread.run_sync(
                _checked_answer, response, validator, abandon_on_cancel=True
            )
        return attrs.evolve(outcome, usage=outcome.usage + usage)


@asynccontextmanager
async def _in_task(options: Mapping[str, Any]) -> AsyncIterator[ChatRun]:
    """``async with chat(...)``: the run in a task beside the block, its events on a bounded channel."""
    require_trio("chat()")
    prepared = _Prepared(options)
    send, receive = trio.open_memory_channel[RunEvent](256)
    run = ChatRun(prepared.run_id, receive, prepared.abort)
    run_abort = prepared.abort
    cleanup_grace = prepared.cleanup_grace
    overflow = run._overflow

    async def events(event: RunEvent) -> None:
        # Without a task switch while the buffer has room (one per chunk would cost more than the
        # rest of the run); a full buffer makes the run wait for its reader (backpressure).
        if run.unread:
            return
        if overflow:  # events wait past the channel: the later ones behind them, in order
            overflow.append(event)
            await trio.lowlevel.checkpoint()
            return
        try:
            send.send_nowait(event)
        except trio.WouldBlock:
            if run_abort.aborted:
                # Never block once aborted (the reader may have stopped reading), nor drop what a
                # reader that reads on must see (every block closed, the terminal event).
                overflow.append(event)
                await trio.lowlevel.checkpoint()
                return
            try:
                # The reader's wait: a model call streaming now, or a tool whose progress this is, holds its deadline.
                with waiting_for_reader():
                    await send.send(event)
            except trio.Cancelled:
                # Not delivered (a cancelled send hands nothing over): an abort cancels the model
                # call waiting here, and its reader still gets the event, before the later ones.
                if not run.unread:
                    overflow.append(event)
                raise
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await trio.lowlevel.checkpoint()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.lowlevel.checkpoint()

    async def drive() -> None:
        try:
            await prepared.drive(events)
            run._result, run._error = prepared.result, prepared.error
        finally:
            send.close()
            run._done.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drive)
            try:
                yield run
            finally:
                if not run._done.is_set():
                    # Leaving early aborts the run (committed tool results are kept) and waits for it;
                    # nobody reads its events now.
                    run.abort("the chat block was left before the run ended")
                    run._unread()
                    with bounded_shield(cleanup_grace, "ending a chat run whose block was left early") as waited:
                        while not run._done.is_set():
                            try:
                                await receive.receive()
                            except (trio.EndOfChannel, trio.ClosedResourceError):
                                await run._done.wait()
                    if waited.cancelled_caught:
                        nursery.cancel_scope.cancel()  # it did not end in time: stop waiting for it
    except BaseExceptionGroup as group:
        # The body's error or the run's, as the awaited form raises it (never in one more group);
        # a cancellation from outside is dropped beside them, as a Trio nursery drops it.
        raise_for_boundary(group)
    finally:
        prepared.unlink()


async def _record_end(journal: DurableJournal, agent_id: str, run_id: str, outcome: Finished) -> None:
    if outcome.pause is not None:
        # Durable: the journal refuses a second continuation of this pause (interrupts_resolved).
        await journal.append(RunPaused(request_id=run_id, state=pause_to_json(outcome.pause, with_messages=False)))
    elif outcome.aborted:
        # An abort may end the run inside a turn (its calls settled): the turn ends with the request.
        interrupted = RequestInterrupted(request_id=run_id, reason=RequestInterruptReason.USER_ABORT)
        await record_request_end(journal, agent_id, run_id, interrupted)
    else:
        await journal.append(RequestCompleted(request_id=run_id, output={"text": outcome.text}))


# A failing structured answer's issues are listed as a tool input's are (`listed_issues`).
# Up to this many characters of answer every issue is found (then listed up to LISTED_ISSUES);
# beyond it, only the first (validate() stops there): jsonschema_rs finds them all, eagerly, a
# Python object each (about 300 bytes of memory an answer's character; in a worker thread, the
# collections of so many objects still stalled the loop for 0.3 s at a time).
_LISTED_ANSWER = 4096
# A longer answer is checked in a worker thread (`_structured_output`).
_THREADED_ANSWER = 16384


def _answer_length(response: ModelResponse) -> int:
    return sum(len(part.text) for part in response.message.parts if isinstance(part, TextPart))


def _checked_answer(response: ModelResponse, validator: jsonschema_rs.Validator) -> Any:
    """The structured-output answer as a JSON value the schema accepts, else `StructuredOutputError`."""
    text = "".join(part.text for part in response.message.parts if isinstance(part, TextPart)).strip()
    if text.startswith("```"):
        text = text.strip("`")
        if text[:4].lower() == "json":  # the fence's language tag, in any case (```JSON)
            text = text[4:]
        text = text.strip()
    try:
        value = parse_json_value(text)  # the model's text is untrusted: depth and numbers are bounded
    except JSONTextError as exc:
        raise StructuredOutputError(
            f"the structured output is {exc.problem}", issues=[f"not JSON: {exc.problem}"], text=text
        ) from None
    # A JSON escape such as "\ud800" decodes to a lone surrogate: text no encoding can hold, which
    # the validator fails on (UnicodeEncodeError) or, where it reads no such string, would pass.
    # Checked first, anywhere in the value: the C encoder finds one, the walk then names it.
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        issues = listed_issues(surrogate_errors(value), 0, of="an answer")
        raise StructuredOutputError(
            "the structured output is not valid Unicode: " + "; ".join(issues), issues=issues, text=text
        ) from None
    if validator.is_valid(value):  # no error objects for a good answer
        return value
    if len(text) <= _LISTED_ANSWER:
        # jsonschema_rs builds every error (a Python exception object each, some microseconds)
        # before the first is read: listed only for an answer small enough to bound their number.
        errors = validator.iter_errors(value)
        issues = listed_issues(
            [schema_issue(error) for error in itertools.islice(errors, LISTED_ISSUES)],
            sum(1 for _ in errors),
            of="an answer",
        )
    else:
        issues = listed_issues([first_schema_issue(validator, value)], 0, longer_than=_LISTED_ANSWER, of="an answer")
    raise StructuredOutputError(
        "the structured output does not match the schema: " + "; ".join(issues), issues=issues, text=text
    )
