"""The AG-UI endpoint (issue 15, part 2): a real Hypercorn server under Trio on loopback, read with
httpx the way a client would; every event checked against the AG-UI protocol's models."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from ag_ui.core import Event as AgUiEventModel
from pydantic import TypeAdapter

import trio_agent as ta
from tests.test_session import gated_tool
from trio_agent._web import _app, _serve
from trio_agent.agui import AgUiEncoder
from trio_agent.lifecycle import ChatMiddleware, TextMessageContent
from trio_agent.testing import Reply, TestModel
from trio_agent.web import InputError, bearer_token, create_app, local_only, parse_run_input, serve

EVENTS: TypeAdapter[Any] = TypeAdapter(AgUiEventModel)


@ta.define_tool(name="add", description="adds", input_schema={"type": "object"}, side_effect="pure", kind="readonly")
async def add(input: dict[str, Any], ctx: Any) -> int:
    return int(input["a"]) + int(input["b"])


def respond(request: ta.ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ta.ToolResultMessage):
        return Reply(text=f"result: {last.content}")
    if isinstance(last, ta.UserMessage) and last.content.startswith("slow"):
        return Reply(tool_calls=[("slow", {})])
    if isinstance(last, ta.UserMessage) and last.content.startswith("locate"):
        return Reply(tool_calls=[("where_am_i", {})])
    return Reply(tool_calls=[("add", {"a": 1, "b": 2})])


@asynccontextmanager
async def running(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(app, port=0, task_status=task_status))
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=50)
        async with httpx.AsyncClient(base_url=binds[0], limits=limits, timeout=30) as client:
            yield client
        nursery.cancel_scope.cancel()


def body(prompt: str = "add 1 and 2", *, thread: str = "t1", run: str = "r1", **more: Any) -> dict[str, Any]:
    return {"threadId": thread, "runId": run, "messages": [{"id": "u1", "role": "user", "content": prompt}], **more}


async def events_of(response: httpx.Response) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = json.loads(line[6:])
            EVENTS.validate_python(data)
            out.append(data)
    return out


async def post_run(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.stream("POST", "/runs", json=payload) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        return await events_of(response)


async def test_a_run_streams_its_ag_ui_events() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add])
    async with running(app) as client:
        events = await post_run(client, body())
    types = [e["type"] for e in events]
    assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED"
    assert events[0]["runId"] == "r1" and events[0]["threadId"] == "t1"
    assert [t for t in types if t.startswith("TOOL_CALL")] == [
        "TOOL_CALL_START",
        "TOOL_CALL_ARGS",
        "TOOL_CALL_END",
        "TOOL_CALL_RESULT",
    ]
    assert "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT") == "result: 3"
    assert events[-1]["outcome"] == {"type": "success"}


@pytest.mark.parametrize(
    ("send", "status", "code"),
    [
        ({"content": b"{", "headers": {"content-type": "application/json"}}, 400, "invalid_json"),
        ({"content": b"hello", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type"),
        ({"json": {"threadId": 5, "messages": [{"role": "wizard"}]}}, 422, "invalid_input"),
        ({"json": {"threadId": "t", "runId": "r", "messages": []}}, 422, "invalid_input"),
        ({"json": body(resume=[{"interruptId": "x", "status": "resolved"}])}, 409, "nothing_to_resume"),
        ({"json": body("x" * 5000)}, 413, "body_too_large"),
    ],
)
async def test_bad_input_is_an_http_error_naming_what_is_wrong(send: dict[str, Any], status: int, code: str) -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], max_body=4096)
    async with running(app) as client:
        response = await client.post("/runs", **send)
        assert response.status_code == status and response.json()["error"] == code
        if code == "invalid_input" and status == 422 and "wizard" in str(send):
            assert response.json()["problems"] == [
                "$.threadId: expected a non-empty string, got a number",
                "$.runId: missing",
                "$.messages[0].id: missing",
                "$.messages[0].role: unknown role 'wizard'",
            ]
        assert (await client.post("/runs/nope/abort")).status_code == 404
    assert app.state.agui.runs == {}


def test_every_typed_field_of_a_run_input_is_checked_not_only_the_ones_read() -> None:
    # toolCalls 0 / false / "" read as "no calls", a tool message's non-string error as "not an
    # error", and context and protocolVersion were never looked at.
    user = {"id": "u", "role": "user", "content": "hi"}
    given = {
        "threadId": "t",
        "runId": "r",
        "protocolVersion": 5,
        "context": [5, {"description": "d"}, {"description": "d", "value": 3}],
        "messages": [
            user,
            {"id": "a", "role": "assistant", "toolCalls": 0},
            {"id": "b", "role": "assistant", "toolCalls": ""},
            {"id": "c", "role": "tool", "toolCallId": "c1", "content": "x", "error": 5},
        ],
    }
    with pytest.raises(InputError) as caught:
        parse_run_input(given)
    assert caught.value.problems == (
        "$.protocolVersion: expected a non-empty string, got a number",
        "$.messages[1].toolCalls: expected a list, got a number",
        "$.messages[2].toolCalls: expected a list, got a string",
        "$.messages[3].error: expected a string (the error's text), got a number",
        "$.context[0]: expected an object {description, value}, got a number",
        "$.context[1].value: missing",
        "$.context[2].value: expected a string, got a number",
    )
    with pytest.raises(InputError, match=r"\$\.context: expected a list, got a string"):
        parse_run_input({**given, "context": "nope", "protocolVersion": "0.1", "messages": [user]})
    read = parse_run_input(
        {
            **given,
            "protocolVersion": "0.1",
            "context": [{"description": "the page", "value": "/home"}],
            "messages": [user, {"id": "c", "role": "tool", "toolCallId": "c1", "content": "x", "error": "boom"}],
        }
    )
    assert read.messages[1] == ta.ToolResultMessage("c1", "x", is_error=True)


async def test_auth_is_asked_for_every_request() -> None:
    app = create_app(TestModel(respond=respond), auth=bearer_token("s3cret"), tools=[add])
    async with running(app) as client:
        assert (await client.post("/runs", json=body())).status_code == 401
        assert (await client.post("/runs/r1/abort")).status_code == 401
        headers = {"authorization": "Bearer s3cret"}
        async with client.stream("POST", "/runs", json=body(), headers=headers) as response:
            assert response.status_code == 200 and (await events_of(response))[-1]["type"] == "RUN_FINISHED"
    with pytest.raises(TypeError, match="auth="):
        create_app(TestModel(respond=respond), auth=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("header", "served"),
    [
        (b"Bearer s3cret-~!", True),
        (b"bearer s3cret-~!", True),  # RFC 7235: the scheme is case-insensitive
        (b"BEARER   s3cret-~!", True),
        (b"Basic s3cret-~!", False),
        (b"Bearer s3cret-~", False),
        (b"Bearer s3cret-~!!", False),
        (b"s3cret-~!", False),
        (b"", False),
        (b"Bearer s3cr\xe9t-~!", False),
        (b"Bearer s3cret-~!\xc3\xa9", False),
    ],
)
def test_a_bearer_token_is_matched_byte_for_byte_with_the_scheme_in_any_case(header: bytes, served: bool) -> None:
    from starlette.requests import Request

    request = Request({"type": "http", "headers": [(b"authorization", header)] if header else [], "method": "POST"})
    assert bearer_token("s3cret-~!")(request) is served


@pytest.mark.parametrize("secret", ["", "pässwort", "tök", "two words", "tab\there", "line\n"])
def test_a_bearer_token_that_no_header_could_carry_as_sent_is_refused(secret: str) -> None:
    # A secret above U+00FF could never match (header bytes are read as Latin-1, the secret was
    # encoded as UTF-8), one in Latin-1 only in that encoding: neither could be relied on.
    with pytest.raises(ta.ConfigError, match="token"):
        bearer_token(secret)


def test_serve_refuses_a_token_no_client_could_send(capsys: pytest.CaptureFixture[str]) -> None:
    from trio_agent.__main__ import main

    # Refused before anything is bound (this address could not be: a serve that took the token
    # would end with status 1, not hang the test).
    assert main(["serve", "--token", "pässwort", "--host", "256.0.0.1"]) == 2
    assert "visible ASCII" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("keep_alive", 0),
        ("keep_alive", -1),
        ("keep_alive", float("nan")),
        ("keep_alive", float("inf")),
        ("keep_alive", "15"),
        ("buffer", -1),
        ("buffer", "64"),
        ("buffer", 1.5),
        ("buffer", True),
        ("max_body", 0),
        ("max_body", "x"),
        ("body_timeout", 0),
        ("body_timeout", float("inf")),
        ("max_paused", 0),
        ("max_paused", None),
    ],
)
def test_create_app_refuses_options_no_request_could_be_served_with(option: str, value: Any) -> None:
    # They were taken as given and broke every request at serve time, after its 200: a stream cut
    # with no end event, a bare 500, keep-alive comments flooding, every pause unresumable.
    with pytest.raises(ta.ConfigError, match=f"^{option} must be"):
        create_app(TestModel(respond=respond), auth=local_only, **{option: value})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"instrucions": "Be brief."}, r"instrucions= is not a chat option \(did you mean instructions=\?\)"),
        ({"max_turns": 3}, r"max_turns= applies only with threads="),
        ({"system_prompt": "Be brief."}, r"system_prompt= is called instructions="),
        ({"lifecycle": [ChatMiddleware()]}, r"lifecycle= is called middleware="),
        ({"resume": None}, r"resume= is set by create_app\(\) for each run itself"),
        ({"middleware": ta.MiddlewareConfig()}, r"a MiddlewareConfig's layers go in model_middleware="),
        ({"instructions": 3}, r"^instructions must be a string"),
        ({"metadata": [("team", "a")]}, r"^metadata must be a mapping"),
        ({"strategy": "fast"}, r"^strategy must be a LoopStrategy"),
        ({"output_schema": {"type": 3}}, r"^output_schema: not valid JSON Schema"),
        ({"permission_mode": "relaxed"}, r"^permission mode must be one of"),
        ({"cleanup_grace": -1}, r"^cleanup_grace must be"),
        ({"model_middleware": [object()]}, r"model_middleware"),
    ],
)
def test_create_app_checks_its_chat_options_before_any_request(options: dict[str, Any], message: str) -> None:
    # They went to chat() as given at serve time: a misspelt name or a bad value was a 200, then a
    # RUN_ERROR ("chat() got an unexpected keyword argument ..."), for every request.
    with pytest.raises(ta.ConfigError, match=message):
        create_app(TestModel(respond=respond), auth=local_only, tools=[add], **options)


async def test_the_chat_options_reach_each_run() -> None:
    seen: list[Any] = []

    def answer(request: ta.ModelRequest) -> Reply:
        seen.append(request.messages[0])
        return Reply(text="hi")

    class Started(ChatMiddleware):
        async def on_start(self, ctx: Any) -> None:
            seen.append("started")

    app = create_app(TestModel(respond=answer), auth=local_only, instructions="Be brief.", middleware=[Started()])
    async with running(app) as client:
        events = await post_run(client, body("hello"))
    assert events[-1]["type"] == "RUN_FINISHED"
    assert seen == ["started", ta.SystemMessage("Be brief.")]


async def test_the_smallest_options_serve_a_run() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], buffer=0, max_paused=1, keep_alive=0.5)
    async with running(app) as client, client.stream("POST", "/runs", json=body()) as response:
        assert (await events_of(response))[-1]["outcome"] == {"type": "success"}


async def test_a_paused_run_resumes_once_with_the_answers() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], permissions={"ask": ["add"]})
    async with running(app) as client:
        paused = await post_run(client, body())
        finished = paused[-1]
        assert finished["outcome"]["type"] == "interrupt" and "TOOL_CALL_RESULT" not in [e["type"] for e in paused]
        (interrupt,) = finished["outcome"]["interrupts"]
        wrong = body(run="r2", resume=[{"interruptId": "nope", "status": "resolved", "payload": {"approved": True}}])
        refused = await client.post("/runs", json=wrong)
        assert refused.status_code == 422 and refused.json()["error"] == "invalid_answers"
        answer = [{"interruptId": interrupt["id"], "status": "resolved", "payload": {"approved": True}}]
        resumed = await post_run(client, body(run="r2", resume=answer))
        assert resumed[0]["type"] == "RUN_STARTED" and resumed[-1]["outcome"] == {"type": "success"}
        result = next(e for e in resumed if e["type"] == "TOOL_CALL_RESULT")
        assert result["toolCallId"] == interrupt["toolCallId"] and result["content"] == "3"
        again = await client.post("/runs", json=body(run="r3", resume=answer))
        assert again.status_code == 409 and again.json()["error"] == "nothing_to_resume"  # accepted once


async def test_an_approval_is_read_strictly_and_edited_args_as_a_json_string_are_the_edit() -> None:
    # editedArgs as a JSON string (how AG-UI carries a tool call's arguments) or a list was dropped:
    # the call ran with the model's own input. approved "true" (a string) was taken as a rejection.
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], permissions={"ask": ["add"]})
    async with running(app) as client:
        (interrupt,) = (await post_run(client, body()))[-1]["outcome"]["interrupts"]

        def answer(payload: dict[str, Any], run: str) -> dict[str, Any]:
            return body(run=run, resume=[{"interruptId": interrupt["id"], "status": "resolved", "payload": payload}])

        for index, (payload, problem) in enumerate(
            [
                ({"approved": True, "editedArgs": ["a", 10]}, "payload.editedArgs must be a JSON object"),
                ({"approved": True, "editedArgs": "[10, 5]"}, "its string holds an array"),
                ({"approved": True, "editedArgs": '{"a": NaN}'}, "a string that is not valid: NaN is not"),
                # read as the model's arguments are: 1e999 became inf (refused later, not as the
                # edit), and nesting had no limit but the interpreter's
                ({"approved": True, "editedArgs": '{"a": 1e999}'}, "a string that is not valid: the number 1e999"),
                ({"approved": True, "editedArgs": "[" * 100 + "]" * 100}, "a string that is nested more than"),
                ({"approved": "true"}, "payload.approved must be true or false, got a string"),
                ({"editedArgs": {"a": 10, "b": 5}}, "payload.approved must be true or false, got null"),
                ({"approved": False, "message": 5}, "payload.message must be a string, got a number"),
            ]
        ):
            refused = await client.post("/runs", json=answer(payload, f"x{index}"))
            assert refused.status_code == 422 and refused.json()["error"] == "invalid_answers", payload
            (said,) = refused.json()["problems"]
            assert problem in said, (payload, said)
        resumed = await post_run(client, answer({"approved": True, "editedArgs": '{"a": 10, "b": 5}'}, "r2"))
        result = next(e for e in resumed if e["type"] == "TOOL_CALL_RESULT")
        assert result["content"] == "15"  # the edit ran, not the model's {"a": 1, "b": 2}


class EmitsOnStart(ChatMiddleware):
    """Emits a custom event in ``on_start``: before the run's ``RunStarted``."""

    def __init__(self, value: object) -> None:
        self.value = value

    async def on_start(self, ctx: Any) -> None:
        await ctx.emit_custom("progress", self.value)


