"""Dagster sensors: the WAL flusher, CTID partition planning, and merge automation."""

from .automation import merge_automation_sensor
from .flusher import flusher_sensor
from .snapshot_planner import snapshot_planner_sensor

__all__ = ["flusher_sensor", "merge_automation_sensor", "snapshot_planner_sensor"]
