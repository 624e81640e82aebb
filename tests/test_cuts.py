"""Consistent cuts across tables (cuts.py, docs/cuts.md), under continuous writes and running merges.

A writer thread changes ``orders`` and their ``order_items`` in the same source transactions, and
numbers each transaction in a third mirrored table, ``txlog``. Its transactions commit one after
another, so the source as of any transaction boundary is the writer's state after some transaction k.
Each cut, read through its tag with Spark's ``VERSION AS OF``, must hold exactly transactions 1..k in
``txlog`` and equal that state in ``orders`` and ``order_items`` (so no order lacks its items and no
item its order), while ``run`` keeps flushing and merging the same tables.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any

import psycopg
import pytest

from pg2iceberg_dagster import cuts
from pg2iceberg_dagster.cuts import CUT_PROPERTY_PREFIX
from pg2iceberg_dagster.errors import CutError
from pg2iceberg_dagster.iceberg.catalog import snapshot_summaries
from pg2iceberg_dagster.materializer.merge import SOURCE_LSN
from pg2iceberg_dagster.materializer.spark_sql import spark_identifier, spark_string
from pg2iceberg_dagster.source.lsn import format_lsn, parse_lsn

from .conftest import Crash, SourceDb, _in_thread, assert_mirrored, pipeline_running

log = logging.getLogger(__name__)
TABLES = ["public.orders", "public.order_items", "public.txlog"]
# Cuts taken under the writes (more with PG2ICEBERG_TEST_CUTS), and how many of them retention keeps.
CUTS = int(os.environ.get("PG2ICEBERG_TEST_CUTS", "2"))
KEEP = 1

State = tuple[dict[int, tuple[int, int]], dict[tuple[int, int], int]]  # orders, items


class Writer:
    """Changes orders with their items, one source transaction at a time, keeping the state after each."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.orders: dict[int, tuple[int, int]] = {}  # id -> (item count, total)
        self.items: dict[tuple[int, int], int] = {}  # (order id, line) -> amount
        self.states: list[State] = [({}, {})]  # states[k]: after transaction k
        self.rng = random.Random(33)
        self.next_id = 1
        self.committed = threading.Semaphore(0)

    def run(self, stop: threading.Event) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            while not stop.is_set():
                with conn.transaction():
                    self._change(conn)
                    conn.execute("INSERT INTO txlog (seq) VALUES (%s)", (len(self.states),))
                self.states.append((dict(self.orders), dict(self.items)))
                self.committed.release()
                time.sleep(0.05)  # a steady stream, not a flood: every state is kept

    def _change(self, conn: psycopg.Connection) -> None:
        """A new order with items, new items of an existing order, or an order deleted with its items."""
        choice = self.rng.random()
        if choice < 0.5 or len(self.orders) < 5:
            order, lines = self.next_id, self.rng.randint(1, 4)
            self.next_id += 1
            amounts = [self.rng.randint(1, 100) for _ in range(lines)]
            conn.execute("INSERT INTO orders VALUES (%s, %s, %s)", (order, lines, sum(amounts)))
            for line, amount in enumerate(amounts, 1):
                conn.execute("INSERT INTO order_items VALUES (%s, %s, %s)", (order, line, amount))
                self.items[(order, line)] = amount
            self.orders[order] = (lines, sum(amounts))
        elif choice < 0.8:
            order = self.rng.choice(sorted(self.orders))
            lines, total = self.orders[order]
            amount = self.rng.randint(1, 100)
            conn.execute("INSERT INTO order_items VALUES (%s, %s, %s)", (order, lines + 1, amount))
            conn.execute("UPDATE orders SET items = %s, total = %s WHERE id = %s", (lines + 1, total + amount, order))
            self.items[(order, lines + 1)] = amount
            self.orders[order] = (lines + 1, total + amount)
        else:
            order = self.rng.choice(sorted(self.orders))
            conn.execute("DELETE FROM order_items WHERE order_id = %s", (order,))
            conn.execute("DELETE FROM orders WHERE id = %s", (order,))
            self.items = {key: value for key, value in self.items.items() if key[0] != order}
            del self.orders[order]

    def wait_for(self, transactions: int) -> None:
        """Block until ``transactions`` more transactions committed."""
        for _ in range(transactions):
            assert self.committed.acquire(timeout=120), "the writer stopped committing"


