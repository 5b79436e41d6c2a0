"""What JSON a payload may be: the one rule for every event, answer and wire value we keep.

Exactly JSON's types (``None``, ``bool``, ``str``, ``int`` of at most `MAX_JSON_INT_BITS` bits,
finite ``float``, ``list``, ``dict`` with ``str`` keys), nested at most `MAX_JSON_DEPTH` containers
deep. `is_json` answers fast for the common case; `explain_json` names where a value fails;
`json_problem` says why, or ``None``.
"""

from __future__ import annotations

import math

__all__ = ["MAX_JSON_DEPTH", "MAX_JSON_INT_BITS", "NOT_JSON", "copy_if_json", "explain_json", "is_json", "json_problem"]

_LEAVES = frozenset({type(None), bool, str, int})  # an int within `MAX_JSON_INT_BITS`
_CONTAINERS = frozenset({dict, list})


MAX_JSON_DEPTH = 200
"""How deeply a payload's containers may nest. Fixed, so that what is accepted does not depend on
how deep the caller's stack is, and so that every later step (the stored text, reading it back)
has room below the interpreter's recursion limit."""

MAX_JSON_INT_BITS = 2048
"""How large an integer a payload may hold: at most this many bits (617 decimal digits). Python
refuses to turn an integer of more than ``sys.get_int_max_str_digits()`` digits (4300 by default,
never less than 640 when limited) into text or back, so a larger one would be accepted here and
then fail its encoding later (the journal, the wire, the model's text). 2048 bits stay below the
lowest limit a process can set."""

# An int of at most MAX_JSON_INT_BITS bits: _INT_LOW < x < _INT_HIGH.
_INT_HIGH = 1 << MAX_JSON_INT_BITS
_INT_LOW = -_INT_HIGH


def is_json(value: object, depth: int = 0) -> bool:
    """The common case, fast: exact JSON types (no path text built); anything else is judged by
    `explain_json`, which also names where it fails. Leaves and empty containers are judged in
    the loop, without a call each: most payloads are flat."""
    kind = type(value)
    if kind in _LEAVES:
        return kind is not int or _INT_LOW < value < _INT_HIGH  # type: ignore[operator]
    if depth >= MAX_JSON_DEPTH:
        return False
    if kind is dict:
        low, high = _INT_LOW, _INT_HIGH  # locals: read once per container, not per item
        for key, item in value.items():  # type: ignore[attr-defined]
            if type(key) is not str:
                return False
            inner = type(item)
            if inner in _LEAVES:
                if inner is int and not low < item < high:
                    return False
            elif (inner not in _CONTAINERS or item) and not is_json(item, depth + 1):
                return False
        return True
    if kind is list:
        low, high = _INT_LOW, _INT_HIGH
        for item in value:  # type: ignore[attr-defined]
            inner = type(item)
            if inner in _LEAVES:
                if inner is int and not low < item < high:
                    return False
            elif (inner not in _CONTAINERS or item) and not is_json(item, depth + 1):
                return False
        return True
    return kind is float and math.isfinite(value)  # type: ignore[arg-type]


NOT_JSON: object = object()
"""What `copy_if_json` returns for a value that is not JSON."""


def copy_if_json(value: object, depth: int = 0) -> object:
    """`is_json` and a copy of the containers (dicts and lists; leaves are shared) in one walk:
    the copy when *value* is JSON, `NOT_JSON` otherwise. For a value that is frozen and then
    checked, where two walks would cost twice."""
    kind = type(value)
    if kind in _LEAVES:
        return value if kind is not int or _INT_LOW < value < _INT_HIGH else NOT_JSON  # type: ignore[operator]
    if kind is dict or kind is list:
        if depth >= MAX_JSON_DEPTH:
            return NOT_JSON
        copy = value.copy()  # type: ignore[attr-defined]
        low, high = _INT_LOW, _INT_HIGH
        # Replacing an item's value does not disturb the iteration over the copy's own items.
        for key, item in copy.items() if kind is dict else enumerate(copy):
            if kind is dict and type(key) is not str:
                return NOT_JSON
            inner = type(item)
            if inner in _LEAVES:
                if inner is int and not low < item < high:
                    return NOT_JSON
            elif inner is dict or inner is list:
                # An empty one is judged here, as `is_json` judges it (at any depth): only a
                # container with items counts towards `MAX_JSON_DEPTH`.
                item = copy_if_json(item, depth + 1) if item else item.copy()
                if item is NOT_JSON:
                    return NOT_JSON
                copy[key] = item
            elif not (inner is float and math.isfinite(item)):
                return NOT_JSON
        return copy
    return value if kind is float and math.isfinite(value) else NOT_JSON  # type: ignore[arg-type]


def explain_json(value: object, path: str, depth: int = 0) -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        bits = int.bit_length(value)
        if bits > MAX_JSON_INT_BITS:
            raise ValueError(f"{path} is an integer too large for JSON ({bits} bits, at most {MAX_JSON_INT_BITS})")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} is not a finite number: {value!r}")
        return
    if isinstance(value, (list, dict)) and depth >= MAX_JSON_DEPTH:
        raise ValueError(f"{path} nests containers deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, list):
        for index, item in enumerate(value):
            explain_json(item, f"{path}[{index}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path} has a non-string key {key!r}")
            explain_json(item, f"{path}.{key}", depth + 1)
        return
    raise ValueError(f"{path} is not JSON: {type(value).__name__}")


def json_problem(value: object, path: str, *, depth: int = 0) -> str | None:
    """Why ``value``, found ``depth`` containers deep in an event's JSON field, is no JSON an event may
    carry (a number that is not finite, containers nested past `MAX_JSON_DEPTH` ...), naming where;
    ``None`` if it is. For a check before the event is made (at the door, not in the middle of a run)."""
    if is_json(value, depth):
        return None
    try:
        explain_json(value, path, depth)
    except ValueError as exc:
        return str(exc)
    return None
