"""The permission engine: the decision table row by row, rules, modes, the ask, the path policy and tool filters.

The table under test (``trio_agent/_permissions/_table.py`` and ``docs/permissions.md``)::

    0 tool filter -> 1 behaviour/signature -> 2 path policy -> 3 the tool's check -> 4 deny rules
    -> 5 plan's hard limit -> 6 tool-level ask -> 7 session approvals -> 8 allow rules -> 9 ask rules
    -> 10 mode table -> 11 default ask -> 12 hooks, then the handler -> 13 nobody answered: deny
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cancel_helpers import nursery_failing_in_cleanup
from trio_agent import ConfigError, SideEffect, Tool, ToolErrorType, ToolKind, define_tool
from trio_agent._journal._events import PermissionDecision
from trio_agent._permissions._engine import PermissionEngine, PermissionRecord, PermissionRequest
from trio_agent._permissions._rules import (
    MODE_TABLE,
    PathPolicy,
    PermissionAllow,
    PermissionAsk,
    PermissionDeny,
    PermissionMode,
    PermissionResult,
    PermissionRules,
    PermissionUpdate,
    Rule,
    RuleBehavior,
    ToolFilter,
    update_from_json,
    update_to_json,
)
from trio_agent._permissions._table import AskNeeded, AskReason, Decision, DecisionSource
from trio_agent.testing import call_tool
from trio_agent.tools import (
    AbortHandle,
    Allow,
    BehaviorOverride,
    Deny,
    ExecutionContext,
    StageRequest,
    ToolPipeline,
    ToolStages,
)

# -- helpers -------------------------------------------------------------------


async def _echo(input: Any, ctx: Any) -> Any:
    return input


def make_tool(
    name: str,
    kind: str = "execute",
    side_effect: str = "non_idempotent",
    *,
    path_key: str | None = None,
    resolver: Callable[[dict[str, Any]], BehaviorOverride | None] | None = None,
) -> Tool[Any]:
    def paths(input: dict[str, Any]) -> list[str]:
        assert path_key is not None
        value = input.get(path_key)
        return [value] if isinstance(value, str) else []

    return define_tool(
        _echo,
        name=name,
        description=f"the {name} tool",
        kind=kind,
        side_effect=side_effect,
        input_schema={"type": "object"},
        affected_paths=paths if path_key is not None else None,
        resolve_behavior=resolver,
    )


def bash_resolver(input: dict[str, Any]) -> BehaviorOverride | None:
    """``ls ...`` is read-only; everything else keeps the static execute / non_idempotent."""
    if str(input.get("command", "")).startswith("ls"):
        return BehaviorOverride(side_effect=SideEffect.PURE, kind=ToolKind.READONLY)
    return None


READ = make_tool("Read", "readonly", "pure", path_key="file_path")
WRITE = make_tool("Write", "write", "idempotent", path_key="file_path")
BASH = make_tool("Bash", "execute", "non_idempotent", resolver=bash_resolver)
TASK = make_tool("Task", "readonly", "non_idempotent")

SIGNATURES: dict[str, Callable[[dict[str, Any]], str | None]] = {
    "Bash": lambda input: str(input.get("command", "")),
    "Task": lambda input: f"{input.get('subagent_type')}:{input.get('description')}",
}

_ids = iter(range(1, 1_000_000))


def ctx(agent_id: str = "root", abort: AbortHandle | None = None, call_id: str | None = None) -> ExecutionContext:
    call_id = call_id or f"call-{next(_ids)}"
    return ExecutionContext(
        "session-1", agent_id, "request-1", "turn-1", call_id, f"key-{call_id}", abort or AbortHandle(), lambda: None
    )


class Answerer:
    """A scripted hook or handler: returns *result* (or calls it with the request) and keeps every request."""

    def __init__(
        self, result: PermissionResult | Callable[[PermissionRequest], Any] | None = None, log: list[str] | None = None
    ) -> None:
        self.result = result
        self.requests: list[PermissionRequest] = []
        self.log = log

    @property
    def calls(self) -> int:
        return len(self.requests)

    async def __call__(self, request: PermissionRequest) -> PermissionResult | None:
        self.requests.append(request)
        if self.log is not None:
            self.log.append(f"answer:{request.signature}")
        await trio.lowlevel.checkpoint()
        if callable(self.result):
            value = self.result(request)
            return value  # type: ignore[no-any-return]
        return self.result


ASKED = PermissionDeny("asked the handler")


def engine(
    *,
    allow: tuple[str, ...] = (),
    ask: tuple[str, ...] = (),
    deny: tuple[str, ...] = (),
    mode: PermissionMode | str = PermissionMode.DEFAULT,
    handler: Any = None,
    **kwargs: Any,
) -> PermissionEngine:
    kwargs.setdefault("signature_content", SIGNATURES)
    return PermissionEngine(PermissionRules(allow=allow, ask=ask, deny=deny), mode=mode, handler=handler, **kwargs)


class Recorder:
    def __init__(self, log: list[str] | None = None) -> None:
        self.entries: list[tuple[str, PermissionRecord]] = []
        self.log = log if log is not None else []

    async def __call__(self, phase: str, record: PermissionRecord) -> None:
        await trio.lowlevel.checkpoint()
        self.entries.append((phase, record))
        outcome = "" if record.outcome is None else f":{record.outcome.value}"
        self.log.append(f"{phase}{outcome}")


# -- rule syntax -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "tool", "tool_prefix", "content", "content_prefix"),
    [
        ("*", "", True, None, False),
        ("Bash", "Bash", False, None, False),
        ("mcp__github__*", "mcp__github__", True, None, False),
        ("Bash:*", "Bash", False, None, False),
        ("Bash:git *", "Bash", False, "git ", True),
        ("Bash:git status", "Bash", False, "git status", False),
        ("Task:Explore:find the bug", "Task", False, "Explore:find the bug", False),
    ],
)
def test_rule_parsing(text: str, tool: str, tool_prefix: bool, content: str | None, content_prefix: bool) -> None:
    rule = Rule.parse(text)
    assert (rule.tool, rule.tool_prefix, rule.content, rule.content_prefix) == (
        tool,
        tool_prefix,
        content,
        content_prefix,
    )
    assert str(rule) == text


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("   ", "empty"),
        (" Bash", "whitespace"),
        ("Bash ", "whitespace"),
        ("Ba*sh", "last character"),
        ("*:rm", "last character"),
        ("Ba*:x", "last character"),
        ("Bash:git * --force", "last character"),
        ("Bash:", "empty content"),
        (":ls", "not a tool name"),
        ("Read File", "not a tool name"),
        ("x" * 65, "not a tool name"),
        ("Bash:ls\nrm", "control character"),
        (42, "must be a string"),
        (None, "must be a string"),
    ],
)
def test_bad_rules_are_config_errors(text: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        Rule.parse(text)
    with pytest.raises(ConfigError, match=rf"permissions\.allow\[1\].*{why}"):
        PermissionRules(allow=["Read", text])


def test_rules_must_be_lists_not_a_single_string() -> None:
    with pytest.raises(ConfigError, match="single string 'Bash'"):
        PermissionRules(deny="Bash")  # a str is an Iterable[str]: caught at runtime


@pytest.mark.parametrize(
    ("lists", "message"),
    [
        ({"allow": ["Bash"], "deny": ["Bash"]}, r"'Bash' is in both permissions\.deny and permissions\.allow"),
        ({"allow": ["Read:*"], "ask": ["Read:*"]}, r"'Read:\*' is in both permissions\.allow and permissions\.ask"),
        ({"deny": ["Bash"], "ask": ["Bash:*"]}, r"'Bash:\*' is in both permissions\.deny \(as 'Bash'\)"),
    ],
)
def test_the_same_rule_in_two_lists_is_a_conflict(lists: dict[str, list[str]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PermissionRules(**lists)


def test_repeats_within_one_list_are_dropped_and_overlap_is_not_a_conflict() -> None:
    rules = PermissionRules(allow=["Read", "Read", "Read:*"], deny=["Bash:rm *"], ask=["Bash"])
    assert [rule.text for rule in rules.rules(RuleBehavior.ALLOW)] == ["Read"]
    # Overlapping but different rules are fine: precedence decides.
    match = rules.match("Bash:rm -rf /")
    assert match is not None and (match.behavior, match.rule.text) == (RuleBehavior.DENY, "Bash:rm *")
    match = rules.match("Bash:ls")
    assert match is not None and match.behavior is RuleBehavior.ASK
    assert rules.match("Write") is None


@pytest.mark.parametrize(
    ("rule", "signature", "expected"),
    [
        ("*", "Read", True),
        ("*", "Bash:rm -rf /", True),
        ("Bash", "Bash", True),
        ("Bash", "Bash:git push", True),
        ("Bash", "Bashful", False),
        ("Bash", "Read", False),
        ("Bash:*", "Bash", True),
        ("Bash:*", "Bash:ls", True),
        ("Ba*", "Bash:ls", True),
        ("Ba*", "Read", False),
        ("mcp__gh__*", "mcp__gh__create_issue:x", True),
        ("Bash:git *", "Bash:git push", True),
        ("Bash:git *", "Bash:gitk", False),
        ("Bash:git *", "Bash", False),
        ("Bash:git status", "Bash:git status", True),
        ("Bash:git status", "Bash:git status --short", False),
        ("Bash:git status", "Bash", False),
        ("Read:*", "Read", True),
        ("Task:Explore:*", "Task:Explore:find it", True),
        ("Task:Explore:*", "Task:Plan:find it", False),
    ],
)
def test_rule_matching(rule: str, signature: str, expected: bool) -> None:
    assert Rule.parse(rule).matches(signature) is expected


# -- precedence (hypothesis) -------------------------------------------------------

TOOL_NAMES = ["Bash", "Read", "Re", "Write"]
CONTENTS = ["git status", "git push", "ls", "g"]


@st.composite
def rule_texts(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(TOOL_NAMES))
    content = draw(st.sampled_from(CONTENTS))
    form = draw(st.integers(0, 5))
    return ["*", name, f"{name[:-1]}*", f"{name}:*", f"{name}:{content}", f"{name}:{content[:2]}*"][form]


def oracle_matches(rule: str, tool: str, content: str | None) -> bool:
    """An independent statement of the rule syntax, for the property."""
    if rule == "*":
        return True
    if ":" not in rule:
        return tool.startswith(rule[:-1]) if rule.endswith("*") else tool == rule
    rule_tool, rule_content = rule.split(":", 1)
    if rule_tool != tool:
        return False
    if rule_content == "*":
        return True
    if content is None:
        return False
    return content.startswith(rule_content[:-1]) if rule_content.endswith("*") else content == rule_content


@settings(max_examples=300, deadline=None)
@given(
    rules=st.lists(st.tuples(rule_texts(), st.sampled_from(["allow", "ask", "deny"])), max_size=8),
    tool_name=st.sampled_from(TOOL_NAMES),
    content=st.one_of(st.none(), st.sampled_from(CONTENTS)),
)
def test_deny_beats_allow_beats_ask_beats_default(
    rules: list[tuple[str, str]], tool_name: str, content: str | None
) -> None:
    # One list per distinct rule (the same rule in two lists is a conflict, tested above).
    lists: dict[str, list[str]] = {"allow": [], "ask": [], "deny": []}
    placed: set[Rule] = set()
    for text, behavior in rules:
        if Rule.parse(text) not in placed:
            placed.add(Rule.parse(text))
            lists[behavior].append(text)
    permission_rules = PermissionRules(**lists)

    def matching(behavior: str) -> bool:
        return any(oracle_matches(text, tool_name, content) for text in lists[behavior])

    expected = "deny" if matching("deny") else "allow" if matching("allow") else "ask" if matching("ask") else None
    signature = tool_name if content is None else f"{tool_name}:{content}"
    match = permission_rules.match(signature)
    assert (None if match is None else match.behavior.value) == expected

    # The engine agrees: an execute tool in default mode, a handler that says which path it saw.
    handler = Answerer(ASKED)
    tool = make_tool(tool_name)
    permissions = PermissionEngine(
        permission_rules, handler=handler, signature_content={tool_name: lambda _input: content}
    )
    decision = trio.run(permissions.decide, tool, {}, ctx())
    assert decision.signature == signature
    if expected == "deny":
        assert (decision.allowed, decision.source, handler.calls) == (False, DecisionSource.RULE, 0)
    elif expected == "allow":
        assert (decision.allowed, decision.source, handler.calls) == (True, DecisionSource.RULE, 0)
    else:
        assert (decision.allowed, decision.source, decision.message, handler.calls) == (
            False,
            DecisionSource.HANDLER,
            "asked the handler",
            1,
        )
        assert handler.requests[0].reason is (AskReason.RULE if expected == "ask" else AskReason.MODE)


# -- row 0: tool filter -------------------------------------------------------------


async def test_row0_tool_filter_denies_tools_an_agent_may_not_use() -> None:
    handler = Answerer(PermissionAllow())
    filters = {"root": ToolFilter(), "sub-1": ToolFilter(allowed=["Read"])}
    permissions = engine(mode="bypass", allow=("*",), handler=handler, tool_filter=lambda agent: filters[agent])
    root = await permissions.decide(WRITE, {"file_path": "a"}, ctx("root"))
    assert root.allowed
    sub = await permissions.decide(WRITE, {"file_path": "a"}, ctx("sub-1"))
    assert (sub.allowed, sub.source) == (False, DecisionSource.FILTER)
    assert sub.message == "tool 'Write' is not available to agent 'sub-1'"
    assert (await permissions.decide(READ, {}, ctx("sub-1"))).allowed
    assert handler.calls == 0


# -- row 1: behaviour and signature --------------------------------------------------


async def test_row1_a_failing_resolver_or_signature_callable_denies() -> None:
    def widen(input: dict[str, Any]) -> BehaviorOverride:
        return BehaviorOverride(kind=ToolKind.EXECUTE)

    bad = make_tool("Bad", "write", "idempotent", resolver=widen)
    handler = Answerer(PermissionAllow())
    permissions = engine(mode="bypass", handler=handler)
    decision = await permissions.decide(bad, {}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.TOOL)
    assert decision.message is not None and "widened kind" in decision.message

    def boom(input: dict[str, Any]) -> str:
        raise KeyError("command")

    for content in (boom, lambda input: 42):
        permissions = engine(mode="bypass", handler=handler, signature_content={"Bash": content})
        decision = await permissions.decide(BASH, {}, ctx())
        assert (decision.allowed, decision.source) == (False, DecisionSource.TOOL)
        assert decision.message is not None and "signature content of tool 'Bash' failed" in decision.message
    assert handler.calls == 0


STRICT = define_tool(
    _echo,
    name="Strict",
    description="needs a command",
    kind="execute",
    side_effect="non_idempotent",
    input_schema={
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
    },
)


async def test_row1_validation_applies_in_every_mode_and_nobody_is_asked() -> None:
    handler = Answerer(PermissionAllow())
    for mode in PermissionMode:
        permissions = engine(mode=mode, allow=("*",), handler=handler)
        decision = await permissions.decide(STRICT, {"command": 3}, ctx())
        assert (decision.allowed, decision.source) == (False, DecisionSource.VALIDATION), mode
        assert decision.message is not None and decision.message.startswith("invalid input for tool 'Strict': at ")
        stage = decision.to_stage_decision()
        assert isinstance(stage, Deny) and (stage.type, stage.code) == (ToolErrorType.VALIDATION, "invalid_input")
    assert handler.calls == 0
    # An answer's updated input is validated too.
    handler.result = PermissionAllow(updated_input={"command": "ls", "extra": 1})
    decision = await engine(handler=handler).decide(STRICT, {"command": "ls"}, ctx())
    assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.VALIDATION, True)


async def test_signature_content_mapping_callable_and_tool_attribute() -> None:
    by_map = engine()
    assert by_map.signature(BASH, {"command": "git status"}) == "Bash:git status"
    assert by_map.signature(BASH, {"command": ""}) == "Bash"  # empty content: no content
    assert by_map.signature(READ, {"file_path": "x"}) == "Read"
    assert by_map.signature(TASK, {"subagent_type": "Explore", "description": "find"}) == "Task:Explore:find"

    by_fn = PermissionEngine(signature_content=lambda name, input: input.get("q"))
    assert by_fn.signature(READ, {"q": "x"}) == "Read:x"
    assert by_fn.signature(READ, {}) == "Read"

    # The tool's own, from define_tool(signature_content=), when the engine is given none for it.
    fetch = define_tool(
        _echo, name="Fetch", description="d", side_effect="pure", kind="readonly",
        input_schema={"type": "object"}, signature_content=lambda input: str(input["host"]),
    )  # fmt: skip
    assert PermissionEngine().signature(fetch, {"host": "example.org"}) == "Fetch:example.org"
    assert by_map.signature(fetch, {"host": "example.org"}) == "Fetch:example.org"
    # A mapping entry or the engine's callable overrides the tool's own.
    assert by_fn.signature(fetch, {"host": "h", "q": "x"}) == "Fetch:x"


async def test_signature_content_defaults_to_the_declared_conventional_field() -> None:
    def declaring(*names: str, **schemas: dict[str, Any]) -> Tool[Any]:
        properties: dict[str, Any] = {name: {"type": "string"} for name in names}
        properties.update(schemas)
        return define_tool(
            _echo, name="T", description="d", side_effect="pure",
            input_schema={"type": "object", "properties": properties},
        )  # fmt: skip

    permissions = PermissionEngine()
    shell = declaring("command", "path")
    assert permissions.signature(shell, {"command": "  rm -rf build \n", "path": "x"}) == "T:rm -rf build"
    assert permissions.signature(shell, {"path": "x"}) == "T"  # the chosen field is absent: no content
    assert permissions.signature(declaring("path", "url"), {"path": "a/b", "url": "u"}) == "T:a/b"
    assert permissions.signature(declaring("file_path", "path"), {"file_path": "f", "path": "p"}) == "T:f"
    # Chosen from the schema, never from the call: an undeclared 'command' the model adds is ignored,
    # and a field that is not declared as a plain string does not count.
    assert permissions.signature(declaring("url"), {"url": "https://x", "command": "ls"}) == "T:https://x"
    loose = declaring(command={"type": ["string", "array"]})
    assert (loose.signature_field, loose.has_signature_content) == (None, False)
    assert permissions.signature(loose, {"command": "rm -rf /"}) == "T"


# -- row 2: path policy ------------------------------------------------------------------


@pytest.fixture
def workspace(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "ws"
    other_root = tmp_path / "ws2"
    outside = tmp_path / "outside"
    for directory in (root / "src", other_root, outside):
        directory.mkdir(parents=True)
    (root / "src" / "main.py").write_text("print(1)\n")
    (outside / "secret.txt").write_text("secret\n")
    os.symlink(outside, root / "escape")  # a directory link out
    os.symlink(outside / "secret.txt", root / "secret-link")  # a file link out
    os.symlink(outside / "not-yet.txt", root / "dangling")  # a dangling link out
    os.symlink(root / "src", root / "src-link")  # a link that stays inside
    os.symlink(root, tmp_path / "ws-alias")  # a root reached through a link
    return {"root": root, "other": other_root, "outside": outside, "alias": tmp_path / "ws-alias"}


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("src/main.py", None),
        ("src/new/deep/file.py", None),  # missing parents: resolved from the deepest existing one
        ("src-link/main.py", None),  # a symlink that stays inside
        ("./src/./main.py", None),
        ("../outside/secret.txt", "contains a '..' component"),
        ("src/../src/main.py", "contains a '..' component"),  # even one that stays inside
        ("src\\..\\..\\x", "contains a '..' component"),
        ("escape/secret.txt", "escapes the workspace through a symlink"),
        ("escape/new-file.txt", "escapes the workspace through a symlink"),
        ("secret-link", "escapes the workspace through a symlink"),
        ("dangling", "escapes the workspace through a symlink"),  # writing it would create a file outside
        ("", "empty"),
        ("src/\x00x", "NUL byte"),
    ],
)
def test_path_policy_relative_paths(workspace: dict[str, Path], path: str, problem: str | None) -> None:
    policy = PathPolicy([workspace["root"], workspace["other"]])
    violation = policy.violation(path)
    if problem is None:
        assert violation is None
    else:
        assert violation is not None and problem in violation


def test_path_policy_absolute_paths_and_several_roots(workspace: dict[str, Path]) -> None:
    policy = PathPolicy([workspace["root"], workspace["other"]])
    assert policy.violation(str(workspace["root"] / "src" / "main.py")) is None
    assert policy.violation(str(workspace["other"] / "notes.md")) is None  # the second root
    assert policy.violation(str(workspace["alias"] / "src" / "main.py")) is None  # through a link to a root
    outside = policy.violation(str(workspace["outside"] / "secret.txt"))
    assert outside is not None and "is outside the workspace roots" in outside
    assert policy.violation("/etc/passwd") is not None
    assert policy.check(["src/main.py", "/etc/passwd", "../x"]) == policy.violation("/etc/passwd")
    assert policy.check(["src/main.py"]) is None


def test_path_policy_root_given_through_a_symlink(workspace: dict[str, Path]) -> None:
    policy = PathPolicy(workspace["alias"])
    assert policy.workspace_roots == (str(workspace["alias"]),)
    assert policy.violation("src/main.py") is None
    assert policy.violation(str(workspace["root"] / "src" / "main.py")) is None  # the real location
    escape = policy.violation("escape/secret.txt")
    assert escape is not None and "symlink" in escape


def test_path_policy_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="at least one workspace root"):
        PathPolicy([])
    with pytest.raises(ConfigError, match="non-empty path"):
        PathPolicy([""])
    with pytest.raises(ConfigError, match="must be a path"):
        PathPolicy([42])  # type: ignore[list-item]


async def test_row2_path_policy_denies_in_every_mode_even_with_allow_rules(workspace: dict[str, Path]) -> None:
    handler = Answerer(PermissionAllow())
    for mode in PermissionMode:
        permissions = engine(mode=mode, allow=("*",), handler=handler, path_policy=PathPolicy([workspace["root"]]))
        decision = await permissions.decide(WRITE, {"file_path": "escape/x"}, ctx())
        assert (decision.allowed, decision.source) == (False, DecisionSource.PATH_POLICY), mode
        assert decision.message is not None and "symlink" in decision.message
    assert handler.calls == 0
    # And the path is fine: the allow rule decides.
    inside = await permissions.decide(WRITE, {"file_path": "src/new.py"}, ctx())
    assert (inside.allowed, inside.source) == (True, DecisionSource.RULE)


async def test_row2_failing_affected_paths_denies(workspace: dict[str, Path]) -> None:
    async def run(input: Any, ctx: Any) -> None:
        return None

    def paths(input: dict[str, Any]) -> list[str]:
        raise ValueError("no path")

    tool = define_tool(
        run, name="Edit", description="edit", kind="write", side_effect="non_idempotent",
        input_schema={"type": "object"}, affected_paths=paths,
    )  # fmt: skip
    decision = await engine(mode="bypass").decide(tool, {}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.PATH_POLICY)
    assert decision.message is not None and "affected paths of tool 'Edit' failed" in decision.message


# -- row 3: the tool's own check ------------------------------------------------------------


async def test_row3_tool_deny_is_final_and_skips_hooks_and_handler() -> None:
    hook, handler = Answerer(PermissionAllow()), Answerer(PermissionAllow())
    checks = {"Bash": lambda input: PermissionDeny("never run rm", stop_loop=True)}
    permissions = engine(mode="bypass", allow=("Bash",), hooks=[hook], handler=handler, tool_checks=checks)
    decision = await permissions.decide(BASH, {"command": "rm -rf /"}, ctx())
    assert (decision.allowed, decision.source, decision.message, decision.stop_loop) == (
        False, DecisionSource.TOOL, "never run rm", True,
    )  # fmt: skip
    assert (hook.calls, handler.calls) == (0, 0)
    stage = decision.to_stage_decision()
    assert stage == Deny("never run rm", ToolErrorType.PERMISSION_DENIED, "stop_loop")


async def test_row3_tool_ask_survives_rules_approvals_and_bypass_and_is_answered_only_by_asking() -> None:
    log: list[str] = []
    handler = Answerer(PermissionAllow(remember=True), log)
    checks = {"Bash": lambda input: PermissionAsk("this command deletes files")}
    for mode in PermissionMode:
        if mode is PermissionMode.PLAN:
            continue  # plan denies Bash (execute) before anyone is asked
        permissions = engine(mode=mode, allow=("Bash",), handler=handler, tool_checks=checks)
        permissions.remember("Bash:rm x")
        first = await permissions.decide(BASH, {"command": "rm x"}, ctx())
        # Asked although an allow rule, a remembered approval and the mode would all allow.
        assert (first.allowed, first.source, first.asked) == (True, DecisionSource.HANDLER, True), mode
        request = handler.requests[-1]
        assert (request.reason, request.message) == (AskReason.TOOL, "this command deletes files")
        # The handler's "remember" does not silence the tool's own ask: the next call asks again.
        calls = handler.calls
        await permissions.decide(BASH, {"command": "rm x"}, ctx())
        assert handler.calls == calls + 1
    # With nobody to answer, the tool's ask is a deny even in bypass.
    lonely = engine(mode="bypass", allow=("Bash",), tool_checks=checks)
    decision = await lonely.decide(BASH, {"command": "rm x"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.NO_HANDLER)
    assert decision.message is not None and "only a permission_handler= can answer" in decision.message


async def test_row3_tool_allow_with_updated_input_is_not_final_and_is_rechecked(workspace: dict[str, Path]) -> None:
    handler = Answerer(ASKED)
    checks = {"Write": lambda input: PermissionAllow(updated_input={**input, "file_path": input["file_path"].strip()})}
    permissions = engine(handler=handler, tool_checks=checks, path_policy=PathPolicy(workspace["root"]))
    # Normalised input; not a final allow: write in default mode still asks.
    original = {"file_path": " src/a.py "}
    decision = await permissions.decide(WRITE, original, ctx())
    assert handler.requests[-1].input == {"file_path": "src/a.py"}
    assert (decision.allowed, decision.source) == (False, DecisionSource.HANDLER)
    # The path policy runs again on the updated input.
    escaped = await permissions.decide(WRITE, {"file_path": " escape/x "}, ctx())
    assert (escaped.allowed, escaped.source) == (False, DecisionSource.PATH_POLICY)
    assert escaped.input == {"file_path": "escape/x"}


async def test_row3_async_check_raising_check_and_junk_deny() -> None:
    async def async_check(input: dict[str, Any]) -> PermissionResult | None:
        await trio.lowlevel.checkpoint()
        return None

    allowed = await engine(mode="bypass", tool_checks={"Bash": async_check}).decide(BASH, {"command": "x"}, ctx())
    assert (allowed.allowed, allowed.source) == (True, DecisionSource.MODE)

    def raising(input: dict[str, Any]) -> None:
        raise RuntimeError("check exploded")

    for check, text in ((raising, "check exploded"), (lambda input: True, "returned True")):
        decision = await engine(mode="bypass", tool_checks={"Bash": check}).decide(BASH, {"command": "x"}, ctx())
        assert (decision.allowed, decision.source) == (False, DecisionSource.TOOL)
        assert decision.message is not None and text in decision.message


async def test_a_tool_check_that_raises_or_returns_what_cannot_be_told_denies() -> None:
    # Its exception and its junk answer were formatted with !r: a __repr__ that raises left decide().
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("str boom")

        def __repr__(self) -> str:
            raise RuntimeError("repr boom")

    def raising(input: dict[str, Any]) -> None:
        raise Unprintable()

    for check in (raising, lambda input: Unprintable()):
        decision = await engine(mode="bypass", tool_checks={"Bash": check}).decide(BASH, {"command": "x"}, ctx())
        assert (decision.allowed, decision.source) == (False, DecisionSource.TOOL)
        assert decision.message is not None and "Unprintable" in decision.message


NOT_JSON: list[tuple[str, Any, Any]] = [
    ("a set", "x", {1, 2}),
    ("an object", "x", object()),
    ("NaN", "x", float("nan")),
    ("a non-string key", 1, "x"),
]


@pytest.mark.parametrize(("what", "key", "value"), NOT_JSON, ids=[case[0] for case in NOT_JSON])
async def test_an_updated_input_that_is_not_json_denies(what: str, key: Any, value: Any) -> None:
    # A handler's or a tool check's updated_input was checked for being a dict only: a set or NaN
    # was allowed and failed the whole request later; a non-string key raised ValueError out of decide.
    def bad(*args: Any) -> PermissionAllow:
        return PermissionAllow(updated_input={"command": "ls", key: value})

    decision = await engine(handler=Answerer(bad)).decide(BASH, {"command": "make"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.ERROR), what
    assert decision.input == {"command": "make"} and decision.message is not None
    assert "the permission handler's updated_input is not JSON" in decision.message
    checked = await engine(mode="bypass", tool_checks={"Bash": bad}).decide(BASH, {"command": "x"}, ctx())
    assert (checked.allowed, checked.source) == (False, DecisionSource.TOOL)
    assert checked.message is not None and "returned input that is not JSON" in checked.message


async def test_row3_check_permissions_from_define_tool() -> None:
    def check(input: dict[str, Any]) -> PermissionResult | None:
        return PermissionDeny("guarded") if input.get("danger") else None

    guarded = define_tool(
        _echo, name="Guarded", description="d", input_schema={"type": "object"}, side_effect="pure",
        kind="readonly", check_permissions=check,
    )  # fmt: skip
    assert guarded.check_permissions is check
    permissions = engine()
    assert (await permissions.decide(guarded, {}, ctx())).allowed
    denied = await permissions.decide(guarded, {"danger": True}, ctx())
    assert (denied.allowed, denied.message) == (False, "guarded")
    # The engine's tool_checks entry overrides the tool's own.
    overridden = engine(tool_checks={"Guarded": lambda input: None})
    assert (await overridden.decide(guarded, {"danger": True}, ctx())).allowed


# -- row 4: deny rules -------------------------------------------------------------------------


async def test_row4_deny_rules_hold_in_every_mode_and_beat_allow() -> None:
    handler = Answerer(PermissionAllow())
    for mode in PermissionMode:
        permissions = engine(mode=mode, allow=("Bash",), deny=("Bash:rm *",), handler=handler)
        decision = await permissions.decide(BASH, {"command": "rm -rf build"}, ctx())
        assert (decision.allowed, decision.source, decision.rule) == (False, DecisionSource.RULE, "Bash:rm *"), mode
        assert decision.message == "Bash:rm -rf build is denied by rule 'Bash:rm *'"
    assert handler.calls == 0


async def test_row4_session_deny_rules_from_updates() -> None:
    permissions = engine(mode="bypass")
    assert (await permissions.decide(BASH, {"command": "curl x"}, ctx())).allowed
    permissions.apply_updates([PermissionUpdate.add("Bash:curl *", behavior="deny")])
    decision = await permissions.decide(BASH, {"command": "curl x"}, ctx())
    assert (decision.allowed, decision.rule) == (False, "Bash:curl *")
    permissions.apply_updates([PermissionUpdate.remove("Bash:curl *", behavior="deny")])
    assert (await permissions.decide(BASH, {"command": "curl x"}, ctx())).allowed


# -- row 5: plan's hard limit -------------------------------------------------------------------


async def test_row5_plan_denies_non_read_only_whatever_would_allow_it() -> None:
    hook, handler = Answerer(PermissionAllow()), Answerer(PermissionAllow())
    permissions = engine(mode="plan", allow=("Write", "Bash"), hooks=hook, handler=handler)
    permissions.remember("Write")
    permissions.apply_updates([PermissionUpdate.add("Bash")])
    for tool, input in ((WRITE, {"file_path": "a"}), (BASH, {"command": "make"})):
        decision = await permissions.decide(tool, input, ctx())
        assert (decision.allowed, decision.source) == (False, DecisionSource.MODE)
        assert decision.message is not None and "plan mode denies" in decision.message
    assert (hook.calls, handler.calls) == (0, 0)
    # Read-only by resolved behaviour passes: `ls` narrows Bash to readonly.
    listing = await permissions.decide(BASH, {"command": "ls -la"}, ctx())
    assert (listing.allowed, listing.source) == (True, DecisionSource.SESSION)
    assert (await permissions.decide(READ, {}, ctx())).allowed


async def test_plan_still_denies_after_a_handler_allow() -> None:
    # The handler allows with input that resolves to a non-read-only call: stages 0-5 run again and deny.
    handler = Answerer(PermissionAllow(updated_input={"command": "rm -rf /"}))
    permissions = engine(mode="plan", ask=("Bash:ls*",), handler=handler)
    decision = await permissions.decide(BASH, {"command": "ls"}, ctx())
    assert handler.calls == 1
    assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.MODE, True)
    assert decision.input == {"command": "rm -rf /"}

    # The mode switched to plan while the handler was deciding: its allow does not stand either.
    def switch_then_allow(request: PermissionRequest) -> PermissionAllow:
        permissions.mode = PermissionMode.PLAN
        return PermissionAllow()

    permissions = engine(mode="default", handler=Answerer(switch_then_allow))
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.MODE)


# -- rows 7 and 8: session approvals and allow rules ------------------------------------------


@pytest.mark.parametrize("rule", ["Read", "Read:*", "Re*", "*"])
async def test_row8_an_allow_rule_skips_the_handler(rule: str) -> None:
    handler = Answerer(ASKED)
    permissions = engine(allow=(rule,), ask=() if rule == "*" else ("*",), handler=handler)
    decision = await permissions.decide(READ, {}, ctx())
    assert (decision.allowed, decision.source, decision.rule, decision.asked) == (
        True,
        DecisionSource.RULE,
        rule,
        False,
    )
    assert handler.calls == 0


async def test_row8_allow_rule_beats_the_mode_for_execute_tools() -> None:
    handler = Answerer(ASKED)
    permissions = engine(allow=("Bash:git *",), handler=handler)
    assert (await permissions.decide(BASH, {"command": "git push"}, ctx())).allowed
    other = await permissions.decide(BASH, {"command": "make"}, ctx())
    assert (other.allowed, other.source, handler.calls) == (False, DecisionSource.HANDLER, 1)


async def test_row7_remember_and_rule_updates_let_later_calls_skip_the_handler() -> None:
    answers = [
        PermissionAllow(remember=True),
        PermissionAllow(rule_updates=[PermissionUpdate.add("Bash:git *")]),
    ]
    handler = Answerer(lambda request: answers.pop(0) if answers else ASKED)
    permissions = engine(handler=handler)

    first = await permissions.decide(BASH, {"command": "make test"}, ctx())
    assert (first.allowed, first.source, handler.calls) == (True, DecisionSource.HANDLER, 1)
    assert permissions.approved_signatures == {"Bash:make test"}
    again = await permissions.decide(BASH, {"command": "make test"}, ctx())
    assert (again.allowed, again.source, handler.calls) == (True, DecisionSource.SESSION, 1)
    # The approval is exact: another command asks.
    await permissions.decide(BASH, {"command": "git status"}, ctx())
    assert handler.calls == 2
    assert [rule.text for rule in permissions.session_allow_rules] == ["Bash:git *"]
    later = await permissions.decide(BASH, {"command": "git log"}, ctx())
    assert (later.allowed, later.source, later.rule, handler.calls) == (True, DecisionSource.SESSION, "Bash:git *", 2)
    # Removing the session rule makes calls ask again; forget_session drops the approval too.
    permissions.apply_updates([PermissionUpdate.remove("Bash:git *")])
    asked = await permissions.decide(BASH, {"command": "git log"}, ctx())
    assert (asked.allowed, asked.source, handler.calls) == (False, DecisionSource.HANDLER, 3)
    await permissions.forget_session()
    assert permissions.approved_signatures == frozenset()


async def test_row7_remember_for_a_tool_without_signature_content_covers_every_call() -> None:
    # As documented: the signature of a tool without content is its name, so "always" for one
    # call is "don't ask again for this tool", whatever the input.
    handler = Answerer(PermissionAllow(remember=True))
    permissions = engine(handler=handler)
    first = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (first.signature, permissions.approved_signatures) == ("Write", {"Write"})
    other = await permissions.decide(WRITE, {"file_path": "/etc/passwd"}, ctx())
    assert (other.allowed, other.source, handler.calls) == (True, DecisionSource.SESSION, 1)


async def test_a_session_allow_never_lifts_a_configured_deny() -> None:
    permissions = engine(mode="bypass", deny=("Bash",))
    permissions.apply_updates([PermissionUpdate.add("Bash")])
    permissions.remember("Bash:ls")
    decision = await permissions.decide(BASH, {"command": "ls"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.RULE)


async def test_session_layer_moves_rules_between_allow_and_deny() -> None:
    permissions = engine()
    permissions.apply_updates([PermissionUpdate.add("Bash:curl *")])
    permissions.apply_updates([PermissionUpdate.add("Bash:curl *", behavior="deny")])
    assert [r.text for r in permissions.session_deny_rules] == ["Bash:curl *"]
    assert permissions.session_allow_rules == ()


# -- rows 9-11: ask rules, the mode table, the default ask ---------------------------------------

# The mode table, pinned independently of MODE_TABLE: "allow", "ask" or "deny" per (mode, kind).
EXPECTED_MODES = {
    ("default", "readonly"): "allow", ("default", "write"): "ask", ("default", "execute"): "ask",
    ("accept_edits", "readonly"): "allow", ("accept_edits", "write"): "allow", ("accept_edits", "execute"): "ask",
    ("plan", "readonly"): "allow", ("plan", "write"): "deny", ("plan", "execute"): "deny",
    ("bypass", "readonly"): "allow", ("bypass", "write"): "allow", ("bypass", "execute"): "allow",
}  # fmt: skip


@pytest.mark.parametrize(("mode", "kind"), sorted(EXPECTED_MODES))
async def test_row10_mode_table(mode: str, kind: str) -> None:
    handler = Answerer(ASKED)
    tool = make_tool("Tool", kind, "pure")
    decision = await engine(mode=mode, handler=handler).decide(tool, {}, ctx())
    expected = EXPECTED_MODES[(mode, kind)]
    assert MODE_TABLE[PermissionMode(mode)][ToolKind(kind)].value == expected
    if expected == "allow":
        assert (decision.allowed, decision.source, handler.calls) == (True, DecisionSource.MODE, 0)
    elif expected == "deny":
        assert (decision.allowed, decision.source, handler.calls) == (False, DecisionSource.MODE, 0)
    else:
        assert (decision.allowed, decision.source, handler.calls) == (False, DecisionSource.HANDLER, 1)
        assert handler.requests[0].reason is AskReason.MODE  # row 11: the default ask


async def test_row9_ask_rules_beat_the_mode_allow_except_in_bypass() -> None:
    handler = Answerer(PermissionAllow())
    permissions = engine(ask=("Read",), handler=handler)
    decision = await permissions.decide(READ, {}, ctx())
    assert (decision.allowed, decision.source, handler.calls) == (True, DecisionSource.HANDLER, 1)
    assert (handler.requests[0].reason, handler.requests[0].rule) == (AskReason.RULE, "Read")
    permissions.mode = PermissionMode.BYPASS
    bypassed = await permissions.decide(READ, {}, ctx())
    assert (bypassed.allowed, bypassed.source, handler.calls) == (True, DecisionSource.MODE, 1)


async def test_resolved_behaviour_picks_the_mode_cell() -> None:
    handler = Answerer(ASKED)
    permissions = engine(handler=handler)
    listing = await permissions.decide(BASH, {"command": "ls"}, ctx())  # narrowed to readonly
    assert (listing.allowed, listing.source) == (True, DecisionSource.MODE)
    building = await permissions.decide(BASH, {"command": "make"}, ctx())
    assert (building.allowed, handler.calls) == (False, 1)
    request = handler.requests[0]
    assert (request.tool_kind, request.side_effect) == (ToolKind.EXECUTE, SideEffect.NON_IDEMPOTENT)


# -- row 12: hooks, then the handler -----------------------------------------------------------


async def test_row12_hooks_then_handler_first_decision_wins() -> None:
    log: list[str] = []
    silent, asking = Answerer(None, log), Answerer(PermissionAsk("not mine"), log)
    allowing, handler = Answerer(PermissionAllow(), log), Answerer(ASKED, log)
    permissions = engine(hooks=[silent, asking, allowing], handler=handler)
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source) == (True, DecisionSource.HOOK)
    assert (silent.calls, asking.calls, allowing.calls, handler.calls) == (1, 1, 1, 0)

    denying = Answerer(PermissionDeny("hook says no", stop_loop=True))
    permissions = engine(hooks=[silent, denying], handler=handler)
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source, decision.message, decision.stop_loop) == (
        False, DecisionSource.HOOK, "hook says no", True,
    )  # fmt: skip
    assert handler.calls == 0

    permissions = engine(hooks=[silent, asking], handler=handler)
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.source, handler.calls) == (DecisionSource.HANDLER, 1)

    # An engine's own hook answers like the handler, so its allow stands with no handler at all
    # (a session's PermissionRequest hooks cannot allow: tests/test_session_permission_rules.py).
    decision = await engine(hooks=[allowing]).decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source) == (True, DecisionSource.HOOK)


async def test_row12_handler_sees_the_request_and_updates_the_input() -> None:
    handler = Answerer(lambda request: PermissionAllow(updated_input={"command": "git status --short"}))
    permissions = engine(handler=handler)
    original = {"command": "git status"}
    decision = await permissions.decide(BASH, original, ctx(agent_id="sub-7", call_id="call-42"))
    request = handler.requests[0]
    assert (request.tool_name, request.signature, request.mode, request.reason) == (
        "Bash", "Bash:git status", PermissionMode.DEFAULT, AskReason.MODE,
    )  # fmt: skip
    assert (request.agent_id, request.session_id, request.tool_call_id, request.permission_id) == (
        "sub-7", "session-1", "call-42", "call-42:permission",
    )  # fmt: skip
    assert request.input == original and request.input is not original  # the handler gets a copy
    assert (decision.allowed, decision.input, decision.signature) == (
        True, {"command": "git status --short"}, "Bash:git status --short",
    )  # fmt: skip
    assert decision.to_stage_decision(original) == Allow({"command": "git status --short"})
    assert original == {"command": "git status"}


async def test_row12_an_updated_input_is_screened_again(workspace: dict[str, Path]) -> None:
    handler = Answerer(PermissionAllow(updated_input={"file_path": "escape/x"}, remember=True))
    permissions = engine(handler=handler, deny=("Bash:rm *",), path_policy=PathPolicy(workspace["root"]))
    decision = await permissions.decide(WRITE, {"file_path": "src/a.py"}, ctx())
    assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.PATH_POLICY, True)
    assert permissions.approved_signatures == frozenset()  # an allow that did not stand applies nothing

    handler.result = PermissionAllow(updated_input={"command": "rm -rf /"})
    decision = await permissions.decide(BASH, {"command": "echo hi"}, ctx())
    assert (decision.allowed, decision.source, decision.rule) == (False, DecisionSource.RULE, "Bash:rm *")


async def test_row12_a_raising_or_misbehaving_answerer_denies() -> None:
    async def raising(request: PermissionRequest) -> PermissionResult:
        raise RuntimeError("handler exploded")

    async def junk(request: PermissionRequest) -> Any:
        return True

    for bad, text in ((raising, "handler exploded"), (junk, "returned True")):
        later = Answerer(PermissionAllow())
        permissions = engine(hooks=[bad], handler=later)
        decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
        assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.ERROR, True)
        assert decision.message is not None and text in decision.message
        assert later.calls == 0  # fail closed: nobody after it is asked


class _Unprintable(Exception):
    """Junk a user's answerer returns or raises: its repr raises."""

    def __repr__(self) -> str:
        raise RuntimeError("the repr raised")


