"""A publication's column lists and row filters (PostgreSQL 15+), from each table's ``columns`` and ``where``.

The server filters, so excluded columns and filtered-out rows never leave it. Before the publication
is created or changed, the entries are tried in a transaction that is rolled back: a predicate the
server refuses as a row filter (a subquery, a volatile function, an unknown column), and a filter or
column list an UPDATE or DELETE of the table would then fail on (PostgreSQL checks the replica
identity when the source writes, so the application's own UPDATEs would fail), are refused before
anything is written, with the server's reason. The same try gives the server's own text of each
filter, which is what an existing publication is compared with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import psycopg
from psycopg import sql

from ..errors import StartupCheckError
from .catalog import SourceTable, publication_tables
from .policy import MIN_SERVER_FILTER_VERSION, PublishedPolicy, published_policies

_TRIAL_PUBLICATION = "pg2iceberg_filter_trial"
# Stands for a row filter the server was not asked about (see try_entries).
UNTRIED = "<not tried>"
log = logging.getLogger(__name__)


def server_filters(table: SourceTable) -> bool:
    """Whether the table's publication entry carries a column list or a row filter."""
    return bool(table.column_selection or table.row_filter)


def listed_attnums(table: SourceTable, version: int) -> frozenset[int] | None:
    """The attnums of the columns the publication's column list sends of ``table`` (None: every
    column). The list is the columns mirrored at start (an ``exclude`` list's columns added since are
    not in it), and PostgreSQL refuses to drop a listed column, so it holds while the pipeline runs."""
    if version < MIN_SERVER_FILTER_VERSION or not table.column_selection:
        return None
    return frozenset(column.attnum for column in table.columns if column.attnum is not None)


def refuse_unfilterable(tables: Sequence[SourceTable], version: int) -> None:
    """A row filter needs PostgreSQL 15+: below it the client cannot evaluate the user's SQL."""
    filtered = [table.key for table in tables if table.row_filter]
    if filtered and version < MIN_SERVER_FILTER_VERSION:
        raise StartupCheckError(
            f"{', '.join(filtered)}: where (a row filter) needs PostgreSQL 15 or newer, which filters the rows "
            f"it publishes; the source is {version // 10000}: remove where from these tables or upgrade the source"
        )


def table_entries(tables: Iterable[SourceTable], version: int) -> sql.Composed:
    """The tables of a ``CREATE PUBLICATION ... FOR TABLE`` or ``ADD TABLE``, each with its column list
    and row filter (from PostgreSQL 15 on; below, the names alone and the flusher drops the columns)."""
    entries: list[sql.Composable] = []
    for table in tables:
        entry: sql.Composable = sql.Identifier(table.schema_name, table.table_name)
        if version >= MIN_SERVER_FILTER_VERSION and table.column_selection:
            names = sql.SQL(", ").join(sql.Identifier(column.name) for column in table.columns)
            entry = sql.SQL("{} ({})").format(entry, names)
        if version >= MIN_SERVER_FILTER_VERSION and table.row_filter:
            entry = sql.SQL("{} WHERE {}").format(entry, table.row_filter_sql())
        entries.append(entry)
    return sql.SQL(", ").join(entries)


def try_entries(conn: psycopg.Connection, tables: Sequence[SourceTable]) -> dict[str, PublishedPolicy]:
    """Each filtered table's entry as the server takes it, tried in a publication of its own that is
    rolled back; raises StartupCheckError with the server's reason when it refuses one."""
    tried: dict[str, PublishedPolicy] = {}
    for table in tables:
        if not server_filters(table) or conn.info.server_version < MIN_SERVER_FILTER_VERSION:
            continue
        try:
            with conn.transaction(force_rollback=True):
                conn.execute(
                    sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish_via_partition_root = true)").format(
                        sql.Identifier(_TRIAL_PUBLICATION), table_entries([table], conn.info.server_version)
                    )
                )
                _refuse_failing_writes(conn, table)
                tried[table.key] = published_policies(conn, _TRIAL_PUBLICATION)[table.key]
        except psycopg.errors.InsufficientPrivilege:
            # Not the table's owner (nor allowed to plan an UPDATE): a publication made by its owner is
            # taken as it is, its filter compared by presence only (the server took it already).
            log.warning("%s: not the owner, so its row filter and column list are not tried", table.key)
            columns = frozenset(column.name for column in table.columns) if table.column_selection else None
            tried[table.key] = PublishedPolicy(columns, UNTRIED if table.row_filter else None)
        except psycopg.Error as exc:
            raise StartupCheckError(_refusal(table, exc)) from None
    return tried


def _refuse_failing_writes(conn: psycopg.Connection, table: SourceTable) -> None:
    """Plans an UPDATE and a DELETE of the table (EXPLAIN runs neither, and fires no trigger): with the
    publication in place the server checks its filter and column list against the replica identity
    then, as it would at every write of the application."""
    name = sql.Identifier(table.schema_name, table.table_name)
    key = sql.Identifier(table.primary_key[0])
    conn.execute(sql.SQL("EXPLAIN UPDATE {} SET {} = {}").format(name, key, key))
    conn.execute(sql.SQL("EXPLAIN DELETE FROM {}").format(name))


