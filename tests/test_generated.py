"""GENERATED ALWAYS AS (...) STORED columns replicate exactly, though pgoutput (before PostgreSQL 18)
never sends them: the snapshot reads them, the flusher computes them for every staged row image.
Iceberg is compared with PostgreSQL row by row (verify, and directly for the generated columns)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.staging.codec import read_staged
from pg2iceberg_dagster.staging.store import ObjectStore

from .conftest import SourceDb, assert_mirrored, sync

pytestmark = pytest.mark.usefixtures("spark")

# A generated column between plain columns of the same type: after a RENAME the flusher identifies
# columns by position, and must not count the generated one (the stream does not send it).
ITEMS = """
CREATE TABLE public.items (
    id int PRIMARY KEY,
    a int,
    twice int GENERATED ALWAYS AS (a * 2 + coalesce(qty, 0)) STORED,
    qty int,
    b text,
    doc jsonb,
    label text GENERATED ALWAYS AS (b || ' / ' || coalesce(doc ->> 'k', '?')) STORED,
    price numeric(10, 2),
    total numeric(12, 2) GENERATED ALWAYS AS (price * qty * 1.175) STORED,
    d date,
    due date GENERATED ALWAYS AS (d + a) STORED,
    oid_plus bigint GENERATED ALWAYS AS (tableoid::bigint - tableoid::bigint + a) STORED
)
"""
GENERATED = ["twice", "label", "total", "due", "oid_plus"]


def _rows(source: SourceDb, pipeline: Pipeline, table: str, columns: list[str]) -> tuple[list[Any], list[Any]]:
    """The ``columns`` of every row (ordered by id) in PostgreSQL and in Iceberg."""
    with psycopg.connect(source.conninfo) as conn:
        query = sql.SQL("SELECT {} FROM public.{} ORDER BY id").format(
            sql.SQL(", ").join(map(sql.Identifier, ["id", *columns])), sql.Identifier(table)
        )
        in_pg = [list(row) for row in conn.execute(query)]
    scanned = pipeline.catalog.load_table(f"{source.name}_public.{table}").scan().to_arrow().to_pylist()
    in_iceberg = [[row[name] for name in ["id", *columns]] for row in sorted(scanned, key=lambda r: r["id"])]
    return in_pg, in_iceberg


def _assert_generated_mirrored(source: SourceDb, pipeline: Pipeline, table: str, columns: list[str]) -> None:
    assert_mirrored(pipeline)
    in_pg, in_iceberg = _rows(source, pipeline, table, columns)
    assert in_iceberg == in_pg


def test_generated_columns_follow_snapshot_inserts_updates_and_deletes(source: SourceDb) -> None:
    """Int arithmetic, text concatenation (with characters JSON escapes), a numeric rounded to its
    column's scale, a date and tableoid: equal to the source after the snapshot and after streamed
    inserts, updates of inputs and of other columns, NULL inputs, a key change, deletes, and a RENAME
    of an input column between changes the flusher reads after it."""
    source.execute(ITEMS)
    source.execute(
        "INSERT INTO public.items (id, a, qty, b, doc, price, d) "
        "SELECT g, g, g % 5, 'item ' || g, jsonb_build_object('k', 'v' || g), g * 1.01, '2024-01-01'::date + g "
        "FROM generate_series(1, 200) g"
    )
    source.execute("INSERT INTO public.items (id) VALUES (201)")  # every input NULL
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    _assert_generated_mirrored(source, pipeline, "items", GENERATED)

    source.execute(
        "INSERT INTO public.items (id, a, qty, b, doc, price, d) "
        "SELECT g, -g, 3, E'quote \" back \\\\ tab \\t é ' || g, '{\"k\": \"line\\nbreak\"}', 0.333, '2000-02-28' "
        "FROM generate_series(300, 420) g"
    )
    source.execute("UPDATE public.items SET a = a + 100, price = 7.77 WHERE id % 3 = 0")
    source.execute("UPDATE public.items SET doc = NULL, qty = NULL WHERE id % 7 = 0")
    source.execute("UPDATE public.items SET b = 'renamed later' WHERE id = 10")
    source.execute("UPDATE public.items SET id = 1000, a = 5 WHERE id = 11")
    source.execute("DELETE FROM public.items WHERE id % 10 = 1")
    source.execute("ALTER TABLE public.items RENAME COLUMN a TO alpha")
    source.execute("UPDATE public.items SET alpha = 42 WHERE id IN (2, 300)")
    source.execute("INSERT INTO public.items (id, alpha, qty, b, d) VALUES (2000, 1, 1, 'after rename', '2024-02-29')")
    sync(pipeline)
    _assert_generated_mirrored(source, pipeline, "items", GENERATED)


def _big(seed: str) -> str:
    """SQL of a text of about 3 kB that pglz cannot compress (it is TOASTed out of line)."""
    return f"(SELECT string_agg(md5({seed} || ':' || i), '') FROM generate_series(1, 100) i)"


def _unchanged_updates(config: Any) -> int:
    """Staged UPDATE images that left ``big`` out as unchanged TOAST."""
    store = ObjectStore(config.staging)
    count = 0
    for key in store.list():
        if key.startswith("_batches/"):
            continue
        _, changes = read_staged(store.get(key))
        count += sum(1 for names in changes.column("_unchanged_cols").to_pylist() if names and "big" in names)
    return count


def test_generated_column_reading_an_unchanged_toast_value(source: SourceDb) -> None:
    """An UPDATE that changes one input of a generated column and leaves its large text input
    unchanged: the stream omits the large value, so the flusher reads the generated value from the
    source row. Also when the row changes again, changes key or is deleted before the flusher reads
    it; a generated column that reads no TOASTed value is still evaluated from the image."""
    source.execute(
        "CREATE TABLE public.docs (id int PRIMARY KEY, n int, big text, "
        "digest text GENERATED ALWAYS AS (md5(big) || ':' || n) STORED, "
        "size int GENERATED ALWAYS AS (length(big) + n) STORED, "
        "next int GENERATED ALWAYS AS (n + 1) STORED)"
    )
    source.execute(f"INSERT INTO public.docs (id, n, big) SELECT g, g, {_big('g')} FROM generate_series(1, 20) g")
    pipeline = source.pipeline(source.config(["public.docs"]))
    pipeline.snapshot()
    columns = ["n", "big", "digest", "size", "next"]
    source.execute("UPDATE public.docs SET n = n * 10 WHERE id <= 12")
    source.execute("UPDATE public.docs SET n = n + 1 WHERE id = 2")  # changed again before the flush
    source.execute("UPDATE public.docs SET id = 100 WHERE id = 3")  # the key of the earlier image is gone
    source.execute("DELETE FROM public.docs WHERE id = 4")  # the row of the earlier image is gone
    source.execute(f"UPDATE public.docs SET n = 0, big = {_big('id + 1000')} WHERE id = 5")  # both inputs sent
    source.execute(f"INSERT INTO public.docs (id, n, big) VALUES (50, 7, {_big('50')})")
    sync(pipeline)
    assert _unchanged_updates(pipeline.config) >= 10
    _assert_generated_mirrored(source, pipeline, "docs", columns)
    # Across flushes: the image is staged and merged, then its row changes again.
    source.execute("UPDATE public.docs SET n = -1 WHERE id IN (6, 7)")
    pipeline.stream(until_caught_up=True)
    source.execute("UPDATE public.docs SET n = -2 WHERE id = 6")
    source.execute("DELETE FROM public.docs WHERE id = 7")
    pipeline.materialize()
    sync(pipeline)
    _assert_generated_mirrored(source, pipeline, "docs", columns)


def test_a_generated_column_added_later_is_resynced(source: SourceDb) -> None:
    """``ADD COLUMN ... GENERATED ALWAYS AS (...) STORED`` rewrites the table, computing a value for
    every existing row with no WAL change: the merge writes nothing and requests a resync rather than
    leaving those rows NULL in Iceberg; after it the column follows every change."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, n int)")
    source.execute("INSERT INTO public.items SELECT g, g FROM generate_series(1, 10) g")
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    source.execute("UPDATE public.items SET n = 0 WHERE id = 1")
    source.execute("ALTER TABLE public.items ADD COLUMN half numeric(6, 1) GENERATED ALWAYS AS (n / 2.0) STORED")
    source.execute("INSERT INTO public.items (id, n) VALUES (11, 11)")
    pipeline.stream(until_caught_up=True)
    result = pipeline.materialize()["public.items"]
    assert result.resync_reason and "column half was added as GENERATED" in result.resync_reason
    assert "half" not in pipeline.catalog.load_table(f"{source.name}_public.items").schema().column_names
    pipeline.resync("public.items")
    source.execute("UPDATE public.items SET n = 3 WHERE id = 2")
    source.execute("INSERT INTO public.items (id, n) VALUES (12, 5)")
    sync(pipeline)
    _assert_generated_mirrored(source, pipeline, "items", ["n", "half"])
