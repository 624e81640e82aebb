"""The CPU of one small table's merge on a warm session: pyiceberg's writes against Spark's MERGE.

    .venv/bin/python -m bench.small_merge [--tables 40] [--rows 1000] [--changes 70] [--rounds 3]
                                          [--aged-merges 240]

Starts its own PostgreSQL with ``--tables`` copy-on-write tables of ``--rows`` rows (the three column
shapes of bench.tables), snapshots them, then, ``--rounds`` times, commits ``--changes`` single-row
transactions to every table, stages them and merges every table one after the other, measuring the
CPU-seconds of this process (Python) and of its Spark JVM per table merge. Two cases, each on its own
pipeline: *mixed* (3 in 4 insert a new key, 1 in 4 update an older row) and *inserts* (every change an
insert). Each is merged the way the pipeline chooses (``pyiceberg``: a pyiceberg write, see
materializer/append.py) and with ``materialize.pyiceberg_max_rows: 0`` (``spark``: every batch a Spark
MERGE, the limit it is compared with). The first round of each starts Spark or warms up and is left
out. A third case, *aged*, merges one of the tables ``--aged-merges`` times, 4 changes each (an
update and 3 inserts: overwrites), as `run` does to a table written all the time, and compares the
CPU of its last 10 merges with its first 10: a table keeps an hour of snapshots
(``maintenance.snapshot_retention_hours``), about 240 at a merge every 15 s, and a merge must not cost
more for each one before it. Every table is then compared with the source row by row (the bench
fails on any difference). Target: <= 0.1 CPU-seconds per small-table merge (issue 34), the aged
table's last merges included.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from pg2iceberg_dagster.pipeline import Pipeline

from .common import (
    SOURCE_DB,
    Report,
    argument_parser,
    bench_cluster,
    mode_config,
    process_cpu_seconds,
    process_tree,
    work_dir,
)
from .tables import KEY, SHAPES, SourceTable, fill_tables

TARGET = 0.1
AGED_CHANGES = 4  # write() makes every 4th change an update: each merge an overwrite
AGED_WINDOW = 10  # merges averaged at each end of the aged table's
PIPELINES = [(case, way) for case in ("mixed", "inserts") for way in ("pyiceberg", "spark")]
MODES = [*(f"{case}_{way}" for case, way in PIPELINES), "aged"]  # each inserts keys of its own
COPY_ON_WRITE = {f"write.{kind}.mode": "copy-on-write" for kind in ("merge", "update", "delete")}


def jvm_cpu_seconds() -> float:
    """CPU seconds of this process's children (its Spark JVM)."""
    me = os.getpid()
    return sum(process_cpu_seconds(pid) for pid in process_tree(me) if pid != me)


def write(pg: Any, tables: list[SourceTable], changes: int, next_ids: dict[str, int], inserts_only: bool) -> None:
    """Commit ``changes`` single-row transactions to every table."""
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        for table in tables:
            for number in range(changes):
                if not inserts_only and number % 4 == 3:
                    row = random.randint(1, table.rows)
                    conn.execute(f"UPDATE {table.name} SET {table.shape.update} WHERE {KEY} = %s", (row,))
                    continue
                new = next_ids[table.name]
                next_ids[table.name] += 1
                conn.execute(
                    f"INSERT INTO {table.name} SELECT g, {table.shape.values} FROM generate_series(%s::bigint, %s) g",
                    (new, new),
                )


@dataclass
class RoundCost:
    """One round's merges of every table: wall and CPU seconds, merges, of them pyiceberg writes."""

    wall: float
    python: float
    jvm: float
    merges: int
    pyiceberg: int


def merge_rounds(
    pg: Any,
    root: Path,
    tables: list[SourceTable],
    mode: str,
    rounds: int,
    changes: int,
    inserts_only: bool,
    materialize: dict[str, int],
) -> list[RoundCost]:
    """``rounds`` times, ``changes`` single-row transactions to every table, staged, then every table
    merged one after the other, on a pipeline of its own (``mode``): the cost of each round's merges.
    Every table is then compared with the source (the bench fails on any difference)."""
    config, _ = mode_config(
        pg, root, [t.key for t in tables], "small", mode,
        iceberg={"table_properties": COPY_ON_WRITE}, materialize=materialize,
    )  # fmt: skip
    # Each pipeline inserts keys of its own: the source tables are shared.
    offset = 1_000_000 * (1 + MODES.index(mode))
    next_ids = {table.name: offset for table in tables}
    costs: list[RoundCost] = []
    with Pipeline(config) as pipeline:
        pipeline.snapshot()
        materializer = pipeline.materializer()  # one, as `run` keeps: what it learnt of each table stays
        for _ in range(rounds):
            write(pg, tables, changes, next_ids, inserts_only)
            pipeline.stream(until_caught_up=True)
            started, python_before, jvm_before = time.monotonic(), time.process_time(), jvm_cpu_seconds()
            results = [materializer.materialize_table(table.key) for table in tables]
            costs.append(
                RoundCost(
                    wall=time.monotonic() - started,
                    python=time.process_time() - python_before,
                    jvm=jvm_cpu_seconds() - jvm_before,
                    merges=len(results),
                    pyiceberg=sum(result.pyiceberg_writes for result in results),
                )
            )
        differ = [str(diff) for diff in pipeline.verify() if not diff.ok]
    if differ:
        raise SystemExit(f"{mode}: Iceberg differs from PostgreSQL: {differ}")
    return costs


