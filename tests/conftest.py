"""Shared fixtures: a throw-away PostgreSQL cluster for the journal store tests.

``postgres_dsn`` starts one cluster per test session (see ``tests/pg_cluster.py``)
and skips the tests that need it when the machine has no PostgreSQL server
binaries, unless ``CI=true``: then a missing server fails them instead.
``fresh_pg_schema`` gives each test a schema name of its own, so tests never
see each other's data.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest
from pg_cluster import PostgresUnavailable, pg_cluster


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """The DSN of a throw-away PostgreSQL cluster shared by the whole session."""
    with contextlib.ExitStack() as stack:
        try:
            dsn = stack.enter_context(pg_cluster())
        except PostgresUnavailable as exc:
            if os.environ.get("CI") == "true":
                pytest.fail(f"CI=true but PostgreSQL is unavailable: {exc}", pytrace=False)
            pytest.skip(f"PostgreSQL is unavailable: {exc}")
        yield dsn


@pytest.fixture
def fresh_pg_schema(postgres_dsn: str) -> Iterator[str]:
    """A schema name no other test uses (``t_<hex>``); dropped after the test."""
    schema = f"t_{uuid.uuid4().hex}"
    yield schema
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '5s'")
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
