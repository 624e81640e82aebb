"""The records the coordination stores read and write: pipeline identity, table state, snapshot chunks
and epochs, staged-log entries and cursors. Plain values, shared by every store."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class PipelineMeta:
    system_identifier: str
    slot_name: str
    publication: str
    consistent_point: int | None


# The resync reason of a table waiting for a repair (compare and write the differences, see repair.py)
# rather than a full copy; and the one a lost slot's repair marks every table with.
REPAIR_PREFIX = "repair: "
SLOT_LOST_REASON = REPAIR_PREFIX + "the replication slot was lost"


def is_repair(reason: str | None) -> bool:
    """Whether a table's pending resync is a repair."""
    return reason is not None and reason.startswith(REPAIR_PREFIX)


def resync_command(table_key: str, reason: str | None) -> str:
    """The command that carries out the table's pending resync: ``repair`` for a repair."""
    if is_repair(reason):
        return "`pg2iceberg-dagster repair`"
    return f"`pg2iceberg-dagster resync --table {table_key}`"


@dataclass(frozen=True)
class SlotReading:
    """A reading of the replication slot kept in ``_pg2iceberg.slot_readings`` (see wal_budget.py):
    when (``read_at``, the source's clock), the server's WAL position ``pg_current_wal_lsn()`` and the
    slot's ``safe_wal_size`` then (None: ``max_slot_wal_keep_size`` unlimited, or the slot lost WAL),
    and the rates in bytes per second smoothed up to it (None until two readings were compared)."""

    read_at: datetime
    wal_lsn: int
    safe_wal_size: int | None
    wal_write_rate: float | None = None
    safe_wal_shrink_rate: float | None = None


@dataclass(frozen=True)
class TableState:
    table_name: str
    pg_oid: int
    iceberg_table: str
    snapshot_complete: bool
    snapshot_lsn: int | None
    # The snapshot epoch the table's rows were read in (None: not planned in any epoch yet).
    snapshot_epoch: int | None = None
    # Set while an online resync is requested or running (why): merges of the table wait for it.
    resync_reason: str | None = None
    # The epoch the running resync copies the table in (None before its copy started).
    resync_epoch: int | None = None

    @property
    def mergeable(self) -> bool:
        """The table's rows are in Iceberg and no resync is replacing them."""
        return self.snapshot_complete and self.resync_reason is None


@dataclass(frozen=True)
class SnapshotEpoch:
    """An exported snapshot chunks were read under (see migration 4)."""

    epoch: int
    snapshot: str  # pg_snapshot text: xmin:xmax:xip,...
    lsn_bound: int


@dataclass(frozen=True)
class AdvertisedSnapshot:
    """The exported snapshot a live holder keeps importable, and its epoch."""

    name: str
    epoch: int


@dataclass(frozen=True)
class Chunk:
    """A CTID page range ``[start_page, end_page)``; ``end_page`` None means open-ended."""

    table_name: str
    index: int
    start_page: int
    end_page: int | None
    done: bool = False
    epoch: int | None = None  # the snapshot epoch a done chunk was read in
    # The leaf partition (schema, name) whose pages these are, for a partitioned table; else None.
    leaf: tuple[str, str] | None = None
    rows: int | None = None  # rows a done chunk wrote

    @property
    def partition_key(self) -> str:
        """A stable name like ``ctid_000000_002048`` (``..._end`` when open-ended), after the leaf
        partition's name for a partitioned table (``public.orders_2024.ctid_000000_end``)."""
        end = f"{self.end_page:06d}" if self.end_page is not None else "end"
        leaf = f"{self.leaf[0]}.{self.leaf[1]}." if self.leaf is not None else ""
        return f"{leaf}ctid_{self.start_page:06d}_{end}"


@dataclass(frozen=True)
class StagedFile:
    """One staged Parquet file about to be registered for a table."""

    table_name: str
    path: str
    row_count: int
    byte_size: int
    first_lsn: int
    flushable_lsn: int
    # The earliest source commit time of its changes, Unix microseconds (None: not known).
    first_commit_us: int | None = None


@dataclass(frozen=True)
class LogEntry:
    table_name: str
    start_offset: int
    end_offset: int
    path: str
    first_lsn: int
    flushable_lsn: int
    row_count: int
    byte_size: int


@dataclass(frozen=True)
class Lag:
    """Where a consumer group stands in a table's staged log: the changes from ``mat_cursor`` up to
    ``log_head`` are staged and not merged yet."""

    mat_cursor: int = 0
    log_head: int = 0
    # The LSN the last merged change was flushed at (None before any merge): where the cursor stands
    # in the WAL, not part of how far behind it is (lags compare by offsets).
    merged_lsn: int | None = field(default=None, compare=False)

    @property
    def changes(self) -> int:
        """Staged changes waiting for a merge."""
        return self.log_head - self.mat_cursor


def take_batch(entries: Iterable[LogEntry], max_rows: int | None) -> list[LogEntry]:
    """The leading ``entries`` (in offset order) that hold about ``max_rows`` changes: stop before the
    entry that would pass ``max_rows``, but take the first entry whatever its size."""
    batch: list[LogEntry] = []
    total = 0
    for entry in entries:
        if batch and max_rows is not None and total + entry.row_count > max_rows:
            break
        batch.append(entry)
        total += entry.row_count
    return batch
