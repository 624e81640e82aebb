"""Applying the staged log to Iceberg: read past ``mat_cursor``, fold, evolve schema, MERGE, advance.

One writer per table (a lease in ``consumer``); the cursor moves only after the Iceberg commit, so a
crash replays the last batch, which the fold makes harmless (upserts and deletes of final states).
A table is not merged before its snapshot is complete: an older snapshot row must never overwrite
a newer change.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.table import Table

from ..config import PipelineConfig, TableConfig
from ..coordination.protocol import LEASE_WAIT_SECONDS, StagedLogStore, writer_lease_within
from ..coordination.records import Lag, LogEntry, SnapshotEpoch, is_repair, resync_command
from ..errors import Pg2IcebergError, ResyncRequiredError
from ..faults import crash_point
from ..iceberg.catalog import new_table_location, new_table_properties
from ..iceberg.change_metadata import deletion_columns, ensure_configured_columns, metadata_columns, metadata_names
from ..iceberg.commit import commit_with_retry
from ..iceberg.delete_formats import merges_on_read
from ..iceberg.evolution import (
    SOURCE_LEAVES,
    clear_pending_fills,
    column_attnums,
    column_name,
    evolve_schema,
    leaves_property,
    pending_fills,
    recorded_leaves,
    refuse_unfollowable_retypes,
    refuse_unidentified_columns,
    schema_follows_source,
)
from ..iceberg.history import HistoryPosition, history_position
from ..iceberg.layout import apply_layout
from ..iceberg.transaction import open_transaction
from ..iceberg.types import arrow_schema
from ..iceberg.values import null_key_refusal, null_key_rows
from ..source.catalog import SourceColumn, TypeResolver, describe_table, file_node
from ..source.connection import connect
from ..source.lsn import format_lsn
from ..source.partitions import LeafChange, leaf_change, leaf_files, leaves, partitioned_oid
from ..source.xid_snapshot import XidSnapshot
from ..staging.codec import COMMIT_LSN_COLUMN, DELETE, INSERT, StagedRelation, changes_of, commit_lsns_of, read_staged
from ..staging.store import ObjectStore
from ..tables import MirroredTables
from .align import StagedBatch, align_batches
from .append import append_rows, keys_compare_exactly, replace_keys
from .arrow_rows import folded_arrow, spark_arrow_schema, spark_value
from .branch import spark_view, write_on_branch
from .change_stamp import stamp_merged, without_fields
from .commit_properties import snapshot_properties
from .fold import UPSERT, fold
from .history import HistoryWriter
from .lanes import LaneConnections, on_lanes
from .spark_sql import (
    OP_COLUMN,
    UNCHANGED_COLUMN,
    fill_statement,
    merge_statement,
    soft_delete_all_statement,
    spark_identifier,
)
from .toast_fill import fill_moved_keys
from .vectorized import can_fold_vectorized, fold_vectorized, typed_column


@dataclass
class MergeResult:
    """What one table's materialization did (also the Dagster metadata)."""

    table: str
    batches: int = 0
    pyiceberg_writes: int = 0  # of the batches, those written without a Spark MERGE (see materializer.append)
    changes: int = 0
    upserts: int = 0
    deletes: int = 0
    truncated: bool = False
    schema_changes: tuple[str, ...] = ()
    lag: Lag = field(default_factory=Lag)  # after the merge
    last_lsn: int | None = None
    snapshot_id: int | None = None
    waiting_for_snapshot: bool = False
    # Why the table waits for an online resync (requested before or by this merge), else None.
    resync_reason: str | None = None
    seconds: float = 0.0
    # Seconds per phase (see PHASES), summed over the batches: where a merge spends its time.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def last_lsn_text(self) -> str:
        """The LSN the last merged change was flushed at, as PostgreSQL writes LSNs ("none" before any)."""
        return format_lsn(self.last_lsn) if self.last_lsn else "none"

    @property
    def not_current(self) -> str | None:
        """Why this merge could not bring the table up to date, with the command that does; None when it did."""
        if self.waiting_for_snapshot:
            return "waiting for its snapshot to complete: `snapshot` (or `run`) takes it"
        if self.resync_reason:
            if is_repair(self.resync_reason):
                return f"waiting for a repair ({self.resync_reason}): {resync_command(self.table, self.resync_reason)}"
            return (
                f"waiting for an online resync ({self.resync_reason}): `resync --table {self.table}` runs it "
                "(or `materialize --once --resync`)"
            )
        return None

    def as_json(self) -> dict[str, Any]:
        """The result as ``materialize --once --json`` prints it."""
        return {
            "table": self.table,
            "current": self.not_current is None,
            "not_current_because": self.not_current,
            "changes": self.changes,
            "upserts": self.upserts,
            "deletes": self.deletes,
            "batches": self.batches,
            "pyiceberg_batches": self.pyiceberg_writes,
            "mat_cursor": self.lag.mat_cursor,
            "log_head": self.lag.log_head,
            "last_lsn": self.last_lsn_text,
            "schema_changes": list(self.schema_changes),
        }


# read: staged files fetched and decoded; fold: folded by key (plus TOAST fills and schema evolution);
# arrow: typed Arrow rows handed to Spark; spark_start: the session created (first merge of a process);
# spark_merge: the MERGE INTO (Iceberg commit included); pyiceberg_write: the batch written by pyiceberg
# instead (see materializer.append); history: the history table's MERGE (tables with
# history); commit: mat_cursor advanced.
PHASES = ("read", "fold", "arrow", "spark_start", "spark_merge", "pyiceberg_write", "history", "commit")


