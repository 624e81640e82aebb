"""A coordination store held in memory: the semantics of :class:`~.store.CoordinationStore`, no server.

It implements :class:`~.protocol.StagedLogStore` (what the flusher and the materializer call) and the
few operations that set up the state they read: seeding ``flushed_lsn``, snapshot epochs, a table's
snapshot state, and the cleanup queries. Everything lives in one process and is lost with it, so it
is for tests and experiments; one lock makes each operation atomic, as one transaction is in PostgreSQL.

Where the PostgreSQL store fails on a constraint, this one raises ValueError or KeyError instead of
a psycopg error, and changes nothing, as the rolled-back transaction does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..errors import LeaseBusyError
from .records import Chunk, Lag, LogEntry, SnapshotEpoch, StagedFile, TableState, take_batch


@dataclass(frozen=True)
class _Cursor:
    """A row of ``mat_cursor``."""

    next_offset: int
    last_lsn: int
    iceberg_snapshot_id: int | None


class InMemoryCoordinationStore:
    """The ``_pg2iceberg`` tables the flusher and the materializer use, as dictionaries behind a lock.

    One instance is one coordination database: share the instance (across threads too) where processes
    would share the database. The writer lease is not reentrant, as the PostgreSQL one is not (each
    holder takes it on a connection of its own).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flushed_lsn: int | None = None
        self._next_offset: dict[str, int] = {}  # log_seq
        self._log: dict[str, list[LogEntry]] = {}  # log_index, in offset order
        # (table, start offset) -> the file's earliest commit time, else its registration (time.time())
        self._registered_at: dict[tuple[str, int], float] = {}
        self._cursors: dict[tuple[str, str], _Cursor] = {}  # mat_cursor by (group, table)
        self._consumers: dict[tuple[str, str], str] = {}  # the worker that last took each lease
        self._leased: set[tuple[str, str]] = set()  # leases held now
        self._tables: dict[str, TableState] = {}
        self._chunks: dict[str, list[Chunk]] = {}
        self._epochs: dict[int, SnapshotEpoch] = {}

    def close(self) -> None:
        """Nothing to release (the PostgreSQL store closes its connection)."""

    def __enter__(self) -> InMemoryCoordinationStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # flushed_lsn ---------------------------------------------------------------------------------

    def record_slot_created(self, consistent_point: int) -> None:
        """The slot now exists: seed ``flushed_lsn`` with its consistent point (set, not advanced)."""
        with self._lock:
            self._flushed_lsn = consistent_point

    def flushed_lsn(self) -> int | None:
        """The LSN up to which every committed change is registered (None before the slot exists)."""
        with self._lock:
            return self._flushed_lsn

    def record_flushed_lsn(self, lsn: int) -> None:
        """Advance ``flushed_lsn`` (never backwards); before it is seeded, nothing changes."""
        with self._lock:
            self._advance_flushed_lsn(lsn)

    def _advance_flushed_lsn(self, lsn: int) -> None:
        if self._flushed_lsn is not None:
            self._flushed_lsn = max(self._flushed_lsn, lsn)

    # snapshot epochs and table state -------------------------------------------------------------

    def begin_epoch(self, snapshot: str, lsn_bound: int) -> int:
        """Record a new snapshot epoch (0 for the first); returns its number."""
        with self._lock:
            epoch = max(self._epochs, default=-1) + 1
            self._epochs[epoch] = SnapshotEpoch(epoch, snapshot, lsn_bound)
            return epoch

    def snapshot_epoch(self, epoch: int) -> SnapshotEpoch:
        """A recorded snapshot epoch; KeyError when there is none of that number."""
        with self._lock:
            if epoch not in self._epochs:
                raise KeyError(f"snapshot epoch {epoch} is not recorded")
            return self._epochs[epoch]

    def table_states(self) -> dict[str, TableState]:
        with self._lock:
            return dict(self._tables)

    def table_state(self, table_name: str) -> TableState | None:
        """The table's snapshot state (None before its snapshot was planned)."""
        with self._lock:
            return self._tables.get(table_name)

    def start_table_snapshot(
        self, table_name: str, pg_oid: int, iceberg_table: str, snapshot_lsn: int | None, chunks: Sequence[Chunk]
    ) -> list[Chunk]:
        """Register a table and its chunk plan once; returns the stored plan (the first one wins)."""
        with self._lock:
            if table_name not in self._tables:
                # As in PostgreSQL, where LSN 0 is written as NULL.
                self._tables[table_name] = TableState(table_name, pg_oid, iceberg_table, False, snapshot_lsn or None)
            if not self._chunks.get(table_name):
                self._chunks[table_name] = [
                    Chunk(table_name, c.index, c.start_page, c.end_page, leaf=c.leaf)
                    for c in sorted(chunks, key=lambda c: c.index)
                ]
            return list(self._chunks[table_name])

    def chunks(self, table_name: str) -> list[Chunk]:
        with self._lock:
            return list(self._chunks.get(table_name, []))

    def restart_table_snapshot(self, table_name: str, epoch: int) -> None:
        """Every chunk of the table pending again, to be read in ``epoch`` (which must be recorded)."""
        with self._lock:
            if epoch not in self._epochs:
                raise KeyError(f"snapshot epoch {epoch} is not recorded")
            if table_name in self._chunks:
                self._chunks[table_name] = [
                    dataclasses.replace(c, done=False, epoch=None, rows=None) for c in self._chunks[table_name]
                ]
            if table_name in self._tables:
                self._tables[table_name] = dataclasses.replace(self._tables[table_name], snapshot_epoch=epoch)

    def mark_snapshot_complete(self, table_name: str) -> None:
        """Mark the table's snapshot complete (nothing happens for a table never started)."""
        with self._lock:
            if table_name in self._tables:
                self._tables[table_name] = dataclasses.replace(self._tables[table_name], snapshot_complete=True)

    def request_resync(self, table_name: str, reason: str) -> None:
        """Ask for an online resync of the table (a request already pending keeps its reason)."""
        with self._lock:
            state = self._tables.get(table_name)
            if state is not None and state.resync_reason is None:
                self._tables[table_name] = dataclasses.replace(state, resync_reason=reason)

    # staged log ----------------------------------------------------------------------------------

    def register_flush(self, files: Sequence[StagedFile], flushed_lsn: int) -> list[LogEntry]:
        """Atomically: claim offsets, index the files, move ``flushed_lsn``. A file without rows is refused
        (ValueError), and then none of the files is registered."""
        with self._lock:
            next_offset = dict(self._next_offset)
            entries: list[LogEntry] = []
            for staged in files:
                if staged.row_count <= 0:
                    raise ValueError(f"{staged.path}: a staged file must hold at least one change")
                start = next_offset.get(staged.table_name, 0)
                next_offset[staged.table_name] = start + staged.row_count
                entries.append(
                    LogEntry(
                        staged.table_name,
                        start,
                        start + staged.row_count,
                        staged.path,
                        staged.first_lsn,
                        staged.flushable_lsn,
                        staged.row_count,
                        staged.byte_size,
                    )
                )
            self._next_offset = next_offset
            now = time.time()
            for entry, staged in zip(entries, files, strict=True):
                self._log.setdefault(entry.table_name, []).append(entry)
                since = staged.first_commit_us / 1e6 if staged.first_commit_us is not None else now
                self._registered_at[(entry.table_name, entry.start_offset)] = since
            self._advance_flushed_lsn(flushed_lsn)
            return entries

    def log_head(self, table_name: str) -> int:
        """The next offset the flusher will assign for ``table_name`` (0 when nothing was staged)."""
        with self._lock:
            return self._next_offset.get(table_name, 0)

    def staged_positions(self, table_names: Sequence[str]) -> tuple[int | None, dict[str, int]]:
        """``flushed_lsn`` and each table's log head, read together."""
        with self._lock:
            return self._flushed_lsn, {name: self._next_offset.get(name, 0) for name in table_names}

    def log_entries(self, table_name: str, from_offset: int, max_rows: int | None = None) -> list[LogEntry]:
        """Entries ending after ``from_offset`` in offset order, about ``max_rows`` changes (at least one)."""
        with self._lock:
            return take_batch((e for e in self._log.get(table_name, []) if e.end_offset > from_offset), max_rows)

    def delete_log_entries_before(self, table_name: str, offset: int) -> list[str]:
        """Drop index entries entirely below ``offset``; returns their file paths for deletion."""
        with self._lock:
            log = self._log.get(table_name, [])
            self._log[table_name] = [entry for entry in log if entry.end_offset > offset]
            return [entry.path for entry in log if entry.end_offset <= offset]

    # materializer cursor and lease ---------------------------------------------------------------

    def mat_cursor(self, group: str, table_name: str) -> int:
        """The first offset of ``table_name`` not yet applied to Iceberg by ``group`` (0 at first)."""
        with self._lock:
            cursor = self._cursors.get((group, table_name))
            return cursor.next_offset if cursor else 0

    def merged_snapshot_id(self, group: str, table_name: str) -> int | None:
        """The Iceberg snapshot the cursor was last advanced with (None before any merge, or when the
        advance recorded none)."""
        with self._lock:
            cursor = self._cursors.get((group, table_name))
            return cursor.iceberg_snapshot_id if cursor else None

    def lag(self, group: str, table_name: str) -> Lag:
        """``group``'s mat_cursor and the log head of ``table_name``, read together."""
        with self._lock:
            cursor = self._cursors.get((group, table_name))
            head = self._next_offset.get(table_name, 0)
            return Lag(cursor.next_offset, head, cursor.last_lsn) if cursor else Lag(0, head)

    def lags(self, group: str) -> dict[str, tuple[Lag, float]]:
        """Every staged table's :meth:`lag` for ``group``, with the seconds since the earliest commit
        in the file holding its oldest unmerged change (else since it was registered; 0 when none)."""
        now = time.time()
        with self._lock:
            result: dict[str, tuple[Lag, float]] = {}
            for table_name, head in self._next_offset.items():
                cursor = self._cursors.get((group, table_name))
                lag = Lag(cursor.next_offset if cursor else 0, head)
                oldest = next((e for e in self._log.get(table_name, []) if e.end_offset > lag.mat_cursor), None)
                age = max(0.0, now - self._registered_at[(table_name, oldest.start_offset)]) if oldest else 0.0
                result[table_name] = (lag, age)
            return result

    def min_mat_cursor(self, table_name: str) -> int:
        """The lowest cursor of any group that has advanced one on ``table_name`` (0 when none has)."""
        with self._lock:
            offsets = [c.next_offset for (_, table), c in self._cursors.items() if table == table_name]
            return min(offsets, default=0)

    def advance_mat_cursor(
        self, group: str, table_name: str, next_offset: int, last_lsn: int, iceberg_snapshot_id: int | None
    ) -> None:
        """Move the cursor forward (only forward) after the Iceberg commit. As in PostgreSQL, ``last_lsn``
        and ``iceberg_snapshot_id`` are overwritten even when the offset stays."""
        with self._lock:
            current = self._cursors.get((group, table_name))
            offset = max(current.next_offset, next_offset) if current else next_offset
            self._cursors[(group, table_name)] = _Cursor(offset, last_lsn, iceberg_snapshot_id)

    @contextlib.contextmanager
    def writer_lease(self, group: str, table_name: str, worker_id: str) -> Iterator[None]:
        """Hold the single-writer lease of a table; LeaseBusyError naming the holder when it is taken."""
        lease = (group, table_name)
        with self._lock:
            if lease in self._leased:
                raise LeaseBusyError(
                    f"{table_name} is being materialized by {self._consumers.get(lease, 'another worker')}"
                )
            self._leased.add(lease)
            self._consumers[lease] = worker_id
        try:
            yield
        finally:
            with self._lock:
                self._leased.discard(lease)
