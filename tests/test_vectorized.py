"""The vectorized fold gives exactly what the change-by-change fold + typing gives, where it applies."""

from __future__ import annotations

import random
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pytest

from pg2iceberg_dagster.config import OutOfRange
from pg2iceberg_dagster.errors import UnsupportedTypeError
from pg2iceberg_dagster.iceberg.types import arrow_schema, iceberg_schema
from pg2iceberg_dagster.materializer.arrow_rows import folded_arrow, spark_arrow_schema, spark_value
from pg2iceberg_dagster.materializer.fold import fold
from pg2iceberg_dagster.materializer.spark_sql import OP_COLUMN
from pg2iceberg_dagster.materializer.vectorized import can_fold_vectorized, fold_vectorized
from pg2iceberg_dagster.source.catalog import PgType, SourceColumn
from pg2iceberg_dagster.staging import codec
from pg2iceberg_dagster.staging.codec import DELETE, INSERT, TRUNCATE, UPDATE, Change, StagedRelation, read_staged


def pg_type(name: str, kind: str, oid: int, array_oid: int = 0, type_mod: int = -1, element: Any = None) -> PgType:
    return PgType(name=name, kind=kind, type_mod=type_mod, base_oid=oid, array_oid=array_oid, element=element)


INT8 = pg_type("bigint", "int8", 20, 1016)
INT4 = pg_type("integer", "int4", 23, 1007)
INT2 = pg_type("smallint", "int2", 21, 1005)
TEXT = pg_type("text", "text", 25, 1009)
BPCHAR = pg_type("character(3)", "bpchar", 1042, 1014, type_mod=7)
BOOL = pg_type("boolean", "bool", 16, 1000)
FLOAT8 = pg_type("double precision", "float8", 701, 1022)
FLOAT4 = pg_type("real", "float4", 700, 1021)
NUMERIC = pg_type("numeric(12,2)", "numeric", 1700, 1231, type_mod=((12 << 16) | 2) + 4)
NUMERIC_FREE = pg_type("numeric", "numeric", 1700, 1231)
UUID = pg_type("uuid", "uuid", 2950, 2951)
TIMESTAMPTZ = pg_type("timestamp with time zone", "timestamptz", 1184, 1185)
DATE = pg_type("date", "date", 1082, 1182)
JSONB = pg_type("jsonb", "jsonb", 3802, 3807)
TEXT_ARRAY = pg_type("text[]", "array", 1009, 0, element=TEXT)
INT_ARRAY = pg_type("integer[]", "array", 1007, 0, element=INT4)
UUID_ARRAY = pg_type("uuid[]", "array", 2951, 0, element=UUID)
DATE_ARRAY = pg_type("date[]", "array", 1182, 0, element=DATE)
NUMERIC_ARRAY = pg_type("numeric(12,2)[]", "array", 1231, 0, element=NUMERIC)
INT_GRID = replace(INT_ARRAY, dimensions=2)

