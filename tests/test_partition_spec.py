"""Partition spec and sort order per table (``partition_by``, ``sort_by``): the snapshot writes
partitioned, sorted files, Spark's MERGE keeps them partitioned (a row moving to another day too),
a changed config evolves the spec, a bad one is refused before anything is written, and DDL on a
partition column neither stalls the mirror nor leaves it quietly wrong.

Every test compares Iceberg with PostgreSQL row by row and looks at the data files themselves.
"""

from __future__ import annotations

from typing import Any

import pyarrow.parquet as pq
import pytest

from pg2iceberg_dagster.cleanup import remove_tables
from pg2iceberg_dagster.errors import ConfigError, StartupCheckError
from pg2iceberg_dagster.tables import MirroredTables

from .conftest import SourceDb, assert_mirrored, sync, written_anything

pytestmark = pytest.mark.usefixtures("spark")

EVENTS = {
    "name": "public.events",
    "partition_by": ["day(created_at)", "bucket(4, id)"],
    "sort_by": ["created_at desc", "name asc nulls last"],
}


def _events(source: SourceDb, rows: int = 300) -> None:
    source.execute("CREATE TABLE public.events (id int PRIMARY KEY, created_at timestamptz, name text, n int)")
    source.execute(
        "INSERT INTO public.events SELECT g, timestamptz '2024-01-01 00:00+00' + (g % 5) * interval '1 day' "
        "+ g * interval '1 minute', CASE WHEN g % 7 = 0 THEN NULL ELSE 'n' || g END, g "
        f"FROM generate_series(1, {rows}) g"
    )


def _files(pipeline: Any, source: SourceDb, table: str = "events") -> list[dict[str, Any]]:
    """The live data files of the table: spec id, partition values, row count, sort order id."""
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.{table}")
    return iceberg.inspect.files().select(["spec_id", "partition", "record_count", "file_path"]).to_pylist()


def _spec(pipeline: Any, source: SourceDb, table: str = "events") -> list[tuple[str, str]]:
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.{table}")
    schema = iceberg.schema()
    return [(str(f.transform), schema.find_column_name(f.source_id)) for f in iceberg.spec().fields]


def test_snapshot_and_merges_write_partitioned_sorted_files(source: SourceDb) -> None:
    """Snapshot, then inserts, updates (one moving a row to another day), deletes and a key change
    merged by Spark: Iceberg equals the source, and every data file belongs to one day and one bucket."""
    _events(source)
    pipeline = source.pipeline(source.config([EVENTS]))
    pipeline.snapshot()
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.events")
    assert _spec(pipeline, source) == [("day", "created_at"), ("bucket[4]", "id")]
    assert [f.name for f in iceberg.spec().fields] == ["created_at_day", "id_bucket_4"]
    order = iceberg.sort_order()
    assert [(str(f.direction), str(f.null_order)) for f in order.fields] == [
        ("DESC", "NULLS LAST"),
        ("ASC", "NULLS LAST"),
    ]
    snapshot_files = _files(pipeline, source)
    # 5 days x up to 4 buckets, each file holding exactly one (day, bucket).
    assert len({(f["partition"]["created_at_day"], f["partition"]["id_bucket_4"]) for f in snapshot_files}) > 10
    assert all(f["partition"]["created_at_day"] is not None for f in snapshot_files)
    biggest = max(snapshot_files, key=lambda f: f["record_count"])
    assert biggest["record_count"] > 1
    times = pq.read_table(biggest["file_path"].removeprefix("file://")).column("created_at").to_pylist()
    assert times == sorted(times, reverse=True)  # the snapshot sorted each chunk by the sort order

    source.execute("UPDATE public.events SET created_at = created_at + interval '10 days' WHERE id = 3")
    source.execute("UPDATE public.events SET name = 'renamed' WHERE id BETWEEN 10 AND 20")
    source.execute("DELETE FROM public.events WHERE id % 11 = 0")
    source.execute("INSERT INTO public.events VALUES (1000, '2024-02-01 12:00+00', 'new', 0), (1001, NULL, 'x', 1)")
    source.execute("UPDATE public.events SET id = 2000 WHERE id = 5")
    sync(pipeline)
    assert_mirrored(pipeline)
    files = _files(pipeline, source)
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.events")
    moved = iceberg.scan(row_filter="id = 3").to_arrow().to_pylist()[0]
    assert moved["created_at"].day == 14
    days = {f["partition"]["created_at_day"] for f in files}
    assert moved["created_at"].date() in days and None in days  # Spark wrote the moved row's new day
    assert all(f["spec_id"] == iceberg.spec().spec_id for f in files)
    # Each file holds the rows of its own partition only.
    for file in files:
        table = pq.read_table(file["file_path"].removeprefix("file://"))
        assert {None if t is None else t.date() for t in table.column("created_at").to_pylist()} == {
            file["partition"]["created_at_day"]
        }


