"""Plans each table's CTID chunks (from its page count) and adds them as dynamic partitions; chunks that
must be read again (their table started over in a new snapshot epoch, though Dagster shows them
materialized) are requested as one ranged run, which skips the chunks already done."""

from dagster import (
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from assets.tables import partitions_def
from assets.translator import Pg2IcebergTranslator
from resources import Pg2IcebergResource


def snapshot_planner_sensor(translator: Pg2IcebergTranslator) -> SensorDefinition:
    @sensor(
        name="pg2iceberg_snapshot_planner",
        minimum_interval_seconds=30,
        default_status=DefaultSensorStatus.RUNNING,
        description="Stores each table's CTID chunk plan once and exposes it as snapshot partitions; "
        "reruns chunks whose table started over under a new exported snapshot.",
        asset_selection=AssetSelection.assets(*[translator.snapshot_key(t) for t in translator.config.tables]),
    )
    def _planner(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        requests = []
        runs = []
        with pg2iceberg.pipeline() as pipeline:
            for table in translator.config.tables:
                plan = pipeline.snapshot_plan(table.key)
                chunks = plan.chunks
                partitions = partitions_def(translator, table)
                known = set(partitions.get_partition_keys(dynamic_partitions_store=context.instance))
                new = [chunk.partition_key for chunk in chunks if chunk.partition_key not in known]
                if new:
                    requests.append(partitions.build_add_request(new))
                key = translator.snapshot_key(table)
                materialized = context.instance.get_materialized_partitions(key)
                redo = [chunk for chunk in chunks if not chunk.done and chunk.partition_key in materialized]
                if redo:
                    runs.append(
                        RunRequest(
                            run_key=f"{table.key}:epoch-{plan.epoch}:read-again",
                            asset_selection=[key],
                            tags={
                                ASSET_PARTITION_RANGE_START_TAG: redo[0].partition_key,
                                ASSET_PARTITION_RANGE_END_TAG: redo[-1].partition_key,
                            },
                        )
                    )
        if not requests and not runs:
            return SkipReason("every table's chunk partitions are registered")
        return SensorResult(dynamic_partitions_requests=requests, run_requests=runs)

    return _planner
