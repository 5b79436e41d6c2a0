"""Web threads backed by durable sessions (issue 15): a disconnect only detaches, a client that
comes back replays and follows, a reload (or a restarted server) sees the same conversation."""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from ag_ui.core import Event as AgUiEventModel
from pydantic import TypeAdapter

import trio_agent as ta
from tests.test_session import gated_tool
from tests.test_web import add, body, respond
from trio_agent.lifecycle import ChatMiddleware
from trio_agent.testing import Reply, TestModel
from trio_agent.web import create_app, local_only, serve

EVENTS: TypeAdapter[Any] = TypeAdapter(AgUiEventModel)


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """The app served on a free loopback port until the block ends (its URL), then shut down
    gracefully: its lifespan ends and its sessions close."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, app, port=0, shutdown_trigger=stop.wait))
        try:
            yield binds[0]
        finally:
            stop.set()


@asynccontextmanager
async def running(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """`served`, with a client of it."""
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client


async def read(
    response: httpx.Response, until: str | None = None, *, first: trio.Event | None = None
) -> list[dict[str, Any]]:
    """The events of a stream, to its end or (cancelling the read, not breaking it) to ``until``;
    ``first`` is set once the first event arrived (the client is attached)."""
    out: list[dict[str, Any]] = []
    with trio.CancelScope() as reading:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                EVENTS.validate_python(data)
                out.append(data)
                if first is not None:
                    first.set()
                if data["type"] == until:
                    reading.cancel()
    return out


async def view(client: httpx.AsyncClient, thread: str) -> list[dict[str, Any]]:
    async with client.stream("GET", f"/threads/{thread}") as response:
        assert response.status_code == 200
        return await read(response)


def texts(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")


async def test_a_thread_is_a_session_a_reload_sees_its_conversation(tmp_path: Path) -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "threads.db")
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body(thread="t1")) as response:
            events = await read(response)
        assert events[0]["type"] == "RUN_STARTED" and events[-1]["outcome"] == {"type": "success"}
        assert texts(events) == "result: 3"
        async with client.stream("POST", "/runs", json=body("add 3 and 4", thread="t1", run="r2")) as response:
            await read(response)
        (snapshot,) = await view(client, "t1")
        roles = [m["role"] for m in snapshot["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"] * 2
        unknown = await client.get("/threads/nope")
        assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_thread"
    # A restarted server: the same file, a new app; the thread's conversation is read back.
    again = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "threads.db")
    async with running(again) as client:
        (reloaded,) = await view(client, "t1")
        assert reloaded == snapshot


async def test_a_disconnect_detaches_and_a_returning_client_replays_then_follows(tmp_path: Path) -> None:
    log: list[str] = []
    slow, started, release = gated_tool("slow", log=log)
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow], threads=tmp_path / "threads.db")
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body("slow please", run="r1")) as response:
            first = await read(response, until="TOOL_CALL_END")
        with trio.fail_after(10):
            await started.wait()  # the tool runs on, without any client
        async with trio.open_nursery() as nursery:
            seen: dict[str, list[dict[str, Any]]] = {}
            attached = {"again": trio.Event(), "tab": trio.Event()}

            async def follow(name: str, request: Any) -> None:
                async with request as response:
                    assert response.status_code == 200
                    seen[name] = await read(response, first=attached[name])

            # The same run again (a client coming back) and a second tab, both while it runs.
            nursery.start_soon(follow, "again", client.stream("POST", "/runs", json=body("slow please", run="r1")))
            nursery.start_soon(follow, "tab", client.stream("GET", "/threads/t1"))
            with trio.fail_after(10):
                for event in attached.values():  # both follow the run before it may end
                    await event.wait()
            release.set()
        assert log == ["slow:finished"]
        assert seen["again"][: len(first)] == first  # replayed from the start
        assert seen["again"][-1]["type"] == "RUN_FINISHED" and texts(seen["again"]) == "result: slow done"
        assert seen["tab"][0]["type"] == "MESSAGES_SNAPSHOT" and seen["tab"][1:] == seen["again"]
        busy = await client.post("/runs", json=body("slow please", run="r2"))
        assert busy.status_code == 200  # the previous run ended: a new one may start
        await busy.aread()


def asking_app(tmp_path: Path) -> Any:
    """A threads app whose `add` asks for approval: its first run pauses."""
    model = TestModel(respond=respond)
    return create_app(model, auth=local_only, tools=[add], threads=tmp_path / "t.db", permissions={"ask": ["add"]})


async def test_a_paused_thread_shows_its_questions_and_resumes(tmp_path: Path) -> None:
    app = asking_app(tmp_path)
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body()) as response:
            paused = await read(response)
        (interrupt,) = paused[-1]["outcome"]["interrupts"]
        shown = await view(client, "t1")
        assert [e["type"] for e in shown] == ["MESSAGES_SNAPSHOT", "CUSTOM"]
        assert shown[1]["name"] == "trio_agent.thread_paused" and shown[1]["value"]["interrupts"] == [interrupt]
        refused = await client.post("/runs", json=body("another", run="r2"))
        assert refused.status_code == 409 and refused.json()["error"] == "thread_paused"
        answer = [{"interruptId": interrupt["id"], "status": "resolved", "payload": {"approved": True}}]
        async with client.stream("POST", "/runs", json=body(run="r3", resume=answer)) as response:
            resumed = await read(response)
        assert resumed[-1]["outcome"] == {"type": "success"} and texts(resumed) == "result: 3"
        again = await client.post("/runs", json=body(run="r4", resume=answer))
        assert again.status_code == 409 and again.json()["error"] == "nothing_to_resume"


async def test_a_run_id_posted_again_with_other_input_is_refused_not_replayed(tmp_path: Path) -> None:
    # A continuation reusing the paused run's runId was taken for a retry: the paused run's
    # events were replayed and its answers dropped without a word (a new message likewise).
    app = asking_app(tmp_path)
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body(run="r1")) as response:
            paused = await read(response)
        (interrupt,) = paused[-1]["outcome"]["interrupts"]
        answer = [{"interruptId": interrupt["id"], "status": "resolved", "payload": {"approved": True}}]
        for other in (body(run="r1", resume=answer), body("add 5 and 6", run="r1")):
            refused = await client.post("/runs", json=other)
            assert refused.status_code == 409 and refused.json()["error"] == "run_id_taken", refused.text
        async with client.stream("POST", "/runs", json=body(run="r1")) as response:
            assert await read(response) == paused  # a retry (the same input) is still replayed
        async with client.stream("POST", "/runs", json=body(run="r2", resume=answer)) as response:
            resumed = await read(response)  # the answers were not spent by the refused post
        assert resumed[-1]["outcome"] == {"type": "success"} and texts(resumed) == "result: 3"
        async with client.stream("POST", "/runs", json=body(run="r2", resume=answer)) as response:
            assert await read(response) == resumed  # a continuation's retry is replayed too
        refused = await client.post("/runs", json=body("add 5 and 6", run="r2"))
        assert refused.status_code == 409 and refused.json()["error"] == "run_id_taken"


async def test_the_stop_endpoint_stops_a_thread_run(tmp_path: Path) -> None:
    slow, started, _release = gated_tool("slow")
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow], threads=tmp_path / "t.db")
    events: list[dict[str, Any]] = []
    async with (
        running(app) as client,
        client.stream("POST", "/runs", json=body("slow please", run="r1")) as response,
        trio.open_nursery() as nursery,
    ):

        async def stop_when_started() -> None:
            await started.wait()
            assert (await client.post("/runs/r1/abort")).status_code == 202

        nursery.start_soon(stop_when_started)
        events = await read(response)
    assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "cancelled"}


async def test_a_thread_that_cannot_be_opened_is_an_http_error(tmp_path: Path) -> None:
    from trio_agent.journal import open_sqlite_store

    path = tmp_path / "t.db"
    async with open_sqlite_store(path) as store:
        # Another process holds the session's lease: the thread cannot be opened here.
        await store.acquire_lease("t1", "someone-else", 60)
        app = create_app(TestModel(default=Reply(text="hi")), auth=local_only, threads=store)
        async with running(app) as client:
            busy = await client.post("/runs", json=body(thread="t1"))
            assert busy.status_code == 503 and busy.json()["error"] == "thread_unavailable"
            async with client.stream("POST", "/runs", json=body(thread="t2")) as response:
                assert (await read(response))[-1]["type"] == "RUN_FINISHED"  # a neighbour is not affected
    assert ta.__name__ == "trio_agent"


async def test_a_view_whose_store_fails_is_a_503_not_a_bare_500(tmp_path: Path, monkeypatch: Any) -> None:
    from trio_agent._journal._sqlite import SQLiteStore
    from trio_agent.journal import open_sqlite_store

    async def unavailable(self: Any, session_id: str | None = None) -> Any:
        raise ta.JournalUnavailableError("the disk went away")

    async with open_sqlite_store(tmp_path / "t.db") as store:
        app = create_app(TestModel(default=Reply(text="hi")), auth=local_only, threads=store)
        async with running(app) as client:
            monkeypatch.setattr(SQLiteStore, "streams", unavailable)
            reply = await client.get("/threads/t1")
            assert reply.status_code == 503 and reply.json()["error"] == "thread_unavailable"
            assert "the disk went away" in reply.json()["message"]


def where_model() -> TestModel:
    def answer(request: ta.ModelRequest) -> Reply:
        last = request.messages[-1]
        if isinstance(last, ta.ToolResultMessage):
            return Reply(text=f"you are at {last.content}")
        return Reply(tool_calls=[("where_am_i", {})])

    return TestModel(respond=answer)


async def test_a_thread_resumes_a_client_tool_with_its_output(tmp_path: Path) -> None:
    from trio_agent.lifecycle import define_client_tool

    where = define_client_tool("where_am_i", "the page's location")
    app = create_app(where_model(), auth=local_only, tools=[where], threads=tmp_path / "t.db")
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body("where am I?")) as response:
            paused = await read(response)
        (interrupt,) = paused[-1]["outcome"]["interrupts"]
        assert interrupt["metadata"]["kind"] == "client_tool"
        answer = [{"interruptId": interrupt["id"], "status": "resolved", "payload": "Lisbon"}]
        async with client.stream("POST", "/runs", json=body(run="r2", resume=answer)) as response:
            resumed = await read(response)
        assert resumed[-1]["outcome"] == {"type": "success"} and texts(resumed) == "you are at Lisbon"


async def test_run_ids_are_unique_across_threads_and_a_finished_run_is_replayed_not_rerun(tmp_path: Path) -> None:
    slow, started, release = gated_tool("slow")
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow, add], threads=tmp_path / "t.db")
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body("slow please", thread="a", run="shared")) as response:
            with trio.fail_after(10):
                await started.wait()
            other = await client.post("/runs", json=body(thread="b", run="shared"))
            assert other.status_code == 409 and other.json()["error"] == "run_in_progress"
            release.set()
            first = await read(response)
        async with client.stream("POST", "/runs", json=body("slow please", thread="a", run="shared")) as response:
            again = await read(response)  # a retry of a run that ended: its events again, no new run
        assert again == first
        (snapshot,) = await view(client, "a")
        assert [m["content"] for m in snapshot["messages"] if m["role"] == "user"] == ["slow please"]


async def test_a_run_id_the_thread_ran_is_never_run_again_once_its_events_are_gone(tmp_path: Path) -> None:
    # The runId is the request's id in the session's journal: once the thread moved on (another
    # run, its session closed to make room, a restart) its events are gone, and the runId was run
    # again as a new prompt. Now the journal knows it: 409 run_ended, with how it ended.
    def make_app() -> Any:
        return create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")

    async def prompts(client: httpx.AsyncClient) -> list[str]:
        (snapshot,) = await view(client, "t1")
        return [m["content"] for m in snapshot["messages"] if m["role"] == "user"]

    async def retry_is_refused(client: httpx.AsyncClient, run: str) -> None:
        again = await client.post("/runs", json=body("add 1 and 2", run=run))
        assert again.status_code == 409, again.text
        assert again.json()["error"] == "run_ended" and again.json()["state"] == "completed"

    app = make_app()
    async with running(app) as client:
        for prompt, run in (("add 1 and 2", "X"), ("add 3 and 4", "Y")):
            async with client.stream("POST", "/runs", json=body(prompt, run=run)) as response:
                assert (await read(response))[-1]["outcome"] == {"type": "success"}
        await retry_is_refused(client, "X")  # another run since
        hub = app.state.agui.hub
        hub.max_threads = 1
        async with client.stream("POST", "/runs", json=body(thread="t2", run="Z")) as response:
            await read(response)
        with trio.fail_after(10):
            while "t1" in hub._threads:
                await trio.testing.wait_all_tasks_blocked()
        await retry_is_refused(client, "Y")  # its session closed to make room, reopened now
        assert await prompts(client) == ["add 1 and 2", "add 3 and 4"]
    async with running(make_app()) as client:
        await retry_is_refused(client, "Y")  # a restart
        assert await prompts(client) == ["add 1 and 2", "add 3 and 4"]


async def test_a_run_whose_model_fails_ends_with_run_error_and_is_not_run_again(tmp_path: Path) -> None:
    calls: list[str] = []

    def failing(request: ta.ModelRequest) -> Reply:
        calls.append("model")
        raise ValueError("it broke")

    app = create_app(TestModel(respond=failing), auth=local_only, threads=tmp_path / "t.db")
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body("hi", run="X")) as response:
            events = await read(response)
        assert [e["type"] for e in events] == ["RUN_STARTED", "RUN_ERROR"]
        assert events[-1]["code"] == "provider_failed" and "it broke" in events[-1]["message"]  # the error's own
        async with client.stream("POST", "/runs", json=body("hi", run="X")) as response:
            assert await read(response) == events  # its events are kept: replayed
    async with running(create_app(TestModel(respond=failing), auth=local_only, threads=tmp_path / "t.db")) as client:
        again = await client.post("/runs", json=body("hi", run="X"))
        assert again.status_code == 409 and again.json()["state"] == "failed"
    assert calls == ["model"]


async def test_a_stop_that_comes_before_the_run_opens_still_stops_it(tmp_path: Path) -> None:
    log: list[str] = []
    slow, _started, _release = gated_tool("slow", log=log)
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow], threads=tmp_path / "t.db")
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body("slow please", run="r1")) as response:
            # Before reading a byte (the run's task may not have opened its request yet).
            app.state.agui.runs["r1"]()
            events = await read(response)
        assert events[-1]["outcome"] == {"type": "cancelled"}
        assert "slow:finished" not in log


async def test_a_stop_that_comes_while_the_run_opens_its_thread_stops_it(tmp_path: Path) -> None:
    # The run id was known only once its request had opened the thread's session: a stop that
    # came meanwhile was 404 unknown_run, and the run then ran to its end.
    opening, opened = trio.Event(), trio.Event()

    async def session_start(input: Any) -> None:
        opening.set()
        await opened.wait()  # the session takes a while to open (recovery, a slow store ...)

    log: list[str] = []
    slow, _started, _release = gated_tool("slow", log=log)
    model = TestModel(respond=respond)
    agent = ta.define_agent(
        provider=model, tools=[slow], hooks={ta.HookEvent.SESSION_START: [session_start]}, permission_asks="interrupt"
    )
    app = create_app(model, auth=local_only, threads=tmp_path / "t.db", agent=agent)
    async with running(app) as client, trio.open_nursery() as nursery:
        events: list[dict[str, Any]] = []

        async def post() -> None:
            async with client.stream("POST", "/runs", json=body("slow please", run="r1")) as response:
                events.extend(await read(response))

        nursery.start_soon(post)
        with trio.fail_after(10):
            await opening.wait()
        stopped = await client.post("/runs/r1/abort")
        assert (stopped.status_code, stopped.json()) == (202, {"aborted": True})
        opened.set()
    assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "cancelled"}
    assert "slow:finished" not in log and app.state.agui.runs == {}


async def test_a_request_that_starts_no_run_leaves_its_run_id_free(tmp_path: Path) -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")
    async with running(app) as client:
        payload = body()
        payload["messages"][-1]["content"] = ""
        assert (await client.post("/runs", json=payload)).status_code == 422
        assert app.state.agui.runs == {}
        assert (await client.post("/runs/r1/abort")).status_code == 404  # nothing runs, nor opens
        async with client.stream("POST", "/runs", json=body()) as response:
            assert (await read(response))[-1]["outcome"] == {"type": "success"}
        async with client.stream("POST", "/runs", json=body()) as response:  # a replay starts nothing
            assert (await read(response))[-1]["outcome"] == {"type": "success"}
        assert app.state.agui.runs == {}


async def test_a_view_during_a_live_run_shows_it_once(tmp_path: Path) -> None:
    slow, started, release = gated_tool("slow")
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow, add], threads=tmp_path / "t.db")
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body(run="r1")) as response:
            await read(response)
        async with client.stream("POST", "/runs", json=body("slow please", run="r2")) as response:
            with trio.fail_after(10):
                await started.wait()
            async with trio.open_nursery() as nursery:
                seen: list[dict[str, Any]] = []

                async def watch() -> None:
                    seen.extend(await view(client, "t1"))

                nursery.start_soon(watch)
                with trio.fail_after(10):
                    while not seen and app.state.agui.hub._threads["t1"].live.end < 4:
                        await trio.lowlevel.checkpoint()
                await trio.testing.wait_all_tasks_blocked()
                release.set()
            await read(response)
    snapshot = seen[0]
    assert [m["role"] for m in snapshot["messages"]] == ["user", "assistant", "tool", "assistant"]  # before r2
    assert [e["type"] for e in seen].count("TOOL_CALL_START") == 1 and seen[-1]["type"] == "RUN_FINISHED"


async def test_at_most_max_threads_sessions_stay_open(tmp_path: Path) -> None:
    from trio_agent._web import _app

    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")
    async with running(app) as client:
        app.state.agui.hub.max_threads = 2
        for index in range(5):
            async with client.stream("POST", "/runs", json=body(thread=f"t{index}", run=f"r{index}")) as response:
                assert (await read(response))[-1]["outcome"] == {"type": "success"}
        hub = app.state.agui.hub
        with trio.fail_after(10):
            while len(hub._threads) > 2:
                await trio.testing.wait_all_tasks_blocked()
        (snapshot,) = await view(client, "t0")  # closed, reopened from the journal
        assert [m["role"] for m in snapshot["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert _app.__name__.endswith("_app")


async def test_sessions_past_max_threads_close_as_soon_as_they_are_idle(tmp_path: Path) -> None:
    # Room was made only when a thread opened: sessions kept open past max_threads while their
    # threads were busy stayed open after their runs ended, until some other thread opened.
    slow, _started, release = gated_tool("slow")
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow], threads=tmp_path / "t.db")

    async def until_settled() -> None:  # no run, and every session asked to close has closed
        with trio.fail_after(10):
            while any(t.busy or t.closing.is_set() for t in hub._threads.values()):
                await trio.testing.wait_all_tasks_blocked()
                await trio.lowlevel.checkpoint()

    async with running(app) as client:
        hub = app.state.agui.hub
        hub.max_threads = 2
        for index in range(4):  # each client detaches at once: the runs go on
            async with client.stream("POST", "/runs", json=body("slow please", thread=f"t{index}", run=f"r{index}")):
                pass
        assert len(hub._threads) == 4 and all(t.busy for t in hub._threads.values())  # a busy one never closes
        release.set()
        await until_settled()
        # Closed as their runs ended, in whichever order the runs end: two idle ones stay.
        assert len(hub._threads) == 2 and set(hub._threads) < {"t0", "t1", "t2", "t3"}
        assert not any(t.busy for t in hub._threads.values())
        async with hub.use("u1"), hub.use("u2"), hub.use("u3"):  # requests using threads: they stay open
            assert len(hub._threads) == 3
        await until_settled()
        assert list(hub._threads) == ["u1", "u2"]  # u3's request left first: idle past max_threads, it closed


async def test_a_thread_needs_a_new_user_message_and_the_app_its_lifespan(tmp_path: Path) -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")
    async with running(app) as client:
        payload = body()
        payload["messages"].append({"id": "a1", "role": "assistant", "content": "hi"})
        refused = await client.post("/runs", json=payload)
        assert refused.status_code == 422 and "last message must be the user's" in refused.json()["problems"][0]
    # Served without its lifespan (e.g. an ASGI transport that runs none): threads say so.
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as bare:
        reply = await bare.post("/runs", json=body())
        assert reply.status_code == 503 and reply.json()["error"] == "threads_unavailable"


async def test_a_message_a_thread_cannot_take_is_refused_before_the_stream_and_its_run_id_stays_free(
    tmp_path: Path,
) -> None:
    # The session refused it once streaming (RUN_ERROR run_failed), and the failed run kept its
    # runId: posting it again replayed the failure.
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")
    async with running(app) as client:
        reasoning = {"id": "x", "role": "reasoning", "content": "hm"}
        for content, at in (
            ("", 0),
            ("   ", 0),
            ([{"type": "binary", "mimeType": "image/png", "data": "AAAA"}], 0),
            ([{"type": "text", "text": ""}], 0),
        ):
            payload = body()
            payload["messages"] = [reasoning] * at + [{"id": "u1", "role": "user", "content": content}]
            refused = await client.post("/runs", json=payload)
            assert refused.status_code == 422 and refused.json()["error"] == "invalid_input", content
            (problem,) = refused.json()["problems"]
            assert problem.startswith(f"$.messages[{at}].content: a prompt must be a non-empty string"), problem
        payload = body()
        payload["messages"].insert(0, reasoning)
        payload["messages"][-1]["content"] = ""
        refused = await client.post("/runs", json=payload)
        assert refused.json()["problems"][0].startswith("$.messages[1].content: ")  # named by its own path
        async with client.stream("POST", "/runs", json=body()) as response:  # the same runId, now runs
            events = await read(response)
        assert events[-1]["outcome"] == {"type": "success"} and texts(events) == "result: 3"


async def test_a_follower_that_keeps_up_copies_each_frame_once() -> None:
    # LiveRun.since copied the whole kept window on every wake-up, and a follower that keeps up
    # wakes once per frame: following a run of n frames read n*n/2 of them, on the event loop.
    from trio_agent._web._app import _Follow
    from trio_agent._web._threads import LiveRun
    from trio_agent.agui import sse_event

    class CountingFrames(collections.deque[bytes]):
        """The run's kept frames, counting each one read out of them."""

        read = 0

        def __iter__(self) -> Iterator[bytes]:
            for frame in super().__iter__():
                self.read += 1
                yield frame

        def __reversed__(self) -> Iterator[bytes]:
            for frame in super().__reversed__():
                self.read += 1
                yield frame

        def __getitem__(self, index: Any) -> Any:
            self.read += 1
            return super().__getitem__(index)

    def frame(index: int) -> bytes:
        return sse_event({"type": "CUSTOM", "name": "n", "value": index})

    app = create_app(TestModel(default=Reply(text="hi")), auth=local_only)
    live = LiveRun("r1", 0)
    live._frames = kept = CountingFrames()
    written: list[bytes] = []

    async def send(message: Any) -> None:
        written.append(message.get("body", b""))

    async def receive() -> Any:
        await trio.sleep_forever()

    count = 500
    scope = {"type": "http", "method": "POST", "path": "/runs", "headers": []}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_Follow(app.state.agui, (), live), scope, receive, send)
        for index in range(count):
            await trio.testing.wait_all_tasks_blocked()  # the follower waits for the next frame
            live.add(frame(index))
        live.finish()
    assert b"".join(written) == b"".join(frame(index) for index in range(count))
    assert len(written) > count // 2  # it woke (about) once per frame ...
    assert kept.read == count  # ... and read each frame once: linear in the run, not quadratic


