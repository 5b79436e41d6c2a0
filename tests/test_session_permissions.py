"""Permissions inside real sessions: rules, modes, the handler, durability of asks, tool lists,
the path policy, subagents' calls, and handlers that hang.

The decision table itself is pinned engine-side (tests/test_permissions.py); here we check what a
session makes of it: what runs, what the model sees, what the journal keeps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.session_helpers import run_request, stream_events
from trio_agent import (
    ConfigError,
    HookEvent,
    HookInput,
    HookOutput,
    PermissionAllow,
    PermissionDeny,
    PermissionRequest,
    PermissionRules,
    RequestAbortedError,
    SubagentDefinition,
    Tool,
    ToolContext,
    ToolResult,
    ToolResultEvent,
    ToolUseEvent,
    define_agent,
    define_tool,
    open_session,
)
from trio_agent._journal._events import (
    PermissionDecision,
    PermissionRequested,
    PermissionResolved,
    RequestInterrupted,
    ToolCancelled,
    ToolScheduled,
    ToolStarted,
)
from trio_agent.models import ModelRequest, ToolResultMessage
from trio_agent.testing import Reply, TestModel

# -- helpers -----------------------------------------------------------------------------

KINDS = {"read": "readonly", "write": "write", "run": "execute"}


def make_tool(name: str, log: list[Any], *, kind: str = "readonly", paths: bool = False) -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: ToolContext) -> ToolResult:
        log.append((name, ctx.agent_id, dict(inp)))
        return ToolResult.success(f"{name}:{inp.get('x', '')}")

    return define_tool(
        run,
        name=name,
        description=f"the {name} tool",
        side_effect="pure" if kind == "readonly" else "idempotent",
        kind=kind,
        input_schema={
            "type": "object",
            "properties": {"x": {"type": "string"}, "path": {"type": "string"}, "dry_run": {"type": "boolean"}},
        },
        affected_paths=(lambda inp: [inp["path"]] if "path" in inp else []) if paths else None,
    )


def three_tools(log: list[Any]) -> list[Tool[Any]]:
    return [make_tool(name, log, kind=kind) for name, kind in KINDS.items()]


def results_by_call(request: ModelRequest) -> dict[str, ToolResultMessage]:
    return {m.tool_call_id: m for m in request.messages if isinstance(m, ToolResultMessage)}


def result_messages(request: ModelRequest) -> list[ToolResultMessage]:
    return [m for m in request.messages if isinstance(m, ToolResultMessage)]


def ran_names(log: list[Any]) -> set[str]:
    return {name for name, _, _ in log}


def calls_all(*names: str) -> Reply:
    return Reply(tool_calls=[(name, {"x": name}) for name in names])


# ======================================================================== rules


@pytest.mark.parametrize(
    "permissions",
    [
        pytest.param({"allow": ["write"], "deny": ["run"], "ask": ["read"]}, id="mapping"),
        pytest.param(PermissionRules(allow=["write"], deny=["run"], ask=["read"]), id="PermissionRules"),
    ],
)
async def test_allow_deny_and_ask_rules_without_a_handler(permissions: Any) -> None:
    """allow runs a write tool without asking; deny refuses; ask with nobody to ask denies,
    and the model sees a permission error for both refusals."""
    log: list[Any] = []
    model = TestModel({"go": [calls_all("read", "write", "run"), Reply(text="ok")]})
    async with open_session(provider=model, tools=three_tools(log), permissions=permissions) as session:
        seen, done = await run_request(session, "go")
        events = await stream_events(session)
    assert done.stop_reason == "end_turn"
    assert ran_names(log) == {"write"}
    errors = {e.tool_name: e.result.error for e in seen if isinstance(e, ToolResultEvent)}
    assert errors["write"] is None
    assert errors["run"] is not None and errors["run"].type.value == "permission_denied"
    assert "denied by rule" in errors["run"].message
    assert errors["read"] is not None and errors["read"].type.value == "permission_denied"
    messages = result_messages(model.requests[1])
    assert [m.is_error for m in messages] == ["write" not in m.content for m in messages]
    # Nobody was asked, so nothing about asking was journalled.
    assert not any(isinstance(e, (PermissionRequested, PermissionResolved)) for e in events)


async def test_conflicting_or_unknown_rule_lists_reject_the_session() -> None:
    model = TestModel(default=Reply(text="never"))
    with pytest.raises(ConfigError, match="both"):
        async with open_session(provider=model, permissions={"allow": ["run"], "deny": ["run:*"]}):
            pytest.fail("must not start")  # pragma: no cover
    with pytest.raises(ConfigError, match="permissions"):
        async with open_session(provider=model, permissions={"allow": ["run"], "maybe": ["x"]}):
            pytest.fail("must not start")  # pragma: no cover


# ======================================================================== modes

MODE_TABLE = {
    # mode: which of read/write/run run with no handler at all
    "default": {"read"},
    "accept_edits": {"read", "write"},
    "plan": {"read"},
    "bypass": {"read", "write", "run"},
}
# ...and which ones reach an allow-everything handler.
ASKS = {"default": {"write", "run"}, "accept_edits": {"run"}, "plan": set(), "bypass": set()}


@pytest.mark.parametrize("mode", list(MODE_TABLE))
async def test_modes_without_a_handler(mode: str) -> None:
    log: list[Any] = []
    model = TestModel({"go": [calls_all("read", "write", "run"), Reply(text="ok")]})
    async with open_session(provider=model, tools=three_tools(log), permission_mode=mode) as session:
        seen, _ = await run_request(session, "go")
    assert ran_names(log) == MODE_TABLE[mode]
    for event in seen:
        if isinstance(event, ToolResultEvent):
            assert (event.result.error is None) == (event.tool_name in MODE_TABLE[mode])


@pytest.mark.parametrize("mode", list(MODE_TABLE))
async def test_modes_with_an_allowing_handler(mode: str) -> None:
    """The handler is asked exactly where the mode says ask; plan's denial is a hard limit it never sees."""
    log: list[Any] = []
    asked: list[str] = []

    async def allow_all(request: PermissionRequest) -> PermissionAllow:
        asked.append(request.tool_name)
        return PermissionAllow()

    model = TestModel({"go": [calls_all("read", "write", "run"), Reply(text="ok")]})
    async with open_session(
        provider=model, tools=three_tools(log), permission_mode=mode, permission_handler=allow_all
    ) as session:
        await session.send("go")
        events = await stream_events(session)
    assert set(asked) == ASKS[mode] and len(asked) == len(ASKS[mode])
    expected = {"read"} if mode == "plan" else {"read", "write", "run"}
    assert ran_names(log) == expected
    requested = [e for e in events if isinstance(e, PermissionRequested)]
    assert len(requested) == len(ASKS[mode])


