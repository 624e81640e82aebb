"""Planning CTID page chunks, reading one chunk, writing its data files, and committing them to
Iceberg exactly once per snapshot epoch."""

from __future__ import annotations

import json
from dataclasses import dataclass

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import _dataframe_to_data_files  # pyiceberg is pinned; append() writes with it too
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata

from ..config import OutOfRange
from ..coordination.records import Chunk
from ..iceberg.catalog import refresh, snapshot_summaries
from ..iceberg.commit import commit_with_retry
from ..iceberg.evolution import no_pending_fills, source_files_properties
from ..iceberg.layout import sorted_rows
from ..iceberg.transaction import open_transaction
from ..iceberg.types import arrow_schema
from ..iceberg.values import null_key_refusal, null_key_rows
from ..source.catalog import SourceFiles, SourceTable, table_pages
from ..source.partitions import leaves
from .reader import ArrowReader, conform, select_expressions

MIN_CTID_RANGE_VERSION = 140000
CHUNK_MARKERS = "pg2iceberg.snapshot-chunks"  # a JSON list: the chunks one commit wrote
CHUNK_EPOCH = "pg2iceberg.snapshot-epoch"  # the snapshot epoch they were read in
RESTART_EPOCH = "pg2iceberg.snapshot-restart-epoch"  # the table emptied to start again in this epoch


