"""Live text deltas out of a worker: best effort, never in the run's way.

Rules
=====

* A request's text deltas become NOTIFY payloads on ``<schema>_live``: JSON (ASCII only, so
  any text, lone surrogates included, encodes), cut so each payload stays under
  PostgreSQL's 8000 bytes; ``n`` counts one request's pieces from 1.
* The run's sink never waits and never raises: a piece that does not fit the bounded
  channel, or cannot be built, is dropped and counted (`LivePublisher.dropped`). Deltas are
  not durable; the journal is the truth.
* One publisher task drains the channel in batches: one statement per batch.
"""

from __future__ import annotations

import json
import logging

import trio

from .._errors import TrioAgentError
from .._session._messages import SessionEvent, TextDeltaEvent
from .._session._stream import EventSink
from ._control import Control

__all__ = ["LivePublisher", "live_payloads"]

_log = logging.getLogger("trio_agent.workers")

NOTIFY_MAX = 7999  # bytes: PostgreSQL refuses a NOTIFY payload of 8000 bytes or more
_BATCH = 256
_FIRST_CUT = 2000  # characters of text per piece before measuring


def _payload(session_id: str, request_id: str, agent_id: str, n: int, text: str) -> str:
    return json.dumps({"s": session_id, "r": request_id, "a": agent_id, "n": n, "t": text}, separators=(",", ":"))


def live_payloads(session_id: str, request_id: str, agent_id: str, first_n: int, text: str) -> list[str]:
    """The payloads that carry *text*, numbered from *first_n*, each within `NOTIFY_MAX` bytes
    (ASCII JSON: its length is its size). A piece too long is halved until it fits; a single
    character that cannot fit (ids near their maximum length) is dropped, never sent oversized."""
    pieces = [text[i : i + _FIRST_CUT] for i in range(0, len(text), _FIRST_CUT)]
    payloads: list[str] = []
    stack = pieces[::-1]
    while stack:
        piece = stack.pop()
        payload = _payload(session_id, request_id, agent_id, first_n + len(payloads), piece)
        if len(payload) <= NOTIFY_MAX:
            payloads.append(payload)
        elif len(piece) > 1:
            half = len(piece) // 2
            stack.extend([piece[half:], piece[:half]])
    return payloads


class LivePublisher:
    """The worker's live deltas (module rules)."""

    def __init__(self, control: Control, channel: str, capacity: int = 4096) -> None:
        self.control = control
        self.channel = channel
        self._send, self._receive = trio.open_memory_channel[str](capacity)
        self.sent = 0
        self.dropped = 0

    def sink_for(self, session_id: str, request_id: str) -> EventSink:
        counter = 1

        async def sink(event: SessionEvent) -> None:
            nonlocal counter
            if not isinstance(event, TextDeltaEvent) or not event.text:
                return
            try:
                payloads = live_payloads(session_id, request_id, event.agent_id, counter, event.text)
            except Exception:  # never into the run: this text is dropped
                self.dropped += 1
                return
            counter += len(payloads)
            for payload in payloads:
                try:
                    self._send.send_nowait(payload)
                except (trio.WouldBlock, trio.ClosedResourceError):
                    self.dropped += 1

        return sink

    async def run(self) -> None:
        """Publish until `close` (batches: one statement each)."""
        async with self._receive:
            async for first in self._receive:
                batch = [first]
                while len(batch) < _BATCH:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                try:
                    await self.control.publish(self.channel, batch)
                    self.sent += len(batch)
                except TrioAgentError as exc:
                    self.dropped += len(batch)
                    _log.debug("live deltas dropped (not durable): %s", exc)

    def close(self) -> None:
        self._send.close()
