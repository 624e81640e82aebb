"""When the live Iceberg table should be merged: its mat_cursor lags the staged log and its snapshot
is complete. Reads the coordination tables, so it runs on the user code server."""

from __future__ import annotations

from dagster import AutomationCondition, AutomationContext, AutomationResult

from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.coordination.store import CoordinationStore


class StagedLogLag(AutomationCondition):
    """True when ``table_key``'s staged log has changes past mat_cursor and its snapshot is complete."""

    def __init__(self, config_path: str, table_key: str) -> None:
        self.config_path = config_path
        self.table_key = table_key

    @property
    def name(self) -> str:
        return "staged_log_lag"

    @property
    def description(self) -> str:
        return f"mat_cursor of {self.table_key} lags the staged log and its snapshot is complete"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        config = load_config(self.config_path)
        with CoordinationStore(config.state_connection) as store:
            store.migrate()
            state = store.table_state(self.table_key)
            lag = store.log_head(self.table_key) - store.mat_cursor(config.materialize.group, self.table_key)
        ready = state is not None and state.snapshot_complete and lag > 0
        subset = context.candidate_subset if ready else context.get_empty_subset()
        return AutomationResult(context=context, true_subset=subset)


def merge_condition(config_path: str, table_key: str) -> AutomationCondition:
    """Merge on lag, never while a run of the same table is in progress."""
    return (StagedLogLag(config_path, table_key) & ~AutomationCondition.in_progress()).with_label(
        "lag and snapshot complete, not in progress"
    )


def snapshot_condition() -> AutomationCondition:
    """Take each planned chunk once: missing, not running, and not failed (a failed chunk waits for a retry)."""
    return (
        AutomationCondition.missing() & ~AutomationCondition.in_progress() & ~AutomationCondition.execution_failed()
    ).with_label("chunk not taken yet")
