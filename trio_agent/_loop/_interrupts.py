"""Interrupts: a run that pauses with one batch of questions and resumes from the answers.

Rules
=====

* A run pauses at one of four boundaries (`Phase.BEFORE_MODEL`, ``AFTER_MODEL``,
  ``BEFORE_TOOLS``, ``AFTER_TOOLS``). At a boundary every hook's
  ``on_interrupt_boundary`` is asked; their requests form one batch. At
  ``BEFORE_TOOLS`` the batch also holds the calls that need a person: approvals
  first, then client-tool calls, then the hooks' requests (ids unique in a batch).
* A non-empty batch ends the run paused: ``MessagesSnapshot``, then ``RunFinished``
  whose ``outcome`` is ``"interrupt"`` and whose ``interrupts`` is the batch. No
  terminal hook runs for a pause (the run did not end: a continuation resumes it).
* While any approval of a batch is pending, no call of that batch runs: the pause is
  taken before the first call of the batch starts, so the batch resumes as one.
* A continuation answers every interrupt of the batch exactly once
  (`validate_answers`): `Approve` (optionally with edited arguments) or `Reject`
  for an approval, `Respond` for a client tool (its output) or a generic interrupt
  (its response), `Cancel` for any. Unknown, duplicate, missing, wrongly-typed or
  invalid answers are one `InterruptResumeError` listing each issue; nothing runs.
* ``on_interrupt_resolution`` runs once per continuation whose batch holds generic
  interrupts, after ``on_config`` (phase init) and before ``on_start``; the most
  restrictive answer wins: ``stop`` > ``cancel`` > ``continue``. ``stop`` finishes
  the run at once (``on_finish`` runs); ``cancel`` answers every pending call
  "cancelled"; ``continue`` resumes where the run paused:

  ============  =====================================================
  paused at     a continuation goes on with
  ============  =====================================================
  before_model  the model call of the same turn
  after_model   the tool phase of that reply (``before_tools`` runs again)
  before_tools  the tool phase (that boundary is not asked again)
  after_tools   the next turn
  ============  =====================================================

* An approved call runs through everything its first arguments went through (the
  permission table, the path policy, the schema, every stage and guard); a
  rejected call is answered with the person's message (an error the model reads);
  a cancelled call with "cancelled by the user".
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import attrs
import jsonschema_rs

from .._errors import ConfigError, TrioAgentError
from .._json import json_problem
from .._models._messages import FinishReason, Message, ToolCallPart
from .._tools._definition import input_errors
from .._tools._results import JsonObject, ToolErrorType, ToolResult
from .._util import safe_repr
from ._rules import LoopState, Phase

__all__ = [
    "BOUNDARIES",
    "Approve",
    "Cancel",
    "ClientTool",
    "Interrupt",
    "InterruptAnswer",
    "InterruptDefinition",
    "InterruptIssue",
    "InterruptKind",
    "InterruptRequest",
    "InterruptResolution",
    "InterruptResolutions",
    "InterruptResumeError",
    "PauseState",
    "Reject",
    "Respond",
    "Resume",
    "ToolResume",
    "answer_to_json",
    "answered_without_running",
    "define_client_tool",
    "define_interrupt",
    "most_restrictive",
    "validate_answers",
]

BOUNDARIES = (Phase.BEFORE_MODEL, Phase.AFTER_MODEL, Phase.BEFORE_TOOLS, Phase.AFTER_TOOLS)


class InterruptKind(enum.StrEnum):
    APPROVAL = "approval"  # a tool call waits for a person's yes / no
    CLIENT_TOOL = "client_tool"  # a tool the client runs: the answer is its output
    GENERIC = "generic"  # a question a middleware asked (`InterruptDefinition`)


class ToolResume(enum.StrEnum):
    """What ``on_interrupt_resolution`` decides for the pending calls (most restrictive wins)."""

    CONTINUE = "continue"
    CANCEL = "cancel"
    STOP = "stop"


_RANK = {ToolResume.CONTINUE: 0, ToolResume.CANCEL: 1, ToolResume.STOP: 2}


def most_restrictive(values: Iterable[ToolResume | None]) -> ToolResume:
    """``stop`` > ``cancel`` > ``continue``; ``None`` has no effect."""
    best = ToolResume.CONTINUE
    for value in values:
        if value is not None and _RANK[value] > _RANK[best]:
            best = value
    return best


# ---------------------------------------------------------------- schemas


def _compile(schema: Mapping[str, Any] | None, what: str) -> jsonschema_rs.Validator | None:
    if schema is None:
        return None
    if not isinstance(schema, Mapping):
        raise ConfigError(f"{what} must be a JSON Schema object, got {safe_repr(schema)}")
    try:
        return jsonschema_rs.Draft202012Validator(dict(schema), offline=True)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        raise ConfigError(f"{what} is not valid JSON Schema: {str(exc).splitlines()[0]}") from None


def schema_errors(validator: jsonschema_rs.Validator | None, value: object) -> tuple[str, ...]:
    if validator is None:
        return ()
    try:
        return input_errors(validator, value)  # the tools' wording, lone surrogates included
    except (ValueError, TypeError) as exc:
        return (f"not JSON: {exc}",)


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def schema_hash(schema: Mapping[str, Any] | None) -> str | None:
    return None if schema is None else hashlib.sha256(canonical_json(schema).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- definitions


@attrs.frozen(eq=False)
class InterruptDefinition:
    """A kind of question a middleware may ask at a boundary (`define_interrupt`).

    Register it with the run (``chat(interrupts=[...])``, ``open_session(interrupts=[...])``
    or a middleware's ``interrupts``); ids are unique per run. Identity is the object.
    """

    id: str
    payload_schema: Mapping[str, Any] | None = None
    response_schema: Mapping[str, Any] | None = None
    _payload: jsonschema_rs.Validator | None = attrs.field(init=False, repr=False)
    _response: jsonschema_rs.Validator | None = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id.strip():
            raise ConfigError(f"an interrupt definition needs a non-empty id, got {safe_repr(self.id)}")
        if self.payload_schema is None and self.response_schema is None:
            raise ConfigError(f"interrupt {self.id!r}: give a payload_schema, a response_schema or both")
        object.__setattr__(self, "_payload", _compile(self.payload_schema, f"interrupt {self.id!r} payload_schema"))
        object.__setattr__(self, "_response", _compile(self.response_schema, f"interrupt {self.id!r} response_schema"))

    def request(self, key: str, message: str, *, reason: str = "", payload: Any = None) -> InterruptRequest:
        """A question of this kind; *payload* is checked against ``payload_schema`` now."""
        if not isinstance(key, str) or not key:
            raise ConfigError(f"interrupt {self.id!r}: key must be a non-empty string, got {safe_repr(key)}")
        if not isinstance(message, str):
            raise ConfigError(f"interrupt {self.id!r}: message must be a string, got {safe_repr(message)}")
        if not isinstance(reason, str):
            raise ConfigError(f"interrupt {self.id!r}: reason must be a string, got {safe_repr(reason)}")
        if payload is not None:
            if self._payload is None:
                raise ConfigError(f"interrupt {self.id!r} has no payload_schema: it takes no payload")
            errors = schema_errors(self._payload, payload)
            if errors:
                raise ConfigError(f"interrupt {self.id!r}: invalid payload: " + "; ".join(errors))
        request = InterruptRequest(self, key, message, reason, payload)
        object.__setattr__(request, "_checked", True)
        return request

    def response_errors(self, value: object) -> tuple[str, ...]:
        return schema_errors(self._response, value)


def define_interrupt(
    id: str, *, payload_schema: Mapping[str, Any] | None = None, response_schema: Mapping[str, Any] | None = None
) -> InterruptDefinition:
    """A kind of question with typed payload and response schemas (at least one)."""
    return InterruptDefinition(id, payload_schema, response_schema)


@attrs.frozen
class InterruptRequest:
    """What ``on_interrupt_boundary`` returns (built by `InterruptDefinition.request`, which checks
    it; one built directly is checked by the same rules when a hook returns it: `checked_request`)."""

    definition: InterruptDefinition
    key: str
    message: str
    reason: str = ""
    payload: Any = None
    # Set only by `InterruptDefinition.request`: what it built is not checked again.
    _checked: bool = attrs.field(default=False, init=False, eq=False, repr=False)


def checked_request(request: object) -> InterruptRequest:
    """*request* as its definition's `InterruptDefinition.request` checks it (that one's own, as it is;
    one built directly, rebuilt through it): a `ConfigError` saying what is wrong, never a request a
    pause cannot hold (a payload that is no JSON, or that its ``payload_schema`` refuses, a key or a
    message that is no string)."""
    if not isinstance(request, InterruptRequest):
        raise ConfigError(
            f"{safe_repr(request)} is not an InterruptRequest (build one with an InterruptDefinition's request())"
        )
    if request._checked:
        return request
    definition = request.definition
    if not isinstance(definition, InterruptDefinition):
        raise ConfigError(
            f"an InterruptRequest's definition must be an InterruptDefinition, got {safe_repr(definition)}"
        )
    return definition.request(request.key, request.message, reason=request.reason, payload=request.payload)


@attrs.frozen(eq=False)
class ClientTool:
    """A tool the client runs (`define_client_tool`): a call pauses the run; the answer is its output."""

    name: str
    description: str
    input_schema: Mapping[str, Any]
    output_schema: Mapping[str, Any] | None = None
    _input: jsonschema_rs.Validator | None = attrs.field(init=False, repr=False)
    _output: jsonschema_rs.Validator | None = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"a client tool needs a non-empty name, got {safe_repr(self.name)}")
        if not isinstance(self.description, str):  # the model is offered it as the tool's description
            raise ConfigError(
                f"client tool {self.name!r} description must be a string, got {safe_repr(self.description)}"
            )
        object.__setattr__(self, "_input", _compile(self.input_schema, f"client tool {self.name!r} input_schema"))
        object.__setattr__(self, "_output", _compile(self.output_schema, f"client tool {self.name!r} output_schema"))
        # Its own copy, made once the schema is known to be a mapping: the caller's may change later.
        object.__setattr__(self, "input_schema", dict(self.input_schema))

    def input_errors(self, value: object) -> tuple[str, ...]:
        return schema_errors(self._input, value)

    def output_errors(self, value: object) -> tuple[str, ...]:
        return schema_errors(self._output, value)


def define_client_tool(
    name: str,
    description: str = "",
    *,
    input_schema: Mapping[str, Any] | None = None,
    output_schema: Mapping[str, Any] | None = None,
) -> ClientTool:
    """A tool declared without a server implementation (the client runs it)."""
    # Anything else is ClientTool's to refuse (ConfigError): a dict() here turned a string or a
    # number into a raw ValueError / TypeError, and a list of pairs into a schema.
    if input_schema is None or (isinstance(input_schema, Mapping) and not input_schema):
        input_schema = {"type": "object"}
    return ClientTool(name, description, input_schema, output_schema)


# ---------------------------------------------------------------- the batch


@attrs.frozen
class Interrupt:
    """One question of a paused run's batch (JSON-serialisable; see `InterruptKind`)."""

    id: str
    kind: InterruptKind
    message: str
    reason: str = ""
    tool_call_id: str | None = None
    tool_name: str | None = None
    input: JsonObject | None = None  # the call's arguments (approval, client tool)
    definition_id: str | None = None
    key: str | None = None
    payload: Any = None
    response_schema: Mapping[str, Any] | None = None


