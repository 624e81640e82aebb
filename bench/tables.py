"""Many tables on one slot: snapshot of them all, then ``run`` under writes spread over every table.

    .venv/bin/python -m bench.tables [--tables 200] [--rate 200] [--seconds 120] [--drain 900]
                                     [--modes run[,dagster]] [--check-interval SECONDS]
                                     [--snapshot-only] [--profile FILE] [--file-latency-ms MS]
                                     [--json FILE] [--dir DIR]

Starts its own PostgreSQL with ``--tables`` tables of mixed sizes (about 1.5% of 100-200k rows, 10%
of 10-20k, the rest 500-2000; an integer key and one of three column shapes: pgbench-like, numeric
+ text + timestamptz, boolean + double + date + jsonb), all in one publication and one slot, one
pipeline config listing every table. Then:

1. **Snapshot.** The CLI ``snapshot`` of every table as a child process (its wall time and its peak
   RSS from wait4) against the limit: raw ``COPY ... TO STDOUT`` into /dev/null by as many psql
   processes as ``snapshot.parallelism``, over the same CTID chunks (``snapshot.chunk_pages``).
   Target ours >= 0.7 x raw, and at most 20 ms per table beyond the copy ((ours - raw) / tables).
   A ``validate`` child first gives the floor of a process on this config (start, imports, the
   startup checks of every table), and ``bench.iceberg_floor`` as a child the Iceberg library's own
   cost per table (a table created and one file appended, as many tables, one thread); with
   ``--file-latency-ms`` every Iceberg file the children create waits that long first, as an
   object store's PUT would (``bench/file_latency``). CPU seconds of the snapshot child (``wait4``)
   and of the server are reported for both. ``--snapshot-only`` stops here (after a ``verify`` of every table: the
   bench fails on any difference); ``--profile FILE`` runs the snapshot child under cProfile.
2. **``run`` under a spread workload.** The CLI ``run`` as a child; a writer commits ``--rate``
   single-row transactions per second, each on a table drawn uniformly at random (3 in 4 insert the
   table's next id, 1 in 4 update one of its rows). Target p99 <= 15 s. ``--modes dagster`` runs
   ``dagster dev`` instead, as bench.freshness does (the quickstart's instance settings), on whatever
   ``definitions.py`` builds, after a CLI snapshot; target p99 <= 60 s. Each mode has its own state
   database, slot, staging and namespace, and starts from the tables as filled.
3. **Catch up and compare.** ``verify --catch-up`` as a child: every table row by row against the
   source; the bench fails (exit 1) when any differs.

How the latency is measured, per inserted row (polling 200 tables with pyiceberg would load the
machine it measures):

- The writer records each commit's wall-clock time after ``COMMIT`` returned, and the table's ids
  are inserted in increasing order from (rows filled) + 1.
- A poller reads every table's ``metadata_location`` from the SQL catalog in one query every
  ``POLL_SECONDS``; the time taken is when that query has returned, so any metadata it names was
  committed, hence readable by anyone, by then (a row is never counted visible before a reader
  could load it). For each table whose location changed, the poller loads that metadata file
  alone and reads the current snapshot's ``total-records`` (maintenance's ``summary_health``).
- The writer never deletes, and the merges are copy-on-write (the bench stops if a table holds a
  delete file), so ``total-records - rows filled`` is the number of the table's inserts applied;
  merges apply a table's staged log as a prefix in commit order, so those are its first inserts.
  The k-th insert is visible at the first poll that saw at least k, and its latency is that poll's
  time minus its commit time: over-counted by up to one poll period, never under-counted.
- The prefix claim is checked, not assumed: every ``CHECK_EVERY`` polls, one of the tables just
  seen changed (in turn) is scanned at that snapshot, and its inserted ids must be exactly the first
  k; any mismatch fails the bench.
- Latencies are kept for inserts committed in a ``--seconds`` window that opens once every table
  has a write visible (Spark started and the pipeline came round every table once); afterwards the
  writer stops and the bench waits up to ``--drain`` seconds for the window's rows. A row never seen
  makes p99 infinite.

Each latency is split at the staged log (``log_index.created_at`` of the file holding the change:
the table's k-th change is the writer's k-th commit to it). Also reported: RSS of the ``run``
process (Python: flusher, merge loop; and with its Spark JVM) sampled every second, peak and last,
"bounded" when the peak of the window's last minute is at most 1.2 x that of its first; CPU seconds
of both in the window; staged files and flushes per second (``log_index``); Iceberg commits per
second (snapshots committed in the window, from each table's metadata); and the merges ``run``
logged (count, seconds each), which is where a pass over many tables goes.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from pyiceberg.expressions import GreaterThan
from pyiceberg.table import StaticTable

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.iceberg.catalog import open_catalog, shared_catalog_properties
from pg2iceberg_dagster.maintenance.health import summary_health
from pg2iceberg_dagster.tables import MirroredTables

from .common import (
    SOURCE_DB,
    Report,
    argument_parser,
    bench_cluster,
    checked,
    child_process,
    dagster_dev,
    dagster_runs_since,
    machine_busy_seconds,
    mode_config,
    paced,
    page_ranges,
    percentile,
    process_cpu_seconds,
    process_rss_mib,
    process_tree,
    raw_copy,
    run_child,
    server_cpu_seconds,
    timed,
    wait_for,
    work_dir,
)

KEY = "id"
POLL_SECONDS = 0.5
CHECK_EVERY = 4
TARGETS = {"snapshot": 0.7, "snapshot_ms_per_table": 20.0, "run": 15.0, "dagster": 60.0}
BOUNDED = 1.2
# CPU-seconds of ``run`` (Python and its JVM) per table merge, at most (issue 34).
MERGE_CORE_SECONDS = 0.1
CLI = [sys.executable, "-m", "pg2iceberg_dagster.cli"]


@dataclass(frozen=True)
class Shape:
    """A table's columns after the key, the values of row ``g`` for them, and what an update sets."""

    columns: str
    values: str
    update: str


