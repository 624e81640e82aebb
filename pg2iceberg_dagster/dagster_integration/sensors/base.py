"""What the mirror's sensors share: their pipeline resource, found under the mirror's key, and the runs
of a job already under way for a table (a sensor launches one at a time per table)."""

from collections.abc import Callable
from typing import Any

from dagster import (
    DagsterRunStatus,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from ..mirror import Mirror, table_run_tag
from ..resources import Pg2IcebergResource

UNFINISHED = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]

Tick = Callable[[SensorEvaluationContext, Pg2IcebergResource], SensorResult | SkipReason]


def mirror_sensor(mirror: Mirror, what: str, **sensor_args: Any) -> Callable[[Tick], SensorDefinition]:
    """``@sensor`` named ``<mirror>_<what>`` whose tick gets the mirror's pipeline resource."""

    def decorate(tick: Tick) -> SensorDefinition:
        # The resource key is the mirror's, so it cannot be a parameter name: it is declared and read
        # from the context. A direct invocation (tests) also passes it as a keyword, ignored here.
        @sensor(name=mirror.named(what), required_resource_keys={mirror.resource_key}, **sensor_args)
        def _tick(context: SensorEvaluationContext, **_direct: Any) -> SensorResult | SkipReason:
            return tick(context, mirror.pipeline_resource(context))

        return _tick

    return decorate


def run_in_flight(context: SensorEvaluationContext, job_name: str, table_key: str) -> bool:
    """Whether a run of ``job_name`` on the table ``table_key`` (its tag) is queued or running."""
    runs = context.instance.get_runs(
        filters=RunsFilter(job_name=job_name, statuses=UNFINISHED, tags={table_run_tag(table_key): "true"}),
        limit=1,
    )
    return bool(runs)


def job_in_flight(context: SensorEvaluationContext, job_name: str) -> bool:
    """Whether a run of ``job_name`` (on any table) is queued or running."""
    return bool(context.instance.get_runs(filters=RunsFilter(job_name=job_name, statuses=UNFINISHED), limit=1))
