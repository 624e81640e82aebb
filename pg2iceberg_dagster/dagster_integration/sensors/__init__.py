"""The mirror's sensors: the WAL flusher, CTID partition planning, merge and snapshot automation,
resyncs, maintenance."""

from .automation import merge_automation_sensor, snapshot_automation_sensor
from .flusher import flusher_sensor
from .maintenance import maintenance_sensor
from .resync import resync_sensor
from .snapshot_planner import snapshot_planner_sensor

__all__ = [
    "flusher_sensor",
    "maintenance_sensor",
    "merge_automation_sensor",
    "resync_sensor",
    "snapshot_automation_sensor",
    "snapshot_planner_sensor",
]
