"""Shared test fixtures: one throwaway PostgreSQL cluster and one Spark session per test session.

Each test gets its own source database, slot, publication, staging directory and Iceberg namespace,
so tests never see each other's state while sharing the expensive parts.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from pg2iceberg_dagster.config import PipelineConfig, parse_config
from pg2iceberg_dagster.coordination.records import Chunk
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.lifecycle import run_following_config
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.run_loop import run
from pg2iceberg_dagster.snapshot.chunks import WrittenChunk
from pg2iceberg_dagster.snapshot.runner import SnapshotRunner
from pg2iceberg_dagster.source.catalog import SourceTable
from pg2iceberg_dagster.threads import alongside

CATALOG_DB = "iceberg_catalog"
# `definitions.py` builds its module-level graph from $PG2ICEBERG_CONFIG, else it writes the
# quickstart's config into the repository: tests that import it use the example config instead.
os.environ.setdefault("PG2ICEBERG_CONFIG", str(Path(__file__).resolve().parent.parent / "examples" / "pg2iceberg.yaml"))


class Crash(Exception):
    """Stands for the process dying at an injection point."""


def crash_at(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """Make ``owner.name`` (a method of a class, a function of a module) die with Crash until
    ``monkeypatch.undo()``."""

    def crash(*args: object, **kwargs: object) -> None:
        raise Crash

    monkeypatch.setattr(owner, name, crash)


def snapshot_crashing_at_chunk(monkeypatch: pytest.MonkeyPatch, pipeline: Pipeline, first_failing: int) -> None:
    """Run ``pipeline``'s snapshot until writing chunk ``first_failing`` dies with Crash: the chunks
    before it are written and committed, and the patch is undone. (Reads run ahead of commits, so a
    crash decided by chunk index, not by timing, is what leaves exactly those chunks done.)"""
    write = SnapshotRunner.write_chunk

    def write_or_crash(self: SnapshotRunner, table: SourceTable, chunk: Chunk, data: pa.Table) -> WrittenChunk:
        if chunk.index >= first_failing:
            raise Crash
        return write(self, table, chunk, data)

    monkeypatch.setattr(SnapshotRunner, "write_chunk", write_or_crash)
    with pytest.raises(Crash):
        pipeline.snapshot()
    monkeypatch.undo()


@pytest.fixture(scope="session")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pg2iceberg-tests-") as directory:
        yield Path(directory)


@pytest.fixture(scope="session", autouse=True)
def warm_spark_servers(workdir: Path) -> Iterator[None]:
    """Warm Spark servers that Dagster runs of the tests start (in their own processes) keep their
    endpoint files in this run's directory, and are stopped by their pids at the end."""
    from pg2iceberg_dagster.materializer.warm_spark import RUNTIME_DIR_ENV, stop_server_at

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RUNTIME_DIR_ENV, str(workdir / "runtime"))
        yield
        for endpoint in (workdir / "runtime").glob("spark-*.json"):
            stop_server_at(endpoint)


@pytest.fixture(autouse=True)
def merge_sensor_answers_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge sensor tick invoked by a test answers from one look: it does not watch for a run to
    request for seconds, as it does between the daemon's looks (test_dagster tests the watch)."""
    from pg2iceberg_dagster.dagster_integration.sensors import merge

    monkeypatch.setattr(merge, "MERGE_WATCH_SECONDS", 0.0)


@pytest.fixture(scope="session")
def pg(workdir: Path) -> Iterator[EmbeddedPostgres]:
    cluster = EmbeddedPostgres(workdir / "pg", int(os.environ.get("PG2ICEBERG_TEST_PORT", free_port())))
    cluster.start()
    cluster.create_database(CATALOG_DB)
    try:
        yield cluster
    finally:
        cluster.stop()


def base_config(
    pg: EmbeddedPostgres, workdir: Path, dbname: str, tables: list[dict[str, Any]], **overrides: Any
) -> PipelineConfig:
    """A pipeline config on the test cluster; ``overrides`` replace top-level sections."""
    name = dbname
    data: dict[str, Any] = {
        "source": {"host": "127.0.0.1", "port": pg.port, "dbname": dbname, "user": "postgres"},
        "tables": tables,
        "replication": {"slot": f"slot_{name}", "publication": f"pub_{name}", "status_interval_seconds": 1},
        "staging": {"url": f"file://{workdir}/staging/{name}"},
        "iceberg": {
            "catalog": {"postgres": {"host": "127.0.0.1", "port": pg.port, "dbname": CATALOG_DB}},
            "warehouse": f"file://{workdir}/warehouse",
            "namespace": f"{name}_{{schema}}",
        },
        "snapshot": {"chunk_pages": 8, "parallelism": 2},
        "flush": {"interval_seconds": 0.5},
    }
    data.update(overrides)
    return parse_config(data)


