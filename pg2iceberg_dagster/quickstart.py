"""The embedded default end to end: a local Postgres with a sample schema and live writes, a file://
warehouse, the SQL catalog in Postgres and Spark local, replicated and then verified."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import yaml

from .config import PipelineConfig, load_config
from .embedded import EmbeddedPostgres
from .materializer.warm_spark import stop_server as stop_warm_server
from .pipeline import Pipeline
from .verify import print_diffs

SAMPLE_SCHEMA = """
CREATE TABLE IF NOT EXISTS public.customers (
    id bigint PRIMARY KEY, name text NOT NULL, email varchar(200), created_at timestamptz NOT NULL DEFAULT now(),
    preferences jsonb
);
CREATE TABLE IF NOT EXISTS public.orders (
    id bigint PRIMARY KEY, customer_id bigint NOT NULL, amount numeric(12, 2) NOT NULL, status text NOT NULL,
    tags text[], ordered_on date NOT NULL, note text
);
"""


WORKSPACE = Path(__file__).resolve().parent.parent / "workspace.yaml"


def dagster_dev_command(port: int, workspace: Path = WORKSPACE) -> list[str]:
    """``dg dev`` (Dagster's CLI for local development, from dagster-dg-cli, which supersedes
    ``dagster dev``) on ``workspace`` (this repository's by default), its UI on 127.0.0.1:``port``;
    ``dagster dev`` where dg is not installed next to this Python (the same server either way)."""
    dg = Path(sys.executable).with_name("dg")
    cli = [str(dg), "dev"] if dg.exists() else [sys.executable, "-m", "dagster", "dev"]
    return [*cli, "-w", str(workspace), "-h", "127.0.0.1", "-p", str(port)]


def code_location_name(config: PipelineConfig) -> str:
    """The name of a pipeline's code location: its replication slot, unique per pipeline and source
    database (a deployment of several pipelines tells them apart), not the module's name."""
    return re.sub(r"[^A-Za-z0-9_]", "_", config.replication.slot)


def write_workspace(root: Path, config: PipelineConfig) -> Path:
    """A workspace file in ``root`` loading this repository's ``definitions.py`` as the code location
    named after the pipeline (:func:`code_location_name`); returns its path."""
    workspace = {
        "load_from": [
            {
                "python_module": {
                    "module_name": "definitions",
                    "working_directory": str(WORKSPACE.parent),
                    "location_name": code_location_name(config),
                }
            }
        ]
    }
    path = root / "workspace.yaml"
    path.write_text(yaml.safe_dump(workspace, sort_keys=False))
    return path


def config_for(root: Path, port: int) -> dict:
    """The quickstart pipeline config (also a complete example of the format)."""
    return {
        "source": {"host": "127.0.0.1", "port": port, "dbname": "app", "user": "postgres"},
        "tables": [{"name": "public.customers"}, {"name": "public.orders"}],
        "replication": {"slot": "pg2iceberg_quickstart", "publication": "pg2iceberg_quickstart"},
        "staging": {"url": f"file://{root.resolve()}/staging"},
        "iceberg": {
            "catalog": {
                "type": "sql",
                "name": "pg2iceberg",
                "postgres": {"host": "127.0.0.1", "port": port, "dbname": "iceberg_catalog"},
            },
            "warehouse": f"file://{root.resolve()}/warehouse",
            "namespace": "{schema}",
        },
        "spark": {"master": "local[2]"},
        "snapshot": {"chunk_pages": 64, "parallelism": 2},
        "flush": {"interval_seconds": 2},
        "materialize": {"interval_seconds": 5},
    }


def write_default_config(root: Path, port: int = 54329, replace: bool = False) -> Path:
    """Write the quickstart config into ``root`` (unless one is there and not ``replace``); returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "pg2iceberg.yaml"
    if replace or not path.exists():
        path.write_text(yaml.safe_dump(config_for(root, port), sort_keys=False))
    return path


def seed(conninfo: str, rows: int) -> None:
    """Create and fill the sample tables once."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(SAMPLE_SCHEMA)
        if conn.execute("SELECT count(*) FROM public.orders").fetchone()[0]:  # type: ignore[index]
            return
        conn.execute(
            "INSERT INTO customers (id, name, email, preferences) SELECT g, 'customer ' || g, "
            "'c' || g || '@example.com', jsonb_build_object('newsletter', g %% 2 = 0) "
            "FROM generate_series(1, %s) g",
            (max(rows // 10, 1),),
        )
        conn.execute(
            "INSERT INTO orders SELECT g, 1 + g %% %s, (g %% 1000) * 1.25, 'new', ARRAY['web'], "
            "date '2026-01-01' + (g %% 300), NULL FROM generate_series(1, %s) g",
            (max(rows // 10, 1), rows),
        )
        conn.execute("ANALYZE customers, orders")


def live_writes(conninfo: str, stop: threading.Event, rows: int) -> int:
    """Random inserts, updates and deletes until ``stop``; returns the number of transactions."""
    rng = random.Random(7)
    transactions = 0
    with psycopg.connect(conninfo, autocommit=True) as conn:
        # After the first session (quickstart, then quickstart --dagster) orders holds later ids too.
        row = conn.execute("SELECT coalesce(max(id), 0) FROM orders").fetchone()
        next_id = max(rows, row[0] if row else 0) + 1
        while not stop.is_set():
            with conn.transaction():
                for _ in range(rng.randint(1, 20)):
                    action = rng.random()
                    if action < 0.4:
                        conn.execute(
                            "INSERT INTO orders VALUES (%s, %s, %s, 'new', ARRAY['app'], current_date, NULL)",
                            (next_id, rng.randint(1, max(rows // 10, 1)), rng.randint(1, 99999) / 100),
                        )
                        next_id += 1
                    elif action < 0.85:
                        conn.execute(
                            "UPDATE orders SET status = %s, amount = amount + 1 WHERE id = %s",
                            (rng.choice(["paid", "shipped", "done"]), rng.randint(1, next_id)),
                        )
                    else:
                        conn.execute("DELETE FROM orders WHERE id = %s", (rng.randint(1, next_id),))
            transactions += 1
            time.sleep(0.01)
    return transactions


def start_embedded(root: Path, port: int, rows: int) -> tuple[EmbeddedPostgres, Path]:
    """Start the local PostgreSQL with its sample data; returns it and the pipeline config path."""
    root.mkdir(parents=True, exist_ok=True)
    postgres = EmbeddedPostgres(root / "pg", port)
    print(f"starting PostgreSQL on 127.0.0.1:{port} (data in {postgres.data_dir})")
    postgres.start()
    postgres.create_database("app")
    postgres.create_database("iceberg_catalog")
    # The config of the PostgreSQL just started: one left by an earlier run (another --port, or the
    # graph `dagster dev` shows before any quickstart) would point elsewhere.
    config_path = write_default_config(root, port, replace=True)
    seed(postgres.conninfo("app"), rows)
    return postgres, config_path


# The Dagster instance (dagster.yaml) of the quickstart, also what bench/freshness.py measures with: no
# onboarding pop-up over a local demo; sensors tick in parallel threads (a flusher tick lasts up to 20 s
# and would otherwise hold back the merge automation: 22 s between a merge run and the next instead of
# 5); queued runs are launched within a second instead of five.
DAGSTER_INSTANCE_YAML = """\
nux:
  enabled: false
telemetry:
  enabled: false
sensors:
  use_threads: true
  num_workers: 4
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    dequeue_interval_seconds: 1
"""


def run_dagster_dev(root: Path, port: int = 54329, rows: int = 50_000, ui_port: int = 3000) -> int:
    """Start the local PostgreSQL with live writes and run ``dg dev`` on the quickstart pipeline."""
    postgres, config_path = start_embedded(root, port, rows)
    workspace = write_workspace(root.resolve(), load_config(config_path))
    dagster_home = (root / "dagster_home").resolve()
    dagster_home.mkdir(exist_ok=True)
    (dagster_home / "dagster.yaml").write_text(DAGSTER_INSTANCE_YAML)
    stop_writes = threading.Event()
    writer = threading.Thread(target=live_writes, args=(postgres.conninfo("app"), stop_writes, rows), daemon=True)
    writer.start()
    env = {**os.environ, "PG2ICEBERG_CONFIG": str(config_path.resolve()), "DAGSTER_HOME": str(dagster_home)}
    print(f"live writes running; Dagster UI on http://127.0.0.1:{ui_port} (Ctrl-C stops)")
    # Its own session: dg dev shuts down its process group. Ctrl-C or SIGTERM here is handed
    # on to it; PostgreSQL keeps running for the next session. A shell starting this in the background
    # ignores SIGINT for it, and an ignored signal stays ignored across exec: dg dev would never
    # stop. With a handler here, the child starts with SIGINT at its default (Python's Ctrl-C).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dagster = subprocess.Popen(
        dagster_dev_command(ui_port, workspace),
        env=env,
        cwd=WORKSPACE.parent,
        start_new_session=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: dagster.send_signal(signal.SIGINT))
    try:
        while True:
            try:
                return dagster.wait()
            except KeyboardInterrupt:
                dagster.send_signal(signal.SIGINT)
    finally:
        stop_writes.set()
        writer.join()
        stop_warm_server(load_config(config_path))  # the merge runs' Spark driver goes with Dagster


def run_quickstart(root: Path, port: int = 54329, seconds: float = 20.0, rows: int = 50_000) -> int:
    """Bring up the embedded default, replicate it under live writes, and verify. Exit code 0 on a match."""
    postgres, config_path = start_embedded(root, port, rows)
    config = load_config(config_path)
    stop_writes = threading.Event()
    writer = threading.Thread(target=live_writes, args=(postgres.conninfo("app"), stop_writes, rows), daemon=True)
    writer.start()
    print(f"live writes running for {seconds:.0f}s; config in {config_path}")
    started = time.monotonic()
    with Pipeline(config) as pipeline:
        for key, result in pipeline.snapshot().items():
            print(f"snapshot {key}: {result.rows} rows in {result.chunks_run} chunks")
        stop_stream = threading.Event()
        streamer = threading.Thread(target=pipeline.stream, args=(stop_stream,), daemon=True)
        streamer.start()
        materializer = pipeline.materializer()
        while time.monotonic() - started < seconds:
            for key, merged in materializer.run_once().items():
                print(f"merged {key}: {merged.changes} changes, lag {merged.lag.changes}")
            time.sleep(2)
        stop_writes.set()
        writer.join()
        stop_stream.set()
        streamer.join()
        pipeline.catch_up()
        ok = print_diffs(pipeline.verify())
    print(
        "\nIceberg equals PostgreSQL." if ok else "\nDIFFERENCES FOUND.",
        f"\nTry: .venv/bin/pg2iceberg-dagster -c {config_path} status",
        f"\nPostgreSQL keeps running on port {port}; stop it with: "
        f".venv/bin/python -m pg2iceberg_dagster.embedded stop {postgres.root}",
    )
    return 0 if ok else 5