async def test_plan_mode_denial_is_visible_to_the_model() -> None:
    log: list[Any] = []
    model = TestModel({"go": [calls_all("write"), Reply(text="ok")]})
    async with open_session(provider=model, tools=three_tools(log), permission_mode="plan") as session:
        await session.send("go")
    [message] = result_messages(model.requests[1])
    assert message.is_error and "plan mode" in message.content
    assert log == []


# ======================================================================== the handler


async def test_handler_allow_with_updated_input_is_durable() -> None:
    log: list[Any] = []
    requests: list[PermissionRequest] = []

    async def dry_run(request: PermissionRequest) -> PermissionAllow:
        requests.append(request)
        return PermissionAllow(updated_input={**request.input, "dry_run": True})

    model = TestModel({"go": [Reply(tool_calls=[("write", {"x": "a"})]), Reply(text="ok")]})
    async with open_session(provider=model, tools=three_tools(log), permission_handler=dry_run) as session:
        await session.send("go")
        events = await stream_events(session)
    assert log == [("write", "root", {"x": "a", "dry_run": True})]
    [request] = requests
    assert request.agent_id == "root" and request.tool_kind.value == "write" and request.input == {"x": "a"}
    [scheduled] = [e for e in events if isinstance(e, ToolScheduled)]
    [started] = [e for e in events if isinstance(e, ToolStarted)]
    assert scheduled.model_input == {"x": "a"} and started.input == {"x": "a", "dry_run": True}
    [requested] = [e for e in events if isinstance(e, PermissionRequested)]
    [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
    assert requested.call_id == resolved.call_id == scheduled.call_id
    assert requested.permission_id == resolved.permission_id == f"{scheduled.call_id}:permission"
    assert resolved.decision is PermissionDecision.ALLOW
    kinds = [type(e) for e in events]
    assert kinds.index(ToolScheduled) < kinds.index(PermissionRequested) < kinds.index(PermissionResolved)
    assert kinds.index(PermissionResolved) < kinds.index(ToolStarted)


async def test_handler_deny_message_reaches_the_model_and_is_durable() -> None:
    log: list[Any] = []

    async def deny(request: PermissionRequest) -> PermissionDeny:
        return PermissionDeny("The user declined: not on Fridays.")

    model = TestModel({"go": [Reply(tool_calls=[("write", {"x": "a"})]), Reply(text="understood")]})
    async with open_session(provider=model, tools=three_tools(log), permission_handler=deny) as session:
        _, done = await run_request(session, "go")
        events = await stream_events(session)
    assert log == []
    assert done.text == "understood" and done.stop_reason == "end_turn"
    [message] = result_messages(model.requests[1])
    assert message.is_error and "not on Fridays" in message.content
    [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
    assert resolved.decision is PermissionDecision.DENY
    [cancelled] = [e for e in events if isinstance(e, ToolCancelled)]
    assert cancelled.call_id == resolved.call_id
    assert ToolStarted not in [type(e) for e in events]


async def test_handler_deny_with_stop_loop_stops_the_loop() -> None:
    log: list[Any] = []

    async def stop(request: PermissionRequest) -> PermissionDeny:
        return PermissionDeny("The user stopped the agent.", stop_loop=True)

    model = TestModel({"go": [Reply(tool_calls=[("write", {"x": "a"})]), Reply(text="must not be asked")]})
    async with open_session(provider=model, tools=three_tools(log), permission_handler=stop) as session:
        seen, done = await run_request(session, "go")
    assert log == []
    [result] = [e.result for e in seen if isinstance(e, ToolResultEvent)]
    assert result.error is not None and result.error.code == "stop_loop"  # the pipeline's part works
    assert len(model.requests) == 1, "no model call after a stop_loop denial"
    assert done.stop_reason == "permission_denied"


async def test_handler_remember_skips_the_next_ask() -> None:
    log: list[Any] = []
    asked: list[str] = []

    async def remember(request: PermissionRequest) -> PermissionAllow:
        asked.append(request.signature)
        return PermissionAllow(remember=True)

    model = TestModel(
        {"go": [calls_all("write"), Reply(text="one"), calls_all("write"), Reply(text="two")]},
    )
    async with open_session(provider=model, tools=three_tools(log), permission_handler=remember) as session:
        assert await session.send("go") == "one"
        assert await session.send("again") == "two"
        events = await stream_events(session)
    assert asked == ["write"]
    assert [name for name, _, _ in log] == ["write", "write"]
    assert sum(isinstance(e, PermissionRequested) for e in events) == 1


@pytest.mark.parametrize("behaviour", ["raises", "garbage"])
async def test_a_misbehaving_handler_denies(behaviour: str) -> None:
    log: list[Any] = []

    async def bad(request: PermissionRequest) -> Any:
        if behaviour == "raises":
            raise RuntimeError("ui crashed")
        return "yes"

    model = TestModel({"go": [calls_all("write"), Reply(text="ok")]})
    async with open_session(provider=model, tools=three_tools(log), permission_handler=bad) as session:
        assert await session.send("go") == "ok"
        events = await stream_events(session)
    assert log == []
    [message] = result_messages(model.requests[1])
    assert message.is_error
    [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
    assert resolved.decision is PermissionDecision.DENY


async def test_ask_without_a_handler_denies_with_a_model_visible_permission_error() -> None:
    log: list[Any] = []
    model = TestModel({"go": [calls_all("write"), Reply(text="ok")]})
    async with open_session(provider=model, tools=three_tools(log)) as session:
        seen, _ = await run_request(session, "go")
    assert log == []
    [result] = [e.result for e in seen if isinstance(e, ToolResultEvent)]
    assert result.error is not None and result.error.type.value == "permission_denied"
    [message] = result_messages(model.requests[1])
    assert message.is_error and "permission" in message.content


# ======================================================================== allowed / disallowed lists


@pytest.mark.parametrize(
    ("allowed", "disallowed", "expected"),
    [
        pytest.param(None, None, {"read", "write", "run"}, id="omitted-all"),
        pytest.param([], None, set(), id="empty-none"),
        pytest.param(["read"], None, {"read"}, id="only-read"),
        pytest.param(None, ["write"], {"read", "run"}, id="disallow-write"),
        pytest.param(None, [], {"read", "write", "run"}, id="disallow-empty"),
        pytest.param(["read", "write"], ["write"], {"read"}, id="both"),
        pytest.param([], ["read"], set(), id="empty-and-disallowed"),
    ],
)
async def test_allowed_and_disallowed_lists(
    allowed: list[str] | None, disallowed: list[str] | None, expected: set[str]
) -> None:
    """Omitted = all, empty = none; enforced on calls (the model calls every tool anyway), not only on
    what it is shown."""
    log: list[Any] = []
    model = TestModel({"go": [calls_all("read", "write", "run"), Reply(text="ok")]})
    async with open_session(
        provider=model,
        tools=three_tools(log),
        allowed_tools=allowed,
        disallowed_tools=disallowed,
        permission_mode="bypass",
    ) as session:
        seen, _ = await run_request(session, "go")
    assert {spec.name for spec in model.requests[0].tools} == expected
    assert ran_names(log) == expected
    for event in seen:
        if isinstance(event, ToolResultEvent):
            assert (event.result.error is None) == (event.tool_name in expected)
            if event.tool_name not in expected:
                assert "not available" in event.result.error.message  # type: ignore[union-attr]


async def test_allowed_and_disallowed_tools_may_be_iterators_read_once() -> None:
    """A generator is used up by one pass: the check and the filter read the same names, so a
    disallowed tool is never offered or run (it once stayed allowed: fail open)."""
    log: list[Any] = []
    model = TestModel({"go": [calls_all("read", "write", "run"), Reply(text="ok")]})
    async with open_session(
        provider=model,
        tools=three_tools(log),
        allowed_tools=iter(["read", "write"]),
        disallowed_tools=(name for name in ["write"]),
        permission_mode="bypass",
    ) as session:
        await run_request(session, "go")
    assert {spec.name for spec in model.requests[0].tools} == {"read"}
    assert ran_names(log) == {"read"}


@pytest.mark.parametrize("option", ["allowed_tools", "disallowed_tools"])
@pytest.mark.parametrize("value", [5, "read", {"read": 1}, [1]])
def test_a_tool_list_that_is_not_a_list_of_names_is_a_config_error(option: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"{option} must be a list of tool names"):
        define_agent(provider=TestModel(default=Reply(text="x")), **{option: value})


# ======================================================================== path policy


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "ws"
    outside = tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "link")
    return root, outside


def path_cases(root: Path, outside: Path) -> dict[str, tuple[str, bool]]:
    """name -> (path, allowed)."""
    return {
        "outside-absolute": (str(outside / "secret.txt"), False),
        "dotdot-escape": ("../outside/secret.txt", False),
        "dotdot-inside": ("sub/../file.txt", False),  # a '..' is denied even when it stays inside
        "symlink-escape": ("link/secret.txt", False),
        "inside-relative": ("sub/file.txt", True),
        "inside-absolute": (str(root / "file.txt"), True),
    }


@pytest.mark.parametrize("mode", ["default", "bypass"])
async def test_path_policy_in_a_session(workspace: tuple[Path, Path], mode: str) -> None:
    root, outside = workspace
    cases = path_cases(root, outside)
    log: list[Any] = []
    model = TestModel({"go": [Reply(tool_calls=[("touch", {"path": p}) for p, _ in cases.values()]), Reply(text="ok")]})

    async def allow_all(request: PermissionRequest) -> PermissionAllow:
        return PermissionAllow()

    async with open_session(
        provider=model,
        tools=[make_tool("touch", log, kind="write", paths=True)],
        workspace_roots=[root],
        permission_mode=mode,
        permission_handler=allow_all,
    ) as session:
        seen, _ = await run_request(session, "go")
    ran_paths = {inp["path"] for _, _, inp in log}
    assert ran_paths == {p for p, ok in cases.values() if ok}
    results = [e.result for e in seen if isinstance(e, ToolResultEvent)]
    assert sum(r.error is not None and r.error.type.value == "permission_denied" for r in results) == 4
    assert not (outside / "secret.txt").exists()


async def test_one_workspace_root_given_as_a_string_is_that_root(workspace: tuple[Path, Path]) -> None:
    # A lone string was split into one root per character, "/" among them: every path was inside.
    root, outside = workspace
    log: list[Any] = []
    target = str(outside / "secret.txt")
    model = TestModel({"go": [Reply(tool_calls=[("touch", {"path": target})]), Reply(text="ok")]})
    async with open_session(
        provider=model,
        tools=[make_tool("touch", log, kind="write", paths=True)],
        workspace_roots=str(root),
        permission_mode="bypass",
    ) as session:
        seen, _ = await run_request(session, "go")
    assert log == []
    [result] = [e.result for e in seen if isinstance(e, ToolResultEvent)]
    assert result.error is not None and "outside the workspace roots" in result.error.message


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("workspace_roots", [], "at least one workspace root"),
        ("permissions", {"deny": "Bash"}, "deny"),
        ("permissions", {"allow": "Read"}, "allow"),
    ],
)
async def test_permission_options_of_the_wrong_shape_are_config_errors(option: str, value: Any, match: str) -> None:
    # An empty root list turned the path policy off; a lone rule string became one rule per letter.
    with pytest.raises(ConfigError, match=match):
        async with open_session(provider=TestModel(default=Reply(text="ok")), **{option: value}):
            pass  # pragma: no cover - refused before the block