SHAPES = (
    Shape("bid int NOT NULL, abalance int NOT NULL, filler char(84)", "mod(g, 1000), 0, ''", "abalance = abalance + 1"),
    Shape(
        "amount numeric(12,2), label text, at timestamptz",
        "g / 100.0, 'row ' || g, timestamptz '2026-01-01 00:00:00+00' + g * interval '1 second'",
        "amount = amount + 1, at = now()",
    ),
    Shape(
        "flag boolean, score double precision, day date, payload jsonb",
        "mod(g, 2) = 0, g * 0.5, date '2020-01-01' + mod(g, 3000)::int, jsonb_build_object('g', g)",
        "flag = NOT flag, score = score + 1",
    ),
)


@dataclass(frozen=True)
class SourceTable:
    name: str  # unqualified, in schema public; also the Iceberg table's name
    rows: int
    shape: Shape

    @property
    def key(self) -> str:
        return f"public.{self.name}"


def plan_tables(count: int, seed: int = 16) -> list[SourceTable]:
    """``count`` tables of mixed sizes in a shuffled order (a few large, some medium, most small)."""
    rng = random.Random(seed)
    large = max(1, round(count * 0.015))
    medium = max(1, round(count * 0.1))
    sizes = [rng.randint(100_000, 200_000) for _ in range(large)]
    sizes += [rng.randint(10_000, 20_000) for _ in range(medium)]
    sizes += [rng.randint(500, 2_000) for _ in range(max(0, count - large - medium))]
    rng.shuffle(sizes)
    return [SourceTable(f"t{index:03d}", rows, SHAPES[index % len(SHAPES)]) for index, rows in enumerate(sizes[:count])]


def fill_tables(pg: EmbeddedPostgres, tables: list[SourceTable]) -> dict[str, int]:
    """Create and fill the tables; returns each one's heap pages."""
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        for table in tables:
            conn.execute(f"CREATE TABLE {table.name} ({KEY} bigint PRIMARY KEY, {table.shape.columns})")
            conn.execute(
                f"INSERT INTO {table.name} SELECT g, {table.shape.values} FROM generate_series(1, %s) g", (table.rows,)
            )
        conn.execute("VACUUM (FREEZE, ANALYZE)")
        sizes = conn.execute(
            "SELECT relname, pg_relation_size(oid) / 8192 FROM pg_class WHERE relname = ANY(%s)",
            ([t.name for t in tables],),
        ).fetchall()
    return {name: int(pages) for name, pages in sizes}


class Writer(threading.Thread):
    """Single-row transactions at ``rate`` per second on tables drawn at random: 3 in 4 insert the
    table's next id, 1 in 4 update one of its rows."""

    def __init__(self, pg: EmbeddedPostgres, tables: list[SourceTable], rate: float) -> None:
        super().__init__(name="writer", daemon=True)
        self.pg = pg
        self.tables = tables
        self.rate = rate
        self.stop = threading.Event()
        self.next_id = {t.name: t.rows + 1 for t in tables}
        # Per table, in commit order, one per transaction (= one staged change): (new id or None, commit time).
        self.commits: dict[str, list[tuple[int | None, float]]] = defaultdict(list)
        self.count = 0
        self.random = random.Random(7)

    def run(self) -> None:
        with psycopg.connect(self.pg.conninfo(SOURCE_DB), autocommit=True) as conn:
            for _ in paced(self.rate, self.stop):
                table = self.random.choice(self.tables)
                new_id = self.next_id[table.name]
                if self.random.random() < 0.25:
                    conn.execute(
                        f"UPDATE {table.name} SET {table.shape.update} WHERE {KEY} = %s",
                        (self.random.randrange(1, new_id),),
                    )
                    self.commits[table.name].append((None, time.time()))
                else:
                    conn.execute(
                        f"INSERT INTO {table.name} SELECT g, {table.shape.values} FROM (SELECT %s AS g) s", (new_id,)
                    )
                    self.commits[table.name].append((new_id, time.time()))
                    self.next_id[table.name] = new_id + 1
                self.count += 1


