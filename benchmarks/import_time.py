"""Cold import time of ``trio_agent`` against its direct dependencies alone (issue 16, item 6).

Each figure is the median of N fresh interpreters (``python -c``), each timing one
statement with ``time.perf_counter``, the two statements measured alternately so that
machine load hits both alike:

* ``import trio_agent``
* ``import trio, attrs, cattrs`` (the direct dependencies every program loads anyway)

The target is a ratio of at most 2.0. ``import trio_agent`` loads only the package (every
top-level name loads on first use); a third line, ``from trio_agent import open_session,
define_tool``, is what a typical program runs, and its ratio is reported against the same
target. The last line is one JSON object.

    python benchmarks/import_time.py           # 10 runs each
    python benchmarks/import_time.py --short   # 3 runs each (the smoke test)

``--progress`` (the default when stderr is a terminal) writes a line per run to stderr; see ``_progress.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from _progress import add_progress_option, note, start_progress

TARGET_RATIO = 2.0

STATEMENTS = {
    "trio_agent": "import trio_agent",
    "direct": "import trio, attrs, cattrs",
    "typical": "from trio_agent import open_session, define_tool",
}

_TIMER = "import time; _t = time.perf_counter(); {stmt}; print(time.perf_counter() - _t)"


def cold_import_seconds(statement: str) -> float:
    """Run *statement* in a fresh interpreter (no bytecode writes) and return its duration."""
    done = subprocess.run(
        [sys.executable, "-B", "-c", _TIMER.format(stmt=statement)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="3 runs each instead of 10")
    parser.add_argument("--runs", type=int, default=None, help="runs per statement")
    add_progress_option(parser)
    args = parser.parse_args()
    start_progress("import_time", args)
    runs = args.runs or (3 if args.short else 10)

    for statement in STATEMENTS.values():  # warm the OS file cache and the .pyc files
        cold_import_seconds(statement)
    samples: dict[str, list[float]] = {key: [] for key in STATEMENTS}
    for run in range(runs):
        note(f"run {run + 1}/{runs}")
        for key, statement in STATEMENTS.items():
            samples[key].append(cold_import_seconds(statement))
    medians = {key: statistics.median(values) for key, values in samples.items()}
    ratio = medians["trio_agent"] / medians["direct"]

    print(f"cold import, median of {runs} fresh interpreters")
    print(f"{'statement':<52} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for key, statement in STATEMENTS.items():
        values = samples[key]
        print(f"{statement:<52} {medians[key] * 1e3:>10.1f} {min(values) * 1e3:>8.1f} {max(values) * 1e3:>8.1f}")
    typical = medians["typical"] / medians["direct"]
    print(f"ratio trio_agent / direct dependencies: {ratio:.2f} (target <= {TARGET_RATIO}; names load on first use)")
    state = "met" if typical <= TARGET_RATIO else "open target"
    print(
        f"ratio typical program / direct dependencies: {typical:.2f} ({state}: the session stack it loads defines "
        f"about 280 attrs classes, and attrs compiles each one's methods at import)"
    )

    figures = {
        "benchmark": "import_time",
        "runs": runs,
        "trio_agent_s": round(medians["trio_agent"], 4),
        "direct_deps_s": round(medians["direct"], 4),
        "typical_program_s": round(medians["typical"], 4),
        "ratio_vs_direct": round(ratio, 2),
        "within_target": ratio <= TARGET_RATIO,
        "typical_ratio_vs_direct": round(typical, 2),
        "typical_within_target": typical <= TARGET_RATIO,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
