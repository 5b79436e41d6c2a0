"""What waits in the root agent's inbox survives the session's close and a crash.

The inbox holds what the root's next model call takes as input besides the prompt: a tool's
``new_messages`` effect, a background subagent's report, a message that joined a request that
ended first, recovery's notes. Each is journalled as it enters (``inbox_noted``) and is owed
until a model call that took it is journalled, so a reopened session tells the model every one
it never saw, once, and none it saw.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.session_helpers import stream_events, user_texts
from tests.store_helpers import LaterStore
from trio_agent import SubagentDefinition, TrioAgentError, define_tool, open_session
from trio_agent._journal._store import AppendBatch, AppendTicket
from trio_agent.journal import InboxNoted, MemoryStore, SessionClosed, open_sqlite_store
from trio_agent.models import ModelRequest, ToolResultMessage, UserMessage
from trio_agent.testing import FaultyStore, Reply, TestModel
from trio_agent.tools import Effect

OBJECT: dict[str, Any] = {"type": "object"}
NOTE = "remember: the sky is green"
HELPER = SubagentDefinition("helper", "a helper", "You are the helper.")


@pytest.fixture(params=["memory", "sqlite"])
async def journal(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """The same store for every open of a test: one memory store, or one SQLite file's."""
    if request.param == "memory":
        yield MemoryStore()
    else:
        async with open_sqlite_store(tmp_path / "journal.db") as store:
            yield store


@define_tool(
    name="note", description="tells the model something", input_schema=OBJECT, side_effect="pure", kind="readonly"
)
async def note(input: dict[str, Any], ctx: Any) -> str:
    await ctx.emit(Effect("new_messages", [NOTE]))
    return "noted"


def respond(request: ModelRequest) -> Reply:
    """A tool call for the first prompt, text for anything else."""
    last = request.messages[-1]
    if isinstance(last, UserMessage) and last.content == "go":
        return Reply(tool_calls=[("note", {})])
    return Reply(text="ok")


def told(model: TestModel, text: str = NOTE) -> int:
    """How often the last model call's input holds *text* as a user message."""
    return user_texts(model.requests[-1]).count(text)


async def test_a_note_the_run_never_reached_is_told_after_a_reopen_once(journal: Any) -> None:
    model = TestModel(respond=respond)
    opened = functools.partial(open_session, provider=model, tools=[note], journal=journal, session_id="s")
    async with opened(max_turns=1) as session:
        await session.send("go")  # its turn limit ends it after the call: the note waits in the inbox
        assert told(model) == 0
        [noted] = [e for e in await stream_events(session) if isinstance(e, InboxNoted)]
        assert noted.messages == (NOTE,) and noted.request_id is not None
    async with opened() as session:
        assert await session.send("and now?") == "ok"
    assert told(model) == 1
    # It reached the model: a later life neither tells it again nor loses it from the history.
    async with opened() as session:
        assert await session.send("again") == "ok"
    assert told(model) == 1
    assert user_texts(model.requests[-1])[-1] == "again"


async def test_a_note_is_owed_once_whatever_number_of_lives_pass_without_a_model_call(journal: Any) -> None:
    model = TestModel(respond=respond)
    opened = functools.partial(open_session, provider=model, tools=[note], journal=journal, session_id="s")
    async with opened(max_turns=1) as session:
        await session.send("go")
    for _ in range(2):  # reopened and closed, nothing sent: restored each time, journalled once
        async with opened():
            pass
    async with opened() as session:
        assert await session.send("and now?") == "ok"
        noted = [e for e in await stream_events(session) if isinstance(e, InboxNoted)]
    assert told(model) == 1
    assert [e.messages for e in noted] == [(NOTE,)]


async def test_a_note_taken_in_the_same_life_is_not_told_again_after_a_reopen(journal: Any) -> None:
    model = TestModel(respond=respond)
    opened = functools.partial(open_session, provider=model, tools=[note], journal=journal, session_id="s")
    async with opened() as session:
        assert await session.send("go") == "ok"  # the next turn takes the note
        assert told(model) == 1
    async with opened() as session:
        assert await session.send("and now?") == "ok"
    assert told(model) == 1  # in the rebuilt history, once; not owed again


async def test_a_note_survives_a_crash(journal: Any) -> None:
    """The note is durable once its call's result is: the crash right after loses neither."""
    model = TestModel(respond=respond)
    faulty = FaultyStore(journal)
    async with open_session(provider=model, tools=[note], journal=faulty, session_id="s", max_turns=1) as session:
        await session.send("go")
        faulty.fail_next("before")  # the process is as good as dead: nothing more is written
        with pytest.raises(TrioAgentError):
            await session.send("this write fails")
    assert not [e for e in await journal.read("s/root") if isinstance(e.event, SessionClosed)]
    async with open_session(provider=model, tools=[note], journal=journal, session_id="s") as session:
        assert await session.send("and now?") == "ok"
    assert told(model) == 1


