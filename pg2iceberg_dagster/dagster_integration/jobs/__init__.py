"""The mirror's jobs that are not asset materializations: the online resync and the maintenance of one table."""

from .maintenance import maintenance_job
from .resync import resync_job

__all__ = ["maintenance_job", "resync_job"]
