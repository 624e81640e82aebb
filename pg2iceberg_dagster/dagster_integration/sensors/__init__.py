"""The mirror's sensors: the WAL flusher, CTID chunk planning and their runs, merges,
resyncs, repairs, maintenance."""

from .flusher import flusher_sensor
from .maintenance import maintenance_sensor
from .merge import merge_sensor
from .repair import repair_sensor
from .resync import resync_sensor
from .snapshot_planner import snapshot_planner_sensor

__all__ = [
    "flusher_sensor",
    "maintenance_sensor",
    "merge_sensor",
    "repair_sensor",
    "resync_sensor",
    "snapshot_planner_sensor",
]
