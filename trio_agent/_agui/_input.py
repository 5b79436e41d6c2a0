"""AG-UI's ``RunAgentInput``: what a client posts to start (or continue) a run, read strictly.

Rules
=====

* The body is one JSON object with AG-UI's camelCase keys: ``threadId``, ``runId``
  (ids by the rules of a session id, `validate_id`: non-empty text of at most 200
  characters, no ``/``, no control character, no lone surrogate; a thread id is a
  session id, and either may be a path segment: ``/runs/{runId}/abort``, so neither
  may be ``.`` or ``..``, which a URL client removes from a path), ``messages``
  (each with ``id`` and ``role``: ``user``, ``system``, ``developer``, ``assistant``
  with optional ``toolCalls``, ``tool`` with ``toolCallId``; ``reasoning`` and
  ``activity`` messages are accepted and left out of the history), optional ``tools``
  (the client's own tools: ``name``, each name once, ``description``,
  ``parameters``), ``context`` (``{description, value}``, both
  strings: checked, not used), ``state``, ``forwardedProps``, ``parentRunId``,
  ``protocolVersion`` (a string) and ``resume`` (``interruptId``, ``status``
  ``resolved`` | ``cancelled``, ``payload``). Unknown keys are ignored (the
  protocol grows); a wrong type or a missing key is an `InputError` that lists
  every problem with its JSON path. So is a number anywhere in the body that is not
  finite (a literal too large for a float, such as ``1e400``, reads as infinity; JSON
  has no infinity, and no model, journal or client could take it).
* Content given as a list of parts keeps its text parts, joined.
* Whether the messages are a conversation a run can start from is the host's to ask
  (`check_history`, what ``chat()`` checks): a host that reads only the last message
  (a thread backed by a session) does not.
* Answers: ``cancelled`` is `Cancel`; ``resolved`` answers an approval with
  ``payload.approved`` (``true``: `Approve`, with ``payload.editedArgs`` if given;
  ``false``: `Reject` with ``payload.message``) and anything else with `Respond`
  carrying the payload. An approval's payload is read strictly (`answers_for` raises
  `InterruptResumeError`): ``approved`` must be a boolean, ``message`` a string if
  given, and ``editedArgs`` a JSON object or, as AG-UI carries a tool call's
  arguments, a JSON string holding one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from .._config import validate_id
from .._errors import ConfigError, HistoryError
from .._loop._interrupts import (
    Approve,
    Cancel,
    ClientTool,
    Interrupt,
    InterruptAnswer,
    InterruptIssue,
    InterruptKind,
    InterruptResumeError,
    Reject,
    Respond,
    define_client_tool,
)
from .._models._assemble import JSONTextError, parse_json_value
from .._models._history import validate_history
from .._models._messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    TextPart,
    ToolCallPart,
    ToolResultMessage,
    UserMessage,
)

__all__ = ["InputError", "ResumeEntry", "RunInput", "answers_for", "check_history", "parse_run_input"]


class InputError(ConfigError):
    """A posted ``RunAgentInput`` that cannot be read; ``problems`` lists each (``path: what``)."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid RunAgentInput: " + "; ".join(self.problems))


@attrs.frozen
class ResumeEntry:
    interrupt_id: str
    status: str
    payload: Any = None


@attrs.frozen
class RunInput:
    """A read ``RunAgentInput``."""

    thread_id: str
    run_id: str
    messages: tuple[Message, ...]
    tools: tuple[ClientTool, ...] = ()
    resume: tuple[ResumeEntry, ...] = ()
    state: Any = None
    forwarded_props: Any = None
    parent_run_id: str | None = None
    message_index: tuple[int, ...] = ()
    """Where each of ``messages`` is in the input's ``messages`` (the ones left out of the history
    take no place), so a problem found later can name it by its JSON path."""


