"""Repair: bring Iceberg tables back to the source by writing only their differences, instead of a
new snapshot of everything. For a lost replication slot (gone, or its WAL removed, on the same
cluster) and for any table ``verify`` found different.

A table's repair is an online resync (see :mod:`.snapshot.resync`) whose copy is replaced by a
comparison:

1. **Request** (``tables.resync_reason`` = ``repair: ...``, under the table's writer lease): its
   merges wait; its changes keep staging; readers keep seeing the table as it was.
2. **Compare**: under a new exported snapshot (a new epoch, recorded before anything is read), the
   source is compared with the Iceberg table by primary key with :func:`~.verify.compare_table`
   (hash buckets spilled to disk past ``BUCKET_ROWS``), gathering the rows that differ.
3. **Write**: ONE Iceberg commit (its summary names the epoch) deletes the keys only in Iceberg or
   different and appends the source's rows of the keys only in the source or different. A reader
   sees the table before or after, never half repaired.
4. **Finish**: the table's epoch becomes the comparison's, and merges resume from their cursor,
   skipping the transactions that snapshot shows (as after the initial snapshot, or a resync).

A lost slot first marks every mirrored table for repair, drops the lost slot (if still listed),
moves the cursors of the configured group to each staged log's head (what was staged from the old
slot is superseded: the new snapshot shows its effect), then creates a new slot with ``SNAPSHOT
'export'``: its consistent point becomes the pipeline's, and ``flushed_lsn`` with it, so streaming
resumes there. Every table is then repaired under that one exported snapshot (epoch of the slot).

Crash safety: each step is recorded before the next. Killed before the new slot exists, the rerun
finds the slot lost again and the tables marked (the mark is idempotent); killed after, the slot is
healthy and the marked tables are repaired under a newer plain exported snapshot (any snapshot
taken after the request works: changes it shows are skipped by the merge, the others applied). A
write that landed before the crash is recognised by the epoch in its summary.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table, Transaction

from .config import PipelineConfig
from .coordination.records import REPAIR_PREFIX, SLOT_LOST_REASON, AdvertisedSnapshot, is_repair
from .coordination.store import CoordinationStore
from .errors import Pg2IcebergError, ResyncRequiredError, SlotBusyError
from .faults import crash_point
from .iceberg.catalog import epoch_committed
from .iceberg.change_metadata import deletion_columns
from .iceberg.delete_formats import merges_on_read
from .iceberg.evolution import evolve_schema, pending_fills, source_files_properties, without_pending_fills
from .iceberg.key_filter import key_filter
from .iceberg.transaction import open_transaction
from .iceberg.types import arrow_schema, as_table_rows
from .materializer.branch import spark_view, write_on_branch
from .materializer.spark_sql import OP_COLUMN
from .snapshot.holder import SnapshotHolder
from .snapshot.resync import request_resync
from .source.catalog import SourceTable, source_files_seen_by
from .source.connection import connect
from .source.xid_snapshot import imported_snapshot
from .staging.store import ObjectStore
from .tables import MirroredTable, MirroredTables
from .validation import StartupReport
from .verify import RowDifferences, compare_table

REPAIR_EPOCH = "pg2iceberg.repair-epoch"  # in the repair commit's summary: the epoch it compared in
REQUESTED_REASON = REPAIR_PREFIX + "requested"


@dataclass(frozen=True)
class SparkWriter:
    """What a merge-on-read table's repair writes through: Spark (its session made on first use), which
    reads the rows to write from the staging store ``objects``."""

    session: Callable[[], Any]
    objects: ObjectStore


@dataclass
class TableRepairResult:
    """What one table's repair did."""

    table: str
    epoch: int | None = None
    pg_rows: int = 0  # source rows compared
    iceberg_rows: int = 0  # Iceberg rows compared
    upserted: int = 0  # source rows written (keys only in the source, or different)
    deleted: int = 0  # Iceberg keys deleted (only in Iceberg, or different)
    snapshot_id: int | None = None  # the repair's commit (None: nothing differed, nothing committed)
    seconds: float = 0.0
    # Its commit had landed before an interruption (only recorded as finished now), or another process
    # repaired it meanwhile: nothing compared here.
    resumed: bool = False
    # A source change no comparison can follow was found: the table waits for an online resync instead.
    left_to_resync: str | None = None

    @property
    def rows_compared(self) -> int:
        return self.pg_rows + self.iceberg_rows

    @property
    def rows_written(self) -> int:
        return self.upserted + self.deleted


