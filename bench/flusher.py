"""Flusher throughput against pg_recvlogical draining the same WAL from a slot created at the same point.

    cd /work/main && .venv/bin/python -m bench.flusher [--scale 10] [--transactions 40000]

On a throwaway cluster: ``pgbench -i``, the pipeline's snapshot of the four pgbench tables (it creates
the publication and our pgoutput slot; ``pgbench_history`` gets a ``bigserial`` key first, since the
pipeline mirrors only tables with a primary key), four more pgoutput slots at that point, then a fixed
TPC-B load (``pgbench -n -c 2 -t N``) with nobody consuming, so the WAL accumulates. Then:

1. the count: ``pg_logical_slot_peek_binary_changes`` on one extra slot up to the end of the load gives
   the number of row changes (Insert, Update and Delete messages); every rate uses that number. It is
   also timed, with the CPU of the backend that runs it: the server's decoding of the same WAL alone (no
   wire, no client), a limit that does not depend on how much CPU a client's walsender spends (the
   target: the flusher at >= 0.35 of its rate). One peek's time drifts with the machine's speed, so it
   runs three times before ours and three times after (a peek consumes nothing), and the median of the
   six is the figure;
2. the limit: ``pg_recvlogical --start`` (pgoutput, same publication) drains another extra slot to
   ``--endpos`` into /dev/null: the walsender's decoding plus the wire, with nothing done client side;
   it runs once before ours and once after, on two slots, and their mean time is the limit (the
   machine's other load drifts; bracketing the flusher run compares like with like);
3. ours: ``Pipeline.stream(until_caught_up=True)`` drains our slot: decode, buffer, Parquet, file://
   staging, registration in the coordination tables, acknowledgement;
4. the stream alone: the flusher's own receive path (``ReplicationStream.read_batch``) drains two more
   slots to the end, one just before ours and one just after, counting the row messages and dropping
   everything: what the walsender and libpq cost with nothing done client side, the floor of any
   flusher on this receive path. The ``why:`` line compares it with the target: when the stream alone
   stays under 0.35 of the server's decoding, the walsender (its ``send()`` per message and its check
   for replies per WAL record, which the peek does not make) bounds every client on this machine;
5. pg_recvlogical once more, on a third slot, with pgoutput's ``binary`` option: not a limit, only what
   binary tuple data would save the walsender (the ``why:`` line says why the flusher stays on text).

Besides the rates it samples the CPU seconds of the walsender (from /proc/PID/stat while it lives) and
of the client, each also per change, and the machine's busy share, so a shortfall can be explained
(for example two cores shared by the server, the client and whatever else runs).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.source.lsn import format_lsn, parse_lsn
from pg2iceberg_dagster.source.replication import XLOG_HEADER, ReplicationStream

from .common import (
    SOURCE_DB,
    Report,
    argument_parser,
    bench_cluster,
    bench_config,
    machine_busy_seconds,
    pg_tool,
    pgbench,
    process_cpu_seconds,
    timed,
    work_dir,
)

TABLES = ["public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers", "public.pgbench_history"]
LIMIT_SLOTS = ("bench_recvlogical_before", "bench_recvlogical_after")
STREAM_SLOTS = ("bench_stream_before", "bench_stream_after")
BINARY_SLOT = "bench_recvlogical_binary"
COUNT_SLOT = "bench_count"
# The server's decoding alone is timed this many times before the flusher and as many after; the
# median of all is the figure.
DECODING_RUNS = 3
TARGET_VS_DECODING = 0.35
CLIENTS = 2
# Insert, Update and Delete: the messages count_changes counts as changes.
ROW_TAGS = frozenset(b"IUD")


class WalsenderCpu:
    """Samples the CPU time of the walsender serving ``slot`` while it is active.

    The walsender exits with its client, so the last sample (every 20 ms) is the figure; it can miss
    at most one sampling interval at the very end.
    """

    def __init__(self, conninfo: str, slot: str) -> None:
        self._conninfo = conninfo
        self._slot = slot
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.seconds = 0.0

    def __enter__(self) -> WalsenderCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        with psycopg.connect(self._conninfo, autocommit=True) as conn:
            pid = None
            while pid is None and not self._stop.is_set():
                row = conn.execute(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (self._slot,)
                ).fetchone()
                pid = row[0] if row else None
                if pid is None:
                    time.sleep(0.005)
        while pid is not None and not self._stop.is_set():
            if not os.path.exists(f"/proc/{pid}"):
                return  # gone with its client: the last sample stands
            self.seconds = max(self.seconds, process_cpu_seconds(pid))  # 0 when it exited just now
            time.sleep(0.02)


class Phase:
    """Wall time, client CPU (this process or its children), walsender CPU and machine busy share of a run."""

    def __init__(self, conninfo: str, slot: str) -> None:
        self.walsender = WalsenderCpu(conninfo, slot)

    def __enter__(self) -> Phase:
        self._busy = machine_busy_seconds()
        self._cpu = _client_cpu()
        self._started = time.perf_counter()
        self.walsender.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds = time.perf_counter() - self._started
        self.walsender.__exit__()
        cpu = _client_cpu()
        self.client_cpu = cpu[0] - self._cpu[0]
        self.child_cpu = cpu[1] - self._cpu[1]
        busy, total = machine_busy_seconds()
        self.busy_share = (busy - self._busy[0]) / max(total - self._busy[1], 1e-9)
        # CPU the rest of the machine (other users, other PostgreSQL backends) took meanwhile.
        self.others_cpu = max(0.0, busy - self._busy[0] - self.client_cpu - self.child_cpu - self.walsender.seconds)


def _client_cpu() -> tuple[float, float]:
    times = os.times()
    return times.user + times.system, times.children_user + times.children_system


def prepare(pg: Any, root: Path, scale: int, transactions: int) -> tuple[Any, int, dict[str, Any]]:
    """pgbench tables, our snapshot + slot, two more slots, the TPC-B load; returns (config, end LSN, facts)."""
    facts: dict[str, Any] = {}
    seconds, _ = timed(lambda: pgbench(pg, "-i", "-q", "-s", str(scale)))
    facts["init_seconds"] = round(seconds, 1)
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        # The pipeline mirrors keyed tables only; pgbench_history has no key of its own.
        conn.execute("ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY")
    config = bench_config(pg, root, TABLES)
    with Pipeline(config) as pipeline:
        seconds, _ = timed(pipeline.snapshot)
    facts["snapshot_seconds"] = round(seconds, 1)
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        for slot in (*LIMIT_SLOTS, *STREAM_SLOTS, BINARY_SLOT, COUNT_SLOT):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    per_client = max(1, transactions // CLIENTS)
    seconds, _ = timed(lambda: pgbench(pg, "-n", "-c", str(CLIENTS), "-j", str(CLIENTS), "-t", str(per_client)))
    facts["load_transactions"] = per_client * CLIENTS
    facts["load_seconds"] = round(seconds, 1)
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        end_lsn = parse_lsn(row[0])
        # synchronous_commit is off on bench clusters: decoding reads only WAL flushed to disk, so wait
        # for the WAL writer to flush the end of the load before anyone counts or drains it.
        while conn.execute("SELECT pg_current_wal_flush_lsn() < %s::pg_lsn", (format_lsn(end_lsn),)).fetchone()[0]:
            time.sleep(0.05)
        facts["wal_bytes"] = end_lsn - confirmed_lsn(conn, config.replication.slot)
    return config, end_lsn, facts


def confirmed_lsn(conn: psycopg.Connection, slot: str) -> int:
    """Where ``slot`` stands: its ``confirmed_flush_lsn``, the first change it will send."""
    row = conn.execute(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    assert row is not None, f"no slot {slot}"
    return parse_lsn(row[0])


def count_changes(pg: Any, publication: str, end_lsn: int, drop: bool) -> tuple[int, int, list[float], list[float]]:
    """(row changes, pgoutput bytes, each run's seconds, each run's CPU seconds of the backend) the
    publication yields up to ``end_lsn``, decoded by the server alone in one SQL call; run
    :data:`DECODING_RUNS` times (a peek consumes nothing), since one run's time drifts with the
    machine's other load. ``drop``: the counting slot is dropped after (the last round)."""
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        pid = conn.info.backend_pid
        runs: list[tuple[int, int, float, float]] = []
        for _ in range(DECODING_RUNS):
            cpu = process_cpu_seconds(pid)
            started = time.perf_counter()
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE get_byte(data, 0) IN (73, 85, 68)), "
                "coalesce(sum(octet_length(data)), 0) "
                "FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL, "
                "'proto_version', '1', 'publication_names', %s)",
                (COUNT_SLOT, format_lsn(end_lsn), publication),
            ).fetchone()
            assert row is not None
            runs.append((int(row[0]), int(row[1]), time.perf_counter() - started, process_cpu_seconds(pid) - cpu))
        if drop:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (COUNT_SLOT,))
    if len({(changes, size) for changes, size, _, _ in runs}) != 1:
        raise RuntimeError(f"the server decoded different changes each time: {runs}")
    return runs[0][0], runs[0][1], [run[2] for run in runs], [run[3] for run in runs]


