"""Maintenance of one table as a job partitioned by table: launched by the maintenance sensor when a
table is due (its interval passed, or its files call for compaction), or from the UI on a partition.
Each pass reports an observation of the table's Iceberg asset whose numbers the UI plots."""

from dagster import AssetObservation, JobDefinition, MetadataValue, OpExecutionContext, op

from assets.translator import Pg2IcebergTranslator
from resources import Pg2IcebergResource, SparkResource

from .per_table import per_table_job

MAINTENANCE_JOB = "pg2iceberg_maintenance"


def maintenance_job(translator: Pg2IcebergTranslator) -> JobDefinition:
    """The maintenance job: its partition names the table."""
    tables = {table.key: table for table in translator.config.tables}

    @op(name="maintain_table", description="compact files, expire snapshots, delete orphan and applied staged files")
    def _maintain(context: OpExecutionContext, pg2iceberg: Pg2IcebergResource, spark: SparkResource) -> None:
        table = tables[context.partition_key]
        reason = context.run.tags.get("pg2iceberg/maintenance_reason", "requested")
        with pg2iceberg.pipeline(spark_factory=spark.get_session) as pipeline:
            (result,) = pipeline.maintain([table.key], reason=reason)
        if result.skipped:
            context.log.info("%s not maintained: %s", table.key, result.skipped)
            return
        assert result.after is not None
        context.log.info("maintained %s (%s) in %.1f s", table.key, reason, result.seconds)
        context.log_event(
            AssetObservation(
                asset_key=translator.iceberg_key(table),
                description=f"maintained: {reason}",
                metadata={
                    "dagster/table_name": translator.iceberg_table_name(table),
                    **{name: value for name, value in result.after.as_dict().items() if value is not None},
                    **{name: value for name, value in vars(result.rewrites).items()},
                    "orphans_removed": result.orphans_removed,
                    "staged_files_removed": result.staged_files_removed,
                    "maintenance_seconds": round(result.seconds, 3),
                    "before": MetadataValue.json(result.before.as_dict() if result.before else {}),
                },
            )
        )

    return per_table_job(
        translator,
        MAINTENANCE_JOB,
        "Maintain one table's Iceberg files (pick the table as the partition): compaction, "
        "snapshot expiry, orphan files, applied staged files. Merges of the table wait while it runs.",
        _maintain,
    )
