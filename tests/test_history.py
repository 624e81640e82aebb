"""History tables (issue 32 part 5): one row per version of each source row. After each of a sequence of
transactions (inserts, updates, updates leaving a TOAST value unchanged, deletes, key changes, the
re-insert of a deleted key, TRUNCATE, an added column) the test records ``pg_current_wal_insert_lsn()``
(past the commit record) and the source table's rows; after merging in several batches (several changes
of one key inside one batch), the history's as-of query at each recorded LSN equals the rows recorded
then, row by row. Also crashes between the live and the history commit, and after both, lose and
duplicate no version."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from dagster import AssetKey, instance_for_test

from pg2iceberg_dagster.cleanup import remove_tables
from pg2iceberg_dagster.config import load_config, parse_config
from pg2iceberg_dagster.dagster_integration import build_definitions
from pg2iceberg_dagster.errors import ConfigError
from pg2iceberg_dagster.iceberg.history import HistoryColumns, as_of
from pg2iceberg_dagster.materializer import merge as merge_module
from pg2iceberg_dagster.pipeline import Pipeline
from soak.history_check import Sample, history_divergences, take_sample
from soak.policy_check import Policy

from .conftest import Crash, SourceDb, assert_mirrored, sync
from .test_dagster import _launch, _merge_requested, _write_config

pytestmark = pytest.mark.usefixtures("spark")

KEY = "public.items"
OWN = HistoryColumns(
    "_pg_valid_from_lsn", "_pg_valid_from_at", "_pg_valid_to_lsn", "_pg_valid_to_at", "_pg_operation", "_pg_is_current"
)
# A value PostgreSQL stores out of line (TOAST): incompressible, over 2 kB.
BIG = "(SELECT string_agg(md5(random()::text || g), '') FROM generate_series(1, 200) g)"


class Recorder:
    """Runs transactions on the source; after each commit records the WAL position and the table's rows."""

    def __init__(self, source: SourceDb) -> None:
        self.source = source
        self.states: list[tuple[int, list[dict[str, Any]]]] = []

    def __call__(self, *statements: str) -> None:
        body = "; ".join(statements)
        self.source.execute(f"BEGIN; {body}; COMMIT")
        self.record()

    def record(self) -> None:
        lsn = self.source.execute("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint")[0][0]
        self.states.append((int(lsn), self.rows()))

    def rows(self) -> list[dict[str, Any]]:
        columns = [row[0] for row in self.source.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'public.items'::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum"
        )]  # fmt: skip
        rows = self.source.execute("SELECT * FROM public.items ORDER BY id")
        return [dict(zip(columns, row, strict=True)) for row in rows]


def _history(pipeline: Pipeline) -> Any:
    identifier = pipeline.tables[KEY].history
    assert identifier is not None
    return pipeline.catalog.load_table(identifier)


def _as_of(pipeline: Pipeline, lsn: int) -> list[dict[str, Any]]:
    """The source table as of ``lsn`` by the history's as-of query, without the history's own columns."""
    history = _history(pipeline)
    rows = history.scan(row_filter=as_of(history, lsn)).to_arrow().to_pylist()
    return sorted(({k: v for k, v in row.items() if k not in OWN.names} for row in rows), key=lambda r: r["id"])


def _assert_history_exact(pipeline: Pipeline, states: list[tuple[int, list[dict[str, Any]]]]) -> None:
    for index, (lsn, expected) in enumerate(states):
        columns = {name for row in expected for name in row}
        got = [{k: v for k, v in row.items() if k in columns or v is not None} for row in _as_of(pipeline, lsn)]
        if got != expected:
            short = [{k: (v[:8] if isinstance(v, str) else v) for k, v in row.items()} for row in got]
            want = [{k: (v[:8] if isinstance(v, str) else v) for k, v in row.items()} for row in expected]
            history = [
                {k: (v[:8] if isinstance(v, str) else v) for k, v in row.items()}
                for row in _history(pipeline).scan().to_arrow().to_pylist()
            ]
            raise AssertionError(f"as of state {index} (LSN {lsn}):\n{short}\n!=\n{want}\nhistory: {history}")
    rows = _history(pipeline).scan().to_arrow().to_pylist()
    versions = Counter((row["id"], row[OWN.valid_from_lsn], row[OWN.valid_to_lsn], row["n"]) for row in rows)
    assert [v for v, count in versions.items() if count > 1] == []
    current = Counter(row["id"] for row in rows if row[OWN.current])
    assert [k for k, count in current.items() if count > 1] == []