async def test_a_follower_that_falls_behind_the_kept_frames_is_told_never_left_with_a_hole() -> None:
    from trio_agent._web._app import _Follow
    from trio_agent._web._threads import LiveRun
    from trio_agent.agui import sse_event

    def frame(index: int) -> bytes:
        return sse_event({"type": "CUSTOM", "name": "n", "value": index})

    app = create_app(TestModel(default=Reply(text="hi")), auth=local_only)
    live = LiveRun("r1", 0, max_bytes=10 * len(frame(0)))
    live.add(frame(0))
    written: list[bytes] = []
    reading = trio.Event()  # the client reads its first write, then nothing until told

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            written.append(message["body"])
            if len(written) == 1:
                await reading.wait()

    async def receive() -> Any:
        await trio.sleep_forever()

    scope = {"type": "http", "method": "POST", "path": "/runs", "headers": []}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_Follow(app.state.agui, (), live), scope, receive, send)
        await trio.testing.wait_all_tasks_blocked()  # blocked writing frame 0 to a client that does not read
        for index in range(1, 50):  # the run goes on: the oldest frames, 1 on, are dropped
            live.add(frame(index))
        live.finish()
        reading.set()
    events = [json.loads(line[6:]) for line in b"".join(written).decode().splitlines() if line.startswith("data: ")]
    assert [e.get("value") for e in events[:-1]] == [0]  # what it got has no hole ...
    assert events[-1]["type"] == "RUN_ERROR" and events[-1]["code"] == "fell_behind"  # ... and it is told
    assert "GET /threads/" in events[-1]["message"]
    # A client attaching now is told at once: the run's first frames are gone, and a replay from
    # the oldest kept was a run without its start (AG-UI's client refuses it), a stream with a hole.
    late: list[bytes] = []

    async def keep(message: Any) -> None:
        late.append(message.get("body", b""))

    await _Follow(app.state.agui, (), live)(scope, receive, keep)
    (told,) = [json.loads(line[6:]) for line in b"".join(late).decode().splitlines() if line.startswith("data: ")]
    assert live.first > 1 and told["type"] == "RUN_ERROR" and told["code"] == "fell_behind"
    assert "cannot be replayed from its start" in told["message"]


