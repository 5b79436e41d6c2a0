"""A history from outside (`validate_history`): every message's fields, not only its class; `MessageView` + ..."""

from __future__ import annotations

from typing import Any

import pytest

from trio_agent import open_session
from trio_agent._models._history import MessageView, validate_history
from trio_agent.models import (
    AssistantMessage,
    HistoryError,
    Message,
    ModelRequest,
    ReasoningPart,
    SystemMessage,
    TextPart,
    ToolCallPart,
    ToolResultMessage,
    UserMessage,
)
from trio_agent.testing import Reply, TestModel

Q = UserMessage("q")


def call(call_id: Any = "c1", name: Any = "lookup", arguments: Any = "{}") -> AssistantMessage:
    return AssistantMessage((ToolCallPart(call_id, name, arguments),))


# Each: a history with one wrong field, the index of its message, words of the error.
WRONG_FIELDS = [
    ([UserMessage(None)], 0, r"UserMessage\.content must be a string, not NoneType"),  # type: ignore[arg-type]
    ([UserMessage(5)], 0, r"UserMessage\.content must be a string, not int"),  # type: ignore[arg-type]
    ([Q, AssistantMessage("hello")], 1, r"parts\[0\] of the assistant message is not a content part.*str 'h'"),  # type: ignore[arg-type]
    ([Q, AssistantMessage(({"type": "text", "text": "hi"},))], 1, r"parts\[0\].*not a content part.*dict"),  # type: ignore[arg-type]
    ([Q, AssistantMessage((TextPart(None),))], 1, r"parts\[0\]\.text must be a string"),  # type: ignore[arg-type]
    ([Q, AssistantMessage((ReasoningPart("r", signature=5),))], 1, r"parts\[0\]\.signature must be a string or None"),  # type: ignore[arg-type]
    ([Q, call(call_id=["a"])], 1, r"parts\[0\]\.id must be a string, not list"),
    ([Q, call(call_id=7)], 1, r"parts\[0\]\.id must be a string, not int"),
    ([Q, call(call_id="")], 1, r"parts\[0\]\.id must not be empty"),
    ([Q, call(name=None)], 1, r"parts\[0\]\.name must be a string"),
    ([Q, call(arguments={"a": 1})], 1, r"parts\[0\]\.arguments must be a string, not dict"),
    ([Q, call(), ToolResultMessage(["c1"], "ok")], 2, r"ToolResultMessage\.tool_call_id must be a string, not list"),  # type: ignore[arg-type]
    ([Q, call(), ToolResultMessage("c1", None)], 2, r"ToolResultMessage\.content must be a string"),  # type: ignore[arg-type]
    ([Q, call(), ToolResultMessage("c1", "ok", is_error="no")], 2, r"is_error must be True or False"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("history", "index", "words"), WRONG_FIELDS)
def test_a_history_with_a_wrong_field_is_a_history_error_naming_it(history: list[Any], index: int, words: str) -> None:
    with pytest.raises(HistoryError, match=words) as caught:
        validate_history(history)
    assert caught.value.index == index
    assert str(caught.value).startswith(f"history[{index}]: ")


async def test_open_session_refuses_a_history_with_a_wrong_field() -> None:
    with pytest.raises(HistoryError, match=r"history\[1\]: parts\[0\] of the assistant message"):
        async with open_session(provider=TestModel(), history=[Q, AssistantMessage("hello")]):  # type: ignore[arg-type]
            pytest.fail("an invalid history must be refused before the session opens")


def test_a_history_of_every_kind_of_right_field_is_accepted() -> None:
    history: list[Message] = [
        Q,
        AssistantMessage(
            (ReasoningPart("thinking", signature="sig"), ReasoningPart("", redacted_data="x"), TextPart("calling"))
        ),
        UserMessage(""),
        AssistantMessage((TextPart(""), ToolCallPart("c1", "lookup", ""))),
        ToolResultMessage("c1", "", is_error=True),
    ]
    assert validate_history(history) == tuple(history)


def test_a_message_view_concatenates_on_either_side() -> None:
    log: list[Message] = [Q]
    view = MessageView(log, (SystemMessage("sys"),))
    extra = (SystemMessage("first"),)
    assert extra + view == (SystemMessage("first"), SystemMessage("sys"), Q)  # type: ignore[operator]
    assert [UserMessage("x")] + view == (UserMessage("x"), SystemMessage("sys"), Q)  # type: ignore[operator]  # noqa: RUF005
    assert view + [UserMessage("x")] == (SystemMessage("sys"), Q, UserMessage("x"))  # noqa: RUF005
    with pytest.raises(TypeError):
        _ = "text" + view  # type: ignore[operator]


class PrependSystem:
    """Model middleware that puts a system message in front, as a tuple concatenation."""

    async def wrap_stream(self, request: ModelRequest, call_next: Any) -> Any:
        messages = (SystemMessage("rules"),) + request.messages  # noqa: RUF005 - the concatenation under test
        async for chunk in call_next(request.replace(messages=messages)):
            yield chunk


async def test_a_session_request_s_messages_concatenate_after_a_tuple() -> None:
    from trio_agent import MiddlewareConfig

    model = TestModel(default=Reply("ok"))
    async with open_session(
        provider=model, system_prompt="be nice", middleware=MiddlewareConfig(model=[PrependSystem()])
    ) as session:
        await session.send("hi")
    assert model.requests[0].messages[:2] == (SystemMessage("rules"), SystemMessage("be nice"))