class _Reader:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, path: str, what: str) -> None:
        self.problems.append(f"{path}: {what}")

    def text(self, data: Mapping[str, Any], key: str, path: str, *, required: bool = True) -> str | None:
        value = data.get(key)
        if value is None:
            if required:
                self.fail(f"{path}.{key}", "missing")
            return None
        if not isinstance(value, str) or (required and not value):
            self.fail(f"{path}.{key}", f"expected a non-empty string, got {_kind(value)}")
            return None
        return value

    def identifier(self, data: Mapping[str, Any], key: str) -> str | None:
        """An id by the rules of a session id (a thread id is one; a run id names a URL's segment)."""
        value = self.text(data, key, "$")
        if value is None:
            return None
        try:
            value = validate_id(value, name=key)
        except ConfigError as exc:
            self.fail(f"$.{key}", str(exc))
            return None
        if value in (".", ".."):
            self.fail(f"$.{key}", f"{key} must not be {value!r}: URL clients remove such a path segment")
            return None
        return value

    def content(self, data: Mapping[str, Any], path: str) -> str | None:
        value = data.get("content")
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = [part.get("text") for part in value if isinstance(part, dict) and part.get("type") == "text"]
            if all(isinstance(text, str) for text in texts):
                return "".join(texts)  # type: ignore[arg-type]
        got = "missing" if value is None else f"got {_kind(value)}"
        self.fail(f"{path}.content", f"expected a string or a list of parts, {got}")
        return None


def _message(reader: _Reader, data: object, path: str) -> Message | None:
    if not isinstance(data, dict):
        reader.fail(path, f"expected an object, got {_kind(data)}")
        return None
    reader.text(data, "id", path)
    role = data.get("role")
    if role in ("user", "system", "developer"):
        content = reader.content(data, path)
        if content is None:
            return None
        return UserMessage(content) if role == "user" else SystemMessage(content)
    if role == "assistant":
        parts: list[Any] = []
        content = data.get("content")
        if content is not None:
            if not isinstance(content, str):
                reader.fail(f"{path}.content", f"expected a string, got {_kind(content)}")
            elif content:
                parts.append(TextPart(content))
        calls = data.get("toolCalls")
        if calls is None:
            calls = []
        elif not isinstance(calls, list):
            reader.fail(f"{path}.toolCalls", f"expected a list, got {_kind(calls)}")
            calls = []
        for index, call in enumerate(calls):
            where = f"{path}.toolCalls[{index}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(call, dict) or not isinstance(function, dict):
                reader.fail(where, "expected {id, function: {name, arguments}}")
                continue
            call_id = reader.text(call, "id", where)
            name = reader.text(function, "name", f"{where}.function")
            arguments = function.get("arguments", "")
            if not isinstance(arguments, str):
                reader.fail(f"{where}.function.arguments", f"expected a JSON string, got {_kind(arguments)}")
            elif call_id is not None and name is not None:
                parts.append(ToolCallPart(call_id, name, arguments))
        return AssistantMessage(parts)
    if role == "tool":
        call_id = reader.text(data, "toolCallId", path)
        content = reader.content(data, path)
        if call_id is None or content is None:
            return None
        error = data.get("error")
        if error is not None and not isinstance(error, str):
            reader.fail(f"{path}.error", f"expected a string (the error's text), got {_kind(error)}")
            return None
        return ToolResultMessage(call_id, content, is_error=bool(error))
    if role in ("reasoning", "activity"):
        return None  # not part of the history the model reads
    reader.fail(f"{path}.role", f"unknown role {role!r}")
    return None


def _tool(reader: _Reader, data: object, path: str) -> ClientTool | None:
    if not isinstance(data, dict):
        reader.fail(path, f"expected an object, got {_kind(data)}")
        return None
    name = reader.text(data, "name", path)
    description = reader.text(data, "description", path, required=False) or ""
    parameters = data.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        reader.fail(f"{path}.parameters", f"expected a JSON Schema object, got {_kind(parameters)}")
        return None
    if name is None:
        return None
    try:
        return define_client_tool(name, description, input_schema=parameters)
    except ConfigError as exc:
        reader.fail(path, str(exc))
        return None