class Poller(threading.Thread):
    """Every ``POLL_SECONDS``: every table's metadata location from the catalog in one query, and for
    those that changed, how many of the writer's inserts their current snapshot holds (see the
    module docstring)."""

    def __init__(self, config: PipelineConfig, tables: list[SourceTable]) -> None:
        super().__init__(name="poller", daemon=True)
        self.config = config
        self.filled = {t.name: t.rows for t in tables}
        self.namespace = MirroredTables(config)[tables[0].key].iceberg[0]
        self.properties = shared_catalog_properties(config)
        self.stop = threading.Event()
        self.locations: dict[str, str] = {}
        # Per table: (time seen, inserts visible), the count growing.
        self.seen: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.polls = 0
        self.checked = 0
        self.errors: list[str] = []
        self._turn = 0

    def visible(self, name: str) -> int:
        return self.seen[name][-1][1] if self.seen[name] else 0

    def run(self) -> None:
        try:
            self._poll_loop()
        except Exception as exc:  # surfaced to the bench: a poller that died would read as lag
            self.errors.append(f"poller failed: {exc!r}")

    def _poll_loop(self) -> None:
        with psycopg.connect(self.config.catalog_connection.conninfo(), autocommit=True) as conn:
            while not self.stop.is_set():
                started = time.time()
                rows = conn.execute(
                    "SELECT table_name, metadata_location FROM iceberg_tables "
                    "WHERE catalog_name = %s AND table_namespace = %s",
                    (self.config.iceberg.catalog.name, self.namespace),
                ).fetchall()
                # Every location named was committed before the query returned: count from now.
                observed = time.time()
                self.polls += 1
                changed = []
                for name, location in rows:
                    if name not in self.filled or self.locations.get(name) == location:
                        continue
                    self.locations[name] = location
                    table = StaticTable.from_metadata(location, self.properties)
                    health = summary_health(table)
                    if health.delete_files:
                        raise RuntimeError(f"{name} holds delete files: total-records no longer counts its rows")
                    count = health.records - self.filled[name]
                    if count > self.visible(name):
                        self.seen[name].append((observed, count))
                        changed.append((name, table, count))
                if changed and self.polls % CHECK_EVERY == 0:
                    self._turn += 1
                    self._check(*changed[self._turn % len(changed)])
                self.stop.wait(max(0.0, POLL_SECONDS - (time.time() - started)))

    def _check(self, name: str, table: StaticTable, count: int) -> None:
        """The snapshot holding ``count`` inserts holds exactly the table's first ``count`` new ids."""
        filled = self.filled[name]
        ids = table.scan(row_filter=GreaterThan(KEY, filled), selected_fields=(KEY,)).to_arrow()[KEY].to_pylist()
        self.checked += 1
        if sorted(ids) != list(range(filled + 1, filled + 1 + count)):
            self.errors.append(f"{name}: its snapshot counts {count} inserts but holds ids {sorted(ids)[:10]}...")


