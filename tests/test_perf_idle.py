"""What an idle session keeps, and that what it no longer keeps a copy of still works (issue 17).

Thousands of sessions may sit idle at once. A session on a store whose leases never expire (the
memory store) has no heartbeat, so its journal's block enters no cancel scope of its own: the
session's nursery is what a lost lease cancels. Its permission engine keeps no session layer and
no policy of its own until a rule or an approval changes it, and its agents share the spec's
tool specs and turn limit.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import LeaseLostError, define_agent, define_tool, open_session
from trio_agent._journal._durable import open_journal
from trio_agent._journal._memory import MemoryStore
from trio_agent._permissions._engine import PermissionEngine
from trio_agent._permissions._rules import PermissionUpdate
from trio_agent._tools._definition import SideEffect
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@pytest.mark.parametrize("expiring", [False, True], ids=["no-heartbeat", "heartbeat"])
async def test_a_lost_lease_cancels_a_running_request_and_ends_the_session(expiring: bool) -> None:
    # The same outcome whether the journal's block has a scope of its own (a heartbeat) or not.
    store = MemoryStore(clock=trio.current_time) if expiring else MemoryStore()
    started = trio.Event()
    cancelled: list[str] = []

    @define_tool(name="wait", description="w", input_schema=OBJECT, side_effect=SideEffect.IDEMPOTENT, kind="readonly")
    async def wait(input: dict[str, Any], ctx: Any) -> str:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.append("wait")
        raise AssertionError("unreachable")  # pragma: no cover

    model = TestModel({"go": [Reply(tool_calls=[("wait", {})])]})
    with pytest.raises(LeaseLostError) as caught:
        async with open_session(provider=model, tools=[wait], journal=store) as session:
            stream_id = session.journal.stream_id()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.send, "go")
                await started.wait()
                head = await store.head(stream_id)
                session.journal.held.lose(LeaseLostError("handed off"))  # what a worker's hand-off does
                await trio.sleep_forever()
    assert type(caught.value) is LeaseLostError
    assert cancelled == ["wait"]
    assert await store.head(stream_id) == head  # nothing written with the lost lease


@pytest.mark.parametrize("expiring", [False, True], ids=["no-heartbeat", "heartbeat"])
async def test_a_lost_lease_cancels_an_idle_sessions_body(expiring: bool) -> None:
    store = MemoryStore(clock=trio.current_time) if expiring else MemoryStore()
    reached: list[str] = []
    with pytest.raises(LeaseLostError):
        async with open_session(provider=TestModel(default=Reply(text="ok")), journal=store) as session:
            assert await session.send("hi") == "ok"
            session.journal.held.lose(LeaseLostError("handed off"))
            try:
                await trio.sleep_forever()
            finally:
                reached.append("cancelled")
    assert reached == ["cancelled"]


async def test_an_idle_memory_session_has_no_journal_scope_of_its_own() -> None:
    async with open_session(provider=TestModel(default=Reply(text="ok"))) as session:
        await session.send("hi")
        nursery = session._nursery
        assert nursery is not None
        assert session.journal.held.body is nursery.cancel_scope


async def test_open_journal_alone_still_cancels_its_body_on_a_lost_lease() -> None:
    reached: list[str] = []
    with pytest.raises(LeaseLostError):
        async with open_journal(MemoryStore()) as journal:
            assert journal.held.body is not None
            journal.held.lose(LeaseLostError("handed off"))
            try:
                await trio.sleep_forever()
            finally:
                reached.append("cancelled")
    assert reached == ["cancelled"]


async def test_sessions_of_one_spec_share_tool_specs_and_the_empty_permission_layer() -> None:
    @define_tool(name="look", description="l", input_schema=OBJECT, side_effect=SideEffect.PURE, kind="readonly")
    async def look(input: dict[str, Any], ctx: Any) -> str:
        return "seen"

    spec = define_agent(
        provider=TestModel(respond=lambda request: Reply(text="ok")), tools=[look], permissions={"allow": ["look"]}
    )
    async with open_session(spec) as first, open_session(spec) as second:
        await first.send("a")
        await second.send("b")
        parts = [session._host.root.run_parts for session in (first, second)]
        assert parts[0] is not None and parts[1] is not None
        assert parts[0][1] == parts[1][1] and parts[0][1][0] is parts[1][1][0]  # one ToolSpec for both
        assert parts[0][0] is not parts[1][0]  # the instructions read each session's own context
        assert parts[0][3]["session_id"] == first.session_id and parts[1][3]["session_id"] == second.session_id
        engines = [session.permissions for session in (first, second)]
        assert engines[0] is not None and engines[1] is not None
        assert engines[0]._policy() is engines[1]._policy()
        assert first._host.root.strategy() is second._host.root.strategy()


async def test_a_session_layer_made_on_first_use_is_the_engines_own() -> None:
    template = PermissionEngine(mode="default")
    one = template.derive(record=None, tool_filter=None)
    two = template.derive(record=None, tool_filter=None)
    assert one._policy() is two._policy()
    one.remember("Bash:ls")
    await one.accept_updates([PermissionUpdate("add", ["Read"])], source="tool")
    assert one.approved_signatures == frozenset({"Bash:ls"})
    assert [rule.text for rule in one.session_allow_rules] == ["Read"]
    policy = one._policy()
    assert "Bash:ls" in policy.approved and [rule.text for rule in policy.session_allow] == ["Read"]
    # The other engine, and the template, saw none of it.
    assert two.approved_signatures == frozenset() and two.session_allow_rules == ()
    assert two._policy().approved == frozenset() and template.session_allow_rules == ()
    await one.forget_session()
    assert one.approved_signatures == frozenset() and one.session_allow_rules == ()
    assert one._policy().approved == frozenset() and list(one._policy().session_allow) == []
