"""Housekeeping: drop staged files every group has applied, orphans of failed registrations, or the
whole state of one table (to snapshot it again) or of the pipeline."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from psycopg import sql
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError

from .config import PipelineConfig, TableConfig
from .coordination.migrations import SCHEMA
from .coordination.store import CoordinationStore
from .iceberg.catalog import table_identifier
from .source.catalog import publication_tables, table_list
from .source.connection import connect
from .staging.store import ObjectStore, legacy_table_location, staged_file_lsn, table_location

log = logging.getLogger(__name__)


@dataclass
class CleanupResult:
    files_deleted: int = 0
    tables_reset: int = 0
    slot_dropped: bool = False


def collect_garbage(config: PipelineConfig, store: CoordinationStore) -> CleanupResult:
    """Delete applied staged files and unregistered uploads at or below the flushed LSN."""
    objects = ObjectStore(config.staging)
    result = CleanupResult()
    flushed = store.flushed_lsn() or 0
    for table in config.tables:
        result.files_deleted += collect_table_garbage(store, objects, table.key, flushed)
    return result


def collect_table_garbage(store: CoordinationStore, objects: ObjectStore, table_key: str, flushed: int) -> int:
    """Delete ``table_key``'s staged files every group has applied, and its uploads no registration
    names at or below ``flushed`` (the flushed LSN); returns how many files. Only the table's own
    folder is listed, never another table's (see :func:`~.staging.store.table_location`); the folder
    of the first staging layout is swept too, once."""
    deleted = 0
    for path in store.delete_log_entries_before(table_key, store.min_mat_cursor(table_key)):
        objects.delete(path)
        deleted += 1
    registered = {entry.path for entry in store.log_entries(table_key, -1)}
    deleted += _delete_unregistered(objects, table_location(table_key), registered, flushed)
    if store.on_legacy_staging(table_key):
        legacy = legacy_table_location(table_key)
        if legacy is not None:
            deleted += _delete_unregistered(objects, legacy, registered, flushed)
        store.record_legacy_staging_swept(table_key)
    return deleted


def _delete_unregistered(objects: ObjectStore, folder: str, registered: set[str], flushed: int) -> int:
    """Delete the staged files directly in ``folder`` that no registration names, at or below ``flushed``."""
    deleted = 0
    for key in objects.files_in(folder):
        lsn = staged_file_lsn(key)
        # A file newer than flushed_lsn may belong to a flush that is registering right now.
        if key not in registered and lsn is not None and lsn <= flushed:
            objects.delete(key)
            deleted += 1
    return deleted


def reset_table(
    config: PipelineConfig, store: CoordinationStore, catalog: Catalog, table_key: str, drop_iceberg: bool = True
) -> None:
    """Forget a table (state, staged log, cursor) and drop its Iceberg table (unless not
    ``drop_iceberg``); the next snapshot redoes it."""
    objects = ObjectStore(config.staging)
    legacy = legacy_table_location(table_key) if store.on_legacy_staging(table_key) else None
    with store.conn.transaction():
        paths = store.delete_log_entries_before(table_key, 2**62)
        for statement in (
            "DELETE FROM _pg2iceberg.tables WHERE table_name = %s",
            "DELETE FROM _pg2iceberg.log_seq WHERE table_name = %s",
            "DELETE FROM _pg2iceberg.mat_cursor WHERE table_name = %s",
        ):
            store.conn.execute(statement, (table_key,))
    for path in paths:
        objects.delete(path)
    flushed = store.flushed_lsn() or 0
    for folder in (table_location(table_key), legacy):
        if folder is not None:
            _delete_unregistered(objects, folder, set(), flushed)
    if drop_iceberg:
        with contextlib.suppress(NoSuchTableError):
            catalog.drop_table(table_identifier(config, table_key))


def remove_tables(
    config: PipelineConfig, store: CoordinationStore, catalog: Catalog, tables: list[TableConfig], drop_iceberg: bool
) -> None:
    """Stop mirroring ``tables``: out of the publication when the pipeline owns it, state and staged
    log deleted; their Iceberg tables are dropped only with ``drop_iceberg`` (which needs them in
    ``config``: it names them)."""
    if config.replication.create_publication:
        with connect(config.source) as conn:
            published = publication_tables(conn, config.replication.publication)
            leaving = [table for table in tables if table.key in published]
            if leaving:
                conn.execute(
                    sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(
                        sql.Identifier(config.replication.publication), table_list(leaving)
                    )
                )
    for table in tables:
        reset_table(config, store, catalog, table.key, drop_iceberg=drop_iceberg)
        log.warning("no longer mirroring %s (Iceberg table %s)", table.key, "dropped" if drop_iceberg else "kept")


def reset_all(config: PipelineConfig, store: CoordinationStore, catalog: Catalog) -> CleanupResult:
    """Drop the slot, the coordination schema, the Iceberg tables and the staged files."""
    result = CleanupResult()
    for table in config.tables:
        with contextlib.suppress(NoSuchTableError):
            catalog.drop_table(table_identifier(config, table.key))
        result.tables_reset += 1
    objects = ObjectStore(config.staging)
    for key in objects.list():
        objects.delete(key)
        result.files_deleted += 1
    with connect(config.source) as conn:
        dropped = conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
            (config.replication.slot,),
        ).fetchall()
        result.slot_dropped = bool(dropped)
    store.conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    return result
