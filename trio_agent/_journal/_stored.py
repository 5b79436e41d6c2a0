"""A mapping whose older entries may still be the JSON text a snapshot stored them as.

A stream keeps two indexes that grow with its age and are rarely read back: the
command ids it took (the replay cache) and the requests that ended (kept so an id
is never reused). A reopen should not pay for decoding them, so a snapshot stores
each as one JSON object ``{key: row, ...}`` and `StoredIndex` keeps that text
as it is.

Rules
=====

* Stored form (`to_text`): one line, the CRC32 of every stored key (little-endian
  32-bit words, in hex), a space, then the JSON object.
* Entries set after the text was read live in a dict beside it and shadow it.
* A key is looked up in that dict first, then by its CRC32 among the stored
  keys' (a set built from the hex on the first lookup): absent there means
  absent, the usual answer for a new id, in constant time whatever the size of
  the text. A hit decodes the whole text once (a CRC shared by two keys only
  costs that decode).
* Iterating, sizing with entries that may shadow the text, deleting a stored key,
  or a failure to decode decode the text first (a failure is `JournalCorruptError`
  and leaves the text in place, so asking again reports it again; `damage` keeps
  what failed, for the owner to rebuild the entries elsewhere and hand them to
  `rebuild`, which replaces the text and keeps the entries set since).
* `to_text` writes the stored text back with the entries since appended, and
  encodes everything only when the text was decoded or may hold one of them.
"""

from __future__ import annotations

import copy
import json
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Generic, TypeVar, overload

from ._errors import JournalCorruptError

V = TypeVar("V")
T = TypeVar("T")
_ABSENT: Any = object()

__all__ = ["StoredIndex", "dumps"]


