"""One soak scenario: a seeded workload, CLI processes that really die, restarts, catch-up, verify.

Per seed the runner creates a fresh source database and pipeline, then:

1. runs ``snapshot`` in a child process while the workload writes, with a crash point armed or a
   ``kill -9`` at a random moment, and reruns it until it completes;
2. runs ``stream`` in a child process while the workload writes, killing it (armed crash points and
   ``kill -9`` after a seed-chosen number of transactions) and restarting it, with merges in between;
3. optionally runs ``materialize`` in a child process that dies right after its Iceberg commit;
4. stops the writes, catches up, merges, collects garbage, and compares every table row by row (the
   table with excluded, masked and filtered columns and rows also by the soak's own check,
   soak/policy_check.py, and its history table with the table as of sampled past LSNs,
   soak/history_check.py).

Whatever dies is a real process death (SIGKILL), never an exception the engine could catch.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml
from psycopg import sql

from pg2iceberg_dagster.config import PipelineConfig, load_config
from pg2iceberg_dagster.faults import CRASH_ENV
from pg2iceberg_dagster.maintenance.orphans import orphan_files
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.verify import TableDiff

from .history_check import SampleLog, history_divergences
from .policy_check import policy_divergences
from .workload import MASK_KEY_ENV, Workload

SNAPSHOT_FAULTS = ["snapshot.mid_chunk", "snapshot.after_chunk_commit", "kill"]
STREAM_FAULTS = [
    "flusher.mid_transaction",
    "flusher.during_spill",
    "flusher.after_upload",
    "flusher.after_register",
    "kill",
]
MATERIALIZE_FAULT = "materializer.after_commit"
RESYNC_FAULTS = ["resync.before_switch", "resync.after_switch", "kill"]
MAINTENANCE_FAULTS = ["maintenance.after_compaction", "maintenance.after_expiry", "kill"]
# The replication slot lost while the mirror is down: dropped, or invalidated by max_slot_wal_keep_size
# under writes. The next `stream` repairs it (replication.on_slot_lost: repair, the default).
SLOT_FAULTS = ["slot.dropped", "slot.invalidated"]
# The keep size a slot invalidation is provoked with, set on the cluster only meanwhile.
SMALL_SLOT_WAL_KEEP = "1MB"
# The hash key of the masked column when the environment does not give one.
SOAK_MASK_KEY = "soak-mask-key"


@dataclass
class Cluster:
    """Where the scenarios run: a PostgreSQL server, the Iceberg catalog database and a warehouse."""

    host: str
    port: int
    catalog_db: str
    warehouse: Path
    user: str = "postgres"

    def conninfo(self, dbname: str) -> str:
        return f"host={self.host} port={self.port} dbname={dbname} user={self.user}"


@dataclass
class Profile:
    """How big a scenario is."""

    initial_rows: int = 300
    snapshot_writes: int = 15
    stream_writes: int = 60
    big_rows: int = 4000
    stream_kills: int = 2
    materialize_fault_rate: float = 0.2
    slot_fault_rate: float = 0.3  # seeds whose slot is lost once while the mirror is down
    history_sample_rate: float = 0.15  # streamed transactions after which a table with history is sampled


@dataclass
class ScenarioResult:
    """What one seed did and whether the mirror came out exact."""

    seed: int
    faults: Counter[str] = field(default_factory=Counter)
    armed_not_reached: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    epoch_restarts: int = 0  # snapshots that lost their exported snapshot and started a table again
    history_samples: int = 0  # past states the history tables were compared with at the end
    transactions: Counter[str] = field(default_factory=Counter)
    divergences: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.divergences


class ChildProcess:
    """A ``pg2iceberg-dagster`` command in its own process, with an optional armed crash point."""

    def __init__(self, config_path: Path, args: list[str], crash_at: str | None, log: Path) -> None:
        env = {key: value for key, value in os.environ.items() if key != CRASH_ENV}
        if crash_at:
            env[CRASH_ENV] = crash_at
        self.log = log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(config_path), *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.returncode is not None:
                self.log.close()

    def stop(self, timeout: float = 60) -> int:
        """Ask it to finish what it buffered (SIGTERM) and wait."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout)


