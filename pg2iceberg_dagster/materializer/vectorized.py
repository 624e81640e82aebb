"""The fast path of folding: staged files read as Arrow, folded by key and typed with Arrow compute.

It applies to a batch of one relation whose changes all carry every column (no unchanged TOAST
values) and hold no TRUNCATE: the common case. Then the last change per key is all there is to
keep, which Arrow's group-by finds without a Python object per change. Any other batch goes through
:func:`~pg2iceberg_dagster.materializer.fold.fold`, which knows how to fill unchanged columns.

The result equals ``folded_arrow(fold(...))`` row for row (``tests/test_vectorized.py`` compares
them): the same keys, ops and typed values. Values are converted by Arrow casts only where the cast
is exactly psycopg's text loader (integers, booleans, double, numeric, text-like types); other
columns go through the loaders, but only for the folded rows.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from ..config import OutOfRange
from ..errors import UnsupportedTypeError
from ..iceberg.types import arrow_column, is_ruled, loader_oid, text_loaders
from ..iceberg.values import conform_texts
from ..source.catalog import TEXT_OID, SourceColumn
from ..staging.codec import COMMIT_LSN_COLUMN, DELETE, TRUNCATE, StagedRelation
from .fold import UPSERT
from .spark_sql import OP_COLUMN, UNCHANGED_COLUMN

# Past this, one JSON line would not fit a block of Arrow's JSON reader: use the general path.
MAX_ROW_BYTES = 256 * 1024 * 1024
_INTEGERS = frozenset({"int2", "int4", "int8", "oid"})
# psycopg loads these as the text itself (uuid: Spark reads Iceberg uuid as its canonical text form).
_TEXT_KINDS = frozenset({"text", "varchar", "bpchar", "name", "uuid"})
_EXACT_CASTS = frozenset({"float8", "numeric"})


@dataclass
class VectorFold:
    """The folded rows (Spark shape, with the ``OP_COLUMN`` and ``UNCHANGED_COLUMN``) and what they hold."""

    rows: pa.Table
    changes: int
    upserts: int
    deletes: int
    has_unchanged: bool
    # Per folded row, its last change's commit LSN and source commit time (change metadata).
    commit_lsns: pa.Array
    committed_at: pa.Array


def can_fold_vectorized(batches: Sequence[tuple[StagedRelation, pa.Table]]) -> bool:
    """One relation, no TRUNCATE, no unchanged TOAST column, no row too large for the JSON reader."""
    if not batches or any(relation != batches[0][0] for relation, _ in batches):
        return False
    for _, table in batches:
        if table.num_rows == 0:
            continue
        if table.column("_unchanged_cols").null_count != table.num_rows:
            return False
        if pc.any(pc.equal(table.column("_op"), TRUNCATE)).as_py():
            return False
        if pc.max(pc.binary_length(table.column("_data"))).as_py() >= MAX_ROW_BYTES:
            return False
    return True


def _parse_rows(data: pa.ChunkedArray, columns: Sequence[SourceColumn]) -> pa.Table:
    """The ``_data`` JSON objects as one string column per relation column (missing keys -> null)."""
    schema = pa.schema([(column.name, pa.string()) for column in columns])
    if len(data) == 0:
        return schema.empty_table()
    lines = "\n".join(data.to_pylist()).encode()
    longest = pc.max(pc.binary_length(data)).as_py() or 0
    return pa_json.read_json(
        io.BytesIO(lines),
        read_options=pa_json.ReadOptions(block_size=max(1 << 20, 2 * longest + 2)),
        parse_options=pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
    )


def typed_column(
    texts: pa.Array,
    column: SourceColumn,
    target: pa.DataType,
    name: str,
    rule: OutOfRange,
    convert: Callable[[Any], Any] | None = None,
) -> pa.Array:
    """PostgreSQL text values -> ``target``, as the column's text loader would convert them, values
    Iceberg cannot hold mapped by ``rule`` (then ``convert`` applied to each loaded value, when given)."""
    kind = column.type.kind
    try:
        textual = pa.types.is_string(target) or pa.types.is_large_string(target)
        if textual and (loader_oid(column.type) == TEXT_OID or kind in _TEXT_KINDS):
            # Text-like, text-form types and uuid (Spark reads uuid as its canonical text): no conversion.
            return texts.cast(target)
        if kind in _INTEGERS and pa.types.is_integer(target):
            return pc.cast(texts, target)
        if kind == "bool" and pa.types.is_boolean(target):
            return pc.equal(texts, "t")
        if kind in _EXACT_CASTS and (pa.types.is_float64(target) or pa.types.is_decimal(target)):
            if is_ruled(column.type):
                texts = conform_texts(kind, texts, rule)
            return pc.cast(texts, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise UnsupportedTypeError(f"column {name}: value cannot be stored as {target}: {exc}") from None
    load = text_loaders([column], rule)[0]
    values = [None if text is None else load(text.encode()) for text in texts.to_pylist()]
    if convert is not None:
        values = [None if value is None else convert(value) for value in values]
    return arrow_column(values, target, name)


def fold_vectorized(
    batches: Sequence[tuple[StagedRelation, pa.Table]],
    key: Sequence[str],
    iceberg_schema: pa.Schema,
    spark_schema: pa.Schema,
    spark_value: Callable[[Any], Any],
    rule: OutOfRange,
) -> VectorFold:
    """Keep the last change per key (log order) and type it like ``spark_schema`` (the Iceberg columns,
    ``iceberg_schema``, as Spark reads them; ``spark_value`` turns a loaded value into a column whose
    Spark type differs; values Iceberg cannot hold mapped by ``rule``), plus ``OP_COLUMN`` (U or D) and
    ``UNCHANGED_COLUMN`` (columns the change does not carry)."""
    relation = batches[0][0]
    staged = pa.concat_tables([table for _, table in batches])
    changes = staged.num_rows
    parsed = _parse_rows(staged.column("_data"), relation.columns)
    positions = pa.array(range(changes), pa.int64())
    grouped = parsed.select(list(key)).append_column("_pos", positions).group_by(list(key), use_threads=False)
    last = grouped.aggregate([("_pos", "max")]).column("_pos_max").combine_chunks()
    last = last.take(pc.sort_indices(last))  # keep log order: deterministic output
    rows = parsed.take(last)
    is_delete = pc.equal(staged.column("_op").take(last), DELETE).combine_chunks()
    if COMMIT_LSN_COLUMN in staged.column_names:
        commit_lsns = staged.column(COMMIT_LSN_COLUMN).take(last).combine_chunks()
    else:
        commit_lsns = pa.repeat(pa.scalar(0, pa.int64()), len(last))
    deletes = pc.sum(is_delete).as_py() or 0

    by_name = {column.name: column for column in relation.columns}
    arrays: list[pa.Array] = []
    missing: list[str] = []
    for iceberg_field, field in zip(iceberg_schema, spark_schema, strict=True):
        column = by_name.get(field.name)
        if column is None:
            # A column the relation does not have (dropped at the source): upserts keep the target's value.
            missing.append(field.name)
            arrays.append(pa.nulls(len(last), field.type))
            continue
        convert = spark_value if field.type != iceberg_field.type else None
        texts = rows.column(field.name).combine_chunks()
        arrays.append(typed_column(texts, column, field.type, field.name, rule, convert))
    arrays.append(pc.if_else(is_delete, DELETE, UPSERT).cast(pa.string()))
    unchanged_type = pa.list_(pa.string())
    if missing:
        upsert_unchanged = sorted(missing)
        unchanged = pa.array([[] if d else upsert_unchanged for d in is_delete.to_pylist()], unchanged_type)
    else:
        unchanged = pa.ListArray.from_arrays(pa.array([0] * (len(last) + 1), pa.int32()), pa.array([], pa.string()))
    arrays.append(unchanged)
    schema = spark_schema.append(pa.field(OP_COLUMN, pa.string())).append(pa.field(UNCHANGED_COLUMN, unchanged_type))
    return VectorFold(
        rows=pa.Table.from_arrays(arrays, schema=schema),
        changes=changes,
        upserts=len(last) - deletes,
        deletes=deletes,
        has_unchanged=bool(missing) and len(last) > deletes,
        commit_lsns=commit_lsns,
        committed_at=staged.column("_ts").take(last).combine_chunks(),
    )
