"""The README's main job and every benchmark's short mode run and report sane figures."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trio_agent._demo import run_demo

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted(path for path in (ROOT / "benchmarks").glob("*.py") if not path.name.startswith("_"))


def test_demo_runs_offline_and_summarises_the_journal() -> None:
    out = io.StringIO()
    assert run_demo(calls=8, out=out) == 0
    text = out.getvalue()
    assert "journal summary" in text
    assert "cancelled: 1" in text  # the steered research call
    assert "password=[redacted]" in text and "hunter2" not in text
    assert "calls answered from the cache (the tool did not run): 1" in text
    assert "legend    ▸ you say" in text
    # The offline test model planned the calls (streamed) and answered after the tool results.
    assert "[9 tool calls]" in text
    assert "the research was interrupted by you" in text


def test_demo_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_agent", "demo", "--calls", "4"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "journal summary" in done.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")
def test_demo_into_a_pipe_closed_early_stops_quietly() -> None:
    """``python -m trio_agent demo | head -1``: no ``error: BrokenPipeError`` line, exit 141 (SIGPIPE's)."""
    with subprocess.Popen(
        [sys.executable, "-m", "trio_agent", "demo", "--calls", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.readline()  # the header: the demo is running
        process.stdout.close()
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=120) == 141, stderr
    assert stderr == ""


@pytest.mark.parametrize("script", BENCHMARKS, ids=[path.stem for path in BENCHMARKS])
def test_benchmark_short_mode_prints_json_last(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--short", "--progress"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    # Progress goes to stderr, a line per round or section; stdout keeps the table and the JSON line.
    progress = re.compile(rf"^\[{script.stem} +\d+\.\d s\] \S")
    assert any(progress.match(line) for line in done.stderr.splitlines()), done.stderr
    lines = done.stdout.strip().splitlines()
    assert not any(line.startswith(f"[{script.stem} ") for line in lines)
    assert len(lines) > 2, "a readable table comes before the JSON line"
    figures = json.loads(lines[-1])
    assert figures["benchmark"] == script.stem
    numbers = [value for value in figures.values() if isinstance(value, float)]
    # Differences and slopes may dip below zero in a noisy short run; they must still be real numbers.
    assert numbers and all(math.isfinite(value) for value in numbers)
    direct = [value for key, value in figures.items() if "direct" in key and isinstance(value, float)]
    assert direct and all(value > 0 for value in direct)
    if script.stem == "agent_turn":
        # A peer that is installed is measured: one that fails (its API moved on, or its tool path broke)
        # must not pass as left out.
        statuses = figures["peer_status"]
        assert all(status in ("measured", "skipped (not installed)") for status in statuses.values()), statuses
        assert figures["peers_failed"] == []


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_agent_turn_instructions_mode_counts_under_callgrind() -> None:
    """``agent_turn.py --instructions``: its callgrind children run and the JSON has section 3's shape."""
    script = ROOT / "benchmarks" / "agent_turn.py"
    command = [sys.executable, str(script), "--short", "--no-peers", "--no-progress", "--instructions"]
    command += ["--instructions-requests", "1", "2", "--instructions-runtimes", "chat"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "== 3. instructions per request under callgrind" in done.stdout
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["instructions_status"] == "measured"
    assert (figures["instructions_small_requests"], figures["instructions_large_requests"]) == (1, 2)
    for runtime in ("floor", "chat"):  # the floor is always counted: every ratio needs it
        prefix = f"instructions_{runtime}"
        assert figures[f"{prefix}_status"] == "measured"
        assert 0 < figures[f"{prefix}_ir_small"] < figures[f"{prefix}_ir_large"]
        assert figures[f"{prefix}_counted"] in ("requests", "process")
        assert isinstance(figures[f"{prefix}_per_request"], float) and figures[f"{prefix}_per_request"] > 0
    assert figures["direct_instructions_per_request"] == figures["instructions_floor_per_request"]
    assert figures["instructions_chat_x_floor"] > 1
    assert isinstance(figures["instructions_chat_within_target"], bool)
    assert figures["instructions_session_fresh_memory_status"] == "not counted (--instructions-runtimes)"
    assert figures["instructions_openai_agents_status"] == "skipped (--no-peers)"
    assert "instructions_session_fresh_memory_per_request" not in figures
    # benchmarks/_plot.py draws the instructions from these keys.
    plot = _load_benchmark_module("_plot")
    assert [name for name, _ in plot._instructions(figures)] == ["floor", "chat"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _load_benchmark_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "terminal", "shown"),
    [
        ([], False, False),  # piped or captured: quiet unless asked
        ([], True, True),  # a terminal: shown
        (["--progress"], False, True),
        (["--no-progress"], True, False),
    ],
)
def test_benchmark_progress_is_on_for_a_terminal_or_when_asked(argv: list[str], terminal: bool, shown: bool) -> None:
    progress = _load_benchmark_module("_progress")
    parser = argparse.ArgumentParser()
    progress.add_progress_option(parser)
    stream = _Terminal() if terminal else io.StringIO()
    progress.start_progress("bench", parser.parse_args(argv), stream)
    progress.note("round 1/3")
    written = stream.getvalue()
    if shown:
        assert re.fullmatch(r"\[bench +\d+\.\d s\] round 1/3\n", written), written
    else:
        assert written == ""
