"""Data checks on a mirrored table: one row per primary key, a schema that matches the source, and
(through :meth:`Pipeline.check_table`) content equal to the source."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysTrue, BooleanExpression
from pyiceberg.table import Table

from .iceberg.evolution import schema_follows_source
from .source.catalog import SourceTable
from .verify import TableDiff

ALL_ROWS = "all rows"


@dataclass(frozen=True)
class ContentCheck:
    """Rows compared with the source, or why not: changes still staged (``lag`` > 0), or
    ``not_compared``."""

    lag: int
    diff: TableDiff | None = None  # None when not compared
    # The source was written while it was compared: a difference is not at a consistent point.
    source_written_during_check: bool = False
    # Changes committed before the comparison may not have been merged yet (the flusher had not
    # staged past them, or staged some since): a difference may be the mirror's ordinary delay.
    changes_in_flight: bool = False
    not_compared: str = ""  # why a table with no lag was not compared

    @property
    def conclusive(self) -> bool:
        """Whether a difference found is one the mirror should not have (else it may be in flight)."""
        return not (self.source_written_during_check or self.changes_in_flight)


@dataclass(frozen=True)
class TableCheckReport:
    """Every check of one mirrored table."""

    duplicate_keys: int
    duplicate_examples: list[tuple]
    schema_problems: list[str]
    content: ContentCheck
    # The rows whose keys were checked, and the rows compared: all, or a key range of a large table.
    keys_checked: str = ALL_ROWS
    content_checked: str = ALL_ROWS


def duplicate_keys(table: Table, row_filter: BooleanExpression | None = None) -> tuple[int, list[tuple]]:
    """(number of primary keys that appear more than once, a few of them) in the Iceberg table's rows
    (those of ``row_filter``)."""
    schema = table.schema()
    key = [schema.find_field(field_id).name for field_id in schema.identifier_field_ids]
    rows = table.scan(row_filter=row_filter or AlwaysTrue(), selected_fields=tuple(key)).to_arrow()
    if rows.num_rows == 0:
        return 0, []
    counts = rows.group_by(key).aggregate([([], "count_all")])
    duplicated = counts.filter(pc.greater(counts["count_all"], 1))
    examples = [tuple(row[name] for name in key) for row in duplicated.slice(0, 5).to_pylist()]
    return duplicated.num_rows, examples


def schema_mismatches(source: SourceTable, table: Table) -> list[str]:
    """How the Iceberg schema differs from what the source columns map to (empty when it matches),
    by the rule schema evolution follows (see :func:`schema_follows_source`).

    Extra Iceberg columns are expected (columns dropped at the source are kept) and not reported.
    """
    problems = schema_follows_source(table, source.columns)
    schema = table.schema()
    key = {schema.find_field(field_id).name for field_id in schema.identifier_field_ids}
    if key != set(source.primary_key):
        problems.append(f"identifier fields {sorted(key)} differ from the primary key {list(source.primary_key)}")
    return problems
