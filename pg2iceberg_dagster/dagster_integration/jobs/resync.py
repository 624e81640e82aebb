"""The online resync of one table: launch it from the UI's launchpad with the table in its run config
(``ops: {<mirror>_resync_table: {config: {table: public.orders}}}``), or let the resync sensor launch
it when a merge found a change the WAL cannot follow.
The copy reports a materialization of the table's live Iceberg asset (its rows were replaced)."""

from dagster import AssetMaterialization, JobDefinition, MetadataValue, OpExecutionContext, op

from ..mirror import Mirror
from .per_table import TABLE_CONFIG_SCHEMA, chosen_table, per_table_job


def resync_job(mirror: Mirror) -> JobDefinition:
    """The mirror's resync job (``<name>_resync``): the run config names the table."""

    @op(
        name=mirror.named("resync_table"),
        config_schema=TABLE_CONFIG_SCHEMA,
        description="copy the table again under a new snapshot, switch it in one commit",
        required_resource_keys={mirror.resource_key},
    )
    def _resync(context: OpExecutionContext) -> None:
        table = chosen_table(mirror, context)
        with mirror.pipeline_resource(context).pipeline() as pipeline:
            result = pipeline.resync(table.key)
            summary = pipeline.iceberg_summary(table.key)
        context.log.info("resynced %s: %s rows in %s chunks", table.key, result.rows, result.chunks)
        context.log_event(
            AssetMaterialization(
                asset_key=mirror.key(table, "iceberg"),
                description=f"resynced online: {result.reason}",
                metadata={
                    "dagster/table_name": mirror.iceberg_table_name(table),
                    "dagster/row_count": summary.row_count,
                    "resync_reason": result.reason,
                    "rows_copied": result.rows,
                    "chunks": result.chunks,
                    "snapshot_epoch": result.epoch if result.epoch is not None else -1,
                    "schema_changes": MetadataValue.json(list(result.schema_changes)),
                    "iceberg_snapshot_id": str(summary.snapshot_id or ""),
                    "resync_seconds": round(result.seconds, 3),
                },
            )
        )

    return per_table_job(
        mirror,
        "resync",
        "Resync one table online (the run config's table names it): the others keep streaming "
        "and merging, readers see the old table until one Iceberg commit switches it.",
        _resync,
    )
