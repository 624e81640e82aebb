"""Batches written on the merge branch (delete the batch's keys, append its upserts, fast-forward
main) leave Iceberg equal to the source, and main never shows a batch half applied."""

from __future__ import annotations

from typing import Any

import pytest

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.materializer import branch as branch_module
from pg2iceberg_dagster.materializer.spark_sql import spark_identifier
from pg2iceberg_dagster.pipeline import Pipeline

from .conftest import Crash, SourceDb, assert_mirrored, sync

pytestmark = pytest.mark.usefixtures("spark")

MERGE_ON_READ = {f"write.{kind}.mode": "merge-on-read" for kind in ("merge", "update", "delete")}
BIG = "repeat(md5(g::text), 300)"  # stored out of line: an update that leaves it alone does not send it


def _pipeline(source: SourceDb) -> Pipeline:
    """``items`` (ids 1-3000, the first 50 with an out-of-line body), merge-on-read, and every batch
    whose upserts carry all their columns goes through the branch."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, note text, body text)")
    source.execute("ALTER TABLE public.items ALTER COLUMN body SET STORAGE EXTERNAL")
    source.execute(
        f"INSERT INTO public.items SELECT g, 'n' || g, CASE WHEN g <= 50 THEN {BIG} ELSE 'b' END "
        "FROM generate_series(1, 3000) g"
    )
    tables = ["public.items"]
    iceberg = source.config(tables).iceberg.model_dump(mode="json", exclude_none=True)
    iceberg["table_properties"] = {**iceberg["table_properties"], **MERGE_ON_READ}
    config: PipelineConfig = source.config(tables, iceberg=iceberg, materialize={"branch_upsert_min_rows": 0})
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    return pipeline


def _items(pipeline: Pipeline) -> Any:
    return pipeline.catalog.load_table(pipeline.tables["public.items"].iceberg)


def _main_history(pipeline: Pipeline) -> list[int]:
    """The snapshots main pointed at, oldest first: what readers of main could see."""
    return [entry.snapshot_id for entry in _items(pipeline).metadata.snapshot_log]


def _on_branch(pipeline: Pipeline) -> bool:
    """The last merge published the branch (main and the branch are the same snapshot)."""
    refs = _items(pipeline).metadata.refs
    return (
        branch_module.MERGE_BRANCH in refs and refs[branch_module.MERGE_BRANCH].snapshot_id == refs["main"].snapshot_id
    )


def test_batches_on_the_branch_equal_the_source_and_move_main_once_each(source: SourceDb) -> None:
    pipeline = _pipeline(source)
    rounds = [
        (
            "UPDATE items SET note = note || '+' WHERE id % 3 = 0 AND id > 50; "
            "DELETE FROM items WHERE id % 11 = 0 AND id > 50; "
            "INSERT INTO items SELECT g, 'new', 'b' FROM generate_series(5001, 5100) g",
            True,
        ),
        (
            # A key changed, a key deleted and inserted again, a row inserted and deleted: one batch.
            "UPDATE items SET id = id + 10000 WHERE id % 7 = 1 AND id > 50; DELETE FROM items WHERE id = 2; "
            "INSERT INTO items VALUES (2, 'again', 'b'); INSERT INTO items VALUES (9999, 'gone', 'b'); "
            "DELETE FROM items WHERE id = 9999",
            True,
        ),
        # Emptied and refilled: one fast-forward, so no reader of main ever sees the table empty.
        (f"TRUNCATE items; INSERT INTO items SELECT g, 'after truncate', {BIG} FROM generate_series(1, 40) g", True),
        # The bodies stay in Iceberg: a MERGE on main, which leaves the branch behind it.
        ("UPDATE items SET note = 'kept body' WHERE id <= 10", False),
        ("UPDATE items SET body = 'small' WHERE id > 30", True),
    ]
    for statements, through_branch in rounds:
        before = _main_history(pipeline)
        source.execute(statements)
        sync(pipeline)
        assert_mirrored(pipeline)
        after = _main_history(pipeline)
        assert after[: len(before)] == before and len(after) == len(before) + 1, (statements, before, after)
        assert _on_branch(pipeline) == through_branch, statements


def test_a_crash_before_the_fast_forward_leaves_main_untouched(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = _pipeline(source)
    source.execute("UPDATE items SET note = 'first' WHERE id > 100 AND id <= 200")
    sync(pipeline)
    main = _items(pipeline).current_snapshot().snapshot_id
    source.execute("UPDATE items SET note = 'second' WHERE id > 100 AND id <= 300; DELETE FROM items WHERE id > 2900")
    pipeline.stream(until_caught_up=True)

    def crash(name: str) -> None:
        if name == "materializer.before_fast_forward":
            raise Crash

    monkeypatch.setattr(branch_module, "crash_point", crash)
    with pytest.raises(Crash):
        pipeline.materialize(["public.items"])
    monkeypatch.undo()  # the process "restarts" with the real code
    table = _items(pipeline)
    assert table.current_snapshot().snapshot_id == main
    assert not _on_branch(pipeline)  # the batch is on the branch, never published
    notes = table.scan(row_filter="id > 100").to_arrow().column("note").to_pylist()
    assert "second" not in notes and len(notes) == 2900
    sync(pipeline)
    assert_mirrored(pipeline)


def test_a_commit_to_main_while_the_batch_is_on_the_branch_writes_it_again(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer (here a compaction) commits to main between the branch's writes and the
    fast-forward: main is no longer the branch's ancestor, and the batch is written again on top."""
    pipeline = _pipeline(source)
    source.execute("UPDATE items SET note = 'x' WHERE id % 2 = 0 AND id > 50; DELETE FROM items WHERE id % 5 = 0")
    pipeline.stream(until_caught_up=True)
    catalog = spark_identifier(pipeline.config.iceberg.catalog.name)
    table = spark_identifier(*pipeline.tables["public.items"].iceberg)
    compactions: list[int] = []

    def compact_once(name: str) -> None:
        if name == "materializer.before_fast_forward" and not compactions:
            pipeline.spark().sql(
                f"CALL {catalog}.system.rewrite_data_files(table => '{table}', options => map('rewrite-all', 'true'))"
            ).collect()
            compactions.append(_items(pipeline).current_snapshot().snapshot_id)

    monkeypatch.setattr(branch_module, "crash_point", compact_once)
    pipeline.materialize(["public.items"])
    monkeypatch.undo()
    assert compactions
    history = _main_history(pipeline)
    assert history[-2] == compactions[0], "the batch was not published on top of the compaction"
    assert _on_branch(pipeline)
    assert_mirrored(pipeline)
