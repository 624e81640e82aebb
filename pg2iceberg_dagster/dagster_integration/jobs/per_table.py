"""What the per-table jobs share: one partition per configured table, one op on that table."""

from dagster import JobDefinition, OpDefinition, StaticPartitionsDefinition, job

from ..mirror import Mirror

# A resync copies a whole table and a maintenance pass rewrites its files: hours for a large one.
MAX_RUNTIME_SECONDS = 6 * 3600


def table_partitions(mirror: Mirror) -> StaticPartitionsDefinition:
    """One partition per configured table (its ``schema.table`` key)."""
    return StaticPartitionsDefinition([table.key for table in mirror.tables])


def per_table_job(mirror: Mirror, what: str, description: str, step: OpDefinition) -> JobDefinition:
    """The mirror's job ``what`` running ``step`` on the table its run's partition names."""

    @job(
        name=mirror.named(what),
        partitions_def=table_partitions(mirror),
        description=description,
        tags={"dagster/max_runtime": MAX_RUNTIME_SECONDS},
    )
    def _job() -> None:
        step()

    return _job