def _wait_for_a_merge(pipeline: Any) -> None:
    """Block until ``run`` merged some of the writer's transactions into txlog."""
    for _ in range(600):
        if pipeline.lag("public.txlog").mat_cursor > 0:
            return
        time.sleep(0.2)
    raise AssertionError("run merged nothing into txlog")


def _read_at(spark: Any, catalog: str, namespace: str, table: str, tag: str, columns: str) -> list[tuple]:
    name = spark_identifier(catalog, namespace, table)
    spark.sql(f"REFRESH TABLE {name}")
    return [
        tuple(row) for row in spark.sql(f"SELECT {columns} FROM {name} VERSION AS OF {spark_string(tag)}").collect()
    ]


def _cut_state(spark: Any, catalog: str, namespace: str, tag: str) -> tuple[int, State]:
    """The transactions a cut holds (from txlog, which must be 1..k) and its orders and items."""
    seqs = sorted(seq for (seq,) in _read_at(spark, catalog, namespace, "txlog", tag, "seq"))
    assert seqs == list(range(1, len(seqs) + 1)), f"{tag}: txlog holds a gap: {seqs[:10]}..."
    orders = {i: (n, total) for i, n, total in _read_at(spark, catalog, namespace, "orders", tag, "id, items, total")}
    items = {
        (order, line): amount
        for order, line, amount in _read_at(spark, catalog, namespace, "order_items", tag, "order_id, line, amount")
    }
    return len(seqs), (orders, items)


def test_cuts_under_continuous_writes_read_every_table_at_one_transaction_boundary(
    source: SourceDb, spark: Any
) -> None:
    source.execute("CREATE TABLE orders (id int PRIMARY KEY, items int NOT NULL, total int NOT NULL)")
    source.execute(
        "CREATE TABLE order_items (order_id int, line int, amount int NOT NULL, PRIMARY KEY (order_id, line))"
    )
    source.execute("CREATE TABLE txlog (seq int PRIMARY KEY)")
    config = source.config(
        TABLES,
        flush={"interval_seconds": 0.3},
        materialize={"interval_seconds": 1.0},
        cuts={"keep": KEEP, "groups": {"sales": ["public.orders", "public.order_items", "public.txlog"]}},
    )
    runner, cutter = source.pipeline(config), source.pipeline(config)
    runner.snapshot()
    with pytest.raises(CutError, match="not usable as an Iceberg tag"):
        cutter.cut(name="123")
    writer = Writer(source.conninfo)
    catalog = config.iceberg.catalog.name
    namespace = config.iceberg_identifier(config.tables[0])[0]
    names = [f"cut{i}" for i in range(CUTS)]
    held: list[int] = []
    compared: list[int] = []  # rows read at each cut: txlog, orders and items
    with pipeline_running(runner) as run_errors, _in_thread(writer.run) as write_errors:
        # So that even the first cut holds transactions; read on the cutter's connections (the
        # runner's state connection belongs to its loop's thread: a second thread interleaved
        # its transactions, OutOfOrderTransactionNesting in CI).
        _wait_for_a_merge(cutter)
        for name in names:
            writer.wait_for(10)
            cut = cutter.cut(name=name, group="sales")
            assert cut.lsn and sorted(cut.tables) == sorted(TABLES)
            transactions, state = _cut_state(spark, catalog, namespace, name)
            # The source as of L: exactly the first k transactions, in every table.
            assert state == writer.states[transactions], f"{name} at {cut.lsn}: not the state after {transactions}"
            held.append(transactions)
            compared.append(transactions + len(state[0]) + len(state[1]))
    assert not run_errors and not write_errors, (run_errors, write_errors)
    assert held == sorted(held) and held[0] > 0 and held[-1] > held[0], held
    log.info("cuts held %s of %d transactions; rows compared per cut: %s", held, len(writer.states) - 1, compared)

    # Retention kept the newest two; the latest cut is the last one taken, readable again.
    tables = {key: runner.catalog.load_table(runner.tables[key].iceberg) for key in TABLES}
    for table in tables.values():
        assert sorted(ref for ref in table.metadata.refs if ref.startswith("cut")) == names[-KEEP:]
        assert sorted(p for p in table.properties if p.startswith(CUT_PROPERTY_PREFIX)) == [
            CUT_PROPERTY_PREFIX + name for name in names[-KEEP:]
        ]
    latest = cutter.status()["latest_cut"]
    assert latest["name"] == names[-1] and latest["group"] == "sales" and sorted(latest["tables"]) == sorted(TABLES)
    assert _cut_state(spark, catalog, namespace, names[-1]) == (held[-1], writer.states[held[-1]])

    # At quiescence a merge that reached the head records the source LSN it is complete up to.
    runner.stream(until_caught_up=True)
    runner.materialize()
    assert_mirrored(runner)
    flushed = runner.store.flushed_lsn() or 0
    for key, table in tables.items():
        table.refresh()
        recorded = [parse_lsn(summary[SOURCE_LSN]) for summary in snapshot_summaries(table) if SOURCE_LSN in summary]
        assert recorded and recorded == sorted(recorded) and recorded[-1] <= flushed, key


