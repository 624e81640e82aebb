"""The leaf partitions of a partitioned source table, and the changes to them no WAL change carries.

A partitioned parent is mirrored as one Iceberg table: the publication sends its leaves' changes as
the parent's (``publish_via_partition_root``), and the snapshot reads every leaf. Rows also join and
leave the parent with no WAL change: ``ATTACH PARTITION`` of a table holding rows, ``DETACH`` or
``DROP`` of a leaf, ``TRUNCATE`` of a leaf alone (pgoutput sends none for a leaf when it publishes
through the root), a rewrite of a leaf. The mirror records the leaves it has read (oid -> relfilenode,
in an Iceberg table property) and compares them with the catalog before each merge: any such change
it sees resyncs the table. A leaf that joins and leaves again between two merges is in neither, and
is not seen (docs/correctness.md, "Not detected"; verify and the checks show it). A leaf created
empty (``CREATE TABLE ... PARTITION OF``), or attached with no row older than its attachment,
only changes the record: its rows all came through the WAL.

The catalog is read with plain SQL over ``pg_inherits`` and ``pg_class`` (not pg_partition_tree),
so that inside a transaction on an imported snapshot the leaves are the ones that snapshot sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..errors import Pg2IcebergError

# The relations under a table that hold its rows: its leaf partitions at every level, or the table
# itself when it is not partitioned (pg_partition_tree, by contrast, lists nothing for such a table).
_ROW_HOLDERS = """
WITH RECURSIVE tree(relid, relkind) AS (
    SELECT c.oid, c.relkind FROM pg_catalog.pg_class c WHERE c.oid = %(oid)s
    UNION ALL
    SELECT c.oid, c.relkind FROM tree t
    JOIN pg_catalog.pg_inherits i ON i.inhparent = t.relid JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
    WHERE t.relkind = 'p'
)
"""

_LEAVES = (
    _ROW_HOLDERS
    + """
SELECT c.oid, n.nspname, c.relname, c.relfilenode, c.relkind, c.relpersistence
FROM tree t JOIN pg_catalog.pg_class c ON c.oid = t.relid JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE t.relkind <> 'p' AND t.relid <> %(oid)s
ORDER BY n.nspname, c.relname
"""
)

# Whether a leaf holds a row older than the youngest attachment on its path to the root (a frozen
# row reads as xid 2, the oldest there is): such a row joined the parent with no WAL change.
_ROWS_OLDER_THAN_ATTACHMENT = """
WITH RECURSIVE path(relid, parent, attached_age) AS (
    SELECT inhrelid, inhparent, age(xmin) FROM pg_catalog.pg_inherits WHERE inhrelid = %(leaf)s
    UNION ALL
    SELECT i.inhrelid, i.inhparent, least(p.attached_age, age(i.xmin))
    FROM pg_catalog.pg_inherits i JOIN path p ON i.inhrelid = p.parent
)
SELECT EXISTS (SELECT 1 FROM {leaf} WHERE age(xmin) >= (SELECT min(attached_age) FROM path))
"""


@dataclass(frozen=True)
class Leaf:
    """A leaf partition: a table holding rows of the partitioned parent."""

    oid: int
    schema_name: str
    table_name: str
    file_node: int

    @property
    def qualified(self) -> str:
        return f"{self.schema_name}.{self.table_name}"


def row_holders(conn: psycopg.Connection, oid: int) -> list[int]:
    """The oids of the relations holding the table's rows: a partitioned table's leaves, or the table."""
    return [
        relid for (relid,) in conn.execute(_ROW_HOLDERS + "SELECT relid FROM tree WHERE relkind <> 'p'", {"oid": oid})
    ]


def leaves(conn: psycopg.Connection, oid: int) -> list[Leaf]:
    """The leaf partitions under ``oid`` at every level, by name; empty for a table that is no parent.
    A foreign-table or UNLOGGED leaf is refused: logical replication sends none of its changes."""
    found = []
    for leaf_oid, schema_name, table_name, file_node, relkind, persistence in conn.execute(_LEAVES, {"oid": oid}):
        if relkind != "r":
            raise Pg2IcebergError(
                f"partition {schema_name}.{table_name} is not an ordinary table (relkind {relkind!r}): logical "
                "replication does not send its changes"
            )
        if persistence == "u":
            name = sql.Identifier(schema_name, table_name).as_string(conn)
            raise Pg2IcebergError(
                f"partition {schema_name}.{table_name} is UNLOGGED: logical replication does not send its changes "
                f"(ALTER TABLE {name} SET LOGGED)"
            )
        found.append(Leaf(leaf_oid, schema_name, table_name, file_node))
    return found


def leaf_files(found: list[Leaf]) -> dict[int, int]:
    """What the mirror records of the leaves it read: oid -> relfilenode."""
    return {leaf.oid: leaf.file_node for leaf in found}


@dataclass(frozen=True)
class LeafChange:
    """How the leaves now differ from those the mirror recorded: ``reason`` a change no WAL change
    carries (the table must be resynced), else None; ``now`` the leaves to record."""

    reason: str | None
    now: dict[int, int]


def partitioned_oid(conn: psycopg.Connection, schema_name: str, table_name: str) -> int | None:
    """The oid of the table when it is a partitioned table, else None."""
    row = conn.execute(
        "SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND c.relkind = 'p'",
        (schema_name, table_name),
    ).fetchone()
    return int(row[0]) if row else None


def leaf_change(conn: psycopg.Connection, current: list[Leaf], recorded: dict[int, int]) -> LeafChange:
    """Compare the ``current`` leaves with the ``recorded`` ones (see the module's docstring)."""
    now = leaf_files(current)
    gone = sorted(set(recorded) - set(now))
    if gone:
        return LeafChange(
            f"{len(gone)} partition(s) were detached or dropped (oids {gone}): their rows left with no WAL change", now
        )
    rewritten = [leaf.qualified for leaf in current if leaf.oid in recorded and recorded[leaf.oid] != leaf.file_node]
    if rewritten:
        return LeafChange(
            f"partition(s) {', '.join(rewritten)} were truncated or rewritten (a TRUNCATE of a partition alone, "
            "VACUUM FULL, ALTER COLUMN ... TYPE), which changes rows with no WAL change",
            now,
        )
    for leaf in current:
        if leaf.oid in recorded:
            continue
        query = sql.SQL(_ROWS_OLDER_THAN_ATTACHMENT).format(leaf=sql.Identifier(leaf.schema_name, leaf.table_name))
        row = conn.execute(query, {"leaf": leaf.oid}).fetchone()
        if row is not None and row[0]:
            return LeafChange(
                f"partition {leaf.qualified} was attached holding rows, which came with no WAL change", now
            )
    return LeafChange(None, now)