async def test_a_message_that_joined_a_request_ending_at_its_turn_limit_survives_a_close(journal: Any) -> None:
    started, release = trio.Event(), trio.Event()

    @define_tool(name="slow", description="s", input_schema=OBJECT, side_effect="pure", kind="readonly")
    async def slow(input: dict[str, Any], ctx: Any) -> str:
        started.set()
        await release.wait()
        return "slow done"

    def answer(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        return (
            Reply(tool_calls=[("slow", {})]) if isinstance(last, UserMessage) and last.content == "go" else Reply("ok")
        )

    model = TestModel(respond=answer)
    opened = functools.partial(open_session, provider=model, tools=[slow], journal=journal, session_id="s")
    async with opened(max_turns=1) as session:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.send, "go")
            await started.wait()
            nursery.start_soon(functools.partial(session.send, "joined message", priority="next"))
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        assert len(model.requests) == 1  # the turn limit ended the request before the joined turn
    async with opened() as session:
        assert await session.send("and now?") == "ok"
    assert told(model, "joined message") == 1


async def test_a_background_subagents_later_report_survives_a_close(journal: Any) -> None:
    """A background subagent's first outcome is journalled (``subagent_completed``); the report of
    its next work is not an outcome, and was lost with the inbox."""
    model = TestModel(
        respond=lambda request: (
            Reply(text=f"answer to {user_texts(request)[-1]}")
            if request.metadata["agent_id"] != "root"
            else Reply(text="ok")
        )
    )
    opened = functools.partial(open_session, provider=model, journal=journal, session_id="s", subagents=[HELPER])
    async with opened() as session:
        handle = await session.start_subagent("helper", "first")
        assert await handle.wait() == "answer to first"
        assert await session.send("take the first") == "ok"
        first = [text for text in user_texts(model.requests[-1]) if text.startswith("[background")]
        assert len(first) == 1 and first[0].endswith("answer to first")
        handle.resume("second")
        assert await handle.wait() == "answer to second"
    async with opened() as session:
        assert await session.send("and now?") == "ok"
    notes = [text for text in user_texts(model.requests[-1]) if text.startswith("[background")]
    assert notes == [*first, f"[background subagent {handle.id} (helper) completed]: answer to second"]


async def test_recovery_notes_survive_a_close_before_any_request(journal: Any) -> None:
    """Recovery tells the model of a call whose outcome it cannot know; the request that held it
    is closed by that recovery, so a later recovery cannot tell it again: the note must survive."""

    @define_tool(name="pay", description="p", input_schema=OBJECT, side_effect="non_idempotent")
    async def pay(input: dict[str, Any], ctx: Any) -> str:
        if faulty is not None:
            faulty.fail_next("before")  # its settlement is never written: the process "died"
        return "paid"

    store = journal
    faulty: FaultyStore | None = FaultyStore(store)
    model = TestModel(respond=lambda r: Reply(tool_calls=[("pay", {})]) if user_texts(r) == ["pay"] else Reply("ok"))
    allow: Any = {"permissions": {"allow": ["pay"]}}
    with pytest.raises(TrioAgentError):
        async with open_session(provider=model, tools=[pay], journal=faulty, session_id="s", **allow) as session:
            await session.send("pay")
    faulty = None
    async with open_session(provider=model, tools=[pay], journal=store, session_id="s", **allow):
        pass  # recovered (the call settled outcome_unknown, the request interrupted), nothing sent
    async with open_session(provider=model, tools=[pay], journal=store, session_id="s", **allow) as session:
        assert await session.send("and now?") == "ok"
    recovered = [text for text in user_texts(model.requests[-1]) if text.startswith("[session recovered")]
    assert len(recovered) == 1 and "outcome" in recovered[0]
    answers = [m for m in model.requests[-1].messages if isinstance(m, ToolResultMessage)]
    assert len(answers) == 1 and answers[0].is_error


async def test_a_request_with_nothing_in_the_inbox_writes_no_note() -> None:
    model = TestModel(default=Reply(text="ok"))
    async with open_session(provider=model) as session:
        assert await session.send("hi") == "ok"
        assert not [e for e in await stream_events(session) if isinstance(e, InboxNoted)]


