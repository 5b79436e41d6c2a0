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


def deep_list(depth: int = 100_000) -> list[Any]:
    """A list nested *depth* levels deep: its repr passes the recursion limit."""
    outer: list[Any] = []
    inner = outer
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


class BadRepr:
    def __repr__(self) -> str:
        raise ValueError("repr failed")


class BadReprId(str):
    """A call id of a str subclass whose repr raises (a string, so a valid id)."""

    def __repr__(self) -> str:
        raise ValueError("repr failed")


# Each: a history with a wrong value whose repr raises, the index of its message, words of the error.
# The message formatted the value with repr() before cutting it short: the HistoryError naming the
# message became a RecursionError, a ValueError (an int past the digit limit) or the repr's own error.
UNPRINTABLE = {
    "deep-message": ([deep_list()], 0, r"history\[0\] is not a message: <list object, unprintable"),
    "deep-content": ([UserMessage(deep_list())], 0, r"UserMessage\.content must be a string, not list <list"),  # type: ignore[arg-type]
    "deep-arguments": ([Q, call(arguments=deep_list())], 1, r"parts\[0\]\.arguments must be a string, not list"),
    "raising-repr": ([UserMessage(BadRepr())], 0, r"not BadRepr <BadRepr object, unprintable"),  # type: ignore[arg-type]
    "huge-int": ([UserMessage(10**5000)], 0, r"UserMessage\.content must be a string, not int <int object"),  # type: ignore[arg-type]
    "huge-is-error": ([Q, call(), ToolResultMessage("c1", "ok", is_error=10**5000)], 2, r"is_error must be True"),  # type: ignore[arg-type]
    "deep-part": ([Q, AssistantMessage((deep_list(),))], 1, r"parts\[0\] of the assistant message is not a content"),  # type: ignore[arg-type]
    "id-used-twice": ([Q, call(BadReprId("c")), ToolResultMessage("c", "ok"), call(BadReprId("c"))], 3, "used twice"),
    "id-unanswered": ([Q, call(BadReprId("c")), Q], 2, r"tool call\(s\) <BadReprId object, unprintable"),
    "id-unanswered-at-end": ([Q, call(BadReprId("c"))], 1, r"tool call\(s\) <BadReprId object.* are not answered"),
    "result-of-no-call": ([Q, call(), ToolResultMessage(BadReprId("x"), "ok")], 2, "answers tool call <BadReprId"),
}


@pytest.mark.parametrize(("history", "index", "words"), UNPRINTABLE.values(), ids=UNPRINTABLE.keys())
def test_a_wrong_value_whose_repr_raises_is_still_a_history_error_naming_its_message(
    history: list[Any], index: int, words: str
) -> None:
    with pytest.raises(HistoryError, match=words) as caught:
        validate_history(history)
    assert caught.value.index == index
    assert len(str(caught.value)) < 400  # the value is shown cut short


# Each: a call id or tool name holding a surrogate code point (a JSON "\ud800" escape decodes to one).
# A request body sends every surrogate as U+FFFD (a pair as its character), so distinct ids became one
# on the wire and their results could not be told apart.
NOT_UNICODE = {
    "lone-high-id": ([Q, call("c\ud800")], r"parts\[0\]\.id 'c\\ud800' is not well-formed Unicode"),
    "lone-low-id": ([Q, call("c\udc00")], r"parts\[0\]\.id 'c\\udc00' is not well-formed Unicode"),
    "pair-halves-id": ([Q, call("c\ud83d\ude00")], r"parts\[0\]\.id .* is not well-formed Unicode"),
    "name": ([Q, call(name="look\udc00up")], r"parts\[0\]\.name 'look\\udc00up' is not well-formed Unicode"),
    "result-id": (
        [Q, call(), ToolResultMessage("c1\ud800", "ok")],
        r"ToolResultMessage\.tool_call_id .* not well-formed",
    ),
}


@pytest.mark.parametrize(("history", "words"), NOT_UNICODE.values(), ids=NOT_UNICODE.keys())
def test_a_call_id_or_tool_name_that_is_not_well_formed_unicode_is_refused(history: list[Any], words: str) -> None:
    with pytest.raises(HistoryError, match=words) as caught:
        validate_history(history)
    assert caught.value.index == len(history) - 1


def test_two_call_ids_that_differ_only_in_lone_surrogates_are_refused_not_taken_as_distinct() -> None:
    history = [
        Q,
        AssistantMessage((ToolCallPart("c\ud800", "delete", '{"what": "A"}'), ToolCallPart("c\udc00", "delete", "{}"))),
        ToolResultMessage("c\ud800", "A deleted"),
        ToolResultMessage("c\udc00", "B FAILED", is_error=True),
    ]
    with pytest.raises(HistoryError, match=r"history\[1\]: parts\[0\]\.id 'c\\ud800' is not well-formed Unicode"):
        validate_history(history)


def test_ids_and_names_of_any_well_formed_unicode_are_accepted() -> None:
    history: list[Message] = [Q, call("c😀~2", "géo_λ"), ToolResultMessage("c😀~2", "ok")]
    assert validate_history(history) == tuple(history)
