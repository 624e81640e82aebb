"""The snapshot's three overlapping stages: read chunks, write their data files, commit them.

Up to ``parallelism`` chunks are read at once, as many are written as data files, and ``committers``
commit every chunk of a table written by then in one Iceberg commit (group commit), so neither the
source connections nor the file writers wait for commits. A commit is a chain of waits (its
manifest, manifest list and metadata file written, its catalog row swapped): on object storage one
committer made them the pace of a snapshot of many small tables, and commits of several tables fill
each other's waits. Commits do not multiply with chunks: while more chunks of a table are coming,
they are ``min_commit_interval`` seconds apart. At most ``in_memory`` chunks are read and not yet
written. The work is taken from its iterable by a thread of its own as the stages go: whatever
producing the next chunk costs (creating its table...) overlaps with the chunks before it; a
table's chunks come one after another.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ..config import PostgresConnection
from ..coordination.records import Chunk
from ..source.catalog import SourceTable
from .chunks import WrittenChunk
from .reader import ArrowReader

CHUNKS_IN_MEMORY_PER_WORKER = 4

ReadChunk = Callable[[SourceTable, Chunk], pa.Table]
WriteChunk = Callable[[SourceTable, Chunk, pa.Table], WrittenChunk]
CommitChunks = Callable[[SourceTable, list[WrittenChunk]], list[tuple[Chunk, int]]]


@dataclass(frozen=True)
class _Fed:
    """What taking one chunk of the work started: its read, and the taking of the next chunk."""

    futures: tuple[Future[Any], ...]


class ChunkStages:
    """Runs chunks through read, write and commit; see the module docstring."""

    def __init__(
        self,
        read: ReadChunk,
        write: WriteChunk,
        commit: CommitChunks,
        parallelism: int,
        committers: int,
        in_memory: int,
        min_commit_interval: float,
    ) -> None:
        self._read, self._write, self._commit = read, write, commit
        self._parallelism = parallelism
        self._committers_count = committers
        self._min_commit_interval = min_commit_interval
        self._held = threading.BoundedSemaphore(in_memory)
        self._ready: dict[str, list[WrittenChunk]] = {}
        self._ready_changed = threading.Condition()  # guards _ready, _unwritten and _last_commit
        self._unwritten: Counter[str] = Counter()
        self._last_commit: dict[str, float] = {}
        self._readers: ThreadPoolExecutor | None = None
        self._writers: ThreadPoolExecutor | None = None
        self._committers: ThreadPoolExecutor | None = None
        self._feeder: ThreadPoolExecutor | None = None
        self._reads: list[Future[Any]] = []
        self._stopped = threading.Event()

    def run(self, work: Iterable[tuple[SourceTable, Chunk]]) -> Iterator[tuple[Chunk, int]]:
        """Yield each committed chunk with its rows; the first failure (taking the work included)
        stops taking work, cancels the reads not started and is raised (chunks already read are still
        written and committed: valid progress)."""
        with self._pools():
            assert self._feeder is not None
            try:
                yield from self._committed({self._feeder.submit(self._feed, iter(work))})
            except BaseException:
                self._stopped.set()
                for future in list(self._reads):
                    future.cancel()
                raise

    @contextmanager
    def _pools(self) -> Iterator[None]:
        # Inner pools shut down first, so every chunk is handed to a stage still running.
        with ExitStack() as stack:
            self._committers = stack.enter_context(
                ThreadPoolExecutor(self._committers_count, thread_name_prefix="chunk-commit")
            )
            self._writers = stack.enter_context(ThreadPoolExecutor(self._parallelism, thread_name_prefix="chunk-write"))
            self._readers = stack.enter_context(ThreadPoolExecutor(self._parallelism, thread_name_prefix="chunk-read"))
            self._feeder = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="chunk-feed"))
            yield

    @staticmethod
    def _committed(pending: set[Future[Any]]) -> Iterator[tuple[Chunk, int]]:
        """Follow each chunk's futures from stage to stage until its commit."""
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                outcome = future.result()
                if isinstance(outcome, Future):  # a read or a write handed its chunk on
                    pending.add(outcome)
                elif isinstance(outcome, _Fed):
                    pending.update(outcome.futures)
                else:
                    yield from outcome

    def _feed(self, work: Iterator[tuple[SourceTable, Chunk]]) -> _Fed:
        """Take the next chunk of ``work`` and start reading it; the next one is taken after."""
        item = None if self._stopped.is_set() else next(work, None)
        if item is None:
            return _Fed(())
        table, chunk = item
        with self._ready_changed:
            self._unwritten[table.key] += 1
        assert self._readers is not None and self._feeder is not None
        read = self._readers.submit(self._read_then_hand_over, table, chunk)
        self._reads.append(read)
        return _Fed((read, self._feeder.submit(self._feed, work)))

    def _read_then_hand_over(self, table: SourceTable, chunk: Chunk) -> Future[Any]:
        self._held.acquire()
        try:
            rows = self._read(table, chunk)
        except BaseException:
            self._held.release()
            raise
        assert self._writers is not None
        return self._writers.submit(self._write_then_hand_over, table, chunk, rows)

    def _write_then_hand_over(self, table: SourceTable, chunk: Chunk, rows: pa.Table) -> Future[Any]:
        try:
            written = self._write(table, chunk, rows)
        except BaseException:
            self._hand_over(table, None)
            raise
        finally:
            self._held.release()
        self._hand_over(table, written)
        assert self._committers is not None
        return self._committers.submit(self._commit_ready, table)

    def _hand_over(self, table: SourceTable, written: WrittenChunk | None) -> None:
        """Give a written chunk (None: its write failed) to the committers' pile."""
        with self._ready_changed:
            if written is not None:
                self._ready.setdefault(table.key, []).append(written)
            self._unwritten[table.key] -= 1
            if self._unwritten[table.key] == 0:
                self._ready_changed.notify_all()

    def _commit_ready(self, table: SourceTable) -> list[tuple[Chunk, int]]:
        """Commit what of ``table`` is written, waiting first for more while a commit was recent."""
        with self._ready_changed:
            previous = self._last_commit.get(table.key)
            if previous is not None:
                deadline = previous + self._min_commit_interval
                self._ready_changed.wait_for(
                    lambda: self._unwritten[table.key] == 0 or time.monotonic() >= deadline,
                    timeout=max(0.0, deadline - time.monotonic()),
                )
            batch = self._ready.pop(table.key, [])
            if batch:
                self._last_commit[table.key] = time.monotonic()
        return self._commit(table, batch) if batch else []


def run_chunks(
    source: PostgresConnection,
    work: Iterable[tuple[SourceTable, Chunk]],
    read: Callable[[ArrowReader, SourceTable, Chunk], pa.Table],
    write: WriteChunk,
    commit: CommitChunks,
    parallelism: int,
    committers: int,
    min_commit_interval: float,
) -> Iterator[tuple[Chunk, int]]:
    """Run ``work`` through :class:`ChunkStages`, reading with one :class:`ArrowReader` on ``source``
    (``read`` gets it) and ``CHUNKS_IN_MEMORY_PER_WORKER`` chunks in memory per reader; yields each
    committed chunk with its rows."""
    with ArrowReader(source) as reader:
        stages = ChunkStages(
            read=lambda table, chunk: read(reader, table, chunk),
            write=write,
            commit=commit,
            parallelism=parallelism,
            committers=committers,
            in_memory=CHUNKS_IN_MEMORY_PER_WORKER * parallelism,
            min_commit_interval=min_commit_interval,
        )
        yield from stages.run(work)