def run_pg_recvlogical(pg: Any, slot: str, publication: str, end_lsn: int, binary: bool = False) -> Phase:
    """Drain ``slot`` to ``end_lsn`` into /dev/null with pg_recvlogical (``binary``: pgoutput's binary
    tuple data, PostgreSQL 14+)."""
    command = [
        pg_tool("pg_recvlogical"),
        *("-h", "127.0.0.1", "-p", str(pg.port), "-U", pg.superuser, "-d", SOURCE_DB),
        *("--slot", slot, "--start", "--no-loop", "-F", "0", "-f", "/dev/null"),
        *("-o", "proto_version=1", "-o", f"publication_names={publication}", "--endpos", format_lsn(end_lsn)),
        *(("-o", "binary=true") if binary else ()),
    ]
    with Phase(pg.conninfo(SOURCE_DB), slot) as phase:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pg_recvlogical failed: {result.stderr.strip()}")
    return phase


def run_stream_alone(pg: Any, config: PipelineConfig, slot: str, end_lsn: int, changes: int) -> Phase:
    """Drain ``slot`` to ``end_lsn`` through the flusher's receive path, row messages counted (there must
    be ``changes``) and everything dropped."""
    with psycopg.connect(pg.conninfo(SOURCE_DB), autocommit=True) as conn:
        start_lsn = confirmed_lsn(conn, slot)
    received = 0
    stream = ReplicationStream(config.source, slot, config.replication.publication, start_lsn)
    with Phase(pg.conninfo(SOURCE_DB), slot) as phase, stream:
        while True:
            batch = stream.read_batch(0.05)
            received += sum(1 for message in batch if message[XLOG_HEADER] in ROW_TAGS)
            if batch:
                continue
            if stream.server_wal_end >= end_lsn:  # a keepalive sent after every message before it
                break
            stream.request_keepalive()
    if received != changes:
        raise RuntimeError(f"the stream alone received {received} changes, the server decoded {changes}")
    return phase


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--scale", type=int, default=10, help="pgbench scale factor (100,000 accounts each)")
    parser.add_argument("--transactions", type=int, default=40_000, help="TPC-B transactions of the load in all")
    args = parser.parse_args()
    report = Report(
        "flusher",
        {"scale": args.scale, "transactions": args.transactions, "clients": CLIENTS},
        [
            *("run", "changes", "seconds", "changes_per_s", "files", "bytes", "mb_per_s"),
            *("client_cpu_s", "client_us_per_change", "walsender_cpu_s", "walsender_us_per_change"),
            *("others_cpu_s", "machine_busy"),
        ],
    )
    with work_dir(args.dir) as root, bench_cluster(root, {"max_wal_size": "8GB"}) as pg:
        config, end_lsn, facts = prepare(pg, root, args.scale, args.transactions)
        publication = config.replication.publication
        changes, wire_bytes, decoding_runs, decoding_cpus = count_changes(pg, publication, end_lsn, drop=False)
        report.parameters.update(facts, changes=changes, pgoutput_bytes=wire_bytes, end_lsn=format_lsn(end_lsn))

        def us(seconds: float) -> float:
            return round(seconds / changes * 1e6, 2)

        limits = [run_pg_recvlogical(pg, LIMIT_SLOTS[0], publication, end_lsn)]
        streams = [run_stream_alone(pg, config, STREAM_SLOTS[0], end_lsn, changes)]
        with Pipeline(config) as pipeline:
            pipeline.validate()  # startup checks are not part of the throughput
            with Phase(pg.conninfo(SOURCE_DB), config.replication.slot) as ours:
                stats = pipeline.stream(until_caught_up=True)
        streams.append(run_stream_alone(pg, config, STREAM_SLOTS[1], end_lsn, changes))
        limits.append(run_pg_recvlogical(pg, LIMIT_SLOTS[1], publication, end_lsn))
        after_changes, after_bytes, after_runs, after_cpus = count_changes(pg, publication, end_lsn, drop=True)
        if (after_changes, after_bytes) != (changes, wire_bytes):
            raise RuntimeError(
                f"the server decoded {after_changes} changes ({after_bytes} bytes) after the flusher, "
                f"{changes} ({wire_bytes} bytes) before"
            )
        decoding_runs, decoding_cpus = decoding_runs + after_runs, decoding_cpus + after_cpus
        decoding_seconds, decoding_cpu = statistics.median(decoding_runs), statistics.median(decoding_cpus)
        report.parameters["server_decoding_alone_seconds"] = [round(seconds, 3) for seconds in decoding_runs]
        report.add(
            f"server decoding alone (peek, median of {len(decoding_runs)} before and after ours; its backend's CPU)",
            changes, round(decoding_seconds, 2),
            round(changes / decoding_seconds), "-", wire_bytes, round(wire_bytes / decoding_seconds / 1e6, 1),
            "-", "-", round(decoding_cpu, 2), us(decoding_cpu), "-", "-",
        )  # fmt: skip
        binary = run_pg_recvlogical(pg, BINARY_SLOT, publication, end_lsn, binary=True)
        if stats.changes != changes:
            raise RuntimeError(f"the flusher staged {stats.changes} changes, the server decoded {changes}")

        def add_run(name: str, phase: Phase, client_cpu: float, files: Any = "-", size: int = wire_bytes) -> None:
            report.add(
                name, changes, round(phase.seconds, 2), round(changes / phase.seconds), files, size,
                round(size / phase.seconds / 1e6, 1), round(client_cpu, 2), us(client_cpu),
                round(phase.walsender.seconds, 2), us(phase.walsender.seconds), round(phase.others_cpu, 2),
                f"{phase.busy_share:.0%}",
            )  # fmt: skip

        names = ("pg_recvlogical (before)", "pg_recvlogical (after)", "pg_recvlogical, binary (not a limit)")
        for name, limit in zip(names, [*limits, binary], strict=True):
            add_run(name, limit, limit.child_cpu)
        stream_names = ("stream alone, the flusher's receive path (before)", "stream alone (after)")
        for name, stream in zip(stream_names, streams, strict=True):
            add_run(name, stream, stream.client_cpu)
        add_run("flusher", ours, ours.client_cpu, stats.files, stats.bytes)
    limit_seconds = statistics.mean(limit.seconds for limit in limits)
    # Same change count: the ratio of rates is the inverse ratio of the times.
    ratio = limit_seconds / ours.seconds
    report.ratio("flusher_vs_pg_recvlogical", ratio, 0.8)
    # The server decodes for us as it does for the peek, so this is how close to the decoder we get.
    report.ratio("flusher_vs_server_decoding", decoding_seconds / ours.seconds, TARGET_VS_DECODING)
    # No targets: what the receive path alone reaches, and how much of it the staging leaves.
    stream_seconds = statistics.mean(stream.seconds for stream in streams)
    report.ratio("stream_alone_vs_server_decoding", decoding_seconds / stream_seconds)
    report.ratio("flusher_vs_stream_alone", stream_seconds / ours.seconds)
    breakdown = cpu_breakdown(limits, binary, streams, ours, stats.stage_seconds, changes)
    breakdown["server_decoding_alone_wall"] = us(decoding_seconds)
    breakdown["server_decoding_alone_cpu"] = us(decoding_cpu)
    report.parameters["cpu_us_per_change"] = breakdown
    report.parameters["why"] = explain(breakdown, ours, ratio, report.ratios)
    report.emit(args.json)
    print(f"why: {report.parameters['why']}")


