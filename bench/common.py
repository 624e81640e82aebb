"""What every benchmark shares: a throwaway PostgreSQL, pipeline configs, data sets, and the report.

Each benchmark measures a physical limit (raw ``COPY``, ``pg_recvlogical``...) and our pipeline in
the same run on the same cluster, and prints both and their ratio: a short table for people and one
JSON document (also written to ``--json PATH``) for scripts. Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import yaml

from pg2iceberg_dagster.config import PipelineConfig, load_config, parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, find_pg_bin, free_port
from pg2iceberg_dagster.materializer.warm_spark import stop_server
from pg2iceberg_dagster.quickstart import DAGSTER_INSTANCE_YAML, dagster_dev_command

CATALOG_DB = "iceberg_catalog"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SOURCE_DB = "bench"

# pgbench_accounts' shape: narrow rows of ~100 bytes.
NARROW_DDL = "CREATE TABLE {name} (aid bigint PRIMARY KEY, bid int NOT NULL, abalance int NOT NULL, filler char(84))"
NARROW_FILL = "INSERT INTO {name} SELECT g, 1 + g / 100000, 0, '' FROM generate_series({start}, {stop}) g"

# A wide typed table: text of varying length, exact numerics, timestamps, uuid, jsonb, NULLs.
WIDE_DDL = (
    "CREATE TABLE {name} (id bigint PRIMARY KEY, customer_id int, sku text, title text, note text, "
    "qty smallint, price numeric(12,2), tax numeric(9,4), total numeric(14,2), weight double precision, "
    "discount real, active boolean, created timestamptz, updated timestamp, ship_date date, "
    "ref uuid, tags text[], attrs jsonb, status varchar(16), comment text)"
)
WIDE_FILL = (
    "INSERT INTO {name} SELECT g, g % 50000, 'SKU-' || lpad((g % 100000)::text, 6, '0'), "
    "'product title number ' || g, CASE WHEN g % 3 = 0 THEN NULL ELSE repeat('note ', 1 + g % 20) END, "
    "(g % 100)::smallint, (g % 100000) / 100.0, (g % 10000) / 10000.0, (g % 1000000) / 10.0, g * 0.001, "
    "(g % 50) / 100.0, g % 2 = 0, timestamptz '2026-01-01 00:00:00+00' + g * interval '1 second', "
    "timestamp '2026-01-01' + g * interval '1 minute', date '2020-01-01' + (g % 3000), "
    "md5(g::text)::uuid, ARRAY['a' || (g % 7), 'b' || (g % 11)], "
    "jsonb_build_object('k', g % 13, 'v', 'x' || g), "
    "(ARRAY['new','paid','shipped','done'])[1 + g % 4], CASE WHEN g % 5 = 0 THEN 'c' || g END "
    "FROM generate_series({start}, {stop}) g"
)

# The public NYC yellow-taxi trip records' 19 columns with their published types (int32 -> integer,
# int64 -> bigint, double, timestamp, string -> text); generated values in their ranges, NULLs where
# the real data has them (about 3% of trips carry no passenger count, rate code, flag, surcharges).
# The data has no key: a vendor's pickup time (unique here) is declared as one.
TAXI_DDL = (
    'CREATE TABLE {name} ("VendorID" integer NOT NULL, tpep_pickup_datetime timestamp NOT NULL, '
    "tpep_dropoff_datetime timestamp, passenger_count bigint, trip_distance double precision, "
    '"RatecodeID" bigint, store_and_fwd_flag text, "PULocationID" integer, "DOLocationID" integer, '
    "payment_type bigint, fare_amount double precision, extra double precision, mta_tax double precision, "
    "tip_amount double precision, tolls_amount double precision, improvement_surcharge double precision, "
    "total_amount double precision, congestion_surcharge double precision, airport_fee double precision, "
    'PRIMARY KEY ("VendorID", tpep_pickup_datetime))'
)
TAXI_FILL = (
    "INSERT INTO {name} SELECT 1 + g % 2, t.pickup, t.pickup + (240 + g % 1800) * interval '1 second', "
    "CASE WHEN t.missing THEN NULL ELSE 1 + g % 4 END, ((g % 2500) / 100.0)::float8, "
    "CASE WHEN t.missing THEN NULL WHEN g % 50 = 0 THEN 2 ELSE 1 END, "
    "CASE WHEN t.missing THEN NULL WHEN g % 200 = 0 THEN 'Y' ELSE 'N' END, 1 + g % 265, 1 + (g * 7) % 265, "
    "CASE WHEN t.missing THEN 0 ELSE 1 + g % 4 END, t.fare, (g % 4) * 0.5, 0.5, t.tip, "
    "CASE WHEN g % 10 = 0 THEN 6.94 ELSE 0 END, 1.0, "
    "t.fare + (g % 4) * 0.5 + 0.5 + t.tip + CASE WHEN g % 10 = 0 THEN 6.94 ELSE 0 END + 1.0 "
    "+ CASE WHEN t.missing THEN 0 ELSE 2.5 END, "
    "CASE WHEN t.missing THEN NULL ELSE 2.5 END, CASE WHEN t.missing THEN NULL WHEN g % 12 = 0 THEN 1.75 ELSE 0 END "
    "FROM generate_series({start}, {stop}) g, LATERAL (SELECT "
    "timestamp '2024-01-01' + g * interval '1 second' + (g % 997) * interval '1 microsecond' AS pickup, "
    "g % 33 = 0 AS missing, (3 + (g % 7000) / 100.0)::float8 AS fare, ((g % 1500) / 100.0)::float8 AS tip) t"
)

DATASETS = {"narrow": (NARROW_DDL, NARROW_FILL), "wide": (WIDE_DDL, WIDE_FILL), "taxi": (TAXI_DDL, TAXI_FILL)}


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the options every benchmark takes (``--json``, ``--keep``)."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0], epilog=doc)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--json", type=Path, help="also write the JSON report to this file")
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed at the end)")
    return parser


@contextlib.contextmanager
def work_dir(path: Path | None) -> Iterator[Path]:
    """``path`` if given (kept afterwards), else a temporary directory removed at the end."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="pg2iceberg-bench-") as directory:
        yield Path(directory)


