"""The README's main job and every benchmark's short mode run and report sane figures."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from trio_agent._demo import run_demo

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


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


@pytest.mark.parametrize("script", BENCHMARKS, ids=[path.stem for path in BENCHMARKS])
def test_benchmark_short_mode_prints_json_last(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--short"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) > 2, "a readable table comes before the JSON line"
    figures = json.loads(lines[-1])
    assert figures["benchmark"] == script.stem
    numbers = [value for value in figures.values() if isinstance(value, float)]
    # Differences and slopes may dip below zero in a noisy short run; they must still be real numbers.
    assert numbers and all(math.isfinite(value) for value in numbers)
    direct = [value for key, value in figures.items() if "direct" in key and isinstance(value, float)]
    assert direct and all(value > 0 for value in direct)
