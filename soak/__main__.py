"""The on-demand soak: ``python -m soak --seeds 200 [--first 1] [--report soak-report.json]``.

Starts its own PostgreSQL (temporary directory, free port) and one Spark session, runs each seed's
scenario (see ``soak.runner``), prints one line per seed and writes the JSON report. Exit code 1 when
any seed diverged or failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from pg2iceberg_dagster.config import parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.materializer.spark import build_spark_session

from .runner import Cluster, Profile, ScenarioResult, run_scenario, summarize

CATALOG_DB = "iceberg_catalog"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m soak", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="how many seeds to run")
    parser.add_argument("--first", type=int, default=1, help="the first seed")
    parser.add_argument("--report", default="soak-report.json", help="where the JSON report goes")
    parser.add_argument("--stream-writes", type=int, default=Profile.stream_writes, help="transactions per seed")
    args = parser.parse_args(argv)
    profile = Profile(stream_writes=args.stream_writes)
    results: list[ScenarioResult] = []
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
                    result = run_scenario(cluster, root / "runs", seed, spark, profile)
                    results.append(result)
                    faults = ",".join(f"{k}x{v}" for k, v in sorted(result.faults.items())) or "-"
                    status = "ok" if result.ok else f"FAIL {result.error or result.divergences}"
                    print(
                        f"seed {seed}: {status} | faults {faults} | restarts {result.restarts} | "
                        f"{sum(result.transactions.values())} tx | {result.seconds:.1f}s",
                        flush=True,
                    )
                    Path(args.report).write_text(json.dumps(summarize(results), indent=2) + "\n")
            finally:
                spark.stop()
        finally:
            pg.stop()
    report = summarize(results)
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=2))
    print(f"report: {args.report} ({time.strftime('%Y-%m-%d %H:%M:%S')})")
    return 0 if report["seeds_ok"] == report["seeds"] else 1


if __name__ == "__main__":
    sys.exit(main())
