"""The bounded server-sent-events parser both HTTP providers share (`trio_agent._models._http.SSEParser`)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest

from trio_agent._models import _http
from trio_agent._models._http import SSEEvent, SSEParser, SSEReader
from trio_agent.models import MalformedResponseError

BOM = b"\xef\xbb\xbf"


def parse(pieces: list[bytes], limit: int = 1 << 20) -> tuple[list[SSEEvent], bytes | None]:
    parser = SSEParser(limit, what="the test stream")
    events: list[SSEEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events, parser.json_body


def every_split(body: bytes) -> list[list[bytes]]:
    """*body* in one read, cut in two at every position, and byte by byte."""
    return [[body], *([body[:cut], body[cut:]] for cut in range(1, len(body))), [bytes([b]) for b in body]]


HEADS = [
    b" data: hello\n\n",  # a field named " data": no event, however the first read is cut
    b"\n\n data: hello\n\ndata: x\n\n",
    b"\n" + BOM + b'{"error": {"type": "rate_limit_error"}}',  # a BOM after byte 0 is no BOM
    BOM + b"\r\n  \t\r\ndata: hi\n\n",
    BOM + b'\n  {"error": "x"}',
    b" \t\r\n\r  [1, 2]",
    b"  \n\tdata: a\r\n\r\n",
    b"\r\n\r\ndata: a\n\n",
]


@pytest.mark.parametrize("body", HEADS)
def test_the_body_parses_the_same_wherever_the_network_splits_its_head(body: bytes) -> None:
    whole = parse([body])
    for pieces in every_split(body):
        assert parse(pieces) == whole, pieces


def test_the_head_rules() -> None:
    """A BOM only at byte 0, blank lines before the first field dropped, blanks that start a line kept."""
    assert parse([b" ", b"data: hello\n\n"]) == ([], None)  # the line is " data: hello"
    assert parse([b"\n", BOM + b'{"a": 1}']) == ([], None)  # BOM + "{" is a line of text, not JSON
    assert parse([BOM[:1], BOM[1:] + b"data: x\n\n"]) == ([SSEEvent("message", "x")], None)
    assert parse([b"\r\n \t\r", b'\n  {"a": 1}']) == ([], b'  {"a": 1}')
    assert parse([b"\r\n", b"\r\n", b"data: x\n\n"]) == ([SSEEvent("message", "x")], None)


def test_blanks_at_the_head_are_bounded() -> None:
    parser = SSEParser(64, what="the test stream")
    for _ in range(100):  # endless blank lines are dropped as they come: nothing grows
        assert parser.feed(b" \t\r\n" * 10) == []
    with pytest.raises(MalformedResponseError, match="larger than max_response_bytes=64"):
        parser.feed(b" " * 65)  # a line of blanks without its end is held, bounded as any line


REPLY = b"data: one\n\nevent: end\ndata: two\n\n"
REPLY_EVENTS = [SSEEvent("message", "one"), SSEEvent("end", "two")]


@pytest.mark.parametrize("bad", [b"data: \xff\xfe not UTF-8\n\n", b"data: " + b"x" * 200])
def test_events_before_an_unreadable_line_are_returned_however_the_reads_split_the_body(bad: bytes) -> None:
    """A reply then a line not UTF-8 (or over the bound): the events parsed before the line in the
    same read were dropped with it, so a finished reply became a malformed one when the network
    happened to deliver both in one read. The events come first, the error at the next feed."""
    for pieces in every_split(REPLY + bad):
        parser = SSEParser(100, what="the test stream")
        events: list[SSEEvent] = []
        with pytest.raises(MalformedResponseError, match=r"not valid UTF-8|larger than max_response_bytes=100"):
            for piece in pieces:
                events += parser.feed(piece)
            parser.check()
        assert events == REPLY_EVENTS, pieces
        with pytest.raises(MalformedResponseError):  # the parse is over for good
            parser.feed(b"data: more\n\n")


async def read_all(pieces: list[bytes], max_total_bytes: int) -> tuple[list[SSEEvent], MalformedResponseError | None]:
    async def body() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    events: list[SSEEvent] = []
    async with aclosing(body()) as source:
        parser = SSEParser(1 << 20, what="the test stream")
        reader = SSEReader(source, parser, what="the test stream", max_total_bytes=max_total_bytes)
        try:
            while (event := await reader.next()) is not None:
                events.append(event)
        except MalformedResponseError as exc:
            return events, exc
    return events, None


async def test_events_within_the_total_bound_are_returned_however_the_reads_split_the_body() -> None:
    """The total bound was checked after each read was parsed: its events were dropped when the
    read crossed the bound. The bytes within it are parsed, and their events stand."""
    body = REPLY + b"data: past the bound\n\n"
    for pieces in every_split(body):
        events, error = await read_all(pieces, len(REPLY) + 3)
        assert events == REPLY_EVENTS, pieces
        assert error is not None and "larger than max_response_bytes=" in str(error), pieces
    assert await read_all([body], len(body)) == ([*REPLY_EVENTS, SSEEvent("message", "past the bound")], None)


class _CountingPattern:
    """A compiled pattern that adds up how many bytes each of its searches was given."""

    def __init__(self, pattern: re.Pattern[bytes], scanned: list[int]) -> None:
        self._pattern, self._scanned = pattern, scanned

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._pattern, name)
        if not callable(method):
            return method

        def counted(string: Any, *args: Any, **kwargs: Any) -> Any:
            self._scanned[0] += len(string)
            return method(string, *args, **kwargs)

        return counted


def test_a_head_of_blanks_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The held head of blanks was rescanned whole on every read: 32 MiB of spaces (16 KiB gzipped)
    took over a minute of CPU in 64 KiB reads. Only new bytes are scanned now: what the parser's
    patterns are given grows with the body, not with its square."""
    scanned = [0]
    for name, value in list(vars(_http).items()):
        if isinstance(value, re.Pattern) and isinstance(value.pattern, bytes):
            monkeypatch.setattr(_http, name, _CountingPattern(value, scanned))
    size, read = 2**20, 1024
    parser = SSEParser(2 * size, what="the test stream")
    for _ in range(size // read):
        assert parser.feed(b" " * read) == []
    assert scanned[0] <= 2 * size
