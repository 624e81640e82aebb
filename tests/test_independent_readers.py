"""The mirror read by engines that do not share our writer: DuckDB, Daft, pyiceberg and Spark.

One pipeline per delete format the project writes (``iceberg.delete_format``: copy-on-write; merge-on-read,
position deletes written by Spark's ``MERGE`` and, once
the table holds ``materialize.branch_upsert_min_rows``, by the branch path's ``DELETE`` before an
append fast-forwarded onto main) mirrors one table with a partition spec (``bucket(4, id)``,
``month(at)``; unpartitioned tables are the simpler case for a reader). The source then goes through every step
below in sequence; after each merge every engine reads both tables and must return exactly the
source's rows (psycopg), compared as sorted lists of normalized tuples of the source's current columns
(``tests/readers.py`` says which types and why). The column set is the types all four read alike:
int, bigint, text, numeric(p, s), boolean, date, timestamptz, with NULLs in each.

Each cell of the matrix in docs/readers.md is one ``test_reader_reads_what_the_source_holds[format-engine]``,
or for deletion vectors (which the project cannot write yet) ``test_reader_reads_deletion_vectors[engine]``.
An engine found to read something wrong is kept as a strict xfail naming its version and the
behaviour, not left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.materializer.branch import MERGE_BRANCH
from pg2iceberg_dagster.pipeline import Pipeline

from .conftest import SourceDb, assert_mirrored, sync
from .readers import ENGINES, Row, read, source_columns, source_rows, versions

# Delete format (``iceberg.delete_format``) -> materialize settings.
# Merge-on-read writes with Spark's MERGE while the table's snapshot summary counts fewer than
# ``branch_upsert_min_rows`` records (300 after the snapshot, growing with every merge: position-deleted
# rows still count), then through the branch path (delete by key + append, fast-forwarded onto main).
# Deletion vectors are not among them: the project cannot write v3 tables yet (iceberg/delete_formats.py);
# ``test_reader_reads_deletion_vectors`` reads a v3 table Spark alone wrote.
FORMATS: dict[str, dict[str, Any]] = {
    "copy-on-write": {},
    "merge-on-read": {"branch_upsert_min_rows": 450},
}
# One table, partitioned: its files split by bucket and month, an update moving a row between them.
TABLES = {"public.items": {"partition_by": ["bucket(4, id)", "month(at)"]}}
ROWS = {"public.items": 300}
# Compaction at the end: every small file and every delete file is rewritten, snapshots expired.
MAINTENANCE = {"snapshot_retention_hours": 0, "min_snapshots": 2, "orphan_min_age_hours": 0}


def _each_table(source: SourceDb, statement: str) -> None:
    """Run ``statement`` (with ``{t}`` for the table name) on every mirrored table."""
    for key in TABLES:
        source.execute(statement.format(t=key))


def _create(source: SourceDb) -> None:
    _each_table(
        source,
        "CREATE TABLE {t} (id int PRIMARY KEY, qty int, note text, price numeric(8, 2), active boolean, "
        "born date, at timestamptz, legacy text)",
    )
    for key, rows in ROWS.items():
        source.execute(
            f"INSERT INTO {key} SELECT g, g * 10, CASE WHEN g % 7 = 0 THEN NULL ELSE 'note ' || g END, "
            "CASE WHEN g % 11 = 0 THEN NULL ELSE g / 8.0 END, CASE WHEN g % 5 = 0 THEN NULL ELSE g % 2 = 0 END, "
            "date '2024-01-01' + g, CASE WHEN g % 13 = 0 THEN NULL "
            "ELSE timestamptz '2024-03-01 10:00:00+02' + g * interval '7 hours 3 minutes 0.25 seconds' END, "
            f"'legacy ' || g FROM generate_series(1, {rows}) g"
        )


def _insert(source: SourceDb, first: int, columns: str, values: str) -> None:
    """Insert ids ``first`` .. ``first + 9`` with ``values`` (SQL over ``g``) into ``columns``."""
    _each_table(source, f"INSERT INTO {{t}} ({columns}) SELECT {values} FROM generate_series({first}, {first + 9}) g")


BASE = "id, qty, note, price, active, born, at"
BASE_VALUES = (
    "g, g, 'new ' || g, g / 3.0, g % 3 = 0, date '2025-06-01' - g, "
    "timestamptz '2025-01-01 00:00:00Z' + g * interval '1 day'"
)


def _updates(source: SourceDb) -> None:
    _each_table(source, "UPDATE {t} SET note = note || ' +', price = price + 1, active = NOT active WHERE id % 3 = 0")
    _each_table(source, "UPDATE {t} SET at = NULL, note = NULL WHERE id % 17 = 0")


def _deletes(source: SourceDb) -> None:
    _each_table(source, "DELETE FROM {t} WHERE id % 5 = 0 OR id BETWEEN 40 AND 49")


def _key_change(source: SourceDb) -> None:
    # Moves rows to other buckets (and their old key away): the old key must read as gone everywhere.
    _each_table(source, "UPDATE {t} SET id = id + 1000, note = 'moved' WHERE id % 7 = 1")
    _each_table(source, "UPDATE {t} SET id = 5000 WHERE id = 2")


def _add_column(source: SourceDb) -> None:
    # (A constant DEFAULT would cost a rewrite of the table, a MERGE more: tests/test_ddl.py has those.)
    _each_table(source, "ALTER TABLE {t} ADD COLUMN extra text, ADD COLUMN score int")
    _each_table(source, "UPDATE {t} SET extra = 'extra ' || id WHERE id % 4 = 0")
    _insert(source, 10000, f"{BASE}, extra, score", f"{BASE_VALUES}, NULL, g")


def _rename_column(source: SourceDb) -> None:
    _each_table(source, "ALTER TABLE {t} RENAME COLUMN note TO remark")
    _each_table(source, "UPDATE {t} SET remark = 'renamed ' || id WHERE id % 6 = 0")
    _insert(source, 11000, "id, qty, remark, price, at", "g, g, 'after rename', 1.5, now()")


def _drop_column(source: SourceDb) -> None:
    # Iceberg keeps the dropped column (null from then on); readers are compared on the source's columns.
    _each_table(source, "ALTER TABLE {t} DROP COLUMN legacy")
    _each_table(source, "UPDATE {t} SET qty = -qty WHERE id % 8 = 0")
    _insert(source, 12000, "id, qty, remark", "g, g, 'after drop'")


def _widen_in_place(source: SourceDb) -> None:
    # numeric(8, 2) -> numeric(12, 2): no table rewrite at the source, an Iceberg decimal promotion
    # (older files keep decimal(8, 2) physically).
    _each_table(source, "ALTER TABLE {t} ALTER COLUMN price TYPE numeric(12, 2)")
    _each_table(source, "UPDATE {t} SET price = 1234567890.12 WHERE id % 9 = 0")


def _widen_by_rewrite(source: SourceDb) -> None:
    # int -> bigint rewrites the source table: the mirror resyncs it (a new Iceberg field of that name).
    _each_table(source, "ALTER TABLE {t} ALTER COLUMN qty TYPE bigint")
    _each_table(source, "UPDATE {t} SET qty = 9000000000 + id WHERE id % 10 = 3")


def _more_changes(source: SourceDb) -> None:
    _each_table(source, "UPDATE {t} SET remark = 'last', score = coalesce(score, 0) + 1 WHERE id % 4 = 1")
    _each_table(source, "DELETE FROM {t} WHERE id % 11 = 2")
    _insert(source, 13000, "id, qty, remark, price", "g, g * 1000000000::bigint, 'last insert', g / 7.0")


# The steps, in order; after each one the pipeline merges and every engine reads.
STEPS: list[tuple[str, Callable[[SourceDb], None]]] = [
    ("update", _updates),
    ("delete", _deletes),
    ("key change", _key_change),
    ("add column", _add_column),
    ("rename column", _rename_column),
    ("drop column", _drop_column),
    ("widen numeric(8,2) to numeric(12,2)", _widen_in_place),
    ("widen int to bigint (resync)", _widen_by_rewrite),
    ("more changes", _more_changes),
]


@dataclass
class Outcome:
    """What every engine read, step by step, for one delete format."""

    delete_format: str
    steps: list[str] = field(default_factory=list)
    problems: dict[str, list[str]] = field(default_factory=lambda: {engine: [] for engine in ENGINES})
    seconds: float = 0.0
    # Seconds spent by each engine reading, and by the writer ("pipeline") merging and maintaining.
    timings: dict[str, float] = field(default_factory=dict)

    def timed(self, what: str, started: float) -> None:
        """Add the time since ``started`` to ``what``'s total."""
        self.timings[what] = self.timings.get(what, 0.0) + time.monotonic() - started