def _items(source: SourceDb) -> Recorder:
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text, n int, big text)")
    source.execute(f"INSERT INTO public.items SELECT g, 'item ' || g, g, {BIG} FROM generate_series(1, 8) g")
    return Recorder(source)


def _snapshotted(source: SourceDb, entry: dict[str, Any] | None = None, **overrides: Any) -> tuple[Recorder, Pipeline]:
    """The items table mirrored with history (or as ``entry`` says) and snapshotted; the recorder
    holds the state after the snapshot."""
    record = _items(source)
    pipeline = source.pipeline(source.config([entry or {"name": KEY, "history": True}], **overrides))
    pipeline.snapshot()
    record.record()
    return record, pipeline


def test_history_reproduces_the_source_as_of_every_commit(source: SourceDb) -> None:
    record, pipeline = _snapshotted(source, materialize={"max_batch_changes": 3})
    pipeline.materialize()
    first = _history(pipeline).scan().to_arrow().to_pylist()
    assert sorted(row["id"] for row in first) == list(range(1, 9))
    assert {(row[OWN.operation], row[OWN.current], row[OWN.valid_to_lsn]) for row in first} == {
        ("snapshot", True, None)
    }

    # One batch with several changes of a key (updates, a TOAST value left unchanged, a delete, a re-insert).
    record("UPDATE public.items SET n = n + 100 WHERE id = 1")
    record("UPDATE public.items SET name = 'renamed' WHERE id = 1")
    record("INSERT INTO public.items VALUES (20, 'new', 20, 'small')")
    record("UPDATE public.items SET n = 0 WHERE id = 20", "UPDATE public.items SET n = 1 WHERE id = 20")
    record("DELETE FROM public.items WHERE id = 2")
    record(f"INSERT INTO public.items VALUES (2, 'back', 2, {BIG})")
    record("UPDATE public.items SET n = 7 WHERE id = 2")
    sync(pipeline)
    _assert_history_exact(pipeline, record.states)

    # Key changes (the TOAST value stays with the row), deletes, an added column.
    record("UPDATE public.items SET id = 103 WHERE id = 3")
    record("UPDATE public.items SET id = 104, n = 44 WHERE id = 4", "UPDATE public.items SET n = 45 WHERE id = 104")
    record("DELETE FROM public.items WHERE id IN (5, 6)")
    record("ALTER TABLE public.items ADD COLUMN note text")
    record("UPDATE public.items SET note = 'noted' WHERE id = 7")
    record("UPDATE public.items SET n = n + 1 WHERE id IN (1, 7, 103)")
    sync(pipeline)
    _assert_history_exact(pipeline, record.states)

    # TRUNCATE closes every version, and the table fills again in the same batch.
    record("UPDATE public.items SET n = -1 WHERE id = 8")
    record("TRUNCATE public.items")
    record("INSERT INTO public.items (id, name, n, big) VALUES (8, 'again', 8, 'x'), (9, 'nine', 9, 'y')")
    record("UPDATE public.items SET note = 'after' WHERE id = 8")
    sync(pipeline)
    record("TRUNCATE public.items")
    record("INSERT INTO public.items (id, name, n) VALUES (10, 'ten', 10)")
    sync(pipeline)
    _assert_history_exact(pipeline, record.states)
    assert_mirrored(pipeline)