def approval_interrupt(call: ToolCallPart, arguments: JsonObject, message: str) -> Interrupt:
    return Interrupt(f"approval_{call.id}", InterruptKind.APPROVAL, message, "tool_call", call.id, call.name, arguments)


def client_tool_interrupt(call: ToolCallPart, arguments: JsonObject, tool: ClientTool) -> Interrupt:
    return Interrupt(
        f"client_tool_{call.id}", InterruptKind.CLIENT_TOOL, f"run client tool {call.name!r}",
        "client_tool_execution", call.id, call.name, arguments, response_schema=tool.output_schema,
    )  # fmt: skip


def generic_interrupt(request: InterruptRequest) -> Interrupt:
    definition = request.definition
    return Interrupt(
        f"{definition.id}:{request.key}", InterruptKind.GENERIC, request.message, request.reason,
        definition_id=definition.id, key=request.key, payload=request.payload,
        response_schema=definition.response_schema,
    )  # fmt: skip


# ---------------------------------------------------------------- answers


@attrs.frozen
class Approve:
    """Run the call; *edited_args* (a JSON object) replace its arguments and are checked like them."""

    interrupt_id: str
    edited_args: JsonObject | None = None


@attrs.frozen
class Reject:
    """Do not run the call; the model reads *message* as its (error) answer."""

    interrupt_id: str
    message: str | None = None


