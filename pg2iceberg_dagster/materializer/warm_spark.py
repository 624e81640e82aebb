"""A warm Spark driver that short-lived processes (Dagster merge runs) attach to instead of each
starting a JVM: a JVM start and its cold first merge are most of a lone merge run's time.

The server is a detached process (``python -m pg2iceberg_dagster.materializer.warm_spark_process``,
started by the first run that finds none) holding a SparkSession built the engine's way, with the
long-lived settings. It writes where its py4j gateway listens, and the gateway's auth token, to an
endpoint file readable only by this user (``$TMPDIR/pg2iceberg-<uid>/spark-<pipeline>.json``; never
to the coordination tables). A run reads it, connects to the gateway, and works in a new session of
its own (its own temporary views and catalog cache). The server exits once no run attached for
``spark.warm_idle_seconds`` and no Spark job is running, or when another server replaced its file.

A server started from another Spark configuration (the file holds a digest of it) is not used: the
run starts one of its configuration. If the server dies mid-merge, the run fails like a run whose
JVM died (the cursor only moves after the Iceberg commit) and the next run starts a new server.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import PipelineConfig
from ..detached import detached_error, process_alive, spawn_with_config
from ..errors import Pg2IcebergError
from .spark import build_spark_session, keeping_sigint, py4j_quiet, spark_conf

log = logging.getLogger(__name__)

RUNTIME_DIR_ENV = "PG2ICEBERG_RUNTIME_DIR"
SERVER_COMMAND = (sys.executable, "-m", "pg2iceberg_dagster.materializer.warm_spark_process")
START_TIMEOUT_SECONDS = 180.0
CHECK_SECONDS = 2.0


def runtime_dir() -> Path:
    """Where endpoint files live: ``$PG2ICEBERG_RUNTIME_DIR``, else ``$TMPDIR/pg2iceberg-<uid>`` (mode 0700)."""
    configured = os.environ.get(RUNTIME_DIR_ENV)
    directory = Path(configured) if configured else Path(tempfile.gettempdir()) / f"pg2iceberg-{os.getuid()}"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def endpoint_path(config: PipelineConfig) -> Path:
    """The endpoint file of ``config``'s pipeline (its state database and slot name it)."""
    state = config.state_connection
    pipeline = f"{state.host}:{state.port}/{state.dbname}/{config.replication.slot}"
    return runtime_dir() / f"spark-{hashlib.sha256(pipeline.encode()).hexdigest()[:16]}.json"


def conf_digest(config: PipelineConfig) -> str:
    """A digest of every Spark setting (secrets included, so a rotated password starts a new server)."""
    settings = {"master": config.spark.master, **spark_conf(config)}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _read_endpoint(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _serving(path: Path) -> bool:
    """The endpoint file at ``path`` is this process's (not replaced by another server, nor removed)."""
    current = _read_endpoint(path)
    return current is not None and current.get("pid") == os.getpid()


def serve(config: PipelineConfig, stop: threading.Event) -> None:
    """Run the warm server in this process until ``stop``, idleness, or replacement (module docstring)."""
    session = build_spark_session(config)
    gateway = session.sparkContext._gateway.gateway_parameters
    path = endpoint_path(config)
    endpoint = {"pid": os.getpid(), "port": gateway.port, "token": gateway.auth_token, "digest": conf_digest(config)}
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        json.dump(endpoint, out)
    partial.replace(path)  # whole or absent: a run never reads half a file
    log.warning("warm Spark server %d serving %s", os.getpid(), config.spark.master)
    try:
        while not stop.wait(CHECK_SECONDS):
            # Replaced (or removed): new runs go to the new server; this one finishes its merges.
            idle = not _serving(path) or time.time() - path.stat().st_mtime > config.spark.warm_idle_seconds
            if idle and not session.sparkContext.statusTracker().getActiveJobsIds():
                return
    finally:
        if _serving(path):
            path.unlink(missing_ok=True)
        session.stop()


def _attach(endpoint: dict[str, Any]) -> Any:
    """A new session on the server at ``endpoint`` (raises when it cannot be reached)."""
    from py4j.java_gateway import GatewayParameters, JavaGateway
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    with py4j_quiet(), keeping_sigint():
        gateway = JavaGateway(
            gateway_parameters=GatewayParameters(port=endpoint["port"], auth_token=endpoint["token"], auto_convert=True)
        )
        try:
            jvm = gateway.jvm
            jsc = jvm.org.apache.spark.api.java.JavaSparkContext.fromSparkContext(
                jvm.org.apache.spark.SparkContext.getOrCreate()
            )
        except Exception:
            gateway.close()
            raise
        context = SparkContext(gateway=gateway, jsc=jsc)
        return SparkSession(context).newSession()


@contextlib.contextmanager
def _starting_lock(path: Path) -> Iterator[None]:
    """One process at a time decides whether to start a server for ``path`` (others wait, then attach)."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def warm_session(config: PipelineConfig) -> Any:
    """A session on the pipeline's warm server, started first when there is none of this config. A
    process that runs its own driver already (``run``, a test session) keeps using it."""
    from pyspark import SparkContext

    if SparkContext._active_spark_context is not None:
        return build_spark_session(config)
    path = endpoint_path(config)
    digest = conf_digest(config)
    with _starting_lock(path):
        endpoint = _read_endpoint(path)
        session = None
        if endpoint is not None and endpoint.get("digest") == digest and process_alive(int(endpoint["pid"])):
            try:
                session = _attach(endpoint)
            except Exception as exc:  # killed a moment ago (not reaped yet), or its gateway is gone
                log.warning("the warm Spark server %s cannot be reached (%s); starting a new one", endpoint["pid"], exc)
        if session is None or endpoint is None:
            endpoint = _start(config, path)
            session = _attach(endpoint)
        os.utime(path)  # this run counts as use: the server's idle time starts again
    log.info("attached to the warm Spark server %s", endpoint["pid"])
    return session


def _start(config: PipelineConfig, path: Path) -> dict[str, Any]:
    """Start a server and wait for its endpoint (a server of another config, if any, then exits:
    its endpoint file is replaced)."""
    process = spawn_with_config(SERVER_COMMAND, config)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        endpoint = _read_endpoint(path)
        if endpoint is not None and endpoint.get("pid") == process.pid:
            return endpoint
        if process.poll() is not None:
            raise Pg2IcebergError(f"the warm Spark server exited at start: {detached_error(process)[-2000:]}")
        time.sleep(0.2)
    process.kill()
    raise Pg2IcebergError(f"the warm Spark server did not start within {START_TIMEOUT_SECONDS:.0f} s")


def stop_server(config: PipelineConfig, timeout: float = 60.0) -> int | None:
    """Stop the pipeline's warm server, if one runs (SIGTERM, then wait for it); returns its pid."""
    return stop_server_at(endpoint_path(config), timeout)


def stop_server_at(path: Path, timeout: float = 60.0) -> int | None:
    """Stop the warm server of the endpoint file at ``path`` (see :func:`stop_server`)."""
    endpoint = _read_endpoint(path)
    if endpoint is None or not process_alive(int(endpoint["pid"])):
        path.unlink(missing_ok=True)  # left by a killed server
        return None
    pid = int(endpoint["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pid