COLUMNS = (
    SourceColumn("id", INT8, True),
    SourceColumn("small", INT2, False),
    SourceColumn("n", INT4, False),
    SourceColumn("name", TEXT, False),
    SourceColumn("code", BPCHAR, False),
    SourceColumn("flag", BOOL, False),
    SourceColumn("ratio", FLOAT8, False),
    SourceColumn("single", FLOAT4, False),
    SourceColumn("price", NUMERIC, False),
    SourceColumn("exact", NUMERIC_FREE, False),
    SourceColumn("ref", UUID, False),
    SourceColumn("at", TIMESTAMPTZ, False),
    SourceColumn("day", DATE, False),
    SourceColumn("doc", JSONB, False),
    SourceColumn("tags", TEXT_ARRAY, False),
    SourceColumn("counts", INT_ARRAY, False),
    SourceColumn("refs", UUID_ARRAY, False),
    SourceColumn("days", DATE_ARRAY, False),
    SourceColumn("prices", NUMERIC_ARRAY, False),
    SourceColumn("grid", INT_GRID, False),
    SourceColumn('odd, "name" é', TEXT, False),
)
RELATION = StagedRelation("public.t", COLUMNS)
# Values Iceberg cannot hold, and the edges of what it can (text as the pipeline's sessions write it).
AWKWARD_DATES = ["infinity", "-infinity", "0044-03-15 BC", "10000-01-01", "5874897-12-31", "0001-01-01", "1200-02-29"]
AWKWARD_TIMESTAMPTZ = [
    "infinity",
    "-infinity",
    "0044-03-15 00:00:00+00 BC",
    "294276-12-31 23:59:59+00",
    "0001-01-01 00:00:00+00",
    "9999-12-31 23:59:59.999999+00",
]
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def random_row(rng: random.Random, key: int) -> dict[str, str | None]:
    def maybe(value: str) -> str | None:
        return None if rng.random() < 0.15 else value

    return {
        "id": str(key),
        "small": maybe(str(rng.randint(-32768, 32767))),
        "n": maybe(str(rng.randint(-(2**31), 2**31 - 1))),
        "name": maybe(rng.choice(["", "plain", "line\nbreak", 'quote " \\ back', "snow ☃ 😀", "x" * 300])),
        "code": maybe(rng.choice(["ab ", "xyz", "   "])),
        "flag": maybe(rng.choice(["t", "f"])),
        "ratio": maybe(rng.choice(["0.1", "-0", "1e+100", "NaN", "Infinity", "-Infinity", "5e-324", "3.14159"])),
        "single": maybe(rng.choice(["248413.11", "0.1", "NaN", "-Infinity"])),
        "price": maybe(rng.choice(["0.00", "-12.34", "9999999999.99", "1.50", "NaN"])),
        "exact": maybe(rng.choice(["1.000000000000000000001", "NaN", "-5"])),
        "ref": maybe(str(uuid.UUID(int=rng.getrandbits(128)))),
        "at": maybe(rng.choice(["2026-01-01 00:00:00+00", "1999-12-31 23:59:59.123456+05:30", *AWKWARD_TIMESTAMPTZ])),
        "day": maybe(rng.choice(["2020-02-29", "1970-01-01", *AWKWARD_DATES])),
        "doc": maybe('{"k": [1, 2], "s": "v"}'),
        "tags": maybe(rng.choice(["{}", '{a,"b c",NULL}', '{"x\\"y"}'])),
        "counts": maybe(rng.choice(["{}", "{1,2,NULL}", "{{1,2},{3,NULL}}", "[0:1]={5,6}"])),
        "refs": maybe(rng.choice(["{}", "{NULL}", "{" + str(uuid.UUID(int=rng.getrandbits(128))) + "}"])),
        "days": maybe(rng.choice(["{}", "{infinity,2020-01-01,NULL}", '{{"0044-03-15 BC",-infinity}}'])),
        "prices": maybe(rng.choice(["{}", "{NaN,1.50,NULL}"])),
        "grid": maybe(rng.choice(["{}", "{{1,2},{3,4}}", "{7}"])),
        'odd, "name" é': maybe("odd"),
    }


def random_changes(rng: random.Random, count: int, keys: int) -> list[Change]:
    """Inserts, updates, deletes and key-changing updates (DELETE old + UPDATE new at one LSN)."""
    changes = []
    lsn = 100
    for _ in range(count):
        lsn += 1
        key = rng.randrange(keys)
        roll = rng.random()
        if roll < 0.15:
            changes.append(Change(DELETE, lsn, T0, 7, {"id": str(key)}))
        elif roll < 0.25:
            new_key = rng.randrange(keys)
            changes.append(Change(DELETE, lsn, T0, 7, {"id": str(key)}))
            changes.append(Change(UPDATE, lsn, T0, 7, random_row(rng, new_key)))
        else:
            changes.append(Change(rng.choice([INSERT, UPDATE]), lsn, T0, 7, random_row(rng, key)))
    return changes


def staged_files(changes: list[Change], per_file: int, relation: StagedRelation = RELATION) -> list[bytes]:
    return [codec.encode(relation, changes[i : i + per_file]) for i in range(0, len(changes), per_file)]


class StubTable:
    """What folded_arrow needs of a pyiceberg table: its schema."""

    def __init__(self, columns: tuple[SourceColumn, ...]) -> None:
        self._schema = iceberg_schema(columns, ["id"])

    def schema(self) -> Any:
        return self._schema