async def test_an_answerer_whose_junk_cannot_be_printed_still_denies_naming_it() -> None:
    # The message was formatted with !r: the repr's RuntimeError replaced the denial.
    async def raising(request: PermissionRequest) -> PermissionResult:
        raise _Unprintable("exploded")

    async def junk(request: PermissionRequest) -> Any:
        return _Unprintable()

    for bad, text in ((raising, "exploded"), (junk, "<_Unprintable object, unprintable")):
        permissions = engine(hooks=[bad], handler=Answerer(PermissionAllow()))
        decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
        assert (decision.allowed, decision.source) == (False, DecisionSource.ERROR)
        assert decision.message is not None and text in decision.message


@pytest.mark.parametrize("part", ["signature_content", "affected_paths"])
async def test_a_tool_part_raising_an_unprintable_exception_denies_naming_it(part: str) -> None:
    def fails(input: Any) -> Any:
        raise _Unprintable("the part failed")

    tool = define_tool(
        name="T", description="t", input_schema={"type": "object"}, side_effect="pure", kind="readonly", **{part: fails}
    )(_noop_tool)
    permissions = PermissionEngine(PermissionRules(allow=("T",)))
    decision = await permissions.decide(tool, {}, ctx())
    assert not decision.allowed
    assert decision.message is not None and "the part failed" in decision.message


