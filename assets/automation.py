"""When the live Iceberg table should be merged: its mat_cursor lags the staged log and its snapshot
is complete. Reads the coordination tables, so it runs on the user code server."""

from __future__ import annotations

from dagster import AutomationCondition, AutomationContext, AutomationResult

from resources import Pg2IcebergResource


class StagedLogLag(AutomationCondition):
    """True when ``table_key``'s staged log has changes past mat_cursor and its snapshot is complete.

    It reaches the pipeline through the deployment's own resource, so the config (and an ``EnvVar``
    password that overrides it) is the one the runs use."""

    def __init__(self, pg2iceberg: Pg2IcebergResource, table_key: str) -> None:
        self.pg2iceberg = pg2iceberg
        self.table_key = table_key

    @property
    def name(self) -> str:
        return "staged_log_lag"

    @property
    def description(self) -> str:
        return f"mat_cursor of {self.table_key} lags the staged log and its snapshot is complete"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        with self.pg2iceberg.process_config_and_initialize_cm() as pg2iceberg, pg2iceberg.pipeline() as pipeline:
            ready = pipeline.merge_pending(self.table_key)
        subset = context.candidate_subset if ready else context.get_empty_subset()
        return AutomationResult(context=context, true_subset=subset)


def merge_condition(pg2iceberg: Pg2IcebergResource, table_key: str) -> AutomationCondition:
    """Merge on lag, never while a run of the same table is in progress."""
    return (StagedLogLag(pg2iceberg, table_key) & ~AutomationCondition.in_progress()).with_label(
        "lag and snapshot complete, not in progress"
    )


def snapshot_condition() -> AutomationCondition:
    """Take each planned chunk once: missing, not running, and not failed (a failed chunk waits for a retry)."""
    return (
        AutomationCondition.missing() & ~AutomationCondition.in_progress() & ~AutomationCondition.execution_failed()
    ).with_label("chunk not taken yet")