@contextlib.contextmanager
def timed_phase(timings: dict[str, float], phase: str) -> Iterator[None]:
    """Add the seconds the block takes to ``timings[phase]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - started


@dataclass
class PreparedBatch:
    """A batch read from the staged log, folded and typed: everything before the MERGE."""

    identifier: tuple[str, str]
    table: Table
    key: list[str]
    rows: pa.Table
    schema_changes: list[str]
    changes: int
    upserts: int
    deletes: int
    truncated: bool
    # Some upsert leaves columns to the target's value (unchanged TOAST, a column dropped at the source).
    has_unchanged: bool
    # Folded by Arrow compute (see materializer.vectorized) rather than change by change.
    vectorized: bool
    # The last TRUNCATE's commit LSN and time (see fold.FoldResult).
    truncated_lsn: int = 0
    truncated_at: datetime | None = None
    # The batch's changes, aligned to the table's columns (what a history table is written from).
    staged: list[StagedBatch] = field(default_factory=list)
    # ``rows`` are typed as Iceberg stores them (no uuid column, which Spark reads as text), and whether
    # every change is an INSERT: what pyiceberg can write without a MERGE (see materializer.append).
    iceberg_typed: bool = False
    inserts_only: bool = False


log = logging.getLogger(__name__)

# In the summary of a merge commit that brings the table up to a position the flusher had staged
# completely: the source LSN (as PostgreSQL writes it) the table is then complete up to, every change
# of a transaction committed at or before it applied and none after (see docs/cuts.md).
SOURCE_LSN = "pg2iceberg.source-lsn"

# The live columns of a table (name, type, default, position): any DDL the schema follows changes it.
_COLUMNS_SIGNATURE = """
SELECT string_agg(concat_ws(':', attnum, attname, atttypid, atttypmod, atthasdef, attgenerated), ',' ORDER BY attnum)
FROM pg_catalog.pg_attribute
WHERE attrelid = to_regclass(quote_ident(%s) || '.' || quote_ident(%s)) AND attnum > 0 AND NOT attisdropped
"""


@dataclass(frozen=True)
class _Described:
    """A table's columns as the catalog describes them now, its relfilenode and their signature."""

    columns: tuple[SourceColumn, ...]
    file_node: int | None
    signature: str


@dataclass
class _Seen:
    """What a process found about its tables and need not look at again (shared by its lanes)."""

    fills_checked: set[str] = field(default_factory=set)
    unpartitioned: set[str] = field(default_factory=set)
    leaves: dict[str, dict[int, int]] = field(default_factory=dict)  # leaves found equal to Iceberg's record
    columns: dict[str, str] = field(default_factory=dict)  # column signatures the Iceberg schema follows
    histories_checked: set[str] = field(default_factory=set)  # tables whose history was looked at once