async def _noop_tool(input: Any, context: Any) -> str:
    return "ok"


async def test_a_request_built_again_for_another_input_has_that_inputs_signature_kind_and_refusals() -> None:
    # What a layer that changes the input before the handler (a session's PermissionRequest hooks)
    # uses, so that the handler is not shown the old signature for the new input.
    restated: list[PermissionRequest | PermissionDeny] = []

    async def rewrite(request: PermissionRequest) -> None:
        for input in ({"command": "ls -l"}, {"command": "rm -rf /"}, ["ls"], {"command": "x", "y": {1}}):
            restated.append(await request.with_input(input))  # type: ignore[arg-type]

    handler = Answerer(ASKED)
    permissions = engine(deny=("Bash:rm *",), hooks=[rewrite], handler=handler)
    await permissions.decide(BASH, {"command": "make"}, ctx())
    asked, *refused = restated
    assert isinstance(asked, PermissionRequest)
    assert (asked.signature, asked.input, asked.tool_kind) == ("Bash:ls -l", {"command": "ls -l"}, ToolKind.READONLY)
    assert (asked.permission_id, asked.reason) == (handler.requests[0].permission_id, AskReason.MODE)
    assert [type(answer) for answer in refused] == [PermissionDeny] * 3
    messages = [answer.message for answer in refused if isinstance(answer, PermissionDeny)]
    assert "denied by rule 'Bash:rm *'" in messages[0] and "not a JSON object" in messages[1]
    assert "is not JSON: input.y is not JSON: set" in messages[2]
    with pytest.raises(ConfigError, match="made by a PermissionEngine"):
        await attrs.evolve(handler.requests[0], restate=None).with_input({"command": "ls"})


