"""How an event row is stored and checked: one rule for every file and database store.

A stored event is a row ``(stream_id, seq, token, body, checksum)``. ``body`` is the
envelope's JSON text (ASCII: `encode_body` escapes everything else) and ``checksum`` is

    CRC32( b"<len(stream_id)>:<stream_id>:<seq>:" + body )

over the UTF-8 bytes of the stream id and the exact stored body bytes. The standard
library has no CRC32C, so this is zlib's CRC32: it catches every burst of up to 32
flipped bits and any other random damage but one time in 2**32; it is no defence
against deliberate forgery (nothing in a store is). The stream id and seq are in it,
so a row moved to another stream or seq fails too.

Reading verifies the checksum, then the UTF-8, then decodes strictly and checks the
row is where it claims to be. Every failure is a `JournalCorruptError` naming
``stream#seq``: damage is never reported as unavailability, and never read as data.
Rows of a version-1 store (no checksum) are checked the same way minus the checksum.

A stored snapshot (`_snapshot`) is a row ``(stream_id, seq, body, checksum)`` under the
same rule: ``body`` is its exact stored bytes and ``checksum`` is `row_checksum` of them.
`verify_snapshot` checks it; a mismatch is a `JournalCorruptError` naming ``stream@seq``
(which the journal reports and ignores: a snapshot is a cache, the events stay the truth).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._errors import JournalCorruptError, JournalError
from ._events import EventEnvelope, decode_event
from ._store import AppendBatch

__all__ = [
    "STORE_SCHEMA_VERSION",
    "EventRow",
    "commit_encoded",
    "decode_range",
    "decode_row",
    "encode_rows",
    "row_checksum",
    "row_error",
    "snapshot_row",
    "verify_snapshot",
]

STORE_SCHEMA_VERSION = 2
"""Version 2 added the ``checksum`` column; version-1 stores are migrated on their first write-open."""

EventRow = tuple[str, int, int, str, int]
"""One stored event: stream_id, seq, token, body, checksum."""


def row_checksum(stream_id: str | bytes, seq: int, body: bytes) -> int:
    """The checksum of one stored row (see the module docstring); an unsigned 32-bit integer."""
    stream = stream_id.encode("utf-8") if isinstance(stream_id, str) else bytes(stream_id)
    # The length prefix keeps the parts apart: no (stream, seq, body) split collides with another.
    return zlib.crc32(body, zlib.crc32(b"%d:%b:%d:" % (len(stream), stream, seq)))


def encode_rows(batch: AppendBatch) -> list[EventRow]:
    """The rows of one append, bodies encoded and checksummed (outside any write transaction)."""
    return [
        (batch.stream_id, envelope.seq, batch.token, body, row_checksum(batch.stream_id, envelope.seq, body.encode()))
        for envelope, body in zip(batch.envelopes, batch.bodies, strict=True)
    ]


def commit_encoded(
    works: Sequence[Any], commit: Callable[[Sequence[Any], list[list[EventRow]]], list[object]]
) -> list[object]:
    """Encode every append of a writer batch (before any transaction), then ``commit(works, rows)``
    the rest: an append that cannot be encoded (an id past the door that is not UTF-8) is refused
    alone, definitely (`JournalError`), and never reaches the shared transaction."""
    outcomes: list[object | None] = []
    kept: list[Any] = []
    rows: list[list[EventRow]] = []
    for work in works:
        if not isinstance(work, AppendBatch):
            outcomes.append(None)
            kept.append(work)
            rows.append([])
            continue
        try:
            rows.append(encode_rows(work))
        except (UnicodeError, ValueError, TypeError) as exc:
            outcomes.append(JournalError(f"append to {work.stream_id!r} refused: it cannot be stored: {exc}"))
            continue
        outcomes.append(None)
        kept.append(work)
    if not kept:
        return list(outcomes)
    done = iter(commit(kept, rows))
    return [next(done) if outcome is None else outcome for outcome in outcomes]


def row_error(stream_id: str, seq: object, problem: BaseException | str) -> JournalCorruptError:
    """The one way a damaged row is reported: `JournalCorruptError` naming ``stream#seq``."""
    detail = str(problem) if isinstance(problem, str | JournalError) else f"{type(problem).__name__}: {problem}"
    error = JournalCorruptError(f"stored event {stream_id}#{seq} is corrupt: {detail}")
    if isinstance(problem, BaseException):
        error.__cause__ = problem
    return error


