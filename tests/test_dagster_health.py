"""What a data engineer reads in Dagster about the mirror's health (issue 30): lag in seconds, the live
tables' freshness policies (a table whose merges stop goes stale, a quiet one does not), the
replication slot's observations and its ``slot_safe`` check, and flusher ticks that say what they did.
Real PostgreSQL throughout; time is frozen only where Dagster's freshness evaluation reads it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    DagsterInstance,
    Definitions,
    SensorDefinition,
    SensorResult,
    build_sensor_context,
    instance_for_test,
)
from dagster._core.definitions.freshness import FreshnessState, TimeWindowFreshnessPolicy
from dagster._core.loader import LoadingContextForTest
from dagster._core.test_utils import freeze_time
from dagster._daemon.freshness import FreshnessDaemon

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.dagster_integration import Pg2IcebergResource, build_definitions
from pg2iceberg_dagster.dagster_integration.mirror import Mirror
from pg2iceberg_dagster.dagster_integration.sensors.flusher import flusher_sensor
from pg2iceberg_dagster.dagster_integration.slot import SLOT_SAFE, slot_check_evaluation
from pg2iceberg_dagster.dagster_integration.translator import Pg2IcebergTranslator
from pg2iceberg_dagster.errors import ConfigError
from pg2iceberg_dagster.source.lsn import parse_lsn
from pg2iceberg_dagster.validation import slot_safety

from .conftest import SourceDb, config_on

SLOT_KEY = AssetKey(["pg2iceberg", "replication_slot"])


def _write_config(config: PipelineConfig, tmp_path: Path) -> str:
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return str(path)


def _tick(sensor: SensorDefinition, instance: DagsterInstance, config_path: str) -> Any:
    """One tick of ``sensor``; its asset events are recorded as the sensor daemon records them."""
    with build_sensor_context(
        instance=instance, resources={"pg2iceberg": Pg2IcebergResource(config_path=config_path)}
    ) as context:
        result = sensor(context)
    for event in getattr(result, "asset_events", []):
        instance.report_runless_asset_event(event)
    return result


def _events(result: SensorResult, kind: type) -> dict[AssetKey, Any]:
    return {event.asset_key: event for event in result.asset_events if isinstance(event, kind)}


def _freshness(defs: Definitions, instance: DagsterInstance, key: AssetKey) -> FreshnessState:
    """The state Dagster's freshness daemon computes for ``key`` now (its own evaluator)."""
    node = defs.resolve_asset_graph().get(key)
    daemon = FreshnessDaemon()
    return asyncio.run(daemon._compute_asset_freshness_state(context=LoadingContextForTest(instance), node=node))


