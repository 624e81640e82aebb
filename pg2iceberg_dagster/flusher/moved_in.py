"""Values of unchanged TOAST columns in rows that an UPDATE moved into a table's row filter.

With a row filter, pgoutput sends an UPDATE whose old row fails the filter and new row passes it as an
INSERT: the mirror has no such row yet. The new image still leaves unchanged TOASTed values out (only
replica identity columns are copied from the old image), and the merge would fill them from a row
Iceberg does not have. So the flusher reads them from the source row by primary key, as its text
form, and masks them like any staged value. That is a later state of the row, but every change of it
after the move comes through the WAL (the row is inside the filter) and is staged after this one, so
the mirror converges to the source; a row gone meanwhile is deleted by such a later change, and its
values are left to the merge.
"""

from __future__ import annotations

import json

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from ..staging.codec import INSERT, split_names
from .batch import RelationInfo


class MovedInValues:
    """Reads from the source the unchanged values of rows moved into a row filter (on an autocommit
    connection, so a row read by key is its latest committed state)."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn

    def fill(self, info: RelationInfo, columns: list[pa.Array]) -> list[pa.Array]:
        """The six staging columns with every INSERT's unchanged values read from the source row."""
        op, lsn, ts, xid, unchanged, data = columns
        moved = pc.indices_nonzero(pc.and_(pc.equal(op, INSERT), pc.is_valid(unchanged))).to_pylist()
        if not moved:
            return columns
        marks, images = unchanged.to_pylist(), data.to_pylist()
        for row in moved:
            image = json.loads(images[row])
            names = list(split_names(marks[row]))
            found = self._read(info, image, names)
            if found is None:
                continue  # gone since: a later change deletes it
            for name, value in zip(names, found, strict=True):
                mask = info.masks.get(info.positions[name])
                image[name] = mask.text(value) if mask is not None else value
            images[row] = json.dumps(image, separators=(",", ":"), ensure_ascii=False)
            marks[row] = None
        return [op, lsn, ts, xid, pa.array(marks, pa.string()), pa.array(images, pa.string())]

    def _read(self, info: RelationInfo, image: dict[str, str | None], names: list[str]) -> tuple | None:
        """The text form of the ``names`` columns of the source row with the image's key (None: gone)."""
        by_name = {column.name: column for column in info.relation.columns}
        values = sql.SQL(", ").join(
            sql.SQL("CASE WHEN {0} IS NULL THEN NULL ELSE pg_catalog.format('%s', {0}) END").format(
                sql.Identifier(name)
            )
            for name in names
        )
        condition = sql.SQL(" AND ").join(
            sql.SQL("{} = CAST({} AS {})").format(
                sql.Identifier(name), sql.Literal(image[name]), sql.SQL(by_name[name].type.name)
            )
            for name in info.key
        )
        table = sql.Identifier(info.table.schema_name, info.table.table_name)
        return self._conn.execute(sql.SQL("SELECT {} FROM {} WHERE {}").format(values, table, condition)).fetchone()
