"""The Dagster snapshot-crash soak: chunk runs of a busy table killed while other chunk runs go on.

Per seed: the busy table of :mod:`soak.busy` with writes that never stop, its chunk partitions planned
by the planner sensor, then rounds of two concurrent ``dagster asset materialize --partition-range``
runs over different chunks, one of them SIGKILLed after a few more chunks are done while the other
goes on; in some rounds the holder's sessions are ended too (its exported snapshot is lost: a new
epoch). Then the chunks are run to completion as the deployment would (the planner's ranged rerun
plus the missing ones), the writes stop, the pipeline catches up, and the table is compared row by row.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import yaml
from dagster import DagsterInstance, SensorResult, build_sensor_context
from psycopg import sql

from definitions import build_definitions
from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.pipeline import Pipeline
from resources import Pg2IcebergResource

from .busy import APPLICATION_NAME, BusyTable
from .runner import Cluster, ScenarioResult, divergences_of, write_config

REPO = Path(__file__).resolve().parent.parent
DAGSTER = Path(sys.executable).parent / "dagster"


@dataclass
class DagsterSnapshotCrashProfile:
    """How big a Dagster snapshot-crash scenario is."""

    busy_rows: int = 100_000
    chunk_pages: tuple[int, ...] = (16, 32)
    rounds: tuple[int, int] = (1, 3)
    holder_loss_rate: float = 0.4  # per round


class DagsterSnapshotCrashScenario:
    def __init__(
        self, cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: DagsterSnapshotCrashProfile
    ) -> None:
        self.cluster = cluster
        self.seed = seed
        self.spark = spark
        self.profile = profile
        self.rng = random.Random(seed)
        self.name = f"dagcrash{seed}_{uuid.uuid4().hex[:6]}"
        self.directory = workdir / self.name
        self.directory.mkdir(parents=True)
        self.home = self.directory / "dagster_home"
        self.home.mkdir()
        (self.home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        self.log = (self.directory / "processes.log").open("ab")
        self.config_path = self.directory / "pg2iceberg.yaml"
        self.result = ScenarioResult(seed)

    def run(self) -> ScenarioResult:
        started = time.monotonic()
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        busy = BusyTable(self.cluster.conninfo(self.name), self.seed, self.profile.busy_rows)
        try:
            busy.create()
            write_config(self.cluster, self.name, ["public.busy"], self.directory)
            data = yaml.safe_load(self.config_path.read_text())
            data["snapshot"] = {"chunk_pages": self.rng.choice(self.profile.chunk_pages), "parallelism": 1}
            self.config_path.write_text(yaml.safe_dump(data))
            self.defs = build_definitions(str(self.config_path))
            self.snapshot_key = next(
                key for key in self.defs.resolve_asset_graph().get_all_asset_keys() if key.path[-1] == "busy_snapshot"
            )
            self.keys = self._plan()
            self._chunk_runs_under_writes(busy)
            self._catch_up_and_verify()
        except Exception as exc:  # the report names the seed; the log file has the processes' output
            self.result.error = f"{type(exc).__name__}: {exc} (log: {self.log.name})"
        finally:
            busy.close()
            self.log.close()
            self._drop_database_sessions()
        self.result.transactions = busy.kinds
        self.result.seconds = time.monotonic() - started
        return self.result

    def _planner_tick(self, instance: DagsterInstance) -> SensorResult:
        """One tick of the planner sensor (an empty result when it skipped)."""
        planner = self.defs.resolve_sensor_def("pg2iceberg_snapshot_planner")
        resources = {"pg2iceberg": Pg2IcebergResource(config_path=str(self.config_path))}
        with build_sensor_context(instance=instance, resources=resources) as context:
            planned = planner(context)
        return planned if isinstance(planned, SensorResult) else SensorResult()

    def _plan(self) -> list[str]:
        with DagsterInstance.from_config(str(self.home)) as instance:
            for request in self._planner_tick(instance).dynamic_partitions_requests:
                instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
            partitions = self.defs.resolve_assets_def(self.snapshot_key).partitions_def
            return list(partitions.get_partition_keys(dynamic_partitions_store=instance))

    def _materialize(self, first: str, last: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PG2ICEBERG_CONFIG": str(self.config_path), "DAGSTER_HOME": str(self.home)}
        command = [str(DAGSTER), "asset", "materialize", "-m", "definitions"]
        return subprocess.Popen(
            [*command, "--select", "/".join(self.snapshot_key.path), "--partition-range", f"{first}...{last}"],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            # Its own process group: the run's step runs in a child process (the multiprocess
            # executor), and a kill must take both, as when the run's host dies. The holder a run
            # starts is in a session of its own and survives, as it would.
            start_new_session=True,
        )

    def _chunks_done(self) -> int:
        with psycopg.connect(self.cluster.conninfo(self.name), autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM _pg2iceberg.snapshot_progress WHERE status = 'done'").fetchone()
        return int(row[0]) if row else 0

    def _chunk_runs_under_writes(self, busy: BusyTable) -> None:
        stop = threading.Event()
        failure: list[BaseException] = []

        def write() -> None:
            try:
                while not stop.is_set():
                    busy.step()
                    time.sleep(0.002)
            except BaseException as exc:
                failure.append(exc)

        writer = threading.Thread(target=write, name="busy-writes")
        writer.start()
        try:
            for _ in range(self.rng.randint(*self.profile.rounds)):
                self._round()
            self._run_to_completion()
        finally:
            stop.set()
            writer.join()
        if failure:
            raise RuntimeError(f"the workload failed: {failure[0]}")

    def _round(self) -> None:
        """Two chunk runs over different halves at once; one is killed after a few more chunks."""
        split = self.rng.randint(1, len(self.keys) - 1)
        halves = [(self.keys[0], self.keys[split - 1]), (self.keys[split], self.keys[-1])]
        before = self._chunks_done()
        runs = [self._materialize(*half) for half in halves]
        victim = self.rng.choice(runs)
        more = self.rng.randint(0, 3)
        deadline = time.monotonic() + 120
        while victim.poll() is None and time.monotonic() < deadline and self._chunks_done() < before + more:
            time.sleep(0.05)
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            self.result.faults["chunk_run.kill"] += 1
            self.result.restarts += 1
        for run in runs:
            run.wait(900)
        if self.rng.random() < self.profile.holder_loss_rate:
            # The holder's sessions end, as when its host dies: its exported snapshot is gone.
            with psycopg.connect(self.cluster.conninfo(self.name), autocommit=True) as conn:
                ended = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s "
                    "AND pid <> pg_backend_pid() AND application_name <> %s",
                    (self.name, APPLICATION_NAME),
                ).fetchone()
            if ended and ended[0]:
                self.result.faults["holder.sessions_ended"] += 1

    def _run_to_completion(self) -> None:
        """What the deployment does: the planner's ranged rerun of chunks to read again, and the rest."""
        for _ in range(4):
            with DagsterInstance.from_config(str(self.home)) as instance:
                planned = self._planner_tick(instance)
            if planned.run_requests:
                self.result.faults["planner.read_again"] += 1
            if self._materialize(self.keys[0], self.keys[-1]).wait(1800) == 0 and self._complete():
                return
        raise RuntimeError("the snapshot did not complete through Dagster runs")

    def _complete(self) -> bool:
        with Pipeline(load_config(str(self.config_path)), spark_factory=lambda: self.spark) as pipeline:
            state = pipeline.store.table_state("public.busy")
            return bool(state and state.snapshot_complete)

    def _catch_up_and_verify(self) -> None:
        with Pipeline(load_config(str(self.config_path)), spark_factory=lambda: self.spark) as pipeline:
            state = pipeline.store.table_state("public.busy")
            self.result.epoch_restarts += (state.snapshot_epoch or 0) if state else 0
            pipeline.stream(until_caught_up=True)
            pipeline.materialize()
            self.result.divergences.extend(divergences_of(pipeline.verify()))

    def _drop_database_sessions(self) -> None:
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (self.name,))
            time.sleep(0.2)
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                (self.name,),
            )


def run_dagster_snapshot_crash_scenario(
    cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: DagsterSnapshotCrashProfile | None = None
) -> ScenarioResult:
    """Run one Dagster snapshot-crash seed end to end (divergences empty when the mirror is exact)."""
    return DagsterSnapshotCrashScenario(cluster, workdir, seed, spark, profile or DagsterSnapshotCrashProfile()).run()
