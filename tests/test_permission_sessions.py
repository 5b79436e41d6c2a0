"""Permission faults seen through a real session: what a misbehaving answer, hook or tool does to
the call, the request and the journal (the engine side is pinned in tests/test_permissions.py;
the session's rules, modes and handler in tests/test_session_permissions.py, whose helpers these use).
"""

from __future__ import annotations

from typing import Any

from tests.session_helpers import stream_events
from tests.test_session_permissions import calls_all, result_messages, three_tools
from trio_agent import PermissionAllow, PermissionRequest, open_session
from trio_agent._journal._events import PermissionDecision, PermissionResolved
from trio_agent.testing import Reply, TestModel


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
    assert message.is_error and "updated_input must be JSON" in str(message.content)
    [resolved] = [e for e in events if isinstance(e, PermissionResolved)]
    assert resolved.decision is PermissionDecision.DENY
