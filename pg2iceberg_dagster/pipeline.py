"""The engine's one door: validate, snapshot (whole or by chunk partitions), stream, materialize,
run, verify, check, status and lag. The CLI and the Dagster integration drive the engine through
:class:`Pipeline` and the plain results defined or re-exported here; they import nothing else from
the engine but ``config`` and ``errors`` (and the CLI ``quickstart``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.expressions import BooleanExpression
from pyiceberg.table import Table

from .checks import ALL_ROWS, ContentCheck, TableCheckReport, duplicate_keys, schema_mismatches
from .cleanup import remove_tables
from .config import PipelineConfig, TableConfig
from .coordination.store import Chunk, CoordinationStore, Lag
from .errors import ConfigError, StagingError
from .flusher.flusher import Flusher, FlushStats
from .iceberg.catalog import open_catalog, table_identifier
from .maintenance import Maintainer, MaintenanceResult, TableHealth, compaction_due, measured_health, summary_health
from .materializer.lanes import LaneConnections, on_lanes
from .materializer.merge import Materializer, MergeResult
from .materializer.spark import build_spark_session
from .materializer.warm_spark import warm_session as warm_spark_session
from .metrics import PipelineMetrics, serve_metrics_once
from .snapshot.holder import holder_lock_key
from .snapshot.resync import ResyncResult, resync_table
from .snapshot.runner import ChunkCallback, SnapshotRunner, TableSnapshotResult
from .source.catalog import SourceTable, TypeResolver, describe_table, modification_count
from .source.connection import KeptConnection, connect, consistent_read
from .source.lsn import current_wal_lsn, format_lsn
from .source.selection import resolve_tables
from .validation import StartupReport, check_startup, slot_info
from .verify import KeySlice, TableDiff, choose_key_slice, compare_table, sliceable

__all__ = [
    "Chunk",
    "ContentCheck",
    "FlushTick",
    "IcebergTableSummary",
    "Lag",
    "MergeResult",
    "Pipeline",
    "PipelineMetrics",
    "ResyncResult",
    "SnapshotPlan",
    "TableCheckReport",
    "TableDiff",
    "TableHealth",
    "TableSnapshotResult",
    "TableStatus",
    "build_spark_session",
    "compaction_due",
    "resolve_tables",
    "serve_metrics_once",
    "warm_spark_session",
]

log = logging.getLogger("pg2iceberg_dagster")


# Statistics trail commits by up to a second: a content check looks at them again after this.
STATS_DELAY_SECONDS = 1.5
# A content check that found a difference waits this long at most for the flusher to stage past the
# comparison, to tell a change still in flight from a difference the mirror should not have.
IN_FLIGHT_WAIT_SECONDS = 10.0

# How often ``run`` reports what it merged (see Pipeline.run's ``on_progress``).
PROGRESS_SECONDS = 60.0
# How often ``run`` looks for tables due for maintenance (a query, and one metadata read per merged table).
UPKEEP_CHECK_SECONDS = 30.0


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
class FlushTick:
    """What one bounded run of the flusher staged: per table with changes, their count and the lag."""

    flushed_lsn: int
    staged: dict[str, tuple[int, Lag]]

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


@dataclass(frozen=True)
class _CheckScope:
    """What a table's checks cover: every row, or a key range of a large table (see
    ``checks.compare_max_rows``); and why its content is not compared, if so."""

    key_slice: KeySlice | None = None
    slice_keys: bool = False  # the duplicate-key check too covers the slice only (with key_slice only)
    described: str = ALL_ROWS
    not_compared: str = ""

    def keys_filter(self) -> BooleanExpression | None:
        return self.key_slice.row_filter() if self.key_slice and self.slice_keys else None

    def report(
        self, duplicates: tuple[int, list[tuple]], problems: list[str], content: ContentCheck
    ) -> TableCheckReport:
        keys_checked = self.described if self.slice_keys else ALL_ROWS
        content_checked = self.described if content.diff is not None else ALL_ROWS
        return TableCheckReport(*duplicates, problems, content, keys_checked, content_checked)


@dataclass(frozen=True)
class _Compared:
    """A table checked and compared with the source; whether the source was written meanwhile (so
    whether a difference is conclusive) is read later."""

    duplicates: tuple[int, list[tuple]]
    schema_problems: list[str]
    scope: _CheckScope
    diff: TableDiff
    oid: int
    writes_before: int
    wal: int  # the source's WAL position as the comparison's snapshot was taken
    started: float


class Pipeline:
    """One configured pipeline. Opens connections lazily; close it when done."""

    def __init__(
        self,
        config: PipelineConfig,
        spark_factory: Any = None,
        detached_holder: bool = False,
        metrics: PipelineMetrics | None = None,
    ) -> None:
        self.config = resolve_tables(config)  # a schema entry's tables, as the source has them now
        # ``detached_holder``: the snapshot's holder runs as a process that outlives this one (see
        # snapshot.holder), as the CLI and Dagster runs need; else as a thread here.
        self.detached_holder = detached_holder
        self._spark_factory = spark_factory or (lambda: build_spark_session(config))
        self.store = CoordinationStore(config.state_connection)
        self._catalog: Catalog | None = None
        self._report: StartupReport | None = None
        self._spark: Any = None
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
        if self._spark is None:
            self._spark = self._spark_factory()
        return self._spark

    def validate(self, refresh: bool = False) -> StartupReport:
        """Run the startup checks (once per Pipeline unless ``refresh``)."""
        if self._report is None or refresh:
            self._report = check_startup(self.config, self.store)
        return self._report

    def snapshot(self, on_chunk: ChunkCallback | None = None, on_plan: Any = None) -> dict[str, TableSnapshotResult]:
        """Take the initial snapshot of every table not yet complete (resumes after a crash)."""
        return self.snapshot_runner().run(on_chunk=on_chunk, on_plan=on_plan)

    def snapshot_runner(self) -> SnapshotRunner:
        return SnapshotRunner(self.config, self.store, self.validate(), self.catalog, self.detached_holder)

    def snapshot_plan(self, table_key: str) -> SnapshotPlan:
        """The table's chunk plan (planned and stored on first call) and its snapshot epoch."""
        report = self.validate()
        chunks = self.store.chunks(table_key) or self.snapshot_runner().plan(report.tables[table_key])
        state = self.store.table_state(table_key)
        return SnapshotPlan(chunks, state.snapshot_epoch if state else None, bool(state and state.snapshot_complete))

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
    ) -> FlushStats:
        """Run the flusher (see :meth:`Flusher.run`); ``merge_idle`` is set by a materializer waiting
        for the next flush, which then comes sooner (``flush.min_interval_seconds``)."""
        report = self.validate()
        with contextlib.closing(CoordinationStore(self.config.state_connection)) as store:
            flusher = Flusher(self.config, store, report.tables)
            try:
                return flusher.run(
                    stop,
                    until_caught_up=until_caught_up,
                    max_seconds=max_seconds,
                    on_flush=on_flush,
                    merge_idle=merge_idle,
                )
            except StagingError as exc:
                raise StagingError(
                    f"{exc}. {_nothing_after(store)}; once there is room (or the store is reachable again), "
                    "`stream` again: it resumes there"
                ) from exc
            finally:
                flusher.close()

    def materializer(self) -> Materializer:
        return Materializer(self.config, self.store, self.catalog, self.spark, source=self.source_connection)

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
        table = self.catalog.load_table(table_identifier(self.config, table_key))
        return measured_health(table, self.config.maintenance.target_file_size_bytes)

    def _summary_health(self, table_key: str) -> TableHealth | None:
        try:
            return summary_health(self.catalog.load_table(table_identifier(self.config, table_key)))
        except NoSuchTableError:
            return None

    def maintainer(self) -> Maintainer:
        return Maintainer(self.config, self.store, self.catalog, self.spark)

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
        keys = table_keys or [table.key for table in self.config.tables]
        for key in keys:
            self.config.table(key)  # an unknown table: a clear error before any pass
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
        return resync_table(self.config, self.store, self.catalog, source, worker, reason, on_chunk)

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
        states = self.store.table_states()
        return {
            key
            for key, (lag, _age) in self.store.lags(self.config.materialize.group).items()
            if lag.changes > 0 and key in states and states[key].mergeable
        }

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
        lags = self.store.lags(self.config.materialize.group)  # one query for every table staged
        staged = {key: (count, lags[key][0]) for key, count in stats.rows_by_table.items() if count}
        return FlushTick(stats.flushed_lsn, staged)

    def iceberg_summary(self, table_key: str) -> IcebergTableSummary:
        """The mirror table's columns, row count and current snapshot."""
        table = self.catalog.load_table(table_identifier(self.config, table_key))
        schema = table.schema()
        key = {schema.find_field(field_id).name for field_id in schema.identifier_field_ids}
        snapshot = table.current_snapshot()
        return IcebergTableSummary(
            columns=[(f.name, str(f.field_type), f.name in key) for f in schema.fields],
            row_count=summary_health(table).records,
            snapshot_id=snapshot.snapshot_id if snapshot else None,
        )

    def check_tables(self, table_keys: list[str]) -> Iterator[tuple[str, TableCheckReport | Exception]]:
        """Per table, as each is done (or the error that stopped its checks): one row per primary key;
        the schema follows the source's columns as they are now; the rows equal the source's when
        nothing is left to merge, compared at one consistent point of the source. Tables are checked
        ``materialize.parallelism`` at a time. Whether the source was written during a comparison is
        read from its statistics, which trail commits: the tables compared share one wait for them."""
        compared: list[tuple[str, _Compared]] = []
        count = max(1, min(self.config.materialize.parallelism, len(table_keys)))
        open_lane = functools.partial(LaneConnections.open, self.config)
        for key, outcome in on_lanes(table_keys, count, open_lane, LaneConnections.close, self._check_table):
            if isinstance(outcome, _Compared):
                compared.append((key, outcome))
            else:
                yield key, outcome
        if not compared:
            return
        last_started = max(table.started for _, table in compared)
        time.sleep(max(0.0, STATS_DELAY_SECONDS - (time.monotonic() - last_started)))
        flushed = self._flushed_past(max((t.wal for _, t in compared if not t.diff.ok), default=None))
        conn = self.source_connection()
        for key, table in compared:
            written = modification_count(conn, table.oid) != table.writes_before
            # A change committed before the comparison but not merged: not staged yet when it was
            # compared (the flusher had not passed it), or staged since (the table lags again).
            in_flight = not table.diff.ok and (flushed < table.wal or self.lag(key).changes > 0)
            content = ContentCheck(0, table.diff, source_written_during_check=written, changes_in_flight=in_flight)
            yield key, table.scope.report(table.duplicates, table.schema_problems, content)

    def _flushed_past(self, lsn: int | None) -> int:
        """The flushed LSN, once it is at or past ``lsn`` or after :data:`IN_FLIGHT_WAIT_SECONDS`
        (no wait when ``lsn`` is None)."""
        deadline = time.monotonic() + IN_FLIGHT_WAIT_SECONDS
        while True:
            flushed = self.store.flushed_lsn() or 0
            if lsn is None or flushed >= lsn or time.monotonic() >= deadline:
                return flushed
            time.sleep(0.5)

    def _check_table(self, lane: LaneConnections, table_key: str) -> TableCheckReport | _Compared:
        """One table's checks (see :meth:`check_tables`); a comparison still waits for the statistics."""
        table = self.catalog.load_table(table_identifier(self.config, table_key))
        conn = lane.source()
        source = describe_table(conn, self.config.table(table_key), TypeResolver(conn))
        problems = schema_mismatches(source, table)
        scope = self._check_scope(conn, source, table)
        duplicates = duplicate_keys(table, scope.keys_filter())
        lag = lane.store.lag(self.config.materialize.group, table_key)
        if lag.changes > 0 or scope.not_compared:
            return scope.report(duplicates, problems, ContentCheck(lag.changes, not_compared=scope.not_compared))
        writes_before = modification_count(conn, source.oid)
        started = time.monotonic()
        with consistent_read(conn):
            wal = current_wal_lsn(conn)  # the transaction's first query: its snapshot is taken here
            rule = self.config.values.out_of_range
            diff = compare_table(conn, source, table, rule, key_slice=scope.key_slice)
        return _Compared(duplicates, problems, scope, diff, source.oid, writes_before, wal, started)

    def _check_scope(self, conn: psycopg.Connection, source: SourceTable, table: Table) -> _CheckScope:
        """Every row, or above ``checks.compare_max_rows`` a key range of that many rows from a random
        key (each check another); its duplicate keys too above ``checks.unique_keys_max_rows``."""
        checks = self.config.checks
        rows = summary_health(table).records
        if rows <= checks.compare_max_rows:
            return _CheckScope()
        if not sliceable(source):
            return _CheckScope(
                not_compared=(
                    f"about {rows:,} rows, more than checks.compare_max_rows ({checks.compare_max_rows:,}), and a "
                    f"primary key that is not all integer columns cannot be compared a range at a time; "
                    f"`pg2iceberg-dagster verify --table {source.key}` compares the whole table"
                )
            )
        key_slice = choose_key_slice(conn, source, checks.compare_max_rows)
        if key_slice is None:  # the source is empty: nothing to slice
            return _CheckScope()
        described = f"{key_slice.describe()} ({checks.compare_max_rows:,} of about {rows:,} rows)"
        return _CheckScope(key_slice, rows > checks.unique_keys_max_rows, described)

    def run(
        self, stop: threading.Event, interval: float | None = None, on_progress: Callable[[str], None] | None = None
    ) -> None:
        """Everything in one process: snapshot, then stream in a thread while merging; ``on_progress``
        is given a line on what was merged and what lags every :data:`PROGRESS_SECONDS`.

        A merge starts as soon as the flusher has staged something (and at least every ``interval``
        seconds, default ``materialize.interval_seconds``), and while no merge runs the flusher stages
        ``flush.min_interval_seconds`` after its previous flush rather than ``flush.interval_seconds``:
        a change waits for the merge in progress (or that minimum, whichever is longer) and its own
        merge, not for a flush interval or a polling period. While a merge runs, commits gather for the
        flush made when it ends. The Spark session is created once and lives as long as the process.

        The first run snapshots every table before it streams (the snapshot creates the slot). Once a
        table is mirrored, tables still to snapshot (added to the config since) are snapshotted in the
        background, in a new snapshot epoch, while the others stream and merge.
        """
        report = self.validate()  # adds tables new to the config to an owned publication, before streaming
        states = self.store.table_states()
        if not any(states[key].snapshot_complete for key in report.tables if key in states):
            self.snapshot()
        errors: list[BaseException] = []
        staged = threading.Event()
        merge_idle = threading.Event()  # set while the loop below waits: a flush now is merged at once

        def stream() -> None:
            try:
                self.stream(stop, on_flush=lambda _stats: staged.set(), merge_idle=merge_idle)
            except BaseException as exc:  # surfaced to the main loop
                errors.append(exc)
                stop.set()
            finally:
                staged.set()

        thread = threading.Thread(target=stream, name="flusher", daemon=True)
        thread.start()
        materializer = self.materializer()
        upkeep = _Upkeep(self.maintainer(), self.metrics) if self.config.maintenance.enabled else None
        copies = _CopyWorker(self.config)
        wait = interval if interval is not None else self.config.materialize.interval_seconds
        progress = _Progress(self.store, self.config.materialize.group, on_progress)
        try:
            while not stop.is_set():
                staged.clear()  # a flush during the merge below sets it again: merge right after
                results = materializer.run_once()
                self.metrics.record_merges(results)
                progress.after_merges(results)
                if upkeep is not None:
                    upkeep.after_merges(results)
                copies.start_next(
                    any(r.waiting_for_snapshot for r in results.values()),
                    {key: r.resync_reason for key, r in results.items() if r.resync_reason},
                )
                for result in results.values():
                    if result.batches:
                        log.info(
                            "merged %s: %d changes in %.2f s (%s), lag %d",
                            result.table,
                            result.changes,
                            result.seconds,
                            ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in result.timings.items()),
                            result.lag.changes,
                        )
                merge_idle.set()
                _wait_for_either(stop, staged, wait)
                merge_idle.clear()
        finally:
            stop.set()
            thread.join()
            copies.join()
        if errors:
            raise errors[0]

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
                    waits = f"it waits for an online resync ({resyncs[key]}): `pg2iceberg-dagster resync --table {key}`"
                    diffs.append(TableDiff(key, not_compared=waits))
                    continue
                identifier = table_identifier(self.config, key)
                try:
                    iceberg_table = self.catalog.load_table(identifier)
                except NoSuchTableError:
                    diff = TableDiff(key)
                    diff.only_in_pg = -1
                    diffs.append(diff)
                    continue
                diffs.append(compare_table(conn, source, iceberg_table, self.config.values.out_of_range))
        return diffs

    def forget_removed_tables(self) -> list[TableConfig]:
        """Stop mirroring the tables the coordination state holds but the config no longer names (see
        cleanup.remove_tables; their Iceberg tables are kept: only the config could name them); returns
        their entries."""
        # A key is "schema.table" unquoted: split at the first dot (a schema name holding one is misread).
        removed = [TableConfig.named(*key.split(".", 1)) for key in self.no_longer_configured()]
        if removed:
            remove_tables(self.config, self.store, self.catalog, removed, drop_iceberg=False)
        return removed

    def no_longer_configured(self) -> list[str]:
        """The keys of the tables the coordination state holds but the config no longer names."""
        self.store.migrate()
        configured = {table.key for table in self.config.tables}
        return sorted(key for key in self.store.table_states() if key not in configured)

    def status(self) -> dict[str, Any]:
        """Replication and per-table progress, as plain data."""
        self.store.migrate()
        with connect(self.config.source) as conn:
            slot = slot_info(conn, self.config.replication.slot)
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
            },
            "flushed_lsn": format_lsn(flushed) if flushed is not None else None,
            # A holder keeping an exported snapshot open (the source's xmin is held back meanwhile).
            "snapshot_holder": {"epoch": held.epoch} if held else None,
            "tables": tables,
            "no_longer_configured": self.no_longer_configured(),
        }


