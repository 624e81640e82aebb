"""The staged-log protocol of the coordination store, run against both stores.

Every test runs on :class:`InMemoryCoordinationStore` (no server) and on :class:`CoordinationStore`
in a fresh database of the test cluster, so the in-memory store is held to the PostgreSQL one's
semantics: offsets, batching, forward-only LSN and cursor, crash replay, the writer lease.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from pg2iceberg_dagster.config import parse_config
from pg2iceberg_dagster.coordination.memory import InMemoryCoordinationStore
from pg2iceberg_dagster.coordination.protocol import StagedLogStore
from pg2iceberg_dagster.coordination.records import Chunk, Lag, LogEntry, StagedFile
from pg2iceberg_dagster.coordination.store import CoordinationStore
from pg2iceberg_dagster.errors import LeaseBusyError, StagingError
from pg2iceberg_dagster.materializer import merge as merge_module
from pg2iceberg_dagster.materializer.merge import Materializer
from pg2iceberg_dagster.staging.store import ObjectStore
from pg2iceberg_dagster.tables import MirroredTables

from .conftest import SourceDb

Store = InMemoryCoordinationStore | CoordinationStore


@dataclass
class Backend:
    """A store under test, and a way to open another handle on the same state (another process's view:
    a connection of its own in PostgreSQL, the same instance in memory)."""

    store: Store
    other: Callable[[], Store]


@pytest.fixture(params=["memory", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        store = InMemoryCoordinationStore()
        yield Backend(store, lambda: store)
        return
    source = request.getfixturevalue("source")
    target = source.config(["public.t"]).state_connection
    with ExitStack() as stack:

        def open_store() -> CoordinationStore:
            return stack.enter_context(CoordinationStore(target))

        store = open_store()
        store.migrate()
        yield Backend(store, open_store)


def staged(table: str, rows: int, lsn: int, path: str | None = None) -> StagedFile:
    """A staged file of ``rows`` changes committed at ``lsn``."""
    return StagedFile(table, path or f"{table}/{lsn}.parquet", rows, rows * 100, lsn, lsn)


def spans(entries: list[LogEntry]) -> list[tuple[int, int]]:
    return [(e.start_offset, e.end_offset) for e in entries]


def stage(store: Store, table: str, sizes: list[int], first_lsn: int = 100) -> list[LogEntry]:
    """Register one file per size, one flush each, at increasing LSNs."""
    entries: list[LogEntry] = []
    for number, rows in enumerate(sizes):
        entries += store.register_flush([staged(table, rows, first_lsn + number)], first_lsn + number)
    return entries


def test_both_stores_have_the_protocols_signatures() -> None:
    """Every operation the protocol names exists on both stores, with the same parameters."""
    operations = [name for name, value in vars(StagedLogStore).items() if callable(value) and name[0] != "_"]
    assert "register_flush" in operations and "writer_lease" in operations
    for name in operations:
        wanted = list(inspect.signature(getattr(StagedLogStore, name)).parameters.values())
        for implementation in (CoordinationStore, InMemoryCoordinationStore):
            assert list(inspect.signature(getattr(implementation, name)).parameters.values()) == wanted, (
                f"{implementation.__name__}.{name}"
            )


def test_offsets_are_contiguous_per_table_from_registration(backend: Backend) -> None:
    store = backend.store
    assert store.log_head("public.a") == 0
    first = store.register_flush(
        [staged("public.a", 3, 10, "a1"), staged("public.b", 4, 10, "b1"), staged("public.a", 2, 11, "a2")], 11
    )
    assert [(e.table_name, e.start_offset, e.end_offset, e.path) for e in first] == [
        ("public.a", 0, 3, "a1"),
        ("public.b", 0, 4, "b1"),
        ("public.a", 3, 5, "a2"),
    ]
    second = store.register_flush([staged("public.a", 1, 12, "a3")], 12)
    assert spans(second) == [(5, 6)]
    assert (store.log_head("public.a"), store.log_head("public.b"), store.log_head("public.c")) == (6, 4, 0)
    assert store.log_entries("public.a", 0) == [first[0], first[2], second[0]], "stored as returned"
    entry = second[0]
    assert (entry.first_lsn, entry.flushable_lsn, entry.row_count, entry.byte_size) == (12, 12, 1, 100)


def test_concurrent_registrations_never_share_an_offset(backend: Backend) -> None:
    handles = [backend.other() for _ in range(4)]

    sizes = [1 + i % 3 for i in range(100)]

    start = threading.Barrier(len(handles))

    def register(handle: Store, number: int) -> None:
        start.wait()
        for i, rows in enumerate(sizes):
            handle.register_flush([staged("public.t", rows, 1000 * number + i)], 1000 * number + i)

    threads = [threading.Thread(target=register, args=(h, n)) for n, h in enumerate(handles)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: a registration that is not atomic shows
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    entries = backend.store.log_entries("public.t", 0)
    assert len(entries) == 4 * len(sizes)
    assert all(a.end_offset == b.start_offset for a, b in itertools.pairwise(entries)), "a gap or overlap"
    assert entries[0].start_offset == 0
    assert entries[-1].end_offset == backend.store.log_head("public.t") == 4 * sum(sizes)


def test_a_registration_of_several_files_is_all_or_nothing(backend: Backend) -> None:
    store = backend.store
    store.record_slot_created(50)
    stage(store, "public.a", [2])
    # A file without rows breaks the log's rule (every entry spans some offsets): the whole flush fails.
    with pytest.raises((ValueError, psycopg.errors.CheckViolation)):
        store.register_flush([staged("public.a", 3, 200, "good"), staged("public.b", 0, 201, "empty")], 201)
    assert store.log_head("public.a") == 2 and store.log_head("public.b") == 0
    assert [e.path for e in store.log_entries("public.a", 0)] == ["public.a/100.parquet"]
    assert store.flushed_lsn() == 100, "flushed_lsn moved with a failed registration"
    assert spans(store.register_flush([staged("public.a", 3, 202)], 202)) == [(2, 5)], "offsets were leaked"


def test_flushed_lsn_only_moves_forward(backend: Backend) -> None:
    store = backend.store
    assert store.flushed_lsn() is None
    store.record_flushed_lsn(40)
    assert store.flushed_lsn() is None, "recorded before the slot seeded it"
    store.record_slot_created(100)
    store.record_flushed_lsn(50)
    assert store.flushed_lsn() == 100
    store.record_flushed_lsn(200)
    assert store.flushed_lsn() == 200
    store.register_flush([], 150)
    assert store.flushed_lsn() == 200
    store.register_flush([staged("public.a", 1, 300)], 300)
    assert store.flushed_lsn() == 300
    assert store.register_flush([], 400) == [] and store.flushed_lsn() == 400, "an empty flush still moves it"
    store.record_slot_created(10)
    assert store.flushed_lsn() == 10, "a new slot seeds it again, backwards too"


def test_log_entries_batch_about_max_rows_but_at_least_one(backend: Backend) -> None:
    store = backend.store
    stage(store, "public.a", [3, 3, 3, 10, 1])  # [0,3) [3,6) [6,9) [9,19) [19,20)
    stage(store, "public.b", [7])
    every = [(0, 3), (3, 6), (6, 9), (9, 19), (19, 20)]
    assert spans(store.log_entries("public.a", 0)) == every
    assert spans(store.log_entries("public.a", 0, 6)) == every[:2]
    assert spans(store.log_entries("public.a", 0, 5)) == every[:1], "stops before going past max_rows"
    assert spans(store.log_entries("public.a", 0, 0)) == every[:1], "at least one entry"
    assert spans(store.log_entries("public.a", 4, 100)) == every[1:], "the entry holding from_offset comes first"
    assert spans(store.log_entries("public.a", 6, 5)) == [(6, 9)]
    assert spans(store.log_entries("public.a", 9, 5)) == [(9, 19)], "one entry larger than max_rows"
    assert spans(store.log_entries("public.a", 9, 11)) == [(9, 19), (19, 20)]
    assert store.log_entries("public.a", 20) == []
    assert store.log_entries("public.c", 0) == []
    assert spans(store.log_entries("public.b", 0)) == [(0, 7)], "tables do not mix"


def test_cursor_moves_only_forward_and_lag_follows(backend: Backend) -> None:
    store = backend.store
    stage(store, "public.a", [4, 6])
    assert store.mat_cursor("g", "public.a") == 0
    assert store.lag("g", "public.a") == Lag(0, 10)
    assert store.lag("g", "public.unknown") == Lag(0, 0)
    store.advance_mat_cursor("g", "public.a", 4, 100, 1)
    assert store.mat_cursor("g", "public.a") == 4
    assert store.lag("g", "public.a") == Lag(4, 10) and store.lag("g", "public.a").changes == 6
    store.advance_mat_cursor("g", "public.a", 2, 99, 2)
    assert store.mat_cursor("g", "public.a") == 4, "moved backwards"
    assert store.mat_cursor("other", "public.a") == 0, "groups have their own cursors"
    assert store.mat_cursor("g", "public.b") == 0
    store.advance_mat_cursor("g", "public.a", 10, 101, 3)
    assert store.lag("g", "public.a").changes == 0


def test_an_unacknowledged_batch_is_read_again(backend: Backend) -> None:
    """The materializer's loop: a batch whose cursor advance never happened (a crash after the Iceberg
    commit) comes back whole; once acknowledged, the next batch starts where it ended."""
    store = backend.store
    stage(store, "public.a", [2, 2, 2, 2, 2])

    def next_batch() -> list[LogEntry]:
        return store.log_entries("public.a", store.mat_cursor("g", "public.a"), 4)

    first = next_batch()
    assert spans(first) == [(0, 2), (2, 4)]
    assert next_batch() == first, "not acknowledged: the same batch again"
    store.advance_mat_cursor("g", "public.a", first[-1].end_offset, first[-1].flushable_lsn, None)
    assert spans(next_batch()) == [(4, 6), (6, 8)]
    batches = 0
    while store.mat_cursor("g", "public.a") < store.log_head("public.a"):
        batch = next_batch()
        store.advance_mat_cursor("g", "public.a", batch[-1].end_offset, batch[-1].flushable_lsn, None)
        batches += 1
    assert batches == 2 and store.lag("g", "public.a") == Lag(10, 10)
    assert next_batch() == []


def test_writer_lease_is_exclusive_per_group_and_table(backend: Backend) -> None:
    store = backend.store
    other = backend.other()
    errors: list[BaseException] = []

    def take(handle: Store, group: str, table: str, worker: str) -> None:
        try:
            with handle.writer_lease(group, table, worker):
                pass
        except BaseException as exc:
            errors.append(exc)

    def take_in_thread(group: str, table: str) -> BaseException | None:
        errors.clear()
        thread = threading.Thread(target=take, args=(other, group, table, "worker-2"))
        thread.start()
        thread.join()
        return errors[0] if errors else None

    with store.writer_lease("g", "public.a", "worker-1"):
        busy = take_in_thread("g", "public.a")
        assert isinstance(busy, LeaseBusyError) and "worker-1" in str(busy)
        # Not reentrant: the holder does not take it twice either.
        with pytest.raises(LeaseBusyError), store.writer_lease("g", "public.a", "worker-1"):
            pass
        assert take_in_thread("g", "public.b") is None, "another table's lease"
        assert take_in_thread("other", "public.a") is None, "another group's lease"
    assert take_in_thread("g", "public.a") is None, "released on exit"
    with pytest.raises(RuntimeError), store.writer_lease("g", "public.a", "worker-1"):
        raise RuntimeError("the merge failed")
    assert take_in_thread("g", "public.a") is None, "released when the body raises"


def test_a_writer_lease_whose_session_was_lost_is_released_with_it(source: SourceDb) -> None:
    """A lease's session ended by the server mid-merge (a restart, an administrator) releases the lease,
    and the store's next lease takes a new session instead of the dead one."""
    target = source.config(["public.t"]).state_connection
    with CoordinationStore(target) as store, CoordinationStore(target) as other:
        store.migrate()
        with store.writer_lease("g", "public.a", "worker-1"):
            holders = other.conn.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid::bigint = %s",
                (zlib.crc32(b"pg2iceberg:materialize:g:public.a"),),
            ).fetchall()
            assert len(holders) == 1
            other.conn.execute("SELECT pg_terminate_backend(%s, 5000)", (holders[0][0],))
        busy = pytest.raises(LeaseBusyError, match="worker-2")
        with other.writer_lease("g", "public.a", "worker-2"), busy, store.writer_lease("g", "public.a", "worker-1"):
            pass  # released: the other store took it
        busy = pytest.raises(LeaseBusyError, match="worker-1")
        with store.writer_lease("g", "public.a", "worker-1"), busy, other.writer_lease("g", "public.a", "worker-2"):
            pass  # and this store's next lease holds it on a live session


