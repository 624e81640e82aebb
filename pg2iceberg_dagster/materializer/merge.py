"""Applying the staged log to Iceberg: read past ``mat_cursor``, fold, evolve schema, MERGE, advance.

One writer per table (a lease in ``consumer``); the cursor moves only after the Iceberg commit, so a
crash replays the last batch, which the fold makes harmless (upserts and deletes of final states).
A table is not merged before its snapshot is complete: an older snapshot row must never overwrite
a newer change.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from ..config import PipelineConfig, TableConfig
from ..coordination.store import CoordinationStore, LogEntry
from ..errors import SchemaChangeError
from ..faults import crash_point
from ..iceberg.catalog import evolve_schema, table_identifier
from ..iceberg.types import arrow_column, arrow_schema, text_loaders
from ..source.catalog import columns_added_with_default
from ..source.connection import connect
from ..staging.codec import DELETE, decode
from ..staging.store import ObjectStore
from .fold import FoldResult, fold
from .source_fill import fill_from_source

OP_COLUMN = "_op"
UNCHANGED_COLUMN = "_unchanged"


@dataclass
class MergeResult:
    """What one table's materialization did (also the Dagster metadata)."""

    table: str
    batches: int = 0
    changes: int = 0
    upserts: int = 0
    deletes: int = 0
    truncated: bool = False
    schema_changes: tuple[str, ...] = ()
    cursor: int = 0
    head: int = 0
    last_lsn: int | None = None
    snapshot_id: int | None = None
    waiting_for_snapshot: bool = False
    seconds: float = 0.0

    @property
    def lag(self) -> int:
        return self.head - self.cursor


def spark_identifier(*parts: str) -> str:
    """Backtick-quoted Spark SQL identifier."""
    return ".".join("`" + part.replace("`", "``") + "`" for part in parts)


def _spark_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def merge_statement(target: str, source_view: str, columns: list[str], key: list[str]) -> str:
    """MERGE INTO: delete, update (unchanged TOAST columns keep the target's value) or insert per key."""
    on = " AND ".join(f"t.{spark_identifier(k)} = s.{spark_identifier(k)}" for k in key)
    assignments = ", ".join(
        f"t.{spark_identifier(c)} = CASE WHEN array_contains(s.{UNCHANGED_COLUMN}, {_spark_string(c)}) "
        f"THEN t.{spark_identifier(c)} ELSE s.{spark_identifier(c)} END"
        for c in columns
        if c not in key
    )
    column_list = ", ".join(spark_identifier(c) for c in columns)
    values = ", ".join(f"s.{spark_identifier(c)}" for c in columns)
    update = f"WHEN MATCHED AND s.{OP_COLUMN} = 'U' THEN UPDATE SET {assignments} " if assignments else ""
    return (
        f"MERGE INTO {target} t USING {source_view} s ON {on} "
        f"WHEN MATCHED AND s.{OP_COLUMN} = 'D' THEN DELETE "
        f"{update}"
        f"WHEN NOT MATCHED AND s.{OP_COLUMN} = 'U' THEN INSERT ({column_list}) VALUES ({values})"
    )


def _spark_arrow_schema(schema: pa.Schema) -> pa.Schema:
    # Spark reads Iceberg uuid columns as strings and cannot read Parquet's UUID logical type.
    fields = [
        pa.field(f.name, pa.string()) if isinstance(f.type, pa.BaseExtensionType) else f.remove_metadata()
        for f in schema
    ]
    return pa.schema(fields)


