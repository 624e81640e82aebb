"""The tables a schema entry of ``tables`` selects, read from the source's catalog.

A schema entry (``{schema: app, include: [...], exclude: [...]}``) stands for every ordinary and
partitioned table of the schema (a partition is mirrored through its parent) whose name matches an
``include`` glob and no ``exclude`` glob. CREATE TABLE has no WAL change, so the catalog is read
again: by every command at its start, and by ``run`` every few seconds (``lifecycle.ConfigWatch``).
A selected table without a primary key, or UNLOGGED (logical replication carries none of its
changes), is left out with a warning: one such table must not stop a whole schema (name a keyless
one in ``tables`` with a ``primary_key`` to mirror it).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence

import psycopg

from ..config import PipelineConfig, SchemaSelection, TableConfig
from .connection import connect

log = logging.getLogger(__name__)


def selected_tables(
    conn: psycopg.Connection, selections: Sequence[SchemaSelection]
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(schema, table) of every table the ``selections`` select, by name, and the keys of those left
    out, each with the reason."""
    rows = conn.execute(
        """
        SELECT n.nspname, c.relname,
               EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
               c.relpersistence = 'u'
        FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = ANY(%s) AND c.relkind IN ('r', 'p') AND NOT c.relispartition
        ORDER BY 1, 2
        """,
        ([selection.schema_name for selection in selections],),
    ).fetchall()
    found: list[tuple[str, str]] = []
    left_out: dict[str, str] = {}
    for schema_name, table_name, has_key, unlogged in rows:
        for selection in selections:
            if selection.schema_name != schema_name:
                continue
            included = any(fnmatch.fnmatchcase(table_name, pattern) for pattern in selection.include)
            if included and not any(fnmatch.fnmatchcase(table_name, pattern) for pattern in selection.exclude):
                if unlogged:
                    left_out[f"{schema_name}.{table_name}"] = (
                        "UNLOGGED: logical replication carries none of its changes"
                    )
                elif not has_key:
                    left_out[f"{schema_name}.{table_name}"] = "no primary key: name it in tables with a primary_key"
                else:
                    found.append((schema_name, table_name))
                break
    return found, left_out


def resolve_tables(config: PipelineConfig, warn: bool = True) -> PipelineConfig:
    """``config`` with the tables its schema entries select now added to ``tables`` (a table also
    named in ``tables`` keeps that entry); unchanged without schema entries."""
    if not config.schemas:
        return config
    with connect(config.source) as conn:
        found, left_out = selected_tables(conn, config.schemas)
    if left_out and warn:
        log.warning("left out: %s", "; ".join(f"{key} ({reason})" for key, reason in left_out.items()))
    named = {table.key for table in config.tables}
    added = [
        TableConfig.named(schema_name, table_name)
        for schema_name, table_name in found
        if f"{schema_name}.{table_name}" not in named
    ]
    return config.model_copy(update={"tables": [*config.tables, *added]})