@attrs.frozen
class Respond:
    """The answer of a client tool (its output) or of a generic interrupt (its response)."""

    interrupt_id: str
    value: Any = None


@attrs.frozen
class Cancel:
    """Abandon the question; a call is answered "cancelled"."""

    interrupt_id: str


InterruptAnswer: TypeAlias = Approve | Reject | Respond | Cancel


@attrs.frozen
class InterruptIssue:
    """One thing wrong with a continuation (``code``: ``unknown_interrupt``, ``duplicate``,
    ``missing``, ``wrong_answer``, ``invalid_edited_args``, ``invalid_tool_output``,
    ``invalid_response``, ``stale``, ``tampered``, ``invalid_payload``)."""

    interrupt_id: str | None
    code: str
    message: str


class InterruptResumeError(TrioAgentError):
    """A continuation that cannot resume the run; ``issues`` names each bad answer. Nothing ran."""

    code = "interrupt_resume"

    def __init__(self, issues: Sequence[InterruptIssue]) -> None:
        self.issues = tuple(issues)
        text = "; ".join(f"{i.interrupt_id or '<continuation>'}: {i.code}: {i.message}" for i in self.issues)
        super().__init__(f"the continuation was refused ({len(self.issues)} issue(s)): {text}")
        self.code = self.issues[0].code if self.issues else "interrupt_resume"


