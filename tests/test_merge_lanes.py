"""Several tables merged at once on the one Spark session (``materialize.parallelism``).

Each concurrent merge runs on a lane with its own connections; the tables must come out equal to the
source row by row, and a table whose merge fails must not keep the others from merging.
"""

from __future__ import annotations

import itertools
import threading
import time

import psycopg
import pyarrow as pa
import pytest

from pg2iceberg_dagster.checks import TableCheckReport
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
    assert dup.content.diff is not None and not dup.content.diff.ok
    assert lagging.content.lag == 1 and lagging.content.diff is None


def test_a_difference_still_in_flight_is_inconclusive_and_one_no_change_explains_is_not(source: SourceDb) -> None:
    """A change committed but not merged when its table is compared makes the difference
    inconclusive (a warning in Dagster, not a failure): the flusher stages it while the check waits.
    A row no change explains (only in Iceberg, nothing staged) stays a conclusive difference."""
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
    assert in_flight.content.changes_in_flight and not in_flight.content.conclusive
    assert stray_row.content.diff is not None and stray_row.content.diff.only_in_iceberg == 1
    assert not stray_row.content.changes_in_flight and stray_row.content.conclusive
    assert pipeline.lag(tables[0]).changes == 1 and pipeline.lag(tables[1]).changes == 0


def test_a_source_written_while_its_table_is_checked_is_reported_so(source: SourceDb) -> None:
    """A table written between the check's reading of its statistics and their reading after the
    comparison (an ordinary table, and a partitioned one through its leaves) is reported as written
    during the check, so a difference there is inconclusive; a table nobody wrote is not."""
    quiet, busy, parted = "public.quiet", "public.busy", "public.parted"
    source.execute(f"CREATE TABLE {quiet} (id int PRIMARY KEY, v text)")
    source.execute(f"CREATE TABLE {busy} (id int PRIMARY KEY, v text)")
    source.execute(f"CREATE TABLE {parted} (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
    source.execute(f"CREATE TABLE {parted}_low PARTITION OF {parted} FOR VALUES FROM (0) TO (1000000)")
    source.execute(f"CREATE TABLE {parted}_high PARTITION OF {parted} FOR VALUES FROM (1000000) TO (MAXVALUE)")
    for name in (quiet, busy, parted):
        source.execute(f"INSERT INTO {name} SELECT g, 'v' FROM generate_series(1, 50) g")
    tables = [quiet, busy, parted]
    pipeline = source.pipeline(source.config(tables))
    pipeline.snapshot()

    # Writes all through the check, one transaction at a time (statistics reach other sessions
    # within about a second of a commit).
    done = threading.Event()

    def write() -> None:
        with psycopg.connect(source.conninfo, autocommit=True) as conn:
            for i in itertools.count(2_000_000):
                if done.is_set():
                    return
                conn.execute(f"INSERT INTO {busy} VALUES (%s, 'during')", (i,))
                conn.execute(f"INSERT INTO {parted} VALUES (%s, 'during')", (i,))
                time.sleep(0.05)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        time.sleep(1.0)
        reports = dict(pipeline.check_tables(tables))
    finally:
        done.set()
        writer.join()
    assert not any(isinstance(report, Exception) for report in reports.values()), reports
    for name in (busy, parted):
        report = reports[name]
        assert isinstance(report, TableCheckReport) and report.content.diff is not None
        assert report.content.source_written_during_check and not report.content.conclusive, name
    still = reports[quiet]
    assert isinstance(still, TableCheckReport) and still.content.diff is not None and still.content.diff.ok
    assert not still.content.source_written_during_check and still.content.conclusive