def folded_arrow(folded: FoldResult, table: Table) -> pa.Table:
    """The folded rows as Arrow, typed like the Iceberg table, with ``_op`` and ``_unchanged``."""
    iceberg_arrow = arrow_schema(table.schema())
    spark_schema = _spark_arrow_schema(iceberg_arrow)
    columns = [field.name for field in iceberg_arrow]
    loaders_by_relation: dict[Any, dict[str, Callable[[bytes], Any]]] = {}
    values: dict[str, list[Any]] = {name: [] for name in columns}
    ops: list[str] = []
    unchanged: list[list[str]] = []
    for row in folded.rows.values():
        relation = row.relation
        if relation is not None and relation not in loaders_by_relation:
            loaders_by_relation[relation] = dict(
                zip((c.name for c in relation.columns), text_loaders(relation.columns), strict=True)
            )
        loaders = loaders_by_relation.get(relation, {})
        missing = [name for name in columns if name not in row.data and name not in row.unchanged]
        for name in columns:
            text = row.data.get(name)
            loader = loaders.get(name)
            if name in row.filled:
                values[name].append(row.filled[name])
            elif text is None or loader is None:
                values[name].append(None)
            else:
                values[name].append(loader(text.encode()))
        ops.append(row.op)
        unchanged.append(sorted((row.unchanged - row.filled.keys()) | (set(missing) if row.op != DELETE else set())))
    arrays = []
    for field, spark_field in zip(iceberg_arrow, spark_schema, strict=True):
        column_values = values[field.name]
        if isinstance(field.type, pa.BaseExtensionType):
            column_values = [None if v is None else str(v) for v in column_values]
        arrays.append(arrow_column(column_values, spark_field.type, field.name))
    arrays.append(pa.array(ops, pa.string()))
    arrays.append(pa.array(unchanged, pa.list_(pa.string())))
    schema = spark_schema.append(pa.field(OP_COLUMN, pa.string())).append(
        pa.field(UNCHANGED_COLUMN, pa.list_(pa.string()))
    )
    return pa.Table.from_arrays(arrays, schema=schema)


def fill_moved_keys(folded: FoldResult, table: Table, key: list[str]) -> None:
    """Fill unchanged columns of rows whose primary key changed from the old key's row in Iceberg."""
    moved = [row for row in folded.rows.values() if row.fill_from_key is not None and row.unchanged]
    if not moved:
        return
    schema = arrow_schema(table.schema())
    text_keys = {row.fill_from_key for row in moved}
    current: dict[tuple[str, ...], dict[str, Any]] = {}
    for record in table.scan().to_arrow().cast(schema).to_pylist():
        # Compare in text form: the staged key values are PostgreSQL text.
        record_key = tuple(_key_text(record[k]) for k in key)
        if record_key in text_keys:
            current[record_key] = record
    for row in moved:
        old = current.get(row.fill_from_key)  # type: ignore[arg-type]
        if old is not None:
            row.filled = {name: old[name] for name in row.unchanged if name in old}


def _key_text(value: Any) -> str:
    return str(value) if not isinstance(value, bool) else ("t" if value else "f")


