"""Prometheus metrics for operators: what an alert needs to see before the mirror falls behind or the
source runs out of disk.

Gauges are read when Prometheus scrapes (a custom collector on a registry of our own, never the
global one): lag per table from the coordination tables, the Iceberg table's files, bytes, records and
snapshots from its current snapshot's summary (no manifest is read), the flushed LSN, and the slot's
position, the WAL it retains and its ``safe_wal_size`` from ``pg_replication_slots``, with its WAL
budget (the write rate and the time until it loses WAL, wal_budget.py: each scrape is one more
reading). Each read has a short connect and statement timeout, and a scrape never raises: a part that
cannot be read is logged, reported as ``pg2iceberg_up{component=...} 0``, and the rest is still served.
Histograms of merge and maintenance durations are observed in the process that does the work (``run``).

``run`` serves them with :func:`serve_metrics`; the Dagster code location that runs the flusher
sensor with :func:`serve_metrics_once`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import start_wsgi_server
from prometheus_client.registry import Collector
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError

from .config import PipelineConfig, PostgresConnection, secret_from_env
from .coordination.records import Lag
from .coordination.store import CoordinationStore
from .errors import Pg2IcebergError
from .iceberg.catalog import open_catalog
from .maintenance.health import summary_health
from .source.connection import connect
from .tables import MirroredTables
from .validation import SlotInfo, slot_info
from .wal_budget import estimate_wal_budget

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from .materializer.merge import MergeResult

log = logging.getLogger(__name__)

# A scrape must answer within Prometheus' scrape timeout (10 s by default) even when a database hangs.
CONNECT_TIMEOUT_SECONDS = 3
STATEMENT_TIMEOUT_MS = 2000

# Merges take from a second (warm, small batch) to many minutes (a first merge, a large backlog).
DURATION_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

# Gauges read at scrape time: name -> (help, label names).
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "pg2iceberg_up": (
        "1 when the component (source, state, catalog) could be read in this scrape, else 0",
        ("component",),
    ),
    "pg2iceberg_lag_changes": ("Staged changes not merged into Iceberg yet (log head minus mat_cursor)", ("table",)),
    "pg2iceberg_lag_seconds": (
        "Age of the oldest staged change not merged yet, since it was staged (0 when none)",
        ("table",),
    ),
    "pg2iceberg_iceberg_data_files": ("Data files of the Iceberg table's current snapshot", ("table",)),
    "pg2iceberg_iceberg_delete_files": ("Delete files of the Iceberg table's current snapshot", ("table",)),
    "pg2iceberg_iceberg_bytes": ("Size in bytes of the files of the Iceberg table's current snapshot", ("table",)),
    "pg2iceberg_iceberg_records": ("Records of the Iceberg table's current snapshot (deletes not applied)", ("table",)),
    "pg2iceberg_iceberg_snapshots": ("Snapshots the Iceberg table's metadata keeps", ("table",)),
    "pg2iceberg_flushed_lsn": ("WAL position staged and registered (coordination flushed_lsn), as a number", ()),
    "pg2iceberg_slot_confirmed_flush_lsn": ("The replication slot's confirmed_flush_lsn, as a number", ()),
    "pg2iceberg_slot_retained_wal_bytes": (
        "WAL the replication slot keeps on the source: pg_current_wal_lsn() minus its restart_lsn",
        (),
    ),
    "pg2iceberg_slot_active": ("1 while a process streams from the replication slot, else 0", ()),
    "pg2iceberg_slot_safe_wal_bytes": (
        "The replication slot's safe_wal_size: WAL the source can still write before the slot is in danger "
        "of losing WAL (absent with max_slot_wal_keep_size unlimited)",
        (),
    ),
    "pg2iceberg_slot_max_wal_keep_bytes": ("The source's max_slot_wal_keep_size (absent when unlimited)", ()),
    "pg2iceberg_slot_wal_write_bytes_per_second": (
        "WAL the source writes per second, smoothed over about five minutes of readings",
        (),
    ),
    "pg2iceberg_slot_safe_wal_shrink_bytes_per_second": (
        "How fast the slot's safe_wal_size shrinks (negative while the flusher wins it back), smoothed likewise",
        (),
    ),
    "pg2iceberg_slot_seconds_until_lost": (
        "safe_wal_size over the rate it shrinks at: when the slot loses WAL at the current rate "
        "(absent when it does not shrink or max_slot_wal_keep_size is unlimited)",
        (),
    ),
    "pg2iceberg_scrape_seconds": ("How long reading these metrics took", ()),
}

# Gauge -> field of the table's summary health (maintenance.health: totals Iceberg keeps in every
# snapshot summary, and the snapshot count; no manifest is read).
HEALTH_GAUGES = {
    "pg2iceberg_iceberg_data_files": "data_files",
    "pg2iceberg_iceberg_delete_files": "delete_files",
    "pg2iceberg_iceberg_bytes": "bytes",
    "pg2iceberg_iceberg_records": "records",
    "pg2iceberg_iceberg_snapshots": "snapshots",
}


class MetricsPortError(Pg2IcebergError):
    """The metrics endpoint cannot listen on its port (in use, or not allowed)."""


def _secrets(config: PipelineConfig) -> list[str]:
    """The secrets this config resolves to (passwords, the S3 secret key, a REST credential), to keep
    them out of logged errors."""
    targets = (config.source, config.state, config.iceberg.catalog.postgres)
    readers: list[Callable[[], str | None]] = [target.resolved_password for target in targets if target]
    readers.append(lambda: config.staging.s3.credentials()[1])
    readers.append(lambda: secret_from_env(config.iceberg.catalog.credential_env, "iceberg.catalog.credential_env"))
    found = []
    for read in readers:
        with contextlib.suppress(Pg2IcebergError):  # one not set cannot leak either
            secret = read()
            if secret:
                found.append(secret)
    return found


def _describe_error(exc: BaseException, config: PipelineConfig) -> str:
    """One line about ``exc`` with no secret in it: our errors say what to do; the first line of
    another's says what failed (libpq, SQLAlchemy and pyiceberg do not echo passwords, and any
    resolved password is masked should one ever do)."""
    text = str(exc).strip().splitlines()
    message = text[0] if text else ""
    if not isinstance(exc, Pg2IcebergError):
        message = f"{type(exc).__name__}: {message}"
    for secret in _secrets(config):
        message = message.replace(secret, "***")
    return message


class _Families:
    """The gauges of one scrape, created up front so each is served once with its HELP text."""

    def __init__(self) -> None:
        self.by_name = {name: GaugeMetricFamily(name, text, labels=labels) for name, (text, labels) in GAUGES.items()}

    def set(self, name: str, value: float, *labels: str) -> None:
        self.by_name[name].add_metric(list(labels), value)


class PipelineCollector(Collector):
    """Reads the gauges on each scrape. Connections and the catalog are kept between scrapes (one
    scrape at a time) and opened again after a failure or when the config names other servers."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._connections: dict[str, tuple[PostgresConnection, psycopg.Connection]] = {}
        self._catalog: tuple[object, Catalog] | None = None
        self._slot: SlotInfo | None = None

    def describe(self) -> Iterable[Metric]:
        """The gauges' names, without reading anything (for the registry's duplicate check)."""
        return _Families().by_name.values()

    def collect(self) -> Iterable[Metric]:
        """Every gauge this scrape could read; never raises."""
        with self._lock:
            started = time.monotonic()
            config = self.config  # ``run`` may switch to a new config meanwhile: one per scrape
            families = _Families()
            self._slot = None  # the slot as the source reader finds it, for the state reader's WAL budget
            readers: dict[str, Callable[[PipelineConfig, _Families], None]] = {
                "source": self._read_source,
                "state": self._read_state,
                "catalog": self._read_iceberg,
            }
            for component, read in readers.items():
                try:
                    read(config, families)
                    up = 1.0
                except Exception as exc:  # a scrape reports what it could, never fails
                    log.warning("metrics: cannot read the %s: %s", component, _describe_error(exc, config))
                    self._forget(component)
                    up = 0.0
                families.set("pg2iceberg_up", up, component)
            families.set("pg2iceberg_scrape_seconds", time.monotonic() - started)
            return list(families.by_name.values())

    def _connection(self, component: str, target: PostgresConnection) -> psycopg.Connection:
        """An open connection to ``target`` with short timeouts, kept for later scrapes."""
        kept = self._connections.get(component)
        if kept is not None and kept[0] == target and not kept[1].closed and not kept[1].broken:
            return kept[1]
        self._forget(component)
        conn = connect(
            target.model_copy(
                update={"connect_timeout": CONNECT_TIMEOUT_SECONDS, "application_name": "pg2iceberg-dagster metrics"}
            )
        )
        conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
        self._connections[component] = (target, conn)
        return conn

    def _forget(self, component: str) -> None:
        """Drop what a failed read used, so the next scrape starts afresh."""
        if component == "catalog":
            self._catalog = None
            return
        kept = self._connections.pop(component, None)
        if kept is not None:
            kept[1].close()

    def _read_source(self, config: PipelineConfig, families: _Families) -> None:
        conn = self._connection("source", config.source)
        slot = slot_info(conn, config.replication.slot)
        if slot is None:
            return  # not created yet (before the first snapshot): nothing retained, nothing to report
        if slot.confirmed_flush_lsn is not None:
            families.set("pg2iceberg_slot_confirmed_flush_lsn", slot.confirmed_flush_lsn)
        if slot.retained_wal_bytes is not None:  # None once the slot has lost its WAL (wal_status 'lost')
            families.set("pg2iceberg_slot_retained_wal_bytes", slot.retained_wal_bytes)
        families.set("pg2iceberg_slot_active", 1.0 if slot.active else 0.0)
        if slot.safe_wal_size_bytes is not None:
            families.set("pg2iceberg_slot_safe_wal_bytes", slot.safe_wal_size_bytes)
        if slot.max_slot_wal_keep_size_bytes is not None:
            families.set("pg2iceberg_slot_max_wal_keep_bytes", slot.max_slot_wal_keep_size_bytes)
        self._slot = slot

    def _read_wal_budget(self, config: PipelineConfig, store: CoordinationStore, families: _Families) -> None:
        """The slot read from the source in this scrape, with its WAL budget measured against the
        readings in the state database (wal_budget.py; the scrape is one more reading)."""
        if self._slot is None or not store.has_slot_readings():
            return  # the source was not read, or the state is not migrated to slot readings yet
        slot = estimate_wal_budget(store, config.replication.slot, self._slot)
        assert slot is not None
        rates = {
            "pg2iceberg_slot_wal_write_bytes_per_second": slot.wal_write_bytes_per_second,
            "pg2iceberg_slot_safe_wal_shrink_bytes_per_second": slot.safe_wal_shrink_bytes_per_second,
            "pg2iceberg_slot_seconds_until_lost": slot.seconds_until_lost,
        }
        for name, rate in rates.items():
            if rate is not None:
                families.set(name, rate)

    def _read_state(self, config: PipelineConfig, families: _Families) -> None:
        conn = self._connection("state", config.state_connection)
        exists = conn.execute("SELECT to_regclass('_pg2iceberg.log_seq') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return  # no pipeline has run here yet
        store = CoordinationStore(config.state_connection, conn)  # closed with the kept connection
        flushed = store.flushed_lsn()
        if flushed is not None:
            families.set("pg2iceberg_flushed_lsn", flushed)
        lags = store.lags(config.materialize.group)
        for table in config.tables:
            lag, age = lags.get(table.key, (Lag(), 0.0))
            families.set("pg2iceberg_lag_changes", lag.changes, table.key)
            families.set("pg2iceberg_lag_seconds", age, table.key)
        self._read_wal_budget(config, store, families)

    def _read_iceberg(self, config: PipelineConfig, families: _Families) -> None:
        settings = (config.iceberg, config.catalog_connection)
        if self._catalog is None or self._catalog[0] != settings:
            self._catalog = (settings, open_catalog(_with_short_timeouts(config)))
        catalog = self._catalog[1]
        for table in MirroredTables(config).values():
            try:
                iceberg = catalog.load_table(table.iceberg)
            except NoSuchTableError:
                continue  # its snapshot has not created it yet
            health = summary_health(iceberg)
            for name, field in HEALTH_GAUGES.items():
                families.set(name, float(getattr(health, field)), table.key)

    def close(self) -> None:
        """Close the kept connections."""
        with self._lock:
            for component in list(self._connections):
                self._forget(component)
            self._catalog = None


def _with_short_timeouts(config: PipelineConfig) -> PipelineConfig:
    """``config`` whose SQL catalog connection gives up connecting after CONNECT_TIMEOUT_SECONDS."""
    catalog = config.catalog_connection.model_copy(update={"connect_timeout": CONNECT_TIMEOUT_SECONDS})
    iceberg = config.iceberg.model_copy(
        update={"catalog": config.iceberg.catalog.model_copy(update={"postgres": catalog})}
    )
    return config.model_copy(update={"iceberg": iceberg})


@dataclass
class MetricsServer:
    """The HTTP endpoint serving a registry; :meth:`close` stops it and frees the port."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class PipelineMetrics:
    """The metrics of one process: the scrape-time gauges of a pipeline and the durations it observes.

    Its registry is its own, so two pipelines in one process (tests) never share series."""

    def __init__(self, config: PipelineConfig) -> None:
        self.registry = CollectorRegistry()
        self.collector = PipelineCollector(config)
        self.registry.register(self.collector)
        self.merge_seconds = self._per_table_durations(
            "pg2iceberg_merge_duration_seconds",
            "Duration of a table's merges that applied staged changes (read, fold, MERGE, cursor)",
        )
        self.maintenance_seconds = self._per_table_durations(
            "pg2iceberg_maintenance_duration_seconds", "Duration of a table's Iceberg maintenance"
        )
        self.server: MetricsServer | None = None

    def _per_table_durations(self, name: str, documentation: str) -> Histogram:
        return Histogram(name, documentation, ["table"], buckets=DURATION_BUCKETS, registry=self.registry)

    def follow(self, config: PipelineConfig) -> None:
        """Report on ``config`` from the next scrape on (``run`` follows its config file)."""
        self.collector.config = config

    def record_merges(self, results: Mapping[str, MergeResult]) -> None:
        """Observe the duration of each merge that applied batches (a table with nothing to merge,
        or waiting for its snapshot or a resync, did no merge)."""
        for key, result in results.items():
            if result.batches:
                self.merge_seconds.labels(table=key).observe(result.seconds)

    def record_maintenance(self, table_key: str, seconds: float) -> None:
        """Observe one maintenance of the table ``table_key`` that took ``seconds``."""
        self.maintenance_seconds.labels(table=table_key).observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serve the registry on http://host:port/metrics in a daemon thread until :meth:`close`;
        raises :class:`MetricsPortError` naming the port when it cannot listen there."""
        try:
            server, thread = start_wsgi_server(port, host, self.registry)
        except OSError as exc:
            reason = "the port is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise MetricsPortError(
                f"cannot serve metrics on {host}:{port}: {reason}; choose another metrics.port "
                "(or `run --metrics-port N`)"
            ) from None
        self.server = MetricsServer(server, thread)
        return self.server

    def close(self) -> None:
        """Stop serving (when serving) and close the collector's connections."""
        if self.server is not None:
            self.server.close()
            self.server = None
        self.collector.close()


