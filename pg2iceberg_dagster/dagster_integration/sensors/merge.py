"""Launches the merges: every tick reads which live tables lag (two queries, however many tables) and
requests one run of the merge job (``<mirror>_merge``) for them all, each table tagged. A table is left
out while a merge run of it is queued or running, and until ``materialize.min_run_interval_seconds``
have passed since its last merge run was created: a busy table then merges several flushes per run
instead of paying a run's start-up for each. A run that has merged a table (its materialization is
recorded) and is only checking it no longer holds the table back: the next run's start-up overlaps
those checks, which compare a consistent pair of merge cursor and Iceberg snapshot whatever merges
after them (see ``checks.py``). A quiet table (nothing to merge) joins a run when it has
had none for ``checks.quiet_interval_seconds`` (by default half the freshness warn window): its checks
then say how it is now, rather than never running, and its materialization (no changes applied) is
what keeps its freshness policy satisfied."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

from dagster import (
    AssetKey,
    DagsterEventType,
    DagsterRun,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from pg2iceberg_dagster.pipeline import Pipeline

from ..assets import live_check_keys
from ..mirror import CHECKED_RUN_TAG, Mirror, table_run_tag
from ..resources import Pg2IcebergResource
from .base import UNFINISHED, mirror_sensor

# Dagster's sensor daemon looks for due sensors every 5 s (MIN_INTERVAL_LOOP_TIME). A minimum interval
# of 5 s would skip every other look (a look comes a few ms short of 5 s after the last tick: merges
# waited 10 s), so it is shorter, and each look evaluates the sensor. A tick with no run to request
# looks again every MERGE_WATCH_POLL_SECONDS for MERGE_WATCH_SECONDS, ending before the daemon's next
# look: a table that starts lagging (or whose run has merged it) waits about half a second for its
# run rather than up to 5 s.
MERGE_TICK_SECONDS = 1
MERGE_WATCH_SECONDS = 3.5
MERGE_WATCH_POLL_SECONDS = 0.5


def _merging(context: SensorEvaluationContext, job_name: str, live: Mapping[str, AssetKey]) -> set[str]:
    """Which of the tables ``live`` (table key -> its live asset) a queued or running run of
    ``job_name`` has still to merge: not those whose materialization the run has recorded (it is
    checking them). One query, and one per started run."""
    tags = {table_run_tag(key): key for key in live}
    runs = context.instance.get_runs(filters=RunsFilter(job_name=job_name, statuses=UNFINISHED))
    merging: set[str] = set()
    for run in runs:
        tables = {tags[tag] for tag in run.tags if tag in tags}
        if tables and run.status == DagsterRunStatus.STARTED:
            tables -= _merged_by(context, run.run_id, {live[key]: key for key in tables})
        merging |= tables
    return merging


def _merged_by(context: SensorEvaluationContext, run_id: str, tables: Mapping[AssetKey, str]) -> set[str]:
    """Which of ``tables`` (live asset -> table key) the run ``run_id`` has materialized so far."""
    events = context.instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    keys = {record.event_log_entry.dagster_event.asset_key for record in events if record.event_log_entry.dagster_event}
    return {table for key, table in tables.items() if key in keys}


def _run_within(context: SensorEvaluationContext, job_name: str, seconds: float, live: Iterable[str]) -> set[str]:
    """Which of the tables ``live`` had a run of ``job_name`` created in the last ``seconds`` (one query)."""
    tags = {table_run_tag(key): key for key in live}
    return {tags[tag] for run in _runs_within(context, job_name, seconds) for tag in run.tags if tag in tags}


def _checked_within(context: SensorEvaluationContext, job_name: str, seconds: float, live: Iterable[str]) -> set[str]:
    """Which of the tables ``live`` had their checks in a run of ``job_name`` created in the last
    ``seconds`` (one query)."""
    checked = {key for run in _runs_within(context, job_name, seconds) for key in _checked_by(run)}
    return checked & set(live)


def _checked_by(run: DagsterRun) -> list[str]:
    """The tables whose checks a merge run runs."""
    return [key for key in run.tags.get(CHECKED_RUN_TAG, "").split(",") if key]


def _runs_within(context: SensorEvaluationContext, job_name: str, seconds: float) -> list[DagsterRun]:
    """The runs of ``job_name`` created in the last ``seconds`` (none for 0)."""
    if seconds <= 0:
        return []
    since = datetime.fromtimestamp(time.time() - seconds, UTC)
    records = context.instance.get_run_records(filters=RunsFilter(job_name=job_name, created_after=since))
    return [record.dagster_run for record in records]


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
        watch_until = time.monotonic() + MERGE_WATCH_SECONDS
        with pg2iceberg.pipeline() as pipeline:
            while True:
                looked = _look(context, pipeline)
                if isinstance(looked, SensorResult) or time.monotonic() >= watch_until:
                    return looked
                time.sleep(MERGE_WATCH_POLL_SECONDS)

    def _look(context: SensorEvaluationContext, pipeline: Pipeline) -> SensorResult | SkipReason:
        """One look: the run to request now, or why none."""
        lagging = sorted(key for key in pipeline.tables_to_merge() if key in tables)
        quiet = sorted(key for key in pipeline.mergeable_tables() - set(lagging) if key in tables)
        interval = pipeline.config.materialize.min_run_interval_seconds
        quiet_interval = pipeline.config.quiet_interval()
        merging = _merging(context, job.name, {key: mirror.key(tables[key], "iceberg") for key in [*lagging, *quiet]})
        recent = _run_within(context, job.name, interval, lagging)
        waiting = [key for key in lagging if key not in merging and key in recent]
        ready = [key for key in lagging if key not in merging and key not in recent]
        checked = _checked_within(context, job.name, quiet_interval, quiet) if quiet_interval > 0 else set(quiet)
        due = [key for key in quiet if key not in merging and key not in checked]
        if not ready and not due:
            return SkipReason(
                f"lagging: {len(lagging)} tables; merging now: {len(merging)}; "
                f"merged less than {interval:g} s ago: {len(waiting)}; quiet and checked within "
                f"{quiet_interval:g} s: {len(quiet) - len(due)}"
            )
        # A quiet table joins for its checks; a lagging one's join when they are due.
        lately = _checked_within(context, job.name, pipeline.config.checks.min_interval_seconds, ready)
        checking = sorted([*(key for key in ready if key not in lately), *due])
        ready += due
        return SensorResult(
            run_requests=[
                RunRequest(
                    asset_selection=[written for key in ready for written in mirror.merged_keys(tables[key])],
                    asset_check_keys=[
                        check for key in checking for check in live_check_keys(mirror.key(tables[key], "iceberg"))
                    ],
                    tags={**mirror.run_tags(ready), **({CHECKED_RUN_TAG: ",".join(checking)} if checking else {})},
                )
            ]
        )

    return _merge
