"""The one place that decides asset keys, groups, kinds, descriptions and partition names per table."""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import NamedTuple

from dagster import AssetKey, AssetSpec, FreshnessPolicy

from pg2iceberg_dagster.config import PipelineConfig, TableConfig
from pg2iceberg_dagster.errors import ConfigError

# The four assets of a mirrored table, upstream first: its source, its staged log, its CTID-chunk
# snapshot and its live Iceberg table.
ROLES = ("source", "staged_log", "snapshot", "iceberg")
# The fifth asset of a table with history (docs/history.md): its history table, downstream of the live one.
HISTORY = "history"
_UPSTREAM: dict[str, tuple[str, ...]] = {
    "source": (),
    "staged_log": ("source",),
    "snapshot": ("source",),
    "iceberg": ("snapshot", "staged_log"),
    HISTORY: ("iceberg",),
}
_KINDS: dict[str, set[str]] = {
    "source": {"postgres"},
    "staged_log": {"parquet"},
    "snapshot": {"iceberg", "postgres"},
    "iceberg": {"iceberg", "spark"},
    HISTORY: {"iceberg", "spark"},
}

# The name of a mirror nobody named (``build_definitions`` without ``name=``).
DEFAULT_NAME = "pg2iceberg"

# Hex digits of sha1(schema.table) a table's names carry when they would collide with another table's;
# longer only if two such suffixes meet (a sha1 prefix shared by two names).
SUFFIX_HEX = 6


# How each mask policy shows in the live table's column schema.
MASK_DESCRIPTIONS = {
    "hash": "hash: hex HMAC-SHA256 of the value, the same for equal values",
    "null": "null: always NULL",
    "redact": "redact: a fixed string where the value is not NULL",
}

# How the change metadata columns show (lsn, committed_at, merged_at; docs/change_metadata.md).
METADATA_DESCRIPTIONS = (
    "LSN by which the transaction of the row's last change had committed (snapshot rows: the snapshot's LSN)",
    "source commit time of the row's last change (NULL for rows as the snapshot copied them)",
    "when the row's last change was merged into Iceberg (or the snapshot copied it)",
)
# How the deletion columns of a table with ``deletes: soft`` show (deleted_at, deleted_lsn).
DELETION_DESCRIPTIONS = (
    "source commit time of the row's DELETE (or TRUNCATE); NULL while the row is live",
    "commit LSN of the row's DELETE (or TRUNCATE); NULL while the row is live",
)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


class _Parts(NamedTuple):
    """The sanitised name parts the keys and partitions name of one table are made of."""

    schema: str
    table: str  # the table name, suffixed when the table's names would collide
    namespace: str
    name: str  # the Iceberg table name, suffixed like ``table``

    @property
    def source(self) -> list[str]:
        return ["pg", self.schema, f"{self.table}_source"]

    @property
    def staged_log(self) -> list[str]:
        return ["staged_log", self.schema, f"{self.table}_staged_log"]

    @property
    def live(self) -> list[str]:
        return ["iceberg", self.namespace, self.name]

    @property
    def snapshot(self) -> list[str]:
        return ["iceberg", self.namespace, f"{self.name}_snapshot"]

    @property
    def partitions(self) -> str:
        return f"ctid_chunks__{self.schema}__{self.table}"

    def names(self) -> set[tuple[str, str]]:
        """Every name Dagster derives from these parts and needs unique: the four asset keys, the op
        names made of them (parts joined with ``__``), and the partitions name."""
        keys = [self.source, self.staged_log, self.snapshot, self.live]
        return (
            {("asset key", "/".join(key)) for key in keys}
            | {("op", "__".join(key)) for key in keys}
            | {("partitions", self.partitions)}
        )


def _suffix(table_key: str, length: int) -> str:
    return hashlib.sha1(table_key.encode(), usedforsecurity=False).hexdigest()[:length]


def _parts(config: PipelineConfig, table: TableConfig, suffix: str = "") -> _Parts:
    namespace, name = config.iceberg_identifier(table)
    tail = f"_{suffix}" if suffix else ""
    return _Parts(_safe(table.schema_name), _safe(table.table_name) + tail, _safe(namespace), _safe(name) + tail)


def _clean(config: PipelineConfig, table: TableConfig) -> bool:
    """Whether sanitising leaves the table's own names (schema, table, Iceberg name) as they are."""
    _, name = config.iceberg_identifier(table)
    return all(_safe(part) == part for part in (table.schema_name, table.table_name, name))


