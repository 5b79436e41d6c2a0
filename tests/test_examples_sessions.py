"""The session examples (examples/fan_out_fan_in.py, supervisor.py, trio_app_embedding.py) do what
they say, as imported modules and as scripts; the demo's provider and journal options work."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio
from fake_server import Recorded, Scripted, open_fake_server

from trio_agent._demo import _demo

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"session_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_fan_out_fan_in(capsys: pytest.CaptureFixture[str]) -> None:
    example = load("fan_out_fan_in")
    result = await example.main()
    findings = result["findings"]
    assert list(findings) == example.CITIES
    assert findings["Rome"] == "Rome: sunny, 27 °C" and findings["Oslo"] == "Oslo: rain, 9 °C"
    # The background subagents ran at the same time: together they took less than one after another.
    assert result["elapsed"] < len(example.CITIES) * example.TOOL_SECONDS
    # The root found the subagents' reports in its conversation (fan-in at its next turn).
    assert result["answer"] == "Go to Rome: sunny and 27 °C, the warmest sunny city of the 4."
    out = capsys.readouterr().out
    assert "fan-out: 4 background subagents" in out and "root: Go to Rome" in out


async def test_supervisor(capsys: pytest.CaptureFixture[str]) -> None:
    example = load("supervisor")
    result = await example.main()
    guide = result["guide"]
    assert guide.startswith("# Cancel scopes")
    assert all(text in guide for text in example.DOCS.values())  # the research reached the writer
    agents = {agent.rsplit("-", 1)[0] for agent, _, _ in result["trace"]}
    assert agents == {"root", "researcher", "writer", "reviewer"}
    # Every call that ran went through the one shared middleware, and each agent used only its tools.
    used = {(agent.rsplit("-", 1)[0], tool) for agent, tool, ok in result["trace"] if ok}
    assert used == {
        ("root", "task"),
        ("researcher", "search_docs"),
        ("writer", "write_file"),
        ("reviewer", "read_file"),
    }
    # The reviewer's write was refused by its allowlist before it could run.
    assert "tool 'write_file' is not available to this agent" in result["answer"]
    out = capsys.readouterr().out
    assert "supervisor: guide.md is written and reviewed" in out


async def test_trio_app_embedding(capsys: pytest.CaptureFixture[str]) -> None:
    example = load("trio_app_embedding")
    result = await example.main()
    outcomes = result["outcomes"]
    first = outcomes[example.FIRST]
    assert first == "50 lines, all services up; 2 errors, as you asked me to count."
    assert outcomes["Count the errors too."] == first  # "next" joined the running request
    assert outcomes["Then draft a status update."].startswith("Status update")  # "later": its own request
    assert outcomes["What time is it?"] == "busy"  # no priority while a request runs
    assert outcomes["Scan the whole archive."].startswith("Stopped scanning")  # "now" steered the scan away
    assert outcomes["Rebuild the search index."] == "aborted"  # session.abort()
    assert outcomes["Are you still there? (now on test-model-large)"].startswith("Yes, still here")
    assert result["ticks"] >= 1
    out = capsys.readouterr().out
    assert "refused 'What time is it?'" in out and "tick 1" in out


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("fan_out_fan_in", "root: Go to Rome"),
        ("supervisor", "supervisor: guide.md is written and reviewed"),
        ("trio_app_embedding", "done: 8 prompts"),
    ],
)
def test_examples_run_as_scripts(script: str, expected: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{script}.py")], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout
    assert "Traceback" not in done.stderr


# -- the demo's options


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--provider", "openai", "--model", "gpt-4o-mini"], "error: no API key for the OpenAI provider"),
        (["--provider", "anthropic", "--model", "claude-haiku"], "error: no Anthropic API key"),
        (["--provider", "openai"], "error: --model is required with --provider openai"),
    ],
)
def test_demo_without_an_api_key_fails_clearly(args: list[str], message: str) -> None:
    env = {key: value for key, value in os.environ.items() if not key.endswith("_API_KEY")}
    done = subprocess.run(
        [sys.executable, "-m", "trio_agent", "demo", *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2
    assert done.stderr.startswith(message), done.stderr
    assert "Traceback" not in done.stderr


def test_demo_keeps_its_journal_for_journal_show(tmp_path: Path) -> None:
    path = tmp_path / "demo.db"
    done = subprocess.run(
        [sys.executable, "-m", "trio_agent", "demo", "--calls", "2", "--journal", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"inspect it: python -m trio_agent journal show {path}" in done.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "trio_agent", "journal", "show", str(path)], capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    assert "subagent summarizer-" in shown.stdout and "research" in shown.stdout


def _sse(delta: dict[str, Any], finish: str | None = None) -> str:
    chunk = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(chunk)}\n\n"


def _openai_reply(request: Recorded) -> Scripted:
    """A stand-in OpenAI-compatible server: the root lists the files, then starts one summarizer."""
    messages = request.json()["messages"]
    results = sum(1 for message in messages if message["role"] == "tool")
    is_root = "coordinate" in messages[0]["content"]
    calls: list[tuple[str, dict[str, Any]]] = []
    if is_root and results == 0:
        calls = [("list_files", {})]
    elif is_root and results == 1:
        calls = [("task", {"subagent": "summarizer", "prompt": "Summarize notes/01-structured-concurrency.md"})]
    pieces = [_sse({"role": "assistant", "content": "Done." if not calls else "Working."})]
    for index, (name, arguments) in enumerate(calls):
        function = {"name": name, "arguments": json.dumps(arguments)}
        pieces.append(
            _sse({"tool_calls": [{"index": index, "id": f"c{results}", "type": "function", "function": function}]})
        )
    pieces += [_sse({}, "tool_calls" if calls else "stop"), "data: [DONE]\n\n"]
    return Scripted.sse(pieces)


async def test_demo_on_a_provider_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_fake_server(_openai_reply) as server:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("OPENAI_BASE_URL", server.url + "/v1")
        out = io.StringIO()
        with trio.fail_after(30):
            await _demo(out, calls=2, provider="openai", model="fake-gpt", journal=None)
    text = out.getvalue()
    assert "model fake-gpt" in text
    assert "← list_files ok" in text and "■ started (summarizer)" in text
    assert "■ done (end_turn, 3 turns)" in text
    assert "journal summary" in text


# -- the code samples of the session guides


def _samples() -> list[tuple[str, int, str]]:
    found = []
    for doc in ("sessions.md", "subagents.md"):
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / doc).read_text(), re.S)
        found += [(doc, index, block) for index, block in enumerate(blocks) if "trio.run(main)" in block]
    return found


SAMPLES = _samples()


@pytest.mark.parametrize(("doc", "index", "code"), SAMPLES, ids=[f"{doc}-{index}" for doc, index, _ in SAMPLES])
def test_guide_samples_run(doc: str, index: int, code: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(code, f"{doc}#{index}", "exec"), {"__name__": f"sample_{index}"})
    printed = capsys.readouterr().out
    assert printed.strip(), "every sample prints what it shows"
    # The sample's own comments that quote its output (a line "# text" right after trio.run) must match.
    tail = code.split("trio.run(main)", 1)[1]
    quoted = [line[2:] for line in tail.splitlines() if line.startswith("# ") and "..." not in line]
    for line in quoted:
        assert line.split("  (")[0].strip() in printed or "summarizer-" in line, line