def decode_row(stream_id: str, seq: int, body: bytes | str, checksum: int | None) -> EventEnvelope:
    """Verify and decode one stored row; ``checksum=None`` (a version-1 row) skips the checksum only."""
    if isinstance(body, str):
        try:
            raw = body.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise row_error(stream_id, seq, exc) from exc
    elif isinstance(body, (bytes, bytearray, memoryview)):
        raw = bytes(body)
    else:
        raise row_error(stream_id, seq, f"the body is {type(body).__name__}, not text")
    if checksum is not None:
        computed = row_checksum(stream_id, seq, raw)
        if type(checksum) is not int or checksum != computed:
            raise row_error(stream_id, seq, f"checksum mismatch (stored {checksum!r}, the row hashes to {computed})")
    try:
        data: Any = json.loads(raw.decode("utf-8"))
        envelope = decode_event(data)
    except Exception as exc:  # decode_event should raise JournalCorruptError; whatever it raises is damage
        raise row_error(stream_id, seq, exc) from exc
    if envelope.stream_id != stream_id or envelope.seq != seq:
        raise row_error(stream_id, seq, f"the row holds {envelope.stream_id}#{envelope.seq}")
    return envelope


def decode_range(
    stream_id: str,
    *,
    after: int,
    limit: int | None,
    head: int | None,
    rows: Iterable[tuple[int, bytes | str, int | None]],
) -> list[EventEnvelope]:
    """Decode the rows ``(seq, body, checksum)`` one read returned for ``seq > after`` (at most
    ``limit``), against the stream's ``head`` read in the same snapshot (``None``: no stream row).

    Exactly ``after + 1 ... min(head, after + limit)`` must be there: a missing row, a row past
    the head or events without a stream are reported, never skipped or returned. The error
    carries the rows decoded before the damage (`JournalCorruptError.intact`): one damaged
    row must not hide the good ones before it from a reader that goes row by row.
    """
    rows = list(rows)
    if head is None:
        if rows:
            raise row_error(stream_id, rows[0][0], "the stream has events but no head")
        return []
    if head < 0:  # never written: an empty stream's head is 0, and it never goes back
        raise row_error(stream_id, "head", f"the stream's row is damaged: the stored head is {head} (below 0)")
    first = max(after, 0) + 1
    last = head if limit is None else min(head, first + max(limit, 0) - 1)
    envelopes: list[EventEnvelope] = []
    expected = first
    try:
        for seq, body, checksum in rows:
            if type(seq) is not int:
                raise row_error(stream_id, expected, f"the row's seq is {seq!r}")
            if seq != expected or seq > last:
                problem = "is missing" if expected <= last else f"lies past the stream's head {head}"
                raise row_error(stream_id, min(seq, expected), f"the row {problem}")
            envelopes.append(decode_row(stream_id, seq, body, checksum))
            expected += 1
        if expected <= last:
            raise row_error(stream_id, expected, f"the row is missing (head {head})")
    except JournalCorruptError as exc:
        exc.intact = tuple(envelopes)
        raise
    return envelopes


def snapshot_row(stream_id: str, seq: int, body: bytes) -> tuple[bytes, int]:
    """The stored form of a snapshot body: its bytes and their checksum (the events' rule)."""
    body = bytes(body)
    return body, row_checksum(stream_id, seq, body)


def verify_snapshot(stream_id: str, seq: object, body: object, checksum: object) -> tuple[int, bytes]:
    """Check one stored snapshot row; `JournalCorruptError` naming ``stream@seq`` if it fails."""

    def damaged(problem: str) -> JournalCorruptError:
        return JournalCorruptError(f"stored snapshot {stream_id}@{seq} is corrupt: {problem}")

    if type(seq) is not int or seq < 1:
        raise damaged(f"its seq is {seq!r}")
    if isinstance(body, str):
        try:
            raw = body.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise damaged(str(exc)) from exc
    elif isinstance(body, (bytes, bytearray, memoryview)):
        raw = bytes(body)
    else:
        raise damaged(f"the body is {type(body).__name__}, not bytes")
    computed = row_checksum(stream_id, seq, raw)
    if type(checksum) is not int or checksum != computed:
        raise damaged(f"checksum mismatch (stored {checksum!r}, the body hashes to {computed})")
    return seq, raw
