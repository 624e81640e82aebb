"""Evaluates the snapshot chunks' automation condition; running by default (Dagster's own default
sensor is not). It targets only its mirror's snapshot assets, so a team's own automation sensor over
its other assets (or a second mirror's) does not overlap it. (Merges have a sensor of their own,
``sensors/merge.py``, that launches the named merge job.)"""

from __future__ import annotations

from dagster import AssetSelection, AutomationConditionSensorDefinition, DefaultSensorStatus

from ..mirror import Mirror


def snapshot_automation_sensor(mirror: Mirror) -> AutomationConditionSensorDefinition:
    """Launches runs of the snapshot chunk partitions not taken yet (``<mirror>_snapshot_automation``)."""
    return AutomationConditionSensorDefinition(
        mirror.named("snapshot_automation"),
        target=AssetSelection.assets(*[mirror.key(table, "snapshot") for table in mirror.tables]),
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=10,
        description="Launches runs of the initial snapshot's CTID chunk partitions that are planned and not "
        "read yet (each chunk once; a failed chunk waits for a retry).",
    )
