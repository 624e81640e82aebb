"""The repository's code location, jobs: the installed integration's merge job, and the online resync
and maintenance of one table."""

from pg2iceberg_dagster.dagster_integration.jobs.maintenance import maintenance_job
from pg2iceberg_dagster.dagster_integration.jobs.merge import merge_job
from pg2iceberg_dagster.dagster_integration.jobs.resync import resync_job

__all__ = ["maintenance_job", "merge_job", "resync_job"]