def _difference(expected: list[Row], got: list[Row]) -> str:
    """A short account of how ``got`` differs from ``expected``."""
    want, have = set(expected), set(got)
    missing, extra = sorted(want - have, key=repr)[:2], sorted(have - want, key=repr)[:2]
    return f"{len(got)} rows, source {len(expected)}; missing e.g. {missing}; unexpected e.g. {extra}"


def _read_everything(source: SourceDb, pipeline: Pipeline, spark: Any, step: str, outcome: Outcome) -> None:
    """Every engine reads every table; a difference from the source (or an error) is recorded."""
    outcome.steps.append(step)
    catalog = pipeline.config.iceberg.catalog.name
    for key in TABLES:
        schema, name = key.split(".")
        columns = source_columns(source.conninfo, schema, name)
        expected = source_rows(source.conninfo, schema, name, columns)
        identifier = pipeline.tables[key].iceberg
        table = pipeline.catalog.load_table(identifier)
        for engine in ENGINES:
            started = time.monotonic()
            try:
                got = read(engine, spark, catalog, table, identifier, columns)
            except Exception as exc:
                outcome.problems[engine].append(f"after {step}, {key}: {type(exc).__name__}: {str(exc)[:400]}")
                continue
            finally:
                outcome.timed(engine, started)
            if got != expected:
                outcome.problems[engine].append(f"after {step}, {key}: {_difference(expected, got)}")