@contextlib.contextmanager
def serve_metrics(config: PipelineConfig, port: int | None = None) -> Iterator[PipelineMetrics]:
    """The process's metrics, served on ``port`` (default ``metrics.port``; None: not served) at
    ``metrics.host`` until the block exits."""
    metrics = PipelineMetrics(config)
    port = port if port is not None else config.metrics.port
    if port is not None:
        metrics.serve(port, config.metrics.host)
    try:
        yield metrics
    finally:
        metrics.close()


_process_lock = threading.Lock()
_process_metrics: list[PipelineMetrics | None] = []  # empty until this process tried to serve


def serve_metrics_once(config: PipelineConfig) -> PipelineMetrics | None:
    """Serve ``config``'s metrics from this process for the rest of its life, if ``metrics.port`` is
    set: the first call tries, later ones only follow ``config``. Several processes load the Dagster
    definitions; the ones that find the port taken log a warning and serve nothing."""
    if config.metrics.port is None:
        return None
    with _process_lock:
        if _process_metrics:
            served = _process_metrics[0]
            if served is not None:
                served.follow(config)
            return served
        metrics = PipelineMetrics(config)
        try:
            metrics.serve(config.metrics.port, config.metrics.host)
        except MetricsPortError as exc:
            log.warning("%s; this process serves no metrics (another one may)", exc)
            _process_metrics.append(None)
            return None
        _process_metrics.append(metrics)
        return metrics
