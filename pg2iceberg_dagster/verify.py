"""Row-by-row comparison of PostgreSQL and Iceberg at one consistent point of the source."""

from __future__ import annotations

import contextlib
import functools
import math
import random
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql
from pyiceberg.expressions import (
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
from .iceberg.change_metadata import live_rows_filter
from .iceberg.types import arrow_column, arrow_schema, iceberg_schema, text_loaders
from .maintenance.health import summary_health
from .source.catalog import TEXT_OID, SourceTable
from .source.connection import consistent_read
from .source.partitions import row_holders
from .source.policy import ColumnMask


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
    # Every differing key (only on one side, or different), up to the ``keep_keys`` the comparison
    # was asked to keep: what a check accounts for one by one.
    differing_keys: list[tuple] = field(default_factory=list)
    # Why the table was not compared (it waits for an online resync: its Iceberg schema is the old one).
    not_compared: str = ""

    @property
    def differences(self) -> int:
        """Keys whose rows differ: only on one side, or different (duplicate keys not included)."""
        return self.only_in_pg + self.only_in_iceberg + self.different

    def counts(self) -> dict[str, int]:
        """The rows compared on each side and the differences of each kind, by name (the Dagster check's
        metadata, the soak's report)."""
        return {
            "pg_rows": self.pg_rows,
            "iceberg_rows": self.iceberg_rows,
            "only_in_pg": self.only_in_pg,
            "only_in_iceberg": self.only_in_iceberg,
            "different": self.different,
            "duplicate_keys": self.duplicate_keys,
        }

    @property
    def ok(self) -> bool:
        return not (
            self.only_in_pg or self.only_in_iceberg or self.different or self.duplicate_keys or self.not_compared
        )


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
    equal: Any = EqualTo  # its __init__ takes (term, literal); the pydantic model's signature says otherwise
    return Or(strict(columns[0], values[0]), And(equal(columns[0], values[0]), rest))


def sliceable(source: SourceTable) -> bool:
    """Whether the table's primary key orders alike in PostgreSQL and Iceberg (integer columns, no
    collation), so that a :class:`KeySlice` of it selects the same rows on both sides."""
    return all(source.column(name).type.kind in _SLICEABLE_KEY_KINDS for name in source.primary_key)


def choose_key_slice(conn: psycopg.Connection, source: SourceTable, rows: int) -> KeySlice | None:
    """A slice of ``rows`` rows of a :func:`sliceable` table from a random key (another each call, so
    that checks over time cover the table; the last ``rows`` rows when fewer follow it), read through
    the primary key's index on ``conn`` (not in a transaction). None when the table is empty."""
    table = source.rows_sql()
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


def copy_batches(
    conn: psycopg.Connection,
    source: SourceTable,
    schema: pa.Schema,
    rule: OutOfRange,
    where: KeySlice | None = None,
    batch_rows: int = 65_536,
) -> Iterator[pa.Table]:
    """The table (or the rows of ``where``) as ``schema``, ``batch_rows`` at a time, read by ``COPY``
    text on ``conn`` (inside the caller's transaction), values Iceberg cannot hold mapped by ``rule``.

    Deliberately not the snapshot's reader: values are parsed from their text form by the text loaders
    the WAL path uses, so a decoding slip in either path shows up as a difference.
    """
    columns = sql.SQL(", ").join(sql.Identifier(column.name) for column in source.columns)
    condition = where.condition() if where is not None else _EVERY_ROW
    if source.row_filter:  # the rows the publication and the snapshot mirror
        condition = sql.SQL("{} AND {}").format(condition, source.row_filter_sql())
    query = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT").format(columns, source.rows_sql(), condition)
    loaders = list(text_loaders(source.columns, rule))
    for position, column in enumerate(source.columns):
        mask = source.mask_of(column.name)
        if mask is not None:  # masked as the snapshot and the flusher mask it, from the same text
            loaders[position] = functools.partial(_masked, mask, loaders[position])

    def as_arrow(values: list[list[object]], rows: int) -> pa.Table:
        by_name = {column.name: column_values for column, column_values in zip(source.columns, values, strict=True)}
        arrays = [
            arrow_column(by_name[field.name], field.type, field.name)
            if field.name in by_name
            else pa.nulls(rows, field.type)
            for field in schema
        ]
        return pa.Table.from_arrays(arrays, schema=schema)

    values: list[list[object]] = [[] for _ in source.columns]
    rows = 0
    with conn.cursor() as cursor, cursor.copy(query) as copy:
        # COPY's escapes undone, each value's text goes through the column's loader.
        copy.set_types([TEXT_OID] * len(source.columns))
        for row in copy.rows():
            for position, text in enumerate(row):
                values[position].append(None if text is None else loaders[position](text.encode()))
            rows += 1
            if rows == batch_rows:
                yield as_arrow(values, rows)
                values, rows = [[] for _ in source.columns], 0
    if rows:
        yield as_arrow(values, rows)


def _masked(mask: ColumnMask, load: Callable[[bytes], Any], text: bytes) -> Any:
    """A masked column's value: the mask of its text, then loaded as the (text) column it is mirrored as."""
    masked = mask.text(text.decode())
    return None if masked is None else load(masked.encode())


def copy_rows(
    conn: psycopg.Connection, source: SourceTable, schema: pa.Schema, rule: OutOfRange, where: KeySlice | None = None
) -> pa.Table:
    """:func:`copy_batches` as one table."""
    return pa.Table.from_batches(
        [batch for table in copy_batches(conn, source, schema, rule, where) for batch in table.to_batches()], schema
    )


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


def _normalizers(schema: pa.Schema) -> list[bool]:
    """Per column, whether its values need :func:`_comparable`: only floats (and what may nest them)
    can hold a NaN; other values compare as they are."""
    return [pa.types.is_floating(f.type) or pa.types.is_nested(f.type) for f in schema]


def _row_values(batch: pa.RecordBatch, with_nan: list[bool], positions: list[int] | None = None) -> Iterator[tuple]:
    """Each row's values (those at ``positions`` only, when given) as compared."""
    chosen = range(batch.num_columns) if positions is None else positions
    by_column = [
        [_comparable(value) for value in batch.column(i).to_pylist()] if with_nan[i] else batch.column(i).to_pylist()
        for i in chosen
    ]
    return zip(*by_column, strict=True)


def _rows_by_key(rows: pa.Table, positions: list[int]) -> tuple[dict[tuple, tuple], set[tuple], int]:
    """The rows by their key (the values at ``positions``), the keys that repeat, and how many times
    keys repeat."""
    by_key: dict[tuple, tuple] = {}
    repeated: set[tuple] = set()
    duplicates = 0
    with_nan = _normalizers(rows.schema)
    for batch in rows.to_batches(max_chunksize=65_536):
        for values in _row_values(batch, with_nan):
            k = tuple(values[position] for position in positions)
            if k in by_key:
                duplicates += 1
                repeated.add(k)
            by_key[k] = values
    return by_key, repeated, duplicates


@dataclass
class RowDifferences:
    """What makes Iceberg equal to the source, gathered by :func:`compare_table` bucket by bucket (so
    its size is that of the drift, not of the table): ``upserts`` are source rows (of keys only in the
    source, different, or repeated in Iceberg), ``delete_keys`` the keys whose Iceberg rows must go
    (only in Iceberg, different, or repeated; an upserted key is deleted first, then appended)."""

    upserts: list[pa.Table] = field(default_factory=list)
    delete_keys: list[tuple] = field(default_factory=list)
    # The keys of ``delete_keys`` with no upsert (only in Iceberg): a writer that deletes and upserts by
    # key in one statement needs each key once.
    delete_only_keys: list[tuple] = field(default_factory=list)
    # Every upserted key: a soft-deleting table may hold such a key as a row marked deleted, which the
    # comparison of live rows does not see, and which must go before the source's row is appended.
    upsert_keys: list[tuple] = field(default_factory=list)

    @property
    def upserted(self) -> int:
        return sum(rows.num_rows for rows in self.upserts)

    def add(self, pg_rows: pa.Table, positions: list[int], upsert: set[tuple], delete: set[tuple]) -> None:
        """Keep the rows of ``pg_rows`` whose key is in ``upsert``, and the keys of ``delete``."""
        self.delete_keys.extend(delete)
        self.delete_only_keys.extend(delete - upsert)
        self.upsert_keys.extend(upsert)
        if not upsert:
            return
        with_nan = _normalizers(pg_rows.schema)
        wanted = [
            key in upsert
            for batch in pg_rows.to_batches(max_chunksize=65_536)
            for key in _row_values(batch, with_nan, positions)
        ]
        self.upserts.append(pg_rows.filter(pa.array(wanted, pa.bool_())))


def _add_differences(
    diff: TableDiff,
    pg_rows: pa.Table,
    iceberg_rows: pa.Table,
    positions: list[int],
    examples: int,
    keep_keys: int = 0,
    differences: RowDifferences | None = None,
) -> None:
    """Count into ``diff`` the differences between these rows (all the rows of some keys on both sides),
    keeping differing keys up to ``keep_keys`` in all, and gather them into ``differences`` when given."""
    pg, _, _ = _rows_by_key(pg_rows, positions)
    ice, repeated, duplicates = _rows_by_key(iceberg_rows, positions)
    diff.pg_rows += pg_rows.num_rows
    diff.iceberg_rows += iceberg_rows.num_rows
    diff.duplicate_keys += duplicates
    found = {
        "only_in_pg": [k for k in pg if k not in ice],
        "only_in_iceberg": [k for k in ice if k not in pg],
        "different": [k for k in pg if k in ice and pg[k] != ice[k]],
    }
    if differences is not None:
        rewritten = set(found["different"]) | repeated
        differences.add(
            pg_rows,
            positions,
            upsert=set(found["only_in_pg"]) | (rewritten & pg.keys()),
            delete=set(found["only_in_iceberg"]) | rewritten,
        )
    diff.only_in_pg += len(found["only_in_pg"])
    diff.only_in_iceberg += len(found["only_in_iceberg"])
    diff.different += len(found["different"])
    for name, keys in found.items():
        diff.differing_keys += keys[: keep_keys - len(diff.differing_keys)]
        kept = diff.examples.setdefault(name, [])
        kept += keys[: examples - len(kept)]
        if not kept:
            del diff.examples[name]


class _Buckets:
    """One side's rows spilled to ``count`` Arrow files by a hash of their key, so that the two sides
    are compared a bucket (the same keys on both sides) at a time in bounded memory."""

    def __init__(self, directory: Path, side: str, schema: pa.Schema, count: int, positions: list[int]) -> None:
        self._paths = [directory / f"{side}-{bucket}.arrow" for bucket in range(count)]
        options = pa.ipc.IpcWriteOptions(compression="lz4")
        self._writers = [pa.ipc.new_file(str(path), schema, options=options) for path in self._paths]
        self._positions = positions
        self._with_nan = _normalizers(schema)

    def add(self, rows: pa.Table) -> None:
        count = len(self._writers)
        for batch in rows.to_batches():
            keys = _row_values(batch, self._with_nan, self._positions)
            buckets = pa.array([hash(key) % count for key in keys], pa.int32())
            order = pc.sort_indices(buckets)
            batch, buckets = batch.take(order), buckets.take(order)
            start = 0
            for bucket_count in pc.value_counts(buckets).to_pylist():
                bucket, size = bucket_count["values"], bucket_count["counts"]
                self._writers[bucket].write_batch(batch.slice(start, size))
                start += size

    def close(self) -> None:
        for writer in self._writers:
            writer.close()

    def read(self, bucket: int) -> pa.Table:
        with pa.memory_map(str(self._paths[bucket])) as source:
            return pa.ipc.open_file(source).read_all()


# Rows compared in memory at once by ``verify``: a larger table is compared a hash bucket of keys at
# a time, each side first spilled to local Arrow files (lz4) in the temporary directory; past
# MAX_BUCKETS (a file open per bucket while a side is written) buckets grow instead.
BUCKET_ROWS = 500_000
MAX_BUCKETS = 256


def compare_table(
    conn: psycopg.Connection,
    source: SourceTable,
    iceberg_table: Table,
    rule: OutOfRange,
    examples: int = 5,
    key_slice: KeySlice | None = None,
    keep_keys: int = 0,
    differences: RowDifferences | None = None,
) -> TableDiff:
    """Compare a table (or the rows of ``key_slice``) read on ``conn`` (the caller's REPEATABLE READ
    transaction) with Iceberg, after ``rule`` mapped the source's values Iceberg cannot hold. A table
    of more than :data:`BUCKET_ROWS` rows (on either side, as its statistics say) is compared a hash
    bucket of keys at a time, both sides spilled to local files first. Up to ``keep_keys`` differing
    keys are kept (``TableDiff.differing_keys``), as :func:`typed_keys` types keys. With ``differences``,
    the rows that differ are gathered there as well (the source's rows as typed for Iceberg, see
    :class:`RowDifferences`), for a repair to write.

    A source column Iceberg does not have yet counts as NULL there: logical replication carries no
    DDL, so a column added in the source reaches Iceberg with the first change to the table after
    it. Until then every row has it NULL (columns added with a default are refused), and a value in
    it is a difference.
    """
    iceberg_schema_arrow = arrow_schema(iceberg_table.schema())
    not_yet_in_iceberg = [column for column in source.columns if column.name not in iceberg_schema_arrow.names]
    schema = pa.schema([*iceberg_schema_arrow, *arrow_schema(iceberg_schema(not_yet_in_iceberg, ()))])
    columns = [column.name for column in source.columns]
    positions = [columns.index(name) for name in source.primary_key]

    def as_compared(rows: pa.Table | pa.RecordBatch) -> pa.Table:
        table = pa.Table.from_batches([rows]) if isinstance(rows, pa.RecordBatch) else rows
        table = table.cast(iceberg_schema_arrow)
        for column in not_yet_in_iceberg:
            added = schema.field(column.name)
            table = table.append_column(added, pa.nulls(table.num_rows, added.type))
        return table.select(columns)

    # Soft-deleted rows are not compared: a key soft-deleted in Iceberg and live at the source differs.
    live = live_rows_filter(iceberg_table)
    scan = iceberg_table.scan(row_filter=And(key_slice.row_filter(), live) if key_slice else live)
    diff = TableDiff(source.key)
    # A slice is sized to be compared at once; a whole table by the larger of the two sides.
    rows = 0 if key_slice else max(summary_health(iceberg_table).records, _source_rows_estimate(conn, source))
    buckets = min(MAX_BUCKETS, -(-rows // BUCKET_ROWS))
    if buckets <= 1:
        pg_rows = copy_rows(conn, source, schema, rule, key_slice).select(columns)
        iceberg_rows = scan.to_arrow()
        iceberg_rows = as_compared(iceberg_rows) if iceberg_rows.num_rows else pg_rows.slice(0, 0)
        _add_differences(diff, pg_rows, iceberg_rows, positions, examples, keep_keys, differences)
        return diff
    compared = pa.schema([schema.field(name) for name in columns])
    with tempfile.TemporaryDirectory(prefix="pg2iceberg-verify-") as directory:
        pg_side = _Buckets(Path(directory), "pg", compared, buckets, positions)
        with contextlib.closing(pg_side):
            for rows in copy_batches(conn, source, schema, rule):
                pg_side.add(rows.select(columns))
        iceberg_side = _Buckets(Path(directory), "iceberg", compared, buckets, positions)
        with contextlib.closing(iceberg_side):
            for batch in scan.to_arrow_batch_reader():
                iceberg_side.add(as_compared(batch))
        for bucket in range(buckets):
            _add_differences(
                diff, pg_side.read(bucket), iceberg_side.read(bucket), positions, examples, keep_keys, differences
            )
    return diff


def typed_keys(
    source: SourceTable, iceberg_table: Table, rule: OutOfRange, texts: Sequence[Sequence[str | None]]
) -> list[tuple]:
    """Primary keys given in PostgreSQL's text form (the primary key's columns in order, as staged
    changes hold them) as :func:`compare_table` compares keys: through the same text loaders and
    Arrow types it reads the source with, so that a key equals the comparison's key of the same row."""
    iceberg = arrow_schema(iceberg_table.schema())
    loaders = text_loaders([source.column(name) for name in source.primary_key], rule)
    columns = []
    for position, (name, load) in enumerate(zip(source.primary_key, loaders, strict=True)):
        values = [None if text is None else load(text.encode()) for text in (row[position] for row in texts)]
        columns.append(arrow_column(values, iceberg.field(name).type, name))
    batch = pa.RecordBatch.from_arrays(columns, names=list(source.primary_key))
    return list(_row_values(batch, _normalizers(batch.schema)))


def _source_rows_estimate(conn: psycopg.Connection, source: SourceTable) -> int:
    """The planner's row count of the table (of its leaf partitions for a partitioned one; 0 when
    never analyzed)."""
    row = conn.execute(
        "SELECT coalesce(sum(greatest(reltuples, 0)), 0)::bigint FROM pg_catalog.pg_class WHERE oid = ANY(%s)",
        (row_holders(conn, source.oid),),
    ).fetchone()
    return int(row[0]) if row else 0


def print_diffs(diffs: Sequence[TableDiff]) -> bool:
    """Print a verify report (``only_in_pg == -1`` marks a table with no Iceberg table); True when every
    table matches."""
    ok = True
    for diff in diffs:
        if diff.only_in_pg == -1:
            print(f"{diff.table}: MISSING (no Iceberg table)")
            ok = False
            continue
        if diff.not_compared:
            print(f"{diff.table}: NOT COMPARED: {diff.not_compared}")
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
