"""Evaluate the merge and snapshot automation conditions; running by default (Dagster's own default
sensor is not). Two sensors, because their costs differ by an order of magnitude: Dagster evaluates a
snapshot asset through its dynamic chunk partitions (about 85 ms per table a tick on the default
SQLite storage, measured with 200 tables), a live table in about 9 ms. Merges, the fresh path, keep
a short interval that the snapshot assets' evaluation cannot hold up."""

from __future__ import annotations

from collections.abc import Callable

from dagster import AssetKey, AssetSelection, AutomationConditionSensorDefinition, DefaultSensorStatus

from assets.translator import Pg2IcebergTranslator
from pg2iceberg_dagster.config import TableConfig

MERGE_AUTOMATION = "pg2iceberg_merge_automation"
SNAPSHOT_AUTOMATION = "pg2iceberg_snapshot_automation"


def _automation_sensor(
    name: str, translator: Pg2IcebergTranslator, key: Callable[[TableConfig], AssetKey], interval: int
) -> AutomationConditionSensorDefinition:
    return AutomationConditionSensorDefinition(
        name,
        target=AssetSelection.assets(*[key(table) for table in translator.config.tables]),
        default_status=DefaultSensorStatus.RUNNING,
        use_user_code_server=True,  # the lag condition reads the coordination tables
        minimum_interval_seconds=interval,
    )


def merge_automation_sensor(translator: Pg2IcebergTranslator) -> AutomationConditionSensorDefinition:
    """Launches merges of lagging live tables: every 5 s rather than Dagster's 30 s default, since a
    merge run waits for the next evaluation (the lag of every table is read once per tick)."""
    return _automation_sensor(MERGE_AUTOMATION, translator, translator.iceberg_key, 5)


def snapshot_automation_sensor(translator: Pg2IcebergTranslator) -> AutomationConditionSensorDefinition:
    """Launches runs of the snapshot chunk partitions not taken yet."""
    return _automation_sensor(SNAPSHOT_AUTOMATION, translator, translator.snapshot_key, 10)
