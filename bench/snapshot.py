"""Snapshot throughput against raw COPY at equal parallelism, and against dlt, in the same run.

    .venv/bin/python -m bench.snapshot [--narrow-rows 2000000] [--wide-rows 500000] [--taxi-rows 2000000]
                                       [--datasets narrow wide taxi] [--parallelism 1 2]
                                       [--repeat 1] [--no-dlt] [--json report.json]

Starts its own PostgreSQL, fills a pgbench_accounts-like narrow table, a wide typed table
(text, numerics, timestamps, uuid, jsonb, arrays, NULLs) and a table of the public NYC yellow-taxi
schema (19 integer, double, timestamp and text columns, generated rows), then for each table measures:

- the limit: raw ``COPY (SELECT * FROM t WHERE ctid range) TO STDOUT`` into /dev/null by ``psql``,
  with the table split into as many CTID ranges as there are workers, all running at once;
- our snapshot (``Pipeline.snapshot``: slot with an exported snapshot, CTID chunks read in
  parallel into Arrow, written as Parquet data files as they arrive, one Iceberg commit for every
  chunk written by then, on a file:// warehouse) with the same number of workers;
- dlt's ``sql_database`` source loading the same table into Iceberg, with its default pyarrow
  backend and with connectorx (in its own venv, ``.venv-peer``; ``--no-dlt`` skips it).

Rates are rows/s and heap MB/s; each figure is the median of ``--repeat`` runs. Targets: ours
>= 0.8 x raw COPY, >= 2.5 x dlt/connectorx, >= 5 x dlt/pyarrow (narrow and wide).

Cost per core, on the taxi table: rows per CPU-second of the snapshot's own process (client) and of
that process plus the PostgreSQL cluster (machine: every backend of the server, the catalog's too),
beside the figures published for other loaders of taxi data (:data:`PEERS`). Target:
>= 600k rows per client CPU-second. CPU-seconds, not wall time: on a shared machine they measure
the work, not the wait.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
from psycopg import sql
from pyiceberg.io.pyarrow import _get_parquet_writer_kwargs  # pyiceberg is pinned: its writer's options

from pg2iceberg_dagster.config import DEFAULT_TABLE_PROPERTIES
from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.snapshot.chunks import chunk_query, plan_table_chunks
from pg2iceberg_dagster.snapshot.reader import ArrowReader
from pg2iceberg_dagster.source.catalog import TypeResolver, describe_table

from .common import (
    SOURCE_DB,
    Report,
    argument_parser,
    bench_cluster,
    bench_config,
    fill_table,
    machine_busy_seconds,
    median,
    page_ranges,
    raw_copy,
    run_dlt_peer,
    server_cpu_seconds,
    work_dir,
)

CHUNK_PAGES = 2048
CORES = os.cpu_count() or 1
TAXI_TARGET = 600_000  # rows per client CPU-second
# Rows per CPU-second published for other loaders of NYC taxi data into Iceberg: rows loaded over the
# CPU-seconds the galaxy-io benchmark harness recorded for each in its published results.
PEERS = {"filament": 574_000, "OLake": 38_000}
PEERS_SOURCE = "galaxy-io benchmark harness, published results: rows over recorded CPU-seconds (issue 34)"


@dataclass
class Run:
    """One measured run: wall seconds, CPU seconds of this process, of the PostgreSQL cluster, and of
    the whole machine (whatever else runs on it included)."""

    seconds: float
    client_cpu: float
    server_cpu: float
    machine_cpu: float
    chunks: int = 0


# Which build of the driver decoded: the PyPI wheels of 1.9.0 to 1.13.0 are compiled without
# optimisation and decode at about twice the CPU of 1.8.0's (docs/performance-history.md).
DRIVER = f"adbc-driver-postgresql {version('adbc-driver-postgresql')}"


def measured(pg: EmbeddedPostgres, action: Callable[[], int]) -> Run:
    """Run ``action`` (it returns a chunk count) and measure it."""
    busy_before, _ = machine_busy_seconds()
    server_before = server_cpu_seconds(pg)
    cpu_before = time.process_time()
    started = time.perf_counter()
    chunks = action()
    seconds = time.perf_counter() - started
    client = time.process_time() - cpu_before
    server = server_cpu_seconds(pg) - server_before
    return Run(seconds, client, server, machine_busy_seconds()[0] - busy_before, chunks)


def snapshot(pg: EmbeddedPostgres, root: Path, table: str, workers: int, run: str) -> Run:
    """Our snapshot of ``table`` with ``workers`` chunks read at once, measured."""
    pg.create_database(f"state_{run}")  # each run its own coordination state
    config = bench_config(
        pg,
        root,
        [f"public.{table}"],
        state={"host": "127.0.0.1", "port": pg.port, "dbname": f"state_{run}", "user": pg.superuser},
        replication={"slot": f"slot_{run}", "publication": f"pub_{run}"},
        staging={"url": f"file://{root}/staging/{run}"},
        iceberg={"namespace": f"{run}_{{schema}}"},
        snapshot={"chunk_pages": CHUNK_PAGES, "parallelism": workers},
    )
    with Pipeline(config) as pipeline:
        # Connection checks and opening the catalog (SQLAlchemy's import and engine, ~0.3 s once per
        # process) are not the snapshot's cost.
        pipeline.validate()
        _ = pipeline.catalog  # opened on first use

        def run_snapshot() -> int:
            result = pipeline.snapshot()[f"public.{table}"]
            if not result.complete:
                raise RuntimeError(f"snapshot of {table} did not complete")
            return result.chunks_run

        return measured(pg, run_snapshot)


def median_run(runs: list[Run]) -> Run:
    """The run of median wall time."""
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


def floor_cpu(pg: EmbeddedPostgres, root: Path, table: str) -> tuple[float, float]:
    """CPU-seconds of this process to decode ``table``'s chunks from binary COPY into Arrow (the ADBC
    driver alone, the snapshot's own chunk queries) and to encode them as zstd Parquet the way the
    tables' writer does (no Iceberg, no commit): the least a snapshot of it can cost here."""
    config = bench_config(pg, root, [f"public.{table}"])
    with psycopg.connect(pg.conninfo(SOURCE_DB)) as conn:
        source = describe_table(conn, config.tables[0], TypeResolver(conn))
        chunks = plan_table_chunks(conn, source, CHUNK_PAGES)
    rule = config.values.out_of_range
    writer_options = _get_parquet_writer_kwargs(DEFAULT_TABLE_PROPERTIES)  # what pyiceberg writes with
    decode = encode = 0.0
    with ArrowReader(config.source) as reader:
        reader.read(sql.SQL("SELECT 1"), None)  # the driver's connection and type catalog: not per row
        for chunk in chunks:
            started = time.process_time()
            rows = reader.read(chunk_query(source, chunk, rule), None)
            decoded = time.process_time()
            pq.write_table(rows, pa.BufferOutputStream(), **writer_options)
            encode += time.process_time() - decoded
            decode += decoded - started
    return decode, encode