def spamming_app(tmp_path: Path) -> tuple[Any, trio.Event]:
    """An app whose run ("go") emits 20 KB of progress, then waits for the event; each live run
    keeps 5 KB of events (16 MiB in earnest), so its first events are soon dropped."""
    release = trio.Event()

    @ta.define_tool(
        name="spam", description="spam", input_schema={"type": "object"}, side_effect="pure", kind="readonly"
    )
    async def spam(input: dict[str, Any], ctx: Any) -> str:
        for _ in range(20):
            await ctx.emit(ta.Progress("x" * 1000))
        await release.wait()
        return "spammed"

    def spamming(request: ta.ModelRequest) -> Reply:
        if isinstance(request.messages[-1], ta.ToolResultMessage):
            return Reply(text="done")
        return Reply(tool_calls=[("spam", {})])

    app = create_app(TestModel(respond=spamming), auth=local_only, tools=[spam], threads=tmp_path / "t.db")
    return app, release


async def until_its_first_events_are_dropped(app: Any, url: str) -> None:
    """Run r1 of thread t1 started by a client that then went away, once its first events are gone."""
    hub = app.state.agui.hub
    hub.run_bytes = 5_000
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("POST", "/runs", json=body("go", run="r1")) as response,
    ):
        assert (await read(response, until="RUN_STARTED"))[0]["type"] == "RUN_STARTED"  # and detaches
    with trio.fail_after(10):
        while hub._threads["t1"].live.first == 0:
            await trio.testing.wait_all_tasks_blocked()
            await trio.lowlevel.checkpoint()


