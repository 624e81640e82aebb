"""When the live Iceberg table should be merged: its mat_cursor lags the staged log and its snapshot
is complete. Reads the coordination tables, so it runs on the user code server."""

from __future__ import annotations

import threading
from datetime import datetime

from dagster import AutomationCondition, AutomationContext, AutomationResult

from .resources import Pg2IcebergResource


class TablesToMerge:
    """The tables ready to merge, read once per automation tick and shared by every table's condition:
    a tick costs two queries whatever the number of tables, not a connection and two queries per table.

    Every condition of one tick sees the same ``evaluation_time``; a new time reads again."""

    def __init__(self, pg2iceberg: Pg2IcebergResource) -> None:
        self.pg2iceberg = pg2iceberg
        self._lock = threading.Lock()
        self._read_at: datetime | None = None
        self._ready: frozenset[str] = frozenset()

    def at(self, evaluation_time: datetime) -> frozenset[str]:
        """The tables ready to merge as of the tick evaluated at ``evaluation_time``."""
        with self._lock:
            if self._read_at != evaluation_time:
                with (
                    self.pg2iceberg.process_config_and_initialize_cm() as pg2iceberg,
                    pg2iceberg.pipeline() as pipeline,
                ):
                    self._ready = frozenset(pipeline.tables_to_merge())
                self._read_at = evaluation_time
            return self._ready


class StagedLogLag(AutomationCondition):
    """True when ``table_key``'s staged log has changes past mat_cursor and its snapshot is complete.

    It reaches the pipeline through the deployment's own resource, so the config (and an ``EnvVar``
    password that overrides it) is the one the runs use."""

    def __init__(self, ready: TablesToMerge, table_key: str) -> None:
        self.ready = ready
        self.table_key = table_key

    @property
    def name(self) -> str:
        return "staged_log_lag"

    @property
    def description(self) -> str:
        return f"mat_cursor of {self.table_key} lags the staged log and its snapshot is complete"

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        ready = self.table_key in self.ready.at(context.evaluation_time)
        subset = context.candidate_subset if ready else context.get_empty_subset()
        return AutomationResult(context=context, true_subset=subset)


def merge_condition(ready: TablesToMerge, table_key: str) -> AutomationCondition:
    """Merge on lag, never while a run of the same table is in progress."""
    return (StagedLogLag(ready, table_key) & ~AutomationCondition.in_progress()).with_label(
        "lag and snapshot complete, not in progress"
    )


def snapshot_condition() -> AutomationCondition:
    """Take each planned chunk once: missing, not running, and not failed (a failed chunk waits for a retry)."""
    return (
        AutomationCondition.missing() & ~AutomationCondition.in_progress() & ~AutomationCondition.execution_failed()
    ).with_label("chunk not taken yet")
