"""End to end under `dagster dev`: nobody clicks. The planner sensor plans chunks, automation takes the
snapshot and merges, the flusher sensor stages WAL; a source write is observed landing in Iceberg
through Dagster's own instance API, both tables it touched merged by one run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import AssetKey, DagsterInstance, DagsterRunStatus, RunsFilter

from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.materializer.warm_spark import stop_server
from pg2iceberg_dagster.quickstart import dagster_dev_command

from .conftest import SourceDb, assert_mirrored

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_SECONDS = 300
TABLES = ("orders", "customers")
FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
RUNS_BEFORE_WRITE_SECONDS = 120  # how far back a failure lists the runs around the write


@pytest.fixture
def dagster_dev(source: SourceDb, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    for table in TABLES:
        source.execute(f"CREATE TABLE public.{table} (id int PRIMARY KEY, v text)")
        source.execute(f"INSERT INTO public.{table} SELECT g, 'v' || g FROM generate_series(1, 500) g")
    # No minimum run interval: the snapshots' merges run a table at a time, and a table merged less than
    # the interval before the write would wait while the other one's run went ahead (two runs, rightly).
    # Quiet tables are checked once, so no quiet run takes one table's change before the write's run.
    config = source.config(
        [f"public.{table}" for table in TABLES],
        flush={"interval_seconds": 0.5},
        materialize={"min_run_interval_seconds": 0},
        checks={"quiet_interval_seconds": 3600},
    )
    config_path = tmp_path / "pg2iceberg.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\nnux:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home), "PG2ICEBERG_CONFIG": str(config_path)}
    log = open(tmp_path / "dagster_dev.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        dagster_dev_command(free_port()),
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield home, source.name
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: only dagster dev's processes
            process.wait()
        log.close()
        stop_server(config)  # the merge runs' warm Spark driver (a detached process of its own)


def _wait(predicate, what: str, log_hint: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}; see {log_hint}")


@pytest.mark.usefixtures("spark")
def test_a_source_write_lands_in_iceberg_with_nobody_clicking(
    dagster_dev: tuple[Path, str], source: SourceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, name = dagster_dev
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # for DagsterInstance.get(); restored after the test
    live = [AssetKey(["iceberg", f"{name}_public", table]) for table in TABLES]
    snapshots = [AssetKey(["iceberg", f"{name}_public", f"{table}_snapshot"]) for table in TABLES]
    log = tmp_path / "dagster_dev.log"
    with DagsterInstance.get() as instance:
        _wait(lambda: all(instance.get_latest_materialization_event(s) for s in snapshots), "the snapshots", log)
        # Quiet first: a merge run the snapshots set off and still running when the write lands would take
        # one table's change while the next tick requests the other (two runs, rightly).
        _wait(lambda: _settled(instance, live), "the merges that follow the snapshots", log)
        written_at = time.time()
        # One transaction over both tables: both lag from the same flush, so one tick requests both.
        source.execute(
            "INSERT INTO public.orders VALUES (100000, 'written while dagster runs');"
            "UPDATE public.orders SET v = 'updated' WHERE id = 1; DELETE FROM public.customers WHERE id = 2"
        )

        def merged(key: AssetKey) -> Any:
            event = instance.get_latest_materialization_event(key)
            if (
                event is not None
                and event.timestamp > written_at
                and event.asset_materialization.metadata["lag"].value == 0
                and event.asset_materialization.metadata["mat_cursor"].value >= 1
            ):
                return event
            return None

        _wait(lambda: all(merged(key) for key in live), "an automated merge of the write", log)
        assert len({merged(key).run_id for key in live}) == 1, (
            f"both lagging tables merged by one run; {_runs_around(instance, written_at)}"
        )
    pipeline = source.pipeline(source.config([f"public.{table}" for table in TABLES]))
    rows = {r["id"]: r["v"] for r in pipeline.catalog.load_table(f"{name}_public.orders").scan().to_arrow().to_pylist()}
    assert rows[100000] == "written while dagster runs" and rows[1] == "updated"
    assert_mirrored(pipeline)


def _runs_around(instance: DagsterInstance, written_at: float) -> str:
    """The runs created from ``RUNS_BEFORE_WRITE_SECONDS`` before the write on (seconds from it, status,
    tags): what to read when the write took two runs."""
    since = datetime.fromtimestamp(written_at - RUNS_BEFORE_WRITE_SECONDS, UTC)
    records = instance.get_run_records(filters=RunsFilter(created_after=since))
    lines = [
        f"{record.create_timestamp.timestamp() - written_at:+.1f} s {record.dagster_run.job_name} "
        f"{record.dagster_run.status.value} {dict(record.dagster_run.tags)}"
        for record in sorted(records, key=lambda record: record.create_timestamp)
    ]
    heading = f"runs created in the {RUNS_BEFORE_WRITE_SECONDS} s before the write and since (seconds from it):"
    return "\n".join([heading, *lines])


def _settled(instance: DagsterInstance, live: list[AssetKey]) -> bool:
    """Every live table materialized by a merge run and no run queued or going. The planner's report
    that a table's snapshot is complete is no merge run (it has no run id): the merge sensor's first
    run of that quiet table, for its checks, is still to come and would take one table's change."""
    going = instance.get_runs(filters=RunsFilter(statuses=[s for s in DagsterRunStatus if s not in FINISHED]))
    if going:
        return False
    events = [instance.get_latest_materialization_event(key) for key in live]
    return all(event is not None and event.run_id for event in events)


