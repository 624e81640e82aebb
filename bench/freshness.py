"""Freshness: seconds from a PostgreSQL commit until the row can be read from Iceberg, under steady writes.

    .venv/bin/python -m bench.freshness [--seconds 60] [--rate 200] [--rows 100000] [--modes run,dagster]

Starts its own PostgreSQL with a narrow table of ``--rows`` rows. A writer thread commits ``--rate``
single-row transactions per second (three in four insert a new id, one updates an older row) and
records each commit's wall-clock time; a poller scans the Iceberg table with pyiceberg every 0.5 s
and records when each new id is first seen. Latency = first seen - commit, for the ids committed in
a ``--seconds`` window that opens ``--warmup`` seconds after the first write is visible: the
snapshot is taken, Spark started, and the merges right after the first, cold one (which catch up
with the writes queued behind it, in a JVM still compiling its hot code) are behind.

- ``run``: the CLI ``pg2iceberg-dagster run`` in a child process (snapshot, flusher thread, merges
  in one long-lived Spark session; while no merge runs the flusher stages after
  ``flush.min_interval_seconds``). Target p99 <= 3 s.
- ``dagster``: ``dagster dev`` in a child process on the same kind of pipeline (snapshot taken first
  by the engine); the flusher sensor stages, the merge sensor launches merge runs, each run a new
  process attached to the pipeline's warm Spark driver when its batch needs Spark (the first such run
  starts it). Target p99 <= 10 s; ``--min-run-interval 0`` for runs back to back.

Each latency is split where the pipeline hands over: commit -> staged (``log_index.created_at`` of
the file holding the change) -> Iceberg commit (the snapshot that made it visible) -> seen; under
Dagster also staged -> merge run created -> run started -> merged, with the merge's own phases.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.expressions import GreaterThan

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.coordination.store import CoordinationStore
from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.iceberg.catalog import open_catalog
from pg2iceberg_dagster.pipeline import Pipeline

from .common import (
    SOURCE_DB,
    Report,
    argument_parser,
    bench_cluster,
    child_process,
    dagster_dev,
    dagster_runs_since,
    fill_table,
    mode_config,
    paced,
    percentile,
    wait_for,
    work_dir,
)

ROOT = Path(__file__).resolve().parent.parent
TABLE = "accounts"
TABLE_KEY = f"public.{TABLE}"
KEY = "aid"
POLL_SECONDS = 0.5
TARGETS = {"run": 3.0, "dagster": 10.0}


class Writer(threading.Thread):
    """Single-row transactions at ``rate`` per second: inserts of new ids (3 in 4) and updates of older rows."""

    def __init__(self, pg: EmbeddedPostgres, first_id: int, rate: float) -> None:
        super().__init__(name="writer", daemon=True)
        self.pg = pg
        self.next_id = first_id
        self.rate = rate
        self.stop = threading.Event()
        # In commit order, one per transaction (= one staged change): (new id or None, commit time).
        self.commits: list[tuple[int | None, float]] = []
        self.random = random.Random(7)

    def run(self) -> None:
        with psycopg.connect(self.pg.conninfo(SOURCE_DB), autocommit=True) as conn:
            for _ in paced(self.rate, self.stop):
                if len(self.commits) % 4 == 3:
                    conn.execute(
                        f"UPDATE {TABLE} SET abalance = abalance + 1 WHERE {KEY} = %s",
                        (self.random.randrange(1, self.next_id),),
                    )
                    self.commits.append((None, time.time()))
                else:
                    conn.execute(f"INSERT INTO {TABLE} VALUES (%s, 1, 0, 'fresh')", (self.next_id,))
                    self.commits.append((self.next_id, time.time()))
                    self.next_id += 1


class Poller(threading.Thread):
    """Scans the Iceberg table for ids above the last one seen, every ``POLL_SECONDS``."""

    def __init__(self, catalog: Catalog, identifier: str, after_id: int) -> None:
        super().__init__(name="poller", daemon=True)
        self.catalog = catalog
        self.identifier = identifier
        self.last = after_id
        self.stop = threading.Event()
        self.seen: dict[int, float] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.time()
            try:
                table = self.catalog.load_table(self.identifier)
            except NoSuchTableError:
                self.stop.wait(POLL_SECONDS)
                continue
            # A row this snapshot shows was visible once the load returned; not necessarily when it
            # started (the commit may have landed during the load): count from now, never early.
            observed = time.time()
            ids = table.scan(row_filter=GreaterThan(KEY, self.last), selected_fields=(KEY,)).to_arrow()[KEY]
            for new_id in ids.to_pylist():
                self.seen.setdefault(new_id, observed)
                self.last = max(self.last, new_id)
            self.stop.wait(max(0.0, POLL_SECONDS - (time.time() - started)))


@dataclass
class Measurement:
    """What one mode measured: per new id its commit, staged, Iceberg-commit and seen times."""

    mode: str
    window: tuple[float, float] = (0.0, 0.0)
    commits: dict[int, float] = field(default_factory=dict)
    staged: dict[int, float] = field(default_factory=dict)
    committed: dict[int, float] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)
    writes: int = 0
    extra: dict[str, list[float]] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    def in_window(self) -> list[int]:
        start, end = self.window
        return [i for i, t in self.commits.items() if start <= t <= end]


def write_config(pg: EmbeddedPostgres, root: Path, name: str, args: Any) -> tuple[PipelineConfig, Path]:
    """The pipeline config of one mode (own state database, slot and staging), also written as YAML.
    Defaults everywhere except what ``--flush-interval``, ``--flush-min-interval``, ``--min-run-interval`` and
    ``--property`` set."""
    flush = {"interval_seconds": args.flush_interval, "min_interval_seconds": args.flush_min_interval}
    flush = {key: value for key, value in flush.items() if value is not None}
    sections: dict[str, Any] = {"flush": flush} if flush else {}
    if args.min_run_interval is not None:
        sections["materialize"] = {"min_run_interval_seconds": args.min_run_interval}
    if args.property:
        properties = {"format-version": "2", **dict(p.split("=", 1) for p in args.property)}
        sections["iceberg"] = {"table_properties": properties}
    return mode_config(pg, root, [TABLE_KEY], "fresh", name, **sections)


def measure(
    pg: EmbeddedPostgres,
    config: PipelineConfig,
    mode: str,
    process: subprocess.Popen,
    log: Path,
    rows: int,
    rate: float,
    seconds: float,
    drain_seconds: float,
    warmup_seconds: float,
) -> Measurement:
    """Writes at ``rate`` while the child replicates; the window opens ``warmup_seconds`` after the
    first write is visible."""
    result = Measurement(mode)
    with CoordinationStore(config.state_connection) as store:

        def snapshot_complete() -> bool:
            try:
                state = store.table_state(TABLE_KEY)
            except psycopg.errors.UndefinedTable:  # the child has not created the coordination schema yet
                return False
            return state is not None and state.snapshot_complete

        wait_for(snapshot_complete, 300, "the snapshot", process, log)
    catalog = open_catalog(config)
    identifier = f"{config.iceberg_identifier(config.tables[0])[0]}.{TABLE}"
    writer = Writer(pg, rows + 1, rate)
    poller = Poller(catalog, identifier, rows)
    writer.start()
    poller.start()
    try:
        warmup = time.time()
        wait_for(lambda: bool(poller.seen), 300, "the first write to be visible", process, log)
        result.facts["first_visible_after_s"] = round(time.time() - warmup, 1)
        # The first merge starts Spark and takes seconds; the merges after it catch up with what was
        # written meanwhile, in a JVM still warming up. That is the start of the process, not its
        # steady freshness.
        time.sleep(warmup_seconds)
        start = time.time()
        time.sleep(seconds)
        result.window = (start, time.time())
        writer.stop.set()
        writer.join()
        result.commits = {i: t for i, t in writer.commits if i is not None}
        wanted = result.in_window()
        deadline = time.monotonic() + drain_seconds
        while time.monotonic() < deadline and not all(i in poller.seen for i in wanted):
            if process.poll() is not None:
                break
            time.sleep(0.5)
    finally:
        writer.stop.set()
        poller.stop.set()
        poller.join()
    result.seen = dict(poller.seen)
    result.writes = len(writer.commits)
    result.facts["achieved_rate"] = round(len([t for _, t in writer.commits if result.window[0] <= t]) / seconds, 1)
    result.staged = staged_times(config, writer.commits)
    result.committed = iceberg_commit_times(catalog, identifier, result.seen)
    return result


def staged_times(config: PipelineConfig, commits: list[tuple[int | None, float]]) -> dict[int, float]:
    """When each new id's change was registered in the staged log. The writer's k-th transaction is
    the k-th change in the log (one change each, all after the slot was created)."""
    with psycopg.connect(config.state_connection.conninfo()) as conn:
        entries = conn.execute(
            "SELECT start_offset, end_offset, extract(epoch FROM created_at) FROM _pg2iceberg.log_index "
            "WHERE table_name = %s ORDER BY start_offset",
            (TABLE_KEY,),
        ).fetchall()
    staged: dict[int, float] = {}
    for start, end, created in entries:
        for offset in range(start, min(end, len(commits))):
            new_id = commits[offset][0]
            if new_id is not None:
                staged[new_id] = float(created)
    return staged


def iceberg_commit_times(catalog: Catalog, identifier: str, seen: dict[int, float]) -> dict[int, float]:
    """Per seen id, the time of the last Iceberg snapshot committed before it was seen (the one that made
    it visible: rows only ever appear in log order)."""
    table = catalog.load_table(identifier)
    stamps = sorted(s.timestamp_ms / 1000 for s in table.snapshots())
    committed: dict[int, float] = {}
    index = 0
    for new_id, when in sorted(seen.items(), key=lambda item: item[1]):
        while index + 1 < len(stamps) and stamps[index + 1] <= when:
            index += 1
        if stamps and stamps[index] <= when:
            committed[new_id] = stamps[index]
    return committed


def measure_run(pg: EmbeddedPostgres, root: Path, args: Any) -> Measurement:
    """The CLI ``run`` in a child process."""
    config, path = write_config(pg, root, "run", args)
    log = root / "run.log"
    command = [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(path), "-v", "run"]
    with child_process(command, log) as process:
        return measure(pg, config, "run", process, log, args.rows, args.rate, args.seconds, args.drain, args.warmup)


def measure_dagster(pg: EmbeddedPostgres, root: Path, args: Any) -> Measurement:
    """``dagster dev`` in a child process; the snapshot is taken by the engine first."""
    config, path = write_config(pg, root, "dagster", args)
    with Pipeline(config) as pipeline:
        pipeline.snapshot()
    started = time.time()
    with dagster_dev(root, path) as (process, log, home):
        result = measure(
            pg, config, "dagster", process, log, args.rows, args.rate, args.seconds, args.drain, args.warmup
        )
    dagster_breakdown(home, started, result)
    return result


def dagster_breakdown(home: Path, since: float, result: Measurement) -> None:
    """Merge runs from the Dagster instance: when each was created, started and committed, and its phases."""
    from dagster import DagsterEventType

    runs = []
    with dagster_runs_since(home, since) as (instance, records):
        for record in records:
            selection = record.dagster_run.asset_selection or set()
            if not any(key.path[-1] == TABLE for key in selection):
                continue  # snapshot-chunk runs
            events = instance.all_logs(record.dagster_run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
            merged = [e for e in events if e.dagster_event and e.dagster_event.asset_key.path[-1] == TABLE]
            if not merged or record.start_time is None:
                continue
            metadata = merged[0].dagster_event.event_specific_data.materialization.metadata  # type: ignore[union-attr]
            steps = instance.all_logs(record.dagster_run.run_id, of_type=DagsterEventType.STEP_START)
            runs.append(
                {
                    "created": record.create_timestamp.timestamp(),
                    "started": record.start_time,
                    # RUN_START -> STEP_START: the run's process start, imports, resources, executor.
                    "step_started": min((e.timestamp for e in steps), default=record.start_time),
                    "merged": merged[0].timestamp,
                    "ended": record.end_time or merged[0].timestamp,
                    "phases": {
                        k.removeprefix("merge_").removesuffix("_seconds"): float(v.value)
                        for k, v in metadata.items()
                        if k.startswith("merge_") and k.endswith("_seconds")
                    },
                    "changes": int(metadata["changes_applied"].value) if "changes_applied" in metadata else 0,
                }
            )
    runs.sort(key=lambda r: r["merged"])
    result.facts["merge_runs"] = len(runs)
    if len(runs) > 1:
        span = runs[-1]["created"] - runs[0]["created"]
        result.facts["merge_runs_per_hour"] = round((len(runs) - 1) * 3600 / span, 1) if span > 0 else None
    extra: dict[str, list[float]] = {
        "run: created -> started (queue, launch)": [r["started"] - r["created"] for r in runs],
        "run: started -> step started (start-up)": [r["step_started"] - r["started"] for r in runs],
        "run: started -> merged (process, JVM, merge)": [r["merged"] - r["started"] for r in runs],
        "run: merged -> ended (asset checks)": [r["ended"] - r["merged"] for r in runs],
        "run: previous ended -> created": [b["created"] - a["ended"] for a, b in itertools.pairwise(runs)],
        "run: changes merged": [float(r["changes"]) for r in runs],
    }
    for phase in sorted({p for r in runs for p in r["phases"]}):
        extra[f"run merge phase: {phase}"] = [r["phases"].get(phase, 0.0) for r in runs]
    # Per id: staged -> the run that made it visible was created.
    waits = []
    for new_id in result.in_window():
        staged, seen = result.staged.get(new_id), result.seen.get(new_id)
        run = next((r for r in reversed(runs) if seen is not None and r["merged"] <= seen), None)
        if staged is not None and run is not None:
            waits.append(run["created"] - staged)
    extra["id: staged -> its run created (<0: joined a starting run)"] = waits
    result.extra = extra


def add_rows(report: Report, result: Measurement) -> None:
    """Distributions of the latency and of each hand-over, for the ids committed in the window."""
    ids = result.in_window()

    def spans(start: dict[int, float], end: dict[int, float]) -> list[float]:
        return [end[i] - start[i] for i in ids if i in start and i in end]

    series = {
        "commit -> seen (latency)": spans(result.commits, result.seen),
        "commit -> staged": spans(result.commits, result.staged),
        "staged -> Iceberg commit": spans(result.staged, result.committed),
        "Iceberg commit -> seen (poll)": spans(result.committed, result.seen),
        **result.extra,
    }
    for name, values in series.items():
        report.add(
            result.mode,
            name,
            len(values),
            percentile(values, 0.5),
            percentile(values, 0.9),
            percentile(values, 0.99),
            max(values, default=float("nan")),
        )
    missing = [i for i in ids if i not in result.seen]
    latencies = series["commit -> seen (latency)"]
    p99 = percentile(latencies, 0.99) if not missing else float("inf")
    report.ratio(f"{result.mode}_p99_seconds", p99, TARGETS[result.mode], at_most=True)
    report.parameters[f"{result.mode}_facts"] = {
        **result.facts,
        "writes": result.writes,
        "ids": len(ids),
        "never_seen": len(missing),
    }
    if result.mode == "dagster" and p99 > TARGETS["dagster"]:
        print(f"why: {dagster_why(series)}")


def dagster_why(series: dict[str, list[float]]) -> str:
    """Where a row's wait under Dagster goes, from the spans the bench read off the runs."""

    def p50(name: str) -> float:
        return percentile(series.get(name, []), 0.5)

    def p99(name: str) -> float:
        return percentile(series.get(name, []), 0.99)

    return (
        f"dagster: a row waits for a flusher sensor tick (commit -> staged p99 {p99('commit -> staged'):.1f} s), "
        f"for the run of its table in progress to end, its checks included (merged -> ended p50 "
        f"{p50('run: merged -> ended (asset checks)'):.1f} s), for the merge sensor's next tick (previous ended -> "
        f"created p50 {p50('run: previous ended -> created'):.1f} s), and for a new run process (created -> started "
        f"p50 {p50('run: created -> started (queue, launch)'):.1f} s: the daemon's dequeue, a Python process "
        f"importing the code location) before its merge ({p50('run: started -> merged (process, JVM, merge)'):.1f} s)"
    )


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window")
    parser.add_argument("--rate", type=float, default=200.0, help="single-row transactions per second")
    parser.add_argument("--rows", type=int, default=100_000, help="rows in the table before the writes")
    parser.add_argument("--drain", type=float, default=90.0, help="how long to wait for the window's last writes")
    parser.add_argument(
        "--warmup", type=float, default=15.0, help="seconds from the first visible write to the window's start"
    )
    parser.add_argument("--modes", default="run,dagster", help="run, dagster or both")
    parser.add_argument("--flush-interval", type=float, help="flush.interval_seconds (default: the config default)")
    parser.add_argument(
        "--flush-min-interval", type=float, help="flush.min_interval_seconds (default: the config default)"
    )
    parser.add_argument(
        "--min-run-interval",
        type=float,
        help="materialize.min_run_interval_seconds (default: the config default; 0 for the freshest Dagster runs)",
    )
    parser.add_argument(
        "--property", action="append", default=[], metavar="KEY=VALUE", help="an Iceberg table property"
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    report = Report(
        "freshness",
        {
            "seconds": args.seconds,
            "warmup": args.warmup,
            "rate": args.rate,
            "rows": args.rows,
            "modes": modes,
            "poll_seconds": POLL_SECONDS,
            "flush_interval": args.flush_interval,
            "flush_min_interval": args.flush_min_interval,
            "min_run_interval": args.min_run_interval,
            "properties": args.property,
        },
        ["mode", "span", "count", "p50_s", "p90_s", "p99_s", "max_s"],
    )
    with work_dir(args.dir) as root, bench_cluster(root) as pg:
        fill_table(pg, "narrow", TABLE, args.rows)
        for mode in modes:
            with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
                # Each mode starts from the same table: drop what the previous mode's writer added.
                conn.execute(f"DELETE FROM {TABLE} WHERE {KEY} > %s", (args.rows,))
            measured = measure_run(pg, root, args) if mode == "run" else measure_dagster(pg, root, args)
            add_rows(report, measured)
    report.emit(args.json)


if __name__ == "__main__":
    main()
