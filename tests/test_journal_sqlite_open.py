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
import hashlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_agent._journal._sqlite as sqlite_module
from trio_agent._errors import ConfigError, JournalCorruptError, JournalError, JournalUnavailableError
from trio_agent._journal._durable import open_journal
from trio_agent._journal._events import EventEnvelope, RequestAccepted, RequestStarted
from trio_agent._journal._sqlite import open_sqlite_store
from trio_agent._journal._store import AppendBatch, AppendResult, Lease, stream_id_for


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


# ---------------------------------------------------------------- a file that is not ours


NOT_OURS: dict[str, tuple[Callable[[Path], None], str]] = {
    "another_application": (_foreign_database, "another application's SQLite database"),
    "another_format": (_other_format, "journal/99"),
}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("kind", list(NOT_OURS))
async def test_a_file_that_is_not_a_journal_is_refused_byte_for_byte_unchanged(tmp_path: Path, kind: str) -> None:
    """Refused before WAL mode is set: the refusal says the file was left unchanged, and it is
    (its header still says rollback journal, and no -wal or -shm file is left beside it)."""
    make, message = NOT_OURS[kind]
    path = tmp_path / "file.db"
    make(path)
    before = _digest(path)
    with pytest.raises(JournalCorruptError, match=message):
        async with open_sqlite_store(path):
            pass
    assert _digest(path) == before
    assert _listing(tmp_path) == ["file.db"]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


async def test_a_new_file_and_a_journal_without_its_format_row_still_open_in_wal(tmp_path: Path) -> None:
    """The checks moved before WAL mode refuse only what is not ours: an empty file, and a
    journal's tables without the format row, are still taken, in WAL mode."""
    empty = tmp_path / "empty.db"
    empty.touch()
    bare = tmp_path / "bare.db"
    with contextlib.closing(sqlite3.connect(bare)) as conn:
        conn.execute("CREATE TABLE journal_meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.commit()
    for path in (empty, bare, tmp_path / "new.db"):
        async with open_sqlite_store(path) as store:
            assert store._writer is not None
            assert store._writer.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        with contextlib.closing(sqlite3.connect(path)) as conn:
            assert conn.execute("SELECT value FROM journal_meta WHERE key='format'").fetchone() == (
                sqlite_module.STORE_FORMAT,
            )


# ---------------------------------------------------------------- damage or unavailable, read-only too


async def _new_journal(path: Path) -> None:
    async with open_sqlite_store(path):
        pass


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The file locked by another connection, as another process's exclusive transaction does
    (SQLite's locks conflict between the connections of one process as between processes)."""
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode=EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        yield
    finally:
        holder.close()


@pytest.mark.parametrize("readonly", [True, False], ids=["readonly", "write"])
async def test_a_locked_journal_is_unavailable_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded_connections: list[sqlite3.Connection], readonly: bool
) -> None:
    path = tmp_path / "journal.db"
    await _new_journal(path)
    recorded_connections.clear()
    monkeypatch.setattr(sqlite_module, "_BUSY_TIMEOUT", 0.05)  # busy at once, not after 30 s
    with _locked(path), pytest.raises(JournalUnavailableError, match="locked"):
        async with open_sqlite_store(path, readonly=readonly):
            pass
    assert recorded_connections
    assert all(_is_closed(conn) for conn in recorded_connections)
    async with open_sqlite_store(path, readonly=readonly):  # the lock gone, it opens
        pass


@pytest.mark.parametrize("readonly", [True, False], ids=["readonly", "write"])
async def test_a_directory_is_unavailable_not_corrupt(tmp_path: Path, readonly: bool) -> None:
    """SQLite cannot open it (as a read-only directory, or one without permission): nothing says it is damaged."""
    path = tmp_path / "journal.db"
    path.mkdir()
    with pytest.raises(JournalUnavailableError, match="unable to open"):
        async with open_sqlite_store(path, readonly=readonly):
            pass


@pytest.mark.parametrize("make", [_garbage, _foreign_database], ids=["garbage", "another_application"])
async def test_a_read_only_open_still_calls_damage_corrupt(tmp_path: Path, make: Callable[[Path], None]) -> None:
    path = tmp_path / "file.db"
    make(path)
    with pytest.raises(JournalCorruptError):
        async with open_sqlite_store(path, readonly=True):
            pass


# ---------------------------------------------------------------- an append too big for SQLite


def _append(lease: Lease, agent: str, prompt: str) -> AppendBatch:
    stream = stream_id_for(lease.session_id, agent)
    event = RequestAccepted(request_id="r", command_id="c", input={"prompt": prompt})
    envelope = EventEnvelope(stream_id=stream, seq=1, event=event, recorded_at=1.0)
    return AppendBatch(lease.session_id, stream, lease.token, [envelope])


async def test_an_append_too_big_for_sqlite_fails_alone_in_its_group_commit(tmp_path: Path) -> None:
    """SQLITE_TOOBIG (`sqlite3.DataError`; a body past SQLite's length limit, lowered here) is that
    append's own refusal, a definite `JournalError`: its neighbours in the same transaction land,
    where all of them got `JournalUnavailableError` (outcome unknown: their journals fenced)."""
    async with open_sqlite_store(tmp_path / "journal.db") as store:
        small_lease = await store.acquire_lease("small", "me", 60.0)
        big_lease = await store.acquire_lease("big", "me", 60.0)
        assert store._writer is not None
        store._writer.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 20_000)
        works = [
            _append(small_lease, "a", "x"),
            _append(big_lease, "root", "x" * 50_000),
            _append(small_lease, "b", "y"),
        ]
        # One group commit, run as the writer thread runs it (the lane is idle: nothing else uses the connection).
        outcomes = await trio.to_thread.run_sync(store._commit, works)
        assert outcomes[0] == AppendResult(works[0].stream_id, 1, 1)
        assert outcomes[2] == AppendResult(works[2].stream_id, 1, 1)
        refused = outcomes[1]
        assert isinstance(refused, JournalError) and not isinstance(refused, JournalUnavailableError), refused
        assert "too big" in str(refused)
        assert [env.event for env in await store.read(works[0].stream_id)] == [works[0].envelopes[0].event]
        assert [env.event for env in await store.read(works[2].stream_id)] == [works[2].envelopes[0].event]
        assert await store.head(works[1].stream_id) == 0  # nothing of it written