def write_config(cluster: Cluster, name: str, tables: Sequence[str | dict[str, Any]], directory: Path) -> Path:
    """The scenario's pipeline YAML: small chunks, frequent flushes, a small in-memory transaction bound.
    ``tables``: names, or config entries."""
    data = {
        "source": {"host": cluster.host, "port": cluster.port, "dbname": name, "user": cluster.user},
        "tables": [table if isinstance(table, dict) else {"name": table} for table in tables],
        "replication": {"slot": f"slot_{name}", "publication": f"pub_{name}", "status_interval_seconds": 1},
        "staging": {"url": f"file://{directory}/staging"},
        "iceberg": {
            "catalog": {"postgres": {"host": cluster.host, "port": cluster.port, "dbname": cluster.catalog_db}},
            "warehouse": f"file://{cluster.warehouse}",
            "namespace": f"{name}_{{schema}}",
        },
        "snapshot": {"chunk_pages": 4, "parallelism": 2},
        "flush": {"interval_seconds": 0.3, "max_rows": 2000, "txn_memory_bytes": 256 * 1024},
        "materialize": {"interval_seconds": 1},
        # Eager maintenance: every pass compacts, expires and deletes orphans. An orphan age of 0 is
        # safe here only because no other process writes Iceberg while a pass runs.
        "maintenance": {
            "compact_at_files": 2,
            "snapshot_retention_hours": 0,
            "min_snapshots": 2,
            "orphan_min_age_hours": 0,
        },
    }
    path = directory / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def planned_slot_fault(seed: int, profile: Profile) -> str | None:
    """How the seed loses its slot once while the mirror is down (one of :data:`SLOT_FAULTS`), or None.
    Drawn from a generator of its own, so every other choice of the seed stays as it was."""
    rng = random.Random(f"slot-{seed}")
    return rng.choice(SLOT_FAULTS) if rng.random() < profile.slot_fault_rate else None


