"""Merge throughput (staged changes applied per second) against a raw Spark MERGE of the same changes.

    .venv/bin/python -m bench.merge [--rows 2000000] [--changes 200000] [--modes copy-on-write,merge-on-read]

Starts its own PostgreSQL, and per write mode (Iceberg ``write.{merge,update,delete}.mode``, set
through the config's ``iceberg.table_properties``) runs in a fresh process, so the first merge pays
the JVM start as in a new deployment:

1. fills a narrow table of ``--rows`` rows and snapshots it into Iceberg;
2. commits ``--changes`` changes (80 % updates, 10 % inserts, 10 % deletes, in 10k-row
   transactions), stages them with the flusher, and times ``Pipeline.materialize()``: **cold**;
3. does it again with new batches: **warm** (same process, same Spark session), ``--warm-batches`` times;
4. the limit, for each warm batch: its folded changes, cached in memory as a Spark DataFrame, merged
   by a plain ``MERGE INTO`` into the table as it was before our merge (Iceberg ``set_current_snapshot``),
   in the same session: the raw engine cost without staged-file reads, folding or typing. The JVM keeps
   getting faster from one merge to the next, so the raw MERGE goes after ours in odd pairs and before
   it in even ones; our merge's snapshot is always the one kept;
5. checks that Iceberg equals PostgreSQL row by row (``Pipeline.verify``).

Per merge it prints where the time went (read, fold, arrow, spark_start, spark_merge, commit; see
``pg2iceberg_dagster.materializer.merge.PHASES``), and the ratio ours / raw Spark MERGE over the warm
pairs (changes per second), and the warm rate against 100k changes/s.

A merge-on-read table of at least ``materialize.branch_upsert_min_rows`` rows (the 2M rows here) is
written as delete-by-key plus append on a branch, then main is fast-forwarded (see
``materializer.branch.write_on_branch``); the raw MERGE is Spark's own plan for the same changes.
"""

from __future__ import annotations

import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq

from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.iceberg.delete_formats import format_properties
from pg2iceberg_dagster.materializer.merge import PHASES
from pg2iceberg_dagster.materializer.spark_sql import merge_statement, spark_identifier
from pg2iceberg_dagster.pipeline import Pipeline

from .common import SOURCE_DB, Report, argument_parser, bench_cluster, bench_config, fill_table, timed, work_dir

MODES = ("copy-on-write", "merge-on-read")
TARGET_CHANGES_PER_S = 100_000
TXN_ROWS = 10_000


class ChangeMaker:
    """Commits batches of random updates, inserts and deletes to a narrow table (seeded, reproducible)."""

    def __init__(self, pg: EmbeddedPostgres, table: str, rows: int, seed: int = 42) -> None:
        self.pg = pg
        self.table = table
        self.next_id = rows + 1
        self.random = random.Random(seed)
        self.deleted: set[int] = set()

    def _live_keys(self, count: int) -> list[int]:
        keys: set[int] = set()
        while len(keys) < count:
            key = self.random.randrange(1, self.next_id)
            if key not in self.deleted:
                keys.add(key)
        return list(keys)

    def commit(self, changes: int) -> int:
        """Commit about ``changes`` row changes (80 % updates, 10 % inserts, 10 % deletes); returns the count."""
        inserts = deletes = changes // 10
        updates = changes - inserts - deletes
        keys = self._live_keys(updates + deletes)
        to_update, to_delete = keys[:updates], keys[updates:]
        self.deleted.update(to_delete)
        statements: list[tuple[str, Any]] = []
        for start in range(0, updates, TXN_ROWS):
            statements.append(
                (
                    f"UPDATE {self.table} SET abalance = abalance + 1 WHERE aid = ANY(%s)",
                    to_update[start : start + TXN_ROWS],
                )
            )
        for start in range(0, deletes, TXN_ROWS):
            statements.append((f"DELETE FROM {self.table} WHERE aid = ANY(%s)", to_delete[start : start + TXN_ROWS]))
        for start in range(0, inserts, TXN_ROWS):
            count = min(TXN_ROWS, inserts - start)
            first = self.next_id
            self.next_id += count
            statements.append(
                (
                    f"INSERT INTO {self.table} SELECT g, 1 + g / 100000, 0, '' FROM generate_series(%s::bigint, %s) g",
                    (first, first + count - 1),
                )
            )
        self.random.shuffle(statements)  # interleave the kinds, as an application would
        done = 0
        with psycopg.connect(self.pg.conninfo(SOURCE_DB), autocommit=True) as conn:
            for statement, params in statements:
                done += conn.execute(statement, params if isinstance(params, tuple) else (params,)).rowcount
        return done


