"""A partitioned source table is one Iceberg table: the snapshot reads its leaf partitions' CTID
chunks under one exported snapshot, the stream sends their changes as the parent's, and partitions
attached, detached, dropped or truncated while the pipeline runs are reconciled. Every test compares
Iceberg with PostgreSQL row by row."""

from __future__ import annotations

import pytest

from pg2iceberg_dagster.errors import StartupCheckError

from .conftest import SourceDb, assert_mirrored, sync

pytestmark = pytest.mark.usefixtures("spark")

# Two levels: a list partition split again by range, a plain one, and a default partition.
EVENTS = [
    "CREATE TABLE public.events (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)",
    "CREATE TABLE public.events_eu PARTITION OF public.events FOR VALUES IN ('eu') PARTITION BY RANGE (id)",
    "CREATE TABLE public.events_eu_low PARTITION OF public.events_eu FOR VALUES FROM (MINVALUE) TO (500)",
    "CREATE TABLE public.events_eu_high PARTITION OF public.events_eu FOR VALUES FROM (500) TO (MAXVALUE)",
    "CREATE TABLE public.events_us PARTITION OF public.events FOR VALUES IN ('us')",
    "CREATE TABLE public.events_other PARTITION OF public.events DEFAULT",
    "INSERT INTO public.events SELECT g, (ARRAY['eu', 'us', 'apac'])[g % 3 + 1], repeat('x', 300) "
    "FROM generate_series(1, 1500) g",
]


def _events(source: SourceDb) -> None:
    for statement in EVENTS:
        source.execute(statement)


def test_a_partitioned_table_is_snapshotted_per_leaf_and_streamed_as_one_table(source: SourceDb) -> None:
    """Chunks are planned per leaf (at every level), the Iceberg table is one, and inserts, updates,
    a row moved to another partition and deletes on every leaf arrive through the parent."""
    _events(source)
    pipeline = source.pipeline(source.config(["public.events"]))
    pipeline.snapshot()
    chunks = pipeline.store.chunks("public.events")
    assert {chunk.leaf for chunk in chunks} == {
        ("public", name) for name in ["events_eu_low", "events_eu_high", "events_us", "events_other"]
    }
    assert len(chunks) > 4 and all(
        chunk.partition_key.startswith(f"{chunk.leaf[0]}.{chunk.leaf[1]}.ctid_") for chunk in chunks
    )  # type: ignore[index]
    assert_mirrored(pipeline)

    source.execute("INSERT INTO public.events SELECT g, 'eu', 'new' FROM generate_series(2000, 2100) g")
    source.execute("UPDATE public.events SET v = 'updated' WHERE id % 10 = 0")
    source.execute("UPDATE public.events SET region = 'us' WHERE id = 3 AND region = 'apac'")  # moves partition
    source.execute("UPDATE public.events SET id = id + 10000 WHERE id = 6 AND region = 'apac'")  # key change
    source.execute("DELETE FROM public.events WHERE id % 7 = 0")
    sync(pipeline)
    assert pipeline.resyncs_pending() == {}
    assert_mirrored(pipeline)
    namespace = (f"{source.name}_public",)
    assert [name for _, name in pipeline.catalog.list_tables(namespace)] == ["events"]


def test_partitions_attached_detached_dropped_or_truncated_while_running_are_reconciled(source: SourceDb) -> None:
    """A partition created empty only streams. A table attached with rows, a partition detached or
    dropped, a partition truncated alone: each moves rows with no WAL change, and the next merge
    resyncs the table while its changes keep staging."""
    _events(source)
    pipeline = source.pipeline(source.config(["public.events"]))
    pipeline.snapshot()

    source.execute("CREATE TABLE public.events_emea PARTITION OF public.events FOR VALUES IN ('emea')")
    source.execute("INSERT INTO public.events SELECT g, 'emea', 'emea' FROM generate_series(1, 50) g")
    sync(pipeline)
    assert pipeline.resyncs_pending() == {}
    assert_mirrored(pipeline)

    def reconciled(reason: str) -> None:
        source.execute("UPDATE public.events SET v = 'meanwhile' WHERE id = 1")
        pipeline.stream(until_caught_up=True)
        result = pipeline.materialize()["public.events"]
        assert reason in (result.resync_reason or ""), result
        source.execute("UPDATE public.events SET v = 'before the resync' WHERE id = 2")
        pipeline.resync("public.events")
        source.execute("UPDATE public.events SET v = 'after the resync' WHERE id = 4")
        sync(pipeline)
        assert pipeline.resyncs_pending() == {}
        assert_mirrored(pipeline)

    source.execute("CREATE TABLE public.events_latam (LIKE public.events)")
    source.execute("INSERT INTO public.events_latam SELECT g, 'latam', 'attached' FROM generate_series(1, 40) g")
    source.execute("ALTER TABLE public.events ATTACH PARTITION public.events_latam FOR VALUES IN ('latam')")
    reconciled("was attached holding rows")

    source.execute("ALTER TABLE public.events DETACH PARTITION public.events_us")
    reconciled("detached or dropped")

    source.execute("DROP TABLE public.events_eu_high")
    reconciled("detached or dropped")

    source.execute("TRUNCATE public.events_other")
    reconciled("truncated or rewritten")


