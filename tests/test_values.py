"""Values Iceberg cannot hold, end to end: infinite, BC and far-future dates and timestamps, numeric NaN,
float NaN/Infinity, multi-dimensional arrays. The snapshot, the merge and ``verify`` all apply the
configured rule (``values.out_of_range``); the expected rows are computed from the live source by
SQL written here, independently of the pipeline's code."""

from __future__ import annotations

import math
from typing import Any

import psycopg
import pytest

from pg2iceberg_dagster.config import OutOfRange
from pg2iceberg_dagster.coordination.records import Chunk
from pg2iceberg_dagster.errors import UnsupportedTypeError
from pg2iceberg_dagster.iceberg.types import arrow_schema, iceberg_schema
from pg2iceberg_dagster.snapshot.chunks import read_chunk
from pg2iceberg_dagster.snapshot.reader import ArrowReader
from pg2iceberg_dagster.source.catalog import TypeResolver, describe_table
from pg2iceberg_dagster.verify import copy_rows

from .conftest import SourceDb, assert_mirrored, sync

TABLE = """
CREATE TABLE public.edges (
    id int PRIMARY KEY, d date, ts timestamp, tz timestamptz, n numeric(6, 2), free numeric,
    f4 real, f8 double precision, days date[], stamps timestamptz[], prices numeric(6, 2)[],
    ints int[], grid int[][], v text
)
"""
# Rows 1-2 are proleptic values Iceberg holds exactly (year 1, a leap day before 1582).
ROWS = """
INSERT INTO public.edges VALUES
    ({0}, '0001-01-01', '0001-01-01 00:00:00', '0001-01-01 00:00:00+00', 1.5, 1.5, 1.5, 1.5, '{{1200-02-29}}',
     '{{"1500-02-28 12:00:00+00"}}', '{{1.5}}', '{{1,2}}', '{{{{1,2}},{{3,4}}}}', 'a'),
    ({1}, '1200-02-29', '9999-12-31 23:59:59.999999', '9999-12-31 23:59:59.999999+00', -9999.99, 'NaN', 'NaN',
     'NaN', '{{}}', '{{}}', '{{}}', '{{}}', '{{}}', 'b'),
    ({2}, 'infinity', 'infinity', 'infinity', 'NaN', 'Infinity', 'Infinity', 'Infinity',
     '{{infinity,NULL,2020-01-01}}', '{{-infinity}}', '{{NaN,NULL}}', '{{{{1,2}},{{3,NULL}}}}', '{{5,6}}', 'c'),
    ({3}, '-infinity', '-infinity', '-infinity', NULL, '-Infinity', '-Infinity', '-Infinity',
     '{{{{0044-03-15 BC}},{{10000-01-01}}}}', NULL, NULL, '[0:1]={{7,8}}', '{{{{{{1}}}}}}', 'd'),
    ({4}, '0044-03-15 BC', '0044-03-15 12:00:00 BC', '4713-01-01 00:00:00+00 BC', 0, '-0', '-0', '-0',
     NULL, NULL, NULL, '{{{{{{1}},{{2}}}}}}', '[2:3]={{1,2}}', 'e'),
    ({5}, '10000-01-01', '12345-06-07 08:09:10', '294276-12-31 23:59:59+00', 9999.99, NULL, NULL, NULL,
     NULL, NULL, NULL, NULL, NULL, 'f')
"""


def _expected_sql(rule: OutOfRange) -> str:
    """The source's rows as the rule documents them, by SQL of its own."""
    low = {"d": "'0001-01-01'", "ts": "'0001-01-01 00:00:00'", "tz": "'0001-01-01 00:00:00+00'"}
    high = {"d": "'9999-12-31'", "ts": "'9999-12-31 23:59:59.999999'", "tz": "'9999-12-31 23:59:59.999999+00'"}
    kind = {"d": "date", "ts": "timestamp", "tz": "timestamptz"}

    def ruled(column: str, value: str) -> str:
        t = kind[column]
        below = f"{low[column]}::{t}" if rule == "clamp" else "NULL"
        above = f"{high[column]}::{t}" if rule == "clamp" else "NULL"
        return (
            f"CASE WHEN {value} < {low[column]}::{t} THEN {below} "
            f"WHEN {value} > {high[column]}::{t} THEN {above} ELSE {value} END"
        )

    def one_dimension(column: str, element: str = "x") -> str:
        flattened = f"ARRAY(SELECT {element} FROM unnest({column}) WITH ORDINALITY AS u(x, o) ORDER BY o)"
        if rule == "null":
            return f"CASE WHEN {column} IS NULL OR array_ndims({column}) > 1 THEN NULL ELSE {flattened} END"
        return f"CASE WHEN {column} IS NULL THEN NULL ELSE {flattened} END"

    prices = one_dimension("prices", "CASE WHEN x = 'NaN' THEN NULL ELSE x END")
    return (
        f"SELECT id, {ruled('d', 'd')}, {ruled('ts', 'ts')}, {ruled('tz', 'tz')}, "
        "CASE WHEN n = 'NaN' THEN NULL ELSE n END, free::text, f4, f8, "
        f"{one_dimension('days', ruled('d', 'x'))}, {one_dimension('stamps', ruled('tz', 'x'))}, "
        f"{prices}, {one_dimension('ints')}, "
        "grid::text, v FROM public.edges ORDER BY id"
    )


