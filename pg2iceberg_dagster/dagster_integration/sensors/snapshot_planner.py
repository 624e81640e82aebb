"""Plans each table's CTID chunks (from its page count), adds them as dynamic partitions and requests
the runs that read them: one ranged run per table for the chunks not done in its current snapshot
epoch (its new chunks, and those to read again when the table started over in a new epoch though
Dagster shows them materialized), which skips any chunk done meanwhile. The planner launches them
itself, not declarative automation: Dagster's evaluation of 200 tables' chunk partitions took 20-37 s
a tick, back to back, a core of two, long after every chunk was read; this look is the planner's own
queries and one for the runs in flight. Chunks read by another process (the CLI ``snapshot``,
``run``) are reported materialized, a tick before their partitions are added, so no run is launched
only to find them done. Once a table's snapshot is complete, its live table is reported materialized
(its data is complete)."""

import json

from dagster import (
    AddDynamicPartitionsRequest,
    AssetKey,
    AssetMaterialization,
    AssetSelection,
    DefaultSensorStatus,
    DeleteDynamicPartitionsRequest,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from pg2iceberg_dagster.config import TableConfig
from pg2iceberg_dagster.pipeline import Pipeline, SnapshotPlan

from ..mirror import Mirror
from ..resources import Pg2IcebergResource
from .base import UNFINISHED, mirror_sensor


def _chunks_to_read(
    mirror: Mirror, table: TableConfig, plan: SnapshotPlan, in_flight: set[AssetKey]
) -> RunRequest | None:
    """One ranged run for the table's chunks not done in its current epoch, unless a run of its
    snapshot is queued or going. Keyed by the table, epoch and range, and Dagster requests a key
    once: a run that failed having read no chunk is not requested again (it waits for a retry), one
    that read some is followed by a run of the rest."""
    key = mirror.key(table, "snapshot")
    todo = [chunk.partition_key for chunk in plan.chunks if not chunk.done]
    if plan.complete or not todo or key in in_flight:
        return None
    return RunRequest(
        run_key=f"{table.key}:epoch-{plan.epoch}:{todo[0]}...{todo[-1]}",
        asset_selection=[key],
        tags={ASSET_PARTITION_RANGE_START_TAG: todo[0], ASSET_PARTITION_RANGE_END_TAG: todo[-1]},
    )


def _assets_in_flight(context: SensorEvaluationContext) -> set[AssetKey]:
    """The assets selected by the runs queued or going (one query)."""
    runs = context.instance.get_runs(filters=RunsFilter(statuses=UNFINISHED))
    return {key for run in runs for key in run.asset_selection or ()}


def _done_elsewhere(
    mirror: Mirror, table: TableConfig, plan: SnapshotPlan, materialized: set[str]
) -> list[AssetMaterialization]:
    """The chunks of the table's current epoch that are done but that Dagster does not show
    materialized (read by the CLI, by ``run``, or by a run that has not reported yet), as
    materializations of their partitions. Reported a tick before the table's partitions are added
    (Dagster keeps the events for partitions added after), so the partitions keep the chunks' order
    and an automation condition of your own on them never sees these missing: an automation tick
    reads the materializations before the partitions, and over 200 tables it read them before the
    daemon had stored the events of the tick that added the partitions, and launched a run of every
    chunk."""
    return [
        AssetMaterialization(
            asset_key=mirror.key(table, "snapshot"),
            partition=chunk.partition_key,
            # No Dagster run read it (the UI shows no run): say who did, and what it wrote.
            description="read outside this Dagster run history: by the CLI (`snapshot`, `run`), or by a run "
            f"that ended before reporting it; reported by {mirror.named('snapshot_planner')}",
            metadata={
                "snapshot_epoch": chunk.epoch if chunk.epoch is not None else -1,
                "rows_written": chunk.rows if chunk.rows is not None else -1,
                "read_by": "another process of the pipeline (no Dagster run)",
                "reported_by": mirror.named("snapshot_planner"),
            },
        )
        for chunk in plan.chunks
        if chunk.done and chunk.epoch == plan.epoch and chunk.partition_key not in materialized
    ]


def _live_table_complete(
    context: SensorEvaluationContext,
    mirror: Mirror,
    table: TableConfig,
    plan: SnapshotPlan,
    materialized: set[str],
    pipeline: Pipeline,
) -> AssetMaterialization | None:
    """The live table's first materialization, once its snapshot is complete: its data is there even
    when no change has come since (then no merge ever runs to say so). Not before Dagster shows every
    chunk partition ``materialized`` (a snapshot completed by the CLI is), or the live table would
    read as older than its snapshot ("Unsynced")."""
    live = mirror.key(table, "iceberg")
    if not plan.complete or any(chunk.partition_key not in materialized for chunk in plan.chunks):
        return None
    if context.instance.get_latest_materialization_event(live) is not None:
        return None
    summary = pipeline.iceberg_summary(table.key)
    lag = pipeline.lag(table.key)
    return AssetMaterialization(
        asset_key=live,
        description="the initial snapshot is complete",
        metadata={
            "dagster/table_name": mirror.iceberg_table_name(table),
            "dagster/row_count": summary.row_count,
            "snapshot_epoch": plan.epoch if plan.epoch is not None else -1,
            "mat_cursor": lag.mat_cursor,
            "log_head": lag.log_head,
            "lag": lag.changes,
            "iceberg_snapshot_id": str(summary.snapshot_id or ""),
        },
    )


def snapshot_planner_sensor(mirror: Mirror) -> SensorDefinition:
    """The mirror's planner of CTID-chunk partitions."""

    @mirror_sensor(
        mirror,
        "snapshot_planner",
        minimum_interval_seconds=30,
        default_status=DefaultSensorStatus.RUNNING,
        description="Stores each table's CTID chunk plan once, exposes it as snapshot partitions and "
        "requests one run per table of the chunks not read yet (again when the table started over under "
        "a new exported snapshot); reports the live table once its snapshot is complete; stops mirroring "
        "tables removed from the config (their chunk partitions, state and staged files go; their "
        "Iceberg tables stay).",
        asset_selection=AssetSelection.assets(*[mirror.key(table, "snapshot") for table in mirror.tables]),
    )
    def _planner(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        requests: list[AddDynamicPartitionsRequest | DeleteDynamicPartitionsRequest] = []
        runs, events = [], []
        # The cursor: the tables whose snapshot was complete, every chunk shown materialized and the
        # live table reported, by epoch. Nothing is left to do for them while their epoch stands, so
        # they cost no Dagster query: at 200 tables those took 6 s a tick (24 s on busy cores).
        settled: dict[str, int | None] = json.loads(context.cursor) if context.cursor else {}
        with pg2iceberg.pipeline() as pipeline:
            # Tables gone from the config: stop mirroring them, and their chunk partitions go too.
            for removed in pipeline.forget_removed_tables():
                name = mirror.partitions_name(removed)
                if stale := context.instance.get_dynamic_partitions(name):
                    requests.append(DeleteDynamicPartitionsRequest(partitions_def_name=name, partition_keys=stale))
            configured = {table.key for table in pipeline.config.tables}
            complete = pipeline.completed_snapshots()
            settled = {key: epoch for key, epoch in settled.items() if key in complete and complete[key] == epoch}
            in_flight = _assets_in_flight(context)
            for table in mirror.tables:
                if table.key not in configured or table.key in settled:
                    continue  # removed from the file (still in this graph until the code location reloads), or done
                plan = pipeline.snapshot_plan(table.key)
                partitions = mirror.partitions_def(table)
                known = set(partitions.get_partition_keys(dynamic_partitions_store=context.instance))
                materialized = context.instance.get_materialized_partitions(mirror.key(table, "snapshot"))
                reported = _done_elsewhere(mirror, table, plan, materialized)
                events += reported
                materialized |= {event.partition for event in reported if event.partition}
                new = [chunk.partition_key for chunk in plan.chunks if chunk.partition_key not in known]
                if not (reported and new):  # else its partitions and run come next tick, once these are stored
                    if new:
                        requests.append(partitions.build_add_request(new))
                    if run := _chunks_to_read(mirror, table, plan, in_flight):
                        runs.append(run)
                if event := _live_table_complete(context, mirror, table, plan, materialized, pipeline):
                    events.append(event)
                if plan.complete and all(c.partition_key in known & materialized for c in plan.chunks):
                    settled[table.key] = plan.epoch  # its live table reported, now or before
        context.update_cursor(json.dumps(settled, sort_keys=True))
        if not requests and not runs and not events:
            return SkipReason("every table's chunk partitions are registered and read")
        return SensorResult(dynamic_partitions_requests=requests, run_requests=runs, asset_events=events)

    return _planner
