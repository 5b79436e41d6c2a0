"""The command line: version, refused options, one-line errors, and ``journal show`` for people."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agent import open_session
from trio_agent._terminate import until_stopped
from trio_agent.testing import Reply, TestModel

ENV = {**os.environ, "OPENAI_API_KEY": "", "ANTHROPIC_API_KEY": ""}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_agent", *args], capture_output=True, text=True, timeout=120, env=ENV
    )


def test_version() -> None:
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.startswith("trio_agent ")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("demo", "--model", "gpt-x"), "--model needs --provider"),
        (("demo", "--calls", "0"), "0 is not >= 1"),
        (("demo", "--calls", "-1"), "-1 is not >= 1"),
        (("demo", "--calls", "5001"), "5001 is not <= 5000"),  # millions of files, deaf to SIGTERM
        (("demo", "--calls", "99999999999999"), "99999999999999 is not <= 5000"),
        (("serve", "--model", "gpt-x"), "--model needs --provider"),  # it was silently ignored
        (("serve", "--port", "70000"), "70000 is not a port"),  # a traceback from bind()
        (("worker", "--lease-ttl", "1e9"), "at most"),  # a misleading "cannot connect" from the server
        *(
            (("worker", "--inbox-retention", bad), f"--inbox-retention: {bad!r} is not a number of seconds >= 0")
            for bad in ("-1", "nan", "inf", "1e400", "7d", "")
        ),
    ],
)
def test_options_that_would_be_silently_changed_are_refused(args: tuple[str, ...], words: str) -> None:
    done = run_cli(*args)
    assert done.returncode == 2
    assert words in done.stderr


def test_a_demo_that_cannot_start_says_why_in_one_line() -> None:
    done = run_cli("demo", "--provider", "openai", "--model", "gpt-x")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _started(command: list[str], ready: str) -> subprocess.Popen[str]:
    """The command line running *command*, once it printed a line holding *ready*. Ctrl-C is
    delivered as a terminal delivers it, even where this run ignores SIGINT (a job started in the
    background of a script inherits SIG_IGN, and Python then never raises it)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_agent", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=_sigint_default,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if ready in line:
            return process
    raise AssertionError(f"{command} ended before printing {ready!r}: {process.communicate()}")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_in_the_demo_is_one_line() -> None:
    process = _started(["demo", "--calls", "200"], "")  # the demo is running
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip() == "interrupted"


