"""A mirror table's partition spec and sort order, from its config's ``partition_by`` and ``sort_by``.

The startup checks refuse a term whose column the source does not have, or whose transform does not
apply to the column's type (:func:`layout_problems`), before anything is written. A table is created
with its layout (:func:`initial_layout`) and follows a changed config before its next write
(:func:`follow_layout`: Iceberg's spec evolution, so older files keep the spec they were written
with). A configured column is found by its source identity (``attnum``), so a RENAME keeps
partitioning; a term whose column left the source (DROP COLUMN), or no longer fits its type after a
resync, is left out of the spec from then on and reported, and the next startup asks for the config
to be changed.

Partition fields are named ``<column>_<transform>`` (``created_at_day``, ``id_bucket_16``,
``name_trunc_4``, ``region_identity``), never after the column alone: pyiceberg checks every spec the
table ever had against each new schema, and an identity field named like its column would clash with
a column of that name that replaces it (a type change a resync follows, a DROP and ADD).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table, Transaction
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.sorting import (
    UNSORTED_SORT_ORDER,
    UNSORTED_SORT_ORDER_ID,
    NullOrder,
    SortDirection,
    SortField,
    SortOrder,
)
from pyiceberg.table.update import AddSortOrderUpdate, AssertDefaultSortOrderId, SetDefaultSortOrderUpdate
from pyiceberg.transforms import (
    BucketTransform,
    DayTransform,
    HourTransform,
    IdentityTransform,
    MonthTransform,
    Transform,
    TruncateTransform,
    YearTransform,
)
from pyiceberg.types import BinaryType, DoubleType, FloatType, IcebergType, NestedField, PrimitiveType, UUIDType

from ..config import TableConfig
from ..source.catalog import SourceColumn
from .commit import commit_with_retry
from .evolution import column_attnums, column_name, field_for
from .terms import PartitionTerm, SortTerm
from .transaction import open_transaction
from .types import field_ids, iceberg_type

log = logging.getLogger(__name__)

_TRANSFORMS: dict[str, Any] = {
    "identity": IdentityTransform,
    "year": YearTransform,
    "month": MonthTransform,
    "day": DayTransform,
    "hour": HourTransform,
    "bucket": BucketTransform,
    "truncate": TruncateTransform,
}
_APPLIES_TO = {
    "year": "date, timestamp and timestamptz columns",
    "month": "date, timestamp and timestamptz columns",
    "day": "date, timestamp and timestamptz columns",
    "hour": "timestamp and timestamptz columns",
    "bucket": "integer, numeric(p, s), date, timestamp, text and bytea columns",
    "truncate": "integer, numeric(p, s) and text columns",
    "identity": "columns of a single value",
}
FIRST_PARTITION_FIELD_ID = 1000  # Iceberg's: partition field ids start there


def transform_of(term: PartitionTerm) -> Transform[Any, Any]:
    """The Iceberg transform ``term`` names."""
    factory = _TRANSFORMS[term.transform]
    return factory(term.parameter) if term.parameter is not None else factory()


def partition_refusal(term: PartitionTerm, field_type: IcebergType) -> str | None:
    """Why ``term`` cannot partition a column stored as ``field_type`` (None: it can)."""
    what = f"{term.transform}() does not apply to {term.column}, stored as Iceberg {field_type}"
    if not transform_of(term).can_transform(field_type):
        return f"{what}: it applies to {_APPLIES_TO[term.transform]}"
    # Iceberg allows these, but pyiceberg 0.12 cannot write them: refused rather than written unpartitioned.
    if isinstance(field_type, FloatType | DoubleType):
        return f"{what}: a float partition value can be NaN, which pyiceberg cannot write; use bucket of another column"
    if isinstance(field_type, UUIDType):
        return f"{what}: pyiceberg cannot group uuid values into partitions; partition by another column"
    if term.transform == "truncate" and isinstance(field_type, BinaryType):
        return f"{what}: pyiceberg cannot truncate bytea values; use bucket(N, {term.column})"
    return None


def sort_refusal(term: SortTerm, field_type: IcebergType) -> str | None:
    """Why ``term`` cannot sort by a column stored as ``field_type`` (None: it can)."""
    if not isinstance(field_type, PrimitiveType) or isinstance(field_type, UUIDType):
        return f"{term.column}, stored as Iceberg {field_type}, has no order to sort by"
    return None


def layout_problems(table: TableConfig, columns: Sequence[SourceColumn]) -> list[str]:
    """What in ``table``'s ``partition_by`` and ``sort_by`` the source ``columns`` cannot take: a column
    the source does not have, a transform that does not apply to the column's type."""
    by_name = {column.name: column for column in columns}
    element_ids = field_ids(10_000)  # only the types matter
    problems = []
    for setting, terms in (("partition_by", table.partition_terms), ("sort_by", table.sort_terms)):
        for term in terms:
            column = by_name.get(term.column)
            if column is None:
                problems.append(
                    f"{setting} {term}: the source table has no column {term.column} (renamed or dropped?); "
                    f"name one of its columns in {setting}, or remove the item"
                )
                continue
            field_type = iceberg_type(column.type, column.name, element_ids)
            refusal = partition_refusal(term, field_type) if isinstance(term, PartitionTerm) else None
            refusal = refusal or (sort_refusal(term, field_type) if isinstance(term, SortTerm) else None)
            if refusal:
                problems.append(f"{setting} {term}: {refusal}")
    return problems


