"""Prometheus metrics, scraped over HTTP for real and compared with what the live PostgreSQL and
Iceberg say at that moment: lag, retained WAL, slot and flushed positions, Iceberg files; merge
durations observed by ``run``; a scrape of an unreachable source; a busy port for ``run`` and for
the Dagster code location."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from dagster import build_sensor_context, instance_for_test
from prometheus_client.parser import text_string_to_metric_families

from pg2iceberg_dagster import metrics as metrics_module
from pg2iceberg_dagster import run_loop
from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.dagster_integration import Pg2IcebergResource, build_definitions
from pg2iceberg_dagster.embedded import free_port
from pg2iceberg_dagster.metrics import PipelineMetrics, serve_metrics
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.source.lsn import parse_lsn

from .conftest import SourceDb, assert_mirrored, pipeline_running, running, sync

TABLE = "public.orders"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample the endpoint serves now: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _write(path: Path, config: PipelineConfig) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))


def _create_orders(source: SourceDb, rows: int = 300) -> None:
    source.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, amount numeric(10, 2), note text)")
    source.execute(f"INSERT INTO {TABLE} SELECT g, g * 1.5, 'n' || g FROM generate_series(1, {rows}) g")


def _retained_wal(source: SourceDb, slot: str) -> float:
    ((retained,),) = source.execute(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::float8 FROM pg_replication_slots "
        "WHERE slot_name = %s",
        (slot,),
    )
    return retained


def _oldest_unmerged_age(pipeline: Pipeline, cursor: int) -> float:
    """Seconds since the earliest source commit in the staged files holding an unmerged change, read
    directly."""
    row = pipeline.store.conn.execute(
        "SELECT extract(epoch FROM now() - min(first_commit_at))::float8 FROM _pg2iceberg.log_index "
        "WHERE table_name = %s AND end_offset > %s",
        (TABLE, cursor),
    ).fetchone()
    assert row is not None and row[0] is not None
    return row[0]


def _assert_iceberg_gauges(samples: Samples, pipeline: Pipeline) -> None:
    """Files, bytes, records and snapshots as the Iceberg table's own file listing has them."""
    table = pipeline.catalog.load_table(pipeline.tables[TABLE].iceberg)
    files = table.inspect.files().to_pylist()
    data = [f for f in files if f["content"] == 0]
    deletes = [f for f in files if f["content"] != 0]
    assert data
    assert value(samples, "pg2iceberg_iceberg_data_files", table=TABLE) == len(data)
    assert value(samples, "pg2iceberg_iceberg_delete_files", table=TABLE) == len(deletes)
    assert value(samples, "pg2iceberg_iceberg_bytes", table=TABLE) == sum(f["file_size_in_bytes"] for f in files)
    assert value(samples, "pg2iceberg_iceberg_records", table=TABLE) == sum(f["record_count"] for f in data)
    assert value(samples, "pg2iceberg_iceberg_snapshots", table=TABLE) == table.inspect.snapshots().num_rows


