"""One mirror (one pipeline config, one source database) as Dagster sees it: its tables' asset specs, as
the translator gives them, and every name Dagster needs unique per mirror (resource keys, sensors, jobs,
pools, the CTID-chunk partitions), all derived from the mirror's name, so two mirrors load side by side."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from dagster import AssetKey, AssetSpec, DynamicPartitionsDefinition

from pg2iceberg_dagster.config import PipelineConfig, TableConfig
from pg2iceberg_dagster.errors import ConfigError

from .resources import Pg2IcebergResource, SparkResource
from .translator import ROLES, Pg2IcebergTranslator

DEFAULT_NAME = "pg2iceberg"
# Every asset of every mirror carries this tag (no value), so a team's own automation sensor can leave
# the mirrors' assets to their own sensors: ``AssetSelection.all() - AssetSelection.tag(MIRROR_TAG, "")``.
MIRROR_TAG = "pg2iceberg"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Mirror:
    """The tables of one pipeline and the names of its Dagster objects.

    ``name`` prefixes them: the pipeline resource is ``<name>``, its Spark resource ``<name>_spark``,
    the sensors ``<name>_flusher``, ``<name>_merge_automation``, ..., the jobs ``<name>_resync`` and
    ``<name>_maintenance``, the pools ``<name>_snapshot`` and ``<name>_merge``."""

    translator: Pg2IcebergTranslator
    name: str = DEFAULT_NAME

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"mirror name {self.name!r}: use letters, digits and _ (a Dagster name prefix)")

    @property
    def config(self) -> PipelineConfig:
        """The pipeline config the graph was built from (a schema entry's tables as resolved at load)."""
        return self.translator.config

    @property
    def tables(self) -> list[TableConfig]:
        return self.translator.config.tables

    @cached_property
    def _specs(self) -> dict[tuple[str, str], AssetSpec]:
        # Asked once per table and role: sensors look keys up on every tick.
        tag = {MIRROR_TAG: ""}
        return {
            (table.key, role): self.translator.get_asset_spec(table, role).merge_attributes(tags=tag)
            for table in self.tables
            for role in ROLES
        }

    def spec(self, table: TableConfig, role: str) -> AssetSpec:
        """The translator's spec of the table's asset ``role``."""
        return self._specs[(table.key, role)]

    def key(self, table: TableConfig, role: str) -> AssetKey:
        """The asset key of the table's asset ``role``."""
        return self.spec(table, role).key

    def named(self, what: str) -> str:
        """The name of this mirror's ``what`` (a sensor, job or pool): ``<name>_<what>``."""
        return f"{self.name}_{what}"

    @property
    def resource_key(self) -> str:
        """Key of the pipeline resource (:class:`Pg2IcebergResource`)."""
        return self.name

    @property
    def spark_resource_key(self) -> str:
        """Key of the Spark resource the merges and maintenance run on."""
        return self.named("spark")

    def pipeline_resource(self, context: Any) -> Pg2IcebergResource:
        """This mirror's pipeline resource, from a step's or a sensor tick's ``context``."""
        return getattr(context.resources, self.resource_key)

    def spark_resource(self, context: Any) -> SparkResource:
        """This mirror's Spark resource, from a step's ``context``."""
        return getattr(context.resources, self.spark_resource_key)

    def partitions_name(self, table: TableConfig) -> str:
        """The name of the table's CTID-chunk partitions: instance-wide in Dagster, so it carries the
        mirror's name."""
        return self.named(self.translator.partitions_name(table))

    def partitions_def(self, table: TableConfig) -> DynamicPartitionsDefinition:
        """The table's CTID-chunk partitions (keys added by the planning sensor from the stored plan)."""
        return DynamicPartitionsDefinition(name=self.partitions_name(table))

    def iceberg_table_name(self, table: TableConfig) -> str:
        """``catalog.namespace.name`` of the table's Iceberg table."""
        return self.translator.iceberg_table_name(table)
