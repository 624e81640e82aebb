"""Launches the maintenance job for each table that is due: its ``maintenance.interval_minutes``
passed, or its files call for compaction (one run per table at a time)."""

import json

from dagster import (
    DefaultSensorStatus,
    JobDefinition,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)

from ..jobs.per_table import table_run_request
from ..mirror import Mirror
from ..resources import Pg2IcebergResource
from .base import mirror_sensor, run_in_flight


def maintenance_sensor(mirror: Mirror, job: JobDefinition) -> SensorDefinition:
    """Launches ``job`` (the mirror's maintenance job) for each table that is due."""
    enabled = mirror.config.maintenance.enabled

    @mirror_sensor(
        mirror,
        "maintenance",
        job=job,
        minimum_interval_seconds=60,
        default_status=DefaultSensorStatus.RUNNING if enabled else DefaultSensorStatus.STOPPED,
        description="Maintains a table's Iceberg files when it is due: on its interval, or sooner when "
        "small files or delete files pile up (maintenance.* in the pipeline config).",
    )
    def _maintenance(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        # The cursor holds each table's mat_cursor at the last tick: only tables merged since have
        # their files read. A due table is left out of it, so the next tick looks at it again.
        seen = json.loads(context.cursor) if context.cursor else None
        with pg2iceberg.pipeline() as pipeline:
            due, cursors = pipeline.maintenance_due(seen)
        context.update_cursor(json.dumps({key: at for key, at in cursors.items() if key not in due}))
        runs = [
            table_run_request(mirror, job, key, {"pg2iceberg/maintenance_reason": reason[:200]})
            for key, reason in due.items()
            if not run_in_flight(context, job.name, key)
        ]
        if not runs:
            return SkipReason("no table is due for maintenance" if not due else "its maintenance is running")
        return SensorResult(run_requests=runs)

    return _maintenance
