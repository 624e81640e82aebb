"""The engine's entry points in one place: validate, snapshot, stream, materialize, run, verify,
status and cleanup. The CLI and the Dagster layer both drive the engine through :class:`Pipeline`."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError

from .config import PipelineConfig
from .coordination.store import CoordinationStore
from .errors import StagingError
from .flusher.flusher import Flusher, FlushStats
from .iceberg.catalog import open_catalog, table_identifier
from .materializer.merge import Materializer, MergeResult
from .materializer.spark import build_spark_session
from .snapshot.holder import holder_lock_key
from .snapshot.runner import ChunkCallback, SnapshotRunner, TableSnapshotResult
from .source.connection import connect
from .source.lsn import format_lsn
from .validation import StartupReport, check_startup, slot_info
from .verify import TableDiff, compare_table

log = logging.getLogger("pg2iceberg_dagster")


@dataclass
class TableStatus:
    table: str
    snapshot_complete: bool
    chunks_done: int
    chunks_total: int
    log_head: int
    mat_cursor: int
    snapshot_epoch: int | None = None  # the exported snapshot the table's rows were read under

    @property
    def lag(self) -> int:
        return self.log_head - self.mat_cursor


def _nothing_after(store: CoordinationStore) -> str:
    """What a failed flush left behind, for its error message."""
    flushed = store.flushed_lsn()
    return f"Nothing after flushed_lsn {format_lsn(flushed) if flushed else '-'} was registered or acknowledged"


class Pipeline:
    """One configured pipeline. Opens connections lazily; close it when done."""

    def __init__(self, config: PipelineConfig, spark_factory: Any = None, config_path: str | None = None) -> None:
        self.config = config
        # With the file the config came from, the snapshot's holder runs as a process that outlives
        # this one (see snapshot.holder); without, as a thread here.
        self.config_path = config_path
        self._spark_factory = spark_factory or (lambda: build_spark_session(config))
        self.store = CoordinationStore(config.state_connection)
        self._catalog: Catalog | None = None
        self._report: StartupReport | None = None
        self._spark: Any = None

    def close(self) -> None:
        self.store.close()

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
        return SnapshotRunner(self.config, self.store, self.validate(), self.catalog, self.config_path)

    def stream(
        self,
        stop: threading.Event | None = None,
        *,
        until_caught_up: bool = False,
        max_seconds: float | None = None,
        on_flush: Any = None,
    ) -> FlushStats:
        """Run the flusher (see :meth:`Flusher.run`)."""
        report = self.validate()
        with contextlib.closing(CoordinationStore(self.config.state_connection)) as store:
            flusher = Flusher(self.config, store, report.tables)
            try:
                return flusher.run(stop, until_caught_up=until_caught_up, max_seconds=max_seconds, on_flush=on_flush)
            except StagingError as exc:
                raise StagingError(
                    f"{exc}. {_nothing_after(store)}; once there is room (or the store is reachable again), "
                    "`stream` again: it resumes there"
                ) from exc
            finally:
                flusher.close()

    def materializer(self) -> Materializer:
        return Materializer(self.config, self.store, self.catalog, self.spark)

    def materialize(self, table_keys: list[str] | None = None) -> dict[str, MergeResult]:
        """One pass: merge every table's staged log up to its current head."""
        self.validate()
        return self.materializer().run_once(table_keys)

    def run(self, stop: threading.Event, interval: float | None = None) -> None:
        """Everything in one process: snapshot, then stream in a thread while merging.

        A merge starts as soon as the flusher has staged something (and at least every ``interval``
        seconds, default ``materialize.interval_seconds``), so a change waits for one flush interval
        and at most one merge in progress, not for a polling period. The Spark session is created once
        and lives as long as the process.
        """
        self.snapshot()
        errors: list[BaseException] = []
        staged = threading.Event()

        def stream() -> None:
            try:
                self.stream(stop, on_flush=lambda _stats: staged.set())
            except BaseException as exc:  # surfaced to the main loop
                errors.append(exc)
                stop.set()
            finally:
                staged.set()

        thread = threading.Thread(target=stream, name="flusher", daemon=True)
        thread.start()
        materializer = self.materializer()
        wait = interval if interval is not None else self.config.materialize.interval_seconds
        try:
            while not stop.is_set():
                staged.clear()  # a flush during the merge below sets it again: merge right after
                for result in materializer.run_once().values():
                    if result.batches:
                        log.info(
                            "merged %s: %d changes in %.2f s (%s), lag %d",
                            result.table,
                            result.changes,
                            result.seconds,
                            ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in result.timings.items()),
                            result.lag,
                        )
                _wait_for_either(stop, staged, wait)
        finally:
            stop.set()
            thread.join()
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
        diffs = []
        with connect(self.config.source, autocommit=False) as conn:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            for key, source in report.tables.items():
                if table_keys is not None and key not in table_keys:
                    continue
                identifier = table_identifier(self.config, self.config.table(key))
                try:
                    iceberg_table = self.catalog.load_table(identifier)
                except NoSuchTableError:
                    diff = TableDiff(key)
                    diff.only_in_pg = -1
                    diffs.append(diff)
                    continue
                diffs.append(compare_table(conn, source, iceberg_table))
            conn.rollback()
        return diffs

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
                    log_head=self.store.log_head(table.key),
                    mat_cursor=self.store.mat_cursor(self.config.materialize.group, table.key),
                    snapshot_epoch=state.snapshot_epoch if state else None,
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
        }


def _wait_for_either(stop: threading.Event, wake: threading.Event, timeout: float) -> None:
    """Return when ``stop`` or ``wake`` is set, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (stop.is_set() or wake.is_set()):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        wake.wait(min(remaining, 0.2))  # short slices: ``stop`` is set by a signal handler, not by us
