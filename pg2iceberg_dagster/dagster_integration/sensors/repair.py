"""Launches the repair job when the replication slot is lost (gone, its WAL removed, or invalidated)
and ``replication.on_slot_lost`` is ``repair``, or when a table's repair is pending (requested, or
interrupted). Each need is launched once: its run key changes only when the slot is replaced or a
table's repair made progress, so a failed run is not relaunched in a loop (re-execute it, or run
``pg2iceberg-dagster repair``). The flusher sensor waits while a repair run is under way, and streams
again from the new slot once it is done."""

from dagster import (
    DefaultSensorStatus,
    JobDefinition,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)

from ..mirror import Mirror
from ..resources import Pg2IcebergResource
from .base import job_in_flight, mirror_sensor

REPAIR_REASON_TAG = "pg2iceberg/repair_reason"


def repair_sensor(mirror: Mirror, job: JobDefinition) -> SensorDefinition:
    """Launches ``job`` (the mirror's repair job) when the slot is lost or a repair is pending."""

    @mirror_sensor(
        mirror,
        "repair",
        job=job,
        minimum_interval_seconds=15,
        default_status=DefaultSensorStatus.RUNNING,
        description="Repairs the mirror when its replication slot is lost (replication.on_slot_lost: repair): "
        "a new slot, and only each table's differences from the source written; also finishes a repair "
        "that was requested or interrupted.",
    )
    def _repair(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        if job_in_flight(context, job.name):
            return SkipReason("a repair run is under way")
        with pg2iceberg.pipeline() as pipeline:
            if pipeline.config.replication.on_slot_lost != "repair":
                return SkipReason(
                    "replication.on_slot_lost is refuse: a lost slot waits for `pg2iceberg-dagster repair`"
                )
            due = pipeline.repair_due()
        if due is None:
            return SkipReason("the slot is healthy and no repair is pending")
        context.log.warning("repair: %s", due.reason)
        return SensorResult(
            run_requests=[
                RunRequest(run_key=due.key, tags={**mirror.run_tags(due.tables), REPAIR_REASON_TAG: due.reason[:200]})
            ]
        )

    return _repair