@attrs.frozen
class InterruptResolution:
    """A generic interrupt as answered: ``status`` is ``"resolved"`` (with ``response``) or ``"cancelled"``."""

    interrupt: Interrupt
    status: str
    response: Any = None


@attrs.frozen
class InterruptResolutions:
    """What ``on_interrupt_resolution`` receives: the generic answers of the batch, in batch order."""

    items: tuple[InterruptResolution, ...] = ()

    def all(self) -> tuple[InterruptResolution, ...]:
        return self.items

    def of(self, definition: InterruptDefinition) -> tuple[InterruptResolution, ...]:
        """The answers to questions of *definition*."""
        return tuple(item for item in self.items if item.interrupt.definition_id == definition.id)

    def __iter__(self) -> Iterator[InterruptResolution]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


# ---------------------------------------------------------------- the resume point


@attrs.frozen
class PauseState:
    """Where a run paused: everything a continuation needs besides the answers (JSON via cattrs)."""

    phase: Phase
    interrupts: tuple[Interrupt, ...]
    messages: tuple[Message, ...]  # the history at the pause, without the system prompt
    pending_calls: tuple[ToolCallPart, ...] = ()  # the reply's calls, none answered yet (in call order)
    turns: int = 0
    state: LoopState = attrs.field(factory=LoopState)
    text: str = ""
    refused: Mapping[str, ToolResult] = attrs.field(factory=dict)  # pending calls refused before they could run
    inputs: tuple[str, ...] = ()  # paused before the model: the input that joined the turn
    finish: FinishReason | None = None  # paused after the reply: why it finished

    def interrupt(self, interrupt_id: str) -> Interrupt | None:
        return next((item for item in self.interrupts if item.id == interrupt_id), None)


@attrs.frozen
class Resume:
    """A continuation as the loop takes it: where the run paused, and the answers."""

    pause: PauseState
    answers: tuple[InterruptAnswer, ...]
    parent_run_id: str


def validate_answers(
    pause: PauseState, answers: Sequence[object], client_tools: Mapping[str, ClientTool]
) -> tuple[dict[str, InterruptAnswer], list[InterruptIssue]]:
    """The answers by interrupt id, and every issue that is visible without running anything
    (edited arguments are checked by the gate afterwards)."""
    issues: list[InterruptIssue] = []
    by_id: dict[str, InterruptAnswer] = {}
    if pause.phase not in BOUNDARIES:
        issues.append(InterruptIssue(None, "invalid_payload", f"a run cannot pause at {pause.phase.value!r}"))
    for index, answer in enumerate(answers):
        if not isinstance(answer, (Approve, Reject, Respond, Cancel)):
            issues.append(InterruptIssue(None, "wrong_answer", f"answer #{index} is not Approve, Reject, Respond "
                                         f"or Cancel: {safe_repr(answer)}"))  # fmt: skip
            continue
        interrupt = pause.interrupt(answer.interrupt_id)
        if interrupt is None:
            known = ", ".join(item.id for item in pause.interrupts) or "none"
            issues.append(InterruptIssue(answer.interrupt_id, "unknown_interrupt",
                                         f"the paused run asked no such question (asked: {known})"))  # fmt: skip
            continue
        if answer.interrupt_id in by_id:
            issues.append(InterruptIssue(answer.interrupt_id, "duplicate", "answered more than once"))
            continue
        by_id[answer.interrupt_id] = answer
        issue = _answer_issue(interrupt, answer, client_tools) or _unkept_payload(answer)
        if issue is not None:
            issues.append(issue)
    for interrupt in pause.interrupts:
        if interrupt.id not in by_id and not any(i.interrupt_id == interrupt.id for i in issues):
            issues.append(InterruptIssue(interrupt.id, "missing", f"no answer to {interrupt.kind} question "
                                         f"{interrupt.message!r}"))  # fmt: skip
    return by_id, issues


