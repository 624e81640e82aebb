"""Keeping the slot's exported snapshot importable while chunks are read, in-process or as a holder process.

The snapshot stays valid only while the replication connection that created the slot stays open
and idle. :class:`SnapshotHolder` is that connection. :func:`hold_snapshot` runs it as a process of
its own that outlives any one chunk run (the Dagster case): it advertises the snapshot's name in
coordination under an advisory lock, so runs in other processes can import it, and it lets go once
every configured table's snapshot is complete.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import zlib

import psycopg

from ..config import PipelineConfig
from ..coordination.store import CoordinationStore
from ..source.connection import connect
from ..source.replication import create_slot_with_snapshot


def holder_lock_key(config: PipelineConfig) -> int:
    """The advisory lock a holder process holds while its snapshot is advertised."""
    return zlib.crc32(f"pg2iceberg:snapshot-holder:{config.replication.slot}".encode()) & 0x7FFFFFFF


class SnapshotHolder:
    """Creates the slot and holds its exported snapshot open until closed."""

    def __init__(self, config: PipelineConfig, store: CoordinationStore) -> None:
        self._conn: psycopg.Connection = connect(config.source, replication=True)
        created = create_slot_with_snapshot(self._conn, config.replication.slot)
        store.record_slot_created(created.consistent_point)
        self.snapshot_name = created.snapshot_name
        self.consistent_point = created.consistent_point

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SnapshotHolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def hold_snapshot(
    config: PipelineConfig, stop: threading.Event | None = None, max_seconds: float = 6 * 3600, poll: float = 1.0
) -> bool:
    """Create the slot, advertise its exported snapshot, and hold it until every table is snapshotted.

    Returns False without doing anything when another holder runs or the slot already exists (its
    snapshot cannot be exported again). ``max_seconds`` bounds how long the source's xmin is held back.
    """
    from ..validation import check_startup

    stop = stop or threading.Event()
    lock_conn = connect(config.state_connection)
    try:
        locked = lock_conn.execute("SELECT pg_try_advisory_lock(%s)", (holder_lock_key(config),)).fetchone()
        if not locked or not locked[0]:
            return False
        with CoordinationStore(config.state_connection) as store:
            if check_startup(config, store).slot is not None:
                return False
            with SnapshotHolder(config, store) as holder:
                store.publish_exported_snapshot(holder.snapshot_name)
                try:
                    deadline = time.monotonic() + max_seconds
                    keys = {table.key for table in config.tables}
                    while not stop.is_set() and time.monotonic() < deadline:
                        states = store.table_states()
                        if all(key in states and states[key].snapshot_complete for key in keys):
                            break
                        stop.wait(poll)
                finally:
                    store.publish_exported_snapshot(None)
        return True
    finally:
        lock_conn.close()


def spawn_holder(config_path: str, max_seconds: float, log_path: str | None = None) -> subprocess.Popen[bytes]:
    """Start ``pg2iceberg-dagster hold-snapshot`` as a detached process that outlives the caller."""
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pg2iceberg_dagster.cli",
            "-c",
            config_path,
            "hold-snapshot",
            "--max-seconds",
            str(max_seconds),
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
        env=os.environ.copy(),
    )


def wait_for_advertised_snapshot(
    store: CoordinationStore, config: PipelineConfig, process: subprocess.Popen[bytes] | None, timeout: float = 120.0
) -> str | None:
    """Wait until a holder advertises its snapshot; None when the holder exited without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        name = store.exported_snapshot(holder_lock_key(config))
        if name:
            return name
        if process is not None and process.poll() is not None:
            return store.exported_snapshot(holder_lock_key(config))
        time.sleep(0.2)
    return None
