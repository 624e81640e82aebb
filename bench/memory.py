"""Peak memory of the flusher and of the snapshot, each run as a child process, against what they handle.

    cd /work/main && .venv/bin/python -m bench.memory [--small 100000] [--large 1000000] [--snapshot-rows 500000]

On a throwaway cluster, with the pipeline's CLI as a child process (its own peak RSS comes from wait4):

1. the snapshot: ``pg2iceberg-dagster snapshot`` of a wide table of ``--snapshot-rows`` rows (and of an
   empty narrow one): a chunk is in memory from its read until its data files are written, at most
   four per worker, so its memory follows the chunk size and the parallelism, not the table;
2. the flusher: ONE transaction inserts ``--small`` rows into the narrow table (a single
   ``INSERT ... SELECT generate_series``), then ``pg2iceberg-dagster stream --until-caught-up`` stages
   it; then the same with ONE transaction of ``--large`` rows. Past ``flush.txn_memory_bytes`` the open
   transaction spills to a temporary file and is staged from it in chunks, so the peak should not
   grow with the transaction: ``rss_large / rss_small`` is expected to stay at most about 1.5.

A ``validate`` child (imports, connections, startup checks, no data) gives the floor of a process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psycopg

from .common import (
    NARROW_FILL,
    SOURCE_DB,
    ChildRun,
    Report,
    argument_parser,
    bench_cluster,
    bench_config,
    checked,
    fill_table,
    run_child,
    work_dir,
    write_config,
)

NARROW = "public.txn_rows"
WIDE = "public.wide_rows"
CLI = str(Path(sys.executable).with_name("pg2iceberg-dagster"))


def cli(config: Path, *command: str) -> list[str]:
    """The pipeline's CLI on ``config``."""
    return [CLI, "-c", str(config), *command]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--small", type=int, default=100_000, help="rows of the small transaction")
    parser.add_argument("--large", type=int, default=1_000_000, help="rows of the large transaction")
    parser.add_argument("--snapshot-rows", type=int, default=500_000, help="rows of the wide table snapshotted")
    args = parser.parse_args()
    report = Report(
        "memory",
        {"small": args.small, "large": args.large, "snapshot_rows": args.snapshot_rows},
        ["run", "rows", "seconds", "peak_rss_mib"],
    )
    with work_dir(args.dir) as root, bench_cluster(root) as pg:
        fill_table(pg, "narrow", NARROW, 0)
        heap = fill_table(pg, "wide", WIDE, args.snapshot_rows)
        config = bench_config(pg, root, [NARROW, WIDE])
        path = write_config(config, root / "pg2iceberg.yaml")
        log = root / "children.log"
        report.parameters.update(
            wide_heap_mib=round(heap / 2**20, 1),
            txn_memory_mib=round(config.flush.txn_memory_bytes / 2**20, 1),
            chunk_pages=config.snapshot.chunk_pages,
            parallelism=config.snapshot.parallelism,
        )

        floor = checked(run_child(cli(path, "validate"), log), "validate", log)
        report.add("validate (floor)", 0, round(floor.seconds, 1), round(floor.peak_rss_mib, 1))
        snapshot = checked(run_child(cli(path, "snapshot"), log), "snapshot", log)
        report.add(f"snapshot {WIDE}", args.snapshot_rows, round(snapshot.seconds, 1), round(snapshot.peak_rss_mib, 1))

        stream: dict[int, ChildRun] = {}
        start = 1
        for rows in (args.small, args.large):
            with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
                # One statement in autocommit: one transaction of ``rows`` changes.
                conn.execute(NARROW_FILL.format(name=NARROW, start=start, stop=start + rows - 1))
            start += rows
            run = checked(run_child(cli(path, "stream", "--until-caught-up"), log), "stream", log)
            stream[rows] = run
            report.add(f"stream, 1 txn of {rows:,} rows", rows, round(run.seconds, 1), round(run.peak_rss_mib, 1))
    ratio = stream[args.large].peak_rss_mib / stream[args.small].peak_rss_mib
    report.ratio("flusher_rss_large_vs_small", ratio, 1.5, at_most=True)
    report.emit(args.json)


if __name__ == "__main__":
    main()