@pytest.mark.parametrize("point", ["materializer.before_history", "materializer.after_commit"])
def test_a_crash_around_the_history_commit_loses_and_repeats_no_version(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """A crash after the live commit and before the history's (or after both, before the cursor moves);
    more is staged before the retry, so the retried batch is longer than the one that crashed."""
    record, pipeline = _snapshotted(source)
    pipeline.materialize()
    record("UPDATE public.items SET n = n + 1 WHERE id <= 4")
    record("DELETE FROM public.items WHERE id = 5")
    record("UPDATE public.items SET name = 'x' WHERE id = 1")
    pipeline.stream(until_caught_up=True)

    def crash(name: str) -> None:
        if name == point:
            raise Crash

    monkeypatch.setattr(merge_module, "crash_point", crash)
    with pytest.raises(Crash):
        pipeline.materialize()
    monkeypatch.undo()
    record("UPDATE public.items SET n = n + 10 WHERE id IN (1, 6)")
    record("UPDATE public.items SET id = 106 WHERE id = 6")
    sync(pipeline)
    _assert_history_exact(pipeline, record.states)
    assert_mirrored(pipeline)


def test_a_history_table_named_like_a_mirrored_table_is_refused(source: SourceDb) -> None:
    with pytest.raises(ConfigError, match=r"the history of table public\.items and table public\.items_history"):
        source.config([{"name": KEY, "history": True}, "public.items_history"])
    data = source.config([KEY]).model_dump()
    data["tables"] = [{"name": KEY, "history": True}, {"name": "public.other", "iceberg_name": "items_history"}]
    with pytest.raises(ConfigError, match=r"the history of table public\.items"):
        parse_config(data)


def test_a_resync_closes_the_current_versions_and_writes_snapshot_versions(source: SourceDb) -> None:
    """A resync starts a new copy: the versions current until then end at the copy's LSN and every row
    gets a ``snapshot`` version valid from it; the history stays exact as of every recorded commit."""
    record, pipeline = _snapshotted(source)
    record("UPDATE public.items SET n = n + 1 WHERE id <= 3")
    record("DELETE FROM public.items WHERE id = 8")
    sync(pipeline)
    pipeline.resync(KEY)
    record.record()
    record("UPDATE public.items SET name = 'after' WHERE id = 1")
    sync(pipeline)
    _assert_history_exact(pipeline, record.states)
    rows = _history(pipeline).scan().to_arrow().to_pylist()
    snapshots = sorted(row["id"] for row in rows if row[OWN.operation] == "snapshot")
    assert snapshots == sorted([*range(1, 9), *range(1, 8)]), "8 rows copied first, 7 by the resync"
    current = {row["id"]: row[OWN.operation] for row in rows if row[OWN.current]}
    assert current == {1: "update", **{key: "snapshot" for key in range(2, 8)}}


def test_the_merge_run_materializes_the_history_asset_with_the_live_table(source: SourceDb, tmp_path: Path) -> None:
    """In Dagster the history table is its own asset downstream of the live table: the merge sensor
    selects both for a lagging table, and the one merge step writes and reports both."""
    record = _items(source)
    config_path = _write_config(source, tmp_path, [{"name": KEY, "history": True}])  # type: ignore[list-item]
    defs = build_definitions(config_path)
    namespace = f"{source.name}_public"
    live, history = AssetKey(["iceberg", namespace, "items"]), AssetKey(["iceberg", namespace, "items_history"])
    assert {dep.asset_key for dep in defs.resolve_assets_def(history).specs_by_key[history].deps} == {live}
    pipeline = source.pipeline(load_config(config_path))
    pipeline.snapshot()
    record.record()
    record("UPDATE public.items SET n = 0 WHERE id = 1")
    pipeline.stream(until_caught_up=True)
    with instance_for_test() as instance:
        request = _merge_requested(defs, instance, config_path)
        assert request is not None and set(request.asset_selection or []) == {live, history}
        assert _launch(defs, instance, request).success
        event = instance.get_latest_materialization_event(history)
        assert event is not None and event.asset_materialization is not None
        assert event.asset_materialization.metadata["changes"].value == 1
    _assert_history_exact(pipeline, record.states)


def test_the_history_holds_columns_as_the_policy_leaves_them(source: SourceDb) -> None:
    """An excluded column is not in the history table, a masked one holds the masked value, in the
    snapshot's versions and the streamed ones alike."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text, phone text, secret text)")
    source.execute(
        "INSERT INTO public.items SELECT g, 'item ' || g, '555-' || g, 'pw' || g FROM generate_series(1, 3) g"
    )
    table = {"name": KEY, "history": True, "columns": {"exclude": ["secret"]}, "mask": {"phone": "redact"}}
    pipeline = source.pipeline(source.config([table]))
    pipeline.snapshot()
    pipeline.materialize()
    source.execute("UPDATE public.items SET phone = '555-0', secret = 'changed' WHERE id = 1")
    source.execute("INSERT INTO public.items VALUES (4, 'four', NULL, 'pw4')")
    sync(pipeline)
    history = _history(pipeline)
    assert [field.name for field in history.schema().fields] == ["id", "name", "phone", *OWN.names]
    rows = history.scan().to_arrow().to_pylist()
    assert sorted((row["id"], row["phone"], row[OWN.operation]) for row in rows) == [
        (1, "[redacted]", "snapshot"),
        (1, "[redacted]", "update"),
        (2, "[redacted]", "snapshot"),
        (3, "[redacted]", "snapshot"),
        (4, None, "insert"),
    ]
    # A table no longer mirrored with its Iceberg table dropped loses its history table too.
    mirrored = pipeline.tables[KEY]
    assert mirrored.history is not None and pipeline.catalog.table_exists(mirrored.history)
    remove_tables(pipeline.config, pipeline.store, pipeline.objects, pipeline.catalog, [mirrored], drop_iceberg=True)
    assert not pipeline.catalog.table_exists(mirrored.history)


def test_a_column_renamed_at_the_source_is_renamed_in_the_history(source: SourceDb) -> None:
    """As in the live table, the renamed column keeps its values, earlier versions' included; an update
    leaving a TOAST value of the renamed column unchanged takes it from the version before the rename."""
    record, pipeline = _snapshotted(source)
    record("UPDATE public.items SET n = -1 WHERE id = 1")
    sync(pipeline)
    record("ALTER TABLE public.items RENAME COLUMN big TO payload")
    record("UPDATE public.items SET n = -2 WHERE id IN (1, 2)")
    sync(pipeline)
    renamed = [(lsn, [_renamed(row) for row in rows]) for lsn, rows in record.states]
    _assert_history_exact(pipeline, renamed)
    assert "big" not in [field.name for field in _history(pipeline).schema().fields]


def _renamed(row: dict[str, Any]) -> dict[str, Any]:
    return {("payload" if name == "big" else name): value for name, value in row.items()}


def test_a_column_retyped_beyond_widening_is_kept_aside_after_the_resync(source: SourceDb) -> None:
    """``ALTER COLUMN n TYPE text`` needs a resync (Iceberg cannot turn an int column into a string one):
    the history keeps the earlier versions' values in ``n__was_int`` and continues with the new ``n``."""
    record, pipeline = _snapshotted(source)
    record("UPDATE public.items SET n = -1 WHERE id = 1")
    sync(pipeline)
    record("ALTER TABLE public.items ALTER COLUMN n TYPE text USING 'n' || n")
    record("UPDATE public.items SET n = 'changed' WHERE id = 2")
    pipeline.stream(until_caught_up=True)
    assert pipeline.materialize()[KEY].resync_reason
    pipeline.resync(KEY)
    record.record()
    record("UPDATE public.items SET n = 'after' WHERE id = 3")
    sync(pipeline)
    before = [(lsn, [_aside_n(row) for row in rows]) for lsn, rows in record.states[:2]]
    _assert_history_exact(pipeline, [*before, *record.states[-2:]])
    fields = {field.name: str(field.field_type) for field in _history(pipeline).schema().fields}
    assert (fields["n"], fields["n__was_int"]) == ("string", "int")


def _aside_n(row: dict[str, Any]) -> dict[str, Any]:
    return {("n__was_int" if name == "n" else name): value for name, value in row.items()}


def test_the_history_of_a_table_whose_name_ends_a_url_lives_beside_it(source: SourceDb) -> None:
    """A table named with ``?`` and ``#`` (which would end a file URL's path) gets its history files
    under escaped path segments as its live table does, and its history reads back as the source."""
    source.execute('CREATE TABLE public."odd?name#1" (id int PRIMARY KEY, v text)')
    source.execute("""INSERT INTO public."odd?name#1" SELECT g, 'v' || g FROM generate_series(1, 20) g""")
    pipeline = source.pipeline(source.config([{"name": 'public."odd?name#1"', "history": True}]))
    pipeline.snapshot()
    source.execute("""UPDATE public."odd?name#1" SET v = 'changed' WHERE id <= 5""")
    sync(pipeline)
    assert_mirrored(pipeline)
    identifier = pipeline.tables["public.odd?name#1"].history
    assert identifier is not None
    history = pipeline.catalog.load_table(identifier)
    assert "?" not in history.location() and "#" not in history.location()
    current = history.scan(row_filter=as_of(history, 2**62)).to_arrow().to_pylist()
    assert sorted((row["id"], row["v"]) for row in current) == [
        (i, "changed" if i <= 5 else f"v{i}") for i in range(1, 21)
    ]
    assert len(history.scan().to_arrow()) == 25  # 20 first versions, 5 updates


def test_maintenance_compacts_and_expires_the_history_and_it_stays_exact(source: SourceDb) -> None:
    """A maintenance pass compacts the history table's files and expires its old snapshots, but keeps
    the one recording what the history holds: later merges neither lose nor repeat a version."""
    eager = {"snapshot_retention_hours": 0, "min_snapshots": 1, "orphan_min_age_hours": 0}
    # Merge-on-read: the history's MERGEs write delete files, so compaction commits after its last write.
    table = {"name": KEY, "history": True, "delete_format": "merge-on-read"}
    record, pipeline = _snapshotted(source, table, maintenance=eager)
    pipeline.materialize()
    for round_ in range(4):
        record(f"UPDATE public.items SET n = n + {round_ + 1} WHERE id <= {round_ + 2}")
        sync(pipeline)
    before = _history(pipeline)
    assert len(before.snapshots()) >= 5
    (result,) = pipeline.maintain([KEY])
    assert result.history is not None and not result.skipped
    after = _history(pipeline)
    assert len(after.snapshots()) < len(before.snapshots())
    assert result.history.before.delete_files and not result.history.after.delete_files
    assert result.history.rewrites.snapshots_expired and result.history.rewrites.files_expired
    _assert_history_exact(pipeline, record.states)
    record("UPDATE public.items SET n = 0 WHERE id IN (1, 8)")
    record("DELETE FROM public.items WHERE id = 3")
    sync(pipeline)
    _assert_history_exact(pipeline, record.states)
    assert_mirrored(pipeline)


def test_the_soak_history_check_passes_on_the_history_and_names_a_perturbed_sample(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's history check (soak/history_check.py) on a table with an excluded, a hashed and a
    filtered part: the samples taken between transactions are reproduced as of their LSNs; a sample with
    one value changed is reported with the seed, the sample, its LSN and the differing row."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text, email text, secret text)")
    source.execute("INSERT INTO public.items SELECT g, 'n' || g, g || '@x', 's' || g FROM generate_series(1, 6) g")
    options = {"columns": {"exclude": ["secret"]}, "mask": {"email": "hash"}, "where": "id <= 10"}
    policy = Policy("public", "items", ["id"], ["id", "name", "email"], {"secret"}, options)
    secret = b"history-check-key"
    monkeypatch.setenv("SOAK_HC_KEY", secret.decode())
    pipeline = source.pipeline(
        source.config([{"name": KEY, "history": True, "mask_key_env": "SOAK_HC_KEY", **options}])
    )
    pipeline.snapshot()
    samples: list[Sample] = []
    with psycopg.connect(source.conninfo, autocommit=True) as writer:
        for number, statement in enumerate(
            [
                "UPDATE public.items SET name = 'first' WHERE id = 1",
                "UPDATE public.items SET secret = 'only excluded' WHERE id = 2",
                "UPDATE public.items SET id = 20 WHERE id = 3",  # out of the filter
                "DELETE FROM public.items WHERE id = 4",
                "INSERT INTO public.items VALUES (7, 'seven', '7@x', 's7')",
            ]
        ):
            writer.execute(statement)
            samples.append(take_sample(writer, source.conninfo, policy, secret, number))
        sync(pipeline)
    history = _history(pipeline)
    assert history_divergences(history, samples, ["id"], seed=5) == []
    changed = dict(samples[2].rows)
    changed[(1,)] = (1, "perturbed", changed[(1,)][2])
    perturbed = Sample(samples[2].number, samples[2].lsn, samples[2].columns, 1, changed)
    (found,) = history_divergences(history, [samples[0], perturbed], ["id"], seed=5)
    assert (found["seed"], found["sample"], found["lsn"], found["differences"]) == (5, 2, samples[2].lsn, 1)
    assert found["examples"] == [{"key": "(1,)", "name": {"history": "first", "source": "perturbed"}}]
