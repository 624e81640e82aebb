"""Writing a mirrored table's history table (docs/history.md) in the merge step, after the live table.

Each write is one Spark ``MERGE INTO`` (one Iceberg commit) whose source rows either close the
current version of their key (valid-to set, current flag cleared) or are new versions. Its summary
records the snapshot epoch and the staged log offset the history holds up to (:data:`HISTORY_OFFSET`),
so a batch retried after a crash (between the live commit and this one, or before the cursor moved)
writes only what the history lacks: nothing twice, nothing lost.

The first versions (operation ``snapshot``) are written from the live table by the first merge of a
snapshot epoch, before any streamed change of that epoch, when the live table is still the copy; a
resync's new epoch closes the versions current until then at the copy's LSN.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from ..config import ChangeMetadataConfig, OutOfRange
from ..coordination.records import SnapshotEpoch
from ..errors import Pg2IcebergError, ResyncRequiredError
from ..iceberg.catalog import snapshot_summaries
from ..iceberg.change_metadata import deletion_columns
from ..iceberg.commit import commit_with_retry
from ..iceberg.history import (
    HISTORY_EPOCH,
    HISTORY_OFFSET,
    SNAPSHOT,
    HistoryColumns,
    HistoryPosition,
    ensure_history_table,
    history_position,
    source_fields,
)
from ..iceberg.types import arrow_schema
from ..staging.store import ObjectStore
from ..tables import MirroredTable
from .align import StagedBatch
from .arrow_rows import rows_arrow
from .branch import spark_view
from .change_stamp import LSN_TYPE, TIME_TYPE
from .commit_properties import commit_properties_available, snapshot_properties
from .fold import UPSERT, FoldedRow
from .history_versions import BatchVersions, batch_versions
from .spark_sql import OP_COLUMN, UNCHANGED_COLUMN, spark_identifier, spark_string

CLOSE_COLUMN = "_pg2iceberg_close"
FILL_PREFIX = "_pg2iceberg_fill_"
# The live table's commits that leave it equal to the source as of a snapshot epoch: the snapshot's
# chunks (snapshot/chunks.py), a resync's switch (snapshot/resync.py), a repair's write (repair.py).
_COPY_COMMITS = ("pg2iceberg.snapshot-epoch", "pg2iceberg.resync-epoch", "pg2iceberg.repair-epoch")


class HistoryWriter:
    """Writes one table's history table on the merge's Spark session."""

    def __init__(
        self,
        spark: Any,
        catalog: Catalog,
        catalog_name: str,
        objects: ObjectStore,
        mirrored: MirroredTable,
        settings: ChangeMetadataConfig,
        rule: OutOfRange,
        location: str | None,
        properties: Mapping[str, str],
    ) -> None:
        """``location`` and ``properties``: where a new history table's files go (None: the catalog's
        default) and the table properties it starts with."""
        assert mirrored.history is not None
        self.spark, self.catalog, self.objects, self.mirrored = spark, catalog, objects, mirrored
        self.settings, self.rule, self.location, self.properties = settings, rule, location, properties
        self.identifier = mirrored.history
        self.target = spark_identifier(catalog_name, *mirrored.history)
        self.live_target = spark_identifier(catalog_name, *mirrored.iceberg)

    def table(self, live: Table) -> Table:
        """The history table, created or following the live table's columns."""
        if not commit_properties_available(self.spark):
            raise Pg2IcebergError(
                f"table {self.mirrored.key}: its history table records what it holds in the summary of its commits, "
                "and this Spark session cannot set commit properties (a warm driver's gateway, or not Spark "
                "classic); set spark.warm_server: false, or turn history off for the table"
            )
        return ensure_history_table(
            self.catalog, self.identifier, live, self.settings, self.mirrored.key, self.location, self.properties
        )

    def seed(self, history: Table, live: Table, key: list[str], epoch: SnapshotEpoch | None, cursor: int) -> Table:
        """Write the first versions of the epoch's copy (the live table as the snapshot left it), closing
        the versions current before it at the copy's LSN, unless the history already holds this epoch."""
        number = epoch.epoch if epoch is not None else 0
        held = history_position(history)
        if held.epoch == number:
            return history
        # The live table is the copy while no batch of the epoch was merged: the cursor has not moved
        # since the history was last written (or the copy's own commit is the live table's last).
        summaries = snapshot_summaries(live)
        copied = not summaries or any(summaries[-1].get(name) == str(number) for name in _COPY_COMMITS)
        if not copied and held.offset != cursor:
            raise ResyncRequiredError(
                self.mirrored.key,
                "its history table was turned on (or lost) after its rows were merged past the snapshot, so its "
                "first versions cannot be written exactly; a resync writes them from a fresh copy",
            )
        lsn = epoch.lsn_bound if epoch is not None else 0
        columns, own = self._columns(history), HistoryColumns.recorded(history)
        live_names = {field.name for field in source_fields(live)}
        deletion = deletion_columns(live)
        alive = f" WHERE {spark_identifier(deletion.deleted_at)} IS NULL" if deletion else ""
        values = [spark_identifier(c) if c in live_names else "NULL" for c in columns]
        values += [f"CAST({lsn} AS BIGINT)", "CAST(NULL AS TIMESTAMP)", "CAST(NULL AS BIGINT)"]
        values += ["CAST(NULL AS TIMESTAMP)", spark_string(SNAPSHOT), "true", "false"]
        inserts = f"SELECT {', '.join(values)} FROM {self.live_target}{alive}"
        closings = self._close_current(columns, own, lsn, None, None)
        self._merge(history, f"{closings} UNION ALL {inserts}", key, HistoryPosition(number, cursor))
        return self.catalog.load_table(self.identifier)

    def position(self, history: Table, cursor: int) -> HistoryPosition:
        """What the history holds; refused (a resync) when it lacks versions merged into the live table."""
        position = history_position(history)
        if position.offset < cursor:
            raise ResyncRequiredError(
                self.mirrored.key,
                f"its history table holds the staged changes up to offset {position.offset} only, and the mirror "
                f"merged them up to {cursor} (history turned off and on again?); a resync starts its history anew",
            )
        return position

    def write(
        self,
        history: Table,
        position: HistoryPosition,
        staged: Callable[[int], list[StagedBatch]],
        end_offset: int,
        key: list[str],
    ) -> None:
        """Add the versions of the batch's changes from ``position.offset`` to ``end_offset``
        (``staged(offset)`` gives them aligned to the live table), unless the history holds them."""
        if position.offset >= end_offset:
            return
        versions = batch_versions(staged(position.offset), key)
        if not versions.versions and not versions.closings and versions.truncated is None:
            self._merge(history, None, key, HistoryPosition(position.epoch, end_offset))
            return
        columns, own = self._columns(history), HistoryColumns.recorded(history)
        rows = self._version_rows(history, versions, key, own)
        with spark_view(self.spark, self.objects, self.mirrored.staging, rows) as view:
            source = _versions_select(view, self.target, columns, key, own)
            if versions.truncated is not None:
                truncated = versions.truncated
                closings = self._close_current(columns, own, truncated.lsn, truncated.at, (view, key))
                source = f"{source} UNION ALL {closings}"
            self._merge(history, source, key, HistoryPosition(position.epoch, end_offset))

    def _columns(self, history: Table) -> list[str]:
        own = set(HistoryColumns.recorded(history).names)
        return [field.name for field in history.schema().fields if field.name not in own]

    def _version_rows(self, history: Table, versions: BatchVersions, key: list[str], own: HistoryColumns) -> pa.Table:
        """The batch's versions, then its closings, as Arrow typed like the history table."""
        closings = versions.closings
        rows = [version.row for version in versions.versions]
        rows += [FoldedRow(UPSERT, dict(zip(key, c.key, strict=True)), relation=c.relation) for c in closings]
        typed = rows_arrow(rows, history, self.rule, own.names).drop_columns([OP_COLUMN, UNCHANGED_COLUMN])
        # Only the unchanged TOAST values are filled (a column the change lacks is NULL in its version).
        unchanged = [sorted(row.unchanged - row.filled.keys()) for row in rows]
        typed = typed.append_column(UNCHANGED_COLUMN, pa.array(unchanged, pa.list_(pa.string())))
        fill_rows = [
            FoldedRow(UPSERT, dict(zip(key, row.fill_from_key or (), strict=False)), relation=row.relation)
            for row in rows
        ]
        fills = rows_arrow(fill_rows, history, self.rule, own.names).select(key)
        for name in key:
            typed = typed.append_column(FILL_PREFIX + name, fills.column(name))
        added = [None] * len(closings)
        new = versions.versions
        own_values: list[tuple[str, pa.Array]] = [
            (own.valid_from_lsn, pa.array([v.row.commit_lsn for v in new] + added, LSN_TYPE)),
            (own.valid_from_at, pa.array([v.row.committed_at for v in new] + added, TIME_TYPE)),
            (own.valid_to_lsn, pa.array([v.valid_to_lsn for v in new] + [c.lsn for c in closings], LSN_TYPE)),
            (own.valid_to_at, pa.array([v.valid_to_at for v in new] + [c.at for c in closings], TIME_TYPE)),
            (own.operation, pa.array([v.operation for v in new] + added, pa.string())),
            (own.current, pa.array([v.valid_to_lsn is None for v in new] + added, pa.bool_())),
            (CLOSE_COLUMN, pa.array([False] * len(new) + [True] * len(closings), pa.bool_())),
        ]
        for name, values in own_values:
            typed = typed.append_column(name, values)
        return typed

    def _close_current(
        self,
        columns: list[str],
        own: HistoryColumns,
        lsn: int,
        at: datetime | None,
        except_closed_in: tuple[str, list[str]] | None,
    ) -> str:
        """A SELECT of closing rows for the current history rows, ending at ``lsn`` and ``at``: all of
        them, or those whose key no closing row of the view ``except_closed_in`` names."""
        current = f"(SELECT * FROM {self.target} WHERE {spark_identifier(own.current)}) p"
        if except_closed_in is not None:
            view, key = except_closed_in
            keys = ", ".join(spark_identifier(k) for k in key)
            on = " AND ".join(f"p.{spark_identifier(k)} = c.{spark_identifier(k)}" for k in key)
            current += f" LEFT ANTI JOIN (SELECT {keys} FROM {view} WHERE {CLOSE_COLUMN}) c ON {on}"
        at_sql = f"timestamp_micros({int(at.timestamp() * 1_000_000)})" if at is not None else "CAST(NULL AS TIMESTAMP)"
        values = [f"p.{spark_identifier(c)}" for c in columns]
        values += [f"p.{spark_identifier(own.valid_from_lsn)}", f"p.{spark_identifier(own.valid_from_at)}"]
        values += [f"CAST({lsn} AS BIGINT)", at_sql, f"p.{spark_identifier(own.operation)}", "false", "true"]
        return f"SELECT {_aliased(values, [*columns, *own.names, CLOSE_COLUMN])} FROM {current}"

    def _merge(self, history: Table, source: str | None, key: list[str], position: HistoryPosition) -> None:
        """Run the history MERGE of ``source`` (None: nothing to change, only the position to record)
        with the position in its commit's summary."""
        properties = {HISTORY_EPOCH: str(position.epoch), HISTORY_OFFSET: str(position.offset)}
        if source is None:
            empty = pa.Table.from_pylist([], schema=arrow_schema(history.schema()))
            commit_with_retry(lambda: history.refresh().append(empty, snapshot_properties=properties))
            return
        statement = history_merge_statement(self.target, source, self._columns(history), key, history)
        with snapshot_properties(self.spark, properties):
            self.spark.sql(statement)


