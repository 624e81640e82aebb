"""The WAL flusher as a sensor: each tick streams for a bounded time, stages what committed, and
reports materializations of the staged-log assets of the tables it staged changes of (at most
``STAGED_LOG_EVENTS_PER_TICK``, see below) and the replication slot's observation and check. (A live
table with nothing to merge is kept fresh by a merge run with its checks, see ``sensors/merge.py``: a
runless report here would hide its check results.) The CLI
``stream`` runs the same flusher as a long-lived process; only one can hold the slot, and the other
is told so (skip, no crash loop). A lost slot stops it (the slot's check errs) until the repair run
the repair sensor launches has replaced the slot; ticks skip while that run is under way.

The process that evaluates it (the code location server) also serves the pipeline's Prometheus
metrics when ``metrics.port`` is set (``pg2iceberg_dagster/metrics.py``)."""

import json
import time

from dagster import (
    AssetCheckEvaluation,
    AssetMaterialization,
    AssetObservation,
    DefaultSensorStatus,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)

from pg2iceberg_dagster.config import TableConfig
from pg2iceberg_dagster.errors import SlotBusyError, StartupCheckError
from pg2iceberg_dagster.pipeline import FlushTick, TableProgress, serve_metrics_once, slot_safety

from ..mirror import Mirror
from ..resources import Pg2IcebergResource
from ..slot import slot_check_evaluation, slot_observation
from .base import job_in_flight, mirror_sensor

TICK_SECONDS = 20.0  # well under Dagster's 60 s sensor timeout
# Dagster's sensor daemon looks for due ticks every 5 s (MIN_INTERVAL_LOOP_TIME). A tick done just
# before one of those looks is followed by the next at once; one done just after leaves every commit
# of the next ~5 s unstaged. So a tick (a multiple of 5 s) stops streaming this long before its end:
# its last flush, the lag and slot reads, and the daemon storing its events fit in it.
TICK_HANDOFF_SECONDS = 1.5
# The sensor daemon stores a tick's asset events one at a time before the next tick can start, and
# nothing is staged meanwhile: about 10 ms an event on a quiet machine, 45-85 ms with merges running
# (bench.tables, 200 tables). So a tick reports at most this many tables' staged logs, those waiting
# longest first; the others' changes add up in the sensor's cursor until their turn.
STAGED_LOG_EVENTS_PER_TICK = 40

# Per table, changes staged but not yet reported, and when the first of them was staged (epoch s).
Unreported = dict[str, tuple[int, float]]


def _staged_log_event(
    mirror: Mirror, table: TableConfig, changes: int, progress: TableProgress, tick: FlushTick
) -> AssetMaterialization:
    """The table's staged log grew by ``changes`` since its last report; how far the live table is behind."""
    return AssetMaterialization(
        asset_key=mirror.key(table, "staged_log"),
        metadata={
            "changes_staged": changes,
            "log_head": progress.lag.log_head,
            "mat_cursor": progress.lag.mat_cursor,
            "lag": progress.lag.changes,
            "lag_seconds": round(progress.lag_seconds, 3),
            "flushed_lsn": tick.flushed_lsn_text,
            "flushed_lsn_bytes": tick.flushed_lsn,
        },
    )


def tick_summary(tick: FlushTick) -> str:
    """What a tick did, in a line: ``staged N changes of K tables up to LSN X`` or ``no new changes``."""
    staged = tick.staged
    if not staged:
        return f"no new changes; flushed to {tick.flushed_lsn_text}"
    changes = sum(progress.staged for progress in staged.values())
    return f"staged {changes} changes of {len(staged)} tables up to LSN {tick.flushed_lsn_text}"


def _read_cursor(cursor: str | None) -> Unreported:
    """The unreported changes the sensor's cursor holds (none in an older cursor: the LSN alone)."""
    try:
        loaded = json.loads(cursor or "{}")
    except json.JSONDecodeError:
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {key: (int(changes), float(since)) for key, (changes, since) in loaded.get("unreported", {}).items()}