async def test_a_custom_value_that_contains_itself_or_nests_deeply_is_written_and_the_stream_starts_right() -> None:
    # json_value recursed without end on such a value: the stream broke with no event at all and
    # the client waited for ever. And a custom event from on_start came before RUN_STARTED.
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    deep: Any = "leaf"
    for _ in range(2000):
        deep = {"k": deep}
    value = {"tree": cyclic, "deep": deep}
    app = create_app(TestModel(default=Reply(text="hi")), auth=local_only, middleware=[EmitsOnStart(value)])
    async with running(app) as client:
        with trio.fail_after(10):
            events = await post_run(client, body())
    assert [e["type"] for e in events[:2]] == ["RUN_STARTED", "CUSTOM"] and events[-1]["type"] == "RUN_FINISHED"
    written = events[1]["value"]
    assert written["tree"] == ["[[...]]"]  # itself, where it comes round again: its str
    cut = written["deep"]
    for _ in range(199):
        cut = cut["k"]
    assert cut == "<dict nested more than 200 levels deep>"


async def test_a_custom_value_holding_an_int_too_long_to_print_is_written_and_the_run_goes_on() -> None:
    # json.dumps refused it (past the interpreter's int-to-text limit): the run failed at its first event.
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(4300)
    try:
        app = create_app(TestModel(default=Reply(text="hi")), auth=local_only, middleware=[EmitsOnStart(10**5000)])
        async with running(app) as client:
            events = await post_run(client, body())
    finally:
        sys.set_int_max_str_digits(limit)
    assert events[1] == {"type": "CUSTOM", "name": "progress", "value": "<int with more than 4300 digits>"}
    assert ends_once(events)["outcome"] == {"type": "success"}


