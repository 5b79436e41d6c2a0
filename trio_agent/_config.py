"""Validation of configuration values shared by several parts."""

from __future__ import annotations

import sys
import unicodedata

from ._errors import ConfigError, TrioAgentError
from ._util import safe_repr

__all__ = ["finite_seconds", "seconds_problem", "short_repr", "validate_id", "validate_limit", "validate_timeout"]

MAX_TIMEOUT = 2**31 / 1000  # the largest timer the reference accepts, in seconds (~24.8 days)

_LARGEST_FLOAT = sys.float_info.max  # a number above it (an int: float() raises) is no float's


def seconds_problem(value: object, *, allow_zero: bool = False, maximum: float | None = None) -> str | None:
    """What is wrong with *value* as a finite number of seconds (``"must be ..., got ..."``), or
    ``None``: an int or float (not a bool), > 0 (>= 0 with *allow_zero*), at most *maximum* (else
    the largest float).

    Compared as given, never through float() or math.isfinite(): for an int too large for a float
    both raise OverflowError, and Python compares ints and floats exactly (NaN fails every
    comparison, infinity the upper bound). The value is printed through `short_repr`."""
    top = _LARGEST_FLOAT if maximum is None else maximum
    if type(value) is float and 0 < value <= top:  # the usual case, judged alike (NaN fails it)
        return None
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if number and (value >= 0 if allow_zero else value > 0) and value <= top:  # type: ignore[operator]
        return None
    bounds = (">= 0" if allow_zero else "> 0") + ("" if maximum is None else f" and at most {maximum:g}")
    return f"must be a finite number of seconds {bounds}, got {short_repr(value)}"


def finite_seconds(
    value: object,
    name: str,
    *,
    allow_zero: bool = False,
    maximum: float | None = None,
    error: type[TrioAgentError] = ConfigError,
) -> float:
    """*value* as a float number of seconds (the rules of `seconds_problem`), else *error* naming
    *name*: the one check every duration of the package goes through."""
    problem = seconds_problem(value, allow_zero=allow_zero, maximum=maximum)
    if problem is not None:
        raise error(f"{name} {problem}")
    return float(value)  # type: ignore[arg-type]  # an int or float within a float's range


def validate_timeout(value: object, *, name: str) -> float:
    """A positive, finite number of seconds no larger than `MAX_TIMEOUT`."""
    if type(value) is float and 0 < value <= MAX_TIMEOUT:  # the usual case (NaN fails the comparison)
        return value
    return finite_seconds(value, name, maximum=MAX_TIMEOUT)


def short_repr(value: object) -> str:
    """*value*'s repr, cut short: a huge int's repr is thousands of digits (and past 4300 raises)."""
    try:
        text = repr(value)
    except Exception:  # the caller's __repr__ raised, or an int past sys.get_int_max_str_digits()
        return "an int too large to print" if type(value) is int else safe_repr(value)
    text = str.__str__(text)  # a str subclass's own slicing is the caller's code too
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def validate_limit(value: object, *, name: str, minimum: int = 1) -> int:
    """A whole number (an int, not a bool) of at least *minimum* (a positive one by default)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be a whole number >= {minimum}, got {short_repr(value)}")
    return value


# Unicode categories an id may not hold: controls (C0, DEL and C1, e.g. U+0085 NEXT LINE, U+009B
# CSI, which terminals act on), format characters (invisible: zero-width spaces, bidi overrides,
# so two ids could look the same) and the line and paragraph separators.
_REFUSED_CATEGORIES = {
    "Cc": "a control",
    "Cf": "an invisible format",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def validate_id(value: object, *, name: str, max_length: int = 200, stored: bool = False) -> str:
    """An id that names streams and rows: non-empty text of at most *max_length* characters,
    encodable as UTF-8 (no lone surrogates), without ``/`` (the separator of stream ids),
    control characters (C0, DEL, C1), format characters or line/paragraph separators. Checked
    at the door, so a bad id fails alone and never reaches a store's shared batch.

    ``stored=True`` is for an id that may name something already stored and is only read: it
    keeps the rule ids were made under before C1 controls, format characters and separators
    were refused (C0 controls and DEL only), so such a session can still be read and served.
    """
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string, not {value!r}")
    if len(value) > max_length:
        raise ConfigError(f"{name} must be at most {max_length} characters, not {len(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{name} must be valid Unicode text (it has a lone surrogate): {value!r}") from None
    if "/" in value:
        raise ConfigError(f"{name} must not contain '/': {value!r}")
    if value.isascii() or stored:  # the usual id; in ASCII the refused characters are C0 and DEL
        bad = next((char for char in value if ord(char) < 32 or ord(char) == 127), None)
    else:
        bad = next((char for char in value if unicodedata.category(char) in _REFUSED_CATEGORIES), None)
    if bad is not None:
        kind = _REFUSED_CATEGORIES[unicodedata.category(bad)]
        raise ConfigError(
            f"{name} must not contain control characters: it has {kind} character U+{ord(bad):04X}: {value!r}"
        )
    return value