def test_quickstart_dagster_started_in_the_background_stops_on_sigterm(tmp_path: Path) -> None:
    """`quickstart --dagster` started where SIGINT is ignored (a shell's background job, which its
    children inherit) stops with its `dagster dev` on SIGTERM, what `kill` or a supervisor sends."""
    root = tmp_path / "quickstart"
    ui_port = free_port()
    command = [sys.executable, "-m", "pg2iceberg_dagster.cli", "quickstart", "--dagster", "--dir", str(root)]
    command += ["--port", str(free_port()), "--ui-port", str(ui_port), "--rows", "1000"]
    process = subprocess.Popen(
        ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command],  # SIGINT ignored, as for a background job
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    dagster_pids: list[int] = []
    try:
        _wait(lambda: _answers(f"http://127.0.0.1:{ui_port}/server_info"), "the Dagster UI", root)
        dagster_pids = [
            int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        ]
        assert dagster_pids, "dagster dev runs as the quickstart's child"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
        # dagster dev leads its own session; every process of it is gone.
        deadline = time.monotonic() + 60
        while any(_group_alive(pid) for pid in dagster_pids) and time.monotonic() < deadline:
            time.sleep(1)
        assert not any(_group_alive(pid) for pid in dagster_pids), "dagster dev's processes outlived the quickstart"
    finally:
        for group in [process.pid, *dagster_pids]:
            if _group_alive(group):
                os.killpg(group, signal.SIGKILL)
        process.wait()
        EmbeddedPostgres(root / "pg", port=0).stop()
        if (root / "pg2iceberg.yaml").exists():
            stop_server(load_config(root / "pg2iceberg.yaml"))


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_quickstart_runs_dg_dev_on_a_location_named_after_the_pipeline(tmp_path: Path) -> None:
    """`quickstart --dagster` runs `dg dev` (what Dagster recommends over `dagster dev`) on a workspace
    whose code location is named after the pipeline's slot, not after the module `definitions`."""
    from pg2iceberg_dagster.config import parse_config
    from pg2iceberg_dagster.quickstart import config_for, write_workspace

    workspace = write_workspace(tmp_path, parse_config(config_for(tmp_path, 54329), "quickstart"))
    (entry,) = yaml.safe_load(workspace.read_text())["load_from"]
    assert entry["python_module"] == {
        "module_name": "definitions",
        "working_directory": str(ROOT),
        "location_name": "pg2iceberg_quickstart",
    }
    command = dagster_dev_command(3000, workspace)
    assert Path(command[0]).name == "dg" and command[1:4] == ["dev", "-w", str(workspace)]
    assert yaml.safe_load((ROOT / "workspace.yaml").read_text())["load_from"][0]["python_module"]["location_name"] == (
        "pg2iceberg"
    )
