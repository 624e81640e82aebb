"""The Iceberg catalog through pyiceberg: loading it, naming and creating mirror tables, committing."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from pyiceberg.catalog import PY_CATALOG_IMPL, Catalog, load_catalog

# Imported here, not by load_catalog on its first use: sqlalchemy.orm imported for the first time in
# one thread while another runs a SQLAlchemy query fails that query ("partially initialized module
# 'sqlalchemy.orm.exc'"), and Dagster evaluates the mirror's sensors in threads (seen on a first tick).
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import (
    CommitFailedException,
    NamespaceAlreadyExistsError,
    NoSuchNamespaceError,
    NoSuchTableError,
    TableAlreadyExistsError,
)
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.sorting import SortOrder
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError, ProgrammingError

from ..config import PipelineConfig, PostgresConnection, secret_from_env
from ..paths import path_segment
from ..source.catalog import SourceTable
from ..tables import MirroredTable
from .change_metadata import ensure_configured_columns
from .delete_formats import DESCRIBED, align_table, format_of, format_properties
from .evolution import attnum_properties
from .layout import initial_layout
from .manifests import read_manifests_once
from .sql_catalog import MirrorSqlCatalog
from .types import iceberg_schema

log = logging.getLogger(__name__)


def shared_catalog_properties(config: PipelineConfig) -> dict[str, str]:
    """The catalog's properties in Iceberg's own names, the same for pyiceberg and Spark: the
    warehouse, a REST catalog's uri and credential, the S3 FileIO settings, then ``catalog.properties``.
    Secrets are resolved from the environment now."""
    catalog = config.iceberg.catalog
    properties: dict[str, str] = {"warehouse": config.iceberg.warehouse}
    if catalog.type == "rest":
        properties["uri"] = catalog.uri or ""
        credential = secret_from_env(catalog.credential_env, "iceberg.catalog.credential_env")
        if credential:
            properties["credential"] = credential
    if config.staging.url.startswith("s3://") or config.iceberg.warehouse.startswith("s3://"):
        s3 = config.staging.s3
        access_key, secret_key = s3.credentials()
        properties["s3.region"] = properties["client.region"] = s3.region  # pyiceberg's name, Java's name
        if s3.endpoint:
            properties["s3.endpoint"] = s3.endpoint
        if s3.path_style:
            properties["s3.path-style-access"] = "true"
        if access_key and secret_key:
            properties["s3.access-key-id"] = access_key
            properties["s3.secret-access-key"] = secret_key
    properties.update(catalog.properties)
    return properties


def catalog_properties(config: PipelineConfig) -> dict[str, str]:
    """pyiceberg's properties: the shared ones plus the catalog type (for a SQL catalog, pyiceberg's
    own in :class:`.sql_catalog.MirrorSqlCatalog`, and its database URL)."""
    catalog = config.iceberg.catalog
    properties: dict[str, str] = {"type": catalog.type}
    if catalog.type == "sql":
        properties = {PY_CATALOG_IMPL: f"{MirrorSqlCatalog.__module__}.{MirrorSqlCatalog.__qualname__}"}
        pg = config.catalog_connection
        # Give up as the config says, as every other connection does, instead of hanging on a host
        # that drops packets. Each server as a ``host`` parameter: SQLAlchemy hands libpq the list.
        query: dict[str, str | list[str]] = {
            "host": [f"{host}:{port}" for host, port in pg.endpoints()],
            "connect_timeout": str(pg.connect_timeout),
        }
        if pg.target_session_attrs:
            query["target_session_attrs"] = pg.target_session_attrs
        url = URL.create(
            "postgresql+psycopg", username=pg.user, password=pg.resolved_password(), database=pg.dbname, query=query
        )
        properties["uri"] = url.render_as_string(hide_password=False)
    return {**properties, **shared_catalog_properties(config)}


def spark_catalog_conf(config: PipelineConfig) -> dict[str, str]:
    """Spark's ``spark.sql.catalog.<name>`` settings: the shared properties plus Spark's catalog
    implementation (and a SQL catalog's JDBC connection)."""
    catalog = config.iceberg.catalog
    prefix = f"spark.sql.catalog.{catalog.name}"
    properties: dict[str, str] = {
        # pyiceberg evolves schemas between merges: never merge against a cached, stale table.
        "cache-enabled": "false",
    }
    if catalog.type == "sql":
        pg = config.catalog_connection
        properties.update(
            {
                "type": "jdbc",
                "uri": _jdbc_url(pg),
                "jdbc.user": pg.user,
                "jdbc.schema-version": "V1",
                # A JDBC connection per concurrent merge (Iceberg's default pool holds 2).
                "clients": str(max(2, config.materialize.parallelism)),
            }
        )
        password = pg.resolved_password()
        if password:
            properties["jdbc.password"] = password
    elif catalog.type == "rest":
        properties["type"] = "rest"
    else:
        properties["catalog-impl"] = "org.apache.iceberg.aws.glue.GlueCatalog"
    properties.update(shared_catalog_properties(config))
    return {prefix: "org.apache.iceberg.spark.SparkCatalog", **{f"{prefix}.{k}": v for k, v in properties.items()}}


# libpq's target_session_attrs in pgjdbc's words (targetServerType).
_JDBC_SERVER_TYPES = {
    "any": "any",
    "read-write": "primary",
    "primary": "primary",
    "read-only": "secondary",
    "standby": "secondary",
    "prefer-standby": "preferSecondary",
}


def _jdbc_url(pg: PostgresConnection) -> str:
    """The JDBC URL of ``pg``: every server it lists, and which kind to pick as libpq would."""
    servers = ",".join(f"{host}:{port}" for host, port in pg.endpoints())
    url = f"jdbc:postgresql://{servers}/{pg.dbname}"
    if pg.target_session_attrs:
        url += f"?targetServerType={_JDBC_SERVER_TYPES[pg.target_session_attrs]}"
    return url


def open_catalog(config: PipelineConfig) -> Catalog:
    """The pyiceberg catalog; its name must match Spark's (the SQL catalog stores it per table)."""
    read_manifests_once()
    try:
        return load_catalog(config.iceberg.catalog.name, **catalog_properties(config))
    except (IntegrityError, ProgrammingError):
        # Another process of this pipeline created the SQL catalog's tables at the same moment (a
        # duplicate table or type): they exist now, and the second load finds them. A real fault
        # raises again.
        return load_catalog(config.iceberg.catalog.name, **catalog_properties(config))


def ensure_table(
    catalog: Catalog,
    config: PipelineConfig,
    mirrored: MirroredTable,
    source: SourceTable,
    properties: Mapping[str, str] | None = None,
) -> Table:
    """Load the mirror table, creating it (primary key as identifier fields, the configured partition
    spec and sort order, and ``properties`` too) when missing, with the change metadata and deletion
    columns the table is configured with."""
    table = _load_or_create(catalog, config, mirrored, source, properties or {})
    return ensure_configured_columns(table, config, mirrored.config, source.columns)


def _load_or_create(
    catalog: Catalog, config: PipelineConfig, mirrored: MirroredTable, source: SourceTable, extra: Mapping[str, str]
) -> Table:
    identifier = mirrored.iceberg
    try:
        return catalog.load_table(identifier)
    except NoSuchTableError:
        pass
    schema = iceberg_schema(source.columns, source.primary_key)
    properties = {**new_table_properties(config, mirrored), **attnum_properties(schema, source.columns), **extra}
    spec, sort_order = initial_layout(schema, mirrored.config, source.columns)

    def create() -> Table:
        if isinstance(catalog, SqlCatalog):
            return _create_sql_table(catalog, config, identifier, schema, spec, sort_order, properties)
        return catalog.create_table_if_not_exists(
            identifier,
            schema,
            location=new_table_location(config, identifier),
            partition_spec=spec,
            sort_order=sort_order,
            properties=properties,
        )

    try:
        return create()
    except NoSuchNamespaceError:  # the first table of its namespace (not tried for every table)
        pass
    # IntegrityError: the SQL catalog's insert lost a race with another process creating the namespace.
    with contextlib.suppress(NamespaceAlreadyExistsError, IntegrityError):
        catalog.create_namespace(identifier[:1])
    return create()


def refresh(table: Table) -> Table:
    """``table.refresh()``: the table as the catalog holds it now. With the SQL catalog a look at its
    row, and the metadata read again only when another writer moved it."""
    catalog = table.catalog
    if isinstance(catalog, MirrorSqlCatalog) and catalog.names_current(table):
        return table
    return table.refresh()


def new_table_properties(config: PipelineConfig, mirrored: MirroredTable) -> dict[str, str]:
    """The properties a new Iceberg table of ``mirrored`` (its live or its history table) starts with:
    the configured table properties and the write modes of its declared delete format."""
    properties = dict(config.iceberg.table_properties)
    delete_format = config.delete_format_of(mirrored.config)
    if delete_format is not None:
        properties.update(format_properties(delete_format))
    return properties


def align_delete_formats(catalog: Catalog, config: PipelineConfig, tables: Iterable[MirroredTable]) -> None:
    """Give every existing mirror table whose delete format is declared that format's write modes, so
    its later merges write it; the delete files it holds stay until maintenance compacts them (said in
    the log). Tables not created yet get the format when they are."""
    for mirrored in tables:
        delete_format = config.delete_format_of(mirrored.config)
        if delete_format is None:
            continue
        try:
            table = catalog.load_table(mirrored.iceberg)
        except NoSuchTableError:
            continue
        was = format_of(table.properties)
        if align_table(table, delete_format):
            snapshot = table.current_snapshot()
            summary = snapshot.summary.additional_properties if snapshot and snapshot.summary else {}
            log.warning(
                "table %s: merges write %s from now on (was %s); its %s delete files stay until "
                "`pg2iceberg-dagster maintain --table %s` compacts them",
                mirrored.key,
                DESCRIBED[delete_format],
                DESCRIBED[was],
                summary.get("total-delete-files", "0"),
                mirrored.key,
            )


def new_table_location(config: PipelineConfig, identifier: tuple[str, str]) -> str | None:
    """Where a new table's files go when its names are not plain (``?`` or ``#`` would end the path
    of a URL, ``/`` nest it): ``<warehouse>/<namespace segment>/<name segment>``. None (the catalog's
    own default, the same path) for plain names, and where the warehouse is not a path (a REST
    catalog's warehouse may name it; the catalog places the files)."""
    segments = [path_segment(part) for part in identifier]
    if segments == list(identifier) or "://" not in config.iceberg.warehouse:
        return None
    return "/".join([config.iceberg.warehouse.rstrip("/"), *segments])


# Each SQL catalog's namespaces as first read (see _create_sql_table): a snapshot of 200 new tables
# in one namespace looked the namespace up twice per table.
_NAMESPACE_PROPERTIES: weakref.WeakKeyDictionary[Catalog, dict[str, Mapping[str, str]]] = weakref.WeakKeyDictionary()


def _create_sql_table(
    catalog: SqlCatalog,
    config: PipelineConfig,
    identifier: tuple[str, str],
    schema: Schema,
    spec: PartitionSpec,
    sort_order: SortOrder,
    properties: dict[str, str],
) -> Table:
    """Create a table in the SQL catalog in one commit (its metadata written, its row inserted), or
    load it when another process created it first. pyiceberg's ``create_table`` looks the namespace
    up twice (to check it, for its default location) and reads the new table back: most of a new
    table's catalog queries.
    The namespace is looked up once per catalog object (pyiceberg's NoSuchNamespaceError when it
    does not exist, not remembered); the location is the one ``create_table`` gives."""
    namespace, name = identifier
    known = _NAMESPACE_PROPERTIES.setdefault(catalog, {})
    namespace_properties = known.get(namespace)
    if namespace_properties is None:
        namespace_properties = known[namespace] = catalog.load_namespace_properties(namespace)
    location = new_table_location(config, identifier)
    if location is None:
        parent = namespace_properties.get("location") or f"{config.iceberg.warehouse.rstrip('/')}/{namespace}"
        location = f"{parent.rstrip('/')}/{name}"
    creation = catalog.create_table_transaction(
        identifier, schema, location=location, partition_spec=spec, sort_order=sort_order, properties=properties
    )
    try:
        created = creation.commit_transaction()
    except (CommitFailedException, TableAlreadyExistsError):
        # Another process created it first: seen by the commit's look (its only requirement, that
        # the table does not exist, failed) or by its insert.
        return catalog.load_table(identifier)
    # A staged table cannot be refreshed: the same table as a catalog table.
    return Table(identifier, created.metadata, created.metadata_location, created.io, catalog)


def snapshot_summaries(table: Table) -> list[dict[str, Any]]:
    """Summary properties of every snapshot of ``table`` (oldest first)."""
    return [dict(snapshot.summary.additional_properties) if snapshot.summary else {} for snapshot in table.snapshots()]


def epoch_committed(table: Table, epoch_property: str, epoch: int) -> bool:
    """Whether the commit made for snapshot epoch ``epoch`` landed: a snapshot's summary names that epoch
    under ``epoch_property`` (a resync's switch, a repair's write), so a crash between the commit and
    recording it is recognised."""
    return any(summary.get(epoch_property) == str(epoch) for summary in snapshot_summaries(table))