async def test_a_failure_to_write_an_event_is_one_run_error_and_the_stream_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only our own errors were caught: any other (an encoder's) escaped the response, which sent
    # no end, and the client waited for ever.
    class Broken(AgUiEncoder):
        def wire(self, event: Any) -> list[dict[str, Any]]:
            if isinstance(event, TextMessageContent):
                raise RuntimeError("cannot write this")
            return super().wire(event)

    monkeypatch.setattr(_app, "AgUiEncoder", Broken)
    app = create_app(TestModel(default=Reply(text="hi there")), auth=local_only)
    async with running(app) as client:
        with trio.fail_after(10):
            events = await post_run(client, body())
    assert events[0]["type"] == "RUN_STARTED"
    assert [e["type"] for e in events].count("RUN_ERROR") == 1 and events[-1]["type"] == "RUN_ERROR"
    assert events[-1]["code"] == "run_failed" and "RuntimeError: cannot write this" in events[-1]["message"]
    assert app.state.agui.runs == {}


async def test_a_failure_that_cannot_be_told_is_still_one_run_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its message was built with f"{failure}": a __str__ that raises escaped the response unended.
    # (Its repr must work: trio formats an exception that leaves a nursery's body with it.)
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("str boom")

    class Broken(AgUiEncoder):
        def wire(self, event: Any) -> list[dict[str, Any]]:
            if isinstance(event, TextMessageContent):
                raise Unprintable()
            return super().wire(event)

    monkeypatch.setattr(_app, "AgUiEncoder", Broken)
    app = create_app(TestModel(default=Reply(text="hi there")), auth=local_only)
    async with running(app) as client:
        with trio.fail_after(10):
            events = await post_run(client, body())
    assert [e["type"] for e in events].count("RUN_ERROR") == 1 and events[-1]["type"] == "RUN_ERROR"
    assert events[-1]["message"] == "the run failed: Unprintable()"


class AfterTheEnd(ChatMiddleware):
    """Emits from ``on_finish`` / ``on_error`` and a deferred function (after the loop's end event);
    with ``fail``, its ``on_finish`` raises after emitting."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail

    async def on_start(self, ctx: Any) -> None:
        async def flush() -> None:
            await ctx.emit_custom("flushed", 1)

        ctx.defer(flush)

    async def on_finish(self, ctx: Any, *args: Any) -> None:
        await ctx.emit_custom("finished", 2)
        if self.fail:
            raise RuntimeError("metrics backend down")

    async def on_error(self, ctx: Any, *args: Any) -> None:
        await ctx.emit_custom("failed", 3)


def ends_once(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The stream's terminal event, checked to be its one and last (AG-UI refuses anything after it)."""
    terminal = [index for index, e in enumerate(events) if e["type"] in ("RUN_FINISHED", "RUN_ERROR")]
    assert terminal == [len(events) - 1], [e["type"] for e in events]
    return events[-1]


@pytest.mark.parametrize(
    ("model", "end", "customs"),
    [
        (TestModel(default=Reply(text="hi")), "RUN_FINISHED", ["finished", "flushed"]),
        (TestModel(default=Reply(error=ta.ModelError("down", retryable=False))), "RUN_ERROR", ["failed", "flushed"]),
        (TestModel(respond=respond), "RUN_FINISHED", ["flushed"]),  # a pause: no terminal hook
    ],
)
async def test_what_a_run_emits_after_its_end_comes_before_its_terminal_event(
    model: TestModel, end: str, customs: list[str]
) -> None:
    # It was written after RUN_FINISHED / RUN_ERROR, and an AG-UI client refuses the stream there.
    app = create_app(model, auth=local_only, tools=[add], permissions={"ask": ["add"]}, middleware=[AfterTheEnd()])
    async with running(app) as client:
        events = await post_run(client, body())
    assert ends_once(events)["type"] == end
    assert [e["name"] for e in events if e["type"] == "CUSTOM"] == customs


async def test_an_error_after_the_runs_end_is_logged_not_a_second_terminal_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An on_finish that raised (run.result() raises it) came as a RUN_ERROR after RUN_FINISHED.
    app = create_app(TestModel(default=Reply(text="hi")), auth=local_only, middleware=[AfterTheEnd(fail=True)])
    async with running(app) as client:
        events = await post_run(client, body())
    finished = ends_once(events)
    assert finished["type"] == "RUN_FINISHED" and finished["outcome"] == {"type": "success"}
    assert finished["result"]["text"] == "hi"
    (logged,) = [r for r in caplog.records if r.name == "trio_agent.web"]
    assert logged.levelname == "WARNING" and "failed after it finished" in logged.getMessage()
    assert "metrics backend down" in logged.getMessage()


async def test_a_pause_is_kept_before_its_run_finished_reaches_the_client() -> None:
    # The pause was kept only after the run's last deferred function: a client answering as soon
    # as it read RUN_FINISHED (as the page does a client tool) got 409 nothing_to_resume.
    flushing, release = trio.Event(), trio.Event()

    class Deferring(ChatMiddleware):
        async def on_start(self, ctx: Any) -> None:
            async def flush() -> None:  # telemetry flushed once the run ended
                flushing.set()
                await release.wait()

            ctx.defer(flush)

    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], middleware=[Deferring()])
    tool = {"name": "where_am_i", "parameters": {"type": "object"}}
    answered: list[list[dict[str, Any]]] = []
    async with running(app) as client, trio.open_nursery() as nursery:

        async def release_once_all_wait() -> None:
            await flushing.wait()
            await trio.testing.wait_all_tasks_blocked()  # the client read whatever it was sent
            release.set()

        nursery.start_soon(release_once_all_wait)
        async with client.stream("POST", "/runs", json=body("locate me", tools=[tool])) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"RUN_FINISHED"' in line:
                    assert "t1" in app.state.agui.paused
                    (interrupt,) = json.loads(line[6:])["outcome"]["interrupts"]
                    answer = [{"interruptId": interrupt["id"], "status": "resolved", "payload": "Lisbon"}]
                    answered.append(await post_run(client, body(run="r2", tools=[tool], resume=answer)))
    (resumed,) = answered
    assert "".join(e["delta"] for e in resumed if e["type"] == "TEXT_MESSAGE_CONTENT") == "result: Lisbon"


