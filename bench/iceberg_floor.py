"""The Iceberg library's own cost per table: what a snapshot of many small tables cannot go below.

    .venv/bin/python -m bench.iceberg_floor -c CONFIG --tables N --out FILE.json

On the pipeline's catalog (``open_catalog``: this project's SQL catalog and transactions), one
thread creates ``N`` Iceberg tables in a namespace of its own and gives each one data file of
``ROWS`` rows in one append, one table after another: the least Iceberg work a table's snapshot
does, without its source, its chunks or its coordination rows. Writes the wall and CPU seconds of
that loop (this process's, every thread: pyiceberg writes manifests on a pool) to ``FILE.json``.
``bench.tables --snapshot-only`` runs it as a child and reports it beside the snapshot.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from pyiceberg.io.pyarrow import _dataframe_to_data_files  # pyiceberg is pinned; the snapshot writes with it
from pyiceberg.schema import Schema
from pyiceberg.types import DoubleType, LongType, NestedField, StringType, TimestamptzType

from pg2iceberg_dagster.config import load_config
from pg2iceberg_dagster.iceberg.catalog import open_catalog
from pg2iceberg_dagster.iceberg.transaction import open_transaction

NAMESPACE = "bench_iceberg_floor"
ROWS = 1000  # the bench's small tables hold 500-2,000 rows
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "label", StringType()),
    NestedField(3, "amount", DoubleType()),
    NestedField(4, "created", TimestamptzType()),
    identifier_field_ids=[1],
)


def rows() -> pa.Table:
    """``ROWS`` rows of ``SCHEMA``."""
    created = datetime(2026, 1, 1, tzinfo=UTC)
    return pa.table(
        {
            "id": pa.array(range(ROWS), pa.int64()),
            "label": [f"row {i}" for i in range(ROWS)],
            "amount": [i * 0.5 for i in range(ROWS)],
            "created": pa.array([created] * ROWS, pa.timestamp("us", tz="UTC")),
        }
    ).cast(SCHEMA.as_arrow())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", type=Path, required=True, help="the pipeline config (its catalog)")
    parser.add_argument("--tables", type=int, required=True, help="tables to create and append to")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON figures go")
    args = parser.parse_args()
    catalog = open_catalog(load_config(args.config))
    catalog.create_namespace_if_not_exists(NAMESPACE)
    data = rows()
    wall, cpu = time.monotonic(), time.process_time()
    for index in range(args.tables):
        table = catalog.create_table((NAMESPACE, f"t{index}"), SCHEMA)
        files = list(_dataframe_to_data_files(table_metadata=table.metadata, df=data, io=table.io))
        with (
            open_transaction(table) as transaction,
            transaction.update_snapshot().fast_append() as append,
        ):
            for data_file in files:
                append.append_data_file(data_file)
    figures = {"tables": args.tables, "seconds": time.monotonic() - wall, "cpu_seconds": time.process_time() - cpu}
    args.out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
