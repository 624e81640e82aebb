"""An online resync of one table: a fresh consistent copy while every other table keeps streaming,
switched in one Iceberg commit.

For what the WAL cannot follow (a type Iceberg cannot evolve into, a rewrite that changed older rows
with no WAL change). Four steps, each safe to crash in:

1. **Request** (``tables.resync_reason``, set under the table's writer lease): merges of the table
   wait from then on; its changes keep staging, and readers keep seeing the table as it was.
2. **Copy**: a new exported snapshot (a new epoch, recorded before anything is read), CTID chunks
   read in parallel under it, their data files written for the *rebuilt* schema (the source's
   columns as they are now) and held by this process: nothing is committed.
3. **Switch**: one Iceberg commit holds the new schema, the deletion of every old data file and the
   copy's files (its summary names the epoch). A reader sees the old table or the new one.
4. **Finish**: the table's epoch becomes the copy's, and merges resume from their cursor, skipping
   the transactions that snapshot shows (as after the initial snapshot).

A crash before the switch leaves the copy's files unreferenced (orphans) and the next resync starts
over in a new epoch; a crash between switch and finish is recognised by the epoch in the summary.
Every change at or below the cursor was merged before the request, so the copy's snapshot, taken
after it, shows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io import FileIO
from pyiceberg.table import Transaction

from ..config import PipelineConfig
from ..coordination.protocol import LEASE_WAIT_SECONDS, writer_lease_within
from ..coordination.records import Chunk
from ..coordination.store import CoordinationStore
from ..errors import Pg2IcebergError
from ..faults import crash_point
from ..iceberg.catalog import epoch_committed
from ..iceberg.change_metadata import metadata_columns
from ..iceberg.evolution import rebuild_schema
from ..iceberg.layout import follow_layout
from ..iceberg.types import arrow_schema
from ..materializer.change_stamp import stamp_snapshot
from ..source.catalog import SourceTable, source_files_seen_by
from ..source.connection import connect
from ..tables import MirroredTable
from .chunks import WrittenChunk, plan_table_chunks, read_chunk, write_chunk
from .holder import SnapshotHolder
from .stages import run_chunks

RESYNC_EPOCH = "pg2iceberg.resync-epoch"  # in the switch commit's summary: the epoch of its copy


@dataclass
class ResyncResult:
    """What one resync did (also the Dagster metadata)."""

    table: str
    reason: str = ""
    epoch: int | None = None
    rows: int = 0
    chunks: int = 0
    schema_changes: tuple[str, ...] = ()
    snapshot_id: int | None = None
    seconds: float = 0.0


def request_resync(store: CoordinationStore, group: str, table_key: str, reason: str, worker_id: str) -> None:
    """Step 1: record the request under the table's writer lease, waiting for a merge in progress to
    end (a merge that already holds the lease must not run past the request)."""
    with writer_lease_within(store, group, table_key, worker_id, LEASE_WAIT_SECONDS):
        store.request_resync(table_key, reason)


def resync_table(
    config: PipelineConfig,
    mirrored: MirroredTable,
    store: CoordinationStore,
    catalog: Catalog,
    source: SourceTable,
    worker_id: str,
    reason: str = "requested",
    on_chunk: Callable[[Chunk, int], None] | None = None,
) -> ResyncResult:
    """Resync ``source`` (described as it is now) online; see the module docstring. A resync already
    requested (by the materializer) or interrupted is carried out; else one is requested first."""
    started = time.monotonic()
    key = source.key
    state = store.table_state(key)
    if state is None or not state.snapshot_complete:
        raise Pg2IcebergError(
            f"{key}: its initial snapshot is not complete, so there is nothing to resync; run the snapshot"
        )
    if state.resync_reason is None:
        request_resync(store, config.materialize.group, key, reason, worker_id)
    result = ResyncResult(key, reason=state.resync_reason or reason)
    identifier = mirrored.iceberg
    table = catalog.load_table(identifier)
    if state.resync_epoch is not None and epoch_committed(table, RESYNC_EPOCH, state.resync_epoch):
        store.finish_resync(key, state.resync_epoch)  # switched just before a crash
        result.epoch = state.resync_epoch
        return result
    with SnapshotHolder(config, store, create_slot=False) as holder:
        result.epoch = holder.advertised.epoch
        store.start_resync_copy(key, result.epoch)
        files = source_files_seen_by(config.source, source, holder.advertised.name)
        transaction, changes = rebuild_schema(table, key, source.columns, source.primary_key, files)
        # The copy is written with the spec the switch commits: the configured one, on the new fields.
        changes += follow_layout(transaction, key, mirrored.config, source.columns)
        result.schema_changes = tuple(changes)
        lsn_bound = store.snapshot_epoch(result.epoch).lsn_bound
        metadata = metadata_columns(table)

        def stamp(rows: pa.Table) -> pa.Table:
            return stamp_snapshot(rows, metadata, lsn_bound)  # as the first snapshot's rows

        written = _copy(config, source, transaction, table.io, holder.advertised.name, on_chunk, stamp)
    crash_point("resync.before_switch")
    result.rows, result.chunks = sum(w.rows for w in written), len(written)
    result.snapshot_id = _switch(transaction, written, result.epoch, key)
    crash_point("resync.after_switch")
    store.finish_resync(key, result.epoch)
    result.seconds = time.monotonic() - started
    return result


def _copy(
    config: PipelineConfig,
    source: SourceTable,
    transaction: Transaction,
    io: FileIO,
    snapshot_name: str,
    on_chunk: Callable[[Chunk, int], None] | None,
    stamp: Callable[[pa.Table], pa.Table],
) -> list[WrittenChunk]:
    """Step 2: read every chunk of the table under ``snapshot_name`` and write it as data files of the
    rebuilt schema (change metadata set by ``stamp``); returns them, committed nowhere."""
    metadata = transaction.table_metadata
    schema = arrow_schema(metadata.schema())
    with connect(config.source) as conn:
        chunks = plan_table_chunks(conn, source, config.snapshot.chunk_pages)
    written: list[WrittenChunk] = []

    def keep(_table: SourceTable, batch: list[WrittenChunk]) -> list[tuple[Chunk, int]]:
        written.extend(batch)
        return [(w.chunk, w.rows) for w in batch]

    rule = config.values.out_of_range
    for chunk, rows in run_chunks(
        config.source,
        [(source, chunk) for chunk in chunks],
        read=lambda reader, table, chunk: stamp(read_chunk(reader, table, chunk, schema, snapshot_name, rule)),
        write=lambda _table, chunk, rows: write_chunk(metadata, io, chunk, rows),
        commit=keep,
        parallelism=config.snapshot.parallelism,
        committers=1,  # keep() only collects
        min_commit_interval=0.0,  # nothing is committed: every written chunk is kept at once
    ):
        if on_chunk:
            on_chunk(chunk, rows)
    return written


def _switch(transaction: Transaction, written: list[WrittenChunk], epoch: int, key: str) -> int | None:
    """Step 3: one commit with the rebuilt schema, no old row, and the copy's files."""
    properties = {RESYNC_EPOCH: str(epoch)}
    if transaction.table_metadata.current_snapshot() is not None:
        transaction.delete(AlwaysTrue(), snapshot_properties=properties)
    files = [data_file for w in written for data_file in w.files]
    if files:
        with transaction.update_snapshot(snapshot_properties=properties).fast_append() as append:
            for data_file in files:
                append.append_data_file(data_file)
    try:
        table = transaction.commit_transaction()
    except CommitFailedException as exc:
        raise Pg2IcebergError(
            f"{key}: the Iceberg table changed while it was resynced ({exc}); nothing was switched. Run "
            f"`pg2iceberg-dagster resync --table {key}` again"
        ) from None
    snapshot = table.current_snapshot()
    return snapshot.snapshot_id if snapshot else None
