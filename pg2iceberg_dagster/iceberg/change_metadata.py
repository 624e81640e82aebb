"""Change metadata columns of an Iceberg table: which they are, adding them, refusing name clashes.

A table with change metadata carries, after the source's columns, the LSN and source commit time of
each row's last change and the time it was merged (docs/change_metadata.md). Which fields these are
is recorded in a table property, so every reader (the merge, ``verify``, the checks, schema evolution)
tells them from source columns by the table alone, whatever the configuration says now.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pyiceberg.expressions import AlwaysTrue, BooleanExpression, IsNull
from pyiceberg.table import Table
from pyiceberg.types import IcebergType, LongType, TimestamptzType

from ..config import ChangeMetadataConfig, PipelineConfig, TableConfig
from ..errors import ConfigError, StartupCheckError
from ..source.catalog import SourceColumn
from .commit import commit_with_retry
from .transaction import open_transaction

METADATA_COLUMNS = "pg2iceberg.metadata-columns"
DELETION_COLUMNS = "pg2iceberg.soft-delete-columns"


@dataclass(frozen=True)
class MetadataColumns:
    """The names of a table's change metadata columns."""

    lsn: str
    committed_at: str
    merged_at: str

    PROPERTY: ClassVar[str] = METADATA_COLUMNS

    @property
    def names(self) -> tuple[str, ...]:
        return (self.lsn, self.committed_at, self.merged_at)

    def fields(self) -> list[tuple[str, IcebergType]]:
        """Each column's name and Iceberg type."""
        return [(self.lsn, LongType()), (self.committed_at, TimestamptzType()), (self.merged_at, TimestamptzType())]

    @classmethod
    def of(cls, config: ChangeMetadataConfig) -> MetadataColumns:
        return cls(config.lsn_column, config.committed_at_column, config.merged_at_column)


@dataclass(frozen=True)
class DeletionColumns:
    """The names of a soft-deleting table's deletion columns: when the row was deleted at the source
    (commit time) and the delete's commit LSN; both NULL on a live row."""

    deleted_at: str
    deleted_lsn: str

    PROPERTY: ClassVar[str] = DELETION_COLUMNS

    @property
    def names(self) -> tuple[str, ...]:
        return (self.deleted_at, self.deleted_lsn)

    def fields(self) -> list[tuple[str, IcebergType]]:
        """Each column's name and Iceberg type."""
        return [(self.deleted_at, TimestamptzType()), (self.deleted_lsn, LongType())]

    @classmethod
    def of(cls, config: ChangeMetadataConfig) -> DeletionColumns:
        return cls(config.deleted_at_column, config.deleted_lsn_column)


ColumnSet = MetadataColumns | DeletionColumns


def _recorded(table: Table, name: str) -> dict[str, str] | None:
    text = table.properties.get(name)
    return json.loads(text) if text else None


def metadata_columns(table: Table) -> MetadataColumns | None:
    """The change metadata columns ``table`` records (None: it has none)."""
    recorded = _recorded(table, METADATA_COLUMNS)
    return MetadataColumns(**recorded) if recorded else None


def deletion_columns(table: Table) -> DeletionColumns | None:
    """The deletion columns of ``table`` (None: its deletes remove rows)."""
    recorded = _recorded(table, DELETION_COLUMNS)
    return DeletionColumns(**recorded) if recorded else None


def metadata_names(table: Table) -> frozenset[str]:
    """The names of ``table``'s change metadata and deletion columns (empty: none): not source columns."""
    sets = [metadata_columns(table), deletion_columns(table)]
    return frozenset(name for columns in sets if columns is not None for name in columns.names)


def live_rows_filter(table: Table) -> BooleanExpression:
    """The rows of ``table`` that are live at the source: all, or those not soft-deleted."""
    deletion = deletion_columns(table)
    return IsNull(term=deletion.deleted_at) if deletion else AlwaysTrue()


def refuse_metadata_name_clash(table_key: str, source: Sequence[SourceColumn], names: Sequence[str]) -> None:
    """A source column named like a change metadata column cannot be mirrored beside it."""
    clash = sorted({column.name for column in source} & set(names))
    if clash:
        raise StartupCheckError(
            f"table {table_key}: source column {clash[0]} has the name of a change metadata column; rename the "
            f"source column (ALTER TABLE {table_key} RENAME COLUMN ...), or, before the table's first snapshot, "
            "give the metadata columns other names (change_metadata.lsn_column, committed_at_column, "
            "merged_at_column) or turn change_metadata off for it; then run again"
        )


def ensure_configured_columns(
    table: Table, config: PipelineConfig, configured: TableConfig, source: Sequence[SourceColumn]
) -> Table:
    """``table`` with the change metadata and deletion columns ``configured`` asks for (added when
    turned on after the table was created)."""
    metadata = config.change_metadata_for(configured)
    if metadata is not None:
        table = ensure_columns(table, configured.key, source, MetadataColumns.of(metadata))
    if configured.deletes == "soft":
        table = ensure_columns(table, configured.key, source, DeletionColumns.of(config.change_metadata))
    return table


def ensure_columns(table: Table, table_key: str, source: Sequence[SourceColumn], wanted: ColumnSet) -> Table:
    """Add the change metadata (or deletion) columns ``table`` lacks and record them; refused when a
    source column has one of their names, or the table already records others (renaming them is not
    supported)."""
    refuse_metadata_name_clash(table_key, source, wanted.names)
    recorded = _recorded(table, wanted.PROPERTY)
    if recorded == wanted.__dict__:
        return table
    if recorded is not None:
        raise ConfigError(
            f"table {table_key}: its Iceberg table has the columns {', '.join(recorded.values())}, and the "
            f"configuration names {', '.join(wanted.names)}; set the names back (renaming them is not supported)"
        )

    def add() -> None:
        table.refresh()
        with open_transaction(table) as transaction:
            with transaction.update_schema() as update:
                present = set(table.schema().column_names)
                for name, field_type in wanted.fields():
                    if name not in present:
                        update.add_column(name, field_type, doc="pg2iceberg change metadata")
            transaction.set_properties({wanted.PROPERTY: json.dumps(wanted.__dict__)})

    commit_with_retry(add)
    table.refresh()
    return table
