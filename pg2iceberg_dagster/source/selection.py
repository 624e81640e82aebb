"""The tables a schema entry of ``tables`` selects, read from the source's catalog.

A schema entry (``{schema: app, include: [...], exclude: [...]}``) stands for every ordinary and
partitioned table of the schema (a partition is mirrored through its parent) whose name matches an
``include`` glob and no ``exclude`` glob. CREATE TABLE has no WAL change, so the catalog is read
again: by every command at its start, and by ``run`` every few seconds (``lifecycle.ConfigWatch``).
A selected table that validate would refuse (no primary key, UNLOGGED, not readable by the role, a
replica identity without the key, a key Iceberg cannot take) is left out with a warning: one such
table must not stop a whole schema (name a keyless one in ``tables`` with a ``primary_key`` to
mirror it). So are the pipeline's own tables (the coordination schema, an Iceberg SQL catalog's
tables), which validate refuses when named in ``tables``.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence

import psycopg

from ..config import PipelineConfig, SchemaSelection
from .catalog import PIPELINE_OWN_REASON, ROW_SECURITY_APPLIES
from .connection import connect

log = logging.getLogger(__name__)


def selected_tables(
    conn: psycopg.Connection, selections: Sequence[SchemaSelection]
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(schema, table) of every table the ``selections`` select, by name, and the keys of those left
    out, each with the reason."""
    rows = conn.execute(
        f"""
        SELECT n.nspname, c.relname,
               EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
               c.relpersistence = 'u',
               -- every row readable: SELECT, and no row-level security applying to the role
               has_table_privilege(c.oid, 'SELECT') AND NOT {ROW_SECURITY_APPLIES},
               -- deletes would not carry the key: REPLICA IDENTITY NOTHING, or USING INDEX without it
               c.relreplident = 'n' OR (c.relreplident = 'i' AND NOT EXISTS (
                   SELECT 1 FROM pg_catalog.pg_index r JOIN pg_catalog.pg_index k ON k.indrelid = r.indrelid
                   WHERE r.indrelid = c.oid AND r.indisreplident AND k.indisprimary
                     AND (k.indkey::int2[]) <@ (r.indkey::int2[])[0:r.indnkeyatts - 1])),
               -- a key column Iceberg cannot take as an identifier field (float, double, array)
               EXISTS (
                   SELECT 1 FROM pg_catalog.pg_index i
                   JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
                   JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
                   WHERE i.indrelid = c.oid AND i.indisprimary AND (t.typcategory = 'A'
                     OR coalesce(nullif(t.typbasetype, 0), t.oid) IN ('float4'::regtype, 'float8'::regtype))),
               {PIPELINE_OWN_REASON}
        FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = ANY(%s) AND c.relkind IN ('r', 'p') AND NOT c.relispartition
        ORDER BY 1, 2
        """,
        ([selection.schema_name for selection in selections],),
    ).fetchall()
    found: list[tuple[str, str]] = []
    left_out: dict[str, str] = {}
    for schema_name, table_name, has_key, unlogged, readable, identity_lacks_key, key_not_identifier, own in rows:
        for selection in selections:
            if selection.schema_name != schema_name:
                continue
            included = any(fnmatch.fnmatchcase(table_name, pattern) for pattern in selection.include)
            if included and not any(fnmatch.fnmatchcase(table_name, pattern) for pattern in selection.exclude):
                reason = own or _left_out_because(has_key, unlogged, readable, identity_lacks_key, key_not_identifier)
                if reason:
                    left_out[f"{schema_name}.{table_name}"] = reason
                else:
                    found.append((schema_name, table_name))
                break
    return found, left_out


def _left_out_because(
    has_key: bool, unlogged: bool, readable: bool, identity_lacks_key: bool, key_not_identifier: bool
) -> str | None:
    """Why a selected table is left out (what validate would refuse it for), or None."""
    if unlogged:
        return "UNLOGGED: logical replication carries none of its changes"
    if not has_key:
        return "no primary key: name it in tables with a primary_key"
    if not readable:
        return "the role may not read all of it: GRANT SELECT (and BYPASSRLS where row-level security applies)"
    if identity_lacks_key:
        return "its REPLICA IDENTITY does not carry the primary key: ALTER TABLE ... REPLICA IDENTITY DEFAULT"
    if key_not_identifier:
        return "a primary key column is float, double or an array, which Iceberg cannot take as a key"
    return None


def resolve_tables(config: PipelineConfig, warn: bool = True) -> PipelineConfig:
    """``config`` with the tables its schema entries select now added to ``tables`` (a table also
    named in ``tables`` keeps that entry); unchanged without schema entries."""
    return resolve_tables_left_out(config, warn)[0]


def resolve_tables_left_out(config: PipelineConfig, warn: bool = True) -> tuple[PipelineConfig, dict[str, str]]:
    """:func:`resolve_tables`, and the keys of the tables its schema entries leave out, each with why."""
    if not config.schemas:
        return config, {}
    with connect(config.source) as conn:
        found, left_out = selected_tables(conn, config.schemas)
    if left_out and warn:
        log.warning("left out: %s", "; ".join(f"{key} ({reason})" for key, reason in left_out.items()))
    return config.with_selected_tables(found), left_out
