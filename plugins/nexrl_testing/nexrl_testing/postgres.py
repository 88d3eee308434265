"""A throwaway PostgreSQL server for tests: every SQL store runs on it as well as on SQLite.

Debian's ``postgresql`` package installs the binaries but no running server, and the
server refuses to run as root, so `PostgresServer` runs ``initdb`` and ``pg_ctl`` as the
``postgres`` user when the tests run as root, on a fresh directory and a free
127.0.0.1 port with trust authentication, and removes everything on `stop`. Each
`new_database` call gives a test its own empty database. Stores connect with psycopg 3
(``nexrl[postgres]``).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

__all__ = ["PostgresServer", "postgres_unavailable"]

BIN_GLOB = "/usr/lib/postgresql/*/bin"
"""Where Debian puts the server binaries (not on PATH)."""


def _bin_dir() -> Path | None:
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    found = sorted(glob.glob(BIN_GLOB))
    return Path(found[-1]) if found else None


def postgres_unavailable() -> str | None:
    """Why no server can be started here, or None when one can."""
    if _bin_dir() is None:
        return f"PostgreSQL server binaries not found (pg_ctl on PATH or {BIN_GLOB}); apt install postgresql"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed; pip install 'nexrl[postgres]'"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """One server on a temp directory; `start`, then `new_database`, then `stop`."""

    def __init__(self) -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise RuntimeError(postgres_unavailable() or "PostgreSQL binaries not found")
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="nexrl-postgres-"))
        self.data_dir = self.root / "data"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0

    def _run(self, *command: str) -> subprocess.CompletedProcess[str]:
        argv = list(command)
        if self._as_postgres:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done

    def start(self) -> PostgresServer:
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=200"
        log = str(self.root / "server.log")
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", log, "-o", options, "-w", "-t", "60", "start")
        return self

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def new_database(self, prefix: str = "nexrl") -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        """Stop the server (immediately: its data are thrown away) and remove its directory."""
        try:
            if (self.data_dir / "postmaster.pid").exists():
                self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
