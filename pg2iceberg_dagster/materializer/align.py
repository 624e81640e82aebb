"""Staged changes in the Iceberg table's current columns, whatever columns their relation had.

A batch can span an ALTER TABLE: changes staged before it name the columns as they were then. Each
relation's columns are matched to the Iceberg fields by identity (``attnum``, see
:mod:`~pg2iceberg_dagster.iceberg.evolution`), so a value staged under a column's old name lands in
the renamed field, and a value of a column since dropped never lands in a new column that took its
name. A change staged before a column was added with a DEFAULT carries that default: PostgreSQL
shows it on every row written before the ALTER.

Batches that span no such ALTER (nearly all) pass through untouched.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import pyarrow as pa
from pyiceberg.table import Table

from ..iceberg.evolution import column_attnums, field_for
from ..source.catalog import SourceColumn
from ..staging.codec import StagedRelation, join_names, split_names

StagedBatch = tuple[StagedRelation, pa.Table]


@dataclasses.dataclass(frozen=True)
class _Mapping:
    """How one relation's changes become the table's: target name per column (None: no field), and
    the columns its changes take a constant for."""

    targets: dict[str, str | None]
    fills: tuple[tuple[SourceColumn, str], ...]

    @property
    def identity(self) -> bool:
        return not self.fills and all(source == target for source, target in self.targets.items())


def _mapping(relation: StagedRelation, newest: StagedRelation, table: Table) -> _Mapping:
    schema = table.schema()
    attnums = column_attnums(table)
    targets: dict[str, str | None] = {}
    for column in relation.columns:
        field = field_for(schema, attnums, column)
        targets[column.name] = field.name if field is not None else None
    present = {column.attnum for column in relation.columns}
    fills = []
    for column in newest.columns:
        if column.missing is None or column.attnum is None or column.attnum in present:
            continue
        field = field_for(schema, attnums, column)
        if field is not None:
            fills.append((dataclasses.replace(column, name=field.name), column.missing))
    return _Mapping(targets, tuple(fills))


def _aligned_relation(relation: StagedRelation, mapping: _Mapping) -> StagedRelation:
    columns = [
        dataclasses.replace(column, name=target)
        for column in relation.columns
        if (target := mapping.targets[column.name]) is not None
    ]
    columns.extend(column for column, _ in mapping.fills)
    return dataclasses.replace(relation, columns=tuple(columns))


def _aligned_changes(changes: pa.Table, mapping: _Mapping) -> pa.Table:
    fills = {column.name: value for column, value in mapping.fills}
    data = []
    for text in changes.column("_data").to_pylist():
        row = json.loads(text)
        if isinstance(row, dict):
            row = {target: value for name, value in row.items() if (target := mapping.targets.get(name, name))}
            row.update(fills)
        data.append(json.dumps(row, separators=(",", ":")))
    unchanged: list[str | None] = []
    for text in changes.column("_unchanged_cols").to_pylist():
        if text is None:
            unchanged.append(None)
            continue
        names = [t for name in split_names(text) if (t := mapping.targets.get(name, name))]
        unchanged.append(join_names(names) if names else None)
    return changes.set_column(changes.schema.get_field_index("_data"), "_data", pa.array(data, pa.string())).set_column(
        changes.schema.get_field_index("_unchanged_cols"), "_unchanged_cols", pa.array(unchanged, pa.string())
    )


def align_batches(staged: Sequence[StagedBatch], table: Table) -> list[StagedBatch]:
    """``staged`` (in log order, the last relation the newest) in ``table``'s current columns."""
    if not staged:
        return []
    newest = staged[-1][0]
    mappings: dict[StagedRelation, _Mapping] = {}
    aligned = []
    for relation, changes in staged:
        mapping = mappings.get(relation)
        if mapping is None:
            mapping = mappings[relation] = _mapping(relation, newest, table)
        if mapping.identity:
            aligned.append((relation, changes))
        else:
            aligned.append((_aligned_relation(relation, mapping), _aligned_changes(changes, mapping)))
    return aligned
