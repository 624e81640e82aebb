"""An independent end check of a table with excluded and masked columns, a row filter and soft deletes.

``verify`` compares such a table through the pipeline's own projection, masks and filter; this check
computes the expectation itself, from the source and what the caller knows of the table: the live
Iceberg rows (``_pg_deleted_at`` NULL, or every row without soft deletes) are exactly the source's rows
that pass the filter, projected on the mirrored columns, each masked column as docs/columns.md
specifies it (``hash``: the HMAC-SHA256 of the source value's text under the key, computed here);
every soft-deleted key is gone from the filtered source; a key is one row; and the Iceberg schema is
the mirrored columns and the change metadata columns, never a left-out one. Used by the soak's end
check, its history samples (soak/history_check.py) and tests/test_combined_features.py.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

# Default change metadata and deletion column names (docs/change_metadata.md).
METADATA_COLUMNS = ("_pg_lsn", "_pg_committed_at", "_pg_merged_at")
DELETED_AT, DELETED_LSN = "_pg_deleted_at", "_pg_deleted_lsn"
# What a ``redact`` mask writes (docs/columns.md).
REDACTED_TEXT = "[redacted]"
EXAMPLES = 5


@dataclass(frozen=True)
class Policy:
    """What the mirror of one table must hold: the columns by their current names (the key first), the
    columns it must not hold, and the table's config entry options (mask, where, deletes,
    change_metadata)."""

    schema: str
    name: str
    key: list[str]
    mirrored: list[str]
    left_out: set[str]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def qualified(self) -> str:
        """``schema.name``."""
        return f"{self.schema}.{self.name}"

    @property
    def soft(self) -> bool:
        """Whether deleted rows stay, marked (``deletes: soft``)."""
        return bool(self.options.get("deletes") == "soft")

    def schema_columns(self) -> set[str]:
        """The Iceberg table's columns: the mirrored ones, and the metadata and deletion columns."""
        extra = [*METADATA_COLUMNS] if self.options.get("change_metadata") else []
        return {*self.mirrored, *extra, *([DELETED_AT, DELETED_LSN] if self.soft else [])}

    def masked(self, name: str, value: Any, secret: bytes) -> Any:
        """``value`` of column ``name`` as its mask gives it."""
        policy = self.options.get("mask", {}).get(name)
        if policy is None or value is None:
            return value
        if policy == "hash":
            return hmac.new(secret, str(value).encode(), hashlib.sha256).hexdigest()
        return REDACTED_TEXT if policy == "redact" else None


def expected_rows(conninfo: str, policy: Policy, secret: bytes) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """The source's rows that pass the filter, by key: mirrored columns only, masks applied here."""
    query = sql.SQL("SELECT {} FROM {} WHERE {}").format(
        sql.SQL(", ").join(sql.Identifier(name) for name in policy.mirrored),
        sql.Identifier(policy.schema, policy.name),
        sql.SQL(policy.options.get("where", "true")),
    )
    with psycopg.connect(conninfo) as conn:
        rows = conn.execute(query).fetchall()
    width = len(policy.key)
    expected = {}
    for row in rows:
        pairs = zip(policy.mirrored, row, strict=True)
        expected[row[:width]] = tuple(policy.masked(name, value, secret) for name, value in pairs)
    return expected


def policy_divergences(conninfo: str, policy: Policy, iceberg: Any, secret: bytes) -> list[dict[str, Any]]:
    """How the Iceberg table ``iceberg`` differs from what ``policy`` asks of the source's rows (empty:
    exact)."""
    found: list[dict[str, Any]] = []
    schema = iceberg.schema().column_names
    if set(schema) != policy.schema_columns() or policy.left_out & set(schema):
        return [{"table": policy.qualified, "schema": schema, "expected_schema": sorted(policy.schema_columns())}]
    width = len(policy.key)
    live: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    deleted: set[tuple[Any, ...]] = set()
    rows = iceberg.scan().to_arrow().to_pylist()
    for row in rows:
        values = tuple(row[name] for name in policy.mirrored)
        if policy.soft and row[DELETED_AT] is not None:
            deleted.add(values[:width])
            if row[DELETED_LSN] is None:
                found.append({"table": policy.qualified, "soft_deleted_without_lsn": str(values[:width])})
        else:
            live[values[:width]] = values
    if len(rows) != len(live) + len(deleted) or live.keys() & deleted:
        found.append({"table": policy.qualified, "duplicate_keys": len(rows) - len(set(live) | deleted)})
    expected = expected_rows(conninfo, policy, secret)
    only_source = sorted(set(expected) - set(live))
    only_iceberg = sorted(set(live) - set(expected))
    different = sorted(key for key in set(live) & set(expected) if live[key] != expected[key])
    deleted_but_live = sorted(deleted & set(expected))
    if only_source or only_iceberg or different or deleted_but_live:
        found.append(
            {
                "table": policy.qualified,
                "check": "policy",
                "only_in_source": len(only_source),
                "only_in_iceberg": len(only_iceberg),
                "differences": len(different),
                "soft_deleted_but_live_at_source": len(deleted_but_live),
                "examples": [str(key) for key in (only_source + only_iceberg + different)[:EXAMPLES]],
                "columns_differing": sorted(
                    {
                        name
                        for key in different
                        for name, ours, theirs in zip(policy.mirrored, live[key], expected[key], strict=True)
                        if ours != theirs
                    }
                ),
            }
        )
    return found
