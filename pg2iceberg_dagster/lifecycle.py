"""Tables added to and removed from the config while ``run`` runs.

``run`` watches its config file. When the file changes and parses, the running pipeline stops at its
next step (the flusher flushes what it holds, a merge finishes) and starts again with the new config:

- a **removed** table stops being mirrored: it leaves the publication (when the pipeline owns it,
  ``replication.create_publication``), its staged files and coordination rows are deleted, and its
  Iceberg table is kept, or dropped with ``iceberg.drop_removed_tables``;
- an **added** table joins the publication (when owned) before the flusher starts with the new config,
  so no change of it is skipped, and is then snapshotted in a new snapshot epoch in the background
  while the other tables stream and merge (see ``run_loop.run``).

The same happens when a schema entry of ``tables`` selects other tables than before (a table
created or dropped there: DDL has no WAL change, so the catalog is read every poll). A config that
does not parse is reported and ignored: the pipeline goes on with the one it has.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .cleanup import remove_tables
from .config import PipelineConfig, load_config
from .errors import Pg2IcebergError
from .metrics import serve_metrics
from .pipeline import Pipeline
from .run_loop import run
from .source.connection import is_connection_loss
from .source.selection import resolve_tables

log = logging.getLogger(__name__)

POLL_SECONDS = 2.0
# Pauses between attempts to reach a lost source (doubling from the first to the last).
MIN_RECONNECT_DELAY = 1.0
MAX_RECONNECT_DELAY = 15.0


class ConfigWatch:
    """Sets ``changed`` when the file at ``path`` holds a new valid config, or a schema entry of it
    selects other tables than ``current`` has (a table created or dropped there), or ``stop`` is set."""

    def __init__(
        self, path: str | os.PathLike[str], loaded: PipelineConfig, current: PipelineConfig, stop: threading.Event
    ) -> None:
        self.path = Path(path)
        self.loaded = loaded  # as the file says, before a schema entry's tables are read
        self.current = current
        self.stop = stop
        self.changed = threading.Event()
        self.new_config: PipelineConfig | None = None
        self._seen = self._stamp()
        self._thread = threading.Thread(target=self._watch, name="config watch", daemon=True)
        self._thread.start()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            status = self.path.stat()
        except FileNotFoundError:
            return None
        return status.st_mtime_ns, status.st_size

    def _watch(self) -> None:
        while not self.changed.is_set():
            if self.stop.wait(POLL_SECONDS):
                self.changed.set()
                return
            stamp = self._stamp()
            if stamp != self._seen:
                self._seen = stamp
                try:
                    self.loaded = load_config(self.path)
                except Pg2IcebergError as exc:
                    log.error("%s changed but is not a valid config; going on with the current one: %s", self.path, exc)
                    continue
            elif not self.loaded.schemas:
                continue
            try:
                config = resolve_tables(self.loaded, warn=False)
            except Pg2IcebergError as exc:
                log.error("cannot read the tables of the config's schemas; going on with the current ones: %s", exc)
                continue
            if config != self.current:
                self.new_config = config
                self.changed.set()


def run_following_config(
    path: str | os.PathLike[str],
    stop: threading.Event,
    metrics_port: int | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> None:
    """``run`` with the config at ``path``, following its changes until ``stop`` is set. Metrics are
    served on ``metrics_port`` (default ``metrics.port`` as the config says at start) throughout;
    ``on_progress`` gets ``run``'s lines on what it merged."""
    loaded = load_config(path)
    config = resolve_tables(loaded)
    with serve_metrics(config, metrics_port) as metrics:
        reconnect = Reconnect(config.replication.reconnect_seconds, stop)
        while not stop.is_set():
            metrics.follow(config)
            watch = ConfigWatch(path, loaded, config, stop)
            try:
                with Pipeline(config, detached_holder=True, metrics=metrics) as pipeline:
                    run(pipeline, watch.changed, on_progress=on_progress, on_started=reconnect.started)
                    if stop.is_set() or watch.new_config is None:
                        return
                    _follow_removed_tables(pipeline, config, watch.new_config)
            except Exception as exc:
                watch.changed.set()  # ends its thread: the next round watches anew
                if not reconnect.wait_to_retry(exc):
                    raise
                if watch.new_config is not None:  # seen before the loss: the next round starts with it
                    loaded, config = watch.loaded, watch.new_config
                continue
            loaded, config = watch.loaded, watch.new_config


def _follow_removed_tables(pipeline: Pipeline, config: PipelineConfig, new: PipelineConfig) -> None:
    """Stop mirroring the tables ``new`` no longer names (see the module docstring)."""
    removed = [t for t in config.tables if t.key not in {n.key for n in new.tables}]
    added = [t.key for t in new.tables if t.key not in {c.key for c in config.tables}]
    log.warning("config changed: added %s, removed %s", added, [t.key for t in removed])
    if removed:
        leaving = [pipeline.tables[table.key] for table in removed]
        drop = new.iceberg.drop_removed_tables
        remove_tables(config, pipeline.store, pipeline.objects, pipeline.catalog, leaving, drop)


class Reconnect:
    """``run`` going on through a lost source: once it has started, a lost or refused connection (a
    failover's promotion, a restart of the server) starts it again after a pause growing to
    :data:`MAX_RECONNECT_DELAY`, for ``seconds`` from the loss; any other error, or a source still
    unreachable then, ends it. Restarting is safe anywhere: every step is crash-safe (see
    docs/correctness.md), and the startup checks run again on the server it reaches."""

    def __init__(self, seconds: float, stop: threading.Event) -> None:
        self.seconds = seconds
        self.stop = stop
        self.running = False
        self.lost_at: float | None = None
        self.delay = MIN_RECONNECT_DELAY

    def started(self) -> None:
        """``run`` passed its startup checks and streams."""
        if self.lost_at is not None:
            log.warning("reached the source again after %.1f s", time.monotonic() - self.lost_at)
        self.running, self.lost_at, self.delay = True, None, MIN_RECONNECT_DELAY

    def wait_to_retry(self, error: Exception) -> bool:
        """Whether to start again after ``error`` (having waited), or to let it end ``run``. A stop
        asked for meanwhile is a retry: the loop then ends without an error."""
        if not self.running or self.seconds <= 0 or not is_connection_loss(error):
            return False
        now = time.monotonic()
        self.lost_at = self.lost_at if self.lost_at is not None else now
        left = self.lost_at + self.seconds - now
        if left <= 0:
            log.error("the source is still unreachable after %.0f s (replication.reconnect_seconds)", self.seconds)
            return False
        pause = min(self.delay, left)
        reason = " ".join(str(error).split())  # libpq's message spans lines
        log.warning("lost the source: %s; trying again in %.0f s (for %.0f s more)", reason, pause, left)
        self.stop.wait(pause)
        self.delay = min(self.delay * 2, MAX_RECONNECT_DELAY)
        return True
