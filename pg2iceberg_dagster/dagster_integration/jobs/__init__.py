"""The mirror's jobs: the merge job (runs of the live tables' merges, tagged with their tables), and
the online resync, the repair and the maintenance of one table (named by the run config; a repair
with none repairs a lost slot's every table)."""

from .maintenance import maintenance_job
from .merge import merge_job
from .repair import repair_job
from .resync import resync_job

__all__ = ["maintenance_job", "merge_job", "repair_job", "resync_job"]
