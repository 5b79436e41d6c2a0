"""Conversations that continue: reopening a cleanly closed session, seeding a new one (issue 12)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.session_helpers import stream_events
from tests.store_helpers import LaterStore
from tests.test_session import gated_tool
from trio_agent import (
    ConfigError,
    RequestAbortedError,
    SessionClosedError,
    SideEffect,
    SubagentDefinition,
    ToolKind,
    define_tool,
    open_session,
)
from trio_agent._journal._inspect import render_timeline
from trio_agent.journal import (
    ConversationSeeded,
    SessionClosed,
    SessionReopened,
    open_sqlite_store,
    read_conversation,
)
from trio_agent.models import (
    AssistantMessage,
    HistoryError,
    Message,
    SystemMessage,
    TextPart,
    ToolCallPart,
    ToolResultMessage,
    UserMessage,
)
from trio_agent.testing import Reply, TestModel

OBJECT: dict[str, Any] = {"type": "object"}


def lookup_tool() -> Any:
    @define_tool(
        name="lookup", description="looks up", input_schema=OBJECT, side_effect=SideEffect.PURE, kind=ToolKind.READONLY
    )
    async def lookup(input: dict[str, Any], ctx: Any) -> str:
        return f"found {input.get('q')}"

    return lookup


def chatty_model() -> TestModel:
    """Answers every user message with a tool call, then a text naming how many messages it saw."""

    def respond(request: Any) -> Reply:
        last = request.messages[-1]
        if isinstance(last, UserMessage):
            return Reply(tool_calls=[("lookup", {"q": last.content})])
        return Reply(text=f"answer after {len(request.messages)} messages")

    return TestModel(respond=respond)


async def conversation_after(path: Path, session_id: str, *, crash: bool) -> tuple[list[Message], list[Message]]:
    """The conversation before the close (or crash), and the one the reopened session has."""
    model = chatty_model()
    async with open_session(provider=model, tools=[lookup_tool()], journal=path, session_id=session_id) as session:
        await session.send("first")
        await session.send("second")
        before = list(session.messages())
        if crash:
            session.journal._fence("test: simulate a crash")  # the close writes nothing: a crash
    async with open_session(provider=model, tools=[lookup_tool()], journal=path, session_id=session_id) as session:
        assert session.life == (1 if crash else 2)
        return before, list(session.messages())


def without_ids(messages: list[Message]) -> list[Any]:
    """The messages with call ids numbered by first appearance (the test model's ids differ per run)."""
    names: dict[str, str] = {}

    def rename(call_id: str) -> str:
        return names.setdefault(call_id, f"id{len(names)}")

    out: list[Any] = []
    for m in messages:
        if isinstance(m, AssistantMessage):
            out.append(tuple((p.name, rename(p.id)) if isinstance(p, ToolCallPart) else p for p in m.parts))
        elif isinstance(m, ToolResultMessage):
            out.append((rename(m.tool_call_id), m.content, m.is_error))
        else:
            out.append(m)
    return out


async def test_a_clean_close_then_reopen_gives_the_conversation_a_crash_would(tmp_path: Path) -> None:
    clean_before, clean = await conversation_after(tmp_path / "clean.db", "s", crash=False)
    crash_before, crashed = await conversation_after(tmp_path / "crash.db", "s", crash=True)
    assert clean == clean_before  # same messages, same call ids
    assert crashed == crash_before
    assert without_ids(clean) == without_ids(crashed)
    assert [m.content for m in clean if isinstance(m, UserMessage)] == ["first", "second"]
    assert len([m for m in clean if isinstance(m, ToolResultMessage)]) == 2


async def test_a_reopened_session_goes_on_with_its_conversation(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    model = chatty_model()
    async with open_session(provider=model, tools=[lookup_tool()], journal=path, session_id="b") as session:
        await session.send("hello")
    async with open_session(provider=model, tools=[lookup_tool()], journal=path, session_id="b") as session:
        await session.send("again")
    seen = [m.content for m in model.requests[-1].messages if isinstance(m, UserMessage)]
    assert seen == ["hello", "again"]
    async with open_sqlite_store(path, readonly=True) as store:
        events = [e.event for e in await store.read("b/root")]
        timeline = await render_timeline(store, session_id="b")
    assert [type(e) for e in events if isinstance(e, SessionClosed | SessionReopened)] == [
        SessionClosed,
        SessionReopened,
        SessionClosed,
    ]
    assert "2 lives" in timeline and "life 2: session reopened" in timeline


async def test_a_reopen_decodes_no_history_until_the_first_request_needs_it(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    model = chatty_model()
    async with open_session(provider=model, tools=[lookup_tool()], journal=path, session_id="b") as session:
        for prompt in ("one", "two", "three"):  # enough events for a snapshot on the way out
            await session.send(prompt)
        before = list(session.messages())
    async with open_session(provider=model, tools=[lookup_tool()], journal=path, session_id="b") as session:
        stream = session.journal._streams["b/root"]
        assert stream.snapshot_seq > 0
        assert session._host.root._history is None and stream.fold._stored is not None
        await session.send("again")
        assert list(model.requests[-2].messages[: len(before)]) == before  # once, as it was
        assert list(session.messages())[: len(before) + 1] == [*before, UserMessage("again")]


async def test_reopen_after_a_close_that_interrupted_a_request_answers_it_once(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    slow, started, _release = gated_tool("slow")
    model = TestModel({"go": [Reply(tool_calls=[("slow", {})]), Reply(text="later")]})
    async with open_session(provider=model, tools=[slow], journal=path, session_id="i") as session:

        async def send() -> None:
            with pytest.raises(RequestAbortedError):
                await session.send("go")

        session._nursery.start_soon(send)  # type: ignore[union-attr]
        await started.wait()
    async with open_session(provider=model, tools=[slow], journal=path, session_id="i") as session:
        messages = session.messages()
        assistant = [m for m in messages if isinstance(m, AssistantMessage)]
        answers = [m for m in messages if isinstance(m, ToolResultMessage)]
        assert len(assistant) == 1 and len(answers) == 1  # the interrupted call, answered once
        assert answers[0].is_error
        await session.send("next")
    last = model.requests[-1].messages
    assert len([m for m in last if isinstance(m, ToolResultMessage)]) == 1


async def test_an_ended_session_is_refused_and_can_still_be_read(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with open_session(provider=chatty_model(), tools=[lookup_tool()], journal=path, session_id="e") as session:
        await session.send("hello")
        await session.end()
        with pytest.raises(SessionClosedError):
            await session.send("too late")
    with pytest.raises(SessionClosedError, match="ended for good"):
        async with open_session(provider=chatty_model(), journal=path, session_id="e"):
            pass
    async with open_sqlite_store(path, readonly=True) as store:
        conversation = await read_conversation(store, "e")
    assert conversation[0] == UserMessage("hello")


async def test_end_after_a_plain_close_is_refused_and_reopen_then_end_ends_it(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with open_session(provider=chatty_model(), journal=path, session_id="c") as session:
        await session.send("hello")
        await session.close()
        with pytest.raises(SessionClosedError, match="already closed"):
            await session.end()
        with pytest.raises(SessionClosedError, match="already closed"):
            await session.close(final=True)
        await session.close()  # a second plain close still does nothing more
    # Not silently left reopenable as if ended: the way the error names ends it for good.
    async with open_session(provider=chatty_model(), journal=path, session_id="c") as again:
        assert again.life == 2
        await again.end()
        await again.end()  # ending an ended session again does nothing more
    with pytest.raises(SessionClosedError, match="ended for good"):
        async with open_session(provider=chatty_model(), journal=path, session_id="c"):
            pass  # pragma: no cover


async def test_end_during_a_plain_close_waits_for_it_and_is_refused() -> None:
    # end() during a close() in another task returned normally without ending the session: it
    # turned the close final midway, so streams written after said final and the others not, and
    # the session reopened.
    store = LaterStore()
    helper = SubagentDefinition("helper", "helps", "You help.")
    outcome: dict[str, BaseException | None] = {}
    async with trio.open_nursery() as writer:
        writer.start_soon(store.run)
        async with open_session(provider=chatty_model(), journal=store, subagents=[helper], session_id="d") as session:
            await session.send("hello")
            await (await session.start_subagent("helper", "look this up")).wait()

            async def end() -> None:
                try:
                    await session.end()
                    outcome["end"] = None
                except SessionClosedError as exc:
                    outcome["end"] = exc

            async with trio.open_nursery() as nursery:
                store.gate = trio.Event()  # the close's writes wait
                nursery.start_soon(session.close)
                await trio.testing.wait_all_tasks_blocked()  # the close waits for its first write
                nursery.start_soon(end)
                await trio.testing.wait_all_tasks_blocked()
                assert "end" not in outcome  # it waits for the close
                store.gate.set()
            assert isinstance(outcome["end"], SessionClosedError)
            assert "already closed (not for good)" in str(outcome["end"])
        closes = [
            event.final
            for agent_id in session.journal.agents
            for event in await stream_events(session, agent_id)
            if isinstance(event, SessionClosed)
        ]
        assert closes == [False, False]  # the root's and the helper's, as the close began
        async with open_session(provider=chatty_model(), journal=store, session_id="d") as again:
            assert again.life == 2
        writer.cancel_scope.cancel()


async def test_background_subagent_outcomes_reach_the_reopened_conversation(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    slow, started, _release = gated_tool("slow")
    helper = SubagentDefinition("helper", "helps", "You help.", tools=("slow",))
    model = TestModel({"job": [Reply(tool_calls=[("slow", {})])]}, default=Reply(text="ok"))
    async with open_session(provider=model, tools=[slow], journal=path, session_id="g", subagents=[helper]) as session:
        handle = await session.start_subagent("helper", "job")
        await started.wait()
    async with open_session(provider=model, tools=[slow], journal=path, session_id="g", subagents=[helper]) as session:
        await session.send("what happened?")
    notes = [m.content for m in model.requests[-1].messages if isinstance(m, UserMessage)]
    assert any(handle.id in note and "cancelled" in note for note in notes)


SEED: list[Message] = [
    UserMessage("What is 2+2?"),
    AssistantMessage((TextPart("Let me compute."), ToolCallPart("c1", "lookup", '{"q": "2+2"}'))),
    ToolResultMessage("c1", "4"),
    AssistantMessage((TextPart("It is 4."),)),
]


async def test_a_seeded_session_starts_from_the_history_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    model = chatty_model()
    async with open_session(
        provider=model, tools=[lookup_tool()], journal=path, session_id="seeded", history=SEED
    ) as session:
        assert list(session.messages()) == SEED
        await session.send("And 3+3?")
    assert list(model.requests[0].messages[: len(SEED)]) == SEED
    async with open_sqlite_store(path, readonly=True) as store:
        events = [e.event for e in await store.read("seeded/root")]
        conversation = await read_conversation(store, "seeded")
    assert any(isinstance(e, ConversationSeeded) for e in events)
    assert conversation[: len(SEED)] == SEED
    # A seeded session reopens with its seed, and cannot be seeded again.
    with pytest.raises(ConfigError, match="already has a conversation"):
        async with open_session(provider=model, journal=path, session_id="seeded", history=SEED):
            pass


@pytest.mark.parametrize(
    ("history", "index", "words"),
    [
        ([AssistantMessage((TextPart("hi"),))], 0, "starts with a user message"),
        ([UserMessage("q"), AssistantMessage((ToolCallPart("c1", "lookup", "{}"),))], 1, "not answered"),
        (
            [UserMessage("q"), AssistantMessage((ToolCallPart("c1", "lookup", "{}"),)), UserMessage("more")],
            2,
            "not answered",
        ),
        ([UserMessage("q"), ToolResultMessage("c9", "?")], 1, "answers tool call 'c9'"),
        ([SystemMessage("be nice"), UserMessage("q")], 0, "system_prompt="),
        (
            [
                UserMessage("q"),
                AssistantMessage((ToolCallPart("c1", "lookup", "{}"),)),
                ToolResultMessage("c1", "a"),
                ToolResultMessage("c1", "b"),
            ],
            3,
            "answers tool call 'c1'",
        ),
        (
            [
                UserMessage("q"),
                AssistantMessage((ToolCallPart("c1", "lookup", "{}"),)),
                ToolResultMessage("c1", "a"),
                AssistantMessage((ToolCallPart("c1", "lookup", "{}"),)),
                ToolResultMessage("c1", "b"),
            ],
            3,
            "used twice",
        ),
        ([UserMessage("q"), "not a message"], 1, "not a message"),
    ],
)
async def test_an_invalid_history_is_refused_naming_the_message(history: Any, index: int, words: str) -> None:
    with pytest.raises(HistoryError, match=words) as caught:
        async with open_session(provider=chatty_model(), history=history):
            pytest.fail("an invalid history must be refused before the session opens")
    assert caught.value.index == index
    assert f"history[{index}]" in str(caught.value)


async def test_many_close_reopen_cycles_keep_the_journal_readable(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    model = TestModel(default=Reply(text="ok"))
    for cycle in range(40):
        async with open_session(provider=model, journal=path, session_id="cycles") as session:
            assert session.life == cycle + 1
            await session.send(f"message {cycle}")
    async with open_sqlite_store(path, readonly=True) as store:
        conversation = await read_conversation(store, "cycles")
    assert [m.content for m in conversation if isinstance(m, UserMessage)] == [f"message {i}" for i in range(40)]