async def test_a_journal_whose_append_is_too_big_is_refused_and_a_neighbour_is_not_fenced(tmp_path: Path) -> None:
    """Through the journal: the big append raises a definite `JournalError`; the other session's
    append, submitted with it, lands and its journal stays usable."""
    async with (
        open_sqlite_store(tmp_path / "journal.db") as store,
        open_journal(store, session_id="big") as big,
        open_journal(store, session_id="small") as small,
    ):
        assert store._writer is not None
        store._writer.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 20_000)
        outcomes: dict[str, BaseException | None] = {}

        async def append(name: str, journal: Any, size: int) -> None:
            try:
                await journal.append(RequestAccepted(request_id="r", command_id="c", input={"prompt": "x" * size}))
                outcomes[name] = None
            except JournalError as exc:
                outcomes[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(append, "big", big, 50_000)
            nursery.start_soon(append, "small", small, 10)
        assert outcomes["small"] is None
        assert isinstance(outcomes["big"], JournalError)
        assert not isinstance(outcomes["big"], JournalUnavailableError), outcomes["big"]
        assert not small.fenced
        await small.append(RequestStarted(request_id="r"))


async def test_a_read_whose_connection_cannot_be_opened_is_unavailable(tmp_path: Path) -> None:
    """A read opens its connection when none is idle: SQLite's error there was raised as it was
    (a bare `sqlite3.OperationalError`), not as the store's."""
    path = tmp_path / "journal.db"
    await _new_journal(path)
    async with open_sqlite_store(path, readonly=True) as store:
        path.unlink()
        path.mkdir()  # no read connection is idle yet: the read opens one, and cannot
        with pytest.raises(JournalUnavailableError, match="unable to open"):
            await store.read("s/root")


@pytest.mark.parametrize(
    ("path", "named"),
    [
        (None, r"must be a file path \(a str or an os.PathLike\), not NoneType None"),
        (123, r"must be a file path .*not int 123"),
        (["a"], r"must be a file path .*not list \['a'\]"),
        (b"j.db", r"must be a file path .*not bytes b'j.db'"),
        ("a\x00b.db", r"'a\\x00b.db' holds a NUL character"),
        ("", r"is empty"),
    ],
    ids=["none", "int", "list", "bytes", "nul", "empty"],
)
def test_a_path_no_file_can_have_is_a_config_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: Any, named: str
) -> None:
    # None, a number or a list was a raw TypeError from os.fspath, a NUL character a raw ValueError
    # ("embedded null byte"), an empty path a JournalError about WAL mode (a temporary database).
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^open_sqlite_store's path " + named):
        open_sqlite_store(path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("store", "named"),
    [
        (
            "/tmp/j.db",
            r"takes an open JournalStore, not the path '/tmp/j.db': open the file's store with open_sqlite_store",
        ),
        (Path("j.db"), r"not the path PosixPath\('j.db'\)"),
        (123, r"takes a JournalStore \(a MemoryStore, .*\), not int 123"),
        (None, r"not NoneType None"),
    ],
    ids=["str", "path", "int", "none"],
)
async def test_open_journal_on_what_is_not_a_store_is_a_config_error_naming_the_store_it_takes(
    store: Any, named: str
) -> None:
    # A path raised a raw AttributeError ('str' object has no attribute 'acquire_lease').
    with pytest.raises(ConfigError, match=r"^open_journal .*" + named):
        async with open_journal(store):
            pass  # pragma: no cover