def _merge_row(mode: str, merge: str, changes: int, seconds: float, timings: dict[str, float]) -> list[Any]:
    return [
        mode,
        merge,
        changes,
        round(seconds, 2),
        changes / seconds,
        *(round(timings.get(p, 0.0), 2) for p in PHASES),
    ]


def run_mode(
    pg: EmbeddedPostgres,
    root: Path,
    mode: str,
    rows: int,
    changes: int,
    warm_batches: int,
    properties: dict[str, str],
) -> dict[str, Any]:
    """One write mode end to end in this (fresh) process; returns report rows and facts."""
    short = "cow" if mode == "copy-on-write" else "mor"
    table = f"accounts_{short}"
    fill_table(pg, "narrow", table, rows)
    # Each mode is its own pipeline: its own coordination state, slot, publication and staging.
    pg.create_database(f"state_{short}")
    config = bench_config(
        pg,
        root,
        [f"public.{table}"],
        replication={"slot": f"bench_{short}", "publication": f"bench_{short}"},
        state={"host": "127.0.0.1", "port": pg.port, "dbname": f"state_{short}", "user": "postgres"},
        staging={"url": f"file://{root}/staging_{short}"},
        iceberg={"table_properties": {**format_properties(mode), **properties}},
    )
    maker = ChangeMaker(pg, table, rows)
    report_rows: list[list[Any]] = []
    facts: dict[str, Any] = {}
    with Pipeline(config) as pipeline:
        facts["snapshot_seconds"] = round(timed(pipeline.snapshot)[0], 2)
        identifier = f"public.{table}"
        properties = pipeline.catalog.load_table(identifier).properties
        assert properties.get("write.merge.mode") == mode, properties  # the config reached the table

        def merge_batch(name: str, raw: str | None = None) -> None:
            """Commit and stage a batch, merge it (timed); ``raw`` "before"/"after": also time the raw
            Spark MERGE of the same batch on the same table state, before or after ours."""
            committed = maker.commit(changes)
            pipeline.stream(until_caught_up=True)
            with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
                conn.execute("CHECKPOINT")  # the write burst's flushing is done before anything is timed
            before = pipeline.catalog.load_table(identifier).current_snapshot()
            assert before is not None
            cursor = pipeline.store.mat_cursor(config.materialize.group, config.tables[0].key)
            if raw == "before":
                raw_row = raw_spark_merge(pipeline, identifier, cursor, before.snapshot_id, before.snapshot_id, mode)
            seconds, results = timed(pipeline.materialize)
            result = results[config.tables[0].key]
            assert result.changes == committed, (result.changes, committed)
            report_rows.append(_merge_row(mode, name, result.changes, seconds, result.timings))
            if raw == "after":
                ours = pipeline.catalog.load_table(identifier).current_snapshot()
                assert ours is not None
                raw_row = raw_spark_merge(pipeline, identifier, cursor, before.snapshot_id, ours.snapshot_id, mode)
            if raw is not None:
                report_rows.append([mode, f"raw Spark MERGE {name.rsplit(' ', 1)[-1]}", *raw_row[2:]])

        merge_batch("ours cold")
        for number in range(1, warm_batches + 1):
            # The JVM keeps getting faster from one merge to the next, and the machine is shared: the
            # raw MERGE goes after ours in odd pairs and before it in even ones.
            merge_batch(f"ours warm {number}", raw="after" if number % 2 else "before")
        facts["verify_seconds"], diffs = timed(pipeline.verify)
        facts["verify_seconds"] = round(facts["verify_seconds"], 2)
        facts["verify_ok"] = all(diff.ok for diff in diffs)
        facts["diffs"] = [str(diff) for diff in diffs if not diff.ok]
        facts["data_files"] = int(
            pipeline.catalog.load_table(identifier)
            .current_snapshot()
            .summary.additional_properties.get(  # type: ignore[union-attr]
                "total-data-files", 0
            )
        )
    return {"rows": report_rows, "facts": facts}


