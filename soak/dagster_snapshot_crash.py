"""The Dagster snapshot-crash soak: chunk runs of a busy table killed while other chunk runs go on.

Per seed: the busy table of :mod:`soak.busy` with writes that never stop, its chunk partitions planned
by the planner sensor, then rounds of two concurrent ``dagster asset materialize --partition-range``
runs over different chunks, one of them SIGKILLed after a few more chunks are done while the other
goes on; in some rounds the holder's sessions are ended too (its exported snapshot is lost: a new
epoch). Then the chunks are run to completion as the deployment would (the planner's ranged run of
every chunk not done in the current epoch), the writes stop, the pipeline catches up, and the table
is compared row by row.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter, SensorResult, build_sensor_context
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from pg2iceberg_dagster.dagster_integration import Pg2IcebergResource, build_definitions

from .busy import APPLICATION_NAME, TABLE, BusyTable
from .busy_scenario import BusyTableScenario
from .runner import Cluster, ScenarioResult

REPO = Path(__file__).resolve().parent.parent
DAGSTER = Path(sys.executable).parent / "dagster"


@dataclass
class DagsterSnapshotCrashProfile:
    """How big a Dagster snapshot-crash scenario is."""

    busy_rows: int = 100_000
    chunk_pages: tuple[int, ...] = (16, 32)
    rounds: tuple[int, int] = (1, 3)
    holder_loss_rate: float = 0.4  # per round


class DagsterSnapshotCrashScenario(BusyTableScenario):
    name_prefix = "dagcrash"
    parallelism = 1

    def __init__(
        self, cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: DagsterSnapshotCrashProfile
    ) -> None:
        super().__init__(cluster, workdir, seed, spark, profile.busy_rows, profile.chunk_pages)
        self.profile = profile
        self.home = self.directory / "dagster_home"
        self.home.mkdir()
        (self.home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")

    def exercise(self, busy: BusyTable) -> None:
        self.defs = build_definitions(str(self.config_path))
        self.snapshot_key = next(
            key for key in self.defs.resolve_asset_graph().get_all_asset_keys() if key.path[-1] == "busy_snapshot"
        )
        self.keys = self._plan()

        def rounds_then_completion() -> None:
            for _ in range(self.rng.randint(*self.profile.rounds)):
                self._round()
            self._run_to_completion()

        self.under_writes(busy, rounds_then_completion)

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
        with self.log.open("ab") as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                [*command, "--select", "/".join(self.snapshot_key.path), "--partition-range", f"{first}...{last}"],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                # Its own process group: the run's step runs in a child process (the multiprocess
                # executor), and a kill must take both, as when the run's host dies. The holder a run
                # starts is in a session of its own and survives, as it would.
                start_new_session=True,
            )

    def _round(self) -> None:
        """Two chunk runs over different halves at once; one is killed after a few more chunks."""
        split = self.rng.randint(1, len(self.keys) - 1)
        halves = [(self.keys[0], self.keys[split - 1]), (self.keys[split], self.keys[-1])]
        before = self.chunks_done()
        runs = [self._materialize(*half) for half in halves]
        victim = self.rng.choice(runs)
        more = self.rng.randint(0, 3)
        deadline = time.monotonic() + 120
        while victim.poll() is None and time.monotonic() < deadline and self.chunks_done() < before + more:
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
        """What the deployment does: the planner's ranged run of the chunks not done in the current epoch."""
        for _ in range(4):
            if self._complete():
                return
            with DagsterInstance.from_config(str(self.home)) as instance:
                # The killed runs' processes are gone, their runs still "started": say so, as a deployment's
                # run monitoring does, or the planner waits for them.
                for run in instance.get_runs(filters=RunsFilter(statuses=[DagsterRunStatus.STARTED])):
                    instance.report_run_failed(run, "its process was killed")
                requests = self._planner_tick(instance).run_requests
            for request in requests:
                self.result.faults["planner.chunk_run"] += 1
                first, last = request.tags[ASSET_PARTITION_RANGE_START_TAG], request.tags[ASSET_PARTITION_RANGE_END_TAG]
                self._materialize(first, last).wait(1800)
        if not self._complete():
            raise RuntimeError("the snapshot did not complete through Dagster runs")

    def _complete(self) -> bool:
        with self.pipeline() as pipeline:
            state = pipeline.store.table_state(TABLE)
            return bool(state and state.snapshot_complete)


def run_dagster_snapshot_crash_scenario(
    cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: DagsterSnapshotCrashProfile | None = None
) -> ScenarioResult:
    """Run one Dagster snapshot-crash seed end to end (divergences empty when the mirror is exact)."""
    return DagsterSnapshotCrashScenario(cluster, workdir, seed, spark, profile or DagsterSnapshotCrashProfile()).run()