def test_flusher_ticks_report_lag_the_slot_and_what_they_did(source: SourceDb, tmp_path: Path) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' FROM generate_series(1, 100) g")
    config = source.config(["public.orders"])
    source.pipeline(config).snapshot()
    config_path = _write_config(config, tmp_path)
    defs = build_definitions(config_path)
    flusher = defs.resolve_sensor_def("pg2iceberg_flusher")
    staged_log = AssetKey(["staged_log", "public", "orders_staged_log"])

    with instance_for_test() as instance:
        ((before_commit,),) = source.execute("SELECT clock_timestamp()")
        source.execute("INSERT INTO public.orders SELECT g, 'new' FROM generate_series(101, 150) g")
        ticked = _tick(flusher, instance, config_path)
        assert isinstance(ticked, SensorResult) and not ticked.run_requests
        flushed = _events(ticked, AssetMaterialization)[staged_log].metadata["flushed_lsn"].value
        # The tick says what it did (Dagster shows a tick without runs as skipped, with this text).
        assert ticked.skip_reason is not None
        assert ticked.skip_reason.skip_message == f"staged 50 changes of 1 tables up to LSN {flushed}"
        staged = _events(ticked, AssetMaterialization)[staged_log].metadata
        assert staged["changes_staged"].value == 50 and staged["lag"].value == 50
        assert staged["lag_seconds"].value >= 0  # the age of the oldest unmerged change
        # ...counted from its source commit time, which the log index records per staged file.
        ((first_commit, registered),) = source.execute(
            "SELECT first_commit_at, created_at FROM _pg2iceberg.log_index WHERE table_name = 'public.orders'"
        )
        assert before_commit <= first_commit <= registered

        # The slot's observation is what pg_replication_slots shows (read after the tick: nothing moved).
        observed = _events(ticked, AssetObservation)[SLOT_KEY].metadata
        with psycopg.connect(source.conninfo, autocommit=True) as conn:
            row = conn.execute(
                "SELECT wal_status, active, confirmed_flush_lsn::text, restart_lsn::text, "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, safe_wal_size "
                "FROM pg_replication_slots WHERE slot_name = %s",
                (config.replication.slot,),
            ).fetchone()
        assert row is not None
        wal_status, active, confirmed, restart, retained_now, safe = row
        assert observed["wal_status"].value == wal_status
        assert observed["active"].value == int(active) == 0  # the tick let go of the slot
        assert observed["confirmed_flush_lsn"].value == confirmed == flushed
        assert observed["confirmed_flush_lsn_bytes"].value == parse_lsn(confirmed)
        assert observed["restart_lsn"].value == restart and observed["restart_lsn_bytes"].value == parse_lsn(restart)
        assert 0 <= observed["retained_wal_bytes"].value <= retained_now  # WAL only grows after the tick
        assert safe is None and "safe_wal_size_bytes" not in observed  # max_slot_wal_keep_size = -1
        check = _events(ticked, AssetCheckEvaluation)[SLOT_KEY]
        assert check.check_name == SLOT_SAFE and check.passed

        # Nothing new: the tick says so, still observes the slot.
        again = _tick(flusher, instance, config_path)
        assert again.skip_reason.skip_message.startswith("no new changes; flushed to ")
        assert staged_log not in _events(again, AssetMaterialization)
        assert SLOT_KEY in _events(again, AssetObservation)
        # The second tick measures the WAL rate since the first (its reading is in the coordination
        # store); with max_slot_wal_keep_size unlimited there are no minutes until lost.
        budget = _events(again, AssetObservation)[SLOT_KEY].metadata
        assert budget["wal_write_bytes_per_second"].value >= 0 and "minutes_until_lost" not in budget
        # Recorded on the slot asset as the daemon records them: the UI plots these.
        recorded = instance.fetch_observations(SLOT_KEY, limit=10).records
        assert len(recorded) == 2


