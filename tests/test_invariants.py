"""Startup and runtime invariants once the pipeline has state: lost WAL, a table taken out of the
publication, snapshot state without a slot. Every entry point refuses, says what to do, writes nothing."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.errors import StartupCheckError
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.snapshot import holder
from pg2iceberg_dagster.snapshot.holder import hold_snapshot

from .conftest import SourceDb, config_on, footprint, snapshot_crashing_at_chunk


def _every_entry_point_refuses(source: SourceDb, config: PipelineConfig, match: str) -> None:
    """validate, snapshot, stream, materialize and verify each refuse with ``match`` and change nothing."""
    before = footprint(config)
    entry_points: dict[str, Callable[[Pipeline], object]] = {
        "validate": lambda p: p.validate(),
        "snapshot": lambda p: p.snapshot(),
        "stream": lambda p: p.stream(until_caught_up=True),
        "materialize": lambda p: p.materialize(),
        "verify": lambda p: p.verify(),
    }
    for name, call in entry_points.items():
        with pytest.raises(StartupCheckError, match=match):
            call(source.pipeline(config))  # a fresh process: nothing cached from earlier checks
        assert footprint(config) == before, f"{name} wrote something before refusing"


def _wal_status(cluster: EmbeddedPostgres, slot: str) -> str | None:
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        row = conn.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return row[0] if row else None


def test_lost_wal_is_refused_everywhere(source: SourceDb, make_cluster: Callable[..., EmbeddedPostgres]) -> None:
    """A slot whose WAL was removed (max_slot_wal_keep_size) can no longer deliver every change."""
    cluster = make_cluster(conf=["max_slot_wal_keep_size = 1MB", "wal_keep_size = 0"])
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO public.t SELECT g, 'v' FROM generate_series(1, 100) g")
    config = config_on(source, cluster, ["public.t"])
    source.pipeline(config).snapshot()
    assert _wal_status(cluster, config.replication.slot) == "reserved"

    # Nobody streams; WAL grows past max_slot_wal_keep_size and a checkpoint removes the slot's segments.
    deadline = time.monotonic() + 30
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        while _wal_status(cluster, config.replication.slot) != "lost":
            assert time.monotonic() < deadline, "the slot never lost its WAL"
            conn.execute("INSERT INTO public.t SELECT g, 'w' FROM generate_series(1000, 1100) g ON CONFLICT DO NOTHING")
            conn.execute("UPDATE public.t SET v = v || '.'")
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")

    _every_entry_point_refuses(source, config, r"has lost required WAL \(wal_status = lost\).*cleanup --all")
    assert source.pipeline(config).status()["slot"]["wal_status"] == "lost"  # status still reports, for operators


def test_table_removed_from_publication_is_refused(source: SourceDb) -> None:
    """Changes of a table outside the publication never reach the WAL stream: the mirror must stop and
    say that re-adding the table is not enough (what changed meanwhile was never decoded)."""
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text); CREATE TABLE public.u (id int PRIMARY KEY)")
    source.execute("INSERT INTO public.t VALUES (1, 'a'); INSERT INTO public.u VALUES (1)")
    config = source.config(["public.t", "public.u"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    source.execute("INSERT INTO public.t VALUES (2, 'b'); INSERT INTO public.u VALUES (2)")
    pipeline.stream(until_caught_up=True)
    assert pipeline.store.log_head("public.u") == 1

    source.execute(f"ALTER PUBLICATION {config.replication.publication} DROP TABLE public.u")
    source.execute("INSERT INTO public.u VALUES (3); INSERT INTO public.t VALUES (3, 'c')")
    _every_entry_point_refuses(
        source,
        config,
        rf"publication {config.replication.publication} no longer covers public\.u.*ADD TABLE public\.u.*"
        r"cleanup --table public\.u",
    )
    # The whole publication dropped: recreating it (create_publication) would hide the gap.
    source.execute(f"DROP PUBLICATION {config.replication.publication}")
    _every_entry_point_refuses(source, config, r"publication \S+ is gone but the pipeline already mirrors public\.t")
    assert footprint(config)["publication"] == []


def test_slot_dropped_mid_snapshot_is_refused(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some chunks are in Iceberg, then the slot disappears: resuming would read the rest at a later
    point with no WAL from the consistent point. No entry point may create a new slot and carry on."""
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.t SELECT g, repeat('x', 200) FROM generate_series(1, 3000) g")
    config = source.config(["public.t"], snapshot={"chunk_pages": 8, "parallelism": 1})

    snapshot_crashing_at_chunk(monkeypatch, source.pipeline(config), 1)
    source.drop_slot(config.replication.slot)
    state = footprint(config)
    assert state["_pg2iceberg.tables"] and any(
        '"status":"done"' in row for row in state["_pg2iceberg.snapshot_progress"]
    )
    _every_entry_point_refuses(source, config, r"replication slot \S+ is gone but the pipeline created it.*cleanup")
    assert footprint(config)["slot"] == [], "a new slot was created"


