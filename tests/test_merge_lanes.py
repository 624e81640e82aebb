"""Several tables merged at once on the one Spark session (``materialize.parallelism``).

Each concurrent merge runs on a lane with its own connections; the tables must come out equal to the
source row by row, and a table whose merge fails must not keep the others from merging.
"""

from __future__ import annotations

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
