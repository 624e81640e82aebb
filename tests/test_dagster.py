"""The Dagster layer against real PostgreSQL, Spark and Iceberg: definitions from the config, CTID
snapshot partitions under one exported snapshot and the planner's runs of them, the flusher sensor,
the merge sensor, and checks."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml
from dagster import (
    AddDynamicPartitionsRequest,
    AssetKey,
    AssetMaterialization,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DefaultSensorStatus,
    Definitions,
    RunRequest,
    SensorResult,
    SkipReason,
    build_sensor_context,
    instance_for_test,
    materialize,
)
from dagster._core.events import DagsterEvent, StepMaterializationData
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from pg2iceberg_dagster.dagster_integration import Pg2IcebergResource, SparkResource, build_definitions
from pg2iceberg_dagster.dagster_integration.assets import FILES_COMPACT, MATCHES_SOURCE, PK_UNIQUE, SCHEMA_MATCHES
from pg2iceberg_dagster.dagster_integration.mirror import CHECKED_RUN_TAG, MIRROR_RUN_TAG, TABLES_RUN_TAG, table_run_tag
from pg2iceberg_dagster.dagster_integration.sensors import merge as merge_sensors
from pg2iceberg_dagster.snapshot.holder import holder_lock_key

from .conftest import SourceDb, assert_mirrored

pytestmark = pytest.mark.usefixtures("spark")


def _write_config(source: SourceDb, tmp_path: Path, tables: list[str], **sections: Any) -> str:
    # Quiet tables get no merge runs of their own here unless a test asks (checks.quiet_interval_seconds).
    sections.setdefault("checks", {"quiet_interval_seconds": 0})
    config = source.config(tables, snapshot={"chunk_pages": 8, "parallelism": 2}, **sections)
    data = config.model_dump(mode="json", exclude_none=True)
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _assets_def(defs: Definitions, key: AssetKey) -> Any:
    return defs.resolve_assets_def(key)


MERGE_JOB = "pg2iceberg_merge"


def _merge(defs: Definitions, instance: DagsterInstance, *keys: AssetKey, **kwargs: Any) -> Any:
    """A run of the merge job on the live tables ``keys`` (a subset of the one multi-asset of live tables)."""
    return defs.resolve_job_def(MERGE_JOB).execute_in_process(instance=instance, asset_selection=list(keys), **kwargs)


def _merge_requested(defs: Definitions, instance: DagsterInstance, config_path: str) -> RunRequest | None:
    """The merge run the merge sensor requests in one tick (None: it skips)."""
    ticked = _tick(defs, MERGE_JOB, instance, config_path)
    if isinstance(ticked, SkipReason):
        return None
    (request,) = ticked.run_requests
    return request


def _launch(
    defs: Definitions, instance: DagsterInstance, request: RunRequest, job: str = MERGE_JOB, **kwargs: Any
) -> Any:
    """Run what a sensor requested of ``job`` (its assets and checks, config and tags), as the daemon would."""
    job_def = defs.resolve_job_def(job)
    assets = list(request.asset_selection) if request.asset_selection else None
    if request.asset_check_keys is not None:  # subset here: execute_in_process's selection takes every check
        checks = set(request.asset_check_keys)
        job_def = job_def.get_subset(asset_selection=set(assets or ()), asset_check_selection=checks)
        assets = None
    return job_def.execute_in_process(
        instance=instance, asset_selection=assets, run_config=request.run_config, tags=request.tags, **kwargs
    )


def _resources(config_path: str) -> dict[str, Any]:
    pg2iceberg = Pg2IcebergResource(config_path=config_path)
    return {"pg2iceberg": pg2iceberg, "pg2iceberg_spark": SparkResource(pg2iceberg=pg2iceberg)}


def _tick(defs: Definitions, name: str, instance: DagsterInstance, config_path: str) -> Any:
    sensor = defs.resolve_sensor_def(name)
    with build_sensor_context(instance=instance, resources=_resources(config_path)) as context:
        return sensor(context)


def _plan_partitions(defs: Definitions, instance: DagsterInstance, config_path: str) -> SensorResult:
    """Tick the planner sensor, record the events it reports and add the chunk partitions it
    registers (as the daemon would, in that order)."""
    planned = _tick(defs, "pg2iceberg_snapshot_planner", instance, config_path)
    assert isinstance(planned, SensorResult)
    for event in planned.asset_events:
        instance.report_runless_asset_event(event)
    for request in planned.dynamic_partitions_requests:
        if isinstance(request, AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return planned


def _chunk_runs(planned: SensorResult) -> dict[AssetKey, tuple[str, str]]:
    """The chunk runs a planner tick requests: each snapshot asset's partition range."""
    runs = {}
    for request in planned.run_requests or []:
        (key,) = request.asset_selection or []
        runs[key] = (request.tags[ASSET_PARTITION_RANGE_START_TAG], request.tags[ASSET_PARTITION_RANGE_END_TAG])
    return runs


