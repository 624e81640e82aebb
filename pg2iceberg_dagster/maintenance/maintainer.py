"""One maintenance pass over a table, and when each table is due for one.

A pass runs under the table's writer lease (the one its merges take), so it never races a merge of
the pipeline: it waits for one in progress, and a merge waits for it. It only touches tables whose
snapshot is complete and that wait for no resync: those write files they have not committed yet, and
their recovery reads the snapshots' summaries. Steps, each safe to crash in (the next pass redoes
what is left):

1. compaction (data files, then position delete files, then manifests), when files are small or
   deletes many: one Iceberg commit each;
2. snapshot expiry past the retention (Iceberg deletes the files only they referenced);
3. orphan files older than ``orphan_min_age_hours`` deleted (what a crash left, in any step or any
   writer);
4. the staged log: files every group applied, unregistered uploads, merge batches a crash left.

A table's history table (docs/history.md) gets steps 1-3 in the same pass; its expiry keeps the
snapshot recording what the history holds.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from ..cleanup import collect_table_garbage
from ..config import PipelineConfig
from ..coordination.protocol import LEASE_WAIT_SECONDS, writer_lease_within
from ..coordination.store import CoordinationStore
from ..faults import crash_point
from ..iceberg.history import snapshots_to_keep
from ..staging.store import ObjectStore, merge_batch_prefix
from ..tables import MirroredTables
from .health import TableHealth, compaction_due, measured_health, summary_health
from .orphans import remove_orphan_files
from .procedures import Rewrites, compact, expire_snapshots

log = logging.getLogger(__name__)


@dataclass
class MaintenanceResult:
    """What one pass did to one table (``skipped`` says why it did nothing)."""

    table: str
    reason: str
    skipped: str | None = None
    before: TableHealth | None = None
    after: TableHealth | None = None
    rewrites: Rewrites = field(default_factory=Rewrites)
    orphans_removed: int = 0
    staged_files_removed: int = 0
    seconds: float = 0.0
    history: IcebergUpkeep | None = None  # of its history table, when it has one

    def as_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "reason": self.reason,
            "skipped": self.skipped,
            "before": self.before.as_dict() if self.before else None,
            "after": self.after.as_dict() if self.after else None,
            **vars(self.rewrites),
            "orphans_removed": self.orphans_removed,
            "staged_files_removed": self.staged_files_removed,
            "seconds": round(self.seconds, 3),
            "history": self.history.as_json() if self.history else None,
        }


@dataclass
class IcebergUpkeep:
    """What steps 1-3 did to one Iceberg table."""

    before: TableHealth
    after: TableHealth
    rewrites: Rewrites
    orphans_removed: int

    def as_json(self) -> dict[str, Any]:
        return {
            "before": self.before.as_dict(),
            "after": self.after.as_dict(),
            **vars(self.rewrites),
            "orphans_removed": self.orphans_removed,
        }


class Maintainer:
    """Maintains the configured tables' Iceberg files and staged log (see the module docstring)."""

    def __init__(
        self,
        config: PipelineConfig,
        tables: MirroredTables,
        store: CoordinationStore,
        objects: ObjectStore,
        catalog: Catalog,
        spark_factory: Callable[[], Any],
        worker_id: str | None = None,
    ) -> None:
        self.config = config
        self.tables = tables
        self.settings = config.maintenance
        self.store = store
        self.catalog = catalog
        self._spark_factory = spark_factory
        self.objects = objects
        self.worker_id = worker_id or f"maintenance:{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    def due(self, merged: Iterable[str] | None = None) -> dict[str, str]:
        """Tables due for a pass now, with why: ``interval_minutes`` since the last pass, or files that
        call for compaction. The files are judged from the snapshot summary (one metadata read per
        table) of the tables in ``merged`` (all configured tables when None): only a merge adds files."""
        keys = list(self.tables)
        states = self.store.table_states()
        since = self.store.seconds_since_maintained()
        examined = set(keys if merged is None else merged)
        due: dict[str, str] = {}
        for key in keys:
            state = states.get(key)
            if state is None or not state.snapshot_complete or not state.mergeable:
                continue
            if since.get(key, 0.0) >= self.settings.interval_minutes * 60:
                due[key] = "scheduled"
            elif key in examined:
                reason = compaction_due(
                    summary_health(self.catalog.load_table(self.tables[key].iceberg)), self.settings
                )
                if reason:
                    due[key] = reason
        return due

    def maintain(self, table_key: str, reason: str = "requested") -> MaintenanceResult:
        """One pass over ``table_key`` (see the module docstring); waits for its writer lease."""
        started = time.monotonic()
        result = MaintenanceResult(table_key, reason)
        with writer_lease_within(
            self.store, self.config.materialize.group, table_key, self.worker_id, LEASE_WAIT_SECONDS
        ):
            state = self.store.table_state(table_key)
            if state is None or not state.snapshot_complete:
                result.skipped = "its snapshot is not complete"
            elif not state.mergeable:
                result.skipped = f"it waits for a resync ({state.resync_reason})"
            else:
                self._pass(table_key, result)
                self.store.record_maintained(table_key)
        result.seconds = time.monotonic() - started
        if result.skipped:
            log.info("maintenance of %s skipped: %s", table_key, result.skipped)
        return result

    def _pass(self, table_key: str, result: MaintenanceResult) -> None:
        mirrored = self.tables[table_key]
        live = self._upkeep(mirrored.iceberg, lambda _: self.settings.min_snapshots)
        result.before, result.after, result.rewrites = live.before, live.after, live.rewrites
        result.orphans_removed = live.orphans_removed
        result.staged_files_removed = self._collect_staged(table_key)
        if mirrored.history is not None and self.catalog.table_exists(mirrored.history):
            keep = self.settings.min_snapshots
            result.history = self._upkeep(mirrored.history, lambda history: max(keep, snapshots_to_keep(history)))

    def _upkeep(self, identifier: tuple[str, str], retain_last: Callable[[Table], int]) -> IcebergUpkeep:
        """Steps 1-3 on one Iceberg table; expiry keeps at least the newest ``retain_last(table)``
        snapshots of the table as compaction left it."""
        settings = self.settings
        table = self.catalog.load_table(identifier)
        before = measured_health(table, settings.target_file_size_bytes)
        catalog = self.config.iceberg.catalog.name
        rewrites = Rewrites()
        if (before.small_files or 0) >= 2 or before.delete_files:
            rewrites = compact(
                self._spark_factory(), catalog, identifier, settings, sorted_table=not table.sort_order().is_unsorted
            )
        crash_point("maintenance.after_compaction")
        table = self.catalog.load_table(identifier)
        if len(table.metadata.snapshots) > (keep := retain_last(table)):
            expire_snapshots(self._spark_factory(), catalog, identifier, settings, rewrites, keep)
        crash_point("maintenance.after_expiry")
        orphans = remove_orphan_files(self.catalog.load_table(identifier), settings.orphan_min_age_hours * 3600)
        after = measured_health(self.catalog.load_table(identifier), settings.target_file_size_bytes)
        rewrites.snapshots_expired = max(0, before.snapshots - after.snapshots)
        return IcebergUpkeep(before, after, rewrites, orphans)

    def _collect_staged(self, table_key: str) -> int:
        """The staged log's garbage of the table: applied and unregistered files, and merge batches a
        crash left (older than the orphan age: a merge of another consumer group may be reading one)."""
        table = self.tables[table_key]
        removed = collect_table_garbage(self.store, self.objects, table, self.store.flushed_lsn() or 0)
        cutoff = time.time() - self.settings.orphan_min_age_hours * 3600
        for key, modified in self.objects.modified(merge_batch_prefix(table.staging), recursive=False).items():
            if modified <= cutoff:
                self.objects.delete(key)
                removed += 1
        return removed
