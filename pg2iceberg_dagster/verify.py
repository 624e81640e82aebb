"""Row-by-row comparison of PostgreSQL and Iceberg at one consistent point of the source."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql
from pyiceberg.expressions import (
    AlwaysTrue,
    And,
    BooleanExpression,
    EqualTo,
    GreaterThan,
    GreaterThanOrEqual,
    LessThan,
    LessThanOrEqual,
    Or,
)
from pyiceberg.table import Table

from .config import OutOfRange
from .iceberg.types import arrow_column, arrow_schema, iceberg_schema, text_loaders
from .source.catalog import TEXT_OID, SourceTable
from .source.connection import consistent_read


@dataclass
class TableDiff:
    """Differences for one table; ``examples`` holds a few keys of each kind."""

    table: str
    pg_rows: int = 0
    iceberg_rows: int = 0
    only_in_pg: int = 0
    only_in_iceberg: int = 0
    different: int = 0
    duplicate_keys: int = 0
    examples: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.only_in_pg or self.only_in_iceberg or self.different or self.duplicate_keys)


_EVERY_ROW = sql.SQL("true")

# Key types ordered alike in PostgreSQL and Iceberg (text is not: its collation orders it in one, its
# bytes in the other).
_SLICEABLE_KEY_KINDS = frozenset({"int2", "int4", "int8"})


@dataclass(frozen=True)
class KeySlice:
    """The rows whose primary key lies between ``low`` and ``high`` (inclusive, in the key's order;
    ``high`` None: to the end): part of a table too large to compare whole at every check."""

    columns: tuple[str, ...]
    low: tuple[int, ...]
    high: tuple[int, ...] | None

    def condition(self) -> sql.Composable:
        """The slice as a PostgreSQL condition (a row comparison: the primary key's index serves it)."""
        keys = sql.SQL("({})").format(sql.SQL(", ").join(map(sql.Identifier, self.columns)))
        bounds = [sql.SQL("{} >= ({})").format(keys, sql.SQL(", ").join(map(sql.Literal, self.low)))]
        if self.high is not None:
            bounds.append(sql.SQL("{} <= ({})").format(keys, sql.SQL(", ").join(map(sql.Literal, self.high))))
        return sql.SQL(" AND ").join(bounds)

    def row_filter(self) -> BooleanExpression:
        """The same rows as an Iceberg scan filter (files outside the range are skipped by their stats)."""
        at_least = _lexicographic(self.columns, self.low, GreaterThan, GreaterThanOrEqual)
        if self.high is None:
            return at_least
        return And(at_least, _lexicographic(self.columns, self.high, LessThan, LessThanOrEqual))

    def describe(self) -> str:
        def key(values: tuple[int, ...]) -> str:
            return str(values[0]) if len(values) == 1 else str(values)

        return f"{', '.join(self.columns)} from {key(self.low)} to {key(self.high) if self.high else 'the end'}"


def _lexicographic(columns: tuple[str, ...], values: tuple[int, ...], strict: type, inclusive: type) -> Any:
    """``(columns) >= values`` (or ``<=``) for Iceberg, which has no row comparison: the first column
    past its value, or equal to it and the rest compared the same way."""
    if len(columns) == 1:
        return inclusive(columns[0], values[0])
    rest = _lexicographic(columns[1:], values[1:], strict, inclusive)
    return Or(strict(columns[0], values[0]), And(EqualTo(columns[0], values[0]), rest))


def sliceable(source: SourceTable) -> bool:
    """Whether the table's primary key orders alike in PostgreSQL and Iceberg (integer columns, no
    collation), so that a :class:`KeySlice` of it selects the same rows on both sides."""
    return all(source.column(name).type.kind in _SLICEABLE_KEY_KINDS for name in source.primary_key)


def choose_key_slice(conn: psycopg.Connection, source: SourceTable, rows: int) -> KeySlice | None:
    """A slice of ``rows`` rows of a :func:`sliceable` table from a random key (another each call, so
    that checks over time cover the table; the last ``rows`` rows when fewer follow it), read through
    the primary key's index on ``conn`` (not in a transaction). None when the table is empty."""
    table = sql.Identifier(source.schema_name, source.table_name)
    keys = sql.SQL(", ").join(map(sql.Identifier, source.primary_key))
    descending = sql.SQL(", ").join(sql.SQL("{} DESC").format(sql.Identifier(k)) for k in source.primary_key)

    def key_at(order: sql.Composable, offset: int, where: sql.Composable = _EVERY_ROW, params: Any = ()) -> Any:
        """The key ``offset`` rows into the keys (those of ``where``) in ``order``; None past the end."""
        query = sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} OFFSET %s LIMIT 1").format(keys, table, where, order)
        row = conn.execute(query, (*params, offset)).fetchone()
        return tuple(row) if row is not None else None

    with consistent_read(conn):
        first = sql.Identifier(source.primary_key[0])
        bounds = conn.execute(sql.SQL("SELECT min({0}), max({0}) FROM {1}").format(first, table)).fetchone()
        if bounds is None or bounds[0] is None:
            return None
        start = random.randint(bounds[0], bounds[1])
        low = key_at(keys, 0, sql.SQL("{} >= %s").format(first), (start,))
        placeholders = sql.SQL(", ").join(sql.Placeholder() * len(source.primary_key))
        high = key_at(keys, rows - 1, sql.SQL("({}) >= ({})").format(keys, placeholders), low)
        if high is None:
            low = key_at(descending, rows - 1) or key_at(keys, 0)
    return KeySlice(source.primary_key, low, high)