async def test_recovery_reruns_calls_under_the_session_rules_the_journal_holds() -> None:
    # Recovery re-ran the calls of the last life before the journalled rule updates were
    # replayed: a session deny recorded while the call ran did not hold for its re-run.
    from trio_agent import JournalError, PermissionUpdate, RequestAbortedError, SideEffect, ToolKind, define_tool
    from trio_agent.journal import MemoryStore

    ran: list[str] = []
    started = trio.Event()

    def danger(block: bool) -> Any:
        @define_tool(
            name="danger", input_schema={"type": "object"}, side_effect=SideEffect.IDEMPOTENT, kind=ToolKind.EXECUTE
        )
        async def run(input: dict[str, Any], ctx: Any) -> str:
            """Does something one may regret."""
            ran.append("danger")
            if block:
                started.set()
                await trio.sleep_forever()
            return "did it"

        return run

    store = MemoryStore()
    model = TestModel(default=Reply(text="ok"), script={"go": [Reply(tool_calls=[("danger", {})])]})
    options: dict[str, Any] = {"provider": model, "journal": store, "session_id": "s", "permission_mode": "bypass"}
    async with open_session(tools=[danger(True)], **options) as session, trio.open_nursery() as nursery:

        async def send() -> None:
            with pytest.raises((RequestAbortedError, JournalError)):
                await session.send("go")

        nursery.start_soon(send)
        await started.wait()
        await session.permissions.accept_updates([PermissionUpdate.add("danger", behavior="deny")], source="handler")
        session.journal._fence("the process died")  # nothing more is written: as a crash leaves it
        nursery.cancel_scope.cancel()
    assert ran == ["danger"]
    async with open_session(tools=[danger(False)], **options) as session:
        assert [rule.text for rule in session.permissions.session_deny_rules] == ["danger"]
    assert ran == ["danger"], "recovery re-ran the call the session's deny rule refuses"


