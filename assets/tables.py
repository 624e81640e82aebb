"""Per configured table: the source (external), its staged log (reported by the flusher sensor), the
CTID-chunk partitioned snapshot, and the live Iceberg table merged by Spark, with its checks."""

import time
from collections.abc import Iterator
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetsDefinition,
    AssetSpec,
    BackfillPolicy,
    DynamicPartitionsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    TableColumn,
    TableSchema,
    asset,
)

from pg2iceberg_dagster.checks import duplicate_keys, schema_mismatches
from pg2iceberg_dagster.config import TableConfig
from pg2iceberg_dagster.iceberg.catalog import table_identifier
from pg2iceberg_dagster.materializer.merge import MergeResult
from pg2iceberg_dagster.source.catalog import modification_count
from pg2iceberg_dagster.source.connection import connect
from pg2iceberg_dagster.source.lsn import format_lsn
from resources import Pg2IcebergResource, SparkResource

from .automation import merge_condition, snapshot_condition
from .translator import Pg2IcebergTranslator

STATS_DELAY_SECONDS = 1.5
PK_UNIQUE = "primary_key_unique"
MATCHES_SOURCE = "matches_source"
SCHEMA_MATCHES = "schema_matches_source"


def partitions_def(translator: Pg2IcebergTranslator, table: TableConfig) -> DynamicPartitionsDefinition:
    """CTID chunk partitions of a table; keys are added by the planning sensor from the stored plan."""
    return DynamicPartitionsDefinition(name=translator.partitions_name(table))


def _table_schema(iceberg_table: Any) -> TableSchema:
    schema = iceberg_table.schema()
    key = {schema.find_field(i).name for i in schema.identifier_field_ids}
    return TableSchema(
        columns=[
            TableColumn(f.name, str(f.field_type), description="primary key" if f.name in key else None)
            for f in schema.fields
        ]
    )


def source_spec(translator: Pg2IcebergTranslator, table: TableConfig) -> AssetSpec:
    return AssetSpec(
        key=translator.source_key(table),
        group_name=translator.group_name(table),
        kinds={"postgres"},
        description=translator.description(table, "source"),
        metadata={"dagster/table_name": f"{translator.config.source.dbname}.{table.key}"},
    )


def staged_log_spec(translator: Pg2IcebergTranslator, table: TableConfig) -> AssetSpec:
    return AssetSpec(
        key=translator.staged_log_key(table),
        deps=[translator.source_key(table)],
        group_name=translator.group_name(table),
        kinds={"parquet"},
        description=translator.description(table, "staged_log"),
    )


def snapshot_asset(translator: Pg2IcebergTranslator, table: TableConfig, config_path: str) -> AssetsDefinition:
    @asset(
        name=translator.snapshot_key(table).path[-1],
        key_prefix=translator.snapshot_key(table).path[:-1],
        deps=[translator.source_key(table)],
        partitions_def=partitions_def(translator, table),
        backfill_policy=BackfillPolicy.single_run(),
        automation_condition=snapshot_condition(),
        group_name=translator.group_name(table),
        kinds={"iceberg", "postgres"},
        description=translator.description(table, "snapshot"),
        pool="pg2iceberg_snapshot",
    )
    def _snapshot(context: AssetExecutionContext, pg2iceberg: Pg2IcebergResource) -> MaterializeResult:
        with pg2iceberg.pipeline() as pipeline:
            runner = pipeline.snapshot_runner()
            result = runner.run_partitions(table.key, context.partition_keys)
            return MaterializeResult(
                metadata={
                    "rows_written": result.rows,
                    "chunks_run": result.chunks_run,
                    "chunks_already_done": result.chunks_skipped,
                    "snapshot_epoch": result.epoch if result.epoch is not None else -1,
                    "table_restarted": result.restarted,
                    "table_snapshot_complete": result.complete,
                    "dagster/table_name": translator.iceberg_table_name(table),
                }
            )

    return _snapshot


def _merge_metadata(
    translator: Pg2IcebergTranslator, table: TableConfig, result: MergeResult, pipeline: Any
) -> dict[str, Any]:
    iceberg_table = pipeline.catalog.load_table(table_identifier(pipeline.config, table))
    snapshot = iceberg_table.current_snapshot()
    summary = snapshot.summary.additional_properties if snapshot and snapshot.summary else {}
    return {
        "dagster/table_name": translator.iceberg_table_name(table),
        "dagster/column_schema": _table_schema(iceberg_table),
        "dagster/row_count": int(summary.get("total-records", 0)),
        "changes_applied": result.changes,
        "rows_upserted": result.upserts,
        "rows_deleted": result.deletes,
        "batches": result.batches,
        "mat_cursor": result.cursor,
        "log_head": result.head,
        "lag": result.lag,
        "last_lsn": format_lsn(result.last_lsn) if result.last_lsn else "none",
        "schema_changes": MetadataValue.json(list(result.schema_changes)),
        "iceberg_snapshot_id": str(result.snapshot_id or ""),
        "merge_seconds": round(result.seconds, 3),
        # Where the merge spent its time (read, fold, arrow, spark_start, spark_merge, commit).
        **{f"merge_{phase}_seconds": round(seconds, 3) for phase, seconds in result.timings.items()},
    }


