"""Opening connections to PostgreSQL with errors that name the server but never the password."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from ..config import PostgresConnection
from ..errors import Pg2IcebergError

# Text forms must not depend on server or role defaults: the snapshot (COPY text) and the WAL
# (pgoutput text) are parsed alike, timestamps with an explicit UTC offset, floats exactly. Text
# arrives as UTF-8 whatever the database's encoding (a LATIN1 database's walsender and COPY convert
# it; Iceberg strings are UTF-8): left at the server default it would arrive in that encoding.
SESSION_OPTIONS = (
    "-c client_encoding=UTF8 -c datestyle=ISO,YMD -c intervalstyle=postgres -c timezone=UTC -c extra_float_digits=3 "
    "-c bytea_output=hex"
)


def connect(target: PostgresConnection, *, autocommit: bool = True, replication: bool = False) -> psycopg.Connection:
    """Open a connection (a replication one when ``replication``) or raise a clear error."""
    kwargs: dict[str, str] = {"options": SESSION_OPTIONS}
    if replication:
        kwargs["replication"] = "database"
    try:
        return psycopg.connect(target.conninfo(**kwargs), autocommit=autocommit)
    except psycopg.OperationalError as exc:
        # Every line: libpq puts the cause ("Connection refused", "password authentication failed")
        # before its hint line. libpq never echoes the password.
        reason = " ".join(line.strip() for line in str(exc).strip().splitlines()) or type(exc).__name__
        raise Pg2IcebergError(
            f"cannot connect to {target.describe()}{' (replication)' if replication else ''}: {reason}"
        ) from None


class KeptConnection:
    """One connection kept for many short uses, reopened when it was closed or broke."""

    def __init__(self, target: PostgresConnection) -> None:
        self.target = target
        self._conn: psycopg.Connection | None = None

    def __call__(self) -> psycopg.Connection:
        """The kept connection (opened on first use, or again after it closed or broke)."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = connect(self.target)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


@contextmanager
def consistent_read(conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """A READ ONLY REPEATABLE READ transaction on ``conn`` (not in one yet), rolled back at the end:
    every query in it sees the source at one point, taken by its first query."""
    with conn.transaction(force_rollback=True):
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield conn
