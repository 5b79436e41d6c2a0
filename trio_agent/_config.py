"""Validation of configuration values shared by several parts."""

from __future__ import annotations

import unicodedata

from ._errors import ConfigError

__all__ = ["short_repr", "validate_id", "validate_limit", "validate_timeout"]

MAX_TIMEOUT = 2**31 / 1000  # the largest timer the reference accepts, in seconds (~24.8 days)


def validate_timeout(value: object, *, name: str) -> float:
    """A positive, finite number of seconds no larger than `MAX_TIMEOUT`."""
    if type(value) is float and 0 < value <= MAX_TIMEOUT:  # the usual case (NaN fails the comparison)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    # Compared as given, before float(): an int too large for a float would raise OverflowError
    # there; Python compares ints and floats exactly (and NaN fails the comparison).
    if not 0 < value <= MAX_TIMEOUT:
        raise ConfigError(f"{name} must be > 0 and <= {MAX_TIMEOUT:g} seconds, got {short_repr(value)}")
    return float(value)


def short_repr(value: object) -> str:
    """*value*'s repr, cut short: a huge int's repr is thousands of digits (and past 4300 raises)."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return "an int too large to print"
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def validate_limit(value: object, *, name: str) -> int:
    """A positive whole number."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {short_repr(value)}")
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
