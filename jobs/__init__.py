"""Dagster jobs that are not asset materializations: the online resync and the maintenance of one table."""

from .maintenance import MAINTENANCE_JOB, maintenance_job
from .resync import RESYNC_JOB, resync_job

__all__ = ["MAINTENANCE_JOB", "RESYNC_JOB", "maintenance_job", "resync_job"]