@pytest.mark.usefixtures("spark")
def test_a_table_whose_merges_stop_goes_stale_and_a_quiet_one_does_not(source: SourceDb, tmp_path: Path) -> None:
    """Freshness counts from a live table's last materialization: a quiet table gets one from the merge
    run (with its checks) the merge sensor requests every half warn window, so it stays fresh; a
    table whose merges stop while its changes pile up goes stale."""
    source.execute("CREATE TABLE public.busy (id int PRIMARY KEY, v text)")
    source.execute("CREATE TABLE public.quiet (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.busy SELECT g, 'v' FROM generate_series(1, 50) g")
    source.execute("INSERT INTO public.quiet SELECT g, 'v' FROM generate_series(1, 50) g")
    config = source.config(
        ["public.busy", "public.quiet"], dagster={"freshness_warn_seconds": 120, "freshness_fail_seconds": 300}
    )
    assert config.quiet_interval() == 60, "half the warn window"
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    config_path = _write_config(config, tmp_path)
    defs = build_definitions(config_path)
    ns = f"{source.name}_public"
    busy, quiet = AssetKey(["iceberg", ns, "busy"]), AssetKey(["iceberg", ns, "quiet"])
    policy = defs.resolve_assets_def(busy).specs_by_key[busy].freshness_policy
    assert isinstance(policy, TimeWindowFreshnessPolicy)
    assert policy.fail_window.to_timedelta().total_seconds() == 300
    planner = defs.resolve_sensor_def("pg2iceberg_snapshot_planner")
    merge = defs.resolve_sensor_def("pg2iceberg_merge")

    with instance_for_test() as instance:
        start = time.time()
        with freeze_time(start):
            # Both snapshots are complete: the planner reports both live tables materialized.
            _tick(planner, instance, config_path)
            assert _freshness(defs, instance, busy) == FreshnessState.PASS
            assert _freshness(defs, instance, quiet) == FreshnessState.PASS

        # Changes pile up in busy's staged log.
        source.execute("UPDATE public.busy SET v = 'changed'")
        pipeline.stream(until_caught_up=True)
        with freeze_time(start + 300 + 30):
            assert _freshness(defs, instance, quiet) == FreshnessState.FAIL, "no run since: stale"
            (request,) = _tick(merge, instance, config_path).run_requests
            assert sorted(request.asset_selection) == sorted([busy, quiet]), "busy lags; quiet is due a check"
            # busy's merges have stopped: only the quiet table's part of the run happens.
            job = defs.resolve_job_def("pg2iceberg_merge")
            ran = job.execute_in_process(instance=instance, asset_selection=[quiet], tags=request.tags)
            assert ran.success
            (materialized,) = ran.get_asset_materialization_events()
            assert materialized.materialization.metadata["changes_applied"].value == 0
            assert _freshness(defs, instance, busy) == FreshnessState.FAIL
            assert _freshness(defs, instance, quiet) == FreshnessState.PASS


def test_slot_safe_warns_before_the_slot_loses_wal_and_errors_once_lost(
    source: SourceDb, make_cluster: Callable[..., Any], tmp_path: Path
) -> None:
    cluster = make_cluster(conf=["max_slot_wal_keep_size = 64MB", "wal_keep_size = 0"])
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO public.t SELECT g, 'v' FROM generate_series(1, 100) g")
    config = config_on(
        source,
        cluster,
        ["public.t"],
        # The WAL budget rule is off: at the rate this test writes WAL it would warn first (test_wal_budget.py).
        replication={
            "slot": "slot_health",
            "publication": "pub_health",
            "slot_warn_safe_wal_fraction": 0.5,
            "slot_warn_minutes_until_lost": 0,
        },
    )
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    mirror = Mirror(Pg2IcebergTranslator(config))
    slot = pipeline.slot()
    assert slot is not None and slot.max_slot_wal_keep_size_bytes == 64 * 1024 * 1024
    assert slot.safe_wal_size_bytes is not None and slot.safe_wal_size_bytes > 32 * 1024 * 1024
    assert slot_safety(slot, config.replication).level == "ok"

    # Nobody streams: WAL grows until less than half of max_slot_wal_keep_size is left to go (safe_wal_size
    # moves a 16 MB segment at a time).
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        for _ in range(12):
            slot = pipeline.slot()
            assert slot is not None and slot.safe_wal_size_bytes is not None
            if slot.safe_wal_size_bytes < 32 * 1024 * 1024:
                break
            assert slot_safety(slot, config.replication).level == "ok"
            conn.execute(
                "SELECT pg_logical_emit_message(false, 'health', repeat('x', 1000000)) FROM generate_series(1, 8)"
            )
    assert slot.wal_status in ("reserved", "extended")
    assert slot.safe_wal_size_bytes < 32 * 1024 * 1024
    warned = slot_check_evaluation(mirror, slot)
    assert not warned.passed and warned.severity == AssetCheckSeverity.WARN
    assert "max_slot_wal_keep_size" in (warned.description or "")
    assert warned.metadata["safe_wal_size_bytes"].value == slot.safe_wal_size_bytes

    # Past it, a checkpoint removes the slot's WAL: lost, an error; the flusher tick reports it.
    deadline = time.monotonic() + 60
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        while (slot := pipeline.slot()) is not None and slot.wal_status != "lost":
            assert time.monotonic() < deadline, "the slot never lost its WAL"
            conn.execute(
                "SELECT pg_logical_emit_message(false, 'health', repeat('x', 1000000)) FROM generate_series(1, 20)"
            )
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
    config_path = _write_config(config, tmp_path)
    with instance_for_test() as instance:
        ticked = _tick(flusher_sensor(mirror, tick_seconds=2.0), instance, config_path)
    assert ticked.skip_reason.skip_message.startswith("flusher stopped: ")
    check = _events(ticked, AssetCheckEvaluation)[SLOT_KEY]
    assert not check.passed and check.severity == AssetCheckSeverity.ERROR
    assert "lost" in (check.description or "")
    assert _events(ticked, AssetObservation)[SLOT_KEY].metadata["wal_status"].value == "lost"


