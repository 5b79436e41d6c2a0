"""A session taken over keeps its unfinished requests (``unfinished="keep"``) and
`Session.serve_request` runs each one to its end exactly once: the journal side of the
workers, without PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from workers_helpers import takeover_agent

from trio_agent import (
    ConfigError,
    LeaseLostError,
    SessionError,
    SubagentDefinition,
    UnfinishedRequestError,
    define_agent,
    open_session,
)
from trio_agent.journal import (
    MemoryStore,
    RequestAccepted,
    RequestCompleted,
    RequestInterrupted,
    RequestStarted,
    ToolOutcomeUnknown,
    open_journal,
)
from trio_agent.models import ToolResultMessage, UserMessage
from trio_agent.testing import Reply, TestModel

OBJECT = {"type": "object"}


def of_type(events: list[Any], kind: type) -> list[Any]:
    return [event for event in events if isinstance(event, kind)]


async def events_of(store: MemoryStore, session_id: str) -> list[Any]:
    return [envelope.event for envelope in await store.read(f"{session_id}/root")]


async def die_during(store: MemoryStore, spec: Any, session_id: str, run: Any) -> None:
    """Run ``run(session, nursery)`` until it returns (what it started in *nursery* still runs),
    then "die": nothing more is written (not even the close); the lease is given back later,
    as its expiry would."""
    async with (
        open_journal(store, session_id=session_id) as journal,
        open_session(spec, journal=journal) as session,
        trio.open_nursery() as nursery,
    ):
        await run(session, nursery)
        journal._lose(LeaseLostError("the worker died"))
        await trio.sleep_forever()  # the lost lease cancels the body
    raise AssertionError("unreachable")  # pragma: no cover


def accepts(request_id: str) -> Any:
    """A run that records *request_id* accepted (as ``send`` would) and dies before it starts."""

    async def run(session: Any, nursery: trio.Nursery) -> None:
        accepted = RequestAccepted(request_id=request_id, command_id=request_id, input={"prompt": "queued"})
        await session.journal.append(accepted, command_id=request_id)

    return run


def starts(request_id: str) -> Any:
    """A run that records *request_id* accepted and started, and dies before its first turn."""

    async def run(session: Any, nursery: trio.Nursery) -> None:
        accepted = RequestAccepted(request_id=request_id, command_id=request_id, input={"prompt": "go"})
        await session.journal.append(accepted, RequestStarted(request_id=request_id), command_id=request_id)

    return run


async def crashed(store: MemoryStore, spec: Any, session_id: str, run: Any) -> None:
    with pytest.raises(LeaseLostError):
        await die_during(store, spec, session_id, run)
    lease = await store.current_lease(session_id)
    assert lease is not None
    await store.release_lease(lease)


async def test_a_started_request_goes_on_from_its_last_durable_point() -> None:
    store = MemoryStore()
    scenario = takeover_agent()
    spec, model, ran, started = scenario.spec, scenario.model, scenario.paid, scenario.started

    async def run(session: Any, nursery: trio.Nursery) -> None:
        nursery.start_soon(session.serve_request, "req-1", "go")
        with trio.fail_after(5):
            await started.wait()  # the process dies with the call started

    await crashed(store, spec, "s", run)
    before = await events_of(store, "s")
    assert of_type(before, RequestStarted) and not of_type(before, RequestCompleted)
    calls_before = len(model.requests)

    async with open_session(spec, journal=store, session_id="s", unfinished="keep") as session:
        assert session.journal.projection().request("req-1").state.value == "started"
        ended = await session.serve_request("req-1", "go")
        assert ended.value == "completed"
        assert (await session.serve_request("req-1", "go")).value == "completed"  # once: not run again
    after = await events_of(store, "s")
    # One terminal event; the started payment is not repeated (its outcome is unknown) and the
    # settled look is kept: the model is asked next, with both results, and no second prompt.
    assert [e.output for e in of_type(after, RequestCompleted)] == [{"text": "finished with 2 results"}]
    assert not of_type(after, RequestInterrupted)
    assert len(of_type(after, ToolOutcomeUnknown)) == 1
    assert len(ran) == 1
    assert len(of_type(after, RequestAccepted)) == 1 and len(of_type(after, RequestStarted)) == 1
    resumed = model.requests[calls_before]
    prompts = [m.content for m in resumed.messages if isinstance(m, UserMessage)]
    assert prompts[0] == "go" and prompts.count("go") == 1  # the prompt is not asked again
    assert "outcome of pay call" in prompts[-1]  # the model learns what the restart left unknown
    assert len([m for m in resumed.messages if isinstance(m, ToolResultMessage)]) == 2


async def test_an_accepted_request_stays_runnable_and_runs_once() -> None:
    store = MemoryStore()
    spec = define_agent(provider=TestModel(default=Reply("answer")))

    await crashed(store, spec, "s2", accepts("req-2"))
    async with open_session(spec, journal=store, session_id="s2", unfinished="keep") as session:
        assert session.journal.projection().request("req-2").state.value == "accepted"
        assert (await session.serve_request("req-2", "queued")).value == "completed"
    events = await events_of(store, "s2")
    assert len(of_type(events, RequestAccepted)) == 1
    assert [e.output for e in of_type(events, RequestCompleted)] == [{"text": "answer"}]


async def test_the_default_reopen_still_interrupts_what_the_crash_left_open() -> None:
    store = MemoryStore()
    spec = define_agent(provider=TestModel(default=Reply("answer")))

    await crashed(store, spec, "s3", accepts("req-3"))
    async with open_session(spec, journal=store, session_id="s3") as session:
        assert session.journal.projection().request("req-3").state.value == "interrupted"
        assert (await session.serve_request("req-3", "queued")).value == "interrupted"  # ended: not run


async def test_serve_request_records_a_failure_and_returns_it() -> None:
    def respond(request: Any) -> Reply:
        raise RuntimeError("the model broke")

    spec = define_agent(provider=TestModel(respond=respond))
    async with open_session(spec) as session:
        assert (await session.serve_request("req-4", "hi")).value == "failed"


@pytest.mark.parametrize("bad", ["", "a" * 300, 7])
async def test_serve_request_refuses_a_bad_request_id(bad: Any) -> None:
    async with open_session(define_agent(provider=TestModel(default=Reply("x")))) as session:
        with pytest.raises(ConfigError, match="request_id"):
            await session.serve_request(bad, "hi")


async def test_open_session_refuses_an_unknown_unfinished_mode() -> None:
    with pytest.raises(ConfigError, match="unfinished"):
        async with open_session(define_agent(provider=TestModel(default=Reply("x"))), unfinished="resume"):  # type: ignore[arg-type]
            pass  # pragma: no cover


async def test_serve_request_raises_when_the_end_could_not_be_recorded() -> None:
    """The store refuses the writes that end the request: serve_request must not report an
    outcome the journal never recorded (a worker would mark the submission done on its word)."""
    from trio_agent import TrioAgentError
    from trio_agent.testing import FaultyStore

    inner = MemoryStore()
    store = FaultyStore(inner)

    def respond(request: Any) -> Reply:
        store.fail_next("before", count=10)  # every write from the reply on is refused
        return Reply("done")

    spec = define_agent(provider=TestModel(respond=respond))
    with pytest.raises(TrioAgentError):
        async with open_session(spec, journal=store, session_id="fenced") as session:
            with pytest.raises(TrioAgentError) as raised:
                await session.serve_request("req-5", "hi")
            assert "req-5" in str(raised.value) or session.journal.fenced
            raise raised.value  # the close of a fenced journal may fail too: either way, typed
    events = await events_of(inner, "fenced")
    assert not of_type(events, RequestCompleted)


async def test_serve_request_refuses_a_bad_prompt_by_name() -> None:
    async with open_session(define_agent(provider=TestModel(default=Reply("x")))) as session:
        for bad in ["", "   ", 42]:
            with pytest.raises(ConfigError, match="prompt"):
                await session.serve_request("req-6", bad)  # type: ignore[arg-type]
        assert session.journal.projection().request("req-6") is None


async def test_a_request_taken_over_counts_its_earlier_turns_against_max_turns() -> None:
    store = MemoryStore()
    scenario = takeover_agent()
    spec = define_agent(provider=scenario.model, tools=list(scenario.spec.parts.tools.values()), max_turns=2)

    async def run(session: Any, nursery: trio.Nursery) -> None:
        nursery.start_soon(session.serve_request, "req-7", "go")
        with trio.fail_after(5):
            await scenario.started.wait()  # in its second turn

    await crashed(store, spec, "s7", run)
    calls_before = len(scenario.model.requests)
    async with open_session(spec, journal=store, session_id="s7", unfinished="keep") as session:
        assert (await session.serve_request("req-7", "go")).value == "completed"
    # The two turns it took before the crash were its max_turns: no third model call is made.
    assert len(scenario.model.requests) == calls_before
    [done] = of_type(await events_of(store, "s7"), RequestCompleted)
    assert done.output == {"text": ""}


async def test_a_store_that_raises_on_submit_fences_the_journal_and_serve_request_raises() -> None:
    """The projection moves before the write: a store raising synchronously on the request's end
    (as a closed PostgreSQL store does) must fence the journal, or serve_request would report the
    projection's `completed`, which the store never got."""
    from trio_agent import TrioAgentError
    from trio_agent.journal import JournalUnavailableError

    class RefusesTheEnd(MemoryStore):
        armed = True

        def submit(self, batch: Any) -> Any:
            if self.armed and any(isinstance(e.event, RequestCompleted) for e in batch.envelopes):
                self.armed = False
                raise JournalUnavailableError("the store is not open")
            return super().submit(batch)

    store = RefusesTheEnd()
    spec = define_agent(provider=TestModel(default=Reply("hi")))
    async with open_journal(store, session_id="refuses") as journal:
        with pytest.raises(TrioAgentError):
            async with open_session(spec, journal=journal) as session:
                with pytest.raises(TrioAgentError):
                    await session.serve_request("req-8", "hello")
                assert journal.fenced
                raise TrioAgentError("done with it")
    assert not of_type(await events_of(store, "refuses"), RequestCompleted)


