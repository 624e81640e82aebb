"""Dagster jobs that are not asset materializations: the online resync of one table."""

from .resync import RESYNC_JOB, resync_job

__all__ = ["RESYNC_JOB", "resync_job"]