@contextlib.contextmanager
def bench_cluster(root: Path, settings: dict[str, str] | None = None) -> Iterator[EmbeddedPostgres]:
    """A throwaway cluster with the source and catalog databases, stopped by its pid at the end."""
    cluster = EmbeddedPostgres(root / "pg", free_port())
    cluster.init()
    if settings:
        with open(cluster.data_dir / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
    cluster.start()
    try:
        cluster.create_database(SOURCE_DB)
        cluster.create_database(CATALOG_DB)
        yield cluster
    finally:
        cluster.stop()


def bench_config(pg: EmbeddedPostgres, root: Path, tables: list[str], **sections: Any) -> PipelineConfig:
    """The embedded-default pipeline config on ``pg`` (file:// staging and warehouse under ``root``).

    A section given as a mapping is merged into the default one (``iceberg={"table_properties": ...}``
    keeps the catalog); any other value replaces it.
    """
    data: dict[str, Any] = {
        "source": {"host": "127.0.0.1", "port": pg.port, "dbname": SOURCE_DB, "user": "postgres"},
        "tables": [{"name": name} for name in tables],
        "staging": {"url": f"file://{root}/staging"},
        "iceberg": {
            "catalog": {"postgres": {"host": "127.0.0.1", "port": pg.port, "dbname": CATALOG_DB}},
            "warehouse": f"file://{root}/warehouse",
        },
    }
    for name, value in sections.items():
        default = data.get(name)
        data[name] = {**default, **value} if isinstance(default, dict) and isinstance(value, dict) else value
    return parse_config(data)


def fill_table(pg: EmbeddedPostgres, dataset: str, name: str, rows: int, batch: int = 500_000) -> int:
    """Create ``name`` with the ``dataset`` shape and ``rows`` rows; returns its heap size in bytes."""
    ddl, fill = DATASETS[dataset]
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        conn.execute(ddl.format(name=name))
        for start in range(1, rows + 1, batch):
            conn.execute(fill.format(name=name, start=start, stop=min(start + batch - 1, rows)))
        conn.execute(f"VACUUM (FREEZE, ANALYZE) {name}")
        size = conn.execute("SELECT pg_relation_size(%s)", (name,)).fetchone()
    return int(size[0]) if size else 0


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``action`` took, and what it returned."""
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile (nearest rank) of ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def paced(rate: float, stop: threading.Event) -> Iterator[None]:
    """Yield ``rate`` times a second until ``stop`` is set (a writer's loop: one transaction a turn)."""
    interval = 1.0 / rate
    next_at = time.monotonic()
    while not stop.is_set():
        yield
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -1.0:
            next_at = time.monotonic()  # fell behind: keep the rate, do not burst


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of every core since boot, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / _CLOCK_TICKS, sum(values) / _CLOCK_TICKS


def peak_rss_of_children_mb() -> float:
    """Largest resident set of any waited-for child process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (a ``run``'s JVM is a child of its Python process)."""
    found, index = [pid], 0
    while index < len(found):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{found[index]}/task"):
                with open(f"/proc/{found[index]}/task/{task}/children", encoding="ascii") as children:
                    found += [int(child) for child in children.read().split()]
        index += 1
    return found


def process_rss_mib(pid: int) -> float:
    """Resident set of a live process now, in MiB (0 once it is gone)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a live process has used so far (0 once it is gone)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        # The command name (field 2) may hold spaces: count the fields after its closing parenthesis.
        fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return 0.0


def server_cpu_seconds(pg: EmbeddedPostgres) -> float:
    """User plus system CPU seconds the cluster has used so far: its postmaster, every live backend
    and every backend that has exited (the postmaster waits for them, so their time is in its own
    children's fields)."""
    pid = pg.pid()
    if pid is None:
        return 0.0
    seconds = 0.0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
        seconds = (int(fields[13]) + int(fields[14])) / _CLOCK_TICKS  # cutime, cstime: exited children
    return seconds + sum(process_cpu_seconds(process) for process in process_tree(pid))


def pg_tool(name: str) -> str:
    """Path of a PostgreSQL client program (``pgbench``, ``pg_recvlogical``) shipped with the server."""
    return str(find_pg_bin() / name)


def pgbench(pg: EmbeddedPostgres, *args: str) -> str:
    """Run ``pgbench ARGS`` against the source database of ``pg``; returns its output (it fails loudly)."""
    command = [pg_tool("pgbench"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", pg.superuser, *args, SOURCE_DB]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pgbench {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout + result.stderr


def page_ranges(table: str, pages: int, parts: int) -> list[tuple[str, int, int | None]]:
    """``table``'s ``pages`` heap pages in ``parts`` CTID ranges of equal size, the last one open-ended
    (as the snapshot's last chunk is: rows may land past the size read)."""
    bounds: list[int | None] = [pages * index // parts for index in range(parts)]
    return [(table, int(start or 0), stop) for start, stop in itertools.pairwise([*bounds, None])]


def psql_copy(table: str, start: int, stop: int | None) -> str:
    """``COPY`` of the CTID pages ``[start, stop)`` of ``table`` (to its end when ``stop`` is None) to STDOUT."""
    where = f"ctid >= '({start},0)'::tid" + (f" AND ctid < '({stop},0)'::tid" if stop is not None else "")
    return f"COPY (SELECT * FROM {table} WHERE {where}) TO STDOUT"


def raw_copy(pg: EmbeddedPostgres, ranges: list[tuple[str, int, int | None]], workers: int) -> int:
    """The snapshot's physical limit: ``workers`` psql processes at once, COPYing the CTID ``ranges``
    (table, first page, end page or None) into /dev/null. Each process takes a share of the ranges,
    dealt in turn, and runs them one after another on one connection; returns the number of ranges."""
    commands = [[pg_tool("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", pg.conninfo(SOURCE_DB)] for _ in range(workers)]
    for index, (table, start, stop) in enumerate(ranges):
        commands[index % workers] += ["-c", psql_copy(table, start, stop)]
    processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL) for command in commands if len(command) > 6]
    codes = [process.wait() for process in processes]
    if any(codes):
        raise RuntimeError(f"psql COPY failed with exit codes {codes}")
    return len(ranges)


def write_config(config: PipelineConfig, path: Path) -> Path:
    """Write ``config`` as the YAML file the CLI loads (for benchmarks that run the pipeline as a child)."""
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True), sort_keys=False))
    return path


def mode_config(
    pg: EmbeddedPostgres, root: Path, tables: list[str], prefix: str, mode: str, **sections: Any
) -> tuple[PipelineConfig, Path]:
    """The pipeline of one mode of a benchmark, apart from the other modes on the same cluster: its
    own state database, slot, publication, staging and Iceberg namespace (``prefix_mode``), written as
    ``root/mode.yaml``. ``sections`` as :func:`bench_config` (``iceberg`` is laid over the namespace)."""
    pg.create_database(f"state_{mode}")
    name = f"{prefix}_{mode}"
    config = bench_config(
        pg,
        root,
        tables,
        replication={"slot": name, "publication": name},
        state={"host": "127.0.0.1", "port": pg.port, "dbname": f"state_{mode}", "user": "postgres"},
        staging={"url": f"file://{root}/staging_{mode}"},
        iceberg={"namespace": name, **sections.pop("iceberg", {})},
        **sections,
    )
    return config, write_config(config, root / f"{mode}.yaml")


@dataclass(frozen=True)
class ChildRun:
    """A child process run to completion: exit code, wall seconds, its own peak resident set, and its
    CPU seconds (user plus system, with those of the children it waited for)."""

    returncode: int
    seconds: float
    peak_rss_mib: float
    cpu_seconds: float


def run_child(argv: list[str], log: Path | None = None) -> ChildRun:
    """Run ``argv`` to completion and measure it alone.

    The peak RSS comes from ``wait4`` on this child (Linux reports KiB), not from ``RUSAGE_CHILDREN``,
    whose maximum runs over every child waited for so far and so could not compare two runs.
    """
    output = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    try:
        started = time.perf_counter()
        child = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)  # already reaped: keep Popen from waiting again
    finally:
        if log:
            output.close()  # type: ignore[union-attr]
    return ChildRun(child.returncode, seconds, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime)


@contextlib.contextmanager
def child_process(command: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run ``command`` in its own process group; stop it with SIGINT (then SIGKILL to its group) by pid."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, cwd=BENCH_DIR.parent, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)  # its own session: only what it started
                    process.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # anything of its group still running (a run's JVM)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, process: subprocess.Popen, log: Path) -> None:
    """Poll ``predicate`` until true; fail if ``timeout`` passes or the child exits."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            raise RuntimeError(f"the child exited ({process.returncode}) while waiting for {what}; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}; see {log}")
        time.sleep(0.5)


def checked(run: ChildRun, what: str, log: Path) -> ChildRun:
    """``run``, or an error pointing at the child's output when it failed."""
    if run.returncode != 0:
        raise RuntimeError(f"{what} exited with {run.returncode}; its output is in {log}")
    return run


@contextlib.contextmanager
def dagster_dev(root: Path, config_path: Path) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """``dagster dev`` on the pipeline at ``config_path`` as a child process, with the quickstart's
    instance settings in its own ``DAGSTER_HOME`` (``root/dagster_home``); yields the process, its log
    and the home (to read the instance's runs afterwards)."""
    home = root / "dagster_home"
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").write_text(DAGSTER_INSTANCE_YAML)
    env = {**os.environ, "DAGSTER_HOME": str(home), "PG2ICEBERG_CONFIG": str(config_path)}
    log = root / "dagster_dev.log"
    try:
        with child_process(dagster_dev_command(free_port()), log, env) as process:
            yield process, log, home
    finally:
        stop_server(load_config(config_path))  # the merge runs' warm Spark driver, a process of its own


@contextlib.contextmanager
def dagster_runs_since(home: Path, since: float) -> Iterator[tuple[Any, list[Any]]]:
    """The Dagster instance in ``home`` and the records of its runs created after ``since`` (epoch s)."""
    from dagster import DagsterInstance, RunsFilter
    from dagster._core.instance.ref import InstanceRef

    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        yield instance, instance.get_run_records(RunsFilter(created_after=datetime.fromtimestamp(since, UTC)))


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    version = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False).stderr
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "java": version.splitlines()[0] if version else None,
        "platform": platform.platform(),
    }