@dataclass
class RepairResult:
    """What a repair did: the slot it replaced (if lost) and each table's repair."""

    slot_lost: str | None = None  # why the old slot could not be resumed
    consistent_point: int | None = None  # the new slot's, when one was created
    tables: list[TableRepairResult] = field(default_factory=list)
    # Tables waiting for a full online resync (a schema change no comparison can follow): left to it.
    left_to_resync: dict[str, str] = field(default_factory=dict)


def repair(
    config: PipelineConfig,
    tables: MirroredTables,
    store: CoordinationStore,
    catalog: Catalog,
    report: StartupReport,
    worker_id: str,
    table_keys: Sequence[str] | None = None,
    on_table: Callable[[TableRepairResult], None] | None = None,
    spark: SparkWriter | None = None,
) -> RepairResult:
    """Repair the lost slot (when ``report.slot_lost``: every mirrored table, whatever ``table_keys``,
    since none received the lost changes), else the tables named by ``table_keys``, else those whose
    repair a crash interrupted. See the module docstring."""
    result = RepairResult(slot_lost=report.slot_lost)
    states = store.table_states()
    group = config.materialize.group
    mirrored = [key for key in report.tables if key in states and states[key].snapshot_complete]
    result.left_to_resync = {
        key: reason for key in mirrored if (reason := states[key].resync_reason) and not is_repair(reason)
    }
    if report.slot_lost:
        keys = [key for key in mirrored if key not in result.left_to_resync]
        for key in keys:
            request_resync(store, group, key, SLOT_LOST_REASON, worker_id)
        if report.slot is not None:
            _drop_slot(config)
        crash_point("repair.after_slot_dropped")
        flushed = store.flushed_lsn() or 0
        for key in report.tables:
            # Nothing stages while no slot exists: what was staged from the old one is superseded (the
            # new slot's snapshot shows its effect), so the cursor moves past it unread.
            head = store.log_head(key)
            if store.mat_cursor(group, key) < head:
                store.advance_mat_cursor(group, key, head, flushed, None)
        holder = SnapshotHolder(config, store, create_slot=True)
        result.consistent_point = store.pipeline_meta().consistent_point  # type: ignore[union-attr]
        crash_point("repair.after_slot_created")
    else:
        if table_keys:
            keys = list(table_keys)
            for key in keys:
                if key not in mirrored:
                    raise Pg2IcebergError(f"{key}: its snapshot is not complete, so there is nothing to repair")
                if key in result.left_to_resync:
                    raise Pg2IcebergError(
                        f"{key} waits for an online resync ({result.left_to_resync[key]}), which a repair cannot "
                        f"replace: run `pg2iceberg-dagster resync --table {key}`"
                    )
                request_resync(store, group, key, REQUESTED_REASON, worker_id)
        else:
            keys = [key for key in mirrored if is_repair(states[key].resync_reason)]
        if not keys:
            return result
        holder = SnapshotHolder(config, store, create_slot=False)
    with holder:
        for key in keys:
            done = repair_table(config, tables, store, catalog, report.tables[key], holder.advertised, spark)
            result.tables.append(done)
            if on_table:
                on_table(done)
    return result


def repairs_pending(store: CoordinationStore) -> list[str]:
    """Tables whose repair was requested and has not finished (a crash interrupted it)."""
    return [key for key, state in store.table_states().items() if is_repair(state.resync_reason)]


@dataclass(frozen=True)
class RepairDue:
    """A repair to carry out now: the slot lost (``slot_lost`` says why), or tables whose repair was
    requested or interrupted (``tables``). ``key`` names this need and no other: it changes once the
    slot is replaced (the slot's consistent point) and as a table's repair makes progress (the epoch it
    compares in), so a scheduler launching one repair per key launches it once, and again only after
    an attempt got somewhere."""

    slot: str
    slot_lost: str | None
    tables: tuple[str, ...]
    key: str

    @property
    def reason(self) -> str:
        """Why, in a line (the log, the Dagster run's tag)."""
        if self.slot_lost:
            return f"replication slot {self.slot} {self.slot_lost}"
        return f"the repair of {', '.join(self.tables)} is pending"


