"""How an Iceberg table stands on files and snapshots: what maintenance looks at and reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from pyiceberg.manifest import DataFileContent
from pyiceberg.table import Table

from ..config import MaintenanceConfig

# A data file under this share of the target size counts as small (Iceberg's own default for
# rewrite_data_files' min-file-size-bytes).
SMALL_FILE_SHARE = 0.75


@dataclass(frozen=True)
class TableHealth:
    """Files and snapshots of a table's current state. ``small_files`` is None when only the
    snapshot summary was read (no manifest), else the data files under 3/4 of the target size."""

    data_files: int
    delete_files: int
    snapshots: int
    bytes: int
    records: int
    small_files: int | None = None

    @property
    def delete_ratio(self) -> float:
        """Delete files per data file (0 for an empty table)."""
        return self.delete_files / self.data_files if self.data_files else float(self.delete_files)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "delete_ratio": round(self.delete_ratio, 4)}


def summary_health(table: Table) -> TableHealth:
    """The table's health from its current snapshot's summary and its metadata: no manifest is read,
    so it costs one metadata load (what a check after every merge can afford)."""
    snapshot = table.current_snapshot()
    summary = snapshot.summary.additional_properties if snapshot and snapshot.summary else {}
    return TableHealth(
        data_files=int(summary.get("total-data-files", 0)),
        delete_files=int(summary.get("total-delete-files", 0)),
        snapshots=len(table.metadata.snapshots),
        bytes=int(summary.get("total-files-size", 0)),
        records=int(summary.get("total-records", 0)),
    )


def measured_health(table: Table, target_file_size_bytes: int) -> TableHealth:
    """The table's health with its small data files counted from the current snapshot's manifests."""
    health = summary_health(table)
    snapshot = table.current_snapshot()
    if snapshot is None:
        return replace(health, small_files=0)
    small = 0
    limit = SMALL_FILE_SHARE * target_file_size_bytes
    for manifest in snapshot.manifests(table.io):
        for entry in manifest.fetch_manifest_entry(table.io):
            data_file = entry.data_file
            if data_file.content == DataFileContent.DATA and data_file.file_size_in_bytes < limit:
                small += 1
    return replace(health, small_files=small)


def compaction_due(health: TableHealth, config: MaintenanceConfig) -> str | None:
    """Why the table needs compacting now (None when it does not): ``compact_at_files`` small data
    files (counted when ``health`` measured them, else estimated from the summary: that many data
    files averaging small), or ``compact_at_files`` delete files that are more than
    ``max_delete_ratio`` per data file (a floor: one merge into a table of one file is no pile-up)."""
    if health.small_files is not None:
        if health.small_files >= config.compact_at_files:
            return f"{health.small_files} small data files"
    elif health.data_files >= config.compact_at_files:
        average = health.bytes / max(1, health.data_files + health.delete_files)
        if average < SMALL_FILE_SHARE * config.target_file_size_bytes:
            return f"{health.data_files} data files averaging {average / 1024:.0f} KiB"
    if health.delete_files >= config.compact_at_files and health.delete_ratio > config.max_delete_ratio:
        return f"{health.delete_files} delete files for {health.data_files} data files"
    return None