class Sampler(threading.Thread):
    """RSS and CPU seconds of a process (and of it with its children: a ``run``'s JVM) every second."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="sampler", daemon=True)
        self.pid = pid
        self.stop = threading.Event()
        # (time, rss of the process, rss with its children, cpu of the process, cpu with its children)
        self.samples: list[tuple[float, float, float, float, float]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            tree = process_tree(self.pid)
            self.samples.append(
                (
                    time.time(),
                    process_rss_mib(self.pid),
                    sum(process_rss_mib(pid) for pid in tree),
                    process_cpu_seconds(self.pid),
                    sum(process_cpu_seconds(pid) for pid in tree),
                )
            )
            self.stop.wait(1.0)


@dataclass
class RunMeasurement:
    window: tuple[float, float] = (0.0, 0.0)
    latencies: list[float] = field(default_factory=list)
    to_staged: list[float] = field(default_factory=list)
    staged_to_seen: list[float] = field(default_factory=list)
    never_seen: int = 0
    stopped: float = 0.0  # when the child was told to stop
    log: Path = Path()  # the child's output
    home: Path | None = None  # the Dagster instance's home (mode dagster)
    samples: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


def snapshot_rows(report: Report, pg: EmbeddedPostgres, path: Path, config: PipelineConfig, log: Path,
                  tables: list[SourceTable], pages: dict[str, int],
                  profile: Path | None = None) -> list[str]:  # fmt: skip
    """Raw COPY of every chunk, then the CLI ``snapshot`` of every table (under cProfile into
    ``profile`` when given); returns the ``why:`` lines."""
    chunk_pages, workers = config.snapshot.chunk_pages, config.snapshot.parallelism
    ranges = [
        r for t in tables for r in page_ranges(t.name, pages[t.name], max(1, math.ceil(pages[t.name] / chunk_pages)))
    ]
    rows = sum(t.rows for t in tables)
    busy, server = machine_busy_seconds()[0], server_cpu_seconds(pg)
    raw_seconds, _ = timed(lambda: raw_copy(pg, ranges, workers))
    raw_busy, raw_server = machine_busy_seconds()[0] - busy, server_cpu_seconds(pg) - server
    floor = checked(run_child([*CLI, "-c", str(path), "validate"], log), "validate", log)
    iceberg = iceberg_floor(path, len(tables), log)
    profiled = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", CLI[-1]] if profile else CLI
    busy, server = machine_busy_seconds()[0], server_cpu_seconds(pg)
    snapshot = checked(run_child([*profiled, "-c", str(path), "snapshot"], log), "snapshot", log)
    ours_busy, ours_server = machine_busy_seconds()[0] - busy, server_cpu_seconds(pg) - server
    blank = ("", "", "")
    report.add("snapshot", f"raw COPY, {workers} psql, {len(ranges)} ranges", rows, raw_seconds, rows / raw_seconds,
               *blank, "", "")  # fmt: skip
    report.add("snapshot", "validate child (floor)", "", floor.seconds, "", *blank, round(floor.peak_rss_mib), "")
    report.add("snapshot", f"Iceberg alone (floor): {len(tables)} tables created, one append each", "",
               iceberg["seconds"], "", *blank, "", "")  # fmt: skip
    report.add("snapshot", f"CLI snapshot, parallelism {workers}", rows, snapshot.seconds, rows / snapshot.seconds,
               *blank, round(snapshot.peak_rss_mib), "")  # fmt: skip
    per_table_ms = (snapshot.seconds - raw_seconds) / len(tables) * 1000
    iceberg_ms, iceberg_cpu_ms = (iceberg[key] / len(tables) * 1000 for key in ("seconds", "cpu_seconds"))
    # The library's CPU, not its wall time: one interpreter runs its Python one thread at a time, while
    # waits (object storage) overlap across tables.
    floor_ms = floor.seconds / len(tables) * 1000 + iceberg_cpu_ms
    report.ratio("snapshot_vs_raw_copy", raw_seconds / snapshot.seconds, TARGETS["snapshot"])
    report.ratio("snapshot_ms_per_table_beyond_copy", per_table_ms, TARGETS["snapshot_ms_per_table"], at_most=True)
    report.parameters["snapshot"] = {
        "rows": rows, "chunks": len(ranges), "raw_copy_machine_cpu_s": round(raw_busy, 2),
        "raw_copy_server_cpu_s": round(raw_server, 2), "snapshot_machine_cpu_s": round(ours_busy, 2),
        "snapshot_server_cpu_s": round(ours_server, 2), "snapshot_child_cpu_s": round(snapshot.cpu_seconds, 2),
        "snapshot_peak_rss_mib": round(snapshot.peak_rss_mib, 1), "validate_seconds": round(floor.seconds, 2),
        "validate_child_cpu_s": round(floor.cpu_seconds, 2), "ms_per_table_beyond_copy": round(per_table_ms, 1),
        "iceberg_floor_ms_per_table": round(iceberg_ms, 1),
        "iceberg_floor_cpu_ms_per_table": round(iceberg_cpu_ms, 1),
        "floor_ms_per_table": round(floor_ms, 1),
    }  # fmt: skip
    if per_table_ms <= TARGETS["snapshot_ms_per_table"]:
        return []
    above = ", above the target" if floor_ms > TARGETS["snapshot_ms_per_table"] else ""
    return [
        f"snapshot: {snapshot.seconds:.1f} s against raw COPY's {raw_seconds:.2f} s for {rows:,} rows in "
        f"{len(tables)} tables, {per_table_ms:.0f} ms per table beyond the copy (target "
        f"{TARGETS['snapshot_ms_per_table']:.0f}); a validate child alone (start, imports, checks of {len(tables)} "
        f"tables) takes {floor.seconds:.1f} s ({floor.cpu_seconds:.1f} CPU-s), the rest is per table (its Iceberg "
        "table created, its chunks planned and recorded, its commit): per-table costs, not rows, set the pace here; "
        f"the Iceberg library alone, creating a table and appending one file to it (bench.iceberg_floor, one "
        f"thread), spends {iceberg_cpu_ms:.0f} CPU-ms a table ({iceberg_ms:.0f} ms of wall time), which one "
        f"interpreter runs a thread at a time: with the validate child's share this machine's floor is "
        f"{floor_ms:.0f} ms a table{above}, and ours is {per_table_ms / floor_ms:.2f}x it; the snapshot process "
        f"spent {snapshot.cpu_seconds:.1f} CPU-s, the server {ours_server:.1f} (raw COPY: {raw_server:.1f}), the "
        f"machine {ours_busy:.1f} on ours and {raw_busy:.1f} on raw COPY"
    ]


def iceberg_floor(path: Path, tables: int, log: Path) -> dict[str, float]:
    """``bench.iceberg_floor`` as a child on ``path``'s catalog: its loop's seconds and CPU-seconds for
    ``tables`` tables."""
    out = log.parent / "iceberg_floor.json"
    command = [sys.executable, "-m", "bench.iceberg_floor", "-c", str(path), "--tables", str(tables), "--out", str(out)]
    checked(run_child(command, log), "iceberg floor", log)
    figures: dict[str, float] = json.loads(out.read_text())
    return figures


@contextlib.contextmanager
def pipeline_child(mode: str, root: Path, path: Path) -> Iterator[tuple[subprocess.Popen, Path, Path | None]]:
    """The CLI ``run`` (``mode`` run) or ``dagster dev`` (``mode`` dagster) on ``path`` as a child:
    (process, log, the Dagster home or None)."""
    if mode == "run":
        log = root / "run.log"
        with child_process([*CLI, "-c", str(path), "-v", "run"], log) as process:
            yield process, log, None
    else:
        with dagster_dev(root, path) as (process, log, home):
            yield process, log, home


def measure(mode: str, pg: EmbeddedPostgres, path: Path, config: PipelineConfig, root: Path,
            tables: list[SourceTable], args: Any) -> RunMeasurement:  # fmt: skip
    """The pipeline of ``mode`` as a child under the spread workload (see the module docstring)."""
    result = RunMeasurement()
    writer = Writer(pg, tables, args.rate)
    poller = Poller(config, tables)
    with pipeline_child(mode, root, path) as (process, log, home):
        sampler = Sampler(process.pid)
        for thread in (sampler, poller, writer):
            thread.start()
        try:
            warmup = time.time()
            # Warm-up: Spark started, then the pipeline came round every table once (under ``run``
            # its first pass, cold, is slower than the ones after): steady state from here.
            wait_for(
                lambda: any(poller.seen.values()) or bool(poller.errors), 600, "a first visible write", process, log
            )
            result.facts["first_visible_after_s"] = round(time.time() - warmup, 1)
            every = lambda: all(poller.seen.get(t.name) for t in tables) or bool(poller.errors)  # noqa: E731
            wait_for(every, 1200, "a visible write in every table", process, log)
            result.facts["every_table_visible_after_s"] = round(time.time() - warmup, 1)
            start = time.time()
            time.sleep(args.seconds)
            result.window = (start, time.time())
            writer.stop.set()
            writer.join()
            wanted = window_inserts(writer, result.window)
            deadline = time.monotonic() + args.drain
            while time.monotonic() < deadline and process.poll() is None and not poller.errors:
                if all(poller.visible(t.name) >= wanted.get(t.name, 0) - t.rows for t in tables):
                    break
                time.sleep(1.0)
            result.stopped = time.time()
            result.facts["drained_after_s"] = round(result.stopped - result.window[1], 1)
        finally:
            for thread in (writer, poller, sampler):
                thread.stop.set()
            poller.join()
            sampler.join()
    result.samples = sampler.samples
    result.log, result.home = log, home
    if poller.errors:
        raise RuntimeError("; ".join(poller.errors))
    result.facts.update(writes=writer.count, polls=poller.polls, prefix_checks=poller.checked)
    window_writes = sum(
        1 for rows in writer.commits.values() for _, t in rows if result.window[0] <= t <= result.window[1]
    )
    result.facts["achieved_rate"] = round(window_writes / (result.window[1] - result.window[0]), 1)
    latencies(result, config, tables, writer, poller)
    return result


def window_inserts(writer: Writer, window: tuple[float, float]) -> dict[str, int]:
    """Per table, the largest id inserted in ``window``."""
    return {
        name: max((i for i, t in rows if i is not None and window[0] <= t <= window[1]), default=0)
        for name, rows in writer.commits.items()
    }


def latencies(result: RunMeasurement, config: PipelineConfig, tables: list[SourceTable], writer: Writer,
              poller: Poller) -> None:  # fmt: skip
    """Per insert committed in the window: commit -> first poll that counted it, split at the staged log."""
    staged = staged_times(config, writer)
    start, end = result.window
    for table in tables:
        seen = poller.seen.get(table.name, [])
        counts = [count for _, count in seen]
        for index, (new_id, committed) in enumerate(writer.commits.get(table.name, [])):
            if new_id is None or not start <= committed <= end:
                continue
            at = bisect.bisect_left(counts, new_id - table.rows)  # first poll holding at least this many inserts
            if at == len(counts):
                result.never_seen += 1
                continue
            visible = seen[at][0]
            result.latencies.append(visible - committed)
            if (table.name, index) in staged:
                result.to_staged.append(staged[table.name, index] - committed)
                result.staged_to_seen.append(visible - staged[table.name, index])


def staged_times(config: PipelineConfig, writer: Writer) -> dict[tuple[str, int], float]:
    """When the writer's k-th change to each table was registered in the staged log (the table's k-th
    change in its log: nothing else writes to it after the snapshot)."""
    with psycopg.connect(config.state_connection.conninfo()) as conn:
        entries = conn.execute(
            "SELECT table_name, start_offset, end_offset, extract(epoch FROM created_at) FROM _pg2iceberg.log_index"
        ).fetchall()
    staged: dict[tuple[str, int], float] = {}
    for key, first, last, created in entries:
        name = key.split(".", 1)[1]
        for offset in range(first, min(last, len(writer.commits.get(name, [])))):
            staged[name, offset] = float(created)
    return staged


MERGED = re.compile(r"^(\S+ \S+) INFO \S+: merged (\S+): (\d+) changes in ([\d.]+) s \((.*)\), lag")
# ``run`` logs a pass's merges together once the pass is over: lines this close are one pass.
SAME_PASS_SECONDS = 0.5


@dataclass(frozen=True)
class LoggedMerge:
    logged: float
    changes: int
    seconds: float
    phases: dict[str, float]


def logged_merges(log: Path, since: float, until: float) -> list[LoggedMerge]:
    """The merges ``run`` logged from ``since`` to ``until``, but for the first of the process (it
    starts Spark: the warm-up, not the loop)."""
    merges = []
    for line in log.read_text(errors="replace").splitlines():
        match = MERGED.match(line)
        if not match:
            continue
        logged = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # logging's asctime, local time
        phases = {k: float(v) for k, v in (part.rsplit(" ", 1) for part in match[5].split(", ") if " " in part)}
        if since <= logged <= until and "spark_start" not in phases:
            merges.append(LoggedMerge(logged, int(match[3]), float(match[4]), phases))
    return merges


def passes(merges: list[LoggedMerge]) -> list[tuple[float, int]]:
    """``run``'s passes over the tables: (logged at, merges in it)."""
    found: list[tuple[float, int]] = []
    for merge in merges:
        if found and merge.logged - found[-1][0] <= SAME_PASS_SECONDS:
            found[-1] = (merge.logged, found[-1][1] + 1)
        else:
            found.append((merge.logged, 1))
    return found