def test_a_tick_reports_at_most_its_share_of_staged_logs_and_later_ones_catch_up(
    source: SourceDb, tmp_path: Path
) -> None:
    """Many tables staged in one tick: the daemon stores a tick's events one at a time, so a tick
    reports at most ``staged_log_events`` staged logs, those waiting longest first; the others' changes
    wait in the cursor, and every change the source committed is reported exactly once."""
    tables = ["public.a", "public.b", "public.c"]
    for name in tables:
        source.execute(f"CREATE TABLE {name} (id int PRIMARY KEY)")
    config = source.config(tables)
    source.pipeline(config).snapshot()
    config_path = _write_config(config, tmp_path)
    flusher = flusher_sensor(Mirror(Pg2IcebergTranslator(config)), tick_seconds=2.0, staged_log_events=2)
    reported: dict[str, int] = dict.fromkeys(tables, 0)
    cursor: str | None = None

    def tick() -> tuple[list[str], str]:
        """One tick, carrying the cursor: the tables it reported, in its order, and what it says it did."""
        nonlocal cursor
        with (
            instance_for_test() as instance,
            build_sensor_context(
                instance=instance, resources={"pg2iceberg": Pg2IcebergResource(config_path=config_path)}, cursor=cursor
            ) as context,
        ):
            result = flusher(context)
            cursor = context.cursor
        keys = []
        for key, event in _events(result, AssetMaterialization).items():
            table = f"public.{key.path[-1].removesuffix('_staged_log')}"
            reported[table] += event.metadata["changes_staged"].value
            keys.append(table)
        return keys, result.skip_reason.skip_message

    source.execute("INSERT INTO public.a SELECT generate_series(1, 5)")
    source.execute("INSERT INTO public.b SELECT generate_series(1, 7)")
    source.execute("INSERT INTO public.c SELECT generate_series(1, 9)")
    keys, said = tick()
    assert keys == ["public.a", "public.b"]  # all three staged; c waits
    assert said.startswith("staged 21 changes of 3 tables") and said.endswith(
        "; 1 tables' staged logs to report at a later tick"
    )
    source.execute("INSERT INTO public.a SELECT generate_series(6, 8)")
    assert tick()[0] == ["public.c", "public.a"]  # c has waited longest
    keys, said = tick()
    assert keys == [] and said.startswith("no new changes")
    counts = {name: source.execute(f"SELECT count(*) FROM {name}")[0][0] for name in tables}
    assert reported == counts == {"public.a": 8, "public.b": 7, "public.c": 9}


def test_freshness_windows_derive_from_the_flush_and_merge_cadence(source: SourceDb) -> None:
    config = source.config(["public.x"], flush={"interval_seconds": 5}, materialize={"interval_seconds": 10})
    assert config.freshness_windows() == (300.0, 900.0)
    assert source.config(["public.x"], dagster={"freshness": False}).freshness_windows() is None
    assert source.config(["public.x"], dagster={"freshness_fail_seconds": 120}).freshness_windows() == (None, 120)
    with pytest.raises(ConfigError, match="must be below"):
        source.config(["public.x"], dagster={"freshness_warn_seconds": 600, "freshness_fail_seconds": 300})
