"""Evaluates the snapshot and merge automation conditions; running by default (Dagster's own default sensor is not)."""

from __future__ import annotations

from dagster import AssetSelection, AutomationConditionSensorDefinition, DefaultSensorStatus

from assets.translator import Pg2IcebergTranslator


def merge_automation_sensor(translator: Pg2IcebergTranslator) -> AutomationConditionSensorDefinition:
    return AutomationConditionSensorDefinition(
        "pg2iceberg_merge_automation",
        target=AssetSelection.assets(
            *[key for t in translator.config.tables for key in (translator.snapshot_key(t), translator.iceberg_key(t))]
        ),
        default_status=DefaultSensorStatus.RUNNING,
        use_user_code_server=True,  # the lag condition reads the coordination tables
        # A merge run waits for the next evaluation: every 5 s rather than Dagster's 30 s default (the lag
        # condition is two indexed queries per table).
        minimum_interval_seconds=5,
    )