# Partitions that join and leave between two merges. The leaf comparison sees the catalog at merge
# time only, which keeps no trace of a dropped or detached leaf, while the rows' WAL changes were
# staged and merged: Iceberg keeps rows the source no longer has. Known defect (soak seed 16), see
# "Partitioned tables" in docs/correctness.md; strict, so a fix makes these tests fail until unmarked.
BETWEEN_MERGES = {
    # Soak seed 16: a table attached holding rows (no WAL change), two of its rows updated (WAL
    # changes), then the partition dropped (no WAL change).
    "attached_updated_dropped": [
        "CREATE TABLE public.events_latam (LIKE public.events)",
        "INSERT INTO public.events_latam SELECT g, 'latam', 'attached' FROM generate_series(1, 40) g",
        "ALTER TABLE public.events ATTACH PARTITION public.events_latam FOR VALUES IN ('latam')",
        "UPDATE public.events SET v = 'updated' WHERE region = 'latam' AND id IN (7, 9)",
        "DROP TABLE public.events_latam",
    ],
    # A partition created empty, rows inserted into it (WAL changes), then dropped.
    "created_filled_dropped": [
        "CREATE TABLE public.events_emea PARTITION OF public.events FOR VALUES IN ('emea')",
        "INSERT INTO public.events SELECT g, 'emea', 'emea' FROM generate_series(1, 30) g",
        "DROP TABLE public.events_emea",
    ],
    # Detached, changed while detached (changes the publication does not send), attached again: the
    # same oid and relfilenode as recorded.
    "detached_changed_attached": [
        "ALTER TABLE public.events DETACH PARTITION public.events_us",
        "DELETE FROM public.events_us WHERE id < 100",
        "INSERT INTO public.events_us SELECT g, 'us', 'while detached' FROM generate_series(5000, 5020) g",
        "ALTER TABLE public.events ATTACH PARTITION public.events_us FOR VALUES IN ('us')",
    ],
}


@pytest.mark.xfail(strict=True, reason="a partition that joins and leaves between two merges is not noticed")
@pytest.mark.parametrize("sequence", sorted(BETWEEN_MERGES))
def test_partitions_joining_and_leaving_between_two_merges_are_reconciled(source: SourceDb, sequence: str) -> None:
    """After the sequence, a merge, the resyncs it requested and another merge, Iceberg equals the source."""
    _events(source)
    pipeline = source.pipeline(source.config(["public.events"]))
    pipeline.snapshot()
    for statement in BETWEEN_MERGES[sequence]:
        source.execute(statement)
    sync(pipeline)
    for table_key in pipeline.resyncs_pending():
        pipeline.resync(table_key)
    sync(pipeline)
    assert_mirrored(pipeline)


def test_a_publication_not_publishing_through_the_root_is_refused(source: SourceDb) -> None:
    """Without publish_via_partition_root the changes would come as the leaves' own: refused with the fix."""
    _events(source)
    config = source.config(["public.events"])
    source.execute(f"CREATE PUBLICATION {config.replication.publication} FOR TABLE public.events")
    with pytest.raises(StartupCheckError, match=r"publish_via_partition_root = true"):
        source.pipeline(config).snapshot()


def test_a_table_others_inherit_from_is_mirrored_with_its_own_rows(source: SourceDb) -> None:
    """Partitioning by INHERITS (before declarative partitioning): a query on the parent shows its
    children's rows too, but the WAL carries their changes as the children's. The parent's mirror
    holds the parent's own rows (``FROM ONLY``) and a child configured beside it its own; before,
    the snapshot read the children's rows into the parent and their later changes never followed."""
    for statement in [
        "CREATE TABLE public.measures (id int PRIMARY KEY, v text)",
        "CREATE TABLE public.measures_2024 (extra int) INHERITS (public.measures)",
        "ALTER TABLE public.measures_2024 ADD PRIMARY KEY (id)",
        "CREATE TABLE public.measures_2025 () INHERITS (public.measures)",
        "ALTER TABLE public.measures_2025 ADD PRIMARY KEY (id)",
        "INSERT INTO public.measures SELECT g, 'parent' FROM generate_series(1, 50) g",
        "INSERT INTO public.measures_2024 SELECT g, 'y2024', g FROM generate_series(101, 150) g",
        "INSERT INTO public.measures_2025 SELECT g, 'y2025' FROM generate_series(201, 250) g",
    ]:
        source.execute(statement)
    pipeline = source.pipeline(source.config(["public.measures", "public.measures_2024"]))
    pipeline.snapshot()
    source.execute("UPDATE public.measures SET v = 'changed'")  # the parent's and both children's rows
    source.execute("DELETE FROM public.measures_2024 WHERE id > 140")
    source.execute("INSERT INTO public.measures_2025 VALUES (300, 'new')")
    source.execute("INSERT INTO public.measures VALUES (60, 'new')")
    sync(pipeline)
    for table, columns in [("measures", "id, v"), ("measures_2024", "id, v, extra")]:
        expected = source.execute(f"SELECT {columns} FROM ONLY public.{table} ORDER BY id")
        iceberg = pipeline.catalog.load_table(f"{source.name}_public.{table}").scan().to_arrow()
        rows = sorted(tuple(row.values()) for row in iceberg.select(columns.split(", ")).to_pylist())
        assert rows == [tuple(row) for row in expected]
    assert len(source.execute("SELECT 1 FROM public.measures")) == 51 + 40 + 51  # what ONLY leaves out
    assert_mirrored(pipeline)