def _to_report(unreported: Unreported, tick: FlushTick, limit: int) -> tuple[dict[str, int], Unreported]:
    """The tables whose staged log a tick reports (table -> changes since its last report), at most
    ``limit`` of them, waiting longest first; and what is left unreported for a later tick."""
    now = time.time()
    pending = {key: unreported[key] for key in unreported if key in tick.tables}
    for key, progress in tick.staged.items():
        changes, since = pending.get(key, (0, now))
        pending[key] = (changes + progress.staged, since)
    due = sorted(pending, key=lambda key: (pending[key][1], key))[:limit]
    return {key: pending.pop(key)[0] for key in due}, pending


def _streaming_budget(tick_seconds: float, started: float) -> float:
    """How long a tick that began at ``started`` (``time.monotonic()``) may still stream."""
    handoff = min(TICK_HANDOFF_SECONDS, tick_seconds / 4)  # a short tick (tests) still streams
    return max(0.0, tick_seconds - handoff - (time.monotonic() - started))


def flusher_sensor(
    mirror: Mirror, tick_seconds: float = TICK_SECONDS, staged_log_events: int = STAGED_LOG_EVENTS_PER_TICK
) -> SensorDefinition:
    """The mirror's flusher: each tick streams for at most ``tick_seconds`` (less its handoff).

    A tick reports, as runless asset events: a materialization of the staged log of each table it
    staged changes of (with ``lag`` and ``lag_seconds``), at most ``staged_log_events`` of them, the
    tables whose changes have waited longest first (a table reported later counts every change staged
    since its last report); an observation of the replication slot and its ``slot_safe`` check. It
    requests no runs, so Dagster shows every tick as skipped: its skip reason says what it did
    (``staged N changes of K tables up to LSN X``)."""
    tables = {table.key: table for table in mirror.tables}
    repair_job = mirror.named("repair")

    @mirror_sensor(
        mirror,
        "flusher",
        minimum_interval_seconds=5,
        default_status=DefaultSensorStatus.RUNNING,
        asset_selection=[mirror.key(table, "staged_log") for table in mirror.tables],
        description="Streams the replication slot into the staged log in bounded ticks; observes the slot.",
    )
    def _flusher(context: SensorEvaluationContext, pg2iceberg: Pg2IcebergResource) -> SensorResult | SkipReason:
        started = time.monotonic()
        if job_in_flight(context, repair_job):
            # The repair replaces the slot and holds it while it compares: streaming resumes after it.
            return SkipReason(f"waiting for the repair run ({repair_job}) to replace the replication slot")
        with pg2iceberg.pipeline() as pipeline:
            serve_metrics_once(pipeline.config)  # the first tick starts the endpoint, later ones pass
            try:
                tick = pipeline.flush_tick(max_seconds=_streaming_budget(tick_seconds, started))
            except SlotBusyError as exc:
                return SkipReason(str(exc))
            except StartupCheckError as exc:
                # A slot that lost its WAL stops the flusher: its check says so (ERROR) on the slot asset.
                slot = pipeline.slot()
                if slot_safety(slot, pipeline.config.replication).level != "error":
                    raise
                stopped = f"flusher stopped: {exc}"
                if pipeline.config.replication.on_slot_lost == "repair":
                    stopped += f". The sensor {mirror.named('repair')} launches {repair_job}"
                context.log.error(stopped)
                observed = [slot_observation(mirror, slot)] if slot is not None else []
                return SensorResult(
                    asset_events=[*observed, slot_check_evaluation(mirror, slot)],
                    skip_reason=SkipReason(stopped),
                )
        if tick is None:
            return SkipReason("waiting for the snapshot to create the replication slot")
        reported, unreported = _to_report(_read_cursor(context.cursor), tick, staged_log_events)
        events: list[AssetMaterialization | AssetObservation | AssetCheckEvaluation] = [
            _staged_log_event(mirror, tables[key], changes, tick.tables[key], tick)
            for key, changes in reported.items()
            if key in tables
        ]
        if tick.slot is not None:
            events.append(slot_observation(mirror, tick.slot))
        events.append(slot_check_evaluation(mirror, tick.slot))
        summary = tick_summary(tick)
        if unreported:
            summary += f"; {len(unreported)} tables' staged logs to report at a later tick"
        context.log.info(summary)
        context.update_cursor(json.dumps({"flushed_lsn": tick.flushed_lsn_text, "unreported": unreported}))
        return SensorResult(asset_events=events, skip_reason=SkipReason(summary))

    return _flusher