def _resume(reader: _Reader, data: object, path: str) -> ResumeEntry | None:
    if not isinstance(data, dict):
        reader.fail(path, f"expected an object, got {_kind(data)}")
        return None
    interrupt_id = reader.text(data, "interruptId", path)
    status = data.get("status")
    if status not in ("resolved", "cancelled"):
        reader.fail(f"{path}.status", f"expected 'resolved' or 'cancelled', got {status!r}")
        return None
    return None if interrupt_id is None else ResumeEntry(interrupt_id, status, data.get("payload"))


def _unique_names(reader: _Reader, tools: Sequence[ClientTool | None]) -> None:
    """Two client tools of one name: a run could not tell which the model called."""
    first: dict[str, int] = {}
    for index, tool in enumerate(tools):
        if tool is None:
            continue
        seen = first.setdefault(tool.name, index)
        if seen != index:
            reader.fail(f"$.tools[{index}].name", f"{tool.name!r} is the name of $.tools[{seen}] already")


def check_history(run_input: RunInput) -> None:
    """`InputError` if the input's messages are not a conversation a run can start from: the check
    ``chat()`` makes of a history (`validate_history`: it starts with a user message, no system
    message, each tool call answered by the tool results right after it, once, call ids unique),
    the message at fault named by its place in ``$.messages``."""
    try:
        validate_history(run_input.messages)
    except HistoryError as exc:
        where, said = "$.messages", str(exc)
        if exc.index is not None:  # named by its own path: "history[i]" counts no left-out message
            where = f"$.messages[{run_input.message_index[exc.index]}]"
            head = f"history[{exc.index}]"
            said = said.removeprefix(f"{head}: ")
            if said.startswith(f"{head} "):
                said = "this message" + said.removeprefix(head)
        raise InputError([f"{where}: {said}"]) from None


def _context(reader: _Reader, data: object, path: str) -> None:
    """One ``context`` item: ``{description, value}``, both strings (read, not kept: the app's
    own instructions say what a run knows)."""
    if not isinstance(data, dict):
        reader.fail(path, f"expected an object {{description, value}}, got {_kind(data)}")
        return
    for key in ("description", "value"):
        value = data.get(key)
        if not isinstance(value, str):
            reader.fail(f"{path}.{key}", "missing" if value is None else f"expected a string, got {_kind(value)}")


def _non_finite(data: object) -> list[str]:
    """Where ``data`` (decoded JSON) holds a number that is not finite. Without recursion: a body
    nests as deeply as the decoder let it."""
    problems: list[str] = []
    pending: list[tuple[str, object]] = [("$", data)]
    while pending:
        path, value = pending.pop()
        items: Any = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if type(item) is float:
                if not math.isfinite(item):
                    problems.append(f"{_at(path, key)}: not a finite number (it reads as {item!r})")
            elif isinstance(item, (dict, list)) and item:
                pending.append((_at(path, key), item))
    return sorted(problems)


def _at(path: str, key: object) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}"


def parse_run_input(data: object) -> RunInput:
    """Read a decoded ``RunAgentInput`` body; `InputError` names every problem."""
    reader = _Reader()
    if not isinstance(data, dict):
        raise InputError([f"$: expected a JSON object, got {_kind(data)}"])
    thread_id = reader.identifier(data, "threadId")
    run_id = reader.identifier(data, "runId")
    parent = reader.text(data, "parentRunId", "$", required=False)
    reader.text(data, "protocolVersion", "$", required=False)
    lists: dict[str, list[Any]] = {}
    for key in ("messages", "tools", "context", "resume"):
        value = data.get(key, [] if key != "messages" else None)
        if value is None and key != "messages":
            value = []
        if value is None:
            reader.fail(f"$.{key}", "missing")
            value = []
        elif not isinstance(value, list):
            reader.fail(f"$.{key}", f"expected a list, got {_kind(value)}")
            value = []
        lists[key] = value
    messages = [_message(reader, item, f"$.messages[{i}]") for i, item in enumerate(lists["messages"])]
    tools = [_tool(reader, item, f"$.tools[{i}]") for i, item in enumerate(lists["tools"])]
    for index, item in enumerate(lists["context"]):
        _context(reader, item, f"$.context[{index}]")
    _unique_names(reader, tools)
    resume = [_resume(reader, item, f"$.resume[{i}]") for i, item in enumerate(lists["resume"])]
    reader.problems.extend(_non_finite(data))
    if reader.problems:
        raise InputError(reader.problems)
    assert thread_id is not None and run_id is not None
    return RunInput(
        thread_id=thread_id,
        run_id=run_id,
        messages=tuple(m for m in messages if m is not None),
        message_index=tuple(index for index, m in enumerate(messages) if m is not None),
        tools=tuple(t for t in tools if t is not None),
        resume=tuple(r for r in resume if r is not None),
        state=data.get("state"),
        forwarded_props=data.get("forwardedProps"),
        parent_run_id=parent,
    )


