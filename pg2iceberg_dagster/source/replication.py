"""The logical replication connection: slot creation with an exported snapshot, and the COPY_BOTH stream.

The stream loop runs on libpq directly (psycopg's ``pgconn``): psycopg 3.3 has no high-level
replication API. Keepalives are answered inside :meth:`ReplicationStream.read`.
"""

from __future__ import annotations

import select
import struct
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, NamedTuple, NoReturn

import psycopg
from psycopg import sql

from ..config import PostgresConnection
from ..errors import Pg2IcebergError, SlotBusyError, StartupCheckError
from .connection import connect
from .lsn import format_lsn, parse_lsn
from .pgoutput import PG_EPOCH


@dataclass(frozen=True)
class CreatedSlot:
    """What CREATE_REPLICATION_SLOT returned; ``snapshot_name`` is valid while its connection idles."""

    name: str
    consistent_point: int
    snapshot_name: str


# Failover slots (``FAILOVER`` of CREATE_REPLICATION_SLOT): PostgreSQL 17 and later.
MIN_FAILOVER_VERSION = 170000


def failover_wanted(setting: bool | Literal["auto"], server_version: int) -> bool:
    """Whether a new slot is created as a failover slot (``replication.failover_slot``): auto means
    wherever the server can sync slots to standbys (17+); true on an older server is refused."""
    if setting == "auto":
        return server_version >= MIN_FAILOVER_VERSION
    if setting and server_version < MIN_FAILOVER_VERSION:
        raise StartupCheckError(
            f"replication.failover_slot is true but the source runs PostgreSQL {server_version // 10000}: failover "
            "slots need PostgreSQL 17 or later; set replication.failover_slot: auto (or false)"
        )
    return setting


def create_slot_with_snapshot(conn: psycopg.Connection, slot: str, failover: bool = False) -> CreatedSlot:
    """Create a pgoutput slot on a replication connection and export its snapshot; ``failover``
    (PostgreSQL 17+) makes standbys that sync slots keep a copy a promotion can continue from.

    The caller must keep ``conn`` open and send nothing more on it while other sessions import the
    snapshot: its next command invalidates it.
    """
    options = sql.SQL("SNAPSHOT 'export', FAILOVER true" if failover else "SNAPSHOT 'export'")
    try:
        row = conn.execute(
            sql.SQL("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput ({})").format(sql.Identifier(slot), options)
        ).fetchone()
    except psycopg.errors.DuplicateObject:
        raise StartupCheckError(f"replication slot {slot} already exists") from None
    except psycopg.errors.ConfigurationLimitExceeded as exc:
        raise StartupCheckError(
            f"cannot create replication slot {slot}: {exc.diag.message_primary}; drop a slot nobody uses "
            "(see SELECT slot_name, database, active FROM pg_replication_slots) or raise max_replication_slots "
            "and restart PostgreSQL"
        ) from None
    assert row is not None
    return CreatedSlot(name=row[0], consistent_point=parse_lsn(row[1]), snapshot_name=row[2])


def transactions_holding_slot_creation(conn: psycopg.Connection) -> list[str]:
    """The oldest open transactions that hold an xid, in any database of the cluster: creating a
    logical slot waits until every such transaction running when it started has ended."""
    rows = conn.execute(
        """
        SELECT pid, datname, usename, state, extract(epoch FROM now() - xact_start)::int
        FROM pg_catalog.pg_stat_activity
        WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() AND backend_type = 'client backend'
        ORDER BY xact_start LIMIT 5
        """
    ).fetchall()
    return [
        f"pid {pid} ({user} on {database}, {state}, open {seconds} s)" for pid, database, user, state, seconds in rows
    ]


class XLogData(NamedTuple):
    """One WAL data message: the LSN it starts at, the server's WAL end, and the pgoutput payload."""

    # A NamedTuple, not a dataclass: one is built per message, and this is the cheapest to build.
    data_start: int
    wal_end: int
    payload: bytes


_XLOG_HEADER = struct.Struct("!QQ")  # after 'w': WAL start, WAL end (then the send time, 8 bytes, unused)
XLOG_HEADER = 25  # bytes before the pgoutput payload of a WAL data message
# How long read_batch lets messages gather once the first arrives after a wait (far below any bound
# that matters to a consumer: flush intervals are seconds).
_GATHER_SECONDS = 0.001
_KEEPALIVE = struct.Struct("!QqB")  # after 'k': WAL end, send time, reply requested


def xlog_data_start(message: bytes | memoryview) -> int:
    """The WAL position a whole WAL data message (as :meth:`ReplicationStream.read_batch` returns) starts at."""
    return _XLOG_HEADER.unpack_from(message, 1)[0]


def _now_micros() -> int:
    return int((datetime.now(UTC) - PG_EPOCH).total_seconds() * 1_000_000)


