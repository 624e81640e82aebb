"""DDL the mirror follows while it streams: ADD COLUMN ... DEFAULT, RENAME COLUMN, DROP and ADD again.

Every test changes a live source around the ALTER (before it, after it, in one batch and across
batches) and compares Iceberg with PostgreSQL row by row.
"""

from __future__ import annotations

import pytest

from pg2iceberg_dagster.errors import StartupCheckError
from pg2iceberg_dagster.materializer import merge

from .conftest import Crash, SourceDb, assert_mirrored, crash_at, snapshot_crashing_at_chunk, sync

pytestmark = pytest.mark.usefixtures("spark")


def _field_ids(pipeline, source: SourceDb, table: str) -> dict[str, int]:  # type: ignore[no-untyped-def]
    schema = pipeline.catalog.load_table(f"{source.name}_public.{table}").schema()
    return {f.name: f.field_id for f in schema.fields}


def test_add_column_with_a_default_gives_older_rows_the_default(source: SourceDb) -> None:
    """Rows older than ``ADD COLUMN ... DEFAULT <constant>`` read the default with no WAL change; rows
    changed before the ALTER in the same batch too; a later SET DEFAULT changes no old row."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'v' FROM generate_series(1, 20) g")
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    # Before the ALTER, in the batch that also holds it: an update, an insert, a delete.
    source.execute("UPDATE public.items SET v = 'before' WHERE id = 1")
    source.execute("INSERT INTO public.items VALUES (21, 'inserted before')")
    source.execute("DELETE FROM public.items WHERE id = 2")
    source.execute(
        "ALTER TABLE public.items ADD COLUMN flag int DEFAULT 7, ADD COLUMN label text DEFAULT 'it''s, \"new\"', "
        "ADD COLUMN tags text[] DEFAULT '{a,\"b c\"}', ADD COLUMN at timestamptz DEFAULT now(), ADD COLUMN plain int"
    )
    source.execute("INSERT INTO public.items (id, v, flag, label) VALUES (22, 'after', 1, NULL)")
    source.execute("UPDATE public.items SET flag = 8 WHERE id = 3")
    sync(pipeline)
    assert_mirrored(pipeline)
    # A new default applies to new rows only, as in PostgreSQL.
    source.execute("ALTER TABLE public.items ALTER COLUMN flag SET DEFAULT 99")
    source.execute("INSERT INTO public.items (id, v) VALUES (23, 'newest')")
    source.execute("UPDATE public.items SET v = 'touched' WHERE id = 4")
    sync(pipeline)
    assert_mirrored(pipeline)
    assert source.execute("SELECT count(*) FROM public.items WHERE flag = 7")[0][0] == 19


def test_add_column_with_a_default_across_batches_and_a_crash_after_the_fill(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The changes before the ALTER merged in an earlier batch; the process dies after the default is
    set on the existing rows but before the fill is marked done: the next merge fills again."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'v' FROM generate_series(1, 10) g")
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    source.execute("UPDATE public.items SET v = 'before' WHERE id = 1")
    sync(pipeline)
    source.execute("ALTER TABLE public.items ADD COLUMN price numeric(10, 2) DEFAULT 12.50")
    source.execute("INSERT INTO public.items VALUES (11, 'after', 3)")
    pipeline.stream(until_caught_up=True)
    crash_at(monkeypatch, merge, "clear_pending_fills")
    with pytest.raises(Crash):
        pipeline.materialize()
    monkeypatch.undo()
    source.execute("UPDATE public.items SET price = 1 WHERE id = 2")
    sync(pipeline)
    assert_mirrored(pipeline)


def test_add_column_with_a_default_and_a_rename_during_the_snapshot(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ALTERs land between chunks: the resumed snapshot reads the new columns under their new
    names, rows read earlier get the default, and nothing needs a change to the table to be right."""
    source.execute("CREATE TABLE public.big (id int PRIMARY KEY, v text, n int)")
    source.execute("INSERT INTO public.big SELECT g, repeat('x', 200), g FROM generate_series(1, 3000) g")
    config = source.config(["public.big"], snapshot={"chunk_pages": 10, "parallelism": 1})
    pipeline = source.pipeline(config)
    snapshot_crashing_at_chunk(monkeypatch, pipeline, 3)
    source.execute("ALTER TABLE public.big ADD COLUMN flag boolean DEFAULT true")
    source.execute("ALTER TABLE public.big RENAME COLUMN n TO amount")
    source.execute("UPDATE public.big SET v = 'changed', amount = -1 WHERE id % 500 = 0")
    source.execute("INSERT INTO public.big VALUES (3001, 'new', 5, false)")
    pipeline.close()
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    assert_mirrored(pipeline)


