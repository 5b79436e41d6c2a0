"""A tiny Trio HTTP server whose agent runs pause for a person's approval between two requests.

Run it with ``python examples/approval_server.py``: it starts the server on a free port, then
plays the client (httpx) once and stops. ``python examples/approval_server.py --serve 8000``
only serves, for curl::

    curl -s localhost:8000/runs -d '{"prompt": "save my notes"}'
    curl -s localhost:8000/runs/RUN_ID/answers -d '{"answers": [{"type": "approve", "interrupt_id": "ID"}]}'

``POST /runs`` starts a ``chat()`` run. The test model asks for a ``write`` and the rule
``ask: ["write"]`` pauses the run before it runs; the server keeps the `PausedRun` in memory and
answers with the questions. ``POST /runs/<run id>/answers`` resumes it with the answers
(JSON, `answers_from_json`). The state never leaves the server, so no ``signing_key`` is
needed; it is taken out before the continuation runs, so answering twice is refused (404) in
this process. A refused continuation (`InterruptResumeError`) ran nothing: the state is put
back and the answer is 400 with every issue. HTTP is `h11` (installed with httpx).
See docs/human-in-the-loop.md.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import h11
import httpx
import trio

from trio_agent import SideEffect, ToolKind, chat, define_tool
from trio_agent.lifecycle import ChatResult, InterruptResumeError, PausedRun, answers_from_json
from trio_agent.models import ToolResultMessage
from trio_agent.testing import Reply, TestModel


@define_tool(
    name="write",
    description="Write a file.",
    input_schema={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    side_effect=SideEffect.IDEMPOTENT,
    kind=ToolKind.WRITE,
)
async def write(input: dict[str, Any], ctx: Any) -> str:
    return f"wrote {input['path']}"


def respond(request: Any) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolResultMessage):
        return Reply(text=f"tool said: {last.content}")
    return Reply(tool_calls=[("write", {"path": "notes.txt"})])


MODEL = TestModel(respond=respond)
OPTIONS: dict[str, Any] = {"tools": [write], "permissions": {"ask": ["write"]}}
PAUSED: dict[str, PausedRun] = {}  # run id -> the paused run (a database in a real server)


def reply(result: ChatResult) -> tuple[int, dict[str, Any]]:
    if result.paused is None:
        return 200, {"status": "done", "text": result.text}
    PAUSED[result.paused.run_id] = result.paused
    questions = [
        {"id": q.id, "kind": q.kind.value, "message": q.message, "tool": q.tool_name, "input": q.input}
        for q in result.interrupts
    ]
    return 200, {"status": "paused", "run_id": result.paused.run_id, "questions": questions}


async def handle(method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    parts = path.strip("/").split("/")
    if method != "POST" or not isinstance(body, dict):
        return 400, {"error": "POST a JSON object"}
    if parts == ["runs"] and isinstance(body.get("prompt"), str):
        async with chat(MODEL, body["prompt"], **OPTIONS) as run:
            return reply(await run.result())
    if len(parts) == 3 and parts[0] == "runs" and parts[2] == "answers":
        paused = PAUSED.pop(parts[1], None)  # taken out: a second answer finds nothing
        if paused is None:
            return 404, {"error": f"no paused run {parts[1]!r}"}
        try:
            answers = answers_from_json(body.get("answers"))
            async with chat(MODEL, resume=paused, answers=answers, **OPTIONS) as run:
                return reply(await run.result())
        except InterruptResumeError as error:  # nothing ran: the state stays usable
            PAUSED[paused.run_id] = paused
            return 400, {"error": "refused", "issues": [[i.interrupt_id, i.code, i.message] for i in error.issues]}
    return 404, {"error": f"no route {path!r}"}


async def serve_connection(stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)

    async def next_event() -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await stream.receive_some(65536))

    async def send(*events: Any) -> None:
        for event in events:
            data = conn.send(event)
            if data:
                await stream.send_all(data)

    try:
        while True:
            request = await next_event()
            if not isinstance(request, h11.Request):
                return  # the client closed the connection
            body = b""
            while not isinstance(event := await next_event(), h11.EndOfMessage):
                body += event.data
            try:
                status, payload = await handle(request.method.decode(), request.target.decode(), json.loads(body))
            except json.JSONDecodeError:
                status, payload = 400, {"error": "the body is not JSON"}
            data = json.dumps(payload).encode()
            headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
            await send(h11.Response(status_code=status, headers=headers), h11.Data(data=data), h11.EndOfMessage())
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except (h11.RemoteProtocolError, trio.BrokenResourceError):
        return
    finally:
        await stream.aclose()


async def client(base: str) -> None:
    async with httpx.AsyncClient(base_url=base) as http:
        first = (await http.post("/runs", json={"prompt": "save my notes"})).json()
        print("POST /runs ->", first["status"], [q["message"] for q in first["questions"]])
        [question] = first["questions"]
        url = f"/runs/{first['run_id']}/answers"
        bad = await http.post(url, json={"answers": [{"type": "approve", "interrupt_id": "approval_nope"}]})
        print("bad answers ->", bad.status_code, [issue[1] for issue in bad.json()["issues"]])
        answers = [{"type": "approve", "interrupt_id": question["id"], "edited_args": {"path": "draft.txt"}}]
        done = await http.post(url, json={"answers": answers})
        print("approved with an edit ->", done.status_code, done.json())
        again = await http.post(url, json={"answers": answers})
        print("the same answers again ->", again.status_code, again.json())


async def main(port: int | None = None) -> None:
    async with trio.open_nursery() as nursery:
        # Loopback only: the endpoint has no authentication.
        serve_loopback = functools.partial(trio.serve_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve_loopback, serve_connection, port or 0)
        if port is not None:
            print(f"serving on http://localhost:{port}")
            return  # serve until interrupted
        await client(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    serve_port: int | None = None
    if sys.argv[1:2] == ["--serve"]:
        if len(sys.argv) != 3 or not sys.argv[2].isdigit() or not 0 < int(sys.argv[2]) < 65536:
            sys.exit("usage: approval_server.py [--serve PORT]  (PORT: 1 to 65535)")
        serve_port = int(sys.argv[2])
    trio.run(main, serve_port)
