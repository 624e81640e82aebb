"""Shared test fixtures: one throwaway PostgreSQL cluster and one Spark session per test session.

Each test gets its own source database, slot, publication, staging directory and Iceberg namespace,
so tests never see each other's state while sharing the expensive parts.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pg2iceberg_dagster.config import PipelineConfig, parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.pipeline import Pipeline

CATALOG_DB = "iceberg_catalog"


@pytest.fixture(scope="session")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pg2iceberg-tests-") as directory:
        yield Path(directory)


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

    def __init__(self, pg: EmbeddedPostgres, workdir: Path) -> None:
        self.pg = pg
        self.workdir = workdir
        self.name = f"t{uuid.uuid4().hex[:10]}"
        pg.create_database(self.name)
        self.conninfo = pg.conninfo(self.name)
        self._pipelines: list[Pipeline] = []

    def execute(self, statement: str, params: Any = None) -> list[tuple]:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

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


def assert_mirrored(pipeline: Pipeline) -> None:
    """Iceberg equals PostgreSQL for every configured table, compared row by row."""
    diffs = pipeline.verify()
    bad = [d for d in diffs if not d.ok]
    assert not bad, bad