def by_key(table: pa.Table) -> list[dict[str, Any]]:
    rows = table.to_pylist()
    return sorted(rows, key=lambda row: row["id"])


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN
    return a == b and type(a) is type(b)


def assert_same_fold(
    files: list[bytes], iceberg_columns: tuple[SourceColumn, ...] = COLUMNS, rule: OutOfRange = "clamp"
) -> None:
    staged = [read_staged(data) for data in files]
    assert can_fold_vectorized(staged)
    table = StubTable(iceberg_columns)
    expected = folded_arrow(fold([codec.decode(data) for data in files], ["id"]), table, rule)  # type: ignore[arg-type]
    iceberg_arrow = arrow_schema(table.schema())
    got = fold_vectorized(staged, ["id"], iceberg_arrow, spark_arrow_schema(iceberg_arrow), spark_value, rule)
    assert got.rows.schema == expected.schema
    assert got.changes == sum(t.num_rows for _, t in staged)
    assert got.deletes == sum(1 for op in expected.column(OP_COLUMN).to_pylist() if op == DELETE)
    for got_row, expected_row in zip(by_key(got.rows), by_key(expected), strict=True):
        for name in expected_row:
            assert same(got_row[name], expected_row[name]), (name, got_row[name], expected_row[name])


@pytest.mark.parametrize("rule", ["clamp", "null"])
@pytest.mark.parametrize("seed", range(5))
def test_vectorized_fold_equals_the_change_by_change_fold(seed: int, rule: OutOfRange) -> None:
    rng = random.Random(seed)
    changes = random_changes(rng, 3000, 400)
    assert_same_fold(staged_files(changes, 700), rule=rule)


def test_a_column_dropped_at_the_source_is_left_to_the_target() -> None:
    rng = random.Random(9)
    relation = StagedRelation("public.t", tuple(c for c in COLUMNS if c.name != "name"))
    changes = [
        Change(c.op, c.lsn, c.ts, c.xid, {k: v for k, v in c.data.items() if k != "name"})
        for c in random_changes(rng, 500, 50)
    ]
    assert_same_fold(staged_files(changes, 200, relation))


def test_a_widened_column_is_cast_to_the_iceberg_type() -> None:
    rng = random.Random(3)
    widened = tuple(
        SourceColumn(c.name, {"n": INT8, "single": FLOAT8}.get(c.name, c.type), c.not_null) for c in COLUMNS
    )
    assert_same_fold(staged_files(random_changes(rng, 500, 50), 500), widened)


def test_unchanged_toast_truncate_or_two_shapes_take_the_general_fold() -> None:
    rng = random.Random(4)
    plain = random_changes(rng, 10, 5)
    toast = [*plain, Change(UPDATE, 999, T0, 8, {"id": "1"}, ("name",))]
    truncate = [*plain, Change(TRUNCATE, 999, T0, 8, {})]
    other = StagedRelation("public.t", COLUMNS[:-1])
    assert not can_fold_vectorized([read_staged(d) for d in staged_files(toast, 100)])
    assert not can_fold_vectorized([read_staged(d) for d in staged_files(truncate, 100)])
    two_shapes = [read_staged(staged_files(plain, 100)[0]), read_staged(codec.encode(other, plain[:1]))]
    assert not can_fold_vectorized(two_shapes)


def test_a_value_that_does_not_fit_names_its_column() -> None:
    narrow = (SourceColumn("id", INT8, True), SourceColumn("n", INT4, False))
    relation = StagedRelation("public.t", (SourceColumn("id", INT8, True), SourceColumn("n", INT8, False)))
    files = staged_files([Change(INSERT, 1, T0, 1, {"id": "1", "n": str(2**40)})], 10, relation)
    iceberg_arrow = arrow_schema(StubTable(narrow).schema())
    with pytest.raises(UnsupportedTypeError, match="column n"):
        fold_vectorized(
            [read_staged(d) for d in files],
            ["id"],
            iceberg_arrow,
            spark_arrow_schema(iceberg_arrow),
            spark_value,
            "clamp",
        )
