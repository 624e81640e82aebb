"""Dagster runs and sensor ticks killed mid-way (real SIGKILL at an armed crash point), then rerun.

Runs go through the ``dagster`` command line in their own processes, as a deployment would launch
them; after each death the rerun must converge with nothing lost or duplicated.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterInstance, Definitions, SensorResult, build_sensor_context
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.dagster_integration import Pg2IcebergResource, build_definitions
from pg2iceberg_dagster.faults import CRASH_ENV
from soak.busy import APPLICATION_NAME, BusyTable

from .conftest import SourceDb, assert_mirrored

pytestmark = pytest.mark.usefixtures("spark")
REPO = Path(__file__).resolve().parent.parent
DAGSTER = Path(sys.executable).parent / "dagster"


def _dagster_process(args: list[str], config_path: str, home: Path, crash_at: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env.update({"PG2ICEBERG_CONFIG": config_path, "DAGSTER_HOME": str(home)})
    if crash_at:
        env[CRASH_ENV] = crash_at
    return subprocess.Popen(
        [str(DAGSTER), *args, "-m", "definitions"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def _dagster(args: list[str], config_path: str, home: Path, crash_at: str | None = None) -> subprocess.CompletedProcess:
    process = _dagster_process(args, config_path, home, crash_at)
    stdout, stderr = process.communicate(timeout=900)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@dataclass
class Deployment:
    """A pipeline config file and a Dagster home for one table, with its chunk partitions planned."""

    config: PipelineConfig
    config_path: Path
    home: Path
    defs: Definitions
    snapshot_key: AssetKey
    chunk_keys: list[str]


def _deploy(source: SourceDb, tmp_path: Path, table: str, chunk_pages: int) -> Deployment:
    config = source.config([f"public.{table}"], snapshot={"chunk_pages": chunk_pages, "parallelism": 1})
    config_path = tmp_path / "pg2iceberg.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    defs = build_definitions(str(config_path))
    snapshot_key = AssetKey(["iceberg", f"{source.name}_public", f"{table}_snapshot"])
    with DagsterInstance.from_config(str(home)) as instance:
        planned = _planner_tick(defs, instance, config_path)
        for request in planned.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        keys = defs.resolve_assets_def(snapshot_key).partitions_def.get_partition_keys(
            dynamic_partitions_store=instance
        )
    return Deployment(config, config_path, home, defs, snapshot_key, list(keys))


def _planner_tick(defs: Definitions, instance: DagsterInstance, config_path: Path) -> SensorResult:
    planner = defs.resolve_sensor_def("pg2iceberg_snapshot_planner")
    with build_sensor_context(
        instance=instance, resources={"pg2iceberg": Pg2IcebergResource(config_path=str(config_path))}
    ) as context:
        planned = planner(context)
    assert isinstance(planned, SensorResult)
    return planned


def test_killed_snapshot_run_merge_run_and_flusher_tick_converge(source: SourceDb, tmp_path: Path) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' || g FROM generate_series(1, 3000) g")
    deployment = _deploy(source, tmp_path, "orders", 8)
    config, config_path, home, keys = deployment.config, deployment.config_path, deployment.home, deployment.chunk_keys
    snapshot_key = deployment.snapshot_key
    live = "/".join(["iceberg", f"{source.name}_public", "orders"])
    assert len(keys) >= 2
    select = "/".join(snapshot_key.path)

    # A chunk run dies after its Iceberg commit, before the chunk is recorded as done.
    source.execute("UPDATE public.orders SET v = 'during snapshot' WHERE id <= 10")
    died = _dagster(
        ["asset", "materialize", "--select", select, "--partition", keys[0]],
        str(config_path),
        home,
        "snapshot.after_chunk_commit",
    )
    assert died.returncode != 0
    pipeline = source.pipeline(config)
    assert not pipeline.store.chunks("public.orders")[0].done
    for key in keys:
        ran = _dagster(["asset", "materialize", "--select", select, "--partition", key], str(config_path), home)
        assert ran.returncode == 0, ran.stderr[-3000:]
    assert pipeline.store.table_state("public.orders").snapshot_complete

    # A flusher sensor tick dies after registering staged files, before acknowledging the slot.
    source.execute(
        "UPDATE public.orders SET v = 'streamed' WHERE id % 5 = 0; DELETE FROM public.orders WHERE id > 2900"
    )
    tick = _dagster(["sensor", "preview", "pg2iceberg_flusher"], str(config_path), home, "flusher.after_register")
    # The tick ran in a code server process; the CLI reports its death as a lost gRPC peer.
    assert "_InactiveRpcError" in tick.stdout + tick.stderr, tick.stdout[-2000:]
    head = pipeline.store.log_head("public.orders")
    assert head > 0, "the killed tick registered its files"
    source.execute("INSERT INTO public.orders VALUES (5001, 'after the killed tick')")
    tick = _dagster(["sensor", "preview", "pg2iceberg_flusher"], str(config_path), home)
    assert tick.returncode == 0, tick.stderr[-3000:]
    assert pipeline.store.log_head("public.orders") == head + 1, "the registered transaction was staged twice"

    # A merge run dies after its Iceberg commit, before mat_cursor moves; the rerun replays the batch.
    died = _dagster(["asset", "materialize", "--select", live], str(config_path), home, "materializer.after_commit")
    assert died.returncode != 0
    assert pipeline.store.mat_cursor("default", "public.orders") == 0
    ran = _dagster(["asset", "materialize", "--select", live], str(config_path), home)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert_mirrored(pipeline)


def test_chunk_runs_killed_and_holder_lost_under_busy_writes_converge(source: SourceDb, tmp_path: Path) -> None:
    """Busy writes throughout. Two chunk runs at once: one is SIGKILLed after its Iceberg commit while
    the other goes on under the same exported snapshot. Then the holder's sessions die: the next chunk
    run starts the table again in a new epoch, the planner sensor requests one run of every chunk not
    done in it (those Dagster shows materialized from the lost one included), and it converges."""
    setup = BusyTable(source.conninfo, 21, 30_000)
    setup.create()
    setup.close()
    deployment = _deploy(source, tmp_path, "busy", 16)
    config, config_path, home, keys = deployment.config, deployment.config_path, deployment.home, deployment.chunk_keys
    select = "/".join(deployment.snapshot_key.path)
    assert len(keys) >= 6
    busy = BusyTable(source.conninfo, 21, 30_000)
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            busy.step()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        killed = _dagster_process(
            ["asset", "materialize", "--select", select, "--partition", keys[0]],
            str(config_path),
            home,
            "snapshot.after_chunk_commit",
        )
        goes_on = _dagster_process(
            ["asset", "materialize", "--select", select, "--partition-range", f"{keys[1]}...{keys[2]}"],
            str(config_path),
            home,
        )
        assert killed.wait(600) != 0
        assert goes_on.wait(600) == 0, goes_on.communicate()[1][-3000:]
        chunks = source.pipeline(config).store.chunks("public.busy")
        # The killed chunk is in Iceberg, unrecorded: recorded by its marker if the other run entered the epoch
        # after the kill (its rows unknown: 0), else still pending. Nothing else is done.
        killed_chunk = chunks[0]
        assert not killed_chunk.done or killed_chunk.rows == 0, killed_chunk
        assert [c.done for c in chunks[1:3]] == [True, True] and {c.epoch for c in chunks if c.done} == {0}
        assert not any(c.done for c in chunks[3:])

        # The holder's sessions end (as when its host dies): its exported snapshot is gone.
        source.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
            "AND application_name <> %s",
            (source.name, APPLICATION_NAME),
        )
        ran = _dagster(["asset", "materialize", "--select", select, "--partition", keys[3]], str(config_path), home)
        assert ran.returncode == 0, ran.stderr[-3000:]
        chunks = source.pipeline(config).store.chunks("public.busy")
        assert [c.index for c in chunks if c.done] == [3] and chunks[3].epoch == 1

        # The planner asks for every chunk but 3 (1 and 2 too, though Dagster shows them materialized),
        # as one ranged run of the new epoch.
        with DagsterInstance.from_config(str(home)) as instance:
            planned = _planner_tick(deployment.defs, instance, config_path)
        (request,) = planned.run_requests
        tags = request.tags
        assert (tags[ASSET_PARTITION_RANGE_START_TAG], tags[ASSET_PARTITION_RANGE_END_TAG]) == (keys[0], keys[-1])
        assert request.run_key and "epoch-1" in request.run_key
        ran = _dagster(
            ["asset", "materialize", "--select", select, "--partition-range", f"{keys[0]}...{keys[-1]}"],
            str(config_path),
            home,
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
    finally:
        stop.set()
        writer.join()
        busy.close()
    pipeline = source.pipeline(config)
    state = pipeline.store.table_state("public.busy")
    assert state is not None and state.snapshot_complete and state.snapshot_epoch == 1
    pipeline.stream(until_caught_up=True)
    pipeline.materialize()
    assert_mirrored(pipeline)
