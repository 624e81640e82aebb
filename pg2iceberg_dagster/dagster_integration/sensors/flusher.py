"""The WAL flusher as a sensor: each tick streams for a bounded time, stages what committed, and
reports a materialization of each table's staged-log asset. The CLI ``stream`` runs the same flusher
as a long-lived process; only one can hold the slot, and the other is told so (skip, no crash loop).

The process that evaluates it (the code location server) also serves the pipeline's Prometheus
metrics when ``metrics.port`` is set (``pg2iceberg_dagster/metrics.py``)."""

from dagster import (
    AssetMaterialization,
    DefaultSensorStatus,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)

from pg2iceberg_dagster.errors import SlotBusyError
from pg2iceberg_dagster.pipeline import serve_metrics_once

from ..mirror import Mirror
from ..resources import Pg2IcebergResource
from .base import mirror_sensor

TICK_SECONDS = 20.0  # well under Dagster's 60 s sensor timeout


def flusher_sensor(mirror: Mirror, tick_seconds: float = TICK_SECONDS) -> SensorDefinition:
    """The mirror's flusher: each tick streams for at most ``tick_seconds``."""

    @mirror_sensor(
        mirror,
        "flusher",
        minimum_interval_seconds=5,
        default_status=DefaultSensorStatus.RUNNING,
        asset_selection=[mirror.key(table, "staged_log") for table in mirror.tables],
        description="Streams the replication slot into the staged log in bounded ticks.",
    )
    def _flusher(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        with pg2iceberg.pipeline() as pipeline:
            serve_metrics_once(pipeline.config)  # the first tick starts the endpoint, later ones pass
            try:
                tick = pipeline.flush_tick(max_seconds=tick_seconds)
            except SlotBusyError as exc:
                return SkipReason(str(exc))
        if tick is None:
            return SkipReason("waiting for the snapshot to create the replication slot")
        events = [
            AssetMaterialization(
                asset_key=mirror.key(table, "staged_log"),
                metadata={
                    "changes_staged": tick.staged[table.key][0],
                    "log_head": tick.staged[table.key][1].log_head,
                    "mat_cursor": tick.staged[table.key][1].mat_cursor,
                    "lag": tick.staged[table.key][1].changes,
                    "flushed_lsn": tick.flushed_lsn_text,
                    "flushed_lsn_bytes": tick.flushed_lsn,
                },
            )
            for table in mirror.tables
            if table.key in tick.staged
        ]
        context.update_cursor(tick.flushed_lsn_text)
        if not events:
            return SkipReason(f"no new changes; flushed_lsn {tick.flushed_lsn_text}")
        return SensorResult(asset_events=events)

    return _flusher
