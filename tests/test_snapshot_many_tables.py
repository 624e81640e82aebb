"""The snapshot of many tables: tables enter the epoch while earlier tables' chunks run, and a new
table takes no commit of its own before its rows."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.schema import Schema
from pyiceberg.types import IntegerType, NestedField, StringType

from pg2iceberg_dagster.iceberg.evolution import SOURCE_FILE_NODE
from pg2iceberg_dagster.iceberg.sql_catalog import MirrorSqlCatalog
from pg2iceberg_dagster.snapshot import holder
from pg2iceberg_dagster.snapshot.runner import SnapshotRunner

from .conftest import Crash, SourceDb, assert_mirrored

TABLES = 8
CRASHING = 4  # the table whose entry into the epoch dies in test_crash_entering_a_later_table_resumes


def _tables(source: SourceDb) -> list[str]:
    """``TABLES`` tables, every third one of several chunks (the tests' chunk_pages is 8), the others
    of a few rows; returns their keys."""
    for index in range(TABLES):
        rows = 3000 if index % 3 == 0 else 20 + index
        source.execute(f"CREATE TABLE public.t{index} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO public.t{index} SELECT g, 'v' || g FROM generate_series(1, %s) g", (rows,))
    return [f"public.t{index}" for index in range(TABLES)]


def test_many_tables_snapshot_with_one_commit_per_small_table(source: SourceDb) -> None:
    """Every table equals its source; a single-chunk table's Iceberg table went from its creation to
    its rows in one commit, and records the source file its rows were read from."""
    keys = _tables(source)
    pipeline = source.pipeline(source.config(keys))
    results = pipeline.snapshot()
    assert all(result.complete for result in results.values()), results
    assert {key: results[key].chunks_run > 1 for key in keys} == {key: key[-1] in "036" for key in keys}
    assert_mirrored(pipeline)
    for key in keys:
        table = pipeline.catalog.load_table(pipeline.tables[key].iceberg)
        (file_node,) = source.execute("SELECT relfilenode FROM pg_class WHERE oid = %s::regclass", (key,))[0]
        assert table.properties[SOURCE_FILE_NODE] == str(file_node), key
        if results[key].chunks_run == 1:
            assert len(table.snapshots()) == 1, key
            assert len(table.metadata.metadata_log) == 1, (key, table.metadata.metadata_log)  # created, then rows


def test_crash_entering_a_later_table_resumes(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process dies entering a table into the epoch while the chunks of the tables before it run;
    the export dies with it. Meanwhile one of the tables entered is rewritten (a new source file) and
    another changes: the rerun, in a new epoch, brings every table to its source's rows."""
    keys = _tables(source)
    config = source.config(keys)
    enter_epoch = SnapshotRunner.enter_epoch

    def enter_or_crash(self: SnapshotRunner, table, snapshot, sessions=None):  # type: ignore[no-untyped-def]
        if table.key == keys[CRASHING]:
            raise Crash
        return enter_epoch(self, table, snapshot, sessions)

    monkeypatch.setattr(SnapshotRunner, "enter_epoch", enter_or_crash)
    with pytest.raises(Crash):
        source.pipeline(config).snapshot()
    monkeypatch.undo()
    source.execute("VACUUM FULL public.t1")
    source.execute("UPDATE public.t2 SET v = v || '!'")
    source.execute("DELETE FROM public.t3 WHERE id % 2 = 0")
    second = source.pipeline(config)
    results = second.snapshot()
    assert all(result.complete and result.epoch == 1 for result in results.values()), results
    assert_mirrored(second)
    table = second.catalog.load_table(second.tables["public.t1"].iceberg)
    (file_node,) = source.execute("SELECT relfilenode FROM pg_class WHERE oid = 'public.t1'::regclass")[0]
    assert table.properties[SOURCE_FILE_NODE] == str(file_node)


def test_new_tables_go_where_their_namespace_says(
    source: SourceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A namespace a team created with a location of its own keeps the mirror's new tables under it,
    as the catalog's own table creation places them (the namespace is looked up once for all of
    them). A table another process creates after the snapshot looked for it, before its creation's
    insert (which does not look again), is the one the snapshot fills."""
    keys = _tables(source)[:3]
    pipeline = source.pipeline(source.config(keys))
    namespace = pipeline.tables[keys[0]].iceberg[0]
    location = (tmp_path / "team_area").as_uri()
    pipeline.catalog.create_namespace(namespace, {"location": location})
    raced = pipeline.tables[keys[2]].iceberg
    load_table, plan = MirrorSqlCatalog.load_table, SnapshotRunner.plan
    racing: list[bool] = []  # while the raced table is planned: whether its look is still to race
    created: list[Any] = []  # the table the other process created

    def planned(runner: SnapshotRunner, table: Any, *args: Any, **kwargs: Any) -> Any:
        racing[:] = [table.key == keys[2]]
        return plan(runner, table, *args, **kwargs)

    def created_meanwhile(catalog: MirrorSqlCatalog, identifier: Any) -> Any:
        if racing and racing[0] and tuple(identifier) == raced:
            racing[0] = False
            created.append(raced)
            columns = Schema(NestedField(1, "id", IntegerType(), required=True), NestedField(2, "v", StringType()))
            source.pipeline(source.config(keys)).catalog.create_table(raced, columns)
            raise NoSuchTableError(f"{raced} (created by another process right after this look)")
        return load_table(catalog, identifier)

    monkeypatch.setattr(MirrorSqlCatalog, "load_table", created_meanwhile)
    monkeypatch.setattr(SnapshotRunner, "plan", planned)
    results = pipeline.snapshot()
    assert created == [raced]
    assert all(result.complete for result in results.values()), results
    assert_mirrored(pipeline)
    for key in keys:
        identifier = pipeline.tables[key].iceberg
        assert pipeline.catalog.load_table(identifier).location() == f"{location}/{identifier[1]}", key


def test_tables_planned_while_the_snapshot_is_exported_take_what_it_sees(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables are planned (created, chunks stored) while the holder exports its snapshot. Between
    their planning and the export one is rewritten (a new source file), one grows past its planned
    pages and others change: every table equals the rows the snapshot saw, and records its file."""
    keys = _tables(source)
    planned: list[str] = []
    before_the_export: list[bool] = []  # whether every table was planned before the slot's export
    plan = SnapshotRunner.plan
    create_slot = holder.create_slot_with_snapshot

    def recorded(runner: SnapshotRunner, table: Any, *args: Any, **kwargs: Any) -> Any:
        chunks = plan(runner, table, *args, **kwargs)
        planned.append(table.key)
        return chunks

    def after_every_table_was_planned(*args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + 30
        while len(planned) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        before_the_export.append(len(planned) == len(keys))
        source.execute("VACUUM FULL public.t1")
        source.execute("INSERT INTO public.t0 SELECT g, 'late ' || g FROM generate_series(3001, 9000) g")
        source.execute("UPDATE public.t2 SET v = v || '!'")
        source.execute("DELETE FROM public.t3 WHERE id % 2 = 0")
        return create_slot(*args, **kwargs)

    monkeypatch.setattr(SnapshotRunner, "plan", recorded)
    monkeypatch.setattr(holder, "create_slot_with_snapshot", after_every_table_was_planned)
    pipeline = source.pipeline(source.config(keys))
    results = pipeline.snapshot()
    assert before_the_export == [True]
    assert sorted(planned) == sorted(keys)  # and not again once the snapshot was exported
    assert all(result.complete for result in results.values()), results
    assert_mirrored(pipeline)
    table = pipeline.catalog.load_table(pipeline.tables["public.t1"].iceberg)
    (file_node,) = source.execute("SELECT relfilenode FROM pg_class WHERE oid = 'public.t1'::regclass")[0]
    assert table.properties[SOURCE_FILE_NODE] == str(file_node)
