"""The snapshot's Arrow reader (binary COPY through ADBC) against the text path verify uses.

Both read the same rows; the text path parses PostgreSQL's text form with psycopg's loaders, as
the WAL path does. Any value the two decode differently would make a snapshot disagree with the
changes replayed after it, so they must agree exactly, on awkward values above all.
"""

from __future__ import annotations

import math
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from pg2iceberg_dagster.coordination.records import Chunk
from pg2iceberg_dagster.errors import Pg2IcebergError
from pg2iceberg_dagster.iceberg.types import arrow_schema, iceberg_schema
from pg2iceberg_dagster.snapshot.chunks import read_chunk
from pg2iceberg_dagster.snapshot.reader import ArrowReader
from pg2iceberg_dagster.source.catalog import SourceTable, TypeResolver, describe_table
from pg2iceberg_dagster.verify import copy_rows

from .conftest import SourceDb

EDGE_TYPES = """
CREATE TYPE mood AS ENUM ('sad', 'ok');
CREATE DOMAIN short_text AS varchar(10);
CREATE TABLE public.edge (
    id int PRIMARY KEY, c_oid oid, c_real real, c_double double precision, c_char char(6), c_name name,
    c_short short_text, c_numeric numeric(12, 3), c_numeric_array numeric(8, 2)[], c_real_array real[],
    c_enum_array mood[], c_uuid_array uuid[], c_ts_array timestamptz[], c_bool_array boolean[],
    c_bytea_array bytea[], c_interval interval, c_json json, c_money money, c_bit bit(4), c_int_range int4range,
    c_time time, c_empty_array int[], c_inet inet, c_inet_array inet[], c_cidr cidr, c_jsonb jsonb,
    c_interval_array interval[]
);
INSERT INTO public.edge VALUES
    (1, 4000000000, 248413.11, 'NaN', 'ab', 'a name', 'dom', -0.001, '{1.50,NULL,-2.25}', '{0.1,-Infinity}',
     '{ok,sad}', '{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}', '{"2024-06-01 00:00:00.000001+05:30"}', '{t,f,NULL}',
     '{"\\\\x00ff",NULL}', '-1 year 2 mons 00:00:00.5', '{"k": [1, "two"]}', 12.34, B'1010', '[1,10)',
     '24:00:00', '{}', '10.1.2.3', '{10.1.2.3,NULL,::1/128,10.0.0.0/8}', '10.0.0.0/8',
     '{"b": 1.50, "a": [null, "é"]}', '{"1 day",NULL,"-00:00:01"}'),
    (2, 0, 'Infinity', -0.0, NULL, '', NULL, 99999999.999, '{}', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
     NULL, NULL, 'empty', NULL, NULL, NULL, NULL, NULL, NULL, NULL),
    (3, NULL, NULL, 1e-308, '      ', 'x', 'tab	nl', NULL, NULL, '{}', '{}', '{}', '{}', '{}', '{}', '0',
     'null', -0.01, B'0000', '(,)', '00:00', NULL, '::1', '{}', '::/0', 'null', '{}');
"""


def _comparable(rows: pa.Table) -> list[dict[str, Any]]:
    """Rows by id with NaN spelled out (NaN never equals itself)."""
    return [
        {name: "NaN" if isinstance(value, float) and math.isnan(value) else value for name, value in row.items()}
        for row in rows.sort_by("id").to_pylist()
    ]


def _describe(source: SourceDb, name: str) -> SourceTable:
    config = source.config([f"public.{name}"])
    with psycopg.connect(source.conninfo) as conn:
        return describe_table(conn, config.tables[0], TypeResolver(conn))


def test_binary_reader_agrees_with_the_text_path_on_awkward_values(source: SourceDb) -> None:
    source.execute(EDGE_TYPES)
    table = _describe(source, "edge")
    schema = arrow_schema(iceberg_schema(table.columns, table.primary_key))
    config = source.config(["public.edge"])
    with ArrowReader(config.source) as reader:
        binary = read_chunk(reader, table, Chunk("public.edge", 0, 0, None), schema, None, "clamp")
    with psycopg.connect(source.conninfo) as conn:
        text = copy_rows(conn, table, schema, "clamp")
    assert binary.schema == text.schema
    assert _comparable(binary) == _comparable(text)
    by_id = {row["id"]: row for row in binary.to_pylist()}
    assert by_id[1]["c_oid"] == 4_000_000_000  # above 2^31: read as bigint, not a signed 32-bit number
    assert by_id[1]["c_real"] == 248413.109375  # the exact single-precision value
    assert by_id[1]["c_char"] == "ab    "  # char(n) keeps its padding
    assert by_id[1]["c_enum_array"] == ["ok", "sad"]
    assert by_id[3]["c_short"] == "tab\tnl"
    assert by_id[1]["c_inet"] == "10.1.2.3"  # the output function's form (inet::text says 10.1.2.3/32)
    assert by_id[1]["c_inet_array"] == ["10.1.2.3", None, "::1", "10.0.0.0/8"]
    assert by_id[1]["c_jsonb"] == '{"a": [null, "é"], "b": 1.50}'  # jsonb's own form: keys sorted
    assert by_id[1]["c_interval_array"] == ["1 day", None, "-00:00:01"]
    assert by_id[2]["c_jsonb"] is None and by_id[3]["c_jsonb"] == "null"  # SQL NULL is not JSON null


def test_a_failed_read_leaves_the_reader_usable(source: SourceDb) -> None:
    """Each thread reuses its connection from read to read; one a read failed on is not reused (it
    would be stuck in the aborted transaction)."""
    config = source.config(["public.any"])
    with ArrowReader(config.source) as reader:
        with pytest.raises(Pg2IcebergError, match="division by zero"):
            reader.read(sql.SQL("SELECT 1 / 0 AS x"), None)
        assert reader.read(sql.SQL("SELECT 1 AS one"), None).column("one").to_pylist() == [1]
        assert reader.read(sql.SQL("SELECT 2 AS two"), None).column("two").to_pylist() == [2]