async def test_session_rules_forgotten_stay_forgotten_after_a_reopen() -> None:
    # forget_session cleared the rules in memory only: the reopen replayed the journalled grant.
    from trio_agent import PermissionUpdate
    from trio_agent.journal import MemoryStore

    log: list[Any] = []
    store = MemoryStore()
    model = TestModel(default=Reply(text="ok"), script={"go": [Reply(tool_calls=[("touch", {})]), Reply(text="done")]})
    options: dict[str, Any] = {"provider": model, "journal": store, "session_id": "s"}
    tools = [make_tool("touch", log, kind="write")]
    async with open_session(tools=tools, **options) as session:
        await session.permissions.accept_updates([PermissionUpdate.add("touch")], source="handler")
        await session.permissions.accept_updates([PermissionUpdate.add("Bash", behavior="deny")], source="handler")
        await session.permissions.forget_session()
        assert session.permissions.session_allow_rules == session.permissions.session_deny_rules == ()
    async with open_session(tools=tools, **options) as session:
        assert session.permissions.session_allow_rules == session.permissions.session_deny_rules == ()
        await session.send("go")
    assert log == []  # default mode, nobody to ask: the forgotten allow no longer lets it run


async def test_a_mode_switch_is_journalled_and_survives_a_crash_and_a_reopen() -> None:
    # session.permissions.mode = "plan" changed the live engine only: a reopen, after a crash or a
    # clean close, was back in the configured mode, so a switch to plan failed open.
    from trio_agent.journal import MemoryStore

    log: list[Any] = []
    store = MemoryStore()

    async def allow_all(request: PermissionRequest) -> PermissionAllow:
        return PermissionAllow()

    def respond(request: ModelRequest) -> Reply:
        return Reply(text="done") if isinstance(request.messages[-1], ToolResultMessage) else calls_all("write")

    model = TestModel(respond=respond)
    options: dict[str, Any] = {
        "provider": model, "journal": store, "session_id": "s", "tools": three_tools(log),
        "permission_mode": "accept_edits", "permission_handler": allow_all,
    }  # fmt: skip
    async with open_session(**options) as session:
        assert session.permissions is not None
        with pytest.raises(ConfigError, match=r"set_mode\('plan'\)"):
            session.permissions.mode = "plan"  # not journalled, so refused rather than lost on reopen
        await session.permissions.set_mode("plan")
        session.journal._fence("the process died")  # nothing more is written: as a crash leaves it
    async with open_session(**options) as session:
        assert session.permissions is not None and session.permissions.mode.value == "plan"
        await session.send("go")
    assert log == []  # plan's hard limit holds after the reopen, whatever the handler says
    async with open_session(**options) as session:  # after a clean close too
        assert session.permissions is not None and session.permissions.mode.value == "plan"
        await session.permissions.set_mode("accept_edits")
    async with open_session(**options) as session:
        assert session.permissions is not None and session.permissions.mode.value == "accept_edits"
        await session.send("go")
    assert ran_names(log) == {"write"}


