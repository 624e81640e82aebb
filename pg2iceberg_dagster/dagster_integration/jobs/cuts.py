"""Consistent cuts in Dagster (docs/cuts.md): a job that takes one, of every configured group (or of
all tables when there is no group), and a schedule that runs it every ``cuts.interval_minutes``.
Each cut reports an observation of every cut table's live Iceberg asset naming the cut (tag, source
LSN, time, tables), so the asset's page shows the latest cut its table is in."""

from typing import Any

from dagster import (
    AssetObservation,
    DefaultScheduleStatus,
    JobDefinition,
    MetadataValue,
    OpExecutionContext,
    ScheduleDefinition,
    in_process_executor,
    job,
    op,
)

from pg2iceberg_dagster.config import CutsConfig
from pg2iceberg_dagster.pipeline import Cut

from ..mirror import MIRROR_RUN_TAG, Mirror


def cut_metadata(cut: Cut) -> dict[str, Any]:
    """The Dagster metadata of a cut (numbers the UI can plot: the LSN as an integer too)."""
    return {
        "cut_name": cut.name,
        "cut_lsn": cut.as_json()["lsn"],
        "cut_lsn_int": cut.lsn,
        "cut_taken_at": cut.taken_at.isoformat(),
        "cut_group": cut.group or "",
        "cut_tables": MetadataValue.json(list(cut.tables)),
    }


def cuts_job(mirror: Mirror) -> JobDefinition:
    """The mirror's cut job (``<name>_cut``): a cut of each group of ``cuts.groups`` (all tables without)."""

    @op(
        name=mirror.named("take_cuts"),
        description="bring each group's tables up to one source LSN and tag them with one name",
        required_resource_keys={mirror.resource_key, mirror.spark_resource_key},
    )
    def _take_cuts(context: OpExecutionContext) -> None:
        groups: list[str | None] = [*mirror.config.cuts.groups] or [None]
        spark_factory = mirror.spark_resource(context).get_session
        by_key = {table.key: table for table in mirror.tables}
        with mirror.pipeline_resource(context).pipeline(spark_factory=spark_factory) as pipeline:
            for group in groups:
                cut = pipeline.cut(group=group)
                context.log.info("cut %s: %d tables at source LSN %s", cut.name, len(cut.tables), cut.as_json()["lsn"])
                for key in cut.tables:
                    context.log_event(
                        AssetObservation(
                            asset_key=mirror.key(by_key[key], "iceberg"),
                            description=f"in cut {cut.name}",
                            metadata={**cut_metadata(cut), "cut_snapshot_id": str(cut.snapshots[key])},
                        )
                    )

    @job(
        name=mirror.named("cut"),
        executor_def=in_process_executor,  # one op: a second process would only import the code location again
        tags={MIRROR_RUN_TAG: mirror.name},
        description="Take a consistent cut: every table (of each cuts.groups group) complete up to one "
        "source LSN, tagged with one name (read it with VERSION AS OF '<name>'). Merges wait meanwhile.",
    )
    def _cut_job() -> None:
        _take_cuts()

    return _cut_job


def cron_of(cuts: CutsConfig) -> str:
    """``cuts.interval_minutes`` as a cron schedule (the config allows minutes dividing an hour, or
    whole hours dividing a day)."""
    minutes = int(cuts.interval_minutes or 60)
    return f"*/{minutes} * * * *" if minutes < 60 else f"0 */{minutes // 60} * * *"


def cuts_schedule(mirror: Mirror, cut_job: JobDefinition) -> ScheduleDefinition | None:
    """The schedule that runs the cut job every ``cuts.interval_minutes`` (None when unset)."""
    cuts = mirror.config.cuts
    if cuts.interval_minutes is None:
        return None
    return ScheduleDefinition(
        name=mirror.named("cut_schedule"),
        job=cut_job,
        cron_schedule=cron_of(cuts),
        default_status=DefaultScheduleStatus.RUNNING,
        description=f"a consistent cut every {cuts.interval_minutes:g} minutes (cuts.interval_minutes)",
    )
