"""What the HTTP providers share: base-URL validation and ``retry-after`` parsing."""

from __future__ import annotations

import datetime
import email.utils
import math
import time

import httpx

from .._errors import ProviderConfigError

__all__ = ["checked_base_url", "retry_after_seconds"]


def checked_base_url(base_url: object, *, provider: str, source: str, example: str) -> str:
    """*base_url* without a trailing slash, or a `ProviderConfigError` naming *source* and the problem."""
    problem: str | None = None
    url: httpx.URL | None = None
    if not isinstance(base_url, str):
        problem = "it is not a string"
    else:
        try:
            url = httpx.URL(base_url.strip())
        except (httpx.InvalidURL, TypeError, ValueError) as exc:
            problem = str(exc)
        else:
            if url.scheme not in ("http", "https"):
                problem = "the scheme must be http or https"
            elif not url.host:
                problem = "it has no host"
            elif url.query or url.fragment:
                problem = "it must not have a query or fragment"
    if problem is not None or url is None:
        raise ProviderConfigError(
            f"invalid {source} {base_url!r} for the {provider} provider: {problem}; expected a URL such as {example!r}"
        )
    return str(url).rstrip("/")


def retry_after_seconds(headers: httpx.Headers) -> float | None:
    """The server's wait hint in seconds: ``retry-after-ms``, else ``retry-after`` (seconds or an HTTP date)."""
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / divisor
        except ValueError:
            continue
        if math.isfinite(seconds):
            return max(seconds, 0.0)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return max(when.timestamp() - time.time(), 0.0)
