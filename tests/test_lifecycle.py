"""Tables added to and removed from the config of a running ``run``: the added table is snapshotted
while the others stream, the removed one leaves the publication and its staged log, and a broken
config is ignored. Every step is checked against the live source, row by row."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import yaml

from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import PipelineConfig, SchemaSelection
from pg2iceberg_dagster.lifecycle import POLL_SECONDS
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.source.selection import selected_tables
from pg2iceberg_dagster.staging.store import ObjectStore

from .conftest import SourceDb, running

pytestmark = pytest.mark.usefixtures("spark")


def _write(path: Path, config: PipelineConfig) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))


def _mirrored(source: SourceDb, config: PipelineConfig) -> bool:
    with Pipeline(config) as probe:
        probe.store.migrate()  # run may not have created the coordination tables yet
        states = probe.store.table_states()
        if not all(key in states and states[key].snapshot_complete for key in (t.key for t in config.tables)):
            return False
        return all(diff.ok for diff in probe.verify())


def _wait(condition: Callable[[], bool], errors: list[BaseException], what: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not errors:
        if condition():
            return
        time.sleep(1)
    raise AssertionError(f"not {what}: {errors}")


def _published(source: SourceDb, config: PipelineConfig) -> set[str]:
    rows = source.execute(
        "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s",
        (config.replication.publication,),
    )
    return {name for (name,) in rows}


def test_run_follows_tables_added_to_and_removed_from_its_config(source: SourceDb, tmp_path: Path) -> None:
    for name in ("a", "b"):
        source.execute(f"CREATE TABLE public.{name} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO public.{name} SELECT g, '{name}' FROM generate_series(1, 500) g")
    only_a = source.config(["public.a"], materialize={"interval_seconds": 0.5})
    both = source.config(["public.a", "public.b"], materialize={"interval_seconds": 0.5})
    only_b = source.config(["public.b"], materialize={"interval_seconds": 0.5})
    path = tmp_path / "pg2iceberg.yaml"
    _write(path, only_a)

    with running(path) as errors:
        _wait(lambda: _mirrored(source, only_a), errors, "a mirrored")
        assert _published(source, only_a) == {"public.a"}

        # Added: b joins the publication and is snapshotted while a keeps streaming.
        source.execute("UPDATE public.b SET v = 'before the add' WHERE id <= 10")
        _write(path, both)
        source.execute("UPDATE public.a SET v = 'while b is added' WHERE id <= 20")
        source.execute("UPDATE public.b SET v = 'while b is added' WHERE id BETWEEN 5 AND 30")
        _wait(lambda: _mirrored(source, both), errors, "a and b mirrored")
        assert _published(source, both) == {"public.a", "public.b"}

        # A broken config is ignored: the pipeline keeps following the last good one.
        path.write_text("tables: [not a mapping\n")
        time.sleep(POLL_SECONDS * 2)
        source.execute("DELETE FROM public.b WHERE id = 1")
        _wait(lambda: _mirrored(source, both), errors, "still mirrored after a broken config")

        # Removed: a leaves the publication, its state and staged files go, its Iceberg table stays.
        with Pipeline(both) as probe:
            staged_before = {entry.path for entry in probe.store.log_entries("public.a", 0, 10**9)}
        assert staged_before
        _write(path, only_b)
        source.execute("INSERT INTO public.b VALUES (1000, 'after a left')")
        _wait(lambda: _published(source, only_b) == {"public.b"} and _mirrored(source, only_b), errors, "a removed")
        with Pipeline(only_b) as probe:
            assert "public.a" not in probe.store.table_states()
            assert probe.catalog.load_table(f"{source.name}_public.a").scan().to_arrow().num_rows == 500
        staged_after = set(ObjectStore(both.staging).list())
        assert not staged_after & staged_before


def _staged_for_removal(source: SourceDb, removed: str, kept: str) -> tuple[PipelineConfig, Pipeline]:
    """Tables ``removed`` and ``kept`` (named as SQL and the config both take them) created with 50
    rows and snapshotted, and a change of ``removed`` staged: the config of both and its pipeline."""
    for table in (removed, kept):
        source.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO {table} SELECT g, 'v' FROM generate_series(1, 50) g")
    both = source.config([kept, removed])
    pipeline = source.pipeline(both)
    pipeline.snapshot()
    source.execute(f"UPDATE {removed} SET v = 'staged' WHERE id < 5")
    pipeline.stream(until_caught_up=True)
    return both, pipeline


def test_cleanup_of_a_table_removed_from_the_config_stops_mirroring_it(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Outside ``run``: after a table leaves the config, ``cleanup --table`` takes it out of the
    publication and deletes its state and staged log; the other table keeps streaming exactly."""
    both, _ = _staged_for_removal(source, "public.b", "public.a")
    only_a = source.config(["public.a"])
    path = tmp_path / "pg2iceberg.yaml"
    _write(path, only_a)
    # validate and status say what is left of it, and the command that lets it go.
    for command in ("validate", "status"):
        capsys.readouterr()
        assert main(["-c", str(path), command]) == 0
        out = capsys.readouterr().out
        assert "public.b: no longer configured" in out and "cleanup --table public.b" in out, out
    assert main(["-c", str(path), "cleanup", "--table", "public.b"]) == 0
    assert _published(source, only_a) == {"public.a"}
    capsys.readouterr()
    assert main(["-c", str(path), "status"]) == 0
    assert "no longer configured" not in capsys.readouterr().out
    with Pipeline(only_a) as probe:
        assert "public.b" not in probe.store.table_states()
        assert probe.store.log_entries("public.b", 0) == []
    source.execute("UPDATE public.a SET v = 'after' WHERE id < 5")
    source.execute("UPDATE public.b SET v = 'not mirrored' WHERE id < 5")
    assert main(["-c", str(path), "verify", "--catch-up"]) == 0
    assert main(["-c", str(path), "cleanup", "--table", "nodot"]) == 2

    # Put back after DDL the mirror never saw: its kept Iceberg table is rebuilt and read again.
    source.execute("ALTER TABLE public.b ADD COLUMN twice bigint GENERATED ALWAYS AS (id * 2) STORED")
    source.execute("ALTER TABLE public.b ALTER COLUMN v TYPE int USING length(v)")
    _write(path, both)
    assert main(["-c", str(path), "snapshot"]) == 0
    source.execute("UPDATE public.b SET v = 0 WHERE id = 7")
    assert main(["-c", str(path), "verify", "--catch-up"]) == 0