def answers_for(entries: Sequence[ResumeEntry], interrupts: Sequence[Interrupt]) -> list[InterruptAnswer]:
    """The answers ``entries`` give to a paused run's ``interrupts`` (see the module rules). An entry
    for an unknown interrupt is answered `Respond` and left for the run's own checks to refuse.

    An approval's payload is read strictly: a decision that cannot be read is refused
    (`InterruptResumeError`, every issue named) rather than guessed, since a guess either runs the
    model's own input in place of the edit or rejects what the person approved."""
    kinds = {interrupt.id: interrupt.kind for interrupt in interrupts}
    answers: list[InterruptAnswer] = []
    issues: list[InterruptIssue] = []
    for entry in entries:
        payload = entry.payload
        if entry.status == "cancelled":
            answers.append(Cancel(entry.interrupt_id))
        elif kinds.get(entry.interrupt_id) is InterruptKind.APPROVAL and isinstance(payload, dict):
            answer, problems = _approval(entry.interrupt_id, payload)
            issues.extend(problems)
            if answer is not None:
                answers.append(answer)
        else:
            answers.append(Respond(entry.interrupt_id, payload))
    if issues:
        raise InterruptResumeError(issues)
    return answers


def _approval(interrupt_id: str, payload: Mapping[str, Any]) -> tuple[Approve | Reject | None, list[InterruptIssue]]:
    """An approval's payload as `Approve` / `Reject`, or what is wrong with it."""
    issues: list[InterruptIssue] = []

    def wrong(code: str, message: str) -> None:
        issues.append(InterruptIssue(interrupt_id, code, message))

    approved = payload.get("approved")
    if not isinstance(approved, bool):
        wrong("wrong_answer", f"payload.approved must be true or false, got {_kind(approved)}")
    edited = _edited_args(payload.get("editedArgs"), wrong)
    message = payload.get("message")
    if message is not None and not isinstance(message, str):
        wrong("wrong_answer", f"payload.message must be a string, got {_kind(message)}")
    if issues:
        return None, issues
    if approved:
        return Approve(interrupt_id, edited), issues
    return Reject(interrupt_id, message), issues


def _edited_args(value: object, wrong: Callable[[str, str], None]) -> dict[str, Any] | None:
    """``payload.editedArgs``: a JSON object, or (as AG-UI carries a tool call's arguments: a
    ``function.arguments``, a ``TOOL_CALL_ARGS`` delta) a JSON string holding one. Absent or
    ``null`` is no edit."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        # Read as the model's own arguments are (a depth limit, finite numbers only): json.loads
        # turned 1e999 into inf, which passed here and was refused later as a bad payload.
        try:
            decoded = parse_json_value(value)
        except JSONTextError as exc:
            wrong("invalid_edited_args", f"payload.editedArgs is a string that is {exc.problem}")
            return None
        if isinstance(decoded, dict):
            return decoded
        holds = _kind(decoded)
        wrong("invalid_edited_args", f"payload.editedArgs must hold a JSON object, its string holds {holds}")
        return None
    got = _kind(value)
    wrong("invalid_edited_args", f"payload.editedArgs must be a JSON object (or one as a JSON string), got {got}")
    return None


def _kind(value: object) -> str:
    """A decoded JSON value's kind, in JSON's words (what the client sent, not a Python type)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__