class ReplicationStream:
    """START_REPLICATION on ``slot`` from ``start_lsn``; read messages, acknowledge flushed LSNs."""

    def __init__(
        self,
        target: PostgresConnection,
        slot: str,
        publication: str,
        start_lsn: int,
        status_interval: float = 10.0,
    ) -> None:
        self._target = target
        self._slot = slot
        self._publication = publication
        self._start_lsn = start_lsn
        self._status_interval = status_interval
        self._conn: psycopg.Connection | None = None
        self._flushed = start_lsn
        self._last_status = 0.0
        # Position the server reported in its last keepalive: everything committed before it was sent.
        self.server_wal_end = start_lsn

    def open(self) -> None:
        """Connect and start streaming; a slot in use by another process raises SlotBusyError."""
        self._conn = connect(self._target, replication=True)
        command = sql.SQL("START_REPLICATION SLOT {} LOGICAL {} (proto_version '1', publication_names {})").format(
            sql.Identifier(self._slot), sql.SQL(format_lsn(self._start_lsn)), sql.Literal(self._publication)
        )
        try:
            self._conn.execute(command)
        except psycopg.errors.ObjectInUse as exc:
            self.close()
            raise SlotBusyError(
                f"replication slot {self._slot} is in use by another process ({exc.diag.message_primary}); "
                "only one flusher may stream at a time: stop the other `stream`/`run` process or the "
                "Dagster flusher sensor"
            ) from None
        except psycopg.errors.UndefinedObject:
            self.close()
            raise StartupCheckError(
                f"replication slot {self._slot} does not exist; run `pg2iceberg-dagster snapshot` first"
            ) from None
        except psycopg.Error as exc:
            self.close()
            raise Pg2IcebergError(f"START_REPLICATION failed: {exc.diag.message_primary or exc}") from None

    def __enter__(self) -> ReplicationStream:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def read(self, timeout: float) -> XLogData | None:
        """The next XLogData message, or None when none arrived within ``timeout`` seconds."""
        assert self._conn is not None, "stream is not open"
        pgconn = self._conn.pgconn
        deadline = time.monotonic() + timeout
        while True:
            self._maybe_send_status()
            nbytes, data = pgconn.get_copy_data(1)
            if nbytes == 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                readable, _, _ = select.select([pgconn.socket], [], [], min(remaining, 1.0))
                if readable:
                    pgconn.consume_input()
                continue
            if nbytes < 0:
                self._stream_ended(nbytes)
            # ``data`` is a view owning the buffer libpq allocated for this message (psycopg frees it
            # with the view); the payload is copied out as bytes, once.
            kind = data[0]
            if kind == 119:  # 'w'
                data_start, wal_end = _XLOG_HEADER.unpack_from(data, 1)
                return XLogData(data_start, wal_end, bytes(data[XLOG_HEADER:]))
            if kind == 107:  # 'k'
                self._keepalive(data)

    def read_batch(self, timeout: float, limit: int = 4096, limit_bytes: int = 4 << 20) -> list[bytes]:
        """The WAL data messages that arrived, whole ('w', WAL start, WAL end, send time, then the
        pgoutput payload at offset :data:`XLOG_HEADER`): at most ``limit`` or about ``limit_bytes``.

        Waits up to ``timeout`` seconds for the first one, not for more: what is already received is
        returned at once. Empty when nothing arrived. One call serves thousands of messages, each
        copied into bytes and libpq's buffer freed at once: psycopg's view of that buffer is an object
        the garbage collector tracks, bytes are not, and thousands of views alive at a time made it
        walk every object of the process again and again (as much CPU as everything else the
        flusher does; the copy costs a fraction of that).
        """
        assert self._conn is not None, "stream is not open"
        pgconn = self._conn.pgconn
        get_copy_data = pgconn.get_copy_data
        out: list[bytes] = []
        append = out.append
        size = 0
        refilled = False
        deadline = None
        self._maybe_send_status()
        while len(out) < limit and size < limit_bytes:
            nbytes, data = get_copy_data(1)
            if nbytes > 0:
                refilled = False
                kind = data[0]
                if kind == 119:  # 'w'
                    append(bytes(data))
                    size += nbytes
                elif kind == 107:  # 'k'
                    self._keepalive(data)
                continue
            if nbytes == 0:
                if not refilled:
                    # libpq parses only what it has read: read what the socket holds now, without waiting.
                    pgconn.consume_input()
                    refilled = True
                    continue
                if out:
                    break
                now = time.monotonic()
                if deadline is None:
                    deadline = now + timeout
                if now >= deadline:
                    break
                readable, _, _ = select.select([pgconn.socket], [], [], min(deadline - now, 1.0))
                if readable:
                    # Ahead of the server: let a few messages gather, then take them in one read
                    # instead of a wakeup and a read per message.
                    time.sleep(_GATHER_SECONDS)
                    pgconn.consume_input()
                self._maybe_send_status()
                continue
            self._stream_ended(nbytes)
        return out

    def _keepalive(self, data: memoryview) -> None:
        wal_end, _, reply = _KEEPALIVE.unpack_from(data, 1)
        self.server_wal_end = max(self.server_wal_end, wal_end)
        if reply:
            self._send_status(reply=False)

    def _stream_ended(self, nbytes: int) -> NoReturn:
        assert self._conn is not None
        if nbytes == -1:
            raise Pg2IcebergError("the server ended the replication stream")
        message = self._conn.pgconn.error_message.decode(errors="replace").strip()
        raise Pg2IcebergError(f"replication stream failed: {message}")

    def request_keepalive(self) -> None:
        """Ask the server to answer now with a keepalive carrying its current position."""
        self._send_status(reply=True)

    def ack(self, lsn: int) -> None:
        """Tell the server everything up to ``lsn`` is durably handled; it may recycle that WAL."""
        if lsn > self._flushed:
            self._flushed = lsn
        self._send_status(reply=False)

    def _maybe_send_status(self) -> None:
        if time.monotonic() - self._last_status >= self._status_interval:
            self._send_status(reply=False)

    def _send_status(self, reply: bool) -> None:
        assert self._conn is not None
        lsn = self._flushed
        payload = b"r" + struct.pack("!QQQqB", lsn, lsn, lsn, _now_micros(), 1 if reply else 0)
        pgconn = self._conn.pgconn
        pgconn.put_copy_data(payload)
        pgconn.flush()
        self._last_status = time.monotonic()

    def close(self) -> None:
        """End the stream and close the connection."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        try:
            conn.pgconn.put_copy_end()
            conn.pgconn.flush()
        except psycopg.Error:
            pass
        finally:
            conn.close()
