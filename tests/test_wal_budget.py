"""The slot's WAL budget (issue 31 part 3): from two readings of a slot nobody streams from, the rate its
``safe_wal_size`` shrinks at and the time until it loses WAL; ``slot_safe`` warns within the horizon
before the fraction rule fires; and the estimate reaches Dagster, ``status`` and the metrics. Real
PostgreSQL (a throwaway cluster with a small ``max_slot_wal_keep_size``; the shared one for unlimited);
no clock is read by the assertions: the readings' own timestamps (the server's) are the only time."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from prometheus_client.core import Metric

from pg2iceberg_dagster import run_loop
from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.coordination.records import SlotReading
from pg2iceberg_dagster.dagster_integration.mirror import Mirror
from pg2iceberg_dagster.dagster_integration.slot import slot_check_evaluation, slot_observation
from pg2iceberg_dagster.dagster_integration.translator import Pg2IcebergTranslator
from pg2iceberg_dagster.metrics import PipelineCollector
from pg2iceberg_dagster.validation import SlotInfo, slot_safety
from pg2iceberg_dagster.wal_budget import RATE_TIME_CONSTANT_SECONDS, next_reading, seconds_until_lost, with_budget

from .conftest import SourceDb, config_on, pipeline_running

MB = 1024 * 1024
WARNING = re.compile(
    r"at the current rate of ([\d.]+) MB/s the replication slot \w+ loses WAL in about ([\d.]+) minutes"
)


def _emit_wal(conninfo: str, megabytes: int) -> None:
    """Write about ``megabytes`` of WAL (logical messages: no table, nothing for the slot to decode)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_logical_emit_message(false, 'budget', repeat('x', 1000000)) FROM generate_series(1, %s)",
            (megabytes,),
        )


def _gauges(config: PipelineConfig) -> dict[str, float]:
    """One scrape of the collector: gauge name -> value (the unlabeled ones this test reads)."""
    collector = PipelineCollector(config)
    try:
        families: list[Metric] = list(collector.collect())
    finally:
        collector.close()
    return {sample.name: sample.value for family in families for sample in family.samples if not sample.labels}


def _slot(read_at: datetime, wal_lsn: int, safe: int | None, keep: int | None = 64 * MB) -> SlotInfo:
    return SlotInfo(
        plugin="pgoutput",
        database="db",
        confirmed_flush_lsn=None,
        wal_status="reserved",
        active_pid=None,
        safe_wal_size_bytes=safe,
        max_slot_wal_keep_size_bytes=keep,
        read_at=read_at,
        wal_lsn=wal_lsn,
    )


def test_rates_are_smoothed_over_time_and_start_from_the_first_pair() -> None:
    """The arithmetic alone, on readings dated by hand."""
    start = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
    first = next_reading(None, _slot(start, 1000 * MB, 60 * MB))
    assert first == SlotReading(start, 1000 * MB, 60 * MB)  # one reading: no rate yet

    # 10 s later, 10 MB written, none won back: 1 MB/s both ways; 50 MB left is 50 s.
    later = _slot(start + timedelta(seconds=10), 1010 * MB, 50 * MB)
    second = next_reading(first, later)
    assert second is not None and second.wal_write_rate == second.safe_wal_shrink_rate == 1 * MB
    assert with_budget(later, second).seconds_until_lost == 50

    # A reading older than the stored one (it arrived late) changes nothing.
    assert next_reading(second, _slot(start + timedelta(seconds=5), 1005 * MB, 55 * MB)) is second

    # One time constant later at 3 MB/s: the rate moves (1 - 1/e) of the way there.
    third = next_reading(
        second, _slot(later.read_at + timedelta(seconds=RATE_TIME_CONSTANT_SECONDS), 1010 * MB + 900 * MB, 50 * MB)
    )
    assert third is not None and third.wal_write_rate == pytest.approx(MB + 2 * MB * (1 - math.exp(-1)))
    assert third.safe_wal_shrink_rate == pytest.approx(MB * math.exp(-1))  # safe_wal_size did not move

    # safe_wal_size growing back (the flusher acknowledged) is no estimate; unlimited keep size neither.
    assert seconds_until_lost(later, -1.0) is None and seconds_until_lost(later, 0.0) is None
    assert seconds_until_lost(_slot(start, 0, None, keep=None), 1.0) is None


