"""A lost replication slot under Dagster (issue 31 part 2): the flusher stops and says who repairs it, the
repair sensor launches the repair job once, the job writes only each table's differences, and the
flusher streams again from the new slot. Real PostgreSQL, the job run in process as the daemon would;
no Spark (a copy-on-write repair is a pyiceberg commit)."""

from __future__ import annotations

from pathlib import Path

from dagster import SensorResult, SkipReason, instance_for_test

from pg2iceberg_dagster.dagster_integration import build_definitions
from pg2iceberg_dagster.dagster_integration.mirror import Mirror
from pg2iceberg_dagster.dagster_integration.sensors.flusher import flusher_sensor
from pg2iceberg_dagster.dagster_integration.translator import Pg2IcebergTranslator

from .conftest import SourceDb, assert_mirrored
from .test_dagster_health import _tick, _write_config


def test_slot_dropped_while_nothing_runs_is_repaired_by_the_sensor_and_flushing_resumes(
    source: SourceDb, tmp_path: Path
) -> None:
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.t SELECT g, 'v' || g FROM generate_series(1, 3000) g")
    config = source.config(["public.t"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    config_path = _write_config(config, tmp_path)
    defs = build_definitions(config_path)
    flusher = flusher_sensor(Mirror(Pg2IcebergTranslator(config)), tick_seconds=2.0)  # defs' ticks last 20 s
    repair = defs.resolve_sensor_def("pg2iceberg_repair")
    job = defs.resolve_job_def("pg2iceberg_repair")

    with instance_for_test() as instance:
        healthy = _tick(repair, instance, config_path)
        assert isinstance(healthy, SkipReason) and "healthy" in (healthy.skip_message or "")

        # Nothing runs: the slot is dropped, and the source changes while no slot records it.
        source.drop_slot(config.replication.slot)
        source.execute("UPDATE public.t SET v = 'changed' WHERE id <= 50")
        source.execute("DELETE FROM public.t WHERE id BETWEEN 101 AND 120")
        source.execute("INSERT INTO public.t SELECT g, 'new' FROM generate_series(5001, 5030) g")

        stopped = _tick(flusher, instance, config_path)
        message = stopped.skip_reason.skip_message
        assert message.startswith("flusher stopped: ") and "is gone" in message
        assert "pg2iceberg_repair launches pg2iceberg_repair" in message, message

        # The sensor asks for one repair: ticking again asks for the same run (its run key), so
        # Dagster launches it once.
        first, again = _tick(repair, instance, config_path), _tick(repair, instance, config_path)
        assert isinstance(first, SensorResult) and isinstance(again, SensorResult)
        (request,) = first.run_requests
        assert [r.run_key for r in again.run_requests] == [request.run_key]
        assert "is gone" in request.tags["pg2iceberg/repair_reason"]

        ran = job.execute_in_process(instance=instance, run_config=request.run_config, tags=request.tags)
        assert ran.success
        (event,) = ran.get_asset_materialization_events()
        metadata = event.materialization.metadata
        print(
            f"\nDagster repair: {metadata['rows_compared'].value} rows compared, "
            f"{metadata['rows_written'].value} written"
        )
        # The drift, not the table: 50 changed (deleted and written again), 20 deleted, 30 new.
        assert (metadata["rows_upserted"].value, metadata["rows_deleted"].value) == (80, 70)
        assert metadata["rows_compared"].value == 3010 + 3000

        assert_mirrored(pipeline)  # row by row, before anything streams again
        after = _tick(repair, instance, config_path)
        assert isinstance(after, SkipReason) and "healthy" in (after.skip_message or "")

        # Flushing resumes from the new slot: a change made after the repair is staged.
        source.execute("UPDATE public.t SET v = 'streamed' WHERE id <= 10")
        resumed = _tick(flusher, instance, config_path)
        assert resumed.skip_reason.skip_message.startswith("staged 10 changes of 1 tables")
