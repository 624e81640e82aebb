"""Per configured table: the source (external), its staged log (reported by the flusher sensor), the
CTID-chunk partitioned snapshot, and the live Iceberg table merged by Spark, with its checks."""

from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from dagster import (
    AssetCheckKey,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    AssetSpec,
    BackfillPolicy,
    Failure,
    MaterializeResult,
    MetadataValue,
    TableColumn,
    TableSchema,
    multi_asset,
)

from pg2iceberg_dagster.config import MaintenanceConfig, TableConfig
from pg2iceberg_dagster.pipeline import (
    IcebergTableSummary,
    MergeResult,
    Pipeline,
    TableCheckReport,
    TableHealth,
    compaction_due,
)

from .mirror import Mirror
from .translator import HISTORY

PK_UNIQUE = "primary_key_unique"
MATCHES_SOURCE = "matches_source"
SCHEMA_MATCHES = "schema_matches_source"
FILES_COMPACT = "files_compact"


def _table_schema(mirror: Mirror, table: TableConfig, summary: IcebergTableSummary) -> TableSchema:
    """The Iceberg table's columns (excluded ones are not there), each described by the translator."""
    describe = mirror.translator.column_description
    return TableSchema(
        columns=[
            TableColumn(name, type_name, description=describe(table, name, in_key))
            for name, type_name, in_key in summary.columns
        ]
    )


def snapshot_asset(mirror: Mirror, table: TableConfig) -> AssetsDefinition:
    """The table's snapshot, one partition per CTID chunk; a run of a range of chunks reads them under
    one exported snapshot."""
    spec = mirror.spec(table, "snapshot")
    # No automation condition: the planner sensor requests the chunk runs.

    @multi_asset(
        name=spec.key.to_python_identifier(),
        specs=[spec],
        partitions_def=mirror.partitions_def(table),
        backfill_policy=BackfillPolicy.single_run(),
        pool=mirror.named("snapshot"),
        required_resource_keys={mirror.resource_key},
    )
    def _snapshot(context: AssetExecutionContext) -> MaterializeResult:
        with mirror.pipeline_resource(context).pipeline() as pipeline:
            result = pipeline.snapshot_chunks(table.key, context.partition_keys)
            return MaterializeResult(
                metadata={
                    "rows_written": result.rows,
                    "chunks_run": result.chunks_run,
                    "chunks_already_done": result.chunks_skipped,
                    "snapshot_epoch": result.epoch if result.epoch is not None else -1,
                    "table_restarted": result.restarted,
                    "table_snapshot_complete": result.complete,
                    "dagster/table_name": mirror.iceberg_table_name(table),
                }
            )

    return _snapshot


def _merge_metadata(
    mirror: Mirror, table: TableConfig, result: MergeResult, summary: IcebergTableSummary, lag_seconds: float
) -> dict[str, Any]:
    """What a merge materialization carries; ``lag_seconds`` is how far the table is behind the source
    (0 when the merge left nothing unmerged, see :meth:`Pipeline.lags`)."""
    return {
        "dagster/table_name": mirror.iceberg_table_name(table),
        "dagster/column_schema": _table_schema(mirror, table, summary),
        "dagster/row_count": summary.row_count,
        "changes_applied": result.changes,
        "rows_upserted": result.upserts,
        "rows_deleted": result.deletes,
        "batches": result.batches,
        "mat_cursor": result.lag.mat_cursor,
        "log_head": result.lag.log_head,
        "lag": result.lag.changes,
        "lag_seconds": round(lag_seconds, 3),
        "last_lsn": result.last_lsn_text,
        "schema_changes": MetadataValue.json(list(result.schema_changes)),
        # A change the WAL cannot follow: merges wait for the resync job (its sensor launches it).
        "resync_pending": result.resync_reason or "",
        "iceberg_snapshot_id": str(result.snapshot_id or ""),
        "merge_seconds": round(result.seconds, 3),
        # Where the merge spent its time (read, fold, arrow, spark_start, spark_merge, commit).
        **{f"merge_{phase}_seconds": round(seconds, 3) for phase, seconds in result.timings.items()},
    }


def table_check_results(report: TableCheckReport, key: Any) -> Iterator[AssetCheckResult]:
    """The engine's checks of one table as Dagster check results: primary keys unique (blocking);
    schema follows the source; content equals the source, lag or not, every difference explained by
    a change not merged yet (an unexplained one is an error; a check that could not tell is a failed
    warning, never a pass). A large table's keys and content are checked a slice at a time
    (``checks.compare_max_rows``): ``checked_rows`` says which."""
    examples = [list(map(str, example)) for example in report.duplicate_examples]
    yield AssetCheckResult(
        asset_key=key,
        check_name=PK_UNIQUE,
        passed=report.duplicate_keys == 0,
        metadata={
            "duplicate_keys": report.duplicate_keys,
            "examples": MetadataValue.json(examples),
            "checked_rows": report.keys_checked,
        },
    )
    yield AssetCheckResult(
        asset_key=key,
        check_name=SCHEMA_MATCHES,
        passed=not report.schema_problems,
        metadata={"problems": MetadataValue.json(report.schema_problems)},
    )
    yield _content_check_result(report, key)


