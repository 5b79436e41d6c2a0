"""How every worker-side connection is made (submitters, workers, listeners, live subscribers)."""

from __future__ import annotations

from collections.abc import Mapping

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow

from .._errors import ConfigError, JournalUnavailableError

__all__ = ["connect", "connection_info"]

_Conn = psycopg.Connection[TupleRow]

_PG_INT_MAX = 2**31 - 1  # the largest value of an integer setting (MAX_TIMEOUT in ms is one more)


def connection_info(dsn: str, *, name: str, settings: Mapping[str, int] | None = None) -> str:
    """*dsn* with what every worker connection sets: its name, TCP keepalives and a user
    timeout (a vanished server ends the connection), and server *settings* (``-c name=value``,
    e.g. timeouts in ms, each at most the server's int: ``2**31 - 1``, ~24.8 days); the DSN's own
    settings (``options`` included) are kept. `ConfigError` for a DSN that is not one."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        raise ConfigError("the PostgreSQL DSN is not a valid connection string or URI") from None
    extra: dict[str, str | int | None] = {
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": 30_000,
    }
    extra = {key: value for key, value in extra.items() if key not in params}
    extra.setdefault("connect_timeout", params.get("connect_timeout", 10))
    extra.setdefault("application_name", params.get("application_name", name))
    if settings:
        # PostgreSQL's integer settings are 32-bit: a longer timeout would refuse every connection.
        values = {key: min(value, _PG_INT_MAX) for key, value in settings.items()}
        options = " ".join([str(params.get("options") or ""), *(f"-c {k}={v}" for k, v in values.items())])
        extra["options"] = options.strip()
    return make_conninfo(dsn, **extra)


def connect(conninfo: str) -> _Conn:
    try:
        return psycopg.connect(conninfo, autocommit=True)
    except psycopg.Error as exc:
        raise JournalUnavailableError(f"cannot connect to PostgreSQL: {str(exc).strip()}") from None
