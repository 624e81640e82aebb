"""What the per-table jobs share: one op on one table, chosen by the run config (``table``), not by a
partition: a partition per table made the UI count tables never resynced as "missing" and offer a
backfill that would resync every table. Each run is tagged with its table (``Mirror.run_tags``)."""

from collections.abc import Mapping
from typing import Any

from dagster import Failure, Field, JobDefinition, OpDefinition, OpExecutionContext, RunRequest, job

from pg2iceberg_dagster.config import TableConfig

from ..mirror import Mirror

# A resync copies a whole table and a maintenance pass rewrites its files: hours for a large one.
MAX_RUNTIME_SECONDS = 6 * 3600
# How many of the mirror's tables an error about an unknown one names.
_NAMED = 20

# The op config of a per-table job's op.
TABLE_CONFIG_SCHEMA = {"table": Field(str, description="the table, as schema.table (one of the mirror's tables)")}


def chosen_table(mirror: Mirror, context: OpExecutionContext) -> TableConfig:
    """The table the run's config names; an unknown table fails the run, naming the mirror's tables."""
    key = context.op_config["table"]
    for table in mirror.tables:
        if table.key == key:
            return table
    known = sorted(table.key for table in mirror.tables)
    listed = ", ".join(known[:_NAMED]) + (f" (and {len(known) - _NAMED} more)" if len(known) > _NAMED else "")
    raise Failure(
        f"unknown table {key!r}: the mirror {mirror.name!r} mirrors {listed or 'no table'}",
        allow_retries=False,
    )


def table_run_request(mirror: Mirror, job_def: JobDefinition, table_key: str, tags: Mapping[str, str]) -> RunRequest:
    """A run of the per-table job ``job_def`` on ``table_key``: its run config and tags."""
    (node,) = job_def.graph.nodes
    run_config: dict[str, Any] = {"ops": {node.name: {"config": {"table": table_key}}}}
    return RunRequest(run_config=run_config, tags={**mirror.run_tags([table_key]), **tags})


def per_table_job(mirror: Mirror, what: str, description: str, step: OpDefinition) -> JobDefinition:
    """The mirror's job ``what`` running ``step`` on the table its run config names."""

    @job(name=mirror.named(what), description=description, tags={"dagster/max_runtime": MAX_RUNTIME_SECONDS})
    def _job() -> None:
        step()

    return _job
