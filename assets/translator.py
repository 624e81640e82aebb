"""The one place that decides asset keys, groups, kinds, descriptions and partition names per table."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dagster import AssetKey

from pg2iceberg_dagster.config import PipelineConfig, TableConfig


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


@dataclass(frozen=True)
class Pg2IcebergTranslator:
    """Subclass and override to change how tables appear in Dagster."""

    config: PipelineConfig

    # The graph labels a node by the last part of its key: each part says what the node is
    # (``orders_source``, ``orders_staged_log``, ``orders_snapshot``, and ``orders``, the live table).

    def source_key(self, table: TableConfig) -> AssetKey:
        return AssetKey(["pg", _safe(table.schema_name), f"{_safe(table.table_name)}_source"])

    def staged_log_key(self, table: TableConfig) -> AssetKey:
        return AssetKey(["staged_log", _safe(table.schema_name), f"{_safe(table.table_name)}_staged_log"])

    def iceberg_key(self, table: TableConfig) -> AssetKey:
        namespace, name = self.config.iceberg_identifier(table)
        return AssetKey(["iceberg", _safe(namespace), _safe(name)])

    def snapshot_key(self, table: TableConfig) -> AssetKey:
        *namespace, name = self.iceberg_key(table).path
        return AssetKey([*namespace, f"{name}_snapshot"])

    def group_name(self, table: TableConfig) -> str:
        return _safe(table.schema_name)

    def partitions_name(self, table: TableConfig) -> str:
        """Name of the table's dynamic CTID-chunk partitions."""
        return f"ctid_chunks__{_safe(table.schema_name)}__{_safe(table.table_name)}"

    def iceberg_table_name(self, table: TableConfig) -> str:
        namespace, name = self.config.iceberg_identifier(table)
        return f"{self.config.iceberg.catalog.name}.{namespace}.{name}"

    def description(self, table: TableConfig, role: str) -> str:
        iceberg = self.iceberg_table_name(table)
        return {
            "source": f"PostgreSQL table {table.key} (replicated through slot {self.config.replication.slot}).",
            "staged_log": f"Committed WAL changes of {table.key} staged as Parquet files and registered in "
            "_pg2iceberg.log_index. Materialized by the flusher sensor.",
            "snapshot": f"Initial snapshot of {table.key} into the Iceberg table {iceberg}, one partition per CTID "
            "page chunk. Writes the same Iceberg table as the live asset.",
            "iceberg": f"The live Iceberg table {iceberg}: the staged log MERGEd by primary key through Spark. "
            "Writes the same Iceberg table as the snapshot asset.",
        }[role]