# CI reads merge-on-read (position deletes, both write paths: the harder case for a reader) to stay
# within its time budget; PG2ICEBERG_ALL_DELETE_FORMATS=1 adds copy-on-write and the v3 deletion
# vectors (docs/readers.md).
TESTED_FORMATS = list(FORMATS) if os.environ.get("PG2ICEBERG_ALL_DELETE_FORMATS") == "1" else ["merge-on-read"]


@pytest.fixture(scope="module", params=TESTED_FORMATS)
def outcome(request: pytest.FixtureRequest, pg: EmbeddedPostgres, workdir: Path, spark: Any) -> Iterator[Outcome]:
    """One pipeline in ``request.param``'s delete format through every step, read by every engine."""
    delete_format = request.param
    materialize = FORMATS[delete_format]
    started = time.monotonic()
    source = SourceDb(pg, workdir)
    try:
        _create(source)
        tables = [{"name": key, **spec} for key, spec in TABLES.items()]
        iceberg = source.config(tables).iceberg.model_dump(mode="json", exclude_none=True)
        iceberg["delete_format"] = delete_format
        config = source.config(tables, iceberg=iceberg, materialize=materialize, maintenance=MAINTENANCE)
        pipeline = source.pipeline(config)
        result = Outcome(delete_format)
        pipeline.snapshot()
        _read_everything(source, pipeline, spark, "snapshot", result)
        for step, change in STEPS:
            change(source)
            at = time.monotonic()
            sync(pipeline)
            if pipeline.resyncs_pending():
                for key in pipeline.resyncs_pending():
                    pipeline.resync(key)
                sync(pipeline)
            result.timed("pipeline", at)
            _read_everything(source, pipeline, spark, step, result)
        at = time.monotonic()
        compacted = pipeline.maintain()
        result.timed("pipeline", at)
        assert all(r.skipped is None for r in compacted), compacted
        assert all(r.after is not None and r.after.delete_files == 0 for r in compacted), compacted
        _read_everything(source, pipeline, spark, "compaction", result)
        assert_mirrored(pipeline)
        # Merge-on-read took the branch path too (copy-on-write never does).
        refs = pipeline.catalog.load_table(pipeline.tables["public.items"].iceberg).metadata.refs
        assert (MERGE_BRANCH in refs) == (delete_format == "merge-on-read"), refs
        result.seconds = time.monotonic() - started
        print(f"{delete_format}: {result.seconds:.1f} s", {k: round(v, 1) for k, v in result.timings.items()})
        yield result
    finally:
        source.close()


