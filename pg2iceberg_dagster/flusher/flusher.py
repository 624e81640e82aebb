"""The WAL flusher: pgoutput changes -> staged Parquet files -> one registering transaction -> slot ack.

Order of durability for each flush (DESIGN.md rule 4): upload the files, register them together
with the new ``flushed_lsn`` in one coordination transaction, and only then acknowledge the slot.
A restart streams from the recorded ``flushed_lsn`` and skips commits at or below it, so a crash at
any point neither loses nor duplicates a transaction (unregistered uploads are orphans that
``cleanup`` removes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import pyarrow as pa

from ..config import PipelineConfig
from ..coordination.protocol import StagedLogStore
from ..coordination.records import StagedFile
from ..errors import StartupCheckError
from ..faults import armed, crash_point
from ..source import pgoutput
from ..source.catalog import (
    SourceTable,
    TypeResolver,
    column_policy,
    file_node,
    identify_columns,
    masked_column,
    source_column,
    table_attributes,
)
from ..source.connection import connect
from ..source.lsn import current_wal_lsn
from ..source.publication_policy import listed_attnums
from ..source.replication import XLOG_HEADER, ReplicationStream, xlog_data_start
from ..staging.codec import StagedRelation
from ..staging.store import ObjectStore
from ..tables import MirroredTables
from .batch import RelationInfo, truncate_marker
from .generated import GeneratedValues, describe_generated
from .moved_in import MovedInValues
from .priority import FlushFirst
from .window import RelationLog, StagedWriter

log = logging.getLogger(__name__)

_ROW_TAGS = frozenset(b"IUD")
_BEGIN, _COMMIT = ord("B"), ord("C")


@dataclass
class FlushStats:
    """What a run of the flusher did."""

    transactions: int = 0
    changes: int = 0
    files: int = 0
    bytes: int = 0
    flushes: int = 0
    flushed_lsn: int = 0
    rows_by_table: dict[str, int] = field(default_factory=dict)
    # CPU seconds this process spent decoding, encoding and uploading staged files (the rest of its
    # time goes to receiving and buffering the stream, and to registering).
    stage_seconds: float = 0.0


@dataclass(slots=True)
class _RunState:
    """The state of one :meth:`Flusher.run`: its stream, limits and staged writer, and where it stands."""

    stream: ReplicationStream
    writer: StagedWriter
    relations: RelationLog
    stats: FlushStats
    stop: threading.Event
    deadline: float | None  # time.monotonic() at which the time budget ends
    target: int | None  # until_caught_up: the WAL position to flush
    on_flush: Callable[[FlushStats], None] | None
    last_flush: float  # time.monotonic() of the last flush (or of the start)
    merge_idle: threading.Event | None  # set while a merge would start on the next flush (``run``)
    flush_first: FlushFirst | None  # merges in this process wait while a flush is written (``run``)
    in_transaction: bool = False
    commit_ts: int = 0  # of the open transaction, in Unix microseconds
    xid: int = 0  # of the open transaction
    pending_end_lsn: int | None = None  # end of the last commit staged but not registered and acked
    last_idle_ack: float = 0.0
    stopping: bool = False  # a commit reached the deadline or target: flush it and return
    finishing: bool = False  # stop was requested or the time budget spent when the batch came: its next commit ends


def _count_flush(stats: FlushStats, files: list[StagedFile]) -> None:
    """Add one flush and its registered files to ``stats``."""
    stats.flushes += 1
    stats.files += len(files)
    stats.bytes += sum(f.byte_size for f in files)
    for staged in files:
        stats.changes += staged.row_count
        stats.rows_by_table[staged.table_name] = stats.rows_by_table.get(staged.table_name, 0) + staged.row_count


class Flusher:
    """Streams the slot into the staged log. One instance per process; the slot admits one consumer."""

    def __init__(
        self,
        config: PipelineConfig,
        store: StagedLogStore,
        objects: ObjectStore,
        mirrored: MirroredTables,
        tables: dict[str, SourceTable],
    ) -> None:
        """``tables``: the configured tables as the source describes them (the startup report's)."""
        self.config = config
        self.store = store
        self.tables = tables
        self._by_oid = {table.oid: table for table in tables.values()}
        self.object_store = objects
        self._locations = {key: table.staging for key, table in mirrored.items()}
        self._catalog_conn = connect(config.source)
        self._resolver = TypeResolver(self._catalog_conn)
        self._generated = GeneratedValues(self._catalog_conn)
        self._moved_in = MovedInValues(self._catalog_conn)

    def close(self) -> None:
        self._catalog_conn.close()

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        until_caught_up: bool = False,
        max_seconds: float | None = None,
        on_flush: Callable[[FlushStats], None] | None = None,
        merge_idle: threading.Event | None = None,
        flush_first: FlushFirst | None = None,
    ) -> FlushStats:
        """Stream until ``stop`` is set, the time budget ends, or (``until_caught_up``) the WAL position
        at the start has been flushed. Everything received and committed is flushed before returning.

        ``merge_idle``, set by a materializer while it waits for the next flush, lets committed changes
        be flushed ``flush.min_interval_seconds`` after the previous flush instead of
        ``flush.interval_seconds`` (see :meth:`_flush_due`). ``flush_first``: held while each flush
        is written, for the merges of this process to wait (see :mod:`.priority`)."""
        stop = stop or threading.Event()
        start_lsn = self.store.flushed_lsn()
        if start_lsn is None:
            raise StartupCheckError(
                "nothing to stream yet: the replication slot is created by the first snapshot; run "
                "`pg2iceberg-dagster snapshot` (or `run`, which starts with it) first"
            )
        target = current_wal_lsn(self._catalog_conn) if until_caught_up else None
        deadline = time.monotonic() + max_seconds if max_seconds is not None else None
        stats = FlushStats(flushed_lsn=start_lsn)
        relations = RelationLog()
        writer = StagedWriter(self.object_store, self.config.flush, relations, self._locations, self._complete_rows)
        last_flush = time.monotonic()
        with ReplicationStream(
            self.config.source,
            self.config.replication.slot,
            self.config.replication.publication,
            start_lsn,
            self.config.replication.status_interval_seconds,
        ) as stream:
            run = _RunState(
                stream=stream,
                writer=writer,
                relations=relations,
                stats=stats,
                stop=stop,
                deadline=deadline,
                target=target,
                on_flush=on_flush,
                last_flush=last_flush,
                merge_idle=merge_idle,
                flush_first=flush_first,
            )
            try:
                self._stream(run)
                self._flush(run)
            finally:
                writer.close()  # drops a spill file (a failed run must not keep its disk space)
        return stats

    def _stream(self, run: _RunState) -> None:
        """Read and stage batches of messages until the run is done; the last commit may be unflushed."""
        while not run.stopping:
            now = time.monotonic()
            if not run.in_transaction and (self._finished(run, now) or self._caught_up(run)):
                break
            if self._flush_due(run, now):
                self._flush(run)  # also inside a long transaction: what committed before it is due
            # Catching up, a short silence after transactions came means the end is reached: find
            # out at once (a keepalive tells where the server is) instead of idling half a second.
            quick = run.target is not None and not run.in_transaction and run.stats.transactions > 0
            messages = run.stream.read_batch(0.05 if quick else 0.5)
            if not messages:
                self._on_silence(run)
                continue
            # Once per batch, not per commit: a batch is read in milliseconds, and per commit, this and
            # the flush's time bounds cost about 1 us (0.25 us a TPC-B change).
            run.finishing = self._finished(run, time.monotonic())
            self._consume(run, messages)
            run.writer.bound()  # the open transaction spills past txn_memory_bytes

    def _consume(self, run: _RunState, messages: list[bytes]) -> None:
        """Stage one batch of WAL data messages; stops early (``run.stopping``) at a commit that ends the run.

        Messages after that commit in the batch are dropped unacknowledged: the next run receives them again.
        """
        # Locals for the per-message loop: it runs hundreds of thousands of times a second.
        data, ends = run.writer.pending
        extend, end, header, row_tags = data.extend, ends.append, XLOG_HEADER, _ROW_TAGS
        crash = armed("flusher.mid_transaction")
        for message in messages:
            tag = message[header]
            if tag in row_tags:
                extend(message)  # kept as received: decoded in bulk when staged
                end(len(data))
                if crash:
                    crash_point("flusher.mid_transaction")
            elif tag == _BEGIN:
                _, run.commit_ts, run.xid = pgoutput.begin_fields(message, XLOG_HEADER)
                run.in_transaction = True
            elif tag == _COMMIT:
                self._commit(run, message)
                if run.stopping:
                    return
            else:
                self._describe(run, message)

    def _commit(self, run: _RunState, message: bytes) -> None:
        """End the open transaction: stage it (unless a run before this one registered it already), and
        mark the run as stopping if this commit reaches its deadline or target, or flush if the staged
        rows reached their bound (the time bounds are looked at once per batch, in :meth:`_stream`)."""
        run.in_transaction = False
        end_lsn = pgoutput.commit_end_lsn(message, XLOG_HEADER)
        if end_lsn <= run.stats.flushed_lsn:
            run.writer.discard()  # registered before a restart: already in the staged log
            return
        run.writer.commit(run.commit_ts, run.xid, end_lsn)
        run.stats.transactions += 1
        run.pending_end_lsn = end_lsn
        if run.finishing or (run.target is not None and end_lsn >= run.target):
            run.stopping = True
        elif run.writer.full:
            self._flush(run)  # here, not after the batch: a file per table holds max_rows, not a few more

    def _describe(self, run: _RunState, message: bytes) -> None:
        """Handle a message other than a row change, Begin or Commit: a Relation describes a table's
        columns from the next row on; a Truncate becomes one marker row per truncated table."""
        decoded = pgoutput.decode(message[XLOG_HEADER:])
        if isinstance(decoded, pgoutput.Relation):
            run.relations.describe(decoded.oid, run.writer.next_seq, self._relation_info(decoded))
        elif isinstance(decoded, pgoutput.Truncate):
            lsn = xlog_data_start(message)
            for oid in decoded.relation_oids:
                run.writer.add(truncate_marker(lsn, oid))
                crash_point("flusher.mid_transaction")

    def _on_silence(self, run: _RunState) -> None:
        """Nothing arrived: between transactions, flush what committed, then keep the slot moving."""
        now = time.monotonic()
        if run.in_transaction:
            return
        if run.pending_end_lsn is not None:
            self._flush(run)
        if run.pending_end_lsn is None:
            self._advance_idle(run, now)

    def _advance_idle(self, run: _RunState, now: float) -> None:
        """Nothing left to flush: record and acknowledge the server's WAL end, so a quiet publication
        does not pin WAL (at once when catching up, else once per flush interval); when catching up and
        already there, ask for a keepalive to learn where the server is."""
        stream, stats = run.stream, run.stats
        if stream.server_wal_end > stats.flushed_lsn and (
            run.target is not None or now - run.last_idle_ack >= self.config.flush.interval_seconds
        ):
            self.store.record_flushed_lsn(stream.server_wal_end)
            stream.ack(stream.server_wal_end)
            stats.flushed_lsn = stream.server_wal_end
            run.last_idle_ack = now
        elif run.target is not None:
            stream.request_keepalive()

    def _flush(self, run: _RunState) -> None:
        """Upload the committed rows, register the files with the last commit's end LSN, then ack it."""
        if run.pending_end_lsn is None:
            return
        end_lsn = run.pending_end_lsn
        with run.flush_first.flushing() if run.flush_first is not None else nullcontext():
            files = run.writer.finish()
            crash_point("flusher.after_upload")
            self.store.register_flush(files, end_lsn)
        crash_point("flusher.after_register")
        run.stream.ack(end_lsn)
        _count_flush(run.stats, files)
        run.stats.flushed_lsn = end_lsn
        run.stats.stage_seconds = run.writer.stage_seconds
        run.writer.reset()
        run.pending_end_lsn = None
        run.last_flush = time.monotonic()
        if run.on_flush:
            run.on_flush(run.stats)

    def _flush_due(self, run: _RunState, now: float) -> bool:
        """A commit waits and the staged rows, bytes or time since the last flush reached their bound.

        The time bound is ``interval_seconds``, or only ``min_interval_seconds`` while the materializer
        is idle (``merge_idle``): a flush then becomes visible after one merge instead of waiting for
        the interval. While a merge runs, commits gather until it ends (fewer, bigger merges when
        merges are slow); ``min_interval_seconds`` caps the flushes, and so the staged files and
        Iceberg commits, an idle materializer causes."""
        flush = self.config.flush
        if run.pending_end_lsn is None:
            return False
        waited = now - run.last_flush
        idle = run.merge_idle is not None and run.merge_idle.is_set()
        return run.writer.full or waited >= flush.interval_seconds or (idle and waited >= flush.min_interval_seconds)

    @staticmethod
    def _finished(run: _RunState, now: float) -> bool:
        """Stop was requested or the time budget is spent."""
        return run.stop.is_set() or (run.deadline is not None and now >= run.deadline)

    @staticmethod
    def _caught_up(run: _RunState) -> bool:
        """Catching up, and the WAL position at the start is flushed."""
        return run.target is not None and run.stats.flushed_lsn >= run.target

    def _complete_rows(self, info: RelationInfo, columns: list[pa.Array]) -> list[pa.Array]:
        """Values the stream did not send: of rows moved into a row filter, then of generated columns."""
        if info.table.row_filter:
            columns = self._moved_in.fill(info, columns)
        if info.generated is not None:
            columns = self._generated.complete(info.generated, columns)
        return columns

    def _relation_info(self, relation: pgoutput.Relation) -> RelationInfo | None:
        # By oid first: a table renamed at the source (ALTER TABLE ... RENAME TO) sends its changes
        # under its new name, and they are still its changes. By name, a table dropped and created
        # again (another oid), which the next startup refuses.
        table = self._by_oid.get(relation.oid) or self.tables.get(relation.key)
        if table is None:
            return None  # published but not configured: ignored
        if relation.key != table.key:
            log.warning(
                "%s was renamed to %s at the source; its changes are still staged as %s's. Rename it back, or "
                "mirror it under its new name (name it in the config, then `cleanup --table %s` and `snapshot`): "
                "the next start refuses the old name",
                table.key,
                relation.key,
                table.key,
                table.key,
            )
        # The message names the columns; the catalog gives each its identity (attnum, which a RENAME
        # keeps) and the value older rows read for a column added with a DEFAULT.
        attributes = table_attributes(self._catalog_conn, relation.oid)
        listed = listed_attnums(table, self._catalog_conn.info.server_version)
        identities = identify_columns(attributes, [(c.name, c.type_oid) for c in relation.columns], listed)
        names = {a.attnum: column.name for a, column in zip(identities, relation.columns, strict=True) if a is not None}
        key = tuple(names.get(table.column(name).attnum or 0, name) for name in table.primary_key)
        columns = tuple(
            source_column(
                column.name,
                self._resolver.resolve(column.type_oid, column.type_mod, identity.dimensions if identity else 0),
                column.name in key,
                identity,
            )
            for column, identity in zip(relation.columns, identities, strict=True)
        )
        staged_positions, masks = column_policy(table, [c.name for c in relation.columns], identities)
        columns = tuple(masked_column(column, masks[i]) if i in masks else column for i, column in enumerate(columns))
        # Generated columns the message lacks are computed for each row image (see .generated).
        wire_names = [column.name for column in relation.columns]
        generated = describe_generated(
            self._catalog_conn, table, attributes, identities, wire_names, key, self._resolver
        )
        # A replica identity changed since startup (USING INDEX without the key, NOTHING) leaves the key
        # out of deletes: staged as they come, the merge then asks for a resync (see materializer.merge).
        flagged = {column.name for column in relation.columns if column.is_key}
        unkeyed = () if relation.replica_identity == "f" else tuple(name for name in key if name not in flagged)
        return RelationInfo(
            table=table,
            relation=StagedRelation(table.key, columns, file_node(self._catalog_conn, relation.oid), unkeyed, key),
            positions={name: index for index, name in enumerate(wire_names)},
            key=key,
            generated=generated,
            staged_positions=staged_positions,
            masks=masks,
        )
