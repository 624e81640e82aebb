"""Change metadata values of the rows a merge or a snapshot writes (see iceberg.change_metadata).

A merged row takes the commit LSN and source commit time of its last change in the batch, and the
batch's merge time; a row the snapshot copies takes the snapshot's LSN, no commit time (the copy
cannot tell when the row last changed) and the time it was read.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc

from ..iceberg.change_metadata import DeletionColumns, MetadataColumns
from ..staging.codec import DELETE
from .spark_sql import OP_COLUMN

LSN_TYPE = pa.int64()
TIME_TYPE = pa.timestamp("us", tz="UTC")


def without_fields(schema: pa.Schema, names: Sequence[str]) -> pa.Schema:
    """``schema`` without the fields named ``names`` (the columns the source does not fill)."""
    return pa.schema([field for field in schema if field.name not in names])


def stamp_merged(
    rows: pa.Table,
    columns: MetadataColumns | None,
    deletion: DeletionColumns | None,
    commit_lsns: pa.Array,
    committed_at: pa.Array,
) -> pa.Table:
    """``rows`` (folded, one per key) with the change metadata columns appended: each row's commit LSN
    and commit time (arrays in row order), and now as the merge time; and with the deletion columns:
    a delete's commit time and LSN, NULL on an upsert (which revives a soft-deleted row)."""
    if columns is not None:
        merged_at = pa.repeat(pa.scalar(datetime.now(UTC), TIME_TYPE), rows.num_rows)
        rows = (
            rows.append_column(pa.field(columns.lsn, LSN_TYPE), commit_lsns.cast(LSN_TYPE))
            .append_column(pa.field(columns.committed_at, TIME_TYPE), committed_at.cast(TIME_TYPE))
            .append_column(pa.field(columns.merged_at, TIME_TYPE), merged_at)
        )
    if deletion is not None:
        is_delete = pc.equal(rows.column(OP_COLUMN), DELETE)
        for name, values, kind in (
            (deletion.deleted_at, committed_at, TIME_TYPE),
            (deletion.deleted_lsn, commit_lsns, LSN_TYPE),
        ):
            marked = pc.if_else(is_delete, values.cast(kind), pa.nulls(rows.num_rows, kind))
            rows = rows.append_column(pa.field(name, kind), marked)
    return rows


def stamp_snapshot(rows: pa.Table, columns: MetadataColumns | None, snapshot_lsn: int) -> pa.Table:
    """A snapshot chunk's ``rows`` (their metadata columns null) with the snapshot's LSN and the time
    of the copy set; the commit time stays null."""
    if columns is None:
        return rows
    count = rows.num_rows
    values = {
        columns.lsn: pa.repeat(pa.scalar(snapshot_lsn, LSN_TYPE), count),
        columns.merged_at: pa.repeat(pa.scalar(datetime.now(UTC), TIME_TYPE), count),
    }
    for name, array in values.items():
        index = rows.schema.get_field_index(name)
        rows = rows.set_column(index, rows.schema.field(index), array.cast(rows.schema.field(index).type))
    return rows