class Materializer:
    """Merges each table's staged log into its Iceberg table through Spark."""

    def __init__(
        self,
        config: PipelineConfig,
        store: CoordinationStore,
        catalog: Catalog,
        spark_factory: Callable[[], Any],
        worker_id: str | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.catalog = catalog
        self.object_store = ObjectStore(config.staging)
        self._spark_factory = spark_factory
        self._spark: Any = None
        self.worker_id = worker_id or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.group = config.materialize.group

    @property
    def spark(self) -> Any:
        if self._spark is None:
            self._spark = self._spark_factory()
        return self._spark

    def lag(self, table_key: str) -> tuple[int, int]:
        """(cursor, head) of a table's staged log for this group."""
        return self.store.mat_cursor(self.group, table_key), self.store.log_head(table_key)

    def materialize_table(self, table_key: str, max_batches: int | None = None) -> MergeResult:
        """Apply the table's staged log up to its current head (or ``max_batches`` batches)."""
        started = time.monotonic()
        cursor, head = self.lag(table_key)
        result = MergeResult(table=table_key, cursor=cursor, head=head)
        state = self.store.table_state(table_key)
        if state is None or not state.snapshot_complete:
            result.waiting_for_snapshot = True
            return result
        if cursor >= head:
            return result
        with self.store.writer_lease(self.group, table_key, self.worker_id):
            while max_batches is None or result.batches < max_batches:
                cursor = self.store.mat_cursor(self.group, table_key)
                entries = self.store.log_entries(table_key, cursor, self.config.materialize.max_batch_changes)
                if not entries:
                    break
                self._apply_batch(table_key, cursor, entries, result, state.source_fill_until_lsn)
                result.batches += 1
        result.cursor, result.head = self.lag(table_key)
        result.seconds = time.monotonic() - started
        return result

    def _apply_batch(
        self,
        table_key: str,
        cursor: int,
        entries: list[LogEntry],
        result: MergeResult,
        source_fill_until_lsn: int | None,
    ) -> None:
        table_config = self.config.table(table_key)
        identifier = table_identifier(self.config, table_config)
        table = self.catalog.load_table(identifier)
        key = [table.schema().find_field(i).name for i in table.schema().identifier_field_ids]
        batches = []
        for entry in entries:
            relation, changes = decode(self.object_store.get(entry.path))
            # An entry may start before the cursor only if it was half applied; never the case as
            # the cursor always lands on an entry's end, but skip defensively by offset.
            skip = max(0, cursor - entry.start_offset)
            batches.append((relation, changes[skip:]))
        folded = fold(batches, key)
        fill_moved_keys(folded, table, key)
        if source_fill_until_lsn is not None and entries[0].first_lsn < source_fill_until_lsn:
            with connect(self.config.source) as conn:
                fill_from_source(conn, table_config.schema_name, table_config.table_name, folded, key)
        added = {c.name for relation in folded.relations for c in relation.columns} - set(table.schema().column_names)
        if added:
            self._refuse_defaulted_columns(table_config, added)
        changes = []
        for relation in folded.relations:
            changes.extend(evolve_schema(table, relation.columns))
        if changes:
            table = self.catalog.load_table(identifier)
        rows = folded_arrow(folded, table)
        spark = self.spark
        target = spark_identifier(self.config.iceberg.catalog.name, *identifier.split("."))
        if folded.truncated:
            spark.sql(f"DELETE FROM {target}")
        if rows.num_rows:
            batch_key = f"_batches/{table_key}/{uuid.uuid4().hex}.parquet"
            self.object_store.put(batch_key, _parquet_bytes(rows))
            try:
                view = f"pg2iceberg_batch_{threading.get_ident()}"
                spark.read.parquet(self.object_store.uri(batch_key)).createOrReplaceTempView(view)
                columns = [f.name for f in table.schema().fields]
                spark.sql(merge_statement(target, view, columns, key))
                spark.catalog.dropTempView(view)
            finally:
                self.object_store.delete(batch_key)
        table = self.catalog.load_table(identifier)
        snapshot = table.current_snapshot()
        last = entries[-1]
        crash_point("materializer.after_commit")
        self.store.advance_mat_cursor(
            self.group, table_key, last.end_offset, last.flushable_lsn, snapshot.snapshot_id if snapshot else None
        )
        deletes = sum(1 for row in folded.rows.values() if row.op == DELETE)
        result.changes += folded.changes
        result.deletes += deletes
        result.upserts += len(folded.rows) - deletes
        result.truncated = result.truncated or folded.truncated
        result.schema_changes += tuple(changes)
        result.last_lsn = last.flushable_lsn
        result.snapshot_id = snapshot.snapshot_id if snapshot else None

    def _refuse_defaulted_columns(self, table_config: TableConfig, added: set[str]) -> None:
        """Stop before a column added with a default reaches Iceberg: older rows hold the default in
        PostgreSQL without any WAL change, so merging on would leave them NULL in the mirror."""
        with connect(self.config.source) as conn:
            defaulted = columns_added_with_default(conn, table_config.schema_name, table_config.table_name, added)
        if defaulted:
            raise SchemaChangeError(
                f"{table_config.key}: column(s) {', '.join(defaulted)} were added with a default; rows that "
                "existed before the ALTER hold it without a WAL change, so the mirror cannot follow. Snapshot "
                f"the table again: pg2iceberg-dagster cleanup --table {table_config.key}, then snapshot. "
                "(Add the column without a default, then UPDATE, to keep replicating through such a change.)"
            )

    def run_once(self, table_keys: list[str] | None = None) -> dict[str, MergeResult]:
        """Bring every (or the given) table up to its current head."""
        return {key: self.materialize_table(key) for key in (table_keys or [t.key for t in self.config.tables])}


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()