# ======================================================================== subagents' calls

HELPER = SubagentDefinition("helper", "a helper", "You help.")


async def test_rules_handler_hooks_and_path_policy_apply_to_subagent_calls(workspace: tuple[Path, Path]) -> None:
    root, outside = workspace
    log: list[Any] = []
    asked: list[tuple[str, str]] = []
    pre_tool: list[tuple[str, str | None]] = []

    async def handler(request: PermissionRequest) -> PermissionAllow:
        asked.append((request.agent_id, request.tool_name))
        return PermissionAllow(updated_input={**request.input, "x": "approved"})

    async def audit(inp: HookInput) -> HookOutput:
        pre_tool.append((inp.agent_id, inp.tool_name))
        return HookOutput.modify({"dry_run": True}) if inp.tool_name == "touch" else HookOutput()

    child_calls = [
        ("run", {"x": "r"}),  # denied by rule
        ("write", {"x": "w"}),  # asks the handler
        ("touch", {"path": str(outside / "secret.txt")}),  # outside the workspace
        ("touch", {"path": "sub/ok.txt"}),  # fine
    ]
    model = TestModel(
        {
            "go": [Reply(tool_calls=[("task", {"subagent": "helper", "prompt": "sub"})]), Reply(text="parent ok")],
            "sub": [Reply(tool_calls=child_calls), Reply(text="child ok")],
        }
    )
    async with open_session(
        provider=model,
        tools=[*three_tools(log), make_tool("touch", log, kind="write", paths=True)],
        subagents=[HELPER],
        permissions={"deny": ["run"], "allow": ["touch"]},
        permission_handler=handler,
        hooks={HookEvent.PRE_TOOL_USE: [audit]},
        workspace_roots=[root],
    ) as session:
        assert await session.send("go") == "parent ok"
        [child] = [a for a in session.journal.agents if a != session.root_agent_id]
        child_events = await stream_events(session, child)
        root_events = await stream_events(session)
    assert asked == [(child, "write")]
    assert sorted(log) == sorted(
        [("write", child, {"x": "approved"}), ("touch", child, {"path": "sub/ok.txt", "dry_run": True})]
    )
    assert ("root", "task") in pre_tool and {(child, name) for name, _ in child_calls} <= set(pre_tool)
    child_request = next(r for r in model.requests if r.metadata["agent_id"] == child and result_messages(r))
    errors = [m.is_error for m in result_messages(child_request)]
    assert errors == [True, False, True, False]
    # The ask is durable on the calling agent's stream, not the root's.
    assert [type(e) for e in child_events if isinstance(e, (PermissionRequested, PermissionResolved))] == [
        PermissionRequested,
        PermissionResolved,
    ]
    assert not any(isinstance(e, PermissionRequested) for e in root_events)