def test_a_slot_nobody_streams_from_warns_minutes_before_it_loses_wal(
    source: SourceDb, make_cluster: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = make_cluster(conf=["max_slot_wal_keep_size = 64MB", "wal_keep_size = 0"])
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO public.t SELECT g, 'v' FROM generate_series(1, 100) g")
    config = config_on(
        source,
        cluster,
        ["public.t"],
        # A horizon far longer than any rate this machine reaches, so the rule fires whatever the speed.
        replication={"slot": "slot_budget", "publication": "pub_budget", "slot_warn_minutes_until_lost": 1e9},
    )
    pipeline = source.pipeline(config)
    pipeline.snapshot()  # creates the slot; nobody streams from it afterwards

    first = pipeline.slot()
    assert first is not None and first.safe_wal_size_bytes is not None and first.safe_wal_size_bytes > 40 * MB
    _emit_wal(cluster.conninfo(), 2)
    second = pipeline.slot()
    assert second is not None and second.safe_wal_size_bytes is not None and first.wal_lsn is not None
    assert second.wal_lsn is not None and second.wal_lsn - first.wal_lsn >= 2_000_000
    written, shrinking = second.wal_write_bytes_per_second, second.safe_wal_shrink_bytes_per_second
    assert written is not None and written > 0
    # restart_lsn stays put, so safe_wal_size shrank by the WAL written (read in one statement each).
    assert shrinking is not None and shrinking > 0 and shrinking == pytest.approx(written, rel=0.1)
    assert second.seconds_until_lost is not None and math.isfinite(second.seconds_until_lost)
    assert second.seconds_until_lost == pytest.approx(second.safe_wal_size_bytes / shrinking)
    assert second.seconds_until_lost > 0

    # The fraction rule has not fired (over 60% of max_slot_wal_keep_size left): with the horizon off,
    # the slot is ok; with it on, the check warns naming the minutes and the rate.
    off = config.replication.model_copy(update={"slot_warn_minutes_until_lost": 0})
    assert slot_safety(second, off).level == "ok"
    safety = slot_safety(second, config.replication)
    assert safety.level == "warn"
    found = WARNING.search(safety.reason)
    assert found is not None, safety.reason
    assert float(found.group(1)) == pytest.approx(shrinking / MB, abs=0.005)
    assert float(found.group(2)) == pytest.approx(second.seconds_until_lost / 60, abs=0.05)
    assert "raise max_slot_wal_keep_size (now 64.0 MB" in safety.reason and "repair" in safety.reason

    # Dagster: the check WARNs with that text, the observation carries the budget.
    mirror = Mirror(Pg2IcebergTranslator(config))
    check = slot_check_evaluation(mirror, second)
    assert not check.passed and check.description == safety.reason
    assert check.metadata["slot_warn_minutes_until_lost"].value == 1e9
    observed = slot_observation(mirror, second).metadata
    assert observed["wal_write_bytes_per_second"].value == round(written, 1)
    assert observed["safe_wal_shrink_bytes_per_second"].value == round(shrinking, 1)
    assert observed["minutes_until_lost"].value == round(second.seconds_until_lost / 60, 2)

    # `status`: the budget and the warning, measured from the last reading (whoever took it).
    _emit_wal(cluster.conninfo(), 1)
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    capsys.readouterr()
    assert main(["-c", str(path), "status"]) == 0
    out = capsys.readouterr().out
    assert '"minutes_until_lost": ' in out and '"wal_write_bytes_per_second": ' in out
    assert "slot warn: " in out and WARNING.search(out)

    # Metrics: a scrape is one more reading of the same series.
    _emit_wal(cluster.conninfo(), 1)
    gauges = _gauges(config)
    assert gauges["pg2iceberg_slot_seconds_until_lost"] > 0
    assert gauges["pg2iceberg_slot_wal_write_bytes_per_second"] > 0
    assert gauges["pg2iceberg_slot_safe_wal_shrink_bytes_per_second"] > 0
    assert 0 < gauges["pg2iceberg_slot_safe_wal_bytes"] < second.safe_wal_size_bytes
    assert gauges["pg2iceberg_slot_max_wal_keep_bytes"] == 64 * MB


def test_unlimited_keep_size_has_no_estimate_and_no_warning(source: SourceDb) -> None:
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    config = source.config(["public.t"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    first = pipeline.slot()
    _emit_wal(source.conninfo, 2)
    second = pipeline.slot()
    assert first is not None and second is not None and second.max_slot_wal_keep_size_bytes is None
    assert second.safe_wal_size_bytes is None
    assert second.wal_write_bytes_per_second is not None and second.wal_write_bytes_per_second > 0
    assert second.safe_wal_shrink_bytes_per_second is None and second.seconds_until_lost is None
    high = config.replication.model_copy(update={"slot_warn_minutes_until_lost": 1e9})
    assert slot_safety(second, high).level == "ok"
    gauges = _gauges(config)
    assert "pg2iceberg_slot_seconds_until_lost" not in gauges and "pg2iceberg_slot_safe_wal_bytes" not in gauges
    assert gauges["pg2iceberg_slot_wal_write_bytes_per_second"] >= 0


@pytest.mark.usefixtures("spark")
def test_run_reads_its_slot_on_its_own(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` takes WAL-budget readings itself (every SLOT_READING_SECONDS, shortened here): with no
    `status` and no metrics scrape, the coordination store holds a reading with a measured WAL rate."""
    monkeypatch.setattr(run_loop, "SLOT_READING_SECONDS", 0.2)
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    config = source.config(["public.t"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    query = "SELECT read_at, wal_write_rate FROM _pg2iceberg.slot_readings WHERE slot_name = %s"
    assert source.execute(query, (config.replication.slot,)) == [], "the snapshot takes no reading"
    readings: set[datetime] = set()
    with pipeline_running(pipeline, interval=0.2) as errors:
        for _ in range(600):
            assert not errors, errors
            _emit_wal(source.conninfo, 1)
            rows = source.execute(query, (config.replication.slot,))
            readings.update(read_at for read_at, _rate in rows)
            if len(readings) >= 3 and rows[0][1] is not None:
                break
            time.sleep(0.1)
    ((_read_at, rate),) = rows
    assert len(readings) >= 3 and rate is not None and rate > 0
