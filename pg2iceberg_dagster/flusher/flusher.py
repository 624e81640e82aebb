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
from ..coordination.store import CoordinationStore, StagedFile
from ..faults import crash_point
from ..source import pgoutput
from ..source.catalog import SourceColumn, SourceTable, TypeResolver
from ..source.connection import connect
from ..source.lsn import current_wal_lsn
from ..source.replication import ReplicationStream
from ..staging.codec import DELETE, INSERT, TRUNCATE, UPDATE, Change, StagedRelation, encode
from ..staging.store import ObjectStore, staged_file_key
from .txbuffer import TransactionBuffer, estimate_size


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


@dataclass(frozen=True)
class _RelationInfo:
    table: SourceTable
    relation: StagedRelation
    positions: dict[str, int]


class StagedWriter:
    """Accumulates committed changes per table and uploads them as staged files of bounded size."""

    def __init__(self, store: ObjectStore, max_rows: int) -> None:
        self._store = store
        self._max_rows = max_rows
        self._segments: dict[str, tuple[StagedRelation, list[Change]]] = {}
        self.uploaded: list[StagedFile] = []
        self.rows = 0

    def add(self, relation: StagedRelation, change: Change) -> None:
        segment = self._segments.get(relation.table)
        if segment is not None and segment[0] != relation:
            self._upload(relation.table)  # the table's columns changed: a new file keeps one shape each
            segment = None
        if segment is None:
            segment = (relation, [])
            self._segments[relation.table] = segment
        segment[1].append(change)
        self.rows += 1
        if len(segment[1]) >= self._max_rows:
            self._upload(relation.table)

    def _upload(self, table: str) -> None:
        relation, changes = self._segments.pop(table)
        if not changes:
            return
        data = encode(relation, changes)
        key = staged_file_key(table, changes[-1].lsn)
        self._store.put(key, data)
        self.uploaded.append(
            StagedFile(table, key, len(changes), len(data), changes[0].lsn, max(c.lsn for c in changes))
        )

    def finish(self) -> list[StagedFile]:
        """Upload what is left; returns every file uploaded since the last reset."""
        for table in list(self._segments):
            self._upload(table)
        return self.uploaded

    def reset(self) -> None:
        self._segments.clear()
        self.uploaded = []
        self.rows = 0


