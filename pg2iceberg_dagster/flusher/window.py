"""The row messages between two flushes, in log order, and how they become staged files.

Every row message goes into one list whole, as received (its LSN is in its header): per message
nothing is decoded, looked up or sorted by table (that cost more than the server's own decoding). At
COMMIT the transaction's rows get its commit time and xid; at a flush the committed rows are split by
relation OID and decoded in bulk (:mod:`.batch`), ``max_rows`` at a time, into one staged file per
table. Rows of the open transaction wait for the next flush; past ``txn_memory_bytes`` they move to a
spill file and are staged from it, in bounded chunks, at their COMMIT.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc

from ..config import FlushConfig
from ..coordination.records import StagedFile
from ..staging.store import ObjectStore, staged_file_key
from .batch import CompleteRows, MessageBatch, RelationInfo
from .txbuffer import SpillFile

# What one buffered message costs beyond its bytes: the memoryview, the libpq buffer object holding
# the bytes, the allocator's header and the list slot.
ENTRY_OVERHEAD = 256


class RelationLog:
    """Which relation description applies to each row: the last Relation message for its OID before it.

    Rows are numbered in arrival order (``seq``); a Relation message applies from the next row on. An
    unconfigured table's description is None: its rows are dropped when staged.
    """

    def __init__(self) -> None:
        self._history: dict[int, list[tuple[int, RelationInfo | None]]] = {}

    def describe(self, oid: int, seq: int, info: RelationInfo | None) -> None:
        history = self._history.setdefault(oid, [])
        if history and history[-1][1] == info:
            return  # re-sent unchanged (after a reconnect or a cache invalidation): one file shape
        history.append((seq, info))

    def pieces(self, oid: int, first_seq: int, rows: pa.Array) -> list[tuple[RelationInfo | None, pa.Array]]:
        """``rows`` (ascending indices of a batch whose first row is ``first_seq``) split where the
        relation's description changed, each piece with its description."""
        current: RelationInfo | None = None
        changes = []
        for seq, info in self._history.get(oid, []):
            if seq <= first_seq:
                current = info
            else:
                changes.append((seq - first_seq, info))
        if not changes:
            return [(current, rows)]
        pieces = []
        lower = 0
        for at, info in changes:
            part = pc.filter(rows, pc.and_(pc.greater_equal(rows, lower), pc.less(rows, at)))
            if len(part):
                pieces.append((current, part))
            current, lower = info, at
        part = pc.filter(rows, pc.greater_equal(rows, lower))
        if len(part):
            pieces.append((current, part))
        return pieces

    def forget_before(self, seq: int) -> None:
        """Drop descriptions no row from ``seq`` on can need."""
        for history in self._history.values():
            applies = [index for index, (start, _) in enumerate(history) if start <= seq]
            if applies and applies[-1] > 0:
                del history[: applies[-1]]