async def test_a_subagent_cannot_call_tools_outside_its_allowlist() -> None:
    log: list[Any] = []
    model = TestModel(
        {
            "go": [Reply(tool_calls=[("task", {"subagent": "reader", "prompt": "sub"})]), Reply(text="ok")],
            "sub": [calls_all("read", "write", "task"), Reply(text="child ok")],
        }
    )
    reader = SubagentDefinition("reader", "reads", "You read.", tools=["read"])
    async with open_session(
        provider=model, tools=three_tools(log), subagents=[reader], permission_mode="bypass"
    ) as session:
        await session.send("go")
    assert ran_names(log) == {"read"}
    child_request = next(r for r in model.requests if r.metadata["agent_id"] != "root" and result_messages(r))
    assert [m.is_error for m in result_messages(child_request)] == [False, True, True]


# ======================================================================== hanging handlers


@pytest.mark.parametrize("ask_timeout", [None, 45.0, 7200.0], ids=["default", "shorter", "longer"])
async def test_a_hanging_handler_is_bounded_by_the_ask_deadline(
    ask_timeout: float | None, autojump_clock: trio.testing.MockClock
) -> None:
    # permission_ask_timeout= is the session's bound (the engine's ask_timeout, which sessions did not expose).
    log: list[Any] = []
    cancelled = trio.Event()
    bound = 600.0 if ask_timeout is None else ask_timeout

    async def hang(request: PermissionRequest) -> None:
        assert request.deadline - trio.current_time() == pytest.approx(bound)
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    model = TestModel({"go": [calls_all("write"), Reply(text="gave up on it")]})
    options: dict[str, Any] = {} if ask_timeout is None else {"permission_ask_timeout": ask_timeout}
    async with open_session(
        provider=model, tools=three_tools(log), permission_handler=hang, tool_timeout=9000.0, **options
    ) as session:
        start = trio.current_time()
        _, done = await run_request(session, "go")
        elapsed = trio.current_time() - start
        events = await stream_events(session)
    assert cancelled.is_set()
    assert elapsed == pytest.approx(bound)
    assert done.text == "gave up on it" and log == []
    [message] = result_messages(model.requests[1])
    assert message.is_error and "no answer" in message.content and f"{bound:g} s" in message.content
    [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
    assert resolved.decision is PermissionDecision.DENY


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "10", True])
async def test_a_bad_permission_ask_timeout_is_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match="permission_ask_timeout"):
        define_agent(provider=TestModel(), permission_ask_timeout=bad)
    with pytest.raises(ConfigError, match="permission_ask_timeout"):
        async with open_session(provider=TestModel(), permission_ask_timeout=bad):
            raise AssertionError("unreachable")  # pragma: no cover


