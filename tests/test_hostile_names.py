"""Identifiers that break naive quoting: spaces, double quotes, mixed case, reserved words, commas and
backticks, in the schema, the table and the columns, and a composite primary key made of them.
They go through snapshot, streaming and MERGE unchanged, and Iceberg carries the same names."""

from __future__ import annotations

import pytest

from pg2iceberg_dagster.config import parse_config

from .conftest import SourceDb, assert_mirrored, sync

SCHEMA_DDL = '''
CREATE SCHEMA "My Schema";
CREATE TABLE "My Schema"."select" (
    "from" int, "Mixed Case" text, "a,b" text, "quote""d" text, "back`tick" text, "where" numeric(10, 2),
    PRIMARY KEY ("from", "Mixed Case")
);
CREATE TABLE "My Schema"."Order ""Items""" (
    "Order ID" bigint, "quote""d" text, "a,b" int, "Select" text, PRIMARY KEY ("quote""d", "Order ID")
);
'''
TABLES = ['"My Schema"."select"', '"My Schema"."Order ""Items"""']
KEYS = ["My Schema.select", 'My Schema.Order "Items"']


def test_config_names_follow_sql_quoting() -> None:
    """A double quote inside a quoted name is written twice, as in SQL; the key holds the real name."""
    config = parse_config({"source": {"dbname": "app"}, "tables": [{"name": name} for name in TABLES]})
    assert [table.key for table in config.tables] == KEYS
    assert [(t.schema_name, t.table_name) for t in config.tables] == [
        ("My Schema", "select"),
        ("My Schema", 'Order "Items"'),
    ]


@pytest.mark.usefixtures("spark")
def test_hostile_identifiers_replicate(source: SourceDb) -> None:
    source.execute(SCHEMA_DDL)
    source.execute(
        """INSERT INTO "My Schema"."select" SELECT g % 7, 'case ' || (g / 7), 'x,y', 'q"' || g, 'b`' || g, g / 4.0
        FROM generate_series(1, 300) g"""
    )
    source.execute(
        '''INSERT INTO "My Schema"."Order ""Items""" SELECT g, 'k"' || (g % 3), g, 'sel'
        FROM generate_series(1, 200) g'''
    )
    pipeline = source.pipeline(source.config(TABLES, snapshot={"chunk_pages": 1, "parallelism": 2}))
    results = pipeline.snapshot()
    assert results[KEYS[0]].chunks_run > 1, "several CTID chunks, each quoting the names"
    assert_mirrored(pipeline)

    source.execute(
        '''
        INSERT INTO "My Schema"."select" VALUES (100, 'New Key', 'n,m', 'q""', 'b``', 1.5);
        UPDATE "My Schema"."select" SET "a,b" = 'changed', "quote""d" = NULL WHERE "from" = 1;
        DELETE FROM "My Schema"."select" WHERE "from" = 2 AND "Mixed Case" LIKE 'case 1%';
        UPDATE "My Schema"."select" SET "Mixed Case" = "Mixed Case" || ' moved' WHERE "from" = 3;  -- key change
        UPDATE "My Schema"."Order ""Items""" SET "Order ID" = "Order ID" + 1000 WHERE "Order ID" <= 10;
        UPDATE "My Schema"."Order ""Items""" SET "Select" = 'upd' WHERE "quote""d" = 'k"1';
        DELETE FROM "My Schema"."Order ""Items""" WHERE "Order ID" BETWEEN 50 AND 60;
        '''
    )
    sync(pipeline)
    assert_mirrored(pipeline)
    # A column added later with a hostile name evolves the Iceberg schema.
    source.execute("""ALTER TABLE "My Schema"."select" ADD COLUMN "New ""Col"", too" text""")
    source.execute("""UPDATE "My Schema"."select" SET "New ""Col"", too" = 'set' WHERE "from" = 4""")
    sync(pipeline)
    assert_mirrored(pipeline)

    namespace = f"{source.name}_My Schema"
    assert sorted(ident for ident in pipeline.catalog.list_tables(namespace)) == [
        (namespace, 'Order "Items"'),
        (namespace, "select"),
    ]
    select = pipeline.catalog.load_table((namespace, "select"))
    assert select.schema().column_names == [
        "from",
        "Mixed Case",
        "a,b",
        'quote"d',
        "back`tick",
        "where",
        'New "Col", too',
    ]
    assert [select.schema().find_column_name(i) for i in select.schema().identifier_field_ids] == [
        "from",
        "Mixed Case",
    ]
    rows = {(r["from"], r["Mixed Case"]): r for r in select.scan().to_arrow().to_pylist()}
    assert rows[(100, "New Key")]['quote"d'] == 'q""' and rows[(100, "New Key")]["back`tick"] == "b``"
    items = pipeline.catalog.load_table((namespace, 'Order "Items"'))
    assert items.schema().column_names == ["Order ID", 'quote"d', "a,b", "Select"]