class SourceDb:
    """A fresh source database for one test, with helpers to run SQL and build pipelines."""

    def __init__(self, pg: EmbeddedPostgres, workdir: Path, encoding: str | None = None) -> None:
        self.pg = pg
        self.workdir = workdir
        self.name = f"t{uuid.uuid4().hex[:10]}"
        if encoding is not None:  # another server encoding than the cluster's (UTF8)
            with psycopg.connect(pg.conninfo(), autocommit=True) as conn:
                conn.execute(
                    sql.SQL("CREATE DATABASE {} ENCODING {} LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0").format(
                        sql.Identifier(self.name), sql.Literal(encoding)
                    )
                )
        pg.create_database(self.name)
        self.conninfo = pg.conninfo(self.name)
        self._pipelines: list[Pipeline] = []

    def execute(self, statement: str, params: Any = None) -> list[tuple]:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def drop_slot(self, slot: str) -> None:
        """Drop the replication slot ``slot`` once its walsender has let it go: a stream just closed
        leaves the slot active until its backend exits (under load, past a drop: ObjectInUse in CI)."""
        deadline = time.monotonic() + 30.0
        while self.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))[0][0]:
            assert time.monotonic() < deadline, f"the walsender still holds the slot {slot} after 30 s"
            time.sleep(0.1)
        self.execute("SELECT pg_drop_replication_slot(%s)", (slot,))

    def config(self, tables: list[dict[str, Any]] | list[str], **overrides: Any) -> PipelineConfig:
        specs = [t if isinstance(t, dict) else {"name": t} for t in tables]
        return base_config(self.pg, self.workdir, self.name, specs, **overrides)

    def pipeline(self, config: PipelineConfig) -> Pipeline:
        pipeline = Pipeline(config)
        self._pipelines.append(pipeline)
        return pipeline

    def close(self) -> None:
        for pipeline in self._pipelines:
            pipeline.close()
        # A snapshot holder a test left running loses its sessions and exits.
        self.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (self.name,),
        )
        self.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = %s "
            "AND active_pid IS NOT NULL",
            (self.name,),
        )
        self.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s", (self.name,)
        )


@pytest.fixture
def source(pg: EmbeddedPostgres, workdir: Path) -> Iterator[SourceDb]:
    db = SourceDb(pg, workdir)
    try:
        yield db
    finally:
        db.close()


@pytest.fixture(scope="session")
def spark(pg: EmbeddedPostgres, workdir: Path) -> Iterator[Any]:
    """The one Spark session of the test run (its catalog points at the shared catalog database)."""
    config = base_config(pg, workdir, "spark", [{"name": "public.unused"}])
    from pg2iceberg_dagster.materializer.spark import build_spark_session

    session = build_spark_session(config)
    yield session
    session.stop()


Replicate = Callable[..., Pipeline]


def sync(pipeline: Pipeline) -> None:
    """Flush everything committed so far and merge it."""
    pipeline.stream(until_caught_up=True)
    results = pipeline.materialize()
    assert not any(r.waiting_for_snapshot for r in results.values())


@contextlib.contextmanager
def _in_thread(target: Callable[[threading.Event], object]) -> Iterator[list[BaseException]]:
    """``target(stop)`` in a thread; yields the list of errors it raised; on exit sets ``stop`` and joins it."""
    with alongside(target, "run") as (_, errors):
        yield errors


@contextlib.contextmanager
def running(path: Path, metrics_port: int | None = None) -> Iterator[list[BaseException]]:
    """``run`` following the config at ``path`` in a thread; yields the errors it raised (none, at the end)."""
    with _in_thread(lambda stop: run_following_config(path, stop, metrics_port=metrics_port)) as errors:
        yield errors
    assert not errors


def pipeline_running(
    pipeline: Pipeline, interval: float | None = None, on_progress: Callable[[str], None] | None = None
) -> contextlib.AbstractContextManager[list[BaseException]]:
    """``pipeline.run`` in a thread until the block ends; yields the list of errors it raised."""
    return _in_thread(lambda stop: run(pipeline, stop, interval, on_progress))


