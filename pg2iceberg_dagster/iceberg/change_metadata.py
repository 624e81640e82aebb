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

from pyiceberg.table import Table
from pyiceberg.types import IcebergType, LongType, TimestamptzType

from ..config import ChangeMetadataConfig
from ..errors import ConfigError, StartupCheckError
from ..source.catalog import SourceColumn
from .commit import commit_with_retry

METADATA_COLUMNS = "pg2iceberg.metadata-columns"


@dataclass(frozen=True)
class MetadataColumns:
    """The names of a table's change metadata columns."""

    lsn: str
    committed_at: str
    merged_at: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.lsn, self.committed_at, self.merged_at)

    def fields(self) -> list[tuple[str, IcebergType]]:
        """Each column's name and Iceberg type."""
        return [(self.lsn, LongType()), (self.committed_at, TimestamptzType()), (self.merged_at, TimestamptzType())]

    @classmethod
    def of(cls, config: ChangeMetadataConfig) -> MetadataColumns:
        return cls(config.lsn_column, config.committed_at_column, config.merged_at_column)


def metadata_columns(table: Table) -> MetadataColumns | None:
    """The change metadata columns ``table`` records (None: it has none)."""
    recorded = table.properties.get(METADATA_COLUMNS)
    if not recorded:
        return None
    data = json.loads(recorded)
    return MetadataColumns(data["lsn"], data["committed_at"], data["merged_at"])


def metadata_names(table: Table) -> frozenset[str]:
    """The names of ``table``'s change metadata columns (empty: none): not source columns."""
    columns = metadata_columns(table)
    return frozenset(columns.names) if columns else frozenset()


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


def ensure_metadata_columns(
    table: Table, table_key: str, source: Sequence[SourceColumn], wanted: MetadataColumns
) -> Table:
    """Add the change metadata columns ``table`` lacks and record them; refused when a source column has
    one of their names, or the table already records others (renaming them is not supported)."""
    refuse_metadata_name_clash(table_key, source, wanted.names)
    recorded = metadata_columns(table)
    if recorded == wanted:
        return table
    if recorded is not None:
        raise ConfigError(
            f"table {table_key}: its Iceberg table has change metadata columns {', '.join(recorded.names)}, and the "
            f"configuration names {', '.join(wanted.names)}; set the names back (renaming them is not supported)"
        )

    def add() -> None:
        table.refresh()
        with table.transaction() as transaction:
            with transaction.update_schema() as update:
                present = set(table.schema().column_names)
                for name, field_type in wanted.fields():
                    if name not in present:
                        update.add_column(name, field_type, doc="pg2iceberg change metadata")
            transaction.set_properties({METADATA_COLUMNS: json.dumps(wanted.__dict__, sort_keys=True)})

    commit_with_retry(add)
    table.refresh()
    return table
