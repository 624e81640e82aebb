"""Spark's memory over many MERGEs into an Iceberg v3 table (deletion vectors) against v2 (position deletes).

    .venv/bin/python -m bench.v3_merge_memory [--rows 500000] [--changes 20000] [--batches 40] [--formats ...]

A v3 MERGE's memory growth was reported upstream; the project cannot write v3 tables yet (pyiceberg
0.12: see pg2iceberg_dagster/iceberg/delete_formats.py), so this measures the Spark runtime it ships
on its own. Per format, in a fresh process (its own JVM, ``local[2]``, the project's Spark settings
otherwise), a table of ``--rows`` rows partitioned by ``bucket(8, id)`` takes ``--batches`` MERGEs
back to back, each of ``--changes`` keys (80 % updates, 10 % deletes, 10 % inserts, seeded), with
no compaction in between: steady writes, delete debt growing. After each merge it samples the
driver's JVM heap in use after a full GC (live objects), the heap committed, and the JVM's resident
set (RSS; in ``local`` mode the driver is the executor). Bounded memory: the live heap and the RSS of
the last fifth of the batches stay within about 1.2x of the second fifth (the first holds JIT and
cache warm-up).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pg2iceberg_dagster.iceberg.delete_formats import format_properties

from .common import argument_parser, process_rss_mib, work_dir

FORMATS = ("merge-on-read", "deletion-vectors")
MIB = 1024 * 1024


def _session(warehouse: Path) -> Any:
    """A local Spark session with the Iceberg runtime the project ships and a Hadoop catalog."""
    from pyspark.sql import SparkSession

    from pg2iceberg_dagster.materializer.spark import default_jars

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return (
        SparkSession.builder.master("local[2]")
        .config("spark.jars", ",".join(default_jars()))
        .config("spark.sql.extensions", "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.catalog.bench", "org.apache.iceberg.spark.SparkCatalog")
        .config("spark.sql.catalog.bench.type", "hadoop")
        .config("spark.sql.catalog.bench.warehouse", f"file://{warehouse}")
        .getOrCreate()
    )


def _sample(spark: Any, pid: int) -> dict[str, float]:
    """Live heap after a full GC, heap committed and the JVM's RSS, in MiB."""
    runtime = spark._jvm.java.lang.Runtime.getRuntime()
    spark._jvm.java.lang.System.gc()
    live = (runtime.totalMemory() - runtime.freeMemory()) / MIB
    return {"live_heap": live, "heap_committed": runtime.totalMemory() / MIB, "rss": process_rss_mib(pid)}


def _changes(spark: Any, rows: int, changes: int, batch: int) -> None:
    """Register this batch's source view ``changes_batch``: keys with an op (u/d/i), seeded by batch."""
    pick = random.Random(batch)
    updates = pick.sample(range(1, rows + 1), changes * 9 // 10)
    deletes, updated = updates[: changes // 10], updates[changes // 10 :]
    inserts = range(rows + 1 + batch * changes, rows + 1 + batch * changes + changes // 10)
    data = [(k, "u", batch) for k in updated] + [(k, "d", batch) for k in deletes] + [(k, "i", batch) for k in inserts]
    spark.createDataFrame(data, "id long, op string, batch int").createOrReplaceTempView("changes_batch")


def run_format(delete_format: str, root: str, rows: int, changes: int, batches: int) -> list[dict[str, float]]:
    """One format in this (child) process: the table, then ``batches`` MERGEs, a sample after each."""
    spark = _session(Path(root) / delete_format)
    pid = int(spark._jvm.java.lang.ProcessHandle.current().pid())
    properties = ", ".join(f"'{key}' = '{value}'" for key, value in format_properties(delete_format).items())
    spark.sql(
        "CREATE TABLE bench.ns.t (id bigint, qty bigint, note string, batch int) USING iceberg "
        f"PARTITIONED BY (bucket(8, id)) TBLPROPERTIES ({properties})"
    )
    spark.sql(f"INSERT INTO bench.ns.t SELECT id, id * 10, concat('note ', id), -1 FROM range(1, {rows + 1})")
    samples = []
    for batch in range(batches):
        _changes(spark, rows, changes, batch)
        started = time.monotonic()
        spark.sql(
            "MERGE INTO bench.ns.t t USING changes_batch s ON t.id = s.id "
            "WHEN MATCHED AND s.op = 'd' THEN DELETE "
            "WHEN MATCHED THEN UPDATE SET qty = t.qty + 1, batch = s.batch "
            "WHEN NOT MATCHED AND s.op = 'i' THEN INSERT (id, qty, note, batch) VALUES (s.id, 0, 'new', s.batch)"
        )
        seconds = time.monotonic() - started
        deletes = spark.sql("SELECT count(*) FROM bench.ns.t.delete_files").collect()[0][0]
        samples.append({"batch": batch, "merge_s": seconds, "delete_files": deletes, **_sample(spark, pid)})
    spark.stop()
    return samples


def _window_mean(samples: list[dict[str, float]], key: str, part: int) -> float:
    """Mean of ``key`` over the ``part``-th fifth (0-based) of the samples."""
    size = max(1, len(samples) // 5)
    window = samples[part * size : (part + 1) * size] or samples[-size:]
    return sum(s[key] for s in window) / len(window)


def _report(delete_format: str, samples: list[dict[str, float]]) -> None:
    print(f"\n{delete_format}: batch, merge s, delete files, live heap MiB, heap committed MiB, RSS MiB")
    for s in samples:
        print(
            f"  {s['batch']:>3} {s['merge_s']:>6.2f} {s['delete_files']:>5} "
            f"{s['live_heap']:>7.0f} {s['heap_committed']:>7.0f} {s['rss']:>7.0f}"
        )
    for key in ("live_heap", "rss", "merge_s"):
        second, last = _window_mean(samples, key, 1), _window_mean(samples, key, 4)
        print(f"  {key}: second fifth {second:.1f}, last fifth {last:.1f}, last/second {last / second:.2f}")


def main() -> None:
    parser = argument_parser(__doc__ or "")
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--changes", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of: " + ", ".join(FORMATS))
    args = parser.parse_args()
    report: dict[str, list[dict[str, float]]] = {}
    with work_dir(args.dir) as root:
        for delete_format in args.formats.split(","):
            # A fresh JVM per format: one format's heap, caches and JIT do not count against the other.
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                samples = pool.submit(
                    run_format, delete_format, str(root), args.rows, args.changes, args.batches
                ).result()
            _report(delete_format, samples)
            report[delete_format] = samples
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
