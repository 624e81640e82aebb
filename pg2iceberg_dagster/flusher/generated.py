"""Values of ``GENERATED ALWAYS AS (...) STORED`` columns for the staged row images.

pgoutput sends no generated column before PostgreSQL 18 (from 18 on, only for a publication with
``publish_generated_columns``). A generation expression is immutable, so evaluating it later over a
row's values gives exactly the value PostgreSQL stored. The flusher computes the generated columns a
Relation message lacks, for every staged INSERT and UPDATE image, with one query in the source
database per staged file: the staged log holds complete rows, and the materializer sees ordinary
columns.

An UPDATE leaves unchanged TOASTed values out of its image, so a generated column reading one cannot
be evaluated from it. Its value is read from the source row by primary key instead: a later state of
the row, but every later change of the row comes through the WAL as well and is staged after this
one, so the mirror converges to the source. A row gone meanwhile (deleted, or its key changed) is
deleted by such a later change: its generated value is left to the merge like an unchanged TOAST value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from ..source.catalog import (
    Attribute,
    SourceColumn,
    SourceTable,
    TypeResolver,
    attribute_column,
    generation_expressions,
)
from ..staging.codec import INSERT, UPDATE, join_names, split_names
from .json_text import PLAIN_TEXT_KINDS, json_string_bodies

# Aliases in the queries below. A generation expression names the table's columns unqualified, and
# the innermost scope it is evaluated in holds exactly those columns, so these never capture a name.
_ROW = sql.Identifier("pg2iceberg_row")
_INPUTS = sql.Identifier("pg2iceberg_inputs")
_VALUES = sql.Identifier("pg2iceberg_values")
_NOW = sql.Identifier("pg2iceberg_now")


@dataclass(frozen=True)
class InputColumn:
    """A column a query reads from the row images: its name in the catalog now (what generation
    expressions call it), its name in the images (the Relation message's; None when the message has
    no such column), and its declared type as SQL."""

    name: str
    wire: str | None
    type_sql: str


@dataclass(frozen=True)
class GeneratedColumn:
    """A generated column to compute: its name now, expression, declared type as SQL, the names (in
    the row images) of the columns it reads, and whether its text form never needs JSON escaping."""

    name: str
    expression: str
    type_sql: str
    inputs: frozenset[str]
    plain: bool


@dataclass(frozen=True)
class GeneratedColumns:
    """The generated columns of a table that its Relation message lacks, and how to compute them."""

    table: SourceTable
    columns: tuple[GeneratedColumn, ...]
    inputs: tuple[InputColumn, ...]
    key: tuple[InputColumn, ...] | None  # to read a row's values now (None: a key column is unknown)
    staged: tuple[SourceColumn, ...]  # the computed columns as staged files describe them
    _queries: dict[bool, sql.Composed] = field(default_factory=dict, init=False, repr=False, compare=False)

    def evaluation_query(self, skipping: bool) -> sql.Composed:
        """One row holding, per generated column, an array of its values (text) over the row images
        passed as one JSON array; ``skipping`` adds a boolean array per column: true rows get NULL,
        their expression never evaluated."""
        if skipping not in self._queries:
            self._queries[skipping] = _evaluation_query(self, skipping)
        return self._queries[skipping]

    def current_query(self) -> sql.Composed:
        """(position, then each generated column's value as text) of the source rows now having the
        keys of the row images passed as one JSON array (1-based positions)."""
        assert self.key is not None
        key = sql.SQL(" AND ").join(
            sql.SQL("{}.{} = CAST({}.data ->> {} AS {})").format(
                _NOW, sql.Identifier(k.name), _ROW, sql.Literal(k.wire), sql.SQL(k.type_sql)
            )
            for k in self.key
        )
        values = sql.SQL(", ").join(
            sql.SQL("CAST({}.{} AS text)").format(_NOW, sql.Identifier(c.name)) for c in self.columns
        )
        return sql.SQL(
            "SELECT {row}.n, {values} FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS {row}(data, n) "
            "JOIN {schema}.{table} AS {now} ON {key}"
        ).format(
            row=_ROW,
            values=values,
            schema=sql.Identifier(self.table.schema_name),
            table=sql.Identifier(self.table.table_name),
            now=_NOW,
            key=key,
        )


def _evaluation_query(generated: GeneratedColumns, skipping: bool) -> sql.Composed:
    inputs = [
        sql.SQL("CAST({} AS {}) AS {}").format(
            sql.SQL("{}.data ->> {}").format(_ROW, sql.Literal(i.wire)) if i.wire is not None else sql.NULL,
            sql.SQL(i.type_sql),
            sql.Identifier(i.name),
        )
        for i in generated.inputs
    ]
    # A generation expression may read tableoid too (PostgreSQL allows that system column).
    inputs.append(sql.SQL("CAST({} AS oid) AS tableoid").format(sql.Literal(generated.table.oid)))
    values: list[sql.Composable] = []
    aggregates: list[sql.Composable] = []
    functions: list[sql.Composable] = [sql.SQL("jsonb_array_elements(%s::jsonb)")]
    names: list[sql.Composable] = [sql.SQL("data")]
    for index, column in enumerate(generated.columns):
        value = sql.SQL("CAST(CAST(({}) AS {}) AS text)").format(sql.SQL(column.expression), sql.SQL(column.type_sql))
        if skipping:
            skip = sql.Identifier(f"skip{index}")
            value = sql.SQL("CASE WHEN {}.{} THEN NULL ELSE {} END").format(_ROW, skip, value)
            functions.append(sql.SQL("unnest(%s::boolean[])"))
            names.append(skip)
        alias = sql.Identifier(f"v{index}")
        values.append(sql.SQL("{} AS {}").format(value, alias))
        aggregates.append(sql.SQL("array_agg({}.{} ORDER BY {}.n)").format(_VALUES, alias, _ROW))
    return sql.SQL(
        "SELECT {aggregates} FROM ROWS FROM ({functions}) WITH ORDINALITY AS {row}({names}, n) "
        "CROSS JOIN LATERAL (SELECT {values} FROM (SELECT {inputs}) AS {inputs_alias}) AS {values_alias}"
    ).format(
        aggregates=sql.SQL(", ").join(aggregates),
        functions=sql.SQL(", ").join(functions),
        row=_ROW,
        names=sql.SQL(", ").join(names),
        values=sql.SQL(", ").join(values),
        inputs=sql.SQL(", ").join(inputs),
        inputs_alias=_INPUTS,
        values_alias=_VALUES,
    )


def describe_generated(
    conn: psycopg.Connection,
    table: SourceTable,
    attributes: Sequence[Attribute],
    identities: Sequence[Attribute | None],
    wire_names: Sequence[str],
    key: Sequence[str],
    resolver: TypeResolver,
) -> GeneratedColumns | None:
    """What computes the generated columns of ``table`` (the catalog's ``attributes`` now) that a Relation
    message lacks (its columns ``wire_names``, identified as ``identities``; ``key`` in its names); None when
    it sends them all (PostgreSQL 18 with ``publish_generated_columns``) or the table has none."""
    sent = {a.attnum for a in identities if a is not None}
    if not any(a.generated and a.attnum not in sent for a in attributes):
        return None
    expressions = generation_expressions(conn, table.oid)
    missing = [a for a in attributes if a.attnum in expressions and a.attnum not in sent]
    if not missing:
        return None
    wire = {a.attnum: name for a, name in zip(identities, wire_names, strict=True) if a is not None}
    by_attnum = {a.attnum: a for a in attributes}
    read = sorted({i for a in missing for i in expressions[a.attnum].inputs if i in by_attnum})
    inputs = tuple(InputColumn(by_attnum[i].name, wire.get(i), by_attnum[i].type_sql) for i in read)
    staged = tuple(attribute_column(a, resolver) for a in missing)
    columns = tuple(
        GeneratedColumn(
            name=a.name,
            expression=expressions[a.attnum].expression,
            type_sql=a.type_sql,
            inputs=frozenset(wire[i] for i in expressions[a.attnum].inputs if i in wire),
            plain=column.type.kind in PLAIN_TEXT_KINDS,
        )
        for a, column in zip(missing, staged, strict=True)
    )
    identity = dict(zip(wire_names, identities, strict=True))
    key_inputs: tuple[InputColumn, ...] | None = ()
    for name in key:
        attribute = identity.get(name)
        if attribute is None or key_inputs is None:
            key_inputs = None  # a key column the catalog cannot name: no row is read by key
            continue
        key_inputs += (InputColumn(attribute.name, name, attribute.type_sql),)
    return GeneratedColumns(table, columns, inputs, key_inputs, staged)


class GeneratedValues:
    """Computes generated columns in the source database (on an autocommit connection, so a value read
    by key is the row's latest committed state)."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn

    def complete(self, generated: GeneratedColumns, columns: list[pa.Array]) -> list[pa.Array]:
        """The six staging columns of a table's rows with the generated values added to every INSERT
        and UPDATE image (``_data``), or named in ``_unchanged_cols`` where the row is gone."""
        op, lsn, ts, xid, unchanged, data = columns
        is_image = pc.or_(pc.equal(op, INSERT), pc.equal(op, UPDATE))
        images, marks = pc.filter(data, is_image), pc.filter(unchanged, is_image)
        if len(images) == 0:
            return columns
        unevaluable = _unevaluable(generated, marks)
        # Read only: an expression runs the table owner's (IMMUTABLE-declared) functions with our role.
        with self._conn.transaction():
            self._conn.execute("SET TRANSACTION READ ONLY")
            values = self._evaluate(generated, images, unevaluable)
            left_out = self._read_current(generated, images, unevaluable, values)
        completed = _with_values(generated, images, values, left_out)
        if any(left_out):
            marks = _with_left_out(generated, marks, left_out)
        if len(images) == len(data):
            return [op, lsn, ts, xid, marks, completed]
        return [
            op,
            lsn,
            ts,
            xid,
            pc.replace_with_mask(unchanged, is_image, marks),
            pc.replace_with_mask(data, is_image, completed),
        ]

    def _evaluate(
        self, generated: GeneratedColumns, images: pa.Array, unevaluable: list[set[int]]
    ) -> list[list[str | None]]:
        """Each generated column's value (text) for each image: NULL where ``unevaluable``."""
        skipping = any(unevaluable)
        params: list[object] = [_json_array(images)]
        if skipping:
            params += [[row in rows for row in range(len(images))] for rows in unevaluable]
        row = self._conn.execute(generated.evaluation_query(skipping), params).fetchone()
        assert row is not None  # an aggregate returns one row
        return [list(values) for values in row]

    def _read_current(
        self,
        generated: GeneratedColumns,
        images: pa.Array,
        unevaluable: list[set[int]],
        values: list[list[str | None]],
    ) -> list[set[int]]:
        """Set the ``unevaluable`` values (in ``values``) from the source rows now having the images'
        keys; returns, per column, the images whose key no row has any more."""
        needed = sorted(set().union(*unevaluable))
        found: dict[int, tuple[str | None, ...]] = {}
        if needed and generated.key is not None:
            params = [_json_array(pc.take(images, pa.array(needed, pa.int64())))]
            for position, *texts in self._conn.execute(generated.current_query(), params):
                found[needed[position - 1]] = tuple(texts)
        left_out: list[set[int]] = []
        for index, rows in enumerate(unevaluable):
            left_out.append({row for row in rows if row not in found})
            for row in rows - left_out[-1]:
                values[index][row] = found[row][index]
        return left_out


def _json_array(images: pa.Array) -> str:
    """The JSON objects ``images`` as one JSON array (joined by Arrow, no Python object per row)."""
    rows = pa.ListArray.from_arrays(pa.array([0, len(images)], pa.int32()), images)
    return f"[{pc.binary_join(rows, ',')[0].as_py()}]"


def _unevaluable(generated: GeneratedColumns, marks: pa.Array) -> list[set[int]]:
    """Per generated column, the images that lack a value it reads (unchanged TOAST)."""
    rows = pc.indices_nonzero(pc.is_valid(marks))
    result: list[set[int]] = [set() for _ in generated.columns]
    for row, text in zip(rows.to_pylist(), pc.take(marks, rows).to_pylist(), strict=True):
        names = set(split_names(text))
        for index, column in enumerate(generated.columns):
            if names & column.inputs:
                result[index].add(row)
    return result


def _with_values(
    generated: GeneratedColumns, images: pa.Array, values: list[list[str | None]], left_out: list[set[int]]
) -> pa.Array:
    """``images`` (JSON objects) with each generated column's value added, except where left out."""
    pieces = []
    for index, column in enumerate(generated.columns):
        texts = pa.array(values[index], pa.string())
        if not column.plain:
            texts = json_string_bodies(texts)
        key = json.dumps(column.name)
        piece = pc.if_else(pc.is_null(texts), f",{key}:null", pc.binary_join_element_wise(f',{key}:"', texts, '"', ""))
        if left_out[index]:
            piece = pc.if_else(_mask(len(images), left_out[index]), "", piece)
        pieces.append(piece)
    added = pc.binary_join_element_wise(*pieces, "")
    inner = pc.utf8_slice_codeunits(images, 1, -1)
    # Every piece starts with a comma: an image with no other key (never seen: images hold the key)
    # takes the pieces without their first comma.
    return pc.if_else(
        pc.equal(inner, ""),
        pc.binary_join_element_wise("{", pc.utf8_slice_codeunits(added, 1), "}", ""),
        pc.binary_join_element_wise("{", inner, added, "}", ""),
    )


def _with_left_out(generated: GeneratedColumns, marks: pa.Array, left_out: list[set[int]]) -> pa.Array:
    """``_unchanged_cols`` naming the left-out generated columns too (the merge keeps what it has)."""
    names = marks.to_pylist()
    for index, column in enumerate(generated.columns):
        for row in left_out[index]:
            before = split_names(names[row]) if names[row] else ()
            names[row] = join_names([*before, column.name])
    return pa.array(names, pa.string())


def _mask(count: int, rows: set[int]) -> pa.Array:
    mask = [False] * count
    for row in rows:
        mask[row] = True
    return pa.array(mask, pa.bool_())
