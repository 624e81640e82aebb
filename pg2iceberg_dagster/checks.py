"""Data checks on a mirrored table: one row per primary key, a schema that matches the source, and
content equal to the source at a consistent point (:class:`TableChecker` runs them over tables)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import AlwaysTrue, BooleanExpression
from pyiceberg.table import Table

from .config import PipelineConfig
from .coordination.store import CoordinationStore
from .iceberg.evolution import schema_follows_source
from .maintenance.health import summary_health
from .materializer.lanes import LaneConnections, on_lanes
from .source.catalog import SourceTable, TypeResolver, describe_table, modification_count
from .source.connection import consistent_read
from .source.lsn import current_wal_lsn
from .tables import MirroredTables
from .verify import KeySlice, TableDiff, choose_key_slice, compare_table, sliceable

# Statistics trail commits by up to a second: a content check looks at them again after this.
STATS_DELAY_SECONDS = 1.5
# A content check that found a difference waits this long at most for the flusher to stage past the
# comparison, to tell a change still in flight from a difference the mirror should not have.
IN_FLIGHT_WAIT_SECONDS = 10.0

ALL_ROWS = "all rows"


@dataclass(frozen=True)
class ContentCheck:
    """Rows compared with the source, or why not: changes still staged (``lag`` > 0), or
    ``not_compared``."""

    lag: int
    diff: TableDiff | None = None  # None when not compared
    # The source was written while it was compared: a difference is not at a consistent point.
    source_written_during_check: bool = False
    # Changes committed before the comparison may not have been merged yet (the flusher had not
    # staged past them, or staged some since): a difference may be the mirror's ordinary delay.
    changes_in_flight: bool = False
    not_compared: str = ""  # why a table with no lag was not compared

    @property
    def conclusive(self) -> bool:
        """Whether a difference found is one the mirror should not have (else it may be in flight)."""
        return not (self.source_written_during_check or self.changes_in_flight)


@dataclass(frozen=True)
class TableCheckReport:
    """Every check of one mirrored table."""

    duplicate_keys: int
    duplicate_examples: list[tuple]
    schema_problems: list[str]
    content: ContentCheck
    # The rows whose keys were checked, and the rows compared: all, or a key range of a large table.
    keys_checked: str = ALL_ROWS
    content_checked: str = ALL_ROWS


def duplicate_keys(table: Table, row_filter: BooleanExpression | None = None) -> tuple[int, list[tuple]]:
    """(number of primary keys that appear more than once, a few of them) in the Iceberg table's rows
    (those of ``row_filter``)."""
    schema = table.schema()
    key = [schema.find_field(field_id).name for field_id in schema.identifier_field_ids]
    rows = table.scan(row_filter=row_filter or AlwaysTrue(), selected_fields=tuple(key)).to_arrow()
    if rows.num_rows == 0:
        return 0, []
    counts = rows.group_by(key).aggregate([([], "count_all")])
    duplicated = counts.filter(pc.greater(counts["count_all"], 1))
    examples = [tuple(row[name] for name in key) for row in duplicated.slice(0, 5).to_pylist()]
    return duplicated.num_rows, examples


def schema_mismatches(source: SourceTable, table: Table) -> list[str]:
    """How the Iceberg schema differs from what the source columns map to (empty when it matches),
    by the rule schema evolution follows (see :func:`schema_follows_source`).

    Extra Iceberg columns are expected (columns dropped at the source are kept) and not reported.
    """
    problems = schema_follows_source(table, source.columns)
    schema = table.schema()
    key = {schema.find_field(field_id).name for field_id in schema.identifier_field_ids}
    if key != set(source.primary_key):
        problems.append(f"identifier fields {sorted(key)} differ from the primary key {list(source.primary_key)}")
    return problems


@dataclass(frozen=True)
class _CheckScope:
    """What a table's checks cover: every row, or a key range of a large table (see
    ``checks.compare_max_rows``); and why its content is not compared, if so."""

    key_slice: KeySlice | None = None
    slice_keys: bool = False  # the duplicate-key check too covers the slice only (with key_slice only)
    described: str = ALL_ROWS
    not_compared: str = ""

    def keys_filter(self) -> BooleanExpression | None:
        return self.key_slice.row_filter() if self.key_slice and self.slice_keys else None

    def report(
        self, duplicates: tuple[int, list[tuple]], problems: list[str], content: ContentCheck
    ) -> TableCheckReport:
        keys_checked = self.described if self.slice_keys else ALL_ROWS
        content_checked = self.described if content.diff is not None else ALL_ROWS
        return TableCheckReport(*duplicates, problems, content, keys_checked, content_checked)


@dataclass(frozen=True)
class _Compared:
    """A table checked and compared with the source; whether the source was written meanwhile (so
    whether a difference is conclusive) is read later."""

    duplicates: tuple[int, list[tuple]]
    schema_problems: list[str]
    scope: _CheckScope
    diff: TableDiff
    oid: int
    writes_before: int
    wal: int  # the source's WAL position as the comparison's snapshot was taken
    started: float


class TableChecker:
    """Runs the data checks over tables with a pipeline's parts (its tables, coordination store,
    catalog and kept source connection)."""

    def __init__(
        self,
        config: PipelineConfig,
        tables: MirroredTables,
        store: CoordinationStore,
        catalog: Catalog,
        source_connection: Callable[[], psycopg.Connection],
    ) -> None:
        self.config = config
        self.tables = tables
        self.store = store
        self.catalog = catalog
        self.source_connection = source_connection

    def check_tables(self, table_keys: list[str]) -> Iterator[tuple[str, TableCheckReport | Exception]]:
        """Per table, as each is done (or the error that stopped its checks): one row per primary key;
        the schema follows the source's columns as they are now; the rows equal the source's when
        nothing is left to merge, compared at one consistent point of the source. Tables are checked
        ``materialize.parallelism`` at a time. Whether the source was written during a comparison is
        read from its statistics, which trail commits: the tables compared share one wait for them."""
        compared: list[tuple[str, _Compared]] = []
        count = max(1, min(self.config.materialize.parallelism, len(table_keys)))
        open_lane = functools.partial(LaneConnections.open, self.config)
        for key, outcome in on_lanes(table_keys, count, open_lane, LaneConnections.close, self._check_table):
            if isinstance(outcome, _Compared):
                compared.append((key, outcome))
            else:
                yield key, outcome
        if not compared:
            return
        last_started = max(table.started for _, table in compared)
        time.sleep(max(0.0, STATS_DELAY_SECONDS - (time.monotonic() - last_started)))
        flushed = self._flushed_past(max((t.wal for _, t in compared if not t.diff.ok), default=None))
        conn = self.source_connection()
        for key, table in compared:
            written = modification_count(conn, table.oid) != table.writes_before
            # A change committed before the comparison but not merged: not staged yet when it was
            # compared (the flusher had not passed it), or staged since (the table lags again).
            lag = self.store.lag(self.config.materialize.group, key)
            in_flight = not table.diff.ok and (flushed < table.wal or lag.changes > 0)
            content = ContentCheck(0, table.diff, source_written_during_check=written, changes_in_flight=in_flight)
            yield key, table.scope.report(table.duplicates, table.schema_problems, content)

    def _flushed_past(self, lsn: int | None) -> int:
        """The flushed LSN, once it is at or past ``lsn`` or after :data:`IN_FLIGHT_WAIT_SECONDS`
        (no wait when ``lsn`` is None)."""
        deadline = time.monotonic() + IN_FLIGHT_WAIT_SECONDS
        while True:
            flushed = self.store.flushed_lsn() or 0
            if lsn is None or flushed >= lsn or time.monotonic() >= deadline:
                return flushed
            time.sleep(0.5)

    def _check_table(self, lane: LaneConnections, table_key: str) -> TableCheckReport | _Compared:
        """One table's checks (see :meth:`check_tables`); a comparison still waits for the statistics."""
        table = self.catalog.load_table(self.tables[table_key].iceberg)
        conn = lane.source()
        source = describe_table(conn, self.tables[table_key].config, TypeResolver(conn))
        problems = schema_mismatches(source, table)
        scope = self._check_scope(conn, source, table)
        duplicates = duplicate_keys(table, scope.keys_filter())
        lag = lane.store.lag(self.config.materialize.group, table_key)
        if lag.changes > 0 or scope.not_compared:
            return scope.report(duplicates, problems, ContentCheck(lag.changes, not_compared=scope.not_compared))
        writes_before = modification_count(conn, source.oid)
        started = time.monotonic()
        with consistent_read(conn):
            wal = current_wal_lsn(conn)  # the transaction's first query: its snapshot is taken here
            rule = self.config.values.out_of_range
            diff = compare_table(conn, source, table, rule, key_slice=scope.key_slice)
        return _Compared(duplicates, problems, scope, diff, source.oid, writes_before, wal, started)

    def _check_scope(self, conn: psycopg.Connection, source: SourceTable, table: Table) -> _CheckScope:
        """Every row, or above ``checks.compare_max_rows`` a key range of that many rows from a random
        key (each check another); its duplicate keys too above ``checks.unique_keys_max_rows``."""
        checks = self.config.checks
        rows = summary_health(table).records
        if rows <= checks.compare_max_rows:
            return _CheckScope()
        if not sliceable(source):
            return _CheckScope(
                not_compared=(
                    f"about {rows:,} rows, more than checks.compare_max_rows ({checks.compare_max_rows:,}), and a "
                    f"primary key that is not all integer columns cannot be compared a range at a time; "
                    f"`pg2iceberg-dagster verify --table {source.key}` compares the whole table"
                )
            )
        key_slice = choose_key_slice(conn, source, checks.compare_max_rows)
        if key_slice is None:  # the source is empty: nothing to slice
            return _CheckScope()
        described = f"{key_slice.describe()} ({checks.compare_max_rows:,} of about {rows:,} rows)"
        return _CheckScope(key_slice, rows > checks.unique_keys_max_rows, described)