def _wait_for(condition: Callable[[], bool], errors: list[BaseException], what: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not errors:
        with contextlib.suppress(OSError):  # the endpoint is not up yet
            if condition():
                return
        time.sleep(0.5)
    raise AssertionError(f"not {what}: {errors}")


@pytest.mark.usefixtures("spark")
def test_scraped_metrics_equal_what_postgres_and_iceberg_say(source: SourceDb, tmp_path: Path) -> None:
    _create_orders(source)
    config = source.config([TABLE], materialize={"interval_seconds": 0.5})
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    source.execute(f"UPDATE {TABLE} SET note = 'merged' WHERE id <= 40")
    sync(pipeline)
    # Staged, not merged: lag.
    source.execute(f"UPDATE {TABLE} SET amount = amount + 1 WHERE id BETWEEN 100 AND 160")
    source.execute(f"DELETE FROM {TABLE} WHERE id > 290")
    pipeline.stream(until_caught_up=True)
    lag = pipeline.lag(TABLE)
    assert lag.changes == 61 + 10
    slot = config.replication.slot

    port = free_port()
    with serve_metrics(config, port):
        time.sleep(1.1)  # the oldest unmerged change is at least this old
        age_before = _oldest_unmerged_age(pipeline, lag.mat_cursor)
        retained_before = _retained_wal(source, slot)
        samples = scrape(port)
        retained_after = _retained_wal(source, slot)
        age_after = _oldest_unmerged_age(pipeline, lag.mat_cursor)

    for component in ("source", "state", "catalog"):
        assert value(samples, "pg2iceberg_up", component=component) == 1
    assert value(samples, "pg2iceberg_lag_changes", table=TABLE) == pipeline.lag(TABLE).changes == lag.changes
    assert age_before <= value(samples, "pg2iceberg_lag_seconds", table=TABLE) <= age_after
    assert age_before >= 1
    assert retained_before <= value(samples, "pg2iceberg_slot_retained_wal_bytes") <= retained_after
    assert retained_before > 0
    ((confirmed, active),) = source.execute(
        "SELECT confirmed_flush_lsn::text, active FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    )
    assert value(samples, "pg2iceberg_slot_confirmed_flush_lsn") == parse_lsn(confirmed)
    assert value(samples, "pg2iceberg_slot_active") == int(active) == 0
    assert value(samples, "pg2iceberg_flushed_lsn") == pipeline.store.flushed_lsn()
    _assert_iceberg_gauges(samples, pipeline)
    # Served, never observed yet: no merge ran in that process.
    assert ("pg2iceberg_merge_duration_seconds_count", (("table", TABLE),)) not in samples
    pipeline.close()

    # ``run`` serves the same on its config's port while it merges what was staged.
    config = config.model_copy(update={"metrics": config.metrics.model_copy(update={"port": free_port()})})
    path = tmp_path / "pg2iceberg.yaml"
    _write(path, config)
    merged: list[Samples] = []

    def merged_and_reported() -> bool:
        samples = scrape(config.metrics.port)  # type: ignore[arg-type]
        merged[:] = [samples]
        return value(samples, "pg2iceberg_lag_changes", table=TABLE) == 0 and (
            ("pg2iceberg_merge_duration_seconds_count", (("table", TABLE),)) in samples
        )

    with running(path) as errors:
        _wait_for(merged_and_reported, errors, "merged and reported")
        source.execute(f"INSERT INTO {TABLE} VALUES (1000, 1, 'while running')")
        _wait_for(
            lambda: (
                merged_and_reported() and value(merged[0], "pg2iceberg_merge_duration_seconds_count", table=TABLE) >= 2
            ),
            errors,
            "a second merge reported",
        )
        with Pipeline(config) as probe:
            assert probe.lag(TABLE).changes == 0
            samples = scrape(config.metrics.port)  # type: ignore[arg-type]
            assert value(samples, "pg2iceberg_lag_changes", table=TABLE) == 0
            assert value(samples, "pg2iceberg_lag_seconds", table=TABLE) == 0
            assert value(samples, "pg2iceberg_merge_duration_seconds_sum", table=TABLE) > 0
            assert value(samples, "pg2iceberg_merge_duration_seconds_bucket", table=TABLE, le="+Inf") == value(
                samples, "pg2iceberg_merge_duration_seconds_count", table=TABLE
            )
            _assert_iceberg_gauges(samples, probe)
            assert_mirrored(probe)
    # Stopped with ``run``: the port is free again for the next one.
    with serve_metrics(config) as again:
        assert again.server is not None and again.server.port == config.metrics.port


def test_a_scrape_of_an_unreachable_source_reports_it_down(
    source: SourceDb, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing listens on the source's port: the scrape answers, with up 0 for the source and the
    coordination state (the same server) and 1 for the catalog; the password is in no log line."""
    secret = "metrics-secret-7f3a"
    monkeypatch.setenv("PG2ICEBERG_TEST_METRICS_PASSWORD", secret)
    dead = source.config([TABLE]).model_dump(mode="json", exclude_none=True)
    dead["source"].update(port=free_port(), password_env="PG2ICEBERG_TEST_METRICS_PASSWORD")
    config = PipelineConfig.model_validate(dead)
    caplog.set_level(logging.WARNING, logger="pg2iceberg_dagster.metrics")
    port = free_port()
    with serve_metrics(config, port):
        samples = scrape(port)
        again = scrape(port)  # and the next scrape tries again
    for scraped in (samples, again):
        assert value(scraped, "pg2iceberg_up", component="source") == 0
        assert value(scraped, "pg2iceberg_up", component="state") == 0
        assert value(scraped, "pg2iceberg_up", component="catalog") == 1
        assert not any(name == "pg2iceberg_lag_changes" for name, _ in scraped)
    assert f"cannot read the source: cannot connect to postgresql://postgres@127.0.0.1:{config.source.port}/" in (
        caplog.text
    )
    assert secret not in caplog.text


def test_run_refuses_a_metrics_port_in_use(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pg2iceberg.yaml"
    _write(path, source.config([TABLE]))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["-c", str(path), "run", "--metrics-port", str(port)]) == 1
    error = capsys.readouterr().err
    assert f"cannot serve metrics on 127.0.0.1:{port}: the port is already in use" in error
    # Refused before anything ran: no slot, no coordination schema.
    assert not source.execute("SELECT 1 FROM pg_replication_slots WHERE database = current_database()")
    assert not source.execute("SELECT 1 FROM pg_namespace WHERE nspname = '_pg2iceberg'")


def test_the_flusher_sensors_process_serves_metrics_once(
    source: SourceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first flusher tick of a code location serves the metrics; later ticks do not start again;
    another process finding the port taken warns and goes on ticking."""
    monkeypatch.setattr(metrics_module, "_process_metrics", [])  # a fresh process
    _create_orders(source, rows=50)
    port = free_port()
    config = source.config([TABLE], metrics={"port": port})
    path = tmp_path / "pg2iceberg.yaml"
    _write(path, config)
    with Pipeline(config) as pipeline:
        pipeline.snapshot()
    source.execute(f"UPDATE {TABLE} SET note = 'staged by the sensor' WHERE id <= 7")
    defs = build_definitions(path)
    sensor = defs.resolve_sensor_def("pg2iceberg_flusher")
    resources = {"pg2iceberg": Pg2IcebergResource(config_path=str(path))}
    served: list[PipelineMetrics] = []
    try:
        with instance_for_test() as instance:
            for _ in range(2):
                with build_sensor_context(instance=instance, resources=resources) as context:
                    sensor(context)
                assert len(metrics_module._process_metrics) == 1
                served = [m for m in metrics_module._process_metrics if m is not None]
                assert served and served[0].server is not None and served[0].server.port == port
            samples = scrape(port)
            with Pipeline(config) as pipeline:
                assert value(samples, "pg2iceberg_lag_changes", table=TABLE) == pipeline.lag(TABLE).changes == 7
            assert value(samples, "pg2iceberg_up", component="source") == 1

            # Another process loading the definitions: the port is taken, the tick goes on.
            monkeypatch.setattr(metrics_module, "_process_metrics", [])
            caplog.set_level(logging.WARNING, logger="pg2iceberg_dagster.metrics")
            source.execute(f"UPDATE {TABLE} SET note = 'second process' WHERE id = 20")
            with build_sensor_context(instance=instance, resources=resources) as context:
                result = sensor(context)
            assert metrics_module._process_metrics == [None]
            assert f"cannot serve metrics on 127.0.0.1:{port}: the port is already in use" in caplog.text
            assert result.asset_events  # it still staged the change
    finally:
        for metrics in served:
            metrics.close()


@pytest.mark.usefixtures("spark")
def test_run_says_what_it_merged_and_what_lags(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` prints a line on what it merged every minute (here every second): the changes it
    counts are the ones written, and once merged nothing lags."""
    source.execute("CREATE TABLE public.progress (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.progress SELECT g, 'v' FROM generate_series(1, 10) g")
    monkeypatch.setattr(run_loop, "PROGRESS_SECONDS", 1.0)
    pipeline = source.pipeline(source.config(["public.progress"]))
    lines: list[str] = []

    def merged() -> int:
        return sum(int(m.group(1).replace(",", "")) for m in map(_MERGED.match, lines) if m)

    with pipeline_running(pipeline, interval=0.5, on_progress=lines.append) as errors:
        _wait_until(lambda: bool(lines) or bool(errors), "run's first progress line")
        source.execute("INSERT INTO public.progress SELECT g, 'new' FROM generate_series(100, 129) g")
        source.execute("UPDATE public.progress SET v = 'changed' WHERE id <= 5")
        _wait_until(lambda: (merged() >= 35 and lines[-1].endswith("no table lags")) or bool(errors), "the merge")
    assert not errors, errors
    assert merged() == 35, lines
    assert any(_MERGED.match(line) and "into 1 tables" in line for line in lines), lines
    assert_mirrored(pipeline)


_MERGED = re.compile(r"merged ([\d,]+) changes into \d+ tables in the last \d+ s; ")


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
