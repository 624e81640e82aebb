"""A mirror's Dagster definitions, assembled in one place from its pipeline config: per table its assets
and checks, the replication slot's asset and check, the sensors, the jobs and the two resources, all
named after the mirror."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagster import Definitions

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.pipeline import resolve_tables

from .assets import table_definitions
from .jobs.cuts import cuts_job, cuts_schedule
from .jobs.maintenance import maintenance_job
from .jobs.merge import merge_job
from .jobs.repair import repair_job
from .jobs.resync import resync_job
from .mirror import DEFAULT_NAME, Mirror
from .resources import Pg2IcebergResource, SparkResource
from .sensors.flusher import flusher_sensor
from .sensors.maintenance import maintenance_sensor
from .sensors.merge import merge_sensor
from .sensors.repair import repair_sensor
from .sensors.resync import resync_sensor
from .sensors.snapshot_planner import snapshot_planner_sensor
from .slot import slot_check, slot_spec
from .translator import Pg2IcebergTranslator

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]


def pipeline_resource(config: ConfigSource) -> Pg2IcebergResource:
    """The pipeline resource for a config file path or an inline config mapping."""
    if isinstance(config, Mapping):
        return Pg2IcebergResource(config=dict(config))
    return Pg2IcebergResource(config_path=str(Path(config).resolve()))


def resolved_config(config: ConfigSource) -> PipelineConfig:
    """The graph's shape: the configured tables, a schema entry's as the source has them now.

    Only a config with a schema entry (``{schema: ...}``) connects to PostgreSQL here (with the
    config's own credentials: a resource's ``EnvVar`` is only resolved for runs and ticks); named
    tables are read from the config alone."""
    return resolve_tables(pipeline_resource(config).load_config())


def mirror_definitions(mirror: Mirror, pg2iceberg: Pg2IcebergResource) -> Definitions:
    """Every definition of ``mirror``, reaching its pipeline through ``pg2iceberg``."""
    specs, assets = table_definitions(mirror)
    merge = merge_job(mirror)
    resync = resync_job(mirror)
    maintenance = maintenance_job(mirror)
    cut = cuts_job(mirror)
    schedule = cuts_schedule(mirror, cut)
    repair = repair_job(mirror)
    return Definitions(
        assets=[*specs, slot_spec(mirror), *assets],
        asset_checks=[slot_check(mirror)],
        jobs=[merge, resync, maintenance, cut, repair],
        schedules=[schedule] if schedule is not None else [],
        sensors=[
            flusher_sensor(mirror),
            snapshot_planner_sensor(mirror),
            merge_sensor(mirror, merge),
            resync_sensor(mirror, resync),
            maintenance_sensor(mirror, maintenance),
            repair_sensor(mirror, repair),
        ],
        resources={mirror.resource_key: pg2iceberg, mirror.spark_resource_key: SparkResource(pg2iceberg=pg2iceberg)},
    )


def build_definitions(
    config: ConfigSource,
    pg2iceberg: Pg2IcebergResource | None = None,
    *,
    name: str = DEFAULT_NAME,
    translator_cls: type[Pg2IcebergTranslator] = Pg2IcebergTranslator,
) -> Definitions:
    """Definitions for the pipeline ``config`` (a YAML file's path, or the config as a mapping): add a
    table to the config, it joins the graph.

    ``pg2iceberg`` overrides the resource (e.g. a source password as ``EnvVar``); the runs, sensors and
    merge sensor all reach the pipeline through it. ``name`` prefixes the resource keys and the
    names of sensors, jobs and pools (two mirrors in one code location need two names);
    ``translator_cls`` decides how the tables appear (see :class:`Pg2IcebergTranslator`)."""
    mirror = Mirror(translator_cls(resolved_config(config)), name)
    return mirror_definitions(mirror, pg2iceberg or pipeline_resource(config))
