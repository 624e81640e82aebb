"""The coordination operations the flusher and the materializer need, as a structural type.

:class:`~.store.CoordinationStore` (the ``_pg2iceberg`` schema in PostgreSQL) satisfies it, and so does
:class:`~.memory.InMemoryCoordinationStore`, which gives the staged-log protocol fast tests without a
server. Only what the two callers really call is named here: snapshot planning, pipeline identity
and cleanup stay on the concrete stores.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from ..errors import LeaseBusyError
from .records import Lag, LogEntry, SnapshotEpoch, StagedFile, TableState


class StagedLogStore(Protocol):
    """The staged log, ``flushed_lsn``, the materializer cursors and the writer lease.

    Offsets count staged changes per table: each registered file takes the next ``row_count`` of
    them, so a table's log is contiguous from 0 and ``log_head`` is its next free offset.
    """

    # The flusher (flusher/flusher.py) -------------------------------------------------------------

    def flushed_lsn(self) -> int | None:
        """The LSN up to which every committed change is registered (None before the slot exists)."""
        ...

    def record_flushed_lsn(self, lsn: int) -> None:
        """Move ``flushed_lsn`` to ``lsn``, never backwards (and not at all before it is seeded)."""
        ...

    def register_flush(self, files: Sequence[StagedFile], flushed_lsn: int) -> list[LogEntry]:
        """All or nothing: give each file the next offsets of its table, index it, move ``flushed_lsn``."""
        ...

    # The materializer (materializer/merge.py) ------------------------------------------------------

    def table_state(self, table_name: str) -> TableState | None:
        """The table's snapshot state (None before its snapshot was planned)."""
        ...

    def snapshot_epoch(self, epoch: int) -> SnapshotEpoch:
        """A recorded snapshot epoch; KeyError when there is none of that number."""
        ...

    def lag(self, group: str, table_name: str) -> Lag:
        """``group``'s cursor and the table's log head, read together."""
        ...

    def lags(self, group: str) -> dict[str, tuple[Lag, float]]:
        """Every staged table's lag for ``group``, with the age in seconds of its oldest unmerged
        staged change (0 when none)."""
        ...

    def log_head(self, table_name: str) -> int:
        """The next offset the flusher will assign for ``table_name`` (0 when nothing was staged)."""
        ...

    def mat_cursor(self, group: str, table_name: str) -> int:
        """The first offset of ``table_name`` not yet applied to Iceberg by ``group`` (0 at first)."""
        ...

    def merged_snapshot_id(self, group: str, table_name: str) -> int | None:
        """The Iceberg snapshot ``group``'s cursor was last advanced with: while it is still the table's
        current one, nothing was committed past the cursor (None before any merge, or when unrecorded)."""
        ...

    def staged_positions(self, table_names: Sequence[str]) -> tuple[int | None, dict[str, int]]:
        """``flushed_lsn`` and each table's log head, read together: the log up to these heads holds
        exactly the changes of the transactions committed at or before that LSN."""
        ...

    def log_entries(self, table_name: str, from_offset: int, max_rows: int | None = None) -> list[LogEntry]:
        """Entries ending after ``from_offset`` in offset order, about ``max_rows`` changes (at least one)."""
        ...

    def advance_mat_cursor(
        self, group: str, table_name: str, next_offset: int, last_lsn: int, iceberg_snapshot_id: int | None
    ) -> None:
        """Move ``group``'s cursor forward (only forward) after the Iceberg commit."""
        ...

    def request_resync(self, table_name: str, reason: str) -> None:
        """Ask for an online resync of the table; its merges wait until the resync switched it."""
        ...

    def writer_lease(self, group: str, table_name: str, worker_id: str) -> AbstractContextManager[None]:
        """Hold the single-writer lease of (``group``, ``table_name``); LeaseBusyError when it is taken."""
        ...


# How often a writer waiting for a table's lease tries again, and for how long: a merge, a resync
# request or a maintenance pass waits for the one in progress (a long merge, a compaction) to end.
LEASE_RETRY_SECONDS = 0.5
LEASE_WAIT_SECONDS = 600.0


@contextlib.contextmanager
def writer_lease_within(
    store: StagedLogStore, group: str, table_name: str, worker_id: str, wait_seconds: float
) -> Iterator[None]:
    """Hold the table's writer lease, waiting up to ``wait_seconds`` while another writer (a merge,
    maintenance) holds it; then LeaseBusyError naming the holder."""
    deadline = time.monotonic() + wait_seconds
    with contextlib.ExitStack() as stack:
        while True:
            try:
                stack.enter_context(store.writer_lease(group, table_name, worker_id))
                break
            except LeaseBusyError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(LEASE_RETRY_SECONDS)
        yield
