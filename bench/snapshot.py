"""Snapshot throughput against raw COPY at equal parallelism, and against dlt, in the same run.

    .venv/bin/python -m bench.snapshot [--narrow-rows 2000000] [--wide-rows 500000] [--parallelism 1 2]
                                       [--repeat 1] [--no-dlt] [--json report.json]

Starts its own PostgreSQL, fills a pgbench_accounts-like narrow table and a wide typed table
(text, numerics, timestamps, uuid, jsonb, arrays, NULLs), then for each table measures:

- the limit: raw ``COPY (SELECT * FROM t WHERE ctid range) TO STDOUT`` into /dev/null by ``psql``,
  with the table split into as many CTID ranges as there are workers, all running at once;
- our snapshot (``Pipeline.snapshot``: slot with an exported snapshot, CTID chunks read in
  parallel into Arrow, written as Parquet data files as they arrive, one Iceberg commit for every
  chunk written by then, on a file:// warehouse) with the same number of workers;
- dlt's ``sql_database`` source loading the same table into Iceberg, with its default pyarrow
  backend and with connectorx (in its own venv, ``.venv-peer``; ``--no-dlt`` skips it).

Rates are rows/s and heap MB/s; each figure is the median of ``--repeat`` runs. Targets: ours
>= 0.8 x raw COPY, >= 2.5 x dlt/connectorx, >= 5 x dlt/pyarrow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.pipeline import Pipeline

from .common import (
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
    work_dir,
)

CHUNK_PAGES = 2048
CORES = os.cpu_count() or 1


@dataclass
class Run:
    """One measured run: wall seconds, CPU seconds of this process, CPU seconds of the whole machine."""

    seconds: float
    client_cpu: float
    machine_cpu: float
    chunks: int = 0


def measured(action: Callable[[], int]) -> Run:
    """Run ``action`` (it returns a chunk count) and measure it."""
    busy_before, _ = machine_busy_seconds()
    cpu_before = time.process_time()
    started = time.perf_counter()
    chunks = action()
    seconds = time.perf_counter() - started
    return Run(seconds, time.process_time() - cpu_before, machine_busy_seconds()[0] - busy_before, chunks)


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

        return measured(run_snapshot)


def median_run(runs: list[Run]) -> Run:
    """The run of median wall time."""
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


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
        ["table", "rows", "heap_mb", "loader", "workers", "seconds", "rows_per_s", "mb_per_s", "client_cpu_s", "busy"],
    )
    why: list[str] = []
    with work_dir(args.dir) as root, bench_cluster(root) as pg:
        for dataset, rows in (("narrow", args.narrow_rows), ("wide", args.wide_rows)):
            heap = fill_table(pg, dataset, dataset, rows)
            mb = heap / 1e6
            pages = heap // 8192
            ours: dict[int, float] = {}
            for workers in args.parallelism:
                ranges = page_ranges(dataset, pages, workers)
                copy = median_run([measured(lambda: raw_copy(pg, ranges, workers)) for _ in range(args.repeat)])  # noqa: B023
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
                        mb / measured_run.seconds, measured_run.client_cpu, f"{busy:.0%}",
                    )  # fmt: skip
                report.ratio(f"{dataset}_p{workers}_vs_raw_copy", copy.seconds / run.seconds, 0.8)
                why.append(
                    f"{dataset}, {workers} worker(s): raw COPY used {copy.machine_cpu:.1f} CPU-s in all; the snapshot "
                    f"used {run.machine_cpu:.1f} CPU-s, {run.client_cpu:.1f} of them in this process (binary COPY "
                    f"decoding into Arrow, Parquet encoding, Iceberg commits: "
                    f"{run.client_cpu / rows * 1e6:.2f} us/row), on {CORES} cores; even with every core busy it "
                    f"needs {run.machine_cpu / CORES:.2f} s, which caps the ratio at "
                    f"{copy.seconds * CORES / run.machine_cpu:.2f}"
                )
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
                report.add(dataset, rows, mb, f"dlt ({backend})", "dlt default", peer, rows / peer, mb / peer, "-", "-")
                report.ratio(f"{dataset}_vs_dlt_{backend}", peer / best, target)
    for line in why:
        print(f"why: {line}")
    report.emit(args.json)


if __name__ == "__main__":
    main()
