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
from collections.abc import Callable
from pathlib import Path

from .cleanup import remove_tables
from .config import PipelineConfig, load_config
from .errors import Pg2IcebergError
from .metrics import serve_metrics
from .pipeline import Pipeline
from .run_loop import run
from .source.selection import resolve_tables

log = logging.getLogger(__name__)

POLL_SECONDS = 2.0


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
        while True:
            metrics.follow(config)
            watch = ConfigWatch(path, loaded, config, stop)
            with Pipeline(config, detached_holder=True, metrics=metrics) as pipeline:
                run(pipeline, watch.changed, on_progress=on_progress)
                if stop.is_set() or watch.new_config is None:
                    return
                new = watch.new_config
                removed = [t for t in config.tables if t.key not in {n.key for n in new.tables}]
                added = [t.key for t in new.tables if t.key not in {c.key for c in config.tables}]
                log.warning("config changed: added %s, removed %s", added, [t.key for t in removed])
                if removed:
                    leaving = [pipeline.tables[table.key] for table in removed]
                    drop = new.iceberg.drop_removed_tables
                    remove_tables(config, pipeline.store, pipeline.objects, pipeline.catalog, leaving, drop)
            loaded, config = watch.loaded, new