def raw_spark_merge(
    pipeline: Pipeline, identifier: str, cursor: int, before: int, restore: int, mode: str
) -> list[Any]:
    """The batch past ``cursor``, folded, as a cached DataFrame, MERGEd into the table as of snapshot
    ``before``; then snapshot ``restore`` is made current again. Only the MERGE statement is timed."""
    config = pipeline.config
    table_key = config.tables[0].key
    materializer = pipeline.materializer()
    entries = pipeline.store.log_entries(table_key, cursor)
    prepared = materializer.prepare_batch(table_key, cursor, entries)
    spark = pipeline.spark()
    path = Path(config.staging.url.removeprefix("file://")) / "raw_batch.parquet"
    pq.write_table(prepared.rows, path)
    source = spark.read.parquet(f"file://{path}").cache()
    source.count()  # materialize the cache: the MERGE below reads memory, not Parquet
    source.createOrReplaceTempView("raw_changes")
    catalog = config.iceberg.catalog.name
    target = spark_identifier(catalog, *identifier.split("."))
    spark.sql(f"CALL {catalog}.system.set_current_snapshot('{identifier}', {before})").collect()
    columns = [f.name for f in prepared.table.schema().fields]
    # A plain MERGE: no unchanged-TOAST handling (the narrow table has none to keep).
    statement = merge_statement(target, "raw_changes", columns, prepared.key, keep_unchanged=False)
    seconds, _ = timed(lambda: spark.sql(statement))
    spark.sql(f"CALL {catalog}.system.set_current_snapshot('{identifier}', {restore})").collect()
    source.unpersist()
    changes = prepared.changes
    return [
        mode,
        "raw Spark MERGE",
        changes,
        round(seconds, 2),
        changes / seconds,
        *([0.0] * (len(PHASES) - 2)),
        round(seconds, 2),
        0.0,
    ]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows in the table before the merges")
    parser.add_argument("--changes", type=int, default=200_000, help="changes per merged batch")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated Iceberg write modes")
    parser.add_argument("--warm-batches", type=int, default=2, help="warm batches (each compared with a raw MERGE)")
    parser.add_argument(
        "--property", action="append", default=[], metavar="KEY=VALUE", help="another Iceberg table property"
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    properties = dict(item.split("=", 1) for item in args.property)
    report = Report(
        "merge",
        {
            "rows": args.rows,
            "changes_per_batch": args.changes,
            "modes": modes,
            "warm_batches": args.warm_batches,
            "properties": properties,
        },
        ["mode", "merge", "changes", "seconds", "changes_per_s", *PHASES],
    )
    # No autovacuum: the source's housekeeping after each write burst would land on whichever merge
    # runs first and skew the comparison.
    with work_dir(args.dir) as root, bench_cluster(root, {"autovacuum": "off"}) as pg:
        for mode in modes:
            # A fresh process per mode: its first merge starts the JVM, like a new deployment.
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                outcome = pool.submit(
                    run_mode, pg, root, mode, args.rows, args.changes, args.warm_batches, properties
                ).result()
            for row in outcome["rows"]:
                report.add(*row)
            report.parameters[f"{mode}_facts"] = outcome["facts"]
            warm = [row for row in outcome["rows"] if row[1].startswith("ours warm")]
            raw = [row for row in outcome["rows"] if row[1].startswith("raw")]
            # Same changes on both sides: the rate ratio is raw seconds over ours, summed over the pairs.
            report.ratio(f"{mode}_warm_vs_raw_spark_merge", sum(r[3] for r in raw) / sum(r[3] for r in warm))
            # The bar: 100k changes/s warm (changes over seconds, summed over the warm merges).
            warm_rate = sum(r[2] for r in warm) / sum(r[3] for r in warm)
            report.ratio(f"{mode}_warm_changes_per_s_vs_100k", warm_rate / TARGET_CHANGES_PER_S, 1.0)
            report.ratio(f"{mode}_verify_ok", float(outcome["facts"]["verify_ok"]), 1.0)
    report.emit(args.json)


if __name__ == "__main__":
    main()
