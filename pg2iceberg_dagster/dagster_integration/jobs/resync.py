"""The online resync of one table as a job partitioned by table: launch it from the UI on a table's
partition, or let the resync sensor launch it when a merge found a change the WAL cannot follow.
The copy reports a materialization of the table's live Iceberg asset (its rows were replaced)."""

from dagster import AssetMaterialization, JobDefinition, MetadataValue, OpExecutionContext, op

from ..mirror import Mirror
from .per_table import per_table_job


def resync_job(mirror: Mirror) -> JobDefinition:
    """The mirror's resync job (``<name>_resync``): its partition names the table."""
    tables = {table.key: table for table in mirror.tables}

    @op(
        name=mirror.named("resync_table"),
        description="copy the table again under a new snapshot, switch it in one commit",
        required_resource_keys={mirror.resource_key},
    )
    def _resync(context: OpExecutionContext) -> None:
        table = tables[context.partition_key]
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
        "Resync one table online (pick the table as the partition): the others keep streaming "
        "and merging, readers see the old table until one Iceberg commit switches it.",
        _resync,
    )
