"""The CI set of the soak: 12 seeded workloads with real process deaths (three of them also lose the
replication slot while the mirror is down, repaired by the next ``stream``), and 3 seeds of snapshot
crashes on a busy table, each ending exact (more seeds run by ``python -m soak``).

Each seed runs ``soak.runner``: the snapshot, stream and (for some seeds) materialize commands in
child processes that die by SIGKILL at armed crash points or from outside at random moments, are
restarted, catch up, and then every table is compared row by row. The long run is ``python -m soak``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pg2iceberg_dagster.embedded import EmbeddedPostgres
from soak.runner import SLOT_FAULTS, Cluster, Profile, planned_slot_fault, run_scenario
from soak.snapshot_crash import SnapshotCrashProfile, run_snapshot_crash_scenario

from .conftest import CATALOG_DB

CI_SEEDS = range(1, 13)
CI_PROFILE = Profile(initial_rows=200, snapshot_writes=10, stream_writes=40, big_rows=3000, materialize_fault_rate=0.25)
# Seed 2 kills the soak-owned holder, so its table starts again in a new epoch.
CI_SNAPSHOT_CRASH_SEEDS = range(1, 4)
CI_SNAPSHOT_CRASH_PROFILE = SnapshotCrashProfile(busy_rows=60_000, chunk_pages=(8, 16), kills=(2, 3))


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_seeded_workload_with_crashes_ends_exact(seed: int, pg: EmbeddedPostgres, workdir: Path, spark: Any) -> None:
    cluster = Cluster("127.0.0.1", pg.port, CATALOG_DB, workdir / "warehouse")
    result = run_scenario(cluster, workdir / "soak", seed, spark, CI_PROFILE)
    assert result.error is None, result.error
    assert not result.divergences, json.dumps(result.divergences, indent=1)
    assert sum(result.faults.values()) >= 1, "every seed must kill at least one process"
    lost = {fault: count for fault, count in result.faults.items() if fault in SLOT_FAULTS}
    planned = planned_slot_fault(seed, CI_PROFILE)
    assert lost == ({planned: 1} if planned else {}), "the slot is lost (and repaired) as the seed plans"


def test_the_ci_seeds_lose_the_slot_both_ways() -> None:
    """Among the CI seeds, some drop the slot and some have it invalidated; most lose it not at all."""
    planned = [planned_slot_fault(seed, CI_PROFILE) for seed in CI_SEEDS]
    assert set(planned) == {None, *SLOT_FAULTS} and planned.count(None) > len(planned) // 2


@pytest.mark.parametrize("seed", CI_SNAPSHOT_CRASH_SEEDS)
def test_snapshot_killed_under_busy_writes_ends_exact(
    seed: int, pg: EmbeddedPostgres, workdir: Path, spark: Any
) -> None:
    cluster = Cluster("127.0.0.1", pg.port, CATALOG_DB, workdir / "warehouse")
    result = run_snapshot_crash_scenario(cluster, workdir / "soak", seed, spark, CI_SNAPSHOT_CRASH_PROFILE)
    assert result.error is None, result.error
    assert not result.divergences, json.dumps(result.divergences, indent=1)
    assert result.restarts >= 1, "every seed must kill the snapshot at least once"
