"""All Dagster definitions, assembled in one place from the pipeline config.

The config path is ``$PG2ICEBERG_CONFIG``, else the quickstart's ``.pg2iceberg/pg2iceberg.yaml``.
Secrets stay in the environment: the config names the variables; ``PostgresResource`` takes EnvVar.
"""

from __future__ import annotations

import os
from pathlib import Path

from dagster import Definitions

from assets import Pg2IcebergTranslator, table_definitions
from jobs import maintenance_job, resync_job
from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.source.selection import resolve_tables
from resources import Pg2IcebergResource, SparkResource
from sensors import (
    flusher_sensor,
    maintenance_sensor,
    merge_automation_sensor,
    resync_sensor,
    snapshot_automation_sensor,
    snapshot_planner_sensor,
)

DEFAULT_CONFIG = Path(__file__).parent / ".pg2iceberg" / "pg2iceberg.yaml"


def build_definitions(config_path: str | os.PathLike[str], pg2iceberg: Pg2IcebergResource | None = None) -> Definitions:
    """Definitions for the pipeline at ``config_path``: add a table to the config, it joins the graph.

    ``pg2iceberg`` overrides the resource (e.g. a source password as ``EnvVar``); the runs, sensors and
    automation conditions all reach the pipeline through it."""
    config_path = str(Path(config_path).resolve())
    # The graph's shape: tables (a schema entry's as the source has them at load) and names.
    translator = Pg2IcebergTranslator(resolve_tables(load_config(config_path)))
    pg2iceberg = pg2iceberg or Pg2IcebergResource(config_path=config_path)
    specs, assets = table_definitions(translator, pg2iceberg)
    resync = resync_job(translator)
    maintenance = maintenance_job(translator)
    return Definitions(
        assets=[*specs, *assets],
        jobs=[resync, maintenance],
        sensors=[
            flusher_sensor(translator),
            snapshot_planner_sensor(translator),
            merge_automation_sensor(translator),
            snapshot_automation_sensor(translator),
            resync_sensor(resync),
            maintenance_sensor(translator, maintenance),
        ],
        resources={"pg2iceberg": pg2iceberg, "spark": SparkResource(pg2iceberg=pg2iceberg)},
    )


def _config_path() -> Path:
    configured = os.environ.get("PG2ICEBERG_CONFIG")
    if configured:
        return Path(configured)
    if not DEFAULT_CONFIG.exists():
        # Before the first quickstart: the graph of the quickstart pipeline, so `dagster dev` shows it.
        from pg2iceberg_dagster.quickstart import write_default_config

        write_default_config(DEFAULT_CONFIG.parent)
    return DEFAULT_CONFIG


defs = build_definitions(_config_path())
