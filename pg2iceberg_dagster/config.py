"""Pipeline configuration: one YAML file, validated, with secrets taken from the environment.

Secrets are never written in the file: a connection names the environment variable that holds its
password (``password_env``), and S3 credentials come from ``*_env`` fields or the AWS default chain.
Validation errors name the offending field, e.g. ``tables.1.name: expected 'schema.table'``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from psycopg.conninfo import make_conninfo
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .iceberg.delete_formats import READERS, DeleteFormat, chosen_format
from .iceberg.terms import PartitionTerm, SortTerm, parse_partition_term, parse_sort_term, repeated_columns

# An unquoted name, or a quoted one in which a double quote is written twice (SQL's own escape).
_IDENT = r'[A-Za-z_][A-Za-z0-9_$]*|"(?:[^"]|"")+"'
_QUALIFIED_NAME = re.compile(rf"^({_IDENT})\.({_IDENT})$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def secret_from_env(variable: str | None, what: str) -> str | None:
    """The value of the environment variable ``variable`` (None when no variable is named)."""
    if variable is None:
        return None
    value = os.environ.get(variable)
    if value is None:
        raise ConfigError(f"{what}: environment variable {variable} is not set")
    return value


class PostgresConnection(_Strict):
    """How to reach one PostgreSQL database. The password comes from ``password_env``.

    ``host`` may list several servers (``a,b``), with one ``port`` for all or one per host (``5432,5433``):
    libpq tries them in order, and ``target_session_attrs: read-write`` makes it pass over a standby, so
    after a failover every connection finds the promoted primary."""

    host: str = "127.0.0.1"
    port: int | str = 5432
    target_session_attrs: Literal["any", "read-write", "read-only", "primary", "standby", "prefer-standby"] | None = (
        None
    )
    dbname: str
    user: str = "postgres"
    password_env: str | None = None
    # Set only programmatically (e.g. from a Dagster EnvVar); never shown, never serialized.
    password: SecretStr | None = Field(default=None, exclude=True, repr=False)
    sslmode: str | None = None
    connect_timeout: int = Field(10, ge=1)
    application_name: str = "pg2iceberg-dagster"

    @field_validator("port")
    @classmethod
    def _port_numbers(cls, value: int | str) -> int | str:
        ports = str(value).split(",")
        if not all(port.strip().isdigit() and 1 <= int(port) <= 65535 for port in ports):
            # The value is not echoed: a secret pasted into the wrong field must not reach a log.
            raise ValueError("expected a port number (1-65535) or a comma-separated list of them (5432,5433)")
        return int(value) if len(ports) == 1 else ",".join(port.strip() for port in ports)

    @model_validator(mode="after")
    def _ports_match_hosts(self) -> PostgresConnection:
        ports, hosts = str(self.port).split(","), self.host.split(",")
        if len(ports) > 1 and len(ports) != len(hosts):
            raise ValueError(f"port lists {len(ports)} ports for {len(hosts)} hosts: give one port, or one per host")
        return self

    def endpoints(self) -> list[tuple[str, int]]:
        """(host, port) of each server ``host`` lists, in order."""
        hosts = [host.strip() for host in self.host.split(",")]
        ports = [int(port) for port in str(self.port).split(",")]
        return list(zip(hosts, ports * len(hosts) if len(ports) == 1 else ports, strict=True))

    def resolved_password(self) -> str | None:
        """The password: set programmatically, or read now from ``password_env``."""
        if self.password is not None:
            return self.password.get_secret_value()
        return secret_from_env(self.password_env, "password_env")

    def conninfo(self, **overrides: Any) -> str:
        """libpq connection string, password resolved from the environment now."""
        params: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "dbname": self.dbname,
            "user": self.user,
            "connect_timeout": self.connect_timeout,
            "application_name": self.application_name,
        }
        password = self.resolved_password()
        if password is not None:
            params["password"] = password
        if self.sslmode:
            params["sslmode"] = self.sslmode
        if self.target_session_attrs:
            params["target_session_attrs"] = self.target_session_attrs
        params.update(overrides)
        return make_conninfo(**params)

    def describe(self) -> str:
        """A secret-free description for logs and errors."""
        servers = ",".join(f"{host}:{port}" for host, port in self.endpoints())
        return f"postgresql://{self.user}@{servers}/{self.dbname}"


def _partition_expression(value: str) -> str:
    parse_partition_term(value)
    return value


def _known_reader(value: str) -> str:
    if value not in READERS:
        raise ValueError(
            f"{value!r} is not a reader whose delete formats are known here ({', '.join(READERS)}): "
            "leave it out and set delete_format directly"
        )
    return value


def _sort_expression(value: str) -> str:
    parse_sort_term(value)
    return value


# Columns the merge adds to its batches begin so (materializer/spark_sql.py): no metadata column may.
RESERVED_COLUMN_PREFIX = "_pg2iceberg"

MaskPolicy = Literal["hash", "null", "redact"]


class ColumnSelection(_Strict):
    """Which columns of a table are mirrored: ``include`` (only these) or ``exclude`` (all but these),
    not both (``source/policy.py`` applies them; docs/columns.md)."""

    include: list[str] | None = None
    exclude: list[str] | None = None

    @model_validator(mode="after")
    def _one_list(self) -> ColumnSelection:
        if (self.include is None) == (self.exclude is None):
            raise ValueError("give either include or exclude (a list of column names), not both")
        listed = self.include if self.include is not None else self.exclude
        if self.include is not None and not listed:
            raise ValueError("include must list at least one column")
        repeated = repeated_columns(listed or [])
        if repeated:
            raise ValueError(f"column {repeated[0]} is listed twice")
        return self


class ChangeMetadataConfig(_Strict):
    """Change metadata columns (docs/change_metadata.md): per row, the LSN and source commit time of its
    last change and when it was merged. ``enabled`` turns them on for every table (a table's own
    ``change_metadata: true/false`` overrides it); the names are the Iceberg columns'."""

    enabled: bool = False
    lsn_column: str = Field("_pg_lsn", min_length=1)
    committed_at_column: str = Field("_pg_committed_at", min_length=1)
    merged_at_column: str = Field("_pg_merged_at", min_length=1)
    # The deletion columns of tables with ``deletes: soft`` (docs/change_metadata.md).
    deleted_at_column: str = Field("_pg_deleted_at", min_length=1)
    deleted_lsn_column: str = Field("_pg_deleted_lsn", min_length=1)
    # History tables (docs/history.md): one row per version of each source row, in a second Iceberg table
    # named like the mirror plus ``history_suffix``; ``history`` turns them on for every table (a table's
    # own ``history: true/false`` overrides it).
    history: bool = False
    history_suffix: str = Field("_history", min_length=1)
    valid_from_lsn_column: str = Field("_pg_valid_from_lsn", min_length=1)
    valid_from_at_column: str = Field("_pg_valid_from_at", min_length=1)
    valid_to_lsn_column: str = Field("_pg_valid_to_lsn", min_length=1)
    valid_to_at_column: str = Field("_pg_valid_to_at", min_length=1)
    operation_column: str = Field("_pg_operation", min_length=1)
    current_column: str = Field("_pg_is_current", min_length=1)

    @model_validator(mode="after")
    def _distinct_names(self) -> ChangeMetadataConfig:
        names = self.column_names() + self.deletion_column_names() + self.history_column_names()
        repeated = repeated_columns(names)
        if repeated:
            raise ValueError(f"column name {repeated[0]} is given to two change metadata columns")
        for name in names:
            if name.startswith(RESERVED_COLUMN_PREFIX):
                raise ValueError(f"column name {name}: names starting {RESERVED_COLUMN_PREFIX} are the merge's own")
        return self

    def column_names(self) -> list[str]:
        """The three columns' names (LSN, commit time, merge time)."""
        return [self.lsn_column, self.committed_at_column, self.merged_at_column]

    def deletion_column_names(self) -> list[str]:
        """The deletion columns' names (time, LSN) of tables with ``deletes: soft``."""
        return [self.deleted_at_column, self.deleted_lsn_column]

    def history_column_names(self) -> list[str]:
        """The history table's own columns: valid from (LSN, time), valid to (LSN, time), operation, current."""
        return [
            self.valid_from_lsn_column,
            self.valid_from_at_column,
            self.valid_to_lsn_column,
            self.valid_to_at_column,
            self.operation_column,
            self.current_column,
        ]


