"""Column selection, masking and row filters of one table (``columns``, ``mask``, ``where``; docs/columns.md).

Selection and the row filter are applied by the server where it can (a publication column list and
row filter, PostgreSQL 15+; the snapshot's and ``verify``'s reads select only those columns and rows).
Masks are applied by the client, to a value's PostgreSQL text form, before anything is staged or
written: the snapshot, the flusher and ``verify`` all call :meth:`ColumnMask.text` or
:meth:`ColumnMask.texts`, so a masked value is the same whichever path wrote it (and a ``hash`` joins).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg
import pyarrow as pa

from ..config import MaskPolicy, TableConfig, secret_from_env
from ..errors import ConfigError, StartupCheckError

# The text a ``redact`` mask writes in place of every non-NULL value.
REDACTED = "[redacted]"
# Publication column lists and row filters exist from PostgreSQL 15 on.
MIN_SERVER_FILTER_VERSION = 150000


@dataclass(frozen=True)
class ColumnMask:
    """How one column's values are masked. ``hash``: the hex HMAC-SHA256 of the value's text under the
    secret key (the same value gives the same hash everywhere, so joins on it still work); ``null``:
    NULL; ``redact``: :data:`REDACTED`. NULL stays NULL under every policy."""

    policy: MaskPolicy
    secret: bytes = field(default=b"", repr=False, compare=False)

    def text(self, value: str | None) -> str | None:
        """The masked form of one value's text (None: NULL)."""
        if value is None or self.policy == "null":
            return None
        if self.policy == "redact":
            return REDACTED
        return hmac.new(self.secret, value.encode(), hashlib.sha256).hexdigest()

    def texts(self, values: pa.Array | pa.ChunkedArray) -> pa.Array:
        """The masked form of an array of text values."""
        return pa.array([self.text(value) for value in values.to_pylist()], pa.string())


@dataclass(frozen=True)
class PublishedPolicy:
    """What a publication sends of one table: its column list (None: every column) and row filter as
    the server prints it (None: every row)."""

    columns: frozenset[str] | None
    row_filter: str | None


def published_policies(conn: psycopg.Connection, publication: str) -> dict[str, PublishedPolicy]:
    """Column list and row filter of each table listed in the publication (PostgreSQL 15+)."""
    rows = conn.execute(
        """
        SELECT n.nspname || '.' || c.relname,
               CASE WHEN r.prattrs IS NOT NULL THEN ARRAY(
                   SELECT a.attname FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = r.prrelid AND a.attnum = ANY(r.prattrs::int2[])) END,
               pg_catalog.pg_get_expr(r.prqual, r.prrelid)
        FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid
        JOIN pg_catalog.pg_class c ON c.oid = r.prrelid JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE p.pubname = %s
        """,
        (publication,),
    ).fetchall()
    return {key: PublishedPolicy(None if names is None else frozenset(names), text) for key, names, text in rows}


def table_masks(table: TableConfig) -> tuple[tuple[str, ColumnMask], ...]:
    """Each masked column with its mask, the ``hash`` key read from ``mask_key_env`` now."""
    if not table.mask:
        return ()
    secret = b""
    if "hash" in table.mask.values():
        try:
            value = secret_from_env(table.mask_key_env, f"{table.key}: mask_key_env")
        except ConfigError as exc:
            raise ConfigError(f"{exc}: export it (the secret key of the hash masks) before starting") from None
        secret = (value or "").encode()
        if not secret:
            raise ConfigError(f"{table.key}: mask_key_env: environment variable {table.mask_key_env} is empty")
    return tuple((name, ColumnMask(policy, secret)) for name, policy in sorted(table.mask.items()))


def selected_columns(
    table: TableConfig,
    names: Sequence[str],
    key: Sequence[str],
    identity: Sequence[str],
    replica_identity: str,
    published: frozenset[str] | None = None,
) -> tuple[list[str], list[str]]:
    """(mirrored, left out) column names of the table's ``names``, by its ``columns`` entry. Under an
    ``exclude`` list, a column the publication's column list does not send (``published``: added to the
    table since it joined) is left out too: it was never streamed, so it is never written.

    Refuses a name the table does not have (a typo, or a column renamed or dropped since: a renamed
    excluded column would otherwise be mirrored) and leaving out a key or replica identity column
    (deletes carry only those; a publication column list must hold them)."""
    masked_unknown = [name for name in table.mask if name not in names]
    if masked_unknown:
        raise StartupCheckError(
            f"{table.key}: mask names {', '.join(masked_unknown)}, which the table does not have (renamed or "
            "dropped?): write the column's name as it is now in the config's mask"
        )
    masked_key = [name for name in key if name in table.mask]
    if masked_key:
        raise StartupCheckError(
            f"{table.key}: mask names the primary key column(s) {', '.join(masked_key)}: deletes and key changes "
            "carry them unmasked, so they could not be matched; remove them from mask (exclude other columns)"
        )
    if table.columns is None:
        return list(names), []
    listed = table.columns.include if table.columns.include is not None else table.columns.exclude or []
    unknown = [name for name in listed if name not in names]
    which = "include" if table.columns.include is not None else "exclude"
    if unknown:
        raise StartupCheckError(
            f"{table.key}: columns.{which} names {', '.join(unknown)}, which the table does not have (renamed or "
            f"dropped?): write the column's name as it is now in columns.{which}, or remove it"
        )
    if table.columns.include is not None:
        kept = [name for name in names if name in table.columns.include]
    else:
        kept = [name for name in names if name not in listed and (published is None or name in published)]
    left_out = [name for name in names if name not in kept]
    if left_out and replica_identity == "f":
        raise StartupCheckError(
            f"{table.key}: REPLICA IDENTITY FULL sends every column with updates and deletes, so a publication "
            f"cannot leave out {', '.join(left_out)}; run ALTER TABLE {table.name} REPLICA IDENTITY DEFAULT, "
            f"or mirror every column"
        )
    needed = [name for name in [*key, *identity] if name in left_out]
    if needed:
        raise StartupCheckError(
            f"{table.key}: columns.{which} leaves out {', '.join(dict.fromkeys(needed))}, a primary key or "
            "replica identity column, which deletes and key changes carry: keep it in the mirror"
        )
    return kept, left_out
