"""The initial snapshot: one exported snapshot, CTID chunks read in parallel, resumable chunk by chunk.

Every chunk of a table is read under one exported snapshot, which a holder keeps open (see
:mod:`.holder`): the slot's own (epoch 0) or, once that was lost, a later one (a new epoch). A
table's chunks are all of one epoch, so its Iceberg rows are one consistent read of the source: a
snapshot process killed mid-table resumes chunk by chunk while the holder lives, and a table whose
done chunks belong to an epoch that is gone starts again in the new one. The materializer then
replays exactly the transactions that epoch's snapshot did not show.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata

from ..config import PipelineConfig
from ..coordination.records import AdvertisedSnapshot, Chunk
from ..coordination.store import CoordinationStore
from ..errors import Pg2IcebergError, SnapshotGoneError, StartupCheckError
from ..faults import crash_point
from ..iceberg.catalog import ensure_table
from ..iceberg.change_metadata import metadata_columns
from ..iceberg.commit import commit_with_retry
from ..iceberg.evolution import evolve_schema, rebuild_schema
from ..iceberg.layout import apply_layout, follow_layout
from ..materializer.change_stamp import stamp_snapshot
from ..source.catalog import SourceFiles, SourceTable, published_keys_seen_by, source_files_seen_in
from ..source.connection import connect
from ..source.xid_snapshot import imported_snapshot
from ..tables import MirroredTables
from ..threads import alongside, per_thread
from ..validation import StartupReport
from .chunks import (
    WrittenChunk,
    arrow_schema_for,
    chunk_marker,
    commit_chunks,
    committed_chunk_markers,
    empty_for_epoch,
    epoch_properties,
    plan_table_chunks,
    read_chunk,
    write_chunk,
)
from .holder import (
    HolderThread,
    holder_error,
    holder_lock_key,
    spawn_holder,
    wait_for_advertised_snapshot,
    working_on_snapshot,
)
from .reader import ArrowReader
from .stages import run_chunks

ChunkCallback = Callable[[Chunk, int], None]
# While more chunks of a table are coming, its commits are at least this far apart: each commit
# rewrites the table metadata (~25 ms of CPU, growing with snapshots), and chunks arrive faster.
MIN_COMMIT_INTERVAL_SECONDS = 1.0
HOLDER_MAX_SECONDS = 6 * 3600
# Tables committed at once, each committer on a state connection of its own: enough to fill the
# waits of the commits' metadata files on object storage (bench.tables --snapshot-only
# --file-latency-ms 30: 130-137 -> 63-67 ms a table), not one per chunk reader (up to 64).
COMMITTERS_AT_MOST = 4
# How long a run for a table added since waits for the holder of an older snapshot to let go.
STALE_HOLDER_WAIT_SECONDS = 60.0


class SnapshotEpochError(Pg2IcebergError):
    """The snapshot a process reads under is no longer the one its table is being read in."""


@dataclass
class TableSnapshotResult:
    rows: int = 0
    chunks_run: int = 0
    chunks_skipped: int = 0
    epoch: int | None = None
    # The table's done chunks were of an epoch whose snapshot is gone: it started again.
    restarted: bool = False
    complete: bool = False


@dataclass(frozen=True)
class SourceSessions:
    """The source connections entering tables into an epoch uses, shared by every table of a run:
    ``now`` plans chunks on the table's pages as they are now, ``seen`` is in a transaction on the
    epoch's exported snapshot (the files its reads come from). A session per table would cost the
    server a backend start each."""

    now: psycopg.Connection
    seen: psycopg.Connection


@contextmanager
def source_sessions(config: PipelineConfig, snapshot: AdvertisedSnapshot) -> Iterator[SourceSessions]:
    """Both :class:`SourceSessions` for ``snapshot``, closed on leaving."""
    with connect(config.source) as now, connect(config.source) as seen, imported_snapshot(seen, snapshot.name):
        yield SourceSessions(now, seen)


class SnapshotRunner:
    """Plans and runs the snapshot of the configured tables that are not complete yet.

    With ``detached_holder`` the holder is a detached process (it outlives this one, so a crash here
    loses no progress); without, a thread of this process.
    """

    def __init__(
        self,
        config: PipelineConfig,
        tables: MirroredTables,
        store: CoordinationStore,
        report: StartupReport,
        catalog: Catalog,
        detached_holder: bool = False,
    ) -> None:
        self.config = config
        self.mirrored = tables
        self.store = store
        self.report = report
        self.catalog = catalog
        self.detached_holder = detached_holder
        self._tables: dict[str, Table] = {}
        self._schemas: dict[str, pa.Schema] = {}
        # The chunk writers' own copy of each table's metadata, and each table's lock its copy and its
        # commits take (see _metadata_for_writes).
        self._writer_metadata: dict[str, TableMetadata] = {}
        self._commit_locks: dict[str, threading.Lock] = {}
        self._holder_thread: HolderThread | None = None
        # Tables planned while the holder exported its snapshot (see _plan_ahead): entered without again.
        self._planned_ahead: set[str] = set()

    def pending_tables(self) -> list[SourceTable]:
        """Configured tables whose snapshot is not complete."""
        states = self.store.table_states()
        return [
            table for key, table in self.report.tables.items() if key not in states or not states[key].snapshot_complete
        ]

    def plan(
        self, table: SourceTable, source: psycopg.Connection | None = None, created_with: dict[str, str] | None = None
    ) -> list[Chunk]:
        """Create the Iceberg table and store the chunk plan once; returns the stored plan.

        A table created by an earlier process follows the columns as they are now: a column renamed
        or added meanwhile is read under its new name by this process's chunks. An Iceberg table
        this pipeline has no state for (kept after the table left the config, which it rejoins now)
        is rebuilt to the source's columns instead: every row is read again. Either way the table
        takes the configured partition spec and sort order before any chunk is written. ``source``:
        an open source connection to plan on (else one of its own); ``created_with``: properties the
        Iceberg table takes if it is created here."""
        fresh = self.store.table_state(table.key) is None
        mirrored = self.mirrored[table.key]

        def follow() -> None:
            iceberg = ensure_table(self.catalog, self.config, mirrored, table, created_with)
            if fresh:
                # One commit: a field the rebuild deletes must leave the spec in the same one.
                transaction, changes = rebuild_schema(
                    iceberg, table.key, table.columns, table.primary_key, SourceFiles(None)
                )
                changes += follow_layout(transaction, table.key, mirrored.config, table.columns)
                if changes:
                    transaction.commit_transaction()
            else:
                evolve_schema(iceberg, table.key, table.columns)
                apply_layout(iceberg, table.key, mirrored.config, table.columns)
            self._tables[table.key] = iceberg  # as loaded and committed here: no second load

        commit_with_retry(follow)
        with nullcontext(source) if source is not None else connect(self.config.source) as conn:
            planned = plan_table_chunks(conn, table, self.config.snapshot.chunk_pages)
        return self.store.start_table_snapshot(
            table.key, table.oid, ".".join(self.mirrored[table.key].iceberg), None, planned
        )

    def enter_epoch(
        self, table: SourceTable, snapshot: AdvertisedSnapshot, sessions: SourceSessions | None = None
    ) -> tuple[list[Chunk], bool]:
        """Make ``epoch`` the table's snapshot epoch; returns its chunks and whether it started again.

        A table already in ``epoch`` keeps its progress, and a chunk whose Iceberg commit landed just
        before a crash is recognised by its marker. A table in an older epoch (that snapshot is gone)
        is emptied and every chunk is read again: rows read at two moments cannot make one consistent
        table, because a row that moved pages in between can be read twice or not at all.
        ``sessions``: the run's source sessions on ``snapshot`` (else sessions of its own).
        """
        with ExitStack() as stack:
            if sessions is None:
                sessions = stack.enter_context(source_sessions(self.config, snapshot))
            return self._enter_epoch(table, snapshot, sessions)

    def _enter_epoch(
        self, table: SourceTable, snapshot: AdvertisedSnapshot, sessions: SourceSessions
    ) -> tuple[list[Chunk], bool]:
        epoch = snapshot.epoch
        files = source_files_seen_in(sessions.seen, table)
        if table.key not in self._planned_ahead:
            # Created with the epoch's properties, a new table needs no commit to enter the epoch.
            self.plan(table, sessions.now, epoch_properties(files))
        iceberg = self._iceberg_table(table)
        restarted = False
        with self.store.table_snapshot_lock(table.key):
            state = self.store.table_state(table.key)
            assert state is not None
            if state.snapshot_epoch is not None and state.snapshot_epoch > epoch:
                raise SnapshotEpochError(
                    f"{table.key} is being snapshotted in epoch {state.snapshot_epoch}, newer than this process's "
                    f"snapshot (epoch {epoch}); run the snapshot again to import the newer one"
                )
            if state.snapshot_epoch != epoch:
                restarted = state.snapshot_epoch is not None or any(c.done for c in self.store.chunks(table.key))
                # Until a table enters an epoch nothing commits to it (chunks wait for the epoch,
                # merges for the snapshot): as planned above, it is current.
                empty_for_epoch(iceberg, epoch, files, current=not restarted)
                self.store.restart_table_snapshot(table.key, epoch)
            committed = committed_chunk_markers(iceberg, epoch)
            for chunk in self.store.chunks(table.key):
                if not chunk.done and chunk_marker(chunk) in committed:
                    # Committed to Iceberg before a crash, but not recorded: the marker proves it.
                    self.store.mark_chunk_done(table.key, chunk.index, 0, epoch, None)
        return self.store.chunks(table.key), restarted

    def _iceberg_table(self, table: SourceTable) -> Table:
        """The table's Iceberg table, loaded once per runner (commits refresh it)."""
        loaded = self._tables.get(table.key)
        if loaded is None:
            loaded = self._tables[table.key] = self.catalog.load_table(self.mirrored[table.key].iceberg)
        return loaded

    def read_chunk(
        self, reader: ArrowReader, table: SourceTable, chunk: Chunk, snapshot: AdvertisedSnapshot
    ) -> pa.Table:
        """Read one chunk under ``snapshot`` as the Iceberg table's Arrow schema (only merges evolve it,
        after the snapshot)."""
        schema = self._schemas.get(table.key)
        if schema is None:
            schema = self._schemas[table.key] = arrow_schema_for(self._iceberg_table(table))
        try:
            rows = read_chunk(reader, table, chunk, schema, snapshot.name, self.config.values.out_of_range)
            metadata = metadata_columns(self._iceberg_table(table))
            if metadata is None:
                return rows
            # The rows as of the epoch's snapshot (the slot's consistent point in the first epoch).
            return stamp_snapshot(rows, metadata, self.store.snapshot_epoch(snapshot.epoch).lsn_bound)
        except Pg2IcebergError as exc:
            if self.store.exported_snapshot(holder_lock_key(self.config)) != snapshot:
                raise Pg2IcebergError(
                    f"{exc}. The exported snapshot of epoch {snapshot.epoch} is gone (its holder stopped). Run the "
                    "snapshot again: finished tables stay, the others are read again under a new snapshot"
                ) from None
            raise

    def write_chunk(self, table: SourceTable, chunk: Chunk, rows: pa.Table) -> WrittenChunk:
        """Write a chunk's data files (nothing is committed yet)."""
        return write_chunk(self._metadata_for_writes(table), self._iceberg_table(table).io, chunk, rows)

    def _metadata_for_writes(self, table: SourceTable) -> TableMetadata:
        """The Iceberg table's metadata as the chunk writers use it: a copy of their own, taken once per
        table while no commit of it runs. A pyiceberg commit deep-copies the table's metadata, and writers
        filling the lazily computed caches of that same object broke the copy ("dictionary changed size
        during iteration"). What writers need (schema, spec, sort order, location) stays put while an
        epoch's chunks are written."""
        metadata = self._writer_metadata.get(table.key)
        if metadata is not None:  # every chunk after the table's first: no wait for a commit in progress
            return metadata
        with self._commit_lock(table):
            metadata = self._writer_metadata.get(table.key)
            if metadata is None:
                metadata = self._writer_metadata[table.key] = self._iceberg_table(table).metadata.model_copy(deep=True)
            return metadata

    def _commit_lock(self, table: SourceTable) -> threading.Lock:
        """The lock of ``table``'s commits in this process: tables commit at once, each one at a time
        (a commit may copy objects of its own table's metadata only)."""
        return self._commit_locks.setdefault(table.key, threading.Lock())  # setdefault is atomic

    def commit_chunks(
        self, table: SourceTable, batch: list[WrittenChunk], epoch: int, store: CoordinationStore
    ) -> list[tuple[Chunk, int]]:
        """Commit written chunks of one table to Iceberg in one commit, then record each as done on
        ``store``; returns each chunk with its rows. Refused when the table moved to another epoch
        meanwhile."""
        crash_point("snapshot.mid_chunk")
        with store.table_snapshot_lock(table.key):
            state = store.table_state(table.key)
            if state is None or state.snapshot_epoch != epoch:
                raise SnapshotEpochError(
                    f"{table.key} started again in snapshot epoch {state.snapshot_epoch if state else '-'} while "
                    f"this process read it in epoch {epoch}; run the snapshot again"
                )
            with self._commit_lock(table):
                snapshot_id = commit_chunks(self._iceberg_table(table), batch, epoch)
            crash_point("snapshot.after_chunk_commit")
            for written in batch:
                store.mark_chunk_done(table.key, written.chunk.index, written.rows, epoch, snapshot_id)
        return [(written.chunk, written.rows) for written in batch]

    def run_partitions(self, table_key: str, partition_keys: Iterable[str]) -> TableSnapshotResult:
        """Run the chunks named by partition keys (``ctid_000000_002048``...) of one table.

        For runs in separate processes (Dagster): the snapshot a live holder advertises is imported,
        or a holder process is started first (it creates the slot on the first run).
        """
        table = self.report.tables[table_key]
        wanted = list(partition_keys)
        known = {chunk.partition_key for chunk in self.store.chunks(table_key) or self.plan(table)}
        unknown = sorted(set(wanted) - known)
        if unknown:
            raise ValueError(f"{table_key}: unknown chunk partitions {unknown}; the chunk plan has {sorted(known)}")
        result = TableSnapshotResult()
        state = self.store.table_state(table_key)
        if state is not None and state.snapshot_complete:
            result.chunks_skipped, result.epoch, result.complete = len(wanted), state.snapshot_epoch, True
            return result
        with self.holding_snapshot([table]) as snapshot:
            chunks, result.restarted = self.enter_epoch(table, snapshot)
            by_key = {chunk.partition_key: chunk for chunk in chunks}
            pending = [by_key[key] for key in wanted if not by_key[key].done]
            result.chunks_skipped, result.epoch = len(wanted) - len(pending), snapshot.epoch
            if pending:
                self.run_chunks([(table, chunk) for chunk in pending], snapshot, {table_key: result})
        result.complete = self.complete_if_done(table_key)
        return result

    def complete_if_done(self, table_key: str) -> bool:
        """Mark the table's snapshot complete once every chunk is done in the table's epoch."""
        state = self.store.table_state(table_key)
        chunks = self.store.chunks(table_key)
        if state is not None and chunks and all(c.done and c.epoch == state.snapshot_epoch for c in chunks):
            self.store.mark_snapshot_complete(table_key)
            return True
        return False

    def run(
        self, on_chunk: ChunkCallback | None = None, on_plan: Callable[[int], None] | None = None
    ) -> dict[str, TableSnapshotResult]:
        """Snapshot every pending table under one exported snapshot. Tables enter the epoch one after
        another while the chunks of those before them are read, written and committed; ``on_plan``
        gets the count of chunks to run so far after each table."""
        pending = self.pending_tables()
        results = {table.key: TableSnapshotResult() for table in pending}
        if not pending:
            return results
        with (
            self.holding_snapshot(pending, meanwhile=lambda exported: self._plan_ahead(pending, exported)) as snapshot,
            source_sessions(self.config, snapshot) as sessions,
        ):
            work = self._entered_chunks(pending, snapshot, sessions, results, on_plan)
            self.run_chunks(work, snapshot, results, on_chunk)
        for table in pending:
            results[table.key].complete = self.complete_if_done(table.key)
        return results

    def _plan_ahead(self, tables: Sequence[SourceTable], exported: threading.Event) -> None:
        """Plan ``tables`` in turn (each Iceberg table created, its chunks stored) until ``exported``
        is set. Planning reads the source as it is now, so it need not wait for the holder's
        snapshot; a table created with files the snapshot then does not see takes their properties
        when it enters the epoch (:func:`.chunks.empty_for_epoch`). On a store and a source session of
        its own: the thread waiting for the snapshot uses the runner's store meanwhile."""
        with CoordinationStore(self.store.target) as store, connect(self.config.source) as source:
            planner = SnapshotRunner(self.config, self.mirrored, store, self.report, self.catalog)
            for table in tables:
                if exported.is_set():
                    return
                planner.plan(table, source, epoch_properties(source_files_seen_in(source, table)))
                self._tables[table.key] = planner._iceberg_table(table)
                self._planned_ahead.add(table.key)

    def _entered_chunks(
        self,
        tables: Sequence[SourceTable],
        snapshot: AdvertisedSnapshot,
        sessions: SourceSessions,
        results: dict[str, TableSnapshotResult],
        on_plan: Callable[[int], None] | None,
    ) -> Iterator[tuple[SourceTable, Chunk]]:
        """Each table entered into ``snapshot``'s epoch in turn, then its chunks not done yet."""
        planned = 0
        for table in tables:
            chunks, restarted = self.enter_epoch(table, snapshot, sessions)
            result = results[table.key]
            result.epoch, result.restarted = snapshot.epoch, restarted
            todo = [chunk for chunk in chunks if not chunk.done]
            result.chunks_skipped += len(chunks) - len(todo)
            planned += len(todo)
            if on_plan:
                on_plan(planned)
            for chunk in todo:
                yield table, chunk

    def _usable_advertised_snapshot(
        self, tables: Sequence[SourceTable], timeout: float = 30.0
    ) -> AdvertisedSnapshot | None:
        """The advertised snapshot if ``tables`` can be read under it: it is still importable and saw
        each of them in the publication. Both are learnt by importing it once, so a holder letting go
        in between cannot surprise a later import. A holder killed a moment ago may still look alive
        (its sessions end when the server notices): that is waited for, as is the holder of a snapshot
        older than a table added since; then there is none."""
        advertised = self.store.exported_snapshot(holder_lock_key(self.config))
        if advertised is None:
            return None
        publication = self.config.replication.publication
        try:
            covered = published_keys_seen_by(self.config.source, advertised.name, publication, tables)
        except SnapshotGoneError:
            self._holder_gone_within(timeout)
            return None
        # A table not in the publication as that snapshot sees it was added since: its changes between
        # that snapshot and joining the publication never stream, so it cannot start from it.
        added = [table.key for table in tables if table.key not in covered]
        if added:
            self._wait_for_holder_to_let_go(advertised, added)
            return None
        return advertised

    def _holder_gone_within(self, timeout: float, poll: float = 0.1) -> bool:
        """Wait up to ``timeout`` seconds for no holder to be alive; whether none is."""
        deadline = time.monotonic() + timeout
        while self.store.holder_alive(self.config.replication.slot):
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def _wait_for_holder_to_let_go(self, advertised: AdvertisedSnapshot, added: list[str]) -> None:
        """Wait for the holder of a snapshot older than ``added`` tables to let go (it does once the
        tables it serves are complete); refuse clearly if it does not."""
        if not self._holder_gone_within(STALE_HOLDER_WAIT_SECONDS, poll=0.5):
            raise StartupCheckError(
                f"{', '.join(added)} joined the publication after the snapshot of epoch {advertised.epoch} was "
                "exported, so that snapshot cannot start their mirror; its holder lets go once the tables it serves "
                "are snapshotted (or after snapshot.holder_idle_seconds idle). Run this again then"
            )

    @contextmanager
    def holding_snapshot(
        self, tables: Sequence[SourceTable], meanwhile: Callable[[threading.Event], None] | None = None
    ) -> Iterator[AdvertisedSnapshot]:
        """The exported snapshot to read ``tables`` under, while this process counts as a snapshot worker.

        A live holder's snapshot is imported, unless it was exported before one of ``tables`` joined
        the publication (then its holder is waited for); otherwise a holder is started (a detached
        process with ``detached_holder``, else a thread that stops on leaving) and its snapshot is
        awaited, ``meanwhile`` running in a thread until it is (given an event set then).
        """
        with working_on_snapshot(self.config):
            advertised = self._usable_advertised_snapshot(tables)
            if advertised is not None:
                yield advertised
                return
            stop = threading.Event()
            alive: HolderThread | Any
            if self.detached_holder:
                alive = spawn_holder(self.config, HOLDER_MAX_SECONDS)
            else:
                alive = HolderThread(self.config, stop)
                alive.start()
            try:
                # meanwhile stops (its event set) once the wait ends.
                with alongside(meanwhile or (lambda exported: None), "snapshot-plan-ahead") as (_, failures):
                    advertised = wait_for_advertised_snapshot(self.store, self.config, alive)
                if failures:
                    raise failures[0]
                if advertised is None:
                    reason = holder_error(alive).removeprefix("error: ")
                    why = f": {reason}. Then" if reason else ". Run that command by hand to see why, then"
                    raise StartupCheckError(
                        "no exported snapshot to read under: the snapshot holder "
                        f"(`pg2iceberg-dagster hold-snapshot`) stopped without one{why} run the snapshot again"
                    )
                yield advertised
            finally:
                stop.set()
                if isinstance(alive, HolderThread):
                    alive.join()

    def run_chunks(
        self,
        work: Iterable[tuple[SourceTable, Chunk]],
        snapshot: AdvertisedSnapshot,
        results: dict[str, TableSnapshotResult],
        on_chunk: ChunkCallback | None = None,
    ) -> None:
        """Run chunks under ``snapshot`` through read, write and commit (see :mod:`.stages`), adding to
        ``results``; the first failure cancels what has not started and is raised. ``work`` is taken
        as the stages go (it may enter tables into the epoch on this runner's store), so each
        committing thread records chunks on a store of its own: a transaction of one never takes in
        a statement of another."""
        with per_thread(lambda: CoordinationStore(self.store.target), CoordinationStore.close) as commit_store:
            for chunk, rows in run_chunks(
                self.config.source,
                work,
                read=lambda reader, table, chunk: self.read_chunk(reader, table, chunk, snapshot),
                write=self.write_chunk,
                commit=lambda table, batch: self.commit_chunks(table, batch, snapshot.epoch, commit_store()),
                parallelism=self.config.snapshot.parallelism,
                committers=min(self.config.snapshot.parallelism, COMMITTERS_AT_MOST),
                min_commit_interval=MIN_COMMIT_INTERVAL_SECONDS,
            ):
                result = results[chunk.table_name]
                result.rows += rows
                result.chunks_run += 1
                if on_chunk:
                    on_chunk(chunk, rows)