async def test_a_client_tool_pauses_the_run_for_its_output() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add])
    tool = {"name": "where_am_i", "description": "the browser's location", "parameters": {"type": "object"}}
    async with running(app) as client:
        paused = await post_run(client, body("locate me", tools=[tool]))
        (interrupt,) = paused[-1]["outcome"]["interrupts"]
        assert interrupt["metadata"]["kind"] == "client_tool" and interrupt["metadata"]["toolName"] == "where_am_i"
        answer = [{"interruptId": interrupt["id"], "status": "resolved", "payload": "Lisbon"}]
        resumed = await post_run(client, body(run="r2", tools=[tool], resume=answer))
        assert "".join(e["delta"] for e in resumed if e["type"] == "TEXT_MESSAGE_CONTENT") == "result: Lisbon"


async def test_a_client_that_disconnects_aborts_its_run() -> None:
    log: list[str] = []
    slow, started, _release = gated_tool("slow", log=log)
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow])
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body("slow please")) as response:
            with trio.CancelScope() as reading:  # a cancel, not a break: httpx's generators unwind
                async for line in response.aiter_lines():
                    if "TOOL_CALL_END" in line:
                        reading.cancel()
            with trio.fail_after(10):
                await started.wait()
        # Leaving the block closed the connection: the server aborts the run it was serving.
        with trio.fail_after(10):
            while app.state.agui.runs:
                await trio.testing.wait_all_tasks_blocked()
                await trio.lowlevel.checkpoint()
    assert log == ["slow:cancelled"]