def _suffix_lengths(config: PipelineConfig) -> dict[str, int]:
    """How many hex digits of sha1(schema.table) each table's names carry (0: none, the plain names).

    A table keeps its plain names unless one of them equals a name of another table. Then the tables
    whose own names were changed by sanitising give way first (a name that reads ``public.a_b`` stays
    public.a_b's, however many ``public."a b"`` or ``public.a$b`` are added); if the colliding tables
    all have clean names (``orders`` and ``orders_snapshot``, ``a__b.c`` and ``a.b__c``) they all carry
    the suffix. This repeats until every name is unique, so the result depends on the set of tables,
    not on their order in the config."""
    tables = {table.key: table for table in config.tables}
    lengths = dict.fromkeys(tables, 0)
    while True:
        owners: dict[tuple[str, str], set[str]] = defaultdict(set)
        for key, table in tables.items():
            for name in _parts(config, table, _suffix(key, lengths[key])).names():
                owners[name].add(key)
        colliding = {key for keys in owners.values() if len(keys) > 1 for key in keys}
        if not colliding:
            return lengths
        plain = {key for key in colliding if not lengths[key]}
        yielding = {key for key in plain if not _clean(config, tables[key])} or plain
        if yielding:
            lengths.update(dict.fromkeys(yielding, SUFFIX_HEX))
            continue
        # Suffixed names still meet (a shared sha1 prefix): lengthen their suffixes.
        if any(lengths[key] >= 40 for key in colliding):
            raise ConfigError(f"cannot give the tables {', '.join(sorted(colliding))} distinct Dagster names")
        lengths.update({key: lengths[key] + 2 for key in colliding})


@dataclass(frozen=True)
class TableAsset:
    """One of a table's four assets: what a translation (``translation:`` in ``defs.yaml``) is given,
    as the template variables ``table`` (its ``key``, ``schema_name``, ``table_name``) and ``role``."""

    table: TableConfig
    role: str


