"""``run``: everything in one process, with the pipeline's parts: the snapshot first, then the flusher
in a thread while merges follow each flush, maintenance when due, and tables added since snapshotted
(or resynced) in the background."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .config import PipelineConfig
from .coordination.records import is_repair
from .coordination.store import CoordinationStore
from .flusher.priority import FlushFirst
from .maintenance import Maintainer, MaintenanceResult
from .materializer.merge import MergeResult
from .metrics import PipelineMetrics
from .pipeline import Pipeline, TableRepairResult, slot_safety

log = logging.getLogger("pg2iceberg_dagster")

# How often ``run`` reports what it merged (see run's ``on_progress``).
PROGRESS_SECONDS = 60.0
# How often ``run`` looks for tables due for maintenance (a query, and one metadata read per merged table).
UPKEEP_CHECK_SECONDS = 30.0
# How often ``run`` reads its slot (one query): a WAL-budget reading, and a warning when it is in danger.
SLOT_READING_SECONDS = 60.0


def run(
    pipeline: Pipeline,
    stop: threading.Event,
    interval: float | None = None,
    on_progress: Callable[[str], None] | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Everything in one process: snapshot, then stream in a thread while merging; ``on_progress``
    is given a line on what was merged and what lags every :data:`PROGRESS_SECONDS`; ``on_started`` is
    called once the startup checks passed and the flusher started.

    A merge starts as soon as the flusher has staged something (and at least every ``interval``
    seconds, default ``materialize.interval_seconds``), and while no merge runs the flusher stages
    ``flush.min_interval_seconds`` after its previous flush rather than ``flush.interval_seconds``:
    a change waits for the merge in progress (or that minimum, whichever is longer) and its own
    merge, not for a flush interval or a polling period. While a merge runs, commits gather for the
    flush made when it ends. A flush being written goes ahead of the next table's merge (see
    :mod:`.flusher.priority`): the flusher and the merges share one interpreter. The Spark session
    is created once and lives as long as the process.

    The first run snapshots every table before it streams (the snapshot creates the slot). Once a
    table is mirrored, tables still to snapshot (added to the config since) are snapshotted in the
    background, in a new snapshot epoch, while the others stream and merge.
    """
    pipeline.repair_at_startup(on_table=_log_repair)  # a lost slot (replication.on_slot_lost: repair)
    report = pipeline.validate()  # adds tables new to the config to an owned publication, before streaming
    states = pipeline.store.table_states()
    if not any(states[key].snapshot_complete for key in report.tables if key in states):
        pipeline.snapshot()
    errors: list[BaseException] = []
    staged = threading.Event()
    merge_idle = threading.Event()  # set while the loop below waits: a flush now is merged at once
    flush_first = FlushFirst()  # a flush being written goes ahead of the next table's merge

    def stream() -> None:
        try:
            pipeline.stream(stop, on_flush=lambda _stats: staged.set(), merge_idle=merge_idle, flush_first=flush_first)
        except BaseException as exc:  # surfaced to the main loop
            errors.append(exc)
            stop.set()
        finally:
            staged.set()

    thread = threading.Thread(target=stream, name="flusher", daemon=True)
    thread.start()
    if on_started is not None:
        on_started()
    materializer = pipeline.materializer()
    upkeep = _Upkeep(pipeline.maintainer(), pipeline.metrics) if pipeline.config.maintenance.enabled else None
    if upkeep is not None:
        # Merges pyiceberg writes need no JVM, but compaction does: started now, beside the merges, its
        # first pass does not hold them back for a JVM's start (15 s on 2 cores, bench/freshness.py).
        threading.Thread(target=_warm_up, args=(pipeline,), name="spark-warm-up", daemon=True).start()
    copies = _CopyWorker(pipeline.config)
    wait = interval if interval is not None else pipeline.config.materialize.interval_seconds
    progress = _Progress(pipeline.store, pipeline.config.materialize.group, on_progress)
    slot_watch = _SlotWatch(pipeline)
    try:
        while not stop.is_set():
            staged.clear()  # a flush during the merge below sets it again: merge right after
            results = materializer.run_once(before_each=flush_first.wait)
            pipeline.metrics.record_merges(results)
            progress.after_merges(results)
            if upkeep is not None:
                upkeep.after_merges(results)
            slot_watch.read_when_due()
            copies.start_next(
                any(r.waiting_for_snapshot for r in results.values()),
                {key: r.resync_reason for key, r in results.items() if r.resync_reason},
            )
            merge_idle.set()
            _wait_for_either(stop, staged, wait)
            merge_idle.clear()
    finally:
        stop.set()
        thread.join()
        copies.join()
    if errors:
        raise errors[0]