async def test_a_kept_started_request_refuses_other_requests_until_it_is_served() -> None:
    # The journal takes one started request at a time: while a kept one is open, a new request
    # (send, stream, serve_request of another id, a subagent start between requests) is refused
    # with a typed error naming it, before anything is written; once served, all is as usual.
    store = MemoryStore()
    helper = SubagentDefinition("helper", "a helper", "You help.")
    spec = define_agent(provider=TestModel(default=Reply("answer")), subagents=[helper])
    await crashed(store, spec, "s9", starts("req-9"))
    async with open_session(spec, journal=store, session_id="s9", unfinished="keep") as session:
        before = await events_of(store, "s9")
        refusals: list[UnfinishedRequestError] = []
        for attempt in (
            lambda: session.send("hello"),
            lambda: session.serve_request("req-10", "hello"),
            lambda: session.start_subagent("helper", "look around"),
        ):
            with pytest.raises(UnfinishedRequestError) as caught:
                await attempt()
            refusals.append(caught.value)
        with pytest.raises(UnfinishedRequestError) as caught:
            async with session.stream("hello"):
                pass  # pragma: no cover
        refusals.append(caught.value)
        assert all(isinstance(error, SessionError) and error.request_id == "req-9" for error in refusals)
        assert "serve_request('req-9'" in str(refusals[0]) and refusals[0].code == "unfinished_request"
        assert await events_of(store, "s9") == before and not session.subagents  # nothing was written
        assert (await session.serve_request("req-9", "go")).value == "completed"
        assert await session.send("hello") == "answer"
        assert (await session.serve_request("req-10", "hello")).value == "completed"


async def test_a_request_accepted_under_the_older_id_rule_is_still_served() -> None:
    """An id with a C1 control (U+0085) was accepted before such ids were refused, by a process
    that died: the journal holds it, so it is served by the rule it was stored under. An id the
    journal never saw is judged by the rule for new ids."""
    store = MemoryStore()
    spec = define_agent(provider=TestModel(default=Reply("answer")))

    await crashed(store, spec, "s11", accepts("legacy\x85req"))
    async with open_session(spec, journal=store, session_id="s11", unfinished="keep") as session:
        assert (await session.serve_request("legacy\x85req", "queued")).value == "completed"
        with pytest.raises(ConfigError, match="U\\+0085"):
            await session.serve_request("new\x85req", "hi")
    assert [e.request_id for e in of_type(await events_of(store, "s11"), RequestCompleted)] == ["legacy\x85req"]