async def test_the_stop_endpoint_aborts_a_running_run() -> None:
    slow, started, _release = gated_tool("slow")
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow])
    async with running(app) as client, client.stream("POST", "/runs", json=body("slow please", run="stop-me")) as reply:
        events: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:

            async def stop_when_started() -> None:
                await started.wait()
                stopped = await client.post("/runs/stop-me/abort")
                assert stopped.status_code == 202 and stopped.json() == {"aborted": True}

            nursery.start_soon(stop_when_started)
            events = await events_of(reply)
    assert events[-1]["type"] == "RUN_FINISHED" and events[-1]["outcome"] == {"type": "cancelled"}


async def test_a_thread_runs_one_run_at_a_time_so_no_pause_replaces_another() -> None:
    # Two runs on one thread both ran; when both paused, the second pause silently replaced the
    # first in the thread's slot, and the first client got an interrupt nobody could answer.
    slow, started, release = gated_tool("slow")
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow, add], permissions={"ask": ["add"]})
    async with running(app) as client, client.stream("POST", "/runs", json=body("slow please", run="a")) as first:
        with trio.fail_after(10):
            await started.wait()
        refused = await client.post("/runs", json=body(run="b"))
        assert refused.status_code == 409 and refused.json()["error"] == "run_in_progress"
        assert "'a'" in refused.json()["message"]
        other = await post_run(client, body(thread="t2", run="c"))  # another thread is not held up
        assert other[-1]["outcome"]["type"] == "interrupt"
        release.set()
        assert (await events_of(first))[-1]["outcome"] == {"type": "success"}
        paused = await post_run(client, body(run="b"))  # the thread is free again once its run ended
        (interrupt,) = paused[-1]["outcome"]["interrupts"]
        answer = [{"interruptId": interrupt["id"], "status": "resolved", "payload": {"approved": True}}]
        assert (await post_run(client, body(run="b2", resume=answer)))[-1]["outcome"] == {"type": "success"}
    assert app.state.agui.thread_runs == {} and app.state.agui.runs == {}


async def test_an_idle_stream_gets_keep_alive_comments() -> None:
    slow, started, release = gated_tool("slow")
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[slow], keep_alive=0.05)
    async with running(app) as client:
        async with client.stream("POST", "/runs", json=body("slow please")) as response:
            seen: list[str] = []
            async for line in response.aiter_lines():
                seen.append(line)
                if line == ": keep-alive":
                    release.set()  # the tool was idle long enough for a keep-alive: let it finish
        assert started.is_set() and any(line.startswith("data: ") and "RUN_FINISHED" in line for line in seen)