def repair_due(config: PipelineConfig, store: CoordinationStore, report: StartupReport) -> RepairDue | None:
    """What must be repaired now, given the startup checks' ``report`` (made with ``slot_lost_ok``); None
    when nothing."""
    states = store.table_states()
    pending = tuple(sorted(key for key, state in states.items() if is_repair(state.resync_reason)))
    if report.slot_lost is None and not pending:
        return None
    meta = store.pipeline_meta()
    at = meta.consistent_point if meta is not None else None
    progress = ",".join(f"{key}@{states[key].resync_epoch}" for key in pending)
    digest = hashlib.sha256(f"{at}|{report.slot_lost}|{progress}".encode()).hexdigest()[:16]
    return RepairDue(config.replication.slot, report.slot_lost, pending, f"repair-{digest}")


def _drop_slot(config: PipelineConfig) -> None:
    """Drop the lost slot (it cannot stream any more; its name is needed for the new one)."""
    with connect(config.source) as conn:
        try:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                (config.replication.slot,),
            )
        except psycopg.errors.ObjectInUse:
            raise SlotBusyError(
                f"replication slot {config.replication.slot} is lost but still held by another process; stop it "
                "(see active_pid in pg_replication_slots), then repair again"
            ) from None


def repair_table(
    config: PipelineConfig,
    tables: MirroredTables,
    store: CoordinationStore,
    catalog: Catalog,
    source: SourceTable,
    snapshot: AdvertisedSnapshot,
    spark: SparkWriter | None = None,
) -> TableRepairResult:
    """Steps 2 to 4 for one table whose repair is requested, under ``snapshot`` (an exported snapshot
    taken after the request); a merge-on-read table is written through ``spark`` when given."""
    # One repair of a table at a time (a `repair --table` next to `run` finishing the same one): the
    # second finds it done.
    with store.table_snapshot_lock(source.key):
        return _repair_table(config, tables, store, catalog, source, snapshot, spark)


def _repair_table(
    config: PipelineConfig,
    tables: MirroredTables,
    store: CoordinationStore,
    catalog: Catalog,
    source: SourceTable,
    snapshot: AdvertisedSnapshot,
    spark: SparkWriter | None,
) -> TableRepairResult:
    started = time.monotonic()
    key = source.key
    identifier = tables[key].iceberg
    state = store.table_state(key)
    assert state is not None, f"{key}: not mirrored"
    if state.resync_reason is None:
        return TableRepairResult(key, epoch=state.snapshot_epoch, resumed=True)  # another process finished it
    table = catalog.load_table(identifier)
    if state.resync_epoch is not None and epoch_committed(table, REPAIR_EPOCH, state.resync_epoch):
        store.finish_resync(key, state.resync_epoch)  # written just before a crash
        return TableRepairResult(key, epoch=state.resync_epoch, seconds=time.monotonic() - started, resumed=True)
    result = TableRepairResult(key, epoch=snapshot.epoch)
    store.start_resync_copy(key, snapshot.epoch)
    # A column added at the source reaches Iceberg first (a schema-only commit: no row changes).
    try:
        if evolve_schema(table, key, source.columns):
            table = catalog.load_table(identifier)
    except ResyncRequiredError as exc:
        # A change no comparison can follow (a type Iceberg cannot evolve into, a generated column added):
        # the table is copied again instead, by an online resync (merges keep waiting for it).
        store.replace_resync_reason(key, exc.reason)
        result.left_to_resync = exc.reason
        return result
    differences = RowDifferences()
    with connect(config.source) as conn, imported_snapshot(conn, snapshot.name):
        diff = compare_table(conn, source, table, config.values.out_of_range, differences=differences)
    result.pg_rows, result.iceberg_rows = diff.pg_rows, diff.iceberg_rows
    result.upserted, result.deleted = differences.upserted, len(differences.delete_keys)
    # The source files the comparison read (a partition truncated or a table rewritten while the slot was
    # lost): recorded with the rows, or the next merge would find them changed and ask for a resync.
    files = source_files_properties(source_files_seen_by(config.source, source, snapshot.name))
    crash_point("repair.before_commit")
    if spark is not None and merges_on_read(table):
        result.snapshot_id = _write_through_spark(config, tables[key], spark, table, differences, files)
    else:
        result.snapshot_id = _write(table, differences, snapshot.epoch, key, files)
    crash_point("repair.after_commit")
    store.finish_resync(key, snapshot.epoch)
    result.seconds = time.monotonic() - started
    return result


