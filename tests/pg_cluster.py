"""A throw-away PostgreSQL cluster for the tests.

`pg_cluster()` finds the server binaries (``pg_config --bindir``, then
``/usr/lib/postgresql/*/bin``), runs ``initdb`` and ``pg_ctl start`` in a
temporary directory with trust authentication, a free localhost TCP port and a
unix socket inside that directory, yields a DSN, and then stops the server with
``pg_ctl stop -m immediate`` and removes the directory.

PostgreSQL refuses to run as root, so as root the server runs as an
unprivileged OS user: ``postgres`` if the machine has it (the server package
creates it), else ``trio_agent_pg`` (created with ``useradd`` if absent), else
``nobody``.

If no binaries are found, `PostgresUnavailable` says why; the fixture turns
that into a skip, or a failure when ``CI=true``. Setting
``TRIO_AGENT_TEST_POSTGRES_DSN`` uses that server instead of starting one.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PostgresUnavailable", "find_bindir", "pg_cluster"]

DSN_ENV = "TRIO_AGENT_TEST_POSTGRES_DSN"
_USER_CANDIDATES = ("postgres", "trio_agent_pg", "nobody")


class PostgresUnavailable(Exception):
    """No PostgreSQL server binaries on this machine (the reason is the message)."""


def find_bindir() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``; `PostgresUnavailable` if there is none."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            candidates.append(Path(out.stdout.strip()))
    # Newest major version first.
    versioned = glob.glob("/usr/lib/postgresql/*/bin")
    versioned.sort(key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0, reverse=True)
    candidates.extend(Path(p) for p in versioned)
    for directory in (shutil.which("initdb"), shutil.which("pg_ctl")):
        if directory is not None:
            candidates.append(Path(directory).parent)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    raise PostgresUnavailable(
        "PostgreSQL server binaries (initdb, pg_ctl) not found via `pg_config --bindir`, "
        "/usr/lib/postgresql/*/bin or PATH; install the `postgresql` package"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _server_user() -> str | None:
    """The OS user to run the server as (None: the current user, who is not root)."""
    if os.geteuid() != 0:
        return None
    for name in _USER_CANDIDATES:
        try:
            pwd.getpwnam(name)
        except KeyError:
            if name == "trio_agent_pg" and shutil.which("useradd") is not None:
                created = subprocess.run(
                    ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                    capture_output=True,
                    check=False,
                )
                if created.returncode == 0:
                    return name
            continue
        return name
    raise PostgresUnavailable("running as root and found no unprivileged user to run PostgreSQL as")


def _traversable_by_all(path: Path) -> bool:
    import stat

    resolved = path.resolve()
    return all(os.stat(directory).st_mode & stat.S_IXOTH for directory in (resolved, *resolved.parents))


def _as_user(user: str | None, argv: list[str]) -> list[str]:
    if user is None:
        return argv
    if shutil.which("runuser") is not None:
        return ["runuser", "-u", user, "--", *argv]
    return ["su", "-s", "/bin/sh", user, "-c", " ".join(_quote(arg) for arg in argv)]


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _run(user: str | None, argv: list[str], *, what: str, timeout: float = 120) -> None:
    done = subprocess.run(_as_user(user, argv), capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


@contextlib.contextmanager
def pg_cluster() -> Iterator[str]:
    """Start a throw-away cluster and yield its DSN (see the module docstring)."""
    existing = os.environ.get(DSN_ENV)
    if existing:
        yield existing
        return
    bindir = find_bindir()
    user = _server_user()
    base = Path(tempfile.gettempdir())
    if user is not None and not _traversable_by_all(base):
        base = Path("/tmp")  # the server's user must reach its directory
    root = Path(tempfile.mkdtemp(prefix="trio_agent_pg_", dir=base))
    data = root / "data"
    sockets = root / "sockets"
    log = root / "server.log"
    started = False
    try:
        sockets.mkdir()
        if user is not None:
            entry = pwd.getpwnam(user)
            for path in (root, sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        _run(
            user,
            [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"],
            what="initdb",
        )
        last_error: Exception | None = None
        for _ in range(3):  # the free port may be taken between probing and binding
            port = _free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={sockets}"
                " -c fsync=on -c max_connections=300 -c shared_buffers=32MB"
            )
            try:
                _run(
                    user,
                    [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o", options, "start"],
                    what="pg_ctl start",
                )
            except RuntimeError as exc:
                last_error = exc
                continue
            started = True
            break
        if not started:
            server_log = log.read_text(errors="replace") if log.exists() else ""
            raise RuntimeError(f"could not start PostgreSQL: {last_error}\n{server_log}")
        yield f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
    finally:
        if started:
            with contextlib.suppress(Exception):
                _run(
                    user, [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], what="pg_ctl stop"
                )
        shutil.rmtree(root, ignore_errors=True)
