"""Freshness under ``run``: while the materializer waits, committed changes are flushed and merged
without waiting for ``flush.interval_seconds``, and the mirror stays exact."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from pyiceberg.expressions import EqualTo

from pg2iceberg_dagster.pipeline import Pipeline

from .conftest import SourceDb, assert_mirrored, pipeline_running

pytestmark = pytest.mark.usefixtures("spark")

FLUSH_INTERVAL = 30.0
# Well under the flusher's 0.5 s read timeout: the stream is never silent, so no flush comes from a
# pause in the writes, only from the flush bounds.
WRITE_PERIOD = 0.05


class _Writer(threading.Thread):
    """Commits one single-row insert every WRITE_PERIOD until stopped; ``committed`` lists the ids."""

    def __init__(self, conninfo: str, first_id: int) -> None:
        super().__init__(name="writer", daemon=True)
        self.conninfo = conninfo
        self.next_id = first_id
        self.committed: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            while not self.stop.wait(WRITE_PERIOD):
                conn.execute("INSERT INTO public.items VALUES (%s, 'fresh')", (self.next_id,))
                self.committed.append(self.next_id)
                self.next_id += 1


def _visible(pipeline: Pipeline, identifier: str, row_id: int) -> bool:
    table = pipeline.catalog.load_table(identifier)
    return table.scan(row_filter=EqualTo("id", row_id), selected_fields=("id",)).to_arrow().num_rows == 1


def test_run_flushes_early_while_the_materializer_waits(source: SourceDb) -> None:
    """Continuous writes, ``flush.interval_seconds`` 30 s: a row committed after ``run`` started is
    readable in Iceberg before the flusher's first interval could have passed, most flushes batch
    many commits, and once the writes stop the table equals the source row by row."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'snapshot' FROM generate_series(1, 100) g")
    # (maintenance off: it would delete applied staged files, counted at the end)
    config = source.config(["public.items"], flush={"interval_seconds": FLUSH_INTERVAL}, maintenance={"enabled": False})
    assert config.flush.min_interval_seconds < FLUSH_INTERVAL
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    probe = source.pipeline(config)  # reads from this thread while run uses ``pipeline`` in its own
    identifier = f"{source.name}_public.items"
    writer = _Writer(source.conninfo, 101)
    # The flusher starts inside run, after this: no interval-driven flush can happen before the deadline.
    interval_ends = time.monotonic() + FLUSH_INTERVAL
    with pipeline_running(pipeline) as errors:
        writer.start()
        try:
            while not writer.committed:
                time.sleep(WRITE_PERIOD)
            first = writer.committed[0]
            seen = False
            while not seen and not errors and time.monotonic() < interval_ends:
                seen = _visible(probe, identifier, first)
                time.sleep(0.2)
            assert not errors, errors
            assert seen, f"row {first} not in Iceberg within flush.interval_seconds of the start of run"
        finally:
            writer.stop.set()
            writer.join()
        deadline = time.monotonic() + 120
        while not errors and time.monotonic() < deadline and not all(diff.ok for diff in probe.verify()):
            time.sleep(0.5)
    assert not errors, errors
    assert_mirrored(probe)
    # Early flushes are spaced by flush.min_interval_seconds: they batch commits, not one file each.
    staged_files = probe.store.log_entries("public.items", 0, 10**9)
    assert len(staged_files) < len(writer.committed) / 2, (len(staged_files), len(writer.committed))


def test_a_dagster_flusher_tick_stages_at_the_minimum_interval(source: SourceDb) -> None:
    """The flusher sensor's tick (``Pipeline.flush_tick``) under continuous writes and a 30 s
    ``flush.interval_seconds``: merge runs are other processes, so the tick stages every
    ``min_interval_seconds`` instead of holding its commits for the interval (or the end of the tick);
    every change is in the staged log, each once."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    config = source.config(["public.items"], flush={"interval_seconds": FLUSH_INTERVAL, "min_interval_seconds": 0.5})
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    writer = _Writer(source.conninfo, 1)
    writer.start()
    try:
        tick = pipeline.flush_tick(max_seconds=4.0)
    finally:
        writer.stop.set()
        writer.join()
    assert tick is not None
    entries = pipeline.store.log_entries("public.items", 0)
    assert len(entries) >= 3, "several flushes within one 4 s tick"
    pipeline.stream(until_caught_up=True)
    pipeline.materialize()
    assert_mirrored(pipeline)