class _Progress:
    """What ``run`` merged over the last :data:`PROGRESS_SECONDS`, and what lags, as one line."""

    def __init__(self, store: CoordinationStore, group: str, on_progress: Callable[[str], None] | None) -> None:
        self.store = store
        self.group = group
        self.on_progress = on_progress
        self.since = time.monotonic()
        self.changes = 0
        self.tables: set[str] = set()

    def after_merges(self, results: dict[str, MergeResult]) -> None:
        """Log each merge, and give the line when :data:`PROGRESS_SECONDS` have passed."""
        for key, result in results.items():
            if result.batches:
                log.info(
                    "merged %s: %d changes in %.2f s (%s), lag %d",
                    result.table,
                    result.changes,
                    result.seconds,
                    ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in result.timings.items()),
                    result.lag.changes,
                )
            if result.changes:
                self.changes += result.changes
                self.tables.add(key)
        elapsed = time.monotonic() - self.since
        if self.on_progress is None or elapsed < PROGRESS_SECONDS:
            return
        lagging = {key: (lag, age) for key, (lag, age) in self.store.lags(self.group).items() if lag.changes}
        behind = (
            f"{len(lagging)} tables lag by {sum(lag.changes for lag, _ in lagging.values()):,} changes, the oldest "
            f"staged {max(age for _, age in lagging.values()):.1f} s ago"
            if lagging
            else "no table lags"
        )
        self.on_progress(
            f"merged {self.changes:,} changes into {len(self.tables)} tables in the last {elapsed:.0f} s; {behind}"
        )
        self.since, self.changes, self.tables = time.monotonic(), 0, set()


