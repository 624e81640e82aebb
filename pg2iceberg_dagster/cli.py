"""``pg2iceberg-dagster``: the engine's command line (no Dagster needed).

Exit codes: 0 success, 1 error, 2 bad configuration, 3 a startup check refused, 4 the slot or a
table lease is held by another process, 5 verify found differences, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from .config import TableConfig, load_config
from .errors import NOT_CURRENT_EXIT_CODE, ConfigError, Pg2IcebergError
from .lifecycle import run_following_config
from .pipeline import Pipeline, RepairResult, TableRepairResult
from .source.lsn import format_lsn
from .source.publication_policy import describe_policy
from .verify import print_diffs

if TYPE_CHECKING:
    from .flusher.flusher import FlushStats
    from .materializer.merge import MergeResult

DEFAULT_CONFIG = "pg2iceberg.yaml"


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def _progress(total: int | None, unit: str, desc: str) -> tqdm:
    return tqdm(total=total, unit=unit, desc=desc, disable=None, file=sys.stderr)


def cmd_validate(pipeline: Pipeline, args: argparse.Namespace) -> int:
    report = pipeline.validate()
    print(f"ok: PostgreSQL {report.server_version}, system_identifier {report.system_identifier}")
    print(f"    CTID chunking: {'on' if report.ctid_chunking else 'off (PostgreSQL < 14: one chunk per table)'}")
    print(f"    slot {pipeline.config.replication.slot}: {'exists' if report.slot else 'not created yet'}")
    for warning in report.warnings:
        print(f"    warning: {warning}")
    for key, table in report.tables.items():
        print(f"    {key}: {len(table.columns)} columns, primary key ({', '.join(table.primary_key)})")
        for line in describe_policy(table, report.server_version):
            print(f"      {line}")
    for key, reason in pipeline.left_out.items():
        print(f"    {key}: left out of its schema entry: {reason}")
    _print_no_longer_configured(pipeline.no_longer_configured())
    return 0


def _print_no_longer_configured(keys: list[str]) -> None:
    """Tables still mirrored that the config no longer names, and how they are let go."""
    for key in keys:
        print(
            f"    {key}: no longer configured, still in the publication and the coordination state until "
            f"`pg2iceberg-dagster cleanup --table {key}` (Dagster's snapshot planner sensor does it on its own)"
        )


def cmd_snapshot(pipeline: Pipeline, args: argparse.Namespace) -> int:
    bar = _progress(None, "chunk", "snapshot")

    def on_plan(total: int) -> None:  # the chunks planned so far: tables are planned while chunks run
        bar.total = total
        bar.refresh()

    try:
        results = pipeline.snapshot(on_chunk=lambda chunk, rows: bar.update(1), on_plan=on_plan)
    finally:
        bar.close()
    if not results:
        print("snapshot already complete for every table")
    for key, result in results.items():
        restarted = "; started again: its earlier chunks were of a snapshot that is gone" if result.restarted else ""
        print(
            f"{key}: {result.rows} rows in {result.chunks_run} chunks ({result.chunks_skipped} already done; "
            f"snapshot epoch {result.epoch}{restarted})"
        )
    return 0


def cmd_stream(pipeline: Pipeline, args: argparse.Namespace) -> int:
    repaired = pipeline.repair_at_startup(on_table=_print_repair)  # a lost slot (replication.on_slot_lost)
    if repaired is not None:
        _print_repair_summary(pipeline, repaired)
    stop = _stop_on_signals()
    bar = _progress(None, "change", "stream")
    last = [0]

    def on_flush(stats: FlushStats) -> None:
        bar.update(stats.changes - last[0])
        last[0] = stats.changes
        bar.set_postfix(flushed_lsn=format_lsn(stats.flushed_lsn), files=stats.files)

    try:
        stats = pipeline.stream(
            stop, until_caught_up=args.until_caught_up, max_seconds=args.max_seconds, on_flush=on_flush
        )
    finally:
        bar.close()
    print(
        f"staged {stats.changes} changes of {stats.transactions} transactions in {stats.files} files; "
        f"flushed_lsn {format_lsn(stats.flushed_lsn)}"
    )
    return 0


def _print_merge(results: dict[str, MergeResult]) -> None:
    for key, result in results.items():
        if result.not_current:
            print(f"{key}: not up to date, {result.not_current}")
        else:
            print(
                f"{key}: {result.changes} changes ({result.upserts} upserts, {result.deletes} deletes) "
                f"in {result.batches} batches; mat_cursor {result.lag.mat_cursor}/{result.lag.log_head}"
            )


def cmd_materialize(pipeline: Pipeline, args: argparse.Namespace) -> int:
    tables = args.table or None
    if not args.once and (args.resync or args.json):
        raise ConfigError("materialize: --resync and --json go with --once")
    if args.once:
        results = pipeline.materialize(tables)
        pending = [key for key, result in results.items() if result.resync_reason]
        if args.resync and pending:
            _resync_or_repair(pipeline, pending)
            results = pipeline.materialize(tables)  # what was staged meanwhile
        if args.json:
            print(json.dumps([result.as_json() for result in results.values()], indent=2))
        else:
            _print_merge(results)
        return NOT_CURRENT_EXIT_CODE if any(result.not_current for result in results.values()) else 0
    stop = _stop_on_signals()
    pipeline.validate()
    materializer = pipeline.materializer()
    while not stop.is_set():
        _print_merge({k: r for k, r in materializer.run_once(tables).items() if r.batches})
        stop.wait(pipeline.config.materialize.interval_seconds)
    return 0


def cmd_run(pipeline: Pipeline, args: argparse.Namespace) -> int:
    # A pipeline per version of the config file it follows (``pipeline`` is the first one's config).
    tables = len(pipeline.config.tables)
    print(f"run: mirroring {tables} tables on slot {pipeline.config.replication.slot}; Ctrl-C stops", flush=True)

    def progress(line: str) -> None:
        print(f"run: {line}", flush=True)

    run_following_config(args.config, _stop_on_signals(), metrics_port=args.metrics_port, on_progress=progress)
    return 0


def cmd_repair(pipeline: Pipeline, args: argparse.Namespace) -> int:
    keys = [pipeline.tables.named(name).key for name in args.table or []] or None
    result = pipeline.repair(keys, on_table=_print_repair)
    _print_repair_summary(pipeline, result)
    if keys and result.slot_lost:
        print("--table was not followed: with the slot lost, every mirrored table was repaired")
    if not result.tables and not result.slot_lost:
        print("the slot is healthy and no repair is pending; name a table with --table")
    return 0


def _print_repair(result: TableRepairResult) -> None:
    if result.left_to_resync:
        print(
            f"{result.table}: not repaired, left to an online resync ({result.left_to_resync}): "
            f"`pg2iceberg-dagster resync --table {result.table}`"
        )
        return
    if result.resumed:
        print(f"{result.table}: already repaired (before an interruption, or by another process; epoch {result.epoch})")
        return
    print(
        f"{result.table}: {result.rows_compared} rows compared ({result.pg_rows} in PostgreSQL, {result.iceberg_rows} "
        f"in Iceberg), {result.rows_written} written ({result.upserted} upserted, {result.deleted} deleted) "
        f"in {'one commit' if result.snapshot_id else 'no commit'} (epoch {result.epoch}, {result.seconds:.1f} s)",
        flush=True,
    )


def _print_repair_summary(pipeline: Pipeline, result: RepairResult) -> None:
    if result.slot_lost:
        at = format_lsn(result.consistent_point) if result.consistent_point else "?"
        slot = pipeline.config.replication.slot
        print(f"replication slot {slot} {result.slot_lost}: replaced by a new one, streaming resumes at {at}")
    if result.tables:
        compared = sum(t.rows_compared for t in result.tables)
        written = sum(t.rows_written for t in result.tables)
        print(f"repaired {len(result.tables)} tables: {compared} rows compared, {written} rows written")
    for key, reason in result.left_to_resync.items():
        print(f"{key}: left to its online resync ({reason}): `pg2iceberg-dagster resync --table {key}`")


def cmd_resync(pipeline: Pipeline, args: argparse.Namespace) -> int:
    if args.table:  # asked for by name: copied again, even one waiting for a repair
        for name in args.table:
            _resync(pipeline, pipeline.tables.named(name).key)
        return 0
    pending = list(pipeline.resyncs_pending())
    if not pending:
        print("no resync pending; name a table with --table")
    _resync_or_repair(pipeline, pending)
    return 0


def _resync_or_repair(pipeline: Pipeline, pending: list[str]) -> None:
    """Bring the tables waiting for a resync or a repair up to date: a repair writes only the table's
    differences, not a copy of all of it."""
    repairs = set(pipeline.repairs_pending())
    for key in pending:
        if key in repairs:
            pipeline.repair([key], on_table=_print_repair)
        else:
            _resync(pipeline, key)


def _resync(pipeline: Pipeline, key: str) -> None:
    with _progress(None, "chunk", f"resync {key}") as bar:
        result = pipeline.resync(key, on_chunk=lambda chunk, rows: bar.update(1))
    print(f"{key}: {result.rows} rows in {result.chunks} chunks, switched in one commit (epoch {result.epoch})")
    if result.schema_changes:
        print(f"    schema: {', '.join(result.schema_changes)}")


def cmd_maintain(pipeline: Pipeline, args: argparse.Namespace) -> int:
    keys = [pipeline.tables.named(name).key for name in args.table or []] or None
    results = pipeline.maintain(keys, due_only=args.due)
    if args.json:
        print(json.dumps([result.as_json() for result in results], indent=2))
        return 0
    if not results:
        print("no table is due for maintenance")
    for result in results:
        if result.skipped:
            print(f"{result.table}: skipped, {result.skipped}")
            continue
        before, after, rewrites = result.before, result.after, result.rewrites
        assert before is not None and after is not None
        print(
            f"{result.table}: data files {before.data_files} -> {after.data_files}, "
            f"delete files {before.delete_files} -> {after.delete_files}, "
            f"snapshots {before.snapshots} -> {after.snapshots}, {result.orphans_removed} orphan files and "
            f"{result.staged_files_removed} staged files deleted ({result.seconds:.1f} s)"
        )
        if rewrites.manifests_rewritten:
            print(f"    {rewrites.manifests_rewritten} manifests rewritten")
    return 0


def cmd_hold_snapshot(pipeline: Pipeline, args: argparse.Namespace) -> int:
    from .snapshot.holder import hold_snapshot

    held = hold_snapshot(pipeline.config, _stop_on_signals(), max_seconds=args.max_seconds)
    print(
        "held the exported snapshot until the snapshot completed"
        if held
        else "nothing to hold: every table's snapshot is complete or another holder runs"
    )
    return 0


def cmd_spark_server(pipeline: Pipeline, args: argparse.Namespace) -> int:
    from .materializer.warm_spark import serve, stop_server

    if args.stop:
        pid = stop_server(pipeline.config)
        print(f"stopped the warm Spark server {pid}" if pid else "no warm Spark server runs for this pipeline")
        return 0
    serve(pipeline.config, _stop_on_signals())
    return 0


def cmd_verify(pipeline: Pipeline, args: argparse.Namespace) -> int:
    if args.catch_up:
        pipeline.catch_up()
    return 0 if print_diffs(pipeline.verify(args.table)) else 5


def cmd_status(pipeline: Pipeline, args: argparse.Namespace) -> int:
    status = pipeline.status()
    if args.json:
        print(json.dumps({**status, "tables": [t.as_json() for t in status["tables"]]}, indent=2))
        return 0
    slot = status["slot"]
    print(f"slot: {json.dumps(slot) if slot else 'not created'}; flushed_lsn: {status['flushed_lsn']}")
    if slot and slot["safety"] != "ok":
        print(f"slot {slot['safety']}: {slot['safety_reason']}")
    if status["snapshot_holder"]:
        print(f"snapshot holder: keeps the exported snapshot of epoch {status['snapshot_holder']['epoch']} open")
    for t in status["tables"]:
        snap = "complete" if t.snapshot_complete else f"{t.chunks_done}/{t.chunks_total} chunks"
        snap += f" (epoch {t.snapshot_epoch})" if t.snapshot_epoch is not None else ""
        lag = f"staged log head {t.lag.log_head}, mat_cursor {t.lag.mat_cursor}, lag {t.lag.changes}"
        resync = f"; resync pending: {t.resync_reason}" if t.resync_reason else ""
        files = (
            f"; Iceberg {t.iceberg.data_files} data files, {t.iceberg.delete_files} delete files, "
            f"{t.iceberg.snapshots} snapshots"
            if t.iceberg
            else ""
        )
        print(f"{t.table}: snapshot {snap}; {lag}{resync}{files}")
    _print_no_longer_configured(status["no_longer_configured"])
    cut = status["latest_cut"]
    if cut:
        print(f"latest cut: {cut['name']} at source LSN {cut['lsn']}, {cut['taken_at']}, {len(cut['tables'])} tables")
    return 0


def cmd_cut(pipeline: Pipeline, args: argparse.Namespace) -> int:
    cut = pipeline.cut(args.name, args.group)
    if args.json:
        print(json.dumps(cut.as_json(), indent=2))
        return 0
    print(f"cut {cut.name}: {len(cut.tables)} tables complete up to source LSN {format_lsn(cut.lsn)}")
    for key in cut.tables:
        print(f"    {key}: snapshot {cut.snapshots[key]}")
    print(f"read it with: SELECT ... FROM <table> VERSION AS OF '{cut.name}'")
    return 0


def cmd_cleanup(pipeline: Pipeline, args: argparse.Namespace) -> int:
    from .cleanup import remove_tables, reset_all, reset_table
    from .tables import MirroredTable

    pipeline.store.migrate()
    if args.all:
        if not args.yes:
            print(
                "cleanup --all drops the slot, the coordination state, the Iceberg tables and staged files; "
                "add --yes to confirm",
                file=sys.stderr,
            )
            return 2
        tables = pipeline.tables.values()
        result = reset_all(pipeline.config, tables, pipeline.store, pipeline.objects, pipeline.catalog)
        print(
            f"dropped slot: {result.slot_dropped}; tables reset: {result.tables_reset}; "
            f"files deleted: {result.files_deleted}"
        )
        return 0
    for table in args.table or []:
        if table not in pipeline.tables:
            # Removed from the config: it stops being mirrored; its Iceberg table (unknown now) stays.
            try:
                removed = TableConfig(name=table)
            except ValueError:
                raise ConfigError(f"--table {table!r}: expected 'schema.table'") from None
            leaving = [MirroredTable.of(pipeline.config, removed)]
            remove_tables(pipeline.config, pipeline.store, pipeline.objects, pipeline.catalog, leaving, False)
            print(f"{table}: not in the config any more; left the publication, state and staged files deleted")
            continue
        reset_table(pipeline.tables[table], pipeline.store, pipeline.objects, pipeline.catalog)
        print(f"{table}: state and Iceberg table dropped; run `snapshot` to mirror it again")
    if not args.table:
        result = pipeline.collect_garbage()
        print(f"deleted {result.files_deleted} staged files")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from .quickstart import run_dagster_dev, run_quickstart

    if args.dagster:
        return run_dagster_dev(Path(args.dir), port=args.port, rows=args.rows, ui_port=args.ui_port)
    return run_quickstart(Path(args.dir), port=args.port, seconds=args.seconds, rows=args.rows)


COMMANDS = {
    "validate": (cmd_validate, "run every startup check and describe the tables"),
    "snapshot": (cmd_snapshot, "take (or resume) the consistent initial snapshot"),
    "stream": (cmd_stream, "run the WAL flusher into the staged log"),
    "materialize": (cmd_materialize, "merge the staged log into Iceberg with Spark"),
    "run": (cmd_run, "snapshot, then stream and materialize in one process until interrupted"),
    "repair": (
        cmd_repair,
        "after a lost slot (or for tables verify found different): compare with the source, write only the differences",
    ),
    "resync": (cmd_resync, "copy tables again online (those named, or those a merge found need it)"),
    "maintain": (cmd_maintain, "compact files, expire snapshots, delete orphan and applied staged files"),
    "verify": (cmd_verify, "compare PostgreSQL and Iceberg row by row (exit 5 on differences)"),
    "status": (cmd_status, "show slot, flushed LSN, snapshot progress and lag per table"),
    "cut": (
        cmd_cut,
        "tag every table (or a cuts.groups group) complete up to one source LSN: a consistent cut (docs/cuts.md)",
    ),
    "hold-snapshot": (
        cmd_hold_snapshot,
        "create the slot and keep its exported snapshot open for chunk runs in other processes",
    ),
    "spark-server": (
        cmd_spark_server,
        "run the warm Spark driver Dagster merge runs attach to (they start one themselves); --stop stops it",
    ),
    "cleanup": (cmd_cleanup, "delete applied staged files, or reset a table or the whole pipeline"),
}


def _json_argument(command: argparse.ArgumentParser) -> None:
    command.add_argument("--json", action="store_true", help="machine-readable output")


def _cut_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--name", help="the tag's name (default: cut-<UTC time>)")
    command.add_argument("--group", help="only this group of cuts.groups (default: every mirrored table)")
    _json_argument(command)


# The arguments of the commands that have some, beyond those build_parser adds itself.
_MORE_ARGUMENTS = {"status": _json_argument, "cut": _cut_arguments}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pg2iceberg-dagster",
        description="Mirror PostgreSQL tables into Apache Iceberg: consistent snapshot, staged WAL, Spark MERGE.",
    )
    parser.add_argument(
        "-c",
        "--config",
        default=os.environ.get("PG2ICEBERG_CONFIG", DEFAULT_CONFIG),
        help="pipeline YAML (default: $PG2ICEBERG_CONFIG or ./pg2iceberg.yaml)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == "stream":
            command.add_argument(
                "--until-caught-up", action="store_true", help="stop once the WAL position at start is flushed"
            )
            command.add_argument("--max-seconds", type=float, help="stop after this many seconds")
        if name == "materialize":
            command.add_argument("--once", action="store_true", help="one pass up to the current head, then exit")
            command.add_argument("--table", action="append", help="only this table (repeatable)")
            command.add_argument(
                "--resync",
                action="store_true",
                help="with --once: also run the online resyncs a table waits for, then merge what they left",
            )
            command.add_argument("--json", action="store_true", help="with --once: machine-readable output")
        if name == "run":
            command.add_argument(
                "--metrics-port",
                type=int,
                metavar="N",
                help="serve Prometheus metrics on this port (overrides metrics.port)",
            )
        if name == "verify":
            command.add_argument(
                "--catch-up", action="store_true", help="flush and merge up to the current WAL position first"
            )
            command.add_argument("--table", action="append", help="only this table, schema.table (repeatable)")
        if name == "hold-snapshot":
            command.add_argument(
                "--max-seconds",
                type=float,
                default=6 * 3600,
                help="give up after this long (the snapshot holds back the source's xmin)",
            )
        if name == "spark-server":
            command.add_argument("--stop", action="store_true", help="stop the running one")
        if name == "resync":
            command.add_argument("--table", action="append", help="resync this table (repeatable)")
        if name == "repair":
            command.add_argument(
                "--table", action="append", help="repair this table even with a healthy slot (repeatable)"
            )
        if name == "maintain":
            command.add_argument("--table", action="append", help="only this table (repeatable)")
            command.add_argument(
                "--due", action="store_true", help="only tables due (interval passed, or files call for compaction)"
            )
            command.add_argument("--json", action="store_true", help="machine-readable output")
        if name in _MORE_ARGUMENTS:
            _MORE_ARGUMENTS[name](command)
        if name == "cleanup":
            command.add_argument("--table", action="append", help="reset this table so it is snapshotted again")
            command.add_argument("--all", action="store_true", help="reset the whole pipeline")
            command.add_argument("--yes", action="store_true", help="confirm --all")
    quick = sub.add_parser("quickstart", help="start a local Postgres with live writes and replicate it end to end")
    quick.add_argument("--dir", default=".pg2iceberg", help="where the cluster, staging and warehouse live")
    quick.add_argument("--port", type=int, default=54329, help="port of the local Postgres")
    quick.add_argument("--seconds", type=float, default=20.0, help="how long the live writes run")
    quick.add_argument("--rows", type=int, default=50_000, help="rows in the sample orders table")
    quick.add_argument(
        "--dagster",
        action="store_true",
        help="instead of replicating here, keep writing and run `dg dev` (Dagster's UI and daemon) on the pipeline",
    )
    quick.add_argument("--ui-port", type=int, default=3000, help="Dagster UI port (with --dagster)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "quickstart":
            return cmd_quickstart(args)
        with Pipeline(load_config(args.config), detached_holder=True) as pipeline:
            return COMMANDS[args.command][0](pipeline, args)
    except Pg2IcebergError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