def copy_rows(
    conn: psycopg.Connection, source: SourceTable, schema: pa.Schema, rule: OutOfRange, where: KeySlice | None = None
) -> pa.Table:
    """The table (or the rows of ``where``) as ``schema``, read by ``COPY`` text on ``conn`` (inside the
    caller's transaction), values Iceberg cannot hold mapped by ``rule``.

    Deliberately not the snapshot's reader: values are parsed from their text form by the text loaders
    the WAL path uses, so a decoding slip in either path shows up as a difference.
    """
    columns = sql.SQL(", ").join(sql.Identifier(column.name) for column in source.columns)
    condition = where.condition() if where is not None else _EVERY_ROW
    query = sql.SQL("COPY (SELECT {} FROM {}.{} WHERE {}) TO STDOUT").format(
        columns, sql.Identifier(source.schema_name), sql.Identifier(source.table_name), condition
    )
    loaders = text_loaders(source.columns, rule)
    values: list[list[object]] = [[] for _ in source.columns]
    with conn.cursor() as cursor, cursor.copy(query) as copy:
        # COPY's escapes undone, each value's text goes through the column's loader.
        copy.set_types([TEXT_OID] * len(source.columns))
        for row in copy.rows():
            for position, text in enumerate(row):
                values[position].append(None if text is None else loaders[position](text.encode()))
    by_name = {column.name: column_values for column, column_values in zip(source.columns, values, strict=True)}
    arrays = [
        arrow_column(by_name[field.name], field.type, field.name)
        if field.name in by_name
        else pa.nulls(len(values[0]) if values else 0, field.type)
        for field in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


class _NaN:
    """Stands for a float NaN in compared rows: NaN never equals itself, yet a NaN mirrored as NaN is equal."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NaN)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "NaN"


def _comparable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return _NaN()
    if isinstance(value, list):
        return [_comparable(item) for item in value]
    return value


def _rows_by_key(rows: pa.Table, key: tuple[str, ...], columns: list[str]) -> tuple[dict[tuple, tuple], int]:
    by_key: dict[tuple, tuple] = {}
    duplicates = 0
    selected = rows.select(columns)
    positions = [columns.index(name) for name in key]
    # Only floats (and what may nest them) can hold a NaN: other values compare as they are.
    with_nan = [pa.types.is_floating(f.type) or pa.types.is_nested(f.type) for f in selected.schema]
    for batch in selected.to_batches(max_chunksize=65_536):
        by_column = [
            [_comparable(value) for value in column.to_pylist()] if nan else column.to_pylist()
            for column, nan in zip(batch.columns, with_nan, strict=True)
        ]
        for values in zip(*by_column, strict=True):
            k = tuple(values[position] for position in positions)
            if k in by_key:
                duplicates += 1
            by_key[k] = values
    return by_key, duplicates


def compare_table(
    conn: psycopg.Connection,
    source: SourceTable,
    iceberg_table: Table,
    rule: OutOfRange,
    examples: int = 5,
    key_slice: KeySlice | None = None,
) -> TableDiff:
    """Compare a table (or the rows of ``key_slice``) read on ``conn`` (the caller's REPEATABLE READ
    transaction) with Iceberg, after ``rule`` mapped the source's values Iceberg cannot hold.

    A source column Iceberg does not have yet counts as NULL there: logical replication carries no
    DDL, so a column added in the source reaches Iceberg with the first change to the table after
    it. Until then every row has it NULL (columns added with a default are refused), and a value in
    it is a difference.
    """
    iceberg_schema_arrow = arrow_schema(iceberg_table.schema())
    not_yet_in_iceberg = [column for column in source.columns if column.name not in iceberg_schema_arrow.names]
    schema = pa.schema([*iceberg_schema_arrow, *arrow_schema(iceberg_schema(not_yet_in_iceberg, ()))])
    pg_rows = copy_rows(conn, source, schema, rule, key_slice)
    iceberg_rows = iceberg_table.scan(row_filter=key_slice.row_filter() if key_slice else AlwaysTrue()).to_arrow()
    if iceberg_rows.num_rows:
        iceberg_rows = iceberg_rows.cast(iceberg_schema_arrow)
        for column in not_yet_in_iceberg:
            added = schema.field(column.name)
            iceberg_rows = iceberg_rows.append_column(added, pa.nulls(iceberg_rows.num_rows, added.type))
    else:
        iceberg_rows = pg_rows.slice(0, 0)
    columns = [column.name for column in source.columns]
    pg, _ = _rows_by_key(pg_rows, source.primary_key, columns)
    ice, duplicates = _rows_by_key(iceberg_rows, source.primary_key, columns)
    diff = TableDiff(source.key, pg_rows.num_rows, iceberg_rows.num_rows, duplicate_keys=duplicates)
    only_pg = [k for k in pg if k not in ice]
    only_ice = [k for k in ice if k not in pg]
    different = [k for k in pg if k in ice and pg[k] != ice[k]]
    diff.only_in_pg, diff.only_in_iceberg, diff.different = len(only_pg), len(only_ice), len(different)
    for name, keys in (("only_in_pg", only_pg), ("only_in_iceberg", only_ice), ("different", different)):
        if keys:
            diff.examples[name] = keys[:examples]
    return diff


def print_diffs(diffs: Sequence[TableDiff]) -> bool:
    """Print a verify report (``only_in_pg == -1`` marks a table with no Iceberg table); True when every
    table matches."""
    ok = True
    for diff in diffs:
        if diff.only_in_pg == -1:
            print(f"{diff.table}: MISSING (no Iceberg table)")
            ok = False
            continue
        state = "OK" if diff.ok else "DIFFERENT"
        ok = ok and diff.ok
        print(
            f"{diff.table}: {state} pg={diff.pg_rows} iceberg={diff.iceberg_rows} only_in_pg={diff.only_in_pg} "
            f"only_in_iceberg={diff.only_in_iceberg} different={diff.different} duplicate_keys={diff.duplicate_keys}"
        )
        for kind, keys in diff.examples.items():
            print(f"    {kind}: {keys}")
    return ok