def test_cleanup_drops_entries_below_the_slowest_cursor(backend: Backend) -> None:
    store = backend.store
    stage(store, "public.a", [3, 2, 4])  # [0,3) [3,5) [5,9)
    stage(store, "public.b", [5])
    assert store.min_mat_cursor("public.a") == 0, "no cursor yet"
    store.advance_mat_cursor("fast", "public.a", 9, 102, None)
    store.advance_mat_cursor("slow", "public.a", 5, 101, None)
    assert store.min_mat_cursor("public.a") == 5
    assert sorted(store.delete_log_entries_before("public.a", 5)) == ["public.a/100.parquet", "public.a/101.parquet"]
    assert spans(store.log_entries("public.a", 0)) == [(5, 9)]
    assert store.delete_log_entries_before("public.a", 8) == [], "an entry partly above stays"
    assert spans(store.log_entries("public.a", 0)) == [(5, 9)]
    assert store.log_head("public.a") == 9, "offsets are never reused"
    assert spans(store.register_flush([staged("public.a", 1, 200)], 200)) == [(9, 10)]
    assert spans(store.log_entries("public.b", 0)) == [(0, 5)]


def test_table_state_and_snapshot_epochs(backend: Backend) -> None:
    store = backend.store
    assert store.table_state("public.a") is None
    assert store.begin_epoch("10:20:", 500) == 0
    assert store.begin_epoch("30:40:35", 900) == 1
    epoch = store.snapshot_epoch(1)
    assert (epoch.epoch, epoch.snapshot, epoch.lsn_bound) == (1, "30:40:35", 900)
    with pytest.raises(KeyError):
        store.snapshot_epoch(2)
    plan = [Chunk("public.a", 0, 0, 8), Chunk("public.a", 1, 8, None)]
    assert store.start_table_snapshot("public.a", 1234, "ns.a", 700, plan) == plan
    assert store.start_table_snapshot("public.a", 99, "ns.other", 800, plan[:1]) == plan, "the first plan wins"
    state = store.table_state("public.a")
    assert state is not None
    assert (state.pg_oid, state.iceberg_table, state.snapshot_lsn) == (1234, "ns.a", 700)
    assert not state.snapshot_complete and state.snapshot_epoch is None
    store.restart_table_snapshot("public.a", 1)
    store.mark_snapshot_complete("public.a")
    state = store.table_state("public.a")
    assert state is not None and state.snapshot_complete and state.snapshot_epoch == 1
    assert list(store.table_states()) == ["public.a"]


