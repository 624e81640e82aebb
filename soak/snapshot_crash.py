"""The snapshot-crash soak: a large busy table, ``snapshot`` and its holder killed again and again.

Per seed: a fresh database with ``public.busy`` (see :mod:`soak.busy`) of ``busy_rows`` rows in small
CTID chunks, and writes that never stop while the snapshot runs: non-HOT updates that move rows into
chunks read earlier, key changes, updates that leave a TOASTed column out of the WAL, deletes and
re-inserts of one key. ``snapshot`` runs as a child process and is SIGKILLed at random moments (or
dies at an armed crash point) several times; in some seeds the soak runs the snapshot holder itself
and kills it too, so the exported snapshot is lost and the table starts again in a new epoch. Then
the writes stop, the pipeline catches up, and the table is compared with the source row by row.
"""

from __future__ import annotations

import random
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import yaml
from psycopg import sql

from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.pipeline import Pipeline

from .busy import BusyTable
from .runner import ChildProcess, Cluster, ScenarioResult, divergences_of, write_config

SNAPSHOT_CRASH_POINTS = ["snapshot.mid_chunk", "snapshot.after_chunk_commit"]


@dataclass
class SnapshotCrashProfile:
    """How big a snapshot-crash scenario is."""

    busy_rows: int = 300_000
    chunk_pages: tuple[int, ...] = (8, 16, 32)
    kills: tuple[int, int] = (2, 6)  # snapshot deaths per seed, at least and at most
    holder_kill_rate: float = 0.5  # seeds where the soak owns the holder and kills it once


class SnapshotCrashScenario:
    """Runs one seed against ``cluster``; ``spark`` is the session used for the final merges."""

    def __init__(self, cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: SnapshotCrashProfile) -> None:
        self.cluster = cluster
        self.seed = seed
        self.spark = spark
        self.profile = profile
        self.name = f"snapcrash{seed}_{uuid.uuid4().hex[:6]}"
        self.directory = workdir / self.name
        self.directory.mkdir(parents=True)
        self.log = self.directory / "processes.log"
        self.result = ScenarioResult(seed)
        self.rng = random.Random(seed)
        self.busy: BusyTable | None = None
        self.config_path = self.directory / "pg2iceberg.yaml"

    def run(self) -> ScenarioResult:
        started = time.monotonic()
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        busy = self.busy = BusyTable(self.cluster.conninfo(self.name), self.seed, self.profile.busy_rows)
        try:
            busy.create()
            write_config(self.cluster, self.name, ["public.busy"], self.directory)
            data = yaml.safe_load(self.config_path.read_text())
            data["snapshot"] = {"chunk_pages": self.rng.choice(self.profile.chunk_pages), "parallelism": 2}
            self.config_path.write_text(yaml.safe_dump(data))
            self._snapshot_under_writes()
            self._catch_up_and_verify()
        except Exception as exc:  # the report names the seed; the log file has the processes' output
            self.result.error = f"{type(exc).__name__}: {exc} (log: {self.log})"
        finally:
            busy.close()
            self._drop_database_sessions()
        self.result.transactions = busy.kinds
        self.result.seconds = time.monotonic() - started
        return self.result

    def _snapshot_under_writes(self) -> None:
        busy = self.busy
        assert busy is not None
        stop = threading.Event()
        failure: list[BaseException] = []

        def write() -> None:
            try:
                while not stop.is_set():
                    busy.step()
                    time.sleep(0.002)  # a busy application, not a benchmark: the snapshot gets its share
            except BaseException as exc:
                failure.append(exc)

        writer = threading.Thread(target=write, name="busy-writes")
        writer.start()
        try:
            self._kill_snapshots()
            self._finish_snapshot()
        finally:
            stop.set()
            writer.join()
        if failure:
            raise RuntimeError(f"the workload failed: {failure[0]}")

    def _kill_snapshots(self) -> None:
        """Start ``snapshot`` and kill it (SIGKILL, or an armed crash point) again and again, each time
        after a few more chunks are done; in some seeds also kill the holder the soak started."""
        holder = None
        kills = self.rng.randint(*self.profile.kills)
        if self.rng.random() < self.profile.holder_kill_rate:
            holder = ChildProcess(self.config_path, ["hold-snapshot"], None, self.log)
        holder_dies_after = self.rng.randint(1, min(kills, 2))
        for number in range(1, kills + 1):
            armed = None
            if self.rng.random() < 0.3:
                armed = f"{self.rng.choice(SNAPSHOT_CRASH_POINTS)}:{self.rng.randint(1, 3)}"
            before = self._chunks_done()
            child = ChildProcess(self.config_path, ["snapshot"], armed, self.log)
            more = self.rng.randint(0, 3)  # 0: killed before any chunk of this run is done
            deadline = time.monotonic() + 30
            while child.alive() and time.monotonic() < deadline and self._chunks_done() < before + more:
                time.sleep(0.05)
            if child.alive():
                child.kill()
            code = child.wait(600)
            if code == 0:
                self.result.armed_not_reached["snapshot.kill"] += 1
                return  # it finished before the kill
            if code != -signal.SIGKILL:
                raise RuntimeError(f"snapshot exited with {code}, expected 0 or SIGKILL")
            self.result.faults["snapshot." + (armed.split(":")[0].split(".")[1] if armed else "kill")] += 1
            self.result.restarts += 1
            if holder is not None and number == holder_dies_after:
                if holder.alive():
                    holder.kill()
                    self.result.faults["holder.kill"] += 1
                holder.wait(60)

    def _chunks_done(self) -> int:
        with psycopg.connect(self.cluster.conninfo(self.name), autocommit=True) as conn:
            if not self._coordination_exists(conn):
                return 0
            row = conn.execute("SELECT count(*) FROM _pg2iceberg.snapshot_progress WHERE status = 'done'").fetchone()
        return int(row[0]) if row else 0

    @staticmethod
    def _coordination_exists(conn: psycopg.Connection) -> bool:
        row = conn.execute("SELECT to_regclass('_pg2iceberg.snapshot_progress') IS NOT NULL").fetchone()
        return bool(row and row[0])

    def _finish_snapshot(self) -> None:
        for _ in range(3):  # a run whose holder was lost mid-read says so and exits 1: run it again
            if ChildProcess(self.config_path, ["snapshot"], None, self.log).wait(1800) == 0:
                return
        raise RuntimeError("snapshot did not complete after restarts")

    def _catch_up_and_verify(self) -> None:
        with Pipeline(load_config(str(self.config_path)), spark_factory=lambda: self.spark) as pipeline:
            epochs = {chunk.epoch for chunk in pipeline.store.chunks("public.busy")}
            if len(epochs) != 1:
                raise RuntimeError(f"the table's chunks are of several snapshot epochs: {sorted(epochs)}")
            self.result.epoch_restarts += epochs.pop() or 0
            pipeline.stream(until_caught_up=True)
            pipeline.materialize()
            self.result.divergences.extend(divergences_of(pipeline.verify()))

    def _drop_database_sessions(self) -> None:
        """End what this seed left: a holder still waiting, the slot."""
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (self.name,))
            time.sleep(0.2)
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                (self.name,),
            )


def run_snapshot_crash_scenario(
    cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: SnapshotCrashProfile | None = None
) -> ScenarioResult:
    """Run one snapshot-crash seed end to end (divergences empty when the mirror is exact)."""
    return SnapshotCrashScenario(cluster, workdir, seed, spark, profile or SnapshotCrashProfile()).run()
