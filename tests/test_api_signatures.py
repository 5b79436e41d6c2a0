"""The signatures written in docs/api.md's code blocks match the code (inspect.signature).

For a curated list of public callables, the test finds the call written in the ``python
fragment`` blocks of the callable's api.md section, parses its parameter list with ``ast``
and compares it with ``inspect.signature``: the names in order, their kinds (positional-only,
keyword-only, ``*args``, ``**kwargs``) and their defaults. Class blocks written as fields
(``@attrs.frozen class X: a: int; b: str = ""``) are compared with the constructor the same
way, kinds aside (a field list has none).

What api.md abbreviates on purpose is not held against it, and is named where it happens:

* a default written ``...`` (``schema=...``): given in the prose; only "has a default" is checked;
* a default written ``<in words>`` (``<32; None for a MemoryStore>``): a sentinel in the code;
  likewise only "has a default";
* ``32 MiB`` is read as 33554432;
* the Events block writes each journal event positionally, for brevity; the prose says every
  event is keyword-only, which is checked once for all of them instead of per parameter;
* the entries' own notes (``skip_defaults``, ``init_only``) say what else a block leaves out.

Adding an entry: the section heading as written after the ``#``s, the callable's name as written
in the block (``service.with_model``, ``execute``), and the object.
"""

from __future__ import annotations

import ast
import enum
import inspect
import math
import os
import re
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import trio_agent
import trio_agent.journal
import trio_agent.lifecycle
import trio_agent.middleware
import trio_agent.models
import trio_agent.permissions
import trio_agent.plugins
import trio_agent.testing
import trio_agent.tools
import trio_agent.workers

ROOT = Path(__file__).resolve().parent.parent
API = (ROOT / "docs" / "api.md").read_text()

_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)
_HEADING = re.compile(r"^#{2,4} (.*)$", re.M)
# A call at the start of a statement, or after whitespace / `;` (two signatures on one line).
_CALL = re.compile(r"(?:^|(?<=[\s;]))((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(")
_STATEMENT_PREFIX = re.compile(
    r"^(?:(?:async with await|async with|with|await|async def|def|async)\s+|\w+ = (?:await )?)+"
)
_PLACEHOLDER = re.compile(r"<[A-Za-z0-9][^<>\n]*>")

_MODULES = [
    trio_agent,
    trio_agent.journal,
    trio_agent.lifecycle,
    trio_agent.middleware,
    trio_agent.models,
    trio_agent.permissions,
    trio_agent.plugins,
    trio_agent.testing,
    trio_agent.tools,
    trio_agent.workers,
]
# What a default written in api.md may name: the public names, and the few modules it uses.
_NAMESPACE: dict[str, Any] = {"trio": trio, "os": os, "math": math}
for _module in reversed(_MODULES):  # trio_agent's own name wins a clash
    _NAMESPACE.update({name: getattr(_module, name) for name in _module.__all__})

_ABBREVIATED = "__abbreviated__"  # `...` or `<in words>`: the prose gives the default


# ---------------------------------------------------------------- reading api.md


def _section(heading: str) -> str:
    """The text under the heading written exactly `heading`, up to the next heading."""
    for match in _HEADING.finditer(API):
        if match.group(1).strip() == heading:
            following = _HEADING.search(API, match.end())
            return API[match.end() : following.start() if following else len(API)]
    raise AssertionError(f"api.md has no heading {heading!r}")


def _fragments(heading: str) -> list[str]:
    return [m.group(2) for m in _BLOCK.finditer(_section(heading)) if "fragment" in m.group(1)]


