"""Introspection of the source catalog: tables, columns, resolved types, primary keys, sizes."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import psycopg
from psycopg import sql

from ..config import PostgresConnection, TableConfig
from ..coordination.migrations import SCHEMA as COORDINATION_SCHEMA
from ..errors import Pg2IcebergError, StartupCheckError
from ..iceberg.terms import quote_column
from .connection import connect
from .partitions import leaf_files, leaves, row_holders
from .policy import ColumnMask, published_policies, selected_columns, table_masks
from .xid_snapshot import imported_snapshot

TEXT_OID = 25
TEXT_ARRAY_OID = 1009


@dataclass(frozen=True)
class PgType:
    """A column type resolved through domains, with what decides its Iceberg mapping.

    ``kind`` is the base type's name (``int4``, ``numeric``, ...) or ``enum``/``composite``/``range``;
    ``loader_oid`` is the type psycopg loads the value's text form with. ``dimensions`` is what an
    array column declares (``pg_attribute.attndims``: 2 for ``int[][]``, 0 when not said); PostgreSQL
    does not enforce it, but a column declared with more than one is stored as text.
    """

    name: str
    kind: str
    type_mod: int
    base_oid: int
    array_oid: int
    element: PgType | None = None
    dimensions: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (stored in staged file metadata)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PgType:
        element = data.get("element")
        return cls(**{**data, "element": cls.from_json(element) if element else None})


@dataclass(frozen=True)
class SourceColumn:
    """A column of a source table.

    ``attnum`` is its identity (it survives a RENAME; None in files staged before it was recorded).
    ``missing`` is the text form of the value rows older than the column read
    (``pg_attribute.attmissingval``, set by ``ADD COLUMN ... DEFAULT <constant>``), else None.
    ``has_default``: the column has a default now (with no ``missing``, rows older than the column
    may hold a value no WAL change carried: a volatile default, or a table rewritten since).
    ``generated``: a ``GENERATED ALWAYS AS (...) STORED`` column (the flusher computes its values).
    """

    name: str
    type: PgType
    not_null: bool
    attnum: int | None = None
    missing: str | None = None
    has_default: bool = False
    generated: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type.to_json(),
            "not_null": self.not_null,
            "attnum": self.attnum,
            "missing": self.missing,
            "has_default": self.has_default,
            "generated": self.generated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SourceColumn:
        return cls(
            name=data["name"],
            type=PgType.from_json(data["type"]),
            not_null=data["not_null"],
            attnum=data.get("attnum"),
            missing=data.get("missing"),
            has_default=data.get("has_default", False),
            generated=data.get("generated", False),
        )


@dataclass(frozen=True)
class SourceTable:
    """A configured source table as the catalog describes it now."""

    key: str
    schema_name: str
    table_name: str
    oid: int
    columns: tuple[SourceColumn, ...]
    primary_key: tuple[str, ...]
    replica_identity: str
    partitioned: bool = False  # a partitioned parent: its rows are in its leaf partitions
    # Per table policy (source/policy.py): masked columns (their type is text), the source columns not
    # mirrored, and the row filter (SQL written by the user; the publication's too).
    masks: tuple[tuple[str, ColumnMask], ...] = ()
    excluded: tuple[str, ...] = ()
    row_filter: str | None = None
    column_selection: bool = False  # ``columns`` applies: only these columns are mirrored, never one added later

    def mask_of(self, name: str) -> ColumnMask | None:
        """The mask of the column ``name``, None when it is not masked."""
        return dict(self.masks).get(name)

    def row_filter_sql(self) -> sql.Composable:
        """The row filter as a condition (``true`` without one); the user's SQL, as the publication has it."""
        return sql.SQL("({})").format(sql.SQL(self.row_filter)) if self.row_filter else sql.SQL("true")

    def column(self, name: str) -> SourceColumn:
        for column in self.columns:
            if column.name == name:
                return column
        raise KeyError(name)

    def rows_sql(self) -> sql.Composable:
        """The table in a FROM clause, with its own rows only: ``ONLY`` leaves out the rows of tables
        that INHERIT from it, whose changes the WAL carries as theirs (a partitioned table's rows are
        its partitions', which ``ONLY`` would leave out)."""
        name = sql.Identifier(self.schema_name, self.table_name)
        return name if self.partitioned else sql.SQL("ONLY {}").format(name)