def staged_in(config: PipelineConfig, window: tuple[float, float]) -> tuple[int, int]:
    """Staged files registered in ``window``, and flushes (one registering transaction each: one ``now()``)."""
    with psycopg.connect(config.state_connection.conninfo()) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT created_at) FROM _pg2iceberg.log_index "
            "WHERE created_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)",
            window,
        ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def iceberg_commits_in(config: PipelineConfig, tables: list[SourceTable], window: tuple[float, float]) -> int:
    """Iceberg snapshots committed in ``window`` over every table (from each table's metadata)."""
    catalog = open_catalog(config)
    commits = 0
    for table in tables:
        snapshots = catalog.load_table(MirroredTables(config)[table.key].iceberg).snapshots()
        commits += sum(1 for s in snapshots if window[0] <= s.timestamp_ms / 1000 <= window[1])
    return commits


def distribution(report: Report, mode: str, what: str, values: list[float], total: Any = "", rate: Any = "") -> None:
    """A row of ``values``' count, median, p99 and maximum."""
    report.add(mode, what, len(values), total, rate, percentile(values, 0.5), percentile(values, 0.99),
               max(values, default=float("nan")), "", "")  # fmt: skip


def mode_rows(report: Report, mode: str, result: RunMeasurement, config: PipelineConfig,
              tables: list[SourceTable]) -> list[str]:  # fmt: skip
    """The latency, memory, CPU, files and commits of ``mode``, and ``run``'s merge loop; returns ``why:`` lines."""
    start, end = result.window
    seconds = end - start

    def rate(what: str, count: float, over: float) -> None:
        report.add(mode, what, count, round(over, 1), count / over, "", "", "", "", "")

    distribution(report, mode, "commit -> seen (latency)", result.latencies)
    distribution(report, mode, "commit -> staged", result.to_staged)
    distribution(report, mode, "staged -> seen", result.staged_to_seen)
    p99 = percentile(result.latencies, 0.99) if not result.never_seen else float("inf")
    report.ratio(f"{mode}_p99_seconds", p99, TARGETS[mode], at_most=True)

    why = memory_rows(report, mode, result)
    files, flushes = staged_in(config, result.window)
    rate("staged files", files, seconds)
    rate("flushes", flushes, seconds)
    rate("Iceberg commits", iceberg_commits_in(config, tables, result.window), seconds)
    report.parameters[mode] = {
        **result.facts,
        "window_s": round(seconds, 1),
        "inserts_in_window": len(result.latencies) + result.never_seen,
        "never_seen": result.never_seen,
        "files_per_flush": round(files / flushes, 1) if flushes else None,
    }
    if mode == "run":
        why += merge_loop_rows(report, result, len(tables), config.materialize.parallelism, p99)
    elif result.home is not None:
        why += dagster_run_rows(report, result, result.home, p99)
    return why