def test_a_schema_entry_mirrors_its_tables_and_those_created_later(source: SourceDb, tmp_path: Path) -> None:
    """``tables: [{schema: app, exclude: [tmp_*]}]`` mirrors the schema's keyed tables (a partitioned
    one through its parent; a keyless or an UNLOGGED one is left out with a warning); a table created there while
    ``run`` runs is mirrored without touching the config, and one dropped there stops being mirrored."""
    source.execute("CREATE SCHEMA app")
    for statement in [
        "CREATE TABLE app.a (id int PRIMARY KEY, v text)",
        "CREATE TABLE app.parted (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)",
        "CREATE TABLE app.parted_1 PARTITION OF app.parted FOR VALUES FROM (0) TO (100)",
        "CREATE TABLE app.parted_2 PARTITION OF app.parted FOR VALUES FROM (100) TO (MAXVALUE)",
        "CREATE TABLE app.keyless (v text)",
        "CREATE UNLOGGED TABLE app.scratchpad (id int PRIMARY KEY)",
        "CREATE TABLE app.tmp_scratch (id int PRIMARY KEY)",
        "INSERT INTO app.a SELECT g, 'a' FROM generate_series(1, 300) g",
        "INSERT INTO app.parted SELECT g, 'p' FROM generate_series(1, 300) g",
    ]:
        source.execute(statement)
    config = source.config([{"schema": "app", "exclude": ["tmp_*"]}], materialize={"interval_seconds": 0.5})
    assert [s.schema_name for s in config.schemas] == ["app"] and config.tables == []
    path = tmp_path / "pg2iceberg.yaml"
    _write(path, config)

    def mirrored(keys: set[str]) -> Callable[[], bool]:
        def check() -> bool:
            with Pipeline(config) as probe:
                return {t.key for t in probe.config.tables} == keys and _mirrored(source, probe.config)

        return check

    with running(path) as errors:
        _wait(mirrored({"app.a", "app.parted"}), errors, "the schema's tables mirrored")
        source.execute("CREATE TABLE app.created_later (id int PRIMARY KEY, v text)")
        source.execute("INSERT INTO app.created_later SELECT g, 'later' FROM generate_series(1, 100) g")
        source.execute("UPDATE app.a SET v = 'meanwhile' WHERE id < 10")
        _wait(mirrored({"app.a", "app.parted", "app.created_later"}), errors, "the created table mirrored")
        source.execute("DROP TABLE app.a")
        source.execute("UPDATE app.created_later SET v = 'after the drop' WHERE id < 10")
        _wait(mirrored({"app.parted", "app.created_later"}), errors, "the others mirrored after the drop")

        def forgotten() -> bool:
            # The source shows the drop at once; run forgets the table once its config watch sees it.
            with Pipeline(config) as probe:
                return "app.a" not in probe.store.table_states()

        _wait(forgotten, errors, "the dropped table forgotten")