def cost_per_core(report: Report, rows: int, workers: int, run: Run) -> str:
    """Record the taxi snapshot's rows per client and per machine CPU-second against the target and
    the published peers; returns the line that says where they stand."""
    client = rows / run.client_cpu
    machine = rows / (run.client_cpu + run.server_cpu)
    report.ratio(f"taxi_p{workers}_client_rows_per_cpu_s_vs_target", client / TAXI_TARGET, 1.0)
    for peer, figure in PEERS.items():
        report.ratio(f"taxi_p{workers}_client_rows_per_cpu_s_vs_{peer}", client / figure)
    peers = ", ".join(f"{peer} {figure / 1e3:.0f}k" for peer, figure in PEERS.items())
    return (
        f"taxi, {workers} worker(s): {client / 1e3:.0f}k rows per client CPU-second ({run.client_cpu:.2f} CPU-s, "
        f"{run.client_cpu / rows * 1e6:.2f} us/row, decoding with {DRIVER}), {machine / 1e3:.0f}k per machine "
        "CPU-second (client + "
        f"server {run.server_cpu:.2f} CPU-s); target {TAXI_TARGET / 1e3:.0f}k per client CPU-second: "
        f"{client / TAXI_TARGET:.2f}; published peers per CPU-second: {peers} ({PEERS_SOURCE})"
    )


def floor_line(rows: int, workers: int, run: Run, decode: float, encode: float) -> str:
    """Why the taxi snapshot is below its target: what decoding and encoding alone cost."""
    beyond = run.client_cpu - decode - encode
    return (
        f"taxi, {workers} worker(s), below {TAXI_TARGET / 1e3:.0f}k rows per client CPU-second: the same chunks "
        f"decoded from binary COPY into Arrow by the ADBC driver ({DRIVER}) alone took {decode:.2f} CPU-s "
        f"({decode / rows * 1e6:.2f} us/row) and their Parquet encoding alone (zstd, the tables' writer options) "
        f"{encode:.2f} CPU-s ({encode / rows * 1e6:.2f} us/row): {rows / (decode + encode) / 1e3:.0f}k rows per "
        f"CPU-second with nothing else, the floor on this machine; the snapshot spent "
        f"{beyond:.2f} CPU-s beyond it ({beyond / rows * 1e6:.2f} us/row: Iceberg's writer, commits, coordination)"
    )


