"""Reads and writes of the coordination tables. Every multi-row change is one transaction."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg

from ..config import PostgresConnection
from ..errors import LeaseBusyError
from ..source.connection import connect
from ..source.lsn import format_lsn, parse_lsn
from .migrations import migrate
from .records import (
    AdvertisedSnapshot,
    Chunk,
    Lag,
    LogEntry,
    PipelineMeta,
    SlotReading,
    SnapshotEpoch,
    StagedFile,
    TableState,
    take_batch,
)


def snapshot_holder_lock(slot: str) -> int:
    """The advisory lock a snapshot holder holds while it lives (see snapshot.holder)."""
    return zlib.crc32(f"pg2iceberg:snapshot-holder:{slot}".encode()) & 0x7FFFFFFF


_TABLE_STATE_QUERY = (
    "SELECT table_name, pg_oid, iceberg_table, snapshot_complete, snapshot_lsn::text, snapshot_epoch, "
    "resync_reason, resync_epoch FROM _pg2iceberg.tables"
)


def _table_state(row: tuple[Any, ...]) -> TableState:
    return TableState(row[0], row[1], row[2], row[3], _lsn(row[4]), *row[5:])


def _lsn(value: str | None) -> int | None:
    return parse_lsn(value) if value is not None else None


class CoordinationStore:
    """The ``_pg2iceberg`` schema in the state database (the source database by default)."""

    def __init__(self, target: PostgresConnection, conn: psycopg.Connection | None = None) -> None:
        """``conn``: an open autocommit connection to ``target`` to use instead of a new one."""
        self.target = target
        self.conn = conn if conn is not None else connect(target)
        # Connections of table_snapshot_lock not holding a lock now, kept for the next one.
        self._idle_lock_conns: list[psycopg.Connection] = []

    def close(self) -> None:
        for lock_conn in self._idle_lock_conns:
            lock_conn.close()
        self.conn.close()

    def __enter__(self) -> CoordinationStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def migrate(self) -> list[int]:
        """Create or upgrade the schema."""
        return migrate(self.conn)

    # pipeline identity -------------------------------------------------------------------------

    def pipeline_meta(self) -> PipelineMeta | None:
        row = self.conn.execute(
            "SELECT system_identifier, slot_name, publication, consistent_point::text FROM _pg2iceberg.pipeline_meta"
        ).fetchone()
        if row is None:
            return None
        return PipelineMeta(row[0], row[1], row[2], _lsn(row[3]))

    def stamp_pipeline(self, system_identifier: str, slot: str, publication: str) -> None:
        """Record the source cluster's identity the first time; later runs compare against it."""
        self.conn.execute(
            "INSERT INTO _pg2iceberg.pipeline_meta (system_identifier, slot_name, publication) "
            "VALUES (%s, %s, %s) ON CONFLICT (id) DO NOTHING",
            (system_identifier, slot, publication),
        )

    def record_slot_created(self, consistent_point: int) -> None:
        """The slot now exists; from here on its absence is an error. Seeds ``flushed_lsn``."""
        with self.conn.transaction():
            self.conn.execute(
                "UPDATE _pg2iceberg.pipeline_meta SET consistent_point = %s, slot_created_at = now()",
                (format_lsn(consistent_point),),
            )
            self.conn.execute(
                "INSERT INTO _pg2iceberg.flushed_lsn (lsn) VALUES (%s) "
                "ON CONFLICT (id) DO UPDATE SET lsn = EXCLUDED.lsn, updated_at = now()",
                (format_lsn(consistent_point),),
            )

    def begin_epoch(self, snapshot: str, lsn_bound: int) -> int:
        """Record a new snapshot epoch (0 for the first, taken with the slot); returns its number."""
        row = self.conn.execute(
            "INSERT INTO _pg2iceberg.snapshot_epochs (epoch, snapshot, lsn_bound) "
            "SELECT coalesce(max(epoch) + 1, 0), %s, %s FROM _pg2iceberg.snapshot_epochs RETURNING epoch",
            (snapshot, format_lsn(lsn_bound)),
        ).fetchone()
        assert row is not None
        return int(row[0])

    def snapshot_epoch(self, epoch: int) -> SnapshotEpoch:
        row = self.conn.execute(
            "SELECT snapshot, lsn_bound::text FROM _pg2iceberg.snapshot_epochs WHERE epoch = %s", (epoch,)
        ).fetchone()
        if row is None:
            raise KeyError(f"snapshot epoch {epoch} is not recorded")
        return SnapshotEpoch(epoch, row[0], parse_lsn(row[1]))

    def publish_exported_snapshot(self, advertised: AdvertisedSnapshot | None) -> None:
        """Advertise (or withdraw) the exported snapshot a holder process keeps open."""
        self.conn.execute(
            "UPDATE _pg2iceberg.pipeline_meta SET exported_snapshot = %s, exported_epoch = %s",
            (advertised.name, advertised.epoch) if advertised else (None, None),
        )

    def holder_alive(self, slot: str) -> bool:
        """True while a snapshot holder process (or thread) holds its lock."""
        row = self.conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = 0 "
            "AND objid = %s AND objsubid = 1)",
            (snapshot_holder_lock(slot),),
        ).fetchone()
        return bool(row and row[0])

    def exported_snapshot(self, holder_lock: int) -> AdvertisedSnapshot | None:
        """The advertised exported snapshot, if the holder that advertised it still holds its lock."""
        row = self.conn.execute(
            "SELECT exported_snapshot, exported_epoch FROM _pg2iceberg.pipeline_meta "
            "WHERE exported_snapshot IS NOT NULL AND EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
            "AND granted AND classid = 0 AND objid = %s AND objsubid = 1)",
            (holder_lock,),
        ).fetchone()
        return AdvertisedSnapshot(row[0], row[1]) if row else None

    def flushed_lsn(self) -> int | None:
        row = self.conn.execute("SELECT lsn::text FROM _pg2iceberg.flushed_lsn").fetchone()
        return _lsn(row[0]) if row else None

    def record_flushed_lsn(self, lsn: int) -> None:
        """Advance the durable flushed LSN (never backwards); called before acking the slot."""
        self.conn.execute(
            "UPDATE _pg2iceberg.flushed_lsn SET lsn = greatest(lsn, %s::pg_lsn), updated_at = now()",
            (format_lsn(lsn),),
        )

    # per-table snapshot state -------------------------------------------------------------------

    def table_states(self) -> dict[str, TableState]:
        return {row[0]: _table_state(row) for row in self.conn.execute(_TABLE_STATE_QUERY)}

    def table_state(self, table_name: str) -> TableState | None:
        """One table's state (a merge reads it twice: one row, not every table's)."""
        row = self.conn.execute(_TABLE_STATE_QUERY + " WHERE table_name = %s", (table_name,)).fetchone()
        return None if row is None else _table_state(row)

    # the replication slot's readings (wal_budget.py) ----------------------------------------------

    def has_slot_readings(self) -> bool:
        """Whether the schema has ``slot_readings`` yet (a reader that does not migrate checks first)."""
        row = self.conn.execute("SELECT to_regclass('_pg2iceberg.slot_readings') IS NOT NULL").fetchone()
        return bool(row and row[0])

    def update_slot_reading(self, slot_name: str, advance: Callable[[SlotReading | None], SlotReading]) -> SlotReading:
        """Replace the slot's stored reading with ``advance(stored)`` in one transaction, the stored row
        locked meanwhile, so readers in several processes take turns; returns the new reading. A
        reading ``advance`` returns unchanged (it was given an older one that arrived late) is not
        written again."""
        with self.conn.transaction():
            row = self.conn.execute(
                "SELECT read_at, wal_lsn::text, safe_wal_size, wal_write_rate, safe_wal_shrink_rate "
                "FROM _pg2iceberg.slot_readings WHERE slot_name = %s FOR UPDATE",
                (slot_name,),
            ).fetchone()
            stored = None if row is None else SlotReading(row[0], parse_lsn(row[1]), row[2], row[3], row[4])
            reading = advance(stored)
            if reading != stored:
                self.conn.execute(
                    "INSERT INTO _pg2iceberg.slot_readings (slot_name, read_at, wal_lsn, safe_wal_size, "
                    "wal_write_rate, safe_wal_shrink_rate) VALUES (%s, %s, %s::pg_lsn, %s, %s, %s) "
                    "ON CONFLICT (slot_name) DO UPDATE SET read_at = excluded.read_at, wal_lsn = excluded.wal_lsn, "
                    "safe_wal_size = excluded.safe_wal_size, wal_write_rate = excluded.wal_write_rate, "
                    "safe_wal_shrink_rate = excluded.safe_wal_shrink_rate",
                    (
                        slot_name,
                        reading.read_at,
                        format_lsn(reading.wal_lsn),
                        reading.safe_wal_size,
                        reading.wal_write_rate,
                        reading.safe_wal_shrink_rate,
                    ),
                )
        return reading

    def seconds_since_maintained(self) -> dict[str, float]:
        """Per registered table, seconds since maintenance last finished a pass over it. A table never
        maintained counts from now (it is stamped now): its first pass comes one interval later."""
        with self.conn.transaction():
            self.conn.execute("UPDATE _pg2iceberg.tables SET maintained_at = now() WHERE maintained_at IS NULL")
            rows = self.conn.execute(
                "SELECT table_name, extract(epoch FROM now() - maintained_at)::float8 FROM _pg2iceberg.tables"
            ).fetchall()
        return {table: seconds for table, seconds in rows}

    def record_maintained(self, table_name: str) -> None:
        """Maintenance finished a pass over ``table_name`` now."""
        self.conn.execute("UPDATE _pg2iceberg.tables SET maintained_at = now() WHERE table_name = %s", (table_name,))

    def on_legacy_staging(self, table_name: str) -> bool:
        """Whether ``table_name`` was registered under the first staging layout and its old folder has
        not been swept yet (see :func:`~..cleanup.collect_table_garbage`)."""
        row = self.conn.execute(
            "SELECT staging_layout < 2 FROM _pg2iceberg.tables WHERE table_name = %s", (table_name,)
        ).fetchone()
        return bool(row and row[0])

    def record_legacy_staging_swept(self, table_name: str) -> None:
        """The old staging folder of ``table_name`` holds nothing left to sweep."""
        self.conn.execute("UPDATE _pg2iceberg.tables SET staging_layout = 2 WHERE table_name = %s", (table_name,))

    def start_table_snapshot(
        self, table_name: str, pg_oid: int, iceberg_table: str, snapshot_lsn: int | None, chunks: Sequence[Chunk]
    ) -> list[Chunk]:
        """Register a table and its chunk plan once; returns the stored plan (the first one wins)."""
        with self.conn.transaction():
            self.conn.execute(
                "INSERT INTO _pg2iceberg.tables (table_name, pg_oid, iceberg_table, snapshot_lsn) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (table_name) DO NOTHING",
                (table_name, pg_oid, iceberg_table, format_lsn(snapshot_lsn) if snapshot_lsn else None),
            )
            exists = self.conn.execute(
                "SELECT 1 FROM _pg2iceberg.snapshot_progress WHERE table_name = %s LIMIT 1", (table_name,)
            ).fetchone()
            if not exists:
                with self.conn.cursor() as cursor:
                    cursor.executemany(
                        "INSERT INTO _pg2iceberg.snapshot_progress "
                        "(table_name, chunk_index, start_page, end_page, leaf_schema, leaf_name) "
                        "VALUES (%s, %s, %s, %s, %s, %s)",
                        [(table_name, c.index, c.start_page, c.end_page, *(c.leaf or (None, None))) for c in chunks],
                    )
        return self.chunks(table_name)

    def chunks(self, table_name: str) -> list[Chunk]:
        return [
            Chunk(
                table_name,
                index,
                start,
                end,
                status == "done",
                epoch,
                (schema, name) if name is not None else None,
                rows,
            )
            for index, start, end, status, epoch, schema, name, rows in self.conn.execute(
                "SELECT chunk_index, start_page, end_page, status, epoch, leaf_schema, leaf_name, rows_written "
                "FROM _pg2iceberg.snapshot_progress WHERE table_name = %s ORDER BY chunk_index",
                (table_name,),
            )
        ]

    def mark_chunk_done(
        self, table_name: str, index: int, rows: int, epoch: int, iceberg_snapshot_id: int | None
    ) -> None:
        self.conn.execute(
            "UPDATE _pg2iceberg.snapshot_progress SET status = 'done', rows_written = %s, epoch = %s, "
            "iceberg_snapshot_id = %s, completed_at = now() WHERE table_name = %s AND chunk_index = %s",
            (rows, epoch, iceberg_snapshot_id, table_name, index),
        )

    def restart_table_snapshot(self, table_name: str, epoch: int) -> None:
        """Every chunk of the table pending again, to be read in ``epoch`` (its Iceberg rows are gone)."""
        with self.conn.transaction():
            self.conn.execute(
                "UPDATE _pg2iceberg.snapshot_progress SET status = 'pending', rows_written = NULL, epoch = NULL, "
                "iceberg_snapshot_id = NULL, completed_at = NULL WHERE table_name = %s",
                (table_name,),
            )
            self.conn.execute(
                "UPDATE _pg2iceberg.tables SET snapshot_epoch = %s WHERE table_name = %s", (epoch, table_name)
            )

    def mark_snapshot_complete(self, table_name: str) -> None:
        """Mark the table's snapshot complete (every chunk is done, all in the table's epoch)."""
        self.conn.execute(
            "UPDATE _pg2iceberg.tables SET snapshot_complete = true, snapshot_completed_at = now() "
            "WHERE table_name = %s AND NOT snapshot_complete",
            (table_name,),
        )

    def request_resync(self, table_name: str, reason: str) -> None:
        """Ask for an online resync of the table (a request already pending keeps its reason).
        Callers hold the table's writer lease, so no merge runs past this point."""
        self.conn.execute(
            "UPDATE _pg2iceberg.tables SET resync_reason = coalesce(resync_reason, %s) WHERE table_name = %s",
            (reason, table_name),
        )

    def replace_resync_reason(self, table_name: str, reason: str) -> None:
        """The table's pending resync is now for ``reason`` (a repair found it needs a full copy)."""
        self.conn.execute(
            "UPDATE _pg2iceberg.tables SET resync_reason = %s, resync_epoch = NULL WHERE table_name = %s",
            (reason, table_name),
        )

    def start_resync_copy(self, table_name: str, epoch: int) -> None:
        """The resync copies the table in ``epoch`` (a copy in an earlier epoch is abandoned)."""
        self.conn.execute("UPDATE _pg2iceberg.tables SET resync_epoch = %s WHERE table_name = %s", (epoch, table_name))

    def finish_resync(self, table_name: str, epoch: int) -> None:
        """The table's rows are now the resync's copy, read in ``epoch``: merges resume from the
        cursor, skipping what that epoch's snapshot shows."""
        self.conn.execute(
            "UPDATE _pg2iceberg.tables SET snapshot_epoch = %s, resync_reason = NULL, resync_epoch = NULL "
            "WHERE table_name = %s",
            (epoch, table_name),
        )

    @contextlib.contextmanager
    def table_snapshot_lock(self, table_name: str) -> Iterator[None]:
        """Serialize a table's epoch changes and chunk commits across processes (a session advisory
        lock on a connection of its own, released even on a crash; see :meth:`_lock_session`)."""
        lock_key = zlib.crc32(f"pg2iceberg:snapshot-table:{table_name}".encode())
        with self._lock_session() as lock_conn:
            lock_conn.execute("SELECT pg_advisory_lock(%s)", (lock_key,))
            try:
                yield
            finally:
                lock_conn.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))

    @contextlib.contextmanager
    def _lock_session(self) -> Iterator[psycopg.Connection]:
        """A connection of this store's own to hold session advisory locks on, lent to one thread at a
        time (a lock taken on it again is then another session's, never a re-entry). It is kept for
        the next lock once given back healthy: a snapshot takes two locks a table and a merge one, and
        a new session each would cost the state database a backend start each. On any error it is
        closed, which releases whatever its session holds."""
        try:
            conn = self._idle_lock_conns.pop()  # atomic: threads never share one
        except IndexError:
            conn = connect(self.target)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        if conn.broken or conn.closed:
            conn.close()
        else:
            self._idle_lock_conns.append(conn)

    # staged log ----------------------------------------------------------------------------------

    def register_flush(self, files: Sequence[StagedFile], flushed_lsn: int) -> list[LogEntry]:
        """Atomically: claim offsets in ``log_seq``, add ``log_index`` rows, move ``flushed_lsn``.

        Each statement runs once for all files in one round trip (psycopg's pipelined ``executemany``):
        a flush over hundreds of tables costs the same few round trips as one over a single table."""
        entries: list[LogEntry] = []
        with self.conn.transaction(), self.conn.cursor() as cursor:
            if files:
                cursor.executemany(
                    "INSERT INTO _pg2iceberg.log_seq AS s (table_name, next_offset) VALUES (%s, %s) "
                    "ON CONFLICT (table_name) DO UPDATE SET next_offset = s.next_offset + EXCLUDED.next_offset "
                    "RETURNING next_offset",
                    [(staged.table_name, staged.row_count) for staged in files],
                    returning=True,
                )
                for staged in files:  # one result set per file, in order
                    row = cursor.fetchone()
                    assert row is not None
                    end = int(row[0])
                    entries.append(
                        LogEntry(
                            staged.table_name,
                            end - staged.row_count,
                            end,
                            staged.path,
                            staged.first_lsn,
                            staged.flushable_lsn,
                            staged.row_count,
                            staged.byte_size,
                        )
                    )
                    cursor.nextset()
                cursor.executemany(
                    "INSERT INTO _pg2iceberg.log_index (table_name, start_offset, end_offset, path, first_lsn, "
                    "flushable_lsn, row_count, byte_size, first_commit_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, to_timestamp(%s::float8 / 1e6))",
                    [
                        (
                            entry.table_name,
                            entry.start_offset,
                            entry.end_offset,
                            entry.path,
                            format_lsn(entry.first_lsn),
                            format_lsn(entry.flushable_lsn),
                            entry.row_count,
                            entry.byte_size,
                            staged.first_commit_us,
                        )
                        for entry, staged in zip(entries, files, strict=True)
                    ],
                )
            self.record_flushed_lsn(flushed_lsn)
        return entries

    def log_head(self, table_name: str) -> int:
        """The next offset the flusher will assign for ``table_name`` (0 when nothing was staged)."""
        row = self.conn.execute(
            "SELECT next_offset FROM _pg2iceberg.log_seq WHERE table_name = %s", (table_name,)
        ).fetchone()
        return int(row[0]) if row else 0

    def staged_positions(self, table_names: Sequence[str]) -> tuple[int | None, dict[str, int]]:
        """``flushed_lsn`` and each table's log head, read together in one statement (so one snapshot):
        a flush registers its files and moves ``flushed_lsn`` in one transaction, so the log up to these
        heads holds exactly the changes of the transactions committed at or before that LSN."""
        row = self.conn.execute(
            "SELECT (SELECT lsn::text FROM _pg2iceberg.flushed_lsn), "
            "(SELECT coalesce(jsonb_object_agg(t.name, coalesce(s.next_offset, 0)), '{}'::jsonb) "
            "FROM unnest(%s::text[]) AS t(name) LEFT JOIN _pg2iceberg.log_seq s ON s.table_name = t.name)",
            (list(table_names),),
        ).fetchone()
        assert row is not None
        return _lsn(row[0]), {name: int(head) for name, head in row[1].items()}

    def log_entries(self, table_name: str, from_offset: int, max_rows: int | None = None) -> list[LogEntry]:
        """Entries ending after ``from_offset`` in offset order, about ``max_rows`` changes (at least one)."""
        rows = self.conn.execute(
            "SELECT table_name, start_offset, end_offset, path, first_lsn::text, flushable_lsn::text, "
            "row_count, byte_size FROM _pg2iceberg.log_index WHERE table_name = %s AND end_offset > %s "
            "ORDER BY start_offset",
            (table_name, from_offset),
        )
        entries = (
            LogEntry(name, start, end, path, parse_lsn(first), parse_lsn(flushable), count, size)
            for name, start, end, path, first, flushable, count, size in rows
        )
        return take_batch(entries, max_rows)

    def delete_log_entries_before(self, table_name: str, offset: int) -> list[str]:
        """Drop index rows entirely below ``offset``; returns their file paths for deletion."""
        return [
            path
            for (path,) in self.conn.execute(
                "DELETE FROM _pg2iceberg.log_index WHERE table_name = %s AND end_offset <= %s RETURNING path",
                (table_name, offset),
            )
        ]

    # materializer cursor and lease ---------------------------------------------------------------

    def mat_cursor(self, group: str, table_name: str) -> int:
        """The first offset of ``table_name`` not yet applied to Iceberg by ``group``."""
        row = self.conn.execute(
            "SELECT next_offset FROM _pg2iceberg.mat_cursor WHERE group_name = %s AND table_name = %s",
            (group, table_name),
        ).fetchone()
        return int(row[0]) if row else 0

    def merged_snapshot_id(self, group: str, table_name: str) -> int | None:
        """The Iceberg snapshot the cursor was last advanced with (None before any merge, or when the
        advance recorded none)."""
        row = self.conn.execute(
            "SELECT iceberg_snapshot_id FROM _pg2iceberg.mat_cursor WHERE group_name = %s AND table_name = %s",
            (group, table_name),
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else None

    def lag(self, group: str, table_name: str) -> Lag:
        """``group``'s mat_cursor (with the LSN it was merged up to) and the log head of ``table_name``,
        read together."""
        row = self.conn.execute(
            "SELECT coalesce(c.next_offset, 0), coalesce((SELECT next_offset FROM _pg2iceberg.log_seq "
            "WHERE table_name = %s), 0), c.last_lsn::text FROM (SELECT 1) AS one LEFT JOIN "
            "_pg2iceberg.mat_cursor c ON c.group_name = %s AND c.table_name = %s",
            (table_name, group, table_name),
        ).fetchone()
        assert row is not None
        return Lag(int(row[0]), int(row[1]), _lsn(row[2]))

    def lags(self, group: str) -> dict[str, tuple[Lag, float]]:
        """Every staged table's :meth:`lag` for ``group``, with the age in seconds of its oldest
        unmerged staged change (0 when none): the time since the earliest source commit in the file
        holding it (``first_commit_at``, by the source's clock), or, for a file staged before that was
        recorded, since the file was registered (``created_at``), against the state database's clock
        (never below 0: the two clocks may differ when the state is on another server). One query,
        cheap however long the log: it reads only the entry holding the cursor (through the primary
        key), not the applied entries cleanup has not deleted yet."""
        rows = self.conn.execute(
            "SELECT s.table_name, c.cursor, s.next_offset, coalesce(("
            "  SELECT greatest(0, extract(epoch FROM now() - coalesce(i.first_commit_at, i.created_at)))::float8"
            "  FROM _pg2iceberg.log_index i"
            "  WHERE i.table_name = s.table_name AND i.end_offset > c.cursor AND i.start_offset >= coalesce(("
            "    SELECT max(j.start_offset) FROM _pg2iceberg.log_index j"
            "    WHERE j.table_name = s.table_name AND j.start_offset <= c.cursor), 0)"
            "  ORDER BY i.start_offset LIMIT 1), 0) "
            "FROM _pg2iceberg.log_seq s CROSS JOIN LATERAL (SELECT coalesce((SELECT m.next_offset "
            "FROM _pg2iceberg.mat_cursor m WHERE m.group_name = %s AND m.table_name = s.table_name), 0) AS cursor) c",
            (group,),
        )
        return {name: (Lag(int(cursor), int(head)), float(age)) for name, cursor, head, age in rows}

    def min_mat_cursor(self, table_name: str) -> int:
        row = self.conn.execute(
            "SELECT min(next_offset) FROM _pg2iceberg.mat_cursor WHERE table_name = %s", (table_name,)
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def advance_mat_cursor(
        self, group: str, table_name: str, next_offset: int, last_lsn: int, iceberg_snapshot_id: int | None
    ) -> None:
        """Move the cursor forward (only forward) after the Iceberg commit."""
        self.conn.execute(
            "INSERT INTO _pg2iceberg.mat_cursor AS m (group_name, table_name, next_offset, last_lsn, "
            "iceberg_snapshot_id) VALUES (%s, %s, %s, %s, %s) ON CONFLICT (group_name, table_name) DO UPDATE "
            "SET next_offset = greatest(m.next_offset, EXCLUDED.next_offset), last_lsn = EXCLUDED.last_lsn, "
            "iceberg_snapshot_id = EXCLUDED.iceberg_snapshot_id, updated_at = now()",
            (group, table_name, next_offset, format_lsn(last_lsn), iceberg_snapshot_id),
        )

    @contextlib.contextmanager
    def writer_lease(self, group: str, table_name: str, worker_id: str) -> Iterator[None]:
        """Hold the single-writer lease of a table: a session advisory lock (see :meth:`_lock_session`),
        released even on a crash."""
        lock_key = zlib.crc32(f"pg2iceberg:materialize:{group}:{table_name}".encode())
        with self._lock_session() as lease_conn:
            acquired = lease_conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key,)).fetchone()
            if acquired and acquired[0]:
                lease_conn.execute(
                    "INSERT INTO _pg2iceberg.consumer (group_name, table_name, worker_id) VALUES (%s, %s, %s) "
                    "ON CONFLICT (group_name, table_name) DO UPDATE SET worker_id = EXCLUDED.worker_id, "
                    "acquired_at = now(), heartbeat_at = now()",
                    (group, table_name, worker_id),
                )
                try:
                    yield
                finally:
                    try:
                        lease_conn.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))
                    except psycopg.Error:
                        lease_conn.close()  # not kept: its lock goes with its backend
                return
        holder = self.conn.execute(
            "SELECT worker_id FROM _pg2iceberg.consumer WHERE group_name = %s AND table_name = %s",
            (group, table_name),
        ).fetchone()
        raise LeaseBusyError(f"{table_name} is being materialized by {holder[0] if holder else 'another worker'}")