# -- row 13: nobody to answer -------------------------------------------------------------------


async def test_row13_ask_with_nobody_to_answer_denies() -> None:
    recorder = Recorder()
    permissions = engine(record=recorder)
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.NO_HANDLER, False)
    assert decision.message == (
        "Write needs permission and there is no permission handler to ask, so the call was denied "
        "(default mode asks before write tools). This is the session's configuration, not the call: "
        'to let it run, open the session with permissions={"allow": ["Write"]} or a permission_handler=, '
        'or define the tool with kind="readonly" if it only reads.'
    )
    stage = decision.to_stage_decision()
    assert isinstance(stage, Deny) and (stage.type, stage.code) == (ToolErrorType.PERMISSION_DENIED, "no_handler")
    assert recorder.entries == []  # nothing was asked, nothing recorded

    # Hooks that all pass leave nobody to answer: with no handler, the same no_handler refusal.
    permissions = engine(record=recorder, hooks=[Answerer(None)])
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.NO_HANDLER, True)
    assert decision.message is not None and 'permissions={"allow": ["Write"]}' in decision.message
    assert recorder.log == ["requested", "resolved:deny"]

    # A handler that passes is "nobody answered", not a missing handler.
    permissions = engine(handler=Answerer(None))
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.NO_ANSWER)
    assert decision.message is not None and decision.message.endswith("; denied")
    stage = decision.to_stage_decision()
    assert isinstance(stage, Deny) and stage.code is None


async def test_row13_no_handler_message_names_the_ask_rule_or_the_tool_check() -> None:
    by_rule = await engine(ask=("Read",)).decide(READ, {}, ctx())
    assert by_rule.source is DecisionSource.NO_HANDLER
    assert by_rule.message is not None and "ask rule 'Read'" in by_rule.message
    assert "kind=" not in by_rule.message  # a read-only tool is not fixed by being read-only
    checks = {"Bash": lambda input: PermissionAsk("deletes files")}
    by_tool = await engine(mode="bypass", tool_checks=checks).decide(BASH, {"command": "rm x"}, ctx())
    assert by_tool.source is DecisionSource.NO_HANDLER
    assert by_tool.message is not None and "(deletes files)" in by_tool.message


# -- deadline and abort ---------------------------------------------------------------------------


async def test_a_hanging_handler_is_denied_at_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    async def hang(request: PermissionRequest) -> PermissionResult:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    recorder = Recorder()
    permissions = engine(handler=hang, record=recorder)
    assert permissions.ask_timeout == 600.0
    start = trio.current_time()
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert trio.current_time() - start == pytest.approx(600.0)
    assert (decision.allowed, decision.source, decision.outcome) == (
        False, DecisionSource.TIMEOUT, PermissionDecision.DENY,
    )  # fmt: skip
    assert decision.message == "permission request for Write got no answer within 600 s"
    assert recorder.log == ["requested", "resolved:deny"]


async def test_the_deadline_is_configurable_and_covers_hooks_and_handler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow_hook(request: PermissionRequest) -> None:
        await trio.sleep(4)

    async def slow_handler(request: PermissionRequest) -> PermissionResult:
        await trio.sleep(4)
        return PermissionAllow()

    permissions = engine(hooks=[slow_hook], handler=slow_handler, ask_timeout=5)
    start = trio.current_time()
    decision = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert decision.source is DecisionSource.TIMEOUT
    assert trio.current_time() - start == pytest.approx(5.0)


async def test_an_answer_after_the_deadline_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    async def ignores_cancellation(request: PermissionRequest) -> PermissionResult:
        with trio.CancelScope(shield=True):
            await trio.sleep(700)
        return PermissionAllow()

    decision = await engine(handler=ignores_cancellation).decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.TIMEOUT)