@dataclass
class Report:
    """A benchmark's results: rows of a table for people, and the same figures as JSON."""

    benchmark: str
    parameters: dict[str, Any]
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, *values: Any) -> None:
        self.rows.append(list(values))

    def ratio(self, name: str, value: float, target: float | None = None, at_most: bool = False) -> None:
        """Record ``name`` = ``value`` and, when given, the target it should reach (or stay under)."""
        self.ratios[name] = round(value, 3)
        if target is not None:
            met = value <= target if at_most else value >= target
            self.targets[name] = {"target": target, "at_most": at_most, "met": met}

    def emit(self, json_path: Path | None = None) -> dict[str, Any]:
        """Print the table, the ratios against their targets, and the JSON document."""
        document = {
            "benchmark": self.benchmark,
            "machine": machine(),
            "parameters": self.parameters,
            "results": [dict(zip(self.columns, row, strict=True)) for row in self.rows],
            "ratios": self.ratios,
            "targets": self.targets,
        }
        widths = [max(len(str(c)), *(len(_cell(row[i])) for row in self.rows)) for i, c in enumerate(self.columns)]
        print()
        print("  ".join(str(c).ljust(w) for c, w in zip(self.columns, widths, strict=True)))
        for row in self.rows:
            print("  ".join(_cell(v).ljust(w) for v, w in zip(row, widths, strict=True)))
        print()
        for name, value in self.ratios.items():
            target = self.targets.get(name)
            verdict = ""
            if target is not None:
                bound = "<=" if target["at_most"] else ">="
                verdict = f"  (target {bound} {target['target']}: {'met' if target['met'] else 'NOT met'})"
            print(f"{name}: {value}{verdict}")
        print(json.dumps(document))
        if json_path:
            json_path.write_text(json.dumps(document, indent=1) + "\n")
        return document


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