class _Progress:
    """What ``run`` merged over the last :data:`PROGRESS_SECONDS`, and what lags, as one line."""

    def __init__(self, store: CoordinationStore, group: str, on_progress: Callable[[str], None] | None) -> None:
        self.store = store
        self.group = group
        self.on_progress = on_progress
        self.since = time.monotonic()
        self.changes = 0
        self.tables: set[str] = set()

    def after_merges(self, results: dict[str, MergeResult]) -> None:
        for key, result in results.items():
            if result.changes:
                self.changes += result.changes
                self.tables.add(key)
        elapsed = time.monotonic() - self.since
        if self.on_progress is None or elapsed < PROGRESS_SECONDS:
            return
        lagging = {key: (lag, age) for key, (lag, age) in self.store.lags(self.group).items() if lag.changes}
        behind = (
            f"{len(lagging)} tables lag by {sum(lag.changes for lag, _ in lagging.values()):,} changes, the oldest "
            f"staged {max(age for _, age in lagging.values()):.1f} s ago"
            if lagging
            else "no table lags"
        )
        self.on_progress(
            f"merged {self.changes:,} changes into {len(self.tables)} tables in the last {elapsed:.0f} s; {behind}"
        )
        self.since, self.changes, self.tables = time.monotonic(), 0, set()