class Materializer:
    """Merges each table's staged log into its Iceberg table through Spark."""

    def __init__(
        self,
        config: PipelineConfig,
        tables: MirroredTables,
        store: StagedLogStore,
        objects: ObjectStore,
        catalog: Catalog,
        spark_factory: Callable[[], Any],
        worker_id: str | None = None,
        source: Callable[[], psycopg.Connection] | None = None,
    ) -> None:
        """``source`` hands out a kept connection to the source (a pipeline's); without it each use
        of the source opens one of its own."""
        self.config = config
        self.tables = tables
        self._source_connection = source
        self.store = store
        self.catalog = catalog
        self.object_store = objects
        self._spark_factory = spark_factory
        self._spark: Any = None
        self._spark_lock = threading.Lock()  # lanes ask for the one session at once
        self.worker_id = worker_id or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.group = config.materialize.group
        self._seen = _Seen()
        self._lane_numbers = itertools.count(1)  # next() is atomic: lanes open on their own threads
        self._lane_connections: LaneConnections | None = None  # when this is a lane (see _open_lane)

    @property
    def spark(self) -> Any:
        with self._spark_lock:
            if self._spark is None:
                self._spark = self._spark_factory()
        return self._spark

    def materialize_table(self, table_key: str, max_batches: int | None = None, rounds: int = 1) -> MergeResult:
        """Apply the table's staged log up to its current head (or ``max_batches`` batches).

        The head is read once Spark is up, and what is staged after that waits for the next call: under
        steady writes the loop would otherwise never end, and other tables would never get their turn.
        ``rounds`` > 1 reads the head again after each round: a process that started a JVM for this
        merge (a Dagster run) then also applies, warm and fast, what was staged while its first,
        cold merge ran, instead of leaving it to the next run and its new JVM.
        """
        started = time.monotonic()
        result = MergeResult(table=table_key, lag=self.store.lag(self.group, table_key))
        if not self._mergeable(table_key, result):
            return result
        # A batch fills what its table has pending; with no batch to merge, only a snapshot can have
        # left fills (once per process and table, so an idle table costs no catalog read).
        unfilled = self._table_with_fills_left(table_key) if result.lag.changes <= 0 else None
        leaves = self._leaves_changed(table_key)
        described = self._columns_changed(table_key) if result.lag.changes <= 0 else None
        unseeded = result.lag.changes <= 0 and self._history_unseeded(table_key)
        if result.lag.changes <= 0 and unfilled is None and leaves is None and described is None and not unseeded:
            return result
        with writer_lease_within(self.store, self.group, table_key, self.worker_id, LEASE_WAIT_SECONDS):
            # A resync requested since the look above: nothing may be merged past its request.
            if not self._mergeable(table_key, result):
                return result
            try:
                if leaves is not None:
                    self._follow_leaves(table_key, leaves)
                if described is not None:
                    unfilled = self._follow_columns(table_key, described, result) or unfilled
                if self.tables[table_key].history is not None:
                    # The first versions come from the copy as the snapshot left it: before any fill or batch.
                    self._start_spark(table_key, result.timings)
                    self._history_ready(table_key, self.catalog.load_table(self.tables[table_key].iceberg))
                if unfilled is not None:
                    self._fill_pending(table_key, unfilled, result.timings)
                self._apply_rounds(table_key, rounds, max_batches, result)
            except ResyncRequiredError as exc:
                if not self.config.materialize.auto_resync:
                    raise
                # Under the lease: the cursor stays before the batch that found it.
                self.store.request_resync(table_key, exc.reason)
                result.resync_reason = exc.reason
        result.lag = self.store.lag(self.group, table_key)
        result.seconds = time.monotonic() - started
        return result

    def _mergeable(self, table_key: str, result: MergeResult) -> bool:
        """The table's snapshot is complete and no resync is pending (else ``result`` says which)."""
        state = self.store.table_state(table_key)
        if state is None or not state.snapshot_complete:
            result.waiting_for_snapshot = True
            return False
        result.resync_reason = state.resync_reason
        return state.mergeable

    def _leaves_changed(self, table_key: str) -> LeafChange | None:
        """For a partitioned source table, how its leaf partitions differ from those its Iceberg rows
        came from (see source.partitions); None when they do not, or the table is not partitioned
        (its Iceberg table records no leaves: then the source is never asked). Leaves this process
        found equal to the record are not compared again (no catalog read)."""
        if table_key in self._seen.unpartitioned:
            return None
        identifier = self.tables[table_key].iceberg
        recorded = None
        if table_key not in self._seen.leaves:
            recorded = recorded_leaves(self.catalog.load_table(identifier))
            if recorded is None:
                self._seen.unpartitioned.add(table_key)
                return None
        table = self.tables[table_key].config
        with self._source() as conn:
            oid = partitioned_oid(conn, table.schema_name, table.table_name)
            if oid is None:
                return None  # dropped, or recreated unpartitioned: the startup checks refuse it
            current = leaves(conn, oid)
            if self._seen.leaves.get(table_key) == leaf_files(current):
                return None
            if recorded is None:
                recorded = recorded_leaves(self.catalog.load_table(identifier)) or {}
            change = leaf_change(conn, current, recorded)
        if change.reason is None and change.now == recorded:
            self._seen.leaves[table_key] = change.now
            return None
        return change

    def _columns_changed(self, table_key: str) -> _Described | None:
        """The table as the catalog describes it now (and the signature of its columns), when its
        columns changed since this process last looked and the Iceberg schema does not follow them
        yet. pgoutput describes a table only with its next row change: without this, a column added
        (with a DEFAULT older rows read) to a table nobody writes would stay missing in Iceberg."""
        mirrored = self.tables[table_key]
        with contextlib.ExitStack() as stack:
            try:
                conn = stack.enter_context(self._source())
            except Pg2IcebergError as exc:  # the staged log merges without the source; this waits for it
                log.warning("%s: not comparing its columns with the source's now: %s", table_key, exc)
                return None
            row = conn.execute(_COLUMNS_SIGNATURE, (mirrored.schema_name, mirrored.table_name)).fetchone()
            signature = row[0] if row else None
            if signature is None or self._seen.columns.get(table_key) == signature:
                return None
            source = describe_table(conn, mirrored.config, TypeResolver(conn), self.config.replication.publication)
            described = _Described(source.columns, file_node(conn, source.oid), signature)
        iceberg = self.catalog.load_table(self.tables[table_key].iceberg)
        if not schema_follows_source(iceberg, source.columns):
            self._seen.columns[table_key] = signature
            return None
        return described

    @contextlib.contextmanager
    def _source(self) -> Iterator[psycopg.Connection]:
        """A connection to the source: the kept one when given (the checks of idle tables run at
        every merge, and a new server process per table and merge costs more than the checks), else
        one for this use."""
        if self._source_connection is not None:
            yield self._source_connection()
            return
        with connect(self.config.source) as conn:
            yield conn

    def _follow_columns(self, table_key: str, described: _Described, result: MergeResult) -> Table | None:
        """Evolve the schema to the columns the catalog describes (see :meth:`_columns_changed`);
        returns the table when that left defaults to fill."""
        table = self.catalog.load_table(self.tables[table_key].iceberg)
        result.schema_changes += tuple(evolve_schema(table, table_key, described.columns, described.file_node))
        self._seen.columns[table_key] = described.signature
        table = self.catalog.load_table(self.tables[table_key].iceberg)
        return table if pending_fills(table) else None

    def _follow_leaves(self, table_key: str, change: LeafChange) -> None:
        """Resync for rows that joined or left with no WAL change; else record the new leaves (created
        empty, or attached with no row older than the attachment: every row of theirs is streamed)."""
        if change.reason is not None:
            raise ResyncRequiredError(table_key, change.reason)
        table = self.catalog.load_table(self.tables[table_key].iceberg)

        def record() -> None:
            table.refresh()
            with open_transaction(table) as transaction:
                transaction.set_properties({SOURCE_LEAVES: leaves_property(change.now)})

        commit_with_retry(record)
        self._seen.leaves[table_key] = change.now

    def _apply_rounds(self, table_key: str, rounds: int, max_batches: int | None, result: MergeResult) -> None:
        """Apply batches up to the head, ``rounds`` times (see :meth:`materialize_table`)."""
        for _ in range(rounds):
            flushed, heads = self.store.staged_positions([table_key])
            self._apply_until(table_key, heads[table_key], flushed, max_batches, result)

    def _apply_until(
        self, table_key: str, head: int, flushed: int | None, max_batches: int | None, result: MergeResult
    ) -> None:
        """Apply batches up to offset ``head`` and never past it, ``head`` being the log head read
        together with ``flushed_lsn`` = ``flushed``: the batch that reaches it leaves the table complete
        up to ``flushed``, which its commit records (:data:`SOURCE_LSN`)."""
        while max_batches is None or result.batches < max_batches:
            cursor = self.store.mat_cursor(self.group, table_key)
            if cursor >= head:
                break
            entries = self.store.log_entries(table_key, cursor, self.config.materialize.max_batch_changes)
            # Entries from ``head`` on were registered by later flushes (a flush's files are atomic).
            entries = [entry for entry in entries if entry.start_offset < head]
            if not entries:
                break
            complete = flushed if entries[-1].end_offset == head else None
            self._apply_batch(table_key, cursor, entries, result, self.replay_epoch(table_key), complete)
            result.batches += 1

    def merge_to(self, table_key: str, head: int, flushed: int) -> MergeResult:
        """Apply the table's staged log up to offset ``head``, no further, where ``head`` was read
        together with ``flushed_lsn`` = ``flushed`` (see StagedLogStore.staged_positions); the caller
        holds the table's writer lease (a cut, see cuts.py). Like :meth:`materialize_table` otherwise,
        except that it neither follows the source's columns nor its partitions as they are now: a cut
        reads the table as of ``flushed``, not later."""
        started = time.monotonic()
        result = MergeResult(table=table_key, lag=self.store.lag(self.group, table_key))
        if not self._mergeable(table_key, result):
            return result
        if result.lag.mat_cursor < head:
            self._apply_until(table_key, head, flushed, None, result)
        result.lag = self.store.lag(self.group, table_key)
        result.seconds = time.monotonic() - started
        return result

    def _history_unseeded(self, table_key: str) -> bool:
        """Whether the table's history lacks the first versions of its snapshot epoch (looked at once
        per process and table: a table with no change to merge then has them written too)."""
        mirrored = self.tables[table_key]
        if mirrored.history is None or table_key in self._seen.histories_checked:
            return False
        self._seen.histories_checked.add(table_key)
        epoch = self.replay_epoch(table_key)
        try:
            history = self.catalog.load_table(mirrored.history)
        except NoSuchTableError:
            return True
        return history_position(history).epoch != (epoch.epoch if epoch is not None else 0)

    def _history_ready(self, table_key: str, live: Table) -> tuple[HistoryWriter, Table, HistoryPosition] | None:
        """The table's history writer, its history table (columns following the live table's, first
        versions of the epoch written) and what it holds; None for a table without history. Under
        the writer lease, before anything of the batch is written (a refusal writes nothing)."""
        mirrored = self.tables[table_key]
        settings = self.config.history_for(mirrored.config)
        if mirrored.history is None or settings is None:
            return None
        writer = HistoryWriter(
            self.spark,
            self.catalog,
            self.config.iceberg.catalog.name,
            self.object_store,
            mirrored,
            settings,
            self.config.values.out_of_range,
            new_table_location(self.config, mirrored.history),
            new_table_properties(self.config, mirrored),
        )
        history = writer.table(live)
        key = [live.schema().find_field(i).name for i in live.schema().identifier_field_ids]
        cursor = self.store.mat_cursor(self.group, table_key)
        history = writer.seed(history, live, key, self.replay_epoch(table_key), cursor)
        return writer, history, writer.position(history, cursor)

    def _table_with_fills_left(self, table_key: str) -> Table | None:
        """The Iceberg table when a snapshot left defaults of added columns to fill, the first time
        this process asks for ``table_key``; else None."""
        if table_key in self._seen.fills_checked:
            return None
        self._seen.fills_checked.add(table_key)
        table = self.catalog.load_table(self.tables[table_key].iceberg)
        return table if pending_fills(table) else None

    def replay_epoch(self, table_key: str) -> SnapshotEpoch | None:
        """The snapshot epoch the table's rows were read in (None for a table snapshotted before epochs)."""
        return replay_epoch(self.store, table_key)

    def _start_spark(self, table_key: str, timings: dict[str, float]) -> None:
        """Create the session when a merge first needs it (a batch pyiceberg does not write, a fill, a
        history table), and resolve the table in it: a process whose batches pyiceberg writes (a
        Dagster run) never starts or attaches to a JVM."""
        if self._spark is not None:
            return
        with timed_phase(timings, "spark_start"):
            spark = self._spark_factory()
            identifier = self.tables[table_key].iceberg
            # Loads the catalog and Iceberg's table classes now (the first table access costs seconds).
            spark.table(spark_identifier(self.config.iceberg.catalog.name, *identifier)).schema  # noqa: B018
            self._spark = spark

    def prepare_batch(
        self,
        table_key: str,
        cursor: int,
        entries: list[LogEntry],
        replay_epoch: SnapshotEpoch | None = None,
        timings: dict[str, float] | None = None,
    ) -> PreparedBatch:
        """Read ``entries`` past ``cursor``, evolve the schema, fold them by key and type the rows.

        Changes of transactions the table's snapshot already shows (``replay_epoch``) are left out: the
        table is one read under that snapshot, so replaying exactly the others reaches the source's state.
        """
        timings = {} if timings is None else timings
        identifier = self.tables[table_key].iceberg
        with timed_phase(timings, "read"):
            table = self.catalog.load_table(identifier)
            staged = list(staged_changes(self.object_store, entries, cursor, replay_epoch))
        with timed_phase(timings, "fold"):
            # The last relation describes the table as it is now; older ones are mapped onto it.
            relations = [relation for relation, _ in staged]
            newest = relations[-1] if relations else None
            _refuse_unkeyed(self.tables[table_key].config, relations)
            _refuse_changed_key(table_key, table, relations)
            refuse_unfollowable_retypes(table_key, [(relation.columns, relation.file_node) for relation in relations])
            schema_changes = evolve_schema(table, table_key, newest.columns, newest.file_node) if newest else []
            if schema_changes:
                table = self.catalog.load_table(identifier)
            if newest:
                # A changed partition_by/sort_by, or a partition column dropped at the source, before
                # Spark writes: its files take the spec from here on.
                schema_changes += apply_layout(table, table_key, self.tables[table_key].config, newest.columns)
                table = ensure_configured_columns(table, self.config, self.tables[table_key].config, newest.columns)
            # Against the schema as evolved (a rename just applied takes the old name away).
            refuse_unidentified_columns(table, table_key, [relation.columns for relation, _ in staged])
            key = [table.schema().find_field(i).name for i in table.schema().identifier_field_ids]
            staged = align_batches(staged, table)
            metadata, deletion = metadata_columns(table), deletion_columns(table)
            leave_out = tuple(metadata_names(table))
            if can_fold_vectorized(staged):
                iceberg_arrow = without_fields(arrow_schema(table.schema()), leave_out)
                spark_schema = spark_arrow_schema(iceberg_arrow)
                fast = fold_vectorized(
                    staged, key, iceberg_arrow, spark_schema, spark_value, self.config.values.out_of_range
                )
                rows = stamp_merged(fast.rows, metadata, deletion, fast.commit_lsns, fast.committed_at)
                return PreparedBatch(
                    identifier, table, key, rows, schema_changes, fast.changes, fast.upserts, fast.deletes,
                    truncated=False, has_unchanged=fast.has_unchanged, vectorized=True, staged=staged,
                    iceberg_typed=spark_schema == iceberg_arrow, inserts_only=_inserts_only(staged),
                )  # fmt: skip
            folded = fold([(relation, changes_of(changes)) for relation, changes in staged], key)
            fill_moved_keys(folded, table, key)
        with timed_phase(timings, "arrow"):
            rows = folded_arrow(folded, table, self.config.values.out_of_range, leave_out)
            last = list(folded.rows.values())
            rows = stamp_merged(
                rows,
                metadata,
                deletion,
                pa.array([row.commit_lsn for row in last], pa.int64()),
                pa.array([row.committed_at for row in last], pa.timestamp("us", tz="UTC")),
            )
        deletes = sum(1 for row in folded.rows.values() if row.op == DELETE)
        unchanged = pc.any(pc.greater(pc.list_value_length(rows.column(UNCHANGED_COLUMN)), 0)).as_py()
        return PreparedBatch(
            identifier, table, key, rows, schema_changes, folded.changes, len(folded.rows) - deletes, deletes,
            truncated=folded.truncated, has_unchanged=bool(unchanged), vectorized=False,
            truncated_lsn=folded.truncated_lsn, truncated_at=folded.truncated_at, staged=staged,
        )  # fmt: skip

    def _apply_batch(
        self,
        table_key: str,
        cursor: int,
        entries: list[LogEntry],
        result: MergeResult,
        replay_epoch: SnapshotEpoch | None,
        complete_lsn: int | None = None,
    ) -> None:
        """Merge ``entries`` and advance the cursor past them; ``complete_lsn``: the source LSN the
        table is complete up to once they are merged (None: the batch stops inside a flush)."""
        timings = result.timings
        prepared = self.prepare_batch(table_key, cursor, entries, replay_epoch, timings)
        prepared = _without_keyless_deletes(table_key, prepared)
        if self.tables[table_key].history is not None:
            self._start_spark(table_key, timings)
        history = self._history_ready(table_key, prepared.table)
        self._fill_pending(table_key, prepared.table, timings)
        properties = {SOURCE_LSN: format_lsn(complete_lsn)} if complete_lsn is not None else {}
        by_pyiceberg = True
        if self._appendable(table_key, prepared):
            with timed_phase(timings, "pyiceberg_write"):
                append_rows(prepared.table, prepared.rows, properties)
        elif self._replaceable(prepared):
            with timed_phase(timings, "pyiceberg_write"):
                replace_keys(prepared.table, prepared.rows, prepared.key, properties)
        else:
            by_pyiceberg = False
            self._start_spark(table_key, timings)
            with timed_phase(timings, "spark_merge"):
                self._merge_batch(table_key, prepared, properties)
        result.pyiceberg_writes += by_pyiceberg
        with timed_phase(timings, "commit"):
            # pyiceberg's write left ``prepared.table`` current; Spark's commit is in the catalog only.
            table = prepared.table if by_pyiceberg else self.catalog.load_table(prepared.identifier)
            snapshot = table.current_snapshot()
            last = entries[-1]
        if history is not None:
            crash_point("materializer.before_history")
            with timed_phase(timings, "history"):
                self._write_history(history, prepared, entries, cursor, replay_epoch)
        with timed_phase(timings, "commit"):
            crash_point("materializer.after_commit")
            self.store.advance_mat_cursor(
                self.group, table_key, last.end_offset, last.flushable_lsn, snapshot.snapshot_id if snapshot else None
            )
        result.changes += prepared.changes
        result.deletes += prepared.deletes
        result.upserts += prepared.upserts
        result.truncated = result.truncated or prepared.truncated
        result.schema_changes += tuple(prepared.schema_changes)
        result.last_lsn = last.flushable_lsn
        result.snapshot_id = snapshot.snapshot_id if snapshot else None

    def _merge_batch(self, table_key: str, prepared: PreparedBatch, properties: dict[str, str]) -> None:
        """Write the batch through Spark: a MERGE (after a TRUNCATE's delete), or for a large merge-on-read
        table the branch write; ``properties`` go into the summary of the batch's last commit."""
        spark = self.spark
        if prepared.rows.num_rows and self._upserts_on_branch(prepared):
            with self._spark_view(spark, table_key, prepared.rows) as view:
                write_on_branch(
                    spark,
                    self.config.iceberg.catalog.name,
                    prepared.identifier,
                    prepared.table,
                    prepared.key,
                    view,
                    prepared.truncated,
                    properties,
                )
            return
        target = spark_identifier(self.config.iceberg.catalog.name, *prepared.identifier)
        # Only the batch's last commit is complete up to the source LSN ``properties`` carry.
        with snapshot_properties(spark, properties if not prepared.rows.num_rows else {}):
            if prepared.truncated:
                spark.sql(_truncate_statement(target, prepared))
        if prepared.rows.num_rows:
            with snapshot_properties(spark, properties):
                self._merge_rows(spark, table_key, target, prepared)

    def _write_history(
        self,
        history: tuple[HistoryWriter, Table, HistoryPosition],
        prepared: PreparedBatch,
        entries: list[LogEntry],
        cursor: int,
        replay_epoch: SnapshotEpoch | None,
    ) -> None:
        """Add the batch's versions to the history table (see :class:`.history.HistoryWriter`)."""
        writer, table, position = history

        def staged_from(offset: int) -> list[StagedBatch]:
            if offset <= cursor:
                return prepared.staged
            # The history holds part of this batch already (written before a crash, when the batch was shorter).
            later = [entry for entry in entries if entry.end_offset > offset]
            return align_batches(list(staged_changes(self.object_store, later, offset, replay_epoch)), prepared.table)

        writer.write(table, position, staged_from, entries[-1].end_offset, prepared.key)

    def _written_by_pyiceberg(self, prepared: PreparedBatch) -> bool:
        """Whether pyiceberg can write the batch at all (see materializer.append): rows carrying every
        column, typed as Iceberg stores them, and no soft delete (which updates the deleted row);
        ``materialize.pyiceberg_max_rows: 0`` leaves every batch to Spark."""
        return (
            self.config.materialize.pyiceberg_max_rows > 0
            and prepared.iceberg_typed
            and prepared.vectorized
            and not prepared.has_unchanged
            and prepared.rows.num_rows > 0
            and deletion_columns(prepared.table) is None
        )

    def _appendable(self, table_key: str, prepared: PreparedBatch) -> bool:
        """Whether the batch is appended without a MERGE (see materializer.append): it inserts rows and
        nothing else, and nothing was committed to the table past the cursor (a replay after a crash
        does not append). ``prepared.table`` was loaded under the writer lease."""
        if not prepared.inserts_only or not self._written_by_pyiceberg(prepared):
            return False
        if pending_fills(prepared.table):
            return False  # filled just before this batch: a commit past the cursor
        snapshot = prepared.table.current_snapshot()
        merged = self.store.merged_snapshot_id(self.group, table_key)
        return snapshot is not None and snapshot.snapshot_id == merged

    def _replaceable(self, prepared: PreparedBatch) -> bool:
        """Whether pyiceberg rewrites the files holding the batch's keys with its upserts (see
        materializer.append): a copy-on-write table of at most ``materialize.pyiceberg_max_rows`` rows
        whose keys pyiceberg compares exactly."""
        limit = self.config.materialize.pyiceberg_max_rows
        snapshot = prepared.table.current_snapshot()
        if snapshot is None or snapshot.summary is None or not self._written_by_pyiceberg(prepared):
            return False
        if merges_on_read(prepared.table) or not keys_compare_exactly(prepared.table, prepared.key):
            return False
        return int(snapshot.summary.additional_properties.get("total-records", 0)) <= limit

    def _spark_view(self, spark: Any, table_key: str, rows: pa.Table) -> contextlib.AbstractContextManager[str]:
        """``rows`` as a Spark temporary view (see :func:`.branch.spark_view`)."""
        return spark_view(spark, self.object_store, self.tables[table_key].staging, rows)

    def _upserts_on_branch(self, prepared: PreparedBatch) -> bool:
        """Whether the batch is written as delete-by-key plus append on :data:`MERGE_BRANCH`: every
        upsert carries all its columns (nothing to keep from the target), the table is merge-on-read,
        and it holds at least ``materialize.branch_upsert_min_rows`` rows. Spark plans a MERGE with inserts as an
        outer join that shuffles and sorts the whole target unless it can broadcast it; deleting the
        batch's keys is an inner join that broadcasts the batch instead."""
        snapshot = prepared.table.current_snapshot()
        if prepared.has_unchanged or snapshot is None or snapshot.summary is None:
            return False
        if deletion_columns(prepared.table) is not None:
            return False  # a soft delete updates its row: the MERGE does that
        if prepared.table.properties.get("write.merge.mode") != "merge-on-read":
            # Copy-on-write rewrites every file a key lives in either way: the MERGE was as fast.
            return False
        rows = int(snapshot.summary.additional_properties.get("total-records", 0))
        return rows >= self.config.materialize.branch_upsert_min_rows

    def _merge_rows(self, spark: Any, table_key: str, target: str, prepared: PreparedBatch) -> None:
        """MERGE the prepared rows into ``target``."""
        with self._spark_view(spark, table_key, prepared.rows) as view:
            columns = [f.name for f in prepared.table.schema().fields]
            soft = deletion_columns(prepared.table)
            # A soft delete sets the deletion and change metadata columns of the row, nothing else.
            soft_delete = [*soft.names, *metadata_names(prepared.table) - set(soft.names)] if soft else []
            spark.sql(
                merge_statement(
                    target, view, columns, prepared.key, keep_unchanged=prepared.has_unchanged, soft_delete=soft_delete
                )
            )

    def _fill_pending(self, table_key: str, table: Table, timings: dict[str, float]) -> None:
        """Give every existing row the value of each column added with a DEFAULT since the last merge
        (PostgreSQL shows it on rows older than the ALTER, with no WAL change), then forget the fill.
        Runs before anything newer is merged, so every row it touches is older than the ALTER."""
        fills = pending_fills(table)
        if not fills:
            return
        self._start_spark(table_key, timings)
        identifier = self.tables[table_key].iceberg
        with timed_phase(timings, "spark_merge"):
            iceberg_arrow = arrow_schema(table.schema())
            spark_schema = spark_arrow_schema(iceberg_arrow)
            names = [column_name(table.schema(), fill.field_id) for fill in fills]
            rule = self.config.values.out_of_range
            arrays = []
            for fill, name in zip(fills, names, strict=True):
                target_type = spark_schema.field(name).type
                convert = spark_value if target_type != iceberg_arrow.field(name).type else None
                texts = pa.array([fill.value], pa.string())
                arrays.append(typed_column(texts, fill.column, target_type, name, rule, convert))
            row = pa.Table.from_arrays(arrays, names=names)
            target = spark_identifier(self.config.iceberg.catalog.name, *identifier)
            with self._spark_view(self.spark, table_key, row) as view:
                self.spark.sql(fill_statement(target, view, names))
            crash_point("materializer.after_fill")
            clear_pending_fills(self.catalog.load_table(identifier), [fill.field_id for fill in fills])

    def run_once(
        self, table_keys: list[str] | None = None, before_each: Callable[[], None] | None = None
    ) -> dict[str, MergeResult]:
        """Bring every (or the given) table up to its current head, the oldest unmerged change first;
        a table's failure is raised once the others have merged. ``before_each`` is called before
        each table's merge starts (``run``: a flush being written goes first)."""
        keys = self.oldest_change_first(table_keys or list(self.tables))
        results: dict[str, MergeResult] = {}
        errors: list[Exception] = []
        for key, outcome in self.merge_tables(keys, before_each=before_each):
            if isinstance(outcome, Exception):
                errors.append(outcome)
            else:
                results[key] = outcome
        if errors:
            raise errors[0]
        return {key: results[key] for key in keys}

    def merge_tables(
        self, table_keys: list[str], rounds: int = 1, before_each: Callable[[], None] | None = None
    ) -> Iterator[tuple[str, MergeResult | Exception]]:
        """Merge each table (see :meth:`materialize_table`), up to ``materialize.parallelism`` at once
        on the one Spark session, started in the given order; yields each table with its result, or
        the error its merge raised, as it ends. Each concurrent merge runs on a lane: a materializer
        with connections of its own (to the state database and the source) and this one's Spark.
        ``before_each`` is called before each table's merge starts."""

        def merge(materializer: Materializer, key: str) -> MergeResult:
            if before_each is not None:
                before_each()
            return materializer.materialize_table(key, rounds=rounds)

        count = min(self.config.materialize.parallelism, len(table_keys))
        if count <= 1:
            for key in table_keys:
                try:
                    yield key, merge(self, key)
                except Exception as exc:  # reported to the caller, like a lane's
                    yield key, exc
            return
        yield from on_lanes(table_keys, count, self._open_lane, Materializer._close_lane, merge)

    def _open_lane(self) -> Materializer:
        """A materializer for one worker thread: this one's catalog, Spark and findings, its own connections."""
        connections = LaneConnections.open(self.config)
        lane = Materializer(
            self.config,
            self.tables,
            connections.store,
            self.object_store,
            self.catalog,
            lambda: self.spark,
            worker_id=f"{self.worker_id}/lane{next(self._lane_numbers)}",
            source=connections.source,
        )
        lane._seen = self._seen
        lane._lane_connections = connections
        return lane

    def _close_lane(self) -> None:
        """Close the connections :meth:`_open_lane` opened for this lane."""
        if self._lane_connections is not None:
            self._lane_connections.close()

    def oldest_change_first(self, table_keys: list[str]) -> list[str]:
        """``table_keys`` ordered by the age of their oldest unmerged staged change, oldest first (one
        query): with many lagging tables, the change waiting longest is merged first."""
        ages = {key: age for key, (_lag, age) in self.store.lags(self.group).items()}
        return sorted(table_keys, key=lambda key: -ages.get(key, 0.0))


