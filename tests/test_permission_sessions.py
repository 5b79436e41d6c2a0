"""Permission faults seen through a real session: what a misbehaving answer, hook or tool does to
the call, the request and the journal (the engine side is pinned in tests/test_permissions.py;
the session's rules, modes and handler in tests/test_session_permissions.py, whose helpers these use).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.session_helpers import stream_events
from tests.test_session_permissions import calls_all, result_messages, three_tools
from trio_agent import (
    HookEvent,
    HookInput,
    HookOutput,
    PermissionAllow,
    PermissionMode,
    PermissionRequest,
    Tool,
    ToolContext,
    ToolKind,
    ToolResult,
    define_tool,
    open_session,
)
from trio_agent._journal._events import PermissionDecision, PermissionResolved
from trio_agent.journal import MemoryStore
from trio_agent.models import UserMessage
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import BehaviorOverride, Effect


async def test_a_handler_answer_with_input_that_is_not_json_denies_the_call_not_the_request() -> None:
    # PermissionAllow(updated_input={"x": {1}}) was allowed, journalled as allow, and then the run's
    # JSON check failed the whole request (RequestAbortedError).
    log: list[Any] = []

    async def bad(request: PermissionRequest) -> PermissionAllow:
        return PermissionAllow(updated_input={**request.input, "x": {1}})

    model = TestModel({"go": [calls_all("write"), Reply(text="ok")]})
    async with open_session(provider=model, tools=three_tools(log), permission_handler=bad) as session:
        assert await session.send("go") == "ok"
        events = await stream_events(session)
    assert log == []
    [message] = result_messages(model.requests[1])
    assert message.is_error and "updated_input is not JSON" in str(message.content)
    [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
    assert resolved.decision is PermissionDecision.DENY


@pytest.mark.parametrize("kind", ["permission_updates", "new_messages"])
@pytest.mark.parametrize("payload", [5, True, {"allow": ["Bash"]}, b"Bash"], ids=["int", "bool", "mapping", "bytes"])
async def test_an_effect_payload_that_is_not_a_list_is_logged_and_ignored(
    kind: str, payload: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # list(payload or []) raised a bare TypeError outside the effect's `except ConfigError`:
    # one tool's malformed effect failed the whole request (RequestAbortedError).
    async def emit(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await ctx.emit(Effect(kind, payload))
        return ToolResult.success("emitted")

    tool = define_tool(
        emit, name="emit", description="e", kind="readonly", side_effect="pure", input_schema={"type": "object"}
    )
    model = TestModel({"go": [Reply(tool_calls=[("emit", {})]), Reply(text="done")]})
    async with open_session(provider=model, tools=[tool]) as session:
        assert await session.send("go") == "done"
        assert session.permissions is not None and session.permissions.session_allow_rules == ()
    assert f"ignored a {kind} effect" in caplog.text and "payload must be one item or a list" in caplog.text
    assert not any(isinstance(m, UserMessage) for m in model.requests[1].messages[2:])


async def test_a_session_whose_only_answerers_are_permission_request_hooks_still_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # never_allowed now counts an engine's hooks as able to allow; a session's PermissionRequest
    # hooks cannot allow (they wrap the handler), so without a handler the tool still never runs.
    async def look(input: HookInput) -> None:
        return None

    log: list[Any] = []
    model = TestModel(default=Reply(text="ok"))
    hooks: Any = {HookEvent.PERMISSION_REQUEST: [look]}
    with caplog.at_level(logging.WARNING, logger="trio_agent.permissions"):
        async with open_session(provider=model, tools=three_tools(log), hooks=hooks):
            pass
    warned = sorted(r.getMessage().split("'")[1] for r in caplog.records if r.name == "trio_agent.permissions")
    assert warned == ["run", "write"]


def bash_tool(ran: list[str]) -> Tool[Any]:
    async def run(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        ran.append(input["command"])
        return ToolResult.success("ran")

    def readonly_ls(input: dict[str, Any]) -> BehaviorOverride | None:
        return BehaviorOverride(kind=ToolKind.READONLY) if input["command"].startswith("ls") else None

    return define_tool(
        run, name="Bash", description="b", kind="execute", side_effect="non_idempotent",
        input_schema={"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        resolve_behavior=readonly_ls,
    )  # fmt: skip


async def test_a_permission_request_hooks_modified_input_is_shown_to_the_handler_as_what_runs() -> None:
    # The hook's modified_input reached the handler with the old signature, kind and paths: the
    # person approved "Bash:ls" (always) and "rm -rf build" ran and was remembered.
    async def rewrite(input: HookInput) -> HookOutput:
        return HookOutput.modify({"command": "rm -rf build"})

    shown: list[tuple[str, str, ToolKind]] = []

    async def always(request: PermissionRequest) -> PermissionAllow:
        shown.append((request.signature, request.input["command"], request.tool_kind))
        return PermissionAllow(remember=True)

    ran: list[str] = []
    model = TestModel({"go": [Reply(tool_calls=[("Bash", {"command": "ls"})]), Reply(text="done")]})
    hooks: Any = {HookEvent.PERMISSION_REQUEST: [rewrite]}
    # "ls" is read-only here (the resolver), so an ask rule makes the call ask.
    options: dict[str, Any] = {"permission_handler": always, "hooks": hooks, "permissions": {"ask": ["Bash"]}}
    async with open_session(provider=model, tools=[bash_tool(ran)], **options) as session:
        assert await session.send("go") == "done"
        assert session.permissions is not None
        assert session.permissions.approved_signatures == {"Bash:rm -rf build"}
    assert shown == [("Bash:rm -rf build", "rm -rf build", ToolKind.EXECUTE)]
    assert ran == ["rm -rf build"]


async def test_a_permission_request_hooks_modified_input_that_the_stages_refuse_is_denied() -> None:
    async def rewrite(input: HookInput) -> HookOutput:
        return HookOutput.modify({"command": "rm -rf build"})

    async def always(request: PermissionRequest) -> PermissionAllow:
        raise AssertionError("the handler is not asked about input a deny rule refuses")

    ran: list[str] = []
    model = TestModel({"go": [Reply(tool_calls=[("Bash", {"command": "make"})]), Reply(text="done")]})
    hooks: Any = {HookEvent.PERMISSION_REQUEST: [rewrite]}
    options: dict[str, Any] = {"permission_handler": always, "hooks": hooks, "permissions": {"deny": ["Bash:rm *"]}}
    async with open_session(provider=model, tools=[bash_tool(ran)], **options) as session:
        assert await session.send("go") == "done"
        events = await stream_events(session)
    assert ran == []
    [message] = result_messages(model.requests[1])
    assert message.is_error and "the changed input was refused" in str(message.content)
    assert "denied by rule 'Bash:rm *'" in str(message.content)
    [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
    assert resolved.decision is PermissionDecision.DENY


@pytest.mark.parametrize("ending", ["close", "crash"])
async def test_a_reopened_session_keeps_the_mode_it_started_in(ending: str) -> None:
    # The starting mode was never journalled (only set_mode was): a session opened in plan and
    # reopened with permission_mode="bypass" ran in bypass, though the docs say it keeps its mode.
    store = MemoryStore()
    options: dict[str, Any] = {"provider": TestModel(default=Reply(text="ok")), "journal": store, "session_id": "s"}
    async with open_session(permission_mode="plan", **options) as session:
        updates = session.journal.projection().permission_updates
        assert [event.update for event in updates] == [{"action": "set_mode", "mode": "plan"}]
        if ending == "crash":
            session.journal._fence("the process died")  # nothing more is written: as a crash leaves it
    async with open_session(permission_mode="bypass", **options) as session:
        assert session.permissions is not None and session.permissions.mode is PermissionMode.PLAN


async def test_a_session_started_in_default_writes_no_mode_and_reopens_in_default() -> None:
    store = MemoryStore()
    options: dict[str, Any] = {"provider": TestModel(default=Reply(text="ok")), "journal": store, "session_id": "s"}
    async with open_session(**options) as session:
        assert session.journal.projection().permission_updates == ()  # nothing more on the hot path
        await session.send("hi")
    async with open_session(permission_mode="bypass", **options) as session:
        assert session.permissions is not None and session.permissions.mode is PermissionMode.DEFAULT
        await session.permissions.set_mode("accept_edits")
    async with open_session(permission_mode="plan", **options) as session:
        assert session.permissions is not None and session.permissions.mode is PermissionMode.ACCEPT_EDITS


async def test_a_new_session_seeded_with_history_journals_its_starting_mode() -> None:
    store = MemoryStore()
    options: dict[str, Any] = {"provider": TestModel(default=Reply(text="ok")), "journal": store, "session_id": "s"}
    async with open_session(permission_mode="accept_edits", history=[UserMessage("earlier")], **options):
        pass
    async with open_session(**options) as session:
        assert session.permissions is not None and session.permissions.mode is PermissionMode.ACCEPT_EDITS