async def test_two_hundred_concurrent_clients() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add])
    results: dict[int, list[dict[str, Any]]] = {}
    async with running(app) as client:

        async def one(index: int) -> None:
            results[index] = await post_run(client, body(thread=f"t{index}", run=f"r{index}"))

        async with trio.open_nursery() as nursery:
            for index in range(200):
                nursery.start_soon(one, index)
    assert len(results) == 200
    for index, events in results.items():
        assert events[0]["runId"] == f"r{index}" and events[-1]["outcome"] == {"type": "success"}
        assert "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT") == "result: 3"


def test_serve_refuses_to_be_open_by_accident(capsys: pytest.CaptureFixture[str]) -> None:
    from trio_agent.__main__ import main

    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "needs --token" in capsys.readouterr().err
    assert main(["serve", "--provider", "openai"]) == 2
    assert "--model is required" in capsys.readouterr().err


async def test_a_client_that_never_reads_holds_the_run_back_not_the_memory() -> None:
    produced = [0]

    class Count(ChatMiddleware):
        def on_chunk(self, ctx: Any, event: Any) -> None:
            if isinstance(event, TextMessageContent):
                produced[0] += 1

    chunks, size = 2_000, 8_000  # 16 MB of text: more than the socket buffers between us hold
    model = TestModel(default=Reply(text=" ".join(["x" * size] * chunks)))
    app = create_app(model, auth=local_only, middleware=[Count()], buffer=4)
    async with running(app) as client, client.stream("POST", "/runs", json=body()) as response:
        assert response.status_code == 200
        # Nobody reads: once everything is blocked, the run waits behind the full socket and channel.
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        held = produced[0]
        assert app.state.agui.runs and held < chunks // 2, held
        events = await events_of(response)  # now read it all: the run goes on to its end
    assert produced[0] == chunks and events[-1]["type"] == "RUN_FINISHED"
    assert sum(len(e["delta"]) for e in events if e["type"] == "TEXT_MESSAGE_CONTENT") == chunks * size + chunks - 1


class _Produced(ChatMiddleware):
    """Counts the text chunks the run produced, and says when it was aborted."""

    def __init__(self) -> None:
        self.count = 0
        self.aborted = trio.Event()

    def on_chunk(self, ctx: Any, event: Any) -> None:
        if isinstance(event, TextMessageContent):
            self.count += 1

    def on_abort(self, ctx: Any, info: Any) -> None:
        self.aborted.set()


def _a_long_answer(chunks: int = 2_000, size: int = 8_000) -> TestModel:
    """16 MB of text: more than the socket buffers between a server and a client hold."""
    return TestModel(default=Reply(text=" ".join(["x" * size] * chunks)))


async def _a_client_that_stops_reading(url: str, payload: dict[str, Any]) -> trio.SocketStream:
    """A connection that posts a run and then reads nothing (it stays open)."""
    address = httpx.URL(url)
    assert address.host is not None and address.port is not None
    stream = await trio.open_tcp_stream(address.host, address.port)
    data = json.dumps(payload).encode()
    head = f"POST /runs HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {len(data)}"
    await stream.send_all(head.encode() + b"\r\n\r\n" + data)
    return stream


async def _until_its_writes_stall(app: Any, produced: _Produced) -> None:
    with trio.fail_after(10):
        while not app.state.agui.runs:
            await trio.testing.wait_all_tasks_blocked()
            await trio.lowlevel.checkpoint()
    # Once everything is blocked, the run waits behind the full channel and the write behind the socket.
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    assert app.state.agui.runs and 0 < produced.count < 1_000, produced.count