def replay_epoch(store: StagedLogStore, table_key: str) -> SnapshotEpoch | None:
    """The snapshot epoch the table's rows were read in (None for a table snapshotted before epochs)."""
    state = store.table_state(table_key)
    return store.snapshot_epoch(state.snapshot_epoch) if state and state.snapshot_epoch is not None else None


def staged_changes(
    objects: ObjectStore, entries: list[LogEntry], cursor: int, epoch: SnapshotEpoch | None
) -> Iterator[tuple[StagedRelation, pa.Table]]:
    """The changes of ``entries`` (in offset order) from offset ``cursor`` on that a merge applies, a
    file at a time: those of transactions the table's snapshot already shows (``epoch``) left out, as
    the table is one read under that snapshot and replaying exactly the others reaches the source's
    state."""
    visible = XidSnapshot.parse(epoch.snapshot) if epoch is not None else None
    for entry in entries:
        relation, changes = read_staged(objects.get(entry.path))
        # The registration's LSN where the file does not record its commits: every change committed by then.
        changes = changes.append_column(COMMIT_LSN_COLUMN, commit_lsns_of(changes, entry.flushable_lsn))
        # An entry may start before the cursor only if it was half applied; never the case as the
        # cursor always lands on an entry's end, but skip defensively by offset.
        changes = changes.slice(max(0, cursor - entry.start_offset))
        if visible is not None and epoch is not None and entry.first_lsn < epoch.lsn_bound:
            changes = changes.filter(pc.invert(visible.visible(changes.column("_xid"))))
            if changes.num_rows == 0:
                # All in the snapshot: its relation (maybe older than the table's rebuilt schema,
                # after a resync) must not steer the evolution.
                continue
        yield relation, changes