def _unkept_payload(answer: InterruptAnswer) -> InterruptIssue | None:
    """An answer no journal could keep (a number that is not finite, containers nested too
    deeply): refused with the other issues, before anything runs, never when the continuation
    records it (which would fail the request). Paths as the answers are recorded."""
    for field in attrs.fields(type(answer)):
        where = f"answers.{answer.interrupt_id}.{field.name}"
        problem = json_problem(getattr(answer, field.name), where, depth=2)
        if problem is not None:
            return InterruptIssue(answer.interrupt_id, "invalid_payload", problem)
    return None


def _answer_issue(
    interrupt: Interrupt, answer: InterruptAnswer, client_tools: Mapping[str, ClientTool]
) -> InterruptIssue | None:
    if isinstance(answer, Cancel):
        return None  # a cancel carries nothing to check, even if the tool changed since
    kind = interrupt.kind
    if kind is InterruptKind.APPROVAL:
        if isinstance(answer, Respond):
            return InterruptIssue(interrupt.id, "wrong_answer", "an approval takes Approve, Reject or Cancel")
        if isinstance(answer, Approve) and answer.edited_args is not None and not isinstance(answer.edited_args, dict):
            got = type(answer.edited_args).__name__
            return InterruptIssue(interrupt.id, "invalid_edited_args", f"edited_args must be a JSON object, got {got}")
        if isinstance(answer, Reject) and answer.message is not None and not isinstance(answer.message, str):
            return InterruptIssue(interrupt.id, "wrong_answer", "a rejection's message must be a string")
        return None
    if not isinstance(answer, Respond):
        return InterruptIssue(interrupt.id, "wrong_answer", f"a {kind} question takes Respond or Cancel")
    if kind is InterruptKind.CLIENT_TOOL:
        tool = client_tools.get(interrupt.tool_name or "")
        if tool is None:
            return InterruptIssue(interrupt.id, "stale", f"client tool {interrupt.tool_name!r} is not offered any more")
        errors = tool.output_errors(answer.value)
        if errors:
            return InterruptIssue(interrupt.id, "invalid_tool_output", "; ".join(errors))
        return None
    try:
        validator = _compile(interrupt.response_schema, f"interrupt {interrupt.id!r} response_schema")
    except ConfigError as exc:  # a paused state from outside may carry anything
        return InterruptIssue(interrupt.id, "invalid_payload", str(exc))
    errors = schema_errors(validator, answer.value)
    if errors:
        return InterruptIssue(interrupt.id, "invalid_response", "; ".join(errors))
    return None


CANCELLED_ANSWER = "cancelled by the user"
STOPPED_ANSWER = "cancelled: the run was stopped"


def _cancelled(text: str) -> ToolResult:
    return ToolResult.failure(ToolErrorType.VALIDATION, text, code="cancelled")


def answered_without_running(
    pause: PauseState, answers: Mapping[str, InterruptAnswer], resume: ToolResume
) -> dict[str, ToolResult]:
    """The answer of every pending call a continuation answers without running it: all of them
    on ``stop`` / ``cancel``; else rejected or cancelled approvals and client tools' outputs."""
    if resume is not ToolResume.CONTINUE:
        text = STOPPED_ANSWER if resume is ToolResume.STOP else CANCELLED_ANSWER
        return {part.id: _cancelled(text) for part in pause.pending_calls if part.id not in pause.refused}
    results: dict[str, ToolResult] = {}
    for interrupt in pause.interrupts:
        answer = answers.get(interrupt.id)
        call_id = interrupt.tool_call_id
        if call_id is None or answer is None or isinstance(answer, Approve):
            continue
        if isinstance(answer, Cancel):
            results[call_id] = _cancelled(CANCELLED_ANSWER)
        elif isinstance(answer, Reject):
            message = answer.message or "the user declined to run this call"
            results[call_id] = ToolResult.failure(ToolErrorType.PERMISSION_DENIED, message, code="rejected")
        elif isinstance(answer, Respond):
            results[call_id] = ToolResult.success(answer.value)
    return results


def answer_to_json(answer: InterruptAnswer) -> JsonObject:
    """An answer as JSON (``{"type": "approve" | "reject" | "respond" | "cancel", ...}``)."""
    return {"type": type(answer).__name__.lower(), **attrs.asdict(answer)}
