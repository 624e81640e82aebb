"""Data checks on a mirrored table: one row per primary key, and a schema that matches the source."""

from __future__ import annotations

import pyarrow.compute as pc
from pyiceberg.table import Table

from .iceberg.types import field_ids, iceberg_type
from .source.catalog import SourceTable


def duplicate_keys(table: Table) -> tuple[int, list[tuple]]:
    """(number of primary keys that appear more than once, a few of them) in the Iceberg table."""
    schema = table.schema()
    key = [schema.find_field(field_id).name for field_id in schema.identifier_field_ids]
    rows = table.scan(selected_fields=tuple(key)).to_arrow()
    if rows.num_rows == 0:
        return 0, []
    counts = rows.group_by(key).aggregate([([], "count_all")])
    duplicated = counts.filter(pc.greater(counts["count_all"], 1))
    examples = [tuple(row[name] for name in key) for row in duplicated.slice(0, 5).to_pylist()]
    return duplicated.num_rows, examples


def schema_mismatches(source: SourceTable, table: Table) -> list[str]:
    """How the Iceberg schema differs from what the source columns map to (empty when it matches).

    Extra Iceberg columns are expected (columns dropped at the source are kept) and not reported.
    """
    schema = table.schema()
    problems = []
    element_ids = field_ids(100_000)
    for column in source.columns:
        wanted = iceberg_type(column.type, column.name, element_ids)
        if column.name not in schema.column_names:
            problems.append(f"{column.name}: missing in Iceberg (source type {column.type.name})")
            continue
        actual = schema.find_field(column.name).field_type
        if str(actual) != str(wanted):
            problems.append(f"{column.name}: Iceberg {actual}, source maps to {wanted}")
    key = {schema.find_field(field_id).name for field_id in schema.identifier_field_ids}
    if key != set(source.primary_key):
        problems.append(f"identifier fields {sorted(key)} differ from the primary key {list(source.primary_key)}")
    return problems
