"""Maintenance of the mirror's Iceberg tables: compaction, snapshot expiry, orphan files and the
staged log's garbage, from the CLI, under crashes, and inside ``run``. After each, Iceberg still
equals the live source row by row, and merges go on."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pg2iceberg_dagster import run_loop
from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.maintenance import maintainer as maintainer_module
from pg2iceberg_dagster.maintenance import measured_health
from pg2iceberg_dagster.maintenance.orphans import orphan_files, referenced_files
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.staging.store import ObjectStore, merge_batch_prefix

from .conftest import Crash, SourceDb, assert_mirrored, pipeline_running, sync

pytestmark = pytest.mark.usefixtures("spark")

# Merge-on-read: merges leave position delete files, the harder case for compaction.
MERGE_ON_READ = {f"write.{kind}.mode": "merge-on-read" for kind in ("merge", "update", "delete")}
EAGER = {"snapshot_retention_hours": 0, "min_snapshots": 2, "orphan_min_age_hours": 0}


def _config(source: SourceDb, table: dict[str, Any] | None = None, **maintenance: Any) -> PipelineConfig:
    tables = [table or {"name": "public.items"}]
    iceberg = source.config(tables).iceberg.model_dump(mode="json", exclude_none=True)
    iceberg["table_properties"] = {**iceberg["table_properties"], **MERGE_ON_READ}
    return source.config(tables, iceberg=iceberg, maintenance={**EAGER, **maintenance})


def _churn(source: SourceDb, pipeline: Pipeline, rounds: int) -> None:
    """``rounds`` merges, each updating and deleting some rows and inserting others."""
    for round_ in range(rounds):
        source.execute("UPDATE items SET note = note || '+' WHERE id %% 5 = %s", (round_ % 5,))
        source.execute("DELETE FROM items WHERE id %% 89 = %s", (round_,))
        source.execute(
            "INSERT INTO items SELECT top + i, 'new ' || i FROM (SELECT max(id) AS top FROM items) t, "
            "generate_series(1, 50) i"
        )
        sync(pipeline)


def _table(pipeline: Pipeline) -> Any:
    return pipeline.catalog.load_table(pipeline.tables["public.items"].iceberg)


def _plant_orphans(pipeline: Pipeline) -> tuple[Path, str]:
    """What crashes leave: a data file written under the table but never committed, and a merge batch
    staged for Spark but never deleted."""
    location = _table(pipeline).location().removeprefix("file://")
    orphan = Path(location) / "data" / "never-committed.parquet"
    orphan.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [1], "note": ["x"]}), orphan)
    objects = ObjectStore(pipeline.config.staging)
    batch = f"{merge_batch_prefix(pipeline.tables['public.items'].staging)}left-by-a-crash.parquet"
    objects.put(batch, b"PAR1")
    return orphan, batch


def _files_under(pipeline: Pipeline) -> set[str]:
    root = Path(_table(pipeline).location().removeprefix("file://"))
    return {str(path) for path in root.rglob("*") if path.is_file()}


def _churned(source: SourceDb, config: PipelineConfig, rounds: int) -> Pipeline:
    """The pipeline of a table snapshotted, then changed and merged ``rounds`` times."""
    source.execute("CREATE TABLE items (id int PRIMARY KEY, note text)")
    source.execute("INSERT INTO items SELECT i, 'item ' || i FROM generate_series(1, 3000) i")
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    _churn(source, pipeline, rounds)
    return pipeline


def test_maintain_compacts_expires_and_removes_orphans_and_the_mirror_still_equals_the_source(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(source)
    pipeline = _churned(source, config, 6)
    before = measured_health(_table(pipeline), config.maintenance.target_file_size_bytes)
    assert before.delete_files > 0 and before.data_files > 4 and before.snapshots > 6, before
    orphan, batch = _plant_orphans(pipeline)

    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    capsys.readouterr()
    assert main(["-c", str(path), "maintain", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)

    table = _table(pipeline)
    after = measured_health(table, config.maintenance.target_file_size_bytes)
    assert result["after"]["data_files"] == after.data_files
    assert after.data_files == 1 and after.delete_files == 0, after
    assert after.snapshots == config.maintenance.min_snapshots
    assert result["data_files_rewritten"] >= before.data_files - 1
    assert not orphan.exists() and result["orphans_removed"] >= 1
    assert batch not in ObjectStore(config.staging).list()
    # Every file left under the table is one its metadata reaches.
    assert _files_under(pipeline) <= referenced_files(table)
    assert orphan_files(table, 0) == []
    assert_mirrored(pipeline)
    # Merges go on over the compacted table.
    _churn(source, pipeline, 2)
    assert_mirrored(pipeline)


def test_maintain_compacts_a_partitioned_sorted_table_within_its_partitions(source: SourceDb) -> None:
    table = {"name": "public.items", "partition_by": ["bucket(4, id)"], "sort_by": ["id"]}
    config = _config(source, table)
    pipeline = _churned(source, config, 4)
    (result,) = pipeline.maintain()
    assert result.skipped is None and result.rewrites.data_files_rewritten > 4
    iceberg = _table(pipeline)
    health = measured_health(iceberg, config.maintenance.target_file_size_bytes)
    assert health.delete_files == 0 and health.data_files <= 4  # one file per bucket at most
    buckets = [row["id_bucket_4"] for row in iceberg.inspect.files().column("partition").to_pylist()]
    assert len(set(buckets)) == len(buckets)
    assert_mirrored(pipeline)


@pytest.mark.parametrize("point", ["maintenance.after_compaction", "maintenance.after_expiry"])
def test_a_crash_inside_maintenance_loses_nothing_and_the_next_pass_finishes(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    config = _config(source)
    pipeline = _churned(source, config, 4)
    orphan, _ = _plant_orphans(pipeline)

    def crash_at(name: str) -> None:
        if name == point:
            raise Crash

    monkeypatch.setattr(maintainer_module, "crash_point", crash_at)
    with pytest.raises(Crash):
        pipeline.maintain()
    monkeypatch.undo()
    assert_mirrored(pipeline)
    _churn(source, pipeline, 1)  # the lease was let go: merges go on

    (result,) = pipeline.maintain()
    assert result.skipped is None
    table = _table(pipeline)
    assert not orphan.exists()
    assert len(table.metadata.snapshots) == config.maintenance.min_snapshots
    assert measured_health(table, config.maintenance.target_file_size_bytes).delete_files == 0
    assert _files_under(pipeline) <= referenced_files(table)
    assert_mirrored(pipeline)


def test_maintenance_leaves_a_table_waiting_for_a_resync_alone(source: SourceDb) -> None:
    pipeline = _churned(source, _config(source), 3)
    snapshots = [s.snapshot_id for s in _table(pipeline).snapshots()]
    pipeline.store.request_resync("public.items", "test: a change the WAL cannot follow")
    (result,) = pipeline.maintain()
    assert result.skipped and "resync" in result.skipped
    assert [s.snapshot_id for s in _table(pipeline).snapshots()] == snapshots


def test_run_maintains_tables_between_merges(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` with live writes: tables whose files call for it are compacted and their snapshots
    expired between merges, and the mirror stays exact."""
    config = _config(source, compact_at_files=3)
    monkeypatch.setattr(run_loop, "UPKEEP_CHECK_SECONDS", 0.5)
    pipeline = _churned(source, config, 0)
    with pipeline_running(pipeline, interval=0.5) as errors:
        for round_ in range(12):
            source.execute("UPDATE items SET note = note || '.' WHERE id %% 7 = %s", (round_ % 7,))
            source.execute("DELETE FROM items WHERE id = %s", (round_ * 11 + 1,))
            time.sleep(1.5)
        maintained = source.execute(
            "SELECT count(*) FROM _pg2iceberg.tables WHERE maintained_at > now() - interval '1 minute'"
        )
    assert not errors, errors
    assert maintained == [(1,)]
    table = _table(pipeline)
    # Twelve rounds of merges, each a snapshot; expiry keeps the table far below that.
    assert len(table.metadata.snapshots) < 12, len(table.metadata.snapshots)
    sync(pipeline)
    assert_mirrored(pipeline)


