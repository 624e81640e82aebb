"""Runs of a job already under way for a partition: a sensor launches one at a time per table."""

from dagster import DagsterRunStatus, RunsFilter, SensorEvaluationContext

_UNFINISHED = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]


def run_in_flight(context: SensorEvaluationContext, job_name: str, partition_key: str) -> bool:
    """Whether a run of ``job_name`` for ``partition_key`` is queued or running."""
    runs = context.instance.get_runs(
        filters=RunsFilter(job_name=job_name, statuses=_UNFINISHED, tags={"dagster/partition": partition_key}),
        limit=1,
    )
    return bool(runs)