class _CopyWorker:
    """``run``'s copies of tables: the snapshot of tables added to the config, and resyncs. One at a
    time, in a thread with its own connections, while the flusher streams and the other tables merge.
    A failed copy is logged and tried again after a pause."""

    RETRY_SECONDS = 60.0
    SNAPSHOT = "the snapshot of new tables"

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self._thread: threading.Thread | None = None
        self._failed_at: dict[str, float] = {}

    def start_next(self, snapshot_pending: bool, resyncs: dict[str, str]) -> None:
        """Start the snapshot (when ``snapshot_pending``), else the first of ``resyncs`` (table ->
        reason), unless a copy is running or failed too recently."""
        if self._thread is not None and self._thread.is_alive():
            return
        now = time.monotonic()
        jobs = ([self.SNAPSHOT] if snapshot_pending else []) + list(resyncs)
        ready = [job for job in jobs if now - self._failed_at.get(job, -self.RETRY_SECONDS) >= self.RETRY_SECONDS]
        if ready:
            self._thread = threading.Thread(target=self._copy, args=(ready[0], resyncs.get(ready[0])), name=ready[0])
            self._thread.start()

    def _copy(self, job: str, reason: str | None) -> None:
        try:
            # Neither a snapshot nor a resync needs Spark; the holder process outlives a crash of run.
            with Pipeline(self.config, detached_holder=True) as pipeline:
                if job == self.SNAPSHOT:
                    results = pipeline.snapshot()
                    log.warning("snapshotted %s", ", ".join(f"{k} ({r.rows} rows)" for k, r in results.items()))
                else:
                    log.warning("resyncing %s online: %s", job, reason)
                    result = pipeline.resync(job)
                    log.warning("resynced %s: %d rows in %.1f s", job, result.rows, result.seconds)
            self._failed_at.pop(job, None)
        except Exception:
            self._failed_at[job] = time.monotonic()
            log.exception("%s failed; trying again in %.0f s", job, self.RETRY_SECONDS)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