@dataclass
class _Layout:
    """The configured layout resolved against one Iceberg schema."""

    partition: list[tuple[PartitionTerm, NestedField]] = field(default_factory=list)
    sort: list[tuple[SortTerm, NestedField]] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # terms the schema cannot take, and why


def _resolve(
    metadata: TableMetadata | None, schema: Schema, table: TableConfig, columns: Sequence[SourceColumn] | None
) -> _Layout:
    """Each term's Iceberg field: the one mirroring the source column of that name (by identity, so a
    rename Iceberg did not follow yet still finds it), else the live field that had that name in an
    earlier schema of the table (a rename it followed: partitioning goes on until the config names
    the column anew). Without the source's ``columns``, by name only."""
    attnums = column_attnums(metadata) if metadata is not None else {}
    by_name = {column.name: column for column in columns} if columns is not None else None
    live = {column.attnum for column in columns or () if column.attnum is not None}
    current = {f.field_id: f for f in schema.fields}
    earlier = {f.name: f.field_id for old in (metadata.schemas if metadata else ()) for f in old.fields}
    layout = _Layout()

    def field_of(term: PartitionTerm | SortTerm, setting: str) -> NestedField | None:
        column = by_name.get(term.column) if by_name is not None else None
        if by_name is None:
            found = next((f for f in schema.fields if f.name == term.column), None)
        elif column is not None:
            found = field_for(schema, attnums, column)
        else:
            found = current.get(earlier.get(term.column, -1))
            if found is not None and attnums.get(found.field_id) not in live:
                found = None  # that field's column is gone: dropped, not renamed
        refusal = None
        if found is None:
            refusal = f"column {term.column} is gone from the source"
        elif isinstance(term, PartitionTerm):
            refusal = partition_refusal(term, found.field_type)
        else:
            refusal = sort_refusal(term, found.field_type)
        if refusal:
            layout.left_out.append(f"{setting} {term} left out: {refusal}; change {setting} in the config")
            return None
        return found

    for term in table.partition_terms:
        if (found := field_of(term, "partition_by")) is not None:
            layout.partition.append((term, found))
    for sort_term in table.sort_terms:
        if (found := field_of(sort_term, "sort_by")) is not None:
            layout.sort.append((sort_term, found))
    return layout


def _base_name(term: PartitionTerm, column: str) -> str:
    if term.transform == "bucket":
        return f"{column}_bucket_{term.parameter}"
    if term.transform == "truncate":
        return f"{column}_trunc_{term.parameter}"
    return f"{column}_{term.transform}"


def _partition_names(metadata: TableMetadata | None, schema: Schema, layout: _Layout) -> list[str]:
    """A name per partition field: ``<column>_<transform>``, numbered on when the name is a column's or
    belongs to another field in any spec of the table (pyiceberg checks them all)."""
    owners: dict[str, tuple[int, str]] = {}
    for spec in metadata.specs().values() if metadata is not None else ():
        for old in spec.fields:
            owners.setdefault(old.name, (old.source_id, repr(old.transform)))
    columns = set(schema.column_names)
    names: list[str] = []
    for term, source in layout.partition:
        identity = (source.field_id, repr(transform_of(term)))
        base = _base_name(term, source.name)
        name, number = base, 1
        while name in columns or name in names or owners.get(name, identity) != identity:
            number += 1
            name = f"{base}_{number}"
        names.append(name)
    return names


def _sort_field(term: SortTerm, source: NestedField) -> SortField:
    return SortField(
        source_id=source.field_id,
        transform=IdentityTransform(),
        direction=SortDirection.DESC if term.descending else SortDirection.ASC,
        null_order=NullOrder.NULLS_FIRST if term.nulls_go_first else NullOrder.NULLS_LAST,
    )


def initial_layout(
    schema: Schema, table: TableConfig, columns: Sequence[SourceColumn]
) -> tuple[PartitionSpec, SortOrder]:
    """The partition spec and sort order a new table mirroring ``columns`` is created with."""
    layout = _resolve(None, schema, table, columns)
    names = _partition_names(None, schema, layout)
    spec = PartitionSpec(
        *(
            PartitionField(source.field_id, FIRST_PARTITION_FIELD_ID + index, transform_of(term), name)
            for index, ((term, source), name) in enumerate(zip(layout.partition, names, strict=True))
        )
    )
    fields = [_sort_field(term, source) for term, source in layout.sort]
    return spec, SortOrder(*fields) if fields else SortOrder()