def test_definitions_follow_the_config(source: SourceDb, tmp_path: Path) -> None:
    source.execute(
        "CREATE TABLE public.orders (id int PRIMARY KEY); CREATE TABLE public.customers (id int PRIMARY KEY)"
    )
    defs = build_definitions(_write_config(source, tmp_path, ["public.orders", "public.customers"]))
    Definitions.validate_loadable(defs)
    specs = {spec.key: spec for spec in defs.resolve_all_asset_specs()}
    ns = f"{source.name}_public"
    for table in ("orders", "customers"):
        live = specs[AssetKey(["iceberg", ns, table])]
        assert {dep.asset_key for dep in live.deps} == {
            AssetKey(["iceberg", ns, f"{table}_snapshot"]),
            AssetKey(["staged_log", "public", f"{table}_staged_log"]),
        }
        assert {dep.asset_key for dep in specs[AssetKey(["iceberg", ns, f"{table}_snapshot"])].deps} == {
            AssetKey(["pg", "public", f"{table}_source"])
        }
        assert "iceberg" in live.kinds and live.automation_condition is None, "the merge sensor launches merges"
        snapshot = specs[AssetKey(["iceberg", ns, f"{table}_snapshot"])]
        assert snapshot.automation_condition is None, "the planner sensor launches the chunk runs"
        assert live.group_name == "pg2iceberg_public", "the mirror's group, not a bare schema name"
    for name in ("pg2iceberg_merge", "pg2iceberg_snapshot_planner"):
        assert defs.resolve_sensor_def(name).default_status == DefaultSensorStatus.RUNNING
    for sensor in defs.sensors or []:
        assert sensor.description, f"sensor {sensor.name} has no description"
    jobs = {job.name: defs.resolve_job_def(job.name) for job in defs.jobs or []}
    assert set(jobs) == {
        "pg2iceberg_merge",
        "pg2iceberg_resync",
        "pg2iceberg_maintenance",
        "pg2iceberg_cut",
        "pg2iceberg_repair",
    }
    for job in jobs.values():
        assert job.description, f"job {job.name} has no description"
        assert job.partitions_def is None, f"{job.name}: no partition per table (no 'missing' tables, no backfill)"
    assert jobs["pg2iceberg_merge"].executor_def.name == "in_process", "one process per merge run"
    assert jobs["pg2iceberg_merge"].tags[MIRROR_RUN_TAG] == "pg2iceberg"


