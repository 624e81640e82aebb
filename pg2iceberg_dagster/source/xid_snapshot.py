"""Which transactions a PostgreSQL snapshot sees, for the staged changes of a table read under it.

A table whose rows were read under snapshot S already holds the effect of every transaction S sees;
replaying exactly the others, in log order, takes it to the source's current state. A snapshot is
``xmin:xmax:xip`` (``pg_current_snapshot()``, 64-bit transaction ids): a transaction is visible when
its id is below ``xmin``, or below ``xmax`` and not in ``xip``. Staged changes carry pgoutput's 32-bit
id, widened here to 64 bits by the epoch nearest the snapshot (every streamed transaction is within
2^31 of it: PostgreSQL's wraparound protection guarantees that much).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from ..errors import SnapshotGoneError
from .connection import consistent_read

_WRAP = 1 << 32
_HALF = 1 << 31


@dataclass(frozen=True)
class XidSnapshot:
    xmin: int
    xmax: int
    xip: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> XidSnapshot:
        """Parse ``pg_snapshot`` text such as ``100:105:101,103``."""
        xmin, xmax, xip = text.split(":")
        return cls(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))

    def widen(self, xids: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
        """32-bit transaction ids as 64-bit ones, taking the epoch that puts each nearest ``xmax``."""
        low = pc.bit_wise_and(xids.cast(pa.int64()), _WRAP - 1)
        full = pc.add(low, self.xmax & ~(_WRAP - 1))
        full = pc.if_else(pc.greater(pc.subtract(full, self.xmax), _HALF), pc.subtract(full, _WRAP), full)
        return pc.if_else(pc.greater(pc.subtract(self.xmax, full), _HALF), pc.add(full, _WRAP), full)

    def visible(self, xids: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
        """For each 32-bit transaction id, whether this snapshot sees that (committed) transaction."""
        full = self.widen(xids)
        running = pc.is_in(full, value_set=pa.array(sorted(self.xip), pa.int64()))
        return pc.or_(pc.less(full, self.xmin), pc.and_(pc.less(full, self.xmax), pc.invert(running)))


@contextmanager
def imported_snapshot(conn: psycopg.Connection, snapshot_name: str) -> Iterator[None]:
    """A read-only transaction on ``conn`` (not in one yet) that sees exactly the exported snapshot;
    :class:`SnapshotGoneError` when its exporter has ended."""
    with consistent_read(conn):
        try:
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
        except psycopg.errors.InvalidParameterValue:  # "invalid snapshot identifier"
            raise SnapshotGoneError(
                f"the exported snapshot {snapshot_name} is gone (its holder stopped); run again to read under a new one"
            ) from None
        yield


def exported_snapshot_text(conn: psycopg.Connection, snapshot_name: str) -> str:
    """The ``pg_snapshot`` text of an exported snapshot, read by importing it (``conn`` not in a transaction)."""
    with imported_snapshot(conn, snapshot_name):
        row = conn.execute("SELECT pg_catalog.pg_current_snapshot()::text").fetchone()
    assert row is not None
    return str(row[0])
