"""Validation of configuration values shared by several parts."""

from __future__ import annotations

import math

from ._errors import ConfigError

__all__ = ["validate_limit", "validate_timeout"]

MAX_TIMEOUT = 2**31 / 1000  # the largest timer the reference accepts, in seconds (~24.8 days)


def validate_timeout(value: object, *, name: str) -> float:
    """A positive, finite number of seconds no larger than `MAX_TIMEOUT`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0 or seconds > MAX_TIMEOUT:
        raise ConfigError(f"{name} must be > 0 and <= {MAX_TIMEOUT:g} seconds, got {value!r}")
    return seconds


def validate_limit(value: object, *, name: str) -> int:
    """A positive whole number."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    return value
