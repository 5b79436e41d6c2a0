"""Draw docs/images/performance.png from the JSON lines of agent_turn.py and scale.py (issue 17).

Usage (matplotlib is the optional ``plot`` extra: ``pip install -e .[plot]``)::

    python benchmarks/agent_turn.py --instructions | tail -1 > /tmp/agent_turn.json
    python benchmarks/scale.py --variants plain | tail -1 > /tmp/scale.json
    python benchmarks/_plot.py /tmp/agent_turn.json /tmp/scale.json docs/images/performance.png

Left: instructions per request by runtime (callgrind, ``instructions_<runtime>_per_request``), as a
multiple of the hand-written floor. Right: wall seconds against the number of concurrent sessions, the
agent beside the floor (``agent_memory_plain_<N>_total_s`` and ``direct_plain_<N>_wall_s``).
It is not a benchmark itself (the leading underscore keeps the smoke test from running it).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any


def _load(path: str) -> dict[str, Any]:
    lines = Path(path).read_text().strip().splitlines()
    figures: dict[str, Any] = json.loads(lines[-1])
    return figures


def _instructions(figures: dict[str, Any]) -> list[tuple[str, float]]:
    pattern = re.compile(r"^instructions_(.+)_per_request$")
    rows = [
        (m.group(1), float(v)) for k, v in figures.items() if (m := pattern.match(k)) and isinstance(v, (int, float))
    ]
    floor = [value for name, value in rows if name == "floor"]
    rest = [(name, value) for name, value in rows if name != "floor"]
    return [("floor", floor[0]), *rest] if floor else rest


def _scale(figures: dict[str, Any]) -> tuple[list[int], list[float], list[float]]:
    sizes = sorted(int(n) for n in figures.get("sessions", []))
    agent = [float(figures.get(f"agent_memory_plain_{n}_total_s", float("nan"))) for n in sizes]
    floor = [float(figures.get(f"direct_plain_{n}_wall_s", float("nan"))) for n in sizes]
    return sizes, agent, floor


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[plot]); nothing drawn")
        return 1
    turn, scale = _load(argv[0]), _load(argv[1])
    rows = _instructions(turn)
    sizes, agent, floor = _scale(scale)
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if rows:
        base = rows[0][1]
        names = [name.replace("_", " ") for name, _ in rows]
        positions = list(range(len(rows)))
        left.barh(positions, [value / 1e6 for _, value in rows], color="#4a7ab5")
        left.set_yticks(positions, names)
        for index, (_, value) in enumerate(rows):
            left.text(value / 1e6, index, f" {value / base:.1f}x", va="center", fontsize=8)
        left.set_xlim(0, max(value for _, value in rows) / 1e6 * 1.15)
        left.invert_yaxis()
        left.set_xlabel("million instructions per request (callgrind)")
        left.set_title("one request: x the hand-written Trio floor")
    if sizes:
        right.plot(sizes, agent, "o-", label="trio_agent (memory journal)")
        right.plot(sizes, floor, "s--", label="hand-written Trio floor")
        right.set_xscale("log")
        right.set_yscale("log")
        right.set_xlabel("concurrent sessions, one request each (5 ms model latency)")
        right.set_ylabel("wall seconds (open + requests + close)")
        right.set_title("N concurrent sessions")
        right.legend()
    figure.tight_layout()
    figure.savefig(argv[2], dpi=110)
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