@pytest.mark.parametrize("stop", ["cancelled", "shut_down"])
async def test_serve_ends_when_asked_though_a_client_stopped_reading(
    monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    # Hypercorn writes in a shielded scope with no bound: a client that stopped reading (its
    # connection left open) held the write, and serve with it, cancelled or shut down, until
    # the client went away. Cancelled, serve closes every connection at once; shut down, after
    # the grace it gives responses in progress.
    monkeypatch.setattr(_serve, "GRACEFUL_TIMEOUT", 0.05)
    produced = _Produced()
    app = create_app(_a_long_answer(), auth=local_only, middleware=[produced], buffer=4)
    shutdown, ended = trio.Event(), trio.Event()
    serving = trio.CancelScope()

    async def run_server(task_status: trio.TaskStatus[list[str]]) -> None:
        with serving:
            await serve(app, port=0, shutdown_trigger=shutdown.wait, task_status=task_status)
        ended.set()

    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(run_server)
        client = await _a_client_that_stops_reading(url, body())
        try:
            await _until_its_writes_stall(app, produced)
            if stop == "cancelled":
                serving.cancel()
            else:
                shutdown.set()
            with trio.move_on_after(10):
                await ended.wait()
            stopped = ended.is_set()
        finally:
            await client.aclose()  # (without the fix, only this let serve end)
    assert stopped, "serve waited for a client that stopped reading"
    assert app.state.agui.runs == {}  # its run was aborted, as for a disconnect


@pytest.mark.parametrize("write_timeout", [0, -1.0, float("nan"), float("inf"), "30"])
async def test_serve_refuses_a_write_timeout_that_is_no_bound(write_timeout: Any) -> None:
    app = create_app(TestModel(respond=respond), auth=local_only)
    with pytest.raises(ta.ConfigError, match="write_timeout"):
        await serve(app, port=0, write_timeout=write_timeout)


async def test_a_client_that_takes_nothing_for_write_timeout_is_let_go_and_its_run_aborted() -> None:
    produced = _Produced()
    app = create_app(_a_long_answer(), auth=local_only, middleware=[produced], buffer=4)
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(functools.partial(serve, app, port=0, write_timeout=0.2))
        async with await _a_client_that_stops_reading(url, body()) as client:
            await _until_its_writes_stall(app, produced)
            with trio.fail_after(10):  # 0.2 s after its write stalled, the server closed the connection
                await produced.aborted.wait()  # and its run was aborted, as for a disconnect
                received = b""
                with contextlib.suppress(trio.BrokenResourceError):  # (a reset, once we read what was sent)
                    while chunk := await client.receive_some():
                        received += chunk
                while app.state.agui.runs:  # and its response has ended
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.lowlevel.checkpoint()
        assert received.startswith(b"HTTP/1.1 200") and b"RUN_FINISHED" not in received
        assert produced.count < 2_000  # it never ran to its end
        nursery.cancel_scope.cancel()


async def test_a_client_that_sends_garbage_or_leaves_mid_body_breaks_nothing() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add])
    async with running(app) as client:
        url = httpx.URL(str(client.base_url))
        assert url.host is not None and url.port is not None
        head = b"POST /runs HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n"
        for sent in (b"\x00\x01\x02 this is not HTTP\r\n\r\n", head + b'{"threadId": "t", "runI'):
            stream = await trio.open_tcp_stream(url.host, url.port)
            async with stream:
                await stream.send_all(sent)
                if sent.startswith(b"POST"):
                    await stream.send_eof()  # the client leaves in the middle of its body
                with trio.fail_after(10):
                    reply = b""
                    while chunk := await stream.receive_some():
                        reply += chunk
            assert not reply or reply.startswith(b"HTTP/1.1 4"), reply[:200]
        assert app.state.agui.runs == {}
        events = await post_run(client, body())  # the server goes on serving
        assert events[-1]["outcome"] == {"type": "success"}


async def test_a_body_that_stalls_is_a_408_and_its_connection_is_let_go() -> None:
    # A request whose body never came held its connection and its task for ever: Hypercorn bounds
    # only the headers, and nothing bounded the body.
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], body_timeout=0.2)
    async with running(app) as client:
        url = httpx.URL(str(client.base_url))
        assert url.host is not None and url.port is not None
        head = (
            b"POST /runs HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
        )
        stream = await trio.open_tcp_stream(url.host, url.port)
        async with stream:
            await stream.send_all(head + b'{"threadId"')  # and then nothing more
            with trio.fail_after(10):
                reply = b""
                while chunk := await stream.receive_some():  # to the end: the server closes it
                    reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"] == "body_timeout"
        assert app.state.agui.runs == {}
        events = await post_run(client, body())  # a body that comes in time is served
        assert events[-1]["outcome"] == {"type": "success"}


def scope_of(peer: str, host: str, origin: str | None = None) -> Any:
    from starlette.requests import Request

    headers = [(b"host", host.encode())] + ([(b"origin", origin.encode())] if origin else [])
    return Request({"type": "http", "client": (peer, 1234), "headers": headers, "method": "POST", "path": "/"})


@pytest.mark.parametrize(
    ("peer", "host", "origin", "served"),
    [
        ("127.0.0.1", "127.0.0.1:8000", None, True),
        ("::1", "[::1]:8000", "http://[::1]:8000", True),
        ("127.0.0.1", "localhost:8000", "http://localhost:8000", True),
        ("127.0.0.1", "evil.example:8000", None, False),  # a name rebound to 127.0.0.1
        ("127.0.0.1", "127.0.0.1:8000", "http://evil.example", False),  # a page elsewhere
        ("::1234:5678", "[::1]:8000", None, False),  # starts like ::1, is not loopback
        ("10.0.0.5", "127.0.0.1:8000", None, False),
    ],
)
def test_local_only_serves_loopback_names_and_pages_only(
    peer: str, host: str, origin: str | None, served: bool
) -> None:
    assert local_only(scope_of(peer, host, origin)) is served


async def test_json_that_nests_too_deep_or_is_not_json_is_a_400_and_ids_are_checked() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], max_body=1_000_000)
    async with running(app) as client:
        for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"threadId": NaN}'):
            reply = await client.post("/runs", content=raw, headers={"content-type": "application/json"})
            assert reply.status_code == 400 and reply.json()["error"] == "invalid_json"
        for bad in ("t\x00", "x" * 300):
            reply = await client.post("/runs", json=body(thread=bad))
            assert reply.status_code == 422 and reply.json()["problems"][0].startswith("$.threadId")


async def test_ids_follow_the_session_id_rules_so_every_run_can_be_addressed() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add])
    async with running(app) as client:
        # 'run/1' could never be stopped: /runs/{run_id}/abort does not match a '/'.
        # '.' and '..' could never be reached either: a URL client removes such a path segment.
        ids = [("run", "run/1"), ("run", "r\n1"), ("thread", "team/alpha"), ("thread", "x" * 201)]
        ids += [(key, dots) for key in ("run", "thread") for dots in (".", "..")]
        for key, bad in ids:
            reply = await client.post("/runs", json=body(**{key: bad}))
            field = "$.runId" if key == "run" else "$.threadId"
            assert reply.status_code == 422 and reply.json()["error"] == "invalid_input"
            assert reply.json()["problems"][0].startswith(f"{field}: ") and "must" in reply.json()["problems"][0]
        events = await post_run(client, body(run="...", thread="t."))  # only the dot segments are refused
        assert events[0]["runId"] == "..." and events[-1]["outcome"] == {"type": "success"}


