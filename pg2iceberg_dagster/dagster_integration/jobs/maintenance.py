"""Maintenance of one table, named by the run config (``table``): launched by the maintenance sensor
when a table is due (its interval passed, or its files call for compaction), or from the launchpad.
Each pass reports an observation of the table's Iceberg asset whose numbers the UI plots."""

from dagster import AssetObservation, JobDefinition, MetadataValue, OpExecutionContext, op

from ..mirror import Mirror
from .per_table import TABLE_CONFIG_SCHEMA, chosen_table, per_table_job


def maintenance_job(mirror: Mirror) -> JobDefinition:
    """The mirror's maintenance job (``<name>_maintenance``): the run config names the table."""

    @op(
        name=mirror.named("maintain_table"),
        config_schema=TABLE_CONFIG_SCHEMA,
        description="compact files, expire snapshots, delete orphan and applied staged files",
        required_resource_keys={mirror.resource_key, mirror.spark_resource_key},
    )
    def _maintain(context: OpExecutionContext) -> None:
        table = chosen_table(mirror, context)
        reason = context.run.tags.get("pg2iceberg/maintenance_reason", "requested")
        spark_factory = mirror.spark_resource(context).get_session
        with mirror.pipeline_resource(context).pipeline(spark_factory=spark_factory) as pipeline:
            (result,) = pipeline.maintain([table.key], reason=reason)
        if result.skipped:
            context.log.info("%s not maintained: %s", table.key, result.skipped)
            return
        assert result.after is not None
        context.log.info("maintained %s (%s) in %.1f s", table.key, reason, result.seconds)
        context.log_event(
            AssetObservation(
                asset_key=mirror.key(table, "iceberg"),
                description=f"maintained: {reason}",
                metadata={
                    "dagster/table_name": mirror.iceberg_table_name(table),
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
        mirror,
        "maintenance",
        "Maintain one table's Iceberg files (the run config's table names it): compaction, "
        "snapshot expiry, orphan files, applied staged files. Merges of the table wait while it runs.",
        _maintain,
    )
