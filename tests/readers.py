"""Iceberg readers that do not share our writer, for tests that read the mirror the way its users do.

Each reader returns a table's rows as a list of tuples of the requested columns, normalized so that
the same value reads the same from every engine and from PostgreSQL (psycopg):

- ``timestamptz`` becomes an aware ``datetime`` in UTC (Spark returns naive datetimes in its session
  time zone, which this project sets to UTC);
- ``numeric(p, s)`` stays a ``Decimal`` (equal whatever its exponent: ``1.20 == 1.2``);
- NULL stays ``None``; ``int``, ``bigint``, ``boolean``, ``text`` and ``date`` are compared as they are.

Other types are left out of these tests on purpose: ``uuid`` (pyiceberg and Spark read a string,
DuckDB a ``UUID``, Daft 16 bytes), ``bytea``, ``float``/``double`` (exact equality across engines is
not the point here), arrays, and ``timestamp`` without a time zone (naive on every side, fine, but one
timestamp type suffices).

The engines (versions in pyproject's ``readers`` extra, see docs/readers.md):

- ``pyiceberg``: ``Table.scan(...).to_arrow()`` (the library our snapshot writes with);
- ``spark``: ``SELECT`` through the test run's Spark session (the engine our merges write with);
- ``duckdb``: ``iceberg_scan('<current metadata file>')`` with the ``iceberg`` and ``avro`` extensions
  loaded from the files the ``duckdb-extension-*`` packages ship (no download);
- ``daft``: ``daft.read_iceberg(<pyiceberg table>)`` (its own Rust Parquet reader and delete handling).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql
from pyiceberg.table import Table

from pg2iceberg_dagster.materializer.spark_sql import spark_identifier

ENGINES = ("pyiceberg", "spark", "duckdb", "daft")

Row = tuple[Any, ...]


def normalized(value: Any) -> Any:
    """``value`` as compared across engines (see the module docstring)."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:  # Spark: the session time zone, UTC
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)
    return value  # Decimal compares by value (Decimal("1.20") == Decimal("1.2")); the rest as is


def sorted_rows(rows: Sequence[Sequence[Any]]) -> list[Row]:
    """Normalized tuples, sorted by their first value (the primary key: unique and never NULL)."""
    return sorted((tuple(normalized(v) for v in row) for row in rows), key=lambda row: row[0])


def source_rows(conninfo: str, schema: str, table: str, columns: Sequence[str]) -> list[Row]:
    """The source table's rows (psycopg), ``columns`` only."""
    statement = sql.SQL("SELECT {} FROM {}.{}").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier(schema), sql.Identifier(table)
    )
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return sorted_rows(conn.execute(statement).fetchall())


def source_columns(conninfo: str, schema: str, table: str) -> list[str]:
    """The source table's column names, in order."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [
            name
            for (name,) in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                "AND NOT attisdropped ORDER BY attnum",
                (sql.Identifier(schema, table).as_string(conn),),
            )
        ]


def _arrow_rows(data: pa.Table, columns: Sequence[str]) -> list[Row]:
    return sorted_rows([tuple(row[c] for c in columns) for row in data.select(list(columns)).to_pylist()])


def read_pyiceberg(table: Table, columns: Sequence[str]) -> list[Row]:
    """pyiceberg's scan of ``table``'s current snapshot."""
    return _arrow_rows(table.scan(selected_fields=tuple(columns)).to_arrow(), columns)


def read_spark(spark: Any, catalog: str, identifier: Sequence[str], columns: Sequence[str]) -> list[Row]:
    """Spark SQL over the catalog, after ``REFRESH TABLE`` (pyiceberg commits, such as a resync's,
    are not in the session's table cache)."""
    name = spark_identifier(catalog, *identifier)
    spark.sql(f"REFRESH TABLE {name}")
    selected = ", ".join(spark_identifier(c) for c in columns)
    return sorted_rows([tuple(row) for row in spark.sql(f"SELECT {selected} FROM {name}").collect()])


@cache
def duckdb_extension(name: str) -> str:
    """The extension file the ``duckdb-extension-<name>`` package ships for the installed DuckDB."""
    import importlib

    import duckdb

    package = importlib.import_module(f"duckdb_extension_{name}")
    path = Path(package.__file__ or "").parent / "extensions" / f"v{duckdb.__version__}" / f"{name}.duckdb_extension"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: duckdb-extension-{name} does not match duckdb {duckdb.__version__}")
    return str(path)


@cache
def _duckdb() -> Any:
    """One in-memory DuckDB connection with the ``avro`` and ``iceberg`` extensions loaded from the
    packages' files (loading them takes longer than a small scan)."""
    import duckdb

    conn = duckdb.connect(":memory:", config={"autoinstall_known_extensions": "false"})
    conn.execute("SET TimeZone = 'UTC'")
    for extension in ("avro", "iceberg"):
        conn.execute(f"LOAD '{duckdb_extension(extension)}'")
    return conn


def read_duckdb(table: Table, columns: Sequence[str]) -> list[Row]:
    """DuckDB's ``iceberg_scan`` of the table's current metadata file (no catalog: the file names the
    current snapshot)."""
    metadata = table.metadata_location.removeprefix("file://")
    selected = ", ".join('"' + c.replace('"', '""') + '"' for c in columns)
    data = _duckdb().execute(f"SELECT {selected} FROM iceberg_scan(?)", [metadata]).to_arrow_table()
    return _arrow_rows(data, columns)


def read_daft(table: Table, columns: Sequence[str]) -> list[Row]:
    """Daft's ``read_iceberg`` of the pyiceberg table (Daft plans the scan and applies deletes)."""
    import daft

    return _arrow_rows(daft.read_iceberg(table).select(*columns).to_arrow(), columns)


def read(
    engine: str, spark: Any, catalog: str, table: Table, identifier: Sequence[str], columns: Sequence[str]
) -> list[Row]:
    """``engine``'s (one of :data:`ENGINES`) rows of ``table`` (freshly loaded by pyiceberg; Spark reads
    ``identifier`` in ``catalog`` itself)."""
    if engine == "spark":
        return read_spark(spark, catalog, identifier, columns)
    readers: dict[str, Callable[[Table, Sequence[str]], list[Row]]] = {
        "pyiceberg": read_pyiceberg,
        "duckdb": read_duckdb,
        "daft": read_daft,
    }
    return readers[engine](table, columns)


def versions() -> dict[str, str]:
    """The installed version of each engine (for failure messages and docs/readers.md)."""
    from importlib.metadata import version

    names = ["pyiceberg", "pyspark", "duckdb", "duckdb-extension-iceberg", "duckdb-extension-avro", "daft", "pyarrow"]
    return {name: version(name) for name in names}
