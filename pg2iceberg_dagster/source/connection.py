"""Opening connections to PostgreSQL with errors that name the server but never the password."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from ..config import PostgresConnection
from ..errors import SourceUnreachableError

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
        raise SourceUnreachableError(
            f"cannot connect to {target.describe()}{' (replication)' if replication else ''}: {reason}"
        ) from None


# SQLSTATEs of a connection the server ended or cannot serve yet: class 08 (connection exception),
# admin_shutdown, crash_shutdown and cannot_connect_now (a server starting up or in recovery).
_CONNECTION_LOST_STATES = ("57P01", "57P02", "57P03")


def is_connection_loss(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a lost or refused connection to PostgreSQL,
    rather than an error of the work itself: what a restart or a failover of the server looks like."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, SourceUnreachableError):
            return True
        if isinstance(current, psycopg.OperationalError):
            state = current.sqlstate
            # No SQLSTATE: libpq's own "server closed the connection unexpectedly", "consuming input failed".
            if state is None or state.startswith("08") or state in _CONNECTION_LOST_STATES:
                return True
        current = current.__cause__ or current.__context__
    return False


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
