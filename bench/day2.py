"""Day 2: ``run`` for a long time under steady writes, with maintenance on and off.

    .venv/bin/python -m bench.day2 [--minutes 30] [--rate 200] [--rows 100000] [--modes on,off]

Starts its own PostgreSQL with a narrow table of ``--rows`` rows. For each mode, the CLI
``pg2iceberg-dagster run`` runs in a child process on its own slot, state database and Iceberg
namespace while a writer commits ``--rate`` single-row transactions per second (three in four insert,
one updates an older row). Every ``--sample-seconds`` the bench reads, from Iceberg, the table's data
and delete files and its snapshots, and times a full scan of it with pyiceberg; each merge's duration
comes from ``run``'s log.

Reported per mode, for the first ``--window`` minutes after a warm-up of one maintenance interval plus
one retention (before that no pass can have expired a snapshot) and for the last ``--window``
minutes of the writes: the mean file count, snapshot count, full-scan seconds (raw, and per million
rows: the table grows under the inserts), merge seconds and rows, and last/first for each. Target
with maintenance on: files, snapshots, scan seconds per million rows and merge seconds flat
(last/first <= 1.2). Maintenance runs with a short interval and retention here
(``--interval-minutes``, ``--retention-minutes``, 1 each) so that a 30-minute run sees many passes;
the file and snapshot bounds scale with them. The table merges on read by default (``--write-mode``):
each merge adds a data file and a delete file, the case compaction is for; copy-on-write rewrites
the data files a merge touches instead.
"""

from __future__ import annotations

import re
import sys
import time
from datetime import datetime
from pathlib import Path
from statistics import mean
from typing import Any

import psycopg

from pg2iceberg_dagster.coordination.store import CoordinationStore
from pg2iceberg_dagster.iceberg.catalog import open_catalog
from pg2iceberg_dagster.maintenance import summary_health
from pg2iceberg_dagster.tables import MirroredTables

from .common import SOURCE_DB, Report, argument_parser, bench_cluster, fill_table, mode_config, work_dir
from .freshness import KEY, TABLE, TABLE_KEY, Writer, child_process, wait_for

TARGET = 1.2
TARGETED = ("files", "snapshots", "scan_s_per_mrow", "merge_s")
# "2026-11-24 21:40:23,123 INFO pg2iceberg_dagster: merged public.accounts: 812 changes in 1.52 s (...)"
MERGE_LINE = re.compile(r"^(\S+ \S+) INFO pg2iceberg_dagster: merged \S+: \d+ changes in ([\d.]+) s")


def write_config(pg: Any, root: Path, mode: str, args: Any) -> tuple[Any, Path]:
    """The pipeline config of one mode (own state database, slot, staging and namespace)."""
    return mode_config(
        pg,
        root,
        [TABLE_KEY],
        "day2",
        mode,
        iceberg={"table_properties": {f"write.{kind}.mode": args.write_mode for kind in ("merge", "update", "delete")}},
        maintenance={
            "enabled": mode == "on",
            "interval_minutes": args.interval_minutes,
            "snapshot_retention_hours": args.retention_minutes / 60,
            "orphan_min_age_hours": args.retention_minutes / 60,
        },
    )


def sample(catalog: Any, identifier: tuple[str, str]) -> dict[str, float]:
    """Files and snapshots of the table now, and how long a full scan of it takes."""
    table = catalog.load_table(identifier)
    health = summary_health(table)
    started = time.monotonic()
    rows = table.scan().to_arrow().num_rows
    seconds = time.monotonic() - started
    return {
        "at": time.time(),
        "files": health.data_files + health.delete_files,
        "snapshots": health.snapshots,
        "scan_s": seconds,
        # The table grows under the writes (3 in 4 insert): a scan's time per million rows is what
        # files and deletes can make worse; the raw time also grows with the data.
        "scan_s_per_mrow": seconds / max(rows, 1) * 1e6,
        "rows": rows,
    }