def test_a_schema_entry_leaves_out_what_validate_would_refuse(source: SourceDb) -> None:
    """One table of a schema that validate would refuse must not stop the whole schema: it is left
    out, with the reason, and the others are mirrored."""
    role = f"sel_{source.name}"
    for statement in [
        "CREATE SCHEMA sel",
        "CREATE TABLE sel.plain (id int PRIMARY KEY)",
        "CREATE TABLE sel.covered (id int PRIMARY KEY, email text NOT NULL)",
        "CREATE UNIQUE INDEX covered_ix ON sel.covered (email, id)",
        "ALTER TABLE sel.covered REPLICA IDENTITY USING INDEX covered_ix",
        "CREATE TABLE sel.by_email (id int PRIMARY KEY, email text NOT NULL UNIQUE)",
        "ALTER TABLE sel.by_email REPLICA IDENTITY USING INDEX by_email_email_key",
        "CREATE TABLE sel.no_identity (id int PRIMARY KEY)",
        "ALTER TABLE sel.no_identity REPLICA IDENTITY NOTHING",
        "CREATE TABLE sel.float_key (id double precision PRIMARY KEY)",
        "CREATE TABLE sel.array_key (id int[] PRIMARY KEY)",
        "CREATE TABLE sel.keyless (v text)",
        "CREATE TABLE sel.hidden (id int PRIMARY KEY)",
        f"CREATE ROLE {role} LOGIN",
        f"GRANT USAGE ON SCHEMA sel TO {role}",
        f"GRANT SELECT ON ALL TABLES IN SCHEMA sel TO {role}",
        f"REVOKE SELECT ON sel.hidden FROM {role}",
        "CREATE TABLE sel.policed (id int PRIMARY KEY)",
        "ALTER TABLE sel.policed ENABLE ROW LEVEL SECURITY",
        f"GRANT SELECT ON sel.policed TO {role}",
    ]:
        source.execute(statement)
    selection = [SchemaSelection(schema="sel")]
    with psycopg.connect(source.conninfo, user=role) as conn:
        found, left_out = selected_tables(conn, selection)
    assert found == [("sel", "covered"), ("sel", "plain")]
    assert sorted(left_out) == [
        "sel.array_key",
        "sel.by_email",
        "sel.float_key",
        "sel.hidden",
        "sel.keyless",
        "sel.no_identity",
        "sel.policed",
    ]
    assert "SELECT" in left_out["sel.hidden"] and "REPLICA IDENTITY" in left_out["sel.by_email"]
    assert "BYPASSRLS" in left_out["sel.policed"]
    assert "float, double or an array" in left_out["sel.array_key"]
    # The pipeline's own role (a superuser here) reads sel.hidden and sel.policed whole.
    config = source.config([{"schema": "sel"}])
    assert source.pipeline(config).validate().tables.keys() == {"sel.covered", "sel.hidden", "sel.plain", "sel.policed"}


@pytest.mark.usefixtures("spark")
def test_ctrl_c_stops_run_cleanly_once_spark_runs(source: SourceDb, tmp_path: Path) -> None:
    """`run` stops on Ctrl-C (SIGINT) by its own handler and exits 0, as the README says, also after
    its Spark session started: PySpark's context replaced that handler with one raising
    KeyboardInterrupt, so run exited 130 from wherever it was."""
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.t SELECT g, 'v' FROM generate_series(1, 10) g")
    config = source.config(["public.t"], materialize={"interval_seconds": 0.5})
    path = tmp_path / "pg2iceberg.yaml"
    _write(path, config)
    command = [str(Path(sys.executable).with_name("pg2iceberg-dagster")), "-c", str(path), "run"]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as process:
        try:
            source.execute("UPDATE public.t SET v = 'merged' WHERE id = 1")
            # Merged: run's Spark session is up.
            _wait(lambda: process.poll() is None and _mirrored(source, config), [], "the update merged by run")
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=120) == 0, process.stderr.read().decode() if process.stderr else ""
        finally:
            if process.poll() is None:
                process.kill()


def test_a_removed_table_whose_schema_name_holds_a_dot_leaves_the_publication(source: SourceDb) -> None:
    """A table gone from the config is known by its key alone (``a.b.c``: schema ``a.b``, table ``c``,
    though ``a``/``b.c`` reads the same); it leaves the publication under its own names and its state
    goes, while the other table keeps streaming exactly."""
    source.execute('CREATE SCHEMA "a.b"')
    _, pipeline = _staged_for_removal(source, '"a.b".c', "public.kept")
    pipeline.close()
    only_kept = source.config(["public.kept"])
    pipeline = source.pipeline(only_kept)
    assert [table.key for table in pipeline.forget_removed_tables()] == ["a.b.c"]
    assert "a.b.c" not in pipeline.store.table_states()
    assert _published(source, only_kept) == {"public.kept"}
    source.execute("UPDATE public.kept SET v = 'after' WHERE id < 10")
    pipeline.stream(until_caught_up=True)
    pipeline.materialize()
    assert all(diff.ok for diff in pipeline.verify())
