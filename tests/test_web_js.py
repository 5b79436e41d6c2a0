"""The JavaScript client end to end (issue 15): `@ag-ui/client` (Node) against the running endpoint
with the offline agent: a whole run with a tool call, a pause for approval and its continuation.

Needs Node and ``npm ci --prefix tests/js`` (``.ci/run`` does both); skipped, saying so, where
they are missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.test_web_threads import served
from trio_agent._web._offline import offline_agent
from trio_agent.web import create_app, local_only

JS = Path(__file__).parent / "js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(
    NODE is None or not (JS / "node_modules" / "@ag-ui" / "client").is_dir(),
    reason="needs node and `npm ci --prefix tests/js` (.ci/run installs both)",
)


async def test_the_ag_ui_javascript_client_reads_a_run_a_pause_and_its_continuation(tmp_path: Path) -> None:
    model, tools, options = offline_agent()
    app = create_app(model, auth=local_only, tools=tools, threads=tmp_path / "threads.db", **options)
    async with served(app) as url:
        assert NODE is not None
        with trio.fail_after(60):
            done = await trio.run_process(
                [NODE, str(JS / "agui_e2e.mjs"), url], capture_stdout=True, capture_stderr=True, check=False
            )
    assert done.returncode == 0, done.stderr.decode()
    seen: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert seen["first"][0] == "RUN_STARTED" and seen["first"][-1] == "RUN_FINISHED"
    assert "TOOL_CALL_RESULT" in seen["second"] and seen["text"] == "The tool returned: 42"


async def test_the_javascript_client_reads_a_chat_run_whose_middleware_emits_after_the_loops_end() -> None:
    # The AG-UI client's own checker refused such a stream: on_finish's and a deferred function's
    # CUSTOM events came after RUN_FINISHED ("The run has already finished").
    from tests.test_web import AfterTheEnd

    model, tools, options = offline_agent()
    app = create_app(model, auth=local_only, tools=tools, middleware=[AfterTheEnd()], **options)
    async with served(app) as url:
        assert NODE is not None
        with trio.fail_after(60):
            done = await trio.run_process(
                [NODE, str(JS / "agui_e2e.mjs"), url], capture_stdout=True, capture_stderr=True, check=False
            )
    assert done.returncode == 0, done.stderr.decode()
    seen: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert seen["first"][-2:] == ["CUSTOM", "RUN_FINISHED"]  # the deferred function's, before the pause's end
    assert seen["second"][-4:] == ["STEP_FINISHED", "CUSTOM", "CUSTOM", "RUN_FINISHED"]
    assert seen["text"] == "The tool returned: 42"


async def test_the_javascript_client_takes_a_run_posted_again_after_its_first_events_were_dropped(
    tmp_path: Path,
) -> None:
    # The run was replayed from the oldest event kept, without RUN_STARTED: the client refused it
    # ("First event must be 'RUN_STARTED'"). Now the stream is one RUN_ERROR fell_behind.
    from tests.test_web_threads import spamming_app, until_its_first_events_are_dropped

    app, release = spamming_app(tmp_path)
    async with served(app) as url:
        await until_its_first_events_are_dropped(app, url)
        release.set()  # the run ends: posted again, it would be replayed whole, if it could be
        assert NODE is not None
        with trio.fail_after(60):
            done = await trio.run_process(
                [NODE, str(JS / "agui_retry.mjs"), url, "t1", "r1", "go"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert done.returncode == 0, done.stderr.decode()
    seen: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert seen == {"types": ["RUN_ERROR"], "error": None}, seen