@dataclass(frozen=True)
class Pg2IcebergTranslator:
    """Subclass and override to change how tables appear in Dagster: :meth:`get_asset_spec` returns
    the whole ``AssetSpec`` of each of a table's four assets (override it, or the narrower methods it
    is built from). The mirror's own settings (partitions, pools, checks) are added to what it
    returns. Its sensors launch the snapshot and merge runs: an ``automation_condition`` it sets is
    left to your own automation sensor.

    Names are the schema and table names with every character outside ``[A-Za-z0-9_]`` replaced by
    ``_``. Where that would give two tables the same asset key, op or partitions name, the tables
    involved carry a short hex suffix of sha1(schema.table) after their table part (``a_b_3f2c1a``);
    every other table keeps its plain names.

    ``mirror_name`` is the name of the mirror the translator serves (the :class:`Mirror` sets it):
    the default group of a table is ``<mirror>_<schema>``, so a deployment shared by several mirrors
    (or teams) does not show one ``public`` group of everybody's tables."""

    config: PipelineConfig
    mirror_name: str = DEFAULT_NAME

    @cached_property
    def _suffixes(self) -> dict[str, str]:
        """The suffix of each configured table's names, by table key ("" for the plain names)."""
        return {key: _suffix(key, length) for key, length in _suffix_lengths(self.config).items()}

    def _table_parts(self, table: TableConfig) -> _Parts:
        return _parts(self.config, table, self._suffixes.get(table.key, ""))

    # The graph labels a node by the last part of its key: each part says what the node is
    # (``orders_source``, ``orders_staged_log``, ``orders_snapshot``, and ``orders``, the live table).

    def source_key(self, table: TableConfig) -> AssetKey:
        return AssetKey(self._table_parts(table).source)

    def staged_log_key(self, table: TableConfig) -> AssetKey:
        return AssetKey(self._table_parts(table).staged_log)

    def iceberg_key(self, table: TableConfig) -> AssetKey:
        return AssetKey(self._table_parts(table).live)

    def snapshot_key(self, table: TableConfig) -> AssetKey:
        *namespace, name = self.iceberg_key(table).path
        return AssetKey([*namespace, f"{name}_snapshot"])

    def history_key(self, table: TableConfig) -> AssetKey:
        """The key of the table's history table: the live table's, with the history suffix."""
        *namespace, name = self.iceberg_key(table).path
        return AssetKey([*namespace, _safe(name + self.config.change_metadata.history_suffix)])

    def group_name(self, table: TableConfig) -> str:
        """The table's asset group: ``<mirror>_<schema>`` (override to group otherwise)."""
        return f"{self.mirror_name}_{_safe(table.schema_name)}"

    def get_asset_spec(self, table: TableConfig, role: str) -> AssetSpec:
        """The spec of the table's asset ``role`` (one of :data:`ROLES`, or :data:`HISTORY` for a table
        with history). Its deps are the specs of its upstream roles, asked of this method again, so an
        override that renames keys keeps the graph."""
        key = {
            "source": self.source_key,
            "staged_log": self.staged_log_key,
            "snapshot": self.snapshot_key,
            "iceberg": self.iceberg_key,
            HISTORY: self.history_key,
        }[role](table)
        metadata = {"dagster/table_name": f"{self.config.source.dbname}.{table.key}"} if role == "source" else {}
        return AssetSpec(
            key=key,
            deps=[self.get_asset_spec(table, upstream).key for upstream in _UPSTREAM[role]],
            group_name=self.group_name(table),
            kinds=_KINDS[role],
            description=self.description(table, role),
            metadata=metadata,
            freshness_policy=self.freshness_policy(table) if role == "iceberg" else None,
        )

    def freshness_policy(self, table: TableConfig) -> FreshnessPolicy | None:
        """The live table's time-window freshness policy, from ``dagster.freshness_*`` in the config
        (None: no policy). Dagster counts from the asset's last materialization: a merge, or the
        flusher sensor's report that a table with nothing to merge is current (see ``sensors/flusher.py``)."""
        windows = self.config.freshness_windows()
        if windows is None:
            return None
        warn, fail = windows
        return FreshnessPolicy.time_window(
            fail_window=timedelta(seconds=fail), warn_window=timedelta(seconds=warn) if warn else None
        )

    def partitions_name(self, table: TableConfig) -> str:
        """Name of the table's dynamic CTID-chunk partitions."""
        return self._table_parts(table).partitions

    def iceberg_table_name(self, table: TableConfig) -> str:
        namespace, name = self.config.iceberg_identifier(table)
        return f"{self.config.iceberg.catalog.name}.{namespace}.{name}"

    def column_description(self, table: TableConfig, column: str, in_key: bool) -> str | None:
        """What the live table's column schema says of a column: the key, or how it is masked (an
        excluded column is not in the Iceberg table at all)."""
        policy = table.mask.get(column)
        if policy is not None:
            return f"masked ({MASK_DESCRIPTIONS[policy]}), by the client before staging"
        names = self.config.change_metadata
        roles = dict(zip(names.column_names(), METADATA_DESCRIPTIONS, strict=True))
        roles |= dict(zip(names.deletion_column_names(), DELETION_DESCRIPTIONS, strict=True))
        if column in self.config.added_column_names(table):
            return f"change metadata (not a source column): {roles[column]}"
        return "primary key" if in_key else None

    def policy_description(self, table: TableConfig) -> str:
        """The live table's column selection, masks and row filter in words ('' when it has none)."""
        parts = []
        if table.columns is not None and table.columns.include is not None:
            parts.append(f"Only the columns {', '.join(table.columns.include)} are mirrored.")
        elif table.columns is not None:
            parts.append(f"The columns {', '.join(table.columns.exclude or [])} are left out (never leave the server).")
        if table.mask:
            parts.append(
                "Masked: " + ", ".join(f"{name} ({policy})" for name, policy in sorted(table.mask.items())) + "."
            )
        if table.where:
            parts.append(f"Only the rows where {table.where}.")
        return " ".join(parts)

    def description(self, table: TableConfig, role: str) -> str:
        iceberg = self.iceberg_table_name(table)
        policy = self.policy_description(table)
        return {
            "source": f"PostgreSQL table {table.key} (replicated through slot {self.config.replication.slot}).",
            "staged_log": f"Committed WAL changes of {table.key} staged as Parquet files and registered in "
            "_pg2iceberg.log_index. Materialized by the flusher sensor.",
            "snapshot": f"Initial snapshot of {table.key} into the Iceberg table {iceberg}, one partition per CTID "
            "page chunk. Writes the same Iceberg table as the live asset.",
            "iceberg": f"The live Iceberg table {iceberg}: the staged log merged by primary key, by a Spark MERGE "
            "or, for a batch pyiceberg writes exactly, by pyiceberg without a JVM. Writes the same Iceberg table as "
            "the snapshot asset." + (f" {policy}" if policy else ""),
            HISTORY: f"The history of {table.key} in the Iceberg table "
            f"{iceberg}{self.config.change_metadata.history_suffix}: one row per version of each source row, valid "
            "from/to by commit LSN and time; written by the live table's merge, right after it (docs/history.md).",
        }[role]