def test_serve_with_a_journal_it_cannot_open_says_why_in_one_line_before_announcing_anything(
    tmp_path: Path,
) -> None:
    done = run_cli("serve", "--port", "0", "--journal", str(tmp_path / "missing" / "threads.db"))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: JournalUnavailableError"), done.stderr
    assert "chat page" not in done.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize(
    ("stop", "status", "said"), [(signal.SIGINT, 130, "stopped"), (signal.SIGTERM, 143, "stopped (SIGTERM)")]
)
def test_serve_stops_on_ctrl_c_and_sigterm_in_one_line(
    tmp_path: Path, stop: signal.Signals, status: int, said: str
) -> None:
    # Ctrl-C came out of trio's nursery as a group (a traceback, status 1); SIGTERM killed it outright.
    process = _started(["serve", "--port", "0", "--journal", str(tmp_path / "threads.db")], "chat page on")
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    assert (process.returncode, stderr.strip().splitlines()[-1]) == (status, said)  # after the server's log line
    assert "Traceback" not in stderr


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize(
    ("stop", "status", "said"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_ctrl_c_and_sigterm_in_the_demo_close_its_session(
    tmp_path: Path, stop: signal.Signals, status: int, said: str
) -> None:
    # SIGTERM killed the process: the lease stayed held, no session_closed, the workspace left behind.
    journal = tmp_path / "demo.db"
    process = _started(["demo", "--calls", "2000", "--journal", str(journal)], "")
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    assert (process.returncode, stderr.strip()) == (status, said)
    shown = run_cli("journal", "show", str(journal))
    assert "not held" in shown.stdout and "session closed" in shown.stdout, shown.stdout


async def journal_with_a_subagent(path: Path) -> None:
    from trio_agent import SubagentDefinition

    helper = SubagentDefinition("reviewer", "reviews", "You review.")
    model = TestModel(default=Reply(text="line one\nline two"))
    async with open_session(provider=model, journal=path, session_id="s1", subagents=[helper]) as session:
        handle = await session.start_subagent("reviewer", "look")
        await handle.wait()
        await session.send("first line\nsecond line")


async def test_journal_show_for_people(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    await journal_with_a_subagent(path)
    done = run_cli("journal", "show", str(path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.index("stream s1/root") < out.index("stream s1/reviewer")  # root first
    assert "'first line second line'" in out  # a preview stays on one line
    only = run_cli("journal", "show", str(path), "--agent", "root")
    assert "s1/reviewer" not in only.stdout.split("calls:")[0].split("stream s1/root")[1]
    assert "stream s1/reviewer" not in only.stdout
    missing = run_cli("journal", "show", str(path), "--agent", "nobody")
    assert missing.returncode == 1 and "no agent 'nobody'" in missing.stderr


async def test_journal_show_escapes_stored_text_that_is_no_printable_text(tmp_path: Path) -> None:
    # A tool's output (and a model's arguments) may hold a lone surrogate, which the journal keeps
    # escaped, or a terminal escape sequence: shown escaped, never a crash nor a recoloured terminal.
    from trio_agent import SideEffect, define_tool
    from trio_agent.models import ToolResultMessage

    @define_tool(
        name="echo", description="e", input_schema={"type": "object"}, side_effect=SideEffect.PURE, kind="readonly"
    )
    async def echo(input: dict[str, str], ctx: object) -> str:
        return "out \udc80 \x1b[31mred"

    def respond(request: object) -> Reply:
        if isinstance(request.messages[-1], ToolResultMessage):  # type: ignore[attr-defined]
            return Reply(text="done")
        return Reply(tool_calls=[("echo", {"x": "a\ud800b"})])

    path = tmp_path / "j.db"
    async with open_session(provider=TestModel(respond=respond), tools=[echo], journal=path, session_id="s") as session:
        assert await session.send("go") == "done"
    done = run_cli("journal", "show", str(path))  # decoded strictly: every byte shown is UTF-8
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert '{"x": "a\\ud800b"}' in out and "out \\udc80 \\x1b[31mred" in out
    assert "\x1b" not in out


def test_journal_show_of_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    done = run_cli("journal", "show", str(tmp_path))
    assert done.returncode == 1
    assert "is a directory" in done.stderr


def test_a_worker_that_cannot_reach_its_database_says_why_without_a_traceback() -> None:
    done = run_cli("worker", "--dsn", "host=127.0.0.1 port=1 connect_timeout=5")
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot connect to PostgreSQL"), done.stderr
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_is_a_cancellation_at_a_checkpoint_not_an_exception_at_any_line() -> None:
    # Ctrl-C was trio's KeyboardInterrupt, raised at whatever line ran: between an `async with`'s
    # enter and its block, the exit never ran ("Exception ignored in Session._streamed" at exit).
    ran: list[str] = []

    async def main() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # plain code, where Python runs a signal's handler
            sum(range(10))
        ran.append("the plain code, all of it")
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            ran.append("cancelled at the checkpoint")
            raise

    assert trio.run(until_stopped, main) is signal.SIGINT
    assert ran == ["the plain code, all of it", "cancelled at the checkpoint"]


# A run whose clean-up cannot be cancelled (a write to a client that stopped reading, in
# Hypercorn's shield, was one): Ctrl-C cancels it, and its clean-up then waits for ever.
_STUCK_CLEAN_UP = """
import trio
from trio_agent._terminate import until_stopped

async def main():
    try:
        print("running", flush=True)
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            print("cleaning up", flush=True)
            await trio.sleep_forever()

print(trio.run(until_stopped, main))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize(
    ("first", "second", "status", "said"),
    [
        (signal.SIGINT, signal.SIGINT, 130, "interrupted"),
        (signal.SIGTERM, signal.SIGINT, 143, "terminated"),  # stopped by the first; the second hurries it
    ],
)
def test_a_second_signal_stops_a_clean_up_that_cannot_be_cancelled(
    first: signal.Signals, second: signal.Signals, status: int, said: str
) -> None:
    # The second Ctrl-C was Trio's KeyboardInterrupt, delivered to the main task, which waited for
    # the shielded clean-up first: the process never ended.
    process = subprocess.Popen(
        [sys.executable, "-c", _STUCK_CLEAN_UP],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=_sigint_default,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "running\n"
        process.send_signal(first)
        assert process.stdout.readline() == "cleaning up\n"
        process.send_signal(second)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait()
    assert (process.returncode, stderr) == (status, said + "\n")


def test_a_second_signal_leaves_a_clean_up_that_ends_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_agent import _terminate

    cut_short: list[int] = []
    monkeypatch.setattr(_terminate, "_hard_exit", lambda status, line: cut_short.append(status))
    ran: list[str] = []

    async def main() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                os.kill(os.getpid(), signal.SIGINT)
                await trio.testing.wait_all_tasks_blocked()  # the second signal is received
                ran.append("the clean-up, all of it")

    assert trio.run(until_stopped, main, clock=trio.testing.MockClock(autojump_threshold=0)) is signal.SIGINT
    assert ran == ["the clean-up, all of it"] and cut_short == []


def _with_sitecustomize(tmp_path: Path, code: str) -> dict[str, str]:
    """The environment of a command line whose interpreter first runs *code* (a sitecustomize)."""
    (tmp_path / "sitecustomize.py").write_text(code)
    paths = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**ENV, "PYTHONPATH": os.pathsep.join(paths)}


# What `pip install trio_agent` without its extras leaves: these modules are not found.
_HIDE_EXTRAS = """
import importlib.abc, sys

class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("starlette", "hypercorn", "psycopg", "psycopg_binary", "psycopg_c"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hidden())
"""


@pytest.mark.parametrize(
    ("args", "extra", "module"),
    [
        (("serve", "--port", "0"), "web", "starlette"),  # an ExceptionGroup traceback, from inside trio.run
        (("worker", "--dsn", "host=127.0.0.1 port=1"), "postgres", "psycopg"),
        (("submit", "s", "hi", "--dsn", "host=127.0.0.1 port=1"), "postgres", "psycopg"),
        (("sessions", "--dsn", "host=127.0.0.1 port=1"), "postgres", "psycopg"),
        (("workers", "--dsn", "host=127.0.0.1 port=1", "--json"), "postgres", "psycopg"),
    ],
)
def test_a_command_whose_extra_is_not_installed_says_which_in_one_line(
    tmp_path: Path, args: tuple[str, ...], extra: str, module: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_agent", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_with_sitecustomize(tmp_path, _HIDE_EXTRAS),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: {args[0]} needs pip install 'trio_agent[{extra}]' (No module named '{module}')"
    ]


def test_the_demo_needs_no_extra(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_agent", "demo", "--calls", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_with_sitecustomize(tmp_path, _HIDE_EXTRAS),
    )
    assert done.returncode == 0, done.stderr
    assert "journal summary" in done.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize(
    ("stop", "status", "said"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_signal_while_the_demo_imports_is_one_line(
    tmp_path: Path, stop: signal.Signals, status: int, said: str
) -> None:
    # The demo's modules took half a second to import at the top of __main__, before main()
    # handled anything: a Ctrl-C then was a KeyboardInterrupt traceback (status -2, not 130), a
    # SIGTERM a silent death (-15, not 143). The signal here lands exactly then: sent by the
    # import system as it looks the module up.
    interrupt_the_import = f"""
import importlib.abc, os, signal, sys

class _Stop(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "trio_agent._demo":
            os.kill(os.getpid(), {int(stop)})
        return None

sys.meta_path.insert(0, _Stop())
"""
    done = subprocess.run(
        [sys.executable, "-m", "trio_agent", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_with_sitecustomize(tmp_path, interrupt_the_import),
        preexec_fn=_sigint_default,
    )
    assert (done.returncode, done.stderr) == (status, said + "\n")
    assert done.stdout == ""


def test_the_inbox_retention_reaches_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_agent import __main__ as cli
    from trio_agent._workers import _cli
    from trio_agent._workers._queue import DEFAULT_INBOX_RETENTION

    given: list[object] = []
    monkeypatch.setattr(_cli, "run_worker", lambda **options: given.append(options["inbox_retention"]) or 0)
    for args in (["--inbox-retention", "3600"], ["--inbox-retention", "0"], ["--inbox-retention", "none"], []):
        assert cli.main(["worker", "--dsn", "host=127.0.0.1 port=1", *args]) == 0
    assert given == [3600.0, 0.0, None, DEFAULT_INBOX_RETENTION]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
async def test_a_worker_started_with_an_inbox_retention_prunes_by_it(postgres_dsn: str, fresh_pg_schema: str) -> None:
    from trio_agent.workers import request_status

    schema = fresh_pg_schema
    where = ["--dsn", postgres_dsn, "--schema", schema]
    command = ["worker", *where, "--lease-ttl", "0.6", "--inbox-retention", "0"]
    process = await trio.to_thread.run_sync(_started, command, "serving")
    try:
        done = await trio.to_thread.run_sync(
            lambda: run_cli("submit", "s", "hi", "--request-id", "r1", "--wait", "30", *where)
        )
        assert done.returncode == 0, done.stderr
        status = functools.partial(request_status, "s", "r1", dsn=postgres_dsn, schema=schema)
        with trio.fail_after(30):
            while await trio.to_thread.run_sync(status) is not None:  # its done row, until a prune deletes it
                await trio.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = await trio.to_thread.run_sync(lambda: process.communicate(timeout=60))
    assert process.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["pruned"] == 1