class StagedWriter:
    """Buffers row messages in log order and uploads the committed ones as staged files of bounded size."""

    def __init__(
        self,
        store: ObjectStore,
        flush: FlushConfig,
        relations: RelationLog,
        locations: Mapping[str, str],
        complete: CompleteRows | None = None,
    ) -> None:
        """``locations``: each configured table's staging folder, by key (see MirroredTable.staging)."""
        self._store = store
        self._locations = locations
        self._complete = complete  # computes generated columns the stream does not send
        self._max_rows = flush.max_rows
        self._max_bytes = flush.max_bytes
        self._memory_bytes = flush.txn_memory_bytes
        self._spill_dir = flush.spill_dir
        self._relations = relations
        self._messages: list[builtins.bytes | memoryview] = []  # whole WAL data messages, as read
        self._ts: list[int] = []  # of committed rows only: commit time, Unix microseconds
        self._xids: list[int] = []
        # Each transaction's commit (end) LSN by xid, for the staged files' change metadata; kept to the flush.
        self._commit_lsns: dict[int, int] = {}
        self._committed = 0  # rows at the head of the lists whose transaction committed
        self._committed_bytes = 0
        self._counted = 0  # messages whose size is in _open_bytes or _committed_bytes
        self._open_bytes = 0
        self._base = 0  # seq of the first row in the lists
        self._spill: SpillFile | None = None
        self.uploaded: list[StagedFile] = []
        self._uploaded_rows = 0
        self._uploaded_bytes = 0
        self.stage_seconds = 0.0  # CPU time spent decoding, encoding and uploading staged files

    @property
    def next_seq(self) -> int:
        """The number the next row message will get (see :class:`RelationLog`)."""
        return self._base + len(self._messages) + (self._spill.count if self._spill else 0)

    @property
    def rows(self) -> int:
        """Committed row messages not registered yet (for the ``max_rows`` flush bound)."""
        return self._committed + self._uploaded_rows

    @property
    def bytes(self) -> int:
        """Their size (for the ``max_bytes`` flush bound)."""
        return self._committed_bytes + self._uploaded_bytes

    @property
    def pending(self) -> list[builtins.bytes | memoryview]:
        """Where the open transaction's row messages (whole WAL data messages) are appended, in order.

        The stream loop appends to it directly (a method call per message costs more than the append);
        it calls :meth:`bound` after each batch it read, which keeps the memory bound.
        """
        return self._messages

    def add(self, message: builtins.bytes | memoryview) -> None:
        """Append one row message (or TRUNCATE marker) of the open transaction and keep the bound."""
        self._messages.append(message)
        self.bound()

    def bound(self) -> None:
        """Keep the open transaction within ``txn_memory_bytes`` (give or take the batch appended last):
        past it, its messages so far and every later one until COMMIT move to a spill file."""
        if self._spill is None:
            self._count_open()
            if self._open_bytes <= self._memory_bytes:
                return
            self._spill = SpillFile(self._spill_dir)
        self._spill_open()

    def _count_open(self) -> None:
        new = self._messages[self._counted :]
        self._open_bytes += sum(map(len, new)) + ENTRY_OVERHEAD * len(new)
        self._counted = len(self._messages)

    def _spill_open(self) -> None:
        assert self._spill is not None
        for message in self._messages[self._committed :]:
            self._spill.add(message)
        del self._messages[self._committed :]
        self._counted = self._committed
        self._open_bytes = 0

    def commit(self, ts: int, xid: int, end_lsn: int = 0) -> None:
        """The open transaction committed at ``ts`` (Unix microseconds) as ``xid``, its commit record
        ending at ``end_lsn``."""
        self._commit_lsns[xid] = end_lsn
        if self._spill is None:
            self._count_open()
            count = len(self._messages) - self._committed
            self._ts += [ts] * count
            self._xids += [xid] * count
            self._committed = self._counted = len(self._messages)
            self._committed_bytes += self._open_bytes
            self._open_bytes = 0
            return
        self._spill_open()
        # Staged files of a table are registered in list order: what came before goes first.
        self._stage_committed()
        spill, self._spill = self._spill, None
        try:
            for messages in spill.chunks(self._max_rows, self._max_bytes):
                self._stage(messages, [ts] * len(messages), [xid] * len(messages))
                self._base += len(messages)
        finally:
            spill.close()

    def discard(self) -> None:
        """Forget the open transaction (it was registered before a restart)."""
        del self._messages[self._committed :]
        self._counted = self._committed
        self._open_bytes = 0
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    def finish(self) -> list[StagedFile]:
        """Stage and upload every committed row; returns every file uploaded since the last reset."""
        self._stage_committed()
        return self.uploaded

    def reset(self) -> None:
        """After a flush registered :attr:`uploaded`."""
        self.uploaded = []
        self._commit_lsns = {}
        self._uploaded_rows = 0
        self._uploaded_bytes = 0

    def close(self) -> None:
        """Drop a spill file (a failed run must not keep its disk space)."""
        self.discard()

    def _stage_committed(self) -> None:
        count = self._committed
        if count == 0:
            return
        # In chunks of max_rows: a window holding a large transaction is decoded a bounded part at a time.
        for offset in range(0, count, self._max_rows):
            end = min(offset + self._max_rows, count)
            self._stage(self._messages[offset:end], self._ts[offset:end], self._xids[offset:end])
            self._base += end - offset
        del self._messages[:count]
        self._counted -= count
        self._ts, self._xids = [], []
        self._committed = 0
        self._committed_bytes = 0
        self._relations.forget_before(self._base)

    def _stage(self, messages: list[builtins.bytes | memoryview], ts: list[int], xids: list[int]) -> None:
        """Upload the staged files of these rows (at most ``max_rows``; the first is row ``self._base``):
        one per table, or more where a table's description changed among them."""
        started = time.thread_time()
        batch = MessageBatch(messages, ts, xids)
        oids = batch.relation_oids()
        files: list[tuple[StagedFile, bytes]] = []
        for oid in pc.unique(oids).to_pylist():
            rows = pc.indices_nonzero(pc.equal(oids, oid)).cast(pa.int64())
            for info, part in self._relations.pieces(oid, self._base, rows):
                if info is None:
                    continue  # published but not configured
                files.append(self._encode(batch, info, part))
        # All at once (in parallel on S3), before anything is registered: a flush writes a file per table.
        self._store.put_many([(staged.path, data) for staged, data in files])
        self.uploaded += [staged for staged, _data in files]
        self._uploaded_rows += len(messages)
        self._uploaded_bytes += sum(map(len, messages))
        self.stage_seconds += time.thread_time() - started

    def _encode(self, batch: MessageBatch, info: RelationInfo, rows: pa.Array) -> tuple[StagedFile, builtins.bytes]:
        """The staged file of ``rows`` of one table, and its bytes."""
        table = info.relation.table
        xids = pc.unique(pc.take(batch.xid, rows)).to_pylist()
        commits = {xid: self._commit_lsns[xid] for xid in xids if xid in self._commit_lsns}
        encoded = batch.encode(info, rows, self._complete, commits)
        key = staged_file_key(self._locations[table], encoded.last_lsn)
        staged = StagedFile(
            table, key, encoded.rows, len(encoded.data), encoded.first_lsn, encoded.last_lsn, encoded.first_commit_us
        )
        return staged, encoded.data