def test_the_cut_schedule_runs_the_cut_job_every_configured_interval() -> None:
    from pg2iceberg_dagster.dagster_integration import build_definitions

    config = {"source": {"dbname": "app"}, "tables": ["public.orders", "public.order_items"]}
    assert not build_definitions(config, name="plain").schedules  # no interval: cuts on demand only
    defs = build_definitions({**config, "cuts": {"interval_minutes": 120}}, name="shop")
    (schedule,) = defs.schedules
    assert schedule.name == "shop_cut_schedule" and schedule.cron_schedule == "0 */2 * * *"
    assert schedule.job_name == "shop_cut" and defs.get_job_def("shop_cut") is not None


def test_a_cut_refuses_before_writing_and_an_unfinished_one_is_never_the_latest(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    source.execute("CREATE TABLE orders (id int PRIMARY KEY, items int NOT NULL, total int NOT NULL)")
    source.execute("INSERT INTO orders SELECT g, 1, g FROM generate_series(1, 20) g")
    source.execute("CREATE TABLE txlog (seq int PRIMARY KEY)")
    pipeline = source.pipeline(
        source.config(["public.orders", "public.txlog"], cuts={"groups": {"g": ["public.orders"]}})
    )
    with pytest.raises(CutError, match=r"public\.orders \(snapshot not complete: `snapshot` or `run` takes it\)"):
        pipeline.cut()
    with pytest.raises(CutError, match=r"cut group 'nope' is not configured \(cuts.groups has: g\)"):
        pipeline.cut(group="nope")
    pipeline.snapshot()
    first = pipeline.cut(name="first")  # nothing staged: each table tagged at its snapshot's commit
    with pytest.raises(CutError, match=r"'first' is already a tag or branch of public\.orders, public\.txlog"):
        pipeline.cut(name="first")

    # A crash after the first table's tag leaves the cut unfinished: not the latest; the next cut drops it.
    tag = cuts._tag
    tagged: list[str] = []

    def crash_after_one(table: Any, cut: Any, snapshot_id: int) -> None:
        if tagged:
            raise Crash
        tagged.append(cut.name)
        tag(table, cut, snapshot_id)

    monkeypatch.setattr(cuts, "_tag", crash_after_one)
    with pytest.raises(Crash):
        pipeline.cut(name="broken")
    monkeypatch.undo()
    assert pipeline.latest_cut() == first
    pipeline.cut(name="third")
    orders = pipeline.catalog.load_table(pipeline.tables["public.orders"].iceberg)
    assert sorted(orders.metadata.refs) == ["first", "main", "third"]
    at_first = orders.scan(snapshot_id=orders.metadata.refs["first"].snapshot_id).to_arrow()
    assert sorted(at_first.column("id").to_pylist()) == list(range(1, 21))

    # The Dagster cut job takes a cut of each group and reports it on the group's live tables.
    from dagster import instance_for_test

    from pg2iceberg_dagster.dagster_integration import build_definitions

    defs = build_definitions(pipeline.config.model_dump(mode="json", exclude_none=True), name="shop")
    with instance_for_test() as instance:
        result = defs.resolve_job_def("shop_cut").execute_in_process(instance=instance)
    (observation,) = result.asset_observations_for_node("shop_take_cuts")
    metadata = observation.metadata
    assert observation.asset_key.path[-1] == "orders" and metadata["cut_group"].value == "g"
    latest = pipeline.latest_cut()
    assert latest is not None and latest.group == "g" and metadata["cut_name"].value == latest.name
    assert metadata["cut_lsn"].value == format_lsn(latest.lsn) and latest.tables == ("public.orders",)
