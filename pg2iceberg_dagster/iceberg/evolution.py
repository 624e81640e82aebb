"""Evolving a mirror table's schema with its source table, column by column identity.

A source column is identified by its ``attnum``, which a RENAME keeps and a DROP + ADD of the same
name does not. The Iceberg table records, per field id, the ``attnum`` it mirrors (a table property),
so a renamed column is renamed in Iceberg (Iceberg renames by field id: old data files keep reading),
and a column dropped and added again under its old name becomes a new field while the dropped one keeps
its history under ``<name>__dropped_<attnum>``.

A column added with a constant DEFAULT gives every row older than the ALTER that value, without a
WAL change (``pg_attribute.attmissingval``). Such an addition is recorded as a *pending fill* in
the same commit as the schema change; the materializer sets the value on every existing row
before it merges anything newer, and then clears the record (so a crash in between fills again).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pyiceberg.schema import Schema
from pyiceberg.table import Table, Transaction
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.types import DecimalType, DoubleType, FloatType, IcebergType, IntegerType, LongType, NestedField

from ..errors import ResyncRequiredError
from ..source.catalog import SourceColumn, SourceFiles
from .change_metadata import metadata_names, refuse_metadata_name_clash
from .transaction import open_transaction
from .types import field_ids, iceberg_type


def column_name(schema: Schema, field_id: int) -> str:
    """The full name of the field ``field_id`` of ``schema`` (KeyError when it has none: a field
    the caller took from this very schema always has one)."""
    name = schema.find_column_name(field_id)
    if name is None:
        raise KeyError(f"field id {field_id} is not in the schema")
    return name


COLUMN_ATTNUMS = "pg2iceberg.column-attnums"
PENDING_FILLS = "pg2iceberg.pending-fills"
# The source table's relfilenode as the snapshot (or resync) the rows were read in saw it. Only a
# rewrite changes it: a type change seen with another one may have changed values (``USING``).
SOURCE_FILE_NODE = "pg2iceberg.source-relfilenode"
# A partitioned source table's leaf partitions the rows were read from (JSON: oid -> relfilenode),
# to find the rows that joined or left it with no WAL change (see source.partitions).
SOURCE_LEAVES = "pg2iceberg.source-partitions"


def source_files_properties(files: SourceFiles) -> dict[str, str]:
    """The table properties recording the source files the rows were read from."""
    properties = {SOURCE_FILE_NODE: str(files.file_node)} if files.file_node is not None else {}
    if files.leaves is not None:
        properties[SOURCE_LEAVES] = leaves_property(files.leaves)
    return properties


def leaves_property(leaves: dict[int, int]) -> str:
    return json.dumps({str(oid): node for oid, node in sorted(leaves.items())})


def recorded_leaves(table: Table) -> dict[int, int] | None:
    """The leaf partitions recorded for ``table`` (None: its source is not partitioned)."""
    text = table.properties.get(SOURCE_LEAVES)
    return {int(oid): node for oid, node in json.loads(text).items()} if text else None


_WIDENINGS: dict[type[IcebergType], tuple[type[IcebergType], ...]] = {
    IntegerType: (LongType,),
    FloatType: (DoubleType,),
}


def _is_widening(current: IcebergType, wanted: IcebergType) -> bool:
    if current == wanted:
        return False
    if isinstance(current, DecimalType) and isinstance(wanted, DecimalType):
        return wanted.scale == current.scale and wanted.precision > current.precision
    return isinstance(wanted, _WIDENINGS.get(type(current), ()))


def _same_shape(current: IcebergType, wanted: IcebergType) -> bool:
    # Lists compare with element ids; the element type is what matters.
    current_element = getattr(current, "element_type", None)
    wanted_element = getattr(wanted, "element_type", None)
    return current_element is not None and current_element == wanted_element


ColumnFit = Literal["same", "widen", "holds", "incompatible"]


def column_fit(current: IcebergType, wanted: IcebergType) -> ColumnFit:
    """How an Iceberg column of type ``current`` takes a source column that maps to ``wanted``: the
    one type-compatibility rule of schema evolution and of the schema check.

    ``same``; ``widen`` (a safe widening to apply first); ``holds`` (narrowed at the source: the
    wider Iceberg type holds every value); ``incompatible`` (any other change of type).
    """
    if current == wanted or _same_shape(current, wanted):
        return "same"
    if _is_widening(current, wanted):
        return "widen"
    if _is_widening(wanted, current):
        return "holds"
    return "incompatible"


def _json_property(table: Table | TableMetadata, name: str) -> dict[str, Any]:
    text = table.properties.get(name)
    return json.loads(text) if text else {}


def column_attnums(table: Table | TableMetadata) -> dict[int, int]:
    """Field id -> the ``attnum`` of the source column it mirrors (fields recorded so far); of a table,
    or of the metadata a transaction stages."""
    return {int(field_id): attnum for field_id, attnum in _json_property(table, COLUMN_ATTNUMS).items()}


def _attnums_property(attnums: dict[int, int]) -> dict[str, str]:
    return {COLUMN_ATTNUMS: json.dumps({str(k): v for k, v in sorted(attnums.items())}, sort_keys=True)}


def attnum_properties(schema: Schema, columns: Sequence[SourceColumn]) -> dict[str, str]:
    """The table property recording which field mirrors which source column (for a new table)."""
    return _attnums_property(
        {schema.find_field(column.name).field_id: column.attnum for column in columns if column.attnum is not None}
    )


@dataclass(frozen=True)
class PendingFill:
    """Rows older than ``column`` take its ``missing`` value (PostgreSQL text form of its type)."""

    field_id: int
    column: SourceColumn

    @property
    def value(self) -> str:
        assert self.column.missing is not None  # only columns with a missing value are recorded
        return self.column.missing


def pending_fills(table: Table) -> list[PendingFill]:
    """Columns added with a DEFAULT whose value existing rows do not hold yet."""
    return [
        PendingFill(int(field_id), SourceColumn.from_json(column))
        for field_id, column in sorted(_json_property(table, PENDING_FILLS).items())
    ]


def field_for(schema: Schema, attnums: dict[int, int], column: SourceColumn) -> NestedField | None:
    """The Iceberg field mirroring ``column``: by ``attnum`` where recorded, else by name (unless the
    name belongs to another source column)."""
    if column.attnum is not None:
        fields = {f.field_id: f for f in schema.fields}
        for field_id, attnum in attnums.items():
            if attnum == column.attnum and field_id in fields:
                return fields[field_id]
    if column.name not in schema.column_names:
        return None
    named = schema.find_field(column.name, case_sensitive=True)
    owner = attnums.get(named.field_id)
    if owner is not None and column.attnum is not None and owner != column.attnum:
        return None
    return named


@dataclass
class _Plan:
    renames: dict[int, str] = field(default_factory=dict)  # field id -> new name
    additions: list[tuple[SourceColumn, IcebergType]] = field(default_factory=list)
    widenings: list[tuple[int, IcebergType]] = field(default_factory=list)
    # A rebuild only (see rebuild_schema): fields whose type changed incompatibly (a new field of the
    # same name replaces each) and fields of columns gone from the source.
    replaced: list[int] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    rebuild: bool = False  # every row is read again: no value of an added column is left to fill
    adopted: dict[int, int] = field(default_factory=dict)  # field id -> attnum, newly recorded
    changes: list[str] = field(default_factory=list)


def schema_follows_source(table: Table, columns: Sequence[SourceColumn]) -> list[str]:
    """What keeps ``table`` from taking the source ``columns`` as they are (empty when nothing): a
    missing column, a rename not applied yet, a widening not applied yet, an incompatible type."""
    schema = table.schema()
    attnums = column_attnums(table)
    element_ids = field_ids(10_000)  # only the types are compared
    problems = []
    for column in columns:
        wanted = iceberg_type(column.type, column.name, element_ids)
        current = field_for(schema, attnums, column)
        if current is None:
            problems.append(f"{column.name}: missing in Iceberg (source type {column.type.name})")
        elif current.name != column.name:
            problems.append(f"{column.name}: still named {current.name} in Iceberg")
        elif column_fit(current.field_type, wanted) == "widen":
            problems.append(f"{column.name}: Iceberg {current.field_type} is narrower than the source's {wanted}")
        elif column_fit(current.field_type, wanted) == "incompatible":
            problems.append(f"{column.name}: Iceberg {current.field_type}, source maps to {wanted}")
    return problems


def _plan(
    table: Table, table_key: str, columns: Sequence[SourceColumn], rebuild: bool = False, file_node: int | None = None
) -> _Plan:
    """What evolves the schema to ``columns`` (read with the source at ``file_node``). A ``rebuild`` is
    for rows read again from the source: no older values to fill or refuse, an incompatible type
    replaces its field, and fields of columns gone from the source are deleted."""
    refuse_metadata_name_clash(table_key, columns, sorted(metadata_names(table)))
    schema = table.schema()
    attnums = column_attnums(table)
    live = {column.attnum for column in columns if column.attnum is not None}
    plan = _Plan(rebuild=rebuild)
    element_ids = field_ids(10_000)  # only the types are compared; pyiceberg assigns real ids
    matched: set[int] = set()
    retyped: list[str] = []  # source columns now of another type than their Iceberg field's
    for column in columns:
        wanted = iceberg_type(column.type, column.name, element_ids)
        current = field_for(schema, attnums, column)
        fit = column_fit(current.field_type, wanted) if current is not None else None
        if current is not None and rebuild and fit in ("incompatible", "holds"):
            # Every row is read again: the field takes the source's type exactly (a narrowed one too).
            plan.replaced.append(current.field_id)
            plan.changes.append(f"replace {current.name} {current.field_type} -> {column.name} {wanted}")
            current = None
        if current is None:
            if not rebuild:
                _refuse_unknown_older_values(table_key, column)
            plan.additions.append((column, wanted))
            default = f" (older rows: {column.missing})" if column.missing is not None else ""
            plan.changes.append(f"add column {column.name} {wanted}{default}")
            if rebuild:
                continue
            holder = schema.find_field(column.name) if column.name in schema.column_names else None
            owner = attnums.get(holder.field_id) if holder is not None else None
            if holder is not None and owner not in live:
                # The name belongs to a column dropped at the source: it keeps its history aside.
                plan.renames[holder.field_id] = f"{column.name}__dropped_{owner}"
                plan.changes.append(f"rename {column.name} -> {column.name}__dropped_{owner} (dropped at the source)")
            continue
        matched.add(current.field_id)
        if column.attnum is not None and current.field_id not in attnums:
            plan.adopted[current.field_id] = column.attnum
        if current.name != column.name:
            plan.renames[current.field_id] = column.name
            plan.changes.append(f"rename {current.name} -> {column.name}")
        if fit == "widen":
            plan.widenings.append((current.field_id, wanted))
            plan.changes.append(f"widen {column.name} {current.field_type} -> {wanted}")
        elif fit == "holds":
            retyped.append(column.name)
        elif fit == "incompatible":
            _refuse_incompatible_type(table_key, column.name, current.field_type, wanted)
    retyped += [column_name(schema, field_id) for field_id, _ in plan.widenings]
    recorded = table.properties.get(SOURCE_FILE_NODE)
    if retyped and not rebuild and file_node is not None and recorded and int(recorded) != file_node:
        # PostgreSQL rewrites the table for int->bigint, real->double and a narrowing, and for any
        # USING: values may have changed with no WAL change, and nothing tells which.
        _refuse_rewritten_type(table_key, retyped[0])
    if rebuild:
        # Change metadata columns are no source columns: a rebuild keeps them (see iceberg.change_metadata).
        kept = matched | set(plan.replaced) | {f.field_id for f in schema.fields if f.name in metadata_names(table)}
        plan.deleted = [f.field_id for f in schema.fields if f.field_id not in kept]
        plan.changes += [f"drop {schema.find_column_name(i)} (gone from the source)" for i in plan.deleted]
    return plan


def refuse_unidentified_columns(table: Table, table_key: str, versions: Sequence[Sequence[SourceColumn]]) -> None:
    """A staged column whose identity the flusher could not tell (a RENAME and a DROP COLUMN of the
    table before it read the changes in between) and whose name no Iceberg field has: its values
    would land nowhere (a key column's too, and the merge could never fold them). The table is
    resynced instead."""
    schema = table.schema()
    attnums = column_attnums(table)
    lost = sorted(
        {
            column.name
            for columns in versions
            for column in columns
            if column.attnum is None and field_for(schema, attnums, column) is None
        }
    )
    if lost:
        raise ResyncRequiredError(
            table_key,
            f"column(s) {', '.join(lost)} of changes staged before a RENAME and a DROP COLUMN could not be told "
            "apart from the columns now (the flusher read them after both), so their values have no place",
        )


def _refuse_incompatible_type(table_key: str, column: str, was: IcebergType, now: IcebergType) -> None:
    raise ResyncRequiredError(
        table_key,
        f"column {column} changed from {was} to {now} at the source, which Iceberg cannot evolve into (only "
        "int->bigint, real->double, numeric precision up, varchar->text are)",
    )


def _refuse_rewritten_type(table_key: str, column: str) -> None:
    raise ResyncRequiredError(
        table_key,
        f"column {column} changed type with a rewrite of the table, whose USING expression may have changed "
        "its values without any WAL change",
    )


def refuse_unfollowable_retypes(table_key: str, versions: Sequence[tuple[Sequence[SourceColumn], int | None]]) -> None:
    """Between consecutive versions of a table's columns (oldest first, each with the ``file_node`` it
    was read at), a column whose type changed needs a resync when Iceberg cannot evolve between the two
    types, or when the table was rewritten meanwhile (its values may have changed with no WAL change).
    Comparing the Iceberg schema with the newest version alone misses a column added and retyped
    between two merges."""
    element_ids = field_ids(10_000)  # only the types are compared
    for (older, older_node), (newer, newer_node) in itertools.pairwise(versions):
        before = {column.attnum: column for column in older if column.attnum is not None}
        rewritten = older_node is not None and newer_node is not None and older_node != newer_node
        for column in newer:
            previous = before.get(column.attnum) if column.attnum is not None else None
            if previous is None or previous.type == column.type:
                continue
            was = iceberg_type(previous.type, column.name, element_ids)
            now = iceberg_type(column.type, column.name, element_ids)
            if column_fit(was, now) == "incompatible":
                _refuse_incompatible_type(table_key, column.name, was, now)
            if rewritten:
                _refuse_rewritten_type(table_key, column.name)


def _refuse_unknown_older_values(table_key: str, column: SourceColumn) -> None:
    """A new column with a default but no ``attmissingval``: rows older than it may hold values no
    WAL change carried (a volatile default rewrites the table; any rewrite since the ALTER, such as
    ``ALTER COLUMN ... TYPE`` or ``VACUUM FULL``, clears the catalog's record of a constant one).
    A generated column added by ``ALTER TABLE ... ADD COLUMN`` is the same case: the ALTER rewrites
    the table, computing a value for every existing row."""
    if column.generated:
        raise ResyncRequiredError(
            table_key,
            f"column {column.name} was added as GENERATED ALWAYS AS (...) STORED: PostgreSQL computed it for every "
            "existing row while rewriting the table, without any WAL change",
        )
    if column.has_default and column.missing is None:
        raise ResyncRequiredError(
            table_key,
            f"column {column.name} was added with a default that the table's older rows hold without any WAL "
            "change, and the catalog no longer says which (a volatile default, the table was rewritten since "
            "the ALTER, or the column got its default after it was added)",
        )


def evolve_schema(
    table: Table, table_key: str, columns: Sequence[SourceColumn], file_node: int | None = None
) -> list[str]:
    """Bring the Iceberg schema up to the source ``columns`` (the newest description of the table):
    renames by column identity, new columns (with a pending fill when added with a DEFAULT), safe
    widenings. Columns dropped at the source stay in Iceberg (they keep their history and read null
    from then on). A narrowed column keeps its wider Iceberg type; any other change of type needs a
    resync (see :func:`column_fit`), and so does a widening or narrowing seen with a ``file_node``
    other than the one the rows were read with (a rewrite). Returns what changed."""
    plan = _plan(table, table_key, columns, file_node=file_node)
    if not plan.changes and not plan.adopted:
        return []
    schema = table.schema()
    names = set(schema.column_names)
    if any(name in names for name in plan.renames.values()) or any(c.name in names for c, _ in plan.additions):
        # A swap of names or a name taken over: move the renamed fields out of the way first (a crash
        # in between is harmless: the next evolution finds them by identity).
        with table.update_schema() as update:
            for field_id in plan.renames:
                update.rename_column(column_name(schema, field_id), f"__pg2iceberg_renaming_{field_id}")
    with open_transaction(table) as transaction:
        _apply_plan(transaction, table, plan, fills=_json_property(table, PENDING_FILLS))
    return plan.changes


def _apply_plan(
    transaction: Transaction, table: Table, plan: _Plan, fills: dict[str, Any], key: Sequence[str] = ()
) -> None:
    """Stage ``plan`` in ``transaction``: the schema change (with ``key`` as the identifier fields when
    given) and the attnum and pending-fill records."""
    attnums = column_attnums(table)
    # A key column a rebuild adds anew must be required (identifier fields are); its rows are all new.
    with transaction.update_schema(allow_incompatible_changes=bool(key)) as update:
        current = transaction.table_metadata.schema()
        for field_id in [*plan.replaced, *plan.deleted]:
            update.delete_column(column_name(current, field_id))
            attnums.pop(field_id, None)
            fills.pop(str(field_id), None)
        for field_id, name in plan.renames.items():
            update.rename_column(column_name(current, field_id), name)
        for field_id, wanted in plan.widenings:
            update.update_column(column_name(current, field_id), field_type=wanted)
        for column, wanted in plan.additions:
            update.add_column(column.name, wanted, required=column.name in key)
        if key:
            # A rebuild may bring another key (changed at the source): key fields required, the others
            # not, as a new table has them.
            removed = {*plan.replaced, *plan.deleted}
            for kept in current.fields:
                name = plan.renames.get(kept.field_id, kept.name)
                if kept.field_id not in removed and kept.required != (name in key):
                    update.update_column(kept.name, required=name in key)
            update.set_identifier_fields(*key)
    evolved = transaction.table_metadata.schema()
    attnums.update(plan.adopted)
    for column, _ in plan.additions:
        field_id = evolved.find_field(column.name).field_id
        if column.attnum is not None:
            attnums[field_id] = column.attnum
        if column.missing is not None and not plan.rebuild:
            fills[str(field_id)] = column.to_json()
    transaction.set_properties({**_attnums_property(attnums), PENDING_FILLS: json.dumps(fills, sort_keys=True)})


def rebuild_schema(
    table: Table, table_key: str, columns: Sequence[SourceColumn], key: Sequence[str], files: SourceFiles
) -> tuple[Transaction, list[str]]:
    """An open transaction bringing the schema to ``columns`` for rows read again from the source's
    ``files`` (see :func:`_plan`), with ``key`` as the identifier fields and no pending fill, and
    what it changes; nothing is committed. Files written with its metadata carry the new field ids:
    they are added to it, then it commits."""
    plan = _plan(table, table_key, columns, rebuild=True)
    transaction = open_transaction(table)
    _apply_plan(transaction, table, plan, fills={}, key=key)
    transaction.set_properties(source_files_properties(files))
    return transaction, plan.changes


def without_pending_fills(table: Table, done: Sequence[int]) -> dict[str, str]:
    """The pending-fill property with the fills of ``done`` removed, to set in a commit."""
    fills = _json_property(table, PENDING_FILLS)
    for field_id in done:
        fills.pop(str(field_id), None)
    return {PENDING_FILLS: json.dumps(fills, sort_keys=True)}


def no_pending_fills() -> dict[str, str]:
    """The pending-fill property of a table with none (every row holds its columns' values)."""
    return {PENDING_FILLS: json.dumps({})}


def clear_pending_fills(table: Table, done: Sequence[int]) -> None:
    """Forget the fills that are done (their values are in every existing row)."""
    open_transaction(table).set_properties(without_pending_fills(table, done)).commit_transaction()