def test_dagster_maintains_a_due_table_and_plots_its_files(source: SourceDb, tmp_path: Path) -> None:
    """The merge's check warns once small files pile up; the maintenance sensor requests the table's
    partition of the maintenance job; its run compacts the table and reports an observation with the
    numbers Iceberg has; the next merge's check passes and the mirror equals the source."""
    from dagster import AssetKey, SensorResult, SkipReason, build_sensor_context, instance_for_test, materialize

    from pg2iceberg_dagster.dagster_integration import Pg2IcebergResource, SparkResource, build_definitions
    from pg2iceberg_dagster.dagster_integration.assets import FILES_COMPACT

    config = _config(source, compact_at_files=3)
    pipeline = _churned(source, config, 4)
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    defs = build_definitions(path)
    live = defs.resolve_assets_def(AssetKey(["iceberg", f"{source.name}_public", "items"]))
    resource = Pg2IcebergResource(config_path=str(path))
    resources = {"pg2iceberg": resource, "pg2iceberg_spark": SparkResource(pg2iceberg=resource)}

    with instance_for_test() as instance:
        source.execute("UPDATE items SET note = 'x' WHERE id < 10")
        pipeline.stream(until_caught_up=True)
        merged = materialize([live], instance=instance)
        checks = {e.check_name: e for e in merged.get_asset_check_evaluations()}
        assert not checks[FILES_COMPACT].passed

        with build_sensor_context(instance=instance, resources=resources) as context:
            ticked = defs.resolve_sensor_def("pg2iceberg_maintenance")(context)
        assert isinstance(ticked, SensorResult)
        (request,) = ticked.run_requests
        assert request.run_config == {"ops": {"pg2iceberg_maintain_table": {"config": {"table": "public.items"}}}}
        assert request.tags["pg2iceberg/tables"] == "public.items" and request.tags["pg2iceberg/table.public.items"]

        run = defs.resolve_job_def("pg2iceberg_maintenance").execute_in_process(
            run_config=request.run_config, instance=instance, tags=request.tags
        )
        assert run.success
        (observation,) = [event.event_specific_data.asset_observation for event in run.get_asset_observation_events()]
        health = measured_health(_table(pipeline), config.maintenance.target_file_size_bytes)
        assert observation.metadata["data_files"].value == health.data_files == 1
        assert observation.metadata["snapshots"].value == health.snapshots
        assert observation.metadata["delete_files"].value == 0

        source.execute("UPDATE items SET note = 'y' WHERE id < 10")
        pipeline.stream(until_caught_up=True)
        merged = materialize([live], instance=instance)
        checks = {e.check_name: e for e in merged.get_asset_check_evaluations()}
        assert checks[FILES_COMPACT].passed

        # The sensor's cursor: the compacted table is looked at again and is not due; merges since
        # the last tick make it due again.
        cursor = context.cursor
        with build_sensor_context(instance=instance, resources=resources, cursor=cursor) as context:
            assert isinstance(defs.resolve_sensor_def("pg2iceberg_maintenance")(context), SkipReason)
            cursor = context.cursor
        _churn(source, pipeline, 3)
        with build_sensor_context(instance=instance, resources=resources, cursor=cursor) as context:
            ticked = defs.resolve_sensor_def("pg2iceberg_maintenance")(context)
        assert isinstance(ticked, SensorResult)
        assert [r.tags["pg2iceberg/tables"] for r in ticked.run_requests] == ["public.items"]
    assert_mirrored(pipeline)


