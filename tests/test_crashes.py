"""Crashes injected at each durability boundary lose nothing and duplicate nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.coordination.store import CoordinationStore
from pg2iceberg_dagster.faults import CRASH_ENV
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.source.replication import ReplicationStream
from soak.busy import BusyTable

from .conftest import Crash, SourceDb, assert_mirrored, crash_at, snapshot_crashing_at_chunk, sync

pytestmark = pytest.mark.usefixtures("spark")


def _orders(source: SourceDb, rows: int = 6000) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' || g FROM generate_series(1, %s) g", (rows,))


def test_crash_mid_snapshot_with_its_export_lost_starts_the_table_again(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some chunks commit, then the process dies with its in-process holder: the export is gone. Rows
    move pages before the rerun, so the old chunks cannot join new ones: the table starts again in a
    new epoch and the WAL before that epoch's snapshot is skipped, not replayed on top."""
    _orders(source)
    config = source.config(["public.orders"], snapshot={"chunk_pages": 4, "parallelism": 1})
    first = source.pipeline(config)
    snapshot_crashing_at_chunk(monkeypatch, first, 2)
    chunks = first.store.chunks("public.orders")
    assert [c.index for c in chunks if c.done] == [0, 1] and len(chunks) > 2
    source.execute("UPDATE public.orders SET v = v || '!' WHERE id % 3 = 0")
    source.execute("DELETE FROM public.orders WHERE id % 10 = 0")
    source.execute("UPDATE public.orders SET id = id + 100000 WHERE id % 7 = 0")
    second = source.pipeline(config)
    result = second.snapshot()["public.orders"]
    assert (result.epoch, result.restarted, result.complete, result.chunks_skipped) == (1, True, True, 0)
    sync(second)
    assert_mirrored(second)  # also fails on duplicate keys