_TYPE_QUERY = """
SELECT t.typname, t.typtype, t.typbasetype, t.typtypmod, t.typelem, t.typcategory, t.typarray,
       format_type(t.oid, %(mod)s)
FROM pg_type t WHERE t.oid = %(oid)s
"""

_SPECIAL_KINDS = {"e": "enum", "c": "composite", "r": "range", "m": "multirange", "p": "pseudo"}


class TypeResolver:
    """Resolves (type oid, typmod) pairs to :class:`PgType`, caching what it has seen."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn
        self._cache: dict[tuple[int, int, int], PgType] = {}

    def resolve(self, oid: int, type_mod: int, dimensions: int = 0) -> PgType:
        """The resolved type of a column declared as ``oid`` with ``type_mod`` (and ``dimensions``,
        which only an array keeps)."""
        cached = self._cache.get((oid, type_mod, dimensions))
        if cached is None:
            cached = self._resolve(oid, type_mod, display_name=None)
            if cached.kind == "array":
                cached = replace(cached, dimensions=dimensions)
            self._cache[(oid, type_mod, dimensions)] = cached
        return cached

    def _resolve(self, oid: int, type_mod: int, display_name: str | None) -> PgType:
        row = self._conn.execute(_TYPE_QUERY, {"oid": oid, "mod": type_mod}).fetchone()
        if row is None:
            raise StartupCheckError(f"type oid {oid} does not exist in the source catalog")
        typname, typtype, basetype, base_mod, elem, category, array_oid, formatted = row
        name = display_name or formatted
        if typtype == "d":
            return self._resolve(basetype, base_mod if base_mod != -1 else type_mod, name)
        if category == "A" and elem:
            element = self._resolve(elem, type_mod, None)
            return PgType(name=name, kind="array", type_mod=type_mod, base_oid=oid, array_oid=0, element=element)
        kind: str = _SPECIAL_KINDS.get(typtype) or typname
        return PgType(name=name, kind=kind, type_mod=type_mod, base_oid=oid, array_oid=array_oid)


@dataclass(frozen=True)
class Attribute:
    """A live column of a table as ``pg_attribute`` holds it now."""

    name: str
    attnum: int
    type_oid: int
    type_mod: int
    not_null: bool
    generated: bool
    missing: str | None
    has_default: bool
    dimensions: int  # declared array dimensions (attndims), 0 for a non-array
    type_sql: str  # the declared type as SQL (format_type), to cast a text value to it


def source_column(name: str, pg_type: PgType, not_null: bool, attribute: Attribute | None) -> SourceColumn:
    """A column named and typed as given, with the identity and defaults of its catalog ``attribute``
    (None when the catalog cannot say which column it is)."""
    if attribute is None:
        return SourceColumn(name=name, type=pg_type, not_null=not_null)
    return SourceColumn(
        name=name,
        type=pg_type,
        not_null=not_null,
        attnum=attribute.attnum,
        missing=attribute.missing,
        has_default=attribute.has_default,
        generated=attribute.generated,
    )


def attribute_column(attribute: Attribute, resolver: TypeResolver) -> SourceColumn:
    """The column a catalog ``attribute`` describes, as it is now."""
    pg_type = resolver.resolve(attribute.type_oid, attribute.type_mod, attribute.dimensions)
    return source_column(attribute.name, pg_type, attribute.not_null, attribute)


def table_attributes(conn: psycopg.Connection, oid: int) -> list[Attribute]:
    """The table's live columns in ``attnum`` order (the order pgoutput's Relation message lists them)."""
    rows = conn.execute(
        """
        SELECT attname, attnum, atttypid, atttypmod, attnotnull, attgenerated <> '',
               CASE WHEN atthasmissing THEN (attmissingval::text::text[])[1] END, atthasdef, attndims,
               format_type(atttypid, atttypmod)
        FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum
        """,
        (oid,),
    ).fetchall()
    return [Attribute(*row) for row in rows]


def identify_columns(
    attributes: Sequence[Attribute], columns: Sequence[tuple[str, int]], listed: Collection[int] | None = None
) -> list[Attribute | None]:
    """The catalog's column behind each ``(name, type oid)`` of a Relation message (None: unknown).

    The message may be older than the catalog (the flusher reads WAL after the DDL ran): by name
    when every name is still there in the message's order; else by position when the first live
    columns have the message's types (a RENAME keeps positions, columns added since come last). A
    RENAME together with a DROP COLUMN since the message leaves the renamed columns unknown.
    Generated columns count for the positions only when the message names one: pgoutput sends
    them only from PostgreSQL 18 on, and only for a publication with ``publish_generated_columns``.
    Under a publication column list (``listed``: its attnums) the message has only those columns:
    positions count among them (else a column after an excluded one would take its neighbour's place).
    """
    by_name = {attribute.name: attribute for attribute in attributes}
    named = [by_name.get(name) for name, _ in columns]
    attnums = [attribute.attnum for attribute in named if attribute is not None]
    if len(attnums) == len(columns) and attnums == sorted(attnums):
        return named
    sent = [attribute for attribute in attributes if listed is None or attribute.attnum in listed]
    if not any(attribute is not None and attribute.generated for attribute in named):
        sent = [attribute for attribute in sent if not attribute.generated]
    first = list(sent[: len(columns)])
    if len(first) == len(columns) and all(
        a.type_oid == type_oid for a, (_, type_oid) in zip(first, columns, strict=True)
    ):
        return list(first)
    return named


@dataclass(frozen=True)
class GenerationExpression:
    """How PostgreSQL computes a ``GENERATED ALWAYS AS (...) STORED`` column."""

    attnum: int
    expression: str  # pg_get_expr: SQL over the table's column names as they are now
    inputs: tuple[int, ...]  # attnums of the columns it reads (pg_depend; tableoid, -6, too)


def generation_expressions(conn: psycopg.Connection, oid: int) -> dict[int, GenerationExpression]:
    """The stored generated columns of a table by attnum, with their expressions and input columns."""
    rows = conn.execute(
        """
        SELECT a.attnum, pg_get_expr(d.adbin, d.adrelid),
               ARRAY(SELECT dep.refobjsubid::int FROM pg_depend dep
                     WHERE dep.classid = 'pg_attrdef'::regclass AND dep.objid = d.oid
                       AND dep.refclassid = 'pg_class'::regclass AND dep.refobjid = a.attrelid
                       AND dep.refobjsubid <> a.attnum AND dep.refobjsubid <> 0
                     ORDER BY 1)
        FROM pg_attribute a JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attrelid = %s AND a.attgenerated = 's' AND NOT a.attisdropped
        """,
        (oid,),
    ).fetchall()
    return {attnum: GenerationExpression(attnum, expression, tuple(inputs)) for attnum, expression, inputs in rows}


def server_version(conn: psycopg.Connection) -> int:
    """``server_version_num``, e.g. 150004."""
    return int(conn.execute("SHOW server_version_num").fetchone()[0])  # type: ignore[index]


def _refuse_generated_key(table: TableConfig, key: Sequence[str], columns: Sequence[SourceColumn]) -> None:
    """A key column must come with every DELETE, and pgoutput before PostgreSQL 18 sends no generated
    column: such a key could not say which row went."""
    generated = [column.name for column in columns if column.generated and column.name in key]
    if generated:
        raise StartupCheckError(
            f"{table.key}: primary key column(s) {', '.join(generated)} are GENERATED ... STORED, and logical "
            "replication does not send generated columns, so a DELETE would not say which row went. Key the "
            "table on plain columns (or set tables[].primary_key to them, with REPLICA IDENTITY FULL), or remove "
            f"{table.key} from the config"
        )


def _index_columns(
    conn: psycopg.Connection, oid: int, attributes: Sequence[Attribute], condition: str
) -> dict[str, set[str | None]]:
    """The table's indexes matching ``condition`` (a fixed ``pg_index`` predicate), each with the names
    of its key columns (INCLUDE columns left out; None for an expression)."""
    names = {attribute.attnum: attribute.name for attribute in attributes}
    rows = conn.execute(
        sql.SQL(
            "SELECT indexrelid::regclass::text, (indkey::int2[])[0:indnkeyatts - 1] FROM pg_catalog.pg_index "
            "WHERE indrelid = %s AND {}"
        ).format(sql.SQL(condition)),  # a predicate written in this module, never from config
        (oid,),
    ).fetchall()
    return {index: {names.get(attnum) for attnum in attnums} for index, attnums in rows}


def _refuse_unenforced_key(
    conn: psycopg.Connection, table: TableConfig, oid: int, key: Sequence[str], attributes: Sequence[Attribute]
) -> None:
    """A configured key must be what PostgreSQL enforces: NOT NULL columns (Iceberg's key columns hold
    no NULL) with a unique index or constraint on some of them. Rows sharing a key would be folded into
    one in Iceberg, and deleting one would delete them all there."""

    def quoted(name: str) -> str:
        return sql.Identifier(name).as_string(conn)

    nullable = [attribute.name for attribute in attributes if attribute.name in key and not attribute.not_null]
    if nullable:
        columns = ", ".join(f"ALTER COLUMN {quoted(name)} SET NOT NULL" for name in nullable)
        raise StartupCheckError(
            f"{table.key}: primary_key column(s) {', '.join(nullable)} may be NULL, and an Iceberg key column "
            f"cannot; run ALTER TABLE {table.name} {columns}"
        )
    # Plain unique indexes only: a partial one or one on expressions does not make the columns unique.
    plain_unique = "indisunique AND indisvalid AND indpred IS NULL AND indexprs IS NULL"
    unique = _index_columns(conn, oid, attributes, plain_unique)
    if not any(columns <= set(key) for columns in unique.values()):
        columns = ", ".join(quoted(name) for name in key)
        raise StartupCheckError(
            f"{table.key}: primary_key {list(key)} is not unique in the source (no unique index or constraint "
            f"on these columns), and rows sharing a key would become one row in Iceberg; run CREATE UNIQUE "
            f"INDEX ON {table.name} ({columns}), or set primary_key to columns that are unique"
        )


def _refuse_identity_without_key(
    conn: psycopg.Connection, table: TableConfig, oid: int, key: Sequence[str], attributes: Sequence[Attribute]
) -> None:
    """REPLICA IDENTITY USING INDEX: a DELETE carries that index's columns only, and an UPDATE the old
    ones only when they change. Unless they include the whole key, a delete could not be matched to its
    Iceberg row, nor a changed key's old row removed."""
    identity = _index_columns(conn, oid, attributes, "indisreplident")
    carried = set().union(*identity.values())
    missing = [name for name in key if name not in carried]
    if missing:
        index = next(iter(identity), "a dropped index")
        raise StartupCheckError(
            f"{table.key}: REPLICA IDENTITY USING INDEX {index} does not carry the key column(s) "
            f"{', '.join(missing)}, so deletes and key changes could not be matched to their rows; run ALTER TABLE "
            f"{table.name} REPLICA IDENTITY DEFAULT (or FULL)"
        )


def _near_names(conn: psycopg.Connection, table: TableConfig) -> str:
    """A hint naming the tables whose names differ from the configured one only in case: names in the
    config are exact (like quoted SQL names), where SQL folds an unquoted name to lower case."""
    rows = conn.execute(
        """
        SELECT n.nspname, c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE lower(n.nspname) = lower(%s) AND lower(c.relname) = lower(%s) AND c.relkind IN ('r', 'p')
        ORDER BY 1, 2 LIMIT 5
        """,
        (table.schema_name, table.table_name),
    ).fetchall()
    if not rows:
        return ""
    names = " or ".join(f"{quote_column(schema_name)}.{quote_column(table_name)}" for schema_name, table_name in rows)
    return f" (names in the config are exact, case included: did you mean {names}?)"


# SQL, true when row-level security hides rows of the pg_class row ``c`` from the current role (it
# neither bypasses RLS nor, unless RLS is forced, owns the table): its snapshot would copy only those
# the policies show, while the WAL carries every row's changes.
ROW_SECURITY_APPLIES = """
    (c.relrowsecurity
     AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
                     WHERE r.rolname = current_user AND (r.rolsuper OR r.rolbypassrls))
     AND (c.relforcerowsecurity OR NOT pg_has_role(c.relowner, 'USAGE')))
"""


# Tables of the pipeline's own (c: pg_class, n: pg_namespace), never mirrored: the coordination schema,
# and an Iceberg SQL catalog's tables (wherever the catalog created them: every Iceberg commit writes
# ``iceberg_tables``, so mirroring it would feed itself). A SQL catalog table is told by its name and
# its ``catalog_name`` column; NULL for any other table, else why it is the pipeline's own.
PIPELINE_OWN_REASON = f"""
    CASE WHEN n.nspname = '{COORDINATION_SCHEMA}'
         THEN 'the pipeline''s coordination state (schema {COORDINATION_SCHEMA})'
         WHEN c.relname IN ('iceberg_tables', 'iceberg_namespace_properties') AND EXISTS (
             SELECT 1 FROM pg_catalog.pg_attribute a
             WHERE a.attrelid = c.oid AND a.attname = 'catalog_name' AND NOT a.attisdropped)
         THEN 'an Iceberg SQL catalog''s table: every Iceberg commit writes it, so mirroring it would feed itself'
    END
"""


def _refuse_pipeline_own(conn: psycopg.Connection, table: TableConfig, oid: int) -> None:
    reason = conn.execute(
        f"SELECT {PIPELINE_OWN_REASON} FROM pg_catalog.pg_class c "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
        (oid,),
    ).fetchone()
    if reason and reason[0]:
        raise StartupCheckError(f"{table.key} is {reason[0]}; remove it from tables in the config")


def _refuse_unreadable(conn: psycopg.Connection, table: TableConfig, oid: int) -> None:
    """The snapshot and ``verify`` read the table (a partitioned one's leaves directly): the role needs
    SELECT on each, or the first chunk would fail after the slot was created; and row-level security
    must not apply to it, or the snapshot would take the rows its policies show, silently, while the
    WAL carries every row's changes."""
    rows = conn.execute(
        "SELECT format('%%I.%%I', n.nspname, c.relname), has_table_privilege(c.oid, 'SELECT'), "
        + ROW_SECURITY_APPLIES
        + " FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = ANY(%s::oid[]) ORDER BY 1",
        ([oid, *(holder for holder in row_holders(conn, oid) if holder != oid)],),
    ).fetchall()
    user = sql.Identifier(conn.info.user).as_string(conn)
    unreadable = [name for name, readable, _ in rows if not readable]
    if unreadable:
        raise StartupCheckError(
            f"{table.key}: role {user} may not read {', '.join(unreadable)}; run GRANT SELECT ON "
            f"{', '.join(unreadable)} TO {user}"
        )
    filtered = [name for name, _, row_security in rows if row_security]
    if filtered:
        raise StartupCheckError(
            f"{table.key}: row-level security applies to role {user} on {', '.join(filtered)}, so the snapshot "
            f"would copy only the rows its policies show; run ALTER ROLE {user} BYPASSRLS"
        )


def describe_table(
    conn: psycopg.Connection, table: TableConfig, resolver: TypeResolver, publication: str | None = None
) -> SourceTable:
    """Columns (those mirrored: _with_policy), key and identity of a table; refuses missing or keyless ones."""
    row = conn.execute(
        """
        SELECT c.oid, c.relkind, c.relreplident, c.relpersistence FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %s AND c.relname = %s
        """,
        (table.schema_name, table.table_name),
    ).fetchone()
    if row is None:
        raise StartupCheckError(f"table {table.name} does not exist in the source database{_near_names(conn, table)}")
    oid, relkind, replident, persistence = row
    if relkind not in ("r", "p"):
        raise StartupCheckError(
            f"{table.key} is not a table (relkind {relkind!r}); only ordinary and partitioned tables are replicated"
        )
    if persistence == "u":
        raise StartupCheckError(
            f"{table.key} is UNLOGGED: its changes are not written to the WAL, so logical replication cannot "
            f"carry them; run ALTER TABLE {table.name} SET LOGGED, or remove {table.key} from the config"
        )
    _refuse_pipeline_own(conn, table, oid)
    if relkind == "p":
        try:
            leaves(conn, oid)
        except Pg2IcebergError as exc:
            raise StartupCheckError(f"{table.key}: {exc}") from None
    _refuse_unreadable(conn, table, oid)
    attributes = table_attributes(conn, oid)
    columns = tuple(attribute_column(attribute, resolver) for attribute in attributes)
    declared_key = tuple(
        name
        for (name,) in conn.execute(
            """
            SELECT a.attname FROM pg_index i
            JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) ON true
            JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
            WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.ord
            """,
            (oid,),
        )
    )
    names = {column.name for column in columns}
    if table.primary_key:
        missing = [name for name in table.primary_key if name not in names]
        if missing:
            raise StartupCheckError(f"{table.key}: primary_key names unknown columns {missing}")
        key = tuple(table.primary_key)
        if tuple(key) != declared_key and replident not in ("f", "i"):
            raise StartupCheckError(
                f"{table.key}: primary_key {list(key)} is not the declared primary key, so updates and "
                f"deletes would not carry it; run ALTER TABLE {table.name} REPLICA IDENTITY FULL"
            )
        _refuse_unenforced_key(conn, table, oid, key, attributes)
    elif declared_key:
        key = declared_key
    else:
        raise StartupCheckError(
            f"{table.key} has no primary key; declare one, or set tables[].primary_key in the config "
            f"and ALTER TABLE {table.name} REPLICA IDENTITY FULL"
        )
    _refuse_generated_key(table, key, columns)
    if replident == "n":
        raise StartupCheckError(f"{table.key} has REPLICA IDENTITY NOTHING; updates and deletes cannot be replicated")
    if replident == "i":
        _refuse_identity_without_key(conn, table, oid, key, attributes)
    described = SourceTable(
        key=table.key,
        schema_name=table.schema_name,
        table_name=table.table_name,
        oid=oid,
        columns=columns,
        primary_key=key,
        replica_identity=replident,
        partitioned=relkind == "p",
    )
    return _with_policy(conn, table, described, attributes, publication)


def _with_policy(
    conn: psycopg.Connection,
    table: TableConfig,
    described: SourceTable,
    attributes: Sequence[Attribute],
    publication: str | None,
) -> SourceTable:
    """The table as it is mirrored: the columns ``columns`` selects (under an exclude list, of those the
    ``publication`` sends), masked ones as text, and its row filter (see source/policy.py)."""
    columns, key, replident = described.columns, described.primary_key, described.replica_identity
    identity_index = _index_columns(conn, described.oid, attributes, "indisreplident") if replident == "i" else {}
    identity = [name for index in identity_index.values() for name in index if name]
    published = None
    if publication and table.columns and table.columns.exclude is not None and conn.info.server_version >= 150000:
        listed = published_policies(conn, publication).get(table.key)
        published = listed.columns if listed else None
    kept, excluded = selected_columns(table, [column.name for column in columns], key, identity, replident, published)
    if (excluded or table.mask) and any(column.generated for column in columns):
        raise StartupCheckError(
            f"{table.key}: has GENERATED columns, which the flusher computes from the staged row, and columns or "
            "mask would leave it without their inputs or give it masked ones: mirror the table whole and unmasked"
        )
    masks = table_masks(table)
    by_name = dict(masks)
    return replace(
        described,
        columns=tuple(
            masked_column(column, by_name[column.name]) if column.name in by_name else column
            for column in columns
            if column.name in kept
        ),
        masks=masks,
        excluded=tuple(excluded),
        row_filter=table.where,
        column_selection=table.columns is not None,
    )


MASKED_TYPE = PgType(name="text", kind="text", type_mod=-1, base_oid=TEXT_OID, array_oid=TEXT_ARRAY_OID)


def masked_column(column: SourceColumn, mask: ColumnMask) -> SourceColumn:
    """A masked column as it is mirrored: text (a hash, a fixed string or NULL), nullable; the value rows
    older than the column read is masked too."""
    return replace(column, type=MASKED_TYPE, not_null=False, missing=mask.text(column.missing))


def file_node(conn: psycopg.Connection, oid: int) -> int | None:
    """The table's ``relfilenode``: a new one after every rewrite (``ALTER COLUMN ... TYPE`` with a
    rewrite, a volatile default, ``VACUUM FULL``, ``CLUSTER``, ``TRUNCATE``). Read inside a transaction
    on an imported snapshot, it is the one that snapshot sees."""
    row = conn.execute("SELECT relfilenode FROM pg_catalog.pg_class WHERE oid = %s", (oid,)).fetchone()
    return int(row[0]) if row and row[0] else None


@dataclass(frozen=True)
class SourceFiles:
    """Where a read of a table under a snapshot took its rows from: the table's relfilenode, and for
    a partitioned table (which has none) its leaf partitions' (oid -> relfilenode)."""

    file_node: int | None
    leaves: dict[int, int] | None = None


def source_files_seen_by(target: PostgresConnection, source: SourceTable, snapshot_name: str) -> SourceFiles:
    """The table's files as the exported snapshot ``snapshot_name`` sees them (rows read under it are
    from those files)."""
    with connect(target) as conn, imported_snapshot(conn, snapshot_name):
        return source_files_seen_in(conn, source)


def source_files_seen_in(conn: psycopg.Connection, source: SourceTable) -> SourceFiles:
    """The table's files as ``conn``'s transaction sees them (one on an imported snapshot: the files
    rows read under that snapshot come from); one transaction serves many tables."""
    found = leaf_files(leaves(conn, source.oid)) if source.partitioned else None
    return SourceFiles(file_node(conn, source.oid), found)


def table_pages(conn: psycopg.Connection, oid: int) -> int:
    """Heap pages of a table: the larger of ``relpages`` and the file size (relpages may be stale or 0)."""
    row = conn.execute(
        """
        SELECT greatest(c.relpages::bigint,
                        pg_relation_size(c.oid) / current_setting('block_size')::bigint)
        FROM pg_class c WHERE c.oid = %s
        """,
        (oid,),
    ).fetchone()
    return int(row[0]) if row else 0


def published_keys(conn: psycopg.Connection, publication: str, tables: Sequence[SourceTable]) -> set[str]:
    """The keys of ``tables`` the publication covers, read from the catalog tables themselves: inside
    a transaction on an imported snapshot, as that snapshot sees them. A snapshot taken before a table
    joined the publication must not be the start of its mirror (its changes in between never stream)."""
    found = conn.execute(
        "SELECT oid, puballtables FROM pg_catalog.pg_publication WHERE pubname = %s", (publication,)
    ).fetchone()
    if found is None:
        return set()
    oid, all_tables = found
    if all_tables:
        return {table.key for table in tables}
    # FOR TABLES IN SCHEMA exists from PostgreSQL 15 on.
    in_schema = (
        "OR c.relnamespace IN (SELECT pnnspid FROM pg_catalog.pg_publication_namespace WHERE pnpubid = %(pub)s)"
        if conn.info.server_version >= 150000
        else ""
    )
    rows = conn.execute(
        "SELECT c.oid FROM pg_catalog.pg_class c WHERE c.oid = ANY(%(oids)s) AND (c.oid IN "
        f"(SELECT prrelid FROM pg_catalog.pg_publication_rel WHERE prpubid = %(pub)s) {in_schema})",
        {"oids": [table.oid for table in tables], "pub": oid},
    )
    covered = {relid for (relid,) in rows}
    return {table.key for table in tables if table.oid in covered}


def published_keys_seen_by(
    target: PostgresConnection, snapshot_name: str, publication: str, tables: Sequence[SourceTable]
) -> set[str]:
    """:func:`published_keys` as the exported snapshot ``snapshot_name`` sees the publication."""
    with connect(target) as conn, imported_snapshot(conn, snapshot_name):
        return published_keys(conn, publication, tables)


def publication_tables(conn: psycopg.Connection, publication: str) -> set[str]:
    """The keys (``schema.table``) the publication covers now."""
    return set(published_names(conn, publication))


def published_names(conn: psycopg.Connection, publication: str) -> dict[str, tuple[str, str]]:
    """The (schema, table) names of each table the publication covers now, by key: the names as the
    server holds them, which a key (``schema.table``) cannot be split back into when a name holds a dot."""
    rows = conn.execute("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (publication,))
    return {f"{schema}.{table}": (schema, table) for schema, table in rows}


def column_policy(
    table: SourceTable, wire_names: Sequence[str], identities: Sequence[Attribute | None]
) -> tuple[tuple[int, ...] | None, dict[int, ColumnMask]]:
    """For the columns of a Relation message (``wire_names``, identified as ``identities``): the
    positions staged (None: all) and each masked one's mask. Matched by attnum, so a column renamed
    since startup keeps its mask; under a column selection a column the table did not mirror at
    startup (excluded, or added since) is not staged."""
    names = {column.attnum: column.name for column in table.columns if column.attnum is not None}
    mirrored = [names.get(a.attnum) if a is not None else None for a in identities]
    masks = {}
    for position, (name, wire_name) in enumerate(zip(mirrored, wire_names, strict=True)):
        mask = table.mask_of(name or wire_name)
        if mask is not None:
            masks[position] = mask
    if not table.column_selection:
        return None, masks
    return tuple(position for position, name in enumerate(mirrored) if name is not None), masks