def test_the_maintenance_sensor_skips_a_pipeline_that_has_not_run_yet(source: SourceDb, tmp_path: Path) -> None:
    from dagster import SkipReason, build_sensor_context, instance_for_test

    from pg2iceberg_dagster.dagster_integration import Pg2IcebergResource, SparkResource, build_definitions

    source.execute("CREATE TABLE items (id int PRIMARY KEY, note text)")
    config = _config(source)
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    resource = Pg2IcebergResource(config_path=str(path))
    with (
        instance_for_test() as instance,
        build_sensor_context(
            instance=instance,
            resources={"pg2iceberg": resource, "pg2iceberg_spark": SparkResource(pg2iceberg=resource)},
        ) as context,
    ):
        ticked = build_definitions(path).resolve_sensor_def("pg2iceberg_maintenance")(context)
    assert isinstance(ticked, SkipReason) and "no table is due" in (ticked.skip_message or "")


def test_old_metadata_files_are_deleted_at_commit(source: SourceDb) -> None:
    """A mirror commits every few seconds, each commit a new metadata file: by default the files past
    the table's metadata log are deleted by the commit that drops them from it (Spark's and pyiceberg's
    alike), not left for orphan removal."""
    config = _config(source)
    iceberg = config.iceberg.model_dump(mode="json", exclude_none=True)
    iceberg["table_properties"]["write.metadata.previous-versions-max"] = "2"
    pipeline = _churned(source, source.config(["public.items"], iceberg=iceberg), 5)
    location = Path(_table(pipeline).location().removeprefix("file://")) / "metadata"
    assert len(list(location.glob("*.metadata.json"))) == 3  # the current one and the log's two
    assert_mirrored(pipeline)