class _SlotWatch:
    """``run``'s look at its slot every :data:`SLOT_READING_SECONDS`: a reading of the WAL budget (kept in
    the coordination store, see wal_budget.py), so ``status``, the metrics and Dagster have the current
    rate without a scrape, and a log line when the slot's safety changes (a warning before it loses WAL)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.next_reading = time.monotonic()
        self.level = "ok"

    def read_when_due(self) -> None:
        if time.monotonic() < self.next_reading:
            return
        self.next_reading = time.monotonic() + SLOT_READING_SECONDS
        try:
            safety = slot_safety(self.pipeline.slot(), self.pipeline.config.replication)
        except Exception:
            # A reading is advice, not what keeps the mirror exact: the next one tries again.
            log.warning("could not read replication slot %s", self.pipeline.config.replication.slot, exc_info=True)
            return
        if safety.level != self.level:
            (log.info if safety.level == "ok" else log.warning)("replication slot: %s", safety.reason)
            self.level = safety.level


class _CopyWorker:
    """``run``'s copies of tables: the snapshot of tables added to the config, resyncs and repairs. One at a
    time, in a thread with its own connections, while the flusher streams and the other tables merge.
    A failed copy is logged and tried again after a pause."""

    RETRY_SECONDS = 60.0
    SNAPSHOT = "the snapshot of new tables"

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self._thread: threading.Thread | None = None
        self._failed_at: dict[str, float] = {}

    def start_next(self, snapshot_pending: bool, resyncs: dict[str, str]) -> None:
        """Start the snapshot (when ``snapshot_pending``), else the first of ``resyncs`` (table ->
        reason), unless a copy is running or failed too recently."""
        if self._thread is not None and self._thread.is_alive():
            return
        now = time.monotonic()
        jobs = ([self.SNAPSHOT] if snapshot_pending else []) + list(resyncs)
        ready = [job for job in jobs if now - self._failed_at.get(job, -self.RETRY_SECONDS) >= self.RETRY_SECONDS]
        if ready:
            self._thread = threading.Thread(target=self._copy, args=(ready[0], resyncs.get(ready[0])), name=ready[0])
            self._thread.start()

    def _copy(self, job: str, reason: str | None) -> None:
        try:
            # Neither a snapshot nor a resync needs Spark; the holder process outlives a crash of run.
            with Pipeline(self.config, detached_holder=True) as pipeline:
                if job == self.SNAPSHOT:
                    results = pipeline.snapshot()
                    log.warning("snapshotted %s", ", ".join(f"{k} ({r.rows} rows)" for k, r in results.items()))
                elif is_repair(reason):  # interrupted, or requested by `repair --table` while run runs
                    for repaired in pipeline.repair([job]).tables:
                        _log_repair(repaired)
                else:
                    log.warning("resyncing %s online: %s", job, reason)
                    result = pipeline.resync(job)
                    log.warning("resynced %s: %d rows in %.1f s", job, result.rows, result.seconds)
            self._failed_at.pop(job, None)
        except Exception:
            self._failed_at[job] = time.monotonic()
            log.exception("%s failed; trying again in %.0f s", job, self.RETRY_SECONDS)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


class _Upkeep:
    """Maintenance inside ``run``: between merges, a pass over each table that is due (see
    maintenance.Maintainer.due), looked for at most every :data:`UPKEEP_CHECK_SECONDS`."""

    def __init__(self, maintainer: Maintainer, metrics: PipelineMetrics) -> None:
        self.maintainer = maintainer
        self.metrics = metrics
        self.merged: set[str] = set()
        self.next_check = time.monotonic() + UPKEEP_CHECK_SECONDS

    def after_merges(self, results: dict[str, MergeResult]) -> None:
        self.merged.update(key for key, result in results.items() if result.batches)
        if time.monotonic() < self.next_check:
            return
        for key, reason in self.maintainer.due(self.merged).items():
            try:
                done = self.maintainer.maintain(key, reason)
            except Exception:
                # Upkeep is not what keeps the mirror exact: merges go on, the next check tries again.
                log.error("maintenance of %s failed; merges go on, the next check retries it", key, exc_info=True)
                continue
            if not done.skipped:
                self.metrics.record_maintenance(key, done.seconds)
                log.info("maintained %s (%s) in %.1f s: %s", key, reason, done.seconds, _maintenance_line(done))
        self.merged.clear()
        self.next_check = time.monotonic() + UPKEEP_CHECK_SECONDS


def _maintenance_line(result: MaintenanceResult) -> str:
    """What a pass did, in one log line."""
    rewrites = result.rewrites
    before, after = result.before, result.after
    files = f"data files {before.data_files} -> {after.data_files}" if before and after else ""
    return (
        f"{files}, {rewrites.data_files_rewritten} rewritten, {rewrites.delete_files_removed} delete files removed, "
        f"{rewrites.snapshots_expired} snapshots expired, {result.orphans_removed} orphans and "
        f"{result.staged_files_removed} staged files deleted"
    )


def _warm_up(pipeline: Pipeline) -> None:
    """Start the pipeline's Spark session; a failure is said and left to the first use that needs it."""
    try:
        pipeline.spark()
    except Exception:  # the maintenance pass that needs Spark raises it with its context
        log.warning("Spark did not start ahead of maintenance; it is started again when needed", exc_info=True)


def _wait_for_either(stop: threading.Event, wake: threading.Event, timeout: float) -> None:
    """Return when ``stop`` or ``wake`` is set, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (stop.is_set() or wake.is_set()):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        wake.wait(min(remaining, 0.2))  # short slices: ``stop`` is set by a signal handler, not by us


def _log_repair(result: TableRepairResult) -> None:
    if result.left_to_resync:
        log.warning("%s left to an online resync: %s", result.table, result.left_to_resync)
        return
    if result.resumed:
        log.warning("repair of %s was already written (epoch %s)", result.table, result.epoch)
        return
    log.warning(
        "repaired %s: %d rows compared, %d written (%d upserted, %d deleted) in %.1f s",
        result.table,
        result.rows_compared,
        result.rows_written,
        result.upserted,
        result.deleted,
        result.seconds,
    )