def dagster_run_rows(report: Report, result: RunMeasurement, home: Path, p99: float) -> list[str]:
    """The Dagster runs that merged live tables (not snapshot chunks) from the window on: how long
    each waited to start and ran, and how many tables each merged; the ``why:`` line of a missed p99."""
    runs = []
    with dagster_runs_since(home, result.window[0]) as (_, records):
        for record in records:
            live = [k for k in record.dagster_run.asset_selection or () if not k.path[-1].endswith("_snapshot")]
            if live and record.start_time is not None and record.end_time is not None:
                runs.append((record.create_timestamp.timestamp(), record.start_time, record.end_time, len(live)))
    waits = [started - created for created, started, _, _ in runs]
    spans = [ended - started for _, started, ended, _ in runs]
    tables = [float(count) for *_, count in runs]
    ticks = {name: sensor_tick_seconds(result.log, name, *result.window) for name in SENSORS}
    distribution(report, "dagster", "merge runs: created -> started (s)", waits)
    distribution(report, "dagster", "merge runs: started -> ended (s)", spans)
    distribution(report, "dagster", "merge runs: tables merged by one run", tables)
    for name, seconds in ticks.items():
        distribution(report, "dagster", f"{name} sensor ticks (s)", seconds)
    if p99 <= TARGETS["dagster"] or not runs:
        return []
    return [
        f"dagster: {len(runs)} merge runs from the window on, each merging {percentile(tables, 0.5):.0f} table(s) "
        f"at the median in a new process: queued {percentile(waits, 0.5):.1f} s and ran "
        f"{percentile(spans, 0.5):.1f} s at the median; a row waits for its flush tick, the merge sensor, a "
        f"run's start and its table's turn (staged -> seen p99 {percentile(result.staged_to_seen, 0.99):.1f} s); "
        "the sensors' ticks in the window, median / max: "
        + ", ".join(f"{name} {percentile(took, 0.5):.0f} / {max(took):.0f} s" for name, took in ticks.items() if took)
    ]