def _write(table: Table, differences: RowDifferences, epoch: int, key: str, files: dict[str, str]) -> int | None:
    """Step 3: one commit deleting ``differences.delete_keys`` and appending ``differences.upserts``
    (and recording what was compared, see :func:`_record_compared`). None when nothing differs (the
    record alone is committed when it changed)."""
    transaction = open_transaction(table)
    if not differences.delete_keys and not differences.upserted:
        if _record_compared(table, transaction, files):
            transaction.commit_transaction()
        return None
    properties = {REPAIR_EPOCH: str(epoch)}
    schema = table.schema()
    _record_compared(table, transaction, files)
    doomed = differences.delete_keys
    if deletion_columns(table) is not None:  # a marked row of an upserted key goes too (see RowDifferences)
        doomed = list({*differences.delete_keys, *differences.upsert_keys})
    if doomed:
        key_names = [schema.find_field(field_id).name for field_id in schema.identifier_field_ids]
        transaction.delete(key_filter(key_names, doomed), snapshot_properties=properties)
    if differences.upserted:
        upserts = as_table_rows(table.schema(), pa.concat_tables(differences.upserts))
        transaction.append(upserts, snapshot_properties=properties)
    try:
        committed = transaction.commit_transaction()
    except CommitFailedException as exc:
        raise Pg2IcebergError(
            f"{key}: the Iceberg table changed while it was repaired ({exc}); nothing was written. Run "
            f"`pg2iceberg-dagster repair --table {key}` again"
        ) from None
    current = committed.current_snapshot()
    return current.snapshot_id if current else None


def _record_compared(table: Table, transaction: Transaction, files: dict[str, str]) -> bool:
    """Record in ``transaction`` what the rows written and compared are: the source ``files`` (table
    properties) they were read from, and no pending DEFAULT fill (they hold their values). Whether
    anything changed."""
    properties = {name: value for name, value in files.items() if table.properties.get(name) != value}
    fills = pending_fills(table)
    if fills:
        properties.update(without_pending_fills(table, [fill.field_id for fill in fills]))
    if properties:
        transaction.set_properties(properties)
    return bool(properties)


def _write_through_spark(
    config: PipelineConfig,
    mirrored: MirroredTable,
    spark: SparkWriter,
    table: Table,
    differences: RowDifferences,
    files: dict[str, str],
) -> int | None:
    """Step 3 for a merge-on-read table: the differing keys deleted (position deletes) and the source's
    rows appended on the table's merge branch, then main fast-forwarded to it: one step for readers,
    as a merge writes. (Spark's SQL cannot put the epoch in the summary: a crash before the repair is
    recorded compares again under a newer snapshot, which finds nothing left to write but what
    changed since.) None when nothing differs."""
    # The record first (Spark's write cannot carry it): a crash in between leaves rows the next
    # comparison finds different, where a fill left behind would overwrite the rows written with its default.
    transaction = open_transaction(table)
    if _record_compared(table, transaction, files):
        table = transaction.commit_transaction()
    if not differences.delete_keys and not differences.upserted:
        return None
    rows = _spark_rows(table, differences)
    schema = table.schema()
    key_names = [schema.find_field(field_id).name for field_id in schema.identifier_field_ids]
    session = spark.session()
    with spark_view(session, spark.objects, mirrored.staging, rows) as view:
        write_on_branch(session, config.iceberg.catalog.name, mirrored.iceberg, table, key_names, view, False)
    current = table.refresh().current_snapshot()
    return current.snapshot_id if current else None


def _spark_rows(table: Table, differences: RowDifferences) -> pa.Table:
    """The repair's rows as the branch write takes them: the source's rows to upsert (op ``U``), then a
    row per key only in Iceberg (op ``D``, its key set, NULL elsewhere)."""
    schema = arrow_schema(table.schema())
    # A key's values come in the order of the identifier fields (the source's primary key).
    key_names = [table.schema().find_field(field_id).name for field_id in table.schema().identifier_field_ids]
    parts = []
    if differences.upserted:
        upserts = as_table_rows(table.schema(), pa.concat_tables(differences.upserts))
        parts.append(upserts.append_column(OP_COLUMN, pa.array(["U"] * upserts.num_rows, pa.string())))
    keys = differences.delete_only_keys
    if keys:
        columns = [
            pa.array([key[key_names.index(target.name)] for key in keys], target.type)
            if target.name in key_names
            else pa.nulls(len(keys), target.type)
            for target in schema
        ]
        parts.append(
            pa.Table.from_arrays([*columns, pa.array(["D"] * len(keys), pa.string())], names=[*schema.names, OP_COLUMN])
        )
    return pa.concat_tables(parts, promote_options="permissive")