def _inserts_only(staged: list[StagedBatch]) -> bool:
    """Whether every staged change is an INSERT."""
    return all(pc.all(pc.equal(changes.column("_op"), INSERT)).as_py() is not False for _, changes in staged)


def _without_keyless_deletes(table_key: str, prepared: PreparedBatch) -> PreparedBatch:
    """Rows whose key the values rule made NULL (see iceberg.values.null_key_rows): a delete of one is
    dropped (no Iceberg row has a NULL key; so a row whose key was mended at the source merges), an
    upsert is refused, naming the table, rather than failing in Spark at every attempt."""
    rows = prepared.rows
    if not rows.num_rows:
        return prepared
    keyless = null_key_rows(rows, prepared.key)
    if not pc.any(keyless).as_py():
        return prepared
    upserts = pc.sum(pc.and_(keyless, pc.equal(rows.column(OP_COLUMN), UPSERT))).as_py() or 0
    if upserts:
        raise null_key_refusal(table_key, prepared.key, upserts)
    dropped = pc.sum(keyless).as_py() or 0
    return replace(prepared, rows=rows.filter(pc.invert(keyless)), deletes=prepared.deletes - dropped)


def _refuse_changed_key(table_key: str, table: Table, relations: list[StagedRelation]) -> None:
    """A primary key changed at the source (``DROP CONSTRAINT ..._pkey, ADD PRIMARY KEY (other)``): the
    Iceberg table is keyed on the old columns, which the new key's deletes do not carry. Compared by
    ``attnum``, so a renamed key column is still the same key."""
    schema = table.schema()
    attnums = column_attnums(table)
    mirrored = {attnums.get(field_id) for field_id in schema.identifier_field_ids}
    if None in mirrored:
        return  # a table whose fields were not recorded: nothing to compare with
    for relation in relations:
        if not relation.key:
            continue  # staged before the key was recorded
        staged = {column.attnum for column in relation.columns if column.name in relation.key}
        if None not in staged and staged != mirrored:
            was = [schema.find_field(field_id).name for field_id in schema.identifier_field_ids]
            raise ResyncRequiredError(
                table_key,
                f"its primary key changed at the source from ({', '.join(was)}) to ({', '.join(relation.key)}), and "
                "the Iceberg table is keyed on the old columns",
            )


