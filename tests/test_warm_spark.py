"""Dagster merge runs attach to one warm Spark driver instead of each starting a JVM: runs in new
processes share the server, a killed server is replaced by the next run, and every merge leaves the
table equal to the source."""

from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.materializer.warm_spark import endpoint_path, stop_server

from .conftest import SourceDb, assert_mirrored

# A merge run's process: a session from the warm server (started if there is none), one merge pass.
RUN = """
import pickle, sys
from pg2iceberg_dagster.pipeline import Pipeline, warm_spark_session
config = pickle.load(open(sys.argv[1], "rb"))
with Pipeline(config, spark_factory=lambda: warm_spark_session(config)) as pipeline:
    print(sum(result.changes for result in pipeline.materialize().values()))
"""


def _merge_run(config_file: Path) -> int:
    done = subprocess.run([sys.executable, "-c", RUN, str(config_file)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


def _server_pid(config: PipelineConfig) -> int:
    return int(json.loads(endpoint_path(config).read_text())["pid"])


@pytest.mark.usefixtures("spark")
def test_merge_runs_share_one_warm_server_and_a_killed_one_is_replaced(source: SourceDb, tmp_path: Path) -> None:
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'v' || g FROM generate_series(1, 2000) g")
    # Through Spark: pyiceberg would write these small batches without a JVM (materializer/append.py).
    config = source.config(["public.items"], materialize={"pyiceberg_max_rows": 0})
    config_file = tmp_path / "config.pickle"
    config_file.write_bytes(pickle.dumps(config))
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    try:
        source.execute("UPDATE public.items SET v = 'first' WHERE id <= 10")
        pipeline.stream(until_caught_up=True)
        assert _merge_run(config_file) == 10
        first = _server_pid(config)
        assert stat.S_IMODE(endpoint_path(config).stat().st_mode) == 0o600  # it holds the gateway's token
        assert_mirrored(pipeline)

        source.execute("DELETE FROM public.items WHERE id <= 5; INSERT INTO public.items VALUES (5000, 'new')")
        pipeline.stream(until_caught_up=True)
        assert _merge_run(config_file) == 6
        assert _server_pid(config) == first, "the second run attached to the running server"
        assert_mirrored(pipeline)

        os.kill(first, signal.SIGKILL)
        source.execute("UPDATE public.items SET v = 'after the kill' WHERE id BETWEEN 1991 AND 2000")
        pipeline.stream(until_caught_up=True)
        assert _merge_run(config_file) == 10
        assert _server_pid(config) != first, "the next run started a new server"
        assert_mirrored(pipeline)
    finally:
        stopped = stop_server(config)
    assert stopped is not None and not endpoint_path(config).exists()