def assert_mirrored(pipeline: Pipeline) -> None:
    """Iceberg equals PostgreSQL for every configured table, compared row by row."""
    diffs = pipeline.verify()
    bad = [d for d in diffs if not d.ok]
    assert not bad, bad


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., EmbeddedPostgres]]:
    """A factory of dedicated throwaway clusters (for server settings the shared one cannot have).

    ``make_cluster(conf=[...], hba=[...])`` appends ``conf`` lines to postgresql.conf and puts ``hba``
    lines before the trust lines of pg_hba.conf (first match wins). Every cluster is stopped by its pid.
    """
    clusters: list[EmbeddedPostgres] = []

    def make(conf: list[str] | None = None, hba: list[str] | None = None) -> EmbeddedPostgres:
        cluster = EmbeddedPostgres(tmp_path / f"cluster{len(clusters)}", free_port())
        clusters.append(cluster)
        cluster.init()
        with open(cluster.data_dir / "postgresql.conf", "a", encoding="utf-8") as handle:
            handle.writelines(f"{line}\n" for line in conf or [])
        if hba:
            path = cluster.data_dir / "pg_hba.conf"
            path.write_text("".join(f"{line}\n" for line in hba) + path.read_text(encoding="utf-8"), encoding="utf-8")
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.stop()


def config_on(
    source: SourceDb, cluster: EmbeddedPostgres, tables: list[str], dbname: str = "postgres", **overrides: Any
) -> PipelineConfig:
    """``source.config`` with the source (and coordination state) on a dedicated ``cluster``; the Iceberg
    catalog stays on the shared cluster."""
    data = source.config(tables, **overrides).model_dump()
    data["source"].update(port=cluster.port, dbname=dbname)
    data["state"] = None
    return parse_config(data)


def footprint(config: PipelineConfig, staged: bool = True) -> dict[str, Any]:
    """Everything the pipeline has written so far, to compare before and after a refusal: the slot and
    its position, the publication, every coordination row, the Iceberg tables and their snapshots, and
    (``staged``) the staged files."""
    from pg2iceberg_dagster.iceberg.catalog import open_catalog
    from pg2iceberg_dagster.staging.store import ObjectStore
    from pg2iceberg_dagster.tables import MirroredTables

    result: dict[str, Any] = {}
    # UTF-8 names whatever the database's encoding (in SQL_ASCII psycopg would return bytes).
    with psycopg.connect(config.source.conninfo(client_encoding="UTF8"), autocommit=True) as conn:
        result["slot"] = conn.execute(
            "SELECT confirmed_flush_lsn::text, restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (config.replication.slot,),
        ).fetchall()
        result["publication"] = (
            conn.execute(
                "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1, 2",
                (config.replication.publication,),
            ).fetchall()
            or conn.execute(
                "SELECT 1 FROM pg_publication WHERE pubname = %s", (config.replication.publication,)
            ).fetchall()
        )
    with psycopg.connect(config.state_connection.conninfo(client_encoding="UTF8"), autocommit=True) as conn:
        tables = [
            name
            for (name,) in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = '_pg2iceberg' "
                "AND table_name <> 'schema_migrations' ORDER BY 1"
            )
        ]
        for name in tables:
            result[f"_pg2iceberg.{name}"] = sorted(
                row
                for (row,) in conn.execute(
                    psycopg.sql.SQL("SELECT row_to_json(t)::text FROM _pg2iceberg.{} t").format(
                        psycopg.sql.Identifier(name)
                    )
                )
            )
    catalog = open_catalog(config)
    for table in MirroredTables(config).values():
        identifier = table.iceberg
        if catalog.table_exists(identifier):
            snapshots = catalog.load_table(identifier).snapshots()
            result[f"iceberg:{'.'.join(identifier)}"] = [snapshot.snapshot_id for snapshot in snapshots]
    if staged:
        result["staged"] = ObjectStore(config.staging).list()
    return result


def written_anything(config: PipelineConfig) -> list[str]:
    """What a pipeline that never ran has nonetheless written (should be empty after a refusal)."""
    found = footprint(config)
    written = [key for key in ("slot", "publication", "staged") if found[key]]
    written += [key for key, rows in found.items() if key.startswith("_pg2iceberg.") and rows]
    return written + [key for key in found if key.startswith("iceberg:")]