def test_a_changed_config_evolves_the_spec_and_keeps_older_files(source: SourceDb) -> None:
    """The config's partition_by changes between runs: the table gets a new spec before the next write,
    older files keep theirs, rows stay equal; removing partition_by makes new writes unpartitioned."""
    _events(source, rows=100)
    pipeline = source.pipeline(source.config([EVENTS]))
    pipeline.snapshot()
    first_spec = pipeline.catalog.load_table(f"{source.name}_public.events").spec().spec_id
    pipeline.close()

    changed = {**EVENTS, "partition_by": ["month(created_at)", "truncate(2, name)"], "sort_by": ["id"]}
    pipeline = source.pipeline(source.config([changed]))
    source.execute("UPDATE public.events SET n = -1 WHERE id <= 10")
    source.execute("INSERT INTO public.events VALUES (500, '2024-03-05 00:00+00', 'zz', 5)")
    sync(pipeline)
    assert_mirrored(pipeline)
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.events")
    assert iceberg.spec().spec_id != first_spec
    assert _spec(pipeline, source) == [("month", "created_at"), ("truncate[2]", "name")]
    assert [str(f.direction) for f in iceberg.sort_order().fields] == ["ASC"]
    specs = {f["spec_id"] for f in _files(pipeline, source)}
    assert specs == {first_spec, iceberg.spec().spec_id}  # older files kept theirs
    pipeline.close()

    pipeline = source.pipeline(source.config(["public.events"]))
    source.execute("UPDATE public.events SET n = -2 WHERE id = 500")
    sync(pipeline)
    assert_mirrored(pipeline)
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.events")
    assert iceberg.spec().is_unpartitioned() and iceberg.sort_order().is_unsorted
    newest = iceberg.spec().spec_id
    assert newest in {f["spec_id"] for f in _files(pipeline, source)}


def test_a_resync_and_a_table_added_back_keep_the_configured_spec(source: SourceDb) -> None:
    """A resync (a type change of another column) and a table taken out of the config and put back
    (its Iceberg table kept, rebuilt and read again) write their copies with the configured spec."""
    _events(source, rows=120)
    config = source.config([EVENTS])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    source.execute("ALTER TABLE public.events ALTER COLUMN n TYPE text USING 'n' || n::text")
    source.execute("UPDATE public.events SET name = 'after' WHERE id = 1")
    pipeline.stream(until_caught_up=True)
    assert pipeline.materialize()["public.events"].resync_reason
    pipeline.resync("public.events")
    sync(pipeline)
    assert_mirrored(pipeline)
    files = _files(pipeline, source)
    assert len(files) > 5 and all(f["partition"]["created_at_day"] is not None for f in files)
    assert _spec(pipeline, source) == [("day", "created_at"), ("bucket[4]", "id")]
    pipeline.close()

    # Taken out of the config (its Iceberg table stays) and put back with another partition_by: the
    # kept table is rebuilt and read again, its new files partitioned the new way.
    source.execute("CREATE TABLE public.other (id int PRIMARY KEY)")
    without = source.pipeline(source.config(["public.other"]))
    events = MirroredTables(config)["public.events"]
    remove_tables(config, without.store, without.objects, without.catalog, [events], drop_iceberg=False)
    without.close()
    source.execute("UPDATE public.events SET name = 'while out' WHERE id = 2")
    back = source.pipeline(source.config(["public.other", {**EVENTS, "partition_by": ["truncate(2, name)"]}]))
    back.snapshot()
    sync(back)
    assert_mirrored(back)
    assert _spec(back, source) == [("truncate[2]", "name")]
    live = _files(back, source)
    assert live and all("name_trunc_2" in f["partition"] for f in live)


