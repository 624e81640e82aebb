"""Crashes injected at each durability boundary lose nothing and duplicate nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pg2iceberg_dagster.coordination.store import CoordinationStore
from pg2iceberg_dagster.faults import CRASH_ENV
from pg2iceberg_dagster.source.replication import ReplicationStream

from .conftest import Crash, SourceDb, assert_mirrored, crash_writing_chunks_from, sync

pytestmark = pytest.mark.usefixtures("spark")


def crash_at(monkeypatch: pytest.MonkeyPatch, owner: type, method: str) -> None:
    """Make ``owner.method`` die with Crash until ``monkeypatch.undo()``."""

    def crash(*args: object, **kwargs: object) -> None:
        raise Crash

    monkeypatch.setattr(owner, method, crash)


def _orders(source: SourceDb, rows: int = 6000) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' || g FROM generate_series(1, %s) g", (rows,))


def test_crash_mid_snapshot_resumes_without_loss_or_duplicates(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some chunks commit, the process dies (the export is lost), rows move pages, the rerun converges."""
    _orders(source)
    config = source.config(["public.orders"], snapshot={"chunk_pages": 4, "parallelism": 1})
    first = source.pipeline(config)
    crash_writing_chunks_from(monkeypatch, 2)
    with pytest.raises(Crash):
        first.snapshot()
    monkeypatch.undo()
    chunks = first.store.chunks("public.orders")
    assert [c.index for c in chunks if c.done] == [0, 1]
    assert len(chunks) > 2
    # Updates move rows to new pages, possibly into chunks not read yet: they would be read twice.
    source.execute("UPDATE public.orders SET v = v || '!' WHERE id % 3 = 0")
    source.execute("DELETE FROM public.orders WHERE id % 10 = 0")
    second = source.pipeline(config)
    results = second.snapshot()
    assert results["public.orders"].read_modes == {"repeatable_read"}
    assert results["public.orders"].complete
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
    from pg2iceberg_dagster.cleanup import collect_garbage

    assert collect_garbage(pipeline.config, pipeline.store).files_deleted >= 1


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
    """Export lost mid-snapshot; an update that leaves a TOASTed column alone moves its row into a chunk
    already read, so no chunk reads it and the WAL update lacks that column: it must come from the source.

    Found by the soak (seed 1): the column arrived in Iceberg as NULL.
    """
    source.execute("CREATE TABLE public.docs (id int PRIMARY KEY, n int, body text)")
    source.execute("ALTER TABLE public.docs ALTER COLUMN body SET STORAGE EXTERNAL")
    source.execute("ALTER TABLE public.docs SET (autovacuum_enabled = off)")
    source.execute("INSERT INTO public.docs SELECT g, 0, repeat(md5(g::text), 100) FROM generate_series(1, 2000) g")
    config = source.config(["public.docs"], snapshot={"chunk_pages": 4, "parallelism": 1})
    first = source.pipeline(config)
    crash_writing_chunks_from(monkeypatch, 1)
    with pytest.raises(Crash):
        first.snapshot()
    monkeypatch.undo()
    chunks = first.store.chunks("public.docs")
    boundary = min(c.start_page for c in chunks if not c.done)
    assert all(c.done == (c.start_page < boundary) for c in chunks)
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
    second = source.pipeline(config)
    assert second.snapshot()["public.docs"].read_modes == {"repeatable_read"}
    sync(second)
    assert_mirrored(second)


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