@pytest.mark.usefixtures("spark")
def test_dots_in_names_stay_one_namespace_and_one_table(source: SourceDb) -> None:
    """A dot inside a schema or table name is part of the name: one Iceberg namespace level and one
    table, through snapshot, streaming, MERGE and verify (never a nested namespace)."""
    source.execute('CREATE SCHEMA "v1.2"; CREATE TABLE "v1.2"."events.log" (id int PRIMARY KEY, "a.b" text)')
    source.execute("""INSERT INTO "v1.2"."events.log" SELECT g, 'x.' || g FROM generate_series(1, 400) g""")
    pipeline = source.pipeline(source.config(['"v1.2"."events.log"'], snapshot={"chunk_pages": 1}))
    assert pipeline.snapshot()["v1.2.events.log"].chunks_run > 1
    assert_mirrored(pipeline)
    source.execute(
        """UPDATE "v1.2"."events.log" SET "a.b" = 'changed' WHERE id <= 20;
        DELETE FROM "v1.2"."events.log" WHERE id BETWEEN 30 AND 40;
        UPDATE "v1.2"."events.log" SET id = id + 1000 WHERE id = 50;
        INSERT INTO "v1.2"."events.log" VALUES (5000, 'new')"""
    )
    sync(pipeline)
    assert_mirrored(pipeline)
    namespace = f"{source.name}_v1.2"
    # (The SQL catalog keeps a namespace as dotted text, so its listings split it; lookups do not.)
    assert pipeline.catalog.table_exists((namespace, "events.log"))
    assert not pipeline.catalog.table_exists((namespace, "events", "log"))
    assert pipeline.iceberg_summary("v1.2.events.log").row_count == 400 - 11 + 1


@pytest.mark.usefixtures("spark")
def test_columns_only_case_tells_apart_and_columns_named_like_ours(source: SourceDb) -> None:
    """Columns that differ only in case ("Name" and name, "ID" and id) are different columns in
    PostgreSQL and Iceberg, and so in Spark's MERGE; columns named like the merge's own (_op,
    _unchanged) or the staged log's (_lsn, _data) are ordinary columns. Every merge failed on them
    before ("column already exists"), so the table never moved past its snapshot."""
    source.execute(
        'CREATE TABLE public.people (id int PRIMARY KEY, "ID" int, "Name" text, name text, _op text, '
        "_unchanged text[], _lsn bigint, _data jsonb, big text)"
    )
    source.execute(
        "INSERT INTO public.people SELECT g, -g, 'N' || g, 'n' || g, 'D', '{x}', g, '{}', repeat('t', 3000) "
        "FROM generate_series(1, 50) g"
    )
    pipeline = source.pipeline(source.config(["public.people"]))
    pipeline.snapshot()
    source.execute("""UPDATE public.people SET name = 'lower', _op = 'U' WHERE id <= 10""")  # big unchanged (TOAST)
    source.execute("""UPDATE public.people SET "Name" = 'Upper', "ID" = 0 WHERE id BETWEEN 5 AND 15""")
    source.execute("DELETE FROM public.people WHERE id > 45")
    source.execute("""INSERT INTO public.people VALUES (100, 1, 'A', 'a', 'I', '{}', 1, '[1]', 'b')""")
    sync(pipeline)
    columns = 'id, "ID", "Name", name, _op, _unchanged, _lsn, _data::text, big'
    expected = source.execute(f"SELECT {columns} FROM public.people ORDER BY id")
    table = pipeline.catalog.load_table(f"{source.name}_public.people")
    rows = sorted(table.scan().to_arrow().to_pylist(), key=lambda row: row["id"])
    names = ["id", "ID", "Name", "name", "_op", "_unchanged", "_lsn", "_data", "big"]
    assert [tuple(row[name] for name in names) for row in rows] == [tuple(row) for row in expected]
    assert expected[0][2:5] == ("N1", "lower", "U") and expected[-1][0] == 100
    assert_mirrored(pipeline)