def _content_check_result(report: TableCheckReport, key: Any) -> AssetCheckResult:
    """``matches_source``: passed only when compared and every difference is explained; ``compared``
    is true only for a conclusive result."""
    content = report.content
    metadata: dict[str, Any] = {
        "compared": content.conclusive,
        "checked_rows": report.content_checked,
        "lag": content.lag,
        "merged_lsn": content.merged_lsn_text,
        "source_lsn": content.source_lsn_text,
    }
    diff = content.diff
    if diff is not None:
        metadata.update(
            {
                **diff.counts(),
                "differences_explained_by_later_changes": content.explained,
                "unexplained_differences": content.unexplained,
                "unexplained_examples": MetadataValue.json([list(map(str, k)) for k in content.unexplained_examples]),
            }
        )
    if content.failed:
        description = (
            f"{content.unexplained:,} rows differ from the source with no change after the merged position to "
            f"explain them (merged up to {content.merged_lsn_text}, source compared at {content.source_lsn_text}); "
            "`pg2iceberg-dagster repair --table` of this table writes exactly the differences"
        )
        return AssetCheckResult(
            asset_key=key,
            check_name=MATCHES_SOURCE,
            passed=False,
            severity=AssetCheckSeverity.ERROR,
            description=description,
            metadata=metadata,
        )
    if not content.passed:
        return AssetCheckResult(
            asset_key=key,
            check_name=MATCHES_SOURCE,
            passed=False,
            severity=AssetCheckSeverity.WARN,
            description=f"not conclusive: {content.inconclusive}",
            metadata={**metadata, "inconclusive": content.inconclusive},
        )
    return AssetCheckResult(asset_key=key, check_name=MATCHES_SOURCE, passed=True, metadata=metadata)


def files_check_result(health: TableHealth, settings: MaintenanceConfig, key: Any) -> AssetCheckResult:
    """A warning when small files or delete files pile up (maintenance compacts them: if this stays
    red, maintenance is off or cannot keep up)."""
    due = compaction_due(health, settings)
    return AssetCheckResult(
        asset_key=key,
        check_name=FILES_COMPACT,
        passed=due is None,
        severity=AssetCheckSeverity.WARN,
        description=due,
        metadata={
            "small_files": health.small_files or 0,
            "delete_files": health.delete_files,
            "delete_ratio": round(health.delete_ratio, 4),
            "compact_at_files": settings.compact_at_files,
            "max_delete_ratio": settings.max_delete_ratio,
            "maintenance_enabled": settings.enabled,
        },
    )


def _live_spec(mirror: Mirror, table: TableConfig) -> AssetSpec:
    # No automation condition: the merge sensor launches the merges, as runs of the merge job.
    # A run merges the tables it selected; one that fails does not hold back the others.
    return mirror.spec(table, "iceberg").replace_attributes(skippable=True)


def _live_check_specs(key: AssetKey) -> list[AssetCheckSpec]:
    return [
        AssetCheckSpec(PK_UNIQUE, asset=key, blocking=True, description="one row per primary key"),
        AssetCheckSpec(
            MATCHES_SOURCE,
            asset=key,
            description="rows equal the source, every difference explained by a change not merged yet",
        ),
        AssetCheckSpec(SCHEMA_MATCHES, asset=key, description="columns and types match the source"),
        AssetCheckSpec(FILES_COMPACT, asset=key, description="few small files and delete files (maintenance compacts)"),
    ]


def live_check_keys(key: AssetKey) -> list[AssetCheckKey]:
    """The checks of the live table ``key`` (what a merge run selects with it)."""
    return [spec.key for spec in _live_check_specs(key)]


def _report_merge(
    mirror: Mirror, pipeline: Pipeline, table: TableConfig, result: MergeResult, log: Any
) -> Iterator[MaterializeResult | AssetCheckResult]:
    """Report one table's merge: its materialization and its files check (the data checks follow
    once every selected table has merged, see :meth:`Pipeline.check_tables`)."""
    key = mirror.key(table, "iceberg")
    if result.waiting_for_snapshot:
        raise Failure(f"{table.key}: the snapshot is not complete yet; materialize its chunk partitions first")
    log.info("merged %s changes of %s; lag %s", result.changes, table.key, result.lag.changes)
    if result.resync_reason:
        log.warning("%s waits for an online resync: %s", table.key, result.resync_reason)
    summary = pipeline.iceberg_summary(table.key)
    health = pipeline.file_health(table.key)
    # The age of the oldest change still unmerged (one read of the state), 0 when the merge left none.
    lag_seconds = pipeline.lags().get(table.key, (result.lag, 0.0))[1] if result.lag.changes else 0.0
    metadata = _merge_metadata(mirror, table, result, summary, lag_seconds)
    # Plotted per merge: how files and snapshots grow between maintenance passes.
    metadata.update({f"iceberg_{name}": value for name, value in health.as_dict().items()})
    yield MaterializeResult(asset_key=key, metadata=metadata)
    yield files_check_result(health, pipeline.config.maintenance, key)
    for history in mirror.merged_keys(table)[1:]:
        yield MaterializeResult(
            asset_key=history,
            metadata={"changes": result.changes, "last_lsn": result.last_lsn_text, "merged_with": key.to_user_string()},
        )