async def test_a_run_whose_first_events_were_dropped_is_never_replayed_without_its_start(tmp_path: Path) -> None:
    # Posted again once the run had gone past the events a run keeps, the run was replayed from
    # the oldest kept: no RUN_STARTED (AG-UI's client refuses it), and a hole where its start was.
    app, release = spamming_app(tmp_path)
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        await until_its_first_events_are_dropped(app, url)
        async with client.stream("POST", "/runs", json=body("go", run="r1")) as response:  # a client coming back
            assert response.status_code == 200
            with trio.fail_after(10):  # its stream ends at once, the run going on
                (told,) = await read(response)
        assert told["type"] == "RUN_ERROR" and told["code"] == "fell_behind"  # AG-UI takes it as a first event
        assert "cannot be replayed from its start" in told["message"]
        # A view: the conversation as it is now (the run's own messages so far), then the same word.
        with trio.fail_after(10):
            snapshot, told_again = await view(client, "t1")
        assert [m["role"] for m in snapshot["messages"]] == ["user", "assistant"]  # the prompt, the tool call
        assert told_again == told
        release.set()
        hub = app.state.agui.hub
        with trio.fail_after(10):
            while hub._threads["t1"].busy:
                await trio.testing.wait_all_tasks_blocked()
                await trio.lowlevel.checkpoint()
        (ended,) = await view(client, "t1")
        assert [m["role"] for m in ended["messages"]] == ["user", "assistant", "tool", "assistant"]


