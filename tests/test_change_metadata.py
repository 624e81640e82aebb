"""Change metadata columns (issue 32 part 3): every Iceberg row carries the commit LSN and source commit
time of its last change and when it was merged. The values are compared, row by row, with what the
source said to the test's own writer around each transaction (``pg_current_wal_insert_lsn()`` and
``clock_timestamp()`` before and after its COMMIT), through the snapshot, both fold paths (plain
changes, unchanged TOAST values), key changes, deletes, transactions committed in another order than
they wrote, and a restart; ``verify`` and the checks compare source columns only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from pg2iceberg_dagster.config import parse_config
from pg2iceberg_dagster.dagster_integration.assets import _table_schema
from pg2iceberg_dagster.dagster_integration.mirror import Mirror
from pg2iceberg_dagster.dagster_integration.translator import Pg2IcebergTranslator
from pg2iceberg_dagster.errors import ConfigError, StartupCheckError

from .conftest import SourceDb, assert_mirrored, sync

pytestmark = pytest.mark.usefixtures("spark")

KEY = "public.items"
METADATA = ["_pg_lsn", "_pg_committed_at", "_pg_merged_at"]


@dataclass
class Commit:
    """What the source said around one of the test's transactions, and the keys it left changed."""

    lsn_before: int = 0
    lsn_after: int = 0
    time_before: datetime | None = None
    time_after: datetime | None = None
    keys: set[int] = field(default_factory=set)


def _lsn(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint").fetchone()
    assert row is not None
    return int(row[0])


def _now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


class Writer:
    """Runs transactions on the source and remembers, per key, the last transaction that changed it
    (``None`` for a deleted key)."""

    def __init__(self, source: SourceDb) -> None:
        self.source = source
        self.last: dict[int, Commit | None] = {}

    @contextlib.contextmanager
    def transaction(self, keys: set[int], deleted: set[int] = frozenset()) -> Iterator[psycopg.Connection]:  # type: ignore[assignment]
        """One transaction changing ``keys`` (and deleting ``deleted``); its statements run in the block."""
        commit = Commit(keys=keys)
        with psycopg.connect(self.source.conninfo, autocommit=True) as conn:
            commit.lsn_before = _lsn(conn)
            conn.execute("BEGIN")
            yield conn
            commit.time_before = _now(conn)
            conn.execute("COMMIT")
            commit.lsn_after, commit.time_after = _lsn(conn), _now(conn)
        self.last.update(dict.fromkeys(keys, commit))
        self.last.update(dict.fromkeys(deleted, None))


def _create(source: SourceDb) -> None:
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text, body text)")
    # body: incompressible and large on every 4th row, so an UPDATE not touching it sends it as unchanged.
    source.execute(
        "INSERT INTO public.items SELECT g, 'n' || g, CASE WHEN g % 4 = 0 THEN (SELECT string_agg(md5(random()::text "
        "|| g || s), '') FROM generate_series(1, 300) s) END FROM generate_series(1, 60) g"
    )
    source.execute("CREATE TABLE public.plain (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.plain VALUES (1, 'a')")


def _config(source: SourceDb) -> Any:
    return source.config([KEY, {"name": "public.plain", "change_metadata": False}], change_metadata={"enabled": True})


def _metadata_rows(pipeline: Any, source: SourceDb) -> dict[int, dict[str, Any]]:
    table = pipeline.catalog.load_table((f"{source.name}_public", "items"))
    assert list(table.schema().column_names[-3:]) == METADATA
    return {row["id"]: row for row in table.scan().to_arrow().to_pylist()}


def _assert_metadata(pipeline: Any, source: SourceDb, writer: Writer, snapshot: Commit) -> None:
    """Each row's metadata equals what the source said of its last change (or of the snapshot)."""
    rows = _metadata_rows(pipeline, source)
    live = {key for (key,) in source.execute("SELECT id FROM public.items")}
    assert set(rows) == live
    now = datetime.now(UTC)
    snapshot_lsns = set()
    for key, row in rows.items():
        commit = writer.last.get(key)
        if commit is None:  # as the snapshot copied it
            assert snapshot.lsn_before <= row["_pg_lsn"] <= snapshot.lsn_after, key
            assert row["_pg_committed_at"] is None, key
            assert snapshot.time_before is not None and snapshot.time_after is not None
            assert snapshot.time_before <= row["_pg_merged_at"] <= snapshot.time_after, key
            snapshot_lsns.add(row["_pg_lsn"])
            continue
        assert commit.lsn_before < row["_pg_lsn"] <= commit.lsn_after, (key, row["_pg_lsn"], commit)
        assert commit.time_before is not None and commit.time_after is not None
        assert commit.time_before <= row["_pg_committed_at"] <= commit.time_after, key
        assert commit.time_after <= row["_pg_merged_at"] <= now, key
    assert len(snapshot_lsns) <= 1  # one snapshot LSN for every copied row


