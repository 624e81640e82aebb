"""What the two snapshot-crash soaks share: one seed against a fresh database holding the busy table
of :mod:`soak.busy`, its snapshot driven (and killed) under writes that never stop, then the catch-up
and the row-by-row comparison with the source."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import yaml
from psycopg import sql

from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.pipeline import Pipeline

from .busy import TABLE, BusyTable
from .runner import Cluster, ScenarioResult, divergences_of, write_config


class BusyTableScenario:
    """One seed; subclasses drive the snapshot in :meth:`exercise`. ``spark`` is the session used for
    the final merges."""

    name_prefix = "busy"
    parallelism = 1  # snapshot.parallelism of the seed's config

    def __init__(
        self, cluster: Cluster, workdir: Path, seed: int, spark: Any, busy_rows: int, chunk_pages: tuple[int, ...]
    ) -> None:
        self.cluster = cluster
        self.seed = seed
        self.spark = spark
        self.busy_rows = busy_rows
        self.chunk_pages = chunk_pages
        self.rng = random.Random(seed)
        self.name = f"{self.name_prefix}{seed}_{uuid.uuid4().hex[:6]}"
        self.directory = workdir / self.name
        self.directory.mkdir(parents=True)
        self.log = self.directory / "processes.log"  # the output of every process the seed starts
        self.config_path = self.directory / "pg2iceberg.yaml"
        self.result = ScenarioResult(seed)

    def run(self) -> ScenarioResult:
        started = time.monotonic()
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        busy = BusyTable(self.cluster.conninfo(self.name), self.seed, self.busy_rows)
        try:
            busy.create()
            write_config(self.cluster, self.name, [TABLE], self.directory)
            data = yaml.safe_load(self.config_path.read_text())
            data["snapshot"] = {"chunk_pages": self.rng.choice(self.chunk_pages), "parallelism": self.parallelism}
            self.config_path.write_text(yaml.safe_dump(data))
            self.exercise(busy)
            self._catch_up_and_verify()
        except Exception as exc:  # the report names the seed; the log file has the processes' output
            self.result.error = f"{type(exc).__name__}: {exc} (log: {self.log})"
        finally:
            busy.close()
            self._drop_database_sessions()
        self.result.transactions = busy.kinds
        self.result.seconds = time.monotonic() - started
        return self.result

    def exercise(self, busy: BusyTable) -> None:
        """Take the table's snapshot, with the seed's faults, until it is complete."""
        raise NotImplementedError

    def pipeline(self) -> Pipeline:
        """An in-process pipeline on the seed's config (close it)."""
        return Pipeline(load_config(str(self.config_path)), spark_factory=lambda: self.spark)

    @staticmethod
    def under_writes(busy: BusyTable, work: Callable[[], None]) -> None:
        """Run ``work`` while ``busy`` writes without pause; a failure of the writes is raised after."""
        stop = threading.Event()
        failure: list[BaseException] = []

        def write() -> None:
            try:
                while not stop.is_set():
                    busy.step()
                    time.sleep(0.002)  # a busy application, not a benchmark: the snapshot gets its share
            except BaseException as exc:
                failure.append(exc)

        writer = threading.Thread(target=write, name="busy-writes")
        writer.start()
        try:
            work()
        finally:
            stop.set()
            writer.join()
        if failure:
            raise RuntimeError(f"the workload failed: {failure[0]}")

    def chunks_done(self) -> int:
        """Chunks recorded done so far (0 before the coordination tables exist)."""
        with psycopg.connect(self.cluster.conninfo(self.name), autocommit=True) as conn:
            exists = conn.execute("SELECT to_regclass('_pg2iceberg.snapshot_progress') IS NOT NULL").fetchone()
            if not (exists and exists[0]):
                return 0
            row = conn.execute("SELECT count(*) FROM _pg2iceberg.snapshot_progress WHERE status = 'done'").fetchone()
        return int(row[0]) if row else 0

    def _catch_up_and_verify(self) -> None:
        with self.pipeline() as pipeline:
            epochs = {chunk.epoch for chunk in pipeline.store.chunks(TABLE)}
            if len(epochs) != 1:
                raise RuntimeError(f"the table's chunks are of several snapshot epochs: {sorted(epochs)}")
            self.result.epoch_restarts += epochs.pop() or 0
            pipeline.stream(until_caught_up=True)
            pipeline.materialize()
            self.result.divergences.extend(divergences_of(pipeline.verify()))

    def _drop_database_sessions(self) -> None:
        """End what this seed left: a holder still waiting, the slot."""
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (self.name,))
            time.sleep(0.2)
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                (self.name,),
            )