def test_snapshot_partitions_stream_automation_and_checks(source: SourceDb, tmp_path: Path) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("CREATE TABLE public.customers (id int PRIMARY KEY, name text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' || g FROM generate_series(1, 4000) g")
    source.execute("INSERT INTO public.customers SELECT g, 'c' || g FROM generate_series(1, 3000) g")
    config_path = _write_config(source, tmp_path, ["public.orders", "public.customers"])
    defs = build_definitions(config_path)
    ns = f"{source.name}_public"
    orders_snapshot = _assets_def(defs, AssetKey(["iceberg", ns, "orders_snapshot"]))
    customers_snapshot = _assets_def(defs, AssetKey(["iceberg", ns, "customers_snapshot"]))
    orders_live = AssetKey(["iceberg", ns, "orders"])

    with instance_for_test() as instance:
        # The planner sensor registers the CTID chunk partitions.
        _plan_partitions(defs, instance, config_path)
        order_keys = orders_snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        assert len(order_keys) > 2 and order_keys[0] == "ctid_000000_000008" and order_keys[-1].endswith("_end")

        # One run per chunk; writes between runs; every chunk still reads the one exported snapshot.
        modes = []
        for number, key in enumerate(order_keys):
            source.execute("UPDATE public.orders SET v = 'changed' WHERE id = %s", (number + 1,))
            result = materialize([orders_snapshot], partition_key=key, instance=instance)
            assert result.success
            modes.append(result.asset_materializations_for_node(orders_snapshot.node_def.name)[0].metadata)
        assert {m["snapshot_epoch"].value for m in modes} == {0}
        assert not any(m["table_restarted"].value for m in modes)

        # Writes reach the staged log through the flusher sensor.
        source.execute("INSERT INTO public.orders VALUES (100001, 'new'); DELETE FROM public.orders WHERE id = 7")
        source.execute("UPDATE public.customers SET name = 'renamed' WHERE id = 1")
        ticked = _tick(defs, "pg2iceberg_flusher", instance, config_path)
        assert isinstance(ticked, SensorResult)
        events = {event.asset_key: event for event in ticked.asset_events}
        orders_event = events[AssetKey(["staged_log", "public", "orders_staged_log"])]
        assert orders_event.metadata["lag"].value > 0

        # The merge sensor: orders lags and its snapshot is complete, so it merges; customers lags but
        # is not snapshotted, so it does not merge, and the planner requests one run of its chunks.
        request = _merge_requested(defs, instance, config_path)
        assert request is not None and request.asset_selection == [orders_live]
        assert request.tags[TABLES_RUN_TAG] == "public.orders" and request.tags[table_run_tag("public.orders")]
        customer_chunks = customers_snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        assert _chunk_runs(_plan_partitions(defs, instance, config_path)) == {
            customers_snapshot.key: (customer_chunks[0], customer_chunks[-1])
        }

        # The merge runs as the named job on Spark and its checks pass.
        merged = _launch(defs, instance, request)
        assert merged.success and merged.dagster_run.job_name == MERGE_JOB
        checks = {e.check_name: e for e in merged.get_asset_check_evaluations()}
        assert checks[PK_UNIQUE].passed and checks[SCHEMA_MATCHES].passed and checks[MATCHES_SOURCE].passed
        assert _merge_requested(defs, instance, config_path) is None, "no lag left: no merge"

        # A duplicated key fails the blocking check.
        table = source.pipeline(source.config(["public.orders"])).catalog.load_table(f"{ns}.orders")
        table.append(pa.Table.from_pylist([{"id": 1, "v": "dup"}], schema=table.schema().as_arrow()))
        failed = _merge(defs, instance, orders_live, raise_on_error=False)
        assert not failed.success
        checks = {e.check_name: e for e in failed.get_asset_check_evaluations()}
        assert not checks[PK_UNIQUE].passed and checks[PK_UNIQUE].metadata["duplicate_keys"].value == 1

        # The other table's chunks: one range run; the holder lets go once every table is done.
        customer_keys = customers_snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        assert len(customer_keys) > 1
        ranged = materialize(
            [customers_snapshot],
            instance=instance,
            tags={ASSET_PARTITION_RANGE_START_TAG: customer_keys[0], ASSET_PARTITION_RANGE_END_TAG: customer_keys[-1]},
        )
        assert ranged.success
        runs = {
            m.metadata["chunks_run"].value
            for m in ranged.asset_materializations_for_node(customers_snapshot.node_def.name)
        }
        assert runs == {len(customer_keys)}, "one run read every chunk of the range"

        # Its snapshot complete, the customers live table is reported materialized (no merge ran yet);
        # orders, merged already, is not reported again.
        ticked = _tick(defs, "pg2iceberg_snapshot_planner", instance, config_path)
        assert isinstance(ticked, SensorResult)
        live_events = {event.asset_key: event for event in ticked.asset_events}
        assert set(live_events) == {AssetKey(["iceberg", ns, "customers"])}
        assert live_events[AssetKey(["iceberg", ns, "customers"])].metadata["dagster/row_count"].value == 3000
    pipeline = source.pipeline(source.config(["public.customers"]))
    deadline = time.monotonic() + 30
    while pipeline.store.exported_snapshot(holder_lock_key(pipeline.config)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pipeline.store.exported_snapshot(holder_lock_key(pipeline.config)) is None
    pipeline.stream(until_caught_up=True)
    pipeline.materialize()
    assert_mirrored(pipeline)


def test_lagging_tables_merge_in_one_run_and_one_failure_holds_back_none(source: SourceDb, tmp_path: Path) -> None:
    """One merge sensor tick requests every lagging table, and one run of the merge job merges them (one
    Spark session for them all), tagged with each; in a run, a table that cannot merge fails the run but
    the others are merged and reported."""
    names = ("orders", "customers", "later")
    for name in names:
        source.execute(f"CREATE TABLE public.{name} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO public.{name} SELECT g, 'v' || g FROM generate_series(1, 300) g")
    ns = f"{source.name}_public"
    live = {name: AssetKey(["iceberg", ns, name]) for name in names}
    config_path = _write_config(source, tmp_path, [f"public.{name}" for name in names])
    defs = build_definitions(config_path)
    # orders and customers are snapshotted; `later` is configured but its snapshot is not taken.
    mirrored = source.pipeline(source.config(["public.orders", "public.customers"]))
    mirrored.snapshot()
    source.execute("UPDATE public.orders SET v = 'changed' WHERE id <= 5; DELETE FROM public.customers WHERE id = 9")
    mirrored.stream(until_caught_up=True)
    with instance_for_test() as instance:
        # One request for both lagging tables (test_dagster_dev sees it as one run); `later` waits.
        request = _merge_requested(defs, instance, config_path)
        assert request is not None and set(request.asset_selection or []) == {live["orders"], live["customers"]}
        assert request.tags[TABLES_RUN_TAG] == "public.customers,public.orders"
        merged = _launch(defs, instance, request)
        assert merged.success
        assert {e.asset_key for e in merged.get_asset_materialization_events()} == {live["orders"], live["customers"]}
        assert all(e.passed for e in merged.get_asset_check_evaluations())
        assert len(merged.get_asset_check_evaluations()) == 8, "the four checks of each table"
        (run,) = instance.get_runs()
        assert run.job_name == MERGE_JOB and run.tags[MIRROR_RUN_TAG] == "pg2iceberg"
        assert {table_run_tag("public.orders"), table_run_tag("public.customers")} <= set(run.tags)
        assert _merge_requested(defs, instance, config_path) is None

        source.execute("INSERT INTO public.orders VALUES (1000, 'new')")
        mirrored.stream(until_caught_up=True)
        partly = _merge(defs, instance, live["later"], live["orders"], raise_on_error=False)
        assert not partly.success
        assert {e.asset_key for e in partly.get_asset_materialization_events()} == {live["orders"]}
    assert_mirrored(mirrored)


def test_chunks_read_by_the_cli_are_reported_and_then_the_live_table(source: SourceDb, tmp_path: Path) -> None:
    """A table snapshotted by the CLI before Dagster ran: the planner reports its chunk partitions
    materialized (no run is launched only to find them done), then the live table, after its chunks,
    so it never reads as older than its snapshot ("Unsynced")."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'v' || g FROM generate_series(1, 2000) g")
    config_path = _write_config(source, tmp_path, ["public.items"])
    source.pipeline(source.config(["public.items"], snapshot={"chunk_pages": 8, "parallelism": 2})).snapshot()
    defs = build_definitions(config_path)
    ns = f"{source.name}_public"
    snapshot = _assets_def(defs, AssetKey(["iceberg", ns, "items_snapshot"]))
    with instance_for_test() as instance:
        # One tick reports the chunks read, then the live table; the next registers their partitions
        # (an automation condition of your own on the chunks, evaluated before the first tick's events
        # were stored, would otherwise see them missing).
        planned = _plan_partitions(defs, instance, config_path)
        assert not snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        assert not planned.dynamic_partitions_requests
        assert not planned.run_requests, "no run only to find the chunks done"
        registered = _plan_partitions(defs, instance, config_path)
        assert not registered.asset_events, "reported once"
        keys = snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        assert len(keys) > 1
        *chunks, live = planned.asset_events
        assert [(e.asset_key, e.partition) for e in chunks] == [(snapshot.key, key) for key in keys]
        # No Dagster run read them ("Run None" in the UI): each says who did and what it wrote.
        assert sum(e.metadata["rows_written"].value for e in chunks) == 2000
        assert all("CLI" in (e.description or "") and e.metadata["reported_by"].value for e in chunks)
        assert live.asset_key == AssetKey(["iceberg", ns, "items"]) and live.metadata["dagster/row_count"].value == 2000
        assert not registered.run_requests, "nothing left for a chunk run"
        assert not isinstance(_tick(defs, "pg2iceberg_snapshot_planner", instance, config_path), SensorResult)


def test_a_table_partly_read_outside_dagster_gets_one_run_of_the_rest(source: SourceDb, tmp_path: Path) -> None:
    """Chunks read by another process, the rest not: the planner reports the read ones first, then
    adds every partition in chunk order and requests one ranged run of the chunks not done, which
    completes the snapshot; the live table then equals the source."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'v' || g FROM generate_series(1, 6000) g")
    config_path = _write_config(source, tmp_path, ["public.items"])
    outside = source.pipeline(source.config(["public.items"]))
    chunks = [chunk.partition_key for chunk in outside.snapshot_plan("public.items").chunks]
    assert len(chunks) > 3
    assert outside.snapshot_chunks("public.items", chunks[1:3]).chunks_run == 2
    defs = build_definitions(config_path)
    snapshot = _assets_def(defs, AssetKey(["iceberg", f"{source.name}_public", "items_snapshot"]))
    with instance_for_test() as instance:
        reported = _plan_partitions(defs, instance, config_path)
        assert [event.partition for event in reported.asset_events] == chunks[1:3]
        assert not reported.dynamic_partitions_requests and not reported.run_requests
        planned = _plan_partitions(defs, instance, config_path)
        assert snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance) == chunks
        assert _chunk_runs(planned) == {snapshot.key: (chunks[0], chunks[-1])}
        (request,) = planned.run_requests
        assert request.run_key and "epoch-0" in request.run_key
        source.execute("UPDATE public.items SET v = 'during the snapshot' WHERE id <= 20")
        ran = materialize([snapshot], instance=instance, tags=request.tags)
        assert ran.success
        materialization = ran.asset_materializations_for_node(snapshot.node_def.name)[0]
        # The other process's exported snapshot ended with it: the run started the table over in a new
        # epoch and read every chunk again under its own.
        metadata = {name: value.value for name, value in materialization.metadata.items()}
        assert metadata["snapshot_epoch"] == 1 and metadata["table_restarted"]
        assert metadata["chunks_run"] == len(chunks) and metadata["rows_written"] == 6000
        assert outside.store.table_state("public.items").snapshot_complete
        assert not _chunk_runs(_plan_partitions(defs, instance, config_path)), "nothing left to read"
        # Settled: the cursor keeps it, and later ticks query nothing of it, until it starts over.
        planner = defs.resolve_sensor_def("pg2iceberg_snapshot_planner")
        with build_sensor_context(instance=instance, resources=_resources(config_path)) as context:
            assert isinstance(planner(context), SkipReason)
            cursor = context.cursor
        assert json.loads(cursor or "{}") == {"public.items": 1}
        outside.store.conn.execute("UPDATE _pg2iceberg.tables SET snapshot_complete = false")
        outside.store.restart_table_snapshot("public.items", 1)
        with build_sensor_context(instance=instance, resources=_resources(config_path), cursor=cursor) as context:
            started_over = planner(context)
        assert isinstance(started_over, SensorResult)
        assert _chunk_runs(started_over) == {snapshot.key: (chunks[0], chunks[-1])}
        assert "epoch-1" in (started_over.run_requests[0].run_key or "")
        assert json.loads(context.cursor or "{}") == {}
        ran = materialize([snapshot], instance=instance, tags=started_over.run_requests[0].tags)
        assert ran.success and outside.store.table_state("public.items").snapshot_complete
    outside.stream(until_caught_up=True)
    outside.materialize()
    assert_mirrored(outside)