def test_chunks_read_without_a_slot_are_refused(
    source: SourceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dagster chunk runs import the snapshot of a holder process. When the holder cannot create the
    slot, a chunk run must not read anyway: nothing would replay the changes after its read."""
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.t SELECT g, 'v' FROM generate_series(1, 500) g")
    config = source.config(["public.t"])
    pipeline = source.pipeline(config)
    # The holder process dies at once, so no slot is created.
    pipeline.detached_holder = True
    monkeypatch.setattr(holder, "HOLDER_COMMAND", (sys.executable, "-c", "raise SystemExit('holder cannot start')"))
    runner = pipeline.snapshot_runner()
    chunk = runner.plan(pipeline.validate().tables["public.t"])[0]
    with pytest.raises(StartupCheckError, match=r"hold-snapshot.*stopped without one.*holder cannot start"):
        runner.run_partitions("public.t", [chunk.partition_key])
    state = footprint(config)
    assert state["slot"] == [] and not any('"status":"done"' in r for r in state["_pg2iceberg.snapshot_progress"])
    assert state[f"iceberg:{config.iceberg_identifier(config.tables[0])[0]}.t"] == [], "rows were committed"

    # State left by a chunk read without any slot (what the engine did before the check above): refused.
    pipeline.store.mark_chunk_done("public.t", chunk.index, 500, 0, None)
    _every_entry_point_refuses(
        source, config, r"public\.t.*read without a replication slot.*cleanup --table public\.t.*snapshot again"
    )
    with pytest.raises(StartupCheckError, match="read without a replication slot"):
        hold_snapshot(config, max_seconds=1)
    assert footprint(config)["slot"] == []


def test_no_free_replication_slot_is_a_clear_refusal(
    source: SourceDb, make_cluster: Callable[..., EmbeddedPostgres]
) -> None:
    """Every replication slot taken by others: the snapshot (whose holder creates the slot, in another
    process) says so and what to do, without a traceback, and the slot is made once one is free."""
    cluster = make_cluster(conf=["max_replication_slots = 1"])
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO public.t SELECT g, 'v' FROM generate_series(1, 100) g")
        conn.execute("SELECT pg_create_logical_replication_slot('somebody_else', 'pgoutput')")
    config = config_on(source, cluster, ["public.t"])
    with pytest.raises(StartupCheckError) as refused:
        source.pipeline(config).snapshot()
    message = str(refused.value)
    assert "cannot create replication slot" in message and "raise max_replication_slots" in message
    assert "Traceback" not in message
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('somebody_else')")
    assert source.pipeline(config).snapshot()["public.t"].rows == 100


def test_a_snapshot_waiting_on_an_open_transaction_says_which(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Creating the slot waits for every transaction open when it began (an idle-in-transaction
    session, say): the snapshot names the oldest ones while it waits, instead of hanging silently, and
    goes on once they end."""
    monkeypatch.setattr(holder, "SLOT_WAIT_REPORT_SECONDS", 0.5)
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    config = source.config(["public.t"])
    with psycopg.connect(source.conninfo) as open_transaction:
        open_transaction.execute("INSERT INTO public.t VALUES (1)")  # an xid, not committed
        pid = open_transaction.info.backend_pid
        results: list[object] = []
        thread = threading.Thread(target=lambda: results.append(source.pipeline(config).snapshot()))
        with caplog.at_level("WARNING", logger=holder.__name__):
            thread.start()
            deadline = time.monotonic() + 30
            while f"pid {pid} (postgres on {source.name}, idle in transaction" not in caplog.text:
                assert time.monotonic() < deadline and thread.is_alive(), caplog.text
                time.sleep(0.2)
        open_transaction.commit()
        thread.join(60)
    assert results and results[0]["public.t"].rows == 1  # type: ignore[index]


def test_a_standby_source_is_refused_before_anything_is_written(
    source: SourceDb, make_cluster: Callable[..., EmbeddedPostgres]
) -> None:
    """The read replica's address in the config, a common first mistake: a standby exports no
    snapshot and holds no coordination tables. Refused saying so (the coordination schema's CREATE
    failed as a read-only transaction before), and with state elsewhere too."""
    cluster = make_cluster()
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    cluster.stop()
    (cluster.data_dir / "standby.signal").touch()
    cluster.start()
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
    config = config_on(source, cluster, ["public.t"])
    with pytest.raises(StartupCheckError, match=r"is a standby \(in recovery, a read replica\).*primary"):
        source.pipeline(config).validate()
    with pytest.raises(StartupCheckError, match=r"is read-only \(a standby\?\).*point state: at one"):
        source.pipeline(config).status()
    elsewhere = config.model_copy(update={"state": source.config(["public.t"]).source})
    with pytest.raises(StartupCheckError, match=r"is a standby"):
        source.pipeline(elsewhere).validate()
