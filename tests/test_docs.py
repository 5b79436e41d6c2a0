"""Every Python code block in README.md and docs/ runs (blocks marked ```python fragment are shown, not run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