class _Upkeep:
    """Maintenance inside ``run``: between merges, a pass over each table that is due (see
    maintenance.Maintainer.due), looked for at most every :data:`UPKEEP_CHECK_SECONDS`."""

    def __init__(self, maintainer: Maintainer, metrics: PipelineMetrics) -> None:
        self.maintainer = maintainer
        self.metrics = metrics
        self.merged: set[str] = set()
        self.next_check = time.monotonic() + UPKEEP_CHECK_SECONDS

    def after_merges(self, results: dict[str, MergeResult]) -> None:
        self.merged.update(key for key, result in results.items() if result.batches)
        if time.monotonic() < self.next_check:
            return
        for key, reason in self.maintainer.due(self.merged).items():
            try:
                done = self.maintainer.maintain(key, reason)
            except Exception:
                # Upkeep is not what keeps the mirror exact: merges go on, the next check tries again.
                log.error("maintenance of %s failed; merges go on, the next check retries it", key, exc_info=True)
                continue
            if not done.skipped:
                self.metrics.record_maintenance(key, done.seconds)
                log.info("maintained %s (%s) in %.1f s: %s", key, reason, done.seconds, _maintenance_line(done))
        self.merged.clear()
        self.next_check = time.monotonic() + UPKEEP_CHECK_SECONDS


def _maintenance_line(result: MaintenanceResult) -> str:
    """What a pass did, in one log line."""
    rewrites = result.rewrites
    before, after = result.before, result.after
    files = f"data files {before.data_files} -> {after.data_files}" if before and after else ""
    return (
        f"{files}, {rewrites.data_files_rewritten} rewritten, {rewrites.delete_files_removed} delete files removed, "
        f"{rewrites.snapshots_expired} snapshots expired, {result.orphans_removed} orphans and "
        f"{result.staged_files_removed} staged files deleted"
    )


def _wait_for_either(stop: threading.Event, wake: threading.Event, timeout: float) -> None:
    """Return when ``stop`` or ``wake`` is set, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (stop.is_set() or wake.is_set()):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        wake.wait(min(remaining, 0.2))  # short slices: ``stop`` is set by a signal handler, not by us