async def test_a_handler_whose_own_nursery_fails_as_the_deadline_cancels_it_is_denied_at_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Trio passes the rest of the nursery's group through the deadline's scope: a bare
    # ExceptionGroup left the engine instead of the timeout's denial.
    async def with_helpers(request: PermissionRequest) -> PermissionResult:
        await nursery_failing_in_cleanup()

    decision = await engine(handler=with_helpers, ask_timeout=5).decide(WRITE, {"file_path": "a"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.TIMEOUT)


async def test_the_calls_abort_cancels_the_ask() -> None:
    started = trio.Event()
    seen: list[AbortHandle] = []

    async def waits(request: PermissionRequest) -> PermissionResult:
        seen.append(request.abort)
        started.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    recorder = Recorder()
    abort = AbortHandle()
    permissions = engine(handler=waits, record=recorder)
    result: list[Decision] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            result.append(await permissions.decide(WRITE, {"file_path": "a"}, ctx(abort=abort)))

        nursery.start_soon(run)
        await started.wait()
        abort.abort(message="the user pressed stop")
    (decision,) = result
    assert seen == [abort]
    assert (decision.allowed, decision.source, decision.outcome) == (
        False, DecisionSource.ABORT, PermissionDecision.CANCEL,
    )  # fmt: skip
    assert decision.message == "permission request cancelled: the user pressed stop"
    assert recorder.log == ["requested", "resolved:cancel"]


async def test_a_hanging_tool_check_is_denied_at_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    # Stage 3 awaited the tool's own check with no bound: a check that never returned held the call
    # (and its request) forever, past tool_timeout, ask_timeout and the call's abort.
    async def hang(input: dict[str, Any]) -> PermissionResult:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    handler = Answerer(PermissionAllow())
    permissions = engine(mode="bypass", handler=handler, tool_checks={"Bash": hang}, ask_timeout=5)
    start = trio.current_time()
    decision = await permissions.decide(BASH, {"command": "make"}, ctx())
    assert trio.current_time() - start == pytest.approx(5.0)
    assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.TOOL, False)
    assert decision.message == "permission check of tool 'Bash' gave no answer within 5 s"
    assert handler.calls == 0
    # A check whose own nursery fails in its cleanup as the deadline cancels it: the same denial.
    permissions = engine(tool_checks={"Bash": lambda input: nursery_failing_in_cleanup()}, ask_timeout=5)
    decision = await permissions.decide(BASH, {"command": "make"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.TOOL)


async def test_the_calls_abort_cancels_a_hanging_tool_check() -> None:
    started = trio.Event()

    async def hang(input: dict[str, Any]) -> PermissionResult:
        started.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    abort = AbortHandle()
    permissions = engine(mode="bypass", tool_checks={"Bash": hang})
    result: list[Decision] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            result.append(await permissions.decide(BASH, {"command": "make"}, ctx(abort=abort)))

        nursery.start_soon(run)
        await started.wait()
        abort.abort(message="the user pressed stop")
    (decision,) = result
    assert (decision.allowed, decision.source, decision.outcome) == (
        False, DecisionSource.ABORT, PermissionDecision.CANCEL,
    )  # fmt: skip
    assert decision.message == "permission check of tool 'Bash' cancelled: the user pressed stop"

    # A check that answers in time is not cut short.
    async def quick(input: dict[str, Any]) -> PermissionResult:
        await trio.lowlevel.checkpoint()
        return PermissionDeny("no make")

    quick_decision = await engine(tool_checks={"Bash": quick}).decide(BASH, {"command": "make"}, ctx())
    assert (quick_decision.source, quick_decision.message) == (DecisionSource.TOOL, "no make")


async def test_an_already_aborted_call_is_not_asked() -> None:
    handler, recorder = Answerer(PermissionAllow()), Recorder()
    abort = AbortHandle()
    abort.abort()
    decision = await engine(handler=handler, record=recorder).decide(WRITE, {"file_path": "a"}, ctx(abort=abort))
    assert (decision.allowed, decision.source, handler.calls, recorder.entries) == (
        False, DecisionSource.ABORT, 0, [],
    )  # fmt: skip


async def test_outside_cancellation_records_cancel_and_propagates() -> None:
    started = trio.Event()

    async def waits(request: PermissionRequest) -> PermissionResult:
        started.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    recorder = Recorder()
    permissions = engine(handler=waits, record=recorder)
    finished: list[Decision] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            finished.append(await permissions.decide(WRITE, {"file_path": "a"}, ctx()))

        nursery.start_soon(run)
        await started.wait()
        nursery.cancel_scope.cancel()
    assert finished == []  # trio.Cancelled went on; no decision came back
    assert recorder.log == ["requested", "resolved:cancel"]
    assert recorder.entries[1][1].decision is not None
    assert recorder.entries[1][1].decision.source is DecisionSource.ABORT


async def test_outside_cancellation_through_a_handlers_nursery_records_cancel_too() -> None:
    """A handler that waits in a nursery of its own turns the cancellation into a group."""
    started = trio.Event()

    async def waits_in_a_nursery(request: PermissionRequest) -> PermissionResult:
        async with trio.open_nursery() as inner:
            inner.start_soon(trio.sleep_forever)
            started.set()
            await trio.sleep_forever()
        raise AssertionError("unreachable")

    recorder = Recorder()
    permissions = engine(handler=waits_in_a_nursery, record=recorder)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(permissions.decide, WRITE, {"file_path": "a"}, ctx())
        await started.wait()
        nursery.cancel_scope.cancel()
    assert recorder.log == ["requested", "resolved:cancel"]


# -- recording ---------------------------------------------------------------------------------


async def test_record_wraps_the_ask_and_updates_apply_after_resolved() -> None:
    log: list[str] = []
    permissions: PermissionEngine

    class CheckingRecorder(Recorder):
        async def __call__(self, phase: str, record: PermissionRecord) -> None:
            # Nothing is remembered until the resolution is durable.
            log.append(f"approved-before-{phase}:{sorted(permissions.approved_signatures)}")
            await super().__call__(phase, record)

    recorder = CheckingRecorder(log)
    handler = Answerer(PermissionAllow(remember=True), log)
    permissions = engine(handler=handler, record=recorder)
    decision = await permissions.decide(BASH, {"command": "make"}, ctx(call_id="call-9"))
    assert log == [
        "approved-before-requested:[]",
        "requested",
        "answer:Bash:make",
        "approved-before-resolved:[]",
        "resolved:allow",
    ]
    assert permissions.approved_signatures == {"Bash:make"}
    (requested_phase, requested), (resolved_phase, resolved) = recorder.entries
    assert (requested_phase, resolved_phase) == ("requested", "resolved")
    assert requested.permission_id == resolved.permission_id == decision.permission_id == "call-9:permission"
    assert requested.decision is None and resolved.decision is decision
    # A decision that did not ask is not recorded.
    await permissions.decide(BASH, {"command": "make"}, ctx())
    assert len(recorder.entries) == 2


async def test_a_failing_record_propagates_and_nothing_is_asked_or_applied() -> None:
    class Broken(Exception):
        pass

    async def fail_requested(phase: str, record: PermissionRecord) -> None:
        raise Broken(phase)

    handler = Answerer(PermissionAllow(remember=True))
    with pytest.raises(Broken, match="requested"):
        await engine(handler=handler, record=fail_requested).decide(WRITE, {"file_path": "a"}, ctx())
    assert handler.calls == 0

    async def fail_resolved(phase: str, record: PermissionRecord) -> None:
        if phase == "resolved":
            raise Broken(phase)

    permissions = engine(handler=handler, record=fail_resolved)
    with pytest.raises(Broken, match="resolved"):
        await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (handler.calls, permissions.approved_signatures) == (1, frozenset())


# -- the pipeline stage ----------------------------------------------------------------------------


async def test_as_stage_in_a_real_pipeline() -> None:
    received: list[dict[str, Any]] = []

    async def run(input: Any, tool_ctx: Any) -> str:
        received.append(input)
        return "ran"

    bash = define_tool(
        run, name="Bash", description="shell", kind="execute", side_effect="non_idempotent",
        input_schema={"type": "object"}, resolve_behavior=bash_resolver,
    )  # fmt: skip

    def answer(request: PermissionRequest) -> PermissionResult:
        command = request.input["command"]
        if command == "stop":
            return PermissionDeny("the user stopped the agent", stop_loop=True)
        if command == "deny":
            return PermissionDeny("no")
        return PermissionAllow(updated_input={"command": command + " --dry-run"})

    permissions = engine(handler=Answerer(answer), deny=("Bash:rm *",))
    pipeline = ToolPipeline([bash], stages=ToolStages(permission=[permissions.as_stage()]))

    allowed = await call_tool(pipeline, "Bash", {"command": "make"})
    assert allowed.result.ok and received == [{"command": "make --dry-run"}]
    for command, message, code in (
        ("rm -rf /", "Bash:rm -rf / is denied by rule 'Bash:rm *'", None),
        ("deny", "no", None),
        ("stop", "the user stopped the agent", "stop_loop"),
    ):
        record = await call_tool(pipeline, "Bash", {"command": command})
        assert record.result.error is not None
        assert (record.result.error.type, record.result.error.message, record.result.error.code) == (
            ToolErrorType.PERMISSION_DENIED, message, code,
        )  # fmt: skip
        assert not record.tool_ran
    assert len(received) == 1


async def test_as_stage_passes_unchanged_input_as_none() -> None:
    stage = engine(mode="bypass").as_stage()
    input = {"command": "make"}
    decision = await stage(StageRequest(BASH, input, ctx(), BASH.behavior))
    assert decision == Allow(None)


async def test_abort_during_the_ask_inside_the_pipeline_settles_interrupted() -> None:
    started = trio.Event()

    async def waits(request: PermissionRequest) -> PermissionResult:
        started.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    recorder = Recorder()
    permissions = engine(handler=waits, record=recorder)
    pipeline = ToolPipeline([WRITE], stages=ToolStages(permission=[permissions.as_stage()]))
    abort = AbortHandle()
    records: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            records.append(await call_tool(pipeline, "Write", {"file_path": "a"}, abort=abort))

        nursery.start_soon(run)
        await started.wait()
        abort.abort()
    (record,) = records
    assert record.result.error is not None and record.result.error.type is ToolErrorType.INTERRUPTED
    assert recorder.log == ["requested", "resolved:cancel"]


# -- results, updates, engine configuration ----------------------------------------------------


def test_result_and_update_validation() -> None:
    with pytest.raises(ConfigError, match="needs a message"):
        PermissionDeny("")
    with pytest.raises(ConfigError, match="updated_input must be a JSON object"):
        PermissionAllow(updated_input=["x"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="PermissionUpdate objects"):
        PermissionAllow(rule_updates=["Bash"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="not ask rules"):
        PermissionUpdate.add("Bash", behavior="ask")
    with pytest.raises(ConfigError, match="'\\*' is only allowed"):
        PermissionUpdate.add("Ba*sh")
    with pytest.raises(ConfigError, match="is empty"):
        PermissionUpdate.add()
    with pytest.raises(ConfigError, match="'add', 'remove' or 'set_mode'"):
        PermissionUpdate("replace", ("Bash",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="permission mode must be one of"):
        PermissionUpdate.set_mode("yolo")
    with pytest.raises(ConfigError, match="needs the mode"):
        PermissionUpdate("set_mode")
    with pytest.raises(ConfigError, match="sets the mode only"):
        PermissionUpdate("set_mode", ("Bash",), mode="plan")
    with pytest.raises(ConfigError, match="not the mode"):
        PermissionUpdate("add", ("Bash",), mode="plan")
    assert PermissionUpdate.set_mode("plan").mode is PermissionMode.PLAN
    update = PermissionUpdate.add("Bash:git *", "Read", behavior="deny")
    assert ([r.text for r in update.rules], update.behavior, update.action) == (
        ["Bash:git *", "Read"], RuleBehavior.DENY, "add",
    )  # fmt: skip


def test_engine_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="permission mode must be one of"):
        PermissionEngine(mode="yolo")
    with pytest.raises(ConfigError, match="ask_timeout"):
        PermissionEngine(ask_timeout=0)
    with pytest.raises(ConfigError, match="handler must be an async callable"):
        PermissionEngine(handler="allow")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="hook #1 must be an async callable"):
        PermissionEngine(hooks=[Answerer(), None])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="rules must be PermissionRules"):
        PermissionEngine({"allow": ["Bash"]})  # type: ignore[arg-type]
    permissions = PermissionEngine(mode="accept_edits")
    assert permissions.mode is PermissionMode.ACCEPT_EDITS
    with pytest.raises(ConfigError):
        permissions.mode = "nope"
    assert permissions.mode is PermissionMode.ACCEPT_EDITS


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PermissionEngine(hooks=5), "hooks must be an async callable or a list"),  # type: ignore[arg-type]
        (lambda: PermissionEngine(tool_checks=5), "tool_checks must be a mapping"),  # type: ignore[arg-type]
        (lambda: PermissionEngine(tool_checks=[1]), "tool_checks must be a mapping"),  # type: ignore[arg-type]
        (lambda: PermissionAllow(rule_updates=5), "rule_updates must be a list"),  # type: ignore[arg-type]
        (lambda: PermissionUpdate("add", rules=5), "PermissionUpdate.rules must be a list"),  # type: ignore[arg-type]
        (lambda: PermissionEngine().replay_updates(5), "replay_updates takes a PermissionUpdate"),  # type: ignore[arg-type]
        (lambda: PermissionEngine().apply_updates("Bash"), "apply_updates takes a PermissionUpdate"),  # type: ignore[arg-type]
        (lambda: trio.run(functools.partial(PermissionEngine().accept_updates, 5, source="t")), "accept_updates takes"),  # type: ignore[arg-type]
        (lambda: PermissionAllow(remember="no"), "PermissionAllow.remember must be True or False"),  # type: ignore[arg-type]
        (lambda: PermissionDeny("x", stop_loop="yes"), "PermissionDeny.stop_loop must be True or False"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_to_the_permission_api_are_config_errors_naming_them(make: Any, match: str) -> None:
    # Each raised a bare TypeError ('int' object is not iterable), or (the flags) was taken as true.
    with pytest.raises(ConfigError, match=match):
        make()


# -- tool filter ----------------------------------------------------------------------------------


def test_tool_filter_none_means_all_and_empty_means_none() -> None:
    names = {"Read", "Write", "Bash"}
    assert ToolFilter().filter(names) == names
    assert ToolFilter(allowed=[]).filter(names) == set()
    assert ToolFilter(allowed=["Read", "Task"]).filter(names) == {"Read"}
    assert ToolFilter(disallowed=None).filter(names) == names
    assert ToolFilter(disallowed=[]).filter(names) == names
    assert ToolFilter(allowed=["Read", "Write"], disallowed=["Write"]).filter(names) == {"Read"}
    assert ToolFilter(disallowed=["Bash"]).allows("Read") and not ToolFilter(disallowed=["Bash"]).allows("Bash")


@pytest.mark.parametrize(
    ("session", "subagent", "expected"),
    [
        (ToolFilter(), ToolFilter(), {"Read", "Write", "Bash"}),
        (ToolFilter(), ToolFilter(allowed=["Read"]), {"Read"}),
        (ToolFilter(allowed=["Read", "Write"]), ToolFilter(), {"Read", "Write"}),  # None inherits the session's
        (ToolFilter(allowed=["Read", "Write"]), ToolFilter(allowed=["Write", "Bash"]), {"Write"}),
        (ToolFilter(allowed=["Read"]), ToolFilter(allowed=[]), set()),  # empty is none, for subagents too
        (ToolFilter(disallowed=["Bash"]), ToolFilter(allowed=["Bash", "Read"]), {"Read"}),
        (ToolFilter(allowed=["Read", "Bash"]), ToolFilter(disallowed=["Read"]), {"Bash"}),
    ],
)
def test_tool_filter_intersection_for_subagents(session: ToolFilter, subagent: ToolFilter, expected: set[str]) -> None:
    names = {"Read", "Write", "Bash"}
    combined = session.intersect(subagent)
    assert combined.filter(names) == expected
    assert combined.filter(names) == session.filter(names) & subagent.filter(names)
    assert subagent.intersect(session).filter(names) == expected


def test_tool_filter_validation() -> None:
    with pytest.raises(ConfigError, match="single string 'Read'"):
        ToolFilter(allowed="Read")
    with pytest.raises(ConfigError, match="is not a tool name"):
        ToolFilter(disallowed=["Read", ""])
    with pytest.raises(ConfigError, match="is not a tool name"):
        ToolFilter(allowed=[3])  # type: ignore[list-item]


# -- rule updates: reporting, JSON, replay (settlement issue item 11) ------------------------------


class UpdateLog:
    """An ``on_updates_applied`` callback (sync or async) that keeps what it was told."""

    def __init__(self, *, is_async: bool = True, fail: bool = False) -> None:
        self.calls: list[tuple[tuple[PermissionUpdate, ...], str, str | None]] = []
        self.is_async = is_async
        self.fail = fail

    def __call__(self, updates: tuple[PermissionUpdate, ...], /, *, source: str, call_id: str | None) -> Any:
        self.calls.append((updates, source, call_id))
        if self.fail:
            raise RuntimeError("journal down")
        if self.is_async:
            return _reported()
        return None


async def _reported() -> None:
    await trio.lowlevel.checkpoint()


async def test_a_handler_answers_updates_are_reported_with_source_and_call_id_then_applied() -> None:
    update = PermissionUpdate.add("Bash:git *")
    seen_rules: list[tuple[str, ...]] = []
    permissions = engine(handler=Answerer(PermissionAllow(rule_updates=[update])))

    async def on_applied(updates: tuple[PermissionUpdate, ...], /, *, source: str, call_id: str | None) -> None:
        # Called before the updates take effect (write-ahead): the engine does not have them yet.
        seen_rules.append(tuple(rule.text for rule in permissions.session_allow_rules))
        log.append((updates, source, call_id))

    log: list[tuple[tuple[PermissionUpdate, ...], str, str | None]] = []
    permissions.on_updates_applied = on_applied
    decision = await permissions.decide(BASH, {"command": "git push"}, ctx(call_id="call-7"))
    assert decision.allowed
    assert log == [((update,), "handler", "call-7")]
    assert seen_rules == [()]
    assert [rule.text for rule in permissions.session_allow_rules] == ["Bash:git *"]
    # Answers without updates, and decisions that did not ask, report nothing.
    await permissions.decide(BASH, {"command": "git log"}, ctx())
    permissions.on_updates_applied = UpdateLog()
    await engine(handler=Answerer(PermissionAllow())).decide(BASH, {"command": "x"}, ctx())
    assert len(log) == 1


@pytest.mark.parametrize("is_async", [True, False])
async def test_accept_updates_reports_then_applies_and_replay_does_not_report(is_async: bool) -> None:
    callback = UpdateLog(is_async=is_async)
    permissions = engine(mode="bypass", on_updates_applied=callback)
    deny = PermissionUpdate.add("Bash:curl *", behavior="deny")
    applied = await permissions.accept_updates([deny], source="tool", call_id="call-1")
    assert applied == (deny,)
    assert callback.calls == [((deny,), "tool", "call-1")]
    assert (await permissions.decide(BASH, {"command": "curl x"}, ctx())).allowed is False
    # Nothing to apply: no report.
    assert await permissions.accept_updates([], source="tool") == ()
    # Reopen: a fresh engine gets the stored updates back without reporting them again.
    reopened = engine(mode="bypass", on_updates_applied=callback)
    reopened.replay_updates([update_from_json(update_to_json(deny))])
    assert len(callback.calls) == 1
    assert [rule.text for rule in reopened.session_deny_rules] == ["Bash:curl *"]
    assert (await reopened.decide(BASH, {"command": "curl x"}, ctx())).allowed is False


async def test_a_failing_report_applies_nothing_and_propagates() -> None:
    permissions = engine(mode="bypass", on_updates_applied=UpdateLog(fail=True))
    with pytest.raises(RuntimeError, match="journal down"):
        await permissions.accept_updates([PermissionUpdate.add("Bash:curl *", behavior="deny")], source="tool")
    assert permissions.session_deny_rules == ()
    # Through an answer: the call fails closed (the pipeline turns the error into a denial).
    answering = engine(
        handler=Answerer(PermissionAllow(rule_updates=[PermissionUpdate.add("Bash")])),
        on_updates_applied=UpdateLog(fail=True),
    )
    with pytest.raises(RuntimeError, match="journal down"):
        await answering.decide(BASH, {"command": "make"}, ctx())
    assert answering.session_allow_rules == ()


async def test_accept_updates_checks_every_item_before_reporting() -> None:
    callback = UpdateLog()
    permissions = engine(on_updates_applied=callback)
    with pytest.raises(ConfigError, match="expected a PermissionUpdate"):
        await permissions.accept_updates([PermissionUpdate.add("Bash"), "Read"], source="tool")  # type: ignore[list-item]
    assert (callback.calls, permissions.session_allow_rules) == ([], ())
    with pytest.raises(ConfigError, match="callable"):
        engine(on_updates_applied=42)


# -- rules of live updates: judged against the tools the engine knows, as check_tools judges ---------


def field_tool(name: str, field: str | None, kind: str = "readonly") -> Tool[Any]:
    """A tool whose signature content is its conventional *field* (``None``: no content at all)."""
    properties = {} if field is None else {field: {"type": "string"}}
    return define_tool(
        _echo, name=name, description=f"the {name} tool", kind=kind, side_effect="idempotent",
        input_schema={"type": "object", "properties": properties},
    )  # fmt: skip


FILE_READ = field_tool("Read", "file_path")
SHELL = field_tool("Bash", "command", "execute")
ISSUE = field_tool("issue", None, "execute")


def knowing(*tools: Tool[Any], **options: Any) -> PermissionEngine:
    """An engine that knows *tools* as a session's does: each tool's own content (`signature_content=`)."""
    return PermissionEngine(signature_content={tool.name: tool.signature_content_for for tool in tools}, **options)


REFUSED_LIVE_RULES = [
    ("Read:./.env", "Read:.env"),
    ("Read:/home/u//.ssh/*", "Read:/home/u/.ssh/*"),
    ("Bash: rm *", "Bash:rm *"),
    ("issue:42", "issue"),
]


@pytest.mark.parametrize("behavior", ["allow", "deny"])
@pytest.mark.parametrize(("rule", "normal"), REFUSED_LIVE_RULES)
async def test_a_live_rule_that_can_never_match_a_known_tool_is_refused_before_it_is_reported(
    behavior: str, rule: str, normal: str
) -> None:
    # accept_updates took deny Read:./.env, reported (journalled) and applied it: it denied nothing,
    # since a call's content is '.env'. The configured rule was refused (check_tools); this was not.
    callback = UpdateLog()
    permissions = knowing(FILE_READ, SHELL, ISSUE, mode="bypass", on_updates_applied=callback)
    updates = [PermissionUpdate.add("Bash:git *"), PermissionUpdate.add(rule, behavior=behavior)]
    with pytest.raises(ConfigError, match="can never match") as info:
        await permissions.accept_updates(updates, source="tool")
    assert f"permission update add {behavior} rule {rule!r}" in str(info.value)
    assert f"write {normal!r}" in str(info.value) and "nothing of these permission updates was applied" in str(
        info.value
    )
    with pytest.raises(ConfigError, match="can never match"):
        permissions.apply_updates(updates)
    with pytest.raises(ConfigError, match="can never match"):  # a remove of it would take nothing out
        await permissions.accept_updates([PermissionUpdate.remove(rule, behavior=behavior)], source="tool")
    assert (callback.calls, permissions.session_allow_rules, permissions.session_deny_rules) == ([], (), ())
    # The configured check says the same of the same rule.
    with pytest.raises(ConfigError, match="can never match"):
        PermissionRules(**{behavior: [rule]}).check_tools([FILE_READ, SHELL, ISSUE])


@pytest.mark.parametrize(("rule", "normal"), REFUSED_LIVE_RULES)
async def test_a_live_rule_for_a_tool_the_engine_does_not_judge_is_taken(rule: str, normal: str) -> None:
    # As check_tools: a tool it was not given, or whose content a function of its own makes.
    for permissions in (
        PermissionEngine(),
        knowing(),
        PermissionEngine(signature_content={"Read": lambda input: "x", "Bash": lambda input: "x", "issue": str}),
        PermissionEngine(signature_content=lambda name, input: None),
    ):
        await permissions.accept_updates([PermissionUpdate.add(rule, behavior="deny")], source="tool")
        assert [r.text for r in permissions.session_deny_rules] == [rule]


async def test_a_live_rule_in_the_form_of_call_content_is_taken_and_denies() -> None:
    permissions = knowing(FILE_READ, SHELL, ISSUE, mode="bypass")
    updates = [
        PermissionUpdate.add(
            "Read:.env", "Read:src/.*", "Bash:git status*", "issue", "is*", "Other:./x", behavior="deny"
        )
    ]
    await permissions.accept_updates(updates, source="tool")
    for input in ({"file_path": "./.env"}, {"file_path": ".env"}, {"file_path": "src/.git/config"}):
        assert (await permissions.decide(FILE_READ, input, ctx())).allowed is False
    assert (await permissions.decide(FILE_READ, {"file_path": "README"}, ctx())).allowed is True


@pytest.mark.parametrize("answerer", ["handler", "hook"])
async def test_an_answer_with_a_refused_rule_update_denies_its_call_and_changes_nothing(
    answerer: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A handler relaying a person's answer (a web client's, say) is untrusted input: its bad rule
    # update fails that decision (a deny, source error), never the engine or the session.
    answer = Answerer(PermissionAllow(rule_updates=[PermissionUpdate.add("Read:./.env", behavior="deny")]))
    recorder, callback = Recorder(), UpdateLog()
    options: dict[str, Any] = {"handler": answer} if answerer == "handler" else {"hooks": [answer]}
    permissions = knowing(FILE_READ, SHELL, record=recorder, on_updates_applied=callback, **options)
    with caplog.at_level(logging.WARNING, logger="trio_agent.permissions"):
        decision = await permissions.decide(SHELL, {"command": "make"}, ctx())
    assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.ERROR, True)
    assert "refused rule update" in (decision.message or "") and "write 'Read:.env'" in (decision.message or "")
    assert [(phase, record.outcome) for phase, record in recorder.entries] == [
        ("requested", None),
        ("resolved", PermissionDecision.DENY),
    ]
    assert (callback.calls, permissions.session_deny_rules) == ([], ())
    assert "rule update that was refused" in caplog.text
    # The next answer, a good one, is taken as ever.
    answer.result = PermissionAllow(rule_updates=[PermissionUpdate.add("Read:.env", behavior="deny")])
    assert (await permissions.decide(SHELL, {"command": "make"}, ctx())).allowed
    assert [r.text for r in permissions.session_deny_rules] == ["Read:.env"]


