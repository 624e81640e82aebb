"""The WAL flusher: pgoutput changes -> staged Parquet files -> one registering transaction -> slot ack.

Order of durability for each flush (DESIGN.md rule 4): upload the files, register them together
with the new ``flushed_lsn`` in one coordination transaction, and only then acknowledge the slot.
A restart streams from the recorded ``flushed_lsn`` and skips commits at or below it, so a crash at
any point neither loses nor duplicates a transaction (unregistered uploads are orphans that
``cleanup`` removes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import PipelineConfig
from ..coordination.store import CoordinationStore
from ..faults import crash_point
from ..source import pgoutput
from ..source.catalog import SourceColumn, SourceTable, TypeResolver
from ..source.connection import connect
from ..source.lsn import current_wal_lsn
from ..source.replication import XLOG_HEADER, ReplicationStream, xlog_data_start
from ..staging.codec import StagedRelation
from ..staging.store import ObjectStore
from .batch import RelationInfo, truncate_marker
from .window import RelationLog, StagedWriter

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


class Flusher:
    """Streams the slot into the staged log. One instance per process; the slot admits one consumer."""

    def __init__(self, config: PipelineConfig, store: CoordinationStore, tables: dict[str, SourceTable]) -> None:
        self.config = config
        self.store = store
        self.tables = tables
        self.object_store = ObjectStore(config.staging)
        self._catalog_conn = connect(config.source)
        self._resolver = TypeResolver(self._catalog_conn)

    def close(self) -> None:
        self._catalog_conn.close()

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        until_caught_up: bool = False,
        max_seconds: float | None = None,
        on_flush: Callable[[FlushStats], None] | None = None,
    ) -> FlushStats:
        """Stream until ``stop`` is set, the time budget ends, or (``until_caught_up``) the WAL position
        at the start has been flushed. Everything received and committed is flushed before returning."""
        stop = stop or threading.Event()
        start_lsn = self.store.flushed_lsn()
        if start_lsn is None:
            raise RuntimeError("no flushed_lsn recorded: the slot was not created by `snapshot` yet")
        target = current_wal_lsn(self._catalog_conn) if until_caught_up else None
        deadline = time.monotonic() + max_seconds if max_seconds is not None else None
        flush_cfg = self.config.flush
        stats = FlushStats(flushed_lsn=start_lsn)
        relations = RelationLog()
        writer = StagedWriter(self.object_store, flush_cfg, relations)
        in_transaction = False
        commit_ts = 0  # of the open transaction, in Unix microseconds
        xid = 0
        pending_end_lsn: int | None = None
        last_flush = time.monotonic()
        last_idle_ack = 0.0

        def flush() -> None:
            nonlocal pending_end_lsn, last_flush
            if pending_end_lsn is None:
                return
            files = writer.finish()
            crash_point("flusher.after_upload")
            self.store.register_flush(files, pending_end_lsn)
            crash_point("flusher.after_register")
            stream.ack(pending_end_lsn)
            stats.flushes += 1
            stats.files += len(files)
            stats.bytes += sum(f.byte_size for f in files)
            for staged in files:
                stats.changes += staged.row_count
                stats.rows_by_table[staged.table_name] = (
                    stats.rows_by_table.get(staged.table_name, 0) + staged.row_count
                )
            stats.flushed_lsn = pending_end_lsn
            stats.stage_seconds = writer.stage_seconds
            writer.reset()
            pending_end_lsn = None
            last_flush = time.monotonic()
            if on_flush:
                on_flush(stats)

        def flush_due(now: float) -> bool:
            return pending_end_lsn is not None and (
                writer.rows >= flush_cfg.max_rows
                or writer.bytes >= flush_cfg.max_bytes
                or now - last_flush >= flush_cfg.interval_seconds
            )

        def finished(now: float) -> bool:
            return stop.is_set() or (deadline is not None and now >= deadline)

        with ReplicationStream(
            self.config.source,
            self.config.replication.slot,
            self.config.replication.publication,
            start_lsn,
            self.config.replication.status_interval_seconds,
        ) as stream:
            # Locals for the per-message loop: it runs hundreds of thousands of times a second.
            append, header, row_tags, crash = writer.pending.append, XLOG_HEADER, _ROW_TAGS, crash_point
            stopping = False
            try:
                while not stopping:
                    now = time.monotonic()
                    if not in_transaction and (finished(now) or (target is not None and stats.flushed_lsn >= target)):
                        break
                    if flush_due(now):
                        flush()  # also inside a long transaction: what committed before it is due
                    # Catching up, a short silence after transactions came means the end is reached: find
                    # out at once (a keepalive tells where the server is) instead of idling half a second.
                    quick = target is not None and not in_transaction and stats.transactions > 0
                    messages = stream.read_batch(0.05 if quick else 0.5)
                    if not messages:
                        now = time.monotonic()
                        if not in_transaction and pending_end_lsn is not None:
                            flush()
                        if not in_transaction and pending_end_lsn is None:
                            if stream.server_wal_end > stats.flushed_lsn and (
                                target is not None or now - last_idle_ack >= flush_cfg.interval_seconds
                            ):
                                # Quiet publication: advance the slot so WAL is not pinned.
                                self.store.record_flushed_lsn(stream.server_wal_end)
                                stream.ack(stream.server_wal_end)
                                stats.flushed_lsn = stream.server_wal_end
                                last_idle_ack = now
                            elif target is not None:
                                stream.request_keepalive()
                        continue
                    for message in messages:
                        tag = message[header]
                        if tag in row_tags:
                            append(message)  # kept as received: decoded in bulk when staged
                            crash("flusher.mid_transaction")
                        elif tag == _BEGIN:
                            _, commit_ts, xid = pgoutput.begin_fields(message, XLOG_HEADER)
                            in_transaction = True
                        elif tag == _COMMIT:
                            in_transaction = False
                            end_lsn = pgoutput.commit_end_lsn(message, XLOG_HEADER)
                            if end_lsn <= stats.flushed_lsn:
                                writer.discard()  # registered before a restart: already in the staged log
                                continue
                            writer.commit(commit_ts, xid)
                            stats.transactions += 1
                            pending_end_lsn = end_lsn
                            now = time.monotonic()
                            if finished(now) or (target is not None and end_lsn >= target):
                                # Messages after this commit in the batch are dropped unacknowledged:
                                # the next run receives them again.
                                stopping = True
                                break
                            if flush_due(now):
                                flush()
                        else:
                            decoded = pgoutput.decode(bytes(message[XLOG_HEADER:]))
                            if isinstance(decoded, pgoutput.Relation):
                                relations.describe(decoded.oid, writer.next_seq, self._relation_info(decoded))
                            elif isinstance(decoded, pgoutput.Truncate):
                                lsn = xlog_data_start(message)
                                for oid in decoded.relation_oids:
                                    append(truncate_marker(lsn, oid))
                                    crash_point("flusher.mid_transaction")
                    writer.bound()  # the open transaction spills past txn_memory_bytes
                flush()
            finally:
                writer.close()  # drops a spill file (a failed run must not keep its disk space)
        return stats

    def _relation_info(self, relation: pgoutput.Relation) -> RelationInfo | None:
        table = self.tables.get(relation.key)
        if table is None:
            return None  # published but not configured: ignored
        columns = tuple(
            SourceColumn(
                name=column.name,
                type=self._resolver.resolve(column.type_oid, column.type_mod),
                not_null=column.name in table.primary_key,
            )
            for column in relation.columns
        )
        return RelationInfo(
            table=table,
            relation=StagedRelation(table=table.key, columns=columns),
            positions={column.name: index for index, column in enumerate(relation.columns)},
        )