class Scenario:
    """Runs one seed against ``cluster``; ``spark`` is the session used for in-process merges."""

    def __init__(self, cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: Profile) -> None:
        self.cluster = cluster
        self.seed = seed
        self.rng = random.Random(seed)
        self.profile = profile
        self.spark = spark
        self.name = f"soak{seed}_{uuid.uuid4().hex[:6]}"
        self.directory = workdir / self.name
        self.directory.mkdir(parents=True)
        self.log = self.directory / "processes.log"
        self.result = ScenarioResult(seed)
        self.workload = Workload(cluster.conninfo(self.name), seed, profile.initial_rows, profile.big_rows)
        self.config_path: Path | None = None
        self.removed: str | None = None  # a table taken out of the config for now
        self.slot_fault = planned_slot_fault(seed, profile)
        # Every child inherits it, and the end check hashes with it.
        self.mask_key = os.environ.setdefault(MASK_KEY_ENV, SOAK_MASK_KEY).encode()
        # The tables with a history, sampled between transactions (soak/history_check.py) when a generator
        # of its own says so, so every other choice of the seed stays as it was.
        self.samples = SampleLog([t.qualified for t in self.workload.tables if t.options.get("history")])
        self.sample_rng = random.Random(f"history-{seed}")

    def run(self) -> ScenarioResult:
        started = time.monotonic()
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        try:
            self.workload.setup()
            self.config_path = write_config(self.cluster, self.name, self.workload.table_entries(), self.directory)
            self._snapshot_phase()
            self._stream_phase()
            self._finish()
        except Exception as exc:  # the report names the seed; the log file has the processes' output
            self.result.error = f"{type(exc).__name__}: {exc} (log: {self.log})"
        finally:
            self.workload.close()
            self._drop_slot()
        self.result.transactions = self.workload.kinds
        self.result.seconds = time.monotonic() - started
        return self.result

    def _child(self, args: list[str], crash_at: str | None) -> ChildProcess:
        assert self.config_path is not None
        self._wait_slot_released()
        return ChildProcess(self.config_path, args, crash_at, self.log)

    def _wait_slot_released(self, timeout: float = 30) -> None:
        """A killed consumer's walsender notices the dead socket a moment later; the next one waits."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FROM pg_replication_slots WHERE database = %s AND active", (self.name,)
                ).fetchone()
                if row is not None and row[0] == 0:
                    return
                time.sleep(0.1)
        raise RuntimeError("the replication slot stayed active after its consumer died")

    def _wait_streaming(self, child: ChildProcess, timeout: float = 60) -> None:
        """Wait until ``child`` holds the slot, so writes land while it streams and SIGTERM finds its handler."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            while child.alive() and time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FROM pg_replication_slots WHERE database = %s AND active", (self.name,)
                ).fetchone()
                if row is not None and row[0] > 0:
                    return
                time.sleep(0.1)

    def _record_death(self, fault: str | None, code: int) -> None:
        if code == -signal.SIGKILL:
            self.result.faults[(fault or "kill").split(":")[0]] += 1
            self.result.restarts += 1
        elif code != 0:
            raise RuntimeError(f"child exited with {code}, expected 0 or SIGKILL")
        elif fault:
            self.result.armed_not_reached[fault.split(":")[0]] += 1

    def _armed(self, fault: str) -> str | None:
        """The crash-point spec for ``fault``, or None for a kill from outside."""
        return None if fault == "kill" else f"{fault}:{self.rng.randint(1, 3)}"

    def _writes_while(self, child: ChildProcess, count: int, kill_after: int | None) -> int:
        """Run up to ``count`` transactions while ``child`` lives; kill it after ``kill_after`` of them."""
        done = 0
        while done < count and child.alive():
            self.workload.step()
            done += 1
            if self.sample_rng.random() < self.profile.history_sample_rate:
                policies = {key: self.workload.table(key).policy() for key in self.samples.samples}
                self.samples.take(self.workload.conn, self.cluster.conninfo(self.name), policies, self.mask_key)
            if kill_after is not None and done == kill_after:
                child.kill()
        return done

    def _snapshot_phase(self) -> None:
        self.workload.allow_ddl = False
        fault = self.rng.choice(SNAPSHOT_FAULTS)
        armed = self._armed(fault)
        child = self._child(["snapshot"], armed)
        kill_after = self.rng.randint(0, 3) if fault == "kill" else None
        if kill_after == 0:
            child.kill()
        self._writes_while(child, self.profile.snapshot_writes, kill_after)
        self._record_death(fault, child.wait(600))
        for _ in range(3):  # restarts until the snapshot is complete
            retry = self._child(["snapshot"], None)
            self._writes_while(retry, 3, None)
            if retry.wait(600) == 0:
                break
        else:
            raise RuntimeError("snapshot did not complete after restarts")
        self.workload.allow_ddl = True
        self.samples.close_gap("snapshot")

    def _stream_phase(self) -> None:
        remaining = self.profile.stream_writes
        kills = self.profile.stream_kills
        while remaining > 0:
            fault = self.rng.choice(STREAM_FAULTS) if kills > 0 else None
            kills -= 1
            armed = self._armed(fault) if fault else None
            child = self._child(["stream"], armed)
            self._wait_streaming(child)
            self._wait_repaired(child)
            kill_after = self.rng.randint(1, max(1, remaining)) if fault == "kill" else None
            done = self._writes_while(child, remaining, kill_after)
            remaining -= done
            code = child.stop() if child.alive() else child.wait()
            self._record_death(fault, code)
            if code == 0:
                self.samples.staged()
            if self.rng.random() < 0.5:
                self._pipeline_call(self._merge)  # a merge while the log keeps growing
            if self.rng.random() < 0.25:
                self._maintain()
            if self.rng.random() < 0.2:
                self._change_tables()
            if self.slot_fault and remaining > 0:  # the next `stream` repairs it
                self._lose_slot(self.slot_fault)
        if self.slot_fault:  # no stream was killed before the writes ran out: lose it now, and repair
            self._lose_slot(self.slot_fault)
            self._record_death(None, self._child(["stream", "--until-caught-up"], None).wait(600))

    def _lose_slot(self, fault: str) -> None:
        """The mirror is down and its slot is lost: dropped, or invalidated by a small
        max_slot_wal_keep_size while the workload writes and checkpoints remove the WAL it holds (the
        setting is the cluster's: restored at once, so no other slot is at risk longer)."""
        slot = f"slot_{self.name}"
        self.samples.open_gap("slot")
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            if fault == "slot.dropped":
                self.workload.step()
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                self.workload.step()
            else:
                self._invalidate_slot(conn, slot)
        self.result.faults[fault] += 1
        self.slot_fault = None

    def _invalidate_slot(self, conn: psycopg.Connection, slot: str, timeout: float = 120) -> None:
        conn.execute(sql.SQL("ALTER SYSTEM SET max_slot_wal_keep_size = {}").format(sql.Literal(SMALL_SLOT_WAL_KEEP)))
        conn.execute("SELECT pg_reload_conf()")
        try:
            deadline = time.monotonic() + timeout
            while True:
                status = "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s"
                row = conn.execute(status, (slot,)).fetchone()
                if row is not None and row[0] == "lost":
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replication slot {slot} was not invalidated in {timeout:.0f} s")
                self.workload.step()
                conn.execute("SELECT pg_logical_emit_message(false, 'soak', repeat('x', 1000000))")
                conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
        finally:
            conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            conn.execute("SELECT pg_reload_conf()")

    def _merge(self, pipeline: Pipeline) -> None:
        """Merge every table; resync those a merge found the WAL cannot follow (in a child that may die
        first, as ``run`` or a Dagster run could), then merge them."""
        if self._slot_was_lost:
            self._finish_repairs(pipeline)
        pipeline.materialize()
        pending = pipeline.resyncs_pending()
        self.samples.merged(resynced=set(pending))
        if pending:
            if self.rng.random() < 0.5:
                self._child_that_may_die(["resync"], RESYNC_FAULTS, kill_within=3.0)
            for table_key in pipeline.resyncs_pending():
                pipeline.resync(table_key)
            pipeline.materialize()
        if self._repaired(pipeline):
            self.samples.close_gap("slot")

    def _repaired(self, pipeline: Pipeline) -> bool:
        """Whether a lost slot's repair is done for the tables with a history: the new slot exists (it is
        created after every table is marked for repair) and none of them waits for a repair or resync."""
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            status = "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s"
            row = conn.execute(status, (f"slot_{self.name}",)).fetchone()
        return row is not None and row[0] != "lost" and not set(pipeline.resyncs_pending()) & set(self.samples.samples)

    def _wait_repaired(self, child: ChildProcess, timeout: float = 120) -> None:
        """While a lost slot leaves a gap in the history: wait until ``child`` (a ``stream``) has repaired the
        tables with a history, and close it, so the writes during ``child`` are sampled again."""
        deadline = time.monotonic() + timeout
        while "slot" in self.samples.gaps and child.alive() and time.monotonic() < deadline:
            if self._pipeline_call(self._repaired):
                self.samples.close_gap("slot")
            else:
                time.sleep(0.5)

    def _child_that_may_die(self, args: list[str], faults: list[str], kill_within: float) -> None:
        """Run the command ``args`` in a child armed with one of ``faults``: a crash point it dies at,
        or a kill from outside after 0.5 to ``kill_within`` seconds; record how it ended."""
        fault = self.rng.choice(faults)
        child = self._child(args, None if fault == "kill" else fault)
        if fault == "kill":
            time.sleep(self.rng.uniform(0.5, kill_within))
            child.kill()
        self._record_death(fault, child.wait(600))

    def _maintain(self) -> None:
        """A ``maintain`` child that may die inside its pass; a pass in this process finishes it."""
        self._child_that_may_die(["maintain"], MAINTENANCE_FAULTS, kill_within=4.0)
        self._pipeline_call(lambda pipeline: pipeline.maintain())
        self.workload.kinds["maintain"] += 1

    def _pipeline_call(self, action: Any) -> Any:
        assert self.config_path is not None
        config: PipelineConfig = load_config(str(self.config_path))
        with Pipeline(config, spark_factory=lambda: self.spark) as pipeline:
            return action(pipeline)

    def _change_tables(self) -> None:
        """Take a table out of the config (``cleanup --table`` stops mirroring it while it keeps being
        written) or put the one taken out back (a ``snapshot`` child copies it again in a new epoch,
        under writes, and the stream goes on with it)."""
        keys = self.workload.table_keys()
        if self.removed is None:
            self.removed = self.rng.choice(keys)
            self.config_path = write_config(
                self.cluster, self.name, self.workload.table_entries(leaving_out=self.removed), self.directory
            )
            self._record_death(None, self._child(["cleanup", "--table", self.removed], None).wait(300))
            self.workload.kinds["remove_table"] += 1
            if self.removed in self.samples.samples:
                self.samples.open_gap("removed")
            return
        # Entered into the publication again: with the columns added since (docs/columns.md).
        self.workload.table(self.removed).added_since_entry.clear()
        self.removed = None
        self.config_path = write_config(self.cluster, self.name, self.workload.table_entries(), self.directory)
        self.workload.allow_ddl = False  # a rewrite under a snapshot is not MVCC-safe (see the snapshot phase)
        child = self._child(["snapshot"], None)
        self._writes_while(child, 5, None)
        self._record_death(None, child.wait(600))
        self.workload.allow_ddl = True
        self.workload.kinds["add_table"] += 1
        self.samples.close_gap("removed")

    @property
    def _slot_was_lost(self) -> bool:
        return any(fault in SLOT_FAULTS for fault in self.result.faults)

    @staticmethod
    def _finish_repairs(pipeline: Pipeline) -> None:
        """Finish a repair of a lost slot that a `stream` killed at startup left (the next `stream` would),
        and the resyncs a repair left (a change made while the slot was lost no comparison can follow)."""
        if pipeline.repairs_pending():
            pipeline.repair()
        for table_key in pipeline.resyncs_pending():
            pipeline.resync(table_key)

    def _finish(self) -> None:
        if self.removed is not None:
            self._change_tables()  # every table is verified at the end
        if self._slot_was_lost:
            self._pipeline_call(self._finish_repairs)  # before `materialize --once`, which would wait for it
        if self.rng.random() < self.profile.materialize_fault_rate:
            self._pipeline_call(lambda p: p.stream(until_caught_up=True))
            child = self._child(["materialize", "--once"], MATERIALIZE_FAULT)
            self._record_death(MATERIALIZE_FAULT, child.wait(900))

        def catch_up_and_verify(pipeline: Pipeline) -> None:
            pipeline.stream(until_caught_up=True)
            self._merge(pipeline)
            pipeline.collect_garbage()
            self.result.divergences.extend(divergences_of(pipeline.verify()))
            self._check_policies(pipeline)
            # After a last pass, nothing under a table's location is unreferenced: every crash's
            # leftovers were found.
            pipeline.maintain()
            for table in pipeline.config.tables:
                iceberg = pipeline.catalog.load_table(pipeline.tables[table.key].iceberg)
                left = orphan_files(iceberg, 0)
                if left:
                    self.result.divergences.append({"table": table.key, "orphans_left": left[:5]})
            self.result.divergences.extend(divergences_of(pipeline.verify()))

        self._pipeline_call(catch_up_and_verify)

    def _check_policies(self, pipeline: Pipeline) -> None:
        """The soak's own comparison of each table with excluded, masked or filtered columns and rows, and
        of each history table with the samples of its table (soak/history_check.py)."""
        for table in self.workload.tables:
            if table.options:
                iceberg = pipeline.catalog.load_table(pipeline.tables[table.qualified].iceberg)
                conninfo = self.cluster.conninfo(self.name)
                self.result.divergences.extend(policy_divergences(conninfo, table.policy(), iceberg, self.mask_key))
            if table.qualified in self.samples.samples:
                identifier = pipeline.tables[table.qualified].history
                assert identifier is not None
                history = pipeline.catalog.load_table(identifier)
                samples = self.samples.samples[table.qualified]
                key = [column.name for column in table.key]
                self.result.divergences.extend(history_divergences(history, samples, key, self.seed))
                self.result.history_samples += len(samples)

    def _drop_slot(self) -> None:
        with psycopg.connect(self.cluster.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                "WHERE database = %s AND active_pid IS NOT NULL",
                (self.name,),
            )
            time.sleep(0.2)
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                (self.name,),
            )


