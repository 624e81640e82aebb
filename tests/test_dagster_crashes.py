"""Dagster runs and sensor ticks killed mid-way (real SIGKILL at an armed crash point), then rerun.

Runs go through the ``dagster`` command line in their own processes, as a deployment would launch
them; after each death the rerun must converge with nothing lost or duplicated.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterInstance, SensorResult, build_sensor_context

from definitions import build_definitions
from pg2iceberg_dagster.faults import CRASH_ENV
from resources import Pg2IcebergResource, SparkResource

from .conftest import SourceDb, assert_mirrored

pytestmark = pytest.mark.usefixtures("spark")
REPO = Path(__file__).resolve().parent.parent
DAGSTER = Path(sys.executable).parent / "dagster"


def _dagster(args: list[str], config_path: str, home: Path, crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env.update({"PG2ICEBERG_CONFIG": config_path, "DAGSTER_HOME": str(home)})
    if crash_at:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [str(DAGSTER), *args, "-m", "definitions"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )


def test_killed_snapshot_run_merge_run_and_flusher_tick_converge(source: SourceDb, tmp_path: Path) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' || g FROM generate_series(1, 3000) g")
    config = source.config(["public.orders"], snapshot={"chunk_pages": 8, "parallelism": 1})
    config_path = tmp_path / "pg2iceberg.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    defs = build_definitions(str(config_path))
    snapshot_key = AssetKey(["iceberg", f"{source.name}_public", "orders_snapshot"])
    live = "/".join(["iceberg", f"{source.name}_public", "orders"])
    pg2iceberg = Pg2IcebergResource(config_path=str(config_path))
    resources = {"pg2iceberg": pg2iceberg, "spark": SparkResource(pg2iceberg=pg2iceberg)}
    with DagsterInstance.from_config(str(home)) as instance:
        planner = defs.resolve_sensor_def("pg2iceberg_snapshot_planner")
        with build_sensor_context(instance=instance, resources=resources) as context:
            planned = planner(context)
        assert isinstance(planned, SensorResult)
        for request in planned.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        keys = defs.resolve_assets_def(snapshot_key).partitions_def.get_partition_keys(
            dynamic_partitions_store=instance
        )
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