# The mirror's sensors whose ticks bench.tables times from the daemon's log (the quickstart's mirror name).
SENSORS = ("snapshot_planner", "merge", "flusher")
TICK_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \+0000 - dagster\.daemon\.SensorDaemon - \w+ - (.*)")


def sensor_tick_seconds(log: Path, sensor: str, start: float, stop: float) -> list[float]:
    """How long each tick of the sensor ``pg2iceberg_<sensor>`` that began between ``start`` and
    ``stop`` (epoch s) took, from ``dagster dev``'s log (one-second resolution): from the daemon's
    "Checking for new runs" to the last line it logged for the sensor before its next tick."""
    name = f"pg2iceberg_{sensor}"
    seconds: list[float] = []
    began = last = None
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace")).splitlines():
        if not (match := TICK_LINE.search(line)) or not re.search(rf"\b{name}\b", match.group(2)):
            continue
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
        if match.group(2).startswith("Checking for new runs"):
            if began is not None and last is not None and start <= began <= stop:
                seconds.append(last - began)
            began = at
        last = at
    return seconds


def merge_loop_rows(report: Report, result: RunMeasurement, tables: int, parallelism: int, p99: float) -> list[str]:
    """``run``'s merges and passes over the tables, from its log; the ``why:`` line of a missed p99."""
    start = result.window[0]
    # Merges go on after the window, draining it: count them up to the stop.
    merges = logged_merges(result.log, start, result.stopped)
    merge_seconds = [m.seconds for m in merges]
    rounds = passes(merges)
    # Seconds between the ends of consecutive passes: how long a lagging table waits for its next merge.
    periods = [b[0] - a[0] for a, b in itertools.pairwise(rounds)]
    busy = result.stopped - start
    total = round(sum(merge_seconds), 1)
    distribution(report, "run", "merges (seconds each)", merge_seconds, total, len(merges) / busy)
    distribution(report, "run", "passes of the merge loop (seconds apart)", periods)
    phases: dict[str, float] = defaultdict(float)
    for merge in merges:
        for phase, value in merge.phases.items():
            phases[phase] += value / len(merges)
    # The run process's CPU (its JVM's too, and the flusher's: an upper bound) over the window's merges.
    end = result.window[1]
    samples = [s for s in result.samples if start <= s[0] <= end]
    merged_in_window = sum(1 for merge in merges if merge.logged <= end)
    cores = os.cpu_count() or 1
    why = []
    if merged_in_window and len(samples) > 1:
        cpu, python = samples[-1][4] - samples[0][4], samples[-1][3] - samples[0][3]
        per_merge = cpu / merged_in_window
        report.ratio("run_core_seconds_per_merge", per_merge, MERGE_CORE_SECONDS, at_most=True)
        if per_merge > MERGE_CORE_SECONDS:
            busy = cpu / (end - start)
            why.append(
                f"run: {per_merge:.3f} CPU-s per merge, {python / cpu:.0%} of it in Python (the flusher's too), the "
                f"process at {busy:.2f} cores: Python threads share one interpreter lock, so past one core the "
                "merge lanes and the flusher wait on each other"
            )
    report.parameters["run"] |= {
        "cores": cores,
        "pass_core_seconds_median": round(percentile(periods, 0.5) * cores, 1) if periods else None,
        "changes_per_merge": round(sum(m.changes for m in merges) / len(merges), 1) if merges else None,
        "merges_per_pass_median": percentile([float(count) for _, count in rounds], 0.5),
        "merge_phase_seconds_mean": {k: round(v, 3) for k, v in phases.items()},
    }
    if not p99 <= TARGETS["run"] and merges:
        per_table = percentile(periods, 0.5) / report.parameters["run"]["merges_per_pass_median"] if periods else None
        why.append(
            f"run: each pass merges every lagging table, {parallelism} at a time, each a pyiceberg write or a "
            f"Spark MERGE, and an Iceberg commit of its own: {percentile(merge_seconds, 0.5):.2f} s a merge at the "
            f"median whatever the batch ({report.parameters['run']['changes_per_merge']} changes on average; per "
            "merge "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
            + f" s), {per_table or 0:.2f} s of a pass per table. With the writes spread over {tables} tables nearly "
            f"every table lags at every pass, so a pass took {percentile(periods, 0.5):.0f} s at the median and a "
            f"row waits for its flush and up to a whole pass (staged -> seen p99 "
            f"{percentile(result.staged_to_seen, 0.99):.1f} s)"
        )
    return why