# The materializer against the in-memory store: what it decides before Spark starts. --------------


def _materializer(tmp_path: Path, store: InMemoryCoordinationStore) -> Materializer:
    config = parse_config(
        {
            "source": {"dbname": "unused"},
            "tables": [{"name": "public.a"}],
            "staging": {"url": f"file://{tmp_path}/staging"},
            "materialize": {"group": "g"},
        }
    )

    def no_spark() -> None:
        raise AssertionError("Spark was started")

    class NoIcebergTable:
        """The catalog of a table with nothing to fill (the materializer looks once per table)."""

        properties: dict[str, str] = {}

        def load_table(self, identifier: tuple[str, str]) -> NoIcebergTable:
            return self

    return Materializer(
        config,
        MirroredTables(config),
        store,
        ObjectStore(config.staging),
        catalog=NoIcebergTable(),  # type: ignore[arg-type]
        spark_factory=no_spark,
        worker_id="me",
    )


def test_materializer_waits_for_the_snapshot_and_for_changes(tmp_path: Path) -> None:
    store = InMemoryCoordinationStore()
    materializer = _materializer(tmp_path, store)
    stage(store, "public.a", [5])
    result = materializer.materialize_table("public.a")
    assert result.waiting_for_snapshot and result.lag == Lag(0, 5) and result.batches == 0
    store.start_table_snapshot("public.a", 1, "public.a", 100, [Chunk("public.a", 0, 0, None)])
    assert materializer.materialize_table("public.a").waiting_for_snapshot, "snapshot not complete yet"
    store.mark_snapshot_complete("public.a")
    store.advance_mat_cursor("g", "public.a", 5, 100, None)
    result = materializer.materialize_table("public.a")
    assert not result.waiting_for_snapshot and result.batches == 0 and result.lag == Lag(5, 5)


