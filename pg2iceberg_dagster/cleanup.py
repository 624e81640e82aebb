"""Housekeeping: drop staged files every group has applied, orphans of failed registrations, or the
whole state of one table (to snapshot it again) or of the pipeline."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from psycopg import sql
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError

from .config import PipelineConfig
from .coordination.migrations import SCHEMA
from .coordination.store import CoordinationStore
from .source.catalog import published_names
from .source.connection import connect
from .staging.store import ObjectStore, legacy_table_location, staged_file_lsn
from .tables import MirroredTable

log = logging.getLogger(__name__)


@dataclass
class CleanupResult:
    files_deleted: int = 0
    tables_reset: int = 0
    slot_dropped: bool = False


def collect_garbage(tables: Iterable[MirroredTable], store: CoordinationStore, objects: ObjectStore) -> CleanupResult:
    """Delete applied staged files and unregistered uploads at or below the flushed LSN."""
    result = CleanupResult()
    flushed = store.flushed_lsn() or 0
    for table in tables:
        result.files_deleted += collect_table_garbage(store, objects, table, flushed)
    return result


def collect_table_garbage(store: CoordinationStore, objects: ObjectStore, table: MirroredTable, flushed: int) -> int:
    """Delete the table's staged files every group has applied, and its uploads no registration
    names at or below ``flushed`` (the flushed LSN); returns how many files. Only the table's own
    folder is listed, never another table's (see :func:`~.staging.store.table_location`); the folder
    of the first staging layout is swept too, once."""
    key = table.key
    deleted = 0
    for path in store.delete_log_entries_before(key, store.min_mat_cursor(key)):
        objects.delete(path)
        deleted += 1
    registered = {entry.path for entry in store.log_entries(key, -1)}
    on_legacy = store.on_legacy_staging(key)
    for folder in _staging_folders(table, on_legacy):
        deleted += _delete_unregistered(objects, folder, registered, flushed)
    if on_legacy:
        store.record_legacy_staging_swept(key)
    return deleted


def _staging_folders(table: MirroredTable, on_legacy: bool) -> list[str]:
    """The folders the table's staged files may be in: its own, and the first layout's folder until
    that was swept once (``on_legacy``; a legacy name that is not a safe folder is left alone)."""
    legacy = legacy_table_location(table.key) if on_legacy else None
    return [table.staging] if legacy is None else [table.staging, legacy]


def _delete_unregistered(objects: ObjectStore, folder: str, registered: set[str], flushed: int) -> int:
    """Delete the staged files directly in ``folder`` that no registration names, at or below ``flushed``."""
    deleted = 0
    for key in objects.files_in(folder):
        lsn = staged_file_lsn(key)
        # A file named above flushed_lsn (its last commit, see staged_file_key) may belong to a flush
        # that is registering right now.
        if key not in registered and lsn is not None and lsn <= flushed:
            objects.delete(key)
            deleted += 1
    return deleted


def reset_table(
    table: MirroredTable, store: CoordinationStore, objects: ObjectStore, catalog: Catalog, drop_iceberg: bool = True
) -> None:
    """Forget a table (state, staged log, cursor) and drop its Iceberg table (unless not
    ``drop_iceberg``); the next snapshot redoes it."""
    table_key = table.key
    folders = _staging_folders(table, store.on_legacy_staging(table_key))
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
    for folder in folders:
        _delete_unregistered(objects, folder, set(), flushed)
    if drop_iceberg:
        _drop_iceberg_tables(catalog, table)


def remove_tables(
    config: PipelineConfig,
    store: CoordinationStore,
    objects: ObjectStore,
    catalog: Catalog,
    tables: list[MirroredTable],
    drop_iceberg: bool,
) -> None:
    """Stop mirroring ``tables``: out of the publication when the pipeline owns it, state and staged
    log deleted; their Iceberg tables are dropped only with ``drop_iceberg``."""
    if config.replication.create_publication:
        with connect(config.source) as conn:
            # Named as the publication holds them: a removed table's entry may come from its key alone.
            published = published_names(conn, config.replication.publication)
            leaving = [sql.Identifier(*published[table.key]) for table in tables if table.key in published]
            if leaving:
                conn.execute(
                    sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(
                        sql.Identifier(config.replication.publication), sql.SQL(", ").join(leaving)
                    )
                )
    for table in tables:
        reset_table(table, store, objects, catalog, drop_iceberg=drop_iceberg)
        log.warning("no longer mirroring %s (Iceberg table %s)", table.key, "dropped" if drop_iceberg else "kept")


def reset_all(
    config: PipelineConfig,
    tables: Iterable[MirroredTable],
    store: CoordinationStore,
    objects: ObjectStore,
    catalog: Catalog,
) -> CleanupResult:
    """Drop the slot, the coordination schema, the Iceberg tables and the staged files."""
    result = CleanupResult()
    for table in tables:
        _drop_iceberg_tables(catalog, table)
        result.tables_reset += 1
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


def _drop_iceberg_tables(catalog: Catalog, table: MirroredTable) -> None:
    """Drop the table's Iceberg table and its history table (docs/history.md), those that exist. A
    history table outliving its mirror's state would be taken for the history of a new copy."""
    for identifier in (table.iceberg, table.history):
        if identifier is not None:
            with contextlib.suppress(NoSuchTableError):
                catalog.drop_table(identifier)
