"""Batches written by pyiceberg instead of a Spark MERGE (materializer/append.py): inserts appended,
small copy-on-write tables' batches as key deletes plus appends; each compared row by row with the
source, across a crash between the write and the cursor's advance, and against the cases that must
stay on Spark."""

from __future__ import annotations

from typing import Any

import pytest
from pyiceberg.avro.file import AvroFile
from pyiceberg.schema import Schema
from pyiceberg.utils.schema_conversion import AvroSchemaConversion

from pg2iceberg_dagster.coordination.store import CoordinationStore
from pg2iceberg_dagster.pipeline import Pipeline

from .conftest import Crash, SourceDb, assert_mirrored, crash_at

COW = {"write.merge.mode": "copy-on-write", "write.update.mode": "copy-on-write", "write.delete.mode": "copy-on-write"}
MOR = {"write.merge.mode": "merge-on-read", "write.update.mode": "merge-on-read", "write.delete.mode": "merge-on-read"}


def _mirrored(source: SourceDb, ddl: str, properties: dict[str, str], **materialize: int) -> Pipeline:
    """``public.items`` created by ``ddl`` with 50 rows, snapshotted and an insert merged."""
    source.execute(ddl)
    source.execute("INSERT INTO public.items SELECT g, 'row ' || g FROM generate_series(1, 50) g")
    iceberg = source.config(["public.items"]).iceberg.model_dump(mode="json", exclude_none=True)
    iceberg["table_properties"] = {**iceberg["table_properties"], **properties}
    config = source.config(["public.items"], iceberg=iceberg, materialize=materialize)
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    source.execute("INSERT INTO public.items VALUES (51, 'first')")
    pipeline.stream(until_caught_up=True)
    pipeline.materialize()
    assert_mirrored(pipeline)
    return pipeline


def _merged(pipeline: Pipeline) -> tuple[int, int]:
    """Stage and merge what the source committed: (batches, of them written by pyiceberg)."""
    pipeline.stream(until_caught_up=True)
    result = pipeline.materialize()["public.items"]
    return result.batches, result.pyiceberg_writes


