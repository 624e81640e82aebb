"""Snapshot throughput against the physical limit measured in the same run: raw COPY of the table.

    .venv/bin/python bench/snapshot_vs_copy.py [--rows 1000000]

Starts its own PostgreSQL (temporary directory, free port), fills a table, then measures
(1) raw ``COPY ... TO STDOUT`` (bytes read, nothing parsed) and (2) the pipeline's snapshot
(CTID chunks, parsing, Arrow, Iceberg commits on a file:// warehouse), and prints both and the ratio.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

import psycopg

from pg2iceberg_dagster.config import parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.pipeline import Pipeline


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--parallelism", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pg2iceberg-bench-") as directory:
        root = Path(directory)
        pg = EmbeddedPostgres(root / "pg", free_port())
        pg.start()
        try:
            pg.create_database("bench")
            pg.create_database("catalog")
            with psycopg.connect(pg.conninfo("bench"), autocommit=True) as conn:
                conn.execute(
                    "CREATE TABLE orders (id bigint PRIMARY KEY, customer int, amount numeric(12,2), "
                    "status text, created timestamptz)"
                )
                conn.execute(
                    "INSERT INTO orders SELECT g, g %% 1000, g / 7.0, 'status ' || (g %% 5), "
                    "timestamptz '2026-01-01' + g * interval '1 second' FROM generate_series(1, %s) g",
                    (args.rows,),
                )
                conn.execute("VACUUM ANALYZE orders")
                started = time.perf_counter()
                copied = 0
                with conn.cursor().copy("COPY orders TO STDOUT") as copy:
                    for block in copy:
                        copied += len(block)
                copy_seconds = time.perf_counter() - started
            config = parse_config(
                {
                    "source": {"port": pg.port, "dbname": "bench"},
                    "tables": [{"name": "public.orders"}],
                    "staging": {"url": f"file://{root}/staging"},
                    "iceberg": {
                        "warehouse": f"file://{root}/warehouse",
                        "catalog": {"postgres": {"port": pg.port, "dbname": "catalog"}},
                    },
                    "snapshot": {"parallelism": args.parallelism},
                }
            )
            with Pipeline(config) as pipeline:
                started = time.perf_counter()
                results = pipeline.snapshot()
                snapshot_seconds = time.perf_counter() - started
            chunks = results["public.orders"].chunks_run
        finally:
            pg.stop()
    copy_rate = args.rows / copy_seconds
    snapshot_rate = args.rows / snapshot_seconds
    print(f"raw COPY:  {args.rows} rows, {copied / 1e6:.1f} MB in {copy_seconds:.2f} s = {copy_rate:,.0f} rows/s")
    print(f"snapshot:  {args.rows} rows in {chunks} chunks in {snapshot_seconds:.2f} s = {snapshot_rate:,.0f} rows/s")
    print(f"ratio snapshot / raw COPY: {snapshot_rate / copy_rate:.2f}")


if __name__ == "__main__":
    main()