class NoteHeldStore(LaterStore):
    """Commits later (`LaterStore`); the first write holding an `InboxNoted` and every one after it
    wait until ``gate`` is set again (``held`` is set as that write is handed over)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        super().__init__()
        self.held = trio.Event()

    def submit(self, batch: AppendBatch) -> AppendTicket:
        if not self.held.is_set() and any(isinstance(e.event, InboxNoted) for e in batch.envelopes):
            self.gate = trio.Event()
            self.held.set()
        return super().submit(batch)


async def test_a_note_whose_write_a_cancellation_lands_on_is_told_once_after_a_reopen() -> None:
    """The note is in the inbox and in the journal's stream before the write's first checkpoint:
    a cancellation while the write is confirmed leaves it noted once, neither lost nor doubled."""
    store = NoteHeldStore()
    model = TestModel(respond=respond)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.run)
        async with open_session(provider=model, tools=[note], journal=store, session_id="s") as session:
            with trio.CancelScope() as scope:

                async def cancel_while_held() -> None:
                    await store.held.wait()
                    scope.cancel()
                    await trio.testing.wait_all_tasks_blocked()
                    store.gate.set()  # the write lands: its confirmation was waiting for it

                nursery.start_soon(cancel_while_held)
                await session.send("go")
            assert scope.cancelled_caught and not session.journal.fenced
            assert len(model.requests) == 1  # the turn that would have taken the note never ran
        async with open_session(provider=model, tools=[note], journal=store, session_id="s") as session:
            assert await session.send("and now?") == "ok"
        assert told(model) == 1
        nursery.cancel_scope.cancel()


class CrashAfterNoteStore(FaultyStore):
    """Fails every write after the first one holding an `InboxNoted` (the process "dies" there)."""

    def submit(self, batch: AppendBatch) -> AppendTicket:
        ticket = super().submit(batch)
        if any(isinstance(e.event, InboxNoted) for e in batch.envelopes):
            self.fail_next("before", 1000)
        return ticket


async def test_a_recovery_that_dies_after_journalling_its_note_has_it_told_once(journal: Any) -> None:
    """The note is journalled before the requests it tells of are closed: a crash between the two
    leaves them open, and the next recovery tells the same again; owed already, it is told once."""

    @define_tool(name="pay", description="p", input_schema=OBJECT, side_effect="non_idempotent")
    async def pay(input: dict[str, Any], ctx: Any) -> str:
        faulty.fail_next("before")  # its settlement is never written: the process "died"
        return "paid"

    faulty = FaultyStore(journal)
    model = TestModel(respond=lambda r: Reply(tool_calls=[("pay", {})]) if user_texts(r) == ["pay"] else Reply("ok"))
    allow: Any = {"permissions": {"allow": ["pay"]}}
    with pytest.raises(TrioAgentError):
        async with open_session(provider=model, tools=[pay], journal=faulty, session_id="s", **allow) as session:
            await session.send("pay")
    with pytest.raises(TrioAgentError):  # recovery notes the unknown outcome, then dies
        async with open_session(
            provider=model, tools=[pay], journal=CrashAfterNoteStore(journal), session_id="s", **allow
        ):
            pass
    async with open_session(provider=model, tools=[pay], journal=journal, session_id="s", **allow) as session:
        assert await session.send("and now?") == "ok"
        noted = [e for e in await stream_events(session) if isinstance(e, InboxNoted)]
    recovered = [text for text in user_texts(model.requests[-1]) if text.startswith("[session recovered")]
    assert len(recovered) == 1 and "outcome" in recovered[0]
    assert len(noted) == 1


async def test_a_message_that_joined_a_request_aborted_before_it_started_survives_a_close() -> None:
    store = LaterStore()
    model = TestModel(default=Reply(text="ok"))
    async with trio.open_nursery() as writer:
        writer.start_soon(store.run)
        opened = functools.partial(open_session, provider=model, journal=store, session_id="s")
        async with opened() as session:
            await session.send("warm")
            store.gate = trio.Event()  # the next acceptance waits for its commit
            async with trio.open_nursery() as nursery:

                async def send(prompt: str, **options: Any) -> None:
                    with pytest.raises(TrioAgentError):
                        await session.send(prompt, **options)

                nursery.start_soon(send, "first")
                await trio.testing.wait_all_tasks_blocked()  # "first" is being accepted
                nursery.start_soon(functools.partial(send, "remember this", priority="next"))
                await trio.testing.wait_all_tasks_blocked()  # the message joined it
                aborting = trio.Event()

                async def abort() -> None:
                    aborting.set()
                    await session.abort()

                nursery.start_soon(abort)
                await aborting.wait()
                store.gate.set()
        async with opened() as session:
            assert await session.send("next one") == "ok"
        assert told(model, "remember this") == 1
        writer.cancel_scope.cancel()


async def test_journal_show_names_what_entered_the_inbox() -> None:
    from trio_agent._journal._inspect import render_timeline

    store = MemoryStore()
    async with open_session(provider=TestModel(respond=respond), tools=[note], journal=store, max_turns=1) as session:
        await session.send("go")
    timeline = await render_timeline(store)
    assert f"inbox noted (1): {NOTE}" in timeline
