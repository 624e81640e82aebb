"""Keeping one exported snapshot importable while chunks are read, by a holder that outlives any reader.

An exported snapshot stays valid only while the session that exported it stays open and idle.
:class:`SnapshotHolder` is that session. The first one creates the slot with ``SNAPSHOT 'export'``:
epoch 0, at the slot's consistent point. Once the slot exists its export cannot be had again, so a
later holder exports the snapshot of a plain REPEATABLE READ transaction: a new epoch, recorded with
its ``pg_snapshot`` so the materializer can skip the transactions it already shows.

:func:`hold_snapshot` runs a holder in a process (or thread) of its own and advertises the snapshot's
name and epoch in coordination under an advisory lock. Snapshot processes (the CLI's ``snapshot`` and
Dagster chunk runs) import it; one killed mid-chunk and started again resumes under the same
snapshot. The holder lets go once the snapshot of every table it can serve is complete (the tables
in the publication as its snapshot sees it: a table added since must start from a newer snapshot),
after ``max_seconds``, or when no snapshot process has run for ``snapshot.holder_idle_seconds``.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator

import psycopg

from ..config import PipelineConfig, PostgresConnection
from ..coordination.records import AdvertisedSnapshot
from ..coordination.store import CoordinationStore, snapshot_holder_lock
from ..detached import detached_error, spawn_with_config
from ..errors import Pg2IcebergError, SnapshotGoneError, StartupCheckError
from ..source.catalog import published_keys_seen_by
from ..source.connection import connect
from ..source.lsn import parse_lsn
from ..source.replication import create_slot_with_snapshot, failover_wanted, transactions_holding_slot_creation
from ..source.xid_snapshot import exported_snapshot_text

log = logging.getLogger(__name__)
# How often a snapshot waiting for its holder says what the slot's creation waits for.
SLOT_WAIT_REPORT_SECONDS = 10.0

HOLDER_COMMAND = (sys.executable, "-m", "pg2iceberg_dagster.snapshot.holder_process")


def holder_lock_key(config: PipelineConfig) -> int:
    """The advisory lock a holder holds while it lives (its snapshot is advertised under it)."""
    return snapshot_holder_lock(config.replication.slot)


def worker_lock_key(config: PipelineConfig) -> int:
    """The advisory lock every snapshot process holds (shared) while it works: the holder's sign of life."""
    return zlib.crc32(f"pg2iceberg:snapshot-worker:{config.replication.slot}".encode()) & 0x7FFFFFFF


class SnapshotHolder:
    """Exports a snapshot and keeps it importable until closed: the slot's own when ``create_slot``."""

    def __init__(self, config: PipelineConfig, store: CoordinationStore, create_slot: bool) -> None:
        if create_slot:
            self._conn: psycopg.Connection = connect(config.source, replication=True)
            failover = failover_wanted(config.replication.failover_slot, self._conn.info.server_version)
            created = create_slot_with_snapshot(self._conn, config.replication.slot, failover)
            store.record_slot_created(created.consistent_point)
            name, lsn_bound = created.snapshot_name, created.consistent_point
        else:
            self._conn = connect(config.source)
            self._conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            # One statement: the snapshot is taken first, so every change it shows is below the position.
            row = self._conn.execute("SELECT pg_export_snapshot(), pg_current_wal_insert_lsn()::text").fetchone()
            assert row is not None
            name, lsn_bound = row[0], parse_lsn(row[1])
        with connect(config.source) as probe:
            text = exported_snapshot_text(probe, name)
        self.advertised = AdvertisedSnapshot(name, store.begin_epoch(text, lsn_bound))

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SnapshotHolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def snapshot_importable(target: PostgresConnection, snapshot_name: str) -> bool:
    """True while the exported snapshot ``snapshot_name`` can still be imported."""
    with connect(target) as conn:
        try:
            exported_snapshot_text(conn, snapshot_name)
            return True
        except SnapshotGoneError:
            return False


def _try_lock(conn: psycopg.Connection, key: int) -> bool:
    row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
    return bool(row and row[0])


def _workers_running(conn: psycopg.Connection, config: PipelineConfig) -> bool:
    """True while some snapshot process holds the worker lock."""
    if not _try_lock(conn, worker_lock_key(config)):
        return True
    conn.execute("SELECT pg_advisory_unlock(%s)", (worker_lock_key(config),))
    return False


