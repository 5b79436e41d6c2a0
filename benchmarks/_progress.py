"""Progress lines on stderr while a benchmark runs; shared by every script in this directory.

Each benchmark prints a table and, as its last stdout line, one JSON object. Progress never
touches stdout, so that last line stays the JSON whatever happens; it goes to stderr, one line
per round or section, with the seconds since the run began:

    [agent_turn    3.2 s] round 2/5: sequential, 100 and 1000 concurrent sessions

It is shown when stderr is a terminal, or with ``--progress`` (e.g. ``2> progress.log``);
``--no-progress`` silences it on a terminal too. Lines are written between measurements, never
inside a timed loop. Not a benchmark itself (the leading underscore keeps it out of the smoke test).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

__all__ = ["add_progress_option", "note", "start_progress"]


class _Progress:
    def __init__(self, name: str, enabled: bool, stream: TextIO) -> None:
        self.name = name
        self.enabled = enabled
        self.stream = stream
        self.began = time.perf_counter()

    def note(self, text: str) -> None:
        if self.enabled:
            elapsed = time.perf_counter() - self.began
            print(f"[{self.name} {elapsed:6.1f} s] {text}", file=self.stream, flush=True)


_current = _Progress("", False, sys.stderr)


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (default: on when stderr is a terminal)."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress lines on stderr while the run goes (default: only when stderr is a terminal)",
    )


def start_progress(name: str, args: argparse.Namespace, stream: TextIO | None = None) -> None:
    """Start the clock; from now on `note` writes when ``--progress`` (or a terminal) says so."""
    global _current
    out = sys.stderr if stream is None else stream
    wanted = args.progress
    enabled = out.isatty() if wanted is None else bool(wanted)
    _current = _Progress(name, enabled, out)


def note(text: str) -> None:
    """One progress line (nothing when progress is off)."""
    _current.note(text)
