"""PostgreSQL -> Iceberg types, and PostgreSQL text values -> Arrow columns for those types.

Native Iceberg types are used wherever one exists and Spark can read it:

=====================================  ====================================
PostgreSQL                             Iceberg
=====================================  ====================================
smallint, integer                      int
bigint, oid                            long
real / double precision                float / double
numeric(p, s), p <= 38                 decimal(p, s)
boolean                                boolean
text, varchar(n), char(n), name        string
bytea                                  binary
date                                   date
timestamp / timestamptz                timestamp / timestamptz
uuid                                   uuid
T[] (declared with one dimension)      list<T>
T[][] (declared with more)             string (PostgreSQL's text form)
json, jsonb, xml, enums, interval,     string (PostgreSQL's text form)
inet, cidr, macaddr, money, bit,
ranges, composites, geometric, ...
time, timetz                           string (Spark has no time type and
                                       refuses tables that have one)
numeric without precision              string (exact: no fixed scale fits)
=====================================  ====================================

Refused: numeric with precision above 38 or a negative scale, and pseudo types.

Values these types cannot hold (infinite or BC dates and timestamps, years after 9999, numeric NaN,
a multi-dimensional value in a list column) follow one configurable rule: ``iceberg/values.py``.

The WAL path (pgoutput text tuples) and ``verify`` (COPY text rows) parse PostgreSQL's text form with
psycopg's text loaders. The snapshot reads binary COPY through ADBC, and the text form for the types
stored as strings (``snapshot/reader.py``); a test holds both decodings equal.
"""

from __future__ import annotations

import itertools
import struct
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pyarrow as pa
from psycopg.pq import Format
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IcebergType,
    IntegerType,
    ListType,
    LongType,
    NestedField,
    StringType,
    TimestampType,
    TimestamptzType,
    UUIDType,
)

from ..config import OutOfRange
from ..errors import UnsupportedTypeError
from ..source.catalog import TEXT_ARRAY_OID, TEXT_OID, PgType, SourceColumn
from .values import RULED_KINDS, conform_dimensions, conform_text

MAX_DECIMAL_PRECISION = 38

_NATIVE: dict[str, Callable[[], IcebergType]] = {
    "int2": IntegerType,
    "int4": IntegerType,
    "int8": LongType,
    "oid": LongType,
    "float4": FloatType,
    "float8": DoubleType,
    "bool": BooleanType,
    "text": StringType,
    "varchar": StringType,
    "bpchar": StringType,
    "name": StringType,
    "bytea": BinaryType,
    "date": DateType,
    "timestamp": TimestampType,
    "timestamptz": TimestamptzType,
    "uuid": UUIDType,
}


def _numeric_precision_scale(type_mod: int) -> tuple[int, int] | None:
    if type_mod < 4:
        return None
    packed = type_mod - 4
    scale = packed & 0x7FF
    if scale & 0x400:  # PostgreSQL 15 stores the scale as an 11-bit signed number
        scale -= 0x800
    return (packed >> 16) & 0xFFFF, scale


def _is_native(pg_type: PgType) -> bool:
    if pg_type.kind == "numeric":
        return _numeric_precision_scale(pg_type.type_mod) is not None
    return pg_type.kind in _NATIVE


def field_ids(after: int) -> Callable[[], int]:
    """Hands out field ids ``after + 1``, ``after + 2``, ... (list element ids need their own)."""
    return itertools.count(after + 1).__next__


def iceberg_type(pg_type: PgType, column: str, element_ids: Callable[[], int]) -> IcebergType:
    """The Iceberg type for a column; ``element_ids`` hands out field ids for list elements."""
    if pg_type.kind == "pseudo":
        raise UnsupportedTypeError(f"column {column}: pseudo type {pg_type.name} cannot be replicated")
    if is_list(pg_type):
        assert pg_type.element is not None
        element = iceberg_type(pg_type.element, column, element_ids)
        return ListType(element_id=element_ids(), element_type=element, element_required=False)
    if pg_type.kind == "numeric":
        precision_scale = _numeric_precision_scale(pg_type.type_mod)
        if precision_scale is None:
            return StringType()
        precision, scale = precision_scale
        if precision > MAX_DECIMAL_PRECISION or scale < 0:
            raise UnsupportedTypeError(
                f"column {column}: {pg_type.name} does not fit Iceberg decimal (precision <= 38, scale >= 0); "
                "alter the column to numeric(38, s) or drop the precision to replicate it as text"
            )
        return DecimalType(precision, scale)
    factory = _NATIVE.get(pg_type.kind)
    return factory() if factory else StringType()


def is_list(pg_type: PgType) -> bool:
    """An array stored as an Iceberg list: one declared with at most one dimension (``int[]``)."""
    return pg_type.kind == "array" and pg_type.dimensions <= 1


def loader_oid(pg_type: PgType) -> int:
    """The type whose psycopg text loader parses this column's text form."""
    if pg_type.kind == "array":
        if not is_list(pg_type):
            return TEXT_OID
        assert pg_type.element is not None
        return pg_type.element.array_oid if _is_native(pg_type.element) else TEXT_ARRAY_OID
    return pg_type.base_oid if _is_native(pg_type) else TEXT_OID


def iceberg_schema(columns: Sequence[SourceColumn], primary_key: Sequence[str]) -> Schema:
    """An Iceberg schema for source columns, with the primary key as identifier fields."""
    element_ids = field_ids(len(columns))
    fields = []
    for field_id, column in enumerate(columns, start=1):
        required = column.name in primary_key
        fields.append(
            NestedField(field_id, column.name, iceberg_type(column.type, column.name, element_ids), required=required)
        )
    identifier_ids = [field.field_id for field in fields if field.name in primary_key]
    for field in fields:
        if field.field_id in identifier_ids and (
            isinstance(field.field_type, (FloatType, DoubleType)) or not field.field_type.is_primitive
        ):
            raise UnsupportedTypeError(
                f"primary key column {field.name} maps to Iceberg {field.field_type}, which Iceberg cannot take as "
                "a key (no float, double or nested identifier field); set tables[].primary_key to other unique "
                "columns (with REPLICA IDENTITY FULL), or change the column's type"
            )
    return Schema(*fields, identifier_field_ids=identifier_ids)