def _refuse_unkeyed(table: TableConfig, relations: list[StagedRelation]) -> None:
    """Changes staged while the table's replica identity left key columns out (changed at the source
    after startup): their deletes and key changes cannot be matched to rows, so the table is resynced
    (which refuses to start until the identity carries the key again; the changes the copy's snapshot
    shows are then skipped)."""
    unkeyed = sorted({name for relation in relations for name in relation.unkeyed})
    if unkeyed:
        raise ResyncRequiredError(
            table.key,
            f"its replica identity was changed at the source to one that does not carry the key column(s) "
            f"{', '.join(unkeyed)}, so deletes and key changes staged since cannot be matched to their rows; run "
            f"ALTER TABLE {table.name} REPLICA IDENTITY DEFAULT (or FULL) first",
        )


def _truncate_statement(target: str, prepared: PreparedBatch) -> str:
    """Empty the table for a TRUNCATE; a soft-deleting table marks its live rows deleted instead, with
    the TRUNCATE's commit time and LSN (and its change metadata, when it has them)."""
    deletion = deletion_columns(prepared.table)
    if deletion is None:
        return f"DELETE FROM {target}"
    at = prepared.truncated_at
    committed = f"timestamp_micros({int(at.timestamp() * 1_000_000)})" if at is not None else "NULL"
    values = {deletion.deleted_at: committed, deletion.deleted_lsn: str(prepared.truncated_lsn)}
    metadata = metadata_columns(prepared.table)
    if metadata is not None:
        values |= {metadata.lsn: str(prepared.truncated_lsn), metadata.committed_at: committed}
        values[metadata.merged_at] = "current_timestamp()"
    return soft_delete_all_statement(target, values, deletion.deleted_at)
