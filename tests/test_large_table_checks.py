"""Large tables: the data checks compare a slice of the primary key (``checks.compare_max_rows``), and
``verify`` compares a whole table a hash bucket of keys at a time.

A slice must select the same rows in PostgreSQL and in Iceberg (else the check reports rows only on
one side that are not), and must stay ``compare_max_rows`` rows whatever the table's size; buckets
must find exactly what one comparison in memory finds.
"""

from __future__ import annotations

import random

import pytest
from dagster import AssetCheckSeverity, AssetKey
from psycopg import sql

from pg2iceberg_dagster import checks as checks_module
from pg2iceberg_dagster import verify as verify_module
from pg2iceberg_dagster.dagster_integration.assets import table_check_results
from pg2iceberg_dagster.errors import ConfigError
from pg2iceberg_dagster.source.catalog import TypeResolver, describe_table
from pg2iceberg_dagster.source.connection import connect, consistent_read
from pg2iceberg_dagster.verify import choose_key_slice, compare_table

from .conftest import SourceDb

pytestmark = pytest.mark.usefixtures("spark")

LIMIT = 40
COMPOSITE, TEXT_KEY, SMALL = "public.composite_key", "public.text_key", "public.small"


def test_a_large_table_is_checked_a_key_range_at_a_time(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks_module, "IN_FLIGHT_WAIT_SECONDS", 0.0)  # no flusher runs here
    source.execute(f"CREATE TABLE {COMPOSITE} (tenant int, id bigint, v text, PRIMARY KEY (tenant, id))")
    source.execute(f"INSERT INTO {COMPOSITE} SELECT t, i, 'v' FROM generate_series(1, 3) t, generate_series(1, 100) i")
    source.execute(f"CREATE TABLE {TEXT_KEY} (code text PRIMARY KEY, v text)")
    source.execute(f"INSERT INTO {TEXT_KEY} SELECT 'c' || g, 'v' FROM generate_series(1, 300) g")
    source.execute(f"CREATE TABLE {SMALL} (id int PRIMARY KEY, v text)")
    source.execute(f"INSERT INTO {SMALL} SELECT g, 'v' FROM generate_series(1, 30) g")
    tables = [COMPOSITE, TEXT_KEY, SMALL]
    pipeline = source.pipeline(source.config(tables, checks={"compare_max_rows": LIMIT, "unique_keys_max_rows": 100}))
    pipeline.snapshot()

    reports = dict(pipeline.check_tables(tables))
    composite, text_key, small = (reports[name] for name in tables)
    assert not isinstance(composite, Exception) and not isinstance(text_key, Exception)
    assert not isinstance(small, Exception)
    assert composite.content_checked.startswith("tenant, id from (")
    assert f"({LIMIT} of about 300 rows)" in composite.content_checked
    assert composite.keys_checked == composite.content_checked  # 300 rows: more than unique_keys_max_rows
    diff = composite.content.diff
    assert diff is not None and diff.ok and diff.pg_rows == diff.iceberg_rows == LIMIT
    # Too large, and a text key orders by collation in PostgreSQL, by bytes in Iceberg: not compared.
    assert text_key.content.diff is None and "checks.compare_max_rows (40)" in text_key.content.inconclusive
    assert f"verify --table {TEXT_KEY}" in text_key.content.inconclusive
    # In Dagster: a warning that fails, saying why.
    results = {r.check_name: r for r in table_check_results(text_key, AssetKey(["t"]))}
    not_compared = results["matches_source"]
    assert not not_compared.passed and not_compared.severity == AssetCheckSeverity.WARN
    assert not_compared.description == f"not conclusive: {text_key.content.inconclusive}"
    assert not_compared.metadata["compared"].value is False
    assert (
        results["primary_key_unique"].passed
        and results["primary_key_unique"].metadata["checked_rows"].value == "all rows"
    )
    assert small.content_checked == small.keys_checked == "all rows"
    assert small.content.diff is not None and small.content.diff.pg_rows == 30

    # Every source row changed, nothing replicated: each slice must find exactly its rows different,
    # none on one side only, and hold as many rows as the source has in that key range.
    source.execute(f"UPDATE {COMPOSITE} SET v = 'changed'")
    random.seed(16)
    with connect(pipeline.config.source) as conn:
        described = describe_table(conn, pipeline.tables[COMPOSITE].config, TypeResolver(conn))
        iceberg = pipeline.catalog.load_table(f"{source.name}_public.composite_key")
        for _ in range(12):
            key_slice = choose_key_slice(conn, described, LIMIT)
            assert key_slice is not None
            with consistent_read(conn):
                diff = compare_table(conn, described, iceberg, "clamp", key_slice=key_slice)
            live = sql.SQL("SELECT count(*) FROM {} WHERE {}").format(
                sql.Identifier("public", "composite_key"), key_slice.condition()
            )
            row = conn.execute(live).fetchone()
            assert row is not None
            in_source = row[0]
            assert diff.pg_rows == diff.iceberg_rows == diff.different == in_source, key_slice
            assert diff.only_in_pg == diff.only_in_iceberg == 0, key_slice
            assert in_source == LIMIT, key_slice  # also a slice that reached the end: the last LIMIT rows

    report = dict(pipeline.check_tables([COMPOSITE]))[COMPOSITE]
    assert not isinstance(report, Exception) and report.content.diff is not None
    assert report.content.diff.different == report.content.diff.pg_rows > 0
    # Nothing staged them and no flusher runs: not a pass, and not a failure either.
    assert not report.content.conclusive and "flusher had not staged" in report.content.inconclusive

    with pytest.raises(ConfigError, match=r"not configured tables: public\.nope"):
        pipeline.verify(["public.nope"])

    # Every key twice in Iceberg: the duplicate-key check finds the slice's keys, or, at or below
    # unique_keys_max_rows, every key.
    iceberg.append(iceberg.scan().to_arrow())
    sliced = dict(pipeline.check_tables([COMPOSITE]))[COMPOSITE]
    assert not isinstance(sliced, Exception) and sliced.duplicate_keys == LIMIT
    whole_keys = source.pipeline(source.config(tables, checks={"compare_max_rows": LIMIT}))
    whole = dict(whole_keys.check_tables([COMPOSITE]))[COMPOSITE]
    assert not isinstance(whole, Exception) and whole.duplicate_keys == 300 and whole.keys_checked == "all rows"


