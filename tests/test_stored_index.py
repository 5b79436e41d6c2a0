"""`StoredIndex`: a mapping partly kept as the JSON text a snapshot stored, equal to a dict under any use."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent._errors import JournalCorruptError
from trio_agent._journal._stored import StoredIndex, _packed, dumps

# Keys that stress the lookup by encoded form: quotes, backslashes, colons, non-ASCII, prefixes of each other.
KEYS = st.text(alphabet='ab"\\:é', max_size=4)
VALUES = st.integers(-5, 5)


def index(text: bytes | memoryview | None = None, count: int = 0) -> StoredIndex[int]:
    def decode(key: str, row: Any) -> int:
        if type(row) is not int:
            raise TypeError(f"{key!r}: {row!r} is not an int")
        return row

    return StoredIndex(encode=lambda key, value: value, decode=decode, what="numbers", line=text, count=count)


def line(text: bytes, keys: list[str]) -> bytes:
    """A stored line: the keys' digests, a space, the JSON text."""
    return _packed(keys).hex().encode() + b" " + text


def json_of(stored_line: bytes) -> Any:
    return json.loads(stored_line.partition(b" ")[2])


def stored(items: dict[str, int]) -> StoredIndex[int]:
    text, count = StoredIndex.of(items, encode=lambda k, v: v, decode=lambda k, r: r, what="numbers").to_text()
    return index(text, count)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("get"), KEYS),
        st.tuples(st.just("set"), KEYS, VALUES),
        st.tuples(st.just("del"), KEYS),
        st.tuples(st.just("contains"), KEYS),
        st.tuples(st.just("len")),
        st.tuples(st.just("save")),  # to_text, then read back as a new index (a close and a reopen)
    ),
    max_size=25,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(KEYS, VALUES, max_size=6), OPS)
def test_a_stored_index_behaves_as_the_dict_it_stands_for(start: dict[str, int], ops: list[tuple[Any, ...]]) -> None:
    model = dict(start)
    subject = stored(start)
    for op in ops:
        if op[0] == "get":
            assert subject.get(op[1]) == model.get(op[1])
        elif op[0] == "set":
            subject[op[1]] = model[op[1]] = op[2]
        elif op[0] == "del":
            if op[1] in model:
                del model[op[1]]
                del subject[op[1]]
            else:
                with pytest.raises(KeyError):
                    del subject[op[1]]
        elif op[0] == "contains":
            assert (op[1] in subject) == (op[1] in model)
        elif op[0] == "len":
            assert len(subject) == len(model)
        else:
            text, count = subject.to_text()
            assert json_of(text) == model and count == len(model)
            # Read back from bytes, or (as a snapshot does) from a view of a larger body, not copied.
            subject = index(memoryview(b"<" + text + b">")[1:-1] if count % 2 else text, count)
    assert copy.deepcopy(subject) == model  # a projection's snapshot() deep-copies its indexes
    assert subject == model and dict(subject.items()) == model


def test_a_new_key_is_answered_without_decoding_and_the_text_is_reused() -> None:
    subject = stored({"r1": 1, "r2": 2})
    assert subject.get("r3") is None and "r3" not in subject and subject.stored
    subject["r3"] = 3
    assert len(subject) == 3 and subject.stored
    text, count = subject.to_text()
    assert text == line(b'{"r1":1,"r2":2,"r3":3}', ["r1", "r2", "r3"]) and count == 3 and subject.stored
    assert subject["r2"] == 2 and not subject.stored  # a stored key: decoded once
    assert dumps({"a": 1}) == b'{"a":1}'


def test_text_it_cannot_read_is_reported_when_needed_and_stays() -> None:
    subject = index(line(b'{"r1":"one"}', ["r1"]), 1)
    assert subject.get("r2") is None  # not there: nothing decoded
    for _ in range(2):
        with pytest.raises(JournalCorruptError, match="stored numbers cannot be decoded: 'r1'"):
            subject.get("r1")
    assert subject.stored
    with pytest.raises(JournalCorruptError, match="hold 1 entries, not 2"):
        index(line(b'{"r1":1}', ["r1", "r2"]), 2)["r1"]
    # Digests that do not fit the count (or are not hex): every lookup asks the text itself.
    for bad in (b"zz " + b'{"r1":1}', line(b'{"r1":1}', [])):
        unsure = index(bad, 1)
        assert unsure.get("r2") is None and not unsure.stored and unsure["r1"] == 1
    with pytest.raises(JournalCorruptError, match="cannot be decoded"):
        index(b'{"r1":1}', 1).get("r2")  # no digests and no text: a line this code never writes
