"""A throwaway local PostgreSQL cluster with logical replication, for the quickstart and the tests.

The server refuses to run as root, so when we are root the cluster belongs to the ``postgres`` OS
user. The cluster is stopped by the pid in its ``postmaster.pid``, never by process name.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from .detached import process_alive

PG_BIN_CANDIDATES = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/14/bin")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for throwaway clusters)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedPostgresError(RuntimeError):
    """The local cluster could not be created, started or stopped."""


def find_pg_bin() -> Path:
    """Directory holding initdb/pg_ctl: ``$PG_BIN`` or a Debian default location."""
    candidates = [os.environ["PG_BIN"]] if os.environ.get("PG_BIN") else list(PG_BIN_CANDIDATES)
    for candidate in candidates:
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise EmbeddedPostgresError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found; install postgresql-15 or set PG_BIN"
    )


@dataclass
class EmbeddedPostgres:
    """A local cluster in ``root`` listening on 127.0.0.1:``port`` with ``wal_level=logical``."""

    root: Path
    port: int
    superuser: str = "postgres"
    bin_dir: Path | None = None  # initdb and pg_ctl of another PostgreSQL than find_pg_bin's

    def __post_init__(self) -> None:
        # The server resolves paths from its own data directory: hand it absolute ones.
        self.root = Path(self.root).resolve()

    def _bin(self, name: str) -> str:
        return str((self.bin_dir or find_pg_bin()) / name)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "run"

    @property
    def log_file(self) -> Path:
        return self.root / "postgres.log"

    def conninfo(self, dbname: str = "postgres") -> str:
        """A libpq connection string for ``dbname`` on this cluster."""
        return f"host=127.0.0.1 port={self.port} user={self.superuser} dbname={dbname}"

    def _run_as_owner(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        if os.geteuid() == 0:
            args = ["runuser", "-u", "postgres", "--", *args]
        return subprocess.run(args, capture_output=True, text=True, check=False)

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(path, owner.pw_uid, owner.pw_gid)

    def _prepare_root(self) -> None:
        """Create the cluster's directory and socket directory, owned by the server's OS user, who must
        also be able to traverse to them (and to binaries of its own): the server opens its
        configuration files by absolute path."""
        for directory in (self.root, self.socket_dir):
            directory.mkdir(parents=True, exist_ok=True)
            self._chown(directory)
        if os.geteuid() == 0:
            reached = [self.root, *([self.bin_dir] if self.bin_dir else [])]
            for parent in {parent for path in reached for parent in list(path.resolve().parents)[:-1]}:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    os.chmod(parent, mode | 0o001)

    def init(self) -> None:
        """Create the cluster if it does not exist yet."""
        if (self.data_dir / "PG_VERSION").exists():
            return
        self._prepare_root()
        result = self._run_as_owner(
            [
                self._bin("initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                self.superuser,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
            ]
        )
        if result.returncode != 0:
            raise EmbeddedPostgresError(f"initdb failed: {result.stderr.strip()}")
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.socket_dir}'",
            "wal_level": "logical",
            "max_replication_slots": "20",
            "max_wal_senders": "20",
            "max_connections": "200",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "256MB",
            "wal_sender_timeout": "60s",
        }
        self.configure(settings)
        with open(self.data_dir / "pg_hba.conf", "a", encoding="utf-8") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")

    def pid(self) -> int | None:
        """The postmaster pid if the cluster is running."""
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().splitlines()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return None
        return pid if process_alive(pid) else None

    def start(self, timeout: float = 60.0) -> None:
        """Initialise if needed, start, and wait until connections are accepted."""
        self.init()
        if self.pid() is None:
            self.log_file.touch()
            self._chown(self.log_file)
            result = self._run_as_owner(
                [
                    self._bin("pg_ctl"),
                    "-D",
                    str(self.data_dir),
                    "-l",
                    str(self.log_file),
                    "-w",
                    "-t",
                    str(int(timeout)),
                    "start",
                ]
            )
            if result.returncode != 0:
                tail = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
                raise EmbeddedPostgresError(f"pg_ctl start failed: {result.stderr.strip()}\n{tail}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.conninfo(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self, timeout: float = 60.0, immediate: bool = False) -> None:
        """Fast shutdown by the postmaster's pid (``immediate``: a crash, no checkpoint, nothing more
        sent to standbys); waits until it has exited."""
        pid = self.pid()
        if pid is None:
            return
        os.kill(pid, signal.SIGQUIT if immediate else signal.SIGINT)
        deadline = time.monotonic() + timeout
        while self.pid() is not None:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGQUIT)
                break
            time.sleep(0.1)

    def configure(self, settings: dict[str, str]) -> None:
        """Append ``settings`` (values as postgresql.conf writes them) to postgresql.conf; a running
        server reads them on reload or restart."""
        with open(self.data_dir / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def start_standby_of(self, primary: EmbeddedPostgres, slot: str, settings: dict[str, str] | None = None) -> None:
        """Make this cluster a streaming standby of ``primary`` (pg_basebackup -R through the physical
        slot ``slot``, created now) and start it. Its primary_conninfo names a database, which the
        slot sync worker of PostgreSQL 17+ needs; ``settings`` are added to its postgresql.conf."""
        if (self.data_dir / "PG_VERSION").exists():
            raise EmbeddedPostgresError(f"{self.data_dir} already holds a cluster")
        self._prepare_root()
        result = self._run_as_owner(
            [self._bin("pg_basebackup"), "-D", str(self.data_dir), "-d", primary.conninfo(), "-R", "-C", "-S", slot]
        )
        if result.returncode != 0:
            raise EmbeddedPostgresError(f"pg_basebackup failed: {result.stderr.strip()}")
        # The copy carries the primary's port and socket directory: this one's come last and win.
        self.configure({"port": str(self.port), "unix_socket_directories": f"'{self.socket_dir}'", **(settings or {})})
        self.start()

    def promote(self, timeout: float = 60.0) -> None:
        """End recovery on this standby (pg_ctl promote) and wait until it accepts writes."""
        result = self._run_as_owner(
            [self._bin("pg_ctl"), "-D", str(self.data_dir), "-w", "-t", str(int(timeout)), "promote"]
        )
        if result.returncode != 0:
            raise EmbeddedPostgresError(f"pg_ctl promote failed: {result.stderr.strip()}")

    def create_database(self, name: str) -> None:
        """Create ``name`` unless it exists."""
        with psycopg.connect(self.conninfo(), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))


def main(argv: list[str] | None = None) -> int:
    """``python -m pg2iceberg_dagster.embedded stop DIR``: stop a cluster started by the quickstart."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pg2iceberg_dagster.embedded")
    parser.add_argument("action", choices=["stop"])
    parser.add_argument("root", help="the cluster's directory (e.g. .pg2iceberg/pg)")
    args = parser.parse_args(argv)
    EmbeddedPostgres(Path(args.root), port=0).stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
