"""Batches written to Iceberg by pyiceberg in this process, without a Spark ``MERGE``.

A Spark ``MERGE`` costs about 0.2 CPU-seconds of planning and job start-up whatever its size, which
is most of what a small table's merge costs (bench/tables.py). Two kinds of batch skip it:

- **Inserts only** (any table): every change an INSERT adds a key the table does not hold, since the
  table equals the source as of the cursor and the source refused duplicate keys. The rows are one
  fast-append commit. A ``MERGE`` replayed after a crash is harmless, an append replayed would add
  the rows twice: so the append is taken only while the table's current snapshot is still the one
  the cursor was last advanced with (nothing committed past the cursor). A crash between the append
  and the cursor's advance leaves the snapshot moved on, and the replay does not append.
- **A small copy-on-write table** (``materialize.pyiceberg_max_rows``): one overwrite snapshot, the
  data files holding the batch's keys rewritten without them and with its upserts, as Spark's
  copy-on-write ``MERGE`` writes. Like the ``MERGE``, writing the batch again gives the same table.
  Only keys pyiceberg compares exactly (integers, text, dates) go this way.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.expressions.visitors import bind
from pyiceberg.io.pyarrow import (  # pyiceberg is pinned: its delete rewrites files with these too
    ArrowScan,
    _dataframe_to_data_files,
    _expression_to_complementary_pyarrow,
)
from pyiceberg.table import Table
from pyiceberg.types import DateType, IntegerType, LongType, StringType

from ..iceberg.catalog import refresh
from ..iceberg.commit import commit_with_retry
from ..iceberg.key_filter import key_filter
from ..iceberg.layout import sorted_rows
from ..iceberg.transaction import open_transaction, overwrite
from ..iceberg.types import as_table_rows
from ..staging.codec import DELETE
from .spark_sql import OP_COLUMN

# One pyiceberg write at a time in a process: they hold the GIL (manifests and metadata are Python
# objects), so the merge lanes of `run` gain nothing writing at once, and the flusher thread beside
# them waited for the GIL behind four of them (bench/tables.py: commit -> staged p50 15 s, 5 s before).
_ONE_WRITE_AT_A_TIME = threading.Lock()

# Key types whose values pyiceberg's filters compare exactly as PostgreSQL's equality does.
_EXACT_KEY_TYPES = (IntegerType, LongType, StringType, DateType)


def keys_compare_exactly(table: Table, key: Sequence[str]) -> bool:
    """Whether every key column of ``table`` has a type pyiceberg's key filter matches exactly."""
    schema = table.schema()
    return all(isinstance(schema.find_field(name).field_type, _EXACT_KEY_TYPES) for name in key)


def append_rows(table: Table, rows: pa.Table, properties: Mapping[str, str]) -> None:
    """Append ``rows`` (every column of ``table`` by name, typed as Iceberg stores them; other columns
    are left out) in one commit whose summary carries ``properties``."""
    typed = as_table_rows(table.schema(), rows)

    def commit() -> None:
        refresh(table)  # a concurrent commit (maintenance) is kept: appends commute with it
        with open_transaction(table) as appending:
            appending.append(sorted_rows(table.metadata, typed), snapshot_properties=dict(properties))

    with _ONE_WRITE_AT_A_TIME:
        commit_with_retry(commit)


def replace_keys(table: Table, rows: pa.Table, key: Sequence[str], properties: Mapping[str, str]) -> None:
    """Replace the rows of the keys of ``rows`` (one per key, with the ``OP_COLUMN``) by its upserts,
    in one overwrite snapshot whose summary carries ``properties``: every data file that holds one
    of the keys is rewritten without them, together with the upserts, as a copy-on-write ``MERGE``
    writes (appending the upserts apart would add a file at every merge)."""
    keys = list(zip(*(rows.column(name).to_pylist() for name in key), strict=True))
    upserts = as_table_rows(table.schema(), rows.filter(pc.not_equal(rows.column(OP_COLUMN), DELETE)))

    def commit() -> None:
        refresh(table)
        doomed = key_filter(key, keys)
        keep = _expression_to_complementary_pyarrow(bind(table.schema(), doomed, case_sensitive=True), table.schema())
        touched, kept = [], [upserts]
        # The files whose statistics may hold a key, each read with its position deletes applied.
        for task in table.scan(row_filter=doomed).plan_files():
            rows_of_file = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue()).to_table(tasks=[task])
            left = rows_of_file.filter(keep)
            if left.num_rows < rows_of_file.num_rows:
                touched.append(task.file)
                kept.append(left.cast(upserts.schema))
        written = pa.concat_tables(kept)
        if not touched and not written.num_rows:
            return
        # Nothing left to write when the batch deleted every row of the files it touched.
        files = (
            _dataframe_to_data_files(table.metadata, sorted_rows(table.metadata, written), table.io)
            if written.num_rows
            else []
        )
        with (
            open_transaction(table) as rewriting,
            overwrite(rewriting, table.io, properties) as rewrite,
        ):
            for data_file in touched:
                rewrite.delete_data_file(data_file)
            for data_file in files:
                rewrite.append_data_file(data_file)

    with _ONE_WRITE_AT_A_TIME:
        commit_with_retry(commit)
