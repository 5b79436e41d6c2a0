"""Command line: ``python -m trio_agent demo``."""

from __future__ import annotations

import argparse
import sys

from ._demo import run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_agent", description="trio_agent command line")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the offline demo (no API key needed)")
    demo.add_argument("--calls", type=int, default=12, help="how many tool calls to fan out")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(calls=args.calls)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
