"""``matches_source`` under continuous writes: it compares whether the table lags or not, and accounts
for every difference (a change staged past the merge cursor that the source snapshot sees explains
it). It passes only when every difference is explained, fails (an error) on one that is not, and a
check that cannot tell is a failed warning, never a pass.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator

import psycopg
import pytest
from dagster import AssetCheckResult, AssetCheckSeverity, AssetKey

from pg2iceberg_dagster import checks as checks_module
from pg2iceberg_dagster.checks import TableCheckReport
from pg2iceberg_dagster.dagster_integration.assets import MATCHES_SOURCE, table_check_results
from pg2iceberg_dagster.pipeline import Pipeline

from .conftest import SourceDb

pytestmark = pytest.mark.usefixtures("spark")

TABLE = "public.busy"
QUIET_KEY = 100_000  # a row the writer never touches


def _create(source: SourceDb) -> Pipeline:
    source.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, v text, n int)")
    source.execute(f"INSERT INTO {TABLE} SELECT g, 'v' || g, g FROM generate_series(1, 500) g")
    source.execute(f"INSERT INTO {TABLE} VALUES ({QUIET_KEY}, 'quiet', 0)")
    pipeline = source.pipeline(source.config([TABLE]))
    pipeline.snapshot()
    return pipeline


@contextlib.contextmanager
def _writes_and_flusher(source: SourceDb, pipeline: Pipeline) -> Iterator[list[BaseException]]:
    """Inserts, updates and deletes committed all the time (one to three changes a transaction, keys
    below QUIET_KEY), and a flusher staging them, both in threads until the block ends; yields the
    list of errors they raised."""
    stop = threading.Event()
    errors: list[BaseException] = []
    flusher = source.pipeline(pipeline.config)

    def write() -> None:
        rng = random.Random(30)
        next_id = 1_000
        with psycopg.connect(source.conninfo, autocommit=True) as conn:
            while not stop.is_set():
                with conn.transaction():
                    for _ in range(rng.randint(1, 3)):
                        op = rng.random()
                        if op < 0.4:
                            conn.execute(f"INSERT INTO {TABLE} VALUES (%s, 'new', 1)", (next_id,))
                            next_id += 1
                        elif op < 0.8:
                            conn.execute(
                                f"UPDATE {TABLE} SET v = v || '+', n = n + 1 WHERE id = %s", (rng.randint(1, next_id),)
                            )
                        else:
                            conn.execute(f"DELETE FROM {TABLE} WHERE id = %s", (rng.randint(1, next_id),))
                stop.wait(0.01)

    def guarded(target: object) -> None:
        try:
            target()  # type: ignore[operator]
        except BaseException as exc:  # surfaced to the test
            errors.append(exc)

    threads = [
        threading.Thread(target=guarded, args=(write,), daemon=True),
        threading.Thread(target=guarded, args=(lambda: flusher.stream(stop),), daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        yield errors
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def _check(pipeline: Pipeline) -> tuple[TableCheckReport, AssetCheckResult]:
    report = dict(pipeline.check_tables([TABLE]))[TABLE]
    assert isinstance(report, TableCheckReport), report
    results = {result.check_name: result for result in table_check_results(report, AssetKey(["busy"]))}
    return report, results[MATCHES_SOURCE]


def test_every_check_under_writes_compares_and_passes(source: SourceDb) -> None:
    pipeline = _create(source)
    explained = 0
    with _writes_and_flusher(source, pipeline) as errors:
        for _ in range(4):
            pipeline.materialize([TABLE])
            report, result = _check(pipeline)
            content = report.content
            assert content.diff is not None and content.conclusive, content
            assert content.passed and content.unexplained == 0, content
            assert result.passed and result.metadata["compared"].value is True, result
            assert result.metadata["differences_explained_by_later_changes"].value == content.explained
            assert content.source_lsn is not None and (content.merged_lsn or 0) <= content.source_lsn
            explained += content.explained
        assert not errors, errors
    # Writes never stopped: some differences were changes committed after the merge, explained.
    assert explained > 0


def test_a_divergence_injected_under_writes_fails_the_check(source: SourceDb) -> None:
    pipeline = _create(source)
    iceberg = pipeline.catalog.load_table(pipeline.tables[TABLE].iceberg)
    with _writes_and_flusher(source, pipeline) as errors:
        pipeline.materialize([TABLE])
        # A row the writer never touches goes missing from Iceberg: no change can explain that.
        iceberg.delete(f"id = {QUIET_KEY}")
        failures = []
        for _ in range(3):
            pipeline.materialize([TABLE])
            report, result = _check(pipeline)
            assert not report.content.passed and not result.passed, report.content
            if report.content.failed:
                failures.append((report, result))
                break
        assert not errors, errors
    assert failures, "the divergence was never reported as a failure"
    report, result = failures[0]
    assert (QUIET_KEY,) in report.content.unexplained_examples
    assert report.content.diff is not None and report.content.diff.only_in_pg >= 1
    assert result.severity == AssetCheckSeverity.ERROR and result.metadata["compared"].value is True
    assert result.metadata["unexplained_differences"].value >= 1


def test_a_lagging_table_is_compared_and_its_staged_changes_explain_the_differences(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = _create(source)
    source.execute(f"INSERT INTO {TABLE} SELECT g, 'staged', 0 FROM generate_series(2000, 2009) g")
    source.execute(f"UPDATE {TABLE} SET v = 'staged' WHERE id BETWEEN 1 AND 5")
    source.execute(f"DELETE FROM {TABLE} WHERE id BETWEEN 6 AND 8")
    pipeline.stream(until_caught_up=True)  # staged, not merged

    report, result = _check(pipeline)
    content = report.content
    assert content.lag == 18 and content.diff is not None
    assert (content.diff.only_in_pg, content.diff.different, content.diff.only_in_iceberg) == (10, 5, 3)
    assert content.passed and content.explained == 18, content
    assert result.passed and result.metadata["compared"].value is True
    assert result.metadata["differences_explained_by_later_changes"].value == 18

    # A change committed but not staged (no flusher runs) explains nothing yet, and the flusher does
    # not reach the comparison in the wait: a failed warning saying why, not a pass.
    monkeypatch.setattr(checks_module, "IN_FLIGHT_WAIT_SECONDS", 0.5)
    source.execute(f"UPDATE {TABLE} SET v = 'not staged' WHERE id = 9")
    report, result = _check(pipeline)
    assert not report.content.conclusive and "flusher had not staged" in report.content.inconclusive
    assert not result.passed and result.severity == AssetCheckSeverity.WARN
    assert result.metadata["compared"].value is False
    pipeline.stream(until_caught_up=True)
    report, result = _check(pipeline)
    assert report.content.passed and report.content.explained == 19 and result.passed

    # The staged files the comparison needs are gone: it cannot tell.
    for entry in pipeline.store.log_entries(TABLE, 0):
        pipeline.objects.delete(entry.path)
    report, result = _check(pipeline)
    assert not report.content.conclusive and "could not be read" in report.content.inconclusive
    assert not result.passed and result.severity == AssetCheckSeverity.WARN