def run_table_checks(pipeline: Any, table: TableConfig, key: Any) -> Iterator[AssetCheckResult]:
    """Primary keys unique; schema matches the source; content equals the source when there is no lag
    (a difference seen while the source is being written is reported as a warning)."""
    iceberg_table = pipeline.catalog.load_table(table_identifier(pipeline.config, table))
    duplicates, examples = duplicate_keys(iceberg_table)
    yield AssetCheckResult(
        asset_key=key,
        check_name=PK_UNIQUE,
        passed=duplicates == 0,
        metadata={"duplicate_keys": duplicates, "examples": MetadataValue.json([list(map(str, e)) for e in examples])},
    )
    report = pipeline.validate(refresh=True)
    source = report.tables[table.key]
    problems = schema_mismatches(source, iceberg_table)
    yield AssetCheckResult(
        asset_key=key,
        check_name=SCHEMA_MATCHES,
        passed=not problems,
        metadata={"problems": MetadataValue.json(problems)},
    )
    cursor, head = pipeline.materializer().lag(table.key)
    if head > cursor:
        yield AssetCheckResult(
            asset_key=key,
            check_name=MATCHES_SOURCE,
            passed=True,
            severity=AssetCheckSeverity.WARN,
            metadata={"compared": False, "lag": head - cursor},
        )
        return
    with connect(pipeline.config.source) as stats_conn:
        writes_before = modification_count(stats_conn, source.oid)
        started = time.monotonic()
        (diff,) = pipeline.verify([table.key], refresh=False)  # columns were just refreshed above
        # Statistics trail commits by up to a second: look again after that.
        time.sleep(max(0.0, STATS_DELAY_SECONDS - (time.monotonic() - started)))
        writes_in_flight = modification_count(stats_conn, source.oid) != writes_before
    yield AssetCheckResult(
        asset_key=key,
        check_name=MATCHES_SOURCE,
        passed=diff.ok,
        # A difference while the source is being written is not at a consistent point: a warning.
        severity=AssetCheckSeverity.WARN if writes_in_flight else AssetCheckSeverity.ERROR,
        metadata={
            "compared": True,
            "source_written_during_check": writes_in_flight,
            "pg_rows": diff.pg_rows,
            "iceberg_rows": diff.iceberg_rows,
            "only_in_pg": diff.only_in_pg,
            "only_in_iceberg": diff.only_in_iceberg,
            "different": diff.different,
        },
    )


def iceberg_asset(translator: Pg2IcebergTranslator, table: TableConfig, config_path: str) -> AssetsDefinition:
    key = translator.iceberg_key(table)

    @asset(
        name=key.path[-1],
        key_prefix=key.path[:-1],
        deps=[translator.snapshot_key(table), translator.staged_log_key(table)],
        group_name=translator.group_name(table),
        kinds={"iceberg", "spark"},
        description=translator.description(table, "iceberg"),
        automation_condition=merge_condition(config_path, table.key),
        check_specs=[
            AssetCheckSpec(PK_UNIQUE, asset=key, blocking=True, description="one row per primary key"),
            AssetCheckSpec(MATCHES_SOURCE, asset=key, description="rows equal the source when there is no lag"),
            AssetCheckSpec(SCHEMA_MATCHES, asset=key, description="columns and types match the source"),
        ],
        pool="pg2iceberg_merge",
    )
    def _merge(context: AssetExecutionContext, pg2iceberg: Pg2IcebergResource, spark: SparkResource) -> Iterator[Any]:
        with pg2iceberg.pipeline(spark_factory=spark.get_session) as pipeline:
            pipeline.validate()
            # A second round applies what was staged during the first, cold merge (this run's new JVM).
            result = pipeline.materializer().materialize_table(table.key, rounds=2)
            if result.waiting_for_snapshot:
                raise Failure(f"{table.key}: the snapshot is not complete yet; materialize its chunk partitions first")
            context.log.info("merged %s changes of %s; lag %s", result.changes, table.key, result.lag)
            yield MaterializeResult(metadata=_merge_metadata(translator, table, result, pipeline))
            yield from run_table_checks(pipeline, table, key)

    return _merge


def table_definitions(
    translator: Pg2IcebergTranslator, config_path: str
) -> tuple[list[AssetSpec], list[AssetsDefinition]]:
    """External specs and assets for every configured table."""
    specs: list[AssetSpec] = []
    assets: list[AssetsDefinition] = []
    for table in translator.config.tables:
        specs += [source_spec(translator, table), staged_log_spec(translator, table)]
        assets += [snapshot_asset(translator, table, config_path), iceberg_asset(translator, table, config_path)]
    return specs, assets
