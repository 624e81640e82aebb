"""Snapshot throughput against raw COPY at equal parallelism, and against dlt, in the same run.

    .venv/bin/python -m bench.snapshot [--narrow-rows 2000000] [--wide-rows 500000] [--parallelism 1 2]
                                       [--repeat 1] [--no-dlt] [--json report.json]

Starts its own PostgreSQL, fills a pgbench_accounts-like narrow table and a wide typed table
(text, numerics, timestamps, uuid, jsonb, arrays, NULLs), then for each table measures:

- the limit: raw ``COPY (SELECT * FROM t WHERE ctid range) TO STDOUT`` into /dev/null by ``psql``,
  with the table split into as many CTID ranges as there are workers, all running at once;
- our snapshot (``Pipeline.snapshot``: slot with an exported snapshot, CTID chunks read in
  parallel, Arrow, Parquet, one Iceberg commit per chunk on a file:// warehouse) with the same
  number of workers;
- dlt's ``sql_database`` source loading the same table into Iceberg, with its default pyarrow
  backend and with connectorx (in its own venv, ``.venv-peer``; ``--no-dlt`` skips it).

Rates are rows/s and heap MB/s; each figure is the median of ``--repeat`` runs. Targets: ours
>= 0.8 x raw COPY, >= 2.5 x dlt/connectorx, >= 5 x dlt/pyarrow.
"""

from __future__ import annotations

import itertools
import subprocess
import time
from pathlib import Path

from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.pipeline import Pipeline

from .common import (
    SOURCE_DB,
    Report,
    argument_parser,
    bench_cluster,
    bench_config,
    fill_table,
    median,
    pg_tool,
    run_dlt_peer,
    work_dir,
)

CHUNK_PAGES = 2048


def raw_copy_seconds(pg: EmbeddedPostgres, table: str, pages: int, workers: int) -> float:
    """Wall time of ``workers`` psql processes each COPYing one CTID range of ``table`` to /dev/null."""
    bounds = [pages * index // workers for index in range(workers)] + [None]
    commands = []
    for start, stop in itertools.pairwise(bounds):
        where = f"ctid >= '({start},0)'::tid" + (f" AND ctid < '({stop},0)'::tid" if stop is not None else "")
        commands.append(
            [
                pg_tool("psql"),
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                pg.conninfo(SOURCE_DB),
                "-c",
                f"COPY (SELECT * FROM {table} WHERE {where}) TO STDOUT",
            ]
        )
    started = time.perf_counter()
    processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL) for command in commands]
    codes = [process.wait() for process in processes]
    elapsed = time.perf_counter() - started
    if any(codes):
        raise RuntimeError(f"psql COPY failed with exit codes {codes}")
    return elapsed


def snapshot_seconds(pg: EmbeddedPostgres, root: Path, table: str, workers: int, run: str) -> tuple[float, int]:
    """Wall time of our snapshot of ``table`` with ``workers`` parallel chunks; also its chunk count."""
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
        pipeline.validate()  # connection checks and catalog set-up are not the snapshot's cost
        started = time.perf_counter()
        results = pipeline.snapshot()
        elapsed = time.perf_counter() - started
    result = results[f"public.{table}"]
    if not result.complete:
        raise RuntimeError(f"snapshot of {table} did not complete")
    return elapsed, result.chunks_run


def main() -> None:
    parser = argument_parser(__doc__ or "")
    parser.add_argument("--narrow-rows", type=int, default=2_000_000)
    parser.add_argument("--wide-rows", type=int, default=500_000)
    parser.add_argument("--parallelism", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-dlt", action="store_true", help="skip the dlt comparison")
    args = parser.parse_args()
    report = Report(
        "snapshot",
        vars(args) | {"json": None, "dir": None, "chunk_pages": CHUNK_PAGES},
        ["table", "rows", "heap_mb", "loader", "workers", "seconds", "rows_per_s", "mb_per_s"],
    )
    with work_dir(args.dir) as root, bench_cluster(root) as pg:
        for dataset, rows in (("narrow", args.narrow_rows), ("wide", args.wide_rows)):
            heap = fill_table(pg, dataset, dataset, rows)
            pages = heap // 8192
            ours: dict[int, float] = {}
            for workers in args.parallelism:
                copy = median([raw_copy_seconds(pg, dataset, pages, workers) for _ in range(args.repeat)])
                runs = [
                    snapshot_seconds(pg, root, dataset, workers, f"{dataset}_p{workers}_r{attempt}")
                    for attempt in range(args.repeat)
                ]
                ours[workers] = median([seconds for seconds, _ in runs])
                report.add(dataset, rows, heap / 1e6, "raw COPY (psql)", workers, copy, rows / copy, heap / 1e6 / copy)
                report.add(
                    dataset,
                    rows,
                    heap / 1e6,
                    f"pg2iceberg ({runs[0][1]} chunks)",
                    workers,
                    ours[workers],
                    rows / ours[workers],
                    heap / 1e6 / ours[workers],
                )
                report.ratio(f"{dataset}_p{workers}_vs_raw_copy", copy / ours[workers], 0.8)
            if args.no_dlt:
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
                    dataset, rows, heap / 1e6, f"dlt ({backend})", "dlt default", peer, rows / peer, heap / 1e6 / peer
                )
                report.ratio(f"{dataset}_vs_dlt_{backend}", peer / best, target)
    report.emit(args.json)


if __name__ == "__main__":
    main()