async def test_conclude_refuses_an_answer_with_a_refused_rule_update_and_decides_nothing() -> None:
    callback = UpdateLog()
    permissions = knowing(FILE_READ, SHELL, on_updates_applied=callback)
    ask = await permissions.evaluate(SHELL, {"command": "make"}, ctx())
    assert isinstance(ask, AskNeeded)
    bad = PermissionAllow(rule_updates=[PermissionUpdate.add("Read:./.env", behavior="deny")], remember=True)
    with pytest.raises(ConfigError, match=r"'Read:\./\.env' can never match as written.*write 'Read:\.env'"):
        await permissions.conclude(SHELL, ask, ctx(), bad)
    assert (callback.calls, permissions.session_deny_rules, permissions.approved_signatures) == ([], (), frozenset())
    # The ask is still open to a good answer.
    good = PermissionAllow(rule_updates=[PermissionUpdate.add("Read:.env", behavior="deny")])
    assert (await permissions.conclude(SHELL, ask, ctx(), good)).allowed
    assert [r.text for r in permissions.session_deny_rules] == ["Read:.env"]


async def test_a_stored_rule_that_would_be_refused_now_is_replayed_as_it_was(caplog: pytest.LogCaptureFixture) -> None:
    # A journal from before live rules were checked may hold one: replay must not fail the reopen.
    stored = [update_to_json(PermissionUpdate.add("Read:./.env", "Read:.env", behavior="deny"))]
    callback = UpdateLog()
    permissions = knowing(FILE_READ, mode="bypass", on_updates_applied=callback)
    with caplog.at_level(logging.WARNING, logger="trio_agent.permissions"):
        permissions.replay_updates([update_from_json(value) for value in stored])
    assert [r.text for r in permissions.session_deny_rules] == ["Read:./.env", "Read:.env"]
    [warning] = [r.getMessage() for r in caplog.records if r.name == "trio_agent.permissions"]
    assert "replayed a stored permission update as it was" in warning and "'Read:./.env'" in warning
    assert callback.calls == []
    # A remove of the rule the layer holds is taken; forget_session removes (and reports) the rest.
    await permissions.accept_updates([PermissionUpdate.remove("Read:./.env", behavior="deny")], source="tool")
    assert [r.text for r in permissions.session_deny_rules] == ["Read:.env"]
    permissions.replay_updates([update_from_json(value) for value in stored])
    await permissions.forget_session()
    assert permissions.session_deny_rules == ()
    [_, (removed, source, _)] = callback.calls
    assert (source, [r.text for u in removed for r in u.rules]) == ("forget_session", ["Read:.env", "Read:./.env"])