def divergences_of(diffs: list[TableDiff]) -> list[dict[str, Any]]:
    """The report's record of every table that verify found different."""
    return [
        {
            "table": diff.table,
            **diff.counts(),
            "examples": {k: [str(x) for x in v] for k, v in diff.examples.items()},
        }
        for diff in diffs
        if not diff.ok
    ]


def run_scenario(
    cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: Profile | None = None
) -> ScenarioResult:
    """Run one seed end to end and return its result (divergences empty when the mirror is exact)."""
    return Scenario(cluster, workdir, seed, spark, profile or Profile()).run()


def summarize(results: list[ScenarioResult]) -> dict[str, Any]:
    """The soak report: seeds, faults injected by kind, restarts, transactions, divergences."""
    faults: Counter[str] = Counter()
    unreached: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for result in results:
        faults.update(result.faults)
        unreached.update(result.armed_not_reached)
        kinds.update(result.transactions)
    failed = [r for r in results if not r.ok]
    return {
        "seeds": len(results),
        "seeds_ok": len(results) - len(failed),
        "faults_injected": dict(sorted(faults.items())),
        "faults_injected_total": sum(faults.values()),
        "armed_but_not_reached": dict(sorted(unreached.items())),
        "restarts": sum(r.restarts for r in results),
        "epoch_restarts": sum(r.epoch_restarts for r in results),
        "history_samples": sum(r.history_samples for r in results),
        "transactions": dict(sorted(kinds.items())),
        "transactions_total": sum(kinds.values()),
        "seconds": round(sum(r.seconds for r in results), 1),
        "failures": [{"seed": r.seed, "error": r.error, "divergences": r.divergences} for r in failed],
    }
