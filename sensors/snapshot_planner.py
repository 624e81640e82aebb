"""Plans each table's CTID chunks (from its page count) and adds them as dynamic partitions; a chunk
that must be read again (its table started over in a new snapshot epoch) loses its materialization,
so the automation takes it again."""

from dagster import DefaultSensorStatus, SensorDefinition, SensorEvaluationContext, SensorResult, SkipReason, sensor

from assets.tables import partitions_def
from assets.translator import Pg2IcebergTranslator
from resources import Pg2IcebergResource


def snapshot_planner_sensor(translator: Pg2IcebergTranslator) -> SensorDefinition:
    @sensor(
        name="pg2iceberg_snapshot_planner",
        minimum_interval_seconds=30,
        default_status=DefaultSensorStatus.RUNNING,
        description="Stores each table's CTID chunk plan once and exposes it as snapshot partitions.",
    )
    def _planner(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        requests = []
        wiped: list[str] = []
        with pg2iceberg.pipeline() as pipeline:
            runner = pipeline.snapshot_runner()
            for table in translator.config.tables:
                chunks = pipeline.store.chunks(table.key) or runner.plan(runner.report.tables[table.key])
                partitions = partitions_def(translator, table)
                known = set(partitions.get_partition_keys(dynamic_partitions_store=context.instance))
                new = [chunk.partition_key for chunk in chunks if chunk.partition_key not in known]
                if new:
                    requests.append(partitions.build_add_request(new))
                key = translator.snapshot_key(table)
                redo = context.instance.get_materialized_partitions(key) & {
                    c.partition_key for c in chunks if not c.done
                }
                if redo:
                    context.instance.wipe_asset_partitions(key, sorted(redo))
                    wiped.append(f"{table.key}: {len(redo)}")
        if wiped:
            context.log.info(f"chunks to read again in a new snapshot epoch: {', '.join(wiped)}")
        if not requests:
            return SkipReason("every table's chunk partitions are registered")
        return SensorResult(dynamic_partitions_requests=requests)

    return _planner