# Cells of the matrix an engine reads wrong: (delete format, engine) -> the reason (engine, version,
# behaviour) and the steps after which it reads wrong. Such a cell is an xfail only when every
# difference falls after those steps, and fails when there is none (strict): a fixed reader fails the
# run until its entry is removed.
DAFT_RENAME = (
    "daft 0.6.14 reads a column renamed in the Iceberg schema as NULL in every data file written before "
    "the rename (it matches Parquet columns by name, not by Iceberg field id); pyiceberg, Spark and "
    "DuckDB read the values. Files written after the rename (or rewritten by a resync) read right. "
    "Fixed in daft 0.7.26, which needs pyarrow < 26."
)
# From the rename until the int -> bigint resync rewrites every file.
RENAMED_NOT_YET_REWRITTEN = ("rename column", "drop column", "widen numeric(8,2) to numeric(12,2)")
KNOWN_WRONG: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("copy-on-write", "daft"): (DAFT_RENAME, RENAMED_NOT_YET_REWRITTEN),
    ("merge-on-read", "daft"): (DAFT_RENAME, RENAMED_NOT_YET_REWRITTEN),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_reader_reads_what_the_source_holds(outcome: Outcome, engine: str) -> None:
    """``engine`` read the table equal to the source after the snapshot, after every step and after
    compaction (or, in a cell of ``KNOWN_WRONG``, wrong after exactly its steps and right after all others)."""
    assert outcome.steps == ["snapshot", *(step for step, _ in STEPS), "compaction"]
    problems = outcome.problems[engine]
    known = KNOWN_WRONG.get((outcome.delete_format, engine))
    if known is None:
        assert problems == [], f"{engine} in {outcome.delete_format} ({versions()})"
        return
    reason, steps = known
    unexpected = [p for p in problems if not any(p.startswith(f"after {step},") for step in steps)]
    assert unexpected == [], f"{engine} in {outcome.delete_format} ({versions()})"
    wrong_after = {step for step in steps if any(p.startswith(f"after {step},") for p in problems)}
    assert wrong_after == set(steps), f"{engine} reads right after {set(steps) - wrong_after}: update KNOWN_WRONG"
    pytest.xfail(reason)


def test_daft_reads_a_column_renamed_in_a_table_pyiceberg_alone_wrote(tmp_path: Path) -> None:
    """The Daft limitation without our writer: a table pyiceberg wrote (its Parquet columns carry
    ``PARQUET:field_id``), one column renamed, read by Daft. An xfail only if Daft alone is wrong;
    once a Daft reads it right this fails, to have ``KNOWN_WRONG`` emptied (daft 0.7.26 does, but
    needs pyarrow < 26)."""
    import daft
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("readers", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}")
    catalog.create_namespace("ns")
    table = catalog.create_table("ns.t", schema=pa.schema([pa.field("id", pa.int64()), pa.field("note", pa.string())]))
    table.append(pa.table({"id": [1, 2], "note": ["a", "b"]}))
    (path,) = (row["file_path"] for row in table.inspect.files().to_pylist())
    assert [f.metadata for f in pq.read_schema(path.removeprefix("file://"))] == [
        {b"PARQUET:field_id": b"1"},
        {b"PARQUET:field_id": b"2"},
    ]
    with table.update_schema() as update:
        update.rename_column("note", "remark")
    table = catalog.load_table("ns.t")
    assert table.scan().to_arrow().to_pydict() == {"id": [1, 2], "remark": ["a", "b"]}
    read_by_daft = daft.read_iceberg(table).to_pydict()
    if read_by_daft == {"id": [1, 2], "remark": [None, None]}:
        pytest.xfail(DAFT_RENAME)
    assert read_by_daft != {"id": [1, 2], "remark": ["a", "b"]}, "Daft reads renames now: empty KNOWN_WRONG"
    raise AssertionError(f"Daft read {read_by_daft}")


# Deletion vectors (Iceberg v3). The project cannot write a v3 table (pyiceberg 0.12 writes its snapshots,
# resyncs and schema changes and cannot write v3 metadata: iceberg/delete_formats.py), so this reads a
# v3 table Spark alone wrote with the runtime the project ships, compared with the rows it must hold
# (computed here, not read back from Spark), before and after the project's compaction.
DV_ROWS = 300
DV_COLUMNS = ["id", "qty", "note", "price", "born"]
DAFT_DELETION_VECTORS = (
    "daft 0.6.14 opens a deletion vector's Puffin file as Parquet ('The file must end with PAR1') and "
    "reads no table holding one; after compaction (no delete files) it reads the table right"
)


def _dv_expected() -> list[Row]:
    """The rows the statements of ``_write_deletion_vectors`` leave, computed in Python."""
    import datetime as dt
    from decimal import ROUND_HALF_UP, Decimal

    rows = {
        g: [
            g,
            g * 10,
            f"note {g}",
            (Decimal(g) / 8).quantize(Decimal("0.01"), ROUND_HALF_UP),
            dt.date(2024, 1, 1) + dt.timedelta(days=g),
        ]
        for g in range(1, DV_ROWS + 1)
    }
    for g in [g for g in rows if g % 5 == 0]:
        del rows[g]
    for g in [g for g in rows if g % 3 == 0]:
        rows[g][2] = None
    del rows[1]  # the MERGE deletes 1, updates 2, inserts 1001
    rows[2][1] = -2
    rows[1001] = [1001, 1, "merged", Decimal("1.5"), None]
    return sorted((tuple(row) for row in rows.values()), key=lambda row: row[0])


