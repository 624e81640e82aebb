"""The repository's code location, jobs: the installed integration's merge job, the online resync,
repair and maintenance of one table (a repair with no table repairs a lost slot)."""

from pg2iceberg_dagster.dagster_integration.jobs.maintenance import maintenance_job
from pg2iceberg_dagster.dagster_integration.jobs.merge import merge_job
from pg2iceberg_dagster.dagster_integration.jobs.repair import repair_job
from pg2iceberg_dagster.dagster_integration.jobs.resync import resync_job

__all__ = ["maintenance_job", "merge_job", "repair_job", "resync_job"]
