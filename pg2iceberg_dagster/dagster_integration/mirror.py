"""One mirror (one pipeline config, one source database) as Dagster sees it: its tables' asset specs, as
the translator gives them, and every name Dagster needs unique per mirror (resource keys, sensors, jobs,
pools, the CTID-chunk partitions), all derived from the mirror's name, so two mirrors load side by side."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from dagster import AssetKey, AssetSpec, DynamicPartitionsDefinition

from pg2iceberg_dagster.config import PipelineConfig, TableConfig
from pg2iceberg_dagster.errors import ConfigError

from .resources import Pg2IcebergResource, SparkResource
from .translator import DEFAULT_NAME, HISTORY, ROLES, Pg2IcebergTranslator

__all__ = [
    "CHECKED_RUN_TAG",
    "DEFAULT_NAME",
    "MIRROR_RUN_TAG",
    "MIRROR_TAG",
    "TABLES_RUN_TAG",
    "Mirror",
    "table_run_tag",
]
# Every asset of every mirror carries this tag (no value), so a team's own automation sensor can leave
# the mirrors' assets to their own sensors: ``AssetSelection.all() - AssetSelection.tag(MIRROR_TAG, "")``.
MIRROR_TAG = "pg2iceberg"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Run tags of the mirror's runs (merge, resync, maintenance): the mirror, the tables as a comma list
# (to read), and per table a tag of its own (to filter on: a run of several tables has one per table).
MIRROR_RUN_TAG = "pg2iceberg/mirror"
TABLES_RUN_TAG = "pg2iceberg/tables"
# A merge run's tables whose checks it runs, as a comma list (see checks.min_interval_seconds).
CHECKED_RUN_TAG = "pg2iceberg/checked"
TABLE_RUN_TAG_PREFIX = "pg2iceberg/table."
# Dagster tag keys: an optional namespace and a name of at most 63 of [A-Za-z0-9_.-] each.
_TAG_NAME_MAX = 63
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def table_run_tag(table_key: str) -> str:
    """The run tag key that marks a run of ``table_key`` (``pg2iceberg/table.public.orders``).

    The table key as it is when it fits Dagster's tag keys; else its other characters replaced by
    ``_``, cut to length, and followed by 8 hex digits of its sha1, so two tables never share one."""
    room = _TAG_NAME_MAX - len(TABLE_RUN_TAG_PREFIX.split("/", 1)[1])
    safe = _TAG_UNSAFE.sub("_", table_key)
    if safe != table_key or len(safe) > room:
        digest = hashlib.sha1(table_key.encode(), usedforsecurity=False).hexdigest()[:8]
        safe = f"{safe[: room - 9]}-{digest}"
    return TABLE_RUN_TAG_PREFIX + safe


@dataclass(frozen=True)
class Mirror:
    """The tables of one pipeline and the names of its Dagster objects.

    ``name`` prefixes them: the pipeline resource is ``<name>``, its Spark resource ``<name>_spark``,
    the sensors ``<name>_flusher``, ``<name>_merge``, ..., the jobs ``<name>_merge``, ``<name>_resync``
    and ``<name>_maintenance``, the pools ``<name>_snapshot`` and ``<name>_merge``."""

    translator: Pg2IcebergTranslator
    name: str = DEFAULT_NAME

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"mirror name {self.name!r}: use letters, digits and _ (a Dagster name prefix)")
        if self.translator.mirror_name != self.name:
            # The translator names things after the mirror (its groups): it serves this one.
            object.__setattr__(self, "translator", dataclasses.replace(self.translator, mirror_name=self.name))

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
            for role in self.roles(table)
        }

    def roles(self, table: TableConfig) -> tuple[str, ...]:
        """The table's assets: :data:`ROLES`, and :data:`HISTORY` when it has a history table."""
        return (*ROLES, HISTORY) if self.config.history_for(table) else ROLES

    def spec(self, table: TableConfig, role: str) -> AssetSpec:
        """The translator's spec of the table's asset ``role``."""
        return self._specs[(table.key, role)]

    def key(self, table: TableConfig, role: str) -> AssetKey:
        """The asset key of the table's asset ``role``."""
        return self.spec(table, role).key

    def merged_keys(self, table: TableConfig) -> list[AssetKey]:
        """The assets a merge of ``table`` writes: its live table, and its history table when it has one."""
        return [self.key(table, role) for role in self.roles(table) if role in ("iceberg", HISTORY)]

    def run_tags(self, table_keys: Iterable[str]) -> dict[str, str]:
        """The tags of a run of this mirror on ``table_keys``: the mirror, the tables, one tag per table."""
        keys = sorted(table_keys)
        return {
            MIRROR_RUN_TAG: self.name,
            TABLES_RUN_TAG: ",".join(keys),
            **{table_run_tag(key): "true" for key in keys},
        }

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