class Flusher:
    """Streams the slot into the staged log. One instance per process; the slot admits one consumer."""

    def __init__(self, config: PipelineConfig, store: CoordinationStore, tables: dict[str, SourceTable]) -> None:
        self.config = config
        self.store = store
        self.tables = tables
        self.object_store = ObjectStore(config.staging)
        self._catalog_conn = connect(config.source)
        self._resolver = TypeResolver(self._catalog_conn)
        self._relations: dict[int, _RelationInfo | None] = {}

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
        writer = StagedWriter(self.object_store, flush_cfg.max_rows)
        buffer = TransactionBuffer(flush_cfg.txn_memory_bytes, flush_cfg.spill_dir)
        in_transaction = False
        commit_ts = None
        xid = 0
        pending_end_lsn: int | None = None
        pending_bytes = 0
        last_flush = time.monotonic()
        last_idle_ack = 0.0

        def flush() -> None:
            nonlocal pending_end_lsn, pending_bytes, last_flush
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
                stats.rows_by_table[staged.table_name] = (
                    stats.rows_by_table.get(staged.table_name, 0) + staged.row_count
                )
            stats.flushed_lsn = pending_end_lsn
            writer.reset()
            pending_end_lsn = None
            pending_bytes = 0
            last_flush = time.monotonic()
            if on_flush:
                on_flush(stats)

        with ReplicationStream(
            self.config.source,
            self.config.replication.slot,
            self.config.replication.publication,
            start_lsn,
            self.config.replication.status_interval_seconds,
        ) as stream:
            while True:
                now = time.monotonic()
                timed_out = deadline is not None and now >= deadline
                caught_up = target is not None and stats.flushed_lsn >= target and not in_transaction
                if (stop.is_set() or timed_out or caught_up) and not in_transaction:
                    flush()
                    break
                if pending_end_lsn is not None and (
                    writer.rows >= flush_cfg.max_rows
                    or pending_bytes >= flush_cfg.max_bytes
                    or now - last_flush >= flush_cfg.interval_seconds
                ):
                    flush()
                message = stream.read(timeout=0.5)
                if message is None:
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
                decoded = pgoutput.decode(message.payload)
                if isinstance(decoded, pgoutput.Begin):
                    in_transaction, commit_ts, xid = True, decoded.commit_ts, decoded.xid
                    buffer.clear()
                elif isinstance(decoded, pgoutput.Commit):
                    in_transaction = False
                    if decoded.end_lsn <= stats.flushed_lsn:
                        buffer.clear()  # registered before a restart: already in the staged log
                        continue
                    for relation, change in buffer:
                        writer.add(relation, change)
                        pending_bytes += estimate_size(change)
                    stats.transactions += 1
                    stats.changes += buffer.count
                    buffer.clear()
                    pending_end_lsn = decoded.end_lsn
                elif isinstance(decoded, pgoutput.Relation):
                    self._relations[decoded.oid] = self._relation_info(decoded)
                elif isinstance(decoded, (pgoutput.Insert, pgoutput.Update, pgoutput.Delete, pgoutput.Truncate)):
                    assert commit_ts is not None
                    for relation, change in self._changes(decoded, message.data_start, commit_ts, xid):
                        buffer.add(relation, change)
                        crash_point("flusher.mid_transaction")
        return stats

    def _relation_info(self, relation: pgoutput.Relation) -> _RelationInfo | None:
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
        return _RelationInfo(
            table=table,
            relation=StagedRelation(table=table.key, columns=columns),
            positions={column.name: index for index, column in enumerate(relation.columns)},
        )

    def _changes(
        self, message: pgoutput.Message, lsn: int, commit_ts: object, xid: int
    ) -> list[tuple[StagedRelation, Change]]:
        if isinstance(message, pgoutput.Truncate):
            infos = [self._relations.get(oid) for oid in message.relation_oids]
            return [(i.relation, Change(TRUNCATE, lsn, commit_ts, xid, {})) for i in infos if i]  # type: ignore[arg-type]
        info = self._relations.get(message.relation_oid)  # type: ignore[union-attr]
        if info is None:
            return []
        names = [column.name for column in info.relation.columns]
        key = info.table.primary_key

        def row(values: pgoutput.Tuple) -> tuple[dict[str, str | None], tuple[str, ...]]:
            data = {n: v for n, v in zip(names, values, strict=True) if v is not pgoutput.UNCHANGED}
            unchanged = tuple(n for n, v in zip(names, values, strict=True) if v is pgoutput.UNCHANGED)
            return data, unchanged  # type: ignore[return-value]

        def key_of(values: pgoutput.Tuple) -> dict[str, str | None]:
            return {k: values[info.positions[k]] for k in key}  # type: ignore[misc]

        if isinstance(message, pgoutput.Insert):
            data, unchanged = row(message.new)
            return [(info.relation, Change(INSERT, lsn, commit_ts, xid, data, unchanged))]  # type: ignore[arg-type]
        if isinstance(message, pgoutput.Delete):
            return [(info.relation, Change(DELETE, lsn, commit_ts, xid, key_of(message.old)))]  # type: ignore[arg-type]
        assert isinstance(message, pgoutput.Update)
        new_values = message.new
        if message.old is not None and message.old_kind == "O":
            # REPLICA IDENTITY FULL: the old row can fill unchanged TOAST values of the new one.
            new_values = tuple(
                old if new is pgoutput.UNCHANGED else new for old, new in zip(message.old, message.new, strict=True)
            )
        data, unchanged = row(new_values)
        changes: list[tuple[StagedRelation, Change]] = []
        if message.old is not None and key_of(message.old) != key_of(message.new):
            # The primary key changed: the old key's row is gone, the new key's row is written.
            changes.append((info.relation, Change(DELETE, lsn, commit_ts, xid, key_of(message.old))))  # type: ignore[arg-type]
        changes.append((info.relation, Change(UPDATE, lsn, commit_ts, xid, data, unchanged)))  # type: ignore[arg-type]
        return changes