def plan_chunks(
    table_name: str,
    pages: int,
    chunk_pages: int,
    server_version: int,
    first: int = 0,
    leaf: tuple[str, str] | None = None,
) -> list[Chunk]:
    """CTID ranges of ``chunk_pages`` pages covering ``pages`` (of the ``leaf`` partition, when
    given), numbered from ``first``; the last one is open-ended.

    Before PostgreSQL 14 a ctid range is a full scan, so the table is one chunk.
    """
    if server_version < MIN_CTID_RANGE_VERSION or pages <= chunk_pages:
        return [Chunk(table_name, first, 0, None, leaf=leaf)]
    count = -(-pages // chunk_pages)
    return [
        Chunk(
            table_name,
            first + index,
            index * chunk_pages,
            (index + 1) * chunk_pages if index < count - 1 else None,
            leaf=leaf,
        )
        for index in range(count)
    ]


def plan_table_chunks(conn: psycopg.Connection, source: SourceTable, chunk_pages: int) -> list[Chunk]:
    """The chunks of a table: its own pages, or a partitioned table's leaves' pages, one leaf after
    another (the leaves now: one attached or detached since the snapshot is found by the merge's
    check of the leaves the snapshot saw, see source.partitions)."""
    version = conn.info.server_version
    if not source.partitioned:
        return plan_chunks(source.key, table_pages(conn, source.oid), chunk_pages, version)
    chunks: list[Chunk] = []
    for leaf in leaves(conn, source.oid):
        pages = table_pages(conn, leaf.oid)
        chunks += plan_chunks(source.key, pages, chunk_pages, version, len(chunks), (leaf.schema_name, leaf.table_name))
    return chunks


def chunk_query(source: SourceTable, chunk: Chunk, rule: OutOfRange) -> sql.Composed:
    """The chunk's ``SELECT`` (from its leaf partition, for a partitioned table), a CTID range that
    runs as a TID Range Scan on PG 14+."""
    conditions: list[sql.Composable] = []
    if chunk.start_page or chunk.end_page is not None:
        conditions.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({chunk.start_page},0)")))
    if chunk.end_page is not None:
        conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({chunk.end_page},0)")))
    if source.row_filter:
        conditions.append(source.row_filter_sql())  # the publication's row filter: the same rows
    where = sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true")
    # ONLY: the table's own rows, not those of tables that INHERIT from it (see SourceTable.rows_sql).
    relation = sql.SQL("ONLY {}").format(sql.Identifier(*chunk.leaf)) if chunk.leaf else source.rows_sql()
    return sql.SQL("SELECT {} FROM {} WHERE {}").format(select_expressions(source, rule), relation, where)


def read_chunk(
    reader: ArrowReader,
    source: SourceTable,
    chunk: Chunk,
    schema: pa.Schema,
    snapshot_name: str | None,
    rule: OutOfRange,
) -> pa.Table:
    """Read a chunk as ``schema`` under the exported snapshot ``snapshot_name`` (None: a snapshot of its
    own, for tools; the snapshot always passes one), values Iceberg cannot hold mapped by ``rule``."""
    rows = conform(reader.read(chunk_query(source, chunk, rule), snapshot_name), source, schema, rule)
    if rows.num_rows:
        keyless = pc.sum(null_key_rows(rows, source.primary_key)).as_py() or 0
        if keyless:
            raise null_key_refusal(source.key, source.primary_key, keyless)
    return rows


def chunk_marker(chunk: Chunk) -> str:
    return f"{chunk.table_name}#{chunk.index}"


def committed_chunk_markers(table: Table, epoch: int) -> set[str]:
    """Chunks read in ``epoch`` whose rows are already in ``table`` (markers ride in the commit's
    snapshot summary with their epoch; an epoch's markers all follow the table's restart into it)."""
    committed: set[str] = set()
    for summary in snapshot_summaries(table):
        if summary.get(CHUNK_EPOCH) == str(epoch) and CHUNK_MARKERS in summary:
            committed.update(json.loads(summary[CHUNK_MARKERS]))
    return committed


@dataclass(frozen=True)
class WrittenChunk:
    """A chunk ready to commit: its Parquet data files, in no Iceberg snapshot yet."""

    chunk: Chunk
    rows: int
    files: tuple[DataFile, ...] = ()


def write_chunk(metadata: TableMetadata, io: FileIO, chunk: Chunk, rows: pa.Table) -> WrittenChunk:
    """Write a chunk's rows as data files of the table ``metadata`` describes (in no snapshot until
    :func:`commit_chunks`, or a resync's switch, adds them).

    Writing files apart from committing lets the chunk's memory go as soon as it is encoded, and
    lets one commit take every chunk written meanwhile.
    """
    if rows.num_rows == 0:
        return WrittenChunk(chunk, 0)
    # pyiceberg splits the rows by the table's partition spec (pyiceberg-core computes the transforms)
    # and keeps their order within each partition: sorted here, each file is sorted.
    files = tuple(_dataframe_to_data_files(table_metadata=metadata, df=sorted_rows(metadata, rows), io=io))
    return WrittenChunk(chunk, rows.num_rows, files=files)


def commit_chunks(table: Table, chunks: list[WrittenChunk], epoch: int) -> int | None:
    """Append written chunks of one epoch to Iceberg in one commit (skipping those an earlier commit
    already holds); returns the table's snapshot id afterwards.

    Chunks of one epoch are disjoint reads of one snapshot, so their files are appended; the chunk
    markers in the same commit make a re-run after a crash a no-op. One commit for several chunks:
    each commit rewrites the table metadata, so committing chunks as they pile up costs a fraction
    of committing each.
    """

    def commit() -> int | None:
        # Looked at under the table's lock before the markers are: pyiceberg retries an append that
        # found the table moved on the table read again, without looking at the markers.
        refresh(table)
        committed = committed_chunk_markers(table, epoch)
        todo = [written for written in chunks if chunk_marker(written.chunk) not in committed]
        if todo:
            properties = {CHUNK_MARKERS: json.dumps([chunk_marker(w.chunk) for w in todo]), CHUNK_EPOCH: str(epoch)}
            with (
                open_transaction(table) as transaction,
                transaction.update_snapshot(snapshot_properties=properties).fast_append() as append,
            ):
                for written in todo:
                    for data_file in written.files:
                        append.append_data_file(data_file)
        snapshot = table.current_snapshot()
        return snapshot.snapshot_id if snapshot else None

    return commit_with_retry(commit)


def epoch_properties(files: SourceFiles) -> dict[str, str]:
    """The properties of a table whose snapshot starts in an epoch whose snapshot sees the source's
    ``files``: those files, and no pending fill (every row is read again with its columns)."""
    return {**no_pending_fills(), **source_files_properties(files)}


def empty_for_epoch(table: Table, epoch: int, files: SourceFiles, current: bool = False) -> None:
    """Delete every row of ``table`` before its snapshot starts (again) in ``epoch``, whose snapshot
    sees the source's ``files``. Defaults of added columns pending for the deleted rows go with
    them: every row is read again with its columns. A table already empty with the
    :func:`epoch_properties` (created so for this epoch) takes no commit. ``current``: ``table`` is
    as the catalog holds it (no writer can have committed since it was loaded), so the first
    attempt does not reload it."""
    reload = not current

    def commit() -> None:
        nonlocal reload
        if reload:
            table.refresh()
        reload = True  # a retry follows another writer's commit
        properties = epoch_properties(files)
        if table.current_snapshot() is None and all(table.properties.get(k) == v for k, v in properties.items()):
            return
        with open_transaction(table) as transaction:
            if table.current_snapshot() is not None:
                transaction.delete(AlwaysTrue(), snapshot_properties={RESTART_EPOCH: str(epoch)})
            transaction.set_properties(properties)

    commit_with_retry(commit)


def arrow_schema_for(table: Table) -> pa.Schema:
    """The Arrow schema chunks are written with (the Iceberg table's current schema)."""
    return arrow_schema(table.schema())