BENCH_DIR = Path(__file__).resolve().parent
PEER_PYTHON = BENCH_DIR.parent / ".venv-peer" / "bin" / "python"


def run_dlt_peer(pg: EmbeddedPostgres, table: str, backend: str, dest: Path) -> dict[str, Any]:
    """Load ``table`` of ``pg``'s source database into a local Iceberg table with dlt, in the peer venv.

    Makes ``.venv-peer`` first if needed (``bench/peer_venv.sh``: dlt, connectorx, pyiceberg pinned apart
    from the project's venv), then runs ``bench/peer_dlt.py`` there with ``backend`` (``pyarrow`` or
    ``connectorx``) and ``dest`` (missing or empty: dlt's pipelines dir, catalog and bucket go under
    it). Returns its JSON report: ``backend``, ``rows`` (read back from Iceberg and checked against the
    source count), ``seconds`` (the whole dlt run), ``rows_per_second`` and dlt's per-step seconds.
    """
    setup = subprocess.run(["bash", str(BENCH_DIR / "peer_venv.sh")], capture_output=True, text=True, check=False)
    if setup.returncode != 0:
        raise RuntimeError(f"bench/peer_venv.sh failed (exit {setup.returncode}):\n{_tail(setup.stderr)}")
    dsn = f"postgresql://{pg.superuser}@127.0.0.1:{pg.port}/{SOURCE_DB}"
    argv = [str(PEER_PYTHON), str(BENCH_DIR / "peer_dlt.py"), "--dsn", dsn, "--table", table]
    argv += ["--backend", backend, "--dest", str(dest)]
    # The peer interpreter must see only its own venv, whatever the caller's environment points at.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    result = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise RuntimeError(
            f"dlt peer ({backend}, {table}) failed (exit {result.returncode}):\n{_tail(result.stderr or result.stdout)}"
        )
    try:
        return dict(json.loads(lines[-1]))
    except ValueError as error:
        raise RuntimeError(f"dlt peer ({backend}, {table}) printed no JSON report: {lines[-1]!r}") from error


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