async def test_a_thread_closing_to_make_room_is_reopened_and_one_in_use_is_not_closed(tmp_path: Path) -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")
    async with running(app) as client:
        hub = app.state.agui.hub
        hub.max_threads = 1
        async with client.stream("POST", "/runs", json=body(thread="a", run="a1")) as response:
            await read(response)
        first = hub._threads["a"]
        async with trio.open_nursery() as nursery:

            async def open_b() -> None:
                async with hub.use("b"):
                    pass

            nursery.start_soon(open_b)
            while not first.closing.is_set():  # b's request makes room: a's session starts closing
                await trio.lowlevel.checkpoint()
            async with hub.use("a") as again:  # a request for a now: a's session again, open
                assert first.closed.is_set() and again is not first
                with trio.fail_after(10):
                    assert await again.session.send("add 1 and 2") == "result: 3"
                await trio.testing.wait_all_tasks_blocked()  # b has opened meanwhile, over the limit ...
                assert not again.closing.is_set()  # ... and never closes a thread a request uses
        async with client.stream("POST", "/runs", json=body(thread="a", run="a2")) as response:
            assert (await read(response))[-1]["outcome"] == {"type": "success"}


async def test_answers_a_thread_cannot_keep_are_refused_before_the_stream(tmp_path: Path) -> None:
    app = asking_app(tmp_path)
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body()) as response:
            (interrupt,) = (await read(response))[-1]["outcome"]["interrupts"]

        def resume(value: str, run: str) -> bytes:
            payload = {"approved": True, "editedArgs": {"a": 1, "b": 2, "x": "__x__"}}
            answer = [{"interruptId": interrupt["id"], "status": "resolved", "payload": payload}]
            return json.dumps(body(run=run, resume=answer)).replace('"__x__"', value).encode()

        headers = {"content-type": "application/json"}
        huge = await client.post("/runs", content=resume("1e400", "r2"), headers=headers)
        assert huge.status_code == 422 and huge.json()["error"] == "invalid_input"
        assert huge.json()["problems"] == ["$.resume[0].payload.editedArgs.x: not a finite number (it reads as inf)"]
        deep = await client.post("/runs", content=resume("[" * 250 + "]" * 250, "r3"), headers=headers)
        assert deep.status_code == 422 and deep.json()["error"] == "invalid_answers"
        message = deep.json()["message"]
        assert "invalid_payload" in message and "nests containers deeper" in message
        async with client.stream("POST", "/runs", content=resume("[[1]]", "r4"), headers=headers) as response:
            assert (await read(response))[-1]["outcome"] == {"type": "success"}  # the thread still waited for them