def test_rename_column_keeps_the_data_of_old_and_new_rows(source: SourceDb) -> None:
    """A renamed column (the key too) stays one Iceberg field: old data files keep their values, and
    changes staged before the RENAME land under the new name."""
    source.execute("CREATE TABLE public.people (id int PRIMARY KEY, name text, age int)")
    source.execute("INSERT INTO public.people SELECT g, 'p' || g, g FROM generate_series(1, 20) g")
    pipeline = source.pipeline(source.config(["public.people"]))
    pipeline.snapshot()
    before = _field_ids(pipeline, source, "people")
    source.execute("UPDATE public.people SET age = 100 WHERE id = 1")
    source.execute("INSERT INTO public.people VALUES (21, 'before rename', 21)")
    source.execute("ALTER TABLE public.people RENAME COLUMN name TO full_name")
    source.execute("ALTER TABLE public.people RENAME COLUMN id TO person_id")
    source.execute("UPDATE public.people SET full_name = 'renamed' WHERE person_id = 2")
    source.execute("INSERT INTO public.people VALUES (22, 'after rename', 22)")
    source.execute("DELETE FROM public.people WHERE person_id = 3")
    sync(pipeline)
    assert_mirrored(pipeline)
    after = _field_ids(pipeline, source, "people")
    assert (after["person_id"], after["full_name"], after["age"]) == (before["id"], before["name"], before["age"])
    # Two names swapped in one go, then changes only after it.
    source.execute(
        "ALTER TABLE public.people RENAME COLUMN full_name TO tmp; ALTER TABLE public.people RENAME COLUMN age TO "
        "full_name; ALTER TABLE public.people RENAME COLUMN tmp TO age"
    )
    source.execute("UPDATE public.people SET age = 'swapped' WHERE person_id = 4")
    sync(pipeline)
    assert_mirrored(pipeline)


def test_a_column_dropped_and_added_again_under_its_name_is_a_new_column(source: SourceDb) -> None:
    """DROP COLUMN v, later ADD COLUMN v: PostgreSQL's rows read the new column (its default), never
    the dropped values; the dropped column keeps its history in Iceberg under another name.
    (The flusher reads a change between the two: pgoutput carries no DDL, so a DROP and ADD of one
    name that no change separates look like no change at all.)"""
    source.execute("CREATE TABLE public.things (id int PRIMARY KEY, v text, w int)")
    source.execute("INSERT INTO public.things SELECT g, 'old ' || g, g FROM generate_series(1, 10) g")
    pipeline = source.pipeline(source.config(["public.things"]))
    pipeline.snapshot()
    source.execute("UPDATE public.things SET v = 'old changed' WHERE id = 1")
    source.execute("ALTER TABLE public.things DROP COLUMN v")
    source.execute("UPDATE public.things SET w = 0 WHERE id = 5")
    pipeline.stream(until_caught_up=True)
    source.execute("ALTER TABLE public.things ADD COLUMN v text DEFAULT 'fresh'")
    source.execute("UPDATE public.things SET v = 'set' WHERE id = 2")
    source.execute("INSERT INTO public.things VALUES (11, 11, 'inserted')")
    sync(pipeline)
    assert_mirrored(pipeline)
    names = pipeline.catalog.load_table(f"{source.name}_public.things").schema().column_names
    assert [n for n in names if n.startswith("v__dropped_")] == ["v__dropped_2"]


