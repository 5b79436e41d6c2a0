"""Command line: ``python -m trio_agent demo`` and ``python -m trio_agent journal show PATH``."""

from __future__ import annotations

import argparse
import sys

from ._demo import run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_agent", description="trio_agent command line")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the offline demo (no API key needed)")
    demo.add_argument("--calls", type=int, default=12, help="how many tool calls to fan out")
    journal = commands.add_parser("journal", help="inspect a SQLite journal")
    journal_commands = journal.add_subparsers(dest="journal_command", required=True)
    show = journal_commands.add_parser("show", help="print a readable timeline of a journal")
    show.add_argument("path", help="the SQLite journal file")
    show.add_argument("--session", default=None, help="only this session")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(calls=args.calls)
    if args.command == "journal":
        from ._journal._inspect import show_journal

        return show_journal(args.path, args.session)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