def _aliased(values: list[str], names: list[str]) -> str:
    """``value AS name, ...``: the first SELECT of a UNION names its columns."""
    return ", ".join(f"{value} AS {spark_identifier(name)}" for value, name in zip(values, names, strict=True))


def _versions_select(view: str, target: str, columns: list[str], key: list[str], own: HistoryColumns) -> str:
    """The view's rows, each unchanged TOAST value taken from the current history row of its fill key."""
    values = [
        f"CASE WHEN array_contains(v.{UNCHANGED_COLUMN}, {spark_string(c)}) THEN p.{spark_identifier(c)} "
        f"ELSE v.{spark_identifier(c)} END"
        for c in columns
    ]
    values += [f"v.{spark_identifier(name)}" for name in [*own.names, CLOSE_COLUMN]]
    on = " AND ".join(f"p.{spark_identifier(k)} = v.{spark_identifier(FILL_PREFIX + k)}" for k in key)
    return (
        f"SELECT {_aliased(values, [*columns, *own.names, CLOSE_COLUMN])} FROM {view} v "
        f"LEFT JOIN (SELECT * FROM {target} WHERE {spark_identifier(own.current)}) p ON {on}"
    )


def history_merge_statement(target: str, source: str, columns: list[str], key: list[str], history: Table) -> str:
    """MERGE INTO a history table from the query ``source`` (the columns, the six own ones, then
    :data:`CLOSE_COLUMN`): a closing row ends the current version of its key, the others are inserted."""
    own = HistoryColumns.recorded(history)
    on = " AND ".join(f"t.{spark_identifier(k)} = s.{spark_identifier(k)}" for k in key)
    ends = ", ".join(f"t.{spark_identifier(c)} = s.{spark_identifier(c)}" for c in (own.valid_to_lsn, own.valid_to_at))
    names = [*columns, *own.names]
    column_list = ", ".join(spark_identifier(c) for c in names)
    values = ", ".join(f"s.{spark_identifier(c)}" for c in names)
    return (
        f"MERGE INTO {target} t USING ({source}) s ON s.{CLOSE_COLUMN} AND {on} AND t.{spark_identifier(own.current)} "
        f"WHEN MATCHED THEN UPDATE SET {ends}, t.{spark_identifier(own.current)} = false "
        f"WHEN NOT MATCHED AND NOT s.{CLOSE_COLUMN} THEN INSERT ({column_list}) VALUES ({values})"
    )
