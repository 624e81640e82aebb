"""Unchanged columns read from the source, for changes whose row the snapshot may have missed.

When the exported snapshot is lost mid-snapshot, the remaining chunks are read at later moments than
the ones already done. A row updated in between can move into a chunk that was read earlier and be
read by none: its WAL update re-creates it, but an update leaves TOASTed columns it did not touch out
of the WAL, and there is no target row to take them from. For changes in that window the columns are
read from the source row instead. The source may be newer than the change; that is safe because every
later change of the row is still ahead in the log and is applied on top.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
from psycopg import sql

from .fold import UPSERT, FoldResult


def fill_from_source(
    conn: psycopg.Connection, schema_name: str, table_name: str, folded: FoldResult, key: Sequence[str]
) -> int:
    """Give every folded upsert its unchanged columns' current source values (PostgreSQL text form).

    Returns how many rows were filled. A row no longer in the source keeps its gaps: its delete is
    still ahead in the log.
    """
    rows = [row for row in folded.rows.values() if row.op == UPSERT and row.unchanged - row.filled.keys()]
    if not rows:
        return 0
    table = sql.Identifier(schema_name, table_name)
    current = {
        name
        for (name,) in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
            (table.as_string(conn),),
        )
    }
    wanted = sorted({name for row in rows for name in row.unchanged if name in current} - set(key))
    if not wanted:
        return 0
    as_text = [sql.SQL("{}::text").format(sql.Identifier(name)) for name in (*key, *wanted)]
    key_text = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(name)) for name in key)
    query = sql.SQL("SELECT {} FROM {} WHERE ({}) IN (SELECT * FROM unnest({}))").format(
        sql.SQL(", ").join(as_text),
        table,
        key_text,
        sql.SQL(", ").join(sql.SQL("{}::text[]").format(sql.Placeholder()) for _ in key),
    )
    keys = [tuple(row.data[name] for name in key) for row in rows]
    columns = [[k[position] for k in keys] for position in range(len(key))]
    found = {tuple(values[: len(key)]): values[len(key) :] for values in conn.execute(query, columns)}
    filled = 0
    for row, row_key in zip(rows, keys, strict=True):
        values = found.get(row_key)
        if values is None:
            continue
        for name, value in zip(wanted, values, strict=True):
            if name in row.unchanged and name not in row.filled:
                row.data[name] = value
        row.unchanged = row.unchanged - set(wanted)
        filled += 1
    return filled
