"""The merge job: every merge of the mirror's live tables runs as ``<mirror>_merge`` (a run names its
tables in its tags), not as Dagster's unnamed asset job, so merges can be filtered, alerted on and
counted. Its sensor (``sensors/merge.py``) launches it with the lagging tables as its selection."""

from dagster import AssetSelection, define_asset_job, in_process_executor
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from ..mirror import MIRROR_RUN_TAG, Mirror


def merge_job(mirror: Mirror) -> UnresolvedAssetJobDefinition:
    """The mirror's merge job over every live table and its checks; a run selects the tables it merges.

    One process per run: the job has one step (the live tables' multi-asset), so Dagster's default
    multiprocess executor would only start a second Python process, importing the code location
    again, before the step could begin."""
    return define_asset_job(
        mirror.named("merge"),
        selection=AssetSelection.assets(*[key for table in mirror.tables for key in mirror.merged_keys(table)]),
        description="MERGE the staged WAL changes of the selected live tables into Iceberg (one Spark "
        "session for them all), then their checks. Launched by the merge sensor; the run's "
        "pg2iceberg/tables tag lists its tables, and each has a pg2iceberg/table.<table> tag.",
        executor_def=in_process_executor,
        tags={MIRROR_RUN_TAG: mirror.name},
    )
