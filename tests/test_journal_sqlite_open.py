"""The SQLite store's opens and its writer's per-item refusals, on the failure paths.

* A file that is not a journal of ours (another application's database, another journal
  format) is refused before anything is written to it: it stays byte for byte as it was.
* A failed write-open closes its connection before raising.
* A read-only open tells damage (`JournalCorruptError`) from a file it could not open or lock
  (`JournalUnavailableError`), as the write-open does.
* An append too big for SQLite fails alone, with a definite `JournalError`; the other
  appends of its group commit land.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import trio_agent._journal._sqlite as sqlite_module
from trio_agent._errors import JournalCorruptError
from trio_agent._journal._sqlite import open_sqlite_store


def _foreign_database(path: Path) -> None:
    """Another application's database, in SQLite's default (rollback journal) mode."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE users(id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO users(name) VALUES ('alice')")
        conn.commit()


def _other_format(path: Path) -> None:
    """A journal of a format this code does not read, in rollback journal mode."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE journal_meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO journal_meta(key, value) VALUES ('format', 'trio_agent.journal/99')")
        conn.commit()


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a database, " * 512)


@pytest.fixture
def recorded_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[sqlite3.Connection]]:
    """Every connection the store makes."""
    made: list[sqlite3.Connection] = []
    real = sqlite_module._connect

    def connect(path: str, *, readonly: bool) -> sqlite3.Connection:
        conn = real(path, readonly=readonly)
        made.append(conn)
        return conn

    monkeypatch.setattr(sqlite_module, "_connect", connect)
    yield made


def _is_closed(conn: sqlite3.Connection) -> bool:
    try:
        conn.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


# ---------------------------------------------------------------- a failed write-open


@pytest.mark.parametrize(
    "make",
    [_foreign_database, _other_format, _garbage],
    ids=["another_application", "another_format", "garbage"],
)
async def test_a_failed_write_open_closes_its_connection(
    tmp_path: Path, recorded_connections: list[sqlite3.Connection], make: Callable[[Path], None]
) -> None:
    """Closed before the error is raised: a caller that keeps the error (its traceback holds the
    open's frames) held the file and its -wal/-shm open for as long."""
    path = tmp_path / "file.db"
    make(path)
    with pytest.raises(JournalCorruptError) as kept:
        async with open_sqlite_store(path):
            pass
    assert kept.value is not None  # still held here, traceback and all
    assert recorded_connections
    assert all(_is_closed(conn) for conn in recorded_connections)