def live_tables_asset(mirror: Mirror) -> AssetsDefinition:
    """Every live Iceberg table in one multi-asset that can subset: the lagging tables requested in one
    merge sensor tick merge in one run on one Spark session (one JVM start for them all, not one per
    table), several at once (``materialize.parallelism``); each is reported as its merge ends."""
    keys = {mirror.key(table, "iceberg"): table for table in mirror.tables}
    # A table is merged when its live table or its history table is selected: one merge writes both.
    written = {key: table for table in mirror.tables for key in mirror.merged_keys(table)}
    histories = [
        mirror.spec(table, HISTORY).replace_attributes(skippable=True)
        for table in mirror.tables
        if mirror.config.history_for(table)
    ]

    @multi_asset(
        name=mirror.named("merge_live_tables"),  # the job is <mirror>_merge: graph and op names share a namespace
        specs=[*(_live_spec(mirror, table) for table in mirror.tables), *histories],
        check_specs=[spec for key in keys for spec in _live_check_specs(key)],
        can_subset=True,
        pool=mirror.named("merge"),
        required_resource_keys={mirror.resource_key, mirror.spark_resource_key},
    )
    def _merge(context: AssetExecutionContext) -> Iterator[Any]:
        selected = list(
            {table.key: table for key, table in written.items() if key in context.selected_asset_keys}.values()
        )
        checks = context.selected_asset_check_keys
        failed: list[str] = []
        # A run of one table merges twice: the second round applies, warm, what was staged during the
        # first, cold merge in this run's new JVM. With several tables the next run takes that up
        # instead: a second MERGE per table would double the run (about 0.5 s each, even warm).
        rounds = 2 if len(selected) == 1 else 1
        spark_factory = mirror.spark_resource(context).get_session
        with mirror.pipeline_resource(context).pipeline(spark_factory=spark_factory) as pipeline:
            by_key = {table.key: table for table in selected}
            merged: list[str] = []
            for table_key, outcome in pipeline.merge_tables(list(by_key), rounds):
                try:
                    if isinstance(outcome, Exception):
                        raise outcome
                    for event in _report_merge(mirror, pipeline, by_key[table_key], outcome, context.log):
                        if isinstance(event, MaterializeResult):
                            if event.asset_key in context.selected_asset_keys:
                                yield event
                        elif _check_key(event) in checks:
                            yield event
                    merged.append(table_key)
                except Exception as exc:  # reported below; the other tables still merge
                    context.log.exception("merge of %s failed", table_key)
                    failed.append(f"{table_key}: {exc}")
            data_checks = [key for key in merged if _data_checks_selected(mirror.key(by_key[key], "iceberg"), checks)]
            for table_key, report in pipeline.check_tables(data_checks):
                if isinstance(report, Exception):
                    context.log.error("checks of %s failed: %s", table_key, report)
                    failed.append(f"{table_key}: checks: {report}")
                    continue
                for event in table_check_results(report, mirror.key(by_key[table_key], "iceberg")):
                    if _check_key(event) in checks:
                        yield event
        if failed:
            raise Failure(f"{len(failed)} of {len(selected)} merges failed: " + "; ".join(failed))

    return _merge


def _data_checks_selected(key: AssetKey, checks: AbstractSet[AssetCheckKey]) -> bool:
    """Whether the run selected any of the table's checks that read its data (not the files check)."""
    return any(AssetCheckKey(key, name) in checks for name in (PK_UNIQUE, MATCHES_SOURCE, SCHEMA_MATCHES))


def _check_key(result: AssetCheckResult) -> AssetCheckKey:
    assert result.asset_key is not None and result.check_name is not None
    return AssetCheckKey(result.asset_key, result.check_name)


def table_definitions(mirror: Mirror) -> tuple[list[AssetSpec], list[AssetsDefinition]]:
    """External specs and assets for every configured table: per table its source, staged log and
    snapshot; the live tables together in one multi-asset (merged by runs of the merge job)."""
    specs = [mirror.spec(table, role) for table in mirror.tables for role in ("source", "staged_log")]
    assets = [snapshot_asset(mirror, table) for table in mirror.tables]
    if mirror.tables:
        assets.append(live_tables_asset(mirror))
    return specs, assets