async def test_a_thread_reads_an_approval_strictly_and_takes_edited_args_given_as_a_json_string(
    tmp_path: Path,
) -> None:
    app = asking_app(tmp_path)
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body()) as response:
            (interrupt,) = (await read(response))[-1]["outcome"]["interrupts"]

        def answer(payload: dict[str, Any], run: str) -> dict[str, Any]:
            return body(run=run, resume=[{"interruptId": interrupt["id"], "status": "resolved", "payload": payload}])

        refused = await client.post("/runs", json=answer({"approved": True, "editedArgs": ["a", 10]}, "r2"))
        assert refused.status_code == 422 and refused.json()["error"] == "invalid_answers"
        assert "invalid_edited_args" in refused.json()["message"]
        refused = await client.post("/runs", json=answer({"approved": "yes"}, "r3"))
        assert refused.status_code == 422 and "payload.approved must be true or false" in refused.json()["message"]
        edited = answer({"approved": True, "editedArgs": '{"a": 10, "b": 5}'}, "r4")
        async with client.stream("POST", "/runs", json=edited) as response:
            resumed = await read(response)  # the thread still waited: the refusals took nothing
        assert texts(resumed) == "result: 15"


async def test_a_run_whose_request_fails_ends_with_run_error_not_cancelled(tmp_path: Path) -> None:
    # A request that failed (a RequestAbortedError with reason "error", as a session raises for a
    # failure that is not one of ours) ended as RUN_FINISHED "cancelled", like a stop.
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")

    async def failing(session: Any, sink: Any, live: Any) -> None:
        raise ta.RequestAbortedError("the request failed: ValueError: it broke", reason="error")

    async with running(app):
        hub = app.state.agui.hub
        async with hub.use("t1") as thread:
            live = hub.start_run(thread, "t1", "r1", failing, lambda: None)
        with trio.fail_after(10):
            while not live.done:
                await live.changed()
    frames = live.since(0)
    assert frames is not None
    events = [json.loads(frame.decode()[len("data: ") :]) for frame in frames[0]]
    assert [e["type"] for e in events] == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["code"] == "run_failed" and "it broke" in events[-1]["message"]