def test_crash_between_staging_and_registration(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files uploaded but never registered: the rerun stages the changes again, cleanup drops the orphans."""
    _orders(source, 100)
    pipeline = source.pipeline(source.config(["public.orders"]))
    pipeline.snapshot()
    source.execute("UPDATE public.orders SET v = 'changed' WHERE id <= 50")
    crash_at(monkeypatch, CoordinationStore, "register_flush")
    with pytest.raises(Crash):
        pipeline.stream(until_caught_up=True)
    monkeypatch.undo()  # the process "restarts" with the real code
    assert pipeline.store.log_head("public.orders") == 0
    sync(pipeline)
    assert pipeline.store.log_head("public.orders") == 50
    assert_mirrored(pipeline)

    assert pipeline.collect_garbage().files_deleted >= 1


def test_cleanup_between_a_flushs_upload_and_its_registration_keeps_its_files(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction begun before the flushed LSN last moved has changes below it. Cleanup running
    while its flush is between upload and registration (`run` sweeps between merges) took its file
    for an orphan, as the file was named by its last change, and the merge then found it gone."""
    _orders(source, 100)
    pipeline = source.pipeline(source.config(["public.orders"]))
    pipeline.snapshot()
    with psycopg.connect(source.conninfo) as open_transaction:
        open_transaction.execute("UPDATE public.orders SET v = 'long' WHERE id <= 20")
        source.execute("UPDATE public.orders SET v = 'short' WHERE id > 90")  # its commit flushes the WAL
        pipeline.stream(until_caught_up=True)  # the flushed LSN moves past the open transaction's changes
        flushed = pipeline.store.flushed_lsn() or 0
        open_transaction.commit()
    register = CoordinationStore.register_flush
    swept: list[int] = []

    def swept_first(store: CoordinationStore, *args: Any, **kwargs: Any) -> Any:
        swept.append(pipeline.collect_garbage().files_deleted)
        return register(store, *args, **kwargs)

    monkeypatch.setattr(CoordinationStore, "register_flush", swept_first)
    pipeline.stream(until_caught_up=True)
    monkeypatch.undo()
    (entry,) = pipeline.store.log_entries("public.orders", 10)  # after the 10 rows of the first flush
    assert entry.first_lsn < flushed, "the test's transaction did not begin below the flushed LSN"
    assert swept == [0]
    sync(pipeline)
    assert_mirrored(pipeline)


def test_crash_between_registration_and_ack(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered but the slot never heard: the rerun must not stage the transaction twice."""
    _orders(source, 100)
    pipeline = source.pipeline(source.config(["public.orders"]))
    pipeline.snapshot()
    source.execute("DELETE FROM public.orders WHERE id <= 30")
    crash_at(monkeypatch, ReplicationStream, "ack")
    with pytest.raises(Crash):
        pipeline.stream(until_caught_up=True)
    monkeypatch.undo()  # the process "restarts" with the real code
    assert pipeline.store.log_head("public.orders") == 30
    source.execute("INSERT INTO public.orders VALUES (1, 'back')")
    sync(pipeline)
    assert pipeline.store.log_head("public.orders") == 31, "the registered transaction was staged twice"
    assert_mirrored(pipeline)


def test_crash_between_iceberg_commit_and_cursor_update(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """The merge committed but the cursor did not move: replaying the batch gives the same table."""
    _orders(source, 100)
    source.execute("CREATE TABLE public.docs (id int PRIMARY KEY, name text, body text)")
    source.execute("ALTER TABLE public.docs ALTER COLUMN body SET STORAGE EXTERNAL")
    source.execute("INSERT INTO public.docs SELECT g, 'n', repeat(md5(g::text), 300) FROM generate_series(1, 5) g")
    pipeline = source.pipeline(source.config(["public.orders", "public.docs"]))
    pipeline.snapshot()
    source.execute("UPDATE public.orders SET v = 'x' WHERE id <= 20; DELETE FROM public.orders WHERE id > 90")
    source.execute("UPDATE public.docs SET name = 'toast kept' WHERE id <= 3")
    source.execute("TRUNCATE public.orders")
    source.execute("INSERT INTO public.orders VALUES (7, 'after truncate')")
    pipeline.stream(until_caught_up=True)
    crash_at(monkeypatch, CoordinationStore, "advance_mat_cursor")
    with pytest.raises(Crash):
        pipeline.materialize()
    monkeypatch.undo()  # the process "restarts" with the real code
    assert pipeline.store.mat_cursor("default", "public.orders") == 0
    results = pipeline.materialize()
    assert results["public.orders"].batches == 1
    assert_mirrored(pipeline)


def test_row_moved_into_a_done_chunk_keeps_its_toast_after_export_loss(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Export lost mid-snapshot; updates that leave a TOASTed column alone move their rows into a chunk
    already read (no chunk of a mixed read would see them, and their WAL lacks that column), then
    change their keys. Found by the soak (seed 1): the column arrived in Iceberg as NULL."""
    source.execute("CREATE TABLE public.docs (id int PRIMARY KEY, n int, body text)")
    source.execute("ALTER TABLE public.docs ALTER COLUMN body SET STORAGE EXTERNAL")
    source.execute("ALTER TABLE public.docs SET (autovacuum_enabled = off)")
    source.execute("INSERT INTO public.docs SELECT g, 0, repeat(md5(g::text), 100) FROM generate_series(1, 2000) g")
    config = source.config(["public.docs"], snapshot={"chunk_pages": 4, "parallelism": 1})
    first = source.pipeline(config)
    snapshot_crashing_at_chunk(monkeypatch, first, 1)
    chunks = first.store.chunks("public.docs")
    boundary = min(c.start_page for c in chunks if not c.done)
    read = f"'({boundary},0)'::tid"
    # Free space in the chunks already read, then update rows of later chunks without touching body:
    # their new versions land in the freed pages.
    source.execute(f"DELETE FROM public.docs WHERE ctid < {read}")
    source.execute("VACUUM public.docs")
    moved = source.execute(
        f"WITH u AS (UPDATE public.docs SET n = 1 WHERE ctid >= {read} AND id % 7 = 0 RETURNING ctid) "
        f"SELECT count(*) FROM u WHERE ctid < {read}"
    )[0][0]
    assert moved > 0, "the test needs rows moved into the first chunk"
    source.execute("UPDATE public.docs SET id = id + 5000 WHERE n = 1 AND id % 2 = 0")
    source.execute("UPDATE public.docs SET id = id + 5000 WHERE id > 5000 AND id % 4 = 0")
    second = source.pipeline(config)
    assert second.snapshot()["public.docs"].restarted
    sync(second)
    assert_mirrored(second)


BUSY_ROWS = 50_000


def _snapshot_process(config_path: Path, crash_at: str | None = None) -> subprocess.Popen[bytes]:
    env = {key: value for key, value in os.environ.items() if key != CRASH_ENV}
    if crash_at:
        env[CRASH_ENV] = crash_at
    return subprocess.Popen(
        [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(config_path), "snapshot"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _snapshot_busy_table_with_deaths(
    source: SourceDb, tmp_path: Path, seed: int, deaths: Callable[[Path], None]
) -> tuple[Pipeline, BusyTable]:
    """Create the busy table, keep writing to it while ``deaths(config_path)`` kills snapshot
    processes, then run ``snapshot`` to completion; returns a pipeline on it and the workload."""
    setup = BusyTable(source.conninfo, seed, BUSY_ROWS)
    setup.create()
    setup.close()
    config = source.config(["public.busy"], snapshot={"chunk_pages": 8, "parallelism": 2})
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    busy = BusyTable(source.conninfo, seed, BUSY_ROWS)
    stop = threading.Event()

    def write() -> None:
        try:
            while not stop.is_set():
                busy.step()
        except Exception:
            busy.kinds["error"] += 1  # fails the test below
            raise

    writer = threading.Thread(target=write)
    writer.start()
    try:
        deaths(path)
        finished = _snapshot_process(path)
        assert finished.wait(300) == 0, finished.stderr.read() if finished.stderr else ""
    finally:
        stop.set()
        writer.join()
        busy.close()
    assert not busy.kinds["error"], busy.kinds
    return source.pipeline(config), busy


def test_snapshot_killed_again_and_again_under_writes_resumes_exactly(source: SourceDb, tmp_path: Path) -> None:
    """A busy table (rows moving pages, key changes, TOAST left unchanged, deletes and re-inserts):
    ``snapshot`` is SIGKILLed three times. Its holder process lives on, so every rerun imports the same
    exported snapshot and skips the chunks done: one epoch, nothing read twice, nothing lost."""

    def deaths(path: Path) -> None:
        for point in ["snapshot.after_chunk_commit:1", "snapshot.mid_chunk:2", "snapshot.after_chunk_commit:2"]:
            died = _snapshot_process(path, point)
            assert died.wait(300) == -signal.SIGKILL, died.stderr.read() if died.stderr else ""
        # The holder outlived them: `status` shows it, and the next run imports its snapshot.
        assert source.pipeline(load_config(path)).status()["snapshot_holder"] == {"epoch": 0}

    pipeline, busy = _snapshot_busy_table_with_deaths(source, tmp_path, 11, deaths)
    assert busy.kinds["key_change"] and busy.kinds["move_toast"], busy.kinds
    chunks = pipeline.store.chunks("public.busy")
    assert len(chunks) > 6 and {c.epoch for c in chunks} == {0}, "the holder's snapshot was lost"
    sync(pipeline)
    assert_mirrored(pipeline)


def test_holder_killed_mid_snapshot_restarts_the_table_under_a_new_snapshot(source: SourceDb, tmp_path: Path) -> None:
    """The holder itself dies (SIGKILL) after chunks committed, under writes: the rerun takes a new
    epoch, reads the table again under its snapshot, and the merge skips exactly the transactions
    that snapshot shows (without that skip this test diverges)."""

    def deaths(path: Path) -> None:
        holder = subprocess.Popen(
            [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(path), "hold-snapshot"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        died = _snapshot_process(path, "snapshot.after_chunk_commit:2")
        assert died.wait(300) == -signal.SIGKILL
        holder.kill()
        holder.wait()
        time.sleep(1)  # writes under no snapshot at all

    pipeline, busy = _snapshot_busy_table_with_deaths(source, tmp_path, 12, deaths)
    assert busy.kinds["free_early_pages"], busy.kinds
    assert {c.epoch for c in pipeline.store.chunks("public.busy")} == {1}
    assert pipeline.store.table_state("public.busy").snapshot_epoch == 1  # type: ignore[union-attr]
    sync(pipeline)
    assert_mirrored(pipeline)


def test_two_snapshot_processes_started_at_once_share_one_holder(source: SourceDb, tmp_path: Path) -> None:
    """Both start a holder; one holder wins, and both processes read under its snapshot (the loser's
    process waits for the winner instead of failing). Chunks both read are committed once."""
    _orders(source, 20_000)
    config = source.config(["public.orders"], snapshot={"chunk_pages": 8, "parallelism": 1})
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    first, second = _snapshot_process(path), _snapshot_process(path)
    for process in (first, second):
        assert process.wait(300) == 0, process.stderr.read() if process.stderr else ""
    pipeline = source.pipeline(config)
    assert {c.epoch for c in pipeline.store.chunks("public.orders")} == {0}
    sync(pipeline)
    assert_mirrored(pipeline)


def test_process_killed_after_chunk_commit_resumes(source: SourceDb, tmp_path: Path) -> None:
    """``snapshot`` dies by SIGKILL after a chunk's Iceberg commit, before it is recorded as done.

    The rerun recognises the chunk by the marker in its Iceberg commit. Found by the soak (seed 7):
    recording the recovered chunk violated the read_mode constraint, so the snapshot never completed.
    """
    _orders(source, 3000)
    config = source.config(["public.orders"], snapshot={"chunk_pages": 4, "parallelism": 1})
    config_path = tmp_path / "pg2iceberg.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    died = subprocess.run(
        [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(config_path), "snapshot"],
        env={**os.environ, CRASH_ENV: "snapshot.after_chunk_commit:2"},
        capture_output=True,
        timeout=300,
    )
    assert died.returncode == -signal.SIGKILL
    pipeline = source.pipeline(config)
    assert sum(c.done for c in pipeline.store.chunks("public.orders")) == 1, "the second chunk is not recorded"
    source.execute("UPDATE public.orders SET v = 'after the crash' WHERE id % 9 = 0")
    results = pipeline.snapshot()
    assert results["public.orders"].complete
    sync(pipeline)
    assert_mirrored(pipeline)