def measure(pg: Any, root: Path, tables: list[SourceTable], case: str, way: str, args: Any) -> dict[str, float]:
    """Merge ``--rounds`` rounds of writes on a pipeline of its own; CPU per merge after the first round."""
    materialize = {"pyiceberg_max_rows": 0} if way == "spark" else {}
    rounds = merge_rounds(pg, root, tables, f"{case}_{way}", args.rounds, args.changes, case == "inserts", materialize)
    measured = rounds[1:]  # the first: Spark's start, the JVM and Python warming up
    merges = sum(cost.merges for cost in measured)
    return {
        "wall": sum(cost.wall for cost in measured) / merges,
        "python": sum(cost.python for cost in measured) / merges,
        "jvm": sum(cost.jvm for cost in measured) / merges,
        "pyiceberg": sum(cost.pyiceberg for cost in measured) / merges,
    }


def measure_aged(pg: Any, root: Path, table: SourceTable, merges: int) -> tuple[float, float]:
    """CPU-seconds (Python and JVM) per merge of ``table``'s first and last ``AGED_WINDOW`` merges of
    ``merges``, each of ``AGED_CHANGES`` changes, on a pipeline of its own (the very first merge,
    warming up, left out)."""
    rounds = merge_rounds(pg, root, [table], "aged", merges + 1, AGED_CHANGES, False, {})[1:]
    cpu = [cost.python + cost.jvm for cost in rounds]
    return sum(cpu[:AGED_WINDOW]) / AGED_WINDOW, sum(cpu[-AGED_WINDOW:]) / AGED_WINDOW


def main() -> None:
    parser = argument_parser(__doc__ or "")
    parser.add_argument("--tables", type=int, default=40, help="tables, merged one after the other")
    parser.add_argument("--rows", type=int, default=1000, help="rows in each table")
    parser.add_argument("--changes", type=int, default=70, help="changes per table and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of writes and merges (the first is left out)")
    parser.add_argument("--aged-merges", type=int, default=240, help="merges of the aged table (0: no aged case)")
    args = parser.parse_args()
    parameters = {"tables": args.tables, "rows": args.rows, "changes": args.changes, "rounds": args.rounds,
                  "aged_merges": args.aged_merges}  # fmt: skip
    columns = ["case", "way", "wall_s", "python_cpu_s", "jvm_cpu_s", "cpu_s", "pyiceberg_share"]
    report = Report("small_merge", parameters, columns)
    with work_dir(args.dir) as root, bench_cluster(root) as pg:
        tables = [SourceTable(f"t{index:03d}", args.rows, SHAPES[index % len(SHAPES)]) for index in range(args.tables)]
        fill_tables(pg, tables)
        cpu: dict[tuple[str, str], float] = {}
        for case, way in PIPELINES:
            figures = measure(pg, root, tables, case, way, args)
            cpu[case, way] = figures["python"] + figures["jvm"]
            report.add(case, way, *(figures[name] for name in ("wall", "python", "jvm")), cpu[case, way],
                       figures["pyiceberg"])  # fmt: skip
        for case in ("mixed", "inserts"):
            report.ratio(f"{case}_cpu_s_per_merge", cpu[case, "pyiceberg"], TARGET, at_most=True)
            report.ratio(f"{case}_cpu_vs_spark_merge", cpu[case, "pyiceberg"] / cpu[case, "spark"])
        if args.aged_merges > AGED_WINDOW:
            first, last = measure_aged(pg, root, tables[0], args.aged_merges)
            report.add("aged", f"first {AGED_WINDOW} merges", "", "", "", first, "")
            report.add("aged", f"last {AGED_WINDOW} of {args.aged_merges}", "", "", "", last, "")
            report.ratio("aged_cpu_s_per_merge", last, TARGET, at_most=True)
            report.ratio("aged_last_vs_first_merges", last / first)
    report.emit(args.json)


if __name__ == "__main__":
    main()
