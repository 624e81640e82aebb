"""PostgreSQL LSNs as integers, back to the ``X/Y`` text form, and the server's current position."""

from __future__ import annotations

import psycopg


def parse_lsn(text: str) -> int:
    """``'0/1D43AD0'`` -> integer."""
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def format_lsn(value: int) -> str:
    """integer -> ``'0/1D43AD0'``."""
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def current_wal_lsn(conn: psycopg.Connection) -> int:
    """The server's WAL insert position: every transaction committed so far ends at or before it.

    (``pg_current_wal_lsn()`` is the write position, which an asynchronous commit may not have reached.)
    """
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])