def test_metadata_columns_carry_each_rows_last_commit_through_snapshot_stream_and_restart(source: SourceDb) -> None:
    """Snapshot rows carry the snapshot's LSN and no commit time; merged rows (vectorized fold, TOAST
    fold, key changes) their last transaction's commit LSN and time, in commit order even when
    transactions commit in another order than they wrote; a table that opts out has no such columns;
    verify, the checks and the Dagster column schema treat the columns as what they are."""
    _create(source)
    writer = Writer(source)
    pipeline = source.pipeline(_config(source))
    pipeline.validate()
    snapshot = Commit()
    with psycopg.connect(source.conninfo, autocommit=True) as conn:
        snapshot.lsn_before, snapshot.time_before = _lsn(conn), _now(conn)
    pipeline.snapshot()
    with psycopg.connect(source.conninfo, autocommit=True) as conn:
        snapshot.lsn_after, snapshot.time_after = _lsn(conn), _now(conn)
    _assert_metadata(pipeline, source, writer, snapshot)
    plain = pipeline.catalog.load_table((f"{source.name}_public", "plain"))
    assert not set(METADATA) & set(plain.schema().column_names)

    # Plain changes only: the vectorized fold.
    with writer.transaction({1, 2, 100}) as conn:
        conn.execute("UPDATE public.items SET name = 'first' WHERE id IN (1, 2)")
        conn.execute("INSERT INTO public.items VALUES (100, 'new', NULL)")
    with writer.transaction({2, 3}) as conn:
        conn.execute("UPDATE public.items SET name = 'second' WHERE id IN (2, 3)")
    sync(pipeline)
    _assert_metadata(pipeline, source, writer, snapshot)

    # Committed in the other order than written: the later commit has the larger LSN.
    first = psycopg.connect(source.conninfo, autocommit=True)
    with first:
        early = Commit(keys={5}, lsn_before=_lsn(first))
        first.execute("BEGIN")
        first.execute("UPDATE public.items SET name = 'written first, committed last' WHERE id = 5")
        with writer.transaction({6}) as conn:
            conn.execute("UPDATE public.items SET name = 'written last, committed first' WHERE id = 6")
        early.time_before = _now(first)
        first.execute("COMMIT")
        early.lsn_after, early.time_after = _lsn(first), _now(first)
    writer.last[5] = early
    # Unchanged TOAST values, a key change and deletes: the fold that fills unchanged columns.
    with writer.transaction({8, 12, 16}) as conn:
        conn.execute("UPDATE public.items SET name = 'toast kept' WHERE id IN (8, 12, 16)")
    with writer.transaction({1020, 1021}, deleted={20, 21, 30}) as conn:
        conn.execute("UPDATE public.items SET id = id + 1000 WHERE id IN (20, 21)")
        conn.execute("DELETE FROM public.items WHERE id = 30")
    sync(pipeline)
    _assert_metadata(pipeline, source, writer, snapshot)
    rows = _metadata_rows(pipeline, source)
    assert rows[5]["_pg_lsn"] > rows[6]["_pg_lsn"]
    assert rows[1020]["body"] is not None  # the TOASTed value followed the key
    assert_mirrored(pipeline)
    [(_, report)] = list(pipeline.check_tables([KEY]))
    assert not isinstance(report, Exception) and report.schema_problems == [] and report.content.passed

    # A restart: a new flusher and materializer keep stamping the same way.
    restarted = source.pipeline(_config(source))
    restarted.validate()
    with writer.transaction({1, 40}) as conn:
        conn.execute("UPDATE public.items SET name = 'after restart' WHERE id IN (1, 40)")
    sync(restarted)
    _assert_metadata(restarted, source, writer, snapshot)
    assert_mirrored(restarted)

    config = _config(source)
    schema = _table_schema(Mirror(Pg2IcebergTranslator(config)), config.tables[0], restarted.iceberg_summary(KEY))
    described = {column.name: column.description or "" for column in schema.columns}
    assert list(described) == ["id", "name", "body", *METADATA]
    assert all(described[name].startswith("change metadata (not a source column)") for name in METADATA)


