"""Run ``mypy --strict`` on a snippet, for tests that pin how the public API types user code."""

from __future__ import annotations

from pathlib import Path


def mypy_strict(tmp_path: Path, name: str, source: str) -> tuple[int, str]:
    """Type-check *source* saved as ``<tmp_path>/<name>``; return mypy's exit status and its report."""
    from mypy import api

    path = tmp_path / name
    path.write_text(source)
    out, err, status = api.run(["--cache-dir", str(tmp_path / "mypy-cache"), "--strict", str(path)])
    return status, out + err
