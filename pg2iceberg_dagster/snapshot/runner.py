"""The initial snapshot: slot + exported snapshot, CTID chunks read in parallel, resumable.

Normal case: the slot is created with ``SNAPSHOT 'export'`` on a replication connection that stays
open and idle until every chunk of every table has been read, so all tables are read at the slot's
consistent point. After a crash the export is gone; remaining chunks read under plain REPEATABLE
READ and are upserted by primary key (see :func:`commit_chunk`), and WAL replay from the consistent
point converges the table.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from ..config import PipelineConfig
from ..coordination.store import Chunk, CoordinationStore
from ..errors import StartupCheckError
from ..faults import crash_point
from ..iceberg.catalog import ensure_table, table_identifier
from ..source.catalog import SourceTable, table_pages
from ..source.connection import connect
from ..source.lsn import current_wal_lsn
from ..validation import StartupReport, slot_info
from .chunks import (
    EXPORTED_SNAPSHOT,
    REPEATABLE_READ,
    ChunkData,
    WrittenChunk,
    arrow_schema_for,
    chunk_marker,
    commit_chunks,
    committed_chunk_markers,
    plan_chunks,
    read_chunk,
    write_chunk,
)
from .holder import SnapshotHolder, holder_lock_key, spawn_holder, wait_for_advertised_snapshot
from .reader import ArrowReader

ChunkCallback = Callable[[Chunk, int], None]
CHUNKS_IN_MEMORY_PER_WORKER = 4
# While more chunks of a table are coming, its commits are at least this far apart: each commit
# rewrites the table metadata (~25 ms of CPU, growing with snapshots), and chunks arrive faster.
MIN_COMMIT_INTERVAL_SECONDS = 1.0


@dataclass
class TableSnapshotResult:
    rows: int = 0
    chunks_run: int = 0
    chunks_skipped: int = 0
    read_modes: set[str] = field(default_factory=set)
    complete: bool = False


class SnapshotRunner:
    """Plans and runs the snapshot of the configured tables that are not complete yet."""

    def __init__(
        self, config: PipelineConfig, store: CoordinationStore, report: StartupReport, catalog: Catalog
    ) -> None:
        self.config = config
        self.store = store
        self.report = report
        self.catalog = catalog
        self._commit_locks: dict[str, threading.RLock] = {}
        self._tables: dict[str, Table] = {}
        self._schemas: dict[str, pa.Schema] = {}

    def pending_tables(self) -> list[SourceTable]:
        """Configured tables whose snapshot is not complete."""
        states = self.store.table_states()
        return [
            table for key, table in self.report.tables.items() if key not in states or not states[key].snapshot_complete
        ]

    def plan(self, table: SourceTable, snapshot_lsn: int | None) -> list[Chunk]:
        """Create the Iceberg table and store the chunk plan once; returns the stored plan."""
        iceberg_table = ensure_table(self.catalog, self.config, table)
        with connect(self.config.source) as conn:
            pages = table_pages(conn, table.oid)
        planned = plan_chunks(table.key, pages, self.config.snapshot.chunk_pages, self.report.server_version)
        chunks = self.store.start_table_snapshot(
            table.key, table.oid, table_identifier(self.config, self.config.table(table.key)), snapshot_lsn, planned
        )
        committed = committed_chunk_markers(iceberg_table)
        for chunk in chunks:
            read_mode = committed.get(chunk_marker(chunk))
            if not chunk.done and read_mode is not None:
                # Committed to Iceberg before a crash, but not recorded: the marker proves it.
                self.store.mark_chunk_done(table.key, chunk.index, 0, read_mode, None)
        return self.store.chunks(table.key)

    def _iceberg_table(self, table: SourceTable) -> Table:
        """The table's Iceberg table, loaded once per runner (commits refresh it)."""
        loaded = self._tables.get(table.key)
        if loaded is None:
            loaded = self._tables[table.key] = self.catalog.load_table(
                table_identifier(self.config, self.config.table(table.key))
            )
        return loaded

    def read_chunk(self, reader: ArrowReader, table: SourceTable, chunk: Chunk, snapshot_name: str | None) -> ChunkData:
        """Read one chunk as the Iceberg table's Arrow schema (only merges evolve it, after the snapshot)."""
        schema = self._schemas.get(table.key)
        if schema is None:
            schema = self._schemas[table.key] = arrow_schema_for(self._iceberg_table(table))
        return read_chunk(reader, table, chunk, schema, snapshot_name)

    def write_chunk(self, table: SourceTable, chunk: Chunk, data: ChunkData) -> WrittenChunk:
        """Write a chunk's data files (nothing is committed yet)."""
        return write_chunk(self._iceberg_table(table), chunk, data)

    def commit_chunks(self, table: SourceTable, batch: list[WrittenChunk]) -> list[tuple[Chunk, int]]:
        """Commit written chunks of one table to Iceberg in one commit, then record each as done;
        returns each chunk with its rows."""
        crash_point("snapshot.mid_chunk")
        with self._commit_locks.setdefault(table.key, threading.RLock()):
            snapshot_id = commit_chunks(self._iceberg_table(table), batch, table.primary_key)
        crash_point("snapshot.after_chunk_commit")
        for written in batch:
            self.store.mark_chunk_done(table.key, written.chunk.index, written.rows, written.read_mode, snapshot_id)
        return [(written.chunk, written.rows) for written in batch]

    def run_chunk(self, table: SourceTable, chunk: Chunk, snapshot_name: str | None) -> int:
        """Read one chunk and commit it to Iceberg; returns the rows written."""
        with ArrowReader(self.config.source) as reader:
            data = self.read_chunk(reader, table, chunk, snapshot_name)
        ((_, rows),) = self.commit_chunks(table, [self.write_chunk(table, chunk, data)])
        return rows

    def run_partitions(
        self, table_key: str, partition_keys: Iterable[str], config_path: str, holder_max_seconds: float = 6 * 3600
    ) -> TableSnapshotResult:
        """Run the chunks named by partition keys (``ctid_000000_002048``...) of one table.

        For runs in separate processes (Dagster): when the slot does not exist yet, a holder process
        is started to create it and keep its exported snapshot open for every chunk run that follows;
        otherwise the snapshot a live holder advertises is imported, or, with no holder left (after a
        crash), chunks read under REPEATABLE READ and are upserted.
        """
        table = self.report.tables[table_key]
        chunks = {chunk.partition_key: chunk for chunk in self.store.chunks(table_key) or self.plan(table, None)}
        unknown = sorted(set(partition_keys) - chunks.keys())
        if unknown:
            raise ValueError(f"{table_key}: unknown chunk partitions {unknown}; the chunk plan has {sorted(chunks)}")
        result = TableSnapshotResult()
        pending = [chunks[key] for key in partition_keys if not chunks[key].done]
        result.chunks_skipped = len(list(partition_keys)) - len(pending)
        if pending:
            snapshot_name = self.advertised_snapshot()
            if snapshot_name is None and slot_info_missing(self.config):
                process = spawn_holder(config_path, holder_max_seconds)
                snapshot_name = wait_for_advertised_snapshot(self.store, self.config, process)
                if snapshot_name is None and slot_info_missing(self.config):
                    # Reading now would leave these rows with no WAL to replay the changes after them.
                    raise StartupCheckError(
                        f"the snapshot holder (`pg2iceberg-dagster -c {config_path} hold-snapshot`) exited without "
                        f"creating replication slot {self.config.replication.slot}; no chunk is read without it. "
                        "Run that command by hand to see why, then retry the chunk runs"
                    )
            self.run_chunks([(table, chunk) for chunk in pending], snapshot_name, {table_key: result})
        result.complete = self.complete_if_done(table_key)
        return result

    def complete_if_done(self, table_key: str) -> bool:
        """Mark the table's snapshot complete once every chunk is done."""
        if all(chunk.done for chunk in self.store.chunks(table_key)):
            with connect(self.config.source) as conn:
                self.store.mark_snapshot_complete(table_key, current_wal_lsn(conn))
            return True
        return False

    def run(
        self, on_chunk: ChunkCallback | None = None, on_plan: Callable[[int], None] | None = None
    ) -> dict[str, TableSnapshotResult]:
        """Snapshot every pending table; the exported snapshot is held until all chunks are read."""
        pending = self.pending_tables()
        results = {table.key: TableSnapshotResult() for table in pending}
        if not pending:
            return results
        holder = SnapshotHolder(self.config, self.store) if self.report.slot is None else None
        try:
            snapshot_name = holder.snapshot_name if holder else self.advertised_snapshot()
            work: list[tuple[SourceTable, Chunk]] = []
            for table in pending:
                for chunk in self.plan(table, holder.consistent_point if holder else None):
                    if chunk.done:
                        results[table.key].chunks_skipped += 1
                    else:
                        work.append((table, chunk))
            if on_plan:
                on_plan(len(work))
            self.run_chunks(work, snapshot_name, results, on_chunk)
        finally:
            if holder:
                holder.close()
        for table in pending:
            results[table.key].complete = self.complete_if_done(table.key)
        return results

    def advertised_snapshot(self) -> str | None:
        """The exported snapshot a holder process keeps open, if one does."""
        return self.store.exported_snapshot(holder_lock_key(self.config))

    def run_chunks(
        self,
        work: Sequence[tuple[SourceTable, Chunk]],
        snapshot_name: str | None,
        results: dict[str, TableSnapshotResult],
        on_chunk: ChunkCallback | None = None,
    ) -> None:
        """Run chunks, adding to ``results``; the first failure cancels what has not started and is raised.

        Three stages overlap: up to ``snapshot.parallelism`` chunks are read at once, as many are
        written as data files, and one committer commits every chunk of a table written by then in
        one Iceberg commit (group commit), so neither the source connections nor the file writers
        wait for commits. Commits do not multiply with chunks: while more chunks of a table are
        coming, they are ``MIN_COMMIT_INTERVAL_SECONDS`` apart. At most
        ``CHUNKS_IN_MEMORY_PER_WORKER`` x ``parallelism`` chunks are held in memory (a chunk read
        under REPEATABLE READ stays there until its upsert commits).
        """
        parallelism = self.config.snapshot.parallelism
        mode = EXPORTED_SNAPSHOT if snapshot_name else REPEATABLE_READ
        held = threading.BoundedSemaphore(CHUNKS_IN_MEMORY_PER_WORKER * parallelism)
        ready: dict[str, list[WrittenChunk]] = {}
        ready_changed = threading.Condition()  # guards ready, unwritten and last_commit
        unwritten = Counter(table.key for table, _ in work)
        last_commit: dict[str, float] = {}
        # Inner pools shut down first, so every chunk is handed to a stage still running.
        with (
            ArrowReader(self.config.source) as reader,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-commit") as committers,
            ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="chunk-write") as writers,
            ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="chunk-read") as readers,
        ):

            def commit_ready(table: SourceTable) -> list[tuple[Chunk, int]]:
                # REPEATABLE READ chunks hold their memory until committed: those are not held back.
                with ready_changed:
                    previous = last_commit.get(table.key)
                    if previous is not None and mode == EXPORTED_SNAPSHOT:
                        deadline = previous + MIN_COMMIT_INTERVAL_SECONDS
                        ready_changed.wait_for(
                            lambda: unwritten[table.key] == 0 or time.monotonic() >= deadline,
                            timeout=max(0.0, deadline - time.monotonic()),
                        )
                with ready_changed:
                    batch = ready.pop(table.key, [])
                    if batch:
                        last_commit[table.key] = time.monotonic()
                try:
                    return self.commit_chunks(table, batch) if batch else []
                finally:
                    for written in batch:
                        if written.pending_rows is not None:
                            held.release()

            def hand_over(table: SourceTable, written: WrittenChunk | None) -> None:
                """Give a written chunk (None: its write failed) to the committer's pile."""
                with ready_changed:
                    if written is not None:
                        ready.setdefault(table.key, []).append(written)
                    unwritten[table.key] -= 1
                    if unwritten[table.key] == 0:
                        ready_changed.notify_all()

            def write_then_hand_over(table: SourceTable, chunk: Chunk, data: ChunkData) -> Future[Any]:
                try:
                    written = self.write_chunk(table, chunk, data)
                except BaseException:
                    held.release()
                    hand_over(table, None)
                    raise
                if written.pending_rows is None:
                    held.release()
                hand_over(table, written)
                return committers.submit(commit_ready, table)

            def read_then_hand_over(table: SourceTable, chunk: Chunk) -> Future[Any]:
                held.acquire()
                try:
                    data = self.read_chunk(reader, table, chunk, snapshot_name)
                except BaseException:
                    held.release()
                    raise
                return writers.submit(write_then_hand_over, table, chunk, data)

            reads = [readers.submit(read_then_hand_over, table, chunk) for table, chunk in work]
            pending: set[Future[Any]] = set(reads)
            try:
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        outcome = future.result()
                        if isinstance(outcome, Future):  # a read or a write handed its chunk on
                            pending.add(outcome)
                            continue
                        for chunk, rows in outcome:
                            result = results[chunk.table_name]
                            result.rows += rows
                            result.chunks_run += 1
                            result.read_modes.add(mode)
                            if on_chunk:
                                on_chunk(chunk, rows)
            except BaseException:
                # Reads not started are dropped; chunks already read are still written and committed
                # (they are valid progress, and each frees memory for the readers left).
                for future in reads:
                    future.cancel()
                raise


def slot_info_missing(config: PipelineConfig) -> bool:
    """True while the replication slot does not exist (its snapshot can still be exported)."""
    with connect(config.source) as conn:
        return slot_info(conn, config.replication.slot) is None