def test_verify_compares_a_large_table_a_hash_bucket_at_a_time(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spilled to buckets by key, the comparison must find exactly what it finds in memory."""
    name = "public.spilled"
    source.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text, f float8, a int[])")
    source.execute(
        f"INSERT INTO {name} SELECT g, 'v' || g, CASE WHEN g % 7 = 0 THEN 'NaN' ELSE g / 3.0 END, "
        "ARRAY[g, NULL, g * 2] FROM generate_series(1, 300) g"
    )
    pipeline = source.pipeline(source.config([name]))
    pipeline.snapshot()
    # Not replicated (nothing streams): 4 rows only in PostgreSQL, 3 only in Iceberg, 5 different;
    # two keys twice in Iceberg.
    source.execute(f"INSERT INTO {name} SELECT g, 'new', 0, NULL FROM generate_series(1001, 1004) g")
    source.execute(f"DELETE FROM {name} WHERE id IN (10, 20, 30)")
    source.execute(f"UPDATE {name} SET v = 'changed' WHERE id IN (41, 42, 43, 44, 45)")
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.spilled")
    iceberg.append(iceberg.scan(row_filter="id IN (7, 8)").to_arrow())

    in_memory = pipeline.verify([name])[0]
    monkeypatch.setattr(verify_module, "BUCKET_ROWS", 50)  # 6 buckets
    bucketed = pipeline.verify([name])[0]
    for diff in (in_memory, bucketed):
        counts = (diff.pg_rows, diff.iceberg_rows, diff.only_in_pg, diff.only_in_iceberg, diff.different)
        assert counts == (301, 302, 4, 3, 5), diff
        assert diff.duplicate_keys == 2, diff
        assert sorted(diff.examples["only_in_pg"]) == [(1001,), (1002,), (1003,), (1004,)]
        assert sorted(diff.examples["only_in_iceberg"]) == [(10,), (20,), (30,)]
        assert sorted(diff.examples["different"]) == [(41,), (42,), (43,), (44,), (45,)]