def memory_rows(report: Report, mode: str, result: RunMeasurement) -> list[str]:
    """RSS (peak, last, first against last minute of the window) and CPU seconds of the child: under
    ``run`` the Python process (the bounded one) and with its JVM; under Dagster, everything it started."""
    start, end = result.window
    span = min(60.0, (end - start) / 2)  # the window's halves when it is shorter than two minutes
    samples = [s for s in result.samples if start <= s[0] <= end]
    why = []
    measured = (
        ((1, "run process RSS (Python: flusher, merge loop)"), (2, "run process + Spark JVM RSS"))
        if mode == "run"
        else ((2, "dagster dev and all it started: RSS"),)
    )
    for column, what in measured:
        first = max(s[column] for s in samples if s[0] <= start + span)
        last = max(s[column] for s in samples if s[0] >= end - span)
        peak = max(s[column] for s in result.samples)
        report.add(mode, what, len(samples), "", "", "", "", "", round(peak), round(samples[-1][column]))
        report.parameters.setdefault("rss_first_last_minute_mib", {})[what] = [round(first), round(last)]
        if mode == "run" and column == 1:
            report.ratio("run_rss_last_vs_first_minute", last / first, BOUNDED, at_most=True)
            if last > BOUNDED * first:
                why.append(f"run: the Python process's RSS peaked at {first:.0f} MiB at first, {last:.0f} at last")
    elapsed = samples[-1][0] - samples[0][0]
    # Under Dagster the runs come and go between samples: their CPU would be missed, so none is shown.
    cpu_rows = ((3, "CPU s in the window (Python)"), (4, "CPU s in the window (+ JVM)"))
    for column, what in cpu_rows if mode == "run" else ():
        cpu = samples[-1][column] - samples[0][column]
        report.add(mode, what, "", round(cpu, 1), cpu / elapsed, "", "", "", "", "")
    return why


def main() -> None:
    parser = argument_parser(__doc__ or "")
    parser.add_argument("--tables", type=int, default=200, help="tables in the publication")
    parser.add_argument("--rate", type=float, default=200.0, help="single-row transactions per second, all tables")
    parser.add_argument("--seconds", type=float, default=120.0, help="measurement window")
    parser.add_argument("--drain", type=float, default=900.0, help="how long to wait for the window's last rows")
    parser.add_argument("--modes", default="run", help="run, dagster or both (run,dagster)")
    parser.add_argument("--snapshot-only", action="store_true", help="measure the snapshot step alone")
    parser.add_argument("--profile", type=Path, help="run the snapshot child under cProfile, its stats to this file")
    parser.add_argument(
        "--check-interval",
        type=float,
        default=0.0,
        help="checks.min_interval_seconds (Dagster: a lagging table's checks join its merge runs this often; "
        "default 0, the pipeline's default: every run)",
    )
    parser.add_argument(
        "--file-latency-ms",
        type=float,
        default=0.0,
        help="each Iceberg file the children create waits this long first, as an object store's PUT would "
        "(bench/file_latency); default 0: local files",
    )
    args = parser.parse_args()
    if args.file_latency_ms:
        emulate_file_latency(args.file_latency_ms)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.snapshot_only:
        modes = modes[:1]
    parameters = {
        "tables": args.tables,
        "rate": args.rate,
        "seconds": args.seconds,
        "poll_seconds": POLL_SECONDS,
        "check_interval_seconds": args.check_interval,
        "file_latency_ms": args.file_latency_ms,
    }
    columns = ["mode", "what", "count", "seconds", "per_s", "p50_s", "p99_s", "max_s", "peak_rss_mib", "last_rss_mib"]
    report = Report("tables", parameters | {"modes": modes}, columns)
    why: list[str] = []
    differ: list[str] = []
    with work_dir(args.dir) as root, bench_cluster(root) as pg:
        tables = plan_tables(args.tables)
        pages = fill_tables(pg, tables)
        log = root / "children.log"
        for index, mode in enumerate(modes):
            if index:
                restore_tables(pg, tables)
            sections = {"checks": {"min_interval_seconds": args.check_interval}} if args.check_interval else {}
            config, path = mode_config(pg, root, [t.key for t in tables], "tables", mode, **sections)
            if index == 0:
                why += snapshot_rows(report, pg, path, config, log, tables, pages, args.profile)
                if args.snapshot_only:  # no writes since: the tables as snapshotted equal the source's
                    verify = run_child([*CLI, "-c", str(path), "verify"], log)
                    if verify.returncode != 0:
                        differ.append(f"snapshot: verify exited with {verify.returncode} (see {log})")
                    break
            else:
                checked(run_child([*CLI, "-c", str(path), "snapshot"], log), "snapshot", log)
            measured = measure(mode, pg, path, config, root, tables, args)
            why += mode_rows(report, mode, measured, config, tables)
            verify = run_child([*CLI, "-c", str(path), "verify", "--catch-up"], log)
            if verify.returncode != 0:
                differ.append(f"{mode}: verify --catch-up exited with {verify.returncode} (see {log})")
    for line in why:
        print(f"why: {line}")
    report.emit(args.json)
    if differ:
        raise SystemExit("Iceberg differs from PostgreSQL: " + "; ".join(differ))


def emulate_file_latency(milliseconds: float) -> None:
    """Every child started from now on loads ``bench/file_latency`` (see its module)."""
    os.environ["PG2ICEBERG_BENCH_FILE_LATENCY_MS"] = str(milliseconds)
    hook = str(Path(__file__).resolve().parent / "file_latency")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH")) if p)


def restore_tables(pg: EmbeddedPostgres, tables: list[SourceTable]) -> None:
    """Each mode starts from the tables as filled: drop the rows the previous mode's writer inserted
    (its updates stay: they change no count)."""
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        for table in tables:
            conn.execute(f"DELETE FROM {table.name} WHERE {KEY} > %s", (table.rows,))


if __name__ == "__main__":
    main()
