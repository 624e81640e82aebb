"""Reading one CTID chunk straight into Arrow, under the exported snapshot.

The rows never become Python objects: the ADBC PostgreSQL driver (libpq, C) runs the chunk's
``SELECT`` as a binary ``COPY`` and decodes it into Arrow buffers, so a chunk costs about what the
server spends producing it. Each column is selected in a form whose Arrow decoding is exact and
then cast to the Iceberg table's Arrow type:

- native types (integers, floats, booleans, strings, bytea, dates, timestamps, uuid, and
  one-dimensional arrays of them) travel in binary and keep their exact values (a ``real`` stays
  single precision, also when Iceberg widened the column to double);
- ``numeric(p,s)`` and every type Iceberg stores as a string travel as the text their type's output
  function writes (element by element for arrays), the same text the WAL path parses: a plain
  ``::text`` cast where PostgreSQL has no cast function to text, ``format('%s', ...)`` elsewhere;
- ``oid`` is read as ``bigint`` (the driver would read it as a signed 32-bit number).

Values Iceberg cannot hold follow the configured rule (``iceberg/values.py``), as in the WAL path:
dates and timestamps in the ``SELECT`` (the driver would wrap ``infinity`` and years past 9999 around
into wrong values), numerics on their text in Arrow. The driver flattens a multi-dimensional array
value in row-major order; its number of dimensions rides along for the rule. Arrays are sliced
(``a[:]``) to lower bound 1, which the driver requires. An array column declared with more than one
dimension is read as its text form.
"""

from __future__ import annotations

import contextlib
import threading

import adbc_driver_manager
import adbc_driver_postgresql.dbapi as adbc
import pyarrow as pa
from psycopg import sql

from ..config import OutOfRange, PostgresConnection
from ..errors import Pg2IcebergError, UnsupportedTypeError
from ..iceberg.types import is_list, is_ruled
from ..iceberg.values import TIME_KINDS, conform_flattened, conform_sql, conform_texts
from ..source.catalog import PgType, SourceColumn, SourceTable
from ..source.connection import SESSION_OPTIONS
from ..source.policy import ColumnMask
from ..threads import PerThread

# Kinds the driver decodes natively; everything else is selected as text.
_BINARY_KINDS = {
    "int2",
    "int4",
    "int8",
    "float4",
    "float8",
    "bool",
    "text",
    "varchar",
    "bpchar",
    "bytea",
    "date",
    "timestamp",
    "timestamptz",
    "uuid",
}
# Built-in types with no cast function to text: for them ``::text`` is the output function, and a
# cheaper one for the server than format('%s') with its NULL guard.
_TEXT_CAST_IS_OUTPUT = {
    "numeric",
    "json",
    "jsonb",
    "interval",
    "time",
    "timetz",
    "money",
    "macaddr",
    "macaddr8",
    "bit",
    "varbit",
}
_NDIMS_PREFIX = "__pg2iceberg_ndims_"


def _output_text(value: sql.Composable) -> sql.Composable:
    """The value's text form from its type's output function, NULL kept. ``::text`` is not that for
    every type: an explicit cast may differ (``inet::text`` adds ``/32``, ``bool::text`` says ``true``)."""
    return sql.SQL("CASE WHEN {0} IS NULL THEN NULL ELSE pg_catalog.format('%s', {0}) END").format(value)


def _cast_target(kind: str) -> sql.Composable | None:
    """The type a value of ``kind`` is cast to so that the driver decodes it exactly; None when only
    ``format('%s')`` gives its output function's text."""
    if kind in _BINARY_KINDS:
        # Casting to the base type itself is a relabel: it strips domains and keeps char(n) padding.
        return sql.Identifier("pg_catalog", kind)
    if kind == "oid":
        return sql.SQL("pg_catalog.int8")
    if kind in _TEXT_CAST_IS_OUTPUT:
        return sql.SQL("pg_catalog.text")
    return None


