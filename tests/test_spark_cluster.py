"""Merges and maintenance on a real Spark standalone cluster: a master and a worker started as their
own processes from pyspark's distribution, the driver a CLI child process on ``spark://``. Its
executors are other JVMs: they get the Iceberg runtime and the JDBC driver from the driver
(``spark.jars``), and read the merge's batch from the staging store, not from the driver's memory.
The Iceberg table then equals the live source row by row."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest
import yaml

from pg2iceberg_dagster.embedded import free_port

from .conftest import SourceDb, assert_mirrored

SPARK_HOME = Path(pyspark.__file__).parent
ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _spark_process(name: str, args: list[str], log: Path, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    """``spark-class`` running ``args`` in its own process group until ``ready`` shows in its log;
    stopped by its pid at the end."""
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while ready not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Spark {name} did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A standalone master and one worker (1 core, 1 GiB); yields the master URL and the worker's
    work directory (where each executor of each application leaves its logs)."""
    directory = tmp_path_factory.mktemp("spark-cluster")
    port = free_port()
    master = f"spark://127.0.0.1:{port}"
    work = directory / "work"
    with (
        _spark_process(
            "master",
            [
                *("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port)),
                *("--webui-port", str(free_port())),
            ],
            directory / "master.log",
            "I have been elected leader",
        ),
        _spark_process(
            "worker",
            [
                *("org.apache.spark.deploy.worker.Worker", master, "--host", "127.0.0.1", "--cores", "1"),
                *("--memory", "1g", "--work-dir", str(work), "--webui-port", str(free_port())),
            ],
            directory / "worker.log",
            "Successfully registered with master",
        ),
    ):
        yield master, work


def _cli(config_path: Path, *command: str) -> str:
    """The CLI in a child process (its own driver JVM); fails with its output unless it exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(config_path), *command],
        cwd=ROOT,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_merges_and_maintenance_run_on_a_standalone_cluster(
    source: SourceDb, tmp_path: Path, spark_cluster: tuple[str, Path]
) -> None:
    master, work = spark_cluster
    source.execute("CREATE TABLE accounts (id int PRIMARY KEY, owner text, balance numeric(12, 2), opened date)")
    source.execute(
        "INSERT INTO accounts SELECT i, 'owner ' || i, i * 1.5, date '2020-01-01' + i FROM generate_series(1, 5000) i"
    )
    config = source.config(
        ["public.accounts"],
        spark={
            "master": master,
            "app_name": "pg2iceberg-cluster-test",
            "conf": {"spark.executor.memory": "512m", "spark.cores.max": "1", "spark.driver.host": "127.0.0.1"},
        },
        maintenance={"compact_at_files": 2, "snapshot_retention_hours": 0, "min_snapshots": 2},
    )
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    pipeline = source.pipeline(config)
    pipeline.snapshot()

    for round_ in range(2):
        source.execute("UPDATE accounts SET balance = balance + 1 WHERE id %% 3 = %s", (round_,))
        source.execute("DELETE FROM accounts WHERE id %% 101 = %s", (round_,))
        source.execute(
            "INSERT INTO accounts SELECT i, 'late', 0, NULL FROM generate_series(%s::int, %s::int) i",
            (6000 + round_ * 100, 6099 + round_ * 100),
        )
        pipeline.stream(until_caught_up=True)
        assert "changes" in _cli(path, "materialize", "--once")
    assert_mirrored(pipeline)

    _cli(path, "maintain")
    health = pipeline.file_health("public.accounts")
    assert health.data_files == 1 and health.snapshots == 2
    assert_mirrored(pipeline)
    # The work ran in executors the worker started: each left its own directory and logs there.
    executors = [p for p in work.glob("app-*/*") if p.is_dir()]
    assert executors, f"no executor ran on the worker (work dir {work})"
    assert all((p / "stderr").exists() for p in executors)