async def test_a_hanging_handler_is_bounded_by_the_request_abort() -> None:
    log: list[Any] = []
    asked = trio.Event()
    left = trio.Event()

    async def hang(request: PermissionRequest) -> None:
        asked.set()
        try:
            await trio.sleep_forever()
        finally:
            left.set()

    model = TestModel({"go": [calls_all("write"), Reply(text="after the abort")]})
    async with open_session(provider=model, tools=three_tools(log), permission_handler=hang) as session:
        failure: list[BaseException] = []

        async def send() -> None:
            try:
                await session.send("go")
            except RequestAbortedError as exc:
                failure.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await asked.wait()
            await session.abort()
        assert left.is_set()
        assert len(failure) == 1
        events = await stream_events(session)
        [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
        assert resolved.decision is PermissionDecision.CANCEL
        [cancelled] = [e for e in events if isinstance(e, ToolCancelled)]
        assert cancelled.call_id == resolved.call_id
        assert any(isinstance(e, RequestInterrupted) for e in events)
        assert log == [] and len(model.requests) == 1
        # The session is usable afterwards.
        assert await session.send("next") == "after the abort"


async def test_a_hanging_handler_is_bounded_by_leaving_the_stream_early() -> None:
    log: list[Any] = []
    asked = trio.Event()
    left = trio.Event()

    async def hang(request: PermissionRequest) -> None:
        asked.set()
        try:
            await trio.sleep_forever()
        finally:
            left.set()

    model = TestModel({"go": [calls_all("write"), Reply(text="x")]})
    async with open_session(provider=model, tools=three_tools(log), permission_handler=hang) as session:
        async with session.stream("go") as events:
            async for event in events:
                if isinstance(event, ToolUseEvent):
                    await asked.wait()
                    break
        assert left.is_set()
        journal = await stream_events(session)
    assert [e.decision for e in journal if isinstance(e, PermissionResolved)] == [PermissionDecision.CANCEL]
    assert log == []