def _select_expression(name: sql.Identifier, pg_type: PgType, rule: OutOfRange) -> sql.Composable:
    """How a column is selected so that the driver decodes it exactly, with the rule applied."""
    if pg_type.kind == "array" and is_list(pg_type):
        assert pg_type.element is not None
        kind = pg_type.element.kind
        target = _cast_target(kind)
        if target is not None and kind not in TIME_KINDS:
            return sql.SQL("({}::{}[])[:]").format(name, target)
        element = conform_sql(kind, sql.SQL("e.v"), rule) if kind in TIME_KINDS else _output_text(sql.SQL("e.v"))
        # Element by element, in order, NULL elements kept.
        return sql.SQL(
            "CASE WHEN {0} IS NULL THEN NULL ELSE ARRAY(SELECT {1} FROM pg_catalog.unnest({0}) "
            "WITH ORDINALITY AS e(v, n) ORDER BY e.n) END"
        ).format(name, element)
    if pg_type.kind == "array":
        return _output_text(name)
    target = _cast_target(pg_type.kind)
    if target is None:
        return _output_text(name)
    value = sql.SQL("{}::{}").format(name, target)
    return conform_sql(pg_type.kind, value, rule) if pg_type.kind in TIME_KINDS else value


def masked_expression(name: sql.Identifier, mask: ColumnMask) -> sql.Composable:
    """How a masked column is selected: ``null`` and ``redact`` masked by the server (the value never
    leaves it), ``hash`` as the text the client hashes (the same text the WAL carries)."""
    if mask.policy == "null":
        return sql.SQL("NULL::pg_catalog.text")
    if mask.policy == "redact":
        return sql.SQL("CASE WHEN {} IS NULL THEN NULL ELSE {} END").format(name, sql.Literal(mask.text("")))
    return _output_text(name)


def select_expressions(source: SourceTable, rule: OutOfRange) -> sql.Composed:
    """The chunk query's select list: each mirrored column in a form decoded exactly (masked ones as
    :func:`masked_expression` says), plus array dimensions."""
    expressions: list[sql.Composable] = []
    for position, column in enumerate(source.columns):
        name = sql.Identifier(column.name)
        mask = source.mask_of(column.name)
        selected = masked_expression(name, mask) if mask else _select_expression(name, column.type, rule)
        expressions.append(sql.SQL("{} AS {}").format(selected, name))
        if is_list(column.type):
            expressions.append(
                sql.SQL("pg_catalog.array_ndims({}) AS {}").format(name, sql.Identifier(f"{_NDIMS_PREFIX}{position}"))
            )
    return sql.SQL(", ").join(expressions)


def _storage_type(decoded: pa.DataType) -> pa.DataType:
    """``decoded`` with every extension type in it (the driver's ``uuid``, also as a list's element)
    replaced by its storage type: the cast to the Iceberg type starts from the plain values."""
    if isinstance(decoded, pa.BaseExtensionType):
        return _storage_type(decoded.storage_type)
    if pa.types.is_list(decoded):
        return pa.list_(decoded.value_field.with_type(_storage_type(decoded.value_type)))
    if pa.types.is_large_list(decoded):
        return pa.large_list(decoded.value_field.with_type(_storage_type(decoded.value_type)))
    return decoded


def _conform(values: pa.ChunkedArray, target: pa.DataType, column: str) -> pa.ChunkedArray:
    """Cast a decoded column to the Iceberg table's Arrow type, naming the column in any error."""
    storage = _storage_type(values.type)
    if storage != values.type:  # the same buffers, read as their storage type (no copy)
        values = pa.chunked_array([chunk.view(storage) for chunk in values.chunks], type=storage)
    try:
        if isinstance(target, pa.BaseExtensionType):
            storage = values.cast(target.storage_type)
            return pa.chunked_array(
                [pa.ExtensionArray.from_storage(target, chunk) for chunk in storage.chunks], type=target
            )
        return values.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise UnsupportedTypeError(f"column {column}: value cannot be stored as {target}: {exc}") from None


