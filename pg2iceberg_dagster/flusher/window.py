"""The row messages between two flushes, in log order, and how they become staged files.

Every row message is copied whole, as received (its LSN is in its header), to the end of one
buffer, and its end offset to a list: per message nothing is decoded, looked up or sorted by table
(that cost more than the server's own decoding), and no Python object outlives the batch it came in
(a window of hundreds of thousands of views of libpq's buffers made the garbage collector walk them
all, again and again: half the flusher's CPU). At COMMIT the transaction's row count, commit time,
xid and commit LSN are recorded once; at a flush the committed rows are split by relation OID and
decoded in bulk (:mod:`.batch`), ``max_rows`` at a time, into one staged file per table. Rows of
the open transaction wait for the next flush; past ``txn_memory_bytes`` they move to a spill file
and are staged from it, in bounded chunks, at their COMMIT.
"""

from __future__ import annotations

import builtins
import itertools
import time
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc

from ..config import FlushConfig
from ..coordination.records import StagedFile
from ..staging.store import ObjectStore, staged_file_key
from .batch import CompleteRows, MessageBatch, RelationInfo
from .txbuffer import SpillFile

# What one buffered message costs beyond its bytes: the int of its end offset and its list slot.
ENTRY_OVERHEAD = 40


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
        self._data = bytearray()  # whole WAL data messages, as read, back to back
        self._ends: list[int] = []  # where each message in _data ends
        # One entry per committed transaction with rows here: the row count up to its end, then its
        # commit time (Unix microseconds), xid and commit (end) LSN, for the staged files' columns.
        self._txn_rows: list[int] = []
        self._txn_ts: list[int] = []
        self._txn_xids: list[int] = []
        self._txn_lsns: list[int] = []
        self._committed = 0  # rows at the head of the buffer whose transaction committed
        self._base = 0  # seq of the first row in the buffer
        self._spill: SpillFile | None = None
        self.uploaded: list[StagedFile] = []
        self._uploaded_rows = 0
        self._uploaded_bytes = 0
        self.stage_seconds = 0.0  # CPU time spent decoding, encoding and uploading staged files

    @property
    def next_seq(self) -> int:
        """The number the next row message will get (see :class:`RelationLog`)."""
        return self._base + len(self._ends) + (self._spill.count if self._spill else 0)

    @property
    def full(self) -> bool:
        """The committed row messages not registered yet reached ``max_rows`` or ``max_bytes``: flush."""
        return (
            self._committed + self._uploaded_rows >= self._max_rows
            or self._committed_end() + self._uploaded_bytes >= self._max_bytes
        )

    @property
    def pending(self) -> tuple[bytearray, list[int]]:
        """Where the open transaction's row messages (whole WAL data messages) go, in order: the
        message is appended to the buffer, then the buffer's new length to the list.

        The stream loop appends directly (a method call per message costs more than the appends); it
        calls :meth:`bound` after each batch it read, which keeps the memory bound. Both objects stay
        the same for the writer's life.
        """
        return self._data, self._ends

    def add(self, message: builtins.bytes) -> None:
        """Append one row message (or TRUNCATE marker) of the open transaction and keep the bound."""
        self._data += message
        self._ends.append(len(self._data))
        self.bound()

    def bound(self) -> None:
        """Keep the open transaction within ``txn_memory_bytes`` (give or take the batch appended last):
        past it, its messages so far and every later one until COMMIT move to a spill file."""
        if self._spill is None:
            if self._open_bytes() <= self._memory_bytes:
                return
            self._spill = SpillFile(self._spill_dir)
        self._spill_open()

    def _committed_end(self) -> int:
        return self._ends[self._committed - 1] if self._committed else 0

    def _open_bytes(self) -> int:
        return len(self._data) - self._committed_end() + ENTRY_OVERHEAD * (len(self._ends) - self._committed)

    def _spill_open(self) -> None:
        assert self._spill is not None
        start = self._committed_end()
        # Copies, not views: a view alive (in an error's traceback too) would forbid resizing the buffer.
        for end in self._ends[self._committed :]:
            self._spill.add(self._data[start:end])
            start = end
        self._drop_open()

    def _drop_open(self) -> None:
        del self._data[self._committed_end() :]
        del self._ends[self._committed :]

    def commit(self, ts: int, xid: int, end_lsn: int = 0) -> None:
        """The open transaction committed at ``ts`` (Unix microseconds) as ``xid``, its commit record
        ending at ``end_lsn``."""
        if self._spill is None:
            rows = len(self._ends)
            if rows > self._committed:
                self._txn_rows.append(rows)
                self._txn_ts.append(ts)
                self._txn_xids.append(xid)
                self._txn_lsns.append(end_lsn)
                self._committed = rows
            return
        self._spill_open()
        # Staged files of a table are registered in list order: what came before goes first.
        self._stage_committed()
        spill, self._spill = self._spill, None
        try:
            for messages in spill.chunks(self._max_rows, self._max_bytes):
                count = len(messages)
                ends = pa.array(itertools.accumulate(map(len, messages)), pa.int64())
                self._stage(b"".join(messages), ends, *(_repeat(value, count) for value in (ts, xid, end_lsn)))
                self._base += count
        finally:
            spill.close()

    def discard(self) -> None:
        """Forget the open transaction (it was registered before a restart)."""
        self._drop_open()
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
        self._uploaded_rows = 0
        self._uploaded_bytes = 0

    def close(self) -> None:
        """Drop a spill file (a failed run must not keep its disk space)."""
        self.discard()

    def _stage_committed(self) -> None:
        count = self._committed
        if count == 0:
            return
        size = self._committed_end()
        run_ends = pa.array(self._txn_rows, pa.int64())
        ts, xids, lsns = (
            pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(run_ends, pa.array(values, pa.int64())))
            for values in (self._txn_ts, self._txn_xids, self._txn_lsns)
        )
        # In chunks of max_rows: a window holding a large transaction is decoded a bounded part at a time.
        for offset in range(0, count, self._max_rows):
            end = min(offset + self._max_rows, count)
            first = self._ends[offset - 1] if offset else 0
            ends = pc.subtract(pa.array(self._ends[offset:end], pa.int64()), first)
            rows = (column.slice(offset, end - offset) for column in (ts, xids, lsns))
            # A copy, not a view (see _spill_open).
            self._stage(self._data[first : self._ends[end - 1]], ends, *rows)
            self._base += end - offset
        del self._data[:size]
        self._ends[:] = [at - size for at in self._ends[count:]]
        for values in (self._txn_rows, self._txn_ts, self._txn_xids, self._txn_lsns):
            values.clear()
        self._committed = 0
        self._relations.forget_before(self._base)

    def _stage(
        self, data: builtins.bytes | bytearray, ends: pa.Array, ts: pa.Array, xids: pa.Array, lsns: pa.Array
    ) -> None:
        """Upload the staged files of these rows (``data``: the messages back to back, each ending at
        its ``ends`` offset; at most ``max_rows``; the first is row ``self._base``), with each row's
        commit time, xid and commit LSN: one file per table, or more where a table's description
        changed among them."""
        started = time.thread_time()
        batch = MessageBatch(data, ends, ts, xids, lsns)
        oids = batch.relation_oids()
        files: list[tuple[StagedFile, builtins.bytes]] = []
        for oid in pc.unique(oids).to_pylist():
            rows = pc.indices_nonzero(pc.equal(oids, oid)).cast(pa.int64())
            for info, part in self._relations.pieces(oid, self._base, rows):
                if info is None:
                    continue  # published but not configured
                files.append(self._encode(batch, info, part))
        # All at once (in parallel on S3), before anything is registered: a flush writes a file per table.
        self._store.put_many([(staged.path, data) for staged, data in files])
        self.uploaded += [staged for staged, _data in files]
        self._uploaded_rows += len(ends)
        self._uploaded_bytes += len(data)
        self.stage_seconds += time.thread_time() - started

    def _encode(self, batch: MessageBatch, info: RelationInfo, rows: pa.Array) -> tuple[StagedFile, builtins.bytes]:
        """The staged file of ``rows`` of one table, and its bytes."""
        table = info.relation.table
        encoded = batch.encode(info, rows, self._complete)
        # Named by its last commit, not its last change: a transaction begun before the flushed LSN was
        # last moved has changes below it, and cleanup takes an unregistered file named at or below the
        # flushed LSN for an orphan (it deleted such a file between this upload and its registration).
        key = staged_file_key(self._locations[table], max(encoded.last_lsn, encoded.last_commit_lsn or 0))
        staged = StagedFile(
            table, key, encoded.rows, len(encoded.data), encoded.first_lsn, encoded.last_lsn, encoded.first_commit_us
        )
        return staged, encoded.data


def _repeat(value: int, count: int) -> pa.Array:
    return pa.repeat(pa.scalar(value, pa.int64()), count)