def main() -> None:
    parser = argument_parser(__doc__ or "")
    parser.add_argument("--narrow-rows", type=int, default=2_000_000)
    parser.add_argument("--wide-rows", type=int, default=500_000)
    parser.add_argument("--taxi-rows", type=int, default=2_000_000)
    parser.add_argument("--datasets", nargs="+", choices=["narrow", "wide", "taxi"], default=["narrow", "wide", "taxi"])
    parser.add_argument("--parallelism", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-dlt", action="store_true", help="skip the dlt comparison (never run on taxi)")
    args = parser.parse_args()
    report = Report(
        "snapshot",
        vars(args) | {"json": None, "dir": None, "chunk_pages": CHUNK_PAGES},
        [
            "table", "rows", "heap_mb", "loader", "workers", "seconds", "rows_per_s", "mb_per_s",
            "client_cpu_s", "server_cpu_s", "busy",
        ],
    )  # fmt: skip
    rows_of = {"narrow": args.narrow_rows, "wide": args.wide_rows, "taxi": args.taxi_rows}
    why: list[str] = []
    cost: list[str] = []
    with work_dir(args.dir) as root, bench_cluster(root) as pg:
        for dataset in args.datasets:
            rows = rows_of[dataset]
            heap = fill_table(pg, dataset, dataset, rows)
            mb = heap / 1e6
            pages = heap // 8192
            ours: dict[int, float] = {}
            for workers in args.parallelism:
                ranges = page_ranges(dataset, pages, workers)
                copy = median_run([measured(pg, lambda: raw_copy(pg, ranges, workers)) for _ in range(args.repeat)])  # noqa: B023
                run = median_run(
                    [
                        snapshot(pg, root, dataset, workers, f"{dataset}_p{workers}_r{attempt}")
                        for attempt in range(args.repeat)
                    ]
                )
                ours[workers] = run.seconds
                for loader, measured_run in (("raw COPY (psql)", copy), (f"pg2iceberg ({run.chunks} chunks)", run)):
                    busy = measured_run.machine_cpu / (measured_run.seconds * CORES)
                    report.add(
                        dataset, rows, mb, loader, workers, measured_run.seconds, rows / measured_run.seconds,
                        mb / measured_run.seconds, measured_run.client_cpu, measured_run.server_cpu, f"{busy:.0%}",
                    )  # fmt: skip
                report.ratio(f"{dataset}_p{workers}_vs_raw_copy", copy.seconds / run.seconds, 0.8)
                if dataset == "taxi":
                    cost.append(cost_per_core(report, rows, workers, run))
                    if rows / run.client_cpu < TAXI_TARGET:
                        why.append(floor_line(rows, workers, run, *floor_cpu(pg, root, dataset)))
                why.append(
                    f"{dataset}, {workers} worker(s): raw COPY used {copy.machine_cpu:.1f} CPU-s in all; the snapshot "
                    f"used {run.machine_cpu:.1f} CPU-s, {run.client_cpu:.1f} of them in this process (binary COPY "
                    f"decoding into Arrow, Parquet encoding, Iceberg commits: "
                    f"{run.client_cpu / rows * 1e6:.2f} us/row), on {CORES} cores; even with every core busy it "
                    f"needs {run.machine_cpu / CORES:.2f} s, which caps the ratio at "
                    f"{copy.seconds * CORES / run.machine_cpu:.2f}"
                )
            if args.no_dlt or dataset == "taxi":
                continue
            best = min(ours.values())
            for backend, target in (("connectorx", 2.5), ("pyarrow", 5.0)):
                peer = median(
                    [
                        run_dlt_peer(pg, dataset, backend, root / f"dlt_{dataset}_{backend}_{attempt}")["seconds"]
                        for attempt in range(args.repeat)
                    ]
                )
                report.add(
                    dataset, rows, mb, f"dlt ({backend})", "dlt default", peer, rows / peer, mb / peer, "-", "-", "-"
                )
                report.ratio(f"{dataset}_vs_dlt_{backend}", peer / best, target)
    for line in cost:
        print(f"cost per core: {line}")
    for line in why:
        print(f"why: {line}")
    report.emit(args.json)


if __name__ == "__main__":
    main()