def _ruled(decoded: pa.Table, position: int, column: SourceColumn, rule: OutOfRange) -> pa.ChunkedArray:
    """A decoded column with the rule applied where Arrow applies it: numerics (on their text) and the
    dimensions of list values."""
    values = decoded.column(column.name)
    pg_type = column.type
    if is_list(pg_type):
        assert pg_type.element is not None
        dimensions = decoded.column(f"{_NDIMS_PREFIX}{position}")
        values = pa.chunked_array(
            [conform_flattened(v, d, rule) for v, d in zip(values.chunks, dimensions.chunks, strict=True)],
            type=values.type,
        )
        pg_type = pg_type.element
    if pg_type.kind == "numeric" and is_ruled(pg_type):
        values = pa.chunked_array([conform_texts("numeric", chunk, rule) for chunk in values.chunks], type=values.type)
    return values


def conform(decoded: pa.Table, source: SourceTable, schema: pa.Schema, rule: OutOfRange) -> pa.Table:
    """The decoded chunk as a table of ``schema`` (columns the source no longer has are null)."""
    by_name = {column.name: (position, column) for position, column in enumerate(source.columns)}
    arrays = []
    for field in schema:
        if field.name in by_name:
            position, column = by_name[field.name]
            mask = source.mask_of(column.name)
            if mask is not None and mask.policy == "hash":
                masked = pa.chunked_array([mask.texts(decoded.column(column.name))])
                arrays.append(_conform(masked, field.type, field.name))
                continue
            arrays.append(_conform(_ruled(decoded, position, column, rule), field.type, field.name))
        else:
            arrays.append(pa.nulls(decoded.num_rows, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


class ArrowReader:
    """Runs chunk queries into Arrow over one ADBC database handle, from any number of threads.

    Setting up the driver's database handle loads the server's type catalog (about 50 ms of CPU and
    a round of queries), and a new connection costs the server a backend, so one handle serves the
    whole snapshot and each thread keeps its connection from read to read. Every read is its own
    transaction, ended before the next (between reads the connection is idle, not in a
    transaction). Close the reader when the snapshot is done.
    """

    def __init__(self, target: PostgresConnection) -> None:
        self.target = target
        self._template: adbc.Connection | None = None
        self._template_lock = threading.Lock()
        self._connections = PerThread(self._clone)  # each thread's, kept from read to read

    def __enter__(self) -> ArrowReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _clone(self) -> adbc.Connection:
        """A new connection sharing the database handle (made on first use)."""
        with self._template_lock:
            if self._template is None:
                self._template = adbc.connect(self.target.conninfo(options=SESSION_OPTIONS))
            return self._template.adbc_clone()

    def read(self, query: sql.Composable, snapshot_name: str | None) -> pa.Table:
        """Run ``query`` in a READ ONLY REPEATABLE READ transaction (importing ``snapshot_name`` when
        given) and return its rows as Arrow, decoded by the ADBC driver."""
        try:
            connection = self._connections()
            with connection.cursor() as cursor:
                # The driver begins a transaction with the first statement: these come first.
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                if snapshot_name:
                    cursor.execute(
                        sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)).as_string()
                    )
                cursor.execute(query.as_string())
                rows = cursor.fetch_arrow_table()
            connection.rollback()
            return rows
        except adbc_driver_manager.Error as exc:
            # Dropped after an error; this thread's next read opens a new one.
            failed = self._connections.discard()
            if failed is not None:
                with contextlib.suppress(adbc_driver_manager.Error):
                    failed.close()
            # libpq's message names the server, never the password; keep only its first line.
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise Pg2IcebergError(f"reading a snapshot chunk from {self.target.describe()} failed: {reason}") from None

    def close(self) -> None:
        """Close every connection and the database handle."""
        with self._template_lock:
            for connection in [*self._connections.opened(), self._template]:
                if connection is not None:
                    with contextlib.suppress(adbc_driver_manager.Error):
                        connection.close()
            self._connections = PerThread(self._clone)
            self._template = None