def test_a_partition_column_dropped_or_renamed_at_the_source(source: SourceDb) -> None:
    """RENAME keeps partitioning and sorting (Iceberg follows the field). DROP leaves its terms out of
    the spec and sort order from the next write on, reported in the merge's changes, and the merge
    goes on. Any startup check then refuses the config, naming the column and what to change; the
    config changed accordingly, the mirror goes on with the spec it has."""
    _events(source, rows=60)
    pipeline = source.pipeline(source.config([EVENTS]))
    pipeline.snapshot()
    spec_before = pipeline.catalog.load_table(f"{source.name}_public.events").spec().spec_id
    source.execute("ALTER TABLE public.events RENAME COLUMN name TO label")
    source.execute("ALTER TABLE public.events DROP COLUMN created_at")
    source.execute("INSERT INTO public.events VALUES (100, 'x', 1)")
    source.execute("UPDATE public.events SET label = 'y' WHERE id = 2")
    pipeline.stream(until_caught_up=True)
    result = pipeline.materialize()["public.events"]
    assert result.resync_reason is None and result.changes == 2
    assert any("partition_by day(created_at) left out: column created_at is gone" in c for c in result.schema_changes)
    assert any("sort_by created_at desc nulls last left out" in c for c in result.schema_changes)
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.events")
    assert _spec(pipeline, source) == [("bucket[4]", "id")] and iceberg.spec().spec_id != spec_before
    assert [iceberg.schema().find_column_name(f.source_id) for f in iceberg.sort_order().fields] == ["label"]
    newest = [f for f in _files(pipeline, source) if f["spec_id"] == iceberg.spec().spec_id]
    assert newest and all(set(f["partition"]) >= {"id_bucket_4"} for f in newest)
    with pytest.raises(StartupCheckError, match=r"public\.events: partition_by day\(created_at\): the source table "
                       r"has no column created_at \(renamed or dropped\?\); name one of its columns in partition_by, "
                       r"or remove the item; sort_by created_at .*sort_by name asc"):  # fmt: skip
        pipeline.verify()
    pipeline.close()

    fixed = {**EVENTS, "partition_by": ["bucket(4, id)"], "sort_by": ["label asc nulls last"]}
    pipeline = source.pipeline(source.config([fixed]))
    source.execute("UPDATE public.events SET n = 7 WHERE id = 3")
    sync(pipeline)
    assert_mirrored(pipeline)
    assert pipeline.catalog.load_table(f"{source.name}_public.events").spec().spec_id == iceberg.spec().spec_id


@pytest.mark.parametrize(
    ("partition_by", "message"),
    [
        (["day(created_at)", "days(id)"], r"tables\.0\.partition_by\.1: unknown transform 'days'"),
        (["bucket(id)"], r"tables\.0\.partition_by\.0: bucket needs a number of buckets"),
        (["truncate(0, name)"], r"tables\.0\.partition_by\.0: truncate needs a width from 1"),
        (["day(created_at)", "hour(created_at)"], r"tables\.0\.partition_by: column created_at is listed twice"),
        (["id desc"], r"tables\.0\.partition_by\.0: expected a column"),
    ],
)
def test_a_malformed_partition_expression_fails_at_config_parse(
    source: SourceDb, partition_by: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        source.config([{"name": "public.events", "partition_by": partition_by}])


def test_a_malformed_sort_expression_fails_at_config_parse(source: SourceDb) -> None:
    with pytest.raises(ConfigError, match=r"tables\.0\.sort_by\.1: expected 'column \[asc\|desc\]"):
        source.config([{"name": "public.events", "sort_by": ["id", "name sideways"]}])


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"partition_by": ["day(created)"]},
            r"public\.events: partition_by day\(created\): the source table has no column created",
        ),
        ({"partition_by": ["day(n)"]}, r"day\(\) does not apply to n, stored as Iceberg int: it applies to date"),
        ({"partition_by": ["truncate(4, created_at)"]}, r"truncate\(\) does not apply to created_at"),
        ({"partition_by": ["bucket(8, ratio)"]}, r"bucket\(\) does not apply to ratio, stored as Iceberg double"),
        ({"partition_by": ["ratio"]}, r"NaN"),
        ({"sort_by": ["tags"]}, r"sort_by tags asc nulls first: tags, stored as Iceberg list<string>"),
        ({"sort_by": ["nope desc"]}, r"sort_by nope desc nulls last: the source table has no column nope"),
    ],
)
def test_a_column_or_type_the_layout_cannot_use_is_refused_at_startup(
    source: SourceDb, table: dict[str, Any], message: str
) -> None:
    """Refused by the startup checks, naming table, column and reason, with nothing written."""
    source.execute(
        "CREATE TABLE public.events (id int PRIMARY KEY, created_at timestamptz, n int, ratio float8, tags text[])"
    )
    config = source.config([{"name": "public.events", **table}])
    pipeline = source.pipeline(config)
    with pytest.raises(StartupCheckError, match=message):
        pipeline.snapshot()
    assert written_anything(config) == []
