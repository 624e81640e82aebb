"""Several tables merged at once on the one Spark session (``materialize.parallelism``).

Each concurrent merge runs on a lane with its own connections; the tables must come out equal to the
source row by row, and a table whose merge fails must not keep the others from merging.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from pg2iceberg_dagster.errors import ResyncRequiredError

from .conftest import SourceDb

pytestmark = pytest.mark.usefixtures("spark")

TABLES = [f"public.lane{i}" for i in range(6)]


def test_tables_merged_at_once_equal_the_source_and_a_refused_one_holds_back_no_other(source: SourceDb) -> None:
    for i, name in enumerate(TABLES):
        source.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text, n numeric)")
        source.execute(f"INSERT INTO {name} SELECT g, 'v' || g, g * {i} FROM generate_series(1, {200 + 50 * i}) g")
    pipeline = source.pipeline(source.config(TABLES, materialize={"parallelism": 3, "auto_resync": False}))
    pipeline.snapshot()
    for round_ in range(3):
        for i, name in enumerate(TABLES):
            first = 1000 * (round_ + 1)
            source.execute(f"INSERT INTO {name} SELECT g, 'new', {round_} FROM generate_series({first}, {first + i}) g")
            source.execute(f"UPDATE {name} SET v = v || '+{round_}' WHERE id % {i + 2} = 0")
            source.execute(f"DELETE FROM {name} WHERE id % 11 = {round_ + i}")
        pipeline.stream(until_caught_up=True)
        results = pipeline.materialize()
        assert sorted(results) == sorted(TABLES)
        diffs = pipeline.verify()
        assert all(d.ok for d in diffs), [d for d in diffs if not d.ok]

    # A default no WAL change carries: with auto_resync off, lane2's merge refuses.
    refused = "public.lane2"
    source.execute(f"ALTER TABLE {refused} ADD COLUMN token text DEFAULT md5(random()::text)")
    for name in TABLES:
        source.execute(f"INSERT INTO {name} (id, v) VALUES (99999, 'after')")
    pipeline.stream(until_caught_up=True)
    cursor_before = pipeline.store.mat_cursor("default", refused)
    with pytest.raises(ResyncRequiredError, match=r"public\.lane2: column token was added with a default"):
        pipeline.materialize()
    assert pipeline.store.mat_cursor("default", refused) == cursor_before
    others = [name for name in TABLES if name != refused]
    diffs = pipeline.verify(others)
    assert all(d.ok for d in diffs), [d for d in diffs if not d.ok]
    assert all(pipeline.lag(name).changes == 0 for name in others)


def test_checks_of_several_tables_at_once_report_each_table_its_own(source: SourceDb) -> None:
    """``check_tables`` checks tables on several threads: each report must be its own table's."""
    tables = TABLES[:4]
    for i, name in enumerate(tables):
        source.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO {name} SELECT g, 'v' FROM generate_series(1, {100 * (i + 1)}) g")
    pipeline = source.pipeline(source.config(tables, materialize={"parallelism": 4}))
    pipeline.snapshot()
    source.execute(f"INSERT INTO {tables[3]} VALUES (100000, 'staged, not merged')")
    pipeline.stream(until_caught_up=True)
    duplicated = pipeline.catalog.load_table(f"{source.name}_{tables[1]}")
    duplicated.append(pa.Table.from_pylist([{"id": 7, "v": "dup"}], schema=duplicated.schema().as_arrow()))

    reports = dict(pipeline.check_tables(tables))
    assert sorted(reports) == sorted(tables)
    assert not any(isinstance(report, Exception) for report in reports.values()), reports
    clean, dup, clean_too, lagging = (reports[name] for name in tables)
    for report, rows in ((clean, 100), (clean_too, 300)):
        assert report.duplicate_keys == 0 and not report.schema_problems
        assert report.content.diff is not None and report.content.diff.ok and report.content.diff.pg_rows == rows
    assert dup.duplicate_keys == 1 and dup.duplicate_examples == [(7,)]
    assert dup.content.diff is not None and not dup.content.diff.ok and dup.content.failed
    # Lagging, still compared: the one difference is the staged change not merged yet.
    assert lagging.content.lag == 1 and lagging.content.diff is not None and lagging.content.diff.only_in_pg == 1
    assert lagging.content.passed and lagging.content.explained == 1


def test_a_change_staged_while_the_check_waits_explains_its_difference_and_a_stray_row_fails(
    source: SourceDb,
) -> None:
    """A change committed but not staged when its table is compared explains its difference once the
    flusher stages it while the check waits: a pass. A row no change explains (only in Iceberg,
    nothing staged) is a conclusive failure."""
    tables = TABLES[:2]
    for name in tables:
        source.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO {name} SELECT g, 'v' FROM generate_series(1, 50) g")
    pipeline = source.pipeline(source.config(tables))
    pipeline.snapshot()
    source.execute(f"INSERT INTO {tables[0]} VALUES (1000, 'committed, not staged yet')")
    stray = pipeline.catalog.load_table(f"{source.name}_{tables[1]}")
    stray.append(pa.Table.from_pylist([{"id": 5000, "v": "stray"}], schema=stray.schema().as_arrow()))

    # The flusher stages while the check waits for it (after both comparisons have started).
    flusher = threading.Timer(3.0, lambda: pipeline.stream(until_caught_up=True))
    flusher.start()
    try:
        reports = dict(pipeline.check_tables(tables))
    finally:
        flusher.join()
    in_flight, stray_row = (reports[name] for name in tables)
    assert not isinstance(in_flight, Exception) and not isinstance(stray_row, Exception)
    assert in_flight.content.diff is not None and in_flight.content.diff.only_in_pg == 1
    assert in_flight.content.passed and in_flight.content.explained == 1
    assert stray_row.content.diff is not None and stray_row.content.diff.only_in_iceberg == 1
    assert stray_row.content.failed and stray_row.content.unexplained_examples == ((5000,),)
    assert pipeline.lag(tables[0]).changes == 1 and pipeline.lag(tables[1]).changes == 0