def cpu_breakdown(
    limits: list[Phase], binary: Phase, streams: list[Phase], ours: Phase, stage_seconds: float, changes: int
) -> dict[str, float]:
    """CPU microseconds per change of each process in each run (a limit's: the mean of its runs)."""

    def per_change(seconds: float) -> float:
        return round(seconds / changes * 1e6, 2)

    return {
        "walsender_for_pg_recvlogical": per_change(statistics.mean(p.walsender.seconds for p in limits)),
        "walsender_for_pg_recvlogical_binary": per_change(binary.walsender.seconds),
        "pg_recvlogical": per_change(statistics.mean(p.child_cpu for p in limits)),
        "walsender_for_stream_alone": per_change(statistics.mean(p.walsender.seconds for p in streams)),
        "stream_alone": per_change(statistics.mean(p.client_cpu for p in streams)),
        "walsender_for_flusher": per_change(ours.walsender.seconds),
        "flusher": per_change(ours.client_cpu),
        "flusher_staging": per_change(stage_seconds),
        "flusher_receiving_and_rest": per_change(ours.client_cpu - stage_seconds),
    }


def explain(cpu: dict[str, float], ours: Phase, ratio: float, ratios: dict[str, float]) -> str:
    """Which process bounds the flusher run, from the CPU each one spent per change; the ceiling of the
    ratio to the server's decoding alone that those CPU costs leave on this machine, and the one the
    stream alone measured; why binary pgoutput is not used."""
    bound = "the flusher" if cpu["flusher"] > cpu["walsender_for_flusher"] else "the walsender"
    cores = os.cpu_count() or 1
    walsender, client, decoding = cpu["walsender_for_flusher"], cpu["flusher"], cpu["server_decoding_alone_cpu"]
    # Server and client work in parallel: a run takes at least the busier one's CPU time, and at least
    # both together spread over every core. On a quiet machine the peek takes its backend's CPU time.
    floor = max(walsender, client, (walsender + client) / cores)
    if ratios["stream_alone_vs_server_decoding"] < TARGET_VS_DECODING:
        stream_verdict = (
            "under the target with nothing staged, so in this run the walsender (a send() per message, and per WAL "
            "record a check for replies from the client, which the peek makes neither of) held every client of "
            "this receive path under it: the floor on this machine"
        )
    else:
        stream_verdict = "above the target, so the target was within reach in this run"
    text = (
        f"per change, the server decoding alone took {cpu['server_decoding_alone_wall']} us "
        f"({decoding} us of its backend's CPU); the walsender spent {cpu['walsender_for_pg_recvlogical']} us of "
        f"CPU decoding and sending for pg_recvlogical and {walsender} us for the flusher (a send() to the socket "
        f"per message, 1.5 messages a TPC-B change, which the peek does not make); the flusher process spent "
        f"{client} us ({cpu['flusher_staging']} us decoding, encoding and uploading staged files, "
        f"{cpu['flusher_receiving_and_rest']} us receiving through libpq, buffering and registering). Server and "
        f"client run in parallel on {cores} cores shared with everything else on the machine (busy "
        f"{ours.busy_share:.0%} during the flusher run, {ours.others_cpu:.2f} s of CPU taken by other processes), "
        f"so {bound} bounds the run: at best max({walsender}, {client}, ({walsender} + {client}) / {cores}) = "
        f"{floor:.2f} us a change, a ratio to the server's decoding alone of at most {decoding / floor:.2f}; the "
        f"walsender alone, with a client that cost nothing, caps it at {decoding / walsender:.2f} (target "
        f"{TARGET_VS_DECODING}). The stream alone (the flusher's receive path, nothing staged, run just before "
        f"and just after it) reached {ratios['stream_alone_vs_server_decoding']:.3f} of the server's decoding, "
        f"its walsender spending {cpu['walsender_for_stream_alone']} us a change and this process "
        f"{cpu['stream_alone']} us: {stream_verdict}; the flusher reached {ratios['flusher_vs_stream_alone']:.3f} "
        "of the stream alone. Binary pgoutput is not used: the walsender spent "
        f"{cpu['walsender_for_pg_recvlogical_binary']} us a change with it (pg_recvlogical, against "
        f"{cpu['walsender_for_pg_recvlogical']} in text), and the staged log holds each value's PostgreSQL text "
        "form, so the client would have to re-create the output function of every mapped type exactly (numeric, "
        "floats, timestamps under the session's DateStyle and TimeZone, intervals, arrays, ranges, geometry)"
    )
    if ratio < 0.8:
        text += (
            "; below the pg_recvlogical target: the flusher's CPU per change exceeds the walsender's, or other "
            "load took the cores (compare machine_busy)"
        )
    return text


if __name__ == "__main__":
    main()
