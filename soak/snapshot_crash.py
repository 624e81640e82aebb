"""The snapshot-crash soak: a large busy table, ``snapshot`` and its holder killed again and again.

Per seed: a fresh database with ``public.busy`` (see :mod:`soak.busy`) of ``busy_rows`` rows in small
CTID chunks, and writes that never stop while the snapshot runs: non-HOT updates that move rows into
chunks read earlier, key changes, updates that leave a TOASTed column out of the WAL, deletes and
re-inserts of one key. ``snapshot`` runs as a child process and is SIGKILLed at random moments (or
dies at an armed crash point) several times; in some seeds the soak runs the snapshot holder itself
and kills it too, so the exported snapshot is lost and the table starts again in a new epoch. Then
the writes stop, the pipeline catches up, and the table is compared with the source row by row.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .busy import BusyTable
from .busy_scenario import BusyTableScenario
from .runner import ChildProcess, Cluster, ScenarioResult

SNAPSHOT_CRASH_POINTS = ["snapshot.mid_chunk", "snapshot.after_chunk_commit"]


@dataclass
class SnapshotCrashProfile:
    """How big a snapshot-crash scenario is."""

    busy_rows: int = 300_000
    chunk_pages: tuple[int, ...] = (8, 16, 32)
    kills: tuple[int, int] = (2, 6)  # snapshot deaths per seed, at least and at most
    holder_kill_rate: float = 0.5  # seeds where the soak owns the holder and kills it once


class SnapshotCrashScenario(BusyTableScenario):
    """Runs one seed against ``cluster``; ``spark`` is the session used for the final merges."""

    name_prefix = "snapcrash"
    parallelism = 2

    def __init__(self, cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: SnapshotCrashProfile) -> None:
        super().__init__(cluster, workdir, seed, spark, profile.busy_rows, profile.chunk_pages)
        self.profile = profile

    def exercise(self, busy: BusyTable) -> None:
        def kill_then_finish() -> None:
            self._kill_snapshots()
            self._finish_snapshot()

        self.under_writes(busy, kill_then_finish)

    def _kill_snapshots(self) -> None:
        """Start ``snapshot`` and kill it (SIGKILL, or an armed crash point) again and again, each time
        after a few more chunks are done; in some seeds also kill the holder the soak started."""
        holder = None
        kills = self.rng.randint(*self.profile.kills)
        if self.rng.random() < self.profile.holder_kill_rate:
            holder = ChildProcess(self.config_path, ["hold-snapshot"], None, self.log)
        holder_dies_after = self.rng.randint(1, min(kills, 2))
        for number in range(1, kills + 1):
            armed = None
            if self.rng.random() < 0.3:
                armed = f"{self.rng.choice(SNAPSHOT_CRASH_POINTS)}:{self.rng.randint(1, 3)}"
            before = self.chunks_done()
            child = ChildProcess(self.config_path, ["snapshot"], armed, self.log)
            more = self.rng.randint(0, 3)  # 0: killed before any chunk of this run is done
            deadline = time.monotonic() + 30
            while child.alive() and time.monotonic() < deadline and self.chunks_done() < before + more:
                time.sleep(0.05)
            if child.alive():
                child.kill()
            code = child.wait(600)
            if code == 0:
                self.result.armed_not_reached["snapshot.kill"] += 1
                return  # it finished before the kill
            if code != -signal.SIGKILL:
                raise RuntimeError(f"snapshot exited with {code}, expected 0 or SIGKILL")
            self.result.faults["snapshot." + (armed.split(":")[0].split(".")[1] if armed else "kill")] += 1
            self.result.restarts += 1
            if holder is not None and number == holder_dies_after:
                if holder.alive():
                    holder.kill()
                    self.result.faults["holder.kill"] += 1
                holder.wait(60)

    def _finish_snapshot(self) -> None:
        for _ in range(3):  # a run whose holder was lost mid-read says so and exits 1: run it again
            if ChildProcess(self.config_path, ["snapshot"], None, self.log).wait(1800) == 0:
                return
        raise RuntimeError("snapshot did not complete after restarts")


def run_snapshot_crash_scenario(
    cluster: Cluster, workdir: Path, seed: int, spark: Any, profile: SnapshotCrashProfile | None = None
) -> ScenarioResult:
    """Run one snapshot-crash seed end to end (divergences empty when the mirror is exact)."""
    return SnapshotCrashScenario(cluster, workdir, seed, spark, profile or SnapshotCrashProfile()).run()
