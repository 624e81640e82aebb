"""Launches the resync job for each table a merge found a change the WAL cannot follow in (one run
per table at a time)."""

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


def resync_sensor(mirror: Mirror, job: JobDefinition) -> SensorDefinition:
    """Launches ``job`` (the mirror's resync job) for each table waiting for a resync."""

    @mirror_sensor(
        mirror,
        "resync",
        job=job,
        minimum_interval_seconds=15,
        default_status=DefaultSensorStatus.RUNNING,
        description="Resyncs a table online when its merge found a change the WAL cannot follow "
        "(a type Iceberg cannot evolve into, a rewrite that changed older rows).",
    )
    def _resync(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        with pg2iceberg.pipeline() as pipeline:
            # A table waiting for a repair is the repair sensor's: a resync would copy all of it.
            repairs = set(pipeline.repairs_pending())
            pending = {key: reason for key, reason in pipeline.resyncs_pending().items() if key not in repairs}
        runs = []
        for table_key, reason in pending.items():
            if not run_in_flight(context, job.name, table_key):
                context.log.info("resync %s: %s", table_key, reason)
                runs.append(table_run_request(mirror, job, table_key, {"pg2iceberg/resync_reason": reason[:200]}))
        if not runs:
            return SkipReason("no table waits for a resync" if not pending else "its resync is running")
        return SensorResult(run_requests=runs)

    return _resync