def test_a_source_column_named_like_a_metadata_column_is_refused_before_anything_is_written(source: SourceDb) -> None:
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, _pg_lsn text)")
    pipeline = source.pipeline(source.config([KEY], change_metadata={"enabled": True}))
    with pytest.raises(StartupCheckError, match=r"public.items: source column _pg_lsn .*change metadata column"):
        pipeline.validate()
    # Other names take it; a column of a metadata column's name added later stops the merge, saying why.
    renamed = source.config([KEY], change_metadata={"enabled": True, "lsn_column": "_mirror_lsn"})
    pipeline = source.pipeline(renamed)
    pipeline.snapshot()
    source.execute("ALTER TABLE public.items ADD COLUMN _pg_merged_at text")
    source.execute("INSERT INTO public.items VALUES (1, 'x', 'y')")
    pipeline.stream(until_caught_up=True)
    with pytest.raises(StartupCheckError, match=r"source column _pg_merged_at .*RENAME COLUMN"):
        pipeline.materialize()
    table = pipeline.catalog.load_table((f"{source.name}_public", "items"))
    assert table.schema().column_names == ["id", "_pg_lsn", "_mirror_lsn", "_pg_committed_at", "_pg_merged_at"]
    assert table.scan().to_arrow().num_rows == 0  # nothing merged


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"enabled": True, "lsn_column": "_pg_merged_at"}, "given to two change metadata columns"),
        ({"merged_at_column": "_pg2iceberg_x"}, "the merge's own"),
        ({"lsn_column": ""}, "lsn_column"),
    ],
)
def test_bad_change_metadata_settings_name_the_field(section: dict[str, Any], message: str) -> None:
    data = {"source": {"host": "h", "dbname": "d", "user": "u"}, "tables": [KEY], "change_metadata": section}
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def _soft_rows(pipeline: Any, source: SourceDb) -> dict[int, dict[str, Any]]:
    table = pipeline.catalog.load_table((f"{source.name}_public", "orders"))
    return {row["id"]: row for row in table.scan().to_arrow().to_pylist()}


def _assert_soft(pipeline: Any, source: SourceDb, deleted: dict[int, Commit], notes: dict[int, str]) -> None:
    """Live rows equal the source's (verify), and every key deleted at the source is still in Iceberg,
    marked with its delete's commit time and LSN, with the values it had when deleted."""
    assert_mirrored(pipeline)
    rows = _soft_rows(pipeline, source)
    live = {key for (key,) in source.execute("SELECT id FROM public.orders WHERE id < 1000")}
    assert not live & set(deleted)
    assert set(rows) == live | set(deleted)
    for key, row in rows.items():
        commit = deleted.get(key)
        if commit is None:
            assert row["_pg_deleted_at"] is None and row["_pg_deleted_lsn"] is None, key
            continue
        assert commit.time_before is not None and commit.time_after is not None
        assert commit.time_before <= row["_pg_deleted_at"] <= commit.time_after, key
        assert commit.lsn_before < row["_pg_deleted_lsn"] <= commit.lsn_after, key
        assert row["_pg_lsn"] == row["_pg_deleted_lsn"], key  # the delete is the row's last change
        assert row["note"] == notes[key], key  # the values it had when deleted


