"""The engine's one door: validate, snapshot (whole or by chunk partitions), stream, materialize,
run, verify, check, status and lag. The CLI and the Dagster integration drive the engine through
:class:`Pipeline` and the plain results defined or re-exported here; they import nothing else from
the engine but ``config`` and ``errors`` (and the CLI ``quickstart``)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError

from .checks import ContentCheck, TableChecker, TableCheckReport
from .cleanup import CleanupResult, collect_garbage, remove_tables
from .config import PipelineConfig, TableConfig
from .coordination.records import Chunk, Lag, resync_command
from .coordination.store import CoordinationStore
from .cuts import Cut, latest_cut, take_cut
from .errors import ConfigError, StagingError
from .flusher.flusher import Flusher, FlushStats
from .flusher.priority import FlushFirst
from .iceberg.catalog import align_delete_formats, open_catalog
from .maintenance import Maintainer, MaintenanceResult, TableHealth, compaction_due, measured_health, summary_health
from .materializer.merge import Materializer, MergeResult
from .materializer.spark import build_spark_session
from .materializer.warm_spark import warm_session as warm_spark_session
from .metrics import PipelineMetrics, serve_metrics_once
from .repair import RepairDue, RepairResult, SparkWriter, TableRepairResult, repair, repair_due, repairs_pending
from .snapshot.holder import holder_lock_key
from .snapshot.resync import ResyncResult, resync_table
from .snapshot.runner import ChunkCallback, SnapshotRunner, TableSnapshotResult
from .source.connection import KeptConnection, connect, consistent_read
from .source.lsn import format_lsn
from .source.selection import resolve_tables, resolve_tables_left_out
from .staging.store import ObjectStore
from .tables import MirroredTable, MirroredTables
from .validation import SlotInfo, SlotSafety, StartupReport, check_startup, slot_info, slot_safety
from .verify import TableDiff, compare_table
from .wal_budget import estimate_wal_budget

__all__ = [
    "Chunk",
    "ContentCheck",
    "Cut",
    "FlushTick",
    "IcebergTableSummary",
    "Lag",
    "MergeResult",
    "Pipeline",
    "PipelineMetrics",
    "RepairDue",
    "RepairResult",
    "ResyncResult",
    "SlotInfo",
    "SlotSafety",
    "SnapshotPlan",
    "TableCheckReport",
    "TableDiff",
    "TableHealth",
    "TableProgress",
    "TableRepairResult",
    "TableSnapshotResult",
    "TableStatus",
    "build_spark_session",
    "compaction_due",
    "format_lsn",
    "resolve_tables",
    "serve_metrics_once",
    "slot_safety",
    "warm_spark_session",
]

log = logging.getLogger("pg2iceberg_dagster")


@dataclass(frozen=True)
class TableStatus:
    table: str
    snapshot_complete: bool
    chunks_done: int
    chunks_total: int
    lag: Lag
    snapshot_epoch: int | None = None  # the exported snapshot the table's rows were read under
    resync_reason: str | None = None  # an online resync is pending or running, for this reason
    iceberg: TableHealth | None = None  # files and snapshots of its Iceberg table (None: not created yet)

    def as_json(self) -> dict[str, Any]:
        """Plain data for ``status --json``."""
        return {
            "table": self.table,
            "snapshot_complete": self.snapshot_complete,
            "chunks_done": self.chunks_done,
            "chunks_total": self.chunks_total,
            "log_head": self.lag.log_head,
            "mat_cursor": self.lag.mat_cursor,
            "lag": self.lag.changes,
            "snapshot_epoch": self.snapshot_epoch,
            "resync_reason": self.resync_reason,
            "iceberg": self.iceberg.as_dict() if self.iceberg else None,
        }


@dataclass(frozen=True)
class SnapshotPlan:
    """A table's CTID chunks (stored once, planned on first sight), its snapshot epoch and whether
    its snapshot is complete."""

    chunks: list[Chunk]
    epoch: int | None
    complete: bool


@dataclass(frozen=True)
class TableProgress:
    """Where one table stands after a flusher tick: the changes the tick staged, and the unmerged
    ``lag`` (in changes) and ``lag_seconds`` (see :meth:`Pipeline.lags`)."""

    staged: int
    lag: Lag
    lag_seconds: float


@dataclass(frozen=True)
class FlushTick:
    """What one bounded run of the flusher did: where each configured table stands (those it staged
    changes of have ``staged`` > 0), and the replication slot as the tick left it."""

    flushed_lsn: int
    tables: dict[str, TableProgress]
    slot: SlotInfo | None

    @property
    def staged(self) -> dict[str, TableProgress]:
        """The tables this tick staged changes of."""
        return {key: progress for key, progress in self.tables.items() if progress.staged}

    @property
    def flushed_lsn_text(self) -> str:
        return format_lsn(self.flushed_lsn)


@dataclass(frozen=True)
class IcebergTableSummary:
    """The mirror table as it stands: columns (name, type, part of the key) and current snapshot."""

    columns: list[tuple[str, str, bool]]
    row_count: int
    snapshot_id: int | None


def _nothing_after(store: CoordinationStore) -> str:
    """What a failed flush left behind, for its error message."""
    flushed = store.flushed_lsn()
    return f"Nothing after flushed_lsn {format_lsn(flushed) if flushed else '-'} was registered or acknowledged"


class Pipeline:
    """One configured pipeline. Opens connections lazily; close it when done."""

    def __init__(
        self,
        config: PipelineConfig,
        spark_factory: Any = None,
        detached_holder: bool = False,
        metrics: PipelineMetrics | None = None,
    ) -> None:
        # A schema entry's tables, as the source has them now, and those it leaves out (with why).
        self.config, self.left_out = resolve_tables_left_out(config)
        # Each table's identity and the staging store: resolved once here, passed down to every room.
        self.tables = MirroredTables(self.config)
        self.objects = ObjectStore(self.config.staging)
        # ``detached_holder``: the snapshot's holder runs as a process that outlives this one (see
        # snapshot.holder), as the CLI and Dagster runs need; else as a thread here.
        self.detached_holder = detached_holder
        self._spark_factory = spark_factory or (lambda: build_spark_session(config))
        self.store = CoordinationStore(config.state_connection)
        self._catalog: Catalog | None = None
        self._report: StartupReport | None = None
        self._spark: Any = None
        self._spark_lock = threading.Lock()  # `run` warms it up on a thread of its own
        # Kept for the pipeline's life: its merges read the catalog of every idle table each time.
        self.source_connection = KeptConnection(self.config.source)
        # What ``run`` observes (merge durations); served by the caller, or by nobody.
        self.metrics = metrics if metrics is not None else PipelineMetrics(self.config)

    def close(self) -> None:
        self.store.close()
        self.source_connection.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = open_catalog(self.config)
        return self._catalog

    def spark(self) -> Any:
        """The shared Spark session (created on first use)."""
        with self._spark_lock:
            if self._spark is None:
                self._spark = self._spark_factory()
        return self._spark

    def validate(self, refresh: bool = False) -> StartupReport:
        """Run the startup checks (once per Pipeline unless ``refresh``)."""
        if self._report is None or refresh:
            self._report = check_startup(self.config, self.store)
            # Only when a format is declared: the catalog is not opened for nothing.
            if any(self.config.delete_format_of(table.config) for table in self.tables.values()):
                align_delete_formats(self.catalog, self.config, self.tables.values())
        return self._report

    def snapshot(self, on_chunk: ChunkCallback | None = None, on_plan: Any = None) -> dict[str, TableSnapshotResult]:
        """Take the initial snapshot of every table not yet complete (resumes after a crash)."""
        return self.snapshot_runner().run(on_chunk=on_chunk, on_plan=on_plan)

    def snapshot_runner(self) -> SnapshotRunner:
        return SnapshotRunner(self.config, self.tables, self.store, self.validate(), self.catalog, self.detached_holder)

    def snapshot_plan(self, table_key: str) -> SnapshotPlan:
        """The table's chunk plan (planned and stored on first call) and its snapshot epoch."""
        self.store.migrate()
        chunks = self.store.chunks(table_key) or self.snapshot_runner().plan(self.validate().tables[table_key])
        state = self.store.table_state(table_key)
        return SnapshotPlan(chunks, state.snapshot_epoch if state else None, bool(state and state.snapshot_complete))

    def completed_snapshots(self) -> dict[str, int | None]:
        """The tables whose snapshot is complete, with its epoch (one query)."""
        self.store.migrate()
        states = self.store.table_states()
        return {key: state.snapshot_epoch for key, state in states.items() if state.snapshot_complete}

    def snapshot_chunks(self, table_key: str, partition_keys: list[str]) -> TableSnapshotResult:
        """Read the chunks named by ``partition_keys`` under the holder's exported snapshot."""
        return self.snapshot_runner().run_partitions(table_key, partition_keys)

    def stream(
        self,
        stop: threading.Event | None = None,
        *,
        until_caught_up: bool = False,
        max_seconds: float | None = None,
        on_flush: Any = None,
        merge_idle: threading.Event | None = None,
        flush_first: FlushFirst | None = None,
    ) -> FlushStats:
        """Run the flusher (see :meth:`Flusher.run`); ``merge_idle`` is set by a materializer waiting
        for the next flush, which then comes sooner (``flush.min_interval_seconds``); ``flush_first``
        is held while each flush is written, for this process's merges to wait."""
        report = self.validate()
        with contextlib.closing(CoordinationStore(self.config.state_connection)) as store:
            flusher = Flusher(self.config, store, self.objects, self.tables, report.tables)
            try:
                return flusher.run(
                    stop,
                    until_caught_up=until_caught_up,
                    max_seconds=max_seconds,
                    on_flush=on_flush,
                    merge_idle=merge_idle,
                    flush_first=flush_first,
                )
            except StagingError as exc:
                raise StagingError(
                    f"{exc}. {_nothing_after(store)}; once there is room (or the store is reachable again), "
                    "`stream` again: it resumes there"
                ) from exc
            finally:
                flusher.close()

    def materializer(self) -> Materializer:
        return Materializer(
            self.config,
            self.tables,
            self.store,
            self.objects,
            self.catalog,
            self.spark,
            source=self.source_connection,
        )

    def materialize(self, table_keys: list[str] | None = None) -> dict[str, MergeResult]:
        """One pass: merge every table's staged log up to its current head."""
        self.validate()
        return self.materializer().run_once(table_keys)

    def merge_order(self, table_keys: list[str]) -> list[str]:
        """``table_keys`` in the order a pass merges them: the oldest unmerged change first."""
        return self.materializer().oldest_change_first(table_keys)

    def merge_tables(self, table_keys: list[str], rounds: int = 1) -> Iterator[tuple[str, MergeResult | Exception]]:
        """Merge the tables' staged logs up to their heads, ``rounds`` times, several at once, the oldest
        unmerged change first; yields each table's result (or error) as it ends (see Materializer)."""
        self.validate()
        materializer = self.materializer()
        return materializer.merge_tables(materializer.oldest_change_first(table_keys), rounds)

    def file_health(self, table_key: str) -> TableHealth:
        """The table's data and delete files, small files and snapshots (see maintenance.health)."""
        table = self.catalog.load_table(self.tables[table_key].iceberg)
        return measured_health(table, self.config.maintenance.target_file_size_bytes)

    def _summary_health(self, table_key: str) -> TableHealth | None:
        try:
            return summary_health(self.catalog.load_table(self.tables[table_key].iceberg))
        except NoSuchTableError:
            return None

    def maintainer(self) -> Maintainer:
        return Maintainer(self.config, self.tables, self.store, self.objects, self.catalog, self.spark)

    def maintenance_due(self, cursors_seen: Mapping[str, int] | None = None) -> tuple[dict[str, str], dict[str, int]]:
        """Tables due for a maintenance pass now, with why (see maintenance.Maintainer.due), and every
        table's mat_cursor now. Only a merge adds files, so with ``cursors_seen`` (the mat_cursors
        returned last time) only the tables merged since have their Iceberg metadata read: a check
        over hundreds of quiet tables costs two queries."""
        self.store.migrate()  # before the first snapshot there is nothing to maintain, and no error either
        cursors = {key: lag.mat_cursor for key, (lag, _age) in self.store.lags(self.config.materialize.group).items()}
        merged = None if cursors_seen is None else [key for key, at in cursors.items() if cursors_seen.get(key) != at]
        return self.maintainer().due(merged), cursors

    def maintain(
        self, table_keys: list[str] | None = None, due_only: bool = False, reason: str = "requested"
    ) -> list[MaintenanceResult]:
        """A maintenance pass over the given tables (all configured when None), or only over those
        due for one with ``due_only`` (see maintenance.Maintainer); ``reason`` is reported with it."""
        self.validate()
        maintainer = self.maintainer()
        keys = table_keys or list(self.tables)
        for key in keys:
            self.tables[key]
        if due_only:
            due = maintainer.due()
            return [maintainer.maintain(key, due[key]) for key in keys if key in due]
        return [maintainer.maintain(key, reason) for key in keys]

    def resync(self, table_key: str, reason: str = "requested", on_chunk: ChunkCallback | None = None) -> ResyncResult:
        """Copy one table again, online, and switch it in one Iceberg commit (see snapshot.resync):
        the one a merge requested, one interrupted, or a new one for ``reason``."""
        source = self.validate(refresh=True).tables.get(table_key)
        if source is None:
            raise ConfigError(f"{table_key} is not a configured table")
        worker = f"resync:{os.getpid()}"
        return resync_table(
            self.config, self.tables[table_key], self.store, self.catalog, source, worker, reason, on_chunk
        )

    def repair(
        self, table_keys: list[str] | None = None, on_table: Callable[[TableRepairResult], None] | None = None
    ) -> RepairResult:
        """Bring Iceberg back to the source by writing only the differences (see repair.py): every table
        under a new slot when the slot is lost, else the tables named (any table, e.g. one ``verify``
        found different), else those whose repair was interrupted."""
        report = check_startup(self.config, self.store, slot_lost_ok=True)
        for key in table_keys or []:
            if key not in report.tables:
                raise ConfigError(f"{key} is not a configured table")
        worker = f"repair:{os.getpid()}"
        # Spark starts only for a merge-on-read table with differences (its deletes as position deletes).
        spark = SparkWriter(self.spark, self.objects)
        result = repair(self.config, self.tables, self.store, self.catalog, report, worker, table_keys, on_table, spark)
        self._report = None  # the slot may be new: the next entry point checks again
        return result

    def repair_at_startup(self, on_table: Callable[[TableRepairResult], None] | None = None) -> RepairResult | None:
        """What ``run`` and ``stream`` do first under ``replication.on_slot_lost: repair``: repair a lost
        slot, or finish a repair a crash interrupted; None when there was nothing to repair (or the
        policy is ``refuse``: then the startup checks refuse a lost slot, naming ``repair``)."""
        due = self.repair_due()
        if due is None:
            return None
        log.warning("%s: repairing", due.reason)
        return self.repair(on_table=on_table)

    def repair_due(self) -> RepairDue | None:
        """The repair to run now under ``replication.on_slot_lost: repair`` (a lost slot, or a repair
        requested or interrupted), None when there is none or the policy is ``refuse``."""
        if self.config.replication.on_slot_lost != "repair":
            return None
        report = check_startup(self.config, self.store, slot_lost_ok=True)
        due = repair_due(self.config, self.store, report)
        if due is None:
            self._report = report
        return due

    def repairs_pending(self) -> list[str]:
        """Tables waiting for a repair (requested by ``repair --table``, for a lost slot, or interrupted)."""
        self.store.migrate()
        return repairs_pending(self.store)

    def resyncs_pending(self) -> dict[str, str]:
        """Tables waiting for an online resync, with the reason."""
        self.store.migrate()
        return {key: state.resync_reason for key, state in self.store.table_states().items() if state.resync_reason}

    def lag(self, table_key: str) -> Lag:
        """The table's staged changes not merged yet by this pipeline's materializer group."""
        self.store.migrate()
        return self.store.lag(self.config.materialize.group, table_key)

    def tables_to_merge(self) -> set[str]:
        """The tables with staged changes to merge whose snapshot is complete (and no resync is
        replacing them): two queries, however many tables are mirrored."""
        mergeable = self.mergeable_tables()
        return {
            key
            for key, (lag, _age) in self.store.lags(self.config.materialize.group).items()
            if lag.changes > 0 and key in mergeable
        }

    def mergeable_tables(self) -> set[str]:
        """The tables a merge may run on: snapshot complete, no resync replacing them."""
        return {key for key, state in self.store.table_states().items() if state.mergeable}

    def flush_tick(self, max_seconds: float) -> FlushTick | None:
        """Stream for at most ``max_seconds``; None before the snapshot has created the slot.

        The merges run in other processes (Dagster runs), which take whatever is staged when they
        start: nothing is gained by holding commits back for them, so a tick flushes every
        ``flush.min_interval_seconds`` (a run merges the files of several flushes in one commit)."""
        self.store.migrate()
        if self.store.flushed_lsn() is None:
            return None
        merges_elsewhere = threading.Event()
        merges_elsewhere.set()
        stats = self.stream(max_seconds=max_seconds, merge_idle=merges_elsewhere)
        lags = self.lags()  # one query for every table
        tables = {}
        for key in self.tables:
            lag, seconds = lags.get(key, (Lag(), 0.0))
            tables[key] = TableProgress(stats.rows_by_table.get(key, 0), lag, seconds)
        return FlushTick(stats.flushed_lsn, tables, self.slot())

    def lags(self) -> dict[str, tuple[Lag, float]]:
        """Per staged table, its unmerged changes and how many seconds the Iceberg table is behind the
        source: 0 with nothing unmerged, else the age of the oldest unmerged change, counted from its
        source commit time (the earliest commit of the staged file holding it, recorded in
        ``log_index.first_commit_at``; a file staged before that column existed counts from when it was
        registered), by the state database's clock (see :meth:`CoordinationStore.lags`)."""
        self.store.migrate()
        return self.store.lags(self.config.materialize.group)

    def slot(self) -> SlotInfo | None:
        """The replication slot as ``pg_replication_slots`` shows it now (None when it does not exist),
        with its WAL budget measured since the previous reading any process took (see wal_budget.py)."""
        self.store.migrate()
        name = self.config.replication.slot
        with connect(self.config.source) as conn:
            slot = slot_info(conn, name)
        return estimate_wal_budget(self.store, name, slot)

    def iceberg_summary(self, table_key: str) -> IcebergTableSummary:
        """The mirror table's columns, row count and current snapshot."""
        table = self.catalog.load_table(self.tables[table_key].iceberg)
        schema = table.schema()
        key = {schema.find_field(field_id).name for field_id in schema.identifier_field_ids}
        snapshot = table.current_snapshot()
        return IcebergTableSummary(
            columns=[(f.name, str(f.field_type), f.name in key) for f in schema.fields],
            row_count=summary_health(table).records,
            snapshot_id=snapshot.snapshot_id if snapshot else None,
        )

    def check_tables(self, table_keys: list[str]) -> Iterator[tuple[str, TableCheckReport | Exception]]:
        """The data checks of ``table_keys``, per table as each is done (see checks.TableChecker)."""
        checker = TableChecker(self.config, self.tables, self.store, self.objects, self.catalog)
        return checker.check_tables(table_keys)

    def catch_up(self) -> FlushStats:
        """Flush everything up to the current WAL position, then merge every table to its head."""
        stats = self.stream(until_caught_up=True)
        self.materialize()
        return stats

    def verify(self, table_keys: list[str] | None = None, refresh: bool = True) -> list[TableDiff]:
        """Compare every (or the given) table, all read in one REPEATABLE READ transaction of the source.

        ``refresh`` re-reads the source columns first (they may have changed since the last check).
        """
        report = self.validate(refresh=refresh)
        unknown = sorted(set(table_keys or ()) - set(report.tables))
        if unknown:
            configured = sorted(report.tables)
            more = f" and {len(configured) - 10} more" if len(configured) > 10 else ""
            raise ConfigError(
                f"not configured tables: {', '.join(unknown)} (configured: {', '.join(configured[:10])}{more})"
            )
        diffs = []
        resyncs = self.resyncs_pending()
        with connect(self.config.source) as conn, consistent_read(conn):
            for key, source in report.tables.items():
                if table_keys is not None and key not in table_keys:
                    continue
                if key in resyncs:
                    waits = f"it waits for an online resync ({resyncs[key]}): {resync_command(key, resyncs[key])}"
                    diffs.append(TableDiff(key, not_compared=waits))
                    continue
                try:
                    iceberg_table = self.catalog.load_table(self.tables[key].iceberg)
                except NoSuchTableError:
                    diff = TableDiff(key)
                    diff.only_in_pg = -1
                    diffs.append(diff)
                    continue
                diffs.append(compare_table(conn, source, iceberg_table, self.config.values.out_of_range))
        return diffs

    def collect_garbage(self) -> CleanupResult:
        """Delete applied staged files and unregistered uploads at or below the flushed LSN."""
        return collect_garbage(self.tables.values(), self.store, self.objects)

    def forget_removed_tables(self) -> list[TableConfig]:
        """Stop mirroring the tables the coordination state holds but the config no longer names (see
        cleanup.remove_tables; their Iceberg tables are kept: only the config could name them); returns
        their entries."""
        # A key is "schema.table" unquoted: split at the first dot. A schema name holding a dot is misread,
        # which is harmless: what goes is found by key, and the publication names its tables itself.
        removed = [TableConfig.named(*key.split(".", 1)) for key in self.no_longer_configured()]
        if removed:
            leaving = [MirroredTable.of(self.config, table) for table in removed]
            remove_tables(self.config, self.store, self.objects, self.catalog, leaving, drop_iceberg=False)
        return removed

    def no_longer_configured(self) -> list[str]:
        """The keys of the tables the coordination state holds but the config no longer names."""
        self.store.migrate()
        return sorted(key for key in self.store.table_states() if key not in self.tables)

    def cut(self, name: str | None = None, group: str | None = None) -> Cut:
        """Take a consistent cut of ``group``'s tables (all, without one): see cuts.py and docs/cuts.md."""
        self.validate()
        return take_cut(self.materializer(), self.store, self.catalog, self.config.cuts, name, group)

    def latest_cut(self) -> Cut | None:
        """The newest complete cut over the mirrored tables, None when there is none."""
        return latest_cut(self.catalog, self.tables)

    def status(self) -> dict[str, Any]:
        """Replication and per-table progress, as plain data."""
        self.store.migrate()
        slot = self.slot()
        safety = slot_safety(slot, self.config.replication)
        states = self.store.table_states()
        tables = []
        for table in self.config.tables:
            state = states.get(table.key)
            chunks = self.store.chunks(table.key)
            tables.append(
                TableStatus(
                    table=table.key,
                    snapshot_complete=bool(state and state.snapshot_complete),
                    chunks_done=sum(c.done for c in chunks),
                    chunks_total=len(chunks),
                    lag=self.store.lag(self.config.materialize.group, table.key),
                    snapshot_epoch=state.snapshot_epoch if state else None,
                    resync_reason=state.resync_reason if state else None,
                    iceberg=self._summary_health(table.key),
                )
            )
        flushed = self.store.flushed_lsn()
        held = self.store.exported_snapshot(holder_lock_key(self.config))
        return {
            "slot": None
            if slot is None
            else {
                "confirmed_flush_lsn": format_lsn(slot.confirmed_flush_lsn) if slot.confirmed_flush_lsn else None,
                "wal_status": slot.wal_status,
                "active_pid": slot.active_pid,
                "restart_lsn": format_lsn(slot.restart_lsn) if slot.restart_lsn else None,
                "retained_wal_bytes": slot.retained_wal_bytes,
                "safe_wal_size_bytes": slot.safe_wal_size_bytes,
                "max_slot_wal_keep_size_bytes": slot.max_slot_wal_keep_size_bytes,
                **slot.wal_budget(),
                "safety": safety.level,
                "safety_reason": safety.reason,
            },
            "flushed_lsn": format_lsn(flushed) if flushed is not None else None,
            # A holder keeping an exported snapshot open (the source's xmin is held back meanwhile).
            "snapshot_holder": {"epoch": held.epoch} if held else None,
            "tables": tables,
            "no_longer_configured": self.no_longer_configured(),
            "latest_cut": _cut_json(self.latest_cut),
        }


def _cut_json(read: Callable[[], Cut | None]) -> dict[str, Any] | None:
    """The latest cut as ``status`` shows it; None when there is none, or its tables are not there yet."""
    try:
        cut = read()
    except NoSuchTableError:
        return None
    return cut.as_json() if cut else None
