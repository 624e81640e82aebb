"""The repair of a lost replication slot, or of one table: launched by the repair sensor when the slot
is lost (``replication.on_slot_lost: repair``) or a repair is pending, or from the launchpad with a
table in its run config (``ops: {<mirror>_repair_tables: {config: {table: public.orders}}}``) to repair
one ``verify`` or the ``matches_source`` check found different. Each repaired table reports a
materialization of its live Iceberg asset: rows compared and rows written (its differences only)."""

from dagster import AssetMaterialization, Field, JobDefinition, OpExecutionContext, op

from pg2iceberg_dagster.pipeline import TableRepairResult

from ..mirror import Mirror
from .per_table import chosen_table, per_table_job

REPAIR_CONFIG_SCHEMA = {
    "table": Field(
        str,
        is_required=False,
        description="the table to repair, as schema.table; left out: every table when the slot is lost, else "
        "the tables whose repair is pending",
    )
}


def _repaired(mirror: Mirror, result: TableRepairResult) -> AssetMaterialization:
    """The table's live asset after its repair: what was compared and written."""
    table = next(table for table in mirror.tables if table.key == result.table)
    return AssetMaterialization(
        asset_key=mirror.key(table, "iceberg"),
        description="repaired: only its differences from the source written"
        if not result.resumed
        else "repaired (written before an interruption, or by another process)",
        metadata={
            "dagster/table_name": mirror.iceberg_table_name(table),
            "rows_compared": result.rows_compared,
            "rows_written": result.rows_written,
            "rows_upserted": result.upserted,
            "rows_deleted": result.deleted,
            "snapshot_epoch": result.epoch if result.epoch is not None else -1,
            "iceberg_snapshot_id": str(result.snapshot_id or ""),
            "repair_seconds": round(result.seconds, 3),
        },
    )


def _report(context: OpExecutionContext, mirror: Mirror, done: TableRepairResult) -> None:
    """A table's repair as the run reports it: its materialization, or why it was left to a resync
    (the resync sensor launches that)."""
    if done.left_to_resync:
        context.log.warning("%s left to an online resync: %s", done.table, done.left_to_resync)
    else:
        context.log_event(_repaired(mirror, done))


def repair_job(mirror: Mirror) -> JobDefinition:
    """The mirror's repair job (``<name>_repair``): the run config may name one table."""

    @op(
        name=mirror.named("repair_tables"),
        config_schema=REPAIR_CONFIG_SCHEMA,
        description="replace a lost slot with a new one and write into each table only its differences from "
        "the source (or repair the table named)",
        required_resource_keys={mirror.resource_key, mirror.spark_resource_key},
    )
    def _repair(context: OpExecutionContext) -> None:
        keys = [chosen_table(mirror, context).key] if "table" in context.op_config else None
        spark_factory = mirror.spark_resource(context).get_session
        with mirror.pipeline_resource(context).pipeline(spark_factory=spark_factory) as pipeline:
            result = pipeline.repair(keys, on_table=lambda done: _report(context, mirror, done))
            slot = pipeline.config.replication.slot
        if result.slot_lost:
            context.log.warning("replication slot %s %s: replaced by a new one", slot, result.slot_lost)
        for done in result.tables:
            context.log.info("%s: %d rows compared, %d written", done.table, done.rows_compared, done.rows_written)
        for key, reason in result.left_to_resync.items():
            context.log.warning("%s left to its online resync (%s)", key, reason)
        if not result.tables and not result.slot_lost:
            context.log.info("the slot is healthy and no repair is pending")

    return per_table_job(
        mirror,
        "repair",
        "Repair the mirror without a new snapshot: a lost replication slot is replaced and every table "
        "compared with the source, writing only its differences in one Iceberg commit per table; or the "
        "table the run config names. Launched by the repair sensor when the slot is lost.",
        _repair,
    )
