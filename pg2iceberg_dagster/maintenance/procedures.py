"""Iceberg's Spark procedures that rewrite a table's files and expire its snapshots.

Each procedure is one Iceberg commit (or none when there is nothing to do): a crash inside leaves the
table as it was, plus files no snapshot references, which orphan removal deletes later.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from ..config import MaintenanceConfig
from ..materializer.spark_sql import call_procedure, spark_identifier, spark_string


@dataclass
class Rewrites:
    """What the procedures did to one table."""

    data_files_rewritten: int = 0
    data_files_added: int = 0
    delete_files_removed: int = 0
    manifests_rewritten: int = 0
    snapshots_expired: int = 0
    files_expired: int = 0


def _options(options: dict[str, str]) -> str:
    return "map(" + ", ".join(f"{spark_string(k)}, {spark_string(v)}" for k, v in options.items()) + ")"


def compact(
    spark: Any, catalog: str, identifier: tuple[str, str], config: MaintenanceConfig, sorted_table: bool
) -> Rewrites:
    """Rewrite small data files into files of the target size (sorted by the table's sort order when
    it has one), data files with delete files applied, then the position delete files left, then
    the manifests."""
    table = spark_string(spark_identifier(*identifier))
    target = str(config.target_file_size_bytes)
    done = Rewrites()
    data = call_procedure(
        spark,
        catalog,
        "rewrite_data_files",
        {
            "table": table,
            "strategy": spark_string("sort" if sorted_table else "binpack"),
            # A file with any delete applies it; two small files are enough to merge; delete files
            # left pointing only at rewritten files go in the same commit.
            "options": _options(
                {
                    "target-file-size-bytes": target,
                    "min-input-files": "2",
                    "delete-file-threshold": "1",
                    "remove-dangling-deletes": "true",
                }
            ),
        },
    )
    done.data_files_rewritten = int(data.get("rewritten_data_files_count", 0))
    done.data_files_added = int(data.get("added_data_files_count", 0))
    done.delete_files_removed = int(data.get("removed_delete_files_count", 0))
    deletes = call_procedure(
        spark,
        catalog,
        "rewrite_position_delete_files",
        # All of them: what is left after the data files' rewrite points at few live rows, or (rewritten
        # files keep the rewrite's starting sequence number) at none, and a rewrite drops those.
        {"table": table, "options": _options({"target-file-size-bytes": target, "rewrite-all": "true"})},
    )
    done.delete_files_removed += int(deletes.get("rewritten_delete_files_count", 0)) - int(
        deletes.get("added_delete_files_count", 0)
    )
    manifests = call_procedure(spark, catalog, "rewrite_manifests", {"table": table})
    done.manifests_rewritten = int(manifests.get("rewritten_manifests_count", 0))
    return done


def expire_snapshots(
    spark: Any,
    catalog: str,
    identifier: tuple[str, str],
    config: MaintenanceConfig,
    done: Rewrites,
    retain_last: int | None = None,
) -> None:
    """Expire snapshots older than the retention, keeping the newest ``retain_last`` (default
    ``min_snapshots``); Iceberg deletes the files only they referenced."""
    cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(hours=config.snapshot_retention_hours)
    expired = call_procedure(
        spark,
        catalog,
        "expire_snapshots",
        {
            "table": spark_string(spark_identifier(*identifier)),
            "older_than": f"TIMESTAMP {spark_string(cutoff.isoformat(sep=' '))}",
            "retain_last": str(retain_last or config.min_snapshots),
        },
    )
    done.files_expired = sum(int(value) for name, value in expired.items() if name.startswith("deleted_"))
