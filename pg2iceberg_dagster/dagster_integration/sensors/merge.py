"""Launches the merges: every tick reads which live tables lag (two queries, however many tables) and
requests one run of the merge job (``<mirror>_merge``) for them all, each table tagged. A table is left
out while a merge run of it is queued or running, and until ``materialize.min_run_interval_seconds``
have passed since its last merge run was created: a busy table then merges several flushes per run
instead of paying a run's start-up for each. A quiet table (nothing to merge) joins a run when it has
had none for ``checks.quiet_interval_seconds`` (by default half the freshness warn window): its checks
then say how it is now, rather than never running, and its materialization (no changes applied) is
what keeps its freshness policy satisfied."""

from __future__ import annotations

import time
from collections.abc import Iterable

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from ..assets import live_check_keys
from ..mirror import Mirror, table_run_tag
from ..resources import Pg2IcebergResource
from .base import UNFINISHED, mirror_sensor

# Every 5 s rather than Dagster's 30 s default: a merge waits for the next tick. (Dagster's sensor
# daemon evaluates sensors at most every 5 s, MIN_INTERVAL_LOOP_TIME: a shorter interval gains nothing.)
MERGE_TICK_SECONDS = 5


def _merging(context: SensorEvaluationContext, job_name: str, tables: Iterable[str]) -> set[str]:
    """Which of ``tables`` a queued or running run of ``job_name`` merges (one query)."""
    tags = {table_run_tag(key): key for key in tables}
    runs = context.instance.get_runs(filters=RunsFilter(job_name=job_name, statuses=UNFINISHED))
    return {tags[tag] for run in runs for tag in run.tags if tag in tags}


def _seconds_since_last_run(context: SensorEvaluationContext, job_name: str, table_key: str) -> float | None:
    """Seconds since the last run of ``job_name`` on ``table_key`` was created (None: never)."""
    records = context.instance.get_run_records(
        filters=RunsFilter(job_name=job_name, tags={table_run_tag(table_key): "true"}), limit=1
    )
    return time.time() - records[0].create_timestamp.timestamp() if records else None


def _quiet_due(context: SensorEvaluationContext, job_name: str, table_key: str, interval: float) -> bool:
    """Whether the quiet ``table_key`` had no merge run (so no checks) for ``interval`` seconds."""
    since = _seconds_since_last_run(context, job_name, table_key)
    return since is None or since >= interval


def merge_sensor(mirror: Mirror, job: UnresolvedAssetJobDefinition) -> SensorDefinition:
    """The mirror's merge sensor (``<mirror>_merge``), launching ``job`` (the merge job)."""
    tables = {table.key: table for table in mirror.tables}

    @mirror_sensor(
        mirror,
        "merge",
        job=job,
        minimum_interval_seconds=MERGE_TICK_SECONDS,
        default_status=DefaultSensorStatus.RUNNING,
        description="Launches one run of the merge job for the live tables whose staged log is ahead of "
        "Iceberg (snapshot complete, no resync pending), leaving out a table whose merge run is still "
        "in progress or started less than materialize.min_run_interval_seconds ago; a quiet table joins "
        "a run every checks.quiet_interval_seconds, for its checks and freshness.",
    )
    def _merge(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        with pg2iceberg.pipeline() as pipeline:
            lagging = sorted(key for key in pipeline.tables_to_merge() if key in tables)
            quiet = sorted(key for key in pipeline.mergeable_tables() - set(lagging) if key in tables)
            interval = pipeline.config.materialize.min_run_interval_seconds
            quiet_interval = pipeline.config.quiet_interval()
        merging = _merging(context, job.name, [*lagging, *quiet])
        waiting: list[str] = []
        ready: list[str] = []
        for key in lagging:
            if key in merging:
                continue
            since = _seconds_since_last_run(context, job.name, key) if interval > 0 else None
            (waiting if since is not None and since < interval else ready).append(key)
        due = [
            key
            for key in quiet
            if quiet_interval > 0 and key not in merging and _quiet_due(context, job.name, key, quiet_interval)
        ]
        if not ready and not due:
            return SkipReason(
                f"lagging: {len(lagging)} tables; merging now: {len(merging)}; "
                f"merged less than {interval:g} s ago: {len(waiting)}; quiet and checked within "
                f"{quiet_interval:g} s: {len(quiet) - len(due)}"
            )
        ready += due
        keys = [mirror.key(tables[key], "iceberg") for key in ready]
        return SensorResult(
            run_requests=[
                RunRequest(
                    asset_selection=[written for key in ready for written in mirror.merged_keys(tables[key])],
                    asset_check_keys=[check for key in keys for check in live_check_keys(key)],
                    tags=mirror.run_tags(ready),
                )
            ]
        )

    return _merge
