"""Every Python code block in README.md and docs/ runs (blocks marked ```python fragment are shown, not run)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for path in DOCS:
        for index, match in enumerate(BLOCK.finditer(path.read_text())):
            if "fragment" in match.group(1):
                continue
            found.append((str(path.relative_to(ROOT)), index, match.group(2)))
    return found


BLOCKS = _blocks()


@pytest.mark.parametrize(("doc", "index", "code"), BLOCKS, ids=[f"{doc}#{index}" for doc, index, _ in BLOCKS])
def test_every_code_block_runs(doc: str, index: int, code: str, tmp_path: Path) -> None:
    # In a subprocess (a block may call trio.run) in an empty directory (a block may write files).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("OPENAI_API_KEY", None)
    env.pop("ANTHROPIC_API_KEY", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, f"{doc} block {index} failed:\n{done.stderr[-2000:]}"


def test_api_md_lists_what_trio_agent_plugins_exports_of_plugin_resolution() -> None:
    # The define_plugin section of api.md says which names of plugin resolution live in
    # trio_agent.plugins; the errors a user catches (UnknownToolError, ...) are among them.
    import trio_agent.plugins
    from trio_agent._session import _plugins

    api = (ROOT / "docs" / "api.md").read_text()
    start = api.index("### `define_plugin`")
    section = api[start : api.index("\n### ", start + 1)]
    exported = [name for name in _plugins.__all__ if name in trio_agent.plugins.__all__]
    assert exported and [name for name in exported if f"`{name}`" not in section] == []
    assert "`ResolvedPlugins.tool(name)` raises `UnknownToolError`" in section


def test_api_md_errors_tree_names_every_public_error() -> None:
    # LifecycleHookError, RetryNotAllowedError, HistoryError and InputError were public and caught
    # by users, but the Errors section's tree did not name them.
    import importlib

    from trio_agent import TrioAgentError

    api = (ROOT / "docs" / "api.md").read_text()
    start = api.index("## Errors")
    tree = api[api.index("```text", start) : api.index("\n```\n", start)]
    modules = ["trio_agent", "trio_agent.lifecycle", "trio_agent.models", "trio_agent.plugins", "trio_agent.journal"]
    modules += ["trio_agent.tools", "trio_agent.permissions", "trio_agent.middleware", "trio_agent.workers"]
    public: set[str] = set()
    for name in [*modules, "trio_agent.web"]:
        try:
            module = importlib.import_module(name)
        except ImportError:  # trio_agent.web needs the `web` extra
            continue
        for export in module.__all__:
            value = getattr(module, export)
            if isinstance(value, type) and issubclass(value, TrioAgentError):
                public.add(export)
    assert "InputError" in public or "trio_agent.web" not in sys.modules
    assert len(public) > 40
    assert sorted(name for name in public if not re.search(rf"\b{name}\b", tree)) == []


_PUBLIC_MODULES = ["trio_agent", "trio_agent.journal", "trio_agent.lifecycle", "trio_agent.middleware"]
_PUBLIC_MODULES += ["trio_agent.models", "trio_agent.permissions", "trio_agent.plugins", "trio_agent.testing"]
_PUBLIC_MODULES += ["trio_agent.tools", "trio_agent.workers"]


def _names(text: str) -> list[str]:
    """The identifiers written in backticks in `text` (`trio_agent.plugins`, `x(...)` and the like left out)."""
    return [name for name in re.findall(r"`([^`]+)`", text) if re.fullmatch(r"[A-Za-z_]\w*", name)]


def test_hooks_md_says_where_each_hook_name_lives() -> None:
    # hooks.md's API summary said HookAction, the per-event inputs, HookDecision and the five
    # errors were exported from trio_agent: most live in trio_agent.plugins, HookDecision is private.
    import importlib

    import trio_agent
    from trio_agent._session import _hooks

    hooks = (ROOT / "docs" / "hooks.md").read_text()
    start = hooks.index("## API summary")
    summary = " ".join(hooks[start : hooks.index("```", start)].split())
    summary, internal = summary.split("internal (`trio_agent._session._hooks`)", 1)
    # "Exported from `trio_agent`: ... From `trio_agent.plugins`: ..." -> each module and what it is said to hold.
    parts = re.split(r"(?:Exported from|From) `(trio_agent[\w.]*)`:", summary)[1:]
    claims = dict(zip(parts[::2], parts[1::2], strict=True))
    for module_name, text in claims.items():
        module = importlib.import_module(module_name)
        named = [name for name in _names(text) if name != "HookError" or module is trio_agent]
        assert named and [name for name in named if name not in module.__all__] == [], module_name
    assert sorted(claims) == ["trio_agent", "trio_agent.plugins"]
    assert "HookAction" in _names(claims["trio_agent.plugins"]) and "HookDecision" not in _names(summary)
    public = {name for module in _PUBLIC_MODULES for name in importlib.import_module(module).__all__}
    private = _names(internal)
    assert private and [name for name in private if name in public or not hasattr(_hooks, name)] == []


def test_api_md_says_where_chat_and_the_loop_names_live() -> None:
    # api.md said chat, ChatRun, StopReason, the loop's events and strategies "live in private modules".
    import trio_agent
    import trio_agent.lifecycle

    api = (ROOT / "docs" / "api.md").read_text()
    start = api.index("## chat() and the loop")
    intro = " ".join(api[start : api.index("\n### ", start)].split())
    assert "private" not in intro
    top, lifecycle = intro.split("are exported from `trio_agent`.", 1)
    top = top[top.index("the rules). ") :]
    lifecycle = lifecycle.split("exports the rest", 1)[1]
    assert _names(top) == ["chat", "StopReason"]
    assert [name for name in _names(top) if name not in trio_agent.__all__] == []
    named = _names(lifecycle)
    assert len(named) > 8 and [name for name in named if name not in trio_agent.lifecycle.__all__] == []


def test_readme_names_the_lint_commands_ci_runs() -> None:
    # The README said CI runs ruff "on the package"; .ci/run lints the tests, benchmarks and examples too.
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.removeprefix(".venv/bin/") for line in ci.splitlines() if line.startswith(".venv/bin/")]
    assert any(command.startswith("ruff check") for command in commands)
    assert [command for command in commands if f"`{command}`" not in " ".join(readme.split())] == []


def test_demo_md_quotes_the_demo_s_own_output_labels() -> None:
    # demo.md quoted a "synthetic starts: 1" line the demo no longer prints.
    demo = (ROOT / "docs" / "demo.md").read_text()
    source = (ROOT / "trio_agent" / "_demo.py").read_text()
    quoted = re.findall(r'hence\s+"([^"]+?):\s*\d+"', " ".join(demo.split()))
    assert quoted and [label for label in quoted if f"{label}: {{" not in source] == []


def _defined_tools(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for decorator in node.decorator_list:
                call = decorator if isinstance(decorator, ast.Call) else None
                target = call.func if call else decorator
                described = call is not None and any(k.arg == "description" for k in call.keywords)
                if isinstance(target, ast.Name) and target.id == "define_tool" and not described:
                    yield node


def test_every_tool_defined_in_a_fragment_has_a_description() -> None:
    # define_tool refuses a tool with neither a docstring nor description=; permissions.md's Bash
    # example had neither, so copying it failed at once.
    found = []
    for path in DOCS:
        for match in BLOCK.finditer(path.read_text()):
            if "fragment" not in match.group(1):
                continue  # the blocks that run are checked by running them
            try:
                tree = ast.parse(match.group(2))
            except SyntaxError:
                continue  # a signature sketch, not code
            found += [(path.name, tool.name) for tool in _defined_tools(tree) if ast.get_docstring(tool) is None]
    assert found == []


def test_sessions_md_lists_every_stop_reason() -> None:
    # It left out vetoed and interrupted, both of which end a session's request.
    from trio_agent import StopReason

    text = (ROOT / "docs" / "sessions.md").read_text()
    start = text.index("`stop_reason` is a `StopReason`")
    listed = set(re.findall(r"`(\w+)`", text[start : text.index("After the loop", start)]))
    assert {reason.value for reason in StopReason} <= listed