async def test_a_run_that_fails_with_an_error_that_cannot_be_told_still_ends_with_run_error(tmp_path: Path) -> None:
    # Its RUN_ERROR took str(exc): a __str__ that raises left the run's stream without its end.
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("str boom")

        def __repr__(self) -> str:
            raise RuntimeError("repr boom")

    async def failing(session: Any, sink: Any, live: Any) -> None:
        raise Unprintable()

    async with running(app):
        hub = app.state.agui.hub
        async with hub.use("t1") as thread:
            live = hub.start_run(thread, "t1", "r1", failing, lambda: None)
        with trio.fail_after(10):
            while not live.done:
                await live.changed()
    frames = live.since(0)
    assert frames is not None
    events = [json.loads(frame.decode()[len("data: ") :]) for frame in frames[0]]
    assert [e["type"] for e in events] == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["message"] == "Unprintable (unprintable: its __str__ and __repr__ failed)"


async def test_a_thread_id_no_session_can_have_is_invalid_input_not_unavailable(tmp_path: Path) -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], threads=tmp_path / "t.db")
    async with running(app) as client:
        for bad in ("team/alpha", "a\nb", "x" * 201, "a\x85b", "a\u2028b", "a\u202eb"):
            reply = await client.post("/runs", json=body(thread=bad))
            assert reply.status_code == 422 and reply.json()["error"] == "invalid_input"
            assert reply.json()["problems"][0].startswith("$.threadId: ")
        async with client.stream("POST", "/runs", json=body(thread="x" * 200)) as response:
            assert (await read(response))[-1]["outcome"] == {"type": "success"}  # the longest a session id may be
        assert (await client.get("/threads/a%0Ab")).status_code == 404