def text_loaders(columns: Sequence[SourceColumn], rule: OutOfRange) -> list[Callable[[bytes], Any]]:
    """psycopg text loaders, one per column, turning PostgreSQL text into Python values, with values
    Iceberg cannot hold mapped by ``rule`` (``iceberg/values.py``)."""
    return [_column_loader(column.type, rule) for column in columns]


def _psycopg_loader(oid: int) -> Callable[[bytes], Any]:
    loader_class = psycopg.adapters.get_loader(oid, Format.TEXT)
    if loader_class is None:
        loader_class = psycopg.adapters.get_loader(TEXT_OID, Format.TEXT)
    return loader_class(oid, None).load  # type: ignore[misc]


def _column_loader(pg_type: PgType, rule: OutOfRange) -> Callable[[bytes], Any]:
    load = _psycopg_loader(loader_oid(pg_type))
    if pg_type.kind == "float4":
        return _single_precision(load)
    if is_ruled(pg_type):
        return _ruled(pg_type.kind, load, rule)
    if not is_list(pg_type):
        return load
    assert pg_type.element is not None
    if is_ruled(pg_type.element):
        # Elements the rule may change: split as text[], then each element through the rule.
        load_texts = _psycopg_loader(TEXT_ARRAY_OID)
        load_element = _ruled(pg_type.element.kind, _psycopg_loader(loader_oid(pg_type.element)), rule)

        def load_ruled_elements(data: bytes) -> Any:
            texts = conform_dimensions(load_texts(data), rule)
            return None if texts is None else [None if t is None else load_element(t.encode()) for t in texts]

        return load_ruled_elements

    def load_list(data: bytes) -> Any:
        return conform_dimensions(load(data), rule)

    return load_list


def is_ruled(pg_type: PgType) -> bool:
    """Values of this type may be ones Iceberg cannot hold (``iceberg/values.py``)."""
    return pg_type.kind in RULED_KINDS and _is_native(pg_type)


def _ruled(kind: str, load: Callable[[bytes], Any], rule: OutOfRange) -> Callable[[bytes], Any]:
    def load_ruled(data: bytes) -> Any:
        text = conform_text(kind, data.decode(), rule)
        return None if text is None else load(text.encode())

    return load_ruled


def _single_precision(load: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A ``real`` keeps its exact single-precision value, also once Iceberg widened the column to
    double: PostgreSQL's real -> double cast is exact, while parsing the short text form of a real
    (``248413.11``) as a double gives a different number than the cast (``248413.109375``)."""

    def load_single(data: bytes) -> Any:
        return struct.unpack("f", struct.pack("f", load(data)))[0]

    return load_single


def _arrow_value(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return value.bytes
    if isinstance(value, memoryview):
        return bytes(value)
    return value


def _needs_value_conversion(arrow_type: pa.DataType) -> bool:
    return (
        isinstance(arrow_type, pa.BaseExtensionType)
        or pa.types.is_binary(arrow_type)
        or pa.types.is_large_binary(arrow_type)
    )


def arrow_column(values: list[Any], arrow_type: pa.DataType, column: str) -> pa.Array:
    """Python values -> an Arrow array of ``arrow_type``, with the column named in any error."""
    if (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and _needs_value_conversion(
        arrow_type.value_type
    ):
        # pyarrow cannot build a list of extension values (uuid[]) from Python objects: build the
        # elements on their own, then the list around them.
        lengths = [0 if value is None else len(value) for value in values]
        offset_type = pa.int64() if pa.types.is_large_list(arrow_type) else pa.int32()
        offsets = pa.array([0, *itertools.accumulate(lengths)], type=offset_type)
        elements = arrow_column(
            [item for value in values if value is not None for item in value], arrow_type.value_type, column
        )
        mask = pa.array([value is None for value in values], type=pa.bool_())
        list_class = pa.LargeListArray if pa.types.is_large_list(arrow_type) else pa.ListArray
        return list_class.from_arrays(offsets, elements, type=arrow_type, mask=mask)
    if _needs_value_conversion(arrow_type):
        values = [None if value is None else _arrow_value(value) for value in values]
    try:
        if isinstance(arrow_type, pa.BaseExtensionType):
            storage = pa.array(values, type=arrow_type.storage_type)
            return pa.ExtensionArray.from_storage(arrow_type, storage)
        return pa.array(values, type=arrow_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
        raise UnsupportedTypeError(f"column {column}: value cannot be stored as {arrow_type}: {exc}") from None


def arrow_schema(schema: Schema) -> pa.Schema:
    """The Arrow schema pyiceberg writes for an Iceberg schema (field ids included)."""
    return schema_to_pyarrow(schema)


def as_table_rows(schema: Schema, rows: pa.Table) -> pa.Table:
    """``rows`` (columns by name, typed for Iceberg) in ``schema``'s Arrow schema: its field order, each
    column cast to its field's type, and NULL for a column ``rows`` lacks (dropped at the source, kept
    by Iceberg)."""
    target = arrow_schema(schema)
    present = set(rows.column_names)
    columns = [
        rows.column(field.name).cast(field.type) if field.name in present else pa.nulls(rows.num_rows, field.type)
        for field in target
    ]
    return pa.Table.from_arrays(columns, schema=target)
