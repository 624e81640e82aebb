"""The repository's code location, sensors: the installed integration's WAL flusher, CTID chunk
planning and their runs, merges, resyncs, repairs and maintenance."""

from pg2iceberg_dagster.dagster_integration.sensors.flusher import flusher_sensor
from pg2iceberg_dagster.dagster_integration.sensors.maintenance import maintenance_sensor
from pg2iceberg_dagster.dagster_integration.sensors.merge import merge_sensor
from pg2iceberg_dagster.dagster_integration.sensors.repair import repair_sensor
from pg2iceberg_dagster.dagster_integration.sensors.resync import resync_sensor
from pg2iceberg_dagster.dagster_integration.sensors.snapshot_planner import snapshot_planner_sensor

__all__ = [
    "flusher_sensor",
    "maintenance_sensor",
    "merge_sensor",
    "repair_sensor",
    "resync_sensor",
    "snapshot_planner_sensor",
]
