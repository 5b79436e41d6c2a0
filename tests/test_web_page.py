"""The chat page in a real browser (issue 15): headless Chromium (Debian's ``chromium``) driven by
Playwright, against the app serving the offline agent: type a prompt and see the streamed text,
approve a tool call, stop a run, reload and see the conversation. The screenshot is kept in
``test-artifacts/web-page.png`` (``TRIO_AGENT_ARTIFACTS`` moves it).

Needs ``chromium`` and the ``playwright`` package (``.ci/run`` installs both; Playwright is pointed
at the system's browser, it downloads none); skipped, saying so, where they are missing."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.test_web_threads import served
from trio_agent._web._offline import offline_agent
from trio_agent.web import create_app, local_only

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or importlib.util.find_spec("playwright") is None,
    reason="needs Chromium and playwright (.ci/run installs both)",
)


@pytest.fixture
def screenshot() -> Path:
    """Where the page's screenshot is kept (a fresh file: an old one must not pass for it)."""
    artifacts = Path(os.environ.get("TRIO_AGENT_ARTIFACTS", ROOT / "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    path = artifacts / "web-page.png"
    path.unlink(missing_ok=True)
    return path


def size_of(path: Path) -> int:
    return path.stat().st_size


async def test_the_chat_page_in_a_real_browser(tmp_path: Path, screenshot: Path) -> None:
    model, tools, options = offline_agent()
    app = create_app(model, auth=local_only, tools=tools, threads=tmp_path / "threads.db", **options)
    async with served(app) as url:
        assert CHROMIUM is not None
        script = Path(__file__).parent / "browser" / "page_e2e.py"
        with trio.fail_after(100):
            done = await trio.run_process(
                [sys.executable, str(script), url + "/", str(screenshot), CHROMIUM],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    seen: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert seen["users"] == ["hello there", "add 2 and 40", "wait for a while"]
    assert size_of(screenshot) > 10_000  # a picture of the page, kept as a test artifact