def _crashed_before_the_cursor_moved(pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage what the source committed and merge it, dying after the Iceberg write, before the cursor moves."""
    pipeline.stream(until_caught_up=True)
    crash_at(monkeypatch, CoordinationStore, "advance_mat_cursor")
    with pytest.raises(Crash):
        pipeline.materialize()
    monkeypatch.undo()


def _operations(pipeline: Pipeline) -> list[str]:
    """The operations of the table's snapshots, oldest first."""
    table = pipeline.catalog.load_table(pipeline.tables["public.items"].iceberg)
    return [str(snapshot.summary.operation.value) for snapshot in table.snapshots() if snapshot.summary]


def test_inserts_are_appended_and_a_replay_after_a_crash_does_not_append_them_twice(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = _mirrored(source, "CREATE TABLE public.items (id bigint PRIMARY KEY, v text)", MOR)
    source.execute("INSERT INTO public.items SELECT g, 'new ' || g FROM generate_series(100, 140) g")
    assert _merged(pipeline) == (1, 1)  # merge-on-read or not: an append
    assert _operations(pipeline)[-1] == "append"
    assert_mirrored(pipeline)

    source.execute("INSERT INTO public.items SELECT g, 'later ' || g FROM generate_series(200, 230) g")
    _crashed_before_the_cursor_moved(pipeline, monkeypatch)
    # The append landed, the cursor did not move: the replay must not append the rows again.
    replayed = _merged(pipeline)
    assert_mirrored(pipeline)
    assert replayed == (1, 0)
    # Once the cursor recorded the table's snapshot again, inserts are appended again.
    source.execute("INSERT INTO public.items VALUES (300, 'after')")
    assert _merged(pipeline) == (1, 1)
    assert_mirrored(pipeline)


def test_a_small_copy_on_write_tables_batch_is_written_by_pyiceberg_and_a_replay_is_harmless(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = _mirrored(source, "CREATE TABLE public.items (id int, v text, PRIMARY KEY (v, id))", COW)
    source.execute("UPDATE public.items SET id = id WHERE id <= 5")  # same key: an update
    source.execute("DELETE FROM public.items WHERE id BETWEEN 10 AND 14")
    source.execute("INSERT INTO public.items VALUES (60, 'sixty'), (12, 'row 12')")  # a deleted key comes back
    assert _merged(pipeline) == (1, 1)
    assert_mirrored(pipeline)

    source.execute("UPDATE public.items SET id = id WHERE id BETWEEN 20 AND 25; DELETE FROM public.items WHERE id = 30")
    _crashed_before_the_cursor_moved(pipeline, monkeypatch)
    assert _merged(pipeline) == (1, 1)  # the keys deleted and the rows appended again: the same table
    assert_mirrored(pipeline)


def test_a_batch_deleting_every_row_of_a_file_leaves_no_file_behind(source: SourceDb) -> None:
    """The files a batch's deletes empty are removed with nothing written in their place."""
    pipeline = _mirrored(source, "CREATE TABLE public.items (id int PRIMARY KEY, v text)", COW)
    source.execute("DELETE FROM public.items")
    batches = _merged(pipeline)
    assert_mirrored(pipeline)
    assert batches == (1, 1)
    table = pipeline.catalog.load_table(pipeline.tables["public.items"].iceberg)
    assert table.scan().to_arrow().num_rows == 0
    source.execute("INSERT INTO public.items VALUES (1, 'back')")
    assert _merged(pipeline) == (1, 1)
    assert_mirrored(pipeline)


@pytest.mark.parametrize(
    ("ddl", "properties", "materialize"),
    [
        ("CREATE TABLE public.items (id int PRIMARY KEY, v text)", MOR, {}),
        ("CREATE TABLE public.items (id int PRIMARY KEY, v text)", COW, {"pyiceberg_max_rows": 0}),
        ("CREATE TABLE public.items (id int PRIMARY KEY, v text)", COW, {"pyiceberg_max_rows": 49}),
        ("CREATE TABLE public.items (id numeric(12, 2) PRIMARY KEY, v text)", COW, {}),
        ("CREATE TABLE public.items (id int PRIMARY KEY, v text, u uuid DEFAULT gen_random_uuid())", COW, {}),
    ],
    ids=["merge-on-read", "turned-off", "table-too-large", "decimal-key", "uuid-column"],
)
def test_batches_pyiceberg_cannot_write_exactly_go_through_spark(
    source: SourceDb, ddl: str, properties: dict[str, str], materialize: dict[str, int]
) -> None:
    pipeline = _mirrored(source, ddl, properties, **materialize)
    source.execute("UPDATE public.items SET v = 'changed' WHERE id <= 5; DELETE FROM public.items WHERE id = 7")
    assert _merged(pipeline) == (1, 0)
    assert_mirrored(pipeline)


def test_a_table_switched_to_copy_on_write_keeps_its_position_deletes(source: SourceDb) -> None:
    """A merge-on-read table's delete files stay after its format changes until maintenance compacts
    them: pyiceberg, rewriting a data file they apply to, keeps the rows they deleted deleted."""
    pipeline = _mirrored(source, "CREATE TABLE public.items (id int PRIMARY KEY, v text)", MOR)
    source.execute("DELETE FROM public.items WHERE id <= 10; UPDATE public.items SET v = 'mor' WHERE id = 20")
    assert _merged(pipeline) == (1, 0)  # position deletes written by Spark
    assert_mirrored(pipeline)
    pipeline.close()
    switched = source.config([{"name": "public.items", "delete_format": "copy-on-write"}])
    pipeline = source.pipeline(switched)
    pipeline.validate()  # the table takes the copy-on-write write modes; its delete files stay
    source.execute("UPDATE public.items SET v = 'cow' WHERE id BETWEEN 11 AND 30")
    batches = _merged(pipeline)
    assert_mirrored(pipeline)
    assert batches == (1, 1)


def test_merges_of_a_copy_on_write_table_keep_its_manifest_list_bounded_and_its_history_readable(
    source: SourceDb,
) -> None:
    """Each merge rewrites the file holding its keys (an overwrite, whose manifest of tombstones only
    its own snapshot needs): the current snapshot keeps only manifests with live files, so a merge
    does not read one more manifest for every merge before it; every earlier snapshot still reads
    as the table was then."""
    pipeline = _mirrored(source, "CREATE TABLE public.items (id int PRIMARY KEY, v text)", COW)
    table_id = pipeline.tables["public.items"].iceberg
    manifests, held = [], {}
    for merge in range(6):
        source.execute(f"UPDATE public.items SET v = 'merge {merge}' WHERE id <= {merge + 1}")
        assert _merged(pipeline) == (1, 1)
        assert_mirrored(pipeline)
        table = pipeline.catalog.load_table(table_id)
        snapshot = table.current_snapshot()
        assert snapshot is not None
        manifests.append(len(snapshot.manifests(table.io)))
        held[snapshot.snapshot_id] = sorted(table.scan().to_arrow().to_pylist(), key=lambda row: row["id"])
    assert manifests == [manifests[0]] * 6, manifests  # a manifest more per merge before
    table = pipeline.catalog.load_table(table_id)
    for snapshot_id, rows in held.items():
        assert sorted(table.scan(snapshot_id=snapshot_id).to_arrow().to_pylist(), key=lambda row: row["id"]) == rows


def test_merges_read_each_manifest_and_manifest_list_once(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """Manifests and manifest lists never change once written (iceberg/manifests.py): a merge's scan
    and overwrite, and every later merge, read each one once, and the table still equals the source
    after every merge (a merge used to read its table's list and manifests three times each). The
    files' few Avro schemas are converted once too, not per file read."""
    pipeline = _mirrored(source, "CREATE TABLE public.items (id int PRIMARY KEY, v text)", COW)
    opened: list[str] = []
    conversions: list[object] = []
    enter, convert = AvroFile.__enter__, AvroSchemaConversion.avro_to_iceberg

    def counted(avro: AvroFile[Any]) -> AvroFile[Any]:
        opened.append(avro.input_file.location)
        return enter(avro)

    def counted_conversion(conversion: AvroSchemaConversion, schema: dict[str, Any]) -> Schema:
        conversions.append(schema)
        return convert(conversion, schema)

    monkeypatch.setattr(AvroFile, "__enter__", counted)
    monkeypatch.setattr(AvroSchemaConversion, "avro_to_iceberg", counted_conversion)
    for merge in range(4):
        source.execute(f"UPDATE public.items SET v = 'merge {merge}' WHERE id % 4 = {merge}")
        source.execute(f"DELETE FROM public.items WHERE id = {merge + 10}")
        assert _merged(pipeline) == (1, 1)
        assert_mirrored(pipeline)
    assert opened, "no manifest read: the merges did not go through pyiceberg"
    read_again = sorted({location for location in opened if opened.count(location) > 1})
    assert not read_again, read_again
    assert not conversions, f"{len(conversions)} schemas converted again for {len(opened)} files read"