def test_a_resync_requested_by_a_merge_is_launched_and_reported(source: SourceDb, tmp_path: Path) -> None:
    """A change the WAL cannot follow: the merge run succeeds and says the table waits for a resync;
    the resync sensor launches the job on the table's partition; its run reports the live table
    materialized with what the copy did; the next merge's checks all pass against the source."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, code int)")
    source.execute("INSERT INTO public.items SELECT g, g FROM generate_series(1, 500) g")
    config_path = _write_config(source, tmp_path, ["public.items"])
    defs = build_definitions(config_path)
    live = _assets_def(defs, AssetKey(["iceberg", f"{source.name}_public", "items"]))
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    source.execute("ALTER TABLE public.items ALTER COLUMN code TYPE text USING 'c' || code::text")
    source.execute("UPDATE public.items SET code = 'changed' WHERE id = 1")
    pipeline.stream(until_caught_up=True)
    with instance_for_test() as instance:
        waiting = materialize([live], instance=instance)
        assert waiting.success
        metadata = waiting.asset_materializations_for_node(live.node_def.name)[0].metadata
        assert "column code changed from int to string" in metadata["resync_pending"].value

        ticked = _tick(defs, "pg2iceberg_resync", instance, config_path)
        assert isinstance(ticked, SensorResult)
        (request,) = ticked.run_requests
        assert request.partition_key is None and request.tags[TABLES_RUN_TAG] == "public.items"
        assert request.run_config == {"ops": {"pg2iceberg_resync_table": {"config": {"table": "public.items"}}}}
        resynced = _launch(defs, instance, request, job="pg2iceberg_resync")
        assert resynced.success and resynced.dagster_run.tags[table_run_tag("public.items")]
        event = instance.get_latest_materialization_event(live.key)
        assert event is not None and event.asset_materialization is not None
        assert event.asset_materialization.metadata["rows_copied"].value == 500
        assert not isinstance(_tick(defs, "pg2iceberg_resync", instance, config_path), SensorResult)

        source.execute("INSERT INTO public.items VALUES (501, 'after')")
        pipeline.stream(until_caught_up=True)
        merged = materialize([live], instance=instance)
        checks = {e.check_name: e for e in merged.get_asset_check_evaluations()}
        assert checks[PK_UNIQUE].passed and checks[SCHEMA_MATCHES].passed and checks[MATCHES_SOURCE].passed
    assert_mirrored(pipeline)


def test_a_quiet_table_is_merged_and_checked_every_quiet_interval(source: SourceDb, tmp_path: Path) -> None:
    """A table with nothing to merge joins a merge run once it had none for
    ``checks.quiet_interval_seconds``: its checks compare it with the source (rather than never running)
    and it is materialized with no changes; within the interval it is left alone."""
    for name in ("busy", "quiet"):
        source.execute(f"CREATE TABLE public.{name} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO public.{name} SELECT g, 'v' || g FROM generate_series(1, 200) g")
    tables = ["public.busy", "public.quiet"]
    keys = {name: AssetKey(["iceberg", f"{source.name}_public", name]) for name in ("busy", "quiet")}
    pipeline = source.pipeline(source.config(tables))
    pipeline.snapshot()
    source.execute("UPDATE public.busy SET v = v || '+' WHERE id = 1")
    pipeline.stream(until_caught_up=True)
    config_path = _write_config(source, tmp_path, tables, checks={"quiet_interval_seconds": 3600})
    defs = build_definitions(config_path)
    with instance_for_test() as instance:
        request = _merge_requested(defs, instance, config_path)
        assert request is not None and sorted(request.asset_selection) == sorted(keys.values()), "never checked: due"
        merged = _launch(defs, instance, request)
        assert merged.success
        quiet = [e for e in merged.get_asset_check_evaluations() if e.asset_key == keys["quiet"]]
        assert {e.check_name for e in quiet} >= {PK_UNIQUE, MATCHES_SOURCE, SCHEMA_MATCHES}
        assert all(e.passed for e in quiet)
        (compared,) = [e for e in quiet if e.check_name == MATCHES_SOURCE]
        assert compared.metadata["compared"].value is True
        materialized = {e.asset_key: e.materialization for e in merged.get_asset_materialization_events()}
        assert materialized[keys["quiet"]].metadata["changes_applied"].value == 0

        assert _merge_requested(defs, instance, config_path) is None, "checked within the interval: left alone"


def test_a_lagging_tables_checks_join_its_merge_runs_every_min_interval(source: SourceDb, tmp_path: Path) -> None:
    """With ``checks.min_interval_seconds``, a lagging table's merge run runs its checks when they never
    ran or last ran longer ago than that; the runs in between merge it without them (no check planned,
    none evaluated), and its rows still equal the source's."""
    source.execute("CREATE TABLE public.busy (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.busy SELECT g, 'v' || g FROM generate_series(1, 200) g")
    busy = AssetKey(["iceberg", f"{source.name}_public", "busy"])
    pipeline = source.pipeline(source.config(["public.busy"]))
    pipeline.snapshot()
    sections = {"materialize": {"min_run_interval_seconds": 0}, "checks": {"min_interval_seconds": 3600}}
    config_path = _write_config(source, tmp_path, ["public.busy"], **sections)
    defs = build_definitions(config_path)
    with instance_for_test() as instance:
        checked = []
        for round_ in range(3):
            source.execute("UPDATE public.busy SET v = v || '+' WHERE id = %s", (round_ + 1,))
            pipeline.stream(until_caught_up=True)
            request = _merge_requested(defs, instance, config_path)
            assert request is not None and request.asset_selection == [busy]
            result = _launch(defs, instance, request)
            assert result.success
            assert [e.asset_key for e in result.get_asset_materialization_events()] == [busy]
            evaluations = result.get_asset_check_evaluations()
            assert all(e.passed for e in evaluations)
            checked.append(({e.check_name for e in evaluations}, request.tags.get(CHECKED_RUN_TAG)))
        every = {PK_UNIQUE, MATCHES_SOURCE, SCHEMA_MATCHES, FILES_COMPACT}
        assert checked == [(every, "public.busy"), (set(), None), (set(), None)], "checked once within the hour"
    assert_mirrored(pipeline)