def test_soft_deletes_keep_rows_marked_through_deletes_key_changes_reinserts_and_truncate(source: SourceDb) -> None:
    """``deletes: soft``: deleted rows (and the old keys of key changes, and rows leaving the row filter)
    stay marked with the delete's commit time and LSN; a re-insert revives a key; TRUNCATE marks every
    live row; verify compares live rows only, and a restart goes on the same way."""
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, note text, body text)")
    source.execute(
        "INSERT INTO public.orders SELECT g, 'n' || g, CASE WHEN g % 4 = 0 THEN (SELECT string_agg(md5(random()::text "
        "|| g || s), '') FROM generate_series(1, 300) s) END FROM generate_series(1, 40) g"
    )
    # With a row filter: a row leaving it is deleted as far as the mirror knows, so it is soft-deleted.
    entry = {"name": "public.orders", "deletes": "soft", "change_metadata": True, "where": "id < 1000"}
    pipeline = source.pipeline(source.config([entry]))
    pipeline.snapshot()
    writer = Writer(source)
    notes = {key: f"n{key}" for key in range(1, 41)}
    deleted: dict[int, Commit] = {}

    def mark(keys: set[int]) -> None:
        deleted.update(dict.fromkeys(keys, writer.last[min(keys)]))

    with writer.transaction({1, 2, 3, 4, 5}) as conn:
        conn.execute("DELETE FROM public.orders WHERE id <= 5")
    mark({1, 2, 3, 4, 5})
    with writer.transaction({6, 7}) as conn:
        conn.execute("UPDATE public.orders SET id = id + 100 WHERE id IN (6, 7)")  # old keys soft-deleted
    mark({6, 7})
    with writer.transaction({8}) as conn:
        conn.execute("UPDATE public.orders SET note = 'toast kept' WHERE id = 8")  # body unchanged
    notes[8] = "toast kept"
    with writer.transaction({9}) as conn:
        conn.execute("UPDATE public.orders SET id = 1009 WHERE id = 9")  # out of the filter
    mark({9})
    with writer.transaction({10}) as conn:
        conn.execute("DELETE FROM public.orders WHERE id = 10")
    with writer.transaction({10}) as conn:
        conn.execute("INSERT INTO public.orders VALUES (10, 'back in the same batch', NULL)")
    sync(pipeline)
    _assert_soft(pipeline, source, deleted, notes)
    assert _soft_rows(pipeline, source)[8]["body"] is not None  # the unchanged TOAST value stayed

    with writer.transaction({3}) as conn:
        conn.execute("INSERT INTO public.orders VALUES (3, 'revived', NULL)")
    del deleted[3]
    sync(pipeline)
    _assert_soft(pipeline, source, deleted, notes)

    restarted = source.pipeline(source.config([entry]))
    restarted.validate()
    live = {key for (key,) in source.execute("SELECT id FROM public.orders WHERE id < 1000")}
    notes |= {key: row["note"] for key, row in _soft_rows(restarted, source).items() if key in live}
    with writer.transaction(live) as conn:
        conn.execute("TRUNCATE public.orders")
    mark(live)
    with writer.transaction({1, 200}) as conn:
        conn.execute("INSERT INTO public.orders VALUES (1, 'after truncate', NULL), (200, 'new', NULL)")
    del deleted[1]
    sync(restarted)
    _assert_soft(restarted, source, deleted, notes)
    [(_, report)] = list(restarted.check_tables(["public.orders"]))  # the Dagster checks: live rows only
    assert not isinstance(report, Exception) and report.duplicate_keys == 0 and report.content.passed
    config = source.config([entry])
    summary = restarted.iceberg_summary("public.orders")
    schema = _table_schema(Mirror(Pg2IcebergTranslator(config)), config.tables[0], summary)
    described = {column.name: column.description or "" for column in schema.columns}
    assert list(described) == ["id", "note", "body", *METADATA, "_pg_deleted_at", "_pg_deleted_lsn"]
    assert described["_pg_deleted_at"].startswith("change metadata (not a source column): source commit time")


def test_a_bad_deletes_setting_names_the_field() -> None:
    data = {"source": {"host": "h", "dbname": "d", "user": "u"}, "tables": [{"name": KEY, "deletes": "sometimes"}]}
    with pytest.raises(ConfigError, match=r"tables\.0\.deletes"):
        parse_config(data)


def test_a_resync_stamps_its_copy_with_its_own_lsn_and_merges_go_on_stamping(source: SourceDb) -> None:
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text, body text)")
    source.execute("INSERT INTO public.items SELECT g, 'n' || g, NULL FROM generate_series(1, 20) g")
    pipeline = source.pipeline(source.config([{"name": KEY, "change_metadata": True}]))
    pipeline.snapshot()
    writer = Writer(source)
    with writer.transaction({1}) as conn:
        conn.execute("UPDATE public.items SET name = 'before the resync' WHERE id = 1")
    sync(pipeline)
    copy = Commit()
    with psycopg.connect(source.conninfo, autocommit=True) as conn:
        copy.lsn_before, copy.time_before = _lsn(conn), _now(conn)
    pipeline.resync(KEY)
    with psycopg.connect(source.conninfo, autocommit=True) as conn:
        copy.lsn_after, copy.time_after = _lsn(conn), _now(conn)
    writer.last.clear()  # every row is as the resync copied it
    _assert_metadata(pipeline, source, writer, copy)
    with writer.transaction({2}) as conn:
        conn.execute("UPDATE public.items SET name = 'after the resync' WHERE id = 2")
    sync(pipeline)
    _assert_metadata(pipeline, source, writer, copy)
    assert_mirrored(pipeline)