def _write_deletion_vectors(spark: Any, name: str) -> list[Any]:
    """A v3 merge-on-read table partitioned by ``bucket(4, id)``, changed by DELETE, UPDATE and MERGE
    (two passes over some files: one deletion vector per data file, merged); its delete files."""
    modes = ", ".join(f"'write.{kind}.mode' = 'merge-on-read'" for kind in ("merge", "update", "delete"))
    spark.sql(
        f"CREATE TABLE {name} (id int, qty bigint, note string, price decimal(12, 2), born date) USING iceberg "
        f"PARTITIONED BY (bucket(4, id)) TBLPROPERTIES ('format-version' = '3', {modes})"
    )
    spark.sql(
        f"INSERT INTO {name} SELECT id, id * 10, concat('note ', id), CAST(id / 8.0 AS decimal(12, 2)), "
        f"date_add(DATE '2024-01-01', id) FROM (SELECT CAST(id AS int) id FROM range(1, {DV_ROWS + 1}))"
    )
    spark.sql(f"DELETE FROM {name} WHERE id % 5 = 0")
    spark.sql(f"UPDATE {name} SET note = NULL WHERE id % 3 = 0")
    spark.sql(
        f"MERGE INTO {name} t USING (SELECT * FROM VALUES (1, 'd'), (2, 'u'), (1001, 'i') AS s(id, op)) s "
        "ON t.id = s.id WHEN MATCHED AND s.op = 'd' THEN DELETE WHEN MATCHED THEN UPDATE SET qty = -t.id "
        "WHEN NOT MATCHED THEN INSERT (id, qty, note, price, born) VALUES (s.id, 1, 'merged', 1.5, NULL)"
    )
    return spark.sql(f"SELECT content, file_format FROM {name}.delete_files").collect()


@pytest.fixture(scope="module")
def deletion_vectors(pg: EmbeddedPostgres, workdir: Path, spark: Any) -> dict[str, dict[str, str | None]]:
    """Each engine's reading of the v3 table (None: equal to the expected rows, else what differed),
    before and after the project's compaction."""
    from pg2iceberg_dagster.config import MaintenanceConfig
    from pg2iceberg_dagster.iceberg.catalog import open_catalog
    from pg2iceberg_dagster.maintenance.procedures import compact
    from pg2iceberg_dagster.materializer.spark_sql import spark_identifier

    from .conftest import base_config

    config = base_config(pg, workdir, "dv", [{"name": "public.unused"}])
    catalog_name, identifier = config.iceberg.catalog.name, ("dv_v3", "items")
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {spark_identifier(catalog_name, identifier[0])}")
    delete_files = _write_deletion_vectors(spark, spark_identifier(catalog_name, *identifier))
    # Spark wrote deletion vectors (content 1 = position deletes, in Puffin files), not Parquet position deletes.
    assert delete_files and {(row.content, row.file_format) for row in delete_files} == {(1, "PUFFIN")}
    catalog, expected = open_catalog(config), _dv_expected()
    outcome: dict[str, dict[str, str | None]] = {"deletion vectors": {}, "compacted": {}}
    for phase in outcome:
        if phase == "compacted":
            done = compact(spark, catalog_name, identifier, MaintenanceConfig(), sorted_table=False)
            assert done.delete_files_removed == len(delete_files), done
        table = catalog.load_table(identifier)
        assert table.metadata.format_version == 3
        for engine in ENGINES:
            try:
                got = read(engine, spark, catalog_name, table, identifier, DV_COLUMNS)
                outcome[phase][engine] = None if got == expected else _difference(expected, got)
            except Exception as exc:
                outcome[phase][engine] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return outcome


@pytest.mark.skipif(
    os.environ.get("PG2ICEBERG_ALL_DELETE_FORMATS") != "1", reason="PG2ICEBERG_ALL_DELETE_FORMATS=1 reads v3 too"
)
@pytest.mark.parametrize("engine", ENGINES)
def test_reader_reads_deletion_vectors(deletion_vectors: dict[str, dict[str, str | None]], engine: str) -> None:
    """``engine`` reads a v3 table with deletion vectors (Spark's) right, and after compaction; Daft
    0.6.14 is a strict xfail (iceberg/delete_formats.py's READS says so: a Daft reading them fails this)."""
    assert deletion_vectors["compacted"][engine] is None, f"{engine} after compaction ({versions()})"
    problem = deletion_vectors["deletion vectors"][engine]
    if engine != "daft":
        assert problem is None, f"{engine} ({versions()})"
        return
    assert problem is not None, "Daft reads deletion vectors now: add them to READS['daft'] and docs/readers.md"
    assert "PAR1" in problem, problem
    pytest.xfail(DAFT_DELETION_VECTORS)