def merges(log: Path) -> list[tuple[float, float]]:
    """(when, seconds) of each merge ``run`` logged."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        match = MERGE_LINE.match(line)
        if match:
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append((when, float(match.group(2))))
    return found


def measure(pg: Any, root: Path, mode: str, args: Any) -> dict[str, Any]:
    """One mode: ``run`` in a child process under writes for ``--minutes``; samples as it goes."""
    config, path = write_config(pg, root, mode, args)
    log = root / f"run_{mode}.log"
    command = [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(path), "-v", "run"]
    samples: list[dict[str, float]] = []
    with child_process(command, log) as process:
        with CoordinationStore(config.state_connection) as store:

            def snapshot_complete() -> bool:
                try:
                    state = store.table_state(TABLE_KEY)
                except psycopg.errors.UndefinedTable:
                    return False
                return state is not None and state.snapshot_complete

            wait_for(snapshot_complete, 600, "the snapshot", process, log)
        catalog = open_catalog(config)
        identifier = MirroredTables(config)[TABLE_KEY].iceberg
        with psycopg.connect(pg.conninfo(SOURCE_DB)) as conn:
            top = conn.execute(f"SELECT max({KEY}) FROM {TABLE}").fetchone()
        writer = Writer(pg, int(top[0] if top else 0) + 1, args.rate)
        writer.start()
        start = time.time()
        try:
            while time.time() - start < args.minutes * 60:
                if process.poll() is not None:
                    raise RuntimeError(f"run exited ({process.returncode}); see {log}")
                samples.append(sample(catalog, identifier))
                time.sleep(max(0.0, args.sample_seconds - (time.time() - samples[-1]["at"])))
        finally:
            writer.stop.set()
            writer.join()
        end = time.time()
    merged = [(when, seconds) for when, seconds in merges(log) if start <= when <= end]
    return {
        "mode": mode,
        "start": start,
        "end": end,
        "samples": samples,
        "merges": merged,
        "writes": len(writer.commits),
    }


def windows(measured: dict[str, Any], minutes: float, warmup: float) -> dict[str, tuple[float, float]]:
    """Per figure, its mean over the first ``minutes`` after ``warmup`` minutes of writes, and over the
    last ``minutes``."""
    start, end = measured["start"] + warmup * 60, measured["end"]
    first = (start, start + minutes * 60)
    last = (end - minutes * 60, end)

    def mean_in(points: list[tuple[float, float]], window: tuple[float, float]) -> float:
        values = [value for when, value in points if window[0] <= when <= window[1]]
        return mean(values) if values else float("nan")

    figures: dict[str, list[tuple[float, float]]] = {
        name: [(s["at"], s[name]) for s in measured["samples"]]
        for name in ("files", "snapshots", "scan_s", "scan_s_per_mrow", "rows")
    }
    figures["merge_s"] = measured["merges"]
    return {name: (mean_in(points, first), mean_in(points, last)) for name, points in figures.items()}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long each mode runs under writes")
    parser.add_argument("--rate", type=float, default=200.0, help="single-row transactions per second")
    parser.add_argument("--rows", type=int, default=100_000, help="rows in the table before the writes")
    parser.add_argument("--modes", default="on,off", help="maintenance on, off or both")
    parser.add_argument("--window", type=float, default=5.0, help="minutes of the first and last windows")
    parser.add_argument("--sample-seconds", type=float, default=20.0, help="how often files, snapshots, scan")
    parser.add_argument("--interval-minutes", type=float, default=1.0, help="maintenance.interval_minutes")
    parser.add_argument("--retention-minutes", type=float, default=1.0, help="snapshot retention and orphan age")
    parser.add_argument(
        "--write-mode",
        default="merge-on-read",
        choices=["merge-on-read", "copy-on-write"],
        help="the table's write.{merge,update,delete}.mode: merge-on-read leaves delete files and a file per merge",
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    report = Report(
        "day2",
        {
            key: getattr(args, key)
            for key in ("minutes", "rate", "rows", "window", "interval_minutes", "retention_minutes")
        },
        ["maintenance", "figure", "first", "last", "last/first"],
    )
    with work_dir(args.dir) as root, bench_cluster(root) as pg:
        fill_table(pg, "narrow", TABLE, args.rows)
        for mode in modes:
            measured = measure(pg, root, mode, args)
            warmup = args.interval_minutes + args.retention_minutes
            for figure, (first, last) in windows(measured, args.window, warmup).items():
                ratio = last / first if first else float("inf")
                report.add(mode, figure, first, last, ratio)
                # Rows and the raw scan grow with the data whatever maintenance does: no target.
                target = TARGET if mode == "on" and figure in TARGETED else None
                report.ratio(f"{mode}_{figure}_last_over_first", ratio, target, at_most=True)
            report.ratio(f"{mode}_achieved_rate", measured["writes"] / (measured["end"] - measured["start"]))
    report.emit(args.json)


if __name__ == "__main__":
    main()