def _without_comment(line: str) -> str:
    # Signature blocks put no '#' inside strings, so the first one starts the comment.
    return line.split("#", 1)[0].rstrip()


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes text[start]."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] in "([{":
            depth += 1
        elif text[index] in ")]}":
            depth -= 1
            if depth == 0:
                return index + 1
    raise AssertionError(f"unbalanced brackets in api.md: {text[start : start + 80]!r}")


def _statements(block: str) -> Iterator[str]:
    """The block's logical lines (brackets joined across lines), comments removed."""
    lines = [_without_comment(line) for line in block.split("\n")]
    index = 0
    while index < len(lines):
        logical = lines[index].strip()
        index += 1
        while sum(map(logical.count, "([{")) > sum(map(logical.count, ")]}")) and index < len(lines):
            logical += " " + lines[index].strip()
            index += 1
        if logical:
            yield logical


def _written_calls(heading: str) -> dict[str, list[str]]:
    """Each callee written at statement level in the section's fragments -> its parameter texts."""
    calls: dict[str, list[str]] = {}
    for block in _fragments(heading):
        for statement in _statements(block):
            code = _STATEMENT_PREFIX.sub("", statement)
            position = 0
            while match := _CALL.search(code, position):
                end = _closing(code, match.end() - 1)
                calls.setdefault(match.group(1), []).append(code[match.end() : end - 1])
                position = end
    return calls


Param = tuple[str, inspect._ParameterKind, "ast.expr | None"]


def _parse_params(text: str) -> list[Param]:
    text = _PLACEHOLDER.sub(_ABBREVIATED, text).replace("32 MiB", "33554432")
    text = re.sub(r"=\s*\.\.\.(?=\s*[,)]|\s*$)", "=" + _ABBREVIATED, text)
    function = ast.parse(f"def f({text}): pass").body[0]
    assert isinstance(function, ast.FunctionDef)
    args = function.args
    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params: list[Param] = []
    for arg, default in zip(positional, defaults, strict=True):
        kind = inspect.Parameter.POSITIONAL_ONLY if arg in args.posonlyargs else inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append((arg.arg, kind, default))
    if args.vararg:
        params.append((args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    params += [
        (arg.arg, inspect.Parameter.KEYWORD_ONLY, d) for arg, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        params.append((args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None))
    return params


def _class_fields(heading: str, name: str) -> tuple[list[Param], str]:
    """A class block's fields (`name: type = default`, split on `;`) and its comments."""
    for block in _fragments(heading):
        lines = block.split("\n")
        for index, line in enumerate(lines):
            if not re.search(rf"\bclass {name}\b", line):
                continue
            indent = len(line) - len(line.lstrip())
            body = [line.split(f"class {name}", 1)[1].split(":", 1)[1]]
            for following in lines[index + 1 :]:
                if not following.strip() or len(following) - len(following.lstrip()) <= indent:
                    break
                body.append(following)
            comments = " ".join(part.split("#", 1)[1] for part in body if "#" in part)
            fields: list[Param] = []
            # One field per line, or several on a line separated by `;`.
            for part in (f for line in body for f in _without_comment(line).split(";")):
                if not part.strip():
                    continue
                match = re.fullmatch(r"\s*(\w+)\s*(?::[^=]*)?(?:=\s*(.+?))?\s*", part)
                assert match, f"api.md: cannot read the field {part!r} of class {name}"
                default = match.group(2)
                node = None if default is None else ast.parse(_PLACEHOLDER.sub(_ABBREVIATED, default), mode="eval").body
                fields.append((match.group(1), inspect.Parameter.POSITIONAL_OR_KEYWORD, node))
            return fields, comments
    raise AssertionError(f"api.md's section {heading!r} has no class block for {name}")


# ---------------------------------------------------------------- comparing


def _actual_default(obj: Any, name: str, parameter: inspect.Parameter) -> Any:
    # attrs shows a factory default as NOTHING; the factory's value is what a caller gets.
    if parameter.default is attrs.NOTHING and isinstance(obj, type) and attrs.has(obj):
        field = {f.alias: f for f in attrs.fields(obj)}[name]
        if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            return field.default.factory()
    return parameter.default


def _mismatches(
    label: str,
    written: list[Param],
    obj: Any,
    *,
    check_kinds: bool = True,
    skip_defaults: dict[str, str] | None = None,
    init_only: tuple[str, ...] = (),
    subset: bool = False,
) -> list[str]:
    signature = inspect.signature(obj)
    actual = list(signature.parameters.values())
    if actual and actual[0].name == "self":
        actual = actual[1:]
    problems = []
    written_names = [name for name, _, _ in written]
    actual_names = [p.name for p in actual if p.name not in init_only and (not subset or p.name in written_names)]
    if written_names != actual_names:
        missing = [n for n in actual_names if n not in written_names]
        extra = [n for n in written_names if n not in actual_names]
        problems.append(
            f"{label}: parameters differ: api.md {written_names}, code {actual_names}"
            f" (not in api.md: {missing}; not in the code: {extra})"
        )
    by_name = {p.name: p for p in actual}
    for name, kind, default in written:
        parameter = by_name.get(name)
        if parameter is None:
            continue
        if check_kinds and kind is not parameter.kind:
            problems.append(
                f"{label}: {name} is {kind.description} in api.md, {parameter.kind.description} in the code"
            )
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if skip_defaults and name in skip_defaults:
            continue
        problems += _default_mismatch(f"{label}: {name}", default, _actual_default(obj, name, parameter))
    return problems


def _default_mismatch(label: str, written: ast.expr | None, actual: Any) -> list[str]:
    empty = inspect.Parameter.empty
    if written is None:
        return [] if actual is empty else [f"{label} has no default in api.md, {actual!r} in the code"]
    if actual is empty:
        return [f"{label} has the default {ast.unparse(written)} in api.md, none in the code"]
    text = ast.unparse(written)
    if text == _ABBREVIATED:
        return []  # given in the prose (see the module docstring)
    value = eval(text, dict(_NAMESPACE))  # api.md's own text, evaluated against the public names
    if value == actual or value is actual:
        return []
    return [f"{label} defaults to {text} = {value!r} in api.md, {actual!r} in the code"]


# ---------------------------------------------------------------- the curated list


@attrs.frozen
class Entry:
    heading: str  # the section, as written after the #s
    written: str  # the callee as api.md writes it
    obj: Callable[..., Any]
    skip_defaults: dict[str, str] = attrs.field(factory=dict)  # parameter -> why api.md's default is not the code's
    occurrence: int = 0  # which call of that name in the section (0: the first)
    subset: bool = False  # api.md names some parameters only (in the code's order); see the entry


_ENTRIES = [
    Entry("`compose_middleware`", "compose_middleware", trio_agent.middleware.compose_middleware),
    Entry("`define_tool`", "define_tool", trio_agent.define_tool),
    Entry("`ToolPipeline.execute`", "execute", trio_agent.tools.ToolPipeline.execute),
    Entry("`open_journal` †", "open_journal", trio_agent.journal.open_journal),
    Entry("Events", "encode_event", trio_agent.journal.encode_event),
    Entry("Events", "decode_event", trio_agent.journal.decode_event),
    Entry("Messages and content", "ModelResponse", trio_agent.models.ModelResponse),
    Entry("Messages and content", "Usage", trio_agent.models.Usage),
    Entry("Messages and content", "ToolResultMessage", trio_agent.models.ToolResultMessage),
    Entry("Messages and content", "ReasoningPart", trio_agent.models.ReasoningPart),
    Entry("Stream chunks", "FinishChunk", trio_agent.models.FinishChunk),
    Entry("Stream chunks", "ReasoningDelta", trio_agent.models.ReasoningDelta),
    Entry("Stream chunks", "ToolCallEnd", trio_agent.models.ToolCallEnd),
    Entry("`ModelService`", "ModelService", trio_agent.models.ModelService),
    Entry("`ModelService`", "service.with_model", trio_agent.models.ModelService.with_model),
    Entry("`ModelService`", "service.chat", trio_agent.models.ModelService.chat),
    Entry("`ModelService`", "service.side_query", trio_agent.models.ModelService.side_query),
    Entry("`ModelService`", "service.request", trio_agent.models.ModelService.request),
    Entry("Providers", "OpenAIProvider", trio_agent.models.OpenAIProvider),
    Entry("Providers", "AnthropicProvider", trio_agent.models.AnthropicProvider),
    Entry("Providers", "create_provider", trio_agent.create_provider),
    Entry("`define_agent`, `AgentSpec`", "define_agent", trio_agent.define_agent),
    Entry(
        "`open_session`",
        "open_session",
        trio_agent.open_session,
        # api.md writes two forms: with a spec (required there) and with define_agent's options
        # instead; the code is one function whose spec defaults to None. The second form is
        # "...every define_agent option...", checked by test_open_session_takes_every_define_agent_option.
        skip_defaults={"spec": "the spec form requires it"},
        subset=True,
    ),
    Entry("Workers (`trio_agent.workers`)", "submit", trio_agent.workers.submit),
    Entry("Workers (`trio_agent.workers`)", "Submitter", trio_agent.workers.Submitter),
    Entry("Workers (`trio_agent.workers`)", "queue.submit", trio_agent.workers.Submitter.submit),
    Entry("Workers (`trio_agent.workers`)", "submit_answers", trio_agent.workers.submit_answers),
    Entry("Workers (`trio_agent.workers`)", "queue.submit_answers", trio_agent.workers.Submitter.submit_answers),
    Entry("Workers (`trio_agent.workers`)", "request_status", trio_agent.workers.request_status),
    Entry("Workers (`trio_agent.workers`)", "list_sessions", trio_agent.workers.list_sessions),
    Entry("Workers (`trio_agent.workers`)", "list_workers", trio_agent.workers.list_workers),
    Entry("Workers (`trio_agent.workers`)", "serve_sessions", trio_agent.workers.serve_sessions),
    Entry("Workers (`trio_agent.workers`)", "wait_for_request", trio_agent.workers.wait_for_request),
    Entry("Workers (`trio_agent.workers`)", "subscribe_live", trio_agent.workers.subscribe_live),
    Entry("`TestModel`, `Reply`, `open_test_model`, `conversation_key`", "TestModel", trio_agent.testing.TestModel),
    Entry("`TestModel`, `Reply`, `open_test_model`, `conversation_key`", "Reply", trio_agent.testing.Reply),
    Entry(
        "`TestModel`, `Reply`, `open_test_model`, `conversation_key`",
        "open_test_model",
        trio_agent.testing.open_test_model,
    ),
    Entry(
        "`TestModel`, `Reply`, `open_test_model`, `conversation_key`",
        "conversation_key",
        trio_agent.testing.conversation_key,
    ),
    Entry("`chat`", "chat", trio_agent.chat),
]


@pytest.mark.parametrize("entry", _ENTRIES, ids=[f"{e.written}" for e in _ENTRIES])
def test_api_md_signature_matches_the_code(entry: Entry) -> None:
    calls = _written_calls(entry.heading).get(entry.written)
    assert calls, f"api.md's section {entry.heading!r} writes no signature for {entry.written}"
    written = _parse_params(calls[entry.occurrence])
    problems = _mismatches(entry.written, written, entry.obj, skip_defaults=entry.skip_defaults, subset=entry.subset)
    assert problems == []


def test_open_session_takes_every_define_agent_option() -> None:
    # api.md's second open_session form is "(*, provider, ...every define_agent option...)".
    session = inspect.signature(trio_agent.open_session).parameters
    agent = inspect.signature(trio_agent.define_agent).parameters
    spec_form = {name for name, _, _ in _parse_params(_written_calls("`open_session`")["open_session"][0])}
    assert sorted(set(session) - spec_form - set(agent)) == []
    # The same defaults, except that an option define_agent requires (provider) may come from the spec.
    empty = inspect.Parameter.empty
    assert [n for n, p in agent.items() if n not in session or p.default not in (empty, session[n].default)] == []


# Class blocks written as fields: (section, class, constructor parameters the block names only in a comment).
_CLASS_BLOCKS: list[tuple[str, type, tuple[str, ...]]] = [
    ("`ExecutionContext`", trio_agent.tools.ExecutionContext, ("fence", "ensure")),
    ("`ToolContext`", trio_agent.ToolContext, ("slot", "cleanup_grace")),
    ("`Settlement`", trio_agent.tools.Settlement, ()),
    ("`ToolStages`", trio_agent.tools.ToolStages, ()),
    *[("Session events", cls, ()) for cls in typing.get_args(trio_agent.SessionEvent)],
]


@pytest.mark.parametrize(
    ("heading", "cls", "init_only"), _CLASS_BLOCKS, ids=[cls.__name__ for _, cls, _ in _CLASS_BLOCKS]
)
def test_api_md_class_block_matches_the_constructor(heading: str, cls: type, init_only: tuple[str, ...]) -> None:
    fields, comments = _class_fields(heading, cls.__name__)
    # A constructor parameter left out of the field list must at least be named in its comment.
    assert [name for name in init_only if not re.search(rf"\b{name}\b", comments)] == []
    assert _mismatches(cls.__name__, fields, cls, check_kinds=False, init_only=init_only) == []


def test_api_md_lists_every_journal_event_with_its_fields() -> None:
    events = typing.get_args(trio_agent.journal.Event)
    calls = _written_calls("Events")
    assert [cls.__name__ for cls in events if cls.__name__ not in calls] == []
    problems = []
    for cls in events:
        # The block writes them positionally, for brevity; the prose says keyword-only, checked here.
        assert {p.kind for p in inspect.signature(cls).parameters.values()} == {inspect.Parameter.KEYWORD_ONLY}
        problems += _mismatches(cls.__name__, _parse_params(calls[cls.__name__][0]), cls, check_kinds=False)
    assert problems == []


def test_api_md_session_event_union_is_the_code_s() -> None:
    section = _section("Session events")
    match = re.search(r"^SessionEvent = \(?(.*?)\)?\n```", section, re.S | re.M)
    assert match, "api.md's Session events block does not define SessionEvent"
    written = [name.strip() for name in match.group(1).split("|")]
    assert written == [cls.__name__ for cls in typing.get_args(trio_agent.SessionEvent)]
    # ... and each member is described below the block.
    assert [name for name in written if f"- `{name}`" not in section and name != "TextDeltaEvent"] == []


@pytest.mark.parametrize(
    ("heading", "cls"),
    [("`FaultCode`", trio_agent.tools.FaultCode)],
    ids=["FaultCode"],
)
def test_api_md_enum_block_lists_every_member(heading: str, cls: type[enum.Enum]) -> None:
    (block,) = _fragments(heading)
    written = dict(re.findall(r"^\s+([A-Z_]+) = \"([a-z_]+)\"$", block, re.M))
    assert written == {member.name: member.value for member in cls}
    # Every member is explained in the bullets under the block (`A` / `B` share one).
    bullets = _BLOCK.sub("", _section(heading))
    assert [name for name in written if not re.search(rf"^- .*`{name}`", bullets, re.M)] == []