def test_materializer_takes_the_lease_before_anything_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A merge waits for a busy lease (10 minutes in production) before it gives up: not here.
    monkeypatch.setattr(merge_module, "LEASE_WAIT_SECONDS", 1.0)
    store = InMemoryCoordinationStore()
    materializer = _materializer(tmp_path, store)
    store.start_table_snapshot("public.a", 1, "public.a", 100, [Chunk("public.a", 0, 0, None)])
    store.mark_snapshot_complete("public.a")
    stage(store, "public.a", [5])
    with store.writer_lease("g", "public.a", "someone"), pytest.raises(LeaseBusyError, match="someone"):
        materializer.materialize_table("public.a")
    assert store.mat_cursor("g", "public.a") == 0


def test_a_merge_waits_for_a_lease_let_go_within_the_wait(tmp_path: Path) -> None:
    """A maintenance pass or another merge holding the lease: the merge waits, then merges."""
    store = InMemoryCoordinationStore()
    materializer = _materializer(tmp_path, store)
    store.start_table_snapshot("public.a", 1, "public.a", 100, [Chunk("public.a", 0, 0, None)])
    store.mark_snapshot_complete("public.a")
    stage(store, "public.a", [5])
    held = threading.Event()

    def hold_briefly() -> None:
        with store.writer_lease("g", "public.a", "maintenance"):
            held.set()
            threading.Event().wait(1.0)

    holder = threading.Thread(target=hold_briefly)
    holder.start()
    held.wait()
    try:
        # Past the lease the merge reads its batch, whose file this test never wrote.
        with pytest.raises(StagingError, match=r"cannot read staged file public\.a/100\.parquet"):
            materializer.materialize_table("public.a")
    finally:
        holder.join()


def test_materializer_replays_in_the_tables_epoch(tmp_path: Path) -> None:
    store = InMemoryCoordinationStore()
    materializer = _materializer(tmp_path, store)
    assert materializer.replay_epoch("public.a") is None
    store.start_table_snapshot("public.a", 1, "public.a", 100, [])
    assert materializer.replay_epoch("public.a") is None, "snapshotted before epochs"
    store.begin_epoch("1:1:", 10)
    store.restart_table_snapshot("public.a", store.begin_epoch("5:9:7", 90))
    epoch = materializer.replay_epoch("public.a")
    assert epoch is not None and (epoch.epoch, epoch.snapshot, epoch.lsn_bound) == (1, "5:9:7", 90)