def test_ddl_on_a_table_nobody_writes_reaches_iceberg(source: SourceDb) -> None:
    """pgoutput describes a table only with its next row change: an ALTER followed by no write must
    still reach Iceberg (the merge reads the catalog when nothing is staged): a column added with a
    default, one renamed, one widened in place."""
    source.execute('CREATE TABLE public."Quiet" (id int PRIMARY KEY, v text, price numeric(8, 2))')
    source.execute("INSERT INTO public.\"Quiet\" SELECT g, 'v', g FROM generate_series(1, 20) g")
    source.execute("CREATE TABLE public.busy (id int PRIMARY KEY)")
    pipeline = source.pipeline(source.config(['public."Quiet"', "public.busy"]))
    pipeline.snapshot()
    sync(pipeline)
    source.execute('ALTER TABLE public."Quiet" ADD COLUMN flag int DEFAULT 7')
    source.execute('ALTER TABLE public."Quiet" RENAME COLUMN v TO label')
    source.execute('ALTER TABLE public."Quiet" ALTER COLUMN price TYPE numeric(12, 2)')
    source.execute("INSERT INTO public.busy VALUES (1)")
    sync(pipeline)
    assert pipeline.resyncs_pending() == {}
    assert_mirrored(pipeline)
    assert set(_field_ids(pipeline, source, "Quiet")) == {"id", "label", "price", "flag"}


def test_a_rename_and_a_drop_before_the_flusher_reads_resync_instead_of_stalling(source: SourceDb) -> None:
    """Changes written before ``RENAME COLUMN id`` and ``DROP COLUMN`` that the flusher reads only after
    both: their columns cannot be told apart by name or position any more. The key's values would
    land nowhere and the merge would fail on every retry; it requests a resync instead."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, gone text, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'g', 'v' FROM generate_series(1, 30) g")
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    source.execute("UPDATE public.items SET v = 'before' WHERE id <= 5")
    source.execute("ALTER TABLE public.items RENAME COLUMN id TO ident")
    source.execute("ALTER TABLE public.items DROP COLUMN gone")
    source.execute("UPDATE public.items SET v = 'after' WHERE ident > 25")
    pipeline.stream(until_caught_up=True)
    result = pipeline.materialize()["public.items"]
    assert "could not be told apart" in (result.resync_reason or ""), result
    pipeline.resync("public.items")
    sync(pipeline)
    assert_mirrored(pipeline)


def test_a_table_renamed_while_streaming_loses_no_change(source: SourceDb) -> None:
    """``ALTER TABLE ... RENAME TO`` while the flusher streams: the changes arrive under the new name
    and were dropped as another table's, for good (the slot moved past them). They are now staged as
    the mirrored table's (it is the same oid); a start under the old name refuses with what to do, and
    once renamed back the table equals the source."""
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' FROM generate_series(1, 20) g")
    config = source.config(["public.orders"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    source.execute("UPDATE public.orders SET v = 'before' WHERE id = 1")
    source.execute("ALTER TABLE public.orders RENAME TO orders_old")
    source.execute("UPDATE public.orders_old SET v = 'renamed' WHERE id = 2")
    source.execute("DELETE FROM public.orders_old WHERE id = 3")
    source.execute("INSERT INTO public.orders_old VALUES (100, 'new')")
    pipeline.stream(until_caught_up=True)
    assert pipeline.lag("public.orders").changes == 4
    with pytest.raises(StartupCheckError, match=r"public\.orders was renamed to public\.orders_old.*Rename it back"):
        source.pipeline(config).validate()
    source.execute("ALTER TABLE public.orders_old RENAME TO orders")
    sync(pipeline)
    rows = pipeline.catalog.load_table(f"{source.name}_public.orders").scan().to_arrow().to_pylist()
    expected = source.execute("SELECT id, v FROM public.orders ORDER BY id")
    assert sorted((row["id"], row["v"]) for row in rows) == [tuple(row) for row in expected]
    assert expected[1] == (2, "renamed") and 3 not in [id_ for id_, _ in expected]
    assert_mirrored(source.pipeline(config))