def describe_spec(spec: PartitionSpec, schema: Schema) -> str:
    """``day(created_at), bucket(4, id)`` for a spec (``unpartitioned`` when it has no field)."""
    parts = []
    for partition_field in spec.fields:
        source = schema.find_column_name(partition_field.source_id) or f"field {partition_field.source_id}"
        parts.append(f"{partition_field.transform}({source})")
    return ", ".join(parts) or "unpartitioned"


def follow_layout(
    transaction: Transaction, table_key: str, table: TableConfig, columns: Sequence[SourceColumn] | None
) -> list[str]:
    """Stage in ``transaction`` (after any schema change in it) what brings the table's partition spec
    and sort order to ``table``'s config, the source having ``columns`` (None: unknown, terms are
    found by name); returns what changes (nothing: the layout is already the config's).

    A spec change removes every current field and adds the configured ones in order: a field kept
    keeps its id (pyiceberg reuses a historical field of the same source, transform and name), and an
    identical spec reuses its spec id."""
    metadata = transaction.table_metadata
    schema = metadata.schema()
    layout = _resolve(metadata, schema, table, columns)
    changes: list[str] = []
    current = [(f.source_id, repr(f.transform)) for f in metadata.spec().fields]
    wanted = [(source.field_id, repr(transform_of(term))) for term, source in layout.partition]
    if current != wanted:
        names = _partition_names(metadata, schema, layout)
        with transaction.update_spec() as update:
            for old in metadata.spec().fields:
                update.remove_field(old.name)
            for (term, source), name in zip(layout.partition, names, strict=True):
                update.add_field(source.name, transform_of(term), name)
        evolved = transaction.table_metadata
        changes.append(f"partition spec {evolved.default_spec_id}: {describe_spec(evolved.spec(), schema)}")
    sort_fields = [_sort_field(term, source) for term, source in layout.sort]
    if not sort_fields and metadata.sort_order_by_id(UNSORTED_SORT_ORDER_ID) is None:
        # pyiceberg 0.12's UpdateSortOrder cannot go back to unsorted on a table created sorted (it sets
        # "the last added order", which is not order 0): add order 0 and make it the default.
        transaction._apply(
            (AddSortOrderUpdate(sort_order=UNSORTED_SORT_ORDER), SetDefaultSortOrderUpdate(sort_order_id=0)),
            (AssertDefaultSortOrderId(default_sort_order_id=metadata.default_sort_order_id),),
        )
        changes.append("sort order 0: unsorted")
    elif list(metadata.sort_order().fields) != sort_fields:
        with transaction.update_sort_order() as update:
            for sort_field in sort_fields:
                name = column_name(schema, sort_field.source_id)
                add = update.desc if sort_field.direction == SortDirection.DESC else update.asc
                add(name, IdentityTransform(), sort_field.null_order)
        terms = ", ".join(str(term) for term, _ in layout.sort) or "unsorted"
        changes.append(f"sort order {transaction.table_metadata.default_sort_order_id}: {terms}")
    if changes and layout.left_out:
        for note in layout.left_out:
            log.warning("%s: %s", table_key, note)
        changes += layout.left_out
    return changes


def apply_layout(
    table: Table, table_key: str, config: TableConfig, columns: Sequence[SourceColumn] | None = None
) -> list[str]:
    """Commit :func:`follow_layout` when it changes anything (retrying when another commit came
    first); returns what changed. Cheap when nothing does: no commit, no catalog read."""
    attempts = 0

    def commit() -> list[str]:
        nonlocal attempts
        if attempts:
            table.refresh()
        attempts += 1
        transaction = open_transaction(table)
        changes = follow_layout(transaction, table_key, config, columns)
        if changes:
            transaction.commit_transaction()
        return changes

    return commit_with_retry(commit)


def sorted_rows(metadata: TableMetadata, rows: pa.Table) -> pa.Table:
    """``rows`` in the table's sort order (unchanged for an unsorted table). Spark sorts what it writes
    by itself; what pyiceberg writes (snapshot chunks, appended batches) is sorted here, in C, a
    fraction of encoding it."""
    order = metadata.sort_order()
    if not order.fields:
        return rows
    schema = metadata.schema()
    keys = [
        (
            schema.find_column_name(sort_field.source_id),
            "descending" if sort_field.direction == SortDirection.DESC else "ascending",
            "at_start" if sort_field.null_order == NullOrder.NULLS_FIRST else "at_end",
        )
        for sort_field in order.fields
    ]
    return rows.sort_by(keys)
