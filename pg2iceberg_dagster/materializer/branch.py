"""Rows handed to Spark, and the branch write: a batch's keys deleted and its rows appended on an Iceberg
branch, then main fast-forwarded to it in one step. Spark's DELETE by key is an inner join that
broadcasts the batch (a MERGE with inserts shuffles the whole target), and on a merge-on-read table it
writes position deletes. Used by the materializer (a large merge-on-read batch) and by a repair of a
merge-on-read table."""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.table import Table

from ..faults import crash_point
from ..staging.store import ObjectStore, merge_batch_prefix
from .commit_properties import snapshot_properties
from .spark_sql import call_procedure, delete_keys_statement, insert_upserts_statement, spark_identifier, spark_string

log = logging.getLogger(__name__)

# The Iceberg branch a batch is written on before main is fast-forwarded to it; how many times a batch
# is written again when main moved meanwhile.
MERGE_BRANCH = "pg2iceberg_merge"
FAST_FORWARD_ATTEMPTS = 4


@contextlib.contextmanager
def spark_view(spark: Any, objects: ObjectStore, staging: str, rows: pa.Table) -> Iterator[str]:
    """``rows`` as a Spark temporary view, staged as a Parquet file under the table's staging folder
    ``staging`` that Spark reads back (executors need not reach the driver's memory), with the schema
    given when Spark has one for it: inferring it reads the file's footer in a Spark job of its own,
    which cost about as much CPU as a small MERGE's own jobs (bench/tables.py)."""
    batch_key = f"{merge_batch_prefix(staging)}{uuid.uuid4().hex}.parquet"
    sink = pa.BufferOutputStream()
    pq.write_table(rows, sink)
    objects.put(batch_key, sink.getvalue().to_pybytes())
    try:
        view = f"pg2iceberg_batch_{threading.get_ident()}"
        reader = spark.read
        schema = _spark_schema(rows.schema)
        if schema is not None:
            reader = reader.schema(schema)
        reader.parquet(objects.uri(batch_key)).createOrReplaceTempView(view)
        yield view
        spark.catalog.dropTempView(view)
    finally:
        objects.delete(batch_key)


def _spark_schema(schema: pa.Schema) -> Any | None:
    """``schema`` as the Spark schema Spark infers from a Parquet file written with it (a timestamp
    without time zone is Spark's TimestampNTZ), or None for a type PySpark does not map (then Spark
    infers it)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    try:
        return from_arrow_schema(schema, prefer_timestamp_ntz=True)
    except Exception:  # PySpark raises its own error types for an unmapped Arrow type
        return None


def write_on_branch(
    spark: Any,
    catalog: str,
    identifier: tuple[str, ...],
    table: Table,
    key: list[str],
    view: str,
    truncated: bool,
    properties: Mapping[str, str] | None = None,
) -> None:
    """Apply ``view`` (rows with the table's columns and the op column) on :data:`MERGE_BRANCH`, started
    at main's snapshot: delete its keys (every row when ``truncated``), append its upserts; then
    fast-forward main to it, one commit, so readers of main never see the keys deleted and not yet
    appended. Writing a batch again is harmless (its keys are deleted and appended again). Another
    writer's commit to main in between makes the fast-forward fail: the batch is written again from
    main's new snapshot. ``table`` is the Iceberg table as the batch was prepared against; ``properties``
    go into the summary of the append main is fast-forwarded to (see commit_properties)."""
    target = spark_identifier(catalog, *identifier)
    branch = spark_identifier(catalog, *identifier, f"branch_{MERGE_BRANCH}")
    columns = [f.name for f in table.schema().fields]
    refs = table.metadata.refs
    # Main's snapshot as this batch was read, and the branch left there by the last fast-forward.
    on_main = MERGE_BRANCH in refs and refs[MERGE_BRANCH].snapshot_id == refs["main"].snapshot_id
    for attempt in range(1, FAST_FORWARD_ATTEMPTS + 1):
        if not on_main:
            spark.sql(f"ALTER TABLE {target} CREATE OR REPLACE BRANCH {spark_identifier(MERGE_BRANCH)}")
        spark.sql(f"DELETE FROM {branch}" if truncated else delete_keys_statement(branch, view, key))
        with snapshot_properties(spark, properties or {}):
            spark.sql(insert_upserts_statement(branch, view, columns))
        crash_point("materializer.before_fast_forward")
        try:
            call_procedure(
                spark,
                catalog,
                "fast_forward",
                {
                    "table": spark_string(spark_identifier(*identifier)),
                    "branch": spark_string("main"),
                    "to": spark_string(MERGE_BRANCH),
                },
            )
            return
        except Exception as exc:
            if "not an ancestor" not in str(exc) or attempt == FAST_FORWARD_ATTEMPTS:
                raise
            log.info("%s: main moved while a batch was written on its branch; writing it again", target)
            on_main = False