def dumps(data: Any) -> bytes:
    """Compact ASCII JSON, as every line of a snapshot is written."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode("ascii")


def _crc(key: str) -> int:
    return zlib.crc32(key.encode("utf-8", "surrogatepass"))


def _packed(keys: Iterable[str]) -> bytes:
    crcs = [_crc(key) for key in keys]
    return struct.pack(f"<{len(crcs)}I", *crcs)


class StoredIndex(MutableMapping[str, V], Generic[V]):
    """Key -> value, partly as stored JSON text (see the module rules).

    ``encode(key, value)`` gives a value's row (JSON-compatible); ``decode(key, row)``
    takes it back, raising for a row it cannot read; ``what`` names the index in errors.
    """

    __slots__ = ("_count", "_crcs", "_damage", "_decode", "_encode", "_items", "_packed", "_text", "_what")

    def __init__(
        self,
        *,
        encode: Callable[[str, V], Any],
        decode: Callable[[str, Any], V],
        what: str,
        line: bytes | memoryview | None = None,
        count: int = 0,
    ) -> None:
        """``line`` is what `to_text` wrote (``count`` entries); ``None`` for a new, empty index."""
        self._encode = encode
        self._decode = decode
        self._what = what
        self._count = count  # the entries in the text
        self._items: dict[str, V] = {}
        self._crcs: frozenset[int] | None = None  # the stored keys' CRCs, once a lookup needed them
        # None once decoded (or never stored); a view of the snapshot's bytes is not copied until decoded.
        self._text: bytes | memoryview | None = None
        self._packed = b""
        self._damage: str | None = None  # why the text did not decode, once it did not
        if line is not None:
            width = 8 * count  # the digests' hex, as `to_text` writes it
            if len(line) > width and bytes(line[width : width + 1]) == b" ":
                head, self._text = bytes(line[:width]), line[width + 1 :]
            else:  # not the layout this code writes: the first space decides (a copy, never the usual case)
                head, space, self._text = bytes(line).partition(b" ")
                head = head if space else b"?"
            try:
                self._packed = bytes.fromhex(head.decode("ascii"))
            except ValueError:
                self._packed = b"?"  # unusable digests: lookups fall back to decoding the text

    @property
    def stored(self) -> bool:
        """Whether some entries are still undecoded text."""
        return self._text is not None

    @property
    def damage(self) -> str | None:
        """Why the stored text did not decode, if a lookup tried and it did not (else ``None``)."""
        return self._damage

    def rebuild(self, items: Mapping[str, V]) -> None:
        """Replace the stored text by ``items``, the entries it stands for (rebuilt from what the
        text was made of): the entries set since keep shadowing them. One step, no checkpoint."""
        stored = dict(items)
        stored.update(self._items)
        self._items = stored
        self._text = None
        self._count, self._crcs, self._packed, self._damage = 0, None, b"", None

    def _may_hold(self, key: str) -> bool:
        if self._text is None:
            return False
        if self._crcs is None:
            if len(self._packed) != 4 * self._count:
                return True  # no usable digests: the text itself decides
            self._crcs = frozenset(struct.unpack(f"<{self._count}I", self._packed))
        return _crc(key) in self._crcs

    def _load(self) -> None:
        if self._text is None:
            return
        try:
            rows = json.loads(bytes(self._text))
            if not isinstance(rows, dict):
                raise TypeError(f"expected a JSON object, got {type(rows).__name__}")
            stored = {key: self._decode(key, row) for key, row in rows.items()}
        except Exception as exc:
            self._damage = f"the stored {self._what} cannot be decoded: {exc}"
            raise JournalCorruptError(self._damage) from exc
        if len(stored) != self._count:
            self._damage = f"the stored {self._what} hold {len(stored)} entries, not {self._count}"
            raise JournalCorruptError(self._damage)
        stored.update(self._items)
        self._items = stored
        self._text = None

    def __getitem__(self, key: str) -> V:
        try:
            return self._items[key]
        except KeyError:
            if not self._may_hold(key):
                raise
        self._load()
        return self._items[key]

    @overload
    def get(self, key: str, /) -> V | None: ...

    @overload
    def get(self, key: str, default: V | T, /) -> V | T: ...

    def get(self, key: str, default: object = None, /) -> object:
        # Not `Mapping.get`: a new key (the usual lookup) would raise and catch a KeyError twice.
        value = self._items.get(key, _ABSENT)
        if value is not _ABSENT:
            return value
        if isinstance(key, str) and self._may_hold(key):
            self._load()
            return self._items.get(key, default)
        return default

    def __contains__(self, key: object) -> bool:
        if key in self._items:
            return True
        if isinstance(key, str) and self._may_hold(key):
            self._load()
            return key in self._items
        return False

    def __setitem__(self, key: str, value: V) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        if self._may_hold(key):
            self._load()
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(self._items)

    def __len__(self) -> int:
        if self._text is not None and any(self._may_hold(key) for key in self._items):
            self._load()
        return len(self._items) + (self._count if self._text is not None else 0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        self._load()
        return self._items == dict(other.items())

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __deepcopy__(self, memo: dict[int, Any]) -> StoredIndex[V]:
        # A view of a snapshot's bytes cannot be copied as it is: the copy holds the text itself.
        copied: StoredIndex[V] = StoredIndex(encode=self._encode, decode=self._decode, what=self._what)
        copied._count, copied._crcs, copied._packed = self._count, self._crcs, self._packed
        copied._damage = self._damage
        copied._text = None if self._text is None else bytes(self._text)
        copied._items = copy.deepcopy(self._items, memo)
        return copied

    def __repr__(self) -> str:
        if self._text is not None:
            return f"StoredIndex({self._what}: {self._count} stored, {len(self._items)} since)"
        return f"StoredIndex({self._what}: {len(self._items)})"

    def to_text(self, keep: Callable[[str, V], bool] = lambda key, value: True) -> tuple[bytes, int]:
        """The JSON object text of the entries (those ``keep`` keeps of the ones not stored) and their
        number: the stored text as it was read, the entries since appended after it."""
        if self._text is not None and (
            len(self._packed) != 4 * self._count or any(self._may_hold(key) for key in self._items)
        ):
            self._load()  # one may shadow a stored entry (or the digests are unusable): write the decoded whole
        rows = {key: self._encode(key, value) for key, value in self._items.items() if keep(key, value)}
        if self._text is None:
            return _packed(rows).hex().encode("ascii") + b" " + dumps(rows), len(rows)
        text = bytes(self._text)
        if rows:
            text = text[:-1] + (b"," if self._count else b"") + dumps(rows)[1:]
        return (self._packed + _packed(rows)).hex().encode("ascii") + b" " + text, self._count + len(rows)

    @classmethod
    def of(
        cls,
        items: Mapping[str, V],
        *,
        encode: Callable[[str, V], Any],
        decode: Callable[[str, Any], V],
        what: str,
    ) -> StoredIndex[V]:
        """An index of decoded ``items``."""
        index = cls(encode=encode, decode=decode, what=what)
        index._items = dict(items)
        return index
