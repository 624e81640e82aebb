"""What the per-table jobs share: one partition per configured table, one op on that table."""

from dagster import JobDefinition, OpDefinition, StaticPartitionsDefinition, job

from assets.translator import Pg2IcebergTranslator

# A resync copies a whole table and a maintenance pass rewrites its files: hours for a large one.
MAX_RUNTIME_SECONDS = 6 * 3600


def table_partitions(translator: Pg2IcebergTranslator) -> StaticPartitionsDefinition:
    """One partition per configured table (its ``schema.table`` key)."""
    return StaticPartitionsDefinition([table.key for table in translator.config.tables])


def per_table_job(translator: Pg2IcebergTranslator, name: str, description: str, step: OpDefinition) -> JobDefinition:
    """The job ``name`` running ``step`` on the table its run's partition names."""

    @job(
        name=name,
        partitions_def=table_partitions(translator),
        description=description,
        tags={"dagster/max_runtime": MAX_RUNTIME_SECONDS},
    )
    def _job() -> None:
        step()

    return _job