def test_merge_runs_skip_tables_in_flight_and_honour_the_minimum_interval(source: SourceDb, tmp_path: Path) -> None:
    """A busy table: while a merge run of it is in progress (until it has merged it and only checks it), and until
    ``materialize.min_run_interval_seconds`` after its last run was created, the merge sensor leaves it
    out (its changes wait for the next run, which merges several flushes); 0 launches whenever it lags."""
    for name in ("busy", "other"):
        source.execute(f"CREATE TABLE public.{name} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO public.{name} SELECT g, 'v' || g FROM generate_series(1, 200) g")
    tables = ["public.busy", "public.other"]
    other = AssetKey(["iceberg", f"{source.name}_public", "other"])
    pipeline = source.pipeline(source.config(tables))
    pipeline.snapshot()

    def write(*names: str) -> None:
        for name in names:
            source.execute(f"UPDATE public.{name} SET v = v || '+' WHERE id = 1")
        pipeline.stream(until_caught_up=True)

    config_path = _write_config(source, tmp_path, tables, materialize={"min_run_interval_seconds": 3600})
    defs = build_definitions(config_path)
    with instance_for_test() as instance:
        # A run of busy in progress (as the daemon would have launched it): busy is left out.
        in_progress = instance.add_run(
            DagsterRun(job_name=MERGE_JOB, status=DagsterRunStatus.STARTED, tags={table_run_tag("public.busy"): "true"})
        )
        write("busy", "other")
        request = _merge_requested(defs, instance, config_path)
        assert request is not None and request.asset_selection == [other], "busy's run is still in progress"
        assert _launch(defs, instance, request).success

        # Both lag again: busy's in-progress run and other's last run (just now) hold both back.
        write("busy", "other")
        skipped = _tick(defs, MERGE_JOB, instance, config_path)
        assert isinstance(skipped, SkipReason)
        assert "merging now: 1" in str(skipped.skip_message) and "less than 3600 s ago: 1" in str(skipped.skip_message)

        # With no minimum interval, other merges as soon as it lags; busy still waits for its run.
        config_path = _write_config(source, tmp_path, tables, materialize={"min_run_interval_seconds": 0})
        request = _merge_requested(defs, instance, config_path)
        assert request is not None and request.asset_selection == [other]
        assert _launch(defs, instance, request).success

        # Busy's run records busy merged and goes on to its checks: the next run of busy may start.
        busy = AssetKey(["iceberg", f"{source.name}_public", "busy"])
        materialized = StepMaterializationData(AssetMaterialization(busy))
        event = DagsterEvent(DagsterEventType.ASSET_MATERIALIZATION.value, MERGE_JOB, event_specific_data=materialized)
        instance.report_dagster_event(event, run_id=in_progress.run_id)
        request = _merge_requested(defs, instance, config_path)
        assert request is not None and request.asset_selection == [busy], "busy's run is only checking it"

        # The default (30 s) holds other back too: its last run was created a moment ago.
        write("other")
        config_path = _write_config(source, tmp_path, tables)
        assert _merge_requested(defs, instance, config_path) is None