COLUMNS = ["id", "d", "ts", "tz", "n", "free", "f4", "f8", "days", "stamps", "prices", "ints", "grid", "v"]


def _nan_aware(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, list):
        return [_nan_aware(item) for item in value]
    return value


def _expected(source: SourceDb, rule: OutOfRange) -> list[dict[str, Any]]:
    with psycopg.connect(source.conninfo, options="-c timezone=UTC") as conn:
        rows = conn.execute(_expected_sql(rule)).fetchall()
    return [{name: _nan_aware(value) for name, value in zip(COLUMNS, row, strict=True)} for row in rows]


def _comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{name: _nan_aware(row[name]) for name in COLUMNS} for row in sorted(rows, key=lambda r: r["id"])]


@pytest.mark.parametrize("rule", ["clamp", "null"])
def test_snapshot_reader_and_text_path_apply_the_rule_alike(source: SourceDb, rule: OutOfRange) -> None:
    """The snapshot's binary read and the text loaders the WAL path and verify use give the documented
    values, with no error on any of them."""
    source.execute(TABLE)
    source.execute(ROWS.format(1, 2, 3, 4, 5, 6))
    config = source.config(["public.edges"])
    with psycopg.connect(source.conninfo) as conn:
        table = describe_table(conn, config.tables[0], TypeResolver(conn))
    schema = arrow_schema(iceberg_schema(table.columns, table.primary_key))
    with ArrowReader(config.source) as reader:
        binary = read_chunk(reader, table, Chunk("public.edges", 0, 0, None), schema, None, rule)
    with psycopg.connect(source.conninfo) as conn:
        text = copy_rows(conn, table, schema, rule)
    expected = _expected(source, rule)
    assert _comparable(binary.to_pylist()) == expected
    assert _comparable(text.to_pylist()) == expected


@pytest.mark.usefixtures("spark")
@pytest.mark.parametrize("rule", ["clamp", "null"])
def test_values_iceberg_cannot_hold_replicate_by_the_rule(source: SourceDb, rule: OutOfRange) -> None:
    """Snapshot, then the same values through WAL -> staged log -> Spark MERGE (inserts, and updates
    that turn in-range values into out-of-range ones): Iceberg equals the source after the rule, and
    verify says so."""
    source.execute(TABLE)
    source.execute(ROWS.format(1, 2, 3, 4, 5, 6))
    pipeline = source.pipeline(source.config(["public.edges"], values={"out_of_range": rule}))
    pipeline.snapshot()
    source.execute(ROWS.format(11, 12, 13, 14, 15, 16))
    source.execute(
        "UPDATE public.edges SET d = 'infinity', tz = '-infinity', n = 'NaN', f8 = 'NaN', "
        "ints = '{{9,8},{7,6}}', grid = '{1}' WHERE id IN (1, 11)"
    )
    source.execute("UPDATE public.edges SET d = '2024-02-29', ints = '{3}' WHERE id IN (3, 13)")
    sync(pipeline)
    table = pipeline.catalog.load_table(f"{source.name}_public.edges")
    types = {f.name: str(f.field_type) for f in table.schema().fields}
    assert types["grid"] == "string" and types["ints"] == "list<int>" and types["free"] == "string"
    assert _comparable(table.scan().to_arrow().to_pylist()) == _expected(source, rule)
    assert_mirrored(pipeline)


def test_a_key_value_iceberg_cannot_hold_is_refused_by_the_snapshot(source: SourceDb) -> None:
    """numeric(p,s) keeps NaN, and as a key it would become NULL, which no Iceberg key holds: the
    snapshot refuses such a row by name (an Arrow error from the Parquet writer before)."""
    source.execute("CREATE TABLE public.n (id numeric(10, 2) PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.n VALUES (1.5, 'a'), ('NaN', 'nan')")
    pipeline = source.pipeline(source.config(["public.n"]))
    with pytest.raises(UnsupportedTypeError, match=r"public\.n: 1 row\(s\) hold a primary key \(id\) value"):
        pipeline.snapshot()


@pytest.mark.usefixtures("spark")
def test_a_key_value_iceberg_cannot_hold_is_refused_by_the_merge_until_mended(source: SourceDb) -> None:
    """The same value inserted later: the merge refuses it by name (it failed in Spark at every attempt
    before), and goes on once the key is mended at the source (the NaN row's delete needs no key)."""
    source.execute("CREATE TABLE public.n (id numeric(10, 2) PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.n VALUES (1.5, 'a')")
    pipeline = source.pipeline(source.config(["public.n"]))
    pipeline.snapshot()
    source.execute("INSERT INTO public.n VALUES ('NaN', 'nan'), (2, 'b')")
    pipeline.stream(until_caught_up=True)
    with pytest.raises(UnsupportedTypeError, match=r"public\.n: 1 row\(s\) hold a primary key"):
        pipeline.materialize()
    source.execute("UPDATE public.n SET id = 3 WHERE id = 'NaN'")
    sync(pipeline)
    assert_mirrored(pipeline)
    rows = pipeline.catalog.load_table(f"{source.name}_public.n").scan().to_arrow().to_pylist()
    assert sorted((str(r["id"]), r["v"]) for r in rows) == [("1.50", "a"), ("2.00", "b"), ("3.00", "nan")]