def _refusal(table: SourceTable, exc: psycopg.Error) -> str:
    """Why the server refused a table's entry, and what to do."""
    reason = exc.diag.message_primary or str(exc).splitlines()[0]
    detail = f" ({exc.diag.message_detail})" if exc.diag.message_detail else ""
    advice = "fix where or columns in the config"
    if "replica identity" in (reason + detail).lower():
        advice += (
            f", or make the replica identity carry the filter's columns (ALTER TABLE {table.schema_name}."
            f"{table.table_name} REPLICA IDENTITY USING INDEX <a unique index on them and the key>)"
        )
    what = f"row filter {table.row_filter!r}" if table.row_filter else "column list"
    return (
        f"{table.key}: the source refuses its publication entry ({what}"
        + (f", columns {', '.join(c.name for c in table.columns)}" if table.column_selection else "")
        + f"): {reason}{detail}; {advice}"
    )


def differing(
    tables: Sequence[SourceTable], wanted: dict[str, PublishedPolicy], published: dict[str, PublishedPolicy]
) -> list[str]:
    """The keys of ``tables`` the publication lists with another column list or row filter than their
    config asks for (``wanted``, from :func:`try_entries`; absent: no list, no filter)."""
    unfiltered = PublishedPolicy(None, None)

    def same(now: PublishedPolicy, asked: PublishedPolicy) -> bool:
        if asked.row_filter == UNTRIED:
            return now.columns == asked.columns and now.row_filter is not None
        return now == asked

    return [
        table.key
        for table in tables
        if table.key in published and not same(published[table.key], wanted.get(table.key, unfiltered))
    ]


def reconcile(
    conn: psycopg.Connection,
    publication: str,
    tables: Sequence[SourceTable],
    wanted: dict[str, PublishedPolicy],
    mirrored: frozenset[str],
    owned: bool,
) -> None:
    """The existing publication sends each table as its config asks (PostgreSQL 15+). A table it sends
    otherwise is entered again when the pipeline owns the publication and has not mirrored the table
    yet (its snapshot comes after); else refused: its mirror holds rows or columns of the other entry."""
    if conn.info.server_version < MIN_SERVER_FILTER_VERSION:
        return
    listed = published_policies(conn, publication)
    whole = [table.key for table in tables if server_filters(table) and table.key not in listed]
    if whole and (covered := set(whole) & publication_tables(conn, publication)):
        raise StartupCheckError(
            f"publication {publication} covers {', '.join(sorted(covered))} through FOR ALL TABLES or FOR TABLES IN "
            "SCHEMA, which send every column and row and take no column list or row filter; name another "
            "publication in replication.publication (the pipeline creates it FOR TABLE with the filters)"
        )
    changed = differing(tables, wanted, listed)
    refused = [key for key in changed if key in mirrored or not owned]
    if refused:
        names = ", ".join(refused)
        raise StartupCheckError(
            f"publication {publication} sends {names} with another column list or row filter than the config "
            f"says (columns, where), so the mirror does not hold what the config asks for. Run ALTER PUBLICATION "
            f"{publication} DROP TABLE {names}, then `pg2iceberg-dagster cleanup "
            + " ".join(f"--table {key}" for key in refused)
            + "` and snapshot again (the pipeline adds them back as configured); or restore the config"
        )
    if changed:
        entered = [table for table in tables if table.key in changed]
        with conn.transaction():
            listed_names = sql.SQL(", ").join(sql.Identifier(t.schema_name, t.table_name) for t in entered)
            conn.execute(
                sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(sql.Identifier(publication), listed_names)
            )
            conn.execute(
                sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                    sql.Identifier(publication), table_entries(entered, conn.info.server_version)
                )
            )


def describe_policy(table: SourceTable, version: int) -> list[str]:
    """What ``validate`` says of a table's column selection, masks and row filter, and who applies them:
    the server (nothing it filters leaves it) or the client (the values leave the server)."""
    server = version >= MIN_SERVER_FILTER_VERSION
    lines = []
    if table.column_selection:
        where = (
            "by the server (the publication's column list): their values never leave it"
            if server
            else f"by the client (PostgreSQL {version // 10000} has no publication column lists): their values "
            "reach the flusher, which drops them before staging"
        )
        left_out = ", ".join(table.excluded) or "none now; a column added later is never written"
        lines.append(f"columns: {len(table.columns)} mirrored, left out {where}: {left_out}")
    if table.masks:
        masks = ", ".join(f"{name} ({mask.policy})" for name, mask in table.masks)
        lines.append(f"masked by the client before anything is staged (the raw values leave the server): {masks}")
    if table.row_filter:
        lines.append(f"rows: only where {table.row_filter}, filtered by the server (the publication's row filter)")
    return lines