async def test_the_chat_options_mean_the_same_with_threads(tmp_path: Path) -> None:
    # instructions= was handed to define_agent() as it was (a bare TypeError), and middleware=
    # meant define_agent's MiddlewareConfig (a list of chat middleware was a ConfigError).
    seen: list[Any] = []

    def answer(request: ta.ModelRequest) -> Reply:
        seen.append(request.messages[0])
        return Reply(text="hi")

    class Started(ChatMiddleware):
        async def on_start(self, ctx: Any) -> None:
            seen.append("started")

    class Calls(ta.ModelMiddleware):
        async def wrap_chat(self, request: Any, call_next: Any) -> Any:
            seen.append("model call")
            return await call_next(request)

        async def wrap_stream(self, request: Any, call_next: Any) -> Any:
            seen.append("model call")
            async for chunk in call_next(request):
                yield chunk

    app = create_app(
        TestModel(respond=answer),
        auth=local_only,
        threads=tmp_path / "t.db",
        instructions="Be brief.",
        middleware=[Started()],
        model_middleware=[Calls()],
    )
    async with running(app) as client, client.stream("POST", "/runs", json=body("hello")) as response:
        events = await read(response)
    assert events[-1]["type"] == "RUN_FINISHED" and texts(events) == "hi"
    assert seen == ["started", "model call", ta.SystemMessage("Be brief.")]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"metadata": {"team": "a"}}, r"metadata= applies only without threads="),
        ({"output_schema": {"type": "object"}}, r"output_schema= applies only without threads="),
        ({"system_prompt": "Be brief."}, r"system_prompt= is called instructions="),
        ({"lifecycle": []}, r"lifecycle= is called middleware="),
        ({"middleware": ta.MiddlewareConfig()}, r"a MiddlewareConfig's layers go in model_middleware="),
        ({"max_turn": 3}, r"max_turn= is not a chat option \(did you mean max_turns=\?\)"),
        ({"permission_asks": "handler"}, r'permission_asks= is "interrupt" for the threads\' agent'),
        ({"max_turns": 0}, r"max_turns"),
    ],
)
def test_create_app_with_threads_checks_its_chat_options(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ta.ConfigError, match=message):
        create_app(TestModel(respond=respond), auth=local_only, threads=tmp_path / "t.db", **options)


def test_an_agent_is_given_whole_and_only_with_threads(tmp_path: Path) -> None:
    # The chat options and tools were dropped unseen beside agent=, and agent= without threads was ignored.
    model = TestModel(respond=respond)
    agent = ta.define_agent(provider=model, tools=[add], permission_asks="interrupt")
    with pytest.raises(ta.ConfigError, match=r"give tools=, instructions= to its define_agent\(\)"):
        create_app(model, auth=local_only, threads=tmp_path / "t.db", agent=agent, tools=[add], instructions="x")
    with pytest.raises(ta.ConfigError, match="needs threads="):
        create_app(model, auth=local_only, agent=agent)