def call(call_id: str, name: str = "add") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


USER = {"id": "u1", "role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"tools": [{"name": "x"}, {"name": "y"}, {"name": "x"}]}, "$.tools[2].name: 'x' is the name of $.tools[0]"),
        (
            {"messages": [USER, {"id": "t", "role": "tool", "toolCallId": "nope", "content": "x"}, USER]},
            "$.messages[1]: this message answers tool call 'nope', which is not an unanswered call",
        ),
        (
            {
                "messages": [
                    USER,
                    {"id": "a", "role": "assistant", "toolCalls": [call("c1"), call("c1")]},
                    {"id": "t", "role": "tool", "toolCallId": "c1", "content": "x"},
                    USER,
                ]
            },
            "$.messages[1]: tool call id 'c1' is used twice",
        ),
        (
            {
                "messages": [
                    {"id": "r", "role": "reasoning", "content": "hm"},  # left out: the paths still count it
                    USER,
                    {"id": "a", "role": "assistant", "toolCalls": [call("c1")]},
                    USER,
                ]
            },
            "$.messages[3]: tool call(s) 'c1' of the assistant message before it are not answered",
        ),
        ({"messages": [USER, {"id": "a", "role": "assistant", "toolCalls": [call("c1")]}]}, "$.messages[1]: tool call"),
        ({"messages": [{"id": "s", "role": "system", "content": "be nice"}, USER]}, "$.messages[0]: this message is"),
    ],
)
async def test_client_input_a_run_would_refuse_is_a_422_before_the_stream(change: dict[str, Any], problem: str) -> None:
    # These passed the door and failed the run once streaming: a 200 with RUN_ERROR run_failed.
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add])
    async with running(app) as client:
        refused = await client.post("/runs", json={**body(), **change})
        assert refused.status_code == 422 and refused.json()["error"] == "invalid_input"
        (said,) = refused.json()["problems"]
        assert said.startswith(problem), said
        events = await post_run(client, body())  # the same runId: nothing of it was taken
        assert events[-1]["outcome"] == {"type": "success"}
    assert app.state.agui.runs == {}


async def test_a_number_that_is_not_finite_is_refused_with_its_path() -> None:
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add])
    async with running(app) as client:
        # 1e400 is JSON, but too large for a float: it reads as infinity, which nothing downstream can take.
        raw = json.dumps(body(state={"limits": [1, "__big__"]})).replace('"__big__"', "-1e400")
        reply = await client.post("/runs", content=raw, headers={"content-type": "application/json"})
        assert reply.status_code == 422 and reply.json()["error"] == "invalid_input"
        assert reply.json()["problems"] == ["$.state.limits[1]: not a finite number (it reads as -inf)"]


async def test_paused_runs_are_kept_within_a_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_app, "PAUSED_BYTES", 3_000)
    app = create_app(TestModel(respond=respond), auth=local_only, tools=[add], permissions={"ask": ["add"]})
    async with running(app) as client:
        for index in range(6):
            events = await post_run(client, body("add " + "padding " * 50, thread=f"t{index}", run=f"r{index}"))
            assert events[-1]["outcome"]["type"] == "interrupt"
    kept = app.state.agui.paused
    assert 0 < len(kept) < 6 and app.state.agui.paused_bytes <= 3_000
    assert list(kept) == [f"t{index}" for index in range(6 - len(kept), 6)]  # the oldest went first


async def test_with_a_token_the_page_is_served_and_the_endpoints_ask_for_it() -> None:
    app = create_app(TestModel(respond=respond), auth=bearer_token("s3cret"), tools=[add])
    async with running(app) as client:
        page = await client.get("/")
        assert page.status_code == 200 and "static/app.js" in page.text
        script = await client.get("/static/app.js")
        assert script.status_code == 200 and "Authorization" in script.text
        assert (await client.post("/runs", json=body())).status_code == 401


@pytest.mark.parametrize("token", ["s3cret", "a+b", "x&token=y", "100%", "p=q#r", "~!$'()*,;:@/?"])
def test_the_printed_page_address_hands_the_page_its_token_unchanged(token: str) -> None:
    # The page reads the fragment with URLSearchParams, which turns '+' into a space and splits on
    # '&': printed as it was, such a token reached the page as another and every request got 401.
    import urllib.parse

    from trio_agent._web._cli import page_address

    page = page_address("http://127.0.0.1:8000", token)
    assert page.startswith("http://127.0.0.1:8000/#")
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(page).fragment) == {"token": [token]}
    assert page_address("http://127.0.0.1:8000", None) == "http://127.0.0.1:8000/"


def test_web_md_lists_the_chat_options_of_each_mode() -> None:
    # The table of options one mode refuses, read from the doc: it follows chat()'s and define_agent()'s signatures.
    refused = {}
    for line in (Path(__file__).parent.parent / "docs" / "web.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        if line.startswith("| `") and len(cells) == 3:
            for cell in cells[1:]:
                if cell.startswith("refused"):
                    refused[cell] = set(re.findall(r"`(\w+)`", cells[0]))
    assert refused == {
        "refused: a thread's run is a session request": _app._CHAT_ONLY,
        "refused: options of a session's agent": _app._AGENT_ONLY,
    }