async def test_a_mode_change_is_reported_before_it_applies_and_replays() -> None:
    # engine.mode = ... changed the live mode only: nothing was reported, so a session could not
    # journal it and a reopen was back in the configured mode (a switch to plan failed open).
    modes: list[PermissionMode] = []

    def on_applied(updates: tuple[PermissionUpdate, ...], /, *, source: str, call_id: str | None) -> None:
        modes.append(permissions.mode)  # write-ahead: still the old mode while it is reported
        log.append((updates, source, call_id))

    log: list[tuple[tuple[PermissionUpdate, ...], str, str | None]] = []
    permissions = engine(mode="bypass", on_updates_applied=on_applied)
    await permissions.set_mode("plan")
    assert log == [((PermissionUpdate.set_mode("plan"),), "set_mode", None)]
    assert (modes, permissions.mode) == ([PermissionMode.BYPASS], PermissionMode.PLAN)
    refused = await permissions.decide(WRITE, {"file_path": "a"}, ctx())
    assert (refused.allowed, refused.source) == (False, DecisionSource.MODE)
    # Assigning would skip the report: refused, naming the way that reports.
    with pytest.raises(ConfigError, match=r"await permissions.set_mode\('default'\)"):
        permissions.mode = "default"
    with pytest.raises(ConfigError, match="permission mode must be one of"):
        await permissions.set_mode("yolo")
    assert (permissions.mode, len(log)) == (PermissionMode.PLAN, 1)
    # A reopened engine (configured bypass) replays the stored switch without reporting it again.
    reopened = engine(mode="bypass", on_updates_applied=on_applied)
    reopened.replay_updates([update_from_json(update_to_json(update)) for update in log[0][0]])
    assert (reopened.mode, len(log)) == (PermissionMode.PLAN, 1)
    # A handler's answer may switch the mode too, once its allow stood (reported as the handler's).
    answering = engine(
        mode="plan",
        ask=("Read",),
        handler=Answerer(PermissionAllow(rule_updates=[PermissionUpdate.set_mode("accept_edits")])),
        on_updates_applied=on_applied,
    )
    asked = await answering.decide(READ, {"file_path": "a"}, ctx(call_id="call-9"))
    assert (asked.allowed, asked.source, answering.mode) == (True, DecisionSource.HANDLER, PermissionMode.ACCEPT_EDITS)
    assert log[-1][1:] == ("handler", "call-9")


async def test_concurrent_updates_take_effect_in_the_order_they_were_reported() -> None:
    # accept_updates reported (journalled), awaited, then applied, unordered between callers: the
    # journal held plan then bypass (a reopen is in bypass) while the live engine ended in plan.
    reported: list[PermissionMode | None] = []
    plan_written = trio.Event()

    async def journal(updates: tuple[PermissionUpdate, ...], /, *, source: str, call_id: str | None) -> None:
        reported.append(updates[0].mode)
        if updates[0].mode is PermissionMode.PLAN:
            await plan_written.wait()  # the first write is slow to commit

    permissions = engine(on_updates_applied=journal)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(permissions.set_mode, "plan")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(permissions.set_mode, "bypass")
        await trio.testing.wait_all_tasks_blocked()
        plan_written.set()
    assert reported == [PermissionMode.PLAN, PermissionMode.BYPASS]
    assert permissions.mode is PermissionMode.BYPASS  # the journal's last word, as a reopen replays it


async def test_an_update_whose_report_is_cancelled_still_applies() -> None:
    # A cancellation after the report's write went out (a journal has it, and confirms it) left the
    # update durable but not live: a session in plan after a reopen, in default until then.
    written: list[PermissionUpdate] = []

    async def journal(updates: tuple[PermissionUpdate, ...], /, *, source: str, call_id: str | None) -> None:
        written.extend(updates)
        await trio.sleep_forever()  # waiting for the commit when the cancellation comes

    permissions = engine(on_updates_applied=journal)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(permissions.set_mode, "plan")
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert written == [PermissionUpdate.set_mode("plan")]
    assert permissions.mode is PermissionMode.PLAN


def test_set_mode_json_round_trip() -> None:
    import json

    update = PermissionUpdate.set_mode(PermissionMode.ACCEPT_EDITS)
    stored = json.loads(json.dumps(update_to_json(update)))
    assert stored == {"action": "set_mode", "mode": "accept_edits"}
    assert update_from_json(stored) == update


@pytest.mark.parametrize(
    "update",
    [
        PermissionUpdate.add("Bash:git *"),
        PermissionUpdate.add("Bash:rm *", "mcp__*", behavior="deny"),
        PermissionUpdate.remove("Read", behavior="allow"),
        PermissionUpdate.remove("Task:Explore:*", behavior="deny"),
    ],
)
def test_update_json_round_trip(update: PermissionUpdate) -> None:
    import json

    stored = json.loads(json.dumps(update_to_json(update)))
    assert stored["action"] == update.action and stored["behavior"] == update.behavior.value
    assert stored["rules"] == [rule.text for rule in update.rules]
    again = update_from_json(stored)
    assert again == update and [r.text for r in again.rules] == [r.text for r in update.rules]


@pytest.mark.parametrize(
    "stored",
    [
        None,
        [],
        {"action": "add", "rules": ["Bash"]},
        {"action": "add", "behavior": "allow", "rules": ["Bash"], "extra": 1},
        {"action": "grant", "behavior": "allow", "rules": ["Bash"]},
        {"action": "add", "behavior": "ask", "rules": ["Bash"]},
        {"action": "add", "behavior": "allow", "rules": "Bash"},
        {"action": "add", "behavior": "allow", "rules": []},
        {"action": "add", "behavior": "allow", "rules": ["Bash:"]},
        {"action": "add", "behavior": 1, "rules": ["Bash"]},
        {"action": "set_mode", "mode": "yolo"},
        {"action": "set_mode", "mode": 1},
        {"action": "set_mode"},
        {"action": "set_mode", "mode": "plan", "rules": []},
        {"action": "add", "behavior": "allow", "rules": ["Bash"], "mode": "plan"},
    ],
)
def test_update_from_json_rejects_what_update_to_json_never_makes(stored: Any) -> None:
    with pytest.raises(ConfigError):
        update_from_json(stored)


# -- tools whose every call will be denied (settlement surprise 1) ----------------------------------


@pytest.mark.parametrize(
    ("kwargs", "tool", "expected"),
    [
        ({}, "Write", "permission mode 'default' asks before write tools"),
        ({}, "Read", None),
        ({"mode": "accept_edits"}, "Write", None),
        ({"mode": "accept_edits"}, "Shell", "permission mode 'accept_edits' asks before execute tools"),
        ({"mode": "plan"}, "Write", None),  # plan's refusal is the point of plan
        ({"mode": "bypass", "ask": ("Write",)}, "Write", None),
        ({"allow": ("Write",)}, "Write", None),
        ({"allow": ("Wr*",)}, "Write", None),
        ({"allow": ("Shell:ls*",)}, "Shell", None),  # some calls can run
        ({"deny": ("Write",)}, "Write", None),  # refused on purpose
        ({"ask": ("Read",)}, "Read", "it matches ask rule 'Read'"),
        ({"handler": Answerer(None)}, "Write", None),
        ({"hooks": [Answerer(PermissionAllow())]}, "Write", None),  # an engine hook's allow grants (row 13)
        ({}, "Bash", None),  # its resolver may narrow a call to readonly
    ],
)
def test_never_allowed(kwargs: dict[str, Any], tool: str, expected: str | None) -> None:
    tools = {"Write": WRITE, "Read": READ, "Bash": BASH, "Shell": make_tool("Shell")}
    assert engine(**kwargs).never_allowed(tools[tool]) == expected


# -- input the validator cannot encode (issue 11 item 8) --------------------------------------------