class TableConfig(_Strict):
    """One source table. ``primary_key`` overrides the declared key (for tables without one).

    ``partition_by`` and ``sort_by`` lay out its Iceberg table (``iceberg/terms.py`` has the syntax,
    ``iceberg/layout.py`` how they are applied and evolved). Each item is validated on its own, so an
    error names it (``tables.0.partition_by.1``)."""

    name: str
    primary_key: list[str] | None = None
    iceberg_name: str | None = None
    partition_by: list[Annotated[str, AfterValidator(_partition_expression)]] | None = None
    sort_by: list[Annotated[str, AfterValidator(_sort_expression)]] | None = None
    # Column selection, masking and a row filter (docs/columns.md): excluded columns and filtered rows
    # stay on the server (PostgreSQL 15+); masked values are replaced by the client before staging.
    columns: ColumnSelection | None = None
    mask: dict[str, MaskPolicy] = {}
    # The environment variable holding the secret key of ``hash`` masks (never in the file or logs).
    mask_key_env: str | None = None
    where: str | None = Field(None, min_length=1)
    # Overrides change_metadata.enabled for this table (None: the pipeline's setting).
    change_metadata: bool | None = None
    # soft: a row deleted at the source stays, marked by the deletion columns (change_metadata.deleted_*).
    deletes: Literal["hard", "soft"] = "hard"
    # Overrides change_metadata.history for this table (None: the pipeline's setting): a history table.
    history: bool | None = None
    # This table's delete format, or the engines that read it (docs/readers.md); unset: the pipeline's.
    delete_format: DeleteFormat | None = None
    readers: list[Annotated[str, AfterValidator(_known_reader)]] | None = None

    @model_validator(mode="after")
    def _mask_rules(self) -> TableConfig:
        if "hash" in self.mask.values() and not self.mask_key_env:
            raise ValueError("mask: hash needs mask_key_env, the environment variable holding the secret key")
        excluded = set(self.columns.exclude or []) if self.columns else set()
        included = set(self.columns.include or []) if self.columns and self.columns.include is not None else None
        for name in self.mask:
            if name in excluded or (included is not None and name not in included):
                raise ValueError(f"mask: column {name} is not mirrored (columns leaves it out): mask or leave out")
            if self.primary_key and name in self.primary_key:
                raise ValueError(f"mask: column {name} is in primary_key, which is never masked")
        return self

    @field_validator("name")
    @classmethod
    def _qualified(cls, value: str) -> str:
        if not _QUALIFIED_NAME.match(value):
            raise ValueError(f"expected 'schema.table', got {value!r}")
        return value

    @field_validator("primary_key", mode="before")
    @classmethod
    def _one_column(cls, value: Any) -> Any:
        """``primary_key: id`` is the one-column list ``[id]``."""
        return [value] if isinstance(value, str) else value

    @field_validator("primary_key")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("primary_key must list at least one column")
        return value

    @field_validator("partition_by", "sort_by")
    @classmethod
    def _each_column_once(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        # pyiceberg writes one partition value per source column: two fields of one column (day and
        # hour, identity and bucket) make it refuse every write. A second sort key of a column is void.
        parse = parse_partition_term if info.field_name == "partition_by" else parse_sort_term
        repeated = repeated_columns([parse(item).column for item in value or []])
        if repeated:
            raise ValueError(f"column {repeated[0]} is listed twice: one item per column")
        return value

    @property
    def partition_terms(self) -> tuple[PartitionTerm, ...]:
        """``partition_by`` parsed (empty: unpartitioned)."""
        return tuple(parse_partition_term(item) for item in self.partition_by or ())

    @property
    def sort_terms(self) -> tuple[SortTerm, ...]:
        """``sort_by`` parsed (empty: unsorted)."""
        return tuple(parse_sort_term(item) for item in self.sort_by or ())

    @property
    def schema_name(self) -> str:
        return _unquote(_QUALIFIED_NAME.match(self.name).group(1))  # type: ignore[union-attr]

    @property
    def table_name(self) -> str:
        return _unquote(_QUALIFIED_NAME.match(self.name).group(2))  # type: ignore[union-attr]

    @property
    def key(self) -> str:
        """Canonical unquoted ``schema.table`` used as the key in coordination tables."""
        return f"{self.schema_name}.{self.table_name}"

    @classmethod
    def named(cls, schema_name: str, table_name: str) -> TableConfig:
        """The entry of the table ``schema_name``.``table_name`` (exact names: quoted)."""
        return cls(name=".".join('"' + part.replace('"', '""') + '"' for part in (schema_name, table_name)))


def _unquote(identifier: str) -> str:
    return identifier[1:-1].replace('""', '"') if identifier.startswith('"') else identifier


class ReplicationConfig(_Strict):
    """Replication slot and publication."""

    slot: str = Field("pg2iceberg_slot", pattern=r"^[a-z0-9_]{1,63}$")
    publication: str = Field("pg2iceberg_pub", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
    create_publication: bool = True
    status_interval_seconds: float = Field(10.0, gt=0)
    # The slot is gone or lost WAL (same cluster): ``repair`` lets ``run`` and ``stream`` create a new
    # slot and write into each Iceberg table only its differences from the source (see repair.py);
    # ``refuse`` stops them, naming ``pg2iceberg-dagster repair`` as the way back.
    on_slot_lost: Literal["repair", "refuse"] = "repair"
    # Create the slot as a failover slot, which standbys with sync_replication_slots keep in step so a
    # promoted standby continues it (docs/operations.md): auto on PostgreSQL 17+, true refuses older.
    failover_slot: Literal["auto"] | bool = "auto"
    # The slot's health (validation.slot_safety; Dagster's ``slot_safe`` check) warns when it can retain
    # less than this fraction of max_slot_wal_keep_size more WAL before losing some...
    slot_warn_safe_wal_fraction: float = Field(0.2, ge=0, le=1)
    # ...or when nothing has streamed from it for this long (PostgreSQL 17+ records since when)...
    slot_inactive_warn_seconds: float = Field(600.0, gt=0)
    # ...or when, at the rate its safe_wal_size shrinks now, it would lose WAL within this many minutes
    # (wal_budget.py; needs max_slot_wal_keep_size set). 0 turns this rule off.
    slot_warn_minutes_until_lost: float = Field(60.0, ge=0)
    # ``run`` keeps trying to reach the source for this long after losing it once it was running (a
    # failover's promotion, a restart), then exits with the error. 0: exit at once.
    reconnect_seconds: float = Field(300.0, ge=0)


class S3Config(_Strict):
    """S3-compatible endpoint settings; credentials from the environment."""

    endpoint: str | None = None
    region: str = "us-east-1"
    access_key_id_env: str | None = None
    secret_access_key_env: str | None = None
    path_style: bool = True
    # Set only programmatically (e.g. from dagster-aws's S3Resource); never shown, never serialized.
    access_key_id: SecretStr | None = Field(default=None, exclude=True, repr=False)
    secret_access_key: SecretStr | None = Field(default=None, exclude=True, repr=False)

    def credentials(self) -> tuple[str | None, str | None]:
        """(access key id, secret key): set programmatically, else from the named variables, else
        (None, None) for the AWS default chain."""
        if self.access_key_id is not None and self.secret_access_key is not None:
            return self.access_key_id.get_secret_value(), self.secret_access_key.get_secret_value()
        return (
            secret_from_env(self.access_key_id_env, "s3.access_key_id_env"),
            secret_from_env(self.secret_access_key_env, "s3.secret_access_key_env"),
        )


class StagingConfig(_Strict):
    """Where staged Parquet files live: ``file:///path`` or ``s3://bucket/prefix``."""

    url: str = "file:///tmp/pg2iceberg/staging"
    s3: S3Config = S3Config()

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if not value.startswith(("file://", "s3://")):
            raise ValueError("must start with file:// or s3://")
        return value.rstrip("/")


class CatalogConfig(_Strict):
    """The Iceberg catalog. ``sql`` keeps it in a Postgres database; ``rest`` and ``glue`` are remote."""

    type: Literal["sql", "rest", "glue"] = "sql"
    name: str = Field("pg2iceberg", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    postgres: PostgresConnection | None = None
    uri: str | None = None
    credential_env: str | None = None
    properties: dict[str, str] = {}

    @model_validator(mode="after")
    def _needs_uri(self) -> CatalogConfig:
        if self.type == "rest" and not self.uri:
            raise ValueError("a rest catalog needs uri")
        return self


# Properties of the tables we create; the config's own are laid over them. A 64 KiB dictionary page
# keeps dictionaries for low-cardinality columns but gives up early on the others, where building a
# dictionary doubled Parquet encoding time and, under zstd, made files larger (bench/snapshot.py).
# Each commit writes a new metadata file; a mirror commits every second or so, so Spark and pyiceberg
# delete those past the table's metadata log (100 by default) at commit instead of leaving tens of
# thousands a day to orphan removal. Merge-on-read writes one position delete file per partition and
# write task instead of one per data file a merge touched: a 200k-change batch into a 2M-row table
# wrote 24 delete files and took twice as long (bench/merge.py); readers load each such file once per
# scan (Spark's executor cache, pyiceberg), and maintenance compacts them.
DEFAULT_TABLE_PROPERTIES = {
    "format-version": "2",
    "write.parquet.dict-size-bytes": "65536",
    "write.metadata.delete-after-commit.enabled": "true",
    "write.delete.granularity": "partition",
}


class IcebergConfig(_Strict):
    """Iceberg catalog, warehouse and how source schemas map to namespaces."""

    catalog: CatalogConfig = CatalogConfig()
    warehouse: str = "file:///tmp/pg2iceberg/warehouse"
    namespace: str = "{schema}"
    table_properties: dict[str, str] = DEFAULT_TABLE_PROPERTIES
    # A table removed from the config while ``run`` runs: its Iceberg table is kept unless this is set.
    drop_removed_tables: bool = False
    # How merges record deleted rows, directly or chosen for the engines that read the tables
    # (iceberg/delete_formats.py, docs/readers.md); a table's own setting wins. Unset: table_properties.
    delete_format: DeleteFormat | None = None
    readers: list[Annotated[str, AfterValidator(_known_reader)]] = []

    @field_validator("table_properties")
    @classmethod
    def _over_defaults(cls, value: dict[str, str]) -> dict[str, str]:
        return {**DEFAULT_TABLE_PROPERTIES, **value}

    @field_validator("namespace")
    @classmethod
    def _template(cls, value: str) -> str:
        try:
            value.format(schema="s")
        except (KeyError, IndexError) as exc:
            raise ValueError("may only use the placeholder {schema}") from exc
        return value


class SparkConfig(_Strict):
    """Spark session: a master or a Spark Connect remote, jars or Maven packages, extra conf."""

    master: str = "local[2]"
    remote: str | None = None
    app_name: str = "pg2iceberg-dagster"
    jars: list[str] | None = None
    packages: list[str] = []
    conf: dict[str, str] = {}
    # Dagster merge runs attach to one long-lived Spark driver on this machine (the first run starts
    # it; it exits after ``warm_idle_seconds`` without a run) instead of each starting a JVM.
    warm_server: bool = True
    warm_idle_seconds: float = Field(900.0, gt=0)


class SnapshotConfig(_Strict):
    """CTID chunking of the initial snapshot."""

    chunk_pages: int = Field(2048, ge=1)
    parallelism: int = Field(3, ge=1, le=64)
    # The holder keeps the exported snapshot (and so the source's xmin) this long with no snapshot
    # process running: a crashed `snapshot` restarted within it resumes chunk by chunk.
    holder_idle_seconds: float = Field(900.0, gt=0)


class FlushConfig(_Strict):
    """When the flusher stages what it has buffered, and how much one transaction may hold in memory."""

    max_rows: int = Field(50_000, ge=1)
    max_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    interval_seconds: float = Field(5.0, gt=0)
    # Under ``run``, while no merge is in progress, a flush at least this long after the previous one
    # is not held back to ``interval_seconds``: the merge it wakes starts at once. It bounds the files
    # and Iceberg commits an idle materializer adds (at most one per table per this many seconds);
    # at or above ``interval_seconds`` it changes nothing.
    min_interval_seconds: float = Field(1.0, ge=0)
    txn_memory_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    spill_dir: str | None = None


class MaterializeConfig(_Strict):
    """Materializer batching and leases."""

    group: str = "default"
    max_batch_changes: int = Field(500_000, ge=1)
    interval_seconds: float = Field(10.0, gt=0)
    # A batch into a table of at least this many rows deletes its keys and appends its upserts on a
    # branch, then fast-forwards main (one commit), instead of a MERGE that shuffles the whole table.
    # Below it the MERGE's one commit is cheaper (measured crossover on 2 cores: about 300k rows).
    branch_upsert_min_rows: int = Field(300_000, ge=0)
    # A batch into a copy-on-write table of at most this many rows (its keys of integer, text or date
    # types, every column carried) is written by pyiceberg in this process: the files holding its keys
    # rewritten without them and with its upserts, in one commit. A Spark MERGE costs about 0.2
    # CPU-seconds whatever its size; on 2 cores this took 0.07 for a 1,000-row table's 70 changes, and
    # 0.42 against Spark's 3.4-4.2 for a 1M-row table's 1,000 (materializer/append.py). The data files
    # it rewrites are read into this process's memory, hence the limit. 0: always Spark.
    pyiceberg_max_rows: int = Field(1_000_000, ge=0)
    # Tables merged at once on the one Spark session (each with its own connections): a small
    # table's merge is mostly Spark's per-statement overhead, which other merges fill. Four at a
    # time took about half the time per table of one at a time on 2 cores (bench/tables.py).
    parallelism: int = Field(4, ge=1, le=64)
    # A source change the WAL cannot follow (a type Iceberg cannot evolve into, a rewrite that changed
    # older rows) requests an online resync of that table; off: the merge stops with the error.
    auto_resync: bool = True
    # Under Dagster: a table's next merge run is not launched until this long after its last one was
    # created, so a table written to all the time merges several flushes per run instead of paying a
    # run's start-up (a new process, imports, resources) for each; 0: launch whenever it lags.
    min_run_interval_seconds: float = Field(30.0, ge=0)


class ChecksConfig(_Strict):
    """The data checks that follow merges in Dagster (``matches_source``, ``primary_key_unique``)."""

    # A table holding more rows than this is compared with the source on a slice of this many rows
    # at each check, a range of its (integer) primary key from a random key, so that a check's time
    # and memory do not grow with the table (200k narrow rows: about 2.5 s and 300 MiB); `verify`
    # compares whole tables.
    compare_max_rows: int = Field(200_000, ge=1)
    # Its keys are checked for duplicates whole up to this many rows (only the key columns are read:
    # 2M bigint keys took 0.75 s and 250 MiB), in the same slice above it.
    unique_keys_max_rows: int = Field(2_000_000, ge=1)
    # A quiet table (nothing to merge) still gets a merge run with its checks at least this often, so
    # its checks say how it is now rather than never running, and its freshness policy sees it current
    # (0: only when it lags). Default: half the freshness warn window, else 600 s.
    quiet_interval_seconds: float | None = Field(None, ge=0)
    # A lagging table's checks join its merge run when they last ran at least this long ago (0: every
    # merge run). Dagster stores an event for every check a run plans before it queues the run: four
    # of a table's five at its creation. Hundreds of tables merging at once create runs faster with
    # their checks every few minutes instead of after each merge.
    min_interval_seconds: float = Field(0.0, ge=0)


class MaintenanceConfig(_Strict):
    """Day-2 upkeep of each Iceberg table (``maintenance/``): compaction of small data files and of
    delete files, snapshot expiry, removal of orphan files, and the staged log's applied files.

    A table is maintained every ``interval_minutes``, and sooner once merges leave it with
    ``compact_at_files`` small data files (under 3/4 of the target size), or ``compact_at_files``
    delete files that are more than ``max_delete_ratio`` per data file."""

    enabled: bool = True
    interval_minutes: float = Field(15.0, gt=0)
    target_file_size_mb: float = Field(128.0, gt=0)
    compact_at_files: int = Field(50, ge=2)
    max_delete_ratio: float = Field(0.2, ge=0)
    # Snapshots younger than this stay (time travel, readers in flight); the newest ``min_snapshots``
    # stay whatever their age. A mirror commits every few seconds: a day of snapshots would make every
    # commit rewrite megabytes of metadata, so the default keeps an hour.
    snapshot_retention_hours: float = Field(1.0, ge=0)
    min_snapshots: int = Field(5, ge=1)
    # A file no snapshot references is deleted only once it is this old: a commit in flight elsewhere
    # (another engine writing the table) may still add it.
    orphan_min_age_hours: float = Field(24.0, ge=0)

    @property
    def target_file_size_bytes(self) -> int:
        return int(self.target_file_size_mb * 1024 * 1024)


OutOfRange = Literal["clamp", "null"]


class ValuesConfig(_Strict):
    """What becomes of values Iceberg cannot hold (``iceberg/values.py`` has the table): ``clamp`` to the
    nearest value it can (NaN in numeric(p, s) becomes NULL), or ``null``. Applied alike by the snapshot,
    the merge and ``verify``; a change applies to values replicated after it."""

    out_of_range: OutOfRange = "clamp"


class MetricsConfig(_Strict):
    """Prometheus metrics served over HTTP by ``run`` and by the Dagster code location that runs the
    flusher sensor (``metrics.py``): off unless ``port`` is set."""

    port: int | None = Field(None, ge=1, le=65535)
    # Loopback by default: the endpoint needs no credentials, so exposing it is a deliberate choice.
    host: str = "127.0.0.1"


class DagsterConfig(_Strict):
    """How the mirror shows its health in Dagster. Each live Iceberg table asset carries a time-window
    freshness policy: WARN once its last materialization is ``freshness_warn_seconds`` old, FAIL at
    ``freshness_fail_seconds`` (Dagster needs both at least 60 s, warn below fail). Unset, they derive
    from the flush and merge cadence: warn at 20 x (flush.interval_seconds + materialize.interval_seconds),
    300 s by default, and fail at 3 x warn. ``freshness: false`` leaves the policies off."""

    freshness: bool = True
    freshness_warn_seconds: float | None = Field(None, ge=60)
    freshness_fail_seconds: float | None = Field(None, ge=60)


class CutsConfig(_Strict):
    """Consistent cuts (``cuts.py``, docs/cuts.md): every table of a group complete up to one source LSN
    and tagged with one name. ``interval_minutes`` takes one on that schedule (Dagster's cut schedule;
    unset: only ``cut`` on demand); the newest ``keep`` cuts stay, and of those only the ones younger
    than ``max_age_hours`` (unset: no age limit). ``groups`` names sets of tables cut together
    (``cut --group``); without one a cut takes every mirrored table."""

    interval_minutes: float | None = Field(None, gt=0)
    keep: int = Field(24, ge=1)
    max_age_hours: float | None = Field(None, gt=0)
    groups: dict[str, list[str]] = {}

    @field_validator("interval_minutes")
    @classmethod
    def _cron_interval(cls, value: float | None) -> float | None:
        # Dagster schedules are cron schedules: minutes dividing an hour, or whole hours dividing a day.
        if value is None or (
            value == int(value) and (60 % value == 0 if value < 60 else 1440 % value == 0 and value % 60 == 0)
        ):
            return value
        raise ValueError(
            f"{value:g} is neither a divisor of 60 nor a whole number of hours dividing 24: use e.g. 5, 15, 60 or 360"
        )

    @field_validator("groups")
    @classmethod
    def _group_tables(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for group, names in value.items():
            if not names:
                raise ValueError(f"group {group!r} lists no table")
            for name in names:
                if not _QUALIFIED_NAME.match(name):
                    raise ValueError(f"group {group!r}: {name!r} is not schema.table")
        return value


class SchemaSelection(_Strict):
    """Every table of a schema whose name matches an ``include`` glob and no ``exclude`` glob
    (ordinary and partitioned tables, not partitions): ``{schema: app, exclude: ["tmp_*"]}`` in
    ``tables``. Which tables that is, is read from the source (``source/selection.py``), again as
    ``run`` goes: a table created there later is mirrored too."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_name: str = Field(alias="schema", min_length=1)
    include: list[str] = ["*"]
    exclude: list[str] = []


class PipelineConfig(_Strict):
    """The whole pipeline: source, tables, replication, state, staging, Iceberg, Spark, metrics."""

    source: PostgresConnection
    tables: list[TableConfig]
    # Entries of ``tables`` that name a schema; its tables join ``tables`` once read from the source.
    schemas: list[SchemaSelection] = []
    replication: ReplicationConfig = ReplicationConfig()
    state: PostgresConnection | None = None
    staging: StagingConfig = StagingConfig()
    iceberg: IcebergConfig = IcebergConfig()
    spark: SparkConfig = SparkConfig()
    snapshot: SnapshotConfig = SnapshotConfig()
    flush: FlushConfig = FlushConfig()
    materialize: MaterializeConfig = MaterializeConfig()
    checks: ChecksConfig = ChecksConfig()
    values: ValuesConfig = ValuesConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()
    metrics: MetricsConfig = MetricsConfig()
    dagster: DagsterConfig = DagsterConfig()
    cuts: CutsConfig = CutsConfig()
    change_metadata: ChangeMetadataConfig = ChangeMetadataConfig()

    @model_validator(mode="before")
    @classmethod
    def _schema_entries(cls, data: Any) -> Any:
        """``tables`` entries with a ``schema`` key select a schema's tables (see SchemaSelection); an
        entry that is just a name (``- public.orders``) is ``{name: public.orders}``."""
        if isinstance(data, dict) and isinstance(data.get("tables"), list):
            entries = [{"name": entry} if isinstance(entry, str) else entry for entry in data["tables"]]
            data = {**data, "tables": entries}
            selections = [entry for entry in entries if isinstance(entry, dict) and "schema" in entry]
            if selections:
                data = {
                    **data,
                    "tables": [entry for entry in entries if entry not in selections],
                    "schemas": [*data.get("schemas", []), *selections],
                }
        return data

    def change_metadata_for(self, table: TableConfig) -> ChangeMetadataConfig | None:
        """The change metadata columns ``table`` carries (None: none)."""
        enabled = self.change_metadata.enabled if table.change_metadata is None else table.change_metadata
        return self.change_metadata if enabled else None

    def added_column_names(self, table: TableConfig) -> list[str]:
        """The columns ``table``'s Iceberg table has beside the source's: change metadata, deletion."""
        metadata = self.change_metadata_for(table)
        names = metadata.column_names() if metadata else []
        return names + (self.change_metadata.deletion_column_names() if table.deletes == "soft" else [])

    def freshness_windows(self) -> tuple[float | None, float] | None:
        """(warn, fail) seconds of the live tables' freshness policy (see :class:`DagsterConfig`), None
        when off; warn is None when only a fail window of at most 60 s is set (Dagster's minimum)."""
        settings = self.dagster
        if not settings.freshness:
            return None
        derived = max(60.0, 20 * (self.flush.interval_seconds + self.materialize.interval_seconds))
        warn: float | None = settings.freshness_warn_seconds or derived
        fail = settings.freshness_fail_seconds or 3 * (warn or derived)
        if settings.freshness_warn_seconds is None and warn is not None and warn >= fail:
            warn = fail / 3 if fail / 3 >= 60 else None
        return warn, fail

    def quiet_interval(self) -> float:
        """Seconds a quiet table goes without a merge run (and its checks): ``checks.quiet_interval_seconds``,
        by default half the freshness warn (or fail) window, so a current table never looks stale."""
        if self.checks.quiet_interval_seconds is not None:
            return self.checks.quiet_interval_seconds
        windows = self.freshness_windows()
        return (windows[0] or windows[1]) / 2 if windows else 600.0

    @model_validator(mode="after")
    def _freshness_order(self) -> PipelineConfig:
        windows = self.freshness_windows()
        if windows and windows[0] is not None and windows[0] >= windows[1]:
            raise ValueError(
                f"dagster.freshness_warn_seconds ({windows[0]:g}) must be below freshness_fail_seconds ({windows[1]:g})"
            )
        return self

    @field_validator("tables")
    @classmethod
    def _unique_tables(cls, value: list[TableConfig]) -> list[TableConfig]:
        keys = [table.key for table in value]
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        if duplicates:
            raise ValueError(f"listed more than once: {', '.join(duplicates)}")
        return value

    @model_validator(mode="after")
    def _some_table(self) -> PipelineConfig:
        if not self.tables and not self.schemas:
            raise ValueError("tables: list at least one table (schema.table) or schema ({schema: name})")
        return self

    @model_validator(mode="after")
    def _one_mirror_per_table(self) -> PipelineConfig:
        shared = self.shared_mirror()
        if shared:
            raise ValueError(shared)
        return self

    def shared_mirror(self) -> str | None:
        """Why two tables (or a table and another's history table) would be written into one Iceberg
        table, which would overwrite each other's rows; None when none would."""
        mirrors: dict[tuple[str, str], list[str]] = {}
        for table in self.tables:
            mirrors.setdefault(self.iceberg_identifier(table), []).append(f"table {table.key}")
            history = self.history_identifier(table)
            if history is not None:
                mirrors.setdefault(history, []).append(f"the history of table {table.key}")
        for (namespace, name), keys in mirrors.items():
            if len(keys) > 1:
                return (
                    f"{' and '.join(keys)} would all be written into the Iceberg table {namespace}.{name}: "
                    "give them different iceberg_name values (or a namespace with {schema}, or another "
                    "change_metadata.history_suffix)"
                )
        return None

    @property
    def state_connection(self) -> PostgresConnection:
        """Where the coordination tables live: ``state`` or else the source database."""
        return self.state or self.source

    @property
    def catalog_connection(self) -> PostgresConnection:
        """The Postgres database of the SQL catalog: ``iceberg.catalog.postgres`` or the source."""
        return self.iceberg.catalog.postgres or self.source

    def with_selected_tables(self, selected: Iterable[tuple[str, str]]) -> PipelineConfig:
        """This config with the tables ``(schema, table)`` its schema entries select added to ``tables``
        (a table also named in ``tables`` keeps that entry)."""
        named = {table.key for table in self.tables}
        added = [table for table in (TableConfig.named(*name) for name in selected) if table.key not in named]
        return self.model_copy(update={"tables": [*self.tables, *added]})

    def iceberg_identifier(self, table: TableConfig) -> tuple[str, str]:
        """(namespace, name) of the Iceberg table mirroring ``table``."""
        return self.iceberg.namespace.format(schema=table.schema_name), table.iceberg_name or table.table_name

    def history_for(self, table: TableConfig) -> ChangeMetadataConfig | None:
        """The settings of ``table``'s history table (None: it has none)."""
        enabled = self.change_metadata.history if table.history is None else table.history
        return self.change_metadata if enabled else None

    def history_identifier(self, table: TableConfig) -> tuple[str, str] | None:
        """(namespace, name) of the Iceberg table holding ``table``'s history (None: it has none)."""
        history = self.history_for(table)
        if history is None:
            return None
        namespace, name = self.iceberg_identifier(table)
        return namespace, name + history.history_suffix

    def readers_of(self, table: TableConfig) -> list[str]:
        """The engines declared to read ``table``'s mirror (its own list, else the pipeline's)."""
        return table.readers if table.readers is not None else self.iceberg.readers

    def delete_format_of(self, table: TableConfig) -> DeleteFormat | None:
        """``table``'s declared delete format: its own, else chosen for its own readers, else the
        pipeline's, else chosen for the pipeline's readers; None when nothing is declared (the format
        ``iceberg.table_properties`` gives)."""
        if table.delete_format is not None:
            return table.delete_format
        if table.readers:
            return chosen_format(table.readers)
        if self.iceberg.delete_format is not None:
            return self.iceberg.delete_format
        return chosen_format(self.iceberg.readers) if self.iceberg.readers else None


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"  {location}: {message}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<config>") -> PipelineConfig:
    """Validate a mapping into a PipelineConfig, raising ConfigError that names each bad field."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid configuration in {source}: expected a mapping at the top level")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def load_config(path: str | os.PathLike[str]) -> PipelineConfig:
    """Read and validate the YAML file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"configuration file {path} is not valid YAML: {exc}") from None
    return parse_config(data, str(path))
