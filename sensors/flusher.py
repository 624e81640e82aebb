"""The WAL flusher as a sensor: each tick streams for a bounded time, stages what committed, and
reports a materialization of each table's staged-log asset. The CLI ``stream`` runs the same flusher
as a long-lived process; only one can hold the slot, and the other is told so (skip, no crash loop)."""

from dagster import (
    AssetMaterialization,
    DefaultSensorStatus,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from assets.translator import Pg2IcebergTranslator
from pg2iceberg_dagster.errors import SlotBusyError
from pg2iceberg_dagster.source.lsn import format_lsn
from resources import Pg2IcebergResource

TICK_SECONDS = 20.0  # well under Dagster's 60 s sensor timeout


def flusher_sensor(translator: Pg2IcebergTranslator, tick_seconds: float = TICK_SECONDS) -> SensorDefinition:
    staged_keys = [translator.staged_log_key(t) for t in translator.config.tables]

    @sensor(
        name="pg2iceberg_flusher",
        minimum_interval_seconds=5,
        default_status=DefaultSensorStatus.RUNNING,
        asset_selection=staged_keys,
        description="Streams the replication slot into the staged log in bounded ticks.",
    )
    def _flusher(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        with pg2iceberg.pipeline() as pipeline:
            pipeline.store.migrate()
            if pipeline.store.flushed_lsn() is None:
                return SkipReason("waiting for the snapshot to create the replication slot")
            try:
                stats = pipeline.stream(max_seconds=tick_seconds)
            except SlotBusyError as exc:
                return SkipReason(str(exc))
            events = []
            group = pipeline.config.materialize.group
            for table in pipeline.config.tables:
                staged = stats.rows_by_table.get(table.key, 0)
                if not staged:
                    continue
                head = pipeline.store.log_head(table.key)
                cursor = pipeline.store.mat_cursor(group, table.key)
                events.append(
                    AssetMaterialization(
                        asset_key=translator.staged_log_key(table),
                        metadata={
                            "changes_staged": staged,
                            "log_head": head,
                            "mat_cursor": cursor,
                            "lag": head - cursor,
                            "flushed_lsn": format_lsn(stats.flushed_lsn),
                            "flushed_lsn_bytes": stats.flushed_lsn,
                        },
                    )
                )
        context.update_cursor(format_lsn(stats.flushed_lsn))
        if not events:
            return SkipReason(f"no new changes; flushed_lsn {format_lsn(stats.flushed_lsn)}")
        return SensorResult(asset_events=events)

    return _flusher