STRICT_SHELL = define_tool(
    _echo, name="Shell", description="d", kind="execute", side_effect="non_idempotent",
    input_schema={"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)  # fmt: skip


@pytest.mark.parametrize("mode", list(PermissionMode))
async def test_a_lone_surrogate_key_is_a_validation_error(mode: PermissionMode) -> None:
    handler = Answerer(PermissionAllow())
    decision = await engine(mode=mode, handler=handler).decide(STRICT_SHELL, {"\ud800": 1, "command": "ls"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.VALIDATION)
    assert decision.message is not None and "lone surrogate" in decision.message
    decision.message.encode("utf-8")  # the message itself is valid Unicode
    stage = decision.to_stage_decision()
    assert isinstance(stage, Deny) and (stage.type, stage.code) == (ToolErrorType.VALIDATION, "invalid_input")
    assert handler.calls == 0


async def test_a_lone_surrogate_key_in_a_pipeline_is_invalid_input_not_a_hook_error() -> None:
    permissions = engine(mode="bypass")
    pipeline = ToolPipeline([STRICT_SHELL], stages=ToolStages(permission=[permissions.as_stage()]))
    record = await call_tool(pipeline, "Shell", {"\ud800": 1, "command": "ls"})
    assert record.result.error is not None and not record.tool_ran
    assert (record.result.error.type, record.result.error.code) == (ToolErrorType.VALIDATION, "invalid_input")


async def test_a_path_the_file_system_cannot_encode_is_denied_by_the_path_policy(tmp_path: Path) -> None:
    policy = PathPolicy([tmp_path])
    problem = policy.violation("a/\ud800.txt")
    assert problem is not None and "not a valid file name" in problem
    permissions = engine(mode="bypass", path_policy=policy)
    decision = await permissions.decide(WRITE, {"file_path": "a/\ud800.txt"}, ctx())
    assert (decision.allowed, decision.source) == (False, DecisionSource.PATH_POLICY)


# -- evaluate() and conclude(): an answer given elsewhere (interrupts) ------------------------------


def fields(decision: Decision) -> tuple[Any, ...]:
    return (
        decision.allowed, decision.source, decision.input, decision.signature, decision.message,
        decision.stop_loop, decision.rule, decision.asked, decision.permission_id,
    )  # fmt: skip


async def test_evaluate_returns_ask_needed_for_the_default_ask_and_records_nothing() -> None:
    handler, recorder, updates = Answerer(PermissionAllow()), Recorder(), UpdateLog()
    permissions = engine(handler=handler, record=recorder, on_updates_applied=updates)
    input = {"file_path": "a"}
    ask = await permissions.evaluate(WRITE, input, ctx())
    assert ask == AskNeeded(
        tool_name="Write", input={"file_path": "a"}, signature="Write", reason=AskReason.MODE, message=None,
        rule=None, tool_kind=ToolKind.WRITE, side_effect=SideEffect.IDEMPOTENT, affected_paths=("a",),
    )  # fmt: skip
    assert isinstance(ask, AskNeeded) and ask.input is input
    assert (handler.calls, recorder.log, updates.calls) == (0, [], [])


async def test_evaluate_returns_ask_needed_for_an_ask_rule() -> None:
    ask = await engine(ask=("Bash:git *",), mode="accept_edits").evaluate(BASH, {"command": "git push"}, ctx())
    assert isinstance(ask, AskNeeded)
    assert (ask.reason, ask.rule, ask.signature, ask.message) == (AskReason.RULE, "Bash:git *", "Bash:git push", None)
    assert (ask.tool_kind, ask.side_effect, ask.affected_paths) == (ToolKind.EXECUTE, SideEffect.NON_IDEMPOTENT, ())


async def test_evaluate_returns_ask_needed_for_a_tool_level_ask_even_in_bypass_with_an_allow_rule() -> None:
    checks = {"Read": lambda input: PermissionAsk("reading secrets?")}
    ask = await engine(mode="bypass", allow=("Read",), tool_checks=checks).evaluate(READ, {"file_path": "x"}, ctx())
    assert isinstance(ask, AskNeeded)
    assert (ask.reason, ask.message, ask.rule, ask.tool_kind) == (
        AskReason.TOOL, "reading secrets?", None, ToolKind.READONLY,
    )  # fmt: skip


async def test_evaluate_gives_decide_s_decision_where_nobody_is_asked() -> None:
    permissions = engine(allow=("Bash:git *",), deny=("Bash:rm *",))
    for input in ({"command": "git status"}, {"command": "rm -rf x"}, {"command": "ls"}):
        decision = await permissions.evaluate(BASH, input, ctx())
        assert isinstance(decision, Decision)
        assert fields(decision) == fields(await permissions.decide(BASH, input, ctx()))


async def test_conclude_an_allow() -> None:
    recorder, updates = Recorder(), UpdateLog()
    permissions = engine(record=recorder, on_updates_applied=updates)
    input = {"file_path": "a"}
    ask = await permissions.evaluate(WRITE, input, ctx())
    assert isinstance(ask, AskNeeded)
    decision = await permissions.conclude(WRITE, ask, ctx(), PermissionAllow())
    assert fields(decision) == (
        True, DecisionSource.INTERRUPT, input, "Write", "allowed by the permission interrupt", False, None, True, None,
    )  # fmt: skip
    assert decision.input is input and decision.to_stage_decision(input) == Allow(None)
    assert decision.outcome is PermissionDecision.ALLOW
    assert (recorder.log, updates.calls) == ([], [])  # nothing recorded, nothing to apply


async def test_conclude_an_allow_with_edited_input_that_passes(tmp_path: Path) -> None:
    permissions = engine(path_policy=PathPolicy([tmp_path]))
    ask = await permissions.evaluate(WRITE, {"file_path": "a"}, ctx())
    assert isinstance(ask, AskNeeded)
    edited = {"file_path": "b"}
    decision = await permissions.conclude(WRITE, ask, ctx(), PermissionAllow(updated_input=edited))
    assert (decision.allowed, decision.source, decision.input, decision.signature) == (
        True, DecisionSource.INTERRUPT, edited, "Write",
    )  # fmt: skip
    assert decision.to_stage_decision({"file_path": "a"}) == Allow(edited)


async def test_conclude_an_edit_that_a_deny_rule_refuses_and_nothing_of_the_allow_applies() -> None:
    updates = UpdateLog()
    permissions = engine(ask=("Bash:git *",), deny=("Bash:rm *",), on_updates_applied=updates)
    call = ctx()
    ask = await permissions.evaluate(BASH, {"command": "git push"}, call)
    assert isinstance(ask, AskNeeded)
    answer = PermissionAllow(
        updated_input={"command": "rm -rf /"}, rule_updates=[PermissionUpdate.add("Bash")], remember=True
    )
    decision = await permissions.conclude(BASH, ask, call, answer)
    assert (decision.allowed, decision.source, decision.rule, decision.signature, decision.asked) == (
        False, DecisionSource.RULE, "Bash:rm *", "Bash:rm -rf /", True,
    )  # fmt: skip
    assert (updates.calls, permissions.session_allow_rules, permissions.approved_signatures) == ([], (), frozenset())


async def test_conclude_an_edit_that_fails_the_schema() -> None:
    permissions = engine()
    ask = await permissions.evaluate(STRICT_SHELL, {"command": "ls"}, ctx())
    assert isinstance(ask, AskNeeded)
    decision = await permissions.conclude(STRICT_SHELL, ask, ctx(), PermissionAllow(updated_input={"command": 3}))
    assert (decision.allowed, decision.source) == (False, DecisionSource.VALIDATION)
    stage = decision.to_stage_decision()
    assert isinstance(stage, Deny) and (stage.type, stage.code) == (ToolErrorType.VALIDATION, "invalid_input")


async def test_conclude_an_edit_that_leaves_the_workspace(tmp_path: Path) -> None:
    permissions = engine(path_policy=PathPolicy([tmp_path]))
    ask = await permissions.evaluate(WRITE, {"file_path": "a"}, ctx())
    assert isinstance(ask, AskNeeded)
    answer = PermissionAllow(updated_input={"file_path": "../outside"})
    decision = await permissions.conclude(WRITE, ask, ctx(), answer)
    assert (decision.allowed, decision.source) == (False, DecisionSource.PATH_POLICY)


async def test_conclude_an_allow_when_plan_mode_now_denies() -> None:
    permissions = engine()
    ask = await permissions.evaluate(WRITE, {"file_path": "a"}, ctx())
    assert isinstance(ask, AskNeeded)
    permissions.mode = PermissionMode.PLAN  # switched while the person was deciding
    decision = await permissions.conclude(WRITE, ask, ctx(), PermissionAllow())
    assert (decision.allowed, decision.source, decision.asked) == (False, DecisionSource.MODE, True)
    assert decision.message == "plan mode denies write tools: 'Write' is not read-only"


async def test_conclude_a_deny() -> None:
    permissions = engine()
    input = {"file_path": "a"}
    ask = await permissions.evaluate(WRITE, input, ctx())
    assert isinstance(ask, AskNeeded)
    decision = await permissions.conclude(WRITE, ask, ctx(), PermissionDeny("not that file", stop_loop=True))
    assert fields(decision) == (
        False, DecisionSource.INTERRUPT, input, "Write", "not that file", True, None, True, None,
    )  # fmt: skip
    stage = decision.to_stage_decision(input)
    assert isinstance(stage, Deny) and (stage.type, stage.code) == (ToolErrorType.PERMISSION_DENIED, "stop_loop")
    assert decision.outcome is PermissionDecision.DENY


async def test_conclude_satisfies_a_tool_level_ask_and_a_tool_deny_still_denies() -> None:
    seen: list[dict[str, Any]] = []

    def check(input: dict[str, Any]) -> PermissionResult:
        seen.append(input)
        if input.get("file_path") == "secret":
            return PermissionDeny("never the secret")
        return PermissionAsk("sure?")

    permissions = engine(mode="bypass", tool_checks={"Read": check})
    ask = await permissions.evaluate(READ, {"file_path": "x"}, ctx())
    assert isinstance(ask, AskNeeded) and ask.reason is AskReason.TOOL
    allowed = await permissions.conclude(READ, ask, ctx(), PermissionAllow())
    assert (allowed.allowed, allowed.source) == (True, DecisionSource.INTERRUPT)
    assert len(seen) == 2  # the check ran again on the answered input
    denied = await permissions.conclude(READ, ask, ctx(), PermissionAllow(updated_input={"file_path": "secret"}))
    assert (denied.allowed, denied.source, denied.message) == (False, DecisionSource.TOOL, "never the secret")


async def test_conclude_applies_the_rule_updates_and_remember_of_an_allow_that_stood() -> None:
    updates = UpdateLog()
    permissions = engine(on_updates_applied=updates)
    call = ctx()
    ask = await permissions.evaluate(BASH, {"command": "git push"}, call)
    assert isinstance(ask, AskNeeded)
    update = PermissionUpdate.add("Bash:git *")
    answer = PermissionAllow(updated_input={"command": "git pull"}, rule_updates=[update], remember=True)
    decision = await permissions.conclude(BASH, ask, call, answer)
    assert decision.allowed
    assert updates.calls == [((update,), "interrupt", call.tool_call_id)]
    assert [rule.text for rule in permissions.session_allow_rules] == ["Bash:git *"]
    assert permissions.approved_signatures == {"Bash:git pull"}
    again = await permissions.evaluate(BASH, {"command": "git pull"}, ctx())
    assert isinstance(again, Decision) and (again.allowed, again.source) == (True, DecisionSource.SESSION)


async def test_conclude_refuses_a_mismatched_tool_or_a_non_answer() -> None:
    permissions = engine()
    ask = await permissions.evaluate(WRITE, {"file_path": "a"}, ctx())
    assert isinstance(ask, AskNeeded)
    with pytest.raises(ConfigError, match="for tool 'Write', not 'Bash'"):
        await permissions.conclude(BASH, ask, ctx(), PermissionAllow())
    with pytest.raises(ConfigError, match="PermissionAllow or a PermissionDeny"):
        await permissions.conclude(WRITE, ask, ctx(), PermissionAsk())  # type: ignore[arg-type]


EVAL_RULES = ["*", "Bash", "Bash:git *", "Bash:ls*", "Read", "Re*", "Write", "Write:a"]
EVAL_TOOLS = {"Bash": BASH, "Read": READ, "Write": WRITE}
EVAL_INPUTS = {
    "Bash": [{"command": "git status"}, {"command": "ls -l"}, {"command": "rm -rf x"}],
    "Read": [{"file_path": "a"}, {"file_path": "../a"}],
    "Write": [{"file_path": "a"}, {"file_path": "b/c"}, {"file_path": "../a"}],
}


@settings(max_examples=300, deadline=None)
@given(
    placed=st.lists(st.tuples(st.sampled_from(EVAL_RULES), st.sampled_from(["allow", "ask", "deny"])), max_size=5),
    mode=st.sampled_from(list(PermissionMode)),
    tool_name=st.sampled_from(sorted(EVAL_TOOLS)),
    which=st.integers(0, 2),
    check=st.sampled_from(["none", "ask", "deny", "normalise", "raise"]),
    remembered=st.booleans(),
    filtered=st.booleans(),
)
def test_evaluate_walks_the_table_as_decide_does(
    placed: list[tuple[str, str]],
    mode: PermissionMode,
    tool_name: str,
    which: int,
    check: str,
    remembered: bool,
    filtered: bool,
) -> None:
    lists: dict[str, list[str]] = {"allow": [], "ask": [], "deny": []}
    used: set[Rule] = set()
    for text, behavior in placed:
        if Rule.parse(text) not in used:
            used.add(Rule.parse(text))
            lists[behavior].append(text)
    tool = EVAL_TOOLS[tool_name]
    inputs = EVAL_INPUTS[tool_name]
    input = inputs[which % len(inputs)]

    def tool_check(value: dict[str, Any]) -> PermissionResult | None:
        if check == "raise":
            raise RuntimeError("check broke")
        if check == "normalise":
            return PermissionAllow(updated_input={**value, "normalised": True})
        return {"none": None, "ask": PermissionAsk("tool asks"), "deny": PermissionDeny("tool says no")}[check]

    handler = Answerer(ASKED)
    permissions = engine(
        mode=mode, handler=handler, tool_checks={tool_name: tool_check},
        path_policy=PathPolicy(["/nonexistent-workspace"]),
        tool_filter=ToolFilter(disallowed=[tool_name] if filtered else None), **lists,
    )  # fmt: skip
    if remembered:
        permissions.remember(permissions.signature(tool, input))

    async def both() -> tuple[Decision | AskNeeded, Decision]:
        return await permissions.evaluate(tool, input, ctx()), await permissions.decide(tool, input, ctx())

    verdict, decision = trio.run(both)
    if isinstance(verdict, Decision):
        assert handler.calls == 0
        assert fields(verdict) == fields(decision)
    else:
        (request,) = handler.requests
        assert (
            request.tool_name, request.input, request.signature, request.reason, request.message, request.rule,
            request.tool_kind, request.side_effect, request.affected_paths,
        ) == (
            verdict.tool_name, verdict.input, verdict.signature, verdict.reason, verdict.message, verdict.rule,
            verdict.tool_kind, verdict.side_effect, verdict.affected_paths,
        )  # fmt: skip
        assert (decision.source, decision.message, decision.asked) == (DecisionSource.HANDLER, ASKED.message, True)


# -- the stage's fast path: a call the table allows whatever its input ---------------------------------


def _plain_tool(kind: str, schema: dict[str, Any], **options: Any) -> Tool[Any]:
    return define_tool(
        _echo, name="Plain", description="a plain tool", kind=kind, side_effect="pure", input_schema=schema, **options
    )


_PLAIN_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


async def test_a_plain_tool_in_a_mode_that_allows_its_kind_is_allowed_outright() -> None:
    """The stage skips the table (`allows_outright`) exactly where nothing but the schema can refuse."""
    tool = _plain_tool("readonly", _PLAIN_SCHEMA)
    plain = PermissionEngine()
    assert plain.allows_outright(tool, "root")
    walked: list[str] = []

    class Counting(PermissionEngine):
        __slots__ = ()

        async def decide(self, tool: Tool[Any], input: Any, context: ExecutionContext) -> Decision:
            walked.append(tool.name)
            return await super().decide(tool, input, context)

    counting = Counting()
    stage = counting.as_stage()
    assert await stage(StageRequest(tool, {"n": 1}, ctx(), tool.behavior)) == Allow(None)
    assert walked == []  # allowed without walking the table
    # Input that fails the schema walks it, and is denied as the table denies it.
    decision = await stage(StageRequest(tool, {"n": "x"}, ctx(), tool.behavior))
    assert isinstance(decision, Deny) and decision.type is ToolErrorType.VALIDATION
    assert walked == ["Plain"]
    # Anything that could refuse some input, or ask, takes the table.
    assert not PermissionEngine(mode="plan").allows_outright(_plain_tool("write", _PLAIN_SCHEMA), "root")
    assert not PermissionEngine().allows_outright(_plain_tool("execute", _PLAIN_SCHEMA), "root")
    assert not PermissionEngine(PermissionRules(ask=("Plain",))).allows_outright(tool, "root")
    assert not PermissionEngine(PermissionRules(deny=("Other",))).allows_outright(tool, "root")
    assert not PermissionEngine(tool_filter=ToolFilter(allowed=["Other"])).allows_outright(tool, "root")
    assert not PermissionEngine(signature_content={"Plain": lambda input: "x"}).allows_outright(tool, "root")
    assert not PermissionEngine().allows_outright(
        _plain_tool("readonly", _PLAIN_SCHEMA, check_permissions=lambda i: None), "root"
    )


_FAST_RULES = st.sampled_from(["Plain", "Other", "Plain:rm *", "Plain:ls*"])


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["readonly", "write", "execute"]),
    mode=st.sampled_from(list(PermissionMode)),
    allow=st.lists(_FAST_RULES, max_size=1, unique=True),
    ask=st.lists(_FAST_RULES, max_size=1, unique=True),
    deny=st.lists(_FAST_RULES, max_size=1, unique=True),
    allowed_tools=st.sampled_from([None, ["Plain"], ["Other"]]),
    with_check=st.booleans(),
    with_content=st.booleans(),
    command=st.sampled_from(["ls", "rm -rf x", 7]),
)
def test_the_stage_decides_as_the_table_with_or_without_the_fast_path(
    kind: str,
    mode: PermissionMode,
    allow: list[str],
    ask: list[str],
    deny: list[str],
    allowed_tools: list[str] | None,
    with_check: bool,
    with_content: bool,
    command: Any,
) -> None:
    """Whatever the configuration and input, the stage answers what `decide` answers (the fast
    path only skips a walk whose answer is known), and the fast path allows nothing the table denies."""
    try:
        rules = PermissionRules(allow=tuple(allow), ask=tuple(ask), deny=tuple(deny))
    except ConfigError:
        return  # the same rule in two lists
    schema = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    tool = _plain_tool(
        kind,
        schema,
        check_permissions=(lambda input: PermissionAsk("check")) if with_check else None,
        signature_content=(lambda input: input["command"]) if with_content else None,
    )
    permissions = PermissionEngine(
        rules,
        mode=mode,
        tool_filter=None if allowed_tools is None else ToolFilter(allowed=allowed_tools),
    )
    input = {"command": command}

    async def main() -> None:
        table = await permissions.decide(tool, input, ctx())
        staged = await permissions.as_stage()(StageRequest(tool, input, ctx(), tool.behavior))
        assert staged == table.to_stage_decision(input)
        if permissions.allows_outright(tool, "root") and isinstance(command, str):
            assert table.allowed

    trio.run(main)