def hold_snapshot(
    config: PipelineConfig, stop: threading.Event | None = None, max_seconds: float = 6 * 3600, poll: float = 1.0
) -> bool:
    """Export a snapshot (creating the slot if it does not exist), advertise it, and hold it until
    every table's snapshot is complete, ``stop`` is set, ``max_seconds`` pass, or no snapshot process
    has run for ``snapshot.holder_idle_seconds``.

    Returns False without doing anything when another holder runs or every table is complete.
    """
    from ..validation import check_startup

    stop = stop or threading.Event()
    keys = {table.key for table in config.tables}
    with connect(config.state_connection) as lock_conn:
        if not _try_lock(lock_conn, holder_lock_key(config)):
            return False
        with CoordinationStore(config.state_connection) as store:

            def all_complete() -> bool:
                states = store.table_states()
                return all(key in states and states[key].snapshot_complete for key in keys)

            report = check_startup(config, store)  # also creates the coordination tables
            create_slot = report.slot is None
            store.publish_exported_snapshot(None)  # what a killed holder advertised is void
            if all_complete():
                return False
            with SnapshotHolder(config, store, create_slot) as holder:
                # Only tables in the publication as the snapshot sees it can start from it: the holder
                # lets go once those are complete, for a newer snapshot to serve tables added since.
                keys = published_keys_seen_by(
                    config.source, holder.advertised.name, config.replication.publication, list(report.tables.values())
                )
                store.publish_exported_snapshot(holder.advertised)
                try:
                    deadline = time.monotonic() + max_seconds
                    last_busy = time.monotonic()
                    while not stop.is_set() and time.monotonic() < deadline and not all_complete():
                        if _workers_running(lock_conn, config):
                            last_busy = time.monotonic()
                        elif time.monotonic() - last_busy > config.snapshot.holder_idle_seconds:
                            break
                        stop.wait(poll)
                finally:
                    store.publish_exported_snapshot(None)
        return True


@contextlib.contextmanager
def working_on_snapshot(config: PipelineConfig) -> Iterator[None]:
    """Hold the shared worker lock for the duration: the holder waits while any process holds it."""
    with connect(config.state_connection) as conn:
        conn.execute("SELECT pg_advisory_lock_shared(%s)", (worker_lock_key(config),))
        yield


def spawn_holder(config: PipelineConfig, max_seconds: float) -> subprocess.Popen[bytes]:
    """Start :func:`hold_snapshot` in a detached process that outlives the caller (see holder_process)."""
    return spawn_with_config([*HOLDER_COMMAND, str(max_seconds)], config)


class HolderThread(threading.Thread):
    """:func:`hold_snapshot` in a thread of this process, until ``stop`` is set; keeps its error."""

    def __init__(self, config: PipelineConfig, stop: threading.Event) -> None:
        super().__init__(name="snapshot-holder", daemon=True)
        self.config = config
        self.stop = stop
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            hold_snapshot(self.config, self.stop)
        except BaseException as exc:  # reported by holder_error to the process that waits for it
            self.error = exc


def holder_error(alive: HolderThread | subprocess.Popen[bytes]) -> str:
    """Why a holder that stopped without a snapshot stopped: its error, or its stderr."""
    if isinstance(alive, HolderThread):
        return str(alive.error or "")
    return detached_error(alive)


def _report_slot_wait(config: PipelineConfig, waited: float) -> None:
    """Say why no snapshot is advertised yet: the slot's creation waits for open transactions."""
    waiting_for: list[str] = []
    with contextlib.suppress(psycopg.Error, Pg2IcebergError), connect(config.source) as conn:
        waiting_for = transactions_holding_slot_creation(conn)
    if waiting_for:
        log.warning(
            "waited %.0f s for the snapshot holder: creating the replication slot waits for the transactions open "
            "when it began to end; the oldest: %s (commit or end them: SELECT pg_terminate_backend(pid))",
            waited,
            "; ".join(waiting_for),
        )


def wait_for_advertised_snapshot(
    store: CoordinationStore,
    config: PipelineConfig,
    alive: HolderThread | subprocess.Popen[bytes],
    timeout: float = 300.0,
) -> AdvertisedSnapshot | None:
    """Wait until a holder advertises its snapshot; None when ``alive`` (the holder we started) ended
    without one and no other holder lives. Creating a slot waits for running transactions to end:
    every ``SLOT_WAIT_REPORT_SECONDS`` a warning names the oldest, and after ``timeout`` they are
    refused with."""
    started = time.monotonic()
    deadline = started + timeout
    next_report = started + SLOT_WAIT_REPORT_SECONDS
    while time.monotonic() < deadline:
        if time.monotonic() >= next_report:
            _report_slot_wait(config, time.monotonic() - started)
            next_report += SLOT_WAIT_REPORT_SECONDS
        ended = not alive.is_alive() if isinstance(alive, HolderThread) else alive.poll() is not None
        advertised = store.exported_snapshot(holder_lock_key(config))
        # A holder killed before it could withdraw its advertisement leaves it behind: only an
        # importable one is the new holder's.
        if advertised and snapshot_importable(config.source, advertised.name):
            return advertised
        if ended and not store.holder_alive(config.replication.slot):
            return None  # (a holder started at the same moment by another process may have won: wait for it)
        time.sleep(0.1)
    with connect(config.source) as conn:
        waiting_for = transactions_holding_slot_creation(conn)
    raise StartupCheckError(
        f"no exported snapshot after {timeout:.0f} s: creating the replication slot waits for the transactions "
        f"open when it began to end ({'; '.join(waiting_for) or 'none open now: run the snapshot again'}); commit or "
        "end them (SELECT pg_terminate_backend(pid)), then run the snapshot again"
    )
