"""Evaluate the merge and snapshot automation conditions; running by default (Dagster's own default
sensor is not). Two sensors, because their costs differ by an order of magnitude: Dagster evaluates a
snapshot asset through its dynamic chunk partitions (about 85 ms per table a tick on the default
SQLite storage, measured with 200 tables), a live table in about 9 ms. Merges, the fresh path, keep
a short interval that the snapshot assets' evaluation cannot hold up.

Each targets only its mirror's assets, so a team's own automation sensor over its other assets (or a
second mirror's) does not overlap it."""

from __future__ import annotations

from dagster import AssetSelection, AutomationConditionSensorDefinition, DefaultSensorStatus

from ..mirror import Mirror


def _automation_sensor(mirror: Mirror, what: str, role: str, interval: int) -> AutomationConditionSensorDefinition:
    return AutomationConditionSensorDefinition(
        mirror.named(what),
        target=AssetSelection.assets(*[mirror.key(table, role) for table in mirror.tables]),
        default_status=DefaultSensorStatus.RUNNING,
        use_user_code_server=True,  # the lag condition reads the coordination tables
        minimum_interval_seconds=interval,
    )


def merge_automation_sensor(mirror: Mirror) -> AutomationConditionSensorDefinition:
    """Launches merges of lagging live tables: every 5 s rather than Dagster's 30 s default, since a
    merge run waits for the next evaluation (the lag of every table is read once per tick)."""
    return _automation_sensor(mirror, "merge_automation", "iceberg", 5)


def snapshot_automation_sensor(mirror: Mirror) -> AutomationConditionSensorDefinition:
    """Launches runs of the snapshot chunk partitions not taken yet."""
    return _automation_sensor(mirror, "snapshot_automation", "snapshot", 10)
