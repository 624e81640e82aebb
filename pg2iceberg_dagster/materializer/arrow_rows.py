"""Folded rows as the Arrow table Spark merges: typed like the Iceberg table (in the types Spark
can read), with the ``OP_COLUMN`` and ``UNCHANGED_COLUMN`` columns the MERGE statement reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa
from pyiceberg.table import Table

from ..config import OutOfRange
from ..iceberg.types import arrow_column, arrow_schema, text_loaders
from ..staging.codec import DELETE
from .change_stamp import without_fields
from .fold import FoldedRow, FoldResult
from .spark_sql import OP_COLUMN, UNCHANGED_COLUMN


def spark_type(arrow_type: pa.DataType) -> pa.DataType:
    """Spark reads Iceberg uuid values as strings and cannot read Parquet's UUID logical type,
    at the top level or inside a list (uuid[])."""
    if isinstance(arrow_type, pa.BaseExtensionType):
        return pa.string()
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        element = spark_type(arrow_type.value_type)
        if element != arrow_type.value_type:
            return pa.list_(pa.field(arrow_type.value_field.name, element))
    return arrow_type


def spark_value(value: Any) -> Any:
    """A Python value as it goes into a column of :func:`spark_type` (uuid -> its text)."""
    if isinstance(value, list):
        return [spark_value(item) for item in value]
    return None if value is None else str(value)


def spark_arrow_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` in the types Spark reads (see :func:`spark_type`)."""
    fields = []
    for arrow_field in schema:
        spark_field_type = spark_type(arrow_field.type)
        same = spark_field_type == arrow_field.type
        fields.append(arrow_field.remove_metadata() if same else pa.field(arrow_field.name, spark_field_type))
    return pa.schema(fields)


def folded_arrow(folded: FoldResult, table: Table, rule: OutOfRange, leave_out: Sequence[str] = ()) -> pa.Table:
    """The folded rows as Arrow, typed like the Iceberg table (values it cannot hold mapped by
    ``rule``), with the ``OP_COLUMN`` and ``UNCHANGED_COLUMN``; the columns ``leave_out`` names (no
    source columns) are not among them."""
    return rows_arrow(folded.rows.values(), table, rule, leave_out)


def rows_arrow(rows: Iterable[FoldedRow], table: Table, rule: OutOfRange, leave_out: Sequence[str] = ()) -> pa.Table:
    """``rows`` as Arrow (see :func:`folded_arrow`), in their order (a key may have several)."""
    iceberg_arrow = without_fields(arrow_schema(table.schema()), leave_out)
    spark_schema = spark_arrow_schema(iceberg_arrow)
    columns = [field.name for field in iceberg_arrow]
    # Keyed by identity: hashing a relation (every column and type) once per row costs more than the fold.
    loaders_by_relation: dict[int, dict[str, Callable[[bytes], Any]]] = {}
    values: dict[str, list[Any]] = {name: [] for name in columns}
    ops: list[str] = []
    unchanged: list[list[str]] = []
    for row in rows:
        relation = row.relation
        if relation is not None and id(relation) not in loaders_by_relation:
            loaders_by_relation[id(relation)] = dict(
                zip((c.name for c in relation.columns), text_loaders(relation.columns, rule), strict=True)
            )
        loaders = loaders_by_relation.get(id(relation), {})
        missing = [name for name in columns if name not in row.data and name not in row.unchanged]
        for name in columns:
            text = row.data.get(name)
            loader = loaders.get(name)
            if name in row.filled:
                values[name].append(row.filled[name])
            elif text is None or loader is None:
                values[name].append(None)
            else:
                values[name].append(loader(text.encode()))
        ops.append(row.op)
        unchanged.append(sorted((row.unchanged - row.filled.keys()) | (set(missing) if row.op != DELETE else set())))
    arrays = []
    for iceberg_field, spark_field in zip(iceberg_arrow, spark_schema, strict=True):
        column_values = values[iceberg_field.name]
        if spark_field.type != iceberg_field.type:
            column_values = [None if v is None else spark_value(v) for v in column_values]
        arrays.append(arrow_column(column_values, spark_field.type, iceberg_field.name))
    arrays.append(pa.array(ops, pa.string()))
    arrays.append(pa.array(unchanged, pa.list_(pa.string())))
    schema = spark_schema.append(pa.field(OP_COLUMN, pa.string())).append(
        pa.field(UNCHANGED_COLUMN, pa.list_(pa.string()))
    )
    return pa.Table.from_arrays(arrays, schema=schema)
