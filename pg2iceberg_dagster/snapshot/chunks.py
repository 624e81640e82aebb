"""Planning CTID page chunks, reading one chunk, writing its data files, and committing them to
Iceberg exactly once."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
from psycopg import sql
from pyiceberg.io.pyarrow import _dataframe_to_data_files  # pyiceberg is pinned; append() writes with it too
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table

from ..coordination.store import Chunk
from ..iceberg.catalog import commit_with_retry, snapshot_summaries
from ..iceberg.types import arrow_schema
from ..source.catalog import SourceTable
from .reader import ArrowReader, conform, select_expressions

MIN_CTID_RANGE_VERSION = 140000
CHUNK_MARKER = "pg2iceberg.snapshot-chunk"
CHUNK_MARKERS = "pg2iceberg.snapshot-chunks"  # a JSON list: the chunks one commit wrote
CHUNK_READ_MODE = "pg2iceberg.snapshot-read-mode"
EXPORTED_SNAPSHOT = "exported_snapshot"
REPEATABLE_READ = "repeatable_read"


def plan_chunks(table_name: str, pages: int, chunk_pages: int, server_version: int) -> list[Chunk]:
    """CTID ranges of ``chunk_pages`` pages covering ``pages``; the last one is open-ended.

    Before PostgreSQL 14 a ctid range is a full scan, so the table is one chunk.
    """
    if server_version < MIN_CTID_RANGE_VERSION or pages <= chunk_pages:
        return [Chunk(table_name, 0, 0, None)]
    count = -(-pages // chunk_pages)
    return [
        Chunk(table_name, index, index * chunk_pages, (index + 1) * chunk_pages if index < count - 1 else None)
        for index in range(count)
    ]


def chunk_query(source: SourceTable, chunk: Chunk) -> sql.Composed:
    """The chunk's ``SELECT``, a CTID range that runs as a TID Range Scan on PG 14+."""
    conditions = [sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({chunk.start_page},0)"))]
    if chunk.end_page is not None:
        conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({chunk.end_page},0)")))
    where = sql.SQL(" AND ").join(conditions) if chunk.start_page or chunk.end_page is not None else sql.SQL("true")
    return sql.SQL("SELECT {} FROM {}.{} WHERE {}").format(
        select_expressions(source.columns), sql.Identifier(source.schema_name), sql.Identifier(source.table_name), where
    )


@dataclass(frozen=True)
class ChunkData:
    rows: pa.Table
    read_mode: str


def read_chunk(
    reader: ArrowReader, source: SourceTable, chunk: Chunk, schema: pa.Schema, snapshot_name: str | None
) -> ChunkData:
    """Read a chunk as ``schema`` under the exported snapshot (or plain REPEATABLE READ when there is none)."""
    decoded = reader.read(chunk_query(source, chunk), snapshot_name)
    return ChunkData(
        rows=conform(decoded, source, schema), read_mode=EXPORTED_SNAPSHOT if snapshot_name else REPEATABLE_READ
    )


def chunk_marker(chunk: Chunk) -> str:
    return f"{chunk.table_name}#{chunk.index}"


def committed_chunk_markers(table: Table) -> dict[str, str]:
    """Chunks whose rows are already in ``table``, with the mode they were read in (both ride in the
    snapshot summary; a marker without a mode counts as REPEATABLE READ, the mode that asks more of
    the materializer)."""
    committed: dict[str, str] = {}
    for summary in snapshot_summaries(table):
        markers = json.loads(summary[CHUNK_MARKERS]) if CHUNK_MARKERS in summary else []
        if CHUNK_MARKER in summary:  # one chunk per commit, as earlier versions wrote it
            markers.append(summary[CHUNK_MARKER])
        committed.update(dict.fromkeys(markers, summary.get(CHUNK_READ_MODE, REPEATABLE_READ)))
    return committed


@dataclass(frozen=True)
class WrittenChunk:
    """A chunk ready to commit: its Parquet data files (exported snapshot), or its rows (REPEATABLE
    READ, upserted at commit)."""

    chunk: Chunk
    read_mode: str
    rows: int
    files: tuple[DataFile, ...] = ()
    pending_rows: pa.Table | None = None


def write_chunk(table: Table, chunk: Chunk, data: ChunkData) -> WrittenChunk:
    """Write an exported-snapshot chunk's rows as data files of ``table`` (in no snapshot until
    :func:`commit_chunks`); a REPEATABLE READ chunk keeps its rows for the upsert.

    Writing files apart from committing lets the chunk's memory go as soon as it is encoded, and
    lets one commit take every chunk written meanwhile.
    """
    if data.read_mode != EXPORTED_SNAPSHOT:
        return WrittenChunk(chunk, data.read_mode, data.rows.num_rows, pending_rows=data.rows)
    if data.rows.num_rows == 0:
        return WrittenChunk(chunk, data.read_mode, 0)
    files = tuple(_dataframe_to_data_files(table_metadata=table.metadata, df=data.rows, io=table.io))
    return WrittenChunk(chunk, data.read_mode, data.rows.num_rows, files=files)


def commit_chunks(table: Table, chunks: list[WrittenChunk], primary_key: tuple[str, ...]) -> int | None:
    """Commit written chunks read in one mode to Iceberg in one commit (skipping those an earlier
    commit already holds); returns the table's snapshot id afterwards.

    Under the exported snapshot chunks are disjoint, so their files are appended; the chunk markers in
    the same commit make a re-run after a crash a no-op. Under plain REPEATABLE READ a row may already
    be there (it moved pages since an earlier chunk read it), so rows are upserted by primary key.
    One commit for several chunks: each commit rewrites the table metadata, so committing chunks as
    they pile up costs a fraction of committing each.
    """
    modes = {written.read_mode for written in chunks}
    if len(modes) != 1:
        raise ValueError(f"chunks read in different modes cannot share a commit: {sorted(modes)}")
    (read_mode,) = modes

    def commit() -> int | None:
        table.refresh()
        committed = committed_chunk_markers(table)
        todo = [written for written in chunks if chunk_marker(written.chunk) not in committed]
        if todo:
            markers = json.dumps([chunk_marker(written.chunk) for written in todo])
            properties = {CHUNK_MARKERS: markers, CHUNK_READ_MODE: read_mode}
            if read_mode == EXPORTED_SNAPSHOT:
                with (
                    table.transaction() as transaction,
                    transaction.update_snapshot(snapshot_properties=properties).fast_append() as append,
                ):
                    for written in todo:
                        for data_file in written.files:
                            append.append_data_file(data_file)
            else:
                rows = pa.concat_tables([written.pending_rows for written in todo if written.pending_rows is not None])
                if rows.num_rows:
                    table.upsert(rows, join_cols=list(primary_key), snapshot_properties=properties)
                else:
                    table.append(rows, snapshot_properties=properties)
        snapshot = table.current_snapshot()
        return snapshot.snapshot_id if snapshot else None

    return commit_with_retry(commit)


def arrow_schema_for(table: Table) -> pa.Schema:
    """The Arrow schema chunks are written with (the Iceberg table's current schema)."""
    return arrow_schema(table.schema())
