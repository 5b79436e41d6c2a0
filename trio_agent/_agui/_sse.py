"""Server-sent events: the framing of an AG-UI stream over HTTP.

Rules
=====

* One event is one ``data:`` line holding its compact JSON (JSON text never holds
  a raw newline, so one line is enough), then a blank line.
* A comment line (``:`` and text) keeps an idle connection alive; clients ignore it.
* Text is UTF-8; JSON keeps non-ASCII as it is (``ensure_ascii=False``), a lone
  surrogate (which UTF-8 cannot carry) becomes ``?`` rather than failing the stream.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["CONTENT_TYPE", "KEEP_ALIVE", "sse_comment", "sse_event"]

CONTENT_TYPE = "text/event-stream"
KEEP_ALIVE = b": keep-alive\n\n"


def sse_event(data: dict[str, Any]) -> bytes:
    """One SSE event carrying ``data`` as JSON."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return b"data: " + text.encode("utf-8", "replace") + b"\n\n"


def sse_comment(text: str) -> bytes:
    """A comment line (one line: newlines in ``text`` become spaces)."""
    return b": " + " ".join(text.splitlines()).encode("utf-8", "replace") + b"\n\n"