def test_a_merge_tick_with_nothing_to_request_watches_for_a_table_to_lag(
    source: SourceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dagster's daemon looks at the sensor every 5 s at most: a tick with no run to request looks again
    until its watch ends, and requests the merge of a table that starts lagging meanwhile."""
    source.execute("CREATE TABLE public.calm (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.calm VALUES (1, 'a')")
    pipeline = source.pipeline(source.config(["public.calm"]))
    pipeline.snapshot()
    calm = AssetKey(["iceberg", f"{source.name}_public", "calm"])
    config_path = _write_config(source, tmp_path, ["public.calm"], materialize={"min_run_interval_seconds": 0})
    defs = build_definitions(config_path)
    with instance_for_test() as instance:
        assert _merge_requested(defs, instance, config_path) is None, "nothing lags: one look, no request"

        def change_soon() -> None:
            time.sleep(0.5)
            source.execute("UPDATE public.calm SET v = 'b' WHERE id = 1")
            pipeline.stream(until_caught_up=True)

        monkeypatch.setattr(merge_sensors, "MERGE_WATCH_SECONDS", 60.0)
        staging = threading.Thread(target=change_soon)
        staging.start()
        try:
            request = _merge_requested(defs, instance, config_path)
        finally:
            staging.join()
        assert request is not None and request.asset_selection == [calm], "lagging during the watch"
        assert _launch(defs, instance, request).success
        assert_mirrored(pipeline)


def test_resync_maintenance_and_repair_refuse_an_unknown_table(source: SourceDb, tmp_path: Path) -> None:
    """The per-table jobs take their table from the run config: one the mirror does not mirror fails the
    run at once, naming the mirror's tables."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY)")
    defs = build_definitions(_write_config(source, tmp_path, ["public.items"]))
    with instance_for_test() as instance:
        for job, op in (
            ("pg2iceberg_resync", "pg2iceberg_resync_table"),
            ("pg2iceberg_maintenance", "pg2iceberg_maintain_table"),
            ("pg2iceberg_repair", "pg2iceberg_repair_tables"),
        ):
            config = {"ops": {op: {"config": {"table": "public.nope"}}}}
            result = defs.resolve_job_def(job).execute_in_process(
                instance=instance, run_config=config, raise_on_error=False
            )
            assert not result.success
            (failure,) = [e for e in result.all_events if e.is_step_failure]
            message = failure.step_failure_data.error.message  # type: ignore[union-attr]
            assert "unknown table 'public.nope'" in message and "public.items" in message, message


def test_a_partitioned_table_runs_its_leaves_chunks_and_merges(source: SourceDb, tmp_path: Path) -> None:
    """A partitioned table's chunk partitions are named after their leaves; materializing them all in
    one run, then merging, leaves the one Iceberg table equal to the source with its checks passing."""
    source.execute(
        "CREATE TABLE public.events (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)"
    )
    source.execute("CREATE TABLE public.events_eu PARTITION OF public.events FOR VALUES IN ('eu')")
    source.execute("CREATE TABLE public.events_us PARTITION OF public.events FOR VALUES IN ('us')")
    source.execute(
        "INSERT INTO public.events SELECT g, (ARRAY['eu', 'us'])[g % 2 + 1], repeat('v', 100) "
        "FROM generate_series(1, 2000) g"
    )
    config_path = _write_config(source, tmp_path, ["public.events"])
    defs = build_definitions(config_path)
    ns = f"{source.name}_public"
    snapshot = _assets_def(defs, AssetKey(["iceberg", ns, "events_snapshot"]))
    live = _assets_def(defs, AssetKey(["iceberg", ns, "events"]))
    with instance_for_test() as instance:
        _plan_partitions(defs, instance, config_path)
        keys = snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        assert {key.rsplit(".ctid_", 1)[0] for key in keys} == {"public.events_eu", "public.events_us"}
        tags = {ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}
        assert materialize([snapshot], instance=instance, tags=tags).success
        source.execute("UPDATE public.events SET region = 'eu' WHERE id = 1")
        _tick(defs, "pg2iceberg_flusher", instance, config_path)
        merged = materialize([live], instance=instance)
        assert merged.success
        checks = {e.check_name: e for e in merged.get_asset_check_evaluations()}
        assert checks[PK_UNIQUE].passed and checks[SCHEMA_MATCHES].passed and checks[MATCHES_SOURCE].passed
    assert_mirrored(source.pipeline(source.config(["public.events"])))


def test_a_table_added_to_the_config_is_planned_snapshotted_and_merged_on_reload(
    source: SourceDb, tmp_path: Path
) -> None:
    """After the first table is mirrored, a table added to the config shows up when the definitions
    are loaded again: the planner registers its chunks and requests their run, their runs snapshot
    it in a new epoch (the owned publication gains it first), and its merge makes it equal the source."""
    for name in ("orders", "customers"):
        source.execute(f"CREATE TABLE public.{name} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO public.{name} SELECT g, 'v' || g FROM generate_series(1, 2000) g")
    ns = f"{source.name}_public"
    config_path = _write_config(source, tmp_path, ["public.orders"])
    with instance_for_test() as instance:
        defs = build_definitions(config_path)
        _plan_partitions(defs, instance, config_path)
        orders_snapshot = _assets_def(defs, AssetKey(["iceberg", ns, "orders_snapshot"]))
        keys = orders_snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        tags = {ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}
        assert materialize([orders_snapshot], instance=instance, tags=tags).success

        source.execute("UPDATE public.customers SET v = 'before the add' WHERE id <= 10")
        _write_config(source, tmp_path, ["public.orders", "public.customers"])
        defs = build_definitions(config_path)  # what a code location reload does
        customers_snapshot = _assets_def(defs, AssetKey(["iceberg", ns, "customers_snapshot"]))
        planned = _plan_partitions(defs, instance, config_path)
        keys = customers_snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        assert len(keys) > 1 and _chunk_runs(planned) == {customers_snapshot.key: (keys[0], keys[-1])}
        source.execute("UPDATE public.customers SET v = 'during the snapshot' WHERE id BETWEEN 5 AND 15")
        tags = {ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}
        result = materialize([customers_snapshot], instance=instance, tags=tags)
        assert result.success
        materializations = [e.materialization for e in result.get_asset_materialization_events()]
        assert {m.metadata["snapshot_epoch"].value for m in materializations} == {1}
        source.execute("UPDATE public.customers SET v = 'after' WHERE id = 1")
        _tick(defs, "pg2iceberg_flusher", instance, config_path)
        merged = _merge(defs, instance, *[AssetKey(["iceberg", ns, name]) for name in ("orders", "customers")])
        assert merged.success
        assert all(e.passed for e in merged.get_asset_check_evaluations())
    assert_mirrored(source.pipeline(source.config(["public.orders", "public.customers"])))


def test_a_table_removed_from_the_config_leaves_no_state_or_partitions(source: SourceDb, tmp_path: Path) -> None:
    """After a reload without a table, the planner sensor stops mirroring it: out of the publication,
    no coordination state, no chunk partitions left in the instance; its Iceberg table stays."""
    for name in ("orders", "customers"):
        source.execute(f"CREATE TABLE public.{name} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO public.{name} SELECT g, 'v' || g FROM generate_series(1, 500) g")
    config_path = _write_config(source, tmp_path, ["public.orders", "public.customers"])
    ns = f"{source.name}_public"
    with instance_for_test() as instance:
        defs = build_definitions(config_path)
        _plan_partitions(defs, instance, config_path)
        customers = _assets_def(defs, AssetKey(["iceberg", ns, "customers_snapshot"]))
        name = customers.partitions_def.name
        keys = instance.get_dynamic_partitions(name)
        tags = {ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}
        assert materialize([customers], instance=instance, tags=tags).success

        _write_config(source, tmp_path, ["public.orders"])
        defs = build_definitions(config_path)
        ticked = _tick(defs, "pg2iceberg_snapshot_planner", instance, config_path)
        deletions = [r for r in ticked.dynamic_partitions_requests if r.partitions_def_name == name]
        assert [sorted(r.partition_keys) for r in deletions] == [sorted(keys)]
        published = source.execute(
            "SELECT tablename FROM pg_publication_tables WHERE pubname = %s", (f"pub_{source.name}",)
        )
        assert published == [("orders",)]
        with source.pipeline(source.config(["public.orders"])) as pipeline:
            assert "public.customers" not in pipeline.store.table_states()
            assert pipeline.catalog.load_table(f"{ns}.customers").scan().to_arrow().num_rows == 500
